"""Runners: under `stockade serve` a session's calls run on processes kept across calls
(core/zygote.c, core/spawn.c), one per call in flight. Each call's tree must be gone,
to the last process, when its answer arrives, whatever the tool did to outlive it; the
next call on the same runner must see nothing of it; and a tool must not reach the runner
itself (signals, ptrace, its descriptors and memory).

Every test first checks that its calls did run on one runner (strict: one pid namespace
across calls; process: one parent), so that it attacks what it means to."""
import errno
import json
import os
import subprocess
import sys

import pytest

from conftest import IS_ROOT, live_with_marker, strict_only

# The tool's view of its runner: strict, pid 1 of its namespace; process, its parent.
WHO = r"""
import json, os, sys
ns = os.readlink("/proc/self/ns/pid")
runner = 1 if sys.argv[1] == "strict" else os.getppid()
print(json.dumps({"ns": ns, "runner": runner, "pid": os.getpid(),
                  "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit())}))
"""

# Ways a tool's processes try to outlive its call; each leaves `sleep 300.MARKER` (or a
# process whose command line holds MARKER) behind and exits 0.
LEFTOVERS = {
    # setsid + double fork, and a nohup'd child in a new session
    "daemon": r"""
import os, subprocess, sys
m = sys.argv[1]
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv("/bin/sleep", ["sleep", "300." + m + "a"])
    os._exit(0)
subprocess.Popen(["setsid", "sleep", "300." + m + "b"], start_new_session=True)
print("ok")
""",
    # a child made a sibling of the tool (the runner's own child)
    "clone_parent": r"""
import ctypes, os, sys
m = sys.argv[1]
libc = ctypes.CDLL(None, use_errno=True)
CLONE_PARENT, SIGCHLD = 0x8000, 17
pid = libc.syscall(56, CLONE_PARENT | SIGCHLD, 0, 0, 0, 0)
if pid == 0:
    os.execv("/bin/sleep", ["sleep", "300." + m])
assert pid > 0, ctypes.get_errno()
print("ok")
""",
    # the tool makes itself a subreaper: its orphans land on it, then it exits
    "subreaper": r"""
import ctypes, os, sys, time
m = sys.argv[1]
libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(36, 1, 0, 0, 0) == 0, ctypes.get_errno()   # PR_SET_CHILD_SUBREAPER
if os.fork() == 0:
    if os.fork() == 0:
        os.setsid()
        os.execv("/bin/sleep", ["sleep", "300." + m])
    os._exit(0)
os.wait()
print("ok")
""",
    # a thread group whose leader has exited: a zombie leader, a live thread
    "leader_exit": r"""
import ctypes, os, sys, threading, time
m = sys.argv[1]
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(r)
    threading.Thread(target=time.sleep, args=(300,)).start()
    os.write(w, b"x")
    ctypes.CDLL(None).syscall(60, 0)        # SYS_exit: this thread only
os.close(w)
os.read(r, 1)
for _ in range(200):
    st = open(f"/proc/{pid}/status").read()
    if "State:\tZ" in st and "Threads:\t2" in st:
        break
    time.sleep(0.01)
print("ok" if "State:\tZ" in st else "no zombie leader")
""",
}


def who(s, level):
    r = s.call("python3", ["-c", WHO, level])
    assert r.ok, (r.class_, r.message, r.stderr)
    return json.loads(r.stdout)


def same_runner(a, b, level):
    return a["ns"] == b["ns"] if level == "strict" else a["runner"] == b["runner"]


@pytest.mark.parametrize("kind", sorted(LEFTOVERS))
def test_call_leaves_nothing_for_the_next(served, marker, level, kind):
    s = served.open_session()
    before = who(s, level)
    m = marker()
    r = s.call("python3", ["-c", LEFTOVERS[kind], m], timeout_ms=15_000)
    assert r.ok and r.stdout == b"ok\n", (kind, r.class_, r.message, r.stdout, r.stderr)
    # the answer is sent once the runner has reaped the call's last process: no wait here
    left = live_with_marker(m)
    assert not left, f"[{level}/{kind}] outlived the call's answer: {left}"
    after = who(s, level)
    assert same_runner(before, after, level), \
        f"[{level}] premise: the calls did not share a runner ({before}, {after})"
    if level == "strict":
        # the namespace the calls share holds only its init and the one tool running
        assert after["pids"] == sorted({1, after["pid"]}), \
            f"[strict/{kind}] a call saw processes of an earlier one: {after['pids']}"


