"""PROTOCOL.md version 2, rule by rule: framing (params as an array, a bare map still
understood, notifications [2, method, [map]]), strict params, msgid range and msgids in
flight, bounded durations, policy.reload (no path, admin peers only, no lowering of the
isolation level), idempotent session.close, SESSION_EXPIRED after expiry, labels, and the
socket's options (--socket-mode, --socket-group, --admin-uid, a live socket not taken
over). The Python client's side: ProtocolError instead of a silent wait."""

import asyncio
import json
import os
import shutil
import socket
import stat
import subprocess
import threading
import time

import msgpack
import pytest

from serve_helpers import (POLICY, RELOAD_A, RELOAD_B, RPC_TIMEOUT, ServeProc, clean_env,
                           connect_as, is_int, live_with_marker, one_line, stop_all,
                           wait_until)
from stockade_client import (AsyncClient, BadRequest, Client, NoSuchSession, OutputChunk,
                             PolicyViolation, ProtocolError, SessionExpired)
from stockade_client import _proto


@pytest.fixture
def serve(stockade, state_dir, tmp_path):
    servers = []

    def start(policy=POLICY, args=(), listen=False, raw=False):
        # a listening server owns its state dir: a second one gets a dir of its own
        sd = state_dir
        if listen and any(s.sock_path for s in servers):
            sd = os.path.join(state_dir, f"second-{len(servers)}")
            os.mkdir(sd, 0o755)
        s = ServeProc(stockade, sd, policy, args, listen=listen, raw=raw,
                      log_dir=str(tmp_path))
        servers.append(s)
        return s

    yield start
    stop_all(servers)


@pytest.fixture
def raw(serve):
    return serve(raw=True).raw


def open_raw(raw, **params):
    return raw.call_ok("session.open", params)["session_id"]


def assert_bad_request(err, *words):
    assert isinstance(err, dict) and err.get("class") == "BAD_REQUEST", err
    assert err["retryable"] is False and one_line(err["message"]), err
    for w in words:
        assert w in err["message"], f"{w!r} not named in {err['message']!r}"


def process_policy(tmp_path, name="p2-process", isolation="process"):
    path = tmp_path / f"{name}.lua"
    path.write_text(f'''local stockade = require "stockade"
return stockade.policy {{
  name = "{name}", isolation = "{isolation}",
  timeouts = {{ call = "10s", grace = "500ms" }},
  tools = {{ echo = stockade.tool {{ path = "/bin/echo", owner = "tests", timeout = "5s",
                                    schema = {{ type = "object" }} }} }},
}}
''')
    return str(path)


# ---------------------------------------------------------------- framing


def test_hello_says_protocol_2(raw):
    assert raw.call_ok("hello", {"client": "p2"})["protocol"] == 2


def test_params_as_an_array_empty_array_and_bare_map(raw):
    for msgid, params in enumerate(([{"client": "array"}], [], [None], {"client": "v1 map"},
                                     None), start=100):
        raw.send([0, msgid, "hello", params])
        err, res = raw.response(msgid)
        assert err is None and res["protocol"] == 2, (params, err)


@pytest.mark.parametrize("params", [[{}, {}], [5], ["hello"], 7, "x"])
def test_params_other_than_one_map_are_refused(raw, params):
    raw.send([0, 9, "hello", params])
    err, res = raw.response(9)
    assert_bad_request(err, "params")
    assert res is None


# call.output's framing: test_serve.py::test_stream_notifications_raw
def test_session_expired_notification_is_protocol_2(raw):
    sid = open_raw(raw, ttl_ms=300)
    end = time.monotonic() + 15
    while True:
        m = raw.recv(max(end - time.monotonic(), 0.01))
        if m[0] == 2 and m[1] == "session.expired":
            assert m[2] == [{"session_id": sid, "layer": "ttl"}], m
            return


# ---------------------------------------------------------------- strict params


