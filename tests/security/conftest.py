"""Fixtures for the security battery: honest escape attempts against `stockade run`.

    cd /work/main && STOCKADE_BIN=$PWD/stockade PYTHONPATH=contrib/python \\
        /usr/bin/python3 -m pytest -q -p no:cacheprovider tests/security

Every test is parametrized over the two isolation levels (`level`): `strict`
(namespaces, read-only host, Landlock, seccomp) and `process` (uid, Landlock, seccomp,
rlimits), both with tests/fixtures/sec_process.lua (the strict one derived from it).

Ground rules the fixtures enforce:
- everything a test creates on the host (files, dirs, netns, veth, cgroups, listeners,
  processes) is registered here and removed by a finalizer, also when the test fails;
- only processes we started are ended, by pid: our own children, or processes that carry
  a random marker we put on their command line, or processes of the per-session uid a
  call of ours reported (no one else runs as it);
- bombs are bounded twice: by the policy under test (sec_bomb_*.lua) and by a harness
  limit that does not depend on stockade (a pids cgroup, a wall clock).

What the suites share (paths, the binary, state directories, /proc) comes from
tests/stockade_testlib.py; this file must not import tests/integration/conftest.py: both
are named `conftest` and pytest must not confuse them.
"""

import contextlib
import errno
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time

import pytest

from stockade_testlib import (FIXTURES, alive, all_pids, cmdline, fixture_levels,  # noqa: F401
                              force_rmtree, kill_pids, live_with_marker, marker, proc_stat,
                              state_directory, stockade)

HERE = os.path.dirname(os.path.abspath(__file__))

LEVELS = ("strict", "process")
POLICIES = fixture_levels("sec")
BOMB_POLICIES = fixture_levels("sec_bomb")

RUN_TIMEOUT = 40.0          # one `stockade run`, worst case, before the test calls it hung
NOBODY = 65534              # the unprivileged uid of the host-side controls
IS_ROOT = os.geteuid() == 0

# Base of host directories the tool should NOT see or write, chosen outside every place
# the strict mount tree replaces (/tmp, /var/tmp, /home, /root, /run, /mnt, /media), so
# that under strict only the read-only bind of the host tree and Landlock stand in the
# way. /srv exists on Debian and is empty here.
VISIBLE_BASE = "/srv" if os.path.isdir("/srv") else "/opt"


def token(prefix="SECTOK"):
    """A random string that cannot occur by chance in any output."""
    return f"{prefix}{secrets.token_hex(12)}"


def strict_only(reason):
    """Parametrize `level` with strict only; the process case is reported as a skip
    carrying the reason (a property the process level does not claim)."""
    return pytest.mark.parametrize(
        "level", ["strict", pytest.param("process", marks=pytest.mark.skip(
            reason="applies to strict only: " + reason))])


# ---------------------------------------------------------------- the binary, levels


@pytest.fixture(scope="session")
def host_levels(stockade):
    """{level: None or why this host cannot give it}, as `stockade doctor --json` says."""
    cp = subprocess.run([stockade, "doctor", "--json"], capture_output=True, text=True,
                        timeout=60)
    doc = json.loads(cp.stdout)
    return {lvl: None if v["available"] else v["reason"] for lvl, v in doc["levels"].items()}


@pytest.fixture(params=LEVELS)
def level(request, host_levels):
    why = host_levels.get(request.param)
    if why:
        pytest.skip(f"this host cannot give isolation={request.param}: {why}")
    return request.param


@pytest.fixture(autouse=True)
def _need_root():
    if not IS_ROOT:
        pytest.skip("the security battery needs root: per-session service uids, strict "
                    "namespaces as built by a root supervisor, netns/veth, host-side controls")


# ---------------------------------------------------------------- host paths


@pytest.fixture
def cleanup():
    """cleanup(path) registers an exact host path (file or dir) to remove at teardown,
    whether or not it exists yet (an escape may create it)."""
    paths = []
    yield paths.append
    for p in reversed(paths):
        force_rmtree(p)


@pytest.fixture
def state_dir():
    """A fresh state dir per test (stockade_testlib.state_directory)."""
    with state_directory("stockade-sec-") as path:
        yield path


