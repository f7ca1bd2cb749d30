"""Integration tests of `stockade serve`, the MessagePack-RPC server (PROTOCOL.md).

The real binary is driven two ways: through the Python client in contrib/python
(stockade_client) and with raw msgpack bytes (serve_helpers.RawConn), so that what is on
the wire — bin vs str, the error slot vs the result map, msgids, the order of messages —
is asserted, not only what the client makes of it. Every wait is bounded.

    cd /work/main && PYTHONPATH=contrib/python /usr/bin/python3 -m pytest -q \
        -p no:cacheprovider tests/integration/test_serve.py
"""

import asyncio
import os
import random
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import threading
import time

import msgpack
import pytest

from serve_helpers import (BROKEN_POLICY, REDACT_POLICY, LIMITS_POLICY, MiB, POLICY, RELOAD_A, RELOAD_B,
                           RPC_TIMEOUT, SMALL_POLICY, STOP_TIMEOUT, UUID4_RE, WIDE_POLICY,
                           connect_as, note_args,
                           Closed, ServeProc, clean_env, assert_marker_gone, children, fd_count,
                           proc_state, stop_all,
                           is_int, live_with_marker, one_line, sessions_left,
                           summarize, vmrss_kb, wait_until)
from stockade_client import (AsyncClient, BadRequest, CALL_RESULT_FIELDS, CallResult, Cancelled,
                             ConnectionClosed,
                             NoSuchSession, OutputChunk, Overloaded, PolicyViolation,
                             SessionExpired,
                             StockadeError, ToolError, ToolTimeout)
from stockade_testlib import fixture_levels

DEFAULT_OUTPUT_CAP = 1 << 20          # policies/default.lua: limits.output = "1MiB"
DEFAULT_MAX_MESSAGE = 16 * MiB        # PROTOCOL.md: max_message default


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def serve_available(stockade):
    cp = subprocess.run([stockade, "serve", "--help"], capture_output=True, timeout=10)
    if cp.returncode != 0:
        pytest.fail(f"`stockade serve --help` exited {cp.returncode}: the serve command is "
                    f"missing: {cp.stderr[-500:]!r}")
    return stockade


@pytest.fixture
def serve(serve_available, state_dir, tmp_path):
    """serve(policy=POLICY, args=(), listen=False, raw=False) -> ServeProc; stopped at
    teardown, with its stderr printed (shown by pytest when the test failed)."""
    servers = []

    def start(policy=POLICY, args=(), listen=False, raw=False, env=None):
        s = ServeProc(serve_available, state_dir, policy, args, listen=listen, raw=raw,
                      log_dir=str(tmp_path), extra_env=env)
        servers.append(s)
        return s

    def report(s):
        text = s.stderr_text() if not s.log.closed else open(s.log_path, "rb").read().decode(
            "utf-8", "replace")
        if text:
            print(f"---- stderr of {' '.join(s.cmd)}\n{text[-4000:]}")

    yield start
    stop_all(servers, report)


@pytest.fixture
def srv(serve):
    return serve()


@pytest.fixture
def client(srv):
    return srv.client


@pytest.fixture
def session(client):
    s = client.open_session()
    yield s
    if not client.closed:
        try:
            s.close()
        except (NoSuchSession, StockadeError, TimeoutError):
            pass


def raw_session(raw, **params):
    res = raw.call_ok("session.open", params)
    return res["session_id"], res["root"]


def assert_error_map(err, cls, retryable=False):
    assert isinstance(err, dict), f"expected an error map, got {err!r}"
    assert err.get("class") == cls, f"expected {cls}, got {err!r}"
    assert err.get("retryable") is retryable, err
    assert one_line(err.get("message")), f"message must be one line of text: {err!r}"


def wait_running(client, n, timeout=30.0):
    return wait_until(lambda: client.stats().get("running") == n, timeout,
                      f"stats.running == {n}")


def wait_marker(m, n=1, timeout=15.0):
    return wait_until(lambda: len(live_with_marker(m)) >= n, timeout,
                      f"{n} process(es) with marker {m}")


# ---------------------------------------------------------------- hello


def test_hello(client):
    info = client.hello()
    r = info.raw
    assert r["protocol"] == 2
    assert isinstance(r["version"], str) and r["version"]
    pol = r["policy"]
    assert pol["name"] == "default"
    assert isinstance(pol["sha256"], str) and len(pol["sha256"]) == 64, pol
    int(pol["sha256"], 16)
    assert is_int(pol["generation"])
    iso = r["isolation"]
    assert iso["level"] in ("strict", "process"), iso
    assert isinstance(iso["layers"], list) and all(isinstance(x, str) for x in iso["layers"])
    lim = r["limits"]
    assert lim["max_sessions"] == 256 and lim["max_running"] == 64, lim
    assert lim["max_message"] == DEFAULT_MAX_MESSAGE, lim


def test_hello_raw_and_max_message_option(serve):
    s = serve(args=["--max-message", "1MiB"], raw=True)
    raw = s.raw
    res = raw.call_ok("hello", {})
    assert res["limits"]["max_message"] == MiB
    res2 = raw.call_ok("hello", {"client": "raw-test"})
    assert res2["protocol"] == 2


def test_hello_wrong_param_type(serve):
    raw = serve(raw=True).raw
    msgid = raw.request("hello", {"client": 5})
    err, result = raw.response(msgid)
    assert_error_map(err, "BAD_REQUEST")
    assert result is None


def test_msgid_full_uint32_range(serve):
    raw = serve(raw=True).raw
    for msgid in (0, 0xFFFFFFFF, 0x7FFFFFFF + 1):
        raw.request("hello", {}, msgid=msgid)
        err, res = raw.response(msgid)
        assert err is None and res["protocol"] == 2


# ---------------------------------------------------------------- sessions


def test_session_open_named(client, state_dir):
    s = client.open_session("it-named-1")
    assert s.session_id == "it-named-1"
    assert s.root == os.path.join(state_dir, "sessions", "it-named-1")
    st = os.lstat(s.root)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700, oct(st.st_mode)
    for d in ("workspace", "tmp", "cache", "home"):
        assert os.path.isdir(os.path.join(s.root, d)), d
    assert is_int(s.expires_at_ms) and is_int(s.fuse_at_ms), s.info.raw
    r = s.call("sh", ["-c", 'echo "$SESSION_ID"; echo "$AGENT_ROOT"; pwd; echo "$HOME"'])
    assert r.ok, r
    assert r.stdout.decode().splitlines() == [
        "it-named-1", s.root, s.root + "/workspace", s.root + "/home"]


def test_session_open_generated_id(client, state_dir):
    a = client.open_session()
    b = client.open_session()
    for s in (a, b):
        assert UUID4_RE.match(s.session_id), s.session_id
        assert s.root == os.path.join(state_dir, "sessions", s.session_id)
        assert os.path.isdir(s.root)
    assert a.session_id != b.session_id
    assert sorted(sessions_left(state_dir)) == sorted([a.session_id, b.session_id])


@pytest.mark.parametrize("params", [
    {"session_id": ""},
    {"session_id": "-lead"},
    {"session_id": ".hidden"},
    {"session_id": "../escape"},
    {"session_id": "a/b"},
    {"session_id": "x" * 65},
    {"session_id": "spa ce"},
    {"session_id": 5},
    {"ttl_ms": "100"},
    {"fuse_ms": "1s"},
    {"labels": "x"},
], ids=lambda p: repr(p)[:40])
def test_session_open_bad_params(client, state_dir, params):
    with pytest.raises(BadRequest) as ei:
        client.request("session.open", params)
    assert ei.value.retryable is False
    assert one_line(ei.value.message)
    assert sessions_left(state_dir) == []
    assert not os.path.lexists(os.path.join(state_dir, "escape"))
    assert client.hello().protocol == 2   # still answering


def test_session_id_64_chars_ok(client, state_dir):
    sid = "A" + "b" * 62 + "9"
    s = client.open_session(sid)
    assert s.session_id == sid and os.path.isdir(s.root)


