#!/usr/bin/python3
"""`make demo`: a scripted tour of `stockade serve` through the Python client.

    PYTHONPATH=contrib/python /usr/bin/python3 contrib/demo.py

The binary is $STOCKADE_BIN or ./stockade; the policy policies/default.lua; the state
directory a temporary one under /var/tmp, removed at the end. Each scenario prints what
was asked and the structured answer: class, retryable, message, a bit of output.
"""

import os
import shutil
import sys
import tempfile
import textwrap
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(HERE, "python"))

from stockade_client import BadRequest, Client, StockadeError  # noqa: E402

BIN = os.environ.get("STOCKADE_BIN") or os.path.join(REPO, "stockade")
POLICY = os.path.join(REPO, "policies", "default.lua")
RPC_TIMEOUT = 60.0
redactions_seen = 0


def banner(title, asked):
    print()
    print(f"== {title}")
    print(f"   asked: {asked}")


def snippet(data, limit=240, max_lines=6):
    text = data.decode("utf-8", "replace").rstrip("\n")
    lines = text.split("\n")
    cut = len(text) > limit or len(lines) > max_lines
    text = "\n".join(lines[:max_lines])[:limit]
    if cut:
        text += f" ... ({len(data)} bytes in all)"
    return textwrap.indent(text, "   | ") if text.strip() else "   | (empty)"


def show(r):
    global redactions_seen
    redactions_seen += r.redactions
    print(f"   class: {r.class_}   retryable: {r.retryable}"
          + (f"   layer: {r.layer}" if r.layer else "")
          + (f"   exit: {r.exit_code}" if r.exit_code is not None else "")
          + (f"   signal: {r.signal}" if r.signal is not None else ""))
    if r.message:
        print(f"   message: {r.message}")
    print(f"   took {r.duration_ms} ms, cpu {r.cpu_ms} ms, max rss {r.max_rss_kb} KiB"
          + (f", truncated {r.truncated}" if any(r.truncated.values()) else ""))
    if r.stdout:
        print("   stdout:")
        print(snippet(r.stdout))
    if r.stderr:
        print("   stderr:")
        print(snippet(r.stderr))


def count_marker(marker):
    n = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        n += 1
            except OSError:
                pass
    return n


