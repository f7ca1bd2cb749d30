#!/usr/bin/python3
"""Build the held-out half of the redaction corpus from the public rule sets' own test
lists: tests/redact/corpus/heldout-{positives,negatives}.jsonl.

    /usr/bin/python3 tests/redact/import_rulesets.py GITLEAKS_CHECKOUT DETECT_SECRETS_CHECKOUT

The rules in plugins/secrets.lua were written against make_corpus.py's cases; these were
not looked at while writing them. Each checkout is a git directory (bare or not) of
  gitleaks        https://github.com/gitleaks/gitleaks       (MIT)
  detect-secrets  https://github.com/Yelp/detect-secrets     (Apache-2.0)
and the commits read are recorded in corpus/SOURCES (licenses: corpus/NOTICE). What is taken is their test STRINGS
(data), nothing of their code:

- gitleaks: every `tps` and `fps` entry of the rules in cmd/generate/config/rules/*.go of
  the families below. Entries are Go expressions; they are evaluated here: string
  literals, `+`, []string{...}, append, fmt.Sprintf, and the sample generators
  (GenerateSampleSecrets' shapes, secrets.NewSecret / newPlausibleSecret: a random
  string matching a regex, made by `sample()` below, seeded). The secret of a literal
  true positive is what the rule's regex (config/gitleaks.toml) captures.
- detect-secrets: the (line, secret) tables of tests/plugins/*_test.py of the families
  below, evaluated from their AST (string constants, .format, %, +); a line whose
  expected secret is None is a negative.

A gitleaks false positive is a negative for that one rule; for a redactor that knows
every family it may still be a secret (a JWT in a header gitleaks' Basic-auth rule
rejects) or a real-format key that gitleaks only allowlists by value (Google's
published Firebase example keys). Those are listed in LOOK_ALIKES with the reason; they
are kept in the corpus with "kind": "look-alike" and reported apart, not scored as
damage.
"""

import ast
import base64
import json
import os
import random
import re
import warnings
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import sre_constants as C
    import sre_parse
import string
import subprocess
import sys
import tomllib

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "corpus")
R = random.Random(20261201)

# gitleaks rule file -> (family, rule ids taken; None: all rules of the file)
GITLEAKS = {
    "github.go": ("github", None),
    "gitlab.go": ("gitlab", None),
    "openai.go": ("openai", None),
    "anthropic.go": ("anthropic", None),
    "slack.go": ("slack", None),
    "stripe.go": ("stripe", None),
    "npm.go": ("npm", None),
    "pypi.go": ("pypi", None),
    "huggingface.go": ("huggingface", None),
    "atlassian.go": ("atlassian-bitbucket", None),
    "bitbucket.go": ("atlassian-bitbucket", {"bitbucket-client-secret"}),
    "jwt.go": ("jwt", None),
    "aws.go": ("aws", None),
    "gcp.go": ("gcp", {"gcp-api-key"}),
    "azure.go": ("azure", None),
    "privatekey.go": ("private-key", None),
    "curl.go": ("authorization", None),
    "generic.go": ("generic-assignment", None),
}

# detect-secrets test file -> family
DETECT_SECRETS = {
    "aws_key_test.py": "aws",
    "azure_storage_key_test.py": "azure",
    "basic_auth_test.py": "url-credentials",
    "github_token_test.py": "github",
    "gitlab_token_test.py": "gitlab",
    "jwt_test.py": "jwt",
    "keyword_test.py": "generic-assignment",
    "npm_test.py": "npm",
    "openai_test.py": "openai",
    "private_key_test.py": "private-key",
    "pypi_token_test.py": "pypi",
    "slack_test.py": "slack",
    "stripe_key_test.py": "stripe",
}

