"""Download progress as one byte count: what huggingface_hub's per-file tqdm bars report, summed for a pull."""

from __future__ import annotations

from typing import Callable


class ByteCounter:
    """A stand-in for the tqdm bar huggingface_hub updates per file: it adds the bytes to one total
    (`sink`, set on a subclass per pull)."""

    sink: Callable[[int], None]

    def __init__(self, *args, **kwargs):
        if kwargs.get("initial"):
            self.sink(int(kwargs["initial"]))

    def update(self, n=1):
        self.sink(int(n or 0))

    def update_transfer(self, n=1):  # network bytes of xet transfers: update() already counts what was written
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def close(self):
        pass

    def refresh(self, *a, **k):
        pass

    set_postfix_str = set_transfer_postfix_str = set_description = set_description_str = refresh
