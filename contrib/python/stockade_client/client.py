"""Synchronous, thread-safe client of ``stockade serve`` (PROTOCOL.md).

One reader thread per connection decodes the server's stream and dispatches responses by
msgid to their waiters, ``call.output`` notifications to the matching call handle and other
notifications (``session.expired``, ``alarm``) to subscribers. Any number of threads can
have requests in flight on one connection::

    with Client.spawn(["stockade", "serve", "--policy", "policy.lua"]) as c:
        with c.open_session() as s:
            r = s.call("echo", ["hi"])
            print(r.class_, r.stdout)
"""

from __future__ import annotations

import collections
import os
import queue
import socket
import subprocess
import threading
import time
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Sequence, Tuple

from . import _proto
from .errors import ConnectionClosed, NoSuchSession, ProtocolError, error_from_map
from .types import CallResult, OutputChunk, ServerInfo, SessionInfo

__all__ = ["Client", "Session", "CallHandle", "Notification"]

Notification = Tuple[str, Dict[str, Any]]   # (method, params)

_END = object()


class _Pending:
    __slots__ = ("msgid", "method", "event", "error", "result", "closed_error", "chunks",
                 "stream")

    def __init__(self, msgid: int, method: str, stream: bool = False):
        self.msgid = msgid
        self.method = method
        self.event = threading.Event()
        self.error: Any = None
        self.result: Any = None
        self.closed_error: Optional[Exception] = None
        self.stream = stream
        self.chunks: "Optional[queue.Queue]" = queue.Queue() if stream else None


class CallHandle:
    """A call in flight. ``result(timeout)`` waits for its CallResult; for ``stream=True``
    calls ``output()`` yields OutputChunk(stream, data) as the tool writes, and ends when
    the response has arrived."""

    def __init__(self, client: "Client", pending: _Pending):
        self._client = client
        self._p = pending
        self.msgid = pending.msgid

    def done(self) -> bool:
        return self._p.event.is_set()

    def result(self, timeout: Optional[float] = None) -> CallResult:
        """The call's result. Raises TimeoutError if it has not come within ``timeout``
        seconds (the call keeps running; cancel() it if you give up), the matching
        StockadeError if the request was refused in the RPC error slot (OVERLOADED,
        NO_SUCH_SESSION, BAD_REQUEST, INTERNAL), ConnectionClosed if the connection died."""
        raw = self._client._wait(self._p, timeout)
        return CallResult.from_map(raw, msgid=self.msgid)

    def output(self, timeout: Optional[float] = None) -> Iterator[OutputChunk]:
        """Chunks of a ``stream=True`` call, in order, until the call is answered.
        ``timeout`` bounds the wait for each next chunk (TimeoutError)."""
        q = self._p.chunks
        if q is None:
            return
        while True:
            try:
                item = q.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"no output from call {self.msgid} within {timeout}s") from None
            if item is _END:
                q.put(_END)   # later iterations end too
                return
            yield item

    def cancel(self, timeout: Optional[float] = None) -> bool:
        """Ask the server to cancel this call; the call still answers (class CANCELLED)."""
        return self._client.cancel(self.msgid, rpc_timeout=timeout)

    def __repr__(self) -> str:
        return f"<CallHandle msgid={self.msgid} done={self.done()}>"


class Session:
    """A session opened with ``Client.open_session``. A context manager: ``close()`` on exit
    (a session that already expired or was closed is not an error there)."""

    def __init__(self, client: "Client", info: SessionInfo):
        self.client = client
        self.info = info
        self.session_id = info.session_id
        self.root = info.root
        self.expires_at_ms = info.expires_at_ms
        self.fuse_at_ms = info.fuse_at_ms
        self.closed = False

    def call(self, tool: str, argv: Optional[Sequence[str]] = None, **kw: Any) -> CallResult:
        return self.client.call(self.session_id, tool, argv, **kw)

    def start_call(self, tool: str, argv: Optional[Sequence[str]] = None, **kw: Any) -> CallHandle:
        return self.client.start_call(self.session_id, tool, argv, **kw)

    def renew(self, rpc_timeout: Optional[float] = None) -> int:
        res = self.client.request("session.renew", {"session_id": self.session_id},
                                  rpc_timeout=rpc_timeout)
        self.expires_at_ms = res.get("expires_at_ms")
        return self.expires_at_ms

    def close(self, rpc_timeout: Optional[float] = None) -> Dict[str, Any]:
        res = self.client.close_session(self.session_id, rpc_timeout=rpc_timeout)
        self.closed = True
        return res

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.closed and not self.client.closed:
            try:
                self.close()
            except (NoSuchSession, ConnectionClosed):
                pass

    def __repr__(self) -> str:
        return f"<Session {self.session_id} root={self.root}>"