# Negatives of one rule that a redactor covering every family rightly redacts:
# (substring of the case) -> why.
LOOK_ALIKES = {
    # a longer or shorter variant of a vendor shape: the rules take lengths wider than
    # the vendors' current ones on purpose ("lengths widened where a vendor may grow a
    # token"), so a wrong-length key still goes
    "sk-ant-api03-abc123xyz-456de": "wrong-length Anthropic key (lengths widened on purpose)",
    "sk-ant-admin01-abc123xyz-456de": "wrong-length Anthropic key (lengths widened on purpose)",
    "1234fghijklmnopby56aaaogaopaaaabc123xyzBB": "Anthropic key with a wrong last pair (suffix not required)",
    "sk-ant-admin01-abc123xyz-456def789ghij-klmnopqrstuvwx-3456yza789bcde-1234fghijklmnopby56aaaogaopaaaabc123xyzAA":
        "an admin key under the other Anthropic rule: the same family",
    "sk-ant-api03-abc123xyz-456def789ghij-klmnopqrstuvwx-3456yza789bcde-1234fghijklmnopby56aaaogaopaaaabc123xyzAA":
        "an API key under the admin-key rule: the same family",
    "xoxp-1234-1234-1234-4ddbc191d40ee098cbaae6f3523ada2d": "Slack token with short id segments (lengths widened)",
    "xoxp-572370529330-573807301142-572331691188-####": "the real-format head of a Slack token",
    "glsoat-PREfix_helloworld380_testin_pretty_long_token_long_": "GitLab token longer than detect-secrets allows (widened)",
    "GR1348941PREfix_helloworld380_testin_pretty_long_token_long_": "GitLab token longer than detect-secrets allows (widened)",
    "glimt-my-tokens_are-correctAB": "GitLab token of another length (widened)",
    "glptt-Need5_T00-be-exactly-40-chars--ELse_failing": "GitLab token of another length (widened)",
    "glptt-hellOworld380_testin": "GitLab token of another length (widened)",
    "glagent-hellOworld380_testin": "GitLab token of another length (widened)",
    "gloas-checking_Length-Is-": "GitLab token of another length (widened)",
    "GR134894112312312312312312312": "a real-format GitLab runner token of low entropy",
    "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": "a GitHub token (another family) in GitLab's negative list",
    "eyJhbasdGciOiJIUaddasdasfsasdasdzI1NiIasdsInR5cCI6IkpXVCasdJasd9.": "JWT-shaped, only invalid when base64-decoded",
    "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ.": "JWT-shaped, only invalid when base64-decoded",
    "Authorization: Basic eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.": "a JWT (another family) in a Basic header",
    "registry.npmjs.org:_authToken=743b294a": "an npm token in a line detect-secrets finds malformed",
    "registry.npmjs.org/:_authToken=743b294a": "an npm token in a line detect-secrets finds malformed",
    "///:_authToken=743b294a": "an npm token in a line detect-secrets finds malformed",
    "_authToken=743b294a-cd03-11ec-9d64-0242ac120002": "an npm token in a line detect-secrets finds malformed",
    "sk-proj-Xi8tdMjHV6pmbBbwilTeT4BlbkFJ": "OpenAI key without the T3BlbkFJ marker (not required: newer keys lack it)",
    "pypi-AgEIcHlwaS5vcmcCJDU3OTM1MjliLWIyYTYtNDEwOC05NzRkLTM0MjNiNmEwNWIzYgACF1sxLFsibWluaW1h":
        "a PyPI token shorter than detect-secrets allows (widened)",
    "AIzaSy": "a real-format Google API key published as an example (gitleaks allowlists it by value)",
    "AIzayDNSXIbFmlXbIE6mCzDLQAqITYefhixbX4A": "a real-format Google API key published as an example",
    "aws_access_key: AKIAIOSFODNN7EXAMPLE": "AWS's documented example key, real format",
    "ABSKQmVkcm9ja0FQSUtleS1EXAMPLE": "AWS's documented example Bedrock key, real format",
    ',apiKey:"6fe4476ee5a1832882e326b506d14126",': "a real-format key gitleaks allowlists by value (yarn's)",
    'nonMatchingToken := "task_test_72dc93n8g6sh422hpns2gj2qhzg0b1"': "a random value assigned to a *Token name (generic family)",
}


# ---------------------------------------------------------------- sample generation

ALNUM = string.ascii_letters + string.digits
CATEGORY = {
    C.CATEGORY_DIGIT: string.digits, C.CATEGORY_WORD: ALNUM + "_", C.CATEGORY_SPACE: " ",
    C.CATEGORY_NOT_DIGIT: string.ascii_letters, C.CATEGORY_NOT_WORD: " -.", C.CATEGORY_NOT_SPACE: ALNUM,
}
PRINTABLE = ALNUM + "_-.+/=~"


def _charset(items):
    chars, negate = [], False
    for op, av in items:
        if op is C.NEGATE:
            negate = True
        elif op is C.LITERAL:
            chars.append(chr(av))
        elif op is C.RANGE:
            chars += [chr(c) for c in range(av[0], av[1] + 1)]
        elif op is C.CATEGORY:
            chars += CATEGORY[av]
    if negate:
        chars = [c for c in PRINTABLE if c not in chars]
    return chars


def _gen(parsed, out):
    for op, av in parsed:
        if op is C.LITERAL:
            out.append(chr(av))
        elif op is C.NOT_LITERAL:
            out.append(R.choice([c for c in ALNUM if c != chr(av)]))
        elif op is C.ANY:
            out.append(R.choice(ALNUM))
        elif op is C.IN:
            out.append(R.choice(_charset(av)))
        elif op in (C.MAX_REPEAT, C.MIN_REPEAT, getattr(C, "POSSESSIVE_REPEAT", None)):
            lo, hi, sub = av
            hi = lo + 10 if hi is C.MAXREPEAT else hi
            for _ in range(R.randint(lo, hi)):
                _gen(sub, out)
        elif op is C.SUBPATTERN:
            _gen(av[-1], out)
        elif op is C.BRANCH:
            _gen(R.choice(av[1]), out)
        elif op is C.CATEGORY:
            out.append(R.choice(CATEGORY[av]))
        # anchors and look-arounds produce nothing


def go_regex_to_python(rx):
    rx = rx.replace(r"\z", r"\Z").replace("[[:alnum:]]", "[A-Za-z0-9]").replace("[:alnum:]", "A-Za-z0-9")
    flags = 0
    if "(?i)" in rx:
        rx, flags = rx.replace("(?i)", ""), re.I
    return rx, flags


def sample(rx):
    """A random string matching the (Go syntax) regex rx."""
    py, flags = go_regex_to_python(rx)
    out = []
    _gen(sre_parse.parse(py, flags), out)
    return "".join(out)


