"""Talking to the daemon: one connection (DaemonClient), finding or starting
the daemon (connect_or_spawn), and the self-healing session the LSP server
uses (DaemonSession), which reconnects and replays its open documents when the
daemon dies or restarts.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from completiond import config as config_mod
from completiond.serving import paths
from completiond.serving import wire
from completiond.serving.wire import Code, RemoteError

log = logging.getLogger(__name__)

LOG_ROTATE_BYTES = 4 * 1024 * 1024
CRASH_WINDOW = 10.0          # a daemon dying this soon after we connected counts as a failed start
CRASH_LOOP_FAILURES = 3      # after this many failures in a row, back off before trying again
CRASH_LOOP_MAX_WAIT = 60.0


class DaemonUnavailable(ConnectionError):
    """No daemon could be reached (or started)."""


class ConnectionLost(ConnectionError):
    """The daemon went away while a request was in flight."""


class DaemonClient:
    """One connection to the daemon. Use from a single event loop."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 on_notification: Callable[[str, dict], None] | None = None,
                 on_close: Callable[["DaemonClient"], None] | None = None):
        self.reader = reader
        self.writer = writer
        self.on_notification = on_notification
        self.on_close = on_close
        self.welcome: dict[str, Any] = {}
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._reader_task: asyncio.Task | None = None
        self.closed = False
        self.close_reason = ""
        self.directory: Path | None = None  # the runtime directory (connect_or_spawn sets it)
        self.notice = ""                    # why that directory is a fallback, if it is one

    @classmethod
    async def connect(cls, socket: Path, client_name: str = "completiond", settings: dict[str, Any] | None = None,
                      timeout: float = 10.0, **kwargs: Any) -> "DaemonClient":
        reader, writer = await asyncio.wait_for(
            asyncio.open_unix_connection(str(socket), limit=wire.MAX_FRAME + 64), timeout)
        self = cls(reader, writer, **kwargs)
        try:
            writer.write(wire.encode({"t": "hello", "v": wire.VERSION, "client": client_name, "pid": os.getpid(),
                                      "settings": settings or {}}))
            welcome = await asyncio.wait_for(wire.read_message(reader), timeout)
        except (wire.FrameError, asyncio.TimeoutError, OSError) as exc:
            writer.close()
            raise DaemonUnavailable(f"handshake with the daemon at {socket} failed: {exc}") from None
        if welcome is None:
            writer.close()
            raise DaemonUnavailable(f"the daemon at {socket} closed the connection during the handshake")
        if welcome.get("t") != "welcome":
            writer.close()
            raise wire.parse_error(welcome.get("e"))
        self.welcome = welcome
        self._reader_task = asyncio.create_task(self._read_loop())
        return self

    async def _read_loop(self) -> None:
        reason = "the daemon closed the connection"
        try:
            while True:
                message = await wire.read_message(self.reader)
                if message is None:
                    break
                self._dispatch(message)
        except wire.FrameError as exc:
            reason = f"bad frame from the daemon: {exc}"
            log.warning("%s", reason)
        except (ConnectionError, OSError) as exc:
            reason = f"connection to the daemon lost: {exc}"
        except asyncio.CancelledError:
            reason = "closed"
        finally:
            self._closed(reason)

    def _dispatch(self, message: dict[str, Any]) -> None:
        if "id" in message and message["id"] is not None:
            future = self._pending.pop(message["id"], None)
            if future is None or future.done():
                return  # answered after we gave up on it
            if "e" in message:
                future.set_exception(wire.parse_error(message["e"]))
            else:
                future.set_result(message.get("r"))
        elif isinstance(message.get("m"), str) and self.on_notification is not None:
            try:
                self.on_notification(message["m"], message.get("p") or {})
            except Exception:
                log.exception("daemon notification handler failed")

    def _closed(self, reason: str) -> None:
        if self.closed:
            return
        self.closed = True
        self.close_reason = reason
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ConnectionLost(reason))
        self._pending.clear()
        self.writer.close()
        if self.on_close is not None:
            self.on_close(self)

    def _send(self, message: dict[str, Any]) -> None:
        if self.closed:
            raise ConnectionLost(self.close_reason)
        self.writer.write(wire.encode(message))

    def notify(self, method: str, params: dict[str, Any]) -> None:
        self._send({"m": method, "p": params})

    async def request(self, method: str, params: dict[str, Any] | None = None, timeout: float | None = None) -> Any:
        """Send a request and wait for its reply; cancelling the awaiting task cancels it on the daemon too."""
        rid = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[rid] = future
        try:
            self._send({"id": rid, "m": method, "p": params or {}})
            await self.writer.drain()
            return await asyncio.wait_for(asyncio.shield(future), timeout) if timeout else await future
        except (asyncio.CancelledError, asyncio.TimeoutError):
            if self._pending.pop(rid, None) is not None and not self.closed:
                try:
                    self.notify("cancel", {"id": rid})
                except (ConnectionError, OSError):
                    pass
            raise
        except OSError as exc:
            self._pending.pop(rid, None)
            raise ConnectionLost(f"connection to the daemon lost: {exc}") from None

    async def close(self) -> None:
        if self._reader_task is not None:
            self._reader_task.cancel()
            try:
                await self._reader_task
            except asyncio.CancelledError:
                pass
        self._closed("closed")


