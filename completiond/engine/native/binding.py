"""The native step bound to a Forward's weights: NativeStep packs them (packing.py) and calls step.c
through the library build.py loaded.

This module never imports forward.py (forward.py imports it): it reads a Forward's attributes only.
"""

from __future__ import annotations

import ctypes
import time
from typing import Any

import torch

from completiond.engine.native.abi import (
    _LAYER_FIELDS,
    NativeError,
    _as_int,
    _check,
    _Layer,
    _Model,
    _ptr,
)
from completiond.engine.native.build import library, reason
from completiond.engine.native.packing import (
    _FMT_NAMES,
    FMT_BF16,
    FMT_BF16_ROWS,
    FMT_F32,
    FMT_I8,
    PANEL,
    _format_for,
    pack_as,
)
from completiond.engine.native.support import _activation_unsupported, unsupported
from completiond.errors import EngineError

# Up to this many positions a greedy round verifies its draft in one native call (embed, layers, head,
# argmax: decode.py); every pass of any length runs on the native kernels where a step is bound
# (Forward.layers_range).
MAX_ROWS = 33
WEIGHT_FORMATS = ("auto", "bf16", "int8")


def early_step(fwd: Any, adapter: Any, weights: str) -> NativeStep | None:
    """A native step that packs (and releases) fwd's layers one by one as fwd fuses them (pack_layer, then
    bind), or None when the native step cannot run this model: the checks of unsupported() made before any
    layer exists, so no layer is released for a step that is then refused."""
    if weights not in WEIGHT_FORMATS:
        raise EngineError(f"unknown weights format {weights!r}; use {', '.join(WEIGHT_FORMATS)}")
    if fwd.layers or unsupported(fwd) is not None:
        return None
    if any(_activation_unsupported(layer.mlp.act_fn) is not None for layer in adapter.layers):
        return None
    lib = library()
    if lib is None:
        return None
    return NativeStep(lib, fwd, weights, release=True, bind=False)


