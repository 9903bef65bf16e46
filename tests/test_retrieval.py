"""Repository retrieval: chunks, the index's incremental updates, definitions, the sticky block,
privacy of what enters the index, and eval's side-by-side context modes."""

from __future__ import annotations

import json
import os

import pytest

from completiond import cli
from completiond.completion import retrieval
from completiond.completion.retrieval import RetrievalIndex, make_query, split_lines
from completiond.completion.selection import Selector
from completiond.completion.workspace import DISK, LOCAL, Workspace

MODULE = '''import os


def helper_one(path):
    """Read a thing."""
    with open(path) as f:
        data = f.read()
    return data.strip()


@decorated
def exponential_backoff(attempt, base=2.0, cap=60.0):
    """The delay before an attempt."""
    delay = base ** attempt
    return min(cap, delay)


class RetryState:
    def __init__(self, attempts):
        self.attempts = attempts
        self.outcome = None

    def failed(self):
        return self.outcome is not None
'''


LINE_RULES = "lua"      # a language without a tree-sitter grammar: chunks cut by the line rules


def _ws(tmp_path, **kw) -> Workspace:
    w = Workspace([tmp_path], scan=False, **kw)
    w.scan()
    return w


def _chunk_texts(ctx):
    return [t for _, t in ctx]


# -- chunks ----------------------------------------------------------------------

def test_chunks_split_at_definitions_and_stay_within_twenty_lines():
    lines = MODULE.splitlines(keepends=True)
    ranges = split_lines(lines)
    assert ranges[0][0] == 0 and ranges[-1][1] == len(lines)
    assert all(b == c for (_, b), (c, _) in zip(ranges, ranges[1:]))        # they tile the file
    starts = [lines[s] for s, _ in ranges]
    # The decorator opens its function's chunk; the class opens its own.
    assert "@decorated\n" in starts and "class RetryState:\n" in starts
    long = ["x = %d\n" % i for i in range(95)]
    assert max(e - s for s, e in split_lines(long)) <= retrieval.MAX_LINES


def test_an_edit_reindexes_only_the_changed_chunk_and_keeps_the_other_ids():
    index = RetrievalIndex()
    index.update((LOCAL, "/w/m.py"), "/w/m.py", "python", MODULE)
    before = {index.chunks[i].text: i for i in index.by_key[(LOCAL, "/w/m.py")]}
    edited = MODULE.replace("return min(cap, delay)", "return min(cap, delay * jitter)")
    index.update((LOCAL, "/w/m.py"), "/w/m.py", "python", edited)
    after = {index.chunks[i].text: i for i in index.by_key[(LOCAL, "/w/m.py")]}
    kept = set(before) & set(after)
    assert kept and all(before[t] == after[t] for t in kept)
    assert len(set(after) - set(before)) == 1                                    # one new chunk
    assert "jitter" in index.postings and index.defs["exponential_backoff"]
    index.remove((LOCAL, "/w/m.py"))
    assert not index.chunks and not index.postings and not index.defs and index.total_length == 0


def test_the_index_stops_at_its_chunk_bound():
    index = RetrievalIndex(max_chunks=3)
    for i in range(5):
        index.update((DISK, f"/w/{i}.py"), f"/w/{i}.py", "python", MODULE)
    assert len(index) == 3


def test_query_leaves_out_the_identifier_being_typed_and_names_the_ones_at_the_cursor():
    text = "from pkg.timing import exponential_backoff\n\nwait = exponential_backoff(attempt) + jit"
    q = make_query(text, len(text))
    assert q.partial == "jit" and "jit" not in q.terms
    assert q.names[0] == "attempt" and "exponential_backoff" in q.names
    assert q.imports.names["exponential_backoff"] == ("pkg.timing", "exponential_backoff")


# -- the workspace's retrieval ---------------------------------------------------------

def test_definition_of_a_name_at_the_cursor_comes_from_the_imported_module(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "timing.py").write_text(MODULE)
    # A second definition of the same name elsewhere: the import decides.
    (tmp_path / "other.py").write_text("def exponential_backoff(n):\n    return 0\n")
    w = _ws(tmp_path)
    doc = "from pkg.timing import exponential_backoff\n\n\ndef go(n):\n    return exponential_backoff("
    w.did_open(tmp_path / "main.py", doc)
    ctx = w.context(tmp_path / "main.py", "python", 120, text=doc, offset=len(doc), mode="retrieval")
    assert ctx and ctx[0][0] == "pkg/timing.py"
    assert "def exponential_backoff(attempt, base=2.0, cap=60.0):" in ctx[0][1]


