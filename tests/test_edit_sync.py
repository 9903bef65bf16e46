"""Edit-sync fuzzing (issue 7, item 2): the server's copy of a document equals the editor's
after every incremental edit — CJK, emoji (UTF-16 surrogate pairs), combining marks,
CRLF / lone CR line ends, edits spanning lines, several changes per didChange.

The reference ("the client") keeps the text as a Python string and computes LSP positions
with its own code (line ends \\n, \\r\\n, \\r as the spec says; UTF-16 code units, UTF-8
bytes or code points), independent of completiond.completion.documents. Checked at two levels:
Document.apply_lsp_changes (plus the code-point edits it forwards to the daemon, applied
to a mirror), and the real LSP process -> daemon path, comparing with the daemon's state.
"""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace as NS

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from completiond.commands import stress
from completiond.completion.documents import UTF8, UTF16, UTF32, Document, line_starts

PIECES = ["a", "Z", " ", "\t", "é", "中文", "字", "😀", "👩\u200d💻", "𝔘", "e\u0301", "\n", "\r\n", "\r", "\r\n\r\n",
          "def f(x):\n    return x\r\n", "ß", "\u2028", "\ufeff"]


def ref_units(s: str, encoding: str) -> int:
    if encoding == UTF16:
        return len(s.encode("utf-16-le")) // 2
    if encoding == UTF8:
        return len(s.encode("utf-8"))
    return len(s)


def ref_position(text: str, offset: int, encoding: str) -> tuple[int, int]:
    """The client's own LSP position of a code-point offset."""
    line, start, i = 0, 0, 0
    while i < offset:
        ch = text[i]
        if ch == "\n" or (ch == "\r" and not (i + 1 < len(text) and text[i + 1] == "\n")):
            line += 1
            start = i + 1
        elif ch == "\r":  # "\r\n": the line ends after the "\n"
            pass
        i += 1
    return line, ref_units(text[start:offset], encoding)


def addressable(text: str, offset: int) -> bool:
    """Editors never put a position between the \\r and \\n of one line end."""
    return not (0 < offset < len(text) and text[offset - 1] == "\r" and text[offset] == "\n")


def random_edit(rng: random.Random, text: str) -> tuple[int, int, str]:
    points = [i for i in range(len(text) + 1) if addressable(text, i)]
    a, b = sorted((rng.choice(points), rng.choice(points)))
    if rng.random() < 0.5:  # mostly short spans, like typing
        b = min(b, a + rng.randrange(0, 4))
        while not addressable(text, b):
            b += 1
    new = "".join(rng.choice(PIECES) for _ in range(rng.choice([0, 1, 1, 1, 2, 3])))
    if len(text) > 3000:
        new = ""
    return a, b, new


def lsp_change(text: str, a: int, b: int, new: str, encoding: str):
    (sl, sc), (el, ec) = ref_position(text, a, encoding), ref_position(text, b, encoding)
    return NS(range=NS(start=NS(line=sl, character=sc), end=NS(line=el, character=ec)), text=new)


def run_edits(rng: random.Random, text: str, steps: int, encoding: str) -> int:
    doc = Document("file:///x.py", text, 1)
    mirror = Document("file:///x.py", text, 1)   # the daemon's copy, fed the forwarded code-point edits
    client = text
    for step in range(steps):
        changes = []
        for _ in range(rng.choice([1, 1, 1, 2, 3])):   # several changes in one didChange, each on the previous result
            if rng.random() < 0.02:
                client = "".join(rng.choice(PIECES) for _ in range(rng.randrange(0, 30)))
                changes.append(NS(range=None, text=client))
                continue
            a, b, new = random_edit(rng, client)
            changes.append(lsp_change(client, a, b, new, encoding))
            client = client[:a] + new + client[b:]
        forwarded = doc.apply_lsp_changes(changes, step + 2, encoding)
        mirror.apply_edits(forwarded, step + 2)
        assert doc.text == client, (step, encoding, changes)
        assert doc.starts == line_starts(client), (step, changes)   # kept up to date incrementally
        assert mirror.text == client
        assert doc.version == step + 2
    return steps


@pytest.mark.parametrize("encoding", [UTF16, UTF8, UTF32])
def test_thousands_of_random_edits(encoding):
    rng = random.Random(hash(encoding) & 0xFFFF)
    done = sum(run_edits(rng, rng.choice(["", "x", "a😀b\r\nc中\rd\n"]), 500, encoding) for _ in range(6))
    assert done == 3000


@settings(max_examples=60, deadline=None, database=None)
@given(seed=st.integers(0, 2**32), text=st.text(alphabet=st.sampled_from(list("ab é中😀\r\n\t")), max_size=60),
       encoding=st.sampled_from([UTF16, UTF8, UTF32]))
def test_hypothesis_edit_sequences(seed, text, encoding):
    run_edits(random.Random(seed), text, 40, encoding)


@pytest.mark.parametrize("text, a, b, new, want", [
    ("x\r\ny", 1, 1, "\n", "x\n\r\ny"),      # a \n before a CRLF
    ("x\ry", 2, 2, "\n", "x\r\ny"),          # \n right after a lone \r: forms a CRLF... at the start of "y"
    ("x\r\ny", 0, 1, "", "\r\ny"),
    ("😀\r\n😀", 3, 4, "中", "😀\r\n中"),      # replacing a surrogate pair on line 1
    ("a\r", 2, 2, "😀", "a\r😀"),             # after a lone CR at the end: line 1
])
def test_line_end_corner_cases(text, a, b, new, want):
    for encoding in (UTF16, UTF8, UTF32):
        doc = Document("u", text, 1)
        doc.apply_lsp_changes([lsp_change(text, a, b, new, encoding)], 2, encoding)
        assert doc.text == want == text[:a] + new + text[b:]
        assert doc.starts == line_starts(want)


