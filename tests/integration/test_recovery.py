"""Sessions survive the server: durable records, recovery at start, `stockade sessions`.

The server is killed as an operator (or the OOM killer) would: SIGKILL, no goodbye. Then
a new one starts on the same state dir and the tests check what the orchestrator and the
operator see. Every wait is bounded.

    STOCKADE_BIN=$PWD/stockade PYTHONPATH=contrib/python /usr/bin/python3 -m pytest -q \
        -p no:cacheprovider tests/integration/test_recovery.py
"""

import json
import os
import shutil
import signal
import subprocess
import time

import pytest

from serve_helpers import (START_TIMEOUT, assert_marker_gone, clean_env,
                           live_with_marker, sessions_left, wait_until)
from stockade_client import NoSuchSession
from stockade_testlib import cmdline, fixture_levels, state_directory

POLICIES = fixture_levels("recovery")
PROCESS_POLICY, STRICT_POLICY = POLICIES["process"], POLICIES["strict"]





def kill9(srv):
    os.kill(srv.pid, signal.SIGKILL)
    srv.proc.wait(10)


def records_left(state_dir):
    d = os.path.join(state_dir, "records")
    return sorted(n for n in os.listdir(d) if not n.startswith(".")) if os.path.isdir(d) else []


def sessions_cli(stockade, state_dir, *args, check=True):
    cp = subprocess.run([stockade, "sessions", "--state-dir", state_dir, *args],
                        capture_output=True, text=True, timeout=60, env=clean_env())
    if check:
        assert cp.returncode == 0, (args, cp.returncode, cp.stderr)
    return cp


def test_reattach_after_kill9_shows_files(servers, state_dir, level):
    """The issue's scenario: SIGKILL the server while a session has files and a running
    call. Its tools die with it; a new server re-adopts the session, the orchestrator
    reattaches by id and finds its files; opening the id is not 'already exists'."""
    marker = f"stkcrash{os.getpid()}x{time.monotonic_ns()}"
    srv = servers(POLICIES[level])
    c = srv.connect()
    s = c.open_session(session_id="work-1", ttl_ms=600000, labels={"task": "t1"})
    root = s.root
    r = s.call("sh", ["-c", "mkdir -p $AGENT_ROOT/workspace/repo && "
                            "echo edits > $AGENT_ROOT/workspace/repo/file.txt"])
    assert r.ok, (r.class_, r.message, r.stderr)
    running = s.start_call("sh", ["-c", "sleep 60", marker])
    wait_until(lambda: live_with_marker(marker), 10, "the running call's tool")
    kill9(srv)
    c.close(timeout=5)
    # no tool process of the dead server survives
    assert_marker_gone(marker, bound=10)
    assert sessions_left(state_dir) == ["work-1"]
    assert records_left(state_dir) == ["work-1"]

    srv2 = servers(POLICIES[level])
    c2 = srv2.connect()
    s2 = c2.open_session(session_id="work-1")
    assert s2.root == root
    r = s2.call("sh", ["-c", "cat $AGENT_ROOT/workspace/repo/file.txt"])
    assert r.ok and r.stdout == b"edits\n", (r.class_, r.message, r.stderr)
    if level == "strict":
        # its zygote was rebuilt: the call runs in a pid namespace of its own again (its
        # runner's: only its init and the call's own processes are there)
        r = s2.call("sh", ["-c", "echo $$; echo /proc/[0-9]*"])
        assert r.ok, (r.class_, r.message, r.stdout)
        pid, procs = r.stdout.decode().splitlines()
        assert sorted(procs.split()) == sorted({"/proc/1", f"/proc/{pid}"}), r.stdout
    assert c2.stats()["sessions"] == 1
    assert s2.close()["removed"] is True
    assert sessions_left(state_dir) == []
    assert records_left(state_dir) == []
    del running


def test_second_server_on_the_same_state_dir_refused(stockade, servers, state_dir):
    srv = servers()
    cp = subprocess.run([stockade, "serve", "--policy", PROCESS_POLICY, "--state-dir", state_dir,
                         "--listen", "unix:" + srv.sock_path + ".2"],
                        capture_output=True, text=True, timeout=START_TIMEOUT, env=clean_env())
    assert cp.returncode != 0
    lines = cp.stderr.strip().splitlines()
    assert len(lines) == 1, cp.stderr
    assert "in use by another stockade" in lines[0] and f"pid {srv.pid}" in lines[0], lines[0]
    # the first is unaffected
    c = srv.connect()
    assert c.open_session().call("echo", ["still"]).stdout == b"still\n"