def test_similar_code_is_retrieved_and_the_current_window_and_disk_copy_are_not(tmp_path):
    (tmp_path / "a.py").write_text(MODULE)
    far = "".join(f"unrelated_{i} = {i}\n" for i in range(80))
    current = "def reader(path):\n    with open(path) as f:\n        data = f.read()\n" + far + "value = data.strip"
    (tmp_path / "main.py").write_text(current + "()  # the truth, on disk only\n")
    w = _ws(tmp_path)
    w.did_open(tmp_path / "main.py", current)
    ctx = w.context(tmp_path / "main.py", "python", 400, text=current, offset=len(current), mode="retrieval",
                    window_tokens=(40, 10))
    texts = "".join(_chunk_texts(ctx))
    assert "data.strip()" in texts                       # helper_one, from a.py
    assert "the truth" not in texts                      # never the current file's disk copy
    assert "unrelated_79" not in texts                   # the lines the prompt shows already
    assert "def reader(path)" in texts                   # the current file's own far chunk counts


def test_typing_keeps_the_block_and_a_new_chunk_is_appended(tmp_path):
    (tmp_path / "a.py").write_text(MODULE)
    (tmp_path / "b.py").write_text("def helper_two(url):\n    return fetch_remote(url, retries=3)\n")
    w = _ws(tmp_path)
    head = "def load(path):\n    with open(path) as f:\n        data = f.read()\n    value = "
    blocks = []
    changes = w.block_changes
    for typed in ("d", "da", "dat", "data", "data.", "data.s", "data.st"):
        text = head + typed
        w.did_change(tmp_path / "main.py", text)
        blocks.append(w.context(tmp_path / "main.py", "python", 400, text=text, offset=len(text), mode="retrieval"))
    assert blocks[0] and all(b == blocks[0] for b in blocks)
    assert w.block_changes == changes + 1
    # A new line that needs another chunk: the old ones stay in front, in their order.
    text = head + "data.strip()\n    return fetch_remote(url, retries"
    w.did_change(tmp_path / "main.py", text)
    grown = w.context(tmp_path / "main.py", "python", 400, text=text, offset=len(text), mode="retrieval")
    assert grown[: len(blocks[0])] == blocks[0] and any("fetch_remote" in t for t in _chunk_texts(grown))


def test_near_duplicates_are_dropped(tmp_path):
    (tmp_path / "a.py").write_text(MODULE)
    (tmp_path / "copy.py").write_text(MODULE)
    w = _ws(tmp_path)
    text = "def load(path):\n    with open(path) as f:\n        data = f.read()\n    return data."
    ctx = w.context(tmp_path / "main.py", "python", 1000, text=text, offset=len(text), mode="retrieval")
    texts = _chunk_texts(ctx)
    assert len(texts) == len(set(texts))


def test_recent_mode_is_unchanged_by_the_index(tmp_path):
    (tmp_path / "a.py").write_text(MODULE)
    w = _ws(tmp_path)
    ctx = w.context(tmp_path / "main.py", "python", 1000, text="x = 1", offset=5)
    assert [p for p, _ in ctx] == ["a.py"] and ctx[0][1].startswith("import os")


# -- privacy: the index holds only what may be context ------------------------------------

def test_hidden_ignored_secret_and_outside_files_never_enter_the_index(tmp_path):
    root = tmp_path / "proj"
    root.mkdir()
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    marker = "def leaked_marker_name():\n    return 'token'\n"
    (root / ".gitignore").write_text("private.py\nbuild/\n")
    (root / "private.py").write_text(marker)
    (root / "build").mkdir()
    (root / "build" / "gen.py").write_text(marker)
    (root / ".hidden").mkdir()
    (root / ".hidden" / "h.py").write_text(marker)
    (root / ".dotfile.py").write_text(marker)
    (root / "secrets.py").write_text(marker)
    (root / "app_credentials.py").write_text(marker)
    (root / "ok.py").write_text("def fine_name():\n    return 1\n")
    w = _ws(root)
    # The editor also opens such files, and one outside the workspace.
    for path in (root / "private.py", root / ".hidden" / "h.py", root / "secrets.py", root / ".dotfile.py",
                 root / "build" / "gen.py", outside / "o.py"):
        w.did_open(path, marker)
    indexed = {path for _, path in w.index.by_key}
    assert indexed == {str(root / "ok.py")}
    assert "leaked_marker_name" not in w.index.postings and "leaked_marker_name" not in w.index.defs
    text = "value = leaked_marker_name("
    ctx = w.context(root / "main.py", "python", 2000, text=text, offset=len(text), mode="retrieval")
    assert all("leaked_marker_name" not in t for t in _chunk_texts(ctx))


