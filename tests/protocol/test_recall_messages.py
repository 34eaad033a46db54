"""RECALL and ADD-with-token-ids bodies: golden bytes, round trips, and refusal of truncated
or garbled bodies (InvalidRequest, never another exception)."""

from __future__ import annotations

import contextlib
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kalos.errors import InvalidRequest, PayloadTooLarge
from kalos.protocol import codes
from kalos.protocol import messages as M
from kalos.protocol.codes import RecallResponseFlag
from kalos.protocol.messages import Scope

ARENA = 1 << 16


def arena(size: int = ARENA) -> np.ndarray:
    return np.zeros(size, np.uint8)


def i32(*ids: int) -> bytes:
    return np.array(ids, "<i4").tobytes()


# -- RECALL request ---------------------------------------------------------------------------


def test_recall_request_golden_bytes() -> None:
    buf = arena(256)
    sb = M.ScopeBytes(b"ab", b"", b"c")
    q = np.array([1.0, -2.0, 0.5], np.float32)
    n = M.encode_recall(buf, b"sess", q, 5, 300, M.NO_LIMIT, 100, sb)
    expected = (
        struct.pack("<IIIIIIII", 5, 3, 0, 300, 0xFFFFFFFF, 100, 4, 0)  # k, dim, f32, budgets
        + struct.pack("<IIII", 2, 0, 1, 0)  # scope lengths
        + b"abc" + bytes(5)  # scope bytes padded to 8
        + b"sess" + bytes(4)  # session id padded to 8
        + struct.pack("<fff", 1.0, -2.0, 0.5) + bytes(4)  # query padded to 8
    )  # fmt: skip
    assert n == len(expected) == M.recall_request_size(3, 4, 4, sb)
    assert buf[:n].tobytes() == expected


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize(
    "scope", [None, Scope("acme"), Scope("acme", "u1", "s9"), Scope(None, "用户", None)]
)
@pytest.mark.parametrize(
    "max_turns, memory_tokens", [(None, None), (0, 0), (3, 1000), (M.NO_LIMIT - 1, 7)]
)
def test_recall_request_round_trip(
    dtype: type, scope: Scope | None, max_turns: int | None, memory_tokens: int | None
) -> None:
    buf = arena()
    q = np.random.default_rng(0).standard_normal(7).astype(dtype)
    n = M.encode_recall(
        buf, "sëssion".encode(), q, 9, 4096,
        M.NO_LIMIT if max_turns is None else max_turns,
        M.NO_LIMIT if memory_tokens is None else memory_tokens,
        M.encode_scope_fields(scope),
    )  # fmt: skip
    assert n % 8 == 0
    req = M.decode_recall(buf[:n], n)
    assert req.session == "sëssion"
    assert (req.k, req.max_tokens, req.max_turns, req.memory_tokens) == (
        9, 4096, max_turns, memory_tokens,
    )  # fmt: skip
    assert req.scope == (scope or Scope())
    assert req.query.dtype == dtype and req.query.shape == (1, 7)
    np.testing.assert_array_equal(req.query[0], q)
    assert np.shares_memory(req.query, buf)  # zero-copy decode


def test_recall_request_needs_a_session_and_a_query() -> None:
    buf = arena()
    q = np.ones(4, np.float32)
    n = M.encode_recall(buf, b"", q, 1, 10, M.NO_LIMIT, M.NO_LIMIT, M.EMPTY_SCOPE)
    with pytest.raises(InvalidRequest, match="session id"):
        M.decode_recall(buf[:n], n)
    n = M.encode_recall(buf, b"s", np.ones(0, np.float32), 1, 10, 0, 0, M.EMPTY_SCOPE)
    with pytest.raises(InvalidRequest, match="dimension"):
        M.decode_recall(buf[:n], n)


def test_recall_request_that_does_not_fit() -> None:
    with pytest.raises(PayloadTooLarge):
        M.encode_recall(arena(64), b"s", np.ones(64, np.float32), 1, 10, 0, 0, M.EMPTY_SCOPE)


# -- RECALL response --------------------------------------------------------------------------


