"""The first-run offer (issue 47): with no model configured, the language server asks once, through
`window/showMessageRequest`, whether to download the model recommended for this machine; accepted, the
daemon downloads and loads it with progress in the editor; declined or offline, the bundled model stays,
with one notice, and the question never comes again. End to end against the stand-in hub of test_pull."""

from __future__ import annotations

import asyncio
import json
import os
import sys

import pytest
from lsprotocol import types
from pytest_lsp import make_test_lsp_client
from test_lsp import capabilities, runtime, wait_for  # noqa: F401  (fixtures)
from test_pull import BUNDLED, FakeHub

from completiond.lsp import first_run

GIB = 1 << 30


def test_the_recommendation_fits_the_machine():
    assert first_run.recommend(gpu_free=40 * GIB).name == "qwen2.5-coder-7b"
    assert first_run.recommend(gpu_free=5 * GIB).name == "qwen2.5-coder-1.5b"
    assert first_run.recommend(gpu_free=1 * GIB, memory=2 * GIB, cores=2).name == "qwen2.5-coder-0.5b"
    big_cpu = first_run.recommend(memory=32 * GIB, cores=16)
    assert (big_cpu.name, big_cpu.weights, big_cpu.device) == ("qwen2.5-coder-1.5b", "int8", "cpu")
    small = first_run.recommend(memory=4 * GIB, cores=2)
    assert small.name == "qwen2.5-coder-0.5b" and small.weights == "auto"
    text = small.message()
    assert "1.0 GB" in text and "ms/token" in text and small.repo in text


class Editor:
    def __init__(self, client, asked: list, status: list):
        self.client, self.asked, self.status = client, asked, status


@pytest.fixture
async def editor(runtime, monkeypatch):
    editors: list[Editor] = []

    async def _start(answer: str | None, settings: dict | None = None) -> Editor:
        client = make_test_lsp_client()
        asked: list = []
        status: list = []

        @client.feature("window/showMessageRequest")
        def on_request(params):
            asked.append(params)
            return types.MessageActionItem(title=answer) if answer else None

        @client.feature("completiond/status")
        def on_status(params):
            status.append(params if isinstance(params, dict) else params._asdict())

        env = dict(os.environ, XDG_RUNTIME_DIR=str(runtime), OMP_NUM_THREADS="1",
                   XDG_CONFIG_HOME=str(runtime / "config"))
        await client.start_io(sys.executable, "-m", "completiond.cli", "lsp", env=env)
        await client.initialize_session(types.InitializeParams(
            capabilities=capabilities(), initialization_options={"completiond": {
                "device": "cpu", "idleTimeout": 60, "maxTokens": 4, **(settings or {})}}))
        e = Editor(client, asked, status)
        editors.append(e)
        return e

    yield _start
    for e in editors:
        try:
            await asyncio.wait_for(e.client.shutdown_session(), 20)
        except Exception:
            pass
        await e.client.stop()


def state(runtime) -> dict:
    return json.loads((runtime / "config" / "completiond" / first_run.STATE_FILE).read_text())


def _state_or_empty(runtime) -> dict:
    try:
        return state(runtime)
    except (FileNotFoundError, json.JSONDecodeError):  # not written yet, or being replaced
        return {}


@pytest.mark.slow
async def test_declined_the_bundled_model_stays_and_it_is_asked_once(editor, runtime):
    a = await editor(first_run.NOT_NOW)
    await wait_for(lambda: a.asked, "the first-run question")
    assert len(a.asked) == 1 and "Download" in [x.title for x in a.asked[0].actions]
    await wait_for(lambda: any("using the bundled model" in m.message for m in a.client.messages), "the notice")
    assert state(runtime)["asked"] is True and "model" not in state(runtime)
    await wait_for(lambda: any(s.get("state") == "ready" for s in a.status), "ready")
    assert "bundled" in a.status[-1]["model"]
    b = await editor(first_run.DOWNLOAD)  # a new window later: no second question
    await wait_for(lambda: any(s.get("state") in ("ready", "busy") for s in b.status), "ready")
    await asyncio.sleep(1.0)
    assert not b.asked


@pytest.mark.slow
async def test_no_question_when_a_model_is_set(editor, runtime):
    e = await editor(first_run.DOWNLOAD, {"model": str(BUNDLED)})
    await wait_for(lambda: any(s.get("state") == "ready" for s in e.status), "ready")
    await asyncio.sleep(1.0)
    assert not e.asked and not (runtime / "config" / "completiond" / first_run.STATE_FILE).exists()


