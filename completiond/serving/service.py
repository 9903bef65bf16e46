"""The service: documents, the scheduler and what completes, behind one dispatch.

`Service` knows nothing about sockets. Every front end goes through the same two entry points,
`notify(client, method, params)` and `request(client, method, params)`: the daemon's socket server
(server.py) for each connection, and `completiond lsp --no-daemon` in-process. So a method is parsed and
validated in one place, and both paths behave the same. Its parts, one module each: lifecycle.py (loading
the Completer, state, background calibration), documents.py (open documents, the workspace and its
privacy gate), metrics.py (counters); this module is the dispatch and the completion request itself.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Hashable
from typing import Any

from completiond import config as config_mod
from completiond.config import Config
from completiond.backends.team_server import TeamServerError
from completiond.completion.completer import Backend, Completer
from completiond.completion.documents import Document
from completiond.errors import CompletionError
from completiond.serving.documents import Documents, OutOfSync, gate_path, uri_path
from completiond.serving.lifecycle import Lifecycle, Loader, load_completer
from completiond.serving.language_fit import language_unserved
from completiond.serving.metrics import Metrics
from completiond.serving.params import int_param, reason, str_param
from completiond.serving.prefetch import Key, Prefetcher, make_warmup
from completiond.serving.results import Results
from completiond.serving.results import key as result_key
from completiond.serving.scheduler import CANCELLED, ERROR, Job, Outcome, Overloaded, Scheduler, ShuttingDown
from completiond.serving.wire import Code

log = logging.getLogger(__name__)

QUEUE_DEADLINE = 10.0  # seconds a completion may wait in the queue: the editor has long moved on by then


class ServiceError(CompletionError):
    """A request the service refuses; `code` is the wire error code the client sees."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class Service:
    """Lifecycle + documents + metrics behind one dispatch. All public methods run on the event loop thread."""

    def __init__(
        self,
        cfg: Config,
        loader: Loader = load_completer,
        max_pending_per_client: int = 16,
        queue_deadline: float = QUEUE_DEADLINE,
        calibrate_min_params: int | None = None,
    ):
        self.cfg = cfg
        self.scheduler = Scheduler(max_pending_per_client=max_pending_per_client, queue_deadline=queue_deadline)
        self.metrics = Metrics()
        self.docs = Documents()
        self.lifecycle = Lifecycle(
            lambda: self.cfg,
            loader,
            self.scheduler,
            changed=self._broadcast,
            loaded=lambda: self.metrics.add("loads"),
            calibrate_min_params=calibrate_min_params,
        )
        self.listeners: list[Callable[[dict[str, Any]], None]] = []
        self.started = time.time()
        # Background prefills of what documents' next requests start with (prefetch.py), with the settings of
        # each editor's last request, so that they warm what its next one reads.
        self.prefetch = Prefetcher(self.scheduler, self._warmup, lambda: self.lifecycle.loop)
        self.results = Results()  # the last answers, for a request asking again what was answered
        self._last_cfg: dict[Hashable, Config] = {}

    # --- what the parts hold, as front ends and tools read it -------------------------

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        return self.lifecycle.loop

    @loop.setter
    def loop(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self.lifecycle.loop = loop

    @property
    def state(self) -> str:
        return self.lifecycle.state

    @property
    def error(self) -> str:
        return self.lifecycle.error

    @property
    def completer(self) -> Completer | None:
        return self.lifecycle.completer

    @property
    def documents(self) -> dict[tuple[Hashable, str], Document]:
        return self.docs.documents

    @property
    def workspace(self) -> Any:
        return self.docs.workspace

    # --- lifecycle ------------------------------------------------------------------

    def start_loading(self) -> None:
        """Load the completer on the worker thread (queued jobs wait behind it)."""
        self.lifecycle.start_loading()

    def shutdown(self) -> None:
        self.prefetch.stop()
        self.lifecycle.shutdown()
        self.scheduler.stop()
        self.docs.stop()

    def _broadcast(self) -> None:
        status = self.status()
        for listener in list(self.listeners):
            try:
                listener(status)
            except Exception:
                log.exception("status listener failed")

    def _after_job(self) -> None:
        if self.state in ("busy", "ready"):
            # Broadcast even when still busy: the last latency / alpha changed.
            self.lifecycle.state = "busy" if self.scheduler.busy else "ready"
            self._broadcast()

    def status(self) -> dict[str, Any]:
        life = self.lifecycle
        completer = life.completer
        described = completer.describe() if completer is not None else {}
        last = self.metrics.last_request()
        return {
            "state": life.state,
            "error": life.error,
            # A name users recognise (directory, hub id@revision), never the identity hash (model_id).
            "model": life.model_name or config_mod.model_label(self.cfg.model),
            "model_id": life.model_id,
            "warnings": list(life.load_warnings),
            "calibration": life.calibration_status(),
            "device": completer.device if completer is not None else self.cfg.device,
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started, 1),
            "queued": self.scheduler.queued(),
            "progress": life.load_progress,
            "last_latency_ms": last["last_latency_ms"],
            # Of the last request: None when it drafted nothing / generated nothing (not measured, not 0).
            "draft_acceptance": last["draft_acceptance"],
            "tokens_per_s": last["tokens_per_s"],
            # How the engine drafts by default (calibrated), and what the last request's rounds drafted with.
            "draft": described.get("draft"),
            "decode_step": described.get("decode_step"),
            "tokenizer": described.get("tokenizer"),
            "last_draft": last["last_draft"],
            "suggestions": dict(self.metrics.suggestions),
            "engine_settings": config_mod.engine_settings(self.cfg),
        }

    def stats(self) -> dict[str, Any]:
        workspace = self.docs.workspace
        return {
            **self.metrics.summary(),
            "scheduler": self.scheduler.snapshot(),
            "kv_cache": self._cache_stats(),
            "prefetch": self.prefetch.stats(),
            "status": self.status(),
            "documents": len(self.docs.documents),
            "workspace_files": len(workspace.paths()) if workspace is not None else 0,
            "context_changes": workspace.block_changes if workspace is not None else 0,
            "index": workspace.index_status() if workspace is not None else None,
        }

    def _cache_stats(self) -> dict[str, Any] | None:
        try:
            return self.completer.cache_stats() if self.completer is not None else None
        except RuntimeError:  # the worker changed the cache while it was read
            return None

    # --- documents ---------------------------------------------------------------------

    def open(self, client: Hashable, uri: str, version: int, text: str, language_id: str = "") -> None:
        self.docs.open(client, uri, version, text, language_id)
        self.prefetch.note((client, uri), None)

    def change(self, client: Hashable, uri: str, version: int, edits: list) -> None:
        try:
            self.docs.change(client, uri, version, edits)
        except OutOfSync as exc:
            self.prefetch.forget((client, uri))
            raise ServiceError(Code.UNKNOWN_DOCUMENT, str(exc)) from None
        last = edits[-1] if edits else None  # [start, end, text]: the cursor is after the last edit's text
        if isinstance(last, (list, tuple)) and len(last) == 3 and isinstance(last[0], int) and isinstance(last[2], str):
            self.prefetch.touch((client, uri), last[0] + len(last[2]))

    def rest(self, client: Hashable, uri: str, version: int, offset: int, settings: Any = None) -> None:
        """The editor's cursor rests at `offset` (our plugins say so): warm the prompts around it now, with the
        editor's settings when sent. A hint: a document at another version or not open is left alone."""
        doc = self.docs.get(client, uri)
        if doc is None or doc.version != version or not 0 <= offset <= len(doc.text):
            return
        if isinstance(settings, dict):
            if config_mod.route_refusal(settings, self.cfg):
                return
            self._last_cfg[client] = config_mod.request_config(self.cfg, settings)
        self.prefetch.note((client, uri), offset)

    def close(self, client: Hashable, uri: str) -> None:
        self.prefetch.forget((client, uri))
        self.docs.close(client, uri)

    def drop_client(self, client: Hashable) -> None:
        self.scheduler.cancel_client(client)
        self.prefetch.forget_client(client)
        self._last_cfg.pop(client, None)
        self.docs.drop_client(client)

    def _warmup(self, key: Key, offset: int | None) -> Any:
        """Worker thread: the prefetch of `key` with the settings of its editor's last request (or rest); around a
        cursor, the answer there too (prefetch.AnswerAhead)."""
        cfg = self._last_cfg.get(key[0], self.cfg)
        return make_warmup(self.docs, self.completer, cfg, key, offset, language_unserved, run=self._run)

    def count_suggestion(self, event: str, kind: Any = None) -> None:
        """An editor showed, accepted (kind: full / word / line) or dismissed a suggestion."""
        if self.metrics.count_suggestion(event, kind) != "shown":
            self._broadcast()  # shown arrives with every suggestion, right after the status that carried it

    # --- the one dispatch every front end uses --------------------------------------

    def notify(self, client: Hashable, method: str, params: dict[str, Any]) -> None:
        """A notification (nobody to answer). Raises ServiceError for a bad method or bad params."""
        try:
            if method == "cancel":
                self.cancel(client, int_param(params, "id"))
            elif method == "open":
                language = params.get("languageId") or ""
                if not isinstance(language, str):
                    raise TypeError("languageId must be a string")
                self.open(
                    client, str_param(params, "uri"), int_param(params, "version"), str_param(params, "text"), language
                )
            elif method == "change":
                edits = params.get("edits")
                if not isinstance(edits, list):
                    raise TypeError("edits must be a list")
                self.change(client, str_param(params, "uri"), int_param(params, "version"), edits)
            elif method == "close":
                self.close(client, str_param(params, "uri"))
            elif method == "rest":
                self.rest(
                    client,
                    str_param(params, "uri"),
                    int_param(params, "version"),
                    int_param(params, "offset"),
                    params.get("settings"),
                )
            elif method == "suggestion":
                self.count_suggestion(str_param(params, "event"), params.get("kind"))
            elif method == "workspace":
                folders = params.get("folders") or []
                removed = params.get("removed") or []
                if not all(isinstance(x, list) and all(isinstance(f, str) for f in x) for x in (folders, removed)):
                    raise TypeError("folders and removed must be lists of paths")
                self.docs.add_folders(client, folders, removed)
            else:
                raise ServiceError(Code.UNKNOWN_METHOD, f"unknown notification {method!r}")
        except (KeyError, TypeError, ValueError) as exc:
            raise ServiceError(Code.BAD_REQUEST, f"{method}: bad params: {reason(exc)}") from None

    async def request(self, client: Hashable, request_id: Hashable, method: str, params: dict[str, Any]) -> Any:
        """A request; its answer, or ServiceError (bad params included) with the code the client sees."""
        if method == "complete":
            try:
                uri, version, offset = (
                    str_param(params, "uri"),
                    int_param(params, "version"),
                    int_param(params, "offset"),
                )
            except (KeyError, TypeError) as exc:
                raise ServiceError(Code.BAD_REQUEST, f"complete: bad params: {reason(exc)}") from None
            settings = params.get("settings")
            # Never a remote answer for an editor whose own settings did not choose that server (issue 43).
            refusal = config_mod.route_refusal(settings if isinstance(settings, dict) else None, self.cfg)
            if refusal:
                raise ServiceError(Code.NOT_READY, refusal)
            return await self.complete(
                client, request_id, uri, version, offset, settings if isinstance(settings, dict) else None
            )
        if method == "ping":
            return "pong"
        if method == "status":
            return self.status()
        if method == "stats":
            return self.stats()
        if method in ("open", "change", "close", "rest", "cancel", "workspace", "suggestion"):
            self.notify(client, method, params)
            return None
        raise ServiceError(Code.UNKNOWN_METHOD, f"unknown method {method!r}")

    # --- completion ---------------------------------------------------------

    def cancel(self, client: Hashable, request_id: Hashable) -> None:
        self.scheduler.cancel((client, request_id))

    async def complete(
        self,
        client: Hashable,
        request_id: Hashable,
        uri: str,
        version: int,
        offset: int,
        settings: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        loop = self.lifecycle.loop = self.lifecycle.loop or asyncio.get_running_loop()
        self.metrics.add("requests")
        doc = self.docs.get(client, uri)
        if doc is None or doc.version != version:
            have = "not open" if doc is None else f"at version {doc.version}"
            raise ServiceError(Code.UNKNOWN_DOCUMENT, f"{uri} version {version} requested but the daemon has it {have}")
        if not 0 <= offset <= len(doc.text):
            raise ServiceError(Code.BAD_REQUEST, f"offset {offset} outside {uri} ({len(doc.text)} characters)")
        if self.state == "error" and not self.lifecycle.remote_down:
            raise ServiceError(Code.NOT_READY, self.error)
        cfg = config_mod.request_config(self.cfg, settings)
        text, path, language = doc.text, uri_path(uri), doc.language_id or None
        gated = gate_path(uri)
        tree = doc.syntax() if getattr(cfg, "syntax_check", True) else None  # parsed on the worker, incrementally
        future: asyncio.Future = loop.create_future()

        def deliver(outcome: Outcome) -> None:
            self.metrics.account(outcome)
            if not loop.is_closed():  # the answer first, then the status broadcast
                loop.call_soon_threadsafe(settle, outcome)
            self.lifecycle.call_soon(self._after_job)

        def settle(outcome: Outcome) -> None:
            if not future.done():
                future.set_result(outcome)

        job = Job(
            key=(client, uri),
            client=client,
            request_id=(client, request_id),
            run=lambda token: self._run(text, offset, cfg, token, path, language, client, gate_path=gated, tree=tree),
            done=deliver,
        )
        self._last_cfg[client] = cfg
        self.prefetch.touch((client, uri), offset)  # stale now; warmed around here once the user rests
        try:
            self.scheduler.submit(job)
        except Overloaded as exc:
            self.metrics.add("rejected")
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
            self.prefetch.touch((client, uri), offset)  # the timer runs from the answer: not while typing on
        if outcome.status == CANCELLED and outcome.reason == "expired":
            raise ServiceError(
                Code.OVERLOADED,
                f"the request waited {self.scheduler.queue_deadline:g} s in the queue "
                "behind other requests and was dropped; the daemon is busy, try again",
            )
        if outcome.status == CANCELLED:
            reason = {
                "superseded": "superseded by a newer request for this document",
                "shutdown": "the daemon is shutting down",
            }.get(outcome.reason, "cancelled")
            raise ServiceError(Code.CANCELLED, reason)
        if outcome.status == ERROR:
            failure = outcome.value
            if isinstance(failure, CompletionError):
                raise ServiceError(Code.ENGINE_ERROR, str(failure))
            if self.completer is None:
                raise ServiceError(Code.NOT_READY, self.error or f"model not loaded: {failure}")
            raise ServiceError(Code.INTERNAL, f"completion failed: {type(failure).__name__}: {failure}")
        result = dict(outcome.value)
        result["version"] = version
        return result

    def _run(
        self,
        text: str,
        offset: int,
        cfg: Config,
        token: Any,
        path: str | None = None,
        language: str | None = None,
        client: Hashable = None,
        gate_path: str | None = None,
        tree: Any = None,
    ) -> dict[str, Any]:
        """On the worker thread: one completion from whatever completes (the one pipeline, completion/completer.py)."""
        from completiond.completion.completer import suggest

        # The privacy gate (completion/privacy.py) on the document itself, before any engine or server sees it.
        verdict = self.docs.admission(client, cfg, gate_path or path)
        if not verdict.local_ok:
            return _withheld(f"no completions: {verdict.reason}")
        completer = self.completer
        if completer is None:
            raise RuntimeError(self.error or "model not loaded")
        unserved = language_unserved(completer, language, path)
        if unserved:
            return _withheld(unserved, reason="language")
        if completer.backend is not Backend.LOCAL and not verdict.remote_ok:
            # Said as it is: this daemon has no local model, so the file gets no completion at all here.
            return _withheld(
                f"no completions for this file: {verdict.reason}, and such files are never sent to the "
                f"completion server ({cfg.backend}); this daemon has no local model for them "
                "(with backend = local they are completed on this machine)"
            )
        start = time.perf_counter()
        remote = completer.backend is not Backend.LOCAL
        self.lifecycle.call_soon(self.lifecycle.job_started)
        context = self.docs.context(
            client, cfg, path, language, text, offset, completer.budgets(cfg), completer.token_counter()
        )
        # The same question answered before (a switch back, an editor asking again): its answer, no model run.
        asked = result_key(text, offset, cfg, path, language, context) if not remote else None
        if asked is not None and (hit := self.results.get(completer, asked)) is not None:
            hit["latency_ms"] = round((time.perf_counter() - start) * 1000, 2)
            hit["stats"] = {"result_cache": True}
            return hit
        # tree: the document's DocumentTree, handed on whole (syntax.site_at): a long document's tree is used as
        # the edits left it (shifted by tree-sitter's edit API, not reparsed: enough to find the construct around
        # the cursor), reparsed incrementally once edits pile up (DocumentTree.shifted), and the construct's own
        # tree is kept across requests, edited along with the document (DocumentTree.region).
        try:
            done = suggest(
                completer, text, offset, cfg, cancel=token, path=path, language=language, context=context, tree=tree
            )
        except TeamServerError as exc:
            if remote and exc.kind != "config":
                self.lifecycle.call_soon(self.lifecycle.remote_failed, str(exc))
            raise
        if remote:
            self.lifecycle.call_soon(self.lifecycle.remote_answered)
        latency = round((time.perf_counter() - start) * 1000, 2)
        if done.skipped:  # nothing to complete here (e.g. a minified line): no engine work
            return {
                "suggestion": None,
                "suggestions": [],
                "finish_reason": "skipped",
                "stats": {},
                "latency_ms": latency,
                "warnings": done.warnings,
            }
        suggestions = [
            {"text": s.text, "start": s.start, "end": s.end, "multiline": s.multiline} for s in done.suggestions
        ]
        result = {
            "warnings": done.warnings,
            "suggestion": suggestions[0] if suggestions else None,  # the best; older clients read only this
            "suggestions": suggestions,  # up to cfg.alternatives, best first, all different
            "finish_reason": done.finish_reason,
            "stats": done.stats,
            "latency_ms": latency,
        }
        if done.withheld and not suggestions:
            result["withheld"] = done.withheld  # the model made one; the syntax check kept it back, and why
        if asked is not None and done.finish_reason != "cancelled" and not getattr(token, "cancelled", False):
            self.results.put(completer, asked, result)
        return result


def _withheld(message: str, reason: str = "excluded") -> dict[str, Any]:
    """The answer for a document the privacy gate keeps from the model in use (or one in a language the model
    does not serve): no suggestion, and why (the editor tells the user once per message)."""
    return {
        "suggestion": None,
        "suggestions": [],
        "finish_reason": reason,
        "stats": {},
        "latency_ms": 0.0,
        "warnings": [message],
    }
