"""Batched searches on a cuda index, through the GPU search hook, under Triton's interpreter:
members of one scope filter share one batched kernel call (padded to a power of two, at the
largest k rounded up), each keeps its own k, and every answer is exact."""

from __future__ import annotations

# isort: off
from triton_interp import torch  # sets TRITON_INTERPRET=1 before triton loads

# isort: on

import time

import numpy as np
import pytest

from cuda_reference import make_index
from kalos import _native
from kalos.errors import InvalidRequest
from kalos.gpu import driver
from kalos.index.cuda_flat import SearchGraph
from kalos.protocol import layout as L
from kalos.protocol import messages as M
from kalos.protocol.codes import Op, Status
from kalos.server.dispatch import Dispatcher
from kalos.server.gpu_search import GpuSearch
from kalos.stores.memories import MemoryStore
from kalos.testing import check_search
from server import test_doorbell
from server.test_doorbell import ACME, BETA, K, Served, query

served_fixture = test_doorbell.served  # the doorbell tests' fixture, by this name here

DIM = 32
N = 300


def gpu_store(
    monkeypatch: pytest.MonkeyPatch, dim: int = DIM, batch4: int = 0
) -> tuple[GpuSearch, MemoryStore, dict, np.random.Generator]:
    """A store on a cuda index searched through GpuSearch, the CPU standing in for the GPU
    (no context, no page-locking, no stream): two tenants' rows, and their reference.
    ``batch4``: the index's largest batch through the batched 4-bit cascade (257-1536 dims)."""
    monkeypatch.setattr(driver, "ensure_context", lambda device: None)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **kw: self)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **kw: None)
    rng = np.random.default_rng(3)
    index = make_index("ip", "fp16", dim, "cpu")
    index.batch4_max_batch = batch4
    gpu = GpuSearch(index)
    store = MemoryStore(index, gpu=gpu)
    # fp16 rows: the reference scores the rows as stored
    vectors = rng.standard_normal((N, dim)).astype(np.float16).astype(np.float32)
    ids = np.arange(1, N + 1, dtype=np.int64)
    tenants = np.where(np.arange(N) % 3 == 0, "b", "a")
    for t in ("a", "b"):
        rows = np.flatnonzero(tenants == t)
        store.add(ids[rows], vectors[rows], np.zeros(len(rows), np.uint8),
                  np.zeros(len(rows) + 1, np.int64), np.zeros(0, np.uint8),
                  M.Scope(t, None, None))  # fmt: skip
    codes = {t: store.scopes.filter(M.Scope(t, None, None)) for t in ("a", "b")}
    items = {int(i): (v, codes[t]) for i, v, t in zip(ids, vectors, tenants, strict=True)}
    return gpu, store, items, rng


@pytest.mark.parametrize("dim,batch4", [(DIM, 0), (272, 16)], ids=["scan", "batched-cascade"])
def test_a_batch_on_the_gpu_is_each_search_alone(
    monkeypatch: pytest.MonkeyPatch, dim: int, batch4: int
) -> None:
    gpu, store, items, rng = gpu_store(monkeypatch, dim, batch4)
    # fp32 queries, held to the float64 reference's tolerance: the batch's dot scores each
    # query's fp16 rounding and its remainder (scan_topk.dot_lanes), as a search alone does
    q = rng.standard_normal((6, dim)).astype(np.float32)
    members = [
        (q[0:1], 10, None),
        (q[1:3], 3, None),  # two queries, another k: one call of 4 (padded) at k 10
        (q[3:4], 5, M.Scope("a", None, None)),
        (q[4:5], 1, M.Scope("a", None, None)),
        (np.ones((1, dim + 1), np.float32), 5, None),  # a bad member fails alone
        (q[5:6], 7, M.Scope("b", None, None)),  # alone in its filter: a search of its own
    ]
    hits = store.search_many(members)
    assert isinstance(hits[4], Exception)
    for i, ((queries, k, scope), hit) in enumerate(zip(members, hits, strict=True)):
        if i == 4:
            continue
        assert not isinstance(hit, Exception), hit
        filt = store.scopes.filter(scope)
        check_search(hit, items, queries, k, "ip", filt)
        alone = store.search_alone(queries, k, filt)
        np.testing.assert_array_equal(hit[1], alone[1])  # the same answer alone
    # the shapes it used: batches of 4 (3 unscoped queries) and 2 (two scoped), k 10
    assert {(4, 10, False), (2, 10, True)} <= set(gpu._graphs)
    cascade = [
        bool(gpu._graphs[key]._ws[0].get("codes4_batch")) for key in ((4, 10, False), (2, 10, True))
    ]
    assert cascade == [bool(batch4)] * 2


