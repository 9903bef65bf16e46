"""`completiond serve`: the per-user daemon that owns the model.

Two layers:

* `Service` holds the documents, the scheduler and the engine. It knows
  nothing about sockets, so `completiond lsp --no-daemon` runs the very same
  code in-process.
* `DaemonServer` exposes a Service on a private Unix socket (see wire.py for
  the protocol and paths.py for the directory checks), tracks clients and
  exits after an idle timeout with none connected.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import itertools
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Hashable

from completiond import config as config_mod
from completiond import paths, wire
from completiond.documents import Document, EditError
from completiond.scheduler import CANCELLED, ERROR, OK, Job, Outcome, Overloaded, Scheduler, ShuttingDown
from completiond.wire import Code

log = logging.getLogger("completiond.daemon")

# Settings that decide which engine is loaded; the rest apply per request.
ENGINE_KEYS = ("model", "device", "dtype", "trustRemoteCode", "cacheMegabytes")
HANDSHAKE_TIMEOUT = 10.0
MAX_FOLDERS = 16  # workspace folders watched per editor


class ServiceError(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class OutOfMemory(Exception):
    """The device ran out of memory during one request (its KV cache has been freed)."""


def _is_oom(exc: BaseException) -> bool:
    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    if oom is not None and isinstance(exc, oom):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()  # MPS, older builds


def load_engine(cfg: Any):
    """Engine.load with the settings of `cfg` (imports torch: call off the event loop)."""
    from completiond.engine import Engine

    cache = cfg.cache_megabytes * 1024 * 1024 if cfg.cache_megabytes else None
    return Engine.load(model=cfg.model or None, device=cfg.device, dtype=cfg.dtype,
                       trust_remote_code=cfg.trust_remote_code, cache_bytes=cache)


def engine_settings(cfg: Any) -> dict[str, Any]:
    full = config_mod.to_settings(cfg)
    return {k: full[k] for k in ENGINE_KEYS}


def _resolve_model(value: str) -> str:
    """Local directories by absolute path, so a daemon started elsewhere finds them."""
    if value and os.path.isdir(value):
        return os.path.abspath(value)
    return value


class Service:
    """Documents + scheduler + engine. All public methods run on the event loop thread."""

    def __init__(self, cfg: Any, loader: Callable[[Any], Any] = load_engine, max_pending: int = 64,
                 max_pending_per_client: int = 16, simple_prompts: bool = False):
        self.cfg = cfg
        self._loader = loader
        self.simple_prompts = simple_prompts  # completion.py's own pipeline (for engines without a real tokenizer)
        self.scheduler = Scheduler(max_pending=max_pending, max_pending_per_client=max_pending_per_client)
        self.engine: Any = None
        self.state = "idle"            # idle | loading | ready | busy | error
        self.error = ""
        self.model_id = ""
        self.documents: dict[tuple[Hashable, str], Document] = {}
        self.listeners: list[Callable[[dict[str, Any]], None]] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self.started = time.time()
        self._stats_lock = threading.Lock()
        self.stats_counts: dict[str, float] = dict(
            requests=0, completed=0, empty=0, superseded=0, cancelled=0, errors=0, rejected=0,
            wasted_rounds=0, rounds_after_cancel=0, rounds=0, latency_ms_sum=0, prompt_tokens=0, reused_tokens=0, generated_tokens=0, loads=0)
        self.last: dict[str, Any] = {}
        self.workspace: Any = None     # completiond.workspace.Workspace, created on first use

    # --- engine lifecycle ---------------------------------------------------

    def start_loading(self) -> None:
        """Load the engine on the worker thread (queued jobs wait behind it)."""
        self.loop = self.loop or asyncio.get_running_loop()
        self._set_state("loading")

        def load():
            engine = self._loader(self.cfg)
            try:
                from completiond.engine import CancelToken
                self.scheduler.set_token_factory(CancelToken)
            except ImportError:
                pass  # fake engines in tests accept the scheduler's own token
            # Set here, on the worker, not in _loaded: jobs queued behind the load run before the loop gets to it.
            self.engine = engine
            return engine

        def done(outcome: Outcome) -> None:
            self._call_soon(self._loaded, outcome)

        self.scheduler.call(load, done)

    def _loaded(self, outcome: Outcome) -> None:
        if outcome.status == OK:
            self.engine = outcome.value
            self.model_id = getattr(self.engine, "model_id", "") or str(self.cfg.model)
            self.stats_counts["loads"] += 1
            self.error = ""
            log.info("model %s ready on %s", self.model_id, getattr(self.engine, "device", "?"))
            self._set_state("ready")
        else:
            self.error = f"cannot load model {self.cfg.model or '(bundled default)'}: {outcome.value}"
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
        return {
            "state": self.state,
            "error": self.error,
            "model": self.model_id or (self.cfg.model or "(bundled default)"),
            "device": getattr(self.engine, "device", self.cfg.device),
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started, 1),
            "queued": self.scheduler.queued(),
            "last_latency_ms": self.last.get("latency_ms"),
            "alpha": self.last.get("alpha"),
            "tokens_per_s": self.last.get("tokens_per_s"),
            "engine_settings": engine_settings(self.cfg),
        }

    def stats(self) -> dict[str, Any]:
        with self._stats_lock:
            counts = dict(self.stats_counts)
        prompt = counts["prompt_tokens"]
        superseded = counts["superseded"] + counts["cancelled"]
        return {
            **counts,
            "cache_served_fraction": (counts["reused_tokens"] / prompt) if prompt else None,
            "wasted_rounds_per_superseded": (counts["wasted_rounds"] / superseded) if superseded else 0.0,
            "rounds_after_cancel_per_superseded": (counts["rounds_after_cancel"] / superseded) if superseded else 0.0,
            "scheduler": self.scheduler.snapshot(),
            "status": self.status(),
            "documents": len(self.documents),
            "workspace_files": len(self.workspace.paths()) if self.workspace is not None else 0,
        }

    def shutdown(self) -> None:
        self.scheduler.stop()
        if self.workspace is not None:
            self.workspace.stop()

    # --- workspace context ------------------------------------------------------

    def _ws(self) -> Any:
        if self.workspace is None:
            from completiond.workspace import Workspace

            self.workspace = Workspace()
        return self.workspace

    def add_folders(self, folders: list[str]) -> None:
        """Workspace folders of an editor: watched for the context block of prompts."""
        ws = self._ws()
        for folder in folders[:MAX_FOLDERS]:
            try:
                ws.add_folder(folder)
            except (OSError, ValueError) as exc:
                log.warning("workspace folder %s ignored: %s", folder, exc)
        if folders:
            ws.start()

    def _ws_update(self, uri: str, doc: Document | None, edit_start: int | None = None) -> None:
        path = _uri_path(uri)
        if path is None:
            return
        try:
            if doc is None:
                self._ws().did_close(path)
            elif edit_start is None:
                self._ws().did_open(path, doc.text, doc.language_id or None)
            else:
                self._ws().did_change(path, doc.text, edit_line=doc.text.count("\n", 0, edit_start),
                                      language=doc.language_id or None)
        except (OSError, ValueError) as exc:  # context is a nicety: never fail the edit for it
            log.debug("workspace update for %s failed: %s", uri, exc)

    def _context(self, cfg: Any, path: str | None, language: str | None) -> list[tuple[str, str]]:
        if self.workspace is None or not path or not cfg.workspace_context or cfg.context_tokens <= 0:
            return []
        tokenizer = getattr(self.engine, "tokenizer", None)
        count = (lambda s: len(tokenizer.encode(s, add_special_tokens=False))) if tokenizer is not None else None
        try:
            return self.workspace.context(path, language, cfg.context_tokens, count)
        except (OSError, ValueError) as exc:
            log.debug("workspace context for %s failed: %s", path, exc)
            return []

    # --- documents -----------------------------------------------------------

    def open(self, client: Hashable, uri: str, version: int, text: str, language_id: str = "") -> None:
        doc = Document(uri=uri, text=text, version=version, language_id=language_id)
        self.documents[(client, uri)] = doc
        self._ws_update(uri, doc)

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
            self._ws_update(uri, doc, first[0] if isinstance(first[0], int) else 0)

    def close(self, client: Hashable, uri: str) -> None:
        if self.documents.pop((client, uri), None) is not None:
            self._ws_update(uri, None)

    def drop_client(self, client: Hashable) -> None:
        self.scheduler.cancel_client(client)
        for key in [k for k in self.documents if k[0] == client]:
            del self.documents[key]
            self._ws_update(key[1], None)

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
        cfg, _errors = config_mod.merge(self.cfg, {k: v for k, v in (settings or {}).items() if k not in ENGINE_KEYS})
        text, path, language = doc.text, _uri_path(uri), doc.language_id or None
        future: asyncio.Future = self.loop.create_future()
        loop = self.loop

        def deliver(outcome: Outcome) -> None:
            self._account(outcome)
            self._call_soon(self._after_job)
            if not loop.is_closed():
                loop.call_soon_threadsafe(lambda: future.done() or future.set_result(outcome))

        job = Job(key=(client, uri), client=client, request_id=(client, request_id),
                  run=lambda token: self._run(text, offset, cfg, token, path, language), done=deliver)
        try:
            self.scheduler.submit(job)
        except Overloaded as exc:
            with self._stats_lock:
                self.stats_counts["rejected"] += 1
            raise ServiceError(Code.OVERLOADED, str(exc)) from None
        except ShuttingDown as exc:
            raise ServiceError(Code.SHUTTING_DOWN, str(exc)) from None
        try:
            outcome: Outcome = await future
        except asyncio.CancelledError:
            self.scheduler.cancel((client, request_id))
            raise
        if outcome.status == CANCELLED:
            reason = {"superseded": "superseded by a newer request for this document",
                      "shutdown": "the daemon is shutting down"}.get(outcome.reason, "cancelled")
            raise ServiceError(Code.CANCELLED, reason)
        if outcome.status == ERROR:
            exc = outcome.value
            if type(exc).__name__ in ("EngineError", "PromptError", "FimError", "HealingError", "OutOfMemory"):
                raise ServiceError(Code.ENGINE_ERROR, str(exc))
            if self.engine is None:
                raise ServiceError(Code.NOT_READY, self.error or f"model not loaded: {exc}")
            raise ServiceError(Code.INTERNAL, f"completion failed: {type(exc).__name__}: {exc}")
        result = dict(outcome.value)
        result["version"] = version
        return result

    def _run(self, text: str, offset: int, cfg: Any, token: Any, path: str | None = None,
             language: str | None = None) -> dict[str, Any]:
        """On the worker thread."""
        from completiond import completion

        if self.engine is None:
            raise RuntimeError(self.error or "model not loaded")
        start = time.perf_counter()
        rounds = 0
        after_cancel = 0  # rounds finished after the request was cancelled: the engine's reaction time

        def on_round(_tokens: list[int]) -> None:
            nonlocal rounds, after_cancel
            rounds += 1
            if token.cancelled:
                after_cancel += 1

        self._call_soon(self._set_state, "busy")
        context = self._context(cfg, path, language)
        try:
            suggestion, gen = completion.suggest(self.engine, text, offset, cfg, cancel=token, on_round=on_round,
                                                 path=path, language=language, context=context,
                                                 simple=self.simple_prompts)
        except Exception as exc:
            if not _is_oom(exc):
                raise
            # Fail this request only: drop every cached sequence (the failed one was released into
            # the cache on the way out) and hand the memory back, so the next request can run.
            self._free_memory()
            log.error("out of memory during a completion; KV cache cleared: %s", exc)
            raise OutOfMemory(f"out of memory on {getattr(self.engine, 'device', '?')}; the KV cache was cleared, "
                              "try again (or lower cacheMegabytes / prefixTokens)") from None
        if gen is None:  # nothing to complete here (e.g. a minified line): no engine work
            return {"suggestion": None, "finish_reason": "skipped", "stats": {},
                    "latency_ms": round((time.perf_counter() - start) * 1000, 2)}
        stats = gen.stats.to_dict() if hasattr(gen.stats, "to_dict") else dict(gen.stats or {})
        stats.setdefault("rounds", rounds)
        stats["rounds_after_cancel"] = after_cancel
        latency = (time.perf_counter() - start) * 1000
        warnings = [] if self.simple_prompts else completion.plan_warnings(self.engine, cfg)
        return {
            "warnings": warnings,
            "suggestion": None if suggestion is None else {
                "text": suggestion.text, "start": suggestion.start, "end": suggestion.end,
                "multiline": suggestion.multiline},
            "finish_reason": gen.finish_reason,
            "stats": stats,
            "latency_ms": round(latency, 2),
        }

    def _free_memory(self) -> None:
        """Worker thread: empty the engine's prefix KV cache and return freed GPU memory."""
        cache = getattr(self.engine, "cache", None)
        if cache is not None:
            cache.clear()
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            torch.cuda.empty_cache()

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
            if outcome.status == OK:
                c["completed"] += 1
                c["latency_ms_sum"] += (value or {}).get("latency_ms", 0) or 0
                if value and value.get("suggestion") is None:
                    c["empty"] += 1
                self.last = {"latency_ms": value.get("latency_ms") if value else None,
                             "alpha": stats.get("alpha"), "tokens_per_s": stats.get("tokens_per_s")}
            elif outcome.status == CANCELLED:
                # Rounds run for a request nobody will see: superseded by a newer one, or
                # cancelled by the editor (which, while typing, is the same thing).
                c["wasted_rounds"] += stats.get("rounds", 0) or 0
                c["rounds_after_cancel"] += stats.get("rounds_after_cancel", 0) or 0
                c["superseded" if outcome.reason == "superseded" else "cancelled"] += 1
            else:
                c["errors"] += 1


