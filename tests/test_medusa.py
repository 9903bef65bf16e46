"""Medusa heads and tree verification: exactness, the accepted path's K/V, fallbacks, the files.

Greedy decoding through a token tree must give plain greedy decoding's tokens, and the cache
afterwards must hold what a cold prefill of the same tokens gives (the accepted path moved into
consecutive slots). Trained tiny heads rarely guess right, so an oracle that knows the plain
continuation stands in for the heads where the test is about long accepted paths. As in
test_engine.py: float64 with peaked weights.
"""

from __future__ import annotations

import argparse
import json
import random

import pytest
import torch

from completiond.commands import train_medusa as cmd
from completiond.engine import medusa as medusa_mod
from completiond.engine.engine import CancelToken, Engine, EngineError, SamplingParams, model_identity
from completiond.models import exit_adapter as ea
from completiond.models import medusa as md
from tests.conftest import hf_model, make_tiny_model

PROMPT = "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n"
TEXT = (PROMPT + "        self.x = x\n        self.y = y\n\n    def norm(self):\n        return (self.x ** 2) ** 0.5\n") * 6


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request, tmp_path_factory):
    d = make_tiny_model(tmp_path_factory.mktemp(f"medusa-{request.param}"), family=request.param, layers=5,
                        peaked=True, seed=6)
    eng = Engine.load(d, dtype="float64")
    batches = ea.token_windows([eng.tokenizer(TEXT).input_ids], 48, 4, random.Random(0), 10**6)
    w, b, summary = md.train_heads(hf_model(eng), 4, batches, 15, log=lambda m: None)
    md.save_heads(d / md.MEDUSA_FILE, w, b, eng.model_id, eng.model.config, summary)
    return d


@pytest.fixture(scope="module")
def engine(model_dir) -> Engine:
    eng = Engine.load(model_dir, dtype="float64")
    assert eng.medusa is not None and eng.medusa.num_heads == 4
    return eng


def ids(engine: Engine, text: str = PROMPT) -> list[int]:
    return engine.tokenizer(text).input_ids


