"""The two-pass batch search (kalos.index.kernels.batch_topk) on the CPU, under
TRITON_INTERPRET=1: every batch answer held against the float64 reference, on random rows
and on the data that strains the tile bound (ties, one cluster, rows apart only below fp16's
precision, scope filters that leave few rows), and against the fused scan's answers."""

from __future__ import annotations

# isort: off
from triton_interp import torch, triton  # noqa: F401  (first: sets TRITON_INTERPRET)

# isort: on

import numpy as np
import pytest

from cuda_reference import check_result, check_search, make_index, rounding_flips_the_order
from kalos.index.kernels import KEY_NONE, batch_topk, scan_topk


def _index(metric, dtype, dim, x, ids, scopes=None):
    """An index whose every batch (2 queries or more) takes the two passes."""
    idx = make_index(metric, dtype, dim, "cpu")
    idx.two_pass_min_batch = 2
    idx.add(x, ids, scopes)
    return idx


def test_batches_take_the_two_passes_from_their_size_bucket():
    idx = make_index("ip", "fp16", 32, "cpu")
    idx.add(np.ones((10, 32), np.float32), np.arange(10, dtype=np.int64))
    assert idx.two_pass_min_batch == batch_topk.MIN_BATCH == 32  # the default
    idx.two_pass_min_batch = 0  # never
    assert not any(idx._two_pass(nq, 10) for nq in (2, 17, 64))
    assert not idx._workspace(64, 10).get("two_pass")
    idx.two_pass_min_batch = 32
    assert idx._two_pass(32, 10) and idx._two_pass(17, 10)  # the same size bucket
    assert not idx._two_pass(1, 10) and not idx._two_pass(16, 10)
    assert not idx._two_pass(32, 100)  # k beyond the batch fast path: the general path
    assert idx._workspace(32, 10, private=True).get("two_pass")
    idx.two_pass_min_batch = 2
    assert idx._two_pass(2, 10) and idx._workspace(2, 10, private=True).get("two_pass")


@pytest.mark.parametrize(
    ("metric", "dtype", "dim", "n", "nq", "k"),
    [("ip", "fp16", 64, 1500, 4, 10), ("cosine", "bf16", 96, 900, 7, 1),
     ("l2", "fp32", 48, 700, 9, 33), ("l2", "fp16", 200, 1100, 5, 64),
     ("ip", "fp16", 384, 600, 16, 10)],
)  # fmt: skip
def test_matches_the_float64_reference(metric, dtype, dim, n, nq, k):
    rng = np.random.default_rng(hash((metric, dtype, dim, n, nq, k)) % 2**32)
    x = rng.standard_normal((n, dim)).astype(np.float32)
    x *= rng.uniform(0.2, 3.0, (n, 1)).astype(np.float32)  # norms that differ
    ids = rng.permutation(10 * n)[:n].astype(np.int64) + 1
    idx = _index(metric, dtype, dim, x, ids)
    q = rng.standard_normal((nq, dim)).astype(np.float32)
    check_search(idx, x, ids, None, q, k)


def _clustered(rng, n, dim, spread):
    # one shared direction plus a few tight clusters: every tile's best row scores alike
    mean = 3.0 * rng.standard_normal(dim)
    centres = mean + rng.standard_normal((4, dim))
    x = centres[rng.integers(0, 4, n)] + spread * rng.standard_normal((n, dim))
    return x.astype(np.float32)


