-- plugins/secrets.lua — the default secret-redaction set.
--
--   local secrets = require "plugins.secrets"
--   return stockade.policy { ..., redact = { secrets.default }, ... }
--
-- Requires nothing: it runs in the policy sandbox (base, string, table, math, utf8).
--
-- A declarative redactor is
--
--   { name = "aws-access-key", pattern = LUA_PATTERN, replace = STR, window = N,
--     prefix = "AKIA" }
--
--   pattern  a Lua 5.4 pattern, applied with string.gsub (no alternation: where a secret
--            has several shapes there are several entries).
--   replace  a string.gsub replacement string: "%1" is the first capture, "%%" a literal
--            percent sign. Entries that keep some context readable (the key name of an
--            assignment, the Authorization header, the user of a URL) capture it and put
--            it back with "%1".
--   window   the longest text the pattern can match. The core keeps that many bytes
--            between streaming chunks so that a secret split across two reads is still
--            found. For most entries it is an exact bound: variable-length tokens are
--            written as  LITERAL .. CLASS x min .. CLASS? x (max - min)  with nothing
--            after the optional run, so the pattern can never match more than
--            #LITERAL + max bytes. (Nothing may follow such a run: a run of k optional
--            items followed by something that can fail backtracks through 2^k paths.
--            And Lua limits a pattern to ~200 nested items, so every run stays <= 150.
--            Matching is one C call, out of reach of the hooks' instruction budget:
--            every entry here stays linear on hostile input; see the tests.)
--            Six entries cannot be bounded that way — their variable part ends in a
--            delimiter ("-----END ...", ".", "@") or is of arbitrary length — and are
--            marked `unbounded = true`: there the window is a practical cap (the largest
--            realistic secret), a match longer than it is still redacted when it arrives
--            in one piece, but may be missed when it is cut across two reads.
--   prefix   a literal that every match starts with (it is always at offset 0 of the
--            match). The core runs the pattern only when memmem finds it in the text;
--            nil when the pattern has no literal start (the case-insensitive
--            Authorization entries), which makes the core run it on every chunk.
--   name     unique per entry; the marker in `replace` names the kind of secret, which
--            several entries share ("[REDACTED:aws-access-key]" for AKIA and ASIA ids).
--
-- Order matters where patterns overlap; M.default is applied first to last:
--   1. private keys (PEM)     a key body is base64 and may contain anything below;
--                             the whole block goes as one redaction
--   2. jwt                    before the Authorization entries, so "Bearer eyJ..." is
--                             reported as a JWT; before the sk- entries (a JWT segment
--                             can contain "sk-")
--   3. anthropic (sk-ant-)    before OpenAI: "sk-" would match it too
--   4. openai project / service-account / admin keys (sk-proj-, sk-svcacct-, sk-admin-),
--      then the generic openai sk- entry
--   5. aws access key ids, aws secret access keys (assignment contexts only)
--   6. github (fine-grained, then ghp_/gho_/ghu_/ghs_/ghr_), gitlab, slack, stripe
--   7. url-password           after the token entries, so a known token inside a URL
--                             ("https://x:ghp_...@github.com") is reported by its kind
--   8. authorization bearer / basic   last, for the same reason
-- Every replacement text is inert: no entry matches "[REDACTED:...]", so applying the
-- set twice changes nothing the second time.

local M = {}

-- ---- helpers ----------------------------------------------------------------------

local function escape(s)                  -- a literal as a Lua pattern
  return (s:gsub("[%^%$%(%)%%%.%[%]%*%+%-%?]", "%%%0"))
end

local function rep(class, n) return string.rep(class, n) end
local function upto(class, n) return string.rep(class .. "?", n) end

local function marker(kind) return "[REDACTED:" .. kind .. "]" end

local default = {}

