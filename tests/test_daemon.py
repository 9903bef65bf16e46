"""The daemon over its socket: handshake, requests, hostile input, lifecycle.

Most tests run the DaemonServer in this process with a fake engine (fast);
the last ones start real `completiond serve` processes on the tiny model.
"""

from __future__ import annotations

import asyncio
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest

from completiond.serving import client as client_mod
from completiond import config
from completiond.serving import paths
from completiond.serving import wire
from completiond.serving.server import DaemonServer, serve
from completiond.serving.service import Service
from completiond.serving.wire import Code, RemoteError
from test_scheduler import FakeEngine


@pytest.fixture
def rundir(tmp_path):
    d = tmp_path / "rt"
    d.mkdir(mode=0o700)
    return d


class Running:
    def __init__(self, server: DaemonServer, task: asyncio.Task, engine: FakeEngine):
        self.server, self.task, self.engine = server, task, engine

    async def connect(self, **kw) -> client_mod.DaemonClient:
        return await client_mod.DaemonClient.connect(self.server.socket_path, "test", {}, **kw)


@pytest.fixture
async def daemon(rundir):
    engine = FakeEngine(continuation="urn a + b\n", per_round=2, round_s=0.002)
    cfg, _ = config.merge(config.Config(), {"maxTokens": 16, "tokenHealing": False})
    service = Service(cfg, loader=lambda _c: engine)
    server = DaemonServer(service, rundir, idle_timeout=60)
    await server.start()
    service.start_loading()
    task = asyncio.create_task(server.serve_until_stopped())
    yield Running(server, task, engine)
    server.request_stop("test over")
    await asyncio.wait_for(task, 10)


async def raw_connection(path: Path, hello: bool = True):
    reader, writer = await asyncio.open_unix_connection(str(path))
    if hello:
        writer.write(wire.encode({"t": "hello", "v": wire.VERSION, "client": "raw", "pid": os.getpid()}))
        welcome = await wire.read_message(reader)
        assert welcome["t"] == "welcome"
    return reader, writer


async def read_reply(reader):
    """Next reply, skipping the status notifications the daemon broadcasts."""
    while True:
        message = await asyncio.wait_for(wire.read_message(reader), 5)
        if "id" in message:
            return message


async def test_socket_and_dir_permissions(daemon, rundir):
    assert (os.stat(rundir).st_mode & 0o777) == 0o700
    assert (os.stat(daemon.server.socket_path).st_mode & 0o777) == 0o600
    assert (rundir / paths.PID_NAME).read_text().strip() == str(os.getpid())


async def test_open_complete_and_status(daemon):
    c = await daemon.connect()
    try:
        assert c.welcome["v"] == wire.VERSION
        text = "def add(a, b):\n    ret"
        c.notify("open", {"uri": "file:///a.py", "version": 1, "text": text})
        c.notify("change", {"uri": "file:///a.py", "version": 2, "edits": [[len(text), len(text), "u"]]})
        result = await c.request("complete", {"uri": "file:///a.py", "version": 2, "offset": len(text) + 1}, timeout=10)
        assert result["version"] == 2
        # The fake engine ignores the prompt and always continues with "urn a + b".
        assert result["suggestion"] == {"text": "urn a + b", "start": len(text) + 1, "end": len(text) + 1,
                                        "multiline": False}
    finally:
        status = await c.request("status", {}, timeout=5)
        assert status["state"] in ("ready", "busy") and status["model"] == "fake"
        await c.close()


async def test_unknown_method_and_bad_params_get_error_replies(daemon):
    c = await daemon.connect()
    try:
        with pytest.raises(RemoteError) as err:
            await c.request("frobnicate", {}, timeout=5)
        assert err.value.code == Code.UNKNOWN_METHOD
        with pytest.raises(RemoteError) as err:
            await c.request("complete", {"uri": 3}, timeout=5)
        assert err.value.code == Code.BAD_REQUEST
        with pytest.raises(RemoteError) as err:
            await c.request("complete", {"uri": "nope", "version": 1, "offset": 0}, timeout=5)
        assert err.value.code == Code.UNKNOWN_DOCUMENT
        assert await c.request("ping", {}, timeout=5) == "pong"
    finally:
        await c.close()


