"""``stockade soak``: drive a real ``stockade serve`` child over the protocol with a hostile
workload mix for a set duration, sample what the server holds, and fail on leaks.

    python3 -m stockade_soak --stockade ./stockade --duration 30s [options]
    stockade soak [options]        # the binary execs this module with --stockade SELF

A program of its own (contrib/soak/stockade_soak, installed beside the client library by
`make install`), built on the protocol client stockade_client.

What it does (ARCHITECTURE.md, "Accounting and soak"):

- Starts ``stockade serve --policy P --state-dir S`` on pipes (the Python client of this
  package; nothing in-process). Without ``--policy`` it writes a workload policy of its own
  to a temp file: policies/default.lua's tools and values, with ``limits.processes = 32``,
  ``limits.running = 2 x concurrency``, ``limits.sessions = 2 x concurrency`` and
  ``sh``'s timeout at 10 s. The workload only uses tools of policies/default.lua (echo,
  true, cat, sleep, sh) and passes ``timeout_ms`` on every call that could run long, so
  ``--policy policies/default.lua`` works too.
- Runs ``--concurrency`` worker threads, each with its own session, one call at a time.
  Default concurrency: ``min(2 x hello.limits.max_running, 2 x CPUs)`` (at least 2); with
  the written policy that is ``2 x CPUs`` (its ``running`` is then twice that, so the mix
  is never refused for admission). Every call kind appears in the mix:

  ========== ============================================================ ===============
  kind       call                                                         expected class
  ========== ============================================================ ===============
  normal     echo / true / cat (stdin) — output checked                   OK
  flood      sh -c 'yes | head -c 5000000' (timeout 10 s)                 OK, capped
  timeout    sleep 30 with timeout_ms 200                                 TOOL_TIMEOUT
  term_ignore sh -c 'trap "" TERM; sleep 30' with timeout_ms 200          TOOL_TIMEOUT
  daemonizer sh -c 'setsid sleep 300 & echo $!'                           OK
  fork_bomb  sh -c 'f(){ f|f& }; f; sleep 5' with timeout_ms 2000         TOOL_TIMEOUT...
  fd_leaker  sh -c '(sleep 60 3>/dev/null 4>/dev/null &); exec 5>/dev/null; echo ok'
  refusal    an unknown tool                                              POLICY_VIOLATION
  cancel     sleep 30, cancelled after 50-200 ms                          CANCELLED
  deadline   sleep 5 with deadline_ms 150                                 DEADLINE_EXCEEDED
  ========== ============================================================ ===============

  (The fork bomb sleeps after forking so the bomb runs until the 2 s timeout against the
  policy's process limit, instead of being swept the instant its parent exits.) Every
  ``sleep`` argument carries a per-run marker (``30.0NNNNNNN``) so any tool process that
  outlives its call can be found on the host. Half of the workers (the even ones) close
  their session and open a new one every ``--churn-every`` calls (session churn).
  OVERLOADED answers are counted, backed off and are not errors; an expired session is
  reopened.
- Every ``--sample-interval`` (1 s) it samples the server's ``stats`` (fds, processes,
  zombies, rss, sessions, running) over the same connection, the host's view of the server
  (/proc: its fds, its descendants and their zombies, live marked tool processes) and the
  leftover session dirs (dirs under STATE/sessions/ of this run's sessions that belong to
  no open session). ``alarm`` notifications are recorded.
- Warm-up is the first 10 % of the duration (at least 2 s). At its end the workload is
  paused and drained and the *baseline* is sampled quiescent (sessions open). The RSS
  check compares the end with the RSS high-water of the warm-up and the first half of
  the run: a quiescent server's RSS depends on how much heap the allocator kept after the
  last 1 MiB output buffers (the floods), anywhere up to its working set, so one quiescent
  sample against another is noise, while a leak grows past the high-water. At the end:
  stop starting calls, wait for the ones in flight, let the server settle, sample *end*
  (sessions still open: like for like with the baseline), close every session, check the
  session dirs, sample *final*, look for surviving marked processes, close the server's
  stdin and check its exit status.

Verdict (exit status 1 when any check fails; 125 for a usage error or a server that cannot
start, as every stockade subcommand; 130 for a run stopped early by SIGINT/SIGTERM whose checks passed — it drains and
reports as usual; 0 otherwise):

- the server never died and exited 0 after its stdin was closed;
- zombies == 0 at the end, after the drain (``stats.zombies`` and the host's view);
- no zombie outlived its call: the samples that found a child of the supervisor (a call's
  shim, an adopted orphan) still unreaped 200 ms later are at most ``--max-zombie-samples``
  percent (default 5), and none stayed unreaped for a second. (``stats.zombies`` counts
  the server's whole tree, zombies inside calls still running included — a fork bomb's
  unreaped children — so it is charted and checked at the end, not per sample);
- fd growth ``end - baseline <= --max-fd-growth`` (default 8);
- RSS growth ``end vs the warm-up high-water <= --max-rss-growth`` percent (default 5),
  ignored when the growth is below ``--rss-growth-floor`` MiB (default 2);
- no session dir left after every session was closed (before the server stops);
- no process left in the server's tree, and no marked tool process alive, after the drain;
- every kind of the mix ran at least once, every call finished, and no call answered with
  a class its kind does not allow (``--max-errors``, default 0).

Progress goes to stderr: one status line rewritten with \\r on a TTY, a plain line every
10 s otherwise. The summary goes to stdout. ``--report PATH.json`` writes the JSON report
(verdict, thresholds, figures start/baseline/peak/end/final, per-kind and per-class counts,
errors, alarms, the sampled series) and an SVG chart beside it (PATH.svg).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from stockade_client.client import Client, Session
from stockade_client.errors import (ConnectionClosed, NoSuchSession, Overloaded,
                                    SessionExpired, StockadeError)

__all__ = ["main", "parse_duration", "evaluate", "render_svg", "KINDS", "Soak"]

MiB = 1 << 20
EXIT_USAGE = 125        # a usage error, as in every stockade subcommand

# ---------------------------------------------------------------- parsing

_DUR_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DUR_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")


def parse_duration(text: str) -> float:
    """Seconds of ``1h``, ``10m``, ``90s``, ``250ms``, ``1h30m``, ``1.5h`` or a bare number
    of seconds. ValueError otherwise."""
    s = str(text).strip().lower()
    if re.fullmatch(r"\d+(?:\.\d+)?", s):
        return float(s)
    pos, total = 0, 0.0
    if not s:
        raise ValueError(f"not a duration: {text!r}")
    while pos < len(s):
        m = _DUR_PART.match(s, pos)
        if not m:
            raise ValueError(f"not a duration: {text!r} (use e.g. 1h, 10m, 90s, 250ms)")
        total += float(m.group(1)) * _DUR_UNITS[m.group(2)]
        pos = m.end()
    return total


def _arg_duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def fmt_duration(sec: float) -> str:
    if sec < 1:
        return f"{sec * 1000:.0f}ms"
    if sec < 60:
        return f"{sec:.1f}s"
    m, s = divmod(int(round(sec)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def _clock(sec: float) -> str:
    m, s = divmod(int(sec), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


# ---------------------------------------------------------------- the workload

#: Every kind of the mix, with its default weight (relative picks, not time: the slow
#: kinds — term_ignore and fork_bomb take 2 s+ — get fewer picks).
KINDS: "collections.OrderedDict[str, int]" = collections.OrderedDict([
    ("normal", 50), ("flood", 5), ("timeout", 5), ("term_ignore", 3), ("daemonizer", 6),
    ("fork_bomb", 3), ("fd_leaker", 6), ("refusal", 8), ("cancel", 5), ("deadline", 5),
])

#: Classes each kind may answer with; anything else is an error of the run. (A session
#: that expired under a call — its fuse — is handled apart, as is OVERLOADED.)
EXPECTED: Dict[str, Tuple[str, ...]] = {
    "normal": ("OK",),
    "flood": ("OK",),
    "timeout": ("TOOL_TIMEOUT",),
    "term_ignore": ("TOOL_TIMEOUT",),
    "daemonizer": ("OK",),
    # forks fail against the process limit: the shell may give up (TOOL_ERROR), the server
    # may classify it RESOURCE_LIMIT, or the 2 s timeout fires (the usual outcome)
    "fork_bomb": ("TOOL_TIMEOUT", "RESOURCE_LIMIT", "TOOL_ERROR", "OK"),
    "fd_leaker": ("OK",),
    "refusal": ("POLICY_VIOLATION",),
    "cancel": ("CANCELLED",),
    "deadline": ("DEADLINE_EXCEEDED",),
}

FLOOD_BYTES = 5_000_000
# How long a sampled zombie child of the supervisor may stay unreaped before it counts.
LINGER = 0.2
# A child of the supervisor unreaped that long has outlived its call (zombie_stuck).
STUCK_MS = 1000
UNKNOWN_TOOL = "soak-no-such-tool"
# The extra wait on a response beyond the call's own bound (a loaded server, the grace).
RESPONSE_SLACK = 60.0


def _policy_text(concurrency: int, isolation: str, with_secrets: bool) -> str:
    """The workload policy written when no --policy is given."""
    n = max(2, 2 * concurrency)
    secrets_req = 'local secrets = require "plugins.secrets"\n' if with_secrets else ""
    redact = "  redact = { secrets.default },\n" if with_secrets else ""
    return f"""-- Written by `stockade soak` (stockade_soak): the soak's workload policy.
