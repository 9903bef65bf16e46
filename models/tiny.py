"""Tiny random models of each supported family, built on the spot (tests, `completiond stress --tiny`).

They carry a small byte-level BPE trained here with the bundled model's special
tokens, so they load through AutoTokenizer and the real prompt pipeline exactly
like real models do. Nothing here touches the network.
"""

from __future__ import annotations

from pathlib import Path

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


def build_tokenizer(directory: Path, vocab_size: int = 400) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    fast.save_pretrained(directory)


def make_tiny_model(directory: Path, family: str = "llama", layers: int = 4, hidden: int = 64, seed: int = 0,
                    dtype: str = "float32", peaked: bool = False) -> Path:
    """Write a random tiny model of the given family to `directory`.

    peaked=True scales the LM head so that logits are far apart: random tiny
    models otherwise have near-tied logits, and a batched and a single-token
    pass (different summation order) could then flip an argmax.
    """
    import torch
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer(directory)
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(directory))
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                  eos_token_id=0, bos_token_id=0, tie_word_embeddings=True)
    if family == "llama":
        cfg = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    elif family == "mistral":
        cfg = transformers.MistralConfig(**common, sliding_window=None)
        cls = transformers.MistralForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2 if peaked else 0.05)
        if peaked:
            model.get_input_embeddings().weight.mul_(3.0)
    model.to(getattr(torch, dtype)).save_pretrained(directory, safe_serialization=True)
    return directory