def plausible(rx):
    """gitleaks' newPlausibleSecret: a sample with a digit in it."""
    while True:
        s = sample(rx)
        if re.search("[1-9]", s):
            return s


# ---------------------------------------------------------------- Go test lists

TOKEN = re.compile(r"""
    (?P<ws>\s+) | (?P<comment>//[^\n]*|/\*.*?\*/) |
    (?P<raw>`[^`]*`) | (?P<str>"(?:[^"\\\n]|\\.)*") | (?P<rune>'(?:[^'\\]|\\.)+') |
    (?P<ident>[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*) | (?P<num>[0-9]+) |
    (?P<op>\.\.\.|:=|==|!=|&&|\|\||[-+*/%(){}\[\],;:=<>!&|.^])
""", re.X | re.S)


def go_tokens(src):
    toks, i = [], 0
    while i < len(src):
        m = TOKEN.match(src, i)
        if not m:
            raise ValueError("cannot tokenize at %r" % src[i:i + 40])
        i = m.end()
        kind = m.lastgroup
        if kind in ("ws", "comment"):
            continue
        text = m.group()
        if kind == "raw":
            toks.append(("str", text[1:-1].replace("\r", "")))
        elif kind == "str":
            toks.append(("str", ast.literal_eval(text)))
        else:
            toks.append((kind, text))
    return toks


class Unsupported(Exception):
    pass


class GStr:
    """A string value with the generated secrets it holds."""

    def __init__(self, text, secrets=()):
        self.text, self.secrets = text, list(secrets)

    def __add__(self, o):
        return GStr(self.text + o.text, self.secrets + o.secrets)


SAMPLE_SHAPES = None      # GenerateSampleSecrets' templates, read from the checkout


def sample_secrets(ident, secret):
    rep = lambda t: t.replace("{i}", ident).replace("{I}", ident.upper()).replace("{s}", secret)
    return [GStr(rep(t), [secret]) for t in SAMPLE_SHAPES]


def sprintf(fmt, args):
    it = iter(args)
    return re.sub(r"%[sdvq]", lambda m: next(it), fmt)


