"""Integration tests of the soak driver (contrib/soak/stockade_soak, what `stockade soak`
runs): short soaks of the real binary through
`python3 -m stockade_soak --stockade ./stockade`, and the verdict, the duration
parser and the chart on fabricated runs.

    cd /work/main && /usr/bin/python3 -m pytest -q -p no:cacheprovider \
        tests/integration/test_soak.py
"""

import json
import os
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from stockade_testlib import CONTRIB_PYTHON as CONTRIB, POLICY as DEFAULT_POLICY, REPO_ROOT

SOAK_DIR = os.path.join(REPO_ROOT, "contrib", "soak")
if SOAK_DIR not in sys.path:
    sys.path.insert(0, SOAK_DIR)

import stockade_soak as soak  # noqa: E402

SVG_NS = "{http://www.w3.org/2000/svg}"
CALL_KINDS = list(soak.KINDS)                 # every kind of call in the mix
ALL_KINDS = CALL_KINDS + ["session_churn"]


def run_soak(stockade, args, timeout, workdir_base=None):
    """Run the driver as `stockade soak` does; returns the CompletedProcess (text).
    workdir_base: where it makes its work dir (STOCKADE_SOAK_TMPDIR)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = CONTRIB + ":" + SOAK_DIR
    if workdir_base:
        env["STOCKADE_SOAK_TMPDIR"] = workdir_base
    env.pop("STOCKADE_DEPTH", None)
    # RSS is checked against the warm-up's high-water, so it must track live memory. By
    # default glibc raises its mmap threshold to the largest block freed (up to 32 MiB):
    # after the first floods, 1 MiB output buffers come from the heap and what is freed
    # stays resident, so RSS climbs by however many of them happened to be live at once
    # (a 40 s soak climbed from 16.8 to 18.1 MiB between its 2nd and 10th second, then
    # stayed flat for 30 s: no leak; a 10 s soak, slowed by load, ends inside that climb).
    # A fixed threshold gives big blocks back when freed: a leak, of big blocks or small,
    # still grows RSS past the high-water and fails the check.
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    cmd = [sys.executable, "-m", "stockade_soak", "--stockade", stockade,
           "--progress", "plain"] + list(args)
    # Under ASan freed memory sits in the allocator's quarantine (hundreds of MiB by
    # design), so RSS growth says nothing about leaks there; LeakSanitizer does.
    if os.environ.get("STOCKADE_SANITIZED") and "--max-rss-growth" not in args:
        cmd += ["--max-rss-growth", "100000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=REPO_ROOT, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)     # the driver and its server, ours
        out, err = proc.communicate()
        pytest.fail(f"the soak did not finish within {timeout}s\nstdout: {out[-3000:]}\n"
                    f"stderr: {err[-3000:]}")
    cp = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    print(f"---- {' '.join(cmd)} -> {cp.returncode}\n{out}\n---- stderr\n{err[-3000:]}")
    return cp


def load_report(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def assert_svg(path):
    assert os.path.isfile(path), f"no chart at {path}"
    root = ET.parse(path).getroot()          # well-formed XML, or this raises
    assert root.tag == SVG_NS + "svg"
    polylines = list(root.iter(SVG_NS + "polyline"))
    assert len(polylines) == 5, f"expected one polyline per series, got {len(polylines)}"
    texts = " ".join(t.text or "" for t in root.iter(SVG_NS + "text"))
    for label in ("fds", "processes", "zombies", "RSS MiB", "sessions"):
        assert label in texts, f"legend/axis label {label!r} missing from the chart"
    for pl in polylines:
        pts = pl.get("points").split()
        assert len(pts) >= 2
        for p in pts:
            x, y = (float(v) for v in p.split(","))
            assert x >= 0 and y >= 0


def assert_clean_run(cp, report, check_names=None):
    assert cp.returncode == 0, f"soak failed (exit {cp.returncode}): {report.get('failures')}"
    assert "PASS" in cp.stdout.splitlines()[0]
    assert report["verdict"] == "pass" and report["passed"] is True and not report["failures"]
    failed = [c for c in report["checks"] if not c["ok"]]
    assert not failed, failed
    names = {c["name"] for c in report["checks"]}
    for n in check_names or ("server_alive", "server_exit", "zombies_end", "zombie_samples",
                             "fd_growth", "rss_growth", "session_dirs", "processes_end",
                             "tool_processes", "mix", "drain", "errors"):
        assert n in names, f"check {n} missing from the report"
    # every kind of call in the mix ran
    for k in ALL_KINDS:
        assert report["kinds"][k]["calls"] > 0, (k, report["kinds"][k])
    for k in CALL_KINDS:
        classes = report["kinds"][k]["classes"]
        assert set(classes) <= set(soak.EXPECTED[k]), (k, classes)
    # the figures
    figs = report["figures"]
    for f in ("fds", "processes", "zombies", "rss_kb", "sessions"):
        for when in ("start", "baseline", "peak", "end", "final"):
            assert isinstance(figs[f][when], int), (f, when, figs[f])
    assert figs["zombies"]["end"] == 0 and figs["zombies"]["final"] == 0
    growth = figs["fds"]["end"] - figs["fds"]["baseline"]
    assert growth <= report["thresholds"]["max_fd_growth"], figs["fds"]
    assert figs["sessions"]["final"] == 0
    assert figs["processes"]["final"] == 0
    assert report["sessions"]["leftover_dirs_at_end"] == []
    assert report["server"]["exit_status"] == 0
    assert report["calls"]["total"] == sum(report["classes"].values())
    assert report["calls"]["errors"] == 0
    thr = report["thresholds"]
    for k in ("max_fd_growth", "max_rss_growth_pct", "rss_growth_floor_mib",
              "max_zombie_samples_pct", "max_errors"):
        assert k in thr
    assert len(report["series"]["t"]) >= 5


# ---------------------------------------------------------------- real soaks


def test_soak_default_workload(stockade, tmp_path):
    rep = str(tmp_path / "soak.json")
    cp = run_soak(stockade, ["--duration", "20s", "--concurrency", "8", "--churn-every", "5",
                             "--report", rep], timeout=180)
    report = load_report(rep)
    assert_clean_run(cp, report)
    assert report["config"]["policy_written"] is True
    assert report["config"]["concurrency"] == 8
    assert report["server"]["policy"]["name"] == "soak-workload"
    # the written policy's admission: 2 x concurrency
    assert report["server"]["limits"]["max_running"] == 16
    assert report["server"]["limits"]["max_sessions"] == 16
    assert report["calls"]["overloaded"] == 0
    # floods were capped by the policy's output limit, with the rest counted
    assert report["kinds"]["flood"]["classes"] == {"OK": report["kinds"]["flood"]["calls"]}
    # the workload's temp dir (written policy, state) is gone after a passing run
    assert "kept:" not in cp.stdout
    assert not os.path.exists(os.path.dirname(report["config"]["policy"]))
    assert report["chart"] == str(tmp_path / "soak.svg")
    assert_svg(report["chart"])
    # a status line every 10 s on a non-TTY stderr, no carriage returns
    assert "calls/s" in cp.stderr and "\r" not in cp.stderr


def test_soak_default_policy(stockade, tmp_path, state_dir):
    rep = str(tmp_path / "default.json")
    cp = run_soak(stockade, ["--policy", DEFAULT_POLICY, "--duration", "10s",
                             "--churn-every", "4", "--state-dir", state_dir, "--report", rep],
                  timeout=150)
    report = load_report(rep)
    assert_clean_run(cp, report)
    assert report["config"]["policy_written"] is False
    assert report["server"]["policy"]["name"] == "default"
    # default concurrency: min(2 x limits.running, 2 x CPUs), at least 2
    cpus = len(os.sched_getaffinity(0))
    assert report["config"]["concurrency"] == max(2, min(2 * 64, 2 * cpus))
    # the state dir given is used and left without a session of the run
    assert report["config"]["state_dir"] == os.path.realpath(state_dir)
    sessions = os.path.join(state_dir, "sessions")
    assert not os.path.isdir(sessions) or os.listdir(sessions) == []
    assert_svg(str(tmp_path / "default.svg"))


def test_soak_threshold_violation_fails(stockade, tmp_path):
    """A threshold no run can meet (fds must shrink by 1000) is reported as a failure."""
    rep = str(tmp_path / "neg.json")
    cp = run_soak(stockade, ["--duration", "5s", "--concurrency", "4",
                             "--max-fd-growth", "-1000", "--report", rep], timeout=120)
    assert cp.returncode == 1, cp.stdout
    assert cp.stdout.splitlines()[0].startswith("stockade soak: FAIL")
    assert "FAIL fd growth" in cp.stdout
    report = load_report(rep)
    assert report["verdict"] == "fail" and report["passed"] is False
    fd = [c for c in report["checks"] if c["name"] == "fd_growth"][0]
    assert fd["ok"] is False and fd["threshold"] == -1000
    assert any("fd growth" in f for f in report["failures"])
    assert report["thresholds"]["max_fd_growth"] == -1000
    # the server itself was fine: it was the threshold that failed
    ok = {c["name"]: c["ok"] for c in report["checks"]}
    assert ok["server_alive"] and ok["server_exit"] and ok["zombies_end"]
    # a failing run keeps its work dir for inspection, and says where
    kept = [ln for ln in cp.stdout.splitlines() if ln.startswith("kept: ")]
    assert kept, cp.stdout
    workdir = kept[0].split()[1]
    assert os.path.isfile(os.path.join(workdir, "serve.log"))
    import shutil
    shutil.rmtree(workdir, ignore_errors=True)
    assert_svg(str(tmp_path / "neg.svg"))


def test_soak_usage_errors(stockade, tmp_path):
    base = tmp_path / "work"
    base.mkdir()
    for args in (["--duration", "ten minutes"], ["--concurrency", "0"],
                 ["--mix", "nonsense=3"], ["--policy", str(tmp_path / "missing.lua"),
                                           "--duration", "1s"]):
        cp = run_soak(stockade, args, timeout=60, workdir_base=str(base))
        assert cp.returncode == 125, (args, cp.returncode, cp.stderr)
    cp = run_soak(str(tmp_path / "no-such-stockade"), ["--duration", "1s"], timeout=60,
                  workdir_base=str(base))
    assert cp.returncode == 125
    # a refused run leaves nothing behind
    assert os.listdir(base) == []


def test_stockade_soak_subcommand(stockade):
    """`stockade soak` execs this driver with its own path as --stockade."""
    cp = subprocess.run([stockade, "soak", "--help"], capture_output=True, text=True,
                        timeout=60)
    assert cp.returncode == 0, cp.stderr
    assert "--duration" in cp.stdout and "--max-fd-growth" in cp.stdout


# ---------------------------------------------------------------- the parts, on fabricated runs


@pytest.mark.parametrize("text,sec", [("1h", 3600.0), ("10m", 600.0), ("90s", 90.0),
                                      ("250ms", 0.25), ("1h30m", 5400.0), ("1.5h", 5400.0),
                                      ("45", 45.0), ("2m30s", 150.0)])
def test_parse_duration(text, sec):
    assert soak.parse_duration(text) == pytest.approx(sec)


@pytest.mark.parametrize("text", ["", "ten", "10x", "m10", "-5s", "1h 30m"])
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError):
        soak.parse_duration(text)


THRESHOLDS = {"max_fd_growth": 8, "max_rss_growth_pct": 5.0, "rss_growth_floor_mib": 2.0,
              "max_zombie_samples_pct": 5.0, "max_errors": 0, "zombies_end": 0,
              "leftover_session_dirs": 0, "server_exit_status": 0}


def clean_facts():
    def fig(start, baseline, peak, end, final):
        return {"start": start, "baseline": baseline, "peak": peak, "end": end, "final": final}
    return {
        "server_died": None, "exit_status": 0, "killed_on_close": False,
        "figures": {"fds": fig(5, 13, 45, 13, 5), "processes": fig(0, 0, 60, 0, 0),
                    "zombies": fig(0, 0, 30, 0, 0), "host_zombies": fig(0, 0, 12, 0, 0),
                    "rss_kb": fig(3400, 10000, 14000, 10200, 10200),
                    "sessions": fig(0, 8, 8, 8, 0)},
        "zombie_samples": 1, "samples": 100, "stuck_zombies": [],
        "leftover_dirs": [], "dirs_checked": True, "marked_left": [], "stuck_workers": 0,
        "hung_calls": 0, "errors": 0,
        "kinds": {k: 3 for k in CALL_KINDS}, "mix": dict(soak.KINDS), "churn": 4,
        "baseline_taken": True, "rss_reference": {"kb": 11000},
    }


def failed(facts, th=None):
    return {c["name"] for c in soak.evaluate(facts, dict(THRESHOLDS, **(th or {})))
            if not c["ok"]}


def test_evaluate_clean_run_passes():
    assert failed(clean_facts()) == set()


@pytest.mark.parametrize("mutate,check", [
    (lambda f: f.update(server_died="the server exited (status -9)"), "server_alive"),
    (lambda f: f.update(exit_status=1), "server_exit"),
    (lambda f: f.update(exit_status=None, killed_on_close=True), "server_exit"),
    (lambda f: f["figures"]["zombies"].update(final=1), "zombies_end"),
    (lambda f: f["figures"]["host_zombies"].update(final=2), "zombies_end"),
    (lambda f: f.update(zombie_samples=6), "zombie_samples"),
    (lambda f: f.update(samples=0, zombie_samples=0), "zombie_samples"),
    (lambda f: f.update(stuck_zombies=["pid 4242 (stockade) unreaped for 1500 ms"]),
     "zombie_stuck"),
    (lambda f: f["figures"]["fds"].update(end=22), "fd_growth"),
    (lambda f: f["figures"]["fds"].update(end=None), "fd_growth"),
    (lambda f: f["figures"]["rss_kb"].update(end=14000), "rss_growth"),
    (lambda f: f.update(leftover_dirs=["soak-1-w000-000001"]), "session_dirs"),
    (lambda f: f.update(dirs_checked=False), "session_dirs"),
    (lambda f: f["figures"]["processes"].update(final=3), "processes_end"),
    (lambda f: f.update(marked_left=["999: sleep 300.01234567"]), "tool_processes"),
    (lambda f: f["kinds"].update(fork_bomb=0), "mix"),
    (lambda f: f.update(churn=0), "mix"),
    (lambda f: f.update(hung_calls=1), "drain"),
    (lambda f: f.update(stuck_workers=2), "drain"),
    (lambda f: f.update(errors=1), "errors"),
])
def test_evaluate_detects(mutate, check):
    f = clean_facts()
    mutate(f)
    assert check in failed(f)


def test_evaluate_thresholds():
    f = clean_facts()
    f["figures"]["fds"].update(baseline=13, end=21)          # +8: at the threshold
    assert "fd_growth" not in failed(f)
    assert "fd_growth" in failed(f, {"max_fd_growth": 7})
    assert "fd_growth" in failed(f, {"max_fd_growth": -1})
    # 5 of 100 samples is at the limit, 6 past it
    f = clean_facts()
    f["zombie_samples"] = 5
    assert "zombie_samples" not in failed(f)
    # RSS: +50% of a 3 MiB process is only 1.5 MiB: below the 2 MiB floor, ignored
    f = clean_facts()
    f["rss_reference"] = {"kb": 3072}
    f["figures"]["rss_kb"].update(baseline=3072, end=3072 + 1536)
    assert "rss_growth" not in failed(f)
    assert "rss_growth" in failed(f, {"rss_growth_floor_mib": 1.0})
    # +4% of 100 MiB is 4 MiB, over the floor but within the percentage
    f["rss_reference"] = {"kb": 102400}
    f["figures"]["rss_kb"].update(end=102400 + 4096)
    assert "rss_growth" not in failed(f)
    assert "rss_growth" in failed(f, {"max_rss_growth_pct": 3.0})
    # no reference given: the quiescent baseline is the reference
    f["rss_reference"] = None
    f["figures"]["rss_kb"].update(baseline=10000, end=13000)
    assert "rss_growth" in failed(f)
    # a kind weighted 0 in the mix need not run
    f = clean_facts()
    f["mix"]["fork_bomb"] = 0
    f["kinds"]["fork_bomb"] = 0
    assert "mix" not in failed(f)


def test_render_svg_is_well_formed(tmp_path):
    samples = []
    for i in range(3000):      # more points than the chart keeps: downsampled
        samples.append({"t": i * 1.0, "fds": 10 + i % 7, "processes": i % 40,
                        "zombies": 1 if i % 97 == 0 else 0, "rss_kb": 4096 + i,
                        "sessions": 8 if 5 < i < 2990 else 0})
    samples.append({"t": 3000.0, "fds": None, "rss_kb": None})     # a missing figure
    path = tmp_path / "c.svg"
    path.write_text(soak.render_svg(samples, title='a <title> & "quotes"',
                                    marks={"baseline": 300.0, "drain": 2990.0}))
    assert_svg(str(path))
    root = ET.parse(str(path)).getroot()
    for pl in root.iter(SVG_NS + "polyline"):
        assert len(pl.get("points").split()) <= 1500
    title = [t.text for t in root.iter(SVG_NS + "text")][0]
    assert title == 'a <title> & "quotes"'
    # alarm events are marked on their kind's panel: raised and cleared
    path.write_text(soak.render_svg(samples[:100], alarms=[
        {"t": 10.0, "kind": "zombies", "state": "raised", "value": 2, "message": "2 <z>"},
        {"t": 14.0, "kind": "zombies", "state": "cleared"},
        {"t": 20.0, "kind": "sessions", "state": "raised"}]))
    assert_svg(str(path))
    root = ET.parse(str(path)).getroot()
    panels = {g.get("id"): g for g in root.iter(SVG_NS + "g") if g.get("class") == "panel"}
    marks = {pid: [p.find(SVG_NS + "title").text for p in g.iter(SVG_NS + "polygon")]
             for pid, g in panels.items()}
    assert [m.split(" at ")[0] for m in marks["panel-zombies"]] == ["zombies raised",
                                                                  "zombies cleared"]
    assert [m.split(" at ")[0] for m in marks["panel-sessions"]] == ["sessions raised"]
    assert marks["panel-fds"] == []
    # an empty run still renders a valid (empty) chart
    path.write_text(soak.render_svg([]))
    root = ET.parse(str(path)).getroot()
    assert root.tag == SVG_NS + "svg"


def test_written_policy_loads(stockade, tmp_path):
    """The workload policy the driver writes passes `stockade check`."""
    p = tmp_path / "w.lua"
    p.write_text(soak._policy_text(4, "process", with_secrets=False))
    cp = subprocess.run([stockade, "check", str(p)], capture_output=True, text=True, timeout=60)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    text = p.read_text()
    assert "processes = 32" in text and "sessions = 8, running = 8" in text
