"""The client's semantics, over every transport: in-process first, then shm, uds and grpc.

Each test gets a fresh store (a new sidecar process for shm, uds and grpc) from the ``backend``
fixture of conftest.py; ``client`` is one client of a fresh ip store of dimension DIM.
"""

from __future__ import annotations

import ctypes
import dataclasses
import signal
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

import kalos
from conftest import DIM, TIMEOUT, Backend
from first_waits import record_first_waits
from kalos import Scope
from kalos.errors import ClosedError, ConfigError, InvalidRequest
from kalos.testing import RunningSidecar

MAX_K = 1024


def unit_rows(n: int, dim: int = DIM, seed: int = 0) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def exact_ip_topk(base: np.ndarray, ids: np.ndarray, q: np.ndarray, k: int) -> np.ndarray:
    scores = base.astype(np.float64) @ q.astype(np.float64)
    return ids[np.argsort(-scores, kind="stable")[:k]]


# -- basics -----------------------------------------------------------------------------------


def test_ping_returns_timings(client: kalos.Client) -> None:
    t = client.ping()
    assert isinstance(t, kalos.Timings)
    assert all(isinstance(x, float) for x in t)
    assert t.total_us > 0
    assert t.queue_us >= 0 and t.compute_us >= 0 and t.write_us >= 0
    assert client.last_timings == t
    assert client.ping() is not t


def test_info_describes_the_sidecar(backend: Callable[..., Backend]) -> None:
    client = backend(dim=12, metric="l2").connect()
    assert client.dim == 12
    info = client.info
    assert info["dim"] == 12
    assert info["metric"] == "l2"
    assert info["max_k"] == MAX_K
    assert info["index"] == "cpu:flat"


def test_add_counts_new_items_and_search_finds_them(client: kalos.Client) -> None:
    base = unit_rows(50)
    ids = np.arange(100, 150, dtype=np.int64)
    assert client.add(base, ids) == 50
    assert client.add(base[:10], ids[:10]) == 0  # upserts, nothing new
    assert client.stats()["items"] == 50
    for i in (0, 17, 49):
        r = client.search(base[i], k=5)
        np.testing.assert_array_equal(r.ids, exact_ip_topk(base, ids, base[i], 5))
        assert r.ids[0] == ids[i]
        np.testing.assert_allclose(r.scores, np.sort(base @ base[i])[::-1][:5], rtol=1e-5)
        assert r.ids.dtype == np.int64 and r.scores.dtype == np.float32
        assert r.ids.shape == (5,) and r.scores.shape == (5,)


def test_scores_are_descending_for_ip(client: kalos.Client) -> None:
    base = unit_rows(40, seed=1)
    client.add(base, np.arange(40))
    r = client.search(unit_rows(1, seed=2)[0], k=40)
    assert (np.diff(r.scores) <= 0).all()
    assert sorted(r.ids.tolist()) == list(range(40))


def test_fewer_items_than_k_pads_with_minus_one(backend: Callable[..., Backend]) -> None:
    for metric, missing in (("ip", -np.inf), ("l2", np.inf)):
        client = backend(metric=metric).connect()
        client.add(unit_rows(3), [1, 2, 3])
        r = client.search(unit_rows(1, seed=5)[0], k=6)
        assert sorted(r.ids[:3].tolist()) == [1, 2, 3]
        assert r.ids[3:].tolist() == [-1, -1, -1]
        assert (r.scores[3:] == missing).all()
        assert r.payloads is not None and r.payloads[3:] == [None, None, None]


def test_search_of_an_empty_store(client: kalos.Client) -> None:
    r = client.search(np.ones(DIM, np.float32), k=3)
    assert r.ids.tolist() == [-1, -1, -1]
    assert r.payloads == [None, None, None]


def test_k_bounds(client: kalos.Client) -> None:
    client.add(unit_rows(5), np.arange(5))
    assert client.search(np.ones(DIM), k=1).ids.shape == (1,)
    r = client.search(np.ones(DIM), k=MAX_K, payloads=False)
    assert r.ids.shape == (MAX_K,)
    assert (r.ids[5:] == -1).all()


