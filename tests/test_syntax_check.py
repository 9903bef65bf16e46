"""The Python syntax check of a suggestion before it is shown (issue 30: files that still parse)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import pytest

from completiond.completion import syntax
from completiond.completion.syntax import MAX_PARSES, MAX_REGION_CHARS, check, cuts, site_at
from tests.test_continuation_lines import shown

FUNC = "def f(x):\n    "
AFTER = "\n    return y\n\n\ndef g():\n    pass\n"


def at_cursor(generated: str, before: str = FUNC, after: str = AFTER, **kw) -> str:
    return shown(before + after, generated, cursor=len(before), **kw)


def test_a_suggestion_that_parses_is_shown_unchanged():
    assert at_cursor("y = x + 1") == "y = x + 1"
    assert at_cursor("if x:\n        y = 1\n    else:\n        y = 2") == "if x:\n        y = 1\n    else:\n        y = 2"


def test_the_longest_cut_at_a_line_end_that_parses_is_shown():
    assert at_cursor("if x:\n        y = 1\n    else\n        y = 2") == "if x:\n        y = 1"


def test_the_first_line_is_cut_at_a_token_boundary():
    assert at_cursor("y = x +") == "y = x"
    assert at_cursor("y = compute(x, ") == "y = compute"   # `compute(x,` never closes


def test_a_suggestion_that_breaks_valid_code_is_dropped():
    assert at_cursor("def") == ""
    assert at_cursor("else:") == ""


def test_mid_edit_elsewhere_cannot_be_judged_and_passes_unchanged():
    # The block does not parse without the suggestion either (line 2 is unfinished): no verdict.
    before = "def f(x):\n    z = 1 +\n    "
    assert at_cursor("y = x +", before=before) == "y = x +"
    text = before + AFTER
    site = site_at(text, len(before))
    assert check(site, "y = x +").outcome == "unjudged"


def test_a_cursor_line_the_suggestion_cannot_complete_shows_nothing():
    # Only the line being typed is unfinished (the block parses with it set aside): a suggestion that
    # leaves it invalid, whole or cut, is not shown; one that completes it is.
    before = "def f(x):\n    y = compute(x, "
    assert at_cursor("1 +", before=before) == ""
    assert at_cursor("1) +", before=before) == "1)"
    # A continuation line inside brackets opened above is never set aside.
    before = "def f(x):\n    y = compute(x,\n                "
    assert at_cursor("1 +", before=before) == "1 +"


def test_decorators_and_docstrings_do_not_end_or_start_a_block():
    text = "class A:\n    @prop\n    def f(self):\n        return 1\n"
    cursor = text.index("@prop") + len("@prop")
    site = site_at(text, cursor)
    assert "def f(self)" in site.tail
    assert shown(text, "erty", cursor=cursor) == "erty"
    # Inside a docstring (its lines are prose, not statements) nothing is judged.
    text = '"""Module.\n\nGeneric utili\nMore text.\n"""\n\nimport os\n'
    cursor = text.index("utili") + len("utili")
    assert not site_at(text, cursor).checkable
    assert shown(text, "ties (", cursor=cursor) == "ties ("


def test_other_languages_and_the_setting_off_are_untouched():
    assert at_cursor("y = x +", check_syntax=False) == "y = x +"
    js = "function f(x) {\n  "
    assert shown(js + "\n}\n", "y = x +", language="javascript", cursor=len(js)) == "y = x +"
    assert not syntax.is_python("javascript", "a.py") and syntax.is_python(None, "a.pyi")


def test_only_the_enclosing_top_level_block_is_parsed():
    broken_elsewhere = "def broken(:\n    pass\n\n\n"
    before = broken_elsewhere + FUNC
    site = site_at(before + AFTER, len(before))
    assert site.head == FUNC and site.tail == "\n    return y\n\n\n"   # g() starts the next block
    # The error in another function does not stop the check here.
    assert at_cursor("y = x +", before=before) == "y = x"


def test_a_long_class_checks_the_method_around_the_cursor():
    methods = "".join(f"    def m{i}(self):\n        return {i}\n\n" for i in range(400))
    before = "class C:\n" + methods + "    def n(self, x):\n        "
    text = before + "\n        return y\n"
    assert len(text) > MAX_REGION_CHARS
    site = site_at(text, len(before))
    assert site.head.startswith("if 1:\n    def n(self, x):") and len(site.head + site.tail) < 200
    assert shown(text, "y = x +", cursor=len(before)) == "y = x"


def test_pathological_input_is_bounded_and_never_raises():
    # One statement longer than the bound: no region, no check, no exception.
    huge = "x = [\n" + "    1,\n" * 5000 + "    "
    assert site_at(huge, len(huge)) is None
    assert shown(huge, "2,") == "2,"
    # Nesting deeper than the parser allows, runaway unary chains, NUL characters: parse failures.
    for bad in ("(" * 5000, "-" * 100_000 + "1", "a\x00b", "[" * 300 + "]" * 300):
        assert syntax.parses(bad) is False or bad.startswith("[")
        verdict = check(site_at(FUNC + AFTER, len(FUNC)), "y = " + bad)
        assert verdict.parses <= MAX_PARSES and verdict.outcome in ("cut", "dropped")
    # Many lines and tokens: still at most MAX_PARSES parses.
    many = "y = (" + " + ".join("x" for _ in range(200)) + "\n" + "\n".join(f"    z{i} = (" for i in range(50))
    assert len(cuts(many, limit=1000)) > MAX_PARSES
    assert check(site_at(FUNC + AFTER, len(FUNC)), many).parses <= MAX_PARSES


def test_parser_warnings_are_not_failures():
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # -W error: an invalid escape would otherwise raise SyntaxError
        assert at_cursor("y = re.sub('\\d', '', x)") == "y = re.sub('\\d', '', x)"


# -- wired into both request paths ---------------------------------------------------


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


class ScriptedEngine:
    """Generates one fixed text, under the engine's stop-callback contract."""

    def __init__(self, tokenizer, text: str):
        self.tokenizer = tokenizer
        self.max_context = 4096
        self.device = "cpu"
        self.vocab_size = len(tokenizer)
        self.model_id = "scripted"
        self.eos_token_ids = ()
        self.text = text

    def generate(self, prompt_ids, params, cancel=None, on_round=None, stop=None, constraint=None):
        out = []
        for tok in self.tokenizer.encode(self.text, add_special_tokens=False)[: params.max_tokens]:
            out.append(tok)
            keep = stop(out) if stop else None
            if keep is not None:
                return _Gen(out[:keep], "stop", _Stats({}))
        return _Gen(out, "length", _Stats({}))


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    from tests.conftest import build_tokenizer

    d = tmp_path_factory.mktemp("syntax-tok")
    build_tokenizer(d)
    return AutoTokenizer.from_pretrained(d)


