"""Stop rules that run inside the generation loop, and suggestion post-processing.

The engine calls `stop(tokens)` after every verified round; a `StopRules`
instance decodes the tokens (exactly, through the per-token byte table),
finds where the suggestion must end, and answers how many tokens to keep, so
no rounds are spent past a stop.

Token/character contract: a cut can fall inside a token (`"):\\n    "` holds
the end of one line and the start of the next). `__call__` then keeps that
token too (n = tokens overlapping the kept text), so the engine's
token list is a prefix-consistent continuation; `suggestion(tokens)`
applies the exact character cut and the post-processing. Callers must show
`suggestion(gen.tokens)`, never a plain decode.

Rules (in text after the healed characters, see healing.py):
* stop tokens of the template (EOS, FIM end, file separators);
* single-line (mid-line, or multiline=never, or auto on a line that is not
  a block opener and not empty): end at the first newline;
* multi-line (multiline=always, or auto after a block opener `:` `{` `(`
  `[` `=>` or on an empty line): end before a line that dedents out of the
  cursor's block, before top-level code that follows a blank line, after the
  line that closes the bracket opened on the cursor line, at maxLines, and
  before a line that repeats the next non-blank line of the document;
* always: end before a closing bracket that has no opener (in the cursor
  line's prefix or the suggestion), closes the wrong kind of bracket, or
  closes one that the text right of the cursor already closes (`foo(|)`);
  end after the first unit of an in-line repetition loop (`path.path.path`,
  or three copies of a longer unit such as ` with {self.type!r}`);
  end where the suggestion starts re-typing the text right of the cursor;
* multi-line also: end before the first line that starts a cycle (a block of
  lines written again right after itself, or a line's third copy).
Every in-loop rule looks only at evidence already in the stream, so a cut
found early is the cut of any longer stream (stopping early changes nothing).
Post-processing: never insert whitespace the buffer already ends with
(indentation always; inside a line unless healing regenerated it), strip
trailing whitespace, drop an unfinished last line (token limit) and a block
opener left without its body from multi-line suggestions, trim the end of the
suggestion that repeats the text right of the cursor (brackets and quotes by
balance, other text when the overlap is telling), show nothing for an operand
put in front of the one right of the cursor (`str(name)` before `"-".join`),
and turn whitespace-only suggestions into "" (show nothing).
Documents of a language with a tree-sitter grammar (`StopRules.attach_document`,
remote.py's `document_site`): the bracket rules also count the brackets earlier
lines of the statement left open (a continuation line may close them) and the
closers later lines owe them, and the final text passes syntax.check (the longest
part that adds no syntax error to the region around the cursor; the syntaxCheck
setting).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Sequence

from completiond.completion.healing import TokenBytes
from completiond.completion.languages import spec_of
from completiond.completion.syntax import Site, Verdict, check, site_at, unit_end

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
    pos: int       # character offset in the suggestion text where it ends
    reason: str


class TextRules:
    """The stop rules on plain text; StopRules adds tokens around them."""

    def __init__(self, line_prefix: str, line_suffix: str = "", following: str = "", multiline: str = "auto",
                 max_lines: int = 8, site: Site | None = None, check_syntax: bool = True):
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
        self.syntax: Verdict | None = None   # the last syntax check's verdict (postprocess sets it)
        # Brackets open at the cursor, and how many of them the text right of
        # the cursor closes: the suggestion must leave exactly those open.
        self.open_depth = bracket_scan(line_prefix)[0]
        self.open_brackets = open_stack(line_prefix)
        self.suffix_closers = _suffix_closers(line_suffix)
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
            self.min_indent = indent_width(line_prefix) + (1 if line_prefix.rstrip().endswith(BLOCK_OPENER_ENDINGS) else 0)
        else:
            self.min_indent = indent_width(line_prefix)
        self.next_line = next((ln.strip() for ln in following.split("\n") if ln.strip()), "")
        # Token healing made the model regenerate the whitespace at the end of line_prefix (StopRules sets it).
        self.whitespace_healed = False

    def find_cut(self, s: str, final: bool = False) -> Cut | None:
        """Where the suggestion `s` must end, using only evidence already in `s`.

        final=True: generation is over, so the last (unterminated) line
        counts as complete.
        """
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
        cycle = find_line_cycle(s, final, self.line_prefix) if window is None \
            else find_line_cycle(s[:window], True, self.line_prefix)
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
                if len(stack) < owed:
                    return Cut(i, "closing bracket already right of the cursor")
            prev = c if prev != "\\" else ""
        return None

    def _line_cut(self, s: str, final: bool) -> Cut | None:
        lines = s.split("\n")
        starts = [0]
        for ln in lines[:-1]:
            starts.append(starts[-1] + len(ln) + 1)
        complete = len(lines) - 1 + (1 if final else 0)   # lines[:complete] are finished lines
        first = 0 if lines[0].strip() else 1                # a suggestion after an opener starts with "\n"
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
            if i < complete and stripped and stripped == self.next_line and (i >= 1 or not self.line_prefix.strip()) \
                    and not closes_own:
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
_LOOPS = (re.compile(r"([^\n]{2,%d}?)\1{%d}" % (LOOP_MAX_UNIT, LOOP_REPEATS - 1)),
          re.compile(r"([^\n]{%d,%d}?)\1{%d}" % (LOOP_MAX_UNIT + 1, LONG_LOOP_MAX_UNIT, LONG_LOOP_REPEATS - 1)))
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


TRIVIAL_LINES = frozenset({"pass", "else", "try", "finally", "break", "continue", "return", "end", "fi", "done",
                           "default", "return;", "break;", "continue;"})


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
            if keys[i:i + run] == keys[i - p:i - p + run] and any(sig[i - p:i - p + run]):
                return Cut(_trim_blank_tail(s, starts[i] - 1), "repeated lines (a cycle)")
        seen[key] = seen.get(key, 0) + 1
    return None


def _trim_blank_tail(s: str, pos: int) -> int:
    """Move a cut back over blank lines so the suggestion does not end with them."""
    if pos < 0:
        return 0
    head = s[:pos]
    return len(head.rstrip(" \t\n"))


def trim_suffix_overlap(s: str, line_suffix: str, line_prefix: str = "", open_depth: int | None = None) -> str:
    """Remove the end of `s` that repeats the start of the text right of the cursor.

    An overlap of two or more characters that is not only closing brackets
    (`", b)"`, `'")'`, `"):"`) is removed; closing brackets alone only when
    the line would otherwise close more brackets than it opens (`f(a)` in
    `print(|)` stays). open_depth: brackets open at the cursor (default: those the line prefix opens).
    """
    ls = line_suffix.strip()
    body = s.rstrip()
    if not ls or not body:
        return s
    if open_depth is None:
        open_depth = bracket_scan(line_prefix)[0]
    owed = _suffix_closers(line_suffix)
    for k in range(min(len(body), len(ls)), 0, -1):
        overlap = ls[:k]
        if not body.endswith(overlap):
            continue
        only_closers = all(c in CLOSERS or c.isspace() for c in overlap)
        # The whole rest of the line repeated (":" after "if x") is a duplicate
        # even when short; a partial overlap must be long enough to be telling.
        meaningful = not only_closers and (len(overlap) >= 2 or k == len(ls))
        depth, unmatched = bracket_scan(body)
        over_closed = open_depth + depth - len(unmatched) < owed
        if meaningful or over_closed:
            return body[: len(body) - k]
    q = ls[0]
    if q in "'\"`" and body.endswith(q) and (line_prefix + body + line_suffix).count(q) % 2 == 1:
        # The closing quote is already right of the cursor: the line would
        # otherwise be left with an unterminated string.
        return body[:-1]
    return s


def collides_with_suffix(s: str, line_prefix: str, line_suffix: str) -> bool:
    """Inserting `s` puts two operands side by side with the text right of the cursor.

    `return |"-".join(...)` + "str(name)" gives `str(name)"-".join(...)`:
    the model wrote an expression where the line already has one. The
    test is on characters only: `s` ends an operand (a closing bracket,
    a closing quote, or a word right before a quote, other than a string
    prefix like `f`) and the suffix starts one (a word or a quote) with
    nothing between them.
    """
    body = s.rstrip()
    if not body or not line_suffix or "\n" in body or outside_strings(line_prefix + body)[1]:
        return False   # inside a string, the quote right of the cursor closes it (`'binary.f|')` + "ile")
    nxt, last = line_suffix[0], body[-1]
    if not (nxt in "'\"" or _is_word_char(nxt)):
        return False
    if last in CLOSERS:
        return True
    if last in "'\"":
        return nxt not in "'\""   # the string just closed; two literals in a row are a concatenation
    if _is_word_char(last) and nxt in "'\"":
        word = _trailing_word(body)
        return word.lower() not in STRING_PREFIXES
    return False


STRING_PREFIXES = frozenset({"r", "b", "f", "u", "rb", "br", "fr", "rf", "t", "tr", "rt"})


def _is_word_char(c: str) -> bool:
    return c.isalnum() or c == "_"


def _trailing_word(s: str) -> str:
    """The run of word characters `s` ends with (`\\w+$`), in linear time: a regular expression search for it
    backtracks quadratically over long runs of word characters elsewhere in `s`."""
    start = len(s)
    while start > 0 and _is_word_char(s[start - 1]):
        start -= 1
    return s[start:]


def _dangling_last_line(s: str, following: str) -> bool:
    """The last line of a multi-line suggestion opens a block (or a bracket) the suggestion never fills."""
    lines = [ln for ln in s.split("\n") if ln.strip()]
    if len(lines) < 2:
        return False
    last = lines[-1].rstrip()
    if not last.endswith(BLOCK_OPENER_ENDINGS):
        return False
    nxt = next((ln for ln in following.split("\n") if ln.strip()), "")
    # The document's next line may be the body the opener wants.
    return not nxt or indent_width(nxt) <= indent_width(last)


def _drop_last_line(s: str) -> str:
    head = s.rstrip()
    nl = head.rfind("\n")
    return head[:nl].rstrip() if nl >= 0 else head


def postprocess(s: str, rules: TextRules, truncated: bool = False) -> str:
    """Final suggestion text from raw generated text ('' means show nothing).

    truncated: generation ended at the token limit, not at a stop, so the
    last line of a multi-line suggestion is unfinished and is dropped.
    """
    cut = rules.find_cut(s, final=True)
    if cut is not None:
        s = s[: cut.pos]
    if rules.line_prefix.endswith((" ", "\t")) and (not rules.line_prefix.strip() or not rules.whitespace_healed):
        # The buffer already has this whitespace: never insert a second copy of
        # indentation. Inside a line, a model that regenerated the whitespace
        # under the healing constraint and then chose more means it (aligned
        # comments); without healing (a remote server, healing off) a space
        # there is the tokenizer's, not the code's.
        s = s.lstrip(" \t")
    keep_newline = rules.multiline and "\n" in s and rules.line_suffix.strip() != "" and _only_closers(rules.line_suffix)
    unfinished = truncated and cut is None and not s.rstrip(" \t").endswith("\n")
    s = s.rstrip()
    if rules.multiline and "\n" in s.strip():
        if unfinished:
            s = _drop_last_line(s)
        while _dangling_last_line(s, rules.following):
            s = _drop_last_line(s)
    s = trim_suffix_overlap(s, rules.line_suffix, rules.line_prefix, rules.open_depth).rstrip()
    if not s.strip() or collides_with_suffix(s, rules.line_prefix, rules.line_suffix):
        return ""
    if keep_newline:
        # The closer right of the cursor then lands on its own line, at the
        # opener's indentation, instead of being glued to the last line.
        s += "\n" + rules.line_prefix[: len(rules.line_prefix) - len(rules.line_prefix.lstrip())]
    if rules.site is not None and rules.multiline and "\n" in s and not rules.line_prefix.strip():
        # A suggestion begun on an empty line ends with the statement it began (a compound one with its
        # body), as the language's grammar delimits it: the syntactic unit the cursor began.
        end = unit_end(rules.site, s)
        if end is not None:
            s = s[:end].rstrip()
    if rules.site is not None and rules.check_syntax:
        # The longest part that adds no syntax error (syntax.py; bounded, never raises).
        rules.syntax = check(rules.site, s)
        s = rules.syntax.text
    return s


def document_site(text: str, offset: int, language: str | None = None, path: str | None = None,
                  tree=None) -> Site | None:
    """Where the cursor sits in the document (syntax.site_at); None for a language without a grammar here
    (the cursor line is then all the rules know). tree: the document's own tree (documents.Document)."""
    return site_at(text, offset, spec_of(language, path), tree)


