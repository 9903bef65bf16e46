"""Train the bundled default model: `completiond train-default` (or `python -m completiond.models.training.train_default`).

Stages of one model's life, all from the same run directory, which you name with --run-dir. It
holds the checkpoint (weights, AdamW state: three times the model), so it lives outside the
checkout: a run directory inside this repository is refused unless --run-dir-in-checkout.

    --prepare      download the third-party packages, filter, de-duplicate and pre-tokenise
                   everything once into runs/data/ (models/training/data_prep.py); also done
                   automatically when a run starts without prepared data
    (no flag)      start a new run: a planned total of --total-tokens with one warmup + cosine
                   schedule over it; this invocation stops after --minutes (or at the total)
    --resume       continue the run exactly from its checkpoint (weights, AdamW state, data
                   position, schedule, RNG states)
    --probe        scaling probe: a few sizes, equal minutes each, same data; held-out loss
    --export       write the model directory (default models/completiond-py-mini/) from the
                   checkpoint and regenerate its model card; refuses to replace a model that is
                   better on held-out loss unless --force

The run checkpoints every --save-every-min minutes and on SIGTERM/SIGINT (after the step in
flight), so stopping it loses at most that much. Stop: `kill -TERM` the trainer's process.

Data: memory-mapped uint16 token streams (runs/data/*.u16). A training sample is the next chunk
of seq_len+1 tokens of an epoch-wise permutation of the training stream; the data position is
(epoch, index). Tokenizer: the 8k byte-level BPE of the shipped model (models/training/tokenizer_build.py),
kept so the engine's and FIM code's special tokens stay valid.

Model: a plain `LlamaForCausalLM` with tied embeddings. Recipe (LayerSkip, Elhoushi et al. 2024,
with self-distillation and fill-in-the-middle):

* layer dropout rising linearly with depth, p_l = p_max * l / (L-1), per sample, training only;
* early-exit loss: the hidden state after layer l through the shared final norm and tied LM
  head; weights w_l = e_scale * sum_{i<=l} i for l < L-1 and w_{L-1} = L-1. On a CPU budget the
  intermediate exits are scored on a random --exit-frac of positions, and only the exits the
  engine drafts from (--draft-exits, 1-based, default 2,3,4) plus --rotating-exits others chosen
  at random each step (LayerSkip's rotational curriculum) are scored;
* self-distillation: each scored early exit is also trained toward the final layer's detached
  distribution, KL(p_final || p_exit) on the same positions, weight 1 for the draft exits and
  --distill-other for the rest, times --distill;
* FIM on --fim-rate of the samples, --spm-rate of them in SPM order (models/fim.py layouts). The
  middle always ends at a line boundary (before the newline) or at a block boundary, a share is
  empty, and every middle is closed with <|endoftext|> (never truncated away):

      PSM: <|fim_prefix|>PREFIX<|fim_suffix|>SUFFIX<|fim_middle|>MIDDLE<|endoftext|>
      SPM: <|fim_prefix|><|fim_suffix|>SUFFIX<|fim_middle|>PREFIX MIDDLE<|endoftext|>

Precision: bf16 autocast on GPU; on CPU a short probe (<= 20 s) picks the faster of float32
and bf16 autocast (CPUs without native bf16 emulate it, several times slower).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# Under CPU contention (other jobs on the same cores) libgomp's spinning
# barriers make multi-threaded torch several times slower; passive waiting
# avoids that. Must be set before torch starts its OpenMP pool.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

DEFAULTS = dict(hidden=192, layers=10, heads=3, kv_heads=3, intermediate=512, seq_len=512,
                batch_size=8, lr=2e-3, min_lr_ratio=0.1, warmup=100, weight_decay=0.1,
                layer_dropout=0.1, exit_scale=0.1, exit_frac=0.125, fim_rate=0.5, spm_rate=0.5,
                empty_middle=0.1, distill=0.3, distill_other=0.1, rotating_exits=2, total_tokens=40_000_000,
                draft_exits="2,3,4")
# The distillation knobs a resumed run may change (recorded on the stage that changed them): they weight
# losses, not shapes or data, so the checkpoint's weights, optimiser and data position stay valid.
RESUME_RECIPE = ("distill", "distill_other", "draft_exits")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
SPECIALS = ("<|endoftext|>", "<|file_sep|>", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from completiond.models import default_model_dir

    d = DEFAULTS
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--prepare", action="store_true", help="download + pre-tokenise the data, then stop")
    mode.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its checkpoint")
    mode.add_argument("--probe", action="store_true", help="scaling probe over --probe-sizes")
    mode.add_argument("--export", action="store_true", help="write --out from the run's checkpoint + model card")
    parser.add_argument("--run-dir", type=Path, default=None,
                        help="checkpoint and log of the run: a directory you name, outside the checkout")
    parser.add_argument("--run-dir-in-checkout", action="store_true",
                        help="accept a --run-dir inside this repository's checkout (its checkpoints must never be committed)")
    parser.add_argument("--data", type=Path, default=Path("runs/data"), help="prepared token streams")
    parser.add_argument("--tokenizer", type=Path, default=default_model_dir(),
                        help="directory with the tokenizer files the model uses")
    parser.add_argument("--packages", type=Path, default=None,
                        help="package list for --prepare (default models/training/train_packages.txt); 'none': stdlib only")
    parser.add_argument("--out", type=Path, default=default_model_dir(), help="model directory --export writes")
    parser.add_argument("--force", action="store_true", help="--export even if --out holds a better model")
    parser.add_argument("--no-card", action="store_true", help="--export without regenerating the model card")
    parser.add_argument("--total-tokens", type=int, default=None,
                        help=f"planned total of the run, the span of its cosine schedule (new run: default "
                             f"{d['total_tokens']:,}; with --resume: extends the plan, re-stretching the rest of the cosine)")
    parser.add_argument("--minutes", type=float, default=0.0, help="stop this invocation after this long (0: no limit)")
    parser.add_argument("--max-steps", type=int, default=0, help="stop this invocation at this global step (0: none)")
    parser.add_argument("--hidden", type=int, default=d["hidden"])
    parser.add_argument("--layers", type=int, default=d["layers"])
    parser.add_argument("--heads", type=int, default=d["heads"])
    parser.add_argument("--kv-heads", type=int, default=d["kv_heads"])
    parser.add_argument("--intermediate", type=int, default=d["intermediate"])
    parser.add_argument("--seq-len", type=int, default=d["seq_len"])
    parser.add_argument("--batch-size", type=int, default=d["batch_size"])
    parser.add_argument("--lr", type=float, default=d["lr"])
    parser.add_argument("--min-lr-ratio", type=float, default=d["min_lr_ratio"])
    parser.add_argument("--warmup", type=int, default=d["warmup"], help="warmup steps")
    parser.add_argument("--weight-decay", type=float, default=d["weight_decay"])
    parser.add_argument("--layer-dropout", type=float, default=d["layer_dropout"], help="max layer dropout (last layer)")
    parser.add_argument("--exit-scale", type=float, default=d["exit_scale"], help="LayerSkip e_scale")
    parser.add_argument("--exit-frac", type=float, default=d["exit_frac"],
                        help="fraction of positions scored at the intermediate exits each step")
    parser.add_argument("--draft-exits", default=None,
                        help=f"1-based exits the engine drafts from (default {d['draft_exits']}; with --resume: "
                             f"changes the checkpoint's from this stage on)")
    parser.add_argument("--rotating-exits", type=int, default=d["rotating_exits"],
                        help="other early exits scored per step, chosen at random")
    parser.add_argument("--distill", type=float, default=None,
                        help=f"weight of the exit KL toward the final layer (default {d['distill']}; with --resume: "
                             f"changes the checkpoint's from this stage on)")
    parser.add_argument("--distill-other", type=float, default=None,
                        help=f"relative KL weight of exits that are not draft exits (default {d['distill_other']}; "
                             f"with --resume: changes the checkpoint's from this stage on)")
    parser.add_argument("--fim-rate", type=float, default=d["fim_rate"])
    parser.add_argument("--spm-rate", type=float, default=d["spm_rate"], help="share of FIM samples in SPM order")
    parser.add_argument("--empty-middle", type=float, default=d["empty_middle"], help="share of FIM middles that are empty")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--precision", default="auto", help="auto (probe), fp32 or bf16")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--eval-every", type=int, default=150, help="held-out evaluation every N steps (0: never)")
    parser.add_argument("--eval-windows", type=int, default=16, help="held-out windows per split per evaluation")
    parser.add_argument("--save-every-min", type=float, default=15.0, help="checkpoint this often (minutes)")
    parser.add_argument("--probe-sizes", default="128x8x384,192x10x512,256x12x704",
                        help="comma-separated HIDDENxLAYERSxINTERMEDIATE (64-wide heads)")
    parser.add_argument("--probe-minutes", type=float, default=4.5, help="minutes per probe size")
    parser.add_argument("--no-progress", action="store_true", help="no per-log line on stdout")


# ----------------------------------------------------------------------------- tokenizer

def load_tokenizer(tokenizer_dir: Path):
    """(tokenizers.Tokenizer, ids of the special tokens) from a model/tokenizer directory."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    ids = {}
    for name in SPECIALS:
        i = tok.token_to_id(name)
        if i is None:
            raise ValueError(f"{tokenizer_dir}/tokenizer.json lacks the special token {name}")
        ids[name] = i
    return tok, ids


