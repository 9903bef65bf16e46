"""A separate draft model: exactness, its companion K/V, refusal of another tokenizer, cancellation.

As in test_engine.py, exactness runs in float64 with peaked weights (logit gaps dwarf
summation-order rounding). A model drafting for itself must be accepted every time: that
checks that the companion sequence is fed exactly the committed tokens, round after round.
"""

from __future__ import annotations

import math

import pytest
import torch

from completiond.config import Config
from completiond.engine.engine import CancelToken, Engine, EngineError, SamplingParams
from tests.conftest import build_tokenizer, make_tiny_model

PROMPT = "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n"


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def dirs(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"draft-{request.param}")
    target = make_tiny_model(root / "target", family=request.param, layers=6, peaked=True, seed=3)
    draft = make_tiny_model(root / "draft", family=request.param, layers=2, hidden=32, peaked=True, seed=4)
    return target, draft


@pytest.fixture(scope="module")
def engine(dirs) -> Engine:
    target, draft = dirs
    eng = Engine.load(target, dtype="float64", draft_model=draft)
    assert eng.draft_model is not None and eng.draft_model.num_layers == 2
    return eng


def ids(engine: Engine, text: str = PROMPT) -> list[int]:
    return engine.tokenizer(text).input_ids


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("lookup", [False, True])
def test_draft_model_greedy_equals_plain_greedy(engine, k, lookup):
    prompt = ids(engine)
    engine.cache.clear()
    # history=None: the same prompt's plain output would otherwise be drafted whole from the output
    # history (tests/test_output_history.py), and this test is about the model draft
    plain = engine.generate(prompt, SamplingParams(max_tokens=48, speculative=False), history=None)
    spec = engine.generate(prompt, SamplingParams(max_tokens=48, draft="draft_model", draft_k=k, adaptive_k=False,
                                                  prompt_lookup=lookup), history=None)
    assert spec.tokens == plain.tokens
    assert spec.stats.draft == "draft_model" and spec.stats.drafted - spec.stats.lookup_drafted > 0
    follow = prompt + plain.tokens[:9]
    warm = engine.generate(follow, SamplingParams(max_tokens=30, draft="draft_model", draft_k=k, prompt_lookup=lookup))
    assert warm.stats.reused_tokens == len(follow) - 1
    engine.cache.clear()
    assert warm.tokens == engine.generate(follow, SamplingParams(max_tokens=30, speculative=False)).tokens


