"""Chaos: SIGKILL the server at random points of session.open, call, session.close,
expiry and policy reload, restart it on the same state dir, and check what must hold
whatever the instant:

- no process of the dead server survives (found by a marker in their command line: the
  test's state dir is in the server's argv, which its helpers inherit, and each tool
  gets it as its $0; only those are killed, by pid);
- every root has a record the moment the server dies (a record is written first and
  removed last); after the restart, roots and records are the same set (the rest is
  cleaned by the rule);
- no service uid is recorded for two sessions;
- no live session's data is removed: every session whose open was answered and whose
  close was not is there, and every file a call that was answered wrote is in it;
- reattach works for every live session.

Bounded: a fixed number of iterations per level, each with bounded waits, and a time
budget per level (the test reports how many ran).

    STOCKADE_BIN=$PWD/stockade PYTHONPATH=contrib/python /usr/bin/python3 -m pytest -q \
        -p no:cacheprovider tests/integration/test_chaos.py -s
"""

import os
import random
import signal
import socket
import subprocess
import threading
import time

import pytest

from serve_helpers import assert_marker_gone, clean_env, sessions_left, wait_until
from stockade_client import Client, StockadeError
from stockade_testlib import fixture_levels

POLICIES = fixture_levels("recovery")
ITERATIONS = {"process": 150, "strict": 100}
BUDGET_S = {"process": 50.0, "strict": 50.0}
MIN_ITERATIONS = 30                 # under heavy load the budget may end it early
LIVE_MAX = 4                        # live sessions kept across iterations
LONG_TTL_MS = 600000
SCENARIOS = ["open", "call", "close", "expiry", "reload"]



def records_left(state_dir):
    d = os.path.join(state_dir, "records")
    return sorted(n for n in os.listdir(d) if not n.startswith(".")) if os.path.isdir(d) else []


def record_field(state_dir, sid, key):
    try:
        with open(os.path.join(state_dir, "records", sid)) as f:
            for line in f:
                k, _, v = line.rstrip("\n").partition(" ")
                if k == key:
                    return v
    except FileNotFoundError:
        return None
    return None


class Server:
    """One `stockade serve` on the state dir; started and waited for without the 50 ms
    polls of ServeProc (a few hundred starts add up)."""

    def __init__(self, stockade, state_dir, policy, sock, log):
        self.sock = sock
        self.proc = subprocess.Popen(
            [stockade, "serve", "--policy", policy, "--state-dir", state_dir,
             "--listen", "unix:" + sock],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log, env=clean_env(),
            start_new_session=True)
        end = time.monotonic() + 15
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"serve exited {self.proc.returncode} at start")
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(sock)
                break
            except OSError:
                if time.monotonic() > end:
                    pytest.fail("serve not listening after 15s")
                time.sleep(0.005)
            finally:
                s.close()
        self.client = Client.connect_unix(sock, rpc_timeout=30)

    def kill(self):
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self.client.close(timeout=5)


