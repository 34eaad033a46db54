"""CudaFlatIndex and its Triton kernels on the CPU, under TRITON_INTERPRET=1 (CI has no GPU).

Small sizes: the interpreter runs each program in Python. The same checks at full size are in
tests/gpu/test_cuda_flat_gpu.py. Every search is compared with a float64 reference computed from
the storage-rounded vectors; outputs are poisoned first, so an unwritten element fails.
"""

from __future__ import annotations

# isort: off
from triton_interp import torch, triton  # noqa: F401  (first: sets TRITON_INTERPRET)

# isort: on

import numpy as np
import pytest

# The float64 reference and the search checker, shared with the GPU tests.
from cuda_reference import (
    check_graph_search,
    check_result,
    check_search,
    make_index,
    ref_scores,
    unprovable_rows,
)
from kalos.errors import ConfigError, InvalidRequest, NotFound
from kalos.index import cuda_flat
from kalos.index.cuda_flat import SearchGraph, parse_spec


def test_parse_spec():
    b4 = cuda_flat.BATCH4_MAX_BATCH  # the default
    assert parse_spec("cuda:flat,fp16") == ("cuda", "fp16", "auto", b4)
    assert parse_spec("cuda:flat") == ("cuda", "fp16", "auto", b4)
    assert parse_spec("cuda:1:flat,bf16") == ("cuda:1", "bf16", "auto", b4)
    assert parse_spec("cuda:flat,fp32,scan=full") == ("cuda", "fp32", "full", b4)
    assert parse_spec("cuda:flat,scan=int8") == ("cuda", "fp16", "int8", b4)
    assert parse_spec("cuda:flat,scan=4bit,batch4=64") == ("cuda", "fp16", "4bit", 64)
    assert parse_spec("cuda:flat,batch4=0") == ("cuda", "fp16", "auto", 0)
    bad_batch4 = ("cuda:flat,batch4=3", "cuda:flat,batch4=128", "cuda:flat,batch4=x")
    for bad in ("cuda:flat,fp8", "cuda:flat,scan=pq", "cpu:flat", *bad_batch4):
        with pytest.raises(ConfigError):
            parse_spec(bad)


@pytest.mark.parametrize(
    "metric,dtype,dim,n,nq,k",
    [
        ("ip", "fp16", 64, 700, 1, 10),
        ("ip", "fp16", 64, 300, 3, 1),
        ("cosine", "bf16", 96, 400, 1, 7),
        ("l2", "fp32", 128, 300, 2, 16),
        ("ip", "fp16", 1024, 120, 1, 10),
        ("l2", "fp16", 200, 260, 5, 33),
    ],
)
def test_search_matches_float64_reference(metric, dtype, dim, n, nq, k):
    rng = np.random.default_rng(hash((metric, dtype, dim, n, nq, k)) % 2**32)
    idx = make_index(metric, dtype, dim, "cpu")
    x = rng.standard_normal((n, dim)).astype(np.float32)
    ids = rng.permutation(10 * n)[:n].astype(np.int64) + 1
    idx.add(x, ids)
    assert len(idx) == n
    q = rng.standard_normal((nq, dim)).astype(np.float32)
    check_search(idx, x, ids, None, q, k)


def test_device_path_writes_every_output_and_k_above_n():
    rng = np.random.default_rng(1)
    idx = make_index("ip", "fp16", 64, "cpu")
    x = rng.standard_normal((5, 64)).astype(np.float32)
    idx.add(x, np.arange(5, dtype=np.int64) + 100)
    q = torch.from_numpy(rng.standard_normal((2, 64)).astype(np.float32))
    scores = torch.full((2, 10), float("nan"))
    out_ids = torch.full((2, 10), -7, dtype=torch.int64)
    idx.search_device(q, 10, out=(scores, out_ids))
    assert not torch.isnan(scores).any() and not (out_ids == -7).any()
    assert (out_ids[:, 5:] == -1).all() and torch.isinf(scores[:, 5:]).all()
    assert (scores[:, 5:] < 0).all()
    assert sorted(out_ids[0, :5].tolist()) == [100, 101, 102, 103, 104]
    check_search(idx, x, np.arange(5) + 100, None, q.numpy(), 10)
    # l2 pads with +inf
    idx2 = make_index("l2", "fp16", 64, "cpu")
    idx2.add(x[:3], np.arange(3, dtype=np.int64))
    s, i = idx2.search(q.numpy(), 4)
    assert (i[:, 3] == -1).all() and (s[:, 3] == np.inf).all()


def test_ties_duplicates_and_large_k_general_path():
    rng = np.random.default_rng(2)
    dim = 64
    idx = make_index("ip", "fp16", dim, "cpu")
    base = rng.standard_normal((600, dim)).astype(np.float32)
    q = rng.standard_normal((1, dim)).astype(np.float32)
    base[:40] = 10 * q[0] / np.linalg.norm(q[0])  # 40 exact duplicates, far above the rest
    ids = np.arange(600, dtype=np.int64) * 3 + 7
    idx.add(base, ids)
    s, got = idx.search(q, 10)
    assert set(got[0].tolist()) <= set(ids[:40].tolist())
    assert np.allclose(s[0], s[0, 0])
    # k beyond the fast path's per-program list (KP 512 > 256): the general path
    check_search(idx, base, ids, None, q, 300)
    # batch with k = 100 (KP 128 > 64 for batches): the general path too
    q2 = rng.standard_normal((2, dim)).astype(np.float32)
    check_search(idx, base, ids, None, q2, 100)


def test_launch_shapes_fma_noskip_and_survivor_overflow():
    """The same answers from the FMA scorer; without the threshold skip, with so many programs
    that the survivor list overflows (the merge then sorts every program's list); with more
    programs than k (the group-best bound)."""
    from kalos.index.kernels import ScanConfig

    rng = np.random.default_rng(9)
    dim = 64
    x = rng.standard_normal((900, dim)).astype(np.float32)
    ids = np.arange(900, dtype=np.int64) + 1
    q = rng.standard_normal((1, dim)).astype(np.float32)
    for cfg in [
        ScanConfig(
            block_n=32, num_warps=4, num_stages=1, use_dot=False, skip=True, programs_per_sm=3
        ),
        ScanConfig(
            block_n=16, num_warps=4, num_stages=1, use_dot=True, skip=False, programs_per_sm=20
        ),
        # more programs than k: the group-best bound takes part
        ScanConfig(
            block_n=16, num_warps=4, num_stages=1, use_dot=True, skip=True, programs_per_sm=24
        ),
    ]:
        idx = make_index("ip", "fp16", dim, "cpu")
        idx.scan_config = cfg
        idx.add(x, ids)
        check_search(idx, x, ids, None, q, 10)


