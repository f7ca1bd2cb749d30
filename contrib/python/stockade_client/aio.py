"""asyncio client of ``stockade serve`` — the same API as :mod:`stockade_client.client`,
as coroutines::

    async with await AsyncClient.spawn(["stockade", "serve", "--policy", P]) as c:
        async with await c.open_session() as s:
            r = await s.call("echo", ["hi"])
            async for item in s.stream_call("sh", ["-c", "echo a; echo b >&2"]):
                if isinstance(item, OutputChunk): print(item.stream, item.data)
                else: print("result", item.class_)
"""

from __future__ import annotations

import asyncio
import collections
import subprocess
from typing import Any, AsyncIterator, Callable, Deque, Dict, List, Optional, Sequence, Union

from . import _proto
from .errors import ConnectionClosed, NoSuchSession, ProtocolError, error_from_map
from .types import CallResult, OutputChunk, ServerInfo, SessionInfo

__all__ = ["AsyncClient", "AsyncSession", "AsyncCallHandle"]

_END = object()


class _Pending:
    __slots__ = ("msgid", "method", "future", "chunks")

    def __init__(self, loop: asyncio.AbstractEventLoop, msgid: int, method: str,
                 stream: bool) -> None:
        self.msgid = msgid
        self.method = method
        self.future: asyncio.Future = loop.create_future()
        self.chunks: Optional[asyncio.Queue] = asyncio.Queue() if stream else None


class AsyncCallHandle:
    """A call in flight (see stockade_client.client.CallHandle)."""

    def __init__(self, client: "AsyncClient", p: _Pending) -> None:
        self._client = client
        self._p = p
        self.msgid = p.msgid

    def done(self) -> bool:
        """Whether the response has arrived (or the connection ended)."""
        return self._p.future.done()

    async def result(self, timeout: Optional[float] = None) -> CallResult:
        """The call's CallResult; TimeoutError after ``timeout`` seconds (the call goes
        on), the StockadeError of the RPC error slot, ConnectionClosed or ProtocolError."""
        raw = await self._client._wait(self._p, timeout)
        return CallResult.from_map(raw, msgid=self.msgid)

    async def output(self, timeout: Optional[float] = None) -> AsyncIterator[OutputChunk]:
        """Chunks of a ``stream=True`` call until it is answered; ``timeout`` bounds the
        wait for each next chunk."""
        q = self._p.chunks
        if q is None:
            return
        while True:
            try:
                item = await asyncio.wait_for(q.get(), timeout)
            except asyncio.TimeoutError:
                raise TimeoutError(f"no output from call {self.msgid} within {timeout}s") from None
            if item is _END:
                q.put_nowait(_END)
                return
            yield item

    async def cancel(self, timeout: Optional[float] = None) -> bool:
        """Ask the server to cancel this call; it still answers (class CANCELLED)."""
        return await self._client.cancel(self.msgid, rpc_timeout=timeout)


class AsyncSession:
    """A session (see stockade_client.client.Session); ``async with`` closes it."""

    def __init__(self, client: "AsyncClient", info: SessionInfo) -> None:
        self.client = client
        self.info = info
        self.session_id = info.session_id
        self.root = info.root
        self.expires_at_ms = info.expires_at_ms
        self.fuse_at_ms = info.fuse_at_ms
        self.closed = False

    async def call(self, tool: str, argv: Optional[Sequence[str]] = None, **kw: Any) -> CallResult:
        """Run ``tool`` in this session and wait for its CallResult."""
        return await self.client.call(self.session_id, tool, argv, **kw)

    async def start_call(self, tool: str, argv: Optional[Sequence[str]] = None,
                         **kw: Any) -> AsyncCallHandle:
        """Start ``tool`` in this session; returns its AsyncCallHandle."""
        return await self.client.start_call(self.session_id, tool, argv, **kw)

    def stream_call(self, tool: str, argv: Optional[Sequence[str]] = None,
                    **kw: Any) -> AsyncIterator[Union[OutputChunk, CallResult]]:
        """OutputChunks as the tool writes, then its CallResult."""
        return self.client.stream_call(self.session_id, tool, argv, **kw)

    async def renew(self, rpc_timeout: Optional[float] = None) -> int:
        """Touch the lease; returns the new ``expires_at_ms``."""
        self.expires_at_ms = await self.client.renew_session(self.session_id,
                                                             rpc_timeout=rpc_timeout)
        return self.expires_at_ms

    async def close(self, rpc_timeout: Optional[float] = None) -> Dict[str, Any]:
        """Kill the session's calls and remove its root: ``{removed, calls_killed}``."""
        res = await self.client.close_session(self.session_id, rpc_timeout=rpc_timeout)
        self.closed = True
        return res

    async def __aenter__(self) -> "AsyncSession":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if not self.closed and not self.client.closed:
            try:
                await self.close()
            except (NoSuchSession, ConnectionClosed):
                pass


