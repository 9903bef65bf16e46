"""Byte-level BPE tokenizer of the bundled model, trained on the training split only.

Lossless by construction: no normalizer, ByteLevel pre-tokenizer with
add_prefix_space=False, ByteLevel decoder, and no clean-up of spaces on decode.
Special tokens get the lowest ids, in this order:

    0 <|endoftext|>   end of text; also the end of a FIM middle (eos)
    1 <|file_sep|>    separates files in the training stream
    2 <|fim_prefix|>
    3 <|fim_suffix|>
    4 <|fim_middle|>
    5 <|fim_pad|>     padding (never trained on)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from completiond.models import corpus

EOT = "<|endoftext|>"
FILE_SEP = "<|file_sep|>"
FIM_PREFIX = "<|fim_prefix|>"
FIM_SUFFIX = "<|fim_suffix|>"
FIM_MIDDLE = "<|fim_middle|>"
FIM_PAD = "<|fim_pad|>"
SPECIAL_TOKENS = [EOT, FILE_SEP, FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE, FIM_PAD]
DEFAULT_VOCAB = 8192


def train_tokenizer(texts, vocab_size: int = DEFAULT_VOCAB, show_progress: bool = False):
    """Train and return a `PreTrainedTokenizerFast` on an iterable of strings."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = None
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=show_progress,
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOT,
        pad_token=FIM_PAD,
        additional_special_tokens=SPECIAL_TOKENS[1:],
        clean_up_tokenization_spaces=False,
        model_max_length=1_000_000,
    )
    return fast


def build(out_dir: Path, vocab_size: int = DEFAULT_VOCAB, files=None, show_progress: bool = False):
    """Train on `files` (default: the training split) and save into out_dir."""
    files = corpus.training_files() if files is None else files
    tok = train_tokenizer((f.read_text() for f in files), vocab_size=vocab_size, show_progress=show_progress)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(out_dir)
    return tok


def main(argv=None) -> int:
    from completiond.models import default_model_dir

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, default=default_model_dir())
    p.add_argument("--vocab", type=int, default=DEFAULT_VOCAB)
    a = p.parse_args(argv)
    tok = build(a.out, a.vocab, show_progress=True)
    print(f"saved tokenizer with {len(tok)} tokens to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
