"""Privilege on what a tool controls, cross-session channels, limit bypasses.

Each test replays an attack from a review of the supervisor (root, both levels, hostile
code only as tool calls) and judges from the host: a file that must not exist, a secret
that must not come back, a call that must end RESOURCE_LIMIT, a kernel object that must
not outlive its call. Attacks are bounded (a call's timeout, a few hundred MiB, a few
thousand inodes) and aimed only at the test's own temp dirs, its own IPC keys and its own
listeners.
"""

import ctypes
import json
import os
import re
import secrets
import socket
import subprocess
import tempfile

import pytest

from conftest import (NOBODY, POLICIES, RUN_TIMEOUT, VISIBLE_BASE, Stockade, force_rmtree,
                      descendants, mkdir_mode, proc_stat, read_bytes, strict_only, token,
                      wait_until, write_file)


def policy_file(tmpdir, level, *, limits='processes = 64, memory = "1GiB"', mounts=None,
                network='"none"'):
    """The battery's policy for `level` with other limits, mounts or network."""
    with open(POLICIES[level]) as f:
        text = f.read()
    text, n = re.subn(r"limits = \{[^}]*\},", f"limits = {{ {limits} }},", text, count=1)
    assert n == 1
    text = text.replace('network = "none",', f"network = {network},")
    if mounts:
        text = text.replace("  tools = {", f"  mounts = {{ {mounts} }},\n  tools = {{", 1)
    path = os.path.join(tmpdir, f"policy-{secrets.token_hex(4)}.lua")
    with open(path, "w") as f:
        f.write(text)
    return path


def run_raw(stockade, state_dir, policy, argv, *extra):
    """`stockade run` with options the fixture does not know (--uid-range), or whose
    refusal prints no JSON: (returncode, parsed JSON or None, stderr)."""
    cmd = [stockade, "run", "--state-dir", state_dir, "--policy", policy, "--json", *extra,
           "--", *argv]
    env = {k: v for k, v in os.environ.items() if k != "STOCKADE_DEPTH"}
    cp = subprocess.run(cmd, capture_output=True, timeout=RUN_TIMEOUT, env=env,
                        stdin=subprocess.DEVNULL)
    try:
        data = json.loads(cp.stdout.decode())
    except ValueError:
        data = None
    print(f"RUN {argv!r:.200} rc={cp.returncode} json={str(data)[:1500]} "
          f"stderr={cp.stderr[-800:]!r}")
    return cp.returncode, data, cp.stderr.decode(errors="replace")


# ====================================================================== 1. the cwd


def test_cwd_swapped_workspace_is_refused(served, level):
    """Call 1 replaces workspace by a symlink to a directory of its own; call 2 must not
    start there (the shim enters the cwd as root): refused, INTERNAL."""
    s = served.open_session()
    tok = token()
    r1 = s.call("sh", ["-c", 'cd "$AGENT_ROOT" && mkdir -p tmp/elsewhere && mv workspace w.old && '
                       'ln -s "$AGENT_ROOT/tmp/elsewhere" workspace && echo swapped'])
    assert r1.ok and b"swapped" in r1.stdout, (r1.class_, r1.message, r1.stderr)
    r2 = s.call("sh", ["-c", f"echo {tok}; pwd -P"])
    assert tok.encode() not in r2.stdout, f"[{level}] call 2 started in the planted cwd: {r2.stdout!r}"
    assert r2.class_ == "INTERNAL", (r2.class_, r2.message)


def test_cwd_replaced_by_another_directory_is_refused(served, level):
    """Not a symlink this time: workspace renamed away and a fresh directory put in its
    place. Entering it would be harmless, but it is not the directory the session created,
    and the supervisor says so rather than guessing."""
    s = served.open_session()
    tok = token()
    r1 = s.call("sh", ["-c", 'cd "$AGENT_ROOT" && mv workspace w.old && mkdir workspace && echo ok'])
    assert r1.ok, (r1.class_, r1.message, r1.stderr)
    r2 = s.call("sh", ["-c", f"echo {tok}"])
    assert tok.encode() not in r2.stdout and r2.class_ == "INTERNAL", (r2.class_, r2.message)


def _parent(pid):
    st = proc_stat(pid)
    return st[1] if st else None       # gone meanwhile


