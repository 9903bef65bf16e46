"""`completiond lsp`: the language server editors run (LSP over stdio, pygls 2).

It keeps the editor's documents, converts LSP positions, and forwards
everything to the service (a ServiceLink): the shared daemon's over its socket
(DaemonConnection, the default) or one in this process (InProcessService, `--no-daemon`). No torch is imported here unless `--no-daemon`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from lsprotocol import types
from pygls.capabilities import ServerCapabilitiesBuilder
from pygls.exceptions import JsonRpcException
from pygls.lsp.server import LanguageServer
from pygls.protocol import LanguageServerProtocol
from pygls.protocol.language_server import lsp_method

from completiond import config as config_mod
from completiond.config import Config
from completiond.serving import paths
from completiond.serving.client import ConnectionLost, DaemonSession, DaemonUnavailable
from completiond.completion.documents import UTF8, UTF16, UTF32, Document
from completiond.serving.wire import MAX_FRAME, Code, RemoteError
from completiond.lsp import first_run, stdio

if TYPE_CHECKING:
    from completiond.serving.service import Service  # imported at run time only for --no-daemon (torch)

log = logging.getLogger("completiond.lsp")

SECTION = "completiond"
STATUS_METHOD = "completiond/status"
CMD_STATS = "completiond.stats"
CMD_RESTART = "completiond.restartDaemon"
# The catalog for an editor's model picker (VS Code's status menu): each loadable model with its download
# size, speed estimates and languages, the one recommended for this machine, and the model set now.
CMD_MODELS = "completiond.models"
# Editors report what became of a suggestion: accepted (full / word / line) or dismissed. Items carry it
# as their `command` (run by the editor after a full accept); partial accepts and dismissals are sent
# by the plugins themselves. Counted here only: nothing leaves the machine.
CMD_SUGGESTION_EVENT = "completiond.suggestionEvent"
SUGGESTION_EVENTS = {("accepted", "full"), ("accepted", "word"), ("accepted", "line"), ("dismissed", None)}
# Copilot's rule for a suggestion in the middle of a line: only when what follows the cursor is
# closing brackets, quotes and a final `:` `{` `;` `,` (and blanks); anything else is text the
# insertion would split, which editors cannot preview faithfully and users rarely want.
# Matched against the rest of the line stripped of its blanks (midline_rest_ok): the pattern itself holds no
# two adjacent parts that can take the same character, so it runs in linear time. Three adjacent `\s*` did
# not: a line of 2,000 spaces and a letter froze the event loop for seconds.
MIDLINE_REST = re.compile(r"[)>}\]\"'`]*\s*[:{;,]?")
MIDLINE_MAX = 256  # longer (stripped) text after the cursor is never only closers: no match attempted
# Suggestions generated when the user asks for alternatives (an invoked request, e.g. cycling).
ON_DEMAND_ALTERNATIVES = 3
STATUS_MIN_INTERVAL = 0.5  # seconds between completiond/status notifications of the same state
# Our plugins say where the cursor rests ({textDocument: {uri}, position}, after a short debounce, and when a
# file becomes active): the daemon prefills the prompts around it (serving/prefetch.py). Other clients lose
# nothing: didOpen, didChange and requests prefetch too.
CURSOR_REST_METHOD = "completiond/cursorRest"


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("completiond")
    except Exception:  # metadata missing in a source checkout
        return "0"


class ServiceLink(Protocol):
    """How the LSP reaches the service's one dispatch (serving/service.py), wherever it runs."""

    async def start(self, cfg: Config, documents: dict[str, tuple[int, str, str]] | None = None) -> dict[str, Any]: ...

    def notify(self, method: str, params: dict[str, Any]) -> None: ...

    async def request(self, method: str, params: dict[str, Any], timeout: float | None = None) -> Any: ...

    async def restart(self, cfg: Config, documents: dict[str, tuple[int, str, str]]) -> None: ...

    async def close(self) -> None: ...


class InProcessService:
    """The daemon's Service, in this process (`completiond lsp --no-daemon`)."""

    CLIENT = 0

    def __init__(self, cfg: Config, on_notification):
        self.cfg = cfg
        self.on_notification = on_notification
        self.service: Service | None = None
        self._ids = 0
        self.docs: dict[str, tuple[int, str, str]] = {}

    async def start(self, cfg: Config, documents: dict[str, tuple[int, str, str]] | None = None) -> dict[str, Any]:
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

    async def restart(self, cfg: Config, documents: dict[str, tuple[int, str, str]]) -> None:
        if self.service is not None:
            self.service.shutdown()
        await self.start(cfg, documents)

    async def close(self) -> None:
        if self.service is not None:
            self.service.shutdown()


