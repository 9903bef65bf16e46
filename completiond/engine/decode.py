"""The decode loop, as a few plain functions: `decode` prefills, then runs rounds; a speculative round is
`draft`, `verify`, `accept`. The loop never names a draft kind: speculators.py builds the round.

Sequence invariant: `seq` holds the KV of every committed token except the last one, `pending`, which is
the next model input.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from completiond.engine import native as native_mod
from completiond.engine import sampling
from completiond.engine.calibration import Calibration
from completiond.engine.cancel import CancelToken
from completiond.engine.draft import Draft, Proposal
from completiond.engine.kvcache import KVSequence
from completiond.engine.params import ConstraintFn, SamplingParams, Stats, StopFn
from completiond.engine.runner import Runner

# At most this many uncached prompt tokens go through the first decode step with the pending token
# (forward.SMALL_T positions still take the small-pass kernels).
MERGE_PREFILL = 7


class Host(Runner, Protocol):
    """What the loop and the speculators use of the engine beyond a draft's Runner (engine.py's Engine)."""

    calibration: Calibration
    exit_adapter: Any  # exit_adapter.ExitAdapter | None
    draft_model: Any  # a separate draft model's Engine | None
    medusa: Any  # medusa.Medusa | None
    pending_dev: tuple[int, torch.Tensor] | None  # the last committed token, kept on the device

    def prefill(
        self,
        seq: KVSequence,
        tokens: Sequence[int],
        cancel: CancelToken | None,
        draft: Draft | None = None,
        chunk_size: int = ...,
    ) -> bool: ...

    prefill_chunk: int


@dataclass
class Request:
    """One request's decoding state, what every round reads."""

    params: SamplingParams
    warp: sampling.Warp
    rng: torch.Generator
    constraint: ConstraintFn | None
    stats: Stats
    cancel: CancelToken | None = None


class Round(Protocol):
    """What speculators.py builds for a request: one round after `pending` at a time."""

    room: int  # the most tokens a round writes ahead of the committed ones
    merges_prefill: bool  # whether a keystroke's few new prompt tokens may ride on the first step

    @property
    def draft(self) -> Draft | None:
        """The draft shown the prefill's states at its tap layer (None: no draft, or none that taps)."""

    def step(
        self, engine: Host, seq: KVSequence, pending: int, out: list[int], remaining: int, req: Request
    ) -> list[int] | None:
        """The tokens the round commits after pending, or None when cancelled mid-round."""


def decode(
    engine: Host,
    seq: KVSequence,
    prompt: list[int],
    reused: int,
    rounds: Round,
    req: Request,
    stop: StopFn | None,
    on_round: Callable[[list[int]], None] | None,
) -> tuple[list[int], str]:
    """Prefill the prompt's uncached tokens, then run rounds until max_tokens, an end token, a stop or a cancel."""
    params, stats, t0 = req.params, req.stats, time.perf_counter()
    rest = prompt[reused:-1]
    # The prompt's last uncached tokens ride on the first step with the pending token: one pass instead of
    # two (a prefill, then the step).
    merged = merged_tail(engine, seq, rounds, len(rest), req.warp.greedy)
    ahead = rest[len(rest) - merged :] if merged else []
    out: list[int] = []
    finish = (
        "length"
        if engine.prefill(seq, rest[: len(rest) - merged], req.cancel, rounds.draft, engine.prefill_chunk)
        else "cancelled"
    )
    t1 = time.perf_counter()
    stats.prefill_ms = 1000 * (t1 - t0)
    pending = prompt[-1]
    as_prefill = 0.0  # a merged step that is mostly the prompt's last chunk is timed as prefill
    while finish == "length" and len(out) < params.max_tokens:
        if req.cancel is not None and req.cancel.cancelled:
            finish = "cancelled"
            break
        if ahead:
            ts = time.perf_counter()
            new = [plain_step(engine, seq, pending, out, req, before=ahead, draft=rounds.draft)]
            if len(ahead) > MERGE_PREFILL:
                as_prefill = time.perf_counter() - ts
            stats.rounds += 1
            ahead = []
        else:
            got = rounds.step(engine, seq, pending, out, params.max_tokens - len(out) - 1, req)
            if got is None:
                finish = "cancelled"
                break
            new = got
        pending = new[-1]
        finish = take(engine, new, out, params)
        if stop is not None and (keep := stop(out)) is not None:
            del out[keep:]
            finish = "stop"
        if on_round is not None:
            on_round(list(out))
    stats.prefill_ms += 1000 * as_prefill
    stats.decode_ms = 1000 * (time.perf_counter() - t1 - as_prefill)
    return out, finish


