"""Engine: the fast paths against the slow references.

Tiny random models have near-tied logits, so a batched verify pass and a
single-token pass (different summation order) could flip an argmax and make
"speculative == plain" fail for reasons that have nothing to do with the
algorithm. These tests therefore run in float64 with peaked weights
(make_tiny_model(peaked=True)), where the logit gaps dwarf rounding error.
"""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest
import torch

from completiond.engine.engine import sampling
from completiond.engine.engine import PREFILL_CHUNK, CancelToken, Engine, EngineError, SamplingParams
from completiond.engine.kvcache import KVSequence, PrefixCache
from tests.conftest import hf_model, make_tiny_model

PROMPT = "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n"


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def engine(request, tmp_path_factory) -> Engine:
    d = make_tiny_model(tmp_path_factory.mktemp(f"peaked-{request.param}"), family=request.param, layers=6,
                        peaked=True, seed=3)
    return Engine.load(d, dtype="float64")


def ids(engine: Engine, text: str = PROMPT) -> list[int]:
    return engine.tokenizer(text).input_ids


def test_matches_transformers_logits(engine):
    prompt = ids(engine)
    with torch.inference_mode():
        ref = hf_model(engine)(torch.tensor([prompt])).logits[0, -1].float()
    ours = engine.logits_for(prompt, use_cache=False)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("exit_layer,k", [(1, 1), (1, 4), (2, 3), (3, 6), (5, 2)])
def test_speculative_greedy_equals_plain_greedy(engine, exit_layer, k):
    prompt = ids(engine)
    plain = engine.generate(prompt, SamplingParams(max_tokens=48, speculative=False))
    spec = engine.generate(prompt, SamplingParams(max_tokens=48, exit_layer=exit_layer, draft_k=k, adaptive_k=False))
    assert spec.tokens == plain.tokens
    s = spec.stats
    assert s.drafted > 0
    # Each round commits its accepted drafts plus one token of the target's own; only the last
    # round can lose tokens (to EOS), so the rounds account for every token.
    assert len(spec.tokens) - s.accepted <= s.rounds <= len(spec.tokens) - s.accepted + 1
    assert s.rounds == plain.stats.rounds - s.accepted or s.rounds == plain.stats.rounds - s.accepted + 1


def test_adaptive_k_and_threshold_stay_exact(engine):
    prompt = ids(engine)
    plain = engine.generate(prompt, SamplingParams(max_tokens=40, speculative=False))
    for threshold in (0.0, 0.5, 0.99):
        spec = engine.generate(prompt, SamplingParams(max_tokens=40, exit_layer=2, draft_k=8, draft_threshold=threshold))
        assert spec.tokens == plain.tokens


def test_greedy_matches_transformers_generate(engine):
    prompt = ids(engine)
    ours = engine.generate(prompt, SamplingParams(max_tokens=30, exit_layer=2, draft_k=4, ignore_eos=True))
    with torch.inference_mode():
        ref = hf_model(engine).generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert len(ours.tokens) == 30 and ours.tokens == ref


def test_constraint_applies_to_draft_and_target_alike(engine):
    prompt = ids(engine)
    vocab = engine.model.config.vocab_size
    allowed = torch.zeros(vocab, dtype=torch.bool)
    allowed[torch.arange(0, vocab, 3)] = True

    def constraint(tokens):
        return allowed if len(tokens) < 10 else None

    plain = engine.generate(prompt, SamplingParams(max_tokens=20, speculative=False), constraint=constraint)
    spec = engine.generate(prompt, SamplingParams(max_tokens=20, exit_layer=1, draft_k=5, adaptive_k=False),
                           constraint=constraint)
    assert spec.tokens == plain.tokens
    assert all(t % 3 == 0 for t in plain.tokens[:10] if t not in engine.eos_token_ids)


