"""`completiond lsp`: the language server editors run (LSP over stdio, pygls 2).

It keeps the editor's documents, converts LSP positions, and forwards
everything to a backend: the shared daemon (default) or an in-process
engine (`--no-daemon`). No torch is imported here unless `--no-daemon`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from pathlib import Path
from typing import Any

from lsprotocol import types
from pygls.capabilities import ServerCapabilitiesBuilder
from pygls.exceptions import JsonRpcException
from pygls.lsp.server import LanguageServer
from pygls.protocol import LanguageServerProtocol
from pygls.protocol.language_server import lsp_method

from completiond import config as config_mod
from completiond.serving.client import ConnectionLost, DaemonSession, DaemonUnavailable
from completiond.completion.documents import UTF8, UTF16, UTF32, Document
from completiond.serving.wire import MAX_FRAME, Code, RemoteError

log = logging.getLogger("completiond.lsp")

SECTION = "completiond"
STATUS_METHOD = "completiond/status"
CMD_STATS = "completiond.stats"
CMD_RESTART = "completiond.restartDaemon"
STATUS_MIN_INTERVAL = 0.5  # seconds between completiond/status notifications of the same state


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("completiond")
    except Exception:  # metadata missing in a source checkout
        return "0"


class LocalBackend:
    """The daemon's Service, in this process (`completiond lsp --no-daemon`)."""

    CLIENT = 0

    def __init__(self, cfg: Any, on_notification):
        self.cfg = cfg
        self.on_notification = on_notification
        self.service = None
        self._ids = 0
        self.docs: dict[str, tuple[int, str, str]] = {}

    async def start(self, cfg: Any, documents: dict[str, tuple[int, str, str]] | None = None) -> dict[str, Any]:
        from completiond.serving.service import Service

        self.cfg = cfg
        self.service = Service(cfg)
        self.service.listeners.append(lambda status: self.on_notification("status", status))
        self.service.start_loading()
        # Editors open documents right after `initialized`, before this task runs, and notify()
        # drops them while there is no service: hand over what the LSP side already holds.
        # No await since the Service was made, so no didOpen can slip in between.
        for uri, (version, text, language_id) in (documents or {}).items():
            self.notify("open", {"uri": uri, "version": version, "text": text, "languageId": language_id})
        return {"status": self.service.status()}

    def notify(self, method: str, params: dict[str, Any]) -> None:
        from completiond.serving.service import ServiceError

        if self.service is None:
            return
        try:
            self.service.notify(self.CLIENT, method, params)
        except ServiceError as exc:
            log.warning("%s: %s", method, exc.message)

    async def request(self, method: str, params: dict[str, Any], timeout: float | None = None) -> Any:
        from completiond.serving.service import ServiceError

        if self.service is None:
            raise RemoteError(Code.NOT_READY, "engine not started")
        self._ids += 1
        try:
            return await self.service.request(self.CLIENT, self._ids, method, params)
        except ServiceError as exc:
            raise RemoteError(exc.code, exc.message) from None

    async def restart(self, cfg: Any, documents: dict[str, tuple[int, str, str]]) -> None:
        if self.service is not None:
            self.service.shutdown()
        await self.start(cfg, documents)

    async def close(self) -> None:
        if self.service is not None:
            self.service.shutdown()


class DaemonBackend:
    def __init__(self, session: DaemonSession):
        self.session = session

    async def start(self, cfg: Any, documents: dict[str, tuple[int, str, str]] | None = None) -> dict[str, Any]:
        client = await self.session.ensure()
        return client.welcome

    def notify(self, method: str, params: dict[str, Any]) -> None:
        self.session.notify(method, params)

    async def request(self, method: str, params: dict[str, Any], timeout: float | None = None) -> Any:
        return await self.session.request(method, params, timeout)

    async def restart(self, cfg: Any, documents: dict[str, tuple[int, str, str]]) -> None:
        await self.session.restart()

    async def close(self) -> None:
        await self.session.close()


