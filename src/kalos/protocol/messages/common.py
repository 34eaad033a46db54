"""What every body shares: the scope block, array views with bounds checks, vector dtypes,
counts and text (STATS, error messages). The layouts are drawn in :mod:`kalos.protocol.messages`."""

from __future__ import annotations

import struct
from typing import NamedTuple

import numpy as np

from kalos.errors import InvalidRequest, PayloadTooLarge
from kalos.protocol import codes
from kalos.types import Scope

_HEAD4 = struct.Struct("<IIII")
_HEAD2 = struct.Struct("<II")
_U64 = struct.Struct("<Q")
_U64X2 = struct.Struct("<QQ")

_DTYPES: dict[int, np.dtype] = {
    codes.DTYPE_F32: np.dtype(np.float32),
    codes.DTYPE_F16: np.dtype(np.float16),
}


_F32 = np.dtype(np.float32)
_I64 = np.dtype(np.int64)


def _pad8(n: int) -> int:
    return (n + 7) & ~7


NO_SCOPE = Scope()


class ScopeBytes(NamedTuple):
    """A scope encoded once (UTF-8 fields), ready to be written into many requests."""

    tenant: bytes
    user: bytes
    session: bytes

    @property
    def nbytes(self) -> int:
        return 16 + _pad8(len(self.tenant) + len(self.user) + len(self.session))


def encode_scope_fields(scope: Scope | None) -> ScopeBytes:
    s = scope or NO_SCOPE
    return ScopeBytes(
        (s.tenant or "").encode(), (s.user or "").encode(), (s.session or "").encode()
    )


EMPTY_SCOPE = encode_scope_fields(None)
_NO_SCOPE = Scope(None, None, None)


def write_scope(buf: np.ndarray, off: int, sb: ScopeBytes) -> int:
    """Writes a scope block at ``off``; returns the offset after it."""
    a, b, c = len(sb.tenant), len(sb.user), len(sb.session)
    _HEAD4.pack_into(buf, off, a, b, c, 0)
    off += 16
    if a + b + c:
        buf[off : off + a + b + c] = np.frombuffer(sb.tenant + sb.user + sb.session, np.uint8)
    return off + _pad8(a + b + c)


def read_scope(buf: np.ndarray, off: int, end: int) -> tuple[Scope, int]:
    """Reads a scope block at ``off``; returns it (unset fields are None) and the next offset."""
    _need(off + 16, end)
    a, b, c, _ = _HEAD4.unpack_from(buf, off)
    off += 16
    if not (a or b or c):  # the common case: no scope (saves ~1.5 µs per request)
        return _NO_SCOPE, off
    _need(off + a + b + c, end)
    raw = bytes(buf[off : off + a + b + c])
    try:
        t, u, s = raw[:a].decode(), raw[a : a + b].decode(), raw[a + b :].decode()
    except UnicodeDecodeError as exc:
        raise InvalidRequest("scope is not valid UTF-8") from exc
    return Scope(t or None, u or None, s or None), off + _pad8(a + b + c)


def _need(end: int, limit: int) -> None:
    if end > limit:
        raise InvalidRequest(f"truncated request body: needs {end} bytes, has {limit}")


def _array(buf: np.ndarray, off: int, dtype: np.dtype, count: int, end: int) -> np.ndarray:
    nbytes = count * dtype.itemsize
    _need(off + nbytes, end)
    return buf[off : off + nbytes].view(dtype)


def _matrix(buf: np.ndarray, off: int, dtype: np.dtype, shape: tuple[int, int], end: int):
    """A [rows, cols] view of ``buf`` at ``off`` (one constructor call: the hot paths')."""
    _need(off + shape[0] * shape[1] * dtype.itemsize, end)
    return np.ndarray(shape, dtype, buf, off)


def _fit(size: int, capacity: int, what: str) -> None:
    if size > capacity:
        raise PayloadTooLarge(f"{what} needs {size} bytes; the channel arena holds {capacity}")


def wire_dtype(dtype: np.dtype) -> int:
    if dtype == np.float16:
        return codes.DTYPE_F16
    return codes.DTYPE_F32


def vector_dtype(code: int) -> np.dtype:
    dt = _DTYPES.get(code)
    if dt is None:
        raise InvalidRequest(f"unknown vector dtype code {code}")
    return dt


def encode_counts(buf: np.ndarray, a: int, b: int = 0) -> int:
    _U64X2.pack_into(buf, 0, a, b)
    return 16


def decode_counts(buf: np.ndarray, end: int) -> tuple[int, int]:
    _need(16, end)
    a, b = _U64X2.unpack_from(buf, 0)
    return int(a), int(b)


# -- text (STATS, error messages) ----------------------------------------------------------


def encode_text(buf: np.ndarray, text: str) -> int:
    data = text.encode()[: len(buf)]
    buf[: len(data)] = np.frombuffer(data, np.uint8)
    return len(data)


def decode_text(buf: np.ndarray, end: int) -> str:
    return buf[:end].tobytes().decode(errors="replace")


# -- what session, state and event-log bodies share ------------------------------------------
#
# A session op names its session in the session field of its scope block; the tenant and
# user fields are the session's owner (APPEND_TURN, LOG_EVENT) or a filter it must match
# (the others). State ops use the scope block as the key's namespace. docs/PROTOCOL.md draws
# every body.

NO_LIMIT = 0xFFFFFFFF  # max_turns / limit: none


def _bytes_at(buf: np.ndarray, off: int, n: int, end: int) -> bytes:
    _need(off + n, end)
    return buf[off : off + n].tobytes()


def _text_at(buf: np.ndarray, off: int, n: int, end: int, what: str) -> str:
    try:
        return _bytes_at(buf, off, n, end).decode()
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"{what} is not valid UTF-8") from exc


def _put_bytes(buf: np.ndarray, off: int, data: bytes) -> int:
    """Writes ``data`` at ``off``; returns the 8-aligned offset after it."""
    if data:
        buf[off : off + len(data)] = np.frombuffer(data, np.uint8)
    return off + _pad8(len(data))


def session_of(scope: Scope) -> str:
    """The session id a session op's scope block names (InvalidRequest when empty)."""
    if not scope.session:
        raise InvalidRequest("a session id is required")
    return scope.session


def owner_of(scope: Scope) -> Scope | None:
    """The tenant and user of a scope block, or None when it gives neither."""
    if scope.tenant is None and scope.user is None:
        return None
    return Scope(scope.tenant, scope.user, None)


# -- JSON sections (1.5): metadata, string ids, filters ----------------------------------------


def json_section_size(data: bytes) -> int:
    """Bytes of a JSON section: ``u64 length, u64 0``, the UTF-8 JSON padded to 8."""
    return 16 + _pad8(len(data))


def write_json_section(buf: np.ndarray, off: int, data: bytes) -> int:
    """Writes a JSON section at ``off``; returns the offset after it."""
    _U64X2.pack_into(buf, off, len(data), 0)
    off += 16
    if data:
        buf[off : off + len(data)] = np.frombuffer(data, np.uint8)
    pad = _pad8(len(data)) - len(data)
    if pad:
        buf[off + len(data) : off + len(data) + pad] = 0
    return off + _pad8(len(data))


def read_json_section(buf: np.ndarray, off: int, end: int) -> tuple[bytes, int]:
    """(the JSON bytes, the offset after the section) of a section at ``off``."""
    _need(off + 16, end)
    n, _ = _U64X2.unpack_from(buf, off)
    off += 16
    if n > end - off:
        raise InvalidRequest("a JSON section's length points outside the request")
    return bytes(buf[off : off + n]), off + _pad8(n)
