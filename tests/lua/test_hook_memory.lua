-- A hook that keeps the policy state at its memory cap (tests/fixtures/hook_memory.lua):
-- the next hooks meet a full state while the core builds their inputs. Each costs its
-- own call, refused with the cap named in one line; `stockade test` itself goes on.
local lu = require "luaunit"
local testing = require "stockade.testing"

local p = testing.load("tests/fixtures/hook_memory.lua")
local BIG = ("a"):rep(32 * 1024)

function test_a_full_state_refuses_the_next_calls()
  p:decide("keeper", {})         -- fills the state; may pass, having swallowed the refusals
  for _ = 1, 3 do
    local d = p:decide("keeper", { BIG })
    lu.assertEquals(d.class, "POLICY_VIOLATION")
    lu.assertStrContains(d.message, "memory cap")
    lu.assertNotStrContains(d.message, "\n")
  end
  local d = p:decide("guarded", { BIG })
  lu.assertEquals(d.class, "POLICY_VIOLATION")
  lu.assertStrContains(d.message, "memory cap")
  -- a tool without hooks is not the policy state's to refuse
  lu.assertEquals(p:decide("true", {}).class, "OK")
end

os.exit(lu.LuaUnit.run())
