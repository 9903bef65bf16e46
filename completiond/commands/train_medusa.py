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
import os
import random
import sys
from pathlib import Path

from completiond.commands.train_adapter import _expand, _texts


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model directory or hub id (default: the bundled model)")
    p.add_argument("--heads", type=int, default=4, help="number of heads (depths 2..heads+1 ahead)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--minutes", type=float, default=0.0, help="stop training after this long (0: no limit)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--train-tokens", type=int, default=3_000_000)
    p.add_argument("--files", nargs="*", default=None, help="training code files or directories (default: stdlib training split)")
    p.add_argument("--heldout", nargs="*", default=None, help="held-out files or directories (default: stdlib held-out split)")
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
    from completiond.models import corpus
    from completiond.models import exit_adapter as ea
    from completiond.models import medusa as md

    if args.threads:
        torch.set_num_threads(args.threads)
    if not 1 <= args.heads <= 8:
        print("completiond train-medusa: --heads must be in 1..8", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    try:
        engine = Engine.load(args.model, device=args.device, dtype=args.dtype)
    except EngineError as exc:
        print(f"completiond train-medusa: {exc}", file=sys.stderr)
        return 1
    try:
        train_paths = _expand(args.files) if args.files else [f.path for f in corpus.training_files()]
        held_paths = _expand(args.heldout) if args.heldout else [f.path for f in corpus.heldout_files()]
    except FileNotFoundError as exc:
        print(f"completiond train-medusa: {exc}", file=sys.stderr)
        return 2
    tok, device = engine.tokenizer, engine.device
    log = (lambda m: print(m, file=sys.stderr)) if args.json else print

    def streams(paths, r):
        for text in _texts(paths, r):
            yield tok(text).input_ids + ([tok.eos_token_id] if tok.eos_token_id is not None else [])

    try:
        train = (b.to(device) for b in ea.token_windows(streams(train_paths, rng), args.seq_len, args.batch_size, rng,
                                                       args.train_tokens))
        held_rng = random.Random(1234)
        held_iter = ea.token_windows(streams(held_paths, held_rng), args.seq_len, args.batch_size, held_rng,
                                     args.heldout_batches * args.batch_size * args.seq_len * 4)
        held = [next(held_iter).to(device) for _ in range(args.heldout_batches)]
    except ValueError as exc:
        print(f"completiond train-medusa: {exc}", file=sys.stderr)
        return 2
    model = engine.model
    log(f"training {args.heads} Medusa heads for {engine.name} on {device} "
        f"({args.steps} steps x {args.batch_size}x{args.seq_len} tokens)")
    autocast = device != "cpu" and engine.dtype != torch.float32
    with torch.autocast(device_type=str(device).split(":")[0], dtype=engine.dtype, enabled=autocast):
        w, b, summary = md.train_heads(model, args.heads, train, args.steps, lr=args.lr, minutes=args.minutes, log=log)
    after = md.measure(model, w, b, held)
    log("agreement per head (2.." + str(args.heads + 1) + " ahead): " + ", ".join(f"{a:.3f}" for a in after["agreement"]))
    summary.update(after=after, seq_len=args.seq_len, batch_size=args.batch_size)
    model_dir = engine.model_dir
    in_hub_cache = any(part.startswith("models--") for part in model_dir.resolve().parts)
    out = args.out or (model_dir / md.MEDUSA_FILE if not in_hub_cache and os.access(model_dir, os.W_OK)
                       else user_medusa_path(engine.model_id))
    path = md.save_heads(out, w, b, engine.model_id, model.config, summary)
    summary["path"] = str(path)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        log(f"wrote {path}; `completiond calibrate` decides whether the tree pays here")
    return 0
