"""Whether a suggestion keeps the code valid: tree-sitter, for every language of completion/languages.py.

The layers below: syntax_tree.py (a document's tree across edits, the error nodes of a tree), syntax_site.py
(the region around the cursor, parsed with text put in), syntax_python.py (Python's layout rules beside
its grammar, and the eval's whole-file checks). Their public names are re-exported here.

`check(site, suggestion)` parses the region with the suggestion inserted and compares its ERROR and MISSING
nodes (and in Python its layout errors) with the errors the region has whatever the cursor line says: the
region parsed with the cursor line replaced by a stand-in (syntax_site.stand_ins: the line set aside, or
the brackets or header the lines below need from it), the stand-in with the fewest errors. Those errors
are someone else's unfinished edit, elsewhere; every other error after inserting the suggestion is the
suggestion's, the unfinished cursor line's own included: the suggestion must finish the line so that the
lines below read as written. What passes besides: a header without its body at the suggestion's end (the
user goes on to fill it), a bracket the user is still inside (judged with its closer appended, when the
suggestion is balanced within it) unless the model's own text ends the line there (`ends_line`: the line
then ends inside the bracket, and the lines below must close it), a `{` / `(` / `[` the suggestion opens at
the end of one of its lines when it opens a body (judged with its closer appended; a block of its own, such
as Go's `comps: {` label, is no header), and a Python header whose colon is still to come. A suggestion with
errors is cut at the last clean point (line ends, then token boundaries of its first line) or dropped;
the verdict says why.

Cost bound: at most MAX_PARSES parses of the region per verdict (stand-ins included), each incremental
from the region's own tree; the error walk visits only nodes that hold errors.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass

from tree_sitter import Node, Parser, Tree

from completiond.completion.languages import LanguageSpec, spec_of
from completiond.completion.syntax_python import error_at, layout_errors, parses  # noqa: F401  (re-exported)
from completiond.completion.syntax_site import (  # noqa: F401  (re-exported)
    MAX_REGION_BYTES,
    Site,
    _closers,
    edited,
    inserted,
    line_bounds,
    replaced_line,
    site_at,
    stand_ins,
)
from completiond.completion.syntax_tree import (  # noqa: F401  (re-exported)
    MAX_ERRORS,
    MAX_SHIFTED_EDITS,
    DocumentTree,
    Error,
    edited_tree,
    encode,
    errors_in,
)

MAX_PARSES = 10
LAYOUT_REACH = 600  # bytes past the cursor line whose Python layout is judged (the next statements)

_TOKEN = re.compile(r"\w+|\S")
_BALANCED = tuple(c.encode() for c in "()[]{}'\"`")


def _balance(b: bytes) -> tuple[int, ...]:
    """How many of each bracket and quote `b` holds."""
    return tuple(b.count(c) for c in _BALANCED)


_BLOCK_KEYWORD_OPENERS = ("then", "do", "in", "else", "{")  # Bash: a header waiting for fi / done / esac
_KEYWORD_CLOSERS = frozenset({"fi", "done", "esac", "}", "end"})
# Parents of a block that is a statement of its own, heading nothing (Go / JS labels, Rust / C statements).
_BARE_BLOCK_HOLDERS = frozenset({"labeled_statement", "expression_statement", "statement_list"})
_BLOCK_KEYWORDS = re.compile(
    r"\s*(?:async\s+)?(?:def|class|if|elif|else|for|while|with|try|except|finally|match|case)\b"
)


def is_python(language: str | None, path: str | None = None) -> bool:
    """The document is Python: the editor's language id, or the file's extension when none is given."""
    spec = spec_of(language, path)
    return spec is not None and spec.name == "python"


@dataclass(frozen=True)
class Verdict:
    text: str  # what to show
    outcome: str  # parses | cut | dropped | unjudged
    parses: int  # parses made for the verdict
    ms: float
    reason: str = ""  # why it was cut or dropped (the first new error), "" when it passed whole

    def stats(self) -> dict:
        out: dict = {"syntax_check": self.outcome, "syntax_parses": self.parses, "syntax_ms": round(self.ms, 3)}
        if self.reason:
            out["syntax_reason"] = self.reason
        return out


def _open_at_line_ends(spec: LanguageSpec, s: str) -> str | None:
    """The closers for the brackets `s` leaves open when each of them ends a line of `s` (a block or a list
    the user goes on to fill), innermost first; None when one is left open mid-line. Strings and comments
    are not told apart here: the parse with the closers appended judges the result."""
    pairs = dict(spec.brackets)
    closers = {c: o for o, c in spec.brackets}
    stack: list[tuple[str, int]] = []
    for i, c in enumerate(s):
        if c in pairs:
            stack.append((c, i))
        elif c in closers and stack and stack[-1][0] == closers[c]:
            stack.pop()
    if not stack:
        return ""
    for _c, i in stack:
        rest = s[i + 1 :]
        nl = rest.find("\n")
        if (rest if nl < 0 else rest[:nl]).strip():
            return None
    return "".join(pairs[c] for c, _ in reversed(stack))


def _describe(site: Site, data: bytes, e: Error) -> str:
    s, t, missing, kind = e
    row = data.count(b"\n", 0, s) - site.data.count(b"\n", 0, site.cursor) + 1
    where = "on the cursor line" if row == 1 else f"on line {row} of the suggestion" if row > 1 else "above"
    if missing:
        return f"leaves a syntax error {where}: a missing {kind!r}"
    snippet = data[s : min(t, s + 24)].decode("utf-8", "replace").split("\n")[0]
    return f"adds a syntax error {where} at {snippet!r}"


def cuts(s: str, limit: int = MAX_PARSES, blank_line: bool = False) -> list[str]:
    """Up to `limit` shorter versions of the suggestion `s`, longest first: at each line end, then at token
    boundaries of the first line (on a line with nothing before the cursor, only cuts of two tokens or
    more: a lone name left of an unfinished line is no suggestion). Empty and blank cuts are left out."""
    out: list[str] = []
    ends = [m.start() for m in re.finditer("\n", s)]
    for p in reversed(ends):
        c = s[:p].rstrip()
        if len(out) >= limit:
            return out
        if c.strip() and (not out or c != out[-1]):
            out.append(c)
    first = s[: ends[0]] if ends else s
    whole = first.rstrip()
    bounds = [m.end() for m in _TOKEN.finditer(first)]
    least = 2 if blank_line else 1
    for k in range(len(bounds) - 1, least - 2, -1):
        if k < least - 1 or len(out) >= limit:
            break
        c = first[: bounds[k]].rstrip()
        if c.strip() and c != whole and (not out or c != out[-1]):
            out.append(c)
    return out


class _Judge:
    """One verdict's parses: the region with a text inserted at the cursor, and the baseline (the region's
    errors whatever the cursor line says), each counted against MAX_PARSES."""

    shortcuts = True  # skip work that cannot change the verdict (off: the reference, for tests)

    def __init__(self, site: Site):
        self.site = site
        self.count = 0
        self.ls, self.le = line_bounds(site)
        self._probes: dict[tuple[str, str], list[Error]] = {}
        self._trees: dict[tuple[str, str], Tree] = {}
        self._last: tuple[int, int, bytes, Tree] | None = None  # (start, end, text, tree) of the last parse
        self._baseline: list[Error] | None = None
        self._inside: str | None = None  # the closers of the brackets the user is inside (fine)
        self.reasons: list[str] = []

    def _parse(self, start: int, end: int, raw: bytes) -> tuple[Tree, bytes]:
        """(the tree, the text) of the region with its bytes [start, end) replaced by `raw`, parsed
        incrementally from the region's own tree, or (shortcuts) from the verdict's last parse when its text
        is closer: a cut one token shorter than the one before re-reads that token, where the region's
        tree would re-read all that the cut's error disturbs past the cursor line again."""
        site = self.site
        data = site.data[:start] + raw + site.data[end:]
        old, old_data, a, b, new = site.tree, site.data, start, end, raw
        if self.shortcuts and self._last is not None:
            s0, e0, d0, t0 = self._last
            # Both are the region with a span replaced: they differ at most in the union of the spans.
            u0, u1 = min(s0, start), max(e0, end)
            tail = len(site.data) - u1
            was, now = d0[u0 : len(d0) - tail], data[u0 : len(data) - tail]
            k = len(os.path.commonprefix([was, now]))
            j = len(os.path.commonprefix([was[k:][::-1], now[k:][::-1]]))
            # The closer text, unless only the region's tree is told of a change that keeps its brackets and
            # quotes as they were (the text past the line then reads as in the region's tree, not as the last
            # parse's damage left it), or only the last parse is.
            same_site = _balance(raw) == _balance(site.data[start:end])
            same_last = _balance(was[k : len(was) - j]) == _balance(now[k : len(now) - j])
            closer = len(was) + len(now) - 2 * (k + j) < (end - start) + len(raw)
            if same_last if same_site != same_last else closer:
                old, old_data, a, b, new = t0, d0, u0 + k, u0 + len(was) - j, now[k : len(now) - j]
        tree = Parser(site.spec.language()).parse(data, edited_tree(old, old_data, a, b, new))
        self._last = (start, end, data, tree)
        return tree, data

    def _errors(self, tree, data: bytes, hi: int | None = None) -> list[Error]:
        """The parse's errors; in Python also its layout errors from the cursor line to `hi` and a little
        past it (the lines the text put in can disturb)."""
        errors = errors_in(tree)
        if self.site.spec.indented_blocks:
            end = len(data) if hi is None else hi + LAYOUT_REACH
            errors = sorted(errors + layout_errors(tree, data, self.ls, end))
        return errors

    def baseline(self) -> list[Error]:
        """The region's errors with the cursor line replaced by the stand-in that leaves the fewest, in the
        region's own offsets (an error on the stand-in's line is put on the cursor line)."""
        if self._baseline is not None:
            return self._baseline
        site = self.site
        best: list[Error] | None = None
        if site.errors or site.spec.indented_blocks:
            before = self._errors(site.tree, site.data, self.le)
            if not before:
                best = []
            else:
                # The stand-ins the lines below ask for first (one that leaves no error ends the search);
                # on a tie the line set aside wins: a stand-in must do strictly better to be the baseline.
                ranked: list[tuple[int, bool, list[Error]]] = []
                for line in sorted(stand_ins(site), key=lambda x: not x.strip()):
                    if self.count >= MAX_PARSES - 1:
                        break
                    raw = encode(line)
                    self.count += 1
                    tree, data = self._parse(self.ls, self.le, raw)
                    found = [
                        self._back(e, self.ls, self.ls + len(raw), len(raw) - (self.le - self.ls))
                        for e in self._errors(tree, data, self.ls + len(raw))
                    ]
                    ranked.append((len(found), bool(line.strip()), found))
                    if not found:
                        break
                if ranked:
                    best = min(ranked, key=lambda r: (r[0], r[1]))[2]
                if best is None:
                    best = before
        self._baseline = best or []
        return self._baseline

    def _back(self, e: Error, a0: int, a1: int, grow: int) -> Error:
        """An error of a parse where [a0, a1) replaced the original [a0, a1 - grow), in original offsets."""

        def back(p: int) -> int:
            return p if p <= a0 else a0 if p < a1 else p - grow

        return back(e[0]), back(e[1]), e[2], e[3]

    def unexcused(self, insert: str, tail: str = "") -> list[Error]:
        """The errors of the region with `insert` at the cursor (and `tail` after the rest of the cursor line)
        that the baseline does not have."""
        key = (insert, tail)
        if key in self._probes:
            return self._probes[key]
        site = self.site
        suffix = site.data[site.cursor : self.le] if tail else b""
        raw = encode(insert) + suffix + encode(tail)
        a0, a1 = site.cursor, site.cursor + len(raw)
        grow = len(raw) - len(suffix)
        self.count += 1
        tree, data = self._parse(a0, a0 + len(suffix), raw)
        self._trees[key] = tree
        # A header left without its body where the cursor line ends (the suggestion ends with it): the user
        # goes on to fill it.
        line_end = self.le + grow
        # A `{` the text ends with owes its own closer, at the region's end too (the own-closers probe
        # appends it; Go's `comps: {` label block must not pass as the code above's debt).
        opens_body = not tail and site.spec.body_opener == "{" and insert.rstrip().endswith("{")
        baseline: list[Error] | None = None

        def new(errors: list[Error]) -> list[Error]:
            nonlocal baseline
            out: list[Error] = []
            for e in errors:
                s, t, missing, kind = e
                if kind == "body" and a1 - 1 <= s <= line_end:
                    continue
                if missing and s >= len(data) and not opens_body:
                    continue  # a closer owed at the region's very end, by a construct opened above the line
                inside = (a0 < s < a1) if missing or s == t else (a0 <= s < a1 and len(raw) > 0)
                if not inside:
                    if baseline is None:
                        baseline = self.baseline()
                    bs, bt, _, _ = self._back(e, a0, a1, grow)
                    if any(bs <= y and x <= bt for x, y, _, _ in baseline):
                        continue
                out.append(e)
            return out

        if self.shortcuts and self.reasons and site.spec.indented_blocks:
            # Once a reason is kept only pass or fail counts: an unexcused error of the grammar's own fails
            # the probe whatever Python's layout rules add (they cost a walk of the region's statements).
            # Only where the baseline is known by now: the full walk would have made its parses here too.
            out = new(errors_in(tree))
            if out and self._baseline is not None:
                self._probes[key] = out
                return out
        out = new(self._errors(tree, data, self.le + grow))
        if out and not self.reasons:
            self.reasons.append(_describe(site, data, out[0]))
        self._probes[key] = out
        return out

    def fine(self, insert: str, ends_line: bool = False) -> bool:
        """`insert` adds no error, as it is or as the user goes on: with the brackets the user is inside
        closed after the cursor line (when it is balanced within them), with the bodies it opens at its
        lines' ends closed, and (Python) with the colon of the header it writes. ends_line: the model's
        own text ends the cursor line where `insert` ends; the brackets the user is inside then stay open
        past the line's end, so they must be ones the lines below close (no closers are appended)."""
        site = self.site
        suffix = site.line_suffix
        probes = [(insert, "", "")]  # (insert, tail after the cursor line, closers of its own bodies)
        if self._inside is None:
            self._inside = _closers(site, suffix)  # (the same for every text the verdict tries)
        inside = self._inside
        if inside and _closers(site, insert + suffix) == inside and not (ends_line and not suffix.strip()):
            probes.append((insert, inside, ""))
        own = _open_at_line_ends(site.spec, insert) if not suffix.strip() else None
        if own:
            probes.append((insert, own + inside, own))
        last = (site.line_prefix + insert + suffix).rsplit("\n", 1)[-1]
        if site.spec.indented_blocks and _BLOCK_KEYWORDS.match(last) and not last.rstrip().endswith(":"):
            probes += [(p, t + ":", o) for p, t, o in probes]  # a header whose colon is still to come
        for probe, tail, own_closers in probes:
            if self.count >= MAX_PARSES:
                return False
            errors = self.unexcused(probe, tail)
            if not errors and (not own_closers or self._bodies((probe, tail), own_closers)):
                return True
            if (
                site.spec.name == "bash"
                and (probe + tail).rstrip().endswith(_BLOCK_KEYWORD_OPENERS)
                and all(m and k in _KEYWORD_CLOSERS for _, _, m, k in errors)
            ):
                return True
        return False

    def _bodies(self, key: tuple[str, str], closers: str) -> bool:
        """The closers appended after the insert each close a body (a block's `{`), not an expression's
        bracket: a header the user goes on to fill, where an open `[` or `(` is a line cut short."""
        tree = self._trees[key]
        at = self.site.cursor + len(encode(key[0]))
        blocks = self.site.spec.blocks
        for i in range(len(encode(closers))):
            leaf = tree.root_node.descendant_for_byte_range(at + i, at + i + 1)
            body = leaf.parent if leaf is not None else None
            if body is None or body.type not in blocks:
                return False
            # A block of its own (`{` alone, or after a label: Go's `comps: {` for `comps := ...`) heads
            # nothing: a name cut short, not a header.
            holder = body.parent
            if holder is None or holder.type in blocks or holder.type in _BARE_BLOCK_HOLDERS:
                return False
        return True


