"""A document's tree-sitter tree kept across edits, and the error nodes of a tree (completion/syntax.py's
lowest layer: no knowledge of cursors or suggestions).

* `DocumentTree`: a document's tree kept across edits with tree-sitter's edit API (documents.Document owns
  one per open document of a known language); reparsed incrementally, lazily, when a request needs it.
* `errors_in(tree)`: the ERROR and MISSING nodes, visiting only the nodes that hold errors.
"""

from __future__ import annotations

import threading

from tree_sitter import Parser, Point, Tree

from completiond.completion.languages import LanguageSpec

MAX_SHIFTED_EDITS = 64  # edits a document's tree follows by the edit API alone before it is reparsed
MAX_ERRORS = 64  # error nodes collected per parse (the rest cannot change a verdict much)

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


def _end_point(start: Point, new: str) -> Point:
    nl = new.count("\n")
    if not nl:
        return Point(start.row, start.column + len(new.encode("utf-8", "surrogatepass")))
    return Point(start.row + nl, len(new[new.rfind("\n") + 1 :].encode("utf-8", "surrogatepass")))


def encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


class DocumentTree:
    """One document's tree across edits: `edit` applies tree-sitter's edit API to the last tree (no parsing),
    `tree(text)` reparses incrementally when edits are pending. Thread-safe: the daemon edits on its event
    loop and parses on its worker. A tree handed out is never edited afterwards (edits go to a copy)."""

    def __init__(self, spec: LanguageSpec, text: str):
        self.spec = spec
        self._lock = threading.Lock()
        self._tree: Tree | None = None  # parsed for self._parsed, then edited towards self._text
        self._text = text  # the text the pending edits lead to
        self._clean = False  # self._tree is a parse of self._text
        self._pending = 0  # edits since the last parse
        self.parses = 0

    def edit(self, old_text: str, start: int, end: int, new: str, new_text: str | None = None) -> None:
        """old_text[start:end] became `new` (character offsets into old_text); new_text: the result, when the
        caller has it already (kept, not rebuilt)."""
        result = new_text if new_text is not None else old_text[:start] + new + old_text[end:]
        with self._lock:
            if self._tree is not None and (old_text is self._text or old_text == self._text):
                sb, sp = _point(old_text, start)
                eb, ep = _point_from(old_text, start, sb, sp, end)
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
            elif old_text is not self._text and old_text != self._text:
                self._tree = None  # out of step with the text it was told about: the next parse starts over
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