def test_session_lease_and_fuse_values(client):
    # Clock-agnostic: compare sessions opened on the same server clock.
    base = client.open_session()                       # lease 10m, fuse 50m (policy)
    short = client.open_session(ttl_ms=60_000, fuse_ms=120_000)
    huge = client.open_session(fuse_ms=10 ** 10)       # capped by the policy's fuse
    assert short.expires_at_ms < base.expires_at_ms, (short.info.raw, base.info.raw)
    assert short.fuse_at_ms < base.fuse_at_ms, (short.info.raw, base.info.raw)
    assert huge.fuse_at_ms - base.fuse_at_ms < 10 ** 9, \
        f"fuse_ms was not capped by the policy: {huge.info.raw} vs {base.info.raw}"


def test_session_renew(client):
    s = client.open_session(ttl_ms=60_000)
    e1 = s.expires_at_ms
    e2 = s.renew()
    assert is_int(e2) and e2 >= e1
    with pytest.raises(NoSuchSession) as ei:
        client.renew_session("no-such-session")
    assert ei.value.retryable is False
    with pytest.raises(BadRequest):
        client.request("session.renew", {})


def test_session_renew_keeps_lease_alive(client):
    # The lease is 1.5 s; renewing every 0.2 s for 3 s keeps the session.
    s = client.open_session(ttl_ms=1500)
    end = time.monotonic() + 3.0
    while time.monotonic() < end:
        s.renew()
        time.sleep(0.2)
    r = s.call("echo", ["alive"])
    assert r.ok and r.stdout == b"alive\n"


def test_session_close(client, state_dir):
    s = client.open_session("it-close-1")
    r = s.call("sh", ["-c", 'mkdir -p "$HOME/.x" "$TMPDIR/t"; echo data > f; echo data > "$HOME/.x/f"'])
    assert r.ok, r
    res = s.close()
    assert res == {"removed": True, "calls_killed": 0}, res
    assert not os.path.lexists(s.root)
    assert sessions_left(state_dir) == []
    # protocol 2: closing again is idempotent; other requests on it: NO_SUCH_SESSION
    assert client.close_session("it-close-1") == {"removed": False, "calls_killed": 0}
    for fn in (lambda: client.renew_session("it-close-1"),
               lambda: client.call("it-close-1", "echo", ["x"])):
        with pytest.raises(NoSuchSession) as ei:
            fn()
        assert ei.value.retryable is False


def test_session_close_does_not_follow_symlinks(client):
    outside = tempfile.mkdtemp(prefix="stockade-it-outside-", dir="/var/tmp")
    try:
        canary = os.path.join(outside, "canary")
        with open(canary, "w") as f:
            f.write("keep me")
        s = client.open_session()
        r = s.call("sh", ["-c", f'ln -s {outside} dirlink; ln -s {canary} filelink; '
                                f'mkdir -p sub; ln -s {outside} sub/deeper; ln -s / rootlink'])
        assert r.ok, r
        assert s.close()["removed"] is True
        assert not os.path.lexists(s.root)
        assert os.path.isfile(canary), "session.close followed a symlink out of the root"
        assert os.listdir(outside) == ["canary"]
    finally:
        shutil.rmtree(outside, ignore_errors=True)


def test_session_close_kills_running_calls(client, state_dir, marker):
    m = marker()
    s = client.open_session()
    h1 = s.start_call("sleep", [f"300.{m}"])
    h2 = s.start_call("sh", ["-c", f"sleep 301.{m}; echo never"])
    wait_marker(m, 2)
    res = s.close()
    assert res.get("removed") is True and res.get("calls_killed") == 2, res
    for h in (h1, h2):
        r = h.result(RPC_TIMEOUT)
        assert r.class_ == "CANCELLED", r
        assert r.retryable is False
        assert "clos" in r.message.lower(), f"message should say the session was closed: {r.message!r}"
        assert b"never" not in r.stdout
    assert_marker_gone(m)
    assert not os.path.lexists(s.root)
    assert sessions_left(state_dir) == []


# ---------------------------------------------------------------- calls: results


def test_call_ok_all_fields_raw(serve):
    raw = serve(raw=True).raw
    sid, root = raw_session(raw)
    msgid = raw.request("call", {"session_id": sid, "tool": "echo", "argv": ["hi"]})
    err, r = raw.response(msgid)
    assert err is None, err
    for field in CALL_RESULT_FIELDS:
        assert field in r, f"result lacks {field!r}: {r}"
    assert r["class"] == "OK"
    assert r["retryable"] is False
    assert isinstance(r["message"], str)
    assert r["exit_code"] == 0 and r["signal"] is None
    assert type(r["stdout"]) is bytes and r["stdout"] == b"hi\n", "stdout must be msgpack bin"
    assert type(r["stderr"]) is bytes and r["stderr"] == b""
    assert r["truncated"] == {"stdout": 0, "stderr": 0}
    assert r["redactions"] == 0
    for f in ("duration_ms", "cpu_ms", "max_rss_kb"):
        assert is_int(r[f]) and r[f] >= 0, (f, r[f])


def test_call_result_typed(session):
    r = session.call("echo", ["hi"])
    assert isinstance(r, CallResult)
    assert r.ok and r.class_ == "OK" and r.stdout == b"hi\n" and r.exit_code == 0
    assert r.raise_for_class() is r


def test_call_stdin_and_binary_output(session):
    data = bytes(range(256)) * 64 + b"\x00end"
    r = session.call("cat", stdin=data)
    assert r.ok, r
    assert r.stdout == data
    r = session.call("sh", ["-c", r"printf '\377\376\000ok'"])
    assert r.ok and r.stdout == b"\xff\xfe\x00ok"


def test_output_complete_when_the_tree_ends(session):
    """The answer takes what the output pipes hold to their end as soon as the runner
    reports the tree reaped, without waiting for their EOF: every byte written before
    the end must be there, on both streams, below, at and above a pipe's capacity."""
    for n in (0, 1, 4095, 65536, 65537, 300_000):
        r = session.call("sh", ["-c", f"head -c {n} /dev/zero | tr '\\0' a; "
                                      f"head -c {n} /dev/zero | tr '\\0' b >&2"])
        assert r.ok, (n, r.class_, r.message)
        assert (len(r.stdout), len(r.stderr)) == (n, n), n
        assert r.stdout == b"a" * n and r.stderr == b"b" * n, n
    # the last act of the tool: a pipe's worth on each stream, then its exit, so that
    # what it wrote is often still in the pipes when the report arrives
    for _ in range(20):
        r = session.call("head", ["-c", "65536", "/dev/zero"])
        assert r.ok, (r.class_, r.message)
        assert r.stdout == bytes(65536), len(r.stdout)
        r = session.call("sh", ["-c", "exec head -c 65536 /dev/zero >&2"])
        assert r.ok, (r.class_, r.message)
        assert r.stderr == bytes(65536), len(r.stderr)


def test_call_tool_error(session):
    r = session.call("false")
    assert r.class_ == "TOOL_ERROR" and r.exit_code == 1 and r.signal is None
    assert r.retryable is False
    r = session.call("sh", ["-c", "echo out; echo oops >&2; exit 3"])
    assert r.class_ == "TOOL_ERROR" and r.exit_code == 3
    assert r.stdout == b"out\n" and r.stderr == b"oops\n"
    assert "oops" not in r.message, "message must never be raw stderr"
    with pytest.raises(ToolError) as ei:
        r.raise_for_class()
    assert ei.value.result is r and ei.value.retryable is False


def test_call_signal_death(session):
    r = session.call("sh", ["-c", "kill -SEGV $$"])
    assert r.signal == signal.SIGSEGV and r.exit_code is None
    assert r.class_ != "OK"


def test_call_unknown_tool_is_policy_violation(serve, marker):
    raw = serve(raw=True).raw
    sid, _ = raw_session(raw)
    m = marker()
    msgid = raw.request("call", {"session_id": sid, "tool": "curl",
                                 "argv": [f"https://example.com/{m}"]})
    err, r = raw.response(msgid)
    assert err is None, f"a refused call answers in the result map, not the error slot: {err}"
    assert r["class"] == "POLICY_VIOLATION"
    assert r["retryable"] is False
    assert r.get("exit_code") is None and r.get("signal") is None
    assert one_line(r["message"])
    assert live_with_marker(m) == []
    cr = CallResult.from_map(r)
    with pytest.raises(PolicyViolation) as ei:
        cr.raise_for_class()
    assert ei.value.retryable is False


