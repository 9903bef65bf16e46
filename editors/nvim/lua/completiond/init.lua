--- completiond.nvim: inline (ghost text) completions from the local completiond server.
---
---   require("completiond").setup({ settings = { maxTokens = 48 } })
---
--- See :help completiond.
local M = {}

local config = require("completiond.config")
local util = require("completiond.util")

M.NAME = "completiond"
M.STATUS_METHOD = "completiond/status"
M.CMD_STATS = "completiond.stats"
M.CMD_RESTART = "completiond.restartDaemon"
M.CMD_SUGGESTION_EVENT = "completiond.suggestionEvent"

--- The merged configuration (nil until setup()).
M.config = nil
--- The server settings the user set (sent with a value; the rest go as null).
M.user_settings = {}
--- Last `completiond/status` params per client id.
M.status = {}
--- "builtin" or "fallback" once set up.
M.renderer = nil

local augroup = vim.api.nvim_create_augroup("completiond", { clear = true })
local warned_not_found = false

--- The renderer that `opt` ("auto", "builtin", "fallback") resolves to on this Neovim.
---@param opt string
---@return string renderer
---@return string|nil why a note when "builtin" was asked for but is not available
function M.pick_renderer(opt)
  local has_builtin = vim.lsp.inline_completion ~= nil and vim.lsp.inline_completion.get ~= nil
  -- "auto" is completiond's own renderer on every version: Neovim's requests after its own fixed
  -- 200 ms (no debounce_ms), offers no manual trigger and no public way to dismiss.
  if opt ~= "builtin" then
    return "fallback"
  end
  if has_builtin then
    return "builtin"
  end
  return "fallback", "vim.lsp.inline_completion needs Neovim >= 0.12: using completiond's own ghost text"
end

--- The renderer in use, in words (:checkhealth, :CompletiondStatus).
function M.renderer_line()
  local opt = M.config and M.config.renderer or "auto"
  if M.renderer == "builtin" then
    return ('renderer: builtin, Neovim\'s vim.lsp.inline_completion (renderer = "%s")'):format(opt)
  end
  local why = opt == "builtin" and "vim.lsp.inline_completion needs Neovim >= 0.12"
    or "the option builtin draws with Neovim's own on 0.12"
  return ('renderer: fallback, completiond\'s own ghost text (renderer = "%s"; %s)'):format(opt, why)
end

--- The command that starts the language server.
---@param cfg table
---@return string[]|nil cmd
---@return string|nil err why none was found
function M.server_cmd(cfg)
  cfg = cfg or M.config or config.defaults
  local args = cfg.args or {}
  if cfg.cmd then
    local cmd = vim.list_extend(vim.deepcopy(cfg.cmd), args)
    if vim.fn.executable(cmd[1]) ~= 1 then
      return nil, ("cmd[1] %q is not an executable"):format(cmd[1])
    end
    return cmd
  end
  if cfg.python then
    local python = vim.fn.expand(cfg.python)
    if vim.fn.isdirectory(python) == 1 then
      local found
      for _, rel in ipairs({ "bin/python3", "bin/python", "Scripts/python.exe" }) do
        local p = python .. "/" .. rel
        if vim.fn.executable(p) == 1 then
          found = p
          break
        end
      end
      if not found then
        return nil, ("python = %q: no Python interpreter in that folder"):format(cfg.python)
      end
      python = found
    elseif vim.fn.executable(python) ~= 1 then
      return nil, ("python = %q is not an executable"):format(cfg.python)
    end
    return vim.list_extend({ python, "-m", "completiond.cli", "lsp" }, args)
  end
  if vim.fn.executable("completiond") == 1 then
    return vim.list_extend({ "completiond", "lsp" }, args)
  end
  local user_bin = vim.fn.expand("~/.local/bin/completiond")
  if vim.fn.executable(user_bin) == 1 then
    return vim.list_extend({ user_bin, "lsp" }, args)
  end
  return nil, "the `completiond` executable was not found on $PATH"
end

