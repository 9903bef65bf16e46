"""The prompt plan: what of the document (and which context files) a completion's prompt holds, and
where, decided once for the local engine and a team server alike.

`Planner.plan(text, cursor, ...)` cuts the windows and returns a `PromptPlan`: document ranges for
the context block, the prefix pieces, the cursor line and the suffix pieces, plus the FIM template
they are laid out in. It measures every piece through an `Encoder`, in the encoder's units: the
local engine's `TokenEncoder` (completion/prompt.py) counts token ids and renders the plan as ids;
the team server's `TextEncoder` (completion/text_prompt.py) counts characters and renders it as text. The
window rules are therefore the same on both sides:

* the prefix is measured in pieces that never change while the user types on a line: whole chunks
  of `chunk_lines` lines aligned to absolute line numbers (multiples of chunk_lines), the lines of
  the cursor's chunk above the cursor line, and the cursor line up to the cursor. Appending a
  character re-measures (re-tokenizes) only the cursor line.
* the prefix window starts on a chunk boundary and is chosen with slack for the cursor line
  (`reserve`), so it does not slide on every keystroke; at the top of the file where the budget
  reaches it, else at an anchor: the roundest chunk boundary (divisible by the largest power of two)
  that leaves at least half the budget, which stays put while the cursor moves within about half a
  window, so a jump reuses the cached KV of the prefix it shares. Where the window starts is decided
  in `Planner._head` alone.
* only a bounded character window around the cursor is ever measured, so a huge document costs no
  more than a small one.

Offsets are Python string indices (code points); converting editor positions (UTF-16 in LSP) is the
caller's job.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from completiond.completion.languages import comment_for
from completiond.config import Config

# Upper bound on characters per token used to size the text windows before measuring: code averages
# 3-4, indentation runs a bit more. Too large only costs tokenizer time; too small would starve the budget.
CHARS_PER_TOKEN = 6
FOLLOWING_CHARS = 4000  # text after the cursor line the stop rules see (duplicate-line checks)


@dataclass(frozen=True)
class PromptOptions:
    prefix_tokens: int = 1024
    suffix_tokens: int = 256
    context_tokens: int = 256
    # Most of a capped prompt (max_prompt_tokens) the context block may take: what is left goes to
    # the suffix (a quarter) and the prefix. 0.4 measured best for retrieval with the bundled model
    # (512-token training context; eval --context on toolz, tenacity, structlog: 0.25, 0.3, 0.4, 0.55).
    context_share: float = 0.4
    chunk_lines: int = 16  # the prefix window starts on a multiple of this line number
    max_prompt_tokens: int | None = None  # model context minus generation room; None = no extra cap
    max_document_chars: int = 8 * 1024 * 1024
    max_line_chars: int = 2000  # longer lines mean minified/generated text: no suggestion there
    heal: bool = True
    multiline: str = "auto"  # the stop rules' multi-line policy (the multiline setting)
    max_lines: int = 8

    @classmethod
    def from_config(cls, cfg: Config, max_context: int | None = None, **overrides: Any) -> "PromptOptions":
        """Options from a completiond Config (prefixTokens, suffixTokens, workspaceContext, contextTokens)."""
        max_prompt = None
        if max_context:
            max_prompt = max(16, max_context - int(getattr(cfg, "max_tokens", 64)))
        kw: dict[str, Any] = dict(
            prefix_tokens=int(cfg.prefix_tokens),
            suffix_tokens=int(cfg.suffix_tokens),
            context_tokens=int(cfg.context_tokens) if getattr(cfg, "workspace_context", True) else 0,
            max_prompt_tokens=max_prompt,
            heal=bool(getattr(cfg, "token_healing", True)),
            multiline=str(getattr(cfg, "multiline", "auto")),
            max_lines=int(getattr(cfg, "max_lines", 8)),
        )
        kw.update(overrides)
        return cls(**kw)


def skip_reason(text: str, cursor: int, options: PromptOptions) -> str | None:
    """Why no completion should be attempted here, or None."""
    if not 0 <= cursor <= len(text):
        return f"cursor offset {cursor} outside the document (length {len(text)})"
    if len(text) > options.max_document_chars:
        return f"document too large ({len(text)} characters > {options.max_document_chars})"
    lo = max(0, cursor - options.prefix_tokens * CHARS_PER_TOKEN)
    hi = min(len(text), cursor + options.suffix_tokens * CHARS_PER_TOKEN)
    if "\x00" in text[lo:hi]:
        return "binary content near the cursor (NUL characters)"
    ls = text.rfind("\n", 0, cursor) + 1
    le = text.find("\n", cursor)
    le = len(text) if le < 0 else le
    if le - ls > options.max_line_chars:
        return f"cursor line is {le - ls} characters long (minified or generated code?)"
    return None


class Encoder(Protocol):
    """What the planner measures pieces with, and what later renders its plan (ids or text).

    Units are the encoder's own (token ids, characters); `encode` must give the same result for the
    same text every time, since the planner's measure is what the rendering then holds."""

    name: str  # the FIM template (models/fim.py TEMPLATE_NAMES)
    split_before_newline: bool  # pieces are cut just before a newline (else just after)
    supports_suffix: bool
    supports_file_context: bool  # the family has a file separator: context in its repository format
    context_style: str  # "paths" or "separators" (models/fim.py)
    prefix_leading_space: bool

    def encode(self, text: str, first: bool = False) -> Sequence[Any]: ...

    def cursor(self, text: str, first: bool, heal: bool) -> Sequence[Any]:
        """The cursor line's piece as the prompt holds it (after token healing, where there is one)."""
        ...

    def files(self, files: Sequence[tuple[str, str]], current_path: str | None) -> Sequence[Any]:
        """The context files in the family's repository format."""
        ...

    def decoded_chars(self, units: Sequence[Any]) -> int:
        """How many characters of document text `units` (a leading run of one encoded piece) stand for."""
        ...


