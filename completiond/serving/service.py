"""The service: documents, the scheduler and the engine, behind one dispatch.

`Service` knows nothing about sockets. Every front end goes through the same
two entry points, `notify(client, method, params)` and `request(client, method,
params)`: the daemon's socket server (server.py) for each connection, and
`completiond lsp --no-daemon` in-process. So a method is parsed and validated
in one place, and both paths behave the same.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any, NoReturn, Protocol

from completiond import config as config_mod
from completiond.completion.completer import Backend, Completer
from completiond.completion.documents import Document, EditError
from completiond.config import Config
from completiond.errors import CompletionError
from completiond.serving.scheduler import CANCELLED, ERROR, OK, Job, Outcome, Overloaded, Scheduler, ShuttingDown
from completiond.serving.wire import Code

log = logging.getLogger(__name__)

MAX_FOLDERS = 16  # workspace folders watched per editor
QUEUE_DEADLINE = 10.0  # seconds a completion may wait in the queue: the editor has long moved on by then


class ServiceError(CompletionError):
    """A request the service refuses; `code` is the wire error code the client sees."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


# Load phases: the share of the load done when each starts (about, for the bundled model on a CPU) and
# what users read. Engine.load reports up to "engine"; the warm-up is ours. Editors show them as
# `$/progress` percentages, `completiond complete` as lines.
LOAD_PHASES = {"starting": (0, "starting"), "download": (0, "downloading the model"), "tokenizer": (2, "loading the tokenizer"),
               "weights": (10, "loading the weights"), "device": (70, "moving the weights to the device"),
               "engine": (80, "preparing the engine"), "draft model": (85, "loading the draft model"),
               "warm-up": (90, "warming up"), "ready": (100, "ready")}

ProgressFn = Callable[..., None]  # (phase, percentage, message=None)


class Loader(Protocol):
    """Makes the Completer for the settings, on the worker thread, reporting load phases as it goes."""

    def __call__(self, cfg: Config, *, progress: ProgressFn | None = None,
                 warn: Callable[[str], None] | None = None) -> Completer: ...

# Of the progress bar, when the model is downloaded first (a hub model not yet in the cache): the
# download dominates then, and the load phases share the rest, so the percentage only rises.
DOWNLOAD_SHARE = 80


def progress_report(phase: str, percentage: int, message: str | None = None) -> dict[str, Any]:
    """How status() shows a load phase."""
    return {"phase": phase, "percentage": percentage,
            "message": message or LOAD_PHASES.get(phase, (0, phase))[1]}


def load_completer(cfg: Config, progress: ProgressFn | None = None,
                   warn: Callable[[str], None] | None = None) -> Completer:
    """What completes for the settings `cfg`, ready to serve (the Service's loader; call off the event loop).

    A team server replaces the engine: it loads nothing and imports no torch; the server is first asked
    with the first completion."""
    backend = Backend.of(cfg.backend)
    match backend:
        case Backend.LOCAL:
            from completiond.completion.suggest import LocalCompleter

            return LocalCompleter(load_engine(cfg, progress, warn))
        case Backend.OPENAI | Backend.LLAMACPP_INFILL:
            from completiond.backends.team_server import TeamServer
            from completiond.completion.team import TeamCompleter

            completer = TeamCompleter(TeamServer(cfg))
            if progress is not None:
                progress("ready", LOAD_PHASES["ready"][0])
            return completer
        case _:
            _unhandled(backend)


def _unhandled(backend: NoReturn) -> NoReturn:
    """The type checker proves every Backend has its case above (a new member without one fails mypy)."""
    raise AssertionError(f"no completer for backend {backend!r}")


