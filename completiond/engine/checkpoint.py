"""A decoder of the Llama layout read straight from its safetensors, without transformers' model code.

Why: the engine runs its own Forward over fused copies of the weights (and the CPU native step over its own
packed panels), so transformers' modeling classes would serve only as containers; importing them costs about
160 MB of resident memory (torch.distributed, torch._dynamo and sympy come with them: the bundled model's
load went from 472 to 308 MB, 2026-12-06) and seconds of every start, for nothing the engine uses.
The modules here have the attribute layout adapters.adapter_for reads (model.model.{embed_tokens,
layers, norm, rotary_emb}, model.lm_head) and the parameter names of transformers' modules (an exit
adapter's layer is a copy of one), hold the checkpoint's tensors in the dtype asked for, and compute rope
tables exactly as transformers' rotary modules do. They have no forward pass of their own: the engine runs
its Forward over them (tests compare with transformers' models loaded on their own, tests/conftest.py
hf_model). Engine.load uses them for every checkpoint they can stand in for (`eligible`), whatever its
dtype; anything else (remote code, another layout) loads through transformers as before, and so does a load
with reader="transformers" (the training commands, which run transformers' forward pass).

Its config avoids transformers' config classes too: importing any of them imports the model loading code
(torch.distributed, sympy, kernels: about 55 MB more). `light_config` stands in for the config class where
config.json says all the engine reads (the tokenizer: engine/tokenizer.py).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from completiond.engine.hub_cache import read_json
from completiond.engine.tokenizer import quiet_transformers
from completiond.errors import EngineError
from completiond.models.adapters import FAMILIES  # the Llama tensor names; True: q_norm/k_norm per head

if TYPE_CHECKING:
    from transformers import GenerationConfig


def eligible(config: dict, directory: Path, trust_remote_code: bool) -> str | None:
    """None when the checkpoint can be read here, else why not (then transformers loads it)."""
    if trust_remote_code:
        return "trust_remote_code asks for the model's own code"
    family = config.get("model_type")
    if family not in FAMILIES:
        return f"model type {family!r}"
    if str(config.get("hidden_act", "silu")) != "silu":
        return f"activation {config.get('hidden_act')!r}"
    if config.get("mlp_bias"):
        return "MLP biases"
    if not _weight_files(directory):
        return "no safetensors weights"
    return None


def _weight_files(directory: Path) -> list[Path]:
    """The checkpoint's safetensors files; none for an index this reader cannot trust (a malformed one,
    or shard names that leave the directory): transformers' load then reports what is wrong."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(read_json(index)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return []
        if not names or any(not isinstance(n, str) or "/" in n or "\\" in n or n.startswith(".") for n in names):
            return []
        return [directory / n for n in names]
    single = directory / "model.safetensors"
    return [single] if single.is_file() else []


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.variance_epsilon = eps


class Rotary(nn.Module):
    """cos, sin of positions as transformers' rotary modules compute them (Forward.rope reads it)."""

    inv_freq: torch.Tensor  # a buffer (register_buffer)

    def __init__(self, config: Any):
        super().__init__()
        params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        kind = params.get("rope_type") or params.get("type") or "default"
        if kind == "default":
            base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
            scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            if kind not in ROPE_INIT_FUNCTIONS:
                raise EngineError(f"rope type {kind!r} is unknown to this transformers")
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = scaling

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # one product per element, as transformers' matmul of [d/2, 1] by [1, P] is: the same bits
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)  # [1, P, hd]
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def _linear(w: torch.Tensor, b: torch.Tensor | None) -> nn.Linear:
    lin = nn.Linear.__new__(nn.Linear)  # not __init__: no weights to allocate and initialise, the checkpoint's are used
    nn.Module.__init__(lin)
    lin.in_features, lin.out_features = w.shape[1], w.shape[0]
    # a tied head shares the embedding's Parameter itself, so parameters() counts it once
    lin.weight = w if isinstance(w, nn.Parameter) else nn.Parameter(w, requires_grad=False)
    if b is None:
        lin.register_parameter("bias", None)  # as nn.Linear(bias=False) records it
    else:
        lin.bias = nn.Parameter(b, requires_grad=False)
    return lin


