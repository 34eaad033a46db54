"""Bad input and failures, through a real sidecar over shm and uds.

Every bad request gets its exception of the tree, and the sidecar keeps serving: after each
one, a ping and a correct search succeed from the same client and from a second one. Inputs
the client validates itself are also sent raw, encoded with kalos.protocol.messages straight
into the channel past the client's checks, so that the sidecar's own validation is tested.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pytest

import kalos
import kalos.transport.handshake
from conftest import DIM, REAL_TRANSPORTS, TIMEOUT, stop_process
from kalos import Scope
from kalos.errors import (
    ClosedError,
    ConfigError,
    ConnectError,
    InvalidRequest,
    PayloadTooLarge,
    ProtocolMismatch,
    RequestTimeout,
    ServerError,
    SidecarGone,
)
from kalos.protocol import codes
from kalos.protocol import messages as M
from kalos.protocol.codes import PROTOCOL_VERSION, Op, Status
from kalos.testing import RunningSidecar

MAX_K = 1024
BASE = np.eye(DIM, dtype=np.float32) * np.arange(1, DIM + 1, dtype=np.float32)[:, None]
IDS = np.arange(DIM, dtype=np.int64) + 100
TEXTS = [f"memory {i}" for i in range(DIM)]


@dataclass
class Served:
    sidecar: RunningSidecar
    transport: str
    one: kalos.Client
    two: kalos.Client

    def connect(self, **kw: object) -> kalos.Client:
        kw.setdefault("timeout", TIMEOUT)
        return self.sidecar.connect(transport=self.transport, **kw)


@pytest.fixture(params=REAL_TRANSPORTS)
def served(
    request: pytest.FixtureRequest, sidecar: Callable[..., RunningSidecar]
) -> Iterator[Served]:
    """A real sidecar holding DIM items, and two clients of it."""
    sc = sidecar(dim=DIM)
    one = sc.connect(transport=request.param, timeout=TIMEOUT)
    two = sc.connect(transport=request.param, timeout=TIMEOUT)
    one.add(BASE, IDS, payloads=TEXTS, scope=Scope("t"))
    yield Served(sc, request.param, one, two)
    for c in (one, two):
        c.close()
    if sc.process.poll() is None:
        os.kill(sc.process.pid, signal.SIGCONT)  # a test that stopped it may have failed


def assert_serving(s: Served) -> None:
    """A ping and a correct search work from both clients."""
    for c in (s.one, s.two):
        c.ping()
        r = c.search(BASE[3], k=2, scope=Scope("t"))
        assert r.ids[0] == IDS[3]
        assert r.payloads is not None and r.payloads[0] == TEXTS[3]
    assert s.one.stats()["items"] == DIM


def send_raw(
    client: kalos.Client,
    op: int,
    encode: Callable[[np.ndarray], int] | None = None,
    *,
    flags: int = 0,
    body_len: int | None = None,
) -> tuple[int, str]:
    """Sends a request past the client's checks; returns (status, message)."""
    t = client._channel()
    n = encode(t.request_buffer) if encode is not None else 0
    resp = t.request(op, flags, n if body_len is None else body_len, timeout=TIMEOUT)
    return resp.status, M.decode_text(resp.body, len(resp.body))


def raw_search(q: np.ndarray, k: int = 5, scope: Scope | None = None) -> Callable:
    return lambda buf: M.encode_search(
        buf, np.ascontiguousarray(q), k, M.encode_scope_fields(scope)
    )


def raw_add(v: np.ndarray, ids: list[int], payloads: list[bytes] | None = None) -> Callable:
    n = len(ids)
    kinds = np.full(n, codes.PAYLOAD_BYTES if payloads else codes.PAYLOAD_NONE, np.uint8)
    blobs = payloads or [b""] * n
    arr = np.array(ids, np.int64)
    return lambda buf: M.encode_add(buf, arr, np.ascontiguousarray(v), kinds, blobs, M.EMPTY_SCOPE)


# -- bad input --------------------------------------------------------------------------------


