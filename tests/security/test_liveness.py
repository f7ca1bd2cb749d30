"""One call, one client or one session can never stall the server (issue 14).

Work proportional to what a tool, a client or a policy controls must not run unbounded
in the event loop. Each test below attacks `stockade serve` for real, bounded in time
and count, and checks what the other side sees: another session's trivial calls keep
answering (B's worst latency stays under a bound), wedged calls end, roots go, the
server drains. Speed figures are `make bench`'s business (tests/bench/run.py), never
asserted here.

    STOCKADE_BIN=$PWD/stockade PYTHONPATH=contrib/python \\
        /usr/bin/python3 -m pytest -q -p no:cacheprovider tests/security/test_liveness.py
"""
import os
import signal
import socket
import sys
import threading
import time

import msgpack
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "bench"))

import noisy  # noqa: E402
from serve_helpers import assert_no_sanitizer_reports, live_with_marker, stop_all  # noqa: E402
from noisy import (ATTACKS, Server, measure, raw_open_session, raw_read_responses,  # noqa: E402
                   raw_request)

# B's worst latency under any attack: a bound, not a speed target (B alone answers in a
# few milliseconds; the stalls this file guards against lasted seconds). The sanitized
# build runs the server two to three times slower, so its bound is twice as wide.
B_BOUND = 2.0 if os.environ.get("STOCKADE_SANITIZED") else 1.0
WAIT = 60.0


def until(pred, bound, what, step=0.05):
    end = time.monotonic() + bound
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > end:
            pytest.fail(f"timed out after {bound:.0f}s waiting for {what}")
        time.sleep(step)


@pytest.fixture
def serve(stockade, state_dir):
    made = []

    def _new(*args, policy=noisy.POLICY):
        s = Server(stockade, state_dir, policy=policy, args=args)
        made.append(s)
        return s
    yield _new
    stop_all(made)
    for s in made:              # the verdicts once none is left running
        assert_no_sanitizer_reports(s.log_path)


def stats(server):
    c = server.client(rpc_timeout=60)
    try:
        return c.stats()
    finally:
        c.close()


def worst(lat):
    return max(lat) if lat else float("inf")


# ---------------------------------------------------------------- noisy neighbour


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_noisy_neighbour(serve, attack):
    """While session A runs the attack, session B's `true` stays under the bound."""
    srv = serve()
    lat, bad, facts = measure(srv, ATTACKS[attack])
    net, stalls = facts.pop("b_net"), facts.pop("host_stalls")
    host = f"host stalls {len(stalls)}, longest {max([e - s for s, e in stalls] or [0]):.2f}s"
    print(f"{attack}: B n={len(lat)} worst={worst(lat) * 1000:.0f} ms, "
          f"net of the host's stalls {worst(net) * 1000:.0f} ms; {host}; facts={facts}")
    assert len(lat) >= 3, f"B hardly ran during the attack: {lat}"
    assert not bad, f"B's calls failed during {attack}: {bad[:5]}"
    # What the server made B wait: a machine that stalls every process (a loaded shared
    # VM) stalls B too, and that part is not the server's. A server that stalls does
    # not stall the watch thread, so its stall stays in B's net latency.
    assert worst(net) < B_BOUND, \
        f"{attack}: B waited {worst(net):.2f}s net (raw {worst(lat):.2f}s, {host}; " \
        f"bound {B_BOUND}s); {facts}"
    if attack == "tree_at_close":
        assert facts["close"]["removed"] is True and facts["root_gone_at_answer"], facts
    if attack == "stats_flood":
        assert facts["answered"] == 20_000, facts
    if attack == "hostile_hook":
        assert facts["answered"] == 40 and facts["classes"] == ["POLICY_VIOLATION"], facts
    assert srv.proc.poll() is None


# ---------------------------------------------------------------- item 2: root removal


def test_close_of_a_huge_root_answers_when_it_is_gone(serve, state_dir):
    """Tens of thousands of empty dirs: the removal runs off the loop, B keeps its
    latency, and the close answer comes once the root is really gone."""
    srv = serve()
    lat, bad, facts = measure(srv, noisy.TreeAtClose, entries=30_000, dirs_only=True)
    net = facts.pop("b_net")
    print(f"B n={len(lat)} worst={worst(lat) * 1000:.0f} ms, net {worst(net) * 1000:.0f} ms")
    assert facts["close"]["removed"] is True and facts["root_gone_at_answer"], facts
    assert not bad and worst(net) < B_BOUND, (worst(net), worst(lat), bad[:5])
    assert len(lat) >= 3
    until(lambda: not os.listdir(os.path.join(state_dir, "sessions")), 10, "no root left")


