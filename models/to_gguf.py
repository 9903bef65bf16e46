"""Write a Llama- or Qwen2-layout model directory with a byte-level BPE tokenizer (the bundled model, or
a random model shaped like a real one) as GGUF, so llama.cpp can run it: the team-backend tests and
`completiond bench --typing --llama-server` serve the same model both ways, and `completiond bench-device
--llama-bench` measures llama.cpp on the same random weights as our engine.

Why our own writer and not llama.cpp's converter: that converter identifies the tokenizer by a hash of
its pre-tokenizer output and does not know ours. Our split is GPT-2's (byte-level, GPT-2's regex), so
the file names the `gpt-2` pre-tokenizer (a Qwen2 tokenizer's split, as bench-device's random Qwen2 models
carry it, is named `qwen2`); tests/test_backend_remote.py checks that llama.cpp's greedy
output through it is token for token our engine's. Written with the `gguf` package (the GGUF writer
llama.cpp publishes); nothing is copied from llama.cpp.

    python -m completiond.models.to_gguf OUT.gguf [--model DIR] [--dtype f32|bf16|auto]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from completiond.errors import CompletionError

BUNDLED = Path(__file__).resolve().parent / "completiond-py-mini"

# Our FIM / separator tokens, by the GGUF keys llama.cpp's /infill reads.
_FIM_KEYS = (("FIM_PRE_ID", "<|fim_prefix|>"), ("FIM_SUF_ID", "<|fim_suffix|>"), ("FIM_MID_ID", "<|fim_middle|>"),
             ("FIM_PAD_ID", "<|fim_pad|>"), ("FIM_SEP_ID", "<|file_sep|>"))


class GgufError(CompletionError):
    """A model this writer cannot express as GGUF."""


# Qwen2's split as its tokenizer.json states it (Qwen2.5's files, and what transformers' Qwen2Tokenizer saves);
# llama.cpp's `qwen2` pre-tokenizer runs the same expression.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")


def pre_tokenizer_name(pre: dict) -> str | None:
    """llama.cpp's name for a byte-level pre-tokenizer of tokenizer.json (`gpt-2`, `qwen2`), None for another."""
    if not isinstance(pre, dict):
        return None
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"   # ByteLevel's own regex is GPT-2's
    parts = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if (isinstance(parts, list) and len(parts) == 2 and all(isinstance(p, dict) for p in parts)
            and parts[0].get("type") == "Split"
            and parts[0].get("pattern") == {"Regex": QWEN2_SPLIT} and parts[0].get("behavior") == "Isolated"
            and not parts[0].get("invert") and parts[1].get("type") == "ByteLevel" and not parts[1].get("use_regex")):
        return "qwen2"
    return None


def _unpermute(weight, n_head: int):
    """Hugging Face stores q/k rows per head as [first halves; second halves] (rotate_half RoPE);
    GGUF's llama layout pairs them (x0, x1), (x2, x3)... for its interleaved RoPE. Regroup each head's
    rows: row j of half h goes to 2j + h."""
    rows, cols = weight.shape
    head_dim = rows // n_head
    return weight.reshape(n_head, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(rows, cols)


# The Hugging Face model types this writer knows, and the GGUF architecture each becomes. Qwen2 is Llama's
# layout plus biases on q/k/v and rotate-half ("NEOX") RoPE, which llama.cpp's qwen2 architecture applies
# as Hugging Face does: its q/k rows keep their order.
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}
DTYPES = ("auto", "f32", "bf16")


def architecture(config: dict) -> str:
    """The GGUF architecture a model's config.json is written as (GgufError for others)."""
    model_type = config.get("model_type")
    arch = ARCHITECTURES.get(model_type) if isinstance(model_type, str) else None
    if arch is None:
        raise GgufError(f"model_type {model_type!r}; this writer handles {', '.join(ARCHITECTURES)}")
    return arch