class DaemonConnection:
    """The shared daemon's Service, over its socket (the default): a self-healing session (serving/client.py)."""

    def __init__(self, session: DaemonSession):
        self.session = session

    async def start(self, cfg: Config, documents: dict[str, tuple[int, str, str]] | None = None) -> dict[str, Any]:
        client = await self.session.ensure()
        return client.welcome

    def notify(self, method: str, params: dict[str, Any]) -> None:
        self.session.notify(method, params)

    async def request(self, method: str, params: dict[str, Any], timeout: float | None = None) -> Any:
        return await self.session.request(method, params, timeout)

    async def restart(self, cfg: Config, documents: dict[str, tuple[int, str, str]]) -> None:
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
        super().__init__(
            "completiond",
            _version(),
            text_document_sync_kind=types.TextDocumentSyncKind.Incremental,
            protocol_cls=_Protocol,
        )
        self.docs: dict[str, Document] = {}
        self.encoding = UTF16
        self.config_file = config_file
        self.file_cfg, self.file_errors = config_mod.load_file(config_file)
        self.init_options: Any = None
        self.workspace_options: Any = None
        self.cfg = self.file_cfg
        # The model the user accepted at the first-run offer (lsp/first_run.py), used while no `model` is set.
        self.first_run_settings: dict[str, Any] = first_run.accepted_settings()
        self.first_run_offer: first_run.Offer | None = None
        # Where no daemon can run (Windows), the engine runs here: said once, at start-up (see `initialized`).
        self.platform_note = "" if no_daemon else paths.daemon_unsupported()
        no_daemon = no_daemon or bool(self.platform_note)
        self.no_daemon = no_daemon
        self.status: dict[str, Any] = {"state": "starting"}
        self._progress_wanted = False  # a loading progress is open or being created
        self._progress_token: str | None = None  # its token, once created
        self._progress_seq = 0
        self._progress_sent: int | None = None  # the last percentage reported on the open progress
        self._restarting: asyncio.Future | None = None
        self._status_sent = 0.0
        self._told: set[str] = set()  # error messages already shown
        self._last: dict[str, tuple[str, int, str]] = {}  # uri -> (text, cursor, suggestion) last shown
        self.typed_through_count = 0
        self.suggestion_counts = {
            "shown": 0,
            "accepted_full": 0,
            "accepted_word": 0,
            "accepted_line": 0,
            "dismissed": 0,
        }
        self.service_started = False
        self._setting_errors: set[str] = set()  # invalid settings reported at the last merge
        self._started: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        self._progress_task: asyncio.Task | None = None  # held: the loop keeps only a weak reference
        self._offer_task: asyncio.Task | None = None
        if no_daemon:
            self.service: ServiceLink = InProcessService(self.cfg, self._on_service_notification)
        else:
            session = DaemonSession(
                settings=lambda: config_mod.to_settings(self.cfg),
                documents=self.document_snapshot,
                directory=runtime_dir,
                on_notification=self._on_service_notification,
                on_connect=self._on_connect,
                on_lost=self._on_daemon_lost,
                on_notice=lambda message: self.tell_once(message, types.MessageType.Warning),
            )
            self.service = DaemonConnection(session)

    # --- settings ---------------------------------------------------------------

    def start_io(self, stdin: Any = None, stdout: Any = None) -> None:
        stdio.serve(self, stdin, stdout)  # stdin read by the event loop, not a thread per message

    def apply_settings(self) -> None:
        """Recompute the config from its layers; invalid values are shown to the user and replaced by defaults.
        A change of the engine settings (model, device...) restarts the engine with them."""
        cfg, errors = self.file_cfg, list(self.file_errors)
        for layer in (self.init_options, self.workspace_options):
            cfg, more = config_mod.merge(cfg, _section(layer), source="editor settings")
            errors += more
        if not cfg.model and self.first_run_settings:  # no model set anywhere: the one accepted at the first run
            accepted = dict(self.first_run_settings)
            if cfg.weights != "auto":
                accepted.pop("weights", None)
            cfg, _ = config_mod.merge(cfg, accepted)
        before = config_mod.engine_settings(self.cfg)
        self.cfg = cfg
        want = config_mod.engine_settings(cfg)
        changed = config_mod.engine_differences(want, before)
        if changed and self.service_started:
            served = self.status.get("engine_settings")
            if isinstance(served, dict) and not config_mod.engine_differences(want, served):
                self.send_status()  # what the daemon already serves: nothing to reload, no mismatch left
            else:
                self.restart_service("model settings changed: " + ", ".join(d.split(" (")[0] for d in changed))
        new_errors = [e for e in errors if e not in self._setting_errors]
        self._setting_errors = set(errors)
        if new_errors:  # each layer is re-merged on every change: report only what is newly wrong
            errors = new_errors
            message = "completiond: invalid settings, defaults used instead:\n" + "\n".join(errors)
            log.warning("%s", message)
            self.window_show_message(types.ShowMessageParams(type=types.MessageType.Warning, message=message))

    def restart_service(self, reason: str) -> asyncio.Future:
        """Restart the engine (the shared daemon, or the in-process one) with the current settings.

        The user changed them, so they want them now; other editors on the daemon reconnect by themselves
        (and are told if they asked for other settings). Restarts run one after another.
        """
        previous = self._restarting
        where = "the engine" if self.no_daemon else "the shared daemon"
        self.window_show_message(
            types.ShowMessageParams(type=types.MessageType.Info, message=f"completiond: {reason}; restarting {where}")
        )

        async def run() -> None:
            if previous is not None and not previous.done():
                await asyncio.gather(previous, return_exceptions=True)
            log.info("%s; restarting %s", reason, where)
            try:
                await self.service.restart(self.cfg, self.document_snapshot())
            except (DaemonUnavailable, ConnectionError, OSError) as exc:
                self.service_failed(exc)

        self._restarting = asyncio.ensure_future(run())
        return self._restarting

    def request_settings(self) -> dict[str, Any]:
        return config_mod.request_settings(self.cfg)  # with this editor's backend and endpoint

    async def watch_config_file(self, settle: float = 0.1) -> None:
        """Re-read config.toml when it changes, so edits apply without restarting the editor.

        A watchdog observer reports changes (no polling); the file is read and parsed on a worker
        thread, never on this event loop, and a broken file is reported, never fatal to the watch.
        """
        from completiond.lsp.config_watch import ConfigWatcher

        path = Path(self.config_file or config_mod.config_file_path())
        loop = asyncio.get_running_loop()
        changed = asyncio.Event()

        def on_change() -> None:  # observer thread
            try:
                loop.call_soon_threadsafe(changed.set)
            except RuntimeError:  # the loop closed while shutting down
                pass

        watcher = ConfigWatcher(path, on_change)
        try:
            await asyncio.to_thread(watcher.start)
        except OSError as exc:
            log.warning("cannot watch %s (%s): edits to it apply after restarting the editor", path, exc)
            return
        # The file was read before the watch was armed (at start-up, while the model may still be importing):
        # an edit made in between raised no event, so read it once more now that edits are seen.
        changed.set()
        try:
            while True:
                await changed.wait()
                await asyncio.sleep(settle)  # one save is several events: read once, after them
                changed.clear()
                file_cfg, file_errors = await asyncio.to_thread(config_mod.load_file, path)
                if (file_cfg, file_errors) == (self.file_cfg, self.file_errors):
                    continue
                log.info("%s changed: reloading settings", path)
                self.file_cfg, self.file_errors = file_cfg, file_errors
                self.apply_settings()
        finally:
            threading.Thread(target=watcher.stop, daemon=True, name="config-watch-stop").start()

    async def pull_configuration(self) -> None:
        caps = self.client_capabilities.workspace
        if caps is None or not caps.configuration:
            return
        try:
            result = await asyncio.wait_for(
                self.workspace_configuration_async(
                    types.ConfigurationParams(items=[types.ConfigurationItem(section=SECTION)])
                ),
                10,
            )
        except (asyncio.TimeoutError, Exception) as exc:  # the client may not implement it despite advertising it
            log.warning("workspace/configuration failed: %s", exc)
            return
        self.workspace_options = result[0] if result else None

    # --- documents ----------------------------------------------------------------

    def document_snapshot(self) -> dict[str, tuple[int, str, str]]:
        return {uri: (d.version, d.text, d.language_id) for uri, d in self.docs.items()}

    # --- the service ----------------------------------------------------------------------

    async def start_service(self) -> None:
        try:
            welcome = await self.service.start(self.cfg, self.document_snapshot())
        except (DaemonUnavailable, ConnectionError, OSError, RemoteError) as exc:
            self.service_failed(exc)
            return
        if isinstance(welcome, dict) and isinstance(welcome.get("status"), dict):
            self._on_service_notification("status", welcome["status"])
        if self.no_daemon and self.workspace_folders():
            self.service.notify("workspace", {"folders": self.workspace_folders()})

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
            self.service.notify("workspace", {"folders": folders})
        if welcome.get("warning"):
            self.window_show_message(
                types.ShowMessageParams(type=types.MessageType.Warning, message=f"completiond: {welcome['warning']}")
            )
        if isinstance(welcome.get("status"), dict):
            self._on_service_notification("status", welcome["status"])

    def _on_daemon_lost(self, reason: str) -> None:
        """The daemon went away by itself (killed, crashed, `completiond stop`): editors show it now, not
        "ready" until the next keystroke. The next completion starts a daemon again (DaemonSession)."""
        log.warning("the completion daemon stopped: %s", reason)
        self._on_service_notification(
            "status",
            {
                "state": "stopped",
                "model": self.status.get("model"),
                "device": self.status.get("device"),
                "error": f"the completion daemon stopped ({reason}); the next completion starts it again",
            },
        )

    def service_failed(self, exc: Exception) -> None:
        log.error("cannot reach the completion daemon: %s", exc)
        self._on_service_notification(
            "status", {"state": "error", "error": f"cannot reach the completion daemon: {exc}"}
        )

    def _on_service_notification(self, method: str, params: dict[str, Any]) -> None:
        if method != "status":
            return
        previous = self.status.get("state")
        self.status = params
        state = params.get("state")
        if state == "error" and self._first_run_failed(str(params.get("error") or "")):
            return  # said once, and the bundled model is on its way back
        if state == "error" and params.get("error") and (previous != "error" or params["error"] not in self._told):
            # Once per failure, not once per keystroke while it lasts; and not again as the warning of the
            # requests that fail for the same reason (tell_once knows it was said).
            self._told.add(str(params["error"]))
            self.window_show_message(
                types.ShowMessageParams(type=types.MessageType.Error, message=f"completiond: {params['error']}")
            )
        # Told while the model loads (a model that will not fit the device's memory): once each.
        warnings = params.get("warnings")
        for warning in warnings if isinstance(warnings, list) else []:
            self.tell_once(str(warning), types.MessageType.Warning)
        if state == "loading":
            self._begin_progress(f"loading {params.get('model') or 'model'}")
            self._report_progress()
        elif self._progress_wanted:
            self._end_progress(
                "ready" if state != "error" else f"failed: {params.get('error')}", loaded=state != "error"
            )
        now = time.monotonic()
        if state == previous and now - self._status_sent < STATUS_MIN_INTERVAL:
            return  # metrics-only updates arrive per keystroke; status bars need far fewer
        self._status_sent = now
        self.send_status()

    # --- the first-run offer (lsp/first_run.py) ----------------------------------------------

    async def offer_first_run(self) -> None:
        """Ask once, on the first start with no model set, whether to download the recommended model."""
        if not first_run.should_offer(self.cfg) or self.first_run_settings:
            return
        offer = await asyncio.to_thread(first_run.machine_offer)
        # Asked once the bundled model serves: the editor works meanwhile, and the download's progress is its own.
        for _ in range(1200):
            if self.status.get("state") not in ("starting", "loading") and not self._progress_wanted:
                break
            await asyncio.sleep(0.1)
        try:
            answer = await self.window_show_message_request_async(
                types.ShowMessageRequestParams(
                    type=types.MessageType.Info,
                    message=offer.message(),
                    actions=[
                        types.MessageActionItem(title=first_run.DOWNLOAD),
                        types.MessageActionItem(title=first_run.NOT_NOW),
                    ],
                )
            )
        except Exception as exc:  # a client that cannot ask: leave it for one that can, nothing recorded
            log.info("first-run offer not shown: %s", exc)
            return
        title = answer.title if answer is not None else ""
        state = await asyncio.to_thread(first_run.record, title or "dismissed", offer)
        if title == first_run.DOWNLOAD:
            self.first_run_offer = offer
            self.first_run_settings = {"model": state["model"], "weights": state["weights"]}
            self.apply_settings()  # restarts the daemon with it: it downloads, with progress here
        else:
            self.tell_once(first_run.declined_notice(offer), types.MessageType.Info)

    def _first_run_loading(self) -> bool:
        return bool(self.first_run_settings) and self.cfg.model == self.first_run_settings.get("model")

    def _first_run_failed(self, error: str) -> bool:
        """The model accepted at the first run failed to download or load: back to the bundled model, with one
        notice (not the error and then the fallback)."""
        if not self._first_run_loading():
            return False
        model = self.first_run_settings.get("model", "")
        first_run.download_failed(error)
        self.first_run_settings = {}
        offer = self.first_run_offer
        pull = f"`completiond pull {offer.name}`" if offer else f"`completiond pull {model}`"
        self.tell_once(
            f"{model} could not be downloaded or loaded ({error}); using the bundled model (Python only) "
            f'instead. When it can be, {pull}, then set model = "{model}"',
            types.MessageType.Warning,
        )
        self.apply_settings()
        return True

    def cancel_first_run(self) -> None:
        """The user cancelled the download's progress: the bundled model again (the partial files stay in the
        hub cache, so `completiond pull` resumes it)."""
        if self._first_run_loading():
            self._first_run_failed("download cancelled")

    def model_mismatch(self) -> str:
        """What the daemon serves differently from this editor's engine settings ('' when nothing)."""
        have = self.status.get("engine_settings")
        if not isinstance(have, dict) or self.status.get("state") in ("starting", "error"):
            return ""
        diff = config_mod.engine_differences(config_mod.engine_settings(self.cfg), have)
        return (
            "the daemon serves other settings than yours: " + ", ".join(diff) + "; " + config_mod.RESTART_HINT
            if diff
            else ""
        )

    def send_status(self) -> None:
        """The `completiond/status` notification editors show (status bar, :checkhealth, status commands)."""
        params = self.status
        progress = params.get("progress") if params.get("state") == "loading" else None
        counts = self.suggestion_counts
        self.protocol.notify(
            STATUS_METHOD,
            {
                "state": params.get("state"),
                "message": params.get("error") or "",
                "model": params.get("model"),
                "device": params.get("device"),
                "latencyMs": params.get("last_latency_ms"),
                # Of the last completion; null when not measured (nothing drafted / nothing generated), never 0.
                "draftAcceptance": params.get("draft_acceptance"),
                "tokensPerSecond": params.get("tokens_per_s"),
                # The draft in use (calibrated default) and what the last completion's rounds drafted with.
                "draft": params.get("draft"),
                "lastDraft": params.get("last_draft"),
                # While loading: {"phase", "percentage", "message"}.
                "progress": progress if isinstance(progress, dict) else None,
                # Non-empty while the daemon serves another model/device/... than this editor's settings ask for:
                # then the editor is not "ready" for its model, whatever `state` says.
                "modelMismatch": self.model_mismatch(),
                # This editor session's suggestions (`completiond status` shows every editor's, since the daemon started).
                "suggestions": {
                    "shown": counts["shown"],
                    "acceptedFull": counts["accepted_full"],
                    "acceptedWord": counts["accepted_word"],
                    "acceptedLine": counts["accepted_line"],
                    "dismissed": counts["dismissed"],
                },
            },
        )

    def count_suggestion(self, event: str, kind: str | None = None) -> None:
        """One suggestion shown, accepted (kind: full / word / line) or dismissed: counted here for this
        editor, and in the daemon for `completiond status`. Nothing leaves the machine."""
        self.suggestion_counts[
            "dismissed" if event == "dismissed" else "shown" if event == "shown" else f"accepted_{kind}"
        ] += 1
        self.service.notify("suggestion", {"event": event, "kind": kind} if kind else {"event": event})

    def _report_progress(self) -> None:
        """The load's percentage on the open `$/progress` (once its token exists)."""
        progress = self.status.get("progress")
        token = self._progress_token
        if token is None or not isinstance(progress, dict) or not isinstance(progress.get("percentage"), int):
            return
        if progress["percentage"] == self._progress_sent:
            return
        self._progress_sent = progress["percentage"]
        self.work_done_progress.report(
            token,
            types.WorkDoneProgressReport(
                message=str(progress.get("message") or progress.get("phase") or ""), percentage=progress["percentage"]
            ),
        )

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
            # A percentage in begin tells the client that reports will carry one (else it may show a spinner).
            self.work_done_progress.begin(
                token,
                types.WorkDoneProgressBegin(
                    title="completiond", message=message, cancellable=self._first_run_loading(), percentage=0
                ),
            )
            self._progress_token = token
            self._progress_sent = 0
            if not self._progress_wanted or self.status.get("state") != "loading":
                failed = self.status.get("state") == "error"  # loading ended while the token was being created
                self._end_progress(f"failed: {self.status.get('error')}" if failed else "ready", loaded=not failed)
            else:
                self._report_progress()  # phases that went by while the token was being created

        self._progress_task = asyncio.ensure_future(begin())

    def _end_progress(self, message: str, loaded: bool = False) -> None:
        self._progress_wanted = False
        token, self._progress_token = self._progress_token, None
        if token is not None:
            if loaded and self._progress_sent != 100:
                # The bar ends full even when the last phases went by before the client could be told.
                self.work_done_progress.report(token, types.WorkDoneProgressReport(message="ready", percentage=100))
            self.work_done_progress.end(token, types.WorkDoneProgressEnd(message=message))

    # --- completion -------------------------------------------------------------------

    async def suggest(
        self, uri: str, position: types.Position, alternatives: int | None = None
    ) -> tuple[Document, list[dict[str, Any]]] | None:
        """The document and its suggestions at the position, best first (several with `alternatives` > 1, or
        at least `alternatives` when given: the user asked for them, by cycling)."""
        doc = self.docs.get(uri)
        if doc is None or not self.cfg.enable:
            return None
        if doc.language_id.lower() in config_mod.disabled_languages(self.cfg):
            return None  # prose and commit messages by default (disabledLanguages), for every client
        if len(doc.text) > MAX_FRAME:
            # Far past what the prompt builder takes, and too big to send to the daemon: answer at
            # once, instead of scanning the file and trying to encode it again on every keystroke.
            self.tell_once(
                f"{uri} is too large for completions (over {MAX_FRAME} characters); skipped", types.MessageType.Info
            )
            return None
        version = doc.version
        offset = doc.offset(position.line, position.character, self.encoding)
        typed_through = self._typed_through(doc, offset) if alternatives is None else None
        if typed_through is not None:
            return doc, [typed_through]
        if self._started is not None and not self._started.done():
            await asyncio.shield(self._started)
        try:
            result = await self.service.request(
                "complete",
                {
                    "uri": uri,
                    "version": version,
                    "offset": offset,
                    "settings": _with_alternatives(self.request_settings(), alternatives),
                },
            )
        except RemoteError as exc:
            if exc.code == Code.CANCELLED:
                return None  # superseded by a newer request: that one answers
            log.warning("completion for %s failed: %s", uri, exc)
            if exc.code in (Code.ENGINE_ERROR, Code.NOT_READY, Code.INTERNAL):
                self.tell_once(exc.message, types.MessageType.Warning)
            return None
        except (DaemonUnavailable, ConnectionLost) as exc:
            self.service_failed(exc)
            return None
        for warning in (result.get("warnings") or []) if isinstance(result, dict) else []:
            self.tell_once(str(warning), types.MessageType.Warning)
        suggestions = result.get("suggestions") if isinstance(result, dict) else None
        if not isinstance(suggestions, list):  # a daemon from before alternatives
            one = result.get("suggestion") if isinstance(result, dict) else None
            suggestions = [one] if one is not None else []
        if not suggestions or self.docs.get(uri) is not doc or doc.version != version:
            return None  # nothing to show, or the document moved on: never show a stale result as fresh
        suggestion = suggestions[0]
        if suggestion["start"] == suggestion["end"] == offset:
            self._last[uri] = (doc.text, offset, suggestion["text"])
        return doc, suggestions

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

    def midline_allowed(self, doc: Document, offset: int) -> bool:
        """Whether a suggestion at this offset is worth showing (MIDLINE_REST), before asking the model."""
        return midline_rest_ok(_rest_of_line(doc, offset)[0])

    def inline_item(self, doc: Document, s: dict[str, Any]) -> types.InlineCompletionItem | None:
        """The item for one suggestion, in a form that editors preview exactly as they insert it.

        At the end of a line: the (empty) range of the insertion, which every renderer draws after the
        cursor. In the middle of one, the range runs to the end of the line and insertText repeats what
        it covers: Neovim 0.12 draws a ranged item as an overlay from the range start (so an empty range
        hid the rest of the line that accepting kept), and an item without a range inline after skipping
        whatever the text has in common with the rest of the line (so the preview lost those characters).
        A multi-line suggestion there is offered only if its first line covers the rest of the line (the
        overlay would leave part of it visible), else just its first line.
        """
        text, start, end = s["text"], s["start"], s["end"]
        rest, eol = _rest_of_line(doc, end)
        accepted = types.Command(
            title="completiond: suggestion accepted",
            command=CMD_SUGGESTION_EVENT,
            arguments=[{"event": "accepted", "kind": "full"}],
        )
        if not rest:
            return types.InlineCompletionItem(insert_text=text, range=self.lsp_range(doc, start, end), command=accepted)
        if not midline_rest_ok(rest):
            return None
        first = text.split("\n", 1)[0]
        if "\n" in text and len(first) < len(rest):
            text = first
        if not text.strip():
            return None
        return types.InlineCompletionItem(
            insert_text=text + rest, range=self.lsp_range(doc, start, eol), command=accepted
        )

    def lsp_range(self, doc: Document, start: int, end: int) -> types.Range:
        s = doc.position(start, self.encoding)
        e = doc.position(end, self.encoding)
        return types.Range(start=types.Position(*s), end=types.Position(*e))