--- The `completiond` command line itself (for `pull`), or nil when only a custom `cmd` is known.
function M.cli_cmd(cfg)
  cfg = cfg or M.config or config.defaults
  local cmd = M.server_cmd(vim.tbl_extend("force", cfg, { args = {} }))
  if not cmd then
    return nil
  end
  if cmd[#cmd] == "lsp" then
    table.remove(cmd)
    return cmd
  end
  return nil
end

-- One plain sentence each: :checkhealth turns ":help tag" into a link up to the next blank, so the
-- tag must end its line.
-- No sentence ends in a period of its own (`pip install -e .` would read "..." once joined).
M.NOT_FOUND_ADVICE = {
  "Install it: run `pip install -e .` in a completiond checkout",
  "Or pass cmd or python to require('completiond').setup()",
  "Details: :help completiond-install",
}
M.NOT_FOUND_HINT = table.concat(M.NOT_FOUND_ADVICE, "; ")

--- The message when no server command was found: why, then what to do (one period per sentence).
function M.not_found_message(err)
  return ("completiond: %s. %s."):format((err:gsub("%.+$", "")), M.NOT_FOUND_HINT)
end

--- How the daemon's model (device, dtype...) differs from what this editor's settings ask for, or
--- nil: the server's status says so (`modelMismatch`), e.g. while another editor's settings hold.
function M.restart_needed(s)
  if type(s) ~= "table" or type(s.modelMismatch) ~= "string" or s.modelMismatch == "" then
    return nil
  end
  return s.modelMismatch
end

--- The `completiond` settings section sent to the server.
function M.server_section()
  return config.server_section(M.user_settings)
end

--- Whether completions are on (the `enable` server setting).
function M.enabled()
  local v = M.user_settings.enable
  if v == nil or v == vim.NIL then
    return config.defaults.settings.enable
  end
  return v
end

--- Whether suggestions are asked for now: completions on and not snoozed (:CompletiondMenu).
function M.active()
  return M.enabled() and not require("completiond.menu").snoozed()
end

---@return vim.lsp.Client[]
function M.clients(bufnr)
  return vim.lsp.get_clients({ name = M.NAME, bufnr = bufnr })
end

local function wants_buffer(bufnr)
  if not vim.api.nvim_buf_is_valid(bufnr) or vim.bo[bufnr].buftype ~= "" then
    return false
  end
  return config.filetype_enabled(M.config, vim.bo[bufnr].filetype)
end

--- Whether completions are on for a buffer's filetype (the `filetypes` map).
function M.filetype_enabled(bufnr)
  bufnr = (bufnr == nil or bufnr == 0) and vim.api.nvim_get_current_buf() or bufnr
  return M.config ~= nil and config.filetype_enabled(M.config, vim.bo[bufnr].filetype)
end

--- Tell statuslines that the status changed: the User CompletiondStatus event (for statusline plugins)
--- and a redraw of the built-in statusline, so it changes without waiting for a keystroke.
local function status_changed(data)
  vim.api.nvim_exec_autocmds("User", { pattern = "CompletiondStatus", modeline = false, data = data })
  pcall(vim.cmd.redrawstatus, { bang = true })
end

--- The `completiond/status` handler. JSON nulls become absent fields (no "vim.NIL" in messages).
function M.on_status(_, params, ctx)
  if type(params) ~= "table" then
    return
  end
  params = util.strip_nil(params)
  M.status[ctx.client_id] = params
  M.exited = nil
  status_changed(params)
end

--- The language server process ended (killed, crashed, or stopped): forget its status at once and say so,
--- instead of leaving the statusline at its last state ("ready") until the next keystroke.
function M.on_exit(code, signal, client_id)
  M.status[client_id] = nil
  -- A kill shows as signal 9 with code 0; SIGTERM (15) is how Neovim force-stops a client itself.
  local crashed = code ~= 0 or (signal ~= 0 and signal ~= 15)
  M.exited = { code = code, signal = signal, crashed = crashed }
  vim.schedule(function()
    if crashed then
      vim.notify(("completiond: the language server exited (code %s, signal %s); see :LspLog"):format(code, signal), vim.log.levels.WARN)
    end
    status_changed({ state = "stopped", code = code, signal = signal })
  end)
end

local function on_attach(client, bufnr)
  if M.renderer == "builtin" then
    vim.lsp.inline_completion.enable(M.active() and M.filetype_enabled(bufnr), { bufnr = bufnr })
  else
    require("completiond.ghost").attach(bufnr, client.id)
  end
  require("completiond.keymaps").attach(bufnr)
  require("completiond.rest").attach(bufnr) -- where the cursor rests: the daemon prefills there
end

--- Start (or reuse) the client for a buffer.
---@param bufnr integer|nil
---@return integer|nil client_id
function M.attach(bufnr)
  bufnr = (bufnr == nil or bufnr == 0) and vim.api.nvim_get_current_buf() or bufnr
  if not M.config or not wants_buffer(bufnr) then
    return nil
  end
  local cmd, err = M.server_cmd(M.config)
  if not cmd then
    if not warned_not_found then
      warned_not_found = true
      vim.notify(M.not_found_message(err), vim.log.levels.ERROR)
    end
    return nil
  end
  local root = vim.fs.root(bufnr, M.config.root_markers) or vim.fn.getcwd()
  local section = M.server_section()
  return vim.lsp.start({
    name = M.NAME,
    cmd = cmd,
    root_dir = root,
    init_options = { completiond = section },
    settings = { completiond = section },
    handlers = {
      [M.STATUS_METHOD] = M.on_status,
      -- The first-run model offer: asked from :CompletiondMenu, never as a prompt in the middle of typing.
      ["window/showMessageRequest"] = require("completiond.menu").on_message_request,
    },
    on_init = function(client)
      -- The server also answers textDocument/completion (for editors without inline
      -- completions). Completion plugins would then ask it on every keystroke, and
      -- since the daemon keeps only the latest request per document those requests
      -- would cancel the inline ones: hide that capability.
      client.server_capabilities.completionProvider = nil
    end,
    on_attach = on_attach,
    on_exit = function(code, signal, client_id)
      M.on_exit(code, signal, client_id)
    end,
  }, { bufnr = bufnr })
end

--- Send the current settings to every running client.
function M.push_settings()
  local section = M.server_section()
  for _, client in ipairs(M.clients()) do
    client.settings = vim.tbl_extend("force", client.settings or {}, { completiond = section })
    util.notify(client, "workspace/didChangeConfiguration", { settings = { completiond = section } })
  end
end

--- Set up the plugin. Safe to call again: later calls change the settings of the running server.
---@param opts table|nil see :help completiond-config
function M.setup(opts)
  local cfg, user_settings, errors = config.resolve(opts)
  if #errors > 0 then
    vim.notify("completiond: " .. table.concat(errors, "\n"), vim.log.levels.WARN)
  end
  local first = M.config == nil
  require("completiond.menu").apply_languages(cfg)
  M.config = cfg
  M.errors = errors
  M.user_settings = user_settings
  local note
  M.renderer, note = M.pick_renderer(cfg.renderer)
  if note then
    vim.notify("completiond: " .. note, vim.log.levels.INFO)
  end
  vim.api.nvim_set_hl(0, "CompletiondGhost", { link = "Comment", default = true })

  vim.api.nvim_clear_autocmds({ group = augroup })
  vim.api.nvim_create_autocmd("FileType", {
    group = augroup,
    callback = function(ev)
      M.attach(ev.buf)
    end,
  })
  if first then
    for _, bufnr in ipairs(vim.api.nvim_list_bufs()) do
      if vim.api.nvim_buf_is_loaded(bufnr) then
        M.attach(bufnr)
      end
    end
  else
    M.push_settings()
    M.refresh_buffers()
  end
end

--- Re-apply enable state and keymaps to the attached buffers.
function M.refresh_buffers()
  for _, client in ipairs(M.clients()) do
    for bufnr in pairs(client.attached_buffers or {}) do
      local on = M.active() and M.filetype_enabled(bufnr)
      if M.renderer == "builtin" then
        vim.lsp.inline_completion.enable(on, { bufnr = bufnr })
      elseif not on then
        require("completiond.ghost").clear(bufnr)
      end
      require("completiond.keymaps").attach(bufnr)
    end
  end
end

--- Turn completions on or off (the `enable` server setting), here and in the server.
---@param on boolean|nil nil flips
function M.toggle(on)
  if on == nil then
    on = not M.enabled()
  end
  M.user_settings.enable = on
  if M.config then
    M.config.settings.enable = on
  end
  M.push_settings()
  M.refresh_buffers()
  vim.notify("completiond: inline completions " .. (on and "on" or "off"), vim.log.levels.INFO)
end

--- Whether a suggestion shows in the buffer.
function M.visible(bufnr)
  bufnr = (bufnr == nil or bufnr == 0) and vim.api.nvim_get_current_buf() or bufnr
  if M.renderer == "builtin" then
    local ns = vim.api.nvim_get_namespaces()["nvim.lsp.inline_completion"]
    return ns ~= nil and #vim.api.nvim_buf_get_extmarks(bufnr, ns, 0, -1, { limit = 1 }) > 0
  end
  return require("completiond.ghost").visible(bufnr)
end

--- The text of the suggestion that shows (the part not yet in the buffer), or nil.
function M.suggestion_text(bufnr)
  bufnr = (bufnr == nil or bufnr == 0) and vim.api.nvim_get_current_buf() or bufnr
  if M.renderer == "builtin" then
    local ns = vim.api.nvim_get_namespaces()["nvim.lsp.inline_completion"]
    if not ns then
      return nil
    end
    local marks = vim.api.nvim_buf_get_extmarks(bufnr, ns, 0, -1, { details = true })
    if #marks == 0 then
      return nil
    end
    local d = marks[1][4]
    -- Neovim appends " (2/3)" (highlight ComplHintMore) when cycling: not part of the suggestion.
    local function text(chunks)
      return util.chunks_text(vim.tbl_filter(function(c)
        return c[2] ~= "ComplHintMore"
      end, chunks or {}))
    end
    local lines = { text(d.virt_text) }
    for _, l in ipairs(d.virt_lines or {}) do
      table.insert(lines, text(l))
    end
    return table.concat(lines, "\n")
  end
  return require("completiond.ghost").text(bufnr)
end

--- Accept the whole suggestion, its next word, or its next line.
--- Returns false when no suggestion shows. Usable from <expr> mappings.
---@param kind "full"|"word"|"line"|nil
---@return boolean
function M.accept(kind)
  kind = kind or "full"
  local bufnr = vim.api.nvim_get_current_buf()
  if not M.visible(bufnr) then
    return false
  end
  if M.renderer == "builtin" then
    if kind == "full" then
      -- Neovim inserts the item and runs its command, which reports the acceptance to the server.
      return vim.lsp.inline_completion.get({ bufnr = bufnr })
    end
    return vim.lsp.inline_completion.get({
      bufnr = bufnr,
      on_accept = function(item)
        local client = vim.lsp.get_client_by_id(item.client_id)
        local text = type(item.insert_text) == "string" and item.insert_text or item.insert_text.value
        local lsp_range
        if item.range then
          lsp_range = {
            start = { line = item.range.start.row, character = item.range.start.col },
            ["end"] = { line = item.range.end_.row, character = item.range.end_.col },
          }
        end
        local cursor = vim.api.nvim_win_get_cursor(0)
        local ghost, replace = util.ghost_text(bufnr, text, lsp_range, "utf-8", cursor)
        if not ghost or not client then
          return
        end
        local suffix = (replace and replace[3] == cursor[1] - 1) and math.max(0, replace[4] - cursor[2]) or 0
        ghost, suffix = util.as_insertion(bufnr, ghost, suffix, cursor)
        local part = util.next_part(ghost, kind)
        if part == ghost and suffix > 0 then
          util.replace(bufnr, { cursor[1] - 1, cursor[2], cursor[1] - 1, cursor[2] + suffix }, ghost)
        else
          util.insert_at_cursor(bufnr, part)
        end
        util.suggestion_event(client, "accepted", kind)
      end,
    })
  end
  return require("completiond.ghost").accept(bufnr, kind)
end

--- Hide the suggestion that shows.
function M.dismiss(bufnr)
  bufnr = (bufnr == nil or bufnr == 0) and vim.api.nvim_get_current_buf() or bufnr
  if not M.visible(bufnr) then
    return false
  end
  if M.renderer == "builtin" then
    -- Neovim offers no call for this: hide its ghost text (public extmark API). Our accept keys act
    -- only on a visible suggestion, and Neovim replaces it with the next answer as you type.
    local ns = vim.api.nvim_get_namespaces()["nvim.lsp.inline_completion"]
    vim.api.nvim_buf_clear_namespace(bufnr, ns, 0, -1)
    for _, client in ipairs(M.clients(bufnr)) do
      util.suggestion_event(client, "dismissed")
    end
  else
    require("completiond.ghost").clear(bufnr, true)
  end
  return true
end

--- Ask for a suggestion now, whatever the delay (the trigger key). False where the renderer cannot
--- (Neovim's own asks by itself as you type) or completions are off here.
function M.trigger(bufnr)
  bufnr = (bufnr == nil or bufnr == 0) and vim.api.nvim_get_current_buf() or bufnr
  if M.renderer ~= "fallback" or not M.active() or not M.filetype_enabled(bufnr) then
    return false
  end
  local ghost = require("completiond.ghost")
  if not ghost.state(bufnr) then
    return false
  end
  ghost.request(bufnr, true)
  return true
end

--- Neovim's renderer for a buffer: it holds the items of its last request, one while typing (an automatic
--- request). Not public API (vim.lsp._capability, Neovim 0.12): where it is missing or shaped otherwise,
--- cycling goes back to moving through what Neovim holds.
local function builtin_completor(bufnr, client)
  local active = vim.tbl_get(vim.lsp, "_capability", "all", "inline_completion", "active")
  local c = type(active) == "table" and active[bufnr] or nil
  if type(c) == "table" and type(c.count_items) == "function" and type(c.handler) == "function"
    and type(c.client_state) == "table" and c.client_state[client.id] ~= nil then
    return c
  end
end

--- bufnr -> { at = "changedtick:row:col", result = the invoked answer, or nil while it is on its way }
local fetched = {}

--- Give Neovim's renderer the server's alternatives and show the one `step` away from what showed
--- (the first that differs, as completiond's own renderer does).
local function show_alternatives(bufnr, completor, client, result, step)
  local items = result.items or result
  local before = completor.current and completor.current.insert_text
  completor:handler(nil, result, { client_id = client.id, bufnr = bufnr, method = "textDocument/inlineCompletion" })
  local same = #items > 1 and vim.deep_equal(items[1].insertText, before)
  -- count 0 shows the first with Neovim's " (1/3)" hint.
  vim.lsp.inline_completion.select({ bufnr = bufnr, count = same and step or 0 })
end

--- Cycling one suggestion with Neovim's renderer: ask the server for alternatives now (an invoked request,
--- as Copilot does; typing asks for one) and hand them to Neovim. False where there is nothing to fetch.
local function fetch_alternatives(bufnr, step)
  local client = M.clients(bufnr)[1]
  local completor = client and builtin_completor(bufnr, client)
  if not completor or not completor.current or completor:count_items() > 1 then
    return false
  end
  local tick = vim.api.nvim_buf_get_changedtick(bufnr)
  local cursor = vim.api.nvim_win_get_cursor(0)
  local at = table.concat({ tick, cursor[1], cursor[2] }, ":")
  local done = fetched[bufnr]
  if done and done.at == at then
    -- Asked here already: still on its way, or Neovim's own answer came after it and put back one item.
    local items = done.result and (done.result.items or done.result)
    if items and #items > 1 then
      show_alternatives(bufnr, completor, client, done.result, step)
    end
    return done.result == nil or (items ~= nil and #items > 1)
  end
  fetched[bufnr] = { at = at }
  local params = vim.lsp.util.make_position_params(0, client.offset_encoding)
  params.context = { triggerKind = 1 } -- Invoked: the server generates alternatives
  local ok = util.request(client, "textDocument/inlineCompletion", params, function(err, result)
    if fetched[bufnr] == nil or fetched[bufnr].at ~= at then
      return
    end
    fetched[bufnr].result = (not err and result) and result or {}
    if err or not result or not vim.api.nvim_buf_is_valid(bufnr) or vim.api.nvim_get_current_buf() ~= bufnr then
      return
    end
    local now = vim.api.nvim_win_get_cursor(0)
    if vim.api.nvim_buf_get_changedtick(bufnr) ~= tick or now[1] ~= cursor[1] or now[2] ~= cursor[2]
      or not vim.api.nvim_get_mode().mode:match("^i") or builtin_completor(bufnr, client) ~= completor then
      return -- stale: the user typed or moved on
    end
    if #(result.items or result) > 0 then
      show_alternatives(bufnr, completor, client, result, step)
    end
  end, bufnr)
  if not ok then
    fetched[bufnr] = nil
  end
  return ok and true or false
end

--- Show the next (step 1) or previous (-1) of the server's suggestions (`completiond.suggestions`
--- alternatives); with one, fetch alternatives first. False when none shows.
function M.cycle(step, bufnr)
  bufnr = (bufnr == nil or bufnr == 0) and vim.api.nvim_get_current_buf() or bufnr
  if not M.visible(bufnr) then
    return false
  end
  if M.renderer == "builtin" then
    if not fetch_alternatives(bufnr, step) then
      vim.lsp.inline_completion.select({ bufnr = bufnr, count = step })
    end
    return true
  end
  require("completiond.ghost").cycle(bufnr, step)
  return true
end

--- One line for a statusline: "completiond ready 80 ms".
function M.statusline()
  local clients = vim.tbl_filter(function(c)
    return not c:is_stopped()
  end, M.clients())
  if #clients == 0 then
    -- The server went away (killed, crashed): say so rather than nothing, until one starts again.
    return M.exited and M.exited.crashed and "completiond stopped" or ""
  end
  if not M.enabled() then
    return "completiond off"
  end
  local menu = require("completiond.menu")
  if menu.snoozed() then
    return "completiond snoozed " .. menu.snooze_text()
  end
  local s = util.strip_nil(M.status[clients[1].id])
  if not s then
    return "completiond starting"
  end
  local parts = { "completiond", tostring(s.state or "?") }
  if type(s.latencyMs) == "number" then
    table.insert(parts, ("%d ms"):format(s.latencyMs))
  end
  return table.concat(parts, " ")
end

--- Lines describing the plugin and each server (used by :CompletiondStatus).
function M.status_lines()
  local lines = {}
  if not M.config then
    return { "completiond: not set up (call require('completiond').setup())" }
  end
  local menu = require("completiond.menu")
  local state = not M.enabled() and "off" or menu.snoozed() and ("snoozed " .. menu.snooze_text()) or "on"
  table.insert(lines, ("completiond: renderer %s, completions %s"):format(M.renderer, state))
  for _, q in ipairs(menu.questions) do
    table.insert(lines, "question waiting (answer with :CompletiondMenu): " .. q.message)
  end
  local clients = M.clients()
  if #clients == 0 then
    local cmd, err = M.server_cmd(M.config)
    table.insert(lines, cmd and ("no server running (would start: %s)"):format(table.concat(cmd, " ")) or ("no server: " .. err))
  end
  for _, client in ipairs(clients) do
    local s = util.strip_nil(M.status[client.id]) or {}
    table.insert(lines, ("client %d (%s): %s"):format(client.id, client.config.root_dir or "?", table.concat(client.config.cmd or {}, " ")))
    table.insert(lines, ("  state: %s%s"):format(s.state or "starting", s.message and s.message ~= "" and (" — " .. s.message) or ""))
    if s.model then
      table.insert(lines, ("  model: %s on %s"):format(s.model, s.device or "?"))
    end
    vim.list_extend(lines, M.metric_lines(s, "  "))
    local summary = M.suggestion_line(s.suggestions)
    if summary then
      table.insert(lines, "  this session's " .. summary)
    end
    if M.restart_needed(s) then
      table.insert(lines, "  " .. M.restart_needed(s))
    end
  end
  return lines
end

--- The last completion's figures, as people read them: α is the share of the speculative draft's
--- tokens the model kept (not how often suggestions are accepted), and a speed is shown only once
--- one was measured.
function M.metric_lines(s, indent)
  local lines = {}
  if type(s.latencyMs) == "number" then
    table.insert(lines, ("%slast completion: %d ms"):format(indent, s.latencyMs))
  end
  local alpha = s.draftAcceptance or s.alpha
  if type(alpha) == "number" and s.speculation ~= false then
    table.insert(lines, ("%sdraft tokens kept (speculative decoding): %d%%"):format(indent, math.floor(alpha * 100 + 0.5)))
  end
  if type(s.tokensPerSecond) == "number" and s.tokensPerSecond > 0 then
    table.insert(lines, ("%sspeed: %.0f tokens/s"):format(indent, s.tokensPerSecond))
  end
  if type(s.draft) == "string" and s.draft ~= "" then
    local last = (type(s.lastDraft) == "string" and s.lastDraft ~= "") and (" (last completion: %s)"):format(s.lastDraft) or ""
    table.insert(lines, ("%sdraft: %s%s"):format(indent, s.draft, last))
  end
  return lines
end

--- "suggestions: 12 shown, 5 accepted (3 full, 1 word, 1 line), 4 dismissed" from the stats counts.
function M.suggestion_line(counts)
  if type(counts) ~= "table" then
    return nil
  end
  local function n(k) -- the daemon's stats say accepted_full, the status notification acceptedFull
    local v = counts[k]
    if v == nil then
      v = counts[k:gsub("_(%l)", string.upper)]
    end
    return type(v) == "number" and v or 0
  end
  local full, word, line = n("accepted_full"), n("accepted_word"), n("accepted_line")
  return ("suggestions: %d shown, %d accepted (%d full, %d word, %d line), %d dismissed"):format(
    n("shown"), full + word + line, full, word, line, n("dismissed"))
end

--- Ask each server for `completiond.stats`; callback(client, err, result) per client.
function M.request_stats(callback)
  for _, client in ipairs(M.clients()) do
    util.request(client, "workspace/executeCommand", { command = M.CMD_STATS, arguments = {} }, function(err, result)
      callback(client, err, result)
    end)
  end
end

--- The daemon's stats from each server, as lines (waits up to timeout_ms per server).
function M.stats_lines(timeout_ms)
  local lines = {}
  for _, client in ipairs(M.clients()) do
    local result, err = util.request_sync(client, "workspace/executeCommand",
      { command = M.CMD_STATS, arguments = {} }, timeout_ms or 3000)
    if err then
      table.insert(lines, ("client %d stats: error: %s"):format(client.id, err.message or vim.inspect(err)))
    else
      table.insert(lines, ("client %d stats:"):format(client.id))
      local counts = type(result) == "table" and (result.suggestions or (type(result.lsp) == "table" and result.lsp.suggestions))
      local summary = M.suggestion_line(counts)
      if summary then
        table.insert(lines, "  " .. summary)
      end
      vim.list_extend(lines, vim.split(util.format_stats(result, "  "), "\n", { plain = true }))
    end
  end
  return lines
end

--- :CompletiondStatus: the state of each server, then the daemon's stats, in one message.
function M.show_status()
  local lines = M.status_lines()
  vim.list_extend(lines, M.stats_lines(3000))
  vim.api.nvim_echo({ { table.concat(lines, "\n") } }, true, {})
end

--- :CompletiondRestart: restart the shared daemon (the model reloads).
function M.restart()
  for _, client in ipairs(M.clients()) do
    util.request(client, "workspace/executeCommand", { command = M.CMD_RESTART, arguments = {} }, function(err, result)
      if err then
        vim.notify("completiond: restart failed: " .. (err.message or vim.inspect(err)), vim.log.levels.ERROR)
      else
        vim.notify("completiond: daemon restarting " .. vim.inspect(result), vim.log.levels.INFO)
      end
    end)
  end
end

return M
