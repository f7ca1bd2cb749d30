"""Accounting: every alarm fires when its threshold is crossed and clears when back
under; structured logs carry one record per call and never argv values; the metrics
file is Prometheus text, replaced atomically."""

import json
import os
import shutil
import signal
import subprocess
import time

import pytest

from serve_helpers import RPC_TIMEOUT, Client, wait_until
from stockade_testlib import FIXTURES, STOCKADE_BIN as BIN

ALARMS = os.path.join(FIXTURES, "alarms.lua")
ALARMS_RSS = os.path.join(FIXTURES, "alarms_rss.lua")
WAIT = 15.0  # the sampler runs every second; an alarm needs at most two samples


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
              "stockade_alarm", "stockade_timeout_ratio", "stockade_build_info",
              "stockade_call_duration_seconds_bucket", "stockade_call_duration_seconds_sum",
              "stockade_call_duration_seconds_count", "stockade_sessions_opened_total",
              "stockade_sessions_expired_total", "stockade_policy_reloads_total",
              "stockade_policy_last_reload_timestamp_seconds"):
        assert n in names, n
    for l in lines:                      # every sample line: name{labels} value
        float(l.rsplit(" ", 1)[1])
    assert not [f for f in os.listdir(state_dir) if ".prom." in f]


def own_policy_copy(state_dir):
    """A copy of the alarms policy the test may break (reloads re-read the served file)."""
    path = os.path.join(state_dir, "policy.lua")
    shutil.copy(ALARMS, path)
    return path


def break_policy(path):
    with open(path, "w") as f:
        f.write("return 42  -- not a policy\n")


def parse_prom(text):
    """{family: {"help", "type", "samples": {name{labels}: value}}} with every sample
    attributed to the family declared before it."""
    fams, cur = {}, None
    for l in text.splitlines():
        if l.startswith("# HELP "):
            name = l.split()[2]
            cur = fams.setdefault(name, {"samples": {}})
            cur["help"] = l.split(None, 3)[3]
        elif l.startswith("# TYPE "):
            _, _, name, typ = l.split()
            assert name in fams, f"TYPE before HELP: {l}"
            fams[name]["type"] = typ
        elif l:
            key, val = l.rsplit(" ", 1)
            base = key.split("{")[0]
            assert cur is not None and (base == cur_name(fams, cur) or
                                        base.rsplit("_", 1)[0] == cur_name(fams, cur)), l
            cur["samples"][key] = float(val)
    return fams


def cur_name(fams, cur):
    return next(k for k, v in fams.items() if v is cur)


def test_metrics_conventions_and_removal(server, state_dir):
    """# HELP and # TYPE for every family; latency a histogram in seconds; build info;
    reload, session and RPC-error counters; the file is gone once the server exits."""
    metrics = os.path.join(state_dir, "stockade.prom")
    policy = own_policy_copy(state_dir)
    c = server(policy=policy, extra=["--metrics", metrics, "--metrics-interval", "200ms"])
    s = c.open_session()
    assert s.call("echo", ["hi"]).class_ == "OK"
    s.close()
    c.reload_policy()
    break_policy(policy)
    with pytest.raises(Exception):
        c.reload_policy()
    with pytest.raises(Exception):
        c.close_session("never-opened")

    def current():
        try:
            with open(metrics) as f:
                text = f.read()
        except FileNotFoundError:
            return None
        return text if 'result="failure"} 1' in text and "NO_SUCH_SESSION" in text else None
    text = wait_until(current, WAIT, "metrics with the reloads and the error")
    fams = parse_prom(text)
    for name, f in fams.items():
        assert f.get("type") in ("counter", "gauge", "histogram"), name
        assert f["help"], name
        if f["type"] == "counter":
            assert name.endswith("_total"), name
    lat = fams["stockade_call_duration_seconds"]
    assert lat["type"] == "histogram"
    assert lat["samples"]['stockade_call_duration_seconds_bucket{tool="echo",le="+Inf"}'] == 1
    assert lat["samples"]['stockade_call_duration_seconds_count{tool="echo"}'] == 1
    assert 0 < lat["samples"]['stockade_call_duration_seconds_sum{tool="echo"}'] < 10
    assert any(k.startswith("stockade_build_info{version=") for k in
               fams["stockade_build_info"]["samples"])
    reloads = fams["stockade_policy_reloads_total"]["samples"]
    assert reloads['stockade_policy_reloads_total{result="success"}'] == 1
    assert reloads['stockade_policy_reloads_total{result="failure"}'] == 1
    assert fams["stockade_policy_last_reload_timestamp_seconds"]["samples"][
        "stockade_policy_last_reload_timestamp_seconds"] > time.time() - 600
    assert fams["stockade_sessions_opened_total"]["samples"][
        "stockade_sessions_opened_total"] == 1
    assert fams["stockade_rpc_errors_total"]["samples"][
        'stockade_rpc_errors_total{class="NO_SUCH_SESSION"}'] == 1

    assert c.close() == 0
    assert not os.path.exists(metrics), "the metrics file outlived the server"


def test_audit_trail(server, state_dir):
    """start-up, session open/close/expire with labels, reloads, shutdown: one JSON line
    each in --log; SIGUSR1 reopens --log (logrotate moved the old one away). (The session
    records are server.c's: "event":"session" with its "state".)"""
    policy = own_policy_copy(state_dir)
    c = server(policy=policy)
    s = c.open_session(labels={"agent": "a1", "ticket": "42"})
    s.close()
    short = c.open_session(ttl_ms=300, labels={"agent": "a2"})
    c.wait_notification("session.expired", lambda p: p["session_id"] == short.session_id,
                        timeout=WAIT)
    c.reload_policy()
    rotated = c.log_path + ".1"
    os.rename(c.log_path, rotated)
    c.proc.send_signal(signal.SIGUSR1)
    assert wait_until(lambda: os.path.exists(c.log_path), WAIT, "--log reopened")
    break_policy(policy)
    with pytest.raises(Exception):
        c.reload_policy()
    assert c.close() == 0

    def records(path):
        with open(path) as f:
            return [r for r in map(json.loads, f) if "event" in r]
    old, new = records(rotated), records(c.log_path)
    by = {}
    for r in old + new:
        by.setdefault(r["event"], []).append(r)
    start = by["startup"][0]
    assert start["version"] and len(start["sha256"]) == 64 and start["generation"] >= 1
    assert start["listen"] == "stdio" and start["layers"] and start["isolation"]
    sessions = {}
    for r in by["session"]:
        sessions.setdefault(r["state"], []).append(r)
    opened = {r["session"]: r for r in sessions["opened"]}
    assert opened[s.session_id]["labels"] == {"agent": "a1", "ticket": "42"}
    assert [r["session"] for r in sessions["closed"]] == [s.session_id]
    exp = sessions["expired"][0]
    assert exp["session"] == short.session_id and exp["layer"] == "ttl"
    assert exp["labels"] == {"agent": "a2"}
    ok, refused = by["reload"]
    assert ok["accepted"] and ok["old_sha256"] == start["sha256"] and ok["new_sha256"]
    assert not refused["accepted"] and refused["reason"]
    assert refused in new and ok in old, "the refused reload went to the reopened log"
    assert by["shutdown"][0]["reason"]