def test_a_file_that_becomes_ignored_leaves_the_index(tmp_path):
    w = Workspace([tmp_path], scan=False).start()
    try:
        w.did_open(tmp_path / "draft.py", "def drafted_name():\n    return 1\n")
        assert (LOCAL, str(tmp_path / "draft.py")) in w.index.by_key
        (tmp_path / ".gitignore").write_text("draft.py\n")
        assert w.wait_for(lambda: (LOCAL, str(tmp_path / "draft.py")) not in w.index.by_key)
    finally:
        w.stop()


def test_context_exclude_applies_to_retrieved_chunks(tmp_path):
    (tmp_path / "fixtures").mkdir()
    (tmp_path / "fixtures" / "data.py").write_text("def excluded_name():\n    return 1\n")
    w = _ws(tmp_path)
    text = "x = excluded_name("
    ctx = w.context(tmp_path / "main.py", "python", 1000, text=text, offset=len(text), mode="retrieval")
    assert any("excluded_name" in t for t in _chunk_texts(ctx))
    ctx = w.context(tmp_path / "main.py", "python", 1000, text=text, offset=len(text), mode="retrieval",
                    exclude=["fixtures/*"])
    assert all("excluded_name" not in t for t in _chunk_texts(ctx))


def test_another_editors_open_document_is_not_retrieved(tmp_path):
    w = Workspace(scan=False)
    w.add_folder(tmp_path, owner="A")
    w.add_folder(tmp_path, owner="B")
    w.did_open(tmp_path / "a_only.py", "def only_for_a():\n    return 1\n", owner="A")
    text = "x = only_for_a("
    for owner, seen in (("A", True), ("B", False)):
        ctx = w.context(tmp_path / "main.py", "python", 1000, owner=owner, text=text, offset=len(text),
                        mode="retrieval")
        assert any("only_for_a" in t for t in _chunk_texts(ctx)) is seen


def _selector_index(texts: dict[str, str]) -> RetrievalIndex:
    index = RetrievalIndex()
    for name, text in texts.items():
        index.update((DISK, f"/w/{name}"), f"/w/{name}", "python", text)
    return index


def test_the_same_query_gives_the_same_block_when_a_definition_does_not_fit():
    # A definition too big for what is left displaced the last chunk and then did not fit either: the freed
    # room went to another chunk, and the next request (same text) swapped them back, keystroke after keystroke.
    index = _selector_index({
        "small.py": "def small_def(x):\n    return x\n",
        "big.py": "def big_def(y):\n" + "".join(f"    y = y + {k}  # filler words here\n" for k in range(12)),
        "x.py": "value = shared_term(small_def, other_x)\n",
        "y.py": "value = shared_term(small_def, other_y)\n",
    })
    q = make_query("a = small_def(shared_term)\nb = big_def(", len("a = small_def(shared_term)\nb = big_def("))
    cost = lambda c: len(c.text) // 4 + 2   # noqa: E731
    sel = Selector()
    blocks = [[c.path for c in sel.select(index, "s", q, lambda c: True, None, cost, 40)] for _ in range(4)]
    assert "/w/small.py" in blocks[0] and "/w/big.py" not in blocks[0]
    assert all(b == blocks[0] for b in blocks)