def test_call_depth(session):
    for d in (0, -1):
        r = session.call("echo", ["x"], depth=d)
        assert r.class_ == "POLICY_VIOLATION", (d, r)
        assert r.retryable is False and r.exit_code is None
    r = session.call("sh", ["-c", 'echo "$STOCKADE_DEPTH"'], depth=3)
    assert r.ok and r.stdout == b"2\n", r
    r = session.call("sh", ["-c", 'echo "$STOCKADE_DEPTH"'], depth=1)
    assert r.ok and r.stdout == b"0\n", r
    r = session.call("sh", ["-c", 'echo "$STOCKADE_DEPTH"'])    # policy's limits.depth = 4
    assert r.ok and r.stdout == b"3\n", r


def test_call_env_built_from_nothing(session):
    r = session.call("sh", ["-c", "env"])
    assert r.ok, r
    names = {line.split("=", 1)[0] for line in r.stdout.decode().splitlines() if "=" in line}
    allowed = {"SESSION_ID", "AGENT_ROOT", "HOME", "TMPDIR", "XDG_CACHE_HOME", "PATH", "LANG",
               "STOCKADE_DEPTH", "PWD", "OLDPWD", "SHLVL", "_"}
    assert names - allowed == set(), f"unexpected env names: {names - allowed}"


def test_output_flood_is_capped(session):
    total = 5_000_000
    r = session.call("sh", ["-c", f"yes | head -c {total}"])
    assert r.ok, r
    assert len(r.stdout) == DEFAULT_OUTPUT_CAP
    assert r.truncated == {"stdout": total - DEFAULT_OUTPUT_CAP, "stderr": 0}


def test_daemonizer_leaves_nothing(session, marker):
    m = marker()
    r = session.call("sh", ["-c", f"setsid sleep 300.{m} & echo $!"], timeout_ms=10_000)
    assert r.class_ == "OK", r
    assert_marker_gone(m)


# ---------------------------------------------------------------- timeouts, deadline, cancel


def test_timeout_idempotent_tool_is_retryable(session, marker):
    m = marker()
    r = session.call("sleep", [f"30.{m}"], timeout_ms=300)
    assert r.class_ == "TOOL_TIMEOUT", r
    assert r.layer == "timeout"
    assert r.retryable is True, "sleep is idempotent in policies/default.lua"
    with pytest.raises(ToolTimeout) as ei:
        r.raise_for_class()
    assert ei.value.retryable is True and ei.value.layer == "timeout"
    assert_marker_gone(m)


def test_timeout_non_idempotent_tool_is_not_retryable(session, marker):
    m = marker()
    r = session.call("sh", ["-c", f"sleep 30.{m}"], timeout_ms=300)
    assert r.class_ == "TOOL_TIMEOUT" and r.layer == "timeout", r
    assert r.retryable is False
    # the request's idempotent hint does not override the policy (sh: idempotent = false)
    r = session.call("sh", ["-c", f"sleep 31.{m}"], timeout_ms=300, idempotent=True)
    assert r.class_ == "TOOL_TIMEOUT" and r.retryable is False, r
    assert_marker_gone(m)


def test_timeout_ms_cannot_raise_the_policy(serve, marker):
    c = serve(SMALL_POLICY).client
    s = c.open_session()
    m = marker()
    # `slow` is /bin/sleep with a 1 s timeout; asking for 60 s must not let `sleep 8` finish.
    r = s.call("slow", [f"8.{m}"], timeout_ms=60_000, rpc_timeout=40)
    assert r.class_ == "TOOL_TIMEOUT" and r.layer == "timeout", r
    assert r.duration_ms < 8000, r
    assert_marker_gone(m)


def test_deadline_exceeded(session, marker):
    m = marker()
    r = session.call("sleep", [f"5.{m}"], deadline_ms=300)
    assert r.class_ == "DEADLINE_EXCEEDED", r
    assert r.layer == "deadline"
    assert r.retryable is False
    assert r.duration_ms < 5000, r      # the sleep was stopped, not waited for
    # the smallest layer wins: a deadline below the call's timeout
    r = session.call("sleep", [f"6.{m}"], deadline_ms=300, timeout_ms=3000)
    assert r.class_ == "DEADLINE_EXCEEDED" and r.layer == "deadline", r
    assert_marker_gone(m)


def test_cpu_limit_is_a_timeout_layer(serve):
    s = serve(LIMITS_POLICY).client.open_session()
    r = s.call("sh", ["-c", "while :; do :; done"], rpc_timeout=40)
    assert r.class_ == "TOOL_TIMEOUT", r
    assert r.layer == "cpu", r


def test_file_size_limit_is_resource_limit(serve):
    s = serve(LIMITS_POLICY).client.open_session()
    r = s.call("sh", ["-c", "exec head -c 2000000 /dev/zero > big"])
    assert r.class_ == "RESOURCE_LIMIT", r
    assert r.retryable is False


def test_cancel(client, session, marker):
    m = marker()
    h = session.start_call("sleep", [f"300.{m}"])
    wait_marker(m)
    assert h.cancel(RPC_TIMEOUT) is True
    r = h.result(RPC_TIMEOUT)
    assert r.class_ == "CANCELLED", r
    assert r.retryable is False
    with pytest.raises(Cancelled):
        r.raise_for_class()
    assert_marker_gone(m)
    assert client.cancel(h.msgid) is False          # no longer running
    assert client.cancel(0xFFFFFFFE) is False       # never used
    for params in ({"msgid": "x"}, {}, {"msgid": -1.5}):
        with pytest.raises(BadRequest):
            client.request("cancel", params)
    assert session.call("echo", ["after"]).ok


def test_cancel_raw_order(serve, marker):
    """The cancelled call gets its own response, distinct from cancel's."""
    raw = serve(raw=True).raw
    sid, _ = raw_session(raw)
    m = marker()
    call_id = raw.request("call", {"session_id": sid, "tool": "sleep", "argv": [f"300.{m}"]})
    wait_marker(m)
    cancel_id = raw.request("cancel", {"msgid": call_id})
    err, res = raw.response(cancel_id)
    assert err is None and res == {"cancelled": True}, (err, res)
    err, r = raw.response(call_id)
    assert err is None and r["class"] == "CANCELLED", (err, r)
    assert_marker_gone(m)


def test_cancel_is_scoped_to_the_connection(serve, marker):
    """msgids are chosen per connection: another connection's cancel with the same number
    must not touch this connection's call."""
    s = serve(listen=True)
    c1, c2 = s.connect(), s.connect()
    sess = c1.open_session()
    m = marker()
    h = sess.start_call("sh", ["-c", f"sleep 300.{m} & wait"])
    wait_marker(m)
    assert c2.cancel(h.msgid) is False
    assert not h.done() and live_with_marker(m), "a cancel from another connection killed the call"
    assert c1.cancel(h.msgid) is True
    assert h.result(RPC_TIMEOUT).class_ == "CANCELLED"
    assert_marker_gone(m)
    c1.close()
    c2.close()


def _refused(client, session_id, tool, argv, **kw):
    """A request the policy's limits refuse: BAD_REQUEST in the error slot or a result
    that is not OK; either way the tool must not have run (it would print 'RAN')."""
    try:
        r = client.call(session_id, tool, argv, **kw)
    except BadRequest:
        return "BAD_REQUEST"
    assert r.class_ != "OK" and b"RAN" not in r.stdout, r
    assert r.exit_code is None, f"the tool ran: {r}"
    return r.class_


def test_limits_refuse_without_running(client, session):
    sid = session.session_id
    # deadline below the policy's deadline_min (100 ms)
    cls = _refused(client, sid, "sh", ["-c", "echo RAN"], deadline_ms=50)
    assert cls in ("DEADLINE_EXCEEDED", "POLICY_VIOLATION", "BAD_REQUEST"), cls
    # more arguments than limits.argv (64)
    cls = _refused(client, sid, "echo", ["RAN"] + ["a"] * 80)
    assert cls in ("POLICY_VIOLATION", "BAD_REQUEST"), cls
    # stdin above limits.stdin (1 MiB)
    cls = _refused(client, sid, "sh", ["-c", "echo RAN; cat >/dev/null"], stdin=b"x" * (2 * MiB))
    assert cls in ("POLICY_VIOLATION", "BAD_REQUEST"), cls
    assert session.call("echo", ["fine"]).ok


# ---------------------------------------------------------------- streaming


