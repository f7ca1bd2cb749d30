"""Integration tests of `stockade run`, the one-shot CLI (PROTOCOL.md, "The one-shot CLI").

Each test asserts facts observed from the host (files, modes, owners, processes, the
exact bytes returned), not only an exit status. Waits are bounded by the fixtures'
timeouts; nothing sleeps and hopes.
"""

import os
import re
import signal
import stat
import subprocess
import time

import pytest

from conftest import RUN_TIMEOUT, grace_seconds, output_cap
from stockade_testlib import FIXTURES, POLICY, alive, cmdline, kill_pids, live_with_marker, proc_stat

ACCEPT_POLICY = os.path.join(FIXTURES, "accept.lua")
SESSION_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
RESULT_FIELDS = ("class", "retryable", "exit_code", "signal", "stdout", "stderr",
                 "truncated", "redactions", "duration_ms", "cpu_ms", "max_rss_kb")
ALLOWED_ENV = {"SESSION_ID", "AGENT_ROOT", "HOME", "TMPDIR", "XDG_CACHE_HOME", "PATH",
               "LANG", "STOCKADE_DEPTH"}
SHELL_NOISE_ENV = {"PWD", "OLDPWD", "SHLVL", "_"}

is_root = os.geteuid() == 0
root_only = pytest.mark.skipif(not is_root, reason="needs the supervisor to run as root")


# ---------------------------------------------------------------- helpers


def is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


@pytest.fixture
def nonce(marker):
    """stockade_testlib's marker: digits for `sleep 300.<digits>`, its processes killed
    at teardown."""
    return marker


def sessions_left(state_dir):
    d = os.path.join(state_dir, "sessions")
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


def assert_processes_gone(marker, printed_pid=None, bound=3.0):
    """No process of this call may outlive it. A SIGKILLed process can take a moment to
    leave the process table, so poll up to `bound` seconds; a `sleep 300` that really
    survived is still there at the end. Survivors are killed (by pid) after the failure
    is recorded, so a failing run does not leave them on the machine."""
    end = time.monotonic() + bound
    while True:
        survivors = live_with_marker(marker)
        pid_alive = printed_pid is not None and marker.encode() in cmdline(printed_pid) \
            and alive(printed_pid)
        if not survivors and not pid_alive:
            return
        if time.monotonic() > end:
            break
        time.sleep(0.05)
    details = {p: cmdline(p).replace(b"\0", b" ") for p in survivors}
    kill_pids(survivors)
    pytest.fail(f"processes of the call survived it (printed pid {printed_pid}): {details}")


def parse_env(output):
    env = {}
    for line in output.decode("utf-8", "replace").splitlines():
        assert "=" in line, f"unexpected env line {line!r} in {output!r}"
        k, v = line.split("=", 1)
        env[k] = v
    return env


def first_int_line(data):
    text = data.decode() if isinstance(data, bytes) else data
    lines = text.strip().splitlines()
    assert lines, f"expected a pid on stdout, got {data!r}"
    return int(lines[0])


# ---------------------------------------------------------------- basic results


def test_echo_prints_output(run):
    cp = run(["--", "echo", "hi"])
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout == b"hi\n"


def test_echo_json_result(run_json):
    cp = run_json(["--", "echo", "hi"])
    r = cp.json
    assert cp.returncode == 0, cp.stderr
    for field in RESULT_FIELDS:
        assert field in r, f"result lacks {field!r}: {r}"
    assert r["class"] == "OK"
    assert r["exit_code"] == 0
    assert r["signal"] is None
    assert r["stdout"] == "hi\n"
    assert r["stderr"] == ""
    assert r["retryable"] is False
    assert r["truncated"] == {"stdout": 0, "stderr": 0}
    assert r["redactions"] == 0
    for field in ("duration_ms", "cpu_ms", "max_rss_kb"):
        assert is_int(r[field]) and r[field] >= 0, f"{field} = {r[field]!r}"


def test_unknown_tool_is_policy_violation(run, state_dir):
    cp = run(["--", "nosuchtool"])
    assert cp.returncode == 126, cp.stderr
    assert cp.stdout == b""
    assert sessions_left(state_dir) == []


