"""Workspace context: watched folders, open documents, and the context block.

The daemon keeps one `Workspace` for every editor. An entry is either a file read
from disk (owner DISK), kept current by a watchdog observer over the workspace
folders, or a document open in one editor (owner: that editor). An editor's
context is drawn from its own open documents and the disk files under its own
folders only; a document leaves when its editor closes it, everything of an
editor when it disconnects, a folder's files when no editor has the folder.

What may be read from disk: regular files (checked before opening, opened
non-blocking, never through a symlink whose target leaves the folder, checked
at every read) under a workspace folder, not .gitignored, not in a hidden or
vendored directory, with a source extension, under the size cap, and not on the
deny-list of secret-bearing names (privacy.SECRET_NAMES, SECRET_DIRS; the
contextExclude setting adds to it). What may enter a prompt: snippets of those
and of the editor's own open documents, minus the deny-list again. Each file
read and each file sent as context is logged at debug level.

`Workspace` is the facade over the parts, each in its own module and all under one lock
(the facade's, shared with them):

  folders.py    the folders and the editors that added each; gitignore.py  their ignore rules
  gate.py       the privacy gate (privacy.classify) with those rules, its verdicts cached
  store.py      the texts (disk files and open documents) in one LRU bounded by bytes, kept in
                step with the retrieval index (completion/retrieval.py)
  disk.py       scans, and the watcher's file events, into the store; diskread.py  safe reads
  watcher.py    the watchdog observer within the inotify budget, and the one I/O thread
  context.py    picking the context block: recent files, or retrieval's sticky block

`context(current_path, language, budget_tokens, count_tokens, owner=...)` returns
(path, snippet) pairs of recently edited and open files of the same language
for the prompt builder. The result is ordered by path, not by recency, and
depends only on other files: typing in the current file never changes it, so
the context block's KV stays cached across keystrokes.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Hashable, Iterable
from typing import Any

from completiond.completion import retrieval
from completiond.completion.languages import language_of
from completiond.completion.privacy import Verdict, _inside, classify
from completiond.completion.selection import Selector
from completiond.completion.workspace.context import ContextPicker
from completiond.completion.workspace.disk import DiskSync
from completiond.completion.workspace.folders import Folders
from completiond.completion.workspace.gate import Gate
from completiond.completion.workspace.store import DISK, LOCAL, DocumentStore
from completiond.completion.workspace.watcher import FolderWatcher

__all__ = ["DISK", "LOCAL", "Workspace"]

log = logging.getLogger(__name__)


class Workspace:
    """Bounded store of workspace files and open documents, kept current by watchdog.

    Entries belong to an owner: DISK for files read from the folders, else the editor that has
    the document open. `context(..., owner=X)` sees X's open documents and the disk files
    under X's folders only.

    max_bytes: total UTF-8 bytes of text kept (least recently touched disk files go first;
    open documents last). max_file_bytes: larger files are skipped. max_watched_dirs: the
    directories all watched folders may hold together (each is an inotify watch); a folder
    past it is scanned but not watched. Disk I/O (folder set-up, scans, re-reads after a
    close) runs on one background thread, never on the caller's.
    """

    def __init__(
        self,
        folders: Iterable[str | os.PathLike] = (),
        max_bytes: int = 8 << 20,
        max_file_bytes: int = 256 << 10,
        scan: bool = True,
        max_scan_files: int = 5000,
        snippet_lines: int = 60,
        max_files: int = 4,
        max_watched_dirs: int | None = None,
        max_watched_folders: int = 32,
        max_scan_dirs: int = 20000,
        max_index_chunks: int = 200_000,
    ):
        self.scan_on_start = scan
        self._lock = threading.RLock()
        self._folders = Folders()
        self.gate = Gate(self._folders)
        # Retrieval: chunks of the texts admitted as context (see DocumentStore.indexable), updated with them.
        self.index = retrieval.RetrievalIndex(max_chunks=max_index_chunks)
        self.store = DocumentStore(self._lock, self._folders, self.gate, self.index, max_bytes, max_file_bytes)
        self.disk = DiskSync(self.store, self._folders, max_scan_files, max_scan_dirs)
        self.watcher = FolderWatcher(self._lock, self._folders, self.disk, max_watched_dirs, max_watched_folders)
        self.picker = ContextPicker(self.store, self._folders, self.gate, snippet_lines, max_files)
        for f in folders:
            self.add_folder(f)

    @property
    def selector(self) -> Selector:
        return self.picker.selector

    @property
    def block_changes(self) -> int:
        """Retrieval blocks that differed from the last one for the same file."""
        return self.picker.block_changes

    @property
    def version(self) -> int:
        return self.store.version

    @property
    def scan_progress(self) -> dict[str, Any]:
        return self.disk.scan_progress

    # -- lifecycle -------------------------------------------------------
    def start(self, wait: bool = True) -> Workspace:
        """Start watching the folders (set up on the I/O thread; `wait` blocks until it is done)."""
        started = self.watcher.start()
        if started is None:
            return self
        done, roots = started
        if self.scan_on_start:
            for root in roots:
                self.watcher.submit(self.disk.scan_dir, root)
        if wait:
            done.wait(30)
        return self

    def stop(self, timeout: float = 2.0) -> None:
        """Stop watching; returns within about `timeout` seconds even if a watcher thread is stuck."""
        self.watcher.stop(timeout)

    def __enter__(self) -> Workspace:  # noqa: PYI034  (start() returns the Workspace)
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def add_folder(self, folder: str | os.PathLike, owner: Hashable = LOCAL, wait: bool = True) -> None:
        """Add a workspace folder of `owner`. The checks, the watch and the scan run on the I/O
        thread; with wait=False this returns at once (an invalid folder is logged there)."""
        root = os.path.abspath(os.fspath(folder))
        if not wait:
            self.watcher.submit(self._add_folder, root, owner)
            return
        error: list[BaseException] = []
        self.watcher.submit(self._add_folder, root, owner, error).wait(30)
        if error:
            raise error[0]

    def _add_folder(self, root: str, owner: Hashable, error: list | None = None) -> None:
        if not os.path.isdir(root):
            exc = NotADirectoryError(f"workspace folder {root} is not a directory")
            if error is not None:
                error.append(exc)
            else:
                log.warning("%s; ignored", exc)
            return
        with self._lock:
            if self.watcher.closed:
                return
            new = self._folders.add(root, owner)
            if new:
                self.store.reindex_open()
            started = self.watcher.started
        if new and started:
            self.watcher.rewatch()
            if self.scan_on_start:
                self.disk.scan_dir(root)

    def remove_folder(self, folder: str | os.PathLike, owner: Hashable = LOCAL, wait: bool = True) -> None:
        """`owner` no longer has this folder; once nobody has it, its watch and disk files go."""
        root = os.path.abspath(os.fspath(folder))
        folders, store = self._folders, self.store
        with self._lock:
            if not folders.remove(root, owner):
                return
            self.watcher.unwatched.discard(root)
            store.drop_where(lambda e: e.owner is DISK and _inside(e.path, root) and folders.rules_for(e.path) is None)
            store.reindex_open()
            store.bump()
        done = self.watcher.submit(self.watcher.rewatch)
        if wait:
            done.wait(30)

    def drop_owner(self, owner: Hashable) -> None:
        """An editor went away: its open documents leave at once, its folders once nobody else has them."""
        with self._lock:
            self.store.drop_where(lambda e: e.owner == owner)
            folders = self._folders.of(owner)
            self.store.bump()
        for root in folders:
            self.remove_folder(root, owner, wait=False)

    def folders(self, owner: Hashable = LOCAL) -> list[str]:
        with self._lock:
            return self._folders.of(owner)

    def scan(self) -> None:
        """Load the folders' most recent source files now, in this thread (no watcher needed)."""
        for root in list(self._folders):
            self.disk.scan_dir(root)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until the I/O thread has done everything queued so far."""
        return self.watcher.submit(lambda: None).wait(timeout)

    # -- editor events ------------------------------------------------------
    def did_open(
        self, path: str | os.PathLike, text: str, language: str | None = None, owner: Hashable = LOCAL
    ) -> None:
        self.store.put(owner, os.path.abspath(os.fspath(path)), text, language, edit_line=None)

    def did_change(
        self,
        path: str | os.PathLike,
        text: str,
        edit_line: int | None = None,
        language: str | None = None,
        owner: Hashable = LOCAL,
    ) -> None:
        self.store.put(owner, os.path.abspath(os.fspath(path)), text, language, edit_line=edit_line)

    def did_close(self, path: str | os.PathLike, owner: Hashable = LOCAL) -> None:
        """The editor's copy leaves at once; the disk copy is re-read (on the I/O thread) only
        where a folder's rules allow it, so a closed ignored or outside file is gone for good."""
        path = os.path.abspath(os.fspath(path))
        with self._lock:
            self.store.remove((owner, path))
            inside = self._folders.rules_for(path) is not None
        if inside:
            self.watcher.submit(self.disk.changed, path)

    def forget(self, path: str | os.PathLike, owner: Hashable = LOCAL) -> None:
        """Drop the editor's copy without re-reading the disk's (eval: the document it opened per position)."""
        path = os.path.abspath(os.fspath(path))
        with self._lock:
            if self.store.remove((owner, path)):
                self.selector.forget((owner, path))

    # -- queries ---------------------------------------------------------
    def get(self, path: str | os.PathLike, owner: Hashable = LOCAL) -> str | None:
        """`owner`'s open copy of the file, else the disk copy."""
        return self.store.get(owner, os.path.abspath(os.fspath(path)))

    def paths(self) -> list[str]:
        return self.store.paths()

    def __len__(self) -> int:
        return len(self.store.entries)

    @property
    def memory_bytes(self) -> int:
        return self.store.bytes

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
        """Block until predicate() holds (re-checked on every change) or timeout."""
        return self.store.wait_for(predicate, timeout)

    def context(
        self,
        current_path: str | os.PathLike | None,
        language: str | None,
        budget_tokens: int,
        count_tokens: Callable[[str], int] | None = None,
        owner: Hashable = LOCAL,
        exclude: Iterable[str] = (),
        text: str | None = None,
        offset: int | None = None,
        mode: str = "recent",
        window_tokens: tuple[int, int] = (1024, 256),
        roots: Iterable[str] = (),
    ) -> list[tuple[str, str]]:
        """(relative path, snippet) pairs for the prompt's context block.

        mode "retrieval" (with the document's `text` and cursor `offset`): the chunks the code
        around the cursor needs, from the repository index (see `retrieve`). Otherwise ("recent"):
        snippets of recently touched files, ordered by path (ContextPicker.recent).

        Both draw on `owner`'s open documents and the disk files under `owner`'s folders, minus the
        deny-list (built in, plus the glob patterns `exclude`); `roots`: folders `owner` announced that may
        not be set up yet (as for `admission`). Fitted into budget_tokens as counted
        by count_tokens (default: chars / 4). Each file chosen is logged at debug level: that log is
        the record of what left the editor for the model.
        """
        if budget_tokens <= 0:
            return []
        count = self.picker.counter(count_tokens)
        current = os.path.abspath(os.fspath(current_path)) if current_path else None
        if language is None and current is not None:
            language = language_of(current)
        exclude = tuple(exclude)
        if mode == "retrieval" and text is not None and offset is not None:
            return self.picker.retrieve(
                current, language, text, offset, budget_tokens, count, owner, exclude, window_tokens, roots
            )
        return self.picker.recent(current, language, budget_tokens, count, owner, exclude, roots)

    def admission(
        self,
        path: str | os.PathLike | None,
        owner: Hashable = LOCAL,
        exclude: Iterable[str] = (),
        roots: Iterable[str] = (),
    ) -> Verdict:
        """The privacy gate's verdict (privacy.classify) on `path` for `owner`: its workspace folders (plus
        `roots`, folders the caller knows of that may not be registered yet) and their ignore rules."""
        if path is None:
            return classify(None, ())
        with self._lock:
            mine = self._folders.of(owner, roots)
        return self.gate.admit(os.path.abspath(os.fspath(path)), mine, tuple(exclude))

    def relative_path(self, path: str | os.PathLike) -> str:
        """Path as the context block and the current file's header name it (relative to its folder)."""
        return self._folders.relpath(os.path.abspath(os.fspath(path)))

    def index_status(self) -> dict[str, Any]:
        """The retrieval index and the background scan, for status and progress: files and chunks indexed,
        source files the scans found and loaded so far, and whether a scan is running."""
        with self._lock:
            progress = self.disk.scan_progress
            return {
                "files": self.index.files(),
                "chunks": len(self.index),
                "found": progress["found"],
                "loaded": progress["loaded"],
                "scanning": progress["scanning"] > 0,
            }
