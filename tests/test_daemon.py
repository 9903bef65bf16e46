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
from test_scheduler import FakeEngine, local


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
    service = Service(cfg, loader=local(engine))
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
        # typed so far: "ret"; the fake's "urn a + b" then completes valid code (the Python syntax check
        # would cut an insertion that breaks it)
        text = "def add(a, b):\n    re"
        c.notify("open", {"uri": "file:///a.py", "version": 1, "text": text})
        c.notify("change", {"uri": "file:///a.py", "version": 2, "edits": [[len(text), len(text), "t"]]})
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


@pytest.mark.parametrize("rid", ["abc", 1.5, [1, 2], None, {"k": 1}])
async def test_non_integer_request_id_is_echoed_as_sent(daemon, rid):
    """Issue 16 item 9: the error for a request with a non-integer id carried id null."""
    reader, writer = await raw_connection(daemon.server.socket_path)
    writer.write(wire.encode({"id": rid, "m": "ping", "p": {}}))
    reply = await read_reply(reader)
    assert reply["id"] == rid and reply["e"]["code"] == Code.BAD_REQUEST
    writer.close()


async def test_stalled_partial_frame_is_dropped_idle_connection_is_not(daemon, caplog):
    """Issue 16 item 6: a peer that sent part of a frame and stalled was held forever."""
    daemon.server.frame_timeout = 0.3
    idle_reader, idle_writer = await raw_connection(daemon.server.socket_path)
    reader, writer = await raw_connection(daemon.server.socket_path)
    frame = wire.encode({"id": 1, "m": "ping", "p": {}})
    writer.write(frame[:6])                       # header and two bytes of the body, then nothing
    await writer.drain()
    await asyncio.wait_for(reader.read(), 10)     # status broadcasts may precede the close
    assert reader.at_eof()
    assert "frame not completed within 0.3 s" in caplog.text
    # A connection that is merely idle between frames (an editor nobody types in) stays.
    idle_writer.write(wire.encode({"id": 2, "m": "ping", "p": {}}))
    assert (await read_reply(idle_reader))["r"] == "pong"
    writer.close()
    idle_writer.close()


async def test_connection_cap_refuses_with_a_clear_error(daemon):
    """Issue 16 item 6: ~20,000 stalled connections reached the fd limit and new clients hung."""
    daemon.server.max_connections = 2
    a, b = await daemon.connect(), await daemon.connect()
    try:
        with pytest.raises(RemoteError) as err:
            await daemon.connect()
        assert err.value.code == Code.OVERLOADED and "too many connections" in err.value.message
        await b.close()
        for _ in range(500):
            if len(daemon.server._handlers) < 2:
                break
            await asyncio.sleep(0.01)
        c = await daemon.connect()                 # room again
        assert await c.request("ping", {}, timeout=5) == "pong"
        await c.close()
    finally:
        await a.close()


def test_log_flood_is_rate_limited():
    """Issue 16 item 6: EMFILE tracebacks filled the runtime directory at ~0.5 MB/s."""
    import logging

    from completiond.serving.server import RateLimitFilter

    now = [0.0]
    limiter = RateLimitFilter(burst=5, window=60.0, clock=lambda: now[0])

    def record(msg, *args, level=logging.ERROR, name="asyncio"):
        return logging.LogRecord(name, level, __file__, 1, msg, args, None)

    flood = [record("socket.accept() out of system resource\nsocket: %r", i) for i in range(1000)]
    assert sum(limiter.filter(r) for r in flood) == 5
    assert limiter.filter(record("%s: connected", "client#9", level=logging.INFO, name="x"))  # another kind
    assert all(limiter.filter(record("context for %s", i, level=logging.DEBUG)) for i in range(100))
    now[0] = 61.0
    after = record("socket.accept() out of system resource\nsocket: %r", 1000)
    assert limiter.filter(after) and "995 more like this in the last 60 s not logged" in after.getMessage()


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
        assert daemon.server.service.metrics.counts["loads"] == 1
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
    service = Service(config.Config(), loader=local(FakeEngine()))
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
    rc = await serve(config.Config(), rundir, loader=local(FakeEngine()))
    assert rc == 3
    c = await daemon.connect()
    assert await c.request("ping", {}, timeout=5) == "pong"
    await c.close()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a directory away")
