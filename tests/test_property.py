"""Random operation sequences held against a simple in-memory reference model.

The model is a dict: id -> (vector, payload, scope). Its search is exact top-k in float64
over the items the scope filter matches. Vectors and queries are small integers, so the
sidecar's float32 scores are exact for ip and l2 and many scores tie: where scores tie
either id may be returned, so the test compares the multiset of scores, and requires every
id whose score is strictly better than the k-th to be returned.

The machine runs over the in-process transport (fast, many examples, every metric) and once
over a real shm sidecar (fewer examples).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import kalos
from conftest import TIMEOUT, make_inproc_client
from kalos import Scope

DIM = 4
N_IDS = 24  # ids are drawn from 0..N_IDS-1, so upserts and removes hit existing items
TOLERANCE = {"ip": 0.0, "l2": 0.0, "cosine": 1e-5}  # exact for small integers; cosine rounds

ids_st = st.integers(0, N_IDS - 1)
payload_st = st.one_of(st.none(), st.text(max_size=8), st.binary(max_size=8))
item_scope_st = st.builds(
    Scope,
    st.sampled_from([None, "acme", "globex"]),
    st.sampled_from([None, "u1", "u2"]),
    st.sampled_from([None, "s1"]),
)
# filters also name tenants, users and sessions that no item has
filter_st = st.one_of(
    st.none(),
    st.builds(
        Scope,
        st.sampled_from([None, "acme", "globex", "initech"]),
        st.sampled_from([None, "u1", "u2", "u9"]),
        st.sampled_from([None, "s1", "s9"]),
    ),
)


def vectors_st(metric: str, n: int | None = None) -> st.SearchStrategy[np.ndarray]:
    shape = DIM if n is None else (n, DIM)
    vec = arrays(np.float32, shape, elements=st.integers(-3, 3).map(float))
    if metric == "cosine":  # a zero vector has no direction: the sidecar refuses it
        vec = vec.filter(lambda v: bool((np.abs(v).sum(axis=-1) > 0).all()))
    return vec


class Item(NamedTuple):
    vector: np.ndarray  # [DIM] float64
    payload: str | bytes | None
    scope: Scope


def matches(item: Scope, wanted: Scope | None) -> bool:
    if wanted is None:
        return True
    return all(w is None or w == have for w, have in zip(wanted, item, strict=True))


def reference_scores(metric: str, vectors: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Exact scores in float64; 'better' is larger for ip/cosine, smaller for l2."""
    q = q.astype(np.float64)
    if metric == "l2":
        return ((vectors - q) ** 2).sum(axis=1)
    if metric == "cosine":
        vectors = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
        q = q / np.linalg.norm(q)
    return vectors @ q


def check_search(
    metric: str, model: dict[int, Item], q: np.ndarray, k: int, scope: Scope | None,
    ids: np.ndarray, scores: np.ndarray, payloads: list,
) -> None:  # fmt: skip
    """One query's result (ids [k], scores [k], payloads [k]) against the model."""
    tol = TOLERANCE[metric]
    sign = 1.0 if metric == "l2" else -1.0  # sign * score: smaller is better
    candidates = {i: it for i, it in model.items() if matches(it.scope, scope)}
    n_hits = min(k, len(candidates))
    ids_l = ids.tolist()
    # the tail: -1 and the worst score
    assert ids_l[n_hits:] == [-1] * (k - n_hits), (ids_l, sorted(candidates))
    assert (scores[n_hits:] == (np.inf if metric == "l2" else -np.inf)).all()
    assert all(p is None for p in payloads[n_hits:])
    if n_hits == 0:
        return
    cand_ids = np.array(sorted(candidates), np.int64)
    ref = reference_scores(metric, np.stack([candidates[i].vector for i in cand_ids]), q)
    ref_of = dict(zip(cand_ids.tolist(), ref.tolist(), strict=True))
    hits = ids_l[:n_hits]
    # distinct ids the filter matches, each with its own score and payload, best first
    assert len(set(hits)) == n_hits, hits
    assert set(hits) <= set(candidates), (hits, sorted(candidates))
    got = scores[:n_hits].astype(np.float64)
    np.testing.assert_allclose(got, [ref_of[i] for i in hits], rtol=0, atol=max(tol, 1e-12))
    assert (np.diff(sign * got) >= -tol).all(), got
    assert payloads[:n_hits] == [candidates[i].payload for i in hits]
    # the multiset of scores is the exact top-k; anything strictly better than the k-th is in
    best = np.sort(sign * ref)[:n_hits]
    np.testing.assert_allclose(np.sort(sign * got), best, rtol=0, atol=max(tol, 1e-12))
    must = {i for i, s in ref_of.items() if sign * s < best[-1] - tol}
    assert must <= set(hits), (sorted(must), hits)


