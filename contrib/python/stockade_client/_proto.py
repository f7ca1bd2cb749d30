"""The sans-I/O core shared by the sync and the asyncio client: framing, msgid allocation,
routing of what the server sends, and parameter building. No threads, no sockets, no
event loop: the clients feed it bytes and act on the events it returns.

Protocol 2 (PROTOCOL.md): requests are ``[0, msgid, method, [params]]`` (``[]`` for no
argument), responses ``[1, msgid, error, result]``, notifications ``[2, method, [map]]``.
"""

from __future__ import annotations

from typing import (Any, Callable, Dict, Generic, List, NamedTuple, Optional, Sequence,
                    Tuple, TypeVar, Union)

import msgpack

from .errors import ProtocolError
from .types import OutputChunk

REQUEST, RESPONSE, NOTIFICATION = 0, 1, 2
MSGID_MAX = 0xFFFFFFFF
PROTOCOL_VERSION = 2

P = TypeVar("P")


class Response(NamedTuple):
    """The answer to a request this core sent: ``pending`` is what the client registered."""
    pending: Any
    error: Any
    result: Any


class Output(NamedTuple):
    """A ``call.output`` chunk of a streaming call this core sent."""
    pending: Any
    chunk: OutputChunk


class Notification(NamedTuple):
    """Any other notification (``session.expired``, ``alarm``, ...): its one map argument."""
    method: str
    params: Dict[str, Any]


Event = Union[Response, Output, Notification]


def pack(obj: Any) -> bytes:
    """msgpack with str as str and bytes as bin, as the server expects."""
    return msgpack.packb(obj, use_bin_type=True)


def pack_request(msgid: int, method: str, params: Optional[Dict[str, Any]]) -> bytes:
    """A protocol-2 request: the one map argument in an array, or no argument at all."""
    return pack([REQUEST, msgid, method, [params] if params else []])


def new_unpacker(max_buffer_size: int = 0) -> msgpack.Unpacker:
    """str -> Python str, bin -> bytes (process output stays bytes)."""
    return msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max_buffer_size)


def _decode_notification_args(method: Any, args: Any) -> Notification:
    if not isinstance(method, str):
        raise ProtocolError(f"notification method is not a string: {method!r:.200}")
    # protocol 2: [map]; a bare map (a protocol-1 server) is taken as it is
    if isinstance(args, (list, tuple)) and len(args) == 1 and isinstance(args[0], dict):
        return Notification(method, args[0])
    if isinstance(args, dict):
        return Notification(method, args)
    raise ProtocolError(f"notification {method} arguments are not [map]: {args!r:.200}")


class MsgidAllocator:
    """uint32 msgids, wrapping around, never one still in flight."""

    def __init__(self) -> None:
        self._next = 1

    def allocate(self, in_flight: Any) -> int:
        """The next msgid not in ``in_flight`` (a container of msgids)."""
        for _ in range(1 << 20):
            msgid = self._next
            self._next = 1 if self._next >= MSGID_MAX else self._next + 1
            if msgid not in in_flight:
                return msgid
        raise RuntimeError("no free msgid")  # > a million requests in flight


