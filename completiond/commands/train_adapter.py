"""`completiond train-adapter`: train the exit adapter of a model (the Kangaroo-style draft).

The model is loaded as the engine loads it and stays frozen; one decoder layer, started as a
copy of layer E, learns to turn layer E's states into the final layer's distribution
(models/exit_adapter.py). Training text: code files tokenised with the model's own tokenizer
(default: the training split of the Python standard library, which the bundled model trained
on; --files for other code). Greedy agreement with the final layer and KL are measured on held-out
files (default: the stdlib's held-out split) before and after, beside the plain exits at E and E+1.

The adapter goes into the model's directory when that is a local directory we may write
(`exit_adapter.safetensors`), else into ~/.cache/completiond/adapters/<model identity>.safetensors.
It is keyed to the model's identity: a retrained model never uses a stale adapter. Engine.load
picks it up; `completiond calibrate` decides whether drafting through it pays on this machine.

Runs minutes on a CPU for the bundled model; pass --device cuda for a real model on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model directory or hub id (default: the bundled model)")
    p.add_argument(
        "--exit-layer", type=int, default=0, help="E, the layers under the adapter (default: a fifth of the depth)"
    )
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--minutes", type=float, default=0.0, help="stop training after this long (0: no limit)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--train-tokens", type=int, default=3_000_000, help="most tokens of training text to read")
    p.add_argument(
        "--files", nargs="*", default=None, help="training code files or directories (default: stdlib training split)"
    )
    p.add_argument(
        "--heldout", nargs="*", default=None, help="held-out files or directories (default: stdlib held-out split)"
    )
    p.add_argument("--heldout-batches", type=int, default=6)
    p.add_argument("--out", type=Path, default=None, help="where to write the adapter (default: see above)")
    p.add_argument(
        "--init",
        type=Path,
        default=None,
        help="continue from this adapter file (same model and exit layer) instead of a copy of layer E",
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def _expand(paths: list[str]) -> list[Path]:
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out.extend(sorted(q for q in p.rglob("*") if q.is_file() and not any(s.startswith(".") for s in q.parts)))
        elif p.is_file():
            out.append(p)
        else:
            raise FileNotFoundError(f"no such file or directory: {p}")
    return out


def _texts(paths: list[Path], rng: random.Random):
    paths = list(paths)
    rng.shuffle(paths)
    for path in paths:
        try:
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # binary or unreadable: not training text
        if text.strip():
            yield text


def default_out(model_dir: Path | None, file_name: str, user_path: Path) -> Path:
    """Beside the model when its directory is ours to write, else the user's cache (a hub model)."""
    if model_dir is None:  # an engine not loaded from a directory
        return user_path
    in_hub_cache = any(part.startswith("models--") for part in model_dir.resolve().parts)
    if not in_hub_cache and os.access(model_dir, os.W_OK):
        return model_dir / file_name
    return user_path


class DataError(Exception):
    """Training text that cannot be had (a missing path, too little text): exit status 2."""


def training_batches(engine, args, rng: random.Random) -> tuple:
    """(endless training batches, held-out batches) of [batch, seq_len] ids on the engine's device, from
    --files / --heldout (default: the stdlib's training and held-out splits), tokenised by the model."""
    from completiond.models import corpus
    from completiond.models.exit_adapter import token_windows

    try:
        train_paths = _expand(args.files) if args.files else [f.path for f in corpus.training_files()]
        held_paths = _expand(args.heldout) if args.heldout else [f.path for f in corpus.heldout_files()]
    except FileNotFoundError as exc:
        raise DataError(str(exc)) from None
    tok, device = engine.tokenizer, engine.device

    def streams(paths, r):
        for text in _texts(paths, r):
            yield tok(text).input_ids + ([tok.eos_token_id] if tok.eos_token_id is not None else [])

    try:
        train = (
            b.to(device)
            for b in token_windows(streams(train_paths, rng), args.seq_len, args.batch_size, rng, args.train_tokens)
        )
        held_rng = random.Random(1234)  # the same held-out windows before and after, and across runs
        held_iter = token_windows(
            streams(held_paths, held_rng),
            args.seq_len,
            args.batch_size,
            held_rng,
            args.heldout_batches * args.batch_size * args.seq_len * 4,
        )
        held = [next(held_iter).to(device) for _ in range(args.heldout_batches)]
    except ValueError as exc:
        raise DataError(str(exc)) from None
    return train, held