def test_remove(client: kalos.Client) -> None:
    base = unit_rows(10)
    client.add(base, np.arange(10), payloads=[f"p{i}" for i in range(10)])
    assert client.remove([3, 4, 99]) == 2  # 99 never existed
    assert client.remove(3) == 0  # already gone
    assert client.remove([]) == 0
    assert client.stats()["items"] == 8
    r = client.search(base[3], k=10)
    assert 3 not in r.ids.tolist() and 4 not in r.ids.tolist()
    assert r.ids[-2:].tolist() == [-1, -1]
    # a removed id can come back, with a new payload
    assert client.add(base[3], 3, "again") == 1
    r = client.search(base[3], k=1)
    assert r.ids.tolist() == [3] and r.payloads == ["again"]


def test_ids_as_scalar_list_or_array(client: kalos.Client) -> None:
    base = unit_rows(4)
    assert client.add(base[0], 7) == 1
    assert client.add(base[1:3], [8, 9]) == 2
    assert client.add(base[3:], np.array([2**62], np.int64)) == 1
    assert client.search(base[3], k=1).ids[0] == 2**62
    assert client.add(base[0], -(2**63)) == 1  # any int64 but -1
    assert client.search(base[0], k=2).ids.tolist() in ([7, -(2**63)], [-(2**63), 7])


def test_add_of_no_items(client: kalos.Client) -> None:
    assert client.add(np.zeros((0, DIM), np.float32), []) == 0
    assert client.stats()["items"] == 0


# -- payloads ---------------------------------------------------------------------------------


PAYLOADS = ["plain text", "ünïcødé 🙂 用户", "", b"\x00\xff\xfe raw", b"", None, "x" * 5000]


def test_payloads_round_trip(client: kalos.Client) -> None:
    n = len(PAYLOADS)
    base = np.eye(n, DIM, dtype=np.float32)
    client.add(base, np.arange(n), payloads=PAYLOADS)
    for i, expected in enumerate(PAYLOADS):
        r = client.search(base[i], k=1)
        assert r.ids[0] == i
        got = r.payloads[0]  # type: ignore[index]
        assert got == expected
        assert type(got) is type(expected)  # text stays str, bytes stay bytes, None stays None


def test_payloads_are_optional_in_results(client: kalos.Client) -> None:
    client.add(unit_rows(2), [1, 2], payloads=["a", "b"])
    r = client.search(np.ones(DIM), k=2, payloads=False)
    assert r.payloads is None
    assert sorted(r.ids.tolist()) == [1, 2]


def test_one_payload_for_one_vector(client: kalos.Client) -> None:
    client.add(np.ones(DIM, np.float32), 5, "only")
    assert client.search(np.ones(DIM), k=1).payloads == ["only"]
    client.add(np.ones(DIM, np.float32), 6, b"raw")
    assert set(client.search(np.ones(DIM), k=2).payloads) == {"only", b"raw"}  # type: ignore[arg-type]


def test_payload_bytes_are_accounted(client: kalos.Client) -> None:
    client.add(unit_rows(2), [1, 2], payloads=["abcd", b"123456"])
    assert client.stats()["payload_bytes"] == 10
    client.add(unit_rows(1)[0], 1, "ab")  # replaced: 4 bytes -> 2
    assert client.stats()["payload_bytes"] == 8
    client.remove(2)
    assert client.stats()["payload_bytes"] == 2


# -- scopes -----------------------------------------------------------------------------------


def _scoped_store(client: kalos.Client) -> np.ndarray:
    """Ids 0..11: tenant a (user u1: 0-3, u2: 4-5), tenant b (u1: 6-9), no scope: 10-11."""
    base = unit_rows(12, seed=3)
    client.add(base[0:2], [0, 1], scope=Scope("a", "u1", "s1"))
    client.add(base[2:4], [2, 3], scope=Scope("a", "u1"))
    client.add(base[4:6], [4, 5], scope=Scope("a", "u2", "s1"))
    client.add(base[6:10], [6, 7, 8, 9], scope=Scope("b", "u1"))
    client.add(base[10:12], [10, 11])
    return base


