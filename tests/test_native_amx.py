"""The AMX build (avx512-amx, issue 45: the prefill's matrix products on tiles): bf16 panels multiplied with
bf16-rounded activations and int8 panels as w8a8, 16 rows per tile. Every row of any pass has the bits of a
one-row pass (so a prefill chunk, a verify pass and a step agree, and a reused cache is a cold prefill's),
int8 has the VNNI kernel's very bits, and speculative greedy output equals plain greedy output.

AMX cannot be emulated over AVX2 (SIMDe has no tiles): these tests run where the CPU has AMX and the
operating system grants the tile state, and skip elsewhere.
"""

from __future__ import annotations

import pytest
import torch

from completiond.engine import native
from completiond.engine.engine import Engine, SamplingParams
from tests.conftest import make_tiny_model

AMX = "avx512-amx"


def _amx_lib():
    if AMX not in native.supported_kernels():
        pytest.skip("this CPU has no AMX tiles")
    lib = native.library(AMX)
    if lib is None:
        pytest.skip(f"the AMX build is unavailable here: {native.reason(AMX)}")
    return lib


def test_the_amx_build_is_chosen_where_the_cpu_has_tiles(monkeypatch):
    monkeypatch.delenv("COMPLETIOND_KERNEL", raising=False)
    flags = "avx2 fma avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16"
    monkeypatch.setattr(native.build, "_cpu_flags", lambda: flags)
    monkeypatch.setattr(native.build, "bf16_dot_speed", lambda: None)  # stood-in flags: this CPU's probe does not say
    assert native.kernel_name() == "avx512-bf16"
    monkeypatch.setattr(native.build, "_cpu_flags", lambda: flags + " amx_tile amx_bf16 amx_int8")
    # tiles the OS does not grant this process are not offered (a CPU or VM without the tile state)
    monkeypatch.setattr(native.build, "_os_grants_amx", lambda: False)
    assert native.kernel_name() == "avx512-bf16"
    monkeypatch.setattr(native.build, "_os_grants_amx", lambda: True)
    assert native.kernel_name() == AMX
    assert native.build._order()[:2] == [AMX, "avx512-bf16"]  # refused by the OS: the next build down


def test_a_build_without_the_tile_state_is_refused(monkeypatch):
    """Where Linux does not grant the tile state, the AMX build is not loaded (tile instructions would fault)
    and the engine takes the next build down."""
    lib = _amx_lib()
    assert lib.cd_amx_ready() == 1 and lib.cd_kernel().decode() == AMX and lib.cd_bf16_dot() == 1
    assert native.library("avx512-bf16").cd_amx_ready() == 0
    real = native.build.ctypes.CDLL

    class Refused:
        def __init__(self, path: str):
            self._lib = real(path)

        def __getattr__(self, name: str):
            return (lambda: 0) if name == "cd_amx_ready" else getattr(self._lib, name)

    monkeypatch.setattr(native.build.ctypes, "CDLL", Refused)
    monkeypatch.delenv("COMPLETIOND_KERNEL", raising=False)
    native._reset_for_tests()
    try:
        assert native.library(AMX) is None and "AMX tile state" in native.reason(AMX)
        assert native.library().cd_kernel().decode() == "avx512-bf16"
    finally:
        monkeypatch.undo()
        native._reset_for_tests()


