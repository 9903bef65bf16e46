"""The daemon an editor starts serves the editor's engine settings (issue 31, item 3: draftModel never
reached it, so the daemon loaded without the draft and the editor warned of "different settings" for good)."""

from __future__ import annotations

import argparse
import os

from completiond import config
from completiond.commands import serve
from completiond.serving.client import daemon_command


def served_config(settings: dict, tmp_path):
    cmd = daemon_command(settings)
    assert cmd[3] == "serve"
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(cmd[4:] + ["--config", str(tmp_path / "no-config.toml")])
    cfg, errors = serve.config_from_args(args)
    assert not errors, errors
    return cfg


def test_every_engine_setting_reaches_the_daemon(tmp_path, monkeypatch):
    draft = tmp_path / "draft-model"
    draft.mkdir()
    monkeypatch.chdir(tmp_path)
    want = {"model": "Qwen/Qwen2.5-Coder-1.5B", "draftModel": "./draft-model", "device": "cpu", "dtype": "float32",
            "trustRemoteCode": True, "cacheMegabytes": 64, "backend": "openai", "endpoint": "https://gpu-box:8443",
            "endpointModel": "coder", "apiKeyEnv": "TEAM_KEY", "apiKeyFile": str(tmp_path / "key"),
            "endpointCaFile": str(tmp_path / "ca.pem"), "endpointTimeout": 7.5,
            "apiKeyOverHttp": "http://gpu-box:8000"}
    if "weights" in config.SETTINGS_BY_KEY:
        want["weights"] = "int8"
    assert set(config.ENGINE_KEYS) <= set(want), "a new engine setting: add it here and to daemon_command"
    editor, errors = config.merge(config.defaults(), want)
    assert not errors, errors
    daemon = served_config(config.to_settings(editor), tmp_path)
    assert daemon.draft_model == str(draft)          # a directory by absolute path: the daemon runs in /
    assert config.engine_differences(config.engine_settings(editor), config.engine_settings(daemon)) == []
    # A hub id stays a hub id.
    editor, _ = config.merge(config.defaults(), {"draftModel": "org/tiny-draft"})
    assert served_config(config.to_settings(editor), tmp_path).draft_model == "org/tiny-draft"
    # And none at all stays none.
    assert "--draft-model" not in daemon_command(config.to_settings(config.defaults()))
