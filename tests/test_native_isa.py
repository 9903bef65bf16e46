"""The native step's kernels and weight formats (issue 27 items 1-3): every kernel (this CPU's builds, and
the AVX-512 ones it lacks emulated over AVX2: tests/emulated_kernels.py) in every panel format (float32,
bf16, int8) gives each row of a pass of up to 33 positions the bits of a one-row step, kernels that
compute a format alike agree with each other bit for bit, int8 panels compute the dequantised
model, speculative greedy output equals plain greedy output under every weight format, and a model too
large for two copies keeps its packed panels as its only weights.
"""

from __future__ import annotations

import json

import pytest
import torch

from completiond.engine import forward, native
from completiond.engine.engine import Engine, EngineError, SamplingParams
from tests import emulated_kernels
from tests.conftest import make_tiny_model
from tests.test_native_step import TEXT, _need_native, bundled  # noqa: F401  (bundled: a module fixture)


def _ids(eng: Engine, text: str, n: int) -> list[int]:
    ids = eng.tokenizer(text).input_ids
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def _pass(eng: Engine, seq, ids: list[int]) -> torch.Tensor:
    h = eng.fwd.layers_range(eng.embed(ids), 0, eng.num_layers, seq.length, seq)
    return eng.head(h)


def test_kernel_choice_is_one_function_and_status_names_it(bundled, monkeypatch):
    _need_native()
    kernels = native.supported_kernels()
    # the widest, but for a CPU whose vdpbf16ps is slower than float32 products (kernel choice tests below)
    widest = "avx512-vnni" if kernels[-1] == "avx512-bf16" and not native.build.bf16_dot_pays() else kernels[-1]
    assert kernels[0] == "avx2" and native.kernel_name() == widest
    assert f"{bundled.fwd.native.kernel} kernels" in bundled.decode_step_in_use()
    assert bundled.fwd.native.kernel == native.kernel_name()
    monkeypatch.setenv("COMPLETIOND_KERNEL", "avx2")
    assert native.kernel_name() == "avx2"
    monkeypatch.setenv("COMPLETIOND_KERNEL", "sse2")  # not a kernel: the CPU's best
    assert native.kernel_name() == widest
    flags = set(native.build._cpu_flags().split())
    if {"avx512f", "avx512dq", "avx512bw", "avx512vl"} <= flags:
        assert "avx512" in kernels


BF16_FLAGS = "avx2 fma avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16"


@pytest.mark.parametrize(
    "speed,want", [(None, "avx512-bf16"), (0.67, "avx512-vnni"), (1.0, "avx512-bf16"), (1.8, "avx512-bf16")]
)
def test_a_slow_vdpbf16ps_gives_bf16_models_the_float32_products(monkeypatch, speed, want):
    """The dispatch alone: the avx512-bf16 build runs where its bf16 products are at least as fast as the
    float32 ones (the probe's figure, stood in), or where that cannot be measured; else avx512-vnni. Asked
    for by name, it runs anyway."""
    monkeypatch.delenv("COMPLETIOND_KERNEL", raising=False)
    monkeypatch.setattr(native.build, "_cpu_flags", lambda: BF16_FLAGS)
    monkeypatch.setattr(native.build, "bf16_dot_speed", lambda: speed)
    assert native.kernel_name() == want
    assert native.build._order()[0] == want
    monkeypatch.setenv("COMPLETIOND_KERNEL", "avx512-bf16")
    assert native.kernel_name() == "avx512-bf16"


def test_the_bf16_probe_measures_this_cpu_or_says_it_cannot(monkeypatch):
    """On a CPU with AVX512_BF16 the probe gives a positive speed that decides the choice; elsewhere None (flags
    that claim the instructions are not believed: the probe would not run on this CPU)."""
    native.build.bf16_dot_speed.cache_clear()
    try:
        real = set(native.build._read_cpu_flags().split())
        if set(native.KERNELS["avx512-bf16"][0]) <= real and native.library("avx512-bf16") is not None:
            speed = native.build.bf16_dot_speed()
            assert speed is not None and 0.05 < speed < 20
            assert native.build.bf16_dot_pays() == (speed >= native.build.BF16_DOT_MIN_SPEED)
        else:
            monkeypatch.setattr(native.build, "_cpu_flags", lambda: BF16_FLAGS)
            assert native.build.bf16_dot_speed() is None and native.build.bf16_dot_pays()
    finally:
        native.build.bf16_dot_speed.cache_clear()


