"""Workspace watcher and context block."""

from __future__ import annotations

import os
import time

import pytest

from completiond.completion.languages import language_of
from completiond.completion.workspace import Workspace
from completiond.completion.workspace.gitignore import IgnoreRules


@pytest.fixture()
def ws(tmp_path):
    w = Workspace([tmp_path], scan=False).start()
    yield w
    w.stop()


def test_created_changed_deleted_are_picked_up(ws, tmp_path):
    f = tmp_path / "pkg" / "mod.py"
    f.parent.mkdir()
    f.write_text("x = 1\n")
    assert ws.wait_for(lambda: ws.get(f) == "x = 1\n")
    f.write_text("x = 2\n")
    assert ws.wait_for(lambda: ws.get(f) == "x = 2\n")
    f.unlink()
    assert ws.wait_for(lambda: ws.get(f) is None)
    g = tmp_path / "pkg" / "other.py"
    g.write_text("y = 1\n")
    g.rename(tmp_path / "moved.py")
    assert ws.wait_for(lambda: ws.get(tmp_path / "moved.py") == "y = 1\n" and ws.get(g) is None)


def test_gitignored_binary_and_huge_files_are_skipped(tmp_path):
    (tmp_path / ".gitignore").write_text("secret.py\nbuild/\n*.gen.py\n!keep.gen.py\n")
    w = Workspace([tmp_path], scan=False, max_file_bytes=1000).start()
    try:
        (tmp_path / "build").mkdir()
        (tmp_path / "build" / "out.py").write_text("a = 1\n")
        (tmp_path / "secret.py").write_text("b = 1\n")
        (tmp_path / "x.gen.py").write_text("c = 1\n")
        (tmp_path / "keep.gen.py").write_text("d = 1\n")
        (tmp_path / "bin.py").write_bytes(b"e = 1\x00\x01\x02\n")
        (tmp_path / "huge.py").write_text("f = 1\n" * 1000)
        (tmp_path / "last.py").write_text("g = 1\n")
        assert w.wait_for(lambda: w.get(tmp_path / "last.py") is not None and w.get(tmp_path / "keep.gen.py") is not None)
        time.sleep(0.3)  # events for the skipped files were delivered before last.py's
        names = {os.path.basename(p) for p in w.paths()}
        assert names == {"keep.gen.py", "last.py"}
    finally:
        w.stop()


def test_nested_gitignore(tmp_path):
    (tmp_path / ".gitignore").write_text("*.tmp.py\n")
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / ".gitignore").write_text("local.py\n!ok.tmp.py\n")
    rules = IgnoreRules(str(tmp_path))
    assert rules.ignored(str(sub / "local.py"))
    assert rules.ignored(str(tmp_path / "a.tmp.py"))
    assert not rules.ignored(str(sub / "ok.tmp.py"))
    assert not rules.ignored(str(tmp_path / "local.py"))
    assert rules.ignored(str(tmp_path / ".git" / "config"))


def test_initial_scan(tmp_path):
    (tmp_path / "a.py").write_text("a = 1\n")
    (tmp_path / "node_modules").mkdir()
    (tmp_path / "node_modules" / "n.js").write_text("x\n")
    w = Workspace([tmp_path], scan=True).start()
    try:
        assert w.wait_for(lambda: w.get(tmp_path / "a.py") == "a = 1\n")
        assert all("node_modules" not in p for p in w.paths())
    finally:
        w.stop()


def test_memory_budget_respected(tmp_path):
    w = Workspace([tmp_path], scan=False, max_bytes=10_000)
    for i in range(30):
        w.did_change(tmp_path / f"f{i}.py", f"# {i}\n" + "x" * 995 + "\n")
        assert w.memory_bytes <= 10_000
    kept = {os.path.basename(p) for p in w.paths()}
    assert "f29.py" in kept and "f0.py" not in kept
    assert w.memory_bytes == sum(len(w.get(p).encode()) for p in w.paths())


def test_context_same_language_stable_and_budgeted(tmp_path):
    w = Workspace([tmp_path], scan=False, max_files=3)
    w.did_open(tmp_path / "b.py", "def b():\n    return 2\n")
    w.did_open(tmp_path / "a.py", "def a():\n    return 1\n")
    w.did_open(tmp_path / "c.js", "function c() {}\n")
    w.did_open(tmp_path / "main.py", "import a\n")
    ctx = w.context(tmp_path / "main.py", "python", budget_tokens=100)
    assert [p for p, _ in ctx] == ["a.py", "b.py"]           # same language, path order, not the current file
    # Typing in the current file does not change the block.
    w.did_change(tmp_path / "main.py", "import a\nimport b\n", edit_line=1)
    assert w.context(tmp_path / "main.py", "python", budget_tokens=100) == ctx
    small = w.context(tmp_path / "main.py", "python", budget_tokens=12)
    assert sum((len(f"{p}\n{t}") + 3) // 4 + 2 for p, t in small) <= 12
    assert w.context(tmp_path / "main.py", "python", budget_tokens=0) == []
    assert w.relative_path(tmp_path / "pkg" / "m.py") == "pkg/m.py"


def test_snippet_follows_the_last_edit(tmp_path):
    w = Workspace([tmp_path], scan=False, snippet_lines=10)
    text = "".join(f"line{i} = {i}\n" for i in range(200))
    w.did_change(tmp_path / "big.py", text, edit_line=150)
    (_path, snippet), = w.context(tmp_path / "main.py", "python", budget_tokens=1000)
    assert "line150 = 150" in snippet and "line0 = 0" not in snippet


def test_language_of():
    assert language_of("x/y.py") == "python" and language_of("a.TSX") == "typescriptreact"
    assert language_of("README") is None
