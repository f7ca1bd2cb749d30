-- LuaUnit tests of plugins/secrets.lua, through the core's streaming redaction path
-- (tests/fixtures/redact_secrets.lua loaded with stockade.testing): the set is regex
-- redactors, which only the core runs.
--   cd /work/main && STOCKADE_PLUGIN_PATH=$PWD/plugins ./stockade test plugins/tests/test_secrets.lua
--
-- Every token below is synthetic and built at run time (prefix .. generated characters),
-- so this file contains nothing a secret scanner would flag. The per-family corpus
-- (tests/redact/corpus) has many more cases; these are the ones the design turns on.

local lu = require "luaunit"
local testing = require "stockade.testing"

package.path = "./plugins/?.lua;./?.lua;" .. package.path
local secrets = require "secrets"

local P = testing.load("tests/fixtures/redact_secrets.lua")
local HOLD = testing.load("tests/fixtures/redact_hold.lua")

-- ---- helpers ----------------------------------------------------------------------

local UPPER = "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
local ALNUM = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
local B64 = ALNUM .. "+/"

-- n characters of `alphabet`, in a scrambled but reproducible order; `k` varies it.
local function fill(n, alphabet, k)
  local out = {}
  for i = 0, n - 1 do
    local j = (i * 7 + (k or 0) * 13 + (i * i) % 11) % #alphabet + 1
    out[#out + 1] = alphabet:sub(j, j)
  end
  return table.concat(out)
end

local CHUNKS = { 0, 1, 2, 3, 5, 7, 13, 64, 4096 }

-- The text through the core in reads of `chunk` bytes (0: one read).
local function redact(text, chunk, tool, p)
  return (p or P):redact(tool or "cat", text, chunk and chunk > 0 and { chunk = chunk } or nil)
end

-- The same output whatever the reads; returns it and the count.
local function redact_all(text, tool, p)
  local first, n = redact(text, 0, tool, p)
  for _, c in ipairs(CHUNKS) do
    local out = redact(text, c, tool, p)
    lu.assertEquals(out, first, "reads of " .. c .. " bytes differ from one read")
  end
  return first, n
end

local function assert_gone(text, secret, marker)
  local out = redact_all(text)
  lu.assertNotStrContains(out, secret)
  if marker then lu.assertStrContains(out, marker) end
  return out
end

local function assert_intact(text)
  lu.assertEquals(redact_all(text), text)
end

local DASH5 = "-----"
local function pem(label, nlines, k, prefix)
  prefix = prefix or ""
  local t = { prefix .. DASH5 .. "BEGIN " .. label .. DASH5 }
  for i = 1, nlines do t[#t + 1] = prefix .. fill(64, B64, k + i) end
  t[#t + 1] = prefix .. DASH5 .. "END " .. label .. DASH5
  return table.concat(t, "\n")
end
local PK = "PRIVATE" .. " KEY"

-- ---- the set's shape ---------------------------------------------------------------

TestShape = {}

function TestShape.test_every_entry_is_a_regex_redactor_with_a_unique_name()
  local seen = {}
  for i, r in ipairs(secrets.default) do
    lu.assertIsString(r.name, "entry " .. i)
    lu.assertIsNil(seen[r.name], "duplicate name " .. r.name)
    seen[r.name] = true
    lu.assertIsString(r.regex, r.name)
    lu.assertIsString(r.open, r.name)
    lu.assertStrMatches(r.replace, "%[REDACTED[^%]]*%]")
    lu.assertIsNil(r.pattern, r.name .. ": a Lua pattern would run on the slow path")
  end
end

function TestShape.test_markers_are_inert()
  -- applying the set to its own output changes nothing
  local text = "k=AKIA" .. fill(16, UPPER) .. " ghp_" .. fill(36, ALNUM) .. "\n" .. pem("RSA " .. PK, 4, 1)
  local once = redact(text)
  lu.assertNotEquals(once, text)
  lu.assertEquals(redact(once), once)
  for _, r in ipairs(secrets.default) do lu.assertEquals(redact(r.replace), r.replace) end
end

function TestShape.test_without_drops_entries_by_name()
  local fewer = secrets.without { "generic-secret", "generic-secret-quoted" }
  lu.assertEquals(#fewer, #secrets.default - 2)
  for _, r in ipairs(fewer) do lu.assertNotEquals(r.name, "generic-secret") end
end

-- The module needs nothing beyond base/string/table/math/utf8.
function TestShape.test_loads_in_the_policy_sandbox()
  local path = package.searchpath("secrets", package.path)
  local f = assert(io.open(path, "rb"))
  local src = f:read("a")
  f:close()
  local env = {}
  for _, k in ipairs { "assert", "error", "ipairs", "next", "pairs", "pcall", "select", "tonumber",
                       "tostring", "type", "rawequal", "rawget", "rawlen", "rawset",
                       "getmetatable", "setmetatable", "xpcall", "_VERSION" } do
    env[k] = _G[k]
  end
  env.string, env.table, env.math, env.utf8 = string, table, math, utf8
  local m = assert(load(src, "=secrets", "t", env))()
  lu.assertEquals(#m.default, #secrets.default)
  local known = { string = true, table = true, math = true, utf8 = true }
  for k in pairs(env) do
    lu.assertTrue(known[k] or _G[k] ~= nil, "the module set a global " .. tostring(k))
  end
end

-- ---- precision: what the patterns see and where they start ----------------------------

TestPrecision = {}

-- The patterns see the text before the literal: no cut mid-word.
function TestPrecision.test_prefixes_inside_words_are_left_alone()
  assert_intact("task-abcdefghijklmnopqrstuvwxyz0123456789 done")
  assert_intact("x" .. "AKIA" .. fill(16, UPPER) .. " and AKIA" .. fill(16, UPPER) .. "Z")
  assert_intact("mask_test_" .. fill(30, ALNUM) .. " risk_live_" .. fill(30, ALNUM))
  assert_intact("wghp_" .. fill(36, ALNUM) .. " my-eyJ" .. fill(20, ALNUM) .. "." .. fill(20, ALNUM) .. ".x")
  assert_intact("sk-loading-spinner-container-element-wrapper")
end

function TestPrecision.test_pem_markers_in_prose_and_code_are_not_a_key()
  local b, e = DASH5 .. "BEGIN RSA " .. PK .. DASH5, DASH5 .. "END RSA " .. PK .. DASH5
  assert_intact("A key file starts with " .. b .. " and ends with " .. e .. ".")
  assert_intact('if (strstr(buf, "' .. b .. '")) {\n  n++;\n}\nif (strstr(buf, "' .. e .. '"))\n  done();')
  assert_intact(b .. "\nanything\n" .. e)      -- gitleaks' own false positive
  -- a real one right after prose is still found
  local key = pem("RSA " .. PK, 6, 2)
  local out = assert_gone("see " .. b .. " here\n" .. key .. "\nafter", fill(64, B64, 5),
                          "[REDACTED:private-key]")
  lu.assertStrContains(out, "see " .. b .. " here\n")
  lu.assertStrContains(out, "\nafter")
end

function TestPrecision.test_context_stays_readable()
  local sec = fill(40, B64, 3)
  lu.assertEquals(redact_all("aws_secret_access_key = " .. sec .. "\n"),
                  "aws_secret_access_key = [REDACTED:aws-secret-access-key]\n")
  lu.assertEquals(redact_all("https://bob:" .. fill(12, ALNUM) .. "@db.example/x"),
                  "https://bob:[REDACTED]@db.example/x")
  lu.assertEquals(redact_all("Authorization: Bearer " .. fill(30, ALNUM) .. "\r\n"),
                  "Authorization: Bearer [REDACTED:authorization]\r\n")
  lu.assertEquals(redact_all('password = "changeme"'), 'password = "changeme"')   -- policy choice
  lu.assertEquals(redact_all('password = "changeme1"'), 'password = "[REDACTED:secret]"')
end

-- ---- the public rule sets' shapes (held-out corpus findings) ---------------------------

TestShapes = {}

local LOWER_NUM = "abcdefghijklmnopqrstuvwxyz0123456789"

-- gitleaks' GenerateSampleSecrets: the value apart from its name, or joined by more
-- than "=" and ":"; detect-secrets' comparisons.
function TestShapes.test_name_and_value_apart()
  for k, shape in ipairs {
    "<jiraToken>%s</jiraToken>",
    "<jiraToken>\n    %s\n</jiraToken>",
    '{\n    "name": "jira_token",\n    "value": "%s"\n}',
    '<entry name="jiraToken" value="%s" />',
    '<entry>\n  <name="jiraToken" />\n  <value="%s" />\n</entry>',
    "jira_token: |\n  %s",
    "jira_token: >\n  %s",
    '\\{\n    \\"jira_token\\": \\"%s\\"\n\\}',
    'var jiraToken string = "%s"',
    '$jiraToken .= "%s"',
    'System.setProperty("JIRA_TOKEN", "%s")',
    'required username=\\"bob\\" jiraToken=\\"%s\\""',
    'if (password == "%s") {',
    'some_api_token_123 = "%s"',
    "creds = %s",
  } do
    local secret = "Zq8" .. fill(29, ALNUM, k)
    assert_gone(shape:format(secret), secret)
  end
end

function TestShapes.test_placeholders_and_names_that_are_not_secrets_stay()
  assert_intact("ghp_" .. ("x"):rep(36))
  assert_intact("xoxb-" .. ("x"):rep(9) .. "-" .. ("x"):rep(10) .. "-" .. ("x"):rep(12))
  assert_intact("client_secret=bP88Q~" .. ("x"):rep(34))
  assert_intact("credentialsId: 'ff083f76-7804-4ef1-80e4-fe975bb9141b'")
  assert_intact('LLM_SECRET_NAME = "NEXUS-GPT4-API-KEY"')
  assert_intact("  <UserSecretsId>79a3edd0-2092-40a2-a04d-dcb46d5ca9ed</UserSecretsId>")
  assert_intact('publicToken = "' .. fill(43, ALNUM, 3) .. '"')
  assert_intact("//registry.npmjs.org/:_authToken=${NPM_TOKEN}")
  assert_intact("curl -u <user:password> https://test.example/endpoint")
  assert_intact('curl -X GET --insecure --user "username:password" \\')
  assert_intact("- (id)hf_requiredCharacteristicTypesForDisplayMetadata;")
  assert_intact("machine translation\nlogin page\npassword reset")
end

function TestShapes.test_more_token_kinds()
  local cases = {
    { "ABSKQmVkcm9ja0FQSUtleS" .. fill(110, B64, 1), "[REDACTED:aws-bedrock-api-key]" },
    { "bedrock-api-key-YmVkcm9jay5hbWF6b25hd3MuY29t" .. fill(40, ALNUM, 2), "[REDACTED:aws-bedrock-api-key]" },
    { "_gitlab_session=" .. fill(32, LOWER_NUM, 3), "[REDACTED:gitlab-token]" },
    { "xoxa-2-" .. fill(12, ALNUM, 4), "[REDACTED:slack-token]" },
    { "ey" .. fill(20, ALNUM, 5) .. ".ey" .. fill(20, ALNUM, 6) .. "." .. fill(10, B64, 7), "[REDACTED:jwt]" },
    { "eyJ" .. fill(20, ALNUM, 8) .. ".eyJ" .. fill(40, ALNUM, 9), "[REDACTED:jwt]" },
  }
  for _, c in ipairs(cases) do
    local out = assert_gone("got " .. c[1] .. " ok\n", c[1], c[2])
    lu.assertEquals(out, "got " .. c[2] .. " ok\n")
  end
  local t = fill(6, LOWER_NUM, 10) .. "." .. fill(16, LOWER_NUM, 11)
  assert_gone("kubeadm join 10.0.0.1:6443 --token " .. t .. " --discovery-token-ca-cert-hash sha256:0", t)
  assert_gone("users:\n- name: kubelet\n  user:\n    token: " .. t .. "\n", t)
  local b = fill(40, ALNUM, 12)
  assert_gone("curl --oauth2-bearer " .. b .. " https://api.example/v1", b)
  assert_gone('curl -H "Api-Token: Sk94' .. fill(7, ALNUM, 13) .. '"', "Sk94" .. fill(7, ALNUM, 13))
  assert_gone("curl -H 'Authorization: Basic YWI6Y2Q=' \\", "YWI6Y2Q=")
end

function TestShapes.test_netrc_default_and_curl_over_continued_lines()
  local pw = "pw" .. fill(12, ALNUM, 14)
  assert_gone("default login anonymous password " .. pw, pw)
  assert_gone("curl -k -X POST https://h.example/x \\\n  -H 'Content-type: text/plain' \\\n  -u developer:" .. pw, pw)
  assert_gone('curl -u ":' .. pw .. '" https://localhost:9200', pw)
  assert_gone("curl --user kevin:'" .. pw .. "' -iX PATCH", pw)
end

function TestShapes.test_command_lines()
  local pw = "Pw" .. fill(12, ALNUM, 15) .. "!"
  for _, line in ipairs {
    "mysql -h db -u root --password=%s shop", "gh auth login --token %s",
    "docker login -u ci -p %s registry.example", "sshpass -p '%s' ssh deploy@host",
    "mysqldump -u root -p%s --all-databases",
  } do
    assert_gone(line:format(pw), pw, "[REDACTED:password]")
  end
  for _, line in ipairs {
    "ssh -p 2222 deploy@host", "mysql -u root -p shop", "--password PASSWORD", "--token TOKEN",
    "--password-file /run/secrets/db", "echo --password=$DB_PASS",
    "been renamed to --http-password and --proxy-password respectively, and",
  } do
    assert_intact(line)
  end
end

-- Tools' outputs: az, kubectl, terraform, signed URLs, Laravel, .netrc on one line.
function TestShapes.test_tool_outputs()
  local key = fill(86, B64, 16) .. "=="
  assert_gone('[\n  {\n    "keyName": "key1",\n    "permissions": "FULL",\n    "value": "' .. key .. '"\n  }\n]',
              key, "[REDACTED:azure-storage-key]")
  local sig = fill(40, ALNUM, 17) .. "%3D"
  local out = assert_gone("https://a.blob.core.windows.net/c/f?sv=2022-11-02&sp=r&sig=" .. sig, sig)
  lu.assertStrContains(out, "?sv=2022-11-02&sp=r&sig=[REDACTED:signature]")
  local pw = "Pw" .. fill(14, ALNUM, 18) .. "!"
  assert_gone("        - name: DB_PASSWORD\n          value: " .. pw .. "\n", pw)
  assert_intact("        - name: LOG_LEVEL\n          value: info\n")
  assert_gone('{\n  "db_password": {\n    "sensitive": true,\n    "type": "string",\n    "value": "' .. pw .. '"\n  }\n}', pw)
  local app = fill(43, B64, 19) .. "="
  assert_gone("APP_KEY=base64:" .. app .. "\n", app)
  assert_gone("machine a.example login u1 password " .. pw .. " machine b.example login u2 password x" .. pw, "x" .. pw)
end

-- ---- streaming: any length, any reads, diff hunks --------------------------------------

TestStreaming = {}

function TestStreaming.test_one_secret_per_family_at_every_read_size()
  local cases = {
    { "ghp_" .. fill(36, ALNUM, 1), "[REDACTED:github-token]" },
    { "glpat-" .. fill(20, ALNUM, 2), "[REDACTED:gitlab-token]" },
    { "sk-proj-" .. fill(150, ALNUM, 3), "[REDACTED:openai-api-key]" },
    { "sk-ant-api03-" .. fill(93, ALNUM, 4) .. "AA", "[REDACTED:anthropic-api-key]" },
    { "AKIA" .. fill(16, UPPER, 5), "[REDACTED:aws-access-key]" },
    { "AIza" .. fill(35, ALNUM, 6), "[REDACTED:gcp-api-key]" },
    { "ya29." .. fill(120, ALNUM, 7), "[REDACTED:gcp-oauth-token]" },
    { "xoxb-" .. fill(50, ALNUM, 8), "[REDACTED:slack-token]" },
    { "xoxe.xoxp-1-" .. fill(166, UPPER, 9), "[REDACTED:slack-token]" },
    { "sk_live_" .. fill(40, ALNUM, 10), "[REDACTED:stripe-key]" },
    { "npm_" .. fill(36, ALNUM, 11), "[REDACTED:npm-token]" },
    { "pypi-AgEIcHlwaS5vcmc" .. fill(120, ALNUM, 12), "[REDACTED:pypi-token]" },
    { "hf_" .. fill(34, ALNUM, 13), "[REDACTED:huggingface-token]" },
    { "ATATT3" .. fill(186, ALNUM, 14), "[REDACTED:atlassian-token]" },
    { "eyJ" .. fill(30, ALNUM, 15) .. "." .. fill(60, ALNUM, 16) .. "." .. fill(43, ALNUM, 17),
      "[REDACTED:jwt]" },
  }
  for _, c in ipairs(cases) do
    local out = assert_gone("got " .. c[1] .. " ok\n", c[1], c[2])
    lu.assertEquals(out, "got " .. c[2] .. " ok\n")
  end
end

function TestStreaming.test_keys_longer_than_any_window()
  -- ~13 KB (an RSA-16384 key's size) and ~40 KB (a PGP key with subkeys)
  for _, spec in ipairs { { "RSA " .. PK, 200 }, { "PGP " .. PK .. " BLOCK", 640 } } do
    local key = pem(spec[1], spec[2], 7)
    local out, n = redact_all("$ cat key\n" .. key .. "\n$ ")
    lu.assertEquals(out, "$ cat key\n[REDACTED:private-key]\n$ ")
    lu.assertEquals(n, 1)
  end
end

function TestStreaming.test_keys_in_diff_hunks()
  for _, mark in ipairs { "-", "+", " " } do
    local key = pem("OPENSSH " .. PK, 20, 9, mark)
    local out = redact_all("@@ -1,22 +0,0 @@\n" .. key .. "\n")
    -- the first line's marker is before the key and stays
    lu.assertEquals(out, "@@ -1,22 +0,0 @@\n" .. mark .. "[REDACTED:private-key]\n", "hunk " .. mark)
  end
end

function TestStreaming.test_a_key_in_a_json_string()
  local key = pem(PK, 10, 11):gsub("\n", "\\n")
  local out = redact_all('{"private_key": "' .. key .. '\\n", "x": 1}')
  lu.assertEquals(out, '{"private_key": "[REDACTED:private-key]\\n", "x": 1}')
end

-- A possible secret held past limits.redact_hold fails closed: nothing of it leaves.
function TestStreaming.test_hold_limit_fails_closed()
  local tail = fill(64, B64, 13)
  local text = DASH5 .. "BEGIN RSA " .. PK .. DASH5 .. "\n" .. string.rep(tail .. "\n", 200)
  for _, c in ipairs { 0, 1, 100, 4096 } do
    local out = redact(text .. "tail", c, "cat", HOLD)
    lu.assertNotStrContains(out, tail)
    lu.assertStrContains(out, "[stockade: output withheld: a possible secret outgrew limits.redact_hold]")
  end
  -- under the limit, an unterminated block is ordinary text at the end
  local short = DASH5 .. "BEGIN RSA " .. PK .. DASH5 .. "\n" .. tail .. "\n"
  lu.assertEquals(redact(short, 1, "cat", HOLD), short)
end

-- ---- literals and the Lua stage -------------------------------------------------------

TestStages = {}

function TestStages.test_literals_match_magic_characters_literally()
  lu.assertEquals(redact_all("pw=p%a.s-s(w)[o]r*d+?^$; again p%a.s-s(w)[o]r*d+?^$"),
                  "pw=[REDACTED:DB_PASSWORD]; again [REDACTED:DB_PASSWORD]")
  lu.assertEquals(redact_all("aXbXcXdXe a.b.c.d.e"), "aXbXcXdXe [REDACTED:DOTS]")
end

function TestStages.test_lua_function_redactors_run_after_the_regex_stage()
  local tok = "ghp_" .. fill(36, ALNUM, 4)
  local out = redact_all("x LUASECRET42 " .. tok .. " y", "lua")
  lu.assertEquals(out, "x [L] [REDACTED:github-token] y")
  local _, n = redact("LUASECRET1 LUASECRET2", 0, "cat")
  lu.assertEquals(n, 0)                    -- only the tool that declares it
end

function TestStages.test_classify_messages_are_redacted()
  local class, _, message = P:classify("leaky", { exit_code = 1, stdout_tail = "", stderr_tail = "" })
  lu.assertEquals(class, "TOOL_ERROR")
  lu.assertEquals(message, "push to https://ci:[REDACTED]@git.example failed")
end

-- ---- literal(), env_redactors() (plain Lua) -----------------------------------------------

TestLiteral = {}

function TestLiteral.test_shape_and_short_values()
  local r = secrets.literal("abcdefgh", "A%B")
  lu.assertEquals(r, { name = "A%B", literal = "abcdefgh", replace = "[REDACTED:A%B]" })
  lu.assertNil(secrets.literal("1234567", "X"))     -- 7 bytes
  lu.assertNil(secrets.literal("", "X"))
  lu.assertNil(secrets.literal(nil, "X"))
  lu.assertNil(secrets.literal(12345678, "X"))
  lu.assertEquals(secrets.literal("REDACTED", "REDACTED").replace, "[***]")
end

TestEnv = {}

local ENV = {
  GITHUB_TOKEN = "gh-" .. fill(30, ALNUM, 1),
  NPM_TOKEN = "npm_" .. fill(20, ALNUM, 2),
  SHORT_TOKEN = "abc123",                       -- matches, too short: skipped
  AWS_SECRET_ACCESS_KEY = fill(40, B64, 9),
  AWS_DEFAULT_OUTPUT = "json",                  -- matches, too short: skipped
  SSH_AUTH_SOCK = "/tmp/ssh-" .. fill(10, ALNUM, 3) .. "/agent.4242",
  TOKEN_FILE = "/run/secrets/" .. fill(10, ALNUM, 4),  -- "*_TOKEN" is anchored: no
  HOME = "/home/agent-user",
}
local GLOBS = { "*_TOKEN", "AWS_*", "SSH_AUTH_SOCK" }

function TestEnv.test_globs_order_and_short_values()
  local rs = secrets.env_redactors(GLOBS, ENV)
  local names = {}
  for i, r in ipairs(rs) do names[i] = r.name end
  lu.assertEquals(names, { "env:AWS_SECRET_ACCESS_KEY", "env:GITHUB_TOKEN", "env:SSH_AUTH_SOCK",
                           "env:NPM_TOKEN" })
  for _, r in ipairs(rs) do
    local var = r.name:sub(5)
    lu.assertEquals(r.literal, ENV[var])
    lu.assertEquals(r.replace, "[REDACTED:" .. var .. "]")
  end
end

function TestEnv.test_glob_to_pattern_escapes_magic()
  lu.assertEquals(secrets.glob_pattern("AWS_*"), "^AWS_.*$")
  lu.assertEquals(secrets.glob_pattern("*_TOKEN"), "^.*_TOKEN$")
  local rs = secrets.env_redactors({ "A.B*", "X-%Y", "P(1)*", "*_KEY_*" }, {
    ["A.B1"] = "value-one-long", AXB1 = "value-two-long", ["X-%Y"] = "value-three-long",
    ["X-%YZ"] = "value-four-long", ["P(1)Q"] = "value-five-long", P1Q = "value-six-long",
    MY_KEY_ID = "value-seven-long", MY_KEY = "value-eight-long",
  })
  local names = {}
  for _, r in ipairs(rs) do names[#names + 1] = r.name end
  table.sort(names)
  lu.assertEquals(names, { "env:A.B1", "env:MY_KEY_ID", "env:P(1)Q", "env:X-%Y" })
end

function TestEnv.test_duplicates_and_bad_input()
  local long = "outer-" .. fill(20, ALNUM, 5)
  local rs = secrets.env_redactors({ "*_TOKEN" }, { A_TOKEN = long:sub(7, 20), B_TOKEN = long, C_TOKEN = long })
  lu.assertEquals(#rs, 2)
  lu.assertEquals(rs[1].name, "env:B_TOKEN")
  lu.assertEquals(secrets.env_redactors(nil, nil), {})
  lu.assertEquals(secrets.env_redactors({ "*" }, { X = 42, Y = true }), {})
  lu.assertErrorMsgContains("not a string", secrets.env_redactors, { 42 }, ENV)
end

os.exit(lu.LuaUnit.run())
