"""`completiond bench-device`: the figures an accelerator owes the engine-speed work, in one run.

For each model (the bundled one, and randomly initialised models shaped like real ones, so that no
download is needed: the machine a GPU is lent on reaches nothing outside):

* plain decoding, decode-only milliseconds per token (median of repeats), against the memory-bandwidth
  bound: weight bytes ÷ the device's copy bandwidth measured in the same run (batch-1 decoding reads every
  weight once per token, so no step can beat that bound);
* `verify_cost_by_k`: one pass over K+1 positions ÷ one single-token step, K = 1..8;
* early-exit speculation at the model's calibrated (or heuristic) E and K: decode ms/token and whether
  its greedy output equals plain greedy decoding token for token (random weights draft badly: this
  row measures the machinery, not a draft's worth);
* sampling at temperature 0.8, plain and speculative, which exercises the per-device generator
  and the on-device accept test (Engine.resident_ids).

Prepared for the device tool (see README, Performance), from the repository root:

    python3 -m pip install -q --no-deps --no-build-isolation -e . && \\
        python3 -m completiond.cli bench-device --json > $OUT/device.json

It runs on a CPU as well (tests use a tiny shape there).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Randomly initialised stand-ins for real models: the shapes (and so the bytes and FLOPs a step
# moves) of their configs; the bundled tokenizer's ids are all below their vocabularies.
SHAPES = {
    "qwen2.5-coder-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                               num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                               rope_theta=1_000_000.0, tie_word_embeddings=True),
    # for tests on a CPU
    "tiny-qwen2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=8192, max_position_embeddings=4096, tie_word_embeddings=True),
}
DEFAULT_MODELS = ("bundled", "qwen2.5-coder-1.5b")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default=",".join(DEFAULT_MODELS),
                   help=f"comma-separated: 'bundled', a model directory, or a shape ({', '.join(SHAPES)})")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 on a GPU, float32 on the CPU")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-k", type=int, default=8)
    p.add_argument("--bandwidth-mb", type=int, default=1024, help="size of the buffer the bandwidth copy moves")
    p.add_argument("--json", action="store_true")


def copy_bandwidth(device, megabytes: int, repeats: int = 5) -> float:
    """Bytes read plus bytes written per second by a device-to-device copy (median of repeats), GB/s."""
    import torch

    from completiond.commands.bench import synchronize

    n = max(1, megabytes << 20) // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    synchronize(device)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        times.append(time.perf_counter() - t)
    return 2 * src.numel() * 4 / statistics.median(times) / 1e9


def random_model(shape: str, directory: Path, dtype: str, device: str) -> Path:
    """A model of this shape with random weights (std 0.02), written with the bundled tokenizer."""
    import torch
    import transformers

    from completiond.engine.engine import pick_dtype
    from completiond.models import default_model_dir

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: expected one of {', '.join(SHAPES)}")
    cfg = transformers.Qwen2Config(**SHAPES[shape], eos_token_id=0, bos_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: a 1.5B model is minutes of CPU, a blink of GPU
        model = transformers.Qwen2ForCausalLM(cfg)
    model.to(pick_dtype(dtype, device)).save_pretrained(directory, safe_serialization=True)
    del model
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir() / name, directory / name)
    return directory


def _decode_ms_per_token(engine, prompts, params, repeats: int) -> tuple[float, list[list[int]]]:
    from completiond.commands.bench import _timed

    times, outs = [], []
    for r in range(repeats):
        total_ms = tokens = 0
        outs = []
        for ids in prompts:
            gen, _ = _timed(engine, ids, params)  # cold cache, as bench times each method
            total_ms += gen.stats.decode_ms
            tokens += len(gen.tokens)
            outs.append(gen.tokens)
        times.append(total_ms / max(1, tokens))
    return statistics.median(times), outs


def report_model(engine, prompts: list[list[int]], repeats: int, max_tokens: int, max_k: int,
                 bandwidth_gbs: float, log=print) -> dict:
    from completiond.commands.bench import verify_cost
    from completiond.engine.engine import SamplingParams

    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    out = {"model": engine.name, "device": str(engine.device), "dtype": str(engine.dtype).removeprefix("torch."),
           "layers": engine.num_layers, "parameters": sum(p.numel() for p in engine.model.parameters()),
           "weight_bytes": weight_bytes, "decode_step": engine.decode_step_in_use(),
           "resident_ids": engine.resident_ids}
    bound_ms = 1000 * weight_bytes / (bandwidth_gbs * 1e9) if bandwidth_gbs else None
    plain_p = SamplingParams(max_tokens=max_tokens, speculative=False, ignore_eos=True)
    cal = engine.calibration
    spec_p = SamplingParams(max_tokens=max_tokens, exit_layer=cal.exit_layer, draft_k=cal.draft_k, ignore_eos=True,
                            prompt_lookup=False, draft="early_exit")
    _decode_ms_per_token(engine, prompts[:1], plain_p, 1)  # warm-up (allocator, kernels)
    _decode_ms_per_token(engine, prompts[:1], spec_p, 1)
    plain_ms, plain_out = _decode_ms_per_token(engine, prompts, plain_p, repeats)
    spec_ms, spec_out = _decode_ms_per_token(engine, prompts, spec_p, repeats)
    out.update(plain_ms_per_token=round(plain_ms, 4),
               bandwidth_bound_ms_per_token=round(bound_ms, 4) if bound_ms else None,
               plain_vs_bound=round(plain_ms / bound_ms, 2) if bound_ms else None,
               early_exit={"exit_layer": cal.exit_layer, "k": cal.draft_k, "ms_per_token": round(spec_ms, 4),
                           "gain": round(plain_ms / spec_ms, 3), "greedy_identical": spec_out == plain_out})
    log(f"  plain {plain_ms:.3f} ms/token (bandwidth bound {bound_ms or float('nan'):.3f}); "
        f"early exit E={cal.exit_layer} K={cal.draft_k}: {spec_ms:.3f} ms/token, identical {spec_out == plain_out}")
    by_k = {}
    for k in range(1, max_k + 1):
        vc = verify_cost(engine, prompts[0], k, repeats=max(10, 4 * repeats))
        by_k[str(k)] = round(vc["ratio"], 3)
    out["verify_cost_by_k"] = by_k
    log(f"  verify_cost_by_k {by_k}")
    sampled = {}
    for name, spec in (("plain", False), ("early_exit", True)):
        p = SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=1, speculative=spec, ignore_eos=True,
                           exit_layer=cal.exit_layer if spec else None, draft_k=cal.draft_k if spec else None,
                           prompt_lookup=False, draft="early_exit" if spec else None)
        try:
            ms, outs = _decode_ms_per_token(engine, prompts[:2], p, 1)
            sampled[name] = {"ms_per_token": round(ms, 4), "tokens": sum(len(o) for o in outs)}
        except RuntimeError as exc:  # the failure this row exists to catch (a generator on the wrong device)
            sampled[name] = {"error": f"{type(exc).__name__}: {exc}"}
    out["sampling_t0.8"] = sampled
    log(f"  sampling at 0.8: {sampled}")
    return out


def run(args: argparse.Namespace) -> int:
    import torch

    from completiond.commands.bench import prompt_texts, synchronize
    from completiond.engine.engine import Engine, EngineError, pick_device

    log = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    device = pick_device(args.device)
    bandwidth = copy_bandwidth(device, args.bandwidth_mb)
    result = {"device": device, "device_name": torch.cuda.get_device_name() if device == "cuda" else device,
              "torch": torch.__version__, "copy_bandwidth_gbs": round(bandwidth, 1),
              "cuda_graphs": "not built: no captured decode step or verify pass exists yet (issue 11)",
              "models": []}
    log(f"{result['device_name']}: copy bandwidth {bandwidth:.1f} GB/s (read + write)")
    texts = prompt_texts(None, 3)
    with tempfile.TemporaryDirectory(prefix="completiond-device-") as tmp:
        for name in [m.strip() for m in args.models.split(",") if m.strip()]:
            log(f"{name}:")
            try:
                if name in SHAPES:
                    path = random_model(name, Path(tmp) / name, args.dtype, device)
                    engine = Engine.load(path, device=device, dtype=args.dtype)
                    engine.name = f"{name} (random weights)"
                else:
                    engine = Engine.load(None if name == "bundled" else name, device=device, dtype=args.dtype)
            except (EngineError, ValueError, OSError) as exc:
                result["models"].append({"model": name, "error": str(exc)})
                log(f"  not measured: {exc}")
                continue
            prompts = [engine.tokenizer(t)["input_ids"][-512:] for t in texts]
            with torch.inference_mode():
                result["models"].append(report_model(engine, prompts, args.repeats, args.max_tokens, args.max_k,
                                                     bandwidth, log))
            del engine
            if device == "cuda":
                torch.cuda.empty_cache()  # between models only: the next one needs the memory
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_table(result)
    return 0


def _print_table(r: dict) -> None:
    print(f"\n{r['device_name']} (torch {r['torch']}), copy bandwidth {r['copy_bandwidth_gbs']} GB/s; "
          f"CUDA graphs: {r['cuda_graphs']}")
    print("| model | dtype | plain ms/token | bound ms/token | early exit ms/token (identical) | verify cost K=1..8 | sampling 0.8 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for m in r["models"]:
        if "error" in m:
            print(f"| {m['model']} | not measured: {m['error']} | | | | | |")
            continue
        ee = m["early_exit"]
        vc = ", ".join(str(v) for v in m["verify_cost_by_k"].values())
        smp = "; ".join(f"{k}: {v.get('ms_per_token', v.get('error'))}" for k, v in m["sampling_t0.8"].items())
        print(f"| {m['model']} | {m['dtype']} | {m['plain_ms_per_token']} | {m['bandwidth_bound_ms_per_token']} | "
              f"{ee['ms_per_token']} ({ee['greedy_identical']}) | {vc} | {smp} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="completiond bench-device", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