class AsyncClient:
    """One connection to ``stockade serve`` on an asyncio loop. Construct with
    ``await AsyncClient.spawn(argv)`` or ``await AsyncClient.connect_unix(path)``."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                 proc: Optional[asyncio.subprocess.Process] = None,
                 rpc_timeout: Optional[float] = None, keep_notifications: int = 1000):
        self._reader = reader
        self._writer = writer
        self.proc = proc
        self.rpc_timeout = rpc_timeout
        self._loop = asyncio.get_running_loop()
        self._core: _proto.Core[_Pending] = _proto.Core()
        self._wlock = asyncio.Lock()
        self._subscribers: List[Callable[[str, Dict[str, Any]], Any]] = []
        self._notes: Deque = collections.deque(maxlen=keep_notifications)
        self._notes_changed = asyncio.Condition()
        self.closed = False
        self.close_reason: Optional[str] = None
        self._task = self._loop.create_task(self._read_loop())

    @classmethod
    async def spawn(cls, argv: Sequence[str], *, rpc_timeout: Optional[float] = None,
                    **kw: Any) -> "AsyncClient":
        """Start ``argv`` with pipes on its stdin/stdout (``kw`` to create_subprocess_exec)."""
        kw.setdefault("stdin", subprocess.PIPE)
        kw.setdefault("stdout", subprocess.PIPE)
        proc = await asyncio.create_subprocess_exec(*argv, **kw)
        return cls(proc.stdout, proc.stdin, proc=proc, rpc_timeout=rpc_timeout)

    @classmethod
    async def connect_unix(cls, path: str, *, rpc_timeout: Optional[float] = None
                           ) -> "AsyncClient":
        """Connect to ``stockade serve --listen unix:PATH``."""
        reader, writer = await asyncio.open_unix_connection(path)
        return cls(reader, writer, rpc_timeout=rpc_timeout)

    # ------------------------------------------------------------------ reader

    async def _read_loop(self) -> None:
        reason = "the server closed the connection"
        error_type: type = ConnectionClosed
        try:
            while True:
                data = await self._reader.read(1 << 16)
                if not data:
                    break
                for ev in self._core.feed(data):
                    await self._dispatch(ev)
        except asyncio.CancelledError:
            reason = "client closed"
        except ProtocolError as e:   # nothing more on this stream can be trusted
            for ev in getattr(e, "events", ()):
                await self._dispatch(ev)
            reason, error_type = str(e), ProtocolError
            self._writer.close()
        except Exception as e:
            reason = f"connection failed: {e}"
        finally:
            await self._fail_all(reason, error_type)

    async def _dispatch(self, ev: "_proto.Event") -> None:
        if isinstance(ev, _proto.Response):
            p = ev.pending
            if p.chunks is not None:
                p.chunks.put_nowait(_END)
            if not p.future.done():
                p.future.set_result((ev.error, ev.result))
            return
        if isinstance(ev, _proto.Output):
            ev.pending.chunks.put_nowait(ev.chunk)
            return
        async with self._notes_changed:
            self._notes.append((ev.method, ev.params))
            self._notes_changed.notify_all()
        for cb in list(self._subscribers):
            try:
                r = cb(ev.method, ev.params)
                if asyncio.iscoroutine(r):
                    await r
            except Exception:
                pass

    async def _fail_all(self, reason: str, error_type: type = ConnectionClosed) -> None:
        self.closed = True
        self.close_reason = reason
        for p in self._core.take_all():
            if p.chunks is not None:
                p.chunks.put_nowait(_END)
            if not p.future.done():
                p.future.set_exception(error_type(reason, msgid=p.msgid))
        async with self._notes_changed:
            self._notes_changed.notify_all()

    # ------------------------------------------------------------------ requests

    async def _send(self, method: str, params: Optional[Dict[str, Any]],
                    stream: bool = False) -> _Pending:
        if self.closed:
            raise ConnectionClosed(self.close_reason or "connection closed")
        p, data = self._core.request(method, params,
                                     lambda msgid: _Pending(self._loop, msgid, method, stream),
                                     stream)
        try:
            async with self._wlock:
                self._writer.write(data)
                await self._writer.drain()
        except (OSError, RuntimeError) as e:
            self._core.forget(p.msgid)
            raise ConnectionClosed(f"write failed: {e}", msgid=p.msgid) from e
        return p

    async def _wait(self, p: _Pending, timeout: Optional[float]) -> Any:
        if timeout is None:
            timeout = self.rpc_timeout
        try:
            error, result = await asyncio.wait_for(asyncio.shield(p.future), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no response to {p.method} (msgid {p.msgid}) within {timeout}s") from None
        if error is not None:
            raise error_from_map(error, msgid=p.msgid)
        return result

    async def request(self, method: str, params: Optional[Dict[str, Any]] = None, *,
                      rpc_timeout: Optional[float] = None) -> Any:
        """Any method: send ``[params]`` (``[]`` when None or empty), wait, return the
        result or raise the RPC error."""
        return await self._wait(await self._send(method, params), rpc_timeout)

    async def hello(self, client: Optional[str] = "stockade_client.aio", *,
                    rpc_timeout: Optional[float] = None) -> ServerInfo:
        """The server's facts: protocol, version, policy, isolation, limits."""
        params = {"client": client} if client is not None else {}
        return ServerInfo.from_map(await self.request("hello", params, rpc_timeout=rpc_timeout))

    async def open_session(self, session_id: Optional[str] = None, ttl_ms: Optional[int] = None,
                           fuse_ms: Optional[int] = None, labels: Optional[Dict[str, Any]] = None,
                           *, rpc_timeout: Optional[float] = None) -> AsyncSession:
        """Open a session (or reattach to ``session_id``)."""
        res = await self.request("session.open",
                                 _proto.open_params(session_id, ttl_ms, fuse_ms, labels),
                                 rpc_timeout=rpc_timeout)
        return AsyncSession(self, SessionInfo.from_map(res))

    def session(self, session_id: str) -> AsyncSession:
        """An AsyncSession object for an existing id."""
        return AsyncSession(self, SessionInfo(session_id=session_id, root=None))

    async def renew_session(self, session_id: str, *, rpc_timeout: Optional[float] = None) -> int:
        """Touch a session's lease; returns the new ``expires_at_ms``."""
        res = await self.request("session.renew", {"session_id": session_id},
                                 rpc_timeout=rpc_timeout)
        return res.get("expires_at_ms")

    async def close_session(self, session_id: str, *,
                            rpc_timeout: Optional[float] = None) -> Dict[str, Any]:
        """``{removed, calls_killed}``; idempotent for a session that already ended."""
        return await self.request("session.close", {"session_id": session_id},
                                  rpc_timeout=rpc_timeout)

    async def start_call(self, session_id: str, tool: str, argv: Optional[Sequence[str]] = None,
                         *, args: Optional[Dict[str, Any]] = None, stdin: Optional[bytes] = None,
                         timeout_ms: Optional[int] = None, deadline_ms: Optional[int] = None,
                         depth: Optional[int] = None, idempotent: Optional[bool] = None,
                         stream: bool = False, **extra: Any) -> AsyncCallHandle:
        """Send a ``call`` and return its AsyncCallHandle at once."""
        params = _proto.call_params(session_id, tool, argv, args, stdin, timeout_ms,
                                    deadline_ms, depth, idempotent, stream, **extra)
        return AsyncCallHandle(self, await self._send("call", params, stream=stream))

    async def call(self, session_id: str, tool: str, argv: Optional[Sequence[str]] = None, *,
                   rpc_timeout: Optional[float] = None, **kw: Any) -> CallResult:
        """Run one call and wait for its CallResult (RPC-slot errors raise)."""
        h = await self.start_call(session_id, tool, argv, **kw)
        return await h.result(rpc_timeout)

    async def stream_call(self, session_id: str, tool: str, argv: Optional[Sequence[str]] = None,
                          *, rpc_timeout: Optional[float] = None, **kw: Any
                          ) -> AsyncIterator[Union[OutputChunk, CallResult]]:
        """Yields OutputChunk(stream, data) as the tool writes, then the CallResult last."""
        kw["stream"] = True
        h = await self.start_call(session_id, tool, argv, **kw)
        async for chunk in h.output(rpc_timeout):
            yield chunk
        yield await h.result(rpc_timeout)

    async def cancel(self, msgid: int, *, rpc_timeout: Optional[float] = None) -> bool:
        """Cancel the call sent with ``msgid``; True if it was running."""
        res = await self.request("cancel", {"msgid": msgid}, rpc_timeout=rpc_timeout)
        return bool(res.get("cancelled"))

    async def stats(self, *, rpc_timeout: Optional[float] = None) -> Dict[str, Any]:
        """The server's counters (PROTOCOL.md, "stats")."""
        return await self.request("stats", None, rpc_timeout=rpc_timeout)

    async def reload_policy(self, *, rpc_timeout: Optional[float] = None) -> Dict[str, Any]:
        """Re-read the server's own policy file (admin peers only)."""
        return await self.request("policy.reload", None, rpc_timeout=rpc_timeout)

    # ------------------------------------------------------------------ notifications

    def subscribe(self, callback: Callable[[str, Dict[str, Any]], Any]) -> Callable[[], None]:
        """``callback(method, params)`` (plain or coroutine function) for each notification
        not consumed by a streaming call. Returns an unsubscribe function."""
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback) if callback in self._subscribers else None

    def notifications(self) -> List:
        """The recent notifications not routed to a streaming call."""
        return list(self._notes)

    async def wait_notification(self, method: str,
                                predicate: Optional[Callable[[Dict[str, Any]], bool]] = None,
                                timeout: Optional[float] = None) -> Dict[str, Any]:
        """The params of the first notification ``method`` matching ``predicate``."""
        async def _find() -> Dict[str, Any]:
            async with self._notes_changed:
                while True:
                    for m, params in self._notes:
                        if m == method and (predicate is None or predicate(params)):
                            return params
                    if self.closed:
                        raise ConnectionClosed(self.close_reason or "connection closed")
                    await self._notes_changed.wait()
        try:
            return await asyncio.wait_for(_find(), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no {method} notification within {timeout}s") from None

    # ------------------------------------------------------------------ shutdown

    async def close(self, timeout: float = 10.0) -> Optional[int]:
        """Close the connection (for a spawned server: its stdin, then wait for its exit,
        killing it after ``timeout`` seconds). Returns the server's exit status, if any."""
        try:
            self._writer.close()
            await asyncio.wait_for(self._writer.wait_closed(), timeout)
        except (OSError, asyncio.TimeoutError, RuntimeError):
            pass
        rc = None
        if self.proc is not None:
            try:
                rc = await asyncio.wait_for(self.proc.wait(), timeout)
            except asyncio.TimeoutError:
                self.proc.kill()
                rc = await self.proc.wait()
        try:
            await asyncio.wait_for(self._task, timeout)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            self._task.cancel()
        return rc

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