def test_companion_kv_equals_a_cold_draft_prefill(engine):
    engine.cache.clear()
    prompt = ids(engine, PROMPT * 3)
    engine.generate(prompt, SamplingParams(max_tokens=40, draft="draft_model", draft_k=4, adaptive_k=False))
    engine.generate(prompt[:-15], SamplingParams(max_tokens=20, draft="draft_model", draft_k=2))  # a branch
    dr = engine.draft_model
    checked = 0
    for seq in list(engine.cache._entries.values()):
        d = seq.companion
        assert d is not None and d.length <= seq.length
        assert d.tokens[:d.length].tolist() == seq.tokens[:d.length].tolist()
        cold = dr.new_sequence(d.length + 1)
        dr.prefill(cold, d.tokens[:d.length].tolist(), None)
        torch.testing.assert_close(d.k[:, :, :d.length], cold.k[:, :, :d.length], rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(d.v[:, :, :d.length], cold.v[:, :, :d.length], rtol=1e-9, atol=1e-9)
        checked += d.length
    # the branch reused the first sequence in place: its companion covers that prefix and what followed
    assert checked >= len(prompt) - 15


def test_a_model_drafting_for_itself_is_always_accepted(dirs):
    target, _ = dirs
    eng = Engine.load(target, dtype="float64", draft_model=target)
    prompt = ids(eng)
    for k in (1, 4):
        gen = eng.generate(prompt, SamplingParams(max_tokens=40, draft="draft_model", draft_k=k, adaptive_k=False,
                                                  ignore_eos=True))
        assert gen.stats.rejected == 0 and gen.stats.alpha == 1.0
        assert gen.stats.rounds == math.ceil(40 / (k + 1))


def test_another_tokenizer_is_refused(dirs, tmp_path):
    target, draft = dirs
    other = make_tiny_model(tmp_path / "other", layers=2, seed=1)
    build_tokenizer(other, vocab_size=300)  # same special tokens, another vocabulary
    with pytest.raises(EngineError, match="tokenizer differs"):
        Engine.load(target, dtype="float64", draft_model=other)
    eng = Engine.load(target, dtype="float64")
    with pytest.raises(EngineError, match="no draft model"):
        eng.generate(ids(eng), SamplingParams(max_tokens=4, draft="draft_model"))


def test_sampling_with_the_draft_model_matches_p(engine):
    prompt = ids(engine)
    params = SamplingParams(max_tokens=24, temperature=0.9, seed=5, draft="draft_model", draft_k=3)
    assert engine.generate(prompt, params).tokens == engine.generate(prompt, params).tokens
    n = 200
    counts: dict[int, int] = {}
    for s in range(n):
        g = engine.generate(prompt, SamplingParams(max_tokens=2, temperature=1.5, seed=s, draft="draft_model", draft_k=3,
                                                   adaptive_k=False, ignore_eos=True))
        counts[g.tokens[0]] = counts.get(g.tokens[0], 0) + 1
    p = torch.softmax(engine.logits_for(prompt, use_cache=False).double() / 1.5, -1)
    for tok, c in counts.items():
        assert abs(c / n - float(p[tok])) < 5 * math.sqrt(float(p[tok]) * (1 - float(p[tok])) / n) + 2 / n


def test_cancel_mid_generation_keeps_a_verified_prefix(engine):
    prompt = ids(engine)
    full = engine.generate(prompt, SamplingParams(max_tokens=60, speculative=False, ignore_eos=True))
    cancel = CancelToken()
    rounds = []

    def on_round(tokens):
        rounds.append(len(tokens))
        if len(rounds) == 3:
            cancel.cancel()

    part = engine.generate(prompt, SamplingParams(max_tokens=60, draft="draft_model", draft_k=3, ignore_eos=True),
                           cancel=cancel, on_round=on_round)
    assert part.finish_reason == "cancelled" and part.stats.rounds == 3
    assert part.tokens == full.tokens[:len(part.tokens)]
    again = engine.generate(prompt + part.tokens, SamplingParams(max_tokens=6, draft="draft_model", draft_k=3))
    assert again.stats.reused_tokens == len(prompt) + len(part.tokens) - 1


def test_the_draft_model_setting_reaches_the_engine(dirs):
    from completiond.serving.lifecycle import load_engine

    target, draft = dirs
    cfg = Config(model=str(target), draft_model=str(draft), dtype="float64")
    phases = []
    eng = load_engine(cfg, progress=lambda phase, pct: phases.append(phase))
    assert eng.draft_model is not None and "draft model" in phases


def test_status_names_the_draft_in_use(engine):
    from completiond.engine.calibration import Calibration
    from completiond.serving.metrics import _last_draft

    saved = engine.calibration
    try:
        engine.calibration = Calibration(speculative=True, exit_layer=2, draft_k=3, draft="draft_model", prompt_lookup=True)
        assert engine.draft_in_use() == f"prompt lookup, else draft model {engine.draft_model.name}, K<=3"
        engine.calibration = Calibration(speculative=False, exit_layer=2, draft_k=3)
        assert engine.draft_in_use().startswith("none")
        engine.calibration = Calibration(speculative=True, exit_layer=2, draft_k=3, draft="adapter")
        assert engine.draft_in_use() == "early exit at layer 2 of 6, K<=3"  # no adapter attached: what runs
    finally:
        engine.calibration = saved
    gen = engine.generate(ids(engine), SamplingParams(max_tokens=12, draft="draft_model", draft_k=2, prompt_lookup=False))
    assert _last_draft(gen.stats.to_dict()) == "draft_model"
    assert _last_draft({"drafted": 3, "lookup_drafted": 3}) == "prompt_lookup"
    assert _last_draft({"drafted": 0}) is None
    assert _last_draft({"drafted": 3, "lookup_drafted": 3, "history_rounds": 1}) == "prompt_lookup+output_history"
