"""Noisy neighbour: while session A attacks the server, session B calls `true` in a loop
on its own connection, and every one of B's latencies is kept. Whether A can stall the
server shows in B's worst case.

Shared by tests/security/test_liveness.py (B's worst latency under a bound, per attack)
and tests/bench/run.py (B's p50/p99 as a ratio to B alone). Every wait is bounded;
only processes this module starts are signalled, by pid or by their own process group.
"""
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import msgpack

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
POLICY = os.path.join(REPO_ROOT, "tests", "fixtures", "liveness.lua")
_CONTRIB = os.path.join(REPO_ROOT, "contrib", "python")
if _CONTRIB not in sys.path:
    sys.path.insert(0, _CONTRIB)

from stockade_client import Client  # noqa: E402

START_TIMEOUT = 15.0
RPC_TIMEOUT = 180.0         # a stalled server is measured, not given up on


def clean_env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("STOCKADE_") and not k.endswith("_TOKEN")
           and not k.startswith("AWS_")}
    env["STOCKADE_PLUGIN_PATH"] = os.path.join(REPO_ROOT, "plugins")   # the secret set
    return env


class Server:
    """One `stockade serve --listen unix:PATH` in its own process group."""

    def __init__(self, binary, state_dir, policy=POLICY, args=()):
        self.state_dir = state_dir
        self.sock_dir = tempfile.mkdtemp(prefix="stk-noisy-", dir="/var/tmp")
        self.sock_path = os.path.join(self.sock_dir, "s.sock")
        self.log_path = os.path.join(state_dir, f"serve-{id(self):x}.log")
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [binary, "serve", "--policy", policy, "--state-dir", state_dir,
             "--listen", "unix:" + self.sock_path, *args],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self.log,
            env=clean_env(), start_new_session=True)
        self.pid = self.proc.pid
        try:
            self._wait_listening()
        except BaseException:
            self.stop(timeout=5)    # the caller has no object to stop: its socket dir goes
            raise

    def _wait_listening(self):
        end = time.monotonic() + START_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited with {self.proc.returncode}: "
                                   f"{self.stderr_text()[-2000:]}")
            try:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(self.sock_path)
                s.close()
                break
            except OSError:
                s.close()
            if time.monotonic() > end:
                raise RuntimeError(f"serve not listening after {START_TIMEOUT:.0f}s")
            time.sleep(0.05)

    def client(self, rpc_timeout=RPC_TIMEOUT):
        return Client.connect_unix(self.sock_path, rpc_timeout=rpc_timeout)

    def raw(self, rcvbuf=None, timeout=30.0):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if rcvbuf:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        s.settimeout(timeout)
        s.connect(self.sock_path)
        return s

    def stderr_text(self):
        self.log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def stop(self, timeout=60.0):
        """SIGTERM (a drain); SIGKILL to its own process group if it does not exit.
        Returns the exit status, or None when it had to be killed."""
        rc = None
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass
            self.proc.wait(10)
        finally:
            self.log.close()
            shutil.rmtree(self.sock_dir, ignore_errors=True)
        return rc


def raw_request(msgid, method, params=None):
    # params as a bare map: understood by protocol versions 1 and 2
    return msgpack.packb([0, msgid, method, params or {}], use_bin_type=True)


