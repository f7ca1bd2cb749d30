#!/usr/bin/python3
"""Build the redaction corpus: tests/redact/corpus/{positives,negatives}.jsonl.

    /usr/bin/python3 tests/redact/make_corpus.py      # rewrites the corpus

Positives, one JSON object a line: {"family", "source", "text", "secrets": [...]}; a
case counts as caught when no secret (nor its last 8 characters) survives redaction.
Negatives: {"family", "source", "text"}; a case counts as intact when redaction leaves
it byte for byte. Sources:

- the public rule sets' own test cases, cited per case ("gitleaks:<rule file>",
  "detect-secrets:<plugin>", "trufflehog:<detector>"), and their sample shapes
  (gitleaks' GenerateSampleSecrets: INI, JSON, YAML, Go, Java, Python, Makefile ...);
- outputs of real tools run here ("tool:ssh-keygen", "tool:openssl", "tool:gpg",
  "tool:git", "tool:curl"): throwaway keys and credentials made for this corpus only;
- agent-style files written here ("file:~/.aws/credentials", "file:kubeconfig" ...).

Every generated value is random (seeded: the corpus is reproducible up to the keys the
tools make). Nothing in it is a live credential.
"""

import base64
import json
import os
import random
import shutil
import string
import subprocess
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "corpus")
R = random.Random(20261130)

ALNUM = string.ascii_letters + string.digits
UPPER_NUM = string.ascii_uppercase + string.digits
LOWER_NUM = string.ascii_lowercase + string.digits
HEX = "0123456789abcdef"
B64 = ALNUM + "+/"
B64URL = ALNUM + "-_"

positives, negatives = [], []


def rnd(n, alphabet=ALNUM):
    return "".join(R.choice(alphabet) for _ in range(n))


def pos(family, source, text, *secrets):
    for s in secrets:
        assert s in text, (family, source, s)
    positives.append({"family": family, "source": source, "text": text, "secrets": list(secrets)})


def neg(family, source, text):
    negatives.append({"family": family, "source": source, "text": text})


# gitleaks cmd/generate/config/utils/generate.go GenerateSampleSecrets: the shapes in
# which a token appears in configuration and code ({i}: an identifier, {s}: the secret).
SAMPLES = [
    '{i}Token="{s}"', '{i}Token = "{s}"', '{i}Token={s}', '{i}Token = {s}',
    '{{\n    "{i}_token": "{s}"\n}}', '{{"config.ini": "{I}_TOKEN={s}\\nBACKUP_ENABLED=true"}}',
    '<{i}Token>\n    {s}\n</{i}Token>', '{i}_token: {s}', "{i}_token: '{s}'", '{i}_token: "{s}"',
    'string {i}Token = "{s}";', 'var {i}Token string = "{s}"', '{i}Token := "{s}"',
    '{i}Token := `{s}`', 'String {i}Token = "{s}";', 'var {i}Token = "{s}"',
    '${i}Token .= "{s}"', "{i}Token = '{s}'", '{i}Token = "{s}"',
    'System.setProperty("{I}_TOKEN", "{s}")', '  "{i}Token" => "{s}"',
    '{i}_TOKEN = "{s}"', '{i}_TOKEN := "{s}"', '{i}_TOKEN ::= "{s}"',
]
# Agent-style contexts: a token in a log line, an error, a command, a URL query.
CONTEXTS = [
    "{s}", "token: {s}", "export TOKEN={s}", "2026-11-30T10:00:00Z INFO using key {s} for upload",
    "Error: invalid credentials ({s})", "$ tool login --token {s}\nLogged in.",
    "https://api.example.com/v1/items?key={s}&page=2", "[{s}]", '"{s}",',
]


def token_family(family, source, ident, make, n_samples=None):
    for tmpl in SAMPLES[: n_samples or len(SAMPLES)]:
        s = make()
        pos(family, source + " (gitleaks sample shape)", tmpl.format(i=ident, I=ident.upper(), s=s), s)
    for tmpl in CONTEXTS:
        s = make()
        pos(family, source + " (in context)", tmpl.format(s=s), s)


# ---- prefixed tokens --------------------------------------------------------------------

token_family("github", "gitleaks:github.go", "github",
             lambda: R.choice(["ghp_", "gho_", "ghu_", "ghs_", "ghr_"]) + rnd(36))
token_family("github", "gitleaks:github.go github-fine-grained-pat", "github",
             lambda: "github_pat_" + rnd(22) + "_" + rnd(59), 6)
pos("github", "tool:git remote -v",
    "origin\thttps://x-access-token:ghs_%s@github.com/org/repo.git (fetch)" % rnd(36),
    )  # the secret check below is on the URL password
positives[-1]["secrets"] = [positives[-1]["text"].split(":")[2].split("@")[0]]