def test_lease_expiry_removes_a_huge_root_off_the_loop(serve, state_dir):
    srv = serve()
    a = srv.client()
    s = a.open_session(ttl_ms=1500)
    r = s.call("python3", ["-c", "import os\nfor i in range(30000): os.mkdir('e%d' % i)"])
    assert r.ok, r
    expired = threading.Event()
    a.subscribe(lambda m, p: expired.set() if m == "session.expired" else None)
    b = noisy.Prober(srv).start()
    try:
        assert expired.wait(WAIT), "the lease never ran out"
        until(lambda: not os.path.exists(s.root), 120, "the expired root removed")
        time.sleep(0.2)
    finally:
        lat = b.stop()
        b.close()
        a.close()
    print(f"B n={len(lat)} worst={worst(lat) * 1000:.0f} ms")
    assert not b.bad and worst(lat) < B_BOUND, (worst(lat), b.bad[:5])


# ---------------------------------------------------------------- item 4: wedged calls


def test_stalled_stream_then_disconnect_is_freed(serve, state_dir):
    """A streamed flood whose client stops reading and then disconnects: the call ends
    and is freed, the session's lease runs out, its root goes, SIGTERM drains."""
    srv = serve()
    sock = srv.raw(rcvbuf=4096)
    sid = raw_open_session(sock, ttl_ms=1000)
    sock.sendall(raw_request(2, "call", {"session_id": sid, "tool": "sh", "stream": True,
                                         "argv": ["-c", "head -c 50000000 /dev/zero"]}))
    until(lambda: stats(srv)["running"] == 1, 20, "the flood running")
    time.sleep(1.0)                 # it fills the socket and the write queue
    sock.close()
    until(lambda: stats(srv)["running"] == 0, 20, "the wedged call answered and freed")
    until(lambda: not os.path.exists(os.path.join(state_dir, "sessions", sid)), 20,
          "the session's lease to run out and its root to go")
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    try:
        rc = srv.proc.wait(20)
    except Exception:
        pytest.fail("SIGTERM did not drain the server within 20s")
    assert rc == 0, rc
    print(f"drained in {time.monotonic() - t0:.2f}s")


def test_stalled_stream_on_stdio_then_sigterm_drains(stockade, state_dir):
    """Stdio: the orchestrator stops reading a streamed call; SIGTERM still drains."""
    import subprocess
    log = open(os.path.join(state_dir, "serve.log"), "wb")
    proc = subprocess.Popen([stockade, "serve", "--policy", noisy.POLICY, "--state-dir",
                             state_dir], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=log, env=noisy.clean_env(), start_new_session=True)
    try:
        proc.stdin.write(raw_request(1, "session.open", {}))
        proc.stdin.flush()
        unp = msgpack.Unpacker(raw=False)
        sid = None
        end = time.monotonic() + 20
        while sid is None and time.monotonic() < end:
            unp.feed(os.read(proc.stdout.fileno(), 65536))
            for m in unp:
                if m[0] == 1 and m[1] == 1:
                    sid = m[3]["session_id"]
        assert sid
        mark = f"flood-{os.getpid()}-{time.monotonic_ns()}"
        proc.stdin.write(raw_request(2, "call", {"session_id": sid, "tool": "sh",
                                                 "stream": True,
                                                 "argv": ["-c", "head -c 50000000 /dev/zero",
                                                          mark]}))
        proc.stdin.flush()
        until(lambda: live_with_marker(mark), 20, "the flood running")
        time.sleep(1.5)             # nothing read: the server is over its high water
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            pytest.fail("SIGTERM did not drain a server whose client stopped reading")
        assert not os.path.exists(os.path.join(state_dir, "sessions", sid))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()


