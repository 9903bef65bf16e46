"""Repository retrieval: the chunks of workspace files that the code around the cursor needs.

The workspace (completion/workspace/store.py) feeds this index every file text it admits as context
(disk files under the folders' rules, and the editor's own documents that the same rules allow)
and nothing else; it removes a file's chunks when the file leaves. So the index can hold no
hidden, ignored, secret or outside file: it never reads a file itself.

* Chunks: about 10-20 lines, cut at definition starts (def/class/function/..., decorators first)
  where one comes after at least MIN_DEF_LINES lines, else at a blank line once a chunk has
  MIN_LINES lines, and at MAX_LINES lines in any case. Chunks are keyed by their text's digest,
  so re-indexing a file after an edit re-tokenizes only the chunks whose text changed, and an
  unchanged chunk keeps its id (the context block, keyed by ids, stays the same).
* Terms: identifiers (keywords and one-letter names dropped), scored with BM25 against a query
  made of the identifiers of the lines around the cursor: the prefix tail and the suffix head.
* Definitions: each chunk records the names it defines (def/class/function/..., module-level
  assignments); names at the cursor defined in the workspace are resolved to their definition
  chunk, preferring the module the current file imports them from.
* Selection (`Selector`): near-duplicates and chunks overlapping the current window are dropped;
  the block is sticky per (editor, file), with hysteresis: the last request's block stays, whole
  and in its order, until a fresh pick is worth more than (1 + margin) times it under the current
  query (summed BM25 scores, a definition at the cursor counting as the best chunk), or one of its
  chunks is gone or no longer admitted. A new block puts the chunks it shares with the old one
  first, in their old order, so the common prefix (and its KV cache) survives. Typing a line
  therefore keeps the block; it changes where the cursor goes somewhere the block does not serve.

Memory bound: the index holds at most `max_chunks` chunks (default 200,000); each chunk keeps its
text and a term table, about 6-8 times the text's size in CPython (measured: see the README's
retrieval section), over text the workspace already bounds (its max_bytes). A file past
`max_chunks_per_file` chunks is indexed up to that many.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable, Sequence

MIN_LINES = 10
MAX_LINES = 20
MIN_DEF_LINES = 4
IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
DEF_LINE = re.compile(
    r"^[ \t]*(?:export[ \t]+)?(?:default[ \t]+)?(?:pub(?:\([^)]*\))?[ \t]+)?(?:static[ \t]+)?(?:async[ \t]+)?"
    r"(?:def|class|function|func|fn|struct|enum|trait|interface|impl|type|module|object)[ \t]+(?:\([^)]*\)[ \t]*)?"
    r"([A-Za-z_][A-Za-z0-9_]*)")
DECORATOR = re.compile(r"^[ \t]*@[A-Za-z_]")
DEF_FIRST = frozenset("edpsaicfmtor")   # first letters of the words DEF_LINE can start with
ASSIGN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)[ \t]*(?::[^=\n]*)?=[^=]")   # module level: no indentation
# The module part: leading dots then a name, or dots alone. Never two adjacent patterns that can both take
# a dot: `from` with 20,000 dots and no `import` cost seconds of backtracking (quadratic) before.
FROM_IMPORT = re.compile(r"^[ \t]*from[ \t]+(\.*[A-Za-z0-9_][A-Za-z0-9_.]*|\.+)[ \t]+import[ \t]+\(?([^)#\n]*)", re.M)
IMPORT = re.compile(r"^[ \t]*import[ \t]+([A-Za-z0-9_.]+)(?:[ \t]+as[ \t]+([A-Za-z_][A-Za-z0-9_]*))?", re.M)

# Words every file has: no signal, and the longest postings lists.
STOP = frozenset("""
and as assert async await break class continue def del elif else except finally for from global if import in is
lambda nonlocal not or pass raise return try while with yield None True False self cls function var let const new
this null true false undefined typeof instanceof void delete case switch default do goto struct enum union static
public private protected package interface extends implements throws throw catch super int float double char long
short bool boolean string str dict list tuple set len print range isinstance fn pub mut impl use mod crate func go
chan defer select type map make nil end then local begin elsif unless until module require include
""".split())


def terms_of(text: str) -> list[str]:
    return [t for t in IDENT.findall(text) if len(t) > 1 and t not in STOP]


def _is_def_start(line: str) -> bool:
    return bool(DEF_LINE.match(line) or DECORATOR.match(line))


def _kind(line: str) -> int:
    """0 plain, 1 blank, 2 decorator, 3 definition start. The definition pattern runs only on lines
    whose first word can start one: matching every line was most of a keystroke's index update."""
    body = line.lstrip(" \t")
    first = body[:1]
    if not first or first in "\r\n\f\v":
        return 1 if not body.strip() else 0
    if first == "@":
        return 2 if DECORATOR.match(body) else 0
    return 3 if first in DEF_FIRST and DEF_LINE.match(body) else 0


