"""Open documents and LSP position arithmetic.

LSP positions are (line, character) where `character` counts UTF-16 code units
by default, UTF-8 bytes or code points when negotiated. Internally we use
Python string offsets (code points) everywhere; conversion happens only at the
LSP boundary, here. Lines end at "\\n", "\\r\\n" or "\\r", as the spec says.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from completiond.completion.syntax import DocumentTree

UTF8 = "utf-8"
UTF16 = "utf-16"
UTF32 = "utf-32"

_EOL = re.compile(r"\r\n|\n|\r")


class EditError(ValueError):
    """An edit does not fit the document it is applied to."""


def line_starts(text: str) -> list[int]:
    return [0] + [m.end() for m in _EOL.finditer(text)]


def _units(ch: str, encoding: str) -> int:
    cp = ord(ch)
    if encoding == UTF16:
        return 2 if cp > 0xFFFF else 1
    if encoding == UTF8:
        return 1 if cp < 0x80 else 2 if cp < 0x800 else 3 if cp < 0x10000 else 4
    return 1


def _line_end(text: str, starts: list[int], line: int) -> int:
    """Offset of the end of `line`'s content (before its terminator)."""
    end = starts[line + 1] if line + 1 < len(starts) else len(text)
    if end > starts[line] and text[end - 1] == "\n":
        end -= 1
    if end > starts[line] and text[end - 1] == "\r":
        end -= 1
    return end


def position_to_offset(
    text: str, line: int, character: int, encoding: str = UTF16, starts: list[int] | None = None
) -> int:
    """Code-point offset of an LSP position; out-of-range positions clamp as the spec asks."""
    starts = starts if starts is not None else line_starts(text)
    if line < 0:
        return 0
    if line >= len(starts):
        return len(text)
    start = starts[line]
    end = _line_end(text, starts, line)
    if encoding == UTF32:
        return min(start + max(character, 0), end)
    units = 0
    i = start
    while i < end and units < character:
        units += _units(text[i], encoding)
        if units > character:
            # Inside a surrogate pair / multi-byte sequence: stay before the character.
            break
        i += 1
    return i


def offset_to_position(
    text: str, offset: int, encoding: str = UTF16, starts: list[int] | None = None
) -> tuple[int, int]:
    starts = starts if starts is not None else line_starts(text)
    offset = max(0, min(offset, len(text)))
    line = bisect.bisect_right(starts, offset) - 1
    start = starts[line]
    if encoding == UTF32:
        return line, offset - start
    return line, sum(_units(c, encoding) for c in text[start:offset])


def apply_edits(text: str, edits: Iterable[tuple[int, int, str]]) -> str:
    """Apply code-point edits in order, each against the result of the previous one."""
    for edit in edits:
        try:
            start, end, new = edit
        except (TypeError, ValueError):
            raise EditError(f"edit must be [start, end, text], got {edit!r}") from None
        if not (isinstance(start, int) and isinstance(end, int) and isinstance(new, str)):
            raise EditError(f"edit must be [int, int, str], got {edit!r}")
        if not 0 <= start <= end <= len(text):
            raise EditError(f"edit range {start}..{end} outside a document of {len(text)} characters")
        text = text[:start] + new + text[end:]
    return text


@dataclass
class Document:
    uri: str
    text: str
    version: int = 0
    language_id: str = ""
    _starts: list[int] | None = field(default=None, repr=False)
    # The syntax tree, kept across edits once a request asked for it (syntax.DocumentTree).
    _syntax: DocumentTree | None = field(default=None, repr=False)
    _no_grammar: bool = field(default=False, repr=False)

    def syntax(self) -> DocumentTree | None:
        """The document's tree keeper (made on first use; edits then update it with tree-sitter's edit API,
        and it reparses incrementally when asked), or None for a language without a grammar."""
        if self._syntax is None and not self._no_grammar:
            from completiond.completion.languages import spec_of
            from completiond.completion.syntax import DocumentTree

            spec = spec_of(self.language_id or None, self.uri)
            if spec is not None and spec.language() is not None:
                self._syntax = DocumentTree(spec, self.text)
            else:
                self._no_grammar = True
        return self._syntax

    @property
    def tree(self) -> DocumentTree | None:
        """The tree keeper if a request made one, else None; never makes one (a background answer runs off the
        event loop, where edits update the tree: one made there could miss an edit)."""
        return self._syntax

    def _edit_tree(self, old: str, edit: tuple[int, int, str]) -> None:
        if self._syntax is not None:
            self._syntax.edit(old, *edit, new_text=self.text)

    @property
    def starts(self) -> list[int]:
        if self._starts is None:
            self._starts = line_starts(self.text)
        return self._starts

    def offset(self, line: int, character: int, encoding: str = UTF16) -> int:
        return position_to_offset(self.text, line, character, encoding, self.starts)

    def position(self, offset: int, encoding: str = UTF16) -> tuple[int, int]:
        return offset_to_position(self.text, offset, encoding, self.starts)

    def line_end(self, offset: int) -> int:
        """Offset of the end of the line holding `offset` (before the terminator)."""
        line = bisect.bisect_right(self.starts, offset) - 1
        return _line_end(self.text, self.starts, line)

    def apply_lsp_changes(self, changes: Iterable, version: int, encoding: str = UTF16) -> list[tuple[int, int, str]]:
        """Apply LSP content changes (objects with `.text` and optional `.range`).

        Returns the same changes as code-point edits, for forwarding to the daemon.
        """
        edits: list[tuple[int, int, str]] = []
        for change in changes:
            rng = getattr(change, "range", None)
            if rng is None:
                edit = (0, len(self.text), change.text)
            else:
                start = self.offset(rng.start.line, rng.start.character, encoding)
                end = self.offset(rng.end.line, rng.end.character, encoding)
                if end < start:
                    start, end = end, start
                edit = (start, end, change.text)
            old = self.text
            self.text = apply_edits(self.text, [edit])
            self._update_starts(*edit)
            self._edit_tree(old, edit)
            edits.append(edit)
        self.version = version
        return edits

    def _update_starts(self, start: int, end: int, new: str) -> None:
        """Patch the line starts after text[start:end] became `new` (self.text is the new text).

        Recomputing them from scratch costs a regex pass over the whole document per keystroke
        (over a second for a 50 MB file); only starts in the edited span can change, the ones
        after it move by the length difference.
        """
        starts = self._starts
        if starts is None or len(new) > 65536:
            self._starts = None
            return
        text = self.text
        hi = start + len(new)
        # A start p exists iff text[p-1] ends a line: "\n", or "\r" not followed by "\n". Starts before
        # `start` depend only on unchanged characters; p in [start, hi] is rescanned; later ones shift.
        mid = [0] if start == 0 else []
        for p in range(max(start, 1), hi + 1):
            c = text[p - 1]
            if c == "\n" or (c == "\r" and (p >= len(text) or text[p] != "\n")):
                mid.append(p)
        keep = bisect.bisect_left(starts, start)
        tail = bisect.bisect_right(starts, end)
        delta = len(new) - (end - start)
        starts[keep:] = mid + ([s + delta for s in starts[tail:]] if delta else starts[tail:])

    def apply_edits(self, edits: Iterable[tuple[int, int, str]], version: int) -> None:
        if self._syntax is not None:
            for edit in edits:  # one at a time: the tree is told each edit against the text it applies to
                old = self.text
                self.text = apply_edits(self.text, [edit])
                self._edit_tree(old, edit)
        else:
            self.text = apply_edits(self.text, edits)
        self._starts = None
        self.version = version
