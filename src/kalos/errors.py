"""The whole Kalos exception tree, grouped by who is at fault.

::

    KalosError
    ├─ ConfigError (ValueError)          the caller's configuration
    ├─ InvalidRequest (ValueError)       bad input: wrong dim, NaN, k out of range
    │  └─ PayloadTooLarge                a request or item larger than the channel arena
    ├─ TransportError
    │  ├─ ConnectError                   no sidecar of that name, or the handshake failed
    │  ├─ RequestTimeout                 no response within the call's deadline
    │  ├─ SidecarGone                    the sidecar died or restarted
    │  └─ ProtocolMismatch               client and sidecar speak different major versions
    ├─ ClosedError                       you closed it
    ├─ ServerError(code)                 the sidecar failed; message decoded, never a traceback
    └─ StoreError
       ├─ NotFound (KeyError)
       └─ Conflict

Status codes travel in responses (see :mod:`kalos.protocol.codes`); :func:`error_for_status`
turns one into the exception of this tree, in one place.
"""

from __future__ import annotations


class KalosError(Exception):
    """Root of every error Kalos raises."""


class ConfigError(KalosError, ValueError):
    """The caller's configuration is wrong (a bad flag, spec string or option)."""


class InvalidRequest(KalosError, ValueError):
    """The request is malformed: wrong dimension, NaN or inf, k out of range, unknown op."""


class PayloadTooLarge(InvalidRequest):
    """A request, or a single item of it, does not fit the channel's data arena."""


class TransportError(KalosError):
    """Moving a request or its response failed."""


class ConnectError(TransportError):
    """No sidecar answers under that name, or the handshake was refused."""


class RequestTimeout(TransportError):
    """The call's deadline passed before its response arrived."""


class SidecarGone(TransportError):
    """The sidecar died or restarted while this client was connected."""


class ProtocolMismatch(TransportError):
    """Client and sidecar speak incompatible protocol versions (both are named)."""


class ClosedError(KalosError):
    """The client or channel was closed by its owner."""


class ServerError(KalosError):
    """The sidecar failed to carry out a valid request. ``code`` is the wire status code."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code


class StoreError(KalosError):
    """A store refused an operation."""


class NotFound(StoreError, KeyError):
    """The session, key or item does not exist."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the plain message
        return str(self.args[0]) if self.args else ""


class Conflict(StoreError):
    """A compare-and-set or versioned write lost against a newer version."""


__all__ = [
    "ClosedError",
    "ConfigError",
    "Conflict",
    "ConnectError",
    "InvalidRequest",
    "KalosError",
    "NotFound",
    "PayloadTooLarge",
    "ProtocolMismatch",
    "RequestTimeout",
    "ServerError",
    "SidecarGone",
    "StoreError",
    "TransportError",
]