def _spares(server_pid):
    """Live children of the server's children: the spare shims its zygotes keep."""
    kids = [p for p in descendants(server_pid) if _parent(p) == server_pid]
    return [p for k in kids for p in descendants(k) if _parent(p) == k]


def test_refused_calls_do_not_drain_the_spares(served, level):
    """A call refused before its tool starts (here: its workspace replaced) must still
    let its zygote make the next spare, or a session could empty the server's pool."""
    s = served.open_session()
    for _ in range(3):
        assert s.call("true").ok
    assert wait_until(lambda: len(_spares(served.proc.pid)) >= 1, 10), "premise: spares"
    before = len(_spares(served.proc.pid))
    r1 = s.call("sh", ["-c", 'cd "$AGENT_ROOT" && mv workspace w.old && mkdir workspace'])
    assert r1.ok, (r1.class_, r1.message)
    for _ in range(6):
        assert s.call("true").class_ == "INTERNAL"
    assert wait_until(lambda: len(_spares(served.proc.pid)) >= before, 10), \
        f"[{level}] spares {len(_spares(served.proc.pid))} after refused calls, {before} before"


def test_cwd_swap_reads_unreachable_dir(served, level, cleanup):
    """The real escape: the planted cwd is a 0755 dir below a 0700 root-owned dir, which
    the tool's uid cannot reach by path. Under process the target is on the host; under
    strict, inside the session's world (in its root, made root-owned by the host)."""
    tok = token()
    s = served.open_session()
    r0 = s.call("sh", ["-c", 'echo "$AGENT_ROOT"'])
    root = r0.stdout.decode().strip()
    assert r0.ok and root, (r0.class_, r0.message)
    if level == "process":
        base = mkdir_mode("/var/tmp", 0o700)
    else:
        base = os.path.join(root, "tmp", "locked")
        os.mkdir(base, 0o700)
    cleanup(base)
    inner = os.path.join(base, "inner")
    os.mkdir(inner, 0o755)
    write_file(os.path.join(inner, "secret"), tok + "\n", 0o644)
    control = s.call("sh", ["-c", f'cat "{inner}/secret"'])
    assert tok.encode() not in control.stdout, "premise: the tool's uid must not reach the dir by path"
    r1 = s.call("sh", ["-c", f'cd "$AGENT_ROOT" && mv workspace w.old && ln -s "{inner}" workspace'])
    assert r1.ok, (r1.class_, r1.message, r1.stderr)
    r2 = s.call("sh", ["-c", "cat secret; echo end"])
    assert tok.encode() not in r2.stdout, f"[{level}] the tool read a root-only dir through its cwd"


# ====================================================================== 2. mount destinations


@strict_only("policy mounts exist only in the strict world")
def test_mount_dest_through_planted_symlink(stockade, state_dir, hostdirs, cleanup, level):
    """A kept root and a nested mount destination: run 1 replaces `a` by a symlink to a
    host dir; run 2's world build must not create root-owned b/c there."""
    src = mkdir_mode(VISIBLE_BASE, 0o755)
    cleanup(src)
    write_file(os.path.join(src, "README"), "mounted\n")
    pol = policy_file(state_dir, level,
                      mounts=f'{{ "{src}", "workspace/a/b/c", ro = true }}')
    victim = hostdirs.visible
    s = "mnt-" + secrets.token_hex(4)
    sb = Stockade(stockade, state_dir)
    r1 = sb.call(["sh", "-c", 'cat "$AGENT_ROOT/workspace/a/b/c/README" && '
                  f'cd "$AGENT_ROOT/workspace" && mv a a.old && ln -s "{victim}" a && echo planted'],
                 policy=pol, session=s)
    assert r1.json["class"] == "OK" and "planted" in r1.out, r1
    host_a = os.path.join(state_dir, "sessions", s, "workspace", "a")
    assert os.path.islink(host_a), "premise: the planted symlink is on the host"
    rc, d2, err = run_raw(stockade, state_dir, pol, ["sh", "-c", "echo run2"], "--session", s)
    assert not os.path.lexists(os.path.join(victim, "b")), \
        "the world build created a mount destination through the planted symlink"
    # refused (the destination cannot be made beneath the root), never built elsewhere
    assert d2 is None and "symbolic links" in err, (rc, d2, err)


# ====================================================================== 3, 4. shared memory


