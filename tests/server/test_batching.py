"""Dynamic batching: searches and recalls answered together with one pass over the index.

Every answer in a batch is held against an exact numpy reference (kalos.testing.check_search),
with mixed k, scopes and query counts in one batch, and bad members that must fail alone:
first through the dispatcher and the index directly, then through a real sidecar whose
clients (threads, asyncio tasks, processes) search at once (tests/server/test_batching_e2e.py).
"""

from __future__ import annotations

import numpy as np
import pytest

import kalos.index
from kalos.errors import InvalidRequest
from kalos.protocol import codes
from kalos.protocol import messages as M
from kalos.protocol.codes import Op, Status
from kalos.server.dispatch import Dispatcher, batchable
from kalos.stores.memories import MemoryStore
from kalos.stores.sessions import SessionStore
from kalos.testing import check_search

DIM = 16
N = 600
TENANTS = ("", "a", "b")
USERS = ("", "u1", "u2", "u3")


def corpus(seed: int = 0) -> tuple[np.ndarray, np.ndarray, list[tuple[str, str]]]:
    rng = np.random.default_rng(seed)
    vectors = rng.standard_normal((N, DIM)).astype(np.float32)
    ids = np.arange(100, 100 + N, dtype=np.int64)
    # most rows in tenant "a" (a filter matching most rows shares the batch's product), a
    # few with a user (a selective filter scans its own rows)
    scopes = [("a" if i % 5 else "b", "u1" if i % 50 == 0 else "") for i in range(N)]
    return vectors, ids, scopes


def make_store(metric: str, spec: str = "cpu:flat") -> tuple[MemoryStore, dict]:
    """A store with the corpus; returns it and the reference items (id -> (vector, codes))."""
    store = MemoryStore(kalos.index.create(spec, dim=DIM, metric=metric))
    vectors, ids, scopes = corpus()
    for tenant, user in sorted(set(scopes)):
        rows = [i for i, s in enumerate(scopes) if s == (tenant, user)]
        n = len(rows)
        store.add(ids[rows], vectors[rows], np.zeros(n, np.uint8), np.zeros(n + 1, np.int64),
                  np.zeros(0, np.uint8), M.Scope(tenant or None, user or None, None))  # fmt: skip
    items = {}
    for i, (tenant, user) in enumerate(scopes):
        code = store.scopes.filter(M.Scope(tenant or None, user or None, None))
        assert code is not None
        items[int(ids[i])] = (vectors[i], code)
    return store, items


def filter_of(store: MemoryStore, scope: M.Scope | None) -> tuple[int, int, int] | None:
    return store.scopes.filter(scope)


# (queries, k, scope): no filter (three of one k in a row), a filter matching most rows, a
# selective one, one that matches nothing, several queries, k above the matches, k of one
def members(seed: int = 1) -> list[tuple[np.ndarray, int, M.Scope | None]]:
    rng = np.random.default_rng(seed)

    def q(nq: int = 1) -> np.ndarray:
        return rng.standard_normal((nq, DIM)).astype(np.float32)

    return [
        (q(), 10, None),  # with the next two: members without a filter, of one k, in a row
        (q(4), 10, None),
        (q(), 10, None),
        (q(), 3, M.Scope("a", None, None)),
        (q(), 5, M.Scope("a", "u1", None)),  # 10 rows match: fewer than k? no, 5 of 10
        (q(), 20, M.Scope("a", "u1", None)),  # more than match: the tail is -1
        (q(), 4, M.Scope("nobody", None, None)),
        (q(3), 7, None),
        (q(), 1, M.Scope("b", None, None)),
        (q(2), N + 5, None),  # k above the index's size
    ]


@pytest.mark.parametrize("metric", ["ip", "cosine", "l2"])
@pytest.mark.parametrize("spec", ["cpu:flat", "cpu:faiss-flat"])
def test_search_many_is_each_search_alone(metric: str, spec: str) -> None:
    if spec == "cpu:faiss-flat":
        pytest.importorskip("faiss")
    store, items = make_store(metric, spec)
    batch = members()
    hits = store.search_many(batch)
    assert len(hits) == len(batch)
    for (queries, k, scope), hit in zip(batch, hits, strict=True):
        assert not isinstance(hit, Exception), hit
        check_search(hit, items, queries, k, metric, filter_of(store, scope))
        alone = store.search(queries, k, scope)
        np.testing.assert_array_equal(hit[1][alone[1] != -1], alone[1][alone[1] != -1])


