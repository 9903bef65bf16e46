"""Where the cursor sits in the code's structure, and whether a suggestion keeps the code valid: tree-sitter,
for every language of completion/languages.py.

* `DocumentTree`: a document's tree kept across edits with tree-sitter's edit API (documents.Document owns
  one per open document of a known language); reparsed incrementally, lazily, when a request needs it.
* `site_at(text, offset, spec, tree=None)` picks the region around the cursor: the top-level construct that
  holds it, or, when that is bigger than MAX_REGION_BYTES (a long class), the largest statement or
  definition inside it that fits, parsed together with the headers and closing brackets of the constructs
  around it (tree-sitter's included ranges: the region parses as it does in the file, at a region's cost).
  It also finds the brackets still open at the start of the cursor line and the closers the lines below
  owe them (the stop rules let a continuation line close the first and keep the second open).
* `check(site, suggestion)` parses the region with the suggestion inserted and compares its ERROR and
  MISSING nodes with those the region has without it. Validity is "no worse than before": an error node
  that starts inside the inserted text, or one that overlaps no error the unfinished edit already had, is
  new. What passes on its own: a header without its body (the grammars accept an empty block), a bracket
  the user is still inside (its error was there before), and a `{` / `(` / `[` the suggestion opens at the
  end of one of its lines (judged with its closer appended: the user goes on to fill it). A suggestion with
  new errors is cut at the last clean point (line ends, then token boundaries of its first line) or
  dropped; the verdict says why.

Cost bound: one parse of the region without the suggestion, at most MAX_PARSES with it, each of at most
MAX_REGION_BYTES plus the suggestion; the error walk visits only nodes that hold errors.
"""

from __future__ import annotations

import ast
import itertools
import re
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

from tree_sitter import Node, Parser, Point, Range, Tree

from completiond.completion.languages import LanguageSpec, spec_of

MAX_REGION_BYTES = 8000
MAX_PARSES = 10
MAX_LEAVES = 4000          # bracket scans around the cursor line stop after this many tokens
MAX_SHIFTED_EDITS = 64     # edits a document's tree follows by the edit API alone before it is reparsed
MAX_ERRORS = 64            # error nodes collected per parse (the rest cannot change a verdict much)

_TOKEN = re.compile(r"\w+|\S")
_BLOCK_KEYWORD_OPENERS = ("then", "do", "in", "else", "{")        # Bash: a header waiting for fi / done / esac
_KEYWORD_CLOSERS = frozenset({"fi", "done", "esac", "}", "end"})


def is_python(language: str | None, path: str | None = None) -> bool:
    """The document is Python: the editor's language id, or the file's extension when none is given."""
    spec = spec_of(language, path)
    return spec is not None and spec.name == "python"


# -- documents' trees ----------------------------------------------------------------------------------------


def _point(text: str, offset: int) -> tuple[int, Point]:
    """(byte offset, tree-sitter point) of a character offset."""
    row = text.count("\n", 0, offset)
    ls = text.rfind("\n", 0, offset) + 1
    if text.isascii():
        return offset, Point(row, offset - ls)
    line_bytes = len(text[ls:offset].encode("utf-8", "surrogatepass"))
    before = len(text[:ls].encode("utf-8", "surrogatepass"))
    return before + line_bytes, Point(row, line_bytes)


def _end_point(start: Point, new: str) -> Point:
    nl = new.count("\n")
    if not nl:
        return Point(start.row, start.column + len(new.encode("utf-8", "surrogatepass")))
    return Point(start.row + nl, len(new[new.rfind("\n") + 1:].encode("utf-8", "surrogatepass")))


def encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


