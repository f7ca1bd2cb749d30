"""The security battery: honest escape attempts that must FAIL.

Each test attacks from inside a tool call (the `sh`/`python3` tools of
tests/fixtures/sec_process.lua, at both levels) and then judges from the HOST: a file that must
be absent or unchanged, a listener that must have seen nothing, a process that must be
gone, a supervisor that must still have answered. Where it is cheap, the same attack is
first run on the host unsandboxed as uid 65534 (`as_nobody`) to show that the command
works and that the host-side check would see its effect: a pass then means the sandbox
stopped it, not that the attack was broken.

Tools run as a per-session service uid (the supervisor is root here), so plain DAC already
stops many writes (/etc, /root). The honest targets are therefore world-writable (1777)
directories and 0666 files the test creates, where nothing but the sandbox (the read-only
mount tree under strict, Landlock under both) stands in the way.
"""

import fcntl
import hashlib
import os
import pty
import signal
import socket
import termios
import threading
import time
import tty

import pytest

from conftest import (NOBODY, VISIBLE_BASE, alive, as_nobody, cmdline, descendants,
                      live_of_uid, live_with_marker, kill_pids, sleepers, read_bytes, strict_only,
                      token, tracer_pid, wait_until, write_file)


def sha(path):
    return hashlib.sha256(read_bytes(path)).hexdigest()


def snapshot(path):
    st = os.stat(path)
    return (sha(path), st.st_size, st.st_mtime_ns, st.st_nlink, st.st_mode, st.st_uid)


def rel(path):
    return path.lstrip("/")


# ====================================================================== writes


def test_write_outside_root(sbx, hostdirs, cleanup, state_dir):
    """echo/mkdir/touch into host places outside the session root. Under strict /tmp is the
    session's tmp and /var/tmp a read-only tmpfs, so the write may "succeed" inside: only
    the host side counts."""
    name = token("stockade-sec-")
    pub_state = os.path.join(state_dir, "pub")            # a 1777 dir inside the state dir
    os.mkdir(pub_state)
    os.chmod(pub_state, 0o1777)
    targets = {
        "host /tmp": f"/tmp/{name}",
        "/dev/shm": f"/dev/shm/{name}",
        "1777 dir in /var/tmp": f"{hostdirs.vartmp}/{name}",
        f"1777 dir in {VISIBLE_BASE}": f"{hostdirs.visible}/{name}",
        "1777 dir in the state dir": f"{pub_state}/{name}",
        "/etc": f"/etc/{name}",
        "/root": f"/root/{name}",
        "the state dir": f"{state_dir}/{name}",
    }
    for p in targets.values():
        for q in (p, p + ".d", p + ".ctl"):
            cleanup(q)
    # Control: as an unprivileged uid on the host, the world-writable targets ARE writable
    # (so only the sandbox can make the difference below).
    for what, p in targets.items():
        if what in ("/etc", "/root", "the state dir"):
            continue
        cp = as_nobody(f'echo ctl > "{p}.ctl"')
        assert cp.returncode == 0 and os.path.exists(p + ".ctl"), (what, cp.stderr)
        os.unlink(p + ".ctl")

    script = "".join(f'echo pwned > "{p}"; touch "{p}"; mkdir "{p}.d"; ' for p in targets.values())
    r = sbx.sh(script + "echo done")
    assert r.json["class"] in ("OK", "TOOL_ERROR"), r
    escaped = {what: p for what, p in targets.items()
               if os.path.lexists(p) or os.path.lexists(p + ".d")}
    assert not escaped, f"[{sbx.level}] the tool wrote outside its root: {escaped}\n{r}"


# ====================================================================== reads


@pytest.fixture
def placed_secret(cleanup):
    """place(where) -> (path, token): a 0644 file holding a random token, in a fresh 0755
    directory below `where` (made and removed by us)."""
    def place(where):
        tok = token()
        if not os.path.isdir(where):
            pytest.skip(f"{where} does not exist on this host")
        d = os.path.realpath(os.path.join(where, token("stockade-sec-")))
        os.mkdir(d, 0o755)
        os.chmod(d, 0o755)
        cleanup(d)
        p = os.path.join(d, "secret.txt")
        write_file(p, tok + "\n", 0o644)
        return p, tok
    return place


READ_SCRIPT = r'''read SUP
p="$1"
cat "$p"
cat "/proc/self/root$p"
cat "/proc/1/root$p"
cat "/proc/$SUP/root$p"
cat "/proc/$SUP/cwd/../../../../../../../../..$p"
ls -la "$(dirname "$p")"
grep -rs SECTOK "$(dirname "$p")"
echo end
'''


