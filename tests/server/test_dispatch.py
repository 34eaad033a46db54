"""The dispatcher: any bytes in, a status and a short message out, and it keeps serving."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kalos.index
from kalos.protocol import messages as M
from kalos.protocol.codes import Op, Status
from kalos.server.dispatch import Dispatcher
from kalos.stores.memories import MemoryStore

DIM = 4


def make_dispatcher(metric: str = "ip") -> Dispatcher:
    return Dispatcher(MemoryStore(kalos.index.create("cpu:flat", dim=DIM, metric=metric)))


def call(d: Dispatcher, op: int, body: bytes = b"", flags: int = 0) -> tuple[int, bytes]:
    out = np.zeros(1 << 16, np.uint8)
    buf = np.frombuffer(bytearray(body), np.uint8)
    status, n, compute_ns, write_ns = d.handle(op, flags, buf, out)
    assert compute_ns >= 0 and write_ns >= 0
    return status, bytes(out[:n])


def add_body(ids: list[int], payload: bytes = b"") -> bytes:
    buf = np.zeros(1 << 16, np.uint8)
    n = len(ids)
    kinds = np.full(n, 2 if payload else 0, np.uint8)
    size = M.encode_add(buf, np.array(ids, np.int64), np.ones((n, DIM), np.float32), kinds,
                        [payload] * n, M.EMPTY_SCOPE)  # fmt: skip
    return bytes(buf[:size])


def search_body(k: int = 3) -> bytes:
    buf = np.zeros(1 << 16, np.uint8)
    return bytes(buf[: M.encode_search(buf, np.ones((1, DIM), np.float32), k, M.EMPTY_SCOPE)])


def test_ping_and_stats() -> None:
    d = make_dispatcher()
    assert call(d, Op.PING) == (Status.OK, b"")
    status, body = call(d, Op.STATS)
    assert status == Status.OK
    stats = json.loads(body)
    assert stats["items"] == 0 and stats["dim"] == DIM and stats["requests"]["ping"] == 1


def test_add_search_remove() -> None:
    d = make_dispatcher()
    status, body = call(d, Op.ADD, add_body([1, 2], b"x"))
    assert status == Status.OK
    assert M.decode_counts(np.frombuffer(body, np.uint8), len(body)) == (2, 0)
    status, body = call(d, Op.ADD, add_body([2, 3]))
    assert M.decode_counts(np.frombuffer(body, np.uint8), len(body)) == (1, 1)  # new, replaced
    status, body = call(d, Op.SEARCH, search_body(4), flags=1)
    r = M.decode_search_response(np.frombuffer(body, np.uint8), len(body))
    assert sorted(r.ids[0, :3].tolist()) == [1, 2, 3] and r.ids[0, 3] == -1
    assert r.payloads is not None and sorted(map(repr, r.payloads[:3])) == ["None", "None", "b'x'"]
    buf = np.zeros(64, np.uint8)
    n = M.encode_remove(buf, np.array([1, 9], np.int64))
    status, body = call(d, Op.REMOVE, bytes(buf[:n]))
    assert M.decode_counts(np.frombuffer(body, np.uint8), len(body)) == (1, 0)


def test_unknown_op() -> None:
    d = make_dispatcher()
    status, body = call(d, 4242)
    assert status == Status.UNKNOWN_OP and body == b"unknown op 4242"
    assert d.errors == 1


def test_an_internal_failure_is_a_server_error_without_traceback(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    d = make_dispatcher()
    call(d, Op.ADD, add_body([1]))

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(d.memories, "search", broken)
    with caplog.at_level(logging.ERROR, logger="kalos.server"):
        status, body = call(d, Op.SEARCH, search_body())
    assert status == Status.SERVER_ERROR
    assert body == b"internal error: RuntimeError: disk on fire"
    assert b"Traceback" not in body
    assert "disk on fire" in caplog.text  # the traceback goes to the sidecar's log instead
    assert d.errors == 1
    monkeypatch.undo()
    assert call(d, Op.SEARCH, search_body())[0] == Status.OK  # and it carries on


def test_an_error_message_longer_than_the_arena_is_cut() -> None:
    d = make_dispatcher()
    out = np.zeros(8, np.uint8)
    status, n, _, _ = d.handle(999, 0, np.zeros(0, np.uint8), out)
    assert status == Status.UNKNOWN_OP and n == 8


@settings(max_examples=400, deadline=None)
@given(
    op=st.sampled_from([Op.ADD, Op.SEARCH, Op.REMOVE, Op.STATS, Op.PING, 0, 0xBEEF]),
    flags=st.integers(0, 3),
    body=st.one_of(
        st.binary(max_size=200),
        # plausible headers (small counts) reach past the first length check
        st.tuples(st.lists(st.integers(0, 5), min_size=4, max_size=4), st.binary(max_size=200)).map(
            lambda t: np.array(t[0], np.uint32).tobytes() + t[1]
        ),
    ),
)
def test_random_requests_never_fail_the_dispatcher(op: int, flags: int, body: bytes) -> None:
    d = make_dispatcher()
    status, _ = call(d, op, body, flags)
    assert status in (Status.OK, Status.INVALID_REQUEST, Status.UNKNOWN_OP,
                      Status.PAYLOAD_TOO_LARGE)  # fmt: skip
    assert call(d, Op.PING)[0] == Status.OK
