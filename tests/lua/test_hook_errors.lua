-- Hook runtime errors are visible: a test tells "no opinion" from "crashed", and sees
-- what the hook raised; `stockade check` runs every hook once on a neutral input.
local lu = require "luaunit"
local testing = require "stockade.testing"
local p = testing.load("tests/fixtures/hook_errors.lua")

local R = { exit_code = 1, stdout_tail = "", stderr_tail = "", duration_ms = 1 }

function test_classify_no_opinion_is_plain_nil()
  lu.assertEquals(select("#", p:classify("noopinion", R)), 1)
  lu.assertNil(p:classify("noopinion", R))
end

function test_classify_wrong_type_is_an_error()
  local class, err = p:classify("wrongclass", R)
  lu.assertNil(class)
  lu.assertStrContains(err, "unknown class")
end

function test_classify_crash_is_an_error_with_its_location()
  local class, err = p:classify("crash", R)
  lu.assertNil(class)
  lu.assertStrContains(err, "hook_errors.lua:16:")
end

function test_classify_that_decides()
  lu.assertEquals({ p:classify("fine", R) }, { "TOOL_ERROR", false, "said so" })
end

function test_accept_crash_is_refused_and_says_why()
  local d = p:decide("acceptcrash", {})
  lu.assertEquals(d.class, "POLICY_VIOLATION")
  lu.assertStrContains(d.error, "hook_errors.lua:17:")
end

function test_redact_failure_withholds_and_says_why()
  local out, _, err = p:redact("redactbad", "some output\n")
  lu.assertStrContains(out, "withheld")
  lu.assertStrContains(err, "must return a string")
end

function test_check_runs_every_hook_once()
  local f = io.popen((os.getenv("STOCKADE_BIN") or "./stockade")
                     .. " check tests/fixtures/hook_errors.lua 2>/dev/null")
  local out = f:read("a")
  f:close()
  lu.assertStrContains(out, "tests/fixtures/hook_errors.lua:14: tool wrongclass: hook classify: "
                       .. "classify returned an unknown class 42")
  lu.assertStrContains(out, "tests/fixtures/hook_errors.lua:16: tool crash: hook classify:")
  lu.assertStrContains(out, "tests/fixtures/hook_errors.lua:17: tool acceptcrash: hook accept:")
  lu.assertStrContains(out, "tests/fixtures/hook_errors.lua:18: tool redactbad: hook redact:")
  lu.assertNotStrContains(out, "tool fine: hook")
  lu.assertNotStrContains(out, "tool noopinion: hook")
end

os.exit(lu.LuaUnit.run())
