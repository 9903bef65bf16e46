"""The settings object: typed defaults, validation with fallback, layering, and the README table."""

from __future__ import annotations

import re

from completiond import config
from tests.conftest import ROOT


def test_defaults_are_complete_and_valid():
    cfg = config.defaults()
    for s in config.SETTINGS:
        value = getattr(cfg, s.attr)
        assert value == s.default
        # every default passes its own validation
        assert config.merge(cfg, {s.key: s.default}) == (cfg, [])


def test_invalid_values_fall_back_with_a_message():
    cfg, errors = config.merge(config.defaults(), {
        "maxTokens": "lots", "temperature": -1, "device": "tpu", "enable": 1, "topP": float("nan"),
        "noSuchSetting": 3, "seed": 2.5,
    })
    assert cfg == config.defaults()
    text = "\n".join(errors)
    for key in ("maxTokens", "temperature", "device", "enable", "topP", "noSuchSetting", "seed"):
        assert f"completiond.{key}" in text
    assert "expected one of auto, cpu, cuda, mps" in text


def test_valid_values_apply_and_null_means_unchanged():
    cfg, errors = config.merge(config.defaults(), {"maxTokens": 12.0, "temperature": 1, "multiline": "never", "model": None})
    assert errors == []
    assert (cfg.max_tokens, cfg.temperature, cfg.multiline, cfg.model) == (12, 1.0, "never", "")
    assert isinstance(cfg.temperature, float)


def test_non_object_settings_are_reported():
    cfg, errors = config.merge(config.defaults(), ["maxTokens", 3])
    assert cfg == config.defaults() and "must be an object" in errors[0]


def test_config_file_layering(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text('[completiond]\nmaxTokens = 9\ndevice = "gpu"\n')
    cfg, errors = config.load_file(path)
    assert cfg.max_tokens == 9 and cfg.device == "auto"
    assert len(errors) == 1 and str(path) in errors[0]
    path.write_text("maxTokens = [")
    cfg, errors = config.load_file(path)
    assert cfg == config.defaults() and "invalid TOML" in errors[0]
    assert config.load_file(tmp_path / "absent.toml") == (config.defaults(), [])
    path.write_bytes(b"\xff\xfe")
    assert "invalid TOML" in config.load_file(path)[1][0]


def test_readme_settings_table_matches_settings():
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- settings-table:[^>]*-->\n(.*?)<!-- /settings-table -->", readme, re.S)
    assert m, "README.md lost its settings table markers"
    assert m.group(1) == config.markdown_table(), "README settings table is stale: regenerate it from config.markdown_table()"
