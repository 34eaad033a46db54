"""Golden values of the session, state and scope ops, and their bodies: round trips and
refusal of truncated or garbled bodies (InvalidRequest, never another exception)."""

from __future__ import annotations

import contextlib
import math
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kalos.errors import InvalidRequest, PayloadTooLarge, ProtocolMismatch
from kalos.protocol import codes
from kalos.protocol import messages as M
from kalos.protocol.codes import AppendFlag, Op
from kalos.protocol.messages import Scope
from kalos.server.dispatch import WRITE_OPS

ARENA = 1 << 16


def arena(size: int = ARENA) -> np.ndarray:
    return np.zeros(size, np.uint8)


def test_op_codes_after_the_core_ones() -> None:
    assert {op.name: int(op) for op in Op if op >= 6} == {
        "APPEND_TURN": 6,
        "CONTEXT": 7,
        "SESSIONS": 8,
        "TRIM": 9,
        "DELETE_SESSION": 10,
        "STATE_PUT": 11,
        "STATE_GET": 12,
        "STATE_DELETE": 13,
        "STATE_CAS": 14,
        "LOG_EVENT": 15,
        "EVENTS": 16,
        "FORGET": 17,
        "RECALL": 18,
        "LOOKUP": 19,
    }


def test_append_flags_and_no_limit() -> None:
    assert {f.name: int(f) for f in AppendFlag} == {
        "PIN_SYSTEM": 1,
        "HAS_TOKENS": 2,
        "SET_ROLLING": 4,
        "ROLLING": 8,
    }
    assert M.NO_LIMIT == 0xFFFFFFFF


def test_write_ops_are_exactly_the_mutating_ones() -> None:
    assert frozenset(WRITE_OPS) == {
        Op.ADD, Op.REMOVE, Op.APPEND_TURN, Op.TRIM, Op.DELETE_SESSION, Op.STATE_PUT,
        Op.STATE_DELETE, Op.STATE_CAS, Op.LOG_EVENT, Op.FORGET,
    }  # fmt: skip
    reads = {
        Op.PING, Op.STATS, Op.SEARCH, Op.CONTEXT, Op.SESSIONS, Op.STATE_GET, Op.EVENTS,
        Op.RECALL, Op.LOOKUP,
    }  # fmt: skip
    assert reads | WRITE_OPS == set(Op)


# -- golden bytes -----------------------------------------------------------------------------


def test_context_request_golden_bytes() -> None:
    buf = arena(64)
    sb = M.ScopeBytes(b"ab", b"", b"")
    n = M.encode_context(buf, b"s1", 4096, M.NO_LIMIT, sb)
    assert n == 40
    assert buf[:n].tobytes() == (
        struct.pack("<IIQ", 4096, 0xFFFFFFFF, 0)
        + struct.pack("<IIII", 2, 0, 2, 0)
        + b"abs1\0\0\0\0"
    )


@pytest.mark.parametrize("session", ["s", "x" * 300])  # the decode's first copy is 256 bytes
@pytest.mark.parametrize("scope", [None, Scope("t" * 200, "u")])
def test_context_request_round_trip_long_ids_and_a_padded_body(
    session: str, scope: Scope | None
) -> None:
    buf = arena(1 << 20)
    sb = M.EMPTY_SCOPE if scope is None else M.encode_scope_fields(scope)
    n = M.encode_context(buf, session.encode(), 100, 5, sb)
    want = (session, 100, 5, None if scope is None else Scope(scope.tenant, scope.user))
    assert M.decode_context(buf[:n], n) == want
    assert M.decode_context(buf, len(buf)) == want  # trailing bytes: ignored, not copied
    with pytest.raises(InvalidRequest, match="truncated"):
        M.decode_context(buf[: n - 8], n - 8)


def test_context_response_golden_layout() -> None:
    buf = np.full(256, 0xEE, np.uint8)  # stale bytes: the padding must be zeroed
    system = (1, struct.pack("<i", 7), struct.pack("<IIII", 1, 2, 1, 0), b"Sab")
    tokens = memoryview(np.array([1, 2], np.int32)).cast("B")
    meta = struct.pack("<IIII", 1, 1, 2, 0)
    n = M.encode_context_response(buf, tokens, meta, b"ux", system)
    expected = (
        struct.pack("<IIII", 2, 3, 1, 1)
        + struct.pack("<iii", 7, 1, 2) + b"\0" * 4  # tokens padded to 8
        + struct.pack("<IIII", 1, 2, 1, 0) + struct.pack("<IIII", 1, 1, 2, 0)
        + b"Sabux"
    )  # fmt: skip
    assert buf[:n].tobytes() == expected
    tokens, meta, text, has_system = M.decode_context_response(buf, n)
    assert tokens.tolist() == [7, 1, 2] and has_system
    assert M.split_turns(meta, text) == [("S", "ab"), ("u", "x")]
    assert M.turn_token_counts(meta).tolist() == [1, 2]