async def test_foreign_owned_dir_refused(tmp_path, caplog):
    d = tmp_path / "rt"
    d.mkdir(mode=0o700)
    os.chown(d, 12345, 12345)
    rc = await serve(config.Config(), d, loader=local(FakeEngine()))
    assert rc == 2
    assert "owned by uid 12345" in caplog.text
    with pytest.raises(paths.InsecureDirectoryError):
        await client_mod.connect_or_spawn({}, d, timeout=2)


async def test_engine_settings_mismatch_warns(daemon):
    c = await client_mod.DaemonClient.connect(daemon.server.socket_path, "t", {"model": "/some/other/model"})
    warning = c.welcome.get("warning", "")
    assert "different settings" in warning and "model='/some/other/model'" in warning
    # What a user can do, in words they can type: not the server's internal command id.
    assert "completiond.restartDaemon" not in warning
    assert config.RESTART_HINT in warning and ":CompletiondRestart" in warning and "completiond stop" in warning
    await c.close()


async def test_busy_is_announced_only_for_work_that_takes_a_while(daemon, monkeypatch):
    """A quick answer goes out without a "busy" status before it (a broadcast that ran beside the request on
    the same cores, for a spinner nobody could see); work past BUSY_AFTER_S is announced; the answer's own
    status (ready, with its latency) follows it either way."""
    from completiond.serving import lifecycle

    BUSY_AFTER_S = 0.5  # well past the fake engine's quick answer (~20 ms), even on a loaded machine
    monkeypatch.setattr(lifecycle, "BUSY_AFTER_S", BUSY_AFTER_S)
    states: list[str] = []
    daemon.server.service.listeners.append(lambda status: states.append(status["state"]))
    c = await daemon.connect()
    try:
        text = "def add(a, b):\n    ret"
        c.notify("open", {"uri": "file:///a.py", "version": 1, "text": text})
        await c.request("complete", {"uri": "file:///a.py", "version": 1, "offset": len(text)}, timeout=10)
        await asyncio.sleep(BUSY_AFTER_S + 0.1)
        assert "busy" not in states and states[-1] == "ready"
        states.clear()
        daemon.engine.round_s = BUSY_AFTER_S  # the request now runs several times as long as the announcement waits
        c.notify("change", {"uri": "file:///a.py", "version": 2, "edits": [[0, 0, "#\n"]]})
        await c.request("complete", {"uri": "file:///a.py", "version": 2, "offset": len(text) + 2}, timeout=30)
        await asyncio.sleep(0.05)
        assert states.index("busy") < len(states) - 1 and states[-1] == "ready"
    finally:
        await c.close()


async def test_status_counts_editors_apart_from_command_line_clients(daemon, capsys):
    from completiond.commands.status import _status

    editor = await client_mod.DaemonClient.connect(daemon.server.socket_path, wire.EDITOR_CLIENT, {})
    cli_complete = await client_mod.DaemonClient.connect(daemon.server.socket_path, "completiond-complete", {})
    try:
        stats = await editor.request("stats", {}, timeout=5)
        assert (stats["clients"], stats["editors"]) == (2, 1)
        assert await _status(daemon.server.directory, False, 5) == 0
        out = capsys.readouterr().out
        assert "clients  1 editor connection(s), 1 other (command line)" in out, out
    finally:
        await editor.close()
        await cli_complete.close()


