"""The first-run offer: on the first start with no model configured, the language server asks once
(`window/showMessageRequest`, which every client renders natively) whether to download the code model
recommended for this machine, with its download size and expected speed.

- Accepted: the model becomes this user's default (kept in `first-run.json` beside config.toml, applied
  only while no `model` is set anywhere); the daemon restarts with it and downloads it, with progress in
  the editor, resuming a download that was interrupted (engine/resumable.py keeps the partial weights and continues them with a Range request).
- Declined, or the download fails (offline, hub unreachable, disk full): the bundled model stays, with
  one notice saying how to get the model later (`completiond pull`).
- Asked once: the answer is recorded and the question never comes again; setting `model` or running
  `completiond pull` and setting it is the way to change models afterwards.

Torch-free: the recommendation reads the machine's memory (and `nvidia-smi`, for a GPU's free memory).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from completiond import config as config_mod
from completiond.config import Config

log = logging.getLogger(__name__)

STATE_FILE = "first-run.json"
DOWNLOAD = "Download"
NOT_NOW = "Not now"
GIB = 1 << 30


@dataclass(frozen=True)
class Offer:
    name: str  # catalog short name
    repo: str  # hub id (what `model` is set to)
    weights: str  # "int8" where the CPU runs it quantised, else "auto"
    download_gb: float  # bf16 weights
    speed: str  # what to expect here
    device: str  # "cpu" or "cuda"

    def message(self) -> str:
        return (
            f"completiond: the bundled model is a small Python-only demo. Download {self.repo} "
            f"({self.download_gb:.1f} GB; on this machine's {self.device.upper() if self.device == 'cuda' else 'CPU'}"
            f"{' in int8' if self.weights == 'int8' else ''}: {self.speed}) for suggestions in every language? "
            "It loads here once downloaded; `completiond pull --list` shows the others."
        )


def state_path() -> Path:
    return config_mod.config_file_path().parent / STATE_FILE


def read_state() -> dict[str, Any]:
    try:
        data = json.loads(state_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_state(state: dict[str, Any]) -> None:
    path = state_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{STATE_FILE}.{os.getpid()}")
        tmp.write_text(json.dumps(state, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:  # the offer then comes again next time: better than failing the editor
        log.warning("cannot record the first-run answer in %s: %s", path, exc)


def _gpu_free_bytes() -> int | None:
    """The first NVIDIA GPU's free memory, from nvidia-smi (no torch here); None without one."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        ).stdout
        return int(out.split()[0]) * (1 << 20)
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def recommend(gpu_free: int | None = None, memory: int | None = None, cores: int | None = None) -> Offer:
    """The catalog model for this machine: on a GPU, the largest that fits its free memory with room for the
    KV cache; on a CPU, the 0.5B model, or the 1.5B one in int8 where memory and cores allow it."""
    from completiond.engine import hub

    def offer(name: str, weights: str, device: str) -> Offer:
        e = hub.CATALOG_BY_NAME[name]
        if device == "cuda":
            ms = 1000 * e.params_b * 2e9 / hub.GPU_BANDWIDTH
            speed = f"~{ms:.0f} ms/token"
        else:
            ms = 1000 * e.params_b * (1e9 if weights == "int8" else 2e9) / hub.CPU_BANDWIDTH
            speed = f"~{ms:.0f} ms/token"
        return Offer(name=name, repo=e.repo, weights=weights, download_gb=e.params_b * 2, speed=speed, device=device)

    if gpu_free is not None:
        for name in ("qwen2.5-coder-7b", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"):
            if hub.CATALOG_BY_NAME[name].params_b * 2e9 * 1.5 <= gpu_free:
                return offer(name, "auto", "cuda")
    if memory is not None and memory >= 8 * GIB and (cores or 0) >= 8:
        return offer("qwen2.5-coder-1.5b", "int8", "cpu")
    return offer("qwen2.5-coder-0.5b", "auto", "cpu")


def machine_offer() -> Offer:
    from completiond.engine.memory import available_bytes

    return recommend(gpu_free=_gpu_free_bytes(), memory=available_bytes("cpu"), cores=os.cpu_count())


def accepted_settings() -> dict[str, Any]:
    """The settings the user accepted at the first run (empty when they did not, or the download failed)."""
    state = read_state()
    model = state.get("model")
    if not isinstance(model, str) or not model:
        return {}
    weights = state.get("weights") if state.get("weights") in ("auto", "int8") else "auto"
    return {"model": model, "weights": weights}


def should_offer(cfg: Config) -> bool:
    """No model set anywhere, a local engine, and never asked before."""
    return not cfg.model and cfg.backend == "local" and not read_state().get("asked")


def record(answer: str, offer: Offer) -> dict[str, Any]:
    state = {"asked": True, "answer": answer, "offered": offer.repo}
    if answer == DOWNLOAD:
        state.update(model=offer.repo, weights=offer.weights)
    write_state(state)
    return state


def download_failed(error: str) -> None:
    """The accepted model could not be downloaded or loaded: back to the bundled model, for good (the
    user pulls it when they can)."""
    state = read_state()
    state.pop("model", None)
    state.pop("weights", None)
    state["failed"] = error[:500]
    write_state(state)


def declined_notice(offer: Offer) -> str:
    return (
        f"using the bundled model (Python only). For suggestions in every language: `completiond pull "
        f'{offer.name}`, then set model = "{offer.repo}"'
    )
