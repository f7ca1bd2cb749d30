"""The policy engine through the real server: a hostile hook costs one call (refused,
withheld or default-classified), never the server; a reload swaps generations while a
running call finishes under the one it started with."""

import os
import shutil
import subprocess

import pytest

from serve_helpers import RPC_TIMEOUT, Client
from stockade_testlib import FIXTURES, STOCKADE_BIN as BIN

HOSTILE = os.path.join(FIXTURES, "hostile.lua")
GEN_A = os.path.join(FIXTURES, "reload_gen_a.lua")
GEN_B = os.path.join(FIXTURES, "reload_gen_b.lua")


@pytest.fixture
def serve(state_dir):
    clients = []

    def start(policy):
        c = Client.spawn([BIN, "serve", "--policy", policy, "--state-dir", state_dir],
                         rpc_timeout=RPC_TIMEOUT, stderr=subprocess.DEVNULL)
        clients.append(c)
        return c

    yield start
    for c in clients:
        c.close()


@pytest.mark.parametrize("tool", ["loop", "swallow", "bomb", "global", "errerr", "wrongtype"])
def test_hostile_accept_costs_one_call(serve, tool):
    c = serve(HOSTILE)
    s = c.open_session()
    r = s.call(tool, ["x"])
    assert r.class_ == "POLICY_VIOLATION", r
    assert r.exit_code is None and r.stdout == b""      # nothing was started
    # the server, and the same Lua state, still serve the next call
    ok = s.call("echo", ["still", "serving"])
    assert ok.class_ == "OK" and ok.stdout == b"still serving\n"
    s.close()


@pytest.mark.parametrize("tool", ["redactloop", "redactbad"])
def test_hostile_redactor_withholds_the_output(serve, tool):
    c = serve(HOSTILE)
    s = c.open_session()
    r = s.call(tool, ["the-output-that-could-not-be-checked"])
    assert b"the-output-that-could-not-be-checked" not in r.stdout
    assert b"withheld" in r.stdout
    assert s.call("echo", ["ok"]).stdout == b"ok\n"
    s.close()


def test_hostile_classify_keeps_the_default(serve):
    c = serve(HOSTILE)
    s = c.open_session()
    r = s.call("classifyloop", ["-c", "exit 3"])
    assert r.class_ == "TOOL_ERROR" and r.exit_code == 3
    s.close()


def test_reload_new_calls_new_generation_running_call_keeps_its_own(serve, tmp_path):
    path = str(tmp_path / "policy.lua")
    shutil.copy(GEN_A, path)
    c = serve(path)
    gen_a = c.hello().policy["generation"]
    s = c.open_session()
    # started under A: prints a secret of each generation after the reload has happened
    fifo_wait = "i=0; while [ ! -e $TMPDIR/go ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done"
    h = s.start_call("slowecho", ["-c", fifo_wait + "; echo alpha-secret beta-secret"])
    shutil.copy(GEN_B, path)     # policy.reload re-reads the server's own file
    res = c.reload_policy()
    assert res["generation"] > gen_a
    # release the running call only after the swap
    assert s.call("slowecho", ["-c", "touch $TMPDIR/go"]).class_ == "OK"
    old = h.result(RPC_TIMEOUT)
    assert old.class_ == "OK"
    assert old.stdout == b"[A] beta-secret\n", old.stdout      # generation A's redactor
    new = s.call("slowecho", ["-c", "echo alpha-secret beta-secret"])
    assert new.stdout == b"alpha-secret [B]\n", new.stdout     # generation B's
    s.close()


def test_broken_reload_keeps_the_working_policy(serve, tmp_path):
    path = tmp_path / "policy.lua"
    shutil.copy(GEN_A, path)
    c = serve(str(path))
    before = c.hello().policy
    path.write_text("return stockade.policy { oops = }\n")
    with pytest.raises(Exception) as e:
        c.reload_policy()
    assert "BAD_REQUEST" in repr(e.value) or "policy.lua" in str(e.value)
    after = c.hello().policy
    assert after["generation"] == before["generation"] and after["sha256"] == before["sha256"]
    s = c.open_session()
    assert s.call("slowecho", ["-c", "echo alpha-secret"]).stdout == b"[A]\n"
    s.close()


def test_a_long_hook_leaves_the_clock_true(tmp_path):
    """Two calls pipelined in one read: the first one's accept hook runs until its wall
    budget (1 s) stops it; the second (sleep 0.8 under a 1.5 s timeout) is decided in
    the same loop turn. Its timeout must count from when it started, not from the loop's
    cached time before the hook."""
    from serve_helpers import ServeProc
    os.chmod(tmp_path, 0o755)
    sp = ServeProc(BIN, str(tmp_path), os.path.join(FIXTURES, "stale_clock.lua"), raw=True)
    try:
        raw = sp.raw
        sid = raw.call_ok("session.open", {})["session_id"]
        import msgpack
        first, second = 9001, 9002
        raw.send_bytes(
            msgpack.packb([0, first, "call", {"session_id": sid, "tool": "slowhook",
                                              "argv": []}], use_bin_type=True) +
            msgpack.packb([0, second, "call", {"session_id": sid, "tool": "sleep",
                                               "argv": ["0.8"]}], use_bin_type=True))
        err, r1 = raw.response(first)
        assert err is None and r1["class"] == "POLICY_VIOLATION", (err, r1)
        err, r2 = raw.response(second)
        assert err is None, err
        assert r2["class"] == "OK", r2
    finally:
        sp.stop()


TOOL_LIMITS = os.path.join(FIXTURES, "tool_limits.lua")


