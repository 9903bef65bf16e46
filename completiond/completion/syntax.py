"""Python only: where the cursor sits in the code's structure, and whether a suggestion keeps it valid.

Two uses, both on a bounded region of the document (never the whole file):

* `site_at(text, offset)` finds the enclosing top-level block around the cursor (or, when that block
  is too big, the largest enclosing block that fits MAX_REGION_CHARS: a method of a long class) and
  scans it for the brackets still open at the start of the cursor line and the closers the lines
  below owe them. The stop rules use those so a continuation line (`foo(a,\\n    b|`) may close the
  bracket an earlier line opened, and may not close one a later line closes.
* `check(site, suggestion)` parses the region with the suggestion inserted. If that does not parse,
  the longest cut of the suggestion that does is shown (cuts at line ends, then at token boundaries
  of the first line); if no cut parses but the region parses with nothing inserted, the suggestion
  would break valid code and nothing is shown. If it does not parse with nothing inserted either, the
  user is mid-edit: on the cursor line itself when the region parses with that line set aside (then
  a suggestion that does not complete the line into valid code is not shown either), else somewhere
  else in the region. There the parser's first error decides: broken above the cursor, nothing can be
  judged and the suggestion passes unchanged; broken at or below it, the suggestion must let the parser
  get past the inserted text and no earlier than before (past the cursor line and the code line after
  it, when the parser stopped on one of them: the suggestion must complete this edit), else it is cut
  before the point where the parser stops inside it, or not shown. While a triple-quoted string is
  being typed at the cursor the region's end is unknown, and nothing is judged (a one-line string ends
  at its line).

Cost bound: at most MAX_PARSES calls of `ast.parse`, each on at most MAX_REGION_CHARS characters (plus
the suggestion), and one regex scan of the region. Region finding walks at most MAX_REGION_CHARS
characters each way from the cursor line.
"""

from __future__ import annotations

import ast
import re
import time
import warnings
from dataclasses import dataclass

MAX_REGION_CHARS = 8000
MAX_PARSES = 10
PYTHON_EXTENSIONS = (".py", ".pyi")

_PAIRS = {"(": ")", "[": "]", "{": "}"}
_CLOSERS = frozenset(_PAIRS.values())
_CONTINUES = re.compile(r"(?:else|elif|except|finally)\b")
# What a bracket scan of Python must skip: comments and strings (triple-quoted ones across lines;
# the others end at their line). A triple-quoted string left open runs to the end of the text.
_SCAN = re.compile(
    r"#[^\n]*"
    r'|"""(?:[^"\\]|\\.|"(?!""))*(?P<d3>"""|\Z)'
    r"|'''(?:[^'\\]|\\.|'(?!''))*(?P<s3>'''|\Z)"
    r'|"(?:[^"\\\n]|\\.)*(?:"|$)'
    r"|'(?:[^'\\\n]|\\.)*(?:'|$)"
    r"|[()\[\]{}]",
    re.S | re.M)
_TOKEN = re.compile(r"\w+|\S")
# How a statement can start: a keyword, a decorator, a literal or bracket, or a name followed by what
# follows names in code (an operator, a call, an index, an annotation, a comma) or nothing.
# Docstring prose (`Generic utilities.`, `.. versionchanged::`) does not match.
_STATEMENT = re.compile(
    r"(?:def|class|async|if|for|while|try|with|return|import|from|raise|assert|del|pass|break|continue|global"
    r"|nonlocal|yield|await|lambda|not|match|case|type)\b"
    r"|[@\"'(\[{0-9*~-]"
    r"|[A-Za-z_][\w.]*\s*(?:[-=(\[:.,+*/%|&^<>!@;]|$)")


def is_python(language: str | None, path: str | None = None) -> bool:
    """The document is Python: the editor's language id, or the file's extension when none is given."""
    if language:
        return language.lower() in ("python", "python3")
    return bool(path) and str(path).lower().endswith(PYTHON_EXTENSIONS)


@dataclass(frozen=True)
class Site:
    """The region around a cursor in a Python document: head + insertion + tail is what gets parsed."""

    head: str                       # the region up to the cursor (after a wrapper line if it is nested)
    tail: str                       # the region from the cursor to its end
    open_before: tuple[str, ...]    # brackets still open at the start of the cursor line, outermost first
    closed_below: int               # closers in the lines below the cursor line that close brackets open above
                                    # them (0 when no bracket is open at the cursor)
    line_prefix: str = ""           # the cursor line up to the cursor (the end of head)
    line_suffix: str = ""           # the cursor line from the cursor (the start of tail)
    # False while a string is being typed at the cursor (or the cursor is inside a triple-quoted one): where
    # the region ends is then unknown (a docstring's lines look like code), so no verdict is given.
    checkable: bool = True


