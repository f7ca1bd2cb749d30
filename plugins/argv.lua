-- Command lines parsed the way the tool itself parses them, so a policy checks what the
-- tool will really do: combined short flags (-Sc), short options with attached values
-- (-e<pat>), long options with `=value`, unambiguous abbreviations of long options
-- (--open-files-in=... is --open-files-in-pager), `--`, and options after operands
-- (GNU tools permute) or not (interpreters stop at the script).
--
--   local argv = require "plugins.argv"
--   local grep = argv.grammar {
--     { "e", "regexp", "value" }, { "f", "file", "path" },
--     { nil, "exclude-from", "path" },
--   }
--   local parsed, why = argv.parse(call.argv, grep)
--   -- parsed.options: { {name = "regexp", value = "x", kind = "value"}, ... } in order
--   -- parsed.operands: what is not an option, in order (operand_at: their indices)
--
-- Option kinds: "flag" (no value), "value" (a value: attached, `=`, or the next
-- argument), "path" (a value that names a file), "optional" (a value only when attached
-- or with `=`), "refuse" (never allowed: the entry's fourth field says why).
--
-- An option the grammar does not list is taken as a flag: if it really takes a value,
-- that value is then treated as an operand, which is checked (over-refusal, never a
-- skipped path). So a grammar must list every option that takes a value, and only them.
local M = {}

local VALUE_KINDS = { value = true, path = true }

-- Build a grammar from { short, long, kind [, why] } entries; opts: stop_at_operand
-- (the first operand ends the options, as for interpreters), stop_after (a set of
-- canonical names after which everything is an operand: python -c CODE ARGS...).
function M.grammar(entries, opts)
  opts = opts or {}
  local g = { short = {}, long = {}, longs = {}, stop_at_operand = opts.stop_at_operand,
              stop_after = opts.stop_after or {} }
  for _, e in ipairs(entries) do
    local o = { short = e[1], long = e[2], kind = e[3] or "flag", why = e[4] }
    o.name = o.long or o.short
    if o.short then g.short[o.short] = o end
    if o.long then
      g.long[o.long] = o
      g.longs[#g.longs + 1] = o
    end
  end
  return g
end

-- A long option by its exact name or an unambiguous prefix. Ambiguous: the candidates.
local function resolve_long(g, name)
  if g.long[name] then return g.long[name] end
  local found = {}
  for _, o in ipairs(g.longs) do
    if o.long:sub(1, #name) == name then found[#found + 1] = o end
  end
  if #found == 1 then return found[1] end
  if #found > 1 then return nil, found end
  return nil
end

local function refusal(o, spelled)
  return spelled .. ": " .. (o.why or "refused by this policy")
end

-- Parse argv[from..] with grammar g. Returns { options = {...}, operands = {...} } or
-- nil and a reason (a refused option, a missing value, an ambiguous abbreviation of a
-- refused option).
function M.parse(argv, g, from)
  local out = { options = {}, operands = {}, operand_at = {} }
  local only_operands = false
  local i = from or 1
  local function add(o, value)
    out.options[#out.options + 1] = { name = o.name, value = value, kind = o.kind }
    if g.stop_after[o.name] then only_operands = true end
  end
  while i <= #argv do
    local a = argv[i]
    if only_operands or a == "-" or a:sub(1, 1) ~= "-" then
      out.operands[#out.operands + 1] = a
      out.operand_at[#out.operands] = i
      if g.stop_at_operand then only_operands = true end
    elseif a == "--" then
      only_operands = true
    elseif a:sub(1, 2) == "--" then
      local name, value = a:match("^%-%-([^=]*)=(.*)$")
      name = name or a:sub(3)
      local o, ambiguous = resolve_long(g, name)
      if ambiguous then
        -- the tool refuses an ambiguous abbreviation; refuse it first if any reading
        -- of it is refused or names a file
        for _, c in ipairs(ambiguous) do
          if c.kind == "refuse" then return nil, refusal(c, "--" .. name) end
        end
        for _, c in ipairs(ambiguous) do
          if c.kind == "path" and value then
            out.options[#out.options + 1] = { name = c.name, value = value, kind = "path" }
          end
        end
        o = { name = name, kind = "flag" }
      end
      o = o or { name = name, kind = "flag" }
      if o.kind == "refuse" then return nil, refusal(o, "--" .. o.long) end
      if value == nil and VALUE_KINDS[o.kind] then
        i = i + 1
        value = argv[i]
        if value == nil then return nil, "--" .. o.long .. " needs a value" end
      end
      add(o, value)
    else
      local j = 2
      while j <= #a do
        local c = a:sub(j, j)
        local o = g.short[c] or { name = c, kind = "flag" }
        if o.kind == "refuse" then return nil, refusal(o, "-" .. c) end
        if VALUE_KINDS[o.kind] or o.kind == "optional" then
          local value = a:sub(j + 1)
          if value == "" and o.kind ~= "optional" then
            i = i + 1
            value = argv[i]
            if value == nil then return nil, "-" .. c .. " needs a value" end
          end
          add(o, value ~= "" and value or nil)
          break
        end
        add(o)
        j = j + 1
      end
    end
    i = i + 1
  end
  return out
end

-- The values of the options of kind "path", in order.
function M.path_values(parsed)
  local out = {}
  for _, o in ipairs(parsed.options) do
    if o.kind == "path" and o.value then out[#out + 1] = o.value end
  end
  return out
end

-- Whether an option (canonical name) was given.
function M.has(parsed, name)
  for _, o in ipairs(parsed.options) do
    if o.name == name then return true end
  end
  return false
end

return M
