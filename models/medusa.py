"""Medusa heads: extra heads on the model's final hidden state that guess the tokens after the next.

Head i (1-based) reads the final-normed state at position t, the one whose LM-head output is the
distribution of token t+1, and guesses token t+1+i. Each head is one residual block (Medusa-1):
out = hn + silu(W_i hn + b_i), then the model's own LM head (shared and frozen). W_i starts at
zero, so an untrained head repeats the LM head's guess; training (the whole model frozen) moves
head i toward the model's own distribution at position t+i, KL(p_{t+i} || q_i(h_t)), which is
what the verifier will compare its guesses with.

File: ``medusa_heads.safetensors``: ``head.{i}.weight`` [d, d] and ``head.{i}.bias`` [d] for i in
0..n-1, and string metadata: format FORMAT, model_identity (a retrained model never uses stale
heads), num_heads, hidden_size, training (JSON).

The engine's runtime (candidate trees, tree verification) is completiond/engine/medusa.py.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from .draft_files import read_tagged, save_tagged, training_record
from .exit_adapter import schedule

FORMAT = "completiond-medusa-heads/1"
MEDUSA_FILE = "medusa_heads.safetensors"


class MedusaFileError(ValueError):
    """Heads that cannot be used with this model (stale, damaged, another shape)."""


@dataclass
class MedusaRecord:
    weights: list          # [d, d] per head
    biases: list           # [d] per head
    model_identity: str
    meta: dict = field(default_factory=dict)

    @property
    def num_heads(self) -> int:
        return len(self.weights)

    @property
    def training(self) -> dict:
        return training_record(self.meta)


def save_heads(path: Path, weights, biases, model_identity: str, config, training: dict) -> Path:
    tensors = {}
    for i, (w, b) in enumerate(zip(weights, biases)):
        # cloned: heads made from one tensor would share memory, which safetensors refuses to write
        tensors[f"head.{i}.weight"] = w.detach().to("cpu").float().clone()
        tensors[f"head.{i}.bias"] = b.detach().to("cpu").float().clone()
    meta = {"format": FORMAT, "model_identity": model_identity, "num_heads": str(len(weights)),
            "hidden_size": str(config.hidden_size), "training": json.dumps(training)}
    return save_tagged(path, tensors, meta)


def read_heads(path: Path, model_identity: str, config) -> MedusaRecord:
    tensors, meta = read_tagged(path, FORMAT, "Medusa heads", model_identity, "completiond train-medusa",
                                MedusaFileError)
    d = config.hidden_size
    weights, biases = [], []
    i = 0
    while f"head.{i}.weight" in tensors:
        w, b = tensors[f"head.{i}.weight"], tensors.get(f"head.{i}.bias")
        if tuple(w.shape) != (d, d) or b is None or tuple(b.shape) != (d,):
            raise MedusaFileError(f"Medusa head {i} in {path} does not fit this model's hidden size {d}")
        weights.append(w)
        biases.append(b)
        i += 1
    if not weights:
        raise MedusaFileError(f"{path} holds no heads")
    return MedusaRecord(weights, biases, model_identity, meta)


# ----------------------------------------------------------------------------- training

def head_logits(model, hn, w, b):
    """[B, T, d] final-normed states -> [B, T, V] logits of one head."""
    import torch.nn.functional as F

    x = hn.to(w.dtype)
    return model.lm_head((x + F.silu(F.linear(x, w, b))).to(model.lm_head.weight.dtype))


def _teacher(model, ids):
    import torch

    with torch.no_grad():
        hn = model.model(ids).last_hidden_state  # after the final norm
        logp = torch.log_softmax(model.lm_head(hn).float(), dim=-1)
    return hn, logp


def measure(model, weights, biases, batches: list) -> dict:
    """Per head: top-1 agreement with the model's own next-token argmax at t+i, and KL."""
    import torch

    n = len(weights)
    agree = [0] * n
    kl = [0.0] * n
    count = [0] * n
    with torch.no_grad():
        for ids in batches:
            hn, logp = _teacher(model, ids)
            target = logp.argmax(-1)
            for i in range(n):
                s = i + 1
                q = torch.log_softmax(head_logits(model, hn[:, :-s], weights[i], biases[i]).float(), -1)
                p = logp[:, s:]
                agree[i] += int((q.argmax(-1) == target[:, s:]).sum())
                kl[i] += float((p.exp() * (p - q)).sum())
                count[i] += q.shape[0] * q.shape[1]
    return {"agreement": [a / max(1, c) for a, c in zip(agree, count)], "kl": [k / max(1, c) for k, c in zip(kl, count)]}


def train_heads(model, num_heads: int, batches: Iterator, steps: int, lr: float = 1e-3, minutes: float = 0.0,
                warmup: int = 20, log: Callable[[str], None] = print, log_every: int = 10):
    """Train num_heads residual heads, the model frozen. Returns (weights, biases, summary)."""
    import torch

    model.eval().requires_grad_(False)
    d = model.config.hidden_size
    p0 = next(model.parameters())
    # trained in float32 beside a half-precision model (its own dtype otherwise)
    dtype = p0.dtype if p0.dtype in (torch.float32, torch.float64) else torch.float32
    weights = [torch.zeros(d, d, device=p0.device, dtype=dtype, requires_grad=True) for _ in range(num_heads)]
    biases = [torch.zeros(d, device=p0.device, dtype=dtype, requires_grad=True) for _ in range(num_heads)]
    opt = torch.optim.AdamW(weights + biases, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    t0 = time.time()
    tokens = done = 0
    last = float("nan")
    for step, scale in schedule(steps, warmup, minutes, t0, log):
        for g in opt.param_groups:
            g["lr"] = lr * scale
        ids = next(batches)
        hn, logp = _teacher(model, ids)
        kls = []
        for i in range(num_heads):
            s = i + 1
            q = torch.log_softmax(head_logits(model, hn[:, :-s], weights[i], biases[i]).float(), -1)
            p = logp[:, s:]
            kls.append((p.exp() * (p - q)).sum(-1).mean())
        loss = sum(kls[1:], kls[0]) / num_heads  # summed left to right, head 0 first
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(weights + biases, 1.0)
        opt.step()
        tokens += ids.numel()
        done = step + 1
        last = float(loss.detach())
        if log_every and (step % log_every == 0 or step == steps - 1):
            log(f"step {step + 1}/{steps} mean kl {last:.4f} lr {lr * scale:.2e} "
                f"{tokens / max(1e-9, time.time() - t0):.0f} tok/s")
    w = [x.detach() for x in weights]
    b = [x.detach() for x in biases]
    return w, b, {"steps": done, "tokens": tokens, "minutes": round((time.time() - t0) / 60, 2), "final_kl": last,
                  "lr": lr, "num_heads": num_heads}
