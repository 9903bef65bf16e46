"""What the daemon counts: requests and how they ended, tokens, drafting, the last request's figures, and
what users did with the suggestions they saw (as their editors report it; never sent anywhere)."""

from __future__ import annotations

import threading
from typing import Any

from completiond.engine.draft_kind import DraftKind
from completiond.serving.scheduler import CANCELLED, OK, Outcome

COUNTERS = (
    "requests",
    "completed",
    "empty",
    "superseded",
    "cancelled",
    "errors",
    "rejected",
    "expired",
    "wasted_rounds",
    "rounds_after_cancel",
    "rounds",
    "latency_ms_sum",
    "prefill_ms_sum",
    "decode_ms_sum",
    "prompt_tokens",
    "reused_tokens",
    "generated_tokens",
    "loads",
    "draft_accepted",
    "draft_rejected",
    "history_accepted",
    "withheld_syntax",
    "reduced_threads",
    "result_hits",
)
SUGGESTION_EVENTS = {
    ("shown", None): "shown",
    ("dismissed", None): "dismissed",
    ("accepted", "full"): "accepted_full",
    ("accepted", "word"): "accepted_word",
    ("accepted", "line"): "accepted_line",
}


class Metrics:
    """Counters folded from finished jobs (worker thread or loop: `counts` is guarded by a lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: dict[str, float] = dict.fromkeys(COUNTERS, 0)
        self.last: dict[str, Any] = {}
        self.suggestions: dict[str, int] = dict.fromkeys(SUGGESTION_EVENTS.values(), 0)

    def add(self, counter: str, n: float = 1) -> None:
        with self._lock:
            self.counts[counter] += n

    def count_suggestion(self, event: str, kind: Any = None) -> str:
        """An editor showed, accepted (kind: full / word / line) or dismissed a suggestion; the counter's name."""
        key = SUGGESTION_EVENTS.get((event, kind))
        if key is None:
            raise ValueError(
                f"unknown suggestion event {event!r} (kind {kind!r}); expected shown, dismissed, "
                "or accepted with kind full, word or line"
            )
        self.suggestions[key] += 1
        return key

    def account(self, outcome: Outcome) -> None:
        """Fold one finished job into the counters."""
        value = outcome.value if isinstance(outcome.value, dict) else None
        stats = (value or {}).get("stats") or {}
        with self._lock:
            c = self.counts
            if value is not None:
                c["rounds"] += stats.get("rounds", 0) or 0
                c["prompt_tokens"] += stats.get("prompt_tokens", 0) or 0
                c["reused_tokens"] += stats.get("reused_tokens", 0) or 0
                # The engine's time in the prompt's uncached tokens and in the steps after them (bench --editing
                # splits a request's wait with these: the prefill rate in the daemon, what a keystroke costs).
                c["prefill_ms_sum"] += stats.get("prefill_ms", 0) or 0
                c["decode_ms_sum"] += stats.get("decode_ms", 0) or 0
                c["generated_tokens"] += stats.get("generated_tokens", 0) or 0
                c["draft_accepted"] += stats.get("accepted", 0) or 0
                c["draft_rejected"] += stats.get("rejected", 0) or 0
                c["history_accepted"] += stats.get("history_accepted", 0) or 0
                c["reduced_threads"] += 1 if stats.get("threads_reduced") else 0
                c["result_hits"] += 1 if stats.get("result_cache") else 0
            if outcome.status == OK:
                c["completed"] += 1
                c["latency_ms_sum"] += (value or {}).get("latency_ms", 0) or 0
                if value and value.get("suggestion") is None:
                    c["empty"] += 1
                if value and value.get("withheld"):
                    c["withheld_syntax"] += 1
                measured = stats.get("generated_tokens") and stats.get("decode_ms")
                self.last = {
                    "latency_ms": value.get("latency_ms") if value else None,
                    "draft_acceptance": stats.get("alpha") if stats.get("drafted") else None,
                    "tokens_per_s": stats.get("tokens_per_s") if measured else None,
                    "draft": _last_draft(stats),
                }
            elif outcome.status == CANCELLED:
                # Rounds run for a request nobody will see: superseded by a newer one, or
                # cancelled by the editor (which, while typing, is the same thing).
                c["wasted_rounds"] += stats.get("rounds", 0) or 0
                c["rounds_after_cancel"] += stats.get("rounds_after_cancel", 0) or 0
                c[outcome.reason if outcome.reason in ("superseded", "expired") else "cancelled"] += 1
            else:
                c["errors"] += 1

    def last_request(self) -> dict[str, Any]:
        """The last completed request's figures, as status() shows them (None: not measured, not 0)."""
        return {
            "last_latency_ms": self.last.get("latency_ms"),
            "draft_acceptance": self.last.get("draft_acceptance"),
            "tokens_per_s": self.last.get("tokens_per_s"),
            "last_draft": self.last.get("draft"),
        }

    def summary(self) -> dict[str, Any]:
        """The counters and the rates derived from them (stats())."""
        with self._lock:
            counts = dict(self.counts)
        prompt = counts["prompt_tokens"]
        tested = counts["draft_accepted"] + counts["draft_rejected"]
        superseded = counts["superseded"] + counts["cancelled"]
        return {
            **counts,
            "cache_served_fraction": (counts["reused_tokens"] / prompt) if prompt else None,
            # Per-token acceptance of draft tokens over every request so far (the engine's α).
            "draft_acceptance": (counts["draft_accepted"] / tested) if tested else None,
            "wasted_rounds_per_superseded": (counts["wasted_rounds"] / superseded) if superseded else 0.0,
            "rounds_after_cancel_per_superseded": (counts["rounds_after_cancel"] / superseded) if superseded else 0.0,
        }


def _last_draft(stats: dict[str, Any]) -> str | None:
    """What the request's rounds drafted with: the model draft, prompt lookup, both, or None (no drafting)."""
    parts = []
    if (stats.get("drafted", 0) or 0) > (stats.get("lookup_drafted", 0) or 0):
        parts.append(str(stats.get("draft") or DraftKind.EARLY_EXIT.value))
    if stats.get("lookup_drafted"):
        parts.append("prompt_lookup")
    if stats.get("history_rounds"):
        parts.append("output_history")
    return "+".join(parts) or None
