#!/usr/bin/python3
"""stockade's benchmark harness: one table per run, every figure a median with its spread
(p25-p75), every timing also as a ratio to a baseline measured in the same run.

    /usr/bin/python3 tests/bench/run.py             # the full bench (~10 minutes)
    /usr/bin/python3 tests/bench/run.py --quick     # CI smoke: < 1 minute, fails only on a crash
    /usr/bin/python3 tests/bench/run.py --json out.json   # also every figure as JSON

Sections:
  1. per-call latency of /bin/true and `echo hello`: the fork+exec floor (floor.c),
     posix_spawn, `stockade run` (process, strict), `stockade serve` through the Python
     client and through a raw msgpack C client (rawclient.c) (process, strict), `stockade
     mcp` through a JSON-lines Python client (ratio to the msgpack Python client), bwrap,
     unshare, firejail, srt
  2. parallel throughput with 1, 2, 8, 32 calls in flight: serve (the C client pipelining,
     one session per slot) vs K concurrent fork+exec workers
  3. streaming: MB/s of a 1 GiB output through a call (capture only; the default secret
     set; streamed to the client) vs a raw pipe
  4. memory: the supervisor's RSS idle and with 256 / 1,000 open sessions; for strict also
     the zygotes' (the serve process's descendants: VmRSS and PSS summed)
  5. scaling: per-call latency with 1 vs 1,000 open sessions
  6. redaction (tests/bench/redact_bench.py): per-family recall and precision over
     tests/redact/corpus, a scan of the system's source and documentation trees,
     throughput by input class vs a raw pipe with the supervisor's CPU, a noisy neighbour
  7. noisy neighbour (tests/bench/noisy.py): session B's `true` p50/p99 while session A
     runs each attack (redaction-heavy output, a 100,000-entry tree at close, a streamed
     flood whose client stalls, a fork bomb, pipelined `stats`, a looping hook), as a
     ratio to B alone on the same server; and root removal's own time (remove_bench.c,
     the walk a close runs in a remover thread) for 10,000 one-file dirs, 20,000 empty
     dirs, a 100,000-entry tree and a 2,000-deep chain, with its passes over directories

When root, what is missing is installed (bubblewrap firejail hyperfine socat ripgrep;
npm's @anthropic-ai/sandbox-runtime): always in full mode, in --quick mode only with
--install. A comparator that is missing or fails is skipped with a note. A stockade row
that fails (a call not OK, a server that dies or exits non-zero) makes the run exit 1; a
number never does. State lives in a fresh /var/tmp/stockade-bench.* dir, removed at exit.
"""

import argparse
import atexit
import datetime
import json
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
BUILD = os.path.join(REPO, "build", "bench")
FIXTURES = os.path.join(REPO, "tests", "fixtures")
sys.path.insert(0, os.path.dirname(HERE))
from stockade_testlib import fixture_levels  # noqa: E402

POLICY = fixture_levels("bench")     # bench_process.lua, and at isolation "strict"
RUN_PLAIN = os.path.join(FIXTURES, "bench_run_plain.lua")
GIB = 1 << 30

# ---------------------------------------------------------------------------- statistics


def quantile(xs, q):
    """Linear interpolation between the closest ranks (numpy's default)."""
    s = sorted(xs)
    if not s:
        return float("nan")
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


class Row:
    """One line of the table. `better` is "lower" (times, memory) or "higher" (rates).
    `base` names the row whose median is the ratio's denominator."""

    def __init__(self, section, name, unit, samples, base=None, note="", better="lower",
                 key=None):
        self.section, self.name, self.unit = section, name, unit
        self.samples = list(samples)
        self.base, self.note, self.better = base, note, better
        self.key = key or name
        self.skipped = not self.samples
        if self.samples:
            self.median = statistics.median(self.samples)
            self.p25, self.p75 = quantile(self.samples, 0.25), quantile(self.samples, 0.75)
        else:
            self.median = self.p25 = self.p75 = None
        self.ratio = None


class Bench:
    def __init__(self, args):
        self.args = args
        self.rows = []
        self.by_key = {}
        self.failures = []      # stockade's own failures: these fail the run
        self.notes = []

    def add(self, row):
        self.rows.append(row)
        self.by_key[row.key] = row
        if row.base and not row.skipped:
            b = self.by_key.get(row.base)
            if b is not None and not b.skipped and b.median:
                row.ratio = row.median / b.median
        return row

    def skip(self, section, name, unit, why, key=None):
        self.add(Row(section, name, unit, [], note="skipped: " + why, key=key))

    def fail(self, what, detail):
        msg = f"{what}: {detail.strip().splitlines()[-1] if detail.strip() else 'failed'}"
        self.failures.append(msg)
        print(f"bench: FAILED {msg}", file=sys.stderr)
        if detail.strip():
            print(detail.strip()[-2000:], file=sys.stderr)


# ---------------------------------------------------------------------------- set-up


def log(msg):
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def is_root():
    return os.geteuid() == 0