def test_unknown_tool_json(run_json, state_dir):
    cp = run_json(["--", "nosuchtool", "arg"])
    r = cp.json
    assert cp.returncode == 126
    assert r["class"] == "POLICY_VIOLATION"
    assert r["retryable"] is False
    assert r.get("exit_code") is None
    assert r.get("signal") is None
    assert "\n" not in r.get("message", ""), "message must be one line"
    assert sessions_left(state_dir) == []


def test_false_is_tool_error(run, run_json):
    assert run(["--", "false"]).returncode == 1
    cp = run_json(["--", "false"])
    assert cp.returncode == 1
    assert cp.json["class"] == "TOOL_ERROR"
    assert cp.json["exit_code"] == 1
    assert cp.json.get("signal") is None
    assert isinstance(cp.json["retryable"], bool)


def test_stderr_captured_separately(run, run_json):
    script = "echo out; echo err >&2"
    cp = run_json(["--", "sh", "-c", script])
    assert cp.returncode == 0, cp.stderr
    assert cp.json["stdout"] == "out\n"
    assert cp.json["stderr"] == "err\n"
    cp = run(["--", "sh", "-c", script])
    assert cp.returncode == 0
    assert cp.stdout == b"out\n"
    assert b"err\n" in cp.stderr


def test_invalid_utf8_gives_valid_json(run_json):
    cp = run_json(["--", "sh", "-c", r"printf '\377\376ok'"])  # run_json: strict UTF-8 + json.loads
    assert cp.returncode == 0, cp.stderr
    out = cp.json["stdout"]
    assert out.endswith("ok"), repr(out)
    assert "\ufffd" in out, f"invalid bytes not replaced by U+FFFD: {out!r}"
    assert not any(0xD800 <= ord(c) <= 0xDFFF for c in out), f"lone surrogates: {out!r}"


def test_signal_death(run, run_json):
    cp = run(["--", "sh", "-c", "kill -SEGV $$"])
    assert cp.returncode == 128 + signal.SIGSEGV
    cp = run_json(["--", "sh", "-c", "kill -SEGV $$"])
    assert cp.returncode == 128 + signal.SIGSEGV
    assert cp.json["signal"] == signal.SIGSEGV
    assert cp.json["exit_code"] is None
    assert cp.json["class"] != "OK"


# ---------------------------------------------------------------- timeouts and process trees


def test_timeout_plain_exit_status(run, nonce):
    marker = nonce()
    cp = run(["--timeout", "300ms", "--", "sleep", f"30.{marker}"])
    assert cp.returncode == 124, cp.stderr
    assert cp.elapsed < grace_seconds() + 10, f"took {cp.elapsed:.1f}s"
    assert_processes_gone(marker)


def test_timeout_json(run_json, nonce):
    marker = nonce()
    cp = run_json(["--timeout", "300ms", "--", "sleep", f"30.{marker}"])
    assert cp.returncode == 124
    assert cp.json["class"] == "TOOL_TIMEOUT"
    assert cp.json["layer"] == "timeout"
    assert isinstance(cp.json["retryable"], bool)
    assert cp.elapsed < grace_seconds() + 10, f"took {cp.elapsed:.1f}s"
    assert_processes_gone(marker)


def test_timeout_term_ignored_is_killed(run_json, nonce):
    marker = nonce()
    script = f'echo $$; trap "" TERM; sleep 30.{marker}'
    cp = run_json(["--timeout", "300ms", "--", "sh", "-c", script])
    assert cp.returncode == 124, cp.stderr
    assert cp.json["class"] == "TOOL_TIMEOUT"
    assert cp.json["layer"] == "timeout"
    assert cp.json["signal"] == signal.SIGKILL
    assert cp.elapsed < grace_seconds() + 10, f"took {cp.elapsed:.1f}s"
    assert_processes_gone(marker, first_int_line(cp.json["stdout"]))


def test_daemonizer_setsid_is_killed(run_json, nonce):
    marker = nonce()
    script = f"setsid sleep 300.{marker} & echo $!"
    # --timeout: a supervisor that waits for the daemon's copy of stdout to close shows
    # up as TOOL_TIMEOUT instead of OK, not as a hung test.
    cp = run_json(["--timeout", "10s", "--", "sh", "-c", script])
    assert cp.returncode == 0, cp.stderr
    assert cp.json["class"] == "OK"
    assert_processes_gone(marker, first_int_line(cp.json["stdout"]))