def test_fused_final_top_k_matches_the_merge_launch():
    """A single query's final top-k selected by the scan's last program (fused) equals the
    separate merge launch's, bit for bit, for every metric, with a survivor overflow (skip
    off: every candidate passes) and a scope; the ticket and the state are reset after each."""
    from kalos.index.kernels import KEY_NONE, ScanConfig

    rng = np.random.default_rng(12)
    dim, n = 64, 400
    x = rng.standard_normal((n, dim)).astype(np.float32)
    ids = np.arange(n, dtype=np.int64) + 5
    scopes = np.stack([rng.integers(1, 3, n)] * 3, axis=1).astype(np.int64)
    q = rng.standard_normal((1, dim)).astype(np.float32)
    for metric, skip in (("ip", True), ("ip", False), ("cosine", True), ("l2", True)):
        got = []
        for fused in (True, False):
            idx = make_index(metric, "fp16", dim, "cpu")
            idx.scan_config = ScanConfig(
                block_n=32, num_warps=4, num_stages=1, use_dot=False, skip=skip,
                programs_per_sm=6, fused=fused,
            )  # fmt: skip
            idx.add(x, ids, scopes)
            for scope in (None, (1, 0, 0)):
                got.append(idx.search(q, 10, scope=scope))
                ws = idx._workspace(1, 10)
                thr, slots, _ = ws["state"]
                assert int(ws["ticket"][0]) == 0
                assert int(thr[0]) == KEY_NONE and bool((slots[0] == KEY_NONE).all())
            check_search(idx, x, ids, scopes, q, 10, scope=(1, 0, 0))
        for a, b in zip(got[:2], got[2:], strict=True):
            np.testing.assert_array_equal(a[1], b[1], err_msg=f"{metric} skip={skip}")
            np.testing.assert_array_equal(a[0], b[0])


@pytest.mark.parametrize("lanes", [8, 16])
def test_a_batch_selected_in_more_lanes_than_queries(lanes):
    """A batch of 2 or 3 queries whose selection runs in 8 or 16 lanes (the lanes past the
    batch masked out: they must neither add rows nor raise a bound) gives each query its
    exact top-k, with and without a scope."""
    from kalos.index.kernels import scan_topk

    rng = np.random.default_rng(31)
    dim, n = 64, 700
    x = rng.standard_normal((n, dim)).astype(np.float32)
    ids = np.arange(n, dtype=np.int64) + 3
    scopes = np.stack([rng.integers(1, 3, n)] * 3, axis=1).astype(np.int64)
    for metric in ("ip", "l2"):
        idx = make_index(metric, "fp16", dim, "cpu")
        idx.scan_config = scan_topk.choose_config(dim, 2, 2, 10, False).replace(lanes=lanes)
        idx.add(x, ids, scopes)
        for nq in (2, 3):
            assert scan_topk.select_lanes(nq, idx.scan_config) == lanes
            q = rng.standard_normal((nq, dim)).astype(np.float32)
            check_search(idx, x, ids, scopes, q, 10)
            check_search(idx, x, ids, scopes, q, 10, scope=(1, 0, 0))


def test_group_bound_needs_k_groups():
    """The skip bound from group bests must take k groups: here the best 8 rows lie one per
    group 0..7 and the 9th and 10th in a program that runs last (the interpreter runs programs
    in order), so a bound over fewer groups would skip them."""
    from kalos.index.kernels import ScanConfig

    dim, bn, programs = 64, 16, 24
    rng = np.random.default_rng(10)
    x = rng.standard_normal((900, dim)).astype(np.float32)
    for p in range(8):
        x[p * bn + 3, 0] = 100 - p  # program p's first tile
    x[23 * bn + 5, 0] = 90  # program 23: tiles 23 and 47
    x[47 * bn + 5, 0] = 89
    q = np.zeros((1, dim), dtype=np.float32)
    q[0, 0] = 1
    ids = np.arange(900, dtype=np.int64) + 1
    idx = make_index("ip", "fp16", dim, "cpu")
    idx.scan_config = ScanConfig(
        block_n=bn, num_warps=4, num_stages=1, use_dot=True, skip=True, programs_per_sm=programs
    )
    idx.add(x, ids)
    _, got = idx.search(q, 10)
    assert {23 * bn + 6, 47 * bn + 6} <= set(got[0].tolist())
    check_search(idx, x, ids, None, q, 10)


def _key(score: float, row: int) -> int:
    """The kernels' int64 key of (fp32 score, row)."""
    bits = int(np.array([score], dtype=np.float32).view(np.int32)[0])
    return ((bits if bits >= 0 else bits ^ 0x7FFFFFFF) << 32) | int(row)


def _race_index(nq: int):
    """ip fp16, 900 rows, 24 programs of 16-row tiles: 384 candidates a query (> SURV = 256)."""
    from kalos.index.kernels import ScanConfig

    rng = np.random.default_rng(21)
    dim = 64
    x = rng.standard_normal((900, dim)).astype(np.float32)
    ids = np.arange(900, dtype=np.int64) + 1  # row = id - 1
    idx = make_index("ip", "fp16", dim, "cpu")
    idx.scan_config = ScanConfig(
        block_n=16, num_warps=4, num_stages=1, use_dot=True, skip=True, programs_per_sm=24
    )
    idx.add(x, ids)
    q = rng.standard_normal((nq, dim)).astype(np.float32)
    return idx, x, ids, q


