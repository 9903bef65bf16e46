"""The stop rules on plain text (completion/stops.py's rules, without tokens): where a suggestion must end,
decided from the evidence already in it, so a cut found early in the stream is the cut of any longer
stream. Brackets (quoted strings skipped), the cursor line's block, maxLines, the next line of the
document, in-line repetition loops, repeated-line cycles, and text that re-types what is right of the
cursor. See stops.py's module doc for the list of rules.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from completiond.completion.syntax import Site, Verdict

OPENERS = {"(": ")", "[": "]", "{": "}"}
CLOSERS = {v: k for k, v in OPENERS.items()}
BLOCK_OPENER_ENDINGS = (":", "{", "(", "[", "=>")
MULTILINE_MODES = ("auto", "always", "never")


def indent_width(line: str) -> int:
    """Width of the leading whitespace, tabs counted as 4 columns."""
    stripped = line.lstrip(" \t")
    return len(line[: len(line) - len(stripped)].expandtabs(4))


def _only_closers(text: str) -> bool:
    s = "".join(text.split())
    return all(c in CLOSERS or c in ";,'\"`" for c in s)


def wants_multiline(line_prefix: str, line_suffix: str, mode: str = "auto") -> bool:
    """Whether a suggestion here may span lines.

    Text right of the cursor (other than closing brackets an editor
    auto-inserted) always means single-line: a multi-line insertion in the
    middle of a line splits it.
    """
    if mode not in MULTILINE_MODES:
        raise ValueError(f"multiline must be one of {', '.join(MULTILINE_MODES)}, got {mode!r}")
    if mode == "never":
        return False
    if line_suffix.strip() and not _only_closers(line_suffix):
        return False
    if mode == "always":
        return True
    stripped = line_prefix.rstrip()
    return not stripped or stripped.endswith(BLOCK_OPENER_ENDINGS)


def outside_strings(text: str) -> tuple[str, bool]:
    """(text's characters outside quoted strings, whether text ends inside one). A string ends at its
    unescaped closing quote or at the end of its line."""
    code: list[str] = []
    quote = None
    prev = ""
    for c in text:
        if quote:
            if (c == quote and prev != "\\") or c == "\n":
                quote = None
        elif c in "'\"`":
            quote = c
        else:
            code.append(c)
        prev = c if prev != "\\" else ""
    return "".join(code), quote is not None


def bracket_scan(text: str) -> tuple[int, list[str]]:
    """(net depth change, closers that had no opener in text), skipping quoted strings."""
    depth = 0
    unmatched: list[str] = []
    for c in outside_strings(text)[0]:
        if c in OPENERS:
            depth += 1
        elif c in CLOSERS:
            if depth > 0:
                depth -= 1
            else:
                unmatched.append(c)
    return depth, unmatched


def open_stack(text: str, before: Sequence[str] = ()) -> list[str]:
    """Opening brackets still open at the end of text, innermost last (quoted strings skipped).
    before: brackets already open where text starts (earlier lines of the statement)."""
    stack: list[str] = list(before)
    for c in outside_strings(text)[0]:
        if c in OPENERS:
            stack.append(c)
        elif c in CLOSERS and stack and stack[-1] == CLOSERS[c]:
            stack.pop()
    return stack


def _suffix_closers(line_suffix: str) -> int:
    """Closing brackets right of the cursor that have no opener there (they close ours)."""
    return len(bracket_scan(line_suffix)[1])


@dataclass
class Cut:
    pos: int  # character offset in the suggestion text where it ends
    reason: str


class TextRules:
    """The stop rules on plain text; StopRules adds tokens around them."""

    def __init__(
        self,
        line_prefix: str,
        line_suffix: str = "",
        following: str = "",
        multiline: str = "auto",
        max_lines: int = 8,
        site: Site | None = None,
        check_syntax: bool = True,
    ):
        self.line_prefix = line_prefix
        self.line_suffix = line_suffix
        self.following = following
        self.max_lines = max(1, int(max_lines))
        self.multiline_mode = multiline
        self.multiline = wants_multiline(line_prefix, line_suffix, multiline)
        # Where the cursor sits in the document (syntax.site_at), or None: the cursor line is all
        # the rules know of the code's structure.
        self.site = site
        self.check_syntax = check_syntax
        self.syntax: Verdict | None = None  # the last syntax check's verdict (postprocess sets it)
        # Brackets open at the cursor, and how many of them the text right of
        # the cursor closes: the suggestion must leave exactly those open.
        self.open_depth = bracket_scan(line_prefix)[0]
        self.open_brackets = open_stack(line_prefix)
        self.suffix_closers = _suffix_closers(line_suffix)
        self.suffix_closer_types = bracket_scan(line_suffix)[1]  # those closers, in order
        if site is not None:
            if site.open_before:
                # A continuation line: brackets opened on earlier lines of the statement are open here too
                # (`foo(a,` / `    b|` may close with ")").
                self.open_brackets = open_stack(line_prefix, site.open_before)
                self.open_depth = len(self.open_brackets)
            # The ones the lines below close stay open (`list(map(f|` above `    xs)) == 1`).
            room = max(0, self.open_depth - self.suffix_closers)
            self.suffix_closers += min(site.closed_below, room)
        self.carry = max(0, self.open_depth - self.suffix_closers)
        if line_prefix.strip():
            # The block is the one the cursor line belongs to; after an
            # opener, the new block is deeper than the opener's line.
            self.min_indent = indent_width(line_prefix) + (
                1 if line_prefix.rstrip().endswith(BLOCK_OPENER_ENDINGS) else 0
            )
        else:
            self.min_indent = indent_width(line_prefix)
        self.next_line = next((ln.strip() for ln in following.split("\n") if ln.strip()), "")
        # Token healing made the model regenerate the whitespace at the end of line_prefix (StopRules sets it).
        self.whitespace_healed = False
        # A cut was found inside a line of the stream: the model's text went on past where the suggestion
        # ends (in the loop or after it; the syntax check then excuses a bracket left open there).
        self.went_on = False

    def find_cut(self, s: str, final: bool = False) -> Cut | None:
        """Where the suggestion `s` must end, using only evidence already in `s` (and whether the text went
        on past it on the same line: `went_on`).

        final=True: generation is over, so the last (unterminated) line
        counts as complete.
        """
        cut = self._find_cut(s, final)
        if cut is not None and s[cut.pos :].split("\n", 1)[0].strip():
            self.went_on = True
        return cut

    def _find_cut(self, s: str, final: bool) -> Cut | None:
        cut = self._bracket_cut(s)
        for other in (find_loop(s), self._retype_cut(s)):
            if other is not None and (cut is None or other.pos < cut.pos):
                cut = other
        if not self.multiline:
            nl = s.find("\n")
            if nl >= 0 and (cut is None or nl < cut.pos):
                cut = Cut(nl, "single-line")
            return cut
        # Cycles are looked for only within maxLines: past it the stream stops, so a repeat found there
        # would make the whole output's cut differ from the one the engine stopped at.
        window = self._max_lines_end(s)
        cycle = (
            find_line_cycle(s, final, self.line_prefix)
            if window is None
            else find_line_cycle(s[:window], True, self.line_prefix)
        )
        if cycle is not None and (cut is None or cycle.pos < cut.pos):
            cut = cycle
        line_cut = self._line_cut(s if cut is None else s[: cut.pos], final or cut is not None)
        if line_cut is not None:
            return line_cut
        return cut

    def _max_lines_end(self, s: str) -> int | None:
        """Offset of the newline that ends the last line maxLines allows, or None if `s` has not reached it."""
        first = 0 if s.split("\n", 1)[0].strip() else 1  # a suggestion after an opener starts with "\n"
        pos = -1
        for _ in range(first + self.max_lines):
            pos = s.find("\n", pos + 1)
            if pos < 0:
                return None
        return pos

    def _retype_cut(self, s: str) -> Cut | None:
        """Cut where the suggestion starts typing the text that is already right of the cursor.

        `f(|, b)` + "a, b)": the model ignored the suffix and wrote the line
        to its end. The test is a substring search for the suffix's opening
        characters, so a cut found early in the stream is found again in any
        longer stream (stopping early changes nothing). Only a telling start
        counts: at least two letters or digits in it, not closers alone.
        """
        start = self._retype_probe
        if not start:
            return None
        i = s.find(start)
        return Cut(i, "re-types the text right of the cursor") if i >= 0 else None

    @property
    def _retype_probe(self) -> str:
        probe = self.line_suffix.lstrip()[:RETYPE_PROBE_CHARS]
        return probe if sum(c.isalnum() for c in probe) >= 2 else ""

    def _bracket_cut(self, s: str) -> Cut | None:
        """Cut before a closer that has no opener, closes the wrong kind, or is owed to the suffix.

        `foo(|)` + "a, b)": the ")" is already right of the cursor, so the
        suggestion must leave that bracket open. `[(x|]` + "y]": "]" cannot
        close "(".
        """
        stack = list(self.open_brackets)
        # Closers right of the cursor beyond the brackets open here close ones the suggestion opens.
        owed = min(self.suffix_closers, len(stack))
        # Bash's case patterns end with a `)` that has no opener.
        lone_paren_ok = self.site is not None and self.site.spec.name == "bash"
        quote = None
        prev = ""
        for i, c in enumerate(s):
            if quote:
                if (c == quote and prev != "\\") or c == "\n":
                    quote = None
            elif c in "'\"`":
                quote = c
            elif c in OPENERS:
                stack.append(c)
            elif c in CLOSERS:
                if not stack and c == ")" and lone_paren_ok:
                    continue
                if not stack:
                    return Cut(i, "unbalanced closing bracket")
                if stack[-1] != CLOSERS[c]:
                    return Cut(i, "mismatched closing bracket")
                stack.pop()
                # The closer right of the cursor that would close this bracket is of another kind (`]` after
                # `unzip(z|`): it closes one the suggestion has yet to open, not this one.
                other_kind = len(self.suffix_closer_types) == self.suffix_closers and self.suffix_closer_types[:1] != [
                    c
                ]
                if len(stack) < owed and not other_kind:
                    return Cut(i, "closing bracket already right of the cursor")
            prev = c if prev != "\\" else ""
        return None

    def _line_cut(self, s: str, final: bool) -> Cut | None:
        lines = s.split("\n")
        starts = [0]
        for ln in lines[:-1]:
            starts.append(starts[-1] + len(ln) + 1)
        complete = len(lines) - 1 + (1 if final else 0)  # lines[:complete] are finished lines
        first = 0 if lines[0].strip() else 1  # a suggestion after an opener starts with "\n"
        depth = self.carry
        seen_content = bool(lines[0].strip())
        for i, ln in enumerate(lines):
            stripped = ln.strip()
            end_of_prev = starts[i] - 1  # offset of the newline before line i
            if i > first + self.max_lines - 1 and i >= 1:
                return Cut(end_of_prev, f"maxLines ({self.max_lines})")
            if i >= 1 and stripped:
                ind = indent_width(ln)
                closes_block = self.carry > 0 and stripped[0] in CLOSERS
                if ind < self.min_indent and not closes_block:
                    return Cut(_trim_blank_tail(s, end_of_prev), "dedent out of the cursor's block")
                if ind == 0 and self.min_indent == 0 and seen_content and i >= 2 and not lines[i - 1].strip():
                    return Cut(_trim_blank_tail(s, end_of_prev), "top-level code after a blank line")
            # A closer the suggestion owes its own opener is not a repeat of the document's next `}`.
            closes_own = _only_closers(stripped) and depth > self.carry
            if (
                i < complete
                and stripped
                and stripped == self.next_line
                and (i >= 1 or not self.line_prefix.strip())
                and not closes_own
            ):
                return Cut(_trim_blank_tail(s, end_of_prev) if i >= 1 else 0, "repeats the next line of the document")
            d, unmatched = bracket_scan(ln)
            before = depth
            depth += d - len(unmatched)
            if self.carry > 0 and i >= 1 and before > 0 and depth <= 0 and i < complete:
                return Cut(starts[i] + len(ln), "block closed")
            if stripped:
                seen_content = True
        return None


LOOP_REPEATS = 6
LOOP_MAX_UNIT = 7
LONG_LOOP_REPEATS = 3
LONG_LOOP_MAX_UNIT = 64
# A short unit must come 6 times in a row, a longer one (`name of the ` in a comment, an f-string's
# ` with {self.type!r}`) 3 times: either is a model stuck in a loop, not code.
_LOOPS = (
    re.compile(r"([^\n]{2,%d}?)\1{%d}" % (LOOP_MAX_UNIT, LOOP_REPEATS - 1)),
    re.compile(r"([^\n]{%d,%d}?)\1{%d}" % (LOOP_MAX_UNIT + 1, LONG_LOOP_MAX_UNIT, LONG_LOOP_REPEATS - 1)),
)
RETYPE_PROBE_CHARS = 8


def find_loop(s: str) -> Cut | None:
    """The earliest degenerate repetition inside a line (`path.path.path...`), cut after its first unit.

    A unit of 2-7 characters containing a letter, repeated LOOP_REPEATS
    times back to back, or of 8-64 characters repeated LONG_LOOP_REPEATS
    times; stopping there also saves the rest of the token budget. The
    regular expressions find the leftmost start, so a cut found in a prefix
    of the stream is the cut of every longer stream.
    """
    best: int | None = None
    for pattern in _LOOPS:
        pos = 0
        while True:
            m = pattern.search(s, pos)
            if m is None or (best is not None and m.start() >= best):
                break
            unit = m.group(1)
            if any(c.isalpha() for c in unit):
                end = m.start() + len(unit)
                best = end if best is None else min(best, end)
                break
            pos = m.start() + 1
    return Cut(best, "repetition loop") if best is not None else None


def _line_key(line: str) -> str:
    return line.rstrip()


def _significant(line: str) -> bool:
    """A line whose repetition means something: not blank, not closers or a bare keyword."""
    body = line.strip()
    return sum(c.isalnum() for c in body) >= 3 and body.rstrip(":;{") not in TRIVIAL_LINES


TRIVIAL_LINES = frozenset(
    {
        "pass",
        "else",
        "try",
        "finally",
        "break",
        "continue",
        "return",
        "end",
        "fi",
        "done",
        "default",
        "return;",
        "break;",
        "continue;",
    }
)


def find_line_cycle(s: str, final: bool = False, line_prefix: str = "") -> Cut | None:
    """Cut before the first line that starts a cycle of lines repeating earlier lines of `s`.

    A cycle: a block of lines written again right after itself (one line
    three times in a row, or a block of two or more lines twice), or a
    significant line seen twice already. The first copy stays; the cut
    goes before the repeat. Only finished lines count (final: the last one
    too), so the cut never moves as the stream grows. line_prefix: the
    cursor line's text before the suggestion, which completes its first line.
    """
    lines = s.split("\n")
    complete = len(lines) - 1 + (1 if final else 0)
    whole = [line_prefix + lines[0]] + lines[1:]
    keys = [_line_key(ln) for ln in whole[:complete]]
    sig = [_significant(ln) for ln in whole[:complete]]
    starts = [0]
    for ln in lines[:-1]:
        starts.append(starts[-1] + len(ln) + 1)
    seen: dict[str, int] = {}
    for i, key in enumerate(keys):
        if sig[i] and seen.get(key, 0) >= 2:
            return Cut(_trim_blank_tail(s, starts[i] - 1), "repeated line (third time)")
        for p in range(1, i + 1):
            run = max(2, p)
            if i + run > len(keys):
                continue
            if keys[i : i + run] == keys[i - p : i - p + run] and any(sig[i - p : i - p + run]):
                return Cut(_trim_blank_tail(s, starts[i] - 1), "repeated lines (a cycle)")
        seen[key] = seen.get(key, 0) + 1
    return None


def _trim_blank_tail(s: str, pos: int) -> int:
    """Move a cut back over blank lines so the suggestion does not end with them."""
    if pos < 0:
        return 0
    head = s[:pos]
    return len(head.rstrip(" \t\n"))