class Evaluator:
    def __init__(self, toks, env):
        self.t, self.i, self.env = toks, 0, env

    def peek(self, k=0):
        return self.t[self.i + k] if self.i + k < len(self.t) else ("eof", "")

    def take(self, text=None):
        tok = self.t[self.i]
        if text is not None and tok[1] != text:
            raise Unsupported("expected %r got %r" % (text, tok))
        self.i += 1
        return tok

    def expr(self):
        v = self.primary()
        while self.peek()[1] == "+":
            self.take()
            w = self.primary()
            if not (isinstance(v, GStr) and isinstance(w, GStr)):
                raise Unsupported("+ on non-strings")
            v = v + w
        return v

    def args(self):
        self.take("(")
        out = []
        while self.peek()[1] != ")":
            v = self.expr()
            if self.peek()[1] == "...":
                self.take()
                out.append(("spread", v))
            else:
                out.append(v)
            if self.peek()[1] == ",":
                self.take()
        self.take(")")
        return out

    def primary(self):
        kind, text = self.take()
        if kind == "str":
            return GStr(text)
        if text == "[":
            self.take("]")
            self.take()                       # element type
            self.take("{")
            out = []
            while self.peek()[1] != "}":
                out.append(self.expr())
                if self.peek()[1] == ",":
                    self.take()
            self.take("}")
            return out
        if kind == "ident":
            if self.peek()[1] == "(":
                return self.call(text, self.args())
            if text in self.env:
                return self.env[text]
            raise Unsupported("unknown name " + text)
        if kind == "num":
            return GStr(text)
        raise Unsupported("unexpected %r" % text)

    def call(self, name, args):
        s = lambda k: args[k].text
        helpers = {"utils.Numeric": "[0-9]{%s}", "utils.Hex": "[a-f0-9]{%s}",
                   "utils.AlphaNumeric": "[a-z0-9]{%s}", "utils.AlphaNumericExtendedShort": "[a-z0-9_-]{%s}",
                   "utils.AlphaNumericExtended": r"[a-z0-9=_\-]{%s}",
                   "utils.AlphaNumericExtendedLong": r"[a-z0-9\/=_\+\-]{%s}"}
        if name in helpers:
            return GStr(helpers[name] % s(0))
        if name == "utils.Hex8_4_4_4_12":
            return GStr("[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
        if name == "secrets.NewSecret":
            v = sample(s(0))
            return GStr(v, [v])
        if name == "newPlausibleSecret":
            v = plausible(s(0))
            return GStr(v, [v])
        if name == "utils.GenerateSampleSecrets":
            return sample_secrets(s(0), s(1))
        if name == "utils.GenerateSampleSecret":
            return GStr('%s_api_token = "%s"' % (s(0), s(1)), [s(1)])
        if name == "fmt.Sprintf":
            return GStr(sprintf(s(0), [a.text for a in args[1:]]),
                        [x for a in args[1:] for x in a.secrets])
        if name == "strings.Repeat":
            return GStr(s(0) * int(s(1)))
        if name == "append":
            out = list(args[0])
            for a in args[1:]:
                if isinstance(a, tuple):
                    out += a[1]
                else:
                    out.append(a)
            return out
        raise Unsupported("call " + name)


def rule_functions(src):
    """(rule id, body tokens) of each `func X() *config.Rule { ... }`."""
    toks = go_tokens(src)
    out = []
    i = 0
    while i < len(toks):
        if toks[i] == ("ident", "func") and i + 5 < len(toks) and toks[i + 4][1] == "*" \
                and toks[i + 5][1] == "config.Rule":
            j = i + 6
            assert toks[j][1] == "{", toks[j]
            depth, k = 0, j
            while True:
                depth += {"{": 1, "}": -1}.get(toks[k][1], 0)
                if depth == 0:
                    break
                k += 1
            body = toks[j + 1:k]
            rid = None
            for a in range(len(body) - 2):
                if body[a][1] == "RuleID" and body[a + 1][1] == ":":
                    rid = body[a + 2][1]
                    break
            out.append((rid, toks[i + 1][1], body))
            i = k
        else:
            i += 1
    return out


def eval_lists(body, global_env):
    """Evaluate the statements `NAME := EXPR` / `NAME = EXPR` of a rule body whose value
    is a string or a list; returns (tps, fps, skipped statements)."""
    env = dict(global_env)
    skipped = []
    i = 0
    while i < len(body):
        if body[i][0] == "ident" and i + 1 < len(body) and body[i + 1][1] in (":=", "=") \
                and (i == 0 or body[i - 1][1] in ("}", ")", "{", ";") or body[i - 1][0] in ("str", "ident", "num")):
            name = body[i][1]
            ev = Evaluator(body, env)
            ev.i = i + 2
            try:
                v = ev.expr()
                env[name] = v
                i = ev.i
                continue
            except (Unsupported, IndexError, ValueError, re.error) as e:
                if name in ("tps", "fps"):
                    skipped.append("%s: %s" % (name, e))
        i += 1
    as_list = lambda v: v if isinstance(v, list) else ([v] if isinstance(v, GStr) else [])
    return as_list(env.get("tps")), as_list(env.get("fps")), skipped


def toml_rules(git, commit):
    data = tomllib.loads(subprocess.run(["git", "-C", git, "show", commit + ":config/gitleaks.toml"],
                                        check=True, capture_output=True, text=True).stdout)
    return {r["id"]: r for r in data["rules"]}


def secret_of(rule, text):
    """What the gitleaks rule captures in text (its secretGroup, else its first group)."""
    if not rule or "regex" not in rule:
        return None
    try:
        py, flags = go_regex_to_python(rule["regex"])
        m = re.search(py, text, flags)
    except re.error:
        return None
    if not m:
        return None
    g = rule.get("secretGroup") or 0
    if g:
        return m.group(g)
    for k in range(1, (m.lastindex or 0) + 1):
        if m.group(k):
            return m.group(k)
    return m.group(0)


def gitleaks(git, positives, negatives, report):
    global SAMPLE_SHAPES
    commit = subprocess.run(["git", "-C", git, "rev-parse", "HEAD"], check=True, capture_output=True,
                            text=True).stdout.strip()
    show = lambda p: subprocess.run(["git", "-C", git, "show", "%s:%s" % (commit, p)], check=True,
                                    capture_output=True, text=True).stdout
    gen = show("cmd/generate/config/utils/generate.go")
    block = gen[gen.index("samples := map[string]string{"):]
    block = block[:block.index("\n\t}\n")]
    # commented-out entries are shapes gitleaks itself does not handle yet (TODO)
    block = "\n".join(line for line in block.split("\n") if not line.lstrip().startswith("//"))
    SAMPLE_SHAPES = [v for k, v in re.findall(r'((?:"[^"\n]*"))\s*:\s*((?:"(?:[^"\\\n]|\\.)*"|`[^`]*`))', block)
                     for v in [ast.literal_eval(v) if v.startswith('"') else v[1:-1]]]
    rules = toml_rules(git, commit)
    for fname, (family, only) in GITLEAKS.items():
        src = show("cmd/generate/config/rules/" + fname)
        for rid, func, body in rule_functions(src):
            if rid is None or (only and rid not in only):
                continue
            tps, fps, skipped = eval_lists(body, {})
            for s in skipped:
                report.append("gitleaks %s %s: skipped %s" % (fname, rid, s))
            for v in tps:
                secrets = v.secrets or [secret_of(rules.get(rid), v.text)]
                secrets = [x for x in secrets if x]
                if not secrets:
                    report.append("gitleaks %s %s: no secret found in tp %r" % (fname, rid, v.text[:80]))
                    continue
                positives.append({"family": family, "source": "gitleaks:%s %s tps" % (fname, rid),
                                  "text": v.text, "secrets": secrets})
            for v in fps:
                negatives.append({"family": family, "source": "gitleaks:%s %s fps" % (fname, rid),
                                  "text": v.text})
    return commit


# ---------------------------------------------------------------- detect-secrets tables

class PyEval:
    def __init__(self, env):
        self.env = env

    def __call__(self, node):
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, (ast.Tuple, ast.List)):
            return [self(e) for e in node.elts]
        if isinstance(node, ast.Name):
            if node.id in self.env:
                return self.env[node.id]
            raise Unsupported(node.id)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return self(node.left) + self(node.right)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
            r = self(node.right)
            return self(node.left) % (tuple(r) if isinstance(r, list) else r)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
            return self(node.left) * self(node.right)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format":
            return self(node.func.value).format(*[self(a) for a in node.args])
        if isinstance(node, ast.JoinedStr):
            return "".join(str(self(v.value)) if isinstance(v, ast.FormattedValue) else v.value
                           for v in node.values)
        raise Unsupported(ast.dump(node)[:60])