@pytest.mark.parametrize("nq", [1, 2])
def test_scan_exact_whatever_was_published_before_it(nq):
    """The scan's skip reads bounds that other programs publish while it runs; on the GPU a
    program (or one warp of it) may see any of them: none yet, or every other program's. The
    interpreter runs programs one after another, so here the state is seeded before the scan:
    stale (nothing published), the strongest valid bound (just below the true k-th key), a
    weaker one, and different ones for the two rows of a batch. The answer is the same."""
    from kalos.index.kernels import KEY_NONE

    k = 10
    idx, x, ids, q = _race_index(nq)
    s_ref, i_ref = idx.search(q, k)
    kth = [_key(s_ref[r, k - 1], i_ref[r, k - 1] - 1) for r in range(nq)]
    weak = [_key(s_ref[r, k - 1] - 1.0, 0) for r in range(nq)]
    seeds = [[KEY_NONE] * nq, [c - 1 for c in kth], weak]
    if nq == 2:
        seeds += [[kth[0] - 1, KEY_NONE], [KEY_NONE, kth[1] - 1]]
    qt = torch.from_numpy(q)
    thr, slots, _ = idx._workspace(nq, k)["state"]
    for seed in seeds:
        for r in range(nq):
            thr[r] = seed[r]
            slots[r, :k] = seed[r]
        scores = torch.full((nq, k), float("nan"))
        got = torch.full((nq, k), -7, dtype=torch.int64)
        idx.search_device(qt, k, out=(scores, got))
        np.testing.assert_array_equal(got.numpy(), i_ref, err_msg=f"seed {seed}")
        np.testing.assert_array_equal(scores.numpy(), s_ref)
        assert (thr[:nq] == KEY_NONE).all() and (slots[:nq] == KEY_NONE).all(), "not reset"
    check_search(idx, x, ids, None, q, k)


def test_merge_compaction_across_chunks_and_overflow():
    """merge_topk keeps the candidates at or above the final bound (a prefix sum, chunk by
    chunk) and sorts those; with more than SURV it sorts every candidate. Same answer for any
    valid bound and any chunk size: the scan's own bound, none (384 candidates: overflow),
    exactly the top k, and 40 survivors spread over many 16-key chunks."""
    from kalos.index.kernels import KEY_NONE
    from kalos.index.kernels import scan_topk as st

    k = 10
    idx, _, _, q = _race_index(1)
    s_ref, i_ref = idx.search(q, k)
    qt = torch.from_numpy(q)
    ws = idx._workspace(1, k)
    thr, slots, surv = ws["state"]
    cand = ws["cand"]
    st.scan_topk(
        idx._vecs, idx._sq, idx._scopes, idx._no_filter, qt, idx._n_dev, ws["state"], cand,
        k=k, metric=0, scoped=False, programs=ws["programs"], cfg=ws["cfg"],
    )  # fmt: skip
    left = (thr.clone(), slots.clone())
    flat = cand.view(1, -1)
    assert flat.shape[1] == 384
    srt = torch.sort(flat[0], descending=True).values
    kth = _key(s_ref[0, k - 1], i_ref[0, k - 1] - 1)
    assert int(srt[k - 1]) == kth
    states = [left, KEY_NONE, kth - 1, int(srt[39]) - 1]
    for chunk in (16, 64, None):
        for seed in states:
            if isinstance(seed, tuple):
                thr.copy_(seed[0])
                slots.copy_(seed[1])
            else:
                thr.fill_(seed)
                slots.fill_(seed)
            surv.fill_(-5)  # stale scratch: never read beyond what this merge wrote
            scores = torch.full((1, k), float("nan"))
            got = torch.full((1, k), -7, dtype=torch.int64)
            st.merge_topk(
                flat, ws["state"], idx._ids, qt, scores, got, k=k, metric=0, select=True,
                chunk=chunk,
            )  # fmt: skip
            np.testing.assert_array_equal(got.numpy(), i_ref, err_msg=f"{chunk} {seed}")
            np.testing.assert_array_equal(scores.numpy(), s_ref)
            assert int(thr[0]) == KEY_NONE and (slots[0] == KEY_NONE).all()


def test_k_1024_and_more_than_n():
    rng = np.random.default_rng(3)
    idx = make_index("cosine", "fp16", 64, "cpu")
    x = rng.standard_normal((1100, 64)).astype(np.float32)
    ids = np.arange(1100, dtype=np.int64)
    idx.add(x, ids)
    q = rng.standard_normal((1, 64)).astype(np.float32)
    check_search(idx, x, ids, None, q, 1024)
    idx2 = make_index("ip", "fp16", 64, "cpu")
    idx2.add(x[:700], ids[:700])
    check_search(idx2, x[:700], ids[:700], None, q, 1024)


def test_scope_filter_is_applied_in_kernel():
    rng = np.random.default_rng(4)
    n, dim = 500, 64
    idx = make_index("ip", "fp16", dim, "cpu")
    x = rng.standard_normal((n, dim)).astype(np.float32)
    ids = np.arange(n, dtype=np.int64) + 1000
    scopes = np.stack(
        [rng.integers(1, 3, n), rng.integers(1, 4, n), rng.integers(1, 6, n)], axis=1
    ).astype(np.int64)
    idx.add(x, ids, scopes)
    q = rng.standard_normal((2, dim)).astype(np.float32)
    for scope in [(1, 0, 0), (2, 3, 0), (1, 2, 4), (0, 0, 5), (9, 0, 0)]:
        check_search(idx, x, ids, scopes, q, 10, scope=scope)
    check_search(idx, x, ids, scopes, q, 10, scope=(0, 0, 0))