@strict_only("process isolation shares the host's pid namespace")
def test_strict_call_sees_no_process_of_a_previous_call(served, marker, level):
    s = served.open_session()
    first = who(s, level)
    m = marker()
    r = s.call("sh", ["-c", f"setsid sleep 300.{m} & (sleep 301.{m} &); echo $!"])
    assert r.ok, (r.class_, r.message)
    leftover = int(r.stdout)
    second = who(s, level)
    assert first["ns"] == second["ns"], "premise: one pid namespace for the session's calls"
    assert leftover not in second["pids"], f"a call saw {leftover}, started by the one before"
    assert second["pids"] == sorted({1, second["pid"]}), second["pids"]


PROBE_RUNNER = r"""
import ctypes, errno, json, os, signal, sys
libc = ctypes.CDLL(None, use_errno=True)
runner = int(sys.argv[1])
out = {}
def attempt(name, fn):
    try:
        fn()
        out[name] = "allowed"
    except OSError as e:
        out[name] = errno.errorcode.get(e.errno, str(e.errno))
def ptrace():
    if libc.ptrace(16, runner, 0, 0) != 0:             # PTRACE_ATTACH
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
attempt("ptrace", ptrace)
attempt("fds", lambda: os.listdir(f"/proc/{runner}/fd"))
attempt("mem", lambda: open(f"/proc/{runner}/mem", "rb").close())
attempt("environ", lambda: open(f"/proc/{runner}/environ", "rb").read())
for sig in sys.argv[2:]:
    attempt(sig, lambda: os.kill(runner, getattr(signal, sig)))
print(json.dumps(out))
"""


def test_tool_cannot_reach_its_runner(served, level):
    if not IS_ROOT:
        pytest.skip("without root the tools share the runner's uid: only strict's pid 1 holds")
    s = served.open_session()
    before = who(s, level)
    # strict: TERM and USR1 to its init end the tool's own call (the runner's stop
    # signals); STOP and KILL from inside the namespace must do nothing
    sigs = ["SIGSTOP", "SIGKILL"] + (["SIGTERM", "SIGUSR1"] if level == "process" else [])
    r = s.call("python3", ["-c", PROBE_RUNNER, str(before["runner"])] + sigs)
    assert r.ok, (r.class_, r.message, r.stderr)
    got = json.loads(r.stdout)
    for what in ("ptrace", "fds", "mem", "environ"):
        assert got[what] != "allowed", f"[{level}] a tool could {what} its runner: {got}"
    if level == "process":
        # another uid: every signal refused
        for sig in sigs:
            assert got[sig] == "EPERM", f"[process] a tool signalled its runner: {got}"
    # strict: the runner is the namespace's init, which takes from inside only the
    # signals it handles (and ignores them between calls); either way it must still
    # serve the session's next call, the same runner
    after = who(s, level)
    assert same_runner(before, after, level), \
        f"[{level}] the runner did not survive its tool: {before} -> {after}"
    assert s.call("true").ok


def test_leader_exit_thread_group_through_run(sbx, marker, level):
    """The same thread group through `stockade run` (a shim of its own per call): a
    zombie leader was skipped by the tree walk, so the group ran on and the call hung to
    its timeout with an unresponsive shim."""
    m = marker()
    r = sbx.call(["python3", "-c", LEFTOVERS["leader_exit"], m], timeout_opt="15s")
    assert r.json["class"] == "OK" and r.out == "ok\n", r
    assert not live_with_marker(m), f"[{level}] a thread group outlived the call"