local function add(r)
  r.replace = r.replace or marker(r.kind or r.name)
  r.kind = nil
  default[#default + 1] = r
end

-- A token: a literal prefix, then min..max characters of `class`. `lead` is a frontier
-- that keeps the token from starting inside a longer word ("task-..." is not "sk-...").
-- With min == max and a `tail` frontier the length is exact.
local function token(t)
  local max = t.max or t.min
  add {
    name = t.name, kind = t.kind,
    pattern = (t.lead or "%f[%w]") .. escape(t.prefix) .. rep(t.class, t.min)
              .. upto(t.class, max - t.min) .. (t.tail or ""),
    prefix = t.prefix,
    window = #t.prefix + max,
  }
end

-- ---- 1. private keys --------------------------------------------------------------
-- -----BEGIN <LABEL>-----  ...  -----END <LABEL>-----  where LABEL contains
-- "PRIVATE KEY": RSA, EC, DSA, OPENSSH, ENCRYPTED, plain PKCS#8, "PGP PRIVATE KEY
-- BLOCK". Up to the first END line of a private key (the labels need not agree: a
-- damaged block is still key material). The body is anything but "-" (base64, blanks,
-- armor headers, the "\n" escapes of a key inside a JSON string): so the lazy scan for
-- the END line stops at the next "-", and text full of BEGIN lines without END costs
-- linear time, not quadratic. Legacy OpenSSL-encrypted keys have "Proc-Type:" and
-- "DEK-Info: AES-128-CBC,..." header lines, which contain "-": a second entry.
-- Unbounded (the body is "[^-]-"): 8192 covers an RSA-8192 key (~6.4 KB). An
-- unterminated block (BEGIN without END, e.g. output cut by a size limit) is not
-- redacted.
local PK_BEGIN = "%-%-%-%-%-BEGIN [%u ]-PRIVATE KEY[%u ]-%-%-%-%-%-"
local PK_END = "%-%-%-%-%-END [%u ]-PRIVATE KEY[%u ]-%-%-%-%-%-"
add {
  name = "private-key",
  pattern = PK_BEGIN .. "[^%-]-" .. PK_END,
  prefix = "-----BEGIN ",
  window = 8192,
  unbounded = true,
}
add {
  name = "private-key-encrypted", kind = "private-key",
  pattern = PK_BEGIN .. "%s*Proc%-Type:[^\n]*\nDEK%-Info:[^\n]*\n[^%-]-" .. PK_END,
  prefix = "-----BEGIN ",
  window = 8192,
  unbounded = true,
}

-- ---- 2. JWT -----------------------------------------------------------------------
-- header.payload.signature, base64url; the header is JSON, so it starts with "eyJ"
-- ('{"'). Header >= 13 chars, payload >= 8, signature may be empty (alg "none").
-- Unbounded; 8192 is the size limit of most servers' request headers.
local B64URL = "[%w_%-]"
add {
  name = "jwt",
  pattern = "%f[%w_%-]eyJ" .. rep(B64URL, 10) .. B64URL .. "*%." .. rep(B64URL, 8)
            .. B64URL .. "*%." .. B64URL .. "*",
  prefix = "eyJ",
  window = 8192,
  unbounded = true,
}

-- ---- 3, 4. Anthropic, OpenAI --------------------------------------------------------
-- sk-ant-api03-<95> today (108 chars in all); up to 130 after "sk-ant-".
token { name = "anthropic-api-key", prefix = "sk-ant-", class = B64URL, min = 20, max = 130 }
-- sk-proj-/sk-svcacct-/sk-admin- + ~156 chars of [A-Za-z0-9_-] today; up to 170.
token { name = "openai-project-key", kind = "openai-api-key", prefix = "sk-proj-",
        class = B64URL, min = 20, max = 170 }
token { name = "openai-service-account-key", kind = "openai-api-key", prefix = "sk-svcacct-",
        class = B64URL, min = 20, max = 170 }
