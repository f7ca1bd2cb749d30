"""Redaction costs the supervisor CPU linear in the output whatever the output repeats:
for every rule of the default set, text made of nothing but that rule's opener (or the
opener with a short value, or "=" after it) redacts 1 MiB within a bound of supervisor
CPU. `pwd=` x N used to cost O(n^2) (an attempt per opener, each scanning to the end of
the run: 256 KiB, ~80 s); what any policy's regex may cost is bounded by the stream's
work budget (README, Redaction), so the bound holds even for a rule not listed here."""

import os

import pytest

from serve_helpers import ServeProc
from stockade_testlib import PLUGINS, POLICY, state_directory

SIZE = 1 << 20
# Generous: the work budget alone caps a 1 MiB stream near 1.3 s; plain text costs ~0.06 s.
CPU_BOUND_S = 4.0

# One or more openers per rule of plugins/secrets.lua (the rule in the comment).
OPENERS = [
    "-----BEGIN RSA PRIVATE KEY-----", "-----BEGIN PGP PRIVATE KEY BLOCK-----",  # private-key
    "eyJ", "eyJhbGciOiJIUzI1NiJ9.",                         # jwt
    "sk-ant-", "sk-proj-", "sk-", "hf_", "api_org_",         # anthropic, openai, huggingface
    "AKIA", "ABSKQmVkcm9ja0FQSUtleS",                        # aws-access-key, bedrock
    "aws_secret=", "secret_access_key:",                     # aws-secret-access-key
    "aws_session_token=", "sessiontoken:",                   # aws-session-token
    "AIza", "GOCSPX-", "ya29.", '"private_key_id":',         # gcp
    "account_key=", "AccountKey=", '"keyName":',              # azure-storage-key(-listing)
    "abc1Q~",                                                # azure-client-secret
    "github_pat_", "ghp_", "glpat-", "_gitlab_session=", "GR1348941",
    "ATATT3", "xoxb-", "xapp-", "xoxe.xoxb-", "hooks.slack.com/",
    "sk_live_", "npm_", ":_authToken=", "pypi-AgE",
    "://", "://u:", "?sig=", "&X-Amz-Signature=",            # url-password, url-signature
    "password=", "pwd=", "Password =", ";Password=",         # connection-string-password
    "APP_KEY=", "machine ", "default ",                      # laravel, netrc
    "token ", "token=", "client-key-data:",                  # kubeadm, kubeconfig
    '"auth":', '"identitytoken":',                           # docker-auth
    "authorization:", "Authorization: Bearer ", "proxy-authorization:",
    "x-api-key:", "api-key:", "private-token:",              # api-key-header
    "cookie:", "Set-Cookie: a=",                             # cookie
    "curl -u ", "curl ", "--oauth2-bearer ",                 # curl-user, curl-oauth2-bearer
    "--password=", "--db-token ",                            # cli-option-secret
    "docker login -p ", "sshpass -p", "mysql -p",            # cli-login-password
    "secret=", "api_key: ", "SECRET_KEY = '", 'password="',  # generic-secret(-quoted)
    "aToken=", "access_token=", "auth:",                     # generic-token
]
SHAPES = {
    "opener": lambda o: o,
    "opener+a7": lambda o: o + "a1b2c3d",
    "opener+eq": lambda o: o + "=",
}


def supervisor_cpu_s(pid):
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime + stime


@pytest.fixture(scope="module")
def server(request, stockade, tmp_path_factory):
    with state_directory("stockade-rd-") as state:
        s = ServeProc(stockade, state, POLICY, log_dir=str(tmp_path_factory.mktemp("log")),
                      extra_env={"STOCKADE_PLUGIN_PATH": os.environ.get(
                          "STOCKADE_PLUGIN_PATH", PLUGINS)})
        try:
            yield s, s.client.open_session()
        finally:
            s.stop()


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_dense_openers_cost_linear_cpu(server, shape):
    s, session = server
    worst = (-1.0, "")
    for opener in OPENERS:
        unit = SHAPES[shape](opener)
        before = supervisor_cpu_s(s.proc.pid)
        r = session.call("sh", ["-c", 'yes -- "$1" | head -n "$2" | tr -d "\\n"', "sh", unit,
                                str(SIZE // len(unit))])
        cost = supervisor_cpu_s(s.proc.pid) - before
        assert r.ok, (unit, r)
        assert len(r.stdout) > 0, unit
        worst = max(worst, (cost, unit))
        assert cost < CPU_BOUND_S, \
            f"1 MiB of {unit!r} x N cost {cost:.2f}s of supervisor CPU (bound {CPU_BOUND_S}s)"
    print(f"worst: {worst[1]!r} {worst[0]:.2f}s")


def test_header_name_repeated_is_not_its_own_credential(server):
    """`authorization:` x N (a dump of header names) came out as one [REDACTED]."""
    s, session = server
    text = "authorization:" * 40 + "\nAuthorization: Bearer abcdefghijklmnop1234\n"
    r = session.call("sh", ["-c", "printf %s \"$1\"", "sh", text])
    assert r.ok, r
    assert r.stdout.startswith(b"authorization:" * 40 + b"\n"), r.stdout[:120]
    assert r.stdout.endswith(b"Authorization: Bearer [REDACTED:authorization]\n"), r.stdout
