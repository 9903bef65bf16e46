"""One connection to the daemon (DaemonClient): the hello/welcome handshake, requests matched to their
replies by id, notifications in both directions, and cancellation of a request the caller gave up on.
Finding or starting the daemon is launcher.py's; the self-healing session over it is client.py's.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from pathlib import Path
from typing import Any, Callable

from completiond.serving import wire

log = logging.getLogger(__name__)


class DaemonUnavailable(ConnectionError):
    """No daemon could be reached (or started)."""


class ConnectionLost(ConnectionError):
    """The daemon went away while a request was in flight."""


class DaemonClient:
    """One connection to the daemon. Use from a single event loop."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        on_notification: Callable[[str, dict], None] | None = None,
        on_close: Callable[["DaemonClient"], None] | None = None,
    ):
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
        self.notice = ""  # why that directory is a fallback, if it is one

    @classmethod
    async def connect(
        cls,
        socket: Path,
        client_name: str = "completiond",
        settings: dict[str, Any] | None = None,
        timeout: float = 10.0,
        **kwargs: Any,
    ) -> "DaemonClient":
        reader, writer = await asyncio.wait_for(
            asyncio.open_unix_connection(str(socket), limit=wire.MAX_FRAME + 64), timeout
        )
        self = cls(reader, writer, **kwargs)
        try:
            writer.write(
                wire.encode(
                    {
                        "t": "hello",
                        "v": wire.VERSION,
                        "client": client_name,
                        "pid": os.getpid(),
                        "settings": settings or {},
                    }
                )
            )
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
