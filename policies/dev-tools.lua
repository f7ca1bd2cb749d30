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

local function beneath(call)
  return stockade.paths_beneath(call, call.argv)
end

-- Paths among the arguments (those that are not options) must stay in the session.
local function operands_beneath(call)
  local paths = {}
  for _, a in ipairs(call.argv) do
    if a:sub(1, 1) ~= "-" then paths[#paths + 1] = a end
  end
  return stockade.paths_beneath(call, paths)
end

local function argv_schema(max)
  return { type = "object", additionalProperties = false,
           properties = { argv = { type = "array", maxItems = max or 64,
                                   items = { type = "string", maxLength = 4096 } } } }
end

local function from_args(args) return args.argv or {} end

-- An interpreter may run a script from the workspace, never inline code, never a
-- package manager through -m.
local function interpreter(inline_flags)
  return function(call)
    local a1 = call.argv[1]
    if a1 == nil then return false, "an interactive interpreter has nothing to read" end
    if inline_flags[a1] and not ALLOW_INLINE_CODE then
      return false, a1 .. ": inline code is refused by this policy; write a script to the workspace"
    end
    if a1 == "-m" and (call.argv[2] == "pip" or call.argv[2] == "ensurepip") then
      return false, "package installs are refused by default"
    end
    return operands_beneath(call)
  end
end

local function refused(why)
  return function() return false, why end
end

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
      schema = argv_schema(), argv = from_args, idempotent = true, accept = operands_beneath },
    cat = stockade.tool { path = "/bin/cat", owner = "platform-team", timeout = "10s",
      probe = { args = { argv = { "README.md" } } },
      schema = argv_schema(), argv = from_args, idempotent = true, accept = beneath },
    head = stockade.tool { path = "/usr/bin/head", owner = "platform-team", timeout = "10s",
      probe = { args = { argv = { "-n", "1", "README.md" } } },
      schema = argv_schema(), argv = from_args, idempotent = true, accept = operands_beneath },
    grep = stockade.tool { path = "/bin/grep", owner = "platform-team", timeout = "30s",
      probe = { args = { argv = { "-r", "hello", "src" } } },
      schema = argv_schema(), argv = from_args, idempotent = true,
      -- the first operand is the pattern, not a path
      accept = function(call)
        local paths, seen_pattern = {}, false
        for _, a in ipairs(call.argv) do
          if a:sub(1, 1) ~= "-" then
            if seen_pattern then paths[#paths + 1] = a else seen_pattern = true end
          end
        end
        return stockade.paths_beneath(call, paths)
      end },
    -- find can run programs and delete files: those actions are refused
    find = stockade.tool { path = "/usr/bin/find", owner = "platform-team", timeout = "30s",
      probe = { args = { argv = { ".", "-name", "*.py" } } },
      schema = argv_schema(), argv = from_args, idempotent = true,
      accept = function(call)
        local paths = {}
        for _, a in ipairs(call.argv) do
          if a == "-exec" or a == "-execdir" or a == "-ok" or a == "-okdir" or a == "-delete"
             or a:match("^%-fprint") or a == "-fls" then
            return false, "find " .. a .. " is refused: find may only list"
          end
          if a:sub(1, 1) ~= "-" and #paths == 0 then paths[1] = a end
        end
        return stockade.paths_beneath(call, paths)
      end },

    -- git: history and local commits, never the network or its configuration
    git = stockade.tool { path = "/usr/bin/git", owner = "platform-team", timeout = "60s",
      schema = { type = "object", required = { "subcommand" }, additionalProperties = false,
                 properties = { subcommand = { enum = { "status", "diff", "log", "show" } },
                                args = { type = "array", items = { type = "string" } } } },
      argv = function(args)
        local argv = { "--no-pager", args.subcommand }
        for _, a in ipairs(args.args or {}) do argv[#argv + 1] = a end
        return argv
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
      schema = argv_schema(), argv = from_args,
      accept = interpreter { ["-c"] = true } },
    node = stockade.tool { path = "/usr/bin/node", owner = "platform-team", timeout = "120s",
      probe = { args = { argv = { "--version" } } },
      schema = argv_schema(), argv = from_args,
      accept = interpreter { ["-e"] = true, ["--eval"] = true, ["-p"] = true,
                             ["--print"] = true } },

    -- package managers: install scripts are arbitrary code from the network; an
    -- install is a reviewed change to the image, not a tool call
    pip = stockade.tool { path = "/usr/bin/pip3", owner = "platform-team", timeout = "5s",
      schema = argv_schema(), accept = refused("package installs are refused by default") },
    npm = stockade.tool { path = "/usr/bin/npm", owner = "platform-team", timeout = "5s",
      schema = argv_schema(), accept = refused("package installs are refused by default") },
  },
}