def test_tool_memory_limit_holds(serve):
    s = serve(TOOL_LIMITS).open_session()
    r = s.call("small_memory", ["-c", "import time; b = b'x' * (100 << 20); time.sleep(2)"])
    assert r.class_ == "RESOURCE_LIMIT", r
    assert s.call("sh", ["-c", "echo ok"]).class_ == "OK"
    s.close()


def test_tool_process_limit_holds(serve):
    s = serve(TOOL_LIMITS).open_session()
    r = s.call("few_processes", ["-c", "for i in 1 2 3 4 5 6 7 8 9 10; do sleep 2 & done; wait"])
    assert r.class_ == "RESOURCE_LIMIT", r
    # the same script under the policy's limit of 64 runs
    assert s.call("sh", ["-c", "for i in 1 2 3 4 5 6 7 8 9 10; do true & done; wait"]).class_ == "OK"
    s.close()


def test_tool_file_size_limit_holds(serve):
    s = serve(TOOL_LIMITS).open_session()
    s.call("small_files", ["-c", "head -c 8388608 /dev/zero > big"])
    size = os.path.getsize(os.path.join(s.root, "workspace", "big"))
    assert size <= 1 << 20, size
    s.close()


def test_memory_is_resident_not_address_space(serve):
    if not os.path.exists("/usr/bin/node"):
        pytest.skip("no /usr/bin/node")
    s = serve(TOOL_LIMITS).open_session()
    r = s.call("node", ["-e", "console.log(1)"])
    assert r.class_ == "OK" and r.stdout == b"1\n", r
    # address_space is its own limit, and it holds
    r = s.call("capped_space", ["-c", "b = b'x' * (128 << 20)"])
    assert r.class_ == "RESOURCE_LIMIT", r
    s.close()


def test_doctor_suggests_no_fix_that_would_not_help():
    """There is no cgroup layer: doctor must not send an operator to delegate a
    subtree, and must say what holds the limits instead."""
    out = subprocess.run([BIN, "doctor"], capture_output=True, text=True, timeout=60)
    line = next((l for l in (out.stdout + out.stderr).splitlines()
                 if l.strip().startswith("cgroup")), None)
    assert line is not None, out.stdout
    assert "not implemented" in line, line
    assert "no delegated" not in line and "RLIMIT_AS" not in line, line
    assert "limits.memory" in line, line


def test_hook_errors_are_logged_at_warn_with_tool_hook_and_line(tmp_path):
    """A classify that returns a wrong type falls back to the default class, and says
    so in the log: warn, the tool, the hook and where it is defined."""
    from serve_helpers import ServeProc
    os.chmod(tmp_path, 0o755)
    fixture = os.path.join(FIXTURES, "hook_errors.lua")
    sp = ServeProc(BIN, str(tmp_path), fixture)
    try:
        s = sp.client.open_session()
        r = s.call("wrongclass", ["-c", "exit 3"])
        assert r.class_ == "TOOL_ERROR", r          # the default stands
        s.close()
        log = sp.stderr_text()
        line = next((l for l in log.splitlines() if "wrongclass" in l and "hook" in l), "")
        assert "warn" in line, log[-2000:]
        assert "hook classify" in line and "hook_errors.lua:14" in line, line
        assert "unknown class" in line, line
    finally:
        sp.stop()


GC_LOOP = os.path.join(FIXTURES, "gc_loop.lua")


def test_a_looping_finalizer_cannot_hang_run(tmp_path):
    """`run` closes the Lua state on its way out, which runs every pending finalizer:
    a policy cannot leave one behind."""
    os.chmod(tmp_path, 0o755)
    r = subprocess.run([BIN, "run", "--policy", GC_LOOP, "--state-dir", str(tmp_path), "--",
                        "leaves_gc", "x"], capture_output=True, timeout=60)
    assert r.returncode is not None


def test_a_looping_finalizer_cannot_stall_serve(serve):
    c = serve(GC_LOOP)
    s = c.open_session()
    for _ in range(40):
        s.call("leaves_gc", ["x"])
    # the server, the collector having come by, still answers
    assert s.call("echo", ["alive"]).stdout == b"alive\n"
    s.close()


def test_run_takes_structured_args_and_refuses_raw_argv_for_a_hook_tool(tmp_path):
    """A tool with an argv hook: `run --args JSON` goes through the schema and the hook;
    a raw argv, which would skip both, is refused."""
    os.chmod(tmp_path, 0o755)
    policy = os.path.join(FIXTURES, "integrity.lua")
    env = dict(os.environ)
    env.pop("STOCKADE_PLUGIN_PATH", None)       # the fixture's own plugins/ directory
    ok = subprocess.run([BIN, "run", "--json", "--policy", policy, "--state-dir", str(tmp_path),
                         "--args", '{"subcommand": "status"}', "--", "git"],
                        capture_output=True, text=True, timeout=60, env=env)
    import json
    r = json.loads(ok.stdout)
    # git ran (outside a repository it says so and exits 128): the hook built its argv
    assert r["class"] in ("OK", "TOOL_ERROR") and r["exit_code"] is not None, r
    bad = subprocess.run([BIN, "run", "--json", "--policy", policy, "--state-dir", str(tmp_path),
                          "--", "git", "init"], capture_output=True, text=True, timeout=60,
                         env=env)
    assert "POLICY_VIOLATION" in bad.stdout and "structured args" in bad.stdout, bad.stdout
    schema = subprocess.run([BIN, "run", "--json", "--policy", policy, "--state-dir",
                             str(tmp_path), "--args", '{"subcommand": "init"}', "--", "git"],
                            capture_output=True, text=True, timeout=60, env=env)
    assert "POLICY_VIOLATION" in schema.stdout and "enum" in schema.stdout, schema.stdout
