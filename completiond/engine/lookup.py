"""Prompt-lookup drafts: code repeats itself, so the text that followed the last few tokens
the previous time they occurred is a free draft.

`NgramIndex` keeps, for one KV sequence, the end positions of every n-gram (n = 2..4)
of its committed tokens: prompt (context files, FIM suffix, prefix) and generated text
alike. It follows the sequence as it grows, is cut back when the prefix cache crops the
sequence to a new prompt's shared prefix, and so stays incremental across keystrokes:
a one-character edit re-indexes only the few tokens after the edit.

`OutputHistory` keeps what the engine generated for earlier requests. Typing through a
suggestion, or past a line the model already guessed, makes the next request generate text
that the previous one did, and that text is in no prompt (it was ghost text, never typed).

A lookup proposal is deterministic, a one-hot q: speculative sampling's accept test
min(1, p(x)/q(x)) becomes p(x) and the residual max(0, p - q) is p without x, so the
output is still distributed exactly as the model's.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from completiond.engine.kvcache import KVSequence

NGRAM_SIZES = (4, 3, 2)  # longest first: a longer match predicts its continuation better
# How far back a proposal looks for an occurrence with a longer continuation (NgramIndex.propose).
RECENT_OCCURRENCES = 8
# Most tokens a match shorter than the longest n-gram proposes. Measured on the bundled model (bench's
# held-out prompts and edit workload, lookup alone, greedy): after a 4-gram match the i-th proposed token
# is accepted with P(a >= i) = 0.98, 0.86-0.90, 0.78-0.83, 0.61-0.78 for i = 1..4; after a 2- or 3-gram
# match 0.59-0.68, 0.23-0.36, 0.16-0.25. Each verified position costs a share of a step (on a CPU about
# a quarter, arithmetic-bound), so the third token on after a short match costs more than it returns.
SHORT_MATCH_K = 2
# Output history: how many generated tokens it keeps, and how many prompt tokens it keeps before each
# output (so that a 4-gram ending in the output's first tokens can match).
HISTORY_TOKENS = 8192
HISTORY_CONTEXT = 3
HISTORY_N = 4


def _best_occurrence(ends: list[int], cont_len, cap: int, skip=lambda e: False) -> tuple[int, int]:
    """(continuation length, start) of the occurrence a proposal continues: the most recent one with
    `cap` tokens after it, else, of the last RECENT_OCCURRENCES, the longest (the most recent on ties)."""
    best = (0, 0)
    for e in reversed(ends[-RECENT_OCCURRENCES:]):
        if skip(e):
            continue
        got = min(cap, cont_len(e))
        if got > best[0]:
            best = (got, e + 1)
            if got == cap:
                break
    return best


class NgramIndex:
    def __init__(self, sizes: tuple[int, ...] = NGRAM_SIZES):
        self.sizes = sizes
        self.tokens = np.empty(256, dtype=np.int64)  # our own copy: the sequence's tail may be overwritten
        self.length = 0
        self.ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> ascending positions of its last token

    def sync(self, tokens: np.ndarray, length: int) -> None:
        """Make the index cover exactly tokens[:length]."""
        m = min(self.length, length)
        keep = m
        if m:
            diff = np.flatnonzero(self.tokens[:m] != tokens[:m])
            keep = int(diff[0]) if len(diff) else m
        for p in range(self.length - 1, keep - 1, -1):  # drop what the sequence no longer has
            for n in self.sizes:
                if p - n + 1 >= 0:
                    key = tuple(self.tokens[p - n + 1 : p + 1].tolist())
                    ends = self.ends.get(key)
                    if ends and ends[-1] == p:
                        ends.pop()
                        if not ends:
                            del self.ends[key]
        if length > len(self.tokens):
            grown = np.empty(max(length, 2 * len(self.tokens)), dtype=np.int64)
            grown[:keep] = self.tokens[:keep]
            self.tokens = grown
        self.tokens[keep:length] = tokens[keep:length]
        # A first prompt indexes thousands of tokens at once: build the keys with zip over one list
        # (about 3x faster than slicing the array per position). Per key, positions stay ascending.
        lo = max(0, keep - max(self.sizes) + 1)
        toks = self.tokens[lo:length].tolist()
        index = self.ends
        for n in self.sizes:
            first = max(keep, n - 1)  # the first position that ends an n-gram and is new
            if first >= length:
                continue
            a = first - n + 1 - lo
            keys = zip(*(toks[a + i : length - lo - n + 1 + i] for i in range(n)))
            for p, key in zip(range(first, length), keys):
                got = index.get(key)
                if got is None:
                    index[key] = [p]
                else:
                    got.append(p)
        self.length = length

    def propose(self, tail: list[int], k: int, sizes: tuple[int, ...] | None = None) -> list[int]:
        """Up to k tokens that followed the longest indexed n-gram equal to the end of `tail` (of `sizes`,
        default all). `tail` ends with tokens not yet indexed (the pending token).

        The occurrence is the most recent one with k tokens after it, else, of the last
        RECENT_OCCURRENCES, the one with the longest continuation (the most recent on ties): in
        text that repeats with a short period (a list of zeros, a run of similar lines) the latest
        occurrence sits just before the tail and has one or two indexed tokens after it, while the
        one a period earlier continues the same way for longer. A match shorter than the longest
        n-gram proposes at most SHORT_MATCH_K tokens."""
        stream_end = self.length + len(tail) - min(len(tail), max(self.sizes))
        for n in self.sizes if sizes is None else sizes:
            if len(tail) < n:
                continue
            ends = self.ends.get(tuple(tail[-n:]))
            if not ends:
                continue
            cap = k if n == max(self.sizes) else min(k, SHORT_MATCH_K)
            best = _best_occurrence(
                ends,
                lambda e: self.length - e - 1,
                cap,
                # the occurrence that is the tail itself
                skip=lambda e, n=n: e + 1 >= stream_end + n - 1 and e + 1 >= self.length,
            )
            if best[0]:
                return self.tokens[best[1] : best[1] + best[0]].tolist()
        return []


class OutputHistory:
    """The last HISTORY_TOKENS tokens the engine generated, each output after the HISTORY_CONTEXT
    prompt tokens before it, indexed by their n-grams (n = HISTORY_N only: an output is short, and a
    shorter match into another request's text is right too rarely to pay for its verify positions).

    Read by greedy requests only. Under sampling the draft decides which random numbers a round
    draws, so a seeded request would give another text depending on what ran before it; a greedy
    request's text is the model's argmax chain whatever drafts it. Measurements use their own
    history (Engine.generate's `history`), so no run drafts from an earlier run of the same prompt.
    Not thread-safe: the engine runs one generation at a time."""

    SEP = -1  # between outputs: no n-gram or continuation crosses it (token ids are >= 0)

    def __init__(self, capacity: int = HISTORY_TOKENS, n: int = HISTORY_N):
        self.capacity, self.n = capacity, n
        self.outputs: deque[list[int]] = deque()
        self.size = 0  # tokens in self.outputs
        self.stream: list[int] = []  # the outputs in order, each followed by SEP
        self.ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> ascending end positions in stream

    def __len__(self) -> int:
        return self.size

    def clear(self) -> None:
        self.outputs.clear()
        self.size = 0
        self.stream = []
        self.ends = {}

    def add(self, context: list[int], output: list[int]) -> None:
        """Record one request's output with the prompt tokens just before it."""
        seg = [int(t) for t in context[len(context) - min(len(context), HISTORY_CONTEXT) :]] + [int(t) for t in output]
        if not output or len(seg) <= self.n or (self.outputs and self.outputs[-1] == seg):
            return  # nothing to continue from, or the same request again (a re-request at one cursor)
        self.outputs.append(seg)
        self.size += len(seg)
        if self.size > self.capacity:
            # Drop the oldest outputs down to 3/4 of capacity and index again: amortised, a rebuild
            # every quarter capacity of new tokens.
            while self.outputs and self.size > self.capacity * 3 // 4:
                self.size -= len(self.outputs.popleft())
            self.stream, self.ends = [], {}
            for old in self.outputs:
                self._index(old)
        else:
            self._index(seg)

    def _index(self, seg: list[int]) -> None:
        base, n = len(self.stream), self.n
        self.stream.extend(seg)
        self.stream.append(self.SEP)
        for i in range(n - 1, len(seg)):
            self.ends.setdefault(tuple(seg[i - n + 1 : i + 1]), []).append(base + i)

    def _continuation(self, e: int) -> int:
        """Tokens after position e up to the end of its output."""
        j = e + 1
        while self.stream[j] != self.SEP:
            j += 1
        return j - e - 1

    def propose(self, tail: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the last n tokens of `tail` in an earlier output."""
        if len(tail) < self.n or k < 1:
            return []
        ends = self.ends.get(tuple(int(t) for t in tail[-self.n :]))
        if not ends:
            return []
        got, start = _best_occurrence(ends, self._continuation, k)
        return self.stream[start : start + got]


def lookup_for(seq: "KVSequence", pending: int, k: int, history: OutputHistory | None = None) -> tuple[list[int], bool]:
    """A lookup proposal of up to k tokens after `pending` for one sequence, and whether it came from the
    output history. Order: the sequence's own longest n-gram, then the history's, then the sequence's
    shorter n-grams (a 4-gram match anywhere beats a 2-gram match here)."""
    if seq.lookup is None:
        seq.lookup = NgramIndex()
    index = seq.lookup
    index.sync(seq.tokens, seq.length)
    tail = seq.tokens[max(0, seq.length - max(NGRAM_SIZES) + 1) : seq.length].tolist() + [pending]
    found = index.propose(tail, k, index.sizes[:1])
    if found:
        return found, False
    if history is not None:
        found = history.propose(tail, k)
        if found:
            return found, True
    return index.propose(tail, k, index.sizes[1:]), False
