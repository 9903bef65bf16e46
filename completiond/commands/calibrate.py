"""`completiond calibrate`: measure acceptance and real speed per exit layer E and draft length K.

Each candidate runs the same held-out prompts with greedy decoding; the winner
is the fastest, and plain decoding wins when no candidate beats it by a
margin (an ordinary model's early layers usually draft badly). The result is
stored per model in the user's cache directory, never in the model. The
measurement itself lives in engine/autocalibrate.py, which the daemon also runs
in the background for a model loaded without a calibration.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from completiond.config import SETTINGS_BY_KEY
from completiond.engine.draft_kind import DraftKind
from completiond.engine.calibration import Calibration

from completiond.engine.autocalibrate import MIN_GAIN, calibration_steps, candidate_layers, frequent_ids, run_to_end

WEIGHTS = SETTINGS_BY_KEY["weights"].enum  # the formats Engine.load(weights=...) accepts

__all__ = ["MIN_GAIN", "calibrate", "candidate_layers", "frequent_ids"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model directory or hub id (default: the bundled model)")
    p.add_argument("--draft-model", default=None, help="a separate draft model to measure too (completiond.draftModel)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument(
        "--weights",
        choices=WEIGHTS,
        default="auto",
        help="weight format of the native CPU step (the weights setting): auto, bf16 or int8",
    )
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--exit-layers", type=int, nargs="*", default=None, help="candidates (default: a spread over the first half)"
    )
    p.add_argument("--draft-ks", type=int, nargs="*", default=[2, 3, 4, 6, 8])
    p.add_argument("--files", nargs="*", default=None, help="sample code files (default: held-out stdlib files)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per candidate, each beside a plain run")
    p.add_argument("--dry-run", action="store_true", help="measure and print, store nothing")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="PNG of speedup and acceptance per draft and K (default: beside the stored record)",
    )


def calibrate(
    engine,
    prompts: list[list[int]],
    max_tokens: int,
    exit_layers: list[int],
    draft_ks: list[int],
    log=print,
    ranked_ids: list[int] | None = None,
    repeats: int = 3,
) -> tuple["Calibration", list[dict]]:
    """Every candidate measured back to back (the daemon runs the same steps between requests)."""
    return run_to_end(calibration_steps(engine, prompts, max_tokens, exit_layers, draft_ks, log, ranked_ids, repeats))


METHODS = {
    DraftKind.EARLY_EXIT: "early exit",
    DraftKind.ADAPTER: "exit adapter",
    DraftKind.DRAFT_MODEL: "draft model",
    DraftKind.MEDUSA: "Medusa tree",
    DraftKind.NONE: "plain step",
}


def method_name(row: dict) -> str:
    if row.get("draft") == DraftKind.NONE:
        return "lookup alone" if row.get("prompt_lookup") else "plain"
    name = METHODS.get(row.get("draft", DraftKind.EARLY_EXIT), row.get("draft", "?"))
    return ("lookup + " if row.get("prompt_lookup") else "") + name


def table(rows: list[dict]) -> str:
    """The candidates as a text table, fastest first."""
    head = f"{'draft':<26} {'E':>3} {'K':>3} {'vocab':>6} {'alpha':>6} {'tok/s':>7} {'speedup':>8} {'min-max':>11}"
    lines = [head, "-" * len(head)]
    for r in sorted(rows, key=lambda r: -r["speedup"]):
        lines.append(
            f"{method_name(r):<26} {r['exit_layer']:>3} {r['draft_k']:>3} {r['draft_vocab'] or 'all':>6} "
            f"{r['alpha']:>6.3f} {r['tokens_per_s']:>7.1f} {r['speedup']:>7.2f}x "
            f"{r['speedup_min']:>5.2f}-{r['speedup_max']:<5.2f}"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> Path:
    """Speedup and acceptance against K, one line per draft (method and exit layer)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[dict]] = {}
    for r in rows:
        label = method_name(r) + (
            f" E={r['exit_layer']}" if r.get("draft") in (DraftKind.EARLY_EXIT, DraftKind.ADAPTER) else ""
        )
        label += f", vocab {r['draft_vocab']}" if r.get("draft_vocab") else ""
        series.setdefault(label, []).append(r)
    fig, (ax_s, ax_a) = plt.subplots(1, 2, figsize=(12, 4.5))
    colours = plt.get_cmap("tab20").colors  # type: ignore[attr-defined]  # a ListedColormap; more distinct colours than the default cycle's ten
    markers = "os^Dv<>Ph*X"
    for n, (label, rs) in enumerate(sorted(series.items())):
        rs = sorted(rs, key=lambda r: r["draft_k"])
        ks = [r["draft_k"] for r in rs]
        style = dict(
            marker=markers[n % len(markers)], color=colours[(2 * n) % 20 if n < 10 else (2 * n + 1) % 20], label=label
        )
        ax_s.errorbar(
            ks,
            [r["speedup"] for r in rs],
            capsize=3,
            **style,
            yerr=[[r["speedup"] - r["speedup_min"] for r in rs], [r["speedup_max"] - r["speedup"] for r in rs]],
        )
        ax_a.plot(ks, [r["alpha"] for r in rs], **style)
    ax_s.axhline(1.0, color="grey", lw=1, ls="--")
    ax_s.axhline(MIN_GAIN, color="grey", lw=1, ls=":")
    ax_s.set(
        xlabel="K (most draft tokens per round)", ylabel="speedup over plain decoding (median, min-max)", title="speed"
    )
    ax_a.set(
        xlabel="K (most draft tokens per round)", ylabel="alpha (per-token acceptance)", ylim=(0, 1), title="acceptance"
    )
    ax_a.legend(fontsize=7, loc="lower left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run(args: argparse.Namespace) -> int:
    from completiond.commands.bench import prompt_texts
    from completiond.engine.calibration import save_calibration
    from completiond.engine.engine import Engine, EngineError

    log = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    try:
        engine = Engine.load(
            args.model, device=args.device, dtype=args.dtype, draft_model=args.draft_model, weights=args.weights
        )
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
    cal, rows = calibrate(
        engine,
        prompts,
        args.max_tokens,
        layers,
        args.draft_ks,
        log,
        frequent_ids(engine, freq_texts),
        repeats=max(1, args.repeats),
    )
    where = None if args.dry_run else save_calibration(engine.model_id, cal)
    if cal.speculative:
        verdict = (
            f"speculation on: {METHODS[cal.draft]}{' after prompt lookup' if cal.prompt_lookup else ''}, "
            f"E={cal.exit_layer}, K={cal.draft_k}, speedup {cal.measured['speedup']:.2f}"
        )
    elif cal.prompt_lookup:
        verdict = f"prompt lookup alone (no model draft), speedup {cal.measured['speedup']:.2f}"
    else:
        verdict = f"no speculation: best candidate only {cal.measured['speedup']:.2f}x"
    if args.json:
        print(
            json.dumps(
                {
                    "speculative": cal.speculative,
                    "draft": cal.draft,
                    "exit_layer": cal.exit_layer,
                    "draft_k": cal.draft_k,
                    "draft_vocab": len(cal.draft_vocab),
                    "prompt_lookup": cal.prompt_lookup,
                    "measured": cal.measured,
                    "candidates": rows,
                    "saved_to": str(where) if where else None,
                },
                indent=2,
            )
        )
    else:
        log(table(rows))
        log(verdict + (f"; saved to {where}" if where else " (dry run)"))
    from completiond.engine.calibration import record_path

    png = args.plot or (None if args.dry_run else record_path(engine.model_id).with_suffix(".png"))
    if png is not None:
        try:
            log(f"plot: {plot(rows, png, f'{engine.name} on {engine.device}: completiond calibrate')}")
        except ImportError:
            log("no plot: matplotlib is not installed (pip install matplotlib)")
    return 0