# A 0644 file in a 0755 directory is readable by any uid on the host. Under `process`
# nothing hides it by design (Landlock there handles writes only; the tool shares the host
# tree), so those cases are strict-only: under strict the design promises the host's
# personal and runtime dirs are empty (/home, /root, /run, /mnt, /media), /tmp and
# /var/tmp are replaced — and is silent about the rest of `/`, which is bind-mounted
# read-only. A secret in /srv or /etc is the honest probe of "read a host secret": if it
# is read, that is reported as a finding, not hidden by weakening the test. (/var/tmp is
# hidden here by the read-only tmpfs strict puts there when the state dir lies below it,
# as in these tests; in production it is the session's tmp — hidden either way.)
@strict_only("a 0644 host file is readable by every uid under process isolation by design")
@pytest.mark.parametrize("where", ["/var/tmp", "/tmp", "/home", "/run", "/mnt", VISIBLE_BASE,
                                   pytest.param("/etc", marks=pytest.mark.xfail(strict=True,
                                       reason="known and accepted: strict shows the host's /etc "
                                              "read-only (tools need ld.so, passwd, nsswitch, "
                                              "ssl certs); a world-readable secret in /etc is "
                                              "readable by every uid on the host anyway")),
                                   "/opt"])
def test_read_world_readable_host_secret(sbx, placed_secret, level, where):
    path, tok = placed_secret(where)
    # Control: any uid on the host reads it, so the sandbox is the only wall.
    cp = as_nobody(f'cat "{path}"')
    assert tok.encode() in cp.stdout, cp
    r = sbx.sh(READ_SCRIPT, path, pid_stdin=True)
    assert tok not in r.text, \
        f"[{level}] the tool read the host secret {path} (0644):\n{r.out[:2000]}"


@pytest.fixture
def ssh_key(cleanup):
    """/root/.ssh/stockade-test-key (0600, a token): /root/.ssh is made (0700) only if
    absent, and only what we made is removed."""
    d = "/root/.ssh"
    if not os.path.isdir(d):
        os.mkdir(d, 0o700)
        cleanup(d)
    key = os.path.join(d, "stockade-test-key")
    if os.path.lexists(key):
        pytest.skip(f"{key} exists and is not ours")
    tok = token()
    cleanup(key)
    write_file(key, f"-----BEGIN OPENSSH PRIVATE KEY-----\n{tok}\n", 0o600)
    return key, tok


def test_read_root_ssh_key(sbx, ssh_key, level):
    """Plain DAC already refuses this to a non-root uid (/root is 0700); the test guards
    the uid drop and every path the supervisor's (root's) view could leak through."""
    key, tok = ssh_key
    r = sbx.sh(READ_SCRIPT + 'cat /root/.ssh/*; ls -la /root /root/.ssh; '
               'cat "/proc/$SUP/root/root/.ssh/stockade-test-key"', key, pid_stdin=True)
    assert tok not in r.text, f"[{level}] the tool read {key}:\n{r.out[:2000]}"
    assert read_bytes(key).decode().endswith(tok + "\n")      # still there, unchanged


def test_read_other_session(sbx, level):
    """Session B keeps a secret in its own root; session A (another uid) tries to read it
    by path, by .., and by /proc."""
    tok = token()
    b = sbx.sh(f'printf "%s\\n" {tok} > "$AGENT_ROOT/workspace/secret"; '
               f'chmod 644 "$AGENT_ROOT/workspace/secret"; '
               f'printf "%s\\n" {tok} > "$AGENT_ROOT/tmp/secret"; echo "$AGENT_ROOT"',
               session="victim-b")
    assert b.json["class"] == "OK", b
    broot = b.out.strip()
    assert read_bytes(os.path.join(broot, "workspace", "secret")).decode().strip() == tok
    r = sbx.sh(f'cat "{broot}/workspace/secret" "{broot}/tmp/secret"; '
               f'cat "$AGENT_ROOT/../victim-b/workspace/secret"; '
               f'ls -la "$AGENT_ROOT/.." "{broot}"; cat /proc/*/root{broot}/workspace/secret; '
               'echo end', session="attacker-a")
    assert r.json["class"] in ("OK", "TOOL_ERROR"), r
    assert tok not in r.text, f"[{level}] session A read session B's file:\n{r.out[:2000]}"


# ====================================================================== symlinks and ..


def test_symlink_write_escape(sbx, hostdirs, cleanup):
    victims = {}
    for where in (hostdirs.visible, hostdirs.vartmp):
        for kind in ("victim", "ctl"):
            p = os.path.join(where, f"{kind}.txt")
            write_file(p, "original\n", 0o666)        # world-writable: DAC lets anyone in
        victims[where] = os.path.join(where, "victim.txt")
    # Control: through a symlink, as nobody on the host, the 0666 file IS writable.
    for where in victims:
        cp = as_nobody(f'ln -s "{where}/ctl.txt" "{where}/ctl-link" && echo pwned >> "{where}/ctl-link"')
        assert cp.returncode == 0 and read_bytes(f"{where}/ctl.txt") == b"original\npwned\n", cp
    passwd = snapshot("/etc/passwd")
    before = {p: snapshot(p) for p in victims.values()}
    newfile = token("stockade-sec-")
    cleanup(f"/tmp/{newfile}")
    script = (f'ln -s "{victims[hostdirs.visible]}" l1; echo pwned >> l1; echo pwned > l1; '
              f'ln -s "{victims[hostdirs.vartmp]}" l2; echo pwned >> l2; '
              f'ln -s /etc/passwd l3; echo "pwned::0:0::/:/bin/sh" >> l3; '
              f'ln -s "{hostdirs.visible}" d1; echo pwned > d1/{newfile}; '
              f'ln -s "{hostdirs.vartmp}" d2; echo pwned > d2/{newfile}; '
              f'ln -s /tmp d3; echo pwned > d3/{newfile}; '
              f'ln -s / root; echo pwned > "root{hostdirs.visible}/{newfile}.2"; '
              'ls -la; echo end')
    r = sbx.sh(script)
    assert r.json["class"] in ("OK", "TOOL_ERROR"), r
    for p, snap in before.items():
        assert snapshot(p) == snap, f"[{sbx.level}] {p} was modified through a symlink:\n{r}"
    assert snapshot("/etc/passwd") == passwd, f"/etc/passwd modified through a symlink\n{r}"
    made = [p for p in (f"{hostdirs.visible}/{newfile}", f"{hostdirs.vartmp}/{newfile}",
                        f"/tmp/{newfile}", f"{hostdirs.visible}/{newfile}.2")
            if os.path.lexists(p)]
    assert not made, f"[{sbx.level}] files created through symlinks: {made}\n{r}"