# ----------------------------------------------------------------------------- FIM

def _line_bounds(text: str) -> list[int]:
    """Offsets of every newline character, plus len(text) (the end of the last line)."""
    out = [i for i, c in enumerate(text) if c == "\n"]
    if not out or out[-1] != len(text):
        out.append(len(text))
    return out


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" \t"))


def fim_split(text: str, rng, empty_share: float) -> tuple[str, str, str]:
    """(prefix, middle, suffix) with prefix + middle + suffix == text.

    The middle ends where an editor's completion should stop: before a newline (line and block
    middles) or where the rest of the cursor's line begins (in-line middles). Kinds:

    * empty (empty_share): the cursor at the end of a line, nothing missing;
    * lines: from the cursor (end of a line, or inside it) through 0-3 further lines;
    * block: from the end of a line to the end of the indented block that follows it
      (a function or loop body: what the function-body benchmark removes);
    * in-line: a span inside one line, the rest of the line in the suffix.
    """
    n = len(text)
    nls = _line_bounds(text)  # end offsets of lines
    if n == 0:
        return "", "", ""
    li = int(rng.integers(0, len(nls)))
    line_end = nls[li]
    line_start = nls[li - 1] + 1 if li > 0 else 0
    u = float(rng.random())
    if u < empty_share:
        return text[:line_end], "", text[line_end:]
    u = (u - empty_share) / (1 - empty_share)
    if u < 0.45:
        # cursor at the end of the line (before its newline) half the time, else inside the line
        a = line_end if rng.random() < 0.5 else int(rng.integers(line_start, line_end + 1))
        k = min(3, int(rng.geometric(0.5)) - 1)  # further lines: 0 (p=.5), 1, 2, 3
        b = nls[min(len(nls) - 1, li + k + (1 if a == line_end else 0))]
        return text[:a], text[a:b], text[b:]
    if u < 0.85:
        # block: the lines after line li that are indented deeper than it (or, if it opens no
        # block, the lines at its own indentation up to a dedent), cut before the newline that
        # precedes the first line outside it
        lines = text[line_start:].split("\n")
        base = _indent(lines[0])
        deeper = len(lines) > 1 and lines[1].strip() and _indent(lines[1]) > base
        j = 1
        while j < len(lines):
            ln = lines[j]
            if ln.strip():
                ind = _indent(ln)
                if (deeper and ind <= base) or (not deeper and ind < base):
                    break
            j += 1
        # drop trailing blank lines from the block, and never take more than 12 lines
        while j > 1 and not lines[j - 1].strip():
            j -= 1
        j = min(j, 1 + 12)
        b = nls[min(len(nls) - 1, li + max(1, j - 1))]
        a = line_end
        return text[:a], text[a:b], text[b:]
    # in-line: a span inside the line; the rest of the line is in the suffix
    if line_end > line_start:
        a = int(rng.integers(line_start, line_end))
        b = int(rng.integers(a + 1, line_end + 1))
        return text[:a], text[a:b], text[b:]
    # a blank line has no inside: take the line after it
    b = nls[min(len(nls) - 1, li + 1)]
    return text[:line_end], text[line_end:b], text[b:]