class DocumentTree:
    """One document's tree across edits: `edit` applies tree-sitter's edit API to the last tree (no parsing),
    `tree(text)` reparses incrementally when edits are pending. Thread-safe: the daemon edits on its event
    loop and parses on its worker. A tree handed out is never edited afterwards (edits go to a copy)."""

    def __init__(self, spec: LanguageSpec, text: str):
        self.spec = spec
        self._lock = threading.Lock()
        self._tree: Tree | None = None    # parsed for self._parsed, then edited towards self._text
        self._text = text                 # the text the pending edits lead to
        self._clean = False               # self._tree is a parse of self._text
        self._pending = 0                 # edits since the last parse
        self.parses = 0

    def edit(self, old_text: str, start: int, end: int, new: str, new_text: str | None = None) -> None:
        """old_text[start:end] became `new` (character offsets into old_text); new_text: the result, when the
        caller has it already (kept, not rebuilt)."""
        result = new_text if new_text is not None else old_text[:start] + new + old_text[end:]
        with self._lock:
            if self._tree is not None and (old_text is self._text or old_text == self._text):
                sb, sp = _point(old_text, start)
                eb, ep = _point(old_text, end)
                tree = self._tree.copy()
                tree.edit(start_byte=sb, old_end_byte=eb, new_end_byte=sb + len(encode(new)),
                          start_point=sp, old_end_point=ep, new_end_point=_end_point(sp, new))
                self._tree = tree
            elif old_text is not self._text and old_text != self._text:
                self._tree = None   # out of step with the text it was told about: the next parse starts over
            self._text = result
            self._clean = False
            self._pending += 1

    def reset(self, text: str) -> None:
        with self._lock:
            self._tree, self._text, self._clean = None, text, False

    def shifted(self, text: str) -> Tree | None:
        """A tree for `text` without parsing: the last parse with the edits since applied (tree-sitter's edit
        API moves its nodes), good for finding the construct around a cursor, not for its errors. None when
        there is none for this text (never parsed, or out of step)."""
        with self._lock:
            if self._tree is None or self._pending > MAX_SHIFTED_EDITS or (text is not self._text and text != self._text):
                return None
            return self._tree

    @property
    def stale(self) -> bool:
        return not self._clean

    def tree(self, text: str) -> Tree | None:
        """The tree of `text` (incremental when `text` is what the edits led to; else a fresh parse)."""
        lang = self.spec.language()
        if lang is None:
            return None
        with self._lock:
            if text is not self._text and text != self._text:
                return Parser(lang).parse(encode(text))
            if not self._clean or self._tree is None:
                self._tree = Parser(lang).parse(encode(text), self._tree) if self._tree is not None \
                    else Parser(lang).parse(encode(text))
                self._clean = True
                self._pending = 0
                self.parses += 1
            return self._tree


# -- the site ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Site:
    """The region around a cursor and what the stop rules need to know about it."""

    spec: LanguageSpec
    data: bytes                      # the region, UTF-8: the document, or in a long one the construct around the
                                     # cursor with the headers and closers of those around it, put together
    cursor: int                      # byte offset of the cursor in data
    ranges: tuple[tuple[int, int], ...]   # unused (kept empty): data is the region's pieces put together
    tree: Tree                       # the region's parse without the suggestion
    errors: tuple[tuple[int, int, bool, str], ...]   # its error nodes: (start, end, missing, type)
    open_before: tuple[str, ...] = ()    # brackets still open at the start of the cursor line, outermost first
    closed_below: int = 0            # closers in the lines below the cursor line owed to brackets open above them
    line_prefix: str = ""
    line_suffix: str = ""
    node_types: tuple[str, ...] = ()   # the cursor's ancestors in the region's tree, innermost first
    checkable: bool = True
    ms: float = 0.0                  # time spent finding it (parse included)


@dataclass(frozen=True)
class Verdict:
    text: str        # what to show
    outcome: str     # parses | cut | dropped | unjudged
    parses: int      # parses made for the verdict
    ms: float
    reason: str = ""   # why it was cut or dropped (the first new error), "" when it passed whole

    def stats(self) -> dict:
        out: dict = {"syntax_check": self.outcome, "syntax_parses": self.parses, "syntax_ms": round(self.ms, 3)}
        if self.reason:
            out["syntax_reason"] = self.reason
        return out


def _parser(spec: LanguageSpec, ranges: tuple[tuple[int, int], ...] | None, data: bytes) -> Parser | None:
    lang = spec.language()
    if lang is None:
        return None
    parser = Parser(lang)
    if ranges is not None:
        parser.included_ranges = [_range(data, a, b) for a, b in ranges]
    return parser


def _range(data: bytes, a: int, b: int) -> Range:
    return Range(_bpoint(data, a), _bpoint(data, b), a, b)


def _bpoint(data: bytes, b: int) -> Point:
    ls = data.rfind(b"\n", 0, b) + 1
    return Point(data.count(b"\n", 0, b), b - ls)


def _line_start(data: bytes, b: int) -> int:
    return data.rfind(b"\n", 0, b) + 1