def test_context_response_without_turns_is_the_token_ids_alone() -> None:
    buf = np.full(64, 0xEE, np.uint8)
    system = (1, struct.pack("<i", 7), struct.pack("<IIII", 1, 2, 1, 0), b"Sab")
    tokens = memoryview(np.array([1, 2], np.int32)).cast("B")
    meta = struct.pack("<IIII", 1, 1, 2, 0)
    n = M.encode_context_response(buf, tokens, meta, b"ux", system, turns=False)
    assert buf[:n].tobytes() == struct.pack("<IIIIiii", 2, 3, 1, 0, 7, 1, 2)
    got, meta_b, text_b, has_system = M.decode_context_response(buf, n)
    assert got.tolist() == [7, 1, 2] and has_system and meta_b is None and text_b is None
    # the sidecar's own encoder for it takes the turn count, not the meta: the same bytes
    again = np.full(64, 0xEE, np.uint8)
    assert M.encode_context_tokens_response(again, tokens, 1, system) == n
    assert again[:n].tobytes() == buf[:n].tobytes()
    assert M.encode_context_tokens_response(again, tokens, 1, None) == 24
    assert again[:24].tobytes() == struct.pack("<IIIIii", 1, 2, 0, 0, 1, 2)
    with pytest.raises(PayloadTooLarge):
        M.encode_context_tokens_response(np.zeros(20, np.uint8), tokens, 1, None)
    assert {f.name: int(f) for f in codes.ContextFlag} == {"TURNS": 1}


def test_context_response_by_reference_golden_layout() -> None:
    """Form TOKENS_IN_HEAP: the ids' byte offset in the token heap replaces the ids."""
    heap = np.arange(64, dtype=np.int32)  # the client's mapping, as int32
    tokens = memoryview(np.array([5, 6, 7], np.int32)).cast("B")  # only their length counts
    buf = np.full(128, 0xEE, np.uint8)
    assert M.encode_context_tokens_response(buf, tokens, 2, None, heap_at=20) == 32
    assert buf[:32].tobytes() == struct.pack("<IIIIQQ", 2, 3, 0, 2, 20, 0)
    got, meta_b, text_b, has_system = M.decode_context_response(buf, 32, heap)
    assert got.tolist() == [5, 6, 7] and meta_b is None and text_b is None and not has_system
    assert not np.shares_memory(got, buf) and np.shares_memory(got, heap)
    meta = struct.pack("<IIII", 1, 1, 3, 0)
    n = M.encode_context_response(buf, tokens, meta, b"ux", None, heap_at=20)
    assert buf[:n].tobytes() == struct.pack("<IIIIQQ", 1, 3, 0, 3, 20, 0) + meta + b"ux"
    got, meta_b, text_b, _ = M.decode_context_response(buf, n, heap)
    assert got.tolist() == [5, 6, 7] and M.split_turns(meta_b or b"", text_b or b"") == [("u", "x")]
    with pytest.raises(ProtocolMismatch, match="does not map"):
        M.decode_context_response(buf, n)  # a channel without the heap
    for bad_at in (2, 4 * 62):  # misaligned; past the heap's end
        M.encode_context_tokens_response(buf, tokens, 2, None, heap_at=bad_at)
        with pytest.raises(ProtocolMismatch, match="heap"):
            M.decode_context_response(buf, 32, heap)
    with pytest.raises(InvalidRequest):
        M.decode_context_response(buf, 24, heap)  # cut short
    assert {f.name: int(f) for f in codes.ContextForm} == {"TURNS": 1, "TOKENS_IN_HEAP": 2}


# -- round trips ------------------------------------------------------------------------------

names = st.text(min_size=1, max_size=12)
opt_names = st.one_of(st.none(), names)