def detect_secrets(git, positives, negatives, report):
    commit = subprocess.run(["git", "-C", git, "rev-parse", "HEAD"], check=True, capture_output=True,
                            text=True).stdout.strip()
    for fname, family in DETECT_SECRETS.items():
        src = subprocess.run(["git", "-C", git, "show", "%s:tests/plugins/%s" % (commit, fname)],
                             check=True, capture_output=True, text=True).stdout
        tree = ast.parse(src)
        env = {}
        ev = PyEval(env)
        tables = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                try:
                    env[node.targets[0].id] = ev(node.value)
                except (Unsupported, TypeError, KeyError, IndexError, ValueError):
                    pass
            # @pytest.mark.parametrize('a,b', [...]) tables
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "parametrize" \
                    and len(node.args) >= 2:
                try:
                    tables.append((ev(node.args[0]), ev(node.args[1])))
                except (Unsupported, TypeError, KeyError, IndexError, ValueError) as e:
                    report.append("detect-secrets %s: a table skipped (%s)" % (fname, e))
        for name, value in env.items():
            if name.endswith("_TEST_CASES") and isinstance(value, list):
                tables.append(("line,secret", value))
        seen = set()
        for names, rows in tables:
            names = [n.strip() for n in names.split(",")] if isinstance(names, str) else names
            for row in rows:
                row = row if isinstance(row, list) else [row]
                fields = dict(zip(names, row))
                line = next((v for k, v in fields.items() if isinstance(v, str) and k in
                             ("line", "payload", "text", "token", "file_content", "secret")), None)
                if not isinstance(line, str) or len(line) > 20000 or line in seen:
                    continue
                seen.add(line)
                should = [v for k, v in fields.items() if k in ("should_flag", "expected_result")]
                if "secret" in fields and "line" in fields:
                    is_pos = fields["secret"] is not None
                    secret = fields["secret"]
                elif should:
                    is_pos = bool(should[0])
                    secret = None
                else:
                    is_pos, secret = True, None
                src_tag = "detect-secrets:tests/plugins/%s" % fname
                if is_pos:
                    positives.append({"family": family, "source": src_tag, "text": line,
                                      "secrets": [secret] if secret else [], "need_secret": secret is None})
                else:
                    negatives.append({"family": family, "source": src_tag, "text": line})
    return commit


def rnd(n, alphabet=ALNUM):
    return "".join(R.choice(alphabet) for _ in range(n))


B64 = ALNUM + "+/"
HEX = "0123456789abcdef"


def recorder(positives, negatives, tag):
    """pos(family, what, text, *secrets) and neg(family, what, text), sourced "tag:what"."""
    def pos(family, what, text, *secrets):
        for x in secrets:
            assert x in text, (what, x)
        positives.append({"family": family, "source": tag + ":" + what, "text": text, "secrets": list(secrets)})

    def neg(family, what, text):
        negatives.append({"family": family, "source": tag + ":" + what, "text": text})
    return pos, neg