def test_remove_and_upsert():
    rng = np.random.default_rng(5)
    n, dim = 400, 64
    idx = make_index("ip", "fp16", dim, "cpu")
    x = rng.standard_normal((n, dim)).astype(np.float32)
    ids = np.arange(n, dtype=np.int64) * 2 + 1
    scopes = np.zeros((n, 3), dtype=np.int64)
    idx.add(x, ids, scopes)
    q = rng.standard_normal((1, dim)).astype(np.float32)
    _, best = idx.search(q, 20)
    gone = np.concatenate([best[0, :10], ids[:50], [999_999]])  # the best, the first rows, unknown
    removed = idx.remove(gone)
    assert removed == len(set(gone.tolist())) - 1
    keep = ~np.isin(ids, gone)
    assert len(idx) == keep.sum()
    s, got = idx.search(q, 20)
    assert not np.isin(got, gone).any()
    check_search(idx, x[keep], ids[keep], scopes[keep], q, 20)
    with pytest.raises(NotFound):
        idx.reconstruct(gone[:1])
    assert idx.remove(gone) == 0
    # upsert: an existing id gets a new vector (in place), the last one in a batch wins
    x2 = x[keep].copy()
    ids2 = ids[keep]
    target = ids2[7]
    new_vec = (5 * q[0] / np.linalg.norm(q[0])).astype(np.float32)
    idx.add(
        np.stack([rng.standard_normal(dim), new_vec]).astype(np.float32),
        np.array([target, target], dtype=np.int64),
    )
    x2[7] = new_vec
    assert len(idx) == keep.sum()
    s, got = idx.search(q, 5)
    assert got[0, 0] == target
    check_search(idx, x2, ids2, None, q, 5)
    np.testing.assert_allclose(idx.reconstruct([target])[0], new_vec, rtol=1e-3, atol=1e-3)
    d_ids, d_vecs, d_scopes = idx.dump()
    order = np.argsort(d_ids)
    ref_order = np.argsort(ids2)
    np.testing.assert_array_equal(d_ids[order], ids2[ref_order])
    np.testing.assert_allclose(d_vecs[order], x2[ref_order], rtol=1e-3, atol=2e-3)
    assert d_scopes.shape == (len(ids2), 3)
    idx.reset()
    assert len(idx) == 0
    s, got = idx.search(q, 3)
    assert (got == -1).all() and (s == -np.inf).all()


def test_growth_keeps_contents():
    rng = np.random.default_rng(6)
    dim = 64
    idx = make_index("l2", "fp16", dim, "cpu")
    xs, all_ids = [], []
    for step in range(3):
        x = rng.standard_normal((700, dim)).astype(np.float32)
        ids = np.arange(700, dtype=np.int64) + 10_000 * step
        gen = idx.generation
        idx.add(x, ids)
        xs.append(x)
        all_ids.append(ids)
        if step == 1:
            assert idx.generation != gen  # 1400 rows outgrew the first 1024
    assert idx.capacity >= 2100
    q = rng.standard_normal((1, dim)).astype(np.float32)
    check_search(idx, np.concatenate(xs), np.concatenate(all_ids), None, q, 10)


def test_graph_api_on_cpu_runs_the_same_search():
    rng = np.random.default_rng(7)
    dim = 64
    idx = make_index("ip", "fp16", dim, "cpu")
    x = rng.standard_normal((300, dim)).astype(np.float32)
    ids = np.arange(300, dtype=np.int64)
    scopes = np.stack([np.ones(300), rng.integers(1, 3, 300), np.zeros(300)], 1).astype(np.int64)
    idx.add(x, ids, scopes)
    g = idx.graph(1, 10, scope_active=True)
    q = rng.standard_normal((1, dim)).astype(np.float32)
    g.query.copy_(torch.from_numpy(q))
    g.scope.copy_(torch.tensor([1, 2, 0]))
    g.scores.fill_(float("nan"))
    g.replay()
    s_ref, i_ref = idx.search(q, 10, scope=(1, 2, 0))
    np.testing.assert_array_equal(g.ids.numpy(), i_ref)
    np.testing.assert_allclose(g.scores.numpy(), s_ref)
    # an add within capacity: same graph, sees the new row
    best = (4 * q[0] / np.linalg.norm(q[0])).astype(np.float32)
    idx.add(best[None], np.array([5000], dtype=np.int64), np.array([[1, 2, 9]]))
    g.replay()
    assert g.ids[0, 0].item() == 5000
    # replay_and_wait (the sidecar's: a driver launch on the GPU) runs the same search
    g.ids.fill_(-7)
    g.replay_and_wait(None)
    assert g.ids[0, 0].item() == 5000


# ------------------------------------------------------------------------ the int8 prefilter


def test_prefilter_meta_bounds_every_product_in_float64():
    # the bound the re-rank's proof rests on, against exact products: with the fp32 query
    # (|q.x - scale c.q| <= |q| e1) and with the query in int8 too (+ |q - s_q q8| e2)
    from kalos.index.kernels import scan_topk as kern

    rng = np.random.default_rng(3)
    for dim, mag in ((64, 1.0), (300, 1e-3), (1024, 50.0)):
        x = torch.from_numpy(rng.standard_normal((500, dim)).astype(np.float32) * mag).half()
        x[3] = 0  # an all-zero row
        x[4] = 0
        x[4, 7] = 2 * mag  # one-hot
        codes, meta = kern.prefilter_meta(x)
        assert codes.dtype == torch.int8 and meta.shape == (3, 500)
        xd, c = x.double().numpy(), codes.double().numpy()
        sc, e1, e2 = meta.double().numpy()
        assert np.abs(c).max() <= 127 and (np.abs(c).max(axis=1)[5:] == 127).all()
        assert e1[4] <= 1e-3 * mag  # a one-hot row is coded exactly (up to the slack)
        for q in rng.standard_normal((20, dim)):
            true = xd @ q
            qn = np.linalg.norm(q)
            assert np.all(np.abs(true - sc * (c @ q)) <= qn * e1)
            qs = np.abs(q).max() / 127
            q8 = np.clip(np.round(q / qs), -127, 127)
            rq = np.linalg.norm(q - qs * q8)
            assert np.all(np.abs(true - sc * qs * (c @ q8)) <= qn * e1 + rq * e2)


@pytest.mark.parametrize(
    "metric,dtype,dim,n,k",
    [
        ("ip", "fp16", 64, 700, 10),
        ("cosine", "bf16", 96, 500, 7),
        ("l2", "fp32", 128, 400, 1),
        ("ip", "fp16", 256, 300, 32),
    ],
)
def test_prefilter_graph_matches_float64_reference(metric, dtype, dim, n, k):
    rng = np.random.default_rng(hash((metric, dtype, dim, n, k)) % 2**32)
    idx = make_index(metric, dtype, dim, "cpu")
    x = rng.standard_normal((n, dim)).astype(np.float32)
    ids = rng.permutation(10 * n)[:n].astype(np.int64) + 1
    idx.add(x, ids)
    q = rng.standard_normal((3, dim)).astype(np.float32)
    g = check_graph_search(idx, x, ids, None, q, k)
    # random rows: the bound proves each search, so none replays the full scan
    assert g.prefilter and g.fallbacks == 0