def test_wrong_dimension_query(served: Served) -> None:
    with pytest.raises(InvalidRequest, match="dimension"):
        served.one.search(np.ones(DIM + 1), k=1)
    assert_serving(served)
    status, message = send_raw(served.one, Op.SEARCH, raw_search(np.ones((1, DIM + 1), np.float32)))
    assert status == Status.INVALID_REQUEST
    assert "dimension" in message
    assert_serving(served)
    status, _ = send_raw(served.one, Op.SEARCH, raw_search(np.ones((2, DIM - 1), np.float16)))
    assert status == Status.INVALID_REQUEST
    assert_serving(served)


def test_wrong_dimension_add(served: Served) -> None:
    with pytest.raises(InvalidRequest, match="dimension"):
        served.one.add(np.ones((2, DIM + 3)), [1, 2])
    assert_serving(served)
    status, message = send_raw(
        served.one, Op.ADD, raw_add(np.ones((2, DIM + 3), np.float32), [1, 2])
    )
    assert status == Status.INVALID_REQUEST
    assert "dimension" in message
    assert_serving(served)  # nothing was added


BAD_VALUES = [np.nan, np.inf, -np.inf]


@pytest.mark.parametrize("bad", BAD_VALUES, ids=["nan", "inf", "-inf"])
def test_non_finite_query(served: Served, bad: float) -> None:
    for dtype in (np.float32, np.float16, np.float64):
        q = np.ones(DIM, dtype)
        q[2] = bad
        with pytest.raises(InvalidRequest, match="NaN or inf"):
            served.one.search(q, k=3)
        assert_serving(served)
    q = np.ones((3, DIM), np.float32)
    q[1, 0] = bad  # one bad row spoils the batch
    status, message = send_raw(served.one, Op.SEARCH, raw_search(q))
    assert status == Status.INVALID_REQUEST and "NaN or inf" in message
    assert_serving(served)


@pytest.mark.parametrize("bad", BAD_VALUES, ids=["nan", "inf", "-inf"])
def test_non_finite_vectors(served: Served, bad: float) -> None:
    v = np.ones((3, DIM), np.float32)
    v[2, 5] = bad
    with pytest.raises(InvalidRequest, match="NaN or inf"):
        served.one.add(v, [1, 2, 3])  # the whole batch is refused
    assert_serving(served)
    status, _ = send_raw(served.one, Op.ADD, raw_add(v.astype(np.float16), [1, 2, 3]))
    assert status == Status.INVALID_REQUEST
    assert_serving(served)
    assert served.two.search(np.ones(DIM), k=DIM + 3).ids[DIM:].tolist() == [-1, -1, -1]


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_float64_overflowing_float32_is_refused(served: Served) -> None:
    with pytest.raises(InvalidRequest):
        served.one.add(np.full(DIM, 1e300), 1)
    with pytest.raises(InvalidRequest):
        served.one.search(np.full(DIM, -1e300), k=1)
    assert_serving(served)


@pytest.mark.parametrize("k", [0, -1, MAX_K + 1, 10**9])
def test_k_out_of_range_in_the_client(served: Served, k: int) -> None:
    with pytest.raises(InvalidRequest, match="k must be"):
        served.one.search(np.ones(DIM), k=k)
    assert_serving(served)


@pytest.mark.parametrize("k", [True, 2.0, "3"], ids=["bool", "float", "str"])
def test_k_that_is_no_integer(served: Served, k: object) -> None:
    with pytest.raises(InvalidRequest, match="k must be an integer"):
        served.one.search(np.ones(DIM), k=k)  # type: ignore[arg-type]
    assert_serving(served)


@pytest.mark.parametrize(
    "ids",
    [
        np.array([3.5]),  # a float is not truncated to 3
        np.array([3.0]),
        [7.0],
        [True],
        np.array([2**63], np.uint64),  # would wrap to -2**63
        np.array([2**64 - 1], np.uint64),  # would wrap to -1
        [2**63],
        [1, 2**64],  # numpy makes this list's ints objects
        [1, 2**63],  # ... and this one's floats
        ["a string id", 2**63],
    ],
    ids=[
        "float",
        "integral-float",
        "float-list",
        "bool",
        "uint64-2^63",
        "uint64-max",
        "int-2^63",
        "int-2^64",
        "int-mixed",
        "str-and-int-2^63",
    ],
)
def test_ids_that_are_no_int64_are_refused_not_cast(served: Served, ids: object) -> None:
    with pytest.raises(InvalidRequest, match="an id must be a str or an integer in int64"):
        served.one.add(np.ones((np.size(ids), DIM)), ids)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="an id must be"):
        served.one.remove(ids)  # type: ignore[arg-type]
    assert served.one.stats()["items"] == DIM  # nothing was added
    assert_serving(served)