def _region(spec: LanguageSpec, doc_tree: Tree, data: bytes, cursor: int) -> tuple[tuple[int, int], ...] | None:
    """Byte ranges to parse for the cursor: None for the whole document (it fits the bound), else the headers
    of the constructs around the region, the region, and their closing brackets."""
    if len(data) <= MAX_REGION_BYTES:
        return None
    root = doc_tree.root_node
    # The path from the top-level construct holding the cursor down to the smallest node around it.
    path: list[Node] = []
    node: Node | None = root.descendant_for_byte_range(max(0, cursor - 1), cursor)
    while node is not None and node != root:
        path.append(node)
        node = node.parent
    path.reverse()
    if not path:
        return _window(data, cursor)
    top = path[0]
    if top.end_byte - top.start_byte <= MAX_REGION_BYTES:
        return ((_line_start(data, top.start_byte), max(top.end_byte, cursor)),)
    units = spec.statements | spec.definitions
    # The outermost statement / definition on the path that fits; its enclosing constructs contribute
    # their headers (what precedes their first member) and their closing brackets.
    chosen = next((i for i, n in enumerate(path) if n.type in units and n.end_byte - n.start_byte <= MAX_REGION_BYTES
                   and i > 0), None)
    if chosen is None:
        return _window(data, cursor)
    region = path[chosen]
    heads: list[tuple[int, int]] = []
    tails: list[tuple[int, int]] = []
    for anc, child in itertools.pairwise(path[:chosen + 1]):
        first = next((c for c in anc.children if c.type in units or c == child or c.start_byte >= child.start_byte),
                     child)
        hb = first.start_byte
        if data.find(b"\n", anc.start_byte, hb) >= 0:
            hb = _line_start(data, hb)   # up to the header's line end: the region brings its own indentation
        if hb > anc.start_byte:
            heads.append((anc.start_byte, hb))
        last = anc.children[-1] if anc.child_count else None
        if last is not None and not last.is_named and last.type in spec.close_brackets and last.start_byte >= region.end_byte:
            tails.append((last.start_byte, last.end_byte))
    start = _line_start(data, region.start_byte)
    ranges = [r for r in heads if r[1] <= start] + [(start, max(region.end_byte, cursor))] + list(reversed(tails))
    merged: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
        elif b > a:
            merged.append((a, b))
    if sum(b - a for a, b in merged) > 2 * MAX_REGION_BYTES:
        return _window(data, cursor)
    return tuple(merged)


def _window(data: bytes, cursor: int) -> tuple[tuple[int, int], ...]:
    """No construct fits: the lines around the cursor (errors at its edges are in both parses alike)."""
    half = MAX_REGION_BYTES // 2
    a = _line_start(data, max(0, cursor - half))
    b = data.find(b"\n", min(len(data), cursor + half))
    return ((a, len(data) if b < 0 else b),)


def _shift(ranges: tuple[tuple[int, int], ...] | None, at: int, n: int) -> tuple[tuple[int, int], ...] | None:
    """The ranges after n bytes are inserted at byte `at` (a range holding `at` grows)."""
    if ranges is None:
        return None
    return tuple((a + n if a > at else a, b + n if b >= at else b) for a, b in ranges)


def errors_in(tree: Tree, limit: int = MAX_ERRORS) -> list[tuple[int, int, bool, str]]:
    """The tree's ERROR and MISSING nodes, (start byte, end byte, missing, type), in document order; only
    nodes holding errors are visited."""
    out: list[tuple[int, int, bool, str]] = []
    stack = [tree.root_node]
    while stack and len(out) < limit:
        n = stack.pop()
        if n.is_missing:
            out.append((n.start_byte, n.end_byte, True, n.type))
            continue
        if n.is_error:
            out.append((n.start_byte, n.end_byte, False, "ERROR"))
        if n.has_error:
            stack.extend(reversed(n.children))
    return sorted(out)


def _leaves(node: Node, spec: LanguageSpec, lo: int, hi: int) -> Iterator[Node]:
    """Leaf tokens of `node` in [lo, hi), strings and comments skipped whole, in order, bounded."""
    skip = spec.strings | spec.comments
    stack = [node]
    seen = 0
    while stack:
        n = stack.pop()
        if n.end_byte <= lo or n.start_byte >= hi:
            continue
        seen += 1
        if seen > MAX_LEAVES:
            return
        if n.type in skip and not n.is_error:
            continue
        if n.child_count == 0:
            yield n
        else:
            stack.extend(reversed(n.children))


