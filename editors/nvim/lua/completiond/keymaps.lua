--- Insert-mode keys that act on a suggestion only while one shows (trigger: whenever completions
--- are on). Otherwise the key does what it did before (the mapping it had, or its plain meaning).
local M = {}

M.actions = {
  accept = { kind = "full", desc = "completiond: accept the suggestion" },
  accept_word = { kind = "word", desc = "completiond: accept the next word of the suggestion" },
  accept_line = { kind = "line", desc = "completiond: accept the next line of the suggestion" },
  dismiss = { kind = "dismiss", desc = "completiond: dismiss the suggestion" },
  trigger = { kind = "trigger", desc = "completiond: ask for a suggestion now", always = true },
  next = { kind = "next", desc = "completiond: show the next suggestion" },
  prev = { kind = "prev", desc = "completiond: show the previous suggestion" },
}

local function act(core, bufnr, kind)
  if kind == "dismiss" then
    core.dismiss(bufnr)
  elseif kind == "trigger" then
    core.trigger(bufnr)
  elseif kind == "next" or kind == "prev" then
    core.cycle(kind == "next" and 1 or -1, bufnr)
  else
    core.accept(kind)
  end
end

--- bufnr -> lhs -> fallback function, captured the first time we map a key
local originals = {}

local function is_ours(map)
  return type(map) == "table" and type(map.desc) == "string" and map.desc:sub(1, 12) == "completiond:"
end

--- What the key did before we mapped it, as a function returning keys for an <expr> map.
local function fallback_for(lhs, prev)
  if type(prev) ~= "table" or vim.tbl_isempty(prev) or is_ours(prev) then
    return function()
      return lhs
    end
  end
  local mode = prev.noremap == 1 and "n" or "m"
  if prev.callback then
    return function()
      local keys = prev.callback()
      if prev.expr == 1 and type(keys) == "string" and keys ~= "" then
        if prev.replace_keycodes == 1 then
          keys = vim.keycode(keys)
        end
        vim.api.nvim_feedkeys(keys, mode, false)
      end
      return ""
    end
  end
  if prev.rhs and prev.rhs ~= "" then
    return function()
      local keys = prev.expr == 1 and vim.api.nvim_eval(prev.rhs) or vim.keycode(prev.rhs)
      vim.api.nvim_feedkeys(keys, mode, false)
      return ""
    end
  end
  return function()
    return lhs
  end
end

--- Map the configured keys in a buffer (again after setup() changed them).
function M.attach(bufnr)
  local core = require("completiond")
  local keymaps = (core.config or {}).keymaps or {}
  vim.b[bufnr].completiond_keymaps = vim.b[bufnr].completiond_keymaps or {}
  local mapped = vim.b[bufnr].completiond_keymaps
  -- Forget keys we mapped before that are no longer configured.
  for name, lhs in pairs(mapped) do
    if keymaps[name] ~= lhs then
      pcall(vim.keymap.del, "i", lhs, { buffer = bufnr })
      mapped[name] = nil
    end
  end
  for name, action in pairs(M.actions) do
    local lhs = keymaps[name]
    if lhs then
      local prev = vim.api.nvim_buf_call(bufnr, function()
        return vim.fn.maparg(lhs, "i", false, true)
      end)
      originals[bufnr] = originals[bufnr] or {}
      originals[bufnr][lhs] = originals[bufnr][lhs] or fallback_for(lhs, prev)
      local fallback = originals[bufnr][lhs]
      vim.keymap.set("i", lhs, function()
        local active
        if action.always then
          active = core.renderer == "fallback" and core.active() and core.filetype_enabled(bufnr)
        else
          active = core.visible(bufnr)
        end
        if not active then
          return fallback()
        end
        vim.schedule(function()
          act(core, bufnr, action.kind)
        end)
        return ""
      end, { buffer = bufnr, expr = true, silent = true, desc = action.desc })
      mapped[name] = lhs
    end
  end
  vim.b[bufnr].completiond_keymaps = mapped
end

return M
