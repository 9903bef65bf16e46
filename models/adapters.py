"""Model-family adapters: where a loaded transformers model keeps its parts.

The engine runs its own forward pass (so that it can stop at an exit layer,
resume from exit-layer hidden states and own the KV cache), but it uses the
model's own modules for everything that is not attention bookkeeping: the
norms, the projections (Qwen2's q/k/v biases come for free), the MLP and the
rotary embedding (so every rope_scaling variant behaves as in transformers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class UnsupportedModel(ValueError):
    pass


@dataclass
class Adapter:
    family: str
    embed: Any  # nn.Embedding
    layers: Any  # nn.ModuleList of decoder layers
    norm: Any  # final norm
    lm_head: Any  # nn.Linear to vocab
    rotary: Any  # module: rotary(x, position_ids) -> (cos, sin)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    qk_norm: bool  # Qwen3 normalises q and k per head before rope
    sliding_window: int | None

    @property
    def num_layers(self) -> int:
        return len(self.layers)


# model_type -> whether attention has per-head q/k norms. Every family listed
# here has the Llama layout: model.model.{embed_tokens,layers,norm,rotary_emb},
# model.lm_head, layer.{input_layernorm,self_attn,post_attention_layernorm,mlp}.
FAMILIES = {"llama": False, "mistral": False, "qwen2": False, "qwen3": True}


def adapter_for(model: Any) -> Adapter:
    cfg = model.config
    family = getattr(cfg, "model_type", "?")
    if family not in FAMILIES:
        raise UnsupportedModel(
            f"model type {family!r} is not supported; supported families: {', '.join(sorted(FAMILIES))}"
        )
    inner = model.model
    first_attn = inner.layers[0].self_attn
    num_heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
    return Adapter(
        family=family,
        embed=inner.embed_tokens,
        layers=inner.layers,
        norm=inner.norm,
        lm_head=model.lm_head,
        rotary=inner.rotary_emb,
        num_heads=num_heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        scaling=float(getattr(first_attn, "scaling", head_dim**-0.5)),
        qk_norm=FAMILIES[family],
        sliding_window=window,
    )