def test_daemonizer_double_fork_is_killed(run_json, nonce):
    marker = nonce()
    # The grandchild is reparented away from the tool (its parent sh exits), is in its
    # own session, and holds the tool's stdout (fd 3). The pid comes back through a
    # command substitution whose pipe the grandchild does not hold, so no timing is
    # involved.
    script = ("exec 3>&1; "
              f'pid=$( (setsid sh -c "sleep 300.{marker} >&3 & echo \\$!" &) ); '
              'echo "$pid"')
    cp = run_json(["--timeout", "10s", "--", "sh", "-c", script])
    assert cp.returncode == 0, cp.stderr
    assert cp.json["class"] == "OK"
    assert_processes_gone(marker, first_int_line(cp.json["stdout"]))


def test_output_flood_is_capped(run_json):
    cap = output_cap()
    total = 300_000_000
    cp = run_json(["--", "sh", "-c", f"yes | head -c {total}"], timeout=60)
    r = cp.json
    assert cp.returncode == 0, cp.stderr
    assert r["class"] == "OK"
    assert len(r["stdout"]) == cap
    assert set(r["stdout"]) <= {"y", "\n"}
    assert r["truncated"] == {"stdout": total - cap, "stderr": 0}


def test_output_flood_keeps_supervisor_small(stockade, state_dir):
    # The supervisor's peak RSS, read from a wrapper that waits for it alone: 300 MB went
    # through it, and it must have kept only the 1 MiB cap (sanitizer builds are bigger,
    # hence the generous bound — still far below the flood).
    import subprocess, sys
    probe = (
        "import resource, subprocess, sys\n"
        "subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, timeout=60)\n"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
    )
    cmd = [sys.executable, "-c", probe, stockade, "run", "--state-dir", state_dir,
           "--policy", os.path.join(os.path.dirname(FIXTURES), "..", "policies", "default.lua"),
           "--", "sh", "-c", "yes | head -c 300000000"]
    out = subprocess.run(cmd, capture_output=True, timeout=90, check=True)
    max_rss_kb = int(out.stdout.strip())
    assert 0 < max_rss_kb < 96 * 1024, f"supervisor peaked at {max_rss_kb} KiB"


def test_output_flood_plain_is_capped(run):
    cap = output_cap()
    cp = run(["--", "sh", "-c", "yes | head -c 300000000"], timeout=60)
    assert cp.returncode == 0, cp.stderr[-2000:]
    assert len(cp.stdout) == cap


# ---------------------------------------------------------------- identity, env, cwd, fds


@root_only
def test_tool_uid_is_not_root(run):
    cp = run(["--", "sh", "-c", "id -u"])
    assert cp.returncode == 0, cp.stderr
    assert int(cp.stdout.strip()) != 0


@root_only
def test_tool_has_no_root_group(run):
    cp = run(["--", "sh", "-c", "id -G; id -g"])
    assert cp.returncode == 0, cp.stderr
    groups = cp.stdout.split()
    assert groups, cp.stdout
    assert b"0" not in groups, f"tool is in group 0: {cp.stdout!r}"