def load_engine(cfg: Config, progress: ProgressFn | None = None, warn: Callable[[str], None] | None = None) -> Any:
    """Engine.load with the settings of `cfg`, then one tiny generation so that the first real request
    does not pay for lazy initialisation (kernels, allocator). Imports torch: call off the event loop."""
    for what, value in (("model", cfg.model), ("draft model", cfg.draft_model)):
        problem = missing_model(value, what)
        if problem:  # said before torch loads, and with the path as the user wrote it
            raise MissingModel(problem)
    from completiond.engine.engine import Engine, SamplingParams

    cache = cfg.cache_megabytes * 1024 * 1024 if cfg.cache_megabytes else None

    downloaded = [False]
    last = [-1]

    def phase(name: str) -> None:
        if progress is not None:
            pct = LOAD_PHASES[name][0]
            progress(name, DOWNLOAD_SHARE + pct * (100 - DOWNLOAD_SHARE) // 100 if downloaded[0] else pct)

    def download(done: int, total: int) -> None:
        downloaded[0] = True
        pct = DOWNLOAD_SHARE * done // total if total else 0
        if progress is not None and pct != last[0]:  # a report per percent, not per network chunk
            last[0] = pct
            progress("download", pct, f"downloading {cfg.model}: {done / 1e6:.0f} of {total / 1e6:.0f} MB")

    engine = Engine.load(model=cfg.model or None, device=cfg.device, dtype=cfg.dtype, weights=cfg.weights,
                         trust_remote_code=cfg.trust_remote_code, cache_bytes=cache,
                         draft_model=cfg.draft_model or None,
                         progress=phase if progress is not None else None, download_progress=download, warn=warn)
    phase("warm-up")
    engine.generate([0], SamplingParams(max_tokens=2, speculative=True), history=None)
    engine.cache.clear()  # the warm-up's sequence is no prefix of anything real
    try:  # the prompt builder's token tables (about 0.1 s for the bundled model), not the first request's
        from completiond.completion.suggest import builder_for

        builder_for(engine, cfg)
    except CompletionError:
        pass  # a setting no prompt fits: the first request says so
    phase("ready")
    return engine


class MissingModel(CompletionError):
    """A model setting names a local directory that is not there."""


def missing_model(value: str, what: str = "model") -> str:
    """Why `value` cannot be a model, when that is plain without importing torch: a path (it starts with
    `.`, `/` or `~`, as Engine.load reads it) to nothing. Empty when it may be fine. The path is named as
    given and, when that differs, as resolved here (a daemon resolves a relative one in its own folder)."""
    if value and value.startswith((".", "/", "~")) and not os.path.exists(os.path.expanduser(value)):
        resolved = os.path.abspath(os.path.expanduser(value))
        return f"{what} directory {value} does not exist" + (f" ({resolved})" if resolved != value else "")
    return ""


def resolve_model(value: str) -> str:
    """Local directories by absolute path, so a daemon started elsewhere finds them."""
    if value and os.path.isdir(value):
        return os.path.abspath(value)
    return value


class Service:
    """Documents + scheduler + engine. All public methods run on the event loop thread."""

    def __init__(self, cfg: Config, loader: Loader = load_completer, max_pending_per_client: int = 16,
                 queue_deadline: float = QUEUE_DEADLINE, calibrate_min_params: int | None = None):
        self.cfg = cfg
        self._loader = loader
        self.scheduler = Scheduler(max_pending_per_client=max_pending_per_client, queue_deadline=queue_deadline)
        self.completer: Completer | None = None
        self.state = "idle"            # idle | loading | ready | busy | error
        self.error = ""
        self.model_id = ""
        self.model_name = ""           # what users read: directory, or hub id@revision (engine.name)
        self.load_warnings: list[str] = []  # told before the load went on (a model that may not fit)
        # A model loaded without a calibration is calibrated between requests (engine/autocalibrate.py);
        # below this many parameters (test models) there is too little to gain. None: the module's default.
        self.calibrate_min_params = calibrate_min_params
        self.calibration_job: Any = None
        self.calibration_message = ""
        self.documents: dict[tuple[Hashable, str], Document] = {}
        self.listeners: list[Callable[[dict[str, Any]], None]] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self.started = time.time()
        self._stats_lock = threading.Lock()
        self.stats_counts: dict[str, float] = dict(
            requests=0, completed=0, empty=0, superseded=0, cancelled=0, errors=0, rejected=0, expired=0,
            wasted_rounds=0, rounds_after_cancel=0, rounds=0, latency_ms_sum=0, prompt_tokens=0, reused_tokens=0, generated_tokens=0, loads=0,
            draft_accepted=0, draft_rejected=0, history_accepted=0, withheld_syntax=0)
        self.last: dict[str, Any] = {}
        # What users did with the suggestions they saw, as their editors report it (never sent anywhere).
        self.suggestion_counts: dict[str, int] = dict(shown=0, accepted_full=0, accepted_word=0, accepted_line=0,
                                                      dismissed=0)
        self.load_progress: dict[str, Any] | None = None  # progress_report() while loading
        self.workspace: Any = None     # completiond.completion.workspace.Workspace, created on first use
        self._client_folders: dict[Hashable, set[str]] = {}   # workspace folders each editor added

    # --- engine lifecycle ---------------------------------------------------

    def start_loading(self) -> None:
        """Load the engine on the worker thread (queued jobs wait behind it)."""
        self.loop = self.loop or asyncio.get_running_loop()
        self.load_progress = progress_report("starting", 0)
        self.load_warnings = []
        self._cancel_calibration()
        self._set_state("loading")

        def progress(phase: str, percentage: int, message: str | None = None) -> None:
            self._call_soon(self._set_progress, phase, percentage, message)

        def warn(message: str) -> None:
            self._call_soon(self._add_warning, message)

        def load() -> Completer:
            completer = self._loader(self.cfg, progress=progress, warn=warn)
            # Set here, on the worker, not in _loaded: jobs queued behind the load run before the loop gets to it.
            self.completer = completer
            return completer

        def done(outcome: Outcome) -> None:
            self._call_soon(self._loaded, outcome)

        self.scheduler.call(load, done)

    def _set_progress(self, phase: str, percentage: int, message: str | None = None) -> None:
        if self.state == "loading":
            self.load_progress = progress_report(phase, percentage, message)
            self._broadcast()

    def _add_warning(self, message: str) -> None:
        if message not in self.load_warnings:
            self.load_warnings.append(message)
            self._broadcast()

    # --- background calibration ------------------------------------------------

    def _maybe_calibrate(self) -> None:
        """On the loop, after a load: calibrate a model that has neither a user record nor shipped defaults,
        on the engine thread whenever no request waits (a request preempts it within one round)."""
        if self.completer is None:
            return
        job = self.completer.background_calibration(
            self.calibrate_min_params, on_done=lambda message: self._call_soon(self._calibrated, job, message))
        if job is None:
            return
        self.calibration_job = job
        self.calibration_message = f"calibrating {self.model_name} in the background (suggestions are served meanwhile)"
        log.info("%s", self.calibration_message)
        self.scheduler.set_idle(job.step)

    def _calibration_status(self) -> dict | None:
        job = self.calibration_job
        if job is None:
            return None
        state = job.state  # read first: a job that has ended has its message already (it is set before)
        ended = state not in ("pending", "running")
        return {"state": state, "message": job.message if ended and job.message else self.calibration_message}

    def _calibrated(self, job: Any, message: str) -> None:
        if job is self.calibration_job:
            self.calibration_message = message
            self._broadcast()

    def _cancel_calibration(self) -> None:
        job, self.calibration_job = self.calibration_job, None
        if job is not None:
            job.cancel()
            self.scheduler.set_idle(None)
            self.calibration_message = ""

    def _loaded(self, outcome: Outcome) -> None:
        self.load_progress = None
        if outcome.status == OK:
            completer: Completer = outcome.value
            self.completer = completer
            self.model_id = completer.model_id or str(self.cfg.model)
            self.model_name = completer.name or self.model_id
            self.stats_counts["loads"] += 1
            self.error = ""
            log.info("model %s ready on %s", self.model_name, completer.device)
            self._set_state("ready")
            self._maybe_calibrate()
        else:
            what = (f"backend {self.cfg.backend} ({self.cfg.endpoint or 'no endpoint'})" if self.cfg.backend != "local"
                    else f"model {config_mod.model_label(self.cfg.model)}")
            self.error = f"cannot load {what}: {outcome.value}"
            log.error("%s", self.error)
            self._set_state("error")

    def _call_soon(self, fn: Callable, *args: Any) -> None:
        loop = self.loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed while shutting down
            pass

    def _set_state(self, state: str) -> None:
        if state != self.state:
            self.state = state
            self._broadcast()

    def _broadcast(self) -> None:
        status = self.status()
        for listener in list(self.listeners):
            try:
                listener(status)
            except Exception:
                log.exception("status listener failed")

    def status(self) -> dict[str, Any]:
        described = self.completer.describe() if self.completer is not None else {}
        return {
            "state": self.state,
            "error": self.error,
            # A name users recognise (directory, hub id@revision), never the identity hash (model_id).
            "model": self.model_name or config_mod.model_label(self.cfg.model),
            "model_id": self.model_id,
            "warnings": list(self.load_warnings),
            "calibration": self._calibration_status(),
            "device": self.completer.device if self.completer is not None else self.cfg.device,
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started, 1),
            "queued": self.scheduler.queued(),
            "progress": self.load_progress,
            "last_latency_ms": self.last.get("latency_ms"),
            # Of the last request: None when it drafted nothing / generated nothing (not measured, not 0).
            "draft_acceptance": self.last.get("draft_acceptance"),
            "tokens_per_s": self.last.get("tokens_per_s"),
            # How the engine drafts by default (calibrated), and what the last request's rounds drafted with.
            "draft": described.get("draft"),
            "decode_step": described.get("decode_step"),
            "tokenizer": described.get("tokenizer"),
            "last_draft": self.last.get("draft"),
            "suggestions": dict(self.suggestion_counts),
            "engine_settings": config_mod.engine_settings(self.cfg),
        }

    def stats(self) -> dict[str, Any]:
        with self._stats_lock:
            counts = dict(self.stats_counts)
        prompt = counts["prompt_tokens"]
        tested = counts["draft_accepted"] + counts["draft_rejected"]
        superseded = counts["superseded"] + counts["cancelled"]
        return {
            **counts,
            "cache_served_fraction": (counts["reused_tokens"] / prompt) if prompt else None,
            # Per-token acceptance of draft tokens over every request so far (the engine's α).
            "draft_acceptance": (counts["draft_accepted"] / tested) if tested else None,
            "wasted_rounds_per_superseded": (counts["wasted_rounds"] / superseded) if superseded else 0.0,
            "rounds_after_cancel_per_superseded": (counts["rounds_after_cancel"] / superseded) if superseded else 0.0,
            "scheduler": self.scheduler.snapshot(),
            "status": self.status(),
            "documents": len(self.documents),
            "workspace_files": len(self.workspace.paths()) if self.workspace is not None else 0,
            "context_changes": self.workspace.block_changes if self.workspace is not None else 0,
            "index": self.workspace.index_status() if self.workspace is not None else None,
        }

    def shutdown(self) -> None:
        if self.calibration_job is not None:
            self.calibration_job.cancel()
        self.scheduler.stop()
        if self.workspace is not None:
            self.workspace.stop()

    # --- workspace context ------------------------------------------------------

    def _ws(self) -> Any:
        if self.workspace is None:
            from completiond.completion.workspace import Workspace

            self.workspace = Workspace()
        return self.workspace

    def add_folders(self, client: Hashable, folders: list[str], removed: list[str] = ()) -> None:
        """Workspace folders of one editor: watched for the context block of that editor's prompts only.
        Set-up (checks, watches, scans) runs on the workspace's I/O thread, not here on the event loop."""
        ws = self._ws()
        # Counted here, synchronously: the workspace registers folders later, on its I/O thread.
        mine = self._client_folders.setdefault(client, set())
        for folder in removed:
            mine.discard(os.path.abspath(folder))
            ws.remove_folder(folder, owner=client, wait=False)
        for folder in folders:
            folder = os.path.abspath(folder)
            if folder in mine:
                continue
            if len(mine) >= MAX_FOLDERS:
                log.warning("workspace folder %s ignored: an editor may add at most %d", folder, MAX_FOLDERS)
                continue
            mine.add(folder)
            ws.add_folder(folder, owner=client, wait=False)
        if folders:
            ws.start(wait=False)

    def _ws_update(self, client: Hashable, uri: str, doc: Document | None, edit_start: int | None = None) -> None:
        path = _uri_path(uri)
        if path is None:
            return
        try:
            if doc is None:
                self._ws().did_close(path, owner=client)
            elif edit_start is None:
                self._ws().did_open(path, doc.text, doc.language_id or None, owner=client)
            else:
                self._ws().did_change(path, doc.text, edit_line=doc.text.count("\n", 0, edit_start),
                                      language=doc.language_id or None, owner=client)
        except (OSError, ValueError) as exc:  # context is a nicety: never fail the edit for it
            log.debug("workspace update for %s failed: %s", uri, exc)

    def _admission(self, client: Hashable, cfg: Config, path: str | None) -> Any:
        """The privacy gate's verdict on a document of `client` (privacy.classify: its folders, ignore rules
        and contextExclude). Folders the editor announced count before the workspace has set them up."""
        return self._ws().admission(path, owner=client, exclude=_exclude_patterns(cfg),
                                    roots=self._client_folders.get(client, ()))

    def _context(self, client: Hashable, cfg: Config, path: str | None, language: str | None, text: str | None = None,
                 offset: int | None = None, budgets: tuple[int, int, int] | None = None) -> list[tuple[str, str]]:
        """The context block's files: retrieved for the cursor (contextRetrieval on) or recent snippets.
        budgets: the prompt's (prefix, suffix, context) token budgets, where a prompt builder knows them."""
        if self.workspace is None or not path or not cfg.workspace_context or cfg.context_tokens <= 0:
            return []
        count = self.completer.token_counter() if self.completer is not None else None
        prefix_budget, suffix_budget, budget = budgets or (cfg.prefix_tokens, cfg.suffix_tokens, cfg.context_tokens)
        mode = "retrieval" if getattr(cfg, "context_retrieval", "off") == "on" else "recent"
        try:
            return self.workspace.context(path, language, budget, count, owner=client,
                                          exclude=_exclude_patterns(cfg), text=text, offset=offset, mode=mode,
                                          window_tokens=(prefix_budget, suffix_budget))
        except (OSError, ValueError) as exc:
            log.debug("workspace context for %s failed: %s", path, exc)
            return []

    # --- documents -----------------------------------------------------------

    def open(self, client: Hashable, uri: str, version: int, text: str, language_id: str = "") -> None:
        doc = Document(uri=uri, text=text, version=version, language_id=language_id)
        self.documents[(client, uri)] = doc
        self._ws_update(client, uri, doc)

    def change(self, client: Hashable, uri: str, version: int, edits: list) -> None:
        doc = self.documents.get((client, uri))
        if doc is None:
            raise ServiceError(Code.UNKNOWN_DOCUMENT, f"{uri} is not open")
        try:
            doc.apply_edits([tuple(e) if isinstance(e, list) else e for e in edits], version)
        except EditError as exc:
            # Out of sync: forget it, so the next completion asks the client to resend it whole.
            del self.documents[(client, uri)]
            raise ServiceError(Code.UNKNOWN_DOCUMENT, f"{uri}: {exc}; resend the document") from None
        if edits:
            first = edits[0]
            self._ws_update(client, uri, doc, first[0] if isinstance(first[0], int) else 0)

    def close(self, client: Hashable, uri: str) -> None:
        if self.documents.pop((client, uri), None) is not None:
            self._ws_update(client, uri, None)

    def drop_client(self, client: Hashable) -> None:
        self.scheduler.cancel_client(client)
        for key in [k for k in self.documents if k[0] == client]:
            del self.documents[key]
        self._client_folders.pop(client, None)
        if self.workspace is not None:
            self.workspace.drop_owner(client)  # its open documents, and its folders unless another editor has them

    # --- the one dispatch every front end uses --------------------------------------

    def notify(self, client: Hashable, method: str, params: dict[str, Any]) -> None:
        """A notification (nobody to answer). Raises ServiceError for a bad method or bad params."""
        try:
            if method == "cancel":
                self.cancel(client, _int(params, "id"))
            elif method == "open":
                language = params.get("languageId") or ""
                if not isinstance(language, str):
                    raise TypeError("languageId must be a string")
                self.open(client, _str(params, "uri"), _int(params, "version"), _str(params, "text"), language)
            elif method == "change":
                edits = params.get("edits")
                if not isinstance(edits, list):
                    raise TypeError("edits must be a list")
                self.change(client, _str(params, "uri"), _int(params, "version"), edits)
            elif method == "close":
                self.close(client, _str(params, "uri"))
            elif method == "suggestion":
                self.count_suggestion(_str(params, "event"), params.get("kind"))
            elif method == "workspace":
                folders = params.get("folders") or []
                removed = params.get("removed") or []
                if not all(isinstance(x, list) and all(isinstance(f, str) for f in x) for x in (folders, removed)):
                    raise TypeError("folders and removed must be lists of paths")
                self.add_folders(client, folders, removed)
            else:
                raise ServiceError(Code.UNKNOWN_METHOD, f"unknown notification {method!r}")
        except (KeyError, TypeError, ValueError) as exc:
            raise ServiceError(Code.BAD_REQUEST, f"{method}: bad params: {_reason(exc)}") from None

    async def request(self, client: Hashable, request_id: Hashable, method: str, params: dict[str, Any]) -> Any:
        """A request; its answer, or ServiceError (bad params included) with the code the client sees."""
        if method == "complete":
            try:
                uri, version, offset = _str(params, "uri"), _int(params, "version"), _int(params, "offset")
            except (KeyError, TypeError) as exc:
                raise ServiceError(Code.BAD_REQUEST, f"complete: bad params: {_reason(exc)}") from None
            settings = params.get("settings")
            return await self.complete(client, request_id, uri, version, offset,
                                       settings if isinstance(settings, dict) else None)
        if method == "ping":
            return "pong"
        if method == "status":
            return self.status()
        if method == "stats":
            return self.stats()
        if method in ("open", "change", "close", "cancel", "workspace", "suggestion"):
            self.notify(client, method, params)
            return None
        raise ServiceError(Code.UNKNOWN_METHOD, f"unknown method {method!r}")

    def count_suggestion(self, event: str, kind: Any = None) -> None:
        """An editor showed, accepted (kind: full / word / line) or dismissed a suggestion."""
        key = {("shown", None): "shown", ("dismissed", None): "dismissed", ("accepted", "full"): "accepted_full",
               ("accepted", "word"): "accepted_word", ("accepted", "line"): "accepted_line"}.get((event, kind))
        if key is None:
            raise ValueError(f"unknown suggestion event {event!r} (kind {kind!r}); expected shown, dismissed, "
                             "or accepted with kind full, word or line")
        self.suggestion_counts[key] += 1
        if key != "shown":  # shown arrives with every suggestion, right after the status that carried it
            self._broadcast()

    # --- completion ---------------------------------------------------------

    def cancel(self, client: Hashable, request_id: Hashable) -> None:
        self.scheduler.cancel((client, request_id))

    async def complete(self, client: Hashable, request_id: Hashable, uri: str, version: int, offset: int,
                       settings: dict[str, Any] | None = None) -> dict[str, Any]:
        self.loop = self.loop or asyncio.get_running_loop()
        with self._stats_lock:
            self.stats_counts["requests"] += 1
        doc = self.documents.get((client, uri))
        if doc is None or doc.version != version:
            have = "not open" if doc is None else f"at version {doc.version}"
            raise ServiceError(Code.UNKNOWN_DOCUMENT, f"{uri} version {version} requested but the daemon has it {have}")
        if not 0 <= offset <= len(doc.text):
            raise ServiceError(Code.BAD_REQUEST, f"offset {offset} outside {uri} ({len(doc.text)} characters)")
        if self.state == "error":
            raise ServiceError(Code.NOT_READY, self.error)
        cfg, _errors = config_mod.merge(self.cfg, {k: v for k, v in (settings or {}).items() if k not in config_mod.ENGINE_KEYS})
        text, path, language = doc.text, _uri_path(uri), doc.language_id or None
        gate_path = _gate_path(uri)
        tree = doc.syntax() if getattr(cfg, "syntax_check", True) else None   # parsed on the worker, incrementally
        future: asyncio.Future = self.loop.create_future()
        loop = self.loop

        def deliver(outcome: Outcome) -> None:
            self._account(outcome)
            self._call_soon(self._after_job)
            if not loop.is_closed():
                loop.call_soon_threadsafe(lambda: future.done() or future.set_result(outcome))

        job = Job(key=(client, uri), client=client, request_id=(client, request_id),
                  run=lambda token: self._run(text, offset, cfg, token, path, language, client, gate_path=gate_path,
                                              tree=tree),
                  done=deliver)
        try:
            self.scheduler.submit(job)
        except Overloaded as exc:
            with self._stats_lock:
                self.stats_counts["rejected"] += 1
            raise ServiceError(Code.OVERLOADED, str(exc)) from None
        except ShuttingDown as exc:
            raise ServiceError(Code.SHUTTING_DOWN, str(exc)) from None
        # The worker also expires queued jobs before each one it runs, but not while it is busy with a long one.
        expiry = loop.call_later(self.scheduler.queue_deadline, self.scheduler.expire)
        try:
            outcome: Outcome = await future
        except asyncio.CancelledError:
            self.scheduler.cancel((client, request_id))
            raise
        finally:
            expiry.cancel()
        if outcome.status == CANCELLED and outcome.reason == "expired":
            raise ServiceError(Code.OVERLOADED, f"the request waited {self.scheduler.queue_deadline:g} s in the queue "
                                                "behind other requests and was dropped; the daemon is busy, try again")
        if outcome.status == CANCELLED:
            reason = {"superseded": "superseded by a newer request for this document",
                      "shutdown": "the daemon is shutting down"}.get(outcome.reason, "cancelled")
            raise ServiceError(Code.CANCELLED, reason)
        if outcome.status == ERROR:
            exc = outcome.value
            if isinstance(exc, CompletionError):
                raise ServiceError(Code.ENGINE_ERROR, str(exc))
            if self.completer is None:
                raise ServiceError(Code.NOT_READY, self.error or f"model not loaded: {exc}")
            raise ServiceError(Code.INTERNAL, f"completion failed: {type(exc).__name__}: {exc}")
        result = dict(outcome.value)
        result["version"] = version
        return result

    def _run(self, text: str, offset: int, cfg: Config, token: Any, path: str | None = None,
             language: str | None = None, client: Hashable = None, gate_path: str | None = None,
             tree: Any = None) -> dict[str, Any]:
        """On the worker thread: one completion from whatever completes (the one pipeline, completion/completer.py)."""
        from completiond.completion.completer import suggest

        # The privacy gate (completion/privacy.py) on the document itself, before any engine or server sees it.
        verdict = self._admission(client, cfg, gate_path or path)
        if not verdict.local_ok:
            return _withheld(f"no completions: {verdict.reason}")
        completer = self.completer
        if completer is None:
            raise RuntimeError(self.error or "model not loaded")
        if completer.backend is not Backend.LOCAL and not verdict.remote_ok:
            return _withheld(f"not sent to the completion server ({cfg.backend}): {verdict.reason}; "
                             "such files get local completions only (backend = local)")
        start = time.perf_counter()
        self._call_soon(self._set_state, "busy")
        context = self._context(client, cfg, path, language, text, offset, completer.budgets(cfg))
        done = suggest(completer, text, offset, cfg, cancel=token, path=path, language=language, context=context,
                       tree=tree.tree(text) if tree is not None else None)   # tree: the document's DocumentTree
        latency = round((time.perf_counter() - start) * 1000, 2)
        if done.skipped:  # nothing to complete here (e.g. a minified line): no engine work
            return {"suggestion": None, "suggestions": [], "finish_reason": "skipped", "stats": {},
                    "latency_ms": latency, "warnings": done.warnings}
        suggestions = [{"text": s.text, "start": s.start, "end": s.end, "multiline": s.multiline}
                       for s in done.suggestions]
        result = {
            "warnings": done.warnings,
            "suggestion": suggestions[0] if suggestions else None,  # the best; older clients read only this
            "suggestions": suggestions,  # up to cfg.alternatives, best first, all different
            "finish_reason": done.finish_reason,
            "stats": done.stats,
            "latency_ms": latency,
        }
        if done.withheld and not suggestions:
            result["withheld"] = done.withheld   # the model made one; the syntax check kept it back, and why
        return result

    def _after_job(self) -> None:
        if self.state in ("busy", "ready"):
            # Broadcast even when still busy: the last latency / alpha changed.
            self.state = "busy" if self.scheduler.busy else "ready"
            self._broadcast()

    def _account(self, outcome: Outcome) -> None:
        """Worker thread or loop: fold one finished job into the counters."""
        value = outcome.value if isinstance(outcome.value, dict) else None
        stats = (value or {}).get("stats") or {}
        with self._stats_lock:
            c = self.stats_counts
            if value is not None:
                c["rounds"] += stats.get("rounds", 0) or 0
                c["prompt_tokens"] += stats.get("prompt_tokens", 0) or 0
                c["reused_tokens"] += stats.get("reused_tokens", 0) or 0
                c["generated_tokens"] += stats.get("generated_tokens", 0) or 0
                c["draft_accepted"] += stats.get("accepted", 0) or 0
                c["draft_rejected"] += stats.get("rejected", 0) or 0
                c["history_accepted"] += stats.get("history_accepted", 0) or 0
            if outcome.status == OK:
                c["completed"] += 1
                c["latency_ms_sum"] += (value or {}).get("latency_ms", 0) or 0
                if value and value.get("suggestion") is None:
                    c["empty"] += 1
                if value and value.get("withheld"):
                    c["withheld_syntax"] += 1
                measured = stats.get("generated_tokens") and stats.get("decode_ms")
                self.last = {"latency_ms": value.get("latency_ms") if value else None,
                             "draft_acceptance": stats.get("alpha") if stats.get("drafted") else None,
                             "tokens_per_s": stats.get("tokens_per_s") if measured else None,
                             "draft": _last_draft(stats)}
            elif outcome.status == CANCELLED:
                # Rounds run for a request nobody will see: superseded by a newer one, or
                # cancelled by the editor (which, while typing, is the same thing).
                c["wasted_rounds"] += stats.get("rounds", 0) or 0
                c["rounds_after_cancel"] += stats.get("rounds_after_cancel", 0) or 0
                c[outcome.reason if outcome.reason in ("superseded", "expired") else "cancelled"] += 1
            else:
                c["errors"] += 1


