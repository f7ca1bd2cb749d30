-- gates.lua: the policy gates for CI, `stockade check|diff|dry-run|budget ARGS...`.
--
-- Run by core/testing.c (cli_gate) in a full Lua 5.4 state, with `stockade.testing`
-- preloaded, as  gates(command, args, self_exe)  and returns the exit status:
--
--   check [--json] [POLICY...]               0 all clean, 1 a problem (one line each)
--   diff OLD NEW [--json] [--fail-on-widen]  1 an added tool lacks schema/owner/timeout,
--                                            or (with --fail-on-widen) anything widened
--   dry-run [--json] [POLICY]                1 a probe wrote outside its root or failed
--   budget [POLICY] [--json]                 1 the fuse is not below idle_shutdown
--   (125 for a usage error, as every stockade subcommand)
--
-- Everything is read from the normalized policy (testing.load(path):describe()):
-- durations in ms, sizes in bytes, hooks as {kind = "function", where, source}. Problem
-- lines are "FILE:LINE: tool NAME: message" or "FILE:LINE: policy: message", the LINE
-- being the tool's stockade.tool{} call (its `at`) or, for policy-wide problems, the
-- line of the offending field when it can be found in the text, else stockade.policy{}.
local command, args, self = ...
args = args or {}
self = (self and self ~= "") and self or "stockade"

local testing = require "stockade.testing"

local EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 125

-- ---- small helpers ------------------------------------------------------------------

