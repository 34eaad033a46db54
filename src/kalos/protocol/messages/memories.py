"""Memory ops: SEARCH, ADD and REMOVE (the bodies :mod:`kalos.stores.memories` serves)."""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from kalos.errors import InvalidRequest
from kalos.protocol import codes
from kalos.protocol.messages.common import (
    _F32,
    _HEAD2,
    _HEAD4,
    _I64,
    _NO_SCOPE,
    _U64X2,
    ScopeBytes,
    _array,
    _fit,
    _matrix,
    _need,
    _pad8,
    json_section_size,
    read_json_section,
    read_scope,
    vector_dtype,
    wire_dtype,
    write_json_section,
    write_scope,
)
from kalos.types import Scope


def _json(data: bytes, what: str) -> object:
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise InvalidRequest(f"{what} is not valid JSON: {exc}") from None


# -- SEARCH --------------------------------------------------------------------------------


def search_request_size(nq: int, dim: int, itemsize: int, sb: ScopeBytes) -> int:
    return 16 + sb.nbytes + _pad8(nq * dim * itemsize)


def encode_search(
    buf: np.ndarray,
    queries: np.ndarray,
    k: int,
    sb: ScopeBytes,
    where: bytes | None = None,
    nprobe: int = 0,
) -> int:
    """Writes a SEARCH body (queries: [nq, dim] f32 or f16, C-contiguous); returns its length.
    ``where``: a filter's JSON (kalos.filters), sent with flag SEARCH_FILTER. ``nprobe``
    (not 0): the probe count section, sent with flag SEARCH_NPROBE (1.6)."""
    shape = nq, dim = queries.shape
    dtype = queries.dtype
    size = 16 + sb.nbytes + _pad8(queries.nbytes)
    if nprobe:
        size += 8
    if where is not None:
        size += json_section_size(where)
    _fit(size, len(buf), "search request")
    _HEAD4.pack_into(buf, 0, nq, k, dim, codes.DTYPE_F16 if dtype.char == "e" else codes.DTYPE_F32)
    off = write_scope(buf, 16, sb)
    if nprobe:
        _NPROBE.pack_into(buf, off, nprobe, 0)
        off += 8
    if where is not None:
        off = write_json_section(buf, off, where)
    np.ndarray(shape, dtype, buf, off)[...] = queries
    return size


class SearchRequest(NamedTuple):
    queries: np.ndarray  # [nq, dim] view into the request arena
    k: int
    scope: Scope
    where: bytes | None = None  # the filter's JSON (flag SEARCH_FILTER)
    nprobe: int = 0  # lists an approximate index probes (flag SEARCH_NPROBE); 0: its own


_SEARCH_HEAD = struct.Struct("<IIIIIII")  # nq, k, dim, dtype, then the scope's three lengths
_NPROBE = struct.Struct("<II")  # nprobe, 0