@pytest.mark.parametrize("method,params,key", [
    ("hello", {"client": "x", "bogus": 1}, "bogus"),
    ("hello", {"client": 5}, "client"),
    ("session.open", {"ttl": 1000}, "ttl"),
    ("session.open", {"ttl_ms": "1000"}, "ttl_ms"),
    ("session.open", {"labels": ["a"]}, "labels"),
    ("session.open", {"labels": {"k": 1}}, "labels"),
    ("session.open", {"session_id": 5}, "session_id"),
    ("session.renew", {"session_id": "x", "extra": True}, "extra"),
    ("session.renew", {}, "session_id"),
    ("session.close", {"id": "x"}, "id"),
    ("cancel", {"id": 3}, "id"),
    ("cancel", {"msgid": -1}, "msgid"),
    ("cancel", {"msgid": 1 << 32}, "msgid"),
    ("stats", {"verbose": True}, "verbose"),
    ("policy.reload", {"path": "/etc/passwd"}, "path"),
])
def test_strict_params_name_the_key(raw, method, params, key):
    msgid = raw.request(method, params)
    err, res = raw.response(msgid)
    assert_bad_request(err, key)
    assert res is None


@pytest.mark.parametrize("extra,key", [
    ({"deadline": 100}, "deadline"),            # the typo of deadline_ms
    ({"timeout": 100}, "timeout"),
    ({"deadline_ms": "100"}, "deadline_ms"),
    ({"timeout_ms": 1.5}, "timeout_ms"),
    ({"stream": 1}, "stream"),
    ({"idempotent": "yes"}, "idempotent"),
    ({"argv": "sleep"}, "argv"),
    ({"argv": ["ok", 5]}, "argv[1]"),
    ({"env": {"A": 1}}, "env"),
    ({"stdin": 5}, "stdin"),
    ({"depth": "2"}, "depth"),
    ({"args": [1]}, "args"),
])
def test_strict_call_params_run_nothing(raw, extra, key):
    sid = open_raw(raw)
    marker = f"{time.monotonic_ns() % 10**8:08d}"
    params = {"session_id": sid, "tool": "sleep", "argv": [f"5.{marker}"]}
    params.update(extra)
    err, res = raw.response(raw.request("call", params))
    assert_bad_request(err, key)
    assert live_with_marker(marker) == [], "a refused call started a process"


def test_duplicate_keys_are_refused(raw):
    # msgpack maps may repeat a key; the server must not pick one silently
    body = (b"\x94\x00\x05\xa5hello\x91\x82" + msgpack.packb("client") + msgpack.packb("a")
            + msgpack.packb("client") + msgpack.packb("b"))
    raw.send_bytes(body)
    err, _ = raw.response(5)
    assert_bad_request(err, "client", "twice")


# ---------------------------------------------------------------- msgids


@pytest.mark.parametrize("msgid", [-1, 1 << 32, "abc", 1.5, None, [1], True])
def test_a_msgid_that_is_not_uint32_is_answered_echoing_it(raw, msgid):
    raw.send([0, msgid, "hello", []])
    m = raw.recv()
    assert m[0] == 1 and m[1] == msgid and type(m[1]) is type(msgid), m
    assert_bad_request(m[2], "msgid")
    assert m[3] is None
    err, res = raw.response(raw.request("hello", msgid=4242))
    assert err is None and res["protocol"] == 2, "the connection must go on"


def test_a_msgid_in_flight_is_refused_the_first_unaffected(raw):
    sid = open_raw(raw)
    first = raw.request("call", {"session_id": sid, "tool": "sh",
                                 "argv": ["-c", "sleep 1; echo first"]}, msgid=700)
    raw.send([0, 700, "call", [{"session_id": sid, "tool": "echo", "argv": ["second"]}]])
    err, _ = raw.response(700)          # the refusal comes first: the call sleeps
    assert_bad_request(err, "700", "in flight")
    err, r = raw.response(first, timeout=RPC_TIMEOUT)
    assert err is None and r["class"] == "OK" and r["stdout"] == b"first\n", (err, r)
    # answered: the msgid is free again
    err, r = raw.response(raw.request("call", {"session_id": sid, "tool": "echo",
                                               "argv": ["again"]}, msgid=700))
    assert err is None and r["stdout"] == b"again\n"