class _Protocol(LanguageServerProtocol):
    """pygls drops a request whose params do not fit their type (a log line, no response), so the
    editor would wait for it forever: answer it with the error instead."""

    def structure_message(self, data: dict[str, Any]):
        try:
            return super().structure_message(data)
        except JsonRpcException as exc:
            rid = data.get("id") if isinstance(data, dict) else None
            if "method" in data and isinstance(rid, (int, str)) and not isinstance(rid, bool):
                exc.message = f"{data.get('method')}: {exc.message} ({exc.__cause__})"[:500]
                self._send_response(rid, error=exc.to_response_error())
            raise

    def _check_handler_result(self, future) -> None:
        # pygls files the future of every notification handled by a coroutine or generator (our
        # didOpen/didChange/didClose, didChangeConfiguration) in _request_futures under a fresh
        # uuid and never removes it: one Future, lock and uuid leaked per keystroke. This is the
        # done-callback of exactly those futures, so drop the entry here.
        for key, value in list(self._request_futures.items()):
            if value is future:
                del self._request_futures[key]
                break
        super()._check_handler_result(future)

    # pygls keeps its own copy of every open document (unused here: CompletionServer.docs is ours).
    # Updating it rewrites out-of-range positions of the client's change objects in place, with a
    # line model (str.splitlines) that also breaks at U+2028, U+0085, form feeds..., before our
    # handler sees them: our copy then drifted from the editor's. It also doubled the memory of a
    # huge file. So the built-in handlers only pass the notification on.

    @lsp_method(types.TEXT_DOCUMENT_DID_OPEN)
    def lsp_text_document__did_open(self, params: types.DidOpenTextDocumentParams):
        if (handler := self.fm.features.get(types.TEXT_DOCUMENT_DID_OPEN)) is not None:
            yield handler, (params,), None

    @lsp_method(types.TEXT_DOCUMENT_DID_CHANGE)
    def lsp_text_document__did_change(self, params: types.DidChangeTextDocumentParams):
        if (handler := self.fm.features.get(types.TEXT_DOCUMENT_DID_CHANGE)) is not None:
            yield handler, (params,), None

    @lsp_method(types.TEXT_DOCUMENT_DID_CLOSE)
    def lsp_text_document__did_close(self, params: types.DidCloseTextDocumentParams):
        if (handler := self.fm.features.get(types.TEXT_DOCUMENT_DID_CLOSE)) is not None:
            yield handler, (params,), None


