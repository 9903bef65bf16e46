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

from completiond.engine import sampling
from completiond.engine.draft_kind import DraftKind
from completiond.engine.lookup import OutputHistory, lookup_for

# Most tokens a lookup proposes: free to draft, so bounded only by what a wider verify pass costs.
LOOKUP_K = 6

if TYPE_CHECKING:
    from completiond.engine.kvcache import KVSequence
    from completiond.engine.runner import Runner


def first_usable(paths, load: Callable, error: type[Exception], what: str, log):
    """load(path) for the first existing path it accepts; a file it refuses (stale, damaged) is skipped
    with a warning: it costs only the draft it would have made."""
    for path in paths:
        if not path.is_file():
            continue
        try:
            return load(path)
        except error as exc:
            log.warning("not using %s %s: %s", what, path, exc)
    return None


@dataclass
class Proposal:
    tokens: list[int]  # k drafted ids
    probs: torch.Tensor | None  # [k, V] warped draft distributions q (None when greedy)
    masks: list  # the constraint mask used at each of the k positions (or None)
    # [1, n, d] states at exit_layer for pending and the fed drafts; n is k or k+1. None: nothing computed,
    # the verifier starts from the embeddings (a lookup proposal; with no tokens, nothing drafted at all)
    exit_states: torch.Tensor | None
    exit_layer: int = 0  # where verification resumes: the layer exit_states were taken at
    kind: DraftKind = DraftKind.EARLY_EXIT  # who proposed it (for stats)
    token_ids: torch.Tensor | None = None  # [k] the same ids on the device, where the draft made them there
    from_history: bool = False  # a lookup proposal found in the output history (for stats)

    @property
    def from_lookup(self) -> bool:
        """Whether prompt lookup proposed it (stats count those rounds apart)."""
        return self.kind is DraftKind.LOOKUP


class Draft(Protocol):
    # (where verification resumes is the proposal's exit_layer: a lookup's differs from its fallback's)
    # A layer whose hidden states the draft wants to see for every committed position (the exit
    # adapter's), or None; the engine then splits its passes there and calls observe().
    tap_layer: int | None

    def propose(
        self,
        seq: "KVSequence",
        pending: int,
        generated: list[int],
        k_max: int,
        threshold: float,
        warp: sampling.Warp,
        rng: torch.Generator,
        constraint: Callable | None,
        limit: int | None = None,
    ) -> Proposal: ...

    def observe(self, seq: "KVSequence", pos: int, states: torch.Tensor, eager: bool = False) -> None:
        """Positions [pos, pos + n) were committed; states [1, n, d] are theirs at tap_layer."""