def test_cancel_of_a_msgid_cancels_one_call(raw):
    sid = open_raw(raw)
    a = raw.request("call", {"session_id": sid, "tool": "sleep", "argv": ["30"]}, msgid=40)
    raw.send([0, 40, "call", [{"session_id": sid, "tool": "sleep", "argv": ["30"]}]])
    err, _ = raw.response(40)
    assert_bad_request(err, "in flight")
    res = raw.call_ok("cancel", {"msgid": 40})
    assert res == {"cancelled": True}
    err, r = raw.response(a)
    assert err is None and r["class"] == "CANCELLED", (err, r)


# ---------------------------------------------------------------- durations


def test_huge_ttl_is_capped_not_wrapped(raw):
    res = raw.call_ok("session.open", {"ttl_ms": (1 << 63) - 1, "fuse_ms": (1 << 63) - 1})
    now = time.time() * 1000
    assert res["expires_at_ms"] > now and res["fuse_at_ms"] > now, res
    assert res["expires_at_ms"] < now + (1 << 41), "the lease was not capped"
    assert res["fuse_at_ms"] < now + 366 * 86400_000, "fuse above any policy cap"
    sid = res["session_id"]
    assert raw.call_ok("session.renew", {"session_id": sid})["expires_at_ms"] > now
    err, _ = raw.response(raw.request("session.open", {"ttl_ms": (1 << 64) - 1}))
    assert_bad_request(err, "ttl_ms")
    for bad in (0, -5):
        err, _ = raw.response(raw.request("session.open", {"ttl_ms": bad}))
        assert_bad_request(err, "ttl_ms")


@pytest.mark.parametrize("deadline", [0, -5])
def test_a_spent_deadline_is_answered_honestly(raw, deadline):
    sid = open_raw(raw)
    err, r = raw.response(raw.request("call", {"session_id": sid, "tool": "echo",
                                               "argv": ["x"], "deadline_ms": deadline}))
    assert err is None, err
    assert r["class"] == "DEADLINE_EXCEEDED" and r["layer"] == "deadline", r
    assert f"{deadline} ms" in r["message"] and "of 1 ms" not in r["message"], r["message"]
    assert r["exit_code"] is None, "no process may run on a spent deadline"


def test_huge_deadline_and_timeout_run_normally(raw):
    sid = open_raw(raw)
    err, r = raw.response(raw.request("call", {
        "session_id": sid, "tool": "echo", "argv": ["big"], "deadline_ms": (1 << 63) - 1,
        "timeout_ms": (1 << 63) - 1}))
    assert err is None and r["class"] == "OK" and r["stdout"] == b"big\n", (err, r)


# ---------------------------------------------------------------- sessions


def test_session_close_is_idempotent(raw):
    sid = open_raw(raw)
    assert raw.call_ok("session.close", {"session_id": sid}) == {"removed": True,
                                                                  "calls_killed": 0}
    assert raw.call_ok("session.close", {"session_id": sid}) == {"removed": False,
                                                                  "calls_killed": 0}
    err, _ = raw.response(raw.request("session.close", {"session_id": "never-seen-p2"}))
    assert err["class"] == "NO_SUCH_SESSION", err


def test_expired_session_answers_session_expired_with_its_layer(serve):
    c = serve().client
    s = c.open_session(ttl_ms=300)
    c.wait_notification("session.expired", lambda p: p["session_id"] == s.session_id,
                        timeout=15)
    with pytest.raises(SessionExpired) as ei:
        s.call("echo", ["late"])
    assert ei.value.layer == "ttl" and ei.value.retryable is False
    with pytest.raises(SessionExpired) as ei:
        s.renew()
    assert ei.value.layer == "ttl"
    assert s.close() == {"removed": False, "calls_killed": 0}
    f = c.open_session(fuse_ms=300)
    c.wait_notification("session.expired", lambda p: p["session_id"] == f.session_id,
                        timeout=15)
    with pytest.raises(SessionExpired) as ei:
        f.call("echo", ["late"])
    assert ei.value.layer == "fuse"
    # an id reused for a new session is that new session
    again = c.open_session(s.session_id)
    assert again.call("echo", ["new"]).ok
    with pytest.raises(NoSuchSession):
        c.call("never-seen-p2", "echo", ["x"])


