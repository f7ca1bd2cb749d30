-- What the LuaUnit files of plugins/tests and policies/tests share (required from the
-- repository's root, where `make check-lua` runs them, as "tests.lua.refusals").
local lu = require "luaunit"

local M = {}

-- Each case {tool, argv, fragment} is refused (POLICY_VIOLATION) with a reason that holds
-- fragment; a failure names the invocation.
function M.assert_all_refused(p, cases)
  for _, case in ipairs(cases) do
    local tool, argv, fragment = case[1], case[2], case[3]
    local d = p:decide(tool, argv)
    local what = tool .. " " .. table.concat(argv, " ")
    lu.assertEquals(d.class, "POLICY_VIOLATION", what .. " was accepted")
    lu.assertStrContains(d.message, fragment, false, what)
  end
end

return M