def split_lines(lines: Sequence[str], min_lines: int | None = None, max_lines: int | None = None,
                min_def_lines: int | None = None, start: int = 0,
                resume: Callable[[int], bool] | None = None) -> list[tuple[int, int]]:
    """[start, end) line ranges covering `lines` from line `start`: cut before a definition start
    (its decorators included) once the chunk has min_def_lines lines, after a blank line once it
    has min_lines, and at max_lines lines in any case.

    A cut depends only on the chunk's start and the two lines around it, so an edited file can be
    split again from the last unchanged cut before the edit; `resume(i)` says that a cut at line i
    is one the old split had in the unchanged rest of the file: the split stops there (the caller
    keeps the old ranges after it) and the last range returned ends at i."""
    min_lines = MIN_LINES if min_lines is None else min_lines
    max_lines = MAX_LINES if max_lines is None else max_lines
    min_def_lines = MIN_DEF_LINES if min_def_lines is None else min_def_lines
    out: list[tuple[int, int]] = []
    n = len(lines)
    kinds: dict[int, int] = {}

    def kind(k: int) -> int:
        v = kinds.get(k)
        if v is None:
            v = kinds[k] = _kind(lines[k])
        return v

    for i in range(start + 1, n):
        size = i - start
        if size >= max_lines:
            cut = True
        elif size >= min_def_lines and kind(i) >= 2 and kind(i - 1) != 2:
            cut = True
        else:
            cut = size >= min_lines and kind(i - 1) == 1 and kind(i) != 1
        if cut:
            out.append((start, i))
            start = i
            if resume is not None and resume(i):
                return out
    if start < n:
        out.append((start, n))
    return out


def defined_names(text: str) -> tuple[str, ...]:
    names = []
    for line in text.splitlines():
        m = DEF_LINE.match(line) or ASSIGN.match(line)
        if m:
            names.append(m.group(1))
    return tuple(dict.fromkeys(names))


def imports_of(text: str) -> dict[str, str]:
    """name -> module path ("pkg/mod", relative dots kept as leading dots) for Python imports."""
    out: dict[str, str] = {}
    for m in FROM_IMPORT.finditer(text):
        module = m.group(1)
        for part in m.group(2).split(","):
            bits = part.split()
            if not bits or not IDENT.fullmatch(bits[0]):
                continue
            name = bits[2] if len(bits) == 3 and bits[1] == "as" else bits[0]
            out[name] = module
            # `from pkg import mod`: the name may be a module itself
            out.setdefault("\0" + name, (module.rstrip(".") + "." + bits[0]) if module.strip(".") else module + bits[0])
    for m in IMPORT.finditer(text):
        module, alias = m.group(1), m.group(2)
        out["\0" + (alias or module.split(".")[0])] = module if alias else module.split(".")[0]
    return out


# Line breaks str.splitlines knows besides "\n": where an edit holds one, lines are split the slow way.
_OTHER_BREAKS = re.compile("[\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")