def test_labels_are_kept_in_stats_and_logs(serve):
    srv = serve()
    c = srv.client
    labels = {"team": "search", "run": "r-42"}
    s = c.open_session(labels=labels)
    plain = c.open_session()
    assert s.call("echo", ["x"]).ok
    st = c.stats()
    assert st["session_labels"] == {s.session_id: labels}, st["session_labels"]
    s.close()
    plain.close()
    assert c.stats()["session_labels"] == {}
    records = [json.loads(line) for line in srv.stderr_text().splitlines()
               if line.startswith("{")]
    mine = [r for r in records if r.get("session") == s.session_id]
    kinds = {(r.get("event"), r.get("state")) for r in mine}
    assert ("session", "opened") in kinds and ("session", "closed") in kinds, mine
    assert any(r.get("event") == "call" for r in mine), mine
    for r in mine:
        assert r.get("labels") == labels, r
    assert all("labels" not in r for r in records if r.get("session") == plain.session_id)


def test_labels_are_bounded(raw):
    err, _ = raw.response(raw.request("session.open",
                                      {"labels": {f"k{i}": "v" for i in range(33)}}))
    assert_bad_request(err, "labels")
    err, _ = raw.response(raw.request("session.open", {"labels": {"k": "v" * 257}}))
    assert_bad_request(err, "labels")


# ---------------------------------------------------------------- policy.reload


def test_reload_takes_no_path_and_rereads_the_servers_file(serve, tmp_path):
    path = str(tmp_path / "policy.lua")
    shutil.copy(RELOAD_A, path)
    c = serve(path).client
    g0 = c.hello().policy["generation"]
    with pytest.raises(BadRequest) as ei:
        c.request("policy.reload", {"path": RELOAD_B})
    assert "path" in ei.value.message
    assert c.hello().policy["name"] == "serve-reload-a"
    shutil.copy(RELOAD_B, path)
    res = c.reload_policy()
    assert res["generation"] > g0
    assert c.hello().policy["name"] == "serve-reload-b"


def test_reload_is_for_admin_peers_only(serve, tmp_path):
    # the default admin is the server's own uid: this test's
    s = serve(listen=True)
    c = s.connect()
    assert is_int(c.reload_policy()["generation"])
    c.close()
    other = 65534 if os.geteuid() != 65534 else 65533
    s2 = serve(listen=True, args=["--admin-uid", str(other)])
    c2 = s2.connect()
    g = c2.hello().policy["generation"]
    with pytest.raises(PolicyViolation) as ei:
        c2.reload_policy()
    assert ei.value.retryable is False
    assert c2.hello().policy["generation"] == g
    c2.close()


def test_reload_never_lowers_isolation(serve, tmp_path):
    strict = process_policy(tmp_path, "p2-strict", "strict")
    probe = subprocess.run([os.environ["STOCKADE_BIN"], "doctor"], capture_output=True,
                           timeout=60, env=clean_env())
    if b"isolation strict:  available" not in probe.stdout:
        pytest.skip(f"this host cannot give isolation=strict: {probe.stdout[-300:]!r}")
    path = str(tmp_path / "policy.lua")
    shutil.copy(strict, path)
    srv = serve(path)
    c = srv.client
    h0 = c.hello()
    assert h0.isolation["level"] == "strict"
    shutil.copy(process_policy(tmp_path), path)
    with pytest.raises(BadRequest) as ei:
        c.reload_policy()
    assert "isolation" in ei.value.message
    h1 = c.hello()
    assert h1.isolation["level"] == "strict" and h1.policy["generation"] == h0.policy["generation"]
    # SIGHUP is refused the same way
    os.kill(srv.pid, 1)
    # the SIGHUP's own refusal: the RPC's above says "lower isolation" too
    wait_until(lambda: "SIGHUP: policy reload refused, the old policy stays: the new policy "
               "would lower isolation" in srv.stderr_text(), 15, "the refused SIGHUP logged")
    assert c.hello().isolation["level"] == "strict"