def _brackets_around_line(spec: LanguageSpec, tree: Tree, data: bytes, ls: int, le: int) -> tuple[tuple[str, ...], int]:
    """(brackets open at the start of the cursor line, outermost first; closers below the line that close
    brackets open above it), within the statement that holds the line start."""
    root = tree.root_node
    node: Node | None = root.descendant_for_byte_range(ls, ls)
    holder: Node | None = None
    while node is not None:
        if node.start_byte < ls and (node.type in spec.strings or node.type in spec.comments):
            return (), 0   # the line starts inside a multi-line string or comment
        if node.start_byte < ls and (node.type in spec.statements or node.parent is None or node.parent == root
                                     or node.is_error):
            holder = node
            if node.type in spec.statements or node.parent == root or node.parent is None:
                break
        node = node.parent
    if holder is None:
        return (), 0
    pairs = dict(spec.brackets)
    closers = {c: o for o, c in spec.brackets}
    stack: list[str] = []
    for leaf in _leaves(holder, spec, holder.start_byte, ls):
        t = leaf.type
        if leaf.is_missing or _block_brace(spec, leaf):
            continue
        if t in pairs:
            stack.append(t)
        elif t in closers and stack:
            stack.pop()
    if not stack:
        return (), 0
    depth = 0
    owed = 0
    for leaf in _leaves(holder, spec, le, holder.end_byte):
        t = leaf.type
        if leaf.is_missing or _block_brace(spec, leaf):
            continue
        if t in pairs:
            depth += 1
        elif t in closers:
            if depth:
                depth -= 1
            else:
                owed += 1
    return tuple(stack), min(owed, len(stack))


def _block_brace(spec: LanguageSpec, leaf: Node) -> bool:
    """A brace of a block (a body), not a bracket of an expression: the stop rules' brackets are the latter."""
    parent = leaf.parent
    if parent is None:
        return False
    if parent.type in spec.blocks:
        return True
    # Error recovery flattens an unclosed body into an ERROR node: a `{` ending its line is taken for one.
    return parent.is_error and leaf.type == "{" and spec.body_opener == "{" and leaf.next_sibling is not None \
        and leaf.next_sibling.start_point.row > leaf.end_point.row


def _ancestors(tree: Tree, b: int) -> tuple[str, ...]:
    out: list[str] = []
    node: Node | None = tree.root_node.descendant_for_byte_range(max(0, b - 1), b)
    while node is not None and len(out) < 24:
        out.append(node.type)
        node = node.parent
    return tuple(out)


def site_at(text: str, offset: int, spec: LanguageSpec | str | None, tree: Tree | None = None,
            data: bytes | None = None) -> Site | None:
    """The Site around `offset`, or None when the language (a spec, or an LSP id or name) has no grammar
    here. tree: the document's own (DocumentTree.shifted or .tree), used to find the region in a long
    document; the whole document is parsed here when it is long and none is given."""
    if isinstance(spec, str):
        spec = spec_of(spec)
    if spec is None or spec.language() is None:
        return None
    t0 = time.perf_counter()
    data = encode(text) if data is None else data
    cursor = offset if len(data) == len(text) else len(encode(text[:offset]))   # ASCII: bytes are characters
    ls = text.rfind("\n", 0, offset) + 1
    le = text.find("\n", offset)
    le = len(text) if le < 0 else le
    if len(data) > MAX_REGION_BYTES:
        if tree is None:
            tree = Parser(spec.language()).parse(data)
        ranges = _region(spec, tree, data, cursor)
        if ranges is not None:
            # The region's pieces put together: every parse from here on reads only them.
            before = sum(min(b, cursor) - a for a, b in ranges if a < cursor)
            data = b"".join(data[a:b] for a, b in ranges)
            cursor = before
    parser = _parser(spec, None, data)
    assert parser is not None
    region_tree = parser.parse(data)
    bls = cursor - len(encode(text[ls:offset]))
    ble = min(len(data), cursor + len(encode(text[offset:le])))
    open_before, closed_below = _brackets_around_line(spec, region_tree, data, bls, ble)
    return Site(spec=spec, data=data, cursor=cursor, ranges=(), tree=region_tree,
                errors=tuple(errors_in(region_tree)), open_before=open_before, closed_below=closed_below,
                line_prefix=text[ls:offset], line_suffix=text[offset:le],
                node_types=_ancestors(region_tree, cursor), ms=1000 * (time.perf_counter() - t0),
                checkable=not _in_multiline_string(spec, region_tree, cursor, bls))


