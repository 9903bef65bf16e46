"""`completiond bench-device`: the engine-speed figures of real model sizes, in one run.

For each model (the bundled one, a model directory, or a randomly initialised model shaped like a real one,
so that no download is needed: the machine a GPU is lent on reaches nothing outside) and each weight
format asked for (`--weights`):

* plain decoding at a fixed context (`--context`, 512 tokens), decode-only milliseconds per token (median
  of repeats), against the memory-bandwidth bound: the weight bytes the step reads ÷ the copy bandwidth
  measured in the same run (batch-1 decoding reads every weight once per token, so no step beats it);
* resident memory (RSS) after the load, beside the weight bytes;
* `verify_cost_by_k`: one pass over K+1 positions ÷ one single-token step, K = 1..8 (and, where the native
  step runs, its one-call greedy verify ÷ its one-call plain step: `native_verify_cost_by_k`);
* where the native step runs, the floor under those ratios: the matrix products' arithmetic alone at 1..K+1
  rows (this build's kernels on weights held in cache, no memory stream to wait on), in ms and ÷ a plain
  step (`matmul_arithmetic_ms_by_rows`, `matmul_arithmetic_vs_plain_by_k`);
* early-exit speculation at the model's calibrated (or heuristic) E and K: decode ms/token and whether
  its greedy output equals plain greedy decoding token for token (random weights draft badly: this
  row measures the machinery, not a draft's worth);
* sampling at temperature 0.8, plain and speculative, which exercises the per-device generator
  and the on-device accept test (Engine.resident_ids).

The peer (`--llama-bench DIR`, the folder .ci/llama_bench.sh prints): the same model written as GGUF by
models/to_gguf.py, quantised by llama-quantize to each of `--llama-types`, and timed by llama.cpp's
`llama-bench` (token generation at the same context and thread count), ours ÷ theirs beside each row.
It also times llama.cpp's prompt processing of `--context` tokens into an empty cache beside our cold
prefill of the same length (`prefill_tokens_per_s`), and its own pass over K+1 new tokens at that depth
against its pass over one (`-p 1,K+1 -n 0`, for each K of `--llama-k`): the peer's figure for what
`verify_cost_by_k` measures of ours.

Random shapes carry the real vocabulary size (`--vocab real`) or the bundled tokenizer's 8,192 tokens
(`--vocab bundled`, the issue-27 table's first stand-in); the JSON names which. Their weights are random
bf16 values (std 0.02, q/k/v biases included), so bf16 panels and a bf16 GGUF hold them exactly.

Prepared for the device tool (see README, Performance), from the repository root:

    python3 -m pip install -q --no-deps --no-build-isolation -e . && \\
        python3 -m completiond.cli bench-device --json > $OUT/device.json

It runs on a CPU as well (tests use a tiny shape there).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

from completiond.config import SETTINGS_BY_KEY
from completiond.engine.draft_kind import DraftKind
from completiond.errors import CompletionError

# Randomly initialised stand-ins for real models: the shapes (and so the bytes and FLOPs a step
# moves) of their configs; the bundled tokenizer's ids are all below their vocabularies.
SHAPES = {
    "qwen2.5-coder-0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    "qwen2.5-coder-1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    # for tests on a CPU
    "tiny-qwen2": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=8192,
        max_position_embeddings=4096,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
    ),
}
DEFAULT_MODELS = ("bundled", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")
WEIGHT_FORMATS: tuple[str, ...] = SETTINGS_BY_KEY["weights"].enum or ()  # the formats Engine.load(weights=...) accepts
READERS = ("auto", "transformers")  # Engine.load(reader=...)
LLAMA_TYPES = ("f32", "bf16", "q8_0")
# Which llama.cpp type stores the weights as our format does: the pairs the ratios compare.
PEER_TYPE = {"float32": "f32", "bf16": "bf16", "int8": "q8_0"}


class BenchDeviceError(CompletionError):
    """A bench-device run that cannot go on (a bad option, a peer tool that failed)."""


def _csv(value: str, allowed: tuple[str, ...], what: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"{what} {value!r}: expected a comma-separated list of {', '.join(allowed)}")
    return items


def _ks(value: str) -> list[int]:
    try:
        ks = sorted({int(v) for v in value.split(",") if v.strip()})
    except ValueError:
        ks = [0]
    if any(k < 1 or k > 63 for k in ks):
        raise argparse.ArgumentTypeError(f"--llama-k {value!r}: expected comma-separated draft lengths 1..63")
    return ks


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--models",
        default=",".join(DEFAULT_MODELS),
        help=f"comma-separated: 'bundled', a model directory, or a shape ({', '.join(SHAPES)})",
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 on a GPU, float32 on the CPU")
    p.add_argument(
        "--weights",
        default="auto",
        type=lambda v: _csv(v, WEIGHT_FORMATS, "--weights"),
        help="weight formats of the native step to measure, comma-separated (auto, bf16, int8): each "
        "loads the model once",
    )
    p.add_argument(
        "--reader",
        default="auto",
        type=lambda v: _csv(v, READERS, "--reader"),
        help="how the weights are read, comma-separated: auto (a large bf16 checkpoint without "
        "transformers' model code, engine/checkpoint.py) or transformers; each loads the model once (RSS "
        "compares only across processes: a second load starts from the first one's heap)",
    )
    p.add_argument(
        "--vocab",
        choices=("real", "bundled"),
        default="real",
        help="random shapes: the real model's vocabulary size, or the bundled tokenizer's 8,192 tokens",
    )
    p.add_argument("--context", type=int, default=512, help="prompt tokens before decoding starts")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-k", type=int, default=8)
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="CPU threads, ours and llama.cpp's (0: the engine's default, $COMPLETIOND_THREADS or torch's)",
    )
    p.add_argument("--no-sampling", action="store_true", help="skip the temperature-0.8 rows")
    p.add_argument("--bandwidth-mb", type=int, default=1024, help="size of the buffer the bandwidth copy moves")
    p.add_argument(
        "--llama-bench",
        type=Path,
        default=None,
        metavar="PATH",
        help="llama.cpp's llama-bench (or the folder holding it and llama-quantize, as "
        ".ci/llama_bench.sh prints): measure llama.cpp on the same models",
    )
    p.add_argument(
        "--llama-types",
        default="bf16,q8_0",
        type=lambda v: _csv(v, LLAMA_TYPES, "--llama-types"),
        help="GGUF types llama.cpp runs, comma-separated (f32, bf16, q8_0)",
    )
    p.add_argument("--llama-repeats", type=int, default=5, help="llama-bench -r")
    p.add_argument(
        "--llama-k",
        default="4",
        type=_ks,
        metavar="K[,K...]",
        help="llama.cpp's pass cost over K+1 tokens, against one, for each K (comma-separated; '' measures none)",
    )
    p.add_argument("--json", action="store_true")


# ----------------------------------------------------------------------------- measurements


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


def rss_bytes() -> int | None:
    """This process's resident set size now (Linux /proc; None elsewhere)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def shape_config(shape: str, vocab: str = "real") -> dict:
    """The config of a shape, with the bundled tokenizer's vocabulary size when vocab == "bundled"."""
    if shape not in SHAPES:
        raise BenchDeviceError(f"unknown shape {shape!r}: expected one of {', '.join(SHAPES)}")
    cfg = dict(SHAPES[shape])
    if vocab == "bundled":
        cfg["vocab_size"] = 8192  # the bundled tokenizer's (models/completiond-py-mini)
    return cfg


