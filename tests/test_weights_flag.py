"""The `weights` setting and the `--weights` flag of bench, bench-device, calibrate, complete and serve.

Each flag refuses a format that does not exist with argparse's clear message, and each reaches
Engine.load(weights=...) (a recording Engine.load here: no model is loaded). The setting itself is an
engine key: a config file's bad value is reported and replaced by the default.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from completiond import config
from completiond.engine.engine import Engine, EngineError
from tests.conftest import ROOT, linked_model


@pytest.fixture
def loads(monkeypatch):
    """Every Engine.load call's weights argument; the load itself fails, as a missing model would."""
    seen: list[str | None] = []

    def fake_load(model=None, **kwargs):
        seen.append(kwargs.get("weights", "<not passed>"))
        raise EngineError("recorded, not loaded")

    monkeypatch.setattr(Engine, "load", staticmethod(fake_load))
    return seen


def parse(module, argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    module.add_arguments(p)
    return p.parse_args(argv)


@pytest.mark.parametrize("command", ["bench", "bench-device", "calibrate", "complete", "serve"])
def test_an_unknown_format_is_refused(command):
    args = ["x.py:1:1"] if command == "complete" else []
    out = subprocess.run([sys.executable, "-m", "completiond.cli", command, *args, "--weights", "fp8"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2
    error = out.stderr.strip().splitlines()[-1]  # argparse's one line after the usage
    assert "--weights" in error and "fp8" in error and all(v in error for v in ("auto", "bf16", "int8")), error


def test_bench_and_calibrate_pass_the_flag(loads, capsys):
    from completiond.commands import bench, calibrate

    assert bench.run(parse(bench, ["--weights", "int8"])) == 1
    assert calibrate.run(parse(calibrate, ["--weights", "bf16"])) == 1
    assert parse(bench, []).weights == "auto"
    assert loads == ["int8", "bf16"]
    assert "recorded, not loaded" in capsys.readouterr().err


def test_complete_passes_the_flag_and_the_setting(loads, tmp_path, capsys):
    from completiond.commands import complete

    src = tmp_path / "a.py"
    src.write_text("def f():\n    return 1\n")
    conf = tmp_path / "config.toml"
    conf.write_text('weights = "bf16"\n')
    target = f"{src}:2:5"
    assert complete.run(parse(complete, [target, "--weights", "int8", "--config", str(conf)])) == 1
    assert complete.run(parse(complete, [target, "--config", str(conf)])) == 1  # the config file's setting
    assert loads == ["int8", "bf16"]


def test_serve_puts_the_flag_into_the_daemons_settings(loads):
    from completiond.commands import serve
    from completiond.serving.lifecycle import load_engine

    cfg, errors = serve.config_from_args(parse(serve, ["--weights", "int8", "--config", "/nonexistent.toml"]))
    assert cfg.weights == "int8" and not errors
    assert config.engine_settings(cfg)["weights"] == "int8"  # an engine key: a different value reloads
    with pytest.raises(EngineError):
        load_engine(cfg)
    assert loads == ["int8"]


def test_a_bad_setting_is_reported_and_replaced(tmp_path):
    conf = tmp_path / "config.toml"
    conf.write_text('weights = "int4"\n')
    cfg, errors = config.load_file(conf)
    assert cfg.weights == "auto"
    assert len(errors) == 1 and "weights" in errors[0] and "int4" in errors[0]
    assert "weights" in config.ENGINE_KEYS


def test_auto_takes_the_models_cpu_weights_and_a_setting_overrides_it(tiny_model_dir, tmp_path, caplog):
    from completiond.engine import native
    from completiond.engine.model_info import CPU_WEIGHTS, ModelInfo

    assert set(CPU_WEIGHTS) == set(native.WEIGHT_FORMATS) - {"auto"}
    path = linked_model(tiny_model_dir, tmp_path / "model", {"cpu_weights": "int8"})
    assert ModelInfo.read(path).cpu_weights == "int8"
    auto = Engine.load(path, device="cpu")
    assert auto.weights == "int8"
    if auto.fwd.native is not None:  # where the native step runs, its panels are int8
        assert auto.weights_in_use() == "int8"
    assert Engine.load(path, device="cpu", weights="bf16").weights == "bf16"  # a setting wins over the record
    assert Engine.load(tiny_model_dir, device="cpu").weights == "auto"  # no record: the checkpoint's values
    (path / "completiond.json").write_text('{"cpu_weights": "int4"}')
    assert ModelInfo.read(path).cpu_weights is None  # an unknown format is ignored, and said
    assert "cpu_weights" in caplog.text
    assert Engine.load(path, device="cpu").weights == "auto"


def test_the_bundled_model_runs_int8_on_the_cpu_by_default(bundled_model_dir):
    """Its record names int8: `bench --quality` measured its held-out loss 0.0006 nats above bf16's (see the
    model card); the prefill, which a jump or an open waits for, is about a third faster (docs/PERFORMANCE.md)."""
    from completiond.engine.model_info import ModelInfo

    assert ModelInfo.read(bundled_model_dir).cpu_weights == "int8"


def test_bf16_of_a_bf16_model_is_its_own_values(bundled_model_dir, bundled_checkpoint_dir, tiny_model_dir):
    """weights = "bf16" on a model shipped in bf16 computes what "auto" did on its checkpoint, and keeps the PyTorch
    path beside the panels (bench's transformers baselines need it); on float32 weights bf16 rounds, so every pass
    reads the panels."""
    import torch

    bf16 = Engine.load(bundled_model_dir, device="cpu", weights="bf16")
    own = Engine.load(bundled_checkpoint_dir, device="cpu")
    if own.fwd.native is None:
        pytest.skip("no native step on this CPU")
    assert not bf16.fwd.native_all and bf16.weights_in_use() == own.weights_in_use() == "bf16"
    prompt = bf16.tokenizer("def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n").input_ids
    assert torch.equal(bf16.logits_for(prompt, use_cache=False), own.logits_for(prompt, use_cache=False))
    assert Engine.load(tiny_model_dir, device="cpu", weights="bf16").fwd.native_all