def test_cache_reuse_gives_cold_prefill_logits(engine):
    prompt = ids(engine)
    engine.cache.clear()
    cold = engine.logits_for(prompt, use_cache=False)
    engine.logits_for(prompt[:-3], use_cache=True)  # leaves a shorter prefix in the cache
    warm = engine.logits_for(prompt, use_cache=True)
    torch.testing.assert_close(warm, cold, rtol=1e-9, atol=1e-9)
    # a different file, then back: the first sequence must still be found
    engine.logits_for(ids(engine, "import os\nimport sys\n" * 10), use_cache=True)
    gen = engine.generate(prompt + prompt[:2], SamplingParams(max_tokens=1))
    assert gen.stats.reused_tokens >= len(prompt) - 1


def test_cropping_after_rejection_keeps_cache_consistent(engine):
    """A low-acceptance draft rejects often; the KV left behind must still be exact."""
    prompt = ids(engine)
    engine.cache.clear()
    spec = engine.generate(prompt, SamplingParams(max_tokens=40, exit_layer=1, draft_k=8, adaptive_k=False))
    assert spec.stats.accepted < spec.stats.drafted  # there were rejections to crop after
    follow = prompt + spec.tokens[:25]
    warm = engine.generate(follow, SamplingParams(max_tokens=20, exit_layer=2, draft_k=3))
    assert warm.stats.reused_tokens == len(follow) - 1
    engine.cache.clear()
    cold = engine.generate(follow, SamplingParams(max_tokens=20, speculative=False))
    assert warm.tokens == cold.tokens
    torch.testing.assert_close(engine.logits_for(follow, use_cache=False), engine.logits_for(follow), rtol=1e-9, atol=1e-9)


def test_a_keystrokes_new_tokens_ride_with_the_first_step(engine, monkeypatch):
    """A warm prompt with a few uncached tokens: one pass feeds them and the pending token together;
    the result and the cache are those of a cold run."""
    prompt = ids(engine)
    engine.cache.clear()
    engine.generate(prompt[:-4], SamplingParams(max_tokens=3, speculative=False))
    passes = []
    real = engine.fwd.layers_range
    monkeypatch.setattr(engine.fwd, "layers_range", lambda h, *a, **k: passes.append(h.shape[1]) or real(h, *a, **k))
    warm = engine.generate(prompt, SamplingParams(max_tokens=1, speculative=False))
    # the first call cached prompt[:-4] (its own output went elsewhere): 3 tokens and the pending one remain
    assert warm.stats.reused_tokens == len(prompt) - 4 and passes == [4]
    monkeypatch.undo()
    warm = engine.generate(prompt + [prompt[2]], SamplingParams(max_tokens=30, exit_layer=2, draft_k=3))
    seq = next(iter(engine.cache._entries.values()))
    n = seq.length
    cold_seq = engine.new_sequence(n + 1)
    engine.prefill(cold_seq, seq.tokens[:n].tolist(), None)
    torch.testing.assert_close(seq.k[:, :, :n], cold_seq.k[:, :, :n], rtol=1e-9, atol=1e-9)
    engine.cache.clear()
    cold = engine.generate(prompt + [prompt[2]], SamplingParams(max_tokens=30, speculative=False))
    assert warm.tokens == cold.tokens


def test_cancel_mid_generation_returns_verified_prefix(engine):
    prompt = ids(engine)
    full = engine.generate(prompt, SamplingParams(max_tokens=60, speculative=False))
    cancel = CancelToken()
    rounds = []

    def on_round(tokens):
        rounds.append(len(tokens))
        if len(rounds) == 3:
            cancel.cancel()

    part = engine.generate(prompt, SamplingParams(max_tokens=60, exit_layer=2, draft_k=3), cancel=cancel, on_round=on_round)
    assert part.finish_reason == "cancelled"
    assert part.stats.rounds == 3  # stopped at the very next round boundary
    assert part.tokens == full.tokens[: len(part.tokens)]
    # its KV stayed: continuing from it reuses everything but the last token
    again = engine.generate(prompt + part.tokens, SamplingParams(max_tokens=4))
    assert again.stats.reused_tokens == len(prompt) + len(part.tokens) - 1


