--- completiond's own ghost text renderer, for Neovim 0.10/0.11 (no vim.lsp.inline_completion)
--- or when `renderer = "fallback"`.
---
--- One extmark namespace; the first line of a suggestion is virtual text at the
--- cursor (overlay at the end of the line, inline before existing text), the
--- others are virt_lines below. Requests are debounced; a response is dropped
--- when the buffer's version (changedtick, what Neovim sends as the LSP document
--- version) or the cursor changed since it was asked for. Moving the cursor
--- clears the suggestion, except typing the characters it shows. When the server
--- sends several items, next/prev cycle through them.
local util = require("completiond.util")

local M = {}

M.ns = vim.api.nvim_create_namespace("completiond")

---@class completiond.GhostState
---@field client_id integer
---@field augroup integer
---@field timer uv.uv_timer_t|nil
---@field pending integer|nil id of the request in flight
---@field seq integer
---@field ghost table|nil { text, row, col, line_before, suffix_len, extmark, items, index, command }

---@type table<integer, completiond.GhostState>
local states = {}

local uv = vim.uv or vim.loop

local function resolve_buf(bufnr)
  return (bufnr == nil or bufnr == 0) and vim.api.nvim_get_current_buf() or bufnr
end

local function core()
  return require("completiond")
end

local function stop_timer(s)
  if s.timer then
    s.timer:stop()
    if not s.timer:is_closing() then
      s.timer:close()
    end
    s.timer = nil
  end
end

local function cancel_pending(s)
  if s.pending then
    local client = vim.lsp.get_client_by_id(s.client_id)
    if client then
      pcall(util.cancel, client, s.pending)
    end
    s.pending = nil
  end
end

local function expand_tabs(text)
  if not text:find("\t", 1, true) then
    return text
  end
  return (text:gsub("\t", string.rep(" ", vim.bo.tabstop > 0 and vim.bo.tabstop or 8)))
end

