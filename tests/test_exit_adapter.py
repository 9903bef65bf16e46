"""The trained exit adapter (Kangaroo-style draft): format, training, the engine's draft and its K/V.

Exactness is the engine's promise whatever the draft: greedy output through the adapter equals
plain greedy decoding token for token. The adapter's own K/V slot is filled lazily from several
sources (the draft's own steps, prefill chunks, verify passes, a read-only catch-up); the tests
check that what ends up there equals a cold recomputation, so the draft is never silently fed
stale attention. As in test_engine.py, exactness runs in float64 with peaked weights, where logit
gaps dwarf summation-order rounding.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random

import pytest
import torch

from completiond.commands import train_adapter as cmd
from completiond.engine.engine import Engine, EngineError, SamplingParams, model_identity
from completiond.models import exit_adapter as ea
from tests.conftest import hf_model, make_tiny_model

PROMPT = "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n"
TEXT = (PROMPT + "        self.x = x\n        self.y = y\n\n    def norm(self):\n        return (self.x ** 2) ** 0.5\n") * 6
E = 2


def _train(engine: Engine, steps: int, seed: int = 0):
    rng = random.Random(seed)
    ids = engine.tokenizer(TEXT).input_ids
    batches = ea.token_windows([ids], 48, 4, rng, 10**6)
    torch.manual_seed(seed)
    layer, summary = ea.train_adapter(hf_model(engine), E, batches, steps, lr=2e-3, log=lambda m: None)
    return layer.to(engine.dtype), summary


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request, tmp_path_factory):
    d = make_tiny_model(tmp_path_factory.mktemp(f"adapter-{request.param}"), family=request.param, layers=6,
                        peaked=True, seed=5)
    base = Engine.load(d, dtype="float64")
    layer, summary = _train(base, steps=25)
    ea.save_adapter(d / ea.ADAPTER_FILE, layer, E, base.model_id, base.model.config, summary)
    return d


@pytest.fixture(scope="module")
def engine(model_dir) -> Engine:
    eng = Engine.load(model_dir, dtype="float64")
    assert eng.exit_adapter is not None and eng.exit_adapter.exit_layer == E
    return eng


def ids(engine: Engine, text: str = PROMPT) -> list[int]:
    return engine.tokenizer(text).input_ids


def test_identity_ignores_the_adapter_file(model_dir):
    before = model_identity(model_dir)
    (model_dir / ea.ADAPTER_FILE).rename(model_dir / "moved.bin")
    try:
        assert model_identity(model_dir) == before
    finally:
        (model_dir / "moved.bin").rename(model_dir / ea.ADAPTER_FILE)


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("lookup", [False, True])
def test_adapter_greedy_equals_plain_greedy(engine, k, lookup):
    prompt = ids(engine)
    engine.cache.clear()
    # history=None: the same prompt's plain output would otherwise be drafted whole from the output
    # history (tests/test_output_history.py), and this test is about the model draft
    plain = engine.generate(prompt, SamplingParams(max_tokens=48, speculative=False), history=None)
    spec = engine.generate(prompt, SamplingParams(max_tokens=48, draft="adapter", draft_k=k, adaptive_k=False,
                                                  prompt_lookup=lookup), history=None)
    assert spec.tokens == plain.tokens
    assert spec.stats.draft == "adapter" and spec.stats.exit_layer == E
    assert spec.stats.drafted - spec.stats.lookup_drafted > 0  # the adapter itself drafted
    # warm, on a branch of the sequence just cached: the reused prefix's adapter K/V is reused too
    follow = prompt + plain.tokens[:7]
    warm = engine.generate(follow, SamplingParams(max_tokens=30, draft="adapter", draft_k=k, adaptive_k=False,
                                                  prompt_lookup=lookup))
    assert warm.stats.reused_tokens == len(follow) - 1
    engine.cache.clear()
    assert warm.tokens == engine.generate(follow, SamplingParams(max_tokens=30, speculative=False)).tokens


def _cold_adapter_kv(engine: Engine, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The adapter slot's K/V for these tokens, computed from nothing in one go."""
    seq = engine.new_sequence(len(tokens) + 1)
    h = engine.run_layers(engine.embed(tokens), 0, E, 0, seq)
    slot = engine.exit_adapter.slot
    engine.run_layers(h, slot, slot + 1, 0, seq)
    return seq.k[slot, :, :len(tokens)], seq.v[slot, :, :len(tokens)]