@dataclass(frozen=True)
class Verdict:
    text: str        # what to show
    outcome: str     # parses | cut | dropped (breaks valid code) | unjudged (mid-edit elsewhere)
    parses: int      # ast.parse calls made
    ms: float

    def stats(self) -> dict:
        return {"syntax_check": self.outcome, "syntax_parses": self.parses, "syntax_ms": round(self.ms, 3)}


def scan_brackets(code: str) -> tuple[list[str], int, bool]:
    """(brackets open at the end of code, innermost last; closers that had no opener; whether code
    ends inside a triple-quoted string). Comments and strings are skipped."""
    stack: list[str] = []
    unmatched = 0
    in_string = False
    for m in _SCAN.finditer(code):
        tok = m.group()
        c = tok[0]
        in_string = False
        if c in _PAIRS:
            stack.append(c)
        elif c in _CLOSERS:
            if stack:
                stack.pop()   # a wrong kind is a syntax error the parse reports; depth is what counts here
            else:
                unmatched += 1
        elif m.group("d3") == "" or m.group("s3") == "":
            in_string = True
    return stack, unmatched, in_string


def _line_kind(line: str) -> tuple[int, str] | None:
    """(indentation, kind) of a code line, None for blank and comment lines. kind: stmt (may start a
    statement), continue (else/elif/except/finally: part of the statement above), closer (ends a bracket)."""
    body = line.lstrip(" \t")
    if not body.strip() or body.startswith("#"):
        return None
    indent = len(line[: len(line) - len(body)].expandtabs(8))   # the tokenizer's tab stops
    if body[0] in _CLOSERS:
        return indent, "closer"
    if _CONTINUES.match(body):
        return indent, "continue"
    if not _STATEMENT.match(body):
        return None   # prose (a docstring's lines): neither starts nor ends a block
    return indent, "stmt"


def _continued(text: str, s: int) -> bool:
    """The code line before the line starting at `s` does not end its statement (it ends in a comma, an
    opening bracket, a backslash or an operator), so that line is a continuation, not a statement start."""
    e = s - 1
    for _ in range(50):   # blank and comment lines between are skipped, a bounded number of them
        if e < 0:
            return False
        b = text.rfind("\n", 0, e) + 1
        line = text[b:e].strip()
        if line and not line.startswith("#"):
            return line.endswith(_CONTINUATION_ENDINGS)
        e = b - 1
    return False


_CONTINUATION_ENDINGS = tuple(",([{\\+-*/%&|^=<>.@")


def _enclosing(text: str, ls: int, le: int) -> list[tuple[int, int]]:
    """(start, indentation) of the lines that may start a block enclosing the cursor line, innermost
    first, within MAX_REGION_CHARS above it: each is less indented than every code line after it."""
    out: list[tuple[int, int]] = []
    bound: int | None = None
    floor = max(0, ls - MAX_REGION_CHARS)
    s, e = ls, le
    while True:
        kind = _line_kind(text[s:e])
        if kind is not None:
            indent, what = kind
            if (bound is None or indent < bound) and not (what == "stmt" and _continued(text, s)):
                if what == "stmt":
                    out.append((s, indent))
                    bound = indent
                    if indent == 0:
                        break
                else:
                    bound = indent + 1   # its statement starts on an earlier line at this indentation or less
        if s <= floor:
            break
        e = s - 1
        s = text.rfind("\n", 0, e) + 1
    return out


def _block_end(text: str, le: int, start: int, indent: int) -> int | None:
    """Where the block starting at `start` with `indent` ends after the cursor line (the next line that
    starts a statement at that indentation or less); None past MAX_REGION_CHARS."""
    p = le + 1
    decorated = text[text.rfind("\n", 0, le) + 1:le].lstrip().startswith("@")
    while p < len(text):
        q = text.find("\n", p)
        q = len(text) if q < 0 else q
        kind = _line_kind(text[p:q])
        if kind is not None:
            ind, what = kind
            # The definition a decorator line decorates belongs to the decorator's statement.
            if ind < indent and what != "closer" or ind == indent and what == "stmt" and not decorated:
                return p if p - start <= MAX_REGION_CHARS else None
            decorated = text[p:q].lstrip().startswith("@")
        if q - start > MAX_REGION_CHARS:
            return None
        p = q + 1
    return len(text) if len(text) - start <= MAX_REGION_CHARS else None