class Attention(nn.Module):
    def __init__(self, t: dict, p: str, qk_norm: bool, eps: float, head_dim: int):
        super().__init__()
        for n in ("q", "k", "v", "o"):
            setattr(self, f"{n}_proj", _linear(t.pop(f"{p}{n}_proj.weight"), t.pop(f"{p}{n}_proj.bias", None)))
        if qk_norm:
            self.q_norm = RMSNorm(t.pop(f"{p}q_norm.weight"), eps)
            self.k_norm = RMSNorm(t.pop(f"{p}k_norm.weight"), eps)
        self.scaling = head_dim**-0.5


class MLP(nn.Module):
    def __init__(self, t: dict, p: str):
        super().__init__()
        for n in ("gate", "up", "down"):
            setattr(self, f"{n}_proj", _linear(t.pop(f"{p}{n}_proj.weight"), None))
        self.act_fn = nn.SiLU()


class Layer(nn.Module):
    def __init__(self, t: dict, i: int, qk_norm: bool, eps: float, head_dim: int):
        super().__init__()
        p = f"model.layers.{i}."
        self.input_layernorm = RMSNorm(t.pop(p + "input_layernorm.weight"), eps)
        self.self_attn = Attention(t, p + "self_attn.", qk_norm, eps, head_dim)
        self.post_attention_layernorm = RMSNorm(t.pop(p + "post_attention_layernorm.weight"), eps)
        self.mlp = MLP(t, p + "mlp.")


