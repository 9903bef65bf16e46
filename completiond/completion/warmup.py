"""Background warm-ups of a document's prompt heads: what its next requests will start with, prefilled into
the engine's prefix cache while the engine has nothing else to do (serving/prefetch.py schedules them).

With a prefix-first FIM layout (every family but the bundled model's suffix-first one) a prompt is the
context block, the FIM prefix token, then the text above the cursor from the window's anchor
(completion/plan.py), then the cursor line and the suffix. What comes before the cursor line does not
depend on where on its line, or on which line of a region, the cursor is. A `Warmup` prefills those heads:
the cursor line's first (then the whole prompt at the resting cursor itself), then for cursors at line starts one
chunk apart, walking down from the cursor (from the top for a file just opened) and then up, a few windows' worth
at most, in small engine chunks (`Engine.warm`), one piece per `step`. A request there later finds its prompt's
head cached and prefills only the cursor line and the suffix. The KV is the one a cold prefill computes (a token's KV depends only on the tokens before it), so
suggestions are those of a cold prefill of the same prompt.

A suffix-first layout (the bundled model's) puts the suffix, which moves with the cursor, first: no other cursor's
prompt shares its head, so there is no walk. Where the cursor rests, though, the next request's prompt is known
but for the cursor line, which typing there changes: `suffix, FIM middle, context, the window above` (typing at
the cursor leaves the suffix as it is). A rest's warm-up (offset given) prefills that prompt, once, whole: a request
at the rested cursor reuses all of it, one typed there all but the cursor line.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

WALK_WINDOWS = 4  # prefix windows' worth of tokens one warm-up prefills at most
CAPACITY_SLACK = 256  # tokens a sequence may grow by beyond what is prefilled (its capacity steps)


def tag_cache(engine: Any, path: str | None) -> None:
    """Tell the engine's prefix cache whose prompts it is given back next (PrefixCache.group): it evicts older
    prompts of a document before another document's last one. Engines without such a cache are left alone."""
    cache = getattr(engine, "cache", None)
    if cache is not None and hasattr(cache, "group"):
        cache.group = path


class Warmup:
    """One document's walk (worker thread only). `step(cancel)` does one bounded piece; False when done."""

    def __init__(
        self,
        engine: Any,
        builder: Any,
        text: str,
        offset: int | None,
        context: Sequence[tuple[str, str]] = (),
        path: str | None = None,
        language: str | None = None,
    ):
        self.engine, self.builder, self.text = engine, builder, text
        self.context, self.path, self.language = list(context), path, language
        # (offset, whole): where to build a prompt, and whether to warm all of it (the prompt at the resting cursor
        # itself: a request there reuses all but its last token) or only its head. Suffix-first: only that one
        # (nothing for a file just opened); prefix-first: the cursor line's head, that prompt, then the walk.
        self.at_cursor = bool(getattr(builder.template, "spm", False)) and builder.encoder.supports_suffix
        self.lines: list[tuple[int, bool]]
        if self.at_cursor:
            self.lines = [(offset, True)] if offset is not None else []
        else:
            walk = [(at, False) for at in walk_lines(text, offset, builder.options.chunk_lines)]
            self.lines = walk[:1] + [(offset, True)] + walk[1:] if offset is not None else walk
        self.targets: list[tuple[list[int], bool]] = []  # (ids, whether they are the whole prompt at the cursor)
        self.cursor_warm = False  # that prompt is all cached: a request there runs only its last token
        self.budget = WALK_WINDOWS * builder.budgets(bool(context))[0]
        self.warmed = 0  # tokens prefilled
        self.done_targets = 0
        # False (the prefetcher says: a note older than one walked before): prefill only into the prefix cache's
        # free room, never evicting a newer document's prefixes for this one's.
        self.may_evict = True
        self.stopped_full = False

    def step(self, cancel: Any = None) -> bool:
        while self.lines and not self.targets:
            at, whole = self.lines.pop(0)
            prompt = self.builder.build(self.text, at, context=self.context, path=self.path, language=self.language)
            ids = list(prompt.ids) if whole else head_ids(prompt, at_cursor=self.at_cursor)
            if ids:
                self.targets.append((ids, whole))
        if not self.targets or self.budget <= 0:
            return False
        ids, whole = self.targets[0]
        limit = min(self.budget, 4 * self.engine.prefill_chunk)
        if not self.may_evict and not has_room(getattr(self.engine, "cache", None), min(limit, len(ids))):
            self.stopped_full = True
            return False
        tag_cache(self.engine, self.path)  # as a request's prompts are (LocalCompleter.complete)
        warmed, cached = self.engine.warm(ids, cancel, limit=limit)
        if cached >= len(ids):
            self.targets.pop(0)
            self.cursor_warm = self.cursor_warm or whole
            self.done_targets += 1
        self.budget -= warmed
        self.warmed += warmed
        return bool(self.targets or self.lines) and self.budget > 0


def has_room(cache: Any, tokens: int) -> bool:
    """Whether the prefix cache holds `tokens` more (and a capacity step) without evicting anything, at the bytes
    per token its sequences take now (an empty cache, or one without stats: yes, nothing there to evict)."""
    stats = cache.stats() if cache is not None and hasattr(cache, "stats") else None
    if not stats or not stats.get("tokens"):
        return True
    per_token = stats["bytes"] / stats["tokens"]
    return stats["bytes"] + (tokens + CAPACITY_SLACK) * per_token <= stats["budget_bytes"]


def head_ids(prompt: Any, at_cursor: bool = False) -> list[int]:
    """The ids of `prompt` before its cursor line, when nothing among them depends on the cursor (a
    prefix-first layout: context, FIM prefix token, the window above the cursor line); [] otherwise (a
    suffix-first layout starts with the suffix; a skipped prompt has no ids). at_cursor: the prompt is at the
    very cursor a request will come from (a rest), so a suffix-first head counts too: all but the cursor line."""
    ids, prefix, suffix = list(prompt.ids), list(prompt.prefix_ids), list(prompt.suffix_ids)
    if not ids or not prefix:
        return []
    if ids[len(ids) - len(prefix) :] == prefix:  # the prefix ends the prompt: suffix-first, or no FIM at all
        return [] if suffix and not at_cursor else ids[: len(ids) - int(prompt.cursor_line_tokens)]
    end = len(ids) - len(suffix) - 2  # prefix-first: <prefix> P <suffix> S <middle>
    if end < len(prefix) or ids[end - len(prefix) : end] != prefix:
        return []
    return ids[: end - int(prompt.cursor_line_tokens)]


def walk_lines(text: str, offset: int | None, chunk_lines: int) -> list[int]:
    """Document offsets of line starts to warm at: the cursor's own line first (the head of any request on
    it: the window's anchor below may differ), then line starts one chunk apart from the cursor's chunk down
    to the end, then up from it (a file just opened, offset None: from the top down)."""
    starts = [0]
    n = max(1, chunk_lines)
    pos, line = 0, 0
    while True:
        pos = text.find("\n", pos)
        if pos < 0:
            break
        pos += 1
        line += 1
        if line % n == 0:
            starts.append(pos)
    if offset is None:
        return starts[1:] + starts[:1]
    here = sum(1 for s in starts if s <= offset) - 1
    own = text.rfind("\n", 0, max(0, offset)) + 1
    rest = starts[here + 1 :] + starts[here::-1][1:]
    return [own] + [s for s in rest if s != own]
