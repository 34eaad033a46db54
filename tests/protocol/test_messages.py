"""Request and response bodies: round trips, golden bytes, and refusal of bad bodies.

Decoders face bytes from another process. A truncated or garbled body must raise
InvalidRequest (which the sidecar turns into a status), never IndexError, struct.error or a
numpy ValueError (which would be reported as a sidecar bug).
"""

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
from kalos.protocol.messages import Scope

ARENA = 1 << 16


def arena() -> np.ndarray:
    return np.zeros(ARENA, np.uint8)


def scope_bytes(scope: Scope | None) -> M.ScopeBytes:
    return M.encode_scope_fields(scope)


SCOPES = [
    None,
    Scope("acme"),
    Scope("acme", "user-1"),
    Scope("acme", "user-1", "session-42"),
    Scope(None, "u", None),
    Scope("ünïcødé", "用户", "🙂"),
]


def _payload_parts(payloads: list[str | bytes | None]) -> tuple[np.ndarray, list[bytes]]:
    kinds = np.zeros(len(payloads), np.uint8)
    blobs = []
    for i, p in enumerate(payloads):
        if isinstance(p, str):
            kinds[i] = codes.PAYLOAD_TEXT
            blobs.append(p.encode())
        elif isinstance(p, bytes):
            kinds[i] = codes.PAYLOAD_BYTES
            blobs.append(p)
        else:
            blobs.append(b"")
    return kinds, blobs


def _add_payloads(req: M.AddRequest) -> list[str | bytes | None]:
    blob = req.blob.tobytes()
    b = req.offsets.tolist()
    out: list[str | bytes | None] = []
    for i, kind in enumerate(req.kinds.tolist()):
        data = blob[b[i] : b[i + 1]]
        out.append(data.decode() if kind == 1 else data if kind == 2 else None)
    return out


# -- scope ------------------------------------------------------------------------------------


@pytest.mark.parametrize("scope", SCOPES)
def test_scope_block_round_trip(scope: Scope | None) -> None:
    buf = arena()
    sb = scope_bytes(scope)
    end = M.write_scope(buf, 8, sb)
    assert end == 8 + sb.nbytes
    assert (end - 8) % 8 == 0
    got, after = M.read_scope(buf, 8, end)
    assert after == end
    assert got == (scope or Scope())


def test_empty_scope_fields_decode_as_none() -> None:
    buf = arena()
    end = M.write_scope(buf, 0, scope_bytes(Scope("", "", "")))
    assert M.read_scope(buf, 0, end)[0] == Scope(None, None, None)


# -- SEARCH -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("nq", [1, 3])
def test_search_round_trip(dtype: type, scope: Scope | None, nq: int) -> None:
    rng = np.random.default_rng(nq)
    q = rng.standard_normal((nq, 5)).astype(dtype)
    buf = arena()
    n = M.encode_search(buf, q, 7, scope_bytes(scope))
    assert n == M.search_request_size(nq, 5, q.itemsize, scope_bytes(scope))
    assert n % 8 == 0
    req = M.decode_search(buf[:n], n)
    assert req.k == 7
    assert req.scope == (scope or Scope())
    assert req.queries.dtype == dtype
    assert req.queries.shape == (nq, 5)
    np.testing.assert_array_equal(req.queries, q)
    # a view into the buffer, not a copy (zero-copy decode)
    assert np.shares_memory(req.queries, buf)


def test_search_request_golden_bytes() -> None:
    buf = arena()
    q = np.array([[1.0, -2.0]], np.float32)
    n = M.encode_search(buf, q, 3, scope_bytes(Scope("ab", None, "c")))
    expected = (
        struct.pack("<IIII", 1, 3, 2, 0)  # nq, k, dim, dtype f32
        + struct.pack("<IIII", 2, 0, 1, 0)  # scope lengths
        + b"abc"
        + bytes(5)  # scope bytes padded to 8
        + struct.pack("<ff", 1.0, -2.0)
    )
    assert bytes(buf[:n]) == expected