def midline_rest_ok(rest: str) -> bool:
    """The text after the cursor is only closing brackets, quotes and a final `:` `{` `;` `,`, and blanks
    (MIDLINE_REST), decided in time linear in its length."""
    rest = rest.strip()
    return len(rest) <= MIDLINE_MAX and MIDLINE_REST.fullmatch(rest) is not None


def _with_alternatives(settings: dict[str, Any], alternatives: int | None) -> dict[str, Any]:
    if alternatives is None:
        return settings
    return {**settings, "alternatives": max(int(settings.get("alternatives") or 1), alternatives)}


def _rest_of_line(doc: Document, offset: int) -> tuple[str, int]:
    """The text from offset to the end of its line (LSP lines: \n, \r\n or \r), and where it ends."""
    line, _ = doc.position(offset, UTF32)
    eol = doc.starts[line + 1] if line + 1 < len(doc.starts) else len(doc.text)
    rest = doc.text[offset:eol].rstrip("\r\n")
    return rest, offset + len(rest)


def _rest_params(params: Any) -> tuple[str | None, tuple[int, int] | None]:
    """(uri, (line, character)) of a cursorRest notification, as pygls hands over a method of ours (an object
    of attributes, or a dict); (None, None) parts for what is missing or malformed."""

    def field(obj: Any, name: str) -> Any:
        return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)

    uri = field(field(params, "textDocument"), "uri")
    position = field(params, "position")
    line, character = field(position, "line"), field(position, "character")
    ok = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (line, character))
    return (uri if isinstance(uri, str) else None), ((line, character) if ok else None)


