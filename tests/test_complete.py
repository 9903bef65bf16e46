"""The completion glue, `completiond complete FILE:LINE:COL`, and the typing benchmark."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from completiond.completion.completer import Completion, suggest
from completiond.completion.suggest import LocalCompleter
from completiond import config
from completiond.serving import paths
from completiond.commands.complete import TargetError, cursor_offset, parse_target

SOURCE = "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(\n"


def test_parse_target():
    assert parse_target("a/b:c.py:3:7") == (Path("a/b:c.py"), 3, 7)
    for bad in ("file.py", "file.py:x:1", "file.py:0:1"):
        with pytest.raises(TargetError):
            parse_target(bad)


def test_cursor_offset_one_based_and_bounds():
    text = "ab\r\ncdé\n"
    assert cursor_offset(text, 1, 1) == 0
    assert cursor_offset(text, 1, 3) == 2          # end of "ab", before \r\n
    assert cursor_offset(text, 2, 4) == 7          # end of "cdé"
    assert cursor_offset(text, 3, 1) == len(text)  # the empty last line
    with pytest.raises(TargetError):
        cursor_offset(text, 1, 4)
    with pytest.raises(TargetError):
        cursor_offset(text, 4, 1)


# --- the real engine on the tiny model ---------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from completiond.engine.engine import Engine

    return Engine.load(str(tiny_model_dir), device="cpu")


def test_suggest_with_engine(engine, tiny_model_dir):
    from completiond.engine.engine import CancelToken

    cfg, _ = config.merge(config.Config(), {"model": str(tiny_model_dir), "maxTokens": 6})
    rounds = []
    offset = SOURCE.index("print(") + len("print(")
    done = suggest(LocalCompleter(engine, on_round=rounds.append), SOURCE, offset, cfg, cancel=CancelToken())
    suggestion, gen = done.suggestion, done.generation
    assert rounds and done.stats["rounds"] == len(rounds)
    assert gen is not None and gen.stats.to_dict()["prompt_tokens"] > 0
    assert len(gen.tokens) <= 6
    if suggestion is not None:
        assert suggestion.text.strip() and "\ufffd" not in suggestion.text
        assert suggestion.start == suggestion.end == offset


def test_suggest_cancelled_before_start(engine, tiny_model_dir):
    from completiond.engine.engine import CancelToken

    cfg, _ = config.merge(config.Config(), {"model": str(tiny_model_dir), "maxTokens": 50})
    token = CancelToken()
    token.cancel()
    done = suggest(LocalCompleter(engine), SOURCE, 10, cfg, cancel=token)
    suggestion, gen = done.suggestion, done.generation
    assert suggestion is None and gen.finish_reason == "cancelled" and not gen.tokens


def test_alternatives_greedy_are_the_next_best_first_tokens(engine, tiny_model_dir):
    from completiond.completion.suggest import suggest_alternatives
    from completiond.engine.engine import CancelToken

    cfg, _ = config.merge(config.Config(), {"model": str(tiny_model_dir), "maxTokens": 6, "alternatives": 3})
    found, gen = suggest_alternatives(engine, SOURCE, len(SOURCE), cfg, cancel=CancelToken())
    texts = [f.text for f in found]
    assert len(texts) == 3 and len(set(texts)) == 3, texts
    one = suggest(LocalCompleter(engine), SOURCE, len(SOURCE), cfg, cancel=CancelToken()).suggestion
    assert one is not None and texts[0] == one.text  # the first is the plain greedy suggestion
    again, _ = suggest_alternatives(engine, SOURCE, len(SOURCE), cfg, cancel=CancelToken())
    assert [f.text for f in again] == texts  # greedy: the same branches every time
    assert gen is not None and gen.stats.prompt_tokens > 0


def test_alternatives_sampled_each_with_its_own_seed(engine, tiny_model_dir):
    from completiond.completion.suggest import suggest_alternatives
    from completiond.engine.engine import CancelToken

    cfg, _ = config.merge(config.Config(), {"model": str(tiny_model_dir), "maxTokens": 6, "alternatives": 4,
                                            "temperature": 0.8, "seed": 7})
    found, _ = suggest_alternatives(engine, SOURCE, len(SOURCE), cfg, cancel=CancelToken())
    texts = [f.text for f in found]
    assert len(texts) >= 2 and len(set(texts)) == len(texts), texts
    again, _ = suggest_alternatives(engine, SOURCE, len(SOURCE), cfg, cancel=CancelToken())
    assert [f.text for f in again] == texts  # seeded: reproducible


def test_engine_load_reports_its_phases(tiny_model_dir):
    from completiond.engine.engine import Engine
    from completiond.serving.lifecycle import load_engine

    phases: list[str] = []
    Engine.load(str(tiny_model_dir), device="cpu", progress=phases.append)
    assert phases == ["tokenizer", "weights", "device", "engine"]
    cfg, _ = config.merge(config.Config(), {"model": str(tiny_model_dir), "device": "cpu"})
    reports: list[tuple[str, int]] = []
    engine = load_engine(cfg, progress=lambda phase, pct: reports.append((phase, pct)))
    assert [p for p, _ in reports] == ["tokenizer", "weights", "device", "engine", "warm-up", "ready"]
    percentages = [pct for _, pct in reports]
    assert percentages == sorted(percentages) and percentages[-1] == 100
    assert len(engine.cache) == 0  # the warm-up leaves nothing behind in the prefix cache


# --- the commands -----------------------------------------------------------------------------


def cli(*args, env=None, timeout=180):
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "completiond.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


@pytest.mark.slow
def test_complete_command_in_process(tiny_model_dir, tmp_path):
    src = tmp_path / "example.py"
    src.write_text(SOURCE)
    out = cli("complete", f"{src}:5:11", "--model", str(tiny_model_dir), "--device", "cpu", "--max-tokens", "4",
              "--json", env={"XDG_CONFIG_HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["stats"]["prompt_tokens"] > 0 and result["device"] == "cpu"
    assert set(result) >= {"suggestion", "latency_ms", "finish_reason", "model"}
    # The load is not silent: each phase on stderr, ending at 100%.
    for phase in ("loading the tokenizer", "loading the weights", "warming up", "ready (100%"):
        assert phase in out.stderr, out.stderr
    out = cli("complete", f"{src}:99:1", "--model", str(tiny_model_dir))
    assert out.returncode == 2 and "past the end" in out.stderr
    out = cli("complete", f"{tmp_path / 'missing.py'}:1:1")
    assert out.returncode == 2 and "cannot read" in out.stderr


def test_complete_in_process_names_the_file_to_the_suggestion(monkeypatch):
    """The file's path reaches suggest(), as an editor's document URI does: it names the language, so a
    Python file gets the syntax check of its suggestion on the command line too."""
    from completiond.commands import complete
    from completiond.completion import completer as completer_mod
    from completiond.serving import lifecycle

    class FakeCompleter:
        name, device = "fake", "cpu"

    seen = {}

    def fake_suggest(completer, text, offset, cfg, cancel=None, path=None, **kw):
        seen["path"] = path
        return Completion()

    monkeypatch.setattr(lifecycle, "load_completer", lambda cfg, progress=None, warn=None: FakeCompleter())
    monkeypatch.setattr(completer_mod, "suggest", fake_suggest)
    result = complete.complete_in_process(config.Config(), "x = 1\n", 4, "/src/t.py")
    assert seen["path"] == "/src/t.py" and result["finish_reason"] == "skipped"


@pytest.mark.slow
def test_complete_command_via_daemon_then_stop(tiny_model_dir, tmp_path):
    src = tmp_path / "example.py"
    src.write_text(SOURCE)
    env = {"XDG_RUNTIME_DIR": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path)}
    try:
        out = cli("complete", f"{src}:2:5", "--daemon", "--model", str(tiny_model_dir), "--device", "cpu",
                  "--max-tokens", "4", env=env)
        assert out.returncode == 0, out.stderr
        assert "latency" in out.stderr
        out = cli("status", env=env)
        assert out.returncode == 0 and "1 completed" in out.stdout, out.stdout + out.stderr
        out = cli("stop", env=env)
        assert out.returncode == 0, out.stderr
        out = cli("status", env=env)
        assert out.returncode == 1 and "no completiond daemon" in out.stderr
    finally:
        try:
            os.kill(int((tmp_path / "completiond" / paths.PID_NAME).read_text()), signal.SIGKILL)
        except (OSError, ValueError):
            pass


@pytest.mark.slow
def test_typing_bench_small(tiny_model_dir, tmp_path):
    from completiond.commands.bench_typing import run_typing_bench

    src = tmp_path / "held_out.py"
    src.write_text("".join(f"def function_{i}(alpha, beta):\n    return alpha * {i} + beta\n\n" for i in range(20)))
    result = run_typing_bench(str(tiny_model_dir), src, 15, interval_ms=30, device="cpu", max_tokens=4,
                              timeout_s=120)
    assert result["responses"] == result["requests"] == 15
    for key in ("typing_p50_ms", "typing_p95_ms", "cache_served_fraction", "wasted_rounds_per_superseded"):
        assert key in result
    assert result["typing_p50_ms"] is not None and result["typing_p50_ms"] > 0
    assert 0.5 <= result["cache_served_fraction"] <= 1.0
    assert not result["errors"]