token_family("gitlab", "gitleaks:gitlab.go", "gitlab", lambda: R.choice(
    ["glpat-", "gldt-", "glft-", "glsoat-", "glrt-", "glimt-"]) + rnd(20, B64URL))
for pfx, body in [("glptt-", lambda: rnd(40, HEX)), ("gloas-", lambda: rnd(64, B64URL)),
                  ("GR1348941", lambda: rnd(20, B64URL)),
                  ("glpat-", lambda: rnd(27, B64URL) + "." + rnd(2, LOWER_NUM) + rnd(7, LOWER_NUM)),
                  ("glcbt-", lambda: "2a_" + rnd(20, B64URL)),
                  ("glagent-", lambda: rnd(50, B64URL))]:
    s = pfx + body()
    pos("gitlab", "detect-secrets:gitlab_token.py", "GITLAB_TOKEN=" + s, s)
    s = pfx + body()
    pos("gitlab", "gitleaks:gitlab.go", "git clone https://oauth2:%s@gitlab.com/g/p.git" % s, s)

token_family("openai", "gitleaks:openai.go", "openai", lambda: R.choice(
    ["sk-proj-", "sk-svcacct-", "sk-admin-"]) + rnd(74, B64URL) + "T3BlbkFJ" + rnd(74, B64URL))
token_family("openai", "gitleaks:openai.go (legacy)", "openai",
             lambda: "sk-" + rnd(20) + "T3BlbkFJ" + rnd(20), 8)
for s in ["sk-proj-SevzWEV_NmNnMndQ5gn6PjFcX_9ay5SEKse8AL0EuYAB0cIgFW7Equ3vCbUbYShvii6L3rBw3WT3Blbk"
          "FJdD9FqO9Z3BoBu9F-KFR6YJtvW6fUfqg2o2Lfel3diT3OCRmBB24hjcd_uLEjgr9tCqnnerVw8A",
          "sk-admin-JWARXiHjpLXSh6W_0pFGb3sW7yr0cKheXXtWGMY0Q8kbBNqsxLskJy0LCOT3BlbkFJgTJWgjMvdi6YlP"
          "vdXRqmSlZ4dLK-nFxUG2d9Tgaz5Q6weGVNBaLuUmMV4A"]:
    pos("openai", "gitleaks:openai.go tps", 'OPENAI_API_KEY="%s"' % s, s)

token_family("anthropic", "gitleaks:anthropic.go", "anthropic", lambda: R.choice(
    ["sk-ant-api03-", "sk-ant-admin01-"]) + rnd(93, B64URL) + "AA")
pos("anthropic", "gitleaks:anthropic.go tps",
    "sk-ant-api03-abc123xyz-456def789ghij-klmnopqrstuvwx-3456yza789bcde-1234fghijklmnopby56aaaogaop"
    "aaaabc123xyzAA",
    "sk-ant-api03-abc123xyz-456def789ghij-klmnopqrstuvwx-3456yza789bcde-1234fghijklmnopby56aaaogaop"
    "aaaabc123xyzAA")

token_family("slack", "gitleaks:slack.go", "slack", lambda: R.choice([
    "xoxb-%s-%s-%s" % (rnd(12, string.digits), rnd(13, string.digits), rnd(24)),
    "xoxp-%s-%s-%s-%s" % (rnd(11, string.digits), rnd(12, string.digits), rnd(12, string.digits), rnd(32, HEX)),
    "xapp-1-A%s-%s-%s" % (rnd(10, UPPER_NUM), rnd(13, string.digits), rnd(64, HEX)),
    "xoxe.xoxp-1-" + rnd(166, UPPER_NUM),
    "xoxe-1-" + rnd(146, UPPER_NUM),
]))
for s in ['xoxb-781236542736-2364535789652-GkwFDQoHqzXDVsC6GzqYUypD',
          'xoxp-41684372915-1320496754-45609968301-e708ba56e1517a99f6b5fb07349476ef']:
    pos("slack", "gitleaks:slack.go tps", '"bot_token": "%s"' % s, s)
for _ in range(4):
    path = "T%s/B%s/%s" % (rnd(8, UPPER_NUM), rnd(8, UPPER_NUM), rnd(24))
    pos("slack", "gitleaks:slack.go slack-webhook-url",
        "curl -X POST https://hooks.slack.com/services/%s -d @msg.json" % path, path)

token_family("stripe", "gitleaks:stripe.go", "stripe", lambda: R.choice(
    ["sk_live_", "rk_live_", "sk_test_", "rk_test_", "sk_prod_"]) + rnd(R.choice([24, 99])))