def merged_tail(engine: Host, seq: KVSequence, rounds: Round, uncached: int, greedy: bool) -> int:
    """How many of the prompt's `uncached` tokens before the pending one go through the first step with it.
    A keystroke's few (MERGE_PREFILL) on every path. For a greedy request on the native CPU step, whose rows
    have a one-row step's bits whatever the pass (step.c's contract), the whole last prefill chunk: a jump or
    an open saves the step's own pass over the weights, and the tokens are the same (a plain first step and
    a speculative one agree when greedy). A sampled request's draws follow its rounds, so its first round
    stays as before (the same seed, the same text); and elsewhere a pass of more rows may round differently
    (PyTorch's GEMM past forward.SMALL_T)."""
    if not rounds.merges_prefill or uncached <= 0:
        return 0
    if uncached <= MERGE_PREFILL:
        return uncached
    if not greedy or engine.fwd.native_for(engine.fwd.dtype, seq) is None:
        return 0
    return (uncached - 1) % max(1, engine.prefill_chunk) + 1


def take(engine: Host, new: list[int], out: list[int], params: SamplingParams) -> str:
    """Append a round's tokens to out up to an end token or max_tokens; "eos" or "length"."""
    for tok in new:
        if tok in engine.eos_token_ids and not params.ignore_eos:
            return "eos"
        out.append(tok)
        if len(out) >= params.max_tokens:
            break
    return "length"


def plain_step(
    engine: Host,
    seq: KVSequence,
    pending: int,
    gen_tokens: list[int],
    req: Request,
    before: Sequence[int] = (),
    draft: Draft | None = None,
) -> int:
    """One token after pending; `before`: prompt tokens still to feed ahead of it, in the same pass
    (a draft with a tap layer is shown their states there, as prefill does)."""
    warp, constraint = req.warp, req.constraint
    ids, pos = list(before) + [pending], seq.length
    native = engine.fwd.native
    if native is not None and warp.greedy and constraint is None and not before and seq.k.is_contiguous():
        # Embed, layers, head and argmax in one native call (the greedy draft's, run through every
        # layer): the same computation as below, without the ~0.2 ms of Python and tensor glue a
        # step otherwise spends around a ~1 ms pass.
        (token,), _ = native.draft_greedy(
            pending,
            engine.num_layers,
            pos,
            1,
            0.0,
            seq,
            engine.fwd.head_w,
            engine.fwd.head_b,
            None,
            engine.eos_ids_tensor,
        )
        seq.commit(ids)
        return token
    tap = getattr(draft, "tap_layer", None) if before else None
    if tap is None:
        x = (
            engine.fwd.embed(engine.pending_on_device(pending).view(1, 1))
            if engine.resident_ids and not before
            else engine.embed(ids)
        )  # [1, t, d]
        h = engine.run_layers(x, 0, engine.num_layers, pos, seq)
        seq.commit(ids)
    else:
        assert draft is not None
        h_tap = engine.run_layers(engine.embed(ids), 0, tap, pos, seq)
        h = engine.run_layers(h_tap, tap, engine.num_layers, pos, seq)
        seq.commit(ids)
        draft.observe(seq, pos, h_tap)
    logits = sampling.mask_logits(engine.head(h[:, -1:])[-1], _mask(constraint, gen_tokens))
    if warp.greedy:
        nxt = torch.argmax(logits).view(1)  # [1]
    else:
        nxt = torch.multinomial(sampling.probs(logits[None], warp)[0], 1, generator=req.rng)  # [1]
    token = int(nxt)  # the step's one read
    if engine.resident_ids:
        engine.pending_dev = (token, nxt)
    return token


