"""End to end: an LSP client -> `completiond lsp` subprocess -> daemon subprocess (or in-process engine).

Every test gets its own XDG_RUNTIME_DIR, so daemons never leak between tests,
and kills whatever daemon it caused to be started.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest
from lsprotocol import types
from pygls.exceptions import JsonRpcException
from pytest_lsp import make_test_lsp_client

from completiond.serving import paths
from tests.conftest import make_tiny_model

pytestmark = pytest.mark.slow

URI = "file:///work/example.py"
TEXT = "def add(a, b):\n    return a + b\n\n\ndef main():\n    x = "


def capabilities(encodings=("utf-16",)) -> types.ClientCapabilities:
    return types.ClientCapabilities(
        general=types.GeneralClientCapabilities(position_encodings=list(encodings)),
        window=types.WindowClientCapabilities(work_done_progress=True),
        workspace=types.WorkspaceClientCapabilities(configuration=True),
        text_document=types.TextDocumentClientCapabilities(
            inline_completion=types.InlineCompletionClientCapabilities()),
    )


class Session:
    def __init__(self, client, runtime: Path):
        self.client = client
        self.runtime = runtime
        self.status: list[dict] = []
        self.version = 1

    async def open(self, text: str = TEXT, uri: str = URI) -> None:
        self.text = text
        self.client.text_document_did_open(types.DidOpenTextDocumentParams(
            text_document=types.TextDocumentItem(uri=uri, language_id="python", version=self.version, text=text)))

    def type(self, chars: str, uri: str = URI) -> None:
        """Insert at the end of the document, as incremental changes (UTF-16 positions)."""
        for ch in chars:
            lines = self.text.split("\n")
            pos = types.Position(line=len(lines) - 1, character=len(lines[-1].encode("utf-16-le")) // 2)
            self.version += 1
            self.text += ch
            self.client.text_document_did_change(types.DidChangeTextDocumentParams(
                text_document=types.VersionedTextDocumentIdentifier(uri=uri, version=self.version),
                content_changes=[types.TextDocumentContentChangePartial(range=types.Range(start=pos, end=pos), text=ch)]))

    def end(self) -> types.Position:
        lines = self.text.split("\n")
        return types.Position(line=len(lines) - 1, character=len(lines[-1].encode("utf-16-le")) // 2)

    def inline_params(self, uri: str = URI) -> types.InlineCompletionParams:
        return types.InlineCompletionParams(
            text_document=types.TextDocumentIdentifier(uri=uri), position=self.end(),
            context=types.InlineCompletionContext(trigger_kind=types.InlineCompletionTriggerKind.Automatic))

    async def inline(self, timeout: float = 120) -> types.InlineCompletionList:
        return await asyncio.wait_for(self.client.text_document_inline_completion_async(self.inline_params()), timeout)

    async def stats(self) -> dict:
        return await asyncio.wait_for(self.client.workspace_execute_command_async(
            types.ExecuteCommandParams(command="completiond.stats")), 30)

    async def wait_ready(self, timeout: float = 120) -> None:
        for _ in range(int(timeout / 0.1)):
            if any(s.get("state") in ("ready", "busy") for s in self.status):
                return
            if any(s.get("state") == "error" for s in self.status):
                raise AssertionError(f"daemon error: {self.status}")
            await asyncio.sleep(0.1)
        raise AssertionError(f"never ready: {self.status}")


@pytest.fixture
def runtime(tmp_path):
    yield tmp_path
    pid_file = tmp_path / "completiond" / paths.PID_NAME
    try:
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
    except (OSError, ValueError):
        pass


@pytest.fixture
async def start(runtime):
    sessions: list[Session] = []

    async def _start(settings: dict, *args: str, encodings=("utf-16",), workspace: dict | None = None,
                     folder: Path | None = None) -> Session:
        client = make_test_lsp_client()
        if workspace is not None:
            client.set_configuration(workspace, section="completiond")
        session = Session(client, runtime)

        @client.feature("completiond/status")
        def on_status(params):
            session.status.append(params if isinstance(params, dict) else params._asdict())

        env = dict(os.environ, XDG_RUNTIME_DIR=str(runtime), OMP_NUM_THREADS="1",
                   XDG_CONFIG_HOME=str(runtime / "config"))
        await client.start_io(sys.executable, "-m", "completiond.cli", "lsp", *args, env=env)
        session.init = await client.initialize_session(types.InitializeParams(
            capabilities=capabilities(encodings), initialization_options={"completiond": settings},
            workspace_folders=[types.WorkspaceFolder(uri=folder.as_uri(), name="ws")] if folder else None))
        sessions.append(session)
        return session

    yield _start
    for s in sessions:
        try:
            await asyncio.wait_for(s.client.shutdown_session(), 20)
        except (asyncio.TimeoutError, JsonRpcException, RuntimeError):
            pass
        await s.client.stop()


@pytest.fixture(scope="session")
def model_dir(tiny_model_dir) -> Path:
    """The bundled model when it is there (the real thing), else the tiny random one."""
    from completiond.models import default_model_dir

    bundled = default_model_dir()
    return bundled if (bundled / "config.json").is_file() else tiny_model_dir


def settings_for(model: Path, **extra) -> dict:
    return {"model": str(model), "device": "cpu", "maxTokens": 4, "idleTimeout": 60, **extra}


async def test_open_type_complete(start, model_dir, tmp_path):
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "helpers.py").write_text("def helper():\n    return 42\n")
    s = await start(settings_for(model_dir), folder=folder)
    caps = s.init.capabilities
    assert caps.inline_completion_provider is not None
    assert caps.completion_provider is not None
    assert caps.text_document_sync.change == types.TextDocumentSyncKind.Incremental
    await s.open()
    s.type("ad")
    result = await s.inline()
    assert isinstance(result, types.InlineCompletionList)
    for item in result.items:
        assert item.insert_text.strip()
        assert item.range.start == s.end()
    completion = await asyncio.wait_for(s.client.text_document_completion_async(types.CompletionParams(
        text_document=types.TextDocumentIdentifier(uri=URI), position=s.end())), 60)
    assert completion.is_incomplete and len(completion.items) <= 1
    stats = await s.stats()
    assert stats["completed"] >= 1 and stats["errors"] == 0, stats
    assert stats["status"]["state"] in ("ready", "busy")
    for _ in range(100):  # the editor's workspace folder is scanned for prompt context
        if stats["workspace_files"] >= 2:
            break
        await asyncio.sleep(0.1)
        stats = await s.stats()
    assert stats["workspace_files"] >= 2  # helpers.py from the folder + the open document
    more = tmp_path / "second"
    more.mkdir()
    (more / "extra.py").write_text("X = 1\n")
    s.client.workspace_did_change_workspace_folders(types.DidChangeWorkspaceFoldersParams(
        event=types.WorkspaceFoldersChangeEvent(added=[types.WorkspaceFolder(uri=more.as_uri(), name="2")],
                                                removed=[])))
    for _ in range(100):
        stats = await s.stats()
        if stats["workspace_files"] >= 3:
            break
        await asyncio.sleep(0.1)
    assert stats["workspace_files"] >= 3
    # Loading showed up as work-done progress (begin ... end) and as completiond/status.
    reports = [r for rs in s.client.progress_reports.values() for r in rs]
    assert any(isinstance(r, types.WorkDoneProgressBegin) and r.percentage == 0 for r in reports)
    assert any(isinstance(r, types.WorkDoneProgressEnd) for r in reports)
    # ...with percentages in between, rising to 100 (phases that passed before the client created the
    # progress token are skipped, not replayed).
    percentages = [r.percentage for r in reports if isinstance(r, types.WorkDoneProgressReport)]
    assert percentages and percentages == sorted(percentages) and percentages[-1] == 100, reports
    assert any(st.get("state") == "ready" for st in s.status)


@pytest.fixture(scope="module")
def slow_model_dir(tmp_path_factory) -> Path:
    """A random model large enough that 1000 tokens take seconds: the tiny one generates them in ~0.1 s
    with the native step, between two polls of the test below."""
    return make_tiny_model(tmp_path_factory.mktemp("slow-llama"), layers=8, hidden=512)


async def test_cancel_mid_generation(start, slow_model_dir):
    # A random model never ends a line, so the generation is still running when we cancel
    # (a trained model may finish before the cancel gets there).
    s = await start(settings_for(slow_model_dir, maxTokens=1000, multiline="always", maxLines=200))
    await s.open()
    await s.wait_ready()
    msg_id = "inline-1"
    future = asyncio.ensure_future(s.client.protocol.send_request_async(
        types.TEXT_DOCUMENT_INLINE_COMPLETION, s.inline_params(), msg_id=msg_id))
    for _ in range(600):
        if (await s.stats())["scheduler"]["running"]:
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("generation never started")
    s.client.protocol.notify(types.CANCEL_REQUEST, types.CancelParams(id=msg_id))
    with pytest.raises(JsonRpcException) as err:
        await asyncio.wait_for(future, 30)
    assert err.value.code == -32800
    for _ in range(200):
        stats = await s.stats()
        if not stats["scheduler"]["running"]:
            break
        await asyncio.sleep(0.05)
    assert not stats["scheduler"]["running"], "the daemon kept generating after the cancel"
    assert stats["cancelled"] == 1 and stats["completed"] == 0
    assert stats["generated_tokens"] < 1000


async def test_burst_of_50(start, model_dir):
    s = await start(settings_for(model_dir, maxTokens=16))
    await s.open()
    await s.wait_ready()
    futures = []
    for i in range(50):
        s.type("abcdefghij"[i % 10])
        futures.append(s.client.text_document_inline_completion_async(s.inline_params()))
    results = await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), 180)
    assert len(results) == 50
    assert all(isinstance(r, types.InlineCompletionList) for r in results), [r for r in results if not isinstance(r, types.InlineCompletionList)][:3]
    stats = await s.stats()
    assert stats["completed"] <= 1, stats
    # Requests overtaken by later keystrokes before the LSP handled them point inside the newer text and
    # are answered at once without the model; every one that reached the daemon was completed or
    # superseded there, and the last (current) one reached it.
    assert 1 <= stats["requests"] <= 50, stats
    assert stats["completed"] + stats["superseded"] == stats["requests"], stats


async def test_two_clients_share_one_daemon(start, model_dir):
    a, b = await asyncio.gather(start(settings_for(model_dir)), start(settings_for(model_dir)))
    await a.open()
    await b.open(uri=URI)  # same URI in both editors: documents are per client
    ra, rb = await asyncio.gather(a.inline(), b.inline())
    assert isinstance(ra, types.InlineCompletionList) and isinstance(rb, types.InlineCompletionList)
    sa, sb = await a.stats(), await b.stats()
    assert sa["status"]["pid"] == sb["status"]["pid"]
    assert sb["loads"] == 1
    assert sb["completed"] == 2 and sb["errors"] == 0
    # One editor restarts the shared daemon; the other reconnects and replays its documents.
    restarted = await asyncio.wait_for(a.client.workspace_execute_command_async(
        types.ExecuteCommandParams(command="completiond.restartDaemon")), 60)
    assert restarted["restarted"] is True
    rb = await b.inline()
    sb2 = await b.stats()
    assert sb2["status"]["pid"] != sb["status"]["pid"]
    assert sb2["completed"] == 1 and sb2["errors"] == 0


async def wait_for(predicate, what: str, timeout: float = 120):
    for _ in range(int(timeout / 0.1)):
        value = await predicate() if asyncio.iscoroutinefunction(predicate) else predicate()
        if value:
            return value
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


async def test_model_settings_mismatch_is_reported_and_a_change_restarts_the_daemon(start, tiny_model_dir):
    from completiond import config

    a = await start(settings_for(tiny_model_dir, cacheMegabytes=64))
    await a.open()
    await a.wait_ready()
    pid = (await a.stats())["status"]["pid"]
    assert all(st.get("modelMismatch") == "" for st in a.status if st.get("state") == "ready")
    # A second editor wants another cache size: it shares the daemon as it is, and is told so, with
    # commands a user can type, in a message and in its status (what :checkhealth reads).
    b = await start(settings_for(tiny_model_dir, cacheMegabytes=32))
    await b.open()
    mismatch = await wait_for(lambda: next((st["modelMismatch"] for st in b.status if st.get("modelMismatch")), ""),
                              "a status with modelMismatch")
    assert "cacheMegabytes=32 (daemon: 64)" in mismatch and config.RESTART_HINT in mismatch
    await wait_for(lambda: any("cacheMegabytes" in m.message for m in b.client.messages), "the mismatch warning")
    assert not any("completiond.restartDaemon" in m.message for m in a.client.messages + b.client.messages)
    # Its user settles on what the daemon serves: nothing to restart, and the status says so.
    b.client.workspace_did_change_configuration(types.DidChangeConfigurationParams(
        settings={"completiond": {"cacheMegabytes": 64}}))
    await wait_for(lambda: b.status[-1].get("modelMismatch") == "", "the mismatch to clear")
    assert (await b.stats())["status"]["pid"] == pid
    # The first editor's user changes the model settings: the daemon restarts with them, by itself.
    a.client.workspace_did_change_configuration(types.DidChangeConfigurationParams(
        settings={"completiond": {"cacheMegabytes": 16}}))

    async def restarted():
        status = (await a.stats()).get("status") or {}  # none while the LSP reconnects to the new daemon
        return status.get("pid") not in (None, pid) and status.get("engine_settings", {}).get("cacheMegabytes") == 16

    await wait_for(restarted, "the daemon to restart with cacheMegabytes=16")
    assert any("restarting the shared daemon" in m.message for m in a.client.messages)
    await a.wait_ready()
    assert isinstance(await a.inline(), types.InlineCompletionList)


async def test_alternatives_come_as_several_items(start, tiny_model_dir):
    s = await start(settings_for(tiny_model_dir, maxTokens=6, alternatives=4, temperature=0.8, seed=3))
    await s.open(text="def add(a, b):\n    return a + b\n\n\n")
    result = await s.inline()
    texts = [item.insert_text for item in result.items]
    assert len(texts) >= 2 and len(set(texts)) == len(texts), texts
    for item in result.items:
        assert item.command is not None  # a full accept is counted (see completiond.suggestionEvent)
    assert (await s.stats())["lsp"]["suggestions"]["shown"] == 1  # one suggestion shown, with alternatives


async def test_daemon_killed_respawned_documents_replayed(start, model_dir, runtime):
    s = await start(settings_for(model_dir))
    await s.open()
    await s.inline()
    old_pid = (await s.stats())["status"]["pid"]
    os.kill(old_pid, signal.SIGKILL)
    s.type("zq7")  # edits while the daemon is dead are replayed from the editor's copy
    await asyncio.sleep(0.2)
    await s.inline()
    stats = await s.stats()
    assert stats["status"]["pid"] != old_pid
    assert stats["completed"] == 1 and stats["errors"] == 0 and stats["documents"] == 1, stats


async def test_invalid_settings_message_and_defaults_no_daemon_utf8(start, model_dir, runtime):
    config_toml = runtime / "config" / "completiond" / "config.toml"
    config_toml.parent.mkdir(parents=True)
    config_toml.write_text("seed = -1\n")
    settings = settings_for(model_dir, temperature="hot", maxLines=0, bogus=1)
    s = await start(settings, "--no-daemon", encodings=("utf-8",), workspace={"topP": 7})
    assert s.init.capabilities.position_encoding == types.PositionEncodingKind.Utf8
    for _ in range(100):
        if len(s.client.messages) >= 2:
            break
        await asyncio.sleep(0.05)
    text = "\n".join(m.message for m in s.client.messages)
    assert "temperature" in text and "maxLines" in text and "bogus" in text and "topP" in text
    assert "seed" in text and str(config_toml) in text
    await asyncio.sleep(0.5)  # the workspace/configuration pull re-merges every layer: no repeats
    assert sum("temperature" in m.message for m in s.client.messages) == 1, s.client.messages
    # The config file is watched: a later edit is applied (and reported when invalid).
    config_toml.write_text("[completiond]\ntopK = -3\n")
    for _ in range(100):
        if any("topK" in m.message for m in s.client.messages):
            break
        await asyncio.sleep(0.1)
    assert any("topK" in m.message for m in s.client.messages)
    assert all(m.type == types.MessageType.Warning for m in s.client.messages)
    s.client.workspace_did_change_configuration(types.DidChangeConfigurationParams(
        settings={"completiond": {"multiline": "sometimes"}}))
    for _ in range(100):
        if any("multiline" in m.message for m in s.client.messages):
            break
        await asyncio.sleep(0.05)
    assert any("multiline" in m.message for m in s.client.messages)
    # Still serving, in-process, with UTF-8 positions: "é" is two bytes.
    await s.open(text="s = 'é'\nx = ")
    s.type("é")
    pos = types.Position(line=1, character=len("x = é".encode()))
    result = await asyncio.wait_for(s.client.text_document_inline_completion_async(types.InlineCompletionParams(
        text_document=types.TextDocumentIdentifier(uri=URI), position=pos,
        context=types.InlineCompletionContext(trigger_kind=types.InlineCompletionTriggerKind.Invoked))), 120)
    for item in result.items:
        assert item.range.start == pos
    stats = await s.stats()
    assert stats["errors"] == 0 and stats["completed"] == 1
    assert not (s.runtime / "completiond" / paths.SOCKET_NAME).exists()  # no daemon was started


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a directory away")
async def test_foreign_owned_runtime_dir_reported(start, model_dir, runtime):
    """Refused and left alone, said once, and the daemon runs in a private directory beside it instead, so
    completions keep working (issue 43: they stayed off for good)."""
    d = runtime / "completiond"
    d.mkdir(mode=0o700)
    os.chown(d, 12345, 12345)
    fallback = runtime / "completiond-private"
    try:
        s = await start(settings_for(model_dir))
        await s.open()
        await s.wait_ready()
        assert isinstance(await s.inline(), types.InlineCompletionList)
        told = [m for m in s.client.messages if "owned by uid 12345" in m.message]
        assert len(told) == 1 and str(fallback) in told[0].message, s.client.messages
        assert (fallback / paths.SOCKET_NAME).exists() and not (d / paths.SOCKET_NAME).exists()
        assert os.stat(d).st_uid == 12345
    finally:
        try:
            os.kill(int((fallback / paths.PID_NAME).read_text()), signal.SIGKILL)
        except (OSError, ValueError):
            pass


async def test_setting_the_model_cannot_serve_is_reported_once(start, model_dir):
    s = await start(settings_for(model_dir, fimTemplate="deepseek-coder"))
    await s.open()
    await s.wait_ready()
    for _ in range(3):
        s.type("§")  # never what the model suggests, so every request reaches the daemon
        assert isinstance(await s.inline(), types.InlineCompletionList)
    shown = [m.message for m in s.client.messages if "deepseek-coder" in m.message]
    assert len(shown) == 1, s.client.messages  # worked around (auto-detected template), said once
    stats = await s.stats()
    assert stats["errors"] == 0 and stats["completed"] == 3


async def test_typing_the_suggestion_shows_its_rest_without_a_round_trip(start, model_dir):
    s = await start(settings_for(model_dir, maxTokens=8))
    await s.open()
    shown = ""
    for ch in "abcdefgh":  # until the model offers something at least two characters long
        s.type(ch)
        result = await s.inline()
        if result.items and len(result.items[0].insert_text) >= 2:
            shown = result.items[0].insert_text
            break
    if not shown:
        pytest.skip("the model offered no suggestion of two or more characters here")
    before = await s.stats()
    s.type(shown[0])
    result = await s.inline()
    assert [i.insert_text for i in result.items] == [shown[1:]]
    assert result.items[0].range.start == s.end() == result.items[0].range.end
    after = await s.stats()
    assert after["requests"] == before["requests"]  # answered by the LSP server itself
    assert after["lsp"]["typed_through"] == before["lsp"]["typed_through"] + 1
    s.type("§")  # anything else: back to the model
    await s.inline()
    assert (await s.stats())["requests"] == before["requests"] + 1


async def test_disabled_starts_no_daemon_until_enabled(start, model_dir, runtime):
    s = await start(settings_for(model_dir, enable=False))
    await s.open()
    s.type("x")
    assert not (await s.inline()).items
    await asyncio.sleep(0.5)
    assert not (runtime / "completiond" / paths.SOCKET_NAME).exists()
    s.client.workspace_did_change_configuration(types.DidChangeConfigurationParams(
        settings={"completiond": {"enable": True}}))
    await s.wait_ready()
    assert isinstance(await s.inline(), types.InlineCompletionList)
    stats = await s.stats()
    assert stats["requests"] == 1 and stats["errors"] == 0


def test_typed_through_only_on_exact_agreement():
    from completiond.completion.documents import Document
    from completiond.lsp.server import CompletionServer

    server = CompletionServer(no_daemon=True)
    text = "x = \nrest\n"

    def attempt(new_text: str, offset: int):
        server._last["u"] = (text, 4, "foo(1)")
        return server._typed_through(Document("u", new_text, 2), offset)

    assert attempt("x = f\nrest\n", 5) == {"text": "oo(1)", "start": 5, "end": 5, "multiline": False}
    assert attempt("x = foo\nrest\n", 7)["text"] == "(1)"
    assert attempt("x = g\nrest\n", 5) is None           # typed something else
    assert attempt("x = f\nrust\n", 5) is None           # and edited elsewhere
    assert attempt("y = f\nrest\n", 5) is None
    assert attempt("x = foo(1)\nrest\n", 10) is None     # typed all of it: nothing left to show
    assert attempt("x = \nrest\n", 4) is None            # same place: ask the model again
    # A chain: each accepted character moves the remembered suggestion along.
    server._last["u"] = (text, 4, "foo(1)")
    assert server._typed_through(Document("u", "x = f\nrest\n", 2), 5)["text"] == "oo(1)"
    assert server._typed_through(Document("u", "x = fo\nrest\n", 3), 6)["text"] == "o(1)"
