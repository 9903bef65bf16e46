"""`completiond eval`: deterministic positions, metrics, and the full request path."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from completiond import cli
from completiond.commands.eval import (Position, complete, edit_similarity, holds_line, is_duplication, levenshtein,
                                  pick_positions, summarize, Outcome)
from completiond.completion.prompt import PromptBuilder
from tests.conftest import build_tokenizer

SOURCE = '''import os


class Point:
    def __init__(self, x, y):
        self.x = x
        self.y = y

    def norm(self):
        return (self.x ** 2 + self.y ** 2) ** 0.5

    def moved(self, dx, dy):
        return Point(self.x + dx, self.y + dy)


def add(a, b):
    return a + b


for i in range(10):
    print(i, add(i, i))
'''


@pytest.fixture()
def src_dir(tmp_path):
    d = tmp_path / "src"
    (d / "pkg").mkdir(parents=True)
    (d / "a.py").write_text(SOURCE)
    (d / "pkg" / "b.py").write_text("# vectors\n" + SOURCE.replace("Point", "Vec"))
    (d / "notes.bin").write_bytes(b"\x00\x01")
    return d


def test_positions_are_deterministic(src_dir):
    a = pick_positions(src_dir, 6, seed=3)
    b = pick_positions(src_dir, 6, seed=3)
    assert [(p.path, p.offset, p.kind) for p in a] == [(p.path, p.offset, p.kind) for p in b]
    assert len(a) == 6
    assert pick_positions(src_dir, 6, seed=4) != a
    for p in a:
        assert p.target.strip()
        assert p.text[:p.offset] == (src_dir / p.path).read_text()[:p.offset]


def test_midword_positions_sit_inside_identifiers(src_dir):
    for p in pick_positions(src_dir, 8, midword_only=True):
        assert p.text[p.offset - 1].isalnum() or p.text[p.offset - 1] == "_"
        assert p.target[0].isalnum() or p.target[0] == "_"


def test_metric_helpers():
    assert levenshtein("kitten", "sitting") == 3
    assert edit_similarity("", "") == 1.0 and edit_similarity("abc", "abd") == pytest.approx(2 / 3)
    pos = Position("a.py", "foo()\nbar()\n", 4, "x", "infix")
    assert is_duplication(pos, "x)")
    assert not is_duplication(pos, "x")
    assert not is_duplication(pos, "f(x)")          # its own bracket pair: the ")" right of the cursor is still needed
    line = Position("a.py", "def f():\n    \n    return 1\n", 13, "", "eol")
    assert is_duplication(line, "y = 2\n    return 1")


def test_a_block_holds_the_line_only_when_it_shows_the_whole_line():
    pos = Position("a.py", "def f(x):\n    return g(\n", 23, "x, 2)", "eol")   # the file has "    return g(x, 2)"
    assert holds_line(pos, "import os\n  return g(x, 2)  \n")        # indentation and trailing space aside
    assert not holds_line(pos, "return g(x, 3)\nreturn g(\n")         # another call, or only the typed part
    assert not holds_line(pos, "")
    blank = Position("a.py", "x = 1\n\n", 6, "", "eol")
    assert not holds_line(blank, "\n\n")                               # an empty line is not an answer


def test_validity_metrics():
    """Issue 30's figures: indentation typed twice, line cycles, operands in front of the suffix, parsing."""
    from completiond.commands.eval import (parse_check, repeats_lines, starts_with_present_whitespace, suffix_collision,
                                           validity, whitespace_cursor)

    text = "def f(t):\n    if t:\n        u = t\n        \n    return t\n"
    indent = Position("a.py", text, text.index("        \n    return") + 8, "t //= 60", "eol")
    assert whitespace_cursor(indent)
    assert starts_with_present_whitespace(indent, " t //= 60")
    assert not starts_with_present_whitespace(indent, "t //= 60")
    assert parse_check(indent, "t //= 60") is True
    assert parse_check(indent, " t //= 60") is False      # 9 spaces where the block has 8: IndentationError
    assert parse_check(indent, "") is None
    assert parse_check(Position("a.js", text, indent.offset, "x", "eol"), "x") is None
    broken = Position("a.py", "def f(:\n    ", 12, "pass", "eol")
    assert parse_check(broken, "pass") is None             # the file does not parse with its true line either

    assert repeats_lines(indent, "if t % 2:\n            return 0\n        if t % 2:\n            return 0")
    assert repeats_lines(indent, "# a comment here\n        # a comment here\n        # a comment here")
    assert not repeats_lines(indent, "t //= 60\n        u = t")

    line = "    return \"-\".join(name.split()).lower()\n"
    ret = Position("u.py", line, 11, "", "infix")
    assert suffix_collision(ret, "str(name)") and not suffix_collision(ret, "")
    assert is_duplication(ret, "str(name)") is False      # the old test: nothing re-typed ...
    r = summarize([Outcome(ret, "str(name)", 1.0), Outcome(indent, " t //= 60", 1.0), Outcome(indent, "t", 1.0)])
    assert r["suffix_duplication_rate"] == pytest.approx(1 / 3)   # ... but counted as a duplicate now
    assert r["whitespace_cursor_suggestions"] == 2 and r["whitespace_dup_rate"] == 0.5
    assert r["parse_checked"] == 2 and r["parses_after_insertion"] == 0.5
    assert validity([])["parses_after_insertion"] == 0.0


