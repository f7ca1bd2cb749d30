"""Section 6 of tests/bench/run.py: redaction.

  6a  per-family recall and the share of negatives left intact, over the corpus of
      tests/redact/corpus (one read, and one byte per read), for each of its halves:
      the cases the rules were written with, and the public rule sets' own test lists
      imported after them (held out)
  6b  a scan of the system's own source and documentation trees (/usr/include,
      /usr/share/doc with .gz expanded, the Python standard library): files changed
  6c  throughput by input class, through a real `serve` call with the default secret
      set, as a ratio to a raw pipe of the same file, with the supervisor's CPU time
  6d  a noisy neighbour: another session's `true` while a call redacts an adversarial
      input (worst latency as a ratio to the same calls alone)
"""

import base64
import gzip
import json
import os
import random
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "tests", "redact"))
sys.path.insert(0, os.path.join(REPO, "contrib", "python"))

import corpus  # noqa: E402

SEC = "6 redaction"


def _ticks(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])      # utime + stime


# ---------------------------------------------------------------- inputs


def _write(path, size, make):
    with open(path, "wb") as f:
        n = 0
        while n < size:
            b = make()
            f.write(b[:size - n])
            n += len(b[:size - n])
    os.chmod(path, 0o644)


def make_inputs(d, size):
    """The input classes of the redaction issue, `size` bytes each, in directory d."""
    r = random.Random(7)
    files = {}

    def add(name, make):
        p = os.path.join(d, name)
        _write(p, size, make)
        files[name] = p

    add("zero", lambda: bytes(1 << 20))
    add("random base64", lambda: base64.encodebytes(r.randbytes(3 << 18)))
    frag = (b"GET https://cdn.example.com/a?x=1 sk-short eyJhbGciOi.x AKIA123 token=1 "
            b"password: * ghp_abc xoxb-1 -----BEGIN CERTIFICATE----- Authorization: x ")
    add("long prefix-dense lines", lambda: frag * 800 + b"\n")
    js = (b'function a%d(e,t){var n="https://api.example.com/v1/"+e+"?key="+t.k;return fetch'
          b'(n,{headers:{Authorization:"Bearer "+t.token,"X-Api-Key":t.apiKey,cookie:t.c}})'
          b'.then(function(r){return r.json()})};var secret_len=32,tokenType="bearer";')
    k = iter(range(1 << 30))
    add("minified JS (one line)", lambda: b"".join(js % next(k) for _ in range(2000)))
    log = subprocess.run(["git", "-C", REPO, "log", "-p", "-n", "400"], capture_output=True).stdout
    add("git log -p", lambda: log or b"commit 0\n")
    rec = [{"id": i, "name": "item-%d" % i, "token": None, "password": "", "auth": {"type": "none"},
            "url": "https://example.com/items/%d" % i, "tags": ["a", "b"], "score": i * 0.5}
           for i in range(2000)]
    pretty = json.dumps(rec, indent=2).encode()
    add("pretty JSON", lambda: pretty)
    tb = b"".join(b'2026-11-30 10:%02d:00 ERROR request failed auth=ok user=bob\n'
                  b'Traceback (most recent call last):\n  File "/srv/app/views.py", line %d, in get\n'
                  b'    token = session["token"]\nKeyError: \'token\'\n' % (i % 60, i) for i in range(500))
    add("traceback-heavy log", lambda: tb)
    # the liveness issue's input: a prefix, then a run that a secret's body could be
    adv = b"eyJ" + b"a" * 16381
    add("adversarial eyJ+a*16381", lambda: adv * 64)
    return files


# ---------------------------------------------------------------- sections