def _response(buf: np.ndarray, on_gpu: bool = False) -> int:
    scores = np.array([0.5, 0.25, -np.inf], np.float32)
    ids = np.array([7, 9, -1], np.int64)
    payloads = [(codes.PAYLOAD_TEXT, "hé".encode()), (codes.PAYLOAD_BYTES, b"\x00"),
                (codes.PAYLOAD_NONE, b"")]  # fmt: skip
    pieces = [i32(1, 2), i32(30, 31, 32), memoryview(i32(40))]
    n = M.encode_recall_response(
        buf, scores, ids, [3, 0, 0], payloads, None if on_gpu else pieces,
        n_tokens=6, system_tokens=2, n_turns=1, turn_tokens=1,
        flags=RecallResponseFlag.SYSTEM | (RecallResponseFlag.TOKENS_ON_GPU if on_gpu else 0),
    )  # fmt: skip
    M.set_recall_parts(buf, 11, 22, 33)
    return n


def test_recall_response_golden_bytes() -> None:
    buf = arena(512)
    buf[:] = 0xEE  # leftovers of an older response must not leak into the padding
    n = _response(buf)
    expected = (
        struct.pack("<IIIIIIII", 3, 2, 6, 1, 2, 1, 1, 0)  # k, hits, tokens, flags, parts
        + struct.pack("<QQQ", 11, 22, 33)  # context, search, assemble ns
        + struct.pack("<fff", 0.5, 0.25, -np.inf) + bytes(4)
        + struct.pack("<qqq", 7, 9, -1)
        + struct.pack("<iii", 3, 0, 0) + bytes(4)  # memory tokens per hit
        + bytes([1, 2, 0]) + bytes(5)  # payload kinds
        + struct.pack("<QQQQ", 0, 3, 4, 4)  # payload offsets
        + i32(1, 2, 30, 31, 32, 40)  # [system] + [memory 7] + [turn]
        + "hé".encode() + b"\x00"
    )  # fmt: skip
    assert n == len(expected)
    assert buf[:n].tobytes() == expected


def test_recall_response_round_trip() -> None:
    buf = arena()
    n = _response(buf)
    r = M.decode_recall_response(buf[:n], n)
    assert r.ids.tolist() == [7, 9, -1] and r.n_hits == 2
    assert r.scores.tolist() == [0.5, 0.25, -np.inf]
    assert r.memory_tokens.tolist() == [3, 0, 0]
    assert r.tokens is not None and r.tokens.tolist() == [1, 2, 30, 31, 32, 40]
    assert np.shares_memory(r.tokens, buf)
    assert r.payloads == ["hé", b"\x00", None]
    assert (r.system_tokens, r.n_turns, r.turn_tokens) == (2, 1, 1)
    assert (r.context_ns, r.search_ns, r.assemble_ns) == (11, 22, 33)
    assert r.flags == RecallResponseFlag.SYSTEM


def test_recall_response_with_tokens_on_the_gpu_leaves_them_out() -> None:
    buf = arena()
    n = _response(buf, on_gpu=True)
    assert n == _response(arena()) - 24  # 6 token ids, padded to 8: 24 bytes
    r = M.decode_recall_response(buf[:n], n)
    assert r.tokens is None and r.n_tokens == 6
    assert r.payloads == ["hé", b"\x00", None]
    assert r.flags == RecallResponseFlag.SYSTEM | RecallResponseFlag.TOKENS_ON_GPU


def test_recall_response_that_does_not_fit() -> None:
    with pytest.raises(PayloadTooLarge, match="recall response"):
        _response(arena(128))


# -- ADD with token ids -----------------------------------------------------------------------


def test_add_with_tokens_golden_bytes() -> None:
    buf = arena(512)
    buf[:] = 0xEE
    ids = np.array([5, 6], np.int64)
    v = np.array([[1.0], [2.0]], np.float32)
    kinds = np.array([codes.PAYLOAD_TEXT, codes.PAYLOAD_TEXT], np.uint8)
    tokens = [np.array([10, 11, 12], np.int32), None]
    n = M.encode_add(buf, ids, v, kinds, [b"ab", b"c"], M.EMPTY_SCOPE, tokens)
    expected = (
        struct.pack("<IIII", 2, 1, 0, 0) + struct.pack("<IIII", 0, 0, 0, 0)
        + struct.pack("<qq", 5, 6) + struct.pack("<ff", 1.0, 2.0)
        + bytes([1, 1]) + b"\xee" * 6  # kinds: their padding is not written (as before 1.1)
        + struct.pack("<QQQ", 0, 2, 3)  # payload offsets
        + bytes([1, 0]) + bytes(6)  # has_tokens
        + struct.pack("<QQQ", 0, 3, 3)  # token offsets
        + i32(10, 11, 12) + bytes(4)
        + b"abc"
    )  # fmt: skip
    assert n == len(expected)
    assert buf[:n].tobytes() == expected
    fixed, per_item = M.add_item_sizes(1, 4, np.array([2, 1]), M.EMPTY_SCOPE, np.array([3, 0]))
    assert fixed + int(per_item.sum()) >= n


