"""Post-processing of a finished suggestion (completion/stops.py): the final cut, whitespace the buffer
already has, an unfinished or dangling last line, the end that repeats the text right of the cursor, an
operand put in front of the one already there, the syntactic unit the cursor began, and the syntax check.
"""

from __future__ import annotations

from completiond.completion.stops_text import (
    BLOCK_OPENER_ENDINGS,
    CLOSERS,
    TextRules,
    _only_closers,
    _suffix_closers,
    bracket_scan,
    indent_width,
    outside_strings,
)
from completiond.completion.syntax import check, unit_end


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
        return False  # inside a string, the quote right of the cursor closes it (`'binary.f|')` + "ile")
    nxt, last = line_suffix[0], body[-1]
    if not (nxt in "'\"" or _is_word_char(nxt)):
        return False
    if last in CLOSERS:
        return True
    if last in "'\"":
        return nxt not in "'\""  # the string just closed; two literals in a row are a concatenation
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
    keep_newline = (
        rules.multiline and "\n" in s and rules.line_suffix.strip() != "" and _only_closers(rules.line_suffix)
    )
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
        rules.syntax = check(rules.site, s, ends_line=not truncated and not rules.went_on)
        s = rules.syntax.text
    return s