def test_dotdot_escape(sbx, hostdirs, state_dir):
    name = token("stockade-sec-")
    dots = "/".join([".."] * 16)
    script = (f'cd {dots}; pwd; ls; '
              f'echo pwned > "{rel(hostdirs.visible)}/{name}"; '
              f'echo pwned > "{rel(hostdirs.vartmp)}/{name}"; '
              f'echo pwned > "tmp/{name}"; '
              f'cd "$AGENT_ROOT/workspace" && echo pwned > "../../../{name}"; '
              f'echo pwned > "$AGENT_ROOT/workspace/{dots}{hostdirs.visible}/{name}.2"; '
              'echo end')
    r = sbx.sh(script)
    found = [p for p in (f"{hostdirs.visible}/{name}", f"{hostdirs.vartmp}/{name}",
                         f"/tmp/{name}", f"{state_dir}/{name}", f"{hostdirs.visible}/{name}.2")
             if os.path.lexists(p)]
    for p in found + [f"/tmp/{name}"]:
        if os.path.lexists(p):
            os.unlink(p)
    assert not found, f"[{sbx.level}] written through ..: {found}\n{r}"


# ====================================================================== hard links


def test_hardlink_write_escape(sbx, hostdirs, state_dir):
    """A hard link needs no write access to the source's directory; protected_hardlinks
    allows it for a file the uid can read and write (0666). Written through the link, the
    host file changes. The workspace must be on the same file system as the victims, or
    EXDEV would make the test vacuous."""
    victims = []
    for where in (hostdirs.visible, hostdirs.vartmp):
        p = os.path.join(where, "victim.txt")
        write_file(p, "original\n", 0o666)
        assert os.stat(p).st_dev == os.stat(state_dir).st_dev, "victim not on the state dir's fs"
        victims.append(p)
        write_file(os.path.join(where, "ctl.txt"), "original\n", 0o666)
    # Control: as nobody on the host, the link and the write through it work.
    for where in (hostdirs.visible, hostdirs.vartmp):
        cp = as_nobody(f'ln "{where}/ctl.txt" "{where}/ctl-hl" && echo pwned >> "{where}/ctl-hl"')
        assert cp.returncode == 0 and read_bytes(f"{where}/ctl.txt") == b"original\npwned\n", cp
    passwd = snapshot("/etc/passwd")
    before = {p: snapshot(p) for p in victims}
    script = (f'ln "{victims[0]}" h1; echo pwned >> h1; '
              f'ln "{victims[1]}" h2; echo pwned >> h2; '
              'ln /etc/passwd h3; echo "pwned::0:0::/:/bin/sh" >> h3; '
              f'ln -P "{victims[0]}" "$TMPDIR/h4"; echo pwned >> "$TMPDIR/h4"; '
              'ls -li; echo end')
    r = sbx.sh(script)
    for p, snap in before.items():
        assert snapshot(p) == snap, \
            f"[{sbx.level}] {p} changed (content/nlink) through a hard link:\n{r}"
    assert snapshot("/etc/passwd") == passwd, f"/etc/passwd modified through a hard link\n{r}"


# ====================================================================== /proc


def test_proc_root_write(sbx, hostdirs):
    """/proc/PID/root is a magic link to a process's root: the supervisor's is the real
    host root under both levels."""
    name = token("stockade-sec-")
    targets = [f"{hostdirs.visible}/{name}.{i}" for i in range(5)] + \
              [f"{hostdirs.vartmp}/{name}.{i}" for i in range(5)]
    script = ('read SUP; '
              f'echo pwned > "/proc/1/root{hostdirs.visible}/{name}.0"; '
              f'echo pwned > "/proc/self/root/..{hostdirs.visible}/{name}.1"; '
              f'echo pwned > "/proc/$SUP/root{hostdirs.visible}/{name}.2"; '
              f'echo pwned > "/proc/$SUP/cwd/{"/".join([".."] * 12)}{hostdirs.visible}/{name}.3"; '
              f'echo pwned > "/proc/1/root{hostdirs.vartmp}/{name}.0"; '
              f'echo pwned > "/proc/$SUP/root{hostdirs.vartmp}/{name}.2"; '
              f'for p in /proc/[0-9]*; do echo pwned > "$p/root{hostdirs.vartmp}/{name}.4" 2>/dev/null; '
              f'echo pwned > "$p/root{hostdirs.visible}/{name}.4" 2>/dev/null; done; '
              'ls -la /proc/1/root/ "/proc/$SUP/root/"; echo end')
    r = sbx.sh(script, pid_stdin=True)
    found = [p for p in targets if os.path.lexists(p)]
    assert not found, f"[{sbx.level}] written through /proc/*/root: {found}\n{r}"