def _common_prefix(a: str, b: str, hint: int = 0) -> int:
    """Length of the common prefix of a and b, by halving on C string compares (no per-character loop)."""
    lo, hi = 0, min(len(a), len(b))
    if 0 < hint <= hi and a[:hint] == b[:hint]:
        lo = hint
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _common_suffix(a: str, b: str, limit: int) -> int:
    lo, hi = 0, limit
    la, lb = len(a), len(b)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[la - mid:la - lo] == b[lb - mid:lb - lo]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _edit_lines(old_text: str, text: str, old_lines: list[str], old_plain: bool
                ) -> tuple[list[str], int, int, int, bool] | None:
    """(text's lines, first changed line, old lines replaced, new lines in their place, whether text
    breaks lines at "\n" only), made from old_lines (old_text's splitlines(keepends=True)) and the
    changed stretch only; None if the texts are equal. old_plain: old_text breaks lines at "\n"
    only (else every line is compared, the way splitlines counts them). The stretch runs from the
    line holding the first differing character to the end of the line where the common tail starts."""
    cp = _common_prefix(old_text, text)
    if cp == len(old_text) == len(text):
        return None
    cs = _common_suffix(old_text, text, min(len(old_text), len(text)) - cp)
    so, sn = len(old_text) - cs, len(text) - cs
    ls = old_text.rfind("\n", 0, cp) + 1
    nl = old_text.find("\n", so)
    eo = len(old_text) if nl < 0 else nl + 1
    en = sn + (eo - so)
    if not old_plain or _OTHER_BREAKS.search(text, ls, en):
        lines = text.splitlines(keepends=True)
        lo = 0
        m = min(len(lines), len(old_lines))
        while lo < m and lines[lo] == old_lines[lo]:
            lo += 1
        hi = 0
        while hi < m - lo and old_lines[-1 - hi] == lines[-1 - hi]:
            hi += 1
        return lines, lo, len(old_lines) - lo - hi, len(lines) - lo - hi, not _OTHER_BREAKS.search(text)
    lo = old_text.count("\n", 0, ls)
    old_reg = old_text.count("\n", ls, eo) + (1 if eo == len(old_text) and eo > ls and old_text[-1] != "\n" else 0)
    new_reg = text[ls:en].splitlines(keepends=True)
    return old_lines[:lo] + new_reg + old_lines[lo + old_reg:], lo, old_reg, len(new_reg), True


@dataclass(eq=False)
class Chunk:
    id: int
    key: Hashable          # the workspace entry: (owner, path)
    path: str
    language: str
    start: int             # first line (0-based) in its file
    end: int               # line after the last
    text: str
    digest: bytes
    terms: dict[str, int]  # term -> count
    length: int            # number of terms
    defines: tuple[str, ...]


class _Parsed:
    __slots__ = ("terms", "length", "defines")

    def __init__(self, text: str):
        counts = Counter(terms_of(text))
        self.terms = dict(counts)
        self.length = sum(counts.values())
        self.defines = defined_names(text)


