-- The policy engine's Lua half: what the C core asks of a loaded policy at its fixed
-- points — argv from structured args, streaming redaction, classification, output
-- checks. The core calls these through its one budgeted entry (core/policy.c) with
-- copies of data; everything returned is checked again in C.
-- the stockade.schema module and the core's helpers (check_pattern), handed over by the
-- loader; nothing here is reachable by a policy
local schema, core = ...

local E = {}

local DEFAULT_FN_WINDOW = 256      -- what a redact *function* is assumed to need
local MAX_CARRY = 64 * 1024        -- held bytes are emitted past this, whatever matches
local WITHHELD = "[stockade: output withheld: redaction failed]"

-- ---- redactors -------------------------------------------------------------------

-- The literal that begins a regex: an optional leading \b, then letters, digits, "_" and
-- escaped punctuation, up to the first other construct (a char made optional by the
-- quantifier after it is not part of it). nil when shorter than two characters.
local function literal_opener(re)
  local out, i = {}, 1
  local lead = ""
  if re:sub(1, 2) == "\\b" then lead, i = "\\b", 3 end
  local last_at
  while i <= #re do
    local c = re:sub(i, i)
    if c:match("[%w_]") then
      last_at = #out + 1
      out[#out + 1] = c
      i = i + 1
    elseif c == "\\" and re:sub(i + 1, i + 1):match("[^%w]") and re:sub(i + 1, i + 1) ~= "" then
      last_at = #out + 1
      out[#out + 1] = re:sub(i, i + 1)
      i = i + 2
    else
      break
    end
  end
  local q = re:sub(i, i)
  if (q == "?" or q == "*" or q == "{") and last_at then out[last_at] = nil end
  if #out < 2 then return nil end
  return lead .. table.concat(out)
end

-- Flatten the policy's `redact` lists (plugins export lists of redactors) into one list
-- of normalized redactors: {kind="regex"|"pattern"|"function", ...}. Regex redactors
-- (literals become ones) run in the core's one-pass stage; the others here, in Lua.
local function add_redactors(out, r, where)
  if type(r) == "function" then
    out[#out + 1] = { kind = "function", fn = r, window = DEFAULT_FN_WINDOW, name = where }
  elseif type(r) == "table" and r.regex ~= nil then
    if type(r.regex) ~= "string" or #r.regex == 0 then
      error(where .. ": regex must be a non-empty string", 0)
    end
    local open = r.open
    if open == nil then open = literal_opener(r.regex) end
    if type(open) ~= "string" or #open == 0 then
      error(where .. ": a regex redactor needs `open` (a regex for how its matches begin)"
            .. " unless its regex starts with a literal of two or more characters", 0)
    end
    if r.replace ~= nil and type(r.replace) ~= "string" then
      error(where .. ": replace must be a string", 0)
    end
    local name = r.name or where
    out[#out + 1] = { kind = "regex", regex = r.regex, open = open, name = name,
                      replace = r.replace or ("[REDACTED:" .. name .. "]") }
  elseif type(r) == "table" and (r.pattern or r.literal) then
    if r.literal then
      if type(r.literal) ~= "string" or #r.literal == 0 then
        error(where .. ": literal redactor needs a non-empty string", 0)
      end
      -- a literal is a regex redactor: the core finds it at any length, in one pass
      local re = r.literal:gsub("[^%w]", function(c) return ("\\x%02x"):format(c:byte()) end)
      local open = r.literal:sub(1, 64):gsub("[^%w]", function(c)
        return ("\\x%02x"):format(c:byte())
      end)
      out[#out + 1] = { kind = "regex", regex = re, open = open,
                        replace = r.replace or "[REDACTED]", name = r.name or where }
    else
      if type(r.pattern) ~= "string" then error(where .. ": pattern must be a string", 0) end
      local ok, err = core.check_pattern(r.pattern)
      if not ok then error(where .. ": malformed pattern: " .. tostring(err), 0) end
      local window = r.window
      if math.type(window) ~= "integer" or window < 1 or window > MAX_CARRY then
        error(where .. ": window must be an integer from 1 to " .. MAX_CARRY, 0)
      end
      if r.prefix ~= nil and (type(r.prefix) ~= "string" or #r.prefix == 0) then
        error(where .. ": prefix must be a non-empty string", 0)
      end
      -- iprefix: the same, compared without regard to ASCII case (HTTP header names)
      if r.iprefix ~= nil and (type(r.iprefix) ~= "string" or #r.iprefix == 0) then
        error(where .. ": iprefix must be a non-empty string", 0)
      end
      out[#out + 1] = { kind = "pattern", pattern = r.pattern, prefix = r.prefix,
                        iprefix = r.iprefix and r.iprefix:lower(),
                        replace = r.replace or "[REDACTED]", window = window,
                        name = r.name or where }
    end
  elseif type(r) == "table" then
    for i, sub in ipairs(r) do add_redactors(out, sub, where .. "[" .. i .. "]") end
  else
    error(where .. ": a redactor is a function, a {pattern=...} table or a list of them", 0)
  end
end

local function glob_to_pattern(g)
  return "^" .. g:gsub("[%^%$%(%)%%%.%[%]%+%-%?]", "%%%0"):gsub("%*", ".*") .. "$"
end

-- Literal redactors for the values of environment variables the policy denies: a
-- secret that reaches a tool by another route is still caught on the way out.
local function env_redactors(deny, env)
  local out = {}
  local names = {}
  for name in pairs(env) do names[#names + 1] = name end
  table.sort(names)
  for _, name in ipairs(names) do
    for _, g in ipairs(deny) do
      local value = env[name]
      if name:match(glob_to_pattern(g)) and #value >= 8 then
        out[#out + 1] = { literal = value, name = "env:" .. name,
                          replace = "[REDACTED:" .. name .. "]" }
        break
      end
    end
  end
  return out
end

-- Prepare each tool's redactor chain once per policy load. Returns, per tool, what the
-- core needs: the regex redactors (its own one-pass stage), and for the Lua stage the
-- literal prefixes (when every Lua redactor has one) and the window.
function E.init(P, env)
  local global = {}
  add_redactors(global, P.redact or {}, "redact")
  add_redactors(global, env_redactors(P.env.deny or {}, env or {}), "env")
  local info = {}
  for name, tool in pairs(P.tools) do
    local chain = {}
    for _, r in ipairs(global) do chain[#chain + 1] = r end
    if tool.redact then add_redactors(chain, tool.redact, "tools." .. name .. ".redact") end
    -- regex redactors (and literals) go to the core's one-pass stage, the others to Lua
    local lua_chain, regex = {}, {}
    local window, prefixes, iprefixes, lua_always = 1, {}, {}, false
    for _, r in ipairs(chain) do
      if r.kind == "regex" then
        regex[#regex + 1] = { name = r.name, regex = r.regex, open = r.open,
                              replace = r.replace }
      else
        lua_chain[#lua_chain + 1] = r
        if r.window > window then window = r.window end
        if r.prefix then
          prefixes[#prefixes + 1] = r.prefix
        elseif r.iprefix then
          iprefixes[#iprefixes + 1] = r.iprefix
        else
          lua_always = true
        end
      end
    end
    tool._chain = lua_chain
    info[name] = { window = window, prefixes = prefixes, iprefixes = iprefixes,
                   lua_always = lua_always, lua = #lua_chain > 0, regex = regex,
                   -- the same regex list as every tool without its own: compiled once
                   regex_shared = not tool.redact }
  end
  return info
end

-- Apply a chain to a complete piece of text.
local function apply(chain, text, ctx)
  local total = 0
  for _, r in ipairs(chain) do
    local n = 0
    if r.kind == "pattern" then
      if (r.prefix and text:find(r.prefix, 1, true)) or
         (r.iprefix and text:lower():find(r.iprefix, 1, true)) or
         (not r.prefix and not r.iprefix) then
        -- replace is a gsub replacement: %1 puts a capture back (url-password keeps the
        -- user, the Authorization rules keep the header)
        text, n = text:gsub(r.pattern, r.replace)
      end
    else
      local out, count = r.fn(text, ctx)
      if type(out) ~= "string" then
        error(r.name .. ": a redact function must return a string", 0)
      end
      if count ~= nil and math.type(count) ~= "integer" then
        error(r.name .. ": the count must be an integer", 0)
      end
      text, n = out, count or 0
    end
    total = total + n
  end
  return text, total
end

-- Where a match of r in text starts before `cut` but ends after it (or at the very end
-- of the text, where more bytes could still extend it): the cut must move.
local function adjust_cut(r, text, cut)
  if r.kind == "function" then return cut end
  if r.prefix and not text:find(r.prefix, 1, true) then return cut end
  local init = 1
  while true do
    local a, b = text:find(r.pattern, init)
    if not a or a > cut then return cut end
    if b >= #text then return a - 1 end       -- may still grow: hold it back whole
    if b > cut then cut = b end               -- straddles: emit it whole, redacted
    init = (b >= a) and (b + 1) or (a + 1)
  end
end

-- Where, in text, a redactor of the chain could still begin a match: the first
-- occurrence of a literal prefix, or a tail that is the start of one. nil: nowhere.
local function first_possible_start(chain, text)
  local first
  local lower
  for _, r in ipairs(chain) do
    local p, plain_text = r.prefix, text
    if not p and r.iprefix then
      lower = lower or text:lower()
      p, plain_text = r.iprefix, lower
    end
    if p then
      local a = plain_text:find(p, 1, true)
      if not a then
        for k = math.min(#p - 1, #text), 1, -1 do
          if plain_text:sub(-k) == p:sub(1, k) then a = #text - k + 1 break end
        end
      end
      if a and (not first or a < first) then first = a end
    end
  end
  return first
end

-- The offset of the last "\n" in text[from..to], or nil. Plain finds forward: linear
-- in to - from (a backward `.*()\n` match is quadratic on text without newlines).
local function last_newline(text, from, to)
  local at, i = nil, from
  while true do
    local a = text:find("\n", i, true)
    if not a or a > to then return at end
    at, i = a, a + 1
  end
end

-- One step of streaming redaction: `text` is what the core held back plus the new
-- chunk. Returns the redacted text to emit, how many input bytes it covers (the rest
-- is held for the next call) and the number of redactions. mode: "more" (more may
-- come), "eof" (the stream ended), "quiet" (the tool went quiet: release what cannot
-- be the start of a secret, keep what can).
function E.redact(P, toolname, stream, session, text, mode)
  local tool = P.tools[toolname]
  local chain = tool._chain
  local ctx = { stream = stream, tool = toolname, session = session }
  if mode == "eof" or #chain == 0 then
    local out, n = apply(chain, text, ctx)
    return out, #text, n
  end
  if mode == "quiet" then
    local start = first_possible_start(chain, text)
    local cut = start and start - 1 or #text
    if cut <= 0 then return "", 0, 0 end
    local out, n = apply(chain, text:sub(1, cut), ctx)
    return out, cut, n
  end
  local window = 1
  for _, r in ipairs(chain) do if r.window > window then window = r.window end end
  local cut = #text - (window - 1)
  if cut <= 0 and #text < MAX_CARRY then return "", 0, 0 end
  if cut < 1 then cut = #text end
  -- prefer a line boundary for redact functions, which see text in pieces; looked for
  -- in the last window only, so the search is linear in the window, never quadratic
  local nl = last_newline(text, math.max(cut - window + 1, 1), cut)
  if nl then cut = nl end
  for _ = 1, 4 do                               -- until no match straddles the cut
    local before = cut
    for _, r in ipairs(chain) do cut = adjust_cut(r, text, cut) end
    if cut == before then break end
  end
  if cut <= 0 then
    if #text < MAX_CARRY then return "", 0, 0 end
    cut = #text                                 -- bounded memory beats a perfect cut
  end
  local out, n = apply(chain, text:sub(1, cut), ctx)
  return out, cut, n
end

E.WITHHELD = WITHHELD

-- ---- classification ------------------------------------------------------------------

local CLASSES = {
  OK = true, TOOL_ERROR = true, TOOL_TIMEOUT = true, RESOURCE_LIMIT = true,
  OUTPUT_REJECTED = true, POLICY_VIOLATION = true,
}

function E.classify(P, toolname, r)
  local tool = P.tools[toolname]
  if not tool.classify then return nil end
  local class, retryable, message = tool.classify(r)
  if class == nil then return nil end
  if not CLASSES[class] then
    error("classify returned an unknown class " .. tostring(class), 0)
  end
  if retryable ~= nil and type(retryable) ~= "boolean" then
    error("classify: retryable must be a boolean", 0)
  end
  if message ~= nil and type(message) ~= "string" then
    error("classify: message must be a string", 0)
  end
  if message then
    message = apply(tool._chain, message:match("^[^\r\n]*"):sub(1, 200), {})
  end
  return class, retryable == true, message
end

-- ---- structured args and outputs ---------------------------------------------------

function E.argv(P, toolname, args, call)
  local tool = P.tools[toolname]
  if not tool.argv then
    return nil, "tool " .. toolname .. " takes no structured args (it has no argv hook)"
  end
  if tool.schema then
    local ok, err = schema.validate(tool.schema, args)
    if not ok then return nil, "args: " .. err end
  end
  local argv = tool.argv(args, call)
  if type(argv) ~= "table" then return nil, "the argv hook did not return a list" end
  local out = {}
  for i = 1, #argv do
    if type(argv[i]) ~= "string" then
      return nil, "the argv hook returned a non-string at " .. i
    end
    out[i] = argv[i]
  end
  for k in pairs(argv) do
    if math.type(k) ~= "integer" or k < 1 or k > #argv then
      return nil, "the argv hook returned a table that is not a list"
    end
  end
  return out
end

function E.check_output(P, toolname, text, json)
  local spec = P.tools[toolname].output
  if not spec or spec.format ~= "json" then return true end
  local depth = spec.max_depth or 32
  json.decode_max_depth(depth)
  local ok, value = pcall(json.decode, text)
  if not ok then return false, "output is not JSON within depth " .. depth end
  if spec.schema then
    local valid, err = schema.validate(spec.schema, value)
    if not valid then return false, "output: " .. err end
  end
  return true
end

return E
