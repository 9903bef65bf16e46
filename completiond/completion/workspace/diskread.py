"""Reading a workspace file from disk, safely: regular files only, bounded, never through a
symlink that leaves the folder, never blocking on a FIFO or device."""

from __future__ import annotations

import logging
import os
import stat

from completiond.completion.privacy import _inside
from completiond.fileio import read_at_most

log = logging.getLogger(__name__)


class Unreadable(Exception):
    """A file the workspace will not read; the message says why."""


def read_regular(path: str, limit: int, inside: str | None = None) -> tuple[bytes, os.stat_result]:
    """Contents of a regular file of at most `limit` bytes.

    Raises Unreadable for anything else: missing, too big, a FIFO, socket or device (checked
    before opening, and opened non-blocking, so nothing here can wait on a writer), or a
    symlink whose target is not inside `inside` (a real path). The file opened is the one
    checked: the final component is opened without following symlinks and its inode compared.
    """
    real = os.path.realpath(path)
    if inside is not None and not _inside(real, inside):
        raise Unreadable(f"it leads to {real}, outside the workspace folder {inside}")
    try:
        st = os.lstat(real)
    except OSError as exc:
        raise Unreadable(exc.strerror or str(exc)) from None
    if not stat.S_ISREG(st.st_mode):
        raise Unreadable("not a regular file")
    if st.st_size > limit:
        raise Unreadable(f"{st.st_size} bytes, over the {limit}-byte limit")
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise Unreadable(exc.strerror or str(exc)) from None
    try:
        fst = os.fstat(fd)
        if not stat.S_ISREG(fst.st_mode) or (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
            raise Unreadable("replaced while being opened")
        data = read_at_most(fd, limit)
    except OSError as exc:
        raise Unreadable(exc.strerror or str(exc)) from None
    finally:
        os.close(fd)
    if data is None:
        raise Unreadable(f"grew over the {limit}-byte limit")
    return data, fst


def read_source(path: str, limit: int, inside: str) -> tuple[str | None, float]:
    """(text, modification time) of a source file, or (None, 0.0) if missing, huge, binary, not UTF-8,
    not a regular file, or a symlink leading out of its workspace folder (`inside`, a real path)."""
    try:
        data, st = read_regular(path, limit, inside=inside)
    except Unreadable as exc:
        log.debug("not reading %s: %s", path, exc)
        return None, 0.0
    if b"\x00" in data[:8192]:
        return None, 0.0
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None, 0.0
    log.debug("read %s for the workspace context (%d bytes)", path, len(data))
    return text, st.st_mtime
