"""The exit-adapter draft: layers [0, E) of the model, one trained adapter layer, final norm, LM head.

The adapter (models/exit_adapter.py: format and training) is a decoder layer of the model's own
shape that reads layer E's hidden states. Attached to an engine it becomes one more fused layer
past the model's own (Forward.add_layer), with its own K/V slot in every KVSequence. Nothing
else changes for the verifier: it still resumes at layer E from the draft's exit states, and
the KV the draft wrote for layers < E is the verifier's KV.

The adapter's K/V must exist for every earlier position it attends to, but the engine computes
layer-E states only where something needs them. `seq.aux_length` says how far the slot is
valid; the draft fills the rest from, in order of preference:

* the states the draft itself fed (pending and each draft token but the last);
* states at layer E that the engine hands over (`observe`): prefill chunks and verify passes,
  where the engine splits its layer range at E for the purpose (the same arithmetic in two
  calls, so the model's own output is unchanged);
* a read-only recomputation of layers [0, E) over the stored K/V (`write=False`), for what is
  left (a cached prefix written without the adapter). It never writes the model's K/V, which
  must stay exactly what plain decoding wrote.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from completiond.engine.draft import EarlyExitDraft, first_usable
from completiond.engine.draft_kind import DraftKind
from completiond.fileio import user_cache_dir
from completiond.models.exit_adapter import (
    ADAPTER_FILE,
    AdapterFileError,
    build_layer,
    read_adapter,
)

if TYPE_CHECKING:
    from completiond.engine.kvcache import KVSequence
    from completiond.engine.runner import Runner

log = logging.getLogger(__name__)

CATCH_UP_CHUNK = 256


@dataclass
class ExitAdapter:
    exit_layer: int
    slot: int  # its index among the fused layers, and its K/V slot
    path: Path
    training: dict = field(default_factory=dict)


def user_adapter_path(model_id: str) -> Path:
    """Where `completiond train-adapter` writes for a model whose directory is not ours to write (a hub cache)."""
    return user_cache_dir() / "completiond" / "adapters" / f"{model_id}.safetensors"


def adapter_paths(model_dir: Path | None, model_id: str) -> list[Path]:
    """Where an adapter for this model may be, the user's first (it wins, like a calibration record)."""
    paths = [user_adapter_path(model_id)]
    if model_dir is not None:
        paths.append(Path(model_dir) / ADAPTER_FILE)
    return paths


def attach(engine: "Runner", path: Path) -> ExitAdapter:
    """Read, check and fuse the adapter at path into the engine (raises AdapterFileError)."""
    record = read_adapter(path, engine.model_id, engine.model.config)
    layer = build_layer(engine.model, record)
    del engine.fwd.layers[engine.num_layers :]  # an adapter attached before is replaced
    slot = engine.fwd.add_layer(layer)
    return ExitAdapter(record.exit_layer, slot, Path(path), record.training)


def find_and_attach(engine: "Runner", model_dir: Path | None) -> ExitAdapter | None:
    adapter = first_usable(
        adapter_paths(model_dir, engine.model_id), lambda p: attach(engine, p), AdapterFileError, "exit adapter", log
    )
    if adapter is not None:
        log.info("exit adapter %s (exit layer %d)", adapter.path, adapter.exit_layer)
    return adapter


class AdapterDraft(EarlyExitDraft):
    """Early exit at E through the trained adapter layer."""

    kind = DraftKind.ADAPTER

    def __init__(self, engine: "Runner", adapter: ExitAdapter):
        super().__init__(engine, adapter.exit_layer)
        self.slot = adapter.slot
        self.tap_layer = adapter.exit_layer
        # Layer-E states [1, n, d] of committed positions [start, start + n) not yet through the
        # adapter; start is always seq.aux_length. Lives for one generate() call (one sequence).
        self._carry: tuple[int, torch.Tensor] | None = None
        self._fed: tuple[int, int] | None = None  # adapter K/V this round's drafting wrote: [start, end)

    # ------------------------------------------------------------ the adapter's K/V
    def _adapter(self, seq: "KVSequence", h: torch.Tensor, pos: int) -> torch.Tensor:
        return self.engine.run_layers(h, self.slot, self.slot + 1, pos, seq)

    def _fill(self, seq: "KVSequence", upto: int) -> None:
        """Adapter K/V for committed positions [seq.aux_length, upto)."""
        a = seq.aux_length
        if a >= upto:
            return
        c = self._carry
        if c is not None and c[0] == a and c[0] + c[1].shape[1] >= upto:
            self._adapter(seq, c[1][:, : upto - a], a)
            rest = c[1][:, upto - a :]
            self._carry = (upto, rest) if rest.shape[1] else None
        else:
            eng = self.engine
            self._carry = None
            for s in range(a, upto, CATCH_UP_CHUNK):
                e = min(upto, s + CATCH_UP_CHUNK)
                ids = torch.as_tensor(seq.tokens[s:e], device=eng.device)[None]  # [1, e - s]
                h = eng.fwd.layers_range(eng.fwd.embed(ids), 0, self.exit_layer, s, seq, write=False)
                self._adapter(seq, h, s)
        seq.aux_length = upto

    def observe(self, seq: "KVSequence", pos: int, states: torch.Tensor, eager: bool = False) -> None:
        """The engine committed positions [pos, pos + n) whose layer-E states are `states` [1, n, d]."""
        if self._fed is not None:
            start, end = self._fed
            if seq.aux_length == start:
                seq.aux_length = min(end, seq.length)
            self._fed = None
        a, end = seq.aux_length, pos + states.shape[1]
        if self._carry is not None and self._carry[0] != a:
            self._carry = None
        if a >= end:
            self._carry = None
        elif pos <= a:
            self._carry = (a, states[:, a - pos :])
        elif self._carry is not None and self._carry[0] + self._carry[1].shape[1] == pos:
            self._carry = (a, torch.cat([self._carry[1], states], dim=1))
        elif eager:
            self._fill(seq, pos)  # a gap before this chunk (a cached prefix): recompute it once
            self._carry = (pos, states)
        else:
            self._carry = None
        if eager:
            self._fill(seq, min(end, seq.length))

    # ------------------------------------------------------------ drafting
    def propose(self, seq, pending, generated, k_max, threshold, warp, rng, constraint, limit=None):
        self._fed = None  # set by the first draft_logits() of the round
        return super().propose(seq, pending, generated, k_max, threshold, warp, rng, constraint, limit)

    def draft_logits(self, seq: "KVSequence", h: torch.Tensor, pos: int) -> torch.Tensor:
        """Draft logits for the token after position pos, whose layer-E state is h [1, 1, d]."""
        if self._fed is None:
            # First step of a round: bring the adapter up to the pending token, in one pass with it
            # when the carried states reach it (all drafts accepted last round: one position).
            a = seq.aux_length
            c = self._carry
            if c is not None and c[0] == a and a + c[1].shape[1] == pos:
                x, start = torch.cat([c[1], h], dim=1), a  # [1, n + 1, d]
                self._carry = None
            else:
                self._fill(seq, pos)
                x, start = h, pos
            self._fed = (start, pos)
        else:
            x, start = h, pos
        out = self._adapter(seq, x, start)
        self._fed = (self._fed[0], pos + 1)
        return self.engine.draft_head(out[:, -1:])