@dataclass
class PromptPlan:
    """One prompt, laid out but not yet encoded. Ranges are document offsets; `encode` of each range's
    text (with `first` where said) is what the prompt holds. If skip_reason is set, show nothing."""

    template: str = "none"
    skip_reason: str | None = None
    cursor: int = 0
    line_prefix: str = ""  # cursor line up to the cursor
    line_suffix: str = ""  # cursor line after the cursor
    following: str = ""  # text after the cursor line (bounded), for the stop rules' duplicate checks
    context_files: list[tuple[str, str]] = field(default_factory=list)  # repository-format block (fitted)
    context_path: str | None = None  # the current file's path, for the repository format's last header
    context_text: str = ""  # context as plain text at the start of the prefix (fitted)
    head: list[tuple[int, int]] = field(default_factory=list)  # whole-line pieces before the cursor line
    first_leading_space: bool = False  # the prefix's first piece carries the family's leading space
    cursor_start: int = 0  # the cursor line's piece is text[cursor_start:cursor]
    cursor_first: bool = False  # ... encoded as the prefix's first piece (no head, leading-space family)
    cursor_keep: int | None = None  # its last this many units (None: all of them)
    heal: bool = False
    suffix: list[tuple[int, int]] = field(default_factory=list)  # pieces after the cursor
    suffix_keep: int | None = None  # of a single over-long suffix piece, its first this many units
    prefix_start: int = 0  # document offset where the prefix window starts (may be the newline before its first line)
    prefix_line: int = 0  # absolute number of the first line in the prefix window
    suffix_end: int = 0  # document offset where the suffix window ends

    @property
    def skipped(self) -> bool:
        return self.skip_reason is not None

    def prefix_text(self, text: str) -> str:
        """The document text of the prefix window (the plain-text context block not included)."""
        return text[self.prefix_start : self.cursor]

    def suffix_text(self, text: str) -> str:
        return text[self.cursor : self.suffix_end]


