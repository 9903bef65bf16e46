"""step.c's ABI as ctypes sees it: the structs it reads, its entry points' signatures and error codes.

A build whose cd_abi() differs from ABI is never loaded (build.py checks it).
"""

from __future__ import annotations

import ctypes
import operator
from typing import Any

import torch

from completiond.errors import EngineError

ABI = 15
# step.c's negative return codes
_ERRORS = {
    -1: "no scratch memory",
    -2: "a row count, layer range or size out of range",
    -3: "a slot outside the KV cache's capacity",
    -4: "a token id outside the vocabulary",
    -5: "a rotary position outside the rope tables",
}


class NativeError(EngineError):
    """step.c refused its arguments (or had no memory)."""


_LAYER_FIELDS = (
    "ln1",
    "qkv",
    "qkv_b",
    "o",
    "o_b",
    "ln2",
    "gate",
    "gate_b",
    "up",
    "up_b",
    "down",
    "down_b",
    "q_norm",
    "k_norm",
    "qkv_s",
    "o_s",
    "gate_s",
    "up_s",
    "down_s",
)


class _Layer(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in _LAYER_FIELDS] + [("wfmt", ctypes.c_int32)]


class _Model(ctypes.Structure):
    _fields_ = [
        ("d", ctypes.c_int32),
        ("H", ctypes.c_int32),
        ("KV", ctypes.c_int32),
        ("hd", ctypes.c_int32),
        ("I", ctypes.c_int32),
        ("n_layers", ctypes.c_int32),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("layers", ctypes.POINTER(_Layer)),
        ("vocab", ctypes.c_int32),
        ("rope_len", ctypes.c_int32),
    ]


def typed(lib: ctypes.CDLL) -> ctypes.CDLL:
    """lib with its entry points' argument and result types declared (ctypes calls them unchecked otherwise)."""
    i32, f32, vp, i64 = ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int64
    lib.cd_kernel.restype = ctypes.c_char_p
    lib.cd_bf16_pairs.restype = ctypes.c_int
    lib.cd_i8_quads.restype = ctypes.c_int
    lib.cd_act_levels.restype = ctypes.c_int
    lib.cd_bf16_dot.restype = ctypes.c_int
    lib.cd_amx_ready.restype = ctypes.c_int
    lib.cd_gemm.argtypes = [vp, i32, i32, vp, i32, vp, i32, vp, vp]
    lib.cd_gemm.restype = i32
    lib.cd_arith.argtypes = [vp, i32, i32, vp, i32, vp, i32, vp, i32, i32]
    lib.cd_arith.restype = i32
    lib.cd_layers.argtypes = [ctypes.POINTER(_Model), vp, i32, i32, i32, i32, vp, vp, i32, vp, vp, i32, vp, vp, i32]
    lib.cd_layers.restype = i32
    lib.cd_head.argtypes = [vp, i32, i32, vp, f32, vp, i32, vp, i32, vp, vp, i32]
    lib.cd_head.restype = i32
    lib.cd_draft_greedy.argtypes = [
        ctypes.POINTER(_Model),
        vp,
        i32,
        i64,
        i32,
        i32,
        i32,
        f32,
        vp,
        f32,
        vp,
        i32,
        vp,
        i32,
        vp,
        vp,
        vp,
        i32,
        vp,
        vp,
        i32,
        vp,
        vp,
        i32,
        vp,
        vp,
        ctypes.POINTER(ctypes.c_int),
    ]
    lib.cd_draft_greedy.restype = i32
    lib.cd_verify_greedy.argtypes = [
        ctypes.POINTER(_Model),
        vp,
        i32,
        vp,
        i32,
        i32,
        i32,
        vp,
        f32,
        vp,
        i32,
        vp,
        i32,
        vp,
        vp,
        vp,
        i32,
        vp,
        vp,
        i32,
        vp,
    ]
    lib.cd_verify_greedy.restype = i32
    return lib


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
