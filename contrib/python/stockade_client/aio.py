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

    def __init__(self, loop: asyncio.AbstractEventLoop, msgid: int, method: str, stream: bool):
        self.msgid = msgid
        self.method = method
        self.future: asyncio.Future = loop.create_future()
        self.chunks: Optional[asyncio.Queue] = asyncio.Queue() if stream else None


class AsyncCallHandle:
    def __init__(self, client: "AsyncClient", p: _Pending):
        self._client = client
        self._p = p
        self.msgid = p.msgid

    def done(self) -> bool:
        return self._p.future.done()

    async def result(self, timeout: Optional[float] = None) -> CallResult:
        raw = await self._client._wait(self._p, timeout)
        return CallResult.from_map(raw, msgid=self.msgid)

    async def output(self, timeout: Optional[float] = None) -> AsyncIterator[OutputChunk]:
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
        return await self._client.cancel(self.msgid, rpc_timeout=timeout)


class AsyncSession:
    def __init__(self, client: "AsyncClient", info: SessionInfo):
        self.client = client
        self.info = info
        self.session_id = info.session_id
        self.root = info.root
        self.expires_at_ms = info.expires_at_ms
        self.fuse_at_ms = info.fuse_at_ms
        self.closed = False

    async def call(self, tool: str, argv: Optional[Sequence[str]] = None, **kw: Any) -> CallResult:
        return await self.client.call(self.session_id, tool, argv, **kw)

    async def start_call(self, tool: str, argv: Optional[Sequence[str]] = None,
                         **kw: Any) -> AsyncCallHandle:
        return await self.client.start_call(self.session_id, tool, argv, **kw)

    def stream_call(self, tool: str, argv: Optional[Sequence[str]] = None,
                    **kw: Any) -> AsyncIterator[Union[OutputChunk, CallResult]]:
        return self.client.stream_call(self.session_id, tool, argv, **kw)

    async def renew(self, rpc_timeout: Optional[float] = None) -> int:
        self.expires_at_ms = await self.client.renew_session(self.session_id,
                                                             rpc_timeout=rpc_timeout)
        return self.expires_at_ms

    async def close(self, rpc_timeout: Optional[float] = None) -> Dict[str, Any]:
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
        self._pending: Dict[int, _Pending] = {}
        self._ids = _proto.MsgidAllocator()
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
        kw.setdefault("stdin", subprocess.PIPE)
        kw.setdefault("stdout", subprocess.PIPE)
        proc = await asyncio.create_subprocess_exec(*argv, **kw)
        return cls(proc.stdout, proc.stdin, proc=proc, rpc_timeout=rpc_timeout)

    @classmethod
    async def connect_unix(cls, path: str, *, rpc_timeout: Optional[float] = None
                           ) -> "AsyncClient":
        reader, writer = await asyncio.open_unix_connection(path)
        return cls(reader, writer, rpc_timeout=rpc_timeout)

    # ------------------------------------------------------------------ reader

    async def _read_loop(self) -> None:
        unpacker = _proto.new_unpacker()
        reason = "the server closed the connection"
        try:
            while True:
                data = await self._reader.read(1 << 16)
                if not data:
                    break
                unpacker.feed(data)
                for msg in unpacker:
                    await self._dispatch(msg)
        except asyncio.CancelledError:
            reason = "client closed"
        except Exception as e:
            reason = f"connection failed: {e}"
        finally:
            await self._fail_all(reason)

    async def _dispatch(self, msg: Any) -> None:
        try:
            kind, fields = _proto.classify_message(msg)
        except ProtocolError:
            return
        if kind == _proto.RESPONSE:
            msgid, error, result = fields
            p = self._pending.pop(msgid, None) if isinstance(msgid, int) else None
            if p is None:
                return
            if p.chunks is not None:
                p.chunks.put_nowait(_END)
            if not p.future.done():
                p.future.set_result((error, result))
            return
        method, params = fields
        if not isinstance(params, dict):
            params = {"params": params}
        if method == "call.output":
            p = self._pending.get(params.get("msgid"))
            if p is not None and p.chunks is not None:
                data = params.get("data")
                if isinstance(data, str):
                    data = data.encode("utf-8", "surrogateescape")
                p.chunks.put_nowait(OutputChunk(str(params.get("stream")), bytes(data or b"")))
                return
        async with self._notes_changed:
            self._notes.append((method, params))
            self._notes_changed.notify_all()
        for cb in list(self._subscribers):
            try:
                r = cb(method, params)
                if asyncio.iscoroutine(r):
                    await r
            except Exception:
                pass

    async def _fail_all(self, reason: str) -> None:
        self.closed = True
        self.close_reason = reason
        pending, self._pending = self._pending, {}
        for p in pending.values():
            if p.chunks is not None:
                p.chunks.put_nowait(_END)
            if not p.future.done():
                p.future.set_exception(ConnectionClosed(reason, msgid=p.msgid))
        async with self._notes_changed:
            self._notes_changed.notify_all()

    # ------------------------------------------------------------------ requests

    async def _send(self, method: str, params: Dict[str, Any], stream: bool = False) -> _Pending:
        if self.closed:
            raise ConnectionClosed(self.close_reason or "connection closed")
        msgid = self._ids.allocate(self._pending)
        p = _Pending(self._loop, msgid, method, stream)
        self._pending[msgid] = p
        try:
            async with self._wlock:
                self._writer.write(_proto.pack_request(msgid, method, params))
                await self._writer.drain()
        except (OSError, RuntimeError) as e:
            self._pending.pop(msgid, None)
            raise ConnectionClosed(f"write failed: {e}", msgid=msgid) from e
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
        return await self._wait(await self._send(method, params if params is not None else {}),
                                rpc_timeout)

    async def hello(self, client: Optional[str] = "stockade_client.aio", *,
                    rpc_timeout: Optional[float] = None) -> ServerInfo:
        params = {"client": client} if client is not None else {}
        return ServerInfo.from_map(await self.request("hello", params, rpc_timeout=rpc_timeout))

    async def open_session(self, session_id: Optional[str] = None, ttl_ms: Optional[int] = None,
                           fuse_ms: Optional[int] = None, labels: Optional[Dict[str, Any]] = None,
                           *, rpc_timeout: Optional[float] = None) -> AsyncSession:
        res = await self.request("session.open",
                                 _proto.open_params(session_id, ttl_ms, fuse_ms, labels),
                                 rpc_timeout=rpc_timeout)
        return AsyncSession(self, SessionInfo.from_map(res))

    def session(self, session_id: str) -> AsyncSession:
        return AsyncSession(self, SessionInfo(session_id=session_id, root=None))

    async def renew_session(self, session_id: str, *, rpc_timeout: Optional[float] = None) -> int:
        res = await self.request("session.renew", {"session_id": session_id},
                                 rpc_timeout=rpc_timeout)
        return res.get("expires_at_ms")

    async def close_session(self, session_id: str, *,
                            rpc_timeout: Optional[float] = None) -> Dict[str, Any]:
        return await self.request("session.close", {"session_id": session_id},
                                  rpc_timeout=rpc_timeout)

    async def start_call(self, session_id: str, tool: str, argv: Optional[Sequence[str]] = None,
                         *, args: Optional[Dict[str, Any]] = None, stdin: Optional[bytes] = None,
                         timeout_ms: Optional[int] = None, deadline_ms: Optional[int] = None,
                         depth: Optional[int] = None, idempotent: Optional[bool] = None,
                         stream: bool = False, **extra: Any) -> AsyncCallHandle:
        params = _proto.call_params(session_id, tool, argv, args, stdin, timeout_ms,
                                    deadline_ms, depth, idempotent, stream, **extra)
        return AsyncCallHandle(self, await self._send("call", params, stream=stream))

    async def call(self, session_id: str, tool: str, argv: Optional[Sequence[str]] = None, *,
                   rpc_timeout: Optional[float] = None, **kw: Any) -> CallResult:
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
        res = await self.request("cancel", {"msgid": msgid}, rpc_timeout=rpc_timeout)
        return bool(res.get("cancelled"))

    async def stats(self, *, rpc_timeout: Optional[float] = None) -> Dict[str, Any]:
        return await self.request("stats", {}, rpc_timeout=rpc_timeout)

    async def reload_policy(self, path: Optional[str] = None, *,
                            rpc_timeout: Optional[float] = None) -> Dict[str, Any]:
        return await self.request("policy.reload", {"path": path} if path is not None else {},
                                  rpc_timeout=rpc_timeout)

    # ------------------------------------------------------------------ notifications

    def subscribe(self, callback: Callable[[str, Dict[str, Any]], Any]) -> Callable[[], None]:
        """``callback(method, params)`` (plain or coroutine function) for each notification
        not consumed by a streaming call. Returns an unsubscribe function."""
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback) if callback in self._subscribers else None

    def notifications(self) -> List:
        return list(self._notes)

    async def wait_notification(self, method: str,
                                predicate: Optional[Callable[[Dict[str, Any]], bool]] = None,
                                timeout: Optional[float] = None) -> Dict[str, Any]:
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