# --- finding or starting the daemon ---------------------------------------------------


REMOTE_FLAGS = (("backend", "--backend"), ("endpoint", "--endpoint"), ("endpointModel", "--endpoint-model"),
                ("apiKeyEnv", "--api-key-env"), ("apiKeyFile", "--api-key-file"),
                ("endpointCaFile", "--endpoint-ca-file"), ("endpointTimeout", "--endpoint-timeout"),
                ("apiKeyOverHttp", "--api-key-over-http"))


def daemon_command(settings: dict[str, Any], idle_timeout: float | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "completiond.cli", "serve"]
    # Every engine setting (config.ENGINE_KEYS) goes on the command line: one left out would load the
    # daemon's default instead, and the editor would warn about "different settings" for good.
    for key, flag in (("model", "--model"), ("draftModel", "--draft-model")):
        model = settings.get(key) or ""
        if model:
            # Only a path written as one is a directory (config.is_local_model): a hub id or short name stays
            # a name, whatever a same-named folder in the editor's working directory (a cloned repository)
            # holds. The daemon runs in /, so a path goes absolute.
            cmd += [flag, config_mod.resolve_local_model(str(model))]
    for key, flag in (("device", "--device"), ("dtype", "--dtype"), ("weights", "--weights"),
                      ("cacheMegabytes", "--cache-mb"), ("logLevel", "--log-level")):
        if settings.get(key) not in (None, ""):
            cmd += [flag, str(settings[key])]
    if settings.get("trustRemoteCode"):
        cmd.append("--trust-remote-code")
    for key, flag in REMOTE_FLAGS:  # a team backend; the API key itself never goes on a command line
        value = settings.get(key)
        if value not in (None, ""):
            if key in ("apiKeyFile", "endpointCaFile"):
                value = os.path.abspath(os.path.expanduser(str(value)))  # the daemon runs in /
            cmd += [flag, str(value)]
    idle = idle_timeout if idle_timeout is not None else settings.get("idleTimeout")
    if idle is not None:
        cmd += ["--idle-timeout", str(idle)]
    return cmd


def spawn_daemon(directory: Path, settings: dict[str, Any], idle_timeout: float | None = None) -> subprocess.Popen:
    """Start a detached daemon whose output goes to daemon.log in the runtime directory."""
    cmd = daemon_command(settings, idle_timeout) + ["--runtime-dir", str(directory)]
    log_path = directory / paths.LOG_NAME
    try:
        if log_path.stat().st_size > LOG_ROTATE_BYTES:
            os.replace(log_path, log_path.with_name(paths.LOG_NAME + ".1"))
    except FileNotFoundError:
        pass
    log_fd = os.open(directory / paths.LOG_NAME, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    try:
        log.info("starting daemon: %s", " ".join(cmd))
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd, close_fds=True,
                                start_new_session=True, cwd="/")
    finally:
        os.close(log_fd)