def test_plain_call_behind_the_high_water_mark_is_answered(serve):
    """10,700 pipelined stats put the connection over its write high-water mark; a plain
    call dispatched then is answered once the client reads everything."""
    srv = serve()
    sock = srv.raw()
    sid = raw_open_session(sock)
    n = 10_700
    payload = b"".join(raw_request(10 + i, "stats") for i in range(n))
    payload += raw_request(5, "call", {"session_id": sid, "tool": "true"})
    sender = threading.Thread(target=sock.sendall, args=(payload,), daemon=True)
    sender.start()
    got = raw_read_responses(sock, n + 1, 120)
    sender.join(5)
    assert 5 in got, f"the call was never answered ({len(got)} responses read)"
    err, res = got[5]
    assert err is None and res["class"] == "OK", got[5]
    sock.close()


# ---------------------------------------------------------------- item 5: shares


def test_one_client_cannot_hold_every_slot(serve):
    """A client starts as many streamed floods as the server runs at once and stops
    reading: another client's call still runs."""
    srv = serve()
    limit = 16                      # liveness.lua: running = 16
    sock = srv.raw(rcvbuf=4096)
    sid = raw_open_session(sock)
    sock.sendall(b"".join(raw_request(10 + i, "call", {
        "session_id": sid, "tool": "sh", "stream": True,
        "argv": ["-c", "head -c 200000000 /dev/zero"]}) for i in range(limit)))
    # the hog holds every slot it can: a listening server's share for one connection is
    # all but a quarter of them (server.c); the rest of its calls are refused
    share = limit - limit // 4
    until(lambda: stats(srv)["running"] == share, 20, "the hog's calls running, its whole share")
    c = srv.client(rpc_timeout=30)
    s = c.open_session()
    r = s.call("true")
    assert r.ok, f"another client's call: {r.class_} {r.message}"
    s.close()
    c.close()
    sock.close()
    until(lambda: stats(srv)["running"] == 0, 30, "the hog's calls freed")


def test_slow_reader_is_disconnected(serve):
    """A client that stops reading its output is dropped after the slow-reader timeout,
    and its calls are freed."""
    srv = serve("--slow-reader", "2s")
    sock = srv.raw(rcvbuf=4096)
    sid = raw_open_session(sock)
    sock.sendall(raw_request(2, "call", {"session_id": sid, "tool": "sh", "stream": True,
                                         "argv": ["-c", "head -c 200000000 /dev/zero"]}))
    until(lambda: stats(srv)["running"] == 1, 20, "the flood running")
    until(lambda: stats(srv)["running"] == 0, 30, "the slow reader dropped, its call freed")
    # the server closed its end: reading drains what was queued, then EOF
    sock.settimeout(1.0)
    end = time.monotonic() + 30
    while time.monotonic() < end:
        try:
            if not sock.recv(1 << 20):
                break
        except socket.timeout:
            continue
        except OSError:
            break
    else:
        pytest.fail("the slow reader's connection was not closed")
    sock.close()


def _rss_kb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def test_unfinished_frames_have_a_memory_bound(serve):
    """20 clients each send 15 MiB of a 16 MiB frame and stall: the server's memory for
    unfinished frames is bounded (it was 320 MiB)."""
    srv = serve()
    s0 = stats(srv)
    base = _rss_kb(srv.pid)
    head = b"\x94\x00\x01\xa4call\x81\xa5stdin\xc6" + (16 * (1 << 20) - 64).to_bytes(4, "big")
    chunk = b"\0" * (1 << 20)
    socks = []
    peak = base
    try:
        for _ in range(20):
            s = srv.raw()
            s.settimeout(5)
            try:
                s.sendall(head)
                for _ in range(15):
                    s.sendall(chunk)
            except OSError:
                pass                # dropped or not read: either is bounded
            socks.append(s)
            peak = max(peak, _rss_kb(srv.pid))
        time.sleep(0.5)
        peak = max(peak, _rss_kb(srv.pid))
    finally:
        for s in socks:
            s.close()
    print(f"RSS {base} KiB -> peak {peak} KiB; sessions {s0['sessions']}")
    # ASan's shadow and its quarantine of freed blocks add to what a build holds
    bound = 120 * 1024 * (3 if os.environ.get("STOCKADE_SANITIZED") else 1)
    assert peak - base < bound, f"unfinished frames took {(peak - base) >> 10} MiB"
    assert srv.proc.poll() is None
    assert noisy.Prober(srv).session.call("true").ok


# ---------------------------------------------------------------- item 6: clocks


