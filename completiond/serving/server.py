"""The daemon's socket server: connections, frames, the handshake, idle exit.

`DaemonServer` exposes one `Service` (service.py) on a private Unix socket (see
wire.py for the protocol and paths.py for the directory checks). It owns what
only a socket has (peer checks, frames, connection lifetimes, the server-level
`stop` request) and passes every other message to the service's dispatch.
"""

from __future__ import annotations

import asyncio
import fcntl
import itertools
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

from completiond import config as config_mod
from completiond.config import Config
from completiond.errors import CompletionError
from completiond.serving import paths, wire
from completiond.serving.lifecycle import Loader, load_completer
from completiond.serving.service import Service, ServiceError
from completiond.serving.wire import Code

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 10.0
FRAME_TIMEOUT = 10.0  # seconds for the rest of a frame once its first byte arrived (a local peer needs milliseconds)
MAX_CONNECTIONS = 64  # editors are a handful; far below the fd limit, where accept() starts failing


class AlreadyRunning(RuntimeError):
    pass


class _Conn:
    ids = itertools.count(1)

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.id = next(self.ids)
        self.reader = reader
        self.writer = writer
        self.name = f"client#{self.id}"
        self.client = ""  # the name it gave in its hello
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
                try:
                    self.writer.write(wire.encode({"id": message["id"], "e": wire.error_body(Code.INTERNAL, str(exc))}))
                except wire.ProtocolError:  # the id itself (echoed as sent) is too big to answer
                    log.error("%s: reply to an oversized request id dropped", self.name)


class DaemonServer:
    def __init__(
        self,
        service: Service,
        directory: Path | None = None,
        idle_timeout: float = 900.0,
        max_connections: int = MAX_CONNECTIONS,
        frame_timeout: float = FRAME_TIMEOUT,
    ):
        self.service = service
        self.directory = Path(directory) if directory else paths.runtime_dir()
        self.idle_timeout = idle_timeout
        self.max_connections = max_connections
        self.frame_timeout = frame_timeout
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
            raise AlreadyRunning(
                f"another completiond daemon is running (lock {self.directory / paths.LOCK_NAME})"
            ) from None
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
            self._server = await asyncio.start_unix_server(
                self._handle, path=str(self.socket_path), limit=wire.MAX_FRAME + 64
            )
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
        assert task is not None  # asyncio.start_server runs each handler as a task
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
        if len(self._handlers) > self.max_connections:
            await self._refuse(
                conn,
                f"too many connections to the completiond daemon ({self.max_connections} open); "
                "close unused editors, or run `completiond stop` to restart it",
            )
            return
        try:
            if not await self._handshake(conn):
                return
            self.conns[conn.id] = conn
            while True:
                message = await wire.read_message(reader, frame_timeout=self.frame_timeout)
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

    async def _refuse(self, conn: _Conn, reason: str) -> None:
        """Answer a connection we will not serve with an error the client shows, then close it."""
        log.warning("%s: refused: %s", conn.name, reason)
        conn.send({"t": "error", "e": wire.error_body(Code.OVERLOADED, reason)})
        try:
            await asyncio.wait_for(conn.writer.drain(), 1.0)
        except (ConnectionError, OSError, asyncio.TimeoutError):
            pass
        conn.writer.close()

    async def _handshake(self, conn: _Conn) -> bool:
        hello = await asyncio.wait_for(wire.read_message(conn.reader), HANDSHAKE_TIMEOUT)
        if hello is None:
            return False
        if hello.get("t") != "hello":
            raise wire.FrameError(f"expected a hello message first, got {_describe(hello)}")
        if hello.get("v") != wire.VERSION:
            conn.send(
                {
                    "t": "error",
                    "e": wire.error_body(
                        Code.VERSION_MISMATCH,
                        f"protocol version {hello.get('v')!r} not supported (daemon speaks {wire.VERSION}); "
                        "restart the daemon with `completiond stop`",
                    ),
                }
            )
            log.warning("%s: refused: protocol version %r", conn.name, hello.get("v"))
            await _drain(conn)
            conn.writer.close()
            return False
        client = hello.get("client")
        conn.name = f"client#{conn.id} ({client if isinstance(client, str) else '?'}, pid {hello.get('pid')})"
        conn.client = client if isinstance(client, str) else ""
        welcome: dict[str, Any] = {
            "t": "welcome",
            "v": wire.VERSION,
            "pid": os.getpid(),
            "status": self.service.status(),
        }
        wanted = hello.get("settings")
        if isinstance(wanted, dict):
            mismatch = self._engine_mismatch(wanted, editor=conn.client == wire.EDITOR_CLIENT)
            if mismatch:
                welcome["warning"] = mismatch
        conn.send(welcome)
        log.info("%s: connected", conn.name)
        return True

    def _engine_mismatch(self, wanted: dict[str, Any], editor: bool = True) -> str:
        cfg, _ = config_mod.merge(config_mod.Config(), {k: wanted.get(k) for k in config_mod.ENGINE_KEYS})
        diff = config_mod.engine_differences(
            config_mod.engine_settings(cfg), config_mod.engine_settings(self.service.cfg)
        )
        # The daemon's own settings, fixed when it started: an editor window asking for others would otherwise
        # be ignored without a word (a command-line client's are its defaults, not a wish).
        served = {"idleTimeout": self.idle_timeout, "logLevel": self.service.cfg.log_level} if editor else {}
        for key, have in served.items():
            want = wanted.get(key)
            if want is None or key not in wanted:
                continue
            merged, errors = config_mod.merge(config_mod.Config(), {key: want})
            value = getattr(merged, config_mod.SETTINGS_BY_KEY[key].attr)
            if not errors and value != have:
                diff.append(f"{key}={value!r} (daemon: {have!r})")
        if not diff:
            return ""
        refused = config_mod.route_refusal(wanted, self.service.cfg)
        return (
            "the shared daemon runs with different settings: "
            + ", ".join(diff)
            + "; "
            + (
                "it will not complete your documents (it would send them to a server your settings did not choose); "
                if refused
                else ""
            )
            + config_mod.RESTART_HINT
        )

    async def _dispatch(self, conn: _Conn, message: dict[str, Any]) -> None:
        method = message.get("m")
        rid = message.get("id")
        params = message.get("p") or {}
        has_id = "id" in message
        if not isinstance(method, str) or not isinstance(params, dict) or (has_id and not isinstance(rid, int)):
            log.warning("%s: malformed message %s", conn.name, _describe(message))
            if has_id:  # echo the id as sent, whatever its type, so the client can match the error to its request
                conn.send(
                    {"id": rid, "e": wire.error_body(Code.BAD_REQUEST, f"malformed message {_describe(message)}")}
                )
            return
        if not has_id:
            try:
                self.service.notify(conn.id, method, params)
            except ServiceError as exc:
                # Nobody to answer; the next completion will report the document as unknown.
                log.warning("%s: %s notification failed: %s", conn.name, method, exc.message)
            except Exception:  # a bug in one handler drops that notification, not the connection
                log.exception("%s: %s notification failed", conn.name, method)
            return
        assert isinstance(rid, int)  # checked above, for every message with an id
        if method == "stop":
            asyncio.get_running_loop().call_soon(self.request_stop, f"stop requested by {conn.name}")
            conn.send({"id": rid, "r": {"stopping": True, "pid": os.getpid()}})
        elif method == "complete":
            # Runs while this connection's next messages (edits, cancels, newer requests) are read.
            task = asyncio.create_task(self._answer(conn, rid, method, params))
            conn.tasks[rid] = task
            task.add_done_callback(lambda _t: conn.tasks.pop(rid, None))
            return
        else:
            await self._answer(conn, rid, method, params)
        await _drain(conn)

    async def _answer(self, conn: _Conn, rid: int, method: str, params: dict[str, Any]) -> None:
        try:
            result = await self.service.request(conn.id, rid, method, params)
            if method == "stats":
                editors = sum(c.client == wire.EDITOR_CLIENT for c in self.conns.values())
                result = {**result, "clients": len(self.conns), "editors": editors}
        except ServiceError as exc:
            conn.send({"id": rid, "e": wire.error_body(exc.code, exc.message)})
        except asyncio.CancelledError:
            return  # connection gone
        except Exception as exc:  # a bug in one handler fails that request, not the connection
            log.exception("%s: %s failed", conn.name, method)
            conn.send({"id": rid, "e": wire.error_body(Code.INTERNAL, f"{method} failed: {type(exc).__name__}: {exc}")})
        else:
            conn.send({"id": rid, "r": result})
        await _drain(conn)


