"""Token healing: the constraint makes the output start with the backed-off text."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from completiond.completion.healing import Healing, TokenBytes, TokenHealer
from tests.conftest import build_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("heal-tok")
    build_tokenizer(d)
    return AutoTokenizer.from_pretrained(d)


@pytest.fixture(scope="module")
def healer(tok):
    return TokenHealer.for_tokenizer(tok)


def greedy(healing: Healing, vocab: int, steps: int, seed: int) -> list[int]:
    """Decode with random scores under the constraint: a stand-in for any model."""
    g = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(steps):
        scores = torch.randn(vocab, generator=g)
        mask = healing.constraint(out)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        out.append(int(scores.argmax()))
    return out


def test_token_bytes_round_trip(tok):
    table = TokenBytes.for_tokenizer(tok)
    for text in ["def add(a, b):\n    return a + b", "  ünïcödé € 😀\t\n", "self.x ** 2"]:
        assert table.join(tok.encode(text, add_special_tokens=False)) == text.encode()
    assert table[tok.convert_tokens_to_ids("<|endoftext|>")] is None
    assert TokenBytes.for_tokenizer(tok) is table


def test_heal_backs_off_partial_word(tok, healer):
    ids = tok.encode("        self.x = x\n        self.no", add_special_tokens=False)
    kept, healing = healer.heal(ids)
    assert healing is not None
    assert tok.decode(kept) + healing.removed == "        self.x = x\n        self.no"
    assert healing.removed and "no".endswith(healing.removed)


def test_never_backs_off_a_newline(tok, healer):
    ids = tok.encode("x = 1\n", add_special_tokens=False)
    _, healing = healer.heal(ids)
    assert healing is None


def test_allowed_ids_are_exactly_the_consistent_tokens(tok, healer):
    table = TokenBytes.for_tokenizer(tok)
    for remaining in [b"no", b"self", b" ", b"x", b"rm()"]:
        allowed = set(healer.allowed_ids(remaining))
        expected = {i for i, b in enumerate(table.table)
                    if b and (remaining.startswith(b) or b.startswith(remaining))}
        assert allowed == expected
        mask = healer.mask(remaining)
        assert mask.dtype == torch.bool and mask.shape == (healer.vocab_size,)
        assert set(torch.nonzero(mask).flatten().tolist()) == expected


def test_mask_has_model_vocab_size(tok):
    h = TokenHealer(tok, vocab_size=len(tok) + 37)
    assert h.mask(b"se").shape == (len(tok) + 37,)
    assert not h.mask(b"se")[len(tok):].any()


@settings(max_examples=40, deadline=None)
@given(prefix=st.text(alphabet="abcdefghijklmnopqrstuvwxyz_.( =:\n", min_size=1, max_size=40), seed=st.integers(0, 10**6))
def test_healed_output_starts_with_removed_text(tok, healer, prefix, seed):
    ids = tok.encode(prefix, add_special_tokens=False)
    kept, healing = healer.heal(ids)
    if healing is None:
        return
    out = greedy(healing, len(tok), steps=len(healing.removed) + 3, seed=seed)
    text = TokenBytes.for_tokenizer(tok).text(out)
    assert text.startswith(healing.removed)
    assert healing.output_text(out) == text[len(healing.removed):]
    # The prompt plus the output reproduces the typed text, then continues.
    assert (tok.decode(kept) + text).startswith(prefix)


def test_constraint_lifts_after_the_removed_text(tok, healer):
    ids = tok.encode("print(add", add_special_tokens=False)
    _, healing = healer.heal(ids)
    done = tok.encode(healing.removed, add_special_tokens=False)
    assert healing.constraint(done) is None
    assert healing.constraint([]) is not None


def test_healing_with_the_tiny_model_engine(tiny_model_dir):
    from completiond.engine.engine import Engine, SamplingParams

    engine = Engine.load(model=str(tiny_model_dir), device="cpu")
    vocab = engine.vocab_size
    healer = TokenHealer(engine.tokenizer, vocab_size=vocab)
    ids = engine.tokenizer.encode("class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.no",
                                  add_special_tokens=False)
    kept, healing = healer.heal(ids)
    assert healing is not None
    for speculative in (False, True):
        gen = engine.generate(kept, SamplingParams(max_tokens=6, speculative=speculative, exit_layer=2 if speculative else None),
                              constraint=healing.constraint)
        text = TokenBytes.for_tokenizer(engine.tokenizer).text(gen.tokens)
        assert text.startswith(healing.removed) or healing.removed.startswith(text)


def test_sentencepiece_token_bytes_and_healing(tmp_path):
    from completiond.models.fim import make_template
    from tests.test_fim import FAMILIES, make_tokenizer

    tok = make_tokenizer(tmp_path, **FAMILIES["codellama"])
    t = make_template(tok)
    table = TokenBytes.for_tokenizer(tok)
    for text in ["def add(a, b):\n    return a + b", "print(add(1, 2))\n"]:
        assert table.join(t.encode(text)) == text.encode()
    healer = TokenHealer(tok)
    kept, healing = healer.heal(t.encode("    return a + b\nprint(ad"))
    assert healing is not None
    out = greedy(healing, len(tok), steps=len(healing.removed) + 2, seed=1)
    assert table.text(out).startswith(healing.removed)


# -- boundary healing for whitespace (issue 30) --------------------------------------------------

@pytest.mark.parametrize("text, removed", [
    ("def f(x):\n    if x:\n        y = 1\n        ", "\n        "),   # the newline merged with the indentation
    ("if x:\n\t\ty = 1\n\t\t", "\t\t"),                                 # tabs after a newline token
    ("x = ", " "),                                                      # a space inside a line
    ("x =  ", "  "),
])
def test_trailing_whitespace_is_backed_off_to_the_token_boundary_before_it(tok, healer, text, removed):
    ids = tok.encode(text, add_special_tokens=False)
    kept, healing = healer.heal(ids)
    assert healing is not None and healing.removed == removed
    assert tok.decode(kept) + healing.removed == text
    # The prompt now ends where a token boundary was before the whitespace: nothing kept is whitespace-only.
    assert tok.decode(kept[-1:]).strip(" \t")


def test_whitespace_constraint_lets_the_next_word_carry_its_own_space(tok, healer):
    ids = tok.encode("        x = 1\n        ", add_special_tokens=False)
    _, healing = healer.heal(ids)
    table = TokenBytes.for_tokenizer(tok)
    # The canonical tokens of the indented line: the constraint accepts them all the way.
    line = tok.encode("\n        y = 2", add_special_tokens=False)
    for i in range(len(line)):
        mask = healing.constraint(line[:i])
        if mask is None:
            break
        assert bool(mask[line[i]]), table.text(line[:i + 1])
    assert healing.output_text(line) == "y = 2"


@pytest.fixture(scope="module")
def bundled(bundled_model_dir):
    from completiond.engine.engine import Engine

    return Engine.load(model=str(bundled_model_dir), device="cpu")


ETA = '''class Bar:
    def format_eta(self) -> str:
        if self.eta_known:
            t = int(self.eta)
            seconds = t % 60
            t //= 60
            minutes = t % 60
            t //= 60
            hours = t % 24
'''


@pytest.mark.parametrize("text, cursor", [
    (ETA + " " * 12, None),                                   # the case: a file cut after 12 spaces
    (ETA + " " * 12 + "\n" + " " * 12 + "return t\n", len(ETA) + 12),   # ... with the rest of the file after it
    (ETA.replace("    ", "\t") + "\t\t\t", None),              # tabs
    (ETA + "            days = ", None),                      # after a space inside a line
], ids=["cut-after-indent", "indent-before-more-code", "tabs", "after-space"])
def test_bundled_model_never_reinserts_whitespace_already_in_the_buffer(bundled, text, cursor):
    from completiond.completion.completer import suggest
    from completiond.completion.suggest import LocalCompleter
    from completiond.config import defaults

    done = suggest(LocalCompleter(bundled), text, len(text) if cursor is None else cursor, defaults(), cancel=None)
    found, gen = done.suggestion, done.generation
    assert gen is not None
    assert found is None or not found.text.startswith((" ", "\t")), found.text


def test_whitespace_healing_is_exact_under_speculation(bundled):
    """Speculative greedy under the whitespace constraint gives plain greedy's tokens."""
    from completiond.completion.prompt import PromptBuilder
    from completiond.config import defaults
    from completiond.engine.engine import SamplingParams

    builder = PromptBuilder.for_engine(bundled, defaults())
    for text in (ETA + " " * 12, ETA + "            days = "):
        prompt = builder.build(text, len(text))
        assert prompt.healing is not None and prompt.healing.removed.endswith(" ")
        runs = []
        for speculative in (False, True):
            gen = bundled.generate(prompt.ids, SamplingParams(max_tokens=24, speculative=speculative),
                                   constraint=prompt.constraint)
            runs.append(list(gen.tokens))
        assert runs[0] == runs[1]
        assert TokenBytes.for_tokenizer(bundled.tokenizer).text(runs[0]).startswith(prompt.healing.removed)