def raw_read_responses(sock, want, bound):
    """Read from a raw socket until `want` responses (msgids) have come, or bound
    seconds; returns {msgid: (error, result)}."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    got = {}
    end = time.monotonic() + bound
    sock.settimeout(1.0)
    while len(got) < want and time.monotonic() < end:
        try:
            data = sock.recv(1 << 16)
        except socket.timeout:
            continue
        except OSError:
            break
        if not data:
            break
        unpacker.feed(data)
        for m in unpacker:
            if isinstance(m, list) and len(m) == 4 and m[0] == 1:
                got[m[1]] = (m[2], m[3])
    return got


def raw_open_session(sock, msgid=1, **params):
    sock.sendall(raw_request(msgid, "session.open", params))
    got = raw_read_responses(sock, 1, 30)
    err, res = got.get(msgid, ("no answer", None))
    if err:
        raise RuntimeError(f"session.open: {err}")
    return res["session_id"]


class Prober:
    """Session B: `true` in a loop on a connection of its own; every latency kept."""

    def __init__(self, server, tool="true"):
        self.client = server.client()
        self.session = self.client.open_session()
        self.tool = tool
        self.lat = []
        self.spans = []             # (start, end) of each call, for net_latencies
        self.bad = []
        self._stop = threading.Event()
        self._t = None
        for _ in range(3):          # warm: the spawner's spares are in use
            self.session.call(tool)

    def start(self):
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                r = self.session.call(self.tool)
                ok, cls = r.ok, r.class_
            except Exception as e:      # a timeout of the client: the worst case
                ok, cls = False, f"{type(e).__name__}: {e}"
            t1 = time.monotonic()
            self.lat.append(t1 - t0)
            self.spans.append((t0, t1))
            if not ok:
                self.bad.append(cls)

    def stop(self, bound=RPC_TIMEOUT + 10):
        self._stop.set()
        if self._t:
            self._t.join(bound)
        return list(self.lat)

    def close(self):
        try:
            self.session.close()
        except Exception:
            pass
        self.client.close()


class HostWatch:
    """The host's own stalls, seen from this process: a thread that sleeps 5 ms at a time
    and keeps every oversleep past 20 ms as (start, end). A loaded machine (the VM paused,
    CPUs or the disk saturated by other work) stalls this thread and B alike; a stalled
    server does not stall this thread."""

    NAP, SLACK = 0.005, 0.020

    def __init__(self):
        self.stalls = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def start(self):
        self._t.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            t = time.monotonic()
            time.sleep(self.NAP)
            late = time.monotonic() - t - self.NAP
            if late > self.SLACK:
                self.stalls.append((t + self.NAP, t + self.NAP + late))

    def stop(self):
        self._stop.set()
        self._t.join(5)
        return list(self.stalls)


class _Endpoint:
    """What a Prober needs of a Server, in a process that does not own the server."""

    def __init__(self, sock_path):
        self.sock_path = sock_path

    def client(self, rpc_timeout=RPC_TIMEOUT):
        return Client.connect_unix(self.sock_path, rpc_timeout=rpc_timeout)


def _probe_cli(sock_path, tool):
    """Session B's process (`noisy.py --probe SOCK TOOL`): the Prober and a HostWatch
    from "ready" on stdout until a line (or EOF) on stdin, then everything as JSON."""
    b = Prober(_Endpoint(sock_path), tool)
    host = HostWatch().start()
    b.start()
    print("ready", flush=True)
    sys.stdin.readline()
    lat = b.stop()
    stalls = host.stop()
    b.close()
    json.dump({"lat": lat, "spans": b.spans, "bad": b.bad, "stalls": stalls}, sys.stdout)


class ProbeProcess:
    """Session B in a process of its own: the attack's own Python work (packing and
    unpacking 20,000 `stats`) would otherwise hold B's thread off the interpreter lock,
    and be counted as the server's. Its HostWatch sees what B's process saw."""

    def __init__(self, server, tool="true"):
        self._proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--probe", server.sock_path, tool],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        ready, _, _ = select.select([self._proc.stdout], [], [], 2 * START_TIMEOUT)
        line = self._proc.stdout.readline() if ready else ""
        if line.strip() != "ready":
            self._end()
            raise RuntimeError(f"session B's process did not start: {line!r} "
                               f"{self._proc.stderr.read()[-2000:]}")

    def _end(self):
        if self._proc.poll() is None:
            self._proc.kill()           # our own child, by pid
        self._proc.wait(10)

    def stop(self):
        """(latencies, spans, failures, host stalls) of B's calls."""
        try:
            out, err = self._proc.communicate("stop\n", timeout=RPC_TIMEOUT + 30)
        except subprocess.TimeoutExpired:
            self._end()
            raise RuntimeError("session B's process did not report") from None
        if self._proc.returncode != 0:
            raise RuntimeError(f"session B's process failed: {err[-2000:]}")
        r = json.loads(out)
        return r["lat"], [tuple(x) for x in r["spans"]], r["bad"], [tuple(x) for x in r["stalls"]]


def net_latencies(spans, stalls):
    """Each call's latency less the host stalls inside it: what the server made B wait."""
    out = []
    for t0, t1 in spans:
        host = sum(max(0.0, min(t1, e) - max(t0, s)) for s, e in stalls)
        out.append(max(0.0, (t1 - t0) - host))
    return out


def quantile(xs, q):
    s = sorted(xs)
    if not s:
        return float("nan")
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


# ---------------------------------------------------------------- the attacks
#
# Each is a class with prepare() (not measured: building the tree, connecting) and
# strike() (measured: B runs meanwhile), then cleanup(). strike() returns facts the
# test may check (that the attack really happened).


class Attack:
    name = "?"

    def __init__(self, server):
        self.server = server

    def prepare(self):
        pass

    def strike(self):
        return {}

    def cleanup(self):
        pass


class TreeAtClose(Attack):
    """A session whose tool left `entries` files (or empty dirs) behind, then closed."""
    name = "tree_at_close"

    def __init__(self, server, entries=100_000, dirs_only=False):
        super().__init__(server)
        self.entries = entries
        self.dirs_only = dirs_only

    def prepare(self):
        self.client = self.server.client()
        self.session = self.client.open_session()
        if self.dirs_only:
            script = f"import os\nfor i in range({self.entries}): os.mkdir('e%d' % i)\n"
        else:
            per = 1000
            script = ("import os\n"
                      f"for d in range({(self.entries + per - 1) // per}):\n"
                      "    os.mkdir('d%d' % d)\n"
                      f"    for f in range({per}):\n"
                      "        open('d%d/f%d' % (d, f), 'w').close()\n")
        r = self.session.call("python3", ["-c", script])
        if not r.ok:
            raise RuntimeError(f"making the tree: {r.class_} {r.message} {r.stderr[-500:]!r}")
        self.root = self.session.root

    def strike(self):
        res = self.client.close_session(self.session.session_id)
        return {"close": res, "root_gone_at_answer": not os.path.exists(self.root)}

    def cleanup(self):
        self.client.close()