def _log_tail(path: Path, lines: int = 2) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            tail = f.read().decode("utf-8", "replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(tail[-lines:]) or "(empty log)"


def _try_lock(path: Path) -> int | None:
    import fcntl  # POSIX only, like the daemon: importing this module (the LSP does) must work everywhere

    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _placed(client: DaemonClient, directory: Path, notice: str) -> DaemonClient:
    """The client, with the runtime directory it was found in and the fallback notice (if any)."""
    client.directory = directory
    client.notice = notice
    return client


async def connect_or_spawn(settings: dict[str, Any] | None = None, directory: Path | None = None, spawn: bool = True,
                           timeout: float = 60.0, client_name: str = "completiond",
                           idle_timeout: float | None = None, **client_kwargs: Any) -> DaemonClient:
    """Connect to the user's daemon, starting it first if there is none (one starter at a time)."""
    settings = settings or {}
    # The default directory, if squatted or unsafe, is replaced by a private one (the notice says so).
    directory, notice = paths.usable_runtime_dir(directory)
    if notice:
        log.warning("%s", notice)
    socket = paths.socket_path(directory)
    deadline = time.monotonic() + timeout
    delay = 0.02
    proc: subprocess.Popen | None = None
    lock_fd: int | None = None
    last_error: Exception | None = None
    try:
        while True:
            try:
                return _placed(await DaemonClient.connect(socket, client_name, settings, **client_kwargs),
                               directory, notice)
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                last_error = exc
            except DaemonUnavailable as exc:  # e.g. the daemon is exiting: try again
                last_error = exc
            if not spawn:
                raise DaemonUnavailable(f"no completiond daemon is running (no socket at {socket})")
            if proc is None and lock_fd is None:
                # Whoever holds the spawn lock starts the daemon; the others keep polling the socket.
                lock_fd = _try_lock(directory / paths.SPAWN_LOCK_NAME)
                if lock_fd is not None:
                    try:
                        return _placed(await DaemonClient.connect(socket, client_name, settings, **client_kwargs),
                                       directory, notice)
                    except (FileNotFoundError, ConnectionRefusedError, DaemonUnavailable):
                        pass
                    proc = spawn_daemon(directory, settings, idle_timeout)
            if proc is not None and proc.poll() is not None and proc.returncode != 3:
                # 3 = another daemon won the race: keep polling for its socket.
                raise DaemonUnavailable(
                    f"the daemon exited with status {proc.returncode} during start-up: "
                    f"{_log_tail(directory / paths.LOG_NAME)} (log: {directory / paths.LOG_NAME})")
            if time.monotonic() > deadline:
                raise DaemonUnavailable(f"could not reach the daemon at {socket} within {timeout:g} s: {last_error}")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)
    finally:
        if lock_fd is not None:
            os.close(lock_fd)


# --- the LSP server's view: a daemon that comes back ----------------------------------


def _send_open(client: DaemonClient, uri: str, version: int, text: str, language_id: str) -> bool:
    try:
        client.notify("open", {"uri": uri, "version": version, "text": text, "languageId": language_id})
    except wire.ProtocolError as exc:
        log.warning("%s not sent to the daemon: %s", uri, exc)
        return False
    return True