@pytest.mark.parametrize("language,expected", [("python", "y = x"), ("javascript", "y = x +")])
def test_local_path_checks_python_suggestions(tok, language, expected):
    from completiond.completion.completer import suggest
    from completiond.completion.suggest import LocalCompleter
    from completiond.config import Config
    from completiond.engine.cancel import CancelToken

    from completiond import config as config_mod

    # Healing off: the scripted engine does not re-type the indentation healing would back up over.
    cfg, errors = config_mod.merge(Config(), {"tokenHealing": False})
    assert not errors
    text = FUNC + AFTER
    found = suggest(LocalCompleter(ScriptedEngine(tok, "y = x +\n")), text, len(FUNC), cfg, cancel=CancelToken(),
                    language=language).suggestion
    assert found is not None and found.text == expected
    if language == "python":
        assert found.stats["syntax_check"] == "cut" and found.stats["syntax_parses"] >= 2


class _Server:
    """A team server that answers `text` (the TeamServer API the completer uses)."""

    api, model_id = "openai", "scripted"

    def __init__(self, text):
        self.text = text

    def complete(self, req, cancel=None, on_text=None):
        from completiond.backends.team_server import TeamGeneration

        return TeamGeneration(self.text, "stop", {})


@pytest.mark.parametrize("language,expected", [("python", "y = x"), ("javascript", "y = x +")])
def test_remote_path_checks_python_suggestions(language, expected):
    from completiond import config as config_mod
    from completiond.completion.completer import suggest
    from completiond.completion.team import TeamCompleter
    from completiond.engine.cancel import CancelToken

    cfg, errors = config_mod.merge(config_mod.Config(), {"backend": "openai", "endpoint": "http://127.0.0.1:9"})
    assert not errors
    text = FUNC + AFTER
    done = suggest(TeamCompleter(_Server("y = x +\n")), text, len(FUNC), cfg, cancel=CancelToken(),
                   path="/w/a.py" if language == "python" else "/w/a.js", language=language)
    assert [s.text for s in done.suggestions] == [expected]