def test_cancel_from_another_thread_during_prefill(engine):
    engine.cache.clear()
    long_prompt = ids(engine, PROMPT * 60)[:2000]
    cancel = CancelToken()
    cancel.cancel()
    gen = engine.generate(long_prompt, SamplingParams(max_tokens=10), cancel=cancel)
    assert gen.finish_reason == "cancelled" and gen.tokens == []
    assert gen.stats.reused_tokens == 0

    # cancelled between chunks (from another thread, after the second chunk): the two chunks
    # prefilled stay in the cache and are reused, nothing more was computed.
    engine.cache.clear()
    cancel = _CancelAfterChecks(2)
    gen = engine.generate(long_prompt, SamplingParams(max_tokens=10), cancel=cancel)
    assert gen.finish_reason == "cancelled" and gen.tokens == []
    again = engine.generate(long_prompt, SamplingParams(max_tokens=1))
    assert again.stats.reused_tokens == 2 * PREFILL_CHUNK


class _CancelAfterChecks(CancelToken):
    """Cancelled from another thread right after the engine's n-th check of the flag."""

    def __init__(self, checks: int):
        super().__init__()
        self.checks = checks

    @property
    def cancelled(self) -> bool:
        self.checks -= 1
        if self.checks < 0:
            threading.Thread(target=self.cancel).start()
            time.sleep(0.05)  # the cancelling thread has run by the next check
        return super().cancelled


def test_same_seed_same_sample(engine):
    prompt = ids(engine)
    params = SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=7, exit_layer=2, draft_k=4)
    a = engine.generate(prompt, params)
    b = engine.generate(prompt, params)
    assert a.tokens == b.tokens


def test_prompt_over_context_is_refused(engine):
    with pytest.raises(EngineError, match="exceeds the model's context"):
        engine.generate([1] * engine.max_context, SamplingParams(max_tokens=8))
    with pytest.raises(EngineError, match="outside the vocabulary"):
        engine.generate([10**7], SamplingParams(max_tokens=8))
    with pytest.raises(EngineError, match="exit layer"):
        engine.generate([1, 2], SamplingParams(max_tokens=8, exit_layer=99))


# ---------------------------------------------------------------- acceptance maths

def _random_dists(v: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(v, generator=g, dtype=torch.float64) * 2, -1)
    q = torch.softmax(torch.randn(v, generator=g, dtype=torch.float64) * 2, -1)
    return p, q


