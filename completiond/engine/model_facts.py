"""What the engine derives once from a model: its end-of-sequence ids (config, generation config, tokenizer
and the FIM end tokens), and on a CPU its prefill rate, which sizes prefill chunks (and prompt builders the
suffix): estimated from its size, then measured (Engine: a short timed prefill at load, then the real ones).
"""

from __future__ import annotations

from typing import Any

from completiond.models.adapters import Adapter

PREFILL_CHUNK = 256
# A cancelled request, and a background warm-up that a request preempts, let go between prefill chunks: on
# a CPU a chunk is sized to take about PREFILL_CHUNK_S at the rate estimated from the model's size (the
# bundled model keeps PREFILL_CHUNK; the 0.5B shape gets 112). Warm-ups take a quarter of that.
PREFILL_CHUNK_S = 0.5
# The estimate before anything is measured (the size of the load's timed prefill): the 0.5B shape in bf16
# prefilled 245 tokens/s on 2 AVX-512 cores without AMX (2026-12-05/06).
CPU_PREFILL_FLOPS = 2.4e11
# The load's timed prefill: about this long at the estimated rate, within these many tokens (on AMX tiles a
# chunk of 16 rows mostly streams weights, so at least 32: the rate of short chunks sized longer ones too short).
CALIBRATE_S = 0.1
CALIBRATE_TOKENS = (32, 128)
# A real prefill chunk of at least this many tokens moves the measured rate this far towards its own.
MEASURE_MIN_TOKENS = 16
MEASURE_WEIGHT = 0.25


def cpu_prefill(adapter: Adapter, cfg) -> tuple[float, int]:
    """(prefill tokens per second estimated from the model's size, the prefill chunk sized by it) on a CPU."""
    rate = CPU_PREFILL_FLOPS / (2 * max(1, matmul_params(adapter, cfg)))
    return rate, chunk_for(rate)


def chunk_for(rate: float) -> int:
    """The prefill chunk that takes about PREFILL_CHUNK_S at `rate` tokens per second (32..PREFILL_CHUNK)."""
    return max(32, min(PREFILL_CHUNK, int(rate * PREFILL_CHUNK_S) // 16 * 16))


def calibration_tokens(rate: float) -> int:
    """How many tokens the load's timed prefill feeds, at an estimated `rate`."""
    low, high = CALIBRATE_TOKENS
    return max(low, min(high, int(rate * CALIBRATE_S)))


def measure_prefill(engine: Any) -> None:
    """The load's timed prefill (Engine: prefill, new_sequence, max_context, vocab_size, prefill_tokens_per_s)
    on a scratch sequence, nothing cached: a few tokens first (the first pass's one-time costs: rope tables,
    the native library's threads), then about CALIBRATE_S at the estimated rate, which Engine.prefill times
    into the rate that prompt builders and prefill chunks start from."""
    first = min(8, MEASURE_MIN_TOKENS - 1)  # too short to be measured itself
    n = min(calibration_tokens(engine.prefill_tokens_per_s or 0.0), engine.max_context - first - 1)
    if n < MEASURE_MIN_TOKENS:
        return  # a context too short to measure in: the estimate stays
    ids = [(7 * i + 1) % engine.vocab_size for i in range(first + n)]
    seq = engine.new_sequence(len(ids))
    engine.prefill(seq, ids[:first], None, chunk_size=first)
    engine.prefill(seq, ids[first:], None, chunk_size=n)


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