class RateLimitFilter(logging.Filter):
    """At most `burst` records of one kind (logger, level, first line of the message template) per
    `window` seconds; the first one let through after a quiet spell says how many were dropped.

    A flood (a client reconnecting in a loop, accept() failing with EMFILE every second, ...)
    would otherwise fill the runtime directory with the same lines. DEBUG records always pass:
    they were asked for, and the per-file context lines are the prompt's audit trail.
    """

    def __init__(self, burst: int = 20, window: float = 60.0, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.burst = burst
        self.window = window
        self._clock = clock
        self._kinds: dict[tuple, list] = {}  # kind -> [window start, records let through, records dropped]
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.INFO:
            return True
        kind = (record.name, record.levelno, str(record.msg).split("\n", 1)[0][:120])
        with self._lock:
            now = self._clock()
            state = self._kinds.get(kind)
            if state is None or now - state[0] >= self.window:
                dropped = state[2] if state is not None else 0
                if len(self._kinds) > 1000:
                    self._kinds = {k: v for k, v in self._kinds.items() if now - v[0] < self.window}
                self._kinds[kind] = [now, 1, 0]
                if dropped:
                    record.msg = f"{record.msg} [{dropped} more like this in the last {self.window:g} s not logged]"
                return True
            if state[1] < self.burst:
                state[1] += 1
                return True
            state[2] += 1
            return False


class PlainErrorFilter(logging.Filter):
    """Tracebacks are for bugs. A CompletionError (a model that is not there, a setting the model lacks,
    a hub id offline...) is the user's to fix, and its message says how: the record keeps the message and
    drops the traceback, which would bury it in daemon.log. Anything else keeps its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, CompletionError):
            record.msg = f"{record.getMessage()}: {exc}"
            record.args = None
            record.exc_info = None
            record.exc_text = None
        return True


def install_log_rate_limit(burst: int = 20, window: float = 60.0) -> None:
    """Rate-limit what the root logger's handlers write, and keep tracebacks for bugs only (PlainErrorFilter)
    (idempotent)."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, PlainErrorFilter) for f in handler.filters):
            handler.addFilter(PlainErrorFilter())
        if not any(isinstance(f, RateLimitFilter) for f in handler.filters):
            handler.addFilter(RateLimitFilter(burst, window))


def _describe(message: Any) -> str:
    text = repr(message)
    return text if len(text) <= 120 else text[:117] + "..."


async def _drain(conn: _Conn) -> None:
    try:
        await conn.writer.drain()
    except (ConnectionError, OSError):
        pass


async def serve(
    cfg: Config, directory: Path | None = None, idle_timeout: float | None = None, loader: Loader = load_completer
) -> int:
    """Run the daemon until stopped (signal, `stop` request or idle timeout); the process exit code."""
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
