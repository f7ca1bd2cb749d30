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
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from . import _proto
from .errors import ConnectionClosed, NoSuchSession, ProtocolError, error_from_map
from .types import CallResult, OutputChunk, ServerInfo, SessionInfo

__all__ = ["Client", "Session", "CallHandle", "Notification"]

Notification = Tuple[str, Dict[str, Any]]   # (method, params)

_END = object()


class _Pending:
    __slots__ = ("msgid", "method", "event", "error", "result", "closed_error", "chunks",
                 "stream")

    def __init__(self, msgid: int, method: str, stream: bool = False) -> None:
        self.msgid = msgid
        self.method = method
        self.event = threading.Event()
        self.error: Any = None
        self.result: Any = None
        self.closed_error: Optional[Exception] = None   # ConnectionClosed or ProtocolError
        self.stream = stream
        self.chunks: "Optional[queue.Queue]" = queue.Queue() if stream else None


class CallHandle:
    """A call in flight. ``result(timeout)`` waits for its CallResult; for ``stream=True``
    calls ``output()`` yields OutputChunk(stream, data) as the tool writes, and ends when
    the response has arrived."""

    def __init__(self, client: "Client", pending: _Pending) -> None:
        self._client = client
        self._p = pending
        self.msgid = pending.msgid

    def done(self) -> bool:
        """Whether the response has arrived (or the connection ended)."""
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

    def __init__(self, client: "Client", info: SessionInfo) -> None:
        self.client = client
        self.info = info
        self.session_id = info.session_id
        self.root = info.root
        self.expires_at_ms = info.expires_at_ms
        self.fuse_at_ms = info.fuse_at_ms
        self.closed = False

    def call(self, tool: str, argv: Optional[Sequence[str]] = None, **kw: Any) -> CallResult:
        """Run ``tool`` in this session and wait for its CallResult (see Client.call)."""
        return self.client.call(self.session_id, tool, argv, **kw)

    def start_call(self, tool: str, argv: Optional[Sequence[str]] = None, **kw: Any) -> CallHandle:
        """Start ``tool`` in this session; returns its CallHandle (see Client.start_call)."""
        return self.client.start_call(self.session_id, tool, argv, **kw)

    def stream_call(self, tool: str, argv: Optional[Sequence[str]] = None,
                    **kw: Any) -> Iterator[Union[OutputChunk, CallResult]]:
        """OutputChunks as the tool writes, then its CallResult (see Client.stream_call)."""
        return self.client.stream_call(self.session_id, tool, argv, **kw)

    def renew(self, rpc_timeout: Optional[float] = None) -> int:
        """Touch the lease; returns the new ``expires_at_ms``."""
        self.expires_at_ms = self.client.renew_session(self.session_id, rpc_timeout=rpc_timeout)
        return self.expires_at_ms

    def close(self, rpc_timeout: Optional[float] = None) -> Dict[str, Any]:
        """Kill the session's calls and remove its root: ``{removed, calls_killed}``.
        Closing it again answers ``{removed: False, calls_killed: 0}``."""
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
        self._lock = threading.Lock()          # the core's pending map and msgids
        self._wlock = threading.Lock()         # one message on the wire at a time
        self._core: _proto.Core[_Pending] = _proto.Core()
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
        reason = "the server closed the connection"
        error_type: type = ConnectionClosed
        try:
            while True:
                try:
                    data = self._read()
                except (OSError, ValueError) as e:
                    reason = f"read failed: {e}"
                    break
                if not data:
                    break
                with self._lock:
                    events = self._core.feed(data)
                for ev in events:
                    self._dispatch(ev)
        except ProtocolError as e:   # nothing more on this stream can be trusted
            for ev in getattr(e, "events", ()):
                self._dispatch(ev)
            reason, error_type = str(e), ProtocolError
            self._closer()
        finally:
            self._fail_all(reason, error_type)

    def _dispatch(self, ev: "_proto.Event") -> None:
        if isinstance(ev, _proto.Response):
            p = ev.pending
            p.error, p.result = ev.error, ev.result
            if p.chunks is not None:
                p.chunks.put(_END)
            p.event.set()
            return
        if isinstance(ev, _proto.Output):
            ev.pending.chunks.put(ev.chunk)
            return
        with self._notes_cv:
            self._notes.append((ev.method, ev.params))
            self._notes_cv.notify_all()
        for cb in list(self._subscribers):
            try:
                cb(ev.method, ev.params)
            except Exception:   # a subscriber's bug must not kill the reader
                pass

    def _fail_all(self, reason: str, error_type: type = ConnectionClosed) -> None:
        with self._lock:
            self.closed = True
            self.close_reason = reason
            pending = self._core.take_all()
        for p in pending:
            p.closed_error = error_type(reason, msgid=p.msgid)
            if p.chunks is not None:
                p.chunks.put(_END)
            p.event.set()
        with self._notes_cv:
            self._notes_cv.notify_all()

    # ------------------------------------------------------------------ requests

    def _send(self, method: str, params: Optional[Dict[str, Any]], stream: bool = False) -> _Pending:
        with self._lock:
            if self.closed:
                raise ConnectionClosed(self.close_reason or "connection closed")
            p, data = self._core.request(method, params,
                                         lambda msgid: _Pending(msgid, method, stream), stream)
        try:
            with self._wlock:
                self._write(data)
        except (OSError, ValueError) as e:
            with self._lock:
                self._core.forget(p.msgid)
            raise ConnectionClosed(f"write failed: {e}", msgid=p.msgid) from e
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
        """Any method: send ``[params]`` (``[]`` when None or empty), wait, return the
        result or raise the RPC error (a StockadeError subclass)."""
        return self._wait(self._send(method, params), rpc_timeout)

    def hello(self, client: Optional[str] = "stockade_client.py", *,
              rpc_timeout: Optional[float] = None) -> ServerInfo:
        """The server's facts: protocol, version, policy, isolation, limits."""
        params = {"client": client} if client is not None else {}
        return ServerInfo.from_map(self.request("hello", params, rpc_timeout=rpc_timeout))

    def open_session(self, session_id: Optional[str] = None, ttl_ms: Optional[int] = None,
                     fuse_ms: Optional[int] = None, labels: Optional[Dict[str, Any]] = None,
                     *, rpc_timeout: Optional[float] = None) -> Session:
        """Open a session (or reattach to ``session_id``); a context manager that closes
        it on exit. ``labels`` (str to str) appear in the server's logs and stats."""
        res = self.request("session.open", _proto.open_params(session_id, ttl_ms, fuse_ms, labels),
                           rpc_timeout=rpc_timeout)
        return Session(self, SessionInfo.from_map(res))

    def session(self, session_id: str) -> Session:
        """A Session object for an existing id (opened elsewhere, e.g. another connection)."""
        return Session(self, SessionInfo(session_id=session_id, root=None))

    def renew_session(self, session_id: str, *, rpc_timeout: Optional[float] = None) -> int:
        """Touch a session's lease; returns the new ``expires_at_ms``."""
        return self.request("session.renew", {"session_id": session_id},
                            rpc_timeout=rpc_timeout).get("expires_at_ms")

    def close_session(self, session_id: str, *, rpc_timeout: Optional[float] = None) -> Dict[str, Any]:
        """``{removed, calls_killed}``; idempotent for a session that already ended."""
        return self.request("session.close", {"session_id": session_id}, rpc_timeout=rpc_timeout)

    def start_call(self, session_id: str, tool: str, argv: Optional[Sequence[str]] = None, *,
                   args: Optional[Dict[str, Any]] = None, stdin: Optional[bytes] = None,
                   timeout_ms: Optional[int] = None, deadline_ms: Optional[int] = None,
                   depth: Optional[int] = None, idempotent: Optional[bool] = None,
                   stream: bool = False, **extra: Any) -> CallHandle:
        """Send a ``call`` and return its CallHandle at once (PROTOCOL.md, "call", for the
        parameters; ``env=`` is passed through ``extra``)."""
        params = _proto.call_params(session_id, tool, argv, args, stdin, timeout_ms,
                                    deadline_ms, depth, idempotent, stream, **extra)
        return CallHandle(self, self._send("call", params, stream=stream))

    def call(self, session_id: str, tool: str, argv: Optional[Sequence[str]] = None, *,
             rpc_timeout: Optional[float] = None, **kw: Any) -> CallResult:
        """Run one call and wait for its CallResult (which does not raise for a failed
        tool; see CallResult.raise_for_class). RPC-slot errors raise."""
        return self.start_call(session_id, tool, argv, **kw).result(rpc_timeout)

    def stream_call(self, session_id: str, tool: str, argv: Optional[Sequence[str]] = None,
                    *, rpc_timeout: Optional[float] = None, **kw: Any
                    ) -> Iterator[Union[OutputChunk, CallResult]]:
        """Yields OutputChunk(stream, data) as the tool writes, then the CallResult last."""
        kw["stream"] = True
        h = self.start_call(session_id, tool, argv, **kw)
        for chunk in h.output(rpc_timeout):
            yield chunk
        yield h.result(rpc_timeout)

    def cancel(self, msgid: int, *, rpc_timeout: Optional[float] = None) -> bool:
        """Cancel the call sent with ``msgid``; True if it was running."""
        return bool(self.request("cancel", {"msgid": msgid}, rpc_timeout=rpc_timeout)
                    .get("cancelled"))

    def stats(self, *, rpc_timeout: Optional[float] = None) -> Dict[str, Any]:
        """The server's counters (PROTOCOL.md, "stats")."""
        return self.request("stats", None, rpc_timeout=rpc_timeout)

    def reload_policy(self, *, rpc_timeout: Optional[float] = None) -> Dict[str, Any]:
        """Re-read the server's own policy file (admin peers only): ``{generation, sha256}``."""
        return self.request("policy.reload", None, rpc_timeout=rpc_timeout)

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