class StopRules:
    """Engine stop callback for one request, plus the final suggestion.

    healed: text token healing removed from the prompt; the model first
    regenerates it and the rules only look at what follows.
    """

    def __init__(self, token_bytes: TokenBytes, line_prefix: str, line_suffix: str = "", following: str = "",
                 multiline: str = "auto", max_lines: int = 8, stop_ids: Iterable[int] = (), healed: str = ""):
        self.table = token_bytes
        self.rules = TextRules(line_prefix, line_suffix, following, multiline, max_lines)
        self.stop_ids = frozenset(stop_ids)
        self.healed = healed
        self.healed_bytes = healed.encode("utf-8")
        self.rules.whitespace_healed = healed.endswith((" ", "\t"))
        self.reason: str | None = None
        self._ends: list[int] = []      # cumulative byte end of each processed token
        self._data = bytearray()

    @classmethod
    def for_prompt(cls, prompt, template, multiline: str = "auto", max_lines: int = 8,
                   token_bytes: TokenBytes | None = None) -> "StopRules":
        """Rules for a completiond.completion.prompt.Prompt and its models.fim template."""
        table = token_bytes or TokenBytes.for_tokenizer(template.tokenizer)
        healed = prompt.healing.removed if prompt.healing is not None else ""
        return cls(table, prompt.line_prefix, prompt.line_suffix, prompt.following, multiline, max_lines,
                   template.stop_ids, healed)

    @property
    def multiline(self) -> bool:
        return self.rules.multiline

    @property
    def syntax(self) -> Verdict | None:
        """The syntax check's verdict on the last suggestion (None: no grammar, or not checked)."""
        return self.rules.syntax

    def attach_document(self, text: str, offset: int, language: str | None = None, path: str | None = None,
                        check_syntax: bool = True, tree=None) -> None:
        """Let the rules see the document around the cursor; call it before generation starts.

        Every language with a grammar (others keep the cursor-line rules): brackets that earlier lines of
        the statement left open, closers the lines below owe them, and the syntax check of the
        final suggestion (check_syntax: the syntaxCheck setting). tree: the document's own, when kept.
        """
        site = document_site(text, offset, language, path, tree)
        old = self.rules
        if site is None or text[text.rfind("\n", 0, offset) + 1:offset] != old.line_prefix:
            return
        self.rules = TextRules(old.line_prefix, old.line_suffix, old.following, old.multiline_mode, old.max_lines,
                               site, check_syntax)
        self.rules.whitespace_healed = old.whitespace_healed

    def _sync(self, tokens: Sequence[int]) -> None:
        if len(tokens) < len(self._ends):
            self._ends.clear()
            self._data.clear()
        for t in tokens[len(self._ends):]:
            self._data += self.table[t] or b""
            self._ends.append(len(self._data))

    def _stop_index(self, tokens: Sequence[int]) -> int | None:
        for i, t in enumerate(tokens):
            if t in self.stop_ids:
                return i
        return None

    def _text(self, n_tokens: int) -> tuple[str, int] | None:
        """Suggestion text of the first n tokens and its byte offset in the stream, or None while healing."""
        end = self._ends[n_tokens - 1] if n_tokens else 0
        data = bytes(self._data[:end])
        h = len(self.healed_bytes)
        if len(data) < h or not data.startswith(self.healed_bytes):
            return None
        return data[h:].decode("utf-8", errors="surrogateescape"), h

    def _tokens_for(self, char_pos: int, s: str, base: int) -> int:
        """Tokens to keep so that the first char_pos characters of s are covered."""
        cut_byte = base + len(s[:char_pos].encode("utf-8", errors="surrogateescape"))
        if cut_byte <= 0:
            return 0
        n = 0
        for i, _end in enumerate(self._ends):
            start = self._ends[i - 1] if i else 0
            if start >= cut_byte:
                break
            n = i + 1
        return n

    def __call__(self, tokens: Sequence[int]) -> int | None:
        """None to go on, or how many tokens to keep (see the module doc)."""
        self._sync(tokens)
        limit = len(tokens)
        stop_at = self._stop_index(tokens)
        if stop_at is not None:
            limit = stop_at
            self.reason = "stop token"
        got = self._text(limit)
        if got is None:
            return stop_at
        s, base = got
        cut = self.rules.find_cut(s, final=stop_at is not None)
        if cut is None:
            return stop_at
        self.reason = cut.reason
        return min(limit, self._tokens_for(cut.pos, s, base))

    def suggestion(self, tokens: Sequence[int], finish_reason: str | None = None) -> str:
        """The text to show after the cursor for the generated tokens ('' = nothing).

        finish_reason: the engine's; "length" drops an unfinished last line of a multi-line suggestion.
        """
        self._sync(tokens)
        limit = len(tokens)
        stop_at = self._stop_index(tokens)
        if stop_at is not None:
            limit = stop_at
        got = self._text(limit)
        if got is None:
            return ""
        s, _ = got
        s = s.encode("utf-8", errors="surrogateescape").decode("utf-8", errors="ignore")
        truncated = finish_reason == "length" and stop_at is None
        return postprocess(s, self.rules, truncated)
