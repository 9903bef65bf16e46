"""The CPU prefill rate (issue 45): estimated from the model's size, then measured by a short timed prefill at
load and by every real prefill chunk; prefill chunks and the prompt builder's suffix follow the measured rate."""

from __future__ import annotations

import pytest

from completiond.config import Config
from completiond.engine import engine as engine_mod
from completiond.engine.engine import Engine
from completiond.engine.model_facts import MEASURE_MIN_TOKENS, MEASURE_WEIGHT, chunk_for, cpu_prefill


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> Engine:
    return Engine.load(tiny_model_dir, device="cpu", dtype="float32")


class FakeClock:
    """perf_counter advancing `step` seconds on every read: each timed chunk (two reads) takes `step`."""

    def __init__(self, step: float):
        self.now, self.step = 0.0, step

    def perf_counter(self) -> float:
        self.now += self.step
        return self.now


def test_a_cpu_engine_measures_its_prefill_rate_at_load(engine, monkeypatch):
    assert engine.prefill_measured and engine.prefill_tokens_per_s > 0
    assert engine.prefill_chunk == chunk_for(engine.prefill_tokens_per_s)
    # the load's measurement replaces the size's estimate: a slow clock gives a slow rate
    monkeypatch.setattr(engine_mod, "time", FakeClock(100.0))
    engine.prefill_measured = False
    engine._measure_prefill()
    estimate, _ = cpu_prefill(engine.adapter, engine.model.config)
    assert engine.prefill_measured and engine.prefill_tokens_per_s < 10 < estimate
    assert engine.prefill_chunk == 32


def test_real_prefill_chunks_move_the_rate_and_the_chunk(engine, monkeypatch):
    engine.prefill_tokens_per_s, engine.prefill_measured = 1000.0, True
    monkeypatch.setattr(engine_mod, "time", FakeClock(1.0))  # each chunk: one second
    seq = engine.new_sequence(200)
    engine.prefill(seq, list(range(3, 3 + MEASURE_MIN_TOKENS - 1)), None)  # too short to count
    assert engine.prefill_tokens_per_s == 1000.0
    engine.prefill(seq, list(range(3, 67)), None, chunk_size=64)
    want = (1 - MEASURE_WEIGHT) * 1000.0 + MEASURE_WEIGHT * 64
    assert engine.prefill_tokens_per_s == pytest.approx(want)
    assert engine.prefill_chunk == chunk_for(want)
    assert seq.length == MEASURE_MIN_TOKENS - 1 + 64


def test_the_prompt_builder_sizes_the_suffix_by_the_measured_rate(engine):
    from completiond.completion.prompt import SUFFIX_PREFILL_S, PromptBuilder

    cfg = Config()
    saved = engine.prefill_tokens_per_s
    try:
        engine.prefill_tokens_per_s = 200.0
        slow = PromptBuilder.for_engine(engine, cfg)
        engine.prefill_tokens_per_s = 1e6
        fast = PromptBuilder.for_engine(engine, cfg)
    finally:
        engine.prefill_tokens_per_s = saved
    assert slow.options.suffix_tokens == max(32, int(200 * SUFFIX_PREFILL_S)) < fast.options.suffix_tokens