SHM_ATTACK = r"""
import ctypes, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
key, n, size = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
for i in range(n):
    sid = libc.shmget(key + i, size, 0o1000 | 0o666)
    if sid < 0:
        print("shmget err", ctypes.get_errno(), flush=True); sys.exit(3)
    addr = libc.shmat(sid, None, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        print("shmat err", ctypes.get_errno(), flush=True); sys.exit(4)
    ctypes.memset(addr, 0x41, size)
    libc.shmdt(ctypes.c_void_p(addr))
    print("segment", i, flush=True)
print("all segments", flush=True)
time.sleep(3)
print("survived", flush=True)
"""


def _host_shm_keys():
    with open("/proc/sysvipc/shm") as f:
        next(f)
        return {int(line.split()[0]) for line in f if line.strip()}


@pytest.fixture
def shm_keys():
    """Random SysV keys for one test; any segment left on the host with one is removed."""
    base = secrets.randbelow(1 << 28) + (1 << 29)
    yield base
    libc = ctypes.CDLL(None, use_errno=True)
    for k in range(base, base + 8):
        sid = libc.shmget(k, 0, 0)
        if sid >= 0:
            libc.shmctl(sid, 0, None)       # IPC_RMID


def test_sysv_shm_does_not_outlive_the_call(sbx, shm_keys, level):
    """A segment made by a call must not stay in the host's IPC namespace, where a later
    session (another uid) could attach it."""
    r = sbx.call(["python3", "-c", SHM_ATTACK, str(shm_keys), "1", str(1 << 20)])
    assert r.json["class"] in ("OK", "TOOL_ERROR", "RESOURCE_LIMIT"), r
    left = {k for k in _host_shm_keys() if shm_keys <= k < shm_keys + 8}
    assert not left, f"[{level}] the tool's SysV segment outlived its call on the host"


def test_sysv_shm_counted_in_memory(sbx, shm_keys, state_dir, level):
    """Three 100 MiB segments under memory = 256MiB: refused or counted, never OK."""
    pol = policy_file(state_dir, level, limits='processes = 64, memory = "256MiB"')
    r = sbx.call(["python3", "-c", SHM_ATTACK, str(shm_keys), "3", str(100 << 20)], policy=pol)
    assert "survived" not in r.out, f"[{level}] 300 MiB of SysV shm under a 256 MiB limit"
    assert r.json["class"] in ("RESOURCE_LIMIT", "TOOL_ERROR"), r


MEMFD_ATTACK = r"""
import os, sys, time
fds = []
chunk = b"A" * (1 << 20)
for i in range(6):
    fd = os.memfd_create("m%d" % i)
    for _ in range(50):
        os.write(fd, chunk)
    fds.append(fd)
    print("memfd", i, flush=True)
time.sleep(3)
print("survived", flush=True)
"""


def test_memfd_counted_in_memory(sbx, state_dir, level):
    """Six memfds of 50 MiB written with write() (never mapped: no RSS) under 256 MiB."""
    pol = policy_file(state_dir, level, limits='processes = 64, memory = "256MiB"')
    r = sbx.call(["python3", "-c", MEMFD_ATTACK], policy=pol)
    assert "survived" not in r.out, f"[{level}] 300 MiB of memfd under a 256 MiB limit"
    assert r.json["class"] == "RESOURCE_LIMIT", r


SHARED_ANON_ATTACK = r"""
import mmap, os, sys, time
for i in range(4):
    if os.fork() == 0:
        m = mmap.mmap(-1, 80 << 20, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
        for off in range(0, 80 << 20, 4096):
            m[off] = 1
        time.sleep(4)
        os._exit(0)
time.sleep(3)
print("survived", flush=True)
"""


def test_shared_anonymous_memory_counted(sbx, state_dir, level):
    """Shared anonymous mappings are shmem, not anonymous pages: four processes holding
    80 MiB each under memory = 256MiB."""
    pol = policy_file(state_dir, level, limits='processes = 64, memory = "256MiB"')
    r = sbx.call(["python3", "-c", SHARED_ANON_ATTACK], policy=pol)
    assert "survived" not in r.out, f"[{level}] 320 MiB of shared anonymous memory under 256"
    assert r.json["class"] == "RESOURCE_LIMIT", r


# ====================================================================== 5. disk and inodes