def test_session_expired_while_down_is_removed(servers, state_dir):
    srv = servers()
    c = srv.connect()
    s = c.open_session(session_id="short", ttl_ms=500)
    assert s.call("sh", ["-c", "echo x > $AGENT_ROOT/workspace/f"]).ok
    keep = c.open_session(session_id="long", ttl_ms=600000)
    assert keep.call("sh", ["-c", "echo y > $AGENT_ROOT/workspace/f"]).ok
    kill9(srv)
    c.close(timeout=5)
    with open(os.path.join(state_dir, "records", "short")) as f:
        lease_at = int(next(l.split()[1] for l in f if l.startswith("lease_at_ms ")))
    # the recorded lease runs out (a deadline, not a guess)
    wait_until(lambda: time.time() * 1000 > lease_at + 50, 10, "the recorded lease to pass")
    srv2 = servers()
    wait_until(lambda: "short" not in sessions_left(state_dir) and
               "short" not in records_left(state_dir), 15, "the expired session removed")
    assert sessions_left(state_dir) == ["long"] and records_left(state_dir) == ["long"]
    c2 = srv2.connect()
    with pytest.raises(NoSuchSession):
        c2.session("short").call("echo", ["x"])
    r = c2.open_session(session_id="long").call("sh", ["-c", "cat $AGENT_ROOT/workspace/f"])
    assert r.stdout == b"y\n"


def record_lease(state_dir, sid):
    """(lease_at_ms, (inode, mtime)) of a session's record: a rewrite is a new file renamed
    over it."""
    path = os.path.join(state_dir, "records", sid)
    with open(path) as f:
        lease_at = int(next(l.split()[1] for l in f if l.startswith("lease_at_ms ")))
    st = os.stat(path)
    return lease_at, (st.st_ino, st.st_mtime_ns)


def test_record_rewritten_only_when_its_lease_grows(servers, state_dir):
    """A call renews the lease; the record (written and fsynced twice) is rewritten only
    when its recorded lease moves. A lease already at the fuse cannot: no rewrite per call."""
    srv = servers()
    c = srv.connect()
    capped = c.open_session(session_id="capped", ttl_ms=3600000, fuse_ms=600000)
    before = record_lease(state_dir, "capped")
    for _ in range(3):
        assert capped.call("echo", ["x"]).ok
    assert record_lease(state_dir, "capped") == before
    # a lease that can still grow is still persisted, once the renewal passes half a lease
    ttl = 4000
    s = c.open_session(session_id="growing", ttl_ms=ttl)
    lease_at, file = record_lease(state_dir, "growing")
    assert s.call("echo", ["x"]).ok
    assert record_lease(state_dir, "growing") == (lease_at, file)
    wait_until(lambda: time.time() * 1000 > lease_at - ttl + 50, 10, "half a lease to pass")
    assert s.call("echo", ["x"]).ok
    grown, file2 = record_lease(state_dir, "growing")
    assert grown > lease_at and file2 != file


def test_record_without_root_and_root_without_record(stockade, servers, state_dir):
    """The one rule: a record whose root is gone is removed; a root nobody recorded is left
    on disk and reported, and `stockade sessions gc` removes it (not while a server runs)."""
    srv = servers()
    c = srv.connect()
    c.open_session(session_id="rootless", ttl_ms=600000)
    kill9(srv)
    c.close(timeout=5)
    subprocess.run(["rm", "-rf", os.path.join(state_dir, "sessions", "rootless")], check=True)
    os.makedirs(os.path.join(state_dir, "sessions", "stray", "workspace"))
    srv2 = servers()
    srv2.connect().hello()
    assert records_left(state_dir) == []
    assert sessions_left(state_dir) == ["stray"]
    log = srv2.stderr_text()
    assert "rootless has a record and no root" in log, log
    assert "stray has no record" in log, log
    cp = sessions_cli(stockade, state_dir, "gc", check=False)
    assert cp.returncode == 1 and "refused" in cp.stderr and f"pid {srv2.pid}" in cp.stderr
    assert sessions_left(state_dir) == ["stray"]
    srv2.stop()
    out = json.loads(sessions_cli(stockade, state_dir, "--json", "gc").stdout)
    assert out == {"removed": [{"session_id": "stray", "status": "orphan"}]}
    assert sessions_left(state_dir) == []


