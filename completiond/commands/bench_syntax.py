"""`completiond bench-syntax FILE`: what the syntax layer costs per request on a long file (issue 44's budget).

The file is repeated until it has at least --lines lines (5,000 by default) and opened as an editor's
document: its tree is kept across edits (syntax.DocumentTree). Each request types one character somewhere
in the file (tree-sitter's edit API), then does what a completion request does with syntax: find the
construct around the cursor in the document's tree as the edits shifted it (reparsed incrementally once
every syntax.MAX_SHIFTED_EDITS edits, inside the timing), parse that region (site: brackets, errors) and
check a suggestion there: the rest of the line the cursor is in, as the file has it. Two cases (--case):
`typing` (the default) cuts that rest from the document first, as when code is being written, so the
suggestion fills a line the document lacks; `retyped` leaves it right of the cursor and types one character
again, a harder case than production meets (a suggestion repeating the text right of the cursor is dropped
by the stop rules before the judge). Reported: p50 / p95 / max of that work per request, and of each part;
and the parses a request made (`parses`: the document's, the region's and the verdict's; `region`: how
the region's tree was had, DocumentTree.region; `fresh_kb`: bytes parsed from scratch), counts that do not
move with the machine's load. No model runs; run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from completiond.completion.languages import spec_for
from completiond.completion.syntax import DocumentTree, check, site_at


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=Path, help="a source file of a language with a grammar (repeated to --lines)")
    parser.add_argument("--lines", type=int, default=5000, help="lines of the document (default 5000)")
    parser.add_argument("--requests", type=int, default=300, help="requests timed (default 300)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--case",
        choices=CASES,
        default="typing",
        help="typing: the rest of the line is cut and suggested back (default); "
        "retyped: it stays right of the cursor and a character is typed again",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


CASES = ("typing", "retyped")


def _pct(xs: Sequence[float], q: float) -> float:
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(q * len(ys)))] if ys else 0.0


def measure(text: str, language: str, requests: int, seed: int = 0, case: str = "typing") -> dict[str, Any]:
    if case not in CASES:
        raise ValueError(f"case must be one of {CASES}, got {case!r}")
    spec = spec_for(language)
    if spec is None or spec.language() is None:
        raise ValueError(f"no grammar for {language!r}")
    keeper = DocumentTree(spec, text)
    keeper.tree(text)  # the first parse happens once, when the document is opened
    rng = random.Random(seed)
    starts = [0] + [i + 1 for i, c in enumerate(text) if c == "\n"]
    parts: dict[str, list[float]] = {"reparse": [], "site": [], "check": [], "total": []}
    parses: list[int] = []
    fresh_kb: list[float] = []
    region: dict[str, int] = {"fresh": 0, "incremental": 0, "kept": 0}
    for _ in range(requests):
        line = rng.randrange(len(starts) - 1)
        s, e = starts[line], starts[line + 1] - 1
        body = text[s:e]
        if not body.strip():
            continue
        indent = len(body) - len(body.lstrip())
        col = rng.randrange(indent, len(body))
        offset = s + col
        if case == "typing":  # the rest of the line is not written yet: the suggestion supplies it
            typed, cursor, suggestion = text[:offset] + text[e:], offset, body[col:]
            edit: tuple[int, int, str] = (offset, e, "")
        else:  # the user types the character at the cursor again; the rest of the line stays
            typed, cursor, suggestion = text[:offset] + text[offset] + text[offset:], offset + 1, body[col + 1 :]
            edit = (offset, offset, text[offset])
        doc_parses = keeper.parses
        t0 = time.perf_counter()
        keeper.edit(text, *edit, new_text=typed)
        keeper.shifted(typed) or keeper.tree(typed)  # as the daemon does (a long document's tree)
        t1 = time.perf_counter()
        site = site_at(typed, cursor, spec, keeper)
        t2 = time.perf_counter()
        verdict = check(site, suggestion) if site is not None else None
        t3 = time.perf_counter()
        n = keeper.parses - doc_parses + (verdict.parses if verdict is not None else 0)
        kb = 0.0  # (the document's reparse is incremental)
        if site is not None:
            region[site.parsed] += 1
            n += site.parsed != "kept"
            kb += len(site.data) / 1000 if site.parsed == "fresh" else 0
        parses.append(n)
        fresh_kb.append(kb)
        start, end, inserted = edit
        keeper.edit(typed, start, start + len(inserted), text[start:end], new_text=text)  # back, untimed
        for name, v in (("reparse", t1 - t0), ("site", t2 - t1), ("check", t3 - t2), ("total", t3 - t0)):
            parts[name].append(1000 * v)
    return {
        name: {"p50_ms": round(statistics.median(v), 3), "p95_ms": round(_pct(v, 0.95), 3), "max_ms": round(max(v), 3)}
        for name, v in parts.items()
        if v
    } | {
        "parses": {"mean": round(statistics.mean(parses), 3), "p95": _pct(parses, 0.95), "max": max(parses)},
        "fresh_kb": {"mean": round(statistics.mean(fresh_kb), 3), "p95": round(_pct(fresh_kb, 0.95), 3)},
        "region": region,
        "requests": len(parts["total"]),
        "lines": text.count("\n"),
        "bytes": len(text.encode()),
        "language": spec.name,
        "case": case,
    }


def run(args: argparse.Namespace) -> int:
    try:
        one = args.file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        print(f"completiond bench-syntax: cannot read {args.file}: {exc}", file=sys.stderr)
        return 2
    spec = spec_for(str(args.file))
    if spec is None or not one.strip():
        print(
            f"completiond bench-syntax: {args.file} is not a source file of a language with a grammar", file=sys.stderr
        )
        return 2
    text = one if one.endswith("\n") else one + "\n"
    while text.count("\n") < args.lines:
        text += one if one.endswith("\n") else one + "\n"
    result = measure(text, spec.name, args.requests, args.seed, args.case)
    if args.json:
        print(json.dumps(result, sort_keys=True))
        return 0
    print(
        f"{result['language']}: {result['lines']} lines, {result['bytes']} bytes, {result['requests']} requests"
        f" ({result['case']})"
    )
    for name in ("reparse", "site", "check", "total"):
        r = result[name]
        print(f"  {name:<8} p50 {r['p50_ms']:.2f} ms  p95 {r['p95_ms']:.2f} ms  max {r['max_ms']:.2f} ms")
    p, region = result["parses"], result["region"]
    print(
        f"  parses per request: mean {p['mean']:.2f}, p95 {p['p95']}, max {p['max']}; region trees: "
        f"{region['fresh']} fresh, {region['incremental']} incremental, {region['kept']} kept; "
        f"parsed from scratch {result['fresh_kb']['mean']:.1f} kB a request"
    )
    return 0