def test_disk_quota(sbx, state_dir, level):
    """Five 20 MiB files (each under file_size) against disk = 64MiB."""
    st = os.statvfs(state_dir)
    if st.f_bavail * st.f_frsize < 256 << 20:
        pytest.skip(f"premise: the state dir's file system has room for the 64 MiB the "
                    f"limit lets through (free: {st.f_bavail * st.f_frsize >> 20} MiB)")
    pol = policy_file(state_dir, level,
                      limits='processes = 64, memory = "1GiB", disk = "64MiB", inodes = 100000')
    r = sbx.sh('for i in 1 2 3 4 5; do head -c 20971520 /dev/zero > "$AGENT_ROOT/workspace/f$i" '
               '|| exit 9; done; sleep 3; echo survived', policy=pol)
    assert "survived" not in r.out, f"[{level}] 100 MiB written under disk = 64MiB"
    assert r.json["class"] == "RESOURCE_LIMIT", r


def test_inode_quota(sbx, state_dir, level):
    """5000 empty directories against inodes = 2000."""
    pol = policy_file(state_dir, level,
                      limits='processes = 64, memory = "1GiB", disk = "1GiB", inodes = 2000')
    r = sbx.call(["python3", "-c",
                  "import os, time\nr = os.environ['AGENT_ROOT'] + '/workspace'\n"
                  "for i in range(5000): os.mkdir('%s/d%d' % (r, i))\n"
                  "time.sleep(3)\nprint('survived')"], policy=pol)
    assert "survived" not in r.out, f"[{level}] 5000 inodes under inodes = 2000"
    assert r.json["class"] == "RESOURCE_LIMIT", r


@strict_only("policy mounts exist only in the strict world")
def test_inode_quota_skips_policy_mounts(stockade, state_dir, cleanup, level):
    """A read-only policy mount (a bind of the same file system) is not the session's:
    its 3000 files do not count against inodes = 2000."""
    src = mkdir_mode(VISIBLE_BASE, 0o755)
    cleanup(src)
    for i in range(3000):
        open(os.path.join(src, f"f{i}"), "w").close()
    pol = policy_file(state_dir, level,
                      limits='processes = 64, memory = "1GiB", disk = "1GiB", inodes = 2000',
                      mounts=f'{{ "{src}", "workspace/repo", ro = true }}')
    r = Stockade(stockade, state_dir).call(
        ["sh", "-c", 'ls "$AGENT_ROOT/workspace/repo" | wc -l; sleep 1; echo done'], policy=pol)
    assert r.json["class"] == "OK" and "3000" in r.out and "done" in r.out, r


# ====================================================================== 6. kept roots' uids


@pytest.fixture
def pinned_uid(cleanup):
    """One uid of the service range for a test; the kept-root record stockade leaves for
    it next to the uid locks is removed at teardown."""
    uid = 219000 + secrets.randbelow(900)
    cleanup(f"/run/stockade/uids/{uid}.kept")
    return uid


@pytest.mark.parametrize("where", ["same state dir", "another state dir"])
def test_kept_root_keeps_its_uid(stockade, state_dir, pinned_uid, level, where):
    """The uid range pinned to one uid: a kept root's uid must not be handed to a later,
    unrelated session (of this supervisor's state dir or another's), which would then own
    the kept files."""
    uid = pinned_uid
    rng = f"{uid}-{uid}"
    other_state = state_dir if where == "same state dir" else os.path.join(state_dir, "other")
    pol = POLICIES[level]
    tok = token()
    kept = "kept-" + secrets.token_hex(4)
    rc, d1, _ = run_raw(stockade, state_dir, pol,
                        ["sh", "-c", f'umask 077; echo {tok} > "$AGENT_ROOT/workspace/secret"; '
                         'echo "$AGENT_ROOT"'], "--session", kept, "--uid-range", rng)
    assert d1 and d1["class"] == "OK", d1
    secret = os.path.join(d1["stdout"].strip(), "workspace", "secret")
    assert os.stat(secret).st_uid == uid
    rc, d2, err = run_raw(stockade, other_state, pol,
                          ["sh", "-c", f'cat "{secret}"; id -u'], "--uid-range", rng)
    got = (d2 or {}).get("stdout", "")
    assert tok not in got, f"[{level}] a later session drew the kept root's uid and read it"
    if d2 and d2["class"] == "OK":
        assert got.split()[-1] != str(uid), f"[{level}] the kept root's uid was handed out"


