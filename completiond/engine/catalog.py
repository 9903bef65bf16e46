"""The short names `completiond pull` knows: hub ids of supported code models, with their size and speed
estimates (the README's model table is catalog_table(); a test keeps them in step). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from completiond.models.adapters import FAMILIES


@dataclass(frozen=True)
class CatalogEntry:
    name: str  # the short name `completiond pull` accepts
    repo: str  # hub id
    params_b: float  # parameters, billions
    family: str  # config.json model_type
    fim: str  # FIM template (models/fim.py), "" when the model has none
    early_exit: str  # how well its early exits draft
    gated: bool = False  # the hub asks users to accept a licence first
    # The languages it serves, as editors name them; ("*",): the many its authors list (Qwen2.5-Coder 92,
    # DeepSeek-Coder 87, StarCoder2 600+, Code Llama the common ones), so any document is asked.
    languages: tuple[str, ...] = ("*",)

    @property
    def supported(self) -> bool:
        return self.family in FAMILIES


# Memory is the weights alone (the KV cache budget, cacheMegabytes, comes on top). The speed
# classes are estimates: batch-1 decoding streams every weight once per token, so one token costs
# about weight bytes / memory bandwidth (a GPU at 1 TB/s in bfloat16; on the CPU the native step in bf16
# or int8 at the 30 GB/s the development machine's 2 cores copy at, which its bench-device runs of the
# 0.5B and 1.5B shapes matched within 30 %: docs/PERFORMANCE.md); speculation can divide that by up to
# its tokens per round.
CPU_BANDWIDTH = 30e9
GPU_BANDWIDTH = 1e12
CATALOG: tuple[CatalogEntry, ...] = (
    CatalogEntry(
        "qwen2.5-coder-0.5b",
        "Qwen/Qwen2.5-Coder-0.5B",
        0.49,
        "qwen2",
        "qwen2.5-coder",
        "ordinary model: calibrate decides",
    ),
    CatalogEntry(
        "qwen2.5-coder-1.5b",
        "Qwen/Qwen2.5-Coder-1.5B",
        1.54,
        "qwen2",
        "qwen2.5-coder",
        "ordinary model: calibrate decides",
    ),
    CatalogEntry(
        "qwen2.5-coder-7b", "Qwen/Qwen2.5-Coder-7B", 7.62, "qwen2", "qwen2.5-coder", "ordinary model: calibrate decides"
    ),
    CatalogEntry(
        "deepseek-coder-1.3b",
        "deepseek-ai/deepseek-coder-1.3b-base",
        1.35,
        "llama",
        "deepseek-coder",
        "ordinary model: calibrate decides",
    ),
    CatalogEntry(
        "codellama-7b", "codellama/CodeLlama-7b-hf", 6.74, "llama", "codellama", "ordinary model: calibrate decides"
    ),
    CatalogEntry(
        "layerskip-codellama-7b",
        "facebook/layerskip-codellama-7B",
        6.74,
        "llama",
        "codellama",
        "trained to exit early (LayerSkip): drafts well",
        gated=True,
    ),
    CatalogEntry("starcoder2-3b", "bigcode/starcoder2-3b", 3.03, "starcoder2", "starcoder", "ordinary model"),
)
CATALOG_BY_NAME = {e.name: e for e in CATALOG}
CATALOG_BY_REPO = {e.repo.lower(): e for e in CATALOG}


def _speed_class(ms: float) -> str:
    for limit, label in ((30, "fast"), (100, "usable"), (300, "slow")):
        if ms <= limit:
            return f"{label} (~{ms:.0f} ms/token)"
    return f"too slow (~{ms / 1000:.1f} s/token)"


def cpu_speed(e: CatalogEntry) -> str:
    """The CPU estimate in bf16 (the default for bf16 checkpoints) and int8 (`weights = "int8"`: one
    byte a weight, the per-channel scales negligible)."""
    bf16_ms, int8_ms = 1000 * e.params_b * 2e9 / CPU_BANDWIDTH, 1000 * e.params_b * 1e9 / CPU_BANDWIDTH
    label = _speed_class(int8_ms).split(" (")[0]
    return f"{label} (~{bf16_ms:.0f} / ~{int8_ms:.0f} ms/token)"


def catalog_table() -> str:
    """The README's table of short names (a test keeps README in step with CATALOG)."""
    rows = [
        "| short name | hub id | parameters | memory bf16 / fp32 | CPU (bf16 / int8) | GPU (bf16) | FIM | early exits |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for e in CATALOG:
        bf16, fp32 = e.params_b * 2e9, e.params_b * 4e9
        repo = f"`{e.repo}`" + (" (gated: accept its licence on the hub, then log in)" if e.gated else "")
        if e.supported:
            cpu, gpu = cpu_speed(e), _speed_class(1000 * bf16 / GPU_BANDWIDTH)
        else:
            cpu = gpu = f"not supported yet (the engine has no `{e.family}` layout)"
        rows.append(
            f"| `{e.name}` | {repo} | {e.params_b:.2f} B | {bf16 / 1e9:.1f} / {fp32 / 1e9:.1f} GB | {cpu} | "
            f"{gpu} | {e.fim or 'no'} | {e.early_exit} |"
        )
    return "\n".join(rows) + "\n"