token { name = "openai-admin-key", kind = "openai-api-key", prefix = "sk-admin-",
        class = B64URL, min = 20, max = 170 }
-- Legacy and other sk- keys: sk- + 48 alphanumerics. The first 20 characters after "sk-"
-- must be alphanumeric (no "-" or "_"): a kebab-case name such as
-- "sk-loading-spinner-container" is not a key. Up to 170 in all.
add {
  name = "openai-api-key",
  pattern = "%f[%w]sk%-" .. rep("%w", 20) .. upto(B64URL, 150),
  prefix = "sk-",
  window = 3 + 170,
}

-- ---- 5. AWS -------------------------------------------------------------------------
-- Access key ids: exactly AKIA (long-term) or ASIA (temporary, STS) + 16 [A-Z0-9], not
-- inside a longer word.
for _, k in ipairs { { "aws-access-key", "AKIA" }, { "aws-temp-access-key", "ASIA" } } do
  token { name = k[1], kind = "aws-access-key", prefix = k[2], class = "[A-Z0-9]",
          min = 16, tail = "%f[^%w]" }
end

-- Secret access keys: 40 base64 characters are indistinguishable from a git SHA-1 or
-- any other hash, so only the usual assignment contexts count:
--   aws_secret_access_key = ...          (~/.aws/credentials, boto, SDK configs)
--   AWS_SECRET_ACCESS_KEY=...            (environment, shell, .env)
--   "SecretAccessKey": "..."             (aws sts / aws configure export-credentials)
-- with an optional quote after the name, up to 4 blanks around "=" or ":", an optional
-- opening quote, then exactly 40 [A-Za-z0-9/+]. The name, separator and quote stay.
-- Mixed-case spellings of the name ("Aws_Secret_Access_Key") are not covered: a
-- case-insensitive name has no literal prefix for the core's prefilter.
local SEP = "[\"']?" .. upto("[ \t]", 4) .. "[=:]" .. upto("[ \t]", 4) .. "[\"']?"
local SEP_MAX = 1 + 4 + 1 + 4 + 1
for _, k in ipairs {
  { "aws-secret-access-key", "aws_secret_access_key" },
  { "aws-secret-access-key-env", "AWS_SECRET_ACCESS_KEY" },
  { "aws-secret-access-key-json", "SecretAccessKey" },
} do
  add {
    name = k[1], kind = "aws-secret-access-key",
    pattern = "(" .. escape(k[2]) .. SEP .. ")" .. rep("[%w/+]", 40) .. "%f[^%w/+]",
    replace = "%1" .. marker("aws-secret-access-key"),
    prefix = k[2],
    window = #k[2] + SEP_MAX + 40,
  }
end

-- ---- 6. GitHub, GitLab, Slack, Stripe ------------------------------------------------
-- Fine-grained PATs: github_pat_ + 22 + "_" + 59 today (93 in all); 40..100 [%w_].
token { name = "github-fine-grained-pat", kind = "github-token", prefix = "github_pat_",
        class = "[%w_]", min = 40, max = 100 }
-- ghp_ (classic PAT), gho_ (OAuth), ghu_ (user-to-server), ghs_ (server-to-server),
-- ghr_ (refresh): 36 alphanumerics today; up to 76 (GitHub reserves the right to grow
-- them). One entry each, so that each has a 4-byte literal prefix.
for _, k in ipairs {
  { "github-pat", "ghp_" }, { "github-oauth-token", "gho_" },
  { "github-user-token", "ghu_" }, { "github-server-token", "ghs_" },
  { "github-refresh-token", "ghr_" },
} do
  token { name = k[1], kind = "github-token", prefix = k[2], class = "%w", min = 36, max = 76 }