def in_thread(fn):
    """Run fn in a thread (its outcome, or the exception it raised, in .result)."""
    box = {}

    def run():
        try:
            box["ok"] = fn()
        except Exception as e:     # noqa: BLE001 - any outcome is recorded
            box["err"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.box = box
    return t


class Model:
    """What the orchestrator knows for sure, and what it cannot know (a request in flight
    when the server died)."""

    def __init__(self):
        self.live = {}          # id -> {filename: content}, open answered, close not
        self.uncertain = set()  # open or close in flight at the kill
        self.expiring = set()   # opened with a short lease and left alone
        self.seq = 0

    def new_id(self, kind):
        self.seq += 1
        return f"{kind}-{self.seq}"


def write_file(client, sid, name, content, marker):
    r = client.session(sid).call("sh", ["-c", f"printf %s {content} > $AGENT_ROOT/workspace/{name}",
                                        marker])
    return r.ok


def chaos_iteration(rnd, srv, model, level, marker, state_dir):
    c = srv.client
    # a little settled work first: answered, so certain
    if len(model.live) < LIVE_MAX:
        sid = model.new_id("s")
        c.open_session(session_id=sid, ttl_ms=LONG_TTL_MS)
        model.live[sid] = {}
    sid = rnd.choice(sorted(model.live))
    name = f"f{model.seq}"
    model.seq += 1
    if write_file(c, sid, name, name, marker):
        model.live[sid][name] = name

    scenario = rnd.choice(SCENARIOS)
    threads = []
    if scenario == "open":
        new = model.new_id("o")
        model.uncertain.add(new)
        threads.append(in_thread(lambda: c.open_session(session_id=new, ttl_ms=LONG_TTL_MS)))
    elif scenario == "call":
        target = rnd.choice(sorted(model.live))
        # a running call, and a write whose answer may or may not come
        threads.append(in_thread(lambda: c.session(target).call(
            "sh", ["-c", "sleep 5; true", marker])))
        threads.append(in_thread(lambda: write_file(c, target, "inflight", "x", marker)))
    elif scenario == "close" and model.live:
        target = rnd.choice(sorted(model.live))
        del model.live[target]
        model.uncertain.add(target)
        threads.append(in_thread(lambda: c.close_session(target)))
    elif scenario == "expiry":
        exp = model.new_id("e")
        try:
            c.open_session(session_id=exp, ttl_ms=rnd.choice([20, 50, 100]))
            model.expiring.add(exp)
        except StockadeError:
            pass
        time.sleep(rnd.uniform(0, 0.15))
    elif scenario == "reload":
        if rnd.random() < 0.5:
            os.kill(srv.proc.pid, signal.SIGHUP)
        else:
            threads.append(in_thread(lambda: c.request("policy.reload", {})))
    time.sleep(rnd.uniform(0, 0.03))
    srv.kill()
    for t in threads:
        t.join(10)
        assert not t.is_alive(), "a request outlived the connection"
    # settle what the answers told
    if scenario == "open" and "ok" in threads[0].box:
        model.uncertain.discard(new)
        model.live[new] = {}
    if scenario == "close" and threads and "ok" in threads[0].box:
        model.uncertain.discard(target)
    return scenario


def check_dead(state_dir, marker, model):
    """Returns the recorded leases of the short-lived sessions, as the crash left them."""
    # no process of the dead server survives it: helpers, shims, tools
    assert_marker_gone(marker, bound=10)
    roots, records = set(sessions_left(state_dir)), set(records_left(state_dir))
    assert roots <= records, f"roots without a record: {sorted(roots - records)}"
    leases = {}
    for sid in model.expiring:
        lease = record_field(state_dir, sid, "lease_at_ms")
        if lease is not None:
            leases[sid] = int(lease)
    return leases


def check_restarted(srv, model, state_dir, leases_at_death, started_ms):
    c = srv.client
    # the recovery's removals run in a child: wait for them (bounded)
    wait_until(lambda: set(sessions_left(state_dir)) == set(records_left(state_dir)), 15,
               "roots and records the same set after the restart")
    uids = {}
    for sid in records_left(state_dir):
        if record_field(state_dir, sid, "service_uid") == "1":
            uid = record_field(state_dir, sid, "uid")
            assert uid not in uids, f"uid {uid} recorded for {uids.get(uid)} and {sid}"
            uids[uid] = sid
    # a lease that had run out when the server started: removed by the recovery
    for sid, lease in leases_at_death.items():
        if lease <= started_ms:
            wait_until(lambda: sid not in records_left(state_dir), 15,
                       f"session {sid}, expired while no server ran, removed")
    model.expiring = {sid for sid in model.expiring if sid in records_left(state_dir)}
    for sid, files in model.live.items():
        assert sid in records_left(state_dir), f"live session {sid} lost"
        s = c.open_session(session_id=sid)     # reattach
        assert s.root == os.path.join(state_dir, "sessions", sid)
        if files:
            names = sorted(files)
            r = s.call("sh", ["-c", "cd $AGENT_ROOT/workspace && for f in " + " ".join(names) +
                              "; do cat $f; echo; done"])
            assert r.ok, (sid, r.class_, r.message, r.stderr)
            assert r.stdout.decode().split("\n")[:-1] == [files[n] for n in names], sid
    for sid in list(model.uncertain):
        if sid in records_left(state_dir):
            c.renew_session(sid)                # it was adopted: reattach works
            model.live[sid] = {}
        model.uncertain.discard(sid)
    # keep the number of live sessions bounded: close some, for real
    while len(model.live) > LIVE_MAX:
        sid = sorted(model.live)[0]
        assert c.close_session(sid)["removed"] is True
        del model.live[sid]
        assert sid not in sessions_left(state_dir) and sid not in records_left(state_dir)


@pytest.mark.parametrize("level", ["process", "strict"])
def test_chaos_kill9_anywhere(stockade, state_dir, tmp_path, level, strict_available):
    if level == "strict" and not strict_available:
        pytest.skip("this host cannot give strict isolation (stockade doctor)")
    rnd = random.Random(int(os.environ.get("STOCKADE_CHAOS_SEED", "1717")) + len(level))
    marker = state_dir                  # in the server's argv, so in its helpers' too
    sock = str(tmp_path / "s.sock")
    log = open(tmp_path / "serve.log", "ab")
    model = Model()
    counts = {s: 0 for s in SCENARIOS}
    start = time.monotonic()
    done = 0
    srv = None
    try:
        srv = Server(stockade, state_dir, POLICIES[level], sock, log)
        for done in range(1, ITERATIONS[level] + 1):
            counts[chaos_iteration(rnd, srv, model, level, marker, state_dir)] += 1
            leases = check_dead(state_dir, marker, model)
            started_ms = time.time() * 1000
            srv = Server(stockade, state_dir, POLICIES[level], sock, log)
            check_restarted(srv, model, state_dir, leases, started_ms)
            if time.monotonic() - start > BUDGET_S[level]:
                break
        srv.kill()
        check_dead(state_dir, marker, model)
    finally:
        if srv and srv.proc.poll() is None:
            srv.kill()
        log.close()
    print(f"chaos {level}: {done} iterations in {time.monotonic() - start:.1f}s, {counts}")
    assert done >= MIN_ITERATIONS, f"only {done} iterations within the budget"
