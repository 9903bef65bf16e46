"""`completiond eval DIR`: completion quality at deterministic cursor positions.

For each picked position the document is cut the way it looks while the user
types there, the full request path runs in-process (prompt builder with
token healing -> engine.generate with the stop rules and the healing
constraint -> post-processing), and the suggestion is compared with what the
file really has:

* eol: the rest of the line is removed; target = the rest of the line.
* infix: the middle of a line is removed, the closing brackets/punctuation
  at its end stay right of the cursor (`foo(|)`); target = the removed text.
  This is where suffix duplication (`a, b))`) shows.
* mid-word (`--compare-healing`): eol positions with the cursor inside an
  identifier, run with token healing on and off.

Reported: next-line exact match (first suggested line == target), edit
similarity (1 - Levenshtein / longer length), acceptance alpha (accepted /
drafted over all requests), suffix-duplication rate, whitespace-only rate,
empty rate, latency p50/p90 (prompt build + generation + post-processing),
and whether the insertion is valid code: the share of suggestions at
whitespace-only cursors that start with whitespace the buffer already has,
the share holding a repeated-line cycle, and (Python) the share of files
that still parse with the suggestion inserted, among the positions where the
file parses with its true text.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from completiond.commands.eval_positions import (  # noqa: F401  (re-exported: their old home)
    CLOSING_RUN,
    Position,
    _position_in_line,
    _read,
    pick_positions,
    source_files,
)
from completiond.completion.languages import language_of
from completiond.config import Config


@dataclass
class Outcome:
    position: Position
    suggestion: str
    ms: float
    stats: dict = field(default_factory=dict)
    skipped: str | None = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, nargs="?", help="directory of source files to sample cursor positions from")
    parser.add_argument(
        "--heldout",
        action="store_true",
        help="sample from the bundled model's held-out standard-library files instead of DIR",
    )
    parser.add_argument("--model", default="", help="model directory or hub id (default: the bundled model)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda", "mps"))
    parser.add_argument("--positions", type=int, default=200, help="number of cursor positions (default 200)")
    parser.add_argument("--per-file", type=int, default=4, help="most positions taken from one file")
    parser.add_argument("--seed", type=int, default=0, help="position sampling seed (same seed, same positions)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--multiline", default="auto", choices=("auto", "always", "never"))
    parser.add_argument("--max-lines", type=int, default=8)
    parser.add_argument("--fim-template", default="auto")
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--suffix-tokens", type=int, default=256)
    parser.add_argument("--no-heal", action="store_true", help="turn token healing off")
    parser.add_argument(
        "--no-syntax-check",
        action="store_true",
        help="turn the Python syntax check of suggestions off (the syntaxCheck setting)",
    )
    parser.add_argument(
        "--context",
        nargs="?",
        const="recent",
        default="none",
        type=_context_modes,
        help="context block modes, comma-separated, evaluated side by side on the same positions: "
        "none, recent (snippets of other files of DIR), retrieval (chunks of DIR's files "
        "retrieved for the cursor, the current file's own included); bare --context = recent",
    )
    parser.add_argument(
        "--context-tokens",
        type=int,
        default=None,
        help="context budget in tokens (default: the contextTokens setting's default)",
    )
    parser.add_argument("--no-speculation", action="store_true", help="plain decoding (alpha is then 0)")
    parser.add_argument(
        "--compare-healing", action="store_true", help="mid-word positions only, each run with healing on and off"
    )
    parser.add_argument(
        "--ext",
        action="append",
        default=None,
        help="file extension to include (repeatable; default: every known source language)",
    )
    parser.add_argument(
        "--typing",
        type=int,
        default=0,
        metavar="N",
        help="also type the target of N positions character by character and report the fraction "
        "of prompt tokens served from the prefix KV cache (typing_cache_fraction)",
    )
    parser.add_argument(
        "--oracle",
        action="store_true",
        help="no model: feed the stop rules and the syntax check the true middle followed by the "
        "file's next lines, and the true middle cut mid-token; report per language how often "
        "the cut is exact and the file parses after insertion",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--show", type=int, default=0, help="print the first N suggestions next to their targets")
    from completiond.commands import humaneval  # --benchmark: HumanEval infilling, in its own module

    humaneval.add_arguments(parser)


CONTEXT_MODES = ("none", "recent", "retrieval")


def _context_modes(value: str) -> list[str]:
    modes = [m.strip() for m in value.split(",") if m.strip()]
    bad = [m for m in modes if m not in CONTEXT_MODES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"--context takes {', '.join(CONTEXT_MODES)} (comma-separated), not {value!r}")
    return list(dict.fromkeys(modes))


# -- metrics ---------------------------------------------------------------


def levenshtein(a: str, b: str) -> int:
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def edit_similarity(a: str, b: str) -> float:
    longest = max(len(a), len(b))
    return 1.0 if longest == 0 else 1.0 - levenshtein(a, b) / longest


def first_line(s: str) -> str:
    return s.split("\n", 1)[0]


def is_duplication(pos: Position, suggestion: str) -> bool:
    """The suggestion repeats text that is already right of the cursor or on the next line."""
    if not suggestion:
        return False
    le = pos.text.find("\n", pos.offset)
    le = len(pos.text) if le < 0 else le
    right = pos.text[pos.offset : le].strip()
    head = first_line(suggestion).rstrip()
    if right:
        from completiond.completion.stops import CLOSERS, bracket_scan

        line_start = pos.text.rfind("\n", 0, pos.offset) + 1
        before = pos.text[line_start : pos.offset]
        for k in range(len(right), 0, -1):
            piece = right[:k]
            if head.endswith(piece) and not pos.target.rstrip().endswith(piece):
                if all(c in CLOSERS or c.isspace() for c in piece):
                    # Closing brackets are only repeated if the line now closes more than it opens.
                    over = bracket_scan(before + head + pos.text[pos.offset : le])[1]
                    truth = bracket_scan(before + pos.target + pos.text[pos.offset : le])[1]
                    if len(over) <= len(truth):
                        continue
                return True
    nxt = next((ln.strip() for ln in pos.text[le + 1 : le + 2001].split("\n") if ln.strip()), "")
    if nxt:
        lines = suggestion.split("\n")
        line_start = pos.text.rfind("\n", 0, pos.offset) + 1
        blank_cursor_line = not pos.text[line_start : pos.offset].strip()
        for i, ln in enumerate(lines):
            if (i >= 1 or blank_cursor_line) and ln.strip() == nxt:
                return True
    return False


# -- validity of the insertion (issue 30) ---------------------------------------


def _line_prefix(pos: Position) -> str:
    return pos.text[pos.text.rfind("\n", 0, pos.offset) + 1 : pos.offset]


def whitespace_cursor(pos: Position) -> bool:
    """The cursor sits after indentation on a line with nothing else before it."""
    prefix = _line_prefix(pos)
    return bool(prefix) and not prefix.strip(" \t")


def starts_with_present_whitespace(pos: Position, suggestion: str) -> bool:
    """The suggestion begins with a space or tab where the buffer already ends in whitespace and the
    file's own text does not (an aligned comment's extra spaces are the file's)."""
    ws = (" ", "\t")
    return _line_prefix(pos).endswith(ws) and suggestion.startswith(ws) and not pos.target.startswith(ws)


