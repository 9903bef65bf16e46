"""The file format shared by drafts trained on a model (exit adapter, Medusa heads).

A safetensors file whose string metadata names its format and the identity of the model it was
trained on. A file of another format or another model is refused: a retrained model has another
identity, so it never drafts with weights trained on its predecessor.
"""

from __future__ import annotations

import json
from pathlib import Path


def save_tagged(path: Path, tensors: dict, meta: dict) -> Path:
    """Write tensors (name -> tensor) and metadata (str -> str) atomically."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(path)
    return path


def read_tagged(path: Path, fmt: str, what: str, model_identity: str, retrain: str,
                error: type[Exception]) -> tuple[dict, dict]:
    """(tensors, metadata) of the file at path, refused with `error` unless it is `fmt` for this model."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file, safe_open

    from completiond.fileio import check_file

    try:
        check_file(path, 1 << 40)  # a regular file: a FIFO would block the load, a device read forever
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
        tensors = load_file(str(path))
    except (OSError, SafetensorError) as exc:
        raise error(f"cannot read {what} {path}: {exc}") from exc
    if meta.get("format") != fmt:
        raise error(f"{path} holds no completiond {what} (format {meta.get('format')!r})")
    if meta.get("model_identity") != model_identity:
        raise error(f"{what} {path} was trained on another model (identity {meta.get('model_identity')}, this model "
                    f"is {model_identity}); retrain with `{retrain}`")
    return tensors, meta


def training_record(meta: dict) -> dict:
    """The JSON training summary a file's metadata carries ({} when missing or damaged)."""
    try:
        return json.loads(meta.get("training", "{}"))
    except ValueError:
        return {}
