"""Prompt builder: cache-friendly layout, budgets, stable window, bounded work, skips."""

from __future__ import annotations

import os

import pytest

from completiond.config import Config
from completiond.completion.healing import TokenHealer
from completiond.completion.prompt import PromptBuilder, PromptOptions
from completiond.engine.model_info import ModelInfo
from completiond.models.fim import make_template
from tests.conftest import build_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("prompt-tok")
    build_tokenizer(d)
    return AutoTokenizer.from_pretrained(d)


@pytest.fixture()
def builder(tok):
    return PromptBuilder(make_template(tok), PromptOptions(prefix_tokens=200, suffix_tokens=60, chunk_lines=8),
                         TokenHealer.for_tokenizer(tok))


def document(n=300):
    return "".join(f"def f{i}(a, b):\n    return a + b * {i}\n" for i in range(n))


def test_spm_prompt_ends_with_the_prefix(tok, builder):
    doc = document(20)
    cur = doc.index("return a + b * 10") + len("return a")
    p = builder.build(doc, cur, heal=False)
    text = tok.decode(p.ids)
    assert text.startswith("<|fim_prefix|><|fim_suffix|>")
    suffix, prefix = text[len("<|fim_prefix|><|fim_suffix|>"):].split("<|fim_middle|>")
    assert doc[:cur].endswith(prefix) and doc[cur:].startswith(suffix)
    assert p.prefix_start == 0 or "\n" in (doc[p.prefix_start - 1], doc[p.prefix_start])


def test_typing_only_appends_tokens(tok, builder):
    doc = document()
    cur = doc.index("return a + b * 150") + len("return a + b")
    first = builder.build(doc, cur, heal=False)
    for ch in " * 1":
        doc = doc[:cur] + ch + doc[cur:]
        cur += 1
        nxt = builder.build(doc, cur, heal=False)
        common = len(os.path.commonprefix([first.ids, nxt.ids]))
        # Everything before the cursor line's tokens is unchanged.
        assert common >= len(first.ids) - first.cursor_line_tokens
        assert nxt.prefix_start == first.prefix_start
        first = nxt


def test_window_start_is_chunk_aligned_and_stable(builder):
    doc = document()
    starts = set()
    line_starts = [i + 1 for i, c in enumerate(doc) if c == "\n"]
    for line_start in line_starts[200:204]:
        p = builder.build(doc, line_start + 4)
        assert p.prefix_line % 8 == 0
        starts.add(p.prefix_start)
    assert len(starts) <= 2  # moving down a few lines jumps at most one chunk


