"""`stockade mcp` fed raw JSON lines: malformed messages, oversize lines, deep nesting,
version negotiation. Each bad message gets the JSON-RPC error it deserves and the server
keeps serving. (The well-formed protocol is tested with the MCP SDK in tests/mcp.)"""

import json
import os
import select
import shutil
import signal
import subprocess
import time

import pytest

from stockade_testlib import FIXTURES

POLICY = os.path.join(FIXTURES, "mcp.lua")
BOUND = 20.0    # seconds: an answer slower than this is a hang


class Mcp:
    def __init__(self, stockade, state_dir, *args, policy=POLICY):
        self.proc = subprocess.Popen(
            [stockade, "mcp", "--policy", policy, "--state-dir", state_dir, *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True)
        self.buf = b""

    def wait_log(self, text):
        """Read the JSON-lines log until `text` appears in it."""
        deadline = time.monotonic() + BOUND
        while text not in getattr(self, "log", ""):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stderr], [], [], left)[0]:
                pytest.fail(f"{text!r} not logged within {BOUND}s")
            chunk = os.read(self.proc.stderr.fileno(), 65536)
            if not chunk:
                pytest.fail(f"log closed before {text!r}")
            self.log = getattr(self, "log", "") + chunk.decode(errors="replace")

    def send_raw(self, data):
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def send(self, obj):
        self.send_raw(json.dumps(obj).encode() + b"\n")

    def recv(self):
        deadline = time.monotonic() + BOUND
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                pytest.fail(f"no answer within {BOUND}s")
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                pytest.fail("stockade mcp closed its output")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def request(self, obj):
        self.send(obj)
        return self.recv()

    def initialize(self, version="2025-11-25"):
        r = self.request({"jsonrpc": "2.0", "id": 0, "method": "initialize",
                          "params": {"protocolVersion": version, "capabilities": {},
                                     "clientInfo": {"name": "pytest", "version": "1"}}})
        self.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        return r

    def ping(self, i=99):
        r = self.request({"jsonrpc": "2.0", "id": i, "method": "ping"})
        assert r == {"jsonrpc": "2.0", "id": i, "result": {}}

    def close(self):
        self.proc.stdin.close()
        try:
            rc = self.proc.wait(timeout=BOUND)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            pytest.fail("stockade mcp did not exit at EOF")
        self.proc.stdout.close()
        self.proc.stderr.close()
        return rc


@pytest.fixture
def mcp(stockade, state_dir):
    m = Mcp(stockade, state_dir)
    yield m
    if m.proc.poll() is None:
        m.close()


def error_of(r):
    assert "error" in r, r
    return r["id"], r["error"]["code"], r["error"]["message"]


