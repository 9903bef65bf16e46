"""Prompt lookup from earlier requests' outputs (engine/lookup.py OutputHistory): what it proposes,
that its index survives trimming, where it sits in the lookup order, that typing through a
suggestion drafts from it without changing a token, and that sampling and measurements stay
independent of it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from completiond.engine.engine import Engine, SamplingParams
from completiond.engine.kvcache import KVSequence
from completiond.engine.lookup import HISTORY_CONTEXT, OutputHistory, lookup_for

CODE = '''def parse_header(line: str) -> tuple[str, str]:
    name, _, value = line.partition(":")
    return name.strip().lower(), value.strip()


class Request:
    def __init__(self, method: str, path: str) -> None:
        self.method = method
        self.path = path
        self.headers: dict[str, str] = {}

    def add_header(self, line: str) -> None:
'''


def test_proposes_what_followed_the_last_four_tokens_and_never_crosses_outputs():
    h = OutputHistory()
    h.add([90, 91, 92], [1, 2, 3, 4, 5, 6])
    h.add([93, 94, 95], [7, 8, 9, 10])
    # the context before an output counts: 91, 92 + 1, 2 is a 4-gram of the first segment
    assert h.propose([91, 92, 1, 2], 3) == [3, 4, 5]
    assert h.propose([50, 1, 2, 3, 4], 8) == [5, 6]  # stops at the end of its output, not in the next one
    assert h.propose([5, 6, 93, 94], 4) == []  # no n-gram spans two outputs
    assert h.propose([2, 3, 4], 4) == []  # shorter than the n-gram: nothing
    assert h.propose([1, 2, 3, 4], 0) == []
    # the most recent occurrence with a full continuation wins
    h.add([0, 0, 0], [1, 2, 3, 4, 77, 78])
    assert h.propose([1, 2, 3, 4], 2) == [77, 78]


def test_the_same_output_twice_is_kept_once():
    h = OutputHistory()
    h.add([1, 2, 3], [4, 5, 6, 7])
    h.add([1, 2, 3], [4, 5, 6, 7])
    assert len(h) == 7 and len(h.outputs) == 1


def test_trimming_keeps_the_index_equal_to_one_built_from_scratch():
    rng = np.random.default_rng(3)
    h = OutputHistory(capacity=200)
    for _ in range(60):
        h.add(rng.integers(0, 12, 3).tolist(), rng.integers(0, 12, int(rng.integers(1, 30))).tolist())
        assert len(h) <= 200
        fresh = OutputHistory(capacity=10**9)
        for seg in h.outputs:
            fresh.outputs.append(seg)
            fresh._index(seg)
        assert h.stream == fresh.stream and h.ends == fresh.ends
    assert len(h.outputs) < 60  # it did trim


def _seq(tokens: list[int]) -> KVSequence:
    seq = KVSequence(1, 1, 2, torch.float32, "cpu", 64)
    seq.commit(tokens)
    return seq


def test_lookup_order_own_four_gram_then_history_then_own_shorter_ngrams():
    h = OutputHistory()
    h.add([0, 0, 0], [5, 6, 7, 8, 40, 41])
    # own 4-gram (5 6 7 8 -> 30) beats the history's (-> 40)
    found, from_history = lookup_for(_seq([5, 6, 7, 8, 30, 31, 1, 5, 6, 7]), 8, 2, h)
    assert (found, from_history) == ([30, 31], False)
    # only a 3-gram of its own (6 7 8 -> 30): the history's 4-gram comes first
    found, from_history = lookup_for(_seq([6, 7, 8, 30, 31, 1, 5, 6, 7]), 8, 2, h)
    assert (found, from_history) == ([40, 41], True)
    # without the history, the own 3-gram
    assert lookup_for(_seq([6, 7, 8, 30, 31, 1, 5, 6, 7]), 8, 2, None) == ([30, 31], False)


@pytest.fixture(scope="module")
def engine(bundled_checkpoint_dir) -> Engine:
    # The checkpoint's own values: the typed-through text below is their greedy output on every kernel (int8's
    # differs between the 8-bit and 7-bit activation builds, and on the AVX2 build loops where lookup drafts it).
    return Engine.load(bundled_checkpoint_dir, device="cpu")


LOOKUP_ALONE = dict(prompt_lookup=True, draft="none", draft_k=8, adaptive_k=False)


def test_typing_through_a_suggestion_drafts_from_its_text(engine):
    """The user types the first tokens of a suggestion: the next request continues the same text.
    With the history it drafts that text (fewer rounds), and the tokens are plain decoding's."""
    prompt = engine.tokenizer(CODE).input_ids
    first = engine.generate(prompt, SamplingParams(max_tokens=48, ignore_eos=True, **LOOKUP_ALONE),
                            history=(h := OutputHistory()))
    assert len(h) == HISTORY_CONTEXT + 48
    typed = prompt + first.tokens[:6]
    params = SamplingParams(max_tokens=32, ignore_eos=True, **LOOKUP_ALONE)
    engine.cache.clear()
    with_history = engine.generate(typed, params, history=h)
    engine.cache.clear()
    without = engine.generate(typed, params, history=None)
    engine.cache.clear()
    plain = engine.generate(typed, SamplingParams(max_tokens=32, ignore_eos=True, speculative=False,
                                                  prompt_lookup=False), history=None)
    assert with_history.tokens == without.tokens == plain.tokens
    assert with_history.tokens[:10] == first.tokens[6:16]  # greedy: the rest of the first suggestion
    assert with_history.stats.history_rounds > 0 and with_history.stats.history_accepted >= 8
    assert without.stats.history_rounds == 0
    assert with_history.stats.rounds < without.stats.rounds


def test_sampled_requests_neither_read_nor_write_it(engine):
    prompt = engine.tokenizer(CODE).input_ids
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=11, ignore_eos=True, **LOOKUP_ALONE)
    engine.cache.clear()
    alone = engine.generate(prompt, params, history=OutputHistory())
    h = OutputHistory()
    # a history full of what a sampled run would continue: a greedy run on the same prompt, and the
    # sampled output itself
    h.add(prompt, engine.generate(prompt, SamplingParams(max_tokens=24, **LOOKUP_ALONE), history=None).tokens)
    h.add(prompt, alone.tokens)
    before = list(h.stream)
    engine.cache.clear()
    again = engine.generate(prompt, params, history=h)
    assert again.tokens == alone.tokens
    assert again.stats.history_rounds == 0 and h.stream == before


def test_measurements_leave_the_users_history_alone(engine):
    from completiond.commands.bench import _timed

    engine.history.clear()
    prompt = engine.tokenizer(CODE).input_ids
    engine.generate(prompt, SamplingParams(max_tokens=8), history=None)
    _timed(engine, prompt, SamplingParams(max_tokens=8, **LOOKUP_ALONE))
    assert len(engine.history) == 0
    # a request with the defaults (the daemon's) adds its output
    engine.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(engine.history) == HISTORY_CONTEXT + 8
    engine.history.clear()
