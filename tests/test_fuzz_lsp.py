"""Fuzzing the LSP server process (issue 7, item 1): random and mutated JSON-RPC messages
on stdio — wrong types, missing fields, huge numbers, bad UTF-8, deep nesting, positions
out of range. The `completiond lsp` process must never exit, must answer every request
(result or error), and another editor on the same daemon must be unaffected.
"""

from __future__ import annotations

import asyncio
import random
import threading

import numpy  # noqa: F401  (see test_fuzz_wire)
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from completiond.commands import stress
from test_fuzz_wire import InProcDaemon

pytestmark = pytest.mark.slow

URI = "file:///fuzz/a.py"
TEXT = "def add(a, b):\n    return a + b\n\nx = add(1, 2)\n# é😀中\r\ny = "
SETTINGS = {"maxTokens": 4, "idleTimeout": 600, "tokenHealing": False}  # the fake engine ignores healing


class LoopThread:
    """An event loop on a thread, so sync (hypothesis) tests can drive an async RawLsp."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """One in-process daemon (fake engine), two LSP processes on it: `a` is fuzzed, `b` is the bystander."""
    daemon = InProcDaemon(tmp_path_factory.mktemp("lspfuzz"))
    lt = LoopThread()

    async def start():
        a = await stress.RawLsp.start(SETTINGS, daemon.runtime)
        b = await stress.RawLsp.start(SETTINGS, daemon.runtime)
        for lsp in (a, b):
            lsp.notify("textDocument/didOpen", stress.did_open(URI, TEXT))
        return a, b

    a, b = lt.run(start())
    yield daemon, lt, a, b
    try:
        assert a.running and b.running, f"an LSP process exited: {a.stderr_tail[-3000:]!r}"
        reply = lt.run(complete(b))
        assert reply["result"]["items"], reply     # the bystander still gets suggestions
    finally:
        lt.run(a.close())
        lt.run(b.close())
        lt.close()
        daemon.stop()
    assert not daemon.errors, daemon.errors[:3]


async def complete(lsp: stress.RawLsp, text: str = TEXT, uri: str = URI) -> dict:
    lsp.notify("textDocument/didOpen", stress.did_open(uri, text))
    return await asyncio.wait_for(lsp.send_request("textDocument/inlineCompletion", {
        "textDocument": {"uri": uri}, "position": stress.utf16_position(text, len(text)),
        "context": {"triggerKind": 1}}), 60)


def test_random_message_run(stack):
    """The long script's generator, bounded: 600 hostile messages, a valid completion after every 8."""
    daemon, lt, a, b = stack
    report = lt.run(stress.fuzz_lsp(a, URI, TEXT, 600, seed=random.randrange(1 << 30)), timeout=600)
    assert report["messages_tried"] == 600 and report["requests_answered"] > 50
    assert report["error_replies"] > 0
    assert a.running and daemon.thread.is_alive()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=12)
numbers = st.integers(-(2**70), 2**70) | st.sampled_from([0, 1, 2**31 - 1, 2**31, 2**32]) | json_values
positions = st.fixed_dictionaries({}, optional={"line": numbers, "character": numbers}) | json_values
requests = st.sampled_from(["textDocument/inlineCompletion", "textDocument/completion", "workspace/executeCommand",
                            "textDocument/hover", "completiond/nope", "initialize", "shutdown-not"])