def test_stream_output_while_running(session):
    script = ('echo first; while [ ! -e go ]; do sleep 0.05; done; '
              'echo second; echo err >&2')
    h = session.start_call("sh", ["-c", script], stream=True)
    got = {"stdout": b"", "stderr": b""}
    it = h.output(timeout=10)
    try:
        for chunk in it:
            assert isinstance(chunk, OutputChunk) and isinstance(chunk.data, bytes)
            got[chunk.stream] += chunk.data
            if b"first\n" in got["stdout"]:
                break
    except TimeoutError:
        pytest.fail(f"the tool wrote 'first\\n' and is waiting, but no call.output carried it "
                    f"within 10 s (streamed so far: {got!r})")
    assert got["stdout"] == b"first\n"
    assert not h.done(), "output was not streamed while the call ran"
    open(os.path.join(session.root, "workspace", "go"), "w").close()
    for chunk in it:
        got[chunk.stream] += chunk.data
    r = h.result(RPC_TIMEOUT)
    assert r.ok, r
    assert got["stdout"] == r.stdout == b"first\nsecond\n"
    assert got["stderr"] == r.stderr == b"err\n"


def test_stream_notifications_raw(serve):
    raw = serve(raw=True).raw
    sid, _ = raw_session(raw)
    plain = raw.request("call", {"session_id": sid, "tool": "echo", "argv": ["plain"]})
    raw.response(plain)
    assert [m for m in raw.seen if m[0] == 2] == [], "call.output for a call without stream"
    streamed = raw.request("call", {"session_id": sid, "tool": "sh", "stream": True,
                                    "argv": ["-c", r"printf 'a\377'; printf 'e' >&2; printf b"]})
    err, r = raw.response(streamed)
    assert err is None and r["class"] == "OK", (err, r)
    notes = [m for m in raw.seen if m[0] == 2]
    assert notes, "no call.output notification"
    out = {"stdout": b"", "stderr": b""}
    for n in notes:
        assert len(n) == 3 and n[1] == "call.output", n
        p = note_args(n)
        assert p["msgid"] == streamed
        assert p["stream"] in ("stdout", "stderr")
        assert type(p["data"]) is bytes, f"data must be msgpack bin: {p!r}"
        out[p["stream"]] += p["data"]
    assert out == {"stdout": b"a\xffb", "stderr": b"e"}
    # every notification came before the response
    idx = raw.seen.index(next(m for m in raw.seen if m[0] == 1 and m[1] == streamed))
    assert all(raw.seen.index(n) < idx for n in notes)


# ---------------------------------------------------------------- redaction, output checks


SECRET = "ITKEY-abcdefghijkl"


def test_redaction_in_result_and_stream(serve):
    c = serve(REDACT_POLICY).client
    s = c.open_session()
    r = s.call("sh", ["-c", f"echo before {SECRET} after; echo {SECRET} >&2"])
    assert r.ok, r
    assert SECRET.encode() not in r.stdout and SECRET.encode() not in r.stderr, r
    assert b"before " in r.stdout and b" after" in r.stdout
    assert r.redactions >= 2, r
    # streamed, with the secret cut across two writes of the tool
    script = "printf 'x ITKEY-abcd'; sleep 0.3; printf 'efghijkl y\\n'"
    h = s.start_call("sh", ["-c", script], stream=True)
    chunks = list(h.output(timeout=RPC_TIMEOUT))
    r = h.result(RPC_TIMEOUT)
    assert r.ok, r
    streamed = b"".join(ch.data for ch in chunks if ch.stream == "stdout")
    assert SECRET.encode() not in streamed, f"call.output leaked the secret: {chunks!r}"
    assert all(b"ITKEY-abcd" not in ch.data for ch in chunks), chunks
    assert SECRET.encode() not in r.stdout and r.redactions >= 1, r
    assert streamed == r.stdout, (streamed, r.stdout)


def test_supervisor_env_secret_never_returned(serve):
    """A value of a variable the policy's env.deny names (here *_TOKEN) in the server's
    own environment never reaches the tool's env, nor comes back in its output."""
    secret = "tok-" + "".join(random.choice("abcdef0123456789") for _ in range(24))
    c = serve(env={"IT_SERVE_TOKEN": secret}).client
    s = c.open_session()
    r = s.call("sh", ["-c", "env"])
    assert r.ok and secret.encode() not in r.stdout and b"IT_SERVE_TOKEN" not in r.stdout
    r = s.call("echo", [f"leak {secret} end"])
    assert r.ok, r
    assert secret.encode() not in r.stdout, f"the supervisor's secret came back: {r.stdout!r}"
    assert r.redactions >= 1, r
    h = s.start_call("sh", ["-c", f"printf '%s' '{secret[:10]}'; sleep 0.3; echo '{secret[10:]}'"],
                     stream=True)
    chunks = list(h.output(timeout=RPC_TIMEOUT))
    r = h.result(RPC_TIMEOUT)
    assert secret.encode() not in b"".join(ch.data for ch in chunks), chunks
    assert secret.encode() not in r.stdout, r


def test_output_rejected(serve):
    s = serve(REDACT_POLICY).client.open_session()
    r = s.call("json", ["-c", 'echo \'{"ok": true}\''])
    assert r.ok, r
    r = s.call("json", ["-c", "echo not json"])
    assert r.class_ == "OUTPUT_REJECTED", r
    assert r.retryable is False
    r = s.call("json", ["-c", 'echo \'{"other": 1}\''])
    assert r.class_ == "OUTPUT_REJECTED", r


# ---------------------------------------------------------------- expiry


def test_session_expired_by_lease(client, state_dir):
    s = client.open_session(ttl_ms=300)
    note = client.wait_notification("session.expired",
                                     lambda p: p.get("session_id") == s.session_id, timeout=20)
    assert note["layer"] == "ttl", note
    wait_until(lambda: not os.path.lexists(s.root), 10, "the expired session's root removed")
    with pytest.raises(SessionExpired) as ei:   # protocol 2: not NO_SUCH_SESSION
        s.call("echo", ["x"])
    assert ei.value.layer == "ttl"


def test_session_expired_by_fuse_raw(serve, state_dir, marker):
    raw = serve(raw=True).raw
    sid, root = raw_session(raw, fuse_ms=1000)
    m = marker()
    call_id = raw.request("call", {"session_id": sid, "tool": "sleep", "argv": [f"300.{m}"]})
    deadline = time.monotonic() + 30
    resp_i = note_i = None
    while resp_i is None or note_i is None:
        try:
            msg = raw.recv(max(deadline - time.monotonic(), 0.001))
        except (TimeoutError, Closed) as e:
            pytest.fail(f"{type(e).__name__} waiting for the fuse; seen {summarize(raw.seen)}")
        if msg[0] == 1 and msg[1] == call_id:
            resp_i = len(raw.seen) - 1
            err, r = msg[2], msg[3]
            assert err is None, err
            assert r["class"] == "SESSION_EXPIRED" and r["layer"] == "fuse", r
            assert r["retryable"] is False
        elif msg[0] == 2 and msg[1] == "session.expired":
            note_i = len(raw.seen) - 1
            assert msg[2] == [{"session_id": sid, "layer": "fuse"}], msg
    assert resp_i < note_i, "session.expired must follow the answers of the session's calls"
    assert_marker_gone(m)
    wait_until(lambda: not os.path.lexists(root), 10, "the expired session's root removed")
    msgid = raw.request("call", {"session_id": sid, "tool": "echo", "argv": ["x"]})
    err, _ = raw.response(msgid)
    assert_error_map(err, "SESSION_EXPIRED")
    assert err["layer"] == "fuse"


# ---------------------------------------------------------------- admission: OVERLOADED


def test_overloaded_sessions(serve):
    s = serve(SMALL_POLICY, raw=True)
    raw = s.raw
    hello = raw.call_ok("hello", {})
    assert hello["limits"]["max_sessions"] == 2 and hello["limits"]["max_running"] == 2
    a, _ = raw_session(raw)
    raw_session(raw)
    msgid = raw.request("session.open", {})
    err, res = raw.response(msgid)
    assert_error_map(err, "OVERLOADED", retryable=True)
    assert res is None
    raw.call_ok("session.close", {"session_id": a})
    raw_session(raw)


