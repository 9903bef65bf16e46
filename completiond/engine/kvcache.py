"""Prefix KV cache shared across requests.

A `KVSequence` is one token sequence with the keys and values of every layer
for each of its tokens. The `PrefixCache` holds sequences that are not in use,
within a byte budget, and hands out the one sharing the longest prefix with a
new prompt (any cached sequence, so switching files and back still hits).
Least recently used sequences are evicted first, older prompts of a document
before the last prompt of another (each file's latest prompt stays longest; a
sequence that a newer one holds nearly all of goes at once: the budget keeps
the prefixes of distinct files and regions, an LRU of them); `on_evict` is
told, so a GPU caller can return memory to the allocator.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

import numpy as np
import torch

# Growing a sequence's tensors copies them, so capacity grows in steps.
_CAPACITY_STEP = 256
# Fewer shared tokens than this (and than half the prompt) are not reused from a sequence that would lose
# more than that to them.
_MIN_SHARED = 32
# A cached sequence sharing all but this many of its tokens with one released after it is dropped then.
_SUPERSEDED = 8
# Untagged sequences whose first this many tokens agree count as one file's prompts when the cache evicts.
_HEAD = 64


class KVSequence:
    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        capacity: int = _CAPACITY_STEP,
    ):
        capacity = _round_up(max(capacity, 1))
        # [layers, kv_heads, capacity, head_dim]; slots past len(tokens) are scratch space
        # that a round may write ahead into before it knows what is accepted.
        self.k = torch.empty(layers, kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        self.tokens = np.empty(capacity, dtype=np.int64)
        self._sized()
        self.length = 0  # tokens whose KV is valid in every layer
        # A trained exit adapter (engine/exit_adapter.py) keeps its own K/V in the slot past the model's
        # layers; it is filled lazily by the draft, so it may lag: valid for positions < aux_length.
        self.aux_length = 0
        # A separate draft model's own sequence over the same tokens (engine/draft_model.py). It rides
        # on this one so that the prefix cache crops, copies and evicts both together; it may lag.
        self.companion: "KVSequence | None" = None
        # The document whose prompt this is (PrefixCache.group when it was released), for eviction; None: unknown.
        self.group: Any = None
        self.background = False  # last released by a background warm-up (not a request): evicted first in its group
        self.lookup: Any = None  # an NgramIndex (lookup.py, which imports this module): the prompt-lookup draft's n-gram index over tokens[:length], made on first use

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        return self._own_bytes + (self.companion.nbytes if self.companion is not None else 0)

    def _sized(self) -> None:
        # Kept, not recomputed: the cache sums every sequence's size at each release (its budget).
        self._own_bytes = 2 * self.k.element_size() * self.k.numel() + self.tokens.nbytes

    def ensure_capacity(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        new = _round_up(max(needed, 2 * self.capacity))
        k = torch.empty(*self.k.shape[:2], new, self.k.shape[3], dtype=self.k.dtype, device=self.k.device)
        v = torch.empty_like(k)
        k[:, :, : self.length] = self.k[:, :, : self.length]
        v[:, :, : self.length] = self.v[:, :, : self.length]
        tokens = np.empty(new, dtype=np.int64)
        tokens[: self.length] = self.tokens[: self.length]
        self.k, self.v, self.tokens = k, v, tokens
        self._sized()

    def commit(self, tokens: list[int]) -> None:
        """Mark the next len(tokens) slots (already written in every layer) as valid."""
        n = len(tokens)
        self.tokens[self.length : self.length + n] = tokens
        self.length += n

    def crop(self, length: int) -> None:
        self.length = min(self.length, max(0, length))
        self.aux_length = min(self.aux_length, self.length)
        if self.companion is not None:
            self.companion.crop(self.length)

    def copy_prefix(self, length: int, extra_capacity: int = 0) -> "KVSequence":
        out = KVSequence(
            self.k.shape[0],
            self.k.shape[1],
            self.k.shape[3],
            self.k.dtype,
            self.k.device,
            capacity=length + extra_capacity,
        )
        out.k[:, :, :length] = self.k[:, :, :length]
        out.v[:, :, :length] = self.v[:, :, :length]
        out.tokens[:length] = self.tokens[:length]
        out.length = length
        out.aux_length = min(self.aux_length, length)
        if self.companion is not None:
            c = self.companion
            out.companion = c.copy_prefix(min(c.length, length), extra_capacity=out.capacity - min(c.length, length))
        return out

    def common_prefix(self, prompt: np.ndarray) -> int:
        m = min(self.length, len(prompt))
        if m == 0:
            return 0
        # Each lookup and release compares against every cached sequence, and most part from the prompt at
        # once (a suffix-first prompt after the FIM token): two scalar reads, not the whole comparison.
        if self.tokens[0] != prompt[0]:
            return 0
        if m == 1 or self.tokens[1] != prompt[1]:
            return 1
        diff = np.flatnonzero(self.tokens[:m] != prompt[:m])
        return int(diff[0]) if len(diff) else m


class PrefixCache:
    """Sequences not in use, most recently used last."""

    def __init__(
        self, budget_bytes: int, on_evict: Callable[[KVSequence], None] | None = None, branch_threshold: int = 128
    ):
        self.budget_bytes = budget_bytes
        self.on_evict = on_evict
        # Reusing a sequence in place throws away its tail past the common
        # prefix. A short tail (a previous suggestion, a retyped word) is cheap
        # to lose; a long one (another file's body) is worth a copy of the prefix.
        self.branch_threshold = branch_threshold
        self._entries: OrderedDict[int, KVSequence] = OrderedDict()
        # What the worker's current work is for (the completer sets the document's path before a request or a
        # warm-up): sequences released meanwhile are that document's prompts, which `_victim` groups by.
        self.group: Any = None
        self.hits = 0
        self.lookups = 0
        self.evictions = 0
        self.superseded = 0

    def stats(self) -> dict[str, int]:
        """What the cache holds and has done (the daemon's stats)."""
        return {
            "bytes": self.nbytes,
            "budget_bytes": self.budget_bytes,
            "sequences": len(self._entries),
            "tokens": sum(s.length for s in self._entries.values()),
            "lookups": self.lookups,
            "hits": self.hits,
            "evictions": self.evictions,
            "superseded": self.superseded,
        }

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def acquire(
        self, prompt: list[int] | np.ndarray, factory: Callable[[int], KVSequence], keep_tails: bool = False
    ) -> tuple[KVSequence, int]:
        """Return (sequence, reused): a sequence whose first `reused` tokens equal the prompt's.

        The sequence leaves the cache until `release`. At most len(prompt) - 1 tokens are reused:
        the last prompt token is always fed to the model so that its logits exist. keep_tails: a background
        warm-up's prompt; a cached sequence it shares only a prefix of is copied, never cut (its tail is the
        cursor line and suffix of a request's prompt, which a switch back to that cursor asks for again).
        """
        prompt = np.asarray(prompt, dtype=np.int64)
        self.lookups += 1
        best_key, best = None, 0
        for key, seq in self._entries.items():
            n = seq.common_prefix(prompt)
            if n > best:
                best_key, best = key, n
        best = min(best, len(prompt) - 1)
        if best_key is None or best <= 0:
            return factory(len(prompt)), 0
        seq = self._entries[best_key]
        if best < _MIN_SHARED and best < len(prompt) // 2 and seq.length - best > best:
            # A few shared tokens (the template's first ones) are not worth another file's prefix: a fresh
            # sequence, and that one stays cached for its file.
            return factory(len(prompt)), 0
        self.hits += 1
        if keep_tails and best >= len(prompt) - 1:
            del self._entries[best_key]  # all the caller needs is there: the sequence goes back whole
            return seq, best
        if seq.length - best > (0 if keep_tails else self.branch_threshold):
            self._entries.move_to_end(best_key)
            return seq.copy_prefix(best, extra_capacity=len(prompt) - best), best
        del self._entries[best_key]
        seq.crop(best)
        return seq, best

    def release(self, seq: KVSequence, background: bool = False) -> None:
        """Put `seq` back (most recently used). background: a warm-up's, not a request's."""
        if seq.length == 0:
            return
        if self.group is not None:
            seq.group = self.group
        seq.background = background
        # A sequence this one holds (nearly) all of is only its shorter copy: drop it, so that the budget
        # keeps distinct prefixes (other files, other regions of a file) rather than copies of one.
        for key, other in list(self._entries.items()):
            if (
                other.length <= seq.length
                and seq.common_prefix(other.tokens[: other.length]) >= other.length - _SUPERSEDED
            ):
                del self._entries[key]
                self.superseded += 1
                if self.on_evict is not None:
                    self.on_evict(other)
        self._entries[id(seq)] = seq
        self._evict()

    def _evict(self) -> None:
        total = self.nbytes
        while total > self.budget_bytes and self._entries:
            seq = self._entries.pop(self._victim())
            total -= seq.nbytes
            self.evictions += 1
            if self.on_evict is not None:
                self.on_evict(seq)

    def _victim(self) -> int:
        """The key of the sequence to evict: the least recently used one of a document (`group`; untagged: its
        first _HEAD tokens) that another cached sequence is a prompt of too (a warm-up's before a request's), else
        the least recently used.
        So each document's latest prompt stays while older prompts of the documents in use go, and switching
        back to a file finds its block and its last window (issue 45: the walks' and jumps' prompts of the files
        in use had evicted the one of the file left a minute ago)."""
        keys = list(self._entries)
        groups = [_group_of(self._entries[k]) for k in keys]
        counts: dict[Any, int] = {}
        for group in groups:
            counts[group] = counts.get(group, 0) + 1
        # A warm-up's sequence goes before a request's: the walk after a request makes newer prompts of its document,
        # which would otherwise outlive the request's own, the one a switch back asks for.
        for background in (True, False):
            for key, group in zip(keys, groups):
                if group is not None and counts[group] > 1 and self._entries[key].background == background:
                    return key
        return keys[0]

    def clear(self) -> None:
        while self._entries:
            _, seq = self._entries.popitem(last=False)
            if self.on_evict is not None:
                self.on_evict(seq)


def _group_of(seq: KVSequence) -> Any:
    """The document `seq` is a prompt of, for eviction: its tag, else its first _HEAD tokens (None: shorter)."""
    if seq.group is not None:
        return ("document", seq.group)
    return ("head", seq.tokens[:_HEAD].tobytes()) if seq.length >= _HEAD else None


def _round_up(n: int) -> int:
    return -(-n // _CAPACITY_STEP) * _CAPACITY_STEP
