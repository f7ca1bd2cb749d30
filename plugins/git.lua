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
  ["archive"] = "git archive --remote reaches the network; not an agent's tool",
  remote = "remotes are configured by people, not agents",
  config = "git configuration is not the agent's to change",
  credential = "credentials are never handed to tools",
  submodule = "submodules fetch from the network",
  daemon = "git must not serve anything", ["upload-pack"] = "git must not serve anything",
  ["receive-pack"] = "git must not serve anything",
  ["http-backend"] = "git must not serve anything",
  ["filter-branch"] = "history rewriting is a human step",
  gc = "maintenance is not the agent's job", prune = "maintenance is not the agent's job",
}

local argv = require "plugins.argv"

local PROGRAM = "runs a program named on the command line"
local CONFIG = "inline configuration can run programs"

-- Global options, before the subcommand (git.c: handle_options). The first operand is
-- the subcommand.
M.global = argv.grammar({
  { "C", nil, "path" }, { "c", nil, "refuse", CONFIG },
  { nil, "config-env", "refuse", CONFIG }, { nil, "exec-path", "refuse", PROGRAM },
  { nil, "git-dir", "path" }, { nil, "work-tree", "path" }, { nil, "namespace", "value" },
  { nil, "super-prefix", "value" }, { nil, "attr-source", "value" },
  { nil, "list-cmds", "value" },
}, { stop_at_operand = true })

-- Options of the subcommands (parse-options: abbreviations of long options accepted,
-- options after operands too). Each subcommand's own value options; what every one
-- refuses or reads as a file is common.
local common = {
  { nil, "upload-pack", "refuse", PROGRAM }, { nil, "receive-pack", "refuse", PROGRAM },
  { nil, "exec", "refuse", PROGRAM }, { nil, "exec-path", "refuse", PROGRAM },
  { nil, "config-env", "refuse", CONFIG },
  { nil, "output", "path" }, { nil, "pathspec-from-file", "path" },
  { "F", "file", "path" }, { "t", "template", "path" },
}
local function sub_grammar(entries)
  local all = {}
  for _, e in ipairs(common) do all[#all + 1] = e end
  for _, e in ipairs(entries) do all[#all + 1] = e end
  return argv.grammar(all)
end
-- diff, log, show share the diff options: -O<orderfile> reads a file
local diff_options = {
  { nil, "no-index", "flag" }, { "O", nil, "path" }, { nil, "relative", "optional" },
  { "U", "unified", "value" },
  { nil, "src-prefix", "value" }, { nil, "dst-prefix", "value" },
  { nil, "diff-filter", "value" }, { "S", nil, "value" }, { "G", nil, "value" },
  { nil, "find-object", "value" }, { "l", nil, "value" }, { "n", "max-count", "value" },
  { nil, "skip", "value" }, { nil, "since", "value" }, { nil, "until", "value" },
  { nil, "author", "value" }, { nil, "committer", "value" }, { nil, "grep", "value" },
  { nil, "format", "value" }, { nil, "pretty", "optional" }, { nil, "word-diff-regex", "value" },
  { nil, "color-moved", "optional" }, { nil, "stat", "optional" }, { nil, "abbrev", "optional" },
}
M.subcommand = {
  diff = sub_grammar(diff_options), log = sub_grammar(diff_options),
  show = sub_grammar(diff_options),
  grep = sub_grammar {
    { "O", "open-files-in-pager", "refuse", PROGRAM }, { nil, "no-index", "flag" },
    { "e", nil, "value" },
    { "f", nil, "path" }, { "A", "after-context", "value" }, { "B", "before-context", "value" },
    { "C", "context", "value" }, { "m", "max-count", "value" }, { nil, "max-depth", "value" },
    { nil, "threads", "value" }, { nil, "color", "optional" },
  },
  blame = sub_grammar {
    { nil, "contents", "path" }, { "S", nil, "path" }, { nil, "ignore-revs-file", "path" },
    { "L", nil, "value" }, { nil, "ignore-rev", "value" }, { "C", nil, "optional" },
    { "M", nil, "optional" }, { nil, "abbrev", "optional" },
  },
  commit = sub_grammar {
    { "m", "message", "value" }, { "C", "reuse-message", "value" },
    { "c", "reedit-message", "value" }, { nil, "fixup", "value" }, { nil, "squash", "value" },
    { nil, "author", "value" }, { nil, "date", "value" }, { nil, "cleanup", "value" },
    { "S", "gpg-sign", "optional" }, { nil, "trailer", "value" },
  },
}
M.subcommand.default = sub_grammar {}

-- Subcommands whose operands are files on the host, not revisions or pathspecs in the
-- repository: every one must stay beneath the session root.
local function host_operands(sub, parsed)
  if sub == "apply" then return parsed.operands end
  if (sub == "diff" or sub == "grep") and argv.has(parsed, "no-index") then
    local ops = parsed.operands
    -- grep's first operand is the pattern, unless -e or -f gave it
    if sub == "grep" and not argv.has(parsed, "e") and not argv.has(parsed, "f") then
      return { table.unpack(ops, 2) }
    end
    return ops
  end
  return {}
end

-- The subcommand: the first operand after the global options. Paths among the global
-- options (-C, --git-dir, --work-tree) must stay beneath the session root. Returns the
-- subcommand, nil and the index of the subcommand in argv; or nil and a reason.
function M.parse(call)
  local parsed, why = argv.parse(call.argv, M.global)
  if not parsed then return nil, why end
  local ok, outside = stockade.paths_beneath(call, argv.path_values(parsed))
  if not ok then return nil, outside end
  local sub = parsed.operands[1]
  if not sub then return nil, "no git subcommand" end
  return sub, nil, parsed.operand_at[1]
end

-- The subcommand's own options and operands, checked: refused options, files named by
-- options, and host-file operands all beneath the session root.
function M.check_subcommand(call, sub, at)
  local g = M.subcommand[sub] or M.subcommand.default
  local parsed, why = argv.parse(call.argv, g, at + 1)
  if not parsed then return false, "git " .. sub .. " " .. why end
  local paths = argv.path_values(parsed)
  for _, p in ipairs(host_operands(sub, parsed)) do paths[#paths + 1] = p end
  local ok, outside = stockade.paths_beneath(call, paths)
  if not ok then return false, "git " .. sub .. ": " .. outside end
  return true, nil, parsed
end

function M.accept(opts)
  opts = opts or {}
  return function(call)
    local sub, why, at = M.parse(call)
    if not sub then return false, why end
    if M.refused[sub] then return false, "git " .. sub .. ": " .. M.refused[sub] end
    local ok, bad, parsed = M.check_subcommand(call, sub, at)
    if not ok then return false, bad end
    if M.read_only[sub] then
      -- `git branch NAME` / `git tag NAME` create refs: a write
      local creates = (sub == "branch" or sub == "tag") and #parsed.operands > 0
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
