--- :checkhealth completiond
local M = {}

local health = vim.health

function M.check()
  health.start("completiond: Neovim")
  local v = vim.version()
  local version = ("%d.%d.%d"):format(v.major, v.minor, v.patch)
  if vim.fn.has("nvim-0.10") ~= 1 then
    health.error("Neovim " .. version .. " is too old: completiond.nvim needs 0.10 or later")
    return
  end
  -- What this Neovim offers; which renderer is in use is said once, under setup.
  if vim.lsp.inline_completion then
    health.ok("Neovim " .. version .. ": vim.lsp.inline_completion is available")
  else
    health.ok("Neovim " .. version .. ": no vim.lsp.inline_completion (it needs 0.12)")
  end

  local core = require("completiond")
  health.start("completiond: setup")
  if not core.config then
    health.warn("require('completiond').setup() was not called", { "Add require('completiond').setup({}) to your config" })
    return
  end
  health.ok(core.renderer_line())
  if core.renderer == "builtin" then
    health.info("Neovim's renderer asks the server 200 ms after a change: debounce_ms and the trigger key do not apply")
  end
  local off = {}
  for ft, on in pairs(core.config.filetypes) do
    if ft ~= "*" and not on then
      table.insert(off, ft)
    end
  end
  table.sort(off)
  health.info(("filetypes: %s; off for %s"):format(core.config.filetypes["*"] == false and "only those turned on" or "all",
    #off > 0 and table.concat(off, ", ") or "none"))
  health.ok("completions: " .. (core.enabled() and "on" or "off (:CompletiondToggle)"))
  for _, e in ipairs(core.errors or {}) do
    health.warn("setup(): " .. e)
  end
  local km = {}
  for name, lhs in pairs(core.config.keymaps) do
    if lhs then
      table.insert(km, ("%s=%s"):format(name, lhs))
    end
  end
  table.sort(km)
  health.info("keymaps (active while a suggestion shows; trigger always): " .. (#km > 0 and table.concat(km, ", ") or "none"))
  local set = vim.tbl_keys(core.user_settings)
  table.sort(set)
  health.info("server settings you set: " .. (#set > 0 and table.concat(set, ", ") or "none (server defaults / config.toml)"))

  health.start("completiond: server")
  local cmd, err = core.server_cmd(core.config)
  if not cmd then
    health.error(err, core.NOT_FOUND_ADVICE)
    return
  end
  health.ok("server command: " .. table.concat(cmd, " "))
  local probe
  if cmd[2] == "-m" then
    probe = { cmd[1], "-c", "import completiond.cli" }
  elseif vim.fs.basename(cmd[1]) == "completiond" then
    probe = { cmd[1], "--help" }
  end
  if probe then
    local ok, out = pcall(vim.fn.system, probe)
    if not ok or vim.v.shell_error ~= 0 then
      health.error("`" .. table.concat(probe, " ") .. "` failed: " .. tostring(out), core.NOT_FOUND_ADVICE)
    else
      health.ok("`" .. table.concat(probe, " ") .. "` works")
    end
  end
  local clients = core.clients()
  if #clients == 0 then
    health.info("no completiond client is running (open a file of a completed filetype)")
  end
  for _, client in ipairs(clients) do
    local s = core.status[client.id]
    local state = s and s.state or "starting"
    local line = ("client %d: %s%s"):format(client.id, state, s and s.message and s.message ~= "" and (" — " .. s.message) or "")
    local stale = core.restart_needed(s)
    if state == "error" then
      health.error(line)
    elseif stale then
      health.warn(("client %d: %s, but not with your settings: %s"):format(client.id, state, stale),
        { "Run :CompletiondRestart to load the model your settings ask for" })
    elseif state == "ready" or state == "busy" then
      health.ok(line)
    else
      health.info(line)
    end
    if not (client.server_capabilities or {}).inlineCompletionProvider then
      health.warn(("client %d: the server does not offer textDocument/inlineCompletion"):format(client.id))
    end
  end
end

return M
