"""Helpers for the suites that drive `stockade serve` (tests/integration, tests/redact):
start it (stdio or --listen unix:PATH), talk to it with the Python client or with raw
msgpack bytes, and observe it from the host (/proc). Every wait here is bounded."""

import errno
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import msgpack
import pytest

from stockade_client import Client
from stockade_testlib import FIXTURES, POLICY, REPO_ROOT, cmdline, kill_pids, live_with_marker, proc_stat  # noqa: F401

# Bound on waiting for one response that should come promptly.
RPC_TIMEOUT = 30.0
# Bound on a server starting up / shutting down.
START_TIMEOUT = 15.0
STOP_TIMEOUT = 20.0

MiB = 1 << 20
SMALL_POLICY = os.path.join(FIXTURES, "serve_small.lua")
WIDE_POLICY = os.path.join(FIXTURES, "serve_wide.lua")
LIMITS_POLICY = os.path.join(FIXTURES, "serve_limits.lua")
RELOAD_A = os.path.join(FIXTURES, "serve_reload_a.lua")
RELOAD_B = os.path.join(FIXTURES, "serve_reload_b.lua")
BROKEN_POLICY = os.path.join(FIXTURES, "serve_broken.lua")
REDACT_POLICY = os.path.join(FIXTURES, "serve_redact.lua")

UUID4_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


def is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def one_line(s):
    return isinstance(s, str) and "\n" not in s


def wait_until(pred, timeout, what, interval=0.05):
    """Poll pred() until it returns a truthy value (returned) or fail after timeout."""
    end = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > end:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


# ---------------------------------------------------------------- host observation


def _read(path, mode="rb"):
    try:
        with open(path, mode) as f:
            return f.read()
    except OSError:
        return b"" if "b" in mode else ""


def proc_state(pid):
    """(state, ppid) of pid; (b"", 0) once it is gone."""
    st = proc_stat(pid)
    return st[:2] if st else (b"", 0)


def kill_marker(marker):
    kill_pids(live_with_marker(marker))


def assert_marker_gone(marker, bound=10.0):
    end = time.monotonic() + bound
    while live_with_marker(marker):
        if time.monotonic() > end:
            alive = {p: cmdline(p).replace(b"\0", b" ") for p in live_with_marker(marker)}
            kill_marker(marker)
            pytest.fail(f"processes of the call survived it: {alive}")
        time.sleep(0.05)


