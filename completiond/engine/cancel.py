"""The cancel flag shared by the scheduler and the engine (no torch import, so the LSP side can use it)."""

from __future__ import annotations

import threading


class CancelToken:
    """Set from any thread; the engine checks it before each round, between draft and verify,
    and between prefill chunks."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def cancel(self) -> None:
        self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()
