"""The two-pass batch search (kalos.index.kernels.batch_topk) on a CUDA GPU, at full sizes:
the interpreter tests' checks at 1M rows, and the fused scan's answers beside it.

Run on a CUDA machine: ``pytest -m gpu tests/gpu``. Skipped without CUDA.
"""

from __future__ import annotations

# isort: off
from cuda_device import torch

# isort: on

import zlib

import numpy as np
import pytest

from cuda_reference import check_search, make_index, round_to, rounding_flips_the_order

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    ("metric", "dtype", "dim", "n", "nq", "k"),
    [("ip", "fp16", 384, 1_000_000, 64, 10), ("cosine", "fp16", 384, 1_000_000, 8, 32),
     ("l2", "fp16", 128, 1_000_000, 16, 64), ("ip", "bf16", 768, 300_000, 5, 1),
     ("ip", "fp32", 256, 300_000, 32, 10)],
)  # fmt: skip
def test_matches_the_float64_reference(metric, dtype, dim, n, nq, k):
    # a seed of its own for each parameter set, the same in every process (hash() is salted)
    rng = np.random.default_rng(zlib.crc32(repr((metric, dtype, dim, n, nq, k)).encode()))
    idx = make_index(metric, dtype, dim, "cuda")
    idx.two_pass_min_batch = 2  # every batch through the two passes
    x = rng.standard_normal((n, dim)).astype(np.float32)
    ids = np.arange(1, n + 1, dtype=np.int64)
    idx.add(x, ids)
    assert idx._two_pass(nq, k)
    q = rng.standard_normal((nq, dim)).astype(np.float32)
    check_search(idx, x, ids, None, q, k)


def test_clustered_rows_scopes_and_the_fused_scan_beside_it():
    rng = np.random.default_rng(5)
    n, dim, nq, k = 1_000_000, 384, 64, 10
    centres = 3 * rng.standard_normal((50, dim)).astype(np.float32)
    x = centres[rng.integers(0, 50, n)] + 0.3 * rng.standard_normal((n, dim)).astype(np.float32)
    ids = np.arange(1, n + 1, dtype=np.int64)
    scopes = np.stack([np.ones(n), rng.integers(1, 4, n), np.zeros(n)], 1).astype(np.int64)
    idx = make_index("ip", "fp16", dim, "cuda")
    idx.two_pass_min_batch = 2
    idx.add(x, ids, scopes)
    q = (x[rng.integers(0, n, nq)] + 0.2 * rng.standard_normal((nq, dim))).astype(np.float32)
    check_search(idx, x, ids, scopes, q, k, scope=(1, 2, 0))
    two = idx.search(q, k)
    idx.two_pass_min_batch = 0  # never: the fused scan
    idx._workspaces.clear()
    fused = idx.search(q, k)
    # the same rows wherever the fused scan's fp16 query does not reorder them
    same = (two[1] == fused[1]).all(axis=1).mean()
    assert same > 0.9, same
    np.testing.assert_allclose(two[0], fused[0], rtol=2e-3, atol=2e-3)


def test_slack_keeps_a_tile_the_rounded_query_ranks_below():
    rng = np.random.default_rng(21)
    dim, n = 64, 1_000_000
    q, a, b = rounding_flips_the_order(rng, dim)
    x = (0.01 * rng.standard_normal((n, dim))).astype(np.float32)
    x[17], x[n - 5] = a, b  # far apart: different tiles and programs
    ids = np.arange(1, n + 1, dtype=np.int64)
    idx = make_index("ip", "fp16", dim, "cuda")
    idx.two_pass_min_batch = 2
    idx.add(x, ids)
    _, got = idx.search(np.tile(q, (4, 1)), 1)
    assert idx._two_pass(4, 1)
    assert got[:, 0].tolist() == [n - 4] * 4


def test_a_graph_of_a_batch_replays_the_two_passes():
    rng = np.random.default_rng(8)
    n, dim, nq, k = 500_000, 384, 32, 10
    x = rng.standard_normal((n, dim)).astype(np.float32)
    ids = np.arange(1, n + 1, dtype=np.int64)
    idx = make_index("ip", "fp16", dim, "cuda")
    idx.two_pass_min_batch = 32
    idx.add(x, ids)
    g = idx.graph(nq, k)
    assert g._ws[0].get("two_pass")
    q = rng.standard_normal((nq, dim)).astype(np.float32)
    g.query.copy_(torch.from_numpy(q))
    g.replay()
    torch.cuda.synchronize()
    np.testing.assert_array_equal(g.ids.cpu().numpy(), idx.search(q, k)[1])


@pytest.mark.parametrize(
    ("dtype", "dim", "batches"),
    [("fp16", 384, (1, 2, 4, 8, 16, 32)), ("bf16", 384, (4, 16)), ("fp16", 768, (2, 8, 12, 16)),
     ("fp16", 128, (16, 64))],
)  # fmt: skip
def test_a_batch_ranks_by_the_fp32_query_at_full_size(dtype, dim, batches):
    """Row b is best for the fp32 query, row a once the query is rounded to the rows' type:
    every batch the sidecar can form (the fused scan up to 16 queries, the two passes from
    32) and the general path (k = 100) answer b with b's fp32 score, as one search does."""
    rng = np.random.default_rng(zlib.crc32(repr((dtype, dim)).encode()))
    n = 1_000_000
    q, a, b = rounding_flips_the_order(rng, dim, dtype)
    x = (0.01 * rng.standard_normal((n, dim))).astype(np.float32)
    x[17], x[n - 5] = a, b  # far apart: different tiles and programs
    ids = np.arange(1, n + 1, dtype=np.int64)
    idx = make_index("ip", dtype, dim, "cuda")
    idx.add(x, ids)
    want = b.astype(np.float64) @ q.astype(np.float64)
    # fp32 sums in any order and the split's halves stay within rtol of b's fp32 score; the
    # rounded query's score of b lies beyond twice that
    rtol = 1e-5 if dtype == "fp16" else 2e-5
    assert abs(b.astype(np.float64) @ round_to(q, dtype) - want) > 2 * rtol * want
    for nq in batches:
        for k in (1, 10, 100):
            scores, got = idx.search(np.tile(q, (nq, 1)), k)
            assert got[:, 0].tolist() == [n - 4] * nq, (nq, k)
            np.testing.assert_allclose(scores[:, 0], want, rtol=rtol, err_msg=f"{nq} {k}")
