"""The daemon's last answers, for a request that asks exactly what was answered before.

Editors ask again where nothing changed: a switch back to a file asks at the cursor it was left at, and VS Code
asks again when the editor regains focus. The answer depends only on the document's text, the cursor, the
settings, the context block and the model (greedy decoding is deterministic, and sampling draws from the
settings' seed), so the same inputs get the same answer without running the model again. The key holds all of
them (the texts by digest), so a hit is what a cold run gives. Only whole answers are kept: never a cancelled
or failed run, nor a team server's (it keeps its own cache).
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any

ENTRIES = 64  # answers kept: a few per file of a working set; each a suggestion's text and its stats


def _digest(*parts: str) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        data = part.encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.digest()


def key(
    text: str,
    offset: int,
    cfg: Hashable,
    path: str | None,
    language: str | None,
    context: Sequence[tuple[str, str]],
) -> tuple:
    """What an answer depends on, besides the model (Results keeps one model's answers)."""
    flat = [s for pair in context for s in pair]
    return (_digest(text), offset, cfg, path, language, _digest(*flat))


class Results:
    """An LRU of answers for one completer; a new completer (a reload) starts it empty. Any thread."""

    def __init__(self, entries: int = ENTRIES):
        self.entries = entries
        self._lock = threading.Lock()
        self._answers: OrderedDict[tuple, dict[str, Any]] = OrderedDict()
        self._owner: weakref.ref | None = None

    def _for(self, completer: Any) -> None:
        """Under the lock: forget another completer's answers."""
        if self._owner is None or self._owner() is not completer:
            self._answers.clear()
            self._owner = weakref.ref(completer)

    def get(self, completer: Any, k: tuple) -> dict[str, Any] | None:
        with self._lock:
            self._for(completer)
            found = self._answers.get(k)
            if found is None:
                return None
            self._answers.move_to_end(k)
            return dict(found)

    def put(self, completer: Any, k: tuple, answer: dict[str, Any]) -> None:
        with self._lock:
            self._for(completer)
            self._answers[k] = dict(answer)
            self._answers.move_to_end(k)
            while len(self._answers) > self.entries:
                self._answers.popitem(last=False)