def _last_draft(stats: dict[str, Any]) -> str | None:
    """What the request's rounds drafted with: the model draft, prompt lookup, both, or None (no drafting)."""
    parts = []
    if (stats.get("drafted", 0) or 0) > (stats.get("lookup_drafted", 0) or 0):
        parts.append(str(stats.get("draft") or "early_exit"))
    if stats.get("lookup_drafted"):
        parts.append("prompt_lookup")
    if stats.get("history_rounds"):
        parts.append("output_history")
    return "+".join(parts) or None


def _uri_path(uri: str) -> str | None:
    if uri.startswith("file://"):
        from urllib.parse import unquote, urlparse

        return unquote(urlparse(uri).path)
    return None


def _gate_path(uri: str) -> str | None:
    """The path the privacy gate judges: a file's, and another scheme's too (a `git:` diff of `.env` is
    the deny-listed file all the same, and outside the workspace folders); None for an untitled buffer."""
    from urllib.parse import unquote, urlparse

    path = unquote(urlparse(uri).path)
    return path if path.startswith("/") else None


def _withheld(message: str) -> dict[str, Any]:
    """The answer for a document the privacy gate keeps from the model in use: no suggestion, and why
    (the editor tells the user once per file)."""
    return {"suggestion": None, "suggestions": [], "finish_reason": "excluded", "stats": {}, "latency_ms": 0.0,
            "warnings": [message]}


def _exclude_patterns(cfg: Config) -> list[str]:
    return [p for p in str(getattr(cfg, "context_exclude", "") or "").split(",") if p.strip()]


def _int(params: dict[str, Any], key: str) -> int:
    value = params[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{key} must be an integer, got {type(value).__name__}")
    return value


def _str(params: dict[str, Any], key: str) -> str:
    value = params[key]
    if not isinstance(value, str):
        raise TypeError(f"{key} must be a string, got {type(value).__name__}")
    return value


def _reason(exc: BaseException) -> str:
    return f"missing {exc}" if isinstance(exc, KeyError) else str(exc)
