"""Fuzzing and load drivers for the daemon and the LSP server (tests/test_fuzz_*.py, test_load.py
run bounded versions of the same code; docs/RELIABILITY.md has the figures of the long runs).

    completiond stress fuzz --target wire --frames 20000 --model DIR
    completiond stress fuzz --target lsp --frames 5000 --model DIR
    completiond stress load --clients 4 --rate 20 --duration 60 --model DIR

--tiny builds a tiny random model (completiond.models.tiny) instead of --model. Every run
gets its own XDG_RUNTIME_DIR, so it never touches the user's daemon, and kills what it
started. Output: one JSON object with the figures (frames tried, replies, p99, ...).

Nothing here is imported by the daemon or the LSP server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import msgpack

from completiond.serving import paths
from completiond.serving import wire

ROOT = Path(__file__).resolve().parents[2]  # the source tree, for daemons started from a checkout

# --- small helpers ---------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = min(len(s) - 1, max(0, int(round(q / 100 * (len(s) - 1)))))
    return round(s[k], 2)


def rss_mb(pid: int) -> float:
    """Resident memory of a process in MiB (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def hwm_mb(pid: int) -> float:
    """Peak resident memory of a process in MiB (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def child_env(runtime: Path, **extra: str) -> dict[str, str]:
    env = dict(
        os.environ,
        XDG_RUNTIME_DIR=str(runtime),
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        XDG_CONFIG_HOME=str(runtime / "config"),
    )
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


def kill_daemon_in(runtime: Path) -> None:
    """SIGKILL the daemon whose pid file is in runtime/completiond (tests and runs clean up with this)."""
    try:
        pid = int((runtime / "completiond" / paths.PID_NAME).read_text())
        os.kill(pid, signal.SIGKILL)
    except (OSError, ValueError):
        pass


def daemon_pid(runtime: Path) -> int | None:
    try:
        return int((runtime / "completiond" / paths.PID_NAME).read_text())
    except (OSError, ValueError):
        return None


def alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def start_daemon(model: str, runtime: Path, timeout: float = 120.0, extra: Sequence[str] = ()) -> subprocess.Popen:
    """`completiond serve` in runtime/completiond; returns once the socket accepts and the model is ready."""
    rundir = runtime / "completiond"
    cmd = [
        sys.executable,
        "-m",
        "completiond.cli",
        "serve",
        "--model",
        model,
        "--device",
        "cpu",
        "--idle-timeout",
        "600",
        "--runtime-dir",
        str(rundir),
        *extra,
    ]
    log = open(runtime / "daemon-stderr.log", "ab")
    proc = subprocess.Popen(
        cmd, env=child_env(runtime), stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
    )
    log.close()
    deadline = time.monotonic() + timeout
    sock = paths.socket_path(rundir)
    while True:
        if proc.poll() is not None:
            raise RuntimeError(
                f"daemon exited with {proc.returncode}: {(runtime / 'daemon-stderr.log').read_text()[-2000:]}"
            )
        if sock.exists():
            try:
                probe = WireProbe(sock)
                state = probe.welcome["status"]["state"]
                while state in ("idle", "loading"):
                    state = probe.request("status", {})["r"]["state"]
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.05)
                probe.close()
                if state in ("ready", "busy"):
                    return proc
                raise RuntimeError(f"daemon state {state}")
            except (OSError, EOFError):
                pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("daemon did not come up")
        time.sleep(0.05)


# --- the daemon's wire protocol, blocking ----------------------------------------------------------------


class WireProbe:
    """A blocking daemon connection for fuzzing: raw frames in, decoded messages (or EOF) out."""

    def __init__(self, sock_path: Path, hello: bool = True, timeout: float = 10.0):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(timeout)
        self.sock.connect(str(sock_path))
        self.buf = b""
        self.welcome: dict[str, Any] = {}
        self._ids = 1 << 20
        if hello:
            self.send(wire.encode({"t": "hello", "v": wire.VERSION, "client": "stress", "pid": os.getpid()}))
            self.welcome = self.read()
            assert self.welcome.get("t") == "welcome", self.welcome

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self, n: int) -> None:
        while len(self.buf) < n:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise EOFError
            self.buf += chunk

    def read(self) -> dict[str, Any]:
        """Next message; EOFError when the daemon closed the connection."""
        self._fill(4)
        (n,) = struct.unpack(">I", self.buf[:4])
        self._fill(4 + n)
        payload, self.buf = self.buf[4 : 4 + n], self.buf[4 + n :]
        return msgpack.unpackb(payload, raw=False)

    def read_reply(self, rid: Any) -> dict[str, Any]:
        """The reply with this id, skipping status notifications."""
        while True:
            msg = self.read()
            if "m" in msg and "id" not in msg:
                continue
            if msg.get("id") == rid:
                return msg

    def request(self, method: str, params: Any) -> dict[str, Any]:
        self._ids += 1
        self.send(wire.encode({"id": self._ids, "m": method, "p": params}))
        return self.read_reply(self._ids)

    def closed_by_peer(self, wait: float = 5.0) -> bool:
        """True if the daemon closed the connection (anything still buffered is dropped)."""
        self.sock.settimeout(wait)
        try:
            while self.sock.recv(1 << 16):
                pass
            return True
        except socket.timeout:
            return False
        except OSError:
            return True

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


# Methods the daemon knows, and the params it expects (types deliberately wrong in mutations).
WIRE_METHODS = ["ping", "status", "stats", "open", "change", "close", "complete", "cancel", "frobnicate", ""]
FUZZ_URIS = ["file:///f.py", "u", "", "file:///%00%ff", "file:///\u202e.py", "x" * 300]


def random_value(rng: random.Random, depth: int = 0) -> Any:
    """Any msgpack-able value: wrong types, huge numbers, odd strings, nesting (bounded here)."""
    kind = rng.randrange(12 if depth < 6 else 8)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice(
            [0, -1, 1, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, -(2**63), 2**64 - 1, rng.randrange(-(10**6), 10**6)]
        )
    if kind == 3:
        return rng.choice([0.0, -0.0, 1.5, float("inf"), float("-inf"), float("nan"), 1e308, -1e-308])
    if kind == 4:
        return rng.choice(["", "a", "é😀中", "\x00", "\r\n", "\ud7ff\ue000", "x" * rng.randrange(0, 5000)])
    if kind == 5:
        return rng.randbytes(rng.randrange(0, 40))
    if kind == 6:
        return rng.choice(FUZZ_URIS)
    if kind == 7:
        return rng.randrange(-5, 100)
    if kind in (8, 9):
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    return {
        rng.choice(
            [
                "uri",
                "version",
                "text",
                "edits",
                "offset",
                "id",
                "settings",
                "languageId",
                "maxTokens",
                "k" + str(rng.randrange(9)),
            ]
        ): random_value(rng, depth + 1)
        for _ in range(rng.randrange(0, 5))
    }


FUZZ_TEXT = "def f(x):\n    return x\n"


def random_params(rng: random.Random, method: str) -> Any:
    """Params that are mostly right for `method`, with one or two things wrong."""
    by_method: dict[str, dict[str, Any]] = {
        "open": {"uri": "file:///f.py", "version": 1, "text": FUZZ_TEXT, "languageId": "python"},
        "change": {"uri": "file:///f.py", "version": 2, "edits": [[0, 0, "# hi\n"]]},
        "close": {"uri": "file:///f.py"},
        "complete": {"uri": "file:///f.py", "version": 1, "offset": 10, "settings": {"maxTokens": 2}},
        "cancel": {"id": 5},
    }
    params: dict[str, Any] = dict(by_method.get(method, {}))
    for _ in range(rng.randrange(0, 3)):
        op = rng.randrange(4)
        if op == 0 and params:
            params.pop(rng.choice(list(params)))
        elif op == 1 and params:
            params[rng.choice(list(params))] = random_value(rng)
        elif op == 2:
            params[rng.choice(["edits", "offset", "version", "settings", "extra"])] = random_value(rng)
        elif op == 3 and "edits" in params:
            params["edits"] = [
                [
                    rng.choice([0, -1, 2**63 - 1, 5, "a", None]),
                    rng.choice([0, 3, 2**64 - 1, 1.5]),
                    rng.choice(["", "x", None, 7, "😀" * 3]),
                ]
                for _ in range(rng.randrange(0, 3))
            ]
    return params if rng.random() > 0.05 else random_value(rng)


def deep(depth: int) -> bytes:
    """msgpack bytes of a map nested `depth` levels (the unpacker refuses it: limits or our depth check)."""
    return b"\x81\xa1a" * depth + b"\xc0"


def fuzz_frame(rng: random.Random) -> tuple[bytes, str]:
    """One hostile frame (header included) and its kind."""
    kind = rng.randrange(10)
    if kind <= 3:  # a well-formed request or notification with bad params
        method = rng.choice(WIRE_METHODS)
        msg: dict[str, Any] = {"m": method, "p": random_params(rng, method)}
        if rng.random() < 0.7:
            msg["id"] = rng.choice([rng.randrange(1, 1 << 20), 0, -1, 2**64 - 1, "x", None, 1.5, [1]])
        if rng.random() < 0.1:
            msg.pop("m")
        return wire.encode(msg), "message"
    if kind == 4:  # a random map (or not a map at all)
        value = random_value(rng, 4)
        if isinstance(value, dict) and rng.random() < 0.5:
            value["id"] = rng.randrange(1, 1000)
        payload = msgpack.packb(value, use_bin_type=True)
        return wire.HEADER.pack(len(payload)) + payload, "message"
    if kind == 5:  # mutated bytes inside a correct length header
        payload = bytearray(
            msgpack.packb(
                {"id": rng.randrange(1, 1000), "m": rng.choice(WIRE_METHODS), "p": random_params(rng, "open")},
                use_bin_type=True,
            )
        )
        for _ in range(rng.randrange(1, 6)):
            i = rng.randrange(len(payload))
            payload[i] = rng.randrange(256)
        return wire.HEADER.pack(len(payload)) + bytes(payload), "mutated"
    if kind == 6:  # bad UTF-8 in a str
        bad = rng.choice([b"\xff\xfe", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82"])
        payload = b"\x83\xa2id\x01\xa1m\xa4open\xa1p\x81\xa4text" + bytes([0xA0 | len(bad)]) + bad
        return wire.HEADER.pack(len(payload)) + payload, "bad-utf8"
    if kind == 7:  # deep nesting
        payload = deep(rng.choice([17, 40, 200, 5000]))
        return wire.HEADER.pack(len(payload)) + payload, "deep"
    if kind == 8:  # absurd or lying lengths
        choice = rng.randrange(4)
        if choice == 0:
            return struct.pack(">I", rng.choice([0, wire.MAX_FRAME + 1, 2**32 - 1])), "length"
        if choice == 1:
            return b"GET / HTTP/1.1\r\n\r\n", "length"
        if choice == 2:  # promises more than it sends: the daemon must not wait forever holding anything
            return struct.pack(">I", 100) + b"\x81", "truncated"
        return struct.pack(">I", 5) + b"\x92\x01\x02\x03\x04", "trailing"  # array, plus extra data
    # huge containers / numbers / ext types
    choice = rng.randrange(4)
    if choice == 0:
        payload = b"\xdd" + struct.pack(">I", 2**31) + b"\x01"  # array32 claiming 2^31 items
    elif choice == 1:
        payload = b"\x81\xa1a\xd4\x01\x00"  # ext type (refused: max_ext_len=0)
    elif choice == 2:
        payload = b"\x81\xa1a\xcf" + b"\xff" * 8  # uint64 max
    else:
        payload = b"\xdf" + struct.pack(">I", 2**31)  # map32 claiming 2^31 pairs
    return wire.HEADER.pack(len(payload)) + payload, "huge"


def expected_outcome(frame: bytes) -> str:
    """What the daemon must do with this frame: 'reply' (an error or result for the id), 'close' (bad frame:
    the connection is closed and the reason logged), or 'none' (a notification: no reply, connection kept)."""
    if len(frame) < 4:
        return "close"
    (n,) = struct.unpack(">I", frame[:4])
    if n == 0 or n > wire.MAX_FRAME or len(frame) - 4 != n:
        return "close"
    try:
        msg = wire.decode_payload(frame[4:])
    except wire.FrameError:
        return "close"
    return "reply" if "id" in msg else "none"


def check_wire_frame(sock_path: Path, frame: bytes, timeout: float = 10.0) -> str:
    """Send one frame on a fresh connection and check the daemon's answer; returns what happened.

    Raises AssertionError when the daemon's behaviour is wrong (no error reply for a request,
    a reply that is not an error/result, a kept connection after an undecodable frame)."""
    expect = expected_outcome(frame)
    probe = WireProbe(sock_path, timeout=timeout)
    try:
        # The document most fuzzed messages name is open on this connection, so completions and
        # edits get past the "unknown document" check into the engine and the edit code.
        probe.request("open", {"uri": "file:///f.py", "version": 1, "text": FUZZ_TEXT, "languageId": "python"})
        probe.send(frame)
        if len(frame) < 4 or len(frame) - 4 < struct.unpack(">I", frame[:4])[0]:
            # A frame cut short: the daemon waits for the rest (at most its frame timeout) or until we hang up.
            probe.sock.shutdown(socket.SHUT_WR)
        if expect == "close":
            assert probe.closed_by_peer(timeout), f"connection kept after bad frame {frame[:60]!r}"
            return "closed"
        msg = wire.decode_payload(frame[4:])
        if expect == "reply":
            rid = msg["id"]
            reply_id = rid  # echoed as sent, whatever its type (an error for a non-integer id)
            while True:
                try:
                    reply = probe.read()
                except (EOFError, socket.timeout):
                    raise AssertionError(f"no reply to {msg!r:.200}") from None
                if "m" in reply and "id" not in reply:
                    continue
                break
            # Compared as encoded: a NaN anywhere in the id is echoed as NaN, which never equals itself.
            assert msgpack.packb(reply.get("id")) == msgpack.packb(reply_id), (msg, reply)
            if "e" in reply:
                err = reply["e"]
                assert isinstance(err.get("code"), int) and isinstance(err.get("message"), str) and err["message"], (
                    reply
                )
                kind = f"error-{err['code']}"
            else:
                assert "r" in reply, reply
                kind = "result"
        else:
            kind = "notification"
        # The connection survives a bad message (not a bad frame): a ping still works on it.
        pong = probe.request("ping", {})
        assert pong.get("r") == "pong", pong
        return kind
    finally:
        probe.close()


def fuzz_wire(
    sock_path: Path,
    frames: int,
    seed: int = 0,
    on_frame: Callable[[int], None] | None = None,
    deadline: float | None = None,
) -> dict[str, Any]:
    """Throw `frames` hostile frames at a running daemon; a sentinel client must keep working throughout."""
    rng = random.Random(seed)
    sentinel = WireProbe(sock_path)
    sentinel.request("open", {"uri": "file:///sentinel.py", "version": 1, "text": "def add(a, b):\n    return "})
    outcomes: dict[str, int] = {}
    kinds: dict[str, int] = {}
    tried = 0
    t0 = time.monotonic()
    try:
        for i in range(frames):
            if deadline is not None and time.monotonic() > deadline:
                break
            frame, kind = fuzz_frame(rng)
            kinds[kind] = kinds.get(kind, 0) + 1
            what = check_wire_frame(sock_path, frame)
            outcomes[what] = outcomes.get(what, 0) + 1
            tried += 1
            if on_frame is not None:
                on_frame(i)
            if i % 50 == 0:  # other clients unaffected
                assert sentinel.request("ping", {}).get("r") == "pong"
        r = sentinel.request(
            "complete", {"uri": "file:///sentinel.py", "version": 1, "offset": 25, "settings": {"maxTokens": 2}}
        )
        assert "r" in r, f"the sentinel client's completion failed after fuzzing: {r}"
    finally:
        sentinel.close()
    return {"frames_tried": tried, "seconds": round(time.monotonic() - t0, 1), "outcomes": outcomes, "kinds": kinds}


# --- LSP over stdio, raw ---------------------------------------------------------------------------------


class RawLsp:
    """A JSON-RPC client for `completiond lsp` that can also send broken bytes.

    Answers the server's own requests (configuration, progress, registration) like an editor would.
    """

    def __init__(self, proc: asyncio.subprocess.Process, settings: dict[str, Any]):
        # started with all three pipes (start below)
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        self.proc = proc
        self.stdin, self.stdout, self.stderr = proc.stdin, proc.stdout, proc.stderr
        self.init: Any = None  # the initialize result
        self.settings = settings
        self.pending: dict[Any, asyncio.Future] = {}
        self.notifications: list[dict[str, Any]] = []
        self.unmatched: list[dict[str, Any]] = []
        self.ids = 0
        self._reader = asyncio.ensure_future(self._read_loop())
        self.stderr_tail = b""
        self._stderr = asyncio.ensure_future(self._drain_stderr())
        self.closed = asyncio.get_running_loop().create_future()

    @classmethod
    async def start(
        cls,
        settings: dict[str, Any],
        runtime: Path,
        *args: str,
        encodings=("utf-16",),
        initialize: bool = True,
        pre: str | None = None,
    ) -> "RawLsp":
        """pre: Python source run in the server process before it starts (fault injection in tests)."""
        if pre is None:
            cmd = [sys.executable, "-m", "completiond.cli", "lsp", *args]
        else:
            cmd = [
                sys.executable,
                "-c",
                pre + f"\nimport sys\nfrom completiond.cli import main\nsys.exit(main(['lsp', *{list(args)!r}]))",
            ]
        proc = await asyncio.create_subprocess_exec(
            *cmd,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=child_env(runtime),
            limit=1 << 26,
        )
        self = cls(proc, settings)
        if initialize:
            caps = {
                "general": {"positionEncodings": list(encodings)},
                "workspace": {"configuration": True},
                "window": {"workDoneProgress": True},
                "textDocument": {"inlineCompletion": {}},
            }
            self.init = await self.request(
                "initialize",
                {
                    "processId": os.getpid(),
                    "rootUri": None,
                    "capabilities": caps,
                    "initializationOptions": {"completiond": settings},
                },
                timeout=60,
            )
            self.notify("initialized", {})
        return self

    async def _drain_stderr(self) -> None:
        while True:
            chunk = await self.stderr.read(1 << 16)
            if not chunk:
                return
            self.stderr_tail = (self.stderr_tail + chunk)[-20000:]

    async def _read_loop(self) -> None:
        out = self.stdout
        try:
            while True:
                length = None
                while True:
                    line = await out.readline()
                    if not line:
                        return
                    if line in (b"\r\n", b"\n"):
                        break
                    name, _, value = line.decode("ascii").partition(":")
                    if name.lower() == "content-length":
                        length = int(value.strip())
                if length is None:
                    raise ValueError("a message without Content-Length")
                body = await out.readexactly(length)
                msg = json.loads(body)
                self._dispatch(msg)
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            if not self.closed.done():
                self.closed.set_result(True)
            for f in self.pending.values():
                if not f.done():
                    f.set_exception(ConnectionError("LSP server closed its output"))

    def _dispatch(self, msg: dict[str, Any]) -> None:
        if "method" in msg:
            if "id" in msg:  # a request from the server
                result: Any = None
                if msg["method"] == "workspace/configuration":
                    result = [self.settings for _ in msg.get("params", {}).get("items", [])]
                self._write({"jsonrpc": "2.0", "id": msg["id"], "result": result})
            else:
                self.notifications.append(msg)
            return
        future = self.pending.pop(msg.get("id"), None)
        if future is None:
            self.unmatched.append(msg)
        elif not future.done():
            future.set_result(msg)

    def _write(self, msg: dict[str, Any] | bytes) -> None:
        body = msg if isinstance(msg, bytes) else _dumps(msg)
        self.stdin.write(b"Content-Length: %d\r\n\r\n" % len(body) + body)

    def send_raw(self, data: bytes) -> None:
        self.stdin.write(data)

    def notify(self, method: str, params: Any) -> None:
        self._write({"jsonrpc": "2.0", "method": method, "params": params})

    def send_request(self, method: str, params: Any, msg_id: Any = None) -> asyncio.Future:
        """Send a request; the future resolves to the whole response message (result or error)."""
        if msg_id is None:
            self.ids += 1
            msg_id = self.ids
        future = asyncio.get_running_loop().create_future()
        self.pending[msg_id] = future
        self._write({"jsonrpc": "2.0", "id": msg_id, "method": method, "params": params})
        return future

    async def request(self, method: str, params: Any, timeout: float = 30) -> Any:
        msg = await asyncio.wait_for(self.send_request(method, params), timeout)
        if "error" in msg:
            raise RuntimeError(f"{method}: {msg['error']}")
        return msg.get("result")

    async def stats(self) -> dict[str, Any]:
        return await self.request("workspace/executeCommand", {"command": "completiond.stats", "arguments": []})

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc.returncode is None

    async def close(self) -> None:
        if self.proc.returncode is None:
            try:
                await asyncio.wait_for(self.request("shutdown", None), 10)
                self.notify("exit", None)
                await asyncio.wait_for(self.proc.wait(), 10)
            except (asyncio.TimeoutError, RuntimeError, ConnectionError, OSError):
                pass
        if self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()
        self._reader.cancel()
        self._stderr.cancel()


def utf16_position(text: str, offset: int) -> dict[str, int]:
    """LSP position (UTF-16) of a code-point offset; lines end at \\n, \\r\\n or \\r. Written independently
    of completiond.completion.documents, as the client's reference."""
    line = 0
    start = 0
    i = 0
    while i < offset:
        ch = text[i]
        if ch == "\n" or (ch == "\r" and (i + 1 >= len(text) or text[i + 1] != "\n")):
            line += 1
            start = i + 1
        i += 1
    return {"line": line, "character": len(text[start:offset].encode("utf-16-le")) // 2}


def did_open(uri: Any, text: Any, version: Any = 1, language: str = "python") -> dict[str, Any]:  # fuzzing: any type
    return {"textDocument": {"uri": uri, "languageId": language, "version": version, "text": text}}


def _dumps(value: Any) -> bytes:
    """JSON bytes; bytes values become latin-1 strings, NaN/Infinity stay (invalid JSON, on purpose)."""
    return json.dumps(value, default=lambda b: b.decode("latin-1")).encode()


def lsp_fuzz_message(rng: random.Random, uri: str, text: str) -> tuple[bytes, Any]:
    """One hostile LSP message body (JSON bytes) and its request id (None for notifications / unparsable)."""
    methods = [
        "textDocument/inlineCompletion",
        "textDocument/completion",
        "textDocument/didChange",
        "textDocument/didOpen",
        "textDocument/didClose",
        "workspace/executeCommand",
        "workspace/didChangeConfiguration",
        "$/cancelRequest",
        "completiond/bogus",
        "textDocument/hover",
    ]
    method = rng.choice(methods)
    pos = {
        "line": rng.choice([0, 1, -1, 2**31 - 1, 2**31, 2**53, 10**30, "0", None, 1.5]),
        "character": rng.choice([0, 3, -5, 2**31 - 1, 2**32, 10**30, "x", None, 1e308]),
    }
    params: Any = {
        "textDocument/inlineCompletion": {
            "textDocument": {"uri": uri},
            "position": pos,
            "context": {"triggerKind": rng.choice([1, 2, 99, "x"])},
        },
        "textDocument/completion": {"textDocument": {"uri": uri}, "position": pos},
        "textDocument/didChange": {
            "textDocument": {"uri": uri, "version": rng.choice([2, -1, 2**31, 10**20, None])},
            "contentChanges": [
                {"range": {"start": pos, "end": dict(pos)}, "text": rng.choice(["x", "", "😀", 5, None])}
            ],
        },
        "textDocument/didOpen": did_open(
            rng.choice([uri, "file:///other.py", 5]), rng.choice([text, "", None, 7]), rng.choice([1, 2**40, "v"])
        ),
        "textDocument/didClose": {"textDocument": {"uri": rng.choice(["file:///nope.py", 5, None])}},
        "workspace/executeCommand": {"command": rng.choice(["completiond.stats", "nope", 5]), "arguments": [1, {}]},
        "workspace/didChangeConfiguration": {"settings": {"completiond": random_value(rng)}},
        "$/cancelRequest": {"id": rng.choice([1, "x", None, 2**70])},
    }.get(method, random_value(rng))
    # Mutate: drop or retype a field somewhere.
    if isinstance(params, dict) and params and rng.random() < 0.5:
        key = rng.choice(list(params))
        if rng.random() < 0.5:
            params.pop(key)
        else:
            params[key] = random_value(rng)
    msg: dict[str, Any] = {"jsonrpc": "2.0", "method": method, "params": params}
    rid = None
    notification = method.startswith(("textDocument/did", "workspace/didChange", "$/"))
    if not notification or rng.random() < 0.2:
        rid = rng.choice([rng.randrange(10**6, 10**7), "s-" + str(rng.randrange(10**6))])
        msg["id"] = rid
        if notification:
            # A notification method with an id: pygls handles it as the notification (no response)
            # when its params fit, and answers with an error when they do not; either is accepted.
            rid = None
    kind = rng.randrange(12)
    if kind == 0:
        return b'{"jsonrpc": "2.0", "id": ' + b"[" * rng.choice([100, 5000, 100000]) + b"1", None  # deep nesting
    if kind == 1:
        body = _dumps(msg)
        return body.replace(b'"2.0"', b'"\xff\xfe"', 1), None  # bad UTF-8
    if kind == 2:
        return _dumps(msg)[: rng.randrange(1, 30)], None  # truncated JSON
    if kind == 3:
        msg["jsonrpc"] = rng.choice(["1.0", None, 2])
        return _dumps(msg), None  # not JSON-RPC 2.0: servers may drop it without a reply
    if kind == 4:
        return _dumps(random_value(rng)), None
    return _dumps(msg), rid


async def fuzz_lsp(
    lsp: RawLsp, uri: str, text: str, messages: int, seed: int = 0, deadline: float | None = None, timeout: float = 30.0
) -> dict[str, Any]:
    """Send hostile messages to a running LSP server; every request must be answered; the server stays up.

    Between bursts, a valid inline completion on a valid document must keep working."""
    rng = random.Random(seed)
    tried = answered = errors = 0
    t0 = time.monotonic()
    batch: list[tuple[Any, asyncio.Future]] = []
    for i in range(messages):
        if deadline is not None and time.monotonic() > deadline:
            break
        body, rid = lsp_fuzz_message(rng, uri, text)
        future = None
        if rid is not None:
            future = asyncio.get_running_loop().create_future()
            lsp.pending[rid] = future
        lsp._write(body)
        tried += 1
        if future is not None:
            batch.append((rid, future))
        if len(batch) >= 8 or i == messages - 1:
            for rid, f in batch:
                try:
                    reply = await asyncio.wait_for(f, timeout)
                except asyncio.TimeoutError:
                    raise AssertionError(
                        f"no response to request {rid!r}; stderr: {lsp.stderr_tail[-3000:]!r}"
                    ) from None
                answered += 1
                if "error" in reply:
                    err = reply["error"]
                    assert isinstance(err.get("code"), int) and err.get("message"), reply
                    errors += 1
            batch.clear()
            assert lsp.running, f"LSP server exited ({lsp.proc.returncode}); stderr: {lsp.stderr_tail[-3000:]!r}"
            # Re-sync: reopen the document with known text so later probes have something valid.
            lsp.notify("textDocument/didOpen", did_open(uri, text, 1))
            pos = utf16_position(text, len(text))
            reply = await asyncio.wait_for(
                lsp.send_request(
                    "textDocument/inlineCompletion",
                    {"textDocument": {"uri": uri}, "position": pos, "context": {"triggerKind": 1}},
                ),
                120,
            )
            assert "result" in reply, f"valid completion failed during fuzzing: {reply}"
    return {
        "messages_tried": tried,
        "requests_answered": answered,
        "error_replies": errors,
        "seconds": round(time.monotonic() - t0, 1),
    }


# --- load: editors typing ----------------------------------------------------------------------------------


TYPED = "    total = sum(value * 2 for value in values if value > 0)\n    return total\n"


async def type_into(
    lsp: RawLsp, uri: str, text: str, keystrokes: int, rate: float, deadline: float, record: list[dict[str, Any]]
) -> str:
    """Type at `rate` keystrokes/s: per keystroke a didChange and an inlineCompletion (as editors do;
    the server supersedes older requests for the document). Returns the final text."""
    version = 1
    sent = 0
    interval = 1.0 / rate
    next_at = time.monotonic()
    last_sent: dict[str, float] = {}
    tasks = []
    while sent < keystrokes and time.monotonic() < deadline:
        ch = TYPED[sent % len(TYPED)]
        pos = utf16_position(text, len(text))
        version += 1
        text += ch
        lsp.notify(
            "textDocument/didChange",
            {
                "textDocument": {"uri": uri, "version": version},
                "contentChanges": [{"range": {"start": pos, "end": pos}, "text": ch}],
            },
        )
        sent_at = time.monotonic()
        entry = {"uri": uri, "seq": sent, "sent": sent_at, "latest": None, "latency_ms": None, "result": None}
        record.append(entry)
        last_sent[uri] = sent_at
        future = lsp.send_request(
            "textDocument/inlineCompletion",
            {"textDocument": {"uri": uri}, "position": utf16_position(text, len(text)), "context": {"triggerKind": 2}},
        )

        async def wait(entry=entry, future=future):
            reply = await future
            now = time.monotonic()
            entry["latency_ms"] = (now - entry["sent"]) * 1000
            entry["result"] = (
                "error" if "error" in reply else ("items" if (reply.get("result") or {}).get("items") else "empty")
            )
            # The latest request: no newer keystroke for this document when it was answered.
            entry["latest"] = last_sent[uri] == entry["sent"]

        tasks.append(asyncio.ensure_future(wait()))
        sent += 1
        next_at += interval
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
    await asyncio.wait_for(asyncio.gather(*tasks), 300)
    return text


async def run_load(
    model: str,
    runtime: Path,
    clients: int = 4,
    rate: float = 20.0,
    duration: float = 60.0,
    sample: Callable[[], Any] | None = None,
    start_own_daemon: bool = True,
) -> dict[str, Any]:
    """`clients` LSP processes, one document each, typing at `rate` keystrokes/s for `duration` s."""
    settings = {"model": model, "device": "cpu", "maxTokens": 8, "idleTimeout": 600}
    daemon = start_daemon(model, runtime) if start_own_daemon else None
    lsps: list[RawLsp] = []
    record: list[dict[str, Any]] = []
    queued_max = 0
    samples = 0
    try:
        lsps = list(await asyncio.gather(*(RawLsp.start(settings, runtime) for _ in range(clients))))
        base = "import math\n\n\ndef score(values):\n"
        for i, lsp in enumerate(lsps):
            lsp.notify("textDocument/didOpen", did_open(f"file:///load/client{i}.py", base))
        # Warm-up: one answered completion each (the model is loaded by then).
        for i, lsp in enumerate(lsps):
            await lsp.request(
                "textDocument/inlineCompletion",
                {
                    "textDocument": {"uri": f"file:///load/client{i}.py"},
                    "position": utf16_position(base, len(base)),
                    "context": {"triggerKind": 1},
                },
                timeout=120,
            )
        before = await lsps[0].stats()
        stop = asyncio.Event()

        async def watch() -> None:
            nonlocal queued_max, samples
            while not stop.is_set():
                st = await lsps[0].stats()
                queued_max = max(queued_max, st["scheduler"]["queued"])
                samples += 1
                if sample is not None:
                    sample()
                await asyncio.sleep(0.1)

        watcher = asyncio.ensure_future(watch())
        t0 = time.monotonic()
        deadline = t0 + duration
        keystrokes = int(duration * rate)
        texts = await asyncio.gather(
            *(
                type_into(lsp, f"file:///load/client{i}.py", base, keystrokes, rate, deadline + 5, record)
                for i, lsp in enumerate(lsps)
            )
        )
        elapsed = time.monotonic() - t0
        stop.set()
        await watcher
        after = await lsps[0].stats()
        assert all(lsp.running for lsp in lsps), "an LSP server exited under load"
        latest = [e["latency_ms"] for e in record if e["latest"]]
        answered = [e for e in record if e["result"] is not None]
        return {
            "clients": clients,
            "rate_per_client": rate,
            "seconds": round(elapsed, 1),
            "requests": len(record),
            "responses": len(answered),
            "errors": sum(1 for e in record if e["result"] == "error"),
            "with_suggestion": sum(1 for e in record if e["result"] == "items"),
            "latest_requests": len(latest),
            "latest_p50_ms": percentile(latest, 50),
            "latest_p99_ms": percentile(latest, 99),
            "all_p99_ms": percentile([e["latency_ms"] for e in answered], 99),
            "max_queued": queued_max,
            "documents": clients,
            "queue_samples": samples,
            "daemon_completed": after["completed"] - before["completed"],
            "daemon_superseded": after["superseded"] - before["superseded"],
            "daemon_cancelled": after["cancelled"] - before["cancelled"],
            "daemon_errors": after["errors"] - before["errors"],
            "daemon_rejected": after["rejected"] - before["rejected"],
            "daemon_rss_mb": round(rss_mb(daemon.pid), 1) if daemon is not None else None,
            "final_lengths": [len(t) for t in texts],
        }
    finally:
        for lsp in lsps:
            await lsp.close()
        if daemon is not None:
            daemon.kill()
            daemon.wait()
        kill_daemon_in(runtime)


# --- command line ----------------------------------------------------------------------------------------


def _model(args: argparse.Namespace, tmp: Path) -> str:
    if args.model:
        return str(Path(args.model).resolve())
    if args.tiny:
        from completiond.models.tiny import make_tiny_model

        return str(make_tiny_model(tmp / "tiny"))
    from completiond.models import default_model_dir

    path = default_model_dir()
    if not (path / "config.json").is_file():
        raise SystemExit(f"no bundled model at {path}: pass --model DIR or --tiny")
    return str(path)


async def _fuzz_lsp_main(model: str, runtime: Path, messages: int, seed: int, seconds: float | None) -> dict[str, Any]:
    settings = {"model": model, "device": "cpu", "maxTokens": 2, "idleTimeout": 600}
    daemon = start_daemon(model, runtime)
    uri, text = "file:///fuzz/a.py", "def add(a, b):\n    return a + b\n\nx = add(1, 2)\n"
    a = await RawLsp.start(settings, runtime)
    b = await RawLsp.start(settings, runtime)  # the other editor: must be unaffected
    try:
        a.notify("textDocument/didOpen", did_open(uri, text))
        b.notify("textDocument/didOpen", did_open(uri, text))
        deadline = time.monotonic() + seconds if seconds else None
        report = await fuzz_lsp(a, uri, text, messages, seed, deadline)
        reply = await b.request(
            "textDocument/inlineCompletion",
            {"textDocument": {"uri": uri}, "position": utf16_position(text, len(text)), "context": {"triggerKind": 1}},
            timeout=120,
        )
        assert reply is not None and a.running and b.running and daemon.poll() is None
        report.update(lsp_exits=0, daemon_exits=0, other_client_ok=True, lsp_rss_mb=round(rss_mb(a.pid), 1))
        return report
    finally:
        await a.close()
        await b.close()
        daemon.kill()
        daemon.wait()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="mode", required=True)
    f = sub.add_parser("fuzz", help="hostile frames (daemon socket) or messages (LSP stdio)")
    f.add_argument("--target", choices=("wire", "lsp"), default="wire")
    f.add_argument("--frames", type=int, default=20000, help="frames (wire) or messages (lsp) to send")
    f.add_argument("--seconds", type=float, help="stop after this long")
    f.add_argument("--seed", type=int, default=0)
    load = sub.add_parser("load", help="LSP clients typing against one daemon")
    load.add_argument("--clients", type=int, default=4)
    load.add_argument("--rate", type=float, default=20.0, help="keystrokes per second per client")
    load.add_argument("--duration", type=float, default=60.0)
    for p in (f, load):
        p.add_argument("--model", help="model directory (default: the bundled model)")
        p.add_argument("--tiny", action="store_true", help="a tiny random model built on the spot")