def fim_layout(ids: dict, prefix: list[int], middle: list[int], suffix: list[int], spm: bool,
               max_len: int | None = None) -> list[int]:
    """Token ids of one FIM sample. With max_len, the suffix's end and then the prefix's start are
    trimmed so that the middle and its closing <|endoftext|> always fit."""
    p, m, s = list(prefix), list(middle), list(suffix)
    if max_len is not None:
        over = 4 + len(p) + len(m) + len(s) - max_len
        if over > 0:
            cut = min(over, len(s))
            s = s[: len(s) - cut]
            over -= cut
        if over > 0:
            p = p[min(over, len(p)):]
            over -= min(over, len(prefix))
        if over > 0:
            raise ValueError(f"a middle of {len(m)} tokens does not fit a sample of {max_len}")
    P, S, M, E = ids["<|fim_prefix|>"], ids["<|fim_suffix|>"], ids["<|fim_middle|>"], ids["<|endoftext|>"]
    if spm:
        return [P, S] + s + [M] + p + m + [E]
    return [P] + p + [S] + s + [M] + m + [E]


# ----------------------------------------------------------------------------- data

class Sampler:
    """Training batches from the memory-mapped stream. Its whole state is (epoch, index, rng state),
    so a resumed run draws exactly the batches an uninterrupted one would."""

    def __init__(self, stream, docs, tok, ids: dict, seq_len: int, fim_rate: float, spm_rate: float,
                 empty_middle: float, seed: int):
        import numpy as np

        self.stream, self.docs, self.tok, self.ids = stream, docs, tok, ids
        self.seq_len, self.fim_rate, self.spm_rate, self.empty_middle = seq_len, fim_rate, spm_rate, empty_middle
        self.seed = seed
        self.n_chunks = (len(stream) - 1) // seq_len
        if self.n_chunks < 1:
            raise ValueError(f"training stream of {len(stream)} tokens is shorter than one sample of {seq_len + 1}")
        self.epoch, self.index = 0, 0
        self.rng = np.random.default_rng([seed, 1])
        self._perm: np.ndarray | None = None

    def state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "rng": self.rng.bit_generator.state}

    def load_state(self, st: dict) -> None:
        self.epoch, self.index = int(st["epoch"]), int(st["index"])
        self.rng.bit_generator.state = st["rng"]
        self._perm = None

    def _next_chunk(self) -> int:
        import numpy as np

        if self.index >= self.n_chunks:
            self.epoch += 1
            self.index = 0
            self._perm = None
        if self._perm is None:
            self._perm = np.random.default_rng([self.seed, 2, self.epoch]).permutation(self.n_chunks)
        c = int(self._perm[self.index])
        self.index += 1
        return c * self.seq_len

    def _plain(self, start: int):
        seq = self.stream[start:start + self.seq_len + 1].astype("int64").tolist()
        return seq, [1] * len(seq)

    def _fim(self, start: int):
        import numpy as np

        i = int(np.searchsorted(self.docs, start, side="right")) - 1
        doc_end = int(self.docs[i + 1]) - 1  # without the trailing <|file_sep|>
        width = self.seq_len - 24  # room for the sentinels and re-tokenisation at the cuts
        end = min(doc_end, start + width)
        s0 = max(int(self.docs[i]), end - width)
        text = self.tok.decode(self.stream[s0:end].astype("int64").tolist(), skip_special_tokens=False)
        prefix, middle, suffix = fim_split(text, self.rng, self.empty_middle)
        p, m, s = (e.ids if t else [] for e, t in zip(self.tok.encode_batch([prefix or " ", middle or " ", suffix or " "],
                                                                            add_special_tokens=False),
                                                   (prefix, middle, suffix)))
        seq = fim_layout(self.ids, p, m, s, spm=bool(self.rng.random() < self.spm_rate), max_len=self.seq_len + 1)
        mask = [1] * len(seq)
        pad = self.seq_len + 1 - len(seq)
        return seq + [self.ids["<|fim_pad|>"]] * pad, mask + [0] * pad

    def batch(self, bsz: int):
        seqs, masks = [], []
        for _ in range(bsz):
            start = self._next_chunk()
            fim = self.rng.random() < self.fim_rate
            seq, mask = self._fim(start) if fim else self._plain(start)
            seqs.append(seq)
            masks.append(mask)
        return to_batch(seqs, masks)


def to_batch(seqs: list[list[int]], masks: list[list[int]]):
    """(inputs, labels) of equal-length samples [B, T+1]: labels are the next tokens, -100 where the
    mask says padding."""
    import torch

    x = torch.tensor(seqs, dtype=torch.long)
    m = torch.tensor(masks, dtype=torch.bool)
    labels = x[:, 1:].clone()
    labels[~m[:, 1:]] = -100
    return x[:, :-1].contiguous(), labels


def stream_windows(stream, seq_len: int, count: int, seed: int = 1234):
    """Fixed plain windows of a token stream (deterministic): the held-out evaluation windows.
    Same windows as `heldout_windows` on the same files."""
    import torch

    rng = random.Random(seed)
    n = seq_len + 1
    starts = sorted(rng.randrange(0, max(1, len(stream) - n)) for _ in range(count))
    x = torch.tensor([[int(t) for t in stream[s:s + n]] for s in starts], dtype=torch.long)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def heldout_windows(tok, files, seq_len: int, count: int, seed: int = 1234):
    """Fixed plain windows from held-out files (an HF tokenizer; files joined with <|file_sep|>)."""
    sep = tok.convert_tokens_to_ids("<|file_sep|>")
    stream = []
    for f in files:
        stream.extend(tok(f.read_text(), add_special_tokens=False)["input_ids"])
        stream.append(sep)
    return stream_windows(stream, seq_len, count, seed)


# ----------------------------------------------------------------------------- model

def layer_weights(num_layers: int, e_scale: float) -> list[float]:
    """LayerSkip early-exit loss weights, normalized to sum to 1 (index = layer)."""
    w = [e_scale * sum(range(l + 1)) for l in range(num_layers - 1)] + [float(num_layers - 1)]
    total = sum(w)
    return [v / total for v in w]


def forward_all_exits(model, input_ids, layer_drop: list[float] | None = None, exit_positions=None):
    """Run the decoder layer by layer. Returns (final_logits, [hidden_l[:, exit_positions] for l < L-1]).

    With layer_drop (training), layer l is skipped per sample with probability layer_drop[l].
    Attention is causal through SDPA (no mask tensor: sequences are unpadded-left).
    """
    import torch

    inner = model.model
    h = inner.embed_tokens(input_ids)
    pos = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
    pe = inner.rotary_emb(h, position_ids=pos)
    exits = []
    n = len(inner.layers)
    for i, layer in enumerate(inner.layers):
        out = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe)
        if layer_drop is not None and layer_drop[i] > 0:
            keep = torch.rand(h.shape[0], 1, 1, device=h.device) >= layer_drop[i]
            h = torch.where(keep, out, h)
        else:
            h = out
        if i < n - 1 and exit_positions is not None:
            exits.append(h[:, exit_positions])
    logits = model.lm_head(inner.norm(h))
    return logits, exits


