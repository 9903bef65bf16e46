"""The workspace folders: which editors added each one, and each one's ignore rules.

Not locked by itself: the workspace changes it under its lock. Lookups that other threads make
without that lock (the watcher's events, the privacy gate) iterate over a copy of the dicts, so a
folder added or removed meanwhile is seen or not, never half.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Iterable

from completiond.completion.privacy import _inside
from completiond.completion.workspace.gitignore import IgnoreRules


class Folders:
    def __init__(self) -> None:
        self.rules: dict[str, IgnoreRules] = {}  # folder -> its ignore rules
        self.owners: dict[str, set] = {}  # folder -> editors that added it

    def __iter__(self):
        return iter(list(self.rules))

    def add(self, root: str, owner: Hashable) -> bool:
        """`owner` has the folder `root`; True if nobody had it before (it is new)."""
        owners = self.owners.setdefault(root, set())
        new = not owners
        owners.add(owner)
        if new:
            self.rules[root] = IgnoreRules(root)
        return new

    def remove(self, root: str, owner: Hashable) -> bool:
        """`owner` no longer has `root`; True if nobody has it now (it is gone)."""
        owners = self.owners.get(root)
        if owners is None:
            return False
        owners.discard(owner)
        if owners:
            return False
        del self.owners[root]
        self.rules.pop(root, None)
        return True

    def of(self, owner: Hashable, announced: Iterable[str] = ()) -> list[str]:
        """The folders `owner` added, then those of `announced` not among them: folders an editor announced that
        the I/O thread may not have set up yet (its first request's admission and context count them)."""
        mine = [root for root, owners in list(self.owners.items()) if owner in owners]
        for root in announced:
            root = os.path.abspath(root)
            if root not in mine:
                mine.append(root)
        return mine

    def rules_for(self, path: str) -> IgnoreRules | None:
        """The rules of the deepest folder holding `path`."""
        best = None
        for root, rules in list(self.rules.items()):
            if _inside(path, root) and (best is None or len(root) > len(best.root)):
                best = rules
        return best

    def root_of(self, path: str) -> str | None:
        rules = self.rules_for(path)
        return rules.root if rules is not None else None

    def relpath(self, path: str) -> str:
        """Path as the context block names it: relative to a folder holding it, else its base name."""
        for root in list(self.rules):
            if _inside(path, root):
                return os.path.relpath(path, root).replace(os.sep, "/")
        return os.path.basename(path)
