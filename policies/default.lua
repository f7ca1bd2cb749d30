-- The default policy: deny by default. Only the tools below exist; anything else is a
-- POLICY_VIOLATION and no process is started. A small registry for demos and tests.
local stockade = require "stockade"
local secrets = require "plugins.secrets"

local function tool(path, timeout, extra)
  local t = { path = path, owner = "platform-team", timeout = timeout,
              schema = { type = "object", properties = { argv = { type = "array",
                         items = { type = "string" } } } } }
  for k, v in pairs(extra or {}) do t[k] = v end
  return stockade.tool(t)
end

return stockade.policy {
  name = "default",
  isolation = "process",
  timeouts = {
    call = "30s", call_max = "10m", grace = "2s", cpu = "60s",
    fuse = "50m", lease = "10m", idle_shutdown = "60m", deadline_min = "100ms",
  },
  limits = {
    memory = "1GiB", processes = 64, file_size = "256MiB", open_files = 256,
    output = "1MiB", stdin = "1MiB", argv = 64, argv_bytes = "64KiB",
    sessions = 256, running = 64, depth = 4,
  },
  env = { path = "/usr/bin:/bin", allow = { "LANG", "TZ" }, deny = { "*_TOKEN", "AWS_*" } },
  network = "none",
  -- secrets never reach the model: redacted from every output, even split across reads
  redact = { secrets.default },

  tools = {
    -- read-only helpers: safe to retry
    echo  = tool("/bin/echo", "5s", { idempotent = true, probe = { argv = { "dry-run" } } }),
    cat   = tool("/bin/cat", "10s", { idempotent = true, probe = { argv = { "README.md" } } }),
    ls    = tool("/bin/ls", "10s", { idempotent = true, probe = { argv = { "-la", "." } } }),
    head  = tool("/usr/bin/head", "10s", { idempotent = true,
                   probe = { argv = { "-n", "1", "README.md" } } }),
    wc    = tool("/usr/bin/wc", "10s", { idempotent = true,
                   probe = { argv = { "-l", "data/sample.txt" } } }),
    grep  = tool("/bin/grep", "30s", { idempotent = true,
                   probe = { argv = { "-r", "hello", "src" } } }),
    ["true"]  = tool("/bin/true", "5s", { idempotent = true, probe = { argv = {} } }),
    ["false"] = tool("/bin/false", "5s", { idempotent = true }),
    sleep = tool("/bin/sleep", "60s", { idempotent = true, probe = { argv = { "0.1" } } }),
    -- a shell, for scripted probes and tests; never idempotent (it can do anything the
    -- sandbox lets it)
    sh    = tool("/bin/sh", "60s", { idempotent = false,
      probe = { argv = { "-c", "echo probe > \"$TMPDIR/probe\" && ls -R . > listing.txt" } } }),
  },
}
