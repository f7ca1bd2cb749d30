"""What the pytest suites (tests/integration, tests/security, tests/redact) share: where
the repository, the binary and the fixtures are, a state directory a tool's uid can
reach, fixture policies at either isolation level, and reading processes from /proc.

tests/pytest.ini puts this directory (this module, serve_helpers.py) and contrib/python
(the client package) on sys.path, so a suite imports `from stockade_testlib import ...`
without knowing where it runs from.
"""

import atexit
import contextlib
import os
import random
import re
import shutil
import signal
import tempfile

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POLICY = os.path.join(REPO_ROOT, "policies", "default.lua")      # the shipped default
FIXTURES = os.path.join(REPO_ROOT, "tests", "fixtures")
PLUGINS = os.path.join(REPO_ROOT, "plugins")
CONTRIB_PYTHON = os.path.join(REPO_ROOT, "contrib", "python")
# The binary under test: $STOCKADE_BIN (what `make check` sets), else the repository's.
STOCKADE_BIN = os.environ.get("STOCKADE_BIN") or os.path.join(REPO_ROOT, "stockade")


@pytest.fixture(scope="session")
def stockade():
    """The path of the binary under test; the session fails if it is not there."""
    if not (os.path.isfile(STOCKADE_BIN) and os.access(STOCKADE_BIN, os.X_OK)):
        pytest.fail(f"stockade binary not found or not executable at {STOCKADE_BIN} "
                    f"(build it with `make` in {REPO_ROOT}, or set STOCKADE_BIN)")
    return STOCKADE_BIN


# ---------------------------------------------------------------- host directories


def force_rmtree(path):
    """Remove a file, a symlink or a tree, also directories left 0700 by another uid."""
    def onerror(func, p, exc_info):
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass
    if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
        try:
            os.unlink(path)
        except OSError:
            pass
    elif os.path.isdir(path):
        shutil.rmtree(path, onerror=onerror)


@contextlib.contextmanager
def state_directory(prefix):
    """A fresh 0755 state directory, removed on the way out.

    Not under pytest's tmp_path on purpose: that lives below /tmp/pytest-of-USER (mode
    0700), which a tool running under its own uid could not traverse to reach its
    workspace, and /tmp itself is replaced inside a strict sandbox. /var/tmp (or
    $STOCKADE_TEST_TMPDIR) has neither problem. The path is canonical so it compares
    equal to what stockade reports."""
    base = os.environ.get("STOCKADE_TEST_TMPDIR", "/var/tmp")
    path = os.path.realpath(tempfile.mkdtemp(prefix=prefix, dir=base))
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        force_rmtree(path)


# ---------------------------------------------------------------- fixtures at a level

_variants_dir = None


def policy_at_level(path, level):
    """The fixture policy at `path`, written once at isolation = "process", at `level`:
    the file itself for "process"; for another level a copy that differs only in its
    `isolation` (and a name ending in -process, which ends in -LEVEL), made once per run
    in a directory removed at exit. The tests and the bench take both levels from here."""
    if level == "process":
        return path
    global _variants_dir
    if _variants_dir is None:
        _variants_dir = tempfile.mkdtemp(prefix="stockade-fixtures-",
                                         dir=os.environ.get("STOCKADE_TEST_TMPDIR", "/var/tmp"))
        owner = os.getpid()      # not a forked child's exit
        atexit.register(lambda d=_variants_dir: os.getpid() == owner and force_rmtree(d))
    name = os.path.basename(path)
    out = os.path.join(_variants_dir, re.sub(r"_process\.lua$", "", name) + f"_{level}.lua")
    if not os.path.exists(out):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        text, n = re.subn(r'^(\s*)isolation = "process",', rf'\1isolation = "{level}",', text,
                          flags=re.M)
        if n != 1:
            raise ValueError(f"{path}: expected one `isolation = \"process\",` line, found {n}")
        text = re.sub(r'^(\s*name = "[^"]*)-process"', rf'\1-{level}"', text, count=1, flags=re.M)
        with open(out + ".tmp", "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(out + ".tmp", out)
    return out


def fixture_levels(name):
    """{level: path} of tests/fixtures/NAME_process.lua at both levels."""
    source = os.path.join(FIXTURES, f"{name}_process.lua")
    return {level: policy_at_level(source, level) for level in ("process", "strict")}


# ---------------------------------------------------------------- processes (/proc)


def cmdline(pid):
    """The NUL-separated command line of pid, b"" once it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def proc_stat(pid):
    """(state, ppid, starttime) of a pid, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            rest = f.read().rsplit(b")", 1)[1].split()
        return rest[0], int(rest[1]), int(rest[19])
    except (OSError, IndexError, ValueError):
        return None


def alive(pid, starttime=None):
    """pid exists and is not a zombie (and, given starttime, is the same process)."""
    st = proc_stat(pid)
    if st is None or st[0] in (b"Z", b"X"):
        return False
    return starttime is None or st[2] == starttime


def all_pids():
    return [int(n) for n in os.listdir("/proc") if n.isdigit()]


def live_with_marker(marker):
    """Pids of live (non-zombie) host processes, not this one, whose command line holds
    `marker`: the processes of a test's call, by construction."""
    me = os.getpid()
    return [p for p in all_pids()
            if p != me and marker.encode() in cmdline(p) and alive(p)]


def kill_pids(pids):
    """SIGKILL each pid (ours: found by a marker we put there), ignoring the gone."""
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


@pytest.fixture
def marker():
    """marker() -> digits that make a `sleep` argument (`sleep 300.<digits>`), and the
    script holding it, unique on the host, so its processes can be found whatever pid
    namespace the tool ran in. At teardown every live process holding one is SIGKILLed
    by pid (ours by construction), also when the test stopped early."""
    issued = []

    def _new():
        m = f"{random.randrange(10**8):08d}"
        issued.append(m)
        return m

    yield _new
    for m in issued:
        kill_pids(live_with_marker(m))
