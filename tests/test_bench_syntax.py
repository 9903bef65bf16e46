"""`completiond bench-syntax`: both cases run the syntax layer's real work and leave the document as it was."""

import json
import subprocess
import sys

import pytest

from completiond.commands import bench_syntax
from completiond.completion import syntax
from completiond.completion.languages import spec_for

SOURCE = """import os


def walk(root, pattern=None):
    for name in os.listdir(root):
        if pattern is None or name.endswith(pattern):
            yield os.path.join(root, name)


class Box:
    def __init__(self, items):
        self.items = list(items)

    def total(self):
        return sum(x for x in self.items if x > 0)
"""


@pytest.mark.parametrize("case", bench_syntax.CASES)
def test_each_case_judges_suggestions_and_restores_the_document(case, monkeypatch):
    judged: list[str] = []
    real_check = bench_syntax.check
    kept: list[syntax.DocumentTree] = []
    edits: list[str] = []  # the text each edit leaves

    def spy(site, suggestion):
        judged.append(suggestion)
        return real_check(site, suggestion)

    class Recording(syntax.DocumentTree):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            kept.append(self)

        def edit(self, old_text, start, end, new, new_text=None):
            super().edit(old_text, start, end, new, new_text=new_text)
            edits.append(new_text if new_text is not None else old_text[:start] + new + old_text[end:])

    monkeypatch.setattr(bench_syntax, "check", spy)
    monkeypatch.setattr(bench_syntax, "DocumentTree", Recording)
    text = SOURCE * 20
    result = bench_syntax.measure(text, "python", requests=40, seed=1, case=case)
    assert result["case"] == case and result["requests"] > 0
    assert judged
    lines = set(text.splitlines())
    if case == "typing":  # the suggestion is the whole rest of a real line, cut at the cursor
        assert all(any(line.endswith(s) for line in lines) for s in judged)
    # every request's edit is undone: each second edit leaves the file as it was, and so does the kept tree
    assert len(edits) == 2 * result["requests"] and all(e == text for e in edits[1::2])
    assert all(e != text for e in edits[0::2])
    fresh = syntax.DocumentTree(spec_for("python"), text).tree(text)
    assert str(kept[0].tree(text).root_node) == str(fresh.root_node)
    for part in ("reparse", "site", "check", "total"):
        assert result[part]["p95_ms"] >= result[part]["p50_ms"] >= 0
    # the parses counted: every request parses its region (or finds it kept), the verdict's own on top
    assert sum(result["region"].values()) == result["requests"] and result["region"]["incremental"] > 0
    assert result["parses"]["max"] >= result["parses"]["p95"] >= 1 and result["parses"]["mean"] >= 1
    assert result["fresh_kb"]["mean"] >= 0


def test_an_unknown_case_is_refused():
    with pytest.raises(ValueError, match="case must be one of"):
        bench_syntax.measure(SOURCE, "python", requests=1, case="sideways")


def test_cli_prints_json_with_the_case(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(SOURCE)
    out = subprocess.run(
        [sys.executable, "-m", "completiond.cli", "bench-syntax", str(f), "--lines", "200", "--requests", "20",
         "--case", "retyped", "--json"],
        capture_output=True, text=True, timeout=120, check=True,
    )
    data = json.loads(out.stdout)
    assert data["case"] == "retyped" and data["language"] == "python" and data["lines"] >= 200
