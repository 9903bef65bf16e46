"""The loader: carries out a load plan (load_plan.py). It finds out what needs torch (the device, the
dtype, the native step), reads the tokenizer and the weights the way the plan says, and moves them to
the device; Engine.load composes the engine from what it returns."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from completiond.engine import checkpoint, load_plan
from completiond.engine import tokenizer as tokenizer_mod
from completiond.engine.forward import packs_bf16_checkpoint
from completiond.errors import EngineError


def pick_device(device: str = "auto") -> str:
    if device != "auto":
        return device
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def pick_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        if device == "cpu":
            return torch.float32
        if device.startswith("cuda") and not torch.cuda.is_bf16_supported():
            return torch.float16  # GPUs before Ampere emulate bfloat16 slowly
        return torch.bfloat16
    try:
        return {
            "float32": torch.float32,
            "bfloat16": torch.bfloat16,
            "float16": torch.float16,
            "float64": torch.float64,
        }[dtype]
    except KeyError:
        raise EngineError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16") from None


# glibc's mallopt parameter, and the size from which a block gets a mapping of its own
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 20


def steady_heap() -> None:
    """Blocks of MMAP_THRESHOLD and more (KV sequences, prefill activations) get mappings of their own, given
    back to the system when freed. By default glibc raises its threshold to the size of each mapped block that
    is freed (up to 32 MiB), and from then on such blocks come from the heap, where a freed one stays resident:
    a daemon that evicts and allocates KV sequences of many sizes held 2036 MB against 1609 MB with the
    threshold fixed here (0.5B shape, bf16, 20 files, 512 MB cacheMegabytes, `bench --editing`, 2026-12-06),
    and the bundled model's keystrokes took as long either way."""
    try:
        ctypes.CDLL(None).mallopt(ctypes.c_int(M_MMAP_THRESHOLD), ctypes.c_int(MMAP_THRESHOLD))
    except (OSError, AttributeError):
        pass  # not glibc: its allocator keeps its own policy


def machine(device: str, dtype: str, threads: int | None) -> load_plan.Machine:
    """This machine for a load: the device and dtype resolved, CPU threads set (COMPLETIOND_THREADS too)."""
    device = pick_device(device)
    if device == "cpu":
        steady_heap()
    threads = threads or int(os.environ.get("COMPLETIOND_THREADS", "0") or 0)
    if device == "cpu" and threads > 0:
        # Batch-1 decode is a stream of small ops: on a busy machine, fewer threads beat
        # threads that wait for each other.
        torch.set_num_threads(threads)
    name = str(pick_dtype(dtype, device)).removeprefix("torch.")
    return load_plan.Machine(device, name, packs_bf16_checkpoint, checkpoint.eligible)


def read(plan: load_plan.LoadPlan, trust_remote_code: bool, say: Callable[[str], None]) -> tuple[Any, Any]:
    """(model module on the plan's device, in eval mode; tokenizer), read as the plan says."""
    read_dtype = getattr(torch, plan.read_dtype)
    try:
        say("tokenizer")
        # the tokenizer without transformers only where the model loads without it: else nothing is saved
        tok = tokenizer_mod.load_tokenizer(
            plan.path, plan.config, trust_remote_code, light=plan.why_transformers is None
        )
        say("weights")
        hf: torch.nn.Module  # checkpoint's light CausalLM, or transformers' model
        if plan.why_transformers is None:
            hf = checkpoint.read(plan.path, read_dtype, plan.config)
        else:
            tokenizer_mod.quiet_transformers()
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(
                str(plan.path),
                dtype=read_dtype,
                use_safetensors=True,
                trust_remote_code=trust_remote_code,
                local_files_only=True,
            )
    except OSError as exc:
        raise EngineError(f"cannot load model {plan.name} from {plan.path}: {exc}") from exc
    except checkpoint.config_errors() as exc:
        raise EngineError(f"cannot load model {plan.name}: {exc}") from exc
    say("device")
    return _placed(hf, plan.device), tok


def _placed(model: torch.nn.Module, device: str) -> torch.nn.Module:
    """model moved to device (in place), in eval mode. Typed as a plain Module: transformers wraps its own
    `to` in a way type checkers read as needing the model twice."""
    return model.to(device).eval()


def compute_dtype(plan: load_plan.LoadPlan) -> torch.dtype | None:
    return None if plan.compute_dtype is None else getattr(torch, plan.compute_dtype)


def local_path(plan: load_plan.LoadPlan) -> Path:
    return plan.path