@pytest.mark.parametrize(
    "tokens",
    [None, [None, None, None], [np.arange(4, dtype=np.int32), None, np.zeros(0, np.int32)]],
)
def test_add_with_tokens_round_trip(tokens: list[np.ndarray | None] | None) -> None:
    buf = arena()
    ids = np.array([1, 2, 3], np.int64)
    v = np.ones((3, 4), np.float32)
    kinds = np.array([1, 2, 0], np.uint8)
    n = M.encode_add(buf, ids, v, kinds, [b"x", b"yz", b""], M.EMPTY_SCOPE, tokens)
    req = M.decode_add(buf[:n], n, 0 if tokens is None else codes.ADD_HAS_TOKENS)
    assert req.ids.tolist() == [1, 2, 3]
    assert req.blob[: int(req.offsets[-1])].tobytes() == b"xyz"
    if tokens is None:
        assert req.tokens is None
    else:
        assert req.tokens is not None
        got = [None if t is None else t.tolist() for t in req.tokens]
        assert got == [None if t is None else t.tolist() for t in tokens]


def test_add_tokens_without_the_mark_are_refused() -> None:
    buf = arena()
    tokens = [np.array([4], np.int32)]
    n = M.encode_add(buf, np.array([1], np.int64), np.ones((1, 2), np.float32),
                     np.zeros(1, np.uint8), [b""], M.EMPTY_SCOPE, tokens)  # fmt: skip
    has_at = 16 + 16 + 8 + 8 + 8 + 16  # header, scope, ids, vectors, kinds, offsets
    assert buf[has_at] == 1
    buf[has_at] = 0
    with pytest.raises(InvalidRequest, match="not marked"):
        M.decode_add(buf[:n], n, codes.ADD_HAS_TOKENS)


# -- truncated and garbled bodies -------------------------------------------------------------


def _bodies() -> list[tuple[str, bytes]]:
    buf = arena(1024)
    out = []
    n = M.encode_recall(buf, b"s-1", np.ones(5, np.float16), 3, 100, 2, M.NO_LIMIT,
                        M.ScopeBytes(b"acme", b"u", b""))  # fmt: skip
    out.append(("recall", buf[:n].tobytes()))
    n = _response(buf)
    out.append(("recall-response", buf[:n].tobytes()))
    n = _response(buf, on_gpu=True)
    out.append(("recall-response-gpu", buf[:n].tobytes()))
    n = M.encode_add(buf, np.array([1, 2], np.int64), np.ones((2, 3), np.float32),
                     np.array([1, 0], np.uint8), [b"t", b""], M.EMPTY_SCOPE,
                     [np.array([1, 2], np.int32), None])  # fmt: skip
    out.append(("add-tokens", buf[:n].tobytes()))
    return out


_DECODERS = {
    "recall": lambda b, n: M.decode_recall(b, n),
    "recall-response": lambda b, n: M.decode_recall_response(b, n),
    "recall-response-gpu": lambda b, n: M.decode_recall_response(b, n),
    "add-tokens": lambda b, n: M.decode_add(b, n, codes.ADD_HAS_TOKENS),
}
BODIES = _bodies()


@pytest.mark.parametrize("name, body", BODIES, ids=[b[0] for b in BODIES])
def test_truncated_bodies_never_crash_the_decoder(name: str, body: bytes) -> None:
    _DECODERS[name](np.frombuffer(body, np.uint8).copy(), len(body))
    for cut in range(len(body)):
        buf = np.frombuffer(body[:cut], np.uint8).copy()
        with contextlib.suppress(InvalidRequest):  # a cut in the padding may still decode
            _DECODERS[name](buf, cut)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_garbled_bodies_raise_only_invalid_request(data: st.DataObject) -> None:
    name, body = data.draw(st.sampled_from(BODIES))
    raw = bytearray(body)
    for _ in range(data.draw(st.integers(1, 6))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    buf = np.frombuffer(bytes(raw), np.uint8).copy()
    with contextlib.suppress(InvalidRequest):
        _DECODERS[name](buf, len(buf))
