"""Frame encoding and the limits checked before and while decoding."""

from __future__ import annotations

import asyncio
import struct

import msgpack
import pytest

from completiond.serving import wire

pytestmark = pytest.mark.torch_free  # also run on the lowest supported Python, without torch (.ci/run)


async def feed(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader(limit=wire.MAX_FRAME + 64)
    reader.feed_data(data)
    reader.feed_eof()
    return reader


async def test_round_trip_and_clean_eof():
    msg = {"id": 1, "m": "complete", "p": {"uri": "file:///é.py", "offset": 3, "edits": [[0, 1, "x"]]}}
    reader = await feed(wire.encode(msg) + wire.encode({"m": "cancel", "p": {"id": 1}}))
    assert await wire.read_message(reader) == msg
    assert (await wire.read_message(reader))["m"] == "cancel"
    assert await wire.read_message(reader) is None


@pytest.mark.parametrize("data, reason", [
    (struct.pack(">I", wire.MAX_FRAME + 1), "exceeds"),
    (b"GET / HTTP/1.1\r\n\r\n", "exceeds"),
    (struct.pack(">I", 0), "empty frame"),
    (b"\x00\x00", "frame header"),
    (struct.pack(">I", 10) + b"abc", "inside a frame"),
    (struct.pack(">I", 1) + b"\xc1", "undecodable"),
    (struct.pack(">I", 3) + b"\x93\x01\x02", "undecodable"),     # array of 3 with only 2 items
    (lambda: wire.HEADER.pack(len(p := msgpack.packb([1, 2]))) + p, "expected a map"),
    (lambda: wire.HEADER.pack(len(p := msgpack.packb({1: 2}))) + p, "undecodable"),       # strict_map_key
    (lambda: wire.HEADER.pack(len(p := msgpack.packb({"a": list(range(20000))}))) + p, "max_array_len"),
    (lambda: wire.HEADER.pack(len(p := msgpack.packb({"a": b"x" * 100000}))) + p, "max_bin_len"),
    (lambda: wire.HEADER.pack(len(p := b"\x81\xa1a" + b"\x91" * 40 + b"\x01")) + p, "nested deeper"),
    (lambda: wire.HEADER.pack(len(p := b"\x81\xa1a\xa2\xff\xfe")) + p, "undecodable"),      # invalid UTF-8 string
])
async def test_bad_frames_raise_frame_error(data, reason):
    if callable(data):
        data = data()
    reader = await feed(data)
    with pytest.raises(wire.FrameError, match=reason):
        await wire.read_message(reader)


async def test_oversized_length_is_rejected_before_reading_payload():
    reader = asyncio.StreamReader()
    reader.feed_data(struct.pack(">I", 1 << 31))  # no payload follows: we must not wait for it
    with pytest.raises(wire.FrameError):
        await asyncio.wait_for(wire.read_message(reader), 1)


def test_encode_refuses_oversized_message():
    with pytest.raises(wire.ProtocolError):
        wire.encode({"text": "x" * (wire.MAX_FRAME + 1)})


def test_parse_error():
    err = wire.parse_error({"code": wire.Code.OVERLOADED, "message": "busy"})
    assert err.code == wire.Code.OVERLOADED and "busy" in str(err)
    assert wire.parse_error("junk").code == wire.Code.INTERNAL


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
async def test_arbitrary_bytes_never_escape_as_other_errors(data):
    reader = await feed(data)
    try:
        while (msg := await wire.read_message(reader)) is not None:
            assert isinstance(msg, dict)
    except wire.FrameError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) | st.text(max_size=20),
                    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4),
                    max_leaves=20))
async def test_valid_messages_round_trip(value):
    msg = {"id": 1, "m": "x", "p": {"v": value}}
    reader = await feed(wire.encode(msg))
    try:
        assert await wire.read_message(reader) == msg
    except wire.FrameError as exc:
        assert "nested deeper" in str(exc)
