"""The CPU's planning rate (issues 44 and 45): prefill chunks and the prompt builder's suffix follow a rate that
comes from the model's size and the path its prefill runs on, never from a clock, so load on the machine cannot
change a prompt's layout (a run under load once laid out shorter suffixes than a quiet one: other suggestions)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from completiond.completion.prompt import SUFFIX_MIN_TOKENS, SUFFIX_PREFILL_S, PromptBuilder
from completiond.config import Config
from completiond.engine import engine as engine_mod
from completiond.engine import model_facts
from completiond.engine.engine import Engine
from completiond.engine.model_facts import PREFILL_FLOPS_PER_THREAD, chunk_for, cpu_prefill
from completiond.engine.threads import ThreadGovernor


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> Engine:
    return Engine.load(tiny_model_dir, device="cpu", dtype="float32")


class SlowClock:
    """perf_counter advancing 100 s on every read: any timing taken under it says the machine crawls."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 100.0
        return self.now

    def __getattr__(self, name):
        import time

        return getattr(time, name)


def _prompt(engine: Engine, cfg: Config) -> list[int]:
    builder = PromptBuilder.for_engine(engine, cfg)
    prefix = "def total(items):\n    s = 0\n    for x in items:\n        s += "
    suffix = "\n    return s\n" + "".join(f"\ndef f{i}(a, b):\n    return a * {i} + b\n" for i in range(200))
    return builder.build(prefix + suffix, len(prefix)).ids


def test_the_rate_is_the_models_and_the_paths_not_the_clocks(engine, tiny_model_dir, monkeypatch):
    native = engine.fwd.native
    kernel = native.kernel if native is not None else None
    want = cpu_prefill(engine.adapter, engine.model.config, kernel, engine.weights, engine.threads.most)
    assert (engine.prefill_tokens_per_s, engine.prefill_chunk) == want
    assert engine.prefill_chunk == chunk_for(engine.prefill_tokens_per_s)
    cfg = Config(suffix_tokens=4096)
    before = _prompt(engine, cfg)
    # prefills timed by a clock that says the machine crawls, and requests on one thread of a busy machine
    monkeypatch.setattr(engine_mod, "time", SlowClock(), raising=False)
    monkeypatch.setattr(model_facts, "time", SlowClock(), raising=False)
    engine.threads = ThreadGovernor(most=engine.threads.most, runnable=lambda: 64)
    engine.threads.pick()
    engine.logits_for(list(range(3, 300)), use_cache=False)
    assert (engine.prefill_tokens_per_s, engine.prefill_chunk) == want
    assert _prompt(engine, cfg) == before
    # and a second load, its timings slow too, plans the same
    again = Engine.load(tiny_model_dir, device="cpu", dtype="float32", threads=engine.threads.most)
    assert (again.prefill_tokens_per_s, again.prefill_chunk) == want
    assert _prompt(again, cfg) == before


def test_a_load_beside_busy_processes_lays_out_the_same_prompts(tiny_model_dir, tmp_path):
    """Two busy loops take both cores while a process loads the model and lays out a prompt: it must print
    what a load on the quiet machine prints."""
    script = tmp_path / "layout.py"
    script.write_text(
        "import sys\n"
        "from completiond.completion.prompt import PromptBuilder\n"
        "from completiond.config import Config\n"
        "from completiond.engine.engine import Engine\n"
        "e = Engine.load(sys.argv[1], device='cpu', dtype='float32', threads=2)\n"
        "b = PromptBuilder.for_engine(e, Config(suffix_tokens=4096))\n"
        "suffix = ''.join(f'\\ndef f{i}(a):\\n    return a + {i}\\n' for i in range(300))\n"
        "print(e.prefill_tokens_per_s, e.prefill_chunk, b.build('x = ' + suffix, 4).ids)\n"
    )
    run = [sys.executable, str(script), str(tiny_model_dir)]
    quiet = subprocess.run(run, capture_output=True, text=True, check=True).stdout
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        loaded = subprocess.run(run, capture_output=True, text=True, check=True).stdout
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert loaded == quiet