def test_ids_at_int64s_bounds_and_unsigned_ones_that_fit(served: Served) -> None:
    ids = np.array([2**63 - 1, -(2**63)], np.int64)
    assert served.one.add(np.ones((2, DIM)), [2**63 - 1, -(2**63)]) == 2
    assert served.one.add(np.ones((1, DIM)), np.array([2**62], np.uint64)) == 1
    assert served.one.remove(ids) == 2
    assert served.one.remove(np.array([2**62], np.uint64)) == 1
    with pytest.raises(InvalidRequest, match="one-dimensional"):
        served.one.add(np.ones((2, DIM)), np.array([[1, 2]]))
    assert_serving(served)


def test_scope_fields_that_are_no_str_are_refused(served: Served) -> None:
    for scope in (Scope(123), Scope("acme", b"user"), Scope(None, None, 7)):  # type: ignore[arg-type]
        with pytest.raises(InvalidRequest, match="must each be a str or None"):
            served.one.add(np.ones((1, DIM)), [1], scope=scope)
        with pytest.raises(InvalidRequest, match="must each be a str or None"):
            served.one.search(np.ones(DIM), k=1, scope=scope)
    with pytest.raises(InvalidRequest, match="must each be a str or None"):
        served.one.append_turn("s", "user", "hi", tokens=[1], scope=Scope(5))  # type: ignore[arg-type]
    assert served.one.stats()["items"] == DIM
    assert_serving(served)


def test_a_filter_or_metadata_nested_past_pythons_limit_is_refused(served: Served) -> None:
    deep: dict = {"a": 1}
    for _ in range(5000):  # json.dumps recurses once a level: past the interpreter's limit
        deep = {"$not": deep}
    with pytest.raises(InvalidRequest, match="filter cannot be sent as JSON"):
        served.one.search(np.ones(DIM), k=1, where=deep)
    with pytest.raises(InvalidRequest, match="metadata 0 cannot be stored"):
        served.one.add(np.ones((1, DIM)), [1], metadata=[deep])
    assert_serving(served)


def test_counts_that_are_no_integers_are_refused(served: Served) -> None:
    one = served.one
    one.append_turn("s", "user", "hello", tokens=[1, 2])
    version = one.put("key", "v")
    calls = [
        ("max_tokens", lambda: one.context("s", 10.5)),  # type: ignore[arg-type]
        ("max_turns", lambda: one.context("s", 10, 2.0)),  # type: ignore[arg-type]
        ("max_tokens", lambda: one.recall("s", np.ones(DIM), max_tokens=True)),
        ("memory_tokens", lambda: one.recall("s", np.ones(DIM), max_tokens=9, memory_tokens=1.0)),  # type: ignore[arg-type]
        ("keep_turns", lambda: one.trim("s", 1.5)),  # type: ignore[arg-type]
        ("expected_version", lambda: one.cas("key", float(version), "w")),  # type: ignore[arg-type]
        ("expected_version", lambda: one.cas("key", True, "w")),
        ("since", lambda: one.events("s", 1.5)),  # type: ignore[arg-type]
        ("limit", lambda: one.events("s", limit=2.0)),  # type: ignore[arg-type]
    ]
    for name, call in calls:
        with pytest.raises(InvalidRequest, match=f"{name} must be an integer"):
            call()
    assert one.context("s", 10).tokens.tolist() == [1, 2]  # nothing changed
    assert one.get("key") == (version, b"v")
    assert_serving(served)