class StreamFloodStalled(Attack):
    """A streamed flood whose client stops reading, then goes away."""
    name = "stream_flood_stalled"

    def __init__(self, server, seconds=3.0, calls=1):
        super().__init__(server)
        self.seconds = seconds
        self.calls = calls

    def prepare(self):
        self.sock = self.server.raw(rcvbuf=4096)
        self.sid = raw_open_session(self.sock)

    def strike(self):
        for i in range(self.calls):
            self.sock.sendall(raw_request(10 + i, "call", {
                "session_id": self.sid, "tool": "sh", "stream": True,
                "argv": ["-c", "head -c 200000000 /dev/zero"]}))
        time.sleep(self.seconds)        # the attack is the stall itself
        self.sock.close()
        return {}


class ForkBomb(Attack):
    name = "fork_bomb"

    def prepare(self):
        self.client = self.server.client()
        self.session = self.client.open_session()

    def strike(self):
        r = self.session.call("sh", ["-c", "f(){ f | f & }; f; sleep 10"], timeout_ms=4000)
        return {"class": r.class_}

    def cleanup(self):
        try:
            self.session.close()
        finally:
            self.client.close()


class StatsFlood(Attack):
    """Pipelined `stats`, 5,000 per write, everything read back."""
    name = "stats_flood"

    def __init__(self, server, total=20_000):
        super().__init__(server)
        self.total = total

    def prepare(self):
        self.sock = self.server.raw()

    def strike(self):
        got = {}
        reader = threading.Thread(
            target=lambda: got.update(raw_read_responses(self.sock, self.total, 120)),
            daemon=True)
        reader.start()
        batch = 5000
        for start in range(0, self.total, batch):
            self.sock.sendall(b"".join(raw_request(i + 1, "stats")
                                       for i in range(start, min(start + batch, self.total))))
        reader.join(130)
        return {"answered": len(got)}

    def cleanup(self):
        self.sock.close()


class HookFlood(Attack):
    """Pipelined calls of a tool whose accept hook loops until its budget is spent."""
    name = "hostile_hook"

    def __init__(self, server, calls=40):
        super().__init__(server)
        self.calls = calls

    def prepare(self):
        self.sock = self.server.raw()
        self.sid = raw_open_session(self.sock)

    def strike(self):
        self.sock.sendall(b"".join(raw_request(100 + i, "call", {
            "session_id": self.sid, "tool": "hookloop"}) for i in range(self.calls)))
        got = raw_read_responses(self.sock, self.calls, 120)
        return {"answered": len(got),
                "classes": sorted({(r or {}).get("class", "?") for _, r in got.values()})}

    def cleanup(self):
        self.sock.close()


class RedactionHeavy(Attack):
    """1 MiB of output dense with a secret's prefix and no newline (issue 14, item 1)."""
    name = "redaction_heavy"

    def prepare(self):
        self.client = self.server.client()
        self.session = self.client.open_session()

    def strike(self):
        script = "import sys; sys.stdout.write(('eyJ' + 'a' * 16381) * 64)"
        r = self.session.call("python3", ["-c", script])
        return {"class": r.class_, "redactions": r.redactions}

    def cleanup(self):
        try:
            self.session.close()
        finally:
            self.client.close()


ATTACKS = {a.name: a for a in (RedactionHeavy, TreeAtClose, StreamFloodStalled, ForkBomb,
                               StatsFlood, HookFlood)}


def measure(server, attack_cls, **kw):
    """Run one attack while B probes from a process of its own; returns (B's latencies
    in seconds, B's failures, the attack's facts). The facts also hold the host's stalls
    B's process saw meanwhile (HostWatch) and B's latencies net of them (b_net)."""
    attack = attack_cls(server, **kw)
    attack.prepare()
    try:
        b = ProbeProcess(server)
    except Exception:
        attack.cleanup()
        raise
    try:
        time.sleep(0.3)             # B is in its loop before the strike
        facts = attack.strike()
        time.sleep(0.3)
    finally:
        try:
            lat, spans, bad, stalls = b.stop()
        finally:
            attack.cleanup()
    facts = dict(facts or {})
    facts["host_stalls"] = stalls
    facts["b_net"] = net_latencies(spans, stalls)
    return lat, bad, facts


def alone(server, seconds=3.0):
    """B's latencies with nothing else going on (B in its own process, as in measure)."""
    b = ProbeProcess(server)
    time.sleep(seconds)
    return b.stop()[0]


if __name__ == "__main__" and sys.argv[1:2] == ["--probe"]:
    _probe_cli(sys.argv[2], sys.argv[3])
