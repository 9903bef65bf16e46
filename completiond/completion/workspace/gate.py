"""The privacy gate as the workspace applies it: privacy.classify with the folders' ignore rules,
its verdicts on context candidates cached (a query asks for every file with a matching chunk,
every didChange for the document changed).

Not locked by itself: the cache is used under the workspace's lock; `admit` may run without it
(it reads the folders' rules through a dict lookup only).
"""

from __future__ import annotations

from collections.abc import Iterable

from completiond.completion.privacy import Verdict, classify
from completiond.completion.workspace.folders import Folders
from completiond.completion.workspace.gitignore import IgnoreRules

MAX_VERDICTS = 50_000


class Gate:
    def __init__(self, folders: Folders):
        self.folders = folders
        self._verdicts: dict[tuple, bool] = {}  # (path, owner's folders, exclude) -> the gate's remote_ok

    def admit(self, path: str, roots: list[str], exclude: Iterable[str], read_from_disk: bool = False) -> Verdict:
        """classify() with the folders' ignore rules. read_from_disk: an entry read from disk passed those
        rules when it was read, and leaves when a .gitignore change ignores it (the disk sync's recheck),
        so its (deep paths: costly) ignore check is skipped; every other rule is applied as for any file."""

        def ignored(root: str, p: str) -> bool:
            rules = self.folders.rules.get(root) or IgnoreRules(root)  # a folder still being set up: read its rules now
            return rules.ignored(p)

        return classify(path, roots, exclude=exclude, ignored=None if read_from_disk else ignored)

    def context_ok(self, path: str, roots: list[str], exclude: tuple[str, ...] = ()) -> bool:
        """Whether `path`'s text may be context for the editor with folders `roots` (cached until `clear`)."""
        key = (path, tuple(roots), exclude)
        ok = self._verdicts.get(key)
        if ok is None:
            if len(self._verdicts) > MAX_VERDICTS:
                self._verdicts.clear()
            ok = self._verdicts[key] = self.admit(path, roots, exclude).remote_ok
        return ok

    def clear(self) -> None:
        """Folders or ignore rules changed: every cached verdict may be stale."""
        self._verdicts.clear()