-- With --json the human lines are kept out of stdout (captured, then dropped): stdout
-- carries the one JSON document.
local capture
local function printf(fmt, ...)
  local s = string.format(fmt, ...)
  if capture then capture[#capture + 1] = s else io.stdout:write(s) end
end
local function eprintf(fmt, ...) io.stderr:write(string.format(fmt, ...)) end

local function q(s)                       -- a shell word
  return "'" .. tostring(s):gsub("'", "'\\''") .. "'"
end

local function sh(cmd)                    -- output, exit code
  local f = assert(io.popen(cmd, "r"))
  local out = f:read("a") or ""
  local _, how, code = f:close()
  if how == "signal" then code = 128 + (code or 0) end
  return out, code or 0
end

local function dirname(p)
  local d = p:match("^(.*)/[^/]*$")
  if d == nil then return "." end
  if d == "" then return "/" end
  return d
end

local function read_file(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local s = f:read("a")
  f:close()
  return s
end

local function sorted_keys(t)
  local keys = {}
  for k in pairs(t or {}) do keys[#keys + 1] = k end
  table.sort(keys, function(a, b)
    if type(a) == type(b) then return a < b end
    return type(a) == "number"
  end)
  return keys
end

local function is_list(t)
  if type(t) ~= "table" then return false end
  local n = 0
  for _ in pairs(t) do n = n + 1 end
  return n == #t
end

local function is_hook(v) return type(v) == "table" and v.kind == "function" end

-- Deep equality; hooks compare by source text (not by where they sit in the file).
local function same(a, b)
  if is_hook(a) and is_hook(b) then return a.source == b.source end
  if type(a) ~= "table" or type(b) ~= "table" then return a == b end
  for k, v in pairs(a) do if not same(v, b[k]) then return false end end
  for k in pairs(b) do if a[k] == nil then return false end end
  return true
end

local function fmt_ms(ms)
  if type(ms) ~= "number" then return tostring(ms) end
  if ms ~= 0 and ms % 60000 == 0 then return string.format("%dm", ms // 60000) end
  if ms ~= 0 and ms % 1000 == 0 then return string.format("%ds", ms // 1000) end
  return string.format("%dms", ms)
end

local function fmt_size(n)
  if type(n) ~= "number" then return tostring(n) end
  for _, u in ipairs { { 1 << 40, "TiB" }, { 1 << 30, "GiB" }, { 1 << 20, "MiB" },
                       { 1 << 10, "KiB" } } do
    if n ~= 0 and n % u[1] == 0 then return string.format("%d%s", n // u[1], u[2]) end
  end
  return string.format("%d", n)
end

local SIZE_LIMITS = { memory = true, file_size = true, output = true, stdin = true,
                      argv_bytes = true, lua_memory = true }

local function fmt_limit(k, v) return SIZE_LIMITS[k] and fmt_size(v) or tostring(v) end

-- JSON: an encoder with sorted keys (stable output), and a decoder for `run --json`.
local json = {}
local ARRAY = {}
local function array(t) return setmetatable(t or {}, ARRAY) end

local function json_str(s)
  return '"' .. s:gsub('[%c"\\]', function(c)
    local named = { ['"'] = '\\"', ["\\"] = "\\\\", ["\n"] = "\\n", ["\t"] = "\\t",
                    ["\r"] = "\\r", ["\b"] = "\\b", ["\f"] = "\\f" }
    return named[c] or string.format("\\u%04x", c:byte())
  end) .. '"'
end

function json.encode(v, indent, pad)
  pad = pad or ""
  local t = type(v)
  if v == nil then return "null" end
  if t == "boolean" then return tostring(v) end
  if t == "number" then
    if math.type(v) == "integer" then return string.format("%d", v) end
    if v ~= v or v == math.huge or v == -math.huge then return "null" end
    return string.format("%.17g", v)
  end
  if t == "string" then return json_str(v) end
  if t ~= "table" then return json_str(tostring(v)) end
  local inner = indent and (pad .. indent) or ""
  local nl = indent and "\n" or ""
  local sep = indent and ": " or ":"
  local parts = {}
  if getmetatable(v) == ARRAY or (#v > 0 and is_list(v)) then
    for _, x in ipairs(v) do parts[#parts + 1] = inner .. json.encode(x, indent, inner) end
    if #parts == 0 then return "[]" end
    return "[" .. nl .. table.concat(parts, "," .. nl) .. nl .. (indent and pad or "") .. "]"
  end
  for _, k in ipairs(sorted_keys(v)) do
    parts[#parts + 1] = inner .. json_str(tostring(k)) .. sep .. json.encode(v[k], indent, inner)
  end
  if #parts == 0 then return "{}" end
  return "{" .. nl .. table.concat(parts, "," .. nl) .. nl .. (indent and pad or "") .. "}"
end

-- Decoding is lua-cjson's (linked into the binary, preloaded for the gates); JSON null
-- becomes nil, as the encoder above writes nil.
local cjson = require "cjson"
local function denull(v)
  if v == cjson.null then return nil end
  if type(v) == "table" then
    for k, x in pairs(v) do v[k] = denull(x) end
  end
  return v
end

function json.decode(s)
  local ok, v = pcall(cjson.decode, s)
  if not ok then return nil, v end
  return denull(v)
end

-- An aligned table: rows of strings, the first row the header.
local function print_table(rows, indent)
  local widths = {}
  for _, r in ipairs(rows) do
    for c, cell in ipairs(r) do widths[c] = math.max(widths[c] or 0, utf8.len(cell) or #cell) end
  end
  for _, r in ipairs(rows) do
    local cells = {}
    for c, cell in ipairs(r) do
      cells[c] = c < #r and cell .. string.rep(" ", widths[c] - (utf8.len(cell) or #cell)) or cell
    end
    printf("%s%s\n", indent or "", (table.concat(cells, "  "):gsub("%s+$", "")))
  end
end

-- A deny glob ("*_TOKEN", "AWS_*"; only "*" is special) as an anchored Lua pattern.
local function glob_pattern(glob)
  local parts = {}
  for piece in (glob .. "*"):gmatch("([^*]*)%*") do
    parts[#parts + 1] = piece:gsub("[%^%$%(%)%%%.%[%]%*%+%-%?]", "%%%0")
  end
  return "^" .. table.concat(parts, ".*") .. "$"
end

local function default_policy()
  local env = os.getenv("STOCKADE_POLICY")
  if env and env ~= "" then return env end
  return "/etc/stockade/policy.lua"
end

-- Support files beside the binary (a build tree: ./stockade next to lua/ and plugins/),
-- else the installed set.
local function support_file(rel)
  for _, base in ipairs { dirname(self), "/usr/share/stockade", "/usr/local/share/stockade" } do
    local p = base .. "/" .. rel
    if read_file(p) then return p end
  end
end

local schema_mod, schema_err
local function schema_checker()
  if schema_mod ~= nil or schema_err then return schema_mod end
  local ok, m = pcall(require, "stockade.schema")
  if ok and type(m) == "table" and m.check_schema then schema_mod = m; return m end
  local path = support_file("lua/schema.lua")
  if path then
    local ok2, m2 = pcall(dofile, path)
    if ok2 and type(m2) == "table" and m2.check_schema then schema_mod = m2; return m2 end
    schema_err = path .. ": " .. tostring(m2)
  else
    schema_err = "lua/schema.lua not found beside " .. self .. " nor in /usr/share/stockade"
  end
  return nil
end

local secret_patterns, secrets_err
local function secret_set(policy_file)
  if secret_patterns or secrets_err then return secret_patterns end
  local ok0, built_in = pcall(require, "plugins.secrets")   -- a file on the path, or built in
  if ok0 and type(built_in) == "table" and type(built_in.default) == "table" then
    secret_patterns = built_in.default
    return secret_patterns
  end
  local path = support_file("plugins/secrets.lua")
  if not path and policy_file then
    for _, p in ipairs { dirname(policy_file) .. "/../plugins/secrets.lua",
                         dirname(policy_file) .. "/plugins/secrets.lua" } do
      if read_file(p) then path = p; break end
    end
  end
  if not path then
    secrets_err = "plugins/secrets.lua not found beside " .. self .. " nor in /usr/share/stockade"
    return nil
  end
  local ok, m = pcall(dofile, path)
  if not ok or type(m) ~= "table" or type(m.default) ~= "table" then
    secrets_err = path .. ": " .. tostring(m)
    return nil
  end
  secret_patterns = m.default
  return secret_patterns
end

-- Load and describe a policy; nil and the loader's message when it does not load.
local function load_policy(path)
  local ok, p = pcall(testing.load, path)
  if not ok then return nil, tostring(p) end
  local ok2, d = pcall(p.describe, p)
  if not ok2 then return nil, tostring(d) end
  d.tools = d.tools or {}
  d.timeouts = d.timeouts or {}
  d.limits = d.limits or {}
  d.env = d.env or {}
  d.file = d.file or path
  return p, d
end

local function line_of(text, pattern, plain)
  if not text then return nil end
  local s = text:find(pattern, 1, plain)
  if not s then return nil end
  local _, n = text:sub(1, s):gsub("\n", "")
  return n + 1
end

local function at_line(at) return tonumber((at or ""):match(":(%d+)$")) end

-- ---- check --------------------------------------------------------------------------

-- stat -L of several paths: path -> {mode, uid, type}; a missing path is absent.
local function stat_paths(paths)
  local out = {}
  if #paths == 0 then return out end
  local words = {}
  for i, p in ipairs(paths) do words[i] = q(p) end
  local text = sh("stat -L -c '%a %u %F|%n' -- " .. table.concat(words, " ") .. " 2>/dev/null")
  for line in text:gmatch("[^\n]+") do
    local mode, uid, ftype, name = line:match("^(%d+) (%d+) ([^|]*)|(.*)$")
    if mode then
      out[name] = { mode = tonumber(mode, 8), uid = tonumber(uid), type = ftype }
    end
  end
  return out
end

local function realpath(p)
  local out, code = sh("readlink -f -- " .. q(p) .. " 2>/dev/null")
  out = out:gsub("\n$", "")
  if code ~= 0 or out == "" then return nil end
  return out
end

local function ancestors(p, into, seen)
  local d = dirname(p)
  while true do
    if not seen[d] then seen[d] = true; into[#into + 1] = d end
    if d == "/" then break end
    d = dirname(d)
  end
end

-- Is the binary safe from the tool uid: executable by it, not replaceable by it?
local function check_binary(path, problem)
  if path:sub(1, 1) ~= "/" then
    problem("path %q is not absolute", path)
    return
  end
  local real = realpath(path)
  local dirs, seen = {}, {}
  ancestors(path, dirs, seen)
  if real and real ~= path then ancestors(real, dirs, seen) end
  local list = { path }
  if real and real ~= path then list[2] = real end
  for _, d in ipairs(dirs) do list[#list + 1] = d end
  local st = stat_paths(list)
  local f = st[path]
  if not f then
    problem("path %s does not exist", path)
    return
  end
  local shown = (real and real ~= path) and (path .. " (" .. real .. ")") or path
  if not f.type:find("regular", 1, true) then
    problem("path %s is a %s, not an executable file", shown, f.type)
    return
  end
  if f.mode & 1 == 0 then
    problem("path %s is not executable by the tool's uid (mode %04o)", shown, f.mode & 4095)
  end
  if f.mode & 18 ~= 0 then
    problem("path %s is writable by %s (mode %04o): the tool could replace it", shown,
            f.mode & 2 ~= 0 and "others" or "its group", f.mode & 4095)
  end
  if f.uid ~= 0 then
    problem("path %s is owned by uid %d, not root: that user can replace it", shown, f.uid)
  end
  for _, d in ipairs(dirs) do
    local s = st[d]
    if s then
      local sticky = s.mode & 512 ~= 0
      if s.mode & 18 ~= 0 and not sticky then
        problem("directory %s of path %s is writable by %s (mode %04o): the binary can be replaced",
                d, path, s.mode & 2 ~= 0 and "others" or "its group", s.mode & 4095)
      end
      if s.uid ~= 0 then
        problem("directory %s of path %s is owned by uid %d, not root: the binary can be replaced",
                d, path, s.uid)
      end
    end
  end
end

local function state_dirs()
  local dirs = {}
  local env = os.getenv("STOCKADE_STATE_DIR")
  if env and env ~= "" then dirs[#dirs + 1] = env end
  dirs[#dirs + 1] = "/var/lib/stockade"
  local xdg = os.getenv("XDG_RUNTIME_DIR")
  if xdg and xdg ~= "" then dirs[#dirs + 1] = xdg .. "/stockade" end
  return dirs
end

local function inside(path, dir)
  dir = dir:gsub("/+$", "")
  return path == dir or path:sub(1, #dir + 1) == dir .. "/"
end

-- check is a list of rules over one loaded policy. A policy rule gets the context c
-- (c.d: the description, c.text: the file's text, c.policy_problem(line, fmt, ...),
-- c.tline(key): the line of `key =`); a tool rule also gets the tool's name and table,
-- and reports with c.tool_problem(name, fmt, ...) at the tool's line.

-- timeouts: call <= call_max <= fuse < idle_shutdown, grace < call
local function rule_timeouts(c)
  local T = c.d.timeouts
  if T.call and T.call_max and T.call > T.call_max then
    c.policy_problem(c.tline("call"), "timeouts.call %s is above timeouts.call_max %s",
                     fmt_ms(T.call), fmt_ms(T.call_max))
  end
  if T.call_max and T.fuse and T.call_max > T.fuse then
    c.policy_problem(c.tline("call_max"), "timeouts.call_max %s is above timeouts.fuse %s: one "
                     .. "call could outlast the session", fmt_ms(T.call_max), fmt_ms(T.fuse))
  end
  if T.fuse and T.idle_shutdown and T.fuse >= T.idle_shutdown then
    c.policy_problem(c.tline("fuse"), "timeouts.fuse %s is not below timeouts.idle_shutdown %s",
                     fmt_ms(T.fuse), fmt_ms(T.idle_shutdown))
  end
  if T.grace and T.call and T.grace >= T.call then
    c.policy_problem(c.tline("grace"), "timeouts.grace %s is not below timeouts.call %s",
                     fmt_ms(T.grace), fmt_ms(T.call))
  end
end

-- env: an allowed name that a deny glob refuses anyway is a contradiction
local function contradictions(deny, names, report)
  for _, name in ipairs(names or {}) do
    for _, g in ipairs(deny or {}) do
      if tostring(name):find(glob_pattern(g)) then report(name, g); break end
    end
  end
end

local function rule_env(c)
  contradictions(c.d.env.deny, c.d.env.allow, function(name, g)
    c.policy_problem(line_of(c.text, '"' .. name .. '"', true) or c.tline("allow"),
                     "env.allow %s matches the deny glob %s: it is always refused", name, g)
  end)
end

-- mounts: { "/host/path", "target", ro = bool }; the host path exists and is no
-- session's root
local function rule_mounts(c)
  local d = c.d
  if d.mounts == nil then return end
  if type(d.mounts) ~= "table" then
    c.policy_problem(c.tline("mounts"), "mounts: expected a list of { HOST, TARGET, ro = bool }")
    return
  end
  for i, m in ipairs(d.mounts) do
    local host = type(m) == "table" and m[1]
    local line = type(host) == "string" and line_of(c.text, '"' .. host .. '"', true)
                 or c.tline("mounts")
    if type(m) ~= "table" or type(m[1]) ~= "string" or type(m[2]) ~= "string" then
      c.policy_problem(line, "mounts[%d]: expected { \"/host/path\", \"target\", ro = bool }", i)
    else
      local target = m[2]
      if host:sub(1, 1) ~= "/" then
        c.policy_problem(line, "mounts[%d]: host path %s is not absolute", i, host)
      end
      if target:sub(1, 1) == "/" or ("/" .. target .. "/"):find("/%.%./") then
        c.policy_problem(line, "mounts[%d]: target %s must be relative to the session root "
                         .. "without ..", i, target)
      end
      if m.ro ~= nil and type(m.ro) ~= "boolean" then
        c.policy_problem(line, "mounts[%d]: ro must be a boolean", i)
      end
      local real = realpath(host)
      if not stat_paths({ host })[host] then
        c.policy_problem(line, "mounts[%d]: host path %s does not exist", i, host)
      end
      for _, sd in ipairs(state_dirs()) do
        local roots = sd:gsub("/+$", "") .. "/sessions"
        if inside(host, roots) or (real and inside(real, roots)) then
          c.policy_problem(line, "mounts[%d]: host path %s is inside a session root (%s/...)",
                           i, host, roots)
          break
        end
      end
    end
  end
end

-- secret-looking literals in the policy text: the set's regex redactors, run by the
-- core's engine as on a tool's output
local function rule_secrets(c)
  local text = c.text
  local pats = secret_set(c.file)
  if not pats then
    eprintf("stockade check: warning: %s; secret literals not checked\n", secrets_err)
    return
  end
  if not text then return end
  local hits, why = testing.find_secrets(pats, text)
  if not hits then
    eprintf("stockade check: warning: the secret set does not compile: %s\n", why)
    hits = {}
  end
  local found = {}
  for _, h in ipairs(hits) do
    local _, nl = text:sub(1, h.first):gsub("\n", "")
    local line = nl + 1
    if not found[line] then
      found[line] = true
      local col = h.first - ((text:sub(1, h.first):match(".*\n()") or 1)) + 1
      c.policy_problem(line, "a secret-looking literal (%s) at column %d: keep secrets out "
                       .. "of the policy (env or a secret store)", h.name or "secret", col)
    end
  end
end

local function rule_tool_basics(c, name, t)
  if type(t.path) ~= "string" or t.path == "" then
    c.tool_problem(name, "no path")
  else
    check_binary(t.path, function(fmt, ...) c.tool_problem(name, fmt, ...) end)
  end
  if type(t.owner) ~= "string" or t.owner == "" then c.tool_problem(name, "no owner") end
end

local function rule_tool_schemas(c, name, t)
  if type(t.schema) ~= "table" then
    c.tool_problem(name, "no schema")
  elseif c.schemas then
    local ok, msg = c.schemas.check_schema(t.schema)
    if not ok then c.tool_problem(name, "schema is not valid JSON Schema: %s", tostring(msg)) end
  end
  if type(t.output) == "table" and type(t.output.schema) == "table" and c.schemas then
    local ok, msg = c.schemas.check_schema(t.output.schema)
    if not ok then
      c.tool_problem(name, "output.schema is not valid JSON Schema: %s", tostring(msg))
    end
  end
end

local function rule_tool_timeout(c, name, t)
  local T = c.d.timeouts
  if type(t.timeout) ~= "number" then
    c.tool_problem(name, "no timeout (timeouts.call %s would apply)", fmt_ms(T.call))
    return
  end
  if T.call_max and t.timeout > T.call_max then
    c.tool_problem(name, "timeout %s is above timeouts.call_max %s", fmt_ms(t.timeout),
                   fmt_ms(T.call_max))
  end
  if T.grace and T.grace >= t.timeout then
    c.tool_problem(name, "timeouts.grace %s is not below the tool's timeout %s",
                   fmt_ms(T.grace), fmt_ms(t.timeout))
  end
end

local function rule_tool_env(c, name, t)
  contradictions(c.d.env.deny, t.env, function(n, g)
    c.tool_problem(name, "env allows %s but the deny glob %s refuses it", n, g)
  end)
end

local function rule_tool_probe(c, name, t)
  local pr = t.probe
  if pr == nil then return end
  local argv_ok = type(pr.argv) == "table" and is_list(pr.argv)
  if argv_ok then
    for _, a in ipairs(pr.argv) do if type(a) ~= "string" then argv_ok = false end end
  end
  if (pr.argv ~= nil) == (pr.args ~= nil) or (pr.argv ~= nil and not argv_ok)
     or (pr.args ~= nil and type(pr.args) ~= "table") then
    c.tool_problem(name, "probe: expected { argv = { \"ARG\", ... } } or { args = {...} }")
    return
  end
  local ok, r = pcall(c.p.decide, c.p, name, pr.argv or pr.args)
  if not ok then
    c.tool_problem(name, "probe: %s", tostring(r))
  elseif r.class ~= "OK" then
    c.tool_problem(name, "probe is refused by the policy: %s: %s", r.class, tostring(r.message))
  end
end

-- Every hook once, on a neutral input: a hook that raises (a typo, a wrong type) is
-- reported at its own line, where at run time it would fall back silently to its
-- default. accept and idempotent run through a decision on an empty argv (or the
-- probe's args when the tool builds its argv from args); refusing it is fine, raising
-- is not.
local NEUTRAL_RESULT = { exit_code = 1, stdout_tail = "", stderr_tail = "error\n",
                         duration_ms = 1 }
local function rule_tool_hooks(c, name, t)
  local function report(hook, err)
    local h = t[hook]
    local at = is_hook(h) and h.where or t.at
    c.problems[#c.problems + 1] = string.format("%s: tool %s: hook %s: %s", at, name, hook,
                                                tostring(err):gsub("\n.*", ""))
  end
  local input
  if not is_hook(t.argv) or t.raw_argv then
    input = {}
  elseif type(t.probe) == "table" and type(t.probe.args) == "table" then
    input = t.probe.args
  end
  if input and (is_hook(t.accept) or is_hook(t.idempotent) or is_hook(t.argv)) then
    local ok, r = pcall(c.p.decide, c.p, name, input)
    if ok and r.error then
      local hook = is_hook(t.accept) and "accept" or is_hook(t.argv) and "argv" or "idempotent"
      report(hook, r.error)
    end
  end
  if is_hook(t.classify) then
    local ok, class, err = pcall(c.p.classify, c.p, name, NEUTRAL_RESULT)
    if ok and class == nil and err then report("classify", err) end
  end
  if t.redact ~= nil then
    local ok, _, _, err = pcall(c.p.redact, c.p, name, "a neutral line of output\n")
    if ok and err then report("redact", err) end
  end
end

local POLICY_RULES = { rule_timeouts, rule_env, rule_mounts, rule_secrets }
local TOOL_RULES = { rule_tool_basics, rule_tool_schemas, rule_tool_timeout, rule_tool_env,
                     rule_tool_probe, rule_tool_hooks }

local function check_policy(path)
  local p, d = load_policy(path)
  if not p then
    printf("%s\n", d)
    return EXIT_FAIL, { d }, 0
  end
  local file = d.file
  local text = read_file(file)
  local policy_line = at_line(d.at) or 1
  local problems = {}
  local c = { p = p, d = d, file = file, text = text, problems = problems }
  function c.policy_problem(line, fmt, ...)
    problems[#problems + 1] = string.format("%s:%d: policy: " .. fmt, file, line or policy_line,
                                            ...)
  end
  function c.tline(key)
    return line_of(text, "%f[%w_]" .. key .. "%s*=") or policy_line
  end
  function c.tool_problem(name, fmt, ...)
    local at = d.tools[name].at or (file .. ":" .. policy_line)
    problems[#problems + 1] = string.format("%s: tool %s: " .. fmt, at, name, ...)
  end
  for _, rule in ipairs(POLICY_RULES) do rule(c) end
  c.schemas = schema_checker()
  if not c.schemas then
    eprintf("stockade check: warning: %s; schemas checked for presence only\n", schema_err)
  end
  local names = sorted_keys(d.tools)
  for _, name in ipairs(names) do
    for _, rule in ipairs(TOOL_RULES) do rule(c, name, d.tools[name]) end
  end

  for _, line in ipairs(problems) do printf("%s\n", line) end
  if #problems > 0 then
    eprintf("%s: %d tool%s, %d problem%s\n", file, #names, #names == 1 and "" or "s",
            #problems, #problems == 1 and "" or "s")
    return EXIT_FAIL, problems, #names
  end
  printf("%s: %d tool%s, OK\n", file, #names, #names == 1 and "" or "s")
  return EXIT_OK, problems, #names
end

local POLICY_DEFAULT_HELP = "POLICY defaults to $STOCKADE_POLICY, else /etc/stockade/policy.lua.\n"

local function cmd_check(argv)
  local files, as_json = {}, false
  for _, a in ipairs(argv) do
    if a == "-h" or a == "--help" then
      printf("usage: stockade check [--json] [POLICY...]\n"
             .. "Problems in each policy, one line each: FILE:LINE: what.\n"
             .. "  --json   one JSON document on stdout: {ok, files: [{file, ok, tools, problems}]}\n"
             .. POLICY_DEFAULT_HELP
             .. "Exit status: 0 clean, 1 a problem, 125 usage error.\n")
      return EXIT_OK
    elseif a == "--json" then
      as_json = true
    elseif a:sub(1, 1) == "-" then
      eprintf("stockade check: unknown option %s (--help for the options)\n", a)
      return EXIT_USAGE
    else
      files[#files + 1] = a
    end
  end
  if #files == 0 then files[1] = default_policy() end
  local status, report = EXIT_OK, {}
  if as_json then capture = {} end
  for _, f in ipairs(files) do
    local st, problems, ntools = check_policy(f)
    if st ~= EXIT_OK then status = EXIT_FAIL end
    report[#report + 1] = { file = f, ok = st == EXIT_OK, tools = ntools,
                            problems = array(problems) }
  end
  if as_json then
    capture = nil
    printf("%s\n", json.encode({ ok = status == EXIT_OK, files = report }))
  end
  return status
end

-- ---- diff ---------------------------------------------------------------------------

local function short(v, max)
  max = max or 40
  local s
  if v == nil then
    s = "-"
  elseif is_hook(v) then
    s = "function " .. tostring(v.where):gsub("^.*/", "")
  elseif type(v) == "table" then
    s = json.encode(v)
  else
    s = tostring(v)
  end
  s = s:gsub("%s+", " ")
  if utf8.len(s) and utf8.len(s) > max then
    s = s:sub(1, utf8.offset(s, max - 2) - 1) .. "..."
  end
  return s
end

local function json_value(v)                    -- hooks as their location and source
  if is_hook(v) then return { ["function"] = v.where, source = v.source } end
  return v
end

local NETWORK_RANK = { none = 0, loopback = 1 }
local function network_rank(n)
  if type(n) == "table" then return 2 end
  return NETWORK_RANK[n] or 0
end
local function network_str(n)
  if type(n) == "table" then
    local allow = {}
    for _, a in ipairs(n.allow or {}) do allow[#allow + 1] = tostring(a) end
    return "allow " .. (#allow > 0 and table.concat(allow, ",") or "(nothing)")
  end
  return tostring(n)
end

local function set_of(list)
  local s = {}
  for _, x in ipairs(list or {}) do s[tostring(x)] = true end
  return s
end

local function redactor_names(r, out)
  out = out or {}
  if type(r) ~= "table" then return out end
  if is_hook(r) then
    out[#out + 1] = "function:" .. tostring(r.source)
  elseif type(r.pattern) == "string" or type(r.regex) == "string" then
    out[#out + 1] = (r.name or "?") .. ":" .. (r.pattern or r.regex)
  else
    for _, x in ipairs(r) do redactor_names(x, out) end
  end
  return out
end

local function mounts_by_target(ms)
  local out = {}
  for _, m in ipairs(type(ms) == "table" and ms or {}) do
    if type(m) == "table" and m[2] ~= nil then out[tostring(m[2])] = m end
  end
  return out
end

-- The registry's diff, in three steps: diff (what changed, and which changes widen what
-- the agent may do), verdict (the exit status), render (a table or JSON).
local function new_diff()
  local d = { changes = {}, added = {}, removed = {}, problems = {}, widened = {} }
  -- o, n: what the table shows; raw_o, raw_n (when given): what the JSON carries
  function d.change(scope, field, o, n, why, raw_o, raw_n)
    local c = { scope = scope, field = field, old = o, new = n, widens = why ~= nil, why = why,
                old_value = raw_o, new_value = raw_n }
    d.changes[#d.changes + 1] = c
    if why then d.widened[#d.widened + 1] = { scope = scope, field = field, why = why } end
    return c
  end
  return d
end

-- Every key of two maps whose value differs, as a change of FIELD.KEY shown by fmt(k, v);
-- it widens (why) where both values are numbers and the new one is larger, unless the
-- key is in `exempt`.
local function diff_numbers(d, scope, field, old_map, new_map, fmt, why, exempt)
  local keys = {}
  for k in pairs(old_map) do keys[k] = true end
  for k in pairs(new_map) do keys[k] = true end
  for _, k in ipairs(sorted_keys(keys)) do
    local a, b = old_map[k], new_map[k]
    if not same(a, b) then
      local widens = type(a) == "number" and type(b) == "number" and b > a
                     and not (exempt and exempt[k])
      d.change(scope, field .. "." .. k, a and fmt(k, a), b and fmt(k, b), widens and why or nil,
               a, b)
    end
  end
end

-- The names two lists hold, added and removed, one change each; why_added / why_removed
-- say which of the two widens.
local function diff_set(d, scope, field, old_list, new_list, why_added, why_removed)
  local o, n = set_of(old_list), set_of(new_list)
  for _, e in ipairs(sorted_keys(n)) do
    if not o[e] then d.change(scope, field, nil, e, why_added) end
  end
  for _, e in ipairs(sorted_keys(o)) do
    if not n[e] then d.change(scope, field, e, nil, why_removed) end
  end
end

-- Tools added (each widens; one without a schema, an owner or a timeout is a problem)
-- and removed.
local function diff_tool_set(old, new, d)
  for _, name in ipairs(sorted_keys(new.tools)) do
    local t = new.tools[name]
    if old.tools[name] == nil then
      local missing = {}
      for _, f in ipairs { "schema", "owner", "timeout" } do
        if t[f] == nil or t[f] == "" then missing[#missing + 1] = f end
      end
      d.added[#d.added + 1] = { tool = name, path = t.path, owner = t.owner, timeout = t.timeout,
                                at = t.at, missing = array(missing) }
      d.widened[#d.widened + 1] = { scope = "tool " .. name, field = "(tool)", why = "new tool" }
      for _, f in ipairs(missing) do
        d.problems[#d.problems + 1] = string.format("%s: tool %s: added without %s %s",
                                                    t.at or new.file, name,
                                                    f == "owner" and "an" or "a", f)
      end
    end
  end
  for _, name in ipairs(sorted_keys(old.tools)) do
    if new.tools[name] == nil then d.removed[#d.removed + 1] = name end
  end
end

-- Why a change of a tool's field F from ov to nv widens, or nil.
local function tool_field_widens(f, ov, nv)
  if f == "accept" then
    return nv == nil and "accept hook removed" or (ov ~= nil and "accept hook changed" or nil)
  elseif f == "redact" then
    return nv == nil and "redaction removed" or (ov ~= nil and "redaction changed" or nil)
  elseif f == "path" then
    return "runs a different binary"
  elseif f == "schema" and nv == nil then
    return "schema removed"
  end
end

-- The fields of a tool both policies have. Its timeout and limits fall back to the
-- policy's, which the table shows.
local function diff_tool(old, new, d, name)
  local o, n = old.tools[name], new.tools[name]
  local scope = "tool " .. name
  local fields = {}
  for k in pairs(o) do fields[k] = true end
  for k in pairs(n) do fields[k] = true end
  fields.at = nil
  for _, f in ipairs(sorted_keys(fields)) do
    local ov, nv = o[f], n[f]
    if f == "timeout" then
      local OT, NT = old.timeouts, new.timeouts
      local oe, ne = ov or OT.call, nv or NT.call
      if not same(ov, nv) then
        d.change(scope, "timeout",
                 ov and fmt_ms(ov) or (fmt_ms(OT.call) .. " (timeouts.call)"),
                 nv and fmt_ms(nv) or (fmt_ms(NT.call) .. " (timeouts.call)"),
                 (oe and ne and ne > oe) and "longer timeout" or nil, oe, ne)
      end
    elseif f == "limits" then
      local keys = {}
      for k in pairs(type(ov) == "table" and ov or {}) do keys[k] = true end
      for k in pairs(type(nv) == "table" and nv or {}) do keys[k] = true end
      for _, k in ipairs(sorted_keys(keys)) do
        local a = (ov or {})[k] or old.limits[k]
        local b = (nv or {})[k] or new.limits[k]
        if not same((ov or {})[k], (nv or {})[k]) then
          d.change(scope, "limits." .. k, a and fmt_limit(k, a), b and fmt_limit(k, b),
                   (type(a) == "number" and type(b) == "number" and b > a) and "larger limit"
                   or nil, a, b)
        end
      end
    elseif f == "env" then
      diff_set(d, scope, "env", ov, nv, "env allow name added", nil)
    elseif not same(ov, nv) then
      d.change(scope, f, ov, nv, tool_field_widens(f, ov, nv), ov, nv)
    end
  end
end

local function diff_tools(old, new, d)
  diff_tool_set(old, new, d)
  for _, name in ipairs(sorted_keys(new.tools)) do
    if old.tools[name] then diff_tool(old, new, d, name) end
  end
end

-- Policy-wide fields, one function each, in the order the changes are listed.
local P = "policy"

local function diff_identity(old, new, d)
  if old.name ~= new.name then d.change(P, "name", old.name, new.name) end
  if old.isolation ~= new.isolation then
    d.change(P, "isolation", old.isolation, new.isolation,
             (old.isolation == "strict" and new.isolation ~= "strict") and "isolation weakened"
             or nil)
  end
end

local function diff_timeouts(old, new, d)
  diff_numbers(d, P, "timeouts", old.timeouts, new.timeouts, function(_, v) return fmt_ms(v) end,
               "longer timeout", { deadline_min = true })
end

local function diff_limits(old, new, d)
  diff_numbers(d, P, "limits", old.limits, new.limits, fmt_limit, "larger limit")
end

local function diff_env(old, new, d)
  if old.env.path ~= new.env.path then
    local had = {}
    for dir in tostring(old.env.path or ""):gmatch("[^:]+") do had[dir] = true end
    local more
    for dir in tostring(new.env.path or ""):gmatch("[^:]+") do
      if not had[dir] then more = true end
    end
    d.change(P, "env.path", old.env.path, new.env.path, more and "PATH directory added" or nil)
  end
  diff_set(d, P, "env.allow", old.env.allow, new.env.allow, "env allow name added", nil)
  diff_set(d, P, "env.deny", old.env.deny, new.env.deny, nil, "env deny glob removed")
end

local function mount_desc(m)
  return m and string.format("%s -> %s (%s)", tostring(m[1]), tostring(m[2]), m.ro and "ro" or "rw")
end
local function mount_json(m) return m and { host = m[1], target = m[2], ro = m.ro == true } end

local function diff_mounts(old, new, d)
  local om, nm = mounts_by_target(old.mounts), mounts_by_target(new.mounts)
  for _, target in ipairs(sorted_keys(nm)) do
    local a, b = om[target], nm[target]
    if not a then
      d.change(P, "mounts", nil, mount_desc(b),
               b.ro and "new read-only mount" or "new writable mount", nil, mount_json(b))
    elseif not same(a, b) then
      local why
      if a.ro and not b.ro then why = "mount made writable"
      elseif a[1] ~= b[1] then why = "mount source changed" end
      d.change(P, "mounts", mount_desc(a), mount_desc(b), why, mount_json(a), mount_json(b))
    end
  end
  for _, target in ipairs(sorted_keys(om)) do
    if not nm[target] then
      d.change(P, "mounts", mount_desc(om[target]), nil, nil, mount_json(om[target]))
    end
  end
end

local function diff_network(old, new, d)
  if not same(old.network, new.network) then
    local why = network_rank(new.network) > network_rank(old.network) and "network opened" or nil
    d.change(P, "network", network_str(old.network), network_str(new.network), why, old.network,
             new.network)
  end
end

local function diff_redact(old, new, d)
  if same(old.redact, new.redact) then return end
  local on, nn = redactor_names(old.redact), redactor_names(new.redact)
  local have = set_of(nn)
  local lost = {}
  for _, r in ipairs(on) do if not have[r] then lost[#lost + 1] = r:match("^[^:]*") end end
  local function count(n) return string.format("%d redactor%s", n, n == 1 and "" or "s") end
  d.change(P, "redact", count(#on), count(#nn),
           #lost > 0 and ("redactor removed: " .. table.concat(lost, ", ")) or nil, #on, #nn)
end

local POLICY_DIFFS = { diff_identity, diff_timeouts, diff_limits, diff_env, diff_mounts,
                       diff_network, diff_redact }

local function diff_policies(old, new)
  local d = new_diff()
  diff_tools(old, new, d)
  for _, diff in ipairs(POLICY_DIFFS) do diff(old, new, d) end
  return d
end

-- The status: problems (an added tool lacking schema, owner or timeout) fail; widenings
-- fail only when asked to.
local function diff_verdict(d, fail_on_widen)
  if #d.problems > 0 or (fail_on_widen and #d.widened > 0) then return EXIT_FAIL end
  return EXIT_OK
end

local function render_diff_json(old, new, d, status)
  local jchanges = array()
  for _, c in ipairs(d.changes) do
    jchanges[#jchanges + 1] = { scope = c.scope, field = c.field,
                                old = json_value(c.old_value == nil and c.old or c.old_value),
                                new = json_value(c.new_value == nil and c.new or c.new_value),
                                widens = c.widens, why = c.why }
  end
  local jadded = array()
  for _, a in ipairs(d.added) do jadded[#jadded + 1] = a end
  local jw = array()
  for _, w in ipairs(d.widened) do jw[#jw + 1] = w end
  printf("%s\n", json.encode({
    old = old.file, new = new.file, old_sha256 = old.sha256, new_sha256 = new.sha256,
    added = jadded, removed = array(d.removed), changed = jchanges, widened = jw,
    problems = array(d.problems), status = status,
  }, "  "))
end

local function render_diff_table(old, new, d)
  local changes, added, removed, problems, widened = d.changes, d.added, d.removed, d.problems,
                                                     d.widened
  printf("--- %s\n+++ %s\n", old.file, new.file)
  if #added + #removed + #changes == 0 then
    printf("no change\n")
    return
  end
  local rows = { { "", "SCOPE", "FIELD", "OLD", "NEW", "NOTE" } }
  for _, a in ipairs(added) do
    local note = "WIDENS: new tool"
    if #a.missing > 0 then note = note .. "; MISSING " .. table.concat(a.missing, ", ") end
    rows[#rows + 1] = { "+", "tool " .. a.tool, "(added)", "-",
                        short(a.path) .. (a.timeout and (" " .. fmt_ms(a.timeout)) or ""), note }
  end
  for _, name in ipairs(removed) do
    rows[#rows + 1] = { "-", "tool " .. name, "(removed)", short(old.tools[name].path), "-", "" }
  end
  for _, c in ipairs(changes) do
    rows[#rows + 1] = { c.widens and "!" or "~", c.scope, c.field, short(c.old), short(c.new),
                        c.widens and ("WIDENS: " .. c.why) or "" }
  end
  print_table(rows)
  printf("%d added, %d removed, %d changed; %d widening%s\n", #added, #removed, #changes,
         #widened, #widened == 1 and "" or "s")
  for _, line in ipairs(problems) do printf("%s\n", line) end
end

local function cmd_diff(argv)
  local files, as_json, fail_on_widen = {}, false, false
  for _, a in ipairs(argv) do
    if a == "--json" then as_json = true
    elseif a == "--fail-on-widen" then fail_on_widen = true
    elseif a == "-h" or a == "--help" then
      printf("usage: stockade diff OLD NEW [--json] [--fail-on-widen]\n"
             .. "What NEW changes against OLD, and which changes widen what a tool may do.\n"
             .. "  --json            one JSON document on stdout instead of the table\n"
             .. "  --fail-on-widen   exit 1 when anything widens (default: only when an\n"
             .. "                    added tool lacks a schema, an owner or a timeout)\n"
             .. "Exit status: 0 accepted, 1 refused, 125 usage error.\n")
      return EXIT_OK
    elseif a:sub(1, 2) == "--" then
      eprintf("stockade diff: unknown option %s\n", a)
      return EXIT_USAGE
    else files[#files + 1] = a end
  end
  if #files ~= 2 then
    eprintf("usage: stockade diff OLD NEW [--json] [--fail-on-widen]\n")
    return EXIT_USAGE
  end
  local _, old = load_policy(files[1])
  if type(old) ~= "table" then printf("%s\n", old); return EXIT_FAIL end
  local _, new = load_policy(files[2])
  if type(new) ~= "table" then printf("%s\n", new); return EXIT_FAIL end

  local d = diff_policies(old, new)
  local status = diff_verdict(d, fail_on_widen)
  if as_json then
    render_diff_json(old, new, d, status)
  else
    render_diff_table(old, new, d)
  end
  return status
end

-- ---- budget -------------------------------------------------------------------------

local function cmd_budget(argv)
  local file, as_json
  for _, a in ipairs(argv) do
    if a == "--json" then as_json = true
    elseif a == "-h" or a == "--help" then
      printf("usage: stockade budget [POLICY] [--json]\n"
             .. "The timeout budget: call <= call_max <= fuse < idle_shutdown, grace < call.\n"
             .. "  --json   one JSON document on stdout instead of the table\n"
             .. POLICY_DEFAULT_HELP
             .. "Exit status: 0 consistent, 1 the fuse is not below idle_shutdown, 125 usage error.\n")
      return EXIT_OK
    elseif a:sub(1, 2) == "--" or file then
      eprintf("usage: stockade budget [POLICY] [--json]\n")
      return EXIT_USAGE
    else file = a end
  end
  file = file or default_policy()
  local p, d = load_policy(file)
  if not p then printf("%s\n", d); return EXIT_FAIL end
  local T = d.timeouts
  local grace, cpu, fuse, idle = T.grace or 0, T.cpu, T.fuse, T.idle_shutdown
  local tools = array()
  local worst
  for _, name in ipairs(sorted_keys(d.tools)) do
    local t = d.tools[name]
    local timeout = t.timeout or T.call
    local w = timeout + grace
    local row = { tool = name, timeout_ms = timeout, timeout_default = t.timeout == nil,
                  grace_ms = grace, cpu_ms = cpu, worst_call_ms = w,
                  calls_in_fuse = (fuse and w > 0) and fuse // w or nil }
    tools[#tools + 1] = row
    if not worst or w > worst.worst_call_ms then worst = row end
  end
  local ok = fuse ~= nil and idle ~= nil and fuse < idle
  local margin = (fuse and idle) and (idle - fuse) or nil
  local status = ok and EXIT_OK or EXIT_FAIL
  if as_json then
    printf("%s\n", json.encode({
      policy = d.file, fuse_ms = fuse, idle_shutdown_ms = idle, margin_ms = margin,
      grace_ms = grace, cpu_ms = cpu, call_ms = T.call, call_max_ms = T.call_max,
      lease_ms = T.lease, ok = ok, tools = tools,
      worst_call = worst and { tool = worst.tool, ms = worst.worst_call_ms } or nil,
      status = status,
    }, "  "))
    return status
  end
  printf("%s: budget\n", d.file)
  local rows = { { "TOOL", "TIMEOUT", "GRACE", "CPU", "WORST CALL", "CALLS IN FUSE" } }
  for _, r in ipairs(tools) do
    rows[#rows + 1] = { r.tool, fmt_ms(r.timeout_ms) .. (r.timeout_default and " (call)" or ""),
                        fmt_ms(r.grace_ms), fmt_ms(r.cpu_ms), fmt_ms(r.worst_call_ms),
                        tostring(r.calls_in_fuse or "-") }
  end
  print_table(rows, "  ")
  if worst then
    printf("worst call: %s, %s (timeout %s + grace %s)\n", worst.tool, fmt_ms(worst.worst_call_ms),
           fmt_ms(worst.timeout_ms), fmt_ms(grace))
  end
  printf("session: fuse %s (every call ends when it fires), lease %s, call_max %s\n",
         fmt_ms(fuse), fmt_ms(T.lease), fmt_ms(T.call_max))
  if ok then
    printf("fuse %s < idle_shutdown %s: margin %s, OK\n", fmt_ms(fuse), fmt_ms(idle), fmt_ms(margin))
    if margin <= grace then
      printf("warning: the margin %s is not above the grace %s: a tree killed at the fuse may "
             .. "outlive idle_shutdown\n", fmt_ms(margin), fmt_ms(grace))
    end
  else
    printf("fuse %s is not below idle_shutdown %s: FAIL (margin %s)\n", fmt_ms(fuse), fmt_ms(idle),
           fmt_ms(margin))
  end
  return status
end

-- ---- dry-run ------------------------------------------------------------------------

-- path -> "owner size mtime type" for every entry under `root` (not crossing file
-- systems), `prune` (a dir) excluded.
local function snapshot(root, prune)
  local snap = {}
  local cmd = "find " .. q(root) .. " -xdev"
  if prune then cmd = cmd .. " -path " .. q(prune) .. " -prune -o" end
  cmd = cmd .. " -printf '%U %s %T@ %y %p\\n' 2>/dev/null"
  local out = sh(cmd)
  for line in out:gmatch("[^\n]+") do
    local uid, size, mtime, ftype, path = line:match("^(%d+) (%d+) (%S+) (%S) (.*)$")
    if uid then
      snap[path] = { uid = tonumber(uid), size = size, mtime = mtime, type = ftype }
    end
  end
  return snap
end

-- What changed: new, changed (content: size or mtime) and deleted entries, filtered
-- by `keep(path, before, after)`. A directory's own mtime changes whenever an entry in
-- it does; that is reported through the entry, not the directory.
local function compare(before, after, keep)
  local out = {}
  for path, a in pairs(after) do
    local b = before[path]
    if not b then
      if keep(path, nil, a) then out[#out + 1] = path .. " (new)" end
    elseif (b.size ~= a.size or b.mtime ~= a.mtime or b.type ~= a.type)
           and not (a.type == "d" and b.type == "d") then
      if keep(path, b, a) then out[#out + 1] = path .. " (changed)" end
    end
  end
  for path, b in pairs(before) do
    if not after[path] and keep(path, b, nil) then out[#out + 1] = path .. " (deleted)" end
  end
  table.sort(out)
  return out
end

-- The synthetic tree a probe works on, in the workspace of the session root it will
-- reuse: plain files, nested dirs, and a symlink out of the root to a canary dir.
local function build_tree(ws, canary)
  local cmds = {
    "mkdir -p " .. q(ws .. "/src/lib") .. " " .. q(ws .. "/data/nested/deeper"),
    "printf '# synthetic workspace for stockade dry-run\\n' > " .. q(ws .. "/README.md"),
    "printf 'print(\"hello from the dry-run\")\\n' > " .. q(ws .. "/src/main.py"),
    "printf 'def util():\\n    return 42\\n' > " .. q(ws .. "/src/lib/util.py"),
    "printf 'alpha\\nbeta\\ngamma\\n' > " .. q(ws .. "/data/sample.txt"),
    "printf 'deep\\n' > " .. q(ws .. "/data/nested/deeper/leaf.txt"),
    "ln -s " .. q(canary) .. " " .. q(ws .. "/outside"),
    "find " .. q(ws) .. " -mindepth 1 -type d -exec chmod 0755 {} +",
    "find " .. q(ws) .. " -type f -exec chmod 0644 {} +",
  }
  local _, code = sh("{ " .. table.concat(cmds, " && ") .. "; } 2>&1")
  return code == 0
end

local dry_run

local function cmd_dry_run(argv)
  local file, as_json
  for _, a in ipairs(argv) do
    if a == "-h" or a == "--help" then
      printf("usage: stockade dry-run [--json] [POLICY]\n"
             .. "Runs each tool's probe through `stockade run` in a synthetic workspace and\n"
             .. "proves it wrote nothing outside its session root.\n"
             .. "  --json   one JSON document on stdout: {ok, policy, tools: [{tool, result}]}\n"
             .. POLICY_DEFAULT_HELP
             .. "Temp state under /var/tmp/stockade-dryrun.*, removed at the end.\n"
             .. "Exit status: 0 every probe OK, 1 a probe failed, 125 usage error.\n")
      return EXIT_OK
    elseif a == "--json" then
      as_json = true
    elseif a:sub(1, 1) == "-" or file then
      eprintf("usage: stockade dry-run [--json] [POLICY]   (--help for more)\n")
      return EXIT_USAGE
    else file = a end
  end
  file = file or default_policy()
  if as_json then capture = {} end
  local status, rows = dry_run(file)
  if as_json then
    capture = nil
    local tools = {}
    for _, r in ipairs(rows) do tools[#tools + 1] = { tool = r[1], result = r[2] } end
    printf("%s\n", json.encode({ ok = status == EXIT_OK, policy = file,
                                 tools = array(tools) }))
  end
  return status
end

-- A state dir for the probes under /var/tmp, with a canary directory any uid may write:
-- the dir and the canary, or nil and why not.
local function dry_run_state()
  local tmp = sh("mktemp -d /var/tmp/stockade-dryrun.XXXXXX 2>&1"):gsub("\n$", "")
  if tmp == "" or tmp:sub(1, 1) ~= "/" then return nil, "cannot create a temp state dir: " .. tmp end
  local canary = tmp .. "/canary"
  sh("chmod 0755 " .. q(tmp) .. " && mkdir -p " .. q(canary) .. " " .. q(tmp .. "/sessions")
     .. " && chmod 0711 " .. q(tmp .. "/sessions")
     .. " && printf 'canary\\n' > " .. q(canary .. "/canary.txt")
     .. " && chmod 0666 " .. q(canary .. "/canary.txt") .. " && chmod 0777 " .. q(canary))
  return tmp, canary
end

-- What a tool's probe runs: its argv, or its args through the tool's own decision (run
-- with the args themselves: the tool's argv hook builds the command line). Else nil, nil
-- and the failure.
local function probe_invocation(p, name, probe)
  if type(probe.argv) == "table" then return probe.argv end
  if type(probe.args) ~= "table" then
    return nil, nil, "FAILED PROBE: probe has neither argv nor args"
  end
  local ok, r = pcall(p.decide, p, name, probe.args)
  if not ok then return nil, nil, "FAILED PROBE: " .. tostring(r) end
  if r.class ~= "OK" then return nil, nil, "FAILED " .. r.class .. ": " .. tostring(r.message) end
  return {}, probe.args
end

-- One probe through `stockade run` as session `session`, judged from outside: a write
-- outside its root (/tmp, the state dir, the canary, a read-only mount) or a result
-- other than OK fails it. The result and its lines of evidence.
local function run_probe(w, d, name, session, probe_argv, probe_args)
  local root = w.tmp .. "/sessions/" .. session
  local evidence = {}
  local before_tmp = snapshot("/tmp")
  local before_state = snapshot(w.tmp, root)
  local before_mounts = {}
  for i, m in ipairs(w.ro_mounts) do before_mounts[i] = snapshot(m) end
  local words = {}
  for i, a in ipairs(probe_argv) do words[i] = q(a) end
  local cmd = string.format("%s run --json --policy %s --state-dir %s --session %s %s-- %s %s"
                            .. " </dev/null 2>&1", q(self), q(d.file), q(w.tmp), q(session),
                            probe_args and ("--args " .. q(json.encode(probe_args)) .. " ") or "",
                            q(name), table.concat(words, " "))
  local out, code = sh(cmd)
  local uid = tonumber((sh("stat -c %u " .. q(root) .. " 2>/dev/null"):gsub("%s+$", "")))
  local after_tmp = snapshot("/tmp")
  local after_state = snapshot(w.tmp, root)
  local wrote = {}
  local function mine(_, b, a)
    return uid ~= nil and ((a and a.uid == uid) or (b and b.uid == uid))
  end
  for _, x in ipairs(compare(before_tmp, after_tmp, mine)) do wrote[#wrote + 1] = x end
  for _, x in ipairs(compare(before_state, after_state, function(path, b, a)
    return inside(path, w.canary) or mine(path, b, a)
  end)) do wrote[#wrote + 1] = x end
  for i, m in ipairs(w.ro_mounts) do
    for _, x in ipairs(compare(before_mounts[i], snapshot(m), function() return true end)) do
      wrote[#wrote + 1] = x
    end
  end
  local r = json.decode(out:match("{.*}") or "")
  local result
  if #wrote > 0 then
    result = "WROTE-OUTSIDE " .. table.concat(wrote, " ")
    evidence[#evidence + 1] = string.format("session uid %s, root %s", tostring(uid), root)
  elseif type(r) ~= "table" or type(r.class) ~= "string" then
    result = string.format("FAILED STOCKADE: run exited %d: %s", code,
                           (out:gsub("%s+$", ""):gsub("\n", " | ")))
  elseif r.class ~= "OK" then
    result = string.format("FAILED %s: %s", r.class, tostring(r.message))
  else
    result = "OK"
  end
  if type(r) == "table" then
    evidence[#evidence + 1] = ("argv: " .. name .. " " .. table.concat(probe_argv, " ")):gsub("%s+$", "")
    evidence[#evidence + 1] = string.format("class %s, exit %s, %s ms", tostring(r.class),
                                            tostring(r.exit_code), tostring(r.duration_ms))
    for _, stream in ipairs { "stdout", "stderr" } do
      local text = type(r[stream]) == "string" and r[stream]:gsub("%s+$", "") or ""
      if text ~= "" and result ~= "OK" then
        if #text > 400 then text = text:sub(1, 400) .. "..." end
        evidence[#evidence + 1] = stream .. ": " .. text:gsub("\n", "\n    ")
      end
    end
  end
  return result, evidence
end

-- A probed tool: its invocation, its session root and synthetic tree, its run.
local function dry_run_tool(w, p, d, name, session)
  local probe_argv, probe_args, failed = probe_invocation(p, name, d.tools[name].probe)
  if not probe_argv then return failed, {} end
  local root = w.tmp .. "/sessions/" .. session
  sh("mkdir -m 0700 " .. q(root) .. " && mkdir -m 0700 " .. q(root .. "/workspace"))
  if not build_tree(root .. "/workspace", w.canary) then
    return "FAILED DRYRUN: cannot build the synthetic tree in " .. root, {}
  end
  return run_probe(w, d, name, session, probe_argv, probe_args)
end

local function not_probed(d, names)
  local rows = {}
  for _, name in ipairs(names) do
    printf("%s: not dry-run\n", name)
    rows[#rows + 1] = { name, "not dry-run" }
  end
  printf("%s: 0 probed, 0 OK, 0 failed, %d not dry-run\n", d.file, #names)
  return EXIT_OK, rows
end

dry_run = function(file)
  local p, d = load_policy(file)
  if not p then printf("%s\n", d); return EXIT_FAIL, { { "(policy)", d } } end

  local names = sorted_keys(d.tools)
  local any_probe = false
  for _, name in ipairs(names) do any_probe = any_probe or d.tools[name].probe ~= nil end
  if not any_probe then return not_probed(d, names) end

  local tmp, canary = dry_run_state()
  if not tmp then
    printf("%s: %s\n", d.file, canary)
    return EXIT_FAIL, { { "(dry-run)", canary } }
  end
  local w = { tmp = tmp, canary = canary, ro_mounts = {} }
  for _, m in ipairs(type(d.mounts) == "table" and d.mounts or {}) do
    if type(m) == "table" and type(m[1]) == "string" and m.ro then w.ro_mounts[#w.ro_mounts + 1] = m[1] end
  end

  local status = EXIT_OK
  local rows = {}
  local counts = { probed = 0, ok = 0, bad = 0, skipped = 0 }
  printf("%s: dry-run in %s\n", d.file, tmp)
  for _, name in ipairs(names) do
    if type(d.tools[name].probe) ~= "table" then
      rows[#rows + 1] = { name, "not dry-run" }
      printf("%s: not dry-run\n", name)
      counts.skipped = counts.skipped + 1
    else
      counts.probed = counts.probed + 1
      local result, evidence = dry_run_tool(w, p, d, name, "dryrun-" .. counts.probed)
      if result == "OK" then counts.ok = counts.ok + 1
      else status, counts.bad = EXIT_FAIL, counts.bad + 1 end
      rows[#rows + 1] = { name, result }
      printf("%s: %s\n", name, result)
      for _, e in ipairs(evidence) do printf("    %s\n", e) end
    end
  end
  sh("rm -rf -- " .. q(tmp))
  printf("%s: %d probed, %d OK, %d failed, %d not dry-run\n", d.file, counts.probed, counts.ok,
         counts.bad, counts.skipped)
  return status, rows
end

-- ---- dispatch -----------------------------------------------------------------------

local commands = { check = cmd_check, diff = cmd_diff, ["dry-run"] = cmd_dry_run,
                   budget = cmd_budget }
local fn = commands[command]
if not fn then
  eprintf("stockade: unknown gate '%s' (check, diff, dry-run, budget)\n", tostring(command))
  return EXIT_USAGE
end
return fn(args)
