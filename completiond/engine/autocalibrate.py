"""Calibration as a sequence of short steps: `completiond calibrate` runs them back to back, the
daemon runs them in the background between requests.

Each candidate (exit layer E, draft length K, draft vocabulary, prompt lookup) is timed
`repeats` times, each time right after a plain run over the same prompts, so that a drift in
machine load moves both sides of each ratio alike. One such pair is one step: the steps are
where the daemon's engine thread may serve a request instead. A request that arrives during a
step cancels it (the engine stops at its next round); the interrupted pair is measured again
later, since a pair with a request in the middle would time the request too.

The winner is the fastest candidate; plain decoding wins when no candidate beats it by
MIN_GAIN (an ordinary model's early layers usually draft badly) or when one of its repeats
lost to plain decoding.
"""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Generator

from completiond.engine.calibration import Calibration, save_calibration
from completiond.engine.speculators import REGISTRY, DraftKind

log = logging.getLogger(__name__)

# A candidate must beat plain decoding by this factor to switch speculation on:
# below it, measurement noise could pick a setting that is slower in practice.
MIN_GAIN = 1.05


class Preempted(Exception):
    """A timed run was cancelled (a request arrived): its pair is measured again."""


def candidate_layers(num_layers: int, most: int = 8) -> list[int]:
    top = max(1, num_layers // 2)
    if top <= most:
        return list(range(1, top + 1))
    step = max(1, top // most)
    return sorted(set(range(1, top + 1, step)) | {top})


def frequent_ids(engine, texts: list[str]) -> list[int]:
    """Token ids by falling frequency in sample text (ids never seen are left out)."""
    counts: dict[int, int] = {}
    for text in texts:
        for t in engine.tokenizer(text).input_ids:
            counts[t] = counts.get(t, 0) + 1
    return sorted(counts, key=lambda t: (-counts[t], t))


Steps = Generator[str, None, "tuple[Calibration, list[dict]]"]


def calibration_steps(
    engine,
    prompts: list[list[int]],
    max_tokens: int,
    exit_layers: list[int],
    draft_ks: list[int],
    log: Callable[..., None] = print,
    ranked_ids: list[int] | None = None,
    repeats: int = 3,
    cancel: Callable[[], Any] | None = None,
) -> Steps:
    """Yields after each timed pair ("measured") and after each preempted one ("preempted"); returns
    (calibration, candidate rows). cancel() gives the token each run is handed (None: not cancellable)."""
    from completiond.engine.engine import SamplingParams

    def timed(params) -> tuple[float, int, int, int, float, float, int]:
        """Decode seconds (prefill left out: speculation does not change it), drafted, accepted, rejected,
        draft ms, verify ms and rounds over all prompts, cold cache."""
        total = drafted = accepted = rejected = rounds = 0
        draft_ms = verify_ms = 0.0
        token = cancel() if cancel is not None else None
        for ids in prompts:
            engine.cache.clear()
            # history=None: no candidate drafts from another's (or its own earlier) outputs of these prompts
            gen = engine.generate(ids, params, cancel=token, history=None)
            if gen.finish_reason == "cancelled":
                raise Preempted()
            s = gen.stats
            total += s.decode_ms / 1000
            drafted, accepted, rejected, rounds = (
                drafted + s.drafted,
                accepted + s.accepted,
                rejected + s.rejected,
                rounds + s.rounds,
            )
            draft_ms, verify_ms = draft_ms + s.draft_ms, verify_ms + s.verify_ms
        return total, drafted, accepted, rejected, draft_ms, verify_ms, rounds

    n_tokens = max_tokens * len(prompts)
    plain_params = SamplingParams(max_tokens=max_tokens, speculative=False, ignore_eos=True)
    plain_runs: list[float] = []

    def candidate(
        e: int, k: int, vocab: list[int], lookup: bool = False, draft: DraftKind = DraftKind.EARLY_EXIT
    ) -> Generator[str, None, dict]:
        params = SamplingParams(
            max_tokens=max_tokens,
            exit_layer=e,
            draft_k=k,
            adaptive_k=False,
            ignore_eos=True,
            prompt_lookup=lookup,
            draft=draft,
        )
        speedups: list[float] = []
        secs_runs: list[float] = []
        drafted = accepted = rejected = rounds = 0
        dms = vms = 0.0
        while len(speedups) < repeats:
            # Set on every pair: between steps the daemon serves requests with its own draft vocabulary.
            engine.set_draft_vocab(vocab)
            try:
                plain_s = timed(plain_params)[0]
                secs, drafted, accepted, rejected, dms, vms, rounds = timed(params)
            except Preempted:
                yield "preempted"
                continue
            plain_runs.append(plain_s)
            secs_runs.append(secs)
            speedups.append(plain_s / secs)
            yield "measured"
        row = {
            "draft": draft,
            "exit_layer": e,
            "draft_k": k,
            "draft_vocab": len(vocab),
            "prompt_lookup": lookup,
            **_figures(speedups, secs_runs, n_tokens, (drafted, accepted, rejected, rounds), dms, vms),
        }
        log(
            REGISTRY[draft].tag
            + f"E={e:2d} K={k}"
            + (f" draft vocab {len(vocab)}" if vocab else "")
            + (" + lookup" if lookup else "")
            + f": alpha {row['alpha']:.3f}, {row['tokens_per_s']:.1f} tok/s, speedup {row['speedup']:.2f} "
            f"({row['speedup_min']:.2f}-{row['speedup_max']:.2f})"
        )
        return row

    loaded_vocab = [] if engine.draft_ids is None else engine.draft_ids.tolist()
    engine.set_draft_vocab([])  # candidates are first compared with the full draft head
    try:
        timed(SamplingParams(max_tokens=8, speculative=False))  # warm-up
    except Preempted:
        yield "preempted"
    rows = yield from _model_draft_rows(engine, candidate, exit_layers, draft_ks)
    best = max(rows, key=lambda r: r["speedup"])
    # Then a draft head over only the most frequent ids, at the best E and K.
    vocab: list[int] = []
    for size in (engine.vocab_size // 8, engine.vocab_size // 4, engine.vocab_size // 2):
        if not ranked_ids or size < 256 or size > len(ranked_ids):
            continue
        if best["draft"] is DraftKind.DRAFT_MODEL:
            break  # the draft vocabulary is the early-exit head's: a draft model has its own
        rows.append((yield from candidate(best["exit_layer"], best["draft_k"], ranked_ids[:size], draft=best["draft"])))
        if rows[-1]["speedup"] > best["speedup"]:
            best, vocab = rows[-1], ranked_ids[:size]
    # Then prompt lookup in front of the best model draft, and prompt lookup alone (a plain step where it
    # finds nothing: with a lean plain step, a model draft's cost may outweigh what it adds).
    rows.append((yield from candidate(best["exit_layer"], best["draft_k"], vocab, lookup=True, draft=best["draft"])))
    lookup = rows[-1]["speedup"] > best["speedup"]
    if lookup:
        best = rows[-1]
    alone_rows = []
    for k in draft_ks:  # alone, K is lookup's own
        alone_rows.append((yield from candidate(best["exit_layer"], k, [], lookup=True, draft=DraftKind.NONE)))
    rows += alone_rows
    best_alone = max(alone_rows, key=lambda r: r["speedup"])
    alone = best_alone["speedup"] > best["speedup"]
    if alone:
        best, vocab = best_alone, []
    engine.set_draft_vocab(loaded_vocab)
    plain_tokens_per_s = n_tokens / statistics.median(plain_runs)
    return _record(best, vocab, lookup, alone, plain_tokens_per_s, repeats), rows


def _model_draft_rows(
    engine, candidate: Callable[..., Generator[str, None, dict]], exit_layers: list[int], draft_ks: list[int]
) -> Generator[str, None, list[dict]]:
    """The sweep's first phase: early exit at each E and K, then the other model drafts the engine has."""
    rows = []
    for e in exit_layers:
        for k in draft_ks:
            rows.append((yield from candidate(e, k, [])))
    # The other model drafts, where the engine has them: the exit adapter (at its own exit layer) and a
    # separate draft model, over the same K.
    if REGISTRY[DraftKind.ADAPTER].available(engine):
        for k in draft_ks:
            rows.append((yield from candidate(engine.exit_adapter.exit_layer, k, [], draft=DraftKind.ADAPTER)))
    if REGISTRY[DraftKind.DRAFT_MODEL].available(engine):
        for k in draft_ks:
            rows.append((yield from candidate(exit_layers[0], k, [], draft=DraftKind.DRAFT_MODEL)))
    if REGISTRY[DraftKind.MEDUSA].available(engine):
        # one tree (its depth is the number of heads); greedy requests only, which is what is timed here
        rows.append((yield from candidate(exit_layers[0], engine.medusa.num_heads, [], draft=DraftKind.MEDUSA)))
    return rows


def _figures(
    speedups: list[float],
    secs_runs: list[float],
    n_tokens: int,
    counts: tuple[int, int, int, int],
    draft_ms: float,
    verify_ms: float,
) -> dict[str, float]:
    """A candidate's figures from its timed repeats; counts: (drafted, accepted, rejected, rounds) of its last."""
    drafted, accepted, rejected, rounds = counts
    speedup = statistics.median(speedups)
    return {
        "alpha": accepted / max(1, accepted + rejected),  # per-token acceptance, as in Stats.alpha
        "speedup": speedup,
        "speedup_min": min(speedups),
        "speedup_max": max(speedups),
        "spread": (max(speedups) - min(speedups)) / speedup,
        "tokens_per_s": n_tokens / statistics.median(secs_runs),
        # one draft step relative to one verify pass: what choose_k weighs K against
        "draft_cost": (draft_ms / max(drafted, 1)) / (verify_ms / max(rounds, 1)),
    }


def _record(
    best: dict, vocab: list[int], lookup: bool, alone: bool, plain_tokens_per_s: float, repeats: int
) -> Calibration:
    """The calibration the sweep's best candidate makes (lookup: in front of the best model draft; alone:
    prompt lookup without a model draft won)."""
    measured = {
        "alpha": best["alpha"],
        "speedup": best["speedup"],
        "speedup_min": best["speedup_min"],
        "speedup_max": best["speedup_max"],
        "spread": best["spread"],
        "draft_cost": best["draft_cost"],
        "plain_tokens_per_s": plain_tokens_per_s,
        "repeats": repeats,
        "date": time.strftime("%Y-%m-%d"),
    }
    # On only where the gain clears the noise: the median beats the margin and even the worst
    # repeat was faster than plain decoding.
    on = best["speedup"] >= MIN_GAIN and best["speedup_min"] > 1.0
    # Lookup alone is a record without a model draft (speculative off) that keeps prompt lookup on; a
    # record that is off keeps lookup off too, as it was measured.
    return Calibration(
        speculative=on and not alone,
        exit_layer=best["exit_layer"],
        draft_k=best["draft_k"],
        source="calibrate",
        measured=measured,
        draft_vocab=list(vocab),
        prompt_lookup=on and (lookup or alone),
        draft=DraftKind.EARLY_EXIT if alone else best["draft"],
    )


def run_to_end(steps: Steps) -> tuple[Calibration, list[dict]]:
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


# --- in the daemon ----------------------------------------------------------------------------

# Small enough to finish within minutes on a CPU for a 1B model between keystrokes; `completiond
# calibrate` measures more (more prompts, repeats and candidates) when a user wants the full answer.
BACKGROUND_PROMPTS = 2
BACKGROUND_TOKENS = 32
BACKGROUND_REPEATS = 2
BACKGROUND_LAYERS = 4
BACKGROUND_KS = (2, 4)
BACKGROUND_BUDGET_S = 600.0  # engine time spent measuring, preempted pairs included
BACKGROUND_MIN_PARAMS = 100_000_000  # below this (test models, the bundled one) drafting gains little to measure


def sample_prompts(engine, count: int, chars: int = 1500) -> list[list[int]]:
    """The text before a line a third into each held-out stdlib file (as `completiond bench` takes them)."""
    from completiond.models.corpus import heldout_files

    out = []
    for f in heldout_files():
        try:
            lines = f.path.read_text(encoding="utf-8").splitlines(keepends=True)
        except (OSError, UnicodeDecodeError):
            continue
        if len(lines) >= 60:
            out.append(engine.tokenizer("".join(lines[: len(lines) // 3])[-chars:]).input_ids)
        if len(out) == count:
            break
    return out


class BackgroundCalibration:
    """Calibration of the loaded engine in steps, for the daemon's engine thread to run when idle.

    `step(token)` runs one timed pair (a request cancels it through `token`) and returns whether
    there is more to do. The engine is handed back as it was after every step: its own draft
    vocabulary, and its prefix KV cache untouched (the timed runs use a cache of their own, so
    the user's cached prompts survive). At the end the record is stored like `completiond
    calibrate`'s and the engine switches to it. It gives up, storing nothing, after `budget_s`
    seconds of engine time, or when `cancel()` is called.
    """

    def __init__(
        self,
        engine,
        budget_s: float = BACKGROUND_BUDGET_S,
        prompts: list[list[int]] | None = None,
        max_tokens: int = BACKGROUND_TOKENS,
        repeats: int = BACKGROUND_REPEATS,
        on_done: Callable[[str], None] | None = None,
    ):
        self.engine = engine
        self.budget_s = budget_s
        self.spent_s = 0.0
        self.state = "pending"  # pending | running | done | gave up | cancelled | failed
        self.result: Calibration | None = None
        self.preempted = 0
        self._on_done = on_done
        self._token: Any = None
        self._prompts = prompts
        self._max_tokens = max_tokens
        self._repeats = repeats
        self._steps: Steps | None = None
        self.message = ""  # how it ended, set before the state says it has

    def cancel(self) -> None:
        """From any thread: no further step runs, and the running one stops at its next round."""
        if self.state in ("pending", "running"):
            self.state = "cancelled"
            token = self._token
            if token is not None:
                token.cancel()

    def _start(self) -> Steps:
        engine = self.engine
        prompts = self._prompts if self._prompts is not None else sample_prompts(engine, BACKGROUND_PROMPTS)
        if not prompts:
            raise ValueError("no held-out sample files to calibrate on")
        longest = max(len(p) for p in prompts) + self._max_tokens + 16
        if longest > engine.max_context:
            prompts = [p[-(engine.max_context - self._max_tokens - 16) :] for p in prompts]
        layers = candidate_layers(engine.num_layers, BACKGROUND_LAYERS)
        ranked = frequent_ids(engine, [engine.tokenizer.decode(p) for p in prompts])
        return calibration_steps(
            engine,
            prompts,
            self._max_tokens,
            layers,
            list(BACKGROUND_KS),
            log=lambda *a: log.debug(*a),
            ranked_ids=ranked,
            repeats=self._repeats,
            cancel=lambda: self._token,
        )

    def step(self, token: Any) -> bool:
        """One timed pair on the engine thread; False when finished (done, gave up, cancelled or failed)."""
        if self.state not in ("pending", "running"):
            return False
        from completiond.engine.kvcache import PrefixCache

        engine = self.engine
        self._token = token
        user_cache = engine.cache
        user_vocab = [] if engine.draft_ids is None else engine.draft_ids.tolist()
        # A small cache of its own: the runs clear theirs before each prompt.
        engine.cache = PrefixCache(64 << 20, on_evict=getattr(engine, "_on_evict", None))
        t0 = time.perf_counter()
        try:
            if self._steps is None:
                self._steps = self._start()
                self.state = "running"
            what = next(self._steps)
            self.preempted += what == "preempted"
        except StopIteration as done:
            self.result, _rows = done.value
            self._finish("done")
        except Exception as exc:  # noqa: BLE001  (a failed measurement must never take completions down)
            log.warning("background calibration failed: %s: %s", type(exc).__name__, exc)
            self._finish("failed", f"{type(exc).__name__}: {exc}")
        finally:
            engine.cache.clear()
            engine.cache = user_cache
            if self.state != "done":
                engine.set_draft_vocab(user_vocab)
            self.spent_s += time.perf_counter() - t0
        if self.state == "running" and self.spent_s > self.budget_s:
            self._finish("gave up")
        return self.state == "running"

    def _finish(self, state: str, reason: str = "") -> None:
        # The state changes last: a reader that sees it ended also sees its message (the status thread
        # reads both without a lock).
        engine = self.engine
        if state == "done" and self.result is not None:
            try:
                where: Path | str = save_calibration(engine.model_id, self.result)
            except OSError as exc:
                where = f"not stored ({exc})"
            engine.calibration = self.result
            engine.set_draft_vocab(self.result.draft_vocab)
            c = self.result
            message = (
                f"calibrated {engine.name} in the background: "
                + (
                    f"speculation on (E={c.exit_layer}, K={c.draft_k}"
                    f"{', prompt lookup' if c.prompt_lookup else ''}), {c.measured['speedup']:.2f}x plain decoding"
                    if c.speculative
                    else f"prompt lookup alone (no model draft), {c.measured['speedup']:.2f}x plain decoding"
                    if c.prompt_lookup
                    else f"no speculation (best candidate {c.measured['speedup']:.2f}x)"
                )
                + f"; saved to {where}"
            )
        elif state == "gave up":
            self._steps = None
            message = (
                f"background calibration of {engine.name} stopped after {self.spent_s:.0f} s of engine time; "
                "run `completiond calibrate` for a full measurement"
            )
        else:
            self._steps = None
            message = f"background calibration of {engine.name} {state}" + (f": {reason}" if reason else "")
        log.info("%s", message)
        self.message = message
        if self._on_done is not None:
            self._on_done(message)
        self.state = state
