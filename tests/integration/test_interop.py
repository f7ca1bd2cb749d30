"""Interoperability: stockade driven by pynvim's MessagePack-RPC layer (Debian:
python3-pynvim), an implementation the project did not write and that knows nothing of
stockade, through the whole happy path (hello, open, call, streamed call with
notifications, cancel, close) and an error path. The npm side is
contrib/node/test/interop.test.js (msgpack5rpc)."""

from serve_helpers import POLICY, clean_env

from pynvim.msgpack_rpc import AsyncSession, EventLoop, MsgpackStream, Session


class RpcError(Exception):
    """pynvim leaves the error type to its user: the server's error map."""


def rpc_child(argv):
    """A pynvim Session over a spawned server's pipes, built from pynvim's own layers
    (its child_session() would first send Nvim's nvim_set_client_info)."""
    session = Session(AsyncSession(MsgpackStream(EventLoop("child", argv))))
    session.error_wrapper = RpcError
    return session


def test_pynvim_drives_the_whole_protocol(stockade, state_dir, monkeypatch):
    for k, v in clean_env().items():
        monkeypatch.setenv(k, v)
    s = rpc_child([stockade, "serve", "--policy", POLICY, "--state-dir", state_dir])
    got = {}
    notes = []

    def on_notification(method, args):
        notes.append((method, args))
        # args is the notification's argument array: [map]
        params = args[0]
        if method == "call.output" and b"ready" in params["data"] and "cancel" not in got:
            got["cancel"] = s.request("cancel", {"msgid": params["msgid"]})

    def on_request(method, args):
        raise AssertionError(f"the server sent a request: {method}")

    def scenario():
        try:
            got["hello"] = s.request("hello", {"client": "pynvim"})
            sid = s.request("session.open", {"labels": {"via": "pynvim"}})["session_id"]
            got["call"] = s.request("call", {"session_id": sid, "tool": "echo",
                                             "argv": ["interop"]})
            got["streamed"] = s.request("call", {"session_id": sid, "tool": "sh", "stream": True,
                                                 "argv": ["-c", "printf one; printf two >&2"]})
            got["cancelled"] = s.request("call", {"session_id": sid, "tool": "sh",
                                                  "stream": True,
                                                  "argv": ["-c", "echo ready; exec sleep 30"]})
            try:
                s.request("call", {"session_id": sid, "tool": "echo", "deadline": 100})
            except RpcError as e:
                got["error"] = e.args[0]
            try:
                s.request("session.renew", {"session_id": "never-seen"})
            except RpcError as e:
                got["no_such"] = e.args[0]
            got["close"] = s.request("session.close", {"session_id": sid})
        finally:
            s.stop()

    try:
        s.run(on_request, on_notification, scenario)
    finally:
        s.close()

    assert got["hello"]["protocol"] == 2
    assert got["call"]["class"] == "OK" and got["call"]["stdout"] == b"interop\n"
    assert got["streamed"]["class"] == "OK"
    out = {"stdout": b"", "stderr": b""}
    for method, args in notes:
        assert len(args) == 1, f"notification arguments are [map]: {args!r}"
        if method == "call.output":
            out[args[0]["stream"]] += args[0]["data"]
    assert out == {"stdout": b"one" + b"ready\n", "stderr": b"two"}, out
    assert got["cancel"] == {"cancelled": True}
    assert got["cancelled"]["class"] == "CANCELLED", got["cancelled"]
    assert got["error"]["class"] == "BAD_REQUEST" and "deadline" in got["error"]["message"]
    assert got["no_such"]["class"] == "NO_SUCH_SESSION"
    assert got["close"] == {"removed": True, "calls_killed": 0}
