"""`completiond eval DIR --oracle`: the truncation and syntax rules alone, judged against the file's own text.

No model runs. At each cursor position of `completiond eval` (the document cut as the user sees it while
typing), the pipeline's text rules (completion/stops.py: the stop rules, post-processing and the syntax
check, exactly as a team server's stream goes through them) are fed what an oracle model would write:

* full: the true middle followed by the true next lines of the file (a model that knows the answer and
  does not stop). Truncation is exact when what is shown equals the true middle.
* mid-token: the true middle cut inside its last word, as a model stopped by its token limit leaves it.
  What is shown must be a prefix of the true middle (nothing wrong added).

The true middle is the rest of the line for a cursor inside a line (`eol`) and the removed middle for
`infix` positions; for a cursor after a line's indentation it is the statement that begins there, whole
(a compound statement with its body), as the language's tree-sitter grammar delimits it: the syntactic
unit the cursor began. Positions whose unit is longer than maxLines lines are left out.

Reported per language: positions, exact rate, and the share of positions where the file parses with
what is shown inserted (among positions where it parses with the true middle: Python by `ast`, other
languages by their grammar, with no ERROR or MISSING node).
"""

from __future__ import annotations

import sys
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from tree_sitter import Parser

from completiond.commands.eval_positions import Position, pick_positions
from completiond.completion.languages import spec_for
from completiond.completion.stops import TextRules, document_site, postprocess
from completiond.completion.syntax import encode, parses

STREAM_CHARS = 3000


@dataclass
class OracleCase:
    position: Position
    language: str
    original: str  # the file as it is
    middle: str  # the true middle at the cursor
    stream: str  # what the oracle model writes (the true middle and the file after it)


def _unit_end(original: str, offset: int, language: str) -> int | None:
    """Where the statement that begins at `offset` ends (a character offset), or None when none begins
    there (the cursor is inside an expression, or the grammar finds none)."""
    spec = spec_for(language)
    if spec is None or spec.language() is None:
        return None
    data = encode(original)
    b = len(encode(original[:offset]))
    node = Parser(spec.language()).parse(data).root_node.descendant_for_byte_range(b, b)
    best = None
    while node is not None:
        if node.start_byte < b:
            break
        if node.type in spec.statements:
            best = node  # the outermost statement starting exactly here
        node = node.parent
    if best is None:
        return None
    return len(data[: best.end_byte].decode("utf-8", "replace"))


def cases(positions: list[Position], max_lines: int) -> list[OracleCase]:
    out = []
    for pos in positions:
        spec = spec_for(pos.path)
        if spec is None:
            continue
        original = pos.text[: pos.offset] + pos.target + pos.text[pos.offset :]
        line_prefix = pos.text[pos.text.rfind("\n", 0, pos.offset) + 1 : pos.offset]
        middle = pos.target
        if pos.kind == "eol" and not line_prefix.strip():
            end = _unit_end(original, pos.offset, spec.name)
            if end is None:
                continue
            middle = original[pos.offset : end]
            if middle.count("\n") >= max_lines:
                continue
            # The document as the user sees it: the unit not written yet, the rest of the file below it.
            pos = Position(pos.path, original[: pos.offset] + original[end:], pos.offset, middle, "unit")
        out.append(OracleCase(pos, spec.name, original, middle, original[pos.offset : pos.offset + STREAM_CHARS]))
    return out


def _rules(pos: Position, multiline: str, max_lines: int) -> TextRules:
    text, offset = pos.text, pos.offset
    ls = text.rfind("\n", 0, offset) + 1
    le = text.find("\n", offset)
    le = len(text) if le < 0 else le
    return TextRules(
        text[ls:offset],
        text[offset:le],
        text[le + 1 : le + 1 + 4000],
        multiline,
        max_lines,
        document_site(text, offset, None, pos.path),
        True,
    )


def _mid_token(middle: str) -> str | None:
    """The middle cut inside its last word of three or more characters; None when it has none."""
    end = len(middle)
    while end > 0:
        j = end
        while j > 0 and (middle[j - 1].isalnum() or middle[j - 1] == "_"):
            j -= 1
        if end - j >= 3:
            return middle[: j + (end - j) // 2]
        end = j - 1
    return None


def run_oracle(root: Any, args: Any, files: list | None = None) -> dict[str, Any]:
    positions = pick_positions(root, args.positions, args.seed, args.per_file, args.ext, files=files)
    stats: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    shown: list[dict[str, Any]] = []
    for case in cases(positions, args.max_lines):
        s = stats[case.language]
        pos = case.position
        head, tail = pos.text[: pos.offset], pos.text[pos.offset :]
        spec = spec_for(case.language)
        truth_parses = parses(head + case.middle + tail, spec)
        s["positions"] += 1
        out = postprocess(case.stream, _rules(pos, args.multiline, args.max_lines))
        exact = out == case.middle
        s["exact"] += exact
        if truth_parses:
            s["parse_checked"] += 1
            s["parses"] += parses(head + out + tail, spec)
        if not exact and len(shown) < args.show:
            shown.append(
                {"path": pos.path, "offset": pos.offset, "kind": pos.kind, "middle": case.middle, "shown": out}
            )
        cut = _mid_token(case.middle)
        if cut is not None:
            out = postprocess(cut, _rules(pos, args.multiline, args.max_lines), truncated=True)
            s["mid_token"] += 1
            s["mid_token_prefix"] += case.middle.startswith(out)
            if truth_parses:
                s["mid_token_parse_checked"] += 1
                s["mid_token_parses"] += parses(head + out + tail, spec)

    def ratio(k: int, n: int) -> float | None:
        return round(k / n, 4) if n else None

    by_language = {
        lang: {
            "positions": s["positions"],
            "exact": ratio(s["exact"], s["positions"]),
            "parse_checked": s["parse_checked"],
            "parses_after_insertion": ratio(s["parses"], s["parse_checked"]),
            "mid_token": s["mid_token"],
            "mid_token_prefix": ratio(s["mid_token_prefix"], s["mid_token"]),
            "mid_token_parses": ratio(s["mid_token_parses"], s["mid_token_parse_checked"]),
        }
        for lang, s in sorted(stats.items())
    }
    return {
        "oracle": True,
        "source": str(root),
        "seed": args.seed,
        "max_lines": args.max_lines,
        "by_language": by_language,
        "not_exact": shown,
    }


def print_oracle(result: dict[str, Any], out=sys.stdout) -> None:
    print(f"oracle (no model), source {result['source']}, maxLines {result['max_lines']}", file=out)
    print(
        f"  {'language':<12}{'positions':>10}{'exact':>8}{'parses':>8}{'mid-token':>11}{'prefix':>8}{'parses':>8}",
        file=out,
    )

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:.1f}"

    for lang, r in result["by_language"].items():
        print(
            f"  {lang:<12}{r['positions']:>10}{pct(r['exact']):>8}{pct(r['parses_after_insertion']):>8}"
            f"{r['mid_token']:>11}{pct(r['mid_token_prefix']):>8}{pct(r['mid_token_parses']):>8}",
            file=out,
        )
    for s in result["not_exact"]:
        print(
            f"--- {s['path']}@{s['offset']} [{s['kind']}]\n  middle: {s['middle']!r}\n  shown:  {s['shown']!r}",
            file=out,
        )