def test_proc_supervisor_environ(sbx, level):
    """A secret in the supervisor's environment must not reach the tool: not through its
    env (built from nothing), nor /proc/<supervisor>/environ, nor any /proc/*/environ."""
    tok = token()
    script = ('read SUP; echo "sup=$SUP"; ls -l "/proc/$SUP/environ"; '
              'cat "/proc/$SUP/environ"; cat /proc/$SUP/task/*/environ; '
              'for f in /proc/[0-9]*/environ; do cat "$f"; done; '
              'cat "/proc/$SUP/cmdline"; env; echo end')
    r = sbx.sh(script, pid_stdin=True, env={"STOCKADE_SEC_CANARY": tok})
    assert r.json["class"] in ("OK", "TOOL_ERROR"), r
    assert f"sup={r.pid}" in r.out, r          # the tool was told the right pid
    assert tok not in r.text, f"[{level}] the supervisor's env leaked:\n{r.out[:3000]}"


# ====================================================================== network


PY_CONNECT = r"""
import socket, sys
fam = {"4": socket.AF_INET, "6": socket.AF_INET6, "u": socket.AF_UNIX}[sys.argv[1]]
kind = {"tcp": socket.SOCK_STREAM, "udp": socket.SOCK_DGRAM}[sys.argv[2]]
addr = sys.argv[3] if fam == socket.AF_UNIX else (sys.argv[3], int(sys.argv[4]))
if fam == socket.AF_UNIX and addr.startswith("@"):
    addr = "\0" + addr[1:]
try:
    s = socket.socket(fam, kind)
    s.settimeout(3)
    s.connect(addr)
    s.send(b"ESCAPED\n")
    print("CONNECTED", flush=True)
except Exception as e:
    print("blocked:", type(e).__name__, e, flush=True)
"""


def test_connect_loopback_tcp(sbx, listen, level):
    """TCP to a listener on the host's 127.0.0.1. strict: an empty network namespace;
    process: seccomp refuses socket(AF_INET) (network "none") and Landlock refuses TCP
    connect as a second wall."""
    lst = listen(socket.AF_INET, socket.SOCK_STREAM, ("127.0.0.1", 0))
    cp = as_nobody(f"exec /usr/bin/python3 -c '{PY_CONNECT}' 4 tcp 127.0.0.1 {lst.port}")
    assert b"CONNECTED" in cp.stdout and wait_until(lambda: lst.hits, 3), cp   # control
    lst.hits.clear()
    script = (f'python3 -c "$1" 4 tcp 127.0.0.1 {lst.port}; '
              f'curl -sS --max-time 3 http://127.0.0.1:{lst.port}/ ; '
              f'bash -c "echo ESCAPED > /dev/tcp/127.0.0.1/{lst.port}"; echo end')
    r = sbx.sh(script, PY_CONNECT)
    hits = lst.settle(1.0)
    assert not hits and "CONNECTED" not in r.out, \
        f"[{level}] connection reached the host's 127.0.0.1: {hits}\n{r}"


def test_connect_loopback_ipv6_and_udp(sbx, listen, level):
    if not socket.has_ipv6 or not _loopback6():
        pytest.skip("the host has no IPv6 loopback (::1 cannot be bound): nothing to reach")
    lt = listen(socket.AF_INET6, socket.SOCK_STREAM, ("::1", 0))
    lu = listen(socket.AF_INET, socket.SOCK_DGRAM, ("127.0.0.1", 0))
    cp = as_nobody(f"/usr/bin/python3 -c '{PY_CONNECT}' 6 tcp ::1 {lt.port}; "
                   f"/usr/bin/python3 -c '{PY_CONNECT}' 4 udp 127.0.0.1 {lu.port}")
    assert wait_until(lambda: lt.hits and lu.hits, 3), cp                       # control
    lt.hits.clear()
    lu.hits.clear()
    r = sbx.sh(f'python3 -c "$1" 6 tcp ::1 {lt.port}; python3 -c "$1" 4 udp 127.0.0.1 {lu.port}; '
               f'bash -c "echo ESCAPED > /dev/udp/127.0.0.1/{lu.port}"; echo end', PY_CONNECT)
    assert not lt.settle(0.5) and not lu.settle(0.5), \
        f"[{level}] reached the host: tcp6 {lt.hits} udp {lu.hits}\n{r}"


def _loopback6():
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("mode,kind", [("uring-tcp", socket.SOCK_STREAM),
                                        ("uring-udp", socket.SOCK_DGRAM),
                                        ("compat-tcp", socket.SOCK_STREAM),
                                        ("x32-tcp", socket.SOCK_STREAM)])
