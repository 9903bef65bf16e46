"""Issue 43, the smaller findings: a squatted runtime directory no longer switches completion off for good;
only literal loopback addresses and `localhost` take an API key over plain http; every load failure is an
EngineError; the outside-workspace message in team mode says what really happens.
(Temporary native build directories: tests/test_native_cache.py.)"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import struct
import tempfile
from pathlib import Path

import pytest

from completiond import config
from completiond.serving import paths

# --- a squatted runtime directory ---------------------------------------------------------------------


@pytest.fixture
def squatted(tmp_path, monkeypatch):
    """$TMPDIR/completiond-<uid> planted writable by everyone, XDG_RUNTIME_DIR unset: the default runtime
    directory is unsafe. The fallback goes under this test's XDG_CACHE_HOME."""
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    fallback = paths.fallback_runtime_dir
    monkeypatch.setattr(paths, "fallback_runtime_dir", lambda: tmp_path / "cache" / "completiond" / "run")
    with monkeypatch.context() as m:
        m.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
        assert fallback() == tmp_path / "cache" / "completiond" / "run"   # the real one: under the cache folder
    planted = tmp_path / f"completiond-{os.getuid()}"
    planted.mkdir()
    os.chmod(planted, 0o777)
    assert paths.runtime_dir() == planted
    return planted


def test_an_unsafe_default_runtime_dir_falls_back_to_a_private_one(squatted, tmp_path):
    directory, notice = paths.usable_runtime_dir()
    assert directory == tmp_path / "cache" / "completiond" / "run" == paths.fallback_runtime_dir()
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    assert "writable by group or others" in notice and str(directory) in notice
    assert stat.S_IMODE(os.stat(squatted).st_mode) == 0o777          # left alone, never "fixed"
    assert paths.current_runtime_dir() == directory                  # where `status` and `stop` look
    with pytest.raises(paths.InsecureDirectoryError):                # an explicit directory is never replaced
        paths.usable_runtime_dir(squatted)


@pytest.mark.slow
async def test_completions_keep_working_with_a_squatted_runtime_dir(squatted, tmp_path, tiny_model_dir):
    from completiond.serving.client import DaemonSession

    notices: list[str] = []
    text = "def f(x):\n    return "
    session = DaemonSession(settings=lambda: {"model": str(tiny_model_dir), "device": "cpu", "idleTimeout": 30},
                            documents=lambda: {"file:///a.py": (1, text, "python")}, on_notice=notices.append)
    try:
        # The request waits behind the daemon's model load.
        result = await session.request("complete", {"uri": "file:///a.py", "version": 1, "offset": len(text),
                                                    "settings": {"maxTokens": 4}}, timeout=300)
        assert isinstance(result, dict) and "suggestions" in result, result
        assert session.directory == paths.fallback_runtime_dir()
        assert paths.socket_path(session.directory).exists() and not paths.socket_path(squatted).exists()
        await session.restart()                 # a restart finds the daemon in the fallback
        assert session.connected and len(notices) == 1, notices      # one message, not one per connect
    finally:
        if session.connected:
            await session._stop_and_wait()
        await session.close()


# --- loopback for plain http ----------------------------------------------------------------------------


def test_only_literal_loopback_and_localhost_count_as_loopback(monkeypatch):
    from completiond.backends import http
    from completiond.backends.team_server import TeamServer, TeamServerError

    for host in ("localhost", "LOCALHOST", "localhost.", "127.0.0.1", "127.8.9.10", "::1", "[::1]"):
        assert http.is_loopback(host), host
    for host in ("evil.localhost", "api.localhost", "localhost.localdomain", "localhost.evil.com", "10.0.0.1",
                 "gpu-box", "127.0.0.1.nip.io", "0.0.0.0", ""):
        assert not http.is_loopback(host), host
    monkeypatch.setenv("TEAM_KEY_43", "sk-test-0123456789")
    cfg, errors = config.merge(config.Config(), {"backend": "openai", "endpoint": "http://evil.localhost:8000",
                                                 "apiKeyEnv": "TEAM_KEY_43"})
    assert not errors, errors
    with pytest.raises(TeamServerError, match="refusing to send the API key unencrypted"):
        TeamServer(cfg)


# --- every load failure is an EngineError ------------------------------------------------------------------


def _rewrite_header(directory: Path, change) -> None:
    f = directory / "model.safetensors"
    data = f.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    for key, entry in header.items():
        if key != "__metadata__":
            change(entry)
    raw = json.dumps(header).encode()
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


def _deep(n: int) -> str:
    return "[" * n + "]" * n


BROKEN = {
    "huge shapes": lambda d: _rewrite_header(d, lambda e: e.update(shape=[2 ** 62, 2 ** 62])),
    "negative shapes": lambda d: _rewrite_header(d, lambda e: e.update(shape=[-1, 3])),
    "deep tokenizer.json": lambda d: (d / "tokenizer.json").write_text(_deep(5_000_000)),
    "deep tokenizer_config.json": lambda d: (d / "tokenizer_config.json").write_text(_deep(500_000)),
    "deep config.json": lambda d: (d / "config.json").write_text(_deep(500_000)),
    "deep safetensors header": lambda d: (d / "model.safetensors").write_bytes(
        struct.pack("<Q", 400_000) + _deep(200_000).encode()),
    "header of a list": lambda d: (d / "model.safetensors").write_bytes(struct.pack("<Q", 10) + b"[[[[[]]]]]"),
}


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_every_load_failure_is_an_engine_error_with_context(tmp_path, tiny_model_dir, kind):
    from completiond.engine.engine import Engine, EngineError

    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_model_dir, broken)
    BROKEN[kind](broken)
    with pytest.raises(EngineError) as err:
        Engine.load(str(broken), device="cpu")
    assert str(broken) in str(err.value), err.value      # which model, and (below) what went wrong
    assert len(str(err.value)) < 2000


def test_deep_json_reads_as_a_value_error(tmp_path):
    from completiond.engine import hub

    path = tmp_path / "config.json"
    path.write_text(_deep(500_000))
    with pytest.raises(ValueError, match="nested too deeply"):
        hub.read_json(path)


# --- team mode: what a file outside the workspace is told --------------------------------------------------


async def test_an_outside_file_is_told_what_really_happens_in_team_mode(tmp_path):
    from remote_servers import FakeServer

    from completiond.serving.service import Service

    server = FakeServer()
    server.plan.pieces = ["42"]
    cfg, _ = config.merge(config.Config(), {"backend": "openai", "endpoint": server.url, "endpointTimeout": 2.0})
    service = Service(cfg)
    service.start_loading()
    try:
        for _ in range(200):
            if service.state == "ready":
                break
            await asyncio.sleep(0.02)
        project = tmp_path / "project"
        project.mkdir()
        service.notify("ed", "workspace", {"folders": [str(project)]})
        uri = (tmp_path / "elsewhere.py").as_uri()
        text = "OUTSIDE = 1\nx = "
        service.open("ed", uri, 1, text, "python")
        result = await service.request("ed", 1, "complete", {"uri": uri, "version": 1, "offset": len(text),
                                                             "settings": config.request_settings(cfg)})
        assert result["suggestion"] is None and server.plan.requests == []
        (message,) = result["warnings"]
        assert "no completions" in message and "outside the workspace folders" in message, message
        assert "local completions only" not in message            # it got none: never promise them
    finally:
        service.shutdown()
        server.close()
