"""Prompt-lookup drafts: code repeats itself, so the text that followed the last few tokens
the previous time they occurred is a free draft.

`NgramIndex` keeps, for one KV sequence, the end positions of every n-gram (n = 2..4)
of its committed tokens: prompt (context files, FIM suffix, prefix) and generated text
alike. It follows the sequence as it grows, is cut back when the prefix cache crops the
sequence to a new prompt's shared prefix, and so stays incremental across keystrokes:
a one-character edit re-indexes only the few tokens after the edit.

A lookup proposal is deterministic, a one-hot q: speculative sampling's accept test
min(1, p(x)/q(x)) becomes p(x) and the residual max(0, p - q) is p without x, so the
output is still distributed exactly as the model's.
"""

from __future__ import annotations

import numpy as np

NGRAM_SIZES = (4, 3, 2)  # longest first: a longer match predicts its continuation better
# How far back a proposal looks for an occurrence with a longer continuation (NgramIndex.propose).
RECENT_OCCURRENCES = 8
# Most tokens a match shorter than the longest n-gram proposes. Measured on the bundled model (bench's
# held-out prompts and edit workload, lookup alone, greedy): after a 4-gram match the i-th proposed token
# is accepted with P(a >= i) = 0.98, 0.86-0.90, 0.78-0.83, 0.61-0.78 for i = 1..4; after a 2- or 3-gram
# match 0.59-0.68, 0.23-0.36, 0.16-0.25. Each verified position costs a share of a step (on a CPU about
# a quarter, arithmetic-bound), so the third token on after a short match costs more than it returns.
SHORT_MATCH_K = 2


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
                    key = tuple(self.tokens[p - n + 1:p + 1].tolist())
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
        ends = self.ends
        for n in self.sizes:
            first = max(keep, n - 1)  # the first position that ends an n-gram and is new
            if first >= length:
                continue
            a = first - n + 1 - lo
            keys = zip(*(toks[a + i:length - lo - n + 1 + i] for i in range(n)))
            for p, key in zip(range(first, length), keys):
                got = ends.get(key)
                if got is None:
                    ends[key] = [p]
                else:
                    got.append(p)
        self.length = length

    def propose(self, tail: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest indexed n-gram equal to the end of `tail`.
        `tail` ends with tokens not yet indexed (the pending token).

        The occurrence is the most recent one with k tokens after it, else, of the last
        RECENT_OCCURRENCES, the one with the longest continuation (the most recent on ties): in
        text that repeats with a short period (a list of zeros, a run of similar lines) the latest
        occurrence sits just before the tail and has one or two indexed tokens after it, while the
        one a period earlier continues the same way for longer. A match shorter than the longest
        n-gram proposes at most SHORT_MATCH_K tokens."""
        stream_end = self.length + len(tail) - min(len(tail), max(self.sizes))
        for n in self.sizes:
            if len(tail) < n:
                continue
            ends = self.ends.get(tuple(tail[-n:]))
            if not ends:
                continue
            cap = k if n == max(self.sizes) else min(k, SHORT_MATCH_K)
            best = (0, 0)  # (continuation length, start)
            for e in reversed(ends[-RECENT_OCCURRENCES:]):
                if e + 1 >= stream_end + n - 1 and e + 1 >= self.length:
                    continue  # the occurrence is the tail itself
                got = min(cap, self.length - e - 1)
                if got > best[0]:
                    best = (got, e + 1)
                    if got == cap:
                        break
            if best[0]:
                return self.tokens[best[1]:best[1] + best[0]].tolist()
        return []