def test_typing_in_a_huge_document_is_cheap(monkeypatch):
    """5 MB, 833 thousand lines: each keystroke patches the line table instead of rescanning the file (any
    rescan is counted, at any size: 50 MB here took 16 s of the suite for the same check; the time per
    keystroke is `completiond bench`'s business)."""
    from completiond.completion import documents

    text = "x = 1\n" * (5_000_000 // 6)
    doc = Document("u", text, 1)
    doc.offset(0, 0)                      # the one full scan, at open
    scans = []
    real = documents.line_starts
    monkeypatch.setattr(documents, "line_starts", lambda t: scans.append(len(t)) or real(t))
    for i, (line, col) in enumerate([(833_333, 0), (400_000, 3), (833_332, 5)] * 10):
        doc.apply_lsp_changes([lsp_change_at(line, col, "y")], i + 2)
        assert doc.offset(line, col) == doc.starts[line] + col
    assert scans == []
    assert doc.text.count("y") == 30 and doc.starts == real(doc.text)


def lsp_change_at(line: int, character: int, new: str):
    return NS(range=NS(start=NS(line=line, character=character), end=NS(line=line, character=character)), text=new)


def test_position_inside_surrogate_pair_never_splits_it():
    """A client bug (character pointing into a surrogate pair) must not corrupt the text into lone surrogates."""
    doc = Document("u", "a😀b", 1)
    doc.apply_lsp_changes([NS(range=NS(start=NS(line=0, character=2), end=NS(line=0, character=2)), text="X")], 2)
    assert doc.text in ("aX😀b", "a😀Xb")
    doc.text.encode("utf-8")  # no lone surrogate


@pytest.mark.slow
async def test_through_lsp_process_and_daemon(tmp_path):
    """300 random didChange messages through a real `completiond lsp` process; after each one the
    daemon's copy (which only ever sees the forwarded edits) equals the editor's text."""
    from test_fuzz_wire import InProcDaemon

    daemon = InProcDaemon(tmp_path)
    lsp = await stress.RawLsp.start({"maxTokens": 2}, tmp_path)
    try:
        rng = random.Random(11)
        uri = "file:///sync/a.py"
        client = "import os\r\n\r\ndef 函数(x):\n    return '😀' + x\r"
        lsp.notify("textDocument/didOpen", stress.did_open(uri, client))
        steps = 0
        for version in range(2, 302):
            changes = []
            for _ in range(rng.choice([1, 1, 2, 3])):
                a, b, new = random_edit(rng, client)
                (sl, sc), (el, ec) = ref_position(client, a, UTF16), ref_position(client, b, UTF16)
                changes.append({"range": {"start": {"line": sl, "character": sc}, "end": {"line": el, "character": ec}},
                                "text": new})
                client = client[:a] + new + client[b:]
            lsp.notify("textDocument/didChange", {"textDocument": {"uri": uri, "version": version},
                                                  "contentChanges": changes})
            await lsp.stats()   # a round trip through the LSP and over the same socket: the edits are applied
            docs = daemon.documents()
            assert [v for (_c, u), v in docs.items() if u == uri] == [(version, client)], (version, changes)
            steps += 1
        # And the completion path sees the same text: a request at the very end is not refused as out of range.
        reply = await asyncio.wait_for(lsp.send_request("textDocument/inlineCompletion", {
            "textDocument": {"uri": uri}, "position": stress.utf16_position(client, len(client)),
            "context": {"triggerKind": 1}}), 60)
        assert "result" in reply
        stats = await lsp.stats()
        assert stats["errors"] == 0 and steps == 300
    finally:
        await lsp.close()
        daemon.stop()
    assert not daemon.errors


@pytest.mark.slow
@pytest.mark.parametrize("text, line, character, want", [
    ("abc", 0, 10, "abcX"),                 # past the end of the last line: clamps to its end (LSP spec)
    ("ab\ncd", 0, 99, "abX\ncd"),
    ("a\u2028b", 0, 3, "a\u2028bX"),          # U+2028 is not an LSP line end
    ("a\x0cb\x85c", 0, 5, "a\x0cb\x85cX"),    # nor are form feed and NEL
])
async def test_lsp_positions_past_line_end(tmp_path, text, line, character, want):
    """pygls's own document copy rewrote such positions in place before our handler saw them."""
    from test_fuzz_wire import InProcDaemon

    daemon = InProcDaemon(tmp_path)
    lsp = await stress.RawLsp.start({"maxTokens": 2}, tmp_path)
    try:
        uri = "file:///clamp.py"
        lsp.notify("textDocument/didOpen", stress.did_open(uri, text))
        pos = {"line": line, "character": character}
        lsp.notify("textDocument/didChange", {"textDocument": {"uri": uri, "version": 2},
                                              "contentChanges": [{"range": {"start": pos, "end": pos}, "text": "X"}]})
        await lsp.stats()
        assert [v for (_c, u), v in daemon.documents().items() if u == uri] == [(2, want)]
    finally:
        await lsp.close()
        daemon.stop()
