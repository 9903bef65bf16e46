"""engine/checkpoint.py: a large bf16 checkpoint bound for the native CPU step is read without
transformers' model code, and the engine computes exactly what it computes on transformers' modules."""

from __future__ import annotations

import json

import pytest
import torch

from completiond.engine import checkpoint, forward
from completiond.engine.engine import Engine, EngineError, SamplingParams
from completiond.models.tiny import make_tiny_model
from tests.test_native_step import _need_native

QWEN = ["<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|file_sep|>"]
FAMILIES = {"llama": {}, "qwen2": dict(special_tokens=QWEN, tokenizer_class="Qwen2Tokenizer"),
            "qwen3": dict(special_tokens=QWEN, tokenizer_class="Qwen2Tokenizer"), "mistral": {}}


@pytest.fixture(params=sorted(FAMILIES))
def family_model(request, tmp_path):
    fam = request.param
    return fam, make_tiny_model(tmp_path / fam, family=fam, layers=3, seed=11, peaked=True, dtype="bfloat16",
                                tokenizer=FAMILIES[fam] or None)


@torch.inference_mode()
def test_the_reader_holds_transformers_tensors_and_rope_tables(family_model):
    from transformers import AutoModelForCausalLM

    fam, d = family_model
    config = json.loads((d / "config.json").read_text())
    assert checkpoint.eligible(config, d, trust_remote_code=False) is None
    ours = checkpoint.read(d, torch.bfloat16)
    theirs = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
    a, b = dict(ours.named_parameters()), dict(theirs.named_parameters())
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[k], b[k]) for k in a), fam
    pos = torch.arange(5000)[None]
    x = torch.zeros(1, dtype=torch.float32)
    for mine, ref in zip(ours.model.rotary_emb(x, pos), theirs.model.rotary_emb(x, pos)):
        assert torch.equal(mine, ref), fam
    assert ours.config.to_dict() == theirs.config.to_dict()


@torch.inference_mode()
@pytest.mark.parametrize("scaling", [{"rope_type": "linear", "factor": 2.0},
                                     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 256}])
def test_static_rope_scaling_gives_transformers_tables(tmp_path, scaling):
    from transformers import AutoModelForCausalLM

    d = make_tiny_model(tmp_path / "m", layers=2, seed=3, dtype="bfloat16")
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_scaling"] = scaling
    cfg.pop("rope_parameters", None)
    (d / "config.json").write_text(json.dumps(cfg))
    ours = checkpoint.read(d, torch.bfloat16)
    theirs = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
    pos = torch.arange(3000)[None]
    x = torch.zeros(1)
    for mine, ref in zip(ours.model.rotary_emb(x, pos), theirs.model.rotary_emb(x, pos)):
        assert torch.equal(mine, ref)


@torch.inference_mode()
def test_the_engine_reads_large_bf16_checkpoints_itself_with_the_same_output(family_model, monkeypatch):
    _need_native()
    fam, d = family_model
    monkeypatch.setattr(forward, "TRANSPOSED_COPY_LIMIT", 0)
    light = Engine.load(d, device="cpu")
    full = Engine.load(d, device="cpu", reader="transformers")
    assert isinstance(light.model, checkpoint.CausalLM) and not isinstance(full.model, checkpoint.CausalLM)
    assert light.fwd.released and light.fwd.native_all and light.eos_token_ids == full.eos_token_ids
    prompt = list(range(5, 40))
    plain = SamplingParams(max_tokens=16, ignore_eos=True, speculative=False)
    want = full.generate(prompt, plain).tokens
    assert light.generate(prompt, plain).tokens == want, fam
    assert light.generate(prompt, SamplingParams(max_tokens=16, ignore_eos=True, exit_layer=1, draft_k=3)).tokens == want
    assert torch.equal(light.fwd.embed_w, full.fwd.embed_w)


def test_what_the_reader_does_not_take_loads_through_transformers(tmp_path, monkeypatch):
    _need_native()
    d = make_tiny_model(tmp_path / "m", layers=2, seed=5, dtype="bfloat16")
    cfg = json.loads((d / "config.json").read_text())
    assert checkpoint.eligible(cfg, d, trust_remote_code=True) is not None
    assert checkpoint.eligible({**cfg, "hidden_act": "gelu"}, d, False) is not None
    assert checkpoint.eligible({**cfg, "mlp_bias": True}, d, False) is not None
    assert checkpoint.eligible({**cfg, "model_type": "gpt2"}, d, False) is not None
    assert checkpoint.eligible(cfg, tmp_path, False) == "no safetensors weights"
    # a small model keeps transformers' modules (the reader serves packing only)
    assert not isinstance(Engine.load(d, device="cpu").model, checkpoint.CausalLM)
    monkeypatch.setattr(forward, "TRANSPOSED_COPY_LIMIT", 0)
    assert isinstance(Engine.load(d, device="cpu").model, checkpoint.CausalLM)
    # an exit adapter beside the model is built from transformers' layer classes
    (d / "exit_adapter.safetensors").write_bytes(b"not an adapter")
    assert not isinstance(Engine.load(d, device="cpu").model, checkpoint.CausalLM)
    with pytest.raises(EngineError, match="unknown reader"):
        Engine.load(d, device="cpu", reader="fast")


def test_sharded_checkpoints_and_missing_tensors(tmp_path):
    from safetensors.torch import load_file, save_file

    d = make_tiny_model(tmp_path / "m", layers=2, seed=9, dtype="bfloat16")
    w = load_file(d / "model.safetensors")
    names = sorted(w)
    half = len(names) // 2
    parts = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for f, keys in parts.items():
        save_file({k: w[k] for k in keys}, d / f, metadata={"format": "pt"})
    (d / "model.safetensors").unlink()
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, keys in parts.items() for k in keys}}))
    sharded = checkpoint.read(d, torch.bfloat16)
    assert all(torch.equal(p, w[n]) for n, p in sharded.named_parameters())
    # a shard that lost a tensor: a clear error naming it, not a half-built model
    first = next(iter(parts))
    kept = {k: w[k] for k in parts[first] if not k.endswith("post_attention_layernorm.weight")}
    save_file(kept, d / first, metadata={"format": "pt"})
    with pytest.raises(EngineError, match="post_attention_layernorm"):
        checkpoint.read(d, torch.bfloat16)
    # a shard that is not safetensors at all
    (d / first).write_bytes(b"\x00" * 64)
    with pytest.raises(EngineError, match="not a readable safetensors file"):
        checkpoint.read(d, torch.bfloat16)
    # an index this reader cannot trust leaves the checkpoint to transformers
    cfg = json.loads((d / "config.json").read_text())
    for bad in ("{", json.dumps({"weight_map": {"a": "../outside.safetensors"}}), json.dumps({"nothing": 1}),
                json.dumps({"weight_map": {}})):
        (d / "model.safetensors.index.json").write_text(bad)
        assert checkpoint.eligible(cfg, d, False) == "no safetensors weights"
