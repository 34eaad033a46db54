"""Request and response bodies: how each op's arguments lie in a channel arena.

Both sides use these functions: the client encodes requests and decodes responses, the sidecar
decodes requests and encodes responses. Every function works on a ``uint8`` numpy array over
an arena (or a socket buffer) so that vectors and results are written and read in place:
decoders return numpy *views* into that memory, valid until the buffer is reused.

Every section of a body starts 8-byte aligned. Layouts (little-endian):

- scope block: ``u32 tenant_len, u32 user_len, u32 session_len, u32 0``, then the UTF-8
  bytes, padded to 8.
- ADD: ``u32 n, u32 dim, u32 dtype, u32 0``, scope block, ``ids i64[n]``,
  ``vectors dtype[n*dim]``, ``kinds u8[n]``, ``offsets u64[n+1]``, then with flag
  ``ADD_HAS_TOKENS`` ``has_tokens u8[n]``, ``token_offsets u64[n+1]``,
  ``tokens i32[token_offsets[n]]`` (each padded to 8), then ``blob``.
- REMOVE: ``u32 n, u32 0``, ``ids i64[n]``.  Response: ``u64 removed``.
- SEARCH: ``u32 nq, u32 k, u32 dim, u32 dtype``, scope block, ``queries dtype[nq*dim]``.
  Response: ``u32 nq, u32 k, u32 has_payloads, u32 0``, ``scores f32[nq*k]``,
  ``ids i64[nq*k]``, and with payloads ``kinds u8[nq*k]``, ``offsets u64[nq*k+1]``, ``blob``.
- ADD response: ``u64 added, u64 replaced``.
- STATS response, and the message of an error response: UTF-8 text (JSON for STATS).
- Sessions, agent state, event logs and FORGET (ops 6-17): the last section of this module;
  RECALL (op 18) after them.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import NamedTuple, NoReturn

import numpy as np

from kalos.errors import InvalidRequest, PayloadTooLarge, ProtocolMismatch
from kalos.protocol import codes

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


class Scope(NamedTuple):
    """Who a memory belongs to: tenant, user and session, each optional.

    On add, the item's scope. On search, a filter: an item matches when every field given here
    equals the item's field (``Scope("acme")`` matches all of tenant acme's items).
    """

    tenant: str | None = None
    user: str | None = None
    session: str | None = None


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


# -- SEARCH --------------------------------------------------------------------------------


def search_request_size(nq: int, dim: int, itemsize: int, sb: ScopeBytes) -> int:
    return 16 + sb.nbytes + _pad8(nq * dim * itemsize)


def encode_search(buf: np.ndarray, queries: np.ndarray, k: int, sb: ScopeBytes) -> int:
    """Writes a SEARCH body (queries: [nq, dim] f32 or f16, C-contiguous); returns its length."""
    shape = nq, dim = queries.shape
    dtype = queries.dtype
    size = 16 + sb.nbytes + _pad8(queries.nbytes)
    _fit(size, len(buf), "search request")
    _HEAD4.pack_into(buf, 0, nq, k, dim, codes.DTYPE_F16 if dtype.char == "e" else codes.DTYPE_F32)
    off = write_scope(buf, 16, sb)
    np.ndarray(shape, dtype, buf, off)[...] = queries
    return size


class SearchRequest(NamedTuple):
    queries: np.ndarray  # [nq, dim] view into the request arena
    k: int
    scope: Scope


_SEARCH_HEAD = struct.Struct("<IIIIIII")  # nq, k, dim, dtype, then the scope's three lengths


def decode_search(buf: np.ndarray, end: int, with_queries: bool = True) -> SearchRequest:
    """A SEARCH body; ``with_queries`` False (flag SEARCH_GPU_QUERY): the body ends after the
    scope block and ``queries`` is an empty [nq, 0] array (the queries are on the GPU)."""
    _need(32, end)
    nq, k, dim, dtype, a, b, c = _SEARCH_HEAD.unpack_from(buf, 0)
    if a or b or c:
        scope, off = read_scope(buf, 16, end)
    else:  # no scope, the common case: one unpack for both headers
        scope, off = _NO_SCOPE, 32
    if nq == 0 or dim == 0:
        raise InvalidRequest("search needs at least one query of dimension > 0")
    if not with_queries:
        return SearchRequest(np.empty((nq, 0), np.float32), k, scope)
    return SearchRequest(_matrix(buf, off, vector_dtype(dtype), (nq, dim), end), k, scope)


def encode_search_header(buf: np.ndarray, nq: int, dim: int, k: int, sb: ScopeBytes) -> int:
    """A SEARCH body without queries (they are in the channel's GPU buffer)."""
    _HEAD4.pack_into(buf, 0, nq, k, dim, codes.DTYPE_F32)
    return write_scope(buf, 16, sb)


def search_response_size(nq: int, k: int) -> int:
    """Size of a SEARCH response without payloads."""
    return 16 + _pad8(nq * k * 4) + nq * k * 8


def search_response_views(buf: np.ndarray, nq: int, k: int) -> tuple[int, np.ndarray, np.ndarray]:
    """Writes the header of a SEARCH response without payloads and returns (its size, the
    scores [nq, k] f32 and ids [nq, k] i64 views for the results), for a search that writes
    its results in place. The views' offsets depend only on (nq, k)."""
    m = nq * k
    off = 16 + _pad8(m * 4)
    size = off + m * 8
    _fit(size, len(buf), "search response")
    _HEAD4.pack_into(buf, 0, nq, k, 0, 0)
    shape = (nq, k)
    return size, np.ndarray(shape, _F32, buf, 16), np.ndarray(shape, _I64, buf, off)


def encode_search_response(
    buf: np.ndarray,
    scores: np.ndarray,
    ids: np.ndarray,
    payloads: list[tuple[int, bytes]] | None,
) -> int:
    """Writes a SEARCH response (scores [nq,k] f32, ids [nq,k] i64; payloads per hit)."""
    nq, k = ids.shape
    m = nq * k
    off = 16 + _pad8(m * 4)
    size = off + m * 8
    if payloads is not None:
        blob_len = sum(len(p[1]) for p in payloads)
        size += _pad8(m) + (m + 1) * 8 + blob_len
    _fit(size, len(buf), "search response")
    _HEAD4.pack_into(buf, 0, nq, k, 1 if payloads is not None else 0, 0)
    buf[16 : 16 + m * 4].view(np.float32)[:] = scores.reshape(-1)
    buf[off : off + m * 8].view(np.int64)[:] = ids.reshape(-1)
    if payloads is not None:
        off += m * 8
        kinds = buf[off : off + m]
        off += _pad8(m)
        offsets = buf[off : off + (m + 1) * 8].view(np.uint64)
        pos = off + (m + 1) * 8
        start = pos
        for i, (kind, data) in enumerate(payloads):
            kinds[i] = kind
            offsets[i] = pos - start
            if data:
                buf[pos : pos + len(data)] = np.frombuffer(data, np.uint8)
                pos += len(data)
        offsets[m] = pos - start
    return size


def encode_search_device_response(buf: np.ndarray, nq: int, k: int) -> int:
    """The response to a GPU-result SEARCH: the header alone; results are on the GPU."""
    _HEAD4.pack_into(buf, 0, nq, k, 0, 0)
    return 16


class SearchResponse(NamedTuple):
    scores: np.ndarray  # [nq, k] f32 view
    ids: np.ndarray  # [nq, k] i64 view
    payloads: list[str | bytes | None] | None  # nq*k entries, row-major


def decode_search_response(buf: np.ndarray, end: int) -> SearchResponse:
    _need(16, end)
    nq, k, has_payloads, _ = _HEAD4.unpack_from(buf, 0)
    m = nq * k
    off = 16 + _pad8(m * 4)
    _need(off + m * 8, end)
    shape = (nq, k)
    scores, ids = np.ndarray(shape, _F32, buf, 16), np.ndarray(shape, _I64, buf, off)
    if not has_payloads:
        return SearchResponse(scores, ids, None)
    off += m * 8
    kinds = _array(buf, off, np.dtype(np.uint8), m, end)
    off += _pad8(m)
    offsets = _array(buf, off, np.dtype(np.uint64), m + 1, end)
    start = off + (m + 1) * 8
    _need(start + int(offsets[-1]), end)
    blob = buf[start:end].tobytes()
    return SearchResponse(scores, ids, _decode_payloads(kinds, offsets, blob))


def _decode_payloads(
    kinds: np.ndarray, offsets: np.ndarray, blob: bytes
) -> list[str | bytes | None]:
    out: list[str | bytes | None] = []
    bounds = offsets.tolist()
    try:
        for i, kind in enumerate(kinds.tolist()):
            data = blob[bounds[i] : bounds[i + 1]]
            if kind == codes.PAYLOAD_TEXT:
                out.append(data.decode())
            elif kind == codes.PAYLOAD_BYTES:
                out.append(data)
            else:
                out.append(None)
    except UnicodeDecodeError as exc:
        raise InvalidRequest("a text payload is not valid UTF-8") from exc
    return out


# -- ADD -----------------------------------------------------------------------------------


def add_item_sizes(
    dim: int,
    itemsize: int,
    payload_lens: np.ndarray,
    sb: ScopeBytes,
    token_lens: np.ndarray | None = None,
) -> tuple[int, np.ndarray]:
    """Fixed bytes of an ADD body and the bytes each item adds (for chunking bulk adds).
    ``token_lens``: token ids of each item, when the ADD carries token ids."""
    fixed = 16 + sb.nbytes + 8 + 7 + 7  # header, scope, the extra offset, worst-case padding
    per_item = 8 + dim * itemsize + 1 + 8 + payload_lens
    if token_lens is not None:
        fixed += 8 + 7 + 7  # the extra token offset, worst-case padding of the two sections
        per_item = per_item + 1 + 8 + 4 * token_lens
    return fixed, per_item


def _add_size(n: int, vector_bytes: int, blob_len: int, sb: ScopeBytes, n_tokens: int) -> int:
    size = 16 + sb.nbytes + n * 8 + _pad8(vector_bytes) + _pad8(n) + (n + 1) * 8 + blob_len
    if n_tokens >= 0:
        size += _pad8(n) + (n + 1) * 8 + _pad8(4 * n_tokens)
    return size


def encode_add(
    buf: np.ndarray,
    ids: np.ndarray,
    vectors: np.ndarray,
    kinds: np.ndarray,
    blobs: list[bytes],
    sb: ScopeBytes,
    tokens: Sequence[np.ndarray | None] | None = None,
) -> int:
    """Writes an ADD body for ids [n] i64, vectors [n, dim], payload kinds [n] u8 and bytes.

    ``tokens``: None, or per item its token ids (int32 [m]) or None (the sidecar tokenizes a
    text payload when it has a tokenizer); the request then needs flag ADD_HAS_TOKENS."""
    n, dim = vectors.shape
    blob_len = sum(len(b) for b in blobs)
    n_tokens = -1 if tokens is None else sum(0 if t is None else len(t) for t in tokens)
    size = _add_size(n, vectors.nbytes, blob_len, sb, n_tokens)
    _fit(size, len(buf), f"add of {n} items")
    _HEAD4.pack_into(buf, 0, n, dim, wire_dtype(vectors.dtype), 0)
    off = write_scope(buf, 16, sb)
    buf[off : off + n * 8].view(np.int64)[:] = ids
    off += n * 8
    buf[off : off + vectors.nbytes].view(vectors.dtype).reshape(n, dim)[...] = vectors
    off += _pad8(vectors.nbytes)
    buf[off : off + n] = kinds
    off += _pad8(n)
    offsets = buf[off : off + (n + 1) * 8].view(np.uint64)
    offsets[0] = 0
    if blobs:
        np.cumsum([len(b) for b in blobs], out=offsets[1:])
    else:
        offsets[1:] = 0
    off += (n + 1) * 8
    if tokens is not None:
        has = buf[off : off + _pad8(n)]
        has[:] = 0
        has[:n] = [t is not None for t in tokens]
        off += _pad8(n)
        tok_offsets = buf[off : off + (n + 1) * 8].view(np.uint64)
        tok_offsets[0] = 0
        np.cumsum([0 if t is None else len(t) for t in tokens], out=tok_offsets[1:])
        off += (n + 1) * 8
        ids32 = buf[off : off + 4 * n_tokens].view(np.int32)
        pos = 0
        for t in tokens:
            if t is not None and len(t):
                ids32[pos : pos + len(t)] = t
                pos += len(t)
        off += 4 * n_tokens
        buf[off : off + _pad8(4 * n_tokens) - 4 * n_tokens] = 0
        off = _pad8(off)
    if blob_len:
        buf[off : off + blob_len] = np.frombuffer(b"".join(blobs), np.uint8)
    return size


class AddRequest(NamedTuple):
    ids: np.ndarray  # [n] i64 view
    vectors: np.ndarray  # [n, dim] view (f32 or f16)
    kinds: np.ndarray  # [n] u8 view
    offsets: np.ndarray  # [n+1] u64 view, relative to blob
    blob: np.ndarray  # u8 view
    scope: Scope
    # With flag ADD_HAS_TOKENS, per item its token ids (an int32 view into the request), or
    # None (tokenize, when the sidecar can); without the flag: None.
    tokens: list[np.ndarray | None] | None = None


def decode_add(buf: np.ndarray, end: int, flags: int = 0) -> AddRequest:
    _need(16, end)
    n, dim, dtype, _ = _HEAD4.unpack_from(buf, 0)
    scope, off = read_scope(buf, 16, end)
    if n == 0:
        raise InvalidRequest("add needs at least one item")
    ids = _array(buf, off, np.dtype(np.int64), n, end)
    off += n * 8
    dt = vector_dtype(dtype)
    vectors = _array(buf, off, dt, n * dim, end).reshape(n, dim)
    off += _pad8(n * dim * dt.itemsize)
    kinds = _array(buf, off, np.dtype(np.uint8), n, end)
    off += _pad8(n)
    offsets = _array(buf, off, np.dtype(np.uint64), n + 1, end)
    off += (n + 1) * 8
    tokens = None
    if flags & codes.ADD_HAS_TOKENS:
        tokens, off = _decode_add_tokens(buf, off, n, end)
    blob = buf[off:end]
    if offsets[0] != 0 or bool((offsets[1:] < offsets[:-1]).any()):
        raise InvalidRequest("payload offsets are not ascending from 0")
    if int(offsets[-1]) > len(blob):
        raise InvalidRequest("payload offsets point outside the request")
    if bool((kinds > codes.PAYLOAD_BYTES).any()):
        raise InvalidRequest("unknown payload kind")
    _check_text(kinds, offsets, blob)
    return AddRequest(ids, vectors, kinds, offsets, blob, scope, tokens)


def _decode_add_tokens(
    buf: np.ndarray, off: int, n: int, end: int
) -> tuple[list[np.ndarray | None], int]:
    has = _array(buf, off, np.dtype(np.uint8), n, end)
    off += _pad8(n)
    bounds = _array(buf, off, np.dtype(np.uint64), n + 1, end)
    off += (n + 1) * 8
    if bounds[0] != 0 or bool((bounds[1:] < bounds[:-1]).any()):
        raise InvalidRequest("token offsets are not ascending from 0")
    total = int(bounds[-1])
    if total > (end - off) // 4:
        raise InvalidRequest("token offsets point outside the request")
    ids = _array(buf, off, np.dtype(np.int32), total, end)
    b = bounds.tolist()
    tokens: list[np.ndarray | None] = []
    for i, flag in enumerate(has.tolist()):
        if flag:
            tokens.append(ids[b[i] : b[i + 1]])
        elif b[i + 1] != b[i]:
            raise InvalidRequest(f"item {i} has token ids but is not marked as having them")
        else:
            tokens.append(None)
    return tokens, off + _pad8(4 * total)


def _check_text(kinds: np.ndarray, offsets: np.ndarray, blob: np.ndarray) -> None:
    """InvalidRequest unless every text payload is UTF-8: every later search must decode it."""
    text = np.flatnonzero(kinds == codes.PAYLOAD_TEXT).tolist()
    if not text:
        return
    bounds = offsets.tolist()
    data = blob[: bounds[-1]].tobytes()
    for i in text:
        try:
            data[bounds[i] : bounds[i + 1]].decode()
        except UnicodeDecodeError as exc:
            raise InvalidRequest(f"text payload {i} is not valid UTF-8") from exc


def encode_counts(buf: np.ndarray, a: int, b: int = 0) -> int:
    _U64X2.pack_into(buf, 0, a, b)
    return 16


def decode_counts(buf: np.ndarray, end: int) -> tuple[int, int]:
    _need(16, end)
    a, b = _U64X2.unpack_from(buf, 0)
    return int(a), int(b)


# -- REMOVE --------------------------------------------------------------------------------


def encode_remove(buf: np.ndarray, ids: np.ndarray) -> int:
    n = len(ids)
    size = 8 + n * 8
    _fit(size, len(buf), f"remove of {n} ids")
    _HEAD2.pack_into(buf, 0, n, 0)
    buf[8:size].view(np.int64)[:] = ids
    return size


def decode_remove(buf: np.ndarray, end: int) -> np.ndarray:
    _need(8, end)
    n, _ = _HEAD2.unpack_from(buf, 0)
    return _array(buf, 8, np.dtype(np.int64), n, end)


# -- text (STATS, error messages) ----------------------------------------------------------


def encode_text(buf: np.ndarray, text: str) -> int:
    data = text.encode()[: len(buf)]
    buf[: len(data)] = np.frombuffer(data, np.uint8)
    return len(data)


def decode_text(buf: np.ndarray, end: int) -> str:
    return buf[:end].tobytes().decode(errors="replace")


# -- sessions, state, event logs, forget -----------------------------------------------------
#
# A session op names its session in the session field of its scope block; the tenant and
# user fields are the session's owner (APPEND_TURN, LOG_EVENT) or a filter it must match
# (the others). State ops use the scope block as the key's namespace. docs/PROTOCOL.md draws
# every body below.

NO_LIMIT = 0xFFFFFFFF  # max_turns / limit: none
_CTX_HEAD = struct.Struct("<IIQIIII")  # max_tokens, max_turns, 0, then a scope block head
_APPEND_HEAD = struct.Struct("<IIIId")  # n_tokens, role_len, text_len, 0, ttl_s (NaN: keep)
_KEY_HEAD = struct.Struct("<II")  # key_len, 0
_VALUE_HEAD = struct.Struct("<IIQQ")  # key_len, 0, value_len, expected_version
_EVENT_HEAD = struct.Struct("<IIQ")  # kind_len, data_kind, data_len
_EVENTS_HEAD = struct.Struct("<QII")  # since, limit, 0
_U64X4 = struct.Struct("<QQQQ")


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


# APPEND_TURN: u32 n_tokens, u32 role_len, u32 text_len, u32 0, f64 ttl_s (NaN: keep),
# scope block (owner; session = the session id), i32 tokens[n_tokens] padded to 8 (only with
# AppendFlag.HAS_TOKENS), role bytes then text bytes. Response: u64 turns, u64 tokens.


def encode_append_turn(
    buf: np.ndarray,
    sb: ScopeBytes,
    role: bytes,
    text: bytes,
    tokens: np.ndarray | None,
    ttl_s: float | None,
) -> int:
    n = 0 if tokens is None else len(tokens)
    size = 24 + sb.nbytes + _pad8(n * 4) + len(role) + len(text)
    _fit(size, len(buf), "append_turn request")
    ttl = float("nan") if ttl_s is None else float(ttl_s)
    _APPEND_HEAD.pack_into(buf, 0, n, len(role), len(text), 0, ttl)
    off = write_scope(buf, 24, sb)
    if tokens is not None and n:
        buf[off : off + n * 4].view(np.int32)[:] = tokens
    off += _pad8(n * 4)
    if role or text:
        buf[off : off + len(role) + len(text)] = np.frombuffer(role + text, np.uint8)
    return size


class AppendTurnRequest(NamedTuple):
    scope: Scope  # session = the session id
    role: str
    text: str
    tokens: np.ndarray | None  # int32 view into the request, or None: tokenize
    ttl_s: float | None  # None: keep


def decode_append_turn(buf: np.ndarray, end: int, flags: int) -> AppendTurnRequest:
    _need(24, end)
    n, role_len, text_len, _, ttl = _APPEND_HEAD.unpack_from(buf, 0)
    scope, off = read_scope(buf, 24, end)
    session_of(scope)
    tokens = None
    if flags & codes.AppendFlag.HAS_TOKENS:
        tokens = _array(buf, off, np.dtype(np.int32), n, end)
    elif n:
        raise InvalidRequest("token ids sent without the HAS_TOKENS flag")
    off += _pad8(n * 4)
    role = _text_at(buf, off, role_len, end, "the role")
    text = _text_at(buf, off + role_len, text_len, end, "the turn's text")
    return AppendTurnRequest(scope, role, text, tokens, None if ttl != ttl else ttl)


# CONTEXT: u32 max_tokens, u32 max_turns (NO_LIMIT: none), u64 0, scope block (filter;
# session = the session id). Response: u32 n_turns, u32 n_tokens, u32 has_system,
# u32 form (codes.ContextForm), i32 tokens[n_tokens] (with form TOKENS_IN_HEAP instead:
# u64 the ids' byte offset in the token heap, u64 0), and with form TURNS (request flag
# ContextFlag.TURNS): padding to 8, u32 meta[n_turns][4] (role bytes, text bytes, tokens,
# 0), then each turn's role and text bytes. The system prompt, when included, is turn 0
# (never with TOKENS_IN_HEAP: its ids live apart from the turns').
_IN_HEAP = int(codes.ContextForm.TOKENS_IN_HEAP)
_CTX_LENT = struct.Struct("<IIIIQQ")  # the header and the heap offset: 32 bytes
_pack_lent = _CTX_LENT.pack_into
_unpack_lent = _CTX_LENT.unpack_from


_pack_head4 = _HEAD4.pack_into
_unpack_head4 = _HEAD4.unpack_from


def encode_context(
    buf: np.ndarray, session: bytes, max_tokens: int, max_turns: int, sb: ScopeBytes
) -> int:
    """Writes a CONTEXT body with one struct call; returns its length."""
    if sb is EMPTY_SCOPE:  # the common case: no filter
        c = len(session)
        s = _CONTEXT_STRUCTS.get(c) or _context_struct(c)
        if s.size > len(buf):
            _fit(s.size, len(buf), "context request")
        s.pack_into(buf, 0, max_tokens, max_turns, 0, 0, 0, c, 0, session)
        return s.size
    a, b, c = len(sb.tenant), len(sb.user), len(session)
    s = _CONTEXT_STRUCTS.get(a + b + c) or _context_struct(a + b + c)
    if s.size > len(buf):
        _fit(s.size, len(buf), "context request")
    s.pack_into(buf, 0, max_tokens, max_turns, 0, a, b, c, 0, sb.tenant + sb.user + session)
    return s.size


_CONTEXT_STRUCTS: dict[int, struct.Struct] = {}


def _context_struct(n: int) -> struct.Struct:
    s = _CONTEXT_STRUCTS.get(n)
    if s is None:
        s = _CONTEXT_STRUCTS[n] = struct.Struct(f"<IIQIIII{_pad8(n)}s")
    return s


ContextRequest = tuple[str, int, "int | None", "Scope | None"]
"""(session, max_tokens, max_turns or None, tenant/user filter or None). A plain tuple, like
the other CONTEXT helpers' results: a NamedTuple costs ~0.25 µs to build on this hot path."""


def decode_context(buf: np.ndarray, end: int) -> ContextRequest:
    if end < 32:
        _need(32, end)
    # The body is small (header, scope): one copy into bytes, then every field is read from
    # that, ~0.1 µs less than unpacking the numpy view and copying the session id out of it.
    # The copy is bounded: a body padded with megabytes costs no more than it must.
    raw = buf[: min(end, _CTX_COPY)].tobytes()
    max_tokens, max_turns, _, a, b, c, _ = _unpack_ctx_head(raw)
    if 32 + a + b + c > len(raw):
        if 32 + a + b + c > end:
            _need(32 + a + b + c, end)
        raw = buf[: 32 + a + b + c].tobytes()  # long ids: the bytes the fields take
    try:
        if a or b:
            session = raw[32 + a + b : 32 + a + b + c].decode()
            scope = Scope(
                raw[32 : 32 + a].decode() or None, raw[32 + a : 32 + a + b].decode() or None
            )
        else:  # the common case: no filter
            session = raw[32 : 32 + c].decode()
            scope = None
    except UnicodeDecodeError as exc:
        raise InvalidRequest("scope is not valid UTF-8") from exc
    if not session:
        raise InvalidRequest("a session id is required")
    return session, max_tokens, None if max_turns == NO_LIMIT else max_turns, scope


_unpack_ctx_head = _CTX_HEAD.unpack_from
_CTX_COPY = 256  # decode_context's first copy: the header and the usual ids


def encode_context_response(
    buf: np.ndarray,
    tokens: memoryview | bytes,
    meta: memoryview | bytes,
    text: memoryview | bytes,
    system: tuple[int, bytes, bytes, bytes] | None,
    turns: bool = True,
    heap_at: int = -1,
) -> int:
    """Writes a CONTEXT response, one copy per piece: the system prompt's (n_tokens, tokens,
    meta, text) first, when given, then the turns' tokens (int32 as bytes) and, with
    ``turns``, their meta (uint32 [m, 4] as bytes) and text. ``heap_at`` >= 0 (no system
    prompt): the tokens are at that byte offset of the token heap, and only it is written."""
    if not turns:
        return encode_context_tokens_response(buf, tokens, len(meta) >> 4, system, heap_at)
    nt, nm, nx = len(tokens), len(meta), len(text)  # bytes
    if heap_at >= 0:
        size = 32 + nm + nx
        if size > len(buf):
            _fit(size, len(buf), "context response")
        _pack_lent(buf, 0, nm >> 4, nt >> 2, 0, _IN_HEAP | 1, heap_at, 0)
        mv = memoryview(buf)
        mv[32 : 32 + nm] = meta
        mv[32 + nm : size] = text
        return size
    st = sm = sx = 0
    if system is not None:
        st, sm, sx = len(system[1]), 16, len(system[3])
    tok_end = 16 + st + nt
    mv = memoryview(buf)
    meta_at = (tok_end + 7) & ~7
    text_at = meta_at + sm + nm
    size = text_at + sx + nx
    if size > len(buf):
        _fit(size, len(buf), "context response")
    _HEAD4.pack_into(buf, 0, (sm + nm) >> 4, (st + nt) >> 2, sm >> 4, 1)
    if system is not None:
        mv[16 : 16 + st] = system[1]
        mv[meta_at : meta_at + 16] = system[2]
        mv[text_at : text_at + sx] = system[3]
    mv[16 + st : tok_end] = tokens
    if meta_at != tok_end:
        mv[tok_end:meta_at] = b"\0\0\0\0"  # padding: never leave an older response's bytes
    mv[meta_at + sm : text_at] = meta
    mv[text_at + sx : size] = text
    return size


def encode_context_tokens_response(
    buf: np.ndarray,
    tokens: memoryview | bytes,
    n_turns: int,
    system: tuple[int, bytes, bytes, bytes] | None,
    heap_at: int = -1,
) -> int:
    """Writes a CONTEXT response without the turns (form 0): the header, then the
    system prompt's token ids when given, then ``tokens`` (int32 as bytes) of ``n_turns``
    conversation turns. ``heap_at`` >= 0 (no system prompt): the tokens are at that byte
    offset of the token heap, and only it is written (form TOKENS_IN_HEAP, 32 bytes)."""
    nt = len(tokens)
    if heap_at >= 0:
        if len(buf) < 32:
            _fit(32, len(buf), "context response")
        _pack_lent(buf, 0, n_turns, nt >> 2, 0, _IN_HEAP, heap_at, 0)
        return 32
    if system is None:
        end = 16 + nt
        if end > len(buf):
            _fit(end, len(buf), "context response")
        _pack_head4(buf, 0, n_turns, nt >> 2, 0, 0)
        memoryview(buf)[16:end] = tokens
        return end
    st = len(system[1])
    end = 16 + st + nt
    if end > len(buf):
        _fit(end, len(buf), "context response")
    _pack_head4(buf, 0, n_turns + 1, (st + nt) >> 2, 1, 0)
    mv = memoryview(buf)
    mv[16 : 16 + st] = system[1]
    mv[16 + st : end] = tokens
    return end


ContextResponse = tuple[np.ndarray, "bytes | None", "bytes | None", bool]
"""(tokens: int32 [n_tokens] view into the response or the token heap, meta: u32
[n_turns][4] copied, text: the turns' role and text bytes copied, has_system); meta and text
are None when the request did not ask for the turns."""


_frombuffer = np.frombuffer
_I32 = np.dtype(np.int32)


def decode_context_response(
    buf: np.ndarray, end: int, heap: np.ndarray | None = None
) -> ContextResponse:
    """``heap``: the channel's read-only mapping of the token heap as int32, when it has
    one: ids by reference become a slice of it (a view: ~0.1 µs, a third of frombuffer's)."""
    if end >= 32:  # one struct call for the header and, by reference, the ids' offset
        nm, nt, has_system, form, at, _ = _unpack_lent(buf, 0)
    else:
        if end < 16:
            _need(16, end)
        nm, nt, has_system, form = _unpack_head4(buf, 0)
        at = 0
    if form & _IN_HEAP:
        if end < 32:
            _need(32, end)
        i = at >> 2
        if heap is None or at & 3 or i + nt > len(heap):
            _bad_heap_ref(at, nt, heap)
        if form == _IN_HEAP:  # by reference, no turns: the shm fast path
            return heap[i : i + nt], None, None, False
        _need(32 + 16 * nm, end)
        mv = memoryview(buf)
        meta = bytes(mv[32 : 32 + 16 * nm])
        return heap[i : i + nt], meta, bytes(mv[32 + 16 * nm : end]), False
    tok_end = 16 + 4 * nt
    if not form:
        if tok_end > end:
            _need(tok_end, end)
        return _frombuffer(buf, _I32, nt, 16), None, None, has_system != 0
    meta_at = (tok_end + 7) & ~7
    text_at = meta_at + 16 * nm
    _need(text_at, end)
    mv = memoryview(buf)
    return (
        np.frombuffer(buf, np.int32, nt, 16),
        bytes(mv[meta_at:text_at]),
        bytes(mv[text_at:end]),
        bool(has_system),
    )


def _bad_heap_ref(at: int, nt: int, heap: np.ndarray | None) -> NoReturn:
    if heap is None:
        raise ProtocolMismatch(
            "a CONTEXT response refers to the token heap, which this channel does not map"
        )
    raise ProtocolMismatch(
        f"a CONTEXT response refers to {nt} token ids at byte {at} of a {4 * len(heap)}-byte heap"
    )


def split_turns(meta: bytes, text: bytes) -> list[tuple[str, str]]:
    """(role, text) of each turn of a CONTEXT response."""
    out = []
    x = 0
    try:
        whole = text.decode()
    except UnicodeDecodeError as exc:
        raise InvalidRequest("a turn's text is not valid UTF-8") from exc
    if len(whole) == len(text):  # ASCII: byte offsets are character offsets, slice the str
        for role_len, text_len, _n, _ in struct.iter_unpack("<IIII", meta):
            y = x + role_len
            out.append((whole[x:y], whole[y : y + text_len]))
            x = y + text_len
        return out
    try:
        for role_len, text_len, _n, _ in struct.iter_unpack("<IIII", meta):
            out.append(
                (
                    text[x : x + role_len].decode(),
                    text[x + role_len : x + role_len + text_len].decode(),
                )
            )
            x += role_len + text_len
    except UnicodeDecodeError as exc:
        raise InvalidRequest("a turn's text is not valid UTF-8") from exc
    return out


def turn_token_counts(meta: bytes) -> np.ndarray:
    """Token ids of each turn of a CONTEXT response, int64 [n_turns]."""
    return np.frombuffer(meta, np.uint32).reshape(-1, 4)[:, 2].astype(np.int64)


# Session ops with a scope block and a small header: SESSIONS (u32 limit, u32 after_len, scope
# block as filter, after bytes padded to 8; response UTF-8 JSON {"sessions": [...], "more"}),
# TRIM (u32 keep_turns, u32 0, scope block; response u64 dropped, u64 turns left),
# DELETE_SESSION and FORGET (scope block only; responses u64 1, u64 0 and u64 memories,
# u64 sessions, u64 state values, u64 event logs).


def encode_scoped(buf: np.ndarray, a: int, b: int, sb: ScopeBytes, tail: bytes = b"") -> int:
    """``u32 a, u32 b``, a scope block, then ``tail`` padded to 8."""
    size = 8 + sb.nbytes + _pad8(len(tail))
    _fit(size, len(buf), "request")
    _HEAD2.pack_into(buf, 0, a, b)
    off = write_scope(buf, 8, sb)
    _put_bytes(buf, off, tail)
    return size


def decode_scoped(buf: np.ndarray, end: int) -> tuple[int, int, Scope, int]:
    """(a, b, scope, offset after the scope block) of an :func:`encode_scoped` body."""
    _need(8, end)
    a, b = _HEAD2.unpack_from(buf, 0)
    scope, off = read_scope(buf, 8, end)
    return a, b, scope, off


def decode_sessions(buf: np.ndarray, end: int) -> tuple[Scope, int | None, str | None]:
    """SESSIONS → (filter, limit or None, after or None)."""
    limit, after_len, scope, off = decode_scoped(buf, end)
    after = _text_at(buf, off, after_len, end, "the cursor") if after_len else None
    return scope, None if limit == NO_LIMIT else limit, after


def encode_forgotten(buf: np.ndarray, counts: tuple[int, int, int, int]) -> int:
    _U64X4.pack_into(buf, 0, *counts)
    return 32


def decode_forgotten(buf: np.ndarray, end: int) -> tuple[int, int, int, int]:
    _need(32, end)
    return _U64X4.unpack_from(buf, 0)


# STATE_PUT and STATE_CAS: u32 key_len, u32 0, u64 value_len, u64 expected_version (CAS; 0:
# must not exist), scope block (namespace), key bytes padded to 8, value bytes. Response:
# u64 version, u64 0. STATE_GET and STATE_DELETE: u32 key_len, u32 0, scope block, key bytes.
# Responses: GET u64 version, u64 value_len, value bytes; DELETE u64 existed, u64 0.


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


# -- RECALL ----------------------------------------------------------------------------------
#
# RECALL: u32 k, u32 dim, u32 dtype, u32 max_tokens, u32 max_turns (NO_LIMIT: none),
# u32 memory_tokens (NO_LIMIT: no cap but the budget), u32 session_len, u32 0, scope block
# (the memory filter; its tenant and user also filter the session), session id bytes padded
# to 8, query dtype[dim] padded to 8. Flag RecallFlag.GPU_RESULT: the token ids go into the
# channel's GPU buffer.
# Response: u32 k, u32 n_hits, u32 n_tokens, u32 flags (RecallResponseFlag), u32 system_tokens,
# u32 n_turns, u32 turn_tokens, u32 0, u64 context_ns, u64 search_ns, u64 assemble_ns,
# f32 scores[k] padded to 8, i64 ids[k], i32 memory_tokens[k] padded to 8 (token ids of each
# hit in the assembly; 0: none or not included), u8 kinds[k] padded to 8, u64 offsets[k+1],
# i32 tokens[n_tokens] padded to 8 (absent with TOKENS_ON_GPU), payload bytes. The token ids
# are [system prompt] + [included memories, best hit first] + [turns, oldest first].

_RECALL_HEAD = struct.Struct("<IIIIIIII")
_RECALL_RESP_HEAD = struct.Struct("<IIIIIIIIQQQ")  # 56 bytes
_RECALL_PARTS = struct.Struct("<QQQ")
RECALL_PARTS_AT = 32  # offset of context_ns, search_ns, assemble_ns in a RECALL response


def recall_request_size(dim: int, itemsize: int, session_len: int, sb: ScopeBytes) -> int:
    return 32 + sb.nbytes + _pad8(session_len) + _pad8(dim * itemsize)


def encode_recall(
    buf: np.ndarray,
    session: bytes,
    query: np.ndarray,
    k: int,
    max_tokens: int,
    max_turns: int,
    memory_tokens: int,
    sb: ScopeBytes,
) -> int:
    """Writes a RECALL body (query: [dim] or [1, dim] f32 or f16, C-contiguous; max_turns and
    memory_tokens NO_LIMIT for none); returns its length."""
    q = query.reshape(-1)
    size = recall_request_size(len(q), q.itemsize, len(session), sb)
    _fit(size, len(buf), "recall request")
    _RECALL_HEAD.pack_into(
        buf, 0, k, len(q), wire_dtype(q.dtype), max_tokens, max_turns, memory_tokens,
        len(session), 0,
    )  # fmt: skip
    off = _put_bytes(buf, write_scope(buf, 32, sb), session)
    buf[off : off + q.nbytes].view(q.dtype)[:] = q
    return size


class RecallRequest(NamedTuple):
    session: str
    query: np.ndarray  # [1, dim] view into the request arena
    k: int
    max_tokens: int
    max_turns: int | None
    memory_tokens: int | None  # cap on the memories' token ids; None: the budget alone
    scope: Scope  # memory filter; its tenant and user also filter the session


def decode_recall(buf: np.ndarray, end: int) -> RecallRequest:
    _need(32, end)
    k, dim, dtype, max_tokens, max_turns, memory_tokens, session_len, _ = _RECALL_HEAD.unpack_from(
        buf, 0
    )
    scope, off = read_scope(buf, 32, end)
    session = _text_at(buf, off, session_len, end, "the session id")
    if not session:
        raise InvalidRequest("a session id is required")
    off += _pad8(session_len)
    if dim == 0:
        raise InvalidRequest("recall needs a query of dimension > 0")
    q = _array(buf, off, vector_dtype(dtype), dim, end).reshape(1, dim)
    return RecallRequest(
        session,
        q,
        k,
        max_tokens,
        None if max_turns == NO_LIMIT else max_turns,
        None if memory_tokens == NO_LIMIT else memory_tokens,
        scope,
    )


def recall_response_size(k: int, blob_len: int, n_tokens: int) -> int:
    """Bytes of a RECALL response of ``k`` hits, ``blob_len`` payload bytes and ``n_tokens``
    token ids in the body (0 when they go to the GPU)."""
    return 56 + _pad8(4 * k) + 8 * k + _pad8(4 * k) + _pad8(k) + 8 * (k + 1) + _pad8(
        4 * n_tokens
    ) + blob_len  # fmt: skip


def encode_recall_response(
    buf: np.ndarray,
    scores: np.ndarray,
    ids: np.ndarray,
    memory_tokens: Sequence[int],
    payloads: Sequence[tuple[int, bytes]],
    pieces: Sequence[bytes | memoryview] | None,
    *,
    n_tokens: int,
    system_tokens: int,
    n_turns: int,
    turn_tokens: int,
    flags: int,
) -> int:
    """Writes a RECALL response without its parts' timings (:func:`set_recall_parts`).

    ``scores`` [k] f32, ``ids`` [k] i64, ``memory_tokens`` [k], ``payloads`` (kind, bytes) per
    hit; ``pieces``: the token ids as int32 bytes, in order (system prompt, memories, turns),
    one copy each, ``n_tokens`` ids in all; None: they are on the GPU (flag TOKENS_ON_GPU).
    Built with struct and memoryview copies: a handful of numpy calls would cost more than
    the whole of a small response (k = 5).
    """
    k = len(ids)
    datas = [p[1] for p in payloads]
    blob_len = sum(map(len, datas))
    in_body = 0 if pieces is None else n_tokens
    size = recall_response_size(k, blob_len, in_body)
    if size > len(buf):
        _fit(size, len(buf), "recall response")
    id_list = ids.tolist()
    n_hits = k - id_list.count(-1)
    mv = memoryview(buf)
    _RECALL_RESP_HEAD.pack_into(
        buf, 0, k, n_hits, n_tokens, flags, system_tokens, n_turns, turn_tokens, 0, 0, 0, 0
    )
    off = 56
    pad = _pad8(4 * k) - 4 * k
    mv[off : off + 4 * k] = np.ascontiguousarray(scores, "<f4").tobytes()
    mv[off + 4 * k : off + 4 * k + pad] = b"\0\0\0\0"[:pad]
    off += 4 * k + pad
    struct.pack_into(f"<{k}q", buf, off, *id_list)
    off += 8 * k
    struct.pack_into(f"<{k}i{pad}x", buf, off, *memory_tokens)
    off += 4 * k + pad
    kpad = _pad8(k)
    mv[off : off + kpad] = bytes([p[0] for p in payloads]).ljust(kpad, b"\0")
    off += kpad
    bounds = [0]
    for d in datas:
        bounds.append(bounds[-1] + len(d))
    struct.pack_into(f"<{k + 1}Q", buf, off, *bounds)
    off += 8 * (k + 1)
    if pieces is not None:
        pos = off
        for piece in pieces:
            end = pos + len(piece)
            mv[pos:end] = piece
            pos = end
        if pos != off + 4 * n_tokens:
            raise ValueError("the token pieces do not add up to n_tokens")
        off = _pad8(pos)
        mv[pos:off] = b"\0\0\0\0"[: off - pos]
    if blob_len:
        mv[off : off + blob_len] = b"".join(datas)
    return size


def set_recall_parts(buf: np.ndarray, context_ns: int, search_ns: int, assemble_ns: int) -> None:
    """Writes the sidecar's time per part into an encoded RECALL response."""
    _RECALL_PARTS.pack_into(buf, RECALL_PARTS_AT, context_ns, search_ns, assemble_ns)


class RecallResponse(NamedTuple):
    scores: np.ndarray  # [k] f32 view
    ids: np.ndarray  # [k] i64 view
    memory_tokens: np.ndarray  # [k] i32 view
    tokens: np.ndarray | None  # [n_tokens] i32 view; None: on the GPU
    payloads: list[str | bytes | None]  # k entries
    n_hits: int
    n_tokens: int
    flags: int  # RecallResponseFlag
    system_tokens: int
    n_turns: int
    turn_tokens: int
    context_ns: int
    search_ns: int
    assemble_ns: int


def decode_recall_response(buf: np.ndarray, end: int) -> RecallResponse:
    _need(56, end)
    (k, n_hits, n_tokens, flags, system_tokens, n_turns, turn_tokens, _,
     context_ns, search_ns, assemble_ns) = _RECALL_RESP_HEAD.unpack_from(buf, 0)  # fmt: skip
    at_ids = 56 + _pad8(4 * k)
    at_counts = at_ids + 8 * k
    at_kinds = at_counts + _pad8(4 * k)
    at_offsets = at_kinds + _pad8(k)
    off = at_offsets + 8 * (k + 1)
    _need(off, end)
    scores = np.frombuffer(buf, np.float32, k, 56)  # views: no copy
    ids = np.frombuffer(buf, np.int64, k, at_ids)
    memory_tokens = np.frombuffer(buf, np.int32, k, at_counts)
    tokens = None
    if not flags & codes.RecallResponseFlag.TOKENS_ON_GPU:
        _need(off + 4 * n_tokens, end)
        tokens = np.frombuffer(buf, np.int32, n_tokens, off)
        off += _pad8(4 * n_tokens)
    kinds = bytes(buf[at_kinds : at_kinds + k])
    bounds = struct.unpack_from(f"<{k + 1}Q", buf, at_offsets)
    if bounds[0] != 0 or any(bounds[i + 1] < bounds[i] for i in range(k)):
        raise InvalidRequest("payload offsets are not ascending from 0")
    _need(off + bounds[-1], end)
    blob = bytes(buf[off : off + bounds[-1]])
    payloads: list[str | bytes | None] = []
    try:
        for i in range(k):
            kind = kinds[i]
            if kind == codes.PAYLOAD_TEXT:
                payloads.append(blob[bounds[i] : bounds[i + 1]].decode())
            elif kind == codes.PAYLOAD_BYTES:
                payloads.append(blob[bounds[i] : bounds[i + 1]])
            else:
                payloads.append(None)
    except UnicodeDecodeError as exc:
        raise InvalidRequest("a text payload is not valid UTF-8") from exc
    return RecallResponse(
        scores, ids, memory_tokens, tokens, payloads, n_hits, n_tokens, flags, system_tokens,
        n_turns, turn_tokens, context_ns, search_ns, assemble_ns,
    )  # fmt: skip


class SessionInfo(NamedTuple):
    """One session, as SESSIONS lists it (JSON objects with these keys)."""

    session: str
    tenant: str | None
    user: str | None
    turns: int
    tokens: int  # token ids of the turns, without the system prompt
    system: bool  # whether a system prompt is pinned
    ttl_s: float | None
    expires_at: float | None  # seconds since the epoch; None: never


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