@torch.inference_mode()
@pytest.mark.parametrize("weights", ["auto", "float32", "int8"])
def test_every_kernel_gives_every_row_the_bits_of_a_one_row_step(bundled, weights):
    """Passes of 2..33 rows (a verify pass of 32 drafted tokens and the pending one) against 33 one-row
    steps, in every kernel (emulated where this CPU lacks it); kernels of the same arithmetic against each
    other (the same fmadd chain per column, or the same integer sums), and float32 panels against the
    PyTorch path."""
    _need_native()
    prompt = _ids(bundled, TEXT * 4, 300)  # past one 256-key attention chunk
    n0, rows = 260, 33
    saved = bundled.fwd.native
    per_kernel = {}
    try:
        for kernel in emulated_kernels.kernels():
            lib = emulated_kernels.library(kernel)
            bundled.fwd.native = native.NativeStep(lib, bundled.fwd, weights)
            assert bundled.fwd.native.kernel == kernel
            base = bundled.new_sequence(n0 + rows)
            bundled.prefill(base, prompt[:n0], None)
            seq = base.copy_prefix(n0, rows)
            singles = []
            for tok in prompt[n0:n0 + rows]:
                singles.append(_pass(bundled, seq, [tok]))
                seq.commit([tok])
            singles = torch.cat(singles)  # [33, V]
            for t in (2, 5, 9, 16, 17, 33):
                batch = base.copy_prefix(n0, rows)
                got = _pass(bundled, batch, prompt[n0:n0 + t])
                assert torch.equal(got, singles[:t]), (kernel, t)
                L = bundled.num_layers
                assert torch.equal(batch.k[:L, :, n0:n0 + t], seq.k[:L, :, n0:n0 + t]), (kernel, t)
            per_kernel[kernel] = singles
        first = next(iter(per_kernel.values()))
        # Kernels that compute this format alike give the same bits: float32 and widened bf16 everywhere;
        # int8 as w8a8 with the same activation levels (avx2's 63; avx2-vnni's and the AVX-512 VNNI builds'
        # 127) or weight-only (avx512); bf16 panels on bf16-rounded activations (avx512-bf16).
        alike: dict[tuple, dict[str, torch.Tensor]] = {}
        for kernel, singles in per_kernel.items():
            lib = emulated_kernels.library(kernel)
            if weights == "int8" and lib.cd_i8_quads():
                key = ("w8a8", lib.cd_act_levels())
            elif weights == "auto" and lib.cd_bf16_dot():
                key = ("bf16 dot", lib.cd_amx_ready())  # AMX tiles sum bf16 products in their own order
            else:
                key = ("float32 arithmetic",)
            alike.setdefault(key, {})[kernel] = singles
        for key, group in alike.items():
            results = list(group.values())
            assert all(torch.equal(r, results[0]) for r in results), (key, list(group))
        if weights == "float32":
            bundled.fwd.native = None
            ref = bundled.new_sequence(n0 + rows)
            bundled.prefill(ref, prompt[:n0], None)
            want = _pass(bundled, ref, prompt[n0:n0 + rows])
            torch.testing.assert_close(first, want, rtol=1e-4, atol=1e-4)
    finally:
        bundled.fwd.native = saved


