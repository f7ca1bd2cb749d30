-- The `stockade` module as policies see it: stockade.policy{}, stockade.tool{} and the
-- helpers. It checks every field a policy declares — an unknown key, a wrong type or a
-- malformed duration is a load error naming the field and the policy's file:line — and
-- returns a normalized table (durations in ms, sizes in bytes) that the C core reads.
local core = ...          -- C functions handed over by the loader (core/policy.c)

local M = {}

local function where(level)
  return core.where(level + 1) or "?"
end

local function fail(at, fmt, ...)
  error(at .. ": " .. string.format(fmt, ...), 0)
end

-- Errors point at the field's own line: the first line at or after the constructor's
-- (`at`, "file:line") where each key of the field's path appears as `key =`, in turn.
local sources = {}
local function source_lines(file)
  if sources[file] == nil then
    local text = core.source(file)
    local lines = false
    if text then
      lines = {}
      for l in (text .. "\n"):gmatch("([^\n]*)\n") do lines[#lines + 1] = l end
    end
    sources[file] = lines
  end
  return sources[file] or nil
end

local function locate(at, field)
  local file, line = at:match("^(.*):(%d+)$")
  local lines = file and source_lines(file)
  if not lines then return at end
  local n = tonumber(line)
  for key in tostring(field):gmatch("[^.%[%]]+") do
    if not key:match("^%d+$") then
      local pat = "%f[%w_]" .. key:gsub("%W", "%%%0") .. "%s*="
      for i = n, math.min(#lines, n + 2000) do
        if lines[i]:find(pat) then n = i break end
      end
    end
  end
  return file .. ":" .. n
end

local function fail_at(at, field, fmt, ...)
  error(locate(at, field) .. ": " .. field .. ": " .. string.format(fmt, ...), 0)
end

-- A value as an error shows it: its type, and strings and numbers quoted.
local function show(v)
  local t = type(v)
  if t == "string" then
    return string.format("string %q", #v > 40 and v:sub(1, 40) .. "..." or v)
  elseif t == "number" or t == "boolean" then
    return t .. " " .. tostring(v)
  elseif t == "nil" then
    return "nil"
  end
  return "a " .. t
end

-- The nearest name in `names` to a misspelt one, when close enough to be a typo.
local function nearest(name, names)
  local function distance(a, b)
    local prev = {}
    for j = 0, #b do prev[j] = j end
    for i = 1, #a do
      local cur = { [0] = i }
      for j = 1, #b do
        local cost = a:sub(i, i) == b:sub(j, j) and 0 or 1
        cur[j] = math.min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost)
      end
      prev = cur
    end
    return prev[#b]
  end
  local best, best_d
  for _, n in ipairs(names) do
    local d = distance(name, n)
    if not best_d or d < best_d or (d == best_d and n < best) then best, best_d = n, d end
  end
  if best and best_d <= math.max(1, math.floor(#name / 3)) then return best end
end

M.json = core.json              -- encode / decode / null (lua-cjson)
M.schema = core.schema          -- validate(schema, value), check_schema(schema)
M.path = { resolve = core.path_resolve }
M.paths_beneath = core.paths_beneath
M.log = core.log

function M.duration(s)
  local ms, err = core.duration(s)
  if not ms then error(err, 2) end
  return ms
end

function M.size(s)
  local n, err = core.size(s)
  if not n then error(err, 2) end
  return n
end

-- Field checkers: each takes (value, at, field) and returns the normalized value.
local function kind(t)
  return function(v, at, field)
    if type(v) ~= t then fail_at(at, field, "expected a %s, got %s", t, show(v)) end
    return v
  end
end
local is_string, is_table, is_function = kind("string"), kind("table"), kind("function")

local function is_count(v, at, field)
  if math.type(v) ~= "integer" or v < 0 then
    fail_at(at, field, "expected a non-negative integer, got %s", show(v))
  end
  return v
end

local function is_duration(v, at, field)
  if type(v) ~= "string" then
    fail_at(at, field, "expected a duration string such as \"30s\", got %s", show(v))
  end
  local ms, err = core.duration(v)
  if not ms then fail_at(at, field, "%s", err) end
  return ms
end

local function is_size(v, at, field)
  if math.type(v) == "integer" and v >= 0 then return v end
  if type(v) ~= "string" then
    fail_at(at, field, "expected a size such as \"1MiB\", got %s", show(v))
  end
  local n, err = core.size(v)
  if not n then fail_at(at, field, "%s", err) end
  return n
end

local function one_of(...)
  local allowed = { ... }
  return function(v, at, field)
    for _, a in ipairs(allowed) do if v == a then return v end end
    fail_at(at, field, "expected one of %s, got %s", table.concat(allowed, ", "), show(v))
  end
end

local function bool_or_function(v, at, field)
  if type(v) ~= "boolean" and type(v) ~= "function" then
    fail_at(at, field, "expected a boolean or a function, got %s", show(v))
  end
  return v
end

local function list_of_strings(v, at, field)
  is_table(v, at, field)
  local out = {}
  for i, s in ipairs(v) do out[i] = is_string(s, at, field .. "[" .. i .. "]") end
  for k in pairs(v) do
    if math.type(k) ~= "integer" or k < 1 or k > #v then
      fail_at(at, field, "expected a list, found key %s", tostring(k))
    end
  end
  return out
end

-- redact: a function, a { pattern = ... } or { literal = ... } table, or a list of them.
-- Every pattern is compiled here, so a malformed one is a load error at its own line, not
-- output withheld later without a reason.
local function redactors(v, at, field)
  if type(v) == "function" then return v end
  if type(v) ~= "table" then
    fail_at(at, field, "expected a function, a redactor table or a list of them, got %s",
            show(v))
  end
  if v.pattern ~= nil then
    if type(v.pattern) ~= "string" then
      fail_at(at, field .. ".pattern", "expected a string, got %s", show(v.pattern))
    end
    local ok, err = core.check_pattern(v.pattern)
    if not ok then
      -- the line where the pattern is written, when it is written in this file
      local loc = locate(at, field)
      local file, line = loc:match("^(.*):(%d+)$")
      local lines = file and source_lines(file)
      for i = tonumber(line or 1), lines and #lines or 0 do
        if lines[i]:find(v.pattern, 1, true) then loc = file .. ":" .. i break end
      end
      error(loc .. ": " .. field .. ": " .. tostring(err), 0)
    end
    return v
  end
  if v.literal ~= nil then return v end
  for i, r in ipairs(v) do redactors(r, at, field .. "[" .. i .. "]") end
  return v
end

local function network(v, at, field)
  if v == "none" or v == "loopback" then return v end
  if type(v) == "table" then return v end
  fail_at(at, field, "expected \"none\", \"loopback\" or { allow = {...} }, got %s", show(v))
end

-- Check `t` against `spec` (field -> checker or nested spec table); unknown keys fail.
local function check(t, spec, at, prefix)
  if type(t) ~= "table" then fail_at(at, prefix, "expected a table, got %s", show(t)) end
  local out = {}
  for k, v in pairs(t) do
    local field = prefix and (prefix .. "." .. tostring(k)) or tostring(k)
    local checker = spec[k]
    if type(k) ~= "string" or checker == nil then
      local names = {}
      for name in pairs(spec) do names[#names + 1] = name end
      local guess = type(k) == "string" and nearest(k, names)
      local hint = guess and (" (did you mean " .. (prefix and prefix .. "." or "") .. guess .. "?)")
                   or ""
      error(locate(at, field) .. ": unknown field " .. field .. hint, 0)
    end
    if type(checker) == "table" then
      out[k] = check(v, checker, at, field)
    else
      out[k] = checker(v, at, field)
    end
  end
  return out
end

local TIMEOUTS = {
  call = is_duration, call_max = is_duration, grace = is_duration, cpu = is_duration,
  fuse = is_duration, lease = is_duration, idle_shutdown = is_duration,
  deadline_min = is_duration,
}
-- What a tool may set for itself, over the policy's value.
local TOOL_LIMITS = {
  memory = is_size, address_space = is_size, processes = is_count, file_size = is_size,
  open_files = is_count,
}
local LIMITS = {
  memory = is_size, address_space = is_size, processes = is_count, file_size = is_size,
  open_files = is_count, disk = is_size, inodes = is_count,
  output = is_size, stdin = is_size, argv = is_count, argv_bytes = is_size,
  sessions = is_count, running = is_count, depth = is_count,
  lua_memory = is_size, lua_instructions = is_count,
  redact_hold = is_size,      -- the most output a possibly-growing secret may hold back
  -- accounting thresholds: crossing one raises an alarm (log, notification, metric)
  alarms = { zombies = is_count, fds = is_count, rss = is_size, processes = is_count,
             sessions = is_count },
}
local DEFAULTS = {
  timeouts = {
    call = 30000, call_max = 600000, grace = 2000, cpu = 60000, fuse = 3000000,
    lease = 600000, idle_shutdown = 3600000, deadline_min = 100,
  },
  limits = {
    memory = 512 * 1024 * 1024, address_space = 0, processes = 64,
    file_size = 1024 * 1024 * 1024, open_files = 256, output = 1024 * 1024,
    stdin = 1024 * 1024, argv = 64, disk = 2 * 1024 * 1024 * 1024, inodes = 100000,
    argv_bytes = 64 * 1024, sessions = 256, running = 64, depth = 4,
    lua_memory = 64 * 1024 * 1024, lua_instructions = 10000000,
    redact_hold = 1024 * 1024,
  },
  env = { path = "/usr/bin:/bin", allow = {}, deny = {} },
}

local TOOL = {
  path = is_string, owner = is_string, description = is_string, schema = is_table,
  timeout = is_duration, idempotent = bool_or_function, accept = is_function,
  argv = is_function, redact = redactors,
  raw_argv = kind("boolean"),
  classify = is_function, output = { format = one_of("text", "json"), schema = is_table,
                                     max_depth = is_count },
  probe = is_table,
  env = list_of_strings, limits = TOOL_LIMITS,
}

-- Tools made by stockade.tool{}: a private set, not a metatable anyone could reach.
local made_tools = setmetatable({}, { __mode = "k" })

-- A tool does not know its name until the policy lists it: an error in it is kept and
-- raised by stockade.policy{}, which names the tool.
function M.tool(t)
  local at = where(2)
  local ok, tool = pcall(function()
    local tool = check(t, TOOL, at, nil)
    if tool.path == nil then fail(at, "path is required") end
    if tool.path:sub(1, 1) ~= "/" then
      fail_at(at, "path", "must be absolute (no PATH lookup), got %s", show(tool.path))
    end
    return tool
  end)
  if not ok then tool = { _error = tostring(tool) } end
  tool.at = at
  made_tools[tool] = true
  return tool
end

local function tool_error(name, msg)
  local loc, rest = msg:match("^(.-:%d+): (.*)$")
  if not loc then error("tool " .. name .. ": " .. msg, 0) end
  error(loc .. ": tool " .. name .. ": " .. rest, 0)
end

local POLICY = {
  name = is_string, isolation = one_of("strict", "process"), timeouts = TIMEOUTS,
  limits = LIMITS, env = { path = is_string, allow = list_of_strings, deny = list_of_strings },
  mounts = function(v, at, field)
    is_table(v, at, field)
    for i, m in ipairs(v) do
      local f = field .. "[" .. i .. "]"
      if type(m) ~= "table" or type(m[1]) ~= "string" or type(m[2]) ~= "string" then
        fail_at(at, f, "expected { \"/host/path\", \"dest/in/root\", ro = bool }")
      end
      if m[1]:sub(1, 1) ~= "/" then fail_at(at, f, "the host path must be absolute") end
      if m[2]:sub(1, 1) == "/" or m[2]:find("%.%.") then
        fail_at(at, f, "the destination is relative to the session root, without ..")
      end
      for k in pairs(m) do
        if k ~= 1 and k ~= 2 and k ~= "ro" then fail_at(at, f, "unknown field %s", tostring(k)) end
      end
    end
    return v
  end,
  network = network, redact = redactors, tools = is_table,
}

function M.policy(t)
  local at = where(2)
  local p = check(t, POLICY, at, nil)
  for section, defaults in pairs(DEFAULTS) do
    p[section] = p[section] or {}
    for k, v in pairs(defaults) do
      if p[section][k] == nil then p[section][k] = v end
    end
  end
  p.name = p.name or "unnamed"
  p.isolation = p.isolation or "process"
  p.network = p.network or "none"
  -- A gate must never report a capability the runtime does not have: what the runtime
  -- would ignore or do differently is refused here, with the reason.
  if type(p.network) == "table" then
    fail(locate(at, "network"), "network = { allow = ... }: not implemented (there is no egress allowlist "
         .. "yet: the network would stay closed); use \"none\", or \"loopback\" under "
         .. "isolation = \"strict\"")
  end
  if p.isolation == "process" and p.network == "loopback" then
    fail(locate(at, "network"), "network = \"loopback\" needs isolation = \"strict\" (under process "
         .. "isolation a tool would share the host's whole network, not a loopback of its own)")
  end
  if p.isolation == "process" and p.mounts and next(p.mounts) ~= nil then
    fail(locate(at, "mounts"), "mounts need isolation = \"strict\" (process isolation has no mount "
         .. "namespace: they would be ignored)")
  end
  p.tools = p.tools or {}
  local names = {}
  for name in pairs(p.tools) do
    if type(name) ~= "string" or not name:match("^[%w_.-]+$") then
      fail(locate(at, "tools"), "tools: bad tool name %s", show(name))
    end
    names[#names + 1] = name
  end
  table.sort(names)
  for _, name in ipairs(names) do
    local tool = p.tools[name]
    if not made_tools[tool] then
      fail(locate(at, "tools." .. name), "tool %s: must be made with stockade.tool{}", name)
    end
    if tool._error then tool_error(name, tool._error) end
    if tool.timeout and tool.timeout > p.timeouts.call_max then
      tool_error(name, string.format("%s: timeout: %d ms is above timeouts.call_max (%d ms)",
                                     locate(tool.at, "timeout"), tool.timeout,
                                     p.timeouts.call_max))
    end
  end
  p.at = at
  return p
end

-- The field names the loader accepts, by section: docs/policy-reference.md is checked
-- against them (tests/lua/test_reference.lua), so the reference cannot drift.
local function names(spec)
  local out = {}
  for k in pairs(spec) do out[#out + 1] = k end
  table.sort(out)
  return out
end
M.fields = {
  policy = names(POLICY), timeouts = names(TIMEOUTS), limits = names(LIMITS),
  alarms = names(LIMITS.alarms), env = names(POLICY.env), tool = names(TOOL),
  tool_limits = names(TOOL_LIMITS), output = names(TOOL.output),
}

-- The module is shared by the policy and every plugin it requires: read-only all the
-- way down, so a plugin cannot swap stockade.paths_beneath or schema.validate for
-- everyone else. The proxy reads a snapshot no one else holds.
local function readonly(t)
  local shadow = {}
  for k, v in pairs(t) do
    shadow[k] = type(v) == "table" and readonly(v) or v
  end
  return setmetatable({}, {
    __index = shadow,
    __newindex = function(_, k)
      error("the stockade module is read-only (assignment to " .. tostring(k) .. ")", 2)
    end,
    __pairs = function() return next, shadow, nil end,
    __len = function() return #shadow end,
    __metatable = false,
  })
end

return readonly(M)
