"""Watching config.toml for changes with watchdog (inotify and friends), not by polling.

`ConfigWatcher(path, on_change)` calls `on_change()` from the observer's thread when
the file may have changed: created, written, replaced by a rename (how editors and
dotfile managers save), deleted, or, when it is a symlink, its target edited. It
watches the file's directory without recursion; while that directory does not exist
yet (no config written so far), it watches the nearest existing ancestor and moves
down as the directories appear. Callers re-read the file themselves (off their event
loop), so a burst of events per save costs one read.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Callable, cast

if TYPE_CHECKING:  # watchdog is imported when watching starts
    from watchdog.events import FileSystemEventHandler
    from watchdog.observers.api import BaseObserver, ObservedWatch

log = logging.getLogger(__name__)


class ConfigWatcher:
    def __init__(self, path: str | os.PathLike, on_change: Callable[[], None]):
        self.path = os.path.abspath(os.fspath(path))
        self.on_change = on_change
        self._observer: BaseObserver | None = None
        self._watches: dict[str, ObservedWatch] = {}  # directory -> watch
        self._lock = threading.RLock()

    def start(self) -> "ConfigWatcher":
        """Set up the watches (touches the file system: call it off the event loop)."""
        from watchdog.observers import Observer

        with self._lock:
            if self._observer is not None:
                return self
            self._observer = Observer()
            self._observer.daemon = True
            self._observer.start()
            self._arm()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        """Stop watching; bounded even if the observer thread is stuck (it is a daemon thread)."""
        with self._lock:
            obs, self._observer = self._observer, None
            self._watches.clear()
        if obs is None:
            return

        def halt() -> None:
            obs.stop()
            obs.join(timeout)

        stopper = threading.Thread(target=halt, daemon=True, name="config-watch-stop")
        stopper.start()
        stopper.join(timeout)

    def _wanted(self) -> set[str]:
        """Directories to watch: the file's (or its nearest existing ancestor) and its symlink target's."""
        dirs = {_existing_ancestor(os.path.dirname(self.path))}
        real = os.path.realpath(self.path)
        if real != self.path:
            dirs.add(_existing_ancestor(os.path.dirname(real)))
        return dirs

    def _arm(self) -> None:
        # A directory on the way may appear between computing what to watch and the watch taking
        # effect (`mkdir -p` makes several at once): its creation event is then never seen, nor
        # anything inside it. So arm until what is wanted no longer changes.
        for _ in range(16):
            if not self._arm_once():
                return

    def _arm_once(self) -> bool:
        """Watch what is wanted now; whether that still differs from what it was when armed."""
        with self._lock:
            obs = self._observer
            if obs is None:
                return False
            wanted = self._wanted()
            for directory in [d for d in self._watches if d not in wanted]:
                try:
                    obs.unschedule(self._watches.pop(directory))
                except (KeyError, OSError) as exc:
                    log.debug("unwatching %s: %s", directory, exc)
            for directory in wanted - set(self._watches):
                try:
                    self._watches[directory] = obs.schedule(
                        cast("FileSystemEventHandler", _Handler(self)), directory, recursive=False
                    )  # duck-typed: dispatch()
                except OSError as exc:  # e.g. no inotify watches left: edits then need an editor restart
                    log.warning("cannot watch %s for changes of %s: %s", directory, self.path, exc)
            return self._wanted() != wanted

    def _relevant(self, *paths: str) -> bool:
        real = os.path.realpath(self.path)
        for p in paths:
            if not p:
                continue
            p = os.path.abspath(p)
            # The file itself, its target, or a directory on the way to either (created, moved, removed).
            if (
                p in (self.path, real)
                or self.path.startswith(p.rstrip(os.sep) + os.sep)
                or real.startswith(p.rstrip(os.sep) + os.sep)
            ):
                return True
        return False

    def _event(self, src: str, dest: str) -> None:
        if not self._relevant(src, dest):
            return
        self._arm()  # a directory on the way may have appeared, or the symlink may point elsewhere now
        try:
            self.on_change()
        except Exception:  # the observer thread must survive a failing callback
            log.exception("config change callback failed")


class _Handler:
    def __init__(self, watcher: ConfigWatcher):
        self.watcher = watcher

    def dispatch(self, event) -> None:
        if event.event_type in ("opened", "closed_no_write"):
            return  # reads (ours included) change nothing
        dest = getattr(event, "dest_path", "") or ""
        self.watcher._event(os.fsdecode(event.src_path), os.fsdecode(dest))


def _existing_ancestor(directory: str) -> str:
    d = Path(directory)
    while not d.is_dir() and d != d.parent:
        d = d.parent
    return str(d)
