--- Conveniences around the suggestions: snooze, a language on/off switch that persists, the server's
--- questions (the first-run model offer) asked without interrupting typing, and :CompletiondMenu.
local M = {}

local function core()
  return require("completiond")
end

--- Snooze: suggestions paused until this time (os.time()), or true until Neovim restarts; nil when not.
M.snoozed_until = nil
local snooze_timer = nil

local function stop_snooze_timer()
  if snooze_timer then
    snooze_timer:stop()
    snooze_timer:close()
    snooze_timer = nil
  end
end

--- Questions from a server (window/showMessageRequest) waiting for the user's answer.
---@type { message: string, actions: table[], answer: fun(choice: table|nil), client_id: integer }[]
M.questions = {}

local function state_file()
  return vim.fs.joinpath(vim.fn.stdpath("state"), "completiond", "languages.json")
end

--- The languages the user turned off or on from the menu: { [filetype] = false|true }. They win over the
--- `filetypes` option because they are the user's latest word, and survive restarts.
function M.read_languages()
  local f = io.open(state_file(), "r")
  if not f then
    return {}
  end
  local text = f:read("*a")
  f:close()
  local ok, data = pcall(vim.json.decode, text)
  if not ok or type(data) ~= "table" then
    vim.notify("completiond: ignoring unreadable " .. state_file(), vim.log.levels.WARN)
    return {}
  end
  local out = {}
  for ft, on in pairs(data) do
    if type(ft) == "string" and type(on) == "boolean" then
      out[ft] = on
    end
  end
  return out
end

local function write_languages(map)
  local path = state_file()
  vim.fn.mkdir(vim.fs.dirname(path), "p")
  local tmp = path .. ".tmp"
  local f, err = io.open(tmp, "w")
  if not f then
    vim.notify("completiond: cannot save the language choice: " .. tostring(err), vim.log.levels.WARN)
    return
  end
  f:write(vim.json.encode(map))
  f:close()
  os.rename(tmp, path)
end

--- Apply the saved language choices to a resolved config (from setup()).
function M.apply_languages(cfg)
  for ft, on in pairs(M.read_languages()) do
    cfg.filetypes[ft] = on
  end
end

--- Turn suggestions on or off for a filetype, here and in every later session.
---@param ft string
---@param on boolean|nil nil flips
function M.set_language(ft, on)
  local c = core()
  if not c.config or ft == nil or ft == "" then
    vim.notify("completiond: this buffer has no filetype to turn off", vim.log.levels.WARN)
    return
  end
  if on == nil then
    on = not require("completiond.config").filetype_enabled(c.config, ft)
  end
  c.config.filetypes[ft] = on
  local saved = M.read_languages()
  saved[ft] = on
  write_languages(saved)
  for _, bufnr in ipairs(vim.api.nvim_list_bufs()) do
    if vim.api.nvim_buf_is_loaded(bufnr) and vim.bo[bufnr].filetype == ft then
      if on then
        c.attach(bufnr)
      end
    end
  end
  c.refresh_buffers()
  vim.notify(("completiond: suggestions %s for %s"):format(on and "on" or "off", ft), vim.log.levels.INFO)
end

--- Whether suggestions are snoozed now.
function M.snoozed()
  if M.snoozed_until == true then
    return true
  end
  return type(M.snoozed_until) == "number" and os.time() < M.snoozed_until
end

--- "until 14:05" / "until restart", for the statusline and the menu.
function M.snooze_text()
  if M.snoozed_until == true then
    return "until restart"
  end
  return "until " .. os.date("%H:%M", M.snoozed_until)
end

--- Pause suggestions for `minutes` (nil: until Neovim restarts); they resume by themselves.
function M.snooze(minutes)
  stop_snooze_timer()
  if minutes then
    M.snoozed_until = os.time() + math.floor(minutes * 60 + 0.5)
    snooze_timer = vim.uv.new_timer()
    snooze_timer:start(math.floor(minutes * 60000 + 0.5), 0, vim.schedule_wrap(function()
      M.resume(true)
    end))
  else
    M.snoozed_until = true
  end
  core().refresh_buffers()
  pcall(vim.cmd.redrawstatus, { bang = true })
  vim.notify("completiond: suggestions snoozed " .. M.snooze_text(), vim.log.levels.INFO)
end