def speculative_round(
    engine: Host,
    seq: KVSequence,
    pending: int,
    gen_tokens: list[int],
    draft: Draft,
    k_max: int,
    threshold: float,
    req: Request,
    limit: int | None = None,
) -> list[int] | None:
    """One draft + verify + accept round. Returns the tokens it commits (accepted drafts + one more),
    or None when cancelled between draft and verify (the draft's scratch KV is simply not committed)."""
    t0 = time.perf_counter()
    proposal = draft.propose(seq, pending, gen_tokens, k_max, threshold, req.warp, req.rng, req.constraint, limit)
    if req.cancel is not None and req.cancel.cancelled:
        return None
    t1 = time.perf_counter()
    if proposal.exit_states is None and not proposal.tokens and req.warp.greedy:
        # Nothing drafted and nothing computed (prompt lookup alone found no match): a plain step,
        # which takes the native path where it can.
        nxt = plain_step(engine, seq, pending, gen_tokens, req)
        req.stats.rounds += 1
        req.stats.draft_ms += 1000 * (t1 - t0)
        req.stats.verify_ms += 1000 * (time.perf_counter() - t1)
        return [nxt]
    m, nxt = verify_and_accept(engine, seq, pending, gen_tokens, draft, proposal, req)
    return count_round(proposal, m, nxt, req.stats, t0, t1)


def verify_and_accept(
    engine: Host, seq: KVSequence, pending: int, gen_tokens: list[int], draft: Draft, proposal: Proposal, req: Request
) -> tuple[int, int]:
    """The target's verdict on a proposal: (m drafts accepted, the next token), pending and the m committed."""
    native = native_verifier(engine, seq, proposal, draft, req)
    if native is not None:
        # A lookup proposal, greedy: embed, every layer, head and argmax in one native call (the plain
        # step's own arithmetic per row), without the Python and tensors between them.
        target = native.verify_greedy(
            [pending] + proposal.tokens, engine.num_layers, seq.length, seq, engine.fwd.head_w, engine.fwd.head_b
        )
        m, nxt = sampling.accept_greedy(proposal.tokens, target)
        seq.commit([pending] + proposal.tokens[:m])
        return m, nxt
    logits, exit_states = verify(engine, seq, pending, gen_tokens, draft, proposal, req.constraint)
    m, nxt = accept(engine, proposal, logits, req)
    p0 = seq.length
    seq.commit([pending] + proposal.tokens[:m])
    if draft.tap_layer is not None and proposal.exit_layer <= draft.tap_layer:
        draft.observe(seq, p0, exit_states[:, : m + 1])
    return m, nxt


def native_verifier(
    engine: Host, seq: KVSequence, proposal: Proposal, draft: Draft, req: Request
) -> native_mod.NativeStep | None:
    """The native step where it verifies this proposal in one call (greedy, from the embeddings), else None."""
    native = engine.fwd.native
    if (
        proposal.exit_states is None
        and native is not None
        and req.warp.greedy
        and req.constraint is None
        and draft.tap_layer is None
        and len(proposal.tokens) + 1 <= native_mod.MAX_ROWS
        and seq.k.is_contiguous()
        and not engine.resident_ids
    ):
        return native
    return None