def test_prefilter_scope_removals_upserts_and_few_matches():
    rng = np.random.default_rng(21)
    dim, n = 64, 500
    idx = make_index("ip", "fp16", dim, "cpu")
    x = rng.standard_normal((n, dim)).astype(np.float32)
    ids = np.arange(n, dtype=np.int64) + 1
    scopes = np.stack(
        [rng.integers(1, 3, n), rng.integers(1, 4, n), rng.integers(1, 40, n)], 1
    ).astype(np.int64)
    idx.add(x, ids, scopes)
    gone = rng.choice(ids, 120, replace=False)
    idx.remove(gone)
    moved = rng.choice(np.setdiff1d(ids, gone), 30, replace=False)  # upserted in place
    x[moved - 1] = rng.standard_normal((30, dim)).astype(np.float32)
    idx.add(x[moved - 1], moved, scopes[moved - 1])
    live = np.isin(ids, gone, invert=True)
    q = rng.standard_normal((2, dim)).astype(np.float32)
    lx, lids, lsc = x[live], ids[live], scopes[live]
    g = check_graph_search(idx, lx, lids, lsc, q, 10, scope=(1, 2, 0))
    assert g.fallbacks == 0
    # a scope matching fewer rows than the candidates: all of them are, proven without a bound
    t, u, sess = (int(v) for v in lsc[0])
    assert ((lsc == (t, u, sess)).all(1)).sum() < 32
    g = check_graph_search(idx, lx, lids, lsc, q, 10, scope=(t, u, sess))
    assert g.fallbacks == 0


def test_an_unproven_prefilter_search_settles_from_its_bounds():
    # near-copies of the query's direction: the candidates' bounds overlap the k-th exact
    # score, so the search is not proven; it settles from every row's bound (the rows whose
    # bound reaches the re-ranked k-th score, scored exactly), and the answer is the exact one
    dim = 64
    x, ids, base = unprovable_rows(np.random.default_rng(5), dim)
    idx = make_index("ip", "fp32", dim, "cpu")
    idx.add(x, ids)
    g = check_graph_search(idx, x, ids, None, base[None], 10)
    assert g.prefilter and g.fallbacks == 1
    assert (idx.prefilter_searches, idx.prefilter_fallbacks) == (1, 1)  # the metrics' counts
    # the near-copies are left open, the random rows are not
    assert 10 <= g.settled_rows < 400 and idx.prefilter_settled_rows == g.settled_rows
    ws = g._ws[1]
    assert int(ws["count"][0]) == 0 and int(ws["emit_ticket"][0]) == 0  # reset for the next
    assert int(ws["floor"][0][0]) == idx._k.KEY_NONE
    # a random query is proven: nothing settled
    q = np.random.default_rng(6).standard_normal((1, dim)).astype(np.float32)
    g = check_graph_search(idx, x, ids, None, q, 10)
    assert g.fallbacks == 0 and (idx.prefilter_searches, idx.prefilter_fallbacks) == (2, 1)


