"""Shared fixtures: tiny random models built on the spot, and the bundled model.

Nothing here touches the network. The tiny models get a small byte-level BPE
trained in the test, so they load through AutoTokenizer exactly like real ones.
"""

from __future__ import annotations

import os
from pathlib import Path

# Tests drive tiny models whose ops are too small to gain from threads, and the
# machines that run them are shared: extra threads only wait on each other.
# Set before torch loads, so server subprocesses started by tests inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
# The user's cache holds calibration records (`completiond calibrate` writes one per model to
# ~/.cache/completiond/calibration/): a test that loads the bundled model must see its shipped
# defaults, not what a calibration run on this machine stored. CI runs where sessions calibrated.
import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="completiond-tests-cache-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], ignore_errors=True)
# The native step's builds (a compile per kernel, ~12 s of CPU each) are shared by the whole run: the
# pytest-xdist workers inherit this from the process that starts them, tests that give themselves a fresh
# XDG_CACHE_HOME keep using it, and so do the daemons and commands the tests start. Tests of building and
# caching itself drop it (tests/emulated_kernels.py real_build). Calibration records stay per process.
if not os.environ.get("COMPLETIOND_NATIVE_CACHE"):
    os.environ["COMPLETIOND_NATIVE_CACHE"] = tempfile.mkdtemp(prefix="completiond-tests-native-")
    atexit.register(shutil.rmtree, os.environ["COMPLETIOND_NATIVE_CACHE"], ignore_errors=True)
# Daemons the tests start listen in a runtime directory of their own per process (parallel workers never
# meet, and a developer's own daemon is never touched); tests that need one per test set it themselves.
os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="completiond-tests-run-")
atexit.register(shutil.rmtree, os.environ["XDG_RUNTIME_DIR"], ignore_errors=True)

import pytest  # noqa: E402  (after the environment above is set)

ROOT = Path(__file__).resolve().parent.parent

if os.environ.get("COMPLETIOND_TEST_CPU"):  # e.g. avx512-bf16: tests/emulated_kernels.py's emulate_cpu
    from tests import emulated_kernels

    emulated_kernels.emulate_cpu(os.environ["COMPLETIOND_TEST_CPU"].strip().lower())

from completiond.models.tiny import SPECIAL_TOKENS, build_tokenizer, make_tiny_model  # noqa: F401,E402  (fixtures below; tests import them from here)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), family="qwen2", seed=1)


@pytest.fixture(scope="session")
def bundled_model_dir() -> Path:
    from completiond.models import default_model_dir

    path = default_model_dir()
    assert (path / "config.json").is_file(), f"bundled model missing at {path}: run `completiond train-default`"
    return path


def linked_model(model_dir: Path, out: Path, record: dict) -> Path:
    """model_dir's files linked into the new folder out, with `record` as its completiond.json."""
    import json

    out.mkdir()
    for f in model_dir.iterdir():
        if f.name != "completiond.json":
            (out / f.name).symlink_to(f)
    (out / "completiond.json").write_text(json.dumps(record))
    return out


@pytest.fixture(scope="session")
def bundled_checkpoint_dir(bundled_model_dir, tmp_path_factory) -> Path:
    """The bundled model as its checkpoint holds it: its record without "cpu_weights", so weights = "auto" keeps the
    checkpoint's values (the tests that hold the engine to transformers' modules need those)."""
    import json

    record = json.loads((bundled_model_dir / "completiond.json").read_text())
    record.pop("cpu_weights", None)
    return linked_model(bundled_model_dir, tmp_path_factory.mktemp("bundled") / "checkpoint", record)


_HF_MODELS: dict[tuple, object] = {}


def hf_model(source, dtype=None):
    """transformers' own model of a checkpoint: the reference the engine is held to. The engine reads the
    checkpoints it can without transformers' model code (engine/checkpoint.py: its modules have no forward
    pass), so tests that compare with transformers, or train on its forward pass, load the model here.
    source: an Engine (its directory, in the dtype it read the weights in) or a model directory (float32
    unless dtype says). One model per directory, dtype and weights for the worker process: tests only read
    them (training freezes the model and trains copies), and a load costs the import of transformers' model
    code and the checkpoint's read."""
    import torch
    from transformers import AutoModelForCausalLM

    if isinstance(source, (str, os.PathLike)):
        path, dtype = Path(source), dtype or torch.float32
    else:
        path, dtype = Path(source.model_dir), dtype or next(source.model.parameters()).dtype
    from completiond.engine.load_plan import DRAFT_FILES

    weights = sorted(w for w in path.glob("*.safetensors") if w.name not in DRAFT_FILES)  # not a draft beside it
    key = (str(path.resolve()), dtype, tuple((w.name, w.stat().st_mtime_ns, w.stat().st_size) for w in weights))
    if key not in _HF_MODELS:
        _HF_MODELS[key] = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    return _HF_MODELS[key]


def float32_kernel() -> str | None:
    """The widest native kernel this CPU runs that computes in float32 throughout (None: no native step).
    The AVX512_BF16 build rounds activation rows to bf16 for bf16 panels, so tests that hold the engine to
    transformers' float32 modules load it with this one (tests/test_native_bf16.py holds that build to its
    own reference)."""
    from completiond.engine import native

    usable = [k for k in native.supported_kernels() if native.library(k) is not None and not native.library(k).cd_bf16_dot()]
    return usable[-1] if usable else None


class float32_kernel_env:
    """COMPLETIOND_KERNEL set to float32_kernel() inside the block (engines loaded there keep it)."""

    def __enter__(self):
        self.saved = os.environ.get("COMPLETIOND_KERNEL")
        kernel = float32_kernel()
        if kernel:
            os.environ["COMPLETIOND_KERNEL"] = kernel

    def __exit__(self, *exc):
        if self.saved is None:
            os.environ.pop("COMPLETIOND_KERNEL", None)
        else:
            os.environ["COMPLETIOND_KERNEL"] = self.saved


# The files that take longest, slowest first (per-file totals of `--durations=0 --junitxml`, 2026-12-06): with a
# file per worker (`--dist loadfile`, `--no-loadscope-reorder` in pyproject.toml, which keeps this order rather
# than xdist's most-tests-first), a long one started last would leave the other workers idle at the end; the
# many short files fill in behind them.
SLOW_FILES = ("test_bench.py", "test_lsp.py", "test_bench_device.py", "test_vscode.py", "test_nvim.py",
              "test_native_cache.py", "test_edit_sync.py", "test_native_step.py", "test_first_run.py",
              "test_engine.py", "test_train_default.py", "test_complete.py", "test_humaneval.py",
              "test_bundled_model.py", "test_regex_cost.py", "test_load.py", "test_exit_adapter.py", "test_pull.py",
              "test_recovery.py", "test_bench_editing.py", "test_fuzz_wire.py", "test_draft_model.py",
              "test_first_contact.py", "test_tokenizer_light.py", "test_security_fallbacks.py", "test_prefetch.py",
              "test_memory.py", "test_daemon.py", "test_fuzz_lsp.py", "test_architecture.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its order


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: unknown under `-p no:xdist`
def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker more than the cores. Many tests wait on a daemon, an editor or a subprocess
    (measured: a quarter of two cores idle over a quiet run with one worker per core); the extra worker runs
    another file meanwhile. PYTEST_XDIST_AUTO_NUM_WORKERS still decides where it is set."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads it
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return cores + 1
