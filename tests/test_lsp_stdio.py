"""The language server's stdin, read by its event loop (lsp/stdio.py) where it is a pipe, and by pygls's
thread reader otherwise: messages arrive whole and in order either way, a header line past the limit is
skipped rather than fatal, and a body cut short by a closed pipe ends the session quietly."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

from completiond.lsp import stdio


def frame(message: dict) -> bytes:
    body = json.dumps(message).encode()
    return b"Content-Length: %d\r\n\r\n" % len(body) + body


INITIALIZE = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"processId": None, "capabilities": {}}}
SHUTDOWN = {"jsonrpc": "2.0", "id": 2, "method": "shutdown", "params": None}
EXIT = {"jsonrpc": "2.0", "method": "exit", "params": None}


def replies(out: bytes) -> dict:
    """The responses in a server's stdout, by id."""
    found = {}
    while b"\r\n\r\n" in out:
        head, _, rest = out.partition(b"\r\n\r\n")
        length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
        if len(rest) < length:  # the rest of it is still on its way
            break
        message = json.loads(rest[:length])
        if "id" in message:
            found[message["id"]] = message
        out = rest[length:]
    return found


def run_server(tmp_path, **stdin) -> subprocess.CompletedProcess:
    """`completiond lsp` with `stdin=` a file or `input=` bytes (a pipe); no session starts a daemon."""
    env = dict(os.environ, HOME=str(tmp_path), XDG_RUNTIME_DIR=str(tmp_path), XDG_CONFIG_HOME=str(tmp_path))
    return subprocess.run(
        [sys.executable, "-m", "completiond.cli", "lsp"], capture_output=True, env=env, timeout=60, **stdin
    )


async def test_an_overlong_header_line_is_skipped_and_the_next_message_read():
    stream = asyncio.StreamReader(limit=stdio.HEADER_LIMIT)
    stream.feed_data(b"X" * (stdio.HEADER_LIMIT + 10) + b"\r\n" + frame(SHUTDOWN))
    stream.feed_eof()
    reader = stdio.PipeReader(stream)
    assert (await reader.readline()).startswith(b"X-Skipped")
    assert await reader.readline() == b"Content-Length: %d\r\n" % len(json.dumps(SHUTDOWN))
    assert await reader.readline() == b"\r\n"
    assert json.loads(await reader.readexactly(len(json.dumps(SHUTDOWN)))) == SHUTDOWN
    assert await reader.readline() == b""


async def test_a_body_cut_short_comes_back_partial():
    stream = asyncio.StreamReader()
    stream.feed_data(b"abc")
    stream.feed_eof()
    assert await stdio.PipeReader(stream).readexactly(10) == b"abc"


async def test_a_pipe_is_read_by_the_event_loop():
    r, w = os.pipe()
    with open(r, "rb", buffering=0) as stdin:
        reader = await stdio.pipe_reader(stdin)
        assert isinstance(reader, stdio.PipeReader)
        os.write(w, frame(SHUTDOWN))
        os.close(w)
        assert (await asyncio.wait_for(reader.readline(), 5)).startswith(b"Content-Length: ")
        assert await reader.readline() == b"\r\n"
        assert json.loads(await reader.readexactly(len(json.dumps(SHUTDOWN)))) == SHUTDOWN
        assert await reader.readline() == b""  # the editor closed it


async def test_a_regular_file_is_left_to_the_thread_reader(tmp_path):
    path = tmp_path / "in"
    path.write_bytes(b"")
    with open(path, "rb") as f:
        assert await stdio.pipe_reader(f) is None


def test_the_server_answers_over_a_pipe_after_an_overlong_header(tmp_path):
    env = dict(os.environ, HOME=str(tmp_path), XDG_RUNTIME_DIR=str(tmp_path), XDG_CONFIG_HOME=str(tmp_path))
    proc = subprocess.Popen(
        [sys.executable, "-m", "completiond.cli", "lsp"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
    )
    try:
        proc.stdin.write(b"X-Junk: " + b"y" * (2 * stdio.HEADER_LIMIT) + b"\r\n" + frame(INITIALIZE) + frame(SHUTDOWN))
        proc.stdin.flush()
        out = b""
        while len(replies(out)) < 2:  # the shutdown's reply before exit, as clients do
            chunk = os.read(proc.stdout.fileno(), 65536)
            assert chunk, proc.stderr.read().decode()[-2000:]
            out += chunk
        proc.stdin.write(frame(EXIT))
        proc.stdin.close()
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        proc.wait()
    got = replies(out)
    assert got[1]["result"]["serverInfo"]["name"] == "completiond" and got[2]["result"] is None


def test_the_server_answers_with_stdin_from_a_file(tmp_path):
    path = tmp_path / "session"
    path.write_bytes(frame(INITIALIZE) + frame(SHUTDOWN) + frame(EXIT))
    with open(path, "rb") as f:
        proc = run_server(tmp_path, stdin=f)
    got = replies(proc.stdout)
    assert got[1]["result"]["serverInfo"]["name"] == "completiond", proc.stderr.decode()[-2000:]
    assert got[2]["result"] is None