def test_a_gated_prefilter_search_settles_behind_its_scan_and_publishes():
    # the doorbell's armed graph queues the prefilter's pass behind a gate, and the settle
    # behind that, gated on the scan's verdict: a closed gate runs nothing, a proven search
    # does not settle, an unproven one settles, is exact and stores its sequence number
    dim = 64
    x, ids, base = unprovable_rows(np.random.default_rng(5), dim)
    idx = make_index("ip", "fp32", dim, "cpu")
    idx.add(x, ids)
    idx.prefilter_min_rows = 0
    seq, dest = torch.tensor([41], dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    g = SearchGraph(idx, 1, 10, False, prefilter=True, publish=(seq, dest))
    q = np.random.default_rng(6).standard_normal((1, dim)).astype(np.float32)
    g.query.copy_(torch.from_numpy(q))
    assert g.replay_and_wait(None) and int(dest[0]) == 41  # proven: the prefilter's workspace
    gate, settle_gate = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    tally = torch.zeros(2, dtype=torch.int64)

    def queued(query: np.ndarray, open_: bool, s: int) -> None:
        g.query.copy_(torch.from_numpy(query))
        g.scores.fill_(0)
        gate[0], seq[0] = int(open_), s
        g.queue_gated(gate, settle_gate, tally)

    queued(base[None], False, 42)  # closed: nothing ran, nothing stored
    assert int(dest[0]) == 41 and float(g.scores.abs().sum()) == 0 and tally.tolist() == [0, 0]
    queued(q, True, 43)  # proven by the scan: published, not settled
    assert int(dest[0]) == 43 and int(settle_gate[0]) == 0 and tally.tolist() == [0, 0]
    check_result(idx, x, ids, None, q, 10, g.scores.numpy(), g.ids.numpy())
    queued(base[None], True, 44)  # unproven: settled behind the scan, then published
    assert int(dest[0]) == 44 and int(settle_gate[0]) == 1
    check_result(idx, x, ids, None, base[None], 10, g.scores.numpy(), g.ids.numpy())
    assert tally[0] == 1 and 10 <= tally[1] < 400
    ws = g._ws[1]
    assert int(ws["count"][0]) == 0 and int(ws["emit_ticket"][0]) == 0  # reset for the next
    queued(q, True, 45)  # and the next proven one is unaffected
    assert int(dest[0]) == 45 and tally[0] == 1
    check_result(idx, x, ids, None, q, 10, g.scores.numpy(), g.ids.numpy())


def test_the_settle_floor_is_the_reranked_kth_exact_score():
    # rows along the query's direction, a step apart in score (well above the reference's
    # tolerance, well below the int8 bound): the prefilter cannot prove the top-10, and the
    # floor it leaves for the settle must be the 10th best score itself, no higher (a row of
    # the top-k would be left out) and no lower (more rows than needed scored again)
    rng = np.random.default_rng(9)
    dim, k = 64, 10
    base = rng.standard_normal(dim).astype(np.float32)
    steps = 1.0 + 1.5e-4 * np.arange(150, dtype=np.float32)[:, None]
    x = np.concatenate([base * steps, rng.standard_normal((250, dim)).astype(np.float32)])
    ids = np.arange(1, 401, dtype=np.int64)
    idx = make_index("ip", "fp32", dim, "cpu")
    idx.add(x, ids)
    idx.prefilter_min_rows = 0
    g = idx.graph(1, k, prefilter=True)
    g.query.copy_(torch.from_numpy(base[None]))
    g._ensure(True)
    g._run(True)  # the prefilter alone: its verdict and the floor
    assert g._status_np[0] == 0, "the bound proved the top-10: make the steps smaller"
    key = int(g._ws[1]["floor"][0][0])
    hi = np.int32(key >> 32)
    floor = np.array([hi if hi >= 0 else hi ^ 0x7FFFFFFF], np.int32).view(np.float32)[0]
    ref = np.sort(x.astype(np.float64) @ base.astype(np.float64))[::-1]
    tol = 1e-3 * float(base @ base)  # a step is 1.5e-4 |base|^2 x 64 rows
    assert abs(floor - ref[k - 1]) <= tol / 10, (floor, ref[k - 1], ref[k - 2])


@pytest.mark.parametrize("metric", ["ip", "l2", "cosine"])
def test_settling_with_ties_duplicates_and_a_scope(metric):
    # rows tied with the k-th (exact duplicates of one near-copy), a scope filter keeping
    # half the rows, and rows differing only below fp16's precision: every unproven search
    # still returns the exact top-k of the rows its scope keeps
    rng = np.random.default_rng(8)
    dim = 48
    x, ids, base = unprovable_rows(rng, dim)
    x[160:190] = x[5]  # 30 exact duplicates of a near-copy
    x[200:210] = x[6] + np.float32(1e-5)  # below fp16's precision
    scopes = np.stack([np.full(400, 1), rng.integers(1, 3, 400), np.zeros(400)], 1)
    idx = make_index(metric, "fp16", dim, "cpu")
    idx.add(x, ids, scopes.astype(np.int64))
    for scope in (None, (1, 2, 0)):
        for k in (1, 10, 32):
            g = check_graph_search(idx, x, ids, scopes, base[None], k, scope=scope)
            assert g.prefilter
    assert idx.prefilter_fallbacks >= 1 and idx.prefilter_settled_rows > 0


def test_prefilter_publishes_the_sequence_once_proven_or_settled():
    # publish=(seq, dest): a proven prefilter search stores seq into dest (the response's
    # sequence word of a channel, on a GPU), the results already written, and so does the
    # settle of an unproven one; the full scan (below prefilter_min_rows) leaves dest alone
    # (the sidecar publishes then)
    rng = np.random.default_rng(8)
    dim = 64
    x, ids, base = unprovable_rows(rng, dim)
    idx = make_index("ip", "fp32", dim, "cpu")
    idx.add(x, ids)
    idx.prefilter_min_rows = 0
    seq = torch.zeros(1, dtype=torch.int64)
    dest = torch.zeros(1, dtype=torch.int64)
    g = SearchGraph(idx, 1, 10, False, prefilter=True, publish=(seq, dest))
    assert g.publish is not None
    far = rng.standard_normal(dim).astype(np.float32)  # random: proven
    for i, q in enumerate([far, -far], start=41):
        seq[0] = i
        g.query.copy_(torch.from_numpy(q[None]))
        g.ids.fill_(-7)
        assert g.replay_and_wait(None) is True
        assert int(dest[0]) == i and not (g.ids == -7).any()
        check_result(idx, x, ids, None, q[None], 10, g.scores.numpy(), g.ids.numpy())
    seq[0] = 99  # the near-copies' direction: not proven, its settle answers
    g.query.copy_(torch.from_numpy(base[None]))
    g.ids.fill_(-7)
    assert g.replay_and_wait(None) is True
    assert int(dest[0]) == 99 and g.fallbacks == 1 and g.settled_rows >= 10
    check_result(idx, x, ids, None, base[None], 10, g.scores.numpy(), g.ids.numpy())
    idx.prefilter_min_rows = len(x) + 1  # the full scan answers
    seq[0] = 100
    g.ids.fill_(-7)
    assert g.replay_and_wait(None) is False
    assert int(dest[0]) == 99 and not (g.ids == -7).any()
    check_result(idx, x, ids, None, base[None], 10, g.scores.numpy(), g.ids.numpy())
    # a graph without the prefilter has nothing to publish with; the full scan refuses it
    assert SearchGraph(idx, 1, 10, False, publish=(seq, dest)).publish is None
    ws = idx._workspace(1, 10)
    with pytest.raises(ValueError, match="publish needs the prefilter"):
        idx._launch(g.query, 10, idx._no_filter, False, g.scores, g.ids, ws, None, (seq, dest))


def test_prefilter_only_where_it_applies():
    idx = make_index("ip", "fp16", 64, "cpu")
    idx.add(np.random.default_rng(0).standard_normal((40, 64)), np.arange(40))
    assert idx.graph(1, 10, prefilter=True).prefilter
    assert not idx.graph(1, 10).prefilter  # asked for
    assert not idx.graph(2, 10, prefilter=True).prefilter  # batches scan the rows
    assert not idx.graph(1, 33, prefilter=True).prefilter  # k above PREFILTER_MAX_K
    with pytest.raises(InvalidRequest, match="replay_and_wait"):
        idx.graph(1, 10, prefilter=True).replay()
    # below prefilter_min_rows a prefiltered graph runs the full scan: no verdict is written,
    # and the prefilter's workspace (and, on a GPU, its graph) is not even made
    g = idx.graph(1, 10, prefilter=True)
    g._status_np[0] = 7
    g.replay_and_wait(None)
    assert g._status_np[0] == 7 and g.fallbacks == 0 and len(g._ws) == 1
    assert g.cuda_graph is None and g.prefilter_cuda_graph() is None  # the CPU: no graphs
    assert len(g._ws) == 2
    with pytest.raises(InvalidRequest, match="no prefilter"):
        idx.graph(1, 10).prefilter_cuda_graph()
    idx.prefilter_min_rows = 40
    g.query.copy_(torch.ones((1, 64)))
    g.replay_and_wait(None)
    assert g._status_np[0] == 1 and g.fallbacks == 0
    narrow = make_index("ip", "fp16", 16, "cpu")  # an int8 dot operand needs dim >= 32
    assert not narrow.graph(1, 10, prefilter=True).prefilter
    from kalos.index.cuda_flat import CudaFlatIndex

    # int8 codes where their bound grows too loose to pay; the default takes the 4-bit
    # cascade there instead (tests/index/test_codes4_interp.py)
    wide = CudaFlatIndex(dim=384, metric="ip", spec="cuda:flat,scan=int8", device="cpu",
                         scan="int8")  # fmt: skip
    assert not wide.graph(1, 10, prefilter=True).prefilter
    assert make_index("ip", "fp16", 384, "cpu").graph(1, 10, prefilter=True).prefilter

    full = CudaFlatIndex(dim=64, metric="ip", spec="cuda:flat,fp16,scan=full", device="cpu",
                         scan="full")  # fmt: skip
    assert not full.graph(1, 10, prefilter=True).prefilter
    assert full.nbytes < idx.nbytes


def test_validation_errors():
    idx = make_index("ip", "fp16", 64, "cpu")
    x = np.ones((2, 64), dtype=np.float32)
    with pytest.raises(InvalidRequest):
        idx.add(np.ones((2, 63), dtype=np.float32), np.array([1, 2]))
    with pytest.raises(InvalidRequest):
        idx.add(np.full((2, 64), np.nan, dtype=np.float32), np.array([1, 2]))
    with pytest.raises(InvalidRequest):
        idx.add(x, np.array([1, -1]))
    with pytest.raises(InvalidRequest):
        idx.add(x, np.array([1, 2, 3]))
    with pytest.raises(InvalidRequest):
        idx.add(x * 1e6, np.array([1, 2]))  # beyond fp16
    with pytest.raises(InvalidRequest):
        idx.add(x, np.array([1, 2]), np.zeros((2, 2), dtype=np.int64))
    idx.add(x, np.array([1, 2]))
    for bad_k in (0, 1025, -3, 2.5):
        with pytest.raises(InvalidRequest):
            idx.search(x[:1], bad_k)
    with pytest.raises(InvalidRequest):
        idx.search(np.ones((1, 65), dtype=np.float32), 1)
    with pytest.raises(InvalidRequest):
        idx.search(np.array([[np.inf] * 64], dtype=np.float32), 1)
    with pytest.raises(InvalidRequest):
        idx.search(x[:1], 1, scope=(1, 2))
    assert idx.search(x[0], 1)[1].shape == (1, 1)  # a 1-D query is a batch of one


@pytest.mark.parametrize("metric", ["ip", "cosine"])
def test_host_arrays_are_checked_as_device_tensors_are(metric):
    """Small host arrays (queries) are validated on the host, before one upload; tensors
    and large arrays on the device: both refuse the same inputs and give the same rows."""
    idx = make_index(metric, "fp16", 64, "cpu")
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3, 64)) * 7).astype(np.float32)
    bad = {
        "NaN or inf": np.where(np.arange(64) == 5, np.nan, x[0]).astype(np.float32)[None],
        "must be \\[n, 64\\]": x[:, :63],
    }
    if metric == "ip":
        bad["fp16's range"] = x * 1e5
    for message, v in bad.items():
        for given in (v, torch.from_numpy(np.ascontiguousarray(v))):
            with pytest.raises(InvalidRequest, match=message):
                idx._vectors_in(given, "vectors")
            if "fp16" in message:
                with pytest.raises(InvalidRequest, match="query values exceed fp16"):
                    idx.device_queries(given)
    host = idx._vectors_in(x, "vectors")
    device = idx._vectors_in(torch.from_numpy(x), "vectors")
    np.testing.assert_allclose(host.numpy(), device.numpy(), rtol=1e-6, atol=1e-7)
    assert idx._vectors_in(x[0], "q").shape == (1, 64)
    with pytest.raises(InvalidRequest, match="numeric"):
        idx._vectors_in(np.array([["a"] * 64]), "queries")


