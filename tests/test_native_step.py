"""The native decode step (engine/native/step.c) against the PyTorch path and transformers.

Two claims are tested: it computes the model (close to the PyTorch path and to transformers' own
modules, in float32, for every family layout it takes: Llama, Qwen2's biases, Qwen3's qk-norm,
grouped KV heads, token trees, long contexts over several attention chunks), and every row of a
multi-row pass is bit for bit a one-row step (what makes speculative greedy equal plain greedy
without relying on logit gaps).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from completiond.engine import native
from completiond.engine.engine import Engine, SamplingParams
from tests import emulated_kernels
from tests.conftest import hf_model, make_tiny_model

TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"


def _need_native():
    if native.library() is None:
        pytest.skip(f"native step unavailable here: {native.reason()}")


def float_kernel() -> str:
    from tests.conftest import float32_kernel
    return float32_kernel()


class _float_step:
    """eng's native step bound to float_kernel() for the block: comparisons with the float32 PyTorch path."""

    def __init__(self, eng: Engine):
        self.eng = eng

    def __enter__(self):
        self.saved = self.eng.fwd.native
        self.eng.fwd.native = native.NativeStep(native.library(float_kernel()), self.eng.fwd, self.saved.weights_setting)
        return self.eng.fwd.native

    def __exit__(self, *exc):
        self.eng.fwd.native = self.saved


@pytest.fixture(scope="module")
def bundled(bundled_checkpoint_dir) -> Engine:
    return Engine.load(bundled_checkpoint_dir, device="cpu", dtype="float32")


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "mistral"])
def tiny(request, tmp_path_factory) -> Engine:
    d = make_tiny_model(tmp_path_factory.mktemp(f"native-{request.param}"), family=request.param, layers=3, seed=5)
    if request.param == "qwen2":  # random biases: the zero-initialised ones would not test the bias path
        from safetensors.torch import load_file, save_file
        w = load_file(d / "model.safetensors")
        g = torch.Generator().manual_seed(0)
        for name in w:
            if name.endswith("_proj.bias"):
                w[name] = 0.1 * torch.randn(w[name].shape, generator=g)
        save_file(w, d / "model.safetensors", metadata={"format": "pt"})
    return Engine.load(d, device="cpu", dtype="float32")


def _ids(eng: Engine, text: str, n: int | None = None) -> list[int]:
    ids = eng.tokenizer(text).input_ids
    while n is not None and len(ids) < n:
        ids = ids + ids
    return ids if n is None else ids[:n]


def _pass(eng: Engine, seq, ids: list[int], **kw) -> torch.Tensor:
    h = eng.fwd.layers_range(eng.embed(ids), 0, eng.num_layers, seq.length, seq, **kw)
    return eng.head(h)


def _torch_only(eng: Engine):
    class Off:
        def __enter__(self):
            self.saved, eng.fwd.native = eng.fwd.native, None

        def __exit__(self, *exc):
            eng.fwd.native = self.saved
    return Off()


def test_the_bundled_model_gets_the_native_step(bundled):
    _need_native()
    assert bundled.fwd.native is not None, bundled.fwd.native_reason
    assert bundled.fwd.native_reason is None


