"""Cutting a file into retrieval chunks: about 10-20 lines each, cut at definition starts.

Where the file's language has a grammar (languages.py) and the file is not huge, the definition starts
are tree-sitter's (outline.py): top-level definitions and the members of classes, impls, namespaces,
each with its doc comment, decorators or attributes. Elsewhere the line rules below find them
(DEF_LINE, decorators), as they did for every language before.

A cut depends only on the chunk's start and the kinds of the two lines around it, so an edited file
can be split again from the last unchanged cut before the edit (`split_lines`' resume); with a tree,
that holds where the edit left the definition starts outside it as they were (RetrievalIndex checks).
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from completiond.completion import outline as outlines

MIN_LINES = 10
MAX_LINES = 20
MIN_DEF_LINES = 4
IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
DEF_LINE = re.compile(
    r"^[ \t]*(?:export[ \t]+)?(?:default[ \t]+)?(?:pub(?:\([^)]*\))?[ \t]+)?(?:static[ \t]+)?(?:async[ \t]+)?"
    r"(?:def|class|function|func|fn|struct|enum|trait|interface|impl|type|module|object)[ \t]+(?:\([^)]*\)[ \t]*)?"
    r"([A-Za-z_][A-Za-z0-9_]*)"
)
DECORATOR = re.compile(r"^[ \t]*@[A-Za-z_]")
DEF_FIRST = frozenset("edpsaicfmtor")  # first letters of the words DEF_LINE can start with
ASSIGN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)[ \t]*(?::[^=\n]*)?=[^=]")  # module level: no indentation

# Words every file has: no signal, and the longest postings lists.
STOP = frozenset(
    """
and as assert async await break class continue def del elif else except finally for from global if import in is
lambda nonlocal not or pass raise return try while with yield None True False self cls function var let const new
this null true false undefined typeof instanceof void delete case switch default do goto struct enum union static
public private protected package interface extends implements throws throw catch super int float double char long
short bool boolean string str dict list tuple set len print range isinstance fn pub mut impl use mod crate func go
chan defer select type map make nil end then local begin elsif unless until module require include
""".split()
)


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


def split_lines(
    lines: Sequence[str],
    min_lines: int | None = None,
    max_lines: int | None = None,
    min_def_lines: int | None = None,
    start: int = 0,
    resume: Callable[[int], bool] | None = None,
    kinds: Callable[[int], int] | None = None,
) -> list[tuple[int, int]]:
    """[start, end) line ranges covering `lines` from line `start`: cut before a definition start
    (its decorators included) once the chunk has min_def_lines lines, after a blank line once it
    has min_lines, and at max_lines lines in any case.

    A cut depends only on the chunk's start and the two lines around it, so an edited file can be
    split again from the last unchanged cut before the edit; `resume(i)` says that a cut at line i
    is one the old split had in the unchanged rest of the file: the split stops there (the caller
    keeps the old ranges after it) and the last range returned ends at i. `kinds(i)`: line i's kind
    (see `_kind`) where something else than the line rules knows it (a tree's outline)."""
    min_lines = MIN_LINES if min_lines is None else min_lines
    max_lines = MAX_LINES if max_lines is None else max_lines
    min_def_lines = MIN_DEF_LINES if min_def_lines is None else min_def_lines
    out: list[tuple[int, int]] = []
    n = len(lines)
    known: dict[int, int] = {}

    def kind(k: int) -> int:
        v = known.get(k)
        if v is None:
            v = known[k] = kinds(k) if kinds is not None else _kind(lines[k])
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
        if a[la - mid : la - lo] == b[lb - mid : lb - lo]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _edit_lines(
    old_text: str, text: str, old_lines: list[str], old_plain: bool
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
    return old_lines[:lo] + new_reg + old_lines[lo + old_reg :], lo, old_reg, len(new_reg), True


def _blank(line: str) -> bool:
    body = line.lstrip(" \t")
    first = body[:1]
    return (not first or first in "\r\n\f\v") and not body.strip()


class _Parsed:
    __slots__ = ("defines", "length", "terms")

    def __init__(self, text: str, defines: tuple[str, ...] | None = None):
        counts = Counter(terms_of(text))
        self.terms = dict(counts)
        self.length = sum(counts.values())
        self.defines = defined_names(text) if defines is None else defines


def digest_of(body: str) -> bytes:
    return hashlib.blake2b(body.encode("utf-8", "surrogatepass"), digest_size=12).digest()


@dataclass
class Prepared:
    """A file's chunks, made outside any lock: (start line, end line, text, digest, parse or None, the
    names defined or None for the line rules'), and the outline they were cut by, if any."""

    pieces: list[tuple]
    outline: outlines.Outline | None = None

    def __iter__(self):
        return iter(self.pieces)

    def __len__(self) -> int:
        return len(self.pieces)

    def __getitem__(self, i):
        return self.pieces[i]


def edit_outline(outline: outlines.Outline, lo: int, n_old: int, new_lines: Sequence[str]) -> outlines.Outline:
    """The outline of a file after its lines [lo, lo + n_old) became new_lines: the rest as parsed (moved
    by the lines added or removed), the new lines by the line rules. No parse per keystroke: the file is
    parsed again when it is indexed whole (opened, read from disk)."""
    kinds: dict[int, int] = {}
    names: dict[int, tuple[str, ...]] = {}
    for j, line in enumerate(new_lines):
        kind = _kind(line)
        m = DEF_LINE.match(line) if kind == 3 else ASSIGN.match(line)
        if kind >= 2:
            kinds[lo + j] = kind
        if m:
            names[lo + j] = (m.group(1),)
    return outline.edited(lo, n_old, outlines.Outline(kinds, names, len(new_lines)))


def kinds_of(lines: Sequence[str], outline: outlines.Outline | None) -> Callable[[int], int] | None:
    """The line kinds split_lines cuts by for a file with an outline (None: the line rules)."""
    if outline is None:
        return None
    return lambda k: outline.kind(k) or (1 if _blank(lines[k]) else 0)


def parse_outline(text: str, language: str | None, lines: list[str], plain: bool) -> outlines.Outline | None:
    """The outline of a file whose language has a grammar and that is not too big, else None."""
    spec = outlines.spec_with_grammar(language)
    if spec is None:
        return None
    tree = outlines.parse(text.encode("utf-8", "surrogatepass"), spec)
    return outlines.outline(tree, spec, lines, plain) if tree is not None else None


def prepare(
    text: str,
    max_chunks: int = 400,
    parse: bool = False,
    language: str | None = None,
    lines: list[str] | None = None,
    outline: outlines.Outline | None = None,
) -> Prepared:
    """A file's chunks; pure, callable outside any lock (parse=True also tokenizes them there: for a
    file read from disk, whose chunks are mostly new; an edited document reuses its unchanged chunks'
    parses instead). With a `language` that has a grammar, cut where its definitions start (a given
    outline is used as it is)."""
    lines = text.splitlines(keepends=True) if lines is None else lines
    if outline is None and language is not None:
        outline = parse_outline(text, language, lines, not _OTHER_BREAKS.search(text))
    out = []
    for s, e in split_lines(lines, kinds=kinds_of(lines, outline))[:max_chunks]:
        body = "".join(lines[s:e])
        defines = outline.defined_in(s, e) if outline is not None else None
        out.append((s, e, body, digest_of(body), _Parsed(body, defines) if parse else None, defines))
    return Prepared(out, outline)
