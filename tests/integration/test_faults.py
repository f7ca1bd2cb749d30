"""The server short of descriptors or disk, and its helpers killed: what the clients get,
and that it comes back. The descriptor limit of the running server is lowered and raised
again with prlimit(2) (root, or the server's own uid), so the shortage starts and ends
exactly when the test says. Every wait is bounded.

    STOCKADE_BIN=$PWD/stockade PYTHONPATH=contrib/python /usr/bin/python3 -m pytest -q \
        -p no:cacheprovider tests/integration/test_faults.py
"""

import json
import os
import resource
import signal
import socket
import subprocess
import time

import pytest

from serve_helpers import accepted_connections, children, clean_env, proc_state, wait_until
from stockade_client import StockadeError
from stockade_testlib import FIXTURES, fixture_levels

POLICIES = fixture_levels("recovery")
PROCESS_POLICY, STRICT_POLICY = POLICIES["process"], POLICIES["strict"]
ALARMS_POLICY = os.path.join(FIXTURES, "alarms.lua")





def lowest_free_fd(pid):
    """The descriptor number the kernel would hand out next in pid."""
    held = {int(name) for name in os.listdir(f"/proc/{pid}/fd")}
    return next(n for n in range(len(held) + 1) if n not in held)


class Shortage:
    """The server's descriptor limit set to its lowest free descriptor number, so no new
    descriptor can be had, restored on exit. Not the count it holds: a connection closed
    just before leaves a hole below the highest descriptor, and a limit at the count
    would still let accept() fill it. Nor one reading of it: a descriptor the server held
    for a moment then (its sampler opens /proc files once a second) leaves the same hole
    once closed, so the limit follows the lowest free number down for a while."""

    SETTLE = 0.3        # far longer than the sampler holds a descriptor

    def __init__(self, pid):
        self.pid = pid

    def __enter__(self):
        self.old = resource.prlimit(self.pid, resource.RLIMIT_NOFILE)
        limit = lowest_free_fd(self.pid)
        resource.prlimit(self.pid, resource.RLIMIT_NOFILE, (limit, self.old[1]))
        end = time.monotonic() + self.SETTLE
        while time.monotonic() < end:
            free = lowest_free_fd(self.pid)
            if free < limit:
                limit = free
                resource.prlimit(self.pid, resource.RLIMIT_NOFILE, (limit, self.old[1]))
            time.sleep(0.002)
        return self

    def __exit__(self, *exc):
        resource.prlimit(self.pid, resource.RLIMIT_NOFILE, self.old)


def test_descriptor_shortage_is_overloaded_and_passes(servers, level):
    """Out of descriptors: session.open and calls answer OVERLOADED, retryable (not
    INTERNAL, not "no free service uid"); once descriptors come back, everything works,
    the strict session's zygote included."""
    srv = servers(POLICIES[level])
    c = srv.connect()
    s = c.open_session()
    assert s.call("echo", ["before"]).ok
    with Shortage(srv.pid):
        with pytest.raises(StockadeError) as ei:
            c.open_session()
        assert ei.value.class_ == "OVERLOADED" and ei.value.retryable, ei.value
        assert "no free service uid" not in str(ei.value)
        for _ in range(3):
            r = s.call("echo", ["during"])
            assert r.class_ == "OVERLOADED" and r.retryable, (r.class_, r.retryable, r.message)
    for i in range(3):
        r = s.call("echo", [str(i)])
        assert r.ok and r.stdout == f"{i}\n".encode(), (r.class_, r.message)
    s2 = c.open_session()
    assert s2.call("echo", ["after"]).ok


def accept_failures(srv):
    """accept() failures the server logged: each line, plus the repeats the log's rate
    limit folded into the next one."""
    n = 0
    for line in srv.stderr_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if str(rec.get("msg", "")).startswith("accept: "):
            n += 1 + int(rec.get("previous_repeated", 0))
        elif "previous_repeated" in rec and n:
            n += int(rec["previous_repeated"])      # folded into an unrelated line
    return n


def log_messages(srv):
    """The msg of each JSON log line of the server, in order."""
    msgs = []
    for line in srv.stderr_text().splitlines():
        try:
            msgs.append(str(json.loads(line).get("msg", "")))
        except ValueError:
            continue
    return msgs


def disconnect_logged_after_accept_failures(srv):
    msgs = log_messages(srv)
    failed = [i for i, m in enumerate(msgs) if m.startswith("accept: ")]
    return failed and any(m.startswith("client disconnected") for m in msgs[failed[-1]:])


