"""The native decode step (step.c): built once per machine with the system's C compiler, loaded with
ctypes, bound to a Forward's fused float32 weights.

Small models on CPU spend most of a decode step in PyTorch's per-op dispatch; step.c runs a whole
range of layers (or the LM head) in one call instead. It is an accelerator, never a requirement:
without a compiler, on a CPU without AVX2/FMA, for half-precision or GPU models, or with
COMPLETIOND_NATIVE=0, the engine keeps the PyTorch path, and `reason()` says why.

The shared object is cached under ~/.cache/completiond/native/, keyed by the source, the compiler and
this CPU's feature flags (it is built with -march=native), and written atomically, so concurrent
daemons and test workers neither rebuild it nor load half a file. It links libgomp by soname, which
resolves to the copy torch has already loaded: one OpenMP thread pool for both.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from completiond.engine.forward import Forward
    from completiond.engine.kvcache import KVSequence

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("step.c")
ABI = 8
# Up to this many positions a pass takes the native kernels (a decode step, a keystroke's few tokens
# with the pending one, a verify pass or a token tree); longer prefill chunks keep PyTorch's GEMM.
MAX_ROWS = 16
COMPILE_TIMEOUT_S = 120

_LAYER_FIELDS = ("ln1", "qkv", "qkv_b", "o", "o_b", "ln2", "gate", "gate_b", "up", "up_b", "down", "down_b",
                 "q_norm", "k_norm")
PANEL = 16  # output columns per panel of a packed matrix (step.c's PW)
# a bf16 panel row stores column c at half 2c (c < 8) and 2(c - 8) + 1: step.c widens it with one shift
# and one mask (LOAD_BF16)
_BF16_ORDER = [c for i in range(8) for c in (i, i + 8)]


class _Layer(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in _LAYER_FIELDS] + [("wbf16", ctypes.c_int32)]


class _Model(ctypes.Structure):
    _fields_ = [("d", ctypes.c_int32), ("H", ctypes.c_int32), ("KV", ctypes.c_int32), ("hd", ctypes.c_int32),
                ("I", ctypes.c_int32), ("n_layers", ctypes.c_int32), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("layers", ctypes.POINTER(_Layer))]


_lib: ctypes.CDLL | None = None
_reason: str | None = None  # why there is no library (None: not tried yet, or loaded)
_tried = False


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "completiond" / "native"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc) or cc
    return shutil.which("gcc") or shutil.which("cc")


def _build(cc: str) -> Path:
    """The cached shared object for this source, compiler and CPU, compiled if absent."""
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"C compiler {cc!r} does not run: {exc}") from None
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, cc.encode(), version.encode(), _cpu_flags().encode(),
                                     platform.machine().encode()])).hexdigest()[:16]
    out = cache_dir() / f"step-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".step-", suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cc, "-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-o", tmp, str(SOURCE), "-lm"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError(f"{' '.join(cmd[:2])} ... failed (exit {done.returncode}): {first}")
        os.replace(tmp, out)  # atomic: another process sees the whole file or none
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"compiling {SOURCE.name} took over {COMPILE_TIMEOUT_S} s") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def library() -> ctypes.CDLL | None:
    """The loaded native library, built on first use; None (and reason() says why) when unavailable."""
    global _lib, _reason, _tried
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("COMPLETIOND_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        _reason = "turned off by COMPLETIOND_NATIVE=0"
        return None
    if platform.system() == "Windows" or platform.machine().lower() not in ("x86_64", "amd64"):
        _reason = f"the native step is written for x86-64 with AVX2/FMA, not {platform.machine()}"
        return None
    flags = _cpu_flags().split()
    if flags and not {"avx2", "fma"} <= set(flags):
        _reason = "this CPU lacks AVX2 or FMA"
        return None
    cc = _compiler()
    if cc is None:
        _reason = "no C compiler (gcc or cc, or $CC) on PATH"
        return None
    try:
        path = _build(cc)
        try:
            lib = ctypes.CDLL(str(path))
        except OSError:
            path.unlink(missing_ok=True)  # a damaged cached file (a full disk, say): build it once more
            lib = ctypes.CDLL(str(_build(cc)))
        if lib.cd_abi() != ABI:
            raise RuntimeError(f"{path} has ABI {lib.cd_abi()}, expected {ABI}")
    except (OSError, RuntimeError) as exc:
        _reason = f"cannot build or load the native step: {exc}"
        log.warning("%s; using the PyTorch path", _reason)
        return None
    i32, f32, vp = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    lib.cd_layers.argtypes = [ctypes.POINTER(_Model), vp, i32, i32, i32, i32, vp, vp, i32, vp, vp, i32, vp, vp, i32]
    lib.cd_layers.restype = i32
    lib.cd_head.argtypes = [vp, i32, i32, vp, f32, vp, i32, i32, vp, vp, i32]
    lib.cd_head.restype = i32
    lib.cd_draft_greedy.argtypes = [ctypes.POINTER(_Model), vp, ctypes.c_int64, i32, i32, i32, f32, vp, f32, vp, i32, i32,
                                    vp, vp, vp, i32, vp, vp, i32, vp, vp, i32, vp, vp, ctypes.POINTER(ctypes.c_int)]
    lib.cd_draft_greedy.restype = i32
    lib.cd_verify_greedy.argtypes = [ctypes.POINTER(_Model), vp, vp, i32, i32, i32, vp, f32, vp, i32, i32, vp,
                                     vp, vp, i32, vp, vp, i32, vp]
    lib.cd_verify_greedy.restype = i32
    _lib = lib
    return lib


def reason() -> str | None:
    return _reason


def _reset_for_tests() -> None:
    global _lib, _reason, _tried
    _lib, _reason, _tried = None, None, False


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def bf16_exact(w: torch.Tensor) -> bool:
    """Whether every value of w is a bfloat16 widened to float32 (a model shipped in bf16 and run in
    float32): then its bf16 copy is lossless and step.c computes the very same products from half the bytes."""
    return bool(torch.equal(w.to(torch.bfloat16).to(torch.float32), w))


def pack(w: torch.Tensor, bf16: bool = False) -> torch.Tensor:
    """A linear's weight [out, in] as step.c reads it: panels of PANEL output columns, each [in, PANEL]
    row-major, so a kernel streams its panel front to back; zero columns pad the last one. bf16: the
    same panels as bfloat16 bits (int16), columns in step.c's LOAD_BF16 order; w must be bf16_exact."""
    out, inp = w.shape
    panels = -(-out // PANEL)
    padded = torch.zeros(panels * PANEL, inp, dtype=torch.float32)
    padded[:out] = w
    packed = padded.view(panels, PANEL, inp).transpose(1, 2)  # [panels, in, PANEL]
    if not bf16:
        return packed.contiguous()
    return packed[..., _BF16_ORDER].to(torch.bfloat16).contiguous().view(torch.int16)  # [panels, in, PANEL]


def unsupported(fwd: "Forward") -> str | None:
    """Why this Forward cannot use the native step (None: it can)."""
    if str(fwd.device) != "cpu":
        return f"the model runs on {fwd.device}"
    if fwd.dtype != torch.float32:
        return f"the model runs in {fwd.dtype}, the native step in float32 only"
    if not fwd.transposed:
        return "the model is too large for the packed weight copies the native step reads"
    if fwd.hd % 8 or fwd.H % fwd.KV:
        return f"head size {fwd.hd} (needs a multiple of 8) or {fwd.H} heads over {fwd.KV} KV heads"
    for L in fwd.layers:
        if type(L.act).__name__ not in ("SiLUActivation", "SiLU"):
            return f"the MLP activation is {type(L.act).__name__}, the native step has SiLU only"
    return None


class NativeStep:
    """step.c bound to one Forward's weights. Callers check rows <= MAX_ROWS, float32 and a contiguous cache."""

    def __init__(self, lib: ctypes.CDLL, fwd: "Forward", bf16: bool = True):
        self.lib = lib
        self.fwd = fwd
        # bf16 panels for every matrix whose float32 values are all bf16 (bf16_exact): same bits, half
        # the bytes; bf16=False keeps float32 panels throughout (the tests compare the two)
        self.bf16 = bf16
        self._packed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(w) -> (w, packed w): LM heads
        self._bound: dict[int, tuple] = {}  # id(FusedLayer) -> (layer, its packed matrices and split biases)
        self.bind()

    def _pack(self, w: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """w packed and whether as bf16, once per weight tensor (the entry holds w, so its id is not
        reused while cached)."""
        hit = self._packed.get(id(w))
        if hit is None or hit[0] is not w:
            as_bf16 = self.bf16 and bf16_exact(w)
            hit = (w, (pack(w, as_bf16), as_bf16))
            self._packed[id(w)] = hit
            while len(self._packed) > 4:  # the LM head and the draft vocabularies tried last (calibrate)
                del self._packed[next(iter(self._packed))]
        return hit[1]

    def _packed_layer(self, L) -> tuple:
        """L's matrices packed and its gate/up bias split, once per layer: an attached exit adapter
        packs only itself."""
        hit = self._bound.get(id(L))
        if hit is None or hit[0] is not L:
            inter = L.down.shape[1]
            gate_b = up_b = None
            if L.gate_up_bias is not None:
                gate_b, up_b = L.gate_up_bias[:inter].contiguous(), L.gate_up_bias[inter:].contiguous()
            full = (L.qkv, L.o, L.gate_up[:inter], L.gate_up[inter:], L.down)
            as_bf16 = self.bf16 and all(bf16_exact(w) for w in full)  # one layout per layer (step.c's wbf16)
            mats = tuple(pack(w, as_bf16) for w in full)
            hit = (L, mats, gate_b, up_b, as_bf16)
        return hit

    def bind(self) -> None:
        """(Re)read the layers' weights: after Forward.add_layer, or a replaced exit adapter."""
        fwd = self.fwd
        layers = (_Layer * len(fwd.layers))()
        bound = {}
        for i, L in enumerate(fwd.layers):
            _, mats, gate_b, up_b, as_bf16 = bound[id(L)] = self._packed_layer(L)
            values = (L.ln1, mats[0], L.qkv_bias, mats[1], L.o_bias, L.ln2, mats[2], gate_b, mats[3], up_b,
                      mats[4], L.down_bias, L.q_norm, L.k_norm)
            for name, t in zip(_LAYER_FIELDS, values):
                if t is not None and not (t.is_contiguous() and t.dtype in (torch.float32, torch.int16)):
                    raise ValueError(f"layer {i}: {name} is not a contiguous float32 (or packed bf16) tensor")
                setattr(layers[i], name, _ptr(t))
            layers[i].wbf16 = int(as_bf16)
        L0 = fwd.layers[0]
        self._bound = bound  # the packed copies the struct points into (a replaced adapter's are dropped)
        self._layers = layers
        self.model = _Model(d=L0.ln1.shape[0], H=fwd.H, KV=fwd.KV, hd=fwd.hd, I=L0.down.shape[1],
                            n_layers=len(fwd.layers), eps=L0.eps, scale=float(fwd.scaling), layers=layers)
        self.n_layers = len(fwd.layers)

    def weights(self) -> str:
        """The packed layers' weight format, in words: "bf16" (every layer's weights are bf16 values, read
        as such), "float32", or how many of each."""
        n = sum(layer.wbf16 for layer in self._layers)
        if n == len(self._layers):
            return "bf16"
        return "float32" if n == 0 else f"bf16 in {n} of {len(self._layers)} layers, float32 in the rest"

    def layers(self, h: torch.Tensor, first: int, last: int, pos: int, seq: "KVSequence", write: bool,
               rope_pos: torch.Tensor | None, mask: torch.Tensor | None) -> torch.Tensor:
        """Forward.layers_range's contract on h [1, t, d]; returns new states (h is not modified)."""
        t = h.shape[1]
        out = h.clone(memory_format=torch.contiguous_format)  # [1, t, d]: step.c works in place
        if rope_pos is not None:
            rope_pos = rope_pos.to(torch.int64).contiguous()
        if mask is not None:
            mask = mask.to(torch.bool).contiguous()  # [t, pos + t], one byte per entry
        rc = self.lib.cd_layers(ctypes.byref(self.model), out.data_ptr(), t, first, last, pos, _ptr(rope_pos),
                                _ptr(mask), int(write), seq.k.data_ptr(), seq.v.data_ptr(), seq.k.shape[2],
                                self.fwd._cos.data_ptr(), self.fwd._sin.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise MemoryError(f"native step: no scratch memory for a {t}-position pass at position {pos}")
        return out

    def head(self, h: torch.Tensor, norm_w: torch.Tensor, eps: float, w: torch.Tensor,
             bias: torch.Tensor | None) -> torch.Tensor:
        """Final norm + LM head rows w [V, d] (packed on first use): h [1, t, d] -> logits [t, V] float32."""
        x = h[0].contiguous()  # [t, d]
        t, d = x.shape
        V = w.shape[0]
        packed, as_bf16 = self._pack(w)
        out = torch.empty(t, V, dtype=torch.float32)
        rc = self.lib.cd_head(x.data_ptr(), t, d, norm_w.data_ptr(), eps, packed.data_ptr(), int(as_bf16), V, _ptr(bias),
                              out.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise MemoryError(f"native head: no scratch memory for {t} positions")
        return out


    def draft_greedy(self, token: int, exit_layer: int, pos: int, k_max: int, threshold: float, seq: "KVSequence",
                     head_w: torch.Tensor, head_b: torch.Tensor | None, ids: torch.Tensor | None,
                     eos: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """Up to k_max greedy early-exit draft tokens after token (step.c's cd_draft_greedy: no Python between
        the draft's steps); returns them and the layer-E states [1, n_fed, d] of the tokens it fed."""
        fwd = self.fwd
        fwd.rope(pos, k_max)
        d = self.model.d
        states = torch.empty(k_max, d, dtype=torch.float32)  # [k_max, d]
        tokens = torch.empty(k_max, dtype=torch.int64)
        fed = ctypes.c_int(0)
        packed, as_bf16 = self._pack(head_w)
        k = self.lib.cd_draft_greedy(ctypes.byref(self.model), fwd.embed_w.data_ptr(), int(token), exit_layer, pos,
                                     k_max, float(threshold), fwd.norm_w.data_ptr(), fwd.norm_eps, packed.data_ptr(),
                                     int(as_bf16), head_w.shape[0], _ptr(head_b), _ptr(ids), eos.data_ptr(), eos.numel(),
                                     seq.k.data_ptr(), seq.v.data_ptr(), seq.k.shape[2], fwd._cos.data_ptr(),
                                     fwd._sin.data_ptr(), torch.get_num_threads(), tokens.data_ptr(),
                                     states.data_ptr(), ctypes.byref(fed))
        if k < 0:
            raise MemoryError(f"native draft: no scratch memory at position {pos}")
        return tokens[:k].tolist(), states[:fed.value][None]  # [1, n_fed, d]

    def verify_greedy(self, tokens: list[int], last: int, pos: int, seq: "KVSequence", head_w: torch.Tensor,
                      head_b: torch.Tensor | None) -> list[int]:
        """The argmax after each of tokens (pending, then the drafts) fed at slots pos.. through layers
        [0, last), their K/V written (step.c's cd_verify_greedy: one call for embed, layers, head and argmax)."""
        fwd = self.fwd
        t = len(tokens)
        fwd.rope(pos, t)
        ids = torch.tensor(tokens, dtype=torch.int64)  # [t]
        out = torch.empty(t, dtype=torch.int64)
        packed, as_bf16 = self._pack(head_w)
        rc = self.lib.cd_verify_greedy(ctypes.byref(self.model), fwd.embed_w.data_ptr(), ids.data_ptr(), t, last, pos,
                                       fwd.norm_w.data_ptr(), fwd.norm_eps, packed.data_ptr(), int(as_bf16),
                                       head_w.shape[0], _ptr(head_b), seq.k.data_ptr(), seq.v.data_ptr(), seq.k.shape[2],
                                       fwd._cos.data_ptr(), fwd._sin.data_ptr(), torch.get_num_threads(), out.data_ptr())
        if rc != 0:
            raise MemoryError(f"native verify: no scratch memory for a {t}-position pass at position {pos}")
        return out.tolist()



def bind(fwd: "Forward") -> tuple[NativeStep | None, str | None]:
    """The native step for fwd, or None and why not."""
    why = unsupported(fwd)
    if why is not None:
        return None, why
    lib = library()
    if lib is None:
        return None, reason()
    return NativeStep(lib, fwd), None