# ====================================================================== 8, 9. the strict world


@strict_only("the mount tree")
def test_tmp_writable_with_state_dir_under_tmp(stockade, level):
    state = tempfile.mkdtemp(prefix="stockade-sec-tmpstate-", dir="/tmp")
    os.chmod(state, 0o755)
    try:
        r = Stockade(stockade, state).call(
            ["sh", "-c", "echo hello > /tmp/f && cat /tmp/f"], policy=POLICIES["strict"])
        assert r.json["class"] == "OK" and "hello" in r.out, r
    finally:
        force_rmtree(state)


@strict_only("the mount tree")
def test_session_tmp_nosuid_nodev(sbx, level):
    r = sbx.sh("awk '$5 == \"/tmp\" || $5 == \"/var/tmp\" {print $5, $6}' /proc/self/mountinfo")
    lines = [ln for ln in r.out.splitlines() if ln.strip()]
    assert lines, r
    for ln in lines:
        opts = ln.split()[1].split(",")
        assert "nosuid" in opts and "nodev" in opts, f"session tmp mounted without nosuid,nodev: {ln}"


@strict_only("the pid namespace")
def test_proc1_cmdline_is_not_the_supervisors(sbx, state_dir, level):
    r = sbx.sh("tr '\\0' ' ' < /proc/1/cmdline; echo")
    assert r.json["class"] == "OK", r
    assert state_dir not in r.out and "--policy" not in r.out, \
        f"/proc/1/cmdline shows the supervisor's command line: {r.out!r}"


@strict_only("the network namespace")
def test_sys_class_net_hides_host_interfaces(sbx, level):
    host = [i for i in os.listdir("/sys/class/net") if i != "lo"]
    if not host:
        pytest.skip("premise: the host has no interface but lo")
    r = sbx.sh("ls /sys/class/net")
    seen = set(r.out.split())
    assert not (seen & set(host)), f"host interfaces visible: {sorted(seen & set(host))}"


# ====================================================================== the process level


def test_proc_hides_host_command_lines(sbx, marker, level):
    """A host process (ours, root) with a secret on its command line: the tool must not
    list it in /proc, nor read its command line."""
    m = marker()
    proc = subprocess.Popen(["sleep", f"300.{m}"])
    try:
        r = sbx.sh(f'cat /proc/{proc.pid}/cmdline; echo; '
                   'for f in /proc/[0-9]*/cmdline; do tr "\\0" " " < "$f"; echo; done')
    finally:
        proc.kill()
        proc.wait(5)
    assert r.json["class"] in ("OK", "TOOL_ERROR"), r
    assert m not in r.out, f"[{level}] the tool read a host process's command line"


def test_proc_hides_host_command_lines_through_spares(served, marker, level):
    """The same through `serve`, whose calls start from spare shims made ahead."""
    m = marker()
    proc = subprocess.Popen(["sleep", f"300.{m}"])
    try:
        s = served.open_session()
        for _ in range(3):
            assert s.call("true").ok
        r = s.call("sh", ["-c", f'cat /proc/{proc.pid}/cmdline; echo; '
                          'for f in /proc/[0-9]*/cmdline; do tr "\\0" " " < "$f"; echo; done'])
    finally:
        proc.kill()
        proc.wait(5)
    assert m.encode() not in r.stdout, f"[{level}] the tool read a host process's command line"


