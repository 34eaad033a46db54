"""A 2-shard cuda index (``cuda:flat,fp16,shards=2``: both shards on one GPU, searched by
launching both and merging on the device) against one ``cuda:flat,fp16`` at a moderate size:
the same answers up to the order of exact ties; exact ties across shards in one index's order;
shards on two GPUs where there are two.

Run on a CUDA machine: ``pytest -m gpu tests/gpu``. Skipped without CUDA.
"""

from __future__ import annotations

# isort: off
from cuda_device import torch

# isort: on

import numpy as np
import pytest

from kalos.index import create
from kalos.index.cuda_flat import CudaFlatIndex
from kalos.index.sharded import ShardedIndex, shard_of

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("metric", ["ip", "cosine", "l2"])
def test_two_shards_equal_one_index(metric: str) -> None:
    rng = np.random.default_rng(3)
    n, dim = 200_000, 128
    one = create("cuda:flat,fp16", dim=dim, metric=metric)
    many = create("cuda:flat,fp16,shards=2", dim=dim, metric=metric)
    assert isinstance(many, ShardedIndex)
    x = rng.standard_normal((n, dim)).astype(np.float32)
    ids = rng.permutation(4 * n)[:n].astype(np.int64) + 1
    scopes = np.stack([rng.integers(1, 4, n), np.zeros(n, np.int64), np.zeros(n, np.int64)], 1)
    for index in (one, many):
        index.add(x, ids, scopes)
        index.remove(ids[:1000])
    q = rng.standard_normal((8, dim)).astype(np.float32)
    allow = ids[rng.random(n) < 0.01]
    for k in (1, 10, 100):
        for kw in ({}, {"scope": (2, 0, 0)}, {"allow": allow}):
            s1, i1 = one.search(q, k, **kw)
            s2, i2 = many.search(q, k, **kw)
            np.testing.assert_allclose(s2, s1, rtol=2e-3, atol=2e-3)
            same = (i1 == i2).mean()
            assert same > 0.99, (k, kw, same)  # fp16 ties only


@pytest.mark.parametrize("metric", ["ip", "cosine", "l2"])
def test_exact_ties_across_shards_in_one_index_order(metric: str) -> None:
    rng = np.random.default_rng(4)
    dim = 128
    one = create("cuda:flat,fp16", dim=dim, metric=metric)
    many = create("cuda:flat,fp16,shards=2", dim=dim, metric=metric)
    candidates = np.arange(10_000_000, 10_000_100, dtype=np.int64)
    where = shard_of(candidates, 2)
    tied = np.sort(np.concatenate([candidates[where == 0][:4], candidates[where == 1][:4]]))
    dup = rng.standard_normal(dim).astype(np.float32)
    others = rng.standard_normal((50_000, dim)).astype(np.float32)
    for index in (one, many):
        index.add(others, np.arange(1, 50_001, dtype=np.int64))
        # one index breaks exact ties by row, the later first: the copies in descending id
        # order come back in ascending id order, the sharded index's order
        index.add(np.tile(dup, (8, 1)), tied[::-1].copy())
    q = dup[None]
    for k in (5, 8, 20):
        s1, i1 = one.search(q, k)
        s2, i2 = many.search(q, k)
        np.testing.assert_array_equal(i2[0, : min(k, 8)], tied[: min(k, 8)])
        np.testing.assert_array_equal(i2[0, : min(k, 8)], i1[0, : min(k, 8)])
        np.testing.assert_allclose(s2, s1, rtol=2e-3, atol=2e-3)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_shards_on_two_gpus_equal_one_index() -> None:
    rng = np.random.default_rng(6)
    n, dim = 100_000, 128
    one = create("cuda:flat,fp16", dim=dim)
    children = [
        CudaFlatIndex(dim=dim, metric="ip", spec=f"cuda:{d}:flat,fp16", device=f"cuda:{d}")
        for d in (0, 1)
    ]
    many = ShardedIndex("cuda:flat,fp16,shards=2", children)
    x = rng.standard_normal((n, dim)).astype(np.float32)
    ids = rng.permutation(4 * n)[:n].astype(np.int64) + 1
    for index in (one, many):
        index.add(x, ids)
    q = rng.standard_normal((8, dim)).astype(np.float32)
    for k in (1, 10, 100):
        s1, i1 = one.search(q, k)
        s2, i2 = many.search(q, k)
        np.testing.assert_allclose(s2, s1, rtol=2e-3, atol=2e-3)
        assert (i1 == i2).mean() > 0.99, k  # fp16 ties only
    members = [(q[:1], 10, None), (q, 5, None)]
    for got, want in zip(many.search_many(members), one.search_many(members), strict=True):
        np.testing.assert_allclose(got[0], want[0], rtol=2e-3, atol=2e-3)
