"""The native decode step (step.c): built once per machine with the system's C compiler, loaded with
ctypes, bound to a Forward's weights, which it packs into panels (float32, bf16 or int8).

Small models on CPU spend most of a decode step in PyTorch's per-op dispatch, larger ones in streaming
their weights; step.c runs a whole range of layers (or the LM head) in one call over packed weights. It
is an accelerator, never a requirement: without a compiler, on a CPU without AVX2/FMA, for
half-precision or GPU models, or with COMPLETIOND_NATIVE=0, the engine keeps the PyTorch path, and
`reason()` says why.

Kernels: step.c is compiled once per instruction set, "avx2" (AVX2 + FMA, the baseline), "avx2-vnni"
(avx2 plus AVX-VNNI), "avx512" (AVX-512 F/DQ/BW/VL: 16-lane panels, 32 registers) and "avx512-vnni"
(avx512 plus AVX512_VNNI).
kernel_name() is the one place that picks the build for this CPU (COMPLETIOND_KERNEL names a narrower
one); avx2 and avx512 compute every float32 and bf16 output column with the same fmadd chain, so they give
the same bits. int8 matrices: avx512 widens the weights (weight-only); avx512-vnni computes them as w8a8,
each activation row quantised to int8 per row, exact int32 sums by vpdpbusd (its own, still row-for-row
exact, arithmetic); avx2 computes them as w8a8 too, with vpmaddubsw/vpmaddwd (widening each weight cost
more there than the bytes int8 saves), on activation rows of 7 bits, within +-63 (act_levels), which
vpmaddubsw's unsigned operand takes as they are: fewer instructions per row than 8 bits, a small accuracy
cost that `completiond bench --quality` measures, and int8 results that differ from avx512-vnni's;
avx2-vnni is avx2 with vpdpbusd on ymm: 8-bit activations, avx512-vnni's int8 results.
"avx512-bf16" (avx512-vnni plus AVX512_BF16) also computes bf16 panels with vdpbf16ps on activation rows
rounded to bf16 (half the instructions of widening the weights, so a verify pass of several rows stays
near the cost of one; a small accuracy cost, which `completiond bench --quality` measures).

The shared objects are cached under ~/.cache/completiond/native/ (a 0700 directory checked for its owner
and mode before use), keyed by the source, the compiler and the kernel, written atomically with their
sha256 beside them, and loaded only after the file's owner, mode and hash are checked: a failed check
builds into a fresh private directory instead, never loading the file. The library links libgomp by
soname, which resolves to the copy torch has already loaded: one OpenMP thread pool for both.

This module never imports forward.py (forward.py imports it): it reads a Forward's attributes only.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import operator
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from completiond.errors import EngineError
from completiond.fileio import user_cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("step.c")
ABI = 14
# Up to this many positions a pass takes the native kernels when the PyTorch path also holds the
# weights (a decode step, a keystroke's few tokens with the pending one, a verify pass of up to 32
# drafted tokens, a token tree); longer prefill chunks keep PyTorch's GEMM. A Forward whose packed panels
# are its only weights (native_all) runs every pass natively.
MAX_ROWS = 33
COMPILE_TIMEOUT_S = 300  # one build per kernel, once per machine: ~15 s on an idle 2-core machine, minutes under load
WEIGHT_FORMATS = ("auto", "bf16", "int8")
KERNELS = {  # kernel -> (cpu flags it needs, compiler flags)
    "avx2": (("avx2", "fma"), ["-mavx2", "-mfma"]),
    # AVX2 plus AVX-VNNI (vpdpbusd on ymm; Intel since Alder Lake, where AVX-512 is off): int8 as w8a8 on
    # 8-bit activations
    "avx2-vnni": (("avx2", "fma", "avx_vnni"), ["-mavx2", "-mfma", "-mavxvnni"]),
    "avx512": (("avx2", "fma", "avx512f", "avx512dq", "avx512bw", "avx512vl"),
               ["-mavx2", "-mfma", "-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl"]),
    # AVX-512 plus vpdpbusd: int8 matrices as w8a8 (activation rows quantised per row), the rest as avx512
    "avx512-vnni": (("avx2", "fma", "avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_vnni"),
                    ["-mavx2", "-mfma", "-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]),
    # avx512-vnni plus vdpbf16ps: bf16 matrices times bf16-rounded activations (every CPU with AVX512_BF16
    # so far has VNNI too: Cooper Lake, Sapphire Rapids, Zen 4)
    "avx512-bf16": (("avx2", "fma", "avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"),
                    ["-mavx2", "-mfma", "-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mavx512vnni",
                     "-mavx512bf16"]),
}
FMT_F32, FMT_BF16, FMT_I8, FMT_BF16_ROWS = 0, 1, 2, 3  # FMT_BF16_ROWS: a bf16 [out, in] matrix unpacked (LM heads)
_FMT_NAMES = {FMT_F32: "float32", FMT_BF16: "bf16", FMT_I8: "int8", FMT_BF16_ROWS: "bf16"}
# step.c's negative return codes
_ERRORS = {-1: "no scratch memory", -2: "a row count, layer range or size out of range",
           -3: "a slot outside the KV cache's capacity", -4: "a token id outside the vocabulary",
           -5: "a rotary position outside the rope tables"}


class NativeError(EngineError):
    """step.c refused its arguments (or had no memory)."""


_LAYER_FIELDS = ("ln1", "qkv", "qkv_b", "o", "o_b", "ln2", "gate", "gate_b", "up", "up_b", "down", "down_b",
                 "q_norm", "k_norm", "qkv_s", "o_s", "gate_s", "up_s", "down_s")
PANEL = 16  # output columns per panel of a packed matrix (step.c's PW)
# a bf16 panel row stores column c at half 2c (c < 8) and 2(c - 8) + 1: step.c widens it with one shift
# and one mask (LOAD_BF16)
_BF16_ORDER = [c for i in range(8) for c in (i, i + 8)]


class _Layer(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in _LAYER_FIELDS] + [("wfmt", ctypes.c_int32)]


class _Model(ctypes.Structure):
    _fields_ = [("d", ctypes.c_int32), ("H", ctypes.c_int32), ("KV", ctypes.c_int32), ("hd", ctypes.c_int32),
                ("I", ctypes.c_int32), ("n_layers", ctypes.c_int32), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("layers", ctypes.POINTER(_Layer)), ("vocab", ctypes.c_int32),
                ("rope_len", ctypes.c_int32)]


_libs: dict[str, ctypes.CDLL | None] = {}  # kernel -> loaded library (None: failed, _reasons says why)
_reasons: dict[str, str] = {}
_logged: set[str] = set()  # the fallbacks library() has warned about ("": to the PyTorch path)


def cache_dir() -> Path:
    return user_cache_dir() / "completiond" / "native"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def supported_kernels() -> list[str]:
    """The kernels this CPU can run, baseline first."""
    flags = set(_cpu_flags().split())
    return [k for k, (need, _) in KERNELS.items() if set(need) <= flags]


def kernel_name() -> str:
    """The one decision of which kernel runs: the widest this CPU supports, or COMPLETIOND_KERNEL when it
    names one the CPU can run; "none" when the CPU has no AVX2/FMA."""
    usable = supported_kernels()
    if not usable:
        return "none"
    forced = os.environ.get("COMPLETIOND_KERNEL", "").strip().lower()
    if forced in usable:
        return forced
    return usable[-1]


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc) or cc
    return shutil.which("gcc") or shutil.which("cc")


def _private_dir_ok(path: Path) -> str | None:
    """Why path is not a directory only this user can write into (None: it is)."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if st.st_uid != os.geteuid():
        return f"{path} belongs to uid {st.st_uid}, not to this user"
    if st.st_mode & 0o077:
        return f"{path} has mode {stat.S_IMODE(st.st_mode):o}, not 700"
    return None