def vmrss_kb(pid):
    for line in _read(f"/proc/{pid}/status", "r").splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def fd_count(pid):
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def accepted_connections(pid, sock_path):
    """Inodes of the connections pid holds on its listener at sock_path: accepted, not
    yet closed by it (a client's close is not the server's)."""
    held = set()
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return set()
    for name in names:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:["):
            held.add(int(link[8:-1]))
    conns = set()
    with open("/proc/net/unix") as f:
        next(f)
        for line in f:
            # Num RefCount Protocol Flags Type St Inode Path; flag 0x10000: the listener
            fields = line.split()
            if len(fields) >= 8 and fields[7] == sock_path and \
                    not int(fields[3], 16) & 0x10000 and int(fields[6]) in held:
                conns.add(int(fields[6]))
    return conns


def children(pid):
    """(live, zombie) direct children of pid, from /proc."""
    live, zombies = [], []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        state, ppid = proc_state(name)
        if ppid == pid:
            (zombies if state == b"Z" else live).append(int(name))
    return live, zombies


def sessions_left(state_dir):
    d = os.path.join(state_dir, "sessions")
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


# ---------------------------------------------------------------- raw msgpack connection


class Closed(Exception):
    """The server closed the raw connection (EOF)."""


class RawConn:
    """A byte-level MessagePack-RPC peer: no reader thread, nothing read unless asked,
    so a test can stall it, send garbage, or look at every message in order."""

    def __init__(self, rfd, write, close, sock=None):
        self._rfd = rfd
        self._write = write
        self._close = close
        self.sock = sock
        self.unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
        self.eof = False
        self.seen = []          # every message received, in order
        self._claimed = set()   # ids of the responses response() has returned
        self._next_id = 1

    @classmethod
    def over_socket(cls, path, rcvbuf=None, timeout=START_TIMEOUT):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if rcvbuf:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        s.settimeout(timeout)
        s.connect(path)
        s.settimeout(timeout)   # bounds every send

        def close():
            s.close()
        return cls(s.fileno(), s.sendall, close, sock=s)

    @classmethod
    def over_pipes(cls, proc):
        wfd = proc.stdin.fileno()

        def write(data):
            view = memoryview(data)
            while view:
                n = os.write(wfd, view)
                view = view[n:]

        def close():
            try:
                proc.stdin.close()
            except OSError:
                pass
        return cls(proc.stdout.fileno(), write, close)

    # -- sending

    def send_bytes(self, data):
        self._write(data)

    def send(self, obj):
        self._write(msgpack.packb(obj, use_bin_type=True))

    def request(self, method, params=None, msgid=None, v1=False):
        """Send a request: protocol 2 ([params] or []), or a bare map with v1=True."""
        if msgid is None:
            msgid = self._next_id
            self._next_id += 1
        if v1:
            self.send([0, msgid, method, {} if params is None else params])
        else:
            self.send([0, msgid, method, [params] if params else []])
        return msgid

    def shutdown_write(self):
        if self.sock is not None:
            self.sock.shutdown(socket.SHUT_WR)
        else:
            self._close()

    def close(self):
        try:
            self._close()
        except OSError:
            pass

    # -- receiving

    def _fill(self, deadline):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        r, _, _ = select.select([self._rfd], [], [], left)
        if not r:
            raise TimeoutError
        try:
            data = os.read(self._rfd, 1 << 16)
        except OSError as e:
            if e.errno in (errno.ECONNRESET, errno.EPIPE):
                data = b""
            else:
                raise
        if not data:
            self.eof = True
            raise Closed
        self.unpacker.feed(data)

    def recv(self, timeout=RPC_TIMEOUT):
        """The next message; Closed at EOF, TimeoutError after timeout seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = next(self.unpacker)
                self.seen.append(msg)
                return msg
            except StopIteration:
                pass
            if self.eof:
                raise Closed
            self._fill(deadline)

    def response(self, msgid, timeout=RPC_TIMEOUT):
        """Read until the response to msgid; returns (error, result). Notifications and
        other responses read on the way stay in self.seen."""
        for msg in self.seen:      # already read while waiting for another one
            if isinstance(msg, list) and len(msg) == 4 and msg[0] == 1 and msg[1] == msgid \
                    and id(msg) not in self._claimed:
                self._claimed.add(id(msg))
                return msg[2], msg[3]
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                msg = self.recv(max(left, 0.001))
            except TimeoutError:
                pytest.fail(f"no response to msgid {msgid} within {timeout:.0f}s; "
                            f"seen {summarize(self.seen)}")
            except Closed:
                pytest.fail(f"connection closed before the response to msgid {msgid}; "
                            f"seen {summarize(self.seen)}")
            if isinstance(msg, list) and len(msg) == 4 and msg[0] == 1 and msg[1] == msgid:
                self._claimed.add(id(msg))
                return msg[2], msg[3]

    def call_ok(self, method, params=None, timeout=RPC_TIMEOUT):
        msgid = self.request(method, params)
        err, res = self.response(msgid, timeout)
        assert err is None, f"{method} {params!r} failed: {err!r}"
        return res

    def drain_until_closed(self, timeout):
        """Read until EOF (returns the messages read) or fail after timeout."""
        deadline = time.monotonic() + timeout
        got = []
        while True:
            left = deadline - time.monotonic()
            try:
                got.append(self.recv(max(left, 0.001)))
            except Closed:
                return got
            except TimeoutError:
                pytest.fail(f"connection not closed within {timeout:.0f}s; got {summarize(got)}")


def connect_as(sock_path, uid, timeout=15):
    """Connect as uid and send hello; 'ANSWERED' / 'ERROR <class>' / 'CLOSED' / 'NOCONNECT'."""
    script = r"""
import os, socket, sys, msgpack
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(%d)
try:
    s.connect(sys.argv[1])
    s.sendall(msgpack.packb([0, 1, "hello", {}]))
except OSError as e:
    print("NOCONNECT", e); sys.exit(0)
u = msgpack.Unpacker(raw=False)
while True:
    try:
        d = s.recv(65536)
    except ConnectionResetError:
        d = b""
    if not d:
        print("CLOSED"); sys.exit(0)
    u.feed(d)
    for m in u:
        if m[0] == 1 and m[1] == 1:
            print("ANSWERED" if m[2] is None else "ERROR " + str(m[2].get("class"))); sys.exit(0)
""" % timeout

    def demote():
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    cp = subprocess.run(["/usr/bin/python3", "-c", script, sock_path], capture_output=True,
                        timeout=timeout + 10, preexec_fn=demote)
    return cp.stdout.decode().strip() or cp.stderr.decode()[-500:]


def note_args(msg):
    """The one map argument of a protocol-2 notification [2, method, [map]]."""
    assert msg[0] == 2 and isinstance(msg[2], list) and len(msg[2]) == 1, msg
    return msg[2][0]


def summarize(msgs, limit=8):
    out = []
    for m in msgs[-limit:]:
        r = repr(m)
        out.append(r if len(r) < 300 else r[:300] + "...")
    return out


# ---------------------------------------------------------------- the server under test


def stop_all(servers, after=None):
    """Teardown of a fixture's servers: stop() each (after(s) next, e.g. to print its
    log) also when an earlier one failed to stop, so none is left running or leaves its
    socket's directory; the first failure is raised at the end."""
    first = None
    for s in servers:
        try:
            try:
                s.stop()
            finally:
                if after is not None:
                    after(s)
        except BaseException as e:      # pytest.fail's Failed included
            first = first or e
    if first is not None:
        raise first