class NativeStep:
    """step.c bound to one Forward's weights, packed into panels in the format `weights` asks for.
    Callers check float32 and a contiguous cache.

    release: after packing a layer, drop the Forward's own (unpacked) copies of its matrices, so the
    panels are the only copy (fwd.release_layer does it; the PyTorch path cannot run those layers then)."""

    def __init__(self, lib: ctypes.CDLL, fwd: Any, weights: str = "auto", release: bool = False, bind: bool = True):
        if weights not in WEIGHT_FORMATS + ("float32",):
            raise EngineError(f"unknown weights format {weights!r}; use {', '.join(WEIGHT_FORMATS)}")
        self.lib = lib
        self.fwd = fwd
        self.kernel = lib.cd_kernel().decode()
        self.bf16_pairs = bool(lib.cd_bf16_pairs())  # the build's bf16 panel layout
        self.i8_quads = bool(lib.cd_i8_quads())  # the build's int8 layout (k-quads: w8a8 on VNNI)
        self.act_levels = int(lib.cd_act_levels())  # w8a8: activation rows as integers within +-this (0: none)
        self.bf16_dot = bool(lib.cd_bf16_dot())  # bf16 panels times bf16-rounded activations (AVX512_BF16)
        self.tiles = self.kernel == "avx512-amx"  # bf16 and int8 panels on AMX tiles: prefill runs here too
        self.weights_setting = weights
        self.release = release
        self._packed: dict[int, tuple] = {}  # id(w) -> (w, packed w, scales, fmt): LM heads
        self._bound: dict[int, tuple] = {}  # id(FusedLayer) -> (layer, packed matrices, scales, biases, fmt)
        if bind:
            self.bind()

    def pack_layer(self, i: int, L) -> None:
        """Pack layer i now (and release its own copy when release is set); bind() later uses it."""
        self._bound[id(L)] = self._packed_layer(i, L)

    def _pack(self, w: torch.Tensor) -> tuple[torch.Tensor, int, torch.Tensor | None]:
        """w packed (panels, format, int8 scales), once per weight tensor (the entry holds w, so its id is
        not reused while cached)."""
        hit = self._packed.get(id(w))
        if hit is None or hit[0] is not w:
            fmt = _format_for(self.weights_setting, (w,))
            if fmt == FMT_BF16 and w.dtype == torch.bfloat16 and w.is_contiguous():
                # a bf16 head (a large model's, often its tied embedding) is read where it lies, row-major:
                # panels would be a second copy of the model's largest matrix
                packed, scales, fmt = w.view(torch.int16), None, FMT_BF16_ROWS
            else:
                packed, scales = pack_as(w, fmt, self.bf16_pairs, self.i8_quads)
            hit = (w, packed, fmt, scales)
            self._packed[id(w)] = hit
            while len(self._packed) > 4:  # the LM head and the draft vocabularies tried last (calibrate)
                del self._packed[next(iter(self._packed))]
        return hit[1], hit[2], hit[3]

    def _packed_layer(self, i: int, L) -> tuple:
        """L's matrices packed and its gate/up bias split, once per layer: an attached exit adapter
        packs only itself."""
        hit = self._bound.get(id(L))
        if hit is None or hit[0] is not L:
            if L.qkv is None:
                raise EngineError(f"layer {i}'s weights were released after packing and cannot be packed again")
            inter = L.down.shape[1]
            gate_b = up_b = None
            if L.gate_up_bias is not None:
                gate_b, up_b = L.gate_up_bias[:inter].contiguous(), L.gate_up_bias[inter:].contiguous()
            full = (L.qkv, L.o, L.gate_up[:inter], L.gate_up[inter:], L.down)
            fmt = _format_for(self.weights_setting, full)  # one format per layer (step.c's wfmt)
            packed = [pack_as(w, fmt, self.bf16_pairs, self.i8_quads) for w in full]
            hit = (L, tuple(p for p, _ in packed), tuple(sc for _, sc in packed), gate_b, up_b, fmt, inter)
            if self.release and i < self.fwd.num_model_layers:
                self.fwd.release_layer(i)  # the panels are now this layer's only copy
        return hit

    def bind(self) -> None:
        """(Re)read the layers' weights: after Forward.add_layer, or a replaced exit adapter."""
        fwd = self.fwd
        layers = (_Layer * len(fwd.layers))()
        bound = {}
        for i, L in enumerate(fwd.layers):
            _, mats, scales, gate_b, up_b, fmt, inter = bound[id(L)] = self._packed_layer(i, L)
            values = (
                L.ln1,
                mats[0],
                L.qkv_bias,
                mats[1],
                L.o_bias,
                L.ln2,
                mats[2],
                gate_b,
                mats[3],
                up_b,
                mats[4],
                L.down_bias,
                L.q_norm,
                L.k_norm,
                *scales,
            )
            for name, t in zip(_LAYER_FIELDS, values):
                if t is not None and not (t.is_contiguous() and t.dtype in (torch.float32, torch.int16, torch.int8)):
                    raise ValueError(f"layer {i}: {name} is not a contiguous float32 (or packed) tensor")
                setattr(layers[i], name, _ptr(t))
            layers[i].wfmt = fmt
            self._bound[id(L)] = bound[id(L)]  # kept as packed (a later layer's failure must not repack it)
        L0 = bound[id(fwd.layers[0])]
        self._bound = bound  # the packed copies the struct points into (a replaced adapter's are dropped)
        self._layers = layers
        self.model = _Model(
            d=fwd.layers[0].ln1.shape[0],
            H=fwd.H,
            KV=fwd.KV,
            hd=fwd.hd,
            I=L0[6],
            n_layers=len(fwd.layers),
            eps=fwd.layers[0].eps,
            scale=float(fwd.scaling),
            layers=layers,
            vocab=fwd.embed_w.shape[0],
            rope_len=0,
        )
        self.n_layers = len(fwd.layers)

    def weights(self) -> str:
        """The packed layers' weight format, in words: "bf16", "int8", "float32", or how many of each."""
        names = [_FMT_NAMES[layer.wfmt] for layer in self._layers]
        if len(set(names)) == 1:
            return names[0]
        return ", ".join(f"{n} in {names.count(n)} of {len(names)} layers" for n in sorted(set(names)))

    def packed_bytes(self) -> int:
        """Bytes of the packed panels (layers and LM head) this step reads."""
        return sum(self.bytes_by_format().values())

    def bytes_by_format(self) -> dict[int, int]:
        """The packed bytes (layers and LM head, int8 scales included) by the format step.c reads them in."""
        out: dict[int, int] = {}
        for _, mats, scales, _gate_b, _up_b, fmt, _inter in self._bound.values():
            size = sum(m.numel() * m.element_size() for m in mats) + sum(s.numel() * 4 for s in scales if s is not None)
            out[fmt] = out.get(fmt, 0) + size
        for _, packed, fmt, scales in self._packed.values():
            size = packed.numel() * packed.element_size() + (0 if scales is None else scales.numel() * 4)
            out[fmt] = out.get(fmt, 0) + size
        return out

    def arithmetic_rate(
        self, fmt: int, rows: int, seconds: float = 0.1, repeats: int = 5, cache_bytes: int = 128 << 10
    ) -> float:
        """Weight bytes per second this build's kernels for format fmt consume at `rows` rows, on all of
        torch's threads at once, from a random [cols, d] matrix of about cache_bytes per thread, which
        stays in cache: the arithmetic alone, with no memory stream to wait on (step.c's cd_arith). The
        median of `repeats` timings of about `seconds` each."""
        d, threads = self.model.d, torch.get_num_threads()
        per_weight = {FMT_F32: 4, FMT_BF16: 2, FMT_BF16_ROWS: 2, FMT_I8: 1}[fmt]
        cols = max(1, cache_bytes // (d * per_weight * PANEL)) * PANEL * threads
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(cols, d, generator=gen) * 0.02  # [cols, d]
        if fmt == FMT_BF16_ROWS:
            packed, scales = w.to(torch.bfloat16).view(torch.int16), None
        else:
            packed, scales = pack_as(w, fmt, self.bf16_pairs, self.i8_quads)
        x, y = torch.randn(rows, d, generator=gen), torch.empty(rows, cols)
        nbytes = packed.numel() * packed.element_size()

        def timed(reps: int) -> float:
            t0 = time.perf_counter()
            _check(
                self.lib.cd_arith(
                    x.data_ptr(), rows, d, packed.data_ptr(), fmt, _ptr(scales), cols, y.data_ptr(), reps, threads
                ),
                f"arithmetic timing at {rows} rows",
            )
            return time.perf_counter() - t0

        reps = 4
        while (took := timed(reps)) < seconds / 4 and reps < 1 << 24:  # warms up and sizes the repeats
            reps *= 4
        reps = max(1, round(reps * seconds / took))
        import statistics  # here, not at the top: it imports decimal, about 0.5 MiB resident the daemon never uses

        return nbytes * reps / statistics.median(timed(reps) for _ in range(repeats))

    def _rope(self) -> None:
        self.model.rope_len = self.fwd._cos.shape[0]

    def _embed(self) -> tuple[int, int]:
        e = self.fwd.embed_w
        return e.data_ptr(), int(e.dtype == torch.bfloat16)

    def layers(
        self,
        h: torch.Tensor,
        first: int,
        last: int,
        pos: int,
        seq: Any,
        write: bool,
        rope_pos: torch.Tensor | None,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Forward.layers_range's contract on h [1, t, d]; returns new states (h is not modified)."""
        t = h.shape[1]
        self._check_args("layers", seq, pos, t, first, last)
        if h.dim() != 3 or h.shape[0] != 1 or h.shape[2] != self.model.d:
            raise NativeError(
                f"native layers: hidden states of shape {tuple(h.shape)}, expected [1, t, {self.model.d}]"
            )
        out = h.to(torch.float32).clone(memory_format=torch.contiguous_format)  # [1, t, d]: step.c works in place
        if rope_pos is not None:
            rope_pos = rope_pos.to(torch.int64).contiguous()
            if rope_pos.shape != (t,):
                raise NativeError(f"native layers: {tuple(rope_pos.shape)} rotary positions for {t} rows")
        if mask is not None:
            mask = mask.to(torch.bool).contiguous()  # [t, pos + t], one byte per entry
            if mask.shape != (t, pos + t):
                raise NativeError(f"native layers: a mask of shape {tuple(mask.shape)}, expected [{t}, {pos + t}]")
        self._check_cache(seq, last)
        self._rope()
        _check(
            self.lib.cd_layers(
                ctypes.byref(self.model),
                out.data_ptr(),
                t,
                first,
                last,
                pos,
                _ptr(rope_pos),
                _ptr(mask),
                int(write),
                seq.k.data_ptr(),
                seq.v.data_ptr(),
                seq.k.shape[2],
                self.fwd._cos.data_ptr(),
                self.fwd._sin.data_ptr(),
                torch.get_num_threads(),
            ),
            f"step of {t} rows at slot {pos}, layers [{first}, {last})",
        )
        return out

    def _check_args(
        self, what: str, seq: Any, pos: int, t: int, first: int, last: int, tokens: list[int] | None = None
    ) -> None:
        """The checks step.c repeats, made before anything is converted for C (ctypes would truncate an int
        past 32 bits silently, and the rope tables would grow to an absurd position first)."""
        cap = seq.k.shape[2]
        t, pos, first, last = (_as_int(v, what) for v in (t, pos, first, last))
        if not 1 <= t <= cap:
            raise NativeError(f"native {what}: {t} rows for a cache of {cap} slots")
        if not 0 <= pos <= cap - t:
            raise NativeError(f"native {what}: slots {pos}..{pos}+{t} outside the cache's {cap}")
        if not 0 <= first <= last <= self.n_layers:
            raise NativeError(f"native {what}: layers [{first}, {last}) outside 0..{self.n_layers}")
        vocab = self.model.vocab
        for tok in tokens or ():
            if not 0 <= _as_int(tok, what) < vocab:
                raise NativeError(f"native {what}: token id {tok!r} outside the vocabulary of {vocab}")

    def _check_cache(self, seq: Any, last: int) -> None:
        """seq's K/V must hold slots for layers [0, last) of this model's shape, in float32, contiguous."""
        k, v = seq.k, seq.v
        if (
            k.dim() != 4
            or k.shape[0] < last
            or tuple(k.shape[1:2]) + tuple(k.shape[3:]) != (self.model.KV, self.model.hd)
            or k.shape != v.shape
            or k.dtype != torch.float32
            or v.dtype != torch.float32
            or not (k.is_contiguous() and v.is_contiguous())
        ):
            raise NativeError(
                f"native step: a KV cache of shape {tuple(k.shape)} {k.dtype}, expected "
                f"[>= {last}, {self.model.KV}, capacity, {self.model.hd}] float32, contiguous"
            )

    def head(
        self, h: torch.Tensor, norm_w: torch.Tensor, eps: float, w: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """Final norm + LM head rows w [V, d] (packed on first use): h [1, t, d] -> logits [t, V] float32."""
        x = h[0].to(torch.float32).contiguous()  # [t, d]
        t, d = x.shape
        V = w.shape[0]
        if w.shape[1] != d or d != self.model.d:
            raise NativeError(f"native head: rows of width {w.shape[1]} for states of width {d}")
        packed, fmt, scales = self._pack(w)
        out = torch.empty(t, V, dtype=torch.float32)
        _check(
            self.lib.cd_head(
                x.data_ptr(),
                t,
                d,
                norm_w.data_ptr(),
                eps,
                packed.data_ptr(),
                fmt,
                _ptr(scales),
                V,
                _ptr(bias),
                out.data_ptr(),
                torch.get_num_threads(),
            ),
            f"head over {t} rows",
        )
        return out

    def draft_greedy(
        self,
        token: int,
        exit_layer: int,
        pos: int,
        k_max: int,
        threshold: float,
        seq: Any,
        head_w: torch.Tensor,
        head_b: torch.Tensor | None,
        ids: torch.Tensor | None,
        eos: torch.Tensor,
    ) -> tuple[list[int], torch.Tensor]:
        """Up to k_max greedy early-exit draft tokens after token (step.c's cd_draft_greedy: no Python between
        the draft's steps); returns them and the layer-E states [1, n_fed, d] of the tokens it fed."""
        fwd = self.fwd
        self._check_args("draft", seq, pos, k_max, 0, exit_layer, [token])
        fwd.rope(pos, k_max)
        d = self.model.d
        states = torch.empty(k_max, d, dtype=torch.float32)  # [k_max, d]
        tokens = torch.empty(k_max, dtype=torch.int64)
        fed = ctypes.c_int(0)
        packed, fmt, scales = self._pack(head_w)
        if ids is not None:
            ids = ids.to(torch.int64).contiguous()
            if ids.shape != (head_w.shape[0],):
                raise NativeError(f"native draft: {tuple(ids.shape)} ids for {head_w.shape[0]} head rows")
        eos = eos.to(torch.int64).contiguous()
        self._check_cache(seq, exit_layer)
        self._rope()
        embed, ebf16 = self._embed()
        k = _check(
            self.lib.cd_draft_greedy(
                ctypes.byref(self.model),
                embed,
                ebf16,
                int(token),
                exit_layer,
                pos,
                k_max,
                float(threshold),
                fwd.norm_w.data_ptr(),
                fwd.norm_eps,
                packed.data_ptr(),
                fmt,
                _ptr(scales),
                head_w.shape[0],
                _ptr(head_b),
                _ptr(ids),
                eos.data_ptr(),
                eos.numel(),
                seq.k.data_ptr(),
                seq.v.data_ptr(),
                seq.k.shape[2],
                fwd._cos.data_ptr(),
                fwd._sin.data_ptr(),
                torch.get_num_threads(),
                tokens.data_ptr(),
                states.data_ptr(),
                ctypes.byref(fed),
            ),
            f"draft of {k_max} tokens at slot {pos}",
        )
        return tokens[:k].tolist(), states[: fed.value][None]  # [1, n_fed, d]

    def verify_greedy(
        self, tokens: list[int], last: int, pos: int, seq: Any, head_w: torch.Tensor, head_b: torch.Tensor | None
    ) -> list[int]:
        """The argmax after each of tokens (pending, then the drafts) fed at slots pos.. through layers
        [0, last), their K/V written (step.c's cd_verify_greedy: one call for embed, layers, head and argmax)."""
        fwd = self.fwd
        t = len(tokens)
        self._check_args("verify", seq, pos, t, 0, last, list(tokens))
        fwd.rope(pos, t)
        ids = torch.tensor(tokens, dtype=torch.int64)  # [t]
        out = torch.empty(t, dtype=torch.int64)
        packed, fmt, scales = self._pack(head_w)
        self._check_cache(seq, last)
        self._rope()
        embed, ebf16 = self._embed()
        _check(
            self.lib.cd_verify_greedy(
                ctypes.byref(self.model),
                embed,
                ebf16,
                ids.data_ptr(),
                t,
                last,
                pos,
                fwd.norm_w.data_ptr(),
                fwd.norm_eps,
                packed.data_ptr(),
                fmt,
                _ptr(scales),
                head_w.shape[0],
                _ptr(head_b),
                seq.k.data_ptr(),
                seq.v.data_ptr(),
                seq.k.shape[2],
                fwd._cos.data_ptr(),
                fwd._sin.data_ptr(),
                torch.get_num_threads(),
                out.data_ptr(),
            ),
            f"verify of {t} tokens at slot {pos}",
        )
        return out.tolist()


def bind(fwd: Any, weights: str = "auto", release: bool = False) -> tuple[NativeStep | None, str | None]:
    """The native step for fwd, or None and why not."""
    if weights not in WEIGHT_FORMATS:
        raise EngineError(f"unknown weights format {weights!r}; use {', '.join(WEIGHT_FORMATS)}")
    why = unsupported(fwd)
    if why is not None:
        return None, why
    lib = library()
    if lib is None:
        return None, reason()
    return NativeStep(lib, fwd, weights, release), None