def test_env_is_built_from_nothing(run, state_dir):
    secrets = {"SECRET_TOKEN": "s3cr3t-value", "AWS_SECRET_ACCESS_KEY": "aws-s3cr3t-x",
               "STOCKADE_IT_CANARY": "canary-value-7f3a"}
    env = dict(secrets)
    env["PATH"] = "/nonexistent-supervisor-canary:" + os.environ.get("PATH", "/usr/bin:/bin")
    cp = run(["--", "sh", "-c", "env"], env=env)
    assert cp.returncode == 0, cp.stderr
    for k, v in secrets.items():
        assert k.encode() not in cp.stdout, f"{k} leaked into the tool's env"
        assert v.encode() not in cp.stdout, f"value of {k} leaked into the tool's env"
    assert b"nonexistent-supervisor-canary" not in cp.stdout, "supervisor's PATH was inherited"

    tool_env = parse_env(cp.stdout)
    unexpected = set(tool_env) - ALLOWED_ENV - SHELL_NOISE_ENV
    assert not unexpected, f"unexpected names in the tool's env: {sorted(unexpected)}"
    missing = ALLOWED_ENV - set(tool_env)
    assert not missing, f"missing from the tool's env: {sorted(missing)}"

    sid = tool_env["SESSION_ID"]
    assert SESSION_ID_RE.match(sid), sid
    root = tool_env["AGENT_ROOT"]
    assert root == os.path.join(state_dir, "sessions", sid)
    assert tool_env["HOME"] == root + "/home"
    assert tool_env["TMPDIR"] == root + "/tmp"
    assert tool_env["XDG_CACHE_HOME"] == root + "/cache"
    assert tool_env["LANG"] == "C.UTF-8"
    assert all(p.startswith("/") for p in tool_env["PATH"].split(":")), tool_env["PATH"]
    assert sessions_left(state_dir) == []


def test_cwd_is_workspace(run):
    cp = run(["--", "sh", "-c", 'echo "$AGENT_ROOT"; pwd'])
    assert cp.returncode == 0, cp.stderr
    root, cwd = cp.stdout.decode().splitlines()
    assert root, "AGENT_ROOT empty"
    assert cwd == root + "/workspace"


def test_only_std_descriptors_inherited(run):
    # `ls` lists its own descriptors: 0, 1, 2 and the one it opened on /proc/self/fd
    # itself. Anything else was inherited from the supervisor.
    cp = run(["--", "sh", "-c", "exec ls -l /proc/self/fd/"])
    assert cp.returncode == 0, cp.stderr
    fds = {}
    for line in cp.stdout.decode().splitlines():
        m = re.search(r" (\d+) -> (.*)$", line)
        if m:
            fds[int(m.group(1))] = m.group(2)
    assert {0, 1, 2} <= set(fds), cp.stdout
    extra = {fd: t for fd, t in fds.items() if fd > 2}
    own = [fd for fd, t in extra.items() if re.fullmatch(r"/proc/\d+/fd", t)]
    leaked = {fd: t for fd, t in extra.items() if fd not in own[:1]}
    assert not leaked, f"descriptors leaked into the tool: {leaked}"


# ---------------------------------------------------------------- session roots


def test_session_root_removed_after_run(run, state_dir):
    cp = run(["--", "sh", "-c", 'echo data > "$AGENT_ROOT/workspace/f"; echo "$AGENT_ROOT"'])
    assert cp.returncode == 0, cp.stderr
    root = cp.stdout.decode().strip()
    assert root.startswith(os.path.join(state_dir, "sessions") + "/"), root
    assert not os.path.lexists(root)
    assert sessions_left(state_dir) == []


def test_named_session_is_kept(run, state_dir):
    cp = run(["--session", "keepme", "--", "sh", "-c", 'id -u; echo "$AGENT_ROOT"'])
    assert cp.returncode == 0, cp.stderr
    uid_line, root = cp.stdout.decode().splitlines()
    assert root == os.path.join(state_dir, "sessions", "keepme")
    for sub in ("workspace", "tmp", "cache", "home"):
        path = os.path.join(root, sub)
        st = os.lstat(path)
        assert stat.S_ISDIR(st.st_mode), f"{path} is not a directory"
        assert stat.S_IMODE(st.st_mode) == 0o700, f"{path} mode {oct(st.st_mode)}"
        if is_root:
            assert st.st_uid == int(uid_line), f"{path} owned by {st.st_uid}, tool ran as {uid_line}"