def convert(model_dir: Path, out: Path, dtype: str = "f32") -> Path:
    """Write `model_dir` (a Llama or Qwen2 model) as GGUF at `out`. GgufError for what is not supported.

    dtype: f32 writes every tensor as float32; bf16 writes the matrices as bf16 (rounded to nearest even
    where they are not bf16 already) and the vectors (norms, biases) as float32, as llama.cpp's own
    converter does; auto is bf16 when every stored matrix is bf16 (so the file is exact and half the
    size), else f32."""
    import gguf
    import numpy as np
    import torch
    from safetensors import safe_open

    if dtype not in DTYPES:
        raise GgufError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    config = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    try:
        arch = architecture(config)
    except GgufError as exc:
        raise GgufError(f"{model_dir}: {exc}") from None
    model = tok.get("model") or {}
    split = pre_tokenizer_name(tok.get("pre_tokenizer") or {})
    if model.get("type") != "BPE" or split is None:
        raise GgufError(f"{model_dir}: tokenizer is not a byte-level BPE with GPT-2's or Qwen2's split")
    n_head = int(config["num_attention_heads"])
    n_kv = int(config.get("num_key_value_heads") or n_head)
    hidden = int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or hidden // n_head)
    rope = config.get("rope_parameters") or {}
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    if rope.get("rope_type", "default") != "default" or config.get("rope_scaling"):
        raise GgufError(f"{model_dir}: only plain RoPE is supported")
    if arch == "qwen2" and config.get("use_sliding_window"):
        raise GgufError(f"{model_dir}: sliding-window attention is not supported")

    vocab: dict[str, int] = dict(model["vocab"])
    added = {t["content"]: t for t in tok.get("added_tokens", [])}
    for content, t in added.items():
        vocab.setdefault(content, int(t["id"]))
    size = int(config["vocab_size"])
    # A vocabulary larger than the tokenizer's (a random model shaped like a real one, written with the
    # bundled tokenizer) is padded with unused tokens: the file then has the real shape's embedding rows.
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [gguf.TokenType.UNUSED] * size
    for text, idx in vocab.items():
        if idx < size:
            tokens[idx] = text
            types[idx] = gguf.TokenType.CONTROL if added.get(text, {}).get("special") else gguf.TokenType.NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        names = list(f.keys())
        if dtype == "auto":
            matrices = [f.get_slice(name).get_dtype() for name in names if len(f.get_slice(name).get_shape()) == 2]
            dtype = "bf16" if matrices and all(d == "BF16" for d in matrices) else "f32"

        # llama.cpp reads the file as it is written: the header first, then tensors in this order.
        writer = gguf.GGUFWriter(str(out), arch)
        writer.add_name(model_dir.name)
        writer.add_context_length(int(config.get("max_position_embeddings", 2048)))
        writer.add_embedding_length(hidden)
        writer.add_block_count(int(config["num_hidden_layers"]))
        writer.add_feed_forward_length(int(config["intermediate_size"]))
        writer.add_head_count(n_head)
        writer.add_head_count_kv(n_kv)
        writer.add_rope_dimension_count(head_dim)
        writer.add_rope_freq_base(theta)
        writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-5 if arch == "llama" else 1e-6)))
        writer.add_vocab_size(size)
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16 if dtype == "bf16" else gguf.LlamaFileType.ALL_F32)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(split)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        for key, value in (("bos", config.get("bos_token_id")), ("eos", config.get("eos_token_id")),
                           ("pad", config.get("pad_token_id"))):
            if isinstance(value, int):
                getattr(writer, f"add_{key}_token_id")(value)
        writer.add_add_bos_token(False)  # the bundled model was trained without a BOS
        for key, text in _FIM_KEYS:
            if text in vocab:
                writer.add_uint32(getattr(gguf.Keys.Tokenizer, key), vocab[text])

        mapping = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                   "lm_head.weight": "output.weight"}
        parts = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                 "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}
        biased = ("attn_q", "attn_k", "attn_v") if arch == "qwen2" else ()
        for name in names:
            if name in mapping:
                target = mapping[name]
            else:
                bits = name.split(".")
                part = parts.get(".".join(bits[3:-1])) if bits[:2] == ["model", "layers"] else None
                if part is None or not (bits[-1] == "weight" or (bits[-1] == "bias" and part in biased)):
                    raise GgufError(f"{model_dir}: unexpected tensor {name}")
                target = f"blk.{bits[2]}.{part}.{bits[-1]}"
            tensor = f.get_tensor(name)
            if arch == "llama" and target.endswith((".attn_q.weight", ".attn_k.weight")):
                tensor = _unpermute(tensor, n_head if ".attn_q." in target else n_kv)
            if dtype == "bf16" and tensor.dim() == 2:
                # bf16 has no numpy dtype: its bits travel as uint16, tagged BF16 for the writer.
                bits16 = tensor.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)
                writer.add_tensor(target, bits16, raw_dtype=gguf.GGMLQuantizationType.BF16)
            else:
                writer.add_tensor(target, np.ascontiguousarray(tensor.float().numpy(), dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m completiond.models.to_gguf")
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", type=Path, default=BUNDLED)
    parser.add_argument("--dtype", choices=DTYPES, default="f32",
                        help="f32 (default), bf16 (matrices), or auto: bf16 when the stored matrices are bf16")
    args = parser.parse_args(argv)
    try:
        convert(args.model, args.out, args.dtype)
    except (GgufError, OSError, KeyError, ValueError) as exc:
        print(f"to_gguf: {exc}", file=sys.stderr)
        return 1
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