def repeats_lines(pos: Position, suggestion: str) -> bool:
    """The suggestion holds a cycle of repeated lines (the stop rules' own test, on the finished text)."""
    from completiond.completion.stops import find_line_cycle

    return find_line_cycle(suggestion, final=True, line_prefix=_line_prefix(pos)) is not None


def suffix_collision(pos: Position, suggestion: str) -> bool:
    """The suggestion ends an operand right before one the line already has (`str(name)"-".join(...)`)."""
    from completiond.completion.stops import collides_with_suffix

    le = pos.text.find("\n", pos.offset)
    le = len(pos.text) if le < 0 else le
    return collides_with_suffix(suggestion, _line_prefix(pos), pos.text[pos.offset : le])


def parse_check(pos: Position, suggestion: str) -> bool | None:
    """Whether the file still parses with the suggestion inserted at the cursor (Python by `ast`, other
    languages by their tree-sitter grammar); None where the check does not apply (no grammar, no suggestion,
    or the file does not parse with its true text)."""
    from completiond.completion.languages import spec_for
    from completiond.completion.syntax import parses

    spec = spec_for(pos.path)
    if spec is None or not suggestion:
        return None
    head, tail = pos.text[: pos.offset], pos.text[pos.offset :]
    if not parses(head + pos.target + tail, spec):
        return None
    return parses(head + suggestion + tail, spec)