def random_model(shape: str, directory: Path, vocab: str = "real", seed: int = 0) -> Path:
    """A Qwen2 model of this shape with random bf16 weights (std 0.02; q/k/v biases too, so that every
    tensor a converter must carry is non-zero; norms 1), written with the bundled tokenizer's vocabulary.

    Written tensor by tensor from a seeded generator, not through transformers' initialisation: a 1.5B
    model is then seconds, and the process never holds a float32 copy of it."""
    import torch
    import transformers
    from safetensors.torch import save_file

    from completiond.models import default_model_dir

    cfg = cast(Any, transformers.Qwen2Config(**shape_config(shape, vocab), eos_token_id=0, bos_token_id=0))
    directory.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(directory)
    h, inter, kv = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads),
    )
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape_):
        return (torch.randn(*shape_, generator=gen) * 0.02).to(torch.bfloat16)

    tensors = {
        "model.embed_tokens.weight": normal(cfg.vocab_size, h),
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
    }
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        tensors.update(
            {
                p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                p + "self_attn.q_proj.weight": normal(h, h),
                p + "self_attn.q_proj.bias": normal(h),
                p + "self_attn.k_proj.weight": normal(kv, h),
                p + "self_attn.k_proj.bias": normal(kv),
                p + "self_attn.v_proj.weight": normal(kv, h),
                p + "self_attn.v_proj.bias": normal(kv),
                p + "self_attn.o_proj.weight": normal(h, h),
                p + "mlp.gate_proj.weight": normal(inter, h),
                p + "mlp.up_proj.weight": normal(inter, h),
                p + "mlp.down_proj.weight": normal(h, inter),
            }
        )
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    # The bundled tokenizer's vocabulary as transformers' Qwen2 class reads and saves it, with Qwen2's split:
    # a real Qwen2 directory's tokenizer.json describes what its tokenizer class does, and this one must too.
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir() / name, directory / name)
    transformers.AutoTokenizer.from_pretrained(str(directory)).save_pretrained(str(directory))
    return directory