@torch.inference_mode()
def test_native_passes_match_the_torch_path_and_transformers(tiny):
    _need_native()
    assert tiny.fwd.native is not None, tiny.fwd.native_reason
    prompt = _ids(tiny, TEXT, 40)
    ref = hf_model(tiny)(torch.tensor([prompt])).logits[0].float()  # [t, V]
    for rows in (1, 3, 8):
        native_seq, torch_seq = tiny.new_sequence(64), tiny.new_sequence(64)
        tiny.prefill(native_seq, prompt[:-rows], None)
        with _torch_only(tiny):
            tiny.prefill(torch_seq, prompt[:-rows], None)
            want = _pass(tiny, torch_seq, prompt[-rows:])
        got = _pass(tiny, native_seq, prompt[-rows:])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got, ref[-rows:], rtol=1e-4, atol=1e-4)
        n, L = len(prompt), tiny.num_layers
        torch.testing.assert_close(native_seq.k[:L, :, n - rows:n], torch_seq.k[:L, :, n - rows:n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(native_seq.v[:L, :, n - rows:n], torch_seq.v[:L, :, n - rows:n], rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_long_context_attention_over_several_chunks(bundled):
    """Over 256 cached keys attention runs in chunks merged by their maxima: still the model."""
    _need_native()
    prompt = _ids(bundled, TEXT * 3, 700)
    ref = hf_model(bundled)(torch.tensor([prompt])).logits[0, -4:].float()
    with _float_step(bundled):
        seq = bundled.new_sequence(len(prompt))
        bundled.prefill(seq, prompt[:-4], None)
        for i, tok in enumerate(prompt[-4:]):
            logits = _pass(bundled, seq, [tok])
            seq.commit([tok])
            torch.testing.assert_close(logits[-1], ref[i], rtol=1e-4, atol=1e-4)


@torch.inference_mode()
@pytest.mark.parametrize("threads", [1, 2])
def test_every_row_of_a_pass_is_a_one_row_step_bit_for_bit(bundled, threads):
    _need_native()
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        prompt = _ids(bundled, TEXT * 2, 300)  # past one 256-key chunk
        base = bundled.new_sequence(320)
        bundled.prefill(base, prompt[:-8], None)
        n0 = base.length
        singles, seq = [], base.copy_prefix(n0, 16)
        for tok in prompt[-8:]:
            singles.append(_pass(bundled, seq, [tok]))
            seq.commit([tok])
        singles = torch.cat(singles)  # [8, V]
        for rows in (2, 3, 4, 5, 6, 7, 8):
            batch = base.copy_prefix(n0, 16)
            got = _pass(bundled, batch, prompt[-8:-8 + rows] if rows < 8 else prompt[-8:])
            assert torch.equal(got, singles[:rows]), rows
            L = bundled.num_layers  # the model's slots (an exit adapter's slot is the draft's business)
            assert torch.equal(batch.k[:L, :, n0:n0 + rows], seq.k[:L, :, n0:n0 + rows])
            assert torch.equal(batch.v[:L, :, n0:n0 + rows], seq.v[:L, :, n0:n0 + rows])
    finally:
        torch.set_num_threads(saved)


@torch.inference_mode()
def test_a_long_prompts_last_chunk_rides_on_the_first_step(bundled, monkeypatch):
    """A jump's or an open's prompt: its last prefill chunk goes through the first step with the pending token,
    one pass over the weights fewer, for greedy requests (speculative or not): the same tokens and the same
    cached K/V as a prefill and then the step."""
    _need_native()
    from completiond.engine import decode

    prompt = _ids(bundled, TEXT * 3, 150)
    rows: list[int] = []  # rows of each pass through the first layer
    real = bundled.fwd.native.layers

    def counting(h, first, *args, **kw):
        if first == 0:
            rows.append(h.shape[1])
        return real(h, first, *args, **kw)

    def apart(engine, seq, rounds, uncached, greedy):  # the rule before: a keystroke's few tokens only
        return uncached if rounds.merges_prefill and 0 < uncached <= decode.MERGE_PREFILL else 0

    monkeypatch.setattr(bundled.fwd.native, "layers", counting)
    monkeypatch.setattr(bundled, "prefill_chunk", 64)
    merged = decode.merged_tail
    for params in (
        SamplingParams(max_tokens=8),
        SamplingParams(max_tokens=8, speculative=False),
        SamplingParams(max_tokens=8, temperature=0.8, seed=5),
    ):
        got = {}
        for name, rule in (("merged", merged), ("apart", apart)):
            monkeypatch.setattr(decode, "merged_tail", rule)
            bundled.cache.clear()
            rows.clear()
            gen = bundled.generate(prompt, params, history=False)
            n = len(prompt) + len(gen.tokens) - 1
            seq, reused = bundled.cache.acquire(prompt + gen.tokens, bundled.new_sequence)
            assert reused == n
            got[name] = (gen.tokens, seq.k[:, :, :n].clone(), seq.v[:, :, :n].clone(), list(rows))
            bundled.cache.release(seq)
        assert got["merged"][0] == got["apart"][0], params
        assert torch.equal(got["merged"][1], got["apart"][1]) and torch.equal(got["merged"][2], got["apart"][2])
        assert got["apart"][3][:3] == [64, 64, 21]  # and a step of its own after them
        # 149 tokens before the pending one: 64 + 64 + 21, the last 21 with it when greedy. A sampled request
        # keeps its rounds (its draws, so its text for a seed, follow them).
        assert got["merged"][3][:3] == ([64, 64, 21] if params.temperature else [64, 64, 22]), got["merged"][3]


@torch.inference_mode()
def test_results_do_not_depend_on_the_thread_count(bundled):
    _need_native()
    saved = torch.get_num_threads()
    prompt = _ids(bundled, TEXT, 60)
    out = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            seq = bundled.new_sequence(64)
            bundled.prefill(seq, prompt[:-4], None)
            out.append(_pass(bundled, seq, prompt[-4:]))
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(out[0], out[1]) and torch.equal(out[0], out[2])


@torch.inference_mode()
def test_tree_pass_matches_the_torch_path(tiny):
    """A token tree (two branches under the pending token) with rope positions by depth."""
    _need_native()
    prompt = _ids(tiny, TEXT, 30)
    tokens = prompt[-5:]  # node 0: root; 1, 2: its children; 3 under 1; 4 under 2
    parents = [-1, 0, 0, 1, 2]
    depth = torch.tensor([0, 1, 1, 2, 2])
    anc = torch.zeros(5, 5, dtype=torch.bool)
    for i in range(5):
        j = i
        while j >= 0:
            anc[i, j] = True
            j = parents[j]
    outs = []
    for off in (False, True):
        seq = tiny.new_sequence(64)
        if off:
            ctx = _torch_only(tiny)
            ctx.__enter__()
        try:
            tiny.prefill(seq, prompt[:-5], None)
            p0 = seq.length
            mask = torch.cat([torch.ones(5, p0, dtype=torch.bool), anc], 1)
            outs.append((_pass(tiny, seq, tokens, tree=(depth + p0, mask)), seq.k[:tiny.num_layers, :, p0:p0 + 5].clone()))
        finally:
            if off:
                ctx.__exit__(None, None, None)
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=1e-5, atol=1e-5)


def _tree_mask(parents: list[int], p0: int) -> torch.Tensor:
    """[t, p0 + t]: node i sees the prefix, its ancestors and itself."""
    t = len(parents)
    anc = torch.zeros(t, t, dtype=torch.bool)
    for i in range(t):
        j = i
        while j >= 0:
            anc[i, j] = True
            j = parents[j]
    return torch.cat([torch.ones(t, p0, dtype=torch.bool), anc], 1)


@pytest.fixture(scope="module", params=[(14, 2), (32, 1)], ids=["14-on-2", "32-on-1"])
def gqa(request, tmp_path_factory) -> Engine:
    """Query heads grouped on KV heads, tiny: Qwen2.5-Coder-0.5B's 14 on 2, and 32 on one (a group wider
    than one attention batch of 16 pairs, so even a tree node's heads take two). The bundled model has a
    KV head per query head, so only models like these have attention batch several q heads on one."""
    heads, kv = request.param
    d = make_tiny_model(tmp_path_factory.mktemp("native-gqa"), family="qwen2", layers=2, hidden=8 * heads,
                        heads=heads, kv_heads=kv, seed=3)
    return Engine.load(d, device="cpu", dtype="float32")


@torch.inference_mode()
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_grouped_heads_every_row_of_a_long_pass_is_a_one_row_step(gqa, threads):
    """Attention's work items batch the (row, q head) pairs that read one KV head, at most 16 to a batch
    (more batches where threads would idle): 5 rows and native.MAX_ROWS rows (231 pairs), past a 256-key
    chunk, every row bit for bit a one-row step."""
    _need_native()
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n, p0 = native.MAX_ROWS, 280
        prompt = _ids(gqa, TEXT * 8, p0 + n)
        base = gqa.new_sequence(p0 + n + 8)
        gqa.prefill(base, prompt[:p0], None)
        seq, singles = base.copy_prefix(p0, n + 8), []
        for tok in prompt[p0:]:
            singles.append(_pass(gqa, seq, [tok]))
            seq.commit([tok])
        singles = torch.cat(singles)  # [n, V]
        for rows in (5, n):
            got = _pass(gqa, base.copy_prefix(p0, n + 8), prompt[p0:p0 + rows])
            assert torch.equal(got, singles[:rows]), rows
        # and every pair is the right (row, q head): the model, as the PyTorch path computes it
        with _float_step(gqa):
            got = _pass(gqa, base.copy_prefix(p0, n + 8), prompt[p0:])
        with _torch_only(gqa):
            want = _pass(gqa, base.copy_prefix(p0, n + 8), prompt[p0:])
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max().item()
    finally:
        torch.set_num_threads(saved)


@torch.inference_mode()
@pytest.mark.parametrize("p0", [40, 250])  # 250: the deeper nodes' keys cross the 256-key chunk boundary
def test_tree_nodes_are_bit_exact_with_plain_steps(bundled, p0):
    """Every node of a token tree (ancestors at non-consecutive slots) gets, bit for bit, the logits and
    the K/V of plain one-token steps along its path: attention sums in the logical sequence's order,
    whatever slots the ancestors sit in. Float32, the native path, no tolerance."""
    _need_native()
    _tree_is_plain_steps(bundled, p0)


@torch.inference_mode()
def test_grouped_heads_tree_nodes_are_bit_exact_with_plain_steps(gqa):
    """The same with query heads grouped on KV heads (a tree node's heads batched on one KV head)."""
    _need_native()
    _tree_is_plain_steps(gqa, 250)


def _tree_is_plain_steps(eng: Engine, p0: int) -> None:
    prompt = _ids(eng, TEXT * 4, p0 + 20)
    # node 0 the root; two branches interleaved in slot order, one of depth 9, so a node's ancestors are
    # spread over every other slot
    parents = [-1, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]
    tokens = [prompt[p0]] + [prompt[p0 + 1 + i // 2] if i % 2 == 0 else prompt[p0 + 2 + i // 2]
                             for i in range(len(parents) - 1)]
    depth = []
    for i, par in enumerate(parents):
        depth.append(0 if par < 0 else depth[par] + 1)
    t = len(parents)
    base = eng.new_sequence(p0 + t + 16)
    eng.prefill(base, prompt[:p0], None)
    tree_seq = base.copy_prefix(p0, t + 16)
    got = _pass(eng, tree_seq, tokens, tree=(torch.tensor(depth) + p0, _tree_mask(parents, p0)))
    L = eng.num_layers
    for i in range(t):
        path, j = [], i
        while j >= 0:
            path.append(j)
            j = parents[j]
        path.reverse()
        seq = base.copy_prefix(p0, t + 16)
        for node in path:
            want = _pass(eng, seq, [tokens[node]])
            seq.commit([tokens[node]])
        assert torch.equal(got[i], want[0]), (i, depth[i], (got[i] - want[0]).abs().max().item())
        slot = p0 + len(path) - 1  # where the plain steps put node i's K/V
        assert torch.equal(tree_seq.k[:L, :, p0 + i], seq.k[:L, :, slot]), i
        assert torch.equal(tree_seq.v[:L, :, p0 + i], seq.v[:L, :, slot]), i


@torch.inference_mode()
def test_read_only_pass_leaves_the_cache_alone(bundled):
    _need_native()
    prompt = _ids(bundled, TEXT, 40)
    seq = bundled.new_sequence(48)
    bundled.prefill(seq, prompt[:-3], None)
    p0 = seq.length
    h_written = bundled.fwd.layers_range(bundled.embed(prompt[-3:]), 0, 4, p0, seq)
    k, v = seq.k.clone(), seq.v.clone()
    h_again = bundled.fwd.layers_range(bundled.embed(prompt[-3:]), 0, 4, p0, seq, write=False)
    assert torch.equal(h_again, h_written)
    # bit for bit: the cache's unwritten slots are uninitialised memory, where a NaN is never equal to itself
    assert torch.equal(seq.k.view(torch.uint8), k.view(torch.uint8))
    assert torch.equal(seq.v.view(torch.uint8), v.view(torch.uint8))
    assert not torch.equal(h_written, bundled.fwd.layers_range(bundled.embed(prompt[-3:]), 0, 3, p0, seq, write=False))


@torch.inference_mode()
def test_draft_head_rows_match_the_torch_path(bundled):
    _need_native()
    bundled.set_draft_vocab(range(0, 4096, 3))
    try:
        seq = bundled.new_sequence(32)
        with _float_step(bundled):
            h = bundled.run_layers(bundled.embed(_ids(bundled, TEXT)[:12]), 0, bundled.num_layers, 0, seq)
            got = bundled.draft_head(h)
        with _torch_only(bundled):
            want = bundled.draft_head(h)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    finally:
        bundled.set_draft_vocab([])


def test_float64_and_switched_off_models_keep_the_torch_path(tiny_model_dir, monkeypatch):
    eng = Engine.load(tiny_model_dir, device="cpu", dtype="float64")
    assert eng.fwd.native is None and "float32" in eng.fwd.native_reason
    monkeypatch.setenv("COMPLETIOND_NATIVE", "0")
    native._reset_for_tests()
    try:
        eng = Engine.load(tiny_model_dir, device="cpu", dtype="float32")
        assert eng.fwd.native is None and "COMPLETIOND_NATIVE=0" in eng.fwd.native_reason
        assert eng.generate(_ids(eng, TEXT), SamplingParams(max_tokens=8, ignore_eos=True)).tokens
    finally:
        native._reset_for_tests()


def test_a_broken_compiler_falls_back_with_a_reason(tiny_model_dir, monkeypatch, tmp_path, caplog):
    emulated_kernels.real_build(monkeypatch)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing cached: it must compile
    monkeypatch.setenv("CC", "false")
    native._reset_for_tests()
    try:
        eng = Engine.load(tiny_model_dir, device="cpu", dtype="float32")
        assert eng.fwd.native is None
        assert "cannot build or load the native step" in eng.fwd.native_reason
        assert "using the PyTorch path" in caplog.text
        plain = eng.generate(_ids(eng, TEXT), SamplingParams(max_tokens=12, ignore_eos=True, speculative=False))
        spec = eng.generate(_ids(eng, TEXT), SamplingParams(max_tokens=12, ignore_eos=True, exit_layer=2, draft_k=3))
        assert len(plain.tokens) == 12 and len(spec.tokens) == 12
        assert not list(tmp_path.glob("completiond/native/*.so"))
    finally:
        native._reset_for_tests()


def test_a_build_the_compiler_cannot_make_falls_back_to_the_next_narrower(tiny_model_dir, monkeypatch, tmp_path,
                                                                          caplog):
    """A CPU with AVX512_BF16 and a compiler too old for it (or for any AVX-512 build): the widest build
    this CPU runs that compiles (avx2, or avx2-vnni where the CPU has AVX-VNNI), with a warning naming
    what failed; never the PyTorch path."""
    emulated_kernels.real_build(monkeypatch)
    if native.build._compiler() is None or "avx2" not in native.supported_kernels():
        pytest.skip("no C compiler or no AVX2/FMA here")
    want = [k for k in native.supported_kernels() if not k.startswith("avx512")][-1]
    cc = tmp_path / "old-cc"
    cc.write_text(f'#!/bin/sh\ncase "$*" in *-mavx512*) echo "cc: error: unrecognized command-line option" >&2; '
                  f'exit 1;; esac\nexec {native.build._compiler()} "$@"\n')
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("COMPLETIOND_KERNEL", raising=False)
    own = " ".join(f for f in native.build._cpu_flags().split() if not f.startswith("amx"))  # avx512-bf16 the widest
    flags = own + " " + " ".join(native.KERNELS["avx512-bf16"][0])
    monkeypatch.setattr(native.build, "_cpu_flags", lambda: flags)
    monkeypatch.setattr(native.build, "bf16_dot_speed", lambda: None)  # the flags alone decide here
    native._reset_for_tests()
    try:
        assert native.kernel_name() == "avx512-bf16"
        eng = Engine.load(tiny_model_dir, device="cpu", dtype="float32")
        assert eng.fwd.native is not None and eng.fwd.native.kernel == want, eng.fwd.native_reason
        assert f"{want} kernels" in eng.decode_step_in_use()
        warning = f"native step: using the {want} kernels"
        warned = [r.getMessage() for r in caplog.records if warning in r.getMessage()]
        assert len(warned) == 1 and "not avx512-bf16" in warned[0] and "unrecognized command-line option" in warned[0]
        assert native.reason("avx512-vnni") and native.reason("avx512") and native.reason(want) is None
        Engine.load(tiny_model_dir, device="cpu", dtype="float32")  # warned once per process, not per load
        assert sum(warning in r.getMessage() for r in caplog.records) == 1
    finally:
        native._reset_for_tests()


@pytest.fixture
def built_in_tmp(monkeypatch, tmp_path):
    """The native library built into an empty cache under tmp_path: its path."""
    if native.build._compiler() is None:
        pytest.skip("no C compiler here")
    emulated_kernels.real_build(monkeypatch)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    # The narrowest build (a few seconds of compiling, not ~12 s for an AVX-512 one, three times over): caching
    # and rebuilding take the same path for every kernel.
    monkeypatch.setenv("COMPLETIOND_KERNEL", "avx2")
    native._reset_for_tests()
    try:
        if native.library() is None:
            pytest.skip(f"native step unavailable here: {native.reason()}")
        (built,) = tmp_path.glob("completiond/native/step-*.so")
        yield built
    finally:
        native._reset_for_tests()


def test_the_built_library_is_cached_and_reused(built_in_tmp):
    assert not list(built_in_tmp.parent.glob(".step-*"))  # no temporary file left behind
    mtime = built_in_tmp.stat().st_mtime_ns
    native._reset_for_tests()
    assert native.library() is not None
    assert built_in_tmp.stat().st_mtime_ns == mtime  # loaded, not rebuilt


def test_a_damaged_cached_library_is_built_again(built_in_tmp, tmp_path):
    damaged = built_in_tmp.with_name("damaged")
    damaged.write_bytes(b"not an ELF file")
    os.replace(damaged, built_in_tmp)  # a new file: this process keeps its mapping of the loaded one
    # a fresh process (this one would be handed its already loaded copy by the dynamic loader)
    probe = "from completiond.engine import native; lib = native.library(); print(lib is not None, native.reason())"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)})
    assert out.stdout.split()[:1] == ["True"], out.stdout + out.stderr
    assert built_in_tmp.read_bytes()[:4] == b"\x7fELF"