SCOPE_CASES = [
    (None, set(range(12))),
    (Scope(), set(range(12))),
    (Scope("a"), {0, 1, 2, 3, 4, 5}),
    (Scope("b"), {6, 7, 8, 9}),
    (Scope("a", "u1"), {0, 1, 2, 3}),
    (Scope("b", "u1"), {6, 7, 8, 9}),
    (Scope("a", "u1", "s1"), {0, 1}),
    (Scope(None, "u1"), {0, 1, 2, 3, 6, 7, 8, 9}),
    (Scope(None, None, "s1"), {0, 1, 4, 5}),
    (Scope("b", "u2"), set()),  # both names exist, never together
    (Scope("nobody"), set()),  # an unknown tenant
    (Scope("a", "nobody"), set()),
]


def test_scope_filtering(client: kalos.Client) -> None:
    _scoped_store(client)
    q = np.ones(DIM, np.float32)
    for scope, expected in SCOPE_CASES:
        r = client.search(q, k=12, scope=scope)
        found = {int(i) for i in r.ids if i != -1}
        assert found == expected, scope
        assert (r.ids[len(expected) :] == -1).all(), scope  # the hits come first


def test_unknown_tenant_gets_all_minus_one(client: kalos.Client) -> None:
    _scoped_store(client)
    r = client.search(np.ones((2, DIM), np.float32), k=4, scope=Scope("unknown"))
    assert (r.ids == -1).all()
    assert (r.scores == -np.inf).all()
    assert r.payloads == [None] * 8


def test_scope_must_be_a_scope(client: kalos.Client) -> None:
    with pytest.raises(InvalidRequest):
        client.search(np.ones(DIM), k=1, scope=("a", "u"))  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest):
        client.add(np.ones(DIM), 1, scope="a")  # type: ignore[arg-type]


# -- upsert -----------------------------------------------------------------------------------


def test_upsert_replaces_vector_payload_and_scope(client: kalos.Client) -> None:
    e = np.eye(DIM, dtype=np.float32)
    client.add(e[0], 1, "old", scope=Scope("a", "u"))
    client.add(e[1], 2, "other", scope=Scope("a", "u"))
    assert client.add(e[3] * 2, 1, b"new", scope=Scope("b")) == 0
    assert client.stats()["items"] == 2
    # the old scope no longer holds it
    assert client.search(e[0], k=2, scope=Scope("a")).ids.tolist() == [2, -1]
    # the new vector, payload and scope
    r = client.search(e[3], k=2, scope=Scope("b"))
    assert r.ids.tolist() == [1, -1]
    assert r.scores[0] == pytest.approx(2.0)
    assert r.payloads == [b"new", None]
    # the old vector is gone: along e[0] item 1 scores 0 now
    r = client.search(e[0], k=2)
    assert r.scores.tolist() == [0.0, 0.0]
    # replacing with no payload clears it
    client.add(e[3], 1, None, scope=Scope("b"))
    assert client.search(e[3], k=1).payloads == [None]


def test_upsert_inside_one_batch_keeps_the_last(client: kalos.Client) -> None:
    e = np.eye(DIM, dtype=np.float32)
    client.add(e[:3], [5, 5, 6], payloads=["first", "second", "six"])
    assert client.stats()["items"] == 2
    r = client.search(e[1], k=1)
    assert r.ids[0] == 5 and r.scores[0] == pytest.approx(1.0)
    assert r.payloads == ["second"]


# -- views and copies -------------------------------------------------------------------------


def test_search_returns_views_overwritten_by_the_next_call(client: kalos.Client) -> None:
    e = np.eye(DIM, dtype=np.float32)
    client.add(e, np.arange(DIM) + 10)
    first = client.search(e[0], k=1)
    owned = client.search(e[0], k=1, copy=True)
    assert first.ids.tolist() == [10]  # (owned's call already reused first's memory)
    assert owned.ids.tolist() == [10]
    assert owned.ids.flags.owndata and owned.scores.flags.owndata
    assert not first.ids.flags.owndata  # a view into the channel
    second = client.search(e[5], k=1)
    assert second.ids.tolist() == [15]
    assert first.ids.tolist() == [15]  # overwritten: same memory as the second result
    assert np.shares_memory(first.ids, second.ids)
    assert owned.ids.tolist() == [10]  # the copy is the caller's
    assert owned.scores.tolist() == [1.0]
    assert first.payloads is not second.payloads  # payloads are built per call, owned


