-- dev-tools: a realistic registry for a coding agent working on a checkout in its
-- session's workspace. Every decision says why. Deny by default: a tool not listed here
-- does not exist for the agent.
local stockade = require "stockade"
local secrets  = require "plugins.secrets"
local git      = require "plugins.git"

-- Inline code (`python3 -c`, `node -e`) is a shell by another name: it can do anything
-- the sandbox lets it. A team that wants it flips this, knowing the sandbox is then the
-- only wall.
local ALLOW_INLINE_CODE = false

local argv = require "plugins.argv"

local function beneath(call, paths)
  return stockade.paths_beneath(call, paths)
end

-- Each tool's command line parsed with its own option grammar (plugins/argv.lua): the
-- options that take a value are listed, so no path hides behind one, and every file
-- a command line names — operands and option values alike — stays in the session.
local function file_tool(grammar, opts)
  opts = opts or {}
  return function(call)
    local parsed, why = argv.parse(call.argv, grammar)
    if not parsed then return false, why end
    local paths = argv.path_values(parsed)
    for i, op in ipairs(parsed.operands) do
      if not (opts.skip_first and i == 1) then paths[#paths + 1] = op end
    end
    return beneath(call, paths)
  end
end

local FOLLOWS = "follows symbolic links out of the session"

local ls_grammar = argv.grammar {
  { "w", "width", "value" }, { "T", "tabsize", "value" }, { "I", "ignore", "value" },
  { nil, "hide", "value" }, { nil, "format", "value" }, { nil, "time-style", "value" },
  { nil, "block-size", "value" }, { nil, "quoting-style", "value" },
  { nil, "indicator-style", "value" }, { nil, "sort", "value" }, { nil, "time", "value" },
  { nil, "color", "optional" }, { nil, "hyperlink", "optional" },
}
local cat_grammar = argv.grammar {}
local head_grammar = argv.grammar { { "n", "lines", "value" }, { "c", "bytes", "value" } }
local grep_grammar = argv.grammar {
  { "e", "regexp", "value" }, { "f", "file", "path" }, { "m", "max-count", "value" },
  { "A", "after-context", "value" }, { "B", "before-context", "value" },
  { "C", "context", "value" }, { "d", "directories", "value" }, { "D", "devices", "value" },
  { nil, "include", "value" }, { nil, "exclude", "value" }, { nil, "exclude-dir", "value" },
  { nil, "exclude-from", "path" }, { nil, "binary-files", "value" }, { nil, "label", "value" },
  { nil, "color", "optional" }, { nil, "colour", "optional" }, { nil, "group-separator", "value" },
  { "R", "dereference-recursive", "refuse", FOLLOWS },
}

-- grep: the first operand is the pattern, unless -e or -f gave one
local function grep_accept(call)
  local parsed, why = argv.parse(call.argv, grep_grammar)
  if not parsed then return false, why end
  local pattern_given = argv.has(parsed, "regexp") or argv.has(parsed, "file")
  local paths = argv.path_values(parsed)
  for i, op in ipairs(parsed.operands) do
    if pattern_given or i > 1 then paths[#paths + 1] = op end
  end
  return beneath(call, paths)
end

-- find has a grammar of its own: options, then start points (every argument before the
-- first that begins an expression), then the expression. Every start point and every
-- file an expression names stays in the session; actions that run, delete or write are
-- refused.
local FIND_ACTIONS = {
  ["-exec"] = true, ["-execdir"] = true, ["-ok"] = true, ["-okdir"] = true,
  ["-delete"] = true, ["-fprint"] = true, ["-fprint0"] = true, ["-fprintf"] = true,
  ["-fls"] = true,
}
local FIND_FILE_TESTS = { ["-newer"] = true, ["-anewer"] = true, ["-cnewer"] = true,
                          ["-samefile"] = true }
local function find_accept(call)
  local a, i = call.argv, 1
  while a[i] and (a[i] == "-H" or a[i] == "-P" or a[i] == "-D" or a[i]:match("^%-O%d*$")) do
    i = i + (a[i] == "-D" and 2 or 1)
  end
  if a[i] == "-L" then return false, "find -L " .. FOLLOWS end
  local paths = {}
  while a[i] and not a[i]:match("^[-(!),]") do
    paths[#paths + 1] = a[i]
    i = i + 1
  end
  for j = i, #a do
    local x = a[j]
    if FIND_ACTIONS[x] then return false, "find " .. x .. " is refused: find may only list" end
    if x == "-follow" then return false, "find -follow " .. FOLLOWS end
    if x == "-files0-from" then
      return false, "find -files0-from is refused: its start points could not be checked"
    end
    -- -newerXY REF: a file unless Y is t (a date)
    local y = x:match("^%-newer%a(%a)$")
    if FIND_FILE_TESTS[x] or (y and y ~= "t") then
      if a[j + 1] == nil then return false, "find " .. x .. " needs a file" end
      paths[#paths + 1] = a[j + 1]
    end
  end
  return beneath(call, paths)
end

-- An interpreter may run a script from the workspace: never inline code (-c, -e, a
-- script read from stdin, an interactive prompt), never a library module through -m
-- (pip installs; timeit, pdb and code run code given inline).
local INLINE = "inline code is refused by this policy; write a script to the workspace"

local python_grammar = argv.grammar({
  { "c", nil, "value" }, { "m", nil, "value" }, { "W", nil, "value" }, { "X", nil, "value" },
  { nil, "check-hash-based-pycs", "value" },
}, { stop_at_operand = true, stop_after = { c = true, m = true } })

local function python_accept(call)
  local parsed, why = argv.parse(call.argv, python_grammar)
  if not parsed then return false, why end
  if not ALLOW_INLINE_CODE then
    if argv.has(parsed, "c") then return false, "python3 -c: " .. INLINE end
    if argv.has(parsed, "i") then return false, "python3 -i: " .. INLINE end
    if argv.has(parsed, "m") then
      return false, "python3 -m: library modules are refused by this policy (pip installs, " ..
                    "timeit and pdb run inline code); run a script from the workspace"
    end
  end
  local script = parsed.operands[1]
  if argv.has(parsed, "c") or argv.has(parsed, "m") then return beneath(call, {}) end
  if script == nil or script == "-" then
    if argv.has(parsed, "V") or argv.has(parsed, "version") or argv.has(parsed, "h") or
       argv.has(parsed, "help") then
      return true
    end
    return false, "python3 without a script reads code from stdin: " .. INLINE
  end
  return beneath(call, parsed.operands)
end

local node_grammar = argv.grammar({
  { "e", "eval", "value" }, { "p", "print", "value" }, { "r", "require", "path" },
  { nil, "import", "path" }, { nil, "loader", "path" }, { nil, "experimental-loader", "path" },
  { nil, "env-file", "path" }, { "C", "conditions", "value" }, { nil, "input-type", "value" },
  { nil, "title", "value" }, { nil, "inspect-port", "value" },
}, { stop_at_operand = true })

local function node_accept(call)
  local parsed, why = argv.parse(call.argv, node_grammar)
  if not parsed then return false, why end
  if not ALLOW_INLINE_CODE then
    for _, o in ipairs { "eval", "print", "i", "interactive" } do
      if argv.has(parsed, o) then return false, "node --" .. o .. ": " .. INLINE end
    end
  end
  local script = parsed.operands[1]
  if (script == nil or script == "-") and not ALLOW_INLINE_CODE and
     not (argv.has(parsed, "v") or argv.has(parsed, "version") or argv.has(parsed, "h") or
          argv.has(parsed, "help") or argv.has(parsed, "eval") or argv.has(parsed, "print")) then
    return false, "node without a script reads code from stdin: " .. INLINE
  end
  local paths = argv.path_values(parsed)
  for _, op in ipairs(parsed.operands) do paths[#paths + 1] = op end
  return beneath(call, paths)
end

local function argv_schema(max)
  return { type = "object", additionalProperties = false,
           properties = { argv = { type = "array", maxItems = max or 64,
                                   items = { type = "string", maxLength = 4096 } } } }
end

local function from_args(args) return args.argv or {} end

local function refused(why)
  return function() return false, why end
end

-- The git subcommands this policy offers (structured args only): history, and the
-- agent's own local commits. Not init, apply or anything that reaches the network.
local GIT_SUBCOMMANDS = {
  "status", "diff", "log", "show", "blame", "grep", "shortlog", "describe", "rev-parse",
  "ls-files", "ls-tree", "cat-file", "merge-base", "show-ref", "branch", "tag",
  "add", "commit", "checkout", "switch", "restore", "stash", "reset", "merge",
  "cherry-pick", "revert", "mv", "rm",
}

return stockade.policy {
  name = "dev-tools",
  isolation = "process",
  timeouts = {
    call = "30s", call_max = "10m", grace = "2s", cpu = "120s",
    fuse = "50m", lease = "10m", idle_shutdown = "60m", deadline_min = "100ms",
  },
  limits = {
    memory = "2GiB", processes = 128, file_size = "512MiB", open_files = 512,
    output = "1MiB", stdin = "1MiB", argv = 64, argv_bytes = "64KiB",
    sessions = 256, running = 64, depth = 4,
  },
  env = {
    path = "/usr/bin:/bin",
    allow = { "LANG", "TZ" },    -- for every tool; a tool adds its own names below
    -- secrets never reach a tool, even if someone allows them by name; their values are
    -- also redacted from every output
    deny = { "*_TOKEN", "*_SECRET*", "*_PASSWORD", "*_KEY", "AWS_*", "GITHUB_*",
             "SSH_AUTH_SOCK", "GIT_ASKPASS", "GIT_SSH*", "GIT_CONFIG*" },
  },
  network = "none",
  redact = { secrets.default },

  tools = {
    -- read-only file tools: paths stay beneath the session root (symlinks resolved
    -- inside it), so ../../.ssh and /etc/shadow are refused before anything runs
    ls = stockade.tool { path = "/bin/ls", owner = "platform-team", timeout = "10s",
      probe = { args = { argv = { "-la", "src" } } },
      schema = argv_schema(), argv = from_args, raw_argv = true, idempotent = true,
      accept = file_tool(ls_grammar) },
    cat = stockade.tool { path = "/bin/cat", owner = "platform-team", timeout = "10s",
      probe = { args = { argv = { "README.md" } } },
      schema = argv_schema(), argv = from_args, raw_argv = true, idempotent = true,
      accept = file_tool(cat_grammar) },
    head = stockade.tool { path = "/usr/bin/head", owner = "platform-team", timeout = "10s",
      probe = { args = { argv = { "-n", "1", "README.md" } } },
      schema = argv_schema(), argv = from_args, raw_argv = true, idempotent = true,
      accept = file_tool(head_grammar) },
    grep = stockade.tool { path = "/bin/grep", owner = "platform-team", timeout = "30s",
      probe = { args = { argv = { "-r", "hello", "src" } } },
      schema = argv_schema(), argv = from_args, raw_argv = true, idempotent = true,
      accept = grep_accept },
    -- find can run programs and delete files: those actions are refused
    find = stockade.tool { path = "/usr/bin/find", owner = "platform-team", timeout = "30s",
      probe = { args = { argv = { ".", "-name", "*.py" } } },
      schema = argv_schema(), argv = from_args, raw_argv = true, idempotent = true,
      accept = find_accept },

    -- git: history and local commits, never the network or its configuration; through
    -- structured args only ({subcommand, args}), so the schema's list holds
    git = stockade.tool { path = "/usr/bin/git", owner = "platform-team", timeout = "60s",
      schema = { type = "object", required = { "subcommand" }, additionalProperties = false,
                 properties = { subcommand = { enum = GIT_SUBCOMMANDS },
                                args = { type = "array", items = { type = "string" } } } },
      argv = function(args)
        local out = { "--no-pager", args.subcommand }
        for _, a in ipairs(args.args or {}) do out[#out + 1] = a end
        return out
      end,
      accept = git.accept { local_writes = true },
      idempotent = git.idempotent,
      env = { "GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL", "GIT_COMMITTER_NAME",
              "GIT_COMMITTER_EMAIL" },
      -- a lock left by a concurrent git: worth one more try, unlike other failures
      classify = function(r)
        if r.exit_code == 128 and r.stderr_tail:find("index.lock", 1, true) then
          return "TOOL_ERROR", true, "repository busy; retry"
        end
      end },

    -- interpreters: scripts from the workspace only
    python3 = stockade.tool { path = "/usr/bin/python3", owner = "platform-team",
      timeout = "120s", probe = { args = { argv = { "src/main.py" } } },
      schema = argv_schema(), argv = from_args, raw_argv = true, accept = python_accept },
    node = stockade.tool { path = "/usr/bin/node", owner = "platform-team", timeout = "120s",
      probe = { args = { argv = { "--version" } } },
      schema = argv_schema(), argv = from_args, raw_argv = true, accept = node_accept },

    -- package managers: install scripts are arbitrary code from the network; an
    -- install is a reviewed change to the image, not a tool call
    pip = stockade.tool { path = "/usr/bin/pip3", owner = "platform-team", timeout = "5s",
      schema = argv_schema(), accept = refused("package installs are refused by default") },
    npm = stockade.tool { path = "/usr/bin/npm", owner = "platform-team", timeout = "5s",
      schema = argv_schema(), accept = refused("package installs are refused by default") },
  },
}