def _gemm(lib, x: torch.Tensor, packed: torch.Tensor, fmt: int, scales, out: int, bias: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    y = torch.empty(x.shape[0], out)
    rc = lib.cd_gemm(
        x.data_ptr(),
        x.shape[0],
        x.shape[1],
        packed.data_ptr(),
        fmt,
        native.abi._ptr(scales),
        out,
        bias.data_ptr(),
        y.data_ptr(),
    )
    assert rc == 0
    return y


# widths with and without a k tail past the whole tiles (32 bf16 / 64 int8), outputs with a partial panel
SIZES = [(37, 50), (64, 16), (96, 70), (896, 70), (4864, 33)]


@pytest.mark.parametrize("width,out", SIZES)
def test_amx_bf16_is_the_rounded_product_and_row_for_row(width, out):
    lib = _amx_lib()
    g = torch.Generator().manual_seed(width + out)
    t = 40  # two whole tiles of rows and a padded third
    w = torch.randn(out, width, generator=g).to(torch.bfloat16).float()
    x = torch.randn(t, width, generator=g)
    x[3] = 0.0
    bias = torch.randn(out, generator=g)
    packed, _ = native.pack_as(w, native.FMT_BF16, pairs=True)
    full = _gemm(lib, x, packed, native.FMT_BF16, None, out, bias)
    rounded = x.to(torch.bfloat16).double() @ w.double().T + bias.double()
    exact = x.double() @ w.double().T + bias.double()
    scale = float((x.abs().double() @ w.abs().double().T).max())
    assert float((full.double() - rounded).abs().max()) <= 1e-6 * scale
    assert float((full.double() - rounded).norm()) < float((full.double() - exact).norm())
    assert torch.equal(full[3], bias)
    singles = torch.cat([_gemm(lib, x[r : r + 1], packed, native.FMT_BF16, None, out, bias) for r in range(t)])
    assert torch.equal(full, singles)
    for n in (2, 5, 15, 16, 17, 33):
        assert torch.equal(_gemm(lib, x[:n], packed, native.FMT_BF16, None, out, bias), full[:n]), n


@pytest.mark.parametrize("width,out", SIZES)
def test_amx_int8_has_the_vnni_kernels_bits(width, out):
    lib = _amx_lib()
    vnni = native.library("avx512-vnni")
    assert vnni is not None  # every AMX CPU has VNNI
    g = torch.Generator().manual_seed(width * out)
    t = 40
    w = torch.randn(out, width, generator=g)
    x = torch.randn(t, width, generator=g)
    bias = torch.randn(out, generator=g)
    packed, scales = native.pack_as(w, native.FMT_I8, pairs=True, quads=True)
    full = _gemm(lib, x, packed, native.FMT_I8, scales, out, bias)
    assert torch.equal(full, _gemm(vnni, x, packed, native.FMT_I8, scales, out, bias))
    for n in (1, 3, 4, 16, 17, 33):
        assert torch.equal(_gemm(lib, x[:n], packed, native.FMT_I8, scales, out, bias), full[:n]), n


@torch.inference_mode()
@pytest.mark.parametrize("weights", ["bf16", "int8"])
def test_amx_prefill_is_exact_and_speculative_greedy_equals_plain(tmp_path, monkeypatch, weights):
    """A prefill in chunks of many rows, a reused prefix and one-row steps give the logits of a cold prefill
    bit for bit, and speculative greedy decoding equals plain greedy decoding."""
    _amx_lib()
    monkeypatch.setenv("COMPLETIOND_KERNEL", AMX)
    d = make_tiny_model(tmp_path / "m", layers=4, seed=37)
    eng = Engine.load(d, device="cpu", dtype="float32", weights=weights)
    assert eng.fwd.native is not None and eng.fwd.native.kernel == AMX and eng.fwd.native_all
    prompt = [(i * 7) % 200 + 3 for i in range(90)]
    cold = eng.logits_for(prompt, use_cache=False)
    eng.cache.clear()
    eng.logits_for(prompt[:37], use_cache=True)  # a prefix cached in a 36-row chunk
    warm = eng.logits_for(prompt, use_cache=True)
    assert torch.equal(warm, cold)
    seq = eng.new_sequence(len(prompt))
    eng.prefill(seq, prompt[:-1], None, chunk_size=5)  # other chunk boundaries
    h = eng.run_layers(eng.embed(prompt[-1:]), 0, eng.num_layers, seq.length, seq)
    assert torch.equal(eng.head(h)[-1], cold)
    plain = eng.generate(prompt, SamplingParams(max_tokens=30, ignore_eos=True, speculative=False))
    for k in (4, 32):
        spec = eng.generate(prompt, SamplingParams(max_tokens=30, ignore_eos=True, exit_layer=2, draft_k=k))
        assert spec.tokens == plain.tokens, k


def test_a_cpu_with_amx_whose_os_refuses_the_tiles_is_never_offered_the_amx_build(monkeypatch):
    """kernel_name() names the build that runs: where Linux refuses the tile state (an old kernel, a VM that
    lists the flags), AMX is not among the supported kernels, so status and benchmarks name avx512-bf16. Runs on
    any CPU: the flags and the grant are stood in for."""
    flags = "fpu avx2 fma avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16 amx_tile amx_bf16 amx_int8"
    monkeypatch.setattr(native.build, "_cpu_flags", lambda: flags)
    monkeypatch.setattr(native.build, "bf16_dot_speed", lambda: None)  # stood-in flags: this CPU's probe does not say
    monkeypatch.delenv("COMPLETIOND_KERNEL", raising=False)
    monkeypatch.setattr(native.build, "_os_grants_amx", lambda: True)
    assert native.supported_kernels()[-1] == AMX and native.kernel_name() == AMX
    monkeypatch.setattr(native.build, "_os_grants_amx", lambda: False)
    assert AMX not in native.supported_kernels() and native.kernel_name() == "avx512-bf16"
    monkeypatch.setenv("COMPLETIOND_KERNEL", AMX)  # asking for it does not bring it back
    assert native.kernel_name() == "avx512-bf16"


def test_the_grant_is_asked_once_and_answers_a_bool():
    first = native.build._os_grants_amx()
    assert isinstance(first, bool) and native.build._os_grants_amx() is first


@pytest.fixture(scope="module")
def grouped(tmp_path_factory) -> Engine:
    """hd 64 and four query heads on each KV head: attention on tiles (step.c's att_tiles), bf16 panels."""
    _amx_lib()
    d = make_tiny_model(
        tmp_path_factory.mktemp("amx-grouped"), family="qwen2", layers=2, hidden=512, heads=8, kv_heads=2, seed=3
    )
    saved = native.build.os.environ.get("COMPLETIOND_KERNEL")
    native.build.os.environ["COMPLETIOND_KERNEL"] = AMX
    try:
        eng = Engine.load(d, device="cpu", dtype="float32", weights="bf16")
    finally:
        if saved is None:
            del native.build.os.environ["COMPLETIOND_KERNEL"]
        else:
            native.build.os.environ["COMPLETIOND_KERNEL"] = saved
    assert eng.fwd.native is not None and eng.fwd.native.kernel == AMX
    return eng


def _rows(eng: Engine, seq, ids: list[int]) -> torch.Tensor:
    return eng.head(eng.fwd.layers_range(eng.embed(ids), 0, eng.num_layers, seq.length, seq))


@torch.inference_mode()
@pytest.mark.parametrize("threads", [1, 2])
def test_tile_attention_rows_are_one_row_steps(grouped, threads):
    """Attention on tiles: a pass of 5 or 33 rows past a 256-key chunk, a cold prefill in chunks of 5 and a
    reused prefix give every row the bits of one-row steps; speculative greedy equals plain greedy."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        eng, n, p0 = grouped, 33, 280
        prompt = [(i * 7) % 200 + 3 for i in range(p0 + n)]
        base = eng.new_sequence(p0 + n + 8)
        eng.prefill(base, prompt[:p0], None)
        seq, singles = base.copy_prefix(p0, n + 8), []
        for tok in prompt[p0:]:
            singles.append(_rows(eng, seq, [tok]))
            seq.commit([tok])
        single = torch.cat(singles)
        for rows in (5, n):
            assert torch.equal(_rows(eng, base.copy_prefix(p0, n + 8), prompt[p0 : p0 + rows]), single[:rows]), rows
        cold = eng.logits_for(prompt, use_cache=False)
        eng.cache.clear()
        eng.logits_for(prompt[:37], use_cache=True)
        assert torch.equal(eng.logits_for(prompt, use_cache=True), cold)
        seq = eng.new_sequence(len(prompt))
        eng.prefill(seq, prompt[:-1], None, chunk_size=5)
        assert torch.equal(_rows(eng, seq, prompt[-1:])[-1], cold)
        plain = eng.generate(prompt, SamplingParams(max_tokens=20, ignore_eos=True, speculative=False))
        spec = eng.generate(prompt, SamplingParams(max_tokens=20, ignore_eos=True, exit_layer=1, draft_k=4))
        assert spec.tokens == plain.tokens
    finally:
        torch.set_num_threads(saved)


@torch.inference_mode()
@pytest.mark.parametrize("p0", [250, 300])  # 300: the first chunk of keys is all prefix, repacked once for all
def test_tile_attention_tree_nodes_are_plain_steps(grouped, p0):
    """A token tree's nodes (their keys gathered, repacked per node) have the bits of plain steps."""
    from tests.test_native_step import _tree_is_plain_steps

    _tree_is_plain_steps(grouped, p0)


@torch.inference_mode()
def test_tile_attention_is_the_model_in_bf16_and_float_builds_stay_float32(grouped):
    """Tiles round q, K, V and the probabilities to bf16: the logits stay within bf16's reach of the float32
    attention over the same panels (the float32 build's, which keeps the model to 1e-4: AVX2 among them)."""
    eng = grouped
    prompt = [(i * 11) % 200 + 3 for i in range(600)]  # three chunks of keys
    tiles = eng.logits_for(prompt, use_cache=False)
    float_kernels = [k for k in ("avx2", "avx512") if k in native.supported_kernels() and native.library(k) is not None]
    assert float_kernels
    saved = eng.fwd.native
    try:
        for kernel in float_kernels:
            eng.fwd.native = native.NativeStep(native.library(kernel), eng.fwd, "bf16")
            flt = eng.logits_for(prompt, use_cache=False)
            eng.fwd.native = None
            want = eng.logits_for(prompt, use_cache=False)  # the PyTorch path on the module's own weights
            eng.fwd.native = native.NativeStep(native.library(kernel), eng.fwd, "float32")
            torch.testing.assert_close(eng.logits_for(prompt, use_cache=False), want, rtol=1e-4, atol=1e-4)
            scale = float(flt.abs().max())
            assert float((tiles - flt).abs().max()) < 0.02 * scale, kernel
            assert not torch.equal(tiles, flt)  # the tiles ran (bf16 operands)
    finally:
        eng.fwd.native = saved