def by_language(done: list[Outcome]) -> dict[str, dict[str, Any]]:
    """Per language: positions, exact match, empty rate, and how often a shown suggestion breaks a file that
    parsed (the other-languages target of issue 44)."""
    from completiond.completion.languages import spec_for

    groups: dict[str, list[Outcome]] = {}
    for o in done:
        spec = spec_for(o.position.path)
        groups.setdefault(spec.name if spec is not None else "other", []).append(o)
    out = {}
    for lang, os_ in sorted(groups.items()):
        checks = [c for c in (parse_check(o.position, o.suggestion) for o in os_) if c is not None]
        n = len(os_)
        out[lang] = {
            "positions": n,
            "next_line_exact_match": sum(first_line(o.suggestion).rstrip() == o.position.target.rstrip() for o in os_)
            / n,
            "empty_rate": sum(not o.suggestion for o in os_) / n,
            "shown_parse_checked": len(checks),
            "shown_breaking_a_parsing_file": (len(checks) - sum(checks)) / len(checks) if checks else 0.0,
            "withheld": sum(o.stats.get("syntax_check") == "dropped" for o in os_),
        }
    return out


def validity(done: list[Outcome]) -> dict[str, Any]:
    """Issue 30's figures: whitespace re-inserted, repeated-line cycles, suffix duplicates, parse rate."""
    shown = [o for o in done if o.suggestion]
    ws = [o for o in shown if whitespace_cursor(o.position)]
    trailing = [o for o in shown if _line_prefix(o.position).endswith((" ", "\t"))]
    checks = [c for c in (parse_check(o.position, o.suggestion) for o in shown) if c is not None]
    ratio = lambda k, n: k / n if n else 0.0  # noqa: E731
    ws_dup = sum(starts_with_present_whitespace(o.position, o.suggestion) for o in ws)
    trailing_dup = sum(starts_with_present_whitespace(o.position, o.suggestion) for o in trailing)
    cycles = sum(repeats_lines(o.position, o.suggestion) for o in shown)
    collisions = sum(suffix_collision(o.position, o.suggestion) for o in shown)
    syntax_ms = sorted(o.stats["syntax_ms"] for o in done if "syntax_ms" in o.stats)
    outcomes = [o.stats["syntax_check"] for o in done if "syntax_check" in o.stats]
    return {
        "syntax_checked": len(syntax_ms),
        "syntax_outcomes": {k: outcomes.count(k) for k in sorted(set(outcomes))},
        "syntax_check_p50_ms": statistics.median(syntax_ms) if syntax_ms else 0.0,
        "syntax_check_p95_ms": syntax_ms[min(len(syntax_ms) - 1, int(0.95 * len(syntax_ms)))] if syntax_ms else 0.0,
        "whitespace_cursor_suggestions": len(ws),
        "whitespace_dup_rate": ratio(ws_dup, len(ws)),
        "trailing_space_suggestions": len(trailing),
        "trailing_space_dup_rate": ratio(trailing_dup, len(trailing)),
        "repeated_line_rate": ratio(cycles, len(shown)),
        "suffix_collision_rate": ratio(collisions, len(shown)),
        "parse_checked": len(checks),
        "parses_after_insertion": ratio(sum(checks), len(checks)),
    }