def main():
    if not os.access(BIN, os.X_OK):
        print(f"demo: no stockade binary at {BIN} (run `make`, or set STOCKADE_BIN)", file=sys.stderr)
        return 1
    state = tempfile.mkdtemp(prefix="stockade-demo-", dir="/var/tmp")
    os.chmod(state, 0o755)   # a tool runs as its own uid and must reach its workspace
    log = open(os.path.join(state, "serve.log"), "wb")
    client = None
    try:
        # The supervisor needs none of the operator's credentials. (Values of variables the
        # policy's env.deny names would be redacted from tool output anyway.)
        env = {k: v for k, v in os.environ.items()
               if not (k.endswith("_TOKEN") or k.startswith("AWS_") or k == "STOCKADE_DEPTH")}
        client = Client.spawn([BIN, "serve", "--policy", POLICY, "--state-dir", state],
                              rpc_timeout=RPC_TIMEOUT, stderr=log, env=env)
        info = client.hello("demo.py")
        print(f"stockade {info.version}, protocol {info.protocol}, policy "
              f"'{info.policy.get('name')}' (generation {info.policy.get('generation')}), "
              f"isolation {info.isolation.get('level')}: {', '.join(info.layers) or '-'}")

        with client.open_session(labels={"demo": "yes"}) as s:
            print(f"session {s.session_id}\n   root: {s.root}")

            banner("an allowed call", "echo hello from the sandbox")
            show(s.call("echo", ["hello from the sandbox"]))

            banner("who and where the tool is", "sh -c 'id; pwd; env | sort'")
            show(s.call("sh", ["-c", "id; pwd; env | sort"]))

            banner("a refused call: not in the policy's registry, nothing is started",
                   "curl https://example.com")
            show(s.call("curl", ["https://example.com"]))

            banner("a timed-out call (sleep is idempotent in the policy, so retryable)",
                   "sleep 30, timeout_ms=300")
            show(s.call("sleep", ["30"], timeout_ms=300))

            banner("a timed-out shell (never idempotent: not retryable), SIGTERM ignored",
                   "sh -c 'trap \"\" TERM; sleep 30', timeout_ms=300")
            show(s.call("sh", ["-c", 'trap "" TERM; sleep 30'], timeout_ms=300))

            banner("the caller's own deadline runs out first", "sleep 5, deadline_ms=300")
            show(s.call("sleep", ["5"], deadline_ms=300))

            banner("a typo in a parameter is refused, never silently ignored",
                   "sleep 5, deadline=300 (the parameter is deadline_ms)")
            try:
                s.call("sleep", ["5"], deadline=300)
                print("   ran: the typo was ignored")
            except BadRequest as e:
                print(f"   {e}")

            banner("a streamed call: output arrives while it runs",
                   "sh -c 'for i in 1 2 3; do echo tick $i; sleep 0.3; done', stream=True")
            h = s.start_call("sh", ["-c", "for i in 1 2 3; do echo tick $i; sleep 0.3; done"],
                             stream=True)
            t0 = time.monotonic()
            for chunk in h.output(timeout=RPC_TIMEOUT):
                text = chunk.data.decode("utf-8", "replace").rstrip("\n")
                print(f"   +{time.monotonic() - t0:4.1f}s {chunk.stream}: "
                      + text.replace("\n", "\n" + " " * 18))
            show(h.result(RPC_TIMEOUT))

            marker = f"{os.getpid()}{int(time.time()) % 100000}"
            banner("a daemonizer: nothing the call started outlives its answer",
                   f"sh -c 'setsid sleep 300.{marker} & echo started $!'")
            show(s.call("sh", ["-c", f"setsid sleep 300.{marker} & echo started background pid $!"],
                        timeout_ms=10_000))
            end = time.monotonic() + 3
            while count_marker(marker) and time.monotonic() < end:
                time.sleep(0.05)
            print(f"   processes of that daemon left on the host: {count_marker(marker)}")

            banner("an output flood: capped at the policy's 1 MiB, the rest counted",
                   "sh -c 'yes | head -c 300000000'")
            show(s.call("sh", ["-c", "yes | head -c 300000000"]))

            # ---- A REDACTED SECRET -------------------------------------------------------
            # The default policy redacts the secret set of plugins/secrets.lua from every
            # output: the key never reaches the model, and `redactions` counts it.
            key = "AKIA" + "IOSFODNN7" + "EXAMPLE"     # AWS's documentation example key
            cmd = f"echo aws_access_key_id={key}; echo url: https://bob:hunter2@git.example.com/x"
            banner("a redacted secret", f"sh -c '{cmd}'")
            show(s.call("sh", ["-c", cmd]))
            if redactions_seen == 0:
                print("   (no redaction happened: is plugins/secrets.lua in the policy?)")
            # -------------------------------------------------------------------------------

            st = client.stats()
            print()
            print(f"== stats: sessions {st['sessions']}, running {st['running']}, processes "
                  f"{st['processes']}, zombies {st['zombies']}, fds {st['fds']}, rss {st['rss_kb']} KiB")
            print("   calls by class: " + ", ".join(f"{k} {v}" for k, v in sorted(st["calls"].items()) if v))
            print(f"   session labels: {st.get('session_labels')}")
            root = s.root
            res = s.close()
            print()
            print(f"== session closed: {res}; root still there: {os.path.lexists(root)}")
            print(f"== closed again (idempotent): {s.close()}")
        rc = client.close()
        client = None
        print(f"server exited with status {rc}")
        return 0 if rc == 0 else 1
    except (StockadeError, TimeoutError, OSError) as e:
        print(f"demo: {e}", file=sys.stderr)
        log.flush()
        with open(log.name, "rb") as f:
            sys.stderr.write(f.read()[-2000:].decode("utf-8", "replace"))
        return 1
    finally:
        if client is not None:
            client.close()
        log.close()
        shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