SANITIZER_WORDS = ("AddressSanitizer", "LeakSanitizer", "runtime error:")


def assert_no_sanitizer_reports(log_path, extra=()):
    """A server's log, once it is stopped, carries no sanitizer report (nor any of
    `extra`): under SAN=1 a report there is a failure even when every answer was right."""
    with open(log_path, "rb") as f:
        log = f.read().decode("utf-8", "replace")
    for word in SANITIZER_WORDS + tuple(extra):
        assert word not in log, f"serve reported {word}: {log[-3000:]}"


def clean_env():
    """The test's environment minus what would change the server's behaviour: an
    inherited depth, and variables the policies' env.deny patterns match (the server
    redacts their values from tool output, which holds back a redaction window of every
    streamed output — tests that want that set it explicitly)."""
    env = {}
    for k, v in os.environ.items():
        if k == "STOCKADE_DEPTH" or k.endswith("_TOKEN") or k.startswith("AWS_") \
                or k == "SSH_AUTH_SOCK":
            continue
        env[k] = v
    return env



class ServeProc:
    """One `stockade serve`. Stdio mode: `.client` (a Client on its pipes) or, with
    raw=True, `.raw` (a RawConn on them). Listen mode: `.connect()` / `.raw_connect()`."""

    def __init__(self, binary, state_dir, policy, args=(), listen=False, raw=False,
                 log_dir=None, rpc_timeout=RPC_TIMEOUT, extra_env=None):
        self.state_dir = state_dir
        self.policy = policy
        self.sock_dir = None
        self.sock_path = None
        self.log_path = os.path.join(log_dir or state_dir, f"serve-{id(self):x}.log")
        self.log = open(self.log_path, "wb")
        self.proc = None
        self.client = None
        self.raw = None
        try:
            self._start(binary, args, listen, raw, rpc_timeout, extra_env)
        except BaseException:
            # the caller gets no object to stop(): what was made so far goes here
            # (pytest.fail raises a BaseException)
            self._abandon()
            raise
        self.pid = self.proc.pid

    def _start(self, binary, args, listen, raw, rpc_timeout, extra_env):
        cmd = [binary, "serve", "--policy", self.policy, "--state-dir", self.state_dir]
        if listen:
            self.sock_dir = tempfile.mkdtemp(prefix="stk-sock-", dir="/var/tmp")
            self.sock_path = os.path.join(self.sock_dir, "s.sock")
            cmd += ["--listen", "unix:" + self.sock_path]
        cmd += list(args)
        self.cmd = cmd
        env = clean_env()
        env.update(extra_env or {})
        self.rpc_timeout = rpc_timeout
        if listen:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=self.log, env=env, start_new_session=True)
            self._wait_listening()
        elif raw:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=self.log, env=env, start_new_session=True,
                                         bufsize=0)
            self.raw = RawConn.over_pipes(self.proc)
        else:
            self.client = Client.spawn(cmd, rpc_timeout=rpc_timeout, stderr=self.log, env=env,
                                       start_new_session=True)
            self.proc = self.client.proc

    def _abandon(self):
        """Undo a start that failed: what stop() undoes, also before there is a process."""
        if self.proc is not None:
            self.stop()
            return
        self.log.close()
        if self.sock_dir:
            shutil.rmtree(self.sock_dir, ignore_errors=True)

    def _wait_listening(self):
        end = time.monotonic() + START_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"stockade serve exited with {self.proc.returncode} before "
                            f"listening: {self.stderr_text()[-2000:]}")
            if os.path.exists(self.sock_path) and self._probe():
                break
            if time.monotonic() > end:
                pytest.fail(f"stockade serve not listening on {self.sock_path} after "
                            f"{START_TIMEOUT:.0f}s: {self.stderr_text()[-2000:]}")
            time.sleep(0.05)
        # the probe closed by the server too, not only by us: a test that counts the
        # server's connections or descriptors finds none of it pending
        wait_until(lambda: not accepted_connections(self.proc.pid, self.sock_path)
                   or self.proc.poll() is not None,
                   START_TIMEOUT, "the server to close the start-up probe's connection")

    def _probe(self):
        """A hello on a connection of its own, then EOF, read to the server's EOF (or
        reset): True once the server accepted and dropped it; False when nothing listens
        yet, or nothing answered in time."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(START_TIMEOUT)
        try:
            s.connect(self.sock_path)
            s.sendall(msgpack.packb([0, 1, "hello", []]))
            s.shutdown(socket.SHUT_WR)
            while s.recv(65536):
                pass
            return True
        except (ConnectionRefusedError, FileNotFoundError, TimeoutError):
            return False
        except OSError:
            return True         # reset or broken pipe: accepted, then dropped
        finally:
            s.close()

    def connect(self, rpc_timeout=None):
        return Client.connect_unix(self.sock_path, rpc_timeout=rpc_timeout or self.rpc_timeout)

    def raw_connect(self, rcvbuf=None):
        return RawConn.over_socket(self.sock_path, rcvbuf=rcvbuf)

    def stderr_text(self):
        self.log.flush()
        return _read(self.log_path).decode("utf-8", "replace")

    def alive(self):
        return self.proc.poll() is None

    def wait_exit(self, timeout=STOP_TIMEOUT):
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"stockade serve did not exit within {timeout:.0f}s; "
                        f"stderr: {self.stderr_text()[-2000:]}")

    def stop(self):
        """Teardown: EOF (stdio) or SIGTERM, then SIGKILL to its process group."""
        try:
            if self.proc.poll() is None:
                if self.client is not None:
                    self.client.close(timeout=STOP_TIMEOUT)
                elif self.raw is not None:
                    self.raw.close()
                else:
                    self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(STOP_TIMEOUT)
                except subprocess.TimeoutExpired:
                    try:
                        os.killpg(self.proc.pid, signal.SIGKILL)
                    except OSError:
                        pass
                    self.proc.wait(5)
            elif self.client is not None:
                self.client.close(timeout=1)
        finally:
            for f in (self.proc.stdin, self.proc.stdout):
                try:
                    if f is not None:
                        f.close()
                except OSError:
                    pass
            self.log.close()
            if self.sock_dir:
                shutil.rmtree(self.sock_dir, ignore_errors=True)