def test_a_one_line_string_typed_at_the_cursor_is_judged():
    # A quote left open ends at its line, so the region is known: the suggestion must close it. (Before,
    # any text typed inside a string passed unjudged: `'tool` + `olo` broke the file on accept.)
    before = "def f(x):\n    y = name('tool"
    assert site_at(before + AFTER, len(before)).checkable
    assert at_cursor("olo", before=before) == ""
    assert at_cursor("z.curried')", before=before) == "z.curried')"
    assert at_cursor("z')\n    y = name('tool", before=before) == "z')"
    # A triple quote is still open-ended: its lines may be prose, nothing is judged.
    before = 'def f(x):\n    """Retu'
    assert not site_at(before + AFTER, len(before)).checkable


def test_mid_edit_below_a_suggestion_that_breaks_first_is_cut_or_dropped():
    # The block is broken after the cursor (line 3 never closes its bracket), so nothing that is inserted
    # parses; the parser still reaches the cursor. A suggestion it fails inside is cut before that point
    # when the shorter text lets it reach the old error again, and dropped otherwise.
    before = "def f(x):\n    y = "
    after = "\n    z = (1,\n"
    text = before + after
    assert check(site_at(text, len(before)), "x + 1").outcome == "unjudged"   # the error stays below
    assert at_cursor("x + 1)", before=before, after=after) == "x + 1"
    assert at_cursor("x + ]", before=before, after=after) == ""
    # The missing colon of a def with its body below: a stray quote is not shown.
    before = "class A:\n    def do_fix_work()"
    after = "\n        run('Fix')\n"
    assert at_cursor("' -> None:", before=before, after=after) == ""
    assert at_cursor(" -> None:", before=before, after=after) == " -> None:"


def test_a_bracket_left_open_above_is_judged_where_the_parser_stops():
    # `'(' was never closed` is reported at the opener, above the cursor, but found at the end: the
    # parser read everything. Before, that placed the error above the cursor and nothing was judged.
    before = "def f():\n    return g(a,\n             b"
    after = "\n\n\ndef h():\n    pass\n"
    assert at_cursor(", c", before=before, after=after) == ", c"   # still unfinished, as it was
    assert at_cursor(", c]", before=before, after=after) == ", c"
    # The line below closes two of the brackets open at the cursor: a suggestion may not close them
    # (before, it did and left that line dangling), and what is left must parse.
    before = "def f():\n    assert list(map(firs"
    after = "\n                    partitionby(identity, x))) == 1\n"
    assert site_at(before + after, len(before)).closed_below == 2
    assert at_cursor('t, "a")) == [1]', before=before, after=after) == "t,"


def test_an_unfinished_line_must_not_leave_the_next_one_dangling():
    # The true line opens a call the next lines continue; a suggestion that completes the cursor line
    # some other way leaves `    name=...` an unexpected indent: not shown. An error further below is
    # not this edit's: there the suggestion only must not make things worse.
    before = "@pyt"
    after = '\n    name="stdlib_log_method",\n)\ndef f():\n    pass\n'
    assert at_cursor("est.fixture(autouse=True)", before=before, after=after) == ""
    assert at_cursor("est.fixture(", before=before, after=after) == "est.fixture("
    before = "def f(x):\n    y = x."
    after = "\n    z = 1\n    w = (2,\n    return y\n"
    assert at_cursor("real", before=before, after=after) == "real"


def test_the_parse_count_is_every_parse_made_and_stays_within_the_bound(monkeypatch):
    import ast

    calls = []
    real = ast.parse
    monkeypatch.setattr(syntax.ast, "parse", lambda *a, **k: calls.append(1) or real(*a, **k))
    many = "a\nb\nc\nd\ne\nf\ng\nh\ni(\nj)k l m n o p q r s t u v w x y z ] ) )"
    for before, after in [("def f(x):\n    y = ", "\n    z = (1,\n"), ("@pyt", '\n    name="x",\n)\n'),
                          ("def f(x):\n    z = 1 +\n    ", AFTER), (FUNC, AFTER)]:
        for s in (many, "x + 1)", "est.fixture(autouse=True)"):
            calls.clear()
            verdict = check(site_at(before + after, len(before)), s)
            assert verdict.parses == len(calls) <= MAX_PARSES, (before, s, verdict)
