"""What a request asks of the engine and what it gets back: SamplingParams in, Generation (tokens, finish
reason, Stats) out. engine.py re-exports them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from completiond.engine.draft_kind import DraftKind

if TYPE_CHECKING:
    import torch


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    speculative: bool = True
    exit_layer: int | None = None  # None: calibrated
    draft_k: int | None = None  # None: calibrated; the most drafted per round
    draft_threshold: float | None = None  # None: calibrated
    prompt_lookup: bool | None = None  # n-gram drafts from the prompt and output; None: calibrated
    # the draft (draft_kind.SETTINGS; its name as a string is parsed where the plan is made); None: calibrated
    draft: DraftKind | str | None = None
    adaptive_k: bool = True
    ignore_eos: bool = False  # benchmarks: always generate max_tokens


@dataclass
class Stats:
    prompt_tokens: int = 0
    reused_tokens: int = 0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    # ran on fewer threads than configured: other runnable tasks wanted the cores (engine/threads.py)
    threads_reduced: bool = False
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    rejected: int = 0  # rounds that stopped at a rejected draft token
    generated_tokens: int = 0
    exit_layer: int = 0
    draft: str = ""  # the model draft used: a DraftKind's name, or "" (none)
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    lookup_rounds: int = 0  # rounds whose draft came from prompt lookup
    lookup_drafted: int = 0
    lookup_accepted: int = 0
    lookup_rejected: int = 0
    history_rounds: int = 0  # of the lookup rounds, those whose draft came from earlier requests' outputs
    history_accepted: int = 0

    @property
    def alpha(self) -> float:
        """Per-token acceptance probability, the α of (1 - α^(K+1)) / (1 - α).

        Each drafted token after a rejection is never tested, so accepted/drafted would
        understate it; accepted / (accepted + rejections) is its estimate from the tests made.
        """
        tested = self.accepted + self.rejected
        return self.accepted / tested if tested else 0.0

    @property
    def mean_accepted_per_round(self) -> float:
        """Tokens committed per round (accepted drafts plus the target's own token)."""
        return self.generated_tokens / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return 1000.0 * self.generated_tokens / self.decode_ms if self.decode_ms > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(alpha=self.alpha, mean_accepted_per_round=self.mean_accepted_per_round, tokens_per_s=self.tokens_per_s)
        return d


@dataclass
class Generation:
    tokens: list[int]
    finish_reason: str  # "length" | "eos" | "stop" | "cancelled"
    stats: Stats = field(default_factory=Stats)


StopFn = Callable[[list[int]], "int | None"]
ConstraintFn = Callable[[list[int]], "torch.Tensor | None"]
