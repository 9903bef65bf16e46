"""Per-model speculation settings (exit layer E, K, draft threshold), measured by `completiond calibrate`.

Records live in the user's cache directory keyed by the model's identity and
are never written into the model. A model directory may ship a default in its
`completiond.json` under "speculation" (the bundled model does: see
model_info.py); a user record wins over it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

from completiond.engine.draft_kind import MODEL_DRAFTS, DraftKind
from completiond.engine.model_info import ModelInfo
from completiond.fileio import read_file, user_cache_dir, write_text_atomic

log = logging.getLogger(__name__)

RECORD_LIMIT = 1 << 20  # a record is a few hundred bytes


@dataclass
class Calibration:
    speculative: bool
    exit_layer: int
    draft_k: int
    threshold: float = 0.0
    source: str = "heuristic"
    measured: dict = field(default_factory=dict)
    # The draft scores only these ids (the most frequent ones); empty means the whole vocabulary.
    draft_vocab: list = field(default_factory=list)
    # Prompt-lookup (n-gram) drafts before the early-exit draft.
    prompt_lookup: bool = False
    # The model draft (draft_kind.MODEL_DRAFTS): early exit (layers [0, E) + head), through the trained exit
    # adapter, the separate draft model (when one is configured) or Medusa heads (greedy).
    draft: DraftKind = DraftKind.EARLY_EXIT

    @classmethod
    def heuristic(cls, num_layers: int) -> "Calibration":
        # Uncalibrated: a quarter of the depth drafts cheaply. Ordinary models
        # may draft badly from there; `completiond calibrate` finds out.
        return cls(speculative=num_layers >= 2, exit_layer=max(1, num_layers // 4), draft_k=4)

    @classmethod
    def from_dict(cls, data: dict, num_layers: int, source: str) -> "Calibration":
        cal = cls(
            speculative=bool(data["speculative"]),
            exit_layer=int(data["exit_layer"]),
            draft_k=int(data["draft_k"]),
            threshold=float(data.get("threshold", 0.0)),
            source=source,
            measured=dict(data.get("measured", {})),
            draft_vocab=[int(t) for t in data.get("draft_vocab", [])],
            prompt_lookup=bool(data.get("prompt_lookup", False)),
            draft=_model_draft(data.get("draft", DraftKind.EARLY_EXIT)),
        )
        if not 1 <= cal.exit_layer < num_layers or not 1 <= cal.draft_k <= 32 or not 0 <= cal.threshold <= 1:
            raise ValueError(f"calibration out of range for a {num_layers}-layer model: {data}")
        return cal


def _model_draft(value: object) -> DraftKind:
    """A record's draft, parsed (ValueError for a name that is no model draft: the record is ignored)."""
    kind = next((k for k in MODEL_DRAFTS if k.value == value), None)
    if kind is None:
        raise ValueError(f"unknown draft {value!r} (known: {', '.join(k.value for k in MODEL_DRAFTS)})")
    return kind


def cache_dir() -> Path:
    return user_cache_dir() / "completiond" / "calibration"


def record_path(model_id: str) -> Path:
    return cache_dir() / f"{model_id}.json"


def load_calibration(model_id: str, info: ModelInfo | None, num_layers: int) -> Calibration:
    """The user's record for this model, else the model's shipped defaults, else the heuristic."""
    path = record_path(model_id)
    try:
        # A regular file under a cap (a link to /dev/zero is refused at once, not read).
        return Calibration.from_dict(
            json.loads(read_file(path, RECORD_LIMIT)), num_layers, f"user calibration ({path})"
        )
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        # A damaged record (JSON nested too deeply included) must not stop the model from loading.
        log.warning("ignoring calibration %s: %s", path, exc)
    if info is not None and info.speculation is not None:
        try:
            return Calibration.from_dict(info.speculation, num_layers, f"model default ({info.path})")
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring the speculation defaults in %s: %s", info.path, exc)
    return Calibration.heuristic(num_layers)


def save_calibration(model_id: str, cal: Calibration) -> Path:
    path = record_path(model_id)
    data = asdict(cal)
    data.pop("source")
    write_text_atomic(path, json.dumps(data, indent=2))
    return path