@pytest.mark.parametrize(
    ("name", "make"),
    [
        ("ties", lambda rng, n, d: np.tile(rng.standard_normal((1, d)), (n, 1)).astype(np.float32)),
        ("one cluster", lambda rng, n, d: _clustered(rng, n, d, 0.01)),
        ("below fp16", lambda rng, n, d: (rng.standard_normal((1, d))
                                         + 1e-5 * rng.standard_normal((n, d))).astype(np.float32)),
        ("many tied with the k-th", lambda rng, n, d: np.concatenate(
            [rng.standard_normal((n // 2, d)),
             np.tile(rng.standard_normal((1, d)), (n - n // 2, 1))]).astype(np.float32)),
    ],
)  # fmt: skip
@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_adversarial_rows(name, make, metric):
    rng = np.random.default_rng(len(name))
    n, dim, k = 1200, 64, 10
    x = make(rng, n, dim)
    ids = np.arange(1, n + 1, dtype=np.int64)
    idx = _index(metric, "fp16", dim, x, ids)
    q = np.concatenate([x[rng.integers(0, n, 3)], rng.standard_normal((3, dim))]).astype(np.float32)
    check_search(idx, x, ids, None, q, k)


def test_scope_filters_that_leave_few_or_no_rows():
    rng = np.random.default_rng(3)
    n, dim = 1000, 32
    x = rng.standard_normal((n, dim)).astype(np.float32)
    ids = np.arange(1, n + 1, dtype=np.int64)
    scopes = np.zeros((n, 3), np.int64)
    scopes[:, 0] = 1
    scopes[rng.choice(n, 5, replace=False), 1] = 7  # five rows in user 7, in scattered tiles
    idx = _index("cosine", "fp16", dim, x, ids, scopes)
    q = rng.standard_normal((6, dim)).astype(np.float32)
    for scope in [(1, 7, 0), (1, 0, 0), (2, 0, 0)]:  # fewer than k, all, none
        check_search(idx, x, ids, scopes, q, 10, scope=scope)


def test_fewer_rows_than_k_and_a_single_tile():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((20, 16)).astype(np.float32)
    ids = np.arange(1, 21, dtype=np.int64)
    idx = _index("ip", "fp16", 16, x, ids)
    check_search(idx, x, ids, None, rng.standard_normal((5, 16)).astype(np.float32), 32)


def test_removes_upserts_and_reset_keep_it_exact():
    rng = np.random.default_rng(9)
    n, dim = 900, 64
    x = rng.standard_normal((n, dim)).astype(np.float32)
    ids = np.arange(1, n + 1, dtype=np.int64)
    idx = _index("l2", "fp16", dim, x, ids)
    q = rng.standard_normal((5, dim)).astype(np.float32)
    gone = rng.choice(ids, 300, replace=False)
    idx.remove(gone)
    live = ~np.isin(ids, gone)
    x, ids = x[live], ids[live]
    # upserts: far larger rows (the largest norm grows), then small ones near the queries
    big = (10 * rng.standard_normal((3, dim))).astype(np.float32)
    near = (q[:3] + 0.01 * rng.standard_normal((3, dim))).astype(np.float32)
    new_ids = np.array([ids[0], ids[1], 10_001, ids[2], 10_002, 10_003], dtype=np.int64)
    idx.add(np.concatenate([big, near]), new_ids)
    for i, j in enumerate(new_ids.tolist()):
        row = np.concatenate([big, near])[i]
        hit = np.nonzero(ids == j)[0]
        if len(hit):
            x[hit[0]] = row
        else:
            x, ids = np.concatenate([x, row[None]]), np.append(ids, j)
    check_search(idx, x, ids, None, q, 10)
    idx.reset()
    assert float(idx._sq_max[0]) == 0.0
    small = (0.1 * rng.standard_normal((200, dim))).astype(np.float32)
    idx.add(small, np.arange(1, 201, dtype=np.int64))
    check_search(idx, small, np.arange(1, 201, dtype=np.int64), None, q, 10)


def test_same_answers_as_the_fused_scan_and_through_a_graph():
    rng = np.random.default_rng(11)
    n, dim, nq, k = 1000, 64, 8, 10
    x = _clustered(rng, n, dim, 0.5)
    ids = np.arange(1, n + 1, dtype=np.int64)
    scopes = np.stack([np.ones(n), rng.integers(1, 3, n), np.zeros(n)], 1).astype(np.int64)
    idx = _index("ip", "fp16", dim, x, ids, scopes)
    q = (x[rng.integers(0, n, nq)] + 0.1 * rng.standard_normal((nq, dim))).astype(np.float32)
    s2, i2 = idx.search(q, k, scope=(1, 2, 0))
    idx.two_pass_min_batch = 10**9
    idx._workspaces.clear()
    s1, i1 = idx.search(q, k, scope=(1, 2, 0))
    np.testing.assert_array_equal(i2, i1)  # distinct scores here: the same rows, in order
    np.testing.assert_allclose(s2, s1, rtol=2e-3, atol=2e-3)
    idx.two_pass_min_batch = 2
    g = idx.graph(nq, k, scope_active=True)
    assert g._ws[0].get("two_pass")
    g.query.copy_(torch.from_numpy(q))
    g.scope.copy_(torch.tensor([1, 2, 0]))
    g.scores.fill_(float("nan"))
    g.replay()
    np.testing.assert_array_equal(g.ids.numpy(), i2)
    check_result(idx, x, ids, scopes, q, k, g.scores.numpy(), g.ids.numpy(), (1, 2, 0))


def test_slack_covers_the_storage_rounding():
    gap_q, gap_x = batch_topk.slack(384, torch.float16, 0)
    assert gap_q >= 2 * (2.0**-11 + 2 * 384 * 2.0**-24) and gap_x == 0.0
    assert batch_topk.slack(384, torch.bfloat16, 0)[0] > gap_q  # a coarser query rounding
    l2 = batch_topk.slack(384, torch.float16, 2)
    assert l2[0] == 2 * gap_q and l2[1] > 0


def test_workspace_too_small_is_refused():
    idx = _index("ip", "fp16", 16, np.ones((10, 16), np.float32), np.arange(10, dtype=np.int64))
    ws = idx._workspace(4, 10)
    q = torch.zeros((4, 16))
    out = (torch.zeros((4, 10)), torch.zeros((4, 10), dtype=torch.int64))
    args = (idx._vecs, idx._sq, idx._sq_max, idx._scopes, idx._no_filter, q, idx._n_dev, idx._ids)
    kw = {"k": 10, "metric": 0, "scoped": False, "programs": 1, "cfg": ws["cfg"]}
    with pytest.raises(ValueError, match="tmax"):
        batch_topk.search(*args, ws["tmax"][:, :0], ws["lists"][:, :0], ws["parts"], *out, **kw)
    with pytest.raises(ValueError, match="parts"):
        batch_topk.search(*args, ws["tmax"], ws["lists"], ws["parts"][:, :, :2], *out, **kw)
    with pytest.raises(ValueError, match="split"):
        batch_topk.search(*args, ws["tmax"], ws["lists"], ws["parts"], *out, **kw, split=3)


def _flipped(dtype, dim, seed, two_pass_min_batch):
    """(index, q): 300 small rows, of which row a (id 1) scores best for the query rounded to
    the rows' type and row b (id 151, another tile) for the fp32 query q."""
    rng = np.random.default_rng(seed)
    q, a, b = rounding_flips_the_order(rng, dim, dtype)
    x = (0.01 * rng.standard_normal((300, dim))).astype(np.float32)
    x[0], x[150] = a, b
    idx = make_index("ip", dtype, dim, "cpu")
    idx.two_pass_min_batch = two_pass_min_batch
    idx.add(x, np.arange(1, 301, dtype=np.int64))
    return idx, q


def _fp32_score(idx, q, row_id):
    stored = idx.reconstruct(np.array([row_id], dtype=np.int64)).astype(np.float64)[0]
    return stored @ q.astype(np.float64)


def test_slack_keeps_a_tile_the_rounded_query_ranks_below():
    """Row b scores best for the query, but below row a (in another tile) once the query is
    rounded to fp16 as the first pass's dot takes it: the slack keeps b's tile, and the batch
    answers b, the float64 reference's best."""
    idx, q = _flipped("fp16", 64, 21, 2)
    _, got = idx.search(np.tile(q, (4, 1)), 1)
    assert _fp32_score(idx, q, 151) > _fp32_score(idx, q, 1)
    assert got[:, 0].tolist() == [151] * 4


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_a_batch_ranks_by_the_fp32_query_as_one_search_does(dtype):
    """Row b scores best for the fp32 query, row a once the query is rounded to fp16. The
    fused scan of a batch (below the two passes) and the general path (k above the fused
    scan's) score with tensor-core dots, whose operands take the storage type: each scores
    the query's two halves (the rounded query and what the rounding left), so every member
    answers b with b's fp32 score, as the search alone does."""
    idx, q = _flipped(dtype, 64, 21, 0)  # two_pass_min_batch 0: the fused scan for every batch
    want = _fp32_score(idx, q, 151)
    assert want > _fp32_score(idx, q, 1)
    for nq, k in ((1, 1), (4, 1), (4, 3), (4, 100), (1, 300)):
        assert idx._fast(nq, k) == (k <= 3)  # k 100 in a batch and 300: the general path
        scores, got = idx.search(np.tile(q, (nq, 1)), k)
        assert got[:, 0].tolist() == [151] * nq, (nq, k)
        # the halves' products: within ~2^-22 of |q| |x| on fp16 rows, ~2^-16 on bf16
        np.testing.assert_allclose(scores[:, 0], want, rtol=1e-6 if dtype == "fp16" else 5e-5)


def test_a_batch_the_fused_scan_would_round_takes_the_two_passes():
    """Above 512 dims a batch of 9-16 queries has no room in the fused scan's dot for the
    query's low half (dot_lanes): it takes the two passes, whose second pass scores the fp32
    query, and the general path scores it in groups the split fits. Row b is best for the
    fp32 query and a for the rounded one; every member answers b."""
    idx, q = _flipped("fp16", 768, 5, batch_topk.MIN_BATCH)
    assert [idx._two_pass(nq, 10) for nq in (2, 8, 9, 16)] == [False, False, True, True]
    assert scan_topk.split_batch(768, 2) == 8 and scan_topk.split_batch(384, 2) == 16
    assert scan_topk.split_batch(128, 2) == 64 and scan_topk.split_batch(768, 4) == 64
    assert idx._workspace(12, 100, private=True)["chunk"] == 8
    want = _fp32_score(idx, q, 151)
    for nq, k in ((12, 10), (12, 100)):
        scores, got = idx.search(np.tile(q, (nq, 1)), k)
        assert got[:, 0].tolist() == [151] * nq, (nq, k)
        np.testing.assert_allclose(scores[:, 0], want, rtol=1e-6)
    idx.two_pass_min_batch = 0  # never: the fused scan, with the rounded query
    assert not idx._two_pass(12, 10)
    small = make_index("ip", "fp16", 384, "cpu")
    assert not any(small._two_pass(nq, 10) for nq in (2, 9, 16))  # the split fits there
    wide = make_index("ip", "fp32", 768, "cpu")
    assert not wide._two_pass(12, 10)  # fp32 rows: the query is not rounded


@pytest.mark.parametrize(("k", "split"), [(1, 1), (10, 4), (16, 16), (10, 64)])
def test_tile_maxima_over_several_chunks_and_slices(k, split):
    """The second pass splits each query's tiles into slices, a program each, that read their
    tile maxima a chunk at a time and sort only the chunks that beat their KP-th so far:
    small chunks here, the best tiles in the first and the last, and more slices than tiles
    (64: empty slices)."""
    rng = np.random.default_rng(k)
    n, dim, nq = 4000, 32, 6
    x = rng.standard_normal((n, dim)).astype(np.float32)
    q = rng.standard_normal((nq, dim)).astype(np.float32)
    x[:5] = 3 * q[:5]  # strong rows in the first tile
    x[-5:] = 4 * q[1:]  # and stronger ones in the last
    ids = np.arange(1, n + 1, dtype=np.int64)
    idx = _index("ip", "fp16", dim, x, ids)
    ws = idx._workspace(nq, k)
    parts = torch.empty((2, nq, split, ws["parts"].shape[3]), dtype=torch.int64)
    scores = torch.full((nq, k), float("nan"))
    got = torch.full((nq, k), -7, dtype=torch.int64)
    batch_topk.search(
        idx._vecs, idx._sq, idx._sq_max, idx._scopes, idx._no_filter, torch.from_numpy(q),
        idx._n_dev, idx._ids, ws["tmax"], ws["lists"], parts, scores, got, k=k, metric=0,
        scoped=False, programs=ws["programs"], cfg=ws["cfg"], chunk=16, split=split,
    )  # fmt: skip
    assert ws["tmax"].shape[1] > 3 * 16  # several chunks
    check_result(idx, x, ids, None, q, k, scores.numpy(), got.numpy())
    # each slice's list: the KP largest (maximum, tile) keys of its share of the tiles
    kp = parts.shape[3]
    n_tiles = -(-n // ws["cfg"].block_n)
    width = -(-n_tiles // split)
    tmax = ws["tmax"][:nq, :n_tiles].numpy()
    for qi in range(nq):
        for s in range(split):
            m = tmax[qi, s * width : (s + 1) * width]
            bits = m.view(np.int32).astype(np.int64)
            ordered = np.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
            keys = np.sort((ordered << 32) | np.arange(s * width, s * width + len(m)))[::-1]
            want = np.full(kp, KEY_NONE, np.int64)
            want[: min(kp, len(keys))] = keys[:kp]
            np.testing.assert_array_equal(parts[0, qi, s].numpy(), want, err_msg=f"{qi} {s}")