def context_prompts(tokenizer, count: int, context: int) -> list[list[int]]:
    """`count` prompts of exactly `context` tokens where the held-out files allow it: windows starting a
    third of the way into each file (shorter files give way to longer ones; the last resort repeats)."""
    from completiond.commands.bench import source_lines

    out: list[list[int]] = []
    short: list[list[int]] = []
    for lines in source_lines(None):
        ids = tokenizer("".join(lines))["input_ids"]
        start = min(len(ids) // 3, max(0, len(ids) - context))
        (out if len(ids) >= context else short).append(ids[start : start + context])
        if len(out) == count:
            return out
    while len(out) < count and (out or short):
        src = (out or short)[len(out) % len(out or short)]
        out.append((src * (context // max(1, len(src)) + 1))[:context])
    if not out:
        raise BenchDeviceError("no usable prompt files")
    return out


def weight_bytes(engine) -> int:
    """The bytes of weights one decode step streams: the native step's packed panels (layers and LM head,
    int8 scales included; the head is packed on the first plain step, so ask after one) where it runs,
    else the module's parameters (tied ones once)."""
    if engine.fwd.native is not None:
        return engine.fwd.native.packed_bytes()
    seen, total = set(), 0
    for p in engine.model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def parameter_count(engine) -> int:
    """The model's matrices and embedding (norms and biases left out), counted at load: a large model's
    module parameters are released once packed."""
    fwd = engine.fwd
    tied = fwd.head_w.data_ptr() == fwd.embed_w.data_ptr()
    return sum(fwd.layer_numel[: engine.num_layers]) + fwd.embed_w.numel() + (0 if tied else fwd.head_w.numel())


def _decode_ms_per_token(engine, prompts, params, repeats: int) -> tuple[float, list[list[int]]]:
    from completiond.commands.bench import _timed

    times: list[float] = []
    outs: list[list[int]] = []
    for _ in range(repeats):
        total_ms = tokens = 0
        outs = []
        for ids in prompts:
            # The prefix cache kept: the decode clock starts after prefill, which would only repeat the
            # prompt's K/V (seconds per prompt on a 1.5B model) for every method and repeat.
            gen, _ = _timed(engine, ids, params, cold=False)
            total_ms += gen.stats.decode_ms
            tokens += len(gen.tokens)
            outs.append(gen.tokens)
        times.append(total_ms / max(1, tokens))
    return statistics.median(times), outs


def cold_prefill_ms(engine, prompt: list[int], repeats: int) -> float:
    """The whole prompt into a fresh KV sequence, not the prefix cache's (what a file costs before its first
    suggestion, or after an edit near its top): median ms of repeats."""
    from completiond.commands.bench import synchronize

    times = []
    for _ in range(repeats):
        seq = engine.new_sequence(len(prompt) + 1)
        synchronize(engine.device)
        t0 = time.perf_counter()
        engine.prefill(seq, prompt, None)
        synchronize(engine.device)
        times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


def report_model(
    engine,
    prompts: list[list[int]],
    repeats: int,
    max_tokens: int,
    max_k: int,
    bandwidth_gbs: float,
    log=print,
    sampling: bool = True,
) -> dict:
    from completiond.commands.bench import verify_cost
    from completiond.engine import native as native_mod
    from completiond.engine.engine import SamplingParams

    plain_p = SamplingParams(max_tokens=max_tokens, speculative=False, ignore_eos=True)
    # Warm-up (allocator, kernels) before anything is read: the native step packs its LM head panels on
    # the first plain step, so only now do its packed bytes hold every weight a step streams.
    _decode_ms_per_token(engine, prompts[:1], plain_p, 1)
    wbytes = weight_bytes(engine)
    rss_warm = rss_bytes()
    embed = engine.fwd.embed_w
    out: dict[str, Any] = {
        "model": engine.name,
        "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "layers": engine.num_layers,
        "parameters": parameter_count(engine),
        "weights": engine.weights,
        "weights_in_use": engine.weights_in_use(),
        "kernel": native_mod.kernel_name(),
        # why avx512-bf16 runs or was passed over for avx512-vnni (None: not measured, no AVX512_BF16 here)
        "bf16_dot_speed": native_mod.build.bf16_dot_speed(),
        "native_reason": engine.fwd.native_reason,
        "weight_bytes": wbytes,
        # the embedding table lookups read one row of per token; a tied bf16 head is read from it (no
        # second copy), an int8 or float32 head's panels are a copy beside it
        "embedding_bytes": embed.numel() * embed.element_size(),
        "decode_step": engine.decode_step_in_use(),
        "tokenizer": engine.tokenizer_in_use(),  # with transformers imported or not: part of the RSS
        "resident_ids": engine.resident_ids,
        "context": len(prompts[0]),
        "rss_after_warmup_bytes": rss_warm,
    }
    bound_ms = 1000 * wbytes / (bandwidth_gbs * 1e9) if bandwidth_gbs else None
    cal = engine.calibration
    spec_p = SamplingParams(
        max_tokens=max_tokens,
        exit_layer=cal.exit_layer,
        draft_k=cal.draft_k,
        ignore_eos=True,
        prompt_lookup=False,
        draft=DraftKind.EARLY_EXIT,
    )
    _decode_ms_per_token(engine, prompts[:1], spec_p, 1)
    plain_ms, plain_out = _decode_ms_per_token(engine, prompts, plain_p, repeats)
    spec_ms, spec_out = _decode_ms_per_token(engine, prompts, spec_p, repeats)
    out.update(
        plain_ms_per_token=round(plain_ms, 4),
        bandwidth_bound_ms_per_token=round(bound_ms, 4) if bound_ms else None,
        plain_vs_bound=round(plain_ms / bound_ms, 2) if bound_ms else None,
        early_exit={
            "exit_layer": cal.exit_layer,
            "k": cal.draft_k,
            "ms_per_token": round(spec_ms, 4),
            "gain": round(plain_ms / spec_ms, 3),
            "greedy_identical": spec_out == plain_out,
        },
    )
    log(
        f"  plain {plain_ms:.3f} ms/token (bandwidth bound {bound_ms or float('nan'):.3f}); "
        f"early exit E={cal.exit_layer} K={cal.draft_k}: {spec_ms:.3f} ms/token, identical {spec_out == plain_out}"
    )
    by_k, native_by_k = {}, {}
    seq = engine.new_sequence(len(prompts[0]) + max_k + 2)
    engine.prefill(seq, prompts[0], None)  # once for every K
    for k in range(1, max_k + 1):
        vc = verify_cost(engine, prompts[0], k, repeats=max(10, 4 * repeats), seq=seq)
        by_k[str(k)] = round(vc["ratio"], 3)
        if vc.get("native_ratio") is not None:
            native_by_k[str(k)] = round(vc["native_ratio"], 3)
    out["verify_cost_by_k"] = by_k
    if native_by_k:
        out["native_verify_cost_by_k"] = native_by_k
    log(f"  verify_cost_by_k {by_k}" + (f"; native (one call) {native_by_k}" if native_by_k else ""))
    pf_ms = cold_prefill_ms(engine, prompts[0], repeats)
    out.update(
        prefill_ms=round(pf_ms, 2),
        prefill_tokens_per_s=round(1000 * len(prompts[0]) / pf_ms, 1),
        prefill_ms_per_token=round(pf_ms / len(prompts[0]), 3),
    )
    if engine.prefill_tokens_per_s is not None:  # the rate the engine sizes chunks and suffixes by (measured)
        out["prefill_rate_in_use"] = round(engine.prefill_tokens_per_s, 1)
    log(
        f"  cold prefill of {len(prompts[0])} tokens: {pf_ms:.1f} ms ({out['prefill_tokens_per_s']} tokens/s, "
        f"{out['prefill_ms_per_token']} ms/token)"
    )
    if engine.fwd.native is not None:
        out.update(matmul_arithmetic(engine.fwd.native, max_k, plain_ms))
        log(
            f"  matmul arithmetic alone (weights in cache): {out['matmul_arithmetic_ms_by_rows']} ms by rows; "
            f"÷ a plain step, by K: {out['matmul_arithmetic_vs_plain_by_k']}"
        )
    if sampling:
        sampled: dict[str, dict[str, Any]] = {}
        for name, spec in (("plain", False), (DraftKind.EARLY_EXIT.value, True)):
            p = SamplingParams(
                max_tokens=max_tokens,
                temperature=0.8,
                seed=1,
                speculative=spec,
                ignore_eos=True,
                exit_layer=cal.exit_layer if spec else None,
                draft_k=cal.draft_k if spec else None,
                prompt_lookup=False,
                draft=DraftKind.EARLY_EXIT if spec else None,
            )
            try:
                ms, outs = _decode_ms_per_token(engine, prompts[:2], p, 1)
                sampled[name] = {"ms_per_token": round(ms, 4), "tokens": sum(len(o) for o in outs)}
            except RuntimeError as exc:  # the failure this row exists to catch (a generator on the wrong device)
                sampled[name] = {"error": f"{type(exc).__name__}: {exc}"}
        out["sampling_t0.8"] = sampled
        log(f"  sampling at 0.8: {sampled}")
    return out


def matmul_arithmetic(native, max_k: int, plain_ms: float) -> dict:
    """How long the model's matrix products take at 1..max_k+1 rows as arithmetic alone: each format's
    packed bytes ÷ the rate its kernels consume cache-resident weights at that many rows, on every thread.
    A pass cannot cost less than its arithmetic, however well the stream of weights hides under it, so
    the K row ÷ a plain step is a floor for verify_cost_by_k (attention, norms and argmax left out)."""
    by_format = native.bytes_by_format()
    ms = {
        rows: 1000 * sum(size / native.arithmetic_rate(fmt, rows) for fmt, size in by_format.items())
        for rows in range(1, max_k + 2)
    }
    return {
        "matmul_arithmetic_ms_by_rows": {str(r): round(v, 4) for r, v in ms.items()},
        "matmul_arithmetic_vs_plain_by_k": {str(k): round(ms[k + 1] / plain_ms, 3) for k in range(1, max_k + 1)},
    }


# ----------------------------------------------------------------------------- the llama.cpp peer


def llama_tools(path: Path) -> tuple[Path, Path]:
    """llama-bench and llama-quantize from PATH: the folder holding both, or llama-bench itself (then
    llama-quantize beside it)."""
    path = path.expanduser()
    folder = path if path.is_dir() else path.parent
    bench = path if path.is_file() else folder / "llama-bench"
    quantize = folder / "llama-quantize"
    for tool in (bench, quantize):
        if not (tool.is_file() and os.access(tool, os.X_OK)):
            raise BenchDeviceError(f"{tool} is not an executable (build both with .ci/llama_bench.sh)")
    return bench, quantize


def gguf_files(model_dir: Path, folder: Path, types: list[str], quantize: Path, threads: int, log=print) -> dict:
    """The model as GGUF, one file per llama.cpp type: written by models/to_gguf.py (f32, or bf16 when the
    model's matrices are bf16) and quantised from that by llama-quantize. {type: {path, made_by}}, plus
    the layout the writer used."""
    from completiond.models.to_gguf import architecture, convert

    config = json.loads((model_dir / "config.json").read_text())
    arch = architecture(config)
    written = convert(model_dir, folder / "model.gguf", dtype="auto")
    from gguf import GGUFReader  # the file's own type, as written

    reader = GGUFReader(str(written))
    source_type = "bf16" if any(t.tensor_type.name == "BF16" for t in reader.tensors) else "f32"
    del reader
    files = {}
    for kind in types:
        if kind == source_type:
            files[kind] = {"path": str(written), "made_by": "models/to_gguf.py"}
            continue
        target = folder / f"model-{kind}.gguf"
        cmd = [str(quantize), str(written), str(target), kind.upper()] + ([str(threads)] if threads else [])
        log(f"  llama-quantize to {kind}")
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise BenchDeviceError(f"llama-quantize to {kind} failed ({done.returncode}): {done.stderr[-800:]}")
        files[kind] = {"path": str(target), "made_by": f"llama-quantize from the {source_type} file"}
    layout = "qwen2 (Qwen2 layout: q/k/v biases, rotate-half RoPE)" if arch == "qwen2" else "llama"
    return {"layout": layout, "source_type": source_type, "files": files}


def _llama_json(text: str) -> list[dict]:
    """The result rows of `llama-bench -o json` output."""
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BenchDeviceError(f"llama-bench printed no JSON ({exc}): {text[:300]!r}") from None
    return [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []


def parse_llama_bench(text: str) -> dict:
    """ms per generated token from `llama-bench -o json` output: the median of its samples (each the time of
    one run of n_gen tokens), with the mean llama-bench prints itself."""
    rows = [r for r in _llama_json(text) if r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0]
    if not rows:
        raise BenchDeviceError(f"llama-bench printed no token-generation result: {text[:300]!r}")
    r = rows[0]
    n = int(r["n_gen"])
    samples = [s / n / 1e6 for s in r.get("samples_ns") or [r["avg_ns"]]]
    return {
        "ms_per_token": round(statistics.median(samples), 4),
        "mean_ms_per_token": round(r["avg_ns"] / n / 1e6, 4),
        "samples_ms_per_token": [round(s, 4) for s in samples],
        "n_gen": n,
        "n_depth": r.get("n_depth"),
        "threads": r.get("n_threads"),
        "model_type": r.get("model_type"),
        "model_bytes": r.get("model_size"),
        "build": f"{r.get('build_commit')} ({r.get('build_number')})",
        "cpu": r.get("cpu_info"),
    }


def parse_llama_passes(text: str) -> dict[int, float]:
    """{tokens in the pass: median ms of one pass} from `llama-bench -n 0 -o json` output (its prompt rows:
    each sample the time of one pass over n_prompt new tokens after n_depth cached ones)."""
    passes = {
        int(r["n_prompt"]): round(statistics.median(r.get("samples_ns") or [r["avg_ns"]]) / 1e6, 4)
        for r in _llama_json(text)
        if r.get("n_prompt", 0) > 0 and r.get("n_gen", 0) == 0
    }
    if not passes:
        raise BenchDeviceError(f"llama-bench printed no prompt-processing result: {text[:300]!r}")
    return passes


def run_llama_passes(bench: Path, gguf: str, ks: list[int], context: int, threads: int, repeats: int) -> dict:
    """llama.cpp's pass over K+1 tokens ÷ its pass over one, both after `context` cached tokens, one
    llama-bench call: what verify_cost_by_k measures of ours (a pass over one token is a decode step)."""
    rows = [1] + [k + 1 for k in ks]
    out, cmd = _llama_bench(bench, gguf, ",".join(map(str, rows)), 0, context, threads, repeats)
    ms = parse_llama_passes(out)
    missing = [r for r in rows if r not in ms]
    if missing:
        raise BenchDeviceError(f"llama-bench reported no pass over {missing} tokens: {out[:300]!r}")
    return {
        "pass_ms_by_rows": {str(r): ms[r] for r in rows},
        "pass_cost_by_k": {str(k): round(ms[k + 1] / ms[1], 3) for k in ks},
        "pass_command": cmd,
    }


def run_llama_prefill(bench: Path, gguf: str, context: int, threads: int, repeats: int) -> dict:
    """llama.cpp's prompt processing of `context` tokens into an empty cache (`-p context -n 0 -d 0`): our
    cold prefill's counterpart."""
    out, cmd = _llama_bench(bench, gguf, str(context), 0, 0, threads, repeats)
    ms = parse_llama_passes(out)
    if context not in ms:
        raise BenchDeviceError(f"llama-bench reported no prompt of {context} tokens: {out[:300]!r}")
    return {
        "prefill_ms": ms[context],
        "prefill_tokens_per_s": round(1000 * context / ms[context], 1),
        "prefill_command": cmd,
    }


def _llama_bench(
    bench: Path, gguf: str, prompt: str, gen: int, depth: int, threads: int, repeats: int
) -> tuple[str, str]:
    """One llama-bench run (`-p prompt -n gen -d depth`): its JSON output and the command line."""
    cmd = [
        str(bench),
        "-m",
        gguf,
        "-p",
        prompt,
        "-n",
        str(gen),
        "-d",
        str(depth),
        "-t",
        str(threads),
        "-r",
        str(repeats),
        "-o",
        "json",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise BenchDeviceError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr[-800:]}")
    return done.stdout, " ".join(cmd)


def run_llama_bench(bench: Path, gguf: str, tokens: int, context: int, threads: int, repeats: int) -> dict:
    out, cmd = _llama_bench(bench, gguf, "0", tokens, context, threads, repeats)
    return {**parse_llama_bench(out), "command": cmd}


def llama_peer(model_dir: Path, folder: Path, args: argparse.Namespace, threads: int, log=print) -> dict:
    bench, quantize = llama_tools(args.llama_bench)
    made = gguf_files(model_dir, folder, args.llama_types, quantize, threads, log)
    out = {"layout": made["layout"], "types": {}}
    for kind, f in made["files"].items():
        log(f"  llama-bench {kind}: tg{args.max_tokens} at depth {args.context}, {threads} threads")
        out["types"][kind] = {
            **run_llama_bench(bench, f["path"], args.max_tokens, args.context, threads, args.llama_repeats),
            "made_by": f["made_by"],
        }
        log(f"    {out['types'][kind]['ms_per_token']} ms/token")
        out["types"][kind].update(run_llama_prefill(bench, f["path"], args.context, threads, args.llama_repeats))
        log(f"    cold prefill of {args.context} tokens: {out['types'][kind]['prefill_tokens_per_s']} tokens/s")
        if args.llama_k:
            out["types"][kind].update(
                run_llama_passes(bench, f["path"], args.llama_k, args.context, threads, args.llama_repeats)
            )
            log(
                f"    a pass over K+1 tokens ÷ one, K={','.join(map(str, args.llama_k))}: "
                f"{', '.join(map(str, out['types'][kind]['pass_cost_by_k'].values()))}"
            )
    return out


def compare_with_peer(entry: dict, peer: dict) -> None:
    """Add ours ÷ llama.cpp's ms/token for the peer type that stores weights as our format does, and
    against every type measured (so a reader sees both the like-for-like and the rest)."""
    types = peer.get("types", {})
    ours = entry["plain_ms_per_token"]
    entry["vs_llama_cpp"] = {kind: round(ours / t["ms_per_token"], 3) for kind, t in types.items() if t["ms_per_token"]}
    like = PEER_TYPE.get(entry["weights_in_use"].split()[0] if entry["weights_in_use"] else "")
    if like in types:
        entry["peer"] = {
            "type": like,
            "ms_per_token": types[like]["ms_per_token"],
            "ours_over_peer": entry["vs_llama_cpp"][like],
        }
        if types[like].get("prefill_ms") and entry.get("prefill_ms"):
            entry["peer"]["prefill_tokens_per_s"] = types[like]["prefill_tokens_per_s"]
            entry["peer"]["prefill_ours_over_peer"] = round(entry["prefill_ms"] / types[like]["prefill_ms"], 3)
        theirs = types[like].get("pass_cost_by_k", {})
        if theirs:
            mine = entry["verify_cost_by_k"]  # the figure: the pass as the engine runs it
            entry["peer"]["pass_cost_by_k"] = theirs
            entry["peer"]["verify_cost_by_k"] = {k: mine[k] for k in theirs if k in mine}


# ----------------------------------------------------------------------------- the run


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except BenchDeviceError as exc:
        print(f"completiond bench-device: {exc}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    import torch

    from completiond.engine.checkpoint import CausalLM
    from completiond.engine.engine import Engine, EngineError, pick_device

    log = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    if args.llama_bench is not None:
        llama_tools(args.llama_bench)  # before any model is built: a wrong path fails at once
    device = pick_device(args.device)
    threads = args.threads or int(os.environ.get("COMPLETIOND_THREADS", "0") or 0)
    if device == "cpu" and threads > 0:
        torch.set_num_threads(threads)  # the copy below runs on the threads decoding will have
    threads = threads or torch.get_num_threads()
    bandwidth = copy_bandwidth(device, args.bandwidth_mb)
    result = {
        "device": device,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else device,
        "torch": torch.__version__,
        "threads": threads,
        "copy_bandwidth_gbs": round(bandwidth, 1),
        "context": args.context,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "cuda_graphs": "not built: no captured decode step or verify pass exists yet (issue 11)",
        "models": [],
        "llama_cpp": {},
    }
    log(f"{result['device_name']}: copy bandwidth {bandwidth:.1f} GB/s (read + write), {threads} threads")
    with tempfile.TemporaryDirectory(prefix="completiond-device-") as tmp:
        for name in [m.strip() for m in args.models.split(",") if m.strip()]:
            log(f"{name}:")
            try:
                path, label, vocab = _model_path(name, Path(tmp), args.vocab)
            except (EngineError, OSError) as exc:
                result["models"].append({"model": name, "error": str(exc)})
                log(f"  not measured: {exc}")
                continue
            ours = []
            for weights, reader in [(w, r) for w in args.weights for r in args.reader]:
                gc.collect()
                rss_before = rss_bytes()
                t0 = time.perf_counter()
                try:
                    engine = Engine.load(
                        path if path is not None else name if name != "bundled" else None,
                        device=device,
                        dtype=args.dtype,
                        threads=threads,
                        weights=weights,
                        reader=reader,
                    )
                except (EngineError, ValueError, OSError) as exc:
                    result["models"].append({"model": label, "weights": weights, "reader": reader, "error": str(exc)})
                    log(f"  not measured: {exc}")
                    continue
                load_s = time.perf_counter() - t0
                gc.collect()
                rss_after = rss_bytes()
                engine.name = label
                prompts = context_prompts(engine.tokenizer, args.prompts, args.context)
                log(f"  weights {weights}: loaded in {load_s:.1f} s, {engine.decode_step_in_use()}")
                with torch.inference_mode():
                    entry = report_model(
                        engine,
                        prompts,
                        args.repeats,
                        args.max_tokens,
                        args.max_k,
                        bandwidth,
                        log,
                        sampling=not args.no_sampling,
                    )
                entry.update(
                    vocab=vocab,
                    load_s=round(load_s, 2),
                    rss_before_load_bytes=rss_before,
                    reader=(
                        "completiond (engine/checkpoint.py)" if isinstance(engine.model, CausalLM) else "transformers"
                    ),
                    rss_after_load_bytes=rss_after,
                    rss_load_delta_bytes=rss_after - rss_before if rss_after and rss_before else None,
                )
                if rss_after and rss_before:
                    # the whole process (Python, torch and the model) and what the load added, each ÷ the
                    # weights the step streams
                    entry["rss_vs_weight_bytes"] = round(rss_after / entry["weight_bytes"], 3)
                    entry["rss_delta_vs_weight_bytes"] = round((rss_after - rss_before) / entry["weight_bytes"], 3)
                ours.append(entry)
                result["models"].append(entry)
                del engine
                gc.collect()
                if device == "cuda":
                    torch.cuda.empty_cache()  # between models only: the next one needs the memory
            # llama.cpp after ours, with our engine gone: neither run shares memory or cores with the other
            if args.llama_bench is not None and path is not None:
                folder = Path(tmp) / f"{name}-gguf"
                folder.mkdir(exist_ok=True)
                peer = llama_peer(path, folder, args, threads, log)
                result["llama_cpp"][label] = peer
                shutil.rmtree(folder, ignore_errors=True)  # a 1.5B model is gigabytes per type
                for entry in ours:
                    compare_with_peer(entry, peer)
                    if "peer" in entry:
                        log(
                            f"  weights {entry['weights']}: ours {entry['plain_ms_per_token']} ms/token ÷ llama.cpp "
                            f"{entry['peer']['type']} {entry['peer']['ms_per_token']} = {entry['peer']['ours_over_peer']}"
                        )
                        if "prefill_ours_over_peer" in entry["peer"]:
                            log(
                                f"    cold prefill: ours {entry['prefill_tokens_per_s']} tokens/s, llama.cpp "
                                f"{entry['peer']['prefill_tokens_per_s']} (ms ÷ {entry['peer']['prefill_ours_over_peer']})"
                            )
                        for k, theirs in entry["peer"].get("pass_cost_by_k", {}).items():
                            log(
                                f"    K={k}: a verify pass costs {entry['peer']['verify_cost_by_k'].get(k, '?')} "
                                f"steps here, {theirs} in llama.cpp"
                            )
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_table(result)
    return 0


def _model_path(name: str, tmp: Path, vocab: str) -> tuple[Path | None, str, str]:
    """(directory or None for a hub id, the label reported, which vocabulary) of one --models entry."""
    from completiond.engine.engine import EngineError
    from completiond.models import default_model_dir

    if name in SHAPES:
        size = shape_config(name, vocab)["vocab_size"]
        which = f"{'real' if vocab == 'real' else 'bundled tokenizer'}: {size} tokens"
        # Written by a child process: the allocator of this one would keep the pages of a model's worth of
        # freed tensors, and the RSS measured around the engine's load would count them.
        code = (
            "import sys; from pathlib import Path; from completiond.commands.bench_device import random_model; "
            "random_model(sys.argv[1], Path(sys.argv[2]), sys.argv[3])"
        )
        done = subprocess.run(
            [sys.executable, "-c", code, name, str(tmp / name), vocab], capture_output=True, text=True
        )
        if done.returncode != 0:
            raise BenchDeviceError(f"writing the random {name} failed: {done.stderr[-800:]}")
        return tmp / name, f"{name} (random weights, {size}-token vocabulary)", which
    if name == "bundled":
        return default_model_dir(), "bundled", "bundled tokenizer: 8192 tokens"
    path = Path(name).expanduser()
    if path.is_dir():
        return path, str(path), "the model's own"
    if name.startswith((".", "/", "~")):
        raise EngineError(f"model directory {name} does not exist")
    return None, name, "the model's own"


def _print_table(r: dict) -> None:
    print(
        f"\n{r['device_name']} (torch {r['torch']}, {r['threads']} threads), copy bandwidth "
        f"{r['copy_bandwidth_gbs']} GB/s; context {r['context']}; CUDA graphs: {r['cuda_graphs']}"
    )
    print(
        "| model | weights | plain ms/token | bound ms/token | llama.cpp (type) ms/token | ours ÷ peer | cold prefill "
        "tokens/s (llama.cpp) | RSS delta ÷ weight bytes | early exit ms/token (identical) | verify cost K=1..8 | "
        "its arithmetic floor | sampling 0.8 |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for m in r["models"]:
        if "error" in m:
            print(f"| {m['model']} | {m.get('weights', '')} | not measured: {m['error']} | | | | | | | | | |")
            continue
        ee = m[DraftKind.EARLY_EXIT.value]
        vc = ", ".join(str(v) for v in m.get("native_verify_cost_by_k", m["verify_cost_by_k"]).values())
        floor = ", ".join(str(v) for v in m.get("matmul_arithmetic_vs_plain_by_k", {}).values())
        smp = "; ".join(f"{k}: {v.get('ms_per_token', v.get('error'))}" for k, v in m.get("sampling_t0.8", {}).items())
        peer = m.get("peer")
        peer_cell = f"{peer['ms_per_token']} ({peer['type']})" if peer else ""
        prefill = f"{m.get('prefill_tokens_per_s', '')}" + (
            f" ({peer['prefill_tokens_per_s']})" if peer and "prefill_tokens_per_s" in peer else ""
        )
        print(
            f"| {m['model']} | {m['weights_in_use']} | {m['plain_ms_per_token']} | {m['bandwidth_bound_ms_per_token']} | "
            f"{peer_cell} | {peer['ours_over_peer'] if peer else ''} | {prefill} | {m.get('rss_delta_vs_weight_bytes', '')} | "
            f"{ee['ms_per_token']} ({ee['greedy_identical']}) | {vc} | {floor} | {smp} |"
        )
    for label, peer in r.get("llama_cpp", {}).items():
        kinds = ", ".join(f"{k} {t['ms_per_token']}" for k, t in peer["types"].items())
        print(f"llama.cpp on {label} (GGUF layout {peer['layout']}): {kinds} ms/token")
        for k, t in peer["types"].items():
            if t.get("pass_cost_by_k"):
                costs = ", ".join(f"K={n}: {v}" for n, v in t["pass_cost_by_k"].items())
                print(f"  {k}: a pass over K+1 tokens ÷ a pass over one (verify cost): {costs}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="completiond bench-device", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
