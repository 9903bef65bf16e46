"""Picking the prompt's context block from the workspace, for one editor and its current file.

Two ways: "recent" (snippets of the recently touched files of the same language, ordered by
path) and "retrieval" (the chunks of the repository index the code around the cursor needs,
retrieval.Selector's sticky block). Either depends only on other files (and, for retrieval, on
the current file outside the prompt's own window), so typing seldom changes it and the context
block's KV stays cached across keystrokes. Every file or chunk chosen is logged at debug level:
that log is the record of what left the editor for the model.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from typing import cast

from completiond.completion import retrieval
from completiond.completion.privacy import _inside
from completiond.completion.selection import Selector
from completiond.completion.workspace.folders import Folders
from completiond.completion.workspace.gate import Gate
from completiond.completion.workspace.store import DISK, DocumentStore, Entry

log = logging.getLogger(__name__)

MAX_TOKEN_COUNTS = 2048
MAX_BLOCK_STATES = 256


class ContextPicker:
    """snippet_lines: lines of a recent file's snippet; max_files: recent files per block."""

    def __init__(self, store: DocumentStore, folders: Folders, gate: Gate, snippet_lines: int = 60, max_files: int = 4):
        self.store = store
        self.folders = folders
        self.gate = gate
        self.snippet_lines = snippet_lines
        self.max_files = max_files
        self.selector = Selector()
        self.block_changes = 0  # retrieval blocks that differed from the last one for the same file
        self._last_block: dict[tuple, tuple] = {}
        self._token_counts: OrderedDict[str, int] = OrderedDict()

    def counter(self, count_tokens: Callable[[str], int] | None) -> Callable[[str], int]:
        """count_tokens, cached (the same snippets are counted request after request); chars / 4 if None."""
        if count_tokens is None:
            return lambda s: (len(s) + 3) // 4

        def cached(s: str) -> int:
            n = self._token_counts.get(s)
            if n is None:
                n = count_tokens(s)
                self._token_counts[s] = n
                if len(self._token_counts) > MAX_TOKEN_COUNTS:
                    self._token_counts.popitem(last=False)
            else:
                self._token_counts.move_to_end(s)
            return n

        return cached

    # -- recent files ------------------------------------------------------
    def recent(
        self,
        current: str | None,
        language: str | None,
        budget_tokens: int,
        count: Callable[[str], int],
        owner: Hashable,
        exclude: tuple[str, ...],
        roots: Iterable[str] = (),
    ) -> list[tuple[str, str]]:
        """Among `owner`'s open documents and the disk files under `owner`'s folders, the most recently
        touched files of `language` other than the current one (open documents first) that the gate
        admits (contextExclude `exclude` included): a snippet of each (around the last edit, else the
        file's head), fitted into budget_tokens, ordered by path."""
        store = self.store
        with store.lock:
            mine = self.folders.of(owner, roots)
            visible: dict[str, Entry] = {}
            for (who, path), e in store.entries.items():
                if path == current or (language is not None and e.language != language):
                    continue
                if who == owner and who is not DISK:
                    visible[path] = e  # the editor's own copy wins over the disk's
                elif who is DISK and path not in visible and any(_inside(path, root) for root in mine):
                    visible[path] = e
            candidates = sorted(visible.values(), key=lambda e: (not e.open, -e.touched, e.path))
        picked: list[tuple[Entry, str]] = []
        for e in candidates:  # outside the lock: the gate may read a folder's .gitignore files
            if len(picked) >= self.max_files:
                break
            # The one gate (privacy.py): an open hidden, ignored, excluded or outside document is the
            # editor's own business, never context for another file.
            if not self.gate.admit(e.path, mine, exclude, read_from_disk=not e.open).remote_ok:
                continue
            picked.append((e, self._snippet(e)))
        chosen: list[tuple[str, str]] = []
        used = 0
        for e, snippet in picked:
            rel = self.folders.relpath(e.path)
            cost = count(f"{rel}\n{snippet}") + 2
            if used + cost > budget_tokens:
                snippet = _fit(rel, snippet, budget_tokens - used - 2, count)
                if not snippet:
                    continue
                cost = count(f"{rel}\n{snippet}") + 2
            chosen.append((rel, snippet))
            used += cost
            log.debug(
                "context for %s (editor %s): %s, %s copy, %d characters",
                current,
                owner,
                e.path,
                "editor's" if e.open else "disk",
                len(snippet),
            )
        chosen.sort()
        return chosen

    def _snippet(self, e: Entry) -> str:
        lines = e.text.splitlines(keepends=True)
        n = self.snippet_lines
        if e.edit_line is None or len(lines) <= n:
            start = 0
        else:
            # Window around the last edit, snapped to a multiple of n/2 lines so
            # small cursor moves in that file do not change the snippet.
            half = max(1, n // 2)
            start = max(0, min(len(lines) - n, (e.edit_line // half) * half - half // 2))
        return "".join(lines[start : start + n])

    # -- retrieval ---------------------------------------------------------
    def retrieve(
        self,
        current: str | None,
        language: str | None,
        text: str,
        offset: int,
        budget_tokens: int,
        count: Callable[[str], int],
        owner: Hashable,
        exclude: tuple[str, ...],
        window_tokens: tuple[int, int],
        roots: Iterable[str] = (),
    ) -> list[tuple[str, str]]:
        """(relative path, chunk) pairs for the cursor at `offset` in `text` (the current document).

        Candidates are the index's chunks of `language` that `owner` may see: its own open
        documents and the disk files under its folders (a disk copy gives way to the editor's),
        minus the contextExclude patterns; the current file's own chunks count, except those the
        prompt's window (window_tokens before and after the cursor) already shows, and never its
        disk copy (the request's text is the current version). Definitions of the names at the
        cursor come first, then BM25 over the identifiers around the cursor; the block is sticky
        (retrieval.Selector), so typing changes it only when its chunks change.
        """
        before_chars, after_chars = (4 * max(0, int(t)) for t in window_tokens)
        lo = text.count("\n", 0, max(0, offset - before_chars))
        hi = text.count("\n", 0, min(len(text), offset + after_chars)) + 1
        store = self.store
        query = retrieval.make_query(text, offset, language=language, path=current)
        query.window = (lo, hi)
        with store.lock:
            mine = self.folders.of(owner, roots)
            cur_key = (owner, current) if current is not None and (owner, current) in store.entries else None
            verdicts: dict[Hashable, bool] = {}

            def allowed(c: retrieval.Chunk) -> bool:
                ok = verdicts.get(c.key)
                if ok is None:
                    ok = verdicts[c.key] = self._retrievable(c, owner, current, language, mine, exclude)
                return ok

            def cost(c: retrieval.Chunk) -> int:
                return count(f"{self.folders.relpath(c.path)}\n{c.text}") + 2

            chosen = self.selector.select(store.index, (owner, current), query, allowed, cur_key, cost, budget_tokens)
            block = tuple(c.id for c in chosen)
            if self._last_block.get((owner, current), ()) != block:
                self.block_changes += 1
                self._last_block[(owner, current)] = block
                if len(self._last_block) > MAX_BLOCK_STATES:
                    self._last_block.pop(next(iter(self._last_block)))
            out = [(self.folders.relpath(c.path), c.text) for c in chosen]
            for c in chosen:
                log.debug("context for %s (editor %s): %s lines %d-%d", current, owner, c.path, c.start + 1, c.end)
        return out

    def _retrievable(
        self,
        c: retrieval.Chunk,
        owner: Hashable,
        current: str | None,
        language: str | None,
        mine: list[str],
        exclude: tuple[str, ...],
    ) -> bool:
        who, path = cast(tuple[Hashable, str], c.key)
        if language is not None and c.language != language:
            return False
        if who is DISK:
            if path == current or (owner, path) in self.store.entries:
                return False
        elif who != owner:
            return False
        # The one gate (privacy.py), for this editor's folders and contextExclude: cached, since a query
        # asks it for every file with a matching chunk (cleared when folders or ignore rules change).
        return self.gate.context_ok(path, mine, exclude)


def _fit(rel: str, snippet: str, budget: int, count: Callable[[str], int]) -> str:
    lines = snippet.splitlines(keepends=True)
    while lines and count(rel + "\n" + "".join(lines)) > budget:
        lines = lines[: len(lines) // 2] if len(lines) > 8 else lines[:-1]
    return "".join(lines)