def decode_search(
    buf: np.ndarray, end: int, with_queries: bool = True, flags: int = 0
) -> SearchRequest:
    """A SEARCH body; ``with_queries`` False (flag SEARCH_GPU_QUERY): the body ends after the
    scope block and ``queries`` is an empty [nq, 0] array (the queries are on the GPU). With
    flag SEARCH_NPROBE the probe count (``u32 nprobe, u32 0``) follows the scope block; with
    flag SEARCH_FILTER a JSON section (the filter) follows those."""
    _need(32, end)
    nq, k, dim, dtype, a, b, c = _SEARCH_HEAD.unpack_from(buf, 0)
    if a or b or c:
        scope, off = read_scope(buf, 16, end)
    else:  # no scope, the common case: one unpack for both headers
        scope, off = _NO_SCOPE, 32
    if nq == 0 or dim == 0:
        raise InvalidRequest("search needs at least one query of dimension > 0")
    nprobe = 0
    if flags & codes.SEARCH_NPROBE:
        _need(off + 8, end)
        nprobe = _NPROBE.unpack_from(buf, off)[0]
        off += 8
    where = None
    if flags & codes.SEARCH_FILTER:
        where, off = read_json_section(buf, off, end)
    if not with_queries:
        return SearchRequest(np.empty((nq, 0), np.float32), k, scope, where, nprobe)
    queries = _matrix(buf, off, vector_dtype(dtype), (nq, dim), end)
    return SearchRequest(queries, k, scope, where, nprobe)


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
    entries: bytes | None = None,
) -> int:
    """Writes a SEARCH response (scores [nq,k] f32, ids [nq,k] i64; payloads per hit).
    ``entries``: the JSON ``[[string id or null, metadata or null], ...]`` of every hit
    (flag SEARCH_WANT_META; the header's fourth word 1), a section right after the ids."""
    nq, k = ids.shape
    m = nq * k
    off = 16 + _pad8(m * 4)
    size = off + m * 8
    if entries is not None:
        size += json_section_size(entries)
    if payloads is not None:
        blob_len = sum(len(p[1]) for p in payloads)
        size += _pad8(m) + (m + 1) * 8 + blob_len
    _fit(size, len(buf), "search response")
    _HEAD4.pack_into(
        buf, 0, nq, k, 1 if payloads is not None else 0, 1 if entries is not None else 0
    )
    buf[16 : 16 + m * 4].view(np.float32)[:] = scores.reshape(-1)
    buf[off : off + m * 8].view(np.int64)[:] = ids.reshape(-1)
    if entries is not None:
        off = write_json_section(buf, off + m * 8, entries) - m * 8
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
    entries: list[list[Any]] | None = None  # nq*k [string id, metadata], with SEARCH_WANT_META


def decode_search_response(buf: np.ndarray, end: int) -> SearchResponse:
    _need(16, end)
    nq, k, has_payloads, has_entries = _HEAD4.unpack_from(buf, 0)
    m = nq * k
    off = 16 + _pad8(m * 4)
    _need(off + m * 8, end)
    shape = (nq, k)
    scores, ids = np.ndarray(shape, _F32, buf, 16), np.ndarray(shape, _I64, buf, off)
    entries: list[list[Any]] | None = None
    if has_entries:
        raw, after = read_json_section(buf, off + m * 8, end)
        entries = _json(raw, "the hits' metadata")  # type: ignore[assignment]
        off = after - m * 8
    if not has_payloads:
        return SearchResponse(scores, ids, None, entries)
    off += m * 8
    kinds = _array(buf, off, np.dtype(np.uint8), m, end)
    off += _pad8(m)
    offsets = _array(buf, off, np.dtype(np.uint64), m + 1, end)
    start = off + (m + 1) * 8
    _need(start + int(offsets[-1]), end)
    blob = buf[start:end].tobytes()
    return SearchResponse(scores, ids, _decode_payloads(kinds, offsets, blob), entries)


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
    meta_lens: np.ndarray | None = None,
) -> tuple[int, np.ndarray]:
    """Fixed bytes of an ADD body and the bytes each item adds (for chunking bulk adds).
    ``token_lens``: token ids of each item, when the ADD carries token ids. ``meta_lens``:
    bytes of each item's metadata and string id JSON (with its separators), with
    ADD_HAS_META."""
    fixed = 16 + sb.nbytes + 8 + 7 + 7  # header, scope, the extra offset, worst-case padding
    per_item = 8 + dim * itemsize + 1 + 8 + payload_lens
    if token_lens is not None:
        fixed += 8 + 7 + 7  # the extra token offset, worst-case padding of the two sections
        per_item = per_item + 1 + 8 + 4 * token_lens
    if meta_lens is not None:
        fixed += 16 + 7 + len(_META_OPEN) + len(_META_MID) + len(_META_CLOSE)
        per_item = per_item + meta_lens
    return fixed, per_item


# The metadata section of an ADD: {"meta": [m0, m1, ...], "keys": [k0, k1, ...]}, each entry
# an item's metadata object (or null) and its string id (or null).
_META_OPEN, _META_MID, _META_CLOSE = b'{"meta":[', b'],"keys":[', b"]}"