--- End a snooze (`by_timer`: it ran out).
function M.resume(by_timer)
  stop_snooze_timer()
  local was = M.snoozed_until ~= nil
  M.snoozed_until = nil
  core().refresh_buffers()
  pcall(vim.cmd.redrawstatus, { bang = true })
  if was then
    vim.notify("completiond: suggestions resumed" .. (by_timer and " (snooze over)" or ""), vim.log.levels.INFO)
  end
end

--- The window/showMessageRequest handler for completiond's clients. Neovim's own would open a blocking
--- prompt (inputlist) in the middle of typing, where keystrokes would answer it; here the question waits,
--- announced once, until the user answers it from :CompletiondMenu. Runs in the coroutine Neovim gives
--- server requests, so the reply goes when the user answers.
function M.on_message_request(_, params, ctx)
  if type(params) ~= "table" or type(params.actions) ~= "table" or #params.actions == 0 then
    if type(params) == "table" and type(params.message) == "string" then
      vim.notify(params.message, vim.log.levels.INFO)
    end
    return vim.NIL
  end
  local co, is_main = coroutine.running()
  if not co or is_main then
    -- No coroutine to wait in: nothing to answer with; the server asks again another time.
    return nil, vim.lsp.rpc.rpc_response_error(vim.lsp.protocol.ErrorCodes.RequestFailed, "cannot ask now")
  end
  local question = { message = params.message or "", actions = params.actions, client_id = ctx.client_id }
  question.answer = function(choice)
    for i, q in ipairs(M.questions) do
      if q == question then
        table.remove(M.questions, i)
        break
      end
    end
    vim.schedule(function()
      coroutine.resume(co, choice or vim.NIL)
    end)
  end
  table.insert(M.questions, question)
  vim.schedule(function()
    vim.notify(question.message .. "\nAnswer with :CompletiondMenu", vim.log.levels.INFO)
    pcall(vim.cmd.redrawstatus, { bang = true })
  end)
  return coroutine.yield()
end

--- Answer the oldest waiting question with the action titled `title` (nil: dismiss it). For scripts and tests.
function M.answer(title)
  local q = M.questions[1]
  if not q then
    return false
  end
  for _, action in ipairs(q.actions) do
    if action.title == title then
      q.answer(action)
      return true
    end
  end
  q.answer(nil)
  return true
end

--- The menu's entries, for the current buffer: { label, run } in order.
function M.entries(bufnr)
  local c = core()
  bufnr = (bufnr == nil or bufnr == 0) and vim.api.nvim_get_current_buf() or bufnr
  local items = {}
  local function add(label, run)
    table.insert(items, { label = label, run = run })
  end
  for _, q in ipairs(M.questions) do
    add("Answer: " .. q.message, function()
      vim.ui.select(q.actions, {
        prompt = q.message,
        format_item = function(a)
          return a.title
        end,
      }, function(choice)
        q.answer(choice)
      end)
    end)
  end
  if M.snoozed() then
    add("Resume suggestions (snoozed " .. M.snooze_text() .. ")", function()
      M.resume()
    end)
  else
    for _, minutes in ipairs({ 5, 15, 60 }) do
      add(("Snooze for %d minutes"):format(minutes), function()
        M.snooze(minutes)
      end)
    end
    add("Snooze until Neovim restarts", function()
      M.snooze(nil)
    end)
  end
  local ft = vim.bo[bufnr].filetype
  if ft ~= "" and c.config then
    local on = require("completiond.config").filetype_enabled(c.config, ft)
    add(("Turn suggestions %s for %s"):format(on and "off" or "on", ft), function()
      M.set_language(ft, not on)
    end)
  end
  add(c.enabled() and "Turn completions off" or "Turn completions on", function()
    c.toggle()
  end)
  add("Restart the daemon (reloads the model)", function()
    c.restart()
  end)
  add("Choose a model…", function()
    M.choose_model()
  end)
  add("Pull a model…", function()
    M.pull()
  end)
  add("Show status and stats", function()
    c.show_status()
  end)
  add("Open the daemon's log", function()
    vim.cmd.split(vim.fn.fnameescape(M.daemon_log()))
  end)
  add("Settings (config.toml; the plugin's own: :help completiond-config)", function()
    local path = M.config_toml()
    vim.fn.mkdir(vim.fs.dirname(path), "p")
    vim.cmd.split(vim.fn.fnameescape(path))
  end)
  return items
end