@pytest.mark.parametrize("timeout", [-1, -0.001, float("nan"), float("inf"), 1e10])
def test_a_timeout_that_is_none_is_invalid_not_a_timeout(served: Served, timeout: float) -> None:
    with pytest.raises(InvalidRequest, match="timeout must be a number of seconds"):
        served.one.ping(timeout=timeout)
    with pytest.raises(InvalidRequest, match="timeout must be"):
        served.one.search(np.ones(DIM), k=1, timeout=timeout)
    with pytest.raises(ConfigError, match="timeout must be a positive number"):
        served.connect(timeout=timeout)
    with pytest.raises(RequestTimeout, match="before its request was sent"):
        served.one.ping(timeout=0)  # no time at all: the deadline has passed
    assert_serving(served)


@pytest.mark.parametrize("k", [0, MAX_K + 1, 2**32 - 1])
def test_k_out_of_range_in_the_sidecar(served: Served, k: int) -> None:
    status, message = send_raw(served.one, Op.SEARCH, raw_search(np.ones((1, DIM), np.float32), k))
    assert status == Status.INVALID_REQUEST
    assert "k must be" in message
    assert_serving(served)


def test_id_minus_one_is_refused(served: Served) -> None:
    with pytest.raises(InvalidRequest, match="-1"):
        served.one.add(np.ones((2, DIM)), [5, -1])
    assert_serving(served)  # neither item was added
    status, _ = send_raw(served.one, Op.ADD, raw_add(np.ones((1, DIM), np.float32), [-1]))
    assert status == Status.INVALID_REQUEST
    assert_serving(served)


def test_payload_larger_than_the_arena(served: Served) -> None:
    with pytest.raises(PayloadTooLarge):
        served.one.add(np.ones(DIM), 1, b"x" * (2 << 20))  # 2 MiB, the arena holds 1 MiB
    small = served.connect(arena_bytes=65536)
    with pytest.raises(PayloadTooLarge):
        small.add(np.ones((2, DIM)), [1, 2], payloads=["ok", "y" * 70_000])
    with pytest.raises(PayloadTooLarge):
        small.search(np.ones((3000, DIM)), k=1)  # the request does not fit
    assert small.ping()
    small.close()
    assert_serving(served)


def test_response_larger_than_the_arena(served: Served) -> None:
    small = served.connect(arena_bytes=65536)
    # 8 x 1024 hits = 96 KiB of ids and scores: only the sidecar can tell
    with pytest.raises(PayloadTooLarge):
        small.search(np.ones((8, DIM)), k=MAX_K, payloads=False)
    assert small.search(np.ones(DIM), k=MAX_K).ids[0] == IDS[-1]  # the channel still works
    small.close()
    assert_serving(served)


def test_body_len_larger_than_the_arena(served: Served) -> None:
    t = served.one._channel()
    arena = len(t.request_buffer)
    status, message = send_raw(served.one, Op.PING, body_len=arena + 1)
    assert status == Status.PAYLOAD_TOO_LARGE
    assert "exceeds the arena" in message
    assert_serving(served)
    status, _ = send_raw(served.two, Op.SEARCH, body_len=2**63)
    assert status == Status.PAYLOAD_TOO_LARGE
    assert_serving(served)


@pytest.mark.parametrize("op", [0, 0xBEEF, 2**31, 2**32 - 1])
def test_unknown_op(served: Served, op: int) -> None:
    status, message = send_raw(served.one, op)
    assert status == Status.UNKNOWN_OP
    assert str(op) in message
    assert_serving(served)
    t = served.two._channel()
    with pytest.raises(InvalidRequest, match=f"unknown op {op}"):
        served.two._call(t, op, 0, 0, None, time.monotonic_ns())
    assert_serving(served)


@pytest.mark.parametrize("op", [Op.SEARCH, Op.ADD, Op.REMOVE])
def test_garbled_bodies_never_fail_the_sidecar(served: Served, op: Op) -> None:
    rng = np.random.default_rng(int(op))
    t = served.one._channel()
    errors_before = served.one.stats()["errors"]
    statuses = set()
    for i in range(150):
        n = int(rng.integers(0, 200))
        t.request_buffer[:n] = rng.integers(0, 256, n, dtype=np.uint8)
        if i % 3 == 0 and n >= 16:  # plausible small counts reach deeper into the decoder
            t.request_buffer[0:16].view(np.uint32)[:] = rng.integers(0, 4, 4)
        resp = t.request(op, 0, n, timeout=TIMEOUT)
        statuses.add(resp.status)
        assert resp.status in (Status.OK, Status.INVALID_REQUEST, Status.PAYLOAD_TOO_LARGE), (
            i,
            M.decode_text(resp.body, len(resp.body)),
        )
    assert Status.INVALID_REQUEST in statuses
    assert served.one.stats()["errors"] > errors_before
    if op != Op.ADD:  # a random add may have landed an item; searches and removes change nothing
        assert_serving(served)
    else:
        for c in (served.one, served.two):
            c.ping()


