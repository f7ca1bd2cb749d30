-- schema.lua: a JSON Schema validator in pure Lua 5.4 (no require; base, string, table,
-- math and utf8 only), for tool argument and output schemas of stockade policies.
--
-- API
--   M.validate(schema, value)  -> true | false, message
--       message is one line: "<instance pointer>: <what is wrong> (<keyword>)", e.g.
--       "/items/2/name: expected string, got number (type)". The pointer is an RFC 6901
--       JSON pointer (array indices 0-based, "~" and "/" in names as "~0" and "~1"); the
--       document itself is written "(root)". A schema that is malformed where validation
--       reaches it (unknown type name, bad pattern, unresolvable $ref, nesting over
--       M.max_depth) makes validate fail too ("schema error: ..."): fail closed.
--   M.check_schema(schema)     -> true | false, message
--       is the schema well formed for the supported keywords? message names the schema
--       pointer and the keyword, e.g. "/properties/a/type: unknown type \"strnig\" (type)".
--       Keywords that would change validation but are not implemented ($anchor,
--       $dynamicRef, unevaluated*, $id below the root, ...) are refused rather than
--       silently ignored. Other unknown keywords are annotations and are accepted.
--   M.null       the value that stands for JSON null (default: a unique table; the host
--                sets it to cjson.null). Compared with rawequal, whatever its type.
--   M.array_mt   the metatable that marks a JSON array (default: a unique table; the host
--                sets it to cjson.array_mt with cjson.decode_array_with_array_mt(true)).
--   M.max_depth  nesting bound of subschema applications (default 64): a self-referential
--                schema ({"$ref": "#"}) fails with a message instead of looping.
--   M.regex_step_limit  backtracking budget of one pattern match (default 200000).
--   M.match_pattern(pattern, str) -> true | false, or nil, error: the ECMA-subset regex
--                search used by "pattern" / "patternProperties" (unanchored, like JSON
--                Schema); M.check_pattern(pattern) -> true | false, error.
--
-- Lua values as JSON
--   nil is "absent" (a property whose value is nil does not exist); M.null is null;
--   booleans; numbers (integer = a Lua integer or a float without fractional part; 1 and
--   1.0 are equal); strings (lengths count UTF-8 code points; invalid UTF-8 fails
--   minLength/maxLength/pattern); a table whose metatable is M.array_mt is an array (even
--   empty); another table is an array if it is a non-empty sequence with keys 1..n only,
--   otherwise an object. An EMPTY table without M.array_mt is ambiguous (lua-cjson has no
--   object metatable, so "{}" decodes to it): it counts as both an empty object and an
--   empty array: it satisfies type "object" and type "array", the object keywords and the
--   array keywords both apply to it (fail closed: {} fails {"minItems": 1} and
--   {"required": ["a"]} alike, and {"contains": ...}), and in enum, const and uniqueItems
--   it equals both {} and [].
--
-- Supported keywords (draft 2020-12 semantics; draft 7 where 2020-12 has no opinion):
--   type (string or array; "integer"), enum, const (deep equality), $ref ("#", "#/json/
--   pointer" with ~0 ~1 and %XX unescaping, so "#/$defs/x" and "#/definitions/x"; like
--   2020-12, sibling keywords of $ref apply too), $defs / definitions (containers),
--   properties, patternProperties, additionalProperties, required, propertyNames,
--   minProperties, maxProperties, dependentRequired, dependentSchemas, dependencies
--   (draft 7), items (schema; or the draft-7 array form with additionalItems), prefixItems,
--   contains / minContains / maxContains, minItems, maxItems, uniqueItems, minLength,
--   maxLength, pattern, minimum, maximum, exclusiveMinimum, exclusiveMaximum (numbers),
--   multipleOf, allOf, anyOf, oneOf, not, if / then / else, boolean schemas.
--   "format" is an annotation (not checked), as 2020-12 specifies by default.
--
-- Patterns (ECMA 262 subset, matched on code points by a backtracking matcher):
--   literals, ".", ^ $ (input start/end), \b \B, classes [...] [^...] with ranges and the
--   escapes \d \w \s \D \W \S, escaped metacharacters, \t \n \r \f \v \0 \xHH \uHHHH \cX,
--   groups (...) (?:...) (?<name>...), alternation |, quantifiers * + ? {n} {n,} {n,m}
--   and their lazy forms. Refused: lookahead/lookbehind, backreferences (\1, \k<..>),
--   \p{..} / \P{..}, \u{..}, unknown letter escapes. Compiled patterns are cached in a
--   weak table keyed by the pattern string.
--
-- Schemas must not be mutated after their first use: resolved $ref targets are cached
-- per root schema (weakly).

local M = {}

local type, pairs, ipairs, next, rawequal, getmetatable, setmetatable =
      type, pairs, ipairs, next, rawequal, getmetatable, setmetatable
local tostring, tonumber, error, pcall, select = tostring, tonumber, error, pcall, select
local sformat, sbyte, ssub, sfind, sgsub, schar =
      string.format, string.byte, string.sub, string.find, string.gsub, string.char
local concat, sort = table.concat, table.sort
local mtype, floor, huge, mabs, mmax = math.type, math.floor, math.huge, math.abs, math.max
local ulen, ucodes, uchar = utf8.len, utf8.codes, utf8.char

M.null = setmetatable({}, { __name = "json.null", __tostring = function() return "null" end })
M.array_mt = { __name = "json.array" }
M.max_depth = 64
M.regex_step_limit = 200000

------------------------------------------------------------------------------------------
-- JSON view of Lua values
------------------------------------------------------------------------------------------

-- "null" "boolean" "number" "string" "array" "object" "empty" (empty table without
-- array_mt: both an object and an array), or nil for what JSON cannot represent.
local function kind(v)
  if rawequal(v, M.null) then return "null" end
  local t = type(v)
  if t == "table" then
    local amt = M.array_mt
    if amt ~= nil and getmetatable(v) == amt then return "array" end
    local n, max = 0, 0
    for key in next, v do
      if mtype(key) ~= "integer" or key < 1 then return "object" end
      n = n + 1
      if key > max then max = key end
    end
    if n == 0 then return "empty" end
    if max == n then return "array" end
    return "object"
  elseif t == "string" or t == "number" or t == "boolean" then
    return t
  end
  return nil
end

local function is_integer(x)
  if mtype(x) == "integer" then return true end
  return x == x and x ~= huge and x ~= -huge and x == floor(x)
end

local function kind_name(k, v)
  if k == "empty" then return "empty object/array" end
  if k == nil then return "Lua " .. type(v) end
  return k
end

local function fmtnum(x)
  if mtype(x) == "integer" then return tostring(x) end
  if x == floor(x) and mabs(x) < 1e15 then return sformat("%d", x) end
  return sformat("%.14g", x)
end