pos("stripe", "gitleaks:stripe.go tps",
    "sk_test_51OuEMLAlTWGaDypq4P5cuDHbuKeG4tAGPYHJpEXQ7zE8mKK3jkhTFPvCxnSSK5zB5EQZrJsYdsatNmAHGgb0vSKD00GTMSWRHs",
    "sk_test_51OuEMLAlTWGaDypq4P5cuDHbuKeG4tAGPYHJpEXQ7zE8mKK3jkhTFPvCxnSSK5zB5EQZrJsYdsatNmAHGgb0vSKD00GTMSWRHs")

token_family("npm", "gitleaks:npm.go / trufflehog:npmtokenv2", "npm", lambda: "npm_" + rnd(36), 12)
for _ in range(6):
    s = R.choice(["npm_" + rnd(36), "%s-%s-%s-%s-%s" % (rnd(8, HEX), rnd(4, HEX), rnd(4, HEX), rnd(4, HEX), rnd(12, HEX))])
    pos("npm", "detect-secrets:npm.py (.npmrc)", "registry=https://registry.npmjs.org/\n"
        "//registry.npmjs.org/:_authToken=%s\nalways-auth=true" % s, s)

token_family("pypi", "gitleaks:pypi.go", "pypi", lambda: "pypi-AgEIcHlwaS5vcmc" + rnd(R.choice([70, 150]), B64URL), 12)
for _ in range(5):
    s = "pypi-AgEIcHlwaS5vcmc" + rnd(140, B64URL)
    pos("pypi", "file:~/.pypirc", "[distutils]\nindex-servers = pypi\n\n[pypi]\nusername = __token__\n"
        "password = %s\n" % s, s)

token_family("huggingface", "gitleaks:huggingface.go / trufflehog:huggingface", "huggingface",
             lambda: R.choice(["hf_", "api_org_"]) + rnd(34, string.ascii_letters), 12)
pos("huggingface", "gitleaks:huggingface.go tps",
    "huggingface-cli login --token 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", "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")
pos("huggingface", "gitleaks:huggingface.go tps",
    "DEV=1 HF_TOKEN=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 poetry run python app.py",
    "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")

token_family("atlassian-bitbucket", "gitleaks:atlassian.go / trufflehog:bitbucketapppassword",
             "atlassian", lambda: R.choice(["ATATT3" + rnd(186, B64URL + "="),
                                            "ATBB" + rnd(32),
                                            "ATCTT3xFfG" + rnd(120, B64URL) + "=" + rnd(8)]), 14)
for _ in range(3):
    s = "ATBB" + rnd(32)
    pos("atlassian-bitbucket", "trufflehog:bitbucketapppassword",
        "git clone https://bob:%s@bitbucket.org/team/repo.git" % s, s)

# JWT: header.payload.signature, built like real ones
def jwt():
    h = base64.urlsafe_b64encode(json.dumps({"alg": "HS256", "typ": "JWT"}).encode()).rstrip(b"=").decode()
    p = base64.urlsafe_b64encode(json.dumps({"sub": rnd(10), "iat": R.randrange(10**9, 2 * 10**9),
                                             "name": rnd(8)}).encode()).rstrip(b"=").decode()
    return "%s.%s.%s" % (h, p, rnd(43, B64URL))


token_family("jwt", "gitleaks:jwt.go", "jwt", jwt, 10)
pos("jwt", "gitleaks:jwt.go tps",
    "python examples/cli.py eyJhbGciOiJIUzI1NiJ9.eyJJc3N1ZXIiOiJJc3N1ZXIiLCJVc2VybmFtZSI6IkJhZFNlY3J"
    "ldHMiLCJleHAiOjE1OTMxMzM0ODMsImlhdCI6MTQ2NjkwMzA4M30.ovqRikAo_0kKJ0GVrAwQlezymxrLGjcEiW_s3UJMMCo",
    "eyJhbGciOiJIUzI1NiJ9.eyJJc3N1ZXIiOiJJc3N1ZXIiLCJVc2VybmFtZSI6IkJhZFNlY3JldHMiLCJleHAiOjE1OTMxMzM0"
    "ODMsImlhdCI6MTQ2NjkwMzA4M30.ovqRikAo_0kKJ0GVrAwQlezymxrLGjcEiW_s3UJMMCo")

# ---- AWS ----------------------------------------------------------------------------------

for i in range(14):
    kid = R.choice(["AKIA", "ASIA", "ABIA", "ACCA"]) + rnd(16, "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567")
    sec = rnd(40, B64)
    pos("aws", "file:~/.aws/credentials", "[profile%d]\naws_access_key_id = %s\naws_secret_access_key = %s\n"
        % (i, kid, sec), kid, sec)
