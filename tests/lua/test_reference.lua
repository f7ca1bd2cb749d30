-- docs/policy-reference.md against the loader's own field names (stockade.fields) and
-- the testing handle's methods: a field added on one side only fails here.
local lu = require "luaunit"
local testing = require "stockade.testing"
local p = testing.load("tests/fixtures/fields.lua")

-- section -> sorted list of the names in the first column of its table
local function documented()
  local out, section = {}, nil
  for line in io.lines("docs/policy-reference.md") do
    local s = line:match("^<!%-%- fields: ([%w_]+) %-%->$")
    if s then
      section = s
      out[s] = {}
    elseif section and line:match("^|") then
      local name = line:match("^| `([%w_]+)` |")
      if name then table.insert(out[section], name) end
    elseif section and line == "" and #out[section] > 0 then
      section = nil
    end
  end
  for _, names in pairs(out) do table.sort(names) end
  return out
end

local SECTIONS = { "policy", "timeouts", "limits", "alarms", "env", "tool", "tool_limits",
                   "output" }

function test_every_field_is_documented_and_nothing_else()
  local doc = documented()
  for _, s in ipairs(SECTIONS) do
    local d = p:decide("fields", { section = s })
    lu.assertEquals(d.class, "OK", s)
    lu.assertEquals(doc[s], d.argv, "docs/policy-reference.md, section " .. s)
  end
end

function test_testing_methods_are_documented()
  local methods = {}
  for k in pairs(getmetatable(p).__index) do methods[#methods + 1] = k end
  table.sort(methods)
  lu.assertEquals(documented().testing, methods)
end

-- contrib/luals/stockade.lua: the LuaLS classes carry the same fields
local CLASSES = { policy = "Policy", timeouts = "Timeouts", limits = "Limits", alarms = "Alarms",
                  env = "Env", tool = "Tool", tool_limits = "ToolLimits", output = "Output" }

function test_editor_annotations_carry_every_field()
  local fields, class = {}, nil
  for line in io.lines("contrib/luals/stockade.lua") do
    local c = line:match("^%-%-%-@class stockade%.(%w+)$")
    if c then
      class = c
      fields[c] = {}
    elseif class and line:match("^%-%-%-@field ") then
      table.insert(fields[class], line:match("^%-%-%-@field ([%w_]+)"))
    else
      class = nil
    end
  end
  for section, c in pairs(CLASSES) do
    table.sort(fields[c] or {})
    lu.assertEquals(fields[c], p:decide("fields", { section = section }).argv,
                    "contrib/luals/stockade.lua, class stockade." .. c)
  end
end

os.exit(lu.LuaUnit.run())