def verify(
    engine: Host,
    seq: KVSequence,
    pending: int,
    gen_tokens: list[int],
    draft: Draft,
    proposal: Proposal,
    constraint: ConstraintFn | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's logits [k+1, V] after pending and each drafted token (masked by the constraint), and the
    states at the exit layer the pass resumed from (at the draft's tap layer where it has one)."""
    k = len(proposal.tokens)
    exit_states = proposal.exit_states  # [1, k+1, d]: pending and each draft token at layer E
    if exit_states is None:
        # the proposal enters at layer 0: pending and the drafts as embeddings (sampling with no match:
        # the bare pending token)
        exit_states = engine.embed([pending] + proposal.tokens)  # [1, k+1, d]
    if exit_states.shape[1] < k + 1:
        # The last draft token was never fed to the draft: its layers < E run here, once.
        x_last = (
            engine.fwd.embed(proposal.token_ids[-1:].view(1, 1))
            if proposal.token_ids is not None
            else engine.embed(proposal.tokens[-1:])
        )  # [1, 1, d]
        h_last = engine.run_layers(x_last, 0, proposal.exit_layer, seq.length + k, seq)
        exit_states = torch.cat([exit_states, h_last], dim=1)  # [1, k+1, d]
    tap = draft.tap_layer
    if tap is not None and proposal.exit_layer < tap:
        # The draft wants these positions' states at its tap layer: stop there on the way up.
        exit_states = engine.run_layers(exit_states, proposal.exit_layer, tap, seq.length, seq)
        h = engine.run_layers(exit_states, tap, engine.num_layers, seq.length, seq)
    else:
        h = engine.run_layers(exit_states, proposal.exit_layer, engine.num_layers, seq.length, seq)
    logits = engine.head(h)  # [k+1, V]
    masks = proposal.masks + [_mask(constraint, gen_tokens + proposal.tokens)]
    if any(m is not None for m in masks):
        logits = torch.stack([sampling.mask_logits(logits[i], masks[i]) for i in range(k + 1)])
    return logits, exit_states


def accept(engine: Host, proposal: Proposal, logits: torch.Tensor, req: Request) -> tuple[int, int]:
    """(m, next): the longest accepted prefix of the drafts and the token after it (greedy: the target's
    argmax; sampled: the speculative-sampling test, exact in distribution)."""
    if req.warp.greedy:
        target = torch.argmax(logits, dim=-1)  # [k+1]
        m, nxt = sampling.accept_greedy(proposal.tokens, target.tolist())  # the round's one read
        if engine.resident_ids:
            engine.pending_dev = (nxt, target[m : m + 1])
        return m, nxt
    if engine.resident_ids:
        drafted = (
            proposal.token_ids
            if proposal.token_ids is not None
            else torch.tensor(proposal.tokens, dtype=torch.long, device=engine.device)
        )  # [k]
        out = sampling.accept_sampled_resident(
            drafted, proposal.probs, sampling.probs(logits, req.warp), req.rng
        )  # [2]
        m, nxt = out.tolist()  # the round's one read
        engine.pending_dev = (nxt, out[1:])
        return m, nxt
    return sampling.accept_sampled(proposal.tokens, proposal.probs, sampling.probs(logits, req.warp), req.rng)


def count_round(proposal: Proposal, m: int, nxt: int, stats: Stats, t0: float, t1: float) -> list[int]:
    """A verified round's stats (drafted from t0, verified from t1 until now); returns the tokens it
    adds: the m accepted drafts and the verifier's own next one."""
    k = len(proposal.tokens)
    t2 = time.perf_counter()
    stats.rounds += 1
    stats.drafted += k
    stats.accepted += m
    stats.rejected += int(m < k)
    if proposal.from_lookup:
        stats.lookup_rounds += 1
        stats.lookup_drafted += k
        stats.lookup_accepted += m
        stats.lookup_rejected += int(m < k)
        if proposal.from_history:
            stats.history_rounds += 1
            stats.history_accepted += m
    stats.draft_ms += 1000 * (t1 - t0)
    stats.verify_ms += 1000 * (t2 - t1)
    return proposal.tokens[:m] + [nxt]


def choose_k(alpha: float, cost: float, k_max: int) -> int:
    """The K that maximises expected tokens per unit of time.

    K drafts at acceptance α commit (1 - α^(K+1)) / (1 - α) tokens on average; a round
    costs K draft steps of `cost` (relative to one verify pass) plus the verify pass.
    """
    a = min(max(alpha, 0.0), 0.999)
    return max(range(1, k_max + 1), key=lambda k: (1 - a ** (k + 1)) / (1 - a) / (k * cost + 1))


def _mask(constraint: ConstraintFn | None, tokens: list[int]) -> torch.Tensor | None:
    return None if constraint is None else constraint(tokens)
