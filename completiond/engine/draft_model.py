"""A separate draft model: a smaller model with the target's tokenizer proposes, the target verifies.

The draft model runs on its own fused weights (a second `Runner`, engine/runner.py: its own
engine, whose forward pass is used and nothing else) and keeps its own K/V in a `KVSequence`
that rides on the target's sequence (`seq.companion`): the target's prefix cache crops, copies and evicts it together with the
target's, so a keystroke that reuses the target's prefix reuses the draft's too, and the
cancel points are the target's. The companion may lag behind the target (lookup rounds, a
rejected draft, a sequence cached before the draft model was attached); each round first
feeds it what it lacks, in one multi-token pass.

Its proposals enter the verifier at layer 0 (their embeddings) with q the draft model's warped
distribution, so acceptance is exact under sampling as for any draft. Both models must share
one vocabulary: a draft with another tokenizer is refused when it is attached.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from completiond.engine import sampling
from completiond.engine.draft import Proposal
from completiond.engine.draft_kind import DraftKind

if TYPE_CHECKING:
    from completiond.engine.kvcache import KVSequence
    from completiond.engine.runner import Runner

CATCH_UP_CHUNK = 256


def tokenizer_mismatch(target, draft) -> str | None:
    """Why these two tokenizers cannot share drafts, or None when they can."""
    tv, dv = target.get_vocab(), draft.get_vocab()
    if tv == dv:
        return None
    only_t = sorted(set(tv) - set(dv))[:3]
    only_d = sorted(set(dv) - set(tv))[:3]
    moved = sorted(t for t in set(tv) & set(dv) if tv[t] != dv[t])[:3]
    parts = [f"{len(tv)} vs {len(dv)} tokens"]
    if only_t:
        parts.append(f"only the target has {only_t}")
    if only_d:
        parts.append(f"only the draft has {only_d}")
    if moved:
        parts.append(f"{moved} have other ids")
    return "; ".join(parts)


class DraftModelDraft:
    kind = DraftKind.DRAFT_MODEL
    exit_layer = 0
    tap_layer: int | None = None

    def __init__(self, engine: "Runner", drafter: "Runner"):
        self.engine = engine
        self.drafter = drafter
        self.vocab = engine.vocab_size
        self._fed: tuple[int, list[int]] | None = None  # (start, tokens the companion was fed from start)

    def observe(self, seq, pos, states, eager=False) -> None:
        pass

    def _companion(self, seq: "KVSequence") -> "KVSequence":
        d = seq.companion
        if d is None:
            d = seq.companion = self.drafter.new_sequence(seq.capacity)
        d.ensure_capacity(seq.capacity)
        return d

    def _reconcile(self, seq: "KVSequence", d: "KVSequence") -> None:
        """Extend the companion's valid length over what last round's drafting fed that the target kept."""
        if self._fed is None:
            return
        start, fed = self._fed
        self._fed = None
        if d.length != start:
            return
        n = 0
        limit = min(len(fed), seq.length - start)
        while n < limit and fed[n] == int(seq.tokens[start + n]):
            n += 1
        d.commit(fed[:n])

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """Draft logits over the target's vocabulary [V] for the last position of h [1, t, d]."""
        logits = self.drafter.head(h[:, -1:])[-1]  # [Vd]
        if logits.shape[0] > self.vocab:
            logits = logits[: self.vocab]  # ids past the shared vocabulary are padding rows
        elif logits.shape[0] < self.vocab:
            logits = torch.cat([logits, logits.new_full((self.vocab - logits.shape[0],), float("-inf"))])
        return logits

    def propose(self, seq, pending, generated, k_max, threshold, warp, rng, constraint, limit=None) -> Proposal:
        eng, dr = self.engine, self.drafter
        d = self._companion(seq)
        self._reconcile(seq, d)
        if d.length > seq.length:
            d.crop(seq.length)
        p0 = seq.length
        # Bring the companion up to the pending token: committed tokens it lacks, then pending.
        feed = seq.tokens[d.length : p0].tolist() + [pending]
        start = d.length
        for s in range(0, len(feed), CATCH_UP_CHUNK):
            chunk = feed[s : s + CATCH_UP_CHUNK]
            h = dr.run_layers(dr.embed(chunk), 0, dr.num_layers, start + s, d)
        d.commit(feed[:-1])  # pending's K/V is written but stays scratch until the target commits it
        fed = [pending]
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        masks: list = []
        for i in range(k_max):
            mask = None if constraint is None else constraint(generated + tokens)
            logits = sampling.mask_logits(self._logits(h), mask)
            if not torch.isfinite(logits.max()):
                break
            if warp.greedy:
                tok = int(torch.argmax(logits))
                top = float(torch.softmax(logits, -1)[tok]) if threshold > 0 else 1.0
            else:
                q = sampling.probs(logits[None], warp)[0]  # [V]
                tok = sampling.sample(q, rng)
                top = float(q.max())
            if top < threshold:
                break
            tokens.append(tok)
            masks.append(mask)
            if not warp.greedy:
                probs.append(q)
            if tok in eng.eos_token_ids or i == k_max - 1:
                break
            h = dr.run_layers(dr.embed([tok]), 0, dr.num_layers, p0 + 1 + i, d)
            fed.append(tok)
        self._fed = (p0, fed)
        # no states: its tokens enter the verifier at layer 0, embedded there (or in one native greedy call)
        return Proposal(tokens, torch.stack(probs) if probs else None, masks, None, exit_layer=0, kind=self.kind)