def test_a_batch_taken_one_member_at_a_time_spills_into_more_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Members come one at a time (kalos.stores.batch), each checked and stacked into its
    filter's call as it comes; a call full at the GPU's batch limit leaves the next member to a
    new one, a member above the limit is searched alone, and every answer is exact."""
    gpu, store, items, rng = gpu_store(monkeypatch)
    monkeypatch.setattr(gpu, "max_batch", 4)
    q = rng.standard_normal((16, DIM)).astype(np.float16).astype(np.float32)
    a, b = M.Scope("a", None, None), M.Scope("b", None, None)
    members = [
        (q[0:2], 10, None),
        (q[2:3], 4, a),
        (q[3:5], 3, None),  # the unscoped call holds 4 rows: full
        (q[5:6], 6, None),  # ... so this one starts another
        (q[6:11], 5, None),  # 5 rows, above the limit: a search of its own, the call kept
        (q[11:12], 2, a),
        (np.full((1, DIM), np.nan, np.float32), 5, b),  # fails its check alone
        (q[12:13], 7, None),
        (q[13:14], 1, b),
    ]
    batch = store.batch()
    for queries, k, scope in members:
        batch.add(queries, k, scope)
    assert len(batch) == len(members)
    batch.start()
    batch.land()
    hits = batch.results()
    assert isinstance(hits[6], InvalidRequest) and "NaN" in str(hits[6])
    for i, ((queries, k, scope), hit) in enumerate(zip(members, hits, strict=True)):
        if i == 6:
            continue
        assert not isinstance(hit, Exception), hit
        assert hit[1].shape == (len(queries), k)
        check_search(hit, items, queries, k, "ip", store.scopes.filter(scope), rtol=2e-3)
    assert batch.results() is hits  # answered once
    # the calls it made: the full one of 4 unscoped rows, the next of 2 (q[5], q[12]), the
    # scoped pair of 2; the 5-row member and b's lone member each alone
    assert {(4, 10, False), (2, 10, False), (2, 10, True)} <= set(gpu._graphs)


def test_a_batch_left_running_on_the_gpu_keeps_its_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The last batched call runs on while the sidecar serves (GpuSearch.start); a search
    made before its answers are taken first waits for it and keeps them."""
    gpu, store, items, rng = gpu_store(monkeypatch)
    waited: list[int] = []

    class Launch:  # driver.GraphLaunch's: the pass done at once, its wait recorded
        def __init__(self, nq: int) -> None:
            self.nq = nq

        def wait(self) -> None:
            waited.append(self.nq)

        def done(self) -> bool:
            return True

    def start(self, stream):  # type: ignore[no-untyped-def]
        self._run()  # the interpreter's pass, here and now
        return Launch(self.nq)

    monkeypatch.setattr(SearchGraph, "start", start)
    q = rng.standard_normal((4, DIM)).astype(np.float16).astype(np.float32)
    members = [(q[0:1], 10, None), (q[1:3], 4, None), (q[3:4], 6, M.Scope("a", None, None))]
    finish, done = store.start_search_many(members)
    running = done is not None and done()
    # two calls: the scoped one alone (a search of its own, first), the unscoped batch of 3
    # (padded to 4) left running
    assert running and gpu._running is not None and waited == []
    other = rng.standard_normal((1, DIM)).astype(np.float16).astype(np.float32)
    alone = store.search(other, 5, None)  # the staging's next use: it waits for the batch
    assert gpu._running is None and waited == [4]
    check_search(alone, items, other, 5, "ip", None, rtol=2e-3)
    hits = finish()
    assert waited == [4]
    for (queries, k, scope), hit in zip(members, hits, strict=True):
        check_search(hit, items, queries, k, "ip", store.scopes.filter(scope), rtol=2e-3)
    # a pass whose wait fails: each member searched again alone, and the staging free
    failing = Launch(4)
    failing.wait = lambda: (_ for _ in ()).throw(RuntimeError("an illegal address"))  # type: ignore[method-assign]
    monkeypatch.setattr(SearchGraph, "start", lambda self, stream: (self._run(), failing)[1])
    finish, done = store.start_search_many(members)
    assert done is not None and gpu._running is not None
    for (queries, k, scope), hit in zip(members, finish(), strict=True):
        check_search(hit, items, queries, k, "ip", store.scopes.filter(scope), rtol=2e-3)
    assert gpu._running is None
    # ... and one whose query fails too, through the dispatcher: done says so, and every
    # member still gets its answer
    failing.done = lambda: (_ for _ in ()).throw(RuntimeError("an illegal address"))  # type: ignore[method-assign]
    bodies = []
    for queries, k, scope in members:
        body = np.zeros(1 << 16, np.uint8)
        n = M.encode_search(body, queries, k, M.encode_scope_fields(scope))
        bodies.append((int(Op.SEARCH), 0, body[:n], np.zeros(1 << 16, np.uint8)))
    run = Dispatcher(store).begin_batch(bodies)
    assert run.start() and run.done()
    for (queries, k, scope), (_, _, _, out), (status, n, _, _) in zip(
        members, bodies, run.finish(), strict=True
    ):
        assert status == Status.OK
        r = M.decode_search_response(out, n)
        check_search((r.scores, r.ids), items, queries, k, "ip", store.scopes.filter(scope),
                     rtol=2e-3)  # fmt: skip
    # in the interpreter a graph cannot run ahead: the batch is answered at once
    monkeypatch.undo()
    gpu2, store2, items2, _ = gpu_store(monkeypatch)
    finish, done = store2.start_search_many(members[:2])
    assert done is None and gpu2._running is None
    for (queries, k, _), hit in zip(members[:2], finish(), strict=True):
        check_search(hit, items2, queries, k, "ip", None, rtol=2e-3)


