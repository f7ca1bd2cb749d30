"""Graceful upgrade: SIGUSR2 makes the server finish its running calls, hand its listening
socket to the binary now at its path (same pid, exec), and adopt its sessions again.
Clients see a reconnect, not lost sessions. Every wait is bounded.

    STOCKADE_BIN=$PWD/stockade PYTHONPATH=contrib/python /usr/bin/python3 -m pytest -q \
        -p no:cacheprovider tests/integration/test_upgrade.py
"""

import os
import shutil
import signal
import socket
import subprocess
import time

import pytest

from serve_helpers import ServeProc, children, sessions_left, wait_until
from stockade_client import Client, ConnectionClosed
from stockade_testlib import fixture_levels

POLICIES = fixture_levels("recovery")
POLICY, STRICT_POLICY = POLICIES["process"], POLICIES["strict"]


def reconnect(sock, bound=20.0):
    """A client of whichever server answers on the socket now."""
    end = time.monotonic() + bound
    while True:
        try:
            c = Client.connect_unix(sock, rpc_timeout=30)
            c.hello()
            return c
        except (OSError, ConnectionClosed):
            if time.monotonic() > end:
                pytest.fail(f"no server answered on {sock} within {bound:.0f}s")
            time.sleep(0.05)


@pytest.fixture
def binary_copy(stockade, tmp_path):
    """The binary at a path of the test's own, so the test can put another file there."""
    path = str(tmp_path / "stockade")
    shutil.copy2(stockade, path)
    return path


@pytest.mark.parametrize("policy", [POLICY, STRICT_POLICY], ids=["process", "strict"])
def test_upgrade_keeps_sessions_files_and_socket(binary_copy, state_dir, tmp_path, policy):
    if policy == STRICT_POLICY:
        cp = subprocess.run([binary_copy, "doctor"], capture_output=True, text=True, timeout=30)
        if "isolation strict:  available" not in cp.stdout:
            pytest.skip("this host cannot give strict isolation (stockade doctor)")
    srv = ServeProc(binary_copy, state_dir, policy, listen=True, log_dir=str(tmp_path))
    try:
        c = srv.connect()
        s = c.open_session(session_id="agent-7", ttl_ms=600000)
        assert s.call("sh", ["-c", "echo work > $AGENT_ROOT/workspace/notes"]).ok
        running = s.start_call("sh", ["-c", "sleep 1; echo finished"])
        wait_until(lambda: c.stats()["running"] == 1, 10, "the call running")
        # a new build is installed the way packages do: a new file renamed over the old
        new = binary_copy + ".new"
        shutil.copy2(binary_copy, new)
        os.rename(new, binary_copy)
        new_ino = os.stat(binary_copy).st_ino
        assert os.stat(f"/proc/{srv.pid}/exe").st_ino != new_ino
        os.kill(srv.pid, signal.SIGUSR2)
        # the running call finishes within the drain, and is answered
        r = running.result(timeout=20)
        assert r.ok and r.stdout == b"finished\n", (r.class_, r.message)
        # a client that connects during the upgrade waits in the backlog, then is served
        early = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        early.connect(srv.sock_path)
        early.close()
        c2 = reconnect(srv.sock_path)
        # the same process, now running the new file
        assert srv.alive()
        wait_until(lambda: os.stat(f"/proc/{srv.pid}/exe").st_ino == new_ino, 10,
                   "the server running the new binary")
        # the old image's helpers, killed before the exec, are reaped by the new one
        # before anything of its own exits (no SIGCHLD of its own to wait for)
        wait_until(lambda: not children(srv.pid)[1], 10,
                   "no zombie left of the old image's helpers")
        s2 = c2.open_session(session_id="agent-7")
        assert s2.root == s.root
        r = s2.call("sh", ["-c", "cat $AGENT_ROOT/workspace/notes"])
        assert r.ok and r.stdout == b"work\n", (r.class_, r.message)
        assert c2.stats()["sessions"] == 1
        assert c2.open_session().call("echo", ["new"]).ok
        assert s2.close()["removed"] is True
        assert "agent-7" not in sessions_left(state_dir)
        # the old connection was closed by the upgrade
        with pytest.raises(ConnectionClosed):
            for _ in range(50):
                c.hello()
                time.sleep(0.05)
        c2.close()
    finally:
        srv.stop()
        with open(srv.log_path, "rb") as f:
            print(f.read()[-4000:].decode("utf-8", "replace"))


def test_upgrade_exec_failure_keeps_serving(binary_copy, state_dir, tmp_path):
    """No binary at the path any more: the exec fails, the server takes its sessions back
    and goes on serving on the same socket."""
    srv = ServeProc(binary_copy, state_dir, POLICY, listen=True, log_dir=str(tmp_path))
    try:
        c = srv.connect()
        s = c.open_session(session_id="stays", ttl_ms=600000)
        assert s.call("sh", ["-c", "echo kept > $AGENT_ROOT/workspace/f"]).ok
        os.unlink(binary_copy)
        os.kill(srv.pid, signal.SIGUSR2)
        c2 = reconnect(srv.sock_path)
        assert srv.alive()
        r = c2.open_session(session_id="stays").call("sh", ["-c", "cat $AGENT_ROOT/workspace/f"])
        assert r.ok and r.stdout == b"kept\n", (r.class_, r.message)
        wait_until(lambda: "upgrade: exec" in srv.stderr_text(), 10, "the failure logged")
    finally:
        srv.stop()
