-- dev-tools: what a coding agent may and may not do, decision by decision.
local lu = require "luaunit"
local testing = require "stockade.testing"
local p = testing.load("policies/dev-tools.lua")

local function refused(tool, argv, fragment, opts)
  local d = p:decide(tool, argv, opts)
  lu.assertEquals(d.class, "POLICY_VIOLATION", tool .. " " .. table.concat(argv, " "))
  if fragment then lu.assertStrContains(d.message, fragment) end
end

local function allowed(tool, argv, opts)
  local d = p:decide(tool, argv, opts)
  lu.assertEquals(d.class, "OK", (d.message or "") .. " for " .. tool)
  return d
end

-- git ---------------------------------------------------------------------------------

function test_git_reads_and_local_writes()
  allowed("git", { "status" })
  allowed("git", { "log", "--oneline", "-5" })
  allowed("git", { "diff", "HEAD~1" })
  allowed("git", { "commit", "-m", "work" })
  allowed("git", { "grep", "-c", "TODO" })          -- -c after the subcommand is a count
end

function test_git_never_reaches_the_network_or_its_config()
  refused("git", { "push", "origin", "main" }, "human step")
  refused("git", { "fetch" }, "network")
  refused("git", { "clone", "https://example.com/x.git" }, "network")
  refused("git", { "config", "user.name", "x" }, "configuration")
  refused("git", { "credential", "fill" }, "credentials")
  refused("git", { "remote", "add", "evil", "https://example.com" })
  refused("git", { "-c", "core.pager=sh -c id", "log" }, "-c")
  refused("git", { "log", "--exec-path=/tmp" }, "exec-path")
  refused("git", { "-C", "/etc", "status" }, "outside")
  refused("git", { "--git-dir=/root/.git", "status" }, "outside")
  refused("git", {}, "no git subcommand")
end

function test_git_idempotence_follows_the_subcommand()
  lu.assertTrue(p:decide("git", { "status" }).idempotent)
  lu.assertFalse(p:decide("git", { "commit", "-m", "x" }).idempotent)
end

function test_git_structured_args()
  local d = allowed("git", { subcommand = "log", args = { "-3" } })
  lu.assertEquals(d.argv, { "--no-pager", "log", "-3" })
  refused("git", { subcommand = "push" }, "enum")
  refused("git", { subcommand = "log", extra = true }, "additionalProperties")
end

function test_git_lock_is_retryable()
  local class, retryable, msg = p:classify("git", { exit_code = 128,
    stderr_tail = "fatal: Unable to create '.git/index.lock': File exists." })
  lu.assertEquals(class, "TOOL_ERROR")
  lu.assertTrue(retryable)
  lu.assertStrContains(msg, "retry")
  lu.assertNil(p:classify("git", { exit_code = 1, stderr_tail = "error" }))
end

-- files -------------------------------------------------------------------------------

function test_paths_stay_in_the_session()
  allowed("cat", { "README.md" })
  allowed("ls", { "-la", "." })
  refused("cat", { "../../../../etc/shadow" }, "leaves")
  refused("cat", { "/root/.ssh/id_rsa" }, "outside")
  refused("head", { "-n", "5", "/etc/passwd" }, "outside")
  refused("grep", { "-r", "password", "/home" }, "outside")
  allowed("grep", { "-r", "/etc/passwd", "." })     -- a pattern, not a path
end

function test_find_may_only_list()
  allowed("find", { ".", "-name", "*.py" })
  refused("find", { ".", "-delete" }, "-delete")
  refused("find", { ".", "-exec", "rm", "{}", ";" }, "-exec")
  refused("find", { "/", "-name", "id_rsa" }, "outside")
end

-- interpreters and package managers ----------------------------------------------------

function test_inline_code_is_refused_scripts_are_not()
  refused("python3", { "-c", "import os" }, "inline code")
  refused("node", { "-e", "1" }, "inline code")
  refused("python3", { "-m", "pip", "install", "x" }, "package installs")
  refused("python3", { "/tmp/evil.py" }, "outside")
  allowed("python3", { "script.py" })
end

function test_package_managers_are_refused()
  refused("pip", { "install", "requests" }, "package installs")
  refused("npm", { "install" }, "package installs")
end

-- environment and redaction -------------------------------------------------------------

function test_secrets_in_env_are_refused_by_name()
  refused("ls", {}, "deny", { env = { GITHUB_TOKEN = "x" } })
  refused("ls", {}, "deny", { env = { AWS_SECRET_ACCESS_KEY = "x" } })
  allowed("git", { "status" }, { env = { GIT_AUTHOR_NAME = "Agent" } })
  refused("ls", {}, "not allowed", { env = { GIT_AUTHOR_NAME = "Agent" } })
end

function test_outputs_are_redacted_even_split_across_reads()
  local key = "AKIA" .. string.rep("Q", 16)
  local text, n = p:redact("cat", "id=" .. key .. "\n", { chunk = 5 })
  lu.assertNotStrContains(text, key)
  lu.assertEquals(n, 1)
  local jwt = "eyJhbGciOiJIUzI1NiJ9" .. ".eyJzdWIiOiIxMjM0In0" .. ".c2lnbmF0dXJlLXZhbHVl"
  text = p:redact("git", "token: " .. jwt .. " end", { chunk = 7 })
  lu.assertNotStrContains(text, "eyJzdWIiOiIxMjM0In0")
  lu.assertStrContains(text, " end")
end

os.exit(lu.LuaUnit.run())