def test_malformed_messages_get_their_error_and_the_server_serves_on(mcp):
    cases = [
        (b"this is not json\n", (None, -32700)),
        (b'{"jsonrpc":"2.0","id":1,"method":"ping"\n', (None, -32700)),          # truncated
        (b'\xff\xfe{"jsonrpc":"2.0"}\n', (None, -32700)),                        # not UTF-8
        (b'{"jsonrpc":"2.0","id":2,"method":"pi\\u0000ng"}\n', (None, -32700)),  # NUL
        (b'{"jsonrpc":"2.0","id":3,"id":4,"method":"ping"}\n', (None, -32700)),  # duplicate key
        (b'[{"jsonrpc":"2.0","id":5,"method":"ping"}]\n', (None, -32600)),       # batch
        (b'"just a string"\n', (None, -32600)),
        (b'{"jsonrpc":"1.0","id":6,"method":"ping"}\n', (6, -32600)),
        (b'{"jsonrpc":"2.0","id":1.5,"method":"ping"}\n', (None, -32600)),
        (b'{"jsonrpc":"2.0","id":null,"method":"ping"}\n', (None, -32600)),
        (b'{"jsonrpc":"2.0","id":7,"method":42}\n', (7, -32600)),
        (b'{"jsonrpc":"2.0","id":8}\n', (8, -32600)),
        (b'{"jsonrpc":"2.0","id":"a","method":"tools/list"}\n', ("a", -32600)),  # before initialize
    ]
    for raw, (want_id, want_code) in cases:
        mcp.send_raw(raw)
        got_id, code, _ = error_of(mcp.recv())
        assert (got_id, code) == (want_id, want_code), raw
        mcp.ping()
    mcp.initialize()
    r = mcp.request({"jsonrpc": "2.0", "id": 9, "method": "no/such/method"})
    assert error_of(r)[:2] == (9, -32601)
    r = mcp.request({"jsonrpc": "2.0", "id": 10, "method": "tools/call", "params": {"name": 7}})
    assert error_of(r)[:2] == (10, -32602)
    r = mcp.request({"jsonrpc": "2.0", "id": 11, "method": "tools/call",
                     "params": {"name": "nope", "arguments": {}}})
    assert error_of(r)[:2] == (11, -32602)
    # a notification never gets an answer, even a bad one: the next answer is the ping's
    mcp.send({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": "bad"})
    mcp.ping(12)
    assert mcp.close() == 0


def test_an_oversize_line_is_refused_and_the_next_line_served(stockade, state_dir):
    m = Mcp(stockade, state_dir, "--max-message", "4KiB")
    try:
        # 100 KiB in pieces: the server must drop it up to its newline, not buffer it
        big = b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"x":"' + b"a" * 100000 + b'"}}'
        for i in range(0, len(big), 8192):
            m.send_raw(big[i:i + 8192])
        m.send_raw(b"\n")
        _, code, msg = error_of(m.recv())
        assert code == -32600 and "larger than 4096 bytes" in msg
        m.ping(2)
        # just under the limit is fine
        ok = {"jsonrpc": "2.0", "id": 3, "method": "ping", "params": {"x": "a" * 3900}}
        assert m.request(ok)["result"] == {}
    finally:
        assert m.close() == 0


def test_nesting_is_bounded(mcp):
    mcp.send_raw(b"[" * 200000 + b"]" * 200000 + b"\n")
    _, code, msg = error_of(mcp.recv())
    assert code == -32600 and "nested deeper than 64" in msg
    # 64 levels in all pass, 65 do not (the message object itself is one)
    def nested(levels):
        return {"jsonrpc": "2.0", "id": 5, "method": "ping",
                "params": {"x": json.loads("[" * (levels - 2) + "]" * (levels - 2))}}
    assert mcp.request(nested(64))["result"] == {}
    assert error_of(mcp.request(nested(65)))[1] == -32600
    # brackets inside strings are not nesting
    assert mcp.request({"jsonrpc": "2.0", "id": 6, "method": "ping",
                        "params": {"s": "[{" * 1000}})["result"] == {}


@pytest.mark.parametrize("asked,answered", [("2025-11-25", "2025-11-25"),
                                            ("2025-06-18", "2025-06-18"),
                                            ("2024-11-05", "2024-11-05"),
                                            ("1999-01-01", "2025-11-25")])
def test_protocol_version_negotiation(mcp, asked, answered):
    r = mcp.initialize(asked)
    assert r["result"]["protocolVersion"] == answered
    assert r["result"]["capabilities"]["tools"] == {"listChanged": True}
    again = mcp.initialize(asked)
    assert error_of(again)[1] == -32600


def test_arguments_that_are_not_argv_are_a_tool_error(mcp):
    mcp.initialize()
    for args in ({"argv": "ls"}, {"argv": [1, 2]}, {"argv": [], "extra": True}):
        r = mcp.request({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                         "params": {"name": "echo", "arguments": args}})
        res = r["result"]
        assert res["isError"] is True
        assert res["structuredContent"]["class"] == "BAD_REQUEST"
        assert "argv" in res["content"][0]["text"]
    r = mcp.request({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                     "params": {"name": "echo", "arguments": {"argv": ["ok"]}}})
    assert r["result"]["content"][0]["text"] == "ok\n"