def _tightenable(path: Path) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022


def _file_ok(path: Path) -> str | None:
    """Why the cached library at path must not be loaded (None: its owner, mode and sha256 check out)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "absent"
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file"
    if st.st_uid != os.geteuid():
        return f"{path} belongs to uid {st.st_uid}, not to this user"
    if st.st_mode & 0o022:
        return f"{path} is group- or world-writable (mode {stat.S_IMODE(st.st_mode):o})"
    digest_path = path.with_name(path.name + ".sha256")
    try:
        want = digest_path.read_text(encoding="ascii").strip()
        got = hashlib.sha256(path.read_bytes()).hexdigest()
    except (OSError, UnicodeDecodeError) as exc:
        return f"no readable content hash beside {path} ({exc})"
    if got != want:
        return f"{path}'s content does not match the sha256 stored when it was built"
    return None


def _cache_for(kernel: str) -> Path:
    """The private cache directory: created 0700; one that fails the owner/mode check is not used, a
    fresh private directory stands in for it (this process only)."""
    d = cache_dir()
    try:
        d.parent.mkdir(parents=True, exist_ok=True)
        d.mkdir(mode=0o700, exist_ok=True)
    except OSError:
        pass
    why = _private_dir_ok(d)
    if why is not None and _tightenable(d):
        # ours, and never writable by anyone else (an older version made it 755): nothing can have been
        # planted in it, so taking the read bits away is enough
        try:
            os.chmod(d, 0o700)
        except OSError:
            pass
        why = _private_dir_ok(d)
    if why is None:
        return d
    fresh = Path(tempfile.mkdtemp(prefix=f"completiond-native-{kernel}-"))  # 0700, ours
    log.warning("native step cache not used (%s); building into %s instead", why, fresh)
    return fresh


def _build(cc: str, kernel: str) -> Path:
    """The checked cached shared object for this source, compiler and kernel, compiled if absent or if
    the cached one fails its checks."""
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"C compiler {cc!r} does not run: {exc}") from None
    source = SOURCE.read_bytes()
    flags = KERNELS[kernel][1]
    key = hashlib.sha256(b"\0".join([source, cc.encode(), version.encode(), " ".join(flags).encode(),
                                     platform.machine().encode()])).hexdigest()[:16]
    directory = _cache_for(kernel)
    out = directory / f"step-{kernel}-{key}.so"
    why = _file_ok(out)
    if why is None:
        return out
    if why != "absent":
        log.warning("native step: not loading the cached library (%s); building it again", why)
    fd, tmp = tempfile.mkstemp(prefix=".step-", suffix=".so", dir=directory)
    os.close(fd)
    cmd = [cc, "-O3", *flags, "-fopenmp", "-fPIC", "-shared", "-o", tmp, str(SOURCE), "-lm"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError(f"{' '.join(cmd[:2])} ... failed (exit {done.returncode}): {first}")
        os.chmod(tmp, 0o755)
        digest = hashlib.sha256(Path(tmp).read_bytes()).hexdigest()
        fd, tmp_hash = tempfile.mkstemp(prefix=".step-", suffix=".sha256", dir=directory)
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(digest + "\n")
        os.replace(tmp_hash, out.with_name(out.name + ".sha256"))
        os.replace(tmp, out)  # atomic: another process sees the whole file or none
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"compiling {SOURCE.name} took over {COMPILE_TIMEOUT_S} s") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    why = _file_ok(out)  # what is loaded is what was checked (a concurrent build may have replaced it)
    if why is not None:
        raise RuntimeError(f"the freshly built library fails its check: {why}")
    return out


def library(kernel: str | None = None) -> ctypes.CDLL | None:
    """The loaded native library for kernel, built on first use; None (and reason() says why) when
    unavailable. Without a kernel: kernel_name()'s build, or where that one cannot be built or loaded (a
    compiler or assembler older than the CPU: no -mavx512bf16, no vpdpbusd) the next narrower build this
    CPU runs, down to avx2, with a warning naming what failed."""
    if kernel is not None:
        return _load(kernel)
    order = _order()
    for k in order:
        lib = _load(k)
        if lib is not None:
            if k != order[0] and k not in _logged:
                _logged.add(k)
                log.warning("native step: using the %s kernels, not %s (%s)", k, order[0], reason())
            return lib
    if "" not in _logged and _unavailable(order[0]) is None:  # it should have worked: say so, once
        _logged.add("")
        log.warning("%s; using the PyTorch path", reason())
    return None


def _order() -> list[str]:
    """The builds library() tries: kernel_name()'s, then the narrower ones this CPU runs, widest first."""
    chosen, usable = kernel_name(), supported_kernels()
    return [chosen] + (usable[:usable.index(chosen)][::-1] if chosen in usable else [])