def _in_multiline_string(spec: LanguageSpec, tree: Tree, cursor: int, line_start: int) -> bool:
    """The cursor is inside a string that began on an earlier line (a docstring, a template literal): where it
    ends, and so what the code after it is, is not known while it is being typed. Nothing is judged there."""
    node: Node | None = tree.root_node.descendant_for_byte_range(cursor, cursor)
    while node is not None:
        if node.type in spec.strings and node.start_byte < line_start:
            return True
        node = node.parent
    return False


# -- the verdict ---------------------------------------------------------------------------------------------


@dataclass
class _Parse:
    errors: list[tuple[int, int, bool, str]]
    new: list[tuple[int, int, bool, str]] = field(default_factory=list)


def _inserted(site: Site, insert: bytes) -> Tree:
    data = site.data[:site.cursor] + insert + site.data[site.cursor:]
    ranges = _shift(site.ranges or None, site.cursor, len(insert))
    parser = _parser(site.spec, ranges, data)
    assert parser is not None
    if ranges is None:
        # Incremental from the region's own tree: only the inserted span is re-read.
        old = site.tree.copy()
        sp = _bpoint(site.data, site.cursor)
        ep = _end_point(sp, insert.decode("utf-8", "surrogatepass"))
        old.edit(start_byte=site.cursor, old_end_byte=site.cursor, new_end_byte=site.cursor + len(insert),
                 start_point=sp, old_end_point=sp, new_end_point=ep)
        return parser.parse(data, old)
    return parser.parse(data)


def _new_errors(site: Site, after: list[tuple[int, int, bool, str]], n: int) -> list[tuple[int, int, bool, str]]:
    """The errors of the parse with n bytes inserted at the cursor that the region did not have before."""
    a0, a1 = site.cursor, site.cursor + n

    def back(p: int) -> int:
        return p if p <= a0 else a0 if p < a1 else p - n

    new = []
    for e in after:
        s, t, missing, _ = e
        inside = (a0 < s < a1) if missing or s == t else (a0 <= s < a1 and n > 0)
        if inside:
            new.append(e)
            continue
        ms, mt = back(s), back(t)
        if not any(ms <= bt and bs <= mt for bs, bt, _, _ in site.errors):
            new.append(e)
    return new


def _open_at_line_ends(spec: LanguageSpec, s: str) -> str | None:
    """The closers for the brackets `s` leaves open when each of them ends a line of `s` (a block or a list
    the user goes on to fill), innermost first; None when one is left open mid-line. Strings and comments
    are not told apart here: the parse with the closers appended judges the result."""
    pairs = dict(spec.brackets)
    closers = {c: o for o, c in spec.brackets}
    stack: list[tuple[str, int]] = []
    for i, c in enumerate(s):
        if c in pairs:
            stack.append((c, i))
        elif c in closers and stack and stack[-1][0] == closers[c]:
            stack.pop()
    if not stack:
        return ""
    for _c, i in stack:
        rest = s[i + 1:]
        nl = rest.find("\n")
        if (rest if nl < 0 else rest[:nl]).strip():
            return None
    return "".join(pairs[c] for c, _ in reversed(stack))


def _describe(site: Site, data: bytes, e: tuple[int, int, bool, str]) -> str:
    s, t, missing, kind = e
    row = data.count(b"\n", 0, s) - site.data.count(b"\n", 0, site.cursor) + 1
    where = "on the cursor line" if row == 1 else f"on line {row} of the suggestion" if row > 1 else "above"
    if missing:
        return f"leaves a syntax error {where}: a missing {kind!r}"
    snippet = data[s:min(t, s + 24)].decode("utf-8", "replace").split("\n")[0]
    return f"adds a syntax error {where} at {snippet!r}"