def test_views_are_per_thread(client: kalos.Client) -> None:
    e = np.eye(DIM, dtype=np.float32)
    client.add(e, np.arange(DIM))
    mine = client.search(e[1], k=1)
    other: list[np.ndarray] = []
    t = threading.Thread(target=lambda: other.append(client.search(e[2], k=1).ids))
    t.start()
    t.join()
    assert other[0].tolist() == [2]
    assert mine.ids.tolist() == [1]  # another thread's call does not touch this thread's view


# -- batches, dtypes, metrics -----------------------------------------------------------------


def test_batch_queries(client: kalos.Client) -> None:
    base = unit_rows(30, seed=4)
    client.add(base, np.arange(30), payloads=[f"m{i}" for i in range(30)])
    queries = unit_rows(5, seed=9)
    r = client.search(queries, k=4, copy=True)  # the single searches below reuse the views
    assert r.ids.shape == (5, 4) and r.scores.shape == (5, 4)
    assert r.payloads is not None and len(r.payloads) == 20
    for row in range(5):
        single = client.search(queries[row], k=4, copy=True)
        np.testing.assert_array_equal(r.ids[row], single.ids)
        np.testing.assert_allclose(r.scores[row], single.scores, rtol=1e-6)  # GEMM vs GEMV
        np.testing.assert_array_equal(
            r.ids[row], exact_ip_topk(base, np.arange(30), queries[row], 4)
        )
        assert r.payloads[row * 4 : row * 4 + 4] == [f"m{i}" for i in r.ids[row]]


def test_batch_of_one_query_stays_2d(client: kalos.Client) -> None:
    client.add(unit_rows(3), [1, 2, 3])
    r = client.search(unit_rows(1, seed=8), k=2)
    assert r.ids.shape == (1, 2)


def test_float16_queries_and_vectors(client: kalos.Client) -> None:
    rng = np.random.default_rng(11)
    base = rng.integers(-4, 5, (20, DIM)).astype(np.float32)  # exact in float16
    client.add(base[:10], np.arange(10))
    client.add(base[10:].astype(np.float16), np.arange(10, 20))
    q = rng.integers(-4, 5, (3, DIM)).astype(np.float32)
    r32 = client.search(q, k=5, copy=True)
    r16 = client.search(q.astype(np.float16), k=5, copy=True)
    np.testing.assert_array_equal(r16.scores, r32.scores)
    np.testing.assert_array_equal(r16.scores, np.sort(q @ base.T, axis=1)[:, ::-1][:, :5])


def test_float64_and_integer_queries_are_converted(client: kalos.Client) -> None:
    client.add(np.eye(DIM), np.arange(DIM))  # float64 vectors
    assert client.search(np.arange(DIM), k=1).ids[0] == DIM - 1  # int64 query
    assert client.search(np.eye(DIM)[2], k=1).ids[0] == 2


def test_l2_sidecar(backend: Callable[..., Backend]) -> None:
    client = backend(metric="l2").connect()
    base = np.arange(5, dtype=np.float32)[:, None] * np.ones(DIM, np.float32)  # points on a line
    client.add(base, [10, 11, 12, 13, 14])
    r = client.search(np.full(DIM, 1.25, np.float32), k=5)
    assert r.ids.tolist() == [11, 12, 10, 13, 14]  # nearest first
    expected = [(p - 1.25) ** 2 * DIM for p in (1, 2, 0, 3, 4)]
    np.testing.assert_allclose(r.scores, expected, rtol=1e-6)  # squared distances, ascending


def test_cosine_sidecar(backend: Callable[..., Backend]) -> None:
    client = backend(metric="cosine").connect()
    e = np.eye(DIM, dtype=np.float32)
    client.add(np.stack([e[0] * 100, e[0] + e[1], e[2] * 0.01]), [1, 2, 3])
    r = client.search(e[0] * 7, k=3)
    assert r.ids.tolist() == [1, 2, 3]
    np.testing.assert_allclose(r.scores, [1.0, np.sqrt(0.5), 0.0], atol=1e-6)
    with pytest.raises(InvalidRequest):  # a zero vector has no direction
        client.add(np.zeros(DIM), 4)
    assert client.ping()


