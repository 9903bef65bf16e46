"""Logit warping and the exact accept/reject step of speculative sampling.

Both the draft distribution q and the target distribution p go through the same
`warp` (constraint mask, temperature, top-k, top-p) before the test, so the
tokens that come out are distributed exactly as the warped target.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Warp:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """logits [..., V]; allowed: bool [V] or None."""
    if allowed is None:
        return logits
    return logits.masked_fill(~allowed, float("-inf"))


def probs(logits: torch.Tensor, warp: Warp) -> torch.Tensor:
    """Warped distribution over the vocabulary. logits: [T, V] float -> probs [T, V] float32."""
    logits = logits.float() / warp.temperature
    vocab = logits.shape[-1]
    if 0 < warp.top_k < vocab:
        kth = torch.topk(logits, warp.top_k, dim=-1).values[..., -1:]  # [T, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if warp.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [T, V] each
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p;
        # the most likely token is therefore always kept.
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = before >= warp.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.softmax(logits, dim=-1)


def sample(p: torch.Tensor, gen: torch.Generator) -> int:
    """One draw from p [V]."""
    return int(torch.multinomial(p, 1, generator=gen).item())


def acceptance_probability(p: torch.Tensor, q: torch.Tensor, x: int) -> float:
    """min(1, p(x)/q(x)) for a token x that was drawn from q (so q(x) > 0)."""
    return min(1.0, float(p[x]) / float(q[x]))


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(0, p - q)): what to draw from after a rejection."""
    r = torch.clamp(p - q, min=0.0)
    total = r.sum()
    # A rejection is impossible when p == q; float noise can still get here.
    return r / total if total > 0 else p


def accept_sampled(draft: list[int], q: torch.Tensor | None, p: torch.Tensor, gen: torch.Generator) -> tuple[int, int]:
    """Speculative sampling over one round.

    draft: k drafted ids; q: [k, V] draft probs (None when k == 0); p: [k+1, V] target probs.
    Returns (number accepted m, next token). Per position:
      accept x ~ q with probability min(1, p(x)/q(x)); otherwise draw from
      normalize(max(0, p - q)). Together: P(out = y) = q(y)·min(1, p/q) + P(reject)·res(y) = p(y).
    If all k pass, the bonus token is drawn from p[k].
    """
    if not draft:
        return 0, sample(p[0], gen)
    assert q is not None  # drafted tokens come with their distributions
    for i, x in enumerate(draft):
        u = float(torch.rand((), generator=gen, device=gen.device))
        if u < acceptance_probability(p[i], q[i], x):
            continue
        return i, sample(residual(p[i], q[i]), gen)
    return len(draft), sample(p[len(draft)], gen)


def accept_sampled_resident(
    draft: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor, gen: torch.Generator
) -> torch.Tensor:
    """accept_sampled without reading anything back: the same test and the same distributions,
    computed on the device, for accelerators where each read stalls the host.

    draft: [k] drafted ids; q: [k, V] (None when k == 0); p: [k+1, V]. Returns [2] on the device:
    (m accepted, next token). All k uniforms are drawn at once (those past the first rejection go
    unused, which leaves the output's distribution unchanged: they are independent of it)."""
    k, vocab = draft.numel(), p.shape[-1]
    if k == 0:
        return torch.cat([torch.zeros(1, dtype=torch.long, device=p.device), torch.multinomial(p[0], 1, generator=gen)])
    assert q is not None  # drafted tokens come with their distributions
    rows = torch.arange(k, device=p.device)
    u = torch.rand(k, generator=gen, device=p.device, dtype=p.dtype)
    rejected = u >= torch.clamp(p[rows, draft] / q[rows, draft], max=1.0)  # [k]: not min(1, p(x)/q(x))
    m = torch.where(
        rejected.any(), rejected.to(torch.long).argmax(), torch.tensor(k, device=p.device)
    )  # first one, else k
    # Row k of q is zero: with every draft accepted, the "residual" of p[k] is p[k] itself, the bonus.
    q_ext = torch.cat([q.to(p.dtype), p.new_zeros(1, vocab)])  # [k+1, V]
    at = m.view(1)
    p_m = p.index_select(0, at)[0]  # [V]
    r = torch.clamp(p_m - q_ext.index_select(0, at)[0], min=0.0)
    total = r.sum()
    dist = torch.where(total > 0, r / torch.where(total > 0, total, 1.0), p_m)  # residual's float-noise case: p
    return torch.cat([m.view(1), torch.multinomial(dist, 1, generator=gen)])


def accept_greedy(draft: list[int], target_argmax: list[int]) -> tuple[int, int]:
    """Greedy: keep the longest prefix of the draft equal to the target's argmax.

    target_argmax has k+1 entries; the token after the kept prefix is the target's own choice,
    so the output equals plain greedy decoding token for token.
    """
    m = 0
    while m < len(draft) and draft[m] == target_argmax[m]:
        m += 1
    return m, target_argmax[m]