def test_reference_helper_sanity():
    # the checker must be able to fail: a wrong answer is caught
    rng = np.random.default_rng(8)
    x = rng.standard_normal((50, 16)).astype(np.float32)
    q = rng.standard_normal((1, 16)).astype(np.float32)
    ref = ref_scores("ip", "fp16", x, q)
    assert ref.shape == (1, 50)


@pytest.mark.parametrize("lists", [16, 8, 2])
def test_prefilter_with_lists_shorter_than_the_rows_kept(lists):
    # lists of `lists` rows a program, 32 rows kept: the proof must also clear the rows
    # pushed off a program's list; the top rows crowded into one program's tiles test that
    rng = np.random.default_rng(40 + lists)
    dim, n = 64, 900
    idx = make_index("ip", "fp16", dim, "cpu")
    idx.prefilter_lists = lists
    x = rng.standard_normal((n, dim)).astype(np.float32)
    q = rng.standard_normal((1, dim)).astype(np.float32)
    x[:40] = (3 + 0.05 * np.arange(40))[:, None] * q / np.linalg.norm(q)  # one tile's worth
    x[:40] += 0.01 * rng.standard_normal((40, dim)).astype(np.float32)
    ids = rng.permutation(n).astype(np.int64) + 1
    idx.add(x, ids)
    g = check_graph_search(idx, x, ids, None, np.concatenate([q, x[500:502]]), 10)
    assert g._ws[1]["cand"].shape[2] == lists
    if lists == 16:
        assert g.fallbacks == 0  # random rows elsewhere: proven


