"""Request and response bodies: how each op's arguments lie in a channel arena.

Both sides use these functions: the client encodes requests and decodes responses, the sidecar
decodes requests and encodes responses. Every function works on a ``uint8`` numpy array over
an arena (or a socket buffer) so that vectors and results are written and read in place:
decoders return numpy *views* into that memory, valid until the buffer is reused.

Every section of a body starts 8-byte aligned. Layouts (little-endian):

- scope block: ``u32 tenant_len, u32 user_len, u32 session_len, u32 0``, then the UTF-8
  bytes, padded to 8.
- ADD: ``u32 n, u32 dim, u32 dtype, u32 0``, scope block, ``ids i64[n]``,
  ``vectors dtype[n*dim]``, ``kinds u8[n]``, ``offsets u64[n+1]``, ``blob``.
- REMOVE: ``u32 n, u32 0``, ``ids i64[n]``.  Response: ``u64 removed``.
- SEARCH: ``u32 nq, u32 k, u32 dim, u32 dtype``, scope block, ``queries dtype[nq*dim]``.
  Response: ``u32 nq, u32 k, u32 has_payloads, u32 0``, ``scores f32[nq*k]``,
  ``ids i64[nq*k]``, and with payloads ``kinds u8[nq*k]``, ``offsets u64[nq*k+1]``, ``blob``.
- ADD response: ``u64 added, u64 replaced``.
- STATS response, and the message of an error response: UTF-8 text (JSON for STATS).
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import numpy as np

from kalos.errors import InvalidRequest, PayloadTooLarge
from kalos.protocol import codes

_HEAD4 = struct.Struct("<IIII")
_HEAD2 = struct.Struct("<II")
_U64 = struct.Struct("<Q")
_U64X2 = struct.Struct("<QQ")

_DTYPES: dict[int, np.dtype] = {
    codes.DTYPE_F32: np.dtype(np.float32),
    codes.DTYPE_F16: np.dtype(np.float16),
}


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
    nq, dim = queries.shape
    size = search_request_size(nq, dim, queries.itemsize, sb)
    _fit(size, len(buf), "search request")
    _HEAD4.pack_into(buf, 0, nq, k, dim, wire_dtype(queries.dtype))
    off = write_scope(buf, 16, sb)
    buf[off : off + queries.nbytes].view(queries.dtype).reshape(nq, dim)[...] = queries
    return size


class SearchRequest(NamedTuple):
    queries: np.ndarray  # [nq, dim] view into the request arena
    k: int
    scope: Scope


def decode_search(buf: np.ndarray, end: int) -> SearchRequest:
    _need(16, end)
    nq, k, dim, dtype = _HEAD4.unpack_from(buf, 0)
    scope, off = read_scope(buf, 16, end)
    if nq == 0 or dim == 0:
        raise InvalidRequest("search needs at least one query of dimension > 0")
    q = _array(buf, off, vector_dtype(dtype), nq * dim, end).reshape(nq, dim)
    return SearchRequest(q, k, scope)


def search_response_size(nq: int, k: int) -> int:
    """Size of a SEARCH response without payloads."""
    return 16 + _pad8(nq * k * 4) + nq * k * 8


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


class SearchResponse(NamedTuple):
    scores: np.ndarray  # [nq, k] f32 view
    ids: np.ndarray  # [nq, k] i64 view
    payloads: list[str | bytes | None] | None  # nq*k entries, row-major


def decode_search_response(buf: np.ndarray, end: int) -> SearchResponse:
    _need(16, end)
    nq, k, has_payloads, _ = _HEAD4.unpack_from(buf, 0)
    m = nq * k
    scores = _array(buf, 16, np.dtype(np.float32), m, end).reshape(nq, k)
    off = 16 + _pad8(m * 4)
    ids = _array(buf, off, np.dtype(np.int64), m, end).reshape(nq, k)
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
    dim: int, itemsize: int, payload_lens: np.ndarray, sb: ScopeBytes
) -> tuple[int, np.ndarray]:
    """Fixed bytes of an ADD body and the bytes each item adds (for chunking bulk adds)."""
    fixed = 16 + sb.nbytes + 8 + 7 + 7  # header, scope, the extra offset, worst-case padding
    per_item = 8 + dim * itemsize + 1 + 8 + payload_lens
    return fixed, per_item


def encode_add(
    buf: np.ndarray,
    ids: np.ndarray,
    vectors: np.ndarray,
    kinds: np.ndarray,
    blobs: list[bytes],
    sb: ScopeBytes,
) -> int:
    """Writes an ADD body for ids [n] i64, vectors [n, dim], payload kinds [n] u8 and bytes."""
    n, dim = vectors.shape
    blob_len = sum(len(b) for b in blobs)
    size = 16 + sb.nbytes + n * 8 + _pad8(vectors.nbytes) + _pad8(n) + (n + 1) * 8 + blob_len
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


def decode_add(buf: np.ndarray, end: int) -> AddRequest:
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
    blob = buf[off:end]
    if offsets[0] != 0 or bool((offsets[1:] < offsets[:-1]).any()):
        raise InvalidRequest("payload offsets are not ascending from 0")
    if int(offsets[-1]) > len(blob):
        raise InvalidRequest("payload offsets point outside the request")
    if bool((kinds > codes.PAYLOAD_BYTES).any()):
        raise InvalidRequest("unknown payload kind")
    _check_text(kinds, offsets, blob)
    return AddRequest(ids, vectors, kinds, offsets, blob, scope)


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
