"""`completiond generate`: continue a prompt with the engine.

The external check of losslessness: the same seed and prompt give the same
text with and without `--no-spec` under greedy decoding, and the same
distribution under sampling.
"""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model directory or hub id (default: the bundled model)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="read the prompt from this file ('-' for stdin)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-spec", action="store_true", help="plain autoregressive decoding")
    p.add_argument("--exit-layer", type=int, default=None, help="draft exit layer E (default: calibrated)")
    p.add_argument("--draft-k", type=int, default=None, help="most draft tokens per round (default: calibrated)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--stats", action="store_true", help="print stats as JSON on stderr")


def run(args: argparse.Namespace) -> int:
    from completiond.engine.engine import Engine, EngineError, SamplingParams

    if args.prompt is not None:
        prompt = args.prompt
    else:
        try:
            prompt = sys.stdin.read() if args.prompt_file == "-" else open(args.prompt_file, encoding="utf-8").read()
        except (OSError, UnicodeDecodeError) as exc:
            print(f"completiond generate: cannot read prompt: {exc}", file=sys.stderr)
            return 2
    try:
        engine = Engine.load(args.model, device=args.device, dtype=args.dtype, trust_remote_code=args.trust_remote_code)
        ids = engine.tokenizer(prompt).input_ids
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            speculative=not args.no_spec,
            exit_layer=args.exit_layer,
            draft_k=args.draft_k,
        )
        gen = engine.generate(ids, params)
    except EngineError as exc:
        print(f"completiond generate: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(engine.tokenizer.decode(gen.tokens))
    sys.stdout.write("\n")
    if args.stats:
        print(json.dumps({"finish_reason": gen.finish_reason, **gen.stats.to_dict()}, indent=2), file=sys.stderr)
    return 0
