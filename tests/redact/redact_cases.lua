-- Redact a batch of texts through the core's streaming path (not a test suite: a tool
-- for tests/redact/corpus.py and the bench). Run with `stockade test`:
--   REDACT_POLICY=policies/default.lua REDACT_TOOL=cat REDACT_CHUNK=N \
--   REDACT_IN=cases.bin REDACT_OUT=out.bin ./stockade test tests/redact/redact_cases.lua
-- Each record of IN and OUT is "<length>\n<bytes>"; OUT has one record per case.
local testing = require "stockade.testing"

local p = testing.load(os.getenv("REDACT_POLICY") or "policies/default.lua")
local tool = os.getenv("REDACT_TOOL") or "cat"
local chunk = tonumber(os.getenv("REDACT_CHUNK") or "0")
local fin = assert(io.open(assert(os.getenv("REDACT_IN")), "rb"))
local fout = assert(io.open(assert(os.getenv("REDACT_OUT")), "wb"))
while true do
  local n = fin:read("n")
  if not n then break end
  fin:read(1)                    -- the "\n" after the length
  local text = n > 0 and fin:read(n) or ""
  local out = p:redact(tool, text, chunk > 0 and { chunk = chunk } or nil)
  fout:write(#out, "\n", out)
end
fout:close()
