"""The error vocabulary of the stockade wire protocol (PROTOCOL.md, "The error map").

Every failure has the same shape, ``{class, retryable, message, layer}``. Errors that come
in the RPC ``error`` slot (the request never ran: BAD_REQUEST, NO_SUCH_SESSION, OVERLOADED,
INTERNAL) are raised by the client methods; a call that was accepted answers with a
:class:`~stockade_client.types.CallResult` whatever happened, and
``CallResult.raise_for_class()`` turns a non-OK result into the matching exception.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Type

__all__ = [
    "StockadeError", "ToolError", "ToolTimeout", "DeadlineExceeded", "SessionExpired",
    "PolicyViolation", "ResourceLimit", "OutputRejected", "Cancelled", "Overloaded",
    "BadRequest", "NoSuchSession", "Internal", "UnknownErrorClass",
    "ClientError", "ConnectionClosed", "ProtocolError",
    "error_class_for", "error_from_map", "ERROR_CLASSES",
]


class StockadeError(Exception):
    """A failure reported by stockade. ``class_`` is the stable, machine-readable class;
    ``retryable`` whether repeating the same request may succeed; ``message`` one line
    meant for a human or a model; ``layer`` which timeout layer fired (timeouts only)."""

    class_: str = ""          # overridden by each subclass
    default_retryable: bool = False

    def __init__(self, message: str = "", *, retryable: Optional[bool] = None,
                 layer: Optional[str] = None, class_: Optional[str] = None,
                 raw: Optional[Dict[str, Any]] = None, result: Any = None,
                 msgid: Optional[int] = None):
        super().__init__(message)
        if class_ is not None:
            self.class_ = class_
        self.message = message
        self.retryable = self.default_retryable if retryable is None else bool(retryable)
        self.layer = layer
        self.raw = raw if raw is not None else {}
        #: the CallResult this error was raised for (raise_for_class), else None
        self.result = result
        #: the msgid of the request that failed, when known
        self.msgid = msgid

    def __str__(self) -> str:
        extra = f" [layer={self.layer}]" if self.layer else ""
        return f"{self.class_}: {self.message}{extra}"

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(class_={self.class_!r}, retryable={self.retryable!r}, "
                f"layer={self.layer!r}, message={self.message!r})")


class ToolError(StockadeError):
    """The tool ran and exited non-zero (the policy's classify hook may make it retryable)."""
    class_ = "TOOL_ERROR"


class ToolTimeout(StockadeError):
    """The per-call wall clock or CPU limit fired; retryable only for idempotent calls."""
    class_ = "TOOL_TIMEOUT"


class DeadlineExceeded(StockadeError):
    """The caller's own deadline (deadline_ms) ran out first."""
    class_ = "DEADLINE_EXCEEDED"


class SessionExpired(StockadeError):
    """The session's fuse or lease ran out; every call in it ended."""
    class_ = "SESSION_EXPIRED"


class PolicyViolation(StockadeError):
    """Refused by the policy. Terminal: never retry it, never loop on it."""
    class_ = "POLICY_VIOLATION"


class ResourceLimit(StockadeError):
    """Memory, process count, file size or descriptor limit hit."""
    class_ = "RESOURCE_LIMIT"


class OutputRejected(StockadeError):
    """The output failed the tool's declared output schema or depth."""
    class_ = "OUTPUT_REJECTED"


class Cancelled(StockadeError):
    """The client cancelled the call (or closed its session)."""
    class_ = "CANCELLED"


class Overloaded(StockadeError):
    """Admission limits reached (max sessions / running calls). Retryable."""
    class_ = "OVERLOADED"
    default_retryable = True


class BadRequest(StockadeError):
    """Malformed message or params."""
    class_ = "BAD_REQUEST"


class NoSuchSession(StockadeError):
    """Unknown or closed session id."""
    class_ = "NO_SUCH_SESSION"


class Internal(StockadeError):
    """stockade's own failure; logged on the server with a correlation id."""
    class_ = "INTERNAL"


class UnknownErrorClass(StockadeError):
    """A class this client does not know (a newer server). ``class_`` holds it."""
    class_ = "UNKNOWN"


# ---- client-side failures (never sent by the server)

class ClientError(StockadeError):
    """A failure on this side of the wire."""
    class_ = "CLIENT"


class ConnectionClosed(ClientError):
    """The connection to the server went away before the answer arrived."""
    class_ = "CONNECTION_CLOSED"


class ProtocolError(ClientError):
    """The server sent something that is not MessagePack-RPC as PROTOCOL.md defines it."""
    class_ = "PROTOCOL_ERROR"


ERROR_CLASSES: Dict[str, Type[StockadeError]] = {
    cls.class_: cls for cls in (
        ToolError, ToolTimeout, DeadlineExceeded, SessionExpired, PolicyViolation,
        ResourceLimit, OutputRejected, Cancelled, Overloaded, BadRequest, NoSuchSession,
        Internal)
}


def error_class_for(class_name: str) -> Type[StockadeError]:
    """The exception type for a protocol class name (UnknownErrorClass if unknown)."""
    return ERROR_CLASSES.get(class_name, UnknownErrorClass)


def error_from_map(err: Any, *, msgid: Optional[int] = None, result: Any = None) -> StockadeError:
    """Build the matching exception from an error map ``{class, retryable, message, layer}``.
    Something that is not a map (a non-conforming server) becomes a ProtocolError."""
    if not isinstance(err, dict):
        return ProtocolError(f"error slot is not a map: {err!r}", raw={"error": err}, msgid=msgid)
    name = err.get("class")
    name = name if isinstance(name, str) else "UNKNOWN"
    cls = error_class_for(name)
    message = err.get("message")
    message = message if isinstance(message, str) else ""
    layer = err.get("layer")
    retryable = err.get("retryable")
    return cls(message, retryable=bool(retryable) if retryable is not None else None,
               layer=layer if isinstance(layer, str) else None,
               class_=name if cls is UnknownErrorClass else None,
               raw=err, result=result, msgid=msgid)
