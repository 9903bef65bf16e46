"""Reading a file descriptor without trusting its size (base layer: imports nothing of ours).

A file can grow between fstat and read, or claim a size it does not have (/dev/zero, a FIFO):
read at most one byte past the limit, so "over the limit" is always detected and never
costs more than limit + 1 bytes of memory.
"""

from __future__ import annotations

import os


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