def cuts(s: str, limit: int = MAX_PARSES, blank_line: bool = False) -> list[str]:
    """Up to `limit` shorter versions of the suggestion `s`, longest first: at each line end, then at token
    boundaries of the first line (on a line with nothing before the cursor, only cuts of two tokens or
    more: a lone name left of an unfinished line is no suggestion). Empty and blank cuts are left out."""
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
    bounds = [m.end() for m in _TOKEN.finditer(first)]
    least = 2 if blank_line else 1
    for k in range(len(bounds) - 1, least - 2, -1):
        if k < least - 1 or len(out) >= limit:
            break
        c = first[:bounds[k]].rstrip()
        if c.strip() and c != whole and (not out or c != out[-1]):
            out.append(c)
    return out


def _closers(site: Site, x: str) -> str:
    """The closers of the brackets open at the end of the cursor line with `x` typed (those earlier lines
    of the statement opened included, less those the lines below close), innermost first. Quoted text and
    line comments are skipped."""
    pairs = dict(site.spec.brackets)
    closers = {c: o for o, c in site.spec.brackets}
    stack = list(site.open_before)
    quote = ""
    text = site.line_prefix + x
    i = 0
    comment = site.spec.line_comment
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote or c == "\n":
                quote = ""
        elif c in "'\"`":
            quote = c
        elif c == "\n":
            pass
        elif text.startswith(comment, i):
            nl = text.find("\n", i)
            i = len(text) if nl < 0 else nl
            continue
        elif c in pairs:
            stack.append(c)
        elif c in closers and len(stack) > site.closed_below and stack[-1] == closers[c]:
            stack.pop()
        i += 1
    # The outermost brackets the lines below close stay open.
    return "".join(pairs[c] for c in reversed(stack[site.closed_below:]))


