"""A trained exit adapter (Kangaroo-style): one extra decoder layer on top of layer E's hidden states.

The early-exit draft reads the model's own layers [0, E) and then the final norm and LM head.
A shallow exit drafts badly because layer E's states were never meant to be read out. The
adapter is one decoder layer of the model's own shape (attention + MLP) that sits between
layer E and the final norm, trained with the whole model frozen to match the final layer's
distribution (KL(p_final || q_adapter), the quantity acceptance depends on). It starts as a
copy of layer E itself, so before any training the draft equals the exit at E + 1; training
can only move it towards the final layer.

File: ``exit_adapter.safetensors``: the layer's tensors under transformers' own names
(``self_attn.q_proj.weight`` ...) and string metadata:

    format          FORMAT
    model_identity  the identity of the model it was trained on (engine.model_identity);
                    a retrained model has another identity, so a stale adapter is refused
    exit_layer      E (the number of model layers under the adapter)
    family, hidden_size, num_layers
    training        JSON: steps, tokens, minutes, KL and greedy agreement before/after

This module holds the format and the training; the engine's runtime draft is
completiond/engine/exit_adapter.py.
"""

from __future__ import annotations

import copy
import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

from .draft_files import read_tagged, save_tagged, training_record

FORMAT = "completiond-exit-adapter/1"
ADAPTER_FILE = "exit_adapter.safetensors"


class AdapterFileError(ValueError):
    """An adapter file that cannot be used with this model (stale, damaged, another shape)."""


@dataclass
class AdapterRecord:
    exit_layer: int
    model_identity: str
    tensors: dict          # name -> tensor, the decoder layer's state dict
    meta: dict = field(default_factory=dict)

    @property
    def training(self) -> dict:
        return training_record(self.meta)


def save_adapter(path: Path, layer, exit_layer: int, model_identity: str, config, training: dict) -> Path:
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in layer.state_dict().items()}
    meta = {"format": FORMAT, "model_identity": model_identity, "exit_layer": str(exit_layer),
            "family": str(getattr(config, "model_type", "?")), "hidden_size": str(config.hidden_size),
            "num_layers": str(config.num_hidden_layers), "training": json.dumps(training)}
    return save_tagged(path, tensors, meta)


def read_adapter(path: Path, model_identity: str, config) -> AdapterRecord:
    """The adapter at path, checked against the model it is to draft for."""
    tensors, meta = read_tagged(path, FORMAT, "exit adapter", model_identity, "completiond train-adapter",
                                AdapterFileError)
    try:
        exit_layer = int(meta["exit_layer"])
    except (KeyError, ValueError):
        raise AdapterFileError(f"exit adapter {path} names no valid exit layer") from None
    if not 1 <= exit_layer < config.num_hidden_layers:
        raise AdapterFileError(f"exit adapter {path}: exit layer {exit_layer} is outside 1..{config.num_hidden_layers - 1}")
    return AdapterRecord(exit_layer, model_identity, tensors, meta)


def build_layer(model, record: AdapterRecord):
    """A decoder layer module of the model's own class holding the adapter's weights."""
    base = model.model.layers[record.exit_layer]
    layer = copy.deepcopy(base)
    try:
        missing, unexpected = layer.load_state_dict(record.tensors, strict=False)
    except RuntimeError as exc:  # shape mismatch
        raise AdapterFileError(f"exit adapter does not fit this model's layers: {exc}") from exc
    if missing or unexpected:
        raise AdapterFileError(f"exit adapter tensors do not match this model's layers (missing {sorted(missing)[:4]}, "
                               f"unexpected {sorted(unexpected)[:4]})")
    p = next(base.parameters())
    return layer.to(device=p.device, dtype=p.dtype).eval().requires_grad_(False)


# ----------------------------------------------------------------------------- training

def token_windows(streams: Iterable[list[int]], seq_len: int, batch: int, rng: random.Random,
                  max_tokens: int) -> Iterator:
    """Random [batch, seq_len] windows of one token stream made by joining the given files."""
    import torch

    flat: list[int] = []
    for ids in streams:
        flat.extend(ids)
        if len(flat) >= max_tokens:
            break
    if len(flat) < seq_len + 1:
        raise ValueError(f"only {len(flat)} tokens of training text; need at least {seq_len + 1}")
    data = torch.tensor(flat, dtype=torch.long)
    while True:
        starts = [rng.randrange(0, len(flat) - seq_len) for _ in range(batch)]
        yield torch.stack([data[s:s + seq_len] for s in starts])  # [batch, seq_len]


def _causal_mask(t: int, dtype, device):
    import torch

    m = torch.full((t, t), float("-inf"), dtype=dtype, device=device).triu(1)
    return m[None, None]  # [1, 1, t, t]: additive, read by eager and SDPA attention alike