class Decoder(nn.Module):
    def __init__(self, t: dict, config: Any, qk_norm: bool):
        super().__init__()
        eps = float(config.rms_norm_eps)
        hd = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        emb = t.pop("model.embed_tokens.weight")
        self.embed_tokens = nn.Embedding.from_pretrained(emb, freeze=True)
        self.layers = nn.ModuleList(Layer(t, i, qk_norm, eps, hd) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(t.pop("model.norm.weight"), eps)
        self.rotary_emb = Rotary(config)


class CausalLM(nn.Module):
    """What adapters.adapter_for and the engine read of a transformers causal LM, and nothing else."""

    def __init__(self, t: dict, config: Any, generation_config: Any = None):
        super().__init__()
        self.config = config
        self.generation_config = generation_config
        self.model = Decoder(t, config, FAMILIES[config.model_type])
        head = t.pop("lm_head.weight", None)
        if head is None:
            if not getattr(config, "tie_word_embeddings", False):
                raise EngineError(
                    "the checkpoint has no lm_head.weight and its config does not tie it to the embedding"
                )
            head = self.model.embed_tokens.weight
        self.lm_head = _linear(head, None)
        if t:
            raise EngineError(f"the checkpoint has tensors this reader does not place: {', '.join(sorted(t)[:5])}")


def read(directory: Path, dtype: torch.dtype, raw: dict | None = None) -> CausalLM:
    """The model in `directory`, its tensors in dtype (a bf16 checkpoint read as bf16 stays as stored).
    raw: config.json as read already (else read here)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if raw is None:
        raw = read_json(directory / "config.json")
    config = light_config(raw, directory)
    generation: SimpleNamespace | GenerationConfig | None
    if config is not None:
        generation = _generation_config(directory)
    else:
        quiet_transformers()
        from transformers import AutoConfig, GenerationConfig

        config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
        try:
            generation = GenerationConfig.from_pretrained(str(directory), local_files_only=True)
        except OSError:
            generation = None  # no generation_config.json: config.json's ids decide
    # as from_pretrained records it: the dtype the weights were loaded in
    setattr(config, "dtype" if hasattr(config, "dtype") or isinstance(config, LightConfig) else "torch_dtype", dtype)
    tensors: dict[str, torch.Tensor] = {}
    for f in _weight_files(directory):
        try:
            part = load_file(str(f))
        except (SafetensorError, OSError) as exc:
            raise EngineError(f"{f}: not a readable safetensors file ({exc})") from None
        for k, v in part.items():
            tensors[k] = v if v.dtype == dtype else v.to(dtype)
    try:
        return CausalLM(tensors, config, generation)
    except KeyError as exc:
        raise EngineError(f"{directory}: the checkpoint lacks the tensor {exc.args[0]}") from None


def config_errors() -> tuple[type[BaseException], ...]:
    """The errors a load raises for a bad config value or weights file: ValueError, huggingface_hub's
    StrictDataclassError (a value of the wrong type, as transformers' config classes check) once transformers
    has loaded it, safetensors' SafetensorError (a header with shapes whose size overflows, negative or
    malformed), and RecursionError and OverflowError (JSON nested too deeply, sizes past any integer)."""
    from safetensors import SafetensorError

    errors = sys.modules.get("huggingface_hub.errors")
    return (ValueError, SafetensorError, RecursionError, OverflowError) + (
        (errors.StrictDataclassError,) if errors is not None else ()
    )


# ------------------------------------------------------------------ config and tokenizer, light
# What transformers' config classes fill in for a key that config.json leaves out, for each key the engine
# reads (tests compare every entry with the installed transformers). None: derived as the class derives it.
# A key the engine reads that is neither in config.json nor here keeps light_config from standing in.
_COMMON = {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "num_key_value_heads": None, "pad_token_id": None}
CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {**_COMMON, "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2, "head_dim": None},
    "mistral": {
        **_COMMON,
        "max_position_embeddings": 4096 * 32,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "num_key_value_heads": 8,
        "head_dim": None,
        "sliding_window": 4096,
    },
    "qwen2": {
        **_COMMON,
        "max_position_embeddings": 32768,
        "bos_token_id": None,
        "eos_token_id": None,
        "num_key_value_heads": 32,
        "use_sliding_window": False,
        "sliding_window": 4096,
    },
    "qwen3": {
        **_COMMON,
        "max_position_embeddings": 32768,
        "bos_token_id": None,
        "eos_token_id": None,
        "num_key_value_heads": 32,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "head_dim": 128,
    },
}
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


class LightConfig(SimpleNamespace):
    """config.json as attributes, with what the family's transformers config class derives from it."""

    def to_dict(self) -> dict:
        return dict(vars(self))


def light_config(raw: dict, directory: Path) -> LightConfig | None:
    """A stand-in for transformers' config of this model, or None when config.json does not say enough
    (then AutoConfig reads it): a family of FAMILIES, the sizes given, and the default rope (scaled rope
    tables come from transformers' own functions, which take its config)."""
    family = raw.get("model_type")
    if family not in CONFIG_DEFAULTS or any(not isinstance(raw.get(k), int) for k in _REQUIRED):
        return None
    if "rope_parameters" in raw:
        rope = raw["rope_parameters"]
        if not isinstance(rope, dict) or set(rope) - {"rope_type", "rope_theta"}:
            return None
        kind, theta = rope.get("rope_type", "default"), rope.get("rope_theta")
    else:
        kind, theta = ("default" if raw.get("rope_scaling") is None else "scaled"), raw.get("rope_theta")
    if kind != "default" or not isinstance(theta, (int, float)):
        return None
    c = {**CONFIG_DEFAULTS[family], **raw}
    if c["num_key_value_heads"] is None:
        c["num_key_value_heads"] = c["num_attention_heads"]
    if "head_dim" in c and c["head_dim"] is None:
        c["head_dim"] = c["hidden_size"] // c["num_attention_heads"]
    if "use_sliding_window" in c and not c["use_sliding_window"]:
        c["sliding_window"] = None  # Qwen: a window only where use_sliding_window says so
    sizes = ("num_key_value_heads", "max_position_embeddings") + (("head_dim",) if "head_dim" in c else ())
    flags = [c[k] for k in ("tie_word_embeddings", "use_sliding_window") if k in c]
    ids = [c[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")]
    if (
        any(not isinstance(c[k], int) for k in sizes)
        or not isinstance(c["rms_norm_eps"], (int, float))
        or any(not isinstance(f, bool) for f in flags)
        or not all(i is None or isinstance(i, int) or (isinstance(i, list) and _all_ints(i)) for i in ids)
        or not (c.get("sliding_window") is None or isinstance(c["sliding_window"], int))
    ):
        return None  # transformers' config class reports what is wrong
    c["rope_parameters"] = {"rope_type": "default", "rope_theta": float(theta)}
    c.pop("rope_scaling", None)
    c.pop("rope_theta", None)
    c["_name_or_path"] = str(directory)
    return LightConfig(**c)


def _all_ints(values: list) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) for v in values)


def _generation_config(directory: Path) -> SimpleNamespace | None:
    """generation_config.json's token ids (all the engine reads of it), or None without one."""
    path = directory / "generation_config.json"
    if not path.is_file():
        return None
    try:
        data = read_json(path)
    except (OSError, ValueError) as exc:
        raise EngineError(f"{path}: unreadable ({exc})") from None
    if not isinstance(data, dict):
        raise EngineError(f"{path}: not a JSON object")
    return SimpleNamespace(**{k: data.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")})