def exit_losses(model, input_ids, labels):
    """Per-layer mean CE for every exit, final layer last. No dropout."""
    import torch
    import torch.nn.functional as F

    with torch.no_grad():
        logits, exits = forward_all_exits(model, input_ids, None, slice(None))
        out = []
        for h in exits:
            lg = model.lm_head(model.model.norm(h)).float()
            out.append(F.cross_entropy(lg.reshape(-1, lg.shape[-1]), labels.reshape(-1), ignore_index=-100).item())
        out.append(F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                   ignore_index=-100).item())
    return out


def model_config(arch: dict, ids: dict, vocab: int):
    from transformers import LlamaConfig

    # Declared keywords in transformers 4.x, taken through **kwargs in 5.x: passed as a dict so that the
    # call type-checks against either.
    legacy: dict[str, Any] = {"rope_theta": 10000.0, "attn_implementation": "sdpa"}
    return LlamaConfig(
        vocab_size=vocab, hidden_size=arch["hidden"], intermediate_size=arch["intermediate"],
        num_hidden_layers=arch["layers"], num_attention_heads=arch["heads"], num_key_value_heads=arch["kv_heads"],
        max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|endoftext|>"], pad_token_id=ids["<|fim_pad|>"],
        attention_dropout=0.0, initializer_range=0.02, **legacy,
    )


def build_model(arch: dict, ids: dict, vocab: int, seed: int):
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(model_config(arch, ids, vocab))
    model.config._attn_implementation = "sdpa"
    return model


def pick_precision(model, device: str, seq_len: int, wanted: str = "auto", budget_s: float = 20.0) -> tuple[str, dict]:
    """'bf16' or 'fp32' and the probe's timings. GPU: bf16. CPU: time a few training steps in each."""
    import torch

    if wanted in ("fp32", "bf16"):
        return wanted, {"chosen_by": "flag"}
    if device != "cpu":
        return "bf16", {"chosen_by": "device"}
    x = torch.randint(6, model.config.vocab_size, (1, min(seq_len, 256)))
    timings = {}
    deadline = time.time() + budget_s
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for mode in ("fp32", "bf16"):
        best = None
        for _ in range(3):
            if time.time() > deadline:
                break
            t = time.time()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=(mode == "bf16")):
                loss = model(x, labels=x).loss
            loss.backward()
            dt = time.time() - t
            best = dt if best is None else min(best, dt)
        model.zero_grad(set_to_none=True)
        timings[mode] = best
    model.load_state_dict(saved)
    fp32, bf16 = timings["fp32"], timings["bf16"]
    chosen = "bf16" if (bf16 is not None and fp32 is not None and bf16 < 0.9 * fp32) else "fp32"
    return chosen, {"chosen_by": "probe", "step_seconds": timings}


# ----------------------------------------------------------------------------- trainer

