-- argv rules for git, for policies that give an agent a repository.
--
--   local git = require "plugins.git"
--   git = stockade.tool { path = "/usr/bin/git", accept = git.accept{ local_writes = true },
--                         idempotent = git.idempotent, ... }
--
-- Why each rule: the agent works on a checkout inside its session. Reading history is
-- harmless; local commits are the agent's own work; anything that reaches the network
-- (push, fetch, clone), rewrites who git trusts (config, credential, remote) or runs a
-- program named on the command line (-c, --exec-path, --upload-pack) is refused, so a
-- publish stays a human step.
local stockade = require "stockade"

local M = {}

-- Subcommands that only read.
M.read_only = {
  status = true, diff = true, log = true, show = true, ["rev-parse"] = true,
  ["ls-files"] = true, blame = true, grep = true, shortlog = true, describe = true,
  ["cat-file"] = true, ["ls-tree"] = true, ["merge-base"] = true, ["show-ref"] = true,
  branch = true, tag = true,   -- listing; creating one is refused below unless writes are on
}

-- Subcommands that change only the local checkout.
M.local_write = {
  add = true, commit = true, checkout = true, switch = true, restore = true, stash = true,
  init = true, reset = true, merge = true, ["cherry-pick"] = true, revert = true, mv = true,
  rm = true, apply = true,
}

-- Refused whatever else the policy says, with the reason the model is told.
M.refused = {
  push = "publishing is a human step",
  fetch = "git must not reach the network", pull = "git must not reach the network",
  clone = "git must not reach the network", ["ls-remote"] = "git must not reach the network",
  remote = "remotes are configured by people, not agents",
  config = "git configuration is not the agent's to change",
  credential = "credentials are never handed to tools",
  submodule = "submodules fetch from the network",
  daemon = "git must not serve anything", ["upload-pack"] = "git must not serve anything",
  ["receive-pack"] = "git must not serve anything", ["http-backend"] = "git must not serve anything",
  ["filter-branch"] = "history rewriting is a human step",
  gc = "maintenance is not the agent's job", prune = "maintenance is not the agent's job",
}

-- Options that run a program or change config from the command line: refused anywhere.
local dangerous_option = {
  ["--config-env"] = "inline configuration can run programs",
  ["--exec-path"] = "--exec-path runs programs", ["--upload-pack"] = "--upload-pack runs programs",
  ["--receive-pack"] = "--receive-pack runs programs",
}
-- Before the subcommand, -c sets configuration (core.pager, core.sshCommand...); after
-- it, -c means something harmless to the subcommand (grep -c counts).
local dangerous_global = { ["-c"] = "inline configuration (-c) can run programs" }

local function option_name(arg)
  return arg:match("^(%-%-[%w-]+)=") or arg
end

-- The subcommand: the first argument that is not a global option. Global options that
-- take a value (-C path, --git-dir=...) are checked to stay beneath the session root.
function M.parse(call)
  local argv = call.argv
  local i = 1
  while i <= #argv do
    local a = argv[i]
    local name = option_name(a)
    local bad = dangerous_option[name] or dangerous_global[name]
    if bad then return nil, bad end
    if a == "-C" or a == "--git-dir" or a == "--work-tree" then
      local value = argv[i + 1]
      if not value then return nil, a .. " needs a value" end
      local ok, why = stockade.paths_beneath(call, { value })
      if not ok then return nil, why end
      i = i + 2
    elseif name == "--git-dir" or name == "--work-tree" then
      local ok, why = stockade.paths_beneath(call, { a:match("=(.*)$") })
      if not ok then return nil, why end
      i = i + 1
    elseif a:sub(1, 1) == "-" then
      i = i + 1
    else
      return a, nil, i
    end
  end
  return nil, "no git subcommand"
end

function M.accept(opts)
  opts = opts or {}
  return function(call)
    local sub, why, at = M.parse(call)
    if not sub then return false, why end
    if M.refused[sub] then return false, "git " .. sub .. ": " .. M.refused[sub] end
    for j = at + 1, #call.argv do
      local name = option_name(call.argv[j])
      if dangerous_option[name] then return false, dangerous_option[name] end
    end
    if M.read_only[sub] then
      -- `git branch NAME` / `git tag NAME` create refs: a write
      local creates = (sub == "branch" or sub == "tag") and call.argv[at + 1] and
                      call.argv[at + 1]:sub(1, 1) ~= "-"
      if not creates or opts.local_writes then return true end
      return false, "git " .. sub .. " creating a ref needs local writes"
    end
    if M.local_write[sub] then
      if opts.local_writes then return true end
      return false, "git " .. sub .. ": this policy gives git read-only access"
    end
    return false, "git " .. sub .. ": not on the policy's list of git subcommands"
  end
end

-- Reading twice gives the same answer; anything else may not.
function M.idempotent(call)
  local sub = M.parse(call)
  return sub ~= nil and M.read_only[sub] == true and sub ~= "branch" and sub ~= "tag"
end

return M