def mkdir_mode(base, mode, prefix="stockade-sec-"):
    path = os.path.realpath(tempfile.mkdtemp(prefix=prefix, dir=base))
    os.chmod(path, mode)
    return path


@pytest.fixture
def hostdirs(cleanup):
    """World-writable (1777) host directories the test owns: one under /var/tmp (the
    state dir's parent here, hidden by strict's test-mode tmpfs), one under VISIBLE_BASE
    (visible read-only under strict). DAC lets any uid create files in them, so only the
    sandbox can stop a write."""
    class D:
        pass
    d = D()
    d.vartmp = mkdir_mode("/var/tmp", 0o1777)
    cleanup(d.vartmp)
    d.visible = mkdir_mode(VISIBLE_BASE, 0o1777)
    cleanup(d.visible)
    return d


def write_file(path, data, mode=0o644):
    with open(path, "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())
    os.chmod(path, mode)


def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


# ---------------------------------------------------------------- host-side controls


def as_nobody(script, timeout=20, input=None):
    """Run `sh -c script` on the HOST, unsandboxed, as uid/gid 65534 with no groups: the
    control that shows an attack's command really works and the host-side check really
    sees its effect, so a blocked result in the sandbox means the sandbox blocked it."""
    cmd = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
           "/bin/sh", "-c", script]
    return subprocess.run(cmd, capture_output=True, timeout=timeout, cwd="/", input=input,
                          env={"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
                               "LANG": "C.UTF-8", "HOME": "/"})


# ---------------------------------------------------------------- processes


def sleepers(marker):
    """Live `sleep N.<marker>...` processes (argv[0] is sleep): not the supervisor or the
    shell whose command lines merely mention the marker."""
    found = []
    for p in all_pids():
        argv = cmdline(p).split(b"\0")
        if len(argv) > 1 and os.path.basename(argv[0]) == b"sleep" and \
                marker.encode() in argv[1] and alive(p):
            found.append(p)
    return found


def proc_uid(pid):
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def live_of_uid(uid):
    return [p for p in all_pids() if proc_uid(p) == uid and alive(p)]


def tracer_pid(pid):
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"TracerPid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def descendants(root_pid):
    """{pid: starttime} of every live descendant of root_pid (host view)."""
    children = {}
    for p in all_pids():
        st = proc_stat(p)
        if st:
            children.setdefault(st[1], []).append((p, st[2]))
    out, todo = {}, [root_pid]
    while todo:
        for p, start in children.get(todo.pop(), []):
            if p not in out:
                out[p] = start
                todo.append(p)
    return out


def wait_until(pred, bound, step=0.05):
    end = time.monotonic() + bound
    while True:
        v = pred()
        if v or time.monotonic() > end:
            return v
        time.sleep(step)


@pytest.fixture
def uid_sweeper():
    """uid_sweeper(uid): at teardown, SIGKILL whatever still runs as that per-session uid
    (a fork bomb that escaped its call). Only uids a call of ours reported are given."""
    uids = []
    yield uids.append
    for uid in uids:
        for _ in range(20):
            left = live_of_uid(uid)
            if not left:
                break
            kill_pids(left)
            time.sleep(0.05)


# ---------------------------------------------------------------- running stockade


class Result:
    def __init__(self, cp, data, pid, elapsed):
        self.cp = cp
        self.json = data
        self.pid = pid
        self.elapsed = elapsed
        self.rc = cp.returncode

    @property
    def out(self):
        return self.json.get("stdout", "")

    @property
    def err(self):
        return self.json.get("stderr", "")

    @property
    def text(self):
        """Everything the tool got back to the caller: stdout, stderr, the message."""
        return "\n".join([self.out, self.err, str(self.json.get("message", ""))])

    def __repr__(self):
        j = dict(self.json)
        return f"<Result rc={self.rc} json={json.dumps(j)[:3000]}>"


def _preexec_cgroup(cgroup):
    def f():
        if cgroup:
            with open(os.path.join(cgroup, "cgroup.procs"), "w") as fh:
                fh.write(str(os.getpid()))
    return f


