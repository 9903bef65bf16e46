""".gitignore rules of one workspace folder."""

from __future__ import annotations

import logging
import os
import threading

import pathspec

from completiond.completion.privacy import ALWAYS_SKIPPED_DIRS
from completiond.completion.workspace.diskread import Unreadable, read_regular

log = logging.getLogger(__name__)

MAX_IGNORE_FILE_BYTES = 1 << 20


class IgnoreRules:
    """.gitignore semantics for one workspace folder (nested .gitignore files included),
    plus hidden directories, which are never scanned.

    Specs are read lazily per directory and dropped when a .gitignore changes. Thread-safe: the
    watcher's thread, the I/O thread and requests all ask.
    """

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self.real_root = os.path.realpath(self.root)
        self._specs: dict[str, pathspec.GitIgnoreSpec | None] = {}
        self._lock = threading.Lock()

    def invalidate(self, directory: str | None = None) -> None:
        with self._lock:
            if directory is None:
                self._specs.clear()
            else:
                self._specs.pop(os.path.abspath(directory), None)

    def _spec(self, directory: str) -> pathspec.GitIgnoreSpec | None:
        with self._lock:
            if directory in self._specs:
                return self._specs[directory]
        spec = None
        path = os.path.join(directory, ".gitignore")
        try:
            data, _ = read_regular(path, MAX_IGNORE_FILE_BYTES)
            spec = pathspec.GitIgnoreSpec.from_lines(data.decode("utf-8", errors="replace").splitlines())
        except Unreadable as exc:
            if os.path.lexists(path):
                log.warning("cannot read %s: %s (not applying it)", path, exc)
        with self._lock:
            self._specs[directory] = spec
        return spec

    def ignored(self, path: str, is_dir: bool = False) -> bool:
        """Whether `path` (absolute, inside root) is ignored, by its own name or an ignored parent."""
        path = os.path.abspath(path)
        rel = os.path.relpath(path, self.root)
        if rel.startswith(".."):
            return True
        parts = rel.split(os.sep)
        if any(p in ALWAYS_SKIPPED_DIRS or p.startswith(".") for p in parts[:-1]) or (
            is_dir and (parts[-1] in ALWAYS_SKIPPED_DIRS or parts[-1].startswith("."))
        ):
            return True
        # Check every ancestor directory, then the path itself; at each level
        # the deepest .gitignore with a matching pattern decides.
        for depth in range(1, len(parts) + 1):
            target_is_dir = is_dir or depth < len(parts)
            decision = None
            for level in range(depth):
                base = os.path.join(self.root, *parts[:level])
                spec = self._spec(base)
                if spec is None:
                    continue
                sub = "/".join(parts[level:depth]) + ("/" if target_is_dir else "")
                res = spec.check_file(sub)
                if res.include is not None:
                    decision = res.include
            if decision:
                return True
        return False
