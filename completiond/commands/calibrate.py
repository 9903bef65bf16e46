"""`completiond calibrate`: measure acceptance and real speed per exit layer E and draft length K.

Each candidate runs the same held-out prompts with greedy decoding; the winner
is the fastest, and plain decoding wins when no candidate beats it by a
margin (an ordinary model's early layers usually draft badly). The result is
stored per model in the user's cache directory, never in the model.
"""

from __future__ import annotations

import argparse
import json
import sys
import statistics
import time
from pathlib import Path

from completiond.engine.calibration import Calibration

# A candidate must beat plain decoding by this factor to switch speculation on:
# below it, measurement noise could pick a setting that is slower in practice.
MIN_GAIN = 1.05


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model directory or hub id (default: the bundled model)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--exit-layers", type=int, nargs="*", default=None, help="candidates (default: a spread over the first half)")
    p.add_argument("--draft-ks", type=int, nargs="*", default=[2, 3, 4, 6, 8])
    p.add_argument("--files", nargs="*", default=None, help="sample code files (default: held-out stdlib files)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per candidate, each beside a plain run")
    p.add_argument("--dry-run", action="store_true", help="measure and print, store nothing")
    p.add_argument("--json", action="store_true")


def candidate_layers(num_layers: int) -> list[int]:
    top = max(1, num_layers // 2)
    if top <= 8:
        return list(range(1, top + 1))
    step = max(1, top // 8)
    return sorted(set(range(1, top + 1, step)) | {top})


def frequent_ids(engine, texts: list[str]) -> list[int]:
    """Token ids by falling frequency in sample text (ids never seen are left out)."""
    counts: dict[int, int] = {}
    for text in texts:
        for t in engine.tokenizer(text).input_ids:
            counts[t] = counts.get(t, 0) + 1
    return sorted(counts, key=lambda t: (-counts[t], t))


def calibrate(engine, prompts: list[list[int]], max_tokens: int, exit_layers: list[int], draft_ks: list[int],
              log=print, ranked_ids: list[int] | None = None, repeats: int = 3) -> tuple["Calibration", list[dict]]:
    from completiond.engine.engine import SamplingParams

    def timed(params) -> tuple[float, int, int, int, float, float, int]:
        """Decode seconds (prefill left out: speculation does not change it), drafted, accepted, rejected,
        draft ms, verify ms and rounds over all prompts, cold cache."""
        total = drafted = accepted = rejected = rounds = 0
        draft_ms = verify_ms = 0.0
        for ids in prompts:
            engine.cache.clear()
            s = engine.generate(ids, params).stats
            total += s.decode_ms / 1000
            drafted, accepted, rejected, rounds = drafted + s.drafted, accepted + s.accepted, rejected + s.rejected, rounds + s.rounds
            draft_ms, verify_ms = draft_ms + s.draft_ms, verify_ms + s.verify_ms
        return total, drafted, accepted, rejected, draft_ms, verify_ms, rounds

    n_tokens = max_tokens * len(prompts)

    plain_params = SamplingParams(max_tokens=max_tokens, speculative=False, ignore_eos=True)
    plain_runs: list[float] = []

    def candidate(e: int, k: int, draft_vocab: int = 0, lookup: bool = False) -> dict:
        """Timed `repeats` times, each right after a plain run: a speedup per repeat, so that a
        drift in machine load moves both sides of each ratio alike."""
        params = SamplingParams(max_tokens=max_tokens, exit_layer=e, draft_k=k, adaptive_k=False, ignore_eos=True,
                                prompt_lookup=lookup)
        speedups, secs_runs = [], []
        for _ in range(repeats):
            plain_s = timed(plain_params)[0]
            secs, drafted, accepted, rejected, dms, vms, rounds = timed(params)
            plain_runs.append(plain_s)
            secs_runs.append(secs)
            speedups.append(plain_s / secs)
        speedup = statistics.median(speedups)
        row = {"exit_layer": e, "draft_k": k, "draft_vocab": draft_vocab, "prompt_lookup": lookup,
               # per-token acceptance, as in Stats.alpha
               "alpha": accepted / max(1, accepted + rejected),
               "speedup": speedup, "speedup_min": min(speedups), "speedup_max": max(speedups),
               "spread": (max(speedups) - min(speedups)) / speedup,
               "tokens_per_s": n_tokens / statistics.median(secs_runs),
               # one draft step relative to one verify pass: what choose_k weighs K against
               "draft_cost": (dms / max(drafted, 1)) / (vms / max(rounds, 1))}
        log(f"E={e:2d} K={k}" + (f" draft vocab {draft_vocab}" if draft_vocab else "") + (" + lookup" if lookup else "")
            + f": alpha {row['alpha']:.3f}, {row['tokens_per_s']:.1f} tok/s, speedup {speedup:.2f} "
              f"({row['speedup_min']:.2f}-{row['speedup_max']:.2f})")
        return row

    loaded_vocab = [] if engine.draft_ids is None else engine.draft_ids.tolist()
    engine.set_draft_vocab([])  # candidates are first compared with the full draft head
    timed(SamplingParams(max_tokens=8, speculative=False))  # warm-up
    rows = [candidate(e, k) for e in exit_layers for k in draft_ks]
    best = max(rows, key=lambda r: r["speedup"])
    # Then a draft head over only the most frequent ids, at the best E and K.
    vocab = []
    for size in (engine.vocab_size // 8, engine.vocab_size // 4, engine.vocab_size // 2):
        if not ranked_ids or size < 256 or size > len(ranked_ids):
            continue
        engine.set_draft_vocab(ranked_ids[:size])
        rows.append(candidate(best["exit_layer"], best["draft_k"], size))
        if rows[-1]["speedup"] > best["speedup"]:
            best, vocab = rows[-1], ranked_ids[:size]
    # Then prompt lookup in front of the best early-exit draft.
    engine.set_draft_vocab(vocab)
    rows.append(candidate(best["exit_layer"], best["draft_k"], len(vocab), lookup=True))
    lookup = rows[-1]["speedup"] > best["speedup"]
    if lookup:
        best = rows[-1]
    engine.set_draft_vocab(loaded_vocab)
    plain_s = statistics.median(plain_runs)
    measured = {"alpha": best["alpha"], "speedup": best["speedup"], "speedup_min": best["speedup_min"],
                "speedup_max": best["speedup_max"], "spread": best["spread"], "draft_cost": best["draft_cost"],
                "plain_tokens_per_s": n_tokens / plain_s, "repeats": repeats, "date": time.strftime("%Y-%m-%d")}
    # On only where the gain clears the noise: the median beats the margin and even the worst
    # repeat was faster than plain decoding.
    on = best["speedup"] >= MIN_GAIN and best["speedup_min"] > 1.0
    cal = Calibration(speculative=on, exit_layer=best["exit_layer"], draft_k=best["draft_k"],
                      source="calibrate", measured=measured, draft_vocab=list(vocab), prompt_lookup=lookup)
    return cal, rows


def run(args: argparse.Namespace) -> int:
    from completiond.commands.bench import prompt_texts
    from completiond.engine.calibration import save_calibration
    from completiond.engine.engine import Engine, EngineError

    log = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    try:
        engine = Engine.load(args.model, device=args.device, dtype=args.dtype)
    except EngineError as exc:
        print(f"completiond calibrate: {exc}", file=sys.stderr)
        return 1
    files = [Path(f) for f in args.files] if args.files else None
    prompts = [engine.tokenizer(t).input_ids for t in prompt_texts(files, args.prompts)]
    layers = args.exit_layers or candidate_layers(engine.num_layers)
    bad = [e for e in layers if not 1 <= e < engine.num_layers]
    if bad:
        print(f"completiond calibrate: exit layers must be in 1..{engine.num_layers - 1}, got {bad}", file=sys.stderr)
        return 2
    if files is None:
        # token frequencies from training files: the held-out ones stay unseen
        from completiond.models.corpus import training_files

        freq_texts = [f.read_text() for f in training_files()[:: max(1, len(training_files()) // 200)]]
    else:
        freq_texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    cal, rows = calibrate(engine, prompts, args.max_tokens, layers, args.draft_ks, log, frequent_ids(engine, freq_texts),
                          repeats=max(1, args.repeats))
    where = None if args.dry_run else save_calibration(engine.model_id, cal)
    verdict = (f"speculation on: E={cal.exit_layer}, K={cal.draft_k}, speedup {cal.measured['speedup']:.2f}"
               if cal.speculative else f"no speculation: best candidate only {cal.measured['speedup']:.2f}x")
    if args.json:
        print(json.dumps({"speculative": cal.speculative, "exit_layer": cal.exit_layer, "draft_k": cal.draft_k,
                          "draft_vocab": len(cal.draft_vocab), "prompt_lookup": cal.prompt_lookup, "measured": cal.measured, "candidates": rows, "saved_to": str(where) if where else None}, indent=2))
    else:
        log(verdict + (f"; saved to {where}" if where else " (dry run)"))
    return 0