def check(site: Site, s: str, ends_line: bool = False) -> Verdict:
    """What of suggestion `s` to show at `site` (see the module doc). Never raises for any text.
    ends_line: `s` ends where the model's own text ended the cursor line (it stopped, or went on to a
    newline): no bracket the user is inside is excused at the end of the line then, only in its cuts."""
    t0 = time.perf_counter()
    judge = _Judge(site)

    def done(text: str, outcome: str) -> Verdict:
        reason = judge.reasons[0] if judge.reasons and outcome in ("cut", "dropped") else ""
        return Verdict(text, outcome, judge.count, 1000 * (time.perf_counter() - t0), reason)

    try:
        if not s.strip():
            return done(s, "parses")
        if not site.checkable:
            return done(s, "unjudged")
        if judge.fine(s, ends_line):
            return done(s, "parses")
        if ends_line and judge.fine(s):
            # Fine but for the brackets it leaves open where the model ended the line (`&T{Use: "t"`, then a
            # newline): every cut leaves them open too.
            judge.reasons.insert(0, "ends the line inside a bracket that the lines below do not close")
            return done("", "dropped")
        # A cut keeping a token the parser could not place (an error past the start of the suggestion) cannot
        # be clean: those are not tried.
        first_new = min((e[0] for e in judge.unexcused(s) if not e[2] and e[0] > site.cursor), default=None)
        limit_at = None if first_new is None else first_new - site.cursor
        for c in cuts(s, MAX_PARSES, not site.line_prefix.strip()):
            if judge.count >= MAX_PARSES:
                break
            if limit_at is not None and limit_at < len(encode(c)):
                continue
            if judge.fine(c):
                return done(c, "cut")
        if not judge.reasons:
            judge.reasons.append("adds a syntax error")
        return done("", "dropped")
    except (ValueError, RuntimeError, MemoryError, RecursionError) as exc:  # a parser refusing the text
        return Verdict(s, "unjudged", judge.count, 1000 * (time.perf_counter() - t0), f"not judged: {exc}")


def unit_end(site: Site, s: str) -> int | None:
    """Where in suggestion `s` the statement that begins at the cursor ends (a character offset into s), when
    it ends before s does; None when s holds no more than that statement, or none begins at the cursor.
    Parsed with s inserted (the region, as check does): the statement is the grammar's own, so a compound
    statement ends after its body and a simple one at its end, in every language."""
    raw = encode(s)
    tree = inserted(site, raw)
    a0, a1 = site.cursor, site.cursor + len(raw)
    node: Node | None = tree.root_node.descendant_for_byte_range(a0, a0)
    best = None
    while node is not None and node.start_byte == a0:
        if node.type in site.spec.statements and not node.has_error and node.end_byte <= a1:
            best = node  # the outermost statement that starts here and ends inside the suggestion
        node = node.parent
    if best is None or not raw[best.end_byte - a0 :].strip():
        return None
    return len(raw[: best.end_byte - a0].decode("utf-8", "replace"))