def check(site: Site, s: str) -> Verdict:
    """What of suggestion `s` to show at `site` (see the module doc). Never raises for any text."""
    t0 = time.perf_counter()
    count = 0
    seen: dict[str, list[tuple[int, int, bool, str]]] = {}
    trees: dict[str, list[tuple[int, int, bool, str]]] = {}
    reasons: list[str] = []
    data = site.data
    line_start = data.rfind(b"\n", 0, site.cursor) + 1
    le = data.find(b"\n", site.cursor)
    line_end = len(data) if le < 0 else le

    def errors_with(insert: str) -> list[tuple[int, int, bool, str]]:
        nonlocal count
        if insert not in trees:
            count += 1
            trees[insert] = errors_in(_inserted(site, encode(insert)))
        return trees[insert]

    def new_errors(insert: str) -> list[tuple[int, int, bool, str]]:
        if insert not in seen:
            raw = encode(insert)
            found = _new_errors(site, errors_with(insert), len(raw))
            if found and not reasons:
                reasons.append(_describe(site, data[:site.cursor] + raw + data[site.cursor:], found[0]))
            seen[insert] = found
        return seen[insert]

    def clean(insert: str) -> bool:
        if not new_errors(insert):
            return True
        # A bracket (a block's `{`) the suggestion opens at a line's end: judged with its closer appended.
        closing = _open_at_line_ends(site.spec, insert)
        if closing and count < MAX_PARSES:
            return not new_errors(insert + closing)
        if site.spec.name == "bash" and insert.rstrip().endswith(_BLOCK_KEYWORD_OPENERS):
            return all(m and k in _KEYWORD_CLOSERS for _, _, m, k in new_errors(insert))
        return False

    # The cursor line and the code line after it: an error there is the unfinished edit's.
    p = line_end
    while p < len(data):
        q = data.find(b"\n", p + 1)
        q = len(data) if q < 0 else q
        if data[p + 1:q].strip():
            break
        p = q
    near_end = min(len(data), max(line_end, p if p >= len(data) else q))

    def viable(insert: str) -> bool:
        """The statement being typed, with `insert` and then only its open brackets closed (and a body
        opener or a terminator), has no error left on its lines and the next code line: the suggestion
        heads where the user goes."""
        # As it is first (the lines below may close what it opens); then with the brackets the user is inside
        # closed, when the suggestion is balanced within them; then with the block it opens at its end closed.
        probes = [insert]
        inside = _closers(site, "")
        if inside and _closers(site, insert) == inside:
            probes.append(insert + inside)
        own = _open_at_line_ends(site.spec, insert)
        if own:
            probes.append(insert + own + inside)
        last = (site.line_prefix + insert).rsplit("\n", 1)[-1]
        if site.spec.name == "python" and _BLOCK_KEYWORDS.match(last) and not last.rstrip().endswith(":"):
            probes += [p + ":" for p in probes]   # a header whose colon is still to come
        for probe in probes:
            if count >= MAX_PARSES:
                return False
            size = len(encode(probe))
            end, data_end = near_end + size, len(data) + size
            # A closer missing at the very end of the region is owed by a construct opened above the line.
            if not any(a <= end and b >= line_start and not (missing and a >= data_end)
                       for a, b, missing, _ in errors_with(probe)):
                return True
        return False

    # Unfinished here: an error on the cursor line or the next code line before anything is inserted.
    unfinished = any(a <= near_end and b >= line_start for a, b, _, _ in site.errors)
    on_line = any(a <= line_end and b >= line_start for a, b, _, _ in site.errors)

    def done(text: str, outcome: str) -> Verdict:
        reason = reasons[0] if reasons and outcome in ("cut", "dropped") else ""
        return Verdict(text, outcome, count, 1000 * (time.perf_counter() - t0), reason)

    try:
        if not s.strip():
            return done(s, "parses")
        if not site.checkable:
            return done(s, "unjudged")
        blank = not site.line_prefix.strip()
        if site.spec.name == "python":
            gate = _PythonGate.at(site)
            if gate is not None:
                # Python's own parser decides where it can: stricter than the grammar (which takes Python 2
                # statements and bodiless headers), with a header's body and colon still to come allowed.
                count += gate.parses
                for c in [s, *cuts(s, MAX_PARSES, blank)]:
                    if count + 2 > MAX_PARSES:
                        break
                    fine, used = gate.ok(c)
                    count += used
                    if fine:
                        return done(c, "parses" if c == s else "cut")
                reasons.append("adds a syntax error: the line does not become valid Python")
                return done("", "dropped")
        if unfinished:
            # The suggestion, or the longest cut of it, must leave the statement finishable. Where the text
            # without it is not finishable either (broken further on), it must only add no error.
            if viable(s):
                return done(s, "parses")
            for c in cuts(s, MAX_PARSES, blank):
                if count >= MAX_PARSES - 2:
                    break
                if viable(c):
                    if not reasons:
                        reasons.append("only part of it leaves the line being typed finishable")
                    return done(c, "cut")
            if on_line or viable(""):
                # The unfinished edit is this line's: what does not finish it is not shown.
                if not reasons:
                    reasons.append("leaves the line being typed unfinishable")
                return done("", "dropped")
        if clean(s):
            return done(s, "unjudged" if unfinished else "parses")
        # A cut keeping a token the parser could not place (an error past the start of the suggestion) cannot
        # be clean: those are not tried.
        first_new = min((e[0] for e in seen.get(s, []) if not e[2] and e[0] > site.cursor), default=None)
        limit_at = None if first_new is None else first_new - site.cursor
        for c in cuts(s, MAX_PARSES, blank):
            if count >= MAX_PARSES:
                break
            if limit_at is not None and limit_at < len(encode(c)):
                continue
            if clean(c):
                return done(c, "cut")
        return done("", "dropped")
    except (ValueError, RuntimeError, MemoryError, RecursionError) as exc:   # a parser refusing the text
        return Verdict(s, "unjudged", count, 1000 * (time.perf_counter() - t0), f"not judged: {exc}")


_BLOCK_KEYWORDS = re.compile(r"\s*(?:async\s+)?(?:def|class|if|elif|else|for|while|with|try|except|finally|match|case)\b")


