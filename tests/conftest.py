"""Shared fixtures: tiny random models built on the spot, and the bundled model.

Nothing here touches the network. The tiny models get a small byte-level BPE
trained in the test, so they load through AutoTokenizer exactly like real ones.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

# Tests drive tiny models whose ops are too small to gain from threads, and the
# machines that run them are shared: extra threads only wait on each other.
# Set before torch loads, so server subprocesses started by tests inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import pytest

ROOT = Path(__file__).resolve().parent.parent

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


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), family="qwen2", seed=1)


@pytest.fixture(scope="session")
def bundled_model_dir() -> Path:
    from models import default_model_dir

    path = default_model_dir()
    assert (path / "config.json").is_file(), f"bundled model missing at {path}: run `completiond train-default`"
    return path
