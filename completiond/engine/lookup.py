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
        for p in range(keep, length):
            for n in self.sizes:
                if p - n + 1 >= 0:
                    self.ends.setdefault(tuple(self.tokens[p - n + 1:p + 1].tolist()), []).append(p)
        self.length = length

    def propose(self, tail: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest indexed n-gram equal to the end of `tail`
        (the most recent occurrence that has a continuation). `tail` ends with tokens not yet
        indexed (the pending token); continuations may run into them."""
        stream_end = self.length + len(tail) - min(len(tail), max(self.sizes))
        for n in self.sizes:
            if len(tail) < n:
                continue
            ends = self.ends.get(tuple(tail[-n:]))
            if not ends:
                continue
            for e in reversed(ends):
                if e + 1 >= stream_end + n - 1 and e + 1 >= self.length:
                    continue  # the occurrence is the tail itself
                out = self.tokens[e + 1:min(e + 1 + k, self.length)].tolist()
                if out:
                    return out
        return []