async def test_suggestion_events_are_counted_and_shown_by_status(daemon, capsys):
    from completiond.commands.status import _status

    c = await daemon.connect()
    try:
        for event in ({"event": "shown"}, {"event": "shown"}, {"event": "shown"}, {"event": "accepted", "kind": "full"},
                      {"event": "accepted", "kind": "word"}, {"event": "dismissed"}):
            c.notify("suggestion", event)
        c.notify("suggestion", {"event": "accepted", "kind": "sideways"})  # refused, connection kept
        with pytest.raises(RemoteError) as err:
            await c.request("suggestion", {"event": "liked"}, timeout=5)
        assert err.value.code == Code.BAD_REQUEST and "unknown suggestion event" in err.value.message
        status = await c.request("status", {}, timeout=5)
        assert status["suggestions"] == {"shown": 3, "accepted_full": 1, "accepted_word": 1, "accepted_line": 0,
                                         "dismissed": 1}
        assert await _status(daemon.server.directory, False, 5) == 0
        out = capsys.readouterr().out
        assert "3 suggestions shown, 2 accepted (1 whole, 1 by word, 0 by line), 1 dismissed" in out, out
    finally:
        await c.close()


def test_draft_acceptance_and_speed_only_when_measured():
    from completiond.serving.scheduler import OK, Outcome

    service = Service(config.Config(), loader=local(FakeEngine()))
    # Plain decoding that produced nothing: neither figure was measured, so neither is 0.
    service.metrics.account(Outcome(OK, {"latency_ms": 3.0, "suggestion": None, "stats": {
        "drafted": 0, "accepted": 0, "rejected": 0, "alpha": 0.0, "generated_tokens": 0, "decode_ms": 0.0,
        "tokens_per_s": 0.0}}))
    status = service.status()
    assert "alpha" not in status
    assert status["draft_acceptance"] is None and status["tokens_per_s"] is None and status["last_latency_ms"] == 3.0
    assert service.stats()["draft_acceptance"] is None
    service.metrics.account(Outcome(OK, {"latency_ms": 9.0, "suggestion": None, "stats": {
        "drafted": 4, "accepted": 3, "rejected": 1, "alpha": 0.75, "generated_tokens": 5, "decode_ms": 50.0,
        "tokens_per_s": 100.0}}))
    status = service.status()
    assert status["draft_acceptance"] == 0.75 and status["tokens_per_s"] == 100.0
    assert service.stats()["draft_acceptance"] == 0.75


async def test_loading_reports_phases_with_percentages():
    from completiond.serving.lifecycle import LOAD_PHASES

    def loader(_cfg, progress, **_hooks):
        for phase in ("tokenizer", "weights", "device", "engine", "warm-up", "ready"):
            progress(phase, LOAD_PHASES[phase][0])
        return local(FakeEngine())(_cfg)

    service = Service(config.Config(), loader=loader)
    seen: list[dict] = []
    service.listeners.append(seen.append)
    service.start_loading()
    for _ in range(200):
        if service.state == "ready":
            break
        await asyncio.sleep(0.02)
    assert service.state == "ready"
    progress = [s["progress"] for s in seen if s["state"] == "loading"]
    assert [p["percentage"] for p in progress] == [0, 2, 10, 70, 80, 90, 100]
    assert [p["message"] for p in progress][1:3] == ["loading the tokenizer", "loading the weights"]
    assert seen[-1]["state"] == "ready" and seen[-1]["progress"] is None
    service.shutdown()


async def _load_and_log(cfg, loader, monkeypatch) -> tuple[Service, str]:
    """Load with `loader` while the root logger writes (only) to a buffer set up as the daemon sets up
    daemon.log (serve: basicConfig, then install_log_rate_limit); the service and what was written."""
    import io
    import logging

    from completiond.serving.server import install_log_rate_limit

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [handler])
    monkeypatch.setattr(root, "level", logging.INFO)
    install_log_rate_limit()
    service = Service(cfg, loader=loader)
    service.start_loading()
    for _ in range(500):
        if service.state in ("ready", "error"):
            break
        await asyncio.sleep(0.02)
    service.shutdown()
    return service, stream.getvalue()