@settings(max_examples=50, deadline=None)
@given(
    session=names,
    tenant=opt_names,
    user=opt_names,
    role=names,
    text=st.text(max_size=40),
    tokens=st.one_of(st.none(), st.lists(st.integers(0, 2**31 - 1), max_size=20)),
    ttl=st.one_of(st.none(), st.floats(0, 1e9)),
)
def test_append_turn_round_trip(session, tenant, user, role, text, tokens, ttl) -> None:  # type: ignore[no-untyped-def]
    buf = arena()
    sb = M.ScopeBytes((tenant or "").encode(), (user or "").encode(), session.encode())
    ids = None if tokens is None else np.array(tokens, np.int32)
    n = M.encode_append_turn(buf, sb, role.encode(), text.encode(), ids, ttl)
    raw_len = len(role.encode()) + len(text.encode())
    assert n == 24 + sb.nbytes + 4 * len(tokens or []) + 4 * (len(tokens or []) % 2) + raw_len
    flags = 0 if ids is None else AppendFlag.HAS_TOKENS
    req = M.decode_append_turn(buf[:n], n, flags)
    assert req.scope == Scope(tenant or None, user or None, session)
    assert (req.role, req.text) == (role, text)
    assert (req.tokens is None) == (ids is None)
    if ids is not None:
        assert req.tokens is not None and req.tokens.tolist() == tokens
    assert req.ttl_s == ttl


def test_append_turn_tokens_need_the_flag() -> None:
    buf = arena()
    sb = M.ScopeBytes(b"", b"", b"s")
    n = M.encode_append_turn(buf, sb, b"user", b"x", np.array([1], np.int32), None)
    with pytest.raises(InvalidRequest, match="HAS_TOKENS"):
        M.decode_append_turn(buf[:n], n, 0)


def test_session_ops_need_a_session() -> None:
    buf = arena()
    n = M.encode_append_turn(buf, M.EMPTY_SCOPE, b"user", b"x", None, None)
    with pytest.raises(InvalidRequest, match="session id"):
        M.decode_append_turn(buf[:n], n, 0)
    n = M.encode_context(buf, b"", 10, 1, M.EMPTY_SCOPE)
    with pytest.raises(InvalidRequest, match="session id"):
        M.decode_context(buf[:n], n)


@settings(max_examples=50, deadline=None)
@given(session=names, tenant=opt_names, user=opt_names, max_tokens=st.integers(0, 2**32 - 2),
       max_turns=st.one_of(st.none(), st.integers(0, 2**32 - 2)))  # fmt: skip
def test_context_request_round_trip(session, tenant, user, max_tokens, max_turns) -> None:  # type: ignore[no-untyped-def]
    buf = arena()
    sb = M.encode_scope_fields(Scope(tenant, user))
    mt = M.NO_LIMIT if max_turns is None else max_turns
    n = M.encode_context(buf, session.encode(), max_tokens, mt, sb)
    assert n % 8 == 0
    req = M.decode_context(buf[:n], n)
    scope = Scope(tenant or None, user or None) if (tenant or user) else None
    assert req == (session, max_tokens, max_turns, scope)


def test_state_round_trips() -> None:
    buf = arena()
    sb = M.encode_scope_fields(Scope("acme", None, "s"))
    n = M.encode_state_value(buf, sb, "ключ".encode(), b"\x00value", 7)
    assert M.decode_state_value(buf[:n], n) == M.StateValueRequest(
        Scope("acme", None, "s"), "ключ", b"\x00value", 7
    )
    n = M.encode_state_key(buf, sb, b"k")
    assert M.decode_state_key(buf[:n], n) == (Scope("acme", None, "s"), "k")
    n = M.encode_state_get_response(buf, 42, b"v")
    assert M.decode_state_get_response(buf[:n], n) == (42, b"v")


def test_event_round_trips() -> None:
    buf = arena()
    sb = M.ScopeBytes(b"t", b"", b"s")
    for data in ("text ✓", b"\x00\xff", "", b""):
        n = M.encode_log_event(buf, sb, b"tool", data)
        req = M.decode_log_event(buf[:n], n)
        assert (req.scope, req.kind, req.data) == (Scope("t", None, "s"), "tool", data)
        assert type(req.data) is type(data)
    n = M.encode_events_request(buf, sb, 5, M.NO_LIMIT)
    assert M.decode_events_request(buf[:n], n) == (Scope("t", None, "s"), 5, None)
    events = [(1, 1.5, "a", "x"), (2, 2.5, "bb", b"\x01"), (3, math.pi, "", "")]
    n = M.encode_events_response(buf, events, False)
    assert M.decode_events_response(buf[:n], n) == (events, False)


def test_events_response_cuts_what_does_not_fit() -> None:
    events = [(i, float(i), "k", "d" * 100) for i in range(1, 101)]
    buf = arena(2048)
    n = M.encode_events_response(buf, events, False)
    got, more = M.decode_events_response(buf[:n], n)
    assert more and 0 < len(got) < 100 and got == events[: len(got)]
    with pytest.raises(PayloadTooLarge):
        M.encode_events_response(arena(64), [(1, 0.0, "k", "d" * 100)], False)


