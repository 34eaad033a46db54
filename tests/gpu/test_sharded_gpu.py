"""A 2-shard cuda index (``cuda:flat,fp16,shards=2``: both shards on one GPU) against one
``cuda:flat,fp16`` at a moderate size: the same answers up to the order of exact ties.

Run on a CUDA machine: ``pytest -m gpu tests/gpu``. Skipped without CUDA.
"""

from __future__ import annotations

# isort: off
from cuda_device import torch  # noqa: F401

# isort: on

import numpy as np
import pytest

from kalos.index import create
from kalos.index.sharded import ShardedIndex

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