def test_overloaded_running(serve, marker):
    c = serve(SMALL_POLICY).client
    s = c.open_session()
    m = marker()
    h1 = s.start_call("sleep", [f"300.{m}"])
    h2 = s.start_call("sleep", [f"301.{m}"])
    wait_running(c, 2)
    with pytest.raises(Overloaded) as ei:
        s.call("echo", ["third"])
    assert ei.value.retryable is True
    assert c.stats()["running"] == 2
    assert c.cancel(h1.msgid)
    assert h1.result(RPC_TIMEOUT).class_ == "CANCELLED"
    r = s.call("echo", ["now"])
    assert r.ok and r.stdout == b"now\n"
    c.cancel(h2.msgid)
    h2.result(RPC_TIMEOUT)
    assert_marker_gone(m)


# ---------------------------------------------------------------- BAD_REQUEST


BAD_CALL_PARAMS = [
    ("missing tool", {}),
    ("tool int", {"tool": 5}),
    ("argv str", {"tool": "echo", "argv": "hi there"}),
    ("argv ints", {"tool": "echo", "argv": [1, 2]}),
    ("args str", {"tool": "echo", "args": "x"}),
    ("stdin int", {"tool": "cat", "stdin": 5}),
    ("timeout_ms str", {"tool": "echo", "timeout_ms": "300"}),
    ("deadline_ms str", {"tool": "echo", "deadline_ms": "x"}),
    ("depth str", {"tool": "echo", "depth": "3"}),
    ("idempotent str", {"tool": "echo", "idempotent": "yes"}),
    ("stream str", {"tool": "echo", "stream": "yes"}),
]


@pytest.mark.parametrize("name,params", BAD_CALL_PARAMS, ids=[n for n, _ in BAD_CALL_PARAMS])
def test_call_bad_params(serve, name, params):
    raw = serve(raw=True).raw
    sid, _ = raw_session(raw)
    msgid = raw.request("call", dict(params, session_id=sid))
    err, res = raw.response(msgid)
    assert_error_map(err, "BAD_REQUEST")
    assert res is None
    assert raw.call_ok("hello", {})["protocol"] == 2


def test_call_bad_session_params(serve):
    raw = serve(raw=True).raw
    for params in ({"tool": "echo"}, {"session_id": 7, "tool": "echo"}):
        msgid = raw.request("call", params)
        err, res = raw.response(msgid)
        assert_error_map(err, "BAD_REQUEST")
    msgid = raw.request("call", {"session_id": "never-opened", "tool": "echo"})
    err, res = raw.response(msgid)
    assert_error_map(err, "NO_SUCH_SESSION")
    assert res is None


@pytest.mark.parametrize("msg", [
    [0, 9, "hello", [1, 2]],
    [0, 9, "call", "str"],
    [0, 9, "stats", 5],
    [0, 9, "nope.method", {}],
    [0, 9, 5, {}],
    [0, 9, "hello"],
], ids=["params-list", "params-str", "params-int", "unknown-method", "method-int", "arity-3"])
def test_malformed_request_answered(serve, msg):
    raw = serve(raw=True).raw
    raw.send(msg)
    err, res = raw.response(9)
    assert_error_map(err, "BAD_REQUEST")
    assert res is None
    assert raw.call_ok("hello", {})["protocol"] == 2


def test_unknown_method_via_client(client):
    with pytest.raises(BadRequest) as ei:
        client.request("no.such.method", {})
    assert ei.value.retryable is False
    assert client.hello().protocol == 2


# ---------------------------------------------------------------- malformed streams (listen mode)


def test_garbage_closes_only_that_connection(serve):
    s = serve(listen=True)
    good = s.connect()
    sess = good.open_session()
    h = sess.start_call("sh", ["-c", "while [ ! -e go ]; do sleep 0.05; done; echo survived"])
    wait_running(good, 1)
    bad = s.raw_connect()
    bad.send_bytes(b"\xc1" * 64 + b"not msgpack at all \xc1\xc1")
    msgs = bad.drain_until_closed(15)
    for m in msgs:   # whatever it answered must be a BAD_REQUEST
        assert m[0] == 1 and m[2]["class"] == "BAD_REQUEST", m
    assert s.alive(), "the server died of garbage"
    open(os.path.join(sess.root, "workspace", "go"), "w").close()
    r = h.result(RPC_TIMEOUT)
    assert r.ok and r.stdout == b"survived\n", r
    third = s.connect()
    assert third.hello().protocol == 2
    third.close()
    good.close()


