"""The editing bench: its session's choices, and one short run through the real LSP and daemon."""

from __future__ import annotations

import random

import pytest
from completiond.models.training.data_prep import normalise, read_package_list

from completiond.commands.bench_editing import (
    EVENTS,
    MIN_JUMP_LINES,
    PLUGIN_REST_S,
    code_lines,
    default_files,
    far_line,
)


def test_jumps_go_at_least_the_minimum_distance():
    rng = random.Random(0)
    candidates = list(range(0, 200, 3))
    line = 60
    for _ in range(50):
        nxt = far_line(candidates, line, rng)
        assert abs(nxt - line) >= MIN_JUMP_LINES and nxt in candidates
        line = nxt
    assert far_line([1, 2, 3], 2, rng) in (1, 3)   # a short file: the farthest line there is


def test_cursor_lines_skip_comments_and_blank_lines():
    text = "import os\n\n# a comment here\ndef function(a, b):\n    '''doc string'''\n    return a + b\n"
    assert code_lines(text) == [0, 3, 5]
    assert 2 not in code_lines(text) and 4 not in code_lines(text)


def test_default_files_are_held_out_third_party_code():
    files = default_files(3)
    trained = {normalise(name) for name, _ in read_package_list()}
    assert files and len(set(files)) == len(files)
    for f in files:
        assert 4_000 <= f.stat().st_size <= 40_000
        assert "site-packages" in f.parts or "dist-packages" in f.parts
        package = f.parts[max(i for i, p in enumerate(f.parts) if p.endswith("-packages")) + 1]
        assert normalise(package) not in trained


@pytest.mark.slow
def test_editing_bench_small(tiny_model_dir, tmp_path):
    from completiond.commands.bench_editing import run_editing_bench

    files = []
    for k in range(2):
        src = tmp_path / f"held_out_{k}.py"
        src.write_text("".join(f"def function_{i}_{k}(alpha, beta):\n    return alpha * {i} + beta\n\n" for i in range(40)))
        files.append(src)
    result = run_editing_bench(str(tiny_model_dir), files, rounds=1, jumps=1, keystrokes=3, timeout_s=180,
                               settings={"device": "cpu"})
    assert result["responses"] == result["requests"] and not result["errors"]
    assert set(result["events"]) == set(EVENTS)
    for kind in ("open", "jump", "jump_rest"):
        assert result["events"][kind]["count"] == 2, (kind, result)
    assert result["events"]["switch"]["count"] == 1
    assert result["events"]["keystroke"]["count"] >= 1
    for kind in EVENTS:
        e = result["events"][kind]
        assert 0 < e["p50_ms"] <= e["p95_ms"] <= e["max_ms"]
    assert 0.0 <= result["cache_served_fraction"] <= 1.0
    # Where an open's wait went: tokens prefilled (not from the cache) and the engine's time in them.
    opened = result["events"]["open"]
    assert opened["prefilled_tokens"] > 0 and opened["prefill_ms"] > 0 and opened["prefill_ms_per_token"] > 0
    assert opened["decode_ms"] > 0
    # Asked where its file was left, unchanged: the daemon's last answer there, or else its prompt still cached
    switch = result["events"]["switch"]
    assert switch["repeated_answers"] == 1 or switch["cache_served_fraction"] > 0.5, switch
    assert all(result["events"][kind]["repeated_answers"] == 0 for kind in ("open", "jump"))
    assert result["rest_notes"] is True    # a rested jump is reported as our plugins report it
    assert result["rest_delay_ms"] == round(1000 * PLUGIN_REST_S)
    # The daemon's prefetch noted the opens (and the rests after requests) ...
    assert result["prefetch"]["on"] and result["prefetch"]["notes"] >= 2 and result["prefetch"]["failed"] == 0
    assert result["prefetch"] is not None and result["kv_cache"]["budget_bytes"] > 0
    memory = result["memory"]
    assert memory["cache_ok"] is True and memory["weights_mb"] > 0 and memory["bound_mb"] > memory["weights_mb"]
    assert memory["rss_ok"] is not None and memory["rss_mb"] == result["daemon_rss_mb"]
    # ... and `--prefetch off` runs the same session without it (what it brings: compare the two).
    off = run_editing_bench(str(tiny_model_dir), files[:1], rounds=1, jumps=1, keystrokes=2, timeout_s=180,
                            settings={"device": "cpu"}, prefetch=False, rest_delay_s=0.1)
    assert off["rest_delay_ms"] == 100
    with pytest.raises(ValueError, match="within the rest"):
        run_editing_bench(str(tiny_model_dir), files[:1], rest_delay_s=2.0)
    assert off["prefetch_setting"] == "off" and off["prefetch"]["on"] is False and off["prefetch"]["notes"] == 0 and off["prefetch"] == dict(
        off["prefetch"], warmed_tokens=0)
    assert off["responses"] == off["requests"] and not off["errors"] and off["prefetch"] != result["prefetch"]