def test_int8_quantisation_is_symmetric_per_output_channel():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 24, generator=g)
    w[7] = 0.0
    q, scale = native.quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (40,)
    assert int(q.abs().max()) == 127 and int(q[7].abs().max()) == 0
    err = (native.dequantize_int8(q, scale) - w).abs()
    assert bool((err <= scale[:, None] / 2 + 1e-7).all())
    rows = torch.tensor([3, 30, 11])
    q_sub, s_sub = native.quantize_int8(w[rows])  # a draft vocabulary's rows: the same values
    assert torch.equal(q_sub, q[rows]) and torch.equal(s_sub, scale[rows])
    packed, scales = native.pack_as(w, native.FMT_I8)  # [3 panels, 24, 16], natural column order
    assert packed.shape == (3, 24, 16) and scales.shape == (48,)
    assert torch.equal(packed.transpose(1, 2).reshape(48, 24)[:40], q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_quantisation_in_row_blocks_is_the_whole_matrix_formula(dtype):
    """quantize_int8 works in blocks of rows (about 4 MB of float32 each): 300 rows of 8,192 are three
    blocks, and give what the formula gives over the whole matrix at once, a zero row included; w is
    left as it was."""
    g = torch.Generator().manual_seed(8)
    w = (torch.randn(300, 8192, generator=g) * torch.rand(300, 1, generator=g)).to(dtype)
    w[129] = 0.0
    before = w.clone()
    q, scale = native.quantize_int8(w)
    f = w.float()
    amax = f.abs().amax(dim=1)
    want_scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    want = torch.round(f / want_scale[:, None]).clamp(-127, 127).to(torch.int8)
    assert torch.equal(scale, want_scale) and torch.equal(q, want)
    assert torch.equal(w, before)
    # the row sums the VNNI layout's offset corrections take, summed in float32 while a block is at hand,
    # and in int32 where a row is too wide for float32 to hold its sum exactly
    for m in (w, torch.randn(2, 132_200, generator=g).to(dtype)):
        q, _, sums = native.packing._quantize_rows(m, True)
        assert torch.equal(sums, q.sum(dim=1, dtype=torch.int32))


def _bits(x: float) -> int:
    """x's bf16 bits as int16 (x is bf16-exact)."""
    return int(torch.tensor([x]).to(torch.bfloat16).view(torch.int16)[0])


@pytest.mark.parametrize("out,width", [(16, 8), (37, 13), (48, 6), (5, 3)])
def test_every_packed_layout_puts_each_weight_where_step_c_reads_it(out, width):
    """pack_as against the layouts written out weight by weight (padded rows and k zero): whatever this CPU
    runs, the AVX-512 builds' pairs and quads layouts included. Shapes with and without padding."""
    g = torch.Generator().manual_seed(out * width)
    w = torch.randn(out, width, generator=g).to(torch.bfloat16).float()
    P, n = native.PANEL, -(-out // native.PANEL)
    q, scale = native.quantize_int8(w)

    def wt(r: int, k: int) -> float:
        return float(w[r, k]) if r < out and k < width else 0.0

    def qt(r: int, k: int) -> int:
        return int(q[r, k]) if r < out and k < width else 0

    packed, sc = native.pack_as(w, native.FMT_F32)
    assert sc is None and packed.shape == (n, width, P)
    assert packed.tolist() == [[[wt(p * P + c, k) for c in range(P)] for k in range(width)] for p in range(n)]
    for src in (w, w.to(torch.bfloat16)):  # a float32 model's bf16-exact values, and a bf16 model's own
        packed, sc = native.pack_as(src, native.FMT_BF16)
        assert sc is None and packed.dtype == torch.int16 and packed.shape == (n, width, P)
        assert packed.tolist() == [[[_bits(wt(p * P + c, k)) for c in native.packing._BF16_ORDER] for k in range(width)]
                                   for p in range(n)]
        packed, sc = native.pack_as(src, native.FMT_BF16, pairs=True)
        h = -(-width // 2)
        assert sc is None and packed.dtype == torch.int16 and packed.shape == (n, h, P, 2)
        assert packed.tolist() == [[[[_bits(wt(p * P + c, 2 * k + j)) for j in range(2)] for c in range(P)]
                                    for k in range(h)] for p in range(n)]
    want_scales = [float(scale[r]) if r < out else 1.0 for r in range(n * P)]
    packed, sc = native.pack_as(w, native.FMT_I8)
    assert packed.dtype == torch.int8 and packed.shape == (n, width, P) and sc.tolist() == want_scales
    assert packed.tolist() == [[[qt(p * P + c, k) for c in range(P)] for k in range(width)] for p in range(n)]
    packed, sc = native.pack_as(w, native.FMT_I8, quads=True)
    h = -(-width // 4)
    assert packed.dtype == torch.int8 and packed.shape == (n, h, P, 4)
    assert packed.tolist() == [[[[qt(p * P + c, 4 * k + j) for j in range(4)] for c in range(P)] for k in range(h)]
                               for p in range(n)]
    assert sc[:n * P].tolist() == want_scales
    assert sc[n * P:].view(torch.int32).tolist() == [128 * sum(qt(r, k) for k in range(width)) for r in range(n * P)]


@torch.inference_mode()
def test_int8_panels_compute_the_dequantised_model(tmp_path, monkeypatch):
    """weights="int8": every pass (prefill too) reads int8 panels, and computes what the PyTorch path
    computes on the dequantised weights (the weight-only kernel of the avx512 build; the w8a8 builds have
    their own test in test_native_vnni)."""
    _need_native()
    emulated_kernels.library("avx512", monkeypatch)  # emulated where the CPU has no AVX-512
    d = make_tiny_model(tmp_path / "m", layers=3, seed=11)
    q8 = Engine.load(d, device="cpu", dtype="float32", weights="int8")
    assert q8.fwd.native.weights() == "int8" and q8.fwd.native_all and q8.weights_in_use() == "int8"
    ref = Engine.load(d, device="cpu", dtype="float32")
    ref.fwd.native = None
    for L in ref.fwd.layers:
        for w in (L.qkv, L.o, L.gate_up, L.down):
            w.copy_(native.dequantize_int8(*native.quantize_int8(w)))
        L.qkv_t = L.o_t = L.gate_up_t = L.down_t = None
    ref.fwd.head_w = native.dequantize_int8(*native.quantize_int8(ref.fwd.head_w))  # (the embedding stays as it is)
    ref.fwd.head_t = None
    prompt = _ids(q8, TEXT, 50)  # a 47-token prefill: past MAX_ROWS, native all the same
    got_seq, ref_seq = q8.new_sequence(64), ref.new_sequence(64)
    q8.prefill(got_seq, prompt[:-3], None)
    ref.prefill(ref_seq, prompt[:-3], None)
    torch.testing.assert_close(_pass(q8, got_seq, prompt[-3:]), _pass(ref, ref_seq, prompt[-3:]), rtol=1e-4, atol=1e-4)


@torch.inference_mode()
@pytest.mark.parametrize("weights", ["bf16", "int8"])
def test_speculative_greedy_equals_plain_greedy_in_every_weight_format(bundled_model_dir, weights):
    _need_native()
    eng = Engine.load(bundled_model_dir, device="cpu", dtype="float32", weights=weights)
    assert eng.weights_in_use() == weights and f"{weights} weights" in eng.decode_step_in_use()
    prompt = eng.tokenizer(TEXT).input_ids
    plain = eng.generate(prompt, SamplingParams(max_tokens=40, ignore_eos=True, speculative=False))
    for k in (4, 32):  # 33 rows: the settings' largest verify pass stays native
        spec = eng.generate(prompt, SamplingParams(max_tokens=40, ignore_eos=True, exit_layer=2, draft_k=k))
        assert spec.tokens == plain.tokens, k


def test_an_unknown_weights_format_is_refused(bundled_model_dir):
    with pytest.raises(EngineError, match="'fp4'"):
        Engine.load(bundled_model_dir, device="cpu", dtype="float32", weights="fp4")


@torch.inference_mode()
def test_a_large_model_keeps_the_packed_panels_as_its_only_weights(tmp_path, monkeypatch):
    """Above the copy limit each layer is packed and its own tensors dropped (the transformers modules'
    too), the embedding and head are kept once in bf16, and every pass runs natively: the same tokens
    as the model with both copies, plain and speculative. A bf16 checkpoint is read as bf16 (never
    widened to float32 as a whole) and computed in float32 from its panels."""
    _need_native()
    d = make_tiny_model(tmp_path / "rounded", layers=3, seed=7)
    from safetensors.torch import load_file, save_file
    w = load_file(d / "model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in w.items()}, d / "model.safetensors", metadata={"format": "pt"})
    both = Engine.load(d, device="cpu", dtype="float32")
    config = json.loads((d / "config.json").read_text())
    assert not forward.packs_bf16_checkpoint(config, d)  # the bundled limit: small enough for two copies
    monkeypatch.setattr(forward, "TRANSPOSED_COPY_LIMIT", 0)
    assert forward.packs_bf16_checkpoint(config, d)
    packed = Engine.load(d, device="cpu")  # dtype auto: the bf16 checkpoint is read as bf16
    assert packed.dtype == torch.float32 and packed.fwd.layers[0].ln1.dtype == torch.float32
    assert next(packed.model.parameters()).dtype == torch.bfloat16
    fwd = packed.fwd
    assert fwd.released and fwd.native_all and fwd.native.weights() == "bf16"
    assert all(L.qkv is None and L.gate_up is None and L.down is None and L.o is None
               for L in fwd.layers[:packed.num_layers])
    layer_params = [p for n, p in packed.model.named_parameters() if "proj" in n and n.endswith("weight")]
    assert layer_params and all(p.numel() == 0 for p in layer_params)
    assert fwd.embed_w.dtype == torch.bfloat16 and fwd.layer_numel == both.fwd.layer_numel
    prompt = both.tokenizer(TEXT).input_ids[:30]  # prefill within MAX_ROWS: native in both engines
    want = both.generate(prompt, SamplingParams(max_tokens=20, ignore_eos=True, speculative=False)).tokens
    assert packed.generate(prompt, SamplingParams(max_tokens=20, ignore_eos=True, speculative=False)).tokens == want
    spec = packed.generate(prompt, SamplingParams(max_tokens=20, ignore_eos=True, exit_layer=1, draft_k=4))
    assert spec.tokens == want
    long_prompt = _ids(packed, TEXT * 4, 300)  # a prefill of two chunks, native too
    plain = packed.generate(long_prompt, SamplingParams(max_tokens=8, ignore_eos=True, speculative=False))
    assert len(plain.tokens) == 8


@torch.inference_mode()
@pytest.mark.parametrize("width", [37, 64])  # an odd width: the k-pair layout's padded last pair
def test_every_kernel_reads_its_panel_layouts_alike(width):
    """The head kernel straight through ctypes on widths the models do not have, in every format and
    every kernel's own panel layout: the same bits from every kernel, and the reference's values."""
    _need_native()
    import ctypes
    g = torch.Generator().manual_seed(5)
    V, t = 50, 3
    w = torch.randn(V, width, generator=g).to(torch.bfloat16).float()
    x = torch.randn(t, width, generator=g)
    norm_w = torch.rand(width, generator=g) + 0.5
    bias = torch.randn(V, generator=g)
    xn = torch.nn.functional.rms_norm(x, (width,), norm_w, 1e-6)
    ref = xn @ w.T + bias
    ref_i8 = xn @ native.dequantize_int8(*native.quantize_int8(w)).T + bias
    outs = {}
    for kernel in emulated_kernels.kernels():
        lib = emulated_kernels.library(kernel)
        pairs, quads = bool(lib.cd_bf16_pairs()), bool(lib.cd_i8_quads())
        for fmt in (native.FMT_F32, native.FMT_BF16, native.FMT_I8):
            if quads and fmt == native.FMT_I8:
                continue  # w8a8 (VNNI): tests/test_native_vnni.py
            if lib.cd_bf16_dot() and fmt == native.FMT_BF16:
                continue  # rounded activations (AVX512_BF16): tests/test_native_bf16.py
            packed, scales = native.pack_as(w, fmt, pairs, quads)
            out = torch.empty(t, V)
            rc = lib.cd_head(x.data_ptr(), t, width, norm_w.data_ptr(), ctypes.c_float(1e-6), packed.data_ptr(), fmt,
                             native.abi._ptr(scales), V, bias.data_ptr(), out.data_ptr(), 1)
            assert rc == 0
            outs.setdefault(fmt, []).append(out)
    for fmt, results in outs.items():
        assert all(torch.equal(r, results[0]) for r in results), fmt
        torch.testing.assert_close(results[0], ref_i8 if fmt == native.FMT_I8 else ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(outs[native.FMT_F32][0], outs[native.FMT_BF16][0])  # bf16 values: the float32 bits


@torch.inference_mode()
def test_the_arithmetic_timer_computes_the_product_it_times(bundled):
    """cd_arith (bench-device's in-cache arithmetic rate) repeats the very product cd_gemm computes, split over
    threads, in every kernel and format; it refuses bad sizes; and the bytes it is weighed against are the
    packed bytes a step reads."""
    _need_native()
    g = torch.Generator().manual_seed(9)
    V, width = 80, 64
    w = torch.randn(V, width, generator=g).to(torch.bfloat16).float()
    for kernel in emulated_kernels.kernels():
        lib = emulated_kernels.library(kernel)
        pairs, quads = bool(lib.cd_bf16_pairs()), bool(lib.cd_i8_quads())
        for fmt in (native.FMT_F32, native.FMT_BF16, native.FMT_I8, native.FMT_BF16_ROWS):
            if fmt == native.FMT_BF16_ROWS:
                packed, scales = w.to(torch.bfloat16).view(torch.int16), None
            else:
                packed, scales = native.pack_as(w, fmt, pairs, quads)
            for t in (1, 5):
                x = torch.randn(t, width, generator=g)
                want, got = torch.empty(t, V), torch.full((t, V), float("nan"))
                assert lib.cd_gemm(x.data_ptr(), t, width, packed.data_ptr(), fmt, native.abi._ptr(scales), V, None,
                                   want.data_ptr()) == 0
                assert lib.cd_arith(x.data_ptr(), t, width, packed.data_ptr(), fmt, native.abi._ptr(scales), V,
                                    got.data_ptr(), 3, 2) == 0
                assert torch.equal(got, want), (kernel, fmt, t)
                assert lib.cd_arith(x.data_ptr(), t, width, packed.data_ptr(), fmt, native.abi._ptr(scales), V,
                                    got.data_ptr(), 0, 2) == -2, (kernel, fmt)
    step = bundled.fwd.native
    by_format = step.bytes_by_format()
    assert sum(by_format.values()) == step.packed_bytes() > 0
    for fmt in by_format:
        assert step.arithmetic_rate(fmt, 2, seconds=0.01, repeats=1) > 0
