"""Where the daemon's socket lives, and the checks that keep it private.

The socket is the only thing standing between another local user and our
model (and the source text we send it), so the directory holding it must be
ours alone: owned by us, not a symlink, not writable by group or others.
A directory that fails these checks is refused, never "fixed" by deleting it:
someone else may have planted it.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
import sys
import tempfile
from pathlib import Path

SOCKET_NAME = "daemon.sock"
LOCK_NAME = "daemon.lock"        # held by the running daemon for its lifetime
SPAWN_LOCK_NAME = "spawn.lock"   # held by an LSP process while it starts a daemon
PID_NAME = "daemon.pid"
LOG_NAME = "daemon.log"


class InsecureDirectoryError(RuntimeError):
    """The runtime directory exists but is not safe to use."""


def daemon_unsupported() -> str:
    """Why this platform cannot run the shared daemon, or '' where it can.

    The daemon's privacy rests on a Unix domain socket in a directory only our user id can enter (and on
    the peer's uid where the OS tells it). Windows has neither user ids in `os` nor AF_UNIX in Python's
    socket module; there the LSP server runs the model in its own process instead (`--no-daemon`).
    """
    if not hasattr(socket, "AF_UNIX") or not hasattr(os, "getuid"):
        return (f"the shared daemon needs Unix domain sockets and user ids, which this platform ({sys.platform}) "
                "does not offer")
    return ""


def runtime_dir() -> Path:
    """The per-user directory for the socket, lock and log (not created here)."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "completiond"
    return Path(tempfile.gettempdir()) / f"completiond-{os.getuid()}"


def check_private_dir(path: Path) -> None:
    """Raise InsecureDirectoryError unless `path` is a real directory we own, closed to others."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise InsecureDirectoryError(f"{path}: does not exist") from None
    if stat.S_ISLNK(st.st_mode):
        raise InsecureDirectoryError(f"{path}: is a symlink; refusing to use it for the daemon socket")
    if not stat.S_ISDIR(st.st_mode):
        raise InsecureDirectoryError(f"{path}: is not a directory")
    if st.st_uid != os.getuid():
        raise InsecureDirectoryError(
            f"{path}: owned by uid {st.st_uid}, not by you (uid {os.getuid()}); refusing to use it. "
            "Remove it or set XDG_RUNTIME_DIR to a private directory.")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise InsecureDirectoryError(
            f"{path}: writable by group or others (mode {stat.S_IMODE(st.st_mode):o}); refusing to use it. "
            f"Run `chmod 700 {path}`.")


def ensure_private_dir(path: Path | None = None) -> Path:
    """Create the runtime directory 0700 if missing, then check it; returns it."""
    path = Path(path) if path is not None else runtime_dir()
    try:
        # mkdir's mode is filtered by the umask, which only ever removes bits.
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    check_private_dir(path)
    st = os.lstat(path)
    if stat.S_IMODE(st.st_mode) & 0o077:
        # Ours and not writable by others, but readable: tighten rather than refuse.
        os.chmod(path, 0o700)
    return path


def socket_path(directory: Path | None = None) -> Path:
    return (directory or runtime_dir()) / SOCKET_NAME


def peer_uid(sock: socket.socket) -> int | None:
    """uid of the process at the other end of a Unix socket, or None where the OS can't tell."""
    if sys.platform.startswith("linux") and hasattr(socket, "SO_PEERCRED"):
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", creds)
        return uid
    return None