@pytest.fixture
def hub(tmp_path, monkeypatch):
    server = FakeHub()
    for repo in ("Qwen/Qwen2.5-Coder-0.5B", "Qwen/Qwen2.5-Coder-1.5B", "Qwen/Qwen2.5-Coder-7B"):
        server.add(repo, BUNDLED)  # the bundled model's files stand in for the real ones
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    yield server
    server.close()


@pytest.mark.slow
async def test_accepted_the_model_downloads_with_progress_and_loads(editor, runtime, hub, tmp_path):
    e = await editor(first_run.DOWNLOAD)
    await wait_for(lambda: e.asked, "the first-run question")
    # The answer is recorded once the server has it, a moment after the question reached the editor.
    await wait_for(lambda: "model" in _state_or_empty(runtime), "the answer recorded")
    model = state(runtime)["model"]
    assert model.startswith("Qwen/Qwen2.5-Coder-")

    def loaded():
        return any(s.get("state") == "ready" and model in str(s.get("model")) for s in e.status)

    await wait_for(loaded, f"{model} to load", timeout=240)
    assert "config.json" in hub.fetched() and any(f.endswith(".safetensors") for f in hub.fetched())
    reports = [r for rs in e.client.progress_reports.values() for r in rs]
    assert any(isinstance(r, types.WorkDoneProgressBegin) and r.cancellable for r in reports), reports
    # The next window starts with it, and asks nothing.
    f = await editor(first_run.NOT_NOW)
    await wait_for(lambda: any(model in str(s.get("model")) for s in f.status), "the accepted model")
    assert not f.asked


@pytest.mark.slow
async def test_offline_the_bundled_model_comes_back_with_one_notice(editor, runtime, hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    e = await editor(first_run.DOWNLOAD)
    await wait_for(lambda: "failed" in state(runtime) if (runtime / "config" / "completiond" /
                                                          first_run.STATE_FILE).exists() else False,
                   "the download to fail", timeout=240)
    await wait_for(lambda: any(s.get("state") == "ready" and "bundled" in str(s.get("model")) for s in e.status[-3:]),
                   "the bundled model again", timeout=240)
    told = [m for m in e.client.messages if "could not be downloaded" in m.message]
    assert len(told) == 1 and "completiond pull" in told[0].message, e.client.messages
    assert not [m for m in e.client.messages if m.type == types.MessageType.Error], e.client.messages
    assert "model" not in state(runtime) and not hub.fetched()


# --- the download's checks (engine/hub.py pull, which the daemon's load uses) ----------------------------

def _hub_env(monkeypatch, tmp_path, server) -> None:
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)


def test_every_file_is_checked_against_the_hubs_hashes(tmp_path, monkeypatch):
    from completiond.engine import hub as hub_mod

    server = FakeHub()
    try:
        server.add("Qwen/Qwen2.5-Coder-0.5B", BUNDLED)
        _hub_env(monkeypatch, tmp_path, server)
        pulled = hub_mod.pull("Qwen/Qwen2.5-Coder-0.5B")  # sha256 of the weights, git blob ids of the rest
        assert (pulled.path / "model.safetensors").is_file()
        server.add("Qwen/Qwen2.5-Coder-1.5B", BUNDLED)
        server.wrong = {"model.safetensors"}
        with pytest.raises(hub_mod.HubError, match="does not match the hub's sha256"):
            hub_mod.pull("Qwen/Qwen2.5-Coder-1.5B")
        assert not list((tmp_path / "hf").glob("models--Qwen--Qwen2.5-Coder-1.5B/snapshots/*/model.safetensors"))
        server.wrong = {"tokenizer.json"}
        with pytest.raises(hub_mod.HubError, match="git-sha1"):
            hub_mod.pull("Qwen/Qwen2.5-Coder-1.5B")
    finally:
        server.close()


def test_a_full_disk_is_found_before_anything_is_downloaded(tmp_path, monkeypatch):
    import shutil

    from completiond.engine import hub as hub_mod

    server = FakeHub()
    try:
        server.add("Qwen/Qwen2.5-Coder-0.5B", BUNDLED)
        _hub_env(monkeypatch, tmp_path, server)
        real = shutil.disk_usage
        monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=10 << 20))
        with pytest.raises(hub_mod.HubError, match="not enough free disk space"):
            hub_mod.pull("Qwen/Qwen2.5-Coder-0.5B")
        assert not server.fetched()
    finally:
        server.close()
