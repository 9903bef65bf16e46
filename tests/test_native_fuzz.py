"""Bad sizes, ids and positions at the native step's boundary (issue 27 item 6): each is refused with an
EngineError, never a crash and never a write outside the KV cache. Two layers are driven: the Python
wrappers (NativeStep) with hand-picked and random bad values, and step.c's entry points called directly
through ctypes (so its own checks, not only the wrappers', are tested). It runs in a subprocess, so a
crash fails this test instead of killing pytest.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from completiond.engine import native

FUZZ = r'''
import ctypes, random, sys
import torch
from completiond.engine import native
from completiond.engine.engine import Engine, EngineError

eng = Engine.load(None, device="cpu", dtype="float32")
step, fwd = eng.fwd.native, eng.fwd
assert step is not None
L, V = eng.num_layers, fwd.embed_w.shape[0]
seq = eng.new_sequence(40)
cap = seq.k.shape[2]  # (rounded up from 40)
eng.prefill(seq, eng.tokenizer("def f(x):\n    return x\n").input_ids, None)
n = seq.length
guard = seq.k.clone(), seq.v.clone()

def unchanged(guard):
    """bit for bit: the cache's unwritten slots are uninitialised memory, where a NaN never equals itself"""
    return all(torch.equal(now.view(torch.uint8), then.view(torch.uint8)) for now, then in zip((seq.k, seq.v), guard))

hw, hb, eos = fwd.head_w, fwd.head_b, eng.eos_ids_tensor
d = step.model.d
refused = 0

def expect_error(fn, *a):
    global refused
    try:
        fn(*a)
    except EngineError:
        refused += 1
        return
    raise AssertionError(f"accepted {fn.__name__}{a!r}")

bad_tokens = [-1, V, V + 1, 2**31, 2**40, -2**63, 2**70]
for tok in bad_tokens:
    expect_error(step.verify_greedy, [1, tok], L, n, seq, hw, hb)
    expect_error(step.draft_greedy, tok, 2, n, 3, 0.0, seq, hw, hb, None, eos)
for pos in [-1, -2**31, cap, cap - 1, 2**31, 2**33 + n]:  # cap - 1 with 2 rows: one past the end
    expect_error(step.verify_greedy, [1, 2], L, pos, seq, hw, hb)
    expect_error(step.layers, fwd.embed_w[[1, 2]][None].float(), 0, L, pos, seq, True, None, None)
expect_error(step.draft_greedy, 1, 2, cap - 2, 3, 0.0, seq, hw, hb, None, eos)  # k_max past the end
for first, last in [(0, L + 1), (-1, 2), (3, 2), (0, 2**32 + 1), (2**32, 2**32 + 1)]:
    expect_error(step.layers, fwd.embed_w[[1]][None].float(), first, last, n, seq, True, None, None)
    if last > L:
        expect_error(step.verify_greedy, [1], last, n, seq, hw, hb)
for k_max in [0, -1, cap + 1]:
    expect_error(step.draft_greedy, 1, 2, n, k_max, 0.0, seq, hw, hb, None, eos)
expect_error(step.verify_greedy, [], L, n, seq, hw, hb)
expect_error(step.verify_greedy, [1.5], L, n, seq, hw, hb)
h2 = fwd.embed_w[[1, 2]][None].float()
expect_error(step.layers, h2, 0, L, n, seq, True, torch.tensor([0, 1, 2]), None)          # rope rows
expect_error(step.layers, h2, 0, L, n, seq, True, torch.tensor([0, 10**9]), None)         # rope position
expect_error(step.layers, h2, 0, L, n, seq, True, torch.tensor([0, -1]), None)
expect_error(step.layers, h2, 0, L, n, seq, True, None, torch.ones(2, n + 1, dtype=torch.bool))  # mask shape
expect_error(step.layers, h2, 0, L, n, seq, True, None, torch.ones(3, n + 2, dtype=torch.bool))
expect_error(step.layers, fwd.embed_w[[1]][None, :, :-1].float(), 0, L, n, seq, True, None, None)  # width
expect_error(step.draft_greedy, 1, 2, n, 3, 0.0, seq, hw[:10], None, torch.tensor([1, 2]), eos)   # ids shape
expect_error(step.draft_greedy, 1, 2, n, 3, 0.0, seq, hw[:3], None, torch.tensor([1, V, 2]), eos)  # ids range
expect_error(step.head, h2, fwd.norm_w, fwd.norm_eps, hw[:, :-1].contiguous(), None)             # head width
small = eng.new_sequence(8)
small_k = small.k
small.k = small.k[:1]  # a cache with fewer layer slots than the range
expect_error(step.layers, h2, 0, L, 0, small, True, None, None)
small.k = small_k

assert unchanged(guard), "a refused call wrote into the cache"

