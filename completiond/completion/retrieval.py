"""Repository retrieval: the chunks of workspace files that the code around the cursor needs.

The workspace (completion/workspace/store.py) feeds this index every file text it admits as context
(disk files under the folders' rules, and the editor's own documents that the same rules allow)
and nothing else; it removes a file's chunks when the file leaves. So the index can hold no
hidden, ignored, secret or outside file: it never reads a file itself.

* Chunks (chunking.py): about 10-20 lines, cut at definition starts (tree-sitter's, in every language
  languages.py has a grammar for; else the line rules) where one comes after at least MIN_DEF_LINES
  lines, else at a blank line once a chunk has MIN_LINES lines, and at MAX_LINES lines in any case.
  Chunks are keyed by their text's digest,
  so re-indexing a file after an edit re-tokenizes only the chunks whose text changed, and an
  unchanged chunk keeps its id (the context block, keyed by ids, stays the same).
* Terms: identifiers (keywords and one-letter names dropped), scored with BM25 against a query
  made of the identifiers of the lines around the cursor: the prefix tail and the suffix head.
* Definitions: each chunk records the names it defines (outline.py: functions, classes, types,
  methods, constants...); names at the cursor defined in the workspace are resolved to their
  definition chunk, preferring the module the current file imports them from, through each
  language's import forms (Python import/from, JS/TS import and require, Go import, Rust use, Java
  import, C/C++ #include, C# using; imports.py), or the module of their qualifier (`ns.name`).
* Selection (selection.py's `Selector`): near-duplicates and chunks overlapping the current window are dropped;
  the block is sticky per (editor, file), with hysteresis: the last request's block stays, whole
  and in its order, until a fresh pick is worth more than (1 + margin) times it under the current
  query (summed BM25 scores, a definition at the cursor counting as the best chunk), or one of its
  chunks is gone or no longer admitted. A new block puts the chunks it shares with the old one
  first, in their old order, so the common prefix (and its KV cache) survives. Typing a line
  therefore keeps the block; it changes where the cursor goes somewhere the block does not serve.
  The daemon holds it harder (`Selector.hold`, issue 45): the block comes first in the prompt, so a new one
  re-prefills all of it (about a second for a 0.5B model on a CPU); a file's block stays while its chunks are
  valid, whatever the query, and a jump, a rest or a switch back reuses the cached KV of the block and of the
  anchored window above the cursor.

Memory bound: the index holds at most `max_chunks` chunks (default 200,000); each chunk keeps its
text and a term table, about 6-8 times the text's size in CPython (measured: see the README's
retrieval section), over text the workspace already bounds (its max_bytes). A file past
`max_chunks_per_file` chunks is indexed up to that many.
"""

from __future__ import annotations

import math
import posixpath
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field

from completiond.completion import chunking
from completiond.completion import outline as outlines
from completiond.completion.chunking import (
    _OTHER_BREAKS,
    IDENT,
    MAX_LINES,
    MIN_DEF_LINES,
    MIN_LINES,
    STOP,
    Prepared,
    _edit_lines,
    _kind,
    _Parsed,
    defined_names,
    digest_of,
    kinds_of,
    prepare,
    split_lines,
    terms_of,
)
from completiond.completion.imports import Imports, imports_of, matches, module_targets

# The chunking names (chunking.py) where callers knew them before it was split off.
__all__ = [
    "IDENT",
    "MAX_LINES",
    "MIN_DEF_LINES",
    "MIN_LINES",
    "STOP",
    "Chunk",
    "Imports",
    "Query",
    "RetrievalIndex",
    "_kind",
    "defined_names",
    "imports_of",
    "make_query",
    "prepare",
    "split_lines",
    "terms_of",
]


@dataclass(eq=False)
class Chunk:
    id: int
    key: Hashable  # the workspace entry: (owner, path)
    path: str
    language: str
    start: int  # first line (0-based) in its file
    end: int  # line after the last
    text: str
    digest: bytes
    terms: dict[str, int]  # term -> count
    length: int  # number of terms
    defines: tuple[str, ...]