def test_timeout_is_armed_on_a_fresh_clock(serve):
    """A call dispatched after a long stretch of other work in the same read (4,800
    `stats` and 100 calls whose hook loops to its budget) gets its whole timeout."""
    srv = serve()
    sock = srv.raw()
    sid = raw_open_session(sock)
    n = 4800
    payload = b"".join(raw_request(10 + i, "stats") for i in range(n))
    payload += b"".join(raw_request(20000 + i, "call", {"session_id": sid, "tool": "hookloop"})
                        for i in range(100))
    payload += raw_request(5, "call", {"session_id": sid, "tool": "sh", "timeout_ms": 1500,
                                       "argv": ["-c", "sleep 0.5"]})
    assert len(payload) < 65536     # one read of the server's
    t0 = time.monotonic()
    threading.Thread(target=sock.sendall, args=(payload,), daemon=True).start()
    got = raw_read_responses(sock, n + 101, 120)
    print(f"{len(got)} answers in {time.monotonic() - t0:.2f}s")
    err, res = got.get(5, ("no answer", None))
    assert err is None and res["class"] == "OK", (err, res and res["message"])
    sock.close()


def test_completion_wins_over_a_timeout_processed_late(serve):
    """After the server was stopped (SIGSTOP) past its calls' timeouts, tools that
    exited in time are OK, not TOOL_TIMEOUT."""
    srv = serve()
    c = srv.client(rpc_timeout=60)
    s = c.open_session()
    s.call("true")
    handles = [s.start_call("sh", ["-c", ': > "$AGENT_ROOT/workspace/started.$$"; sleep 0.3'],
                            timeout_ms=2000) for _ in range(6)]
    # every tool runs (its timer armed) before the server stops: none starts after
    workspace = os.path.join(s.root, "workspace")
    until(lambda: len([f for f in os.listdir(workspace) if f.startswith("started.")]) == 6,
          20, "the six tools started")
    os.kill(srv.pid, signal.SIGSTOP)
    try:
        time.sleep(3.5)
    finally:
        os.kill(srv.pid, signal.SIGCONT)
    results = [h.result(60) for h in handles]
    classes = [r.class_ for r in results]
    assert classes == ["OK"] * 6, [(r.class_, r.message) for r in results]
    s.close()
    c.close()


# ---------------------------------------------------------------- item 8: strict opens


def strict_policy(state_dir):
    """liveness.lua at the strict level, with room for 320 sessions."""
    with open(noisy.POLICY, encoding="utf-8") as f:
        text = f.read()
    for old, new in (('name = "liveness"', 'name = "liveness-strict"'),
                     ('isolation = "process"', 'isolation = "strict"'),
                     ("sessions = 32,", "sessions = 320,")):
        assert old in text, old
        text = text.replace(old, new)
    path = os.path.join(state_dir, "liveness_strict.lua")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def test_strict_opens_do_not_block_the_loop(serve, stockade, state_dir):
    """300 strict session.open at once (each builds a zygote's namespaces and mount tree,
    tens of milliseconds): another session's calls keep their latency, and every open
    is answered with a session whose calls run."""
    import subprocess
    doctor = subprocess.run([stockade, "doctor"], capture_output=True, text=True, timeout=60)
    if doctor.returncode != 0 or "isolation strict:  available" not in doctor.stdout:
        pytest.skip(f"strict isolation unavailable here: {doctor.stdout[-300:]}")
    srv = serve(policy=strict_policy(state_dir))
    b = noisy.Prober(srv).start()
    sock = srv.raw()
    try:
        time.sleep(0.3)
        n = 300
        sock.sendall(b"".join(raw_request(100 + i, "session.open", {}) for i in range(n)))
        got = raw_read_responses(sock, n, 120)
        time.sleep(0.3)
    finally:
        lat = b.stop()
        b.close()
    print(f"B n={len(lat)} worst={worst(lat) * 1000:.0f} ms")
    assert len(got) == n and all(err is None for err, _ in got.values()), \
        [err for err, _ in got.values() if err][:3]
    sid = got[100][1]["session_id"]
    sock.sendall(raw_request(1, "call", {"session_id": sid, "tool": "true"}))
    err, res = raw_read_responses(sock, 1, 60).get(1, ("no answer", None))
    assert err is None and res["class"] == "OK", (err, res)
    sock.close()
    assert not b.bad and worst(lat) < B_BOUND, (worst(lat), b.bad[:5])
