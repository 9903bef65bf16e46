"""The typing bench's in-process micro-benchmark of didChange (the workspace's text and index update)."""

from __future__ import annotations

from completiond.commands.bench_typing import measure_index_updates, pick_lines


def test_index_update_micro_benchmark_replays_the_bench_keystrokes(tmp_path):
    (tmp_path / "helpers.py").write_text("def helper_one(path):\n    return open(path).read()\n")
    body = "".join(f"def function_{k}(value, other):\n    result = helper_one(value) + other\n    return result\n\n"
                   for k in range(30))
    typed = tmp_path / "main.py"
    typed.write_text(body)
    r = measure_index_updates(typed, tmp_path, keystrokes=60)
    # Every keystroke of the bench's lines is one timed didChange; the index holds both files from disk and
    # the editor's copy of the typed one.
    assert r["changes"] == min(60, sum(len(body.split("\n")[i].strip()) for i in pick_lines(body, 60)))
    assert r["files"] == 3 and r["chunks"] > 2
    assert 0 <= r["p50_ms"] <= r["p95_ms"] <= r["max_ms"]
    assert typed.read_text() == body            # the file on disk is never written
