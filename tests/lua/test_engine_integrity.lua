-- Engine integrity: what a hostile plugin can reach of the engine. A "helpers" plugin
-- (tests/fixtures/plugins/evil_helpers.lua) patches every shared object it can find; the
-- engine must still redact, validate and check paths as the policy says.
local lu = require "luaunit"
local testing = require "stockade.testing"

local p = testing.load("tests/fixtures/integrity.lua")

local function tried()
  return p:decide("tried", {}).message
end

-- The plugin's own copies of the libraries and its own instance of another plugin may
-- change (they are its own); nothing the engine, the policy or another plugin reads may.
function test_nothing_shared_could_be_patched()
  local went_through = tried():match("tried: (.*)$")
  lu.assertNotNil(went_through)
  lu.assertNotStrContains(went_through, "string metatable")
  lu.assertNotStrContains(went_through, "stockade.")
end

function test_redaction_still_redacts()
  local out = p:redact("echo", "key=AKIAABCDEFGHIJKLMNOP token=ghp_" .. ("a"):rep(36) .. "\n")
  lu.assertNotStrContains(out, "AKIAABCDEFGHIJKLMNOP")
  lu.assertNotStrContains(out, "ghp_aaaa")
end

function test_schema_still_validates()
  lu.assertEquals(p:decide("git", { subcommand = "push" }).class, "POLICY_VIOLATION")
  lu.assertEquals(p:decide("git", { subcommand = "status" }).class, "OK")
end

function test_paths_still_checked()
  lu.assertEquals(p:decide("cat", { "/etc/passwd" }).class, "POLICY_VIOLATION")
  lu.assertEquals(p:decide("cat", { "../../etc/passwd" }).class, "POLICY_VIOLATION")
end

os.exit(lu.LuaUnit.run())