def test_search_f16_golden_header() -> None:
    buf = arena()
    n = M.encode_search(buf, np.zeros((2, 3), np.float16), 1, M.EMPTY_SCOPE)
    assert struct.unpack_from("<IIII", buf, 0) == (2, 1, 3, 1)
    assert n == 16 + 16 + 16  # header, empty scope block, 12 bytes of queries padded to 16


def test_search_request_too_large_for_the_arena() -> None:
    q = np.zeros((100, 256), np.float32)
    with pytest.raises(PayloadTooLarge):
        M.encode_search(np.zeros(4096, np.uint8), q, 1, M.EMPTY_SCOPE)


PAYLOAD_SETS = [
    ["alpha", b"\x00\xffbytes", None, "", b"", "ünïcødé 🙂"],
    [None, None, None, None, None, None],
    ["a" * 1000, "b", "c", "d", "e", "f"],
]


@pytest.mark.parametrize("payloads", [None, *PAYLOAD_SETS])
def test_search_response_round_trip(payloads: list | None) -> None:
    nq, k = 2, 3
    scores = np.arange(nq * k, dtype=np.float32).reshape(nq, k) - 2.5
    ids = np.array([[5, -1, 7], [2**62, 0, -1]], np.int64)
    wire = None
    if payloads is not None:
        kinds, blobs = _payload_parts(payloads)
        wire = list(zip(kinds.tolist(), blobs, strict=True))
    buf = arena()
    n = M.encode_search_response(buf, scores, ids, wire)
    if payloads is None:
        assert n == M.search_response_size(nq, k)
    r = M.decode_search_response(buf[:n], n)
    np.testing.assert_array_equal(r.scores, scores)
    np.testing.assert_array_equal(r.ids, ids)
    assert r.scores.dtype == np.float32 and r.ids.dtype == np.int64
    assert r.payloads == payloads
    assert np.shares_memory(r.ids, buf) and np.shares_memory(r.scores, buf)


def test_search_response_with_odd_sizes_keeps_sections_aligned() -> None:
    # nq*k odd: the f32 scores are padded so the i64 ids start 8-byte aligned
    scores = np.array([[0.5, 0.25, 0.125]], np.float32)
    ids = np.array([[1, 2, 3]], np.int64)
    buf = arena()
    n = M.encode_search_response(buf, scores, ids, [(1, b"x"), (0, b""), (2, b"yz")])
    assert struct.unpack_from("<qqq", buf, 16 + 16) == (1, 2, 3)
    r = M.decode_search_response(buf[:n], n)
    assert r.payloads == ["x", None, b"yz"]


def test_search_response_too_large_for_the_arena() -> None:
    ids = np.zeros((10, 1024), np.int64)
    with pytest.raises(PayloadTooLarge):
        M.encode_search_response(np.zeros(ARENA, np.uint8), ids.astype(np.float32), ids, None)


# -- ADD --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("scope", SCOPES[:4])
@pytest.mark.parametrize("payloads", PAYLOAD_SETS)
def test_add_round_trip(dtype: type, scope: Scope | None, payloads: list) -> None:
    n, dim = len(payloads), 3
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((n, dim)).astype(dtype)
    ids = np.array([0, 1, -5, 2**63 - 1, 17, 9], np.int64)[:n]
    kinds, blobs = _payload_parts(payloads)
    buf = arena()
    size = M.encode_add(buf, ids, vectors, kinds, blobs, scope_bytes(scope))
    fixed, per_item = M.add_item_sizes(
        dim, vectors.itemsize, np.array([len(b) for b in blobs]), scope_bytes(scope)
    )
    assert size <= fixed + int(per_item.sum())  # the client's chunking bound holds
    req = M.decode_add(buf[:size], size)
    np.testing.assert_array_equal(req.ids, ids)
    np.testing.assert_array_equal(req.vectors, vectors)
    assert req.vectors.dtype == dtype
    assert req.scope == (scope or Scope())
    assert _add_payloads(req) == payloads
    assert np.shares_memory(req.vectors, buf)