def test_pathname_unix_socket_to_host_daemon(sbx, cleanup, level):
    """network = "none": a host daemon's pathname socket (world-connectable, like a
    docker.sock with lax modes) must not be reachable."""
    d = mkdir_mode(VISIBLE_BASE, 0o755)
    cleanup(d)
    path = os.path.join(d, "daemon.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        srv.bind(path)
        os.chmod(path, 0o777)
        srv.listen(4)
        srv.settimeout(0.2)
        r = sbx.call(["python3", "-c",
                      "import socket, sys\ns = socket.socket(socket.AF_UNIX)\n"
                      "s.connect(sys.argv[1]); s.send(b'hi'); print('connected')", path])
        hits = 0
        try:
            while True:
                c, _ = srv.accept()
                hits += 1
                c.close()
        except (socket.timeout, BlockingIOError):
            pass
    finally:
        srv.close()
    assert "connected" not in r.out and hits == 0, \
        f"[{level}] the tool connected to a host daemon's socket with network none"


def test_loopback_refused_under_process(stockade, state_dir, level):
    """network = "loopback" under process is the host's whole network: refused at load."""
    pol = policy_file(state_dir, level, network='"loopback"')
    tok = token()
    rc, data, err = run_raw(stockade, state_dir, pol, ["sh", "-c", f"echo {tok}"])
    if level == "strict":
        assert data and data["class"] == "OK", data
        return
    assert rc != 0 and tok not in ((data or {}).get("stdout", "")), \
        "a process-level policy with network loopback was accepted"
    assert "loopback" in err + json.dumps(data or {})


def test_xattr_on_world_writable_host_file(sbx, hostdirs, level):
    """Landlock handles no xattr right: setxattr on a 0666 host file outside the root."""
    victim = os.path.join(hostdirs.visible, "victim")
    write_file(victim, "v\n", 0o666)
    try:
        os.setxattr(victim, "user.stockade_premise", b"1")
        os.removexattr(victim, "user.stockade_premise")
    except OSError as e:
        pytest.skip(f"premise: the host file system takes no user xattrs ({e})")
    sbx.call(["python3", "-c", "import os, sys\nos.setxattr(sys.argv[1], 'user.x', b'1')",
              victim])
    assert "user.x" not in os.listxattr(victim), f"[{level}] the tool set an xattr on a host file"


def test_doctor_states_the_levels_guarantees(stockade, level):
    """Nobody may believe a level gives more than it does: doctor says what it does not."""
    cp = subprocess.run([stockade, "doctor"], capture_output=True, timeout=60)
    out = cp.stdout.decode()
    section = out.split(f"guarantees, isolation {level}")
    assert len(section) == 2, out
    body = section[1].split("guarantees, isolation")[0]
    assert "\n    + " in body and "\n    - " in body, body
    if level == "process":
        assert "/proc" in body and "loopback" in body, body
    assert "the operator must add" in out and "cgroup" in out.split("the operator must add")[1]


@pytest.mark.parametrize("level", ["process", pytest.param("strict", marks=pytest.mark.skip(
    reason="strict: another session's root is not in the world at all (test_read_other_session)"))])
def test_non_root_sessions_cannot_read_each_other(stockade, cleanup, level):
    """A supervisor that is not root runs every session as its own uid: file modes cannot
    keep sessions apart, so the walls must. Session A reads B's 0600 file by path."""
    base = mkdir_mode("/var/tmp", 0o755)
    cleanup(base)
    os.chown(base, NOBODY, NOBODY)
    state = os.path.join(base, "state")
    tok = token()

    def run(*args):
        cmd = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
               "env", "-i", "PATH=/usr/bin:/bin", stockade, "run", "--state-dir", state,
               "--policy", POLICIES[level], "--json", *args]
        cp = subprocess.run(cmd, capture_output=True, timeout=RUN_TIMEOUT,
                            stdin=subprocess.DEVNULL)
        print(f"RUN {args!r:.200} rc={cp.returncode} {cp.stdout[:800]!r} {cp.stderr[-400:]!r}")
        return json.loads(cp.stdout.decode()) if cp.stdout.strip() else {}
    b = run("--session", "victim", "--", "sh", "-c",
            f'umask 077; echo {tok} > "$AGENT_ROOT/workspace/secret"; echo ok')
    assert b.get("class") == "OK", b
    secret = os.path.join(state, "sessions", "victim", "workspace", "secret")
    assert read_bytes(secret).decode().strip() == tok
    a = run("--", "sh", "-c", f'cat "{secret}"; ls "{state}/sessions/victim/workspace"; '
            f'cat "$AGENT_ROOT/../victim/workspace/secret"; echo end')
    assert a.get("class") in ("OK", "TOOL_ERROR"), a
    assert tok not in a.get("stdout", ""), "session A read session B's private file"
    # its own files it still reads and writes
    own = run("--", "sh", "-c", 'echo mine > "$AGENT_ROOT/workspace/f" && '
              'cat "$AGENT_ROOT/workspace/f" /etc/hostname >/dev/null && echo fine')
    assert own.get("class") == "OK" and "fine" in own.get("stdout", ""), own