class Core(Generic[P]):
    """The protocol state of one connection, without I/O.

    ``request()`` allocates a msgid, registers the client's pending object for it and
    returns the bytes to write; ``feed()`` takes bytes read and returns events, each
    carrying the pending object it concerns. Anything that is not a protocol-2 message
    raises :class:`ProtocolError`: the stream cannot be trusted after that, and the
    client fails every pending request with it rather than let them wait out their
    timeouts."""

    def __init__(self, max_buffer_size: int = 0) -> None:
        self._unpacker = new_unpacker(max_buffer_size)
        self._ids = MsgidAllocator()
        self._pending: Dict[int, P] = {}
        self._streams: Dict[int, bool] = {}

    def request(self, method: str, params: Optional[Dict[str, Any]],
                make_pending: Callable[[int], P], stream: bool = False) -> Tuple[P, bytes]:
        """Register a request; returns (pending, bytes to write)."""
        msgid = self._ids.allocate(self._pending)
        p = make_pending(msgid)
        self._pending[msgid] = p
        self._streams[msgid] = stream
        return p, pack_request(msgid, method, params)

    def forget(self, msgid: int) -> None:
        """Drop a request whose bytes could not be written."""
        self._pending.pop(msgid, None)
        self._streams.pop(msgid, None)

    def in_flight(self) -> int:
        """How many requests wait for their response."""
        return len(self._pending)

    def take_all(self) -> List[P]:
        """Every pending request, now forgotten (the connection is over)."""
        pending = list(self._pending.values())
        self._pending.clear()
        self._streams.clear()
        return pending

    def feed(self, data: bytes) -> List[Event]:
        """Bytes from the server -> events. Raises ProtocolError on what is not
        MessagePack-RPC as PROTOCOL.md defines it; its ``events`` attribute holds the
        events decoded before it (deliver them, then fail what is still pending)."""
        events: List[Event] = []
        try:
            self._unpacker.feed(data)
            for msg in self._unpacker:
                ev = self._route(msg)
                if ev is not None:
                    events.append(ev)
        except ProtocolError as e:
            e.events = events
            raise
        except Exception as e:   # msgpack's own errors: not msgpack at all
            err = ProtocolError(f"undecodable stream from the server: {e}")
            err.events = events
            raise err from e
        return events

    def _route(self, msg: Any) -> Optional[Event]:
        if not isinstance(msg, (list, tuple)) or not msg:
            raise ProtocolError(f"not a MessagePack-RPC message: {msg!r:.200}")
        kind = msg[0]
        if kind == RESPONSE and len(msg) == 4:
            msgid = msg[1]
            if not isinstance(msgid, int) or isinstance(msgid, bool):
                return None     # the echo of a malformed msgid: no request of ours
            p = self._pending.pop(msgid, None)
            self._streams.pop(msgid, None)
            if p is None:
                return None     # e.g. a second answer to a duplicate msgid
            return Response(p, msg[2], msg[3])
        if kind == NOTIFICATION and len(msg) == 3:
            note = _decode_notification_args(msg[1], msg[2])
            if note.method == "call.output":
                msgid = note.params.get("msgid")
                if isinstance(msgid, int) and self._streams.get(msgid):
                    data = note.params.get("data")
                    if isinstance(data, str):
                        data = data.encode("utf-8", "surrogateescape")
                    return Output(self._pending[msgid],
                                  OutputChunk(str(note.params.get("stream")),
                                              bytes(data or b"")))
            return note
        raise ProtocolError(f"unexpected message from the server: {msg!r:.200}")


# ---- params

def _put(params: Dict[str, Any], key: str, value: Any) -> None:
    if value is not None:
        params[key] = value


def call_params(session_id: str, tool: str, argv: Optional[Sequence[str]] = None,
                args: Optional[Dict[str, Any]] = None, stdin: Optional[bytes] = None,
                timeout_ms: Optional[int] = None, deadline_ms: Optional[int] = None,
                depth: Optional[int] = None, idempotent: Optional[bool] = None,
                stream: Optional[bool] = None, env: Optional[Dict[str, str]] = None,
                **extra: Any) -> Dict[str, Any]:
    """The ``call`` map; None values are left out. ``extra`` keys go as they are (the
    server refuses keys it does not define)."""
    params: Dict[str, Any] = {"session_id": session_id, "tool": tool}
    if argv is not None:
        params["argv"] = list(argv)
    _put(params, "args", args)
    if stdin is not None:
        if isinstance(stdin, str):
            stdin = stdin.encode("utf-8")
        params["stdin"] = bytes(stdin)
    _put(params, "timeout_ms", timeout_ms)
    _put(params, "deadline_ms", deadline_ms)
    _put(params, "depth", depth)
    _put(params, "idempotent", idempotent)
    _put(params, "env", env)
    if stream:
        params["stream"] = True
    for k, v in extra.items():
        _put(params, k, v)
    return params


def open_params(session_id: Optional[str] = None, ttl_ms: Optional[int] = None,
                fuse_ms: Optional[int] = None, labels: Optional[Dict[str, str]] = None
                ) -> Dict[str, Any]:
    """The ``session.open`` map; None values are left out."""
    params: Dict[str, Any] = {}
    _put(params, "session_id", session_id)
    _put(params, "ttl_ms", ttl_ms)
    _put(params, "fuse_ms", fuse_ms)
    _put(params, "labels", labels)
    return params