def test_add_golden_bytes() -> None:
    buf = arena()
    size = M.encode_add(
        buf,
        np.array([9], np.int64),
        np.array([[1.0]], np.float32),
        np.array([codes.PAYLOAD_TEXT], np.uint8),
        [b"hi"],
        M.EMPTY_SCOPE,
    )
    expected = (
        struct.pack("<IIII", 1, 1, 0, 0)  # n, dim, dtype, 0
        + struct.pack("<IIII", 0, 0, 0, 0)  # empty scope block
        + struct.pack("<q", 9)
        + struct.pack("<f", 1.0)
        + bytes(4)  # vectors padded to 8
        + b"\x01"
        + bytes(7)  # kinds padded to 8
        + struct.pack("<QQ", 0, 2)  # offsets
        + b"hi"
    )
    assert bytes(buf[:size]) == expected


def test_add_too_large_for_the_arena() -> None:
    with pytest.raises(PayloadTooLarge):
        M.encode_add(
            np.zeros(1024, np.uint8),
            np.array([1], np.int64),
            np.zeros((1, 4), np.float32),
            np.array([2], np.uint8),
            [bytes(2000)],
            M.EMPTY_SCOPE,
        )


# -- REMOVE, counts, text ---------------------------------------------------------------------


@pytest.mark.parametrize("ids", [[], [1], [3, -7, 2**63 - 1, 0]])
def test_remove_round_trip(ids: list[int]) -> None:
    buf = arena()
    n = M.encode_remove(buf, np.array(ids, np.int64))
    assert n == 8 + 8 * len(ids)
    assert struct.unpack_from("<II", buf, 0) == (len(ids), 0)
    np.testing.assert_array_equal(M.decode_remove(buf[:n], n), ids)


@pytest.mark.parametrize("a, b", [(0, 0), (5, 3), (2**64 - 1, 1)])
def test_counts_round_trip(a: int, b: int) -> None:
    buf = arena()
    n = M.encode_counts(buf, a, b)
    assert n == 16
    assert bytes(buf[:16]) == struct.pack("<QQ", a, b)
    assert M.decode_counts(buf[:n], n) == (a, b)


@pytest.mark.parametrize("text", ["", "ok", '{"items": 3}', "ünïcødé 🙂"])
def test_text_round_trip(text: str) -> None:
    buf = arena()
    n = M.encode_text(buf, text)
    assert n == len(text.encode())
    assert M.decode_text(buf[:n], n) == text


def test_text_longer_than_the_buffer_is_cut_not_refused() -> None:
    buf = np.zeros(8, np.uint8)
    n = M.encode_text(buf, "0123456789é")
    assert n == 8
    assert M.decode_text(buf, n) == "01234567"
    # a cut through a multi-byte character still decodes (replacement character)
    buf = np.zeros(3, np.uint8)
    n = M.encode_text(buf, "a€")  # 4 bytes in UTF-8
    assert n == 3
    assert M.decode_text(buf, n).startswith("a\ufffd")


# -- truncated bodies -------------------------------------------------------------------------


def _search_body() -> bytes:
    buf = arena()
    n = M.encode_search(buf, np.ones((2, 4), np.float32), 5, scope_bytes(Scope("t", "u", "s")))
    return bytes(buf[:n])


def _add_body() -> bytes:
    buf = arena()
    kinds, blobs = _payload_parts(["text", b"bytes", None])
    n = M.encode_add(
        buf,
        np.arange(3, dtype=np.int64),
        np.ones((3, 4), np.float32),
        kinds,
        blobs,
        scope_bytes(Scope("t", "u")),
    )
    return bytes(buf[:n])