# --- the socket server --------------------------------------------------------


class AlreadyRunning(RuntimeError):
    pass


class _Conn:
    ids = itertools.count(1)

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.id = next(self.ids)
        self.reader = reader
        self.writer = writer
        self.name = f"client#{self.id}"
        self.tasks: dict[Any, asyncio.Task] = {}
        self.closed = False

    def send(self, message: dict[str, Any]) -> None:
        if self.closed or self.writer.is_closing():
            return
        try:
            self.writer.write(wire.encode(message))
        except wire.ProtocolError as exc:
            log.error("%s: cannot send reply: %s", self.name, exc)
            if "id" in message:
                self.writer.write(wire.encode({"id": message["id"], "e": wire.error_body(Code.INTERNAL, str(exc))}))


class DaemonServer:
    def __init__(self, service: Service, directory: Path | None = None, idle_timeout: float = 900.0):
        self.service = service
        self.directory = Path(directory) if directory else paths.runtime_dir()
        self.idle_timeout = idle_timeout
        self.conns: dict[int, _Conn] = {}
        # Every connection handler with its writer, including those still in their handshake (not
        # in conns yet): close() closes them all and waits, so none is left pending when the loop goes away.
        self._handlers: dict[asyncio.Task, asyncio.StreamWriter] = {}
        self._stop = asyncio.Event()
        self._idle_since = time.monotonic()
        self._lock_fd: int | None = None
        self._socket_ino: int | None = None
        self.socket_path = paths.socket_path(self.directory)
        self.stop_reason = ""

    def request_stop(self, reason: str) -> None:
        if not self._stop.is_set():
            self.stop_reason = reason
            log.info("stopping: %s", reason)
            self._stop.set()

    def _acquire_lock(self) -> None:
        fd = os.open(self.directory / paths.LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise AlreadyRunning(f"another completiond daemon is running (lock {self.directory / paths.LOCK_NAME})") from None
        self._lock_fd = fd

    async def start(self) -> None:
        paths.ensure_private_dir(self.directory)
        self._acquire_lock()
        try:
            self.socket_path.unlink()  # stale: we hold the lock, so nobody else serves it
        except FileNotFoundError:
            pass
        old = os.umask(0o177)  # the socket is born 0600: no window where others could connect
        try:
            self._server = await asyncio.start_unix_server(self._handle, path=str(self.socket_path),
                                                           limit=wire.MAX_FRAME + 64)
        finally:
            os.umask(old)
        os.chmod(self.socket_path, 0o600)
        self._socket_ino = os.stat(self.socket_path).st_ino
        (self.directory / paths.PID_NAME).write_text(f"{os.getpid()}\n")
        self.service.loop = asyncio.get_running_loop()
        self.service.listeners.append(self._on_status)
        log.info("listening on %s (pid %d)", self.socket_path, os.getpid())

    async def serve_until_stopped(self) -> None:
        idle = asyncio.create_task(self._idle_watch())
        try:
            await self._stop.wait()
        finally:
            idle.cancel()
            await self.close()

    async def close(self) -> None:
        self._server.close()
        for conn in list(self.conns.values()):
            conn.closed = True
        for writer in self._handlers.values():
            writer.close()  # the handler's next read ends, and it returns on its own
        if self._handlers:
            await asyncio.wait(list(self._handlers), timeout=5)
        self.service.shutdown()
        try:
            if os.stat(self.socket_path).st_ino == self._socket_ino:
                self.socket_path.unlink()
        except FileNotFoundError:
            pass
        try:
            pid_file = self.directory / paths.PID_NAME
            if pid_file.read_text().strip() == str(os.getpid()):
                pid_file.unlink()
        except OSError:
            pass
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    async def _idle_watch(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.idle_timeout / 4))
            if self.conns:
                self._idle_since = time.monotonic()
            elif time.monotonic() - self._idle_since >= self.idle_timeout:
                self.request_stop(f"no clients for {self.idle_timeout:g} s")
                return

    def _on_status(self, status: dict[str, Any]) -> None:
        for conn in list(self.conns.values()):
            conn.send({"m": "status", "p": status})

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._handlers[task] = writer
        task.add_done_callback(lambda t: self._handlers.pop(t, None))
        conn = _Conn(reader, writer)
        sock = writer.get_extra_info("socket")
        try:
            uid = paths.peer_uid(sock) if sock is not None else None
        except OSError as exc:
            log.warning("%s: cannot read peer credentials (%s); closing", conn.name, exc)
            writer.close()
            return
        if uid is not None and uid != os.getuid():
            log.warning("%s: refused connection from uid %d (daemon runs as uid %d)", conn.name, uid, os.getuid())
            writer.close()
            return
        try:
            if not await self._handshake(conn):
                return
            self.conns[conn.id] = conn
            while True:
                message = await wire.read_message(reader)
                if message is None:
                    break
                await self._dispatch(conn, message)
        except wire.FrameError as exc:
            log.warning("%s: closing connection: bad frame: %s", conn.name, exc)
        except asyncio.TimeoutError:
            log.warning("%s: closing connection: no handshake within %g s", conn.name, HANDSHAKE_TIMEOUT)
        except (ConnectionError, OSError) as exc:
            log.info("%s: connection lost: %s", conn.name, exc)
        finally:
            conn.closed = True
            self.conns.pop(conn.id, None)
            for task in conn.tasks.values():
                task.cancel()
            self.service.drop_client(conn.id)
            self._idle_since = time.monotonic()
            writer.close()
            log.debug("%s: disconnected", conn.name)

    async def _handshake(self, conn: _Conn) -> bool:
        hello = await asyncio.wait_for(wire.read_message(conn.reader), HANDSHAKE_TIMEOUT)
        if hello is None:
            return False
        if hello.get("t") != "hello":
            raise wire.FrameError(f"expected a hello message first, got {_describe(hello)}")
        if hello.get("v") != wire.VERSION:
            conn.send({"t": "error", "e": wire.error_body(
                Code.VERSION_MISMATCH,
                f"protocol version {hello.get('v')!r} not supported (daemon speaks {wire.VERSION}); "
                "restart the daemon with `completiond stop`")})
            log.warning("%s: refused: protocol version %r", conn.name, hello.get("v"))
            await _drain(conn)
            conn.writer.close()
            return False
        client = hello.get("client")
        conn.name = f"client#{conn.id} ({client if isinstance(client, str) else '?'}, pid {hello.get('pid')})"
        welcome: dict[str, Any] = {"t": "welcome", "v": wire.VERSION, "pid": os.getpid(), "status": self.service.status()}
        wanted = hello.get("settings")
        if isinstance(wanted, dict):
            mismatch = self._engine_mismatch(wanted)
            if mismatch:
                welcome["warning"] = mismatch
        conn.send(welcome)
        log.info("%s: connected", conn.name)
        return True

    def _engine_mismatch(self, wanted: dict[str, Any]) -> str:
        cfg, _ = config_mod.merge(config_mod.Config(), {k: wanted.get(k) for k in ENGINE_KEYS})
        want = engine_settings(cfg)
        want["model"] = _resolve_model(want["model"])
        have = engine_settings(self.service.cfg)
        diff = [f"{k}={want[k]!r} (daemon: {have[k]!r})" for k in ENGINE_KEYS if want[k] != have[k]]
        if not diff:
            return ""
        return ("the shared daemon runs with different settings: " + ", ".join(diff) +
                "; run the command completiond.restartDaemon (or `completiond stop`) to apply yours")

    async def _dispatch(self, conn: _Conn, message: dict[str, Any]) -> None:
        method = message.get("m")
        rid = message.get("id")
        params = message.get("p") or {}
        has_id = "id" in message
        if not isinstance(method, str) or not isinstance(params, dict) or (has_id and not isinstance(rid, int)):
            log.warning("%s: malformed message %s", conn.name, _describe(message))
            if has_id:
                conn.send({"id": rid if isinstance(rid, int) else None,
                           "e": wire.error_body(Code.BAD_REQUEST, f"malformed message {_describe(message)}")})
            return
        if not has_id:
            self._notification(conn, method, params)
            return
        if method == "complete":
            task = asyncio.create_task(self._complete(conn, rid, params))
            conn.tasks[rid] = task
            task.add_done_callback(lambda _t: conn.tasks.pop(rid, None))
            return
        try:
            result = self._request(conn, method, params)
        except ServiceError as exc:
            conn.send({"id": rid, "e": wire.error_body(exc.code, exc.message)})
        except (KeyError, TypeError, ValueError) as exc:
            conn.send({"id": rid, "e": wire.error_body(Code.BAD_REQUEST, f"{method}: bad params: {exc}")})
        except Exception as exc:  # a bug in one handler fails that request, not the connection
            log.exception("%s: %s failed", conn.name, method)
            conn.send({"id": rid, "e": wire.error_body(Code.INTERNAL, f"{method} failed: {type(exc).__name__}: {exc}")})
        else:
            conn.send({"id": rid, "r": result})
        await _drain(conn)

    def _request(self, conn: _Conn, method: str, params: dict[str, Any]) -> Any:
        if method == "ping":
            return "pong"
        if method == "status":
            return self.service.status()
        if method == "stats":
            return {**self.service.stats(), "clients": len(self.conns)}
        if method == "stop":
            asyncio.get_running_loop().call_soon(self.request_stop, f"stop requested by {conn.name}")
            return {"stopping": True, "pid": os.getpid()}
        if method in ("open", "change", "close"):
            self._notification(conn, method, params, strict=True)
            return None
        raise ServiceError(Code.UNKNOWN_METHOD, f"unknown method {method!r}")

    def _notification(self, conn: _Conn, method: str, params: dict[str, Any], strict: bool = False) -> None:
        try:
            if method == "cancel":
                self.service.cancel(conn.id, _int(params, "id"))
            elif method == "open":
                self.service.open(conn.id, _str(params, "uri"), _int(params, "version"), _str(params, "text"),
                                  params.get("languageId") or "")
            elif method == "change":
                edits = params.get("edits")
                if not isinstance(edits, list):
                    raise ValueError("edits must be a list")
                self.service.change(conn.id, _str(params, "uri"), _int(params, "version"), edits)
            elif method == "close":
                self.service.close(conn.id, _str(params, "uri"))
            elif method == "workspace":
                folders = params.get("folders")
                if not isinstance(folders, list) or not all(isinstance(f, str) for f in folders):
                    raise ValueError("folders must be a list of paths")
                self.service.add_folders(folders)
            else:
                raise ServiceError(Code.UNKNOWN_METHOD, f"unknown notification {method!r}")
        except (ServiceError, KeyError, TypeError, ValueError) as exc:
            if strict:
                raise
            # Notifications have nobody to answer; the next completion will report the document as unknown.
            log.warning("%s: %s notification failed: %s", conn.name, method, exc)
        except Exception:
            if strict:
                raise
            log.exception("%s: %s notification failed", conn.name, method)

    async def _complete(self, conn: _Conn, rid: int, params: dict[str, Any]) -> None:
        try:
            settings = params.get("settings")
            result = await self.service.complete(
                conn.id, rid, _str(params, "uri"), _int(params, "version"), _int(params, "offset"),
                settings if isinstance(settings, dict) else None)
        except ServiceError as exc:
            conn.send({"id": rid, "e": wire.error_body(exc.code, exc.message)})
        except (KeyError, TypeError, ValueError) as exc:
            conn.send({"id": rid, "e": wire.error_body(Code.BAD_REQUEST, f"complete: bad params: {exc}")})
        except asyncio.CancelledError:
            return  # connection gone
        except Exception as exc:  # a bug in one handler fails that request only
            log.exception("%s: complete failed", conn.name)
            conn.send({"id": rid, "e": wire.error_body(Code.INTERNAL, f"complete failed: {type(exc).__name__}: {exc}")})
        else:
            conn.send({"id": rid, "r": result})
        await _drain(conn)


