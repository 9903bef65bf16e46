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
import time
from pathlib import Path
from typing import Any, Callable

from completiond import config as config_mod
from completiond.serving import paths, wire
from completiond.serving.service import Service, ServiceError, load_engine, resolve_model
from completiond.serving.wire import Code

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 10.0



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
        cfg, _ = config_mod.merge(config_mod.Config(), {k: wanted.get(k) for k in config_mod.ENGINE_KEYS})
        want = config_mod.engine_settings(cfg)
        want["model"] = resolve_model(want["model"])
        have = config_mod.engine_settings(self.service.cfg)
        diff = [f"{k}={want[k]!r} (daemon: {have[k]!r})" for k in config_mod.ENGINE_KEYS if want[k] != have[k]]
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
            try:
                self.service.notify(conn.id, method, params)
            except ServiceError as exc:
                # Nobody to answer; the next completion will report the document as unknown.
                log.warning("%s: %s notification failed: %s", conn.name, method, exc.message)
            except Exception:  # a bug in one handler drops that notification, not the connection
                log.exception("%s: %s notification failed", conn.name, method)
            return
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
                result = {**result, "clients": len(self.conns)}
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


def _describe(message: Any) -> str:
    text = repr(message)
    return text if len(text) <= 120 else text[:117] + "..."


async def _drain(conn: _Conn) -> None:
    try:
        await conn.writer.drain()
    except (ConnectionError, OSError):
        pass


async def serve(cfg: Any, directory: Path | None = None, idle_timeout: float | None = None,
                loader: Callable[[Any], Any] = load_engine) -> int:
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