def test_text_payload_that_is_not_utf8_is_refused(served: Served) -> None:
    def encode(buf: np.ndarray) -> int:
        kinds = np.array([codes.PAYLOAD_TEXT], np.uint8)
        return M.encode_add(buf, np.array([7], np.int64), np.ones((1, DIM), np.float32), kinds,
                            [b"\xff\xfe"], M.encode_scope_fields(Scope("t")))  # fmt: skip

    status, message = send_raw(served.one, Op.ADD, encode)
    assert status == Status.INVALID_REQUEST and "UTF-8" in message
    assert_serving(served)  # searches returning it would otherwise fail to decode


def test_errors_are_counted(served: Served) -> None:
    before = served.two.stats()["errors"]
    with pytest.raises(InvalidRequest):
        served.one.search(np.full(DIM, np.nan), k=1)
    send_raw(served.one, 77)
    assert served.two.stats()["errors"] == before + 2


# -- connecting -------------------------------------------------------------------------------


def test_protocol_version_mismatch(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kalos.transport.handshake, "PROTOCOL_VERSION", (99, 0))
    with pytest.raises(ProtocolMismatch) as info:
        served.connect()
    assert "99.0" in str(info.value)  # the client's version
    assert "{}.{}".format(*PROTOCOL_VERSION) in str(info.value)  # and the sidecar's
    monkeypatch.undo()
    assert_serving(served)
    served.connect().close()  # the right version still connects


def test_a_newer_minor_version_is_negotiated_down(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kalos.transport.handshake, "PROTOCOL_VERSION", (1, 7))
    client = served.connect()
    assert client.info["protocol"] == list(PROTOCOL_VERSION)
    client.ping()
    client.close()


@pytest.mark.parametrize("transport", REAL_TRANSPORTS)
def test_no_sidecar_running(tmp_path: object, transport: str) -> None:
    with pytest.raises(ConnectError, match="no sidecar"):
        kalos.connect("nobody", runtime_dir=str(tmp_path), transport=transport, timeout=5)


def test_a_socket_nobody_listens_on(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "dead.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)  # bound, never listening: what a killed sidecar leaves
    try:
        with pytest.raises(ConnectError):
            kalos.connect("dead", runtime_dir=str(tmp_path), timeout=5)
    finally:
        s.close()
    open(os.path.join(str(tmp_path), "file.sock"), "w").close()
    with pytest.raises(ConnectError):
        kalos.connect("file", runtime_dir=str(tmp_path), timeout=5)


def test_bad_names_and_transports(served: Served) -> None:
    with pytest.raises(ConfigError):
        kalos.connect("../etc/passwd", runtime_dir=served.sidecar.runtime_dir)
    with pytest.raises(ConfigError):
        kalos.connect(served.sidecar.name, runtime_dir=served.sidecar.runtime_dir, transport="tcp")


def test_calls_after_close(served: Served) -> None:
    before = served.two.stats()
    served.one.close()
    for call in (
        served.one.ping,
        served.one.stats,
        lambda: served.one.search(np.ones(DIM), k=1),
        lambda: served.one.add(np.ones(DIM), 1),
        lambda: served.one.remove([1]),
    ):
        with pytest.raises(ClosedError):
            call()
    # from another thread too (which never had a channel)
    caught: list[BaseException] = []

    def other_thread() -> None:
        try:
            served.one.ping()
        except BaseException as exc:
            caught.append(exc)

    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    assert len(caught) == 1 and isinstance(caught[0], ClosedError)
    # the sidecar released the closed client's channel (or connection)
    key = "channels" if served.transport == "shm" else "uds_connections"
    deadline = time.monotonic() + TIMEOUT
    while served.two.stats()[key] != before[key] - 1:
        assert time.monotonic() < deadline, "the sidecar kept the closed client's channel"
        time.sleep(0.05)


def test_close_while_another_thread_waits(served: Served) -> None:
    outcome: list[BaseException | str] = []
    ready, go = threading.Event(), threading.Event()

    def call() -> None:
        served.one.ping()  # this thread's channel exists before the sidecar stops
        ready.set()
        go.wait()
        try:
            served.one.ping(timeout=TIMEOUT)
            outcome.append("returned")
        except BaseException as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=call)
    waiter.start()
    ready.wait(TIMEOUT)
    stop_process(served.sidecar.process.pid)  # so that the ping waits
    try:
        go.set()
        time.sleep(0.3)
        served.one.close()  # closes every thread's channel, the waiting one's too
        waiter.join(TIMEOUT / 2)
    finally:
        os.kill(served.sidecar.process.pid, signal.SIGCONT)
    assert not waiter.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], ClosedError), outcome
    assert_serving_two(served)