def test_connect_loopback_seccomp_bypass(sbx, listen, secprobe, level, mode, kind):
    """socket() by a route a filter on the socket syscall may not see: io_uring's
    IORING_OP_SOCKET (io_uring_setup is not in the deny list), the i386 entry point
    (int 0x80 socketcall), the x32 bit. For UDP Landlock has no rule at all, so under
    `process` seccomp is the only wall."""
    if mode == "compat-tcp":
        entry = as_nobody(f"{secprobe} compat-entry")
        if b"compat_entry ok" not in entry.stdout:
            pytest.skip("the kernel does not serve int 0x80 (no IA32 emulation, or booted "
                        f"ia32_emulation=0): nothing to bypass; probe said {entry.stdout!r}")
    lst = listen(socket.AF_INET, kind, ("127.0.0.1", 0))
    cp = as_nobody(f"{secprobe} {mode} 127.0.0.1 {lst.port}")
    if mode == "x32-tcp" and b"ENOSYS" in cp.stdout:
        pytest.skip("the kernel has no x32 ABI (CONFIG_X86_X32_ABI off): nothing to bypass")
    assert wait_until(lambda: lst.hits, 3), f"control failed: {cp}"              # control
    lst.hits.clear()
    r = sbx.sh(f'exec "{secprobe}" {mode} 127.0.0.1 {lst.port}')
    hits = lst.settle(1.0)
    assert not hits, f"[{level}] {mode}: reached the host's 127.0.0.1: {hits}\n{r}"


def test_connect_abstract_unix_socket(sbx, listen, level):
    """Abstract AF_UNIX sockets have no file and no permission check: anyone in the same
    network namespace can connect (X11, dbus, containerd, and test-made ones). AF_UNIX is
    always allowed by the seccomp filter. strict: a separate netns has its own abstract
    namespace. process: only Landlock's abstract-socket scoping (ABI 6) could stop it."""
    name = token("stockade-sec-")
    lst = listen(socket.AF_UNIX, socket.SOCK_STREAM, "\0" + name)
    cp = as_nobody(f"/usr/bin/python3 -c '{PY_CONNECT}' u tcp @{name}")
    assert wait_until(lambda: lst.hits, 3), cp                                  # control
    lst.hits.clear()
    r = sbx.sh(f'python3 -c "$1" u tcp @{name}; echo end', PY_CONNECT)
    hits = lst.settle(0.5)
    assert not hits, f"[{level}] connected to the host's abstract socket @{name}: {r.out}"


def test_connect_veth_netns(sbx, veth_netns, level):
    v = veth_netns
    # Control: from the host's netns, the listener behind the veth answers.
    cp = as_nobody(f"/usr/bin/python3 -c '{PY_CONNECT}' 4 tcp {v.ip} {v.port}")
    assert b"CONNECTED" in cp.stdout and wait_until(lambda: v.hits, 3), cp
    v.hits.clear()
    r = sbx.sh(f'python3 -c "$1" 4 tcp {v.ip} {v.port}; '
               f'curl -sS --max-time 3 http://{v.ip}:{v.port}/ ; ip addr; ip route; echo end',
               PY_CONNECT)
    time.sleep(1.0)
    assert not v.hits, f"[{level}] reached {v.ip}:{v.port} in netns {v.ns}: {v.hits}\n{r}"


# ====================================================================== privilege


def _own_task(pid, tracer):
    """A tracer that is the traced process's own clone — LeakSanitizer stops the world
    through a ptrace-attached child of the sanitized supervisor when it exits — is not
    an attack by the tool."""
    try:
        with open(f"/proc/{tracer}/status") as f:
            ppid = next((int(l.split()[1]) for l in f if l.startswith("PPid:")), 0)
        return ppid == pid
    except (OSError, ValueError):
        return False


def _sample_tracer(pids, stop, seen):
    while not stop.is_set():
        for p in list(pids):
            t = tracer_pid(p)
            if t and not _own_task(p, t):
                seen.append((p, t))
        time.sleep(0.005)


def _yama_ptrace_scope():
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 0


def test_ptrace_supervisor(sbx, secprobe, marker, level):
    """ptrace the supervisor (a root process) and, more honestly, a process of the tool's
    own uid (only seccomp stands there). Host side: TracerPid of both stays 0 throughout,
    and the supervisor answered."""
    m = marker()
    # Control: as nobody on the host, ptrace of an own child works.
    cp = as_nobody(f'sleep 5.{m}1 & {secprobe} ptrace $!; kill -9 $!; wait')
    scope = _yama_ptrace_scope()
    if b"ptrace_attach ok" not in cp.stdout and scope >= 2:
        pytest.skip(f"kernel.yama.ptrace_scope = {scope}: an ordinary user cannot ptrace "
                    "even its own child on this host, so the control cannot run")
    assert b"ptrace_attach ok" in cp.stdout, cp
    script = (f'read SUP; sleep 8.{m} & V=$!; '
              f'strace -p "$SUP" -o /dev/null & S1=$!; strace -p "$V" -o /dev/null & S2=$!; '
              f'sleep 0.5; kill $S1 $S2; "{secprobe}" ptrace "$SUP"; "{secprobe}" ptrace "$V"; '
              'kill $V; echo end')
    proc = sbx.start(["sh", "-c", script], pid_stdin=True)
    stop, seen = threading.Event(), []
    targets = [proc.pid]

    def find_victim():
        for p in sleepers(f"8.{m}"):
            if p not in targets:
                targets.append(p)
        return len(targets) > 1
    t = threading.Thread(target=_sample_tracer, args=(targets, stop, seen), daemon=True)
    t.start()
    wait_until(find_victim, 5, 0.01)
    try:
        r = sbx.finish(proc)
    finally:
        stop.set()
        t.join(2)
    assert len(targets) == 2, "the same-uid victim never started"
    assert not seen, f"[{level}] a process was traced (pid, tracer): {seen}\n{r}"
    assert "ptrace_attach ok" not in r.out and "ptrace_seize ok" not in r.out, r
    assert "process_vm_readv ok" not in r.out and "pidfd_getfd ok" not in r.out, r