def test_search_many_bad_members_fail_alone() -> None:
    store, items = make_store("ip")
    good = members()
    bad: list[tuple[np.ndarray, int, M.Scope | None]] = [
        (np.ones((1, DIM + 1), np.float32), 5, None),  # wrong dimension
        (np.full((1, DIM), np.nan, np.float32), 5, None),  # NaN
        (np.ones((1, DIM), np.float32), 0, None),  # k out of range
        (np.ones((1, DIM), np.float32), codes.MAX_K + 1, None),
    ]
    batch = [good[0], bad[0], good[1], bad[1], good[5], bad[2], bad[3], good[3]]
    hits = store.search_many(batch)
    for (queries, k, scope), hit in zip(batch, hits, strict=True):
        if any(queries is b[0] and k == b[1] for b in bad):
            assert isinstance(hit, InvalidRequest)
        else:
            assert not isinstance(hit, Exception), hit
            check_search(hit, items, queries, k, "ip", filter_of(store, scope))


def test_a_failing_pass_falls_back_to_each_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    store, items = make_store("ip")

    def broken(members: object, **_: object) -> None:
        raise RuntimeError("the shared pass failed")

    monkeypatch.setattr(store.index, "search_many", broken)
    batch = members()
    for (queries, k, scope), hit in zip(batch, store.search_many(batch), strict=True):
        assert not isinstance(hit, Exception), hit
        check_search(hit, items, queries, k, "ip", filter_of(store, scope))


# -- the dispatcher -----------------------------------------------------------------------------


def search_body(queries: np.ndarray, k: int, scope: M.Scope | None) -> np.ndarray:
    buf = np.zeros(1 << 16, np.uint8)
    sb = M.encode_scope_fields(scope) if scope is not None else M.EMPTY_SCOPE
    n = M.encode_search(buf, queries, k, sb)
    return buf[:n].copy()


@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_handle_batch_answers_each_member_exactly(metric: str) -> None:
    store, items = make_store(metric)
    d = Dispatcher(store)
    batch = members()
    outs = [np.zeros(1 << 16, np.uint8) for _ in range(len(batch) + 4)]
    reqs = [(int(Op.SEARCH), 0, search_body(q, k, s), outs[i]) for i, (q, k, s) in enumerate(batch)]
    # one with payloads, a truncated body, a response too large for its arena, a wrong dim
    reqs.insert(2, (int(Op.SEARCH), codes.SEARCH_WANT_PAYLOADS, search_body(*batch[0]), outs[-1]))
    reqs.insert(4, (int(Op.SEARCH), 0, search_body(*batch[0])[:20], outs[-2]))
    big = np.zeros(64, np.uint8)
    reqs.insert(6, (int(Op.SEARCH), 0, search_body(batch[5][0], 50, None), big))
    reqs.insert(1, (int(Op.SEARCH), 0, search_body(np.ones((1, DIM + 2), np.float32), 3, None),
                    outs[-3]))  # fmt: skip
    assert all(batchable(op, flags) for op, flags, _, _ in reqs)
    results = d.handle_batch(reqs)
    assert len(results) == len(reqs)
    wanted = iter(batch)
    for (*_, out), (status, n, compute_ns, write_ns) in zip(reqs, results, strict=True):
        assert compute_ns >= 0 and write_ns >= 0
        if out is outs[-2]:
            assert status == Status.INVALID_REQUEST, M.decode_text(out, n)
        elif out is outs[-3]:
            assert status == Status.INVALID_REQUEST and "dimension" in M.decode_text(out, n)
        elif out is big:
            assert status == Status.PAYLOAD_TOO_LARGE
        elif out is outs[-1]:
            assert status == Status.OK
            r = M.decode_search_response(out, n)
            q, k, s = batch[0]
            check_search((r.scores, r.ids), items, q, k, metric, filter_of(store, s))
            assert r.payloads is not None and len(r.payloads) == k
        else:
            q, k, s = next(wanted)
            assert status == Status.OK, M.decode_text(out, n)
            r = M.decode_search_response(out, n)
            check_search((r.scores, r.ids), items, q, k, metric, filter_of(store, s))
    assert d.errors == 3


