"""A document's tree-sitter tree kept across edits, and the error nodes of a tree (completion/syntax.py's
lowest layer: no knowledge of cursors or suggestions).

* `DocumentTree`: a document's tree kept across edits with tree-sitter's edit API (documents.Document owns
  one per open document of a known language); reparsed incrementally, lazily, when a request needs it. It
  also keeps the trees of the regions recent requests parsed (syntax_site.site_at: the construct around the
  cursor), edited along with the document, so that a request in a region parsed before reparses it
  incrementally instead of from scratch.
* `errors_in(tree)`: the ERROR and MISSING nodes, visiting only the nodes that hold errors.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from tree_sitter import Parser, Point, Tree

from completiond.completion.languages import LanguageSpec

MAX_SHIFTED_EDITS = 64  # edits a document's tree follows by the edit API alone before it is reparsed
MAX_ERRORS = 64  # error nodes collected per parse (the rest cannot change a verdict much)
MAX_REGIONS = 16  # region trees a document keeps across edits (the constructs around recent cursors)
MIN_KEPT_REGION_BYTES = 2000  # a smaller region is parsed from scratch each time (a fraction of a millisecond)

# An error of a parse: (start byte, end byte, missing, node type).
Error = tuple[int, int, bool, str]


def _point(text: str, offset: int) -> tuple[int, Point]:
    """(byte offset, tree-sitter point) of a character offset."""
    row = text.count("\n", 0, offset)
    ls = text.rfind("\n", 0, offset) + 1
    if text.isascii():
        return offset, Point(row, offset - ls)
    line_bytes = len(text[ls:offset].encode("utf-8", "surrogatepass"))
    before = len(text[:ls].encode("utf-8", "surrogatepass"))
    return before + line_bytes, Point(row, line_bytes)


def _point_from(text: str, start: int, start_byte: int, start_point: Point, offset: int) -> tuple[int, Point]:
    """_point(text, offset) for an offset at or after `start`, whose (byte, point) are known: only the text
    between them is read (an edit's end, without scanning the document again)."""
    if offset == start:
        return start_byte, start_point
    span = text[start:offset]
    b = start_byte + len(encode(span))
    nl = span.rfind("\n")
    if nl < 0:
        return b, Point(start_point.row, start_point.column + (b - start_byte))
    return b, Point(start_point.row + span.count("\n"), len(encode(span[nl + 1 :])))


def _point_near(text: str, offset: int, anchor: tuple[int, int, Point]) -> tuple[int, Point]:
    """_point(text, offset) counted from `anchor`, the (character offset, byte offset, point) of a place in
    text (one whose text before it the edits since left alone): only the text between them is read."""
    at, at_byte, at_point = anchor
    if offset >= at:
        return _point_from(text, at, at_byte, at_point, offset)
    span = text[offset:at]
    b = at_byte - (len(span) if span.isascii() else len(encode(span)))
    ls = text.rfind("\n", 0, offset) + 1
    line = text[ls:offset]
    return b, Point(at_point.row - span.count("\n"), len(line) if line.isascii() else len(encode(line)))


def _end_point(start: Point, new: str) -> Point:
    nl = new.count("\n")
    if not nl:
        return Point(start.row, start.column + len(new.encode("utf-8", "surrogatepass")))
    return Point(start.row + nl, len(new[new.rfind("\n") + 1 :].encode("utf-8", "surrogatepass")))


def encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def byte_point(data: bytes, b: int) -> Point:
    """The tree-sitter point of byte offset b in data."""
    ls = data.rfind(b"\n", 0, b) + 1
    return Point(data.count(b"\n", 0, b), b - ls)


def edited_tree(tree: Tree, data: bytes, start: int, end: int, new: bytes) -> Tree:
    """A copy of `tree` (a parse of `data`, or one edited towards it) told that data[start:end] became `new`:
    the old tree an incremental parse of the result takes (tree-sitter's edit API; no parsing)."""
    out = tree.copy()
    sp = byte_point(data, start)
    out.edit(
        start_byte=start,
        old_end_byte=end,
        new_end_byte=start + len(new),
        start_point=sp,
        old_end_point=byte_point(data, end),
        new_end_point=_end_point(sp, new.decode("utf-8", "surrogatepass")),
    )
    return out


@dataclass
class _Region:
    """A region's tree kept by its document: the parse of the region's bytes as they were, told of the edits
    made inside the region since (clean: no edit since the parse)."""

    ranges: tuple[tuple[int, int], ...]  # the document's byte ranges put together, as the edits moved them
    data: bytes  # the region's bytes now
    tree: Tree
    clean: bool


class DocumentTree:
    """One document's tree across edits: `edit` applies tree-sitter's edit API to the last tree (no parsing),
    `tree(text)` reparses incrementally when edits are pending; edits that lead back to the text last parsed
    (undone) take that parse back, pending nothing. Thread-safe: the daemon edits on its event loop and
    parses on its worker. A tree handed out is never edited afterwards (edits go to a copy)."""

    def __init__(self, spec: LanguageSpec, text: str):
        self.spec = spec
        self._lock = threading.Lock()
        self._tree: Tree | None = None  # parsed for self._parsed, then edited towards self._text
        self._text = text  # the text the pending edits lead to
        self._clean = False  # self._tree is a parse of self._text
        self._pending = 0  # edits since the last parse
        self._parsed: tuple[str, Tree] | None = None  # the last parse and its text
        self._anchor: tuple[int, int, Point] = (0, 0, Point(0, 0))  # a place in the text: _point_near
        self._regions: list[_Region] = []  # least recently used first
        self._edits = 0  # edits ever told (a region parsed meanwhile is not kept)
        self.parses = 0

    def edit(self, old_text: str, start: int, end: int, new: str, new_text: str | None = None) -> None:
        """old_text[start:end] became `new` (character offsets into old_text); new_text: the result, when the
        caller has it already (kept, not rebuilt)."""
        result = new_text if new_text is not None else old_text[:start] + new + old_text[end:]
        with self._lock:
            same = old_text is self._text or old_text == self._text
            if same and (self._tree is not None or self._regions):
                sb, sp = _point_near(old_text, start, self._anchor)
                eb, ep = _point_from(old_text, start, sb, sp, end)
                self._anchor = (start, sb, sp)  # the text before the edit stays as it was
                if self._tree is not None:
                    tree = self._tree.copy()
                    tree.edit(
                        start_byte=sb,
                        old_end_byte=eb,
                        new_end_byte=sb + len(encode(new)),
                        start_point=sp,
                        old_end_point=ep,
                        new_end_point=_end_point(sp, new),
                    )
                    self._tree = tree
                if self._regions:
                    self._edit_regions(sb, eb, encode(new))
            elif not same:
                # Out of step with the text it was told about: the next parse starts over.
                self._tree, self._parsed = None, None
                self._regions.clear()
                self._anchor = (0, 0, Point(0, 0))
            self._text = result
            self._edits += 1
            last = self._parsed
            if last is not None and (result is last[0] or (len(result) == len(last[0]) and result == last[0])):
                # Back to the text last parsed (the edits since undone): that parse is exact again.
                self._tree, self._clean, self._pending = last[1], True, 0
            else:
                self._clean = False
                self._pending += 1

    def _edit_regions(self, sb: int, eb: int, new: bytes) -> None:
        """The document's bytes [sb, eb) became `new`: the kept regions follow (under the lock). One holding the
        edit in one of its ranges has its tree told of it; one beside it moves; one the edit straddles (a
        range's edge, or the gap between two ranges) is dropped."""
        grow = len(new) - (eb - sb)
        kept: list[_Region] = []
        for r in self._regions:
            if sb > r.ranges[-1][1]:  # after the region
                kept.append(r)
                continue
            if eb < r.ranges[0][0]:  # before it
                r.ranges = tuple((a + grow, b + grow) for a, b in r.ranges)
                kept.append(r)
                continue
            at = 0
            for i, (a, b) in enumerate(r.ranges):
                if a <= sb and eb <= b:
                    s, e = at + sb - a, at + eb - a
                    r.tree = edited_tree(r.tree, r.data, s, e, new)
                    r.data = r.data[:s] + new + r.data[e:]
                    r.ranges = (*r.ranges[:i], (a, b + grow), *((x + grow, y + grow) for x, y in r.ranges[i + 1 :]))
                    r.clean = False
                    kept.append(r)
                    break
                at += b - a
            else:
                if all(eb <= a or sb >= b for a, b in r.ranges):  # in a gap between two ranges
                    r.ranges = tuple((a + grow, b + grow) if a >= eb else (a, b) for a, b in r.ranges)
                    kept.append(r)
        self._regions = kept

    def region(self, text: str, ranges: tuple[tuple[int, int], ...], data: bytes) -> tuple[Tree, str] | None:
        """The parse of `data`, the bytes of `text` in `ranges` put together (syntax_site.site_at's region), and
        how it was had: "kept" (the region's tree, no edit since), "incremental" (its tree told of the edits
        since, reparsed incrementally) or "fresh" (a region not kept: parsed from scratch, then kept). None
        when `text` is not the text the edits led to (the caller parses it itself)."""
        lang = self.spec.language()
        if lang is None or not self.keeps_regions:
            return None
        with self._lock:
            if text is not self._text and text != self._text:
                return None
            version = self._edits
            hit = next((r for r in self._regions if r.ranges == ranges), None)
            if hit is not None:
                self._regions.remove(hit)
                if hit.data != data:
                    hit = None  # moved out of step with the document (cannot happen by the edits alone)
                else:
                    self._regions.append(hit)
                    if hit.clean:
                        return hit.tree, "kept"
            old = hit.tree if hit is not None else None
        tree = Parser(lang).parse(data, old) if old is not None else Parser(lang).parse(data)
        with self._lock:
            if self._edits == version:  # no edit meanwhile: keep it for the next request
                if hit is not None:
                    hit.tree, hit.clean = tree, True
                else:
                    if len(data) >= MIN_KEPT_REGION_BYTES:
                        self._regions.append(_Region(ranges, data, tree, True))
                        del self._regions[:-MAX_REGIONS]
        return tree, "fresh" if old is None else "incremental"

    keeps_regions = True  # off: every region is parsed from scratch (the reference, for tests)

    def reset(self, text: str) -> None:
        with self._lock:
            self._tree, self._text, self._clean, self._parsed = None, text, False, None
            self._regions.clear()
            self._anchor = (0, 0, Point(0, 0))
            self._edits += 1

    def shifted(self, text: str) -> Tree | None:
        """A tree for `text` without parsing: the last parse with the edits since applied (tree-sitter's edit
        API moves its nodes), good for finding the construct around a cursor, not for its errors. None when
        there is none for this text (never parsed, or out of step)."""
        with self._lock:
            if (
                self._tree is None
                or self._pending > MAX_SHIFTED_EDITS
                or (text is not self._text and text != self._text)
            ):
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
                self._tree = (
                    Parser(lang).parse(encode(text), self._tree)
                    if self._tree is not None
                    else Parser(lang).parse(encode(text))
                )
                self._clean = True
                self._pending = 0
                self._parsed = (text, self._tree)
                self.parses += 1
            return self._tree


def errors_in(tree: Tree, limit: int = MAX_ERRORS) -> list[Error]:
    """The tree's ERROR and MISSING nodes, (start byte, end byte, missing, type), in document order; only
    nodes holding errors are visited."""
    out: list[Error] = []
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