# -- bulk: chunks through a small arena -------------------------------------------------------


def test_bulk_add_larger_than_the_arena_lands_every_item(backend: Callable[..., Backend]) -> None:
    b = backend(metric="l2")
    client = b.connect(arena_bytes=65536)
    n = 3000
    base = np.random.default_rng(5).standard_normal((n, DIM)).astype(np.float32)
    ids = np.arange(n, dtype=np.int64) * 7 + 1
    texts = [f"memory number {i:05d} " + "x" * (i % 50) for i in range(n)]
    before = client.stats()["requests"]["add"]
    assert client.add(base, ids, payloads=texts, scope=Scope("bulk")) == n  # ~300 KB in chunks
    stats = client.stats()
    assert stats["items"] == n
    assert stats["requests"]["add"] - before >= 4  # it did go in several chunks
    for start in range(0, n, 250):
        r = client.search(base[start : start + 250], k=1, scope=Scope("bulk"))
        np.testing.assert_array_equal(r.ids[:, 0], ids[start : start + 250])
        assert r.payloads == texts[start : start + 250]
    # bulk remove goes in chunks too: 20,000 ids do not fit one 64 KiB request
    assert client.remove(np.arange(20_000, dtype=np.int64)) == len(ids[ids < 20_000])
    assert client.stats()["items"] == n - len(ids[ids < 20_000])


def test_arena_size_is_negotiated(backend: Callable[..., Backend]) -> None:
    b = backend()
    small = b.connect(arena_bytes=65536)
    assert small.info["arena_bytes"] == 65536
    assert len(small._channel().request_buffer) == 65536
    default = b.connect()
    assert default.info["arena_bytes"] == 1 << 20


# -- clients and threads ----------------------------------------------------------------------


def test_a_second_client_sees_the_first_ones_writes(backend: Callable[..., Backend]) -> None:
    b = backend()
    one, two = b.connect(), b.connect()
    one.add(np.eye(DIM)[0], 42, "shared")
    r = two.search(np.eye(DIM)[0], k=1)
    assert r.ids.tolist() == [42] and r.payloads == ["shared"]
    assert two.remove(42) == 1
    assert one.search(np.eye(DIM)[0], k=1).ids.tolist() == [-1]


def test_threads_share_a_client(client: kalos.Client) -> None:
    threads, per_thread = 4, 30
    e = np.eye(DIM, dtype=np.float32)
    errors: list[str] = []

    def work(t: int) -> None:
        try:
            for i in range(per_thread):
                item = t * 1000 + i
                v = e[t] * (i + 1)
                client.add(v, item, f"{t}:{i}", scope=Scope(f"t{t}"))
                r = client.search(e[t], k=1, scope=Scope(f"t{t}"))
                if r.ids[0] != item or r.payloads != [f"{t}:{i}"]:
                    errors.append(f"thread {t} item {i}: {r.ids} {r.payloads}")
        except Exception as exc:  # reported below, not lost in the thread
            errors.append(repr(exc))

    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    assert errors == []
    assert client.stats()["items"] == threads * per_thread


def test_stats(client: kalos.Client) -> None:
    s0 = client.stats()
    assert s0["items"] == 0 and s0["dim"] == DIM and s0["metric"] == "ip"
    client.ping()
    client.add(unit_rows(3), [1, 2, 3])
    client.search(np.ones(DIM), k=1)
    client.remove([1])
    s1 = client.stats()
    assert s1["items"] == 2
    for op in ("ping", "add", "search", "remove"):
        assert s1["requests"][op] == s0["requests"][op] + 1, op
    assert s1["requests"]["stats"] == s0["requests"]["stats"] + 1
    assert s1["index_bytes"] > 0


def test_close_is_idempotent_and_final(client: kalos.Client) -> None:
    client.ping()
    client.close()
    client.close()
    with pytest.raises(ClosedError):
        client.ping()
    with pytest.raises(ClosedError):
        client.search(np.ones(DIM), k=1)


