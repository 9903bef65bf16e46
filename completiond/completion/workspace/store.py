"""The workspace's texts: files read from disk and documents open in editors, in one LRU bounded
by bytes, kept in step with the retrieval index.

An entry is keyed (owner, path): owner DISK for a file read from a workspace folder (visible to
every editor whose folders contain it), else the editor that has the document open. Every change
runs under the workspace's lock (passed in) and notifies `changed`.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from completiond.completion import retrieval
from completiond.completion.languages import language_of
from completiond.completion.privacy import secret_match
from completiond.completion.workspace.folders import Folders
from completiond.completion.workspace.gate import Gate

DISK = None  # owner of the entries read from disk: visible to every editor whose folders contain them
LOCAL = 0  # the owner when one editor uses the workspace alone (in-process LSP, eval, tests)


@dataclass
class Entry:
    owner: Hashable  # DISK, or the editor that has the document open
    path: str
    language: str
    text: str
    nbytes: int
    touched: float  # last edit (editor) or modification (disk), for recency
    edit_line: int | None  # line of the last edit in the editor, if known

    @property
    def open(self) -> bool:
        return self.owner is not DISK


class DocumentStore:
    """max_bytes: total UTF-8 bytes of text kept (least recently touched disk files go first; open
    documents last). max_file_bytes: larger files are not kept. The index holds the entries the
    privacy gate admits as context (see `indexable`), updated with them.

    Methods that do not take the lock themselves say so: their caller holds it."""

    def __init__(
        self,
        lock: threading.RLock,
        folders: Folders,
        gate: Gate,
        index: retrieval.RetrievalIndex,
        max_bytes: int,
        max_file_bytes: int,
    ):
        self.lock = lock
        self.changed = threading.Condition(lock)
        self.folders = folders
        self.gate = gate
        self.index = index
        self.max_bytes = int(max_bytes)
        self.max_file_bytes = int(max_file_bytes)
        self.entries: OrderedDict[tuple[Hashable, str], Entry] = OrderedDict()  # LRU: least recently touched first
        self.bytes = 0
        self.version = 0

    # -- under the caller's lock ---------------------------------------------
    def bump(self) -> None:
        self.version += 1
        self.changed.notify_all()

    def drop(self, key: tuple[Hashable, str], index: bool = True) -> None:
        e = self.entries.pop(key, None)
        if e is not None:
            self.bytes -= e.nbytes
        if index:
            self.index.remove(key)

    def drop_where(self, doomed: Callable[[Entry], bool]) -> bool:
        """Drop the entries `doomed` picks; True if there were any."""
        keys = [k for k, e in self.entries.items() if doomed(e)]
        for k in keys:
            self.drop(k)
        return bool(keys)

    def indexable(self, owner: Hashable, path: str) -> bool:
        """Whether an entry's text may be retrieved as context: a disk file was admitted when it was
        read (inside a folder, not ignored or hidden, not on the deny-list); an editor's document
        only under the same rules (an open hidden, ignored or outside file stays out of the index)."""
        if os.path.basename(path).startswith("."):
            return False  # a hidden file (.dotfile.py), wherever it is, like a hidden folder's
        if owner is DISK:
            return True
        # Asked on every didChange: cached until folders or ignore rules change.
        return self.gate.context_ok(path, self.folders.of(owner))

    def reindex_open(self) -> None:
        """Folders or ignore rules changed: re-decide which open documents the index may hold."""
        self.gate.clear()
        for key, e in list(self.entries.items()):
            if e.open:
                if self.indexable(e.owner, e.path):
                    if key not in self.index.by_key:
                        self.index.update(key, e.path, e.language, e.text)
                else:
                    self.index.remove(key)

    def _evict(self) -> None:
        while self.bytes > self.max_bytes and self.entries:
            victim = next((k for k, e in self.entries.items() if not e.open), None)
            if victim is None:
                victim = next(iter(self.entries))
            self.drop(victim)

    # -- taking the lock -------------------------------------------------------
    def put(
        self,
        owner: Hashable,
        path: str,
        text: str,
        language: str | None,
        edit_line: int | None,
        touched: float | None = None,
    ) -> None:
        """Keep `text` as (owner, path), or drop that entry where the text may not be kept (no source
        language, too big, on the deny-list)."""
        language = language or language_of(path)
        nbytes = len(text.encode("utf-8", errors="replace"))
        key = (owner, path)
        # Chunked (and, for a disk file, tokenized) here, outside the lock: a scan never holds it long.
        prepared = None
        with self.lock:
            old = self.entries.get(key)
            edit = old is not None and key in self.index.by_key  # a keystroke, or a file saved again
        if language is not None and nbytes <= self.max_file_bytes and not edit:
            prepared = retrieval.prepare(text, self.index.max_chunks_per_file, parse=owner is DISK, language=language)
        with self.lock:
            old = self.entries.get(key)
            if (
                language is None
                or nbytes > self.max_file_bytes
                or nbytes > self.max_bytes
                or secret_match(path, self.folders.root_of(path)) is not None
            ):
                if old is not None:
                    self.drop(key)
                    self.bump()
                return
            if old is not None:
                if edit_line is None and old.text == text:
                    edit_line = old.edit_line
                self.drop(key, index=False)
            self.entries[key] = Entry(
                owner, path, language, text, nbytes, touched if touched is not None else time.time(), edit_line
            )
            self.bytes += nbytes
            if not self.indexable(owner, path):
                self.index.remove(key)
            elif not (
                old is not None
                and key in self.index.by_key
                and self.index.update_edit(key, path, language, old.text, text)
            ):
                self.index.update(key, path, language, text, prepared, keep_outline=owner is not DISK)
            self._evict()
            self.bump()

    def remove(self, key: tuple[Hashable, str]) -> bool:
        """Drop one entry; True if it was there."""
        with self.lock:
            if key not in self.entries:
                return False
            self.drop(key)
            self.bump()
            return True

    def get(self, owner: Hashable, path: str) -> str | None:
        """`owner`'s open copy of the file, else the disk copy."""
        with self.lock:
            e = self.entries.get((owner, path)) or self.entries.get((DISK, path))
            return e.text if e else None

    def has(self, key: tuple[Hashable, str]) -> bool:
        with self.lock:
            return key in self.entries

    def paths(self) -> list[str]:
        with self.lock:
            return list(dict.fromkeys(e.path for e in self.entries.values()))

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
        """Block until predicate() holds (re-checked on every change) or timeout."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.changed.wait(min(left, 0.1))
            return True
