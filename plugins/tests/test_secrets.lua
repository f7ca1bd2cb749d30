-- LuaUnit tests of plugins/secrets.lua.
--   cd /work/main && lua5.4 plugins/tests/test_secrets.lua
--
-- Every token below is synthetic and built at run time (prefix .. generated characters),
-- so this file contains nothing a secret scanner would flag.

local here = arg and arg[0] and arg[0]:match("^(.*)/plugins/tests/[^/]*$")
package.path = "./plugins/?.lua;./?.lua;"
  .. (here and (here .. "/plugins/?.lua;" .. here .. "/?.lua;") or "") .. package.path

local lu = require "luaunit"
local secrets = require "secrets"

-- ---- helpers ----------------------------------------------------------------------

local UPPER = "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
local ALNUM = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
local B64URL = ALNUM .. "-_"
local B64 = ALNUM .. "+/"
local HEX = "0123456789abcdef"
local DIGITS = "0123456789"

-- n characters of `alphabet`, in a scrambled but reproducible order; `k` varies it.
local function fill(n, alphabet, k)
  local out = {}
  for i = 0, n - 1 do
    local j = (i * 7 + (k or 0) * 13 + (i * i) % 11) % #alphabet + 1
    out[#out + 1] = alphabet:sub(j, j)
  end
  return table.concat(out)
end

local by_name = {}
for _, r in ipairs(secrets.default) do by_name[r.name] = r end

local function apply1(name, text) return secrets.apply(text, { by_name[name] }) end

-- every match of r in text: list of {a, b}
local function matches(r, text)
  local out, init = {}, 1
  while init <= #text + 1 do
    local a, b = text:find(r.pattern, init)
    if not a then break end
    out[#out + 1] = { a, b }
    init = (b >= a) and b + 1 or a + 1
  end
  return out
end

local BEGIN, END, DASH5 = "-----BEGIN ", "-----END ", "-----"
local PK = "PRIVATE" .. " KEY"
local function pem(label, body)
  return BEGIN .. label .. DASH5 .. "\n" .. body .. "\n" .. END .. label .. DASH5
end
local function b64_lines(nlines, k)
  local t = {}
  for i = 1, nlines do t[i] = fill(64, B64, k + i) end
  return table.concat(t, "\n")
end

local SLACK_HOST = "hooks.slack" .. ".com/services/"
local function webhook(k)
  return "https://" .. SLACK_HOST .. "T" .. fill(8, UPPER, k) .. "/B" .. fill(10, UPPER, k + 1)
         .. "/" .. fill(24, ALNUM, k + 2)
end

local JWT_HEADER = "eyJ" .. "hbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9"
local function jwt(k, sig)
  return JWT_HEADER .. "." .. "eyJ" .. fill(45, B64URL, k) .. "." .. (sig or fill(43, B64URL, k + 1))
end

local AWS_SECRET = fill(40, B64, 3)
local AWS_SECRET2 = fill(40, B64, 8)

-- ---- the cases: for every redactor, positives and near-miss negatives --------------
-- positive: { input, expected, count (default 1), single = expected under that
-- redactor alone when it differs from the full set }. negative: input, or
-- { input, full = false } when only that redactor must leave it alone (another entry
-- of the set may rightly take it).

local R = {}
local function tok(name, pos, neg) R[name] = { pos = pos, neg = neg } end

-- private keys
do
  local M = "[REDACTED:private-key]"
  tok("private-key", {
    { "key:\n" .. pem("RSA " .. PK, b64_lines(6, 1)) .. "\ndone", "key:\n" .. M .. "\ndone" },
    { pem("OPENSSH " .. PK, b64_lines(4, 2)), M },
    { pem("EC " .. PK, b64_lines(3, 3)) .. "\n", M .. "\n" },
    { pem("DSA " .. PK, b64_lines(3, 4)), M },
    { pem(PK, b64_lines(5, 5)), M },
    { pem("ENCRYPTED " .. PK, b64_lines(5, 6)), M },
    { pem("PGP " .. PK .. " BLOCK", "Version: x\n\n" .. b64_lines(4, 8) .. "\n=" .. fill(4, B64, 1)), M },
    -- inside JSON (a service-account file): "\n" escapes, one line
    { '{"private_key": "' .. (pem(PK, fill(64, B64, 9) .. "\\n" .. fill(40, B64, 10)):gsub("\n", "\\n"))
        .. '\\n", "x": 1}', '{"private_key": "' .. M .. '\\n", "x": 1}' },
  }, {
    pem("PUBLIC KEY", b64_lines(3, 11)),
    pem("CERTIFICATE", b64_lines(3, 12)),
    pem("RSA PUBLIC KEY", b64_lines(3, 13)),
    (pem("RSA " .. PK, b64_lines(2, 14)):lower()),                 -- "-----begin ..."
    BEGIN .. "RSA " .. PK .. DASH5 .. "\n" .. b64_lines(3, 15) .. "\n" .. END .. "RSA PUBLIC KEY" .. DASH5,
  })
  local function legacy(label, k)
    return pem(label, "Proc-Type: 4,ENCRYPTED\nDEK-Info: AES-128-CBC," .. fill(32, "0123456789ABCDEF", k)
                      .. "\n\n" .. b64_lines(4, k))
  end
  tok("private-key-encrypted", {
    { "$ cat server.key\n" .. legacy("RSA " .. PK, 16) .. "\n$ ", "$ cat server.key\n" .. M .. "\n$ " },
    { legacy("EC " .. PK, 17), M },
    { legacy("DSA " .. PK, 18) .. "\r\n", M .. "\r\n" },
  }, {
    legacy("PUBLIC KEY", 19),
    legacy("CERTIFICATE", 20),
    (legacy("RSA " .. PK, 21):gsub("DEK%-Info", "DEK-Inf0")),
  })
end

-- JWT
tok("jwt", {
  { "token=" .. jwt(1), "token=[REDACTED:jwt]" },
  { "Authorization: Bearer " .. jwt(2), "Authorization: Bearer [REDACTED:jwt]" },
  { '{"id_token":"' .. jwt(3) .. '"}', '{"id_token":"[REDACTED:jwt]"}' },
  { "alg none: " .. jwt(4, "") .. " end", "alg none: [REDACTED:jwt] end" },
}, {
  JWT_HEADER .. "." .. fill(40, B64URL, 5),                          -- two segments
  ("eyJ" .. fill(30, B64URL, 6) .. "." .. fill(20, B64URL) .. "." .. fill(20, B64URL)):gsub("^eyJ", "eyj"),
  "eyJ" .. fill(9, ALNUM, 1) .. "." .. fill(20, ALNUM, 2) .. "." .. fill(20, ALNUM, 3),  -- header too short
  "x" .. jwt(7),                                                     -- inside a word
})

-- Anthropic, OpenAI
do
  local ant = "sk-ant-" .. "api03-" .. fill(93, B64URL, 1) .. "AA"
  local ant2 = "sk-ant-" .. "admin01-" .. fill(90, B64URL, 2) .. "AA"
  local A = "[REDACTED:anthropic-api-key]"
  tok("anthropic-api-key", {
    { "ANTHROPIC_API_KEY=" .. ant, "ANTHROPIC_API_KEY=" .. A },
    { '"x-api-key": "' .. ant2 .. '"', '"x-api-key": "' .. A .. '"' },
    { "sk-ant-" .. fill(20, ALNUM, 3) .. " short but enough", A .. " short but enough" },
  }, {
    "sk-ant-" .. fill(19, ALNUM, 4),                                   -- one too short
    "SK-ANT-" .. fill(40, ALNUM, 5),                                   -- upper case
    "task-ant-" .. fill(40, ALNUM, 6),                                 -- inside a word
    { "sk_ant_" .. fill(40, ALNUM, 7), full = true },                  -- wrong separator
  })
  local O = "[REDACTED:openai-api-key]"
  for _, k in ipairs { { "openai-project-key", "proj" }, { "openai-service-account-key", "svcacct" },
                       { "openai-admin-key", "admin" } } do
    local key = "sk-" .. k[2] .. "-" .. fill(156, B64URL, #k[2])
    tok(k[1], {
      { "OPENAI_API_KEY=" .. key, "OPENAI_API_KEY=" .. O },
      { "use " .. key .. ". Then", "use " .. O .. ". Then" },
      { "sk-" .. k[2] .. "-" .. fill(20, B64URL, 9), O },
    }, {
      "sk-" .. k[2] .. "-" .. fill(19, ALNUM, 1),                      -- one too short
      ("sk-" .. k[2] .. "-" .. fill(40, ALNUM, 2)):upper(),            -- upper case
      "task-" .. k[2] .. "-" .. fill(40, ALNUM, 3),                    -- inside a word
    })
  end
  tok("openai-api-key", {
    { "key: sk-" .. fill(48, ALNUM, 1), "key: " .. O },
    { "export OPENAI_API_KEY='sk-" .. fill(48, ALNUM, 2) .. "'", "export OPENAI_API_KEY='" .. O .. "'" },
    { "sk-" .. fill(20, ALNUM, 3) .. "-" .. fill(30, B64URL, 4), O },
  }, {
    "sk-" .. fill(19, ALNUM, 5),                                       -- one too short
    "class=sk-loading-spinner-container-wrapper-element",              -- kebab-case name
    "a skeleton-key opens the task-" .. fill(30, ALNUM, 6),            -- "sk" in words
    "SK-" .. fill(48, UPPER, 7),                                       -- upper-case prefix
  })
end

-- AWS
for _, k in ipairs { { "aws-access-key", "AKIA" }, { "aws-temp-access-key", "ASIA" } } do
  local id = k[2] .. fill(16, UPPER, #k[1])
  local M = "[REDACTED:aws-access-key]"
  tok(k[1], {
    { "aws_access_key_id = " .. id, "aws_access_key_id = " .. M },
    { "key=" .. k[2] .. "ABCDEFGHIJKLMNOP", "key=" .. M },
    { '{"AccessKeyId": "' .. id .. '", "x": "' .. k[2] .. fill(16, UPPER, 9) .. '"}',
      '{"AccessKeyId": "' .. M .. '", "x": "' .. M .. '"}', 2 },
  }, {
    k[2] .. fill(15, UPPER, 1),                                        -- one too short
    k[2]:lower() .. fill(16, UPPER, 2),                                -- lower-case prefix
    k[2] .. fill(15, UPPER, 3) .. "x",                                 -- a lower-case char
    k[2] .. fill(17, UPPER, 4),                                        -- part of a longer word
    "X" .. k[2] .. fill(16, UPPER, 5),
  })
end
do
  local M = "[REDACTED:aws-secret-access-key]"
  local sha = fill(40, HEX, 1)
  tok("aws-secret-access-key", {
    { "[default]\naws_secret_access_key = " .. AWS_SECRET .. "\n",
      "[default]\naws_secret_access_key = " .. M .. "\n" },
    { "boto3.client(aws_secret_access_key='" .. AWS_SECRET2 .. "')",
      "boto3.client(aws_secret_access_key='" .. M .. "')" },
    { '"aws_secret_access_key"    :    "' .. AWS_SECRET .. '"',           -- the longest form
      '"aws_secret_access_key"    :    "' .. M .. '"' },
    { "aws_secret_access_key:" .. sha, "aws_secret_access_key:" .. M },  -- context makes it one
  }, {
    "commit " .. sha,                                                  -- a git SHA: no context
    "aws_secret_access_key = " .. AWS_SECRET:sub(1, 39),               -- one too short
    "aws_secret_access_key = " .. AWS_SECRET .. "A",                   -- one too long
    "aws_secret_access_key = " .. AWS_SECRET:sub(1, 20) .. "-" .. AWS_SECRET:sub(22),
    "aws_secret_access_key      = " .. AWS_SECRET,                     -- 6 blanks: not an assignment we know
  })
  tok("aws-secret-access-key-env", {
    { "AWS_SECRET_ACCESS_KEY=" .. AWS_SECRET, "AWS_SECRET_ACCESS_KEY=" .. M },
    { 'export AWS_SECRET_ACCESS_KEY="' .. AWS_SECRET2 .. '"\n',
      'export AWS_SECRET_ACCESS_KEY="' .. M .. '"\n' },
  }, {
    "AWS_SECRET_ACCESS_KEY=$AWS_SECRET",
    "AWS_SECRET_ACCESS_KEY=" .. AWS_SECRET:sub(2),                     -- one too short
    "AWS_SECRET_ACCESS_KEYS=" .. AWS_SECRET,                           -- another name
    "sha1 " .. sha,
  })
  tok("aws-secret-access-key-json", {
    { '"SecretAccessKey": "' .. AWS_SECRET .. '",', '"SecretAccessKey": "' .. M .. '",' },
    { "SecretAccessKey: " .. AWS_SECRET2, "SecretAccessKey: " .. M },
  }, {
    '"SecretAccessKey": "' .. AWS_SECRET:sub(1, 39) .. '"',            -- one too short
    '"secretaccesskey": "' .. AWS_SECRET .. '"',                       -- lower case
    '"SecretAccessKeyId": "' .. AWS_SECRET .. '"',
  })
end

-- GitHub, GitLab, Slack, Stripe
do
  local G = "[REDACTED:github-token]"
  local fg = "github_pat_" .. "11" .. fill(20, ALNUM, 1) .. "_" .. fill(59, ALNUM, 2)
  tok("github-fine-grained-pat", {
    { "GH_TOKEN=" .. fg, "GH_TOKEN=" .. G },
    { "token " .. "github_pat_" .. fill(40, ALNUM, 3) .. " ok", "token " .. G .. " ok" },
  }, {
    "github_pat_" .. fill(39, ALNUM, 4),                               -- one too short
    "github-pat-" .. fill(82, ALNUM, 5),                               -- wrong separator
    "GITHUB_PAT_" .. fill(82, ALNUM, 6),                               -- upper case
  })
  for i, k in ipairs { { "github-pat", "ghp_" }, { "github-oauth-token", "gho_" },
                       { "github-user-token", "ghu_" }, { "github-server-token", "ghs_" },
                       { "github-refresh-token", "ghr_" } } do
    local t = k[2] .. fill(36, ALNUM, i)
    tok(k[1], {
      { "token " .. t, "token " .. G },
      { "https://x-access-token:" .. t .. "@github.com/org/repo.git",
        "https://x-access-token:" .. G .. "@github.com/org/repo.git" },
      { "refresh=" .. k[2] .. fill(76, ALNUM, i + 1), "refresh=" .. G },
    }, {
      k[2] .. fill(35, ALNUM, i),                                      -- one too short
      k[2]:upper() .. fill(36, ALNUM, i),                              -- upper case
      k[2]:sub(1, 3) .. "-" .. fill(36, ALNUM, i),                     -- wrong separator
      "x" .. t,                                                        -- inside a word
    })
  end
  local gl = "glpat-" .. fill(20, ALNUM .. "_-", 1)
  tok("gitlab-token", {
    { "PRIVATE-TOKEN: " .. gl, "PRIVATE-TOKEN: [REDACTED:gitlab-token]" },
    { "https://oauth2:" .. gl .. "@gitlab.com/g/p.git",
      "https://oauth2:[REDACTED:gitlab-token]@gitlab.com/g/p.git" },
  }, {
    "glpat-" .. fill(19, ALNUM, 2),                                    -- one too short
    "glpat_" .. fill(20, ALNUM, 3),                                    -- wrong separator
    "GLPAT-" .. fill(20, ALNUM, 4),                                    -- upper case
  })
  local S = "[REDACTED:slack-token]"
  tok("slack-token", {
    { "SLACK_BOT_TOKEN=xoxb-" .. fill(12, DIGITS, 1) .. "-" .. fill(13, DIGITS, 2) .. "-"
        .. fill(24, ALNUM, 3), "SLACK_BOT_TOKEN=" .. S },
    { "xoxp-" .. fill(11, DIGITS, 4) .. "-" .. fill(11, DIGITS, 5) .. "-" .. fill(12, DIGITS, 6)
        .. "-" .. fill(32, HEX, 7) .. "\n", S .. "\n" },
    { "a xoxa-2-" .. fill(40, ALNUM, 8) .. " b", "a " .. S .. " b" },
    { "xoxr-" .. fill(30, ALNUM, 9), S },
    { "xoxs-" .. fill(30, ALNUM, 10), S },
  }, {
    "xoxb-" .. fill(9, DIGITS, 11),                                    -- one too short
    "xoxz-" .. fill(30, ALNUM, 12),                                    -- wrong type letter
    "XOXB-" .. fill(30, ALNUM, 13),                                    -- upper case
    "xoxb_" .. fill(30, ALNUM, 14),                                    -- wrong separator
  })
  local W = "https://" .. SLACK_HOST .. "[REDACTED:slack-webhook]"
  tok("slack-webhook", {
    { "curl -X POST " .. webhook(1) .. " -d @msg.json", "curl -X POST " .. W .. " -d @msg.json" },
    { '{"webhook_url": "' .. webhook(2) .. '"}', '{"webhook_url": "' .. W .. '"}' },
  }, {
    "https://" .. SLACK_HOST .. "T0/B0/" .. fill(10, ALNUM),           -- path too short
    "https://hooks.slack" .. ".com/service/" .. webhook(3):match("services/(.*)$"),  -- not /services/
    "https://HOOKS.SLACK" .. ".COM/SERVICES/" .. webhook(4):match("services/(.*)$"),
  })
  for i, k in ipairs { { "stripe-secret-key", "sk_live_" }, { "stripe-restricted-key", "rk_live_" },
                       { "stripe-test-key", "sk_test_" }, { "stripe-restricted-test-key", "rk_test_" } } do
    local key = k[2] .. fill(24, ALNUM, i)
    tok(k[1], {
      { "STRIPE_KEY=" .. key, "STRIPE_KEY=[REDACTED:stripe-key]" },
      { "Stripe.api_key = '" .. k[2] .. fill(99, ALNUM, i + 1) .. "'",
        "Stripe.api_key = '[REDACTED:stripe-key]'" },
    }, {
      k[2] .. fill(23, ALNUM, i),                                      -- one too short
      "pk" .. k[2]:sub(3) .. fill(24, ALNUM, i),                       -- publishable prefix
      k[2]:upper() .. fill(24, ALNUM, i),                              -- upper case
      k[2]:sub(1, -2) .. "-" .. fill(24, ALNUM, i),                    -- wrong separator
    })
  end
end

-- URL credentials
do
  local pw = "hunter2" .. "-" .. fill(12, ALNUM, 1)
  tok("url-password", {
    { "cloning https://bob:" .. pw .. "@example.com/x.git",
      "cloning https://bob:[REDACTED]@example.com/x.git" },
    { "postgres://app:" .. pw .. "@db.internal:5432/app?sslmode=require",
      "postgres://app:[REDACTED]@db.internal:5432/app?sslmode=require" },
    { "redis://:" .. pw .. "@cache:6379/0", "redis://:[REDACTED]@cache:6379/0" },
    { "https://bob:" .. "p@ss:w0rd%21" .. "@example.com/", "https://bob:[REDACTED]@example.com/" },
    { "a ftp://u:" .. "one" .. "@h1 and amqp://v:" .. "two" .. "@h2.",
      "a ftp://u:[REDACTED]@h1 and amqp://v:[REDACTED]@h2.", 2 },
  }, {
    "https://example.com:8443/path?q=1",                               -- a port, no user
    "ssh://git@github.com/org/repo.git",                               -- a user, no password
    "https://bob@example.com:443/x@y",
    "mailto:bob:x@example.com",                                        -- no "://"
    "http://[::1]:8080/",
  })
end

-- Authorization headers
do
  local opaque = "ya29." .. fill(60, B64URL, 1)
  local B = "[REDACTED:bearer-token]"
  tok("authorization-bearer", {
    { "> Authorization: Bearer " .. opaque .. "\r\n", "> Authorization: Bearer " .. B .. "\r\n" },
    { "authorization: bearer " .. fill(32, HEX, 2), "authorization: bearer " .. B },
    { "curl -H 'AUTHORIZATION: BEARER " .. fill(40, B64, 3) .. "==' x",
      "curl -H 'AUTHORIZATION: BEARER " .. B .. "' x" },
    { '{"Authorization": "Bearer ' .. opaque .. '"}', '{"Authorization": "Bearer ' .. B .. '"}' },
    { "Proxy-Authorization:Bearer\t" .. fill(16, ALNUM, 4), "Proxy-Authorization:Bearer\t" .. B },
  }, {
    "Authorization: Bearer $TOKEN",
    "Authorization: Bearer <token>",
    "Authorization: Bearer " .. fill(7, ALNUM, 5),                     -- one too short
    'WWW-Authenticate: Bearer realm="api", error="invalid_token"',
  })
  local C = "[REDACTED:basic-credentials]"
  tok("authorization-basic", {
    { "Authorization: Basic " .. fill(24, B64, 6) .. "=", "Authorization: Basic " .. C },
    { "AUTHORIZATION: BASIC " .. fill(16, ALNUM, 7) .. "\n", "AUTHORIZATION: BASIC " .. C .. "\n" },
    { "headers = {'authorization': 'basic " .. fill(12, ALNUM, 8) .. "=='}",
      "headers = {'authorization': 'basic " .. C .. "'}" },
  }, {
    "Authorization: Basic " .. fill(7, ALNUM, 9),                      -- one too short
    'WWW-Authenticate: Basic realm="x"',
    "Authorization: Basic $CREDENTIALS",
    "Authorisation: Basic " .. fill(24, ALNUM, 10),                    -- not the header
  })
end

-- ---- per-redactor tests, generated ---------------------------------------------------

TestRedactors = {}

for _, r in ipairs(secrets.default) do
  local cases = R[r.name] or { pos = {}, neg = {} }
  for i, c in ipairs(cases.pos) do
    TestRedactors[("test_%s_positive_%d"):format(r.name, i)] = function()
      local input, expected, count = c[1], c[2], c[3] or 1
      local out, n = apply1(r.name, input)
      lu.assertEquals(out, c.single or expected)
      lu.assertEquals(n, count)
      out, n = secrets.apply(input)                                   -- the whole set agrees
      lu.assertEquals(out, expected)
      lu.assertEquals(n, count)
      local again, n2 = secrets.apply(out)                            -- idempotent
      lu.assertEquals(again, out)
      lu.assertEquals(n2, 0)
      local ms = matches(r, input)
      lu.assertEquals(#ms, count)
      for _, m in ipairs(ms) do
        local text = input:sub(m[1], m[2])
        lu.assertTrue(#text <= r.window, ("%s: match of %d bytes > window %d"):format(r.name, #text, r.window))
        if r.prefix then lu.assertEquals(text:sub(1, #r.prefix), r.prefix) end
      end
    end
  end
  for i, c in ipairs(cases.neg) do
    TestRedactors[("test_%s_negative_%d"):format(r.name, i)] = function()
      local input = type(c) == "table" and c[1] or c
      local out, n = apply1(r.name, input)
      lu.assertEquals(out, input)
      lu.assertEquals(n, 0)
      if type(c) ~= "table" or c.full ~= false then
        out, n = secrets.apply(input)
        lu.assertEquals(out, input)
        lu.assertEquals(n, 0)
      end
    end
  end
end

-- ---- the set as a whole --------------------------------------------------------------

TestSet = {}

function TestSet.test_every_redactor_has_two_positives_and_two_negatives()
  for _, r in ipairs(secrets.default) do
    local c = R[r.name]
    lu.assertNotNil(c, "no cases for " .. r.name)
    lu.assertTrue(#c.pos >= 2, r.name .. ": fewer than 2 positives")
    lu.assertTrue(#c.neg >= 2, r.name .. ": fewer than 2 negatives")
  end
  for name in pairs(R) do lu.assertNotNil(by_name[name], "cases for unknown redactor " .. name) end
end

function TestSet.test_shape()
  local seen = {}
  for _, r in ipairs(secrets.default) do
    lu.assertIsString(r.name)
    lu.assertNil(seen[r.name], "duplicate name " .. r.name)
    seen[r.name] = true
    lu.assertIsString(r.pattern)
    lu.assertTrue(pcall(string.find, "", r.pattern), r.name .. ": bad pattern")
    lu.assertIsString(r.replace)
    lu.assertStrContains(r.replace, "[REDACTED")
    lu.assertEquals(math.type(r.window), "integer")
    lu.assertTrue(r.window >= 1 and r.window <= 8192, r.name .. ": window out of range")
    if r.prefix ~= nil then
      lu.assertIsString(r.prefix)
      lu.assertTrue(#r.prefix > 0)
      lu.assertTrue(#r.prefix <= r.window)
    end
  end
  -- only the case-insensitive Authorization entries go without a prefix
  lu.assertNil(by_name["authorization-bearer"].prefix)
  lu.assertNil(by_name["authorization-basic"].prefix)
  lu.assertEquals(by_name["aws-access-key"].prefix, "AKIA")
  lu.assertEquals(by_name["aws-access-key"].window, 20)
end

-- The core skips a redactor whose prefix is absent; that must never change a result.
function TestSet.test_prefix_prefilter_changes_nothing()
  for _, r in ipairs(secrets.default) do
    if r.prefix then
      local bare = { name = r.name, pattern = r.pattern, replace = r.replace, window = r.window }
      for _, cases in pairs(R) do
        for _, c in ipairs(cases.pos) do
          local a, na = secrets.apply(c[1], { r })
          local b, nb = secrets.apply(c[1], { bare })
          lu.assertEquals(a, b)
          lu.assertEquals(na, nb)
        end
      end
    end
  end
end

-- For the bounded entries the window is exact: grow every positive match, and pad the
-- prefix with long runs; no match may exceed the window.
function TestSet.test_window_is_an_honest_bound()
  local extra = { "A", "a", "0", "-", "_", "/", "+", ".", "=", ":", "@" }
  for _, r in ipairs(secrets.default) do
    if not r.unbounded then
      local texts = {}
      for _, c in ipairs(R[r.name].pos) do
        for _, m in ipairs(matches(r, c[1])) do
          local last = c[1]:sub(m[2], m[2])
          for _, ch in ipairs { last, table.unpack(extra) } do
            texts[#texts + 1] = c[1]:sub(1, m[2]) .. ch:rep(400) .. c[1]:sub(m[2] + 1)
          end
        end
      end
      for _, ch in ipairs(extra) do
        texts[#texts + 1] = (r.prefix or "") .. fill(300, ALNUM .. ch, #ch)
      end
      for _, t in ipairs(texts) do
        for _, m in ipairs(matches(r, t)) do
          local len = m[2] - m[1] + 1
          lu.assertTrue(len <= r.window, ("%s: %d > window %d"):format(r.name, len, r.window))
        end
      end
    end
  end
end

-- Long hostile runs after every prefix: no "pattern too complex", no runaway
-- backtracking (a few seconds at most for the whole set over ~1.5 MB).
function TestSet.test_hostile_input_is_cheap()
  local t0 = os and os.clock and os.clock()
  for _, r in ipairs(secrets.default) do
    local lead = r.prefix or "Authorization: Bearer "
    for _, ch in ipairs { "A", "a", "-", "/", ":", " " } do
      local text = (lead .. ch:rep(2000) .. " "):rep(10)
      local ok, err = pcall(secrets.apply, text, { r })
      lu.assertTrue(ok, r.name .. ": " .. tostring(err))
    end
  end
  local ok, err = pcall(secrets.apply, ("://" .. ("a"):rep(3000) .. ":" .. ("b"):rep(3000)):rep(20))
  lu.assertTrue(ok, tostring(err))
  -- near-misses of the AWS-secret assignment: bounded blanks, bounded backtracking
  local near = 'aws_secret_access_key"  :  "' .. ("a"):rep(39) .. " "
  lu.assertEquals(select(2, secrets.apply(near:rep(256 * 1024 // #near))), 0)
  -- 1 MiB of BEGIN lines that never END: the body scan must stop at the next "-"
  -- (with ".-" this is quadratic: ~50 s)
  local unit = BEGIN .. "RSA " .. PK .. DASH5 .. "\n" .. b64_lines(3, 1) .. "\n"
  local t1 = os and os.clock and os.clock()
  lu.assertEquals(select(2, secrets.apply(unit:rep(1024 * 1024 // #unit))), 0)
  if t1 then lu.assertTrue(os.clock() - t1 < 5, "unterminated PEM blocks are too slow") end
  if t0 then lu.assertTrue(os.clock() - t0 < 20, "redaction of hostile input is too slow") end
end

function TestSet.test_pem_block_spanning_lines_is_fully_replaced()
  local body = b64_lines(25, 40)
  local text = "$ cat id_rsa\n" .. pem("RSA " .. PK, body) .. "\n$ echo done\n"
  local out, n = secrets.apply(text)
  lu.assertEquals(out, "$ cat id_rsa\n[REDACTED:private-key]\n$ echo done\n")
  lu.assertEquals(n, 1)
  for line in body:gmatch("[^\n]+") do lu.assertNotStrContains(out, line) end
  lu.assertTrue(#pem("RSA " .. PK, body) <= by_name["private-key"].window)
  -- two blocks, and a certificate between them that stays
  local cert = pem("CERTIFICATE", b64_lines(2, 50))
  text = pem("EC " .. PK, b64_lines(2, 51)) .. "\n" .. cert .. "\n" .. pem(PK, b64_lines(2, 52))
  out, n = secrets.apply(text)
  lu.assertEquals(out, "[REDACTED:private-key]\n" .. cert .. "\n[REDACTED:private-key]")
  lu.assertEquals(n, 2)
end

function TestSet.test_multiple_secrets_in_one_text()
  local ghp = "ghp_" .. fill(36, ALNUM, 1)
  local text = table.concat({
    "AWS_ACCESS_KEY_ID=AKIA" .. fill(16, UPPER, 2),
    "AWS_SECRET_ACCESS_KEY=" .. AWS_SECRET,
    "git remote: https://x:" .. ghp .. "@github.com/o/r",
    "db: postgres://app:" .. fill(10, ALNUM, 7) .. "@db:5432/app",
    "slack: " .. webhook(3),
    "> Authorization: Bearer " .. fill(30, B64URL, 4),
    pem("OPENSSH " .. PK, b64_lines(3, 5)),
    "commit " .. fill(40, HEX, 6),
  }, "\n")
  local out, n = secrets.apply(text)
  lu.assertEquals(out, table.concat({
    "AWS_ACCESS_KEY_ID=[REDACTED:aws-access-key]",
    "AWS_SECRET_ACCESS_KEY=[REDACTED:aws-secret-access-key]",
    "git remote: https://x:[REDACTED:github-token]@github.com/o/r",
    "db: postgres://app:[REDACTED]@db:5432/app",
    "slack: https://" .. SLACK_HOST .. "[REDACTED:slack-webhook]",
    "> Authorization: Bearer [REDACTED:bearer-token]",
    "[REDACTED:private-key]",
    "commit " .. fill(40, HEX, 6),
  }, "\n"))
  lu.assertEquals(n, 7)
end

function TestSet.test_idempotent_over_every_positive()
  local all = {}
  for _, cases in pairs(R) do
    for _, c in ipairs(cases.pos) do all[#all + 1] = c[1] end
  end
  local text = table.concat(all, "\n")
  local once, n1 = secrets.apply(text)
  lu.assertTrue(n1 >= #all)
  local twice, n2 = secrets.apply(once)
  lu.assertEquals(twice, once)
  lu.assertEquals(n2, 0)
end

function TestSet.test_ordinary_text_is_left_alone()
  local text = table.concat({
    "commit " .. fill(40, HEX, 1) .. "\nAuthor: Bob <bob@example.com>",
    "sha256:" .. fill(64, HEX, 2),
    "-rw-r--r-- 1 bob staff 1234 Nov 29 10:22 risk-assessment-framework-overview.md",
    "the task-manager and desk-lamp and whisk-attachment-for-kitchen-mixer",
    "uuid 123e4567-e89b-12d3-a456-426614174000",
    "see https://example.com/docs?a=b and http://localhost:8080/x",
    "Authorization header: use the Bearer scheme",
    "base64: " .. fill(120, B64, 3),
    "ghp_ and sk- and xoxb- and AKIA are prefixes",
    "password=hunter2 is handled by the tool's own redact function",
  }, "\n")
  local out, n = secrets.apply(text)
  lu.assertEquals(out, text)
  lu.assertEquals(n, 0)
end

function TestSet.test_order_anthropic_before_openai()
  local key = "sk-ant-" .. "api03-" .. fill(95, B64URL, 1)
  lu.assertEquals((secrets.apply(key)), "[REDACTED:anthropic-api-key]")
  -- the overlap is real: the OpenAI entry alone would take it too
  lu.assertEquals(select(2, apply1("openai-api-key", "sk-" .. fill(20, ALNUM) .. key:sub(4))), 1)
  local ia, io_
  for i, r in ipairs(secrets.default) do
    if r.name == "anthropic-api-key" then ia = i end
    if r.name == "openai-api-key" then io_ = i end
  end
  lu.assertTrue(ia < io_)
end

function TestSet.test_order_jwt_and_tokens_before_headers_and_urls()
  local t = jwt(9)
  lu.assertEquals((secrets.apply("Authorization: Bearer " .. t)), "Authorization: Bearer [REDACTED:jwt]")
  local g = "glpat-" .. fill(20, ALNUM, 9)
  local out, n = secrets.apply("https://oauth2:" .. g .. "@gitlab.example.com")
  lu.assertEquals(out, "https://oauth2:[REDACTED:gitlab-token]@gitlab.example.com")
  lu.assertEquals(n, 1)
end

function TestSet.test_url_credentials_keep_scheme_user_and_host()
  local out, n = secrets.apply("https://bob:" .. fill(16, ALNUM, 1) .. "@example.com")
  lu.assertEquals(out, "https://bob:[REDACTED]@example.com")
  lu.assertEquals(n, 1)
  out = secrets.apply("mysql://root:" .. fill(10, ALNUM, 2) .. "@10.0.0.5:3306/db")
  lu.assertEquals(out, "mysql://root:[REDACTED]@10.0.0.5:3306/db")
end

-- ---- apply ---------------------------------------------------------------------------

TestApply = {}

function TestApply.test_nested_lists_like_a_policy()
  local extra = { name = "x", pattern = "XSECRET%d%d%d%d", replace = "[REDACTED:x]", window = 11,
                  prefix = "XSECRET" }
  local text = "XSECRET1234 AKIA" .. fill(16, UPPER)
  local out, n = secrets.apply(text, { secrets.default, { extra } })
  lu.assertEquals(out, "[REDACTED:x] [REDACTED:aws-access-key]")
  lu.assertEquals(n, 2)
end

function TestApply.test_defaults_and_errors()
  lu.assertEquals({ secrets.apply("nothing here", {}) }, { "nothing here", 0 })
  lu.assertEquals({ secrets.apply("") }, { "", 0 })
  lu.assertErrorMsgContains("text must be a string", secrets.apply, nil)
  lu.assertErrorMsgContains("a redactor is a table", secrets.apply, "x", { "oops" })
end

function TestApply.test_replace_has_gsub_semantics()
  local r = { name = "kv", pattern = "(token=)%w+", replace = "%1[REDACTED:kv] 100%%", window = 64,
              prefix = "token=" }
  lu.assertEquals({ secrets.apply("token=abc", { r }) }, { "token=[REDACTED:kv] 100%", 1 })
end

function TestApply.test_both_require_names_work()
  local other = require "plugins.secrets"
  lu.assertIsTable(other.default)
  lu.assertEquals(#other.default, #secrets.default)
  for i, r in ipairs(other.default) do lu.assertEquals(r.name, secrets.default[i].name) end
end

-- The module needs nothing beyond base/string/table/math/utf8.
function TestApply.test_loads_in_the_policy_sandbox()
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
  local chunk = assert(load(src, "=secrets", "t", env))
  local m = chunk()
  lu.assertEquals(#m.default, #secrets.default)
  lu.assertEquals((m.apply("key=AKIA" .. fill(16, UPPER))), "key=[REDACTED:aws-access-key]")
  local known = { string = true, table = true, math = true, utf8 = true }
  for k in pairs(env) do
    lu.assertTrue(known[k] or _G[k] ~= nil, "the module set a global " .. tostring(k))
  end
end

-- ---- literal ---------------------------------------------------------------------------

TestLiteral = {}

function TestLiteral.test_magic_characters_match_literally()
  local value = "p%a.s-s(w)[o]r*d+?^$"
  local r = secrets.literal(value, "DB_PASSWORD")
  lu.assertEquals(r.window, #value)
  lu.assertEquals(r.prefix, value)
  lu.assertEquals(r.name, "DB_PASSWORD")
  local out, n = secrets.apply("pw=" .. value .. "; again " .. value, { r })
  lu.assertEquals(out, "pw=[REDACTED:DB_PASSWORD]; again [REDACTED:DB_PASSWORD]")
  lu.assertEquals(n, 2)
  -- what the magic characters would have matched as a pattern stays
  local dots = secrets.literal("a.b.c.d.e", "DOTS")
  lu.assertEquals({ secrets.apply("aXbXcXdXe", { dots }) }, { "aXbXcXdXe", 0 })
  lu.assertEquals({ secrets.apply("a.b.c.d.e", { dots }) }, { "[REDACTED:DOTS]", 1 })
  local pct = secrets.literal("100%d-off", "PCT")
  lu.assertEquals({ secrets.apply("1005-off 100%d-off", { pct }) }, { "1005-off [REDACTED:PCT]", 1 })
end

function TestLiteral.test_short_values_are_refused()
  lu.assertNil(secrets.literal("1234567", "X"))     -- 7 bytes
  lu.assertNil(secrets.literal("", "X"))
  lu.assertNil(secrets.literal(nil, "X"))
  lu.assertNil(secrets.literal(12345678, "X"))
  lu.assertNotNil(secrets.literal("12345678", "X"))  -- 8 bytes is enough
end

function TestLiteral.test_marker_is_inert()
  local r = secrets.literal("REDACTED", "REDACTED")  -- the value is inside its own marker
  local out, n = secrets.apply("x REDACTED y", { r })
  lu.assertEquals(n, 1)
  lu.assertEquals({ secrets.apply(out, { r }) }, { out, 0 })
  local p = secrets.literal("abcdefgh", "A%B")       -- "%" in the name
  lu.assertEquals({ secrets.apply("abcdefgh", { p }) }, { "[REDACTED:A%B]", 1 })
end

-- ---- env_redactors ---------------------------------------------------------------------

TestEnv = {}

local ENV = {
  GITHUB_TOKEN = "gh-" .. fill(30, ALNUM, 1),
  NPM_TOKEN = "npm_" .. fill(20, ALNUM, 2),
  SHORT_TOKEN = "abc123",                       -- matches, too short: skipped
  AWS_SECRET_ACCESS_KEY = AWS_SECRET,
  AWS_DEFAULT_OUTPUT = "json",                  -- matches, too short: skipped
  SSH_AUTH_SOCK = "/tmp/ssh-" .. fill(10, ALNUM, 3) .. "/agent.4242",
  TOKEN_FILE = "/run/secrets/" .. fill(10, ALNUM, 4),  -- "*_TOKEN" is anchored: no
  HOME = "/home/agent-user",
  PATH = "/usr/bin:/bin",
}
local GLOBS = { "*_TOKEN", "AWS_*", "SSH_AUTH_SOCK" }

function TestEnv.test_globs_and_short_values()
  local rs = secrets.env_redactors(GLOBS, ENV)
  local names = {}
  for i, r in ipairs(rs) do names[i] = r.name end
  -- longest value first
  lu.assertEquals(names, { "env:AWS_SECRET_ACCESS_KEY", "env:GITHUB_TOKEN", "env:SSH_AUTH_SOCK",
                           "env:NPM_TOKEN" })
  for _, r in ipairs(rs) do
    local var = r.name:sub(5)
    lu.assertEquals(r.prefix, ENV[var])
    lu.assertEquals(r.window, #ENV[var])
    lu.assertEquals(r.replace, "[REDACTED:" .. var .. "]")
  end
  local text = "token " .. ENV.GITHUB_TOKEN .. " sock " .. ENV.SSH_AUTH_SOCK .. " home " .. ENV.HOME
               .. " out json abc123"
  local out, n = secrets.apply(text, rs)
  lu.assertEquals(out, "token [REDACTED:GITHUB_TOKEN] sock [REDACTED:SSH_AUTH_SOCK] home "
                       .. ENV.HOME .. " out json abc123")
  lu.assertEquals(n, 2)
end

function TestEnv.test_glob_to_pattern_escapes_magic()
  lu.assertEquals(secrets.glob_pattern("AWS_*"), "^AWS_.*$")
  lu.assertEquals(secrets.glob_pattern("*_TOKEN"), "^.*_TOKEN$")
  lu.assertEquals(secrets.glob_pattern("SSH_AUTH_SOCK"), "^SSH_AUTH_SOCK$")
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

function TestEnv.test_duplicates_and_contained_values()
  local long = "outer-" .. fill(20, ALNUM, 5)
  local inner = long:sub(7, 20)
  local rs = secrets.env_redactors({ "*_TOKEN" }, { A_TOKEN = inner, B_TOKEN = long, C_TOKEN = long })
  lu.assertEquals(#rs, 2)                              -- one per distinct value
  lu.assertEquals(rs[1].name, "env:B_TOKEN")           -- the longer value first
  local out, n = secrets.apply("x " .. long .. " y " .. inner, rs)
  lu.assertEquals(out, "x [REDACTED:B_TOKEN] y [REDACTED:A_TOKEN]")
  lu.assertEquals(n, 2)
end

function TestEnv.test_empty_and_bad_input()
  lu.assertEquals(secrets.env_redactors({}, ENV), {})
  lu.assertEquals(secrets.env_redactors(GLOBS, {}), {})
  lu.assertEquals(secrets.env_redactors(nil, nil), {})
  lu.assertEquals(secrets.env_redactors({ "*" }, { X = 42, Y = true }), {})
  lu.assertErrorMsgContains("not a string", secrets.env_redactors, { 42 }, ENV)
end

os.exit(lu.LuaUnit.run())