def own_heldout(positives, negatives):
    """Families no public rule set has a test list for (connection strings, .netrc,
    docker and kube config, .env, URL credentials, service-account JSON, header
    schemes): shapes written for this set after the rules, from the tools' own
    documentation, and never used while writing the rules. Source "heldout:<what>"."""
    pos, neg = recorder(positives, negatives, "heldout")

    pw = lambda: rnd(R.randrange(10, 22), ALNUM + "!*-_.~") + R.choice("0123456789")

    def shapes(family, table, rounds=3):
        """Each (what, template, make) of table, `rounds` times: template % a value."""
        for _ in range(rounds):
            for what, template, make in table:
                value = make()
                pos(family, what, template % value, value)

    shapes("url-credentials", [
        ("git remote", "git remote add origin https://deploy:%s@git.example.com/team/app.git", pw),
        ("IPv6 host", 'DATABASE_URL="postgresql://app:%s@[::1]:5432/app"', pw),
        ("proxy variable", "export https_proxy=http://proxyuser:%s@proxy.corp:3128", pw),
        ("percent-encoded password", "amqps://svc:%s@mq.example/vhost", lambda: rnd(8) + "%40" + rnd(6) + "%2F1"),
        ("replica set", "mongodb://admin:%s@h1:27017,h2:27017/?replicaSet=rs0", pw),
        ("user is an address", "smtp://mailer%%40example.com:%s@smtp.example:587", pw),
        ("pip index url", "pip install --index-url https://__token__:%s@pypi.example/simple pkg",
         lambda: "pypi-AgEIcHlwaS5vcmc" + rnd(60, ALNUM + "-_")),
    ])
    for t in ["https://user@example.com/", "ssh://git@example.com:2222/repo.git", "http://[::1]:8080/health",
              "see https://example.com/a:b@c for details", "postgresql:///app?host=/var/run/postgresql",
              "redis://redis:6379", "s3://bucket/key:with:colons", "file:///home/u/a@b.txt"]:
        neg("url-credentials", "URLs without a password", t)

    shapes("connection-string", [
        ("JDBC SQL Server", "jdbc:sqlserver://db.example:1433;databaseName=app;user=sa;password=%s;encrypt=true", pw),
        ("ADO.NET Data Source", "Data Source=db.example;Initial Catalog=app;User Id=app;Password=%s;", pw),
        ("Npgsql", "Host=db;Port=5432;Database=app;Username=app;Password=%s", pw),
        ("ODBC", "Driver={ODBC Driver 18 for SQL Server};Server=db;UID=app;PWD=%s;", pw),
        ("appsettings.json", '"ConnectionStrings": {\n  "Default": "Server=db;Database=app;User Id=app;Password=%s;"\n}', pw),
        ("libpq keywords, other order", "dbname=app password=%s host=db user=app", lambda: rnd(14)),
        ("JDBC query, other order", "jdbc:postgresql://db/app?password=%s&user=app&ssl=true", pw),
    ])
    for t in ["Server=db;Database=app;Trusted_Connection=True;", "Password=;", "jdbc:h2:mem:test",
              "Data Source=app.db;Mode=ReadOnly", "host=db user=app dbname=app sslmode=verify-full"]:
        neg("connection-string", "connection strings without a password", t)

    shapes("netrc", [
        ("tab-indented", "machine api.example.com\n\tlogin bob\n\tpassword %s\n", pw),
        ("default entry", "default login anonymous password %s", pw),
        ("with port", "machine git.example.com login ci password %s port 443", pw),
    ])
    neg("netrc", "prose", "The machine learning model's password field is empty.")
    neg("netrc", "prose", "machine translation\nlogin page\npassword reset")

    for _ in range(4):
        a = base64.b64encode(("ci:" + rnd(24)).encode()).decode()
        pos("docker", "compact config.json", '{"auths":{"registry.example:5000":{"auth":"%s"}}}' % a, a)
        t = rnd(200, ALNUM + "-_.")
        pos("docker", "podman auth.json identitytoken",
            '{\n    "auths": {\n        "quay.io": {\n            "identitytoken": "%s"\n        }\n    }\n}' % t, t)
    neg("docker", "config without secrets", '{"auths": {"ghcr.io": {}}, "credsStore": "desktop"}')
    neg("docker", "config without secrets", '{"credHelpers": {"123.dkr.ecr.us-east-1.amazonaws.com": "ecr-login"}}')

    for _ in range(3):
        ckd = base64.b64encode(b"-----BEGIN EC PRIVATE KEY-----\n" + rnd(120, B64).encode()
                               + b"\n-----END EC PRIVATE KEY-----\n").decode()
        pos("kubeconfig", "JSON kubeconfig", '{"users": [{"name": "admin", "user": {"client-key-data": "%s"}}]}' % ckd, ckd[:60])
        tok = rnd(6, "abcdefghijklmnopqrstuvwxyz0123456789") + "." + rnd(16, "abcdefghijklmnopqrstuvwxyz0123456789")
        pos("kubeconfig", "bootstrap token", "users:\n- name: kubelet\n  user:\n    token: %s\n" % tok, tok)
        at = "ya29." + rnd(100, ALNUM + "-_")
        pos("kubeconfig", "auth-provider",
            "    auth-provider:\n      config:\n        access-token: %s\n        expiry: 2026-11-30T12:00:00Z\n" % at, at)
        p = pw()
        pos("kubeconfig", "basic auth user", "- name: admin\n  user:\n    username: admin\n    password: %s\n" % p, p)
    neg("kubeconfig", "redacted view", "users:\n- name: admin\n  user:\n    client-certificate-data: DATA+OMITTED\n"
        "    client-key-data: DATA+OMITTED\n")
    neg("kubeconfig", "no credentials", "contexts:\n- context:\n    cluster: kind\n    user: kind\n  name: kind\n")

    for _ in range(3):
        vals = ["NEXTAUTH_SECRET=" + rnd(44, B64), "SESSION_SECRET='%s'" % rnd(32), 'export GITHUB_CLIENT_SECRET="%s"' % rnd(40, HEX),
                "REDIS_PASSWORD=" + pw(), "ENCRYPTION_KEY=" + rnd(64, HEX), "OPENAI_API_KEY=sk-" + rnd(48),
                "JWT_SIGNING_KEY=" + rnd(40), "SMTP_PASSWORD=" + pw()]
        text = "# production\nNODE_ENV=production\nLOG_LEVEL=info\n" + "\n".join(vals) + "\n"
        pos("env-file", "more .env names", text, *[v.split("=", 1)[1].strip("'\"") for v in vals])
    neg("env-file", ".env without secrets", "NODE_ENV=production\nPORT=3000\nLOG_LEVEL=debug\nSECRET_NAME=prod/db\n")
    neg("env-file", ".env placeholders", "API_KEY=\nDB_PASSWORD=changeme\nSECRET_KEY=${SECRET_KEY}\n")

    # service-account key files: other layouts than make_corpus.py's
    key = subprocess.run(["openssl", "genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048"],
                         check=True, capture_output=True, text=True).stdout
    sa = {"type": "service_account", "project_id": "heldout-project", "private_key_id": rnd(40, HEX),
          "private_key": key, "client_email": "ci@heldout-project.iam.gserviceaccount.com",
          "client_id": rnd(21, "0123456789"), "token_uri": "https://oauth2.googleapis.com/token",
          "universe_domain": "googleapis.com"}
    body = json.dumps(key)[1:-1]
    mid = body[60:120]
    pos("gcp-service-account", "indent 4", json.dumps(sa, indent=4), sa["private_key_id"], mid)
    pos("gcp-service-account", "keys sorted", json.dumps(sa, sort_keys=True, indent=1), sa["private_key_id"], mid)
    pos("gcp-service-account", "slashes escaped (PHP json_encode)", json.dumps(sa).replace("/", "\\/"),
        sa["private_key_id"], mid.replace("/", "\\/"))
    pos("gcp-service-account", "as an environment variable", "GOOGLE_CREDENTIALS='%s'" % json.dumps(sa),
        sa["private_key_id"], mid)
    # private keys in layouts make_corpus.py has not: EC with its parameters block,
    # Ed25519/X25519 PKCS#8, an encrypted PKCS#8 key, a key after a certificate
    run = lambda *a: subprocess.run(a, check=True, capture_output=True, text=True).stdout
    ec = run("openssl", "ecparam", "-name", "secp384r1", "-genkey")
    ed = run("openssl", "genpkey", "-algorithm", "ed25519")
    x = run("openssl", "genpkey", "-algorithm", "x25519")
    enc = run("openssl", "genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-aes-256-cbc",
              "-pass", "pass:heldout")
    for what, k in [("openssl ecparam -genkey (EC PARAMETERS + key)", ec), ("openssl ed25519", ed),
                    ("openssl x25519", x), ("encrypted PKCS#8", enc)]:
        body = [l for l in k.split("\n") if l and not l.startswith("-----")]
        pos("private-key", what, "$ kubectl get secret tls -o jsonpath='{.data.key}' | base64 -d\n" + k, body[-1])
    pos("private-key", "key after a certificate (cert.pem with the key)",
        "-----BEGIN CERTIFICATE-----\nMIIBszCCAVmgAwIBAgIUQ\n-----END CERTIFICATE-----\n" + ed, ed.split("\n")[1])
    neg("gcp-service-account", "no key", json.dumps({"type": "service_account", "project_id": "p",
                                                     "client_email": "a@p.iam.gserviceaccount.com"}))

    for _ in range(3):
        t = rnd(40, ALNUM + "-_")
        pos("authorization", "curl --oauth2-bearer", "curl --oauth2-bearer %s https://api.example.com/v1/me" % t, t)
        t = rnd(32, ALNUM)
        pos("authorization", "wget --header", 'wget --header="Authorization: Bearer %s" https://x.example/f' % t, t)
        t = "glpat-" + rnd(20, ALNUM + "-_")
        pos("authorization", "GitLab PRIVATE-TOKEN header", 'curl -H "PRIVATE-TOKEN: %s" https://gitlab.example/api/v4/projects' % t, t)
        t = rnd(40, ALNUM)
        pos("authorization", "Proxy-Authorization", "> Proxy-Authorization: Basic %s\n" % t, t)
        t = rnd(30, ALNUM)
        pos("authorization", "httpie", "http GET :8080/api Authorization:'Token %s'" % t, t)
    neg("authorization", "headers without credentials", "> Accept: */*\n> User-Agent: curl/8.5.0\n> Authorization: Bearer\n")
    neg("authorization", "docs", "Pass the token in the Authorization header, e.g. Authorization: Bearer <token>.")