def prepare(text: str, max_chunks: int = 400, parse: bool = False) -> list[tuple]:
    """(start line, end line, text, digest, parse or None) of a file's chunks; pure, callable
    outside any lock (parse=True also tokenizes them there: for a file read from disk, whose
    chunks are mostly new; an edited document reuses its unchanged chunks' parses instead)."""
    lines = text.splitlines(keepends=True)
    out = []
    for s, e in split_lines(lines)[:max_chunks]:
        body = "".join(lines[s:e])
        digest = hashlib.blake2b(body.encode("utf-8", "surrogatepass"), digest_size=12).digest()
        out.append((s, e, body, digest, _Parsed(body) if parse else None))
    return out


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
        self.by_head: dict[str, set[str]] = {}     # first 2 characters -> terms (completing a partial name)
        self.total_length = 0
        self.version = 0
        self._next = 1
        self._parsed: OrderedDict[bytes, _Parsed] = OrderedDict()   # digest -> parse, across files and edits
        # key -> (text, its lines) of the files edited last: an edit splits only its own lines again.
        self._lines: OrderedDict[Hashable, tuple[str, list[str], bool]] = OrderedDict()
        self.max_line_caches = 8

    def __len__(self) -> int:
        return len(self.chunks)

    def files(self) -> int:
        return len(self.by_key)

    # -- updates ---------------------------------------------------------
    def update(self, key: Hashable, path: str, language: str, text: str,
               prepared: list[tuple] | None = None) -> None:
        """(Re-)index one file; chunks whose text did not change keep their ids."""
        self._lines.pop(key, None)
        pieces = prepared if prepared is not None else prepare(text, self.max_chunks_per_file)
        old = {}
        for cid in self.by_key.get(key, ()):
            c = self.chunks[cid]
            old.setdefault(c.digest, []).append(c)
        ids: list[int] = []
        for s, e, body, digest, parsed in pieces[: self.max_chunks_per_file]:
            same = old.get(digest)
            if same:
                c = same.pop()
                c.start, c.end = s, e                     # the text moved, it did not change
                ids.append(c.id)
                continue
            if len(self.chunks) >= self.max_chunks:
                break                                     # the bound: the rest of this file is not indexed
            ids.append(self._add(key, path, language, s, e, body, digest, parsed))
        for rest in old.values():
            for c in rest:
                self._remove(c)
        if ids:
            self.by_key[key] = ids
        else:
            self.by_key.pop(key, None)
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
            return False                      # indexed in part (the per-file or total bound)
        edit = _edit_lines(old_text, text, old_lines, plain)
        if edit is None:
            return True
        lines, lo, n_old_reg, n_new_reg, plain = edit
        self._keep_lines(key, text, lines, plain)
        n_old, n_new = len(old_lines), len(lines)
        hi = n_old - lo - n_old_reg           # lines after the edit, the same in both texts
        delta = n_new - n_old
        tail = n_new - hi                     # new lines from here on are the old ones, moved by delta
        keep = 0
        while keep < len(old_chunks) and old_chunks[keep].end < lo:
            keep += 1                         # a cut at `end` depends on lines end-1 and end: both unchanged
        start = old_chunks[keep - 1].end if keep else 0
        old_at = {c.start: k for k, c in enumerate(old_chunks) if k >= keep}

        def resume(i: int) -> bool:
            return i - 1 >= tail and (i - delta) in old_at

        middle = split_lines(lines, start=start, resume=resume)
        end = middle[-1][1] if middle else start
        rest = old_chunks[old_at[end - delta]:] if end < n_new and (end - delta) in old_at else []
        if keep + len(middle) + len(rest) > self.max_chunks_per_file:
            return False
        replaced = old_chunks[keep: len(old_chunks) - len(rest)]
        by_digest: dict[bytes, list[Chunk]] = {}
        for c in replaced:
            by_digest.setdefault(c.digest, []).append(c)
        new_ids = [c.id for c in old_chunks[:keep]]
        for s, e in middle:
            body = "".join(lines[s:e])
            digest = hashlib.blake2b(body.encode("utf-8", "surrogatepass"), digest_size=12).digest()
            same = by_digest.get(digest)
            if same:
                c = same.pop()
                c.start, c.end = s, e
                new_ids.append(c.id)
            elif len(self.chunks) < self.max_chunks:
                new_ids.append(self._add(key, path, language, s, e, body, digest))
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

    def remove(self, key: Hashable) -> None:
        self._lines.pop(key, None)
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

    def _add(self, key, path, language, s, e, body, digest, parsed: _Parsed | None = None) -> int:
        p = parsed if parsed is not None else self._parse(body, digest)
        cid = self._next
        self._next += 1
        c = Chunk(cid, key, path, language, s, e, body, digest, p.terms, p.length, p.defines)
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
        for name in c.defines:
            ids = self.defs.get(name)
            if ids is not None:
                ids.discard(c.id)
                if not ids:
                    del self.defs[name]
        self.total_length -= c.length

    # -- queries ---------------------------------------------------------
    def bm25(self, query: dict[str, float], allowed: Callable[[Chunk], bool], k1: float = 1.2, b: float = 0.75,
             max_df_fraction: float = 0.05, max_df_cap: int = 1000) -> dict[int, float]:
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
            if not ids or len(ids) > max_df:      # too common to tell chunks apart (and the longest lists)
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

    def definitions(self, names: Iterable[str], imports: dict[str, str], allowed: Callable[[Chunk], bool],
                    max_each: int = 3) -> list[int]:
        """Definition chunks of `names` (in that order), the imported module's first, skipping names
        defined in more than max_each places that no import disambiguates."""
        out: list[int] = []
        for name in names:
            ids = [cid for cid in self.defs.get(name, ()) if allowed(self.chunks[cid])]
            if not ids:
                continue
            module = imports.get(name)
            if module is not None:
                suffix = module.lstrip(".").replace(".", "/")
                preferred = [cid for cid in ids if _module_match(self.chunks[cid].path, suffix)]
                if preferred:
                    ids = preferred
            if len(ids) > max_each and module is None:
                continue
            ids.sort(key=lambda cid: (self.chunks[cid].path, self.chunks[cid].start))
            out.append(ids[0])
        return out


