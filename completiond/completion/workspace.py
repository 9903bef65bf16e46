"""Workspace context: watched folders, open documents, and the context block.

The daemon keeps one `Workspace`. A watchdog observer follows the workspace
folders (respecting .gitignore files, skipping binary and huge files); the
editor's open/change/close events add the documents the user is working in.
Everything lives in one LRU store with a byte budget.

`context(current_path, language, budget_tokens, count_tokens)` returns
(path, snippet) pairs of recently edited and open files of the same language
for the prompt builder. The result is ordered by path, not by recency, and
depends only on other files: typing in the current file never changes it, so
the context block's KV stays cached across keystrokes.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import pathspec

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
ALWAYS_SKIPPED_DIRS = frozenset({".git", ".hg", ".svn", "node_modules", "__pycache__", ".venv", "venv", ".mypy_cache",
                                 ".pytest_cache", ".tox"})


def language_of(path: str | os.PathLike) -> str | None:
    entry = LANGUAGES.get(os.path.splitext(str(path))[1].lower())
    return entry[0] if entry else None


def comment_for(language: str | None) -> str | None:
    return COMMENTS.get(language or "")


@dataclass
class _Entry:
    path: str
    language: str
    text: str
    nbytes: int
    touched: float          # last edit (editor) or modification (disk), for recency
    edit_line: int | None   # line of the last edit in the editor, if known
    open: bool = False


class IgnoreRules:
    """.gitignore semantics for one workspace folder (nested .gitignore files included).

    Specs are read lazily per directory and dropped when a .gitignore changes.
    """

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
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
            with open(path, encoding="utf-8", errors="replace") as f:
                spec = pathspec.GitIgnoreSpec.from_lines(f.read().splitlines())
        except FileNotFoundError:
            pass
        except OSError as exc:
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
        if any(p in ALWAYS_SKIPPED_DIRS for p in parts[:-1]) or (is_dir and parts[-1] in ALWAYS_SKIPPED_DIRS):
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
    """watchdog event sink; methods named as FileSystemEventHandler expects."""

    def __init__(self, ws: "Workspace"):
        self.ws = ws

    def dispatch(self, event) -> None:
        try:
            kind = event.event_type
            src = os.fsdecode(event.src_path)
            if kind in ("created", "modified", "closed"):
                if event.is_directory:
                    if kind == "created":
                        self.ws._scan_dir(src)
                else:
                    self.ws._disk_changed(src)
            elif kind == "deleted":
                self.ws._disk_removed(src, event.is_directory)
            elif kind == "moved":
                self.ws._disk_removed(src, event.is_directory)
                dest = os.fsdecode(event.dest_path)
                if event.is_directory:
                    self.ws._scan_dir(dest)
                else:
                    self.ws._disk_changed(dest)
        except Exception:  # a watcher thread that dies silently stops all context updates
            log.exception("workspace watcher failed on %r", event)


class Workspace:
    """Bounded store of workspace files and open documents, kept current by watchdog.

    max_bytes: total UTF-8 bytes of text kept (least recently touched files
    go first; open documents last). max_file_bytes: larger files are skipped.
    """

    def __init__(self, folders: Iterable[str | os.PathLike] = (), max_bytes: int = 8 << 20,
                 max_file_bytes: int = 256 << 10, scan: bool = True, max_scan_files: int = 5000,
                 snippet_lines: int = 60, max_files: int = 4):
        self.max_bytes = int(max_bytes)
        self.max_file_bytes = int(max_file_bytes)
        self.scan_on_start = scan
        self.max_scan_files = max_scan_files
        self.snippet_lines = snippet_lines
        self.max_files = max_files
        self._folders: dict[str, IgnoreRules] = {}
        self._entries: OrderedDict[str, _Entry] = OrderedDict()   # LRU: least recently touched first
        self._bytes = 0
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self.version = 0
        self._observer = None
        self._watches: dict[str, object] = {}
        self._token_counts: OrderedDict[str, int] = OrderedDict()
        for f in folders:
            self.add_folder(f)

    # -- lifecycle -------------------------------------------------------
    def start(self) -> "Workspace":
        from watchdog.observers import Observer

        with self._lock:
            if self._observer is not None:
                return self
            self._observer = Observer()
            self._observer.daemon = True
            for root in list(self._folders):
                self._watch(root)
            self._observer.start()
        if self.scan_on_start:
            for root in list(self._folders):
                threading.Thread(target=self._scan_dir, args=(root,), daemon=True, name="workspace-scan").start()
        return self

    def stop(self) -> None:
        with self._lock:
            obs, self._observer = self._observer, None
            self._watches.clear()
        if obs is not None:
            obs.stop()
            obs.join(timeout=5)

    def __enter__(self) -> "Workspace":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def add_folder(self, folder: str | os.PathLike) -> None:
        root = os.path.abspath(os.fspath(folder))
        if not os.path.isdir(root):
            raise NotADirectoryError(f"workspace folder {root} is not a directory")
        with self._lock:
            if root in self._folders:
                return
            self._folders[root] = IgnoreRules(root)
            started = self._observer is not None
            if started:
                self._watch(root)
        if started and self.scan_on_start:
            threading.Thread(target=self._scan_dir, args=(root,), daemon=True, name="workspace-scan").start()

    def scan(self) -> None:
        """Load the folders' most recent source files now, in this thread (no watcher needed)."""
        for root in list(self._folders):
            self._scan_dir(root)

    def remove_folder(self, folder: str | os.PathLike) -> None:
        root = os.path.abspath(os.fspath(folder))
        with self._lock:
            self._folders.pop(root, None)
            watch = self._watches.pop(root, None)
            if watch is not None and self._observer is not None:
                self._observer.unschedule(watch)
            for path in [p for p, e in self._entries.items() if _inside(p, root) and not e.open]:
                self._drop(path)
            self._bump()

    def _watch(self, root: str) -> None:
        try:
            self._watches[root] = self._observer.schedule(_Handler(self), root, recursive=True)
        except OSError as exc:
            # e.g. inotify watch limit reached: keep open documents working.
            log.warning("cannot watch workspace folder %s: %s", root, exc)

    # -- editor events ------------------------------------------------------
    def did_open(self, path: str | os.PathLike, text: str, language: str | None = None) -> None:
        self._put(os.path.abspath(os.fspath(path)), text, language, open_=True, edit_line=None)

    def did_change(self, path: str | os.PathLike, text: str, edit_line: int | None = None,
                   language: str | None = None) -> None:
        self._put(os.path.abspath(os.fspath(path)), text, language, open_=True, edit_line=edit_line)

    def did_close(self, path: str | os.PathLike) -> None:
        path = os.path.abspath(os.fspath(path))
        with self._lock:
            entry = self._entries.get(path)
            if entry is not None:
                entry.open = False
        # The disk copy is what the file is now (unsaved edits were discarded or saved).
        self._disk_changed(path)

    # -- queries ---------------------------------------------------------
    def get(self, path: str | os.PathLike) -> str | None:
        with self._lock:
            e = self._entries.get(os.path.abspath(os.fspath(path)))
            return e.text if e else None

    def paths(self) -> list[str]:
        with self._lock:
            return list(self._entries)

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
                count_tokens: Callable[[str], int] | None = None) -> list[tuple[str, str]]:
        """(relative path, snippet) pairs for the prompt's context block, ordered by path.

        Picks the most recently touched files of `language` other than the
        current one (open documents first), takes a snippet of each (around
        the last edit, else the file's head), and fits them into
        budget_tokens as counted by count_tokens (default: chars / 4).
        """
        if budget_tokens <= 0:
            return []
        count = self._counter(count_tokens)
        current = os.path.abspath(os.fspath(current_path)) if current_path else None
        if language is None and current is not None:
            language = language_of(current)
        with self._lock:
            candidates = [e for e in self._entries.values() if e.path != current and (language is None or e.language == language)]
            candidates.sort(key=lambda e: (not e.open, -e.touched, e.path))
            picked = [(e.path, self._snippet(e)) for e in candidates[: self.max_files]]
        chosen: list[tuple[str, str]] = []
        used = 0
        for path, snippet in picked:
            rel = self._relpath(path)
            cost = count(f"{rel}\n{snippet}") + 2
            if used + cost > budget_tokens:
                snippet = self._fit(rel, snippet, budget_tokens - used - 2, count)
                if not snippet:
                    continue
                cost = count(f"{rel}\n{snippet}") + 2
            chosen.append((rel, snippet))
            used += cost
        chosen.sort()
        return chosen

    # -- internals -------------------------------------------------------
    def _counter(self, count_tokens: Callable[[str], int] | None) -> Callable[[str], int]:
        if count_tokens is None:
            return lambda s: (len(s) + 3) // 4

        def cached(s: str) -> int:
            n = self._token_counts.get(s)
            if n is None:
                n = count_tokens(s)
                self._token_counts[s] = n
                if len(self._token_counts) > 256:
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
        for root in self._folders:
            if _inside(path, root):
                return os.path.relpath(path, root).replace(os.sep, "/")
        return os.path.basename(path)

    def _rules_for(self, path: str) -> IgnoreRules | None:
        best = None
        for root, rules in self._folders.items():
            if _inside(path, root) and (best is None or len(root) > len(best.root)):
                best = rules
        return best

    def _bump(self) -> None:
        self.version += 1
        self._changed.notify_all()

    def _drop(self, path: str) -> None:
        e = self._entries.pop(path, None)
        if e is not None:
            self._bytes -= e.nbytes

    def _put(self, path: str, text: str, language: str | None, open_: bool, edit_line: int | None,
             touched: float | None = None) -> None:
        language = language or language_of(path)
        nbytes = len(text.encode("utf-8", errors="replace"))
        with self._lock:
            old = self._entries.get(path)
            if language is None or nbytes > self.max_file_bytes or nbytes > self.max_bytes:
                if old is not None and not old.open:
                    self._drop(path)
                    self._bump()
                return
            if old is not None:
                open_ = open_ or old.open
                if edit_line is None and old.text == text:
                    edit_line = old.edit_line
                self._drop(path)
            self._entries[path] = _Entry(path, language, text, nbytes, touched if touched is not None else time.time(),
                                         edit_line, open_)
            self._bytes += nbytes
            self._evict()
            self._bump()

    def _evict(self) -> None:
        while self._bytes > self.max_bytes and self._entries:
            victim = next((p for p, e in self._entries.items() if not e.open), None)
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
            entry = self._entries.get(path)
            if entry is not None and entry.open:
                return  # the editor's text is newer than the disk's
            rules = self._rules_for(path)
        if rules is None or language_of(path) is None or rules.ignored(path):
            return
        text, mtime = self._read(path)
        if text is None:
            with self._lock:
                if path in self._entries and not self._entries[path].open:
                    self._drop(path)
                    self._bump()
            return
        self._put(path, text, None, open_=False, edit_line=None, touched=mtime)

    def _disk_removed(self, path: str, is_dir: bool) -> None:
        path = os.path.abspath(path)
        if os.path.basename(path) == ".gitignore":
            rules = self._rules_for(path)
            if rules is not None:
                rules.invalidate(os.path.dirname(path))
            return
        with self._lock:
            doomed = [p for p, e in self._entries.items() if not e.open and (p == path or (is_dir and _inside(p, path)))]
            for p in doomed:
                self._drop(p)
            if doomed:
                self._bump()

    def _recheck_ignored(self, rules: IgnoreRules) -> None:
        with self._lock:
            doomed = [p for p, e in self._entries.items() if not e.open and _inside(p, rules.root) and rules.ignored(p)]
            for p in doomed:
                self._drop(p)
            if doomed:
                self._bump()

    def _read(self, path: str) -> tuple[str | None, float]:
        """File text, or None if missing, huge, binary or not UTF-8."""
        try:
            st = os.stat(path)
            if st.st_size > self.max_file_bytes:
                return None, 0.0
            with open(path, "rb") as f:
                data = f.read(self.max_file_bytes + 1)
        except (FileNotFoundError, IsADirectoryError, PermissionError):
            return None, 0.0
        except OSError as exc:
            log.debug("cannot read %s: %s", path, exc)
            return None, 0.0
        if len(data) > self.max_file_bytes or b"\x00" in data[:8192]:
            return None, 0.0
        try:
            return data.decode("utf-8"), st.st_mtime
        except UnicodeDecodeError:
            return None, 0.0

    def _scan_dir(self, top: str) -> None:
        """Load the most recently modified source files under `top`, up to the budget."""
        top = os.path.abspath(top)
        rules = self._rules_for(top)
        if rules is None or (top != rules.root and rules.ignored(top, is_dir=True)):
            return
        found: list[tuple[float, str]] = []
        stack = [top]
        while stack and len(found) < self.max_scan_files:
            d = stack.pop()
            try:
                with os.scandir(d) as it:
                    for de in it:
                        try:
                            if de.is_dir(follow_symlinks=False):
                                if not rules.ignored(de.path, is_dir=True):
                                    stack.append(de.path)
                            elif de.is_file(follow_symlinks=False) and language_of(de.name) is not None:
                                st = de.stat(follow_symlinks=False)
                                if st.st_size <= self.max_file_bytes and not rules.ignored(de.path):
                                    found.append((st.st_mtime, de.path))
                        except OSError:
                            continue  # vanished or unreadable entry: skip it, keep scanning
            except OSError as exc:
                log.debug("cannot scan %s: %s", d, exc)
        found.sort(reverse=True)
        loaded = 0
        texts: list[tuple[str, str, float]] = []
        for _, path in found:
            if loaded >= self.max_bytes:
                break
            with self._lock:
                if path in self._entries:
                    continue
            text, mtime = self._read(path)
            if text is not None:
                texts.append((path, text, mtime))
                loaded += len(text)
        # Oldest first, so the LRU order matches modification times.
        for path, text, mtime in reversed(texts):
            with self._lock:
                if path in self._entries:
                    continue  # a watcher event got there first with newer text
            self._put(path, text, None, open_=False, edit_line=None, touched=mtime)


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)