def _uri_path(uri: str) -> str | None:
    if uri.startswith("file://"):
        from urllib.parse import unquote, urlparse

        return unquote(urlparse(uri).path)
    return None


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


def _describe(message: Any) -> str:
    text = repr(message)
    return text if len(text) <= 120 else text[:117] + "..."


async def _drain(conn: _Conn) -> None:
    try:
        await conn.writer.drain()
    except (ConnectionError, OSError):
        pass


# --- command line ---------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model directory or hub id (default: the bundled model)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda", "mps"))
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"))
    parser.add_argument("--trust-remote-code", action="store_true", default=None)
    parser.add_argument("--cache-mb", type=int, help="prefix KV cache budget in MiB")
    parser.add_argument("--idle-timeout", type=float, help="seconds to stay up with no client connected")
    parser.add_argument("--runtime-dir", type=Path, help="directory for the socket (default: $XDG_RUNTIME_DIR/completiond)")
    parser.add_argument("--config", type=Path, help="config.toml to read (default: ~/.config/completiond/config.toml)")
    parser.add_argument("--log-level", choices=("error", "warning", "info", "debug"))


def config_from_args(args: argparse.Namespace) -> tuple[Any, list[str]]:
    cfg, errors = config_mod.load_file(getattr(args, "config", None))
    overrides = {"model": _resolve_model(args.model) if args.model else None, "device": args.device,
                 "dtype": args.dtype, "trustRemoteCode": args.trust_remote_code, "cacheMegabytes": args.cache_mb,
                 "idleTimeout": int(args.idle_timeout) if args.idle_timeout is not None and args.idle_timeout >= 5 else None,
                 "logLevel": args.log_level}
    cfg, more = config_mod.merge(cfg, overrides)
    return cfg, errors + more


