"""A sharded index (``cpu:flat,shards=N``) answers exactly as one ``cpu:flat`` index.

Random interleavings of adds (new ids, upserts of stored ids, duplicate ids in one batch),
removes (stored and unknown ids) and searches (random k, k beyond the size, scope filters,
``allow`` filters, ``search_many``) run against both. Vectors are random floats, so scores
are distinct; where two scores lie within float32 rounding of each other, the ids may come in
either order (a single index breaks ties by row order, the sharded one by id). The merge a
sharded index of cuda children runs on the device is checked against the host merge here too.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kalos.errors import ConfigError, NotFound
from kalos.index import create
from kalos.index.sharded import ShardedIndex, merge_topk, shard_of

DIM = 8
TOL = 1e-5


def _same_answer(got: tuple[np.ndarray, np.ndarray], want: tuple[np.ndarray, np.ndarray]) -> None:
    gs, gi = got
    ws, wi = want
    assert gs.shape == ws.shape and gi.shape == wi.shape
    assert gs.dtype == np.float32 and gi.dtype == np.int64
    np.testing.assert_allclose(gs, ws, rtol=TOL, atol=TOL)
    for row in range(wi.shape[0]):
        for pos in range(wi.shape[1]):
            if gi[row, pos] == wi[row, pos]:
                continue
            # a different id only where the score is tied within rounding with a neighbour
            near = np.abs(ws[row] - ws[row, pos]) <= TOL * max(1.0, abs(float(ws[row, pos])))
            assert near.sum() > 1, (row, pos, gi[row], wi[row])
            assert set(gi[row][near]) <= set(wi[row][near]) or pos == wi.shape[1] - 1


def _run(seed: int, shards: int, metric: str, steps: int) -> None:
    rng = np.random.default_rng(seed)
    one = create("cpu:flat", dim=DIM, metric=metric)
    many = create(f"cpu:flat,shards={shards}", dim=DIM, metric=metric)
    assert isinstance(many, ShardedIndex) and many.shards == shards
    id_space = 60  # small, so upserts and removes hit stored ids often
    for _ in range(steps):
        op = rng.integers(0, 10)
        if op < 4:  # add: a batch with duplicates and ids already stored
            n = int(rng.integers(1, 12))
            ids = rng.integers(0, id_space, n).astype(np.int64)
            vecs = rng.standard_normal((n, DIM)).astype(np.float32)
            scopes = rng.integers(0, 3, (n, 3)).astype(np.int64)
            one.add(vecs, ids, scopes)
            many.add(vecs, ids, scopes)
        elif op < 5:  # remove, unknown ids included
            ids = rng.integers(-5, id_space + 20, int(rng.integers(0, 8))).astype(np.int64)
            assert many.remove(ids) == one.remove(ids)
        else:
            nq = int(rng.integers(1, 4))
            q = rng.standard_normal((nq, DIM)).astype(np.float32)
            k = int(rng.integers(1, len(one) + 5))
            scope = None
            if rng.random() < 0.4:
                scope = tuple(int(x) for x in rng.integers(0, 3, 3))
            allow = None
            if rng.random() < 0.4:
                allow = rng.integers(0, id_space + 10, int(rng.integers(0, 30))).astype(np.int64)
            _same_answer(
                many.search(q, k, scope=scope, allow=allow),  # type: ignore[arg-type]
                one.search(q, k, scope=scope, allow=allow),  # type: ignore[arg-type]
            )
            if op == 9:  # a batch of searches, each as it would run alone
                members = [(q, k, scope), (q[:1], max(1, k // 2), None)]
                got_all = many.search_many(members)  # type: ignore[arg-type]
                want_all = one.search_many(members)  # type: ignore[arg-type]
                for got, want in zip(got_all, want_all, strict=True):
                    _same_answer(got, want)
        assert len(many) == len(one)
    ids, vecs, scopes = one.dump()
    mids, mvecs, mscopes = many.dump()
    order, morder = np.argsort(ids), np.argsort(mids)
    np.testing.assert_array_equal(mids[morder], ids[order])
    np.testing.assert_array_equal(mvecs[morder], vecs[order])
    np.testing.assert_array_equal(mscopes[morder], scopes[order])
    if len(ids):
        np.testing.assert_array_equal(many.reconstruct(ids), one.reconstruct(ids))


@pytest.mark.parametrize("metric", ["ip", "cosine", "l2"])
@pytest.mark.parametrize("shards", [2, 3])
@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**32 - 1))
def test_sharded_equals_one_index(shards: int, metric: str, seed: int) -> None:
    _run(seed, shards, metric, steps=40)


def test_shard_of_is_fixed_and_spread() -> None:
    ids = np.arange(-1000, 9000, dtype=np.int64)
    where = shard_of(ids, 3)
    assert where.min() == 0 and where.max() == 2
    counts = np.bincount(where)
    assert counts.min() > 0.3 * ids.shape[0] / 3 * 2  # roughly balanced
    # a pure function of the id: the same answer for the same id, in any batch
    np.testing.assert_array_equal(shard_of(ids[::-1], 3), where[::-1])
    assert shard_of(np.array([2**63 - 1, -(2**63)], np.int64), 2).shape == (2,)


def test_merge_ties_by_id_and_empties_last() -> None:
    a = (np.array([[3.0, 1.0, -np.inf]], np.float32), np.array([[7, 2, -1]], np.int64))
    b = (np.array([[3.0, 2.0, -np.inf]], np.float32), np.array([[4, 9, -1]], np.int64))
    scores, ids = merge_topk([a, b], 5, "ip")
    assert ids.tolist() == [[4, 7, 9, 2, -1]]
    assert scores[0, :4].tolist() == [3.0, 3.0, 2.0, 1.0]
    dist, ids = merge_topk(
        [(np.array([[1.0, np.inf]], np.float32), np.array([[5, -1]]))] * 2, 3, "l2"
    )
    assert ids.tolist() == [[5, 5, -1]] and dist[0, 2] == np.inf


@pytest.mark.parametrize("metric", ["ip", "cosine", "l2"])
@settings(max_examples=40, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1))
def test_device_merge_equals_host_merge(metric: str, seed: int) -> None:
    """merge_topk_device (on CPU tensors here; the cuda children's merge) gives exactly
    merge_topk's answer: many exact ties, -0.0 beside 0.0, infinite scores of real rows, and
    empty slots."""
    torch = pytest.importorskip("torch")
    from kalos.index.base import missing_score
    from kalos.index.sharded import merge_topk_device

    rng = np.random.default_rng(seed)
    nq, shards, k = int(rng.integers(1, 4)), int(rng.integers(2, 4)), int(rng.integers(1, 7))
    values = np.array([-np.inf, -1.0, -0.0, 0.0, 0.5, 2.0, np.inf], np.float32)
    parts = []
    for _ in range(shards):
        scores = rng.choice(values, (nq, k)).astype(np.float32)
        ids = rng.integers(-6, 12, (nq, k)).astype(np.int64)  # negative ids are ids too
        empty = (ids == -1) | (rng.random((nq, k)) < 0.2)
        ids[empty] = -1
        scores[empty] = missing_score(metric)
        parts.append((scores, ids))
    want_scores, want_ids = merge_topk(parts, k, metric)
    got_scores, got_ids = merge_topk_device(
        torch.from_numpy(np.concatenate([p[0] for p in parts], axis=1)),
        torch.from_numpy(np.concatenate([p[1] for p in parts], axis=1)),
        k,
        metric,
    )
    np.testing.assert_array_equal(got_ids.numpy(), want_ids)
    np.testing.assert_array_equal(got_scores.numpy(), want_scores)


def test_sharded_reconstruct_unknown_is_not_found() -> None:
    index = create("cpu:flat,shards=2", dim=DIM)
    index.add(np.ones((2, DIM), np.float32), np.array([1, 2]))
    with pytest.raises(NotFound):
        index.reconstruct(np.array([1, 99]))


@pytest.mark.parametrize(
    "spec",
    [
        "cpu:flat,shards=1",
        "cpu:flat,shards=0",
        "cpu:flat,shards=x",
        "cpu:flat,shards",
        "cpu:flat,shards=2,shards=3",
        "cpu:nope,shards=2",
    ],
)
def test_bad_sharded_specs(spec: str) -> None:
    with pytest.raises(ConfigError):
        create(spec, dim=DIM)


def test_cpu_sidecar_serves_a_sharded_index() -> None:
    from kalos.testing import isolated_sidecar

    rng = np.random.default_rng(5)
    base = rng.standard_normal((60, DIM)).astype(np.float32)
    ids = np.arange(100, 160, dtype=np.int64)
    reference = create("cpu:flat", dim=DIM)
    reference.add(base, ids)
    with isolated_sidecar(dim=DIM, extra_args=("--index", "cpu:flat,shards=3")) as sc:
        client = sc.connect()
        try:
            assert client.add(base, ids) == 60
            for i in (0, 31, 59):
                r = client.search(base[i], k=7)
                _, want = reference.search(base[i], 7)
                np.testing.assert_array_equal(r.ids, want[0])
        finally:
            client.close()
