"""A hook over the policy's memory cap costs its call and nothing else (issue 14).

A hook that keeps memory alive up to `limits.lua_memory` leaves the policy state full:
every later entry into it (the next call's view, the classify hook every finished call
goes through) meets a refused allocation. None of them may raise outside a protected
call (a Lua panic aborts the whole server): each costs its own call, refused with a
one-line reason, and another session's calls and `stats` keep answering.

    STOCKADE_BIN=$PWD/stockade PYTHONPATH=contrib/python \\
        /usr/bin/python3 -m pytest -q -p no:cacheprovider tests/security/test_hook_memory.py
"""
import os

import pytest

from serve_helpers import ServeProc, assert_no_sanitizer_reports, one_line
from stockade_testlib import FIXTURES

POLICY = os.path.join(FIXTURES, "hook_memory.lua")
BIG = "a" * (32 << 10)


@pytest.fixture
def server(stockade, state_dir):
    srv = ServeProc(stockade, state_dir, POLICY, listen=True)
    try:
        yield srv
    finally:
        alive = srv.alive()
        srv.stop()          # SIGTERM, and its socket's directory under /var/tmp removed
    if not alive:
        with open(srv.log_path, "rb") as f:
            log = f.read().decode("utf-8", "replace")
        pytest.fail(f"serve died (exit {srv.proc.returncode}): {log[-3000:]}")
    assert_no_sanitizer_reports(srv.log_path, extra=("PANIC",))


def test_hook_that_fills_the_state_costs_its_calls_only(server):
    a = server.connect()
    b = server.connect()
    try:
        with a.open_session() as sa:
            # the hook swallows every refusal: its own call may pass, the state is full
            sa.call("keeper", [])
            # the next calls' views (32 KiB of argv) meet the cap: refused, in one line
            for i in range(3):
                r = sa.call("keeper", [BIG])
                assert r.class_ == "POLICY_VIOLATION", (i, r)
                assert one_line(r.message) and "memory cap" in r.message, (i, r.message)
            # another hook of the same (full) state: refused the same way, fail closed
            r = sa.call("guarded", [BIG])
            assert r.class_ == "POLICY_VIOLATION" and "memory cap" in r.message, r
        with b.open_session() as sb:
            for _ in range(3):
                r = sb.call("true", [])
                assert r.class_ == "OK" and r.exit_code == 0, r
        st = b.stats()
        assert isinstance(st, dict) and st, st
        assert server.alive()
    finally:
        a.close()
        b.close()