async def serve(cfg: Any, directory: Path | None = None, idle_timeout: float | None = None,
                loader: Callable[[Any], Any] = load_engine) -> int:
    service = Service(cfg, loader=loader)
    server = DaemonServer(service, directory, idle_timeout if idle_timeout is not None else cfg.idle_timeout)
    try:
        await server.start()
    except AlreadyRunning as exc:
        log.error("%s", exc)
        service.shutdown()
        return 3
    except paths.InsecureDirectoryError as exc:
        log.error("%s", exc)
        service.shutdown()
        return 2
    except OSError as exc:  # e.g. XDG_RUNTIME_DIR missing, or a path too long for a Unix socket
        log.error("cannot listen in %s: %s", server.directory, exc)
        service.shutdown()
        return 2
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, server.request_stop, f"signal {signal.Signals(sig).name}")
    service.start_loading()
    await server.serve_until_stopped()
    log.info("stopped (%s)", server.stop_reason)
    return 0


def run(args: argparse.Namespace) -> int:
    cfg, errors = config_from_args(args)
    logging.basicConfig(level=cfg.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s completiond[%(process)d] %(levelname)s %(name)s: %(message)s")
    for error in errors:
        log.warning("%s", error)
    idle = args.idle_timeout if args.idle_timeout is not None else None
    return asyncio.run(serve(cfg, args.runtime_dir, idle))