# Syscalls the filter refuses, each with arguments under which the kernel itself would
# answer otherwise (run unfiltered they succeed harmlessly or fail with another errno), so
# that what the tool sees can only be the filter's answer. x86_64 numbers.
DENIED = r"""
import ctypes, errno, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def sc(nr, *args):
    def f():
        rc = libc.syscall(nr, *[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
        if rc < 0:
            e = ctypes.get_errno()
            return errno.errorcode.get(e, str(e))
        if nr == 41 or nr == 425:       # socket, io_uring_setup: an fd
            os.close(rc)
        return "ok"
    return f
AF_NETLINK, AF_INET, AF_UNIX, SOCK_RAW, SOCK_STREAM = 16, 2, 1, 3, 1
TIOCSTI, KCMP_FILE, KEYCTL_GET_KEYRING_ID, KEY_SPEC_THREAD_KEYRING = 0x5412, 0, 0, -1
me = os.getpid()
probes = {
    "keyctl": sc(250, KEYCTL_GET_KEYRING_ID, KEY_SPEC_THREAD_KEYRING, 0),
    "io_uring_setup": sc(425, 0, None),
    "kcmp": sc(312, me, me, KCMP_FILE, 0, 0),
    "process_vm_readv": sc(310, me, None, 0, None, 0, 0),
    "name_to_handle_at": sc(303, -100, b"/", None, None, 0),
    "pidfd_getfd": sc(438, -1, 0, 0),
    "setns": sc(308, -1, 0),
    "unshare": sc(272, 0),
    "perf_event_open": sc(298, None, 0, -1, -1, 0),
    "open_tree": sc(428, -1, b"", 0),
    "settimeofday": sc(164, None, None),
    "clock_adjtime": sc(305, 0, None),
    "adjtimex": sc(159, None),
    "clone3": sc(435, None, 0),
    "ioctl_tiocsti": sc(16, 0, TIOCSTI, None),
    "socket_netlink": sc(41, AF_NETLINK, SOCK_RAW, 0),
    "socket_inet": sc(41, AF_INET, SOCK_STREAM, 0),
    # process isolation only: the host's IPC and file system
    "shmctl": sc(31, -1, 2, None),
    "msgctl": sc(71, -1, 2, None),
    "semctl": sc(66, -1, 0, 2, None),
    "mq_unlink": sc(241, b"/stockade-test-none"),
    "setxattr": sc(188, b"/stockade-test-none", b"user.x", b"v", 1, 0),
}
print(json.dumps({name: f() for name, f in probes.items()}))
"""
DENIED_ANSWER = {
    "clone3": "ENOSYS", "socket_netlink": "EAFNOSUPPORT", "socket_inet": "EAFNOSUPPORT",
    "setxattr": errno.errorcode[errno.EOPNOTSUPP],     # the name Python gives 95
}
HOST_SHARED = ("shmctl", "msgctl", "semctl", "mq_unlink", "setxattr")


def seccomp_filters(pid):
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
    return fields["Seccomp"].strip(), int(fields.get("Seccomp_filters", "1"))


def test_runner_filter_refuses_each_denied_syscall(served, level):
    """The runner attaches its tools' filter to itself at its first call, once: every
    later call's tool inherits it and attaches nothing. Each syscall the filter denies
    must still be refused, on every call the runner serves, and under one filter."""
    if os.uname().machine != "x86_64":
        pytest.skip("the probe uses x86_64 syscall numbers")
    # unfiltered (this test's own child): the kernel's answers, which the filter's must
    # differ from for a probe to tell anything
    outside = json.loads(subprocess.run([sys.executable, "-c", DENIED], check=True,
                                        stdin=subprocess.DEVNULL, capture_output=True,
                                        timeout=60).stdout)
    s = served.open_session()
    first = who(s, level)
    telling = 0
    for n in range(3):
        r = s.call("python3", ["-c", DENIED])
        assert r.ok, (r.class_, r.message, r.stderr[-2000:])
        got = json.loads(r.stdout)
        for name, answer in got.items():
            if level == "strict" and name in HOST_SHARED:
                # strict gives the session IPC of its own: these stay the kernel's
                assert answer not in ("EPERM", errno.errorcode[errno.EOPNOTSUPP]), (name, got)
                continue
            want = DENIED_ANSWER.get(name, "EPERM")
            if outside[name] == want:
                continue        # the kernel would answer the same: this probe tells nothing
            telling += n == 0
            assert answer == want, \
                f"[{level}] call {n + 1} on the runner: {name} answered {answer}, not {want}"
    assert telling >= 10, f"premise: too few probes tell the filter from the kernel: {outside}"
    # the same runner served them all, with one filter it kept
    after = who(s, level)
    assert same_runner(first, after, level), f"premise: one runner ({first}, {after})"
    if level == "process":
        assert seccomp_filters(after["runner"]) == ("2", 1), seccomp_filters(after["runner"])
    status = s.call("sh", ["-c", "grep -E '^Seccomp(_filters)?:' /proc/self/status"
                           + ("; grep -E '^Seccomp(_filters)?:' /proc/1/status"
                              if level == "strict" else "")])
    assert status.ok, (status.class_, status.message)
    lines = status.stdout.decode().split()
    # the tool, and under strict its runner (pid 1): filtered, by one filter
    assert lines[:4] == ["Seccomp:", "2", "Seccomp_filters:", "1"], lines
    if level == "strict":
        assert lines[4:] == ["Seccomp:", "2", "Seccomp_filters:", "1"], lines
