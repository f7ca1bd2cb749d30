"""The command line as an operator meets it: one convention for --help and usage errors
in every subcommand, --json where a program reads the answer, ^C on `run`, `stockade
test` leaving nothing behind, and the shipped plugins found wherever the policy lives."""
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time

import pytest

from conftest import RUN_TIMEOUT
from stockade_testlib import FIXTURES, POLICY, cmdline, live_with_marker

SUBCOMMANDS = ["run", "serve", "mcp", "sessions", "test", "check", "diff", "dry-run", "budget",
               "doctor", "soak", "version"]
USAGE_STATUS = 125          # README, "Command line": one status for a usage error


def sh(cmd, timeout=RUN_TIMEOUT, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


@pytest.mark.parametrize("sub", SUBCOMMANDS)
def test_help_on_stdout_exit_0(stockade, sub):
    cp = sh([stockade, sub, "--help"])
    assert cp.returncode == 0, cp
    assert cp.stdout.startswith(f"usage: stockade {sub}"), cp.stdout
    if sub in ("run", "serve", "mcp", "check", "dry-run", "budget"):
        # the defaults a reader needs: where the policy comes from when not given
        assert "STOCKADE_POLICY" in cp.stdout and "/etc/stockade/policy.lua" in cp.stdout, \
            cp.stdout
    if sub in ("run", "serve", "mcp"):
        assert "STOCKADE_STATE_DIR" in cp.stdout and "default" in cp.stdout, cp.stdout


@pytest.mark.parametrize("sub", SUBCOMMANDS)
def test_unknown_option_is_a_usage_error(stockade, sub, tmp_path):
    env = dict(os.environ, STOCKADE_SOAK_TMPDIR=str(tmp_path))
    cp = sh([stockade, sub, "--no-such-option"], env=env, timeout=60)
    assert cp.returncode == USAGE_STATUS, (sub, cp)
    assert cp.stderr.strip(), (sub, "a usage error says what was wrong")


def test_no_command_and_unknown_command(stockade):
    assert sh([stockade]).returncode == USAGE_STATUS
    cp = sh([stockade, "frobnicate"])
    assert cp.returncode == USAGE_STATUS and "frobnicate" in cp.stderr


def test_check_json(stockade, tmp_path):
    cp = sh([stockade, "check", "--json", POLICY])
    assert cp.returncode == 0, cp
    doc = json.loads(cp.stdout)
    assert doc["ok"] is True and doc["files"][0]["problems"] == []
    assert doc["files"][0]["tools"] > 0
    missing = str(tmp_path / "missing.lua")
    cp = sh([stockade, "check", "--json", missing])
    assert cp.returncode == 1
    doc = json.loads(cp.stdout)
    assert doc["ok"] is False and missing in doc["files"][0]["problems"][0]


def test_dry_run_json(stockade):
    cp = sh([stockade, "dry-run", "--json", os.path.join(FIXTURES, "gates_dryrun.lua")],
            timeout=120)
    doc = json.loads(cp.stdout)             # stdout is the one document, nothing else
    assert doc["policy"].endswith("gates_dryrun.lua") and doc["tools"], doc
    assert {"tool", "result"} <= set(doc["tools"][0])
    assert doc["ok"] is (cp.returncode == 0)


def test_doctor_json(stockade):
    cp = sh([stockade, "doctor", "--json"])
    doc = json.loads(cp.stdout)
    assert cp.returncode in (0, 1)
    assert {l["name"] for l in doc["layers"]} >= {"seccomp", "landlock"}
    assert set(doc["levels"]) == {"strict", "process"}
    assert doc["levels"]["strict"]["available"] is (cp.returncode == 0)
    for lvl in doc["levels"].values():
        assert lvl["available"] or lvl["reason"]
    g = doc["guarantees"]           # what the text output says each level does and does not
    for lvl in ("process", "strict"):
        assert g[lvl]["gives"] and g[lvl]["lacks"], g
    assert g["operator_adds"]


def _interrupt_run(stockade, state_dir, marker, when):
    """`stockade run -- sleep 30.MARKER`, SIGINT once when(sessions dir, marker, run's
    pid) holds; (status, stderr, what is left in the sessions dir)."""
    m = marker()
    proc = subprocess.Popen([stockade, "run", "--state-dir", state_dir, "--policy", POLICY,
                             "--", "sleep", f"30.{m}"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    sessions = os.path.join(state_dir, "sessions")
    try:
        end = time.monotonic() + 20
        while not when(sessions, m, proc.pid):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < end, "the run never got there"
            time.sleep(0.001)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=RUN_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err, sorted(os.listdir(sessions)) if os.path.isdir(sessions) else []


def test_sigint_to_run_exits_130(stockade, state_dir, marker):
    """^C on `stockade run`: the call is stopped and the status is a shell's for a command
    it interrupted (128 + SIGINT)."""
    # the call is running: its tool is there (not just the marker: the run's command line
    # has it too, and so has a helper forked from the run)
    def tool_running(_, m, run):
        return any(argv[0].endswith(b"sleep") and argv[1:2] == [f"30.{m}".encode()]
                   for argv in (cmdline(p).split(b"\0") for p in live_with_marker(m)))
    status, err, left = _interrupt_run(stockade, state_dir, marker, tool_running)
    assert status == 130, (status, err)
    assert b"CANCELLED" in err
    assert left == []


def test_sigint_while_run_sets_up_leaves_nothing(stockade, state_dir, marker):
    """^C as soon as the session's root exists, before the tool started: still the call
    cancelled (130), not stockade killed by the signal with the root left behind. (A
    window of a few milliseconds: tried a few times.)"""
    for _ in range(3):
        status, err, left = _interrupt_run(
            stockade, state_dir, marker, lambda sessions, *_: os.path.isdir(sessions)
            and os.listdir(sessions))
        assert status == 130, (status, err)
        assert left == [], left


LUAUNIT_FILE = """
local lu = require "luaunit"
local testing = require "stockade.testing"
local p = testing.load(%r)
print("ROOT=" .. p:root())
function test_loaded() lu.assertNotNil(p:decide("echo", { argv = { "x" } })) end
os.exit(lu.LuaUnit.run())
"""


def test_stockade_test_leaves_no_tmp_dir(stockade, tmp_path):
    """A LuaUnit file that ends with os.exit(lu.LuaUnit.run()), as the shipped ones and
    POLICY.md's example do: what testing.load made under /tmp is gone afterwards."""
    f = tmp_path / "test_leftover.lua"
    f.write_text(LUAUNIT_FILE % POLICY)
    cp = sh([stockade, "test", str(f)])
    assert cp.returncode == 0, cp
    root = next(l[5:] for l in cp.stdout.splitlines() if l.startswith("ROOT="))
    tmp = os.path.dirname(root)
    assert tmp.startswith("/tmp/stockade-test-"), root
    assert not os.path.exists(tmp), f"{tmp} was left behind"


def test_stockade_test_double_dash_and_missing_file(stockade, tmp_path):
    cp = sh([stockade, "test"])
    assert cp.returncode == USAGE_STATUS
    cp = sh([stockade, "test", str(tmp_path / "nope.lua")])
    assert cp.returncode == 1


# ---------------------------------------------------------------- plugins


POLICY_WITH_PLUGIN = """
local stockade = require "stockade"
local secrets = require "plugins.%s"
return stockade.policy {
  name = "etc-like", isolation = "process",
  redact = { secrets.default },
  tools = { echo = stockade.tool { path = "/bin/echo", owner = "ops", timeout = "5s",
            schema = { type = "object" } } },
}
"""


@pytest.fixture
def etc_dir():
    """A directory like /etc/stockade: no plugins/ beside it or above it, outside the
    checkout."""
    d = tempfile.mkdtemp(prefix="stockade-etc-", dir="/var/tmp")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_shipped_plugin_found_beside_no_plugins_dir(stockade, etc_dir):
    path = os.path.join(etc_dir, "policy.lua")
    with open(path, "w") as f:
        f.write(POLICY_WITH_PLUGIN % "secrets")
    env = {k: v for k, v in os.environ.items() if k != "STOCKADE_PLUGIN_PATH"}
    cp = sh([stockade, "check", path], env=env, cwd="/")
    assert cp.returncode == 0, cp


def test_plugin_file_on_the_path_overrides_the_built_in(stockade, etc_dir):
    os.mkdir(os.path.join(etc_dir, "plugins"))
    with open(os.path.join(etc_dir, "plugins", "secrets.lua"), "w") as f:
        f.write('error("the local override was loaded")\n')
    path = os.path.join(etc_dir, "policy.lua")
    with open(path, "w") as f:
        f.write(POLICY_WITH_PLUGIN % "secrets")
    cp = sh([stockade, "check", path], cwd="/")
    assert cp.returncode == 1 and "the local override was loaded" in cp.stdout + cp.stderr, cp


def test_plugin_not_found_lists_every_directory(stockade, etc_dir):
    path = os.path.join(etc_dir, "policy.lua")
    with open(path, "w") as f:
        f.write(POLICY_WITH_PLUGIN % "nosuch")
    env = dict(os.environ, STOCKADE_PLUGIN_PATH=f"{etc_dir}/a:{etc_dir}/b")
    cp = sh([stockade, "check", path], env=env, cwd="/")
    msg = cp.stdout + cp.stderr
    assert cp.returncode == 1
    assert f"{etc_dir}/a" in msg and f"{etc_dir}/b" in msg and "STOCKADE_PLUGIN_PATH" in msg, msg
    cp = sh([stockade, "check", path], cwd="/",
            env={k: v for k, v in os.environ.items() if k != "STOCKADE_PLUGIN_PATH"})
    msg = cp.stdout + cp.stderr
    assert f"{etc_dir}/plugins" in msg and "/share/stockade/plugins" in msg, msg