def _remove_body() -> bytes:
    buf = arena()
    n = M.encode_remove(buf, np.arange(4, dtype=np.int64))
    return bytes(buf[:n])


def _search_response_body(with_payloads: bool) -> bytes:
    buf = arena()
    ids = np.arange(6, dtype=np.int64).reshape(2, 3)
    payloads = [(1, b"abc"), (2, b"\x01"), (0, b""), (1, b"d"), (1, b""), (2, b"ef")]
    n = M.encode_search_response(
        buf, ids.astype(np.float32), ids, payloads if with_payloads else None
    )
    return bytes(buf[:n])


DECODERS = {
    "search": (M.decode_search, _search_body),
    "add": (M.decode_add, _add_body),
    "remove": (M.decode_remove, _remove_body),
    "search_response": (M.decode_search_response, lambda: _search_response_body(False)),
    "search_response_payloads": (M.decode_search_response, lambda: _search_response_body(True)),
    "counts": (M.decode_counts, lambda: struct.pack("<QQ", 1, 2)),
}


def _as_buf(data: bytes) -> np.ndarray:
    return np.frombuffer(bytearray(data), np.uint8)


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_every_truncation_is_invalid_request(name: str) -> None:
    decode, make = DECODERS[name]
    body = make()
    decode(_as_buf(body), len(body))  # the whole body decodes
    for cut in range(len(body)):
        with pytest.raises(InvalidRequest):
            decode(_as_buf(body[:cut]), cut)


@pytest.mark.parametrize("name", ["search", "add", "remove"])
def test_end_limits_the_body_even_when_the_buffer_is_larger(name: str) -> None:
    # The sidecar hands decoders a whole arena: bytes past body_len must not be read.
    decode, make = DECODERS[name]
    body = make()
    buf = np.zeros(ARENA, np.uint8)
    buf[: len(body)] = np.frombuffer(body, np.uint8)
    with pytest.raises(InvalidRequest):
        decode(buf, len(body) - 8)


# -- garbled bodies ---------------------------------------------------------------------------


def _patched(body: bytes, offset: int, fmt: str, *values: object) -> np.ndarray:
    buf = _as_buf(body)
    struct.pack_into(fmt, buf, offset, *values)
    return buf


def test_unknown_vector_dtype() -> None:
    body = _search_body()
    with pytest.raises(InvalidRequest, match="dtype"):
        M.decode_search(_patched(body, 12, "<I", 7), len(body))
    body = _add_body()
    with pytest.raises(InvalidRequest, match="dtype"):
        M.decode_add(_patched(body, 8, "<I", 2), len(body))


def test_zero_queries_or_dimension() -> None:
    body = _search_body()
    with pytest.raises(InvalidRequest):
        M.decode_search(_patched(body, 0, "<I", 0), len(body))
    with pytest.raises(InvalidRequest):
        M.decode_search(_patched(body, 8, "<I", 0), len(body))


def test_add_of_zero_items() -> None:
    body = _add_body()
    with pytest.raises(InvalidRequest):
        M.decode_add(_patched(body, 0, "<I", 0), len(body))


def test_huge_counts_are_truncation_not_overflow() -> None:
    for decode, body, off in (
        (M.decode_search, _search_body(), 0),
        (M.decode_add, _add_body(), 0),
        (M.decode_remove, _remove_body(), 0),
        (M.decode_search_response, _search_response_body(True), 0),
        (M.decode_search_response, _search_response_body(True), 4),
    ):
        with pytest.raises(InvalidRequest):
            decode(_patched(body, off, "<I", 0xFFFFFFFF), len(body))
    body = _search_body()
    with pytest.raises(InvalidRequest):  # a scope length past the end
        M.decode_search(_patched(body, 16, "<I", 0xFFFFFFFF), len(body))


