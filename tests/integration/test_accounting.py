"""Accounting: every alarm fires when its threshold is crossed and clears when back
under; structured logs carry one record per call and never argv values; the metrics
file is Prometheus text, replaced atomically."""

import json
import os
import shutil
import subprocess
import tempfile
import time

import pytest

from serve_helpers import FIXTURES, REPO_ROOT, RPC_TIMEOUT, Client, wait_until

ALARMS = os.path.join(FIXTURES, "alarms.lua")
ALARMS_RSS = os.path.join(FIXTURES, "alarms_rss.lua")
BIN = os.environ.get("STOCKADE_BIN", os.path.join(REPO_ROOT, "stockade"))
WAIT = 15.0  # the sampler runs every second; an alarm needs at most two samples


@pytest.fixture
def state_dir():
    d = tempfile.mkdtemp(prefix="stockade-acct-", dir="/var/tmp")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def server(state_dir):
    clients = []

    def start(policy=ALARMS, extra=()):
        log = os.path.join(state_dir, "serve.log")
        c = Client.spawn([BIN, "serve", "--policy", policy, "--state-dir", state_dir,
                          "--debug-hooks", "--log", log, *extra],
                         rpc_timeout=RPC_TIMEOUT, stderr=subprocess.DEVNULL)
        clients.append(c)
        c.log_path = log
        return c

    yield start
    for c in clients:
        try:
            c.close()
        except Exception:
            pass


def alarm(client, kind, state):
    return client.wait_notification(
        "alarm", lambda p: p.get("kind") == kind and p.get("state") == state, timeout=WAIT)


def test_fds_alarm_fires_and_clears(server):
    c = server()
    c.request("debug.leak", {"count": 8})
    raised = alarm(c, "fds", "raised")
    assert raised["value"] > raised["threshold"]
    assert "descriptors" in raised["message"]
    kinds = [a["kind"] for a in c.stats()["alarms"]]
    assert "fds" in kinds
    c.request("debug.unleak", {})
    cleared = alarm(c, "fds", "cleared")
    assert cleared["value"] <= cleared["threshold"]
    assert "fds" not in [a["kind"] for a in c.stats()["alarms"]]


def test_sessions_alarm_fires_and_clears(server):
    c = server()
    s1 = c.open_session()
    s2 = c.open_session()
    raised = alarm(c, "sessions", "raised")
    assert raised["value"] == 2 and raised["threshold"] == 1
    s2.close()
    s1.close()
    alarm(c, "sessions", "cleared")


def test_processes_alarm_fires_and_clears(server):
    c = server()
    s = c.open_session()
    h = s.start_call("sh", ["-c", "sleep 3 & sleep 3 & sleep 3 & sleep 3; wait"])
    raised = alarm(c, "processes", "raised")
    assert raised["value"] > 3
    assert h.result(RPC_TIMEOUT).class_ == "OK"
    alarm(c, "processes", "cleared")
    s.close()


def test_zombie_alarm_fires_and_clears(server):
    # debug.zombie: a child of the supervisor's side that never reaps its own — the leak
    # the alarm is for. Killing the holder hands the zombie to the supervisor (its
    # subreaper), which reaps it: the alarm clears.
    c = server()
    assert c.request("debug.zombie", {})["holding"] is True
    raised = alarm(c, "zombies", "raised")
    assert raised["value"] >= 1 and "unreaped" in raised["message"]
    assert c.stats()["zombies"] >= 1
    c.request("debug.unleak", {})
    alarm(c, "zombies", "cleared")
    wait_until(lambda: c.stats()["zombies"] == 0, WAIT, "zombies back to 0")


