"""The command line and the LSP server's start-up, without torch: what a new user runs first.

All of it is marked torch_free, so CI also runs it on the lowest supported Python in a venv
without torch (.ci/run): an import of torch anywhere on these paths fails there.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest
from lsprotocol import types
from pygls.exceptions import JsonRpcException
from pytest_lsp import make_test_lsp_client

from completiond import config

pytestmark = pytest.mark.torch_free  # also run on the lowest supported Python, without torch (.ci/run)


def cli(*args: str, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "completiond.cli", *args], capture_output=True, text=True,
                          env=dict(os.environ, **(env or {})), timeout=120, **kw)


def run_python(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, **(env or {})))


def test_version():
    from importlib.metadata import version

    out = cli("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"completiond {version('completiond')}", out


@pytest.mark.parametrize("args", [("settings",), ("settings", "--schema"), ("settings", "--toml"), ("--help",)])
def test_output_into_a_closed_pipe_is_not_a_traceback(args, tmp_path):
    # The reader is gone before the command writes anything (`completiond settings | head -0`): every
    # write fails with EPIPE, whatever the timing.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([sys.executable, "-m", "completiond.cli", *args], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=120,
                              env=dict(os.environ, XDG_CONFIG_HOME=str(tmp_path)))
    finally:
        os.close(write_end)
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr
    if args != ("--help",):  # argparse ignores a failed write of its help and exits 0
        assert proc.returncode == 141  # as if killed by SIGPIPE, like other Unix tools in a pipeline


def test_settings_shows_values_in_effect_and_their_source(tmp_path):
    toml = tmp_path / "completiond" / "config.toml"
    toml.parent.mkdir()
    toml.write_text('[completiond]\nmaxTokens = 9\ntemperature = 0.0\ndevice = "gpu"\n')
    out = cli("settings", env={"XDG_CONFIG_HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line.split(None, 2)[1:] for line in out.stdout.splitlines()[1:] if line.startswith("completiond.")}
    assert len(rows) == len(config.SETTINGS)
    assert rows["completiond.maxTokens"] == ["9", str(toml)]
    assert rows["completiond.temperature"] == ["0.0", str(toml)]  # set in the file, even if equal to the default
    assert rows["completiond.device"][0] == '"auto"' and "invalid value" in rows["completiond.device"][1]
    assert rows["completiond.topK"] == ["0", "default"]
    assert "completiond.device: expected one of auto, cpu, cuda, mps" in out.stderr
    data = json.loads(cli("settings", "--json", env={"XDG_CONFIG_HOME": str(tmp_path)}).stdout)
    assert {"key": "maxTokens", "value": 9, "source": str(toml)} in data["settings"]
    assert json.loads(cli("settings", "--schema").stdout) == config.schema()  # what editors/sync_settings.py reads


def test_complete_refuses_binary_and_non_utf8_files_plainly(tmp_path):
    binary = tmp_path / "image.png"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    out = cli("complete", f"{binary}:1:1")
    assert out.returncode == 2
    assert out.stderr.strip() == (f"completiond complete: {binary} is a binary file (it contains NUL bytes); "
                                  "completiond completes text files only")
    latin1 = tmp_path / "old.py"
    latin1.write_bytes("x = 1\nname = 'Jos\xe9'\n".encode("latin-1"))
    out = cli("complete", f"{latin1}:1:1")
    assert out.returncode == 2 and "codec" not in out.stderr
    assert f"{latin1} is not UTF-8 text (byte 0xe9 on line 2 cannot be decoded)" in out.stderr


def test_missing_model_directory_fails_before_torch_is_imported(tmp_path):
    src = tmp_path / "a.py"
    src.write_text("x = 1\n")
    missing = tmp_path / "no-such-model"
    out = run_python(
        "import sys\n"
        "from completiond.cli import main\n"
        f"rc = main(['complete', {str(src) + ':1:1'!r}, '--model', {str(missing)!r}])\n"
        "print(rc, 'torch' in sys.modules, 'transformers' in sys.modules)\n",
        env={"XDG_CONFIG_HOME": str(tmp_path)})
    assert out.stdout.split() == ["2", "False", "False"], out
    assert f"model directory {missing} does not exist" in out.stderr


def test_a_relative_model_path_is_reported_as_given_and_resolved(tmp_path):
    """Issue 30: `model = "./nope"` was reported as `nope`. Now as written, and where it was looked for."""
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "completiond").mkdir()
    (tmp_path / "completiond" / "config.toml").write_text('model = "./nope"\n')
    out = subprocess.run([sys.executable, "-m", "completiond.cli", "complete", "a.py:1:1"], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path, env=dict(os.environ, XDG_CONFIG_HOME=str(tmp_path)))
    assert out.returncode == 2, out
    # Issue 43: a relative directory in config.toml is resolved against that file's folder, not the cwd.
    where = tmp_path.resolve() / "completiond" / "nope"
    assert f"model directory {where} does not exist" in out.stderr, out.stderr


# Windows, as far as completiond can tell: no fcntl, no os.getuid, no AF_UNIX.
AS_IF_WINDOWS = ("import os, socket, sys\n"
                 "sys.modules['fcntl'] = None\n"
                 "del os.getuid\n"
                 "del socket.AF_UNIX\n")


def test_without_unix_sockets_the_lsp_runs_in_process_and_the_daemon_commands_say_why():
    out = run_python(AS_IF_WINDOWS + (
        "from completiond.lsp.server import CompletionServer, InProcessService\n"
        "server = CompletionServer()\n"
        "print(server.no_daemon, isinstance(server.service, InProcessService))\n"
        "print(server.platform_note)\n"
        "from completiond.cli import main\n"
        "print('rc', main(['status']), main(['stop']), main(['serve']))\n"
        "print('torch' in sys.modules)\n"))
    lines = out.stdout.splitlines()
    assert lines[0] == "True True", out
    assert "Unix domain sockets" in lines[1]
    assert lines[2] == "rc 1 1 2" and lines[3] == "False", out
    assert out.stderr.count("no completiond daemon on this platform") == 2
    assert "completiond serve: the shared daemon needs Unix domain sockets" in out.stderr
    assert "Traceback" not in out.stderr


async def test_lsp_starts_and_answers_without_torch(tmp_path):
    client = make_test_lsp_client()
    env = dict(os.environ, XDG_RUNTIME_DIR=str(tmp_path), XDG_CONFIG_HOME=str(tmp_path / "config"))
    # Any import of torch or transformers in this server fails (as on a machine without them).
    await client.start_io(sys.executable, "-c",
                          "import sys; sys.modules['torch'] = sys.modules['transformers'] = None; "
                          "from completiond.cli import main; sys.exit(main(['lsp']))", env=env)
    try:
        init = await asyncio.wait_for(client.initialize_session(types.InitializeParams(
            capabilities=types.ClientCapabilities(), initialization_options={"completiond": {"enable": False}})), 60)
        assert init.capabilities.inline_completion_provider is not None
        assert init.server_info.name == "completiond"
        uri = (tmp_path / "a.py").as_uri()
        client.text_document_did_open(types.DidOpenTextDocumentParams(
            text_document=types.TextDocumentItem(uri=uri, language_id="python", version=1, text="x = ")))
        result = await asyncio.wait_for(client.text_document_inline_completion_async(types.InlineCompletionParams(
            text_document=types.TextDocumentIdentifier(uri=uri), position=types.Position(0, 4),
            context=types.InlineCompletionContext(trigger_kind=types.InlineCompletionTriggerKind.Invoked))), 30)
        assert list(result.items) == []  # disabled: answered at once, no daemon, no model
    finally:
        try:
            await asyncio.wait_for(client.shutdown_session(), 20)
        except (asyncio.TimeoutError, JsonRpcException, RuntimeError):
            pass
        await client.stop()
