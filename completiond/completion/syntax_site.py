"""The region around a cursor (completion/syntax.py's middle layer): which part of a document is parsed for
a request, what brackets are open at the cursor line, and the region parsed with text put in.

* `site_at(text, offset, spec, tree=None)` picks the region around the cursor: the top-level construct that
  holds it, or, when that is bigger than MAX_REGION_BYTES (a long class), the largest statement or
  definition inside it that fits, put together with the headers and closing brackets of the constructs
  around it (the region parses as it does in the file, at a region's cost). It also finds the brackets
  still open at the start of the cursor line and the closers the lines below owe them (the stop rules let
  a continuation line close the first and keep the second open).
* `inserted(site, text)` and `replaced_line(site, text)`: the region parsed (incrementally, from the
  region's own tree) with text inserted at the cursor, or in place of the cursor line.
* `stand_ins(site)`: lines that could stand where the cursor line is, so that the lines below read as they
  were written: the brackets the lines below close without opening them, opened; those the lines above left
  open and nothing below closes, closed (a `{` above `    return x;` / `}`).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

from tree_sitter import Node, Parser, Query, QueryCursor, QueryError, Tree

from completiond.completion.languages import LanguageSpec, spec_of
from completiond.completion.syntax_tree import DocumentTree, Error, edited_tree, encode, errors_in

MAX_REGION_BYTES = 8000
MAX_LEAVES = 4000  # bracket scans around the cursor line stop after this many tokens


@dataclass(frozen=True)
class Site:
    """The region around a cursor and what the stop rules need to know about it."""

    spec: LanguageSpec
    data: bytes  # the region, UTF-8: the document, or in a long one the construct around the
    # cursor with the headers and closers of those around it, put together
    cursor: int  # byte offset of the cursor in data
    tree: Tree  # the region's parse without the suggestion
    errors: tuple[Error, ...]  # its error nodes: (start, end, missing, type)
    open_before: tuple[str, ...] = ()  # brackets still open at the start of the cursor line, outermost first
    closed_below: int = 0  # closers in the lines below the cursor line owed to brackets open above them
    line_prefix: str = ""
    line_suffix: str = ""
    node_types: tuple[str, ...] = ()  # the cursor's ancestors in the region's tree, innermost first
    checkable: bool = True
    partial: bool = False  # the region is a window of lines, not whole constructs (none fits)
    ms: float = 0.0  # time spent finding it (parse included)
    parsed: str = "fresh"  # how the region's tree was had (DocumentTree.region): fresh | incremental | kept


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
        # With the broken constructs beside it: an unfinished cursor line can end its construct early (the
        # rest of a body then reads as errors at the top level) or merge the one above into an error.
        a, b = top.start_byte, max(top.end_byte, cursor)
        nxt = top.next_sibling
        while nxt is not None and nxt.end_byte - a <= MAX_REGION_BYTES and nxt.type not in spec.definitions:
            if nxt.is_error or nxt.has_error:
                b = nxt.end_byte  # the lines below up to the stray closer or error the cut-short construct left
            nxt = nxt.next_sibling
        prv = top.prev_sibling
        while prv is not None and (prv.is_error or prv.has_error) and b - prv.start_byte <= MAX_REGION_BYTES:
            a, prv = prv.start_byte, prv.prev_sibling
        return ((_line_start(data, a), b),)
    units = spec.statements | spec.definitions
    # The outermost statement / definition on the path that fits; its enclosing constructs contribute
    # their headers (what precedes their first member) and their closing brackets.
    chosen = next(
        (i for i, n in enumerate(path) if n.type in units and n.end_byte - n.start_byte <= MAX_REGION_BYTES and i > 0),
        None,
    )
    if chosen is None:
        return _window(data, cursor)
    region = path[chosen]
    heads: list[tuple[int, int]] = []
    tails: list[tuple[int, int]] = []
    for anc, child in itertools.pairwise(path[: chosen + 1]):
        first = next(
            (c for c in anc.children if c.type in units or c == child or c.start_byte >= child.start_byte), child
        )
        hb = first.start_byte
        if data.find(b"\n", anc.start_byte, hb) >= 0:
            hb = _line_start(data, hb)  # up to the header's line end: the region brings its own indentation
        if hb > anc.start_byte:
            heads.append((anc.start_byte, hb))
        last = anc.children[-1] if anc.child_count else None
        if (
            last is not None
            and not last.is_named
            and last.type in spec.close_brackets
            and last.start_byte >= region.end_byte
        ):
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


@functools.cache
def _bracket_query(spec: LanguageSpec) -> Query | None:
    """A query for the bracket tokens and the strings and comments of the language (None: none to ask)."""
    lang = spec.language()
    if lang is None:
        return None
    kinds = sorted({k for pair in spec.brackets for k in pair if lang.id_for_node_kind(k, False)})
    skip = sorted(k for k in spec.strings | spec.comments if lang.id_for_node_kind(k, True))
    if not kinds:
        return None
    source = "[" + " ".join(json.dumps(k) for k in kinds) + "] @bracket"
    if skip:
        source += "\n[" + " ".join(f"({k})" for k in skip) + "] @skip"
    try:
        return Query(lang, source)
    except QueryError:
        return None


def _brackets(node: Node, spec: LanguageSpec, lo: int, hi: int) -> list[Node]:
    """The bracket tokens among _leaves(node, spec, lo, hi), in order: found by a query (in tree-sitter's C)
    where the walk's bound cannot cut the walk short, else by the walk."""
    kinds = {k for pair in spec.brackets for k in pair}
    if hi <= lo:
        return []  # (only a token wider than a bracket spans an empty range's edges)
    query = _bracket_query(spec)
    if query is not None and node.descendant_count <= MAX_LEAVES:
        cursor = QueryCursor(query)
        cursor.set_byte_range(lo, hi)
        found = cursor.captures(node)
        if not cursor.did_exceed_match_limit:
            # Strings and comments (nested ones too) merged into disjoint spans: a bracket in one is skipped,
            # as the walk skips their subtrees.
            starts: list[int] = []
            ends: list[int] = []
            for a, b in sorted((n.start_byte, n.end_byte) for n in found.get("skip", ())):
                if ends and a < ends[-1]:
                    ends[-1] = max(ends[-1], b)
                else:
                    starts.append(a)
                    ends.append(b)
            out = []
            for n in sorted(found.get("bracket", ()), key=lambda n: n.start_byte):
                p = n.start_byte
                if n.end_byte > lo and p < hi:
                    i = bisect.bisect_right(starts, p) - 1
                    if i < 0 or p >= ends[i]:
                        out.append(n)
            return out
    return [n for n in _leaves(node, spec, lo, hi) if n.type in kinds]


def _brackets_around_line(spec: LanguageSpec, tree: Tree, data: bytes, ls: int, le: int) -> tuple[tuple[str, ...], int]:
    """(brackets open at the start of the cursor line, outermost first; closers below the line that close
    brackets open above it), within the statement that holds the line start."""
    root = tree.root_node
    node: Node | None = root.descendant_for_byte_range(ls, ls)
    holder: Node | None = None
    while node is not None:
        if node.start_byte < ls and (node.type in spec.strings or node.type in spec.comments):
            return (), 0  # the line starts inside a multi-line string or comment
        if node.start_byte < ls and (
            node.type in spec.statements or node.parent is None or node.parent == root or node.is_error
        ):
            holder = node
            if node.type in spec.statements or node.parent == root or node.parent is None:
                break
        node = node.parent
    if holder is None:
        return (), 0
    pairs = dict(spec.brackets)
    closers = {c: o for o, c in spec.brackets}
    stack: list[str] = []
    for leaf in _brackets(holder, spec, holder.start_byte, ls):
        t = leaf.type
        if (t not in pairs and t not in closers) or leaf.is_missing or _block_brace(spec, leaf):
            continue  # (brackets only: a node's parent is costly to reach)
        if t in pairs:
            stack.append(t)
        elif t in closers and stack:
            stack.pop()
    if not stack:
        return (), 0
    depth = 0
    owed = 0
    for leaf in _brackets(holder, spec, le, holder.end_byte):
        t = leaf.type
        if (t not in pairs and t not in closers) or leaf.is_missing or _block_brace(spec, leaf):
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
    return (
        parent.is_error
        and leaf.type == "{"
        and spec.body_opener == "{"
        and leaf.next_sibling is not None
        and leaf.next_sibling.start_point.row > leaf.end_point.row
    )


def _ancestors(tree: Tree, b: int) -> tuple[str, ...]:
    out: list[str] = []
    node: Node | None = tree.root_node.descendant_for_byte_range(max(0, b - 1), b)
    while node is not None and len(out) < 24:
        out.append(node.type)
        node = node.parent
    return tuple(out)


def site_at(
    text: str,
    offset: int,
    spec: LanguageSpec | str | None,
    tree: Tree | DocumentTree | None = None,
    data: bytes | None = None,
) -> Site | None:
    """The Site around `offset`, or None when the language (a spec, or an LSP id or name) has no grammar
    here. tree: the document's own, used to find the region in a long document (the whole document is
    parsed here when it is long and none is given): its DocumentTree (which also keeps the trees of the
    regions parsed before, edited along with the document: a request in one reparses it incrementally), or
    a tree from one (DocumentTree.shifted or .tree)."""
    if isinstance(spec, str):
        spec = spec_of(spec)
    if spec is None or spec.language() is None:
        return None
    t0 = time.perf_counter()
    keeper = tree if isinstance(tree, DocumentTree) else None
    doc_tree = tree if isinstance(tree, Tree) else None
    partial = False
    data = encode(text) if data is None else data
    cursor = offset if len(data) == len(text) else len(encode(text[:offset]))  # ASCII: bytes are characters
    ls = text.rfind("\n", 0, offset) + 1
    le = text.find("\n", offset)
    le = len(text) if le < 0 else le
    ranges: tuple[tuple[int, int], ...] = ((0, len(data)),)
    if len(data) > MAX_REGION_BYTES:
        if keeper is not None:
            doc_tree = keeper.shifted(text) or keeper.tree(text)
        if doc_tree is None:
            doc_tree = Parser(spec.language()).parse(data)
        region = _region(spec, doc_tree, data, cursor)
        partial = region is not None and region == _window(data, cursor)
        if region is not None:
            # The region's pieces put together: every parse from here on reads only them.
            ranges = region
            before = sum(min(b, cursor) - a for a, b in ranges if a < cursor)
            data = b"".join(data[a:b] for a, b in ranges)
            cursor = before
    kept = keeper.region(text, ranges, data) if keeper is not None else None
    region_tree, parsed = kept if kept is not None else (Parser(spec.language()).parse(data), "fresh")
    bls = cursor - len(encode(text[ls:offset]))
    ble = min(len(data), cursor + len(encode(text[offset:le])))
    open_before, closed_below = _brackets_around_line(spec, region_tree, data, bls, ble)
    return Site(
        spec=spec,
        data=data,
        cursor=cursor,
        tree=region_tree,
        errors=tuple(errors_in(region_tree)),
        open_before=open_before,
        closed_below=closed_below,
        line_prefix=text[ls:offset],
        line_suffix=text[offset:le],
        node_types=_ancestors(region_tree, cursor),
        ms=1000 * (time.perf_counter() - t0),
        checkable=not _in_multiline_string(spec, region_tree, cursor, bls),
        partial=partial,
        parsed=parsed,
    )


def _in_multiline_string(spec: LanguageSpec, tree: Tree, cursor: int, line_start: int) -> bool:
    """The cursor is inside a string that began on an earlier line (a docstring, a template literal): where it
    ends, and so what the code after it is, is not known while it is being typed. Nothing is judged there."""
    node: Node | None = tree.root_node.descendant_for_byte_range(cursor, cursor)
    while node is not None:
        if node.type in spec.strings and node.start_byte < line_start:
            return True
        node = node.parent
    return False


def line_bounds(site: Site) -> tuple[int, int]:
    """Byte offsets of the cursor line's start and end in the region."""
    le = site.data.find(b"\n", site.cursor)
    return _line_start(site.data, site.cursor), len(site.data) if le < 0 else le


def edited(site: Site, start: int, end: int, new: bytes) -> Tree:
    """The region with data[start:end] replaced by `new`, parsed incrementally from the region's own tree
    (only the changed span is re-read)."""
    data = site.data[:start] + new + site.data[end:]
    return Parser(site.spec.language()).parse(data, edited_tree(site.tree, site.data, start, end, new))


def inserted(site: Site, insert: bytes) -> Tree:
    """The region parsed with `insert` put in at the cursor."""
    return edited(site, site.cursor, site.cursor, insert)


def replaced_line(site: Site, line: bytes) -> Tree:
    """The region parsed with the cursor line (its text, not its newline) replaced by `line`."""
    ls, le = line_bounds(site)
    return edited(site, ls, le, line)


def indent_of(site: Site, ls: int, le: int) -> str:
    line = site.data[ls:le].decode("utf-8", "replace")
    return line[: len(line) - len(line.lstrip(" \t"))]


def stand_ins(site: Site) -> list[str]:
    """Lines that could stand where the cursor line is so that the region reads as it was written, most
    likely first: the closers of the brackets the lines above left open and the lines below do not close,
    then openers for the closers the lines below have with nothing open for them (a `{` above
    `    return x;` / `}`), then the line left empty. In Python also a header (`if x(` / `if 1:`) where the
    code below is deeper than the cursor line. Brackets in strings and comments do not count."""
    spec = site.spec
    pairs = dict(spec.brackets)
    opener_of = {c: o for o, c in spec.brackets}
    ls, le = line_bounds(site)
    root = site.tree.root_node
    above: list[str] = []
    for leaf in _brackets(root, spec, 0, ls):
        if leaf.is_missing:
            continue
        if leaf.type in pairs:
            above.append(leaf.type)
        elif leaf.type in opener_of and above and above[-1] == opener_of[leaf.type]:
            above.pop()
    depth = 0
    debt: list[str] = []  # closers below with no opener below, in order
    for leaf in _brackets(root, spec, le, len(site.data)):
        if leaf.is_missing:
            continue
        if leaf.type in pairs:
            depth += 1
        elif leaf.type in opener_of:
            if depth:
                depth -= 1
            else:
                debt.append(leaf.type)
    if site.partial:
        above, debt = [], []  # a window's edges cut constructs: its brackets say nothing of the cursor line
    # The fewest leading closers of the debt that a line must open so that the rest close what is open above.
    m = next(
        k
        for k in range(len(debt) + 1)
        if len(debt) - k <= len(above) and all(opener_of[c] == above[-1 - i] for i, c in enumerate(debt[k:]))
    )
    still_open = above[: len(above) - (len(debt) - m)]
    closers = "".join(pairs[o] for o in reversed(still_open))
    openers = "".join(opener_of[c] for c in reversed(debt[:m]))
    indent = indent_of(site, ls, le)
    heads = [""]
    if openers[:1] in ("(", "["):
        heads = ["x"]
        if openers[:1] == "(" and spec.definition_head:
            heads.append(spec.definition_head)  # the lines below are parameters and the body
        if openers[:1] == "(":
            heads += spec.paren_heads
    elif openers[:1] == "{":
        heads = ["x = "] if spec.indented_blocks else list(spec.brace_heads)
    if "({" in openers and spec.lambda_head:
        # A body inside a call (`operate((source) => {`): the `{` of a function literal, not an object.
        lam = openers.replace("({", "(" + spec.lambda_head + "{", 1)
        extra = [indent_of(site, ls, le) + closers + "x" + lam]
    else:
        extra = []
    tails = [""]
    if spec.indented_blocks:
        nxt = next(
            (
                ln
                for ln in site.data[le + 1 : le + 4001].decode("utf-8", "replace").split("\n")
                if ln.strip() and not ln.lstrip().startswith(spec.line_comment)
            ),
            "",
        )
        if len(nxt) - len(nxt.lstrip(" \t")) > len(indent):
            # The code below is a body: the line was a header (or ended one).
            if openers:
                heads.append("if x")
            elif closers:
                tails.append(":")
            else:
                heads.append("if 1:")
    out = [indent + closers + h + openers + t for h in heads for t in tails] + extra
    return list(dict.fromkeys([*out, indent]))


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
    return "".join(pairs[c] for c in reversed(stack[site.closed_below :]))