class Stockade:
    """Drives `stockade run --json` as an orchestrator would. The supervisor gets its own
    process group; on a hang that group (ours) is SIGKILLed and the test fails."""

    def __init__(self, binary, state_dir):
        self.binary = binary
        self.state_dir = state_dir

    def cmd(self, argv, *, policy, session=None, timeout_opt=None, stdin=False, state_dir=None):
        cmd = [self.binary, "run", "--state-dir", state_dir or self.state_dir,
               "--policy", policy, "--json"]
        if session:
            cmd += ["--session", session]
        if timeout_opt:
            cmd += ["--timeout", timeout_opt]
        if stdin:
            cmd.append("--stdin")
        return cmd + ["--"] + list(argv)

    def start(self, argv, *, policy, session=None, timeout_opt=None, env=None,
              pid_stdin=False, cgroup=None, state_dir=None, stdin_fd=None):
        full_env = dict(os.environ)
        full_env.pop("STOCKADE_DEPTH", None)
        full_env.update(env or {})
        proc = subprocess.Popen(
            self.cmd(argv, policy=policy, session=session, timeout_opt=timeout_opt,
                     stdin=pid_stdin, state_dir=state_dir),
            stdin=subprocess.PIPE if pid_stdin else (stdin_fd if stdin_fd is not None
                                                     else subprocess.DEVNULL),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=full_env,
            start_new_session=stdin_fd is None, preexec_fn=_preexec_cgroup(cgroup))
        proc.t0 = time.monotonic()
        if pid_stdin:
            # The supervisor's pid, so the tool can aim at it: under strict it cannot
            # learn it from inside (its pid namespace ends at the shim).
            proc.stdin.write(f"{proc.pid}\n".encode())
            proc.stdin.close()
            proc.stdin = None
        return proc

    def finish(self, proc, timeout=RUN_TIMEOUT):
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"stockade did not return within {timeout:.0f}s: {proc.args!r}\n"
                        f"stdout: {out[-2000:]!r}\nstderr: {err[-2000:]!r}")
        out, err = out or b"", err or b""
        elapsed = time.monotonic() - proc.t0
        cp = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        # The supervisor answered: it exited on its own (not by a signal) and printed one
        # JSON result. Anything else means an attack reached the supervisor itself.
        assert proc.returncode >= 0, \
            f"the supervisor died of signal {-proc.returncode}; stderr {err[-2000:]!r}"
        try:
            data = json.loads(out.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            pytest.fail(f"the supervisor gave no JSON result ({e}); exit {proc.returncode}\n"
                        f"stdout: {out[:2000]!r}\nstderr: {err[-2000:]!r}")
        assert isinstance(data, dict) and "class" in data, data
        # What the tool got, for the record (shown by `pytest -rP` / on failure).
        print(f"RESULT argv={proc.args[proc.args.index('--') + 1:]!r:.300}\n  class={data['class']} "
              f"exit={data.get('exit_code')} signal={data.get('signal')} "
              f"layer={data.get('layer')} {elapsed:.2f}s\n"
              f"  stdout={data.get('stdout', '')[:2500]!r}\n  stderr={data.get('stderr', '')[:1500]!r}")
        return Result(cp, data, proc.pid, elapsed)

    def call(self, argv, *, timeout=RUN_TIMEOUT, **kw):
        return self.finish(self.start(argv, **kw), timeout=timeout)


@pytest.fixture
def sbx(stockade, state_dir, level):
    """sbx.sh(script, **kw) / sbx.call(argv, **kw): one call at the test's level."""
    s = Stockade(stockade, state_dir)
    s.level = level
    s.policy = POLICIES[level]
    s.bomb_policy = BOMB_POLICIES[level]

    def call(argv, **kw):
        kw.setdefault("policy", s.policy)
        return Stockade.call(s, argv, **kw)

    def sh(script, *args, **kw):
        return call(["sh", "-c", script, "sh", *args], **kw)

    def start(argv, **kw):
        kw.setdefault("policy", s.policy)
        return Stockade.start(s, argv, **kw)

    s.call, s.sh, s.start = call, sh, start
    return s


@pytest.fixture
def served(stockade, state_dir, level):
    """`stockade serve` at the test's level through the Python client: calls of one
    session share its root, and start from spare shims."""
    with serve_client(stockade, state_dir, POLICIES[level]) as client:
        yield client


@contextlib.contextmanager
def serve_client(stockade, state_dir, policy, extra=(), serve_state=None):
    """`stockade serve --policy POLICY --state-dir (serve_state or state_dir) EXTRA...` on
    pipes, its log in state_dir/serve.log; closed and waited for on the way out."""
    from stockade_client import Client
    env = {k: v for k, v in os.environ.items() if not k.startswith("STOCKADE_")}
    log = open(os.path.join(state_dir, "serve.log"), "wb")
    client = Client.spawn([stockade, "serve", "--policy", policy,
                           "--state-dir", serve_state or state_dir, *extra], rpc_timeout=60,
                          stderr=log, env=env, start_new_session=True)
    try:
        yield client
    finally:
        client.close(timeout=20)
        try:
            client.proc.wait(20)
        except subprocess.TimeoutExpired:
            client.proc.kill()
            client.proc.wait(5)
        log.close()


# ---------------------------------------------------------------- a helper binary


@pytest.fixture(scope="session")
def secprobe():
    """tests/security/secprobe.c compiled on the host into a fresh 0755 directory under
    VISIBLE_BASE, which both levels can read and execute (the strict host tree is
    read-only and nosuid, not noexec). Removed at the end of the session."""
    if not IS_ROOT:
        pytest.skip("needs root")
    if not shutil.which("gcc"):
        pytest.skip("gcc is not installed: cannot build tests/security/secprobe.c")
    d = mkdir_mode(VISIBLE_BASE, 0o755, prefix="stockade-secbin-")
    exe = os.path.join(d, "secprobe")
    try:
        subprocess.run(["gcc", "-O1", "-Wall", "-o", exe, os.path.join(HERE, "secprobe.c")],
                       check=True, capture_output=True, timeout=120)
        os.chmod(exe, 0o755)
        yield exe
    finally:
        force_rmtree(d)


# ---------------------------------------------------------------- listeners


class Listener:
    """A socket the test owns; a thread records every connection or datagram."""

    def __init__(self, family, kind, addr):
        self.sock = socket.socket(family, kind)
        self.sock.bind(addr)
        self.kind = kind
        if kind == socket.SOCK_STREAM:
            self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.addr = self.sock.getsockname()
        self.hits = []
        self._stop = False
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()

    @property
    def port(self):
        return self.addr[1]

    def _loop(self):
        while not self._stop:
            try:
                if self.kind == socket.SOCK_STREAM:
                    c, peer = self.sock.accept()
                    c.settimeout(0.5)
                    try:
                        data = c.recv(200)
                    except OSError:
                        data = b""
                    self.hits.append((peer, data))
                    c.close()
                else:
                    data, peer = self.sock.recvfrom(2000)
                    self.hits.append((peer, data))
            except socket.timeout:
                continue
            except OSError:
                if not self._stop:
                    time.sleep(0.05)

    def settle(self, bound=1.0):
        """Give a late connection time to be accepted before the verdict."""
        time.sleep(bound)
        return list(self.hits)

    def close(self):
        self._stop = True
        self._t.join(2)
        self.sock.close()


@pytest.fixture
def listen():
    """listen(family, kind, addr) -> Listener, closed at teardown."""
    made = []

    def _new(family, kind, addr):
        lst = Listener(family, kind, addr)
        made.append(lst)
        return lst
    yield _new
    for lst in made:
        lst.close()


# ---------------------------------------------------------------- a network namespace


LISTENER_IN_NS = r"""
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(16); s.settimeout(0.2)
print("READY", s.getsockname()[1], flush=True)
while True:
    try:
        c, peer = s.accept()
    except socket.timeout:
        continue
    c.settimeout(0.5)
    try:
        d = c.recv(200)
    except OSError:
        d = b""
    print("CONN", peer[0], d.decode(errors="replace").strip() or "-", flush=True)
    c.close()
"""


@pytest.fixture
def veth_netns():
    """A network namespace `stockade-sec-<pid>-<n>` joined to the host by a veth pair,
    10.200.X.1/30 on the host end, 10.200.X.2/30 inside, and a TCP listener inside on
    10.200.X.2 (a Python process of ours). Only these objects are created, and all are
    deleted at teardown."""
    ip = shutil.which("ip")
    if not ip:
        pytest.skip("`ip` (iproute2) is not installed: apt-get install iproute2")
    n = random.randrange(1, 250)
    routes = subprocess.run([ip, "-4", "route", "show"], capture_output=True, text=True).stdout
    for _ in range(50):
        if f"10.200.{n}." not in routes:
            break
        n = random.randrange(1, 250)
    ns = f"stockade-sec-{os.getpid()}-{n}"
    host_if, ns_if = f"ssec{os.getpid() % 100000}h", f"ssec{os.getpid() % 100000}n"
    host_ip, ns_ip = f"10.200.{n}.1", f"10.200.{n}.2"
    made = {"ns": False, "link": False}
    listener = None

    def sh(*args):
        subprocess.run([ip, *args], check=True, capture_output=True, timeout=10)
    try:
        try:
            sh("netns", "add", ns)
            made["ns"] = True
            sh("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
            made["link"] = True
        except subprocess.CalledProcessError as e:
            pytest.skip(f"this host cannot make a network namespace with a veth pair "
                        f"(`ip {' '.join(e.cmd[1:])}`: {e.stderr.decode().strip()})")
        sh("link", "set", ns_if, "netns", ns)
        sh("addr", "add", f"{host_ip}/30", "dev", host_if)
        sh("link", "set", host_if, "up")
        sh("-n", ns, "addr", "add", f"{ns_ip}/30", "dev", ns_if)
        sh("-n", ns, "link", "set", ns_if, "up")
        sh("-n", ns, "link", "set", "lo", "up")
        listener = subprocess.Popen([ip, "netns", "exec", ns, "/usr/bin/python3", "-u", "-c",
                                     LISTENER_IN_NS, ns_ip],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        line = listener.stdout.readline().decode()
        assert line.startswith("READY"), f"listener in {ns} did not start: {line!r} " \
                                         f"{listener.stderr.read(2000) if listener.poll() is not None else ''}"
        port = int(line.split()[1])
        hits = []
        t = threading.Thread(target=lambda: [hits.append(ln.decode().strip())
                                             for ln in iter(listener.stdout.readline, b"")],
                             daemon=True)
        t.start()

        class V:
            pass
        v = V()
        v.ns, v.host_ip, v.ip, v.port, v.hits = ns, host_ip, ns_ip, port, hits
        yield v
    finally:
        if listener is not None:
            listener.kill()          # our own child, by pid
            listener.wait(5)
        if made["link"]:
            subprocess.run([ip, "link", "del", host_if], capture_output=True, timeout=10)
        if made["ns"]:
            subprocess.run([ip, "netns", "del", ns], capture_output=True, timeout=10)


# ---------------------------------------------------------------- a pids cgroup


@pytest.fixture
def pids_cgroup():
    """A cgroup v1 `pids` child with pids.max = 1024 that a bomb's supervisor is started
    in: a harness bound that holds even if stockade's own limit fails (and the test then
    still fails on the per-uid count). None where no pids controller can be used."""
    base = "/sys/fs/cgroup/pids"
    if not os.path.isfile(os.path.join(base, "cgroup.procs")):
        yield None
        return
    path = os.path.join(base, f"stockade-sec-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        os.mkdir(path)
        with open(os.path.join(path, "pids.max"), "w") as f:
            f.write("1024")
    except OSError:
        yield None
        return
    try:
        yield path
    finally:
        # Whatever is left in it was started by our supervisor; end it, then remove.
        for _ in range(40):
            try:
                with open(os.path.join(path, "cgroup.procs")) as f:
                    left = [int(x) for x in f.read().split()]
            except OSError:
                left = []
            if not left:
                break
            kill_pids(left)
            time.sleep(0.05)
        try:
            os.rmdir(path)
        except OSError:
            pass


def errno_name(e):
    return errno.errorcode.get(e, str(e))
