"""Medusa heads and tree verification (greedy decoding).

The heads (models/medusa.py: format and training) read the final state of the last committed
token, the one whose LM-head output chose `pending`, and guess the tokens after pending: head i
gives a top-k list for depth i. A fixed tree shape (paths of ranks, e.g. (0,) (1,) (0, 0) ...)
turns those lists into a token tree rooted at pending; prompt lookup can add its proposal as
one more branch. The verifier runs every tree node in one pass: node i sits in KV slot pos + i
at rope position pos + depth(i), and attends to the prefix and its own ancestors only (a tree
mask). Greedy acceptance walks from the root along the child whose token is the model's argmax
at its parent; the accepted path's K/V is moved into consecutive slots and everything else is
left as scratch, so the cache afterwards is what a chain of single steps would have written.

The walk is exact for greedy decoding only. With sampling, or under a constraint (token
healing), requests with the Medusa draft use the early-exit chain instead, which stays exact
(SpecInfer-style recursive rejection over siblings is not implemented).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch
import torch.nn.functional as F

from completiond.engine.draft import first_usable
from completiond.engine.draft_kind import DraftKind
from completiond.fileio import user_cache_dir
from completiond.models.medusa import MEDUSA_FILE, MedusaFileError, read_heads

if TYPE_CHECKING:
    from completiond.engine.runner import Runner

log = logging.getLogger(__name__)

# Ranks per depth: 7 positions with the root, so a verify pass stays within the small-pass kernels.
DEFAULT_TREE: tuple[tuple[int, ...], ...] = ((0,), (1,), (0, 0), (1, 0), (0, 0, 0), (0, 0, 0, 0))


@dataclass
class Medusa:
    weights: list  # [d, d] per head, in the engine's dtype and device
    biases: list  # [d] per head
    path: Path
    training: dict = field(default_factory=dict)
    tree: tuple = DEFAULT_TREE

    @property
    def num_heads(self) -> int:
        return len(self.weights)


def user_medusa_path(model_id: str) -> Path:
    return user_cache_dir() / "completiond" / "medusa" / f"{model_id}.safetensors"


def attach(engine: "Runner", path: Path) -> Medusa:
    rec = read_heads(path, engine.model_id, engine.model.config)
    to = dict(device=engine.device, dtype=engine.dtype)
    tree = tuple(p for p in DEFAULT_TREE if len(p) <= rec.num_heads)
    return Medusa([w.to(**to) for w in rec.weights], [b.to(**to) for b in rec.biases], Path(path), rec.training, tree)


def find_and_attach(engine: "Runner", model_dir: Path | None) -> Medusa | None:
    paths = [user_medusa_path(engine.model_id)] + ([Path(model_dir) / MEDUSA_FILE] if model_dir is not None else [])
    medusa = first_usable(paths, lambda p: attach(engine, p), MedusaFileError, "Medusa heads", log)
    if medusa is not None:
        log.info("Medusa heads %s (%d heads)", medusa.path, medusa.num_heads)
    return medusa


def candidates(engine: "Runner", medusa: Medusa, h: torch.Tensor, depth: int, width: int) -> list[list[int]]:
    """Top-`width` ids per depth 1..depth from the heads, for the final state h [1, 1, d] (pre-norm)."""
    hn = engine.fwd.norm(h)  # [1, 1, d]
    rows = engine.draft_head_weight if engine.draft_head_weight is not None else engine.fwd.head_w  # [Vd, d]
    out = []
    for i in range(depth):
        x = hn + F.silu(F.linear(hn, medusa.weights[i], medusa.biases[i]))  # [1, 1, d]
        logits = F.linear(x, rows)[0, -1]  # [Vd]
        top = torch.topk(logits, min(width, logits.shape[0])).indices
        ids = top if engine.draft_ids is None else engine.draft_ids[top]
        out.append(ids.tolist())
    return out


@dataclass
class Tree:
    tokens: list[int]  # node 0 is the root (pending)
    parents: list[int]  # -1 for the root
    depth: list[int]
    children: list[dict[int, int]]  # token -> child node

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int) -> int:
        if token in self.children[parent]:
            return self.children[parent][token]
        self.tokens.append(token)
        self.parents.append(parent)
        self.depth.append(self.depth[parent] + 1)
        self.children.append({})
        self.children[parent][token] = len(self.tokens) - 1
        return len(self.tokens) - 1

    def ancestors(self, device) -> torch.Tensor:
        """[N, N] bool: entry (i, j) says node j is node i or one of its ancestors."""
        n = len(self.tokens)
        anc = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            j = i
            while j >= 0:
                anc[i, j] = True
                j = self.parents[j]
        return anc.to(device)


def build_tree(
    pending: int,
    cand: list[list[int]],
    shape: Sequence[tuple[int, ...]],
    chains: Sequence[list[int]] = (),
    max_depth: int = 1 << 30,
) -> Tree:
    """The tree of the rank paths in `shape` (prefix-closed) over the candidate lists, plus each chain
    as a branch from the root; nodes deeper than max_depth are left out."""
    tree = Tree([pending], [-1], [0], [{}])
    node_of: dict[tuple[int, ...], int] = {(): 0}
    for path in sorted(shape, key=len):
        if len(path) > max_depth or len(path) > len(cand) or path[-1] >= len(cand[len(path) - 1]):
            continue
        parent = node_of.get(path[:-1])
        if parent is None:
            continue  # its parent was left out
        node_of[path] = tree.add(parent, cand[len(path) - 1][path[-1]])
    for chain in chains:
        node = 0
        for tok in chain[:max_depth]:
            node = tree.add(node, tok)
    return tree


def accept_path(tree: Tree, argmax: list[int]) -> tuple[list[int], int]:
    """Greedy walk: (nodes of the accepted path from the root, the model's token after its last node)."""
    path = [0]
    while True:
        nxt = tree.children[path[-1]].get(argmax[path[-1]])
        if nxt is None:
            return path, argmax[path[-1]]
        path.append(nxt)


class TreeDecoder:
    """Greedy rounds with a Medusa tree: one verify pass over the tree, the longest matching path kept.

    The heads need the final state of the token before pending; the first round has none yet,
    so it is a plain step that keeps its state."""

    kind = DraftKind.MEDUSA

    def __init__(self, engine: "Runner", medusa: Medusa, lookup: bool, width: int = 2, history=None):
        self.engine = engine
        self.medusa = medusa
        self.lookup = lookup
        self.history = history  # engine.lookup.OutputHistory: the tree walk is greedy, so it may read it
        self.width = max(width, 1 + max(p[-1] for p in medusa.tree))
        self.h_prev: torch.Tensor | None = None  # [1, 1, d] final state that chose `pending`
        self.max_nodes = len(medusa.tree) + 1 + (8 if lookup else 0)

    def _lookup_chain(self, seq, pending: int, limit: int) -> list[int]:
        from completiond.engine.draft import LOOKUP_K
        from completiond.engine.lookup import lookup_for

        return lookup_for(seq, pending, min(LOOKUP_K, limit), self.history)[0]

    def candidates(self, seq, pending: int, depth: int) -> list[list[int]]:
        """Per depth 1..depth, the ids to try there, best first (from the heads)."""
        h = self.h_prev
        if h is None:  # step() makes the first round a plain step, which keeps it
            raise RuntimeError("the heads need the final state of the token before pending")
        return candidates(self.engine, self.medusa, h, depth, self.width)

    def step(self, seq, pending: int, limit: int, stats) -> list[int]:
        eng = self.engine
        L = eng.num_layers
        p0 = seq.length
        stats.rounds += 1
        if self.h_prev is None:
            h = eng.run_layers(eng.embed([pending]), 0, L, p0, seq)  # [1, 1, d]
            seq.commit([pending])
            self.h_prev = h
            return [int(torch.argmax(eng.head(h)[-1]))]
        t0 = time.perf_counter()
        depth = min(self.medusa.num_heads, limit)
        cand = self.candidates(seq, pending, depth)
        chains = [self._lookup_chain(seq, pending, limit)] if self.lookup else []
        tree = build_tree(pending, cand, self.medusa.tree, [c for c in chains if c], max_depth=limit)
        t1 = time.perf_counter()
        n = len(tree)
        positions = torch.tensor(tree.depth, device=eng.device) + p0  # [N]
        mask = torch.cat([torch.ones(n, p0, dtype=torch.bool, device=eng.device), tree.ancestors(eng.device)], 1)
        h = eng.run_layers(eng.embed(tree.tokens), 0, L, p0, seq, tree=(positions, mask))  # [1, N, d]
        argmax = torch.argmax(eng.head(h), dim=-1).tolist()  # [N]
        path, bonus = accept_path(tree, argmax)
        # Move the accepted nodes' K/V into consecutive slots; children come after their parents, so
        # every source lies at or after its target and is read before anything overwrites it.
        for j, i in enumerate(path):
            if i != j:
                seq.k[:L, :, p0 + j] = seq.k[:L, :, p0 + i]
                seq.v[:L, :, p0 + j] = seq.v[:L, :, p0 + i]
        accepted = [tree.tokens[i] for i in path[1:]]
        seq.commit([pending] + accepted)
        self.h_prev = h[:, path[-1] : path[-1] + 1]
        stats.draft_ms += 1000 * (t1 - t0)
        stats.verify_ms += 1000 * (time.perf_counter() - t1)
        stats.drafted += n - 1
        stats.accepted += len(accepted)
        stats.rejected += int(bool(tree.children[path[-1]]))  # it stopped where the tree offered more
        return accepted + [bonus]