class EarlyExitDraft:
    """Layers [0, E) + final norm + the shared LM head of the target model itself."""

    kind = DraftKind.EARLY_EXIT
    tap_layer: int | None = None

    def __init__(self, engine: "Runner", exit_layer: int):
        self.engine = engine
        self.exit_layer = exit_layer

    def observe(self, seq, pos, states, eager=False) -> None:
        pass

    def draft_logits(self, seq: "KVSequence", h: torch.Tensor, pos: int) -> torch.Tensor:
        """Draft logits [Vd] for the token after position pos, whose layer-E state is h [1, 1, d]."""
        return self.engine.draft_head(h)

    def propose(self, seq, pending, generated, k_max, threshold, warp, rng, constraint, limit=None) -> Proposal:
        eng = self.engine
        native = eng.fwd.native
        if (
            native is not None
            and warp.greedy
            and constraint is None
            and type(self) is EarlyExitDraft
            and seq.k.is_contiguous()
        ):
            # The whole greedy draft in one native call: the same steps (K/V of layers < E, states at E),
            # without Python between them, which on a lean step cost more than the draft's own layers.
            sub = eng.draft_head_weight  # None: the draft scores the whole vocabulary
            drafted, exit_states = native.draft_greedy(
                pending,
                self.exit_layer,
                seq.length,
                k_max,
                threshold,
                seq,
                eng.fwd.head_w if sub is None else sub,
                eng.fwd.head_b if sub is None else None,
                None if sub is None else eng.draft_ids,
                eng.eos_ids_tensor,
            )
            return Proposal(
                drafted, None, [None] * len(drafted), exit_states, exit_layer=self.exit_layer, kind=self.kind
            )
        if eng.resident_ids and constraint is None and type(self) is EarlyExitDraft:
            return self._propose_resident(seq, pending, k_max, threshold, warp, rng)
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        masks: list = []
        states: list[torch.Tensor] = []
        x = pending
        ids = eng.draft_ids  # [Vd] or None: the draft may score only the frequent ids
        for i in range(k_max):
            # The KV written here for layers < E is exactly what the verifier would write: it stays.
            h = eng.run_layers(eng.embed([x]), 0, self.exit_layer, seq.length + i, seq)  # [1, 1, d]
            states.append(h)
            mask = None if constraint is None else constraint(generated + tokens)
            sub_mask = mask if mask is None or ids is None else mask[ids]
            logits = sampling.mask_logits(self.draft_logits(seq, h, seq.length + i), sub_mask)  # [Vd]
            if not torch.isfinite(logits.max()):
                break  # the constraint leaves the draft nothing: the verifier decides
            if warp.greedy:
                j = int(torch.argmax(logits))
                top = float(torch.exp(logits[j] - torch.logsumexp(logits, dim=-1))) if threshold > 0 else 1.0
            else:
                q_sub = sampling.probs(logits[None], warp)[0]  # [Vd]
                j = sampling.sample(q_sub, rng)
                top = float(q_sub.max())
            if top < threshold:
                break  # unsure: let the verifier take over from this exit state
            tok = j if ids is None else int(ids[j])
            tokens.append(tok)
            masks.append(mask)
            if not warp.greedy:
                # q over the whole vocabulary, zero outside the draft's ids: [V]
                probs.append(
                    q_sub
                    if ids is None
                    else torch.zeros(eng.vocab_size, device=q_sub.device).index_copy_(0, ids, q_sub)
                )
            if tok in eng.eos_token_ids:
                break
            x = tok
        return Proposal(
            tokens,
            torch.stack(probs) if probs else None,
            masks,
            torch.cat(states, dim=1),
            exit_layer=self.exit_layer,
            kind=self.kind,
        )

    def _propose_resident(self, seq, pending, k_max, threshold, warp, rng) -> Proposal:
        """The loop above without a read per token (accelerators): each drafted id is fed on from the
        device, k_max steps always, and one read at the end finds where the loop above stops (the first
        token under the threshold, or just after an end token). The steps past that point leave only
        scratch K/V past the committed length, as a rejected draft does; the tokens are the same."""
        eng = self.engine
        ids = eng.draft_ids  # [Vd] or None
        x = eng.pending_on_device(pending)  # [1]
        toks: list[torch.Tensor] = []
        confs: list[torch.Tensor] = []  # each step's confidence, where the loop above checks one
        states: list[torch.Tensor] = []
        qs: list[torch.Tensor] = []
        for i in range(k_max):
            h = eng.run_layers(eng.fwd.embed(x.view(1, 1)), 0, self.exit_layer, seq.length + i, seq)  # [1, 1, d]
            states.append(h)
            logits = self.draft_logits(seq, h, seq.length + i)  # [Vd]
            if warp.greedy:
                j = torch.argmax(logits)  # []
                if threshold > 0:
                    confs.append(torch.exp(logits[j] - torch.logsumexp(logits, dim=-1)))
            else:
                q_sub = sampling.probs(logits[None], warp)[0]  # [Vd]
                j = torch.multinomial(q_sub, 1, generator=rng)[0]
                confs.append(q_sub.max())
                qs.append(q_sub)
            x = (j if ids is None else ids[j]).view(1)
            toks.append(x)
        drafted = torch.cat(toks)  # [K]
        checked = bool(confs)
        # the draft's one read: K ids (exact in float64), then K confidences
        read: list[float] = torch.cat(
            [drafted.double(), torch.stack(confs).double()] if checked else [drafted.double()]
        ).tolist()
        got, n, stopped_unsure = [int(v) for v in read[:k_max]], 0, False
        while n < k_max:
            if checked and read[k_max + n] < threshold:
                stopped_unsure = True  # the loop above breaks here, after this step's state
                break
            n += 1
            if got[n - 1] in eng.eos_token_ids:
                break
        used = n + 1 if stopped_unsure else n  # the states the loop above would have made
        probs = None
        if qs and n:
            q = torch.stack(qs[:n])  # [n, Vd]
            probs = (
                q
                if ids is None
                else torch.zeros(n, eng.vocab_size, device=q.device, dtype=q.dtype).index_copy_(1, ids, q)
            )
        return Proposal(
            got[:n],
            probs,
            [None] * n,
            torch.cat(states[:used], dim=1),
            exit_layer=self.exit_layer,
            kind=self.kind,
            token_ids=drafted[:n],
        )


class LookupDraft:
    """Prompt lookup first; where the n-gram index has nothing, the fallback draft (early exit),
    or no draft at all (the round is then a plain step).

    A lookup costs no model work: its tokens enter the verifier at layer 0 (their embeddings),
    and the verifier runs every layer on them in one pass.
    """

    def __init__(
        self, engine: "Runner", fallback: "Draft | None", k: int = LOOKUP_K, history: OutputHistory | None = None
    ):
        self.engine = engine
        self.fallback = fallback
        self.k = k
        self.history = history  # earlier requests' outputs (greedy requests only; see OutputHistory)
        self.tap_layer = getattr(fallback, "tap_layer", None)

    def observe(self, seq, pos, states, eager=False) -> None:
        if self.fallback is not None:
            self.fallback.observe(seq, pos, states, eager)

    def propose(self, seq, pending, generated, k_max, threshold, warp, rng, constraint, limit=None) -> Proposal:
        eng = self.engine
        found, from_history = lookup_for(
            seq, pending, min(self.k, limit if limit is not None else self.k), self.history
        )
        tokens: list[int] = []
        masks: list = []
        for tok in found:
            mask = None if constraint is None else constraint(generated + tokens)
            if mask is not None and not bool(mask[tok]):
                break  # the target can never take it: stop proposing here
            tokens.append(tok)
            masks.append(mask)
            if tok in eng.eos_token_ids:
                break
        if tokens:
            probs = None
            if not warp.greedy:
                # deterministic proposal: q is one-hot
                probs = torch.zeros(len(tokens), eng.vocab_size, device=eng.device)
                probs[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
            # no states: the verifier embeds these tokens itself, or runs embed to argmax in one native call
            return Proposal(tokens, probs, masks, None, exit_layer=0, kind=DraftKind.LOOKUP, from_history=from_history)
        if self.fallback is not None:
            return self.fallback.propose(seq, pending, generated, k_max, threshold, warp, rng, constraint, limit)
        return Proposal([], None, [], None, exit_layer=0, kind=DraftKind.NONE)  # the engine takes a plain step