-- policies/default.lua's registry and values, with the soak's limits: a small process
-- cap for the fork bombs, admission sized for {concurrency} concurrent workers.
local stockade = require "stockade"
{secrets_req}
local function tool(path, timeout, extra)
  local t = {{ path = path, owner = "soak", timeout = timeout,
              schema = {{ type = "object", properties = {{ argv = {{ type = "array",
                         items = {{ type = "string" }} }} }} }} }}
  for k, v in pairs(extra or {{}}) do t[k] = v end
  return stockade.tool(t)
end

return stockade.policy {{
  name = "soak-workload",
  isolation = "{isolation}",
  timeouts = {{
    call = "30s", call_max = "10m", grace = "2s", cpu = "60s",
    fuse = "50m", lease = "10m", idle_shutdown = "60m", deadline_min = "100ms",
  }},
  limits = {{
    memory = "1GiB", processes = 32, file_size = "256MiB", open_files = 256,
    output = "1MiB", stdin = "1MiB", argv = 64, argv_bytes = "64KiB",
    sessions = {n}, running = {n}, depth = 4,
  }},
  env = {{ path = "/usr/bin:/bin", allow = {{ "LANG", "TZ" }}, deny = {{ "*_TOKEN", "AWS_*" }} }},
  network = "none",
{redact}
  tools = {{
    echo  = tool("/bin/echo", "5s", {{ idempotent = true }}),
    cat   = tool("/bin/cat", "10s", {{ idempotent = true }}),
    ls    = tool("/bin/ls", "10s", {{ idempotent = true }}),
    head  = tool("/usr/bin/head", "10s", {{ idempotent = true }}),
    wc    = tool("/usr/bin/wc", "10s", {{ idempotent = true }}),
    grep  = tool("/bin/grep", "30s", {{ idempotent = true }}),
    ["true"]  = tool("/bin/true", "5s", {{ idempotent = true }}),
    ["false"] = tool("/bin/false", "5s", {{ idempotent = true }}),
    sleep = tool("/bin/sleep", "60s", {{ idempotent = true }}),
    sh    = tool("/bin/sh", "10s", {{ idempotent = false }}),
  }},
}}
"""


# ---------------------------------------------------------------- host observation (/proc)


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def _stat(pid: int) -> Tuple[bytes, int]:
    data = _read(f"/proc/{pid}/stat")
    try:
        rest = data.rsplit(b")", 1)[1].split()
        return rest[0], int(rest[1])
    except (IndexError, ValueError):
        return b"", 0


def host_view(server_pid: int, marker: bytes) -> Dict[str, Any]:
    """The server as the host sees it: its open fds, its descendants (live, zombie) and
    the live processes anywhere that carry this run's marker in their argv."""
    kids: Dict[int, List[int]] = collections.defaultdict(list)
    states: Dict[int, bytes] = {}
    marked: List[int] = []
    me = os.getpid()
    try:
        names = os.listdir("/proc")
    except OSError:
        names = []
    for name in names:
        if not name.isdigit():
            continue
        pid = int(name)
        state, ppid = _stat(pid)
        if not state:
            continue
        states[pid] = state
        kids[ppid].append(pid)
        if pid != me and state not in (b"Z", b"X") and marker in _read(f"/proc/{pid}/cmdline"):
            marked.append(pid)
    live = zombies = 0
    # zombies the supervisor itself has to reap: its direct children (the calls' shims,
    # orphans it adopted as subreaper). Deeper ones belong to a call still supervised.
    own_z = sorted(p for p in kids.get(server_pid, ()) if states.get(p) == b"Z")
    todo = list(kids.get(server_pid, ()))
    seen = set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        if states.get(p) == b"Z":
            zombies += 1
        else:
            live += 1
        todo.extend(kids.get(p, ()))
    try:
        fds = len(os.listdir(f"/proc/{server_pid}/fd"))
    except OSError:
        fds = -1
    rss = 0
    for line in _read(f"/proc/{server_pid}/status").decode("ascii", "replace").splitlines():
        if line.startswith("VmRSS:"):
            try:
                rss = int(line.split()[1])
            except (IndexError, ValueError):
                pass
    return {"host_fds": fds, "host_procs": live, "host_zombies": zombies,
            "server_zombies": len(own_z), "server_zombie_pids": own_z,
            "host_rss_kb": rss, "tool_procs": len(marked), "marked_pids": marked}


def _cmdline(pid: int) -> str:
    return _read(f"/proc/{pid}/cmdline").replace(b"\0", b" ").decode("utf-8", "replace").strip()


# ---------------------------------------------------------------- the run


class _KindStats:
    __slots__ = ("calls", "classes", "errors", "overloaded", "expired", "durations", "total_ms",
                 "max_ms")

    def __init__(self) -> None:
        self.calls = 0
        self.classes: Dict[str, int] = collections.Counter()
        self.errors = 0
        self.overloaded = 0
        self.expired = 0
        self.durations: List[float] = []     # reservoir of client-side durations (ms)
        self.total_ms = 0.0
        self.max_ms = 0.0

    def add_duration(self, ms: float, rng: random.Random) -> None:
        self.total_ms += ms
        self.max_ms = max(self.max_ms, ms)
        if len(self.durations) < 5000:
            self.durations.append(ms)
        else:
            j = rng.randrange(self.calls)
            if j < 5000:
                self.durations[j] = ms

    def to_json(self) -> Dict[str, Any]:
        d = sorted(self.durations)

        def pct(p: float) -> Optional[float]:
            if not d:
                return None
            return round(d[min(len(d) - 1, int(p / 100.0 * len(d)))], 1)
        return {"calls": self.calls, "classes": dict(sorted(self.classes.items())),
                "errors": self.errors, "overloaded": self.overloaded, "expired": self.expired,
                "ms": {"mean": round(self.total_ms / self.calls, 1) if self.calls else None,
                       "p50": pct(50), "p95": pct(95), "max": round(self.max_ms, 1)}}


class _SessionGone(Exception):
    """The worker's session expired or vanished: open a new one."""


class _ServerGone(Exception):
    """The connection to the server is gone."""


def less_standby(st: Dict[str, Any], key: str, standby_key: str) -> int:
    """A figure less what the server keeps ready on purpose (the spawner, zygotes and
    their spare shims: stats.standby processes, stats.standby_fds descriptors), which is
    not growth."""
    v = st.get(key) or 0
    standby = st.get(standby_key)
    return max(0, v - standby) if isinstance(standby, int) else v


def call_processes(st: Dict[str, Any]) -> int:
    return less_standby(st, "processes", "standby")


FIGURES = ("fds", "processes", "zombies", "rss_kb", "sessions", "running", "leftover_dirs",
           "host_fds", "host_procs", "host_zombies", "server_zombies", "server_zombies_seen",
           "host_rss_kb",
           "tool_procs", "stats_ms")


