"""models/to_gguf.py writes Llama and Qwen2 models as GGUF that holds exactly their weights.

Read back with the `gguf` package (no llama.cpp here): every tensor, its name, type and values; the
Qwen2 layout's q/k/v biases; the Llama layout's q/k row regrouping; a vocabulary larger than the
tokenizer padded with unused tokens.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.torch import load_file

from completiond.commands import bench_device
from completiond.models.to_gguf import BUNDLED, GgufError, _unpermute, convert, pre_tokenizer_name

HF_TO_GGUF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if name in fixed:
        return fixed[name]
    bits = name.split(".")
    return f"blk.{bits[2]}.{HF_TO_GGUF['.'.join(bits[3:-1])]}.{bits[-1]}"


def read_back(path):
    """{name: (type name, float32 array in Hugging Face's [rows, cols] order)} and the reader's fields."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    out = {}
    for t in reader.tensors:
        data = np.asarray(t.data)
        if t.tensor_type.name == "BF16":
            bits = data.view(np.uint16).astype(np.uint32) << 16
            data = bits.view(np.float32)
        shape = tuple(int(s) for s in reversed(t.shape))  # GGUF lists dimensions innermost first
        out[t.name] = (t.tensor_type.name, data.reshape(shape))
    return out, reader.fields


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    return bench_device.random_model("tiny-qwen2", tmp_path_factory.mktemp("gguf") / "tiny-qwen2")


def test_qwen2_bf16_holds_every_tensor_exactly(qwen2_dir, tmp_path):
    out = convert(qwen2_dir, tmp_path / "m.gguf", dtype="auto")
    tensors, fields = read_back(out)
    assert fields["general.architecture"].contents() == "qwen2"
    assert fields["general.file_type"].contents() == 32  # MOSTLY_BF16
    source = load_file(str(qwen2_dir / "model.safetensors"))
    assert len(tensors) == len(source)  # tied: no output.weight, the embedding serves as the LM head
    biases = [n for n in tensors if n.endswith(".bias")]
    assert len(biases) == 3 * 4 and all(n.split(".")[2] in ("attn_q", "attn_k", "attn_v") for n in biases)
    for name, value in source.items():
        kind, data = tensors[gguf_name(name)]
        assert kind == ("BF16" if value.dim() == 2 else "F32"), name
        # Qwen2's rotate-half RoPE is llama.cpp's NEOX: q/k rows keep their order, bit for bit
        assert np.array_equal(data, value.float().numpy()), name
        assert value.abs().sum() > 0, name  # random biases: a dropped or zeroed one would show


def test_qwen2_f32(qwen2_dir, tmp_path):
    tensors, fields = read_back(convert(qwen2_dir, tmp_path / "m.gguf", dtype="f32"))
    assert fields["general.file_type"].contents() == 0
    source = load_file(str(qwen2_dir / "model.safetensors"))
    for name, value in source.items():
        kind, data = tensors[gguf_name(name)]
        assert kind == "F32" and np.array_equal(data, value.float().numpy()), name
    assert fields["qwen2.rope.freq_base"].contents() == 1e6  # the shape's theta, not the 10,000 default
    assert fields["qwen2.attention.head_count_kv"].contents() == 2


def test_the_pre_tokenizer_is_named_for_llama_cpp(qwen2_dir, tmp_path):
    """The random Qwen2 model carries Qwen2's split (as Qwen2Tokenizer saves it), the bundled model GPT-2's;
    llama.cpp must be told which, and any other split is refused rather than misnamed."""
    _, fields = read_back(convert(qwen2_dir, tmp_path / "q.gguf", dtype="f32"))
    assert fields["tokenizer.ggml.pre"].contents() == "qwen2"
    _, fields = read_back(convert(BUNDLED, tmp_path / "b.gguf", dtype="f32"))
    assert fields["tokenizer.ggml.pre"].contents() == "gpt-2"
    qwen = json.loads((qwen2_dir / "tokenizer.json").read_text())["pre_tokenizer"]
    assert pre_tokenizer_name(qwen) == "qwen2"
    split = qwen["pretokenizers"][0]
    for other in ({"type": "Metaspace"}, {"type": "ByteLevel", "use_regex": False}, [], "ByteLevel",
                  {"type": "Sequence", "pretokenizers": [{**split, "pattern": {"Regex": r"\w+"}}, qwen["pretokenizers"][1]]},
                  {"type": "Sequence", "pretokenizers": [split, {"type": "ByteLevel", "use_regex": True}]},
                  {"type": "Sequence", "pretokenizers": [split, "ByteLevel"]}, {"type": "Sequence"}):
        assert pre_tokenizer_name(other) is None, other
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in ("model.safetensors", "config.json"):
        (bad / name).write_bytes((qwen2_dir / name).read_bytes())
    tok = json.loads((qwen2_dir / "tokenizer.json").read_text())
    (bad / "tokenizer.json").write_text(json.dumps({**tok, "pre_tokenizer": {"type": "Metaspace"}}))
    with pytest.raises(GgufError, match="GPT-2's or Qwen2's split"):
        convert(bad, tmp_path / "m.gguf")


def test_llama_layout_regroups_q_and_k_rows(tmp_path):
    """The bundled model (Llama): q/k rows regrouped for GGUF's interleaved RoPE, the rest as stored."""
    tensors, fields = read_back(convert(BUNDLED, tmp_path / "m.gguf", dtype="f32"))
    assert fields["general.architecture"].contents() == "llama"
    cfg = json.loads((BUNDLED / "config.json").read_text())
    source = load_file(str(BUNDLED / "model.safetensors"))
    q = source["model.layers.0.self_attn.q_proj.weight"].float()
    k = source["model.layers.0.self_attn.k_proj.weight"].float()
    assert np.array_equal(tensors["blk.0.attn_q.weight"][1], _unpermute(q, cfg["num_attention_heads"]).numpy())
    assert np.array_equal(tensors["blk.0.attn_k.weight"][1], _unpermute(k, cfg["num_key_value_heads"]).numpy())
    assert not np.array_equal(tensors["blk.0.attn_q.weight"][1], q.numpy())
    assert np.array_equal(tensors["blk.0.ffn_up.weight"][1], source["model.layers.0.mlp.up_proj.weight"].float().numpy())
    assert not any(n.endswith(".bias") for n in tensors)


def test_a_vocabulary_larger_than_the_tokenizer_is_padded(tmp_path, monkeypatch):
    """A random model shaped like a real one keeps the real vocabulary's embedding rows; tokens past the
    bundled tokenizer's are unused placeholders."""
    monkeypatch.setitem(bench_device.SHAPES, "wide", {**bench_device.SHAPES["tiny-qwen2"], "vocab_size": 8200})
    model = bench_device.random_model("wide", tmp_path / "wide")
    tensors, fields = read_back(convert(model, tmp_path / "m.gguf", dtype="auto"))
    assert tensors["token_embd.weight"][1].shape == (8200, 64)
    tokens = fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == 8200 and tokens[-1] == "[PAD8199]"
    assert fields["tokenizer.ggml.token_type"].contents()[-1] == 5  # UNUSED


def test_unsupported_models_are_refused(qwen2_dir, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in ("model.safetensors", "tokenizer.json"):
        (bad / name).write_bytes((qwen2_dir / name).read_bytes())
    cfg = json.loads((qwen2_dir / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "mistral"}))
    with pytest.raises(GgufError, match="model_type 'mistral'"):
        convert(bad, tmp_path / "m.gguf")
    with pytest.raises(GgufError, match="dtype 'f16'"):
        convert(qwen2_dir, tmp_path / "m.gguf", dtype="f16")
