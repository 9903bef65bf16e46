"""Reading files without trusting their size or their kind (base layer: imports nothing of ours).

A file can grow between fstat and read, or claim a size it does not have (/dev/zero, a FIFO):
read at most one byte past the limit, so "over the limit" is always detected and never
costs more than limit + 1 bytes of memory. `read_file` is how every side file of a model
(config, tokenizer, completiond.json, calibration records) is read: a regular file (a
symlink may lead to one: the hub cache is made of them), under a size cap, or an error at once.
`user_cache_dir` is where the caches completiond keeps (and the hub's default) live; `write_text_atomic`
is how its small records are written.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


class UnsafeFile(OSError):
    """A file that is not a regular file, or is larger than its cap; the message names it and why."""


def read_at_most(fd: int, limit: int) -> bytes | None:
    """The file's bytes from the current position, or None when there are more than `limit`."""
    chunks, size = [], 0
    while size <= limit:
        chunk = os.read(fd, limit + 1 - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return None if size > limit else b"".join(chunks)


def read_file(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of the regular file at `path` (symlinks followed), at most `limit` of them.

    Raises FileNotFoundError (and other OSErrors) as open does, and UnsafeFile for a device, FIFO,
    socket or directory (opened non-blocking and checked on the descriptor, so nothing waits on a
    writer and nothing is read from /dev/zero) or a file over the limit, before reading more than
    limit + 1 bytes."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile(f"{path} is not a regular file ({_kind(st.st_mode)}{_target(path)}); refusing to read it")
        if st.st_size > limit:
            raise UnsafeFile(f"{path} is {st.st_size} bytes, over the {limit}-byte limit for this file")
        data = read_at_most(fd, limit)
    finally:
        os.close(fd)
    if data is None:
        raise UnsafeFile(f"{path} grew over the {limit}-byte limit for this file while being read")
    return data


def check_file(path: str | os.PathLike, limit: int) -> None:
    """That `path` (symlinks followed) is a regular file of at most `limit` bytes, without reading it:
    for files another library reads (a tokenizer's), checked first. Raises as read_file does."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFile(f"{path} is not a regular file ({_kind(st.st_mode)}{_target(path)}); refusing to read it")
    if st.st_size > limit:
        raise UnsafeFile(f"{path} is {st.st_size} bytes, over the {limit}-byte limit for this file")


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return name
    return "not a file"


def _target(path: str | os.PathLike) -> str:
    return f", a link to {os.path.realpath(path)}" if os.path.islink(path) else ""


def user_cache_dir() -> Path:
    """The user's cache root: $XDG_CACHE_HOME, else ~/.cache. Read at each call, so a process (or a test)
    that sets the variable moves every cache with it."""
    return Path(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"))


def write_text_atomic(path: Path, text: str) -> None:
    """path's new contents, all or nothing: written beside it under a name of this process's own, then
    renamed over it, so two processes writing the same record at once each leave a whole file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