class RetrievalIndex:
    """Chunks of the admitted workspace texts, an inverted index over their identifiers, and the
    definitions they hold. Not thread-safe by itself: the workspace calls it under its lock."""

    def __init__(self, max_chunks: int = 200_000, max_chunks_per_file: int = 400):
        self.max_chunks = max_chunks
        self.max_chunks_per_file = max_chunks_per_file
        self.chunks: dict[int, Chunk] = {}
        self.by_key: dict[Hashable, list[int]] = {}
        self.postings: dict[str, set[int]] = {}
        self.defs: dict[str, set[int]] = {}
        self.by_head: dict[str, set[str]] = {}  # first 2 characters -> terms (completing a partial name)
        self.total_length = 0
        self.version = 0
        self._next = 1
        self._parsed: OrderedDict[bytes, _Parsed] = OrderedDict()  # digest -> parse, across files and edits
        # key -> (text, its lines) of the files edited last: an edit splits only its own lines again.
        self._lines: OrderedDict[Hashable, tuple[str, list[str], bool]] = OrderedDict()
        # key -> (text, outline or None) of the editor's documents edited last: an edit moves the outline.
        self._outlines: OrderedDict[Hashable, tuple[str, outlines.Outline | None]] = OrderedDict()
        self.max_line_caches = 8
        self.max_outlines = 64  # small (a line number and names per definition): an editor's open files

    def __len__(self) -> int:
        return len(self.chunks)

    def files(self) -> int:
        return len(self.by_key)

    # -- updates ---------------------------------------------------------
    def update(
        self,
        key: Hashable,
        path: str,
        language: str,
        text: str,
        prepared: Prepared | None = None,
        keep_outline: bool = False,
    ) -> None:
        """(Re-)index one file; chunks whose text did not change keep their ids. keep_outline: keep where
        its definitions start for its next edit (an editor's document: see `update_edit`)."""
        self._lines.pop(key, None)
        self._outlines.pop(key, None)
        if prepared is None:
            prepared = prepare(text, self.max_chunks_per_file, language=language)
        old: dict[bytes, list[Chunk]] = {}
        for cid in self.by_key.get(key, ()):
            c = self.chunks[cid]
            old.setdefault(c.digest, []).append(c)
        ids: list[int] = []
        for s, e, body, digest, parsed, defines in prepared.pieces[: self.max_chunks_per_file]:
            same = old.get(digest)
            if same:
                c = same.pop()
                c.start, c.end = s, e  # the text moved, it did not change
                self._redefine(c, defines)
                ids.append(c.id)
                continue
            if len(self.chunks) >= self.max_chunks:
                break  # the bound: the rest of this file is not indexed
            ids.append(self._add(key, path, language, s, e, body, digest, parsed, defines))
        for rest in old.values():
            for c in rest:
                self._remove(c)
        if ids:
            self.by_key[key] = ids
        else:
            self.by_key.pop(key, None)
        if keep_outline:
            self._keep_outline(key, text, prepared.outline)
        self.version += 1

    def update_edit(self, key: Hashable, path: str, language: str, old_text: str, text: str) -> bool:
        """Re-index an edited file from the last cut before its first changed line up to the first
        old cut in its unchanged tail (usually one or two chunks for a keystroke); chunks outside
        keep their ids, those after the edit move by the lines it added or removed. False (nothing
        done) where the file is not indexed whole: the caller then re-indexes it with `update`.

        The cost is the edit's, not the file's: the changed stretch is found by comparing the two
        texts in C (no line-by-line loop), and the file's lines are kept from the last update, so
        only the changed lines are split again (see `_edit_lines`)."""
        ids = self.by_key.get(key)
        if not ids:
            return False
        old_chunks = [self.chunks[cid] for cid in ids]
        old_lines, plain = self._lines_of(key, old_text)
        if old_chunks[-1].end != len(old_lines) or old_chunks[0].start != 0:
            return False  # indexed in part (the per-file or total bound)
        edit = _edit_lines(old_text, text, old_lines, plain)
        if edit is None:
            return True
        lines, lo, n_old_reg, n_new_reg, plain = edit
        self._keep_lines(key, text, lines, plain)
        n_old, n_new = len(old_lines), len(lines)
        hi = n_old - lo - n_old_reg  # lines after the edit, the same in both texts
        delta = n_new - n_old
        outline = None
        if outlines.spec_with_grammar(language) is not None:
            # The outline of the last whole parse, moved with the edits since; the edited lines by the line
            # rules (no parse per keystroke). None kept for this text: parse it whole now, once.
            kept, before = self._outline_of(key, old_text)
            if not kept:
                self.update(key, path, language, text, keep_outline=True)
                self._keep_lines(key, text, lines, plain)
                return True
            if before is not None:
                outline = chunking.edit_outline(before, lo, n_old_reg, lines[lo : lo + n_new_reg])
            self._keep_outline(key, text, outline)
        tail = n_new - hi  # new lines from here on are the old ones, moved by delta
        keep = 0
        while keep < len(old_chunks) and old_chunks[keep].end < lo:
            keep += 1  # a cut at `end` depends on lines end-1 and end: both unchanged
        start = old_chunks[keep - 1].end if keep else 0
        old_at = {c.start: k for k, c in enumerate(old_chunks) if k >= keep}

        def resume(i: int) -> bool:
            return i - 1 >= tail and (i - delta) in old_at

        middle = split_lines(lines, start=start, resume=resume, kinds=kinds_of(lines, outline))
        end = middle[-1][1] if middle else start
        rest = old_chunks[old_at[end - delta] :] if end < n_new and (end - delta) in old_at else []
        if keep + len(middle) + len(rest) > self.max_chunks_per_file:
            return False
        replaced = old_chunks[keep : len(old_chunks) - len(rest)]
        by_digest: dict[bytes, list[Chunk]] = {}
        for c in replaced:
            by_digest.setdefault(c.digest, []).append(c)
        new_ids = [c.id for c in old_chunks[:keep]]
        for s, e in middle:
            body = "".join(lines[s:e])
            digest = digest_of(body)
            defines = outline.defined_in(s, e) if outline is not None else None
            same = by_digest.get(digest)
            if same:
                c = same.pop()
                c.start, c.end = s, e
                self._redefine(c, defines)
                new_ids.append(c.id)
            elif len(self.chunks) < self.max_chunks:
                new_ids.append(self._add(key, path, language, s, e, body, digest, defines=defines))
        for c in rest:
            c.start += delta
            c.end += delta
            new_ids.append(c.id)
        for left in by_digest.values():
            for c in left:
                self._remove(c)
        if new_ids:
            self.by_key[key] = new_ids
        else:
            self.by_key.pop(key, None)
        self.version += 1
        return True

    def _lines_of(self, key: Hashable, text: str) -> tuple[list[str], bool]:
        """text's lines (splitlines, ends kept) and whether it breaks lines at "\\n" only."""
        hit = self._lines.get(key)
        if hit is not None and (hit[0] is text or hit[0] == text):
            return hit[1], hit[2]
        return text.splitlines(keepends=True), not _OTHER_BREAKS.search(text)

    def _keep_lines(self, key: Hashable, text: str, lines: list[str], plain: bool) -> None:
        self._lines[key] = (text, lines, plain)
        self._lines.move_to_end(key)
        while len(self._lines) > self.max_line_caches:
            self._lines.popitem(last=False)

    def _outline_of(self, key: Hashable, text: str) -> tuple[bool, outlines.Outline | None]:
        """(whether one is kept, the outline kept for the file at `key` when its text is `text`)."""
        hit = self._outlines.get(key)
        if hit is not None and (hit[0] is text or hit[0] == text):
            self._outlines.move_to_end(key)
            return True, hit[1]
        return False, None

    def _keep_outline(self, key: Hashable, text: str, outline: outlines.Outline | None) -> None:
        self._outlines[key] = (text, outline)
        self._outlines.move_to_end(key)
        while len(self._outlines) > self.max_outlines:
            self._outlines.popitem(last=False)

    def remove(self, key: Hashable) -> None:
        self._lines.pop(key, None)
        self._outlines.pop(key, None)
        for cid in self.by_key.pop(key, ()):
            c = self.chunks.get(cid)
            if c is not None:
                self._remove(c)
        self.version += 1

    def _parse(self, body: str, digest: bytes) -> _Parsed:
        p = self._parsed.get(digest)
        if p is None:
            p = _Parsed(body)
            self._parsed[digest] = p
            if len(self._parsed) > 4096:
                self._parsed.popitem(last=False)
        else:
            self._parsed.move_to_end(digest)
        return p

    def _add(
        self,
        key,
        path,
        language,
        s,
        e,
        body,
        digest,
        parsed: _Parsed | None = None,
        defines: tuple[str, ...] | None = None,
    ) -> int:
        p = parsed if parsed is not None else self._parse(body, digest)
        cid = self._next
        self._next += 1
        c = Chunk(
            cid, key, path, language, s, e, body, digest, p.terms, p.length, p.defines if defines is None else defines
        )
        self.chunks[cid] = c
        for t in c.terms:
            ids = self.postings.get(t)
            if ids is None:
                ids = self.postings[t] = set()
                self.by_head.setdefault(t[:2], set()).add(t)
            ids.add(cid)
        for name in c.defines:
            self.defs.setdefault(name, set()).add(cid)
        self.total_length += c.length
        return cid

    def _redefine(self, c: Chunk, defines: tuple[str, ...] | None) -> None:
        """A kept chunk whose file's outline now says it defines other names (same text, other context)."""
        if defines is None or defines == c.defines:
            return
        self._undefine(c)
        c.defines = defines
        for name in defines:
            self.defs.setdefault(name, set()).add(c.id)

    def _undefine(self, c: Chunk) -> None:
        for name in c.defines:
            ids = self.defs.get(name)
            if ids is not None:
                ids.discard(c.id)
                if not ids:
                    del self.defs[name]

    def _remove(self, c: Chunk) -> None:
        self.chunks.pop(c.id, None)
        for t in c.terms:
            ids = self.postings.get(t)
            if ids is not None:
                ids.discard(c.id)
                if not ids:
                    del self.postings[t]
                    head = self.by_head.get(t[:2])
                    if head is not None:
                        head.discard(t)
                        if not head:
                            del self.by_head[t[:2]]
        self._undefine(c)
        self.total_length -= c.length

    # -- queries ---------------------------------------------------------
    def bm25(
        self,
        query: dict[str, float],
        allowed: Callable[[Chunk], bool],
        k1: float = 1.2,
        b: float = 0.75,
        max_df_fraction: float = 0.05,
        max_df_cap: int = 1000,
    ) -> dict[int, float]:
        """Chunk id -> BM25 score of `query` (term -> weight), over the chunks `allowed` admits."""
        n = len(self.chunks)
        if not n or not query:
            return {}
        avg = max(1.0, self.total_length / n)
        scores: dict[int, float] = {}
        ok: dict[int, bool] = {}
        # Terms in more chunks than this say little (idf ~3 or less against ~10 for rare names) and cost
        # the most: walking their postings is what a query spends its time on in a big workspace.
        max_df = max(8, min(max_df_cap, int(n * max_df_fraction)))
        for t, w in query.items():
            ids = self.postings.get(t)
            if not ids or len(ids) > max_df:  # too common to tell chunks apart (and the longest lists)
                continue
            idf = math.log(1.0 + (n - len(ids) + 0.5) / (len(ids) + 0.5))
            for cid in ids:
                good = ok.get(cid)
                c = self.chunks[cid]
                if good is None:
                    good = ok[cid] = allowed(c)
                if not good:
                    continue
                tf = c.terms[t]
                scores[cid] = scores.get(cid, 0.0) + w * idf * tf * (k1 + 1) / (tf + k1 * (1 - b + b * c.length / avg))
        return scores

    def completions(self, partial: str, limit: int = 6) -> list[str]:
        """Indexed terms that complete the identifier being typed (the most widely used first)."""
        if len(partial) < 2:
            return []
        found = [t for t in self.by_head.get(partial[:2], ()) if t.startswith(partial) and t != partial]
        found.sort(key=lambda t: (-len(self.postings[t]), t))
        return found[:limit]

    def definitions(
        self,
        names: Iterable[str],
        imports: Imports | None,
        allowed: Callable[[Chunk], bool],
        max_each: int = 3,
        qualifiers: dict[str, str] | None = None,
    ) -> list[int]:
        """Definition chunks of `names` (in that order): from the module the name's import (or its
        qualifier's, `ns.name`) points at, else from the wildcard imports' modules or the importing
        file's own folder where those hold one; names defined in more than max_each places that none
        of these disambiguates are skipped."""
        qualifiers = qualifiers or {}
        here = posixpath.dirname(imports.path.replace("\\", "/")) if imports is not None and imports.path else None
        out: list[int] = []
        for name in names:
            modules, there = imports.module_of(name, qualifiers.get(name)) if imports is not None else ([], name)
            ids = [cid for cid in self.defs.get(there, ()) if allowed(self.chunks[cid])]
            if not ids and there != name:
                ids = [cid for cid in self.defs.get(name, ()) if allowed(self.chunks[cid])]
            if not ids:
                continue
            explicit = imports is not None and (name in imports.names or qualifiers.get(name) in imports.modules)
            resolved = False
            if modules and imports is not None:
                targets = [t for m in modules for t in module_targets(m, imports.language, imports.path)]
                preferred = [cid for cid in ids if matches(self.chunks[cid].path, targets)]
                if preferred:
                    ids, resolved = preferred, True
            if not resolved and not explicit and here is not None and len(ids) > 1:
                # Go, Java, C#, C: a name used bare is most often the same package's, the same folder's
                nearby = [cid for cid in ids if posixpath.dirname(self.chunks[cid].path.replace("\\", "/")) == here]
                if nearby and len(nearby) <= max_each:
                    ids, resolved = nearby, True
            if len(ids) > max_each and not (explicit or resolved):
                continue
            ids.sort(key=lambda cid: (self.chunks[cid].path, self.chunks[cid].start))
            out.append(ids[0])
        return out