def test_sessions_cli_with_and_without_a_server(stockade, servers, state_dir):
    srv = servers()
    c = srv.connect()
    s = c.open_session(session_id="ops-1", ttl_ms=600000, labels={"team": "a", "n": "3"})
    assert s.call("sh", ["-c", "echo z > $AGENT_ROOT/workspace/f"]).ok
    listing = json.loads(sessions_cli(stockade, state_dir, "list", "--json").stdout)
    assert listing["server_pid"] == srv.pid
    [e] = listing["sessions"]
    assert e["session_id"] == "ops-1" and e["status"] == "open" and e["root"] == s.root
    rec = e["record"]
    assert rec["owner"] == "serve" and rec["isolation"] == "process" and rec["kept"] is False
    assert rec["labels"] == {"team": "a", "n": "3"}
    assert rec["fuse_at_ms"] >= rec["lease_at_ms"] > time.time() * 1000
    assert c.hello().policy["sha256"] == rec["policy_sha256"]
    shown = json.loads(sessions_cli(stockade, state_dir, "show", "ops-1", "--json").stdout)
    assert shown == e
    text = sessions_cli(stockade, state_dir, "list").stdout
    assert "ops-1" in text and "open" in text
    # a live server owns it: rm refuses, nothing is removed
    cp = sessions_cli(stockade, state_dir, "rm", "ops-1", check=False)
    assert cp.returncode == 1 and "refused" in cp.stderr, cp.stderr
    assert sessions_left(state_dir) == ["ops-1"]
    assert s.call("sh", ["-c", "cat $AGENT_ROOT/workspace/f"]).stdout == b"z\n"
    kill9(srv)
    c.close(timeout=5)
    # no server: rm removes root and record
    assert "removed ops-1" in sessions_cli(stockade, state_dir, "rm", "ops-1").stdout
    assert sessions_left(state_dir) == [] and records_left(state_dir) == []
    cp = sessions_cli(stockade, state_dir, "show", "ops-1", check=False)
    assert cp.returncode == 1 and "no session ops-1" in cp.stderr
    assert sessions_cli(stockade, state_dir, "bogus", check=False).returncode == 125


def test_run_sessions_are_recorded(stockade, run, state_dir):
    """`stockade run --session ID` keeps its root, so its record says kept; a plain run
    leaves neither root nor record."""
    r = run(["--session", "kept-1", "--", "echo", "hi"])
    assert r.returncode == 0, r.stderr
    [e] = json.loads(sessions_cli(stockade, state_dir, "list", "--json").stdout)["sessions"]
    assert e["session_id"] == "kept-1" and e["status"] == "kept"
    assert e["record"]["owner"] == "run"
    assert run(["--", "echo", "hi"]).returncode == 0
    assert records_left(state_dir) == ["kept-1"] and sessions_left(state_dir) == ["kept-1"]
    # gc leaves a kept session; rm removes it
    assert json.loads(sessions_cli(stockade, state_dir, "gc", "--json").stdout) == {"removed": []}
    sessions_cli(stockade, state_dir, "rm", "kept-1")
    assert records_left(state_dir) == [] and sessions_left(state_dir) == []


def test_records_out_of_the_tools_reach(servers, state_dir):
    """A record tells the server whose a root is: no tool may read or plant one."""
    srv = servers()
    s = srv.connect().open_session(session_id="nosy")
    r = s.call("sh", ["-c", f"ls {state_dir}/records; cat {state_dir}/records/nosy; "
                            f"echo owner serve > {state_dir}/records/planted; "
                            f"ls $AGENT_ROOT/../../records"])
    assert b"owner" not in r.stdout and b"nosy" not in r.stdout, r.stdout
    assert not os.path.exists(os.path.join(state_dir, "records", "planted"))


def test_stdio_servers_share_a_state_dir(stockade, state_dir, tmp_path):
    """On stdio the sessions are the server process's own (they end with its
    orchestrator's pipe): several may share a state dir, next to a listening server, and
    what a killed one leaves is `stockade sessions gc`'s once its process is gone."""
    from serve_helpers import ServeProc
    a = ServeProc(stockade, state_dir, PROCESS_POLICY, log_dir=str(tmp_path))
    b = ServeProc(stockade, state_dir, PROCESS_POLICY, log_dir=str(tmp_path))
    try:
        sa = a.client.open_session(session_id="from-a")
        sb = b.client.open_session(session_id="from-b")
        assert sa.call("sh", ["-c", "echo a > $AGENT_ROOT/workspace/f"]).ok
        assert sb.call("echo", ["b"]).ok
        [ea] = [e for e in json.loads(sessions_cli(stockade, state_dir, "list", "--json").stdout)
                ["sessions"] if e["session_id"] == "from-a"]
        assert ea["record"]["owner"] == "stdio" and ea["record"]["pid"] == a.pid
        # a live one's session is not gc's, nor rm's
        assert json.loads(sessions_cli(stockade, state_dir, "gc", "--json").stdout) == \
            {"removed": []}
        cp = sessions_cli(stockade, state_dir, "rm", "from-a", check=False)
        assert cp.returncode == 1 and "still running" in cp.stderr, cp.stderr
        os.kill(a.pid, signal.SIGKILL)
        a.proc.wait(10)
        out = json.loads(sessions_cli(stockade, state_dir, "gc", "--json").stdout)
        assert out == {"removed": [{"session_id": "from-a", "status": "expired"}]}
        assert sessions_left(state_dir) == ["from-b"]
        assert sb.call("echo", ["still"]).stdout == b"still\n"
    finally:
        a.stop()
        b.stop()


