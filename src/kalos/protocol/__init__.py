"""The wire protocol: byte layout, op and status codes, request and response bodies."""

from kalos.protocol.codes import MAX_K, PROTOCOL_VERSION, Op, Status, error_for_status
from kalos.types import Scope

__all__ = ["MAX_K", "PROTOCOL_VERSION", "Op", "Scope", "Status", "error_for_status"]