@pytest.mark.parametrize("seed", range(5))
def test_one_accept_step_reproduces_p_analytically(seed):
    p, q = _random_dists(12, seed)
    # P(out = y) = q(y)·a(y) + (Σ_x q(x)(1 - a(x)))·residual(y)
    accept = torch.tensor([sampling.acceptance_probability(p, q, x) for x in range(12)], dtype=torch.float64)
    reject_mass = float((q * (1 - accept)).sum())
    out = q * accept + reject_mass * sampling.residual(p, q)
    torch.testing.assert_close(out, p, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", ["subset", "one-hot"])
def test_one_accept_step_is_exact_for_restricted_and_one_hot_drafts(kind):
    """q zero outside the draft's vocabulary, or a deterministic (prompt-lookup style) proposal:
    one accept/resample step still outputs exactly p."""
    p, q = _random_dists(12, 7)
    if kind == "subset":
        q[::2] = 0.0
        q /= q.sum()
    else:
        q = torch.zeros(12, dtype=torch.float64)
        q[5] = 1.0
    accept = torch.tensor([sampling.acceptance_probability(p, q, x) if q[x] > 0 else 0.0 for x in range(12)],
                          dtype=torch.float64)
    reject_mass = float((q * (1 - accept)).sum())
    out = q * accept + reject_mass * sampling.residual(p, q)
    torch.testing.assert_close(out, p, rtol=0, atol=1e-12)


def test_accept_sampled_reproduces_p_by_sampling():
    v, draws = 6, 60000
    p, q = _random_dists(v, 11)
    p, q = p.float(), q.float()
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(v)
    draft = torch.multinomial(q, draws, replacement=True, generator=gen).tolist()
    for x in draft:
        m, nxt = sampling.accept_sampled([x], q[None], torch.stack([p, p]), gen)
        counts[x if m == 1 else nxt] += 1
    freq = counts / draws
    # 5 standard errors of a binomial proportion: a false alarm is ~1e-6 per token
    bound = 5 * torch.sqrt(p * (1 - p) / draws)
    assert torch.all((freq - p).abs() < bound), (freq, p)


def test_accept_sampled_resident_reproduces_p_and_the_bonus_by_sampling():
    """The on-device accept step: an accepted or resampled first token is distributed as p[0]; after an
    accepted draft, the bonus token as p[1]."""
    v, draws = 6, 30000
    p, q = _random_dists(v, 11)
    p2, _ = _random_dists(v, 12)
    p, q, p2 = p.float(), q.float(), p2.float()
    gen = torch.Generator().manual_seed(0)
    first, bonus = torch.zeros(v), torch.zeros(v)
    draft = torch.multinomial(q, draws, replacement=True, generator=gen)
    target = torch.stack([p, p2])
    for x in draft:
        m, nxt = sampling.accept_sampled_resident(x.view(1), q[None], target, gen).tolist()
        assert m in (0, 1)
        first[int(x) if m == 1 else nxt] += 1
        if m == 1:
            bonus[nxt] += 1
    for counts, want in ((first, p), (bonus, p2)):
        n = counts.sum()
        assert n > draws / 10  # (the bonus: rounds that accepted, ~18% of them with these p, q)
        bound = 5 * torch.sqrt(want * (1 - want) / n)
        assert torch.all((counts / n - want).abs() < bound), (counts / n, want)
    # nothing drafted: one draw from p[0]
    m, nxt = sampling.accept_sampled_resident(torch.zeros(0, dtype=torch.long), None, p[None], gen).tolist()
    assert m == 0 and 0 <= nxt < v


@pytest.mark.parametrize("exit_layer,k", [(1, 1), (2, 3), (3, 6), (5, 2)])
@pytest.mark.parametrize("threshold", [0.0, 0.5, 0.99])
def test_resident_draft_proposes_what_the_read_per_token_loop_proposes(resident, exit_layer, k, threshold):
    """Same tokens and exit states as the loop that reads each token, whatever the threshold cuts; and
    speculative greedy through it equals plain greedy."""
    from completiond.engine.draft import EarlyExitDraft

    engine = resident
    prompt = ids(engine)
    draft = EarlyExitDraft(engine, exit_layer)
    warp = sampling.Warp()
    got = {}
    for on_device in (False, True):
        engine.resident_ids = on_device
        seq = engine.new_sequence(len(prompt) + k + 2)
        with torch.inference_mode():
            engine.prefill(seq, prompt[:-1], None)
            got[on_device] = draft.propose(seq, prompt[-1], [], k, threshold, warp, None, None)
    a, b = got[False], got[True]
    assert a.tokens == b.tokens and b.token_ids.tolist() == b.tokens
    torch.testing.assert_close(a.exit_states, b.exit_states, rtol=0, atol=0)
    engine.resident_ids = True
    plain = engine.generate(prompt, SamplingParams(max_tokens=40, speculative=False))
    spec = engine.generate(prompt, SamplingParams(max_tokens=40, exit_layer=exit_layer, draft_k=k,
                                                  draft_threshold=threshold))
    assert spec.tokens == plain.tokens
    assert spec.stats.drafted > 0 or threshold > 0  # (a high threshold may leave this tiny model unsure throughout)


def test_warp_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    pr = sampling.probs(logits, sampling.Warp(temperature=1.0, top_p=0.8))
    torch.testing.assert_close(pr[0], torch.tensor([0.625, 0.375, 0.0, 0.0]))
    pr = sampling.probs(logits, sampling.Warp(temperature=1.0, top_k=1))
    torch.testing.assert_close(pr[0], torch.tensor([1.0, 0.0, 0.0, 0.0]))


# ---------------------------------------------------------------- loading and the cache

def test_pickle_only_model_is_refused(tmp_path):
    d = make_tiny_model(tmp_path / "m", layers=2)
    for f in d.glob("*.safetensors"):
        f.unlink()
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(EngineError, match="pickle weights"):
        Engine.load(d)


def test_missing_model_directory_is_a_clear_error(tmp_path):
    with pytest.raises(EngineError, match="does not exist"):
        Engine.load(tmp_path / "nope")


def test_prefix_cache_lru_within_budget():
    def make(n):
        s = KVSequence(2, 1, 4, torch.float32, "cpu", capacity=n)
        s.commit(list(range(n)))
        return s

    one = make(10).nbytes
    cache = PrefixCache(budget_bytes=3 * one)
    seqs = []
    for base in range(5):
        s = KVSequence(2, 1, 4, torch.float32, "cpu", capacity=10)
        s.commit([base * 100 + i for i in range(10)])
        seqs.append(s)
        cache.release(s)
    assert len(cache) == 3 and cache.nbytes <= 3 * one and cache.evictions == 2
    seq, reused = cache.acquire([400 + i for i in range(5)] + [7], lambda n: make(n))
    assert reused == 5 and seq is seqs[4]
    seq, reused = cache.acquire([0, 1, 2], lambda n: make(n))  # evicted long ago
    assert reused == 0


def test_common_prefix_matches_a_plain_comparison():
    rng = np.random.default_rng(0)
    for _ in range(300):
        n, m = int(rng.integers(0, 12)), int(rng.integers(0, 12))
        a, b = rng.integers(0, 3, n), rng.integers(0, 3, m)  # 3 ids: long common heads are frequent
        s = KVSequence(1, 1, 4, torch.float32, "cpu", capacity=max(n, 1))
        s.commit(a.tolist())
        expected = next((i for i in range(min(n, m)) if a[i] != b[i]), min(n, m))
        assert s.common_prefix(b) == expected, (a, b)


def test_draft_vocab_subset_stays_exact(engine):
    """A draft that scores only some ids proposes from a smaller support; greedy output must not
    change (the sampled case is test_one_accept_step_is_exact_for_restricted_and_one_hot_drafts)."""
    prompt = ids(engine)
    params = SamplingParams(max_tokens=32, seed=3, exit_layer=2, draft_k=4, adaptive_k=False)
    plain = engine.generate(prompt, SamplingParams(max_tokens=32, seed=3, speculative=False))
    try:
        engine.set_draft_vocab(range(0, engine.vocab_size, 2))
        sub = engine.generate(prompt, params)
        # the draft really proposed from the subset only
        assert engine.draft_ids is not None and len(engine.draft_ids) == (engine.vocab_size + 1) // 2
    finally:
        engine.set_draft_vocab([])
    assert sub.stats.drafted > 0
    assert sub.tokens == plain.tokens


@pytest.fixture
def resident(engine):
    """The engine as on an accelerator: draft ids and the accept test stay on the device."""
    engine.resident_ids = True
    try:
        yield engine
    finally:
        engine.resident_ids = False
        engine.pending_dev = None


@pytest.mark.parametrize("on_device", [False, True], ids=["read-per-token", "resident"])
def test_sampled_speculation_matches_target_distribution(engine, on_device):
    """First two tokens under sampling: speculative and plain frequencies agree (chi-square-like bound)."""
    engine.resident_ids = on_device
    try:
        _sampled_matches_target(engine)
    finally:
        engine.resident_ids = False
        engine.pending_dev = None


def _sampled_matches_target(engine):
    prompt = ids(engine)
    n = 300
    counts_plain, counts_spec = {}, {}
    for s in range(n):
        a = engine.generate(prompt, SamplingParams(max_tokens=2, temperature=1.5, seed=s, speculative=False, ignore_eos=True))
        b = engine.generate(prompt, SamplingParams(max_tokens=2, temperature=1.5, seed=10_000 + s, exit_layer=1,
                                                   draft_k=3, adaptive_k=False, ignore_eos=True))
        counts_plain[a.tokens[0]] = counts_plain.get(a.tokens[0], 0) + 1
        counts_spec[b.tokens[0]] = counts_spec.get(b.tokens[0], 0) + 1
    p = torch.softmax(engine.logits_for(prompt, use_cache=False).double() / 1.5, -1)
    for counts in (counts_plain, counts_spec):
        for tok, c in counts.items():
            assert abs(c / n - float(p[tok])) < 5 * math.sqrt(float(p[tok]) * (1 - float(p[tok])) / n) + 2 / n


# ---------------------------------------------------------------- float32, the bundled model


@pytest.fixture(scope="module")
def bundled(bundled_checkpoint_dir) -> Engine:
    from tests.conftest import float32_kernel_env
    with float32_kernel_env():  # held to transformers' float32 modules
        return Engine.load(bundled_checkpoint_dir, device="cpu", dtype="float32")


def test_fused_step_matches_the_model_modules_in_float32(bundled):
    """The fused forward pass (one q/k/v and one gate/up projection, functional norms and rope,
    transposed weights for one-token steps) against transformers' own modules, one token at a time
    and in chunks."""
    prompt = bundled.tokenizer(PROMPT * 3).input_ids
    with torch.inference_mode():
        ref = hf_model(bundled)(torch.tensor([prompt])).logits[0].float()  # [t, V]
    torch.testing.assert_close(bundled.logits_for(prompt, use_cache=False), ref[-1], rtol=1e-4, atol=1e-4)
    seq = bundled.new_sequence(len(prompt))
    with torch.inference_mode():
        bundled.prefill(seq, prompt[:-5], None)
        for i in range(len(prompt) - 5, len(prompt)):  # decode steps: the one-token path
            h = bundled.run_layers(bundled.embed([prompt[i]]), 0, bundled.num_layers, seq.length, seq)
            seq.commit([prompt[i]])
            torch.testing.assert_close(bundled.head(h)[-1], ref[i], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("k", [1, 3])
def test_float32_speculative_greedy_equals_plain_and_transformers(bundled, k):
    for text in (PROMPT, "import os\n\n\ndef main(argv):\n    parser = ", "class Stack:\n    def push(self, item):\n"):
        prompt = bundled.tokenizer(text).input_ids
        plain = bundled.generate(prompt, SamplingParams(max_tokens=40, speculative=False, ignore_eos=True))
        spec = bundled.generate(prompt, SamplingParams(max_tokens=40, exit_layer=4, draft_k=k, adaptive_k=False,
                                                       ignore_eos=True))
        assert spec.stats.drafted > 0 and spec.tokens == plain.tokens
        with torch.inference_mode():
            ref = hf_model(bundled).generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False,
                                            eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert plain.tokens == ref


def test_float32_every_trained_draft_greedy_equals_plain(bundled_model_dir, tmp_path):
    """The bundled model in float32 with each other draft: an exit adapter (a copy of layer 2: the
    exit at 3), Medusa heads (untrained: the LM head's guess at every depth) and the model drafting
    for itself as a separate draft model."""
    from completiond.models import exit_adapter as ea
    from completiond.models import medusa as md

    eng = Engine.load(bundled_model_dir, device="cpu", dtype="float32", draft_model=bundled_model_dir)
    ea.save_adapter(tmp_path / "a.safetensors", eng.model.model.layers[2], 2, eng.model_id, eng.model.config, {})
    eng.attach_adapter(tmp_path / "a.safetensors")
    d = eng.model.config.hidden_size
    md.save_heads(tmp_path / "m.safetensors", [torch.zeros(d, d) for _ in range(3)], [torch.zeros(d) for _ in range(3)],
                  eng.model_id, eng.model.config, {})
    eng.attach_medusa(tmp_path / "m.safetensors")
    for text in (PROMPT, "import os\n\n\ndef main(argv):\n    parser = "):
        prompt = eng.tokenizer(text).input_ids
        plain = eng.generate(prompt, SamplingParams(max_tokens=40, speculative=False, ignore_eos=True))
        for draft in ("adapter", "medusa", "draft_model"):
            for lookup in (False, True):
                spec = eng.generate(prompt, SamplingParams(max_tokens=40, draft=draft, draft_k=3, prompt_lookup=lookup,
                                                           ignore_eos=True))
                assert spec.stats.draft == draft and spec.tokens == plain.tokens, (draft, lookup)


# ---------------------------------------------------------------- prompt lookup


def _brute_ends(tokens, sizes):
    ends = {}
    for p in range(len(tokens)):
        for n in sizes:
            if p - n + 1 >= 0:
                ends.setdefault(tuple(tokens[p - n + 1:p + 1]), []).append(p)
    return ends


def test_ngram_index_follows_growth_and_crops():
    import numpy as np

    from completiond.engine.lookup import NGRAM_SIZES, NgramIndex

    rng = np.random.default_rng(0)
    index = NgramIndex()
    buf = np.zeros(4096, dtype=np.int64)
    length = 0
    for step in range(300):
        if rng.random() < 0.25 and length:
            length = int(rng.integers(0, length))  # the prefix cache crops to a shared prefix
        add = rng.integers(0, 6, size=int(rng.integers(1, 12)))  # a small alphabet: many repeats
        buf[length:length + len(add)] = add
        length += len(add)
        index.sync(buf, length)
        assert index.ends == _brute_ends(buf[:length].tolist(), NGRAM_SIZES), step
    # a proposal continues the most recent earlier occurrence of the longest matching n-gram
    stream = [1, 2, 3, 4, 9, 9, 1, 2, 3, 4, 7, 8, 5, 1, 2, 3]
    index = NgramIndex()
    arr = np.array(stream[:-1], dtype=np.int64)
    index.sync(arr, len(arr))
    assert index.propose([1, 2, 3, 4], 3) == [7, 8, 5]     # the 4-gram "1 2 3 4" last followed by "7 8 5"
    assert index.propose(stream[-4:], 3) == [4, 7]          # "1 2 3": a shorter match proposes SHORT_MATCH_K
    assert index.propose([42, 43], 3) == []                 # nothing to continue


def test_ngram_proposal_prefers_an_occurrence_with_a_full_continuation():
    import numpy as np

    from completiond.engine.lookup import NgramIndex

    # period-5 text: the latest "1 2 3 4" ends one token before the stream's end, the one before it
    # has a whole period after it
    stream = [9, 8] + [1, 2, 3, 4, 0] * 3 + [1, 2, 3, 4]
    index = NgramIndex()
    arr = np.array(stream[:-1], dtype=np.int64)
    index.sync(arr, len(arr))
    assert index.propose(stream[-4:], 5) == [0, 1, 2, 3, 4]
    assert index.propose(stream[-4:], 1) == [0]


@pytest.mark.parametrize("early_exit", [False, True])
def test_prompt_lookup_greedy_equals_plain_greedy(engine, early_exit):
    import dataclasses

    prompt = ids(engine, PROMPT * 4)  # repeated text: the index has matches to propose
    plain = engine.generate(prompt, SamplingParams(max_tokens=48, speculative=False, ignore_eos=True))
    saved = engine.calibration
    try:
        engine.calibration = dataclasses.replace(saved, speculative=early_exit)
        spec = engine.generate(prompt, SamplingParams(max_tokens=48, prompt_lookup=True, ignore_eos=True,
                                                      exit_layer=2 if early_exit else None))
    finally:
        engine.calibration = saved
    assert spec.tokens == plain.tokens
    s = spec.stats
    assert s.lookup_rounds > 0 and s.lookup_drafted > 0
    if not early_exit:
        assert s.drafted == s.lookup_drafted  # every draft came from the index
    # continuing from the cached sequence (its index is cropped and extended) stays exact
    follow = prompt + spec.tokens[:20]
    warm = engine.generate(follow, SamplingParams(max_tokens=20, prompt_lookup=True, ignore_eos=True))
    engine.cache.clear()
    cold = engine.generate(follow, SamplingParams(max_tokens=20, speculative=False, ignore_eos=True))
    assert warm.tokens == cold.tokens


def test_draft_none_is_prompt_lookup_alone_whatever_the_calibration(engine):
    """draft="none": no model draft even when the calibration has speculation on; lookup still drafts."""
    import dataclasses

    prompt = ids(engine, PROMPT * 4)
    plain = engine.generate(prompt, SamplingParams(max_tokens=48, speculative=False, ignore_eos=True))
    saved = engine.calibration
    try:
        engine.calibration = dataclasses.replace(saved, speculative=True, exit_layer=2)
        alone = engine.generate(prompt, SamplingParams(max_tokens=48, prompt_lookup=True, draft="none", ignore_eos=True))
        nothing = engine.generate(prompt, SamplingParams(max_tokens=48, prompt_lookup=False, draft="none",
                                                         ignore_eos=True))
        one = engine.generate(prompt, SamplingParams(max_tokens=48, prompt_lookup=True, draft="none", draft_k=1,
                                                     ignore_eos=True))
    finally:
        engine.calibration = saved
    assert alone.tokens == plain.tokens == nothing.tokens
    assert alone.stats.lookup_rounds > 0 and alone.stats.drafted == alone.stats.lookup_drafted > 0
    assert alone.stats.draft == "" and alone.stats.exit_layer == engine.num_layers
    assert nothing.stats.drafted == 0 and nothing.stats.rounds == len(plain.tokens)
    # alone, lookup's K is the request's: at most one token a round with draft_k=1, more with the default
    assert one.tokens == plain.tokens and 0 < one.stats.lookup_drafted <= one.stats.lookup_rounds
    assert alone.stats.lookup_drafted > alone.stats.lookup_rounds


def test_sampled_prompt_lookup_alone_verifies_rounds_without_a_match(engine):
    """Sampling with lookup alone: a round whose lookup finds nothing verifies the bare pending token
    (greedy takes a plain step instead); such rounds happen, and a seed still reproduces the run."""
    prompt = ids(engine, PROMPT * 4)
    params = SamplingParams(max_tokens=48, temperature=0.8, seed=11, prompt_lookup=True, draft="none",
                            ignore_eos=True)
    a, b = engine.generate(prompt, params), engine.generate(prompt, params)
    assert a.tokens == b.tokens and len(a.tokens) == 48
    assert 0 < a.stats.lookup_rounds < a.stats.rounds  # some rounds matched, some had nothing to verify


def test_prompt_lookup_sampling_is_reproducible_and_on_support(engine):
    prompt = ids(engine, PROMPT * 4)
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=5, prompt_lookup=True, exit_layer=2)
    a = engine.generate(prompt, params)
    b = engine.generate(prompt, params)
    assert a.tokens == b.tokens and a.stats.lookup_rounds > 0