def test_the_rate_follows_the_kernel_the_weights_and_the_threads(engine):
    cfg = engine.model.config
    torch_rate, _ = cpu_prefill(engine.adapter, cfg, None, "auto", 2)
    amx_int8, _ = cpu_prefill(engine.adapter, cfg, "avx512-amx", "int8", 2)
    amx_bf16, _ = cpu_prefill(engine.adapter, cfg, "avx512-amx", "bf16", 2)
    avx2, _ = cpu_prefill(engine.adapter, cfg, "avx2", "bf16", 2)
    assert amx_int8 > amx_bf16 > avx2
    assert cpu_prefill(engine.adapter, cfg, "avx512-amx", "int8", 4)[0] == pytest.approx(2 * amx_int8)
    # the 0.5B shape's figures the table was taken from: 2 threads, its suffix cap by kernel
    params = model_facts.matmul_params(engine.adapter, cfg)
    assert amx_int8 == pytest.approx(PREFILL_FLOPS_PER_THREAD[("avx512-amx", "int8")] * 2 / (2 * params))
    assert torch_rate > 0
    # every kernel the native build knows has figures for both weight formats
    from completiond.engine.native.build import KERNELS

    assert {(k, w) for k in KERNELS for w in ("int8", "bf16")} <= set(PREFILL_FLOPS_PER_THREAD)


def test_the_prompt_builder_sizes_the_suffix_by_the_rate(engine):
    cfg = Config()
    saved = engine.prefill_tokens_per_s
    try:
        engine.prefill_tokens_per_s = 200.0
        slow = PromptBuilder.for_engine(engine, cfg)
        engine.prefill_tokens_per_s = 1e6
        fast = PromptBuilder.for_engine(engine, cfg)
    finally:
        engine.prefill_tokens_per_s = saved
    assert slow.options.suffix_tokens == max(SUFFIX_MIN_TOKENS, int(200 * SUFFIX_PREFILL_S)) < fast.options.suffix_tokens


def test_warm_up_slices_take_about_the_same_time_whatever_the_model(bundled_model_dir, monkeypatch):
    """A request that preempts a warm-up waits for the part of a chunk in flight: parts of about
    WARM_SLICE_S at the planning rate on a CPU (the 0.5B shape's int8 rate: 891 tokens/s), never fewer
    than WARM_SLICES, never more than the layers; accelerators (no rate) keep WARM_SLICES."""
    from completiond.engine.model_facts import WARM_SLICE_S, WARM_SLICES, warm_slices

    assert warm_slices(64, 33_000, 10) == WARM_SLICES  # the bundled model: ~2 ms a chunk
    n = warm_slices(64, 891, 24)
    assert n > WARM_SLICES and 64 / 891 / n <= WARM_SLICE_S * 1.01 and 64 / 891 / (n - 1) > WARM_SLICE_S
    assert warm_slices(48, 405, 24) == 24 and warm_slices(64, 50, 3) == 3 and warm_slices(64, None, 24) == WARM_SLICES
    # The engine's warm-up runs its chunks' layers in that many parts (the bundled model: 10 layers).
    engine = Engine.load(bundled_model_dir, device="cpu", dtype="float32")
    assert engine.num_layers > WARM_SLICES
    calls = []
    real = engine.run_layers

    def count(h, first, last, *args, **kw):
        calls.append((first, last))
        return real(h, first, last, *args, **kw)

    monkeypatch.setattr(engine, "run_layers", count)
    monkeypatch.setattr(engine, "prefill_tokens_per_s", 1.0)  # a crawl: one layer a part
    engine.cache.clear()
    engine.warm(list(range(3, 40)))
    assert calls[: engine.num_layers] == [(i, i + 1) for i in range(engine.num_layers)]