def test_scoped_and_forgotten_round_trips() -> None:
    buf = arena()
    sb = M.encode_scope_fields(Scope("acme", "u1"))
    n = M.encode_scoped(buf, 3, 2, sb, b"ab")
    assert M.decode_sessions(buf[:n], n) == (Scope("acme", "u1"), 3, "ab")
    n = M.encode_scoped(buf, M.NO_LIMIT, 0, sb)
    assert M.decode_sessions(buf[:n], n) == (Scope("acme", "u1"), None, None)
    n = M.encode_forgotten(buf, (1, 2, 3, 4))
    assert M.decode_forgotten(buf[:n], n) == (1, 2, 3, 4)


# -- truncated and garbled bodies -------------------------------------------------------------


def _bodies() -> list[tuple[str, bytes, int]]:
    buf = arena()
    sb = M.ScopeBytes(b"acme", b"u1", b"session-1")
    out = []
    n = M.encode_append_turn(buf, sb, b"user", b"hello", np.arange(5, dtype=np.int32), 60.0)
    out.append(("append", buf[:n].tobytes(), int(AppendFlag.HAS_TOKENS)))
    n = M.encode_context(buf, b"session-1", 100, 3, sb)
    out.append(("context", buf[:n].tobytes(), 0))
    n = M.encode_state_value(buf, sb, b"key", b"value", 3)
    out.append(("value", buf[:n].tobytes(), 0))
    n = M.encode_state_key(buf, sb, b"key")
    out.append(("key", buf[:n].tobytes(), 0))
    n = M.encode_log_event(buf, sb, b"kind", "data")
    out.append(("log", buf[:n].tobytes(), 0))
    n = M.encode_events_request(buf, sb, 0, 10)
    out.append(("events", buf[:n].tobytes(), 0))
    n = M.encode_scoped(buf, 5, 3, sb, b"abc")
    out.append(("sessions", buf[:n].tobytes(), 0))
    n = M.encode_events_response(buf, [(1, 1.0, "k", "d"), (2, 2.0, "k", b"e")], True)
    out.append(("events-response", buf[:n].tobytes(), 0))
    return out


_DECODERS = {
    "append": lambda b, n, f: M.decode_append_turn(b, n, f),
    "context": lambda b, n, f: M.decode_context(b, n),
    "value": lambda b, n, f: M.decode_state_value(b, n),
    "key": lambda b, n, f: M.decode_state_key(b, n),
    "log": lambda b, n, f: M.decode_log_event(b, n),
    "events": lambda b, n, f: M.decode_events_request(b, n),
    "sessions": lambda b, n, f: M.decode_sessions(b, n),
    "events-response": lambda b, n, f: M.decode_events_response(b, n),
}
BODIES = _bodies()


@pytest.mark.parametrize("name, body, flags", BODIES, ids=[b[0] for b in BODIES])
def test_truncated_bodies_never_crash_the_decoder(name: str, body: bytes, flags: int) -> None:
    decode = _DECODERS[name]
    decode(np.frombuffer(body, np.uint8).copy(), len(body), flags)  # the whole body decodes
    for cut in range(len(body)):
        buf = np.frombuffer(body[:cut], np.uint8).copy()
        with contextlib.suppress(InvalidRequest):  # a cut in the padding may still decode
            decode(buf, cut, flags)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_garbled_bodies_raise_only_invalid_request(data: st.DataObject) -> None:
    name, body, flags = data.draw(st.sampled_from(BODIES))
    raw = bytearray(body)
    for _ in range(data.draw(st.integers(1, 6))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    buf = np.frombuffer(bytes(raw), np.uint8).copy()
    with contextlib.suppress(InvalidRequest):
        _DECODERS[name](buf, len(buf), flags)


def test_codes_reexport() -> None:
    assert codes.PAYLOAD_TEXT == 1 and codes.PAYLOAD_BYTES == 2  # event data kinds


@pytest.mark.parametrize(
    "turns",
    [
        [("user", "plain ascii"), ("assistant", ""), ("", "x")],
        [("user", "ünïcødé ✓"), ("assistant", "ascii"), ("tool", "用户")],
        [],
    ],
)
def test_split_turns(turns: list[tuple[str, str]]) -> None:
    meta = b"".join(struct.pack("<IIII", len(r.encode()), len(t.encode()), 0, 0) for r, t in turns)
    text = b"".join(r.encode() + t.encode() for r, t in turns)
    assert M.split_turns(meta, text) == turns


def test_split_turns_refuses_bad_utf8() -> None:
    with pytest.raises(InvalidRequest):
        M.split_turns(struct.pack("<IIII", 1, 1, 0, 0), b"\xff\xfe")
