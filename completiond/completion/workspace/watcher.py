"""Watching the workspace folders (watchdog), and the one background thread that does the
workspace's disk I/O (folder set-up, scans, re-reads after a close), never the caller's.

The inotify budget: every directory of a watched tree is a watch, so the folders together may
watch at most max_watched_dirs directories (a quarter of the user's, by default) and at most
max_watched_folders folders; a folder past either is scanned but not watched (logged once).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

from completiond.completion.privacy import _inside
from completiond.completion.workspace.disk import DiskSync
from completiond.completion.workspace.folders import Folders

log = logging.getLogger(__name__)


def default_watch_budget() -> int:
    """Directories all folders together may watch: a quarter of the user's inotify watches
    (editors and other tools need theirs), at most 16,384."""
    try:
        with open("/proc/sys/fs/inotify/max_user_watches", "rb") as f:
            limit = int(f.read(32).strip())
    except (OSError, ValueError):
        return 8192
    return max(256, min(16384, limit // 4))


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


class _Handler:
    """watchdog event sink; methods named as FileSystemEventHandler expects.

    The observer holds its lock while this runs, and stopping the observer waits for that
    lock: so nothing here may block. Single files are read here (regular files only, opened
    non-blocking); whole directories are scanned on the workspace's I/O thread.
    """

    def __init__(self, watcher: FolderWatcher):
        self.watcher = watcher

    def dispatch(self, event) -> None:
        disk = self.watcher.disk
        try:
            kind = event.event_type
            src = os.fsdecode(event.src_path)
            if kind in ("created", "modified", "closed"):
                if event.is_directory:
                    if kind == "created":
                        self.watcher.submit(disk.scan_dir, src)
                else:
                    disk.changed(src)
            elif kind == "deleted":
                disk.removed(src, event.is_directory)
            elif kind == "moved":
                disk.removed(src, event.is_directory)
                dest = os.fsdecode(event.dest_path)
                if event.is_directory:
                    self.watcher.submit(disk.scan_dir, dest)
                else:
                    disk.changed(dest)
        except Exception:  # a watcher thread that dies silently stops all context updates
            log.exception("workspace watcher failed on %r", event)


class FolderWatcher:
    """The observer, its watches, and the I/O thread. `lock` is the workspace's: the observer and the
    closed flag change under it; the watches change on the I/O thread only (and are cleared by stop)."""

    def __init__(
        self,
        lock: threading.RLock,
        folders: Folders,
        disk: DiskSync,
        max_watched_dirs: int | None = None,
        max_watched_folders: int = 32,
    ):
        self.lock = lock
        self.folders = folders
        self.disk = disk
        self.max_watched_dirs = default_watch_budget() if max_watched_dirs is None else max_watched_dirs
        self.max_watched_folders = max_watched_folders
        self.observer: Any = None
        self.watches: dict[str, tuple[object, int]] = {}  # folder -> (watch, directories)
        self.unwatched: set[str] = set()  # folders refused a watch (logged once)
        self.closed = False
        self._io: queue.SimpleQueue = queue.SimpleQueue()
        self._io_thread: threading.Thread | None = None

    @property
    def started(self) -> bool:
        return self.observer is not None

    def start(self) -> tuple[threading.Event, list[str]] | None:
        """Start the observer; (the watches being set up on the I/O thread, the folders there were at
        that moment), or None if it runs already or was stopped. A folder added later is the adder's
        to watch (it sees `started`)."""
        from watchdog.observers import Observer

        with self.lock:
            if self.observer is not None or self.closed:
                return None
            self.observer = Observer()
            self.observer.daemon = True
            self.observer.start()
            roots = list(self.folders)
        return self.submit(self.rewatch), roots

    def stop(self, timeout: float = 2.0) -> None:
        """Stop watching; returns within about `timeout` seconds even if a watcher thread is stuck
        (the threads are daemons: a stuck one cannot hold the process up)."""
        with self.lock:
            obs, self.observer = self.observer, None
            self.watches.clear()
            self.closed = True
            io_thread = self._io_thread
        self._io.put(None)
        if obs is not None:
            stopper = threading.Thread(
                target=lambda: (obs.stop(), obs.join(timeout)), daemon=True, name="workspace-stop"
            )
            stopper.start()
            stopper.join(timeout)
            if stopper.is_alive():
                log.warning("workspace watcher did not stop within %g s; leaving it behind", timeout)
        if io_thread is not None and io_thread is not threading.current_thread():
            io_thread.join(timeout)

    # -- the I/O thread --------------------------------------------------
    def submit(self, fn: Callable, *args: Any) -> threading.Event:
        """Run fn(*args) on the I/O thread; the event is set when it is done (at once if stopped)."""
        done = threading.Event()
        with self.lock:
            if self.closed:
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

    # -- watches -----------------------------------------------------------
    def rewatch(self) -> None:
        """Watch the outermost folders within the budgets; unwatch folders that are gone.
        Runs on the I/O thread: walking and registering a big tree takes a while."""
        with self.lock:
            obs = self.observer
            roots = sorted(self.folders)
        if obs is None:
            return
        wanted: list[str] = []
        for root in roots:
            if not any(_inside(root, w) for w in wanted):  # an enclosing folder's watch covers it
                wanted.append(root)
        for root in [r for r in list(self.watches) if r not in wanted]:
            watch, _ = self.watches.pop(root, (None, 0))
            if watch is None:
                continue
            try:
                obs.unschedule(watch)
            except (KeyError, OSError) as exc:
                log.debug("unwatching %s: %s", root, exc)
        for root in wanted:
            if root in self.watches:
                continue
            used = sum(n for _, n in list(self.watches.values()))
            budget = self.max_watched_dirs - used
            if len(self.watches) >= self.max_watched_folders:
                self._not_watched(root, f"{self.max_watched_folders} folders are watched already")
                continue
            dirs = _count_dirs(root, budget + 1)
            if dirs > budget:
                self._not_watched(
                    root, f"it holds over {budget} directories, the watch budget left ({self.max_watched_dirs} in all)"
                )
                continue
            try:
                self.watches[root] = (obs.schedule(_Handler(self), root, recursive=True), dirs)
                self.unwatched.discard(root)
            except OSError as exc:
                # e.g. the user's inotify watches are used up: keep open documents working.
                self._not_watched(root, str(exc))

    def _not_watched(self, root: str, why: str) -> None:
        if root not in self.unwatched:
            self.unwatched.add(root)
            log.warning(
                "not watching workspace folder %s: %s; its context comes from the start-up scan and "
                "open documents only",
                root,
                why,
            )
