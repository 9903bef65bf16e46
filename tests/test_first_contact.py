"""A new user's first minutes (issue 47): each defect they met, as a test.

- a missing model path is reported once, not as an error and then again as a warning;
- an unreachable team server turns the status to "error" (with its words), not "ready" while every request
  fails, and back to "ready" when it answers;
- a new window asking the shared daemon for other daemon settings is told, not ignored;
- the README's first example asks where an editor would show a suggestion, and one shows;
- prose (Markdown, plain text) gets no suggestions from the server itself, whatever the client;
- the one-time native compile is a load phase of its own (and `completiond setup`), never a silent pause.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
from lsprotocol import types
from remote_servers import FakeServer
from test_lsp import URI, runtime, settings_for, start, wait_for  # noqa: F401  (fixtures)
from test_scheduler import FakeEngine, local

from completiond import config as config_mod
from completiond.serving import client as client_mod
from completiond.serving import wire
from completiond.serving.server import DaemonServer
from completiond.serving.service import Service, ServiceError
from completiond.serving.wire import Code

ROOT = Path(__file__).resolve().parent.parent


# --- a missing model path: said once ------------------------------------------------------------------------

@pytest.mark.slow
async def test_a_missing_model_path_is_reported_once(start, tmp_path):
    missing = tmp_path / "no-such-model"
    s = await start({"model": str(missing), "device": "cpu", "idleTimeout": 60})
    await s.open()
    await wait_for(lambda: any(st.get("state") == "error" for st in s.status), "the load error")
    for ch in "abc":  # the editor keeps asking as the user types; each request fails for the same reason
        s.type(ch)
        assert not (await s.inline(timeout=30)).items
    await asyncio.sleep(0.3)
    told = [m for m in s.client.messages if "does not exist" in m.message]
    assert len(told) == 1, s.client.messages
    assert told[0].type == types.MessageType.Error and str(missing) in told[0].message


# --- an unreachable team server: not "ready" -------------------------------------------------------------------

def _remote_cfg(url: str):
    cfg, errors = config_mod.merge(config_mod.Config(), {"backend": "openai", "endpoint": url, "multiline": "never",
                                                         "endpointModel": "completiond-py-mini", "endpointTimeout": 2.0})
    assert not errors
    return cfg


async def test_a_failing_team_server_shows_as_error_until_it_answers(tmp_path):
    fake = FakeServer()
    service = Service(_remote_cfg(fake.url))
    seen: list[dict] = []
    service.listeners.append(seen.append)
    try:
        service.start_loading()
        for _ in range(100):
            if service.state == "ready":
                break
            await asyncio.sleep(0.05)
        assert service.state == "ready"
        service.notify("c", "workspace", {"folders": [str(tmp_path)]})
        uri = (tmp_path / "a.py").as_uri()
        service.open("c", uri, 1, "x = ", "python")
        fake.plan.mode = "status"
        for rid in (1, 2):  # the second one falls within the backoff: the same error, the same status
            with pytest.raises(ServiceError) as err:
                await service.complete("c", rid, uri, 1, 4)
            assert err.value.code == Code.ENGINE_ERROR
            await asyncio.sleep(0.05)
            status = service.status()
            assert status["state"] == "error" and status["error"] == err.value.message, status
        assert sum(1 for a, b in zip(seen, seen[1:]) if b["state"] == "error" and a["state"] != "error") == 1
        fake.plan.mode, fake.plan.pieces = "stream", ["42\n"]
        for _ in range(300):  # the first backoff is half a second
            if service.completer.server.backoff() is None:
                break
            await asyncio.sleep(0.01)
        result = await service.complete("c", 3, uri, 1, 4)
        assert result["suggestion"]["text"] == "42"
        await asyncio.sleep(0.05)
        assert service.status()["state"] in ("ready", "busy") and service.status()["error"] == ""
    finally:
        service.shutdown()
        fake.close()


# --- a new window's daemon settings: told -------------------------------------------------------------------

@pytest.fixture
async def daemon(tmp_path):
    rundir = tmp_path / "rt"
    rundir.mkdir(mode=0o700)
    cfg, _ = config_mod.merge(config_mod.Config(), {"logLevel": "info"})
    service = Service(cfg, loader=local(FakeEngine()))
    server = DaemonServer(service, rundir, idle_timeout=900)
    await server.start()
    service.start_loading()
    task = asyncio.create_task(server.serve_until_stopped())
    yield server
    server.request_stop("test over")
    await asyncio.wait_for(task, 10)


async def test_a_new_window_asking_for_other_daemon_settings_is_told(daemon):
    settings = config_mod.to_settings(config_mod.Config())
    settings.update(idleTimeout=60, logLevel="debug")
    editor = await client_mod.DaemonClient.connect(daemon.socket_path, wire.EDITOR_CLIENT, settings)
    warning = editor.welcome.get("warning", "")
    assert "idleTimeout=60 (daemon: 900" in warning and "logLevel='debug' (daemon: 'info')" in warning, warning
    assert config_mod.RESTART_HINT in warning
    await editor.close()
    same = config_mod.to_settings(config_mod.Config())
    same.update(idleTimeout=900, logLevel="info")
    editor = await client_mod.DaemonClient.connect(daemon.socket_path, wire.EDITOR_CLIENT, same)
    assert not editor.welcome.get("warning"), editor.welcome.get("warning")
    await editor.close()
    # A command-line client's defaults are no wish about the daemon's lifetime.
    cli = await client_mod.DaemonClient.connect(daemon.socket_path, "completiond-complete", settings)
    assert not cli.welcome.get("warning"), cli.welcome.get("warning")
    await cli.close()


# --- the README's first example -----------------------------------------------------------------------------

def _readme_example() -> tuple[str, str, int, int, str]:
    """(file text, file name, line, column, the suggestion the README promises) of the quick start."""
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"printf '([^']*)' > (\S+) && completiond complete \2:(\d+):(\d+)", readme)
    assert m, "the README's first example writes an unfinished line and completes it"
    text = m.group(1).encode().decode("unicode_escape")
    promised = re.search(r"suggests `([^`]+)`", readme[m.end():m.end() + 600])
    assert promised, "the README says what the example suggests"
    return text, m.group(2), int(m.group(3)), int(m.group(4)), promised.group(1)


def test_readme_first_example_shows_what_an_editor_would():
    from completiond.lsp.server import CompletionServer

    from completiond.commands.complete import complete_in_process, cursor_offset
    from completiond.completion.documents import Document

    text, name, line, col, promised = _readme_example()
    offset = cursor_offset(text, line, col)
    doc = Document(uri="file:///tmp/" + Path(name).name, text=text, version=1, language_id="python")
    server = CompletionServer(no_daemon=True)
    assert server.midline_allowed(doc, offset), "an editor asks for no suggestion at the README's cursor"
    result = complete_in_process(config_mod.Config(), text, offset, name)
    suggestion = result["suggestion"]
    assert suggestion is not None and suggestion["text"].strip(), result
    item = server.inline_item(doc, suggestion)
    assert item is not None, f"an editor would not show {suggestion['text']!r}"
    assert suggestion["text"].startswith(promised), (suggestion["text"], promised)


# --- prose is off in the server itself ------------------------------------------------------------------------

def test_prose_languages_are_off_by_default():
    cfg = config_mod.Config()
    off = config_mod.disabled_languages(cfg)
    assert {"markdown", "plaintext", "text"} <= off and "python" not in off
    cfg, errors = config_mod.merge(cfg, {"disabledLanguages": "plaintext"})
    assert not errors and config_mod.disabled_languages(cfg) == {"plaintext"}
    _, errors = config_mod.merge(cfg, {"disabledLanguages": "mark down"})
    assert errors and "disabledLanguages" in errors[0]


@pytest.mark.slow
async def test_a_client_without_its_own_filter_gets_nothing_in_markdown(start, tmp_path):
    from completiond.models import default_model_dir

    s = await start(settings_for(default_model_dir(), maxTokens=8))
    uri = "file:///work/notes.md"
    s.text = "# Notes\n\nThe daemon "
    s.client.text_document_did_open(types.DidOpenTextDocumentParams(
        text_document=types.TextDocumentItem(uri=uri, language_id="markdown", version=1, text=s.text)))
    await s.wait_ready()
    result = await asyncio.wait_for(s.client.text_document_inline_completion_async(s.inline_params(uri)), 60)
    assert not result.items
    assert (await s.stats())["requests"] == 0  # not even asked: the model's time goes to code
    # Turned on: asked.
    s.client.workspace_did_change_configuration(types.DidChangeConfigurationParams(
        settings={"completiond": {"disabledLanguages": ""}}))
    await asyncio.sleep(0.3)
    await asyncio.wait_for(s.client.text_document_inline_completion_async(s.inline_params(uri)), 60)
    assert (await s.stats())["requests"] == 1


# --- the one-time native compile --------------------------------------------------------------------------------

def test_the_native_compile_is_a_phase_of_its_own(monkeypatch, tiny_model_dir):
    from completiond.engine import native
    from completiond.serving import lifecycle as service_mod

    built: list[bool] = []
    real_library = native.library
    monkeypatch.setattr(native, "build_pending", lambda: not built)

    def library(kernel=None):
        built.append(True)
        return real_library(kernel)

    monkeypatch.setattr(native, "library", library)
    phases: list[tuple[str, int, str]] = []

    def progress(phase, pct, message=None):
        phases.append((phase, pct, message or service_mod.LOAD_PHASES[phase][1]))

    cfg, _ = config_mod.merge(config_mod.Config(), {"model": str(tiny_model_dir), "device": "cpu"})
    service_mod.load_engine(cfg, progress=progress)
    names = [p[0] for p in phases]
    assert "compile" in names and names.index("compile") < names.index("tokenizer"), names
    compile_phase = phases[names.index("compile")]
    assert "compiling the native CPU step" in compile_phase[2]
    assert [p[1] for p in phases] == sorted(p[1] for p in phases)  # the bar only rises
    # Once built, a load has no compile phase.
    phases.clear()
    service_mod.load_engine(cfg, progress=progress)
    assert "compile" not in [p[0] for p in phases]


def test_setup_builds_the_native_step_ahead(monkeypatch, capsys):
    from completiond.commands import setup
    from completiond.engine import native

    calls: list[str] = []
    monkeypatch.setattr(native, "build_pending", lambda: not calls)
    monkeypatch.setattr(native, "library", lambda kernel=None: calls.append("built") or object())
    assert setup.prepare() == 0
    err = capsys.readouterr().err
    assert "compiling the native CPU step" in err and "ready" in err and calls == ["built"]
    assert setup.prepare() == 0  # already built: nothing compiled again
    assert calls == ["built", "built"] and "ready" in capsys.readouterr().err  # (library() loads, no build)


# --- cycling fetches alternatives on demand ------------------------------------------------------------------

@pytest.mark.slow
async def test_an_invoked_request_brings_alternatives(start, tiny_model_dir):
    s = await start(settings_for(tiny_model_dir, maxTokens=6))  # alternatives = 1: one suggestion while typing
    await s.open(text="def add(a, b):\n    return a + b\n\n\n")
    typed = await s.inline()
    assert len(typed.items) <= 1
    params = s.inline_params()
    params.context = types.InlineCompletionContext(trigger_kind=types.InlineCompletionTriggerKind.Invoked)
    cycled = await asyncio.wait_for(s.client.text_document_inline_completion_async(params), 120)
    texts = [i.insert_text for i in cycled.items]
    assert len(texts) >= 2 and len(set(texts)) == len(texts), texts
    if typed.items:
        assert texts[0] == typed.items[0].insert_text  # the first is the one already shown