class CompletionServer(LanguageServer):
    def __init__(self, no_daemon: bool = False, runtime_dir: Path | None = None, config_file: Path | None = None):
        super().__init__("completiond", _version(), text_document_sync_kind=types.TextDocumentSyncKind.Incremental,
                         protocol_cls=_Protocol)
        self.docs: dict[str, Document] = {}
        self.encoding = UTF16
        self.config_file = config_file
        self.file_cfg, self.file_errors = config_mod.load_file(config_file)
        self.init_options: Any = None
        self.workspace_options: Any = None
        self.cfg = self.file_cfg
        self.no_daemon = no_daemon
        self.status: dict[str, Any] = {"state": "starting"}
        self._progress_wanted = False          # a loading progress is open or being created
        self._progress_token: str | None = None  # its token, once created
        self._progress_seq = 0
        self._status_sent = 0.0
        self._told: set[str] = set()  # error messages already shown
        self._last: dict[str, tuple[str, int, str]] = {}  # uri -> (text, cursor, suggestion) last shown
        self.typed_through_count = 0
        self.backend_started = False
        self._setting_errors: set[str] = set()  # invalid settings reported at the last merge
        self._started: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        if no_daemon:
            self.backend: Any = LocalBackend(self.cfg, self._on_backend_notification)
        else:
            session = DaemonSession(settings=lambda: config_mod.to_settings(self.cfg), documents=self.document_snapshot,
                                    directory=runtime_dir, on_notification=self._on_backend_notification,
                                    on_connect=self._on_connect)
            self.backend = DaemonBackend(session)

    # --- settings ---------------------------------------------------------------

    def apply_settings(self) -> None:
        """Recompute the config from its layers; invalid values are shown to the user and replaced by defaults."""
        cfg, errors = self.file_cfg, list(self.file_errors)
        for layer in (self.init_options, self.workspace_options):
            cfg, more = config_mod.merge(cfg, _section(layer))
            errors += more
        self.cfg = cfg
        new_errors = [e for e in errors if e not in self._setting_errors]
        self._setting_errors = set(errors)
        if new_errors:  # each layer is re-merged on every change: report only what is newly wrong
            errors = new_errors
            message = "completiond: invalid settings, defaults used instead:\n" + "\n".join(errors)
            log.warning("%s", message)
            self.window_show_message(types.ShowMessageParams(type=types.MessageType.Warning, message=message))

    def request_settings(self) -> dict[str, Any]:
        return {k: v for k, v in config_mod.to_settings(self.cfg).items() if k not in config_mod.ENGINE_KEYS}

    async def watch_config_file(self, interval: float = 2.0) -> None:
        """Re-read config.toml when it changes, so edits apply without restarting the editor."""
        path = self.config_file or config_mod.config_file_path()

        def stamp() -> tuple[float, int] | None:
            try:
                st = path.stat()
            except OSError:
                return None
            return st.st_mtime, st.st_size

        last = stamp()
        while True:
            await asyncio.sleep(interval)
            now = stamp()
            if now != last:
                last = now
                log.info("%s changed: reloading settings", path)
                self.file_cfg, self.file_errors = config_mod.load_file(path)
                self.apply_settings()

    async def pull_configuration(self) -> None:
        caps = self.client_capabilities.workspace
        if caps is None or not caps.configuration:
            return
        try:
            result = await asyncio.wait_for(self.workspace_configuration_async(
                types.ConfigurationParams(items=[types.ConfigurationItem(section=SECTION)])), 10)
        except (asyncio.TimeoutError, Exception) as exc:  # the client may not implement it despite advertising it
            log.warning("workspace/configuration failed: %s", exc)
            return
        self.workspace_options = result[0] if result else None

    # --- documents ----------------------------------------------------------------

    def document_snapshot(self) -> dict[str, tuple[int, str, str]]:
        return {uri: (d.version, d.text, d.language_id) for uri, d in self.docs.items()}

    # --- backend ----------------------------------------------------------------------

    async def start_backend(self) -> None:
        try:
            welcome = await self.backend.start(self.cfg, self.document_snapshot())
        except (DaemonUnavailable, ConnectionError, OSError, RemoteError) as exc:
            self.backend_failed(exc)
            return
        if isinstance(welcome, dict) and isinstance(welcome.get("status"), dict):
            self._on_backend_notification("status", welcome["status"])
        if self.no_daemon and self.workspace_folders():
            self.backend.notify("workspace", {"folders": self.workspace_folders()})

    def workspace_folders(self) -> list[str]:
        from urllib.parse import unquote, urlparse

        try:
            ws = self.workspace
            uris = [f.uri for f in ws.folders.values()] or ([ws.root_uri] if ws.root_uri else [])
        except RuntimeError:  # workspace not initialized yet
            return []
        return [unquote(urlparse(uri).path) for uri in uris if uri and uri.startswith("file://")]

    def _on_connect(self, welcome: dict[str, Any]) -> None:
        folders = self.workspace_folders()
        if folders:
            self.backend.notify("workspace", {"folders": folders})
        if welcome.get("warning"):
            self.window_show_message(types.ShowMessageParams(type=types.MessageType.Warning,
                                                             message=f"completiond: {welcome['warning']}"))
        if isinstance(welcome.get("status"), dict):
            self._on_backend_notification("status", welcome["status"])

    def backend_failed(self, exc: Exception) -> None:
        log.error("cannot reach the completion daemon: %s", exc)
        self._on_backend_notification("status", {"state": "error",
                                                 "error": f"cannot reach the completion daemon: {exc}"})

    def _on_backend_notification(self, method: str, params: dict[str, Any]) -> None:
        if method != "status":
            return
        previous = self.status.get("state")
        self.status = params
        state = params.get("state")
        if state == "error" and previous != "error" and params.get("error"):
            # Once per failure, not once per keystroke while it lasts.
            self.window_show_message(types.ShowMessageParams(type=types.MessageType.Error,
                                                             message=f"completiond: {params['error']}"))
        if state == "loading":
            self._begin_progress(f"loading {params.get('model') or 'model'}")
        elif self._progress_wanted:
            self._end_progress("ready" if state != "error" else f"failed: {params.get('error')}")
        now = time.monotonic()
        if state == previous and now - self._status_sent < STATUS_MIN_INTERVAL:
            return  # metrics-only updates arrive per keystroke; status bars need far fewer
        self._status_sent = now
        self.protocol.notify(STATUS_METHOD, {
            "state": state, "message": params.get("error") or "", "model": params.get("model"),
            "device": params.get("device"), "latencyMs": params.get("last_latency_ms"),
            "alpha": params.get("alpha"), "tokensPerSecond": params.get("tokens_per_s")})

    def _begin_progress(self, message: str) -> None:
        window = self.client_capabilities.window
        if self._progress_wanted or window is None or not window.work_done_progress:
            return
        self._progress_wanted = True
        self._progress_seq += 1
        token = f"completiond-loading-{self._progress_seq}"  # tokens are never reused

        async def begin() -> None:
            try:
                await asyncio.wait_for(self.work_done_progress.create_async(token), 10)
            except Exception as exc:  # any refusal (error reply, timeout) only costs the progress bar
                log.info("work done progress refused: %s", exc)
                self._progress_wanted = False
                return
            self.work_done_progress.begin(token, types.WorkDoneProgressBegin(
                title="completiond", message=message, cancellable=False))
            self._progress_token = token
            if not self._progress_wanted or self.status.get("state") != "loading":
                self._end_progress("ready")  # loading finished while the token was being created

        asyncio.ensure_future(begin())

    def _end_progress(self, message: str) -> None:
        self._progress_wanted = False
        token, self._progress_token = self._progress_token, None
        if token is not None:
            self.work_done_progress.end(token, types.WorkDoneProgressEnd(message=message))

    # --- completion -------------------------------------------------------------------

    async def suggest(self, uri: str, position: types.Position) -> tuple[Document, dict[str, Any]] | None:
        doc = self.docs.get(uri)
        if doc is None or not self.cfg.enable:
            return None
        if len(doc.text) > MAX_FRAME:
            # Far past what the prompt builder takes, and too big to send to the daemon: answer at
            # once, instead of scanning the file and trying to encode it again on every keystroke.
            self.tell_once(f"{uri} is too large for completions (over {MAX_FRAME} characters); skipped",
                           types.MessageType.Info)
            return None
        version = doc.version
        offset = doc.offset(position.line, position.character, self.encoding)
        typed_through = self._typed_through(doc, offset)
        if typed_through is not None:
            return doc, typed_through
        if self._started is not None and not self._started.done():
            await asyncio.shield(self._started)
        try:
            result = await self.backend.request("complete", {
                "uri": uri, "version": version, "offset": offset, "settings": self.request_settings()})
        except RemoteError as exc:
            if exc.code == Code.CANCELLED:
                return None  # superseded by a newer request: that one answers
            log.warning("completion for %s failed: %s", uri, exc)
            if exc.code in (Code.ENGINE_ERROR, Code.NOT_READY, Code.INTERNAL):
                self.tell_once(exc.message, types.MessageType.Warning)
            return None
        except (DaemonUnavailable, ConnectionLost) as exc:
            self.backend_failed(exc)
            return None
        for warning in (result.get("warnings") or []) if isinstance(result, dict) else []:
            self.tell_once(str(warning), types.MessageType.Warning)
        suggestion = result.get("suggestion") if isinstance(result, dict) else None
        if suggestion is None or self.docs.get(uri) is not doc or doc.version != version:
            return None  # nothing to show, or the document moved on: never show a stale result as fresh
        if suggestion["start"] == suggestion["end"] == offset:
            self._last[uri] = (doc.text, offset, suggestion["text"])
        return doc, suggestion

    def _typed_through(self, doc: Document, offset: int) -> dict[str, Any] | None:
        """The rest of the last suggestion, if the user has since typed its beginning (and nothing else).

        Editors ask again on every keystroke; while the typing agrees with the suggestion shown,
        its remainder is still the model's answer, so it is returned at once without a round trip.
        """
        last = self._last.pop(doc.uri, None)
        if last is None:
            return None
        text, at, shown = last
        typed = offset - at
        if not 0 < typed < len(shown) or len(doc.text) != len(text) + typed:
            return None
        new = doc.text
        if new[at:offset] != shown[:typed] or not new.startswith(text[:at]) or not new.endswith(text[at:]):
            return None
        rest = shown[typed:]
        if not rest.strip():
            return None
        self._last[doc.uri] = (new, offset, rest)
        self.typed_through_count += 1
        return {"text": rest, "start": offset, "end": offset, "multiline": "\n" in rest}

    def tell_once(self, message: str, kind: types.MessageType) -> None:
        """Show a problem the user can fix (a setting, a document), once, not on every keystroke."""
        if message in self._told:
            return
        self._told.add(message)
        self.window_show_message(types.ShowMessageParams(type=kind, message=f"completiond: {message}"))

    def lsp_range(self, doc: Document, start: int, end: int) -> types.Range:
        s = doc.position(start, self.encoding)
        e = doc.position(end, self.encoding)
        return types.Range(start=types.Position(*s), end=types.Position(*e))