for _ in range(6):
    kid, sec, tok = "ASIA" + rnd(16, UPPER_NUM), rnd(40, B64), rnd(356, B64)
    pos("aws", "tool:aws configure export-credentials (JSON)",
        '{\n  "Version": 1,\n  "AccessKeyId": "%s",\n  "SecretAccessKey": "%s",\n  "SessionToken": "%s",\n'
        '  "Expiration": "2026-11-30T12:00:00+00:00"\n}' % (kid, sec, tok), kid, sec, tok)
    kid, sec, tok = "ASIA" + rnd(16, UPPER_NUM), rnd(40, B64), rnd(300, B64)
    pos("aws", "file:.env (env vars)", "AWS_ACCESS_KEY_ID=%s\nAWS_SECRET_ACCESS_KEY=%s\nAWS_SESSION_TOKEN=%s\n"
        % (kid, sec, tok), kid, sec, tok)
pos("aws", "gitleaks:aws.go tps", "aws_access_key_id = AKIALALEMEL33243OLIB", "AKIALALEMEL33243OLIB")

# ---- Google Cloud ---------------------------------------------------------------------------------

token_family("gcp", "gitleaks:gcp.go gcp-api-key", "gcp", lambda: "AIza" + rnd(35, B64URL), 8)
for s in ["AIzaSyAnLA7NfeLquW1tJFpx_eQCxoX-oo6YyIs", "AIzaSyD3asb-2pEZVqMkmL6M9N6nHZRR_znhrh0"]:
    pos("gcp", "gitleaks:gcp.go tps", 'apiKey: "%s"' % s, s)
for _ in range(6):
    cs, rt = "GOCSPX-" + rnd(28, B64URL), "1//0g" + rnd(100, B64URL)
    pos("gcp", "trufflehog:gcpapplicationdefaultcredentials (ADC JSON)",
        '{\n  "client_id": "%s.apps.googleusercontent.com",\n  "client_secret": "%s",\n'
        '  "refresh_token": "%s",\n  "type": "authorized_user"\n}' % (rnd(12, string.digits), cs, rt), cs, rt)
for _ in range(6):
    s = "ya29." + rnd(150, B64URL)
    pos("gcp", "trufflehog:googleoauth2", "$ gcloud auth print-access-token\n%s\n" % s, s)
    s = "ya29." + rnd(120, B64URL)
    pos("gcp", "trufflehog:googleoauth2", "curl -H 'Authorization: Bearer %s' https://www.googleapis.com/x" % s, s)

# ---- Azure ----------------------------------------------------------------------------------------------

for _ in range(8):
    k = rnd(86, B64) + "=="
    pos("azure", "detect-secrets:azure_storage_key.py",
        "DefaultEndpointsProtocol=https;AccountName=acct%s;AccountKey=%s;EndpointSuffix=core.windows.net"
        % (rnd(5, LOWER_NUM), k), k)
    k = rnd(86, B64) + "=="
    pos("azure", "trufflehog:azure_storage", '"storageAccountKey": "%s"' % k, k)
for s in ["bP88Q~rcBcYjzzOhg1Hnn76Wm3jGgakZiZ.8vMgR", ".IQ8Q~79R7TOWOspFnWcEG-dYt4KXqFqxK16cxr",
          "_V28Q~IC8qxmlWNpHuDm34JlbKv9LXV5MvUR3a-P", "YYz7Q~Sudoqwap1PnzEBA3zqBK~i5uesDIv.C",
          "t028Q~-aLbmQuinnZtzbgtlEAYstnBWEmGPAoBm"]:
    pos("azure", "gitleaks:azure.go azure-ad-client-secret tps", "AZURE_CLIENT_SECRET=%s" % s, s)
for _ in range(6):
    s = rnd(3, ALNUM) + R.choice(string.digits) + "Q~" + rnd(34, ALNUM + "_~.-")
    pos("azure", "gitleaks:azure.go shape", '{"appId": "%s", "password": "%s", "tenant": "%s"}'
        % (rnd(8, HEX), s, rnd(8, HEX)), s)

# ---- URLs, connection strings, config files ---------------------------------------------------------------

for scheme in ["postgres", "postgresql", "mysql", "redis", "rediss", "amqp", "mongodb", "mongodb+srv",
               "https", "ftp", "sftp", "mssql", "clickhouse", "nats"]:
    pw = rnd(R.randrange(8, 24), ALNUM + "!$*-_.~")
    pos("url-credentials", "trufflehog:uri / %s" % scheme,
        "%s://%s:%s@db.internal.example:5432/app?sslmode=require" % (scheme, rnd(6, string.ascii_lowercase), pw), pw)
pos("url-credentials", "trufflehog:redis", "REDIS_URL=redis://:%s@cache:6379/0" % "p4ssW0rd-redis", "p4ssW0rd-redis")