def _add_sections(body: bytes) -> tuple[int, int]:
    """Offsets of the kinds and of the payload offsets in _add_body()."""
    n, dim = 3, 4
    scope_len = 16 + 8  # "t" + "u" padded
    kinds = 16 + scope_len + n * 8 + n * dim * 4
    return kinds, kinds + 8


def test_add_payload_offsets_must_ascend_from_zero() -> None:
    body = _add_body()
    _, offs = _add_sections(body)
    with pytest.raises(InvalidRequest, match="offsets"):
        M.decode_add(_patched(body, offs, "<Q", 1), len(body))
    with pytest.raises(InvalidRequest, match="offsets"):
        M.decode_add(_patched(body, offs + 16, "<Q", 1), len(body))  # below offsets[1] == 4


def test_add_payload_offsets_must_stay_inside_the_body() -> None:
    body = _add_body()
    _, offs = _add_sections(body)
    with pytest.raises(InvalidRequest, match="outside"):
        M.decode_add(_patched(body, offs + 24, "<Q", 10_000), len(body))
    with pytest.raises(InvalidRequest):
        M.decode_add(_patched(body, offs + 24, "<Q", 2**64 - 1), len(body))


def test_add_unknown_payload_kind() -> None:
    body = _add_body()
    kinds, _ = _add_sections(body)
    with pytest.raises(InvalidRequest, match="kind"):
        M.decode_add(_patched(body, kinds, "<B", 9), len(body))


def test_add_text_payload_that_is_not_utf8() -> None:
    # Stored as text, it would fail to decode in every later search that returns it.
    buf = arena()
    n = M.encode_add(
        buf,
        np.array([1, 2], np.int64),
        np.ones((2, 2), np.float32),
        np.array([codes.PAYLOAD_TEXT, codes.PAYLOAD_BYTES], np.uint8),
        [b"ok\xff", b"\xff"],
        M.EMPTY_SCOPE,
    )
    with pytest.raises(InvalidRequest, match="UTF-8"):
        M.decode_add(buf[:n], n)
    # bytes payloads may hold anything
    n = M.encode_add(
        buf,
        np.array([1], np.int64),
        np.ones((1, 2), np.float32),
        np.array([codes.PAYLOAD_BYTES], np.uint8),
        [b"\xff"],
        M.EMPTY_SCOPE,
    )
    assert _add_payloads(M.decode_add(buf[:n], n)) == [b"\xff"]


def test_scope_that_is_not_utf8() -> None:
    body = bytearray(_search_body())
    body[32] = 0xFF  # the tenant "t"
    with pytest.raises(InvalidRequest, match="UTF-8"):
        M.decode_search(_as_buf(bytes(body)), len(body))


def test_search_response_text_that_is_not_utf8() -> None:
    body = bytearray(_search_response_body(True))
    body[body.index(b"abc")] = 0xFF
    with pytest.raises(InvalidRequest):
        M.decode_search_response(_as_buf(bytes(body)), len(body))


GARBLE = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("name", sorted(DECODERS))
@GARBLE
@given(data=st.data())
def test_garbled_bodies_decode_or_raise_invalid_request(name: str, data: st.DataObject) -> None:
    decode, make = DECODERS[name]
    body = bytearray(make())
    edits = data.draw(
        st.lists(
            st.tuples(st.integers(0, len(body) - 1), st.integers(0, 255)), min_size=1, max_size=8
        )
    )
    for pos, value in edits:
        body[pos] = value
    cut = data.draw(st.integers(0, len(body)))
    with contextlib.suppress(InvalidRequest):
        decode(_as_buf(bytes(body[:cut])), cut)


@pytest.mark.parametrize("name", sorted(DECODERS))
@GARBLE
@given(raw=st.binary(max_size=256))
def test_random_bytes_decode_or_raise_invalid_request(name: str, raw: bytes) -> None:
    decode, _ = DECODERS[name]
    with contextlib.suppress(InvalidRequest):
        decode(_as_buf(raw), len(raw))