def test_accept_does_not_spin_when_out_of_descriptors(servers):
    srv = servers()
    # a connection closed before the shortage leaves a hole below the highest descriptor:
    # made here on purpose
    early = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    early.connect(srv.sock_path)
    c = srv.connect()
    assert c.stats()["sessions"] == 0          # accepted before the shortage (early first)
    early.close()
    # closed by the server, not just by us (its descriptor count is no measure: helpers
    # and the sampler open and close descriptors of their own)
    wait_until(lambda: len(accepted_connections(srv.pid, srv.sock_path)) == 1, 10,
               "the server to close every connection but c")
    with Shortage(srv.pid):
        t0 = time.monotonic()
        waiting = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        waiting.connect(srv.sock_path)      # in the backlog; accept() gets EMFILE
        wait_until(lambda: accept_failures(srv), 10, "accept() failing (logged)")
        # the window the retries are counted over
        time.sleep(max(0.0, t0 + 1.5 - time.monotonic()))
        wall = time.monotonic() - t0
        assert c.stats()["sessions"] == 0      # the existing connection is still served
        assert len(accepted_connections(srv.pid, srv.sock_path)) == 1, "accept() got one"
    c.close()   # a line after the shortage, carrying the count of repeats before it
    # a listener left armed retries accept() as fast as the loop turns (10^5/s); parked,
    # it retries a few times a second. (Any earlier disconnect, e.g. early's, is no sign.)
    wait_until(lambda: disconnect_logged_after_accept_failures(srv), 10, "the close logged")
    tries = accept_failures(srv)
    assert 0 < tries < 20 * wall, f"{tries} failed accept() calls in {wall:.1f}s"
    waiting.close()
    # the listener is back: a new client is served
    c2 = srv.connect()
    assert c2.open_session().call("echo", ["x"]).ok


def test_fds_figures_hold_when_out_of_descriptors(servers):
    """stats.fds is never -1, and the fds alarm does not clear, when the server cannot
    open /proc/self/fd (that is exactly when descriptors run out)."""
    srv = servers(ALARMS_POLICY, args=["--debug-hooks"])
    c = srv.connect()
    c.request("debug.leak", {"count": 16})
    wait_until(lambda: any(a["kind"] == "fds" for a in c.stats()["alarms"]), 10,
               "the fds alarm raised")
    with Shortage(srv.pid):
        st = c.stats()
        assert st["fds"] > 0, st["fds"]
        # two samples of the shortage
        t_end = time.monotonic() + 2.5
        while time.monotonic() < t_end:
            st = c.stats()
            assert st["fds"] > 0, st["fds"]
            assert any(a["kind"] == "fds" for a in st["alarms"]), st["alarms"]
            time.sleep(0.2)


def test_drain_closes_the_listener(servers):
    """SIGTERM with a call running: the drain waits for it, and a new client is refused
    at once instead of waiting in a backlog nobody will accept from."""
    srv = servers(args=["--drain-timeout", "20s"])
    c = srv.connect()
    s = c.open_session()
    h = s.start_call("sleep", ["8"])
    wait_until(lambda: c.stats()["running"] == 1, 10, "the call running")
    os.kill(srv.pid, signal.SIGTERM)
    wait_until(lambda: not os.path.exists(srv.sock_path), 3, "the socket closed")
    late = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with pytest.raises((ConnectionRefusedError, FileNotFoundError)):
        late.connect(srv.sock_path)
    late.close()
    assert not h.done()             # still draining: the call runs on
    assert h.result(timeout=20).ok
    srv.wait_exit()


def test_file_size_limit_on_the_log(stockade, state_dir, tmp_path):
    """A size-capped log disk (RLIMIT_FSIZE on the server): the server does not die of
    SIGXFSZ; lines that do not fit are dropped and counted, calls go on."""
    log = tmp_path / "serve.log"
    sock = str(tmp_path / "s.sock")

    def cap():
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    proc = subprocess.Popen([stockade, "serve", "--policy", PROCESS_POLICY, "--state-dir",
                             state_dir, "--listen", "unix:" + sock, "--log", str(log),
                             "--metrics", str(tmp_path / "metrics.prom"),
                             "--metrics-interval", "100ms"],
                            preexec_fn=cap, start_new_session=True)
    try:
        from stockade_client import Client
        wait_until(lambda: os.path.exists(sock), 10, "the socket")
        wait_until(lambda: _connectable(sock), 10, "the server listening")
        c = Client.connect_unix(sock, rpc_timeout=30)
        s = c.open_session()
        for i in range(60):     # a log record per call: well past 4 KiB
            assert s.call("echo", [str(i) * 40]).ok
        assert proc.poll() is None
        st = c.stats()
        assert st.get("log_dropped", 0) > 0, st
        assert os.path.getsize(log) <= 4096
        c.close()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.wait(20)
    assert proc.returncode == 0, proc.returncode


