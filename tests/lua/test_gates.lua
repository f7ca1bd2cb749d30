-- LuaUnit tests of the CI gates (lua/gates.lua): `stockade check|diff|dry-run|budget`
-- driven through the real binary over the fixtures tests/fixtures/gates_*.lua, and the
-- negative CI tests of the policy engine (unknown binary, symlink escape).
--
--   cd /work/main && ./stockade test tests/lua/test_gates.lua
--
-- The binary is $STOCKADE_BIN, else ./stockade (run from the repository root). The
-- dry-run tests start real processes; the path-permission test needs root (it chowns).
local lu = require "luaunit"
local testing = require "stockade.testing"

local BIN = os.getenv("STOCKADE_BIN") or "./stockade"
local F = "tests/fixtures/"
local IS_ROOT = (io.popen("id -u"):read("l") or "") == "0"

local function q(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

-- Run `stockade ARGS`; stdout (stderr to /dev/null unless `with_stderr`) and the status.
local function stockade(argstr, with_stderr)
  local f = assert(io.popen(BIN .. " " .. argstr .. (with_stderr and " 2>&1" or " 2>/dev/null")))
  local out = f:read("a")
  local _, how, code = f:close()
  lu.assertEquals(how, "exit", "stockade " .. argstr .. " did not exit normally")
  return out, code
end

local function lines(s)
  local t = {}
  for l in s:gmatch("[^\n]+") do t[#t + 1] = l end
  return t
end

-- The first line of `file` containing `needle` (plain).
local function line_of(file, needle)
  local n = 0
  for l in io.lines(file) do
    n = n + 1
    if l:find(needle, 1, true) then return n end
  end
  error(needle .. " not in " .. file)
end

-- "FILE:LINE: tool NAME: msg" with LINE where `NAME = stockade.tool` is.
local function tool_line(file, name, msg)
  return string.format("%s:%d: tool %s: %s", file, line_of(file, name .. " = stockade.tool"),
                       name, msg)
end

local function policy_line(file, needle, msg)
  return string.format("%s:%d: policy: %s", file, line_of(file, needle), msg)
end

local function sorted(t)
  local c = {}
  for i, v in ipairs(t) do c[i] = v end
  table.sort(c)
  return c
end

local function json_decode(s)
  local ok, cjson = pcall(require, "cjson")
  if not ok then lu.skip("lua-cjson is not installed") end
  return cjson.decode(s)
end

-- ---- check --------------------------------------------------------------------------

TestCheck = {}

function TestCheck.test_a_good_policy_passes()
  local out, code = stockade("check " .. F .. "gates_good.lua")
  lu.assertEquals(out, F .. "gates_good.lua: 3 tools, OK\n")
  lu.assertEquals(code, 0)
end

function TestCheck.test_the_shipped_default_policy_passes()
  local out, code = stockade("check policies/default.lua")
  lu.assertEquals(out, "policies/default.lua: 10 tools, OK\n")
  lu.assertEquals(code, 0)
end

function TestCheck.test_every_per_tool_rule()
  local file = F .. "gates_bad_tools.lua"
  local out, code = stockade("check " .. file)
  lu.assertEquals(code, 1)
  lu.assertEquals(sorted(lines(out)), sorted {
    tool_line(file, "missing", "path /nonexistent/stockade-gates/tool does not exist"),
    tool_line(file, "a_dir", "path /usr/bin is a directory, not an executable file"),
    tool_line(file, "no_owner", "no owner"),
    tool_line(file, "no_schema", "no schema"),
    tool_line(file, "bad_schema",
              'schema is not valid JSON Schema: (root): unknown type "strnig" (type)'),
    tool_line(file, "bad_output", "output.schema is not valid JSON Schema: (root): must be a "
              .. "non-negative integer (minLength)"),
    tool_line(file, "no_timeout", "no timeout (timeouts.call 30s would apply)"),
    tool_line(file, "short_timeout", "timeouts.grace 2s is not below the tool's timeout 2s"),
    tool_line(file, "env_contra", "env allows GITHUB_TOKEN but the deny glob *_TOKEN refuses it"),
    tool_line(file, "bad_probe", 'probe: expected { argv = { "ARG", ... } } or { args = {...} }'),
    tool_line(file, "refused_probe",
              "probe is refused by the policy: POLICY_VIOLATION: refused by policy: never"),
  })
end

function TestCheck.test_a_tool_lacking_schema_owner_or_timeout_fails()
  local file = F .. "gates_bad_tools.lua"
  local out, code = stockade("check " .. file)
  lu.assertEquals(code, 1)
  lu.assertStrContains(out, tool_line(file, "no_owner", "no owner") .. "\n")
  lu.assertStrContains(out, tool_line(file, "no_schema", "no schema") .. "\n")
  lu.assertStrContains(out, tool_line(file, "no_timeout", "no timeout"))
end

local FIX = "/tmp/stockade-gates-fixture"

function TestCheck.test_binaries_the_tool_uid_could_replace_or_cannot_run()
  lu.skipIf(not IS_ROOT, "needs root (chown of a fixture binary)")
  assert(os.execute(table.concat({
    "rm -rf " .. FIX, "mkdir -p " .. FIX .. "/opendir", "chmod 0755 " .. FIX,
    "printf '#!/bin/sh\\n' > " .. FIX .. "/noexec", "chmod 0644 " .. FIX .. "/noexec",
    "cp " .. FIX .. "/noexec " .. FIX .. "/worldw", "chmod 0777 " .. FIX .. "/worldw",
    "cp " .. FIX .. "/noexec " .. FIX .. "/userowned", "chmod 0755 " .. FIX .. "/userowned",
    "chown 4242 " .. FIX .. "/userowned",
    "cp " .. FIX .. "/noexec " .. FIX .. "/opendir/tool", "chmod 0755 " .. FIX .. "/opendir/tool",
    "chmod 0777 " .. FIX .. "/opendir",
  }, " && ")))
  local file = F .. "gates_bad_paths.lua"
  local out, code = stockade("check " .. file)
  os.execute("rm -rf " .. FIX)
  lu.assertEquals(code, 1)
  lu.assertEquals(sorted(lines(out)), sorted {
    tool_line(file, "noexec", "path " .. FIX .. "/noexec is not executable by the tool's uid "
              .. "(mode 0644)"),
    tool_line(file, "worldw", "path " .. FIX .. "/worldw is writable by others (mode 0777): "
              .. "the tool could replace it"),
    tool_line(file, "userowned", "path " .. FIX .. "/userowned is owned by uid 4242, not root: "
              .. "that user can replace it"),
    tool_line(file, "opendir", "directory " .. FIX .. "/opendir of path " .. FIX
              .. "/opendir/tool is writable by others (mode 0777): the binary can be replaced"),
  })
end

function TestCheck.test_inconsistent_timeouts()
  local file = F .. "gates_bad_timeouts.lua"
  local out, code = stockade("check " .. file)
  lu.assertEquals(code, 1)
  lu.assertEquals(lines(out), {
    policy_line(file, 'call = "10m"', "timeouts.call 10m is above timeouts.call_max 5m"),
    policy_line(file, 'call_max = "5m"', "timeouts.call_max 5m is above timeouts.fuse 4m: one "
                .. "call could outlast the session"),
    policy_line(file, 'fuse = "4m"', "timeouts.fuse 4m is not below timeouts.idle_shutdown 4m"),
    policy_line(file, 'grace = "10m"', "timeouts.grace 10m is not below timeouts.call 10m"),
    tool_line(file, "echo", "timeouts.grace 10m is not below the tool's timeout 3m"),
  })
end

function TestCheck.test_env_contradictions_and_network()
  local file = F .. "gates_bad_env.lua"
  local out, code = stockade("check " .. file)
  lu.assertEquals(code, 1)
  lu.assertEquals(lines(out), {
    policy_line(file, '"GITHUB_TOKEN"', "env.allow GITHUB_TOKEN matches the deny glob *_TOKEN: "
                .. "it is always refused"),
    policy_line(file, '"AWS_REGION"', "env.allow AWS_REGION matches the deny glob AWS_*: it is "
                .. "always refused"),
  })
end

function TestCheck.test_secret_literals_are_reported_by_line()
  local file = F .. "gates_bad_secret.lua"
  local out, code = stockade("check " .. file)
  lu.assertEquals(code, 1)
  local advice = ": keep secrets out of the policy (env or a secret store)"
  lu.assertEquals(lines(out), {
    policy_line(file, "AKIA", "a secret-looking literal (aws-access-key) at column 27" .. advice),
    -- the column is where the secret starts (the password, after "https://deploy:")
    policy_line(file, "hunter2", "a secret-looking literal (url-password) at column 47" .. advice),
  })
  lu.assertNotStrContains(out, "AKIAIOSFODNN7EXAMPLE")      -- never echoed into CI logs
  lu.assertNotStrContains(out, "hunter2")
end

function TestCheck.test_mounts()
  local file = F .. "gates_bad_mounts.lua"
  local out, code = stockade("check " .. file)
  lu.assertEquals(code, 1)
  local sess = "/var/lib/stockade/sessions/other-session/workspace"
  lu.assertEquals(lines(out), {
    policy_line(file, "/nonexistent/stockade-gates-mount",
                "mounts[1]: host path /nonexistent/stockade-gates-mount does not exist"),
    policy_line(file, sess, "mounts[2]: host path " .. sess .. " does not exist"),
    policy_line(file, sess, "mounts[2]: host path " .. sess .. " is inside a session root "
                .. "(/var/lib/stockade/sessions/...)"),
    policy_line(file, '"/usr/include"', "mounts[3]: ro must be a boolean"),
  })
end

function TestCheck.test_a_policy_that_does_not_load()
  local out, code = stockade("check " .. F .. "gates_broken.lua")
  lu.assertEquals(code, 1)
  lu.assertEquals(out, F .. "gates_broken.lua:6: unknown field timeout (did you mean timeouts?)\n")
  out, code = stockade("check /nonexistent/policy.lua")
  lu.assertEquals(code, 1)
  lu.assertStrContains(out, "/nonexistent/policy.lua")
end

function TestCheck.test_several_policies_one_status()
  local out, code = stockade("check " .. F .. "gates_good.lua " .. F .. "gates_bad_env.lua")
  lu.assertEquals(code, 1)
  lu.assertStrContains(out, F .. "gates_good.lua: 3 tools, OK\n")
  lu.assertStrContains(out, "GITHUB_TOKEN")
end

function TestCheck.test_default_policy_from_the_environment()
  local f = assert(io.popen("STOCKADE_POLICY=" .. F .. "gates_good.lua " .. BIN .. " check"))
  local out = f:read("a")
  local _, _, code = f:close()
  lu.assertEquals(out, F .. "gates_good.lua: 3 tools, OK\n")
  lu.assertEquals(code, 0)
end

-- ---- diff ---------------------------------------------------------------------------

TestDiff = {}

local OLD, NEW = F .. "gates_diff_old.lua", F .. "gates_diff_new.lua"

function TestDiff.test_identical_is_no_change()
  local out, code = stockade("diff " .. F .. "gates_good.lua " .. F .. "gates_good.lua --fail-on-widen")
  lu.assertEquals(code, 0)
  lu.assertStrContains(out, "no change\n")
end

function TestDiff.test_widenings_pass_unless_fail_on_widen()
  local _, code = stockade("diff " .. OLD .. " " .. NEW)
  lu.assertEquals(code, 0)
  _, code = stockade("diff " .. OLD .. " " .. NEW .. " --fail-on-widen")
  lu.assertEquals(code, 1)
end

function TestDiff.test_every_kind_of_widening_is_flagged()
  local out = stockade("diff " .. OLD .. " " .. NEW)
  local want = {
    { "+", "tool python3", "new tool" },
    { "!", "tool cat", "longer timeout" },
    { "!", "tool cat", "accept hook changed" },
    { "!", "tool ls", "accept hook removed" },
    { "!", "policy", "timeouts.call" },
    { "!", "policy", "limits.memory" },
    { "!", "policy", "env allow name added" },
    { "!", "policy", "env deny glob removed" },
    { "!", "policy", "mount made writable" },
    { "!", "policy", "new writable mount" },
    { "!", "policy", "network opened" },
    { "!", "policy", "redactor removed: password" },
  }
  for _, w in ipairs(want) do
    local found = false
    for _, l in ipairs(lines(out)) do
      if l:sub(1, 1) == w[1] and l:find(w[2], 1, true) and l:find(w[3], 1, true)
         and (w[1] == "+" or l:find("WIDENS:", 1, true)) then
        found = true
      end
    end
    lu.assertTrue(found, table.concat(w, " ") .. " not flagged in:\n" .. out)
  end
  lu.assertStrContains(out, "-  tool old_only  (removed)")
  lu.assertStrContains(out, "1 added, 1 removed, 11 changed; 12 widenings\n")
  -- the value columns of the human table
  lu.assertStrMatches(out, ".*!  tool cat%s+timeout%s+10s%s+20s%s+WIDENS: longer timeout\n.*")
  lu.assertStrMatches(out, ".*!  policy%s+network%s+none%s+loopback%s+WIDENS: network opened\n.*")
end

function TestDiff.test_json()
  local out, code = stockade("diff " .. OLD .. " " .. NEW .. " --json --fail-on-widen")
  lu.assertEquals(code, 1)
  local d = json_decode(out)
  lu.assertEquals(d.old, OLD)
  lu.assertEquals(d.new, NEW)
  lu.assertEquals(d.status, 1)
  lu.assertEquals(#d.added, 1)
  lu.assertEquals(d.added[1].tool, "python3")
  lu.assertEquals(#d.added[1].missing, 0)
  lu.assertEquals(d.removed, { "old_only" })
  lu.assertEquals(#d.widened, 12)
  local by = {}
  for _, c in ipairs(d.changed) do by[c.scope .. " " .. c.field .. " " .. tostring(c.why)] = c end
  local t = by["tool cat timeout longer timeout"]
  lu.assertEquals({ t.old, t.new, t.widens }, { 10000, 20000, true })
  local m = by["policy mounts new writable mount"]
  lu.assertEquals(m.new, { host = "/srv/out", target = "workspace/out", ro = false })
  local a = by["tool ls accept accept hook removed"]
  lu.assertStrContains(a.old.source, "paths_beneath")
  lu.assertEquals(by["policy limits.memory larger limit"].new, 1024 * 1024 * 1024)
end

function TestDiff.test_an_added_tool_lacking_schema_owner_or_timeout_fails()
  local file = F .. "gates_diff_incomplete.lua"
  local out, code = stockade("diff " .. OLD .. " " .. file)
  lu.assertEquals(code, 1)
  local problems = {}
  for _, l in ipairs(lines(out)) do
    if l:find("added without", 1, true) then problems[#problems + 1] = l end
  end
  lu.assertEquals(sorted(problems), sorted {
    tool_line(file, "wc", "added without a schema"),
    tool_line(file, "head", "added without an owner"),
    tool_line(file, "sort", "added without a timeout"),
  })
  local d = json_decode((stockade("diff " .. OLD .. " " .. file .. " --json")))
  lu.assertEquals(d.status, 1)
  lu.assertEquals(#d.problems, 3)
end

function TestDiff.test_narrowing_only_passes_fail_on_widen()
  local out, code = stockade("diff " .. OLD .. " " .. F .. "gates_diff_narrow.lua --fail-on-widen")
  lu.assertEquals(code, 0)
  lu.assertStrContains(out, "0 added, 1 removed, 9 changed; 0 widenings\n")
  lu.assertNotStrContains(out, "WIDENS")
end

function TestDiff.test_the_network_ladder()
  local none, lo = F .. "gates_diff_net_none.lua", F .. "gates_diff_net_loopback.lua"
  local out, code = stockade("diff " .. none .. " " .. lo .. " --fail-on-widen")
  lu.assertEquals(code, 1)
  lu.assertStrContains(out, "WIDENS: network opened")
  out, code = stockade("diff " .. lo .. " " .. none .. " --fail-on-widen")
  lu.assertEquals(code, 0)
  lu.assertNotStrContains(out, "WIDENS")
end

function TestDiff.test_isolation_weakened()
  local out, code = stockade("diff " .. F .. "gates_diff_net_none.lua " .. F ..
                             "gates_diff_process.lua --fail-on-widen")
  lu.assertEquals(code, 1)
  lu.assertStrContains(out, "WIDENS: isolation weakened")
end

function TestCheck.test_a_malformed_redactor_pattern_is_a_load_error_at_its_line()
  local out, code = stockade("check " .. F .. "bad_redactor.lua")
  lu.assertEquals(code, 1)
  lu.assertEquals(out, F .. "bad_redactor.lua:8: redact[2]: malformed pattern (missing ']')\n")
end

-- A gate never reports a capability the runtime does not have: what it would ignore or
-- do otherwise is a load error, in check and diff alike, with the reason.
TestTruth = {}

function TestTruth.test_unimplemented_and_ignored_fields_are_refused()
  for _, case in ipairs {
    { "gates_diff_net_allow.lua", "not implemented" },
    { "gates_truth_loopback_process.lua", "needs isolation = \"strict\"" },
    { "gates_truth_mounts_process.lua", "would be ignored" },
  } do
    local out, code = stockade("check " .. F .. case[1], true)
    lu.assertEquals(code, 1, case[1])
    lu.assertStrContains(out, case[2])
    out, code = stockade("diff " .. F .. "gates_diff_net_loopback.lua " .. F .. case[1], true)
    lu.assertEquals(code, 1, case[1])
    lu.assertStrContains(out, case[2])
    lu.assertNotStrContains(out, "network opened")
  end
end

function TestDiff.test_bad_input()
  local out, code = stockade("diff " .. OLD .. " " .. F .. "gates_broken.lua")
  lu.assertEquals(code, 1)
  lu.assertStrContains(out, "unknown field timeout")
  local _, usage = stockade("diff " .. OLD)
  lu.assertEquals(usage, 125)    -- a usage error, as in every subcommand
end

-- ---- budget -------------------------------------------------------------------------

TestBudget = {}

function TestBudget.test_table()
  local out, code = stockade("budget " .. F .. "gates_good.lua")
  lu.assertEquals(code, 0)
  lu.assertEquals(lines(out), {
    F .. "gates_good.lua: budget",
    "  TOOL  TIMEOUT  GRACE  CPU  WORST CALL  CALLS IN FUSE",
    "  cat   10s      2s     1m   12s         200",
    "  echo  5s       2s     1m   7s          342",
    "  ls    10s      2s     1m   12s         200",
    "worst call: cat, 12s (timeout 10s + grace 2s)",
    "session: fuse 40m (every call ends when it fires), lease 10m, call_max 5m",
    "fuse 40m < idle_shutdown 60m: margin 20m, OK",
  })
end

function TestBudget.test_json()
  local out, code = stockade("budget " .. F .. "gates_good.lua --json")
  lu.assertEquals(code, 0)
  local d = json_decode(out)
  lu.assertEquals({ d.fuse_ms, d.idle_shutdown_ms, d.margin_ms, d.ok, d.status },
                  { 2400000, 3600000, 1200000, true, 0 })
  lu.assertEquals(#d.tools, 3)
  lu.assertEquals(d.tools[2], { tool = "echo", timeout_ms = 5000, timeout_default = false,
                                grace_ms = 2000, cpu_ms = 60000, worst_call_ms = 7000,
                                calls_in_fuse = 342 })
  lu.assertEquals(d.worst_call, { tool = "cat", ms = 12000 })
end

function TestBudget.test_a_fuse_not_below_idle_shutdown_fails()
  local out, code = stockade("budget " .. F .. "gates_bad_timeouts.lua")
  lu.assertEquals(code, 1)
  lu.assertStrContains(out, "fuse 4m is not below idle_shutdown 4m: FAIL")
  local d = json_decode((stockade("budget " .. F .. "gates_bad_timeouts.lua --json")))
  lu.assertFalse(d.ok)
  lu.assertEquals(d.status, 1)
end

-- ---- dry-run ------------------------------------------------------------------------

TestDryRun = {}

function TestDryRun.test_probes_and_writes_outside()
  local out, code = stockade("dry-run " .. F .. "gates_dryrun.lua")
  os.execute("rm -f /tmp/stockade-dryrun-canary-*")      -- what writes_tmp left, on purpose
  lu.assertEquals(code, 1)
  local status = {}
  for _, l in ipairs(lines(out)) do
    local name, rest = l:match("^([%w_]+): (.*)$")
    if name then status[name] = rest end
  end
  lu.assertEquals(status.echo, "OK")
  lu.assertEquals(status.cat, "OK")
  lu.assertEquals(status.ls, "OK")                       -- a probe given as structured args
  lu.assertEquals(status.writes_inside, "OK")            -- workspace, $TMPDIR, $HOME: its root
  lu.assertEquals(status.unprobed, "not dry-run")
  -- written outside on purpose: reported, or refused by the walls (Landlock) and then a
  -- failed probe with the refusal as evidence; never OK
  local function outside_or_refused(name, pattern)
    local s = status[name]
    if s:find("^WROTE%-OUTSIDE") then
      lu.assertStrMatches(s, pattern)
    else
      lu.assertStrMatches(s, "FAILED TOOL_ERROR: exited with status %d+")
      lu.assertStrContains(out, "Permission denied")
    end
  end
  outside_or_refused("writes_tmp", "WROTE%-OUTSIDE /tmp/stockade%-dryrun%-canary%-%d+ %(new%)")
  outside_or_refused("writes_link", "WROTE%-OUTSIDE /var/tmp/stockade%-dryrun%.[%w]+/canary/"
                     .. "pwned%.txt %(new%)")
  -- a metadata write through the symlink, which Landlock does not refuse
  lu.assertStrMatches(status.touches_link, "WROTE%-OUTSIDE /var/tmp/stockade%-dryrun%.[%w]+/"
                      .. "canary/canary%.txt %(changed%)")
  lu.assertEquals(status.refused, "FAILED POLICY_VIOLATION: refused by policy: this tool is "
                  .. "never allowed")
  lu.assertEquals(status.fails, "FAILED TOOL_ERROR: exited with status 1")
  lu.assertStrContains(out, "9 probed, 4 OK, 5 failed, 1 not dry-run\n")
  -- the temp state dir is gone
  local tmp = out:match("dry%-run in (%S+)")
  lu.assertNotNil(tmp)
  lu.assertNil(io.open(tmp, "r"))
end

function TestDryRun.test_a_policy_without_probes_passes()
  local out, code = stockade("dry-run " .. F .. "gates_good.lua")
  lu.assertEquals(code, 0)
  lu.assertStrContains(out, "cat: not dry-run\n")
  lu.assertStrContains(out, "0 probed, 0 OK, 0 failed, 3 not dry-run\n")
end

-- ---- negative CI tests of the policy engine ------------------------------------------

TestNegative = {}

function TestNegative.test_an_unknown_binary_is_refused()
  local p = testing.load(F .. "gates_good.lua")
  for _, tool in ipairs { "curl", "/usr/bin/curl", "bash", "../bin/cat", "" } do
    local d = p:decide(tool, { "https://example.com" })
    lu.assertEquals(d.class, "POLICY_VIOLATION", tool)
    lu.assertStrContains(d.message, "unknown tool")
  end
  lu.assertEquals(p:decide("echo", { "hi" }).class, "OK")
end

function TestNegative.test_a_symlink_escape_out_of_the_session_fails()
  local p = testing.load(F .. "gates_good.lua")
  local ws = p:root() .. "/workspace"
  assert(os.execute("ln -s /etc " .. q(ws .. "/etc-link") .. " && printf 'x\\n' > "
                    .. q(ws .. "/inside.txt")))
  lu.assertEquals(p:decide("cat", { "inside.txt" }).class, "OK")       -- the control
  for _, argv in ipairs { { "etc-link/passwd" }, { "etc-link" }, { "inside.txt", "etc-link/hosts" },
                          { "../../../../etc/passwd" }, { "/etc/passwd" } } do
    local d = p:decide("cat", argv)
    lu.assertEquals(d.class, "POLICY_VIOLATION", table.concat(argv, " "))
  end
end

function TestNegative.test_a_tool_lacking_schema_owner_or_timeout_fails_check_and_diff()
  local _, code = stockade("check " .. F .. "gates_bad_tools.lua")
  lu.assertEquals(code, 1)
  _, code = stockade("diff " .. OLD .. " " .. F .. "gates_diff_incomplete.lua")
  lu.assertEquals(code, 1)
end

os.exit(lu.LuaUnit.run())