# -- the request path with an oracle model --------------------------------------

@dataclass
class _Stats:
    data: dict = field(default_factory=dict)

    def to_dict(self):
        return self.data


@dataclass
class _Gen:
    tokens: list
    finish_reason: str
    stats: _Stats


class OracleEngine:
    """Continues the prompt with the real file's text, under the engine's callback contract."""

    def __init__(self, tokenizer, files: dict[str, str]):
        self.tokenizer = tokenizer
        self.max_context = 4096
        self.device = "cpu"
        self.vocab_size = len(tokenizer)
        self.model_id = "oracle"
        self.files = files
        self.calls = 0

    def generate(self, prompt_ids, params, cancel=None, on_round=None, stop=None, constraint=None):
        self.calls += 1
        text = self.tokenizer.decode(prompt_ids)
        prefix = text.rsplit("<|fim_middle|>", 1)[1]
        source = next(s for s in self.files.values() if prefix in s)
        cont = source[source.index(prefix) + len(prefix):][:300]
        out = []
        for tok in self.tokenizer.encode(cont, add_special_tokens=False)[: params.max_tokens]:
            mask = constraint(out) if constraint else None
            assert mask is None or bool(mask[tok]), "the healing mask must allow the true continuation"
            out.append(tok)
            keep = stop(out) if stop else None
            if keep is not None:
                del out[keep:]
                return _Gen(out, "stop", _Stats({"drafted": 4, "accepted": 3}))
        return _Gen(out, "length", _Stats({"drafted": 4, "accepted": 3}))


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("eval-tok")
    build_tokenizer(d)
    return AutoTokenizer.from_pretrained(d)


@pytest.mark.parametrize("midword", [False, True])
def test_oracle_model_gets_exact_suggestions(tok, src_dir, midword):
    from completiond.config import Config
    from completiond.engine.engine import SamplingParams

    files = {p.name: p.read_text() for p in src_dir.rglob("*.py")}
    engine = OracleEngine(tok, files)
    cfg = Config()
    builder = PromptBuilder.for_engine(engine, cfg)
    positions = pick_positions(src_dir, 24, seed=1, per_file=12, midword_only=midword)
    outcomes = [complete(engine, builder, p, SamplingParams(max_tokens=200)) for p in positions]
    r = summarize(outcomes)
    assert r["positions"] == len(positions)
    assert r["suffix_duplication_rate"] == 0.0
    assert r["whitespace_only_rate"] == 0.0
    # The true text is valid code: every file parses with it inserted, and nothing is inserted twice.
    assert r["parse_checked"] > 0 and r["parses_after_insertion"] == 1.0
    assert r["whitespace_dup_rate"] == 0.0 and r["repeated_line_rate"] == 0.0
    # The oracle knows the file: every first line must match exactly.
    misses = [(o.position.kind, o.position.target, o.suggestion) for o in outcomes
              if o.suggestion.split("\n")[0].rstrip() != o.position.target.rstrip()]
    assert not misses


def test_eval_command_on_the_tiny_model(tiny_model_dir, src_dir, capsys):
    rc = cli.main(["eval", str(src_dir), "--model", str(tiny_model_dir), "--device", "cpu", "--positions", "4",
                   "--max-tokens", "6", "--typing", "1", "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    for key in ("next_line_exact_match", "edit_similarity", "suffix_duplication_rate", "whitespace_only_rate", "alpha",
                "p50_ms", "positions"):
        assert key in r
    assert r["positions"] == 4
    assert r["whitespace_only_rate"] == 0.0
    assert 0.0 <= r["alpha"] <= 1.0 and r["p50_ms"] > 0
    # Suffix-first prompt: a keystroke re-sends only the cursor line's last tokens.
    assert r["spm"] and r["typing_keystrokes"] >= 1
    assert r["typing_cache_fraction"] >= 0.9


def test_eval_compare_healing(tiny_model_dir, src_dir, capsys):
    rc = cli.main(["eval", str(src_dir), "--model", str(tiny_model_dir), "--device", "cpu", "--positions", "3",
                   "--max-tokens", "4", "--compare-healing", "--context", "--context-tokens", "64", "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    assert set(r["healing"]) == {"on", "off"}
    assert r["healing"]["on"]["positions"] == r["healing"]["off"]["positions"] == 3
    assert r["context_tokens"] == 64


def test_eval_rejects_a_missing_directory(tmp_path, capsys):
    assert cli.main(["eval", str(tmp_path / "nope")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_heldout_positions_come_from_heldout_files():
    from completiond.models import corpus

    files = [f.path for f in corpus.heldout_files()][:20]
    root = corpus.stdlib_root()
    positions = pick_positions(root, 5, files=files)
    allowed = {f.relative_to(root).as_posix() for f in files}
    assert positions and all(p.path in allowed and corpus.is_heldout(p.path) for p in positions)