for _ in range(6):
    pw = rnd(14, ALNUM + "!#%")
    pos("connection-string", "trufflehog:jdbc",
        "jdbc:mysql://db.example:3306/shop?user=app&password=%s&useSSL=true" % pw, pw)
    pw = rnd(14, ALNUM + "!#%")
    pos("connection-string", "trufflehog:sqlserver (ADO.NET)",
        "Server=tcp:sql.example,1433;Database=app;User ID=app;Password=%s;Encrypt=True;" % pw, pw)
    pw = rnd(14, ALNUM)
    pos("connection-string", "trufflehog:postgres (libpq)",
        "psql \"host=db.example port=5432 dbname=app user=app password=%s sslmode=require\"" % pw, pw)
    pw = rnd(14, ALNUM)
    pos("connection-string", "trufflehog:postgres (libpq)", "host=db user=app password='%s' dbname=app" % pw, pw)

GENERIC_KEYS = ["password", "passwd", "pwd", "db_password", "DB_PASSWORD", "MYSQL_ROOT_PASSWORD",
                "api_key", "apiKey", "API_KEY", "secret", "client_secret", "SECRET_KEY", "secret_key",
                "private_key", "access_key", "auth_key", "credentials", "dbPassword", "mySecret"]
for key in GENERIC_KEYS:
    for tmpl in ['{k} = "{s}"', "{k}: {s}", "{k}={s}", "'{k}': '{s}',", '"{k}": "{s}"',
                 "{k} := \"{s}\""]:
        s = rnd(R.randrange(10, 32), ALNUM + "!@#%^&*") + R.choice(string.digits)
        pos("generic-assignment", "detect-secrets:keyword.py / gitleaks:generic.go (shape)",
            tmpl.format(k=key, s=s), s)
for line, s in [("SECRET_KEY = 'django-insecure-8#f!x2$k@p0w9q)z(3u%m&v1e^r7t'",
                 "django-insecure-8#f!x2$k@p0w9q)z(3u%m&v1e^r7t"),
                ('"client_secret" : "6da89121079f83b2eb6acccf8219ea982c3d79bccc3e9c6a85856480661f8fde",',
                 "6da89121079f83b2eb6acccf8219ea982c3d79bccc3e9c6a85856480661f8fde"),
                ('"credentials" : "0afae57f3ccfd9d7f5767067bc48b30f719e271ba470488056e37ab35d4b6506"',
                 "0afae57f3ccfd9d7f5767067bc48b30f719e271ba470488056e37ab35d4b6506"),
                ("access_token = 'b8e9c0f1a2d34e5f6a7b8c9d0e1f2a3b'", "b8e9c0f1a2d34e5f6a7b8c9d0e1f2a3b")]:
    pos("generic-assignment", "gitleaks:generic.go tps", line, s)

for _ in range(10):
    vals = {k: rnd(R.randrange(12, 40), ALNUM) + R.choice(string.digits) for k in
            ["DATABASE_PASSWORD", "STRIPE_SECRET", "JWT_SECRET", "SENDGRID_API_KEY", "AUTH_TOKEN"]}
    text = "# .env\nNODE_ENV=production\nPORT=3000\n" + "".join("%s=%s\n" % kv for kv in vals.items())
    pos("env-file", "file:.env", text, *vals.values())

for _ in range(8):
    pw = rnd(16, ALNUM + "!#")
    pos("netrc", "file:~/.netrc", "machine api.example.com\n  login bob\n  password %s\n" % pw, pw)
    pw = rnd(16, ALNUM)
    pos("netrc", "file:~/.netrc", "machine git.example.com login ci password %s" % pw, pw)


# command lines (an agent's own commands, `ps`, shell history, CI logs)
for _ in range(3):
    pw = rnd(14, ALNUM + "!#%") + R.choice(string.digits)
    for tmpl in ["mysql -h db -u root --password=%s shop", "psql --dbname=app --db-password %s",
                 "gh auth login --token %s", "vault write auth/x --client-secret='%s'",
                 "docker login -u ci -p %s registry.example", "helm registry login r.example --username u --password %s",
                 "sshpass -p '%s' ssh deploy@host", "mysqldump -u root -p%s --all-databases"]:
        pos("generic-assignment", "command line (written here)", tmpl % pw, pw)


def run(*argv, **kw):
    return subprocess.run(argv, check=True, capture_output=True, **kw).stdout.decode()


