"""Python client of ``stockade serve``, the MessagePack-RPC server of the stockade tool-call
supervisor. Wire contract: shared/design/PROTOCOL.md (protocol version 2).

- :class:`Client` — synchronous and thread-safe (a reader thread matches responses by
  msgid), over a spawned server's pipes or a Unix socket.
- :class:`AsyncClient` — the same API for asyncio.
- :class:`CallResult` — a call's typed result; :class:`StockadeError` and one subclass per
  error class.

Only the standard library and msgpack (Debian: python3-msgpack) are needed.
"""

from .errors import (BadRequest, Cancelled, ClientError, ConnectionClosed, DeadlineExceeded,
                     ERROR_CLASSES, Internal, NoSuchSession, OutputRejected, Overloaded,
                     PolicyViolation, ProtocolError, ResourceLimit, SessionExpired,
                     StockadeError, ToolError, ToolTimeout, UnknownErrorClass,
                     error_class_for, error_from_map)
from .types import CALL_RESULT_FIELDS, CallResult, OutputChunk, ServerInfo, SessionInfo
from .client import CallHandle, Client, Session
from .aio import AsyncCallHandle, AsyncClient, AsyncSession

from ._proto import PROTOCOL_VERSION

__all__ = [
    "Client", "Session", "CallHandle", "AsyncClient", "AsyncSession", "AsyncCallHandle",
    "CallResult", "OutputChunk", "ServerInfo", "SessionInfo", "CALL_RESULT_FIELDS",
    "StockadeError", "ToolError", "ToolTimeout", "DeadlineExceeded", "SessionExpired",
    "PolicyViolation", "ResourceLimit", "OutputRejected", "Cancelled", "Overloaded",
    "BadRequest", "NoSuchSession", "Internal", "UnknownErrorClass", "ClientError",
    "ConnectionClosed", "ProtocolError", "ERROR_CLASSES", "error_class_for", "error_from_map",
    "PROTOCOL_VERSION",
]