def test_editing_settings_from_the_command_line():
    import argparse

    from completiond.commands import bench
    from completiond.errors import CompletionError

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--editing", "--setting", "fimTemplate=qwen2.5-coder", "--setting", "prefixTokens=512",
                              "--retrieval", "off", "--prefetch", "off"])
    assert bench._editing_settings(args) == {"contextRetrieval": "off", "fimTemplate": "qwen2.5-coder",
                                             "prefixTokens": 512}
    assert args.prefetch == "off" and bench._editing_settings(parser.parse_args(["--editing"])) is None
    with pytest.raises(CompletionError, match="KEY=VALUE"):
        bench._editing_settings(parser.parse_args(["--setting", "fimTemplate"]))


def test_a_qwen_shape_prompts_in_the_real_models_layout():
    from completiond.commands.bench_editing import shape_settings

    # random weights carry the bundled tokenizer (suffix-first); a real Qwen2.5-Coder prompts prefix-first
    assert shape_settings("shape:qwen2.5-coder-0.5b") == {"fimTemplate": "qwen2.5-coder"}
    assert shape_settings(None) == shape_settings("bundled") == shape_settings("/models/x") == {}


def test_the_memory_check_fails_past_its_bounds(tmp_path):
    from completiond.commands.bench_editing import MEMORY_SLACK_MB, memory_check, weights_mb

    (tmp_path / "model.safetensors").write_bytes(b"\0" * (3 << 20))
    assert weights_mb(str(tmp_path)) == 3.0 and weights_mb(str(tmp_path / "absent")) is None
    assert weights_mb("") > 0                         # the bundled model
    cache = {"bytes": 10 << 20, "budget_bytes": 64 << 20}
    ok = memory_check(300.0, 3.0, cache)
    assert ok["bound_mb"] == 3.0 + 64 + MEMORY_SLACK_MB and ok["cache_ok"] and ok["rss_ok"]
    assert memory_check(3.0 + 64 + MEMORY_SLACK_MB + 1, 3.0, cache)["rss_ok"] is False
    assert memory_check(300.0, 3.0, {"bytes": 65 << 20, "budget_bytes": 64 << 20})["cache_ok"] is False
    unknown = memory_check(None, None, None)          # what cannot be checked is not a pass
    assert unknown["rss_ok"] is None and unknown["cache_ok"] is None


def test_the_session_can_open_twenty_files():
    import argparse

    from completiond.commands import bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert parser.parse_args(["--editing", "--file-count", "20"]).file_count == 20
    assert parser.parse_args(["--editing"]).rest_notes == "on"
    assert parser.parse_args(["--editing", "--rest-notes", "off"]).rest_notes == "off"
    assert parser.parse_args(["--editing"]).rest_delay_ms is None
    assert parser.parse_args(["--editing", "--rest-delay-ms", "100"]).rest_delay_ms == 100
    assert len(set(default_files(20))) == 20          # issue 45's memory check opens 20 held-out files