def test_a_held_block_gives_way_only_to_a_pick_worth_clearly_more():
    # One chunk fits. `held` matches the first query best; then two chunks that match the second query a
    # little better than `held` rank above it: the block stays (it used to change as soon as the held chunk
    # left the top ranks); a query `held` does not match at all changes it.
    index = _selector_index({
        "held.py": "def held_chunk():\n    return alpha_term + beta_term\n",
        "one.py": "def one_chunk():\n    return alpha_term + beta_term + gamma_term\n",
        "two.py": "def two_chunk():\n    return alpha_term + beta_term + gamma_term\n",
        "other.py": "def other_chunk():\n    return delta_term + epsilon_term\n",
    })
    sel = Selector(max_chunks=1)
    cost = lambda c: 10   # noqa: E731

    def pick(terms):
        q = make_query("", 0)
        q.terms, q.names = terms, []
        return [c.path for c in sel.select(index, "s", q, lambda c: True, None, cost, 10)]

    assert pick({"held_chunk": 1.0, "alpha_term": 1.0}) == ["/w/held.py"]
    assert pick({"alpha_term": 1.0, "beta_term": 1.0, "gamma_term": 0.3}) == ["/w/held.py"]
    assert pick({"delta_term": 1.0, "epsilon_term": 1.0}) == ["/w/other.py"]


def test_a_held_block_stays_through_any_query_while_valid_with_hold():
    # The daemon's rule (issue 45): the block sits first in the prompt, so a new one re-prefills everything. With
    # `hold` the block stays while its chunks are valid, even for a query it does not match (a jump); it goes
    # when one of its chunks goes. A held chunk of the current file that the window now shows stays too.
    index = _selector_index({
        "held.py": "def held_chunk():\n    return alpha_term + beta_term\n",
        "other.py": "def other_chunk():\n    return delta_term + epsilon_term\n",
    })
    cost = lambda c: 10   # noqa: E731

    def pick(sel, terms, window=(0, 0), current=None):
        q = make_query("", 0)
        q.terms, q.names, q.window = terms, [], window
        return [c.path for c in sel.select(index, "s", q, lambda c: True, current, cost, 10)]

    plain, held = Selector(max_chunks=1), Selector(max_chunks=1)
    held.hold = True
    for sel in (plain, held):
        assert pick(sel, {"held_chunk": 1.0, "alpha_term": 1.0}) == ["/w/held.py"]
    assert pick(plain, {"delta_term": 1.0, "epsilon_term": 1.0}) == ["/w/other.py"]
    assert pick(held, {"delta_term": 1.0, "epsilon_term": 1.0}) == ["/w/held.py"]
    # held.py as the current file, its chunk inside the window: still held.
    assert pick(held, {"delta_term": 1.0}, window=(0, 10), current=(DISK, "/w/held.py")) == ["/w/held.py"]
    index.update((DISK, "/w/held.py"), "/w/held.py", "python", "def held_chunk():\n    return zeta_term\n")
    assert pick(held, {"delta_term": 1.0, "epsilon_term": 1.0}) == ["/w/other.py"]


def test_selector_state_is_bounded():
    sel = Selector(max_states=2)
    index = RetrievalIndex()
    index.update((DISK, "/w/a.py"), "/w/a.py", "python", MODULE)
    q = make_query("x = helper_one(path)\n", 20)
    for i in range(5):
        sel.select(index, ("ed", f"/w/{i}.py"), q, lambda c: True, None, lambda c: 10, 100)
    assert len(sel._last) == 2


def test_a_held_block_survives_its_file_opened_in_the_editor_and_edited_back(tmp_path):
    # The block's chunks came from a.py on disk, in an order the query no longer ranks them in. Opening a.py
    # in the editor (its chunks get the editor copy's ids), and an edit there put back, used to drop the held
    # block for a fresh pick in rank order: another text, and the KV cache of main.py's prompt with it.
    two = (
        "def first_helper(path):\n    return alpha_term(path) + beta_term\n\n\n"
        "def second_helper(path):\n    return gamma_term(path) + beta_term\n"
    )
    (tmp_path / "a.py").write_text(two)
    w = _ws(tmp_path)
    main = tmp_path / "main.py"

    def block(text):
        return w.context(main, "python", 400, text=text, offset=len(text), mode="retrieval")

    first = block("x = alpha_term(p) + gamma_term(q) + first_helper")
    assert [t.split("(")[0] for t in _chunk_texts(first)] == ["def first_helper", "def second_helper"]
    ask = "x = alpha_term(p) + gamma_term(q) + second_helper"   # the same two chunks, ranked the other way
    assert block(ask) == first
    w.did_open(tmp_path / "a.py", two)
    assert block(ask) == first
    w.did_change(tmp_path / "a.py", two.replace("beta_term\n", "beta_term + 1\n", 1))
    w.did_change(tmp_path / "a.py", two)
    assert block(ask) == first


