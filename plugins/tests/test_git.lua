-- plugins/git.lua: git's own option grammar (global options, then the subcommand's),
-- and a table of refused invocations, each with the reason the model is told.
local lu = require "luaunit"
local testing = require "stockade.testing"
local refusals = require "tests.lua.refusals"
local p = testing.load("tests/fixtures/git_plugin.lua")

local REFUSED = {
  -- the network, serving, configuration
  { "git", { "push", "origin", "main" }, "human step" },
  { "git", { "fetch" }, "network" },
  { "git", { "clone", "https://example.com/x.git" }, "network" },
  { "git", { "archive", "--remote=https://example.com/x.git", "HEAD" }, "network" },
  { "git", { "config", "user.name", "x" }, "configuration" },
  { "git", { "credential", "fill" }, "credentials" },
  { "git", { "remote", "add", "evil", "https://example.com" }, "remotes" },
  { "git", { "submodule", "update" }, "submodules" },
  -- programs and configuration named on the command line
  { "git", { "-c", "core.pager=sh -c id", "log" }, "configuration" },
  { "git", { "-ccore.pager=id", "log" }, "configuration" },
  { "git", { "--config-env=core.pager=X", "log" }, "configuration" },
  { "git", { "--exec-path=/tmp", "log" }, "program" },
  { "git", { "log", "--exec-path=/tmp" }, "program" },
  { "git", { "grep", "--open-files-in-pager=sh -c id", "x" }, "program" },
  { "git", { "grep", "--open-files-in=sh", "x" }, "program" },
  { "git", { "grep", "-O", "x" }, "program" },
  { "git", { "grep", "-nOsh", "x" }, "program" },
  -- files outside the session, by option or operand
  { "git", { "-C", "/etc", "status" }, "outside" },
  { "git", { "--git-dir=/root/.git", "status" }, "outside" },
  { "git", { "--work-tree", "/", "status" }, "outside" },
  { "git", { "diff", "--no-index", "--", "/dev/null", "/etc/passwd" }, "outside" },
  { "git", { "diff", "--no-index", "/etc/passwd", "x" }, "outside" },
  { "git", { "diff", "-O/etc/shadow" }, "outside" },
  { "git", { "log", "--output=/tmp/x" }, "outside" },
  { "git", { "grep", "--no-index", "root", "/etc/passwd" }, "outside" },
  { "git", { "grep", "--no-index", "-f", "/etc/shadow", "." }, "outside" },
  { "git", { "blame", "--contents", "/etc/passwd", "f" }, "outside" },
  { "gitw", { "commit", "-F", "/etc/shadow" }, "outside" },
  { "gitw", { "commit", "--file=/etc/shadow" }, "outside" },
  { "gitw", { "apply", "/etc/x.patch" }, "outside" },
  -- a global option's value is not the subcommand
  { "git", { "--namespace", "status", "push" }, "human step" },
  { "git", { "-C", ".", "push" }, "human step" },
  -- writes need local writes; unknown subcommands are refused
  { "git", { "commit", "-m", "x" }, "read-only" },
  { "git", { "branch", "new" }, "local writes" },
  { "git", { "init" }, "read-only" },
  { "gitw", { "bisect", "run", "sh" }, "not on the policy's list" },
  { "git", {}, "no git subcommand" },
  { "git", { "--bare" }, "no git subcommand" },
}

function test_refused()
  refusals.assert_all_refused(p, REFUSED)
end

function test_allowed()
  for _, case in ipairs {
    { "git", { "status" } }, { "git", { "--no-pager", "log", "-3" } },
    { "git", { "-C", "sub", "status" } }, { "git", { "grep", "-c", "TODO" } },
    { "git", { "grep", "-e", "x", "--", "src" } }, { "git", { "log", "-n", "5", "--", "." } },
    { "git", { "diff", "--no-index", "a", "b" } }, { "git", { "branch", "--list" } },
    { "gitw", { "commit", "-m", "work" } }, { "gitw", { "branch", "topic" } },
    { "gitw", { "commit", "-F", "msg.txt" } },
  } do
    local d = p:decide(case[1], case[2])
    lu.assertEquals(d.class, "OK", case[1] .. " " .. table.concat(case[2], " ") .. ": " ..
                    tostring(d.message))
  end
end

function test_idempotent()
  lu.assertTrue(p:decide("git", { "status" }).idempotent)
  lu.assertFalse(p:decide("git", { "branch", "--list" }).idempotent)
end

os.exit(lu.LuaUnit.run())