def corpus_rows(ctx, bench, Row):
    """Per family: recall on the cases the rules were written with ("written") and on
    the public rule sets' own test lists ("held-out"), and the share of each half's
    negatives left intact (overall and per family)."""
    for chunk, how in [(0, "one read"), (1, "one byte per read")]:
        t0 = time.monotonic()
        try:
            res = corpus.evaluate(ctx.stockade, chunk)
        except Exception as e:      # a crash of the core, not a number
            bench.fail(f"corpus ({how})", str(e))
            return
        for half, r in res.items():
            on_purpose = {}
            for c, _ in r["missed"]:
                if corpus.deliberate_miss(c):
                    on_purpose[c["family"]] = on_purpose.get(c["family"], 0) + 1
            for fam, (got, total) in sorted(r["families"].items()):
                why = f"; {on_purpose[fam]} missed on purpose (corpus.DELIBERATE_MISSES)" if fam in on_purpose else ""
                bench.add(Row(SEC, f"recall {fam}, {half} ({how})", "%", [100.0 * got / total],
                              better="higher", key=f"recall:{half}:{fam}:{chunk}",
                              note=f"{got}/{total} cases; target >= 95 %{why}"))
            for fam, (got, total) in sorted(r["negatives_by_family"].items()):
                bench.add(Row(SEC, f"negatives intact {fam}, {half} ({how})", "%", [100.0 * got / total],
                              better="higher", key=f"negatives:{half}:{fam}:{chunk}", note=f"{got}/{total}"))
            intact, total = r["negatives"]
            la_ok, la_total = r["look_alikes"]
            bench.add(Row(SEC, f"negatives left intact, {half} ({how})", "%", [100.0 * intact / total],
                          better="higher", key=f"negatives:{half}:{chunk}",
                          note=f"{intact}/{total}; target >= 99 %; look-alikes (real-format keys a rule set "
                               f"rejects by value) left intact: {la_ok}/{la_total}; "
                               f"corpus in {time.monotonic() - t0:.1f} s"))


def system_texts(limit_bytes):
    roots = ["/usr/include", "/usr/share/doc", os.path.dirname(os.__file__)]
    texts, names, total = [], [], 0
    for root in roots:
        for d, _, fs in os.walk(root):
            for f in sorted(fs):
                p = os.path.join(d, f)
                if os.path.islink(p) or not os.path.isfile(p) or p.endswith((".pyc", ".so")):
                    continue
                try:
                    if p.endswith(".gz"):
                        with gzip.open(p, "rb") as g:
                            data = g.read(4 << 20)
                    elif os.path.getsize(p) <= 4 << 20:
                        with open(p, "rb") as g:
                            data = g.read()
                    else:
                        continue
                except (OSError, EOFError, gzip.BadGzipFile):
                    continue
                texts.append(data)
                names.append(p)
                total += len(data)
                if total >= limit_bytes:
                    return names, texts, total
    return names, texts, total


def scan_rows(ctx, bench, Row):
    limit = (64 << 20) if ctx.args.quick else (1 << 30)
    names, texts, total = system_texts(limit)
    t0 = time.monotonic()
    outs = corpus.redact_texts(ctx.stockade, texts, 0, timeout=1800)
    dt = time.monotonic() - t0
    changed = [n for n, t, o in zip(names, texts, outs) if t != o]
    # a changed file is not necessarily damage: docs hold credential-shaped examples
    # (example keys, user:pass@ URLs); the README lists what this machine's were
    bench.add(Row(SEC, f"system trees: files changed ({len(names)} files, {total / 1e6:.0f} MB)",
                  "files", [len(changed)], key="scan:changed",
                  note=f"{total / 1e6 / dt:.0f} MB/s through `stockade test`; changed: "
                       + (", ".join(os.path.relpath(c, "/usr") for c in changed[:12]) or "none")
                       + (" ..." if len(changed) > 12 else "")))


