"""A ShardedIndex over CudaFlatIndex children on the CPU, under TRITON_INTERPRET=1: the same
answers as one CudaFlatIndex over the same rows, for every metric, with scope and ``allow``
filters, after upserts and removals, and through ``search_many``; searches without ``allow``
launch every child's ``search_device`` and merge on the device, and exact ties across shards
come back in one index's order. Small sizes: the interpreter is slow."""

from __future__ import annotations

# isort: off
from triton_interp import torch, triton  # noqa: F401  (first: sets TRITON_INTERPRET)

# isort: on

import numpy as np
import pytest

from cuda_reference import make_index
from kalos.errors import InvalidRequest
from kalos.index.sharded import DeviceIndex, ShardedIndex, merge_topk, shard_of

TOL = 1e-4


def _same(got: tuple[np.ndarray, np.ndarray], want: tuple[np.ndarray, np.ndarray]) -> None:
    np.testing.assert_allclose(got[0], want[0], rtol=TOL, atol=TOL)
    differ = got[1] != want[1]
    # ids differ only among scores tied within rounding
    for row, pos in zip(*np.nonzero(differ), strict=True):
        tied = np.abs(want[0][row] - want[0][row, pos]) <= TOL * max(1.0, abs(want[0][row, pos]))
        assert tied.sum() > 1, (got, want)


@pytest.mark.parametrize("metric", ["ip", "cosine", "l2"])
def test_sharded_cuda_equals_one(metric: str) -> None:
    rng = np.random.default_rng(11)
    n, dim = 120, 32
    one = make_index(metric, "fp32", dim, "cpu")
    many = ShardedIndex(
        "cuda:flat,fp32,shards=2", [make_index(metric, "fp32", dim, "cpu") for _ in range(2)]
    )
    x = rng.standard_normal((n, dim)).astype(np.float32)
    ids = rng.permutation(5 * n)[:n].astype(np.int64) + 1
    scopes = np.stack([rng.integers(1, 3, n), np.zeros(n, np.int64), rng.integers(4, 6, n)], 1)
    for index in (one, many):
        index.add(x, ids, scopes)
        index.add(x[:10] * 2, ids[:10], scopes[:10])  # upserts
        assert index.remove(np.concatenate([ids[10:20], [999_999]])) == 10
    assert len(many) == len(one) == n - 10
    q = rng.standard_normal((2, dim)).astype(np.float32)
    allow = ids[rng.random(n) < 0.5]
    for k in (7, n + 3):
        for scope in (None, (1, 0, 5)):
            _same(many.search(q, k, scope=scope), one.search(q, k, scope=scope))
        _same(many.search(q, k, allow=allow), one.search(q, k, allow=allow))
    members = [(q[:1], 5, None), (q, 3, (2, 0, 0))]
    for got, want in zip(many.search_many(members), one.search_many(members), strict=True):
        _same(got, want)
    np.testing.assert_array_equal(many.reconstruct(ids[:5]), one.reconstruct(ids[:5]))


@pytest.mark.parametrize("metric", ["ip", "cosine", "l2"])
def test_exact_ties_across_shards_in_one_index_order(
    metric: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(5)
    dim = 16
    candidates = np.arange(100, 200, dtype=np.int64)
    where = shard_of(candidates, 2)
    # one vector stored 6 times, under ids in both shards, beside 30 other rows
    tied = np.sort(np.concatenate([candidates[where == 0][:3], candidates[where == 1][:3]]))
    dup = rng.standard_normal(dim).astype(np.float32)
    others = rng.standard_normal((30, dim)).astype(np.float32)
    other_ids = np.arange(1000, 1030, dtype=np.int64)
    one = make_index(metric, "fp32", dim, "cpu")
    many = ShardedIndex(
        "cuda:flat,fp32,shards=2", [make_index(metric, "fp32", dim, "cpu") for _ in range(2)]
    )
    assert all(isinstance(c, DeviceIndex) for c in many.children)
    for index in (one, many):
        index.add(others, other_ids)
        # one index breaks exact ties by row, the later first: copies added in descending id
        # order come back in ascending id order, the sharded index's order
        index.add(np.tile(dup, (6, 1)), tied[::-1].copy())

    def host_search(*args: object, **kwargs: object) -> None:
        raise AssertionError("a search without allow runs on the device")

    q = dup[None] if metric != "cosine" else 3 * dup[None]  # cosine: the kernels normalise
    host_parts = [c.search(q, 40) for c in many.children]
    for child in many.children:
        monkeypatch.setattr(child, "search", host_search)
    for k in (8, 40):  # 40: beyond the 36 rows, empty slots last
        s1, i1 = one.search(q, k)
        s2, i2 = many.search(q, k)
        np.testing.assert_array_equal(i2, i1)
        np.testing.assert_allclose(s2, s1, rtol=TOL, atol=TOL)
        assert i2[0, :6].tolist() == tied.tolist()
    assert (i2[0, 36:] == -1).all()
    # the same order as the host merge of each shard's own answer
    np.testing.assert_array_equal(i2, merge_topk(host_parts, 40, metric)[1])


def test_sharded_cuda_checks_queries_once_as_one_index() -> None:
    many = ShardedIndex(
        "cuda:flat,fp16,shards=2", [make_index("ip", "fp16", 8, "cpu") for _ in range(2)]
    )
    many.add(np.eye(8, dtype=np.float32), np.arange(1, 9, dtype=np.int64))
    for bad in (np.full((1, 8), np.nan, np.float32), np.full((1, 8), 1e6, np.float32)):
        with pytest.raises(InvalidRequest):
            many.search(bad, 3)
    with pytest.raises(InvalidRequest):
        many.search(np.ones((1, 7), np.float32), 3)
    for bad_k in (0, 1025, 10**12, 2.5):
        with pytest.raises(InvalidRequest):
            many.search(np.ones(8, np.float32), bad_k)  # type: ignore[arg-type]
    s, i = many.search(np.ones(8, np.float32), 3, scope=(0, 0, 0))
    assert s.shape == i.shape == (1, 3) and i.dtype == np.int64 and s.dtype == np.float32
