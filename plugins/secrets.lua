-- plugins/secrets.lua — the default secret-redaction set.
--
--   local secrets = require "plugins.secrets"
--   return stockade.policy { ..., redact = { secrets.default }, ... }
--
-- Requires nothing: it runs in the policy sandbox (base, string, table, math, utf8).
--
-- Every entry is a regex redactor (POLICY.md, extended; see the README's redaction
-- section), which the core runs in one streaming pass over a tool's output:
--
--   { name = "github-token", open = [[gh[pousr]_]], regex = [[...]], replace = "..." }
--
--   regex    a PCRE2 pattern. It sees the text before the place it is tried (so a
--            left frontier such as (?<![A-Za-z0-9_]) works across reads) and, while a
--            match may still grow, the core holds the text back (up to limits.
--            redact_hold). When it has a named group (?<secret>...), only that group is
--            replaced and the rest (a key name, a header, a URL's user) stays readable.
--   open     a short pattern (Vectorscan syntax, at most 256 bytes wide) that every
--            match of `regex` begins with, at the same offset. All openers of a policy
--            are one Vectorscan database scanned once per read; `regex` runs only where
--            an opener is found. Default: the literal `regex` starts with.
--   replace  the text put in place of the secret: "[REDACTED:<kind>]".
--
-- The rule shapes come from public rule sets, cited per entry:
--   gitleaks       https://github.com/gitleaks/gitleaks  config/gitleaks.toml
--   detect-secrets https://github.com/Yelp/detect-secrets detect_secrets/plugins/*.py
--   trufflehog     https://github.com/trufflesecurity/trufflehog pkg/detectors/*/*.go
-- adapted: left frontiers as look-behinds, possessive runs (linear time on hostile
-- input), lengths widened where a vendor may grow a token.
--
-- Order matters only where two entries can begin at the same offset: the first listed
-- wins (sk-ant- before sk-). Elsewhere the earliest match wins, and what it covers is
-- gone: a token inside a URL's password goes as the URL's password.
--
-- Every replacement text is inert: no entry matches "[REDACTED:...]".

local M = {}

local default = {}

local function marker(kind) return "[REDACTED:" .. kind .. "]" end

local function add(r)
  r.replace = r.replace or marker(r.kind or r.name)
  r.kind = nil
  default[#default + 1] = r
end

-- Frontiers: a token does not begin or end inside a longer word.
local NOT_AFTER_TOKEN = [[(?<![A-Za-z0-9_-])]]
local NOT_BEFORE_TOKEN = [[(?![A-Za-z0-9_-])]]

-- A token: `open` (a literal or an alternation), then `body`; both frontiers. What
-- follows the prefix is not a placeholder: "xxxx", a few characters in at most (as in
-- "glrt-tx_xxxx..."; gitleaks' entropy gate for the same false positives).
local NOT_PLACEHOLDER_BODY = [[(?![A-Za-z0-9_-]{0,3}(?i:x{4}))]]
local function token(t)
  add {
    name = t.name, kind = t.kind, open = t.open,
    regex = (t.lead or NOT_AFTER_TOKEN) .. "(?:" .. t.open .. ")" .. NOT_PLACEHOLDER_BODY .. t.body
            .. (t.tail or NOT_BEFORE_TOKEN),
  }
end

-- ---- private keys (PEM, OpenSSH, PGP) ---------------------------------------------------
-- gitleaks "private-key": (?i)-----BEGIN[ A-Z0-9_-]{0,100}PRIVATE KEY(?: BLOCK)?-----
-- [\s\S-]{64,}?KEY(?: BLOCK)?-----. Here the body is what a key body is — lines of
-- base64 or armor headers ("Proc-Type:", "DEK-Info:", "Version:", "Comment:") — so two
-- marker strings in prose or source, with other text between them, are not a key. A
-- line may start with a diff marker or a quote ("-", "+", " ", ">": a key in `git log
-- -p`), and lines may be joined by the two characters "\n" (a key inside a JSON
-- string: GCP service-account files). The first body line must hold 16 base64
-- characters (gitleaks' false positive "-----BEGIN PRIVATE KEY-----\nanything\n...").
-- The whole block goes. Any length: the core holds it back until the END line.
local NL = [[(?:\r?\n|(?:\\r)?\\n)]]
local LEAD = [[[-+ >]?[ \t]*]]
local HEADER = [[[A-Za-z][A-Za-z0-9-]*:[^\r\n\\]*+]]
local PEM_LABEL = [[[A-Z0-9 ]{0,40}PRIVATE KEY(?: BLOCK)?-----]]
add {
  name = "private-key",
  open = "-----BEGIN " .. PEM_LABEL,
  regex = "-----BEGIN " .. PEM_LABEL
          .. "(?=(?:" .. NL .. LEAD .. HEADER .. ")*+(?:" .. NL .. LEAD .. ")?" .. NL .. LEAD
          .. "(?:[A-Za-z0-9+/=]|\\\\/){16})"
          .. "(?:" .. NL .. "(?!" .. LEAD .. "-----)" .. LEAD
          .. "(?:" .. HEADER .. "|(?:[A-Za-z0-9+/=]|\\\\/)*+[ \t]*+))*+"
          .. NL .. LEAD .. "-----END " .. PEM_LABEL,
}

-- ---- JWT ---------------------------------------------------------------------------------
-- gitleaks "jwt": \b(ey[a-zA-Z0-9]{17,}\.ey[a-zA-Z0-9\/\\_-]{17,}\.(?:[a-zA-Z0-9\/\\_-]
-- {10,}={0,2})?). header.payload.signature in base64url (some libraries: base64, so
-- "/" and "+"); the signature may be empty (alg "none") or, when the payload starts
-- "ey" too, missing (detect-secrets jwt). The header starts "eyJ" or "ey" and 17
-- alphanumerics (gitleaks). The header is at most 4 KiB and the payload 64 KiB, so
-- that a long base64url run that merely starts with "eyJ" is let go once it is
-- longer, not held to its end.
local JWT_PART = "[A-Za-z0-9_/+-]"
add {
  name = "jwt", open = "eyJ|ey[A-Za-z0-9]{17}",
  regex = NOT_AFTER_TOKEN .. [[ey(?=J|[A-Za-z0-9]{17})[A-Za-z0-9_-]{10,4096}+\.(?:ey]] .. JWT_PART
          .. "{6,65535}+(?:\\." .. JWT_PART .. "*+={0,2})?|" .. JWT_PART .. "{8,65535}+\\." .. JWT_PART .. "*+={0,2})",
}

-- ---- AI providers ---------------------------------------------------------------------------
-- gitleaks "anthropic-api-key" / "anthropic-admin-api-key": sk-ant-api03-<93>AA,
-- sk-ant-admin01-<93>AA; here any sk-ant- key of 20..300.
token { name = "anthropic-api-key", open = "sk-ant-", body = "[A-Za-z0-9_-]{20,300}+" }
-- gitleaks "openai-api-key": sk-(proj|svcacct|admin)-...T3BlbkFJ... and legacy
-- sk-<20>T3BlbkFJ<20>; here without the T3BlbkFJ marker (newer keys lack it). Legacy
-- keys need 20 alphanumerics first, so "sk-loading-spinner-container" is not a key.
token { name = "openai-project-key", kind = "openai-api-key", open = "sk-(?:proj|svcacct|admin)-",
        body = "[A-Za-z0-9_-]{20,300}+" }
token { name = "openai-api-key", open = "sk-", body = "[A-Za-z0-9]{20}[A-Za-z0-9_-]{0,280}+" }
-- gitleaks "huggingface-access-token", "huggingface-organization-api-token";
-- trufflehog huggingface: \b(?:hf_|api_org_)[a-zA-Z0-9]{34}\b (here 34..40: longer runs are
-- identifiers, "hf_requiredCharacteristicTypesForDisplayMetadata", a gitleaks fp)
token { name = "huggingface-token", open = "hf_|api_org_", body = "[A-Za-z0-9]{34,40}+" }

-- ---- AWS ------------------------------------------------------------------------------------
-- gitleaks "aws-access-token": \b((?:A3T[A-Z0-9]|AKIA|ASIA|ABIA|ACCA)[A-Z2-7]{16})\b
token { name = "aws-access-key", open = "AKIA|ASIA|ABIA|ACCA|A3T[A-Z0-9]", body = "[A-Z0-9]{16}",
        lead = "(?<![A-Za-z0-9])", tail = "(?![A-Za-z0-9])" }
-- gitleaks "aws-amazon-bedrock-api-key-long-lived" / "-short-lived": ABSK + base64 of
-- "BedrockAPIKey-...", and "bedrock-api-key-" + base64 of "bedrock.amazonaws.com..." and
-- of a presigned request (8 KiB at most, and no right frontier: a longer run goes as far
-- as that, rather than not at all).
token { name = "aws-bedrock-api-key", open = "ABSKQmVkcm9ja0FQSUtleS", body = "[A-Za-z0-9+/]{80,400}+={0,2}",
        tail = "(?![A-Za-z0-9+/=])" }
token { name = "aws-bedrock-short-lived-key", kind = "aws-bedrock-api-key",
        open = "bedrock-api-key-YmVkcm9jay5hbWF6b25hd3MuY29t", body = "[A-Za-z0-9+/=%&_-]{0,8192}+", tail = "" }
-- Secret access keys: 40 base64 characters are any hash (trufflehog aws/common.go
-- SecretPat), so only beside their names: ~/.aws/credentials, env, `aws configure
-- export-credentials` JSON. The name and separator stay.
local ASSIGN = [==[["']?[ \t]{0,4}(?:=|:|=>)[ \t]{0,4}["']?]==]
add {
  name = "aws-secret-access-key",
  open = [[(?i)(?:aws_?secret|secret_?access_?key)]],
  regex = [[(?i)(?:aws_?secret_?(?:access_?)?key|secret_?access_?key)]] .. ASSIGN
          .. [[(?<secret>[A-Za-z0-9/+]{40})(?![A-Za-z0-9/+])]],
}
-- trufflehog aws/session_keys: ASIA id + a session token of 100+ base64 characters;
-- here beside its name (aws_session_token, AWS_SECURITY_TOKEN, "SessionToken").
add {
  name = "aws-session-token",
  open = [[(?i)(?:aws_?session_?token|aws_?security_?token|sessiontoken)]],
  regex = [[(?i)(?:aws_?session_?token|aws_?security_?token|sessiontoken)]] .. ASSIGN
          .. [[(?<secret>[A-Za-z0-9/+=]{40,}+)]],
}

-- ---- Google Cloud ------------------------------------------------------------------------------
-- gitleaks "gcp-api-key": \b(AIza[\w-]{35})
token { name = "gcp-api-key", open = "AIza", body = "[A-Za-z0-9_-]{35}" }
-- OAuth client secrets: GOCSPX- + 28 (the format Google issues since 2021; the value
-- of "client_secret" in the client JSON, which trufflehog's
-- gcpapplicationdefaultcredentials detector keys on).
token { name = "gcp-oauth-client-secret", open = "GOCSPX-", body = "[A-Za-z0-9_-]{24,40}+" }
-- trufflehog googleoauth2 access token: \b(ya29\.(?i:[a-z0-9_-]{10,}))
token { name = "gcp-oauth-token", open = [[ya29\.]], body = "[A-Za-z0-9_-]{10,}+" }
-- Service-account JSON: the key itself is the PEM entry (its "\n" escapes); the key id
-- goes too (trufflehog gcp: the JSON with auth_provider_x509_cert_url).
add {
  name = "gcp-private-key-id",
  open = [["private_key_id"]],
  regex = [["private_key_id"\s*:\s*"(?<secret>[0-9a-f]{16,64})"]],
}

-- ---- Azure ----------------------------------------------------------------------------------------
-- detect-secrets azure_storage_key.py: AccountKey=[a-zA-Z0-9+\/=]{88}; trufflehog
-- azure_storage keyPat (Access|Account|Storage)[_.-]?Key ... {86,88}={0,2}.
add {
  name = "azure-storage-key",
  open = [[(?i)(?:account|storage|access)[_.-]?key]],
  regex = [[(?i)(?:account|storage|access)[_.-]?key]] .. ASSIGN
          .. [[(?<secret>[A-Za-z0-9+/]{86}[A-Za-z0-9+/=]{0,2}={0,2})]],
}
-- `az storage account keys list`: the key is the "value" of an object whose "keyName"
-- names it (key1, key2, kerb1 ...), a few fields before.
add {
  name = "azure-storage-key-listing", kind = "azure-storage-key",
  open = [["keyName"]],
  regex = [["keyName"\s*+:\s*+"[^"\r\n]{1,40}+",(?:\s*+"[A-Za-z]{1,20}+"\s*+:\s*+"[^"\r\n]{0,60}+",){0,4}+]]
          .. [[\s*+"value"\s*+:\s*+"(?<secret>[A-Za-z0-9+/]{86}[A-Za-z0-9+/=]{0,2}={0,2})"]],
}
-- gitleaks "azure-ad-client-secret" / trufflehog azure_entra spv2:
-- [a-zA-Z0-9_~.]{3}\dQ~[a-zA-Z0-9_~.-]{31,34}
add {
  name = "azure-client-secret",
  open = [[[A-Za-z0-9_~.]{3}[0-9]Q~]],
  regex = [[(?<![A-Za-z0-9_~.-])[A-Za-z0-9_~.]{3}[0-9]Q~(?!(?i:x{6}))[A-Za-z0-9_~.-]{31,34}(?![A-Za-z0-9_~.-])]],
}

-- ---- GitHub, GitLab, Atlassian/Bitbucket ------------------------------------------------------------
-- gitleaks "github-pat", "github-oauth", "github-app-token", "github-refresh-token":
-- gh[pousr]_[0-9a-zA-Z]{36}; "github-fine-grained-pat": github_pat_\w{82}. Widened.
token { name = "github-fine-grained-pat", kind = "github-token", open = "github_pat_",
        body = "[A-Za-z0-9_]{40,255}+" }
token { name = "github-token", open = "gh[pousr]_", body = "[A-Za-z0-9]{36,255}+",
        tail = "(?![A-Za-z0-9_])" }
-- gitleaks gitlab-* and detect-secrets gitlab_token.py: glpat-, gldt-, glft-, glsoat-,
-- glrt-, glcbt-, glimt-, glptt-, glagent-, gloas-, glffct- + 20..; GR1348941 runner
-- registration; routable tokens end in ".<2><7>".
token { name = "gitlab-token", open = "gl(?:pat|dt|ft|soat|rt|cbt|imt|ptt|agent|oas|ffct)-",
        body = [[[A-Za-z0-9_-]{20,1024}+(?:\.[0-9a-z]{2}[0-9a-z]{7})?]] }
-- gitleaks "gitlab-session-cookie": _gitlab_session=[0-9a-z]{32}
token { name = "gitlab-session-cookie", kind = "gitlab-token", open = "_gitlab_session=",
        body = "[0-9a-z]{32}", lead = "(?<![A-Za-z0-9])" }
token { name = "gitlab-runner-registration-token", kind = "gitlab-token", open = "GR1348941",
        body = "[A-Za-z0-9_-]{20,64}+" }
-- gitleaks "atlassian-api-token": ATATT3[A-Za-z0-9_\-=]{186}; trufflehog atlassian v2
-- ATCTT3xFfG...; trufflehog bitbucketapppassword: ATBB[A-Za-z0-9_=.-]+
token { name = "atlassian-token", open = "ATATT3|ATCTT3|ATBB", body = "[A-Za-z0-9_=.+/-]{24,400}+",
        tail = "(?![A-Za-z0-9_=+/-])" }

-- ---- Slack, Stripe, package registries, other prefixed tokens ---------------------------------------
-- gitleaks slack-bot/user/app/legacy/config tokens: xox[baprseo]-..., xapp-...,
-- xoxe.xox[bp]-1-<163..166>, xoxe-1-<146>; here one shape, 20..600 (gitleaks' false
-- positive "xoxb-12345-abcd234" stays).
token { name = "slack-token", open = [[xox[abeoprs]-|xapp-|xoxe\.xox[bp]-]],
        body = "[A-Za-z0-9-]{20,600}+" }
-- gitleaks "slack-legacy-workspace-token": xox[ar]-(?:\d-)?[0-9a-zA-Z]{8,48}, shorter than
-- the others.
token { name = "slack-legacy-workspace-token", kind = "slack-token", open = "xox[ar]-",
        body = "(?:[0-9]-)?[0-9a-zA-Z]{8,48}" }
-- gitleaks "slack-webhook-url": hooks.slack.com/(services|workflows|triggers)/...
add {
  name = "slack-webhook",
  open = [[hooks\.slack\.com/]],
  regex = [[hooks\.slack\.com/(?:services|workflows|triggers)/(?<secret>[A-Za-z0-9+/_-]{20,200}+)]],
}
-- gitleaks "stripe-access-token": (sk|rk)_(test|live|prod)_[a-zA-Z0-9]{10,99}
token { name = "stripe-key", open = "(?:sk|rk)_(?:live|test|prod)_", body = "[A-Za-z0-9]{10,255}+" }
-- gitleaks "npm-access-token": npm_[a-z0-9]{36}; detect-secrets npm.py:
-- //host/:_authToken=... (the .npmrc line; also _auth, _password).
token { name = "npm-token", open = "npm_", body = "[A-Za-z0-9]{36}" }
add {
  name = "npmrc-auth", kind = "npm-token",
  open = [[:_(?:authToken|auth|password)]],
  regex = [[:_(?:authToken|auth|password)[ \t]*=[ \t]*["']?]] .. "(?!\\$)" .. [[(?<secret>[^\s"']{6,}+)]],
}
-- gitleaks "pypi-upload-token": pypi-AgEIcHlwaS5vcmc[\w-]{50,1000}
token { name = "pypi-token", open = "pypi-AgE", body = "[A-Za-z0-9_-]{50,2000}+" }
-- gitleaks: sendgrid SG., digitalocean do[opr]_v1_, databricks dapi, shopify shp*_,
-- linear lin_api_, pulumi pul-, rubygems rubygems_, doppler dp.pt., age
-- AGE-SECRET-KEY-1, grafana glsa_/glc_, sentry sntrys_/sntryu_, postman PMAK-,
-- heroku HRKU-AA, planetscale pscale_(tkn|oauth|pw)_, stripe webhook whsec_.
for _, t in ipairs {
  { "sendgrid-token", [[SG\.]], [[[A-Za-z0-9_-]{16,32}\.[A-Za-z0-9_-]{20,64}+]] },
  { "digitalocean-token", "do[opr]_v1_", "[a-f0-9]{64}" },
  { "databricks-token", "dapi", "[a-f0-9]{32}(?:-[0-9])?" },
  { "shopify-token", "shp(?:at|ca|pa|ss)_", "[a-fA-F0-9]{32}" },
  { "linear-api-key", "lin_api_", "[A-Za-z0-9]{40}" },
  { "pulumi-token", "pul-", "[a-f0-9]{40}" },
  { "rubygems-token", "rubygems_", "[a-f0-9]{48}" },
  { "doppler-token", [[dp\.(?:pt|st|ct|sa|scim|audit)\.]], "[A-Za-z0-9]{40,48}" },
  { "age-secret-key", "AGE-SECRET-KEY-1", "[QPZRY9X8GF2TVDW0S3JN54KHCE6MUA7L]{58}" },
  { "grafana-token", "glsa_|glc_", "[A-Za-z0-9_+/=]{32,400}+" },
  { "sentry-token", "sntry[su]_", "[A-Za-z0-9_+/=]{40,400}+" },
  { "postman-token", "PMAK-", "[a-fA-F0-9]{24}-[a-fA-F0-9]{34}" },
  { "heroku-token", "HRKU-AA", "[0-9a-zA-Z_-]{58}" },
  { "planetscale-token", "pscale_(?:tkn|oauth|pw)_", "[A-Za-z0-9_=.-]{32,64}+" },
  { "stripe-webhook-secret", "whsec_", "[A-Za-z0-9+/=]{24,}+" },
} do
  token { name = t[1], open = t[2], body = t[3] }
end

-- Values that are placeholders, not secrets: $VAR, <value>, {{ value }}, %(name)s, ***,
-- xxxx, ..., type names and empty-ish words.
local PLACEHOLDER = [[(?!\$|<|\{\{|%\(|\*{3}|x{4}|X{4}|\.{3}|DATA\+OMITTED|REDACTED|(?:str|string|bytes|bool|boolean|int|number|none|null|nil|true|false|undefined|optional|required)\b)]]

-- ---- credentials in URLs, connection strings and config files ------------------------------------------
-- trufflehog uri / redis / mongodb / postgres: scheme://user:PASSWORD@host. The match
-- starts at "://" (the scheme stays) and only the password goes. The password may not
-- contain blanks, quotes, "/", "@" (as in browsers the "@" before the host ends it).
-- Placeholders stay (user:password@, :***@, :${PASS}@, :<password>@).
add {
  name = "url-password", open = "://",
  regex = [[://[A-Za-z0-9._~%!$&'()*+,;=-]{0,256}+:(?!(?:pass(?:word)?|pwd|secret|x{3,}|\*+|\$\{?[A-Za-z_]+\}?|<[^>@]*>)@)(?<secret>[^\s/@"'<>`\\]{1,512}+)@]],
  replace = "[REDACTED]",
}
-- Signed URLs: an Azure SAS token's sig=, an S3 presigned URL's X-Amz-Signature=, a GCS
-- signed URL's X-Goog-Signature= (trufflehog azure_sas shape); the signature is the
-- credential, the rest of the URL stays.
add {
  name = "url-signature", kind = "signature",
  open = [[[?&](?:sig|X-Amz-Signature|X-Goog-Signature)=]],
  regex = [[[?&](?:sig|X-Amz-Signature|X-Goog-Signature)=(?<secret>[A-Za-z0-9%+/=_-]{16,1024}+)]],
}
-- trufflehog jdbc (pass.*?=), sqlserver (ADO.NET key=value;), postgres (libpq
-- key='value'): a password key in a connection string, after ";", "?" or "&", or
-- after a blank with "=" right behind it (libpq's "host=h password=p"; then the value
-- needs a digit or a symbol: Python's "password=None, " stays).
add {
  name = "connection-string-password", kind = "password",
  open = [[(?i)(?:password|pwd)[ \t]{0,4}=]],
  regex = [[(?i)(?:(?<=[;?&])(?:password|pwd)[ \t]{0,4}=[ \t]*|(?<=[ \t])(?:password|pwd)=(?=[^;&\s"',()]{0,511}?[0-9!#$%^*+/=?@~-]))'?]]
          .. PLACEHOLDER .. [[(?<secret>(?<=')[^'\r\n]{1,512}+|[^;&\s"',()][^;&\s"',()]{0,511}+)]],
}
-- Laravel's APP_KEY=base64:... (the application's encryption key; "APP_KEY" alone is
-- too common a name, e.g. Pusher's public app key, to be a keyword).
add {
  name = "laravel-app-key", kind = "secret",
  open = [[APP_KEY]],
  regex = [[(?<![A-Za-z0-9_])APP_KEY[ \t]*=[ \t]*["']?base64:(?<secret>[A-Za-z0-9+/]{32,88}={0,2})]],
}
-- .netrc (and curl's --netrc-file): machine HOST login USER password PASSWORD, or the
-- "default" entry (default login USER password PASSWORD); the "machine" or "default"
-- at the start of a line and a login before the password ("machine learning password
-- manager" is prose); after the first entry, more may follow on the same line. A
-- password of letters only needs 12 of them ("machine translation / login page /
-- password reset" is prose too).
add {
  name = "netrc-password", kind = "password",
  open = "machine|default",
  regex = [[(?m)(?:(?<=^|^ |^  |^\t)(?:machine[ \t]+\S+|default)(?:\s+(?:login|account|port)[ \t]+\S+)+\s+]]
          .. [[|(?<=[ \t])machine[ \t]+\S+(?:[ \t]+(?:login|account|port)[ \t]+\S+)+[ \t]+)]]
          .. [[password[ \t]+(?=\S*[^A-Za-z\s]|\S{12})(?<secret>\S+)]],
}
-- kubeadm bootstrap tokens (kubeadm join --token, a kubeconfig's token:):
-- [a-z0-9]{6}.[a-z0-9]{16}, beside their name.
add {
  name = "kubeadm-token", kind = "secret",
  open = [[(?i)token]],
  regex = [[(?i)token["']?(?:[ \t]*[:=][ \t]*|[ \t]+)["']?(?<secret>(?-i:[a-z0-9]{6}\.[a-z0-9]{16}))(?![A-Za-z0-9_.-])]],
}
-- kubeconfig (gitleaks kubernetes-secret-yaml, for Secret data; here the user's
-- client-key-data, a base64 private key) and docker's config.json "auths" (trufflehog
-- docker_auth_config: "auth": base64(user:password), "identitytoken").
add {
  name = "kubeconfig-client-key", kind = "private-key",
  open = "client-key-data",
  regex = [[client-key-data["']?[ \t]*:[ \t]*["']?(?<secret>[A-Za-z0-9+/=]{16,}+)]],
}
add {
  name = "docker-auth",
  open = [[(?i)"(?:auth|identitytoken|registrytoken)"]],
  regex = [[(?i)"(?:auth|identitytoken|registrytoken)"\s*:\s*"(?<secret>[A-Za-z0-9+/=._-]{8,}+)"]],
}

-- ---- HTTP authentication ----------------------------------------------------------------------------------
-- Authorization / Proxy-Authorization in any case, any scheme (Bearer, Basic, Token,
-- Digest, AWS4-HMAC-SHA256 ...): the header and scheme stay, the credentials go
-- (comma-separated parameters included). A credential is token68 characters (RFC 7235)
-- with a digit in its first 20, or 20 long, up to a blank, a quote or the end: header
-- names in minified code ('"X-Api-Key":t.apiKey,') are not headers. gitleaks "curl-auth-header" for the shapes
-- (-H "Authorization: ...", X-Api-Key, X-Auth-Token). Placeholders ($TOKEN, <token>,
-- {{token}}) are left alone. The header's own name is not its credential
-- ("authorization:authorization:..." in a dump of header names).
local CRED = [==[(?![$<{%*])(?=[A-Za-z0-9._~+/=:%@-]{0,19}?[0-9]|[A-Za-z0-9._~+/=:%@-]{20}|[A-Za-z0-9+/]{6,}+={1,2}(?:[\s"'`,;]|$))]==]
  .. [==[(?<secret>[A-Za-z0-9._~+/=:%@-]{8,}+(?:,[ \t]*[A-Za-z]+=[^\s,"'`]++)*+)(?=[\s"'`,;\\]|$)]==]
add {
  name = "authorization",
  open = [[(?i)(?:proxy-)?authorization]],
  regex = [[(?i)(?:proxy-)?authorization(?:[ \t]*:|["'][ \t]*(?:=>|:|=))[ \t]*["']?]]
          .. [[(?:(?:bearer|basic|token|api-token|digest|negotiate|ntlm|apikey|api-key|sso-key|aws4-hmac-sha256|otp|key)[ \t]+)?]]
          .. [[(?!(?:proxy-)?authorization(?![A-Za-z0-9._~+/=%@-]))]] .. CRED,
}
-- Without the "X-" (apikey:, Api-Token:, PRIVATE-TOKEN:) only as a header inside quotes,
-- as in curl -H "...": a YAML "apikey:" is the generic entries' business.
add {
  name = "api-key-header", kind = "authorization",
  open = [[(?i)(?:x-(?:[a-z]{1,20}-)?(?:api-?key|auth-?token|access-?token|token|key|secret)|api-?(?:key|token)|private-token)]],
  regex = [[(?i)(?:x-(?:[a-z]{1,20}-)?(?:api-?key|auth-?token|access-?token|token|key|secret)|(?<=["'])(?:api-?(?:key|token)|private-token))]]
          .. [[["']?[ \t]*:[ \t]*["']?]] .. CRED,
}
-- Cookies (request and response): the value after the name goes, when it looks like a
-- session id (16+ characters, a digit): "Set-Cookie: fig=newton" in a doctest stays.
add {
  name = "cookie",
  open = [[(?i)(?:set-)?cookie:]],
  regex = [[(?i)(?:set-)?cookie:[ \t]*[A-Za-z0-9_.!#$%&'*+^`|~-]{1,128}+=(?=[^;\s\\"']{0,4095}?[0-9])(?<secret>[^;\s\\"']{16,}+)]],
}
-- gitleaks "curl-auth-user": curl ... -u USER:PASSWORD (the password goes).
-- The command may go on over "\"-continued lines; the user may be empty or quoted on
-- its own ("{id}":"{secret}"); placeholders stay (user:password, <user:password>,
-- ${PASS}, [PASSWORD], {{ .Values.password }}).
add {
  name = "curl-user", kind = "password",
  open = [[curl]],
  regex = [[curl(?![A-Za-z0-9_-])(?:[^\r\n]{0,1024}?\\\r?\n){0,5}?[^\r\n]{0,1024}?[ \t](?:-u|--user)(?:=|[ \t]{1,5})["']?[^\s:"'<]{0,256}+["']?:["']?]]
          .. [[(?![$<\[%]|\{\{|(?:pass(?:word)?|pwd|token|secret)(?:["'\s>]|$))(?<secret>[^\s"']{6,}+)]],
}
add {
  name = "curl-oauth2-bearer", kind = "authorization",
  open = [[--oauth2-bearer]],
  regex = [[--oauth2-bearer(?:=|[ \t]{1,5})["']?(?![$<{%])(?<secret>[^\s"']{8,}+)]],
}

-- ---- command lines -----------------------------------------------------------------------
-- An agent's own commands, `ps`, shell history and CI logs: a long option
-- (--password=..., --db-password ..., --token ..., --api-key ...), a registry login's
-- -p (docker/podman/nerdctl/helm/buildah/skopeo login -u U -p P), sshpass -p, and
-- mysql's attached -pPASSWORD (a bare -p prompts). The value needs a digit or a symbol,
-- or 12 characters in both cases: a man page's "--password PASSWORD", "--token TOKEN"
-- and "--proxy-password respectively" stay, as do placeholders ($PASS, <token>,
-- {{ .token }}) and "--password-file PATH".
local CLI_VALUE = [==[(?<q>["']?)(?![$<{%*-])(?=[^\s"',;]{0,511}?[0-9!#$%^&*+/=?@~]|(?-i:(?=[^\s"',;]{0,511}?[a-z])(?=[^\s"',;]{0,511}?[A-Z]))[^\s"',;]{12})]==]
  .. [==[(?<secret>[^\s"',;]{4,512}+)\k<q>]==]
add {
  name = "cli-option-secret", kind = "password",
  open = [[(?i)--(?:[a-z]{1,20}-)?(?:password|passwd|pass|token|secret|api-?key)]],
  regex = [[(?i)--(?:[a-z]{1,20}-)?(?:password|passwd|pass|token|secret|api-?key)(?:=|[ \t]{1,4})]] .. CLI_VALUE,
}
add {
  name = "cli-login-password", kind = "password",
  open = [[docker|podman|nerdctl|helm|buildah|skopeo|sshpass|mysql]],
  regex = [[(?:(?:docker|podman|nerdctl|helm|buildah|skopeo)(?:[ \t]+registry)?[ \t]+login(?:[ \t]+[^\s]+){0,8}?[ \t]+-p[ \t]+]]
          .. [[|sshpass[ \t]+-p[ \t]*|mysql(?:dump|admin|import|show|check)?(?:[ \t]+[^\s]+){0,8}?[ \t]+-p(?=[^\s]))]] .. CLI_VALUE,
}

-- ---- generic assignments ----------------------------------------------------------------------------------
-- detect-secrets keyword.py (DENYLIST: api_?key, auth_?key, service_?key, account_?key,
-- db_?key, database_?key, priv_?key, private_?key, client_?key, db_?pass,
-- database_?pass, key_?pass, password, passwd, pwd, secret ...) and gitleaks
-- "generic-api-key" (access|auth|api|credential|creds|key|passw(or)?d|secret|token,
-- then = : => := ...). The name may have a prefix after "_" or "-" (DB_PASSWORD,
-- MYSQL_ROOT_PASSWORD) and a suffix (SECRET_KEY, password_hash); the name and
-- separator stay, the value goes.
-- Gates, so that code and prose are not cut:
--   - a quoted value of 6+ characters without blanks that has a digit or a symbol, or
--     of 12+; or an unquoted one (.env, YAML, INI) of 8+ that has a letter and a digit
--     and is not a dotted name (parts of 1..31 characters: request.form), a call, a
--     path or a URL (a changelog's "docs/credential-store: s/--store/--file/" is
--     prose); format strings ('%s:%s', '{0}:{1}') stay;
--   - the name's suffix has no "." (TestMasterSecret.java: is a file name);
--   - placeholders stay: $VAR, ${VAR}, <value>, {{ value }}, %(name)s, ***, xxx...,
--     and type names (str, string, bool ...).
--   - weak names (token, auth, access_token ...) need 16+ characters with letters and
--     digits, and take no suffix ("certificate-authority-data" is not "auth"), nor
--     follow a ":" (a pkcs11: URI's token=LABEL).
-- The name starts a word (not after "-": git-credential-osxkeychain), or a camelCase
-- part of one (mySecret, dbPassword).
-- So `password = "changeme"` in a tutorial stays readable (letters only, under 12),
-- and `password = "changeme1"` does not: a policy choice; a policy that wants every
-- quoted value gone adds its own entry, one that wants fewer drops these by name
-- (M.without).
local STRONG = [[(?:passw(?:or)?d|passphrase|pwd|secret|api[_-]?key|apikey|access[_-]?key|auth[_-]?key|]]
  .. [[private[_-]?key|client[_-]?key|service[_-]?key|account[_-]?key|db[_-]?pass|credentials?|creds|]]
  .. [[client[_-]?secret|secret[_-]?key|signing[_-]?key|encryption[_-]?key|master[_-]?key)]]
local WEAK = [[(?:(?:access|auth|refresh|session|api|bearer|id)[_-]?)?(?:token|auth)]]
local KEY_START = [[(?:(?<![A-Za-z0-9-])|(?-i:(?<=[a-z0-9])(?=[A-Z])))(?<!public)(?<!public[_.-])]]
-- What joins a name to its value, in the shapes of gitleaks' GenerateSampleSecrets (an
-- atomic group: the first shape that fits is the one, so the longer ones come first):
-- = : := ::= => ?= .= (PHP), a comparison (== != === !==: detect-secrets' keyword
-- tests), "," between two quoted strings when the name is an upper-case variable's
-- (setProperty("API_TOKEN", "V"); not a list of paths: "kadmin/passwd", "kadmin/server"),
-- a type between (Go "string", TypeScript ": string"), quotes and "\"" around the name
-- (JSON inside a string, a JAAS config), a YAML block scalar ("key: |" and the value on
-- the next line), an XML element (<key>value</key>), XML attributes
-- (name="key" value="...", <name="key" />\n<value="..." />), a JSON name/value pair
-- ("name": "key", "value": "..."), a YAML one (a Kubernetes env entry: "- name: KEY"
-- and "value: ..." on the next line) and `terraform output -json` ("key": {"sensitive":
-- true, "type": "string", "value": "..."}).
local SEP_TAIL = [==[(?>"[ \t]*:[ \t]*\{(?:\s*+"[a-z_]{1,20}+"[ \t]*:[ \t]*(?:true|false|"[A-Za-z ]{0,20}+"),){0,4}+\s*+"value"[ \t]*:[ \t]*]==]
  .. [==[|[\]'"\\]{0,3}(?:[ \t]*:?[ \t]*(?-i:string|str|String)(?![A-Za-z0-9_]))?[ \t]*]==]
  .. [==[(?::{1,3}=|=>|\?=|\.=|={2,3}|!==?|=|:|(?-i:(?<=[A-Z0-9_]["'])),(?=[ \t]*\\?["'`]))[ \t]*(?:[|>][-+]?[ \t]*\r?\n[ \t]+)?]==]
  .. [==[|>[ \t]*(?:\r?\n[ \t]*)?|["'](?:[ \t]*/?>[ \t]*\r?\n?[ \t]*<|[ \t]+)value=]==]
  .. [==[|"[ \t]*,[ \t]*(?:\r?\n[ \t]*)?"value"[ \t]*:[ \t]*]==]
  .. [==[|["']?[ \t]*\r?\n[ \t]+value:[ \t]*)]==]
-- A name's suffix that says the value is not the secret (gitleaks' generic allowlist:
-- credentialsId, SECRET_NAME, secret_length, key_file, token_url; "secrets:" names a
-- collection).
local SUFFIX_OK = [[(?!s?[_.-]?(?:ids?|names?|size|length|len|type|file|path|url|uri|endpoint|version|field|label|hint)(?![A-Za-z0-9])|s(?![A-Za-z0-9]))]]
local SEPARATOR = SUFFIX_OK .. [==[[\w-]{0,30}?]==] .. SEP_TAIL
-- A value that is a placeholder of x's or one character repeated (gitleaks' entropy
-- gate for the same cases: client_secret=bP88Q~xxxxxxxx..., password: "aaaaaa1").
local VALUE_NOT_PLACEHOLDER = [==[(?![^\s"'`,;\\]{0,512}?(?i:x{6}))(?![^\s"'`,;\\]{0,512}?(?<rep>[A-Za-z0-9])\k<rep>{5})]==]
local UNQUOTED = [==[(?![A-Za-z_][A-Za-z0-9_]{0,30}+(?:(?:\.[A-Za-z_][A-Za-z0-9_]{0,30}+)++(?:[\s,;()\[\]]|$)|\())(?![./]|~/)]==]
-- Every scan of the value is bounded by the value's longest length and, where it can be,
-- possessive over a class that cannot contain what it looks for: text dense with names
-- (`pwd=pwd=...`, `aToken=aToken=...`) starts an attempt every few bytes, and a scan to
-- the end of the run made that O(n^2). The cheap tests come first: an unquoted value is
-- 8..512 characters followed by its end (the secret's own condition, tested before the
-- costlier ones), and has a digit and a letter within its length.
local VALUE_FITS = [[(?=[^\s"'`,;(){}\[\]<>\\]{8,512}+(?:[\s,;"'<\\]|$))]]
local VALUE_HAS_DIGIT_AND_LETTER_512 = [[(?=[^\s"'`,;0-9]{0,511}+[0-9])(?=[^\s"'`,;A-Za-z]{0,511}+[A-Za-z])]]
local VALUE_HAS_DIGIT_AND_LETTER_2048 = [[(?=[^\s"'`,;0-9]{0,2047}+[0-9])(?=[^\s"'`,;A-Za-z]{0,2047}+[A-Za-z])]]
add {
  name = "generic-secret-quoted", kind = "secret",
  open = [[(?i)]] .. STRONG,
  regex = [[(?i)]] .. KEY_START .. STRONG .. SEPARATOR .. [[@?\\?(?<q>["'`])]] .. PLACEHOLDER .. VALUE_NOT_PLACEHOLDER
          .. [==[(?![^"'`\s\\]{0,511}?(?-i:%[sdr]|\{[0-9]?\}))(?![./~]|[a-z]++://)(?=[^"'`\s\\]{0,511}?[0-9!#$%^&*+/=?@~-]|[^"'`\s\\]{12})(?<secret>[^"'`\s\\]{6,512}+)\\?\k<q>]==],
}
add {
  name = "generic-secret", kind = "secret",
  open = [[(?i)]] .. STRONG,
  regex = [[(?i)]] .. KEY_START .. STRONG .. SEPARATOR .. VALUE_FITS .. PLACEHOLDER .. VALUE_HAS_DIGIT_AND_LETTER_512
          .. VALUE_NOT_PLACEHOLDER .. UNQUOTED .. [[(?![a-z]++://)]]
          .. [[(?<secret>[^\s"'`,;(){}\[\]<>\\]{8,512}+)(?=[\s,;"'<\\]|$)]],
}
add {
  name = "generic-token", kind = "secret",
  open = [[(?i)]] .. WEAK,
  regex = [[(?i)(?<!:)]] .. KEY_START .. WEAK .. [[(?:_[0-9]{1,4})?]] .. SEP_TAIL .. [==[\\?["'`]?]==] .. PLACEHOLDER .. VALUE_HAS_DIGIT_AND_LETTER_2048
          .. VALUE_NOT_PLACEHOLDER .. UNQUOTED .. [[(?<secret>[^\s"'`,;(){}\[\]<>]{16,2048}+)]],
}

M.default = default

-- The default set without the entries named (e.g. { "generic-secret-quoted" }).
function M.without(names)
  local drop = {}
  for _, n in ipairs(names or {}) do drop[n] = true end
  local out = {}
  for _, r in ipairs(default) do
    if not drop[r.name] then out[#out + 1] = r end
  end
  return out
end

-- ---- literal values --------------------------------------------------------------------

-- Values shorter than this are refused: short values ("1", "true", "prod", "en_US",
-- "admin") occur all over ordinary output, so redacting every occurrence would mangle
-- it; and each "[REDACTED]" marker where such a word used to be would tell the reader
-- the value (a redaction oracle). Real credentials are longer than 8 bytes anyway.
M.LITERAL_MIN = 8

-- A redactor for one literal secret value, matched exactly (the core escapes it).
-- nil for non-strings and values shorter than M.LITERAL_MIN.
function M.literal(value, name)
  if type(value) ~= "string" or #value < M.LITERAL_MIN then return nil end
  name = name or "secret"
  local replace = marker(name)
  -- the marker must not contain the value itself, or the redaction would not be
  -- idempotent (value "REDACTED!" ...): fall back to a marker too short to contain it
  if replace:find(value, 1, true) then replace = "[***]" end
  return { name = name, literal = value, replace = replace }
end

local function escape(s)                  -- a literal as a Lua pattern
  return (s:gsub("[%^%$%(%)%%%.%[%]%*%+%-%?]", "%%%0"))
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