def test_compile_and_ptrace_in_workspace(sbx, level):
    """The tool compiles its own ptrace program in the workspace and runs it (records
    whether the workspace is executable). PTRACE_TRACEME + a child, and ATTACH on a
    sibling: both must be refused."""
    src = r'''
#include <stdio.h>
#include <errno.h>
#include <string.h>
#include <signal.h>
#include <unistd.h>
#include <sys/ptrace.h>
#include <sys/wait.h>
int main(void) {
  pid_t c = fork();
  if (c == 0) { pause(); _exit(0); }
  long r = ptrace(PTRACE_ATTACH, c, 0, 0);
  printf("attach_child %s\n", r == 0 ? "OK-ESCAPED" : strerror(errno));
  r = ptrace(PTRACE_TRACEME, 0, 0, 0);
  printf("traceme %s\n", r == 0 ? "OK-ESCAPED" : strerror(errno));
  kill(c, SIGKILL); waitpid(c, 0, 0); return 0; }
'''
    script = ('cd "$AGENT_ROOT/workspace" && printf "%s" "$1" > p.c && '
              'gcc -o p p.c && echo COMPILED && ./p && echo EXECUTED; echo end')
    r = sbx.sh(script, src)
    print(f"[{level}] compile/exec in workspace: {r.out!r} {r.err[-500:]!r}")
    assert "OK-ESCAPED" not in r.out, f"[{level}] ptrace allowed in the tool:\n{r}"


def test_signal_supervisor(sbx, level):
    """kill -KILL / -STOP of the supervisor by pid from inside the call."""
    r = sbx.sh('read SUP; kill -STOP "$SUP"; kill -KILL "$SUP"; kill -TERM -1; echo end',
               pid_stdin=True)
    # finish() already asserted the supervisor exited on its own with a JSON result.
    assert r.json["class"] in ("OK", "TOOL_ERROR"), r
    assert r.out.strip().endswith("end"), r


def test_unshare_user_and_mount_ns(sbx, state_dir, level):
    """unshare -r / -m: if any succeeded, the inner command writes its uid into the
    workspace, which the host sees (the session is kept by name)."""
    script = ('cd "$AGENT_ROOT/workspace"; '
              'unshare -r sh -c "id -u > ns-r"; '
              'unshare -m sh -c "id -u > ns-m"; '
              'unshare -U -r -m -n sh -c "id -u > ns-urmn"; '
              'unshare -p -f sh -c "id -u > ns-pid"; '
              'unshare -U sh -c "id -u > ns-u"; '
              'python3 -c "$1"; ls; echo end')
    py = ('import ctypes\n'
          'if ctypes.CDLL(None, use_errno=True).unshare(0x10000000) == 0:\n'
          '    open("ns-py", "w").write("in")\n')
    r = sbx.sh(script, py, session="unshare")
    ws = os.path.join(state_dir, "sessions", "unshare", "workspace")
    made = sorted(f for f in os.listdir(ws) if f.startswith("ns-"))
    assert not made, f"[{level}] new namespaces were created: {made}\n{r}"


def test_mount_tmpfs_over_workspace(sbx, state_dir, level):
    """mount -t tmpfs over a workspace dir. Had it worked, the file written next would be
    on the tmpfs and NOT in the host's workspace dir; it must land on the host."""
    script = ('cd "$AGENT_ROOT/workspace" && mkdir m && '
              'mount -t tmpfs none "$AGENT_ROOT/workspace/m"; echo "mount=$?"; '
              'mount --bind / "$AGENT_ROOT/workspace/m"; echo "bind=$?"; '
              # mount(8) refuses a non-root caller before any syscall; ask the kernel
              # directly so the syscall itself (seccomp, then capabilities) is what answers
              'python3 -c "$1"; '
              'echo probe > m/probe; grep -c "workspace/m" /proc/self/mountinfo; echo end')
    py = ('import ctypes, os\n'
          'libc = ctypes.CDLL(None, use_errno=True)\n'
          'for src, fs, flags in ((b"none", b"tmpfs", 0), (b"/", None, 4096)):\n'
          '    rc = libc.mount(src, b"m", fs, flags, None)\n'
          '    print("mount(2)", src, fs, rc, os.strerror(ctypes.get_errno()) if rc else "MOUNTED")\n')
    r = sbx.sh(script, py, session="mnt")
    assert "MOUNTED" not in r.out, f"[{level}] mount(2) succeeded\n{r}"
    probe = os.path.join(state_dir, "sessions", "mnt", "workspace", "m", "probe")
    assert "mount=0" not in r.out and "bind=0" not in r.out, f"[{level}] mount succeeded\n{r}"
    assert os.path.isfile(probe), f"[{level}] the write went to a mount, not the workspace\n{r}"


