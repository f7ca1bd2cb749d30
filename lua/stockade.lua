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
    if type(v) ~= t then fail(at, "%s: expected a %s, got %s", field, t, type(v)) end
    return v
  end
end
local is_string, is_table, is_function = kind("string"), kind("table"), kind("function")

local function is_count(v, at, field)
  if math.type(v) ~= "integer" or v < 0 then
    fail(at, "%s: expected a non-negative integer, got %s", field, tostring(v))
  end
  return v
end

local function is_duration(v, at, field)
  if type(v) ~= "string" then
    fail(at, "%s: expected a duration string such as \"30s\", got %s", field, type(v))
  end
  local ms, err = core.duration(v)
  if not ms then fail(at, "%s: %s", field, err) end
  return ms
end

local function is_size(v, at, field)
  if math.type(v) == "integer" and v >= 0 then return v end
  if type(v) ~= "string" then
    fail(at, "%s: expected a size such as \"1MiB\", got %s", field, type(v))
  end
  local n, err = core.size(v)
  if not n then fail(at, "%s: %s", field, err) end
  return n
end

local function one_of(...)
  local allowed = { ... }
  return function(v, at, field)
    for _, a in ipairs(allowed) do if v == a then return v end end
    fail(at, "%s: expected one of %s, got %s", field, table.concat(allowed, ", "), tostring(v))
  end
end

local function bool_or_function(v, at, field)
  if type(v) ~= "boolean" and type(v) ~= "function" then
    fail(at, "%s: expected a boolean or a function, got %s", field, type(v))
  end
  return v
end

local function list_of_strings(v, at, field)
  is_table(v, at, field)
  local out = {}
  for i, s in ipairs(v) do out[i] = is_string(s, at, field .. "[" .. i .. "]") end
  for k in pairs(v) do
    if math.type(k) ~= "integer" or k < 1 or k > #v then
      fail(at, "%s: expected a list, found key %s", field, tostring(k))
    end
  end
  return out
end

local function network(v, at, field)
  if v == "none" or v == "loopback" then return v end
  if type(v) == "table" then return v end
  fail(at, "%s: expected \"none\", \"loopback\" or { allow = {...} }, got %s", field, tostring(v))
end

-- Check `t` against `spec` (field -> checker or nested spec table); unknown keys fail.
local function check(t, spec, at, prefix)
  if type(t) ~= "table" then fail(at, "%s: expected a table, got %s", prefix, type(t)) end
  local out = {}
  for k, v in pairs(t) do
    local field = prefix and (prefix .. "." .. tostring(k)) or tostring(k)
    local checker = spec[k]
    if type(k) ~= "string" or checker == nil then fail(at, "unknown field %s", field) end
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
    memory = 512 * 1024 * 1024, address_space = 0, processes = 64, file_size = 1024 * 1024 * 1024,
    open_files = 256, output = 1024 * 1024, stdin = 1024 * 1024, argv = 64,
    disk = 2 * 1024 * 1024 * 1024, inodes = 100000,
    argv_bytes = 64 * 1024, sessions = 256, running = 64, depth = 4,
    lua_memory = 64 * 1024 * 1024, lua_instructions = 10000000,
    redact_hold = 1024 * 1024,
  },
  env = { path = "/usr/bin:/bin", allow = {}, deny = {} },
}

local TOOL = {
  path = is_string, owner = is_string, description = is_string, schema = is_table,
  timeout = is_duration, idempotent = bool_or_function, accept = is_function,
  argv = is_function, redact = function(v, at, field)
    if type(v) ~= "function" and type(v) ~= "table" then
      fail(at, "%s: expected a function or a redactor table, got %s", field, type(v))
    end
    return v
  end,
  raw_argv = kind("boolean"),
  classify = is_function, output = { format = one_of("text", "json"), schema = is_table,
                                     max_depth = is_count },
  probe = is_table,
  env = list_of_strings, limits = TOOL_LIMITS,
}

-- Tools made by stockade.tool{}: a private set, not a metatable anyone could reach.
local made_tools = setmetatable({}, { __mode = "k" })

function M.tool(t)
  local at = where(2)
  local tool = check(t, TOOL, at, nil)
  if tool.path == nil then fail(at, "tool: path is required") end
  if tool.path:sub(1, 1) ~= "/" then
    fail(at, "path: must be absolute (no PATH lookup), got %q", tool.path)
  end
  tool.at = at
  made_tools[tool] = true
  return tool
end

local POLICY = {
  name = is_string, isolation = one_of("strict", "process"), timeouts = TIMEOUTS,
  limits = LIMITS, env = { path = is_string, allow = list_of_strings, deny = list_of_strings },
  mounts = function(v, at, field)
    is_table(v, at, field)
    for i, m in ipairs(v) do
      local f = field .. "[" .. i .. "]"
      if type(m) ~= "table" or type(m[1]) ~= "string" or type(m[2]) ~= "string" then
        fail(at, "%s: expected { \"/host/path\", \"dest/in/root\", ro = bool }", f)
      end
      if m[1]:sub(1, 1) ~= "/" then fail(at, "%s: the host path must be absolute", f) end
      if m[2]:sub(1, 1) == "/" or m[2]:find("%.%.") then
        fail(at, "%s: the destination is relative to the session root, without ..", f)
      end
      for k in pairs(m) do
        if k ~= 1 and k ~= 2 and k ~= "ro" then fail(at, "%s: unknown field %s", f, tostring(k)) end
      end
    end
    return v
  end,
  network = network, redact = is_table, tools = is_table,
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
    fail(at, "network = { allow = ... }: not implemented (there is no egress allowlist "
         .. "yet: the network would stay closed); use \"none\", or \"loopback\" under "
         .. "isolation = \"strict\"")
  end
  if p.isolation == "process" and p.network == "loopback" then
    fail(at, "network = \"loopback\" needs isolation = \"strict\" (under process "
         .. "isolation a tool would share the host's whole network, not a loopback of its own)")
  end
  if p.isolation == "process" and p.mounts and next(p.mounts) ~= nil then
    fail(at, "mounts need isolation = \"strict\" (process isolation has no mount "
         .. "namespace: they would be ignored)")
  end
  p.tools = p.tools or {}
  for name, tool in pairs(p.tools) do
    if type(name) ~= "string" or not name:match("^[%w_.-]+$") then
      fail(at, "tools: bad tool name %s", tostring(name))
    end
    if not made_tools[tool] then
      fail(at, "tools.%s: must be made with stockade.tool{}", name)
    end
    if tool.timeout and tool.timeout > p.timeouts.call_max then
      fail(tool.at, "tools.%s.timeout: %d ms is above timeouts.call_max (%d ms)", name,
           tool.timeout, p.timeouts.call_max)
    end
  end
  p.at = at
  return p
end

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
