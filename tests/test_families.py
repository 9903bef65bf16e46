"""Each supported model family in its real config class and tokenizer format, with its FIM tokens
(issue 14, part 1): template detection, the FIM prompt, and greedy identity of the engine's plain,
early-exit and prompt-lookup decoding with transformers' own generate(), token for token.

The models are random and tiny (4 layers, width 64), saved with save_pretrained as the families'
checkpoints are; their tokenizers are small BPEs with each family's special tokens, written with
the tokenizer class the family's tokenizer_config.json names.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from completiond import config
from completiond.completion.prompt import PromptBuilder
from completiond.engine.engine import Engine, EngineError, SamplingParams
from completiond.models.fim import detect
from completiond.models.tiny import make_tiny_model
from tests.conftest import hf_model

QWEN = ["<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
        "<|file_sep|>", "<|im_start|>", "<|im_end|>"]
# case: (config family, build_tokenizer arguments, template detected, the template's first prompt token)
CASES = {
    "qwen2.5-coder": ("qwen2", dict(special_tokens=QWEN, tokenizer_class="Qwen2Tokenizer"), "qwen2.5-coder",
                      "<|fim_prefix|>"),
    "qwen3": ("qwen3", dict(special_tokens=QWEN, tokenizer_class="Qwen2Tokenizer"), "qwen2.5-coder", "<|fim_prefix|>"),
    # DeepSeek-Coder: the Llama architecture with a byte-level tokenizer, tokenizer_config naming LlamaTokenizerFast
    "deepseek-coder": ("llama", dict(special_tokens=["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜fim▁hole｜>",
                                                     "<｜fim▁begin｜>", "<｜fim▁end｜>", "<|EOT|>"],
                                     eos="<｜end▁of▁sentence｜>", bos="<｜begin▁of▁sentence｜>",
                                     tokenizer_class="LlamaTokenizerFast"), "deepseek-coder", "<｜begin▁of▁sentence｜>"),
    "codellama": ("llama", dict(special_tokens=["<unk>", "<s>", "</s>", "▁<PRE>", "▁<MID>", "▁<SUF>", "▁<EOT>"],
                                eos="</s>", bos="<s>", metaspace=True, tokenizer_class="CodeLlamaTokenizer"),
                  "codellama", "<s>"),
    "codestral": ("mistral", dict(special_tokens=["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[PREFIX]", "[MIDDLE]",
                                                  "[SUFFIX]"], eos="</s>", bos="<s>", metaspace=True,
                                  tokenizer_class="LlamaTokenizer"), "codestral", "<s>"),
}
STARCODER = ["<|endoftext|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<repo_name>", "<file_sep>"]

TEXT = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    family, tokenizer, template, first = CASES[request.param]
    path = make_tiny_model(tmp_path_factory.mktemp(request.param.replace(".", "")), family=family, peaked=True,
                           tokenizer=tokenizer)
    return request.param, path, family, template, first


def test_saved_in_the_familys_own_formats(case):
    name, path, family, _template, _first = case
    cfg = json.loads((path / "config.json").read_text())
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    assert cfg["model_type"] == family and cfg["architectures"][0].lower().startswith(family)
    assert tok_cfg["tokenizer_class"] == CASES[name][1]["tokenizer_class"]
    assert sorted(p.name for p in path.glob("*.safetensors")) == ["model.safetensors"]


def test_template_is_detected_and_the_prompt_uses_its_tokens(case):
    name, path, family, template, first = case
    engine = Engine.load(path, device="cpu")
    assert engine.adapter.family == family
    assert detect(engine.tokenizer, engine.info.fim_template) == template
    builder = PromptBuilder.for_engine(engine, config.Config())
    assert builder.template.name == template
    cursor = TEXT.index("return")
    prompt = builder.build(TEXT, cursor)
    tok = engine.tokenizer
    assert prompt.ids[0] == tok.convert_tokens_to_ids(first)
    names = set(tok.convert_ids_to_tokens(prompt.ids))
    fim = {"qwen2.5-coder": {"<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"},
           "deepseek-coder": {"<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"},
           "codellama": {"▁<PRE>", "▁<SUF>", "▁<MID>"},
           "codestral": {"[SUFFIX]", "[PREFIX]"}}[template]
    assert fim <= names, (name, names)
    # the family's end-of-middle token stops generation
    end = {"qwen2.5-coder": "<|endoftext|>", "deepseek-coder": "<｜end▁of▁sentence｜>", "codellama": "▁<EOT>",
           "codestral": "</s>"}[template]
    assert tok.convert_tokens_to_ids(end) in engine.eos_token_ids


def test_greedy_identity_plain_speculative_lookup_and_transformers(case):
    name, path, _family, _template, _first = case
    engine = Engine.load(path, device="cpu")
    prompt = PromptBuilder.for_engine(engine, config.Config()).build(TEXT, TEXT.index("return")).ids
    n = 24
    plain = engine.generate(prompt, SamplingParams(max_tokens=n, speculative=False, ignore_eos=True)).tokens
    early = engine.generate(prompt, SamplingParams(max_tokens=n, exit_layer=2, draft_k=3, prompt_lookup=False,
                                                   ignore_eos=True))
    lookup = engine.generate(prompt, SamplingParams(max_tokens=n, exit_layer=1, draft_k=4, prompt_lookup=True,
                                                    ignore_eos=True))
    with torch.inference_mode():
        # An explicit mask: generate() would otherwise mask every pad_token_id, and id 0 is the BOS of some families.
        ids = torch.tensor([prompt])
        ref = hf_model(engine).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                        eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert len(plain) == n
    assert early.tokens == plain and lookup.tokens == plain and ref == plain, name
    assert early.stats.drafted > 0  # the speculative path really drafted


def test_starcoder2_is_refused_with_the_families_that_load(tmp_path):
    path = make_tiny_model(tmp_path / "sc2", family="starcoder2", tokenizer=dict(special_tokens=STARCODER))
    from transformers import AutoTokenizer

    assert detect(AutoTokenizer.from_pretrained(path)) == "starcoder"
    with pytest.raises(EngineError, match="'starcoder2' model, which the engine cannot run yet; supported families: "
                                          "llama, mistral, qwen2, qwen3"):
        Engine.load(path, device="cpu")


def test_a_local_remote_code_model_is_refused_unless_trusted(tiny_model_dir, tmp_path):
    path = tmp_path / "custom"
    shutil.copytree(tiny_model_dir, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "modeling_custom.py").write_text("raise SystemExit('remote code ran')\n")
    with pytest.raises(EngineError, match="its own Python code \\(modeling_custom.CustomForCausalLM\\)"):
        Engine.load(path, device="cpu")


def test_a_model_too_large_for_the_device_is_reported_before_it_loads(tiny_model_dir, monkeypatch):
    from completiond.engine import memory

    told = []
    monkeypatch.setattr(memory, "available_bytes", lambda device: 1000)
    engine = Engine.load(tiny_model_dir, device="cpu", warn=told.append)
    assert len(told) == 1 and "will probably not fit" in told[0] and "float32" in told[0]
    assert engine.load_warnings == told
    monkeypatch.setattr(memory, "available_bytes", lambda device: 1 << 40)
    assert Engine.load(tiny_model_dir, device="cpu", warn=told.append).load_warnings == []
    # weights that fit beside a KV budget that does not
    msg = memory.fit_warning("m", tiny_model_dir, 4, "float32", "cpu", cache_bytes=1 << 30, available=8 << 20)
    assert "KV cache budget" in msg and "cacheMegabytes" in msg


def test_the_editor_is_told_each_load_warning_once():
    from completiond.lsp.server import CompletionServer

    server = CompletionServer(no_daemon=True)
    shown = []
    server.window_show_message = shown.append
    server.send_status = lambda: None
    server._begin_progress = server._report_progress = lambda *a: None  # no editor connected to show one
    warning = "org/big@0123456789ab will probably not fit: its weights need about 28.0 GiB in float32"
    for state in ("loading", "loading", "ready"):
        server._on_service_notification("status", {"state": state, "model": "org/big@0123456789ab",
                                                   "warnings": [warning]})
    assert [m.message for m in shown] == [f"completiond: {warning}"]
    assert shown[0].type.name == "Warning"