class Soak:
    def __init__(self, opts: argparse.Namespace, out=sys.stdout, err=sys.stderr):
        self.o = opts
        self.out = out
        self.err = err
        self.rng = random.Random(opts.seed)
        self.run_id = f"{self.rng.randrange(16 ** 6):06x}"
        self.mark = f"0{self.rng.randrange(10 ** 7):07d}"        # in every sleep argument
        self.marker = self.mark.encode()
        self.sid_prefix = f"soak-{self.run_id}-"
        self.lock = threading.Lock()
        self.kinds: Dict[str, _KindStats] = {k: _KindStats() for k in KINDS}
        self.classes: Dict[str, int] = collections.Counter()
        self.errors: List[Dict[str, Any]] = []
        self.error_count = 0
        self.calls_done = 0
        self.sessions_opened = 0
        self.sessions_closed = 0
        self.sessions_expired = 0
        self.churn_cycles = 0
        self.open: Dict[str, Session] = {}        # worker sessions the server holds open
        self.transit: set = set()                 # ids being opened or closed right now
        self.alarms: List[Dict[str, Any]] = []
        self.expired_notes = 0
        self.samples: List[Dict[str, Any]] = []
        self.stop = threading.Event()
        self.paused = threading.Event()
        self.idle_cv = threading.Condition()
        self.idle = 0
        self.server_died: Optional[str] = None
        self.hung: List[str] = []
        self.t0 = time.monotonic()
        self.phase = "start"
        self.marks: Dict[str, float] = {}
        self.workdir: Optional[str] = None
        self.state_dir: Optional[str] = None
        self.client: Optional[Client] = None
        self.policy_path: Optional[str] = None
        self.policy_written = False
        self.concurrency = 0
        self.mix = dict(KINDS)
        self.interrupted = False
        self.exit_status: Optional[int] = None
        self.last_stats: Optional[Dict[str, Any]] = None
        self.start_rec = self.baseline = self.end = self.final = None
        self.stuck_workers = 0
        self.dirs_checked = False
        self._following: set = set()
        self.stuck_zombies: List[str] = []
        self.lingering: List[Dict[str, Any]] = []
        self.stuck_zombie_count = 0

    # ------------------------------------------------------------------ helpers

    def now(self) -> float:
        return time.monotonic() - self.t0

    def note_error(self, kind: Optional[str], what: str) -> None:
        """An unexpected result of a call of ``kind``, or (kind None) a failed request of the
        driver's own (session.open/close, stats)."""
        with self.lock:
            self.error_count += 1
            if kind in self.kinds:
                self.kinds[kind].errors += 1
            if len(self.errors) < 50:
                self.errors.append({"t": round(self.now(), 2), "kind": kind or "-",
                                    "error": what[:300]})

    def log(self, msg: str) -> None:
        if self.o.progress != "none":
            self._clear_status()
            print(f"stockade soak: {msg}", file=self.err, flush=True)

    _status_shown = False

    def _clear_status(self) -> None:
        if self._status_shown:
            self.err.write("\r\x1b[K")
            self.err.flush()
            self._status_shown = False

    # ------------------------------------------------------------------ setup

    def setup(self) -> None:
        o = self.o
        base = os.environ.get("STOCKADE_SOAK_TMPDIR", "/var/tmp")
        if not os.path.isdir(base):
            base = tempfile.gettempdir()
        # Not below a 0700 directory: the tools' service uid must traverse the state dir.
        self.workdir = os.path.realpath(tempfile.mkdtemp(prefix="stockade-soak-", dir=base))
        os.chmod(self.workdir, 0o755)
        if o.state_dir:
            self.state_dir = os.path.realpath(o.state_dir)
            os.makedirs(self.state_dir, exist_ok=True)
        else:
            self.state_dir = os.path.join(self.workdir, "state")
            os.mkdir(self.state_dir)
            os.chmod(self.state_dir, 0o755)
        env = {k: v for k, v in os.environ.items() if k != "STOCKADE_DEPTH"}
        if o.policy:
            self.policy_path = os.path.realpath(o.policy)
            if not os.path.isfile(self.policy_path):
                raise SystemExit(self._usage(f"--policy {o.policy}: no such file"))
        else:
            self.concurrency = o.concurrency or self._cpu_default()
            # plugins.secrets is built into the binary: no plugin directory needed
            self.policy_path = os.path.join(self.workdir, "soak_workload.lua")
            with open(self.policy_path, "w", encoding="utf-8") as f:
                f.write(_policy_text(self.concurrency, o.isolation, True))
            self.policy_written = True
        self.log_path = os.path.join(self.workdir, "serve.log")
        self.serve_log = open(self.log_path, "wb")
        cmd = [o.stockade, "serve", "--policy", self.policy_path, "--state-dir", self.state_dir]
        cmd += list(o.serve_arg or [])
        self.serve_cmd = cmd
        try:
            self.client = Client.spawn(cmd, rpc_timeout=o.rpc_timeout, stderr=self.serve_log,
                                       env=env, start_new_session=True)
        except OSError as e:
            raise SystemExit(self._usage(f"cannot start {o.stockade}: {e}"))
        self.client.subscribe(self._on_note)
        try:
            self.hello = self.client.hello("stockade-soak", rpc_timeout=30)
        except (StockadeError, TimeoutError) as e:
            self.client.close(timeout=5)
            raise SystemExit(self._usage(f"`{' '.join(cmd)}` did not answer hello: {e}\n"
                                         f"{self._log_tail()}"))
        if not self.policy_written:
            mr = self.hello.limits.get("max_running")
            self.concurrency = o.concurrency or self._cpu_default(mr)
        for k, w in (o.mix or {}).items():
            self.mix[k] = w

    def _usage(self, msg: str) -> int:
        # the message carries the server log's tail already; an empty work dir is litter
        print(f"stockade soak: {msg}", file=self.err, flush=True)
        self.cleanup(keep=self.o.keep_state)
        return EXIT_USAGE

    @staticmethod
    def _cpu_default(max_running: Optional[int] = None) -> int:
        try:
            cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = os.cpu_count() or 1
        n = 2 * cpus
        if isinstance(max_running, int) and max_running > 0:
            n = min(n, 2 * max_running)
        return max(2, n)

    def _log_tail(self, n: int = 2000) -> str:
        try:
            self.serve_log.flush()
        except (OSError, ValueError):
            pass
        return _read(self.log_path)[-n:].decode("utf-8", "replace")

    def _on_note(self, method: str, params: Dict[str, Any]) -> None:
        if method == "alarm":
            rec = {"t": round(self.now(), 2)}
            rec.update({k: v for k, v in params.items() if isinstance(v, (str, int, float, bool))
                        or v is None})
            with self.lock:
                if len(self.alarms) < 1000:
                    self.alarms.append(rec)
        elif method == "session.expired":
            with self.lock:
                self.expired_notes += 1

    # ------------------------------------------------------------------ sessions

    def open_session(self, wid: int, seq: int, ignore_stop: bool = False) -> Optional[Session]:
        """Open this worker's next session (retrying OVERLOADED). None when the run stops
        first; with ignore_stop (a churn's reopen), give up only after ~30 s of refusals."""
        sid = f"{self.sid_prefix}w{wid:03d}-{seq:06d}"
        backoff = 0.05
        give_up = time.monotonic() + 30.0
        while (ignore_stop and time.monotonic() < give_up) or not self.stop.is_set():
            with self.lock:
                self.transit.add(sid)
            try:
                s = self.client.open_session(sid, rpc_timeout=30)
            except Overloaded:
                time.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
                continue
            except ConnectionClosed as e:
                raise _ServerGone(str(e)) from None
            except (StockadeError, TimeoutError) as e:
                self.note_error(None, f"session.open {sid}: {e}")
                time.sleep(0.5)
                continue
            finally:
                with self.lock:
                    self.transit.discard(sid)
            with self.lock:
                self.open[sid] = s
                self.sessions_opened += 1
            return s
        return None

    def close_session(self, s: Session, expected_gone: bool = False) -> None:
        sid = s.session_id
        with self.lock:
            self.transit.add(sid)
            self.open.pop(sid, None)
        try:
            s.close(rpc_timeout=60)
            with self.lock:
                self.sessions_closed += 1
        except NoSuchSession:
            if not expected_gone:
                with self.lock:
                    self.sessions_expired += 1
        except ConnectionClosed as e:
            raise _ServerGone(str(e)) from None
        except (StockadeError, TimeoutError) as e:
            self.note_error(None, f"session.close {sid}: {e}")
        finally:
            with self.lock:
                self.transit.discard(sid)

    # ------------------------------------------------------------------ one call of a kind

    def _call(self, s: Session, kind: str, tool: str, argv: Sequence[str], bound: float,
              **kw: Any):
        """Start a call and wait for it. Returns the CallResult, or None when it was refused
        for admission (OVERLOADED, counted). Raises _SessionGone / _ServerGone."""
        try:
            h = s.start_call(tool, list(argv), **kw)
        except ConnectionClosed as e:
            raise _ServerGone(str(e)) from None
        return self._wait(h, kind, bound)

    def _wait(self, h, kind: str, bound: float):
        try:
            return h.result(bound + RESPONSE_SLACK)
        except Overloaded:
            with self.lock:
                self.kinds[kind].overloaded += 1
            return None
        except (NoSuchSession, SessionExpired):
            with self.lock:
                self.kinds[kind].expired += 1
            raise _SessionGone() from None
        except ConnectionClosed as e:
            raise _ServerGone(str(e)) from None
        except TimeoutError:
            what = f"{kind}: no response to msgid {h.msgid} within {bound + RESPONSE_SLACK:.0f}s"
            with self.lock:
                self.hung.append(what)
            self.note_error(kind, what)
            try:
                h.cancel(timeout=10)
            except (StockadeError, TimeoutError):
                pass
            return None
        except StockadeError as e:
            self.note_error(kind, f"{kind}: RPC error {e}")
            return None

    def run_kind(self, kind: str, s: Session, rng: random.Random, n: int) -> None:
        mk = self.mark
        t = time.monotonic()
        check = None     # extra check of an OK result: returns an error string or None
        if kind == "normal":
            v = n % 3
            if v == 0:
                word = f"soak-{n}"
                r = self._call(s, kind, "echo", [word], 5, timeout_ms=5000)
                want = (word + "\n").encode()
            elif v == 1:
                r = self._call(s, kind, "true", [], 5, timeout_ms=5000)
                want = b""
            else:
                want = f"stdin of call {n} {mk}\n".encode() * (1 + n % 7)
                r = self._call(s, kind, "cat", [], 10, stdin=want, timeout_ms=10000)

            def check(r, want=want):
                return None if r.stdout == want else \
                    f"stdout {r.stdout[:60]!r} (len {len(r.stdout)}) != expected {want[:60]!r}"
        elif kind == "flood":
            r = self._call(s, kind, "sh", ["-c", "yes | head -c %d" % FLOOD_BYTES], 10,
                           timeout_ms=10000)

            def check(r):
                got = len(r.stdout) + int(r.truncated.get("stdout") or 0)
                return None if got == FLOOD_BYTES else \
                    f"flood: {len(r.stdout)} bytes + {r.truncated} truncated != {FLOOD_BYTES}"
        elif kind == "timeout":
            r = self._call(s, kind, "sleep", [f"30.{mk}"], 3, timeout_ms=200)
        elif kind == "term_ignore":
            r = self._call(s, kind, "sh", ["-c", f'trap "" TERM; sleep 30.{mk}'], 15,
                           timeout_ms=200)
        elif kind == "daemonizer":
            r = self._call(s, kind, "sh", ["-c", f"setsid sleep 300.{mk} & echo $!"], 5,
                           timeout_ms=5000)
        elif kind == "fork_bomb":
            r = self._call(s, kind, "sh", ["-c", f"f(){{ f|f& }}; f; sleep 5.{mk}"], 15,
                           timeout_ms=2000)
        elif kind == "fd_leaker":
            r = self._call(s, kind, "sh", ["-c", f"(sleep 60.{mk} 3>/dev/null 4>/dev/null &) ; "
                                                 "exec 5>/dev/null; echo ok"], 5, timeout_ms=5000)

            def check(r):
                return None if r.stdout == b"ok\n" else f"fd_leaker: stdout {r.stdout[:60]!r}"
        elif kind == "refusal":
            r = self._call(s, kind, UNKNOWN_TOOL, ["x"], 5)
        elif kind == "cancel":
            try:
                h = s.start_call("sleep", [f"30.{mk}"], timeout_ms=10000)
            except ConnectionClosed as e:
                raise _ServerGone(str(e)) from None
            time.sleep(rng.uniform(0.05, 0.2))
            cancelled = None
            try:
                cancelled = h.cancel(timeout=30)
            except ConnectionClosed as e:
                raise _ServerGone(str(e)) from None
            except (StockadeError, TimeoutError) as e:
                if not h.done():
                    self.note_error(kind, f"cancel: {e}")
            r = self._wait(h, kind, 15)

            def check(r, cancelled=cancelled):
                return None   # the class says it all (CANCELLED); `cancelled` may race
        elif kind == "deadline":
            r = self._call(s, kind, "sleep", [f"5.{mk}"], 5, deadline_ms=150)
        else:
            raise ValueError(kind)
        ms = (time.monotonic() - t) * 1000.0
        if r is None:
            return
        if r.class_ == "SESSION_EXPIRED":
            with self.lock:
                self.kinds[kind].expired += 1
            raise _SessionGone()
        with self.lock:
            ks = self.kinds[kind]
            ks.calls += 1
            ks.classes[r.class_] += 1
            ks.add_duration(ms, rng)
            self.classes[r.class_] += 1
            self.calls_done += 1
        if r.class_ not in EXPECTED[kind]:
            self.note_error(kind, f"{kind}: class {r.class_} (expected "
                                  f"{'/'.join(EXPECTED[kind])}): {r.message}")
        elif r.class_ == "OK" and check is not None:
            bad = check(r)
            if bad:
                self.note_error(kind, bad)

    # ------------------------------------------------------------------ workers

    def _pick(self, rng: random.Random) -> str:
        kinds = [k for k in KINDS if self.mix.get(k, 0) > 0]
        weights = [self.mix[k] for k in kinds]
        return rng.choices(kinds, weights)[0]

    def _wait_if_paused(self) -> None:
        if not self.paused.is_set():
            return
        with self.idle_cv:
            self.idle += 1
            self.idle_cv.notify_all()
            while self.paused.is_set() and not self.stop.is_set():
                self.idle_cv.wait(0.2)
            self.idle -= 1

    def worker(self, wid: int) -> None:
        rng = random.Random(self.o.seed * 7919 + wid if self.o.seed is not None else None)
        active = [k for k in KINDS if self.mix.get(k, 0) > 0]
        # every kind once, then by weight. Every worker starts with a flood, so the warm-up
        # takes the server's heap to its working size (concurrent 1 MiB output buffers)
        # before the baseline; the other kinds follow in a per-worker rotation.
        rest = [k for k in active if k != "flood"]
        shift = wid % len(rest) if rest else 0
        first = (["flood"] if "flood" in active else []) + rest[shift:] + rest[:shift]
        churn = self.o.churn_every > 0 and wid % 2 == 0
        seq = 0
        s: Optional[Session] = None
        in_session = 0
        n = 0
        try:
            while not self.stop.is_set():
                # a worker holds exactly one open session whenever it is idle (the pause
                # for the baseline, the end), so the two quiescent samples compare
                if s is None:
                    seq += 1
                    s = self.open_session(wid, seq)
                    in_session = 0
                    if s is None:
                        break
                self._wait_if_paused()
                if self.stop.is_set():
                    break
                kind = first.pop(0) if first else self._pick(rng)
                n += 1
                try:
                    self.run_kind(kind, s, rng, n)
                except _SessionGone:
                    with self.lock:
                        self.open.pop(s.session_id, None)
                        self.sessions_expired += 1
                    s = None
                    continue
                in_session += 1
                if churn and in_session >= self.o.churn_every:
                    self.close_session(s)
                    with self.lock:
                        self.churn_cycles += 1
                    seq += 1
                    s = self.open_session(wid, seq, ignore_stop=True)
                    in_session = 0
        except _ServerGone as e:
            if self.server_died is None:
                self.server_died = f"connection to the server lost: {e}"
            self.stop.set()
        except Exception as e:   # a bug of ours must not hang the run
            self.note_error(None, f"worker {wid} crashed: {type(e).__name__}: {e}")

    # ------------------------------------------------------------------ sampling

    def sample(self) -> Optional[Dict[str, Any]]:
        t = self.now()
        rec: Dict[str, Any] = {"t": round(t, 3), "phase": self.phase}
        if self.client.closed or self.client.proc.poll() is not None:
            self._server_gone("the server exited during the run "
                              f"(status {self.client.proc.poll()})")
            return None
        t1 = time.monotonic()
        try:
            st = self.client.stats(rpc_timeout=self.o.rpc_timeout)
        except ConnectionClosed as e:
            self._server_gone(f"stats: connection lost: {e}")
            return None
        except (StockadeError, TimeoutError) as e:
            self.note_error(None, f"stats failed: {e}")
            return None
        rec["stats_ms"] = round((time.monotonic() - t1) * 1000.0, 1)
        self.last_stats = st
        for k in ("fds", "processes", "zombies", "rss_kb", "sessions", "running"):
            v = st.get(k)
            rec[k] = v if isinstance(v, int) and not isinstance(v, bool) else None
        if rec["processes"] is not None:
            rec["processes"] = call_processes(st)
        if rec["fds"] is not None:
            rec["fds"] = less_standby(st, "fds", "standby_fds")
        for a in st.get("alarms") or []:
            if isinstance(a, dict):
                rec.setdefault("alarms_active", 0)
                rec["alarms_active"] += 1
        hv = host_view(self.client.proc.pid, self.marker)
        hv.pop("marked_pids")
        zpids = set(hv.pop("server_zombie_pids"))
        rec.update(hv)
        rec["server_zombies_seen"] = len(zpids)
        if zpids:
            # a call that is finishing leaves its shim a zombie for a moment; what counts is
            # a child still unreaped a while later
            time.sleep(LINGER)
            zpids = {p for p in zpids if _stat(p) == (b"Z", self.client.proc.pid)}
            rec["server_zombies"] = len(zpids)
            with self.lock:
                new = zpids - self._following
                self._following |= new
            for pid in new:
                threading.Thread(target=self._follow_zombie, args=(pid, t), daemon=True).start()
        rec["leftover_dirs"] = len(self.leftover_dirs())
        with self.lock:
            rec["calls"] = self.calls_done
            self.samples.append(rec)
        return rec

    def _follow_zombie(self, pid: int, t: float) -> None:
        """How long a lingering child of the supervisor stays unreaped (a zombie keeps its
        pid until reaped, so a continuous Z state is one zombie). STUCK_MS or more: it
        outlived its call."""
        server = self.client.proc.pid
        comm = _read(f"/proc/{pid}/comm").decode("utf-8", "replace").strip()
        start = time.monotonic() - LINGER
        while _stat(pid) == (b"Z", server) and time.monotonic() - start < 30.0:
            time.sleep(0.02)
        ms = round((time.monotonic() - start) * 1000.0)
        with self.lock:
            self._following.discard(pid)
            if len(self.lingering) < 100:
                self.lingering.append({"t": round(t, 2), "pid": pid, "comm": comm,
                                       "unreaped_ms_at_least": ms})
            if ms >= STUCK_MS:
                self.stuck_zombie_count += 1
                if len(self.stuck_zombies) < 50:
                    self.stuck_zombies.append(f"pid {pid} ({comm}) unreaped for {ms} ms "
                                              f"from {t:.1f}s")

    def leftover_dirs(self) -> List[str]:
        d = os.path.join(self.state_dir, "sessions")
        try:
            names = os.listdir(d)
        except OSError:
            return []
        with self.lock:
            keep = set(self.open) | set(self.transit)
        return sorted(n for n in names if n.startswith(self.sid_prefix) and n not in keep)

    def _server_gone(self, why: str) -> None:
        if self.server_died is None:
            self.server_died = why
        self.stop.set()

    def sampler(self) -> None:
        interval = self.o.sample_interval
        next_t = time.monotonic()
        last_plain = -1e9
        last_calls, last_t = 0, self.now()
        while not self.stop.is_set():
            next_t += interval
            if not self.paused.is_set():
                rec = self.sample()
                if rec is not None:
                    now = self.now()
                    rate = (rec["calls"] - last_calls) / max(1e-6, now - last_t)
                    last_calls, last_t = rec["calls"], now
                    rec["calls_per_s"] = round(rate, 1)
                    if self.o.progress == "tty":
                        self._status(rec)
                    elif self.o.progress == "plain" and now - last_plain >= 10.0:
                        last_plain = now
                        self._clear_status()
                        print("stockade soak: " + self._status_text(rec), file=self.err,
                              flush=True)
            delay = next_t - time.monotonic()
            if delay > 0:
                self.stop.wait(delay)
            else:
                next_t = time.monotonic()

    def _status_text(self, rec: Dict[str, Any]) -> str:
        with self.lock:
            cls = dict(self.classes)
            errs = self.error_count
        short = {"OK": "ok", "TOOL_ERROR": "err", "TOOL_TIMEOUT": "tmo", "DEADLINE_EXCEEDED": "dl",
                 "POLICY_VIOLATION": "pv", "RESOURCE_LIMIT": "rl", "CANCELLED": "cx",
                 "SESSION_EXPIRED": "exp", "INTERNAL": "INTERNAL"}
        parts = [f"{short.get(k, k)} {v}" for k, v in sorted(cls.items(), key=lambda kv: -kv[1])
                 if v]
        rss = rec.get("rss_kb")
        return (f"{_clock(rec['t'])}/{_clock(self.o.duration)} {rec.get('calls_per_s', 0):6.1f} calls/s "
                f"[{', '.join(parts)}] errors {errs} | fds {rec.get('fds')} "
                f"procs {rec.get('processes')} zombies {rec.get('zombies')} "
                f"rss {rss / 1024 if isinstance(rss, int) else 0:.1f}MiB "
                f"sess {rec.get('sessions')} {self.phase}")

    def _status(self, rec: Dict[str, Any]) -> None:
        width = shutil.get_terminal_size((120, 24)).columns
        text = self._status_text(rec)
        if len(text) > width - 1:
            text = text[:width - 2] + "…"
        self.err.write("\r\x1b[K" + text)
        self.err.flush()
        self._status_shown = True

    # ------------------------------------------------------------------ phases

    def _quiesce(self, workers: List[threading.Thread], timeout: float) -> bool:
        """Pause the workers (each finishes its call) and wait until all are idle."""
        self.paused.set()
        end = time.monotonic() + timeout
        alive = lambda: sum(1 for w in workers if w.is_alive())   # noqa: E731
        with self.idle_cv:
            while self.idle < alive() and not self.stop.is_set():
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self.idle_cv.wait(min(left, 0.2))
        return True

    def _settle(self, base_procs: int, timeout: float) -> Optional[Dict[str, Any]]:
        """Wait until the server has no running call, no zombie and no more processes than
        base_procs; returns its last stats (None if the server is gone)."""
        end = time.monotonic() + timeout
        st = None
        while True:
            try:
                st = self.client.stats(rpc_timeout=self.o.rpc_timeout)
            except ConnectionClosed as e:
                self._server_gone(f"stats: connection lost: {e}")
                return None
            except (StockadeError, TimeoutError):
                st = None
            if st and st.get("running") == 0 and st.get("zombies") == 0 \
                    and call_processes(st) <= base_procs:
                return st
            if time.monotonic() > end:
                return st
            time.sleep(0.1)

    def run(self) -> int:
        o = self.o
        self.setup()
        self.t0 = time.monotonic()
        warmup = o.warmup if o.warmup is not None else max(2.0, 0.1 * o.duration)
        warmup = min(warmup, o.duration)
        self.warmup = warmup
        self.log(f"{' '.join(self.serve_cmd)}")
        self.log(f"policy {self.hello.policy.get('name')} "
                 f"({'written: ' + self.policy_path if self.policy_written else self.policy_path}), "
                 f"isolation {self.hello.isolation.get('level')}, concurrency {self.concurrency}, "
                 f"duration {fmt_duration(o.duration)}, warm-up {fmt_duration(warmup)}")
        start = self.sample()
        self.start_rec = start
        self.phase = "warmup"
        workers = [threading.Thread(target=self.worker, args=(i,), name=f"soak-w{i}", daemon=True)
                   for i in range(self.concurrency)]
        samp = threading.Thread(target=self.sampler, name="soak-sampler", daemon=True)
        for w in workers:
            w.start()
        samp.start()

        def interruptible_wait(until: float) -> None:
            while not self.stop.is_set():
                left = until - self.now()
                if left <= 0:
                    return
                try:
                    self.stop.wait(min(left, 0.5))
                except KeyboardInterrupt:
                    self.interrupted = True
                    self.log("interrupted: draining and reporting (interrupt again to abort)")
                    self.stop.set()
                    return

        # warm-up, then a quiescent baseline
        interruptible_wait(warmup)
        self.baseline = None
        if not self.stop.is_set():
            self.phase = "pause"
            self.marks["pause"] = self.now()
            ok = self._quiesce(workers, timeout=90.0)
            if ok and not self.stop.is_set():
                self._settle(start.get("processes") or 0 if start else 0, timeout=15.0)
                self.baseline = self.sample()
            elif not ok:
                self.note_error(None, "warm-up pause: workers did not go idle within 90s")
            self.marks["baseline"] = self.now()
            self.phase = "run"
            with self.idle_cv:
                self.paused.clear()
                self.idle_cv.notify_all()
        pause_len = self.marks.get("baseline", 0) - self.marks.get("pause", 0)
        interruptible_wait(o.duration + pause_len)
        # the end: stop starting calls, drain, settle, sample
        self.phase = "drain"
        self.marks["drain"] = self.now()
        self.stop.set()
        with self.idle_cv:
            self.paused.clear()
            self.idle_cv.notify_all()
        drain_end = time.monotonic() + 120.0
        for w in workers:
            w.join(max(0.1, drain_end - time.monotonic()))
        self.stuck_workers = sum(1 for w in workers if w.is_alive())
        samp.join(10)
        self._clear_status()
        self.end = self.final = None
        self.leftover_at_end: List[str] = []
        self.marked_left: List[str] = []
        if self.server_died is None:
            base_procs = (self.baseline or start or {}).get("processes") or 0
            self._settle(base_procs, timeout=30.0)
            self.end = self.sample()
            # close every session, then look for dirs left behind (server still up)
            self.phase = "close"
            with self.lock:
                sessions = list(self.open.values())
            for s in sessions:
                try:
                    self.close_session(s)
                except _ServerGone as e:
                    self._server_gone(str(e))
                    break
            if self.server_died is None:
                self.leftover_at_end = self.leftover_dirs()
                self.dirs_checked = True
                self._settle((start or {}).get("processes") or 0, timeout=15.0)
                self.phase = "final"
                self.final = self.sample()
        # marked tool processes still alive after the drain: they outlived their call
        end_wait = time.monotonic() + 5.0
        while True:
            pids = host_view(self.client.proc.pid, self.marker)["marked_pids"]
            if not pids or time.monotonic() > end_wait:
                break
            time.sleep(0.1)
        for p in pids:
            self.marked_left.append(f"{p}: {_cmdline(p)[:200]}")
            try:
                os.kill(p, signal.SIGKILL)     # ours (this run's marker), by pid
            except OSError:
                pass
        # stop the server: EOF on its stdin, then its exit status
        self.exit_status = None
        self.died_before_close = self.client.proc.poll()
        if self.died_before_close is not None and self.server_died is None:
            self.server_died = f"the server exited with status {self.died_before_close}"
        try:
            self.exit_status = self.client.close(timeout=o.stop_timeout)
        except Exception as e:   # noqa: BLE001
            self.note_error(None, f"closing the server: {e}")
        self.killed_on_close = False
        if self.exit_status is None or self.client.proc.returncode is None:
            self.killed_on_close = True
        self.after_exit_dirs = [n for n in self._list_sessions() if n.startswith(self.sid_prefix)]
        self.elapsed = self.now()
        self.serve_log.close()
        return self.finish()

    def _list_sessions(self) -> List[str]:
        try:
            return sorted(os.listdir(os.path.join(self.state_dir, "sessions")))
        except OSError:
            return []

    # ------------------------------------------------------------------ verdict and report

    def figures(self) -> Dict[str, Dict[str, Any]]:
        out: Dict[str, Dict[str, Any]] = {}
        for f in FIGURES:
            vals = [s.get(f) for s in self.samples if isinstance(s.get(f), (int, float))]
            out[f] = {
                "start": (self.start_rec or {}).get(f),
                "baseline": (self.baseline or {}).get(f),
                "peak": max(vals) if vals else None,
                "end": (self.end or {}).get(f),
                "final": (self.final or {}).get(f),
            }
        return out

    def rss_reference(self) -> Optional[Dict[str, Any]]:
        """What the end's RSS is compared with: the highest RSS sampled during the warm-up
        and the first half of the run after it (the quiescent baseline if higher). A
        server's quiescent RSS depends on how much of its heap the allocator kept after
        the last 1 MiB output buffers (floods) — anywhere up to its working set — so one
        quiescent sample against another is noise; a leak grows past the high-water."""
        if self.baseline is None:
            return None
        t_base = self.marks.get("baseline", 0.0)
        t_mid = t_base + (self.marks.get("drain", t_base) - t_base) / 2.0
        vals = [s["rss_kb"] for s in self.samples
                if isinstance(s.get("rss_kb"), int) and s["phase"] in ("warmup", "pause", "run")
                and s["t"] <= t_mid]
        ref = max(vals + [self.baseline.get("rss_kb") or 0])
        return {"kb": ref, "until_s": round(t_mid, 2), "baseline_kb": self.baseline.get("rss_kb")}

    def finish(self) -> int:
        o = self.o
        end = time.monotonic() + 2.0
        while self._following and time.monotonic() < end:     # zombies still followed
            time.sleep(0.05)
        figs = self.figures()
        zs = [s for s in self.samples if isinstance(s.get("server_zombies"), int)]
        zst = [s for s in self.samples if isinstance(s.get("zombies"), int)]
        facts = {
            "server_died": self.server_died,
            "exit_status": self.exit_status,
            "killed_on_close": self.killed_on_close,
            "figures": figs,
            "zombie_samples": sum(1 for s in zs if s["server_zombies"] > 0),
            "samples": len(zs),
            "stuck_zombies": self.stuck_zombies,
            "stats_zombie_samples": sum(1 for s in zst if s["zombies"] > 0),
            "stats_samples": len(zst),
            "leftover_dirs": self.leftover_at_end,
            "dirs_checked": self.dirs_checked,
            "marked_left": self.marked_left,
            "stuck_workers": self.stuck_workers,
            "hung_calls": len(self.hung),
            "errors": self.error_count,
            "kinds": {k: v.calls for k, v in self.kinds.items()},
            "mix": {k: self.mix.get(k, 0) for k in KINDS},
            "churn": self.churn_cycles if o.churn_every > 0 and self.concurrency > 0 else None,
            "baseline_taken": self.baseline is not None,
            "rss_reference": self.rss_reference(),
        }
        thresholds = {
            "max_fd_growth": o.max_fd_growth,
            "max_rss_growth_pct": o.max_rss_growth,
            "rss_growth_floor_mib": o.rss_growth_floor,
            "max_zombie_samples_pct": o.max_zombie_samples,
            "max_errors": o.max_errors,
            "zombies_end": 0,
            "leftover_session_dirs": 0,
            "server_exit_status": 0,
        }
        checks = evaluate(facts, thresholds)
        failures = [c["detail"] for c in checks if not c["ok"]]
        passed = not failures
        report = self.report(facts, thresholds, checks, failures, passed)
        svg_path = None
        if o.report:
            svg_path = _svg_path(o.report)
            report["chart"] = svg_path
            try:
                d = os.path.dirname(os.path.abspath(o.report))
                os.makedirs(d, exist_ok=True)
                with open(svg_path, "w", encoding="utf-8") as f:
                    f.write(render_svg(self.samples, title=self._title(passed),
                                       marks=self.marks, alarms=self.alarms))
                with open(o.report, "w", encoding="utf-8") as f:
                    json.dump(report, f, indent=1, sort_keys=False)
                    f.write("\n")
            except OSError as e:
                print(f"stockade soak: cannot write the report: {e}", file=self.err)
                passed = False
        self.print_summary(report, checks, svg_path)
        keep = (not passed) or o.keep_state
        if keep:
            print(f"kept: {self.workdir} (serve.log, policy, state)", file=self.out)
        self.cleanup(keep=keep)
        return 0 if passed else 1

    def _title(self, passed: bool) -> str:
        return (f"stockade soak {'PASS' if passed else 'FAIL'}: {self.hello.policy.get('name')}, "
                f"concurrency {self.concurrency}, {fmt_duration(self.elapsed)}, "
                f"{self.calls_done} calls")

    def report(self, facts, thresholds, checks, failures, passed) -> Dict[str, Any]:
        with self.lock:
            kinds = {k: v.to_json() for k, v in self.kinds.items()}
            classes = dict(sorted(self.classes.items()))
            errors = list(self.errors)
        kinds["session_churn"] = {"calls": self.churn_cycles,
                                  "every": self.o.churn_every}
        total_overloaded = sum(v["overloaded"] for k, v in kinds.items() if "overloaded" in v)
        series: Dict[str, List[Any]] = {"t": [s["t"] for s in self.samples]}
        for f in FIGURES + ("calls", "phase"):
            series[f] = [s.get(f) for s in self.samples]
        run_s = max(1e-6, self.elapsed)
        last = self.last_stats or {}
        return {
            "tool": "stockade soak",
            "verdict": "pass" if passed else "fail",
            "passed": passed,
            "failures": failures,
            "interrupted": self.interrupted,
            "checks": checks,
            "thresholds": thresholds,
            "config": {
                "stockade": self.o.stockade, "serve_cmd": self.serve_cmd,
                "policy": self.policy_path, "policy_written": self.policy_written,
                "state_dir": self.state_dir, "duration_s": self.o.duration,
                "warmup_s": self.warmup, "concurrency": self.concurrency,
                "sample_interval_s": self.o.sample_interval, "churn_every": self.o.churn_every,
                "mix": {k: self.mix.get(k, 0) for k in KINDS}, "seed": self.o.seed,
                "run_id": self.run_id, "marker": self.mark,
            },
            "server": {
                "pid": self.client.proc.pid, "version": self.hello.version,
                "policy": self.hello.policy, "isolation": self.hello.isolation,
                "limits": self.hello.limits, "exit_status": self.exit_status,
                "died": self.server_died, "log": self.log_path,
            },
            "elapsed_s": round(self.elapsed, 2),
            "marks_s": {k: round(v, 2) for k, v in self.marks.items()},
            "figures": facts["figures"],
            "calls": {"total": self.calls_done, "per_s": round(self.calls_done / run_s, 1),
                      "errors": self.error_count, "overloaded": total_overloaded,
                      "hung": self.hung[:20]},
            "classes": classes,
            "kinds": kinds,
            "sessions": {"opened": self.sessions_opened, "closed": self.sessions_closed,
                         "expired_or_lost": self.sessions_expired,
                         "expired_notifications": self.expired_notes,
                         "churn_cycles": self.churn_cycles,
                         "leftover_dirs_at_end": self.leftover_at_end,
                         "dirs_after_exit": self.after_exit_dirs},
            "zombie_samples": {
                "supervisor": {"with_zombies": facts["zombie_samples"],
                               "samples": facts["samples"]},
                "stats": {"with_zombies": facts["stats_zombie_samples"],
                          "samples": facts["stats_samples"]},
                "stuck": self.stuck_zombies,
                "lingering": self.lingering,
                "note": "stats.zombies counts the server's whole tree, zombies inside calls "
                        "still running included (a fork bomb's unreaped children); the "
                        "sample rule applies to the supervisor's own unreaped children"},
            "marked_processes_left": self.marked_left,
            "errors": {"count": self.error_count, "examples": errors},
            "alarms": list(self.alarms),
            "server_stats_final": {k: last.get(k) for k in ("calls", "latency_ms", "redactions",
                                                             "alarms", "policy_generation")
                                   if k in last},
            "series": series,
        }

    def print_summary(self, report, checks, svg_path) -> None:
        p = lambda *a: print(*a, file=self.out)   # noqa: E731
        figs = report["figures"]
        p(f"stockade soak: {'PASS' if report['passed'] else 'FAIL'} — "
          f"{fmt_duration(report['elapsed_s'])}, concurrency {self.concurrency}, policy "
          f"{self.hello.policy.get('name')}{' (written)' if self.policy_written else ''}, "
          f"isolation {self.hello.isolation.get('level')}"
          f"{', interrupted' if self.interrupted else ''}")
        c = report["calls"]
        p(f"calls: {c['total']} ({c['per_s']}/s), errors {c['errors']}, overloaded "
          f"{c['overloaded']}; sessions opened {report['sessions']['opened']}, closed "
          f"{report['sessions']['closed']}, churned {report['sessions']['churn_cycles']}")
        p("kinds: " + ", ".join(f"{k} {v['calls']}" for k, v in report["kinds"].items()))
        p("classes: " + ", ".join(f"{k} {v}" for k, v in report["classes"].items() if v))
        p(f"{'figure':<14}{'start':>9}{'baseline':>10}{'peak':>9}{'end':>9}{'final':>9}")
        for f, label, scale in (("fds", "fds", 1), ("processes", "processes", 1),
                                ("zombies", "zombies", 1), ("rss_kb", "rss MiB", 1024),
                                ("sessions", "sessions", 1), ("leftover_dirs", "leftover dirs", 1),
                                ("host_fds", "host fds", 1), ("tool_procs", "tool procs", 1),
                                ("stats_ms", "stats ms", 1)):
            row = figs.get(f, {})

            def fmt(v):
                if v is None:
                    return "-"
                return f"{v / scale:.1f}" if scale != 1 or isinstance(v, float) else str(v)
            p(f"{label:<14}" + "".join(f"{fmt(row.get(k)):>{w}}" for k, w in
                                       (("start", 9), ("baseline", 10), ("peak", 9), ("end", 9),
                                        ("final", 9))))
        p("checks:")
        for ch in checks:
            p(f"  {'ok  ' if ch['ok'] else 'FAIL'} {ch['detail']}")
        if report["alarms"]:
            kinds = collections.Counter(a.get("kind") for a in report["alarms"])
            p("alarms: " + ", ".join(f"{k} {n}" for k, n in kinds.items()))
        else:
            p("alarms: none")
        for e in report["errors"]["examples"][:5]:
            p(f"  error at {e['t']}s: {e['error']}")
        if self.o.report:
            p(f"report: {self.o.report}  chart: {svg_path}")
        if not report["passed"] and self.server_died:
            tail = self._tail_file(self.log_path)
            if tail:
                p("server log (tail):\n" + tail)

    @staticmethod
    def _tail_file(path: str, n: int = 1500) -> str:
        return _read(path)[-n:].decode("utf-8", "replace")

    def cleanup(self, keep: bool) -> None:
        if keep or not self.workdir:
            return
        if self.client is not None and self.client.proc.poll() is None:
            return      # never remove a live server's state
        shutil.rmtree(self.workdir, ignore_errors=True)