def own_heldout_after_fixes(positives, negatives):
    """A second batch, written after the rules were fixed against the first held-out
    cases and scored before any further change: real tools' outputs an agent prints
    (az, kubectl, terraform, docker inspect, git credential, framework .env files).
    Source "heldout2:<what>"."""
    pos, neg = recorder(positives, negatives, "heldout2")

    pw = lambda: rnd(R.randrange(12, 24), ALNUM + "!*-_.~") + R.choice("0123456789")
    for _ in range(3):
        k1, k2 = rnd(86, B64) + "==", rnd(86, B64) + "=="
        pos("azure", "az storage account keys list",
            '[\n  {\n    "creationTime": "2026-11-30T10:00:00+00:00",\n    "keyName": "key1",\n'
            '    "permissions": "FULL",\n    "value": "%s"\n  },\n  {\n    "creationTime": '
            '"2026-11-30T10:00:00+00:00",\n    "keyName": "key2",\n    "permissions": "FULL",\n'
            '    "value": "%s"\n  }\n]' % (k1, k2), k1, k2)
        sig = rnd(43, B64).replace("+", "%2B").replace("/", "%2F") + "%3D"
        pos("azure", "SAS URL", "https://acct.blob.core.windows.net/c/f.txt?sv=2022-11-02&ss=b&srt=o&sp=r"
            "&se=2026-12-01T00:00:00Z&st=2026-11-30T00:00:00Z&spr=https&sig=%s" % sig, sig)
        s = rnd(3, ALNUM) + R.choice("0123456789") + "Q~" + rnd(34, ALNUM + "_~.-")
        pos("azure", "az ad sp create-for-rbac", '{\n  "appId": "%s",\n  "displayName": "ci",\n  "password": "%s",\n'
            '  "tenant": "%s"\n}' % (rnd(8, HEX), s, rnd(8, HEX)), s)
        k = "sk-ant-api03-" + rnd(93, ALNUM + "-_") + "AA"
        pos("anthropic", "request header", "curl https://api.anthropic.com/v1/messages -H 'x-api-key: %s' "
            "-H 'anthropic-version: 2023-06-01'" % k, k)
        k = "sk-ant-admin01-" + rnd(93, ALNUM + "-_") + "AA"
        pos("anthropic", "env dump", "ANTHROPIC_ADMIN_KEY=%s\nHOME=/home/u" % k, k)
        v1, v2 = pw(), "sk_live_" + rnd(24)
        pos("kubeconfig", "kubectl get deploy -o yaml (env)",
            "        env:\n        - name: DB_PASSWORD\n          value: %s\n        - name: STRIPE_KEY\n"
            "          value: %s\n        - name: LOG_LEVEL\n          value: info\n" % (v1, v2), v1, v2)
        v = pw()
        pos("generic-assignment", "terraform output -json",
            '{\n  "db_password": {\n    "sensitive": true,\n    "type": "string",\n    "value": "%s"\n  }\n}' % v, v)
        v = pw()
        pos("generic-assignment", "docker inspect (Env)",
            '            "Env": [\n                "POSTGRES_PASSWORD=%s",\n                "PATH=/usr/bin"\n            ],' % v, v)
        t = "ghp_" + rnd(36)
        pos("github", "git credential fill", "protocol=https\nhost=github.com\nusername=bob\npassword=%s\n" % t, t)
        v = pw()
        pos("generic-assignment", "git credential fill (plain password)",
            "protocol=https\nhost=git.example.com\nusername=bob\npassword=%s\n" % v, v)
        envs = ["SECRET_KEY_BASE=" + rnd(128, HEX), "APP_KEY=base64:" + rnd(43, B64) + "=",
                "TWILIO_AUTH_TOKEN=" + rnd(32, HEX), "STRIPE_WEBHOOK_SECRET=whsec_" + rnd(32),
                "MAILGUN_API_KEY=key-" + rnd(32, HEX)]
        pos("env-file", "framework .env (Rails, Laravel, Twilio, Stripe, Mailgun)", "\n".join(envs) + "\n",
            *[e.split("=", 1)[1] for e in envs])
        a = base64.b64encode(("bob:" + pw()).encode()).decode()
        pos("docker", "config.json with credsStore and email",
            '{\n\t"auths": {\n\t\t"registry.gitlab.com": {\n\t\t\t"auth": "%s",\n\t\t\t"email": "bob@example.com"\n'
            '\t\t}\n\t},\n\t"credsStore": "pass"\n}' % a, a)
        p = pw()
        pos("netrc", "several machines on one line",
            "machine a.example login u1 password %s machine b.example login u2 password %s" % (p, p[::-1]), p, p[::-1])
    for t in ['"keyName": "key1",', "        - name: LOG_LEVEL\n          value: info",
              '{"db_host": {"sensitive": false, "value": "db.internal"}}',
              "protocol=https\nhost=github.com\nusername=bob\n", "APP_NAME=shop\nAPP_ENV=production\n"]:
        neg("ordinary", "outputs without secrets", t)