local function quote(s)
  return '"' .. sgsub(s, '[%c"\\]', function(c)
    if c == '"' then return '\\"' elseif c == "\\" then return "\\\\" end
    return sformat("\\u%04x", sbyte(c))
  end) .. '"'
end

-- short one-line rendering of a value for messages
local function repr(v, budget)
  budget = budget or 60
  local k = kind(v)
  if k == "string" then
    if #v > budget then return quote(ssub(v, 1, budget)) .. "..." end
    return quote(v)
  elseif k == "number" then return fmtnum(v)
  elseif k == "boolean" then return tostring(v)
  elseif k == "null" then return "null"
  elseif k == "array" then return (#v == 0) and "[]" or "[...]"
  elseif k == "object" then return "{...}"
  elseif k == "empty" then return "{}"
  end
  return "<" .. type(v) .. ">"
end

local function escape_token(s)
  s = sgsub(s, "~", "~0")
  return (sgsub(s, "/", "~1"))
end

-- deep equality with JSON semantics (1 == 1.0; the empty table equals [] and {})
local function deep_equal(a, b, depth)
  if rawequal(a, b) then return true end
  if depth > 200 then error("deep_equal: nesting too deep", 0) end
  local ka, kb = kind(a), kind(b)
  if ka == "number" and kb == "number" then return a == b end
  if ka ~= kb or ka == "empty" then
    if ka == "empty" then
      if kb == "empty" then return true end
      if kb == "array" then return #b == 0 end
      return kb == "object" and next(b) == nil
    elseif kb == "empty" then
      if ka == "array" then return #a == 0 end
      return ka == "object" and next(a) == nil
    end
    return false
  end
  if ka == "array" then
    local n = #a
    if #b ~= n then return false end
    for i = 1, n do
      if not deep_equal(a[i], b[i], depth + 1) then return false end
    end
    return true
  elseif ka == "object" then
    local na = 0
    for key, va in next, a do
      local vb = b[key]
      if vb == nil or not deep_equal(va, vb, depth + 1) then return false end
      na = na + 1
    end
    for _ in next, b do na = na - 1 end
    return na == 0
  end
  return false -- different strings / booleans (rawequal failed)
end

------------------------------------------------------------------------------------------
-- Patterns: an ECMA-262 subset, parsed to a tree and compiled to continuation-passing
-- matchers over arrays of code points.
------------------------------------------------------------------------------------------

local FATAL = {} -- metatable of errors that end a validation (schema errors, budgets)

local function is_digit(c) return c >= 48 and c <= 57 end
local function is_word(c)
  return (c >= 97 and c <= 122) or (c >= 65 and c <= 90) or (c >= 48 and c <= 57) or c == 95
end
local SPACE = { [9] = true, [10] = true, [11] = true, [12] = true, [13] = true, [32] = true,
  [0xA0] = true, [0x1680] = true, [0x2028] = true, [0x2029] = true, [0x202F] = true,
  [0x205F] = true, [0x3000] = true, [0xFEFF] = true }
local function is_space(c) return SPACE[c] == true or (c >= 0x2000 and c <= 0x200A) end
local function not_digit(c) return not is_digit(c) end
local function not_word(c) return not is_word(c) end
local function not_space(c) return not is_space(c) end
local function is_dot(c) return c ~= 10 and c ~= 13 and c ~= 0x2028 and c ~= 0x2029 end

local CLASS_ESC = { [100] = is_digit, [68] = not_digit, [119] = is_word, [87] = not_word,
  [115] = is_space, [83] = not_space } -- d D w W s S
local CONTROL_ESC = { [116] = 9, [110] = 10, [114] = 13, [102] = 12, [118] = 11 } -- t n r f v

local function hexval(c)
  if c == nil then return nil end
  if c >= 48 and c <= 57 then return c - 48 end
  if c >= 97 and c <= 102 then return c - 87 end
  if c >= 65 and c <= 70 then return c - 55 end
  return nil
end

local function parse_regex(src)
  if ulen(src) == nil then return nil, "pattern is not valid UTF-8" end
  local cps, n = {}, 0
  for _, c in ucodes(src) do n = n + 1; cps[n] = c end
  local pos = 1

  local function perr(msg, ...)
    error(setmetatable({ msg = sformat("pattern %s: " .. msg .. " at offset %d",
      quote(src), select(1, ...), pos - 1) }, FATAL), 0)
  end

  local function read_hex(count)
    local v = 0
    for i = 0, count - 1 do
      local h = hexval(cps[pos + i])
      if h == nil then return nil end
      v = v * 16 + h
    end
    pos = pos + count
    return v
  end

  -- an escape after "\" (pos at the escaped char); returns "char", cp | "set", test |
  -- "assert", node
  local function parse_escape(in_class)
    local c = cps[pos]
    if c == nil then perr("%s", "trailing backslash") end
    pos = pos + 1
    local cls = CLASS_ESC[c]
    if cls then return "set", cls end
    local ctl = CONTROL_ESC[c]
    if ctl then return "char", ctl end
    if c == 98 then -- b
      if in_class then return "char", 8 end
      return "assert", { t = "wordb", neg = false }
    elseif c == 66 then -- B
      if in_class then perr("%s", "\\B inside a character class") end
      return "assert", { t = "wordb", neg = true }
    elseif c == 48 then -- 0
      if cps[pos] and is_digit(cps[pos]) then perr("%s", "octal escapes are not supported") end
      return "char", 0
    elseif c >= 49 and c <= 57 then
      perr("%s", "backreferences (\\1..\\9) are not supported")
    elseif c == 120 then -- x
      local v = read_hex(2)
      if v == nil then perr("%s", "malformed \\x escape (\\xHH)") end
      return "char", v
    elseif c == 117 then -- u
      if cps[pos] == 123 then perr("%s", "\\u{...} escapes (unicode mode) are not supported") end
      local v = read_hex(4)
      if v == nil then perr("%s", "malformed \\u escape (\\uHHHH)") end
      if v >= 0xD800 and v <= 0xDBFF and cps[pos] == 92 and cps[pos + 1] == 117 then
        local save = pos
        pos = pos + 2
        local lo = read_hex(4)
        if lo and lo >= 0xDC00 and lo <= 0xDFFF then
          return "char", 0x10000 + (v - 0xD800) * 0x400 + (lo - 0xDC00)
        end
        pos = save
      end
      return "char", v
    elseif c == 99 then -- c
      local l = cps[pos]
      if l and ((l >= 65 and l <= 90) or (l >= 97 and l <= 122)) then
        pos = pos + 1
        return "char", l % 32
      end
      perr("%s", "malformed \\c escape (\\cA..\\cZ)")
    elseif c == 112 or c == 80 then
      perr("%s", "unicode property escapes (\\p{...}, \\P{...}) are not supported")
    elseif c == 107 then
      perr("%s", "named backreferences (\\k<name>) are not supported")
    elseif (c >= 65 and c <= 90) or (c >= 97 and c <= 122) or is_digit(c) then
      perr("unknown escape \\%s", uchar(c))
    end
    return "char", c -- identity escape of a non-alphanumeric character
  end

  local function parse_class()
    -- pos is after "["
    local negate = false
    if cps[pos] == 94 then negate = true; pos = pos + 1 end
    local ranges, tests = {}, {}
    local function atom()
      local c = cps[pos]
      if c == nil then perr("%s", "unterminated character class") end
      if c == 92 then
        pos = pos + 1
        local what, val = parse_escape(true)
        return what, val
      end
      pos = pos + 1
      return "char", c
    end
    while true do
      local c = cps[pos]
      if c == nil then perr("%s", "unterminated character class") end
      if c == 93 then pos = pos + 1; break end
      local w1, v1 = atom()
      if cps[pos] == 45 and cps[pos + 1] ~= nil and cps[pos + 1] ~= 93 then
        pos = pos + 1
        local w2, v2 = atom()
        if w1 ~= "char" or w2 ~= "char" then
          perr("%s", "a class escape (\\d, \\w, \\s...) cannot bound a range")
        end
        if v1 > v2 then perr("%s", "range out of order in character class") end
        ranges[#ranges + 1] = { v1, v2 }
      elseif w1 == "char" then
        ranges[#ranges + 1] = { v1, v1 }
      else
        tests[#tests + 1] = v1
      end
    end
    local nr, nt = #ranges, #tests
    local function test(cp)
      for i = 1, nr do
        local r = ranges[i]
        if cp >= r[1] and cp <= r[2] then return not negate end
      end
      for i = 1, nt do
        if tests[i](cp) then return not negate end
      end
      return negate
    end
    return { t = "set", test = test }
  end

  -- {n}, {n,}, {n,m} at pos (pos at "{"); returns min, max(nil = inf) and advances, or nil
  local function try_braces()
    local p = pos + 1
    local function num()
      local v, start = 0, p
      while cps[p] and is_digit(cps[p]) do v = v * 10 + (cps[p] - 48); p = p + 1 end
      if p == start then return nil end
      return v
    end
    local lo = num()
    if lo == nil then return nil end
    local hi = lo
    if cps[p] == 44 then
      p = p + 1
      if cps[p] == 125 then hi = nil else
        hi = num()
        if hi == nil then return nil end
      end
    end
    if cps[p] ~= 125 then return nil end
    pos = p + 1
    return lo, hi, true
  end

  local parse_alt

  local function parse_atom()
    local c = cps[pos]
    if c == 94 then pos = pos + 1; return { t = "bol" } end
    if c == 36 then pos = pos + 1; return { t = "eol" } end
    if c == 46 then pos = pos + 1; return { t = "set", test = is_dot } end
    if c == 91 then pos = pos + 1; return parse_class() end
    if c == 40 then
      pos = pos + 1
      if cps[pos] == 63 then -- (?
        local d = cps[pos + 1]
        if d == 58 then pos = pos + 2 -- (?:
        elseif d == 61 or d == 33 then perr("%s", "lookahead assertions (?= (?! are not supported")
        elseif d == 60 and (cps[pos + 2] == 61 or cps[pos + 2] == 33) then
          perr("%s", "lookbehind assertions (?<= (?<! are not supported")
        elseif d == 60 then -- (?<name>
          local p = pos + 2
          while cps[p] and cps[p] ~= 62 do
            local e = cps[p]
            if not (is_word(e) or e == 36 or e > 127) then perr("%s", "malformed group name") end
            p = p + 1
          end
          if cps[p] ~= 62 or p == pos + 2 then perr("%s", "malformed group name") end
          pos = p + 1
        else
          perr("%s", "unsupported group syntax (?")
        end
      end
      local node = parse_alt()
      if cps[pos] ~= 41 then perr("%s", "missing )") end
      pos = pos + 1
      return { t = "group", node = node }
    end
    if c == 42 or c == 43 or c == 63 then perr("%s", "nothing to repeat") end
    if c == 123 then
      local save = pos
      if try_braces() then pos = save; perr("%s", "nothing to repeat") end
      pos = pos + 1
      return { t = "char", cp = c } -- a "{" that is no quantifier is literal (Annex B)
    end
    if c == 92 then
      pos = pos + 1
      local what, val = parse_escape(false)
      if what == "char" then return { t = "char", cp = val } end
      if what == "set" then return { t = "set", test = val } end
      return val
    end
    pos = pos + 1
    return { t = "char", cp = c }
  end

  local function parse_seq()
    local items = {}
    while true do
      local c = cps[pos]
      if c == nil or c == 124 or c == 41 then break end
      local a = parse_atom()
      local q = cps[pos]
      local lo, hi, ok
      if q == 42 then lo, hi, ok = 0, nil, true; pos = pos + 1
      elseif q == 43 then lo, hi, ok = 1, nil, true; pos = pos + 1
      elseif q == 63 then lo, hi, ok = 0, 1, true; pos = pos + 1
      elseif q == 123 then lo, hi, ok = try_braces()
      end
      if ok then
        if a.t == "bol" or a.t == "eol" or a.t == "wordb" then perr("%s", "nothing to repeat") end
        if hi and hi < lo then perr("%s", "numbers out of order in {} quantifier") end
        local lazy = false
        if cps[pos] == 63 then lazy = true; pos = pos + 1 end
        a = { t = "rep", node = a, min = lo, max = hi, lazy = lazy }
      end
      items[#items + 1] = a
    end
    return { t = "seq", items = items }
  end

  function parse_alt()
    local alts = { parse_seq() }
    while cps[pos] == 124 do
      pos = pos + 1
      alts[#alts + 1] = parse_seq()
    end
    if #alts == 1 then return alts[1] end
    return { t = "alt", alts = alts }
  end

  local tree = parse_alt()
  if pos <= n then perr("%s", "unmatched )") end
  return tree
end

local function step_limit()
  error(setmetatable({ msg = "pattern match exceeded the backtracking budget" }, FATAL), 0)
end

local compile_node

local function TERM(s, i, k) return k(s, i) end

local function compile_seq(items, idx, nxt)
  if idx > #items then return nxt end
  return compile_node(items[idx], compile_seq(items, idx + 1, nxt))
end

function compile_node(node, nxt)
  local t = node.t
  if t == "char" then
    local cp = node.cp
    return function(s, i, k)
      if s[i] == cp then return nxt(s, i + 1, k) end
      return false
    end
  elseif t == "set" then
    local test = node.test
    return function(s, i, k)
      local c = s[i]
      if c ~= nil and test(c) then return nxt(s, i + 1, k) end
      return false
    end
  elseif t == "bol" then
    return function(s, i, k)
      if i == 1 then return nxt(s, i, k) end
      return false
    end
  elseif t == "eol" then
    return function(s, i, k)
      if i == s.n + 1 then return nxt(s, i, k) end
      return false
    end
  elseif t == "wordb" then
    local neg = node.neg
    return function(s, i, k)
      local a = i > 1 and is_word(s[i - 1])
      local b = s[i] ~= nil and is_word(s[i])
      if (a ~= b) ~= neg then return nxt(s, i, k) end
      return false
    end
  elseif t == "seq" then
    return compile_seq(node.items, 1, nxt)
  elseif t == "group" then
    return compile_node(node.node, nxt)
  elseif t == "alt" then
    local ms = {}
    for i, a in ipairs(node.alts) do ms[i] = compile_node(a, nxt) end
    local nm = #ms
    return function(s, i, k)
      for j = 1, nm do
        if ms[j](s, i, k) then return true end
      end
      return false
    end
  elseif t == "rep" then
    local min, max, lazy, a = node.min, node.max, node.lazy, node.node
    if a.t == "char" or a.t == "set" then
      local cp, test = a.cp, a.test
      local lim = max or huge
      return function(s, i, k)
        local j, cnt = i, 0
        if cp then
          while cnt < lim and s[j] == cp do j = j + 1; cnt = cnt + 1 end
        else
          while cnt < lim do
            local c = s[j]
            if c == nil or not test(c) then break end
            j = j + 1; cnt = cnt + 1
          end
        end
        if cnt < min then return false end
        local steps = s.steps + (cnt - min) + 1
        s.steps = steps
        if steps > s.limit then step_limit() end
        if lazy then
          for c = min, cnt do
            if nxt(s, i + c, k) then return true end
          end
        else
          for c = cnt, min, -1 do
            if nxt(s, i + c, k) then return true end
          end
        end
        return false
      end
    end
    local body = compile_node(a, TERM)
    return function(s, i, k)
      local step
      function step(j, count)
        local steps = s.steps + 1
        s.steps = steps
        if steps > s.limit then step_limit() end
        local more = max == nil or count < max
        local function again(_, e)
          if e == j and count >= min then return false end -- empty iteration: stop
          return step(e, count + 1)
        end
        if lazy then
          if count >= min and nxt(s, j, k) then return true end
          return more and body(s, j, again) or false
        end
        if more and body(s, j, again) then return true end
        if count >= min then return nxt(s, j, k) end
        return false
      end
      return step(i, 0)
    end
  end
  error("regex: unknown node " .. tostring(t))
end

local function KTRUE() return true end

local function anchored(node)
  local t = node.t
  if t == "bol" then return true end
  if t == "seq" then return node.items[1] ~= nil and anchored(node.items[1]) end
  if t == "group" then return anchored(node.node) end
  if t == "alt" then
    for _, a in ipairs(node.alts) do
      if not anchored(a) then return false end
    end
    return true
  end
  return false
end

local regex_cache = setmetatable({}, { __mode = "v" })

-- the compiled pattern ({match = fn, anchored = bool}), or raises a FATAL error
local function get_regex(pattern)
  local re = regex_cache[pattern]
  if re then
    if re.err then error(setmetatable({ msg = re.err }, FATAL), 0) end
    return re
  end
  local ok, tree = pcall(parse_regex, pattern)
  if not ok then
    if getmetatable(tree) ~= FATAL then error(tree, 0) end
    regex_cache[pattern] = { err = tree.msg }
    error(tree, 0)
  end
  re = { match = compile_node(tree, function() return true end), anchored = anchored(tree) }
  regex_cache[pattern] = re
  return re
end

local function run_search(re, s, n)
  local m = re.match
  if re.anchored then return m(s, 1, KTRUE) end
  for i = 1, n + 1 do
    if m(s, i, KTRUE) then return true end
  end
  return false
end

-- unanchored search; true/false, or nil when str is not valid UTF-8. Over budget or too
-- deep a recursion (a repeated group over a very long string) raises a FATAL error.
local function regex_search(re, str)
  if ulen(str) == nil then return nil end
  local s, n = {}, 0
  for _, c in ucodes(str) do n = n + 1; s[n] = c end
  s.n, s.steps, s.limit = n, 0, M.regex_step_limit
  local ok, r = pcall(run_search, re, s, n)
  if ok then return r end
  if getmetatable(r) ~= FATAL and type(r) == "string" and sfind(r, "stack overflow", 1, true) then
    error(setmetatable({ msg = "pattern match recursion too deep for this string" }, FATAL), 0)
  end
  error(r, 0)
end

function M.check_pattern(pattern)
  if type(pattern) ~= "string" then return false, "pattern must be a string" end
  local ok, e = pcall(get_regex, pattern)
  if ok then return true end
  if getmetatable(e) == FATAL then return false, e.msg end
  error(e, 0)
end

function M.match_pattern(pattern, str)
  local ok, res = pcall(function()
    return regex_search(get_regex(pattern), str)
  end)
  if ok then
    if res == nil then return nil, "string is not valid UTF-8" end
    return res
  end
  if getmetatable(res) == FATAL then return nil, res.msg end
  error(res, 0)
end

------------------------------------------------------------------------------------------
-- $ref resolution (same document only)
------------------------------------------------------------------------------------------

-- target, tokens | nil, message
local function resolve_ref(root, ref)
  if type(ref) ~= "string" then return nil, "$ref must be a string" end
  if sbyte(ref, 1) ~= 35 then
    return nil, sformat("unsupported $ref %s: only same-document references ('#' or '#/...') are supported", quote(ref))
  end
  local frag = sgsub(ssub(ref, 2), "%%(%x%x)", function(h) return schar(tonumber(h, 16)) end)
  if frag == "" then return root, {} end
  if sbyte(frag, 1) ~= 47 then
    return nil, sformat("unsupported $ref %s: plain-name fragments ($anchor) are not supported", quote(ref))
  end
  local cur, tokens, p = root, {}, 2
  while true do
    local slash = sfind(frag, "/", p, true)
    local tok = ssub(frag, p, (slash or 0) - 1)
    tok = sgsub(sgsub(tok, "~1", "/"), "~0", "~")
    tokens[#tokens + 1] = tok
    if type(cur) ~= "table" or rawequal(cur, M.null) then
      return nil, sformat("$ref %s does not resolve: %s is not an object or array", quote(ref), quote(tok))
    end
    local nxt = cur[tok]
    if nxt == nil and sfind(tok, "^%d+$") and (tok == "0" or sbyte(tok, 1) ~= 48) then
      nxt = cur[tonumber(tok) + 1]
    end
    if nxt == nil then
      return nil, sformat("$ref %s does not resolve: no %s", quote(ref), quote(tok))
    end
    cur = nxt
    if not slash then break end
    p = slash + 1
  end
  return cur, tokens
end

local ref_cache = setmetatable({}, { __mode = "k" })

------------------------------------------------------------------------------------------
-- validation
------------------------------------------------------------------------------------------

local function pointer(path, n)
  if n == 0 then return "(root)" end
  local parts = {}
  for i = 1, n do
    local tok = path[i]
    if type(tok) == "number" then parts[i] = tostring(tok)
    else parts[i] = escape_token(tok) end
  end
  return "/" .. concat(parts, "/")
end

local function fail(ctx, kw, msg, ...)
  if select("#", ...) > 0 then msg = sformat(msg, ...) end
  return pointer(ctx.path, ctx.n) .. ": " .. msg .. " (" .. kw .. ")"
end

local function fatal(ctx, kw, msg, ...)
  if select("#", ...) > 0 then msg = sformat(msg, ...) end
  error(setmetatable({ msg = pointer(ctx.path, ctx.n) .. ": schema error: " .. msg
    .. " (" .. kw .. ")" }, FATAL), 0)
end

-- a search during validation: FATAL errors (budget, depth) get the pointer and keyword
local function search(ctx, kw, re, str)
  local ok, r = pcall(regex_search, re, str)
  if ok then return r end
  if getmetatable(r) == FATAL then
    error(setmetatable({ msg = pointer(ctx.path, ctx.n) .. ": " .. r.msg .. " (" .. kw .. ")" }, FATAL), 0)
  end
  error(r, 0)
end

local VALID_TYPES = { null = true, boolean = true, object = true, array = true,
  number = true, string = true, integer = true }

local function type_matches(name, k, v)
  if name == "integer" then return k == "number" and is_integer(v) end
  if name == "object" or name == "array" then return k == name or k == "empty" end
  return k == name
end

local function num_kw(ctx, s, kw)
  local x = s[kw]
  if x ~= nil and type(x) ~= "number" then
    if type(x) == "boolean" then
      fatal(ctx, kw, "the draft-4 boolean form is not supported; use a number")
    end
    fatal(ctx, kw, "must be a number")
  end
  return x
end

local function count_kw(ctx, s, kw)
  local x = s[kw]
  if x ~= nil and (type(x) ~= "number" or not is_integer(x) or x < 0) then
    fatal(ctx, kw, "must be a non-negative integer")
  end
  return x
end

local function object_keys(ctx, v)
  local keys, n = {}, 0
  for key in next, v do
    n = n + 1
    if type(key) ~= "string" then
      if mtype(key) == "integer" then keys[n] = key
      else return nil, fail(ctx, "type", "object key of Lua type %s is not representable in JSON", type(key)) end
    else
      keys[n] = key
    end
  end
  if n > 1 then sort(keys, function(a, b) return tostring(a) < tostring(b) end) end
  return keys
end

local function is_multiple(v, m)
  if mtype(v) == "integer" and mtype(m) == "integer" then return v % m == 0 end
  local q = v / m
  if q ~= q or q == huge or q == -huge then return false end
  local r = floor(q + 0.5)
  return mabs(q - r) <= 1e-9 * mmax(1, mabs(q))
end

local vnode

local function sub(ctx, s, v, depth, tok)
  local n = ctx.n + 1
  ctx.n = n
  ctx.path[n] = tok
  local e = vnode(ctx, s, v, depth)
  ctx.n = n - 1
  return e
end

local function validate_object(ctx, s, v, depth)
  local e
  local minp, maxp = count_kw(ctx, s, "minProperties"), count_kw(ctx, s, "maxProperties")
  local req = s.required
  if req ~= nil then
    if type(req) ~= "table" then fatal(ctx, "required", "must be an array of strings") end
    for _, name in ipairs(req) do
      if type(name) ~= "string" then fatal(ctx, "required", "must be an array of strings") end
      if v[name] == nil then return fail(ctx, "required", "missing required property %s", quote(name)) end
    end
  end
  local dreq = s.dependentRequired
  local deps = s.dependencies
  local dsch = s.dependentSchemas
  local props, pprops, addl, pnames = s.properties, s.patternProperties, s.additionalProperties, s.propertyNames
  if props ~= nil and type(props) ~= "table" then fatal(ctx, "properties", "must be an object") end
  if pprops ~= nil and type(pprops) ~= "table" then fatal(ctx, "patternProperties", "must be an object") end
  if not (minp or maxp or dreq or deps or dsch or props or pprops or addl ~= nil or pnames ~= nil) then
    return nil
  end
  local keys, kerr = object_keys(ctx, v)
  if not keys then return kerr end
  local nkeys = #keys
  if minp and nkeys < minp then
    return fail(ctx, "minProperties", "has %d properties, fewer than %s", nkeys, fmtnum(minp))
  end
  if maxp and nkeys > maxp then
    return fail(ctx, "maxProperties", "has %d properties, more than %s", nkeys, fmtnum(maxp))
  end
  for _, key in ipairs(keys) do
    local name = type(key) == "string" and key or tostring(key)
    local pv = v[key]
    if pnames ~= nil then
      e = sub(ctx, pnames, name, depth, name)
      if e then return e end
    end
    local matched = false
    if props ~= nil then
      local ps = props[name]
      if ps ~= nil then
        matched = true
        e = sub(ctx, ps, pv, depth, name)
        if e then return e end
      end
    end
    if pprops ~= nil then
      for pat, ps in pairs(pprops) do
        if type(pat) ~= "string" then fatal(ctx, "patternProperties", "keys must be patterns (strings)") end
        local ok, re = pcall(get_regex, pat)
        if not ok then
          if getmetatable(re) ~= FATAL then error(re, 0) end
          fatal(ctx, "patternProperties", "%s", re.msg)
        end
        local r = search(ctx, "patternProperties", re, name)
        if r == nil then return fail(ctx, "patternProperties", "property name %s is not valid UTF-8", quote(name)) end
        if r then
          matched = true
          e = sub(ctx, ps, pv, depth, name)
          if e then return e end
        end
      end
    end
    if not matched and addl ~= nil then
      if addl == false then
        local n = ctx.n + 1
        ctx.n = n; ctx.path[n] = name
        e = fail(ctx, "additionalProperties", "property not allowed")
        ctx.n = n - 1
        return e
      end
      e = sub(ctx, addl, pv, depth, name)
      if e then return e end
    end
  end
  local function dep_required(kw, list, name)
    if type(list) ~= "table" then fatal(ctx, kw, "must map names to arrays of strings") end
    for _, other in ipairs(list) do
      if v[other] == nil then
        return fail(ctx, kw, "property %s requires property %s", quote(name), quote(other))
      end
    end
  end
  if dreq ~= nil then
    for name, list in pairs(dreq) do
      if v[name] ~= nil then
        e = dep_required("dependentRequired", list, name)
        if e then return e end
      end
    end
  end
  if dsch ~= nil then
    for name, ds in pairs(dsch) do
      if v[name] ~= nil then
        e = vnode(ctx, ds, v, depth)
        if e then return e end
      end
    end
  end
  if deps ~= nil then
    for name, d in pairs(deps) do
      if v[name] ~= nil then
        if type(d) == "table" and kind(d) == "array" then
          e = dep_required("dependencies", d, name)
        else
          e = vnode(ctx, d, v, depth)
        end
        if e then return e end
      end
    end
  end
  return nil
end

local function validate_array(ctx, s, v, depth)
  local e
  local n = #v
  local mini, maxi = count_kw(ctx, s, "minItems"), count_kw(ctx, s, "maxItems")
  if mini and n < mini then return fail(ctx, "minItems", "has %d items, fewer than %s", n, fmtnum(mini)) end
  if maxi and n > maxi then return fail(ctx, "maxItems", "has %d items, more than %s", n, fmtnum(maxi)) end
  local done = 0
  local prefix = s.prefixItems
  if prefix ~= nil then
    if type(prefix) ~= "table" then fatal(ctx, "prefixItems", "must be an array of schemas") end
    local np = #prefix
    for i = 1, (np < n and np or n) do
      e = sub(ctx, prefix[i], v[i], depth, i - 1)
      if e then return e end
    end
    done = np
  end
  local items = s.items
  if items ~= nil then
    if type(items) == "table" and kind(items) == "array" then -- draft-7 tuple form
      local np = #items
      for i = 1, (np < n and np or n) do
        e = sub(ctx, items[i], v[i], depth, i - 1)
        if e then return e end
      end
      local addi = s.additionalItems
      if addi ~= nil then
        for i = np + 1, n do
          if addi == false then
            e = fail(ctx, "additionalItems", "has %d items, at most %d allowed", n, np)
          else
            e = sub(ctx, addi, v[i], depth, i - 1)
          end
          if e then return e end
        end
      end
    else
      for i = done + 1, n do
        if items == false then
          return fail(ctx, "items", "has %d items, at most %d allowed", n, done)
        end
        e = sub(ctx, items, v[i], depth, i - 1)
        if e then return e end
      end
    end
  end
  local contains = s.contains
  if contains ~= nil then
    local minc, maxc = count_kw(ctx, s, "minContains"), count_kw(ctx, s, "maxContains")
    minc = minc or 1
    local found = 0
    for i = 1, n do
      if sub(ctx, contains, v[i], depth, i - 1) == nil then found = found + 1 end
    end
    if found < minc then
      if minc == 1 then return fail(ctx, "contains", "no item matches the contains schema") end
      return fail(ctx, "minContains", "%d items match the contains schema, fewer than %s", found, fmtnum(minc))
    end
    if maxc and found > maxc then
      return fail(ctx, "maxContains", "%d items match the contains schema, more than %s", found, fmtnum(maxc))
    end
  end
  local uniq = s.uniqueItems
  if uniq ~= nil and uniq ~= false then
    if uniq ~= true then fatal(ctx, "uniqueItems", "must be a boolean") end
    for i = 2, n do
      for j = 1, i - 1 do
        if deep_equal(v[i], v[j], 0) then
          return fail(ctx, "uniqueItems", "items %d and %d are equal", j - 1, i - 1)
        end
      end
    end
  end
  return nil
end

local function list_kw(ctx, s, kw)
  local l = s[kw]
  if l ~= nil and (type(l) ~= "table" or l[1] == nil) then
    fatal(ctx, kw, "must be a non-empty array of schemas")
  end
  return l
end

function vnode(ctx, s, v, depth)
  if s == true then return nil end
  if s == false then return fail(ctx, "false schema", "no value is allowed here") end
  if type(s) ~= "table" or s[1] ~= nil or rawequal(s, M.null) then
    fatal(ctx, "schema", "a schema must be an object or a boolean, got %s", repr(s))
  end
  if depth >= ctx.max_depth then
    fatal(ctx, "$ref", "schema nesting deeper than %d (a $ref cycle?)", ctx.max_depth)
  end
  local e
  local k = kind(v)
  if k == nil then
    return fail(ctx, "type", "a Lua %s is not a JSON value", type(v))
  end
  depth = depth + 1

  local t = s.type
  if t ~= nil then
    if type(t) == "string" then
      if not VALID_TYPES[t] then fatal(ctx, "type", "unknown type %s", quote(t)) end
      if not type_matches(t, k, v) then
        return fail(ctx, "type", "expected %s, got %s", t, kind_name(k, v))
      end
    elseif type(t) == "table" then
      local ok = false
      for _, name in ipairs(t) do
        if not VALID_TYPES[name] then fatal(ctx, "type", "unknown type %s", repr(name)) end
        if type_matches(name, k, v) then ok = true; break end
      end
      if not ok then
        local names = {}
        for i, name in ipairs(t) do names[i] = name end
        return fail(ctx, "type", "expected %s, got %s", concat(names, " or "), kind_name(k, v))
      end
    else
      fatal(ctx, "type", "must be a string or an array of strings")
    end
  end

  local enum = s.enum
  if enum ~= nil then
    if type(enum) ~= "table" then fatal(ctx, "enum", "must be an array") end
    local ok = false
    for _, x in ipairs(enum) do
      if deep_equal(v, x, 0) then ok = true; break end
    end
    if not ok then
      local shown, total = {}, 0
      for i, x in ipairs(enum) do
        if i <= 8 then shown[i] = repr(x, 30) end
        total = i
      end
      if total > 8 then shown[9] = "..." end
      return fail(ctx, "enum", "%s is not one of %s", repr(v), concat(shown, ", "))
    end
  end

  local const = s.const
  if const ~= nil and not deep_equal(v, const, 0) then
    return fail(ctx, "const", "%s is not the constant %s", repr(v), repr(const))
  end

  local ref = s["$ref"]
  if ref ~= nil then
    local cache = ref_cache[ctx.root]
    if cache == nil then cache = {}; ref_cache[ctx.root] = cache end
    local target = cache[ref]
    if target == nil then
      local err
      target, err = resolve_ref(ctx.root, ref)
      if target == nil then fatal(ctx, "$ref", "%s", err) end
      cache[ref] = target
    end
    e = vnode(ctx, target, v, depth)
    if e then return e end
  end

  if k == "string" then
    local minl, maxl = count_kw(ctx, s, "minLength"), count_kw(ctx, s, "maxLength")
    if minl or maxl then
      local len = ulen(v)
      if len == nil then return fail(ctx, minl and "minLength" or "maxLength", "string is not valid UTF-8") end
      if minl and len < minl then
        return fail(ctx, "minLength", "string of %d characters is shorter than %s", len, fmtnum(minl))
      end
      if maxl and len > maxl then
        return fail(ctx, "maxLength", "string of %d characters is longer than %s", len, fmtnum(maxl))
      end
    end
    local pat = s.pattern
    if pat ~= nil then
      if type(pat) ~= "string" then fatal(ctx, "pattern", "must be a string") end
      local ok, re = pcall(get_regex, pat)
      if not ok then
        if getmetatable(re) ~= FATAL then error(re, 0) end
        fatal(ctx, "pattern", "%s", re.msg)
      end
      local r = search(ctx, "pattern", re, v)
      if r == nil then return fail(ctx, "pattern", "string is not valid UTF-8") end
      if not r then return fail(ctx, "pattern", "%s does not match %s", repr(v), quote(pat)) end
    end
  elseif k == "number" then
    local x = num_kw(ctx, s, "minimum")
    if x and v < x then return fail(ctx, "minimum", "%s is less than %s", fmtnum(v), fmtnum(x)) end
    x = num_kw(ctx, s, "maximum")
    if x and v > x then return fail(ctx, "maximum", "%s is greater than %s", fmtnum(v), fmtnum(x)) end
    x = num_kw(ctx, s, "exclusiveMinimum")
    if x and v <= x then
      return fail(ctx, "exclusiveMinimum", "%s is not greater than %s", fmtnum(v), fmtnum(x))
    end
    x = num_kw(ctx, s, "exclusiveMaximum")
    if x and v >= x then
      return fail(ctx, "exclusiveMaximum", "%s is not less than %s", fmtnum(v), fmtnum(x))
    end
    x = num_kw(ctx, s, "multipleOf")
    if x then
      if x <= 0 then fatal(ctx, "multipleOf", "must be greater than 0") end
      if not is_multiple(v, x) then
        return fail(ctx, "multipleOf", "%s is not a multiple of %s", fmtnum(v), fmtnum(x))
      end
    end
  elseif k == "object" then
    e = validate_object(ctx, s, v, depth)
    if e then return e end
  elseif k == "array" then
    e = validate_array(ctx, s, v, depth)
    if e then return e end
  elseif k == "empty" then -- both an empty object and an empty array: both sets apply
    e = validate_object(ctx, s, v, depth) or validate_array(ctx, s, v, depth)
    if e then return e end
  end

  local list = list_kw(ctx, s, "allOf")
  if list then
    for _, ss in ipairs(list) do
      e = vnode(ctx, ss, v, depth)
      if e then return e end
    end
  end
  list = list_kw(ctx, s, "anyOf")
  if list then
    local first
    local ok = false
    for _, ss in ipairs(list) do
      local ee = vnode(ctx, ss, v, depth)
      if ee == nil then ok = true; break end
      first = first or ee
    end
    if not ok then
      return fail(ctx, "anyOf", "matches none of the %d alternatives; the first says: %s", #list, first)
    end
  end
  list = list_kw(ctx, s, "oneOf")
  if list then
    local matched, first = {}, nil
    for i, ss in ipairs(list) do
      local ee = vnode(ctx, ss, v, depth)
      if ee == nil then matched[#matched + 1] = i - 1 else first = first or ee end
    end
    if #matched == 0 then
      return fail(ctx, "oneOf", "matches none of the %d alternatives; the first says: %s", #list, first)
    elseif #matched > 1 then
      return fail(ctx, "oneOf", "matches %d alternatives (%s), exactly one is required",
        #matched, concat(matched, ", "))
    end
  end
  local nots = s["not"]
  if nots ~= nil and vnode(ctx, nots, v, depth) == nil then
    return fail(ctx, "not", "matches a schema it must not match")
  end
  local ifs = s["if"]
  if ifs ~= nil then
    if vnode(ctx, ifs, v, depth) == nil then
      local th = s["then"]
      if th ~= nil then
        e = vnode(ctx, th, v, depth)
        if e then return e end
      end
    else
      local el = s["else"]
      if el ~= nil then
        e = vnode(ctx, el, v, depth)
        if e then return e end
      end
    end
  end
  return nil
end

function M.validate(schema, value)
  local ctx = { root = schema, path = {}, n = 0, max_depth = M.max_depth }
  local ok, e = pcall(vnode, ctx, schema, value, 0)
  if not ok then
    if getmetatable(e) == FATAL then return false, e.msg end
    error(e, 0) -- not ours (memory, instruction budget of the host, a bug): propagate
  end
  if e then return false, e end
  return true
end

------------------------------------------------------------------------------------------
-- check_schema
------------------------------------------------------------------------------------------

local REFUSED = {
  ["$anchor"] = "plain-name anchors are not supported (use \"#/$defs/...\" references)",
  ["$dynamicRef"] = "dynamic references are not supported",
  ["$dynamicAnchor"] = "dynamic references are not supported",
  ["$recursiveRef"] = "recursive references are not supported",
  ["$recursiveAnchor"] = "recursive references are not supported",
  unevaluatedProperties = "unevaluatedProperties is not supported",
  unevaluatedItems = "unevaluatedItems is not supported",
}

local check_node

local function cfail(st, kw, msg, ...)
  if select("#", ...) > 0 then msg = sformat(msg, ...) end
  error(setmetatable({ msg = pointer(st.path, st.n) .. ": " .. msg .. " (" .. kw .. ")" }, FATAL), 0)
end

local function push(st, tok) st.n = st.n + 1; st.path[st.n] = tok end
local function pop(st) st.n = st.n - 1 end

local function check_sub(st, s, tok, tok2)
  push(st, tok)
  if tok2 ~= nil then push(st, tok2) end
  check_node(st, s)
  if tok2 ~= nil then pop(st) end
  pop(st)
end

local function is_object(x) local k = kind(x); return k == "object" or k == "empty" end
local function is_array(x) local k = kind(x); return k == "array" or k == "empty" end

local function check_schema_map(st, kw, val)
  if not is_object(val) then cfail(st, kw, "must be an object of schemas") end
  push(st, kw)
  for name, ss in pairs(val) do
    if type(name) ~= "string" then cfail(st, kw, "keys must be strings") end
    check_sub(st, ss, name)
  end
  pop(st)
end

local function check_schema_list(st, kw, val, nonempty)
  if not is_array(val) or (nonempty and #val == 0) then
    cfail(st, kw, nonempty and "must be a non-empty array of schemas" or "must be an array of schemas")
  end
  push(st, kw)
  for i = 1, #val do check_sub(st, val[i], i - 1) end
  pop(st)
end

local function check_string_list(st, kw, val)
  if not is_array(val) then cfail(st, kw, "must be an array of strings") end
  local seen = {}
  for i = 1, #val do
    if type(val[i]) ~= "string" then cfail(st, kw, "must be an array of strings (item %d)", i - 1) end
    if seen[val[i]] then cfail(st, kw, "duplicate entry %s", quote(val[i])) end
    seen[val[i]] = true
  end
end

local function check_count(st, kw, val)
  if type(val) ~= "number" or not is_integer(val) or val < 0 then
    cfail(st, kw, "must be a non-negative integer")
  end
end

local function check_number(st, kw, val)
  if type(val) ~= "number" then
    if type(val) == "boolean" then
      cfail(st, kw, "the draft-4 boolean form is not supported; use a number")
    end
    cfail(st, kw, "must be a number")
  end
end

local function check_pattern_kw(st, kw, p)
  if type(p) ~= "string" then cfail(st, kw, "must be a string") end
  local ok, e = M.check_pattern(p)
  if not ok then cfail(st, kw, "%s", e) end
end

local CHECKERS = {
  type = function(st, val)
    if type(val) == "string" then
      if not VALID_TYPES[val] then cfail(st, "type", "unknown type %s", quote(val)) end
      return
    end
    if not is_array(val) or #val == 0 then
      cfail(st, "type", "must be a type name or a non-empty array of type names")
    end
    local seen = {}
    for i = 1, #val do
      local name = val[i]
      if type(name) ~= "string" or not VALID_TYPES[name] then
        cfail(st, "type", "unknown type %s", repr(name))
      end
      if seen[name] then cfail(st, "type", "duplicate type %s", quote(name)) end
      seen[name] = true
    end
  end,
  enum = function(st, val)
    if not is_array(val) or #val == 0 then cfail(st, "enum", "must be a non-empty array") end
  end,
  const = function() end,
  ["$ref"] = function(st, val)
    local target, tokens = resolve_ref(st.root, val)
    if target == nil then cfail(st, "$ref", "%s", tokens) end
    -- the target is checked where it is (it may sit outside the known keywords)
    local saved_path, saved_n = st.path, st.n
    st.path, st.n = tokens, #tokens
    check_node(st, target)
    st.path, st.n = saved_path, saved_n
  end,
  ["$defs"] = function(st, val) check_schema_map(st, "$defs", val) end,
  definitions = function(st, val) check_schema_map(st, "definitions", val) end,
  properties = function(st, val) check_schema_map(st, "properties", val) end,
  patternProperties = function(st, val)
    check_schema_map(st, "patternProperties", val)
    for p in pairs(val) do check_pattern_kw(st, "patternProperties", p) end
  end,
  additionalProperties = function(st, val) check_sub(st, val, "additionalProperties") end,
  propertyNames = function(st, val) check_sub(st, val, "propertyNames") end,
  required = function(st, val) check_string_list(st, "required", val) end,
  minProperties = function(st, val) check_count(st, "minProperties", val) end,
  maxProperties = function(st, val) check_count(st, "maxProperties", val) end,
  dependentRequired = function(st, val)
    if not is_object(val) then cfail(st, "dependentRequired", "must be an object") end
    for _, list in pairs(val) do check_string_list(st, "dependentRequired", list) end
  end,
  dependentSchemas = function(st, val) check_schema_map(st, "dependentSchemas", val) end,
  dependencies = function(st, val)
    if not is_object(val) then cfail(st, "dependencies", "must be an object") end
    for name, d in pairs(val) do
      if type(d) == "table" and kind(d) == "array" then check_string_list(st, "dependencies", d)
      else check_sub(st, d, "dependencies", name) end
    end
  end,
  items = function(st, val)
    if type(val) == "table" and kind(val) == "array" then check_schema_list(st, "items", val, false)
    else check_sub(st, val, "items") end
  end,
  prefixItems = function(st, val) check_schema_list(st, "prefixItems", val, false) end,
  additionalItems = function(st, val) check_sub(st, val, "additionalItems") end,
  contains = function(st, val) check_sub(st, val, "contains") end,
  minContains = function(st, val) check_count(st, "minContains", val) end,
  maxContains = function(st, val) check_count(st, "maxContains", val) end,
  minItems = function(st, val) check_count(st, "minItems", val) end,
  maxItems = function(st, val) check_count(st, "maxItems", val) end,
  uniqueItems = function(st, val)
    if type(val) ~= "boolean" then cfail(st, "uniqueItems", "must be a boolean") end
  end,
  minLength = function(st, val) check_count(st, "minLength", val) end,
  maxLength = function(st, val) check_count(st, "maxLength", val) end,
  pattern = function(st, val) check_pattern_kw(st, "pattern", val) end,
  minimum = function(st, val) check_number(st, "minimum", val) end,
  maximum = function(st, val) check_number(st, "maximum", val) end,
  exclusiveMinimum = function(st, val) check_number(st, "exclusiveMinimum", val) end,
  exclusiveMaximum = function(st, val) check_number(st, "exclusiveMaximum", val) end,
  multipleOf = function(st, val)
    if type(val) ~= "number" or val <= 0 then cfail(st, "multipleOf", "must be a number greater than 0") end
  end,
  allOf = function(st, val) check_schema_list(st, "allOf", val, true) end,
  anyOf = function(st, val) check_schema_list(st, "anyOf", val, true) end,
  oneOf = function(st, val) check_schema_list(st, "oneOf", val, true) end,
  ["not"] = function(st, val) check_sub(st, val, "not") end,
  ["if"] = function(st, val) check_sub(st, val, "if") end,
  ["then"] = function(st, val) check_sub(st, val, "then") end,
  ["else"] = function(st, val) check_sub(st, val, "else") end,
  ["$id"] = function(st, val)
    if type(val) ~= "string" then cfail(st, "$id", "must be a string") end
    if st.depth > 1 then
      cfail(st, "$id", "$id below the root changes $ref resolution and is not supported")
    end
  end,
  format = function(st, val)
    if type(val) ~= "string" then cfail(st, "format", "must be a string") end
  end,
}

function check_node(st, s)
  if s == true or s == false then return end
  if type(s) ~= "table" or rawequal(s, M.null) then
    cfail(st, "schema", "a schema must be an object or a boolean, got %s", repr(s))
  end
  local k = kind(s)
  if k ~= "object" and k ~= "empty" then
    cfail(st, "schema", "a schema must be an object or a boolean, got an array")
  end
  if st.seen[s] then return end
  st.seen[s] = true
  local keys = {}
  for key in pairs(s) do
    if type(key) ~= "string" then cfail(st, "schema", "schema keys must be strings, got %s", repr(key)) end
    keys[#keys + 1] = key
  end
  sort(keys)
  st.depth = st.depth + 1
  for _, key in ipairs(keys) do
    local refused = REFUSED[key]
    if refused then
      cfail(st, key, "%s", refused)
    end
    local ck = CHECKERS[key]
    if ck then ck(st, s[key]) end
  end
  st.depth = st.depth - 1
end

function M.check_schema(schema)
  local st = { root = schema, path = {}, n = 0, seen = {}, depth = 0 }
  local ok, e = pcall(check_node, st, schema)
  if ok then return true end
  if getmetatable(e) == FATAL then return false, e.msg end
  error(e, 0)
end

return M