def _section(options: Any) -> Any:
    """The `completiond` settings object, whether sent wrapped in its section or bare."""
    if isinstance(options, dict) and isinstance(options.get(SECTION), dict):
        return options[SECTION]
    if options is None or options == {}:
        return None
    return options


def _encoding(capabilities: types.ClientCapabilities) -> str:
    chosen = ServerCapabilitiesBuilder.choose_position_encoding(capabilities)
    encodings: dict[str, str] = {types.PositionEncodingKind.Utf8: UTF8, types.PositionEncodingKind.Utf32: UTF32}
    return encodings.get(chosen, UTF16)


def build_server(
    no_daemon: bool = False, runtime_dir: Path | None = None, config_file: Path | None = None
) -> CompletionServer:
    server = CompletionServer(no_daemon=no_daemon, runtime_dir=runtime_dir, config_file=config_file)

    @server.feature(types.INITIALIZE)
    def initialize(ls: CompletionServer, params: types.InitializeParams) -> None:
        ls.encoding = _encoding(params.capabilities)
        ls.init_options = params.initialization_options
        ls.apply_settings()

    @server.feature(types.INITIALIZED)
    async def initialized(ls: CompletionServer, params: types.InitializedParams) -> None:
        if ls.platform_note:
            ls.window_show_message(
                types.ShowMessageParams(
                    type=types.MessageType.Info,
                    message=(
                        f"completiond: {ls.platform_note}; the model runs inside this editor's language server instead "
                        "(as with `completiond lsp --no-daemon`), one copy per editor window"
                    ),
                )
            )

        async def start() -> None:
            await ls.pull_configuration()
            if ls.workspace_options is not None:
                ls.apply_settings()
            if ls.cfg.enable:  # disabled: no daemon, no model in memory, until enabled
                await ls.start_service()
                ls.service_started = True
                ls._offer_task = asyncio.ensure_future(ls.offer_first_run())

        ls._started = asyncio.ensure_future(start())
        ls._watcher = asyncio.ensure_future(ls.watch_config_file())

    @server.feature(types.WORKSPACE_DID_CHANGE_CONFIGURATION)
    async def did_change_configuration(ls: CompletionServer, params: types.DidChangeConfigurationParams) -> None:
        settings = params.settings
        if isinstance(settings, dict) and SECTION in settings:
            ls.workspace_options = settings[SECTION]
        else:
            await ls.pull_configuration()  # the "pull" model: settings is null, ask for them
        ls.apply_settings()  # restarts the engine when its settings changed
        if ls.cfg.enable and not ls.service_started and (ls._started is None or ls._started.done()):
            ls.service_started = True
            ls._started = asyncio.ensure_future(ls.start_service())

    @server.feature(types.WORKSPACE_DID_CHANGE_WORKSPACE_FOLDERS)
    def did_change_folders(ls: CompletionServer, params: types.DidChangeWorkspaceFoldersParams) -> None:
        # Added folders feed this editor's prompt context; removed ones leave it, and their watches go
        # once no other editor has them.
        from urllib.parse import unquote, urlparse

        added = [unquote(urlparse(f.uri).path) for f in params.event.added if f.uri.startswith("file://")]
        removed = [unquote(urlparse(f.uri).path) for f in params.event.removed if f.uri.startswith("file://")]
        if added or removed:
            ls.service.notify("workspace", {"folders": added, "removed": removed})

    @server.feature(types.TEXT_DOCUMENT_DID_OPEN)
    def did_open(ls: CompletionServer, params: types.DidOpenTextDocumentParams) -> None:
        td = params.text_document
        ls.docs[td.uri] = Document(uri=td.uri, text=td.text, version=td.version, language_id=td.language_id)
        ls.service.notify("open", {"uri": td.uri, "version": td.version, "text": td.text, "languageId": td.language_id})

    @server.feature(types.TEXT_DOCUMENT_DID_CHANGE)
    def did_change(ls: CompletionServer, params: types.DidChangeTextDocumentParams) -> None:
        doc = ls.docs.get(params.text_document.uri)
        if doc is None:
            log.warning("didChange for unopened %s ignored", params.text_document.uri)
            return
        edits = doc.apply_lsp_changes(params.content_changes, params.text_document.version, ls.encoding)
        ls.service.notify("change", {"uri": doc.uri, "version": doc.version, "edits": [list(e) for e in edits]})

    @server.feature(types.TEXT_DOCUMENT_DID_CLOSE)
    def did_close(ls: CompletionServer, params: types.DidCloseTextDocumentParams) -> None:
        ls._last.pop(params.text_document.uri, None)
        if ls.docs.pop(params.text_document.uri, None) is not None:
            ls.service.notify("close", {"uri": params.text_document.uri})

    @server.feature(CURSOR_REST_METHOD)
    def cursor_rest(ls: CompletionServer, params: Any) -> None:
        uri, position = _rest_params(params)
        doc = ls.docs.get(uri) if uri is not None else None
        if (
            doc is None
            or position is None
            or not ls.cfg.enable
            or len(doc.text) > MAX_FRAME
            or doc.language_id.lower() in config_mod.disabled_languages(ls.cfg)
        ):
            return  # a hint: nothing to warm (or not ours to warm), and nothing to answer
        offset = doc.offset(position[0], position[1], ls.encoding)
        ls.service.notify(
            "rest", {"uri": uri, "version": doc.version, "offset": offset, "settings": ls.request_settings()}
        )

    @server.feature(types.TEXT_DOCUMENT_INLINE_COMPLETION, types.InlineCompletionOptions())
    async def inline_completion(
        ls: CompletionServer, params: types.InlineCompletionParams
    ) -> types.InlineCompletionList:
        doc = ls.docs.get(params.text_document.uri)
        # Not worth the model's time where nothing would show. (A request still in flight while the user
        # typed on also lands here: its position is inside the newer text, and its answer is stale anyway.)
        # A document too large for completions is left to suggest(), which tells the user once.
        if (
            doc is not None
            and len(doc.text) <= MAX_FRAME
            and not ls.midline_allowed(doc, doc.offset(params.position.line, params.position.character, ls.encoding))
        ):
            return types.InlineCompletionList(items=[])
        typed_through = ls.typed_through_count
        # Asked for explicitly (VS Code asks so when the user cycles through a single suggestion, Neovim's
        # cycle keys too): alternatives on demand, as Copilot does, whatever `alternatives` says for typing.
        invoked = (
            params.context is not None and params.context.trigger_kind == types.InlineCompletionTriggerKind.Invoked
        )
        found = await ls.suggest(
            params.text_document.uri, params.position, alternatives=ON_DEMAND_ALTERNATIVES if invoked else None
        )
        if found is None:
            return types.InlineCompletionList(items=[])
        doc, suggestions = found
        items: list[types.InlineCompletionItem] = []
        for s in suggestions:  # alternatives, best first; the editor's next/previous keys cycle through them
            item = ls.inline_item(doc, s)
            if item is not None and all(item.insert_text != i.insert_text for i in items):
                items.append(item)
        if not items:
            return types.InlineCompletionList(items=[])
        if ls.typed_through_count == typed_through:  # the rest of one already shown is not a new one
            ls.count_suggestion("shown")
        return types.InlineCompletionList(items=items)

    @server.feature(types.TEXT_DOCUMENT_COMPLETION, types.CompletionOptions())
    async def completion(ls: CompletionServer, params: types.CompletionParams) -> types.CompletionList:
        found = await ls.suggest(params.text_document.uri, params.position)
        if found is None:
            return types.CompletionList(is_incomplete=True, items=[])
        doc, suggestions = found
        s = suggestions[0]
        first = s["text"].split("\n", 1)[0].strip() or s["text"].strip()
        label = first if len(first) <= 60 else first[:57] + "..."
        item = types.CompletionItem(
            label=label,
            kind=types.CompletionItemKind.Text,
            detail="completiond",
            preselect=True,
            sort_text="0",
            filter_text=s["text"],
            insert_text_format=types.InsertTextFormat.PlainText,
            text_edit=types.TextEdit(range=ls.lsp_range(doc, s["start"], s["end"]), new_text=s["text"]),
        )
        return types.CompletionList(is_incomplete=True, items=[item])

    @server.command(CMD_STATS)
    async def stats(ls: CompletionServer, *args: Any) -> dict[str, Any]:
        try:
            stats = await ls.service.request("stats", {}, timeout=10)
        except (RemoteError, DaemonUnavailable, ConnectionLost, asyncio.TimeoutError) as exc:
            stats = {"error": str(exc)}
        stats["lsp"] = {"typed_through": ls.typed_through_count, "suggestions": dict(ls.suggestion_counts)}
        return stats

    @server.command(CMD_SUGGESTION_EVENT)
    def suggestion_event(ls: CompletionServer, *args: Any) -> dict[str, int]:
        """args: [{"event": "accepted", "kind": "full"|"word"|"line"}] or [{"event": "dismissed"}]."""
        event = args[0] if args and isinstance(args[0], dict) else {}
        key = (event.get("event"), event.get("kind"))
        if key not in SUGGESTION_EVENTS:
            raise ValueError(f"{CMD_SUGGESTION_EVENT}: unknown event {event!r}")
        ls.count_suggestion(*key)
        return dict(ls.suggestion_counts)

    @server.command(CMD_MODELS)
    async def models(ls: CompletionServer, *args: Any) -> dict[str, Any]:
        from completiond.engine import catalog

        offer = await asyncio.to_thread(first_run.machine_offer)
        return {
            "current": ls.cfg.model,
            "recommended": offer.repo,
            "models": [
                {
                    "name": e.name,
                    "repo": e.repo,
                    "downloadGb": round(e.params_b * 2, 1),
                    "cpu": catalog.cpu_speed(e),
                    "gpuMsPerToken": round(1000 * e.params_b * 2e9 / catalog.GPU_BANDWIDTH, 1),
                    "languages": list(e.languages),
                    "gated": e.gated,
                }
                for e in catalog.CATALOG
                if e.supported
            ],
        }

    @server.command(CMD_RESTART)
    async def restart(ls: CompletionServer, *args: Any) -> dict[str, Any]:
        try:
            await ls.service.restart(ls.cfg, ls.document_snapshot())
        except (DaemonUnavailable, ConnectionError, OSError) as exc:
            ls.service_failed(exc)
            return {"restarted": False, "error": str(exc)}
        return {"restarted": True}

    @server.feature(types.WINDOW_WORK_DONE_PROGRESS_CANCEL)
    def progress_cancel(ls: CompletionServer, params: types.WorkDoneProgressCancelParams) -> None:
        # Only the download of the model accepted at the first run can be cancelled (cancellable=True then).
        if params.token == ls._progress_token:
            ls.cancel_first_run()

    @server.feature(types.SHUTDOWN)
    async def shutdown(ls: CompletionServer, params: Any) -> None:
        # Leave the shared daemon running for the other editors; it exits on its own when idle.
        if ls._watcher is not None:
            ls._watcher.cancel()
        await ls.service.close()

    return server


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stdio", action="store_true", help="accepted for editor compatibility (stdio is the default)")
    parser.add_argument(
        "--no-daemon", action="store_true", help="run the engine in this process instead of the shared daemon"
    )
    parser.add_argument(
        "--runtime-dir", type=Path, help="daemon socket directory (default: $XDG_RUNTIME_DIR/completiond)"
    )
    parser.add_argument("--config", type=Path, help="config.toml (default: ~/.config/completiond/config.toml)")
    parser.add_argument("--log-level", choices=("error", "warning", "info", "debug"), default=None)


def run(args: argparse.Namespace) -> int:
    file_cfg, _ = config_mod.load_file(args.config)
    logging.basicConfig(
        level=(args.log_level or file_cfg.log_level).upper(),
        stream=sys.stderr,
        format="%(asctime)s completiond-lsp[%(process)d] %(levelname)s %(name)s: %(message)s",
    )
    if (args.log_level or file_cfg.log_level) != "debug":
        # pygls logs every message at INFO: that is debug output for us.
        logging.getLogger("pygls").setLevel(logging.WARNING)
    server = build_server(no_daemon=args.no_daemon, runtime_dir=args.runtime_dir, config_file=args.config)
    server.start_io()
    return 0