def test_context_manager_closes(backend: Callable[..., Backend]) -> None:
    with backend().connect() as client:
        client.ping()
    with pytest.raises(ClosedError):
        client.stats()


# -- the client's own argument checks ---------------------------------------------------------


def test_client_side_argument_errors(client: kalos.Client) -> None:
    v = np.ones((2, DIM), np.float32)
    with pytest.raises(InvalidRequest, match="ids"):
        client.add(v, [1, 2, 3])
    with pytest.raises(InvalidRequest, match="payloads"):
        client.add(v, [1, 2], payloads=["only one"])
    with pytest.raises(InvalidRequest, match="payload"):
        client.add(v, [1, 2], payloads=["ok", 3])  # type: ignore[list-item]
    with pytest.raises(InvalidRequest):
        client.search(np.ones((2, 2, DIM)), k=1)
    for k in (2.5, "3", None):  # not struct.error from deep inside the encoder
        with pytest.raises(InvalidRequest, match="k must be"):
            client.search(np.ones(DIM), k=k)  # type: ignore[arg-type]
    assert client.search(np.ones(DIM), k=np.int64(2)).ids.shape == (2,)
    assert client.stats()["items"] == 0


def test_the_default_spin_follows_the_sidecars_device(sidecar) -> None:
    from kalos.transport.shm import GPU_SPIN_US, SPIN_US, default_spin_us

    assert default_spin_us({"device": "cuda:0"}) == GPU_SPIN_US > 2 * SPIN_US
    assert default_spin_us({"device": "cpu"}) == default_spin_us({}) == SPIN_US
    sc = sidecar(dim=DIM)
    with sc.connect() as default, sc.connect(spin_us=7) as told:
        default.ping()
        told.ping()
        spins = [c._channel(TIMEOUT)._spin_ns for c in (default, told)]  # this thread's channels
    assert spins == [int(SPIN_US * 1000), 7000]


def test_a_channel_learns_a_spin_per_op_unless_told_one(sidecar) -> None:
    """Unless the client sets ``spin_us``, an op whose round trips average a little more than
    the base spin is spun for (a quarter more, plus 10 µs) instead of parked for, up to
    SPIN_CAP times the base; a long op, and one that comes back under the base, keep the
    base. Round trips are fed to the channel here: real ones depend on the machine."""
    from kalos.protocol.codes import Op
    from kalos.transport.shm import SPIN_CAP, learned_spin

    OP = 250  # no op of the protocol: round trips fed by hand

    base = 50_000
    assert learned_spin(40_000, base) == base  # quick: answered within the base
    assert learned_spin(80_000, base) == 80_000 + 20_000 + 10_000
    assert learned_spin(SPIN_CAP * base, base) == base  # long: parked for after the base
    sc = sidecar(dim=DIM)
    with sc.connect() as auto, sc.connect(spin_us=50) as told:
        auto.ping()
        told.ping()
        learning, fixed = (c._channel(TIMEOUT) for c in (auto, told))
        assert fixed._spins is None and learning._spins is not None
        learning._spins.clear()  # what the first pings taught (a cold channel)
        learning._rtt.clear()
        for _ in range(20):
            learning._learn(OP, 80_000)
        assert learning._spins == {OP: learned_spin(80_000, learning._spin_ns)}
        for _ in range(20):  # the op got slow: parked for after the base again
            learning._learn(OP, 10 * SPIN_CAP * learning._spin_ns)
        assert learning._spins == {OP: learning._spin_ns}
        for _ in range(40):  # and quick: forgotten
            learning._learn(OP, 1_000)
        assert learning._spins == {} and learning._rtt == {}
        # a real op longer than the cap (a flat scan of 300,000 rows: ms): learned, and
        # parked for after the base
        auto.add(np.random.default_rng(1).standard_normal((300_000, DIM)), np.arange(300_000))
        for _ in range(5):
            auto.search(np.ones(DIM), k=3)
        assert learning._rtt[Op.SEARCH] > SPIN_CAP * learning._spin_ns
        assert learning._spins[Op.SEARCH] == learning._spin_ns