def holds_line(pos: Position, block: str) -> bool:
    """Whether the context block shows the cursor's whole line as the file has it: the most a block can
    hand the model to copy (how far retrieval could go, beside what the model made of it)."""
    line = (_line_prefix(pos) + pos.target).strip()
    return bool(line) and any(b.strip() == line for b in block.splitlines())


def summarize(outcomes: list[Outcome]) -> dict[str, Any]:
    done = [o for o in outcomes if o.skipped is None]
    n = len(done)
    exact = sum(first_line(o.suggestion).rstrip() == o.position.target.rstrip() for o in done)
    sim = sum(edit_similarity(first_line(o.suggestion).rstrip(), o.position.target.rstrip()) for o in done)
    # A duplicate re-types text right of the cursor, or puts a second operand in front of it.
    dup = sum(is_duplication(o.position, o.suggestion) or suffix_collision(o.position, o.suggestion) for o in done)
    ws_only = sum(bool(o.suggestion) and not o.suggestion.strip() for o in done)
    empty = sum(not o.suggestion for o in done)
    drafted = sum(o.stats.get("drafted", 0) for o in done)
    accepted = sum(o.stats.get("accepted", 0) for o in done)
    ms = sorted(o.ms for o in done)
    prompt_tokens = sum(o.stats.get("prompt_tokens", 0) for o in done)
    return {
        "positions": n,
        "skipped": len(outcomes) - n,
        "next_line_exact_match": exact / n if n else 0.0,
        "edit_similarity": sim / n if n else 0.0,
        "suffix_duplication_rate": dup / n if n else 0.0,
        "whitespace_only_rate": ws_only / n if n else 0.0,
        "empty_rate": empty / n if n else 0.0,
        "alpha": accepted / drafted if drafted else 0.0,
        "p50_ms": statistics.median(ms) if ms else 0.0,
        "p90_ms": ms[min(len(ms) - 1, int(0.9 * len(ms)))] if ms else 0.0,
        "mean_prompt_tokens": prompt_tokens / n if n else 0.0,
        "mean_context_tokens": sum(o.stats.get("context_tokens", 0) for o in done) / n if n else 0.0,
        "context_holds_line_rate": sum(bool(o.stats.get("context_holds_line")) for o in done) / n if n else 0.0,
        "by_kind": {k: sum(o.position.kind == k for o in done) for k in sorted({o.position.kind for o in done})},
        **validity(done),
        "by_language": by_language(done),
    }


# -- running ---------------------------------------------------------------


def complete(
    engine: Any,
    builder: Any,
    pos: Position,
    params: Any,
    heal: bool | None = None,
    workspace: "EvalWorkspace | None" = None,
    mode: str = "recent",
    syntax_check: bool = True,
) -> Outcome:
    """One request through the daemon's path, timed end to end (the context block's choice included)."""
    language = language_of(pos.path)
    context: list[tuple[str, str]] = []
    path = workspace.root / pos.path if workspace is not None else None
    if workspace is not None and mode == "retrieval":
        # As in the editor: the file being edited is open, so its own chunks come from the text as typed
        # (the line being completed is not in it), never from the disk copy.
        workspace.store.did_open(path, pos.text, language)
    t0 = time.perf_counter()
    if workspace is not None and mode != "none":
        count = lambda s: len(builder.template.encode(s))  # noqa: E731
        prefix_budget, suffix_budget, _ = builder.budgets(True)
        context = workspace.store.context(
            path,
            language,
            builder.context_tokens,
            count,
            text=pos.text,
            offset=pos.offset,
            mode=mode,
            window_tokens=(prefix_budget, suffix_budget),
        )
    prompt = builder.build(pos.text, pos.offset, context=context, path=pos.path, language=language, heal=heal)
    if prompt.skip_reason is not None:
        outcome = Outcome(pos, "", 0.0, skipped=prompt.skip_reason)
    else:
        prompt.stop.attach_document(pos.text, pos.offset, language, pos.path, syntax_check)  # as suggest() does
        gen = engine.generate(prompt.ids, params, stop=prompt.stop, constraint=prompt.constraint)
        suggestion = prompt.suggestion(gen.tokens, gen.finish_reason)
        ms = 1000 * (time.perf_counter() - t0)
        stats = dict(
            gen.stats.to_dict(),
            context_tokens=len(prompt.context_ids),
            context_holds_line=holds_line(pos, engine.tokenizer.decode(prompt.context_ids))
            if prompt.context_ids
            else False,
        )
        if prompt.stop.syntax is not None:
            stats.update(prompt.stop.syntax.stats())
        outcome = Outcome(pos, suggestion, ms, stats)
    if workspace is not None and mode == "retrieval":
        workspace.store.forget(path)
    return outcome


