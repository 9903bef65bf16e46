"""The daemon's wire protocol: length-prefixed msgpack frames.

A frame is a 4-byte big-endian payload length followed by one msgpack map.
The length is checked before anything is read into memory, and the unpacker
runs with explicit container/string limits, so a hostile or confused peer can
cost us at most one frame's worth of memory before we close its connection.

Messages (all maps with short string keys):

    handshake   client -> {"t": "hello", "v": VERSION, "client": str, "pid": int, "settings": {...}}
                daemon -> {"t": "welcome", "v": VERSION, "pid": int, "status": {...}}
                       or {"t": "error", "e": {"code": int, "message": str}} and close
    request     {"id": int, "m": method, "p": params}
    response    {"id": int, "r": result}  or  {"id": int, "e": {"code": int, "message": str}}
                (a request whose id is not an integer is answered BAD_REQUEST, its id echoed as sent)
    notification{"m": method, "p": params}          (no id; "cancel" carries {"id": int})
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import msgpack

VERSION = 1
# The hello's "client" name of LSP servers, i.e. of editors (`completiond status` counts these; the
# CLI's own connections have other names).
EDITOR_CLIENT = "completiond-lsp"
HEADER = struct.Struct(">I")
MAX_FRAME = 4 * 1024 * 1024
MAX_DEPTH = 16
UNPACK_LIMITS = dict(
    max_str_len=MAX_FRAME,
    max_bin_len=64 * 1024,
    max_array_len=16384,
    max_map_len=512,
    max_ext_len=0,
)


# Error codes carried in {"e": {"code": ...}}.
class Code:
    BAD_REQUEST = 1  # malformed params
    UNKNOWN_METHOD = 2
    CANCELLED = 3  # cancelled by the client, or superseded by a newer request for the document
    OVERLOADED = 4  # this editor's queue is full, a request waited past the deadline, or too many connections
    ENGINE_ERROR = 5  # the engine refused the input (message is for the user)
    NOT_READY = 6  # model failed to load
    VERSION_MISMATCH = 7
    UNKNOWN_DOCUMENT = 8  # not open, or the version does not match: resend the document
    INTERNAL = 9
    SHUTTING_DOWN = 10


class FrameError(Exception):
    """The peer sent bytes that are not a valid frame; the connection must be closed."""


class ProtocolError(Exception):
    """A well-formed frame that is not a valid message."""


class RemoteError(Exception):
    """An error reply from the other side."""

    def __init__(self, code: int, message: str):
        super().__init__(f"[{code}] {message}")
        self.code = code
        self.message = message


def encode(message: dict[str, Any]) -> bytes:
    payload = msgpack.packb(message, use_bin_type=True)
    if len(payload) > MAX_FRAME:
        raise ProtocolError(f"message of {len(payload)} bytes exceeds the {MAX_FRAME}-byte frame limit")
    return HEADER.pack(len(payload)) + payload


def _check_depth(obj: Any) -> None:
    stack = [(obj, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise FrameError(f"message nested deeper than {MAX_DEPTH} levels")
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)


def decode_payload(payload: bytes) -> dict[str, Any]:
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=True, use_list=True, **UNPACK_LIMITS)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError, TypeError) as exc:
        # ValueError covers limit violations and invalid UTF-8; TypeError unhashable keys.
        raise FrameError(f"undecodable msgpack payload ({type(exc).__name__}: {exc})") from None
    _check_depth(obj)
    if not isinstance(obj, dict):
        raise FrameError(f"frame holds a {type(obj).__name__}, expected a map")
    return obj


def check_length(length: int, limit: int = MAX_FRAME) -> None:
    if length == 0:
        raise FrameError("empty frame")
    if length > limit:
        raise FrameError(f"frame of {length} bytes exceeds the {limit}-byte limit")


async def read_message(
    reader: asyncio.StreamReader, limit: int = MAX_FRAME, frame_timeout: float | None = None
) -> dict[str, Any] | None:
    """Next message, or None on a clean EOF between frames. Raises FrameError on bad input.

    The wait for a frame's first byte is unbounded (an idle editor is fine); with
    frame_timeout, the rest of the frame must follow within that many seconds, so a peer
    that sends part of a frame and stalls cannot hold its buffer (up to `limit`) forever.
    """
    try:
        first = await reader.readexactly(1)
    except asyncio.IncompleteReadError:
        return None
    if frame_timeout is None:
        return await _read_rest(reader, first, limit)
    try:
        return await asyncio.wait_for(_read_rest(reader, first, limit), frame_timeout)
    except asyncio.TimeoutError:
        raise FrameError(f"frame not completed within {frame_timeout:g} s") from None


async def _read_rest(reader: asyncio.StreamReader, first: bytes, limit: int) -> dict[str, Any]:
    try:
        header = first + await reader.readexactly(HEADER.size - 1)
    except asyncio.IncompleteReadError as exc:
        raise FrameError(f"connection closed inside a frame header ({1 + len(exc.partial)} of 4 bytes)") from None
    (length,) = HEADER.unpack(header)
    check_length(length, limit)
    try:
        payload = await reader.readexactly(length)
    except asyncio.IncompleteReadError as exc:
        raise FrameError(f"connection closed inside a frame ({len(exc.partial)} of {length} bytes)") from None
    return decode_payload(payload)


def error_body(code: int, message: str) -> dict[str, Any]:
    return {"code": int(code), "message": str(message)}


def parse_error(body: Any) -> RemoteError:
    if isinstance(body, dict) and isinstance(body.get("code"), int):
        return RemoteError(body["code"], str(body.get("message", "")))
    return RemoteError(Code.INTERNAL, f"malformed error reply: {body!r}")