def throughput_rows(ctx, bench, Row):
    from stockade_client import Client
    size = (8 << 20) if ctx.args.quick else (64 << 20)
    reps = 1 if ctx.args.quick else 3
    d = os.path.join(ctx.state, "redact-inputs")
    os.makedirs(d, exist_ok=True)
    os.chmod(d, 0o755)
    files = make_inputs(d, size)
    mb = size / 1e6
    client = Client.spawn(ctx.serve_argv("process"), env=ctx.env, stderr=ctx.serve_log,
                          rpc_timeout=900)
    try:
        s = client.open_session()
        pid = client.proc.pid
        hz = os.sysconf("SC_CLK_TCK")
        for name, path in files.items():
            pipe = []
            for _ in range(reps):
                t0 = time.perf_counter()
                subprocess.run(["/bin/sh", "-c", f"cat '{path}' | cat > /dev/null"], check=True)
                pipe.append(mb / (time.perf_counter() - t0))
            base = f"redact:pipe:{name}"
            bench.add(Row(SEC, f"{name}: raw pipe (cat | cat)", "MB/s", pipe, base=base,
                          better="higher", key=base))
            for tool, what in [("sh", "capture only"), ("sh_redact", "default secret set")]:
                rates, cpu = [], []
                for _ in range(reps):
                    c0 = _ticks(pid)
                    t0 = time.perf_counter()
                    r = s.call(tool, ["-c", f"cat '{path}'"], timeout_ms=600000, rpc_timeout=900)
                    dt = time.perf_counter() - t0
                    if not r.ok:
                        raise RuntimeError(f"{name} via {tool}: {r.class_} {r.message}")
                    got = len(r.stdout) + r.truncated["stdout"]
                    if tool == "sh" and got != size:
                        raise RuntimeError(f"{name}: {got} bytes delivered, not {size}")
                    rates.append(mb / dt)
                    cpu.append((_ticks(pid) - c0) / hz / (size / 1e9))
                bench.add(Row(SEC, f"{name}: call, {what}", "MB/s", rates, base=base, better="higher",
                              key=f"redact:{tool}:{name}",
                              note=f"target >= 0.5x; supervisor CPU "
                                   f"{sorted(cpu)[len(cpu) // 2]:.2f} s/GB"))
    finally:
        client.close()


def neighbour_rows(ctx, bench, Row):
    from stockade_client import Client
    size = (8 << 20) if ctx.args.quick else (64 << 20)
    d = os.path.join(ctx.state, "redact-inputs")
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, "adversarial")
    block = b"eyJ" + b"a" * 16381
    _write(path, size, lambda: block * 64)
    client = Client.spawn(ctx.serve_argv("process"), env=ctx.env, stderr=ctx.serve_log,
                          rpc_timeout=900)
    try:
        a, b = client.open_session(), client.open_session()

        def lat(n):
            xs = []
            for _ in range(n):
                t0 = time.perf_counter()
                if not b.call("true", []).ok:
                    raise RuntimeError("true failed")
                xs.append((time.perf_counter() - t0) * 1e3)
            return xs
        alone = lat(50)
        h = a.start_call("sh_redact", ["-c", f"cat '{path}'"], timeout_ms=600000)
        busy = []
        while not h.done():
            busy += lat(1)
        r = h.result(600)
        if not r.ok:
            raise RuntimeError(f"adversarial call: {r.class_} {r.message}")
        base = "redact:neighbour:alone"
        bench.add(Row(SEC, "neighbour `true` alone", "ms", alone, base=base, key=base))
        bench.add(Row(SEC, f"neighbour `true` while {size >> 20} MiB of eyJ+a*16381 is redacted",
                      "ms", busy, base=base, key="redact:neighbour:busy",
                      note=f"worst {max(busy):.1f} ms over {len(busy)} calls"))
    finally:
        client.close()


def section_redaction(ctx, bench, Row):
    # STOCKADE_BENCH_REDACT=throughput,neighbour: only those parts (while tuning)
    parts = os.environ.get("STOCKADE_BENCH_REDACT", "").split(",")
    for what, fn in [("corpus", corpus_rows), ("scan", scan_rows), ("throughput", throughput_rows),
                     ("neighbour", neighbour_rows)]:
        if parts != [""] and what not in parts:
            continue
        try:
            fn(ctx, bench, Row)
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            bench.fail(f"redaction {what}", str(e))