def run(args: argparse.Namespace) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="completiond-stress-"))
    runtime = tmp / "rt"
    runtime.mkdir(mode=0o700)
    try:
        model = _model(args, tmp)
        if args.mode == "load":
            report = asyncio.run(run_load(model, runtime, args.clients, args.rate, args.duration))
            ok = (
                report["responses"] == report["requests"]
                and report["max_queued"] <= report["documents"]
                and report["errors"] == 0
            )
        elif args.target == "wire":
            proc = start_daemon(model, runtime)
            try:
                deadline = time.monotonic() + args.seconds if args.seconds else None
                report = fuzz_wire(
                    paths.socket_path(runtime / "completiond"), args.frames, args.seed, deadline=deadline
                )
                report["daemon_exits"] = 0 if proc.poll() is None else 1
                report["daemon_rss_mb"] = round(rss_mb(proc.pid), 1)
                ok = proc.poll() is None
            finally:
                proc.kill()
                proc.wait()
        else:
            report = asyncio.run(_fuzz_lsp_main(model, runtime, args.frames, args.seed, args.seconds))
            ok = True
        report["ok"] = ok
        print(json.dumps(report, indent=2))
        return 0 if ok else 1
    finally:
        kill_daemon_in(runtime)
        shutil.rmtree(tmp, ignore_errors=True)