def _connectable(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


def _helpers(pid):
    """The server's kept children (spawner, zygotes) and their children (spares, shims)."""
    kids = children(pid)[0]
    return kids, [g for k in kids for g in children(k)[0]]


def test_killed_spawner_or_zygote(servers, level):
    """Kill the helper that hosts a running call (the spawner under process, the
    session's zygote under strict): that call is INTERNAL, blamed on stockade, not on the
    tool; the helper is started again, and stats.standby matches the processes there."""
    srv = servers(POLICIES[level])
    c = srv.connect()
    s = c.open_session()
    assert s.call("echo", ["x"]).ok
    h = s.start_call("sleep", ["20"])
    wait_until(lambda: c.stats()["running"] == 1, 10, "the call running")
    kids, _ = _helpers(srv.pid)
    assert kids
    for k in kids:
        os.kill(k, signal.SIGKILL)
    r = h.result(timeout=20)
    assert r.class_ == "INTERNAL", (r.class_, r.message)
    for i in range(3):
        r = s.call("echo", [str(i)])
        assert r.ok and r.stdout == f"{i}\n".encode(), (r.class_, r.message)

    def standby_matches():
        st = c.stats()
        kids, grand = _helpers(srv.pid)
        live = [p for p in kids + grand if proc_state(p)[0] not in (b"Z", b"")]
        return st["running"] == 0 and st["standby"] == len(live) and kids
    wait_until(standby_matches, 10, "stats.standby equal to the helpers alive")


def test_killed_shims_and_spares_leave_no_drift(servers, level):
    """Kill running shims and waiting spares, over and over: afterwards stats.standby is
    the number of helper processes really there, and no spare is left over uncounted."""
    import random
    rnd = random.Random(17)
    srv = servers(POLICIES[level])
    c = srv.connect()
    s = c.open_session()
    kills = 0
    for _ in range(30):
        h = s.start_call("sh", ["-c", "sleep 0.2"])
        _, grand = _helpers(srv.pid)
        if grand:
            victim = rnd.choice(grand)
            try:
                os.kill(victim, signal.SIGKILL)
                kills += 1
            except ProcessLookupError:
                pass
            # SIGKILL sent is not exited: an idle runner still dying (under strict, pid 1
            # of its namespace, whose end takes its namespace down first) looks alive and
            # may be handed the next call, which it cannot answer. The next call is
            # checked once the kill has taken.
            wait_until(lambda: proc_state(victim)[0] in (b"Z", b""), 10, "the killed helper gone")
        h.result(timeout=20)            # whatever its class: the call is answered
        assert s.call("echo", ["x"]).ok
    assert kills >= 10

    def standby_matches():
        st = c.stats()
        kids, grand = _helpers(srv.pid)
        live = [p for p in kids + grand if proc_state(p)[0] not in (b"Z", b"")]
        return st["running"] == 0 and st["standby"] == len(live)
    wait_until(standby_matches, 10, "stats.standby equal to the helpers alive")


def test_state_dir_full(stockade, state_dir, tmp_path):
    """The state dir's file system full (a tool filled it): session.open answers
    OVERLOADED, retryable; what is stored (records, files) is intact; once space comes
    back, sessions open again. The state dir is a small tmpfs mounted in a mount namespace
    of the server's own (the host's mounts are not touched)."""
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                            f"mount -t tmpfs -o size=1m tmpfs {tmp_path} && echo ok"],
                           capture_output=True, text=True, timeout=30)
    if probe.stdout.strip() != "ok":
        pytest.skip(f"cannot mount a tmpfs in a mount namespace here: {probe.stderr.strip()}")
    small = os.path.join(state_dir, "small")   # /var/tmp: the tool uid can traverse it
    os.mkdir(small, 0o755)
    state = os.path.join(small, "state")
    sock = str(tmp_path / "s.sock")
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         f"mount -t tmpfs -o size=2m,mode=0755 tmpfs {small} && exec \"$@\"", "sh",
         stockade, "serve", "--policy", PROCESS_POLICY, "--state-dir", state,
         "--listen", "unix:" + sock],
        stdout=subprocess.DEVNULL, stderr=log, env=clean_env(), start_new_session=True)
    try:
        from stockade_client import Client
        wait_until(lambda: _connectable(sock), 15, "the server listening")
        c = Client.connect_unix(sock, rpc_timeout=30)
        s = c.open_session(session_id="keeper", ttl_ms=600000)
        assert s.call("sh", ["-c", "echo precious > $AGENT_ROOT/workspace/f"]).ok
        # the tool fills the file system (its own write fails at the end: its business)
        s.call("sh", ["-c", "cat /dev/zero > $AGENT_ROOT/workspace/big"])
        with pytest.raises(StockadeError) as ei:
            c.open_session(session_id="more")
        assert ei.value.class_ == "OVERLOADED" and ei.value.retryable, ei.value
        # a renew that cannot rewrite the record still answers; the record is intact
        assert c.renew_session("keeper") > 0
        root = f"/proc/{proc.pid}/root{state}"
        # (the exec'd server is the unshare'd sh: same pid)
        with open(f"{root}/records/keeper") as f:
            text = f.read()
        assert text.startswith("stockade-session-record 1\n") and text.endswith("end\n")
        r = s.call("sh", ["-c", "cat $AGENT_ROOT/workspace/f"])
        assert r.ok and r.stdout == b"precious\n", (r.class_, r.message)
        # space comes back
        assert s.call("sh", ["-c", "rm $AGENT_ROOT/workspace/big"]).ok
        s2 = c.open_session(session_id="more")
        assert s2.call("echo", ["ok"]).ok
        c.close()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.wait(20)
        log.close()
