"""Stop rules on fixture snippets, the token-level callback, and post-processing."""

from __future__ import annotations

import pytest

from completiond.completion.healing import TokenBytes
from completiond.completion.stops import StopRules, TextRules, postprocess, trim_suffix_overlap, wants_multiline
from tests.conftest import build_tokenizer


def final(line_prefix, generated, line_suffix="", following="", multiline="auto", max_lines=8):
    return postprocess(generated, TextRules(line_prefix, line_suffix, following, multiline, max_lines))


def test_multiline_decision():
    assert not wants_multiline("    x = fo", "")
    assert not wants_multiline("foo(", "a, b)")          # mid-line
    assert wants_multiline("def f(x):", "")
    assert wants_multiline("    ", "")                   # empty line
    assert wants_multiline("function f() {", "}")       # only an auto-closed bracket to the right
    assert not wants_multiline("def f(x):", "", "never")
    assert wants_multiline("    x = fo", "", "always")
    with pytest.raises(ValueError):
        wants_multiline("", "", "sometimes")


def test_single_line_mid_line():
    assert final("    return self.ap", "pend(x)\n    more()\n") == "pend(x)"
    assert final("x = ", "1\ny = 2", multiline="never") == "1"


def test_dedent_out_of_block():
    got = final("def f(x):", "\n    y = x + 1\n    return y\n\n\ndef g():\n    pass\n")
    assert got == "\n    y = x + 1\n    return y"


def test_dedent_on_empty_indented_line():
    assert final("    ", "if x:\n        y()\n    z = 1\nw = 2\n") == "if x:\n        y()\n    z = 1"


def test_blank_line_then_top_level_code():
    assert final("", "import os\nimport sys\n\n\ndef main():\n    pass\n") == "import os\nimport sys"


def test_unbalanced_closing_bracket():
    assert final("foo(a, ", "b))", multiline="never") == "b)"
    assert final("x = [", "\n    1,\n    2,\n]\ny = 3") == "\n    1,\n    2,\n]"


def test_brace_block_closed():
    assert final("function f() {", "\n  return 1;\n}\n\nfoo();") == "\n  return 1;\n}"


def test_max_lines():
    got = final("def f():", "\n    a = 1\n    b = 2\n    c = 3\n    d = 4\n", max_lines=2)
    assert got == "\n    a = 1\n    b = 2"


def test_repeat_of_following_line_is_cut():
    got = final("    ", "y = 2\n    return y\n", following="    return y\n")
    assert got == "y = 2"


def test_suffix_overlap_trimmed():
    assert trim_suffix_overlap("a, b)", ")", "foo(") == "a, b"
    assert trim_suffix_overlap("f(a)", ")", "print(") == "f(a)"          # balanced: the ")" is the model's own
    assert trim_suffix_overlap("x, y):", "):", "def f(") == "x, y"
    assert trim_suffix_overlap('lo")', '")', 'print("hel') == "lo"
    assert trim_suffix_overlap("'x'", "',", "    'a':  ") == "'x"        # the closing quote is already there
    assert trim_suffix_overlap("'x'", "", "    'a':  ") == "'x'"
    assert final("foo(", "a, b)", line_suffix=")") == "a, b"
    assert final("print(", '"hi")', line_suffix=")") == '"hi"'


def test_whitespace_only_is_empty():
    assert final("    ", "   \n  \n") == ""
    assert final("x = ", "   ") == ""


def test_closers_right_of_cursor_are_owed_by_the_suggestion():
    # "    |):" : the suggestion opens the bracket the suffix closes, and stops before closing it.
    assert final("    ", "def norm(self):\n        return 1\n", line_suffix="):") == "def norm(self"
    assert final("    print(i, add", "(i, i))\n", line_suffix="))") == "(i, i"
    assert final("print(", "f(a))", line_suffix=")") == "f(a)"