def install_missing(bench):
    apt = [pkg for cmd, pkg in (("bwrap", "bubblewrap"), ("firejail", "firejail"),
                                ("hyperfine", "hyperfine"), ("socat", "socat"),
                                ("rg", "ripgrep")) if not shutil.which(cmd)]
    if apt:
        log(f"installing {' '.join(apt)}")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        r = subprocess.run(["apt-get", "install", "-y", "-qq"] + apt, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if r.returncode != 0:
            subprocess.run(["apt-get", "update", "-qq"], env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
            r = subprocess.run(["apt-get", "install", "-y", "-qq"] + apt, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if r.returncode != 0:
            bench.notes.append(f"apt-get install {' '.join(apt)} failed: "
                               f"{(r.stderr.strip().splitlines() or ['?'])[-1]}")
    if not shutil.which("srt"):
        if shutil.which("npm"):
            log("installing @anthropic-ai/sandbox-runtime (npm)")
            try:
                r = subprocess.run(["npm", "install", "-g", "@anthropic-ai/sandbox-runtime"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                   text=True, timeout=300)
                if r.returncode != 0:
                    bench.notes.append("npm install -g @anthropic-ai/sandbox-runtime failed "
                                       "(registry unreachable?): srt skipped")
            except subprocess.TimeoutExpired:
                bench.notes.append("npm install -g @anthropic-ai/sandbox-runtime timed out: "
                                   "srt skipped")
        else:
            bench.notes.append("no npm: srt skipped")


def compile_helpers():
    os.makedirs(BUILD, exist_ok=True)
    cc = os.environ.get("CC", "cc")
    jobs = [(["floor.c"], "floor", []),
            (["rawclient.c"], "rawclient", pkg_config("msgpack", "-lmsgpackc"))]
    for srcs, out, libs in jobs:
        src = [os.path.join(HERE, s) for s in srcs]
        dst = os.path.join(BUILD, out)
        if os.path.exists(dst) and all(os.path.getmtime(s) <= os.path.getmtime(dst) for s in src):
            continue
        cmd = [cc, "-std=c11", "-O2", "-Wall", "-Wextra", "-o", dst] + src + libs
        r = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)
        if r.returncode != 0:
            sys.exit(f"bench: {' '.join(cmd)} failed:\n{r.stderr}"
                     + ("\n(msgpack-c missing? apt-get install libmsgpack-dev)"
                        if out == "rawclient" else ""))
    return os.path.join(BUILD, "floor"), os.path.join(BUILD, "rawclient")


def pkg_config(pkg, fallback):
    try:
        r = subprocess.run(["pkg-config", "--cflags", "--libs", pkg], stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True)
        if r.returncode == 0 and r.stdout.strip():
            return r.stdout.split()
    except OSError:
        pass
    return [fallback]


def raise_nofile():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, 65536) if hard != resource.RLIM_INFINITY else 65536
    if soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            pass


# ---------------------------------------------------------------------------- runners


class Ctx:
    def __init__(self, args, floor, rawclient, state):
        self.args, self.floor, self.rawclient, self.state = args, floor, rawclient, state
        self.stockade = os.path.join(REPO, "stockade")
        env = dict(os.environ)
        env.pop("STOCKADE_DEPTH", None)
        env.pop("STOCKADE_POLICY", None)
        env["STOCKADE_PLUGIN_PATH"] = os.path.join(REPO, "plugins")
        self.env = env
        self.serve_log = open(os.path.join(state, "serve.log"), "ab")

    def serve_argv(self, iso):
        return [self.stockade, "serve", "--policy", POLICY[iso], "--state-dir", self.state]

    def run_argv(self, iso):
        return [self.stockade, "run", "--policy", POLICY[iso], "--state-dir", self.state, "--"]


# Runners off: every call a shim of its own (core/zygote.h), for the comparison rows.
ONE_SHIM = {"STOCKADE_RUNNERS": "0"}
NO_AHEAD = {"STOCKADE_PREPARED": "0"}


def run_floor(ctx, mode, n, cmd, keep_env=False, timeout=None):
    """floor.c: per-iteration ns (fork/spawn) or the batch's ns (par). Returns
    (samples_ns, error or None)."""
    env = dict(ctx.env, FLOOR_KEEP_ENV="1") if keep_env else dict(ctx.env)
    if not keep_env:
        env.pop("FLOOR_KEEP_ENV", None)
    argv = [ctx.floor, mode] + [str(x) for x in (n if isinstance(n, (list, tuple)) else [n])] + cmd
    try:
        r = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                           timeout=timeout, cwd=ctx.state)
    except subprocess.TimeoutExpired:
        return [], f"timed out after {timeout}s"
    xs = [int(x) for x in r.stdout.split()]
    if r.returncode != 0:
        return xs, (r.stderr.decode(errors="replace").strip() or f"exit {r.returncode}")
    return xs, None


def run_rawclient(ctx, opts, iso, timeout, env=None):
    """rawclient.c: parsed lines {key: [values]}; raises RuntimeError on failure."""
    argv = [ctx.rawclient] + [str(o) for o in opts] + ["--"] + ctx.serve_argv(iso)
    try:
        r = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           env=dict(ctx.env, **(env or {})), timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"rawclient {' '.join(map(str, opts))}: timed out after {timeout}s") from e
    out = {}
    for line in r.stdout.decode().splitlines():
        parts = line.split()
        if parts:
            out.setdefault(parts[0], []).append([float(p) for p in parts[1:]])
    if r.returncode != 0:
        raise RuntimeError(r.stderr.decode(errors="replace") or f"exit {r.returncode}")
    return out


def col(out, key, i=0):
    return [v[i] for v in out.get(key, [])]


def iterations(ctx, probe_ns, budget_s, lo, hi):
    """How many iterations fit the row's time budget, from a probe's per-call time."""
    if not probe_ns:
        return lo
    per = max(statistics.median(probe_ns), 1) / 1e9
    return int(max(lo, min(hi, budget_s / per)))


# ---------------------------------------------------------------------------- section 1


def comparators(ctx):
    """(label, argv prefix) of the other sandboxes, the first form that works here."""
    out = []
    bw = shutil.which("bwrap")
    out.append(("bwrap", [("bwrap --unshare-all --ro-bind / /",
                           [bw, "--unshare-all", "--ro-bind", "/", "/"])] if bw else []))
    un = shutil.which("unshare")
    out.append(("unshare", [("unshare -Urmpinuf --mount-proc", [un, "-Urmpinuf", "--mount-proc"]),
                            ("unshare -mpinuf --mount-proc", [un, "-mpinuf", "--mount-proc"])]
                if un else []))
    fj = shutil.which("firejail")
    out.append(("firejail", [("firejail --quiet --noprofile", [fj, "--quiet", "--noprofile"])]
                if fj else []))
    srt = shutil.which("srt")
    out.append(("srt", [("srt (npm sandbox-runtime)", [srt])] if srt else []))
    return out