def site_at(text: str, offset: int) -> Site | None:
    """The Site around `offset` in Python `text`, or None when no enclosing block fits the bound."""
    ls = text.rfind("\n", 0, offset) + 1
    le = text.find("\n", offset)
    le = len(text) if le < 0 else le
    for start, indent in reversed(_enclosing(text, ls, le)):   # the outermost block that fits
        if offset - start > MAX_REGION_CHARS:
            continue
        end = _block_end(text, le, start, indent)
        if end is None:
            continue
        stack, _, in_string = scan_brackets(text[start:ls])
        closed_below = scan_brackets(text[le + 1:end])[1] if le < end else 0
        # A nested block is parsed as the body of a wrapper statement, so its indentation is legal.
        wrap = "if 1:\n" if indent else ""
        before: tuple[str, ...] = () if in_string else tuple(stack)
        return Site(head=wrap + text[start:offset], tail=text[offset:end], line_prefix=text[ls:offset],
                    line_suffix=text[offset:le], open_before=before,
                    closed_below=closed_below if before or scan_brackets(text[ls:offset])[0] else 0,
                    checkable=not in_string and not _typing_string(text[ls:offset]))
    return None


def _typing_string(line_prefix: str) -> bool:
    """The cursor line's text ends inside a triple-quoted string literal, or with `""` / `''` (a triple
    quote half typed). A one-line string left open ends at its line whatever follows, so the region is
    known and a suggestion inside it is judged like any other (it must close the string to parse)."""
    last = None
    for m in _SCAN.finditer(line_prefix):
        last = m.group()
    if last is None or last[0] not in "'\"":
        return False
    if last[:3] in ('"""', "'''"):
        return len(last) < 6 or not last.endswith(last[:3])
    return last in ('""', "''") and line_prefix.endswith(last)


def parses(source: str) -> bool:
    """Whether `source` is valid Python syntax. Only the parser runs (no compile, no code)."""
    return error_at(source) is None