@dataclass
class _PythonGate:
    """`ast` on the region around the cursor (its included ranges put together), where it applies: the region
    parses as it is, or with the cursor line set aside (the user is mid-edit on this line, not elsewhere)."""

    head: str        # the region up to the cursor
    line_suffix: str
    rest: str        # the region after the cursor line
    indent: str      # the cursor line's indentation
    parses: int      # ast.parse calls made to decide it applies
    site: Site

    @classmethod
    def at(cls, site: Site) -> _PythonGate | None:
        head = site.data[:site.cursor].decode("utf-8", "replace")
        tail = site.data[site.cursor:].decode("utf-8", "replace")
        if head[:1] in " \t":
            head = "if 1:\n" + head   # an indented region (lines around the cursor) parses as a block's body
        nl = tail.find("\n")
        line_suffix, rest = (tail, "") if nl < 0 else (tail[:nl], tail[nl:])
        line = site.line_prefix + site.line_suffix
        if '"""' in line or "'''" in line or site.line_prefix.rstrip().endswith(("'", '"')):
            return None   # a triple-quoted string opens or closes here: setting the line aside says nothing
        indent = line[:len(line) - len(line.lstrip(" \t"))]
        line_head = head[:len(head) - len(site.line_prefix)]
        gate = cls(head, line_suffix, rest, indent, 1, site)
        if error_at(head + tail) is None:
            return gate
        # The cursor line set aside: a statement in its place, a header when the next code line is deeper
        # (the body below stays a body), nothing for a continuation line inside brackets.
        nxt = next((ln for ln in rest.split("\n")[1:40] if ln.strip() and not ln.lstrip().startswith("#")), "")
        deeper = len(nxt) - len(nxt.lstrip(" \t")) > len(indent)
        stand_ins = [""] if site.open_before else [indent + ("if 1:" if deeper else "pass"), ""]
        for stand_in in stand_ins:
            gate.parses += 1
            if error_at(line_head + stand_in + rest) is None:
                return gate
        return None

    def ok(self, t: str) -> tuple[bool, int]:
        """(the region parses with `t` inserted, or would with the brackets the user is inside closed and the
        header it writes given its colon and body; ast.parse calls made)."""
        line = self.head + t + self.line_suffix
        if error_at(line + self.rest) is None:
            return True, 1
        used = 1
        closing = _closers(self.site, t + self.line_suffix)
        # A bracket the user is still inside: opened before the cursor, t balanced within it.
        lines = [line + closing] if closing and closing == _closers(self.site, self.line_suffix) else [line]
        body = "\n" + self.indent + "    pass"
        for full in lines:
            last = full[full.rfind("\n") + 1:]
            if last.rstrip().endswith(":"):
                full += body
            elif _BLOCK_KEYWORDS.match(last) and last.strip():
                full += ":" + body
            elif full == line:
                continue
            used += 1
            if error_at(full + self.rest) is None:
                return True, used
        return False, used


def unit_end(site: Site, s: str) -> int | None:
    """Where in suggestion `s` the statement that begins at the cursor ends (a character offset into s), when
    it ends before s does; None when s holds no more than that statement, or none begins at the cursor.
    Parsed with s inserted (the region, as check does): the statement is the grammar's own, so a compound
    statement ends after its body and a simple one at its end, in every language."""
    raw = encode(s)
    tree = _inserted(site, raw)
    a0, a1 = site.cursor, site.cursor + len(raw)
    node: Node | None = tree.root_node.descendant_for_byte_range(a0, a0)
    best = None
    while node is not None and node.start_byte == a0:
        if node.type in site.spec.statements and not node.has_error and node.end_byte <= a1:
            best = node   # the outermost statement that starts here and ends inside the suggestion
        node = node.parent
    if best is None or not raw[best.end_byte - a0:].strip():
        return None
    return len(raw[:best.end_byte - a0].decode("utf-8", "replace"))


# -- whole-file checks (the eval's judge) --------------------------------------------------------------------


def parses(source: str, spec: LanguageSpec | None = None) -> bool:
    """Whether `source` is valid: Python by its own parser (`ast`: only the parser runs, no code), other
    languages by their tree-sitter grammar (no ERROR or MISSING node)."""
    if spec is None or spec.name == "python":
        return error_at(source) is None
    lang = spec.language()
    if lang is None:
        return True
    return not Parser(lang).parse(encode(source)).root_node.has_error


def error_at(source: str) -> int | None:
    """None when `source` is valid Python syntax, else the offset in it where the parser reports its
    first error (len(source) when it names no place). Only the parser runs (no compile, no code)."""
    with warnings.catch_warnings():
        # Invalid escape sequences and the like are warnings of the parser, not errors.
        warnings.simplefilter("ignore", SyntaxWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            ast.parse(source)
        except SyntaxError as exc:   # IndentationError included
            if not exc.lineno:
                return len(source)
            pos = 0
            for _ in range(exc.lineno - 1):
                nl = source.find("\n", pos)
                if nl < 0:
                    return len(source)
                pos = nl + 1
            return min(len(source), pos + max(0, (exc.offset or 1) - 1))
        except (ValueError, MemoryError, RecursionError):
            return len(source)
    return None
