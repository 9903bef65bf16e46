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
    assert _reads(ours.config) == _reads(theirs.config)


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
    # what the reader takes it reads, small or large, in the dtype asked for; transformers only when asked
    small = Engine.load(d, device="cpu")
    assert isinstance(small.model, checkpoint.CausalLM) and next(small.model.parameters()).dtype == torch.float32
    assert not isinstance(Engine.load(d, device="cpu", reader="transformers").model, checkpoint.CausalLM)
    monkeypatch.setattr(forward, "TRANSPOSED_COPY_LIMIT", 0)
    assert isinstance(Engine.load(d, device="cpu").model, checkpoint.CausalLM)
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


# ------------------------------------------------------------------ the light config and tokenizer
ENGINE_READS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "max_position_embeddings",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "hidden_act")


def _reads(cfg) -> dict:
    """What the engine, its adapter and rope read of a config, the way they read it."""
    out = {k: getattr(cfg, k, None) for k in ENGINE_READS}
    out["head_dim"] = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    out["window"] = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
    rope = getattr(cfg, "rope_parameters", None) or {}
    out["rope"] = (rope.get("rope_type", "default"), float(rope["rope_theta"]))
    return out


# config.json as transformers 4 wrote them for real checkpoints of each family (sizes shrunk)
LEGACY = {
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "bos_token_id": 151643, "eos_token_id": 151643,
              "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 128, "max_position_embeddings": 32768,
              "max_window_layers": 24, "model_type": "qwen2", "num_attention_heads": 4, "num_hidden_layers": 2,
              "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
              "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
              "vocab_size": 151936},
    "llama": {"architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
              "hidden_size": 64, "intermediate_size": 128, "max_position_embeddings": 16384, "model_type": "llama",
              "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 4, "pretraining_tp": 1,
              "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000, "tie_word_embeddings": False,
              "torch_dtype": "bfloat16", "vocab_size": 32016},
    "mistral": {"architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
                "hidden_size": 64, "intermediate_size": 128, "max_position_embeddings": 32768, "model_type": "mistral",
                "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-05,
                "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False, "vocab_size": 32000},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "bos_token_id": 151643, "eos_token_id": 151645,
              "head_dim": 16, "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 128,
              "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
              "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
              "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
              "use_sliding_window": False, "vocab_size": 151936},
}


def _variants(fam: str, saved: dict):
    """config.json variants: as transformers 5 saves it, as transformers 4 did, each defaulted key left out
    in turn, and the keys transformers derives when null."""
    yield "saved", saved
    yield "legacy", LEGACY[fam]
    for k in checkpoint.CONFIG_DEFAULTS[fam]:
        for base_name, base in (("saved", saved), ("legacy", LEGACY[fam])):
            yield f"{base_name} without {k}", {n: v for n, v in base.items() if n != k}
    yield "null derived", {**LEGACY[fam], "num_key_value_heads": None, "head_dim": None}
    yield "window on", {**LEGACY[fam], "use_sliding_window": True, "sliding_window": 1024}


@pytest.mark.parametrize("fam", sorted(FAMILIES))
def test_the_light_config_reads_as_transformers_config_does(tmp_path, fam):
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    saved = json.loads((make_tiny_model(tmp_path / "m", family=fam, layers=2, dtype="bfloat16")
                        / "config.json").read_text())
    d = tmp_path / "c"
    d.mkdir()
    for name, raw in _variants(fam, saved):
        (d / "config.json").write_text(json.dumps(raw))
        try:
            theirs = AutoConfig.from_pretrained(d)
        except StrictDataclassError:
            continue   # a null this family's class refuses: a config transformers cannot load at all
        light = checkpoint.light_config(raw, d)
        assert light is not None, (fam, name)
        assert _reads(light) == _reads(theirs), (fam, name)


def test_the_light_config_stands_aside_where_config_json_does_not_say_enough(tmp_path):
    raw = LEGACY["qwen2"]
    assert checkpoint.light_config(raw, tmp_path) is not None
    for bad in ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, {"model_type": "gpt2"},
                {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}},
                {"rope_parameters": {"rope_theta": 1e6, "partial_rotary_factor": 0.5}},
                {"rope_theta": None}, {"hidden_size": None}, {"vocab_size": "many"}, {"rms_norm_eps": "x"},
                {"num_key_value_heads": 2.5}, {"max_position_embeddings": None}):
        assert checkpoint.light_config({**raw, **bad}, tmp_path) is None, bad
    assert checkpoint.light_config({k: v for k, v in raw.items() if k != "num_hidden_layers"}, tmp_path) is None
    assert checkpoint.light_config({k: v for k, v in raw.items() if k != "rope_theta"}, tmp_path) is None


def test_a_large_llama_checkpoint_loads_without_transformers_model_loading_code(tmp_path):
    """The memory point of the light config: no config class, so none of the modules it drags in."""
    import subprocess
    import sys

    _need_native()
    d = make_tiny_model(tmp_path / "m", family="llama", layers=2, dtype="bfloat16")
    code = ("import sys; from completiond.engine import forward, checkpoint; forward.TRANSPOSED_COPY_LIMIT = 0; "
            "from completiond.engine.engine import Engine; e = Engine.load(sys.argv[1], device='cpu'); "
            "assert isinstance(e.model, checkpoint.CausalLM); "
            "print(sorted(m for m in ('sympy', 'torch.distributed.tensor', 'kernels') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code, str(d)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
