-- dev-tools: what a coding agent may and may not do, decision by decision.
local lu = require "luaunit"
local testing = require "stockade.testing"
local refusals = require "tests.lua.refusals"
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
-- Through structured args only: {subcommand = ..., args = {...}}.

local function git(sub, ...) return { subcommand = sub, args = { ... } } end

function test_git_reads_and_local_writes()
  allowed("git", git("status"))
  allowed("git", git("log", "--oneline", "-5"))
  allowed("git", git("diff", "HEAD~1"))
  allowed("git", git("commit", "-m", "work"))
  allowed("git", git("grep", "-c", "TODO"))          -- -c after the subcommand is a count
  allowed("git", git("diff", "--no-index", "--", "a.txt", "b.txt"))
end

function test_git_raw_argv_cannot_skip_the_schema()
  refused("git", { "init" }, "structured args")
  refused("git", { "status" }, "structured args")
  refused("git", git("init"), "enum")
  refused("git", git("push"), "enum")
end

function test_git_never_reaches_the_network_or_its_config()
  refused("git", git("log", "--exec-path=/tmp"), "exec-path")
  refused("git", git("log", "--output=/etc/x"), "outside")
  refused("git", git("diff", "--no-index", "--", "/dev/null", "/etc/passwd"), "outside")
  refused("git", git("diff", "--no-ind", "/dev/null", "/etc/passwd"), "outside")
  refused("git", git("grep", "--no-index", "--open-files-in-pager=sh -c 'id'", "x"), "program")
  refused("git", git("grep", "--open-files-in=sh -c id", "x"), "program")
  refused("git", git("grep", "-Osh", "x"), "program")
  refused("git", git("grep", "--no-index", "root", "/etc/passwd"), "outside")
  refused("git", git("grep", "--no-index", "-e", "root", "/etc/passwd"), "outside")
  refused("git", git("commit", "-F", "/etc/shadow"), "outside")
  refused("git", git("blame", "--contents", "/etc/passwd", "x"), "outside")
end

function test_git_idempotence_follows_the_subcommand()
  lu.assertTrue(p:decide("git", git("status")).idempotent)
  lu.assertFalse(p:decide("git", git("commit", "-m", "x")).idempotent)
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
  refused("python3", { "-m", "pip", "install", "x" }, "-m")
  refused("python3", { "/tmp/evil.py" }, "outside")
  allowed("python3", { "script.py" })
  allowed("python3", { "-u", "script.py", "--flag" })
  allowed("node", { "app.js" })
end

-- Every way each tool has of running code it was handed, reading a file outside the
-- session or writing one: refused, each for its reason.
local REFUSED = {
  -- python3: inline code in all its spellings
  { "python3", { "-Sc", "import os" }, "inline code" },
  { "python3", { "-I", "-c", "import os" }, "inline code" },
  { "python3", { "-cimport os" }, "inline code" },
  { "python3", { "-" }, "stdin" },
  { "python3", {}, "stdin" },
  { "python3", { "-S" }, "stdin" },
  { "python3", { "-i", "script.py" }, "inline code" },
  { "python3", { "-mtimeit", "import os" }, "-m" },
  { "python3", { "-W", "ignore", "-c", "x" }, "inline code" },
  { "python3", { "-X", "dev", "/etc/x.py" }, "outside" },
  -- node
  { "node", { "--eval", "1" }, "inline code" },
  { "node", { "--eval=1" }, "inline code" },
  { "node", { "-pe", "1" }, "inline code" },
  { "node", { "-p", "1" }, "inline code" },
  { "node", { "-i" }, "inline code" },
  { "node", {}, "stdin" },
  { "node", { "-" }, "stdin" },
  { "node", { "-r", "/etc/evil.js", "app.js" }, "outside" },
  { "node", { "--env-file=/etc/environment", "app.js" }, "outside" },
  -- find: every start point, every file a test names, no actions
  { "find", { ".", "/etc", "-name", "passwd" }, "outside" },
  { "find", { "src", "../../..", "-name", "x" }, "leaves" },
  { "find", { "-H", ".", "/root" }, "outside" },
  { "find", { ".", "-newer", "/etc/shadow" }, "outside" },
  { "find", { ".", "-newermm", "/etc/shadow" }, "outside" },
  { "find", { ".", "-execdir", "id", ";" }, "-execdir" },
  { "find", { ".", "-fprint", "out" }, "-fprint" },
  { "find", { ".", "-files0-from", "list" }, "files0-from" },
  { "find", { "-L", "." }, "symbolic links" },
  { "find", { ".", "-follow" }, "symbolic links" },
  -- grep: the pattern is the first operand only when -e and -f are absent
  { "grep", { "-e", "root", "/etc/passwd" }, "outside" },
  { "grep", { "-eroot", "/etc/passwd" }, "outside" },
  { "grep", { "--regexp=root", "/etc/passwd" }, "outside" },
  { "grep", { "-f", "/etc/shadow", "." }, "outside" },
  { "grep", { "--fil=/etc/shadow", "." }, "outside" },
  { "grep", { "-r", "x", ".", "/etc" }, "outside" },
  { "grep", { "x", "--", "/etc/passwd" }, "outside" },
  { "grep", { "-R", "x", "." }, "symbolic links" },
  -- head, ls, cat
  { "head", { "-n5", "/etc/passwd" }, "outside" },
  { "head", { "-c", "10", "/etc/passwd" }, "outside" },
  { "ls", { "-la", "/root" }, "outside" },
  { "ls", { "--width=80", "/" }, "outside" },
  { "cat", { "-n", "/etc/shadow" }, "outside" },
  { "cat", { "--", "/etc/shadow" }, "outside" },
}

function test_each_tool_refuses_what_its_comment_says()
  refusals.assert_all_refused(p, REFUSED)
end

function test_the_same_tools_still_work()
  allowed("find", { ".", "src", "-name", "*.py" })
  allowed("find", { "-newermt", "2024-01-01" })
  allowed("grep", { "-e", "x", "-e", "y", "src" })
  allowed("grep", { "-A3", "-rn", "TODO", "." })
  allowed("head", { "-n", "5", "README.md" })
  allowed("ls", { "-w", "80", "src" })
  allowed("cat", { "README.md" })
  allowed("node", { "--version" })
end

function test_package_managers_are_refused()
  refused("pip", { "install", "requests" }, "package installs")
  refused("npm", { "install" }, "package installs")
end

-- environment and redaction -------------------------------------------------------------

function test_secrets_in_env_are_refused_by_name()
  refused("ls", {}, "deny", { env = { GITHUB_TOKEN = "x" } })
  refused("ls", {}, "deny", { env = { AWS_SECRET_ACCESS_KEY = "x" } })
  allowed("git", { subcommand = "status" }, { env = { GIT_AUTHOR_NAME = "Agent" } })
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