def test_callers_beyond_the_spinners_park_at_once(sidecar, monkeypatch) -> None:
    """More of the process's calls waiting for a slow op than ``shm.SPINNERS``: the callers
    beyond it park at once (their CPUs go to the sidecar and to the callers answered); alone,
    or for a quick op the channel learned (a ping), a caller spins first."""
    from kalos.transport import shm

    monkeypatch.setattr(shm, "SPINNERS", 2)
    spins = record_first_waits(monkeypatch)
    sc = sidecar(dim=DIM)
    q = np.ones(DIM, np.float32)
    with sc.connect(spin_us=50) as told, sc.connect() as auto:
        told.add(q[None], np.arange(1))
        spins.clear()
        for _ in range(3):
            told.search(q, k=1)  # alone: spins first
        assert spins == [50_000] * 3, spins
        barrier = threading.Barrier(13)  # 12 callers and this thread
        errors: list[BaseException] = []

        def crowd() -> None:
            try:
                for _ in range(4):
                    barrier.wait(TIMEOUT)  # the sidecar is stopped: every call waits at once
                    told.search(q, k=1)
                    barrier.wait(TIMEOUT)  # the round is over
            except BaseException as exc:  # reported below
                errors.append(exc)
                barrier.abort()

        spins.clear()
        threads = [threading.Thread(target=crowd) for _ in range(12)]
        for t in threads:
            t.start()
        for _ in range(4):
            sc.process.send_signal(signal.SIGSTOP)
            try:
                barrier.wait(TIMEOUT)
                time.sleep(0.1)
            finally:
                sc.process.send_signal(signal.SIGCONT)
            barrier.wait(TIMEOUT)
        for t in threads:
            t.join(TIMEOUT)
        assert not errors, errors[0]
        assert len(spins) == 48 and spins.count(0) >= 24, spins  # 2 of each 12 may spin
        assert shm._waiting.value == 0  # every caller counted out
        # as many spinning in other client processes of the sidecar (its poller's count in
        # the control segment, here a word of the test's): it parks at once
        theirs = ctypes.c_uint64(2)
        mine = told._channel(TIMEOUT)
        word, mine._spinning = mine._spinning, ctypes.addressof(theirs)
        try:
            spins.clear()
            told.search(q, k=1)
            theirs.value = 1  # fewer: it spins first
            told.search(q, k=1)
            assert spins == [0, 50_000], spins
        finally:
            mine._spinning = word
        auto.ping()  # a learned channel: a ping is quick, it spins however many wait
        channel = auto._channel(TIMEOUT)
        channel._rtt.clear()  # what the first pings taught (a cold channel)
        channel._spins.clear()
        shm._fetch_add(shm._WAITING, 10)
        try:
            spins.clear()
            auto.ping()
            assert spins == [channel._spin_ns]
        finally:
            shm._fetch_add(shm._WAITING, 2**64 - 10)


def test_client_options_as_keywords_or_one_object(sidecar: Callable[..., RunningSidecar]) -> None:
    running = sidecar(dim=DIM)
    opts = kalos.ClientOptions(timeout=2.0, transport="uds", runtime_dir=running.runtime_dir)
    for client in (
        kalos.connect(running.name, options=opts),
        kalos.connect(running.name, timeout=2.0, transport="uds", runtime_dir=running.runtime_dir),
        kalos.Client(running.name, options=kalos.ClientOptions(), timeout=2.0, transport="uds",
                     runtime_dir=running.runtime_dir),
    ):  # fmt: skip
        with client:
            assert client.options == opts
            assert client.timeout == 2.0
            client.ping()
    # keywords beside options override its fields; the defaults are the documented ones
    assert kalos.ClientOptions.of(opts, {"timeout": 1.0}) == dataclasses.replace(opts, timeout=1.0)
    assert kalos.ClientOptions() == kalos.ClientOptions(
        transport="shm", timeout=5.0, runtime_dir=None, arena_bytes=1 << 20, spin_us=None,
        gpu_results=False, on_unavailable="raise", hung_after=None, tls=None, local_reads=True,
    )  # fmt: skip
    with pytest.raises(TypeError, match="transprot"):
        kalos.connect(running.name, transprot="uds")  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match="on_unavailable"):
        kalos.ClientOptions(on_unavailable="ignore")
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.timeout = 1.0  # type: ignore[misc]