def add_meta_json(meta: Sequence[bytes], keys: Sequence[bytes]) -> bytes:
    """The metadata section's JSON from each item's metadata and string id, as JSON each."""
    return _META_OPEN + b",".join(meta) + _META_MID + b",".join(keys) + _META_CLOSE


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
    meta: bytes | None = None,
) -> int:
    """Writes an ADD body for ids [n] i64, vectors [n, dim], payload kinds [n] u8 and bytes.

    ``tokens``: None, or per item its token ids (int32 [m]) or None (the sidecar tokenizes a
    text payload when it has a tokenizer); the request then needs flag ADD_HAS_TOKENS.
    ``meta``: the metadata section's JSON (:func:`add_meta_json`), with flag ADD_HAS_META."""
    n, dim = vectors.shape
    blob_len = sum(len(b) for b in blobs)
    n_tokens = -1 if tokens is None else sum(0 if t is None else len(t) for t in tokens)
    size = _add_size(n, vectors.nbytes, blob_len, sb, n_tokens)
    if meta is not None:
        size += json_section_size(meta)
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
    if meta is not None:
        off = write_json_section(buf, off, meta)
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
    # With flag ADD_HAS_META: per item its metadata (a dict or None) and its string id (or
    # None); without the flag: None.
    meta: list[dict[str, Any] | None] | None = None
    keys: list[str | None] | None = None


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
    meta = keys = None
    if flags & codes.ADD_HAS_META:
        raw, off = read_json_section(buf, off, end)
        meta, keys = _decode_add_meta(raw, n)
    blob = buf[off:end]
    if offsets[0] != 0 or bool((offsets[1:] < offsets[:-1]).any()):
        raise InvalidRequest("payload offsets are not ascending from 0")
    if int(offsets[-1]) > len(blob):
        raise InvalidRequest("payload offsets point outside the request")
    if bool((kinds > codes.PAYLOAD_BYTES).any()):
        raise InvalidRequest("unknown payload kind")
    _check_text(kinds, offsets, blob)
    return AddRequest(ids, vectors, kinds, offsets, blob, scope, tokens, meta, keys)


def _decode_add_meta(raw: bytes, n: int) -> tuple[list[dict[str, Any] | None], list[str | None]]:
    doc = _json(raw, "the items' metadata")
    if not isinstance(doc, dict):
        raise InvalidRequest("the items' metadata must be a JSON object")
    meta = doc.get("meta") or [None] * n
    keys = doc.get("keys") or [None] * n
    if not isinstance(meta, list) or not isinstance(keys, list):
        raise InvalidRequest("the items' metadata and string ids must be JSON lists")
    if len(meta) != n or len(keys) != n:
        raise InvalidRequest(f"{len(meta)} metadata and {len(keys)} string ids for {n} items")
    for i, (m, k) in enumerate(zip(meta, keys, strict=True)):
        if m is not None and not isinstance(m, dict):
            raise InvalidRequest(f"metadata {i} must be a JSON object or null")
        if k is not None and not isinstance(k, str):
            raise InvalidRequest(f"string id {i} must be a JSON string or null")
    return meta, keys


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


# -- LOOKUP (1.5) --------------------------------------------------------------------------
# Request: ``u32 n, u32 0``, scope block (filter), ``i64 ids[n]``. Response: a SEARCH
# response of one row holding the ids found that match the scope, in request order (each
# once, scores 0), with payloads and entries.


def encode_lookup(buf: np.ndarray, ids: np.ndarray, sb: ScopeBytes) -> int:
    n = len(ids)
    size = 8 + sb.nbytes + n * 8
    _fit(size, len(buf), f"lookup of {n} ids")
    _HEAD2.pack_into(buf, 0, n, 0)
    off = write_scope(buf, 8, sb)
    buf[off:size].view(np.int64)[:] = ids
    return size


def decode_lookup(buf: np.ndarray, end: int) -> tuple[np.ndarray, Scope]:
    _need(8, end)
    n, _ = _HEAD2.unpack_from(buf, 0)
    scope, off = read_scope(buf, 8, end)
    return _array(buf, off, np.dtype(np.int64), n, end), scope


def encode_filter_tail(where: bytes) -> bytes:
    """The tail of a FORGET body with flag FORGET_FILTER: the filter's JSON section."""
    return _U64X2.pack(len(where), 0) + where  # encode_scoped pads the tail to 8


def decode_filter_at(buf: np.ndarray, off: int, end: int) -> bytes:
    """The filter's JSON of a JSON section at ``off`` (FORGET_FILTER)."""
    return read_json_section(buf, off, end)[0]
