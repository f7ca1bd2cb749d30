"""Typed views of the protocol's results (PROTOCOL.md, "Methods")."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, NamedTuple, Optional

from .errors import error_from_map

__all__ = ["CallResult", "OutputChunk", "SessionInfo", "ServerInfo", "CALL_RESULT_FIELDS"]

CALL_RESULT_FIELDS = ("class", "retryable", "message", "layer", "exit_code", "signal",
                      "stdout", "stderr", "truncated", "redactions", "duration_ms",
                      "cpu_ms", "max_rss_kb")


class OutputChunk(NamedTuple):
    """One ``call.output`` notification: ``stream`` is "stdout" or "stderr", ``data`` bytes."""
    stream: str
    data: bytes


def _int_or_none(v: Any) -> Optional[int]:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _bytes(v: Any) -> bytes:
    if isinstance(v, (bytes, bytearray)):
        return bytes(v)
    if isinstance(v, str):          # a non-conforming server sent str: keep the text
        return v.encode("utf-8", "surrogateescape")
    return b""


@dataclass
class CallResult:
    """The result of a ``call`` — also when the tool failed or was refused.

    ``class_`` is the protocol's ``class`` (``OK`` on success). Output is bytes, exactly as
    the server sent it (already redacted and capped). ``raw`` keeps the whole map, so
    fields added by a newer server are not lost."""

    class_: str
    retryable: bool = False
    message: str = ""
    layer: Optional[str] = None
    exit_code: Optional[int] = None
    signal: Optional[int] = None
    stdout: bytes = b""
    stderr: bytes = b""
    truncated: Dict[str, int] = field(default_factory=lambda: {"stdout": 0, "stderr": 0})
    redactions: int = 0
    duration_ms: int = 0
    cpu_ms: int = 0
    max_rss_kb: int = 0
    msgid: Optional[int] = None
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def ok(self) -> bool:
        """True when the tool ran and exited 0 (class OK)."""
        return self.class_ == "OK"

    @property
    def text(self) -> str:
        """stdout decoded as UTF-8 with invalid bytes replaced (for display)."""
        return self.stdout.decode("utf-8", "replace")

    @classmethod
    def from_map(cls, m: Dict[str, Any], msgid: Optional[int] = None) -> "CallResult":
        if not isinstance(m, dict):
            from .errors import ProtocolError
            raise ProtocolError(f"call result is not a map: {m!r}", msgid=msgid)
        trunc = m.get("truncated")
        if not isinstance(trunc, dict):
            trunc = {"stdout": 0, "stderr": 0}
        layer = m.get("layer")
        message = m.get("message")
        return cls(
            class_=m.get("class") if isinstance(m.get("class"), str) else "UNKNOWN",
            retryable=bool(m.get("retryable", False)),
            message=message if isinstance(message, str) else "",
            layer=layer if isinstance(layer, str) and layer else None,
            exit_code=_int_or_none(m.get("exit_code")),
            signal=_int_or_none(m.get("signal")),
            stdout=_bytes(m.get("stdout")),
            stderr=_bytes(m.get("stderr")),
            truncated=dict(trunc),
            redactions=_int_or_none(m.get("redactions")) or 0,
            duration_ms=_int_or_none(m.get("duration_ms")) or 0,
            cpu_ms=_int_or_none(m.get("cpu_ms")) or 0,
            max_rss_kb=_int_or_none(m.get("max_rss_kb")) or 0,
            msgid=msgid,
            raw=m,
        )

    def error(self):
        """The matching StockadeError for a non-OK result, else None."""
        if self.ok:
            return None
        return error_from_map({"class": self.class_, "retryable": self.retryable,
                               "message": self.message, "layer": self.layer},
                              msgid=self.msgid, result=self)

    def raise_for_class(self) -> "CallResult":
        """Raise the exception matching ``class_`` unless it is OK; returns self if OK."""
        err = self.error()
        if err is not None:
            raise err
        return self


@dataclass
class SessionInfo:
    """The result of ``session.open``."""
    session_id: str
    root: str
    expires_at_ms: Optional[int] = None
    fuse_at_ms: Optional[int] = None
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_map(cls, m: Dict[str, Any]) -> "SessionInfo":
        return cls(session_id=m.get("session_id"), root=m.get("root"),
                   expires_at_ms=_int_or_none(m.get("expires_at_ms")),
                   fuse_at_ms=_int_or_none(m.get("fuse_at_ms")), raw=m)


@dataclass
class ServerInfo:
    """The result of ``hello``."""
    protocol: int
    version: str
    policy: Dict[str, Any]
    isolation: Dict[str, Any]
    limits: Dict[str, Any]
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_map(cls, m: Dict[str, Any]) -> "ServerInfo":
        return cls(protocol=m.get("protocol"), version=m.get("version"),
                   policy=m.get("policy") or {}, isolation=m.get("isolation") or {},
                   limits=m.get("limits") or {}, raw=m)

    @property
    def layers(self) -> List[str]:
        """The isolation layers really active on the server's host."""
        return list(self.isolation.get("layers") or [])
