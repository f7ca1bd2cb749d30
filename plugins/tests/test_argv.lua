-- plugins/argv.lua: command lines parsed as getopt_long and git's parse-options do.
local lu = require "luaunit"
package.path = "./?.lua;" .. package.path
local argv = require "plugins.argv"

local g = argv.grammar({
  { "e", "regexp", "value" }, { "f", "file", "path" }, { "O", "open-files-in-pager", "refuse",
    "runs a program" }, { nil, "color", "optional" }, { nil, "colour", "optional" },
})

local function names(parsed)
  local out = {}
  for _, o in ipairs(parsed.options) do out[#out + 1] = o.name .. "=" .. tostring(o.value) end
  return out
end

function test_combined_short_flags_and_attached_values()
  local p = argv.parse({ "-rn", "-eX", "-f", "list", "a" }, g)
  lu.assertEquals(names(p), { "r=nil", "n=nil", "regexp=X", "file=list" })
  lu.assertEquals(p.operands, { "a" })
  lu.assertEquals(argv.path_values(p), { "list" })
  p = argv.parse({ "-nfx" }, g)
  lu.assertEquals(names(p), { "n=nil", "file=x" })
end

function test_long_options_equals_abbreviations_and_double_dash()
  local p = argv.parse({ "--regexp=a", "--fil", "b", "--", "--regexp", "-e" }, g)
  lu.assertEquals(names(p), { "regexp=a", "file=b" })
  lu.assertEquals(p.operands, { "--regexp", "-e" })
  -- options after operands (GNU permutation), "-" is an operand
  p = argv.parse({ "x", "-e", "y", "-" }, g)
  lu.assertEquals(p.operands, { "x", "-" })
end

function test_refused_options_in_every_spelling()
  for _, a in ipairs { { "-O" }, { "-nO" }, { "-Ocat" }, { "--open-files-in-pager" },
                       { "--open-files-in-pager=sh" }, { "--open=sh" } } do
    local p, why = argv.parse(a, g)
    lu.assertNil(p, table.concat(a, " "))
    lu.assertStrContains(why, "runs a program")
  end
end

function test_ambiguous_abbreviation()
  -- --col is both --color and --colour: neither is refused; taken as a flag
  local p = argv.parse({ "--col", "x" }, g)
  lu.assertEquals(p.operands, { "x" })
end

function test_missing_value()
  local p, why = argv.parse({ "-e" }, g)
  lu.assertNil(p)
  lu.assertStrContains(why, "needs a value")
end

function test_stop_at_operand()
  local py = argv.grammar({ { "c", nil, "value" } },
                          { stop_at_operand = true, stop_after = { c = true } })
  local p = argv.parse({ "-S", "script.py", "-c", "x" }, py)
  lu.assertEquals(p.operands, { "script.py", "-c", "x" })
  p = argv.parse({ "-Sc", "code", "-x" }, py)
  lu.assertEquals(names(p), { "S=nil", "c=code" })
  lu.assertEquals(p.operands, { "-x" })
end

os.exit(lu.LuaUnit.run())
