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
LOCK_NAME = "daemon.lock"  # held by the running daemon for its lifetime
SPAWN_LOCK_NAME = "spawn.lock"  # held by an LSP process while it starts a daemon
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
        return (
            f"the shared daemon needs Unix domain sockets and user ids, which this platform ({sys.platform}) "
            "does not offer"
        )
    return ""


def runtime_dir() -> Path:
    """The per-user directory for the socket, lock and log (not created here)."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "completiond"
    return Path(tempfile.gettempdir()) / f"completiond-{os.getuid()}"


def fallback_runtime_dir() -> Path:
    """Where the daemon lives when the default runtime directory is not safe (someone else's, a symlink,
    writable by others: e.g. a squatted $TMPDIR/completiond-<uid> when XDG_RUNTIME_DIR is unset): beside it
    in $XDG_RUNTIME_DIR when that directory itself is private, else under the user's own cache folder,
    which no other user can plant anything in."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        try:
            check_private_dir(Path(xdg))
            return Path(xdg) / "completiond-private"
        except InsecureDirectoryError:
            pass
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "completiond" / "run"


def usable_runtime_dir(directory: Path | None = None) -> tuple[Path, str]:
    """The runtime directory to use, created private, and a notice ('' when none) to tell the user once.

    An explicit `directory` is used or refused (InsecureDirectoryError), never replaced. The default one,
    when unsafe or impossible to create, is left alone and fallback_runtime_dir() is used instead, so
    completions keep working; the notice says why and where.
    """
    if directory is not None:
        return ensure_private_dir(directory), ""
    preferred = runtime_dir()
    try:
        return ensure_private_dir(preferred), ""
    except (InsecureDirectoryError, OSError) as exc:
        reason = str(exc)
    fallback = fallback_runtime_dir()
    os.makedirs(fallback.parent, mode=0o700, exist_ok=True)
    return ensure_private_dir(fallback), f"the daemon's directory {reason}; using {fallback} instead"


def current_runtime_dir() -> Path:
    """Where a running daemon is (for `completiond status` and `stop`): the default directory, or the
    fallback where the default exists but is unsafe (usable_runtime_dir went there)."""
    preferred = runtime_dir()
    if not os.path.lexists(preferred):
        return preferred
    try:
        check_private_dir(preferred)
    except InsecureDirectoryError:
        return fallback_runtime_dir()
    return preferred


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
            "Remove it or set XDG_RUNTIME_DIR to a private directory."
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise InsecureDirectoryError(
            f"{path}: writable by group or others (mode {stat.S_IMODE(st.st_mode):o}); refusing to use it. "
            f"Run `chmod 700 {path}`."
        )


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