def test_mismatched_closer_and_short_whole_suffix():
    # "]" cannot close "(": the model wandered off.
    assert final("        self.last = [(C", "_name]", line_suffix="]") == "_name"
    # The whole rest of the line (":") repeated at the end is trimmed even though it is one character.
    assert final("    if", " x is None:", line_suffix=":") == " x is None"
    assert final("    if x", " == y", line_suffix=":") == " == y"


def test_repetition_loop_is_cut():
    assert final("    x = self.", "path.path.path.path.path.path.path.path.path") == "path."
    assert final("foo(", "'a', 'b', 'c')", line_suffix=")") == "'a', 'b', 'c'"
    assert final("x = [", "0, 0, 0, 0, 0, 0, 0, 0]") == "0, 0, 0, 0, 0, 0, 0, 0]"   # no letters: data, not a loop


def test_closer_right_of_cursor_goes_to_its_own_line():
    got = final("function f() {", "\n  return 1;\n}", line_suffix="}")
    assert got == "\n  return 1;\n"


# -- the engine callback on real tokens -------------------------------------------

@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("stops-tok")
    build_tokenizer(d)
    return AutoTokenizer.from_pretrained(d)


def feed(rules, ids, round_size=3):
    """Call the stop callback like the engine does: after each round, with all tokens."""
    out = []
    for i in range(0, len(ids), round_size):
        out.extend(ids[i:i + round_size])
        keep = rules(out)
        if keep is not None:
            return out[:keep]
    return out


def test_callback_keeps_the_tokens_of_the_suggestion(tok):
    table = TokenBytes.for_tokenizer(tok)
    text = "\n        return self.x\n\n    def norm(self):\n        pass\n"
    ids = tok.encode(text, add_special_tokens=False)
    rules = StopRules(table, "    def get(self):", max_lines=8)
    kept = feed(rules, ids)
    assert len(kept) < len(ids)                       # stopped early: no rounds past the stop
    assert rules.suggestion(kept) == "\n        return self.x"
    assert "dedent" in rules.reason


def test_callback_cut_inside_a_token(tok):
    table = TokenBytes.for_tokenizer(tok)
    ids = tok.encode("x)\nfoo", add_special_tokens=False)
    rules = StopRules(table, "print(", line_suffix=")", multiline="never")
    kept = feed(rules, ids, round_size=1)
    assert table.text(kept).startswith("x")
    assert rules.suggestion(kept) == "x"
    # Without the ")" right of the cursor, the model's ")" closes "print(".
    assert StopRules(table, "print(", multiline="never").suggestion(ids) == "x)"


def test_stop_tokens_and_healed_text(tok):
    table = TokenBytes.for_tokenizer(tok)
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    sep = tok.convert_tokens_to_ids("<|file_sep|>")
    ids = tok.encode("norm()", add_special_tokens=False) + [sep] + tok.encode(" junk", add_special_tokens=False)
    rules = StopRules(table, "        return self.", stop_ids={eot, sep}, healed="no")
    kept = feed(rules, ids, round_size=2)
    assert sep not in kept
    assert rules.suggestion(kept) == "rm()"


from hypothesis import given, settings, strategies as st  # noqa: E402

GEN_LINES = st.sampled_from(["", "    x = 1", "        y = f(x)", "return x)", "}", "def g():", "    ]", "  a, b)", "z = (1,",
                             "    pass", "\t", "print(x)", "    if t % 2:", "        return 0", 'y = name.split() + "a"'])


@settings(max_examples=150, deadline=None)
@given(lines=st.lists(GEN_LINES, min_size=1, max_size=10), lead=st.sampled_from(["", "\n", "foo", " + 1"]),
       line_prefix=st.sampled_from(["", "    ", "def f(x):", "    x = foo(", "y = [", "    return self.ap"]),
       line_suffix=st.sampled_from(["", ")", "):", "]", "name.split())", '"a"']), multiline=st.sampled_from(["auto", "always", "never"]),
       rounds=st.integers(1, 4), max_lines=st.integers(1, 5))