local function render(bufnr, g)
  vim.api.nvim_buf_clear_namespace(bufnr, M.ns, 0, -1)
  local hl = (core().config or {}).hl_group or "CompletiondGhost"
  local lines = vim.split(g.text, "\n", { plain = true })
  local line = vim.api.nvim_buf_get_lines(bufnr, g.row, g.row + 1, false)[1] or ""
  local first = expand_tabs(lines[1])
  local suffix = g.suffix_len or 0
  if suffix > #first then
    -- The replaced rest of the line moves down with the last line: blank it where the first is shorter.
    first = first .. string.rep(" ", suffix - #first)
  end
  local opts = {
    virt_text = { { first, hl } },
    -- A replacement of the rest of the line (util.as_insertion left it one: multi-line) is drawn over
    -- it; an insertion before text pushes that text right, as accepting it will.
    virt_text_pos = (g.col < #line and suffix == 0) and "inline" or "overlay",
    hl_mode = "combine",
  }
  if #lines > 1 then
    local virt_lines = {}
    for i = 2, #lines do
      table.insert(virt_lines, { { expand_tabs(lines[i]), hl } })
    end
    opts.virt_lines = virt_lines
  end
  if g.items and #g.items > 1 then
    -- Like Neovim's own renderer: which of the server's alternatives shows.
    local last = opts.virt_lines and opts.virt_lines[#opts.virt_lines] or opts.virt_text
    table.insert(last, { (" (%d/%d)"):format(g.index, #g.items), "Comment" })
  end
  g.extmark = vim.api.nvim_buf_set_extmark(bufnr, M.ns, g.row, math.min(g.col, #line), opts)
end

--- Hide the suggestion in a buffer. `dismissed`: the user turned it down (a key, typing something
--- else, leaving insert mode), which the server counts.
function M.clear(bufnr, dismissed)
  bufnr = resolve_buf(bufnr)
  local s = states[bufnr]
  if s then
    if dismissed and s.ghost and s.ghost.text ~= "" then
      local client = vim.lsp.get_client_by_id(s.client_id)
      if client then
        util.suggestion_event(client, "dismissed")
      end
    end
    s.ghost = nil
  end
  if vim.api.nvim_buf_is_valid(bufnr) then
    vim.api.nvim_buf_clear_namespace(bufnr, M.ns, 0, -1)
  end
end

function M.visible(bufnr)
  bufnr = resolve_buf(bufnr)
  local s = states[bufnr]
  return s ~= nil and s.ghost ~= nil and s.ghost.text ~= ""
end

function M.text(bufnr)
  bufnr = resolve_buf(bufnr)
  local s = states[bufnr]
  return s and s.ghost and s.ghost.text or nil
end

--- Show `text` as the suggestion at the cursor (also used by the tests).
---@param suffix_len integer|nil bytes after the cursor that accepting it overwrites
---@param extra table|nil { items = {...} (the alternatives, each {text, suffix_len, command}), index, command }
function M.show(bufnr, text, suffix_len, extra)
  bufnr = resolve_buf(bufnr)
  local s = states[bufnr]
  if not s or text == nil or text == "" then
    M.clear(bufnr)
    return
  end
  extra = extra or {}
  local row, col = unpack(vim.api.nvim_win_get_cursor(0))
  local line = vim.api.nvim_buf_get_lines(bufnr, row - 1, row, false)[1] or ""
  s.ghost = { text = text, row = row - 1, col = col, line_before = line:sub(1, col), suffix_len = suffix_len or 0,
              items = extra.items, index = extra.index or 1, command = extra.command, fetched = extra.fetched }
  render(bufnr, s.ghost)
end

--- Show the next (`step` 1) or previous (-1) of the server's alternatives; false when there is one.
function M.cycle(bufnr, step)
  bufnr = resolve_buf(bufnr)
  local s = states[bufnr]
  local g = s and s.ghost
  if not g then
    return false
  end
  if not g.items or #g.items < 2 then
    -- One suggestion so far (typing asks for one): fetch alternatives now, as Copilot does; the server
    -- generates several for an invoked request, and the step lands on the first one that differs.
    if g.fetched then
      return false
    end
    M.request(bufnr, true)
    s.cycle_step, s.cycle_seq = step, s.seq
    return true
  end
  local index = (g.index - 1 + step) % #g.items + 1
  local item = g.items[index]
  M.show(bufnr, item.text, item.suffix_len, { items = g.items, index = index, command = item.command, fetched = g.fetched })
  return true
end

local function handle(bufnr, s, seq, tick, cursor, client, err, result)
  if seq ~= s.seq then
    return -- superseded by a newer request
  end
  s.pending = nil
  if err then
    if err.code ~= -32800 then -- RequestCancelled
      vim.lsp.log.warn("completiond: inlineCompletion failed", err)
    end
    return
  end
  if not vim.api.nvim_buf_is_valid(bufnr) or vim.api.nvim_get_current_buf() ~= bufnr then
    return
  end
  if vim.api.nvim_buf_get_changedtick(bufnr) ~= tick then
    return -- stale: the document changed since the request
  end
  local now = vim.api.nvim_win_get_cursor(0)
  if now[1] ~= cursor[1] or now[2] ~= cursor[2] or not vim.api.nvim_get_mode().mode:match("^i") then
    return
  end
  local shown = {}
  for _, item in ipairs(result and (result.items or result) or {}) do
    local text = type(item.insertText) == "string" and item.insertText or (item.insertText or {}).value
    if text then
      local ghost, replace = util.ghost_text(bufnr, text, item.range, client.offset_encoding, cursor)
      if ghost and ghost ~= "" then
        local suffix = 0
        if replace and replace[3] == cursor[1] - 1 then
          suffix = math.max(0, replace[4] - cursor[2])
        end
        ghost, suffix = util.as_insertion(bufnr, ghost, suffix, cursor)
        if ghost ~= "" then
          table.insert(shown, { text = ghost, suffix_len = suffix, command = item.command })
        end
      end
    end
  end
  local step = s.cycle_seq == seq and s.cycle_step or nil
  s.cycle_step, s.cycle_seq = nil, nil
  if #shown == 0 then
    if not step then
      M.clear(bufnr)
    end
    return
  end
  local index = 1
  if step then
    -- Asked for by next/previous: move off the suggestion already shown.
    local before = s.ghost and s.ghost.text
    index = step > 0 and 2 or #shown
    if #shown == 1 or shown[1].text ~= before then
      index = 1
    end
  end
  local item = shown[index] or shown[1]
  M.show(bufnr, item.text, item.suffix_len, { items = shown, index = index, command = item.command, fetched = step ~= nil })
end

--- Ask the server now for a suggestion at the cursor (`invoked`: the user asked, by the trigger key).
function M.request(bufnr, invoked)
  bufnr = resolve_buf(bufnr)
  local s = states[bufnr]
  if not s or not core().active() or not core().filetype_enabled(bufnr) then
    return
  end
  if vim.api.nvim_get_current_buf() ~= bufnr or not vim.api.nvim_get_mode().mode:match("^i") then
    return
  end
  local client = vim.lsp.get_client_by_id(s.client_id)
  if not client then
    return
  end
  cancel_pending(s)
  s.seq = s.seq + 1
  local seq = s.seq
  local tick = vim.api.nvim_buf_get_changedtick(bufnr)
  local cursor = vim.api.nvim_win_get_cursor(0)
  local params = vim.lsp.util.make_position_params(0, client.offset_encoding)
  params.context = { triggerKind = invoked and 1 or 2 } -- Invoked / Automatic
  local ok, id = util.request(client, "textDocument/inlineCompletion", params, function(err, result)
    handle(bufnr, s, seq, tick, cursor, client, err, result)
  end, bufnr)
  if ok and seq == s.seq then
    s.pending = id
  end
end

--- Ask after `debounce_ms` without typing.
function M.schedule(bufnr)
  local s = states[bufnr]
  if not s or not core().active() or not core().filetype_enabled(bufnr) then
    return
  end
  stop_timer(s)
  local delay = (core().config or {}).debounce_ms or 75
  s.timer = uv.new_timer()
  s.timer:start(delay, 0, vim.schedule_wrap(function()
    stop_timer(s)
    M.request(bufnr)
  end))
end

--- Cursor moved in insert mode: keep the suggestion if the user typed what it shows.
local function cursor_moved(bufnr)
  local s = states[bufnr]
  local g = s and s.ghost
  if not g then
    return
  end
  local row, col = unpack(vim.api.nvim_win_get_cursor(0))
  row = row - 1
  if row == g.row and col == g.col then
    return
  end
  if row == g.row and col > g.col then
    local line = vim.api.nvim_buf_get_lines(bufnr, row, row + 1, false)[1] or ""
    local typed = line:sub(g.col + 1, col)
    if line:sub(1, g.col) == g.line_before and g.text:sub(1, #typed) == typed and #typed < #g.text then
      g.text = g.text:sub(#typed + 1)
      g.col = col
      g.line_before = line:sub(1, col)
      g.items = nil -- the alternatives no longer start at the cursor
      render(bufnr, g)
      return
    end
  end
  M.clear(bufnr, true)
end

--- Insert the whole suggestion, or its next word / line.
---@param kind "full"|"word"|"line"
---@return boolean accepted
function M.accept(bufnr, kind)
  bufnr = resolve_buf(bufnr)
  local s = states[bufnr]
  local g = s and s.ghost
  if not g or g.text == "" then
    return false
  end
  stop_timer(s)
  cancel_pending(s)
  kind = kind or "full"
  local part = util.next_part(g.text, kind)
  local row, col = unpack(vim.api.nvim_win_get_cursor(0))
  local client = vim.lsp.get_client_by_id(s.client_id)
  if part == g.text then
    M.clear(bufnr)
    local line = vim.api.nvim_buf_get_lines(bufnr, row - 1, row, false)[1] or ""
    util.replace(bufnr, { row - 1, col, row - 1, math.min(#line, col + g.suffix_len) }, g.text)
    if client and kind == "full" and g.command then
      util.exec_command(client, g.command) -- the server's own "accepted" report, as Neovim's renderer runs it
    elseif client then
      util.suggestion_event(client, "accepted", kind)
    end
    return true
  end
  util.insert_at_cursor(bufnr, part)
  -- The rest still shows and is still the server's answer: no new request for this change of ours.
  s.own_tick = vim.api.nvim_buf_get_changedtick(bufnr)
  if client then
    util.suggestion_event(client, "accepted", kind)
  end
  local nrow, ncol = unpack(vim.api.nvim_win_get_cursor(0))
  local line = vim.api.nvim_buf_get_lines(bufnr, nrow - 1, nrow, false)[1] or ""
  g.text, g.suffix_len = util.as_insertion(bufnr, g.text:sub(#part + 1), g.suffix_len, { nrow, ncol })
  g.row, g.col, g.line_before, g.items = nrow - 1, ncol, line:sub(1, ncol), nil
  if g.text == "" then
    M.clear(bufnr)
    return true
  end
  render(bufnr, g)
  return true
end

--- Start rendering suggestions from a client in a buffer.
function M.attach(bufnr, client_id)
  local old = states[bufnr]
  if old then
    old.client_id = client_id
    return
  end
  local group = vim.api.nvim_create_augroup("completiond.ghost." .. bufnr, { clear = true })
  local s = { client_id = client_id, augroup = group, seq = 0 }
  states[bufnr] = s
  vim.api.nvim_create_autocmd({ "InsertEnter", "TextChangedI", "TextChangedP" }, {
    group = group,
    buffer = bufnr,
    callback = function(ev)
      if ev.event ~= "InsertEnter" and s.ghost and s.own_tick == vim.api.nvim_buf_get_changedtick(bufnr) then
        return
      end
      M.schedule(bufnr)
    end,
  })
  vim.api.nvim_create_autocmd("CursorMovedI", {
    group = group,
    buffer = bufnr,
    callback = function()
      cursor_moved(bufnr)
    end,
  })
  vim.api.nvim_create_autocmd({ "InsertLeave", "BufLeave" }, {
    group = group,
    buffer = bufnr,
    callback = function()
      stop_timer(s)
      cancel_pending(s)
      M.clear(bufnr, true)
    end,
  })
  vim.api.nvim_create_autocmd({ "BufUnload", "LspDetach" }, {
    group = group,
    buffer = bufnr,
    callback = function(ev)
      if ev.event == "LspDetach" and ev.data and ev.data.client_id ~= s.client_id then
        return
      end
      M.detach(bufnr)
    end,
  })
end

function M.detach(bufnr)
  bufnr = resolve_buf(bufnr)
  local s = states[bufnr]
  if not s then
    return
  end
  stop_timer(s)
  cancel_pending(s)
  M.clear(bufnr)
  pcall(vim.api.nvim_del_augroup_by_id, s.augroup)
  states[bufnr] = nil
end

--- For :checkhealth and the tests.
function M.state(bufnr)
  bufnr = resolve_buf(bufnr)
  return states[bufnr]
end

return M