def _load(kernel: str) -> ctypes.CDLL | None:
    """library(kernel): this one build or None."""
    if kernel in _libs:
        return _libs[kernel]
    _libs[kernel] = None
    why = _unavailable(kernel)
    if why is not None:
        _reasons[kernel] = why
        return None
    cc = _compiler()
    try:
        path = _build(cc, kernel)
        lib = ctypes.CDLL(str(path))
        if lib.cd_abi() != ABI:
            raise RuntimeError(f"{path} has ABI {lib.cd_abi()}, expected {ABI}")
    except (OSError, RuntimeError) as exc:
        _reasons[kernel] = f"cannot build or load the native step: {exc}"
        return None
    _libs[kernel] = typed(lib)
    return lib


def typed(lib: ctypes.CDLL) -> ctypes.CDLL:
    """lib with its entry points' argument and result types declared (ctypes calls them unchecked otherwise)."""
    i32, f32, vp, i64 = ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int64
    lib.cd_kernel.restype = ctypes.c_char_p
    lib.cd_bf16_pairs.restype = ctypes.c_int
    lib.cd_i8_quads.restype = ctypes.c_int
    lib.cd_act_levels.restype = ctypes.c_int
    lib.cd_bf16_dot.restype = ctypes.c_int
    lib.cd_gemm.argtypes = [vp, i32, i32, vp, i32, vp, i32, vp, vp]
    lib.cd_gemm.restype = i32
    lib.cd_arith.argtypes = [vp, i32, i32, vp, i32, vp, i32, vp, i32, i32]
    lib.cd_arith.restype = i32
    lib.cd_layers.argtypes = [ctypes.POINTER(_Model), vp, i32, i32, i32, i32, vp, vp, i32, vp, vp, i32, vp, vp, i32]
    lib.cd_layers.restype = i32
    lib.cd_head.argtypes = [vp, i32, i32, vp, f32, vp, i32, vp, i32, vp, vp, i32]
    lib.cd_head.restype = i32
    lib.cd_draft_greedy.argtypes = [ctypes.POINTER(_Model), vp, i32, i64, i32, i32, i32, f32, vp, f32, vp, i32, vp,
                                    i32, vp, vp, vp, i32, vp, vp, i32, vp, vp, i32, vp, vp, ctypes.POINTER(ctypes.c_int)]
    lib.cd_draft_greedy.restype = i32
    lib.cd_verify_greedy.argtypes = [ctypes.POINTER(_Model), vp, i32, vp, i32, i32, i32, vp, f32, vp, i32, vp, i32,
                                     vp, vp, vp, i32, vp, vp, i32, vp]
    lib.cd_verify_greedy.restype = i32
    return lib


