"""The walls as `stockade serve` builds them, on both levels.

`serve` starts a call's tool from a runner, a spare shim made ahead of time (core/spawn.c,
core/sandbox_linux.c): the runner attaches the tool's whole seccomp filter to itself at
its first call and its tools inherit it, and Landlock comes from a ruleset built once per
session. The rest of the battery drives `stockade run`, which takes none of those
shortcuts; here the same kinds of attack go through the shortcut path, after warm-up
calls so that spares are in use."""
import json
import os
import shutil
import tempfile
import time

import pytest

from conftest import VISIBLE_BASE, token

PROBE = r"""
import ctypes, errno, json, os, socket, sys
libc = ctypes.CDLL(None, use_errno=True)
out = {}
def attempt(name, fn):
    try:
        fn()
        out[name] = "allowed"
    except OSError as e:
        out[name] = errno.errorcode.get(e.errno, str(e.errno))
def sock(family):
    def f():
        socket.socket(family, socket.SOCK_STREAM if family != socket.AF_NETLINK
                      else socket.SOCK_RAW).close()
    return f
def libc_call(fn, *args):
    def f():
        if fn(*args) != 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))
    return f
attempt("inet", sock(socket.AF_INET))
attempt("inet6", sock(socket.AF_INET6))
attempt("netlink", sock(socket.AF_NETLINK))
attempt("unshare_user", libc_call(libc.unshare, 0x10000000))
attempt("mount", libc_call(libc.mount, b"none", b"/tmp", b"tmpfs", 0, None))
def write_outside():
    with open(sys.argv[1], "w") as f:
        f.write("escaped")
attempt("write_outside", write_outside)
status = open("/proc/self/status").read()
out["status"] = {k: v.strip() for k, v in (l.split(":", 1) for l in status.splitlines())
                 if k in ("NoNewPrivs", "Seccomp", "Seccomp_filters", "Uid")}
def write_inside():
    with open(os.path.join(os.environ["AGENT_ROOT"], "workspace", "ok"), "w") as f:
        f.write("fine")
attempt("write_inside", write_inside)
print(json.dumps(out))
"""


@pytest.fixture
def outside_dir():
    """A world-writable host dir the tool must not write into (removed at teardown)."""
    path = tempfile.mkdtemp(prefix="stockade-sec-walls-", dir=VISIBLE_BASE)
    os.chmod(path, 0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def standby_ready(client, at_least):
    end = time.monotonic() + 10
    while time.monotonic() < end:
        if client.stats().get("standby", 0) >= at_least:
            return True
        time.sleep(0.05)
    return False


def test_walls_through_spares(served, outside_dir, level):
    s = served.open_session()
    # warm up: the session's first strict call waits for its zygote's first spare; after
    # it, and in process isolation once the spawner has delivered, calls use spares
    for _ in range(3):
        assert s.call("true").ok
    assert standby_ready(served, 2), served.stats()
    target = os.path.join(outside_dir, token("walls"))
    for attempt in range(3):
        r = s.call("python3", ["-c", PROBE, target])
        assert r.ok, (r.class_, r.message, r.stderr[-2000:])
        got = json.loads(r.stdout)
        # the closed network's rules and the base ones, in the filter the runner attached
        # to itself and its tool inherited
        assert got["inet"] == "EAFNOSUPPORT", got
        assert got["inet6"] == "EAFNOSUPPORT", got
        assert got["netlink"] == "EAFNOSUPPORT", got
        assert got["unshare_user"] == "EPERM", got
        assert got["mount"] == "EPERM", got
        assert got["write_outside"] in ("EACCES", "EROFS", "ENOENT"), got
        assert not os.path.exists(target), f"the tool wrote {target} on the host"
        assert got["write_inside"] == "allowed", got
        st = got["status"]
        assert st["NoNewPrivs"] == "1" and st["Seccomp"] == "2", st
        # one filter, not the base and a part stacked: each is run on every syscall
        assert st.get("Seccomp_filters", "1") == "1", st
        if os.geteuid() == 0:
            assert st["Uid"].split()[0] != "0", st