def evaluate(
    engine: Any,
    positions: list[Position],
    cfg: Config,
    heal: bool | None,
    speculative: bool,
    show: int = 0,
    out=sys.stderr,
    workspace: Any = None,
    mode: str = "recent",
) -> list[Outcome]:
    from completiond.engine.engine import SamplingParams
    from completiond.completion.prompt import PromptBuilder

    builder = PromptBuilder.for_engine(engine, cfg)
    params = SamplingParams(max_tokens=cfg.max_tokens, temperature=0.0, speculative=speculative)
    if positions:
        complete(
            engine, builder, positions[0], params, heal, workspace, mode, cfg.syntax_check
        )  # warm-up: first-call costs are not latency
    outcomes = []
    for i, pos in enumerate(positions):
        o = complete(engine, builder, pos, params, heal, workspace, mode, cfg.syntax_check)
        outcomes.append(o)
        if i < show:
            print(
                f"--- {pos.path}@{pos.offset} [{pos.kind}]\n  target:     {pos.target!r}\n"
                f"  suggestion: {o.suggestion!r}",
                file=out,
            )
    return outcomes


def typing_cache_fraction(engine: Any, positions: list[Position], cfg: Config, max_chars: int = 8) -> dict[str, Any]:
    """Type each target one character at a time; fraction of prompt tokens the cache served.

    The first request at a position is excluded (it pays for the whole
    prompt); every later keystroke should be served almost entirely from
    the cache with a suffix-first template.
    """
    from completiond.engine.engine import SamplingParams
    from completiond.completion.prompt import PromptBuilder

    builder = PromptBuilder.for_engine(engine, cfg)
    params = SamplingParams(max_tokens=min(8, cfg.max_tokens), temperature=0.0)
    reused = total = steps = 0
    for pos in positions:
        for j in range(0, min(max_chars, len(pos.target)) + 1):
            typed = pos.target[:j]
            text = pos.text[: pos.offset] + typed + pos.text[pos.offset :]
            prompt = builder.build(text, pos.offset + j, path=pos.path, language=language_of(pos.path))
            if prompt.skip_reason is not None:
                break
            gen = engine.generate(prompt.ids, params, stop=prompt.stop, constraint=prompt.constraint)
            if j:
                st = gen.stats.to_dict()
                reused += st.get("reused_tokens", 0)
                total += st.get("prompt_tokens", 0)
                steps += 1
    return {
        "typing_cache_fraction": reused / total if total else 0.0,
        "typing_keystrokes": steps,
        "template": builder.template.name,
        "spm": builder.template.spm,
    }


@dataclass
class EvalWorkspace:
    store: Any  # completiond.completion.workspace.Workspace
    root: Path


def _workspace(root: Path) -> EvalWorkspace:
    """A scanned, unwatched Workspace over DIR: the other files become context candidates."""
    from completiond.completion.workspace import Workspace

    ws = Workspace([root], scan=False)
    ws.scan()
    return EvalWorkspace(ws, root.resolve())