@pytest.mark.parametrize("junk", [
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",                      # garbage: absurd length
    struct.pack(">I", wire.MAX_FRAME + 1) + b"x" * 100,        # oversized frame
    struct.pack(">I", 2) + b"\xc1\xc1",                        # malformed msgpack
    wire.HEADER.pack(len(p := msgpack.packb({"a": [[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]}))) + p,  # too deep
])
async def test_bad_frames_close_only_that_connection(daemon, junk, caplog):
    good = await daemon.connect()
    try:
        reader, writer = await raw_connection(daemon.server.socket_path)
        writer.write(junk)
        await writer.drain()
        await asyncio.wait_for(reader.read(), 5)  # status broadcasts may precede the close
        assert reader.at_eof()  # closed by the daemon
        writer.close()
        assert "bad frame" in caplog.text
        assert await good.request("ping", {}, timeout=5) == "pong"
        other = await daemon.connect()
        assert await other.request("ping", {}, timeout=5) == "pong"
        await other.close()
    finally:
        await good.close()


async def test_garbage_instead_of_handshake(daemon, caplog):
    reader, writer = await raw_connection(daemon.server.socket_path, hello=False)
    writer.write(wire.encode({"m": "complete", "id": 1, "p": {}}))
    assert await asyncio.wait_for(reader.read(), 5) == b""
    assert "expected a hello" in caplog.text
    c = await daemon.connect()
    assert await c.request("ping", {}, timeout=5) == "pong"
    await c.close()


async def test_foreign_peer_uid_refused(daemon, monkeypatch, caplog):
    monkeypatch.setattr(paths, "peer_uid", lambda sock: os.getuid() + 1)
    reader, writer = await asyncio.open_unix_connection(str(daemon.server.socket_path))
    assert await asyncio.wait_for(reader.read(), 5) == b""
    assert "refused connection from uid" in caplog.text
    monkeypatch.undo()
    c = await daemon.connect()
    assert await c.request("ping", {}, timeout=5) == "pong"
    await c.close()


async def test_version_mismatch_is_refused_with_error(daemon):
    reader, writer = await raw_connection(daemon.server.socket_path, hello=False)
    writer.write(wire.encode({"t": "hello", "v": 999, "client": "future"}))
    reply = await wire.read_message(reader)
    assert reply["t"] == "error" and reply["e"]["code"] == Code.VERSION_MISMATCH
    assert await asyncio.wait_for(reader.read(), 5) == b""


async def test_malformed_message_keeps_connection(daemon):
    reader, writer = await raw_connection(daemon.server.socket_path)
    writer.write(wire.encode({"id": 5, "m": 17}))
    reply = await read_reply(reader)
    assert reply["id"] == 5 and reply["e"]["code"] == Code.BAD_REQUEST
    writer.write(wire.encode({"id": 6, "m": "ping", "p": {}}))
    assert (await read_reply(reader))["r"] == "pong"
    writer.close()


async def test_cancel_message_stops_running_request(daemon):
    daemon.engine.continuation = "a" * 2000
    daemon.engine.per_round = 1
    c = await daemon.connect()
    try:
        c.notify("open", {"uri": "u", "version": 1, "text": "x = "})
        task = asyncio.ensure_future(c.request("complete", {"uri": "u", "version": 1, "offset": 4,
                                                            "settings": {"maxTokens": 1000}}))
        await asyncio.get_running_loop().run_in_executor(None, daemon.engine.started.wait, 5)
        task.cancel()  # DaemonClient turns this into a "cancel" message
        for _ in range(300):
            if not daemon.server.service.scheduler.busy:
                break
            await asyncio.sleep(0.01)
        assert not daemon.server.service.scheduler.busy
        assert daemon.engine.calls[-1].rounds < 1000
        assert daemon.server.service.stats()["cancelled"] == 1
    finally:
        await c.close()


async def test_two_clients_have_separate_documents(daemon):
    a, b = await daemon.connect(), await daemon.connect()
    try:
        a.notify("open", {"uri": "u", "version": 1, "text": "aaa"})
        b.notify("open", {"uri": "u", "version": 7, "text": "bbbb"})
        ra, rb = await asyncio.gather(a.request("complete", {"uri": "u", "version": 1, "offset": 3}, timeout=10),
                                      b.request("complete", {"uri": "u", "version": 7, "offset": 4}, timeout=10))
        assert ra["version"] == 1 and rb["version"] == 7
        assert daemon.server.service.stats_counts["loads"] == 1
    finally:
        await a.close()
        await b.close()


async def test_disconnect_forgets_client_documents(daemon):
    c = await daemon.connect()
    c.notify("open", {"uri": "u", "version": 1, "text": "x"})
    await c.request("ping", {}, timeout=5)
    assert len(daemon.server.service.documents) == 1
    await c.close()
    for _ in range(100):
        if not daemon.server.service.documents:
            break
        await asyncio.sleep(0.01)
    assert not daemon.server.service.documents


async def test_stop_request_cleans_up(daemon, rundir):
    c = await daemon.connect()
    assert (await c.request("stop", {}, timeout=5))["stopping"]
    await asyncio.wait_for(daemon.task, 10)
    assert not daemon.server.socket_path.exists()
    assert not (rundir / paths.PID_NAME).exists()


async def test_idle_exit(rundir):
    service = Service(config.Config(), loader=lambda _c: FakeEngine())
    server = DaemonServer(service, rundir, idle_timeout=0.3)
    await server.start()
    c = await client_mod.DaemonClient.connect(server.socket_path, "t", {})
    task = asyncio.create_task(server.serve_until_stopped())
    await asyncio.sleep(0.6)
    assert not task.done()  # a connected client keeps it alive
    await c.close()
    await asyncio.wait_for(task, 5)
    assert "no clients" in server.stop_reason
    assert not server.socket_path.exists()


async def test_second_daemon_refuses_to_start(daemon, rundir):
    rc = await serve(config.Config(), rundir, loader=lambda _c: FakeEngine())
    assert rc == 3
    c = await daemon.connect()
    assert await c.request("ping", {}, timeout=5) == "pong"
    await c.close()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a directory away")
async def test_foreign_owned_dir_refused(tmp_path, caplog):
    d = tmp_path / "rt"
    d.mkdir(mode=0o700)
    os.chown(d, 12345, 12345)
    rc = await serve(config.Config(), d, loader=lambda _c: FakeEngine())
    assert rc == 2
    assert "owned by uid 12345" in caplog.text
    with pytest.raises(paths.InsecureDirectoryError):
        await client_mod.connect_or_spawn({}, d, timeout=2)


async def test_engine_settings_mismatch_warns(daemon):
    c = await client_mod.DaemonClient.connect(daemon.server.socket_path, "t", {"model": "/some/other/model"})
    assert "different settings" in c.welcome.get("warning", "")
    await c.close()


# --- real daemon processes -------------------------------------------------------------------


def _env(rundir: Path) -> dict[str, str]:
    env = dict(os.environ, XDG_RUNTIME_DIR=str(rundir.parent), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def kill_daemon(rundir: Path) -> None:
    try:
        pid = int((rundir / paths.PID_NAME).read_text())
    except (OSError, ValueError):
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture
def real_rundir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    d = tmp_path / "completiond"
    yield d
    kill_daemon(d)


@pytest.mark.slow
async def test_spawn_once_kill9_and_respawn(tiny_model_dir, real_rundir):
    settings = {"model": str(tiny_model_dir), "device": "cpu", "idleTimeout": 60}
    # Two clients racing to start the daemon make exactly one.
    a, b = await asyncio.gather(client_mod.connect_or_spawn(settings, real_rundir, timeout=90),
                                client_mod.connect_or_spawn(settings, real_rundir, timeout=90))
    try:
        assert a.welcome["pid"] == b.welcome["pid"]
        pid = a.welcome["pid"]
        assert (real_rundir / paths.PID_NAME).read_text().strip() == str(pid)
        text = "def add(a, b):\n    return a + b\n"
        a.notify("open", {"uri": "u", "version": 1, "text": text})
        r = await a.request("complete", {"uri": "u", "version": 1, "offset": len(text),
                                         "settings": {"maxTokens": 4}}, timeout=120)
        assert r["version"] == 1 and r["stats"]["prompt_tokens"] > 0
        stats = await b.request("stats", {}, timeout=10)
        assert stats["loads"] == 1 and stats["clients"] == 2

        os.kill(pid, signal.SIGKILL)
        docs = {"u": (1, text, "python")}
        session = client_mod.DaemonSession(lambda: settings, lambda: docs, directory=real_rundir)
        r = await session.request("complete", {"uri": "u", "version": 1, "offset": len(text),
                                               "settings": {"maxTokens": 4}}, timeout=120)
        assert r["version"] == 1
        assert session.client.welcome["pid"] != pid
        await session.close()
    finally:
        await a.close()
        await b.close()


@pytest.mark.slow
def test_serve_garbage_and_stop_cli(tiny_model_dir, real_rundir):
    env = _env(real_rundir)
    proc = subprocess.Popen([sys.executable, "-m", "completiond.cli", "serve", "--model", str(tiny_model_dir),
                             "--device", "cpu", "--idle-timeout", "60"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        sock = real_rundir / paths.SOCKET_NAME
        deadline = time.monotonic() + 60
        while not sock.exists():
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        import socket as socket_mod

        s = socket_mod.socket(socket_mod.AF_UNIX)
        s.connect(str(sock))
        s.sendall(b"\x00\x10\x00\x00" + b"\xff" * 16)  # 1 MiB promised, garbage given, then hang up
        s.close()
        out = subprocess.run([sys.executable, "-m", "completiond.cli", "status"], env=env, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "pid" in out.stdout
        out = subprocess.run([sys.executable, "-m", "completiond.cli", "stop"], env=env, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert proc.wait(30) == 0
        assert not sock.exists()
        assert "bad frame" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
async def test_spawn_failure_reports_log_tail(real_rundir):
    settings = {"model": "/no/such/model/dir", "device": "cpu", "idleTimeout": 30}
    client = await client_mod.connect_or_spawn(settings, real_rundir, timeout=90)
    try:
        # The daemon starts and listens, then fails to load: every client is told why.
        for _ in range(600):
            status = await client.request("status", {}, timeout=10)
            if status["state"] == "error":
                break
            await asyncio.sleep(0.1)
        assert status["state"] == "error" and "/no/such/model/dir" in status["error"]
        client.notify("open", {"uri": "u", "version": 1, "text": "x"})
        with pytest.raises(RemoteError) as err:
            await client.request("complete", {"uri": "u", "version": 1, "offset": 1}, timeout=10)
        assert err.value.code == Code.NOT_READY and "/no/such/model/dir" in err.value.message
    finally:
        await client.close()


async def test_session_backs_off_after_repeated_failures(tmp_path, monkeypatch):
    calls = []

    async def failing(*args, **kwargs):
        calls.append(1)
        raise client_mod.DaemonUnavailable("the daemon exited with status 1 during start-up")

    monkeypatch.setattr(client_mod, "connect_or_spawn", failing)
    session = client_mod.DaemonSession(lambda: {}, lambda: {}, directory=tmp_path)
    for _ in range(client_mod.CRASH_LOOP_FAILURES):
        with pytest.raises(client_mod.DaemonUnavailable, match="start-up"):
            await session.ensure()
    with pytest.raises(client_mod.DaemonUnavailable, match="failed 3 times in a row"):
        await session.ensure()
    assert len(calls) == client_mod.CRASH_LOOP_FAILURES  # no spawn attempt while backing off
    session._retry_at = 0.0
    with pytest.raises(client_mod.DaemonUnavailable, match="start-up"):
        await session.ensure()
    assert len(calls) == client_mod.CRASH_LOOP_FAILURES + 1
