"""Bounded model metadata (issue 31, item 4): a model directory cannot make a load exhaust memory.

config.json values past sane limits, or describing far more than the weight files hold, are refused
before anything is allocated; every side file (config, tokenizer, completiond.json, calibration
records) is read as a regular file under a cap, so a link to /dev/zero or a FIFO fails at once with
its name instead of reading gigabytes. Before: 1,000,000 layers ran 214 s to 7.4 GB and
std::bad_alloc; completiond.json -> /dev/zero read 5 GB, then MemoryError; a huge vocabulary or
intermediate size ended in a RuntimeError.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from completiond.engine import hub, memory
from completiond.engine.engine import Engine, EngineError
from completiond.engine.model_info import ModelInfo
from completiond.fileio import UnsafeFile, read_file


def copy_with(tiny_model_dir: Path, tmp_path: Path, **config_changes) -> Path:
    path = tmp_path / "model"
    shutil.copytree(tiny_model_dir, path)
    if config_changes:
        cfg = json.loads((path / "config.json").read_text())
        cfg.update(config_changes)
        (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("key, value", [("num_hidden_layers", 1_000_000), ("vocab_size", 1 << 40),
                                        ("intermediate_size", 10**12), ("hidden_size", 1 << 20),
                                        ("num_attention_heads", 100_000), ("max_position_embeddings", 1 << 40),
                                        ("num_hidden_layers", 0), ("vocab_size", "32000"), ("hidden_size", True)])
def test_config_values_past_the_limits_are_refused_before_allocation(tiny_model_dir, tmp_path, key, value):
    path = copy_with(tiny_model_dir, tmp_path, **{key: value})
    with pytest.raises(EngineError, match=f"{key} = {value!r}"):
        Engine.load(path, device="cpu")
    with pytest.raises(hub.HubError, match=key):  # `completiond pull` refuses it before fetching weights
        hub.check_config("org/m", json.loads((path / "config.json").read_text()))


@pytest.mark.parametrize("key, value", [("rms_norm_eps", "small"), ("num_key_value_heads", 2.5),
                                        ("tie_word_embeddings", "yes")])
def test_a_config_value_of_the_wrong_type_is_a_clear_error(tiny_model_dir, tmp_path, key, value):
    # transformers' config classes check types with their own exception class, not a ValueError
    path = copy_with(tiny_model_dir, tmp_path, **{key: value})
    with pytest.raises(EngineError, match=f"cannot (load|use) model .*{key}"):
        Engine.load(path, device="cpu")


@pytest.mark.parametrize("key, value", [("num_hidden_layers", 1000), ("vocab_size", 2_000_000),
                                        ("intermediate_size", 1 << 20)])
def test_a_config_that_describes_more_than_its_weights_is_refused_naming_the_value(tiny_model_dir, tmp_path,
                                                                                    key, value):
    # Within the limits, but the weight files hold a tiny model: transformers would allocate the rest.
    path = copy_with(tiny_model_dir, tmp_path, **{key: value})
    with pytest.raises(EngineError, match=f"{key}={value:,}.*weight files hold") as err:
        Engine.load(path, device="cpu")
    assert "GiB" in str(err.value) and "refusing" in str(err.value)


def test_without_countable_weights_the_config_estimate_meets_the_available_memory(tiny_model_dir, tmp_path):
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    cfg["num_hidden_layers"] = 1000
    message = memory.config_fit_error("m", cfg, None, 4, "float32", "cpu", available=1 << 20)
    assert "num_hidden_layers=1,000" in message and "0.0 GiB available" in message
    assert memory.config_fit_error("m", cfg, None, 4, "float32", "cpu", available=1 << 40) == ""
    # The estimate is the weights' own count for a real model (the bundled one: exact).
    assert memory.config_parameters(cfg | {"num_hidden_layers": 2}) > 0
    honest = json.loads((tiny_model_dir / "config.json").read_text())
    assert memory.config_fit_error("m", honest, tiny_model_dir, 4, "float32", "cpu", available=1000) == ""


@pytest.mark.parametrize("name", ["completiond.json", "tokenizer.json", "tokenizer_config.json", "config.json",
                                  "generation_config.json"])
def test_a_side_file_linked_to_dev_zero_fails_at_once(tiny_model_dir, tmp_path, name):
    path = copy_with(tiny_model_dir, tmp_path)
    if (path / name).exists():
        (path / name).unlink()
    (path / name).symlink_to("/dev/zero")
    with pytest.raises(EngineError, match="not a regular file|config.json is missing"):
        Engine.load(path, device="cpu")


def test_model_info_and_side_files_refuse_fifos_and_oversized_files(tmp_path):
    (tmp_path / "completiond.json").symlink_to("/dev/zero")
    with pytest.raises(UnsafeFile, match="character device"):
        ModelInfo.read(tmp_path)
    (tmp_path / "completiond.json").unlink()
    os.mkfifo(tmp_path / "completiond.json")           # opened non-blocking: nothing waits on a writer
    with pytest.raises(UnsafeFile, match="FIFO"):
        ModelInfo.read(tmp_path)
    with pytest.raises(hub.HubError, match="FIFO"):
        hub.check_side_files(tmp_path)
    (tmp_path / "completiond.json").unlink()
    os.mkfifo(tmp_path / "model.safetensors")             # weights too: a FIFO would block the load
    with pytest.raises(hub.HubError, match="model.safetensors is not a regular file"):
        hub.check_side_files(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    big = tmp_path / "tokenizer.json"
    with big.open("wb") as f:
        f.truncate(hub.SIDE_FILE_LIMITS["tokenizer.json"] + 1)  # sparse: no disk used
    with pytest.raises(UnsafeFile, match="over the"):
        read_file(big, hub.SIDE_FILE_LIMITS["tokenizer.json"])
    with pytest.raises(UnsafeFile, match="over the"):
        hub.read_json(big)
    (tmp_path / "ok.json").write_text('{"a": 1}')
    assert hub.read_json(tmp_path / "ok.json") == {"a": 1}


def test_a_calibration_record_linked_to_dev_zero_is_ignored_at_once(tmp_path, monkeypatch):
    from completiond.engine import calibration

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    record = calibration.record_path("0123456789abcdef")
    record.parent.mkdir(parents=True)
    record.symlink_to("/dev/zero")
    cal = calibration.load_calibration("0123456789abcdef", None, 10)
    assert cal.source == "heuristic"


def test_a_draft_file_that_is_a_fifo_or_a_device_is_skipped_at_once(tiny_model_dir, tmp_path):
    import threading

    path = copy_with(tiny_model_dir, tmp_path)
    os.mkfifo(path / "exit_adapter.safetensors")        # nothing ever writes it: opening it would block for good
    (path / "medusa_heads.safetensors").symlink_to("/dev/zero")
    loaded: list = []
    worker = threading.Thread(target=lambda: loaded.append(Engine.load(path, device="cpu")), daemon=True)
    worker.start()
    worker.join(120)
    try:
        assert loaded, "the load blocked on the FIFO"
        assert loaded[0].exit_adapter is None and loaded[0].medusa is None
    finally:
        try:  # unblock a load stuck in open() (the old behaviour), so the thread can end
            os.close(os.open(path / "exit_adapter.safetensors", os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