def test_eof_ends_the_server_and_removes_the_session(mcp, state_dir):
    mcp.initialize()
    r = mcp.request({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                     "params": {"name": "sh", "arguments": {"argv": ["-c", "pwd"]}}})
    root = r["result"]["content"][0]["text"].strip()
    assert root.startswith(os.path.join(state_dir, "sessions"))
    assert os.path.isdir(root)
    assert mcp.close() == 0
    assert not os.path.exists(root)
    assert os.listdir(os.path.join(state_dir, "sessions")) == []


def test_reloading_the_same_registry_is_not_a_change(mcp):
    """The tool list is rendered deterministically: Lua's table order differs between two
    loads of one file, and must not read as a changed registry."""
    mcp.initialize()
    before = mcp.request({"jsonrpc": "2.0", "id": 1, "method": "tools/list"})["result"]
    for gen in range(2, 8):
        mcp.proc.send_signal(signal.SIGHUP)
        mcp.wait_log(f"generation {gen}")
    # had any reload announced a change, its notification would come before this answer
    r = mcp.request({"jsonrpc": "2.0", "id": 2, "method": "tools/list"})
    assert r.get("id") == 2, f"unexpected message: {r}"
    assert json.dumps(r["result"]) == json.dumps(before)


def test_a_structured_tool_called_without_arguments_meets_its_schema(mcp):
    mcp.initialize()
    r = mcp.request({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                     "params": {"name": "greet"}})
    res = r["result"]
    assert res["isError"] is True
    assert res["structuredContent"]["class"] == "POLICY_VIOLATION"
    assert "name" in res["content"][0]["text"]


def test_a_session_that_cannot_open_says_why(stockade, state_dir):
    policy = os.path.join(state_dir, "no_sessions.lua")
    with open(POLICY) as f:
        text = f.read()
    with open(policy, "w") as f:
        f.write(text.replace('timeouts = { call = "10s"',
                             'limits = { sessions = 0 },\n  timeouts = { call = "10s"'))
    m = Mcp(stockade, state_dir, policy=policy)
    try:
        m.initialize()
        for i in (1, 2):     # the second call tries to open again, and fails the same way
            r = m.request({"jsonrpc": "2.0", "id": i, "method": "tools/call",
                           "params": {"name": "echo", "arguments": {"argv": ["x"]}}})
            sc = r["result"]["structuredContent"]
            assert r["result"]["isError"] is True
            assert (sc["class"], sc["retryable"]) == ("OVERLOADED", True)
            assert sc["message"].startswith("could not open a session: session limit reached")
    finally:
        assert m.close() == 0


def test_odd_tools_still_list(stockade, state_dir):
    """A tool name the policy description skips (a leading underscore) and a structured
    schema that is not an object must not break tools/list for every other tool."""
    policy = os.path.join(state_dir, "odd.lua")
    with open(policy, "w") as f:
        f.write('''local stockade = require "stockade"
return stockade.policy {
  name = "odd", isolation = "process",
  tools = {
    _hidden = stockade.tool { path = "/bin/echo", owner = "t", timeout = "5s",
                              schema = { type = "object" } },
    listy = stockade.tool { path = "/bin/echo", owner = "t", timeout = "5s",
                            schema = { type = "array" }, argv = function() return {} end },
  },
}
''')
    m = Mcp(stockade, state_dir, policy=policy)
    try:
        m.initialize()
        tools = m.request({"jsonrpc": "2.0", "id": 1, "method": "tools/list"})["result"]["tools"]
        assert [t["name"] for t in tools] == ["_hidden", "listy"]
        assert all(t["inputSchema"]["type"] == "object" for t in tools)
    finally:
        assert m.close() == 0


def write_policy(state_dir, name, timeouts):
    path = os.path.join(state_dir, name)
    with open(POLICY) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(text.replace('timeouts = { call = "10s", grace = "500ms" }', timeouts))
    return path


def call(m, i, tool, argv):
    return m.request({"jsonrpc": "2.0", "id": i, "method": "tools/call",
                      "params": {"name": tool, "arguments": {"argv": argv}}})["result"]


