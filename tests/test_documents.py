"""LSP positions in UTF-16 / UTF-8 / UTF-32 and incremental edits."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from completiond.completion.documents import (UTF8, UTF16, UTF32, Document, EditError, apply_edits, offset_to_position,
                                   position_to_offset)

pytestmark = pytest.mark.torch_free  # also run on the lowest supported Python, without torch (.ci/run)

TEXT = "a😀b\r\nxé\n\nlast"


@pytest.mark.parametrize("encoding, position, offset", [
    (UTF16, (0, 0), 0), (UTF16, (0, 1), 1), (UTF16, (0, 3), 2), (UTF16, (0, 4), 3),
    (UTF8, (0, 5), 2), (UTF8, (0, 6), 3), (UTF32, (0, 2), 2),
    (UTF16, (1, 0), 5), (UTF16, (1, 2), 7), (UTF8, (1, 3), 7),
    (UTF16, (0, 99), 3),     # past the end of the line: clamps to the line end, before "\r\n"
    (UTF16, (9, 0), len(TEXT)),
    (UTF16, (0, 2), 1),      # inside a surrogate pair: stays before the character
])
def test_position_to_offset(encoding, position, offset):
    assert position_to_offset(TEXT, *position, encoding) == offset


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab\n\r é😀\t")), max_size=40), st.data())
def test_offset_position_round_trip(text, data):
    offset = data.draw(st.integers(0, len(text)))
    if 0 < offset < len(text) and text[offset - 1] == "\r" and text[offset] == "\n":
        offset -= 1  # between \r and \n is not a position
    for enc in (UTF8, UTF16, UTF32):
        line, col = offset_to_position(text, offset, enc)
        assert position_to_offset(text, line, col, enc) == offset


def change(sl, sc, el, ec, text):
    return NS(range=NS(start=NS(line=sl, character=sc), end=NS(line=el, character=ec)), text=text)


def test_incremental_changes_utf16():
    doc = Document("u", "x😀y\nz", 1)
    edits = doc.apply_lsp_changes([change(0, 3, 0, 4, "Y"), change(1, 1, 1, 1, "!")], 2, UTF16)
    assert doc.text == "x😀Y\nz!" and doc.version == 2
    assert edits == [(2, 3, "Y"), (5, 5, "!")]
    doc.apply_lsp_changes([NS(range=None, text="full")], 3)
    assert doc.text == "full"


def test_forwarded_edits_reproduce_text():
    doc = Document("u", "héllo\nworld", 1)
    mirror = doc.text
    edits = doc.apply_lsp_changes([change(0, 1, 1, 2, "E"), change(0, 0, 0, 0, "😀")], 2, UTF8)
    assert apply_edits(mirror, edits) == doc.text == "😀hErld"


def test_bad_edits():
    with pytest.raises(EditError):
        apply_edits("abc", [(2, 9, "x")])
    with pytest.raises(EditError):
        apply_edits("abc", [("a", 1, "x")])
    with pytest.raises(EditError):
        apply_edits("abc", [(1,)])