@torch.inference_mode()
@pytest.mark.parametrize("vocab", [False, True])
@pytest.mark.parametrize("stop_early", [False, True])
def test_native_greedy_draft_equals_the_python_draft_loop(bundled, vocab, stop_early):
    """cd_draft_greedy against EarlyExitDraft's own loop (a subclass keeps it off the fused path): the same
    tokens, the same layer-E states and the same K/V, bit for bit; with a confidence threshold that
    stops the draft part-way, at the same step."""
    _need_native()
    from completiond.engine import sampling
    from completiond.engine.draft import EarlyExitDraft

    class Looped(EarlyExitDraft):
        pass

    bundled.set_draft_vocab(range(0, 8192, 2) if vocab else [])
    try:
        prompt = _ids(bundled, TEXT * 2, 120)
        warp = sampling.Warp(0.0, 0, 1.0)
        threshold, stop_at = 0.0, 6
        # stop_early: the first prompt end (a deterministic search) where some step s >= 1 is less sure than
        # every step before it, and a threshold between the two, so that the draft stops at s
        for end in (range(120, 40, -1) if stop_early else ()):
            seq = bundled.new_sequence(140)
            bundled.prefill(seq, prompt[:end - 1], None)
            p = Looped(bundled, 3).propose(seq, prompt[end - 1], [], 6, 0.0, warp, None, None, 6)
            tops = [float(torch.softmax(bundled.draft_head(p.exit_states[:, i:i + 1]), -1).max()) for i in range(6)]
            ok = [i for i in range(1, 6) if tops[i] < min(tops[:i])]
            if ok:
                prompt, stop_at = prompt[:end], ok[0]
                threshold = (tops[stop_at] + min(tops[:stop_at])) / 2
                break
        assert not stop_early or threshold > 0, "no prompt end where the draft's confidence drops part-way"
        out = []
        for cls in (EarlyExitDraft, Looped):
            seq = bundled.new_sequence(140)
            bundled.prefill(seq, prompt[:-1], None)
            p = cls(bundled, 3).propose(seq, prompt[-1], [], 6, threshold, warp, None, None, 6)
            out.append((p, seq.k[:3, :, seq.length:seq.length + 6].clone()))
        (a, ka), (b, kb) = out
        assert a.tokens == b.tokens and len(a.tokens) == stop_at
        assert torch.equal(a.exit_states, b.exit_states) and a.exit_layer == b.exit_layer == 3
        n = a.exit_states.shape[1]
        assert torch.equal(ka[:, :, :n], kb[:, :, :n])
    finally:
        bundled.set_draft_vocab([])


