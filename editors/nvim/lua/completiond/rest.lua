--- Cursor rest: tell the server where the cursor has come to rest (the `completiond/cursorRest` notification,
--- { textDocument = { uri }, position }), so that the daemon prefills the prompt there while you read, and
--- the first suggestion after a jump or a switch of buffers comes sooner. Sent `delay_ms` after the cursor
--- last moved (in any mode) or the buffer was entered, once per place, and only while suggestions are on
--- for the buffer. A hint only: the daemon warms on open and after edits anyway, and nothing is answered.
local util = require("completiond.util")

local M = {}

M.METHOD = "completiond/cursorRest"
M.delay_ms = 300

local uv = vim.uv or vim.loop

---@type table<integer, { timer: uv.uv_timer_t, augroup: integer, sent: string|nil }>
local states = {}

--- Send the rest at the current window's cursor to every completiond client of `bufnr` (now).
---@return integer how many notifications were sent
function M.send(bufnr)
  local core = require("completiond")
  local state = states[bufnr]
  if not vim.api.nvim_buf_is_valid(bufnr) or vim.api.nvim_get_current_buf() ~= bufnr then
    return 0
  end
  if not core.active() or not core.filetype_enabled(bufnr) then
    return 0
  end
  local win = vim.api.nvim_get_current_win()
  local cursor = vim.api.nvim_win_get_cursor(win)
  local place = ("%d:%d:%d"):format(vim.api.nvim_buf_get_changedtick(bufnr), cursor[1], cursor[2])
  if state and state.sent == place then
    return 0 -- nothing moved or changed since the last one
  end
  local sent = 0
  for _, client in ipairs(core.clients(bufnr)) do
    local params = vim.lsp.util.make_position_params(win, client.offset_encoding or "utf-16")
    util.notify(client, M.METHOD, params)
    sent = sent + 1
  end
  if state and sent > 0 then
    state.sent = place
  end
  return sent
end

--- The cursor moved (or the buffer was entered): send once it has rested `delay_ms`.
function M.moved(bufnr)
  local state = states[bufnr]
  if not state then
    return
  end
  state.timer:stop()
  state.timer:start(M.delay_ms, 0, vim.schedule_wrap(function()
    if states[bufnr] == state then
      M.send(bufnr)
    end
  end))
end

function M.detach(bufnr)
  local state = states[bufnr]
  if not state then
    return
  end
  states[bufnr] = nil
  state.timer:stop()
  if not state.timer:is_closing() then
    state.timer:close()
  end
  pcall(vim.api.nvim_del_augroup_by_id, state.augroup)
end

function M.attached(bufnr)
  return states[bufnr] ~= nil
end

--- Watch a buffer the completiond client attached to (idempotent).
function M.attach(bufnr)
  if states[bufnr] then
    return
  end
  local augroup = vim.api.nvim_create_augroup("completiond_rest_" .. bufnr, { clear = true })
  states[bufnr] = { timer = uv.new_timer(), augroup = augroup }
  vim.api.nvim_create_autocmd({ "CursorMoved", "CursorMovedI", "BufEnter" }, {
    group = augroup,
    buffer = bufnr,
    callback = function()
      M.moved(bufnr)
    end,
  })
  vim.api.nvim_create_autocmd({ "BufUnload", "BufWipeout" }, {
    group = augroup,
    buffer = bufnr,
    callback = function()
      M.detach(bufnr)
    end,
  })
  M.moved(bufnr) -- attached to the buffer in view: its cursor rests somewhere already
end

return M
