"""Jumps, switches and opens reuse exact KV: every suggestion from a reused or warmed cache equals the one a
cold prefill of the same prompt gives, token for token; the prefix cache keeps distinct prefixes within its
byte budget."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from completiond.completion.healing import TokenHealer
from completiond.completion.plan import PromptOptions
from completiond.completion.prompt import PromptBuilder
from completiond.completion.warmup import Warmup, head_ids, walk_lines
from completiond.engine.engine import Engine, SamplingParams
from completiond.engine.kvcache import KVSequence, PrefixCache
from completiond.models.fim import make_template

FILES = [
    "".join(f"def handler_{k}_{i}(request, value):\n    '''Handle {i}.'''\n    result = value * {i} + {k}\n"
            f"    if result > {i * 3}:\n        return request.send(result)\n    return None\n\n" for i in range(60))
    for k in range(3)
]


@pytest.fixture(scope="module")
def engines():
    warm, cold = Engine.load(None, device="cpu"), Engine.load(None, device="cpu")
    return warm, cold


def psm_builder(engine: Engine, order: str = "psm") -> PromptBuilder:
    tok = engine.tokenizer
    options = PromptOptions(prefix_tokens=320, suffix_tokens=48, context_tokens=0, max_prompt_tokens=440)
    return PromptBuilder(make_template(tok, "completiond", order=order), options, TokenHealer.for_tokenizer(tok))


def line_end(text: str, line: int) -> int:
    lines = text.split("\n")
    return sum(len(x) + 1 for x in lines[:line]) + len(lines[line])


def test_every_event_kind_equals_a_cold_prefill(engines):
    warm, cold = engines
    warm.cache.clear()
    builder = psm_builder(warm)
    params = SamplingParams(max_tokens=6, speculative=False)
    reused: dict[str, list[float]] = {}

    def request(kind: str, text: str, offset: int) -> None:
        prompt = builder.build(text, offset)
        got = warm.generate(prompt.ids, params, constraint=prompt.constraint)
        cold.cache.clear()
        want = cold.generate(prompt.ids, params, constraint=prompt.constraint)
        assert got.tokens == want.tokens, kind
        reused.setdefault(kind, []).append(got.stats.reused_tokens / len(prompt.ids))

    def warm_up(text: str, offset: int | None) -> None:
        w = Warmup(warm, builder, text, offset)
        while w.step(None):
            pass

    a, b = FILES[0], FILES[1]
    warm_up(a, None)                                   # opened
    request("open", a, line_end(a, 40))
    typed = a[:line_end(a, 40)]
    for ch in "\n    x = handler":                      # typing in place
        typed += ch
        request("keystroke", typed + a[line_end(a, 40):], len(typed))
    request("jump", a, line_end(a, 150))               # at once, no warm-up: window anchored, prefix shared
    request("jump", a, line_end(a, 120))
    warm_up(a, line_end(a, 120))                        # the cursor rests
    request("jump_rest", a, line_end(a, 200))
    request("jump_rest", a, line_end(a, 90))
    warm_up(b, None)                                   # another file
    request("open", b, line_end(b, 30))
    request("switch", a, line_end(a, 90))              # back to the first one
    assert max(reused["jump_rest"]) > 0.5 and min(reused["switch"]) > 0.5, reused
    assert max(reused["open"]) > 0.3, reused


def test_a_suffix_first_layout_warms_only_at_the_resting_cursor(engines):
    warm, _ = engines
    spm = psm_builder(warm, order="spm").build(FILES[0], line_end(FILES[0], 20))
    psm = psm_builder(warm).build(FILES[0], line_end(FILES[0], 20))
    assert head_ids(spm) == []                          # no other cursor's prompt starts like this one
    rest = head_ids(spm, at_cursor=True)                # ... but a request at this very cursor does
    assert rest == spm.ids[: len(spm.ids) - spm.cursor_line_tokens] and len(rest) > len(spm.suffix_ids)
    head = head_ids(psm)
    assert head and psm.ids[:len(head)] == head and len(head) < len(psm.ids) - len(psm.suffix_ids)
    builder = psm_builder(warm, order="spm")
    assert Warmup(warm, builder, FILES[0], None).lines == []          # opened: the cursor is not known
    assert Warmup(warm, builder, FILES[0], 123).lines == [(123, True)]    # rested: there, once, whole
    walk = Warmup(warm, psm_builder(warm), FILES[0], 123).lines        # prefix-first: the line's head, the
    own = FILES[0].rfind("\n", 0, 123) + 1
    assert walk[:2] == [(own, False), (123, True)] and all(not whole for _, whole in walk[2:])  # prompt, the walk


def test_a_rest_in_a_suffix_first_layout_equals_a_cold_prefill(engines):
    # The bundled model's own layout: a rest warms the prompt at the cursor but its cursor line; the request
    # there, and the ones typed after it, reuse it and answer as a cold prefill does.
    warm, cold = engines
    warm.cache.clear()
    builder = psm_builder(warm, order="spm")
    params = SamplingParams(max_tokens=6, speculative=False)
    a = FILES[0]
    offset = line_end(a, 150)
    w = Warmup(warm, builder, a, offset)
    while w.step(None):
        pass
    assert w.warmed > 0 and w.done_targets == 1
    first = builder.build(a, offset)
    assert warm.warm(first.ids, limit=0)[1] == len(first.ids)   # the whole prompt at the cursor is cached
    text, at = a, offset
    for typed in ("", " #", " n"):    # at the cursor, then typing on its line
        text, at = text[:at] + typed + text[at:], at + len(typed)
        prompt = builder.build(text, at)
        got = warm.generate(prompt.ids, params, constraint=prompt.constraint)
        cold.cache.clear()
        want = cold.generate(prompt.ids, params, constraint=prompt.constraint)
        assert got.tokens == want.tokens, typed
        assert got.stats.reused_tokens > 0.8 * len(prompt.ids), (typed, got.stats.reused_tokens, len(prompt.ids))


def test_walk_lines_go_down_from_the_cursor_then_up():
    text = "".join(f"line {i}\n" for i in range(100))
    starts = walk_lines(text, None, 16)
    assert starts[0] == text.index("line 16") and starts[-1] == 0
    at = walk_lines(text, text.index("line 50"), 16)
    assert at[0] == text.index("line 50") and at[1] == text.index("line 64")   # the cursor's line, then down
    assert text.index("line 32") in at and at[-1] == 0 and len(set(at)) == len(at)
    assert walk_lines(text, text.index("line 48") + 3, 16)[:2] == [text.index("line 48"), text.index("line 64")]


def test_prefix_lru_stays_within_its_budget_and_keeps_recent_files(engines):
    warm, _ = engines
    builder = psm_builder(warm)
    per_token = 2 * warm.num_layers * warm.adapter.num_kv_heads * warm.adapter.head_dim * 4
    budget = 1500 * per_token
    saved = warm.cache
    warm.cache = PrefixCache(budget)
    try:
        files = [f.replace("handler_", f"h{n}_") for n in range(20) for f in FILES[:1]]
        for text in files:   # 20 files opened, each file's head warmed
            warm.warm(head_ids(builder.build(text, line_end(text, 14))))
            assert warm.cache.nbytes <= budget
        assert warm.cache.evictions > 0
        last = head_ids(builder.build(files[-1], line_end(files[-1], 14)))
        new, cached = warm.warm(last)
        assert new == 0 and cached == len(last)         # the most recent file's head is still there
        first = head_ids(builder.build(files[0], line_end(files[0], 14)))
        assert warm.warm(first, limit=0)[1] < len(first)  # the oldest went
    finally:
        warm.cache = saved


def test_a_sequence_holding_another_supersedes_it():
    cache = PrefixCache(1 << 30)

    def seq(tokens: list[int]) -> KVSequence:
        s = KVSequence(1, 1, 4, __import__("torch").float32, "cpu", capacity=len(tokens))
        s.commit(tokens)
        return s

    short, other = seq(list(range(100))), seq(list(range(50)) + [7] * 60)
    cache.release(short)
    cache.release(other)
    cache.release(seq(list(range(300))))
    assert len(cache) == 2 and cache.superseded == 1     # the 100-token copy went; the branch stays
    s, reused = cache.acquire(np.arange(300), lambda n: seq([]))
    assert reused == 299


def test_eviction_keeps_each_files_latest_prompt_before_older_ones_of_a_file_in_use():
    # Issue 45's switch back: the prompts of the file in use (its jumps, its warm-up walk) used to evict, oldest
    # first, the one prompt of the file left a minute ago. A sequence whose head (the context block, the file's
    # first lines) a newer one shares goes first; the last of its kind stays while another can go.
    def seq(head: int, tail: int) -> KVSequence:
        s = KVSequence(1, 1, 4, __import__("torch").float32, "cpu", capacity=256)
        s.commit([head] * 64 + [tail] * 150)
        return s

    one = seq(1, 0).nbytes
    cache = PrefixCache(3 * one)
    left = seq(2, 0)                       # the file the user left
    cache.release(seq(1, 10))
    cache.release(left)
    for tail in (11, 12, 13):              # three more prompts of the file in use
        cache.release(seq(1, tail))
        assert cache.nbytes <= cache.budget_bytes
    assert cache.evictions == 2 and left in cache._entries.values()
    assert [int(s.tokens[100]) for s in cache._entries.values()] == [0, 12, 13]
    for head in (3, 4):                    # only last-of-their-kind sequences left: least recently used first
        cache.release(seq(head, 0))
    assert left not in cache._entries.values()
    # Documents whose prompts start alike (one context block's first chunk): the completer tags each sequence
    # with its document, and that is what groups them.
    cache = PrefixCache(3 * one)
    cache.group = "left.py"
    left = seq(1, 0)
    cache.release(left)
    cache.group = "used.py"
    for tail in (11, 12, 13):
        cache.release(seq(1, tail))
    assert left in cache._entries.values() and left.group == "left.py"
    assert [int(s.tokens[100]) for s in cache._entries.values()] == [0, 12, 13]
    # Within a document a warm-up's sequences go before a request's: the walk after a request makes newer
    # prompts of its document, and the request's own is the one a switch back asks for.
    cache = PrefixCache(3 * one)
    cache.group = "left.py"
    asked = seq(1, 0)
    cache.release(asked)
    for tail in (11, 12, 13):
        cache.release(seq(1, tail), background=True)
    assert asked in cache._entries.values() and not asked.background
    assert [int(s.tokens[100]) for s in cache._entries.values()] == [0, 12, 13]



def test_a_warm_up_never_cuts_a_cached_request_prompt(engines):
    # Issue 45's switch back: a warm-up after a request (the cursor line's head, then the walk's heads below it)
    # cut the request's cached prompt back to the head it shares, in place: its cursor line and suffix were
    # gone, and a switch back to that cursor prefilled them again. Warm-ups now leave it whole (a copy of the
    # shared head grows instead), and what they cache still equals a cold prefill.
    warm, cold = engines
    builder = psm_builder(warm)
    text = FILES[1]
    saved = warm.cache
    warm.cache = PrefixCache(1 << 30)
    try:
        at = line_end(text, 100)
        prompt = builder.build(text, at)
        params = SamplingParams(max_tokens=4)
        first = warm.generate(prompt.ids, params)
        warm.warm(head_ids(prompt))                                  # fully cached inside the request's prompt
        below = builder.build(text, line_end(text, 104))
        warm.warm(head_ids(below))                                   # shares the window above the cursor line
        again = warm.generate(prompt.ids, params)
        assert again.stats.reused_tokens == len(prompt.ids) - 1, again.stats
        assert again.tokens == first.tokens == cold.generate(prompt.ids, params).tokens
        here = warm.generate(below.ids, params)
        assert here.stats.reused_tokens >= len(head_ids(below))
        assert here.tokens == cold.generate(below.ids, params).tokens
    finally:
        warm.cache = saved


def test_a_warm_up_cancelled_inside_a_chunk_leaves_a_cold_prefills_cache(engines):
    """Warm-ups look at their cancel token between slices of a chunk's layers: a chunk cut part-way is not
    committed (its first layers' K/V lie past the sequence's length), and the request that comes next gets the
    logits of a cold prefill, bit for bit."""
    from completiond.engine.cancel import CancelToken

    engine = engines[0]
    prompt = [(5 * i + 7) % 200 + 3 for i in range(150)]
    cold = engine.logits_for(prompt, use_cache=False)
    engine.cache.clear()
    token = CancelToken()
    real, calls = engine.run_layers, []

    def cancel_in_the_second_chunk(h, first, last, *args, **kw):
        calls.append((first, last))
        if len(calls) == 5:  # the second chunk's first slice: cancelled once it is done
            token.cancel()
        return real(h, first, last, *args, **kw)

    engine.run_layers = cancel_in_the_second_chunk
    try:
        warmed, cached = engine.warm(prompt[:120], token)
    finally:
        engine.run_layers = real
    chunk = max(32, engine.prefill_chunk // 4)
    assert calls[0][0] == 0 and calls[1][0] > 0  # a chunk's layers in slices
    assert len(calls) == 5 and warmed == cached == chunk  # the second chunk stopped after one slice
    assert torch.equal(engine.logits_for(prompt), cold)