def _cache_matches_cold_prefill(engine: Engine) -> int:
    checked = 0
    for seq in list(engine.cache._entries.values()):
        n, L = seq.length, engine.num_layers
        cold = engine.new_sequence(n + 1)
        engine.prefill(cold, seq.tokens[:n].tolist(), None)
        torch.testing.assert_close(seq.k[:L, :, :n], cold.k[:L, :, :n], rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(seq.v[:L, :, :n], cold.v[:L, :, :n], rtol=1e-9, atol=1e-9)
        checked += n
    return checked


def test_identity_ignores_the_heads_file(model_dir):
    before = model_identity(model_dir)
    (model_dir / md.MEDUSA_FILE).rename(model_dir / "moved.bin")
    try:
        assert model_identity(model_dir) == before
    finally:
        (model_dir / "moved.bin").rename(model_dir / md.MEDUSA_FILE)


@pytest.mark.parametrize("lookup", [False, True])
def test_tree_greedy_equals_plain_greedy(engine, lookup):
    prompt = ids(engine)
    engine.cache.clear()
    plain = engine.generate(prompt, SamplingParams(max_tokens=48, speculative=False))
    spec = engine.generate(prompt, SamplingParams(max_tokens=48, draft="medusa", prompt_lookup=lookup))
    assert spec.tokens == plain.tokens and spec.stats.draft == "medusa" and spec.stats.drafted > 0
    assert _cache_matches_cold_prefill(engine) >= len(prompt)
    follow = prompt + plain.tokens[:6]
    warm = engine.generate(follow, SamplingParams(max_tokens=30, draft="medusa", prompt_lookup=lookup))
    assert warm.stats.reused_tokens == len(follow) - 1
    engine.cache.clear()
    assert warm.tokens == engine.generate(follow, SamplingParams(max_tokens=30, speculative=False)).tokens


def _oracle(truth_of, ranks):
    """Candidates with the true continuation at the given rank per depth, a wrong token at the others."""

    def candidates(self, seq, pending, depth):
        truth = truth_of(seq, depth)
        out = []
        for d in range(depth):
            right = truth[d] if d < len(truth) else 0
            wrong = (right + 1) % self.engine.vocab_size
            out.append([wrong, right] if ranks[d] == 1 else [right, wrong])
        return out

    return candidates


@pytest.mark.parametrize("ranks,per_round", [((0, 0, 0, 0), 4), ((1, 0, 0, 0), 2), ((0, 1, 0, 0), 1)])
def test_oracle_tree_accepts_the_longest_matching_path(engine, monkeypatch, ranks, per_round):
    """DEFAULT_TREE holds (0,) (1,) (0,0) (1,0) (0,0,0) (0,0,0,0): truth at ranks (0,0,0,0) is a path of 4,
    (1,0,...) one of 2 (no (1,0,0) in the tree), (0,1,...) one of 1."""
    prompt = ids(engine)
    plain = engine.generate(prompt, SamplingParams(max_tokens=60, speculative=False, ignore_eos=True)).tokens

    def truth_of(seq, depth):
        i = seq.length - len(prompt) + 1  # plain[i - 1] is pending
        return plain[i:i + depth]

    monkeypatch.setattr(medusa_mod.TreeDecoder, "candidates", _oracle(truth_of, ranks))
    engine.cache.clear()
    rounds = []
    spec = engine.generate(prompt, SamplingParams(max_tokens=60, draft="medusa", prompt_lookup=False, ignore_eos=True),
                           on_round=lambda toks: rounds.append(len(toks)))
    assert spec.tokens == plain
    steps = [b - a for a, b in zip([0] + rounds, rounds)]
    assert steps[0] == 1  # the first round is a plain step: the heads need its final state
    assert all(s == per_round + 1 for s in steps[1:-1]), steps  # accepted nodes plus the model's own token
    assert _cache_matches_cold_prefill(engine) == len(prompt) + 60 - 1


def test_cancel_mid_tree_keeps_a_verified_prefix(engine):
    prompt = ids(engine)
    full = engine.generate(prompt, SamplingParams(max_tokens=50, speculative=False, ignore_eos=True))
    cancel = CancelToken()
    seen = []

    def on_round(tokens):
        seen.append(len(tokens))
        if len(seen) == 3:
            cancel.cancel()

    part = engine.generate(prompt, SamplingParams(max_tokens=50, draft="medusa", ignore_eos=True), cancel=cancel,
                           on_round=on_round)
    assert part.finish_reason == "cancelled" and part.stats.rounds == 3
    assert part.tokens == full.tokens[:len(part.tokens)]
    again = engine.generate(prompt + part.tokens, SamplingParams(max_tokens=5, draft="medusa"))
    assert again.stats.reused_tokens == len(prompt) + len(part.tokens) - 1


def test_sampling_and_constraints_fall_back_to_the_exact_chain(engine):
    prompt = ids(engine)
    params = SamplingParams(max_tokens=20, temperature=0.8, seed=3, draft="medusa", exit_layer=2, draft_k=3)
    a, b = engine.generate(prompt, params), engine.generate(prompt, params)
    assert a.tokens == b.tokens and a.stats.draft == "early_exit"
    allowed = torch.zeros(engine.vocab_size, dtype=torch.bool)
    allowed[::2] = True
    plain = engine.generate(prompt, SamplingParams(max_tokens=12, speculative=False), constraint=lambda t: allowed)
    spec = engine.generate(prompt, SamplingParams(max_tokens=12, draft="medusa", exit_layer=2),
                           constraint=lambda t: allowed)
    assert spec.tokens == plain.tokens and spec.stats.draft == "early_exit"


def test_build_tree_and_walk():
    cand = [[10, 11], [20, 21], [30, 31]]
    tree = medusa_mod.build_tree(1, cand, ((0,), (1,), (0, 0), (1, 0), (0, 0, 0), (0, 1, 1)), chains=[[10, 20, 99]])
    # (0, 1, 1) has no parent (0, 1) in the shape: left out; the chain shares 10 -> 20 and adds 99
    assert tree.tokens == [1, 10, 11, 20, 20, 30, 99]
    assert tree.parents == [-1, 0, 0, 1, 2, 3, 3] and tree.depth == [0, 1, 1, 2, 2, 3, 3]
    anc = tree.ancestors("cpu")
    assert anc[5].tolist() == [True, True, False, True, False, True, False]
    # the model's argmax per node: after 1 -> 10, after 10 -> 20, after 20 -> 99, after 99 -> 7
    argmax = [10, 20, 0, 99, 0, 0, 7]
    assert medusa_mod.accept_path(tree, argmax) == ([0, 1, 3, 6], 7)
    assert len(medusa_mod.build_tree(1, cand, ((0,), (0, 0), (0, 0, 0)), max_depth=2)) == 3


def test_stale_and_misshapen_heads_are_refused(model_dir, tmp_path, caplog):
    eng = Engine.load(model_dir, dtype="float64")
    d = eng.model.config.hidden_size
    w, b = [torch.zeros(d, d)], [torch.zeros(d)]
    stale = md.save_heads(tmp_path / "stale.safetensors", w, b, "0123456789abcdef", eng.model.config, {})
    with pytest.raises(md.MedusaFileError, match="another model"):
        eng.attach_medusa(stale)
    wide = md.save_heads(tmp_path / "wide.safetensors", [torch.zeros(d + 1, d + 1)], [torch.zeros(d + 1)],
                         eng.model_id, eng.model.config, {})
    with pytest.raises(md.MedusaFileError, match="hidden size"):
        eng.attach_medusa(wide)
    plain = make_tiny_model(tmp_path / "plain", layers=3, seed=2)
    stale.replace(plain / md.MEDUSA_FILE)
    loaded = Engine.load(plain, dtype="float64")
    assert loaded.medusa is None
    with pytest.raises(EngineError, match="no Medusa heads"):
        loaded.generate(ids(loaded), SamplingParams(max_tokens=4, draft="medusa"))


def test_train_medusa_command_writes_keyed_heads(tmp_path, capsys):
    d = make_tiny_model(tmp_path / "m", layers=3, seed=4)
    (tmp_path / "a.py").write_text(TEXT)
    parser = argparse.ArgumentParser()
    cmd.add_arguments(parser)
    args = parser.parse_args(["--model", str(d), "--heads", "2", "--steps", "3", "--batch-size", "2", "--seq-len", "32",
                              "--files", str(tmp_path / "a.py"), "--heldout", str(tmp_path / "a.py"),
                              "--heldout-batches", "1", "--json"])
    assert cmd.run(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["path"] == str(d / md.MEDUSA_FILE) and summary["steps"] == 3 and summary["num_heads"] == 2
    assert len(summary["after"]["agreement"]) == 2
    eng = Engine.load(d, dtype="float64")
    assert eng.medusa is not None and eng.medusa.num_heads == 2
    assert all(len(p) <= 2 for p in eng.medusa.tree)


def test_calibrate_measures_the_tree(engine):
    from completiond.commands import calibrate as cal_cmd
    from completiond.engine.autocalibrate import calibration_steps, run_to_end

    cal, rows = run_to_end(calibration_steps(engine, [ids(engine)], 12, [1], [2], log=lambda *a: None, repeats=1))
    tree_rows = [r for r in rows if r["draft"] == "medusa"]
    assert tree_rows and tree_rows[0]["draft_k"] == engine.medusa.num_heads
    assert "Medusa tree" in cal_cmd.table(rows)
