"""Finding or starting the daemon: the command line that carries the editor's engine settings
(daemon_command), a detached start with its log (spawn_daemon), and connect_or_spawn, which connects to
the user's daemon and starts one first where there is none (one starter at a time, under a lock).
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from completiond import config as config_mod
from completiond.serving import paths
from completiond.serving.connection import DaemonClient, DaemonUnavailable

log = logging.getLogger(__name__)

LOG_ROTATE_BYTES = 4 * 1024 * 1024

REMOTE_FLAGS = (
    ("backend", "--backend"),
    ("endpoint", "--endpoint"),
    ("endpointModel", "--endpoint-model"),
    ("apiKeyEnv", "--api-key-env"),
    ("apiKeyFile", "--api-key-file"),
    ("endpointCaFile", "--endpoint-ca-file"),
    ("endpointTimeout", "--endpoint-timeout"),
    ("apiKeyOverHttp", "--api-key-over-http"),
)


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
    for key, flag in (
        ("device", "--device"),
        ("dtype", "--dtype"),
        ("weights", "--weights"),
        ("cacheMegabytes", "--cache-mb"),
        ("logLevel", "--log-level"),
    ):
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
        return subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd, close_fds=True, start_new_session=True, cwd="/"
        )
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


async def connect_or_spawn(
    settings: dict[str, Any] | None = None,
    directory: Path | None = None,
    spawn: bool = True,
    timeout: float = 60.0,
    client_name: str = "completiond",
    idle_timeout: float | None = None,
    **client_kwargs: Any,
) -> DaemonClient:
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
                return _placed(
                    await DaemonClient.connect(socket, client_name, settings, **client_kwargs), directory, notice
                )
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
                        return _placed(
                            await DaemonClient.connect(socket, client_name, settings, **client_kwargs),
                            directory,
                            notice,
                        )
                    except (FileNotFoundError, ConnectionRefusedError, DaemonUnavailable):
                        pass
                    proc = spawn_daemon(directory, settings, idle_timeout)
            if proc is not None and proc.poll() is not None and proc.returncode != 3:
                # 3 = another daemon won the race: keep polling for its socket.
                raise DaemonUnavailable(
                    f"the daemon exited with status {proc.returncode} during start-up: "
                    f"{_log_tail(directory / paths.LOG_NAME)} (log: {directory / paths.LOG_NAME})"
                )
            if time.monotonic() > deadline:
                raise DaemonUnavailable(f"could not reach the daemon at {socket} within {timeout:g} s: {last_error}")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)
    finally:
        if lock_fd is not None:
            os.close(lock_fd)
