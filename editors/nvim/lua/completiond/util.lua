--- Helpers shared by the renderers: LSP client calls that work on Neovim 0.10 to 0.12,
--- suggestion text arithmetic, stats formatting.
local M = {}

local method_calls = vim.fn.has("nvim-0.11") == 1

--- client:request / client.request(...) depending on the Neovim version.
---@return boolean ok, integer|nil request_id
function M.request(client, method, params, handler, bufnr)
  if method_calls then
    return client:request(method, params, handler, bufnr)
  end
  return client.request(method, params, handler, bufnr)
end

--- Synchronous request; returns result, err.
function M.request_sync(client, method, params, timeout_ms, bufnr)
  local resp, err
  if method_calls then
    resp, err = client:request_sync(method, params, timeout_ms, bufnr)
  else
    resp, err = client.request_sync(method, params, timeout_ms, bufnr)
  end
  if not resp then
    return nil, { message = err or "no answer" }
  end
  return resp.result, resp.err
end

function M.notify(client, method, params)
  if method_calls then
    return client:notify(method, params)
  end
  return client.notify(method, params)
end

function M.cancel(client, id)
  if method_calls then
    return client:cancel_request(id)
  end
  return client.cancel_request(id)
end

--- Text of a list of virt_text chunks.
function M.chunks_text(chunks)
  local parts = {}
  for _, c in ipairs(chunks or {}) do
    table.insert(parts, c[1])
  end
  return table.concat(parts)
end

--- Byte column of an LSP position in a buffer.
function M.byte_col(bufnr, pos, encoding)
  if encoding == "utf-8" then
    return pos.character
  end
  return vim.lsp.util._get_line_byte_from_position(bufnr, pos, encoding)
end

