"""What the engine derives once from a model: its end-of-sequence ids (config, generation config, tokenizer
and the FIM end tokens), and on a CPU its planning rate, which sizes prefill chunks (and prompt builders the
suffix): from its size and how this machine runs its prefill, never from a clock.
"""

from __future__ import annotations

import math
from typing import Any

from completiond.models.adapters import Adapter

PREFILL_CHUNK = 256
# A cancelled request, and a background warm-up that a request preempts, let go between prefill chunks: on
# a CPU a chunk is sized to take about PREFILL_CHUNK_S at the planning rate below (the bundled model and the
# 0.5B shape get PREFILL_CHUNK: 0.15-0.3 s at the 0.5B shape's rates). Warm-ups take a quarter of that, and
# look again between WARM_SLICES parts of its layers: a request waited for a whole warm-up chunk in flight
# (64 tokens, about 70 ms at the 0.5B shape in int8 without AMX), now for a part of one.
PREFILL_CHUNK_S = 0.5
WARM_SLICES = 4
# On a CPU, at least as many parts as keep each to about WARM_SLICE_S at the planning rate (warm_slices): four
# parts of the 0.5B shape's 64-token chunk took ~18 ms each in int8 on 2 cores, and a jump that preempted a
# warm-up waited ~15 ms for its part; the bundled model keeps four parts of about 1 ms.
WARM_SLICE_S = 0.005
# The CPU's planning rate: what a prefill token costs, from the model's size and the way this machine runs
# its prefill, never from a clock. Prompt builders size the suffix by it and prefill chunks follow it, so a
# process started (or running) under load lays out the same prompts and splits them the same way as a
# quiet one: a moved layout changed suggestions between runs and cost reuse (issue 44's cobra runs).
# Prefill arithmetic per thread, FLOP/s, by path: the 0.5B shape's cold prefill of 1,024 tokens, 2 threads,
# quiet (bench-device; 2026-12-06 on AMX tiles, 2026-12-07 on AVX512_BF16 without AMX). Kernels without bf16
# dot products do half the bf16 work per instruction, AVX2 half again; PyTorch's GEMM (small models, fp32,
# where no native step is bound) is the 2026-12-05 figure.
PREFILL_FLOPS_PER_THREAD: dict[tuple[str, str], float] = {
    ("avx512-amx", "int8"): 8.7e11,
    ("avx512-amx", "bf16"): 6.0e11,
    ("avx512-bf16", "int8"): 4.4e11,
    ("avx512-bf16", "bf16"): 3.9e11,
    ("avx512-vnni", "int8"): 4.4e11,
    ("avx512-vnni", "bf16"): 2.0e11,
    ("avx512", "int8"): 2.0e11,
    ("avx512", "bf16"): 2.0e11,
    ("avx2-vnni", "int8"): 2.2e11,
    ("avx2-vnni", "bf16"): 1.0e11,
    ("avx2", "int8"): 1.0e11,
    ("avx2", "bf16"): 1.0e11,
}
TORCH_PREFILL_FLOPS_PER_THREAD = 1.2e11
# The load's warm-up prefill (warm_prefill): a short pass and a long one.
WARM_TOKENS = 40


def cpu_prefill(adapter: Adapter, cfg, kernel: str | None, weights: str, threads: int) -> tuple[float, int]:
    """(the planning rate in prefill tokens per second, the prefill chunk sized by it) on a CPU: `kernel` is
    the native build that runs prefill chunks (None: PyTorch's GEMM), `weights` its weight format setting,
    `threads` the configured thread count (not the momentary one, which follows the machine's load)."""
    if kernel is None:
        per_thread = TORCH_PREFILL_FLOPS_PER_THREAD
    else:
        per_thread = PREFILL_FLOPS_PER_THREAD.get(
            (kernel, "int8" if weights == "int8" else "bf16"), TORCH_PREFILL_FLOPS_PER_THREAD
        )
    rate = per_thread * max(1, threads) / (2 * max(1, matmul_params(adapter, cfg)))
    return rate, chunk_for(rate)


def warm_slices(chunk: int, rate: float | None, layers: int) -> int:
    """Parts of its layers a warm-up chunk of `chunk` tokens runs in (it looks at its cancel token between them):
    WARM_SLICES, or on a CPU (a planning `rate` in tokens per second) enough to keep each to about WARM_SLICE_S,
    one layer a part at most."""
    if not rate or rate <= 0:
        return min(WARM_SLICES, max(1, layers))
    return max(1, min(max(1, layers), max(WARM_SLICES, math.ceil(chunk / rate / WARM_SLICE_S))))


def chunk_for(rate: float) -> int:
    """The prefill chunk that takes about PREFILL_CHUNK_S at `rate` tokens per second (32..PREFILL_CHUNK)."""
    return max(32, min(PREFILL_CHUNK, int(rate * PREFILL_CHUNK_S) // 16 * 16))


def warm_prefill(engine: Any) -> None:
    """One short prefill at load on a scratch sequence, nothing cached, so the first request does not pay the
    first pass's one-time costs (rope tables, the native library's threads)."""
    n = min(WARM_TOKENS, engine.max_context - 1)
    if n < 2:
        return
    ids = [(7 * i + 1) % engine.vocab_size for i in range(n)]
    seq = engine.new_sequence(n)
    engine.prefill(seq, ids[:8], None, chunk_size=8)  # a short pass (the native step's rows), then a long one
    engine.prefill(seq, ids[8:], None, chunk_size=n)


def matmul_params(adapter: Adapter, cfg) -> int:
    """Weights a token's pass multiplies by: the layers' projections and the LM head (what prefill costs)."""
    d = int(getattr(cfg, "hidden_size", 0) or 0)
    inter = int(getattr(cfg, "intermediate_size", 0) or 4 * d)
    heads = int(getattr(cfg, "num_attention_heads", 0) or 1)
    q = heads * adapter.head_dim
    kv = 2 * adapter.num_kv_heads * adapter.head_dim
    vocab = int(getattr(cfg, "vocab_size", 0) or 0)
    return adapter.num_layers * (d * (q + kv) + q * d + 3 * d * inter) + vocab * d


def eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        if eos is None:
            continue
        ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    # FIM-trained models end the middle with one of these.
    for name in (
        "<|endoftext|>",
        "<|fim_pad|>",
        "<EOT>",
        "▁<EOT>",
        "<｜end▁of▁sentence｜>",
        "<|file_sep|>",
        "<file_sep>",
    ):
        tid = tokenizer.convert_tokens_to_ids(name)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid >= 0:
            ids.add(tid)
    return ids