def test_symlinks_out_of_root_not_followed_on_removal(run, state_dir, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("keep me\n")
    (outside / "sub").mkdir()
    (outside / "sub" / "deep.txt").write_text("deep\n")
    script = (f'ln -s {outside} "$AGENT_ROOT/workspace/link" && '
              f'ln -s {outside}/precious.txt "$AGENT_ROOT/tmp/plink" && '
              f'ln -s {outside}/sub "$AGENT_ROOT/cache/slink" && '
              'echo "$AGENT_ROOT"')
    cp = run(["--", "sh", "-c", script])
    assert cp.returncode == 0, f"the links were not created: {cp.stderr!r}"
    root = cp.stdout.decode().strip()
    assert (outside / "precious.txt").read_text() == "keep me\n"
    assert (outside / "sub" / "deep.txt").read_text() == "deep\n"
    assert sorted(os.listdir(outside)) == ["precious.txt", "sub"]
    assert not os.path.lexists(root)
    assert sessions_left(state_dir) == []


@root_only
def test_tool_cannot_write_outside_its_root(run, state_dir):
    probes = ["/root/stockade-probe", os.path.join(state_dir, "stockade-probe")]
    for p in probes:
        if os.path.lexists(p):
            os.unlink(p)
    try:
        for p in probes:
            cp = run(["--", "sh", "-c", f"echo x > {p}"])
            assert cp.returncode != 0, f"tool wrote {p}"
            assert not os.path.lexists(p), f"{p} exists after the call"
    finally:
        for p in probes:
            if os.path.lexists(p):
                os.unlink(p)


# ---------------------------------------------------------------- depth


def test_depth_default(run):
    cp = run(["--", "sh", "-c", 'echo "$STOCKADE_DEPTH"'])
    assert cp.returncode == 0, cp.stderr
    assert int(cp.stdout.strip()) >= 0


@pytest.mark.parametrize("depth", [1, 3])
def test_depth_from_env(run, depth):
    cp = run(["--", "sh", "-c", 'echo "$STOCKADE_DEPTH"'], env={"STOCKADE_DEPTH": str(depth)})
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout == f"{depth - 1}\n".encode()


def test_depth_exhausted_is_refused(run_json, state_dir):
    script = 'echo STARTED; : > "$AGENT_ROOT/workspace/started-marker"'
    cp = run_json(["--session", "deep", "--", "sh", "-c", script], env={"STOCKADE_DEPTH": "0"})
    assert cp.returncode == 126
    assert cp.json["class"] == "POLICY_VIOLATION"
    assert cp.json["retryable"] is False
    assert cp.json.get("exit_code") is None
    assert "STARTED" not in cp.json.get("stdout", "")
    for dirpath, _dirs, files in os.walk(state_dir):
        assert "started-marker" not in files, f"the tool ran: {dirpath}"


# ---------------------------------------------------------------- misuse


@pytest.mark.parametrize("args", [[], ["--"]], ids=["no-args", "dashdash-only"])
def test_no_tool_is_misuse(run, args):
    cp = run(args)
    assert cp.returncode == 125
    err = cp.stderr.decode(errors="replace").strip()
    assert err, "no error message"
    # A usage synopsis may come first; the error itself is the last line, one line,
    # not a continuation of the synopsis.
    last = err.splitlines()[-1]
    assert last.strip() and not last[0].isspace(), f"no one-line error at the end: {err!r}"
    assert not last.lower().startswith("usage"), f"only a usage synopsis, no error: {err!r}"


def test_missing_policy_is_misuse(run):
    cp = run(["--", "echo", "hi"], policy="/nonexistent/policy.lua")
    assert cp.returncode == 125
    assert cp.stdout == b""
    assert cp.stderr.strip(), "no error message"


def test_bad_timeout_is_misuse(run):
    cp = run(["--timeout", "banana", "--", "echo", "hi"])
    assert cp.returncode == 125
    assert cp.stdout == b""
    assert b"timeout" in cp.stderr.lower(), cp.stderr


def test_policy_syntax_error_is_misuse(run, tmp_path):
    bad = tmp_path / "broken-policy.lua"
    bad.write_text('local stockade = require "stockade"\nreturn stockade.policy {\n  name = "x",\n')
    cp = run(["--", "echo", "hi"], policy=str(bad))
    assert cp.returncode == 125
    assert cp.stdout == b""
    assert b"broken-policy.lua" in cp.stderr, cp.stderr


# ---------------------------------------------------------------- accept hooks


def test_accept_allows(run, run_json):
    cp = run(["--", "echo", "quiet"], policy=ACCEPT_POLICY)
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout == b"quiet\n"
    cp = run_json(["--", "echo", "quiet"], policy=ACCEPT_POLICY)
    assert cp.json["class"] == "OK"


@pytest.mark.parametrize("argv", [["LOUD"], ["a", "very-LOUD-word", "b"]], ids=["first", "middle"])
def test_accept_refuses_with_reason(run, run_json, argv):
    cp = run(["--", "echo", *argv], policy=ACCEPT_POLICY)
    assert cp.returncode == 126
    assert b"LOUD" not in cp.stdout, "the tool ran"
    cp = run_json(["--", "echo", *argv], policy=ACCEPT_POLICY)
    assert cp.returncode == 126
    r = cp.json
    assert r["class"] == "POLICY_VIOLATION"
    assert r["retryable"] is False
    assert "no shouting" in r["message"]
    assert "\n" not in r["message"]
    assert r.get("exit_code") is None
    assert "LOUD" not in r.get("stdout", ""), "the tool ran"


def test_tool_not_in_fixture_policy(run_json):
    cp = run_json(["--", "sh", "-c", "echo ran"], policy=ACCEPT_POLICY)
    assert cp.returncode == 126
    assert cp.json["class"] == "POLICY_VIOLATION"
    assert "ran" not in cp.json.get("stdout", "")


@pytest.mark.parametrize("tool", ["boom", "spin", "sneaky"])
def test_accept_failure_fails_closed(run_json, tool):
    cp = run_json(["--", tool, "should-not-print"], policy=ACCEPT_POLICY, timeout=RUN_TIMEOUT)
    assert cp.returncode == 126, cp.stderr
    assert cp.json["class"] == "POLICY_VIOLATION"
    assert cp.json["retryable"] is False
    assert "should-not-print" not in cp.json.get("stdout", ""), "the tool ran"


# ---------------------------------------------------------------- the call's shim


def rss_anon_kb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    raise AssertionError(f"no RssAnon for {pid}")


def test_shim_is_no_copy_of_the_supervisor_and_ends_with_it(stockade, state_dir, nonce):
    """Process isolation: the call's shim (the tool's parent, which ends its tree) comes
    from a spawner forked before the policy was loaded, not from the loaded supervisor:
    it holds none of the supervisor's heap (the policy, its Lua state), so its anonymous
    memory is a fraction of the supervisor's, where a fork of the supervisor held as much.
    The spawner and the shim are gone once `run` has exited."""
    if os.environ.get("STOCKADE_SANITIZED"):
        pytest.skip("sanitizer runtimes make every process's memory large")
    marker = nonce()
    env = dict(os.environ)
    env.pop("STOCKADE_DEPTH", None)
    proc = subprocess.Popen([stockade, "run", "--state-dir", state_dir, "--policy", POLICY,
                             "--timeout", "20s", "--", "sh", "-c", f"exec sleep 300.{marker}"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, start_new_session=True)
    try:
        tool_argv = b"\x00".join([b"sleep", f"300.{marker}".encode(), b""])
        end = time.monotonic() + RUN_TIMEOUT
        tools = []
        while not tools and time.monotonic() < end and proc.poll() is None:
            tools = [p for p in live_with_marker(marker) if cmdline(p) == tool_argv]
            time.sleep(0.02)
        assert tools, f"the tool did not start (run's status: {proc.poll()})"
        shim = proc_stat(tools[0])[1]
        chain, p = [], shim
        while p not in (proc.pid, 0, 1) and len(chain) < 8:
            chain.append((p, proc_stat(p)[2]))
            p = proc_stat(p)[1]
        assert p == proc.pid, f"the shim {shim} is not below the supervisor {proc.pid}"
        shim_kb, supervisor_kb = rss_anon_kb(shim), rss_anon_kb(proc.pid)
        assert shim_kb * 2 < supervisor_kb, \
            f"the shim holds {shim_kb} KiB of anonymous memory, the supervisor {supervisor_kb}"
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=RUN_TIMEOUT)
        assert proc.returncode == 130
        gone_by = time.monotonic() + 3
        while [p for p, st in chain if alive(p, st)] and time.monotonic() < gone_by:
            time.sleep(0.02)
        left = {p: cmdline(p) for p, st in chain if alive(p, st)}
        assert not left, f"the run's helpers outlived it: {left}"
        assert_processes_gone(marker)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