def test_stopping_early_gives_the_same_suggestion(tok, lines, lead, line_prefix, line_suffix, multiline, rounds, max_lines):
    """The in-loop stop never cuts earlier than post-processing the whole output would."""
    table = TokenBytes.for_tokenizer(tok)
    text = lead + "\n".join(lines)
    ids = tok.encode(text, add_special_tokens=False)
    following = "    return x\n"
    rules = StopRules(table, line_prefix, line_suffix, following, multiline, max_lines)
    kept = feed(rules, ids, round_size=rounds)
    assert table.join(kept) == table.join(ids[:len(kept)])
    full = StopRules(table, line_prefix, line_suffix, following, multiline, max_lines).suggestion(ids)
    assert rules.suggestion(kept) == full
    assert full == "" or full.strip()


# -- repetition, suffix and whitespace rules (issue 30) ----------------------------------------------

def test_a_repeated_pair_of_lines_is_cut_before_the_repeat():
    got = final("            ", "t //= 60\n            if t % 2:\n                return 0\n"
                               "            if t % 2:\n                return 0\n            if t % 2:\n")
    assert got == "t //= 60\n            if t % 2:\n                return 0"


def test_a_line_written_again_and_again_is_kept_once():
    comment = "        # If *cls* is a class, then the class is a class."
    got = final("        ", "\n".join([comment.lstrip()] + [comment] * 3) + "\n")
    assert got == comment.lstrip()


def test_a_line_seen_twice_already_stops_at_its_third_copy():
    text = "x = load()\n    y = 1\n    x = load()\n    z = 2\n    x = load()\n    w = 3\n"
    assert final("    ", text) == "x = load()\n    y = 1\n    x = load()\n    z = 2"


def test_lines_repeating_inside_different_blocks_are_not_a_cycle():
    text = ("try:\n        a()\n    except KeyError:\n        pass\n"
            "    try:\n        b()\n    except KeyError:\n        pass\n")
    assert final("    ", text, max_lines=8) == text.rstrip()
    # Closers and bare keywords repeat in ordinary code.
    assert final("    ", "if a:\n        f(\n        )\n        g(\n        )\n        h(\n        )\n") \
        .count(")") == 3


def test_a_long_unit_repeated_inside_a_line_is_cut():
    got = final('        raise TypeError(f"expected {self.name}', ' with {self.type!r}' * 5 + '")')
    assert got == ' with {self.type!r}'


def test_rule_stops_the_stream_at_a_cycle_before_the_token_limit(tok):
    """Decided in the loop: the callback answers as soon as the second copy of the pair is complete."""
    table = TokenBytes.for_tokenizer(tok)
    body = "if t % 2:\n                return 0\n            "
    ids = tok.encode("t //= 60\n            " + body * 6, add_special_tokens=False)
    rules = StopRules(table, "            ")
    kept = feed(rules, ids, round_size=2)
    assert len(kept) < len(ids) // 2
    assert rules.suggestion(kept) == "t //= 60\n            if t % 2:\n                return 0"
    assert rules.reason == "repeated lines (a cycle)"


def test_suggestion_that_retypes_the_text_right_of_the_cursor_stops_there(tok):
    table = TokenBytes.for_tokenizer(tok)
    suffix = '"-".join(name.split()).lower()'
    rules = StopRules(table, "    return ", suffix)
    ids = tok.encode('name + "-".join(name.split()).lower()', add_special_tokens=False)
    kept = feed(rules, ids, round_size=1)
    assert len(kept) < len(ids)
    assert rules.suggestion(kept) == "name +"


def test_an_operand_in_front_of_the_one_already_right_of_the_cursor_is_not_shown():
    suffix = '"-".join(name.split()).lower()'
    assert final("    return ", "str(name)", line_suffix=suffix) == ""     # the case at click/utils.py:33:12
    assert final("    x = foo(", "a", line_suffix='"b")') == ""
    assert final("    x = foo(", "f", line_suffix='"b")') == "f"             # an f-string prefix
    assert final("    x = ", "a + ", line_suffix='"b"') == "a +"
    assert final("    return ", "self.", line_suffix="name") == "self."


