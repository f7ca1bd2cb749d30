#!/usr/bin/python3
"""How an agent framework's tool function calls stockade.

An LLM framework (PydanticAI, LangChain, a home-grown loop) registers plain Python
functions as tools and feeds what they return back to the model. `run_shell` below is
such a function: it runs the command through stockade and maps the structured result to
text the model may see:

- OK                          -> the (capped, redacted) stdout
- TOOL_TIMEOUT, retryable     -> retried once, then reported as a timeout
- POLICY_VIOLATION            -> a terminal refusal: the model must not try it again
- TOOL_ERROR and the rest     -> a one-line summary from stockade's `message`, never the
                                 tool's raw stderr (it may hold paths, secrets, injection)
- OVERLOADED (raised)         -> retried once after a short pause

Run it:  PYTHONPATH=contrib/python /usr/bin/python3 contrib/python/examples/agent_tool.py
"""

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from stockade_client import Client, Overloaded, StockadeError  # noqa: E402

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
STOCKADE = os.environ.get("STOCKADE_BIN") or os.path.join(REPO, "stockade")
POLICY = os.environ.get("STOCKADE_POLICY") or os.path.join(REPO, "policies", "default.lua")

MAX_TEXT = 4000   # what the model gets back, at most


class StockadeTools:
    """One stockade connection and one session per agent run; the tool functions are
    bound methods the framework registers."""

    def __init__(self, state_dir, timeout_ms=10_000):
        self.client = Client.spawn([STOCKADE, "serve", "--policy", POLICY,
                                    "--state-dir", state_dir],
                                   rpc_timeout=120, stderr=open(os.devnull, "wb"))
        self.session = self.client.open_session(labels={"agent": "example"})
        self.timeout_ms = timeout_ms

    def close(self):
        try:
            self.session.close()
        finally:
            self.client.close()

    # ---- the tool the framework registers -------------------------------------------

    def run_shell(self, cmd: str) -> str:
        """Run a shell command in the agent's sandbox and return its output."""
        return self._run("sh", ["-c", cmd])

    def read_file(self, path: str) -> str:
        """Print a file of the agent's workspace."""
        return self._run("cat", ["--", path])

    def pause(self, seconds: float) -> str:
        """Wait (the `sleep` tool: idempotent in the policy, so a timeout is retried once)."""
        return self._run("sleep", [str(seconds)])

    # ---- mapping ---------------------------------------------------------------------

    def _run(self, tool, argv):
        for attempt in (1, 2):
            self.attempts = attempt
            try:
                r = self.session.call(tool, argv, timeout_ms=self.timeout_ms)
            except Overloaded:
                if attempt == 1:
                    time.sleep(0.5)
                    continue
                return "[the sandbox is busy; try again later]"
            except StockadeError as e:   # NO_SUCH_SESSION, BAD_REQUEST, INTERNAL, ...
                return f"[tool unavailable: {e.class_}: {e.message}]"
            if r.ok:
                text = r.stdout.decode("utf-8", "replace")
                if r.truncated.get("stdout"):
                    text += f"\n[output truncated: {r.truncated['stdout']} more bytes]"
                return text[:MAX_TEXT]
            if r.class_ == "TOOL_TIMEOUT" and r.retryable and attempt == 1:
                continue                    # idempotent: one retry is safe
            return self._describe_failure(r)
        return self._describe_failure(r)

    @staticmethod
    def _describe_failure(r):
        if r.class_ == "POLICY_VIOLATION":
            # Terminal: phrase it so the model stops rather than rephrases the same call.
            return (f"[REFUSED by policy: {r.message}. This action is not permitted; "
                    "do not retry it or try to work around it.]")
        if r.class_ in ("TOOL_TIMEOUT", "DEADLINE_EXCEEDED", "SESSION_EXPIRED"):
            return f"[timed out ({r.layer or r.class_}): {r.message}]"
        if r.class_ == "TOOL_ERROR":
            # stockade's message is one line and never raw stderr; keep it that way.
            out = r.stdout.decode("utf-8", "replace")[:MAX_TEXT // 2]
            return f"[command failed: {r.message}]" + (f"\n{out}" if out else "")
        return f"[{r.class_}: {r.message}]"


def main():
    state = tempfile.mkdtemp(prefix="stockade-agent-", dir="/var/tmp")
    os.chmod(state, 0o755)
    tools = StockadeTools(state, timeout_ms=500)
    try:
        for cmd in ("echo hello; ls -a", "cat /etc/shadow", "sleep 5"):
            print(f">>> run_shell({cmd!r})\n{tools.run_shell(cmd)}\n")
        print(f">>> pause(5)\n{tools.pause(5)}\n(attempts: {tools.attempts})\n")
        print(">>> run_tool curl (unknown to the policy)")
        print(tools._run("curl", ["https://example.com"]))
    finally:
        tools.close()
        import shutil
        shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    main()
