"""Train the bundled default model from scratch: `completiond train-default`.

Data: the CPython stdlib training split (models/corpus.py). Tokenizer: byte-level
BPE trained here (models/tokenizer_build.py). Model: a plain `LlamaForCausalLM`
with tied embeddings, so `AutoModelForCausalLM.from_pretrained` loads it.

Recipe (LayerSkip, Elhoushi et al. 2024, plus fill-in-the-middle):

* layer dropout rising linearly with depth, p_l = p_max * l / (L-1) for layer
  l = 0..L-1, per sample in the batch; only in training (no rescaling, so it is
  simply off at inference);
* early-exit loss: the hidden state after every layer goes through the shared
  final norm and the tied LM head; loss = sum_l w_l CE_l / sum_l w_l with
  w_l = e_scale * sum_{i<=l} i for l < L-1 and w_{L-1} = L-1 (the paper's
  depth-increasing weights). To keep CPU cost down the intermediate exits are
  scored on a random subset of positions each step (the final layer on all);
* FIM on `--fim-rate` of the samples (default half), half of those in PSM and
  half in SPM order, split at character level inside one file:

      PSM: <|fim_prefix|>PREFIX<|fim_suffix|>SUFFIX<|fim_middle|>MIDDLE<|endoftext|>
      SPM: <|fim_prefix|><|fim_suffix|>SUFFIX<|fim_middle|>PREFIX MIDDLE<|endoftext|>

  (SPM: PREFIX and MIDDLE are adjacent, nothing between them; each piece is
  tokenized on its own). Other samples are plain windows of the training
  stream, where files are joined with <|file_sep|>.

bf16 autocast, AdamW, linear warmup then cosine decay over the time budget (or
--max-steps), fixed seed. Loss log: <out>/train_log.jsonl (copied next to the
model); progress on a tqdm bar.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import time
from pathlib import Path

# Under CPU contention (other jobs on the same cores) libgomp's spinning
# barriers make multi-threaded torch several times slower; passive waiting
# avoids that. Must be set before torch starts its OpenMP pool.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

DEFAULTS = dict(hidden=192, layers=10, heads=3, kv_heads=3, intermediate=512, vocab=8192, seq_len=512,
                batch_size=8, lr=2e-3, min_lr_ratio=0.1, warmup=50, weight_decay=0.1,
                layer_dropout=0.1, exit_scale=0.1, exit_frac=0.125, fim_rate=0.5, spm_rate=0.5)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from completiond.models import default_model_dir

    d = DEFAULTS
    parser.add_argument("--out", type=Path, default=default_model_dir(), help="output model directory")
    parser.add_argument("--minutes", type=float, default=50.0, help="wall-clock budget of the training loop")
    parser.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: only the time budget)")
    parser.add_argument("--max-files", type=int, default=0, help="use only the first N training files (quick tests)")
    parser.add_argument("--hidden", type=int, default=d["hidden"])
    parser.add_argument("--layers", type=int, default=d["layers"])
    parser.add_argument("--heads", type=int, default=d["heads"])
    parser.add_argument("--kv-heads", type=int, default=d["kv_heads"])
    parser.add_argument("--intermediate", type=int, default=d["intermediate"])
    parser.add_argument("--vocab", type=int, default=d["vocab"])
    parser.add_argument("--seq-len", type=int, default=d["seq_len"])
    parser.add_argument("--batch-size", type=int, default=d["batch_size"])
    parser.add_argument("--lr", type=float, default=d["lr"])
    parser.add_argument("--min-lr-ratio", type=float, default=d["min_lr_ratio"])
    parser.add_argument("--warmup", type=int, default=d["warmup"])
    parser.add_argument("--weight-decay", type=float, default=d["weight_decay"])
    parser.add_argument("--layer-dropout", type=float, default=d["layer_dropout"], help="max layer dropout (last layer)")
    parser.add_argument("--exit-scale", type=float, default=d["exit_scale"], help="LayerSkip e_scale")
    parser.add_argument("--exit-frac", type=float, default=d["exit_frac"],
                        help="fraction of positions scored at the intermediate exits each step")
    parser.add_argument("--fim-rate", type=float, default=d["fim_rate"])
    parser.add_argument("--spm-rate", type=float, default=d["spm_rate"], help="share of FIM samples in SPM order")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--eval-every", type=int, default=200)
    parser.add_argument("--save-every-min", type=float, default=10.0, help="checkpoint into --out this often")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--init-from", type=Path, default=None,
                        help="continue training a model saved by this script (its tokenizer and architecture; "
                             "a new warmup + cosine stage; steps, tokens and the loss log are cumulative)")


# ----------------------------------------------------------------------------- data

class Data:
    """Training stream + FIM sample maker. Everything is driven by one seeded RNG."""

    def __init__(self, tok, files, seq_len: int, fim_rate: float, spm_rate: float, rng: random.Random):
        import numpy as np

        self.tok = tok
        self.seq_len = seq_len
        self.fim_rate = fim_rate
        self.spm_rate = spm_rate
        self.rng = rng
        self.ids = {name: tok.convert_tokens_to_ids(name) for name in
                    ("<|endoftext|>", "<|file_sep|>", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>")}
        texts = [f.read_text() for f in files]
        enc = tok(texts, add_special_tokens=False)["input_ids"]
        sep = self.ids["<|file_sep|>"]
        parts, starts, lengths = [], [], []
        pos = 0
        for ids in enc:
            starts.append(pos)
            lengths.append(len(ids))
            parts.append(np.asarray(ids, dtype=np.int32))
            parts.append(np.asarray([sep], dtype=np.int32))
            pos += len(ids) + 1
        self.stream = np.concatenate(parts)
        self.file_starts = np.asarray(starts)
        self.file_lengths = np.asarray(lengths)
        self.file_weights = self.file_lengths / self.file_lengths.sum()
        self.cum = np.cumsum(self.file_weights)
        self.n_tokens = int(len(self.stream))

    def _plain(self):
        n = self.seq_len + 1
        start = self.rng.randrange(0, max(1, self.n_tokens - n))
        seq = self.stream[start:start + n].tolist()
        return seq, [1] * len(seq)

    def _pick_file_window(self, n: int) -> str:
        import bisect

        i = min(bisect.bisect_left(self.cum, self.rng.random()), len(self.cum) - 1)
        s, length = int(self.file_starts[i]), int(self.file_lengths[i])
        off = self.rng.randrange(0, max(1, length - n))
        window = self.stream[s + off:s + min(length, off + n)].tolist()
        return self.tok.decode(window)

    def _split(self, text: str):
        n = len(text)
        a = self.rng.randint(0, n)
        if self.rng.random() < 0.5:
            # line-shaped middle: rest of the cursor's line plus 0-3 more lines
            b = a
            for _ in range(1 + min(3, int(self.rng.expovariate(1.0)))):
                nl = text.find("\n", b)
                if nl < 0:
                    b = n
                    break
                b = nl + 1
            if self.rng.random() < 0.5 and b > a and text[b - 1] == "\n":
                b -= 1  # sometimes stop before the newline
        else:
            b = self.rng.randint(a, n)
        return text[:a], text[a:b], text[b:]

    def fim_layout(self, prefix: str, middle: str, suffix: str, spm: bool) -> list[int]:
        """Token ids of one FIM training sample (pieces tokenized separately)."""
        ids = self.ids
        enc = lambda s: self.tok(s, add_special_tokens=False)["input_ids"] if s else []
        p, m, s = enc(prefix), enc(middle), enc(suffix)
        if spm:
            return [ids["<|fim_prefix|>"], ids["<|fim_suffix|>"]] + s + [ids["<|fim_middle|>"]] + p + m + [ids["<|endoftext|>"]]
        return [ids["<|fim_prefix|>"]] + p + [ids["<|fim_suffix|>"]] + s + [ids["<|fim_middle|>"]] + m + [ids["<|endoftext|>"]]

    def _fim(self):
        ids = self.ids
        # leave room for the 4 sentinels and for re-tokenization at the cut points
        text = self._pick_file_window(self.seq_len - 12)
        prefix, middle, suffix = self._split(text)
        seq = self.fim_layout(prefix, middle, suffix, spm=self.rng.random() < self.spm_rate)
        seq = seq[: self.seq_len + 1]
        mask = [1] * len(seq)
        pad = self.seq_len + 1 - len(seq)
        return seq + [ids["<|fim_pad|>"]] * pad, mask + [0] * pad

    def batch(self, bsz: int):
        import torch

        seqs, masks = [], []
        for _ in range(bsz):
            seq, mask = self._fim() if self.rng.random() < self.fim_rate else self._plain()
            seqs.append(seq)
            masks.append(mask)
        x = torch.tensor(seqs, dtype=torch.long)
        m = torch.tensor(masks, dtype=torch.bool)
        labels = x[:, 1:].clone()
        labels[~m[:, 1:]] = -100
        return x[:, :-1].contiguous(), labels


def heldout_windows(tok, files, seq_len: int, count: int, seed: int = 1234):
    """Fixed plain windows from held-out files (deterministic), for evaluation."""
    import torch

    rng = random.Random(seed)
    sep = tok.convert_tokens_to_ids("<|file_sep|>")
    stream = []
    for f in files:
        stream.extend(tok(f.read_text(), add_special_tokens=False)["input_ids"])
        stream.append(sep)
    n = seq_len + 1
    starts = sorted(rng.randrange(0, max(1, len(stream) - n)) for _ in range(count))
    x = torch.tensor([stream[s:s + n] for s in starts], dtype=torch.long)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


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
            exits.append(h[:, exit_positions] if not isinstance(exit_positions, slice) else h[:, exit_positions])
    logits = model.lm_head(inner.norm(h))
    return logits, exits


def exit_losses(model, input_ids, labels):
    """Per-layer held-out loss (mean CE) for every exit, final layer last. No dropout."""
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


def build_model(args, tok):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    pad = tok.convert_tokens_to_ids("<|fim_pad|>")
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=eos, eos_token_id=eos, pad_token_id=pad, attention_dropout=0.0,
        initializer_range=0.02, attn_implementation="sdpa",
    )
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(cfg)
    model.config._attn_implementation = "sdpa"
    return model


def save_model(model, tok, out: Path, extra: dict) -> None:
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
    tok.save_pretrained(out)
    meta = {
        "train_context": extra["seq_len"],
        "fim": {
            "psm": "<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>",
            "spm": "<|fim_prefix|><|fim_suffix|>{suffix}<|fim_middle|>{prefix}",
            "stop": "<|endoftext|>",
        },
        "file_separator": "<|file_sep|>",
    }
    (out / "completiond.json").write_text(json.dumps(meta, indent=2) + "\n")
    (out / "training_summary.json").write_text(json.dumps(extra, indent=2) + "\n")


# ----------------------------------------------------------------------------- loop

def run(args: argparse.Namespace) -> int:
    import numpy as np
    import torch
    import torch.nn.functional as F
    from tqdm import tqdm

    from completiond.models import corpus, tokenizer_build

    t_start = time.time()
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    out: Path = args.out
    work = out.parent / (out.name + ".training")
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)

    files = corpus.training_files()
    held = corpus.heldout_files()
    if args.max_files:
        files = files[: args.max_files]
        held = held[: max(2, args.max_files // 10)]
    print(f"corpus: {len(files)} training files, {len(held)} held-out files", flush=True)

    prev = None
    if args.init_from:
        from transformers import AutoTokenizer, LlamaForCausalLM

        init = Path(args.init_from)
        prev = json.loads((init / "training_summary.json").read_text())
        prev_log = (init / "train_log.jsonl").read_text() if (init / "train_log.jsonl").is_file() else ""
        tok = AutoTokenizer.from_pretrained(init)
        init_model = LlamaForCausalLM.from_pretrained(init, dtype=torch.float32)
        c = init_model.config
        args.hidden, args.layers, args.heads = c.hidden_size, c.num_hidden_layers, c.num_attention_heads
        args.kv_heads, args.intermediate = c.num_key_value_heads, c.intermediate_size
    else:
        tok = tokenizer_build.build(work / "tokenizer", vocab_size=args.vocab, files=files)
    print(f"tokenizer: {len(tok)} tokens ({time.time() - t_start:.0f}s)", flush=True)

    rng = random.Random(args.seed)
    data = Data(tok, files, args.seq_len, args.fim_rate, args.spm_rate, rng)
    print(f"training stream: {data.n_tokens:,} tokens ({time.time() - t_start:.0f}s)", flush=True)
    ev_x, ev_y = heldout_windows(tok, held, args.seq_len, count=16 if not args.max_files else 4)

    model = (init_model if prev else build_model(args, tok)).to(device)
    model.config._attn_implementation = "sdpa"
    n_params = sum(p.numel() for p in model.parameters())
    L = args.layers
    weights = layer_weights(L, args.exit_scale)
    drop = [args.layer_dropout * l / (L - 1) for l in range(L)] if L > 1 else [0.0]
    print(f"model: {n_params:,} parameters, {L} layers; exit weights {[round(w, 3) for w in weights]}", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=(device == "cuda"))
    budget_s = args.minutes * 60.0
    amp = torch.autocast(device_type=device, dtype=torch.bfloat16)

    def progress(step: int, elapsed: float) -> float:
        fr = elapsed / budget_s if budget_s > 0 else 0.0
        if args.max_steps:
            fr = max(fr, step / args.max_steps)
        return min(1.0, fr)

    def lr_at(step: int, elapsed: float) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        fr = progress(step, elapsed)
        return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * fr)))

    log_path = work / "train_log.jsonl"
    logf = open(log_path, "w")
    stage = 1 + len(prev.get("stages", [prev])) if prev else 1
    step0 = prev["steps"] if prev else 0
    tokens0 = prev["tokens_seen"] if prev else 0
    seconds0 = prev["train_seconds"] if prev else 0.0
    if prev:
        logf.write(prev_log if prev_log.endswith("\n") or not prev_log else prev_log + "\n")
    n_exit = max(1, int(round(args.exit_frac * args.seq_len)))
    step, tokens = 0, 0
    acc = np.zeros(L)
    acc_n = 0
    t0 = time.time()
    last_save = t0
    bar = tqdm(total=args.max_steps or None, disable=args.no_progress, unit="step", mininterval=2.0)

    def summary(final_eval=None):
        this = {"stage": stage, "steps": step, "tokens": tokens, "train_seconds": round(time.time() - t0, 1),
                "total_seconds": round(time.time() - t_start, 1), "minutes": args.minutes, "lr": args.lr,
                "warmup": args.warmup, "seed": args.seed, "init_from": str(args.init_from) if prev else None,
                "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                         if k not in ("func",) and not callable(v)}}
        stages = (prev.get("stages") or [{"stage": 1, "steps": prev["steps"], "tokens": prev["tokens_seen"],
                                          "train_seconds": prev["train_seconds"],
                                          "total_seconds": prev["total_seconds"], "lr": prev["lr"],
                                          "warmup": prev["warmup"], "seed": prev["seed"], "init_from": None}]
                  ) if prev else []
        return {
            "parameters": n_params, "layers": L, "hidden": args.hidden, "heads": args.heads,
            "kv_heads": args.kv_heads, "intermediate": args.intermediate, "vocab": len(tok),
            "seq_len": args.seq_len, "batch_size": args.batch_size, "steps": step0 + step,
            "tokens_seen": tokens0 + tokens, "train_seconds": round(seconds0 + time.time() - t0, 1),
            "total_seconds": round(sum(x["total_seconds"] for x in stages) + time.time() - t_start, 1),
            "stages": stages + [this],
            "lr": args.lr, "warmup": args.warmup, "min_lr_ratio": args.min_lr_ratio,
            "weight_decay": args.weight_decay, "layer_dropout_max": args.layer_dropout,
            "layer_dropout": drop, "exit_scale": args.exit_scale, "exit_weights": weights,
            "exit_frac": args.exit_frac, "fim_rate": args.fim_rate, "spm_rate": args.spm_rate,
            "seed": args.seed, "device": device, "threads": args.threads,
            "training_files": len(files), "heldout_files": len(held), "training_stream_tokens": data.n_tokens,
            "max_files": args.max_files, "torch": torch.__version__,
            "heldout_exit_losses": final_eval,
        }

    def evaluate():
        model.eval()
        with amp:
            ls = exit_losses(model, ev_x.to(device), ev_y.to(device))
        model.train()
        return ls

    model.train()
    while True:
        elapsed = time.time() - t0
        if (args.max_steps and step >= args.max_steps) or (budget_s > 0 and elapsed >= budget_s and step > 0):
            break
        lr = lr_at(step, elapsed)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = data.batch(args.batch_size)
        x, y = x.to(device), y.to(device)
        pos = torch.randperm(args.seq_len, device=device)[:n_exit].sort().values
        with amp:
            logits, exits = forward_all_exits(model, x, drop, pos)
            final = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100)
            losses = []
            if exits:
                hs = torch.stack(exits)  # (L-1, B, P, H)
                lg = model.lm_head(model.model.norm(hs)).float()
                yy = y[:, pos].unsqueeze(0).expand(len(exits), -1, -1)
                ce = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), yy.reshape(-1), ignore_index=-100, reduction="none")
                valid = (yy.reshape(-1) != -100).view(len(exits), -1).float()
                per_layer = (ce.view(len(exits), -1) * valid).sum(1) / valid.sum(1).clamp(min=1)
                losses = list(per_layer)
            losses.append(final)
            total = sum(w * l for w, l in zip(weights, losses))
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += int((y != -100).sum())
        acc += np.array([float(l.detach()) for l in losses])
        acc_n += 1
        bar.update(1)
        if step % args.log_every == 0:
            mean = acc / acc_n
            rec = {"step": step0 + step, "tokens": tokens0 + tokens, "elapsed": round(seconds0 + time.time() - t0, 1),
                   "stage": stage, "lr": lr,
                   "loss": float(mean[-1]), "exit_losses": [round(float(v), 4) for v in mean]}
            acc[:] = 0
            acc_n = 0
            if args.eval_every and step % args.eval_every == 0:
                rec["heldout_exit_losses"] = [round(v, 4) for v in evaluate()]
            logf.write(json.dumps(rec) + "\n")
            logf.flush()
            bar.set_postfix(loss=f"{mean[-1]:.3f}", tok=f"{tokens / 1e6:.2f}M",
                            tps=f"{tokens / max(1e-9, time.time() - t0):.0f}")
        if args.save_every_min and time.time() - last_save > args.save_every_min * 60:
            save_model(model, tok, out, summary())
            shutil.copy(log_path, out / "train_log.jsonl")
            last_save = time.time()
    bar.close()
    final_eval = evaluate()
    logf.write(json.dumps({"step": step0 + step, "tokens": tokens0 + tokens, "stage": stage,
                           "elapsed": round(seconds0 + time.time() - t0, 1), "final": True,
                           "heldout_exit_losses": [round(v, 4) for v in final_eval]}) + "\n")
    logf.close()
    save_model(model, tok, out, summary(final_eval))
    shutil.copy(log_path, out / "train_log.jsonl")
    shutil.rmtree(work, ignore_errors=True)
    print(f"done: {step} steps, {tokens:,} tokens in {time.time() - t0:.0f}s; held-out loss per exit "
          f"{[round(v, 3) for v in final_eval]}; saved to {out}", flush=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="retrain the bundled default model")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