def run(args: argparse.Namespace) -> int:
    import torch

    from completiond.engine.engine import Engine, EngineError
    from completiond.engine.exit_adapter import user_adapter_path
    from completiond.models import exit_adapter as ea

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    try:
        # training runs transformers' forward pass (engine/checkpoint.py's modules have none)
        engine = Engine.load(args.model, device=args.device, dtype=args.dtype, reader="transformers")
    except EngineError as exc:
        print(f"completiond train-adapter: {exc}", file=sys.stderr)
        return 1
    L = engine.num_layers
    E = args.exit_layer or max(1, L // 5)
    if not 1 <= E < L - 1:
        print(
            f"completiond train-adapter: --exit-layer must be in 1..{L - 2} for this {L}-layer model "
            "(an adapter at the last layer would cost as much as the model)",
            file=sys.stderr,
        )
        return 2
    log = (lambda m: print(m, file=sys.stderr)) if args.json else print
    device = engine.device
    try:
        train, held = training_batches(engine, args, rng)
    except DataError as exc:
        print(f"completiond train-adapter: {exc}", file=sys.stderr)
        return 2

    model = engine.model
    log(
        f"training the exit adapter of {engine.name} at E={E} of {L} layers on {device} "
        f"({args.steps} steps x {args.batch_size}x{args.seq_len} tokens)"
    )
    previous = {}
    if args.init is not None:
        try:
            record = ea.read_adapter(args.init, engine.model_id, model.config)
        except ea.AdapterFileError as exc:
            print(f"completiond train-adapter: --init: {exc}", file=sys.stderr)
            return 2
        if record.exit_layer != E:
            print(
                f"completiond train-adapter: --init {args.init} is an adapter at layer {record.exit_layer}, not {E}",
                file=sys.stderr,
            )
            return 2
        start = ea.build_layer(model, record)
        previous = record.training
    else:
        start = ea.copy.deepcopy(model.model.layers[E]).eval()
    before = ea.measure(model, start, E, held)
    log(
        f"before: agreement adapter {before['agreement']['adapter']:.3f} (exit {E}: {before['agreement']['exit']:.3f}, "
        f"exit {E + 1}: {before['agreement']['exit_next']:.3f}), KL {before['kl']['adapter']:.3f}"
    )
    autocast = device != "cpu" and engine.dtype != torch.float32
    with torch.autocast(device_type=str(device).split(":")[0], dtype=engine.dtype, enabled=autocast):
        layer, summary = ea.train_adapter(
            model,
            E,
            train,
            args.steps,
            lr=args.lr,
            minutes=args.minutes,
            log=log,
            init=start if args.init is not None else None,
        )
    layer = layer.to(engine.dtype)
    after = ea.measure(model, layer, E, held)
    log(f"after:  agreement adapter {after['agreement']['adapter']:.3f}, KL {after['kl']['adapter']:.3f}")
    summary.update(
        exit_layer=E,
        before=before,
        after=after,
        heldout_windows=len(held) * args.batch_size,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
    )
    if previous:
        # a continued adapter: the totals cover every run, `runs` keeps each one's own figures
        runs = previous.get("runs") or [{k: previous.get(k) for k in ("steps", "tokens", "minutes", "final_kl", "lr")}]
        runs.append({k: summary[k] for k in ("steps", "tokens", "minutes", "final_kl", "lr")})
        summary.update(
            runs=runs,
            steps=sum(r["steps"] or 0 for r in runs),
            tokens=sum(r["tokens"] or 0 for r in runs),
            minutes=round(sum(r["minutes"] or 0 for r in runs), 2),
            before=previous.get("before", before),
        )
    out = args.out or default_out(engine.model_dir, ea.ADAPTER_FILE, user_adapter_path(engine.model_id))
    path = ea.save_adapter(out, layer, E, engine.model_id, model.config, summary)
    summary["path"] = str(path)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        log(f"wrote {path}; `completiond calibrate` decides whether drafting through it pays here")
    return 0