async def test_daemon_log_has_no_traceback_for_a_configuration_error(monkeypatch, tmp_path):
    """Issue 30: daemon.log held a full traceback for a model directory that is not there. A CompletionError
    is logged as its message; a bug (any other exception) keeps its traceback."""
    from completiond.serving.lifecycle import load_completer

    monkeypatch.chdir(tmp_path)
    service, log_text = await _load_and_log(config.Config(model="./nope"), load_completer, monkeypatch)
    assert service.state == "error"
    # The path as given and as resolved (a daemon resolves it in its own folder).
    assert f"model directory ./nope does not exist ({tmp_path / 'nope'})" in service.error
    assert "Traceback" not in log_text, log_text
    assert f"./nope does not exist ({tmp_path / 'nope'})" in log_text, log_text

    def buggy(_cfg, **_hooks):
        raise ZeroDivisionError("a bug in the loader")

    service, log_text = await _load_and_log(config.Config(), buggy, monkeypatch)
    assert service.state == "error"
    assert "Traceback" in log_text and "ZeroDivisionError: a bug in the loader" in log_text, log_text


async def test_session_tells_at_once_when_the_daemon_goes_away(daemon, rundir):
    """Issue 30: after the daemon was killed, editors showed `ready` until the next keystroke. The session
    says so when the connection ends by itself; not when it closes the connection itself."""
    lost: list[str] = []
    session = client_mod.DaemonSession(lambda: {}, lambda: {}, directory=rundir, on_lost=lost.append)
    await session.ensure()
    daemon.server.request_stop("killed")
    await asyncio.wait_for(daemon.task, 10)
    for _ in range(250):
        if lost:
            break
        await asyncio.sleep(0.02)
    assert len(lost) == 1 and lost[0], lost
    assert not session.connected


async def test_session_close_is_not_a_lost_daemon(daemon, rundir):
    lost: list[str] = []
    session = client_mod.DaemonSession(lambda: {}, lambda: {}, directory=rundir, on_lost=lost.append)
    await session.ensure()
    await session.close()
    await asyncio.sleep(0.1)
    assert lost == []


def test_language_server_reports_a_lost_daemon_as_stopped(rundir):
    """What editors get: a `completiond/status` with state "stopped" and why, no error pop-up."""
    from completiond.lsp.server import STATUS_METHOD, build_server

    server = build_server(no_daemon=False, runtime_dir=rundir)
    sent, shown = [], []
    server.protocol.notify = lambda method, params=None: sent.append((method, params))
    server.window_show_message = shown.append
    server.status = {"state": "ready", "model": "m", "device": "cpu"}
    server.service.session.on_lost("the daemon closed the connection")
    (method, params), = sent
    assert method == STATUS_METHOD and params["state"] == "stopped"
    assert "the daemon closed the connection" in params["message"] and "next completion starts it again" in params["message"]
    assert params["model"] == "m" and shown == []


def test_the_bundled_model_has_one_name_everywhere(tmp_path):
    """Issue 30: the model was named three ways: `(bundled default) on auto` while loading, `completiond-py-mini
    (bundled) on cpu` once loaded, and `(daemon: '')` in the mismatch warning. One name now."""
    from completiond.commands.status import describe
    from completiond.models import DEFAULT_MODEL_NAME

    name = f"{DEFAULT_MODEL_NAME} (bundled)"  # what Engine.load names it (test_pull checks the engine's side)
    assert config.model_label("") == name
    service = Service(config.Config(), loader=local(FakeEngine()))
    status = service.status()  # before any load
    assert status["model"] == name
    mismatch = config.engine_differences(config.engine_settings(config.Config(model="./mine")),
                                         config.engine_settings(config.Config()))
    assert mismatch == [f"model='./mine' (daemon: {name!r})"], mismatch
    draft = config.engine_differences(config.engine_settings(config.Config(draft_model="org/d")),
                                      config.engine_settings(config.Config()))
    assert draft == ["draftModel='org/d' (daemon: 'none (the model drafts from its own layers)')"], draft
    stats = {"status": {**status, "state": "loading", "uptime_s": 1.0},
             "requests": 0, "completed": 0, "superseded": 0, "cancelled": 0, "errors": 0}
    lines = describe(stats, tmp_path)
    model_line = next(line for line in lines if line.strip().startswith("model"))
    assert name in model_line and "(bundled default)" not in model_line
    assert not model_line.endswith(" on auto"), model_line  # auto is a setting, not a device
    from completiond.commands.complete import LoadReporter

    assert LoadReporter("").model == name  # `completiond complete`'s "loading ..." line
    service.shutdown()


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
