"""The native step's logits do not depend on its threads: the same passes repeated at 2 threads, and at 1 thread
against 2, give the same bits (issue 45: a reuse made at one thread count must equal a cold prefill at another,
and the thread governor picks 1 or 2 threads with the machine's load).

step.c promises it by construction (each output column one multiply-add chain in index order, attention in
fixed key chunks, every reduction within one thread); these tests hold it to that on the build this CPU runs,
attention on tiles included where it has AMX (grouped heads, hd 64)."""

from __future__ import annotations

import pytest
import torch

from completiond.engine import native
from completiond.engine.engine import Engine
from tests.conftest import make_tiny_model

REPEATS = 4


@pytest.fixture(scope="module", params=["auto", "bf16", "int8"])
def engine(request, tmp_path_factory) -> Engine:
    if native.library() is None:
        pytest.skip(f"native step unavailable here: {native.reason()}")
    d = make_tiny_model(
        tmp_path_factory.mktemp("threads"), family="qwen2", layers=2, hidden=512, heads=8, kv_heads=2, seed=5
    )
    eng = Engine.load(d, device="cpu", dtype="float32", weights=request.param)
    assert eng.fwd.native is not None
    eng.threads = None  # the governor would pick its own count: these tests set it
    return eng


def _passes(eng: Engine, prompt: list[int]) -> list[torch.Tensor]:
    """A prefill in chunks of 37 past a 256-key chunk, a 5- and a 33-row pass past it, six one-row steps, and a
    cold prefill's logits: everything a reuse or a cold request reads."""
    outs = []
    p0 = len(prompt) - 40
    for rows in (5, 33):
        seq = eng.new_sequence(len(prompt) + 8)
        eng.prefill(seq, prompt[:p0], None, chunk_size=37)
        outs.append(eng.head(eng.fwd.layers_range(eng.embed(prompt[p0 : p0 + rows]), 0, eng.num_layers, p0, seq)))
    seq = eng.new_sequence(len(prompt) + 8)
    eng.prefill(seq, prompt[:-1], None, chunk_size=37)
    tok = prompt[-1]
    for _ in range(6):
        logits = eng.head(eng.fwd.layers_range(eng.embed([tok]), 0, eng.num_layers, seq.length, seq))[-1]
        seq.commit([tok])
        outs.append(logits)
        tok = int(logits.argmax())
    outs.append(eng.logits_for(prompt, use_cache=False))
    return outs


def _at(threads: int, eng: Engine, prompt: list[int]) -> list[torch.Tensor]:
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert torch.get_num_threads() == threads
        return _passes(eng, prompt)
    finally:
        torch.set_num_threads(saved)


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@torch.inference_mode()
def test_repeated_passes_at_two_threads_give_the_same_bits(engine):
    """No race and no timing-dependent order: the threads' scheduling differs between repeats, the bits do not."""
    prompt = [(i * 7) % 200 + 3 for i in range(300)]
    first = _at(2, engine, prompt)
    for i in range(REPEATS):
        assert _same(_at(2, engine, prompt), first), i


@torch.inference_mode()
def test_one_thread_gives_the_bits_of_two(engine):
    """No work split along a reduction: a cache filled at one thread count is the cache a cold prefill at the
    other would fill."""
    prompt = [(i * 11) % 200 + 3 for i in range(300)]
    one = _at(1, engine, prompt)
    assert _same(one, _at(2, engine, prompt))
    assert _same(one, _at(1, engine, prompt))