PY_TIOCSTI = r"""
import fcntl, os, sys, termios, glob
paths = ["/dev/tty"] + sorted(glob.glob("/dev/pts/*")) + ["/proc/%s/fd/%d" % (sys.argv[1], i) for i in range(3)]
fds = [(str(i), i) for i in range(3)]
for p in paths:
    try:
        fds.append((p, os.open(p, os.O_RDWR | os.O_NOCTTY)))
    except OSError as e:
        print("open", p, e)
for name, fd in fds:
    try:
        for ch in b"INJECTED\n":
            fcntl.ioctl(fd, termios.TIOCSTI, bytes([ch]))
        print("TIOCSTI-OK", name)
    except OSError as e:
        print("tiocsti", name, e)
"""


def test_tiocsti_terminal_injection(sbx, level):
    """The supervisor runs with a pty as its controlling terminal and stdin (as from an
    operator's shell). The tool tries TIOCSTI on its fds, /dev/tty, /dev/pts/* and the
    supervisor's fds: nothing may be queued on the pty's input (dev.tty.legacy_tiocsti
    is 1 here, so the kernel alone would allow it to an owner of the tty)."""
    master, slave = pty.openpty()
    try:
        tty.setraw(slave)
        # Control: TIOCSTI works on this pty and the check below sees it.
        try:
            fcntl.ioctl(slave, termios.TIOCSTI, b"C")
        except OSError as e:
            pytest.skip(f"TIOCSTI is refused on this host even to the test ({e}): "
                        "nothing to inject, so nothing to stop")
        fcntl.fcntl(slave, fcntl.F_SETFL, os.O_NONBLOCK)
        assert os.read(slave, 100) == b"C"

        def make_ctty():
            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)
        import subprocess
        cmd = sbx.cmd(["sh", "-c", 'read SUP; exec python3 -c "$1" "$SUP"', "sh", PY_TIOCSTI],
                      policy=sbx.policy, stdin=True)
        # stdin: the pid on a pipe; the pty becomes the controlling tty via fd 0 first.
        rd, wr = os.pipe()
        proc = subprocess.Popen(cmd, stdin=slave, stdout=subprocess.PIPE, stderr=slave,
                                preexec_fn=lambda: (make_ctty(), os.dup2(rd, 0)),
                                pass_fds=(rd,))
        os.close(rd)
        os.write(wr, f"{proc.pid}\n".encode())
        os.close(wr)
        proc.t0 = time.monotonic()
        r = sbx.finish(proc)
        time.sleep(0.2)
        try:
            injected = os.read(slave, 4096)
        except BlockingIOError:
            injected = b""
        assert not injected and "TIOCSTI-OK" not in r.out, \
            f"[{level}] bytes were injected into the supervisor's terminal: {injected!r}\n{r}"
    finally:
        os.close(master)
        os.close(slave)


# ====================================================================== bombs


def _uid_of_session(sbx, session):
    r = sbx.sh("id -u", session=session)
    assert r.json["class"] == "OK", r
    uid = int(r.out.strip())
    assert uid not in (0, NOBODY) and uid >= 1000, uid
    return uid


@pytest.mark.parametrize("shell,bomb", [("sh", "bomb(){ bomb|bomb& }; bomb; sleep 10"),
                                        ("bash", ":(){ :|:& };:; sleep 10")],
                         ids=["sh", "bash-colon"])
def test_fork_bomb(sbx, pids_cgroup, uid_sweeper, state_dir, level, shell, bomb):
    """A fork bomb under limits.processes = 64 and a 3 s timeout. (`sh -c ':(){ :|:& };:'`
    is a syntax error in dash — ':' is not a valid function name there — so the sh case
    uses a named function and the colon form runs under bash.) The bare bomb returns at
    once (the first call backgrounds everything), the call then ends OK and the shim sweeps
    the tree; `; sleep 10` keeps the tool alive so the bomb churns until the 3 s timeout
    and the whole tree must be stopped while it is still forking."""
    uid = _uid_of_session(sbx, "bomb")
    uid_sweeper(uid)
    peak = [0]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], len(live_of_uid(uid)))
            if peak[0] > 900:            # harness bound: our call's own processes
                kill_pids(live_of_uid(uid))
            time.sleep(0.02)
    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        proc = sbx.start([shell, "-c", bomb], policy=sbx.bomb_policy, session="bomb",
                         cgroup=pids_cgroup)
        time.sleep(1.0)
        # A second session, during the bomb, must still be served.
        other = sbx.call(["sh", "-c", "echo alive"], session="bystander", timeout=20)
        r = sbx.finish(proc, timeout=30)
    finally:
        stop.set()
        t.join(2)
    assert other.json["class"] == "OK" and other.out == "alive\n", other
    assert r.json["class"] in ("TOOL_TIMEOUT", "TOOL_ERROR", "RESOURCE_LIMIT"), r
    assert r.elapsed < 3 + 0.5 + 10, f"the bomb's call took {r.elapsed:.1f}s"
    left = wait_until(lambda: not live_of_uid(uid), 3)
    assert left, f"[{level}] processes of uid {uid} outlived the call: {live_of_uid(uid)}"
    assert peak[0] <= 64 + 2, f"[{level}] {peak[0]} processes of uid {uid} at once (cap 64)"
    after = sbx.call(["sh", "-c", "echo after"], session="bystander2", timeout=20)
    assert after.json["class"] == "OK", after