tmp = tempfile.mkdtemp(prefix="corpus-")
try:
    # ---- private keys, made by the tools --------------------------------------------------------
    keys = []
    for kind, bits in [("rsa", 2048), ("rsa", 4096), ("ed25519", None), ("ecdsa", 521)]:
        path = os.path.join(tmp, "id_%s_%s" % (kind, bits))
        argv = ["ssh-keygen", "-q", "-t", kind, "-N", "", "-C", "corpus", "-f", path]
        if bits:
            argv[2:2] = ["-b", str(bits)]
        run(*argv)
        keys.append(("tool:ssh-keygen -t %s" % kind, open(path).read()))
    for argv, label in [(["openssl", "genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048"], "pkcs8"),
                        (["openssl", "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256"], "ec pkcs8"),
                        (["openssl", "genrsa", "-traditional", "2048"], "pkcs1"),
                        (["openssl", "genrsa", "-traditional", "-aes128", "-passout", "pass:corpus", "2048"], "legacy encrypted"),
                        (["openssl", "genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:16384"], "rsa-16384")]:
        keys.append(("tool:openssl %s" % label, run(*argv)))
    home = os.path.join(tmp, "gnupg")
    os.makedirs(home, mode=0o700)
    run("gpg", "--homedir", home, "--batch", "--passphrase", "", "--quick-gen-key", "corpus <c@example.invalid>",
        "rsa3072", "default", "never")
    fpr = run("gpg", "--homedir", home, "--list-keys", "--with-colons").split("fpr:::::::::")[1].split(":")[0]
    run("gpg", "--homedir", home, "--batch", "--passphrase", "", "--quick-add-key", fpr, "rsa3072", "encr", "never")
    run("gpg", "--homedir", home, "--batch", "--passphrase", "", "--quick-add-key", fpr, "rsa3072", "sign", "never")
    keys.append(("tool:gpg --export-secret-keys --armor (with subkeys)",
                 run("gpg", "--homedir", home, "--batch", "--pinentry-mode", "loopback", "--passphrase", "",
                     "--export-secret-keys", "--armor")))
    for source, key in keys:
        key = key.strip("\n")
        pos("private-key", source, "$ cat key.pem\n%s\n$ " % key, key)
        # inside a diff: a removed hunk, an added hunk, context lines
        for mark in "-+ ":
            body = "\n".join(mark + line for line in key.split("\n"))
            pos("private-key", source + " in a diff hunk (%r)" % mark,
                "diff --git a/key.pem b/key.pem\n--- a/key.pem\n+++ b/key.pem\n@@ -1,3 +1,3 @@\n%s\n" % body,
                *[l for l in key.split("\n")[1:-1] if len(l) >= 40][:3])
        # inside YAML, indented
        yaml = "tls:\n  key: |\n" + "\n".join("    " + l for l in key.split("\n")) + "\n"
        pos("private-key", source + " in YAML", yaml, *[l for l in key.split("\n")[1:-1] if len(l) >= 40][:3])
    # GCP service-account JSON: the key as a JSON string with \n escapes
    pk = keys[4][1]
    sa = {"type": "service_account", "project_id": "corpus-project", "private_key_id": rnd(40, HEX),
          "private_key": pk, "client_email": "sa@corpus-project.iam.gserviceaccount.com",
          "client_id": rnd(21, string.digits), "auth_uri": "https://accounts.google.com/o/oauth2/auth",
          "token_uri": "https://oauth2.googleapis.com/token",
          "auth_provider_x509_cert_url": "https://www.googleapis.com/oauth2/v1/certs"}
    text = json.dumps(sa, indent=2)
    pos("gcp-service-account", "file:service-account.json (openssl key)", text, sa["private_key_id"],
        json.dumps(pk)[1:-1][40:100])
    pos("gcp-service-account", "file:service-account.json, one line", json.dumps(sa), sa["private_key_id"],
        json.dumps(pk)[1:-1][40:100])

    # kubeconfig: client-key-data (base64 of a PEM key), token, password
    for i in range(6):
        ckd = base64.b64encode(keys[6][1].encode()).decode()
        tok = rnd(40, LOWER_NUM) + "." + rnd(60, B64URL) if i % 2 else jwt()
        text = ("apiVersion: v1\nkind: Config\nclusters:\n- cluster:\n    certificate-authority-data: %s\n"
                "    server: https://10.0.0.1:6443\n  name: c\nusers:\n- name: admin\n  user:\n"
                "    client-certificate-data: %s\n    client-key-data: %s\n- name: sa\n  user:\n    token: %s\n"
                % (rnd(200, B64), rnd(200, B64), ckd, tok))
        pos("kubeconfig", "file:~/.kube/config (kubectl config view --raw)", text, ckd[:60], tok)

    # docker config.json
    for _ in range(6):
        auth = base64.b64encode(("bob:" + rnd(20)).encode()).decode()
        idt = rnd(120, B64URL)
        text = json.dumps({"auths": {"https://index.docker.io/v1/": {"auth": auth},
                                     "ghcr.io": {"auth": base64.b64encode(b"bob:ghp_" + rnd(36).encode()).decode()},
                                     "registry.example": {"identitytoken": idt}}}, indent="\t")
        pos("docker", "file:~/.docker/config.json (trufflehog:docker_auth_config shape)", text, auth, idt)

    # HTTP authentication: curl -v output, headers, curl -u
    for _ in range(5):
        tok = rnd(40, B64URL)
        out = subprocess.run(["curl", "-sv", "-H", "Authorization: Token " + tok, "-H", "X-API-Key: k" + tok[:30],
                              "-b", "sessionid=" + tok[5:35], "http://127.0.0.1:9/"],
                             capture_output=True).stderr.decode()
        pos("authorization", "tool:curl -v (refused connection: the request lines it prints)",
            out + "\n> Authorization: Token %s\n> X-API-Key: k%s\n> Cookie: sessionid=%s\n" % (tok, tok[:30], tok[5:35]),
            tok, "k" + tok[:30], tok[5:35])
    for scheme in ["Bearer", "Basic", "Token", "token", "bearer", "Digest", "ApiKey"]:
        s = rnd(32, B64URL) if scheme != "Basic" else base64.b64encode(("u:" + rnd(12)).encode()).decode()
        pos("authorization", "gitleaks:curl.go curl-auth-header (shape)",
            'curl -H "Authorization: %s %s" https://api.example.com/v1/me' % (scheme, s), s)
        s = rnd(32, B64URL)
        pos("authorization", "HTTP/2 headers (lower case)", "authorization: %s %s\n" % (scheme.lower(), s), s)
    for hdr in ["X-API-Key", "x-api-key", "X-Auth-Token", "X-Access-Token", "Api-Key"]:
        s = rnd(36, B64URL)
        pos("authorization", "gitleaks:curl.go (X-Api-Key shape)", "%s: %s" % (hdr, s), s)
    for user, pw in [("johns", "h0pk1ns~21s"), ("api", "d2LkV78zLx!t"), ("kevin", "pRf7vG2h1L8nQkW9")]:
        pos("authorization", "gitleaks:curl.go curl-auth-user tps", "curl -s --user '%s:%s' https://api.example.com" % (user, pw), pw)
        pos("authorization", "gitleaks:curl.go curl-auth-user (-u)", "curl -u %s:%s https://x.example" % (user, pw), pw)
    for _ in range(4):
        s = rnd(40, B64URL)
        pos("authorization", "Set-Cookie header", "< HTTP/1.1 200 OK\n< Set-Cookie: session=%s; Path=/; HttpOnly\n" % s, s)