end
-- GitLab personal access tokens: glpat- + 20 [%w_-]; up to 80 (newer, longer formats).
token { name = "gitlab-token", prefix = "glpat-", class = "[%w_%-]", min = 20, max = 80 }
-- Slack: xoxb- (bot), xoxp- (user), xoxa- (app), xoxr- (refresh), xoxs- (session),
-- xoxe- (rotating refresh) + [%w-]: 10..120 (real ones are 50..80).
add {
  name = "slack-token",
  pattern = "%f[%w]xox[abeprs]%-" .. rep("[%w%-]", 10) .. upto("[%w%-]", 110),
  prefix = "xox",
  window = 5 + 120,
}
-- Incoming webhooks: hooks.slack.com/services/T.../B.../<24>; the path (20..80 of
-- [%w/]) is the secret, the host stays readable.
add {
  name = "slack-webhook",
  pattern = "(hooks%.slack%.com/services/)" .. rep("[%w/]", 20) .. upto("[%w/]", 60),
  replace = "%1" .. marker("slack-webhook"),
  prefix = "hooks.slack.com/services/",
  window = #"hooks.slack.com/services/" + 80,
}
-- Stripe secret, restricted and test keys: 24 alphanumerics (older) to 99 (newer); up
-- to 100. (pk_ publishable keys are public.)
for _, k in ipairs {
  { "stripe-secret-key", "sk_live_" }, { "stripe-restricted-key", "rk_live_" },
  { "stripe-test-key", "sk_test_" }, { "stripe-restricted-test-key", "rk_test_" },
} do
  token { name = k[1], kind = "stripe-key", prefix = k[2], class = "%w", min = 24, max = 100 }
end

