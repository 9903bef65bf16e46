"""The forward pass: the model's own weights, run without per-op framework overhead.

A batch-1 decode step of a small model is a stream of tiny ops, so the step's
cost is mostly dispatch, not arithmetic. At load time the weights of each
layer are fused where the maths allows it exactly (q/k/v into one projection,
gate/up into one), the module parameters become views of the fused tensors
(no memory is doubled, and transformers' own modules keep working on them),
and the step calls the functional ops directly:

* RMSNorm through `F.rms_norm` (in float32 for half-precision weights, as the
  transformers modules do);
* RoPE from cos/sin tables built once by the model's own rotary module (every
  static rope_scaling variant is then exact), applied to q and k in one go,
  without `cat` (the sign of rotate_half is folded into the sin table);
* attention over the sequence's preallocated KV slots, with the causal mask
  of a multi-token pass taken as a view of one buffer built once per size
  (query i at absolute position pos+i sees keys 0..pos+i), and no mask at
  all for a single token.

Rope types whose tables depend on the sequence length (dynamic NTK, longrope)
cannot be precomputed; such models are refused with a clear message instead of
being computed differently from transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from completiond.engine import native
from completiond.engine.fused_layer import FusedLayer, bias_of, fuse_layer, transpose
from completiond.errors import EngineError
from completiond.models.adapters import Adapter, UnsupportedModel

if TYPE_CHECKING:
    from completiond.engine.kvcache import KVSequence
    from completiond.engine.native import NativeStep

# rope_type values whose cos/sin change with the sequence length.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def check_rope(config) -> None:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    kind = params.get("rope_type") or params.get("type") if isinstance(params, dict) else None
    if kind in LENGTH_DEPENDENT_ROPE:
        raise UnsupportedModel(
            f"rope type {kind!r} changes its tables with the sequence length, which completiond's precomputed "
            "rotary tables cannot follow exactly; use a model with static rope scaling (default, linear, yarn, llama3)"
        )


class Forward:
    """Layers, final norm and LM head of one model, on fused weights. Token ids and hidden states only."""

    def __init__(self, adapter: Adapter, config, device, dtype: torch.dtype, max_positions: int, weights: str = "auto"):
        check_rope(config)
        if weights not in native.WEIGHT_FORMATS:
            raise EngineError(f"unknown weights format {weights!r}; use {', '.join(native.WEIGHT_FORMATS)}")
        self.adapter = adapter
        self.device = device
        self.dtype = dtype
        self.weights = weights
        self.H, self.KV, self.hd = adapter.num_heads, adapter.num_kv_heads, adapter.head_dim
        self.scaling = adapter.scaling
        self.gqa = self.H != self.KV
        self.max_positions = max_positions
        large = not _small_modules(adapter.layers)
        self.num_model_layers = len(adapter.layers)
        self.layers: list[FusedLayer] = []
        # parameters of each layer's matrices (they outlive the matrices when the packed panels replace them)
        self.layer_numel: list[int] = []
        # A large model on the CPU with the native step: each layer is fused, packed and released in turn,
        # so at most one layer's unpacked copy exists beside the checkpoint while loading.
        early = native.early_step(self, adapter, weights) if large and str(device) == "cpu" else None
        self._fuse_layers(early)
        self.norm_w = adapter.norm.weight.detach().to(dtype)
        self.norm_eps = float(adapter.norm.variance_epsilon)
        self.embed_w = adapter.embed.weight.detach()
        self.head_w = adapter.lm_head.weight.detach()
        head_b = bias_of(adapter.lm_head)
        self.head_b = None if head_b is None else head_b.to(dtype)
        self._cos: torch.Tensor | None = None  # [P, 1, hd] each; sin with rotate_half's sign folded in
        self._sin: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None  # [T, W] bool: see mask()
        # step.c, bound to panels packed layer by layer. For a model too large for two copies of its
        # weights the panels become the only copy (each layer's own tensors are dropped once packed), and
        # for a weight format that changes the values (bf16 rounding, int8) every pass must read the
        # panels: then every pass runs natively (native_all). Otherwise the model keeps its own weights too,
        # for the passes the native step cannot take (another dtype, a cache that is not contiguous).
        self.released = False
        self.native: NativeStep | None
        self.native_reason: str | None
        if early is not None:
            early.bind()
            self.native, self.native_reason = early, None
        else:
            self.native, self.native_reason = native.bind(self, weights, release=large and str(device) == "cpu")
        self.native_all = self.native is not None and (large or self._panels_change_values(weights))
        # Where a step is bound it runs passes of every length, prefill chunks included, on every build: its
        # prefill beats PyTorch's float32 GEMM (the bundled model, 330 tokens in chunks of 256, 2 threads: 12-25
        # against 36-41 ms from AVX2 to AVX512_BF16, 2026-12-07; 96 against 165 ms of CPU time on AMX tiles,
        # 2026-12-06), and every pass then has the one arithmetic, whose rows do not depend on the pass (a
        # reused cache is a cold one).
        if self.native is None:
            self._widen_matrices()
        elif large:
            self._keep_panels_only()
        self.transposed = str(device) == "cpu" and not large and not self.native_all
        if self.transposed:
            for L in self.layers:
                transpose(L)
        self.head_t = self.head_w.t().contiguous() if self.transposed else None

    def _panels_change_values(self, weights: str) -> bool:
        """Whether the weights setting gives the panels other values than the model's own: int8 always, bf16 unless
        every matrix and the head already hold bf16 values (the bundled model: "bf16" then computes what "auto"
        did, and the PyTorch path, transformers' baselines included, may still run beside the panels)."""
        if weights == "int8":
            return True
        if weights == "bf16":
            mats = [w for L in self.layers for w in L.matrices()] + [self.head_w]
            return not all(native.bf16_exact(w) for w in mats)
        return False

    def _fuse_layers(self, early: NativeStep | None) -> None:
        """Every model layer on fused weights; an early native step packs (and releases) each as it comes."""
        for i, layer in enumerate(self.adapter.layers):
            L = self._widen_small(fuse_layer(layer, self.adapter.qk_norm))
            self.layers.append(L)
            self.layer_numel.append(sum(w.numel() for w in L.matrices()))
            if early is not None:
                early.pack_layer(i, L)

    def _widen_matrices(self) -> None:
        """The PyTorch path computes in dtype: a bf16-loaded checkpoint widens here."""
        for L in self.layers:
            for name in ("qkv", "o", "gate_up", "down"):
                if getattr(L, name).dtype != self.dtype:
                    setattr(L, name, getattr(L, name).to(self.dtype))
        self.embed_w, self.head_w = self.embed_w.to(self.dtype), self.head_w.to(self.dtype)

    def _keep_panels_only(self) -> None:
        """A large model's native panels are its only layer weights: the rest keeps no view of the checkpoint."""
        self.released = True
        self._compact_embeddings()
        # the small tensors left in the modules (norms, biases) get their own storage: a checkpoint read
        # in its own dtype may be views of the mapped file, which they would keep resident
        for module in (*self.adapter.layers, self.adapter.norm):
            for p in module.parameters():
                if p.numel():
                    p.data = p.data.clone()
        native.trim_heap()

    def _widen_small(self, L: FusedLayer) -> FusedLayer:
        """Norms and biases in the compute dtype: a bf16 checkpoint loaded as bf16 for packing (see
        packs_bf16_checkpoint) keeps only its matrices in bf16, which the native step reads as such."""
        for name in ("ln1", "ln2", "qkv_bias", "o_bias", "gate_up_bias", "down_bias", "q_norm", "k_norm"):
            t = getattr(L, name)
            if t is not None and t.dtype != self.dtype:
                setattr(L, name, t.to(self.dtype))
        return L

    def release_layer(self, i: int) -> None:
        """Drop layer i's own matrices (the native step has packed them): its fused tensors and the
        transformers modules' parameters, so no copy but the panels stays resident."""
        L = self.layers[i]
        L.qkv = L.o = L.gate_up = L.down = None
        L.qkv_t = L.o_t = L.gate_up_t = L.down_t = None
        layer = self.adapter.layers[i]
        for m in (
            layer.self_attn.q_proj,
            layer.self_attn.k_proj,
            layer.self_attn.v_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_proj,
            layer.mlp.up_proj,
            layer.mlp.down_proj,
        ):
            m.weight.data = torch.empty(0, dtype=m.weight.dtype, device=m.weight.device)

    def _compact_embeddings(self) -> None:
        """Keep the embedding and the LM head as one bf16 tensor each (one for both when tied) where that
        holds the values the native step reads: bf16 values (or rounded under weights="bf16"); int8 heads
        are quantised from it row by row. The transformers modules' copies are dropped."""
        tied = self.head_w.data_ptr() == self.embed_w.data_ptr()

        def compact(w: torch.Tensor) -> torch.Tensor:
            if self.weights == "bf16" or w.dtype == torch.bfloat16 or native.bf16_exact(w):
                w = w.to(torch.bfloat16)
            return w.clone()  # its own storage: not a view of the mapped checkpoint, kept resident by it

        self.embed_w = compact(self.embed_w)
        self.head_w = self.embed_w if tied else compact(self.head_w)
        for m in (self.adapter.embed, self.adapter.lm_head):
            m.weight.data = torch.empty(0, dtype=m.weight.dtype, device=m.weight.device)

    def add_layer(self, layer) -> int:
        """Append an extra decoder layer of the model's shape (a draft's exit adapter) and return its
        index: layers_range(h, i, i + 1, ...) runs it on the KV slot of that index."""
        fused = self._widen_small(fuse_layer(layer, self.adapter.qk_norm))
        self.layer_numel.append(sum(w.numel() for w in fused.matrices()))
        if self.transposed:
            transpose(fused)
        self.layers.append(fused)
        if self.native is not None:
            self.native.bind()
        return len(self.layers) - 1

    # ---------------------------------------------------------------- tables
    def rope(self, pos: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin for positions [pos, pos+t), each [t, 1, hd] (broadcast over heads)."""
        end = pos + t
        cos, sin = self._cos, self._sin
        if cos is None or sin is None or cos.shape[0] < end:
            size = min(max(1024, 1 << (end - 1).bit_length()), max(self.max_positions, end))
            positions = torch.arange(size, device=self.device)[None]  # [1, size]
            dummy = torch.zeros(1, dtype=self.dtype, device=self.device)
            cos, sin = self.adapter.rotary(dummy, positions)  # each [1, size, hd]
            cos, sin = cos[0].to(self.dtype), sin[0].to(self.dtype)  # [size, hd]
            half = self.hd // 2
            sign = torch.ones(self.hd, dtype=self.dtype, device=self.device)
            sign[:half] = -1  # rotate_half(x) = cat(-x2, x1) = swap(x) * [-1.., +1..]
            cos, sin = self._cos, self._sin = cos[:, None], (sin * sign)[:, None]  # [size, 1, hd]
        return cos[pos:end], sin[pos:end]

    def mask(self, pos: int, t: int) -> torch.Tensor:
        """Causal mask [t, pos+t] of t queries at absolute positions pos.. over keys 0..pos+t-1,
        as a view of one buffer B[i, j] = j <= W - T + i: rows T-t.., the last pos+t columns."""
        need_t, need_w = t, pos + t
        buffer = self._mask
        if buffer is None or buffer.shape[0] < need_t or buffer.shape[1] < need_w:
            T = max(need_t, 256, 0 if buffer is None else buffer.shape[0])
            W = max(need_w, 1024, 0 if buffer is None else buffer.shape[1])
            W = max(W, 1 << (W - 1).bit_length())
            buffer = self._mask = torch.ones(T, W, dtype=torch.bool, device=self.device).tril(diagonal=W - T)
        T, W = buffer.shape
        return buffer[T - t :, W - need_w :]

    # ---------------------------------------------------------------- the pass
    def native_for(self, dtype: torch.dtype, seq: "KVSequence") -> "NativeStep | None":
        """The native step that runs a pass of activations in `dtype` over `seq`'s cache (step.c: every row of
        such a pass has a one-row step's bits), or None: the PyTorch path runs it."""
        return self.native if dtype == torch.float32 and seq.k.is_contiguous() else None

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [1, t] -> hidden states [1, t, d]."""
        h = F.embedding(ids, self.embed_w)
        return h if h.dtype == self.dtype else h.to(self.dtype)  # a compacted bf16 embedding widens exactly

    def layers_range(
        self,
        h: torch.Tensor,
        first: int,
        last: int,
        pos: int,
        seq: "KVSequence",
        write: bool = True,
        tree: "tuple[torch.Tensor, torch.Tensor] | None" = None,
    ) -> torch.Tensor:
        """Layers [first, last) on h [1, t, d] at positions [pos, pos+t); writes their K/V into seq.

        write=False recomputes hidden states of positions whose K/V seq already holds, attending over
        the stored K/V and leaving it untouched (the exit adapter's catch-up: the model's own cache
        must stay exactly what plain decoding wrote).

        tree=(positions [t], mask [t, pos + t]) verifies a token tree: node i sits in slot pos + i but
        at rope position positions[i] (its depth), and sees the prefix and its own ancestors only."""
        t = h.shape[1]
        H, KV, hd = self.H, self.KV, self.hd
        if (native := self.native_for(h.dtype, seq)) is not None:
            if last > native.n_layers:
                native.bind()
            if tree is None:
                self.rope(pos, t)
                return native.layers(h, first, last, pos, seq, write, None, None)
            positions, tree_mask = tree
            self.rope(0, int(positions.max()) + 1)
            return native.layers(h, first, last, pos, seq, write, positions, tree_mask)
        if self.released:
            raise EngineError(
                f"the model's weights live in the native step's panels only, which cannot run a "
                f"{h.dtype} pass of {t} positions on a non-contiguous cache"
            )
        if tree is None:
            cos, sin = self.rope(pos, t)
            # One token sees every key: no mask. A first chunk is plain causal: no materialised mask either,
            # so SDPA may pick a flash kernel; only a pass after a prefix needs the offset mask.
            mask = self.mask(pos, t) if t > 1 and pos > 0 else None
            causal = t > 1 and pos == 0
        else:
            positions, mask = tree
            cos, sin = self.rope(0, int(positions.max()) + 1)  # the tables cover the deepest node
            cos, sin = cos[positions], sin[positions]  # [t, 1, hd] each
            causal = False
        for li in range(first, last):
            L = self.layers[li]
            w_qkv, w_o, w_gate_up, w_down = L.matrices()
            x = _rms(h, L.ln1, L.eps)
            qkv = _proj(x, w_qkv, L.qkv_t, L.qkv_bias).view(1, t, H + 2 * KV, hd)  # [1, t, H+2KV, hd]
            if L.q_norm is not None and L.k_norm is not None:
                qk = torch.cat([_rms(qkv[:, :, :H], L.q_norm, L.eps), _rms(qkv[:, :, H : H + KV], L.k_norm, L.eps)], 2)
            else:
                qk = qkv[:, :, : H + KV]  # [1, t, H+KV, hd]: rope on q and k at once
            qk = qk * cos + _swap_halves(qk) * sin
            q = qk[:, :, :H].transpose(1, 2)  # [1, H, t, hd]
            if write:
                seq.k[li, :, pos : pos + t] = qk[0, :, H:].transpose(0, 1)  # [KV, t, hd]
                seq.v[li, :, pos : pos + t] = qkv[0, :, H + KV :].transpose(0, 1)
            o = F.scaled_dot_product_attention(
                q,
                seq.k[li : li + 1, :, : pos + t],
                seq.v[li : li + 1, :, : pos + t],
                attn_mask=mask,
                is_causal=causal,
                scale=self.scaling,
                enable_gqa=self.gqa,
            )  # [1, H, t, hd]
            h = h + _proj(o.transpose(1, 2).reshape(1, t, H * hd), w_o, L.o_t, L.o_bias)  # [1, t, d]
            gate, up = _proj(_rms(h, L.ln2, L.eps), w_gate_up, L.gate_up_t, L.gate_up_bias).chunk(2, dim=-1)
            h = h + _proj(L.act(gate) * up, w_down, L.down_t, L.down_bias)
        return h

    def norm(self, h: torch.Tensor) -> torch.Tensor:
        return _rms(h, self.norm_w, self.norm_eps)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head: [1, t, d] -> logits [t, V] float32."""
        step = self._native_for(h)
        if step is not None:
            return step.head(h, self.norm_w, self.norm_eps, self.head_w, self.head_b)
        return _proj(self.norm(h), self.head_w, self.head_t, self.head_b)[0].float()

    def head_rows(self, h: torch.Tensor, weight: torch.Tensor, weight_t: torch.Tensor | None) -> torch.Tensor:
        """Final norm + a subset of the LM head's rows (a draft's vocabulary): [1, t, d] -> [t, Vd] float32."""
        step = self._native_for(h)
        if step is not None:
            return step.head(h, self.norm_w, self.norm_eps, weight, None)
        return _proj(self.norm(h), weight, weight_t, None)[0].float()

    def _native_for(self, h: torch.Tensor) -> NativeStep | None:
        """The native step where it runs this pass on h (float32)."""
        if self.native is not None and h.dtype == torch.float32:
            return self.native
        return None


# Transposed copies (and packed panels beside the model's own weights) cost one more copy of the layer
# weights: only for models small enough that it does not matter (the bundled model: 18 MB). Larger
# models keep the packed panels only.
TRANSPOSED_COPY_LIMIT = 512 << 20
SMALL_T = 8  # up to this many positions, x @ w_t (see _proj)


def _stored_bf16(directory) -> bool:
    """Whether every layer matrix in the model's safetensors files is stored as BF16 (their headers only)."""
    import json
    import struct
    from pathlib import Path

    files = sorted(Path(directory).glob("model*.safetensors"))
    if not files:
        return False
    for f in files:
        try:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                if n > 100 << 20:
                    return False
                header = json.loads(fh.read(n))
        except (OSError, ValueError, struct.error, RecursionError):  # RecursionError: JSON nested too deeply
            return False
        if not isinstance(header, dict):
            return False  # not a safetensors header: the load reports the file
        for name, entry in header.items():
            if (
                name != "__metadata__"
                and name.endswith("proj.weight")
                and (not isinstance(entry, dict) or entry.get("dtype") != "BF16")
            ):
                return False
    return True


def packs_bf16_checkpoint(config: dict, directory=None) -> bool:
    """Whether a CPU load of this model (config.json as a dict) should read its bf16 weights as bf16 and
    let the native step pack them layer by layer, instead of widening the whole model to float32 first
    (a peak of three times the weights for the 1.5B shape): a bf16 checkpoint too large for two copies,
    with a native library here. Forward then computes in float32 from the bf16 panels, the very values
    a float32 load holds."""
    # the stored tensors decide (config.json's dtype may say otherwise); without the files, the config
    stored_bf16 = (
        _stored_bf16(directory)
        if directory is not None
        else str(config.get("torch_dtype") or config.get("dtype") or "") == "bfloat16"
    )
    if not stored_bf16:
        return False
    try:
        d, n, inter = int(config["hidden_size"]), int(config["num_hidden_layers"]), int(config["intermediate_size"])
        heads = int(config["num_attention_heads"])
        kv = int(config.get("num_key_value_heads") or heads)
        hd = int(config.get("head_dim") or d // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return False
    matrix_bytes = 4 * n * (d * (heads + 2 * kv) * hd + heads * hd * d + 3 * d * inter)
    return matrix_bytes > TRANSPOSED_COPY_LIMIT and native.library() is not None


def _small_modules(layers) -> bool:
    """Whether a second (transposed, or packed) copy of the layer weights does not matter (transformers
    decoder layers, counted as float32)."""
    size = 0
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            size += m.weight.numel() * 4
    return size <= TRANSPOSED_COPY_LIMIT


def _proj(x: torch.Tensor, w: torch.Tensor, w_t: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """x [1, t, in] -> [1, t, out]. On CPU, through [in, out]-contiguous weights (x @ w_t) for the few
    positions of a decode step or a verify pass: the bundled model's full pass (minimum of 30
    interleaved runs) took 4.9 / 7.8 / 9.4 ms for 1 / 2 / 3 positions with F.linear and
    5.1 / 5.9 / 6.7 ms this way, so a verify pass costs 1.16-1.31 steps instead of 1.6-1.9.
    Prefill chunks keep F.linear's GEMM."""
    if w_t is None or x.shape[1] > SMALL_T:
        return F.linear(x, w, bias)
    y = x @ w_t
    return y if bias is None else y + bias


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    # As transformers does for half precision: normalise in float32, scale in the model's dtype.
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    """[..., hd] -> the two halves of the last dim exchanged (rotate_half without its sign)."""
    return x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
