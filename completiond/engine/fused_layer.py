"""A transformers decoder layer of the Llama layout on fused weights, as Forward runs it: q/k/v in one
matrix, gate/up in one, and the modules' own parameters made views of the fused tensors (no memory is
doubled, and transformers' modules keep working on them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from completiond.errors import EngineError


@dataclass
class FusedLayer:
    # The four matrices are None once released (Forward.release_layer): the native step's panels hold them.
    ln1: torch.Tensor  # [d]
    qkv: torch.Tensor | None  # [(H + 2*KV) * hd, d]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor | None  # [d, H * hd]
    o_bias: torch.Tensor | None
    ln2: torch.Tensor  # [d]
    gate_up: torch.Tensor | None  # [2 * I, d]
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor | None  # [d, I]
    down_bias: torch.Tensor | None
    act: Callable[[torch.Tensor], torch.Tensor]  # the MLP's activation function (silu for every supported family)
    eps: float
    q_norm: torch.Tensor | None = None  # [hd] Qwen3's per-head norms
    k_norm: torch.Tensor | None = None
    # CPU only: the same weights transposed, [in, out] contiguous, for decode and verify steps (see _proj)
    qkv_t: torch.Tensor | None = None
    o_t: torch.Tensor | None = None
    gate_up_t: torch.Tensor | None = None
    down_t: torch.Tensor | None = None

    def matrices(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv, o, gate_up, down: the layer's own matrices (EngineError once released)."""
        if self.qkv is None or self.o is None or self.gate_up is None or self.down is None:
            raise EngineError("the layer's weights live in the native step's panels only")
        return self.qkv, self.o, self.gate_up, self.down


def _fuse(modules: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) of linears that read the same input, and make each
    module's parameters views of the result: same values, no second copy."""
    weight = torch.cat([m.weight.detach() for m in modules], dim=0)
    has_bias = [m.bias is not None for m in modules]
    bias = None
    if any(has_bias):
        bias = torch.cat(
            [
                m.bias.detach()
                if m.bias is not None
                else torch.zeros(m.weight.shape[0], dtype=m.weight.dtype, device=m.weight.device)
                for m in modules
            ]
        )
    start = 0
    for m in modules:
        n = m.weight.shape[0]
        m.weight.data = weight[start : start + n]
        if m.bias is not None and bias is not None:  # bias is set whenever any module has one
            m.bias.data = bias[start : start + n]
        start += n
    return weight, bias


def fuse_layer(layer, qk_norm: bool) -> FusedLayer:
    """One transformers decoder layer of the Llama layout, on fused weights."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv, qkv_bias = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
    gate_up, gate_up_bias = _fuse([mlp.gate_proj, mlp.up_proj])
    return FusedLayer(
        ln1=layer.input_layernorm.weight.detach(),
        qkv=qkv,
        qkv_bias=qkv_bias,
        o=attn.o_proj.weight.detach(),
        o_bias=bias_of(attn.o_proj),
        ln2=layer.post_attention_layernorm.weight.detach(),
        gate_up=gate_up,
        gate_up_bias=gate_up_bias,
        down=mlp.down_proj.weight.detach(),
        down_bias=bias_of(mlp.down_proj),
        act=mlp.act_fn,
        eps=float(layer.input_layernorm.variance_epsilon),
        q_norm=attn.q_norm.weight.detach() if qk_norm else None,
        k_norm=attn.k_norm.weight.detach() if qk_norm else None,
    )


def transpose(L: FusedLayer) -> None:
    qkv, o, gate_up, down = L.matrices()
    L.qkv_t, L.o_t = qkv.t().contiguous(), o.t().contiguous()
    L.gate_up_t, L.down_t = gate_up.t().contiguous(), down.t().contiguous()


def bias_of(linear) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.detach()
