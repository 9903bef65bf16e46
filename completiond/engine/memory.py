"""Will the model fit? An estimate from the safetensors headers, made before any weight is read.

A model too large for the device does not fail cleanly: on a GPU the load ends in an
out-of-memory error after minutes, on a CPU the machine swaps or the kernel kills the
daemon. So the estimate (parameters x bytes per parameter in the load dtype, plus the KV
cache budget) is compared with what the device has free, and the user is told first.
"""

from __future__ import annotations

import os
from pathlib import Path

from completiond.engine import hub

GIB = 1 << 30


def available_bytes(device: str) -> int | None:
    """Memory the model can use on the device now; None when it cannot be told."""
    if device.startswith("cuda"):
        import torch

        try:
            free, _total = torch.cuda.mem_get_info(torch.device(device))
        except (RuntimeError, AssertionError, ValueError):  # no driver, bad index
            return None
        return int(free)
    # CPU and Apple's unified memory: what the kernel could hand out without swapping.
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def fit_warning(name: str, model_dir: Path, bytes_per_param: int, dtype_name: str, device: str,
                cache_bytes: int, available: int | None = None) -> str:
    """A warning for the user when the model (or its KV cache budget) will not fit; '' when it will."""
    try:
        params = hub.parameter_count(model_dir)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"cannot estimate the memory {name} needs ({exc}); loading it anyway"
    weights = params * bytes_per_param
    available = available_bytes(device) if available is None else available
    if available is None:
        return ""
    what = "free on the GPU" if device.startswith("cuda") else "available memory"
    if weights > available:
        hint = ("pick a smaller model (`completiond pull --list`)" +
                (", or dtype bfloat16 to halve it" if bytes_per_param == 4 else ""))
        return (f"{name} will probably not fit: its weights need about {weights / GIB:.1f} GiB in {dtype_name}, "
                f"and {device} has {available / GIB:.1f} GiB {what}; {hint}")
    if weights + cache_bytes > available:
        return (f"{name} fits ({weights / GIB:.1f} GiB of weights in {dtype_name}), but with its KV cache budget of "
                f"{cache_bytes / GIB:.1f} GiB it may run out of memory ({available / GIB:.1f} GiB {what} on {device}); "
                "lower completiond.cacheMegabytes")
    return ""