# -- the query around the cursor -------------------------------------------------


@dataclass
class Query:
    terms: dict[str, float]  # term -> weight
    names: list[str]  # names at the cursor, nearest first (definition look-ups)
    imports: Imports
    window: tuple[int, int]  # [first, last) line of the current window (chunks overlapping it are dropped)
    line: int  # cursor line
    partial: str = ""  # the identifier being typed, up to the cursor
    qualifiers: dict[str, str] = field(default_factory=dict)  # name at the cursor -> what it follows (`q.name`)


_IDENT_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_")


def trailing_identifier(s: str) -> str:
    """The identifier `s` ends with (what `[A-Za-z_][A-Za-z0-9_]*$` finds), found in linear time: that
    search backtracks quadratically over a long run of word characters that does not reach the end."""
    start = len(s)
    while start > 0 and s[start - 1] in _IDENT_CHARS:
        start -= 1
    while start < len(s) and s[start].isdigit():
        start += 1
    return s[start:]


def qualifiers_of(text: str) -> dict[str, str]:
    """name -> the name it follows through `.`, `::`, `->` or `?.` in `text` (`ns.name`: name -> ns);
    linear: one pass over the identifiers, the separators between them compared as strings."""
    out: dict[str, str] = {}
    prev_end, prev = -1, ""
    for m in IDENT.finditer(text):
        if prev and text[prev_end : m.start()].strip(" \t") in (".", "::", "->", "?."):
            out[m.group(0)] = prev
        prev_end, prev = m.end(), m.group(0)
    return out