# ---------------------------------------------------------------- the verdict (pure)


def evaluate(facts: Dict[str, Any], th: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The checks of a run, from its facts (see Soak.finish) and thresholds. Pure: the
    tests feed it fabricated runs. Each check: {name, ok, value, threshold, detail}."""
    checks: List[Dict[str, Any]] = []

    def add(name, ok, value, threshold, detail):
        checks.append({"name": name, "ok": bool(ok), "value": value, "threshold": threshold,
                       "detail": detail})

    figs = facts.get("figures") or {}
    died = facts.get("server_died")
    add("server_alive", not died, died, None,
        f"the server died: {died}" if died else "the server stayed up for the whole run")
    st = facts.get("exit_status")
    if facts.get("killed_on_close"):
        add("server_exit", False, st, 0,
            f"the server did not exit after its stdin was closed (killed; status {st})")
    else:
        add("server_exit", st == 0, st, 0,
            f"server exit status after EOF on stdin: {st} (must be 0)")

    def at_end(fig):
        d = figs.get(fig, {})
        return d.get("final") if d.get("final") is not None else d.get("end")
    z_end, hz_end = at_end("zombies"), at_end("host_zombies")
    add("zombies_end", z_end == 0 and not hz_end, z_end, 0,
        f"zombies after the drain: {z_end} (host view: {hz_end}; must be 0)")
    n, k = facts.get("samples") or 0, facts.get("zombie_samples") or 0
    pct = 100.0 * k / n if n else 0.0
    lim = th["max_zombie_samples_pct"]
    add("zombie_samples", n > 0 and pct <= lim, round(pct, 2), lim,
        f"samples with an unreaped child of the supervisor: {k}/{n} = {pct:.1f}% "
        f"(max {lim}%)" if n else "no sample of the server's figures was taken")
    stuck = facts.get("stuck_zombies") or []
    add("zombie_stuck", not stuck, len(stuck), 0,
        "no child of the supervisor stayed a zombie for a second or more" if not stuck
        else f"children of the supervisor left unreaped for a second or more: {len(stuck)} "
             f"({'; '.join(stuck[:3])})")

    f = figs.get("fds", {})
    if f.get("baseline") is None or f.get("end") is None:
        add("fd_growth", False, None, th["max_fd_growth"],
            "fd growth: no baseline or end sample (run too short or the server died)")
    else:
        g = f["end"] - f["baseline"]
        add("fd_growth", g <= th["max_fd_growth"], g, th["max_fd_growth"],
            f"fd growth: {f['baseline']} -> {f['end']} = {g:+d} (max {th['max_fd_growth']:+d})")

    r = figs.get("rss_kb", {})
    ref = (facts.get("rss_reference") or {}).get("kb") or r.get("baseline")
    if not ref or r.get("end") is None:
        add("rss_growth", False, None, th["max_rss_growth_pct"],
            "RSS growth: no baseline or end sample (run too short or the server died)")
    else:
        gk = r["end"] - ref
        gp = 100.0 * gk / ref
        floor_kb = th["rss_growth_floor_mib"] * 1024
        bad = gp > th["max_rss_growth_pct"] and gk >= floor_kb
        add("rss_growth", not bad, round(gp, 2), th["max_rss_growth_pct"],
            f"RSS growth: {ref / 1024:.1f} (warm-up high-water) -> {r['end'] / 1024:.1f} MiB "
            f"= {gp:+.1f}% ({gk:+d} KiB; max {th['max_rss_growth_pct']}% when >= "
            f"{th['rss_growth_floor_mib']} MiB)")

    left = facts.get("leftover_dirs") or []
    if not facts.get("dirs_checked", True):
        add("session_dirs", False, None, 0,
            "session dirs: not checked (the server was gone before every session was closed)")
    else:
        add("session_dirs", not left, len(left), 0,
            f"session dirs left after closing every session: {len(left)}"
            + (f" ({', '.join(left[:5])})" if left else ""))

    p = figs.get("processes", {})
    p_fin, p_start = p.get("final"), p.get("start")
    if p_fin is None:
        add("processes_end", False, None, p_start, "processes after the drain: no final sample")
    else:
        add("processes_end", p_fin <= (p_start or 0), p_fin, p_start or 0,
            f"processes in the server's tree after closing every session: {p_fin} "
            f"(at start {p_start or 0})")
    marked = facts.get("marked_left") or []
    add("tool_processes", not marked, len(marked), 0,
        f"tool processes alive after the drain: {len(marked)}"
        + (f" ({'; '.join(marked[:3])})" if marked else ""))

    mix = facts.get("mix") or {}
    kinds = facts.get("kinds") or {}
    missing = [k for k, w in mix.items() if w > 0 and not kinds.get(k)]
    if facts.get("churn") is not None and facts["churn"] == 0:
        missing.append("session_churn")
    add("mix", not missing, missing, None,
        "every kind of the mix ran" if not missing else
        f"kinds of the mix that never completed: {', '.join(missing)}")
    stuck, hung = facts.get("stuck_workers") or 0, facts.get("hung_calls") or 0
    add("drain", not stuck and not hung, stuck + hung, 0,
        "every call was answered" if not stuck and not hung else
        f"calls not answered: {hung} hung, {stuck} workers still waiting after the drain")
    e = facts.get("errors") or 0
    add("errors", e <= th["max_errors"], e, th["max_errors"],
        f"unexpected results / errors: {e} (max {th['max_errors']})")
    if not facts.get("baseline_taken", True):
        add("baseline", False, None, None, "no quiescent baseline could be sampled")
    return checks


# ---------------------------------------------------------------- the chart (hand-written SVG)

_SERIES = (("fds", "fds", 1.0, "#1f77b4"), ("processes", "processes", 1.0, "#2ca02c"),
           ("zombies", "zombies", 1.0, "#d62728"), ("rss_kb", "RSS MiB", 1024.0, "#9467bd"),
           ("sessions", "sessions", 1.0, "#ff7f0e"))


def _esc(s: Any) -> str:
    return (str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
            .replace('"', "&quot;"))


def _nice_max(v: float) -> float:
    if v <= 0:
        return 1.0
    e = 10 ** math.floor(math.log10(v))
    for m in (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10):
        if m * e >= v:
            return m * e
    return 10 * e


def _fmt_num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:.1f}"


def _svg_path(report: str) -> str:
    return report[:-5] + ".svg" if report.endswith(".json") else report + ".svg"


_ALARM_COLORS = {"raised": "#d62728", "cleared": "#2ca02c"}


def render_svg(samples: Sequence[Dict[str, Any]], title: str = "stockade soak",
               marks: Optional[Dict[str, float]] = None,
               alarms: Optional[Sequence[Dict[str, Any]]] = None) -> str:
    """A stacked chart (one panel per figure, a shared time axis) of the sampled series.
    Alarm notifications (`alarms`: {t, kind, state}) are marked on the panel of their
    kind (on every panel for a kind without one): a red triangle pointing up where one
    was raised, a green one pointing down where it cleared."""
    W, left, right, top, ph, gap, bottom = 960, 70, 20, 64, 96, 20, 44
    H = top + len(_SERIES) * (ph + gap) - gap + bottom
    pw = W - left - right
    ts = [s["t"] for s in samples if isinstance(s.get("t"), (int, float))]
    events = [a for a in (alarms or []) if isinstance(a.get("t"), (int, float))
              and a.get("state") in _ALARM_COLORS]
    ts += [a["t"] for a in events]
    tmax = max(ts) if ts else 1.0
    tmax = tmax if tmax > 0 else 1.0
    o: List[str] = []
    o.append('<?xml version="1.0" encoding="UTF-8"?>')
    o.append(f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
             f'viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="11">')
    o.append(f'<rect x="0" y="0" width="{W}" height="{H}" fill="#ffffff"/>')
    o.append(f'<text x="{left}" y="18" font-size="14" font-weight="bold">{_esc(title)}</text>')
    # legend
    lx = left
    for key, label, _, color in _SERIES:
        o.append(f'<line x1="{lx}" y1="36" x2="{lx + 22}" y2="36" stroke="{color}" '
                 f'stroke-width="2"/>')
        o.append(f'<text x="{lx + 27}" y="40">{_esc(label)}</text>')
        lx += 40 + 7 * len(label) + 20
    for name, dash in (("baseline", "6,3"), ("drain", "2,3")):
        if marks and name in marks:
            o.append(f'<line x1="{lx}" y1="36" x2="{lx + 22}" y2="36" stroke="#555" '
                     f'stroke-dasharray="{dash}"/>')
            o.append(f'<text x="{lx + 27}" y="40">{"warm-up end (baseline)" if name == "baseline" else "drain"}</text>')
            lx += 27 + 7 * (22 if name == "baseline" else 5) + 20
    if events:
        for state, color in _ALARM_COLORS.items():
            tri = (f"{lx},40 {lx + 10},40 {lx + 5},31" if state == "raised"
                   else f"{lx},31 {lx + 10},31 {lx + 5},40")
            o.append(f'<polygon points="{tri}" fill="{color}"/>')
            o.append(f'<text x="{lx + 15}" y="40">alarm {state}</text>')
            lx += 15 + 7 * len(f"alarm {state}") + 20

    def xpos(t: float) -> float:
        return left + pw * (t / tmax)

    for i, (key, label, scale, color) in enumerate(_SERIES):
        y0 = top + i * (ph + gap)
        pts = [(s["t"], s[key] / scale) for s in samples
               if isinstance(s.get("t"), (int, float)) and isinstance(s.get(key), (int, float))]
        vmax = _nice_max(max((v for _, v in pts), default=0.0))
        o.append(f'<g class="panel" id="panel-{_esc(key)}">')
        o.append(f'<rect x="{left}" y="{y0}" width="{pw}" height="{ph}" fill="#fafafa" '
                 f'stroke="#999" stroke-width="0.5"/>')
        for frac in (0.0, 0.5, 1.0):
            yy = y0 + ph - ph * frac
            o.append(f'<line x1="{left - 4}" y1="{yy:.1f}" x2="{left + pw}" y2="{yy:.1f}" '
                     f'stroke="#ddd" stroke-width="0.5"/>')
            o.append(f'<text x="{left - 6}" y="{yy + 4:.1f}" text-anchor="end">'
                     f'{_esc(_fmt_num(vmax * frac))}</text>')
        o.append(f'<line x1="{left}" y1="{y0}" x2="{left}" y2="{y0 + ph}" stroke="#333"/>')
        o.append(f'<text x="{left + pw - 6}" y="{y0 - 3}" fill="{color}" font-weight="bold" '
                 f'text-anchor="end">{_esc(label)}</text>')
        if marks:
            for name, dash in (("baseline", "6,3"), ("drain", "2,3")):
                if name in marks:
                    x = xpos(marks[name])
                    o.append(f'<line x1="{x:.1f}" y1="{y0}" x2="{x:.1f}" y2="{y0 + ph}" '
                             f'stroke="#555" stroke-dasharray="{dash}" stroke-width="0.8"/>')
        if len(pts) > 1500:   # keep the peaks: the max of each bucket
            step = len(pts) / 1500.0
            pts = [max(pts[int(j * step):max(int(j * step) + 1, int((j + 1) * step))],
                       key=lambda p: p[1]) for j in range(1500)]
        if pts:
            coords = " ".join(f"{xpos(t):.1f},{y0 + ph - ph * (v / vmax):.1f}" for t, v in pts)
            o.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" '
                     f'points="{coords}"/>')
        kinds_with_panel = {k for k, _, _, _ in _SERIES}
        mine = [a for a in events if a.get("kind") == key or
                ("rss" if key == "rss_kb" else None) == a.get("kind") or
                (a.get("kind") not in kinds_with_panel and a.get("kind") != "rss")]
        if mine:
            o.append('<g class="alarms">')
            for a in mine:
                x = xpos(a["t"])
                color = _ALARM_COLORS[a["state"]]
                tri = (f"{x - 4:.1f},{y0 + 8} {x + 4:.1f},{y0 + 8} {x:.1f},{y0}"
                       if a["state"] == "raised" else
                       f"{x - 4:.1f},{y0} {x + 4:.1f},{y0} {x:.1f},{y0 + 8}")
                o.append(f'<line x1="{x:.1f}" y1="{y0}" x2="{x:.1f}" y2="{y0 + ph}" '
                         f'stroke="{color}" stroke-width="0.6" stroke-opacity="0.6"/>')
                o.append(f'<polygon points="{tri}" fill="{color}"><title>'
                         f'{_esc(a.get("kind"))} {_esc(a["state"])} at {a["t"]:.1f}s: '
                         f'{_esc(a.get("message", ""))}</title></polygon>')
            o.append('</g>')
        o.append('</g>')
    # the time axis, under the last panel
    ya = top + len(_SERIES) * (ph + gap) - gap
    o.append(f'<line x1="{left}" y1="{ya}" x2="{left + pw}" y2="{ya}" stroke="#333"/>')
    step = next((st for st in (0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900,
                               1800, 3600, 7200, 14400) if st >= tmax / 8.0), 86400)
    t = 0.0
    while t <= tmax + 1e-9:
        x = xpos(t)
        o.append(f'<line x1="{x:.1f}" y1="{ya}" x2="{x:.1f}" y2="{ya + 4}" stroke="#333"/>')
        if step < 60:
            lab = f"{_fmt_num(round(t, 1))}s"
        elif step < 3600:
            lab = f"{int(t) // 60}m"
        else:
            lab = f"{int(t) // 3600}h{(int(t) % 3600) // 60:02d}" if t % 3600 else f"{int(t) // 3600}h"
        o.append(f'<text x="{x:.1f}" y="{ya + 16}" text-anchor="middle">{_esc(lab)}</text>')
        t += step
    o.append(f'<text x="{left + pw / 2:.1f}" y="{ya + 34}" text-anchor="middle">'
             f'time since start</text>')
    o.append('</svg>')
    return "\n".join(o) + "\n"


# ---------------------------------------------------------------- the CLI


def _mix_arg(text: str) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        k, sep, v = part.partition("=")
        if not sep or k not in KINDS:
            raise argparse.ArgumentTypeError(
                f"--mix: {part!r}: use KIND=WEIGHT with KIND one of {', '.join(KINDS)}")
        try:
            out[k] = max(0, int(v))
        except ValueError:
            raise argparse.ArgumentTypeError(f"--mix: {part!r}: weight must be an integer") from None
    return out


class _Parser(argparse.ArgumentParser):
    """argparse, with stockade's usage-error status instead of argparse's 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="stockade soak",
        description="Drive a real `stockade serve` with a hostile workload mix and fail on "
                    "leaked zombies, descriptors, memory, processes or session dirs.",
        epilog="Exit status: 0 every check passed, 1 a check failed, 125 usage error or the "
               "server could not start, 130 interrupted (drained and reported). Environment: "
               "STOCKADE_BIN (the binary), STOCKADE_SOAK_TMPDIR (where the work dir goes, "
               "default /var/tmp). See the module docstring (contrib/soak/stockade_soak).")
    p.add_argument("--stockade", default=os.environ.get("STOCKADE_BIN") or shutil.which("stockade"),
                   help="the stockade binary to run as `stockade serve` (default: $STOCKADE_BIN, "
                        "else stockade on PATH)")
    p.add_argument("--policy", metavar="FILE",
                   help="the policy to serve (default: a workload policy written to a temp "
                        "file: default.lua with processes=32, running=sessions=2 x concurrency)")
    p.add_argument("--duration", type=_arg_duration, default=3600.0, metavar="DUR",
                   help="how long to drive the workload: 1h (default), 10m, 90s, 250ms")
    p.add_argument("--concurrency", type=int, metavar="N",
                   help="worker threads, one call in flight each (default: min(2 x the "
                        "policy's limits.running, 2 x CPUs); with the written policy 2 x CPUs)")
    p.add_argument("--report", metavar="PATH.json",
                   help="write the JSON report there and the SVG chart beside it (PATH.svg)")
    p.add_argument("--max-fd-growth", type=int, default=8, metavar="N",
                   help="fail when end - baseline fds > N (default 8)")
    p.add_argument("--max-rss-growth", type=float, default=5.0, metavar="PCT",
                   help="fail when RSS grew more than PCT percent over the baseline (default 5)")
    p.add_argument("--rss-growth-floor", type=float, default=2.0, metavar="MIB",
                   help="ignore RSS growth below this many MiB (default 2)")
    p.add_argument("--max-zombie-samples", type=float, default=5.0, metavar="PCT",
                   help="fail when more than PCT percent of samples saw a zombie (default 5)")
    p.add_argument("--max-errors", type=int, default=0, metavar="N",
                   help="fail on more than N unexpected results or RPC errors (default 0)")
    p.add_argument("--warmup", type=_arg_duration, metavar="DUR",
                   help="warm-up before the baseline (default 10%% of the duration, min 2s)")
    p.add_argument("--sample-interval", type=_arg_duration, default=1.0, metavar="DUR",
                   help="how often to sample the server (default 1s)")
    p.add_argument("--churn-every", type=int, default=10, metavar="K",
                   help="even workers close and reopen their session every K calls "
                        "(default 10; 0: never)")
    p.add_argument("--mix", type=_mix_arg, metavar="KIND=W,...",
                   help=f"override weights of the mix; kinds: {', '.join(KINDS)} (defaults "
                        + ", ".join(f"{k}={w}" for k, w in KINDS.items()) + ")")
    p.add_argument("--isolation", choices=("process", "strict"), default="process",
                   help="isolation level of the written workload policy (default process)")
    p.add_argument("--state-dir", metavar="DIR",
                   help="the server's state dir (default: a fresh temp dir, removed after a "
                        "passing run)")
    p.add_argument("--keep-state", action="store_true",
                   help="keep the temp dir (policy, serve.log, state) even when the run passed")
    p.add_argument("--seed", type=int, help="seed of the workload's random choices")
    p.add_argument("--progress", choices=("auto", "tty", "plain", "none"), default="auto",
                   help="live progress on stderr: a status line on a TTY (auto), plain lines "
                        "every 10s otherwise, or none")
    p.add_argument("--rpc-timeout", type=_arg_duration, default=30.0, metavar="DUR",
                   help="bound on a stats/session response (default 30s)")
    p.add_argument("--stop-timeout", type=_arg_duration, default=30.0, metavar="DUR",
                   help="bound on the server's exit after EOF on its stdin (default 30s)")
    p.add_argument("--serve-arg", action="append", metavar="ARG",
                   help="an extra argument for `stockade serve` (repeatable), e.g. --verbose")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    o = parser.parse_args(argv)
    if not o.stockade:
        parser.error("no stockade binary: pass --stockade PATH (or set STOCKADE_BIN)")
    if not (os.path.isfile(o.stockade) and os.access(o.stockade, os.X_OK)):
        parser.error(f"--stockade {o.stockade}: not an executable file")
    if o.duration <= 0:
        parser.error("--duration must be positive")
    if o.concurrency is not None and o.concurrency < 1:
        parser.error("--concurrency must be at least 1")
    if o.sample_interval <= 0:
        parser.error("--sample-interval must be positive")
    if o.progress == "auto":
        o.progress = "tty" if sys.stderr.isatty() else "plain"
    soak = Soak(o)
    prev = {}

    def on_signal(signum, frame):
        if soak.stop.is_set():
            raise KeyboardInterrupt
        soak.interrupted = True
        soak.log(f"{signal.Signals(signum).name}: stopping early, draining and reporting "
                 "(again to abort)")
        soak.stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            prev[sig] = signal.signal(sig, on_signal)
        except (ValueError, OSError):
            pass
    try:
        rc = soak.run()
        # an interrupted run proved less than it was asked to: never exit 0
        return 130 if rc == 0 and soak.interrupted else rc
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    except KeyboardInterrupt:
        print("stockade soak: aborted", file=sys.stderr)
        if soak.client is not None and soak.client.proc.poll() is None:
            soak.client.close(timeout=10)
        return 130
    finally:
        for sig, h in prev.items():
            try:
                signal.signal(sig, h)
            except (ValueError, OSError):
                pass

