"""Crash recovery (issue 7, item 4).

* kill -9 the daemon while several editors' requests are generating: every LSP process
  reconnects (a new daemon), replays its documents, and answers; the next requests succeed.
  (tests/test_lsp.py covers one idle client; this is several clients mid-generation.)
* kill -9 an LSP process: the daemon drops that client's documents and cancels its work;
  the other editor is unaffected.
* an exception injected into any daemon handler, the engine, or the LSP server's handlers
  fails that one request (an error reply), never the connection or the process.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from completiond.commands import stress
from completiond.serving import wire
from completiond.serving.wire import Code
from test_fuzz_wire import InProcDaemon
from test_scheduler import FakeEngine

TEXT = "def add(a, b):\n    return a + b\n\n\ndef main():\n    ret"  # the fake engine's "urn a + b" completes it validly


def inline(lsp: stress.RawLsp, uri: str, text: str) -> asyncio.Future:
    return lsp.send_request("textDocument/inlineCompletion", {
        "textDocument": {"uri": uri}, "position": stress.utf16_position(text, len(text)),
        "context": {"triggerKind": 2}})


@pytest.mark.slow
async def test_kill9_daemon_mid_generation_three_clients(tiny_model_dir, tmp_path):
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    settings = {"model": str(tiny_model_dir), "device": "cpu", "maxTokens": 300, "multiline": "always",
                "maxLines": 200, "idleTimeout": 600}
    lsps: list[stress.RawLsp] = []
    try:
        lsps = list(await asyncio.gather(*(stress.RawLsp.start(settings, runtime) for _ in range(3))))
        uris = [f"file:///rec/c{i}.py" for i in range(3)]
        for lsp, uri in zip(lsps, uris):
            lsp.notify("textDocument/didOpen", stress.did_open(uri, TEXT))
        first = await asyncio.wait_for(asyncio.gather(*(inline(lsp, uri, TEXT) for lsp, uri in zip(lsps, uris))), 180)
        assert all("result" in r for r in first), first
        old_pid = stress.daemon_pid(runtime)
        assert (await lsps[0].stats())["documents"] == 3

        # Everyone types one more character and asks again; kill the daemon while it generates
        # (a random model may end a generation early: then type again).
        text = TEXT
        for attempt in range(1, 6):
            for version, lsp, uri in ((attempt + 1, lsp, uri) for lsp, uri in zip(lsps, uris)):
                end = stress.utf16_position(text, len(text))
                lsp.notify("textDocument/didChange", {"textDocument": {"uri": uri, "version": version},
                                                      "contentChanges": [{"range": {"start": end, "end": end},
                                                                          "text": "a"}]})
            text += "a"
            inflight = [inline(lsp, uri, text) for lsp, uri in zip(lsps, uris)]
            running = False
            for _ in range(400):
                if (await lsps[0].stats())["scheduler"]["running"]:
                    running = True
                    break
                await asyncio.sleep(0.01)
            if running:
                break
            await asyncio.wait_for(asyncio.gather(*inflight), 180)
        else:
            raise AssertionError("no generation was ever running")
        os.kill(old_pid, signal.SIGKILL)
        killed_at = time.monotonic()
        answers = await asyncio.wait_for(asyncio.gather(*inflight), 180)
        # The in-flight requests were retried on the new daemon (or answered empty): never an error.
        assert all("result" in a for a in answers), answers
        recovered_s = time.monotonic() - killed_at

        # Next requests succeed on the new daemon, with every client's document replayed.
        nxt = await asyncio.wait_for(asyncio.gather(*(inline(lsp, uri, text) for lsp, uri in zip(lsps, uris))), 180)
        assert all("result" in r for r in nxt), nxt
        stats = await lsps[0].stats()
        assert stats["status"]["pid"] != old_pid and stress.alive(stats["status"]["pid"])
        assert not stress.alive(old_pid)
        assert stats["documents"] == 3, stats        # all three editors replayed their document
        assert stats["errors"] == 0 and stats["loads"] == 1, stats
        assert all(lsp.running for lsp in lsps)
        print(f"recovered in {recovered_s:.2f} s")
    finally:
        for lsp in lsps:
            await lsp.close()
        stress.kill_daemon_in(runtime)


async def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


@pytest.mark.slow
async def test_kill9_lsp_process_frees_its_state(tmp_path):
    engine = FakeEngine(continuation="y" * 5000, per_round=1, round_s=0.01)
    daemon = InProcDaemon(tmp_path, engine=engine)
    a = b = None
    try:
        a = await stress.RawLsp.start({"maxTokens": 1000, "tokenHealing": False}, tmp_path)
        b = await stress.RawLsp.start({"maxTokens": 4, "tokenHealing": False}, tmp_path)
        for i in range(3):
            a.notify("textDocument/didOpen", stress.did_open(f"file:///a{i}.py", TEXT))
        b.notify("textDocument/didOpen", stress.did_open("file:///b.py", TEXT))
        await a.stats()
        await b.stats()
        await wait_until(lambda: len(daemon.documents()) == 4)
        inline(a, "file:///a0.py", TEXT)                                   # a long generation for `a`
        await wait_until(lambda: daemon.call(lambda: daemon.service.scheduler.snapshot()["running"]))
        conns_before = daemon.call(lambda: len(daemon.server.conns))
        os.kill(a.pid, signal.SIGKILL)
        await a.proc.wait()
        await wait_until(lambda: daemon.call(lambda: len(daemon.server.conns)) == conns_before - 1)
        docs = daemon.documents()
        assert [u for (_c, u) in docs] == ["file:///b.py"], docs           # a's three documents are gone
        await wait_until(lambda: not daemon.call(lambda: daemon.service.scheduler.busy), 5)
        assert engine.calls[-1].rounds < 1000                               # its generation was cancelled
        assert daemon.service.metrics.counts["cancelled"] >= 1
        reply = await asyncio.wait_for(inline(b, "file:///b.py", TEXT), 30)  # the other editor is unaffected
        assert reply["result"]["items"]
    finally:
        for lsp in (a, b):
            if lsp is not None:
                await lsp.close()
        daemon.stop()
    assert not daemon.errors


# --- injected exceptions ------------------------------------------------------------------------------


@pytest.fixture
def inproc(tmp_path):
    d = InProcDaemon(tmp_path)
    yield d
    d.stop()
    assert not d.errors, d.errors[:3]


def inject_once(obj, name: str, exc: BaseException):
    orig = getattr(obj, name)
    calls = {"n": 0}

    def wrapper(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise exc
        return orig(*args, **kwargs)

    setattr(obj, name, wrapper)
    return calls


PARAMS = {
    "open": {"uri": "file:///i.py", "version": 1, "text": TEXT},
    "change": {"uri": "file:///i.py", "version": 1, "edits": []},
    "close": {"uri": "file:///i.py"},
    "complete": {"uri": "file:///i.py", "version": 1, "offset": len(TEXT)},
    "status": {},
    "stats": {},
    "ping": {},
}


@pytest.mark.parametrize("target, method", [
    ("service.open", "open"), ("service.change", "change"), ("service.close", "close"),
    ("service.complete", "complete"), ("service.status", "status"), ("service.stats", "stats"),
    ("service.request", "ping"), ("engine.generate", "complete"), ("service._run", "complete"),
    ("scheduler.submit", "complete"),
])
@pytest.mark.parametrize("exc", [RuntimeError, AttributeError, MemoryError])
def test_exception_in_a_handler_fails_only_that_request(inproc, target, method, exc):
    probe = stress.WireProbe(inproc.socket_path)
    other = stress.WireProbe(inproc.socket_path)
    try:
        probe.request("open", PARAMS["open"])
        owner, name = target.split(".")
        obj = {"service": inproc.service, "server": inproc.server, "engine": inproc.engine,
               "scheduler": inproc.service.scheduler}[owner]
        calls = inject_once(obj, name, exc("injected"))
        reply = probe.request(method, PARAMS[method])
        assert calls["n"] == 1, "the injected handler was not reached"
        assert reply["e"]["code"] == Code.INTERNAL and reply["e"]["message"], reply
        # Same connection, same request again: it works; another connection never noticed.
        again = probe.request(method, PARAMS[method])
        assert "r" in again, again
        probe.request("open", PARAMS["open"])
        done = probe.request("complete", PARAMS["complete"])
        assert done["r"]["suggestion"]["text"] == "urn a + b", done
        assert other.request("ping", {})["r"] == "pong"
    finally:
        probe.close()
        other.close()


def test_exception_in_a_notification_keeps_the_connection(inproc):
    probe = stress.WireProbe(inproc.socket_path)
    try:
        probe.request("open", PARAMS["open"])
        calls = inject_once(inproc.service, "change", RuntimeError("injected"))
        probe.send(wire.encode({"m": "change", "p": {"uri": "file:///i.py", "version": 2, "edits": [[0, 0, "#"]]}}))
        assert probe.request("ping", {})["r"] == "pong" and calls["n"] == 1
        # The document was not changed: a completion at version 2 asks for a resend, then works at version 1.
        assert probe.request("complete", {**PARAMS["complete"], "version": 2})["e"]["code"] == Code.UNKNOWN_DOCUMENT
        assert "r" in probe.request("complete", PARAMS["complete"])
    finally:
        probe.close()


def test_exception_in_status_listener_or_handshake_is_contained(inproc):
    """A broken status listener must not break the request that changed the state."""
    def bad_listener(_status):
        raise RuntimeError("listener injected")

    inproc.call(lambda: inproc.service.listeners.append(bad_listener))
    probe = stress.WireProbe(inproc.socket_path)
    try:
        probe.request("open", PARAMS["open"])
        assert "r" in probe.request("complete", PARAMS["complete"])
    finally:
        inproc.call(lambda: inproc.service.listeners.remove(bad_listener))
        probe.close()


LSP_INJECT = """
import completiond.lsp.server as S
from completiond.serving import client as C
_calls = {"suggest": 0, "notify": 0}
_suggest = S.CompletionServer.suggest
async def suggest(self, *a, **k):
    _calls["suggest"] += 1
    if _calls["suggest"] == 1:
        raise RuntimeError("injected into suggest")
    return await _suggest(self, *a, **k)
