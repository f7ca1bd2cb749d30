"""Framing and parameter building shared by the sync and asyncio clients."""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

import msgpack

from .errors import ProtocolError

REQUEST, RESPONSE, NOTIFICATION = 0, 1, 2
MSGID_MAX = 0xFFFFFFFF


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def pack_request(msgid: int, method: str, params: Dict[str, Any]) -> bytes:
    return pack([REQUEST, msgid, method, params])


def new_unpacker(max_buffer_size: int = 0) -> msgpack.Unpacker:
    # raw=False: msgpack str -> Python str, bin -> bytes (process output stays bytes).
    return msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max_buffer_size)


def classify_message(msg: Any) -> Tuple[int, tuple]:
    """(kind, fields) of an incoming message; raises ProtocolError if it is not one."""
    if not isinstance(msg, (list, tuple)) or not msg:
        raise ProtocolError(f"not a MessagePack-RPC message: {msg!r:.200}")
    kind = msg[0]
    if kind == RESPONSE and len(msg) == 4:
        return RESPONSE, (msg[1], msg[2], msg[3])
    if kind == NOTIFICATION and len(msg) == 3:
        return NOTIFICATION, (msg[1], msg[2])
    raise ProtocolError(f"unexpected message from the server: {msg!r:.200}")


def _put(params: Dict[str, Any], key: str, value: Any) -> None:
    if value is not None:
        params[key] = value


def call_params(session_id: str, tool: str, argv: Optional[Sequence[str]] = None,
                args: Optional[Dict[str, Any]] = None, stdin: Optional[bytes] = None,
                timeout_ms: Optional[int] = None, deadline_ms: Optional[int] = None,
                depth: Optional[int] = None, idempotent: Optional[bool] = None,
                stream: Optional[bool] = None, **extra: Any) -> Dict[str, Any]:
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
    if stream:
        params["stream"] = True
    for k, v in extra.items():
        _put(params, k, v)
    return params


def open_params(session_id: Optional[str] = None, ttl_ms: Optional[int] = None,
                fuse_ms: Optional[int] = None, labels: Optional[Dict[str, Any]] = None
                ) -> Dict[str, Any]:
    params: Dict[str, Any] = {}
    _put(params, "session_id", session_id)
    _put(params, "ttl_ms", ttl_ms)
    _put(params, "fuse_ms", fuse_ms)
    _put(params, "labels", labels)
    return params


class MsgidAllocator:
    """uint32 msgids, wrapping around, never one still in flight."""

    def __init__(self) -> None:
        self._next = 1

    def allocate(self, in_flight) -> int:
        for _ in range(1 << 20):
            msgid = self._next
            self._next = 1 if self._next >= MSGID_MAX else self._next + 1
            if msgid not in in_flight:
                return msgid
        raise RuntimeError("no free msgid")  # > a million requests in flight
