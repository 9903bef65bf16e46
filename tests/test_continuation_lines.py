"""Python continuation lines: brackets an earlier line of the statement opened are open at the cursor
(issue 30: a continuation line was cut before its closing bracket, or closed one a later line closes)."""

from __future__ import annotations

import pytest

from completiond.completion.healing import TokenBytes
from completiond.completion.stops import (
    StopRules,
    TextRules,
    document_site,
    postprocess,
)
from completiond.completion.syntax import site_at
from tests.conftest import build_tokenizer


def shown(document: str, generated: str, language: str = "python", cursor: int | None = None,
          check_syntax: bool = True) -> str:
    """What the editor shows for `generated` at `cursor` (default: the end of the document's first part)."""
    offset = len(document) if cursor is None else cursor
    ls = document.rfind("\n", 0, offset) + 1
    le = document.find("\n", offset)
    le = len(document) if le < 0 else le
    rules = TextRules(document[ls:offset], document[offset:le], document[le + 1:],
                      site=document_site(document, offset, language), check_syntax=check_syntax)
    return postprocess(generated, rules)


def test_brackets_open_at_the_start_of_the_cursor_line():
    text = "def f():\n    x = foo(a, [1,\n                2],\n            b"
    assert site_at(text, len(text), "python").open_before == ("(",)
    # Brackets in strings, comments and docstrings are not code.
    text = 'def f():\n    """Returns (a."""\n    x = g("(", \'[\',  # (see above\n          1'
    assert site_at(text, len(text), "python").open_before == ("(",)


def test_continuation_line_may_close_the_bracket_an_earlier_line_opened():
    text = "class EUCKRMap(support.TestBase_Mapping,\n               unittest"
    # Before: the ")" was cut as a closer without an opener, leaving `(` unclosed (no parse).
    assert shown(text, ".TestCase):\n    encoding = 'cp949'") == ".TestCase):"
    text = "warnings.warn(MESSAGE,\n              DeprecationWarning, "
    assert shown(text, "stacklevel=2)\nprint(1)") == "stacklevel=2)"


def test_closer_that_a_later_line_owes_stays_open():
    text = "def f():\n    x = foo(a,\n            b"
    following = "\n            c)\n    return x\n"
    # ")" would close foo( a second time: the bracket cut keeps it open, and the syntax check then
    # finds that `b, c` followed by `c)` does not parse but `b,` does.
    assert shown(text + following, ", c)", cursor=len(text)) == ","


def test_whitespace_continuation_line_ends_after_the_statement_closes():
    text = "def f():\n    x = foo(\n        "
    got = shown(text, "a,\n        b,\n    )\n    y = 2\n    z = 3")
    assert got == "a,\n        b,\n    )"


def test_stream_callback_keeps_the_closer_of_a_continuation_line(tmp_path):
    from transformers import AutoTokenizer

    build_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    table = TokenBytes.for_tokenizer(tok)
    text = "result = compute(first,\n                 second"
    ls = text.rfind("\n") + 1
    rules = StopRules(table, text[ls:], "", "\n\nprint(result)\n")
    rules.attach_document(text, len(text), "python")
    ids = tok.encode(")\nprint(result)\n", add_special_tokens=False)
    keep = None
    for n in range(1, len(ids) + 1):
        keep = rules(ids[:n])
        if keep is not None:
            break
    assert rules.suggestion(ids[:keep] if keep is not None else ids, "stop") == ")"


@pytest.mark.parametrize("language, text", [
    ("javascript", "function f() {\n  x = foo(a,\n    b"),
    ("go", "package p\n\nfunc f() {\n\tx := foo(a,\n\t\tb"),
])
def test_every_language_with_a_grammar_sees_the_statement(language, text):
    # The ")" closes the bracket the line above opened.
    assert document_site(text, len(text), language).open_before == ("(",)
    assert shown(text, ")", language=language) == ")"


@pytest.mark.parametrize("language", ["kotlin", None])
def test_languages_without_a_grammar_keep_the_cursor_line_rules(language):
    text = "fun f() {\n  x = foo(a,\n    b"
    # Without a grammar the ")" has no opener on the cursor line: cut, as before.
    assert shown(text, ")", language=language) == ""
    assert document_site(text, len(text), language) is None
