"""What the engine derives once from a model: its end-of-sequence ids (config, generation config, tokenizer
and the FIM end tokens), and on a CPU a prefill rate estimated from its size, which sizes prefill chunks.
"""

from __future__ import annotations

from completiond.models.adapters import Adapter

PREFILL_CHUNK = 256
# A cancelled request, and a background warm-up that a request preempts, let go between prefill chunks: on
# a CPU a chunk is sized to take about PREFILL_CHUNK_S at the rate estimated from the model's size (the
# bundled model keeps PREFILL_CHUNK; the 0.5B shape gets 112). Warm-ups take a quarter of that.
PREFILL_CHUNK_S = 0.5
CPU_PREFILL_FLOPS = 2.4e11  # measured: the 0.5B shape in bf16 prefilled 245 tokens/s on 2 AVX-512 cores (2026-12-05/06)


def cpu_prefill(adapter: Adapter, cfg) -> tuple[float, int]:
    """(prefill tokens per second estimated from the model's size, the prefill chunk sized by it) on a CPU."""
    rate = CPU_PREFILL_FLOPS / (2 * max(1, matmul_params(adapter, cfg)))
    return rate, max(32, min(PREFILL_CHUNK, int(rate * PREFILL_CHUNK_S) // 16 * 16))


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