def payload_secret(family, text):
    """The secret of a detect-secrets payload whose table names none: the password of a
    URL, the body of a key, else the longest token-like run."""
    if family == "url-credentials":
        m = re.search(r"://[^:/@\s]*:([^@\s]+)@", text)
        return m and m.group(1)
    if family == "private-key":
        m = re.search(r"-----\n(.+?)\n-----END", text, re.S)
        return m and m.group(1).split("\n")[0]
    runs = re.findall(r"[A-Za-z0-9+/=_~.-]{8,}", text)
    return max(runs, key=len) if runs else None


def main():
    gl, ds = sys.argv[1], sys.argv[2]
    positives, negatives, report = [], [], []
    gl_commit = gitleaks(gl, positives, negatives, report)
    ds_commit = detect_secrets(ds, positives, negatives, report)
    own_heldout(positives, negatives)
    own_heldout_after_fixes(positives, negatives)
    for p in positives:
        if p.pop("need_secret", False):
            p["secrets"] = [x for x in [payload_secret(p["family"], p["text"])] if x]
    dropped = [p for p in positives if not p["secrets"]]
    for p in dropped:
        report.append("no secret known for %s %r" % (p["source"], p["text"][:60]))
    positives = [p for p in positives if p["secrets"]]
    for n in negatives:
        for pat, why in LOOK_ALIKES.items():
            if pat in n["text"]:
                n["kind"] = "look-alike"
                n["why"] = why
    for name, rows in [("heldout-positives.jsonl", positives), ("heldout-negatives.jsonl", negatives)]:
        with open(os.path.join(OUT, name), "w") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    with open(os.path.join(OUT, "SOURCES"), "w") as f:
        f.write("gitleaks %s\ndetect-secrets %s\n" % (gl_commit, ds_commit))
    fams = {}
    for p in positives:
        fams[p["family"]] = fams.get(p["family"], 0) + 1
    print("held-out positives:", len(positives), dict(sorted(fams.items())))
    print("held-out negatives:", len(negatives))
    for line in report:
        print("  note:", line)


if __name__ == "__main__":
    main()
