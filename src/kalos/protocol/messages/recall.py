"""RECALL: one LLM request's memory step, a session's context and the top-k memories."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from kalos.errors import InvalidRequest
from kalos.protocol import codes
from kalos.protocol.messages.common import (
    NO_LIMIT,
    ScopeBytes,
    _array,
    _fit,
    _need,
    _pad8,
    _put_bytes,
    _text_at,
    json_section_size,
    read_json_section,
    read_scope,
    vector_dtype,
    wire_dtype,
    write_json_section,
    write_scope,
)
from kalos.types import Scope

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
    where: bytes | None = None,
) -> int:
    """Writes a RECALL body (query: [dim] or [1, dim] f32 or f16, C-contiguous; max_turns and
    memory_tokens NO_LIMIT for none); returns its length. ``where``: a metadata filter's JSON
    for the memories (flag RecallFlag.FILTER), a section between the session id and the
    query."""
    q = query.reshape(-1)
    size = recall_request_size(len(q), q.itemsize, len(session), sb)
    if where is not None:
        size += json_section_size(where)
    _fit(size, len(buf), "recall request")
    _RECALL_HEAD.pack_into(
        buf, 0, k, len(q), wire_dtype(q.dtype), max_tokens, max_turns, memory_tokens,
        len(session), 0,
    )  # fmt: skip
    off = _put_bytes(buf, write_scope(buf, 32, sb), session)
    if where is not None:
        off = write_json_section(buf, off, where)
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
    where: bytes | None = None  # a metadata filter's JSON for the memories (RecallFlag.FILTER)


def decode_recall(buf: np.ndarray, end: int, flags: int = 0) -> RecallRequest:
    _need(32, end)
    k, dim, dtype, max_tokens, max_turns, memory_tokens, session_len, _ = _RECALL_HEAD.unpack_from(
        buf, 0
    )
    scope, off = read_scope(buf, 32, end)
    session = _text_at(buf, off, session_len, end, "the session id")
    if not session:
        raise InvalidRequest("a session id is required")
    off += _pad8(session_len)
    where = None
    if flags & codes.RecallFlag.FILTER:
        where, off = read_json_section(buf, off, end)
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
        where,
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