finally:
    shutil.rmtree(tmp, ignore_errors=True)

# ---- negatives: ordinary text that must come out byte for byte -----------------------------------------------

NEG = [
    # words that contain or look like a prefix (the precision findings)
    "task-abcdefghijklmnopqrstuvw", "xAKIAIOSFODNN7EXAMPLEx", "mask_test_abcdefghijklmnopqrstuvwxyz0123",
    "risk-management-assessment-framework-document", "desk-abcdefghijklmnopqrstuvwxyz0123456789",
    "sk-loading-spinner-container", "the task-force-abcdefghijklmnopqrstuvwxyz met", "ASIAN_MARKETS_SUMMARY",
    "wghp_abcdefghijklmnopqrstuvwxyz0123456789", "hf_transfer", "npm_config_cache=/tmp/npm",
    # PEM markers in prose and code, public material
    "The file starts with -----BEGIN RSA PRIVATE KEY----- and ends with -----END RSA PRIVATE KEY-----.",
    'if (strstr(buf, "-----BEGIN PRIVATE KEY-----")) {\n    type = KEY_PKCS8;\n} else if (strstr(buf, "-----END PRIVATE KEY-----")) {\n    done = 1;\n}',
    '#define PEM_BEGIN "-----BEGIN EC PRIVATE KEY-----"\n#define PEM_END   "-----END EC PRIVATE KEY-----"\nstatic int parse(void);',
    "-----BEGIN PRIVATE KEY-----\nanything\n-----END PRIVATE KEY-----",
    "-----BEGIN OPENSSH PRIVATE KEY----------END OPENSSH PRIVATE KEY-----",
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGq2Xo5a2Xs3bL8n1uJzq4cT8Kk8i0QYf8mQj1oV0x7P corpus@host",
    # code that names secrets without containing any
    "password = getpass.getpass()", "if not password:\n    raise ValueError('password required')",
    "self.password = password", "api_key = os.environ['API_KEY']", "token = tokens[i]",
    "secret_length = 32", "tokens = tokenize(text)", "password_hash = hash_password(password)",
    "def check_password(self, raw_password):", "const token = await getToken();",
    "password: string;", "apiKey: string | undefined;", "SECRET_KEY = os.environ.get('SECRET_KEY')",
    "password = request.form['password']", "auth = HTTPBasicAuth(user, password)",
    "if token is None:", "key = cache_key(request)", "secret: ${{ secrets.DEPLOY_KEY }}",
    "password: {{ .Values.db.password }}", "password=$DB_PASSWORD", "api_key = <your-api-key>",
    "export API_TOKEN=${API_TOKEN}", "Authorization: Bearer $TOKEN", "Authorization: Bearer <token>",
    'curl -u "$USER:$PASS" https://x', "curl -u username:token", "token_type: bearer",
    "The password is stored as a salted hash; never log it.", "Enter your password:",
    "Password: ", "passwd: all authentication tokens updated successfully.",
    "secret: true", "password: null", "token: 42", "auth: none", "apikey: ''",
    "password_min_length = 12", "pwd = os.getcwd()", "PWD=/home/user/project",
    # identifiers, hashes, ids, URLs without credentials
    "commit 3f786850e387550fdab836ed7e6dc881de23001b", "9b2cf535f27731c974343645a3985328",
    "550e8400-e29b-41d4-a716-446655440000", "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "https://example.com:8443/path?query=1&page=2", "git@github.com:org/repo.git", "ssh://git@host:22/repo.git",
    "mailto:someone@example.com", "http://user@host.example/", "https://docs.example.com/auth/token-refresh",
    "postgres://localhost/app", "redis://cache:6379/0", "jdbc:postgresql://db:5432/app?sslmode=require",
    "Server=tcp:sql.example,1433;Database=app;Integrated Security=true;",
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg==",
    "Traceback (most recent call last):\n  File \"/usr/lib/python3/app.py\", line 10, in <module>\n    main()\nKeyError: 'token'",
    "eyJ is how a JSON object starts in base64url", "AIza is the prefix of Google API keys",
    "The key (ghp_ prefix) was revoked.", "sk-ant- prefixed keys are Anthropic's.",
    "Set AWS_SECRET_ACCESS_KEY in your environment.", "aws_secret_access_key = YOUR_SECRET_KEY",
    "client-key-data: DATA+OMITTED", "    client-certificate-data: REDACTED",
    '{"auths": {}}', "Cookie: yes please", "machine learning password manager",
    "x-api-key header is required", "Authorization header missing", "ghp_ tokens expire",
    "ssh -p 2222 deploy@host", "mkdir -p build/out", "mysql -u root -p shop", "--password PASSWORD",
    "--token TOKEN", "--password-file /run/secrets/db", "echo --password=$DB_PASS",
    "been renamed to --http-password and --proxy-password respectively, and",
    "docker login -u ci --password-stdin registry.example",
]
for text in NEG:
    neg("ordinary", "written for this corpus", text)