def assert_serving_two(s: Served) -> None:
    s.two.ping()
    assert s.two.search(BASE[3], k=1, scope=Scope("t")).ids.tolist() == [IDS[3]]


# -- a stopped or dead sidecar ----------------------------------------------------------------


def test_request_timeout_then_recovery(served: Served) -> None:
    pid = served.sidecar.process.pid
    stop_process(pid)
    try:
        with pytest.raises(RequestTimeout):
            served.one.ping(timeout=0.5)
        # by now the heartbeat may be over a second old: a shm client then sees a hung sidecar
        with pytest.raises((RequestTimeout, SidecarGone)):
            served.two.add(np.ones(DIM), 999, "late", timeout=0.5)
    finally:
        os.kill(pid, signal.SIGCONT)
    # the same clients carry on: each opens a new channel
    assert_serving(served)
    # the add whose deadline passed before the sidecar reached it was not carried out
    r = served.two.search(np.ones(DIM), k=DIM + 1, payloads=False)
    assert 999 not in r.ids.tolist()


def test_timeout_status_from_the_sidecar_is_request_timeout() -> None:
    exc = codes.error_for_status(Status.TIMEOUT, "deadline passed")
    assert isinstance(exc, RequestTimeout)


def test_sidecar_killed_before_the_next_call(served: Served) -> None:
    served.sidecar.process.kill()
    served.sidecar.process.wait(TIMEOUT)
    for c in (served.one, served.two):
        with pytest.raises((SidecarGone, ConnectError)):
            c.ping()
        with pytest.raises(ConnectError):  # nobody to reconnect to
            c.search(np.ones(DIM), k=1)


def test_sidecar_killed_while_the_client_waits(served: Served) -> None:
    proc = served.sidecar.process
    stop_process(proc.pid)  # the request below waits for an answer...

    def kill() -> None:
        proc.kill()  # ...and the sidecar dies instead
        proc.wait(TIMEOUT)

    killer = threading.Timer(0.5, kill)
    killer.start()
    try:
        with pytest.raises(SidecarGone):  # not RequestTimeout after TIMEOUT s: no hang
            served.one.search(np.ones(DIM), k=1, timeout=TIMEOUT)
    finally:
        killer.join()
    with pytest.raises(ConnectError):
        served.one.ping()


def test_client_reconnects_to_a_restarted_sidecar(
    served: Served, sidecar: Callable[..., RunningSidecar]
) -> None:
    old = served.sidecar
    old.process.kill()
    old.process.wait(TIMEOUT)
    with pytest.raises((SidecarGone, ConnectError)):
        served.one.ping()
    sidecar(dim=DIM, name=old.name, runtime_dir=old.runtime_dir)  # same name, same directory
    served.one.ping()  # the same client object carries on
    assert served.one.stats()["items"] == 0  # a new sidecar (no durability yet)
    assert served.one.add(BASE[0], 1) == 1


def test_server_error_is_not_a_caller_error() -> None:
    exc = codes.error_for_status(Status.SERVER_ERROR, "internal error: boom")
    assert isinstance(exc, ServerError) and not isinstance(exc, InvalidRequest)
