-- completiond.nvim commands. Nothing starts until require("completiond").setup() is called.
if vim.g.loaded_completiond then
  return
end
vim.g.loaded_completiond = true

if vim.fn.has("nvim-0.10") ~= 1 then
  vim.api.nvim_echo({ { "completiond.nvim needs Neovim >= 0.10", "WarningMsg" } }, true, {})
  return
end

vim.api.nvim_create_user_command("CompletiondStatus", function()
  require("completiond").show_status()
end, { desc = "completiond: server state, last latency and acceptance, stats" })

vim.api.nvim_create_user_command("CompletiondToggle", function()
  require("completiond").toggle()
end, { desc = "completiond: turn inline completions on or off" })

vim.api.nvim_create_user_command("CompletiondRestart", function()
  require("completiond").restart()
end, { desc = "completiond: restart the completion daemon" })

vim.api.nvim_create_user_command("CompletiondMenu", function()
  require("completiond.menu").open()
end, { desc = "completiond: snooze, turn this language off, answer the server's questions, restart, status" })
