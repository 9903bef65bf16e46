"""Tiny random models of each supported family, built on the spot (tests, `completiond stress --tiny`).

They carry a small byte-level BPE trained here with the bundled model's special
tokens, so they load through AutoTokenizer and the real prompt pipeline exactly
like real models do. Nothing here touches the network.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_CORPUS = '''def add(a, b):
    return a + b


class Point:
    def __init__(self, x, y):
        self.x = x
        self.y = y

    def norm(self):
        return (self.x ** 2 + self.y ** 2) ** 0.5


for i in range(10):
    print(i, add(i, i))
'''

SPECIAL_TOKENS = ["<|endoftext|>", "<|file_sep|>", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]


def build_tokenizer(directory: Path, vocab_size: int = 400, special_tokens: list[str] | None = None,
                    eos: str = "<|endoftext|>", bos: str | None = None, metaspace: bool = False,
                    tokenizer_class: str | None = None) -> None:
    """A byte-level BPE (GPT-2, Qwen, StarCoder, DeepSeek-Coder) or, with metaspace, a SentencePiece-style
    one with `▁` for spaces (Llama, CodeLlama, Mistral), with the family's special tokens; eos and bos
    must be among them. tokenizer_class is written into tokenizer_config.json as the family's own does."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special_tokens = list(special_tokens or SPECIAL_TOKENS)
    tok = Tokenizer(models.BPE())
    if metaspace:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
        tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
        alphabet = sorted(set(_CORPUS.replace(" ", "\u2581")))
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=eos,
        bos_token=bos,
        additional_special_tokens=[t for t in special_tokens if t not in (eos, bos)],
    )
    fast.save_pretrained(directory)
    if tokenizer_class:
        path = Path(directory) / "tokenizer_config.json"
        data = json.loads(path.read_text(encoding="utf-8"))
        data["tokenizer_class"] = tokenizer_class
        path.write_text(json.dumps(data, indent=2), encoding="utf-8")


def make_tiny_model(directory: Path, family: str = "llama", layers: int = 4, hidden: int = 64, seed: int = 0,
                    dtype: str = "float32", peaked: bool = False, tokenizer: dict | None = None, heads: int = 4,
                    kv_heads: int = 2) -> Path:
    """Write a random tiny model of the given family to `directory`.

    tokenizer: keyword arguments of build_tokenizer (a family's special tokens); its eos and bos
    become the config's. heads, kv_heads: query and KV heads (hidden must divide by heads).

    peaked=True scales the LM head so that logits are far apart: random tiny
    models otherwise have near-tied logits, and a batched and a single-token
    pass (different summation order) could then flip an argmax.
    """
    import torch
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer(directory, **(tokenizer or {}))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(directory)
    vocab = len(tok)
    eos = tok.eos_token_id if tok.eos_token_id is not None else 0
    bos = tok.bos_token_id if tok.bos_token_id is not None else eos
    # Any: each family's config takes these as keywords of several declared types.
    common: dict[str, Any] = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
                  eos_token_id=eos, bos_token_id=bos, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model: transformers.PreTrainedModel
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif family == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    elif family == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**common, sliding_window=None))
    elif family == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=hidden // heads))
    elif family == "starcoder2":  # not a layout the engine runs: its refusal is tested
        model = transformers.Starcoder2ForCausalLM(transformers.Starcoder2Config(**common))
    else:
        raise ValueError(family)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2 if peaked else 0.05)
        if peaked:
            weight = model.get_input_embeddings().weight
            assert isinstance(weight, torch.Tensor)  # typed Tensor | Module through Module.__getattr__
            weight.mul_(3.0)
    model.to(getattr(torch, dtype)).save_pretrained(directory, safe_serialization=True)
    return directory