# ---------------------------------------------------------------- the socket


def test_socket_mode_and_group(serve):
    if os.geteuid() != 0:
        pytest.skip("giving the socket another group needs root")
    s = serve(listen=True, args=["--socket-mode", "0660", "--socket-group", "65534"])
    st = os.stat(s.sock_path)
    assert stat.S_IMODE(st.st_mode) == 0o660, oct(st.st_mode)
    assert st.st_gid == 65534
    s2 = serve(listen=True)
    assert stat.S_IMODE(os.stat(s2.sock_path).st_mode) == 0o600


def test_socket_mode_and_group_admit_an_allowed_uid(serve):
    # --allow-uid alone cannot admit another uid: the kernel refuses it at the 0600 socket
    # before SO_PEERCRED is asked; with the group's rw bits it gets through and is served
    if os.geteuid() != 0:
        pytest.skip("connecting as another uid needs root")
    alone = serve(listen=True, args=["--allow-uid", "65534"])
    os.chmod(alone.sock_dir, 0o755)
    assert connect_as(alone.sock_path, 65534).startswith("NOCONNECT")
    s = serve(listen=True, args=["--allow-uid", "65534", "--socket-mode", "0660",
                                 "--socket-group", "65534"])
    os.chmod(s.sock_dir, 0o755)
    out = connect_as(s.sock_path, 65534)
    assert out.startswith("ANSWERED"), out
    # the group's mode does not widen SO_PEERCRED: a uid not allowed is still refused
    s2 = serve(listen=True, args=["--socket-mode", "0666"])
    os.chmod(s2.sock_dir, 0o755)
    assert not connect_as(s2.sock_path, 65534).startswith("ANSWERED")


@pytest.mark.parametrize("args", [["--socket-mode", "0666x"], ["--socket-mode", "0755"],
                                  ["--socket-mode", "0066"], ["--socket-group", "no-such-grp-p2"],
                                  ["--admin-uid", "abc"]])
def test_socket_options_are_checked(stockade, state_dir, args):
    cp = subprocess.run([stockade, "serve", "--policy", POLICY, "--state-dir", state_dir,
                         "--listen", "unix:/var/tmp/p2-never.sock"] + args,
                        capture_output=True, timeout=30, stdin=subprocess.DEVNULL)
    assert cp.returncode != 0 and args[0].encode() in cp.stderr, cp.stderr
    assert not os.path.exists("/var/tmp/p2-never.sock")


def test_a_live_socket_is_not_taken_over(serve, stockade, state_dir):
    first = serve(listen=True)
    c = first.connect()
    other = os.path.join(state_dir, "other")    # the state dir is the first one's too
    cp = subprocess.run([stockade, "serve", "--policy", POLICY, "--state-dir", other,
                         "--listen", "unix:" + first.sock_path],
                        capture_output=True, timeout=30, stdin=subprocess.DEVNULL)
    assert cp.returncode != 0 and b"address in use" in cp.stderr, cp.stderr
    assert c.hello().protocol == 2, "the first server lost its socket"
    c2 = first.connect()
    assert c2.hello().protocol == 2
    c.close()
    c2.close()