def test_a_member_whose_check_breaks_fails_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A member is checked as it joins the batch (kalos.stores.batch): should that raise
    something unexpected (a bug), that member alone gets a server error, and every other
    member of the batch its exact answer."""
    store, items = make_store("ip")
    d = Dispatcher(store)
    batch = members()
    filt = store.scopes.filter

    def broken(scope: M.Scope | None) -> tuple[int, int, int] | None:
        if scope is not None and scope.tenant == "b":
            raise RuntimeError("a scope table in a bad state")
        return filt(scope)

    monkeypatch.setattr(store.scopes, "filter", broken)
    reqs = [(int(Op.SEARCH), 0, search_body(q, k, s), np.zeros(1 << 16, np.uint8))
            for q, k, s in batch]  # fmt: skip
    results = d.handle_batch(reqs)
    for (q, k, s), (*_, out), (status, n, _, _) in zip(batch, reqs, results, strict=True):
        if s is not None and s.tenant == "b":
            assert status == Status.SERVER_ERROR and "bad state" in M.decode_text(out, n)
            continue
        assert status == Status.OK, M.decode_text(out, n)
        r = M.decode_search_response(out, n)
        check_search((r.scores, r.ids), items, q, k, "ip", filt(s))
    assert d.errors == 1


def test_a_batch_with_several_probe_counts_answers_each_as_alone() -> None:
    """Searches that set their own nprobe join a batch: one pass per probe count, each
    member's answer what the same search alone returns."""
    store, _ = make_store("ip", "cpu:ivf,nlist=16,nprobe=2")
    store.index.train()
    d = Dispatcher(store)
    rng = np.random.default_rng(3)
    queries = rng.standard_normal((9, DIM)).astype(np.float32)
    probes = [0, 1, 16, 1, 0, 4, 16, 4, 1]
    reqs = []
    for q, p in zip(queries, probes, strict=True):
        buf = np.zeros(1 << 12, np.uint8)
        n = M.encode_search(buf, q[None], 5, M.EMPTY_SCOPE, nprobe=p)
        flags = codes.SEARCH_NPROBE if p else 0
        assert batchable(Op.SEARCH, flags)
        reqs.append((int(Op.SEARCH), flags, buf[:n].copy(), np.zeros(1 << 12, np.uint8)))
    calls = []
    many = store.index.search_many

    def counted(members: list, *, nprobe: int = 0) -> list:
        calls.append((len(members), nprobe))
        return many(members, nprobe=nprobe)

    store.index.search_many = counted  # type: ignore[method-assign]
    results = d.handle_batch(reqs)
    assert sorted(calls) == [(2, 0), (2, 4), (2, 16), (3, 1)]
    for (_, _, _, out), (status, n, *_), q, p in zip(reqs, results, queries, probes, strict=True):
        assert status == Status.OK
        r = M.decode_search_response(out, n)
        want = store.search(q[None], 5, None, nprobe=p)
        np.testing.assert_array_equal(r.ids, want[1])
        np.testing.assert_allclose(r.scores, want[0], rtol=1e-6)


def test_batchable_ops() -> None:
    assert batchable(Op.SEARCH, 0) and batchable(Op.SEARCH, codes.SEARCH_WANT_PAYLOADS)
    assert not batchable(Op.SEARCH, codes.SEARCH_GPU_RESULT)
    assert not batchable(Op.SEARCH, codes.SEARCH_GPU_QUERY)
    assert batchable(Op.RECALL, 0) and not batchable(Op.RECALL, codes.RecallFlag.GPU_RESULT)
    assert not batchable(Op.ADD, 0) and not batchable(Op.CONTEXT, 0)