def test_truncated_message_then_hangup(serve):
    s = serve(listen=True)
    bad = s.raw_connect()
    data = msgpack.packb([0, 1, "hello", {"client": "truncated" * 10}], use_bin_type=True)
    bad.send_bytes(data[: len(data) // 2])
    bad.shutdown_write()
    msgs = bad.drain_until_closed(15)
    assert all(m[0] == 1 for m in msgs), msgs
    bad.close()
    assert s.alive()
    c = s.connect()
    assert c.hello().protocol == 2
    c.close()


def test_message_split_across_writes(serve):
    s = serve(listen=True)
    raw = s.raw_connect()
    data = msgpack.packb([0, 42, "hello", {"client": "byte-by-byte"}], use_bin_type=True)
    for i in range(len(data)):
        raw.send_bytes(data[i:i + 1])
        time.sleep(0.002)
    err, res = raw.response(42)
    assert err is None and res["protocol"] == 2
    # two requests in one write
    raw.send_bytes(msgpack.packb([0, 43, "hello", {}]) + msgpack.packb([0, 44, "stats", {}]))
    assert raw.response(44)[0] is None
    assert raw.response(43)[0] is None


@pytest.mark.parametrize("msg", [
    42,
    "hello",
    {"method": "hello"},
    [0, -1, "hello", {}],
    [0, "x", "hello", {}],
    [7, 1, "hello", {}],
    [1, 1, None, {}],
    [],
], ids=["int", "str", "map", "msgid-negative", "msgid-str", "type-7", "client-response", "empty"])
def test_not_a_request_is_survived(serve, msg):
    """Valid msgpack that is not a request: the server answers BAD_REQUEST (with the
    msgid where it has one) or closes the connection; it never crashes."""
    s = serve(listen=True)
    bad = s.raw_connect()
    bad.send(msg)
    bad.request("hello", {}, msgid=5)
    got = []
    try:
        while True:
            m = bad.recv(15)
            got.append(m)
            if m[0] == 1 and m[1] == 5:
                break
    except Closed:
        pass
    except TimeoutError:
        pytest.fail(f"neither an answer nor a close after {msg!r}; got {got!r}")
    for m in got:
        assert isinstance(m, list) and m[0] == 1, m
        if m[1] != 5:
            assert_error_map(m[2], "BAD_REQUEST")
    assert s.alive()
    c = s.connect()
    assert c.hello().protocol == 2
    c.close()


def test_oversized_message(serve):
    s = serve(listen=True, args=["--max-message", "1MiB"])
    c = s.connect()
    sess = c.open_session()
    raw = s.raw_connect()
    big = b"x" * (2 * MiB)
    data = msgpack.packb([0, 77, "call", {"session_id": sess.session_id, "tool": "cat",
                                          "stdin": big}], use_bin_type=True)
    try:
        raw.send_bytes(data)
    except (BrokenPipeError, ConnectionResetError, socket.timeout):
        pass   # the server may stop reading once it has seen enough
    msgs = raw.drain_until_closed(20)
    resp = [m for m in msgs if m[0] == 1]
    assert resp, f"no answer to an oversized message; got {summarize(msgs)}"
    m = resp[0]
    assert m[1] == 77, f"the msgid of an oversized request is recoverable: {m!r}"
    assert_error_map(m[2], "BAD_REQUEST")
    assert m[3] is None
    msg = m[2]["message"]
    assert any(t in msg for t in ("1048576", "1MiB", "1 MiB", str(len(data)), "2097")), \
        f"the message should name the size: {msg!r}"
    assert s.alive()
    assert c.hello().protocol == 2, "another connection must be unaffected"
    assert sess.call("echo", ["ok"]).ok
    c.close()


# ---------------------------------------------------------------- concurrency


def test_many_calls_in_flight_threads(serve, marker):
    """100 threads, each a synchronous call on one shared connection, all held running
    at once by a barrier file, then released: each answer must carry its own output."""
    c = serve(WIDE_POLICY).client
    sessions = [c.open_session() for _ in range(4)]
    n_calls = 100
    results = [None] * n_calls
    errors = []

    def worker(i):
        s = sessions[i % len(sessions)]
        try:
            results[i] = s.call("sh", ["-c", f"while [ ! -e go ]; do sleep 0.05; done; echo {i}"],
                                rpc_timeout=90)
        except BaseException as e:   # recorded, asserted below
            errors.append((i, e))

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(n_calls)]
    for t in threads:
        t.start()
    try:
        wait_running(c, n_calls, timeout=60)
    finally:
        for s in sessions:
            open(os.path.join(s.root, "workspace", "go"), "w").close()
    for t in threads:
        t.join(120)
    assert not [t for t in threads if t.is_alive()], "calls still waiting"
    assert not errors, errors[:5]
    msgids = set()
    for i, r in enumerate(results):
        assert r.ok, (i, r)
        assert r.stdout == f"{i}\n".encode(), f"call {i} got {r.stdout!r}"
        msgids.add(r.msgid)
    assert len(msgids) == n_calls


def test_many_calls_in_flight_raw(serve):
    """64 requests in one write, random run times; responses matched by msgid only."""
    raw = serve(WIDE_POLICY, raw=True).raw
    sid, _ = raw_session(raw)
    n = 64
    ids = random.sample(range(1000, 10 ** 6), n)
    expect = {}
    buf = b""
    for k, msgid in enumerate(ids):
        word = f"n{k}-{msgid}"
        expect[msgid] = (word + "\n").encode()
        delay = f"0.{random.randrange(1000):03d}"
        buf += msgpack.packb([0, msgid, "call", {"session_id": sid, "tool": "sh",
                                                 "argv": ["-c", f"sleep {delay}; echo {word}"]}],
                             use_bin_type=True)
    raw.send_bytes(buf)
    got = {}
    deadline = time.monotonic() + 90
    while len(got) < n:
        try:
            m = raw.recv(max(deadline - time.monotonic(), 0.001))
        except (TimeoutError, Closed) as e:
            pytest.fail(f"{type(e).__name__} with {len(got)}/{n} answers")
        if m[0] == 1:
            assert m[1] in expect and m[1] not in got, f"unexpected/duplicate msgid {m[1]}"
            got[m[1]] = m
    for msgid, m in got.items():
        assert m[2] is None, m
        assert m[3]["class"] == "OK", m[3]
        assert m[3]["stdout"] == expect[msgid], (msgid, m[3]["stdout"], expect[msgid])


def test_async_client(serve_available, state_dir, tmp_path):
    cmd = [serve_available, "serve", "--policy", WIDE_POLICY, "--state-dir", state_dir]
    env = clean_env()

    async def main():
        log = open(tmp_path / "aio.log", "wb")
        c = await AsyncClient.spawn(cmd, rpc_timeout=60, stderr=log, start_new_session=True,
                                    env=env)
        try:
            info = await c.hello()
            assert info.protocol == 2 and info.policy["name"] == "serve-wide"
            async with await c.open_session() as s:
                r = await s.call("echo", ["hi"])
                assert r.ok and r.stdout == b"hi\n"
                rs = await asyncio.gather(*[s.call("sh", ["-c", f"echo {i}"]) for i in range(20)])
                assert [r.stdout for r in rs] == [f"{i}\n".encode() for i in range(20)]
                items = [it async for it in s.stream_call("sh", ["-c", "echo a; echo b >&2"])]
                assert isinstance(items[-1], CallResult) and items[-1].ok
                chunks = items[:-1]
                assert all(isinstance(ch, OutputChunk) for ch in chunks)
                assert b"".join(ch.data for ch in chunks if ch.stream == "stdout") == b"a\n"
                assert b"".join(ch.data for ch in chunks if ch.stream == "stderr") == b"b\n"
                st = await c.stats()
                assert st["sessions"] == 1
                root = s.root
            assert not os.path.lexists(root)
            with pytest.raises(NoSuchSession):
                await c.call(s.session_id, "echo", ["x"])
        finally:
            rc = await c.close(timeout=STOP_TIMEOUT)
            log.close()
        return rc

    rc = asyncio.run(asyncio.wait_for(main(), 120))
    assert rc == 0


def test_async_client_unix_socket(serve):
    s = serve(listen=True)

    async def main():
        c1 = await AsyncClient.connect_unix(s.sock_path, rpc_timeout=60)
        c2 = await AsyncClient.connect_unix(s.sock_path, rpc_timeout=60)
        try:
            sess = await c1.open_session(ttl_ms=300)
            note = await c1.wait_notification(
                "session.expired", lambda p: p.get("session_id") == sess.session_id, timeout=20)
            assert note["layer"] == "ttl"
            shared = await c1.open_session("aio-shared")
            r = await c2.session("aio-shared").call("sh", ["-c", 'echo "$SESSION_ID"'])
            assert r.ok and r.stdout == b"aio-shared\n"
            h = await shared.start_call("sleep", ["300"])
            assert await c1.cancel(h.msgid) is True
            assert (await h.result(30)).class_ == "CANCELLED"
            assert (await shared.close())["removed"] is True
        finally:
            await c1.close()
            await c2.close()

    asyncio.run(asyncio.wait_for(main(), 90))


# ---------------------------------------------------------------- back-pressure


def test_back_pressure_stalled_reader(serve):
    s = serve(listen=True)
    c = s.connect()
    sess = c.open_session()
    total = 200_000_000
    raw = s.raw_connect(rcvbuf=4096)
    msgid = raw.request("call", {"session_id": sess.session_id, "tool": "sh", "stream": True,
                                 "argv": ["-c", f"yes | head -c {total}"]})
    base = vmrss_kb(s.pid)
    peak = base
    end = time.monotonic() + 5.0                 # the client does not read for 5 s
    while time.monotonic() < end:
        peak = max(peak, vmrss_kb(s.pid))
        time.sleep(0.05)
    # the server keeps serving others meanwhile
    assert c.hello(rpc_timeout=15).protocol == 2
    r2 = sess.call("echo", ["meanwhile"], rpc_timeout=15)
    assert r2.ok and r2.stdout == b"meanwhile\n"
    peak = max(peak, vmrss_kb(s.pid))
    assert peak < 200 * 1024, f"server RSS reached {peak} KiB (baseline {base} KiB) while a client stalled"
    # now read everything
    streamed = 0
    first = b""
    deadline = time.monotonic() + 180
    while True:
        try:
            m = raw.recv(max(deadline - time.monotonic(), 0.001))
        except (TimeoutError, Closed) as e:
            pytest.fail(f"{type(e).__name__} after {streamed} streamed bytes")
        raw.seen.clear()          # keep memory flat on our side too
        if m[0] == 2 and m[1] == "call.output" and m[2][0]["msgid"] == msgid:
            data = m[2][0]["data"]
            if len(first) < DEFAULT_OUTPUT_CAP:
                first += data[: DEFAULT_OUTPUT_CAP - len(first)]
            streamed += len(data)
            peak = max(peak, vmrss_kb(s.pid)) if streamed % (64 * MiB) < 65536 else peak
        elif m[0] == 1 and m[1] == msgid:
            err, r = m[2], m[3]
            break
    assert err is None, err
    assert r["class"] == "OK", {k: v for k, v in r.items() if k not in ("stdout", "stderr")}
    assert len(r["stdout"]) == DEFAULT_OUTPUT_CAP
    assert r["truncated"]["stdout"] == total - DEFAULT_OUTPUT_CAP
    assert streamed >= DEFAULT_OUTPUT_CAP and first == r["stdout"]
    assert peak < 200 * 1024, f"server RSS reached {peak} KiB"
    print(f"back-pressure: baseline {base} KiB, peak {peak} KiB, streamed {streamed} bytes")
    c.close()


# ---------------------------------------------------------------- leaks


def _settled(client, pid, base, timeout=15.0):
    def ok():
        st = client.stats()
        live, zombies = children(pid)
        return (st["fds"] - st["standby_fds"] == base["fds"]
                and st["processes"] - st["standby"] == base["processes"]
                and st["zombies"] == 0 and st["running"] == 0 and not zombies
                and fd_count(pid) - st["standby_fds"] == base["host_fds"]
                and len(live) == base["host_children"]) and st
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        st = ok()
        if st:
            return st
        time.sleep(0.1)
    st = client.stats()
    live, zombies = children(pid)
    pytest.fail(f"not back to baseline: stats fds={st['fds']} processes={st['processes']} "
                f"zombies={st['zombies']} running={st['running']}; host fds={fd_count(pid)} "
                f"children={len(live)} zombies={zombies}; baseline {base}")


def _baseline(client, pid):
    """What the server holds between calls, less what it keeps ready on purpose (the
    spawner's spares: stats.standby, stats.standby_fds), which may still be on its way.
    Taken once the last call's shim has exited too: a call is answered when the shim's
    report arrives, and the shim may still be on its way out."""
    wait_until(lambda: (lambda st: st["running"] == 0 and st["processes"] == st["standby"])(
        client.stats()), 10, "no process but the ones kept ready")
    st = client.stats()
    live, _ = children(pid)
    return {"fds": st["fds"] - st["standby_fds"], "processes": st["processes"] - st["standby"],
            "host_fds": fd_count(pid) - st["standby_fds"], "host_children": len(live)}


def test_no_leaks_after_1000_calls(serve):
    srv_ = serve()
    c = srv_.client
    s = c.open_session()
    kinds = [("true", []), ("echo", ["x"]), ("false", []), ("curl", ["x"])]
    for tool, argv in kinds:      # warm-up: every path once
        s.call(tool, argv)
    base = _baseline(c, srv_.pid)
    counts = {}
    for i in range(1000):
        tool, argv = kinds[i % len(kinds)] if i % 10 == 0 else ("true", [])
        r = s.call(tool, argv)
        counts[r.class_] = counts.get(r.class_, 0) + 1
    assert counts.get("OK", 0) >= 900 and set(counts) <= {"OK", "TOOL_ERROR", "POLICY_VIOLATION"}, counts
    st = _settled(c, srv_.pid, base)
    assert st["zombies"] == 0


def test_no_leaks_after_session_cycles(serve, state_dir):
    srv_ = serve()
    c = srv_.client
    with c.open_session() as s:
        s.call("true")
    base = _baseline(c, srv_.pid)
    for i in range(100):
        s = c.open_session()
        assert s.call("echo", [str(i)]).stdout == f"{i}\n".encode()
        assert s.close()["removed"] is True
    st = _settled(c, srv_.pid, base)
    assert st["sessions"] == 0
    assert sessions_left(state_dir) == []


def test_stats(client, session):
    st0 = client.stats()
    for f in ("sessions", "running", "processes", "zombies", "fds", "rss_kb"):
        assert is_int(st0[f]) and st0[f] >= 0, (f, st0.get(f))
    assert isinstance(st0["calls"], dict) and isinstance(st0["alarms"], list)
    assert isinstance(st0["latency_ms"], dict)
    assert st0["sessions"] == 1 and st0["running"] == 0 and st0["zombies"] == 0
    session.call("echo", ["x"])
    session.call("curl", ["x"])
    session.call("false")
    st1 = client.stats()
    for cls in ("OK", "POLICY_VIOLATION", "TOOL_ERROR"):
        assert st1["calls"].get(cls, 0) == st0["calls"].get(cls, 0) + 1, (cls, st0["calls"], st1["calls"])
    lat = st1["latency_ms"].get("echo")
    assert isinstance(lat, dict) and all(is_int(lat[k]) for k in ("p50", "p95", "p99")), st1["latency_ms"]
    other = client.open_session()
    assert client.stats()["sessions"] == 2
    other.close()
    assert client.stats()["sessions"] == 1


# ---------------------------------------------------------------- --listen


def test_listen_socket_mode_and_two_clients(serve):
    s = serve(listen=True)
    st = os.lstat(s.sock_path)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600, oct(st.st_mode)
    assert st.st_uid == os.geteuid()
    c1, c2 = s.connect(), s.connect()
    s1, s2 = c1.open_session(), c2.open_session()
    h1 = s1.start_call("sh", ["-c", "while [ ! -e go ]; do sleep 0.05; done; echo one"])
    h2 = s2.start_call("sh", ["-c", "while [ ! -e go ]; do sleep 0.05; done; echo two"])
    wait_running(c1, 2)
    for sess in (s1, s2):
        open(os.path.join(sess.root, "workspace", "go"), "w").close()
    assert h1.result(RPC_TIMEOUT).stdout == b"one\n"
    assert h2.result(RPC_TIMEOUT).stdout == b"two\n"
    c1.close()
    c2.close()


def test_listen_session_shared_by_same_uid(serve):
    s = serve(listen=True)
    c1, c2 = s.connect(), s.connect()
    a = c1.open_session("shared-1")
    r = c2.session("shared-1").call("sh", ["-c", 'echo "$SESSION_ID"; echo "$AGENT_ROOT"'])
    assert r.ok, r
    assert r.stdout.decode().splitlines() == ["shared-1", a.root]
    c1.close()
    c2.close()


def test_listen_disconnect_spares_other_connections(serve, marker):
    s = serve(listen=True)
    c1, c2 = s.connect(), s.connect()
    s1 = c1.open_session()
    m = marker()
    c1_call = s1.start_call("sleep", [f"300.{m}"])
    s2 = c2.open_session()
    h = s2.start_call("sh", ["-c", "while [ ! -e go ]; do sleep 0.05; done; echo kept"])
    wait_running(c2, 2)
    c1.close(timeout=5)   # the connection goes away with a call running
    with pytest.raises(ConnectionClosed):
        c1_call.result(5)
    # c2's session and its running call are untouched
    open(os.path.join(s2.root, "workspace", "go"), "w").close()
    r = h.result(RPC_TIMEOUT)
    assert r.ok and r.stdout == b"kept\n", r
    assert s2.call("echo", ["still"]).ok
    assert os.path.isdir(s2.root)
    c2.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another uid")
def test_listen_peer_uid_checked(serve):
    s = serve(listen=True, args=["--allow-uid", "0"])
    os.chmod(s.sock_dir, 0o755)
    os.chmod(s.sock_path, 0o666)       # let the kernel pass it; SO_PEERCRED must refuse
    out = connect_as(s.sock_path, 65534)
    assert not out.startswith("ANSWERED"), f"a peer of uid 65534 was served: {out}"
    c = s.connect()
    assert c.hello().protocol == 2
    c.close()
    s.stop()        # one server per state dir

    s2 = serve(listen=True, args=["--allow-uid", "65534"])
    os.chmod(s2.sock_dir, 0o755)
    os.chmod(s2.sock_path, 0o666)
    out = connect_as(s2.sock_path, 65534)
    assert out.startswith("ANSWERED"), f"--allow-uid 65534 did not let uid 65534 in: {out}"


# ---------------------------------------------------------------- policy reload


def test_policy_reload(serve, tmp_path):
    # policy.reload re-reads the file the server started with (protocol 2: no path)
    path = str(tmp_path / "policy.lua")
    shutil.copy(RELOAD_A, path)
    c = serve(path).client
    s = c.open_session()
    h0 = c.hello()
    g0, sha0 = h0.policy["generation"], h0.policy["sha256"]
    assert h0.policy["name"] == "serve-reload-a"
    assert s.call("extra", ["x"]).class_ == "POLICY_VIOLATION"

    shutil.copy(BROKEN_POLICY, path)
    with pytest.raises(BadRequest) as ei:
        c.reload_policy()
    assert ei.value.retryable is False and one_line(ei.value.message)
    os.unlink(path)
    with pytest.raises(BadRequest):
        c.reload_policy()
    with pytest.raises(BadRequest) as ei:
        c.request("policy.reload", {"path": RELOAD_B})
    assert "path" in ei.value.message
    h1 = c.hello()
    assert (h1.policy["generation"], h1.policy["sha256"]) == (g0, sha0), "a failed reload replaced the policy"
    assert s.call("extra", ["x"]).class_ == "POLICY_VIOLATION"
    assert s.call("echo", ["x"]).ok

    shutil.copy(RELOAD_B, path)
    res = c.reload_policy()
    assert is_int(res["generation"]) and res["generation"] > g0, res
    assert isinstance(res["sha256"], str) and res["sha256"] != sha0, res
    h2 = c.hello()
    assert h2.policy["generation"] == res["generation"] and h2.policy["sha256"] == res["sha256"]
    assert h2.policy["name"] == "serve-reload-b"
    r = s.call("extra", ["hi"])
    assert r.ok and r.stdout == b"hi\n", r


def test_policy_reload_running_call_keeps_its_policy(serve, marker, tmp_path):
    path = str(tmp_path / "policy.lua")
    shutil.copy(RELOAD_A, path)
    c = serve(path).client
    s = c.open_session()
    m = marker()
    h = s.start_call("sleep", [f"1.{m}"])
    wait_marker(m)
    shutil.copy(RELOAD_B, path)
    c.reload_policy()
    r = h.result(RPC_TIMEOUT)
    assert r.ok, r


def test_sighup_reloads_current_path(serve, tmp_path):
    path = str(tmp_path / "policy.lua")
    shutil.copy(RELOAD_A, path)
    srv_ = serve(path)
    c = srv_.client
    s = c.open_session()
    g0 = c.hello().policy["generation"]
    assert s.call("extra", ["x"]).class_ == "POLICY_VIOLATION"
    shutil.copy(RELOAD_B, path)
    os.kill(srv_.pid, signal.SIGHUP)
    wait_until(lambda: c.hello().policy["generation"] > g0, 15, "the SIGHUP reload")
    r = s.call("extra", ["hup"])
    assert r.ok and r.stdout == b"hup\n", r
    g1 = c.hello().policy["generation"]
    # A broken file on SIGHUP: logged, the old policy stays, the server lives.
    shutil.copy(BROKEN_POLICY, path)
    log_len = len(srv_.stderr_text())
    os.kill(srv_.pid, signal.SIGHUP)
    # the refusal itself, not any line: what follows must be checked after the reload
    wait_until(lambda: "policy reload refused" in srv_.stderr_text()[log_len:], 15,
               "the broken policy's reload refused")
    assert srv_.alive()
    assert c.hello().policy["generation"] == g1
    assert s.call("extra", ["still"]).ok


# ---------------------------------------------------------------- shutdown


def test_sigterm_drains(serve, state_dir, marker):
    srv_ = serve(args=["--drain-timeout", "3s"])
    c = srv_.client
    s = c.open_session()
    m = marker()
    finishing = s.start_call("sh", ["-c", "while [ ! -e go ]; do sleep 0.05; done; echo done"])
    stuck = s.start_call("sleep", [f"300.{m}"])
    wait_running(c, 2)
    os.kill(srv_.pid, signal.SIGTERM)
    refused = None
    end = time.monotonic() + 10
    while refused is None and time.monotonic() < end:
        try:
            r = s.call("echo", ["new"], rpc_timeout=10)
            assert r.ok, r            # accepted before the signal was handled
        except Overloaded as e:
            refused = e
    assert refused is not None, "new calls were not refused with OVERLOADED while draining"
    assert refused.retryable is True
    open(os.path.join(s.root, "workspace", "go"), "w").close()
    r = finishing.result(RPC_TIMEOUT)
    assert r.ok and r.stdout == b"done\n", f"a running call was not let finish: {r}"
    r = stuck.result(RPC_TIMEOUT)
    assert r.class_ != "OK", r
    assert srv_.wait_exit() == 0
    assert_marker_gone(m)
    assert sessions_left(state_dir) == []


def test_stdin_eof_cleans_up(serve, state_dir, marker):
    srv_ = serve()
    c = srv_.client
    s = c.open_session()
    m = marker()
    s.start_call("sleep", [f"300.{m}"])
    wait_marker(m)
    assert os.path.isdir(s.root)
    rc = c.close(timeout=STOP_TIMEOUT)
    assert rc == 0, srv_.stderr_text()[-2000:]
    assert_marker_gone(m)
    assert sessions_left(state_dir) == []


def test_stdin_eof_mid_message(serve, state_dir):
    srv_ = serve(raw=True)
    raw = srv_.raw
    raw_session(raw)
    data = msgpack.packb([0, 3, "hello", {"client": "cut"}], use_bin_type=True)
    raw.send_bytes(data[:5])
    raw.close()
    assert srv_.wait_exit() == 0
    assert sessions_left(state_dir) == []


# ---------------------------------------------------------------- spares (made ahead of time)

STRICT_POLICY = fixture_levels("sec")["strict"]


def _spawner_and_spares(srv_pid):
    """The server's spawner (its one child that has children of its own while no call
    runs) and the spares waiting under it."""
    live, _ = children(srv_pid)
    for pid in live:
        kids, _ = children(pid)
        if kids:
            return pid, kids
    return None, []


def _kill(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)       # ours: the server's spawner and its spares
        except ProcessLookupError:
            pass


def test_spares_are_kept_and_replaced(serve):
    """The spawner keeps spares; calls use them; killed while they wait, they are made
    up for, and no call fails or waits for them."""
    srv_ = serve()
    c = srv_.client
    s = c.open_session()
    for _ in range(5):
        assert s.call("true").ok
    spawner, spares = [None], []

    def found():
        # stats.standby counts the spawner and its spares, made or on their way
        spawner[0], spares[:] = _spawner_and_spares(srv_.pid)
        return len(spares) >= 2 and c.stats()["standby"] == 1 + len(spares)
    wait_until(found, 10, "the spawner's spares, all made and counted in stats.standby")
    _kill(spares)
    wait_until(lambda: not any(os.path.exists(f"/proc/{p}") for p in spares), 10,
               "the killed spares gone")
    for i in range(30):
        r = s.call("echo", [str(i)])
        assert r.ok and r.stdout == f"{i}\n".encode(), (r.class_, r.message)
    # replaced: as many spares as before, none of the killed ones, nothing else left over
    wait_until(lambda: len(_spawner_and_spares(srv_.pid)[1]) >= len(spares), 10,
               "spares made up for")
    assert not set(_spawner_and_spares(srv_.pid)[1]) & set(spares)
    # nothing but what is kept ready: no zombie, no leftover of the killed ones
    wait_until(lambda: (lambda st: st["zombies"] == 0 and st["processes"] == st["standby"])(
        c.stats()), 10, "the server back to its spawner and spares")


def test_spawner_killed_calls_go_on(serve, state_dir):
    """Without its spawner the server forks each call's shim itself: slower, same walls,
    nothing lost."""
    srv_ = serve()
    c = srv_.client
    s = c.open_session()
    assert s.call("true").ok
    spawner, spares = [None], []

    def found():
        spawner[0], spares[:] = _spawner_and_spares(srv_.pid)
        return spawner[0] is not None
    wait_until(found, 10, "the spawner")
    _kill([spawner[0]])
    # its spares die with it (PDEATHSIG); a call handed to one in that instant would fail
    # like any call whose shim is killed, which is not what this test is about
    wait_until(lambda: not any(os.path.exists(f"/proc/{p}") and proc_state(p)[0] != b"Z"
                               for p in [spawner[0]] + spares), 10, "the spawner and spares dead")
    for i in range(30):
        r = s.call("echo", [str(i)])
        assert r.ok and r.stdout == f"{i}\n".encode(), (r.class_, r.message)
    assert s.close()["removed"] is True
    wait_until(lambda: c.stats()["zombies"] == 0 and not children(srv_.pid)[1], 10,
               "no zombie left")
    assert sessions_left(state_dir) == []


def test_strict_spare_killed_next_call_still_runs(serve):
    """A session's zygote keeps its runner (a spare kept across calls); if it dies while
    it waits, the next call gets a new one, whose pid namespace holds only itself and the
    call's tool."""
    if os.geteuid() != 0 and not os.path.exists("/proc/self/ns/user"):
        pytest.skip("strict isolation needs root or user namespaces")
    srv_ = serve(policy=STRICT_POLICY)
    c = srv_.client
    s = c.open_session()
    for _ in range(3):
        assert s.call("true").ok
    wait_until(lambda: [k for pid in children(srv_.pid)[0] for k in children(pid)[0]], 10,
               "the zygote's spare")
    zygote_spares = [k for pid in children(srv_.pid)[0] for k in children(pid)[0]]
    _kill(zygote_spares)
    wait_until(lambda: not any(os.path.exists(f"/proc/{p}") for p in zygote_spares), 10,
               "the killed spare gone")
    for _ in range(5):
        r = s.call("sh", ["-c", "echo $$; echo /proc/[0-9]*"])
        assert r.ok, (r.class_, r.message, r.stdout)
        pid, procs = r.stdout.decode().splitlines()
        assert sorted(procs.split()) == sorted({"/proc/1", f"/proc/{pid}"}), r.stdout
