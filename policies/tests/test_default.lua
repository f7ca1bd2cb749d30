-- The shipped default policy: deny by default, a small registry.
local lu = require "luaunit"
local testing = require "stockade.testing"
local p = testing.load("policies/default.lua")

function test_registry_is_the_documented_one()
  lu.assertEquals(p:tools(), { "cat", "echo", "false", "grep", "head", "ls", "sh", "sleep",
                               "true", "wc" })
end

function test_unknown_tools_are_refused()
  for _, tool in ipairs({ "curl", "rm", "bash", "python3", "ssh", "" }) do
    local d = p:decide(tool, {})
    lu.assertEquals(d.class, "POLICY_VIOLATION", tool)
    lu.assertStrContains(d.message, "unknown tool")
  end
end

function test_listed_tools_run()
  lu.assertEquals(p:decide("echo", { "hi" }).class, "OK")
  lu.assertEquals(p:decide("sh", { "-c", "true" }).class, "OK")
end

function test_read_tools_are_idempotent_and_the_shell_is_not()
  lu.assertTrue(p:decide("cat", { "f" }).idempotent)
  lu.assertTrue(p:decide("sleep", { "1" }).idempotent)
  lu.assertFalse(p:decide("sh", { "-c", "true" }).idempotent)
end

function test_depth_is_enforced()
  lu.assertEquals(p:decide("echo", {}, { depth = 0 }).class, "POLICY_VIOLATION")
  lu.assertEquals(p:decide("echo", {}, { depth = 1 }).class, "OK")
end

function test_argv_limits()
  local many = {}
  for i = 1, 65 do many[i] = "x" end
  local lua_many = p:decide("echo", many)
  lu.assertEquals(lua_many.class, "POLICY_VIOLATION")
  lu.assertStrContains(lua_many.message, "argv too large")
end

function test_env_deny_beats_allow()
  lu.assertEquals(p:decide("echo", {}, { env = { TZ = "UTC" } }).class, "OK")
  local d = p:decide("echo", {}, { env = { GITHUB_TOKEN = "x" } })
  lu.assertEquals(d.class, "POLICY_VIOLATION")
  lu.assertStrContains(d.message, "deny")
  lu.assertEquals(p:decide("echo", {}, { env = { HOME = "/root" } }).class, "POLICY_VIOLATION")
  lu.assertEquals(p:decide("echo", {}, { env = { LD_PRELOAD = "/x.so" } }).class,
                  "POLICY_VIOLATION")
  lu.assertEquals(p:decide("echo", {}, { env = { EDITOR = "vi" } }).class, "POLICY_VIOLATION")
end

os.exit(lu.LuaUnit.run())
