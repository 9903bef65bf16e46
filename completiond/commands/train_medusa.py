"""`completiond train-medusa`: train Medusa heads for a model (tree drafts for greedy decoding).

The model is loaded as the engine loads it and stays frozen; N residual heads on its final
hidden state learn the model's own distributions 2..N+1 tokens ahead (models/medusa.py). Text,
held-out figures and where the file goes work as in `completiond train-adapter`
(`medusa_heads.safetensors` in the model's directory, or ~/.cache/completiond/medusa/<identity>),
keyed to the model's identity. Engine.load picks the heads up; `completiond calibrate` decides
whether the tree pays on this machine.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from completiond.commands.train_adapter import DataError, default_out, training_batches


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model directory or hub id (default: the bundled model)")
    p.add_argument("--heads", type=int, default=4, help="number of heads (depths 2..heads+1 ahead)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--minutes", type=float, default=0.0, help="stop training after this long (0: no limit)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--train-tokens", type=int, default=3_000_000)
    p.add_argument(
        "--files", nargs="*", default=None, help="training code files or directories (default: stdlib training split)"
    )
    p.add_argument(
        "--heldout", nargs="*", default=None, help="held-out files or directories (default: stdlib held-out split)"
    )
    p.add_argument("--heldout-batches", type=int, default=6)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    import torch

    from completiond.engine.engine import Engine, EngineError
    from completiond.engine.medusa import user_medusa_path
    from completiond.models import medusa as md

    if args.threads:
        torch.set_num_threads(args.threads)
    if not 1 <= args.heads <= 8:
        print("completiond train-medusa: --heads must be in 1..8", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    try:
        # training runs transformers' forward pass (engine/checkpoint.py's modules have none)
        engine = Engine.load(args.model, device=args.device, dtype=args.dtype, reader="transformers")
    except EngineError as exc:
        print(f"completiond train-medusa: {exc}", file=sys.stderr)
        return 1
    log = (lambda m: print(m, file=sys.stderr)) if args.json else print
    device = engine.device
    try:
        train, held = training_batches(engine, args, rng)
    except DataError as exc:
        print(f"completiond train-medusa: {exc}", file=sys.stderr)
        return 2
    model = engine.model
    log(
        f"training {args.heads} Medusa heads for {engine.name} on {device} "
        f"({args.steps} steps x {args.batch_size}x{args.seq_len} tokens)"
    )
    autocast = device != "cpu" and engine.dtype != torch.float32
    with torch.autocast(device_type=str(device).split(":")[0], dtype=engine.dtype, enabled=autocast):
        w, b, summary = md.train_heads(model, args.heads, train, args.steps, lr=args.lr, minutes=args.minutes, log=log)
    after = md.measure(model, w, b, held)
    log(
        "agreement per head (2.."
        + str(args.heads + 1)
        + " ahead): "
        + ", ".join(f"{a:.3f}" for a in after["agreement"])
    )
    summary.update(after=after, seq_len=args.seq_len, batch_size=args.batch_size)
    out = args.out or default_out(engine.model_dir, md.MEDUSA_FILE, user_medusa_path(engine.model_id))
    path = md.save_heads(out, w, b, engine.model_id, model.config, summary)
    summary["path"] = str(path)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        log(f"wrote {path}; `completiond calibrate` decides whether the tree pays here")
    return 0