def _config(args: argparse.Namespace):
    from completiond import config

    settings = {
        "maxTokens": args.max_tokens,
        "multiline": args.multiline,
        "maxLines": args.max_lines,
        "fimTemplate": args.fim_template,
        "prefixTokens": args.prefix_tokens,
        "suffixTokens": args.suffix_tokens,
        "syntaxCheck": not getattr(args, "no_syntax_check", False),
        "workspaceContext": any(m != "none" for m in _modes(args)),
    }
    if args.context_tokens is not None:
        settings["contextTokens"] = args.context_tokens
    cfg, errors = config.merge(config.defaults(), settings)
    if errors:
        raise SystemExit("completiond eval: " + "; ".join(errors))
    return cfg


def _modes(args: argparse.Namespace) -> list[str]:
    modes = args.context
    if isinstance(modes, str):
        modes = _context_modes(modes)
    return list(modes) if modes else ["none"]


def run(args: argparse.Namespace) -> int:
    if getattr(args, "benchmark", None):
        from completiond.commands import humaneval

        return humaneval.run(args)
    from completiond.engine.engine import Engine, EngineError

    files = None
    if args.heldout:
        from completiond.models import corpus

        args.dir = corpus.stdlib_root()
        files = [f.path for f in corpus.heldout_files()]
    elif args.dir is None:
        print("completiond eval: give a DIR or --heldout", file=sys.stderr)
        return 2
    if not args.dir.is_dir():
        print(f"completiond eval: {args.dir} is not a directory", file=sys.stderr)
        return 2
    if args.oracle:
        from completiond.commands.eval_oracle import print_oracle, run_oracle

        oracle = run_oracle(args.dir, args, files)
        if args.json:
            print(json.dumps(oracle, sort_keys=True))
        else:
            print_oracle(oracle)
        return 0 if oracle["by_language"] else 1
    cfg = _config(args)
    positions = pick_positions(
        args.dir, args.positions, args.seed, args.per_file, args.ext, midword_only=args.compare_healing, files=files
    )
    if not positions:
        print(f"completiond eval: no usable source files under {args.dir}", file=sys.stderr)
        return 1
    try:
        engine = Engine.load(model=args.model or None, device=args.device)
    except EngineError as exc:
        print(f"completiond eval: {exc}", file=sys.stderr)
        return 1
    speculative = not args.no_speculation
    modes = _modes(args)
    workspace = _workspace(args.dir) if any(m != "none" for m in modes) else None
    result: dict[str, Any]
    if args.compare_healing:
        mode = modes[0]
        ws = workspace if mode != "none" else None
        on = summarize(evaluate(engine, positions, cfg, True, speculative, args.show, workspace=ws, mode=mode))
        off = summarize(evaluate(engine, positions, cfg, False, speculative, args.show, workspace=ws, mode=mode))
        result = dict(on)
        result["healing"] = {"on": on, "off": off}
    else:
        # Every mode on the same positions, one after the other, in one run.
        by_mode = {
            m: summarize(
                evaluate(
                    engine,
                    positions,
                    cfg,
                    not args.no_heal,
                    speculative,
                    args.show,
                    workspace=workspace if m != "none" else None,
                    mode=m,
                )
            )
            for m in modes
        }
        result = dict(by_mode[modes[0]])
        if len(modes) > 1:
            result["context"] = by_mode
    if workspace is not None:
        result["index"] = {"files": workspace.store.index.files(), "chunks": len(workspace.store.index)}
        workspace.store.stop()
    if args.typing > 0:
        result.update(typing_cache_fraction(engine, positions[: args.typing], cfg))
    result.update(
        model=engine.name,
        model_id=engine.model_id,
        device=engine.device,
        seed=args.seed,
        max_tokens=cfg.max_tokens,
        multiline=cfg.multiline,
        healing_enabled=args.compare_healing or not args.no_heal,
        context_tokens=cfg.context_tokens if cfg.workspace_context else 0,
        context_modes=modes,
        source="heldout" if args.heldout else str(args.dir),
    )
    if args.json:
        print(json.dumps(result, sort_keys=True))
    elif "context" in result:
        _print_modes(result)
    else:
        _print_table(result)
    return 0


