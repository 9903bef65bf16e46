"""Will the model fit? Estimates made before any weight is read.

A model too large for the device does not fail cleanly: on a GPU the load ends in an
out-of-memory error after minutes, on a CPU the machine swaps or the kernel kills the
daemon. So the estimate (parameters x bytes per parameter in the load dtype, plus the KV
cache budget) is compared with what the device has free, and the user is told first.

Two estimates: from the safetensors headers (what the files hold: `fit_warning` warns and the
load goes on), and from config.json (what transformers will allocate before it reads a weight:
`config_fit_error` refuses). They differ only when config.json describes a bigger model than its
weights (num_hidden_layers = 1,000,000 beside a 6M-parameter file): transformers would build the
layers the files lack, for minutes, until the allocator gives up.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from completiond.engine import hub
from completiond.fileio import check_file

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


def fit_warning(
    name: str,
    model_dir: Path,
    bytes_per_param: int,
    dtype_name: str,
    device: str,
    cache_bytes: int,
    available: int | None = None,
) -> str:
    """A warning for the user when the model (or its KV cache budget) will not fit; '' when it will."""
    try:
        params = parameter_count(model_dir)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"cannot estimate the memory {name} needs ({exc}); loading it anyway"
    weights = params * bytes_per_param
    available = available_bytes(device) if available is None else available
    if available is None:
        return ""
    what = "free on the GPU" if device.startswith("cuda") else "available memory"
    if weights > available:
        hint = "pick a smaller model (`completiond pull --list`)" + (
            ", or dtype bfloat16 to halve it" if bytes_per_param == 4 else ""
        )
        return (
            f"{name} will probably not fit: its weights need about {weights / GIB:.1f} GiB in {dtype_name}, "
            f"and {device} has {available / GIB:.1f} GiB {what}; {hint}"
        )
    if weights + cache_bytes > available:
        return (
            f"{name} fits ({weights / GIB:.1f} GiB of weights in {dtype_name}), but with its KV cache budget of "
            f"{cache_bytes / GIB:.1f} GiB it may run out of memory ({available / GIB:.1f} GiB {what} on {device}); "
            "lower completiond.cacheMegabytes"
        )
    return ""


def config_parameters(config: dict) -> int:
    """Parameters the Llama-layout model config.json describes (embeddings, attention, gated MLP, norms),
    with transformers' Llama defaults for missing values. Plain integers: no value can overflow."""

    def value(key: str, default: int) -> int:
        v = config.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else default

    hidden, layers = value("hidden_size", 4096), value("num_hidden_layers", 32)
    vocab, inter = value("vocab_size", 32000), value("intermediate_size", 11008)
    heads = value("num_attention_heads", 32)
    kv = value("num_key_value_heads", heads)
    head_dim = value("head_dim", max(1, hidden // heads))
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv * head_dim
    per_layer = attention + 3 * hidden * inter + 2 * hidden
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2)
    return layers * per_layer + embeddings + hidden


# config.json may describe up to this much more than the weight files hold (estimates differ by biases,
# norms, tied heads) before the two are taken to disagree.
CONFIG_SLACK = 1.5
CONFIG_SLACK_PARAMS = 10_000_000


def config_fit_error(
    name: str,
    config: dict,
    model_dir: Path | None,
    bytes_per_param: int,
    dtype_name: str,
    device: str,
    available: int | None = None,
) -> str:
    """Why the model config.json describes must not be allocated (naming the values), or ''.

    Refused: a config describing more parameters than the weight files hold (beyond CONFIG_SLACK):
    transformers would allocate the difference, minutes of it or more than the machine has, and fill
    it with random values, or fail with a size mismatch after the allocation; and, when the files
    cannot be counted, a config whose weights need more than the available memory. An honest model
    that is merely too large gets fit_warning's warning instead, and loads if the user insists."""
    params = config_parameters(config)
    need = params * bytes_per_param
    held = None
    if model_dir is not None:
        try:
            held = parameter_count(model_dir)
        except (OSError, ValueError, KeyError, TypeError):
            held = None
    available = available_bytes(device) if available is None else available
    values = ", ".join(
        f"{k}={config[k]:,}"
        for k, _ in hub.CONFIG_LIMITS
        if isinstance(config.get(k), int) and not isinstance(config.get(k), bool) and k != "max_position_embeddings"
    )
    what = (
        f"cannot load {name}: its config.json ({values}) describes about {params:,} parameters, "
        f"{need / GIB:,.1f} GiB in {dtype_name}"
    )
    room = (
        f"{available / GIB:.1f} GiB available on {device}" if available is not None else f"unknown memory on {device}"
    )
    if held is not None:
        if params > CONFIG_SLACK * held + CONFIG_SLACK_PARAMS:
            return f"{what}, but its weight files hold {held:,} ({room}); refusing to allocate a model its weights do not fill"
        return ""
    if available is not None and need > available:
        return f"{what}, more than the {room}; refusing to allocate it"
    return ""


# --- sizes before loading ---------------------------------------------------------------------

MAX_HEADER = 100 << 20  # safetensors caps its JSON header at 100 MB


def parameter_count(model_dir: Path) -> int:
    """Parameters in a directory's safetensors weights, from the file headers only (no tensor is read)."""
    model_dir = Path(model_dir)
    index = model_dir / hub.INDEX_FILE
    files = (
        [model_dir / s for s in hub.shards(model_dir)]
        if index.is_file()
        else sorted(p for p in model_dir.glob("*.safetensors") if p.name not in hub.DRAFT_FILES)
    )
    total = 0
    for path in files:
        check_file(path, 1 << 50)  # a regular file (a FIFO here would block the read below)
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError(f"{path}: not a safetensors file")
            (length,) = struct.unpack("<Q", raw)
            if length > MAX_HEADER:
                raise ValueError(f"{path}: header of {length} bytes")
            header = hub.loads_json(f.read(length), f"{path.name}'s header")
        if not isinstance(header, dict):
            raise ValueError(f"{path}: its header is not a JSON object")
        for key, entry in header.items():
            if key == "__metadata__" or not isinstance(entry, dict):
                continue
            n = 1
            try:
                for d in entry.get("shape", []):
                    n *= int(d)
            except TypeError:
                raise ValueError(f"{path}: tensor {key!r} has a malformed shape") from None
            total += n
    return total