S.CompletionServer.suggest = suggest
_notify = C.DaemonSession.notify
def notify(self, method, params):
    if method == "change":
        _calls["notify"] += 1
        if _calls["notify"] == 1:
            raise RuntimeError("injected into notify")
    return _notify(self, method, params)
C.DaemonSession.notify = notify
"""


@pytest.mark.slow
async def test_exception_in_lsp_handlers_fails_only_that_request(tmp_path):
    daemon = InProcDaemon(tmp_path)
    lsp = await stress.RawLsp.start({"maxTokens": 4, "tokenHealing": False}, tmp_path, pre=LSP_INJECT)
    try:
        uri = "file:///lspinj.py"
        lsp.notify("textDocument/didOpen", stress.did_open(uri, TEXT))
        first = await asyncio.wait_for(inline(lsp, uri, TEXT), 30)
        assert first["error"]["code"] == -32603 and "injected into suggest" in first["error"]["message"], first
        second = await asyncio.wait_for(inline(lsp, uri, TEXT), 30)
        assert second["result"]["items"], second
        # The change forwarded to the daemon is lost to an exception: the daemon's copy is stale, the
        # next completion is refused as UNKNOWN_DOCUMENT and the session resends the document, transparently.
        end = stress.utf16_position(TEXT, len(TEXT))
        lsp.notify("textDocument/didChange", {"textDocument": {"uri": uri, "version": 2}, "contentChanges": [
            {"range": {"start": end, "end": end}, "text": "q"}]})
        third = await asyncio.wait_for(inline(lsp, uri, TEXT + "q"), 30)
        assert third["result"]["items"], third
        docs = daemon.documents()
        assert [v for (_c, u), v in docs.items() if u == uri] == [(2, TEXT + "q")]
        assert lsp.running
    finally:
        await lsp.close()
        daemon.stop()
