-- luacheck for policies, plugins and the tests. A policy runs with Lua 5.4's string,
-- table, math and utf8, the safe base functions and print/require (core/policy.c):
-- nothing else is a global there, and assigning one is a load error.
stds.stockade_policy = {
  read_globals = {
    "assert", "error", "ipairs", "next", "pairs", "pcall", "rawequal", "rawget", "rawlen",
    "rawset", "select", "setmetatable", "getmetatable", "tonumber", "tostring", "type",
    "xpcall", "_VERSION", "print", "require",
    string = { fields = { "byte", "char", "find", "format", "gmatch", "gsub", "len", "lower",
                          "match", "pack", "packsize", "rep", "reverse", "sub", "unpack",
                          "upper" } },
    table = { fields = { "concat", "insert", "move", "pack", "remove", "sort", "unpack" } },
    "math", "utf8",
  },
}
max_line_length = 100

files["policies"] = { std = "stockade_policy" }
files["plugins"] = { std = "stockade_policy" }
-- hooks of fixtures often ignore their argument on purpose
files["tests/fixtures"] = { std = "stockade_policy", ignore = { "212" }, max_line_length = false }
-- LuaUnit files run in a full Lua state; test functions are globals by convention
files["policies/tests"] = { std = "lua54", allow_defined_top = true, ignore = { "131" },
  max_line_length = false }
files["plugins/tests"] = { std = "lua54", allow_defined_top = true, ignore = { "131" },
  max_line_length = false }
files["tests/lua"] = { std = "lua54", allow_defined_top = true, ignore = { "131" },
  max_line_length = false }
-- the embedded modules run with the same environment as a policy
files["lua"] = { std = "stockade_policy", max_line_length = 120 }
files["lua/gates.lua"] = { std = "lua54", max_line_length = 120 }
files["contrib/luals"] = { std = "lua54", ignore = { "212", "111", "631" } }
-- the secret set's regexes are long literals
files["plugins/secrets.lua"] = { max_line_length = false }
-- hostile on purpose: globals, patched libraries
files["tests/fixtures/hostile.lua"] = { ignore = { "111", "241" } }
files["tests/fixtures/plugins/evil_helpers.lua"] = { ignore = { "122" } }
