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

The parts: build.py (the build cache: which kernel, compiled and checked once per machine), packing.py
(panels and int8 quantisation), abi.py (step.c's structs and signatures), binding.py (NativeStep, a
Forward's weights bound to a loaded build) and support.py (whether the step can run a model). This package
re-exports their public names.
"""

from __future__ import annotations

from completiond.engine.native import abi, binding, build, packing
from completiond.engine.native.abi import ABI, NativeError, typed
from completiond.engine.native.binding import (
    MAX_ROWS,
    WEIGHT_FORMATS,
    NativeStep,
    bind,
    early_step,
)
from completiond.engine.native.build import (
    COMPILE_TIMEOUT_S,
    KERNELS,
    SOURCE,
    _reset_for_tests,
    build_pending,
    cache_dir,
    kernel_name,
    library,
    reason,
    supported_kernels,
)
from completiond.engine.native.packing import (
    FMT_BF16,
    FMT_BF16_ROWS,
    FMT_F32,
    FMT_I8,
    PANEL,
    bf16_exact,
    dequantize_int8,
    pack,
    pack_as,
    quantize_int8,
)
from completiond.engine.native.support import trim_heap, unsupported

__all__ = [
    "ABI",
    "COMPILE_TIMEOUT_S",
    "FMT_BF16",
    "FMT_BF16_ROWS",
    "FMT_F32",
    "FMT_I8",
    "KERNELS",
    "MAX_ROWS",
    "PANEL",
    "SOURCE",
    "WEIGHT_FORMATS",
    "NativeError",
    "NativeStep",
    "_reset_for_tests",
    "build_pending",
    "abi",
    "bf16_exact",
    "bind",
    "binding",
    "build",
    "cache_dir",
    "dequantize_int8",
    "early_step",
    "kernel_name",
    "library",
    "pack",
    "pack_as",
    "packing",
    "quantize_int8",
    "reason",
    "supported_kernels",
    "trim_heap",
    "typed",
    "unsupported",
]