def make_query(
    text: str,
    offset: int,
    before_lines: int = 12,
    after_lines: int = 4,
    window_before: int = 40,
    window_after: int = 12,
    language: str | None = "python",
    path: str | None = None,
    imports: Imports | None = None,
) -> Query:
    """Identifiers of the prefix tail (the cursor line up to the cursor and `before_lines` lines
    above it) and the suffix head (`after_lines` lines below), the names at the cursor (and what
    each is qualified by), the file's imports (read here in `language` unless given), and the lines
    the prompt's own window will likely show."""
    ls = text.rfind("\n", 0, offset) + 1
    cur_line = text.count("\n", 0, ls)
    # The identifier being typed is unfinished: leave it out (it also changes on every keystroke).
    line_head = text[ls:offset]
    partial = trailing_identifier(line_head)
    if partial:
        line_head = line_head[: len(line_head) - len(partial)]
    lo = ls
    for _ in range(before_lines):
        if lo <= 0:
            break
        lo = text.rfind("\n", 0, lo - 1) + 1
    hi = offset
    for _ in range(after_lines + 1):
        nl = text.find("\n", hi)
        if nl < 0:
            hi = len(text)
            break
        hi = nl + 1
    weights: dict[str, float] = {}
    for t in terms_of(text[lo:ls]):
        weights[t] = weights.get(t, 0.0) + 1.0
    near = terms_of(line_head)
    for t in near:
        weights[t] = weights.get(t, 0.0) + 2.0  # the cursor line says most about what comes next
    for t in terms_of(text[offset:hi]):
        weights[t] = weights.get(t, 0.0) + 0.5
    prev_line_start = text.rfind("\n", 0, max(0, ls - 1)) + 1 if ls else 0
    # nearest first: the cursor line's from its end, then the line above's
    names = list(dict.fromkeys(reversed(terms_of(text[prev_line_start:ls]) + near)))
    if imports is None:
        imports = imports_of(text, language, path)
    qualifiers = qualifiers_of(text[prev_line_start:ls] + line_head)
    return Query(
        weights,
        names[:6],
        imports,
        (max(0, cur_line - window_before), cur_line + window_after + 1),
        cur_line,
        partial,
        {n: q for n, q in qualifiers.items() if n in names[:6]},
    )