@settings(max_examples=150, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(method=requests, uri=st.sampled_from([URI, "file:///unknown.py", "", "not a uri"]) | json_values,
       position=positions, extra=st.dictionaries(st.sampled_from(["context", "command", "arguments",
                                                                  "textDocument"]), json_values, max_size=2),
       drop=st.sampled_from([None, "textDocument", "position"]))
def test_requests_with_wrong_params_are_answered(stack, method, uri, position, extra, drop):
    daemon, lt, a, b = stack
    params = {"textDocument": {"uri": uri}, "position": position, "context": {"triggerKind": 1},
              "command": "completiond.stats", **extra}
    if drop:
        params.pop(drop)

    async def go():
        return await asyncio.wait_for(a.send_request(method, params), 60)

    reply = lt.run(go())
    assert ("result" in reply) != ("error" in reply), reply
    if "error" in reply:
        assert isinstance(reply["error"]["code"], int) and reply["error"]["message"], reply
    assert a.running


@pytest.mark.parametrize("body", [
    b'{"jsonrpc": "2.0", "id": 1, "method": "x", "params": ' + b"[" * 100000 + b"]" * 100000 + b"}",   # deep nesting
    b'{"jsonrpc": "2.0", "method": "textDocument/didOpen", "params": {"textDocument": {"uri": "\xff\xfe"}}}',
    b'{"jsonrpc": "2.0", "id": 2, "method": "textDocument/completion", "par',                           # truncated
    b"\x00\x01\x02 not json at all",
    b'{"jsonrpc": "2.0", "id": 3, "method": "textDocument/completion", "params": {"position": 1e999}}',
], ids=["deep", "bad-utf8", "truncated", "binary", "inf"])
def test_unparsable_messages_reported_and_survived(stack, body):
    """No response is possible without an id; pygls reports each one to the editor (window/showMessage)."""
    daemon, lt, a, b = stack
    before = sum(1 for n in a.notifications if n["method"] == "window/showMessage")
    a._write(body)

    async def after():
        for _ in range(200):
            if sum(1 for n in a.notifications if n["method"] == "window/showMessage") > before:
                break
            await asyncio.sleep(0.02)
        return await complete(a)

    reply = lt.run(after())
    shown = [n for n in a.notifications if n["method"] == "window/showMessage"][before:]
    assert shown and "Error" in shown[0]["params"]["message"], a.notifications[-3:]
    assert reply["result"]["items"], reply


def test_positions_out_of_range_clamp(stack):
    """Valid messages with absurd positions: clamped (LSP says so), answered, never an exception."""
    daemon, lt, a, b = stack

    async def go():
        replies = []
        for line, ch in [(0, 10**6), (2**31 - 1, 0), (1, 2**31 - 1), (5, 1), (6, 3)]:
            replies.append(await asyncio.wait_for(a.send_request("textDocument/inlineCompletion", {
                "textDocument": {"uri": URI}, "position": {"line": line, "character": ch},
                "context": {"triggerKind": 1}}), 60))
        version = 2
        for rng in ([0, 10**6, 0, 10**6], [2**31 - 1, 0, 2**31 - 1, 5], [3, 0, 1, 0]):  # reversed range too
            a.notify("textDocument/didChange", {"textDocument": {"uri": URI, "version": version},
                                                "contentChanges": [{"range": {
                                                    "start": {"line": rng[0], "character": rng[1]},
                                                    "end": {"line": rng[2], "character": rng[3]}}, "text": "z"}]})
            version += 1
        replies.append(await asyncio.wait_for(a.stats(), 30))
        return replies

    replies = lt.run(go())
    assert all("result" in r for r in replies[:-1]), replies
    assert replies[-1]["errors"] == 0, replies[-1]


def test_real_stack_survives_fuzzing(tiny_model_dir, tmp_path):
    """LSP process + the daemon process it spawns, on the tiny model: zero exits of either."""
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    settings_ = {"model": str(tiny_model_dir), "device": "cpu", "maxTokens": 2, "idleTimeout": 600}

    async def go():
        a = await stress.RawLsp.start(settings_, runtime)
        b = await stress.RawLsp.start(settings_, runtime)
        try:
            assert (await complete(a))["result"] is not None      # spawns and loads the daemon
            pid = stress.daemon_pid(runtime)
            report = await stress.fuzz_lsp(a, URI, TEXT, 150, seed=3)
            reply = await complete(b)
            stats = await b.stats()
            return pid, report, reply, stats, a.running, b.running
        finally:
            await a.close()
            await b.close()

    try:
        pid, report, reply, stats, a_up, b_up = asyncio.run(go())
        assert a_up and b_up
        assert stress.alive(pid) and stats["status"]["pid"] == pid, "the daemon exited or was replaced"
        assert "result" in reply
        assert report["messages_tried"] == 150
    finally:
        stress.kill_daemon_in(runtime)