def _check_slot(engine: Engine) -> int:
    """Every cached sequence's adapter K/V, as far as it claims validity, equals a cold computation."""
    checked = 0
    slot = engine.exit_adapter.slot
    for seq in list(engine.cache._entries.values()):
        n = seq.aux_length
        assert n <= seq.length
        if n == 0:
            continue
        k, v = _cold_adapter_kv(engine, seq.tokens[:n].tolist())
        torch.testing.assert_close(seq.k[slot, :, :n], k, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(seq.v[slot, :, :n], v, rtol=1e-9, atol=1e-9)
        checked += n
    return checked


@pytest.mark.parametrize("lookup", [False, True])
def test_adapter_kv_equals_a_cold_computation(engine, lookup):
    """After rounds of drafting, rejections, lookups and a warm follow-up on a branch, the adapter's
    K/V is what a cold pass over the same tokens gives."""
    engine.cache.clear()
    prompt = ids(engine, TEXT[:300])
    gen = engine.generate(prompt, SamplingParams(max_tokens=40, draft="adapter", draft_k=4, adaptive_k=False,
                                                 prompt_lookup=lookup))
    assert gen.stats.rejected > 0 or gen.stats.accepted > 0
    checked = _check_slot(engine)
    # the prefill tap and the draft's own steps cover all but the last few positions
    assert checked >= len(prompt)
    # a branch off the middle, then a prompt the slot never saw with speculation off first
    engine.generate(prompt[:-20] + ids(engine, "x = 1\n"), SamplingParams(max_tokens=12, draft="adapter", draft_k=3))
    _check_slot(engine)
    other = ids(engine, "import os\nimport sys\n" * 8)
    engine.generate(other, SamplingParams(max_tokens=5, speculative=False))
    plain = engine.generate(other + [other[3]], SamplingParams(max_tokens=12, speculative=False))
    spec = engine.generate(other + [other[3]], SamplingParams(max_tokens=12, draft="adapter", draft_k=3,
                                                              prompt_lookup=lookup))
    assert spec.tokens == plain.tokens
    assert _check_slot(engine) > 0  # the catch-up (read-only recompute) filled the slot correctly


def test_untrained_adapter_drafts_like_the_next_exit(model_dir):
    """An adapter that is a copy of layer E is layer E: its draft is the early exit at E + 1."""
    eng = Engine.load(model_dir, dtype="float64")
    layer = ea.copy.deepcopy(eng.model.model.layers[E])
    path = model_dir.parent / "copy-adapter.safetensors"
    ea.save_adapter(path, layer, E, eng.model_id, eng.model.config, {"steps": 0})
    eng.attach_adapter(path)
    prompt = ids(eng)
    via_adapter = eng.generate(prompt, SamplingParams(max_tokens=40, draft="adapter", draft_k=3, adaptive_k=False))
    next_exit = eng.generate(prompt, SamplingParams(max_tokens=40, exit_layer=E + 1, draft="early_exit", draft_k=3,
                                                    adaptive_k=False))
    assert via_adapter.tokens == next_exit.tokens
    assert (via_adapter.stats.accepted, via_adapter.stats.rounds) == (next_exit.stats.accepted, next_exit.stats.rounds)


def test_training_moves_the_adapter_toward_the_final_layer(model_dir):
    eng = Engine.load(model_dir, dtype="float64")
    rng = random.Random(9)
    held = [next(ea.token_windows([ids(eng, TEXT)], 48, 4, rng, 10**6)) for _ in range(2)]
    ref = hf_model(eng)  # training and measuring run transformers' forward pass
    start = ea.copy.deepcopy(ref.model.layers[E])
    before = ea.measure(ref, start, E, held)
    layer, summary = _train(eng, steps=25, seed=1)
    after = ea.measure(ref, layer, E, held)
    assert summary["steps"] == 25 and summary["tokens"] == 25 * 4 * 48
    assert after["kl"]["adapter"] < before["kl"]["adapter"]
    # before training the adapter is exactly layer E: the exit at E + 1
    assert before["agreement"]["adapter"] == before["agreement"]["exit_next"]


def test_sampling_through_the_adapter_is_reproducible_and_matches_p(engine):
    prompt = ids(engine)
    params = SamplingParams(max_tokens=24, temperature=0.9, seed=11, draft="adapter", draft_k=3)
    assert engine.generate(prompt, params).tokens == engine.generate(prompt, params).tokens
    n = 200
    counts: dict[int, int] = {}
    for s in range(n):
        g = engine.generate(prompt, SamplingParams(max_tokens=2, temperature=1.5, seed=s, draft="adapter", draft_k=3,
                                                   adaptive_k=False, ignore_eos=True))
        counts[g.tokens[0]] = counts.get(g.tokens[0], 0) + 1
    p = torch.softmax(engine.logits_for(prompt, use_cache=False).double() / 1.5, -1)
    for tok, c in counts.items():
        assert abs(c / n - float(p[tok])) < 5 * math.sqrt(float(p[tok]) * (1 - float(p[tok])) / n) + 2 / n


def test_stale_damaged_or_misshapen_adapters_are_refused(model_dir, tmp_path, caplog):
    eng = Engine.load(model_dir, dtype="float64")
    layer = ea.copy.deepcopy(eng.model.model.layers[E])
    stale = ea.save_adapter(tmp_path / "stale.safetensors", layer, E, "0123456789abcdef", eng.model.config, {})
    with pytest.raises(ea.AdapterFileError, match="trained on another model"):
        eng.attach_adapter(stale)
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{notjson")
    with pytest.raises(ea.AdapterFileError, match="cannot read"):
        eng.attach_adapter(damaged)
    other = make_tiny_model(tmp_path / "wide", layers=6, hidden=96, seed=2)
    wide = Engine.load(other, dtype="float64")
    misfit = ea.save_adapter(tmp_path / "wide.safetensors", wide.model.model.layers[E], E, eng.model_id,
                             eng.model.config, {})
    with pytest.raises(ea.AdapterFileError, match="does not fit|do not match"):
        eng.attach_adapter(misfit)
    # Found beside a model, a stale adapter is skipped with a warning: the model still loads.
    stale.replace(other / ea.ADAPTER_FILE)
    with caplog.at_level(logging.WARNING):
        loaded = Engine.load(other, dtype="float64")
    assert loaded.exit_adapter is None
    assert "not using exit adapter" in caplog.text
    with pytest.raises(EngineError, match="no exit adapter"):
        loaded.generate(ids(loaded), SamplingParams(max_tokens=4, draft="adapter"))


def test_train_adapter_command_writes_a_keyed_adapter(tmp_path, capsys):
    d = make_tiny_model(tmp_path / "m", layers=5, seed=4)
    src = tmp_path / "code"
    src.mkdir()
    (src / "a.py").write_text(TEXT)
    (src / "b.bin").write_bytes(b"\x00\xff" * 100)  # not UTF-8 text: skipped
    parser = argparse.ArgumentParser()
    cmd.add_arguments(parser)
    args = parser.parse_args(["--model", str(d), "--exit-layer", "1", "--steps", "4", "--batch-size", "2",
                              "--seq-len", "32", "--files", str(src), "--heldout", str(src / "a.py"),
                              "--heldout-batches", "1", "--json"])
    assert cmd.run(args) == 0
    summary = json.loads(capsys.readouterr().out)
    path = d / ea.ADAPTER_FILE
    assert summary["path"] == str(path) and path.is_file()
    assert summary["steps"] == 4 and summary["exit_layer"] == 1
    assert set(summary["after"]["agreement"]) == {"adapter", "exit", "exit_next"}
    eng = Engine.load(d, dtype="float64")
    assert eng.exit_adapter is not None and eng.exit_adapter.exit_layer == 1
    assert eng.exit_adapter.training["steps"] == 4
    # E must leave the adapter cheaper than the model
    bad = parser.parse_args(["--model", str(d), "--exit-layer", "4", "--files", str(src)])
    assert cmd.run(bad) == 2


def test_calibrate_weighs_the_adapter_and_a_draft_model_and_plots_them(model_dir, tmp_path):
    from completiond.commands import calibrate as cal_cmd
    from completiond.engine.autocalibrate import run_to_end, calibration_steps

    eng = Engine.load(model_dir, dtype="float64", draft_model=model_dir)  # the model drafting for itself
    prompts = [ids(eng)]
    cal, rows = run_to_end(calibration_steps(eng, prompts, 12, [1, 2], [2], log=lambda *a: None, repeats=1))
    drafts = {r["draft"] for r in rows}
    assert {"early_exit", "adapter", "draft_model"} <= drafts
    # a model drafting for itself is accepted every time
    assert all(r["alpha"] == 1.0 for r in rows if r["draft"] == "draft_model" and not r["prompt_lookup"])
    best = max(rows, key=lambda r: r["speedup"])
    if best["draft"] == "none":  # prompt lookup alone: a record with lookup on and no model draft
        assert not cal.speculative and cal.prompt_lookup == (best["speedup"] >= cal_cmd.MIN_GAIN and best["speedup_min"] > 1)
    else:
        assert cal.draft == best["draft"] and cal.exit_layer == best["exit_layer"]
    text = cal_cmd.table(rows)
    assert "exit adapter" in text and "draft model" in text and len(text.splitlines()) == len(rows) + 2
    png = cal_cmd.plot(rows, tmp_path / "cal.png", "test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