class Planner:
    """Cuts prompts for one encoder and one set of options; keeps the last few fitted context blocks.
    Not thread-safe: use it from the daemon's worker thread (like the engine)."""

    def __init__(self, encoder: Encoder, options: PromptOptions | None = None):
        self.encoder = encoder
        self.options = options or PromptOptions()
        self._shift = 1 if encoder.split_before_newline else 0
        self._contexts: dict[tuple, list[tuple[str, str]]] = {}

    def budgets(self, with_context: bool = True) -> tuple[int, int, int]:
        """(prefix, suffix, context) budgets after fitting them into max_prompt_tokens.

        Pass the context budget to Workspace.context so the block it returns fits.
        """
        opt = self.options
        prefix_budget, suffix_budget = opt.prefix_tokens, opt.suffix_tokens
        context_budget = opt.context_tokens if with_context else 0
        if not self.encoder.supports_suffix:
            suffix_budget = 0
        if opt.max_prompt_tokens is not None:
            room = opt.max_prompt_tokens - 8  # FIM special tokens and BOS
            context_budget = min(context_budget, max(0, int(room * opt.context_share)))
            suffix_budget = min(suffix_budget, max(0, (room - context_budget) // 4))
            prefix_budget = min(prefix_budget, max(1, room - context_budget - suffix_budget))
        return prefix_budget, suffix_budget, context_budget

    def plan(
        self,
        text: str,
        cursor: int,
        context: Sequence[tuple[str, str]] = (),
        path: str | None = None,
        language: str | None = None,
        heal: bool | None = None,
    ) -> PromptPlan:
        """The prompt for a completion at `cursor` in `text`.

        context: (path, text) snippets, already chosen and ordered by the workspace (stable order keeps
        their KV cached). Families with a file separator get them in their repository format, in front
        of the FIM layout; the bundled model ("separators" style) gets the code as plain text at the
        start of the prefix, which is what its FIM training showed it; families without a separator get
        it there too, each file under a path line in `language`'s comment syntax, or not at all if it
        has none. heal: override PromptOptions.heal for this request.
        """
        opt, enc = self.options, self.encoder
        reason = skip_reason(text, cursor, opt)
        if reason is not None:
            return PromptPlan(template=enc.name, skip_reason=reason, cursor=cursor)
        ls = text.rfind("\n", 0, cursor) + 1
        le = text.find("\n", cursor)
        le = len(text) if le < 0 else le
        plan = PromptPlan(template=enc.name, cursor=cursor, line_prefix=text[ls:cursor], line_suffix=text[cursor:le])
        prefix_budget, suffix_budget, context_budget = self.budgets(bool(context))

        # Context first: its size is known before the prefix is cut.
        if context and context_budget > 0:
            if enc.supports_file_context and enc.context_style == "separators":
                # The bundled model's FIM samples never had anything before <|fim_prefix|>: there it
                # barely reads a block (an oracle block holding the true next line lifted exact match
                # half as much as the same text at the start of the prefix; see docs/PERFORMANCE.md).
                # So its block is plain code at the start of the prefix, where FIM training put the
                # code above the cursor.
                plan.context_text = self._text_context(list(context), None, context_budget)
            elif enc.supports_file_context:
                plan.context_files = self._file_context(list(context), path, context_budget)
                plan.context_path = path
            elif comment := comment_for(language):
                plan.context_text = self._text_context(list(context), comment, context_budget)

        # The cursor line's piece starts at the newline before it when the tokenizer merges a newline
        # with the next line's indentation.
        shift = self._shift
        plan.cursor_start = ls - shift if ls > 0 else 0
        cursor_text = text[plan.cursor_start : cursor]
        plan.heal = opt.heal if heal is None else heal
        cursor_units = len(enc.cursor(cursor_text, False, plan.heal)) if cursor_text else 0
        plan.cursor_keep = prefix_budget
        pieces = self._head(text, ls, prefix_budget, min(cursor_units, prefix_budget))
        plan.head = pieces
        plan.prefix_start = pieces[0][0] if pieces else plan.cursor_start
        plan.prefix_line = text.count("\n", 0, plan.prefix_start) + (1 if shift and plan.prefix_start > 0 else 0)
        if enc.prefix_leading_space and not plan.context_text:
            # Only the first piece of the prefix carries the family's leading space.
            if pieces:
                plan.first_leading_space = True
            elif cursor_text:
                plan.cursor_first, plan.cursor_keep = True, None

        plan.suffix, plan.suffix_keep, plan.suffix_end = self._suffix(text, cursor, le, suffix_budget)
        plan.following = text[le + 1 : min(len(text), le + 1 + FOLLOWING_CHARS)] if le < len(text) else ""
        return plan

    # -- prefix ----------------------------------------------------------
    def _piece(self, text: str, b: int, e: int) -> int:
        """Units of the lines starting at line starts b..e, cut on the encoder's side of the newline."""
        sh = self._shift
        return len(self.encoder.encode(text[max(0, b - sh) : e - sh]))

    def _head(self, text: str, ls: int, budget: int, cursor_units: int) -> list[tuple[int, int]]:
        """Pieces (begin, end) of whole lines before the cursor line, oldest first.

        begin/end are document offsets of the piece text. Walks back chunk by chunk (chunks aligned to
        absolute line numbers) while they fit in the budget minus a reserve for the cursor line. The
        reserve does not depend on the cursor line until that line outgrows it, so typing does not move
        the window start. Then the window starts at an anchor (`_anchor`), so that moving the cursor
        within a region does not move it either.
        """
        if ls == 0:
            return []
        opt = self.options
        sh = self._shift
        n = max(1, opt.chunk_lines)
        reserve = max(budget // 8, cursor_units)
        head_budget = max(0, budget - reserve)
        char_floor = max(0, ls - budget * CHARS_PER_TOKEN)
        cur_line = text.count("\n", 0, ls)  # absolute line number of the cursor line
        first_line = (cur_line // n) * n
        if first_line == cur_line:
            first_line -= n
        pieces: list[tuple[int, int]] = []
        lines: list[int] = []  # each piece's first line (a chunk boundary)
        sizes: list[int] = []
        used = 0
        end = ls  # line start where the next (older) piece ends
        while end > 0:
            begin = _line_start(text, end, cur_line - first_line)
            if begin < char_floor or any(len(seg) > opt.max_line_chars for seg in text[begin:end].split("\n")):
                break
            units = self._piece(text, begin, end)
            if used + units > head_budget:
                if not pieces:
                    tail = self._tail_lines(text, begin, end, head_budget)
                    if tail is not None:
                        pieces.append(tail)
                    return pieces
                break
            pieces.append((max(0, begin - sh), end - sh))
            lines.append(max(0, first_line))
            sizes.append(units)
            used += units
            end = begin
            cur_line, first_line = first_line, first_line - n
        pieces.reverse()
        if end > 0:  # the window did not reach the top of the file
            lines.reverse()
            sizes.reverse()
            pieces = pieces[_anchor(lines, sizes, head_budget // 2, n) :]
        return pieces

    def _tail_lines(self, text: str, begin: int, end: int, budget: int) -> tuple[int, int] | None:
        """Trailing whole lines of the lines begin..end that fit in budget (not chunk-aligned)."""
        sh = self._shift
        starts = [begin] + [i + 1 for i in range(begin, end - 1) if text[i] == "\n"]
        total = 0
        best = None
        for k in range(len(starts) - 1, -1, -1):
            b = starts[k]
            e = starts[k + 1] if k + 1 < len(starts) else end
            total += self._piece(text, b, e)
            if total > budget:
                break
            best = b
        if best is None:
            return None
        return max(0, best - sh), end - sh

    # -- suffix ----------------------------------------------------------
    def _suffix(self, text: str, cursor: int, le: int, budget: int) -> tuple[list[tuple[int, int]], int | None, int]:
        """(pieces, units kept of a single over-long piece or None, window end): the text after the
        cursor, cut at a line end within budget."""
        if budget <= 0 or cursor >= len(text):
            return [], None, cursor
        enc = self.encoder
        sh = self._shift
        hi = min(len(text), cursor + budget * CHARS_PER_TOKEN)
        # Cut points: every line end in the window, on the encoder's side of the newline.
        cuts: list[int] = []
        p = le
        while 0 <= p < hi:
            cuts.append(p + 1 - sh)
            p = text.find("\n", p + 1, hi)
        if hi == len(text) and (not cuts or cuts[-1] < len(text)):
            cuts.append(len(text))
        cuts = [c for c in cuts if c > cursor]
        if not cuts:
            # The cursor line is longer than the window: keep what fits of it.
            units = enc.encode(text[cursor:hi])[:budget]
            return [(cursor, hi)], budget, cursor + enc.decoded_chars(units) if units else cursor
        # The rest of the cursor line is its own piece: it is all that changes when the user edits to
        # the right of the cursor.
        used = len(enc.encode(text[cursor : cuts[0]]))
        if used > budget:
            return [(cursor, cuts[0])], budget, cuts[0]
        pieces = [(cursor, cuts[0])]
        n = max(1, self.options.chunk_lines)
        i = 0
        while i + 1 < len(cuts):
            j = min(i + n, len(cuts) - 1)
            chunk = len(enc.encode(text[cuts[i] : cuts[j]]))
            if used + chunk > budget:
                # Take the leading lines of this chunk that still fit.
                for k in range(i, j):
                    line = len(enc.encode(text[cuts[k] : cuts[k + 1]]))
                    if used + line > budget:
                        break
                    used += line
                    pieces.append((cuts[k], cuts[k + 1]))
                break
            used += chunk
            pieces.append((cuts[i], cuts[j]))
            i = j
        return pieces, None, pieces[-1][1]

    # -- context ---------------------------------------------------------
    def _file_context(self, files: list[tuple[str, str]], path: str | None, budget: int) -> list[tuple[str, str]]:
        # The same block comes back on every keystroke: remember the last few.
        key = (tuple(files), path, budget)
        hit = self._contexts.get(key)
        if hit is not None:
            return list(hit)
        while files and len(self.encoder.files(files, path)) > budget:
            files = _shorten_last(files)
        self._contexts[key] = list(files)
        if len(self._contexts) > 8:
            del self._contexts[next(iter(self._contexts))]
        return files

    def _text_context(self, files: list[tuple[str, str]], comment: str | None, budget: int) -> str:
        """The files as plain text, each under a path line in `comment` syntax (none without one),
        fitted into the budget as `_file_context` does: the last file shortened by lines, dropped when
        nothing of it fits."""
        while files:
            block = "".join(
                (f"{comment} {p}\n" if comment else "") + (t if t.endswith("\n") else t + "\n") for p, t in files
            )
            if len(self.encoder.encode(block, first=True)) <= budget:  # cached: the same block every keystroke
                return block
            files = _shorten_last(files)
        return ""


def _shorten_last(files: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The context files with the last one cut to two thirds of its lines, or dropped when it has one line."""
    last_path, last_text = files[-1]
    lines = last_text.splitlines(keepends=True)
    if len(lines) > 1:
        return files[:-1] + [(last_path, "".join(lines[: max(1, len(lines) * 2 // 3)]))]
    return files[:-1]


def _anchor(lines: list[int], sizes: list[int], keep: int, n: int) -> int:
    """Index of the piece a prefix window starts at: of the chunk boundaries (`lines`, ascending, `n` apart;
    `sizes` the pieces' units) whose pieces up to the cursor still hold `keep` units, the one divisible by the
    largest power of two in chunks (the top of the file above all). That boundary stays the roundest in the
    range while the cursor moves on within about half a window, so after a jump there the window starts
    where it did, and the KV cached after that start is reused."""
    best, best_rank = 0, -1
    tail = sum(sizes)
    for i, line in enumerate(lines):
        if tail < keep and i > 0:
            break
        chunk = line // n
        rank = (chunk & -chunk).bit_length() if chunk else 64
        if rank > best_rank:
            best, best_rank = i, rank
        tail -= sizes[i]
    return best


def _line_start(text: str, end: int, lines: int) -> int:
    """Offset of the line `lines` lines above the line starting at `end` (end is a line start)."""
    pos = end
    for _ in range(max(1, lines)):
        if pos <= 0:
            return 0
        nl = text.rfind("\n", 0, pos - 1)
        pos = nl + 1
        if nl < 0:
            return 0
    return pos
