"""Whether the native step can run a model (unsupported: the device, dtype, head shape and activation it
needs), and giving the heap back after packing (trim_heap). Plain checks on a Forward's attributes: like
binding.py, this never imports forward.py.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch


def trim_heap() -> None:
    """Give freed heap pages back to the system (glibc's malloc_trim): the unpacked weights dropped after
    packing were many mid-sized blocks, which glibc keeps mapped otherwise, so resident memory would
    still count them."""
    try:
        libc = ctypes.CDLL(None)
        libc.malloc_trim(ctypes.c_size_t(0))
    except (OSError, AttributeError):
        pass  # not glibc: nothing to trim with


def unsupported(fwd: Any) -> str | None:
    """Why this Forward cannot use the native step (None: it can)."""
    if str(fwd.device) != "cpu":
        return f"the model runs on {fwd.device}"
    if fwd.dtype != torch.float32:
        return f"the model runs in {fwd.dtype}, the native step in float32 only"
    if fwd.hd % 8 or fwd.H % fwd.KV:
        return f"head size {fwd.hd} (needs a multiple of 8) or {fwd.H} heads over {fwd.KV} KV heads"
    for L in fwd.layers:
        why = _activation_unsupported(L.act)
        if why is not None:
            return why
    return None


def _activation_unsupported(act: Any) -> str | None:
    if type(act).__name__ not in ("SiLUActivation", "SiLU"):
        return f"the MLP activation is {type(act).__name__}, the native step has SiLU only"
    return None
