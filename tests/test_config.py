"""The settings object: typed defaults, validation with fallback, layering, and the settings table."""

from __future__ import annotations

import pytest

from completiond import config
from tests.conftest import ROOT

pytestmark = pytest.mark.torch_free  # also run on the lowest supported Python, without torch (.ci/run)


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
    """The full settings table lives in editors/README.md (editors/sync_settings.py writes it), which the
    README links to: the README stays short (issue 28) and the table has one copy to keep in step."""
    readme = (ROOT / "README.md").read_text()
    assert "(editors/README.md#settings)" in readme, "README.md lost its link to the settings table"
    assert "<!-- settings-table" not in readme, "a second copy of the settings table in README.md would go stale"
    editors = (ROOT / "editors" / "README.md").read_text()
    assert "\n## Settings\n" in editors
    assert config.markdown_table() in editors, "editors/README.md settings table is stale: run editors/sync_settings.py"


def test_config_file_reading_is_guarded(tmp_path):
    """Issue 16 item 7: a config nested 100,000 deep crashed with RecursionError, a symlink to
    /dev/zero read gigabytes, a FIFO blocked start-up. Each is now reported and the defaults kept."""
    import os
    import threading

    deep = tmp_path / "deep.toml"
    deep.write_text("x = " + "[" * 100_000 + "]" * 100_000 + "\n")
    zero = tmp_path / "zero.toml"
    zero.symlink_to("/dev/zero")
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    big = tmp_path / "big.toml"
    big.write_text("# padding\n" * 200_000)          # 2 MB: over the cap
    linked = tmp_path / "linked.toml"                 # a symlink to a regular file is fine (dotfile managers)
    (tmp_path / "real.toml").write_text("maxTokens = 7\n")
    linked.symlink_to(tmp_path / "real.toml")
    results = {}

    def load_all():
        for path in (deep, zero, fifo, big, linked):
            results[path.name] = config.load_file(path)

    reader = threading.Thread(target=load_all, daemon=True)  # a FIFO would block it forever before the fix
    reader.start()
    reader.join(60)
    assert not reader.is_alive(), f"load_file blocked; done so far: {sorted(results)}"
    for name, why in (("deep.toml", "nested too deeply"), ("zero.toml", "not a regular file"),
                      ("fifo.toml", "not a regular file"), ("big.toml", "limit")):
        cfg, errors = results[name]
        assert cfg == config.defaults() and len(errors) == 1 and why in errors[0] and name in errors[0], (name, errors)
    assert results["linked.toml"] == (config.merge(config.defaults(), {"maxTokens": 7})[0], [])


def test_context_exclude_extends_but_cannot_weaken_the_deny_list():
    cfg, errors = config.merge(config.defaults(), {"contextExclude": "*.sql, fixtures/*"})
    assert errors == [] and cfg.context_exclude == "*.sql, fixtures/*"
    cfg, errors = config.merge(config.defaults(), {"contextExclude": "*.sql,!.env"})
    assert cfg.context_exclude == "" and "!.env" in errors[0] and "not re-include" in errors[0]


def test_config_is_written_out_one_typed_field_per_setting():
    """Config is a plain dataclass a type checker reads: each field is annotated with its setting's type and
    carries that setting's metadata; SETTINGS is those fields, in order, under their camelCase keys."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(config.Config)
    fields = dataclasses.fields(config.Config)
    assert [f.name for f in fields] == [s.attr for s in config.SETTINGS]
    for f, s in zip(fields, config.SETTINGS):
        assert hints[f.name] is s.type and f.default == s.default and type(f.default) is s.type
        assert f.metadata["setting"]["description"] == s.description and s.group in dict(config.GROUPS)
    assert config.SETTINGS_BY_KEY["apiKeyOverHttp"].attr == "api_key_over_http"
    assert config.SETTINGS_BY_KEY["endpoint"].restricted and config.SETTINGS_BY_KEY["endpoint"].scope == "machine"


def test_request_config_merges_per_request_settings_once():
    base = config.Config()
    asked = {"maxTokens": 7, "model": "someone/else", "backend": "local", "contextTokens": 100}
    cfg = config.request_config(base, asked)
    assert cfg == config.merge(base, {"maxTokens": 7, "backend": "local", "contextTokens": 100})[0]
    assert cfg.max_tokens == 7 and cfg.model == base.model  # an engine setting is the daemon's own
    assert config.request_config(base, dict(asked)) is cfg  # every keystroke asks the same: merged once
    other = config.merge(base, {"maxTokens": 9})[0]
    assert config.request_config(other, asked).max_tokens == 7 and config.request_config(other, asked) is not cfg
    # A malformed value (unhashable) is merged uncached, and merge's own checks reject it.
    assert config.request_config(base, {"maxTokens": [1, 2]}).max_tokens == base.max_tokens
    assert config.request_config(base, None) == base
    # Equal values of other types are other requests: True is no int, so maxTokens keeps its value.
    assert config.request_config(base, {"maxTokens": 1}).max_tokens == 1
    assert config.request_config(base, {"maxTokens": True}) == config.merge(base, {"maxTokens": True})[0]


def test_settings_read_by_attribute_name_match_the_keys():
    cfg = config.merge(config.Config(), {"maxTokens": 5, "tokenHealing": False})[0]
    out = config.to_settings(cfg)
    assert out["maxTokens"] == 5 and out["tokenHealing"] is False and list(out) == [s.key for s in config.SETTINGS]