def _adapter_logits(model, layer, h, mask, positions):
    cos_sin = model.model.rotary_emb(h, positions)
    out = layer(h, attention_mask=mask, position_ids=positions, position_embeddings=cos_sin)
    out = out[0] if isinstance(out, tuple) else out
    return model.lm_head(model.model.norm(out))


def _teacher(model, ids, exit_layer: int, also_next: bool = False):
    """(states entering layer E [B, T, d], final log-probabilities [B, T, V]) of the frozen model,
    and with also_next the states entering layer E + 1 (None when that is the last layer's output)."""
    import torch

    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    # hidden_states[i] is what layer i reads: the embeddings for i = 0, the output of layer i - 1 after
    # (the last entry is already normed, so E + 1 = L has no plain exit to compare with).
    logp = torch.log_softmax(out.logits.float(), dim=-1)
    if not also_next:
        return out.hidden_states[exit_layer], logp
    nxt = out.hidden_states[exit_layer + 1] if exit_layer + 1 < model.config.num_hidden_layers else None
    return out.hidden_states[exit_layer], logp, nxt


def measure(model, layer, exit_layer: int, batches: list) -> dict:
    """Greedy agreement with the final layer and KL(p_final || q) of the adapter draft, and of the
    plain exits at E and E + 1 for comparison, on held-out batches."""
    import torch

    agree = {"adapter": 0, "exit": 0, "exit_next": 0}
    kl = {"adapter": 0.0, "exit": 0.0}
    n = 0
    with torch.no_grad():
        for ids in batches:
            h, logp, nxt = _teacher(model, ids, exit_layer, also_next=True)
            t = ids.shape[1]
            positions = torch.arange(t, device=ids.device)[None]
            mask = _causal_mask(t, h.dtype, h.device)
            target = logp.argmax(-1)
            q_adapter = torch.log_softmax(_adapter_logits(model, layer, h, mask, positions).float(), -1)
            q_exit = torch.log_softmax(model.lm_head(model.model.norm(h)).float(), -1)
            agree["adapter"] += int((q_adapter.argmax(-1) == target).sum())
            agree["exit"] += int((q_exit.argmax(-1) == target).sum())
            if nxt is not None:
                agree["exit_next"] += int((model.lm_head(model.model.norm(nxt)).argmax(-1) == target).sum())
            p = logp.exp()
            kl["adapter"] += float((p * (logp - q_adapter)).sum())
            kl["exit"] += float((p * (logp - q_exit)).sum())
            n += ids.numel()
    return {"positions": n, "agreement": {k: v / n for k, v in agree.items()}, "kl": {k: v / n for k, v in kl.items()}}


def schedule(steps: int, warmup: int, minutes: float, t0: float, log: Callable[[str], None]) -> Iterator:
    """(step, learning-rate scale): linear warmup then cosine over `steps`, cut off after `minutes` (0: no limit)."""
    for step in range(steps):
        if minutes and time.time() - t0 > minutes * 60:
            log(f"time budget of {minutes} min reached at step {step}")
            return
        yield step, min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / max(1, steps)))


def train_adapter(model, exit_layer: int, batches: Iterator, steps: int, lr: float = 5e-4, minutes: float = 0.0,
                  warmup: int = 20, log: Callable[[str], None] = print, log_every: int = 10, init=None):
    """Train a copy of layer E (or of `init`, an adapter layer to continue) as the adapter, everything
    else frozen. Returns (layer, summary)."""
    import torch

    model.eval().requires_grad_(False)
    layer = copy.deepcopy(init if init is not None else model.model.layers[exit_layer]).float().train().requires_grad_(True)
    params = [p for p in layer.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    t0 = time.time()
    tokens = 0
    done = 0
    last_kl = float("nan")
    for step, scale in schedule(steps, warmup, minutes, t0, log):
        for g in opt.param_groups:
            g["lr"] = lr * scale
        ids = next(batches)
        h, logp = _teacher(model, ids, exit_layer)
        t = ids.shape[1]
        positions = torch.arange(t, device=ids.device)[None]
        logits = _adapter_logits(model, layer, h.float(), _causal_mask(t, torch.float32, h.device), positions)
        logq = torch.log_softmax(logits.float(), dim=-1)
        loss = (logp.exp() * (logp - logq)).sum(-1).mean()  # KL(p_final || q_adapter) per position
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        tokens += ids.numel()
        done = step + 1
        last_kl = float(loss.detach())
        if log_every and (step % log_every == 0 or step == steps - 1):
            log(f"step {step + 1}/{steps} kl {last_kl:.4f} lr {lr * scale:.2e} {tokens / max(1e-9, time.time() - t0):.0f} tok/s")
    layer.eval().requires_grad_(False)
    return layer, {"steps": done, "tokens": tokens, "minutes": round((time.time() - t0) / 60, 2), "final_kl": last_kl,
                   "lr": lr}