class Trainer:
    """One model, its optimizer, schedule and sampler; save/load give an exact resume."""

    def __init__(self, cfg: dict, data, tok, ids: dict, device: str, precision: str | None = None, log=print,
                 sampler=None):
        """sampler: where batches come from (anything with batch/state/load_state); by default the base
        run's Sampler over data's training stream (data may then be None)."""
        import numpy as np
        import torch

        self.cfg, self.data, self.tok, self.ids, self.device, self.log = cfg, data, tok, ids, device, log
        arch = cfg["arch"]
        self.model = build_model(arch, ids, tok.get_vocab_size(), cfg["seed"]).to(device)
        self.L = arch["layers"]
        self.weights = layer_weights(self.L, cfg["exit_scale"])
        self.drop = [cfg["layer_dropout"] * l / (self.L - 1) for l in range(self.L)] if self.L > 1 else [0.0]
        self.draft_exits = [e - 1 for e in cfg["draft_exits"] if 1 <= e < self.L]  # 0-based exit indices
        decay = [p for n, p in self.model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in self.model.named_parameters() if p.dim() < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg["weight_decay"]},
                                      {"params": no_decay, "weight_decay": 0.0}],
                                     lr=cfg["lr"], betas=(0.9, 0.95), eps=1e-8, fused=(device == "cuda"))
        self.sampler = sampler if sampler is not None else Sampler(
            data.streams["train"], data.docs["train"], tok, ids, cfg["seq_len"], cfg["fim_rate"], cfg["spm_rate"],
            cfg["empty_middle"], cfg["seed"])
        self.step, self.tokens, self.seconds = 0, 0, 0.0
        self.stages: list[dict] = []
        if precision is None:
            precision, info = pick_precision(self.model, device, cfg["seq_len"], cfg.get("precision", "auto"))
            self.precision_info = info
        else:
            self.precision_info = {"chosen_by": "caller"}
        self.precision = precision
        self.n_exit = max(1, int(round(cfg["exit_frac"] * cfg["seq_len"])))
        self.acc = np.zeros(self.L)
        self.acc_n = np.zeros(self.L)
        self.acc_kl = 0.0
        self.acc_steps = 0
        self.last_exit = [float("nan")] * self.L

    @property
    def total_steps(self) -> int:
        return max(1, math.ceil(self.cfg["total_tokens"] / (self.cfg["batch_size"] * self.cfg["seq_len"])))

    def lr_at(self, step: int) -> float:
        c = self.cfg
        if step < c["warmup"]:
            return c["lr"] * (step + 1) / c["warmup"]
        fr = min(1.0, (step - c["warmup"]) / max(1, self.total_steps - c["warmup"]))
        return c["lr"] * (c["min_lr_ratio"] + (1 - c["min_lr_ratio"]) * 0.5 * (1 + math.cos(math.pi * fr)))

    def autocast(self):
        import torch

        return torch.autocast(device_type=self.device, dtype=torch.bfloat16, enabled=self.precision == "bf16")

    def scored_exits(self) -> list[int]:
        import torch

        others = [l for l in range(self.L - 1) if l not in self.draft_exits]
        k = min(self.cfg["rotating_exits"], len(others))
        pick = sorted(others[i] for i in torch.randperm(len(others))[:k].tolist()) if k else []
        return sorted(set(self.draft_exits) | set(pick))

    def train_step(self, lr_override: float | None = None) -> dict:
        import torch
        import torch.nn.functional as F

        c = self.cfg
        lr = self.lr_at(self.step) if lr_override is None else lr_override
        for g in self.opt.param_groups:
            g["lr"] = lr
        x, y = self.sampler.batch(c["batch_size"])
        x, y = x.to(self.device), y.to(self.device)
        pos = torch.randperm(c["seq_len"], device=self.device)[: self.n_exit].sort().values
        scored = self.scored_exits()
        self.model.train()
        with self.autocast():
            logits, exits = forward_all_exits(self.model, x, self.drop, pos)
            final = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100)
            per_layer = {}
            kl = torch.zeros((), device=self.device)
            if scored:
                hs = torch.stack([exits[l] for l in scored])  # (S, B, P, H)
                lg = self.model.lm_head(self.model.model.norm(hs)).float()
                yy = y[:, pos]
                valid = (yy != -100).float()
                nvalid = valid.sum().clamp(min=1)
                logp = F.log_softmax(lg, dim=-1)
                ce = -logp.gather(-1, yy.clamp(min=0).unsqueeze(0).expand(len(scored), -1, -1).unsqueeze(-1)).squeeze(-1)
                ce = (ce * valid).sum((1, 2)) / nvalid
                teacher = F.log_softmax(logits[:, pos].detach().float(), dim=-1)
                kl_each = (teacher.exp() * (teacher - logp)).sum(-1)  # (S, B, P)
                kl_each = (kl_each * valid).sum((1, 2)) / nvalid
                dw = torch.tensor([1.0 if l in self.draft_exits else c["distill_other"] for l in scored],
                                  device=self.device)
                kl = (dw * kl_each).sum() / dw.sum()
                for i, l in enumerate(scored):
                    per_layer[l] = ce[i]
            w_final = self.weights[-1]
            w_sum = w_final + sum(self.weights[l] for l in scored)
            total = (w_final * final + sum(self.weights[l] * per_layer[l] for l in scored)) / w_sum
            total = total + c["distill"] * kl
        self.opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.step += 1
        self.tokens += int((y != -100).sum())
        self.acc[-1] += float(final.detach())
        self.acc_n[-1] += 1
        for l, v in per_layer.items():
            self.acc[l] += float(v.detach())
            self.acc_n[l] += 1
        self.acc_kl += float(kl.detach())
        self.acc_steps += 1
        return {"lr": lr, "loss": float(final.detach()), "kl": float(kl.detach())}

    def take_log_record(self, lr: float) -> dict:
        import numpy as np

        mean = []
        for l in range(self.L):
            if self.acc_n[l]:
                self.last_exit[l] = float(self.acc[l] / self.acc_n[l])
            mean.append(round(self.last_exit[l], 4) if not math.isnan(self.last_exit[l]) else None)
        rec = {"step": self.step, "tokens": self.tokens, "elapsed": round(self.seconds, 1), "lr": lr,
               "loss": mean[-1], "exit_losses": mean, "distill_kl": round(self.acc_kl / max(1, self.acc_steps), 4)}
        self.acc = np.zeros(self.L)
        self.acc_n = np.zeros(self.L)
        self.acc_kl, self.acc_steps = 0.0, 0
        return rec

    def evaluate(self, windows: dict) -> dict:
        """Held-out mean CE per exit for each split's fixed windows."""
        out = {}
        self.model.eval()
        with self.autocast():
            for name, (x, y) in windows.items():
                sums = None
                for i in range(0, x.shape[0], 4):
                    v = exit_losses(self.model, x[i:i + 4].to(self.device), y[i:i + 4].to(self.device))
                    n = x[i:i + 4].shape[0]
                    sums = [a * n for a in v] if sums is None else [s + a * n for s, a in zip(sums, v)]
                if sums is None:
                    raise ValueError(f"no held-out windows for {name}")
                out[name] = [round(s / x.shape[0], 4) for s in sums]
        self.model.train()
        return out

    # -- checkpoint ------------------------------------------------------------
    def state(self) -> dict:
        import numpy as np
        import torch

        return {"format": 1, "cfg": self.cfg, "model": self.model.state_dict(), "opt": self.opt.state_dict(),
                "step": self.step, "tokens": self.tokens, "seconds": self.seconds, "stages": self.stages,
                "sampler": self.sampler.state(), "torch_rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                "precision": self.precision, "precision_info": self.precision_info,
                "last_exit": self.last_exit, "numpy_version": np.__version__, "torch_version": torch.__version__}

    def save(self, path: Path) -> None:
        import torch

        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        torch.save(self.state(), tmp)
        if path.exists():
            path.replace(path.with_name(path.stem + ".prev" + path.suffix))
        tmp.replace(path)

    def load_state(self, st: dict) -> None:
        import torch

        self.model.load_state_dict(st["model"])
        self.opt.load_state_dict(st["opt"])
        self.step, self.tokens, self.seconds = st["step"], st["tokens"], st["seconds"]
        self.stages = list(st.get("stages", []))
        self.sampler.load_state(st["sampler"])
        torch.set_rng_state(st["torch_rng"])
        if st.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(st["cuda_rng"])
        self.last_exit = list(st.get("last_exit", self.last_exit))


def load_checkpoint(path: Path) -> dict:
    import torch

    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}: start a run first (without --resume)")
    # the checkpoint holds numpy RNG state and plain Python containers besides tensors
    return torch.load(path, map_location="cpu", weights_only=False)


# ----------------------------------------------------------------------------- commands

def _parse_exits(text) -> list[int]:
    try:
        exits = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--draft-exits {text!r}: expected 1-based layer numbers separated by commas") from None
    if not exits or min(exits) < 1:
        raise ValueError(f"--draft-exits {text!r}: expected at least one layer number >= 1")
    return exits


def _recipe_from_args(a: argparse.Namespace, fill_defaults: bool) -> dict:
    """The RESUME_RECIPE values given on the command line (all of them, defaults filled, for a new run)."""
    given = {k: getattr(a, k, None) for k in RESUME_RECIPE}
    if fill_defaults:
        given = {k: DEFAULTS[k] if v is None else v for k, v in given.items()}
    out = {k: v for k, v in given.items() if v is not None}
    if "draft_exits" in out:
        out["draft_exits"] = _parse_exits(out["draft_exits"])
    return out


