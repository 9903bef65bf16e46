"""Each FIM template renders its family's exact special-token layout.

Tokenizers are trained here on a few lines (no downloads): byte-level BPE for
the GPT-2-style families, a SentencePiece-style (Metaspace) one for
CodeLlama and Codestral, whose prefix carries SentencePiece's leading space.
"""

from __future__ import annotations

import pytest

from completiond.models.fim import FimError, TEMPLATE_NAMES, detect, make_template

CORPUS = ["def add(a, b):\n    return a + b\n", "class P:\n    x = 1\n", "print(add(1, 2))\n"] * 4


def make_tokenizer(tmp_path, specials, eos, bos=None, sentencepiece=False):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    if sentencepiece:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
        alphabet = sorted(set("".join(CORPUS).replace(" ", "▁")))
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials, initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    kw = {"eos_token": eos}
    if bos:
        kw["bos_token"] = bos
    others = [s for s in specials if s not in (eos, bos)]
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, additional_special_tokens=others, **kw)
    path = tmp_path / "tok"
    fast.save_pretrained(path)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


FAMILIES = {
    "completiond": dict(specials=["<|endoftext|>", "<|file_sep|>", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>",
                                  "<|fim_pad|>"], eos="<|endoftext|>"),
    "qwen2.5-coder": dict(specials=["<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                                    "<|repo_name|>", "<|file_sep|>", "<|im_start|>", "<|im_end|>"], eos="<|endoftext|>"),
    "starcoder": dict(specials=["<|endoftext|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>",
                                "<repo_name>", "<file_sep>"], eos="<|endoftext|>"),
    "deepseek-coder": dict(specials=["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜fim▁hole｜>",
                                     "<｜fim▁begin｜>", "<｜fim▁end｜>", "<|EOT|>"],
                           eos="<｜end▁of▁sentence｜>", bos="<｜begin▁of▁sentence｜>"),
    "codellama": dict(specials=["<unk>", "<s>", "</s>", "▁<PRE>", "▁<MID>", "▁<SUF>", "▁<EOT>"], eos="</s>", bos="<s>",
                      sentencepiece=True),
    "codestral": dict(specials=["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[PREFIX]", "[MIDDLE]", "[SUFFIX]"],
                      eos="</s>", bos="<s>", sentencepiece=True),
}


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    return {name: make_tokenizer(tmp_path_factory.mktemp(name.replace(".", "")), **spec) for name, spec in FAMILIES.items()}


def segments(tok, ids):
    """Prompt ids as a list of special-token names and decoded text runs."""
    special = set(tok.all_special_ids)
    out, run = [], []
    for i in ids:
        if i in special:
            if run:
                out.append(tok.decode(run))
                run = []
            out.append(tok.convert_ids_to_tokens(i))
        else:
            run.append(i)
    if run:
        out.append(tok.decode(run))
    return out


PRE, SUF = "def add(a, b):\n    ret", "\nprint(add(1, 2))\n"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_detected_from_vocabulary(toks, name):
    assert detect(toks[name]) == name
    assert make_template(toks[name]).name == name


def test_completiond_spm_layout(toks):
    tok = toks["completiond"]
    t = make_template(tok)
    assert t.spm
    assert segments(tok, t.render(PRE, SUF)) == ["<|fim_prefix|>", "<|fim_suffix|>", SUF, "<|fim_middle|>", PRE]
    assert tok.convert_tokens_to_ids("<|endoftext|>") in t.stop_ids


def test_completiond_psm_layout(toks):
    tok = toks["completiond"]
    t = make_template(tok, "completiond", order="psm")
    assert not t.spm
    assert segments(tok, t.render(PRE, SUF)) == ["<|fim_prefix|>", PRE, "<|fim_suffix|>", SUF, "<|fim_middle|>"]


def test_qwen_is_psm_only_and_stops_on_pad_and_file_sep(toks):
    tok = toks["qwen2.5-coder"]
    t = make_template(tok)
    assert not t.spm
    assert segments(tok, t.render(PRE, SUF)) == ["<|fim_prefix|>", PRE, "<|fim_suffix|>", SUF, "<|fim_middle|>"]
    for name in ("<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>"):
        assert tok.convert_tokens_to_ids(name) in t.stop_ids
    with pytest.raises(FimError, match="SPM"):
        make_template(tok, order="spm")


def test_qwen_repository_context(toks):
    tok = toks["qwen2.5-coder"]
    t = make_template(tok)
    ctx = t.context_ids([("a.py", "x = 1")], current_path="b.py", repo_name="demo")
    assert segments(tok, t.render("y = ", "", ctx)) == [
        "<|repo_name|>", "demo\n", "<|file_sep|>", "a.py\nx = 1\n", "<|file_sep|>", "b.py\n",
        "<|fim_prefix|>", "y = ", "<|fim_suffix|>", "<|fim_middle|>"]


def test_starcoder_spm_layout(toks):
    tok = toks["starcoder"]
    t = make_template(tok)
    assert t.spm
    assert segments(tok, t.render(PRE, SUF)) == ["<fim_prefix>", "<fim_suffix>", SUF, "<fim_middle>", PRE]
    assert segments(tok, make_template(tok, order="psm").render(PRE, SUF)) == [
        "<fim_prefix>", PRE, "<fim_suffix>", SUF, "<fim_middle>"]


def test_deepseek_psm_layout(toks):
    tok = toks["deepseek-coder"]
    t = make_template(tok)
    assert not t.spm
    assert segments(tok, t.render(PRE, SUF)) == ["<｜begin▁of▁sentence｜>", "<｜fim▁begin｜>", PRE, "<｜fim▁hole｜>", SUF,
                                                 "<｜fim▁end｜>"]
    assert tok.convert_tokens_to_ids("<｜end▁of▁sentence｜>") in t.stop_ids


def test_codellama_layouts_and_leading_space(toks):
    tok = toks["codellama"]
    t = make_template(tok)
    assert t.spm
    ids = t.render("def add", "b)\n")
    pieces = tok.convert_ids_to_tokens(ids)
    assert pieces[:3] == ["<s>", "▁<PRE>", "▁<SUF>"]
    mid = pieces.index("▁<MID>")
    # "<PRE> <SUF>{suf} <MID> {pre}": suffix without, prefix with SentencePiece's space.
    assert not pieces[3].startswith("▁")
    assert pieces[mid + 1].startswith("▁")
    psm = make_template(tok, order="psm").render("def add", "b)\n")
    names = tok.convert_ids_to_tokens(psm)
    assert names[:2] == ["<s>", "▁<PRE>"] and names[-1] == "▁<MID>" and "▁<SUF>" in names
    assert tok.convert_tokens_to_ids("▁<EOT>") in t.stop_ids


def test_codestral_suffix_first(toks):
    tok = toks["codestral"]
    t = make_template(tok)
    names = tok.convert_ids_to_tokens(t.render("def add", "b)\n"))
    assert names[:2] == ["<s>", "[SUFFIX]"]
    p = names.index("[PREFIX]")
    assert names[p + 1].startswith("▁") and not names[2].startswith("▁")
    with pytest.raises(FimError):
        make_template(tok, order="psm")


def test_override_by_name_and_missing_tokens(toks, tmp_path):
    tok = toks["completiond"]
    assert make_template(tok, "none").render("abc", "zzz") == tok.encode("abc", add_special_tokens=False)
    with pytest.raises(FimError, match="<fim_prefix>"):
        make_template(tok, "starcoder")
    with pytest.raises(FimError, match="unknown"):
        make_template(tok, "gpt-17")
    assert set(TEMPLATE_NAMES) >= set(FAMILIES) | {"none"}


def test_marker_file_means_bundled_model(toks, tmp_path):
    from completiond.engine.model_info import ModelInfo

    assert ModelInfo.read(tmp_path).fim_template is None
    (tmp_path / "completiond.json").write_text("{}")
    info = ModelInfo.read(tmp_path)
    assert detect(toks["qwen2.5-coder"], info.fim_template) == "completiond"
    assert detect(toks["qwen2.5-coder"], None) == "qwen2.5-coder"
    (tmp_path / "completiond.json").write_text("[not json")   # damaged: still the bundled family, no crash
    assert ModelInfo.read(tmp_path).fim_template == "completiond"


def test_document_text_spelling_a_special_token_stays_text(toks):
    tok = toks["completiond"]
    t = make_template(tok)
    ids = t.render("s = '<|fim_middle|>'", "")
    assert ids.count(tok.convert_tokens_to_ids("<|fim_middle|>")) == 1


def test_pieces_concatenate_without_dummy_space(toks):
    tok = toks["codellama"]
    t = make_template(tok)
    ids = t.encode("def add", first=True) + t.encode("(a, b)")
    assert tok.decode(ids).strip() == "def add(a, b)"