@pytest.mark.parametrize("line_prefix, generated, want", [
    ("            ", " t //= 60", "t //= 60"),
    ("\t\t\t", "\tt //= 60", "t //= 60"),
    ("x = ", " 1", "1"),
    ("            ", "  \n            x = 1", "\n            x = 1"),
])
def test_whitespace_already_in_the_buffer_is_never_inserted_again(line_prefix, generated, want):
    assert final(line_prefix, generated) == want


def test_an_unfinished_last_line_at_the_token_limit_is_dropped():
    rules = TextRules("def f(x):")
    assert postprocess("\n    y = x + 1\n    return fo", rules, truncated=True) == "\n    y = x + 1"
    assert postprocess("\n    y = x + 1\n    return fo", rules) == "\n    y = x + 1\n    return fo"
    assert postprocess("\n    y = x + 1\n", rules, truncated=True) == "\n    y = x + 1"   # the line was finished
    assert postprocess("x = fo", TextRules("    "), truncated=True) == "x = fo"              # one line: kept


def test_a_block_opener_left_without_its_body_is_dropped():
    assert final("    ", "x = 1\n    if x:") == "x = 1"
    assert final("    ", "x = 1\n    if x:", following="        y = 2\n") == "x = 1\n    if x:"
    assert final("def f(x):", "\n    if x:") == "\n    if x:"      # the only line: kept


def test_a_quote_right_of_the_cursor_that_closes_the_suggestions_string_is_no_collision():
    assert final("    p = path.joinpath('binary.f", "ile", line_suffix="')") == "ile"
    assert final("        self.fileobj.wr", "ite(b'\\0", line_suffix="')") == "ite(b'\\0"


def test_aligned_whitespace_inside_a_line_is_kept_when_healing_regenerated_it(tok):
    table = TokenBytes.for_tokenizer(tok)
    line_prefix = "    'U'    "
    generated = "    #  0xE4 -> LATIN CAPITAL LETTER U"
    healed = StopRules(table, line_prefix, healed="    ")
    ids = tok.encode("    " + generated, add_special_tokens=False)
    assert healed.suggestion(ids) == generated                 # the model chose the alignment after the healed spaces
    assert final(line_prefix, generated) == generated.lstrip()   # no healing: the buffer's spaces are enough


def test_a_phrase_repeated_three_times_is_a_loop():
    got = final("        # ", "The name of the name of the name of the name of the name")
    assert got.startswith("The name of t") and len(got) <= len("The name of the")   # one copy of the phrase


def test_a_closer_right_of_the_cursor_of_another_kind_is_not_owed_here():
    # `assert list(unzip(z|]`: the `]` closes a `[` the suggestion opens later, so its `)`s stay.
    rules = TextRules("    assert list(unzip(z", "]")
    assert postprocess("ip([]))) == [", rules) == "ip([]))) == ["
    # The same kind is owed: `foo(|)` + "a, b)" keeps the `)` right of the cursor.
    assert postprocess("a, b)", TextRules("    foo(", ")")) == "a, b"


def test_the_alternatives_of_a_request_share_its_site(tok, monkeypatch):
    # Each alternative gets fresh stop rules; the region around the cursor is found and parsed once.
    from completiond.completion import stops

    calls: list[int] = []
    real = stops.document_site
    monkeypatch.setattr(stops, "document_site", lambda *a, **k: calls.append(1) or real(*a, **k))
    text = "def f(x):\n    y = compute(x, \n    return y\n"
    offset = text.index("\n    return")
    table = TokenBytes.for_tokenizer(tok)
    site = None
    for _ in range(3):
        rules = StopRules(table, "    y = compute(x, ", "", "    return y\n")
        site = rules.attach_document(text, offset, "python", site=site)
        assert site is not None and rules.rules.site is site
        assert rules.rules.open_brackets == ["("]
    assert len(calls) == 1
