"""Fixtures for the integration tests of `stockade run`.

The real binary is driven as an orchestrator would drive it: a subprocess with a bounded
wait. Every test gets its own state directory, so leftovers of one test never hide or
cause a failure in another.

    /usr/bin/python3 -m pytest -q tests/integration
"""

import json
import os
import re
import resource
import signal
import subprocess
import time

import pytest

from stockade_testlib import FIXTURES, POLICY, marker, state_directory, stockade  # noqa: F401 (fixtures)

# Upper bound on how long one `stockade run` may take before the test calls it hung.
RUN_TIMEOUT = 30.0

_SIZE_UNITS = {"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30,
               "KB": 1000, "MB": 1000 ** 2, "GB": 1000 ** 3}
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_size(text):
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]i?B|B)?\s*", text)
    if not m:
        raise ValueError(f"not a size: {text!r}")
    return int(m.group(1)) * _SIZE_UNITS[m.group(2) or ""]


def parse_duration(text):
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)\s*", text)
    if not m:
        raise ValueError(f"not a duration: {text!r}")
    return float(m.group(1)) * _DURATION_UNITS[m.group(2)]


def default_policy_value(key, parse, fallback):
    """A `key = "VALUE"` literal of policies/default.lua, parsed; `fallback` when the
    policy does not declare it (the core's documented default then applies)."""
    try:
        with open(POLICY, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return fallback
    m = re.search(r"\b" + re.escape(key) + r"\s*=\s*\"([^\"]+)\"", text)
    if not m:
        return fallback
    try:
        return parse(m.group(1))
    except ValueError:
        return fallback


def output_cap():
    """Per-stream output cap of the default policy (1 MiB unless it says otherwise)."""
    return default_policy_value("output", parse_size, 1 << 20)


def grace_seconds():
    """SIGTERM-to-SIGKILL grace of the default policy (2 s unless it says otherwise)."""
    return default_policy_value("grace", parse_duration, 2.0)


def _base_env():
    env = dict(os.environ)
    # A depth inherited from whatever runs the tests would change what is under test.
    env.pop("STOCKADE_DEPTH", None)
    return env


def _run(cmd, env, timeout, input_bytes):
    """Run cmd in its own process group; on timeout kill that group (ours, by id) and
    fail the test with what was captured so far."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE if input_bytes is not None else subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(input=input_bytes, timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        pytest.fail(f"stockade did not return within {timeout:.0f}s: {cmd!r}\n"
                    f"stdout: {out[-2000:]!r}\nstderr: {err[-2000:]!r}")
    cp = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    cp.elapsed = time.monotonic() - start
    return cp


@pytest.fixture
def state_dir():
    """A fresh state directory per test (stockade_testlib.state_directory)."""
    with state_directory("stockade-it-") as path:
        yield path


@pytest.fixture
def run(stockade, state_dir):
    """run(args, policy=None, env=None, timeout=RUN_TIMEOUT, input=None, json_out=False)

    Runs `stockade run --state-dir STATE --policy POLICY [--json] ARGS...`. `env` entries
    are added to (value None: removed from) the test's environment. Returns a
    CompletedProcess (bytes) with an extra `elapsed` attribute in seconds."""

    def _do(args, *, policy=None, env=None, timeout=RUN_TIMEOUT, input=None, json_out=False):
        cmd = [stockade, "run", "--state-dir", state_dir, "--policy", policy or POLICY]
        if json_out:
            cmd.append("--json")
        cmd.extend(args)
        full_env = _base_env()
        for k, v in (env or {}).items():
            if v is None:
                full_env.pop(k, None)
            else:
                full_env[k] = v
        return _run(cmd, full_env, timeout, input)

    return _do


@pytest.fixture
def run_json(run):
    """Like `run` with --json; stdout must be one UTF-8 JSON object, parsed into the
    CompletedProcess's extra `json` attribute."""

    def _do(args, **kw):
        cp = run(args, json_out=True, **kw)
        try:
            text = cp.stdout.decode("utf-8")  # strict: invalid UTF-8 is a failure
            data = json.loads(text)
        except (UnicodeDecodeError, ValueError) as e:
            pytest.fail(f"--json output is not valid UTF-8 JSON ({e}); exit {cp.returncode}\n"
                        f"stdout: {cp.stdout[:2000]!r}\nstderr: {cp.stderr[-2000:]!r}")
        assert isinstance(data, dict), f"--json output is not an object: {data!r}"
        cp.json = data
        return cp

    return _do


# ---------------------------------------------------------------- recovery and faults


@pytest.fixture(scope="session")
def strict_available(stockade):
    """Whether this host can give strict isolation (what `stockade doctor` says)."""
    cp = subprocess.run([stockade, "doctor"], capture_output=True, text=True, timeout=30)
    return "isolation strict:  available" in cp.stdout


@pytest.fixture(params=["process", "strict"])
def level(request, strict_available):
    """Both isolation levels; strict skipped, with the reason, where the host lacks it."""
    if request.param == "strict" and not strict_available:
        pytest.skip("this host cannot give strict isolation (stockade doctor)")
    return request.param


@pytest.fixture
def servers(stockade, state_dir, tmp_path):
    """start(policy=fixtures/recovery_process.lua, args=()) -> a `stockade serve --listen`
    (serve_helpers.ServeProc) on the test's state dir; each stopped at teardown, its
    stderr printed."""
    from serve_helpers import ServeProc, stop_all
    started = []

    def start(policy=os.path.join(FIXTURES, "recovery_process.lua"), args=()):
        s = ServeProc(stockade, state_dir, policy, args, listen=True, log_dir=str(tmp_path))
        started.append(s)
        return s

    yield start
    for s in started:
        if s.alive():
            try:     # a test that lowered its descriptor limit may have failed midway
                resource.prlimit(s.pid, resource.RLIMIT_NOFILE, (4096, 4096))
            except OSError:
                pass
    stop_all(started, lambda s: print(f"---- stderr of {' '.join(s.cmd)}\n"
                                      f"{open(s.log_path, 'rb').read()[-3000:]!r}"))
