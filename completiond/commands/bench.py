"""`completiond bench`: speed measured side by side in one run, on one model and one set of prompts.

Compared: plain autoregressive decoding through our engine, our self-speculative
decoding, transformers' greedy `generate()`, and transformers'
`generate(assistant_early_exit=E)` at the same exit layer. Every variant
decodes the same held-out prompts with a cold cache and EOS ignored, so each
produces exactly `--max-tokens` tokens and greedy outputs can be compared
token for token. `--typing` replays a typing session through the editor path instead.
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import sys
import threading
import time
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model directory or hub id (default: the bundled model)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--prompts", type=int, default=6, help="number of held-out prompts")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--exit-layer", type=int, default=None, help="default: calibrated")
    p.add_argument("--draft-k", type=int, default=None, help="default: calibrated")
    p.add_argument("--files", nargs="*", default=None, help="source files for prompts (default: held-out stdlib files)")
    p.add_argument("--skip-hf", action="store_true", help="skip the transformers baselines")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--typing", action="store_true", help="typing-session benchmark through LSP and the daemon")
    p.add_argument("--keystrokes", type=int, default=120, help="with --typing")
    p.add_argument("--file", default=None, help="with --typing: the file to type into (default: a held-out file)")


def prompt_texts(files: list[Path] | None, count: int, chars: int = 1500) -> list[str]:
    """Deterministic prompts: the text before a line a third of the way into each file."""
    if files is None:
        from completiond.models.corpus import heldout_files

        files = [f.path for f in heldout_files()]
    out = []
    for path in files:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        lines = text.splitlines(keepends=True)
        if len(lines) < 60:
            continue
        cut = len(lines) // 3
        out.append("".join(lines[:cut])[-chars:])
        if len(out) == count:
            break
    if not out:
        raise SystemExit("completiond bench: no usable prompt files")
    return out


def long_text(files: list[Path] | None, tokenizer, tokens: int) -> str:
    """A prompt of about `tokens` tokens from consecutive source files."""
    parts, total = [], 0
    for text in prompt_texts(files, 50, chars=20000):
        parts.append(text)
        total += len(tokenizer(text).input_ids)
        if total >= tokens:
            break
    ids = tokenizer("".join(parts)).input_ids[:tokens]
    return tokenizer.decode(ids)


def _patch_hf_early_exit() -> None:
    """transformers 5.2's EarlyExitCandidateGenerator drops an argument its parent requires.

    Forward it, so the baseline runs as upstream intends; a fixed release is left untouched.
    """
    from transformers.generation import candidate_generator as cg

    cls = getattr(cg, "EarlyExitCandidateGenerator", None)
    if cls is None or "is_first_iteration" not in inspect.signature(cg.AssistedCandidateGenerator.get_candidates).parameters:
        return
    src = inspect.getsource(cls.get_candidates)
    if "super().get_candidates(input_ids)" not in src:
        return

    def get_candidates(self, input_ids, is_first_iteration):
        base = getattr(self.assistant_model, self.assistant_model.base_model_prefix)
        layers = base.config.num_hidden_layers
        base.config.num_hidden_layers = self.assistant_early_exit
        try:
            return cg.AssistedCandidateGenerator.get_candidates(self, input_ids, is_first_iteration)
        finally:
            base.config.num_hidden_layers = layers

    cls.get_candidates = get_candidates


def _hf_generate(engine, ids: list[int], max_tokens: int, exit_layer: int | None) -> tuple[list[int], float]:
    import torch

    x = torch.tensor([ids], device=engine.device)
    kwargs = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
                  eos_token_id=None)
    if exit_layer is not None:
        kwargs["assistant_early_exit"] = exit_layer
    t = time.perf_counter()
    with torch.inference_mode():
        out = engine.model.generate(x, **kwargs)
    return out[0, len(ids):].tolist(), time.perf_counter() - t


def _timed(engine, ids, params, cold: bool = True):
    if cold:
        engine.cache.clear()
    t = time.perf_counter()
    gen = engine.generate(ids, params)
    return gen, time.perf_counter() - t


def measure(engine, files, n_prompts: int, max_tokens: int, exit_layer: int | None, draft_k: int | None,
            skip_hf: bool, log=print) -> dict:
    import torch

    from completiond.engine.engine import CancelToken, SamplingParams

    texts = prompt_texts(files, n_prompts)
    prompts = [engine.tokenizer(t).input_ids for t in texts]
    cal = engine.calibration
    E = exit_layer or cal.exit_layer
    K = draft_k or cal.draft_k
    plain_p = SamplingParams(max_tokens=max_tokens, speculative=False, ignore_eos=True)
    spec_p = SamplingParams(max_tokens=max_tokens, exit_layer=E, draft_k=K, ignore_eos=True)
    if not skip_hf:
        _patch_hf_early_exit()
    # warm-up: first calls pay for allocator and kernel selection
    _timed(engine, prompts[0][:64], SamplingParams(max_tokens=8, exit_layer=E, draft_k=K))
    _timed(engine, prompts[0][:64], SamplingParams(max_tokens=8, speculative=False))

    times = {"plain": 0.0, "spec": 0.0, "hf": 0.0, "hf_early_exit": 0.0}
    identical = True
    drafted = accepted = rejected = rounds = generated = 0
    draft_ms = verify_ms = plain_decode_ms = spec_decode_ms = 0.0
    for i, ids in enumerate(prompts):
        plain, t_plain = _timed(engine, ids, plain_p)
        spec, t_spec = _timed(engine, ids, spec_p)
        times["plain"] += t_plain
        times["spec"] += t_spec
        same = spec.tokens == plain.tokens
        if not skip_hf:
            hf, t_hf = _hf_generate(engine, ids, max_tokens, None)
            hfe, t_hfe = _hf_generate(engine, ids, max_tokens, E)
            times["hf"] += t_hf
            times["hf_early_exit"] += t_hfe
            same = same and hf == plain.tokens and hfe == plain.tokens
        identical = identical and same
        s = spec.stats
        drafted += s.drafted
        accepted += s.accepted
        rejected += s.rejected
        rounds += s.rounds
        generated += s.generated_tokens
        draft_ms += s.draft_ms
        verify_ms += s.verify_ms
        plain_decode_ms += plain.stats.decode_ms
        spec_decode_ms += s.decode_ms
        log(f"prompt {i + 1}/{len(prompts)}: {len(ids)} tokens, plain {max_tokens / t_plain:.1f} tok/s, "
            f"spec {max_tokens / t_spec:.1f} tok/s, alpha {s.alpha:.2f}, identical {same}")

    n_tokens = max_tokens * len(prompts)
    tps = {k: (n_tokens / v if v > 0 else None) for k, v in times.items()}
    alpha = accepted / (accepted + rejected) if accepted + rejected else 0.0  # per token, as Stats.alpha
    mean_k = drafted / rounds if rounds else 0.0
    plain_token_ms = plain_decode_ms / n_tokens
    draft_step_ms = draft_ms / drafted if drafted else 0.0
    verify_pass_ms = verify_ms / rounds if rounds else 0.0
    c = draft_step_ms / plain_token_ms if plain_token_ms else 0.0
    expected = (1 - alpha ** (mean_k + 1)) / (1 - alpha) if alpha < 1 else mean_k + 1
    predicted = expected / (1 + mean_k * c)

    # time to first token: cold 2,000-token prompt, then the same text plus one character
    text = long_text(files, engine.tokenizer, 2000)
    cold_ids = engine.tokenizer(text).input_ids
    warm_ids = engine.tokenizer(text + "x").input_ids
    one = SamplingParams(max_tokens=1, exit_layer=E, draft_k=K)
    cold, t_cold = _timed(engine, cold_ids, one, cold=True)
    warm, t_warm = _timed(engine, warm_ids, one, cold=False)

    # cancel latency: cancel a long generation mid-flight, time until it returns
    cancel = CancelToken()
    result = {}
    long_p = SamplingParams(max_tokens=min(512, engine.max_context - len(prompts[0]) - 1), exit_layer=E, draft_k=K,
                            ignore_eos=True)

    def worker():
        result["gen"] = engine.generate(prompts[0], long_p, cancel=cancel)
        result["end"] = time.perf_counter()

    engine.cache.clear()
    th = threading.Thread(target=worker)
    th.start()
    time.sleep(0.3)
    t_cancel = time.perf_counter()
    cancel.cancel()
    th.join()
    cancel_ms = 1000 * (result["end"] - t_cancel)
    g = result["gen"]
    round_ms = g.stats.decode_ms / g.stats.rounds if g.stats.rounds else 0.0

    def ratio(a, b):
        return a / b if a and b else None

    return {
        "model": engine.name,
        "model_id": engine.model_id,
        "device": engine.device,
        "dtype": str(engine.dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "prompts": len(prompts),
        "max_tokens": max_tokens,
        "exit_layer": E,
        "draft_k": K,
        "layers": engine.num_layers,
        "tokens_per_s": tps,
        "spec_vs_plain": ratio(tps["spec"], tps["plain"]),
        "spec_vs_hf": ratio(tps["spec"], tps["hf"]),
        "spec_vs_hf_early_exit": ratio(tps["spec"], tps["hf_early_exit"]),
        "plain_vs_hf": ratio(tps["plain"], tps["hf"]),
        "greedy_identical": identical,
        "alpha": alpha,
        "mean_drafted_per_round": mean_k,
        "mean_accepted_per_round": generated / rounds if rounds else 0.0,
        "predicted_speedup": predicted,
        "draft_cost_ratio": c,
        "plain_ms_per_token": plain_token_ms,
        "draft_ms_per_step": draft_step_ms,
        "verify_ms_per_pass": verify_pass_ms,
        "ttft_cold_ms": 1000 * t_cold,
        "ttft_warm_ms": 1000 * t_warm,
        "ttft_prompt_tokens": len(cold_ids),
        "warm_reused_tokens": warm.stats.reused_tokens,
        "warm_cold_ttft_ratio": t_warm / t_cold,
        "cancel_ms": cancel_ms,
        "cancel_round_ms": round_ms,
        "cancel_within_one_round": cancel_ms <= max(round_ms, 1e-9) * 1.0 + 1.0,
        "cancelled_tokens": len(g.tokens),
    }


def run(args: argparse.Namespace) -> int:
    log = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    if args.typing:
        from completiond.commands.bench_typing import run_typing_bench

        result = run_typing_bench(model=args.model, file=Path(args.file) if args.file else None,
                                  keystrokes=args.keystrokes, log=log)
    else:
        from completiond.engine.engine import Engine, EngineError

        try:
            engine = Engine.load(args.model, device=args.device, dtype=args.dtype)
        except EngineError as exc:
            print(f"completiond bench: {exc}", file=sys.stderr)
            return 1
        files = [Path(f) for f in args.files] if args.files else None
        log(f"model {engine.name} on {engine.device}, {engine.num_layers} layers, calibration: {engine.calibration.source}")
        result = measure(engine, files, args.prompts, args.max_tokens, args.exit_layer, args.draft_k, args.skip_hf, log)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_table(result)
    return 0


def _print_table(r: dict) -> None:
    for key, value in r.items():
        if isinstance(value, float):
            value = f"{value:.3f}"
        elif isinstance(value, dict):
            value = ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in value.items())
        print(f"{key:>26}: {value}")
