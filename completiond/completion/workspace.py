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
deny-list of secret-bearing names (SECRET_NAMES, SECRET_DIRS; the
contextExclude setting adds to it). What may enter a prompt: snippets of those
and of the editor's own open documents, minus the deny-list again. Each file
read and each file sent as context is logged at debug level.

`context(current_path, language, budget_tokens, count_tokens, owner=...)` returns
(path, snippet) pairs of recently edited and open files of the same language
for the prompt builder. The result is ordered by path, not by recency, and
depends only on other files: typing in the current file never changes it, so
the context block's KV stays cached across keystrokes.
"""

from __future__ import annotations

import logging
import os
import queue
import stat
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable

import pathspec

from completiond.completion import retrieval
from completiond.fileio import read_at_most
from completiond.completion.privacy import (  # noqa: F401  (re-exported: the deny-list's old home)
    ALWAYS_SKIPPED_DIRS, CONFIG_SECRET_DIRS, SECRET_DIRS, SECRET_NAMES, Admission, Verdict, _inside, classify,
    secret_match)

log = logging.getLogger(__name__)

# extension -> (language id as editors name it, line comment marker)
LANGUAGES: dict[str, tuple[str, str]] = {
    ".py": ("python", "#"), ".pyi": ("python", "#"),
    ".js": ("javascript", "//"), ".mjs": ("javascript", "//"), ".cjs": ("javascript", "//"), ".jsx": ("javascriptreact", "//"),
    ".ts": ("typescript", "//"), ".tsx": ("typescriptreact", "//"),
    ".go": ("go", "//"), ".rs": ("rust", "//"), ".java": ("java", "//"), ".kt": ("kotlin", "//"), ".scala": ("scala", "//"),
    ".c": ("c", "//"), ".h": ("c", "//"), ".cc": ("cpp", "//"), ".cpp": ("cpp", "//"), ".hpp": ("cpp", "//"), ".cxx": ("cpp", "//"),
    ".cs": ("csharp", "//"), ".swift": ("swift", "//"), ".php": ("php", "//"), ".dart": ("dart", "//"),
    ".rb": ("ruby", "#"), ".sh": ("shellscript", "#"), ".bash": ("shellscript", "#"), ".zsh": ("shellscript", "#"),
    ".lua": ("lua", "--"), ".sql": ("sql", "--"), ".hs": ("haskell", "--"), ".r": ("r", "#"), ".jl": ("julia", "#"),
    ".pl": ("perl", "#"), ".ex": ("elixir", "#"), ".exs": ("elixir", "#"), ".toml": ("toml", "#"), ".yaml": ("yaml", "#"),
    ".yml": ("yaml", "#"), ".vim": ("vim", '"'), ".zig": ("zig", "//"), ".nim": ("nim", "#"),
}
COMMENTS = {lang: comment for lang, comment in LANGUAGES.values()}


def language_of(path: str | os.PathLike) -> str | None:
    entry = LANGUAGES.get(os.path.splitext(str(path))[1].lower())
    return entry[0] if entry else None


def comment_for(language: str | None) -> str | None:
    return COMMENTS.get(language or "")


DISK = None   # owner of the entries read from disk: visible to every editor whose folders contain them
LOCAL = 0     # the owner when one editor uses the workspace alone (in-process LSP, eval, tests)

# The deny-list and the gate live in privacy.py (one rule for the current document and for context).
MAX_IGNORE_FILE_BYTES = 1 << 20


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


def default_watch_budget() -> int:
    """Directories all folders together may watch: a quarter of the user's inotify watches
    (editors and other tools need theirs), at most 16,384."""
    try:
        with open("/proc/sys/fs/inotify/max_user_watches", "rb") as f:
            limit = int(f.read(32).strip())
    except (OSError, ValueError):
        return 8192
    return max(256, min(16384, limit // 4))


@dataclass
class _Entry:
    owner: Hashable         # DISK, or the editor that has the document open
    path: str
    language: str
    text: str
    nbytes: int
    touched: float          # last edit (editor) or modification (disk), for recency
    edit_line: int | None   # line of the last edit in the editor, if known

    @property
    def open(self) -> bool:
        return self.owner is not DISK


class IgnoreRules:
    """.gitignore semantics for one workspace folder (nested .gitignore files included),
    plus hidden directories, which are never scanned.

    Specs are read lazily per directory and dropped when a .gitignore changes.
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
                is_dir and (parts[-1] in ALWAYS_SKIPPED_DIRS or parts[-1].startswith("."))):
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