def test_recalls_in_a_batch() -> None:
    store, items = make_store("ip")
    sessions = SessionStore()
    d = Dispatcher(store, sessions=sessions)
    body = np.zeros(1 << 12, np.uint8)
    n = M.encode_append_turn(body, M.ScopeBytes(b"a", b"", b"s1"), b"user", b"hello",
                             np.arange(7, dtype=np.int32), None)  # fmt: skip
    out = np.zeros(1 << 12, np.uint8)
    flags = codes.AppendFlag.HAS_TOKENS
    assert d.handle(Op.APPEND_TURN, flags, body[:n].copy(), out)[0] == Status.OK
    rng = np.random.default_rng(5)
    qs = rng.standard_normal((3, DIM)).astype(np.float32)

    def recall_body(q: np.ndarray, k: int, session: bytes) -> np.ndarray:
        buf = np.zeros(1 << 12, np.uint8)
        sb = M.encode_scope_fields(M.Scope("a", None, None))
        m = M.encode_recall(buf, session, q, k, 100, M.NO_LIMIT, M.NO_LIMIT, sb)
        return buf[:m].copy()

    outs = [np.zeros(1 << 14, np.uint8) for _ in range(5)]
    reqs = [
        (int(Op.RECALL), 0, recall_body(qs[0], 5, b"s1"), outs[0]),
        (int(Op.SEARCH), 0, search_body(qs[1:2], 4, None), outs[1]),
        (int(Op.RECALL), 0, recall_body(qs[1], 3, b"nosuch"), outs[2]),  # NotFound, alone
        (int(Op.RECALL), 0, recall_body(qs[2], 8, b"s1"), outs[3]),
    ]
    results = d.handle_batch(reqs)
    assert [r[0] for r in results] == [Status.OK, Status.OK, Status.NOT_FOUND, Status.OK]
    tenant_a = store.scopes.filter(M.Scope("a", None, None))
    for i, q, k in ((0, qs[0], 5), (3, qs[2], 8)):
        r = M.decode_recall_response(outs[i], results[i][1])
        check_search((r.scores[None], r.ids[None]), items, q, k, "ip", tenant_a)
        # the same answer as the recall alone
        alone = np.zeros(1 << 14, np.uint8)
        status, m, _, _ = d.handle(Op.RECALL, 0, reqs[i][2], alone)
        assert status == Status.OK
        a = M.decode_recall_response(alone, m)
        np.testing.assert_array_equal(a.ids, r.ids)
        assert a.n_turns == r.n_turns == 1
    s = M.decode_search_response(outs[1], results[1][1])
    check_search((s.scores, s.ids), items, qs[1:2], 4, "ip", None)


def test_mutated_members_fail_alone_and_the_good_ones_stay_exact() -> None:
    """Random mutations of search and recall bodies (bit flips, bytes overwritten, truncated,
    garbage appended) inside batches of good searches: every mutated member gets a status of
    the protocol, never an internal error; every good member its exact answer."""
    store, items = make_store("ip")
    d = Dispatcher(store, sessions=SessionStore())
    rng = np.random.default_rng(11)
    statuses = {int(s) for s in Status}
    good = members()
    for round_ in range(150):
        reqs, wanted = [], []
        for j in range(rng.integers(2, 7)):
            q, k, s = good[(round_ + j) % len(good)]
            body = search_body(q, k, s)
            if rng.random() < 0.5:  # a mutated one
                body = body.copy()
                how = rng.integers(4)
                if how == 0:
                    body[rng.integers(len(body))] ^= np.uint8(1 << rng.integers(8))
                elif how == 1:
                    at = rng.integers(len(body))
                    body[at : at + 4] = rng.integers(0, 256, len(body[at : at + 4]), np.uint8)
                elif how == 2:
                    body = body[: rng.integers(len(body))]
                else:
                    body = np.concatenate([body, rng.integers(0, 256, 9, np.uint8)])
                op = int(Op.RECALL) if rng.random() < 0.3 else int(Op.SEARCH)
                reqs.append((op, 0, body, np.zeros(1 << 15, np.uint8)))
                wanted.append(None)
            else:
                reqs.append((int(Op.SEARCH), 0, body, np.zeros(1 << 15, np.uint8)))
                wanted.append((q, k, s))
        for (_, _, _, out), want, (status, n, _, _) in zip(
            reqs, wanted, d.handle_batch(reqs), strict=True
        ):
            assert status in statuses
            assert status != Status.SERVER_ERROR, M.decode_text(out, n)
            if want is not None:
                assert status == Status.OK
                r = M.decode_search_response(out, n)
                q, k, s = want
                check_search((r.scores, r.ids), items, q, k, "ip", filter_of(store, s))


def test_a_filtered_member_between_unfiltered_ones_of_its_k_keeps_its_filter() -> None:
    # cpu:flat selects a run of unfiltered members of one k together: a filtered member of
    # the same k between them (at position 1 too) is a run of its own
    store, items = make_store("ip")
    rng = np.random.default_rng(5)
    scope = M.Scope("a", None, None)  # most rows: it shares the batch's product
    batch = [(rng.standard_normal((1, DIM)).astype(np.float32), 10, s)
             for s in (None, scope, None, None, scope)]  # fmt: skip
    for (queries, k, s), hit in zip(batch, store.search_many(batch), strict=True):
        assert not isinstance(hit, Exception), hit
        check_search(hit, items, queries, k, "ip", filter_of(store, s))
