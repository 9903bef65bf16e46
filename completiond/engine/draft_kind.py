"""The draft kinds, as one closed enum: the names speculators.py registers and every other module uses.

A string naming a kind (a request's `draft`, a calibration record, a bench row) is parsed into a
DraftKind where it enters, so that no module past that point compares strings. DraftKind is a str
enum: a member equals, hashes and serialises as its name, so records and wire messages keep their
format. Torch-free, and imports nothing of the engine: the drafts and the calibration record import it.
"""

from __future__ import annotations

from enum import Enum

from completiond.errors import EngineError


class DraftKind(str, Enum):
    EARLY_EXIT = "early_exit"  # the model's own layers [0, E) + final norm + LM head
    ADAPTER = "adapter"  # early exit through the trained exit adapter's layer
    DRAFT_MODEL = "draft_model"  # a separate small model of the same tokenizer
    MEDUSA = "medusa"  # Medusa heads and a token tree (greedy only)
    NONE = "none"  # no model draft: prompt lookup alone, a plain step where it finds nothing
    LOOKUP = "lookup"  # a proposal found by prompt lookup (stats; never a setting)

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: str | DraftKind, allowed: tuple[DraftKind, ...] | None = None) -> DraftKind:
        """value as a DraftKind, refused with EngineError when it names none of `allowed` (the settings)."""
        allowed = SETTINGS if allowed is None else allowed
        try:
            kind = cls(value)
        except ValueError:
            kind = None
        if kind not in allowed:
            raise EngineError(
                f"unknown draft {value!r}; use {', '.join(k.value for k in allowed[:-1])} or {allowed[-1].value}"
            )
        return kind


# The model drafts a calibration record may name, and what a request's `draft` may name.
MODEL_DRAFTS = (DraftKind.EARLY_EXIT, DraftKind.ADAPTER, DraftKind.DRAFT_MODEL, DraftKind.MEDUSA)
SETTINGS = (*MODEL_DRAFTS, DraftKind.NONE)
