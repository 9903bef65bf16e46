"""The AVX512_BF16 kernel (issue 27 item 3; emulated over AVX2 where the CPU lacks AVX512_BF16,
tests/emulated_kernels.py): bf16 matrices run on vdpbf16ps with each activation row rounded to bf16
(nearest even): the values of that rounded product, every row of a 33-row pass the bits of a one-row
pass, and speculative greedy output equal to plain greedy output.
"""

from __future__ import annotations

import pytest
import torch

from completiond.engine import native
from completiond.engine.engine import Engine, SamplingParams
from tests import emulated_kernels
from tests.conftest import make_tiny_model
from tests.test_native_vnni import kernel_lib

BF16 = "avx512-bf16"
FLAGS = {"avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"}


def _bf16_lib(monkeypatch: pytest.MonkeyPatch | None = None):
    return kernel_lib(BF16, monkeypatch)


def test_the_bf16_kernel_is_chosen_exactly_where_the_cpu_has_it(monkeypatch):
    monkeypatch.delenv("COMPLETIOND_KERNEL", raising=False)
    if FLAGS <= set(native.build._cpu_flags().split()):
        # the AMX build where the CPU has tiles too; avx512-vnni where vdpbf16ps is the slower (its probe)
        want = (BF16, "avx512-amx") if native.build.bf16_dot_pays() else ("avx512-vnni", "avx512-amx")
        assert native.kernel_name() in want
        lib = _bf16_lib()
        assert lib.cd_kernel().decode() == BF16 and lib.cd_bf16_dot() == 1 and lib.cd_bf16_pairs() == 1
        assert lib.cd_i8_quads() == 1  # int8 stays w8a8 as in the VNNI build
        for narrower in ("avx2", "avx512", "avx512-vnni"):
            if narrower in native.supported_kernels():
                assert native.library(narrower).cd_bf16_dot() == 0, narrower
    else:
        assert BF16 not in native.supported_kernels() and native.kernel_name() != BF16


@pytest.mark.parametrize("width,out", [(37, 50), (64, 16), (896, 70), (4864, 33)])
def test_bf16_dot_is_the_rounded_activation_product_and_row_for_row(width, out):
    import ctypes  # noqa: F401  (cd_gemm's arguments are plain ints and pointers)
    lib = _bf16_lib()
    g = torch.Generator().manual_seed(width)
    t = 33
    w = torch.randn(out, width, generator=g).to(torch.bfloat16).float()  # a bf16 model's values
    x = torch.randn(t, width, generator=g)
    x[3] = 0.0
    bias = torch.randn(out, generator=g)
    packed, _ = native.pack_as(w, native.FMT_BF16, pairs=True)

    def run(rows: torch.Tensor) -> torch.Tensor:
        rows = rows.contiguous()
        y = torch.empty(rows.shape[0], out)
        rc = lib.cd_gemm(rows.data_ptr(), rows.shape[0], width, packed.data_ptr(), native.FMT_BF16, None, out,
                         bias.data_ptr(), y.data_ptr())
        assert rc == 0
        return y

    full = run(x)
    rounded = x.to(torch.bfloat16).double() @ w.double().T + bias.double()  # exact products, float64 sums
    exact = x.double() @ w.double().T + bias.double()
    scale = float((x.abs().double() @ w.abs().double().T).max())
    assert float((full.double() - rounded).abs().max()) <= 1e-6 * scale  # float32 sums of the rounded products
    # the activations really are rounded: the product is nearer the rounded reference than the unrounded one
    assert float((full.double() - rounded).norm()) < float((full.double() - exact).norm())
    assert torch.equal(full[3], bias)
    singles = torch.cat([run(x[r:r + 1]) for r in range(t)])
    assert torch.equal(full, singles)  # each row's bits whatever the pass's other rows
    for n in (2, 5, 9, 17):
        assert torch.equal(run(x[:n]), full[:n]), n