-- ---- 7. URL credentials ---------------------------------------------------------------
-- scheme://user:password@host: only the password goes, "https://bob:[REDACTED]@host".
-- The match starts at "://" (the scheme is outside it and stays). The user is RFC 3986
-- userinfo without ":" (may be empty: redis://:pw@host); the password may contain ":"
-- and, unencoded, "@" — as in browsers the last "@" before the host ends it — but not
-- "/", blanks or "[", so the marker is never matched again. Unbounded ("*", "+"): the
-- pattern needs the "@" after the password; 512 is a practical cap.
local USERINFO = "%w%-%._~%%!%$&'%(%)%*%+,;="
add {
  name = "url-password",
  pattern = "(://[" .. USERINFO .. "]*:)[" .. USERINFO .. ":@]+@",
  replace = "%1[REDACTED]@",
  prefix = "://",
  window = 512,
  unbounded = true,
}

-- ---- 8. Authorization headers ----------------------------------------------------------
-- Header name and scheme are case-insensitive (HTTP/2 sends "authorization: bearer"),
-- so the literal prefix is given as `iprefix`, which the core compares without regard
-- to ASCII case. Also matches Proxy-Authorization, JSON and dict forms
-- ("Authorization": "Bearer ..."). The header and scheme stay; the credential goes.
-- Placeholders ("Bearer $TOKEN", "Bearer <token>") are not matched: the credential must
-- start with a token character and be at least 8 long. Unbounded; 4096 / 1024 caps.
local function nocase(word)
  return (word:gsub("%a", function(c) return "[" .. c:upper() .. c:lower() .. "]" end))
end
local AUTH = nocase("authorization") .. "[\"']?[ \t]*[:=][ \t]*[\"']?"
add {
  name = "authorization-bearer",
  pattern = "(" .. AUTH .. nocase("bearer") .. "[ \t]+)" .. rep("[%w%-%._~%+/]", 8)
            .. "[%w%-%._~%+/]*=*",
  replace = "%1" .. marker("bearer-token"),
  iprefix = "authorization",
  window = 4096,
  unbounded = true,
}
add {
  name = "authorization-basic",
  pattern = "(" .. AUTH .. nocase("basic") .. "[ \t]+)" .. rep("[%w%+/]", 8) .. "[%w%+/]*=*",
  replace = "%1" .. marker("basic-credentials"),
  iprefix = "authorization",
  window = 1024,
  unbounded = true,
}

M.default = default

-- ---- applying ------------------------------------------------------------------------

-- Apply declarative redactors in order with string.gsub; `redactors` may nest lists
-- (a policy's `redact = { secrets.default, {...} }`). Returns the text and the number
-- of redactions. A redactor whose prefix does not occur is skipped, as in the core (the
-- result is the same: every match starts with the prefix).
function M.apply(text, redactors)
  if type(text) ~= "string" then error("secrets.apply: text must be a string", 2) end
  local total = 0
  local function run(list)
    for _, r in ipairs(list) do
      if type(r) ~= "table" then
        error("secrets.apply: a redactor is a table, got " .. type(r), 3)
      end
      if r.pattern ~= nil then
        if not r.prefix or text:find(r.prefix, 1, true) then
          local n
          text, n = string.gsub(text, r.pattern, r.replace or "[REDACTED]")
          total = total + n
        end
      else
        run(r)
      end
    end
  end
  run(redactors or M.default)
  return text, total
end

-- ---- literal values --------------------------------------------------------------------

-- Values shorter than this are refused: short values ("1", "true", "prod", "en_US",
-- "admin") occur all over ordinary output, so redacting every occurrence would mangle
-- it; and each "[REDACTED]" marker where such a word used to be would tell the reader
-- the value (a redaction oracle). Real credentials are longer than 8 bytes anyway.
M.LITERAL_MIN = 8

-- A redactor for one literal secret value, matched exactly (magic characters escaped).
-- nil for non-strings and values shorter than M.LITERAL_MIN.
function M.literal(value, name)
  if type(value) ~= "string" or #value < M.LITERAL_MIN then return nil end
  name = name or "secret"
  local replace = marker(name)
  -- the marker must not contain the value itself, or the redaction would not be
  -- idempotent (value "REDACTED!" ...): fall back to a marker too short to contain it
  if replace:find(value, 1, true) then replace = "[***]" end
  return {
    name = name,
    pattern = escape(value),
    replace = (replace:gsub("%%", "%%%%")),   -- a gsub replacement: "%" must be "%%"
    window = #value,
    prefix = value,
  }
end

-- A deny glob ("*_TOKEN", "AWS_*", "SSH_AUTH_SOCK"; only "*" is special) as an anchored
-- Lua pattern.
function M.glob_pattern(glob)
  local parts = {}
  for piece in (glob .. "*"):gmatch("([^*]*)%*") do parts[#parts + 1] = escape(piece) end
  return "^" .. table.concat(parts, ".*") .. "$"
end

-- Literal redactors for the values of the environment variables whose names match one
-- of `deny_globs` (values shorter than M.LITERAL_MIN are skipped, as in M.literal).
-- Each is named "env:NAME" and replaced by "[REDACTED:NAME]". One redactor per distinct
-- value; the longest values come first, so a value that contains another is redacted
-- whole before the shorter one could cut it in two.
function M.env_redactors(deny_globs, env)
  local pats = {}
  for i, g in ipairs(deny_globs or {}) do
    if type(g) ~= "string" then
      error("secrets.env_redactors: deny glob " .. i .. " is not a string", 2)
    end
    pats[#pats + 1] = M.glob_pattern(g)
  end
  local names = {}
  for name, value in pairs(env or {}) do
    if type(name) == "string" and type(value) == "string" and #value >= M.LITERAL_MIN then
      for _, p in ipairs(pats) do
        if name:find(p) then names[#names + 1] = name; break end
      end
    end
  end
  table.sort(names, function(a, b)
    local va, vb = env[a], env[b]
    if #va ~= #vb then return #va > #vb end
    return a < b
  end)
  local out, seen = {}, {}
  for _, name in ipairs(names) do
    local value = env[name]
    if not seen[value] then
      seen[value] = true
      local r = M.literal(value, name)
      r.name = "env:" .. name
      out[#out + 1] = r
    end
  end
  return out
end

return M