--- The server's catalog (`completiond.models`): loadable models, the one recommended for this machine first.
--- The one picked becomes the `model` setting for this session; the daemon restarts with it and downloads it,
--- with progress. (To keep it, put it in setup()'s settings or config.toml.)
function M.choose_model()
  local c = core()
  local client = c.clients()[1]
  if not client then
    vim.notify("completiond: no server running", vim.log.levels.WARN)
    return
  end
  require("completiond.util").request(client, "workspace/executeCommand", { command = "completiond.models", arguments = {} },
    function(err, result)
      if err or type(result) ~= "table" or type(result.models) ~= "table" then
        vim.notify("completiond: this server has no model list (" .. (err and err.message or "no answer") .. ")",
          vim.log.levels.WARN)
        return
      end
      local models = {}
      for _, m in ipairs(result.models) do
        if m.repo == result.recommended then
          table.insert(models, 1, m)
        else
          table.insert(models, m)
        end
      end
      table.insert(models, { repo = vim.NIL, name = "the bundled model (Python only, no download)" })
      vim.schedule(function()
        vim.ui.select(models, {
          prompt = "Model (now: " .. ((type(result.current) == "string" and result.current ~= "") and result.current or "bundled") .. ")",
          format_item = function(m)
            if m.repo == vim.NIL then
              return m.name
            end
            local langs = type(m.languages) == "table" and #m.languages > 0 and table.concat(m.languages, ", ") or "?"
            if langs == "*" then
              langs = "every language"
            end
            return ("%s%s — %.1f GB, %s; %s"):format(m.repo, m.repo == result.recommended and " (recommended here)" or "",
              tonumber(m.downloadGb) or 0, tostring(m.cpu or ""), langs)
          end,
        }, function(m)
          if not m then
            return
          end
          c.user_settings.model = m.repo
          c.push_settings()
          vim.notify(("completiond: model %s for this session (the daemon loads it%s); to keep it, set it in setup()'s settings or config.toml")
            :format(m.repo == vim.NIL and "bundled" or m.repo, m.repo == vim.NIL and "" or ", downloading it first"), vim.log.levels.INFO)
        end)
      end)
    end)
end

--- Where the shared daemon writes its log (completiond/serving/paths.py: runtime_dir).
function M.daemon_log()
  local run = vim.env.XDG_RUNTIME_DIR
  local dir = (run and run ~= "") and vim.fs.joinpath(run, "completiond")
    or vim.fs.joinpath(vim.uv.os_tmpdir(), "completiond-" .. vim.uv.getuid())
  return vim.fs.joinpath(dir, "daemon.log")
end

--- The user's config.toml (completiond/config.py: config_file_path).
function M.config_toml()
  local home = vim.env.XDG_CONFIG_HOME
  local root = (home and home ~= "") and home or vim.fs.joinpath(vim.uv.os_homedir(), ".config")
  return vim.fs.joinpath(root, "completiond", "config.toml")
end

--- Ask which model to pull, then run `completiond pull NAME` in a terminal split (its progress shows there;
--- an interrupted pull resumes when run again).
function M.pull(name)
  local cli = core().cli_cmd()
  if not cli then
    vim.notify("completiond: run `completiond pull NAME` in a terminal (no completiond command found for a custom cmd)",
      vim.log.levels.WARN)
    return
  end
  local function run(model)
    if not model or vim.trim(model) == "" then
      return
    end
    local cmd = vim.list_extend(vim.deepcopy(cli), { "pull", vim.trim(model) })
    vim.cmd("botright split")
    vim.cmd.enew()
    if vim.fn.has("nvim-0.11") == 1 then
      vim.fn.jobstart(cmd, { term = true })
    else
      vim.fn.termopen(cmd)
    end
  end
  if name then
    return run(name)
  end
  vim.ui.input({ prompt = "Model to pull (`completiond pull --list` shows them): ", default = "qwen2.5-coder-0.5b" }, run)
end

--- :CompletiondMenu: the model and its state as the prompt, then the actions.
function M.open(bufnr)
  local c = core()
  local items = M.entries(bufnr)
  local head = c.statusline()
  for _, client in ipairs(c.clients()) do
    local s = c.status[client.id]
    if s and s.model then
      head = ("%s — %s on %s"):format(head ~= "" and head or "completiond", s.model, s.device or "?")
      local counts = c.suggestion_line(s.suggestions)
      if counts then
        head = head .. "; " .. counts
      end
      break
    end
  end
  vim.ui.select(items, {
    prompt = head ~= "" and head or "completiond",
    format_item = function(item)
      return item.label
    end,
  }, function(item)
    if item then
      item.run()
    end
  end)
end

return M
