"""The context block's chunks: picked from the retrieval index for the query at the cursor, ordered,
and sticky per (editor, current file) (see retrieval.py's docstring for the rules)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable

from completiond.completion.retrieval import Chunk, Query, RetrievalIndex


def jaccard(a: Iterable[str], b: Iterable[str]) -> float:
    sa, sb = set(a), set(b)
    if not sa or not sb:
        return 0.0
    return len(sa & sb) / len(sa | sb)


class Selector:
    """Picks and orders the chunks of the context block, sticky per (editor, current file)."""

    def __init__(
        self,
        max_chunks: int = 8,
        dup_threshold: float = 0.7,
        max_states: int = 64,
        max_definitions: int = 2,
        margin: float = 0.5,
    ):
        self.max_chunks = max_chunks
        self.dup_threshold = dup_threshold
        self.max_definitions = max_definitions
        self.complete_partial = True
        self.best_last = False  # new chunks enter in reverse rank order: the best one nearest the file
        self.margin = margin  # a held block gives way to a fresh pick worth more than (1 + margin) times it
        self.in_file = True  # the current file's own chunks (outside the window) are candidates
        # The daemon's setting (issue 45): the block sits first in the prompt, so changing it re-prefills the whole
        # prompt (about a second for a 0.5B model on a CPU). With `hold` the held block stays while it is valid
        # (its chunks there, admitted, within the budget), whatever the cursor's query: a jump or a file switch
        # then reuses the cached KV of the block and of the window above the cursor. A held chunk of the current
        # file that the window has come to show stays too (shown twice rather than the whole prompt re-prefilled).
        self.hold = False
        # state -> the last block, each chunk as (id, path, digest): a chunk whose id went (its file was opened
        # in the editor, or edited and put back) is held on by its text.
        self._last: OrderedDict[Hashable, list[tuple[int, str, bytes]]] = OrderedDict()
        self.max_states = max_states

    def select(
        self,
        index: RetrievalIndex,
        state: Hashable,
        query: Query,
        allowed: Callable[[Chunk], bool],
        current_key: Hashable | None,
        cost: Callable[[Chunk], int],
        budget: int,
    ) -> list[Chunk]:
        def admitted(c: Chunk) -> bool:
            if c.key == current_key and (not self.in_file or (c.start < query.window[1] and c.end > query.window[0])):
                return False  # the prompt shows these lines already
            return allowed(c)

        def may_hold(c: Chunk) -> bool:
            if self.hold and c.key == current_key and self.in_file:
                return allowed(c)  # in the window now: held all the same (see `hold`)
            return admitted(c)

        if self.hold and state in self._last:
            held = self._held(index, self._last[state], may_hold)
            if held and all(c is not None for c in held):
                kept = [c for c in held if c is not None]
                if sum(cost(c) for c in kept) <= budget:
                    self._last.move_to_end(state)
                    self._last[state] = [(c.id, c.path, c.digest) for c in kept]
                    return kept

        terms = query.terms
        completions = index.completions(query.partial) if self.complete_partial else []
        if completions:
            # The names the identifier being typed may become: their uses and definitions are what
            # the model needs to finish it (they change only when the set of candidates does).
            terms = dict(terms)
            for t in completions:
                terms[t] = terms.get(t, 0.0) + 1.0
        defs = index.definitions(query.names, query.imports, admitted, qualifiers=query.qualifiers)[
            : self.max_definitions
        ]
        scores = index.bm25(terms, admitted)
        ranked = sorted(scores, key=lambda cid: (-scores[cid], cid))
        must = set(defs)
        wanted = list(dict.fromkeys(defs + ranked[: self.max_chunks]))
        fresh = self._fill([index.chunks[cid] for cid in wanted], must, cost, budget)
        held = self._held(index, self._last.get(state, ()), admitted)
        kept = [c for c in held if c is not None]
        chosen = fresh
        if held and len(kept) == len(held) and sum(cost(c) for c in kept) <= budget:
            # Hysteresis: the block the last request had stays, whole and in its order, until the
            # fresh pick is worth clearly more under this query (a change re-prefills the prompt
            # after it). Without the margin two picks of about equal worth take turns keystroke by
            # keystroke. A definition the cursor needs is worth as much as the best BM25 chunk.
            bonus = max(scores.values(), default=1.0)

            def worth(cs: list[Chunk]) -> float:
                return sum(scores.get(c.id, 0.0) + (bonus if c.id in must else 0.0) for c in cs)

            if worth(fresh) <= (1.0 + self.margin) * worth(kept):
                chosen = kept
        if chosen is fresh:
            # A new block: the chunks it shares with the old one first, in their old order, so the
            # block's common prefix (and its KV cache) survives; then the new ones.
            before = {c.id: k for k, c in enumerate(kept)}
            old = sorted((c for c in fresh if c.id in before), key=lambda c: before[c.id])
            new = [c for c in fresh if c.id not in before]
            chosen = old + (new[::-1] if self.best_last else new)
        self._last[state] = [(c.id, c.path, c.digest) for c in chosen]
        self._last.move_to_end(state)
        while len(self._last) > self.max_states:
            self._last.popitem(last=False)
        return chosen

    @staticmethod
    def _held(
        index: RetrievalIndex, last: Iterable[tuple[int, str, bytes]], admitted: Callable[[Chunk], bool]
    ) -> list[Chunk | None]:
        """The last block's chunks as they are now (None: gone or not admitted). One whose id went is found
        again by its path and text: a file opened in the editor (its disk copy's chunks give way to the
        editor's), or edited and put back, re-chunks it with new ids, and without this the block of every
        other file that held a chunk of it changed, and the KV cache of those files' prompts with it (a
        switch back to such a file prefilled nearly everything again)."""
        out: list[Chunk | None] = []
        taken: set[int] = set()
        by_path: dict[str, list[int]] | None = None
        for cid, path, digest in last:
            c = index.chunks.get(cid)
            if c is None or not admitted(c):
                if by_path is None:  # only when something went: one pass over the files
                    by_path = {}
                    for ids in index.by_key.values():
                        if ids:
                            by_path.setdefault(index.chunks[ids[0]].path, []).extend(ids)
                c = next(
                    (
                        index.chunks[k]
                        for k in by_path.get(path, ())
                        if k not in taken and index.chunks[k].digest == digest and admitted(index.chunks[k])
                    ),
                    None,
                )
            if c is not None:
                taken.add(c.id)
            out.append(c)
        return out

    def _fill(self, candidates: list[Chunk], must: set[int], cost: Callable[[Chunk], int], budget: int) -> list[Chunk]:
        """The candidates, in order, that fit the budget (near-duplicates of one already taken skipped);
        a definition in `must` that does not fit displaces the last chunks not in `must`, only where
        that makes room for it."""
        chosen: list[Chunk] = []
        used = 0
        for c in candidates:
            if len(chosen) >= self.max_chunks:
                break
            if any(jaccard(c.terms, o.terms) >= self.dup_threshold for o in chosen):
                continue
            k = cost(c)
            if used + k > budget:
                if c.id in must:
                    cut, freed = len(chosen), 0
                    while cut and used - freed + k > budget and chosen[cut - 1].id not in must:
                        cut -= 1
                        freed += cost(chosen[cut])
                    if used - freed + k <= budget:
                        del chosen[cut:]
                        chosen.append(c)
                        used += k - freed
                continue
            chosen.append(c)
            used += k
        return chosen

    def forget(self, state: Hashable) -> None:
        self._last.pop(state, None)