@torch.inference_mode()
@pytest.mark.parametrize("weights", ["auto", "bf16"])
def test_bf16_dot_speculative_greedy_equals_plain_greedy(tmp_path, monkeypatch, weights):
    _bf16_lib(monkeypatch)
    d = make_tiny_model(tmp_path / "m", layers=4, seed=29)
    if weights == "auto":  # a bf16 checkpoint: auto keeps its values in bf16 panels
        from safetensors.torch import load_file, save_file
        sd = load_file(d / "model.safetensors")
        save_file({k: v.to(torch.bfloat16) for k, v in sd.items()}, d / "model.safetensors", metadata={"format": "pt"})
    eng = Engine.load(d, device="cpu", dtype="float32", weights=weights)
    assert eng.fwd.native.kernel == BF16 and eng.fwd.native.bf16_dot and eng.weights_in_use() == "bf16"
    prompt = list(range(3, 40))
    plain = eng.generate(prompt, SamplingParams(max_tokens=40, ignore_eos=True, speculative=False))
    for k in (4, 32):  # 33 rows: the settings' largest verify pass
        spec = eng.generate(prompt, SamplingParams(max_tokens=40, ignore_eos=True, exit_layer=2, draft_k=k))
        assert spec.tokens == plain.tokens, k


@torch.inference_mode()
@pytest.mark.parametrize("width,out", [(37, 50), (64, 16), (896, 70)])
def test_a_bf16_head_is_read_row_major_alike_by_every_kernel(width, out):
    """FMT_BF16_ROWS (a large model's bf16 LM head, read where it lies, no panel copy) in every kernel
    (emulated where this CPU lacks it): each row of a pass the bits of a one-row pass; the float32 kernels
    the same bits as each other and the product's values; the AVX512_BF16 kernel the product of
    bf16-rounded activations."""
    from tests.test_native_step import _need_native
    _need_native()
    g = torch.Generator().manual_seed(out)
    t = 13  # every block size (1..6 rows) and split (13 = 5 + 4 + 4)
    w = torch.randn(out, width, generator=g).to(torch.bfloat16)
    x = torch.randn(t, width, generator=g)
    bias = torch.randn(out, generator=g)
    rows = w.view(torch.int16)
    scale = float((x.abs().double() @ w.double().abs().T).max())
    exact = x.double() @ w.double().T + bias.double()
    rounded = x.to(torch.bfloat16).double() @ w.double().T + bias.double()
    widened = []
    for kernel in emulated_kernels.kernels():
        lib = emulated_kernels.library(kernel)

        def run(r: torch.Tensor) -> torch.Tensor:
            r = r.contiguous()
            y = torch.empty(r.shape[0], out)
            assert lib.cd_gemm(r.data_ptr(), r.shape[0], width, rows.data_ptr(), native.FMT_BF16_ROWS, None, out,
                               bias.data_ptr(), y.data_ptr()) == 0
            return y

        full = run(x)
        assert torch.equal(full, torch.cat([run(x[i:i + 1]) for i in range(t)])), kernel
        for n in range(2, t):
            assert torch.equal(run(x[:n]), full[:n]), (kernel, n)
        want = rounded if lib.cd_bf16_dot() else exact
        assert float((full.double() - want).abs().max()) <= 1e-6 * scale, kernel
        if not lib.cd_bf16_dot():
            widened.append(full)
    assert all(torch.equal(r, widened[0]) for r in widened)


@torch.inference_mode()
def test_a_large_models_tied_head_is_its_embedding_not_a_copy(tmp_path, monkeypatch):
    from completiond.engine import forward
    from tests.test_native_step import _need_native
    _need_native()
    d = make_tiny_model(tmp_path / "m", layers=3, seed=31)
    from safetensors.torch import load_file, save_file
    sd = load_file(d / "model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in sd.items()}, d / "model.safetensors", metadata={"format": "pt"})
    monkeypatch.setattr(forward, "TRANSPOSED_COPY_LIMIT", 0)
    eng = Engine.load(d, device="cpu")
    fwd = eng.fwd
    assert fwd.released and fwd.head_w.dtype == torch.bfloat16
    eng.generate(list(range(3, 20)), SamplingParams(max_tokens=4, ignore_eos=True, speculative=False))
    entry = fwd.native._packed[id(fwd.head_w)]
    assert entry[2] == native.FMT_BF16_ROWS and entry[1].data_ptr() == fwd.head_w.data_ptr()
    assert fwd.native.packed_bytes() >= fwd.head_w.numel() * 2  # still counted as streamed bytes