def test_bf16_panels_hold_the_weights_exactly():
    """The bf16 panel layout, widened as step.c's LOAD_BF16 does (a shift and a mask per 32-bit lane),
    gives back every weight in its column; float32 values that are not bf16 are not bf16_exact."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(37, 24, generator=g).to(torch.bfloat16).to(torch.float32)  # [out, in]: a padded last panel
    assert native.bf16_exact(w)
    assert not native.bf16_exact(w + 1e-3)
    lanes = native.pack(w, bf16=True).view(torch.int32)  # [panels, in, 8]: two halves per lane
    lo = (lanes << 16).view(torch.float32)  # columns 0-7 of each panel
    hi = (lanes & -65536).view(torch.float32)  # columns 8-15
    widened = torch.cat([lo, hi], dim=-1)  # [panels, in, 16]
    assert torch.equal(widened, native.pack(w))
    assert torch.equal(widened.transpose(1, 2).reshape(-1, 24)[:37], w)


@torch.inference_mode()
def test_bf16_weights_are_read_as_bf16_and_give_the_float32_bits(bundled):
    """The bundled model ships bf16: the native step reads its bf16 panels (half the bytes) and every
    pass, head and draft returns exactly what float32 panels of the same values return."""
    _need_native()
    saved = bundled.fwd.native
    assert saved.weights() == "bf16" and "bf16 weights" in bundled.decode_step_in_use()
    fast = native.NativeStep(native.library(float_kernel()), bundled.fwd, "auto")
    assert fast.weights() == "bf16"
    plain = native.NativeStep(native.library(float_kernel()), bundled.fwd, "float32")
    assert plain.weights() == "float32"
    prompt = _ids(bundled, TEXT * 2, 300)
    results = {}
    for name, step in (("bf16", fast), ("float32", plain)):
        bundled.fwd.native = step
        try:
            out = []
            for rows in (1, 3, 7):
                seq = bundled.new_sequence(320)
                bundled.prefill(seq, prompt[:-rows], None)
                out.append(_pass(bundled, seq, prompt[-rows:]))
                out.append(seq.k[:, :, :seq.length + rows].clone())
            seq = bundled.new_sequence(320)
            bundled.prefill(seq, prompt[:-1], None)
            tokens, states = step.draft_greedy(prompt[-1], 3, seq.length, 4, 0.0, seq, bundled.fwd.head_w, None,
                                               None, bundled.eos_ids_tensor)
            out += [torch.tensor(tokens), states]
            results[name] = out
        finally:
            bundled.fwd.native = saved
    for a, b in zip(results["bf16"], results["float32"]):
        assert torch.equal(a, b)


@torch.inference_mode()
def test_a_float32_model_keeps_float32_panels_and_a_bf16_valued_one_gets_bf16(tmp_path, monkeypatch):
    _need_native()
    monkeypatch.setenv("COMPLETIOND_KERNEL", float_kernel())  # compared with the float32 PyTorch path
    d = make_tiny_model(tmp_path / "rounded", layers=2, seed=7)
    from safetensors.torch import load_file, save_file
    w = load_file(d / "model.safetensors")
    save_file({k: v.to(torch.bfloat16).to(torch.float32) for k, v in w.items()}, d / "model.safetensors",
              metadata={"format": "pt"})
    rounded = Engine.load(d, device="cpu", dtype="float32")
    assert rounded.fwd.native.weights() == "bf16"
    prompt = _ids(rounded, TEXT, 30)
    ref = hf_model(rounded)(torch.tensor([prompt])).logits[0, -3:].float()
    seq = rounded.new_sequence(40)
    rounded.prefill(seq, prompt[:-3], None)
    torch.testing.assert_close(_pass(rounded, seq, prompt[-3:]), ref, rtol=1e-4, atol=1e-4)
    random = Engine.load(make_tiny_model(tmp_path / "random", layers=2, seed=7), device="cpu", dtype="float32")
    assert random.fwd.native.weights() == "float32"


@torch.inference_mode()
def test_native_plain_greedy_steps_equal_the_python_step(bundled):
    """Plain greedy steps take one native call (embed, layers, head, argmax); a constraint that allows
    everything sends each step through the Python path instead: the tokens and the cache agree."""
    _need_native()
    prompt = _ids(bundled, TEXT * 2, 200)
    params = SamplingParams(max_tokens=40, ignore_eos=True, speculative=False, prompt_lookup=False)
    calls = []
    real = bundled.fwd.native.draft_greedy

    def counting(*a, **kw):
        calls.append(a[1])
        return real(*a, **kw)

    bundled.fwd.native.draft_greedy = counting
    try:
        fast = bundled.generate(prompt, params, constraint=None).tokens
        assert calls and set(calls) == {bundled.num_layers}  # every step through all layers, natively
        n = len(calls)
        slow = bundled.generate(prompt, params, constraint=lambda toks: None).tokens
        assert len(calls) == n  # the constrained run never took the native step
    finally:
        del bundled.fwd.native.draft_greedy
    assert fast == slow and len(fast) == 40
    with _torch_only(bundled):
        assert bundled.generate(prompt, params).tokens == fast


def _verify_matches_the_python_pass(eng: Engine) -> None:
    prompt = _ids(eng, TEXT * 3, 150)
    drafts = prompt[40:49]  # 9 drafted tokens: a 10-row pass
    caches = []
    for how in ("native", "python"):
        seq = eng.new_sequence(200)
        eng.prefill(seq, prompt[:-1], None)
        n0 = seq.length
        with torch.inference_mode():
            if how == "native":
                got = eng.fwd.native.verify_greedy([prompt[-1]] + drafts, eng.num_layers, n0, seq, eng.fwd.head_w,
                                                   eng.fwd.head_b)
            else:
                want = torch.argmax(_pass(eng, seq, [prompt[-1]] + drafts), dim=-1).tolist()
        caches.append((seq.k[:eng.num_layers, :, n0:n0 + 10].clone(), seq.v[:eng.num_layers, :, n0:n0 + 10].clone()))
    assert got == want and len(got) == 10
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


def test_native_greedy_verify_is_the_python_pass_and_its_argmax(bundled):
    """cd_verify_greedy (embed, layers, head and argmax in one call) picks each row's argmax of the Python
    pass over the same tokens, and writes the same K/V: the row-for-row contract of the native step."""
    _need_native()
    _verify_matches_the_python_pass(bundled)


def test_native_greedy_verify_in_every_family(tiny):
    _need_native()
    _verify_matches_the_python_pass(tiny)


def test_greedy_lookup_rounds_verify_natively_and_equal_plain_decoding(bundled):
    """Prompt lookup rounds (greedy, no constraint) verify in one native call; the tokens are plain
    decoding's, and those of the same rounds verified through the Python pass (a constraint that
    allows everything)."""
    _need_native()
    prompt = _ids(bundled, TEXT * 4, 220)
    params = SamplingParams(max_tokens=48, ignore_eos=True, prompt_lookup=True, draft="none", draft_k=8,
                            adaptive_k=False)
    calls = []
    real = bundled.fwd.native.verify_greedy

    def counting(*a, **kw):
        calls.append(len(a[0]))
        return real(*a, **kw)

    bundled.fwd.native.verify_greedy = counting
    try:
        bundled.cache.clear()
        fast = bundled.generate(prompt, params, history=None)
        assert calls and max(calls) > 1  # multi-row passes took the native verify
        n = len(calls)
        bundled.cache.clear()
        slow = bundled.generate(prompt, params, constraint=lambda toks: None, history=None)
        assert len(calls) == n  # the constrained run verified through the Python pass
    finally:
        del bundled.fwd.native.verify_greedy
    bundled.cache.clear()
    plain = bundled.generate(prompt, SamplingParams(max_tokens=48, ignore_eos=True, speculative=False,
                                                    prompt_lookup=False), history=None)
    assert fast.tokens == slow.tokens == plain.tokens
    assert fast.stats.rounds == slow.stats.rounds < 48 and fast.stats.lookup_accepted == slow.stats.lookup_accepted > 0


def test_native_never_imports_the_modules_that_import_it():
    """forward.py imports native; native imports no engine module back, not even for type checking
    (issue 28: one direction only)."""
    import ast
    from pathlib import Path

    imported = set()
    for node in (n for p in Path(native.__file__).parent.glob("*.py") for n in ast.walk(ast.parse(p.read_text()))):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
            imported.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
    engine_modules = {m for m in imported if m.startswith("completiond.engine") and not m.startswith("completiond.engine.native")}
    assert not engine_modules, engine_modules
