"""A decoder of the Llama layout read straight from its safetensors, without transformers' model code.

Why: the CPU native step keeps its own packed copy of every matrix, so transformers' modeling classes
serve only as containers there; importing them costs about 80 MB of resident memory (torch.distributed,
torch._dynamo and sympy come with them), 0.08x of a 0.5B model's weights, for nothing the step uses.
The modules here have the attribute layout adapters.adapter_for reads (model.model.{embed_tokens,
layers, norm, rotary_emb}, model.lm_head), hold the checkpoint's tensors as they are stored, and
compute rope tables exactly as transformers' rotary modules do. They have no forward pass of their
own: the engine runs its Forward over them. Engine.load uses them only for what they can stand in for
(`eligible`); anything else loads through transformers as before.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from completiond.errors import EngineError
from completiond.models.adapters import FAMILIES   # the Llama tensor names; True: q_norm/k_norm per head


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
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
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
        emb = torch.cat((freqs, freqs), dim=-1)                       # [1, P, hd]
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def _linear(w: torch.Tensor, b: torch.Tensor | None) -> nn.Linear:
    lin = nn.Linear.__new__(nn.Linear)   # not __init__: no weights to allocate and initialise, the checkpoint's are used
    nn.Module.__init__(lin)
    lin.in_features, lin.out_features = w.shape[1], w.shape[0]
    # a tied head shares the embedding's Parameter itself, so parameters() counts it once
    lin.weight = w if isinstance(w, nn.Parameter) else nn.Parameter(w, requires_grad=False)
    lin.bias = None if b is None else nn.Parameter(b, requires_grad=False)
    return lin


class Attention(nn.Module):
    def __init__(self, t: dict, p: str, qk_norm: bool, eps: float, head_dim: int):
        super().__init__()
        for n in ("q", "k", "v", "o"):
            setattr(self, f"{n}_proj", _linear(t.pop(f"{p}{n}_proj.weight"), t.pop(f"{p}{n}_proj.bias", None)))
        if qk_norm:
            self.q_norm = RMSNorm(t.pop(f"{p}q_norm.weight"), eps)
            self.k_norm = RMSNorm(t.pop(f"{p}k_norm.weight"), eps)
        self.scaling = head_dim ** -0.5


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
                raise EngineError("the checkpoint has no lm_head.weight and its config does not tie it to the embedding")
            head = self.model.embed_tokens.weight
        self.lm_head = _linear(head, None)
        if t:
            raise EngineError(f"the checkpoint has tensors this reader does not place: {', '.join(sorted(t)[:5])}")


def read(directory: Path, dtype: torch.dtype) -> CausalLM:
    """The model in `directory`, its tensors in dtype (a bf16 checkpoint read as bf16 stays as stored)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    try:
        generation = GenerationConfig.from_pretrained(str(directory), local_files_only=True)
    except OSError:
        generation = None   # no generation_config.json: config.json's ids decide
    # as from_pretrained records it: the dtype the weights were loaded in
    setattr(config, "dtype" if hasattr(config, "dtype") else "torch_dtype", dtype)
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
