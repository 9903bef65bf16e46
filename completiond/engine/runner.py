"""The model runner: what a draft may use of the model it drafts for.

Drafts (draft.py, draft_model.py, exit_adapter.py, medusa.py) run the target model's own layers,
head and KV cache, but they never import the engine that composes them: engine.py imports the
drafts and hands itself over as a `Runner`. Keeping the drafts on this small interface keeps the
engine's modules importing one way (tests/test_architecture.py refuses a circle, and checks that
the drafts reach for nothing this protocol does not name).

`Engine` provides every member below; a separate draft model is itself an `Engine`, so it is a
`Runner` too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, Sequence

import torch

if TYPE_CHECKING:
    from completiond.engine.forward import Forward
    from completiond.engine.kvcache import KVSequence


class Runner(Protocol):
    model: Any  # the loaded transformers module (its config; an adapter copies a layer's shape)
    model_id: str  # the identity trained draft files are keyed to
    device: Any  # torch device (or its name)
    dtype: torch.dtype
    num_layers: int  # the model's own layers (an attached exit adapter's layer comes after them)
    vocab_size: int
    eos_token_ids: set[int]
    eos_ids_tensor: torch.Tensor  # the same ids, [n] int64, for native drafts
    resident_ids: bool  # keep token ids on the device within a round (accelerators)
    fwd: "Forward"  # the fused forward pass (layers, norm, head, native step)
    draft_ids: torch.Tensor | None  # [Vd] the ids a draft head scores, or None: all of them
    draft_head_weight: torch.Tensor | None  # [Vd, d] the LM head's rows for draft_ids

    def run_layers(
        self,
        h: torch.Tensor,
        first: int,
        last: int,
        pos: int,
        seq: "KVSequence",
        tree: "tuple[torch.Tensor, torch.Tensor] | None" = None,
    ) -> torch.Tensor:
        """Layers [first, last) on h [1, t, d] at positions [pos, pos + t), writing their K/V into seq."""

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head: [1, t, d] -> logits [t, V] float32."""

    def draft_head(self, h: torch.Tensor) -> torch.Tensor:
        """Draft logits [Vd] for the last position of h [1, t, d], over draft_ids (or everything)."""

    def embed(self, tokens: Sequence[int]) -> torch.Tensor:
        """Token ids -> embeddings [1, t, d] on the model's device."""

    def pending_on_device(self, token: int) -> torch.Tensor:
        """token as a [1] device tensor, reusing the one the last round left there."""

    def new_sequence(self, capacity: int) -> "KVSequence":
        """An empty KV sequence with a slot for every fused layer."""