def test_prefilter_lists_default_shortens_with_a_program_per_kept_row():
    # the default list length: all the rows kept with few programs (the CPU's), a quarter of
    # them (8 for keep 32) once there is a program per kept row, as on a GPU from ~100K rows
    from kalos.index.kernels import scan_topk as kern

    assert [kern.prefilter_lists(32, p) for p in (4, 31, 32, 264)] == [32, 32, 8, 8]
    assert kern.prefilter_lists(64, 264) == 16
    rng = np.random.default_rng(77)
    dim, n = 64, 1100
    idx = make_index("ip", "fp16", dim, "cpu")
    idx.prefilter_config = kern.ScanConfig(
        block_n=16, num_warps=4, num_stages=1, use_dot=True, programs_per_sm=64
    )
    x = rng.standard_normal((n, dim)).astype(np.float32)
    ids = rng.permutation(n).astype(np.int64) + 1
    idx.add(x, ids)
    q = rng.standard_normal((2, dim)).astype(np.float32)
    g = check_graph_search(idx, x, ids, None, q, 10)
    assert g._ws[1]["programs"] == 64 and g._ws[1]["cand"].shape[2] == 8
    assert g.fallbacks == 0  # random rows: proven with lists of 8


@pytest.mark.parametrize("prefilter", [False, True])
def test_trace_counts_every_tile_and_marks_the_last_program(prefilter):
    # kernels.scan_topk's trace (the phases probe's): every program's tiles walked add up to
    # the index's tiles, at most those are merged and at least the first, and the last
    # program's row names one of them; the search's answer is unchanged
    rng = np.random.default_rng(11)
    dim, n, k = 64, 700, 10
    x = rng.standard_normal((n, dim)).astype(np.float32)
    ids = np.arange(n) * 3
    idx = make_index("ip", "fp32", dim, "cpu")
    idx.add(x, ids)
    ws = idx._workspace(1, k, private=True, prefilter=prefilter)
    p = ws["programs"]
    bn = max(ws["cfg"].block_n, ws["cand"].shape[2])
    status = torch.zeros(1, dtype=torch.int32)
    q = torch.from_numpy(x[:1] + 0.1)
    scores = torch.empty((1, k), dtype=torch.float32)
    out = torch.empty((1, k), dtype=torch.int64)
    idx.trace = torch.full((p + 1, 8), -1, dtype=torch.int64)
    idx._launch(q, k, idx._no_filter, False, scores, out, ws, status if prefilter else None)
    t = idx.trace.numpy()
    assert t[:p, 3].sum() == -(-n // bn)  # every tile walked once
    assert ((t[:p, 2] >= 1) & (t[:p, 2] <= t[:p, 3])).all()  # the first tile is always merged
    assert (t[:p, [0, 1, 4, 5]] == 0).all()  # no clocks under the interpreter
    assert 0 <= t[p, 3] < p
    assert (t[p, :3] == (0 if prefilter else -1)).all()  # the prefilter's phases only
    if prefilter:
        assert int(status[0]) == 1
    check_result(idx, x, ids, None, q.numpy(), k, scores.numpy(), out.numpy())
    idx.trace = torch.zeros((p + 2, 8), dtype=torch.int64)
    with pytest.raises(ValueError, match="trace must be"):
        idx._launch(q, k, idx._no_filter, False, scores, out, ws, status if prefilter else None)


def test_bound_replicas_raise_and_reset_every_copy():
    """ScanConfig.bound_replicas: copies of the scan's bounds, replica r read in a program's r-th
    round of tiles. Every merge raises every copy, so the skip decides as with one copy (the
    interpreter runs programs in turn: the tiles merged are the same), the answer is the same
    bit for bit, and the final selection resets every copy (single queries fused, with and
    without the prefilter; a batch through merge_topk)."""
    from kalos.index.kernels import KEY_NONE
    from kalos.index.kernels import scan_topk as kern

    rng = np.random.default_rng(31)
    dim, n, k = 64, 1200, 10
    x = rng.standard_normal((n, dim)).astype(np.float32)
    ids = np.arange(n, dtype=np.int64) + 5
    q = rng.standard_normal((3, dim)).astype(np.float32)
    runs = {}
    for reps in (1, 4):
        idx = make_index("ip", "fp32", dim, "cpu")
        idx.add(x, ids)
        idx.scan_config = kern.choose_config(dim, 4, 1, k, False).replace(bound_replicas=reps)
        pre = kern.choose_prefilter_config(dim, False)
        idx.prefilter_config = pre.replace(bound_replicas=reps)
        for prefilter, nq in ((False, 1), (True, 1), (False, 3)):
            ws = idx._workspace(nq, k, private=True, prefilter=prefilter)
            assert ws["replicas"] == reps and ws["state"][0].shape[0] == reps * nq
            p = ws["programs"]
            idx.trace = torch.zeros((p + 1, 8), dtype=torch.int64) if nq == 1 else None
            status = torch.zeros(1, dtype=torch.int32)
            scores = torch.full((nq, k), float("nan"))
            got = torch.full((nq, k), -7, dtype=torch.int64)
            st = status if prefilter else None
            idx._launch(torch.from_numpy(q[:nq]), k, idx._no_filter, False, scores, got, ws, st)
            check_result(idx, x, ids, None, q[:nq], k, scores.numpy(), got.numpy())
            thr, slots, _ = ws["state"]
            assert (thr == KEY_NONE).all() and (slots == KEY_NONE).all(), "a copy not reset"
            merged = None if idx.trace is None else idx.trace[:p, 2].clone()
            runs[reps, prefilter, nq] = (scores, got, merged)
            idx.trace = None
    for key in [key for key in runs if key[0] == 4]:
        one = runs[(1, *key[1:])]
        for a, b in zip(runs[key], one, strict=True):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), key
    with pytest.raises(ValueError, match="replicas must be a power of two"):
        ws = idx._workspace(1, k, private=True)
        qt = torch.from_numpy(q[:1])
        kern.scan_topk(
            idx._vecs, idx._sq, idx._scopes, idx._no_filter, qt, idx._n_dev, ws["state"],
            ws["cand"], k=k, metric=0, scoped=False, programs=ws["programs"],
            cfg=ws["cfg"].replace(bound_replicas=3),
        )  # fmt: skip
