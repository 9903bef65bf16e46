"""The w8a8 int8 kernels (issue 27 item 3): in the VNNI builds (avx2-vnni, avx512-vnni, avx512-bf16:
vpdpbusd sums; emulated over AVX2 where the CPU lacks the instructions, tests/emulated_kernels.py) and in the
AVX2 build (vpmaddubsw / vpmaddwd sums), int8 matrices run as w8a8 (each activation row quantised symmetric
per row, within +-127 on VNNI and +-63 on AVX2: cd_act_levels): exactly the integer arithmetic of a
reference, every row of a 33-row pass the bits of a one-row pass, and speculative greedy output equal to
plain greedy output under int8 weights.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from completiond.engine import native
from completiond.engine.engine import Engine, SamplingParams
from tests import emulated_kernels
from tests.conftest import make_tiny_model

VNNI = "avx512-vnni"


def kernel_lib(kernel: str, monkeypatch: pytest.MonkeyPatch | None = None):
    """kernel's build: this CPU's own, or, for an AVX-512 build it cannot run, the emulated one
    (tests/emulated_kernels.py); with monkeypatch, the engine picks it too."""
    return emulated_kernels.library(kernel, monkeypatch)


def _vnni_lib():
    return kernel_lib(VNNI)


# the builds that compute int8 matrices as w8a8 (avx512-bf16 is avx512-vnni's int8 code), and their
# activation levels
LEVELS = {"avx2": 63, "avx2-vnni": 127, VNNI: 127, "avx512-bf16": 127, "avx512-amx": 127}


def test_the_vnni_kernel_is_chosen_exactly_where_the_cpu_has_it(monkeypatch):
    monkeypatch.delenv("COMPLETIOND_KERNEL", raising=False)
    flags = set(native.build._cpu_flags().split())
    if {"avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_vnni"} <= flags:
        # the widest build this CPU runs is the VNNI one or one above it (avx512-bf16, avx512-amx), w8a8 in all
        assert native.kernel_name() in (VNNI, "avx512-bf16", "avx512-amx") and native.library().cd_i8_quads() == 1
        lib = _vnni_lib()
        assert lib.cd_kernel().decode() == VNNI and lib.cd_i8_quads() == 1
        assert native.library("avx512").cd_i8_quads() == 0  # the plain AVX-512 build keeps weight-only int8
    else:
        assert native.library("avx2").cd_i8_quads() == 1  # AVX2 without VNNI: w8a8 with vpmaddubsw
        assert VNNI not in native.supported_kernels() and native.kernel_name() != VNNI


def test_avx_vnni_without_avx512_picks_the_avx2_vnni_build(monkeypatch):
    """The dispatch alone (flags as /proc/cpuinfo names them): AVX-VNNI without AVX-512 (Alder Lake and
    later) gets avx2-vnni; with AVX-512 too (Sapphire Rapids) the AVX-512 builds stay wider."""
    monkeypatch.delenv("COMPLETIOND_KERNEL", raising=False)
    monkeypatch.setattr(native.build, "_cpu_flags", lambda: "sse2 avx avx2 fma avx_vnni")
    assert native.supported_kernels() == ["avx2", "avx2-vnni"] and native.kernel_name() == "avx2-vnni"
    monkeypatch.setenv("COMPLETIOND_KERNEL", "avx2")  # a narrower one, as a user may ask
    assert native.kernel_name() == "avx2"
    monkeypatch.delenv("COMPLETIOND_KERNEL")
    monkeypatch.setattr(native.build, "_cpu_flags", lambda: "avx2 fma avx_vnni avx512f avx512dq avx512bw avx512vl "
                                                      "avx512_vnni avx512_bf16")
    monkeypatch.setattr(native.build, "bf16_dot_speed", lambda: None)  # stood-in flags: this CPU's probe does not say
    assert native.kernel_name() == "avx512-bf16"
    assert native.build._order() == ["avx512-bf16", "avx512-vnni", "avx512", "avx2-vnni", "avx2"]  # library()'s fallbacks


def _w8a8_reference(x: np.ndarray, w: torch.Tensor, bias: np.ndarray, levels: int) -> np.ndarray:
    """The w8a8 kernels' arithmetic in numpy: per-row symmetric activations within +-levels (round half to
    even), exact integer sums, then ((float)sum * weight scale) * row scale + bias, each op rounded to
    float32."""
    q, wscale = native.quantize_int8(w)
    f32 = np.float32
    amax = np.abs(x).max(axis=1)
    inv = np.where(amax > 0, f32(levels) / np.where(amax > 0, amax, f32(1.0)), f32(0.0)).astype(f32)
    xq = np.rint(np.clip(x * inv[:, None], f32(-levels), f32(levels))).astype(np.int64)
    assert np.abs(xq).max() == levels  # the test's rows reach the ends of the range
    xs = (amax / f32(levels)).astype(f32)
    acc = xq @ q.numpy().astype(np.int64).T  # exact
    assert np.abs(acc).max() < 2**31
    y = (acc.astype(f32) * wscale.numpy()) * xs[:, None]
    return (y + bias).astype(f32)


@pytest.mark.parametrize("kernel", sorted(LEVELS))
@pytest.mark.parametrize("width,out", [(37, 50), (64, 16), (896, 70), (4864, 33)])
def test_w8a8_int8_is_exactly_the_w8a8_reference_and_row_for_row(kernel, width, out):
    lib = kernel_lib(kernel)
    assert lib.cd_i8_quads() == 1 and lib.cd_act_levels() == LEVELS[kernel]
    g = torch.Generator().manual_seed(width)
    t = 33
    w = torch.randn(out, width, generator=g)
    x = torch.randn(t, width, generator=g)
    x[3] = 0.0  # a zero row: scale 0, the bias alone
    x[5, 7 % width] = 40.0  # an outlier sets its row's scale
    bias = torch.randn(out, generator=g)
    packed, scales = native.pack_as(w, native.FMT_I8, pairs=True, quads=True)
    assert packed.shape == (-(-out // 16), -(-width // 4), 16, 4)

    def run(rows: torch.Tensor) -> torch.Tensor:
        rows = rows.contiguous()
        y = torch.empty(rows.shape[0], out)
        rc = lib.cd_gemm(rows.data_ptr(), rows.shape[0], width, packed.data_ptr(), native.FMT_I8, scales.data_ptr(),
                         out, bias.data_ptr(), y.data_ptr())
        assert rc == 0
        return y

    full = run(x)
    want = _w8a8_reference(x.numpy(), w, bias.numpy(), LEVELS[kernel])
    assert np.array_equal(full.numpy(), want)
    assert torch.equal(full[3], bias)
    singles = torch.cat([run(x[r:r + 1]) for r in range(t)])
    assert torch.equal(full, singles)  # each row's bits whatever the pass's other rows
    for n in (2, 5, 9, 17):
        assert torch.equal(run(x[:n]), full[:n]), n
    # w8a8 stays close to the float product it stands for (the rounding error scales as 1 / levels)
    rel = (full - (x @ w.T + bias)).norm() / (x @ w.T).norm()
    assert float(rel) < 3.8 / LEVELS[kernel]


@torch.inference_mode()
@pytest.mark.parametrize("kernel", sorted(LEVELS))
def test_w8a8_int8_speculative_greedy_equals_plain_greedy(kernel, tmp_path, monkeypatch):
    kernel_lib(kernel, monkeypatch)
    d = make_tiny_model(tmp_path / "m", layers=4, seed=23)
    eng = Engine.load(d, device="cpu", dtype="float32", weights="int8")
    assert eng.fwd.native.kernel == kernel and eng.fwd.native.i8_quads and eng.weights_in_use() == "int8"
    assert f"{kernel} kernels" in eng.decode_step_in_use()
    prompt = list(range(3, 40))
    plain = eng.generate(prompt, SamplingParams(max_tokens=40, ignore_eos=True, speculative=False))
    for k in (4, 32):
        spec = eng.generate(prompt, SamplingParams(max_tokens=40, ignore_eos=True, exit_layer=2, draft_k=k))
        assert spec.tokens == plain.tokens, k
