"""The LSP server's view of the daemon: DaemonSession, a self-healing session that reconnects (starting
the daemon again where it must) and replays the editor's open documents when the daemon dies or restarts,
with crash-loop protection.

The layers below it live apart: one connection in connection.py (DaemonClient), finding or starting the
daemon in launcher.py (connect_or_spawn, daemon_command). Their public names are re-exported here, the
daemon client's one import point for the LSP server and the CLI commands.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any, Callable

from completiond.serving import paths
from completiond.serving import wire
from completiond.serving.connection import ConnectionLost, DaemonClient, DaemonUnavailable
from completiond.serving.launcher import REMOTE_FLAGS, connect_or_spawn, daemon_command, spawn_daemon
from completiond.serving.wire import Code, RemoteError

__all__ = [
    "CRASH_LOOP_FAILURES",
    "CRASH_LOOP_MAX_WAIT",
    "CRASH_WINDOW",
    "REMOTE_FLAGS",
    "ConnectionLost",
    "DaemonClient",
    "DaemonSession",
    "DaemonUnavailable",
    "connect_or_spawn",
    "daemon_command",
    "spawn_daemon",
]

log = logging.getLogger(__name__)

CRASH_WINDOW = 10.0  # a daemon dying this soon after we connected counts as a failed start
CRASH_LOOP_FAILURES = 3  # after this many failures in a row, back off before trying again
CRASH_LOOP_MAX_WAIT = 60.0


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

    def __init__(
        self,
        settings: Callable[[], dict[str, Any]],
        documents: Callable[[], dict[str, tuple[int, str, str]]],
        directory: Path | None = None,
        on_notification: Callable[[str, dict], None] | None = None,
        on_connect: Callable[[dict[str, Any]], None] | None = None,
        client_name: str = wire.EDITOR_CLIENT,
        connect_timeout: float = 60.0,
        on_lost: Callable[[str], None] | None = None,
        on_notice: Callable[[str], None] | None = None,
    ):
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
        return self._live() is not None

    def _live(self) -> DaemonClient | None:
        """The current connection while it is open."""
        client = self.client
        return client if client is not None and not client.closed else None

    async def ensure(self) -> DaemonClient:
        live = self._live()
        if live is not None:
            return live
        wait = self._retry_at - time.monotonic()
        if wait > 0 and (self._connecting is None or self._connecting.done()):
            raise DaemonUnavailable(
                f"the daemon failed {self.failures} times in a row; next try in {wait:.0f} s "
                f"(log: {(self.directory or paths.current_runtime_dir()) / paths.LOG_NAME})"
            )
        if self._connecting is None or self._connecting.done():
            self._connecting = asyncio.ensure_future(self._connect())
        # Shield: one caller giving up (a cancelled completion) must not abort the connect for the others.
        return await asyncio.shield(self._connecting)

    async def _connect(self) -> DaemonClient:
        settings = self._settings()
        try:
            client = await connect_or_spawn(
                settings,
                self.directory,
                timeout=self.connect_timeout,
                client_name=self.client_name,
                on_notification=self.on_notification,
                idle_timeout=settings.get("idleTimeout"),
                on_close=self._client_closed,
            )
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
        client = self._live()
        if client is not None:
            try:
                client.notify(method, params)
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
                    raise RemoteError(
                        Code.BAD_REQUEST, f"{params['uri']} is too large to complete in ({len(text)} characters)"
                    ) from None
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
        client = self._live()
        if client is not None:
            try:
                await client.request("stop", {}, timeout=5)
            except (ConnectionError, RemoteError, asyncio.TimeoutError):
                pass
            await client.close()
        # Wait for the old daemon to release its socket, so we do not reconnect to it.
        directory = self.directory or paths.current_runtime_dir()
        deadline = time.monotonic() + 10
        while paths.socket_path(directory).exists() and time.monotonic() < deadline:  # noqa: ASYNC110 (another process)
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        self._leaving = True
        if self.client is not None:
            await self.client.close()