class DaemonSession:
    """Daemon connection for one editor session.

    `documents()` must return the editor's open documents ({uri: (version, text, languageId)});
    they are replayed whenever a new connection is made, so a daemon restart is invisible
    apart from the model reload.
    """

    def __init__(self, settings: Callable[[], dict[str, Any]], documents: Callable[[], dict[str, tuple[int, str, str]]],
                 directory: Path | None = None, on_notification: Callable[[str, dict], None] | None = None,
                 on_connect: Callable[[dict[str, Any]], None] | None = None, client_name: str = wire.EDITOR_CLIENT,
                 connect_timeout: float = 60.0, on_lost: Callable[[str], None] | None = None,
                 on_notice: Callable[[str], None] | None = None):
        self._settings = settings
        # Told once what the user should know but need not act on: the daemon's directory was unsafe and a
        # private one is used instead.
        self.on_notice = on_notice
        self._noticed = False
        self._documents = documents
        self.directory = directory
        self.on_notification = on_notification
        self.on_connect = on_connect
        # Told (with the reason) when the daemon goes away by itself: killed, crashed, `completiond stop`.
        # Not when we close or restart it. The next request starts one again either way.
        self.on_lost = on_lost
        self._leaving = False  # we are closing or restarting the daemon ourselves
        self.client_name = client_name
        self.connect_timeout = connect_timeout
        self.client: DaemonClient | None = None
        self._connecting: asyncio.Task | None = None
        self.reconnects = 0
        # Crash-loop protection: a daemon that dies right after starting is not restarted on
        # every keystroke; after a few quick failures we wait (exponentially longer) first.
        self.failures = 0
        self._retry_at = 0.0
        self._connected_at = 0.0

    @property
    def connected(self) -> bool:
        return self.client is not None and not self.client.closed

    async def ensure(self) -> DaemonClient:
        if self.connected:
            return self.client  # type: ignore[return-value]
        wait = self._retry_at - time.monotonic()
        if wait > 0 and (self._connecting is None or self._connecting.done()):
            raise DaemonUnavailable(f"the daemon failed {self.failures} times in a row; next try in {wait:.0f} s "
                                    f"(log: {(self.directory or paths.current_runtime_dir()) / paths.LOG_NAME})")
        if self._connecting is None or self._connecting.done():
            self._connecting = asyncio.ensure_future(self._connect())
        # Shield: one caller giving up (a cancelled completion) must not abort the connect for the others.
        return await asyncio.shield(self._connecting)

    async def _connect(self) -> DaemonClient:
        settings = self._settings()
        try:
            client = await connect_or_spawn(settings, self.directory, timeout=self.connect_timeout,
                                            client_name=self.client_name, on_notification=self.on_notification,
                                            idle_timeout=settings.get("idleTimeout"), on_close=self._client_closed)
        except paths.InsecureDirectoryError as exc:
            self._failed()
            raise DaemonUnavailable(str(exc)) from None
        except OSError as exc:  # e.g. the runtime directory's parent is missing or read-only
            self._failed()
            raise DaemonUnavailable(f"cannot use the daemon directory: {exc}") from None
        except DaemonUnavailable:
            self._failed()
            raise
        self._connected_at = time.monotonic()
        if client.notice and self.directory is None:
            self.directory = client.directory  # keep to the fallback: restarts and stops find the daemon there
            if not self._noticed and self.on_notice is not None:
                self._noticed = True
                self.on_notice(client.notice)
        if self.client is not None:
            self.reconnects += 1
        for uri, (version, text, language_id) in self._documents().items():
            _send_open(client, uri, version, text, language_id)
        self.client = client
        if self.on_connect is not None:
            self.on_connect(client.welcome)
        return client

    def _client_closed(self, client: DaemonClient) -> None:
        """A connection ended: say so at once when it was ours and the daemon left by itself, so editors do
        not keep showing "ready" until the next keystroke."""
        if self._leaving or client is not self.client or self.on_lost is None:
            return
        try:
            self.on_lost(getattr(client, "close_reason", "") or "the daemon closed the connection")
        except Exception:  # a listener's bug must not break the connection bookkeeping
            log.exception("daemon-lost handler failed")

    def _failed(self) -> None:
        self.failures += 1
        if self.failures >= CRASH_LOOP_FAILURES:
            self._retry_at = time.monotonic() + min(CRASH_LOOP_MAX_WAIT, 2.0 ** (self.failures - CRASH_LOOP_FAILURES))

    def _lost(self) -> None:
        """The connection died: a crash if it had only just been made."""
        if time.monotonic() - self._connected_at < CRASH_WINDOW:
            self._failed()
        else:
            self.failures = 0
            self._retry_at = 0.0

    def notify(self, method: str, params: dict[str, Any]) -> None:
        """Document notifications: dropped while disconnected (the replay on reconnect covers them)."""
        if self.connected:
            try:
                self.client.notify(method, params)  # type: ignore[union-attr]
            except (ConnectionError, OSError):
                pass
            except wire.ProtocolError as exc:
                # Too big for one frame: the daemon will not know this document, and says so when asked.
                log.warning("%s %s not sent to the daemon: %s", method, params.get("uri"), exc)

    async def request(self, method: str, params: dict[str, Any], timeout: float | None = None) -> Any:
        """Request with one transparent retry if the daemon died under it (or did not know the document)."""
        for attempt in (1, 2):
            client = await self.ensure()
            try:
                result = await client.request(method, params, timeout)
            except ConnectionLost:
                self._lost()
                if attempt == 2:
                    raise
                log.warning("daemon connection lost; reconnecting")
            except RemoteError as exc:
                if exc.code != Code.UNKNOWN_DOCUMENT or attempt == 2 or "uri" not in params:
                    raise
                docs = self._documents()
                if params["uri"] not in docs:
                    raise
                version, text, language_id = docs[params["uri"]]
                if not _send_open(client, params["uri"], version, text, language_id):
                    raise RemoteError(Code.BAD_REQUEST, f"{params['uri']} is too large to complete in "
                                                        f"({len(text)} characters)") from None
            else:
                if self.failures and time.monotonic() - self._connected_at >= CRASH_WINDOW:
                    self.failures = 0
                return result
        raise AssertionError("unreachable")

    async def restart(self) -> None:
        """Stop the daemon (it restarts with our current settings on the next connect)."""
        self._leaving = True
        try:
            await self._stop_and_wait()
        finally:
            self._leaving = False
        await self.ensure()

    async def _stop_and_wait(self) -> None:
        if self.connected:
            try:
                await self.client.request("stop", {}, timeout=5)  # type: ignore[union-attr]
            except (ConnectionError, RemoteError, asyncio.TimeoutError):
                pass
            await self.client.close()  # type: ignore[union-attr]
        # Wait for the old daemon to release its socket, so we do not reconnect to it.
        directory = self.directory or paths.current_runtime_dir()
        deadline = time.monotonic() + 10
        while paths.socket_path(directory).exists() and time.monotonic() < deadline:  # noqa: ASYNC110 (another process)
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        self._leaving = True
        if self.client is not None:
            await self.client.close()