def test_budgets_respected(tok, builder):
    doc = document()
    p = builder.build(doc, len(doc) // 2)
    assert len(p.prefix_ids) <= 200
    assert len(p.suffix_ids) <= 60
    assert len(p.ids) <= 200 + 60 + 3


def test_huge_document_tokenizes_a_bounded_window(tok):
    b = PromptBuilder(make_template(tok), PromptOptions(prefix_tokens=64, suffix_tokens=32))
    doc = document(100_000)   # ~3 MB
    b.build(doc, len(doc) // 2)
    assert b.tokenized_chars < (64 + 32) * 8


def test_skip_reasons(builder):
    assert "binary" in builder.build("abc\x00def", 3).skip_reason
    minified = "var a=1;" * 2000
    assert "minified" in builder.build(minified, 100).skip_reason
    tiny = PromptBuilder(builder.template, PromptOptions(max_document_chars=100))
    assert "too large" in tiny.build("x" * 50 + "\n" * 60, 10).skip_reason
    assert "outside" in builder.build("abc", 7).skip_reason
    assert builder.build("abc", 3).skip_reason is None


def test_pieces_cut_on_the_tokenizers_side_of_the_newline(tok, builder):
    # GPT-2-style BPE merges "\n" with the next line's indentation: the cursor
    # line's piece must start at that newline, or the prompt would end in token
    # sequences the model never saw.
    assert builder.template.split_before_newline
    doc = "class Point:\n    def norm(self):\n        self.x = 1\n"
    cur = doc.index("self.x") + len("self.x")
    p = builder.build(doc, cur, heal=False)
    assert p.prefix_ids == tok.encode(doc[:cur], add_special_tokens=False)


def test_healing_removes_the_partial_word(tok, builder):
    doc = "class P:\n    def norm(self):\n        return self.no\n"
    cur = doc.index("self.no") + len("self.no")
    p = builder.build(doc, cur)
    assert p.healing is not None and "no".endswith(p.healing.removed)
    text = tok.decode(p.ids)
    assert text.endswith("return self." + "no"[: 2 - len(p.healing.removed)])


def test_context_block_at_the_start_of_the_prefix_and_within_budget(tok):
    t = make_template(tok)
    b = PromptBuilder(t, PromptOptions(prefix_tokens=100, suffix_tokens=20, context_tokens=40))
    ctx = [("a.py", "x = 1\n"), ("b.py", "def add(a, b):\n    return a + b\n" * 20)]
    p = b.build("print(x)\n", 6, context=ctx, path="main.py")
    assert 0 < len(p.context_ids) <= 40
    text = tok.decode(p.ids)
    # The bundled model saw FIM samples only from <|fim_prefix|> on, with the code above the cursor after
    # <|fim_middle|>: the block is plain code there, in front of the file's prefix, without separators or
    # paths. The second file does not fit whole: it is shortened by lines.
    assert text.startswith("<|fim_prefix|><|fim_suffix|>x)\n<|fim_middle|>x = 1\ndef add(a, b):\n    return a + b\n")
    assert text.count("def add") < 20 and "<|file_sep|>" not in text and "a.py" not in text
    assert text.endswith("return a + b\nprint(")
    # Same context, next keystroke: the block's ids are identical, and only the cursor line's ids change.
    p1 = b.build("y = 2\nprint(", 12, context=ctx, path="main.py")
    p2 = b.build("y = 2\nprint(x", 13, context=ctx, path="main.py")
    assert p2.context_ids == p1.context_ids == p.context_ids
    assert p2.ids[: len(p1.ids) - p1.cursor_line_tokens] == p1.ids[: len(p1.ids) - p1.cursor_line_tokens]


def test_options_from_config():
    cfg = Config()
    o = PromptOptions.from_config(cfg, max_context=512)
    assert o.prefix_tokens == cfg.prefix_tokens and o.suffix_tokens == cfg.suffix_tokens
    assert o.max_prompt_tokens == 512 - cfg.max_tokens


def test_max_prompt_caps_everything(tok):
    b = PromptBuilder(make_template(tok), PromptOptions(prefix_tokens=1024, suffix_tokens=256, max_prompt_tokens=100))
    doc = document()
    p = b.build(doc, len(doc) // 2)
    assert len(p.ids) <= 100


from hypothesis import given, settings, strategies as st  # noqa: E402

LINES = st.sampled_from(["def f(a, b):", "    return a + b", "", "class P:", "        self.x = x", "print(i)", "\t# ünï", "x = [1, 2,"])


@settings(max_examples=60, deadline=None)
@given(lines=st.lists(LINES, min_size=1, max_size=60), frac=st.floats(0, 1), heal=st.booleans())
def test_pieces_reassemble_the_document(tok, lines, frac, heal):
    b = PromptBuilder(make_template(tok), PromptOptions(prefix_tokens=64, suffix_tokens=24, chunk_lines=4),
                      TokenHealer.for_tokenizer(tok))
    doc = "\n".join(lines) + "\n"
    cur = int(frac * len(doc))
    p = b.build(doc, cur, heal=heal)
    assert p.skip_reason is None
    healed = p.healing.removed if p.healing else ""
    assert tok.decode(p.prefix_ids) + healed == doc[p.prefix_start:cur]
    assert tok.decode(p.suffix_ids) == doc[cur:p.suffix_end]
    assert len(p.prefix_ids) <= 64 and len(p.suffix_ids) <= 24
    assert p.prefix_start == 0 or "\n" in (doc[p.prefix_start - 1], doc[p.prefix_start])


def test_sentencepiece_family_prompt_reassembles(tmp_path):
    from completiond.completion.healing import TokenBytes
    from tests.test_fim import FAMILIES, make_tokenizer

    tok = make_tokenizer(tmp_path, **FAMILIES["codellama"])
    t = make_template(tok)
    b = PromptBuilder(t, PromptOptions(prefix_tokens=80, suffix_tokens=30, chunk_lines=4), TokenHealer(tok))
    doc = "".join(f"def add(a, b):\n    return a + b\nprint(add({1 + i % 2}, 2))\n" for i in range(30))
    cur = doc.index("return a + b", len(doc) // 2) + len("return a + b")
    p = b.build(doc, cur)
    table = TokenBytes.for_tokenizer(tok)
    healed = p.healing.removed if p.healing else ""
    # The first prefix piece carries CodeLlama's leading space ("<PRE> {prefix}").
    assert (table.join(p.prefix_ids).decode() + healed).endswith(doc[p.prefix_start:cur])
    assert table.join(p.prefix_ids).decode().startswith(" ")
    assert table.join(p.suffix_ids).decode() == doc[cur:p.suffix_end]
    names = tok.convert_ids_to_tokens(p.ids)
    assert names[:3] == ["<s>", "▁<PRE>", "▁<SUF>"]


def test_builder_falls_back_when_the_template_setting_does_not_fit(tok):
    from completiond.config import merge
    cfg, _ = merge(Config(), {"fimTemplate": "starcoder"})
    builder = PromptBuilder.for_model(tok, cfg, max_context=512)
    assert builder.template.name == "completiond"
    assert builder.warnings and "starcoder" in builder.warnings[0]
    prompt = builder.build("def add(a, b):\n    return a", 26)
    assert prompt.skip_reason is None and prompt.ids[-1] != tok.convert_tokens_to_ids("<|fim_middle|>")


def test_builder_keeps_prompts_within_the_trained_context(tok, tmp_path):
    (tmp_path / "completiond.json").write_text('{"train_context": 256}')
    builder = PromptBuilder.for_model(tok, Config(), max_context=4096, info=ModelInfo.read(tmp_path))
    assert builder.options.max_prompt_tokens == 256 - Config().max_tokens
    doc = document()
    prompt = builder.build(doc, len(doc) // 2)
    assert len(prompt.ids) + Config().max_tokens <= 256
    assert PromptBuilder.for_model(tok, Config(), max_context=4096).options.max_prompt_tokens == 4096 - Config().max_tokens


def test_context_room_is_reserved_only_with_context(tok):
    b = PromptBuilder(make_template(tok), PromptOptions(prefix_tokens=1024, suffix_tokens=256, context_tokens=256,
                                                        max_prompt_tokens=480))
    assert b.budgets(False)[2] == 0 and b.budgets(False)[0] > b.budgets(True)[0]
    doc = document()
    cur = len(doc) // 2
    big = [("a.py", "def add(a, b):\n    return a + b\n" * 40)]
    p = b.build(doc, cur, context=big)
    assert 0 < len(p.context_ids) <= b.budgets(True)[2]   # shortened, not dropped
    assert len(p.ids) <= 480
    builder = PromptBuilder.for_model(tok, Config(), max_context=512 + Config().max_tokens)
    assert 0 < builder.context_tokens <= Config().context_tokens


def test_psm_family_keeps_everything_before_the_cursor_line(tmp_path):
    from tests.test_fim import FAMILIES, make_tokenizer

    tok = make_tokenizer(tmp_path, **FAMILIES["qwen2.5-coder"])
    t = make_template(tok)
    assert not t.spm
    b = PromptBuilder(t, PromptOptions(prefix_tokens=120, suffix_tokens=30, chunk_lines=4))
    doc = "".join(f"def add(a, b):\n    return a + b\nprint(add({1 + i % 2}, 2))\n" for i in range(40))
    cur = doc.index("return a", len(doc) // 2) + len("return a")
    first = b.build(doc, cur)
    doc2 = doc[:cur] + " +" + doc[cur:]
    second = b.build(doc2, cur + 2)
    common = len(os.path.commonprefix([first.ids, second.ids]))
    head = 1 + len(first.prefix_ids) - first.cursor_line_tokens    # <|fim_prefix|> + whole lines
    assert common >= head
    assert second.suffix_ids == first.suffix_ids