def _section(options: Any) -> Any:
    """The `completiond` settings object, whether sent wrapped in its section or bare."""
    if isinstance(options, dict) and isinstance(options.get(SECTION), dict):
        return options[SECTION]
    if options is None or options == {}:
        return None
    return options


def _encoding(capabilities: types.ClientCapabilities) -> str:
    chosen = ServerCapabilitiesBuilder.choose_position_encoding(capabilities)
    return {types.PositionEncodingKind.Utf8: UTF8, types.PositionEncodingKind.Utf32: UTF32}.get(chosen, UTF16)


def build_server(no_daemon: bool = False, runtime_dir: Path | None = None, config_file: Path | None = None) -> CompletionServer:
    server = CompletionServer(no_daemon=no_daemon, runtime_dir=runtime_dir, config_file=config_file)

    @server.feature(types.INITIALIZE)
    def initialize(ls: CompletionServer, params: types.InitializeParams) -> None:
        ls.encoding = _encoding(params.capabilities)
        ls.init_options = params.initialization_options
        ls.apply_settings()

    @server.feature(types.INITIALIZED)
    async def initialized(ls: CompletionServer, params: types.InitializedParams) -> None:
        async def start() -> None:
            await ls.pull_configuration()
            if ls.workspace_options is not None:
                ls.apply_settings()
            if ls.cfg.enable:  # disabled: no daemon, no model in memory, until enabled
                await ls.start_backend()
                ls.backend_started = True

        ls._started = asyncio.ensure_future(start())
        ls._watcher = asyncio.ensure_future(ls.watch_config_file())

    @server.feature(types.WORKSPACE_DID_CHANGE_CONFIGURATION)
    async def did_change_configuration(ls: CompletionServer, params: types.DidChangeConfigurationParams) -> None:
        before = config_mod.engine_settings(ls.cfg)
        settings = params.settings
        if isinstance(settings, dict) and SECTION in settings:
            ls.workspace_options = settings[SECTION]
        else:
            await ls.pull_configuration()  # the "pull" model: settings is null, ask for them
        ls.apply_settings()
        if ls.cfg.enable and not ls.backend_started and (ls._started is None or ls._started.done()):
            ls.backend_started = True
            ls._started = asyncio.ensure_future(ls.start_backend())
            return
        if config_mod.engine_settings(ls.cfg) == before or not ls.backend_started:
            return
        if ls.no_daemon:
            await ls.backend.restart(ls.cfg, ls.document_snapshot())
        else:
            # The daemon is shared with other editors: restarting it is the user's call.
            ls.window_show_message(types.ShowMessageParams(type=types.MessageType.Info, message=(
                "completiond: model settings changed; run the command completiond.restartDaemon to load them")))

    @server.feature(types.WORKSPACE_DID_CHANGE_WORKSPACE_FOLDERS)
    def did_change_folders(ls: CompletionServer, params: types.DidChangeWorkspaceFoldersParams) -> None:
        # Added folders feed the prompt context; removed ones age out of the daemon's bounded store.
        from urllib.parse import unquote, urlparse

        added = [unquote(urlparse(f.uri).path) for f in params.event.added if f.uri.startswith("file://")]
        if added:
            ls.backend.notify("workspace", {"folders": added})

    @server.feature(types.TEXT_DOCUMENT_DID_OPEN)
    def did_open(ls: CompletionServer, params: types.DidOpenTextDocumentParams) -> None:
        td = params.text_document
        ls.docs[td.uri] = Document(uri=td.uri, text=td.text, version=td.version, language_id=td.language_id)
        ls.backend.notify("open", {"uri": td.uri, "version": td.version, "text": td.text, "languageId": td.language_id})

    @server.feature(types.TEXT_DOCUMENT_DID_CHANGE)
    def did_change(ls: CompletionServer, params: types.DidChangeTextDocumentParams) -> None:
        doc = ls.docs.get(params.text_document.uri)
        if doc is None:
            log.warning("didChange for unopened %s ignored", params.text_document.uri)
            return
        edits = doc.apply_lsp_changes(params.content_changes, params.text_document.version, ls.encoding)
        ls.backend.notify("change", {"uri": doc.uri, "version": doc.version, "edits": [list(e) for e in edits]})

    @server.feature(types.TEXT_DOCUMENT_DID_CLOSE)
    def did_close(ls: CompletionServer, params: types.DidCloseTextDocumentParams) -> None:
        ls._last.pop(params.text_document.uri, None)
        if ls.docs.pop(params.text_document.uri, None) is not None:
            ls.backend.notify("close", {"uri": params.text_document.uri})

    @server.feature(types.TEXT_DOCUMENT_INLINE_COMPLETION, types.InlineCompletionOptions())
    async def inline_completion(ls: CompletionServer, params: types.InlineCompletionParams) -> types.InlineCompletionList:
        found = await ls.suggest(params.text_document.uri, params.position)
        if found is None:
            return types.InlineCompletionList(items=[])
        doc, s = found
        return types.InlineCompletionList(items=[types.InlineCompletionItem(
            insert_text=s["text"], range=ls.lsp_range(doc, s["start"], s["end"]))])

    @server.feature(types.TEXT_DOCUMENT_COMPLETION, types.CompletionOptions())
    async def completion(ls: CompletionServer, params: types.CompletionParams) -> types.CompletionList:
        found = await ls.suggest(params.text_document.uri, params.position)
        if found is None:
            return types.CompletionList(is_incomplete=True, items=[])
        doc, s = found
        first = s["text"].split("\n", 1)[0].strip() or s["text"].strip()
        label = first if len(first) <= 60 else first[:57] + "..."
        item = types.CompletionItem(
            label=label, kind=types.CompletionItemKind.Text, detail="completiond", preselect=True, sort_text="0",
            filter_text=s["text"], insert_text_format=types.InsertTextFormat.PlainText,
            text_edit=types.TextEdit(range=ls.lsp_range(doc, s["start"], s["end"]), new_text=s["text"]))
        return types.CompletionList(is_incomplete=True, items=[item])

    @server.command(CMD_STATS)
    async def stats(ls: CompletionServer, *args: Any) -> dict[str, Any]:
        try:
            stats = await ls.backend.request("stats", {}, timeout=10)
        except (RemoteError, DaemonUnavailable, ConnectionLost, asyncio.TimeoutError) as exc:
            stats = {"error": str(exc)}
        stats["lsp"] = {"typed_through": ls.typed_through_count}
        return stats

    @server.command(CMD_RESTART)
    async def restart(ls: CompletionServer, *args: Any) -> dict[str, Any]:
        try:
            await ls.backend.restart(ls.cfg, ls.document_snapshot())
        except (DaemonUnavailable, ConnectionError, OSError) as exc:
            ls.backend_failed(exc)
            return {"restarted": False, "error": str(exc)}
        return {"restarted": True}

    @server.feature(types.SHUTDOWN)
    async def shutdown(ls: CompletionServer, params: Any) -> None:
        # Leave the shared daemon running for the other editors; it exits on its own when idle.
        if ls._watcher is not None:
            ls._watcher.cancel()
        await ls.backend.close()

    return server


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stdio", action="store_true", help="accepted for editor compatibility (stdio is the default)")
    parser.add_argument("--no-daemon", action="store_true", help="run the engine in this process instead of the shared daemon")
    parser.add_argument("--runtime-dir", type=Path, help="daemon socket directory (default: $XDG_RUNTIME_DIR/completiond)")
    parser.add_argument("--config", type=Path, help="config.toml (default: ~/.config/completiond/config.toml)")
    parser.add_argument("--log-level", choices=("error", "warning", "info", "debug"), default=None)


def run(args: argparse.Namespace) -> int:
    file_cfg, _ = config_mod.load_file(args.config)
    logging.basicConfig(level=(args.log_level or file_cfg.log_level).upper(), stream=sys.stderr,
                        format="%(asctime)s completiond-lsp[%(process)d] %(levelname)s %(name)s: %(message)s")
    if (args.log_level or file_cfg.log_level) != "debug":
        # pygls logs every message at INFO: that is debug output for us.
        logging.getLogger("pygls").setLevel(logging.WARNING)
    server = build_server(no_daemon=args.no_daemon, runtime_dir=args.runtime_dir, config_file=args.config)
    server.start_io()
    return 0