class MemoryMachine(RuleBasedStateMachine):
    """Adds, upserts, removes and searches against the model. Subclasses set the client."""

    metric = "ip"

    def connect(self) -> kalos.Client:
        raise NotImplementedError

    def release(self, client: kalos.Client) -> None:
        client.close()

    def __init__(self) -> None:
        super().__init__()
        self.client = self.connect()
        self.model: dict[int, Item] = {}

    def teardown(self) -> None:
        self.release(self.client)

    @rule(data=st.data(), n=st.integers(1, 5), scope=item_scope_st)
    def add(self, data: st.DataObject, n: int, scope: Scope) -> None:
        vectors = data.draw(vectors_st(self.metric, n))
        ids = data.draw(st.lists(ids_st, min_size=n, max_size=n))
        payloads = data.draw(st.lists(payload_st, min_size=n, max_size=n))
        new = len(set(ids) - set(self.model))
        assert self.client.add(vectors, ids, payloads, scope=scope) == new
        for i, v, p in zip(ids, vectors, payloads, strict=True):  # the last of an id wins
            self.model[i] = Item(v.astype(np.float64), p, scope)

    @rule(ids=st.lists(ids_st, max_size=4))
    def remove(self, ids: list[int]) -> None:
        expected = len(set(ids) & set(self.model))
        assert self.client.remove(ids) == expected
        for i in ids:
            self.model.pop(i, None)

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data(), scope=item_scope_st)
    def upsert_existing(self, data: st.DataObject, scope: Scope) -> None:
        i = data.draw(st.sampled_from(sorted(self.model)))
        v = data.draw(vectors_st(self.metric))
        p = data.draw(payload_st)
        assert self.client.add(v, i, [p], scope=scope) == 0
        self.model[i] = Item(v.astype(np.float64), p, scope)

    @rule(data=st.data(), k=st.integers(1, N_IDS + 2), scope=filter_st)
    def search(self, data: st.DataObject, k: int, scope: Scope | None) -> None:
        q = data.draw(vectors_st(self.metric))
        r = self.client.search(q, k=k, scope=scope)
        assert r.payloads is not None
        check_search(self.metric, self.model, q, k, scope, r.ids, r.scores, r.payloads)

    @rule(data=st.data(), k=st.integers(1, 6), scope=filter_st)
    def search_batch(self, data: st.DataObject, k: int, scope: Scope | None) -> None:
        queries = data.draw(vectors_st(self.metric, 3))
        r = self.client.search(queries, k=k, scope=scope)
        assert r.ids.shape == (3, k) and r.payloads is not None
        for row in range(3):
            check_search(self.metric, self.model, queries[row], k, scope, r.ids[row],
                         r.scores[row], r.payloads[row * k : (row + 1) * k])  # fmt: skip

    @invariant()
    def item_count(self) -> None:
        assert self.client.stats()["items"] == len(self.model)


def inproc_machine(metric: str) -> type[MemoryMachine]:
    class Inproc(MemoryMachine):
        def connect(self) -> kalos.Client:
            return make_inproc_client(DIM, metric)

    Inproc.metric = metric
    return Inproc


INPROC = settings(
    max_examples=60, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)  # fmt: skip


def test_inproc_ip() -> None:
    run_state_machine_as_test(inproc_machine("ip"), settings=INPROC)


def test_inproc_l2() -> None:
    run_state_machine_as_test(inproc_machine("l2"), settings=INPROC)


def test_inproc_cosine() -> None:
    run_state_machine_as_test(inproc_machine("cosine"), settings=INPROC)


def test_shm_sidecar(sidecar: Callable) -> None:
    sc = sidecar(dim=DIM, metric="l2")
    client = sc.connect(timeout=TIMEOUT)

    class OverShm(MemoryMachine):
        metric = "l2"

        def connect(self) -> kalos.Client:
            # one sidecar for every example: it starts empty because the last one emptied it
            assert client.stats()["items"] == 0
            return client

        def release(self, c: kalos.Client) -> None:
            c.remove(np.arange(N_IDS))

    try:
        run_state_machine_as_test(
            OverShm,
            settings=settings(INPROC, max_examples=15, stateful_step_count=25),
        )
    finally:
        client.close()


# -- tenant isolation -------------------------------------------------------------------------

TENANTS = [f"tenant-{i}" for i in range(5)]


@settings(max_examples=100, deadline=None)
@given(
    items=st.lists(
        st.tuples(st.sampled_from(TENANTS), st.sampled_from([None, "u1", "u2"]),
                  vectors_st("ip")),
        min_size=1, max_size=40,
    ),
    query=vectors_st("ip"),
    k=st.integers(1, 45),
)  # fmt: skip
def test_a_tenant_never_sees_another_tenants_items(
    items: list[tuple[str, str | None, np.ndarray]], query: np.ndarray, k: int
) -> None:
    client = make_inproc_client(DIM, "ip")
    owner: dict[int, str] = {}
    for i, (tenant, user, v) in enumerate(items):
        client.add(v, i, f"{tenant}/{i}", scope=Scope(tenant, user))
        owner[i] = tenant
    for tenant in TENANTS:
        mine = {i for i, t in owner.items() if t == tenant}
        r = client.search(query, k=k, scope=Scope(tenant))
        hits = [i for i in r.ids.tolist() if i != -1]
        assert set(hits) <= mine, (tenant, hits)
        assert len(hits) == min(k, len(mine))
        assert all(p.startswith(f"{tenant}/") for p in r.payloads[: len(hits)])  # type: ignore[index, union-attr]
        # and within the tenant, a user filter narrows further, never widens
        r = client.search(query, k=k, scope=Scope(tenant, "u1"))
        assert {i for i in r.ids.tolist() if i != -1} <= mine
    client.close()