def test_zombie_inside_a_running_tool_is_not_an_alarm(server):
    # A tool that does not reap its own child holds a zombie for as long as it runs:
    # counted in stats, not a supervisor leak, so no alarm (and gone with the call).
    c = server()
    seen = []
    c.subscribe(lambda m, p: seen.append(p) if m == "alarm" and p.get("kind") == "zombies" else None)
    s = c.open_session()
    h = s.start_call("sh", ["-c", "true & exec sleep 3"])
    wait_until(lambda: c.stats()["zombies"] >= 1, WAIT, "the tool's zombie in stats")
    assert h.result(RPC_TIMEOUT).class_ == "OK"
    assert c.stats()["zombies"] == 0
    assert seen == []
    s.close()


def test_rss_alarm_fires_and_clears_on_reload(server, tmp_path):
    path = str(tmp_path / "policy.lua")
    shutil.copy(ALARMS_RSS, path)
    c = server(path)         # 1 MiB: any supervisor is over it
    raised = alarm(c, "rss", "raised")
    assert raised["value"] > raised["threshold"]
    shutil.copy(ALARMS, path)
    c.reload_policy()        # 1 GiB: thresholds follow the policy
    alarm(c, "rss", "cleared")


def test_debug_hooks_are_off_by_default(state_dir):
    c = Client.spawn([BIN, "serve", "--policy", ALARMS, "--state-dir", state_dir],
                     rpc_timeout=RPC_TIMEOUT, stderr=subprocess.DEVNULL)
    try:
        with pytest.raises(Exception) as e:
            c.request("debug.leak", {"count": 1})
        assert "BAD_REQUEST" in repr(e.value) or "unknown method" in str(e.value)
    finally:
        c.close()


def read_log(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_call_log_records_without_argv_values(server):
    c = server()
    secret_arg = "argv-value-that-must-not-be-logged-7c1e"
    s = c.open_session()
    r = s.call("echo", [secret_arg])
    assert r.class_ == "OK"
    refused = s.call("rm", ["-rf", "/"])
    assert refused.class_ == "POLICY_VIOLATION"
    s.close()
    c.close()
    records = read_log(c.log_path)
    calls = [r for r in records if r.get("event") == "call"]
    assert len(calls) == 2, records
    ok = next(r for r in calls if r["tool"] == "echo")
    assert ok["class"] == "OK" and ok["decision"] == "run" and ok["exit"] == 0
    for key in ("ts", "level", "session", "msgid", "call_id", "duration_ms", "cpu_ms",
                "bytes_out", "redactions", "generation"):
        assert key in ok, key
    bad = next(r for r in calls if r["tool"] == "rm")
    assert bad["decision"] == "refused" and bad["class"] == "POLICY_VIOLATION"
    assert calls[0]["call_id"] != calls[1]["call_id"]
    with open(c.log_path) as f:
        text = f.read()
    assert secret_arg not in text
    assert "-rf" not in text


def test_metrics_file_is_prometheus_text(server, state_dir):
    metrics = os.path.join(state_dir, "stockade.prom")
    c = server(extra=["--metrics", metrics, "--metrics-interval", "200ms"])
    s = c.open_session()
    assert s.call("echo", ["hi"]).class_ == "OK"
    s.close()

    def has_ok_call():
        try:
            with open(metrics) as f:
                return 'stockade_calls_total{class="OK"} 1' in f.read()
        except FileNotFoundError:
            return False

    wait_until(has_ok_call, WAIT, "metrics file with the call")
    with open(metrics) as f:
        lines = [l for l in f.read().splitlines() if l and not l.startswith("#")]
    names = {l.split("{")[0].split(" ")[0] for l in lines}
    for n in ("stockade_calls_total", "stockade_sessions", "stockade_running",
              "stockade_processes", "stockade_zombies", "stockade_rss_bytes", "stockade_fds",
              "stockade_alarm", "stockade_timeout_ratio", "stockade_call_latency_ms"):
        assert n in names, n
    for l in lines:                      # every sample line: name{labels} value
        float(l.rsplit(" ", 1)[1])
    assert not [f for f in os.listdir(state_dir) if ".prom.tmp" in f]
