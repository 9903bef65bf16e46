"""The load plan: what Engine.load will do for a model, decided before any weight is read. Torch-free.

`plan` resolves the model (a local directory, or a hub id fetched into the Hugging Face cache: never the
network at load), reads and checks its config.json, decides the dtype it is read in and computed in and
which reader reads it, and checks that it fits the device's memory. The loader (loader.py) carries the
plan out; what needs torch (the device's kind, bf16 support, the native step) it hands in as `Machine`.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from completiond.engine import hub, memory
from completiond.errors import EngineError

# Files beside a model's weights that are trained on it (keyed to its identity), not part of it: one
# list for the identity here and for what engine/hub.py counts as weights.
DRAFT_FILES = hub.DRAFT_FILES
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
READERS = ("auto", "transformers")


@dataclass(frozen=True)
class Machine:
    """What the loader found out with torch: the device, the dtype names, and two questions about the model
    only torch-side code answers (forward.packs_bf16_checkpoint, checkpoint.eligible)."""

    device: str
    dtype: str  # the dtype asked for, resolved (pick_dtype)
    packs_bf16: Callable[[dict, Path], bool]  # read as bf16 and pack layer by layer (CPU, native step)
    checkpoint_refusal: Callable[[dict, Path, bool], str | None]  # why engine/checkpoint.py cannot read it


@dataclass(frozen=True)
class LoadPlan:
    name: str  # what status displays call the model
    path: Path  # the local model directory
    config: dict  # config.json ({} when it is not an object)
    model_id: str  # model_identity(path): what calibration records and trained drafts key on
    device: str
    read_dtype: str  # the dtype the weights are read in
    compute_dtype: str | None  # float32 for a bf16 checkpoint read as bf16 only to be packed; None: read_dtype
    why_transformers: str | None  # why transformers' model classes read it (None: engine/checkpoint.py does)
    weights: str  # the native step's weight format (native.WEIGHT_FORMATS)
    warnings: list[str] = field(default_factory=list)  # memory: told to the user before the weights load


def plan(
    model: str | os.PathLike | None,
    machine: Machine,
    dtype: str,
    trust_remote_code: bool,
    cache_bytes: int | None,
    weights: str,
    reader: str,
    formats: tuple[str, ...],
    download_progress: Callable[[int, int], None] | None = None,
) -> LoadPlan:
    """The plan for loading model on machine; EngineError for a model or setting it refuses."""
    if weights not in formats:
        raise EngineError(f"unknown weights format {weights!r}; use {', '.join(formats)}")
    if reader not in READERS:
        raise EngineError(f"unknown reader {reader!r}; use auto or transformers")
    local, name = resolve(model, trust_remote_code, download_progress)
    config = checked_config(local, name, trust_remote_code)
    device, read_dtype = machine.device, machine.dtype
    refusal = memory.config_fit_error(name, config, local, DTYPE_BYTES[read_dtype], read_dtype, device)
    if refusal:
        raise EngineError(refusal)
    budget = cache_bytes if cache_bytes is not None else default_cache_bytes(device)
    warning = memory.fit_warning(name, local, DTYPE_BYTES[read_dtype], read_dtype, device, budget)
    # A large bf16 checkpoint on the CPU with the native step: read as bf16 and packed layer by layer
    # (forward.packs_bf16_checkpoint), never widened to float32 as a whole; computed in float32.
    compute_dtype = None
    if dtype == "auto" and device == "cpu" and config and machine.packs_bf16(config, local):
        read_dtype, compute_dtype = "bfloat16", "float32"
    model_id = model_identity(local)
    # engine/checkpoint.py reads every checkpoint it can, in any dtype: importing transformers' model code
    # costs about 150 MB of resident memory and seconds of every start, for modules only used as containers
    why = "asked for" if reader != "auto" else machine.checkpoint_refusal(config, local, trust_remote_code)
    return LoadPlan(
        name, local, config, model_id, device, read_dtype, compute_dtype, why, weights, [warning] if warning else []
    )


def resolve(
    model: str | os.PathLike | None, trust_remote_code: bool, download_progress: Callable[[int, int], None] | None
) -> tuple[Path, str]:
    """(local directory, display name): the bundled model for none, a local path as it is, else a hub id or
    short name fetched into the Hugging Face cache (engine/hub.py: the cache first, failing fast offline)."""
    if not model:
        from completiond.models import default_model_dir

        local = default_model_dir()
        check_weights(local)
        return local, f"{local.name} (bundled)"
    local = Path(model).expanduser()
    if hub.is_local(model):  # a path written as one; a hub id or short name never means a folder here
        check_weights(local)
        return local, hub.name_for_path(local) or str(local.resolve())
    try:
        pulled = hub.pull(str(model), trust_remote_code=trust_remote_code, progress=download_progress)
    except hub.HubError as exc:
        raise EngineError(f"cannot load model {model!r}: {exc}") from None
    check_weights(pulled.path)
    return pulled.path, pulled.name


def checked_config(local: Path, name: str, trust_remote_code: bool) -> dict:
    """config.json as a dict, after the checks made before anything is allocated or read by a library: side
    files are regular files under a cap, config.json's sizes within bounds."""
    try:
        config = hub.read_json(local / "config.json")
    except (OSError, ValueError) as exc:
        raise EngineError(f"cannot load model {name}: config.json is unreadable: {exc}") from None
    raw = config if isinstance(config, dict) else {}
    try:
        hub.check_side_files(local)
        hub.check_config(name, raw, trust_remote_code)
    except hub.HubError as exc:
        raise EngineError(f"cannot use model {name}: {exc}") from None
    return raw


def default_cache_bytes(device: str) -> int:
    return (512 if device == "cpu" else 4096) << 20


def check_weights(path: Path) -> None:
    """Refuse a local model directory without safetensors weights."""
    if not path.is_dir():
        raise EngineError(f"model directory {path} does not exist")
    if not (path / "config.json").is_file():
        raise EngineError(f"{path} is not a transformers model directory: config.json is missing")
    if any(path.glob("*.safetensors")):
        return
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in {".bin", ".pt", ".pth", ".ckpt", ".pkl"})
    if pickles:
        raise EngineError(
            f"refusing to load {path}: it has only pickle weights ({', '.join(pickles)}), which can run "
            "arbitrary code when loaded. Convert them to safetensors first."
        )
    raise EngineError(f"no *.safetensors weights in {path}")


def model_identity(path: Path | str) -> str:
    """A stable id for calibration records: config plus the weight files' names, sizes and headers."""
    h = hashlib.sha256()
    p = Path(path)
    if p.is_dir():
        h.update((p / "config.json").read_bytes())
        # Draft artifacts trained on this model live beside it and are keyed to this identity.
        for w in sorted(q for q in p.glob("*.safetensors") if q.name not in DRAFT_FILES):
            h.update(w.name.encode())
            h.update(str(w.stat().st_size).encode())
            with w.open("rb") as f:
                h.update(f.read(65536))
    else:
        h.update(str(path).encode())
    return h.hexdigest()[:16]