def test_memory_bomb(sbx, level):
    r = sbx.call(["python3", "-c", "b = bytearray(2**31); print('ALLOCATED')"],
                 policy=sbx.bomb_policy)
    assert r.json["class"] in ("TOOL_ERROR", "RESOURCE_LIMIT"), r
    assert "ALLOCATED" not in r.out, r
    # limits.memory (256 MiB) is the tree's resident memory, watched by the shim twenty
    # times a second: the bomb is killed far below its 2 GiB, past the limit by at most
    # what it writes in one interval
    assert r.json.get("max_rss_kb", 0) < 2 * 256 * 1024, r
    ok = sbx.call(["sh", "-c", "echo alive"])
    assert ok.json["class"] == "OK", ok


def test_memory_bomb_many_processes(sbx, uid_sweeper, level):
    """limits.memory = 256MiB, spent by 6 processes of 200 MiB each (1.2 GiB in all). Each
    stays under the limit alone; the host measures the session's total RSS. limits.memory
    is the resident memory of the call's whole tree (the shim's watch), so the total must
    stay within the limit."""
    uid = _uid_of_session(sbx, "mem")
    uid_sweeper(uid)
    hold = ("import time; b = bytearray(200 * 2**20); "
            "[b.__setitem__(i, 1) for i in range(0, len(b), 4096)]; time.sleep(1.5)")
    script = "".join(f'python3 -c "{hold}" & ' for _ in range(6)) + "wait; echo end"
    peak = [0]
    stop = threading.Event()

    def rss_kb(p):
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1])
        except (OSError, ValueError):
            pass
        return 0

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], sum(rss_kb(p) for p in live_of_uid(uid)))
            time.sleep(0.05)
    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        r = sbx.sh(script, policy=sbx.bomb_policy, session="mem")
    finally:
        stop.set()
        t.join(2)
    # Without a delegated cgroup (this host has none) the tree's total is enforced by the
    # shim's watchdog, which samples every 50 ms and kills the tree: the cap holds to
    # within what six processes can fault in during one interval on two cores, so the
    # bound here is twice the limit — still far below the 1.2 GiB the bomb asks for. A
    # hard cap needs cgroup v2 memory.max (doctor reports it unavailable here).
    # (On a loaded machine the six may not overlap enough to cross the cap before the 3 s
    # wall clock ends the call: then it is a TOOL_TIMEOUT, and the peak is what matters.)
    assert r.json["class"] in ("RESOURCE_LIMIT", "TOOL_TIMEOUT"), r
    assert peak[0] <= 2 * 256 * 1024, \
        f"[{level}] the session held {peak[0] // 1024} MiB at once under limits.memory = " \
        f"256MiB (result {r.json['class']})"


def test_daemon_outlives_call(sbx, marker, level):
    m = marker()
    script = ('exec 3>&1; '
              f'setsid sh -c "sleep 300.{m}1 &" ; '
              f'(setsid sh -c "sleep 300.{m}2 & echo \\$!" &) ; '
              f'nohup sleep 300.{m}3 >/dev/null 2>&1 & '
              f'(trap "" HUP TERM; exec sleep 300.{m}4) & '
              'sleep 0.3; echo started')
    r = sbx.sh(script, timeout_opt="10s")
    assert r.json["class"] == "OK", r
    left = not wait_until(lambda: not live_with_marker(m), 3)
    survivors = {p: cmdline(p) for p in live_with_marker(m)}
    assert not left, f"[{level}] daemons outlived the call: {survivors}"


def test_supervisor_sigkill_mid_call(sbx, marker, level):
    """SIGKILL the supervisor while its call runs a plain child, a setsid daemon and a
    double-forked grandchild: the PDEATHSIG chain (zygote, shim, tool) must end them all,
    and no zygote or shim may remain."""
    m = marker()
    script = (f'setsid sh -c "sleep 300.{m}1 &"; (sleep 300.{m}2 &); '
              f'trap "" TERM HUP; sleep 300.{m}0')
    proc = sbx.start(["sh", "-c", script])
    try:
        ok = wait_until(lambda: len(sleepers(m)) >= 3, 10)
        assert ok, f"the call did not start: {sleepers(m)}"
        tree = descendants(proc.pid)          # zygote (strict), shim, tool, daemons
        assert tree, "no descendants seen"
        print(f"[{level}] supervisor {proc.pid}, its tree before SIGKILL:",
              {p: cmdline(p).replace(b"\0", b" ")[:80] for p in tree})
        os.kill(proc.pid, signal.SIGKILL)     # our child, by pid
        proc.wait(10)
        gone = wait_until(lambda: not live_with_marker(m) and
                          not [p for p, st in tree.items() if alive(p, st)], 5)
        survivors = {p: cmdline(p) for p, st in tree.items() if alive(p, st)}
        survivors.update({p: cmdline(p) for p in live_with_marker(m)})
        assert gone, f"[{level}] processes survived the supervisor's SIGKILL: {survivors}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        if proc.stdout:
            proc.stdout.close()
            proc.stderr.close()