def test_a_stale_socket_is_replaced(stockade, state_dir, tmp_path):
    path = str(tmp_path / "stale.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)          # bound, never listening, then closed: what a dead server leaves
    s.close()
    proc = subprocess.Popen([stockade, "serve", "--policy", POLICY, "--state-dir", state_dir,
                             "--listen", "unix:" + path], stdin=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env=clean_env())
    try:
        wait_until(lambda: proc.poll() is not None or _answers(path), 15,
                   "the new server listening on the stale path")
        assert proc.poll() is None, proc.stderr.read()
    finally:
        proc.terminate()
        proc.wait(30)
        proc.stderr.close()


def _answers(path):
    try:
        c = Client.connect_unix(path, rpc_timeout=5)
    except OSError:
        return False
    try:
        return c.hello().protocol == 2
    finally:
        c.close()


# ---------------------------------------------------------------- the Python client


def _fake_server(reply):
    """A Client over a socketpair whose other end answers every request with `reply`."""
    ours, theirs = socket.socketpair()

    def serve_once():
        theirs.recv(65536)
        theirs.sendall(reply)

    t = threading.Thread(target=serve_once, daemon=True)
    t.start()

    def closer():
        try:
            ours.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
    return Client(lambda: ours.recv(65536), ours.sendall, closer, rpc_timeout=60,
                  sock=ours), theirs


@pytest.mark.parametrize("reply", [b"\xc1", msgpack.packb([7, 1, None, None]),
                                   msgpack.packb({"not": "rpc"}),
                                   msgpack.packb([2, "alarm", "not a map"])])
def test_client_raises_protocol_error_at_once(reply):
    c, theirs = _fake_server(reply)
    t0 = time.monotonic()
    with pytest.raises(ProtocolError):
        c.hello()
    assert time.monotonic() - t0 < 30, "waited out rpc_timeout instead"
    c.close(timeout=5)
    theirs.close()


def test_an_answer_before_the_garbage_still_arrives():
    # the reply holds hello's answer (msgid 1) and then bytes that are not msgpack
    c, theirs = _fake_server(msgpack.packb([1, 1, None, {"protocol": 2}]) + b"\xc1")
    assert c.hello().protocol == 2
    wait_until(lambda: c.closed, 10, "the client closing on the garbage")
    assert "undecodable" in c.close_reason
    c.close(timeout=5)
    theirs.close()


def test_async_client_raises_protocol_error_at_once():
    async def main():
        ours, theirs = socket.socketpair()
        reader, writer = await asyncio.open_unix_connection(sock=ours)
        c = AsyncClient(reader, writer, rpc_timeout=60)
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(None, lambda: (theirs.recv(65536),
                                                  theirs.sendall(b"\x92\x07\x07")))
        t0 = time.monotonic()
        with pytest.raises(ProtocolError):
            await c.hello()
        assert time.monotonic() - t0 < 30
        await fut
        await c.close(timeout=5)
        theirs.close()
    asyncio.run(main())


def test_core_frames_protocol_2():
    core = _proto.Core()
    p, data = core.request("hello", {"client": "x"}, lambda m: ("pending", m))
    msg = msgpack.unpackb(data, raw=False)
    assert msg == [0, p[1], "hello", [{"client": "x"}]]
    _, data = core.request("stats", None, lambda m: m)
    assert msgpack.unpackb(data, raw=False)[3] == []
    events = core.feed(msgpack.packb([2, "alarm", [{"kind": "fds"}]]) +
                       msgpack.packb([1, p[1], None, {"protocol": 2}]))
    assert events[0] == _proto.Notification("alarm", {"kind": "fds"})
    assert events[1].pending == p and events[1].result == {"protocol": 2}
    assert core.in_flight() == 1


def test_sync_and_async_stream_call(serve):
    srv = serve()
    items = list(srv.client.open_session().stream_call("sh", ["-c", "printf a; printf b >&2"]))
    chunks, result = items[:-1], items[-1]
    assert result.ok and all(isinstance(ch, OutputChunk) for ch in chunks)
    assert b"".join(ch.data for ch in chunks if ch.stream == "stdout") == b"a"

    async def main():
        c = await AsyncClient.spawn(srv.cmd, rpc_timeout=RPC_TIMEOUT,
                                    stderr=subprocess.DEVNULL, env=clean_env())
        s = await c.open_session()
        got = [x async for x in s.stream_call("sh", ["-c", "printf c"])]
        await s.close()
        await c.close()
        return got
    got = asyncio.run(main())
    assert got[-1].ok and b"".join(x.data for x in got[:-1]) == b"c"
