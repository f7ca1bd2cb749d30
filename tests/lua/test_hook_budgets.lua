-- Hook budgets: C functions called by a hook are charged to its budget, and nothing a
-- hook leaves behind runs later outside it. Every hook here is over budget by orders of
-- magnitude: it must cost its own call (refused) and nothing else; the policy keeps
-- working after each.
local lu = require "luaunit"
local testing = require "stockade.testing"

local p = testing.load("tests/fixtures/budgets.lua")
local LONG = ("a"):rep(32 * 1024)

local function refused(tool, arg)
  local d = p:decide(tool, { arg or LONG })
  lu.assertEquals(d.class, "POLICY_VIOLATION", tool .. " was not refused")
  lu.assertStrContains(d.message, "budget", false)
  -- and the next trivial call is decided normally
  lu.assertEquals(p:decide("fine", { "x" }).class, "OK")
end

function test_unanchored_find_is_bounded() refused("regex") end
function test_gmatch_is_bounded() refused("gmatch") end
function test_gsub_is_bounded() refused("gsub") end
function test_match_is_bounded() refused("match") end
function test_plain_find_is_bounded() refused("plain", ("a"):rep(60000)) end
function test_rep_of_nothing_is_bounded() refused("rep") end
function test_table_move_is_bounded() refused("move") end
function test_pcall_cannot_swallow_the_abort() refused("swallow") end

function test_finalizers_are_refused()
  local d = p:decide("gc", { "x" })
  lu.assertEquals(d.class, "POLICY_VIOLATION")
end

function test_finalizer_at_load_is_a_load_error()
  local f = os.tmpname()
  local h = io.open(f, "w")
  h:write([[local stockade = require "stockade"
setmetatable({}, { __gc = function() while true do end end })
return stockade.policy { name = "x" }
]])
  h:close()
  local ok, err = pcall(testing.load, f)
  os.remove(f)
  lu.assertFalse(ok)
  lu.assertStrContains(err, "__gc")
end

-- The budgeted matcher is Lua's: the same results as the stock library on the cases
-- below (captures, anchors, frontier, balance, back-references, init, plain, errors).
local CASES = {
  { "find", "hello world", "o w" }, { "find", "hello world", "l+" },
  { "find", "hello", "l", 4 }, { "find", "hello", "l", -2 }, { "find", "hello", "xyz" },
  { "find", "a.b", ".", 1, true }, { "find", "hello", "", 10 }, { "find", "hello", "", 6 },
  { "find", "key = value", "(%w+)%s*=%s*(%w+)" }, { "find", "abc", "^b" },
  { "find", "abc", "()b()" }, { "find", "THE (quick) fox", "%((%a+)%)" },
  { "find", "f(a(b)c)d", "%b()" }, { "find", "THE quick", "%f[%a]%a+", 4 },
  { "find", "abcabc", "(abc)%1" }, { "find", "x", "[%a-]" }, { "find", "a-b", "[a%-]+" },
  { "find", "]]x", "[]]+" }, { "find", "^x", "[%^x]+" }, { "find", "a\0b", "%z" },
  { "find", "aaa", "a-b" }, { "find", "aaab", "a-b" }, { "find", "ab", "a?b" },
  { "find", "end", "d$" }, { "find", "e$nd", "$n" }, { "find", "x", "[" },
  { "find", "x", "%" }, { "find", "x", "(" }, { "find", "x", "x)" }, { "find", "x", "%1" },
  { "find", "x", "%f" }, { "find", "x", "%b" }, { "find", "a.b", "%." },
  { "find", "ACME[", "ACME[%-TKN" }, { "find", "12ab", "%d+%a+$" },
  { "find", "tab\there", "%s" }, { "find", "UPPER lower", "%u+" }, { "find", "x1", "%W" },
  { "find", "héllo", "[\128-\255]+" }, { "find", "hello", "l", 0 }, { "find", "hello", "l", -100 },
  { "match", "key=val", "(%w+)=(%w+)" }, { "match", "  trim  ", "^%s*(.-)%s*$" },
  { "match", "2024-01-02", "(%d+)-(%d+)-(%d+)" }, { "match", "abc", "()" },
  { "match", "abc", ".-b" }, { "match", "abc", "b", 3 }, { "match", "aXb", "%u" },
  { "gmatch", "one two  three", "%a+" }, { "gmatch", "k=v, a=b", "(%w+)=(%w+)" },
  { "gmatch", "abc", "" }, { "gmatch", "abc", "a*" }, { "gmatch", "abcabc", "b", 3 },
  { "gmatch", "^a^a", "^a" }, { "gmatch", "xyz", "()" },
  { "gsub", "hello world", "o", "0" }, { "gsub", "hello world", "(%w+)", "<%1>" },
  { "gsub", "hello", "", "-" }, { "gsub", "abc", "%w", "%0%0" }, { "gsub", "abc", "b", "%%" },
  { "gsub", "abc", "^a", "X" }, { "gsub", "aaa", "a", "b", 2 }, { "gsub", "abc", "b", "%2" },
  { "gsub", "abc", "(b)", "%9" }, { "gsub", "abc", "b", "%x" },
  { "gsub", "a b c", "%a", nil, nil, "function" }, { "gsub", "a b c", "%a", nil, nil, "table" },
  { "gsub", "x = 1, y = 2", "(%w+)%s*=%s*(%w+)", "%2=%1" }, { "gsub", "abc", "()", "%1" },
}

local function stock(fn, s, pat, x, y, kind)
  local function pack(...)
    local out = { tostring(select("#", ...)) }
    for i = 1, select("#", ...) do out[#out + 1] = tostring((select(i, ...))) end
    return out
  end
  if fn == "gmatch" then
    local out = {}
    for a, b in string.gmatch(s, pat, x) do out[#out + 1] = tostring(a) .. "|" .. tostring(b) end
    return pack(table.concat(out, ","))
  elseif fn == "gsub" then
    local repl = x
    if kind == "function" then repl = function(v) return "<" .. v .. ">" end end
    if kind == "table" then repl = { a = "A", b = false } end
    return pack(pcall(string.gsub, s, pat, repl, y))
  end
  return pack(pcall(string[fn], s, pat, x, y))
end

-- error messages differ in their location prefix only ("input:1:" vs none)
local function normalize(list)
  local out = {}
  for i, v in ipairs(list) do out[i] = v:gsub("^[^:]*:%d+: ", "") end
  return out
end

function test_matcher_agrees_with_lua()
  for i, c in ipairs(CASES) do
    local fn, s, pat, x, y, kind = table.unpack(c, 1, 6)
    local args = { fn = fn, s = s, p = pat, init = x, plain = y }
    if fn == "gsub" then args = { fn = fn, s = s, p = pat, repl = x, max = y, repl_kind = kind } end
    local d = p:decide("eval", args)
    lu.assertEquals(d.class, "OK", "case " .. i .. ": " .. tostring(d.message))
    lu.assertEquals(normalize(d.argv), normalize(stock(fn, s, pat, x, y, kind)),
                    "case " .. i .. ": " .. fn .. "(" .. s .. ", " .. pat .. ")")
  end
end

os.exit(lu.LuaUnit.run())