# random mixtures: refused, or run (when every value happens to be valid); never a crash
rng = random.Random(0)
ran = 0
for i in range(300):
    t = rng.choice([0, 1, 2, 5, 33, 34, cap, cap + 1])
    pos = rng.choice([-3, -1, 0, n, cap - t, cap - t + 1, cap, 2**31 - 1, 2**32 + 3])
    last = rng.choice([-1, 0, 1, L, L + 1, 2**31])
    toks = [rng.choice([0, 1, V - 1, V, -1, 2**31 + 7, 2**63 - 1]) for _ in range(max(t, 0))]
    try:
        step.verify_greedy(toks, last, pos, seq, hw, hb)
        ran += 1
    except EngineError:
        refused += 1
    try:
        step.draft_greedy(toks[0] if toks else 0, last, pos, max(t, 1), 0.0, seq, hw, hb, None, eos)
        ran += 1
    except EngineError:
        refused += 1

# step.c's own checks, past the wrappers: the same bad values straight through ctypes
guard = seq.k.clone(), seq.v.clone()
lib = step.lib
step._rope()
m = ctypes.byref(step.model)
ids = torch.tensor([1, V], dtype=torch.int64)
out = torch.empty(2, dtype=torch.int64)
states = torch.empty(4, d)
toks = torch.empty(4, dtype=torch.int64)
fed = ctypes.c_int(0)
packed, fmt, sc = step._pack(hw)
emb, ebf = step._embed()
kp, vp = seq.k.data_ptr(), seq.v.data_ptr()
cs, sn = fwd._cos.data_ptr(), fwd._sin.data_ptr()
nw = fwd.norm_w.data_ptr()
def verify(tokens, t, last, pos, capacity=cap):
    return lib.cd_verify_greedy(m, emb, ebf, tokens.data_ptr(), t, last, pos, nw, fwd.norm_eps, packed.data_ptr(), fmt,
                                native.abi._ptr(sc), V, native.abi._ptr(hb), kp, vp, capacity, cs, sn, 1, out.data_ptr())
def draft(token, E, pos, k_max, ids_ptr=None, Vd=V):
    return lib.cd_draft_greedy(m, emb, ebf, token, E, pos, k_max, 0.0, nw, fwd.norm_eps, packed.data_ptr(), fmt,
                               native.abi._ptr(sc), Vd, native.abi._ptr(hb), ids_ptr, eos.data_ptr(), eos.numel(), kp, vp, cap,
                               cs, sn, 1, toks.data_ptr(), states.data_ptr(), ctypes.byref(fed))
h = torch.zeros(2, d)
def layers(t, first, last, pos, rope=None):
    return lib.cd_layers(m, h.data_ptr(), t, first, last, pos, None if rope is None else rope.data_ptr(), None, 1,
                         kp, vp, cap, cs, sn, 1)
codes = [
    verify(ids, 2, L, n),                      # token V
    verify(torch.tensor([-5, 1]), 2, L, n),    # negative token
    verify(ids[:1], 1, L, cap),                # slot == capacity
    verify(ids[:1], 1, L, -1),
    verify(ids[:1], 1, L + 1, n),
    verify(ids[:1], 0, L, n),
    draft(V, 2, n, 3), draft(-1, 2, n, 3), draft(1, L + 1, n, 3), draft(1, 2, cap - 2, 3), draft(1, 2, n, 0),
    draft(1, 2, n, 3, torch.tensor([0, V, 1], dtype=torch.int64).data_ptr(), 3),
    draft(1, 2, n, 3, None, V + 1),
    layers(1, 0, L, cap), layers(2, 0, L, cap - 1), layers(1, 2, 1, n), layers(1, 0, L + 1, n), layers(0, 0, L, n),
    layers(1, -1, L, n), layers(2, 0, L, n, torch.tensor([0, 10**9])), layers(1, 0, L, -4),
]
kept = step.model.layers[0].wfmt
for bad in (native.FMT_BF16_ROWS, 7, -1):  # layers are panels only: a row-major or unknown format is refused
    step.model.layers[0].wfmt = bad
    codes.append(layers(1, 0, L, n))
step.model.layers[0].wfmt = kept
assert all(c < -1 for c in codes), codes
assert unchanged(guard), "a refused call wrote into the cache"
assert ran > 0
print("refused", refused, "ran", ran, "c-codes", len(codes))
'''


def test_bad_values_at_the_native_boundary_are_refused_never_a_crash():
    if native.library() is None:
        pytest.skip(f"native step unavailable here: {native.reason()}")
    out = subprocess.run([sys.executable, "-c", FUZZ], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "COMPLETIOND_NATIVE": "1"})
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout}\n{out.stderr[-3000:]}"
    assert "refused" in out.stdout