def error_at(source: str) -> int | None:
    """None when `source` is valid Python syntax, else the offset in it where the parser reports its
    first error (len(source) when it names no place). Only the parser runs (no compile, no code)."""
    with warnings.catch_warnings():
        # Invalid escape sequences and the like are warnings of the parser, not errors. (The filter
        # is process-wide while it is set; these categories are all it touches.)
        warnings.simplefilter("ignore", SyntaxWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            ast.parse(source)
        except SyntaxError as exc:   # IndentationError included
            if str(exc.msg).endswith("was never closed"):
                # Reported at the opener, but found at the end: the parser read everything after it.
                return len(source)
            return _offset(source, exc.lineno, exc.offset)
        except (ValueError, MemoryError, RecursionError):
            # ValueError: NUL characters (before 3.12); MemoryError / RecursionError: nesting too deep.
            return len(source)
    return None


def _offset(source: str, lineno: int | None, col: int | None) -> int:
    """The character offset of (1-based line, 1-based column) in source, clamped to it."""
    if not lineno:
        return len(source)
    pos = 0
    for _ in range(lineno - 1):
        nl = source.find("\n", pos)
        if nl < 0:
            return len(source)
        pos = nl + 1
    return min(len(source), pos + max(0, (col or 1) - 1))


def cuts(s: str, limit: int = MAX_PARSES) -> list[str]:
    """Up to `limit` shorter versions of the suggestion `s`, longest first: at each line end, then at
    token boundaries of the first line. Empty and whitespace-only cuts are left out."""
    out: list[str] = []
    ends = [m.start() for m in re.finditer("\n", s)]
    for p in reversed(ends):
        c = s[:p].rstrip()
        if len(out) >= limit:
            return out
        if c.strip() and (not out or c != out[-1]):
            out.append(c)
    first = s[: ends[0]] if ends else s
    whole = first.rstrip()
    # Token ends of the first line, last first; only as many as may be tried.
    bounds = [m.end() for m in _TOKEN.finditer(first)]
    for e in reversed(bounds[-(limit + 2):]):
        c = first[:e].rstrip()
        if len(out) >= limit:
            break
        if c.strip() and c != whole and (not out or c != out[-1]):
            out.append(c)
    return out


def check(site: Site, s: str) -> Verdict:
    """What of suggestion `s` to show at `site` (see the module doc). Never raises for any text."""
    t0 = time.perf_counter()
    count = 0

    errors: dict[str, int | None] = {}   # insertion -> where the region with it fails to parse

    def ok(insert: str) -> bool:
        nonlocal count
        if insert not in errors:
            count += 1
            errors[insert] = error_at(site.head + insert + site.tail)
        return errors[insert] is None

    def done(text: str, outcome: str) -> Verdict:
        return Verdict(text, outcome, count, 1000 * (time.perf_counter() - t0))

    if not site.checkable:
        return done(s, "unjudged")
    if not s.strip() or ok(s):
        return done(s, "parses")
    for c in cuts(s, MAX_PARSES - 4):
        if count >= MAX_PARSES - 3:   # three parses stay for the nothing-inserted, cursor-line and mid-edit tests
            break
        if ok(c):
            return done(c, "cut")
    if ok(""):
        return done("", "dropped")
    if not site.open_before:
        count += 1
        if _only_this_line_is_broken(site):
            # The user is mid-edit here, not elsewhere: the block parses with the cursor line set aside,
            # and neither the suggestion nor any cut of it completes that line into valid code.
            return done("", "dropped")
    # Mid-edit: the region is broken with nothing inserted, so no insertion parses. When the parser got past
    # the cursor without the suggestion, the suggestion is judged by where the parser stops with it: past
    # the inserted text, and no earlier than the floor below. If it stops inside the suggestion, the text
    # before that point is tried once; otherwise nothing is shown.
    p, e0 = len(site.head), errors[""]
    if e0 is None or e0 < p:
        return done(s, "unjudged")   # broken above the cursor: nothing to compare with
    # An error on the cursor line or the code line after it is taken to be this edit's: the suggestion
    # must get the parser past both (a line left unfinished leaves the next one dangling: `@pyt` above
    # `    name="x",`). One further below is someone else's: the parser must get no less far than before.
    near = _next_code_line_end(site.tail, len(site.line_suffix))
    floor = p + near + 1 if e0 <= p + near else e0

    def consistent(insert: str) -> bool:
        # An error at the very end (an unclosed bracket or block at the end of the file) is no place: the
        # parser read everything, and an unfinished region may end that way with any good suggestion.
        e = errors[insert]
        end = len(site.head) + len(insert) + len(site.tail)
        return e is not None and e >= p + len(insert) and (e - len(insert) >= floor or e == end)

    if consistent(s):
        return done(s, "unjudged")
    e1 = errors[s]
    if e1 is not None and p <= e1 < p + len(s) and count < MAX_PARSES:
        c = _cut_before(s, e1 - p)
        if c.strip() and (ok(c) or consistent(c)):
            return done(c, "cut")
    return done("", "dropped")


def _next_code_line_end(tail: str, line_end: int) -> int:
    """In tail (starting at the cursor, its cursor line ending at `line_end`), where the first line below
    the cursor line that is not blank or a comment ends (line_end when there is none)."""
    p = line_end
    while p < len(tail):
        q = tail.find("\n", p + 1)
        q = len(tail) if q < 0 else q
        line = tail[p + 1:q].strip()
        if line and not line.startswith("#"):
            return q
        p = q
    return line_end


def _cut_before(s: str, at: int) -> str:
    """s cut before offset `at`, back to the last whole token (or line end) before it, right-trimmed."""
    head = s[:at]
    if at < len(s) and head and (head[-1].isalnum() or head[-1] == "_") and (s[at].isalnum() or s[at] == "_"):
        # The error is inside a word: not half of it. A loop, not re.sub(r"\w+$"), whose search backtracks
        # quadratically over long runs of word characters.
        end = len(head)
        while end > 0 and (head[end - 1].isalnum() or head[end - 1] == "_"):
            end -= 1
        head = head[:end]
    return head.rstrip()


def _only_this_line_is_broken(site: Site) -> bool:
    """The region parses with the cursor line replaced by `pass` at its indentation (a continuation line
    inside brackets is never set aside: callers check open_before)."""
    line = site.line_prefix + site.line_suffix
    indent = line[: len(line) - len(line.lstrip(" \t"))]
    head = site.head[: len(site.head) - len(site.line_prefix)]
    tail = site.tail[len(site.line_suffix):]
    return parses(head + indent + "pass" + tail)