def _cfg_from_args(a: argparse.Namespace) -> dict:
    return {
        "arch": {"hidden": a.hidden, "layers": a.layers, "heads": a.heads, "kv_heads": a.kv_heads,
                 "intermediate": a.intermediate},
        "seq_len": a.seq_len, "batch_size": a.batch_size, "lr": a.lr, "min_lr_ratio": a.min_lr_ratio,
        "warmup": a.warmup, "weight_decay": a.weight_decay, "layer_dropout": a.layer_dropout,
        "exit_scale": a.exit_scale, "exit_frac": a.exit_frac,
        **_recipe_from_args(a, fill_defaults=True),
        "rotating_exits": a.rotating_exits,
        "fim_rate": a.fim_rate, "spm_rate": a.spm_rate, "empty_middle": a.empty_middle, "seed": a.seed,
        "total_tokens": a.total_tokens or DEFAULTS["total_tokens"], "precision": a.precision,
    }


def _device(a) -> str:
    import torch

    return ("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device


def _ensure_data(a, log=print):
    from . import data_prep

    if not (a.data / "manifest.json").is_file():
        log(f"no prepared data in {a.data}: preparing it (download + pre-tokenise)")
        _prepare(a, log)
    data = data_prep.TokenData(a.data)
    data.check_tokenizer(a.tokenizer)
    return data


def _prepare(a, log=print) -> dict:
    from . import data_prep

    pk = a.packages
    packages_file = None if (pk is not None and str(pk) == "none") else (pk or data_prep.PACKAGES_FILE)
    return data_prep.prepare(a.data, a.tokenizer, packages_file=packages_file, log=log)


def eval_windows(data, seq_len: int, count: int) -> dict:
    out = {"stdlib": stream_windows(data.streams["heldout_stdlib"], seq_len, count)}
    if len(data.streams["heldout_packages"]) > seq_len + 1:
        out["packages"] = stream_windows(data.streams["heldout_packages"], seq_len, count)
    return out


def train(a: argparse.Namespace, log=print) -> int:
    import torch

    torch.set_num_threads(a.threads)
    device = _device(a)
    run: Path = a.run_dir
    ckpt = run / "ckpt.pt"
    tok_dir = run / "tokenizer"
    if a.resume:
        st = load_checkpoint(ckpt)
        cfg = st["cfg"]
        if a.total_tokens and a.total_tokens != cfg["total_tokens"]:
            log(f"planned total changed from {cfg['total_tokens']:,} to {a.total_tokens:,} tokens: the schedule "
                f"continues from step {st['step']} on the new cosine")
            cfg["total_tokens"] = a.total_tokens
        recipe_changes = {k: [cfg.get(k), v] for k, v in _recipe_from_args(a, fill_defaults=False).items()
                          if cfg.get(k) != v}
        for k, (was, now) in recipe_changes.items():
            log(f"{k} changed from {was} to {now} for this stage on")
            cfg[k] = now
        tokenizer_dir = tok_dir
    else:
        if ckpt.exists():
            raise FileExistsError(f"{ckpt} exists: continue it with --resume, or choose another --run-dir")
        cfg = _cfg_from_args(a)
        tokenizer_dir = a.tokenizer
        st = None
        recipe_changes = {}
    a.tokenizer = tokenizer_dir
    data = _ensure_data(a, log)
    tok, ids = load_tokenizer(tokenizer_dir)
    if not a.resume:
        tok_dir.mkdir(parents=True, exist_ok=True)
        for name in TOKENIZER_FILES:
            shutil.copy(tokenizer_dir / name, tok_dir / name)
    tr = Trainer(cfg, data, tok, ids, device, precision=st["precision"] if st else None, log=log)
    if st:
        tr.load_state(st)
        tr.precision_info = st.get("precision_info", {})
        del st
    windows = eval_windows(data, cfg["seq_len"], a.eval_windows)
    n_params = sum(p.numel() for p in tr.model.parameters())
    log(f"model: {n_params:,} parameters, {tr.L} layers, {tr.precision} on {device} "
        f"({tr.precision_info}); step {tr.step} of {tr.total_steps}, {tr.tokens:,} tokens seen; "
        f"train stream {len(data.streams['train']):,} tokens")
    log_path = run / "train_log.jsonl"
    # a resumed run rewrites its log from the checkpoint's step, so records after it (lost work) go
    kept = []
    if log_path.is_file():
        for line in log_path.read_text().splitlines():
            if line.strip() and json.loads(line).get("step", 0) <= tr.step:
                kept.append(line)
    with open(log_path.with_suffix(".tmp"), "w") as f:
        f.write("".join(l + "\n" for l in kept))
    log_path.with_suffix(".tmp").replace(log_path)

    def append_log(rec):
        # reopened per record: a checkout or rebase that replaces the file under a long run must not
        # send the records to an unlinked inode (that lost steps 6,440-7,240 once)
        with open(log_path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    stop = {"signal": None}

    def on_signal(signum, _frame):
        stop["signal"] = signal.Signals(signum).name

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    stage = {"stage": len(tr.stages) + 1, "start_step": tr.step, "start_tokens": tr.tokens,
             "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "precision": tr.precision,
             "device": device, "threads": a.threads, "pid": os.getpid(), "resume": bool(a.resume),
             "torch": torch.__version__}
    if recipe_changes:
        stage["recipe_changes"] = recipe_changes
    tr.stages.append(stage)
    t0 = time.time()
    last_save = t0
    step_t = time.time()
    reason = "total reached"
    failed = True
    try:
        while tr.step < tr.total_steps:
            if stop["signal"]:
                reason = stop["signal"]
                break
            if a.minutes and time.time() - t0 >= a.minutes * 60:
                reason = "time budget"
                break
            if a.max_steps and tr.step >= a.max_steps:
                reason = "max steps"
                break
            r = tr.train_step()
            now = time.time()
            tr.seconds += now - step_t
            step_t = now
            if tr.step % a.log_every == 0:
                rec = tr.take_log_record(r["lr"])
                rec["stage"] = stage["stage"]
                if a.eval_every and tr.step % a.eval_every == 0:
                    ev = tr.evaluate(windows)
                    rec["heldout_exit_losses"] = ev["stdlib"]
                    if "packages" in ev:
                        rec["heldout_packages_exit_losses"] = ev["packages"]
                    step_t = time.time()  # evaluation is not training time
                append_log(rec)
                if not a.no_progress:
                    log(f"step {tr.step}/{tr.total_steps} tokens {tr.tokens:,} loss {rec['loss']} "
                        f"kl {rec['distill_kl']} lr {r['lr']:.2e} {tr.tokens / max(1e-9, tr.seconds):.0f} tok/s"
                        + (f" heldout {rec['heldout_exit_losses'][-1]}" if "heldout_exit_losses" in rec else ""))
            if a.save_every_min and time.time() - last_save >= a.save_every_min * 60:
                stage.update(end_step=tr.step, end_tokens=tr.tokens, ended=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
                tr.save(ckpt)
                last_save = time.time()
                step_t = last_save
                log(f"checkpoint: step {tr.step}, {tr.tokens:,} tokens -> {ckpt}")
        if tr.step >= tr.total_steps:
            ev = tr.evaluate(windows)
            rec = {"step": tr.step, "tokens": tr.tokens, "elapsed": round(tr.seconds, 1), "stage": stage["stage"],
                   "final": True, "heldout_exit_losses": ev["stdlib"]}
            if "packages" in ev:
                rec["heldout_packages_exit_losses"] = ev["packages"]
            append_log(rec)
        failed = False
    finally:
        # after a failure the state may be half-updated: the last periodic checkpoint stays
        if not failed:
            stage.update(end_step=tr.step, end_tokens=tr.tokens, stop_reason=reason,
                         ended=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
            tr.save(ckpt)
        for s, h in old.items():
            signal.signal(s, h)
    log(f"stopped ({reason}): step {tr.step} of {tr.total_steps}, {tr.tokens:,} tokens, "
        f"{tr.tokens / max(1e-9, tr.seconds):.0f} tok/s; checkpoint {ckpt}")
    return 0


def probe(a: argparse.Namespace, log=print) -> int:
    """Equal minutes per size on the same data; held-out loss at the end of each. The schedule of
    each size is a warmup + cosine over its minutes, so every size ends annealed."""
    import torch

    torch.set_num_threads(a.threads)
    device = _device(a)
    data = _ensure_data(a, log)
    tok, ids = load_tokenizer(a.tokenizer)
    windows = eval_windows(data, a.seq_len, a.eval_windows)
    out_dir = a.run_dir.parent / "probe"
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    precision = None
    for spec in a.probe_sizes.split(","):
        h, nl, ff = (int(v) for v in spec.lower().split("x"))
        cfg = _cfg_from_args(a)
        cfg["arch"] = {"hidden": h, "layers": nl, "heads": max(1, h // 64), "kv_heads": max(1, h // 64),
                       "intermediate": ff}
        tr = Trainer(cfg, data, tok, ids, device, precision=precision, log=log)
        precision = tr.precision
        n_params = sum(p.numel() for p in tr.model.parameters())
        budget = a.probe_minutes * 60
        t0 = time.time()
        warm = cfg["warmup"]
        while time.time() - t0 < budget:
            fr = (time.time() - t0) / budget
            lr = cfg["lr"] * (min(1.0, (tr.step + 1) / warm) if tr.step < warm else
                              cfg["min_lr_ratio"] + (1 - cfg["min_lr_ratio"]) * 0.5 * (1 + math.cos(math.pi * fr)))
            tr.train_step(lr_override=lr)
        secs = time.time() - t0
        ev = tr.evaluate(windows)
        res = {"size": spec, "parameters": n_params, "bf16_mb": round(n_params * 2 / 2**20, 1), **cfg["arch"],
               "steps": tr.step, "tokens": tr.tokens, "seconds": round(secs, 1),
               "tokens_per_s": round(tr.tokens / secs, 1), "heldout_stdlib": ev["stdlib"],
               "heldout_packages": ev.get("packages"), "precision": precision, "batch_size": cfg["batch_size"],
               "warmup": warm, "lr": cfg["lr"]}
        results.append(res)
        log(json.dumps({k: v for k, v in res.items() if k not in ("heldout_stdlib", "heldout_packages")})
            + f" heldout stdlib {ev['stdlib'][-1]} packages {ev.get('packages', [None])[-1]} "
              f"exit4 {ev['stdlib'][min(3, nl - 1)]}")
        (out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        del tr
    return 0


def heldout_loss_of(model, data, seq_len: int, count: int = 48) -> list[float]:
    """Per-exit held-out stdlib loss on the model card's fixed windows (same seed and count)."""
    import torch

    x, y = stream_windows(data.streams["heldout_stdlib"], seq_len, count)
    sums = None
    with torch.no_grad():
        for i in range(x.shape[0]):
            v = exit_losses(model, x[i:i + 1], y[i:i + 1])
            sums = v if sums is None else [s + b for s, b in zip(sums, v)]
    if sums is None:
        raise ValueError("no held-out stdlib windows")
    return [s / x.shape[0] for s in sums]


def save_model(model, out: Path, tokenizer_dir: Path, meta: dict, summary: dict) -> None:
    import copy

    import torch
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    m = copy.deepcopy(model).to("cpu", torch.bfloat16)
    m.config.use_cache = True
    m.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id, eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.pad_token_id, do_sample=False, max_new_tokens=64,
    )
    m.save_pretrained(out, safe_serialization=True)
    # Drafts trained on the previous weights (train-adapter, train-medusa) are keyed to them: the engine
    # would only refuse them, so they go with the weights they were trained on.
    for stale in ("exit_adapter.safetensors", "medusa_heads.safetensors"):
        (out / stale).unlink(missing_ok=True)
    if Path(tokenizer_dir).resolve() != out.resolve():
        for name in TOKENIZER_FILES:
            shutil.copy(Path(tokenizer_dir) / name, out / name)
    (out / "completiond.json").write_text(json.dumps(meta, indent=2) + "\n")
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def export(a: argparse.Namespace, log=print) -> int:
    """The model directory from the run's checkpoint; then the model card."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(a.threads)
    run = a.run_dir
    st = load_checkpoint(run / "ckpt.pt")
    cfg = st["cfg"]
    tok_dir = run / "tokenizer"
    a.tokenizer = tok_dir
    data = _ensure_data(a, log)
    tok, ids = load_tokenizer(tok_dir)
    model = build_model(cfg["arch"], ids, tok.get_vocab_size(), cfg["seed"])
    model.load_state_dict(st["model"])
    model.eval()
    # the shipped model is compared as it ships: bf16 weights evaluated in fp32
    model = model.to(torch.bfloat16).to(torch.float32)
    new_loss = heldout_loss_of(model, data, cfg["seq_len"])
    out: Path = a.out
    old_loss = None
    if (out / "config.json").is_file():
        old = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        old_ctx = json.loads((out / "completiond.json").read_text()).get("train_context", cfg["seq_len"]) \
            if (out / "completiond.json").is_file() else cfg["seq_len"]
        old_loss = heldout_loss_of(old, data, old_ctx)
        del old
    log(f"held-out stdlib loss, last layer: checkpoint {new_loss[-1]:.4f}"
        + (f", {out} {old_loss[-1]:.4f}" if old_loss else ""))
    if old_loss is not None and new_loss[-1] >= old_loss[-1] and not a.force:
        log(f"not exported: {out} is at least as good on held-out loss ({old_loss[-1]:.4f} <= {new_loss[-1]:.4f}); "
            f"--force to replace it anyway")
        return 3
    prev_meta = json.loads((out / "completiond.json").read_text()) if (out / "completiond.json").is_file() else {}
    spec = dict(prev_meta.get("speculation") or {"speculative": True, "exit_layer": 4, "draft_k": 2, "threshold": 0.0})
    # the trained drafts are removed with the old weights (save_model): no draft named, the record's
    # default (early exit) applies
    spec.pop("draft", None)
    # the draft head's vocabulary: the most frequent ids of the training stream (exact: q is
    # zero elsewhere); measured figures belong to the weights they were measured on
    counts = np.bincount(np.asarray(data.streams["train"]), minlength=tok.get_vocab_size())
    spec["draft_vocab"] = [int(i) for i in np.argsort(-counts, kind="stable")[: len(spec.get("draft_vocab") or []) or 1024]]
    spec.pop("measured", None)
    spec["exit_layer"] = max(1, min(int(spec.get("exit_layer", 4)), cfg["arch"]["layers"] - 1))
    spec["note"] = ("defaults; rerun `completiond calibrate` to measure this model's acceptance and speed "
                    "per exit layer and K on a machine")
    meta = {
        "train_context": cfg["seq_len"],
        "languages": ["python"],  # what it was trained on: the daemon serves no other language with it
        "fim": {
            "psm": "<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>",
            "spm": "<|fim_prefix|><|fim_suffix|>{suffix}<|fim_middle|>{prefix}",
            "stop": "<|endoftext|>",
        },
        "file_separator": "<|file_sep|>",
        "speculation": spec,
        # No "cpu_weights" (the CPU step's format for weights = "auto"): it is chosen for the weights it was
        # measured on (`completiond bench --quality`, int8 within 0.02 nats of bf16), so new weights start without.
    }
    arch = cfg["arch"]
    L = arch["layers"]
    summary = {
        "parameters": sum(p.numel() for p in model.parameters()), "layers": L, "hidden": arch["hidden"],
        "heads": arch["heads"], "kv_heads": arch["kv_heads"], "intermediate": arch["intermediate"],
        "vocab": tok.get_vocab_size(), "seq_len": cfg["seq_len"], "batch_size": cfg["batch_size"],
        "steps": st["step"], "planned_steps": max(1, math.ceil(cfg["total_tokens"] / (cfg["batch_size"] * cfg["seq_len"]))),
        "tokens_seen": st["tokens"], "planned_tokens": cfg["total_tokens"], "train_seconds": round(st["seconds"], 1),
        "stages": st["stages"], "cfg": cfg, "lr": cfg["lr"], "warmup": cfg["warmup"],
        "min_lr_ratio": cfg["min_lr_ratio"], "weight_decay": cfg["weight_decay"],
        "layer_dropout_max": cfg["layer_dropout"],
        "layer_dropout": [cfg["layer_dropout"] * l / (L - 1) for l in range(L)] if L > 1 else [0.0],
        "exit_scale": cfg["exit_scale"], "exit_weights": layer_weights(L, cfg["exit_scale"]),
        "exit_frac": cfg["exit_frac"], "draft_exits": cfg["draft_exits"], "rotating_exits": cfg["rotating_exits"],
        "distill": cfg["distill"], "distill_other": cfg["distill_other"], "fim_rate": cfg["fim_rate"],
        "spm_rate": cfg["spm_rate"], "empty_middle": cfg["empty_middle"], "seed": cfg["seed"],
        "precision": st["precision"], "precision_info": st.get("precision_info"),
        "training_stream_tokens": int(len(data.streams["train"])), "data_manifest": str(a.data / "manifest.json"),
        "heldout_exit_losses_at_export": new_loss, "previous_model_heldout_exit_losses": old_loss,
        "torch": torch.__version__,
    }
    probe_file = run.parent / "probe" / "results.json"
    if probe_file.is_file():
        summary["scaling_probe"] = json.loads(probe_file.read_text())
    save_model(model, out, tok_dir, meta, summary)
    shutil.copy(a.data / "manifest.json", out / "data_manifest.json")
    # the run's log stays in the run directory (the card draws its loss curves from it): a model
    # directory holds what a user of the model needs, and every clone carries it
    (out / "train_log.jsonl").unlink(missing_ok=True)
    log(f"exported step {st['step']} ({st['tokens']:,} tokens) to {out}")
    if not a.no_card:
        # the card runs in its own process: its evaluation takes minutes and loads the exported files
        cmd = [sys.executable, "-m", __package__ + ".model_card", "--model", str(out), "--threads", str(a.threads)]
        if (run / "train_log.jsonl").is_file():
            cmd += ["--train-log", str(run / "train_log.jsonl")]
        log("model card: " + " ".join(cmd))
        return subprocess.run(cmd).returncode
    return 0


def checkout_root() -> Path | None:
    """The git checkout this module runs from, or None (an installed package)."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / ".git").exists() else None


def run_dir_problem(run_dir: Path | None, allow_checkout: bool) -> str | None:
    """Why this run directory is refused, or None. Checkpoints are large pickles of the optimizer state:
    they were once committed, and every clone still downloads them (issue 28)."""
    if run_dir is None:
        return ("name a run directory with --run-dir, outside the checkout (it holds the checkpoint: "
                "weights and optimizer state), e.g. --run-dir ~/completiond-runs/v2")
    root = checkout_root()
    if root is not None and not allow_checkout:
        where = run_dir.expanduser().resolve()
        if where == root or root in where.parents:
            return (f"--run-dir {run_dir} is inside the checkout {root}: checkpoints stay out of the repository; "
                    "pick a directory outside it, or pass --run-dir-in-checkout")
    return None


def run(args: argparse.Namespace) -> int:
    log = lambda s: print(s, flush=True)
    if args.prepare:
        _prepare(args, log)
        return 0
    problem = run_dir_problem(args.run_dir, args.run_dir_in_checkout)
    if problem is not None:
        print(f"train-default: {problem}", file=sys.stderr)
        return 2
    args.run_dir = args.run_dir.expanduser()
    if args.probe:
        return probe(args, log)
    if args.export:
        return export(args, log)
    return train(args, log)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="train the bundled default model")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