--- The part of an inline completion item still to be inserted at the cursor.
---
--- Servers may send a range that starts before the cursor (what was typed is then
--- repeated at the start of insertText) and ends after it (text after the cursor
--- that the suggestion overwrites).
---@param bufnr integer
---@param text string insertText
---@param range table|nil LSP range
---@param encoding string position encoding of `range`
---@param cursor integer[]|nil {row (1-based), col (0-based byte)}; default: the current window's cursor
---@return string|nil ghost text to show after the cursor; nil when the item does not fit the buffer
---@return table|nil replace {srow, scol, erow, ecol} 0-based byte range that `text` replaces
function M.ghost_text(bufnr, text, range, encoding, cursor)
  cursor = cursor or vim.api.nvim_win_get_cursor(0)
  local crow, ccol = cursor[1] - 1, cursor[2]
  if not range then
    return text, { crow, ccol, crow, ccol }
  end
  local srow, erow = range.start.line, range["end"].line
  if srow >= vim.api.nvim_buf_line_count(bufnr) then
    return nil
  end
  local scol = M.byte_col(bufnr, range.start, encoding)
  local ecol = erow < vim.api.nvim_buf_line_count(bufnr) and M.byte_col(bufnr, range["end"], encoding) or 0
  if srow > crow or (srow == crow and scol > ccol) then
    return nil -- starts after the cursor
  end
  if erow < crow or (erow == crow and ecol < ccol) then
    return nil -- ends before the cursor: not a suggestion for this position
  end
  local typed = table.concat(vim.api.nvim_buf_get_text(bufnr, srow, scol, crow, ccol, {}), "\n")
  if text:sub(1, #typed) ~= typed then
    return nil
  end
  return text:sub(#typed + 1), { srow, scol, erow, ecol }
end

--- A replacement of the rest of the cursor line that only re-types it at its end (what completiond
--- sends mid-line, so that every renderer previews what accepting inserts), as the pure insertion
--- it is, when that is one line: drawn inline before the rest of the line, it shows exactly the
--- result. A multi-line one stays a replacement (drawn over the rest of the line).
---@param ghost string text that replaces `suffix_len` bytes after the cursor
---@param suffix_len integer
---@param cursor integer[]|nil {row (1-based), col (0-based byte)}
---@return string ghost, integer suffix_len
function M.as_insertion(bufnr, ghost, suffix_len, cursor)
  if suffix_len <= 0 then
    return ghost, suffix_len
  end
  cursor = cursor or vim.api.nvim_win_get_cursor(0)
  local line = vim.api.nvim_buf_get_lines(bufnr, cursor[1] - 1, cursor[1], false)[1] or ""
  local rest = line:sub(cursor[2] + 1, cursor[2] + suffix_len)
  local head = ghost:sub(1, #ghost - #rest)
  if #ghost >= #rest and ghost:sub(#ghost - #rest + 1) == rest and not head:find("\n", 1, true) then
    return head, 0
  end
  return ghost, suffix_len
end

--- Tell the server what became of a suggestion (it counts them; see `completiond.suggestionEvent`).
---@param event "accepted"|"dismissed"
---@param kind "full"|"word"|"line"|nil for "accepted"
function M.suggestion_event(client, event, kind)
  M.request(client, "workspace/executeCommand",
    { command = "completiond.suggestionEvent", arguments = { { event = event, kind = kind } } }, function() end)
end

--- Run an LSP command of an item (`item.command`) on the server.
function M.exec_command(client, command)
  M.request(client, "workspace/executeCommand",
    { command = command.command, arguments = command.arguments }, function() end)
end

--- The next word or line of a ghost text (what accept word / line inserts).
---@param ghost string
---@param kind "word"|"line"|"full"
---@return string
function M.next_part(ghost, kind)
  if kind == "full" then
    return ghost
  end
  if kind == "line" then
    if ghost:sub(1, 1) == "\n" then
      local rest = ghost:sub(2)
      local eol = rest:find("\n", 1, true)
      return "\n" .. (eol and rest:sub(1, eol - 1) or rest)
    end
    local eol = ghost:find("\n", 1, true)
    return eol and ghost:sub(1, eol - 1) or ghost
  end
  -- word: leading blanks, then a run of word characters or of other non-blank characters
  local nl = ghost:match("^\n[ \t]*")
  if nl then
    return nl
  end
  return ghost:match("^[ \t]*[%w_]+") or ghost:match("^[ \t]*[^%w_%s]+") or ghost:match("^[ \t]+") or ghost
end

--- Insert text at the cursor of the current window and put the cursor after it.
function M.insert_at_cursor(bufnr, text)
  if text == "" then
    return
  end
  local row, col = unpack(vim.api.nvim_win_get_cursor(0))
  local lines = vim.split(text, "\n", { plain = true })
  vim.api.nvim_buf_set_text(bufnr, row - 1, col, row - 1, col, lines)
  local new_row = row + #lines - 1
  local new_col = (#lines == 1 and col or 0) + #lines[#lines]
  vim.api.nvim_win_set_cursor(0, { new_row, new_col })
end

--- Replace a 0-based byte range with text and put the cursor after it.
function M.replace(bufnr, range, text)
  local lines = vim.split(text, "\n", { plain = true })
  vim.api.nvim_buf_set_text(bufnr, range[1], range[2], range[3], range[4], lines)
  local new_row = range[1] + #lines
  local new_col = (#lines == 1 and range[2] or 0) + #lines[#lines]
  vim.api.nvim_win_set_cursor(0, { new_row, new_col })
end

--- Stats as indented "key: value" lines.
--- A copy of a decoded JSON value with JSON null (vim.NIL) removed: fields become absent (nil), so
--- that `s.model or "?"` and friends read them as missing instead of printing "vim.NIL".
function M.strip_nil(value)
  if value == vim.NIL then
    return nil
  end
  if type(value) ~= "table" then
    return value
  end
  local out = {}
  for k, v in pairs(value) do
    out[k] = M.strip_nil(v)
  end
  return out
end

--- How a stats value reads: JSON null as "none", never "vim.NIL".
local function stat_text(v)
  if v == vim.NIL or v == nil then
    return "none"
  end
  return tostring(v)
end

function M.format_stats(value, indent)
  indent = indent or ""
  if type(value) ~= "table" then
    return indent .. stat_text(value)
  end
  local keys = vim.tbl_keys(value)
  table.sort(keys, function(a, b)
    return tostring(a) < tostring(b)
  end)
  local lines = {}
  for _, k in ipairs(keys) do
    local v = value[k]
    if type(v) == "table" and not vim.islist(v) then
      table.insert(lines, ("%s%s:"):format(indent, k))
      table.insert(lines, M.format_stats(v, indent .. "  "))
    elseif type(v) == "table" then
      table.insert(lines, ("%s%s: %s"):format(indent, k, table.concat(vim.tbl_map(stat_text, v), ", ")))
    elseif type(v) == "number" and v ~= math.floor(v) then
      table.insert(lines, ("%s%s: %.4g"):format(indent, k, v))
    else
      table.insert(lines, ("%s%s: %s"):format(indent, k, stat_text(v)))
    end
  end
  return table.concat(lines, "\n")
end

return M