# -- through the poller, beside the GPU doorbell (its fixture: tests/server/test_doorbell.py) --


def publish(s: Served, ch: int, q: np.ndarray, scope: M.Scope) -> tuple[object, int]:
    c = s.channels[ch]
    n = M.encode_search(c.req_arena, q[None], K, M.encode_scope_fields(scope))
    now = time.monotonic_ns()
    L.REQ_FIELDS.pack_into(c.buf, L.REQ_OP, Op.SEARCH, 0, n, now, now + int(60e9))
    seq = s.seqs[ch] = s.seqs[ch] + 1
    _native.store_release(c.req_seq, seq)
    return c, seq


def answers(s: Served, batch: list, qs: list, codes: list[int]) -> None:
    for (c, seq), q, code in zip(batch, qs, codes, strict=True):
        assert _native.load_acquire(c.resp_seq) == seq
        status, _, body_len, *_ = L.RESP_FIELDS.unpack_from(c.buf, L.RESP_STATUS)
        assert status == Status.OK
        r = M.decode_search_response(c.resp_arena, body_len)
        s.check(q, r.scores.copy(), r.ids.copy(), code)


@pytest.mark.parametrize("armed", [False, True], ids=["idle", "doorbell-armed"])
def test_a_batch_through_the_poller_of_a_cuda_sidecar(served_fixture: Served, armed: bool) -> None:
    served = served_fixture
    served.poller._begin_batch = served.dispatcher.begin_batch
    if armed:  # the GPU waits on channel 0 for its next search: it may take it itself
        served.search(query(1))
        assert served.door.armed is served.channels[0].pinned
    qs = [query(2), query(3)]
    scopes, codes = ([ACME, BETA], [1, 2]) if armed else ([ACME, ACME], [1, 1])
    batch = [publish(served, ch, q, s) for ch, q, s in zip((0, 1), qs, scopes, strict=True)]
    served.poller._serve_batch(list(batch))
    answers(served, batch, qs, codes)
    assert served.door.armed is None  # nothing stays armed ahead of the batch's work
    if not armed:  # both in one batched call: one graph of 2 queries, at k 10, filtered
        assert served.poller.batches == 1 and (2, 10, True) in served.gpu._graphs