# gitleaks rules' own false positives (fps lists)
for src, text in [
    ("gitleaks:aws.go fps", 'msgstr "Näytä asiakirjamallikansio."'),
    ("gitleaks:aws.go fps", "TODAYINASIAASACKOFRICEFELLOVER"),
    ("gitleaks:gcp.go fps", '"type": "service_account"'),
    ("gitleaks:gcp.go fps", "AIZASYCO2CXRMC9ELSKLHLHRMBSWDEVEDZTLO2O"),
    ("gitleaks:generic.go fps", '"accessor":"rA1wk0Y45YCufyfq",'),
    ("gitleaks:generic.go fps", "report_access_id: e8e4df51-2054-49b0-ab1c-516ac95c691d"),
    ("gitleaks:generic.go fps", 'this.ultraPictureBox1.Name = "ultraPictureBox1";'),
    ("gitleaks:generic.go fps", "[DEBUG]\t\torg.slf4j.slf4j-api:jar:1.7.8.:compile (version managed from default)"),
    ("gitleaks:generic.go fps", "apiUrl=apigee.corpint.com"),
    ("gitleaks:generic.go fps", 'author = "james.fake@ymail.com",'),
    ("gitleaks:generic.go fps", "Authentication-Results: 5h.ca.iphmx.com"),
    ("gitleaks:curl.go fps", 'curl -u "${_username}:${_password}"'),
    ("gitleaks:curl.go fps", "curl --user neo4j:[PASSWORD] http://[IP]:7474/db/data/"),
    ("gitleaks:slack.go fps", "xoxb-xxx"),
    ("gitleaks:slack.go fps", "xoxb-12345-abcd234"),
    ("gitleaks:github.go fps", "ghp_" + "x" * 3),
    ("gitleaks:privatekey.go fps", "-----BEGIN PRIVATE KEY-----\nanything\n-----END PRIVATE KEY-----"),
]:
    neg("ordinary", src, text)

os.makedirs(OUT, exist_ok=True)
for name, rows in [("positives.jsonl", positives), ("negatives.jsonl", negatives)]:
    with open(os.path.join(OUT, name), "w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
fams = {}
for p in positives:
    fams[p["family"]] = fams.get(p["family"], 0) + 1
print("positives:", len(positives), fams)
print("negatives:", len(negatives))