def test_the_fuse_is_the_connections_whole_budget(stockade, state_dir):
    policy = write_policy(state_dir, "fuse.lua",
                          'timeouts = { call = "1s", call_max = "30s", fuse = "2s", grace = "100ms" }')
    m = Mcp(stockade, state_dir, policy=policy)
    try:
        m.initialize()
        assert call(m, 1, "echo", ["x"])["structuredContent"]["class"] == "OK"
        # short calls until the 2s fuse fires under one of them
        for i in range(2, 12):
            sc = call(m, i, "sh", ["-c", "sleep 0.6"])["structuredContent"]
            if sc["class"] != "OK":
                break
        assert (sc["class"], sc["layer"]) == ("SESSION_EXPIRED", "fuse")
        m.wait_log("expired (fuse)")
        # no fresh session: every later call is refused the same way
        r = call(m, 20, "echo", ["again"])
        assert r["isError"] is True
        assert (r["structuredContent"]["class"], r["structuredContent"]["layer"]) == \
            ("SESSION_EXPIRED", "fuse")
        assert "fuse" in r["content"][0]["text"]
    finally:
        assert m.close() == 0


def test_a_lapsed_lease_opens_a_fresh_session(stockade, state_dir):
    m = Mcp(stockade, state_dir, "--session-ttl", "300ms")
    try:
        m.initialize()
        first = call(m, 1, "sh", ["-c", "echo $SESSION_ID"])["content"][0]["text"]
        m.wait_log("expired (ttl)")
        second = call(m, 2, "sh", ["-c", "echo $SESSION_ID"])
        assert second["structuredContent"]["class"] == "OK"
        assert second["content"][0]["text"] != first
    finally:
        assert m.close() == 0


def test_first_calls_wait_for_their_sessions_open(stockade, state_dir, level):
    """Calls sent together, before the session exists, run in it once it is open: a
    strict session is answered only when its zygote is up, and requests are handled
    concurrently, so a call that overtook its session.open found no session."""
    policy = POLICY
    if level == "strict":
        policy = os.path.join(state_dir, "strict.lua")
        with open(POLICY) as f:
            text = f.read()
        assert 'isolation = "process"' in text
        with open(policy, "w") as f:
            f.write(text.replace('isolation = "process"', 'isolation = "strict"'))
    m = Mcp(stockade, state_dir, policy=policy)
    try:
        m.initialize()
        for i in (1, 2, 3):
            m.send({"jsonrpc": "2.0", "id": i, "method": "tools/call",
                    "params": {"name": "echo", "arguments": {"argv": [f"call{i}"]}}})
        answers = {}
        for _ in range(3):
            r = m.recv()
            answers[r["id"]] = r["result"]["structuredContent"]["class"]
        assert answers == {1: "OK", 2: "OK", 3: "OK"}
        m.ping()
    finally:
        m.close()


# getrandom(2) that always fails, for LD_PRELOAD (libc is linked dynamically).
NO_RANDOM_C = r"""
#include <errno.h>
#include <sys/types.h>
ssize_t getrandom(void *buf, size_t len, unsigned int flags)
{
    (void)buf, (void)len, (void)flags;
    errno = ENOSYS;
    return -1;
}
"""


def test_no_random_source_is_a_start_up_error(stockade, state_dir, tmp_path):
    """Without a random source `stockade mcp` does not start: its session ids take a
    random nonce, and a fixed one would repeat in every process that shares the state
    dir."""
    if os.environ.get("STOCKADE_SANITIZED"):
        pytest.skip("LD_PRELOAD cannot come before the sanitizer's runtime")
    if not shutil.which("gcc"):
        pytest.skip("gcc is not installed: cannot build the failing getrandom")
    lib = str(tmp_path / "no_random.so")
    src = tmp_path / "no_random.c"
    src.write_text(NO_RANDOM_C)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", lib, str(src)], check=True, timeout=60)
    env = dict(os.environ, LD_PRELOAD=lib)
    cp = subprocess.run([stockade, "mcp", "--policy", POLICY, "--state-dir", state_dir],
                        input=b"", capture_output=True, env=env, timeout=BOUND)
    assert cp.returncode == 125, (cp.returncode, cp.stderr[-2000:])
    assert b"getrandom" in cp.stderr, cp.stderr[-2000:]