class Client:
    """A connection to one ``stockade serve``. Use ``Client.spawn`` (stdio) or
    ``Client.connect_unix`` (``--listen unix:PATH``).

    ``rpc_timeout`` (seconds) is the default bound on waiting for any response; None
    waits forever. Every method takes its own ``rpc_timeout=`` too."""

    def __init__(self, reader: Callable[[], bytes], writer: Callable[[bytes], None],
                 closer: Callable[[], None], *, rpc_timeout: Optional[float] = None,
                 proc: Optional[subprocess.Popen] = None, sock: Optional[socket.socket] = None,
                 keep_notifications: int = 1000):
        self._read = reader
        self._write = writer
        self._closer = closer
        self.proc = proc
        self.sock = sock
        self.rpc_timeout = rpc_timeout
        self._lock = threading.Lock()          # pending map, msgids
        self._wlock = threading.Lock()         # one message on the wire at a time
        self._pending: Dict[int, _Pending] = {}
        self._ids = _proto.MsgidAllocator()
        self._subscribers: List[Callable[[str, Dict[str, Any]], None]] = []
        self._notes: Deque[Notification] = collections.deque(maxlen=keep_notifications)
        self._notes_cv = threading.Condition()
        self.closed = False
        self.close_reason: Optional[str] = None
        self._reader = threading.Thread(target=self._read_loop, name="stockade-client-reader",
                                        daemon=True)
        self._reader.start()

    # ------------------------------------------------------------------ constructors

    @classmethod
    def spawn(cls, argv: Sequence[str], *, rpc_timeout: Optional[float] = None,
              **popen_kw: Any) -> "Client":
        """Start ``argv`` (e.g. ``["stockade", "serve", "--policy", P]``) with pipes on its
        stdin/stdout. ``popen_kw`` go to subprocess.Popen (stderr, env, cwd, ...)."""
        popen_kw.setdefault("stdin", subprocess.PIPE)
        popen_kw.setdefault("stdout", subprocess.PIPE)
        popen_kw.setdefault("bufsize", 0)
        proc = subprocess.Popen(list(argv), **popen_kw)
        in_fd = proc.stdout.fileno()
        out_fd = proc.stdin.fileno()

        def reader() -> bytes:
            return os.read(in_fd, 1 << 16)

        def writer(data: bytes) -> None:
            view = memoryview(data)
            while view:
                n = os.write(out_fd, view)
                view = view[n:]

        def closer() -> None:
            for f in (proc.stdin,):
                try:
                    f.close()
                except OSError:
                    pass

        return cls(reader, writer, closer, rpc_timeout=rpc_timeout, proc=proc)

    @classmethod
    def connect_unix(cls, path: str, *, rpc_timeout: Optional[float] = None,
                     connect_timeout: Optional[float] = 10.0) -> "Client":
        """Connect to ``stockade serve --listen unix:PATH``."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(connect_timeout)
        try:
            sock.connect(path)
        except BaseException:
            sock.close()
            raise
        sock.settimeout(None)

        def reader() -> bytes:
            return sock.recv(1 << 16)

        def closer() -> None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

        return cls(reader, sock.sendall, closer, rpc_timeout=rpc_timeout, sock=sock)

    # ------------------------------------------------------------------ the reader thread

    def _read_loop(self) -> None:
        unpacker = _proto.new_unpacker()
        reason = "the server closed the connection"
        try:
            while True:
                try:
                    data = self._read()
                except (OSError, ValueError) as e:
                    reason = f"read failed: {e}"
                    break
                if not data:
                    break
                unpacker.feed(data)
                for msg in unpacker:
                    self._dispatch(msg)
        except Exception as e:   # undecodable stream: nothing more can be trusted
            reason = f"undecodable stream from the server: {e}"
        finally:
            self._fail_all(reason)

    def _dispatch(self, msg: Any) -> None:
        try:
            kind, fields = _proto.classify_message(msg)
        except ProtocolError:
            return   # ignore what we do not understand; the waiter times out
        if kind == _proto.RESPONSE:
            msgid, error, result = fields
            with self._lock:
                p = self._pending.pop(msgid, None) if isinstance(msgid, int) else None
            if p is None:
                return
            p.error, p.result = error, result
            if p.chunks is not None:
                p.chunks.put(_END)
            p.event.set()
            return
        method, params = fields
        if not isinstance(params, dict):
            params = {"params": params}
        if method == "call.output":
            msgid = params.get("msgid")
            with self._lock:
                p = self._pending.get(msgid)
            if p is not None and p.chunks is not None:
                data = params.get("data")
                if isinstance(data, str):
                    data = data.encode("utf-8", "surrogateescape")
                p.chunks.put(OutputChunk(str(params.get("stream")), bytes(data or b"")))
                return
        with self._notes_cv:
            self._notes.append((method, params))
            self._notes_cv.notify_all()
        for cb in list(self._subscribers):
            try:
                cb(method, params)
            except Exception:   # a subscriber's bug must not kill the reader
                pass

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            self.closed = True
            self.close_reason = reason
            pending, self._pending = self._pending, {}
        for p in pending.values():
            p.closed_error = ConnectionClosed(reason, msgid=p.msgid)
            if p.chunks is not None:
                p.chunks.put(_END)
            p.event.set()
        with self._notes_cv:
            self._notes_cv.notify_all()

    # ------------------------------------------------------------------ requests

    def _send(self, method: str, params: Dict[str, Any], stream: bool = False) -> _Pending:
        with self._lock:
            if self.closed:
                raise ConnectionClosed(self.close_reason or "connection closed")
            msgid = self._ids.allocate(self._pending)
            p = _Pending(msgid, method, stream)
            self._pending[msgid] = p
        data = _proto.pack_request(msgid, method, params)
        try:
            with self._wlock:
                self._write(data)
        except (OSError, ValueError) as e:
            with self._lock:
                self._pending.pop(msgid, None)
            raise ConnectionClosed(f"write failed: {e}", msgid=msgid) from e
        return p

    def _wait(self, p: _Pending, timeout: Optional[float]) -> Any:
        if timeout is None:
            timeout = self.rpc_timeout
        if not p.event.wait(timeout):
            raise TimeoutError(f"no response to {p.method} (msgid {p.msgid}) within {timeout}s")
        if p.closed_error is not None:
            raise p.closed_error
        if p.error is not None:
            raise error_from_map(p.error, msgid=p.msgid)
        return p.result

    def request(self, method: str, params: Optional[Dict[str, Any]] = None, *,
                rpc_timeout: Optional[float] = None) -> Any:
        """Any method: send, wait, return the result or raise the RPC error."""
        return self._wait(self._send(method, params if params is not None else {}), rpc_timeout)

    def hello(self, client: Optional[str] = "stockade_client.py", *,
              rpc_timeout: Optional[float] = None) -> ServerInfo:
        params = {"client": client} if client is not None else {}
        return ServerInfo.from_map(self.request("hello", params, rpc_timeout=rpc_timeout))

    def open_session(self, session_id: Optional[str] = None, ttl_ms: Optional[int] = None,
                     fuse_ms: Optional[int] = None, labels: Optional[Dict[str, Any]] = None,
                     *, rpc_timeout: Optional[float] = None) -> Session:
        res = self.request("session.open", _proto.open_params(session_id, ttl_ms, fuse_ms, labels),
                           rpc_timeout=rpc_timeout)
        return Session(self, SessionInfo.from_map(res))

    def session(self, session_id: str) -> Session:
        """A Session object for an existing id (opened elsewhere, e.g. another connection)."""
        return Session(self, SessionInfo(session_id=session_id, root=None))

    def renew_session(self, session_id: str, *, rpc_timeout: Optional[float] = None) -> int:
        return self.request("session.renew", {"session_id": session_id},
                            rpc_timeout=rpc_timeout).get("expires_at_ms")

    def close_session(self, session_id: str, *, rpc_timeout: Optional[float] = None) -> Dict[str, Any]:
        return self.request("session.close", {"session_id": session_id}, rpc_timeout=rpc_timeout)

    def start_call(self, session_id: str, tool: str, argv: Optional[Sequence[str]] = None, *,
                   args: Optional[Dict[str, Any]] = None, stdin: Optional[bytes] = None,
                   timeout_ms: Optional[int] = None, deadline_ms: Optional[int] = None,
                   depth: Optional[int] = None, idempotent: Optional[bool] = None,
                   stream: bool = False, **extra: Any) -> CallHandle:
        params = _proto.call_params(session_id, tool, argv, args, stdin, timeout_ms,
                                    deadline_ms, depth, idempotent, stream, **extra)
        return CallHandle(self, self._send("call", params, stream=stream))

    def call(self, session_id: str, tool: str, argv: Optional[Sequence[str]] = None, *,
             rpc_timeout: Optional[float] = None, **kw: Any) -> CallResult:
        """Run one call and wait for its CallResult (which does not raise for a failed
        tool; see CallResult.raise_for_class). RPC-slot errors raise."""
        return self.start_call(session_id, tool, argv, **kw).result(rpc_timeout)

    def cancel(self, msgid: int, *, rpc_timeout: Optional[float] = None) -> bool:
        return bool(self.request("cancel", {"msgid": msgid}, rpc_timeout=rpc_timeout)
                    .get("cancelled"))

    def stats(self, *, rpc_timeout: Optional[float] = None) -> Dict[str, Any]:
        return self.request("stats", {}, rpc_timeout=rpc_timeout)

    def reload_policy(self, path: Optional[str] = None, *,
                      rpc_timeout: Optional[float] = None) -> Dict[str, Any]:
        return self.request("policy.reload", {"path": path} if path is not None else {},
                            rpc_timeout=rpc_timeout)

    # ------------------------------------------------------------------ notifications

    def subscribe(self, callback: Callable[[str, Dict[str, Any]], None]) -> Callable[[], None]:
        """Call ``callback(method, params)`` (on the reader thread: keep it short) for every
        notification not consumed by a streaming call handle. Returns an unsubscribe."""
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback) if callback in self._subscribers else None

    def notifications(self) -> List[Notification]:
        """The recent notifications (not the call.output ones routed to call handles)."""
        with self._notes_cv:
            return list(self._notes)

    def wait_notification(self, method: str,
                          predicate: Optional[Callable[[Dict[str, Any]], bool]] = None,
                          timeout: Optional[float] = None) -> Dict[str, Any]:
        """The params of the first kept notification ``method`` matching ``predicate``
        (already received or still to come); TimeoutError after ``timeout`` seconds."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._notes_cv:
            while True:
                for m, params in self._notes:
                    if m == method and (predicate is None or predicate(params)):
                        return params
                if self.closed:
                    raise ConnectionClosed(self.close_reason or "connection closed")
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"no {method} notification within {timeout}s")
                self._notes_cv.wait(left)

    # ------------------------------------------------------------------ shutdown

    def close(self, timeout: float = 10.0) -> Optional[int]:
        """Close the connection. For a spawned server this closes its stdin (the server
        then kills everything, removes the roots and exits) and waits up to ``timeout``
        seconds for it, killing it after that. Returns the server's exit status, if any."""
        try:
            self._closer()
        except OSError:
            pass
        rc = None
        if self.proc is not None:
            try:
                rc = self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                rc = self.proc.wait()
        self._reader.join(timeout)
        if self.sock is not None:
            self.sock.close()
        if self.proc is not None and self.proc.stdout is not None:
            try:
                self.proc.stdout.close()
            except OSError:
                pass
        return rc

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