def _as_nobody(*argv):
    return ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *argv]


def _pid_free_on_host():
    """A pid no host process has now (the run gets it in its own pid namespace)."""
    with open("/proc/sys/kernel/pid_max") as f:
        pid_max = int(f.read())
    for pid in range(min(pid_max, 32768) - 200, 1000, -97):
        if not os.path.exists(f"/proc/{pid}"):
            return pid
    pytest.skip("no free pid found on the host")


def test_run_in_another_pid_namespace_is_alive_to_gc(stockade):
    """A `stockade run` in a pid namespace of its own records a pid that means nothing on
    the host (here: one no host process has). `stockade sessions gc` from the host must
    still see it alive (its lock, not its pid), leave its root while its tool runs, and
    remove it once the run is killed -9."""
    if os.geteuid() != 0 or not all(shutil.which(c) for c in ("unshare", "setpriv")):
        pytest.skip("needs root, unshare and setpriv (a pid namespace, then uid 65534)")
    probe = subprocess.run(["unshare", "-pf", "--mount-proc", "true"], capture_output=True,
                           timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"no pid namespace here: {probe.stderr.decode(errors='replace').strip()}")
    # the run is given a chosen pid through ns_last_pid (CONFIG_CHECKPOINT_RESTORE)
    if not os.access("/proc/sys/kernel/ns_last_pid", os.W_OK):
        pytest.skip("no writable /proc/sys/kernel/ns_last_pid on this kernel")
    with state_directory("stockade-pidns-") as state_dir:
        os.chown(state_dir, 65534, 65534)
        policy = os.path.join(state_dir, "policy.lua")
        shutil.copy(PROCESS_POLICY, policy)
        os.chmod(policy, 0o644)
        ns_pid = _pid_free_on_host()
        marker = f"{ns_pid}.{os.getpid() % 1000:03d}7"
        run = " ".join(_as_nobody(stockade, "run", "--state-dir", state_dir, "--policy", policy,
                                  "--", "sleep", marker))
        # sh is the namespace's pid 1; the run, its child, gets ns_pid
        script = f"echo {ns_pid - 1} > /proc/sys/kernel/ns_last_pid && {{ {run} & wait $!; }}"
        outer = subprocess.Popen(["unshare", "-pf", "--mount-proc", "sh", "-c", script],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=clean_env())

        def sessions(cmd):     # as the run's user: the state dir's lock is its file
            cp = subprocess.run(_as_nobody(stockade, "sessions", "--state-dir", state_dir,
                                           cmd, "--json"),
                                capture_output=True, text=True, timeout=60, env=clean_env())
            assert cp.returncode == 0, cp.stderr
            return json.loads(cp.stdout)

        def gc():
            return sessions("gc")["removed"]

        def sleeper():
            for p in os.listdir("/proc"):
                argv = cmdline(int(p)).split(b"\0") if p.isdigit() else []
                if len(argv) > 1 and argv[0].endswith(b"sleep") and argv[1] == marker.encode():
                    return int(p)
            return None

        try:
            wait_until(sleeper, START_TIMEOUT, "the run's tool")
            [sid] = records_left(state_dir)
            with open(os.path.join(state_dir, "records", sid)) as f:
                assert f"pid {ns_pid}\n" in f.read()
            assert gc() == []
            assert sessions_left(state_dir) == [sid] and sleeper(), "gc removed a live run's root"
            [e] = sessions("list")["sessions"]
            assert e["status"] == "open", e
            # the run itself (the namespace's second process), by its host pid
            run_pid = next(int(p) for p in os.listdir("/proc") if p.isdigit()
                           and cmdline(int(p)).split(b"\0")[1:4] ==
                           [b"run", b"--state-dir", state_dir.encode()])
            os.kill(run_pid, signal.SIGKILL)
            wait_until(lambda: not sleeper(), 30, "the tool to die with its run")
            assert gc() == [{"session_id": sid, "status": "expired"}]
            assert sessions_left(state_dir) == [] and records_left(state_dir) == []
            assert os.listdir(os.path.join(state_dir, "records")) == [], "a lock file stays"
        finally:
            if outer.poll() is None:
                outer.kill()
            outer.wait(30)
