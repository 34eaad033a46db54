"""A ShardedIndex over CudaFlatIndex children on the CPU, under TRITON_INTERPRET=1: the same
answers as one CudaFlatIndex over the same rows, for every metric, with scope and ``allow``
filters, after upserts and removals, and through ``search_many``. Small sizes: the
interpreter is slow."""

from __future__ import annotations

# isort: off
from triton_interp import torch, triton  # noqa: F401  (first: sets TRITON_INTERPRET)

# isort: on

import numpy as np
import pytest

from cuda_reference import make_index
from kalos.index.sharded import ShardedIndex

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