def py_client_latency(ctx, iso, tool, argv, n, warmup):
    sys.path.insert(0, os.path.join(REPO, "contrib", "python"))
    from stockade_client import Client   # noqa: E402  (needs python3-msgpack)
    lat = []
    c = Client.spawn(ctx.serve_argv(iso), rpc_timeout=120, env=ctx.env, stderr=ctx.serve_log)
    try:
        c.hello()
        s = c.open_session()
        for i in range(warmup + n):
            t0 = time.perf_counter_ns()
            r = s.call(tool, argv)
            dt = time.perf_counter_ns() - t0
            if r.class_ != "OK":
                raise RuntimeError(f"call {tool} answered {r.class_}: {r.message}")
            if i >= warmup:
                lat.append(dt)
        s.close()
    finally:
        rc = c.close() if hasattr(c, "close") else None
        proc = c.proc
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.returncode not in (0, None):
        raise RuntimeError(f"stockade serve exited {proc.returncode} (close: {rc})")
    return lat


def mcp_client_latency(ctx, iso, tool, argv, n, warmup, pings=0):
    """`stockade mcp` driven by a minimal JSON-lines client, shaped like the Python msgpack
    client above (one blocking request, one answer), so the two rows differ by the
    protocol: JSON decoding/encoding and the MCP front end's in-process hop. With pings,
    also returns the round trips of that many `ping`s (the front end alone, no call)."""
    argv_mcp = [ctx.stockade, "mcp", "--policy", POLICY[iso], "--state-dir", ctx.state]
    proc = subprocess.Popen(argv_mcp, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=ctx.serve_log, env=ctx.env)

    def rpc(i, method, params):
        proc.stdin.write(json.dumps({"jsonrpc": "2.0", "id": i, "method": method,
                                     "params": params}).encode() + b"\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("stockade mcp closed its output")
        return json.loads(line)

    lat, ping_lat = [], []
    try:
        rpc(0, "initialize", {"protocolVersion": "2025-11-25", "capabilities": {},
                              "clientInfo": {"name": "bench", "version": "1"}})
        for i in range(pings):
            t0 = time.perf_counter_ns()
            rpc(-1 - i, "ping", {})
            ping_lat.append(time.perf_counter_ns() - t0)
        for i in range(warmup + n):
            t0 = time.perf_counter_ns()
            r = rpc(i + 1, "tools/call", {"name": tool, "arguments": {"argv": argv}})
            dt = time.perf_counter_ns() - t0
            res = r.get("result") or {}
            if res.get("isError") is not False:
                raise RuntimeError(f"mcp call {tool} answered {r}")
            if i >= warmup:
                lat.append(dt)
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    if proc.returncode != 0:
        raise RuntimeError(f"stockade mcp exited {proc.returncode}")
    return (lat, ping_lat) if pings else lat


def section_latency(ctx, bench):
    q = ctx.args.quick
    B, LO, HI = (0.25, 5, 40) if q else (4.0, 20, 1000)
    sec = "1 latency"
    for cmd_name, cmd, tool, targs in (("true", ["/bin/true"], "true", []),
                                       ("echo hello", ["/bin/echo", "hello"], "echo", ["hello"])):
        log(f"latency: {cmd_name}")
        base = f"floor:{cmd_name}"
        # the floor and posix_spawn
        probe, _ = run_floor(ctx, "fork", 20, cmd)
        n = iterations(ctx, probe, B / 2, LO * 5, HI * 5)
        for mode, label, key in (("fork", "fork+execve+waitpid (floor)", base),
                                 ("spawn", "posix_spawn+waitpid", f"spawn:{cmd_name}")):
            xs, err = run_floor(ctx, mode, n, cmd)
            if err:
                bench.fail(f"floor {mode} {cmd_name}", err)
                bench.skip(sec, f"{cmd_name}: {label}", "ms", err, key=key)
            else:
                bench.add(Row(sec, f"{cmd_name}: {label}", "ms", [x / 1e6 for x in xs],
                              base=base, key=key))
        # stockade run
        for iso in ("process", "strict"):
            argv = ctx.run_argv(iso) + [tool] + targs
            label = f"{cmd_name}: stockade run ({iso})"
            probe, err = run_floor(ctx, "fork", 3, argv, keep_env=True, timeout=120)
            if not err:
                n = iterations(ctx, probe, B, LO, HI)
                xs, err = run_floor(ctx, "fork", n, argv, keep_env=True, timeout=600)
            if err:
                bench.fail(label, err)
                bench.skip(sec, label, "ms", "failed", key=f"run:{iso}:{cmd_name}")
            else:
                bench.add(Row(sec, label, "ms", [x / 1e6 for x in xs], base=base,
                              key=f"run:{iso}:{cmd_name}"))
        if cmd_name == "true":
            # the same with a policy that has nothing to compile at start (no redactors):
            # the binary's and the call's start without the secret set's compile
            argv = [ctx.stockade, "run", "--policy", RUN_PLAIN, "--state-dir", ctx.state,
                    "--", "true"]
            label = "true: stockade run (process), a policy without redactors"
            probe, err = run_floor(ctx, "fork", 3, argv, keep_env=True, timeout=120)
            if not err:
                xs, err = run_floor(ctx, "fork", iterations(ctx, probe, B, LO, HI), argv,
                                    keep_env=True, timeout=600)
            if err:
                bench.fail(label, err)
                bench.skip(sec, label, "ms", "failed", key="run:plain")
            else:
                bench.add(Row(sec, label, "ms", [x / 1e6 for x in xs], base=base,
                              key="run:plain"))
        # serve: the Python client, then the raw C client
        for iso in ("process", "strict"):
            label = f"{cmd_name}: serve, Python client ({iso})"
            try:
                probe = py_client_latency(ctx, iso, tool, targs, 5, 2)
                n = iterations(ctx, probe, B, LO, HI)
                xs = py_client_latency(ctx, iso, tool, targs, n, 5)
                bench.add(Row(sec, label, "ms", [x / 1e6 for x in xs], base=base,
                              key=f"py:{iso}:{cmd_name}"))
            except Exception as e:   # noqa: BLE001  (any failure of stockade is reported)
                bench.fail(label, f"{type(e).__name__}: {e}")
                bench.skip(sec, label, "ms", "failed", key=f"py:{iso}:{cmd_name}")
        # the same call through `stockade mcp`: ratio to the msgpack row just above
        for iso in ("process", "strict"):
            label = f"{cmd_name}: mcp, Python JSON-lines client ({iso})"
            try:
                probe = mcp_client_latency(ctx, iso, tool, targs, 5, 2)
                n = iterations(ctx, probe, B, LO, HI)
                xs = mcp_client_latency(ctx, iso, tool, targs, n, 5)
                bench.add(Row(sec, label, "ms", [x / 1e6 for x in xs],
                              base=f"py:{iso}:{cmd_name}", key=f"mcp:{iso}:{cmd_name}",
                              note="ratio: to the msgpack Python client's row"))
                if cmd_name == "true" and iso == "process":
                    _, pings = mcp_client_latency(ctx, iso, tool, targs, 0, 0,
                                                  pings=50 if q else 1000)
                    bench.add(Row(sec, "mcp ping round trip (the JSON front end alone)", "ms",
                                  [x / 1e6 for x in pings], key="mcp:ping"))
            except Exception as e:   # noqa: BLE001  (any failure of stockade is reported)
                bench.fail(label, f"{type(e).__name__}: {e}")
                bench.skip(sec, label, "ms", "failed", key=f"mcp:{iso}:{cmd_name}")
        for iso in ("process", "strict"):
            label = f"{cmd_name}: serve, raw C client ({iso})"
            try:
                opts = ["--mode", "seq", "--tool", tool] + sum((["--arg", a] for a in targs), [])
                probe = col(run_rawclient(ctx, opts + ["-n", 5, "--warmup", 2], iso, 120), "lat")
                n = iterations(ctx, probe, B, LO, HI)
                out = run_rawclient(ctx, opts + ["-n", n, "--warmup", 5], iso, 600)
                bench.add(Row(sec, label, "ms", [x / 1e6 for x in col(out, "lat")], base=base,
                              key=f"raw:{iso}:{cmd_name}"))
                if cmd_name == "true":
                    # the same with runners off: a shim of its own per call (as before
                    # runners), in the same run
                    label1 = f"true: serve, raw C client, one shim per call ({iso})"
                    out1 = run_rawclient(ctx, opts + ["-n", n, "--warmup", 5], iso, 600,
                                         env=ONE_SHIM)
                    bench.add(Row(sec, label1, "ms", [x / 1e6 for x in col(out1, "lat")],
                                  base=base, key=f"raw1:{iso}:{cmd_name}",
                                  note="STOCKADE_RUNNERS=0"))
                    bench.add(Row(sec, f"session.open round trip ({iso})", "ms",
                                  [x / 1e6 for x in col(probe_opens(ctx, iso), "open")],
                                  base=base, note="raw C client; see also section 4",
                                  key=f"open:{iso}"))
                    if iso == "strict":
                        # each session building its own world, as without root
                        bench.add(Row(sec, "session.open round trip (strict), no world "
                                      "made ahead", "ms",
                                      [x / 1e6 for x in col(probe_opens(ctx, iso, NO_AHEAD),
                                                            "open")],
                                      base=base, note="STOCKADE_PREPARED=0",
                                      key="open1:strict"))
            except RuntimeError as e:
                bench.fail(label, str(e))
                bench.skip(sec, label, "ms", "failed", key=f"raw:{iso}:{cmd_name}")
        # the other sandboxes
        for name, forms in comparators(ctx):
            key = f"cmp:{name}:{cmd_name}"
            if not forms:
                bench.skip(sec, f"{cmd_name}: {name}", "ms", "not installed", key=key)
                continue
            err = "?"
            for label, form in forms:
                probe, err = run_floor(ctx, "fork", 2, form + cmd, keep_env=True, timeout=120)
                if not err:
                    break
            shown = f"{cmd_name}: {label}"
            if err:
                bench.skip(sec, shown, "ms", f"does not work here: {err.splitlines()[-1][:80]}",
                           key=key)
                continue
            lo = 3 if q else (10 if name == "srt" else LO)
            n = iterations(ctx, probe, B, lo, 10 if q else HI)
            xs, err = run_floor(ctx, "fork", n, form + cmd, keep_env=True, timeout=900)
            if err:
                bench.skip(sec, shown, "ms", f"failed: {err.splitlines()[-1][:80]}", key=key)
            else:
                bench.add(Row(sec, shown, "ms", [x / 1e6 for x in xs], base=base, key=key))
        if cmd_name == "true":
            hyperfine_row(ctx, bench, sec, base)
            xs, err = run_floor(ctx, "fork", 5 if q else 100, [ctx.stockade, "version"],
                                keep_env=True)
            if err:
                bench.fail("stockade version", err)
            else:
                bench.add(Row(sec, "stockade version (binary start alone, no policy)", "ms",
                              [x / 1e6 for x in xs], base=base, key="version"))


def probe_opens(ctx, iso, env=None):
    """A few more session.open round trips (the seq run above opens only one), back to
    back."""
    n = 5 if ctx.args.quick else 30
    return run_rawclient(ctx, ["--mode", "seq", "--sessions", n, "-n", 1, "--warmup", 0],
                         iso, 600, env=env)


def hyperfine_row(ctx, bench, sec, base):
    """A cross-check of the floor-timed `stockade run` row by an independent timer."""
    hf = shutil.which("hyperfine")
    label = "true: stockade run (process), timed by hyperfine -N"
    if not hf:
        bench.skip(sec, label, "ms", "hyperfine not installed", key="hyperfine")
        return
    out = os.path.join(ctx.state, "hyperfine.json")
    runs = 10 if ctx.args.quick else 200
    cmd = " ".join(ctx.run_argv("process") + ["true"])
    r = subprocess.run([hf, "-N", "--style", "none", "--warmup", "3", "--runs", str(runs),
                        "--export-json", out, cmd], env=ctx.env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True, timeout=600)
    if r.returncode != 0:
        bench.skip(sec, label, "ms", f"hyperfine failed: {r.stderr.strip()[-80:]}",
                   key="hyperfine")
        return
    with open(out) as f:
        times = json.load(f)["results"][0]["times"]
    bench.add(Row(sec, label, "ms", [t * 1e3 for t in times], base=base, key="hyperfine"))


# ---------------------------------------------------------------------------- section 2


def section_parallel(ctx, bench):
    q = ctx.args.quick
    reps = 2 if q else 5
    sec = "2 throughput"
    for k in (1, 2, 8, 32):
        log(f"throughput: {k} in flight")
        n = max(k * 2, 16) if q else max(200, k * 10)
        base = f"pfloor:{k}"
        rates = []
        err = None
        for _ in range(reps):
            xs, err = run_floor(ctx, "par", [k, n], ["/bin/true"])
            if err:
                break
            rates.append(n * 1e9 / xs[0])
        if err:
            bench.fail(f"parallel floor K={k}", err)
            bench.skip(sec, f"{k} in flight: fork+exec floor, {k} worker{'s' if k > 1 else ''}", "calls/s", "failed",
                       key=base)
        else:
            bench.add(Row(sec, f"{k} in flight: fork+exec floor, {k} worker{'s' if k > 1 else ''}", "calls/s", rates,
                          base=base, better="higher", key=base))
        for iso in ("process", "strict"):
            label = f"{k} in flight: serve, C client pipelining ({iso})"
            try:
                nn = n if iso == "process" else max(n // 2, k * 2)
                out = run_rawclient(ctx, ["--mode", "par", "--inflight", k, "-n", nn,
                                          "--reps", reps, "--tool", "true"], iso, 900)
                bench.add(Row(sec, label, "calls/s", col(out, "rate"), base=base,
                              better="higher", key=f"par:{iso}:{k}",
                              note=f"{k} session(s), one call in flight in each"))
            except RuntimeError as e:
                bench.fail(label, str(e))
                bench.skip(sec, label, "calls/s", "failed", key=f"par:{iso}:{k}")
            if k in (8,) and not q:
                label = f"{k} in flight: serve, one shim per call ({iso})"
                try:
                    out = run_rawclient(ctx, ["--mode", "par", "--inflight", k, "-n", nn,
                                              "--reps", reps, "--tool", "true"], iso, 900,
                                        env=ONE_SHIM)
                    bench.add(Row(sec, label, "calls/s", col(out, "rate"), base=base,
                                  better="higher", key=f"par1:{iso}:{k}",
                                  note="STOCKADE_RUNNERS=0"))
                except RuntimeError as e:
                    bench.fail(label, str(e))
                    bench.skip(sec, label, "calls/s", "failed", key=f"par1:{iso}:{k}")


# ---------------------------------------------------------------------------- section 3


def section_stream(ctx, bench):
    q = ctx.args.quick
    size = (16 << 20) if q else GIB
    reps = 2 if q else 3
    sec = "3 streaming"
    mb = size / 1e6
    gen = f"head -c {size} /dev/zero"
    log(f"streaming: {size >> 20} MiB")
    xs, err = run_floor(ctx, "fork", reps, ["/bin/sh", "-c", f"{gen} | cat > /dev/null"])
    base = "pipe"
    szl = f"{size >> 20} MiB" if size < GIB else "1 GiB"
    if err:
        bench.fail("raw pipe", err)
        bench.skip(sec, f"{szl}: raw pipe ({gen} | cat)", "MB/s", "failed", key=base)
    else:
        bench.add(Row(sec, f"{szl}: raw pipe (head | cat > /dev/null)", "MB/s",
                      [mb * 1e9 / x for x in xs], base=base, better="higher", key=base))
    cases = [("process", "sh", False, "capture only (no redactor)"),
             ("process", "sh_redact", False, "default secret set (plugins/secrets.lua)"),
             ("process", "sh", True, "capture, stream=true to the C client"),
             ("process", "sh_redact", True, "secret set, stream=true to the C client"),
             ("strict", "sh", False, "capture only (no redactor)"),
             ("strict", "sh_redact", False, "default secret set (plugins/secrets.lua)")]
    for iso, tool, stream, what in cases:
        label = f"{szl}: call, {what} ({iso})"
        key = f"stream:{iso}:{tool}:{int(stream)}"
        try:
            opts = ["--mode", "stream", "--reps", reps, "--tool", tool, "--arg", "-c",
                    "--arg", gen] + (["--stream"] if stream else [])
            out = run_rawclient(ctx, opts, iso, 1800)
            got = col(out, "stream", 1)
            if any(int(b) != size for b in got):
                raise RuntimeError(f"the call delivered {got} bytes, not {size}")
            bench.add(Row(sec, label, "MB/s", [mb * 1e9 / x for x in col(out, "stream")],
                          base=base, better="higher", key=key,
                          note=("every byte sent as call.output" if stream else
                                "result capped at 1 MiB, the rest drained and counted")
                          + ("; every byte through the secret set" if tool == "sh_redact"
                             else "")))
        except RuntimeError as e:
            bench.fail(label, str(e))
            bench.skip(sec, label, "MB/s", "failed", key=key)


# ---------------------------------------------------------------------------- sections 4, 5


def pss_kb(pid):
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def descendants(pid):
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                kids = [int(x) for x in f.read().split()]
        except OSError:
            kids = []
        out += kids
        todo += kids
    return out


def runner_memory(ctx, bench, iso):
    """What a session's runner pool costs: the serve tree's PSS with N sessions open, then
    after one call in each (process: the runner is drawn then; strict: made at open, so
    the figure is the runner's own PSS, found below each session's zygote)."""
    sys.path.insert(0, os.path.join(REPO, "contrib", "python"))
    from stockade_client import Client   # noqa: E402  (needs python3-msgpack)
    nsess = 8 if ctx.args.quick else 32
    c = Client.spawn(ctx.serve_argv(iso), rpc_timeout=120, env=ctx.env, stderr=ctx.serve_log)
    try:
        c.hello()
        sessions = [c.open_session() for _ in range(nsess)]
        c.stats()
        before = sum(pss_kb(p) for p in descendants(c.proc.pid))
        for s in sessions:
            r = s.call("true", [])
            if r.class_ != "OK":
                raise RuntimeError(f"call true answered {r.class_}: {r.message}")
        standby = c.stats().get("standby", 0)
        tree = descendants(c.proc.pid)
        after = sum(pss_kb(p) for p in tree)
        if iso == "strict":
            # a session's zygote is a child of serve; its runner is the zygote's child
            runners = []
            with open(f"/proc/{c.proc.pid}/task/{c.proc.pid}/children") as f:
                for z in (int(x) for x in f.read().split()):
                    with open(f"/proc/{z}/task/{z}/children") as g:
                        runners += [int(x) for x in g.read().split()]
            # (the spawner's spares, in the server's pid namespace, are not a session's)
            host_ns = os.readlink(f"/proc/{c.proc.pid}/ns/pid")
            per = [pss_kb(p) for p in runners
                   if os.path.exists(f"/proc/{p}") and os.readlink(f"/proc/{p}/ns/pid") != host_ns]
        else:
            per = [(after - before) / nsess]
        for s in sessions:
            s.close()
    finally:
        c.close()
        try:
            c.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait()
    bench.add(Row("4 memory", f"runner pool per session, one call in flight ({iso})", "KiB",
                  per, key=f"runner:{iso}",
                  note=f"PSS; {nsess} sessions, {standby} processes standing by"))


def section_memory(ctx, bench):
    for iso in ("process", "strict"):
        try:
            runner_memory(ctx, bench, iso)
        except Exception as e:   # noqa: BLE001  (any failure of stockade is reported)
            bench.fail(f"runner memory ({iso})", f"{type(e).__name__}: {e}")
            bench.skip("4 memory", f"runner pool per session ({iso})", "KiB", "failed",
                       key=f"runner:{iso}")
    section_sessions(ctx, bench)


def section_sessions(ctx, bench):
    q = ctx.args.quick
    counts = {"process": (16, 64) if q else (256, 1000),
              "strict": (16, 64) if q else (256, 1000)}
    if ctx.args.strict_sessions:
        counts["strict"] = (min(256, ctx.args.strict_sessions), ctx.args.strict_sessions)
    n = 20 if q else 300
    mem, scale = "4 memory", "5 scaling"
    scaling = []
    for iso in ("process", "strict"):
        idle = []
        for m in counts[iso]:
            log(f"memory/scaling: {m} {iso} sessions")
            label = f"{m} sessions ({iso})"
            try:
                out = run_rawclient(ctx, ["--mode", "seq", "--sessions", m, "-n", n,
                                          "--warmup", 5, "--tool", "true"], iso, 1800)
            except RuntimeError as e:
                bench.fail(label, str(e))
                bench.skip(mem, f"supervisor RSS, {label}", "MiB", "failed",
                           key=f"rss:{iso}:{m}")
                continue
            idle += col(out, "rss_idle")
            kids = col(out, "kids")
            rss = col(out, "rss_open")
            bench.add(Row(mem, f"supervisor RSS, {label}", "MiB", [x / 1024 for x in rss],
                          base=f"rss:{iso}:idle", key=f"rss:{iso}:{m}",
                          note=f"{(statistics.median(rss) - statistics.median(col(out, 'rss_idle'))) / m:.1f} KiB/session over idle"))
            if iso == "strict" or max(kids, default=0) > 0:
                bench.add(Row(mem, f"descendants' VmRSS sum, {label}", "MiB",
                              [x / 1024 for x in col(out, "kids_rss")], key=f"kids:{iso}:{m}",
                              note=f"{int(statistics.median(kids))} processes; PSS sum "
                                   f"{statistics.median(col(out, 'kids_pss')) / 1024:.1f} MiB"))
            opens = [x / 1e6 for x in col(out, "open")]
            bench.add(Row(mem, f"session.open, {label}", "ms", opens, key=f"openm:{iso}:{m}",
                          base="floor:true" if "floor:true" in bench.by_key else None,
                          note="each open while 0..N-1 are open"))
            if m == counts[iso][-1]:
                scaling.append((iso, m, [x / 1e6 for x in col(out, "lat")]))
        if idle:
            row = Row(mem, f"supervisor RSS idle ({iso})", "MiB", [x / 1024 for x in idle],
                      key=f"rss:{iso}:idle")
            # placed before the rows that use it as their base
            bench.rows.insert(next(i for i, r in enumerate(bench.rows)
                                   if r.key.startswith(f"rss:{iso}:")), row)
            bench.by_key[row.key] = row
            for r in bench.rows:
                if r.base == row.key and not r.skipped:
                    r.ratio = r.median / row.median
    # section 5: the same calls with one session open, measured here the same way
    base = "floor:true" if "floor:true" in bench.by_key else None
    for iso, m, lat in scaling:
        label = f"true: serve, C client, 1 session ({iso})"
        try:
            out = run_rawclient(ctx, ["--mode", "seq", "--sessions", 1, "-n", n, "--warmup", 5,
                                      "--tool", "true"], iso, 600)
            one = bench.add(Row(scale, label, "ms", [x / 1e6 for x in col(out, "lat")],
                                base=base, key=f"scale:{iso}:1"))
        except RuntimeError as e:
            bench.fail(label, str(e))
            one = bench.add(Row(scale, label, "ms", [], note="skipped: failed",
                                key=f"scale:{iso}:1"))
        r = bench.add(Row(scale, f"true: serve, C client, {m} sessions ({iso})", "ms", lat,
                          base=base, key=f"scale:{iso}:{m}"))
        if not one.skipped and not r.skipped:
            r.note = f"{r.median / one.median:.2f}x the 1-session row"


# ---------------------------------------------------------------------------- output


def fmt(v):
    if v is None:
        return "-"
    a = abs(v)
    if a >= 1000:
        return f"{v:,.0f}"
    if a >= 100:
        return f"{v:.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    return f"{v:.3f}"


def print_table(bench, meta, wall):
    heads = ("section", "measurement", "median", "p25-p75", "unit", "n", "x baseline")
    lines = []
    for r in bench.rows:
        if r.skipped:
            lines.append((r.section, r.name, "-", "-", r.unit, "0", r.note))
            continue
        ratio = ""
        if r.base and r.key == r.base:
            ratio = "1.00x (baseline)"
        elif r.ratio is not None:
            ratio = f"{r.ratio:.2f}x"
        extra = f"  {r.note}" if r.note else ""
        lines.append((r.section, r.name, fmt(r.median), f"{fmt(r.p25)}-{fmt(r.p75)}", r.unit,
                      str(len(r.samples)), ratio + extra))
    w = [max(len(h), *(len(l[i]) for l in lines)) for i, h in enumerate(heads[:-1])]
    out = []
    out.append(f"stockade bench — {meta['commit'][:12]} — {meta['date']} — {meta['cpus']} cpus, "
               f"{meta['kernel']}, {'root' if meta['root'] else 'uid ' + str(os.geteuid())}"
               f"{' — QUICK' if meta['quick'] else ''}")
    out.append(f"load average (1 min) at start {meta['loadavg_start']:.2f}, at end "
               f"{os.getloadavg()[0]:.2f} (other work on the machine widens the spreads)")
    out.append("ratios: latency / the fork+exec floor of the same command; throughput and "
               "MB/s / their floor (below 1 = slower); RSS / idle")
    hdr = "  ".join(h.ljust(w[i]) if i < len(w) else h for i, h in enumerate(heads))
    out.append(hdr)
    out.append("-" * len(hdr))
    prev = None
    for l in lines:
        if prev is not None and l[0] != prev:
            out.append("")
        prev = l[0]
        cells = [l[i].rjust(w[i]) if i in (2, 3, 5) else l[i].ljust(w[i]) for i in range(len(w))]
        out.append("  ".join(cells) + "  " + l[-1])
    for n in bench.notes:
        out.append(f"note: {n}")
    out.append(f"wall time {wall:.1f} s; {len(bench.failures)} stockade failure(s)")
    print("\n".join(out), flush=True)


def write_json(path, bench, meta, wall):
    doc = dict(meta, wall_s=round(wall, 2), failures=bench.failures, notes=bench.notes,
               rows=[{"key": r.key, "section": r.section, "name": r.name, "unit": r.unit,
                      "median": r.median, "p25": r.p25, "p75": r.p75, "n": len(r.samples),
                      "baseline": r.base, "ratio": r.ratio, "better": r.better,
                      "skipped": r.skipped, "note": r.note} for r in bench.rows])
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def metadata(args):
    def git(*a):
        r = subprocess.run(["git", "-C", REPO] + list(a), stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True)
        return r.stdout.strip()
    ver = subprocess.run([os.path.join(REPO, "stockade"), "version"], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True).stdout.strip()
    return {"commit": git("rev-parse", "HEAD") or "unknown",
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
            "version": ver, "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "cpus": os.cpu_count(), "kernel": platform.release(), "root": is_root(),
            "quick": args.quick, "loadavg_start": os.getloadavg()[0]}


# ---------------------------------------------------------------------------- main


# ---------------------------------------------------------------------------- section 7


def section_noisy(ctx, bench):
    """Noisy neighbour (tests/bench/noisy.py): B's `true` latency while session A runs
    each attack, as a ratio to B alone on the same server. B alone is measured before
    the attacks and again after them, and the two pooled: on a shared machine the load
    moves, and one sample of it taken at the start would skew every ratio."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import noisy
    sec = "7 noisy neighbour"
    state = tempfile.mkdtemp(prefix="noisy.", dir=ctx.state)
    os.chmod(state, 0o711)
    srv = noisy.Server(os.path.join(REPO, "stockade"), state)
    alone_s = 1.0 if ctx.args.quick else 2.5
    lat, during = [], []
    try:
        log("noisy neighbour: B alone (before)")
        lat += [x * 1000 for x in noisy.alone(srv, alone_s)]
        for name, cls in noisy.ATTACKS.items():
            log(f"noisy neighbour: {name}")
            try:
                kw = {"entries": 20_000} if ctx.args.quick and name == "tree_at_close" else {}
                xs, bad, facts = noisy.measure(srv, cls, **kw)
            except Exception as e:      # an attack that could not be set up
                bench.fail(f"noisy neighbour {name}", str(e))
                during.append((name, None))
                continue
            if bad:
                bench.fail(f"noisy neighbour {name}", f"B's calls failed: {bad[:3]}")
            during.append((name, [x * 1000 for x in xs]))
        log("noisy neighbour: B alone (after)")
        lat += [x * 1000 for x in noisy.alone(srv, alone_s)]
    finally:
        srv.stop()
    if lat:
        bench.add(Row(sec, "B alone: `true` p50", "ms", lat, key="noisy:alone:p50",
                      note="before and after the attacks"))
        bench.add(Row(sec, "B alone: `true` p99", "ms", [noisy.quantile(lat, 0.99)],
                      key="noisy:alone:p99", note=f"worst {max(lat):.1f} ms, n={len(lat)}"))
    for name, xs in during:
        if xs is None:
            bench.skip(sec, f"B during {name}", "ms", "failed", key=f"noisy:{name}:p50")
            continue
        bench.add(Row(sec, f"B during {name}: p50", "ms", xs, base="noisy:alone:p50",
                      key=f"noisy:{name}:p50"))
        bench.add(Row(sec, f"B during {name}: p99", "ms", [noisy.quantile(xs, 0.99)],
                      base="noisy:alone:p99", key=f"noisy:{name}:p99",
                      note=f"worst {max(xs):.0f} ms, n={len(xs)}"))
    section_removal(ctx, bench, sec)


# Root removal's own time, on the state directory's file system (what a close costs a
# remover thread): shape, count (full), count (--quick), label.
REMOVAL_SHAPES = [("onefile", 10_000, 2_000, "dirs of one file"),
                  ("empty", 20_000, 4_000, "empty dirs"),
                  ("tree", 100_000, 20_000, "entries, 1,000 files a dir"),
                  ("deep", 2_000, 500, "deep chain")]


def section_removal(ctx, bench, sec):
    cc = os.environ.get("CC", "cc")
    exe = os.path.join(BUILD, "remove_bench")
    srcs = [os.path.join(HERE, "remove_bench.c"), os.path.join(REPO, "core", "root.c"),
            os.path.join(REPO, "core", "util.c")]
    os.makedirs(BUILD, exist_ok=True)
    r = subprocess.run([cc, "-std=c11", "-O2", "-D_GNU_SOURCE", "-I" + os.path.join(REPO, "core"),
                        "-o", exe] + srcs, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        bench.fail("root removal", r.stderr)
        return
    work = tempfile.mkdtemp(prefix="remove.", dir=ctx.state)
    try:
        for shape, full, quick, label in REMOVAL_SHAPES:
            n = quick if ctx.args.quick else full
            log(f"root removal: {n:,} {label}")
            r = subprocess.run([exe, work, shape, str(n)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, timeout=600)
            if r.returncode != 0:
                bench.fail(f"root removal {shape}", r.stderr)
                continue
            got = dict(kv.split("=", 1) for kv in r.stdout.split())
            bench.add(Row(sec, f"root removal: {n:,} {label}", "ms", [float(got["ms"])],
                          key=f"remove:{shape}",
                          note=f"{int(got['passes']):,} passes, at most "
                               f"{got['max_dir_passes']} over one dir"))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI smoke run: < 1 minute")
    ap.add_argument("--json", metavar="FILE", help="also write every figure to FILE")
    ap.add_argument("--install", action="store_true", help="install missing comparators "
                    "even in --quick mode")
    ap.add_argument("--no-install", action="store_true", help="never install anything")
    ap.add_argument("--only", default="1,2,3,4,6,7", help="sections to run (4 includes 5)")
    ap.add_argument("--strict-sessions", type=int, default=0,
                    help="open sessions for the strict memory row (default 1000; 64 quick)")
    args = ap.parse_args()
    t0 = time.monotonic()

    stockade = os.path.join(REPO, "stockade")
    if not os.access(stockade, os.X_OK):
        log("./stockade is missing: running make")
        if subprocess.run(["make", "-C", REPO, "stockade"]).returncode != 0:
            sys.exit("bench: make failed")
    bench = Bench(args)
    if is_root() and not args.no_install and (not args.quick or args.install):
        install_missing(bench)
    elif not is_root():
        bench.notes.append("not root: nothing installed; missing comparators are skipped")
    floor, rawclient = compile_helpers()
    raise_nofile()

    state = tempfile.mkdtemp(prefix="stockade-bench.", dir="/var/tmp")
    os.chmod(state, 0o711)   # the per-session service uids walk through it
    atexit.register(shutil.rmtree, state, True)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, f: sys.exit(128 + s))
    ctx = Ctx(args, floor, rawclient, state)
    meta = metadata(args)

    only = set(args.only.split(","))
    try:
        if "1" in only:
            section_latency(ctx, bench)
        if "2" in only:
            section_parallel(ctx, bench)
        if "3" in only:
            section_stream(ctx, bench)
        if "4" in only or "5" in only:
            section_memory(ctx, bench)
        if "6" in only:
            from redact_bench import section_redaction
            section_redaction(ctx, bench, Row)
        if "7" in only:
            section_noisy(ctx, bench)
    finally:
        ctx.serve_log.close()
    # a serve that logged a crash of its own is a failure even if every call answered
    with open(os.path.join(state, "serve.log"), "rb") as f:
        tail = f.read().decode(errors="replace")
    for word in ("AddressSanitizer", "runtime error:", "Segmentation fault", "INTERNAL"):
        if word in tail:
            bench.fail("stockade serve log", f"mentions {word!r}")
    wall = time.monotonic() - t0
    print_table(bench, meta, wall)
    if args.json:
        write_json(args.json, bench, meta, wall)
        log(f"wrote {args.json}")
    return 1 if bench.failures else 0


if __name__ == "__main__":
    sys.exit(main())