def _module_match(path: str, suffix: str) -> bool:
    p = path.replace("\\", "/")
    if p.endswith(".py") or p.endswith(".pyi"):
        p = p.rsplit(".", 1)[0]
    if p.endswith("/__init__"):
        p = p[: -len("/__init__")]
    return not suffix or p == suffix or p.endswith("/" + suffix)


# -- the query around the cursor -------------------------------------------------

@dataclass
class Query:
    terms: dict[str, float]     # term -> weight
    names: list[str]            # names at the cursor, nearest first (definition look-ups)
    imports: dict[str, str]
    window: tuple[int, int]     # [first, last) line of the current window (chunks overlapping it are dropped)
    line: int                   # cursor line
    partial: str = ""           # the identifier being typed, up to the cursor


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


def make_query(text: str, offset: int, before_lines: int = 12, after_lines: int = 4,
               window_before: int = 40, window_after: int = 12) -> Query:
    """Identifiers of the prefix tail (the cursor line up to the cursor and `before_lines` lines
    above it) and the suffix head (`after_lines` lines below), the names at the cursor, the
    file's imports, and the lines the prompt's own window will likely show."""
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
        weights[t] = weights.get(t, 0.0) + 2.0       # the cursor line says most about what comes next
    for t in terms_of(text[offset:hi]):
        weights[t] = weights.get(t, 0.0) + 0.5
    prev_line_start = text.rfind("\n", 0, max(0, ls - 1)) + 1 if ls else 0
    names = list(dict.fromkeys(reversed(near + terms_of(text[prev_line_start:ls]))))
    imports = imports_of(text[: min(len(text), 20000)])
    return Query(weights, names[:6], imports, (max(0, cur_line - window_before), cur_line + window_after + 1),
                 cur_line, partial)


def jaccard(a: Iterable[str], b: Iterable[str]) -> float:
    sa, sb = set(a), set(b)
    if not sa or not sb:
        return 0.0
    return len(sa & sb) / len(sa | sb)


class Selector:
    """Picks and orders the chunks of the context block, sticky per (editor, current file)."""

    def __init__(self, max_chunks: int = 8, dup_threshold: float = 0.7, max_states: int = 64,
                 max_definitions: int = 2, margin: float = 0.5):
        self.max_chunks = max_chunks
        self.dup_threshold = dup_threshold
        self.max_definitions = max_definitions
        self.complete_partial = True
        self.best_last = False       # new chunks enter in reverse rank order: the best one nearest the file
        self.margin = margin         # a held block gives way to a fresh pick worth more than (1 + margin) times it
        self.in_file = True          # the current file's own chunks (outside the window) are candidates
        self._last: OrderedDict[Hashable, list[int]] = OrderedDict()
        self.max_states = max_states

    def select(self, index: RetrievalIndex, state: Hashable, query: Query, allowed: Callable[[Chunk], bool],
               current_key: Hashable | None, cost: Callable[[Chunk], int], budget: int) -> list[Chunk]:
        def admitted(c: Chunk) -> bool:
            if c.key == current_key and (not self.in_file or (c.start < query.window[1] and c.end > query.window[0])):
                return False           # the prompt shows these lines already
            return allowed(c)

        terms = query.terms
        completions = index.completions(query.partial) if self.complete_partial else []
        if completions:
            # The names the identifier being typed may become: their uses and definitions are what
            # the model needs to finish it (they change only when the set of candidates does).
            terms = dict(terms)
            for t in completions:
                terms[t] = terms.get(t, 0.0) + 1.0
        defs = index.definitions(query.names, query.imports, admitted)[: self.max_definitions]
        scores = index.bm25(terms, admitted)
        ranked = sorted(scores, key=lambda cid: (-scores[cid], cid))
        must = set(defs)
        wanted = list(dict.fromkeys(defs + ranked[: self.max_chunks]))
        fresh = self._fill([index.chunks[cid] for cid in wanted], must, cost, budget)
        held = [index.chunks.get(cid) for cid in self._last.get(state, ())]
        kept = [c for c in held if c is not None and admitted(c)]
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
        self._last[state] = [c.id for c in chosen]
        self._last.move_to_end(state)
        while len(self._last) > self.max_states:
            self._last.popitem(last=False)
        return chosen

    def _fill(self, candidates: list[Chunk], must: set[int], cost: Callable[[Chunk], int],
              budget: int) -> list[Chunk]:
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