def _print_modes(r: dict[str, Any]) -> None:
    """The context modes side by side."""
    modes = r["context_modes"]
    rows = [
        ("positions", "positions", "{:d}"),
        ("next-line exact match", "next_line_exact_match", "{:.3f}"),
        ("edit similarity", "edit_similarity", "{:.3f}"),
        ("latency p50 ms", "p50_ms", "{:.1f}"),
        ("latency p90 ms", "p90_ms", "{:.1f}"),
        ("context tokens (mean)", "mean_context_tokens", "{:.0f}"),
        ("block holds the line", "context_holds_line_rate", "{:.3f}"),
        ("prompt tokens (mean)", "mean_prompt_tokens", "{:.0f}"),
        ("empty", "empty_rate", "{:.3f}"),
    ]
    width = max(len(label) for label, _, _ in rows)
    print(f"model {r['model']} on {r['device']}, contextTokens {r['context_tokens']}, source {r['source']}")
    print(f"  {'':<{width}}  " + "  ".join(f"{m:>10}" for m in modes))
    for label, key, fmt in rows:
        print(f"  {label:<{width}}  " + "  ".join(f"{fmt.format(r['context'][m].get(key, 0)):>10}" for m in modes))


def _print_table(r: dict[str, Any]) -> None:
    rows = [
        ("positions", f"{r['positions']} ({r['skipped']} skipped) {r['by_kind']}"),
        ("next-line exact match", f"{r['next_line_exact_match']:.3f}"),
        ("edit similarity", f"{r['edit_similarity']:.3f}"),
        ("suffix duplication", f"{r['suffix_duplication_rate']:.3%}"),
        ("whitespace-only", f"{r['whitespace_only_rate']:.3%}"),
        (
            "indentation re-inserted",
            f"{r['whitespace_dup_rate']:.3%} of {r['whitespace_cursor_suggestions']} at whitespace-only cursors",
        ),
        ("repeated-line cycles", f"{r['repeated_line_rate']:.3%}"),
        ("parses after insertion", f"{r['parses_after_insertion']:.3%} of {r['parse_checked']} checked"),
        (
            "syntax check",
            f"{r['syntax_checked']} checked {r['syntax_outcomes']}, p50 / p95 "
            f"{r['syntax_check_p50_ms']:.2f} / {r['syntax_check_p95_ms']:.2f} ms",
        ),
        ("empty", f"{r['empty_rate']:.3%}"),
        ("acceptance alpha", f"{r['alpha']:.3f}"),
        ("latency p50 / p90", f"{r['p50_ms']:.1f} / {r['p90_ms']:.1f} ms"),
    ]
    if "typing_cache_fraction" in r:
        rows.append(
            (
                "cache-served while typing",
                f"{r['typing_cache_fraction']:.3f} over {r['typing_keystrokes']} keystrokes "
                f"({r['template']}, {'SPM' if r['spm'] else 'PSM'})",
            )
        )
    if isinstance(r.get("healing"), dict):
        on, off = r["healing"]["on"], r["healing"]["off"]
        rows.append(
            (
                "mid-word exact, healing on/off",
                f"{on['next_line_exact_match']:.3f} / {off['next_line_exact_match']:.3f}",
            )
        )
        rows.append(("mid-word edit sim, on/off", f"{on['edit_similarity']:.3f} / {off['edit_similarity']:.3f}"))
    width = max(len(k) for k, _ in rows)
    print(f"model {r['model']} on {r['device']}, max_tokens {r['max_tokens']}, multiline {r['multiline']}")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
