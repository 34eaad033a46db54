"""Session ops: APPEND_TURN, CONTEXT, SESSIONS, TRIM, DELETE_SESSION and FORGET.

A session op names its session in the session field of its scope block; the tenant and user
fields are the session's owner (APPEND_TURN, LOG_EVENT) or a filter it must match (the others).
"""

from __future__ import annotations

import struct
from typing import NamedTuple, NoReturn

import numpy as np

from kalos.errors import InvalidRequest, ProtocolMismatch
from kalos.protocol import codes
from kalos.protocol.messages.common import (
    _HEAD2,
    _HEAD4,
    EMPTY_SCOPE,
    NO_LIMIT,
    ScopeBytes,
    _array,
    _fit,
    _need,
    _pad8,
    _put_bytes,
    _text_at,
    read_scope,
    session_of,
    write_scope,
)
from kalos.types import Scope

# APPEND_TURN: u32 n_tokens, u32 role_len, u32 text_len, u32 0, f64 ttl_s (NaN: keep),
# scope block (owner; session = the session id), i32 tokens[n_tokens] padded to 8 (only with
# AppendFlag.HAS_TOKENS), role bytes then text bytes. Response: u64 turns, u64 tokens.

_CTX_HEAD = struct.Struct("<IIQIIII")  # max_tokens, max_turns, 0, then a scope block head
_APPEND_HEAD = struct.Struct("<IIIId")  # n_tokens, role_len, text_len, 0, ttl_s (NaN: keep)
_U64X4 = struct.Struct("<QQQQ")


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