def _unavailable(kernel: str) -> str | None:
    if os.environ.get("COMPLETIOND_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        return "turned off by COMPLETIOND_NATIVE=0"
    if platform.system() == "Windows" or platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the native step is written for x86-64 with AVX2/FMA, not {platform.machine()}"
    if kernel not in supported_kernels():
        return "this CPU lacks AVX2 or FMA" if kernel in ("avx2", "none") else f"this CPU cannot run {kernel} kernels"
    if _compiler() is None:
        return "no C compiler (gcc or cc, or $CC) on PATH"
    return None


def reason(kernel: str | None = None) -> str | None:
    """Why kernel's build is unavailable; without a kernel, why kernel_name()'s is (and, where every
    narrower one failed too, why each did)."""
    if kernel is not None:
        return _reasons.get(kernel)
    order = _order()
    failed = [k for k in order if k in _reasons]
    if len(order) > 1 and len(failed) == len(order):
        return "; ".join(f"{k}: {_reasons[k]}" for k in order)
    return _reasons.get(order[0])


def _reset_for_tests() -> None:
    _libs.clear()
    _reasons.clear()
    _logged.clear()


def trim_heap() -> None:
    """Give freed heap pages back to the system (glibc's malloc_trim): the unpacked weights dropped after
    packing were many mid-sized blocks, which glibc keeps mapped otherwise, so resident memory would
    still count them."""
    try:
        libc = ctypes.CDLL(None)
        libc.malloc_trim(ctypes.c_size_t(0))
    except (OSError, AttributeError):
        pass  # not glibc: nothing to trim with


def _as_int(v: Any, what: str) -> int:
    try:
        return operator.index(v)  # ints, numpy and 0-d torch integers; not floats or strings
    except TypeError:
        raise NativeError(f"native {what}: {v!r} is not an integer") from None


def _check(rc: int, what: str) -> int:
    if rc < 0:
        raise NativeError(f"native {what}: {_ERRORS.get(rc, f'error {rc}')}")
    return rc


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def bf16_exact(w: torch.Tensor) -> bool:
    """Whether every value of w is a bfloat16 widened to float32 (a model shipped in bf16 and run in
    float32): then its bf16 copy is lossless and step.c computes the very same products from half the bytes."""
    return bool(torch.equal(w.to(torch.bfloat16).to(torch.float32), w))


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 of w [out, in]: (q [out, in] int8, scale [out] float32) with
    w ~ q * scale. A row depends only on its own values, so a subset of rows (a draft vocabulary) gets the
    very values of the full matrix."""
    q, scale, _ = _quantize_rows(w, False)
    return q, scale


def _quantize_rows(w: torch.Tensor, sums: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """quantize_int8's (q, scale), and with sums each row's sum of q (int32), taken while the row is at hand.

    In blocks of rows of about 4 MB of float32, each converted, scaled and rounded while it is in cache:
    over the whole matrix at once, five float32 passes through memory (and an int8 sum) took about 15 s of a
    1.5B model's int8 load. The values are the same: each row's scale and each weight's rounding are its own."""
    out, inp = w.shape
    q = torch.empty(out, inp, dtype=torch.int8)
    scale = torch.empty(out, dtype=torch.float32)
    # a float32 sum of at most 2^24 / 127 integers within +-127 is exact, in any order
    row_sums = torch.empty(out, dtype=torch.int32) if sums and inp * 127 < 1 << 24 else None
    step = max(1, (4 << 20) // (4 * max(inp, 1)))
    for a in range(0, out, step):
        x = w[a:a + step].to(torch.float32, copy=True)  # [rows, in], its own copy: rounded in place
        amax = x.abs().amax(dim=1)                      # [rows]
        sc = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
        torch.round(x.div_(sc[:, None]), out=x).clamp_(-127, 127)
        q[a:a + step] = x                               # integers within +-127: exact in int8
        scale[a:a + step] = sc
        if row_sums is not None:
            row_sums[a:a + step] = x.sum(dim=1)
    if sums and row_sums is None:
        row_sums = q.sum(dim=1, dtype=torch.int32)
    return q, scale, row_sums


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 weights an int8 matrix stands for (tests and the PyTorch reference)."""
    return q.float() * scale[:, None]


def pack(w: torch.Tensor, bf16: bool = False) -> torch.Tensor:
    """A linear's weight [out, in] as step.c reads it: panels of PANEL output columns, each [in, PANEL]
    row-major, so a kernel streams its panel front to back; zero columns pad the last one. bf16: the
    same panels as bfloat16 bits (int16), columns in step.c's LOAD_BF16 order; w must be bf16_exact
    (or is rounded to bf16)."""
    return pack_as(w, FMT_BF16 if bf16 else FMT_F32)[0]


def pack_as(w: torch.Tensor, fmt: int, pairs: bool = False,
            quads: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """w [out, in] packed in format fmt: (panels, column scales padded to whole panels, int8 only).
    pairs (bf16, the AVX-512 build's layout): each panel as [ceil(in/2), PANEL, 2], column c's weights at
    k and k + 1 side by side (an odd in is padded with a zero k).
    quads (int8, the avx512-vnni build's layout): each panel as [ceil(in/4), PANEL, 4] (zero-padded k),
    and the scales followed by 128 * sum_k q[j, k] per padded column as int32 bits, which takes out the
    +128 offset of the u8 activations vpdpbusd multiplies."""
    out, inp = w.shape
    panels = -(-out // PANEL)
    # Each layout is one copy out of a [panels, PANEL, k] view of the padded matrix (a model's sizes are
    # mostly whole panels, so usually no padding copy either): packing a 1.5B model took 3.3 s of its
    # load with a gather over the transposed panels, and reordering whole rows first is 4x faster.
    if fmt == FMT_I8:
        q, scale, row_sums = _quantize_rows(w, quads)
        scales = torch.ones(panels * PANEL, dtype=torch.float32)
        scales[:out] = scale
        if quads:
            in4 = -(-inp // 4) * 4
            q4 = _padded(q, panels * PANEL, in4)
            corr = torch.zeros(panels * PANEL, dtype=torch.int32)  # [panels * PANEL]: padded columns sum to 0
            corr[:out] = row_sums * 128
            packed = q4.view(panels, PANEL, in4 // 4, 4).transpose(1, 2).contiguous()  # [panels, in4/4, PANEL, 4]
            return packed, torch.cat([scales, corr.view(torch.float32)])
        return _padded(q, panels * PANEL, inp).view(panels, PANEL, inp).transpose(1, 2).contiguous(), scales
    if fmt == FMT_F32:
        return _padded(w.float(), panels * PANEL, inp).view(panels, PANEL, inp).transpose(1, 2).contiguous(), None
    src = w.to(torch.bfloat16)  # a bf16 model's own values as they are; float32 rounded to bf16
    if pairs:
        in2 = inp + inp % 2
        pairs_ = _padded(src, panels * PANEL, in2).view(panels, PANEL, in2 // 2, 2).transpose(1, 2)
        return pairs_.contiguous().view(torch.int16), None  # [panels, in/2, PANEL, 2]
    rows = _padded(src, panels * PANEL, inp).view(panels, PANEL, inp)[:, _BF16_ORDER]  # each panel's rows in
    return rows.transpose(1, 2).contiguous().view(torch.int16), None                  # LOAD_BF16's order


def _padded(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """t [r, c] zero-padded to [rows, cols] (t itself, contiguous, when it is that size already)."""
    if t.shape == (rows, cols):
        return t.contiguous()
    out = torch.zeros(rows, cols, dtype=t.dtype)
    out[:t.shape[0], :t.shape[1]] = t
    return out


def unsupported(fwd: Any) -> str | None:
    """Why this Forward cannot use the native step (None: it can)."""
    if str(fwd.device) != "cpu":
        return f"the model runs on {fwd.device}"
    if fwd.dtype != torch.float32:
        return f"the model runs in {fwd.dtype}, the native step in float32 only"
    if fwd.hd % 8 or fwd.H % fwd.KV:
        return f"head size {fwd.hd} (needs a multiple of 8) or {fwd.H} heads over {fwd.KV} KV heads"
    for L in fwd.layers:
        why = _activation_unsupported(L.act)
        if why is not None:
            return why
    return None


def _activation_unsupported(act: Any) -> str | None:
    if type(act).__name__ not in ("SiLUActivation", "SiLU"):
        return f"the MLP activation is {type(act).__name__}, the native step has SiLU only"
    return None


def early_step(fwd: Any, adapter: Any, weights: str) -> "NativeStep | None":
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


def _format_for(weights: str, mats: tuple[torch.Tensor, ...]) -> int:
    """The panel format of a group of matrices under the weights setting: auto keeps the values (bf16
    panels when every value is a bf16, float32 otherwise), bf16 rounds, int8 quantises."""
    if weights == "int8":
        return FMT_I8
    if weights == "float32":  # float32 panels whatever the values (tests compare them with bf16 panels)
        return FMT_F32
    if weights == "bf16" or all(w.dtype == torch.bfloat16 or bf16_exact(w) for w in mats):
        return FMT_BF16
    return FMT_F32


class NativeStep:
    """step.c bound to one Forward's weights, packed into panels in the format `weights` asks for.
    Callers check rows <= MAX_ROWS (or fwd.native_all), float32 and a contiguous cache.

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
            values = (L.ln1, mats[0], L.qkv_bias, mats[1], L.o_bias, L.ln2, mats[2], gate_b, mats[3], up_b,
                      mats[4], L.down_bias, L.q_norm, L.k_norm, *scales)
            for name, t in zip(_LAYER_FIELDS, values):
                if t is not None and not (t.is_contiguous() and t.dtype in (torch.float32, torch.int16, torch.int8)):
                    raise ValueError(f"layer {i}: {name} is not a contiguous float32 (or packed) tensor")
                setattr(layers[i], name, _ptr(t))
            layers[i].wfmt = fmt
            self._bound[id(L)] = bound[id(L)]  # kept as packed (a later layer's failure must not repack it)
        L0 = bound[id(fwd.layers[0])]
        self._bound = bound  # the packed copies the struct points into (a replaced adapter's are dropped)
        self._layers = layers
        self.model = _Model(d=fwd.layers[0].ln1.shape[0], H=fwd.H, KV=fwd.KV, hd=fwd.hd, I=L0[6],
                            n_layers=len(fwd.layers), eps=fwd.layers[0].eps, scale=float(fwd.scaling), layers=layers,
                            vocab=fwd.embed_w.shape[0], rope_len=0)
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

    def arithmetic_rate(self, fmt: int, rows: int, seconds: float = 0.1, repeats: int = 5,
                        cache_bytes: int = 128 << 10) -> float:
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
            _check(self.lib.cd_arith(x.data_ptr(), rows, d, packed.data_ptr(), fmt, _ptr(scales), cols, y.data_ptr(),
                                     reps, threads), f"arithmetic timing at {rows} rows")
            return time.perf_counter() - t0

        reps = 4
        while (took := timed(reps)) < seconds / 4 and reps < 1 << 24:  # warms up and sizes the repeats
            reps *= 4
        reps = max(1, round(reps * seconds / took))
        import statistics   # here, not at the top: it imports decimal, about 0.5 MiB resident the daemon never uses

        return nbytes * reps / statistics.median(timed(reps) for _ in range(repeats))

    def _rope(self) -> None:
        self.model.rope_len = self.fwd._cos.shape[0]

    def _embed(self) -> tuple[int, int]:
        e = self.fwd.embed_w
        return e.data_ptr(), int(e.dtype == torch.bfloat16)

    def layers(self, h: torch.Tensor, first: int, last: int, pos: int, seq: Any, write: bool,
               rope_pos: torch.Tensor | None, mask: torch.Tensor | None) -> torch.Tensor:
        """Forward.layers_range's contract on h [1, t, d]; returns new states (h is not modified)."""
        t = h.shape[1]
        self._check_args("layers", seq, pos, t, first, last)
        if h.dim() != 3 or h.shape[0] != 1 or h.shape[2] != self.model.d:
            raise NativeError(f"native layers: hidden states of shape {tuple(h.shape)}, expected [1, t, {self.model.d}]")
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
        _check(self.lib.cd_layers(ctypes.byref(self.model), out.data_ptr(), t, first, last, pos, _ptr(rope_pos),
                                  _ptr(mask), int(write), seq.k.data_ptr(), seq.v.data_ptr(), seq.k.shape[2],
                                  self.fwd._cos.data_ptr(), self.fwd._sin.data_ptr(), torch.get_num_threads()),
               f"step of {t} rows at slot {pos}, layers [{first}, {last})")
        return out

    def _check_args(self, what: str, seq: Any, pos: int, t: int, first: int, last: int,
                    tokens: list[int] | None = None) -> None:
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
        if k.dim() != 4 or k.shape[0] < last or tuple(k.shape[1:2]) + tuple(k.shape[3:]) != (self.model.KV, self.model.hd) \
                or k.shape != v.shape or k.dtype != torch.float32 or v.dtype != torch.float32 \
                or not (k.is_contiguous() and v.is_contiguous()):
            raise NativeError(f"native step: a KV cache of shape {tuple(k.shape)} {k.dtype}, expected "
                              f"[>= {last}, {self.model.KV}, capacity, {self.model.hd}] float32, contiguous")

    def head(self, h: torch.Tensor, norm_w: torch.Tensor, eps: float, w: torch.Tensor,
             bias: torch.Tensor | None) -> torch.Tensor:
        """Final norm + LM head rows w [V, d] (packed on first use): h [1, t, d] -> logits [t, V] float32."""
        x = h[0].to(torch.float32).contiguous()  # [t, d]
        t, d = x.shape
        V = w.shape[0]
        if w.shape[1] != d or d != self.model.d:
            raise NativeError(f"native head: rows of width {w.shape[1]} for states of width {d}")
        packed, fmt, scales = self._pack(w)
        out = torch.empty(t, V, dtype=torch.float32)
        _check(self.lib.cd_head(x.data_ptr(), t, d, norm_w.data_ptr(), eps, packed.data_ptr(), fmt, _ptr(scales), V,
                                _ptr(bias), out.data_ptr(), torch.get_num_threads()), f"head over {t} rows")
        return out

    def draft_greedy(self, token: int, exit_layer: int, pos: int, k_max: int, threshold: float, seq: Any,
                     head_w: torch.Tensor, head_b: torch.Tensor | None, ids: torch.Tensor | None,
                     eos: torch.Tensor) -> tuple[list[int], torch.Tensor]:
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
        k = _check(self.lib.cd_draft_greedy(
            ctypes.byref(self.model), embed, ebf16, int(token), exit_layer, pos, k_max, float(threshold),
            fwd.norm_w.data_ptr(), fwd.norm_eps, packed.data_ptr(), fmt, _ptr(scales), head_w.shape[0], _ptr(head_b),
            _ptr(ids), eos.data_ptr(), eos.numel(), seq.k.data_ptr(), seq.v.data_ptr(), seq.k.shape[2],
            fwd._cos.data_ptr(), fwd._sin.data_ptr(), torch.get_num_threads(), tokens.data_ptr(), states.data_ptr(),
            ctypes.byref(fed)), f"draft of {k_max} tokens at slot {pos}")
        return tokens[:k].tolist(), states[:fed.value][None]  # [1, n_fed, d]

    def verify_greedy(self, tokens: list[int], last: int, pos: int, seq: Any, head_w: torch.Tensor,
                      head_b: torch.Tensor | None) -> list[int]:
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
        _check(self.lib.cd_verify_greedy(
            ctypes.byref(self.model), embed, ebf16, ids.data_ptr(), t, last, pos, fwd.norm_w.data_ptr(), fwd.norm_eps,
            packed.data_ptr(), fmt, _ptr(scales), head_w.shape[0], _ptr(head_b), seq.k.data_ptr(), seq.v.data_ptr(),
            seq.k.shape[2], fwd._cos.data_ptr(), fwd._sin.data_ptr(), torch.get_num_threads(), out.data_ptr()),
            f"verify of {t} tokens at slot {pos}")
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