# -- eval: the modes side by side ------------------------------------------------------

def test_eval_runs_the_context_modes_side_by_side(tiny_model_dir, tmp_path, capsys):
    (tmp_path / "timing.py").write_text(MODULE)
    (tmp_path / "use.py").write_text("from timing import exponential_backoff\n\n\ndef go(n):\n"
                                     "    return exponential_backoff(n, base=2.0)\n")
    rc = cli.main(["eval", str(tmp_path), "--model", str(tiny_model_dir), "--device", "cpu", "--positions", "3",
                   "--max-tokens", "4", "--context", "none,recent,retrieval", "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    assert r["context_modes"] == ["none", "recent", "retrieval"]
    assert set(r["context"]) == {"none", "recent", "retrieval"}
    for summary in r["context"].values():
        assert summary["positions"] == 3 and "next_line_exact_match" in summary and summary["p50_ms"] > 0
    assert r["context"]["none"]["mean_context_tokens"] == 0
    assert r["context"]["none"]["context_holds_line_rate"] == 0   # no block, nothing shown
    assert all(0 <= s["context_holds_line_rate"] <= 1 for s in r["context"].values())
    assert r["index"]["files"] == 2


def test_eval_refuses_an_unknown_context_mode(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["eval", str(tmp_path), "--context", "none,everything"])
    assert "--context takes" in capsys.readouterr().err


def test_memory_of_the_index_is_released_with_its_files(tmp_path):
    w = Workspace([tmp_path], scan=False, max_bytes=20_000)
    for i in range(40):
        w.did_change(tmp_path / f"f{i}.py", MODULE.replace("helper_one", f"helper_{i}"))
    # The workspace's byte budget evicts files; their chunks go with them.
    assert {path for _, path in w.index.by_key} == set(w.paths())
    assert os.path.basename(sorted(w.paths())[-1]).startswith("f")


def test_incremental_updates_give_the_chunks_a_fresh_index_would():
    # The line rules (a language without a grammar): an edit's chunks are exactly a fresh split's.
    import random

    rng = random.Random(7)
    base = (MODULE * 6).splitlines(keepends=True)
    pieces = ["\n", "    x = 1\n", "def added(y):\n", "@deco\n", "class Added:\n", "    return y\n", "# note\n"]
    index = RetrievalIndex()
    key = (LOCAL, "/w/m.py")
    lines = list(base)
    index.update(key, "/w/m.py", LINE_RULES, "".join(lines))
    for _ in range(300):
        old = "".join(lines)
        i = rng.randrange(len(lines) + 1)
        op = rng.random()
        if op < 0.4 or not lines:
            lines.insert(i, rng.choice(pieces))
        elif op < 0.7:
            del lines[min(i, len(lines) - 1)]
        else:
            k = min(i, len(lines) - 1)
            lines[k] = lines[k].rstrip("\n") + rng.choice(["a", " ", "(", ":"]) + "\n"   # a keystroke
        text = "".join(lines)
        kept_before = set(index.by_key[key])
        assert index.update_edit(key, "/w/m.py", LINE_RULES, old, text)
        got = [(index.chunks[c].start, index.chunks[c].end, index.chunks[c].text) for c in index.by_key[key]]
        fresh = [(s, e, "".join(lines[s:e])) for s, e in split_lines(lines)]
        assert got == fresh
        # A keystroke re-creates few chunks: the rest keep their ids.
        assert len(set(index.by_key[key]) - kept_before) <= 3
    fresh_index = RetrievalIndex()
    fresh_index.update(key, "/w/m.py", LINE_RULES, "".join(lines))
    assert index.postings.keys() == fresh_index.postings.keys() and index.defs.keys() == fresh_index.defs.keys()
    assert index.total_length == fresh_index.total_length


class _NoWholeSplit(str):
    """A document text that records being split whole (slices of it are plain str)."""
    splits = 0

    def splitlines(self, *args, **kw):
        type(self).splits += 1
        return super().splitlines(*args, **kw)


def test_an_edit_splits_only_its_own_lines_and_gives_the_chunks_a_fresh_index_would():
    # Character-level edits anywhere (inside lines, across lines, at the end, with and without a final
    # newline, with \r\n and other line breaks str.splitlines knows): the chunks equal a fresh split,
    # and a document that breaks lines at \n only is never split whole again after its first edit.
    import random

    rng = random.Random(11)
    inserts = ["a", "(", " ", "\n", "\n    ", "def g(x):\n", "@d\nclass K:\n", "", "\r\n", "\x0c", "\u2028"]
    index = RetrievalIndex()
    key = (LOCAL, "/w/m.py")
    text = MODULE * 4
    index.update(key, "/w/m.py", LINE_RULES, text)
    for step in range(400):
        old = text
        i = rng.randrange(len(text) + 1)
        j = min(len(text), i + rng.choice([0, 0, 1, 3, 40]))
        special = step % 50 == 49                        # now and then an edit that brings another line break
        ins = rng.choice(inserts if special else inserts[:8])
        text = text[:i] + ins + text[j:]
        if special:
            text = text.replace("\r", "").replace("\x0c", "").replace("\u2028", "")   # and takes it out again
        plain = not any(ch in old for ch in "\r\x0c\u2028")
        _NoWholeSplit.splits = 0
        assert index.update_edit(key, "/w/m.py", LINE_RULES, old, _NoWholeSplit(text))
        if plain and step and not special:
            assert _NoWholeSplit.splits == 0
        lines = text.splitlines(keepends=True)
        got = [(index.chunks[c].start, index.chunks[c].end, index.chunks[c].text) for c in index.by_key[key]]
        assert got == [(s, e, "".join(lines[s:e])) for s, e in split_lines(lines)]
    fresh_index = RetrievalIndex()
    fresh_index.update(key, "/w/m.py", LINE_RULES, text)
    assert index.postings.keys() == fresh_index.postings.keys() and index.total_length == fresh_index.total_length


def test_status_shows_the_index_and_its_background_scan(tmp_path):
    from completiond.commands.status import describe

    (tmp_path / "a.py").write_text(MODULE)
    w = _ws(tmp_path)
    st = {"pid": 1, "state": "ready", "error": "", "model": "m", "device": "cpu", "uptime_s": 3}
    base = {"status": st, "requests": 0, "completed": 0, "superseded": 0, "cancelled": 0, "errors": 0,
            "clients": 1, "editors": 0}
    lines = describe(dict(base, index=w.index_status()), tmp_path)
    assert f"  context  index of 1 files, {len(w.index)} chunks" in lines
    lines = describe(dict(base, index={"files": 3, "chunks": 40, "found": 5000, "loaded": 120, "scanning": True}),
                     tmp_path)
    assert "  context  index of 3 files, 40 chunks, scanning (120 of 5000 files read)" in lines


# -- the team backend gets the same context -------------------------------------------------------

async def test_the_team_backend_is_sent_the_retrieved_chunks_and_nothing_private(tmp_path):
    import asyncio

    from remote_servers import FakeServer  # the recording server the remote tests use
    from test_backend_remote import cfg_for

    from completiond.serving.service import Service

    server = FakeServer()
    try:
        (tmp_path / "timing.py").write_text(MODULE)
        (tmp_path / "secrets.py").write_text("def exponential_backoff(token='hunter2'):\n    return token\n")
        (tmp_path / ".gitignore").write_text("private.py\n")
        (tmp_path / "private.py").write_text("def exponential_backoff(key='private-key'):\n    return key\n")
        server.plan.pieces = ["2"]
        service = Service(cfg_for(server.url, backend="llamacpp-infill", multiline="never"))
        service.start_loading()
        for _ in range(100):
            if service.state == "ready":
                break
            await asyncio.sleep(0.05)
        service.notify("c", "workspace", {"folders": [str(tmp_path)]})
        assert await asyncio.to_thread(service.workspace.flush)
        assert await asyncio.to_thread(service.workspace.wait_for, lambda: service.workspace.index.files() >= 1)
        doc = "from timing import exponential_backoff\n\n\ndef go(n):\n    return exponential_backoff("
        uri = (tmp_path / "main.py").as_uri()
        service.open("c", uri, 1, doc, "python")
        await service.complete("c", 1, uri, 1, len(doc))
        sent = server.plan.requests[-1]["body"]
        files = {f["filename"]: f["text"] for f in sent["input_extra"]}
        assert "def exponential_backoff(attempt, base=2.0, cap=60.0):" in files.get("timing.py", "")
        assert "hunter2" not in json.dumps(sent) and "private-key" not in json.dumps(sent)
        assert service.stats()["context_changes"] == 1
        service.shutdown()
    finally:
        server.close()
