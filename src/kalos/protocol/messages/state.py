"""Agent state and event logs: STATE_PUT, STATE_CAS, STATE_GET, STATE_DELETE, LOG_EVENT, EVENTS.

State ops use the scope block as the key's namespace.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from kalos.errors import InvalidRequest, PayloadTooLarge
from kalos.protocol import codes
from kalos.protocol.messages.common import (
    _HEAD4,
    _U64X2,
    NO_LIMIT,
    ScopeBytes,
    _array,
    _bytes_at,
    _fit,
    _need,
    _pad8,
    _put_bytes,
    _text_at,
    read_scope,
    session_of,
    write_scope,
)
from kalos.protocol.messages.sessions import decode_scoped, encode_scoped
from kalos.types import Scope

# STATE_PUT and STATE_CAS: u32 key_len, u32 0, u64 value_len, u64 expected_version (CAS; 0:
# must not exist), scope block (namespace), key bytes padded to 8, value bytes. Response:
# u64 version, u64 0. STATE_GET and STATE_DELETE: u32 key_len, u32 0, scope block, key bytes.
# Responses: GET u64 version, u64 value_len, value bytes; DELETE u64 existed, u64 0.

_VALUE_HEAD = struct.Struct("<IIQQ")  # key_len, 0, value_len, expected_version
_EVENT_HEAD = struct.Struct("<IIQ")  # kind_len, data_kind, data_len
_EVENTS_HEAD = struct.Struct("<QII")  # since, limit, 0


def encode_state_value(
    buf: np.ndarray, sb: ScopeBytes, key: bytes, value: bytes, expected_version: int = 0
) -> int:
    size = 24 + sb.nbytes + _pad8(len(key)) + len(value)
    _fit(size, len(buf), "state value")
    _VALUE_HEAD.pack_into(buf, 0, len(key), 0, len(value), expected_version)
    off = _put_bytes(buf, write_scope(buf, 24, sb), key)
    _put_bytes(buf, off, value)
    return size


class StateValueRequest(NamedTuple):
    scope: Scope
    key: str
    value: bytes
    expected_version: int


def decode_state_value(buf: np.ndarray, end: int) -> StateValueRequest:
    _need(24, end)
    key_len, _, value_len, expected = _VALUE_HEAD.unpack_from(buf, 0)
    scope, off = read_scope(buf, 24, end)
    key = _text_at(buf, off, key_len, end, "the key")
    value = _bytes_at(buf, off + _pad8(key_len), value_len, end)
    return StateValueRequest(scope, key, value, expected)


def encode_state_key(buf: np.ndarray, sb: ScopeBytes, key: bytes) -> int:
    return encode_scoped(buf, len(key), 0, sb, key)


def decode_state_key(buf: np.ndarray, end: int) -> tuple[Scope, str]:
    key_len, _, scope, off = decode_scoped(buf, end)
    return scope, _text_at(buf, off, key_len, end, "the key")


def encode_state_get_response(buf: np.ndarray, version: int, value: bytes) -> int:
    size = 16 + len(value)
    _fit(size, len(buf), "state value")
    _U64X2.pack_into(buf, 0, version, len(value))
    _put_bytes(buf, 16, value)
    return size


def decode_state_get_response(buf: np.ndarray, end: int) -> tuple[int, bytes]:
    _need(16, end)
    version, n = _U64X2.unpack_from(buf, 0)
    return int(version), _bytes_at(buf, 16, n, end)


# LOG_EVENT: u32 kind_len, u32 data_kind (PAYLOAD_TEXT or PAYLOAD_BYTES), u64 data_len, scope
# block (owner; session = the session id), kind bytes padded to 8, data bytes. Response:
# u64 seq, u64 0. EVENTS: u64 since, u32 limit (NO_LIMIT: none), u32 0, scope block (filter;
# session = the session id). Response: u32 n, u32 more, u64 0, i64 seq[n], f64 time[n],
# u32 kind_len[n] padded to 8, u8 data_kind[n] padded to 8, u64 data_len[n], then each
# event's kind bytes and data bytes. ``more``: later events did not fit; ask again from the
# last seq.


def encode_log_event(buf: np.ndarray, sb: ScopeBytes, kind: bytes, data: str | bytes) -> int:
    data_kind = codes.PAYLOAD_TEXT if isinstance(data, str) else codes.PAYLOAD_BYTES
    raw = data.encode() if isinstance(data, str) else bytes(data)
    size = 16 + sb.nbytes + _pad8(len(kind)) + len(raw)
    _fit(size, len(buf), "event")
    _EVENT_HEAD.pack_into(buf, 0, len(kind), data_kind, len(raw))
    off = _put_bytes(buf, write_scope(buf, 16, sb), kind)
    _put_bytes(buf, off, raw)
    return size


class LogEventRequest(NamedTuple):
    scope: Scope  # owner; session = the session id
    kind: str
    data: str | bytes


def decode_log_event(buf: np.ndarray, end: int) -> LogEventRequest:
    _need(16, end)
    kind_len, data_kind, data_len = _EVENT_HEAD.unpack_from(buf, 0)
    scope, off = read_scope(buf, 16, end)
    session_of(scope)
    kind = _text_at(buf, off, kind_len, end, "the event kind")
    off += _pad8(kind_len)
    data: str | bytes
    if data_kind == codes.PAYLOAD_TEXT:
        data = _text_at(buf, off, data_len, end, "the event data")
    elif data_kind == codes.PAYLOAD_BYTES:
        data = _bytes_at(buf, off, data_len, end)
    else:
        raise InvalidRequest(f"unknown event data kind {data_kind}")
    return LogEventRequest(scope, kind, data)


def encode_events_request(buf: np.ndarray, sb: ScopeBytes, since: int, limit: int) -> int:
    size = 16 + sb.nbytes
    _fit(size, len(buf), "events request")
    _EVENTS_HEAD.pack_into(buf, 0, since, limit, 0)
    write_scope(buf, 16, sb)
    return size


def decode_events_request(buf: np.ndarray, end: int) -> tuple[Scope, int, int | None]:
    """EVENTS → (scope, since, limit or None)."""
    _need(16, end)
    since, limit, _ = _EVENTS_HEAD.unpack_from(buf, 0)
    scope, _off = read_scope(buf, 16, end)
    session_of(scope)
    return scope, since, None if limit == NO_LIMIT else limit


def _events_size(n: int, blob: int) -> int:
    return 16 + 16 * n + _pad8(4 * n) + _pad8(n) + 8 * n + blob


def encode_events_response(
    buf: np.ndarray, events: Sequence[tuple[int, float, str, str | bytes]], more: bool
) -> int:
    """Writes as many of ``events`` as fit; ``more`` is set when some did not (or ``more``)."""
    kinds = [e[2].encode() for e in events]
    datas = [e[3].encode() if isinstance(e[3], str) else e[3] for e in events]
    n, blob = 0, 0
    for k, d in zip(kinds, datas, strict=True):
        if _events_size(n + 1, blob + len(k) + len(d)) > len(buf):
            break
        n, blob = n + 1, blob + len(k) + len(d)
    if n == 0 and events:
        raise PayloadTooLarge("one event does not fit the channel arena")
    more = more or n < len(events)
    _HEAD4.pack_into(buf, 0, n, int(more), 0, 0)
    off = 16
    buf[off : off + 8 * n].view(np.int64)[:] = [e[0] for e in events[:n]]
    off += 8 * n
    buf[off : off + 8 * n].view(np.float64)[:] = [e[1] for e in events[:n]]
    off += 8 * n
    buf[off : off + 4 * n].view(np.uint32)[:] = [len(k) for k in kinds[:n]]
    off += _pad8(4 * n)
    buf[off : off + n] = [
        codes.PAYLOAD_TEXT if isinstance(e[3], str) else codes.PAYLOAD_BYTES for e in events[:n]
    ]
    off += _pad8(n)
    buf[off : off + 8 * n].view(np.uint64)[:] = [len(d) for d in datas[:n]]
    off += 8 * n
    _put_bytes(buf, off, b"".join(k + d for k, d in zip(kinds[:n], datas[:n], strict=True)))
    return off + blob


def decode_events_response(
    buf: np.ndarray, end: int
) -> tuple[list[tuple[int, float, str, str | bytes]], bool]:
    """(events as (seq, time, kind, data), more)."""
    _need(16, end)
    n, more, _, _ = _HEAD4.unpack_from(buf, 0)
    off = 16
    seqs = _array(buf, off, np.dtype(np.int64), n, end).tolist()
    off += 8 * n
    times = _array(buf, off, np.dtype(np.float64), n, end).tolist()
    off += 8 * n
    kind_lens = _array(buf, off, np.dtype(np.uint32), n, end).tolist()
    off += _pad8(4 * n)
    data_kinds = _array(buf, off, np.dtype(np.uint8), n, end).tolist()
    off += _pad8(n)
    data_lens = _array(buf, off, np.dtype(np.uint64), n, end).tolist()
    off += 8 * n
    blob = _bytes_at(buf, off, sum(kind_lens) + sum(data_lens), end)
    out: list[tuple[int, float, str, str | bytes]] = []
    x = 0
    try:
        for i in range(n):
            kind = blob[x : x + kind_lens[i]].decode()
            x += kind_lens[i]
            raw = blob[x : x + data_lens[i]]
            x += data_lens[i]
            out.append(
                (
                    seqs[i],
                    times[i],
                    kind,
                    raw.decode() if data_kinds[i] == codes.PAYLOAD_TEXT else raw,
                )
            )
    except UnicodeDecodeError as exc:
        raise InvalidRequest("an event is not valid UTF-8") from exc
    return out, bool(more)


class Event(NamedTuple):
    """One event of a session's log."""

    seq: int  # 1, 2, 3, ... within the session
    time: float  # seconds since the epoch, when the sidecar logged it
    kind: str
    data: str | bytes  # as it was logged


class StateValue(NamedTuple):
    """A state key's value and its version (versions only grow, store-wide)."""

    version: int
    value: bytes
