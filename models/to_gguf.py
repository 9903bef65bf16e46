"""Write a Llama-layout model directory with a byte-level BPE tokenizer (the bundled model) as GGUF,
so llama.cpp's server can serve it: the team-backend tests and `completiond bench --typing
--llama-server` run the same model both ways.

Why our own writer and not llama.cpp's converter: that converter identifies the tokenizer by a hash of
its pre-tokenizer output and does not know ours. Our split is GPT-2's (byte-level, GPT-2's regex), so
the file names the `gpt-2` pre-tokenizer; tests/test_backend_remote.py checks that llama.cpp's greedy
output through it is token for token our engine's. Written with the `gguf` package (the GGUF writer
llama.cpp publishes); nothing is copied from llama.cpp.

    python -m completiond.models.to_gguf OUT.gguf [--model DIR]
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


def _unpermute(weight, n_head: int):
    """Hugging Face stores q/k rows per head as [first halves; second halves] (rotate_half RoPE);
    GGUF's llama layout pairs them (x0, x1), (x2, x3)... for its interleaved RoPE. Regroup each head's
    rows: row j of half h goes to 2j + h."""
    rows, cols = weight.shape
    head_dim = rows // n_head
    return weight.reshape(n_head, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def convert(model_dir: Path, out: Path) -> Path:
    """Write `model_dir` as float32 GGUF at `out`. GgufError for what is not supported."""
    import gguf
    import numpy as np
    from safetensors import safe_open

    config = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    if config.get("model_type") != "llama":
        raise GgufError(f"{model_dir}: model_type {config.get('model_type')!r}; this writer handles llama only")
    model = tok.get("model") or {}
    pre = tok.get("pre_tokenizer") or {}
    if model.get("type") != "BPE" or pre.get("type") != "ByteLevel" or not pre.get("use_regex", True):
        raise GgufError(f"{model_dir}: tokenizer is not a byte-level BPE with GPT-2's split")
    n_head = int(config["num_attention_heads"])
    n_kv = int(config.get("num_key_value_heads") or n_head)
    hidden = int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or hidden // n_head)
    rope = config.get("rope_parameters") or {}
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    if rope.get("rope_type", "default") != "default" or config.get("rope_scaling"):
        raise GgufError(f"{model_dir}: only plain RoPE is supported")

    vocab: dict[str, int] = dict(model["vocab"])
    added = {t["content"]: t for t in tok.get("added_tokens", [])}
    for content, t in added.items():
        vocab.setdefault(content, int(t["id"]))
    size = int(config["vocab_size"])
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [gguf.TokenType.UNUSED] * size
    for text, idx in vocab.items():
        if idx < size:
            tokens[idx] = text
            types[idx] = gguf.TokenType.CONTROL if added.get(text, {}).get("special") else gguf.TokenType.NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]

    # llama.cpp reads the file as it is written: the header first, then tensors in this order.
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name(model_dir.name)
    writer.add_context_length(int(config.get("max_position_embeddings", 2048)))
    writer.add_embedding_length(hidden)
    writer.add_block_count(int(config["num_hidden_layers"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-5)))
    writer.add_vocab_size(size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
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

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        names = list(f.keys())
        weights = {name: f.get_tensor(name).float().numpy() for name in names}
    mapping = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
               "lm_head.weight": "output.weight"}
    parts = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name in names:
        data = np.ascontiguousarray(weights[name], dtype=np.float32)
        if name in mapping:
            target = mapping[name]
        else:
            bits = name.split(".")
            part = parts.get(".".join(bits[3:-1])) if bits[:2] == ["model", "layers"] and bits[-1] == "weight" else None
            if part is None:
                raise GgufError(f"{model_dir}: unexpected tensor {name}")
            if part == "attn_q":
                data = np.ascontiguousarray(_unpermute(data, n_head))
            elif part == "attn_k":
                data = np.ascontiguousarray(_unpermute(data, n_kv))
            target = f"blk.{bits[2]}.{part}.weight"
        writer.add_tensor(target, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m completiond.models.to_gguf")
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", type=Path, default=BUNDLED)
    args = parser.parse_args(argv)
    try:
        convert(args.model, args.out)
    except (GgufError, OSError, KeyError, ValueError) as exc:
        print(f"to_gguf: {exc}", file=sys.stderr)
        return 1
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
