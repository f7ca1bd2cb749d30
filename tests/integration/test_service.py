"""`stockade serve` as systemd runs it (contrib/systemd): the listening socket passed in
(LISTEN_FDS), readiness and stopping through NOTIFY_SOCKET, the socket left in place for
the next start. systemd itself is not needed: the test plays its part."""
import json
import os
import socket
import subprocess

import pytest

from stockade_testlib import POLICY, STOCKADE_BIN as BIN, state_directory
from serve_helpers import Client



@pytest.fixture
def tmp():
    with state_directory("stockade-svc-") as d:
        yield d


def notifications(sock, until, timeout=20.0):
    """Datagrams on the notify socket until one contains `until`."""
    sock.settimeout(timeout)
    got = []
    while not any(until in g for g in got):
        got.append(sock.recv(4096).decode())
    return got


def test_socket_activation_and_notify(tmp):
    path = os.path.join(tmp, "stockade.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    notify_path = os.path.join(tmp, "notify")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(notify_path)
    log = os.path.join(tmp, "serve.log")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STOCKADE_", "LISTEN_"))}
    env.update(NOTIFY_SOCKET=notify_path, LISTEN_FDS="1")
    # LISTEN_PID must be the server's own pid: the shell's, kept through exec
    cmd = ["/bin/sh", "-c", 'LISTEN_PID=$$ exec "$@"', "sh", BIN, "serve", "--policy", POLICY,
           "--state-dir", os.path.join(tmp, "state"), "--log", log]
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,
                            close_fds=False, preexec_fn=lambda: os.dup2(listener.fileno(), 3))
    try:
        got = notifications(notify, "READY=1")
        assert any(f"MAINPID={proc.pid}" in g for g in got), got
        c = Client.connect_unix(path, rpc_timeout=30)
        with c.open_session() as s:
            r = s.call("echo", ["activated"])
            assert r.class_ == "OK" and r.stdout == b"activated\n", r
        c.close()
        # a socket-activated server outlives its clients, like one on --listen
        c2 = Client.connect_unix(path, rpc_timeout=30)
        assert c2.hello().version
        c2.close()
        assert proc.poll() is None, "the server stopped when its client left"
        proc.terminate()
        assert any("STOPPING=1" in g for g in notifications(notify, "STOPPING=1"))
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        notify.close()
    # the socket is systemd's: still there, still accepting for the next start
    assert os.path.exists(path)
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.connect(path)
    probe.close()
    listener.close()
    with open(log) as f:
        start = next(r for r in map(json.loads, f) if r.get("event") == "startup")
    assert start["listen"] == f"socket-activation:unix:{path}", start


def test_listen_and_socket_activation_conflict(tmp):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(os.path.join(tmp, "a.sock"))
    listener.listen(1)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STOCKADE_", "LISTEN_"))}
    env["LISTEN_FDS"] = "1"
    cmd = ["/bin/sh", "-c", 'LISTEN_PID=$$ exec "$@"', "sh", BIN, "serve", "--policy", POLICY,
           "--state-dir", os.path.join(tmp, "state"), "--listen",
           "unix:" + os.path.join(tmp, "b.sock")]
    cp = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                        text=True, timeout=30, close_fds=False,
                        preexec_fn=lambda: os.dup2(listener.fileno(), 3))
    listener.close()
    assert cp.returncode == 125 and "drop --listen" in cp.stderr, cp
