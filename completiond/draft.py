"""Draft side of speculative decoding.

A draft proposes up to K tokens after `pending` and returns, for the verifier,
the hidden states it reached at layer `exit_layer` for every token it fed, so
that verification resumes there instead of starting again from the embedding.
Early exit is the first implementation. A skip-set draft fits the same shape;
a prompt-lookup or separate-model draft returns exit_layer 0 and the
embeddings, and the verifier then runs every layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

import torch

from completiond import sampling

if TYPE_CHECKING:
    from completiond.engine import Engine
    from completiond.kvcache import KVSequence


@dataclass
class Proposal:
    tokens: list[int]  # k drafted ids
    probs: torch.Tensor | None  # [k, V] warped draft distributions q (None when greedy)
    masks: list  # the constraint mask used at each of the k positions (or None)
    exit_states: torch.Tensor  # [1, n, d] states at exit_layer for pending and the fed drafts; n is k or k+1


class Draft(Protocol):
    exit_layer: int

    def propose(self, seq: "KVSequence", pending: int, generated: list[int], k_max: int, threshold: float,
                warp: sampling.Warp, rng: torch.Generator, constraint: Callable | None) -> Proposal: ...


class EarlyExitDraft:
    """Layers [0, E) + final norm + the shared LM head of the target model itself."""

    def __init__(self, engine: "Engine", exit_layer: int):
        self.engine = engine
        self.exit_layer = exit_layer

    def propose(self, seq, pending, generated, k_max, threshold, warp, rng, constraint) -> Proposal:
        eng = self.engine
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        masks: list = []
        states: list[torch.Tensor] = []
        x = pending
        for i in range(k_max):
            # The KV written here for layers < E is exactly what the verifier would write: it stays.
            h = eng.run_layers(eng.embed([x]), 0, self.exit_layer, seq.length + i, seq)  # [1, 1, d]
            states.append(h)
            mask = None if constraint is None else constraint(generated + tokens)
            logits = sampling.mask_logits(eng.head(h)[-1], mask)  # [V]
            if warp.greedy:
                tok = int(torch.argmax(logits))
                top = float(torch.exp(logits[tok] - torch.logsumexp(logits, dim=-1))) if threshold > 0 else 1.0
            else:
                q = sampling.probs(logits[None], warp)[0]
                tok = sampling.sample(q, rng)
                top = float(q.max())
            if top < threshold:
                break  # unsure: let the verifier take over from this exit state
            tokens.append(tok)
            masks.append(mask)
            if not warp.greedy:
                probs.append(q)
            if tok in eng.eos_token_ids:
                break
            x = tok
        return Proposal(tokens, torch.stack(probs) if probs else None, masks, torch.cat(states, dim=1))
