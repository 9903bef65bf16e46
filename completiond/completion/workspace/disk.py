"""The folders' files in the store: scans of a folder (or of a directory the watcher saw appear),
and the watcher's single-file events (a file written, removed or moved; a .gitignore changed).

Runs on the workspace's I/O thread (scans) and on the watcher's thread (events); the store's
lock is taken only around the store's changes, never around disk I/O.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from completiond.completion.languages import language_of
from completiond.completion.privacy import _inside, secret_match
from completiond.completion.workspace.diskread import read_source
from completiond.completion.workspace.folders import Folders
from completiond.completion.workspace.gitignore import IgnoreRules
from completiond.completion.workspace.store import DISK, DocumentStore

log = logging.getLogger(__name__)


class DiskSync:
    """max_scan_files / max_scan_dirs: how far one scan looks; it loads the most recently modified
    files it found, up to the store's max_bytes of text."""

    def __init__(self, store: DocumentStore, folders: Folders, max_scan_files: int = 5000, max_scan_dirs: int = 20000):
        self.store = store
        self.folders = folders
        self.max_scan_files = max_scan_files
        self.max_scan_dirs = max_scan_dirs
        self.scan_progress: dict[str, Any] = {"found": 0, "loaded": 0, "scanning": 0}

    # -- the watcher's events ------------------------------------------------
    def changed(self, path: str) -> None:
        """A file was created, written or closed after writing."""
        path = os.path.abspath(path)
        store = self.store
        if os.path.basename(path) == ".gitignore":
            rules = self.folders.rules_for(path)
            if rules is not None:
                rules.invalidate(os.path.dirname(path))
                self.recheck_ignored(rules)
            return
        with store.lock:
            rules = self.folders.rules_for(path)
        if (
            rules is None
            or language_of(path) is None
            or rules.ignored(path)
            or secret_match(path, rules.root) is not None
        ):
            return
        text, mtime = read_source(path, store.max_file_bytes, rules.real_root)
        if text is None:
            store.remove((DISK, path))
            return
        store.put(DISK, path, text, None, edit_line=None, touched=mtime)

    def removed(self, path: str, is_dir: bool) -> None:
        path = os.path.abspath(path)
        store = self.store
        if os.path.basename(path) == ".gitignore":
            rules = self.folders.rules_for(path)
            if rules is not None:
                rules.invalidate(os.path.dirname(path))
                with store.lock:
                    store.reindex_open()
            return
        with store.lock:
            if store.drop_where(lambda e: not e.open and (e.path == path or (is_dir and _inside(e.path, path)))):
                store.bump()

    def recheck_ignored(self, rules: IgnoreRules) -> None:
        """A .gitignore of the folder changed: its disk files now ignored leave, and the open documents
        the index holds are decided again."""
        store = self.store
        with store.lock:
            doomed = store.drop_where(lambda e: not e.open and _inside(e.path, rules.root) and rules.ignored(e.path))
            store.reindex_open()
            if doomed:
                store.bump()

    # -- scans ---------------------------------------------------------------
    def scan_dir(self, top: str) -> None:
        """Load the most recently modified source files under `top`, up to the budget."""
        top = os.path.abspath(top)
        rules = self.folders.rules_for(top)
        if rules is None or (top != rules.root and rules.ignored(top, is_dir=True)):
            return
        max_file_bytes = self.store.max_file_bytes
        found: list[tuple[float, str]] = []
        stack = [top]
        visited = 0
        while stack and len(found) < self.max_scan_files and visited < self.max_scan_dirs:
            d = stack.pop()
            visited += 1
            try:
                with os.scandir(d) as it:
                    for de in it:
                        try:
                            if de.is_dir(follow_symlinks=False):
                                if not rules.ignored(de.path, is_dir=True):
                                    stack.append(de.path)
                            elif de.is_file(follow_symlinks=False) and language_of(de.name) is not None:
                                st = de.stat(follow_symlinks=False)
                                if (
                                    st.st_size <= max_file_bytes
                                    and not rules.ignored(de.path)
                                    and secret_match(de.path, rules.root) is None
                                ):
                                    found.append((st.st_mtime, de.path))
                        except OSError:
                            continue  # vanished or unreadable entry: skip it, keep scanning
            except OSError as exc:
                log.debug("cannot scan %s: %s", d, exc)
        if stack:
            log.info("scan of %s stopped after %d directories and %d files (the limits)", top, visited, len(found))
        found.sort(reverse=True)
        with self.store.lock:
            self.scan_progress["found"] += len(found)
            self.scan_progress["scanning"] += 1
        try:
            self._load_found(found, rules)
        finally:
            with self.store.lock:
                self.scan_progress["scanning"] -= 1
                self.store.bump()

    def _load_found(self, found: list[tuple[float, str]], rules: IgnoreRules) -> None:
        store = self.store
        loaded = 0
        texts: list[tuple[str, str, float]] = []
        for _, path in found:
            if loaded >= store.max_bytes:
                break
            if store.has((DISK, path)):
                continue
            text, mtime = read_source(path, store.max_file_bytes, rules.real_root)
            if text is not None:
                texts.append((path, text, mtime))
                loaded += len(text)
        # Oldest first, so the LRU order matches modification times.
        for path, text, mtime in reversed(texts):
            with store.lock:
                if (DISK, path) in store.entries:
                    continue  # a watcher event got there first with newer text
                if self.folders.rules_for(path) is None:
                    continue  # the folder was removed meanwhile
            store.put(DISK, path, text, None, edit_line=None, touched=mtime)
            with store.lock:
                self.scan_progress["loaded"] += 1