class _Handler:
    """watchdog event sink; methods named as FileSystemEventHandler expects.

    The observer holds its lock while this runs, and stopping the observer waits for that
    lock: so nothing here may block. Single files are read here (regular files only, opened
    non-blocking); whole directories are scanned on the workspace's I/O thread.
    """

    def __init__(self, ws: "Workspace"):
        self.ws = ws

    def dispatch(self, event) -> None:
        try:
            kind = event.event_type
            src = os.fsdecode(event.src_path)
            if kind in ("created", "modified", "closed"):
                if event.is_directory:
                    if kind == "created":
                        self.ws._submit(self.ws._scan_dir, src)
                else:
                    self.ws._disk_changed(src)
            elif kind == "deleted":
                self.ws._disk_removed(src, event.is_directory)
            elif kind == "moved":
                self.ws._disk_removed(src, event.is_directory)
                dest = os.fsdecode(event.dest_path)
                if event.is_directory:
                    self.ws._submit(self.ws._scan_dir, dest)
                else:
                    self.ws._disk_changed(dest)
        except Exception:  # a watcher thread that dies silently stops all context updates
            log.exception("workspace watcher failed on %r", event)


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

    def __init__(self, folders: Iterable[str | os.PathLike] = (), max_bytes: int = 8 << 20,
                 max_file_bytes: int = 256 << 10, scan: bool = True, max_scan_files: int = 5000,
                 snippet_lines: int = 60, max_files: int = 4, max_watched_dirs: int | None = None,
                 max_watched_folders: int = 32, max_scan_dirs: int = 20000, max_index_chunks: int = 200_000):
        self.max_bytes = int(max_bytes)
        self.max_file_bytes = int(max_file_bytes)
        self.scan_on_start = scan
        self.max_scan_files = max_scan_files
        self.max_scan_dirs = max_scan_dirs
        self.snippet_lines = snippet_lines
        self.max_files = max_files
        self.max_watched_dirs = default_watch_budget() if max_watched_dirs is None else max_watched_dirs
        self.max_watched_folders = max_watched_folders
        self._folders: dict[str, IgnoreRules] = {}
        self._owners: dict[str, set] = {}                                # folder -> editors that added it
        self._entries: OrderedDict[tuple[Hashable, str], _Entry] = OrderedDict()  # LRU: least recently touched first
        self._bytes = 0
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self.version = 0
        self._observer = None
        self._watches: dict[str, tuple[object, int]] = {}                # folder -> (watch, directories)
        self._unwatched: set[str] = set()                                # folders refused a watch (logged once)
        self._token_counts: OrderedDict[str, int] = OrderedDict()
        # Retrieval: chunks of the texts admitted as context (see _indexable), updated with them.
        self.index = retrieval.RetrievalIndex(max_chunks=max_index_chunks)
        self.selector = retrieval.Selector()
        self.block_changes = 0          # retrieval blocks that differed from the last one for the same file
        self._last_block: dict[tuple, tuple] = {}
        self._verdicts: dict[tuple, bool] = {}   # (path, owner's folders, exclude) -> the gate's remote_ok
        self.scan_progress: dict[str, Any] = {"found": 0, "loaded": 0, "scanning": 0}
        self._io: queue.SimpleQueue = queue.SimpleQueue()
        self._io_thread: threading.Thread | None = None
        self._closed = False
        for f in folders:
            self.add_folder(f)

    # -- lifecycle -------------------------------------------------------
    def start(self, wait: bool = True) -> "Workspace":
        """Start watching the folders (set up on the I/O thread; `wait` blocks until it is done)."""
        from watchdog.observers import Observer

        with self._lock:
            if self._observer is not None or self._closed:
                return self
            self._observer = Observer()
            self._observer.daemon = True
            self._observer.start()
            roots = list(self._folders)
        done = self._submit(self._rewatch)
        if self.scan_on_start:
            for root in roots:
                self._submit(self._scan_dir, root)
        if wait:
            done.wait(30)
        return self

    def stop(self, timeout: float = 2.0) -> None:
        """Stop watching; returns within about `timeout` seconds even if a watcher thread is stuck
        (the threads are daemons: a stuck one cannot hold the process up)."""
        with self._lock:
            obs, self._observer = self._observer, None
            self._watches.clear()
            self._closed = True
            io_thread = self._io_thread
        self._io.put(None)
        if obs is not None:
            stopper = threading.Thread(target=lambda: (obs.stop(), obs.join(timeout)), daemon=True,
                                       name="workspace-stop")
            stopper.start()
            stopper.join(timeout)
            if stopper.is_alive():
                log.warning("workspace watcher did not stop within %g s; leaving it behind", timeout)
        if io_thread is not None and io_thread is not threading.current_thread():
            io_thread.join(timeout)

    def __enter__(self) -> "Workspace":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def add_folder(self, folder: str | os.PathLike, owner: Hashable = LOCAL, wait: bool = True) -> None:
        """Add a workspace folder of `owner`. The checks, the watch and the scan run on the I/O
        thread; with wait=False this returns at once (an invalid folder is logged there)."""
        root = os.path.abspath(os.fspath(folder))
        if not wait:
            self._submit(self._add_folder, root, owner)
            return
        error: list[BaseException] = []
        self._submit(self._add_folder, root, owner, error).wait(30)
        if error:
            raise error[0]

    def remove_folder(self, folder: str | os.PathLike, owner: Hashable = LOCAL, wait: bool = True) -> None:
        """`owner` no longer has this folder; once nobody has it, its watch and disk files go."""
        root = os.path.abspath(os.fspath(folder))
        with self._lock:
            owners = self._owners.get(root)
            if owners is None:
                return
            owners.discard(owner)
            if owners:
                return
            del self._owners[root]
            self._folders.pop(root, None)
            self._unwatched.discard(root)
            for key in [k for k, e in self._entries.items() if e.owner is DISK and _inside(e.path, root)
                        and self._rules_for(e.path) is None]:
                self._drop(key)
            self._reindex_open()
            self._bump()
        done = self._submit(self._rewatch)
        if wait:
            done.wait(30)

    def drop_owner(self, owner: Hashable) -> None:
        """An editor went away: its open documents leave at once, its folders once nobody else has them."""
        with self._lock:
            for key in [k for k in self._entries if k[0] == owner]:
                self._drop(key)
            folders = [root for root, owners in self._owners.items() if owner in owners]
            self._bump()
        for root in folders:
            self.remove_folder(root, owner, wait=False)

    def folders(self, owner: Hashable = LOCAL) -> list[str]:
        with self._lock:
            return [root for root, owners in self._owners.items() if owner in owners]

    def scan(self) -> None:
        """Load the folders' most recent source files now, in this thread (no watcher needed)."""
        for root in list(self._folders):
            self._scan_dir(root)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until the I/O thread has done everything queued so far."""
        return self._submit(lambda: None).wait(timeout)

    # -- the I/O thread --------------------------------------------------
    def _submit(self, fn: Callable, *args: Any) -> threading.Event:
        done = threading.Event()
        with self._lock:
            if self._closed:
                done.set()
                return done
            if self._io_thread is None:
                self._io_thread = threading.Thread(target=self._io_loop, daemon=True, name="workspace-io")
                self._io_thread.start()
        self._io.put((fn, args, done))
        return done

    def _io_loop(self) -> None:
        while True:
            item = self._io.get()
            if item is None:
                return
            fn, args, done = item
            try:
                fn(*args)
            except Exception:  # one failed task (a vanished folder, a bug) must not stop the others
                log.exception("workspace task %s failed", getattr(fn, "__name__", fn))
            finally:
                done.set()

    def _add_folder(self, root: str, owner: Hashable, error: list | None = None) -> None:
        if not os.path.isdir(root):
            exc = NotADirectoryError(f"workspace folder {root} is not a directory")
            if error is not None:
                error.append(exc)
            else:
                log.warning("%s; ignored", exc)
            return
        with self._lock:
            if self._closed:
                return
            owners = self._owners.setdefault(root, set())
            new = not owners
            owners.add(owner)
            if new:
                self._folders[root] = IgnoreRules(root)
                self._reindex_open()
            started = self._observer is not None
        if new and started:
            self._rewatch()
            if self.scan_on_start:
                self._scan_dir(root)

    def _rewatch(self) -> None:
        """Watch the outermost folders within the budgets; unwatch folders that are gone.
        Runs on the I/O thread: walking and registering a big tree takes a while."""
        with self._lock:
            obs = self._observer
            roots = sorted(self._folders)
        if obs is None:
            return
        wanted: list[str] = []
        for root in roots:
            if not any(_inside(root, w) for w in wanted):  # an enclosing folder's watch covers it
                wanted.append(root)
        for root in [r for r in list(self._watches) if r not in wanted]:
            watch, _ = self._watches.pop(root, (None, 0))
            if watch is None:
                continue
            try:
                obs.unschedule(watch)
            except (KeyError, OSError) as exc:
                log.debug("unwatching %s: %s", root, exc)
        for root in wanted:
            if root in self._watches:
                continue
            used = sum(n for _, n in list(self._watches.values()))
            budget = self.max_watched_dirs - used
            if len(self._watches) >= self.max_watched_folders:
                self._not_watched(root, f"{self.max_watched_folders} folders are watched already")
                continue
            dirs = _count_dirs(root, budget + 1)
            if dirs > budget:
                self._not_watched(root, f"it holds over {budget} directories, the watch budget left "
                                        f"({self.max_watched_dirs} in all)")
                continue
            try:
                self._watches[root] = (obs.schedule(_Handler(self), root, recursive=True), dirs)
                self._unwatched.discard(root)
            except OSError as exc:
                # e.g. the user's inotify watches are used up: keep open documents working.
                self._not_watched(root, str(exc))

    def _not_watched(self, root: str, why: str) -> None:
        if root not in self._unwatched:
            self._unwatched.add(root)
            log.warning("not watching workspace folder %s: %s; its context comes from the start-up scan and "
                        "open documents only", root, why)

    # -- editor events ------------------------------------------------------
    def did_open(self, path: str | os.PathLike, text: str, language: str | None = None,
                 owner: Hashable = LOCAL) -> None:
        self._put(owner, os.path.abspath(os.fspath(path)), text, language, edit_line=None)

    def did_change(self, path: str | os.PathLike, text: str, edit_line: int | None = None,
                   language: str | None = None, owner: Hashable = LOCAL) -> None:
        self._put(owner, os.path.abspath(os.fspath(path)), text, language, edit_line=edit_line)

    def did_close(self, path: str | os.PathLike, owner: Hashable = LOCAL) -> None:
        """The editor's copy leaves at once; the disk copy is re-read (on the I/O thread) only
        where a folder's rules allow it, so a closed ignored or outside file is gone for good."""
        path = os.path.abspath(os.fspath(path))
        with self._lock:
            if (owner, path) in self._entries:
                self._drop((owner, path))
                self._bump()
            inside = self._rules_for(path) is not None
        if inside:
            self._submit(self._disk_changed, path)

    def forget(self, path: str | os.PathLike, owner: Hashable = LOCAL) -> None:
        """Drop the editor's copy without re-reading the disk's (eval: the document it opened per position)."""
        path = os.path.abspath(os.fspath(path))
        with self._lock:
            if (owner, path) in self._entries:
                self._drop((owner, path))
                self.selector.forget((owner, path))
                self._bump()

    # -- queries ---------------------------------------------------------
    def get(self, path: str | os.PathLike, owner: Hashable = LOCAL) -> str | None:
        """`owner`'s open copy of the file, else the disk copy."""
        path = os.path.abspath(os.fspath(path))
        with self._lock:
            e = self._entries.get((owner, path)) or self._entries.get((DISK, path))
            return e.text if e else None

    def paths(self) -> list[str]:
        with self._lock:
            return list(dict.fromkeys(e.path for e in self._entries.values()))

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def memory_bytes(self) -> int:
        return self._bytes

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
        """Block until predicate() holds (re-checked on every change) or timeout."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(min(left, 0.1))
            return True

    def context(self, current_path: str | os.PathLike | None, language: str | None, budget_tokens: int,
                count_tokens: Callable[[str], int] | None = None, owner: Hashable = LOCAL,
                exclude: Iterable[str] = (), text: str | None = None, offset: int | None = None,
                mode: str = "recent", window_tokens: tuple[int, int] = (1024, 256)) -> list[tuple[str, str]]:
        """(relative path, snippet) pairs for the prompt's context block.

        mode "retrieval" (with the document's `text` and cursor `offset`): the chunks the code
        around the cursor needs, from the repository index (see `retrieve`). Otherwise ("recent"):
        snippets of recently touched files, ordered by path, as described below.

        Picks, among `owner`'s open documents and the disk files under `owner`'s folders, the
        most recently touched files of `language` other than the current one (open documents
        first), minus the deny-list (built in, plus the glob patterns `exclude`), takes a
        snippet of each (around the last edit, else the file's head), and fits them into
        budget_tokens as counted by count_tokens (default: chars / 4). Each file chosen is
        logged at debug level: that log is the record of what left the editor for the model.
        """
        if budget_tokens <= 0:
            return []
        count = self._counter(count_tokens)
        current = os.path.abspath(os.fspath(current_path)) if current_path else None
        if language is None and current is not None:
            language = language_of(current)
        exclude = tuple(exclude)
        if mode == "retrieval" and text is not None and offset is not None:
            return self.retrieve(current, language, text, offset, budget_tokens, count, owner, exclude, window_tokens)
        with self._lock:
            mine = [root for root, owners in self._owners.items() if owner in owners]
            visible: dict[str, _Entry] = {}
            for (who, path), e in self._entries.items():
                if path == current or (language is not None and e.language != language):
                    continue
                if who == owner and who is not DISK:
                    visible[path] = e                       # the editor's own copy wins over the disk's
                elif who is DISK and path not in visible and any(_inside(path, root) for root in mine):
                    visible[path] = e
            candidates = sorted(visible.values(), key=lambda e: (not e.open, -e.touched, e.path))
        picked = []
        for e in candidates:  # outside the lock: the gate may read a folder's .gitignore files
            if len(picked) >= self.max_files:
                break
            # The one gate (privacy.py): an open hidden, ignored, excluded or outside document is the
            # editor's own business, never context for another file.
            if not self._admit(e.path, mine, exclude, read_from_disk=not e.open).remote_ok:
                continue
            picked.append((e, self._snippet(e)))
        chosen: list[tuple[str, str]] = []
        used = 0
        for e, snippet in picked:
            rel = self._relpath(e.path)
            cost = count(f"{rel}\n{snippet}") + 2
            if used + cost > budget_tokens:
                snippet = self._fit(rel, snippet, budget_tokens - used - 2, count)
                if not snippet:
                    continue
                cost = count(f"{rel}\n{snippet}") + 2
            chosen.append((rel, snippet))
            used += cost
            log.debug("context for %s (editor %s): %s, %s copy, %d characters", current, owner, e.path,
                      "editor's" if e.open else "disk", len(snippet))
        chosen.sort()
        return chosen

    def admission(self, path: str | os.PathLike | None, owner: Hashable = LOCAL, exclude: Iterable[str] = (),
                  roots: Iterable[str] = ()) -> Verdict:
        """The privacy gate's verdict (privacy.classify) on `path` for `owner`: its workspace folders (plus
        `roots`, folders the caller knows of that may not be registered yet) and their ignore rules."""
        if path is None:
            return classify(None, ())
        with self._lock:
            mine = [root for root, owners in self._owners.items() if owner in owners]
        mine += [os.path.abspath(r) for r in roots if os.path.abspath(r) not in mine]
        return self._admit(os.path.abspath(os.fspath(path)), mine, tuple(exclude))

    def _admit(self, path: str, roots: list[str], exclude: Iterable[str], read_from_disk: bool = False) -> Verdict:
        """classify() with the folders' ignore rules. read_from_disk: an entry read from disk passed those
        rules when it was read, and leaves when a .gitignore change ignores it (_recheck_ignored), so its
        (deep paths: costly) ignore check is skipped; every other rule is applied as for any file."""
        def ignored(root: str, p: str) -> bool:
            rules = self._folders.get(root) or IgnoreRules(root)  # a folder still being set up: read its rules now
            return rules.ignored(p)
        return classify(path, roots, exclude=exclude, ignored=None if read_from_disk else ignored)

    def retrieve(self, current: str | None, language: str | None, text: str, offset: int, budget_tokens: int,
                 count: Callable[[str], int], owner: Hashable = LOCAL, exclude: tuple[str, ...] = (),
                 window_tokens: tuple[int, int] = (1024, 256)) -> list[tuple[str, str]]:
        """(relative path, chunk) pairs for the cursor at `offset` in `text` (the current document).

        Candidates are the index's chunks of `language` that `owner` may see: its own open
        documents and the disk files under its folders (a disk copy gives way to the editor's),
        minus the contextExclude patterns; the current file's own chunks count, except those the
        prompt's window (window_tokens before and after the cursor) already shows, and never its
        disk copy (the request's text is the current version). Definitions of the names at the
        cursor come first, then BM25 over the identifiers around the cursor; the block is sticky
        (retrieval.Selector), so typing changes it only when its chunks change.
        """
        before_chars, after_chars = (4 * max(0, int(t)) for t in window_tokens)
        lo = text.count("\n", 0, max(0, offset - before_chars))
        hi = text.count("\n", 0, min(len(text), offset + after_chars)) + 1
        query = retrieval.make_query(text, offset)
        query.window = (lo, hi)
        with self._lock:
            mine = [root for root, owners in self._owners.items() if owner in owners]
            cur_key = (owner, current) if current is not None and (owner, current) in self._entries else None
            verdicts: dict[Hashable, bool] = {}

            def allowed(c: retrieval.Chunk) -> bool:
                ok = verdicts.get(c.key)
                if ok is None:
                    ok = verdicts[c.key] = self._retrievable(c, owner, current, language, mine, exclude)
                return ok

            def cost(c: retrieval.Chunk) -> int:
                return count(f"{self._relpath(c.path)}\n{c.text}") + 2

            chosen = self.selector.select(self.index, (owner, current), query, allowed, cur_key, cost, budget_tokens)
            block = tuple(c.id for c in chosen)
            if self._last_block.get((owner, current), ()) != block:
                self.block_changes += 1
                self._last_block[(owner, current)] = block
                if len(self._last_block) > 256:
                    self._last_block.pop(next(iter(self._last_block)))
            out = [(self._relpath(c.path), c.text) for c in chosen]
            for c in chosen:
                log.debug("context for %s (editor %s): %s lines %d-%d", current, owner, c.path, c.start + 1, c.end)
        return out

    def _retrievable(self, c: "retrieval.Chunk", owner: Hashable, current: str | None, language: str | None,
                     mine: list[str], exclude: tuple[str, ...]) -> bool:
        who, path = c.key
        if language is not None and c.language != language:
            return False
        if who is DISK:
            if path == current or (owner, path) in self._entries:
                return False
        elif who != owner:
            return False
        # The one gate (privacy.py), for this editor's folders and contextExclude: cached, since a query
        # asks it for every file with a matching chunk (cleared when folders or ignore rules change).
        key = (path, tuple(mine), exclude)
        ok = self._verdicts.get(key)
        if ok is None:
            if len(self._verdicts) > 50_000:
                self._verdicts.clear()
            ok = self._verdicts[key] = self._admit(path, mine, exclude).remote_ok
        return ok

    # -- internals -------------------------------------------------------
    def _counter(self, count_tokens: Callable[[str], int] | None) -> Callable[[str], int]:
        if count_tokens is None:
            return lambda s: (len(s) + 3) // 4

        def cached(s: str) -> int:
            n = self._token_counts.get(s)
            if n is None:
                n = count_tokens(s)
                self._token_counts[s] = n
                if len(self._token_counts) > 2048:
                    self._token_counts.popitem(last=False)
            else:
                self._token_counts.move_to_end(s)
            return n
        return cached

    def _snippet(self, e: _Entry) -> str:
        lines = e.text.splitlines(keepends=True)
        n = self.snippet_lines
        if e.edit_line is None or len(lines) <= n:
            start = 0
        else:
            # Window around the last edit, snapped to a multiple of n/2 lines so
            # small cursor moves in that file do not change the snippet.
            half = max(1, n // 2)
            start = max(0, min(len(lines) - n, (e.edit_line // half) * half - half // 2))
        return "".join(lines[start:start + n])

    @staticmethod
    def _fit(rel: str, snippet: str, budget: int, count: Callable[[str], int]) -> str:
        lines = snippet.splitlines(keepends=True)
        while lines and count(rel + "\n" + "".join(lines)) > budget:
            lines = lines[: len(lines) // 2] if len(lines) > 8 else lines[:-1]
        return "".join(lines)

    def relative_path(self, path: str | os.PathLike) -> str:
        """Path as the context block and the current file's header name it (relative to its folder)."""
        return self._relpath(os.path.abspath(os.fspath(path)))

    def _relpath(self, path: str) -> str:
        for root in list(self._folders):
            if _inside(path, root):
                return os.path.relpath(path, root).replace(os.sep, "/")
        return os.path.basename(path)

    def _rules_for(self, path: str) -> IgnoreRules | None:
        best = None
        for root, rules in list(self._folders.items()):
            if _inside(path, root) and (best is None or len(root) > len(best.root)):
                best = rules
        return best

    def _root_of(self, path: str) -> str | None:
        rules = self._rules_for(path)
        return rules.root if rules is not None else None

    def _bump(self) -> None:
        self.version += 1
        self._changed.notify_all()

    def _drop(self, key: tuple[Hashable, str], index: bool = True) -> None:
        e = self._entries.pop(key, None)
        if e is not None:
            self._bytes -= e.nbytes
        if index:
            self.index.remove(key)

    def _indexable(self, owner: Hashable, path: str) -> bool:
        """Whether an entry's text may be retrieved as context: a disk file was admitted when it was
        read (inside a folder, not ignored or hidden, not on the deny-list); an editor's document
        only under the same rules (an open hidden, ignored or outside file stays out of the index)."""
        if os.path.basename(path).startswith("."):
            return False      # a hidden file (.dotfile.py), wherever it is, like a hidden folder's
        if owner is DISK:
            return True
        mine = [root for root, owners in self._owners.items() if owner in owners]
        key = (path, tuple(mine), ())
        ok = self._verdicts.get(key)     # asked on every didChange: cached until folders or ignore rules change
        if ok is None:
            ok = self._verdicts[key] = self._admit(path, mine, ()).remote_ok
        return ok

    def _reindex_open(self) -> None:
        """Folders or ignore rules changed: re-decide which open documents the index may hold."""
        self._verdicts.clear()
        for key, e in list(self._entries.items()):
            if e.open:
                if self._indexable(e.owner, e.path):
                    if key not in self.index.by_key:
                        self.index.update(key, e.path, e.language, e.text)
                else:
                    self.index.remove(key)

    def _put(self, owner: Hashable, path: str, text: str, language: str | None, edit_line: int | None,
             touched: float | None = None) -> None:
        language = language or language_of(path)
        nbytes = len(text.encode("utf-8", errors="replace"))
        key = (owner, path)
        # Chunked (and, for a disk file, tokenized) here, outside the lock: a scan never holds it long.
        prepared = None
        with self._lock:
            old = self._entries.get(key)
            edit = old is not None and key in self.index.by_key   # a keystroke, or a file saved again
        if language is not None and nbytes <= self.max_file_bytes and not edit:
            prepared = retrieval.prepare(text, self.index.max_chunks_per_file, parse=owner is DISK)
        with self._lock:
            old = self._entries.get(key)
            if (language is None or nbytes > self.max_file_bytes or nbytes > self.max_bytes
                    or secret_match(path, self._root_of(path)) is not None):
                if old is not None:
                    self._drop(key)
                    self._bump()
                return
            if old is not None:
                if edit_line is None and old.text == text:
                    edit_line = old.edit_line
                self._drop(key, index=False)
            self._entries[key] = _Entry(owner, path, language, text, nbytes,
                                        touched if touched is not None else time.time(), edit_line)
            self._bytes += nbytes
            if not self._indexable(owner, path):
                self.index.remove(key)
            elif not (old is not None and key in self.index.by_key
                      and self.index.update_edit(key, path, language, old.text, text)):
                self.index.update(key, path, language, text, prepared)
            self._evict()
            self._bump()

    def _evict(self) -> None:
        while self._bytes > self.max_bytes and self._entries:
            victim = next((k for k, e in self._entries.items() if not e.open), None)
            if victim is None:
                victim = next(iter(self._entries))
            self._drop(victim)

    def _disk_changed(self, path: str) -> None:
        path = os.path.abspath(path)
        if os.path.basename(path) == ".gitignore":
            rules = self._rules_for(path)
            if rules is not None:
                rules.invalidate(os.path.dirname(path))
                self._recheck_ignored(rules)
            return
        with self._lock:
            rules = self._rules_for(path)
        if rules is None or language_of(path) is None or rules.ignored(path) \
                or secret_match(path, rules.root) is not None:
            return
        text, mtime = self._read(path, rules)
        if text is None:
            with self._lock:
                if (DISK, path) in self._entries:
                    self._drop((DISK, path))
                    self._bump()
            return
        self._put(DISK, path, text, None, edit_line=None, touched=mtime)

    def _disk_removed(self, path: str, is_dir: bool) -> None:
        path = os.path.abspath(path)
        if os.path.basename(path) == ".gitignore":
            rules = self._rules_for(path)
            if rules is not None:
                rules.invalidate(os.path.dirname(path))
                with self._lock:
                    self._reindex_open()
            return
        with self._lock:
            doomed = [k for k, e in self._entries.items()
                      if not e.open and (e.path == path or (is_dir and _inside(e.path, path)))]
            for k in doomed:
                self._drop(k)
            if doomed:
                self._bump()

    def _recheck_ignored(self, rules: IgnoreRules) -> None:
        with self._lock:
            doomed = [k for k, e in self._entries.items()
                      if not e.open and _inside(e.path, rules.root) and rules.ignored(e.path)]
            for k in doomed:
                self._drop(k)
            self._reindex_open()
            if doomed:
                self._bump()

    def _read(self, path: str, rules: IgnoreRules) -> tuple[str | None, float]:
        """File text, or None if missing, huge, binary, not UTF-8, not a regular file, or a
        symlink leading out of its workspace folder."""
        try:
            data, st = read_regular(path, self.max_file_bytes, inside=rules.real_root)
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

    def _scan_dir(self, top: str) -> None:
        """Load the most recently modified source files under `top`, up to the budget."""
        top = os.path.abspath(top)
        rules = self._rules_for(top)
        if rules is None or (top != rules.root and rules.ignored(top, is_dir=True)):
            return
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
                                if (st.st_size <= self.max_file_bytes and not rules.ignored(de.path)
                                        and secret_match(de.path, rules.root) is None):
                                    found.append((st.st_mtime, de.path))
                        except OSError:
                            continue  # vanished or unreadable entry: skip it, keep scanning
            except OSError as exc:
                log.debug("cannot scan %s: %s", d, exc)
        if stack:
            log.info("scan of %s stopped after %d directories and %d files (the limits)", top, visited, len(found))
        found.sort(reverse=True)
        with self._lock:
            self.scan_progress["found"] += len(found)
            self.scan_progress["scanning"] += 1
        try:
            self._load_found(found, rules)
        finally:
            with self._lock:
                self.scan_progress["scanning"] -= 1
                self._bump()

    def index_status(self) -> dict[str, Any]:
        """The retrieval index and the background scan, for status and progress: files and chunks indexed,
        source files the scans found and loaded so far, and whether a scan is running."""
        with self._lock:
            return {"files": self.index.files(), "chunks": len(self.index), "found": self.scan_progress["found"],
                    "loaded": self.scan_progress["loaded"], "scanning": self.scan_progress["scanning"] > 0}

    def _load_found(self, found: list[tuple[float, str]], rules: IgnoreRules) -> None:
        loaded = 0
        texts: list[tuple[str, str, float]] = []
        for _, path in found:
            if loaded >= self.max_bytes:
                break
            with self._lock:
                if (DISK, path) in self._entries:
                    continue
            text, mtime = self._read(path, rules)
            if text is not None:
                texts.append((path, text, mtime))
                loaded += len(text)
        # Oldest first, so the LRU order matches modification times.
        for path, text, mtime in reversed(texts):
            with self._lock:
                if (DISK, path) in self._entries:
                    continue  # a watcher event got there first with newer text
                if self._rules_for(path) is None:
                    continue  # the folder was removed meanwhile
            self._put(DISK, path, text, None, edit_line=None, touched=mtime)
            with self._lock:
                self.scan_progress["loaded"] += 1


def _count_dirs(root: str, limit: int) -> int:
    """Directories under `root` (itself included) as a recursive inotify watch would add them
    (symlinks not followed), counting no further than `limit`."""
    n = 0
    stack = [root]
    while stack and n < limit:
        d = stack.pop()
        n += 1
        try:
            with os.scandir(d) as it:
                stack.extend(de.path for de in it if de.is_dir(follow_symlinks=False))
        except OSError:
            continue
    return n

