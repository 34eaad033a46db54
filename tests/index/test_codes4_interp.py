"""The 4-bit cascade (``scan=4bit``, kalos.index.kernels.codes4) on the CPU, under
TRITON_INTERPRET=1: every answer against the float64 reference of tests/cuda_reference.py, on
data made to be hard for a compressed scan -- anisotropic and clustered rows, rows tied with
the k-th, every row in one tight cluster, rows that differ only below fp16's precision -- and
through every way in (search_device, a search graph, scope filters, upserts and removes, a
refit of the mean). Small sizes: the interpreter runs each program in Python.
"""

from __future__ import annotations

# isort: off
from triton_interp import torch, triton  # noqa: F401  (first: sets TRITON_INTERPRET)

# isort: on

import numpy as np
import pytest

from cuda_reference import (
    anisotropic,
    check_dp4a,
    check_graph_search,
    check_result,
    check_search,
    stored_vectors,
)
from kalos.index import cuda_flat
from kalos.index.cuda_flat import CudaFlatIndex
from kalos.index.kernels import codes4


def cascade_index(metric: str, dim: int, dtype: str = "fp16") -> CudaFlatIndex:
    idx = CudaFlatIndex(dim=dim, metric=metric, spec=f"cuda:flat,{dtype},scan=4bit",
                        device="cpu", dtype=dtype, scan="4bit")  # fmt: skip
    idx.prefilter_min_rows = 0  # the cascade at any size (it pays from ~1M rows on)
    return idx


def candidates(idx: CudaFlatIndex, k: int) -> int:
    return int(idx._workspaces[(1, k, True)]["status"][1])


@pytest.mark.parametrize(
    "metric,dim,n,k",
    [
        ("ip", 384, 420, 10),
        ("cosine", 96, 500, 7),
        ("l2", 200, 360, 16),
        ("ip", 64, 300, 1),
        ("ip", 768, 300, 10),
        ("cosine", 1536, 260, 10),
    ],
)
def test_cascade_matches_float64_reference(metric, dim, n, k):
    rng = np.random.default_rng(dim + n + k)
    idx = cascade_index(metric, dim)
    x = anisotropic(rng, n, dim)
    ids = rng.permutation(10 * n)[:n].astype(np.int64) + 1
    idx.add(x, ids)
    assert idx._fit_n == 0  # below CODES4_FIT_ROWS: not centred yet, still exact
    for q in anisotropic(rng, 2, dim):
        check_search(idx, x, ids, None, q, k)
        assert 0 < candidates(idx, k) <= n


@pytest.mark.parametrize(("dtype", "metric", "dim"), [("bf16", "cosine", 768), ("fp32", "l2", 320)])
def test_cascade_is_exact_over_bf16_and_fp32_rows(dtype, metric, dim):
    """The codes are made from the stored rows in any storage dtype, and the exact pass scores
    those rows: the answer is the exact scan's over them (the reference rounds as they do)."""
    rng = np.random.default_rng(len(dtype) + dim)
    idx = cascade_index(metric, dim, dtype)
    x = anisotropic(rng, 300, dim)
    ids = np.arange(1, 301, dtype=np.int64) * 7
    idx.add(x, ids)
    for q in anisotropic(rng, 2, dim):
        check_search(idx, x, ids, None, q, 10)
        check_graph_search(idx, x, ids, None, q, 10)
        assert 0 < candidates(idx, 10) <= 300


def test_cascade_is_the_default_from_257_to_1536_dims():
    cases = (
        (256, "int8"),
        (257, "4bit"),
        (384, "4bit"),
        (768, "4bit"),
        (1536, "4bit"),
        (1537, "int8"),
    )
    for dim, scan in cases:
        idx = CudaFlatIndex(dim=dim, metric="ip", spec="cuda:flat", device="cpu")
        assert idx.scan == scan, dim


def test_refit_centres_on_the_mean_and_stays_exact(monkeypatch):
    monkeypatch.setattr(cuda_flat, "CODES4_FIT_ROWS", 200)
    rng = np.random.default_rng(3)
    dim = 128
    idx = cascade_index("ip", dim)
    x = anisotropic(rng, 520, dim)
    ids = np.arange(1, 521, dtype=np.int64)
    idx.add(x[:150], ids[:150])
    assert idx._fit_n == 0
    idx.add(x[150:260], ids[150:260])  # 260 >= 200: fitted
    assert idx._fit_n == 260
    idx.add(x[260:], ids[260:])  # 520 >= 2 * 260: fitted again, every row encoded anew
    assert idx._fit_n == 520
    stored = stored_vectors("ip", "fp16", x)
    np.testing.assert_allclose(idx._mean64.numpy(), stored.mean(axis=0), atol=1e-9)
    # centring on the mean tightens the bounds on data with a strong mean direction
    for q in anisotropic(rng, 2, dim):
        check_search(idx, x, ids, None, q, 10)


def test_ties_with_the_kth_one_cluster_and_sub_fp16_differences():
    rng = np.random.default_rng(11)
    dim = 300
    base = rng.standard_normal(dim).astype(np.float32)
    # 60 exact copies (tied with the k-th), 100 rows closer to base than fp16 can tell apart,
    # and 200 rows of one tight cluster around it
    ties = np.repeat(base[None], 60, axis=0)
    sub = base + 1e-6 * rng.standard_normal((100, dim)).astype(np.float32)
    cluster = base + 1e-2 * rng.standard_normal((200, dim)).astype(np.float32)
    x = np.concatenate([ties, sub, cluster])
    ids = rng.permutation(len(x)).astype(np.int64) + 1
    idx = cascade_index("ip", dim)
    idx.add(x, ids)
    check_search(idx, x, ids, None, base, 10)
    check_search(idx, x, ids, None, base + 0.05 * rng.standard_normal(dim).astype(np.float32), 64)
    check_search(idx, x, ids, None, -base, 10)


def test_scope_filter_upserts_and_removes():
    rng = np.random.default_rng(5)
    dim, n = 272, 400
    idx = cascade_index("cosine", dim)
    x = anisotropic(rng, n, dim)
    ids = np.arange(1, n + 1, dtype=np.int64)
    scopes = np.stack([rng.integers(1, 3, n), rng.integers(1, 4, n), np.zeros(n)], 1)
    scopes = scopes.astype(np.int64)
    idx.add(x, ids, scopes)
    # upsert a third in place, remove another third: the last rows fill the holes
    up = rng.choice(n, n // 3, replace=False)
    x[up] = anisotropic(rng, len(up), dim)
    idx.add(x[up], ids[up], scopes[up])
    gone = rng.choice(np.setdiff1d(np.arange(n), up), n // 3, replace=False)
    assert idx.remove(ids[gone]) == len(gone)
    live = np.setdiff1d(np.arange(n), gone)
    for q in anisotropic(rng, 1, dim):
        check_search(idx, x[live], ids[live], scopes[live], q, 10)
        check_search(idx, x[live], ids[live], scopes[live], q, 10, scope=(2, 0, 0))
        check_search(idx, x[live], ids[live], scopes[live], q, 5, scope=(1, 3, 0))
        check_search(idx, x[live], ids[live], scopes[live], q, 5, scope=(9, 0, 0))  # no match


def test_graph_runs_the_cascade_and_resets_its_state():
    rng = np.random.default_rng(8)
    dim, n = 320, 360
    idx = cascade_index("ip", dim)
    x = anisotropic(rng, n, dim)
    ids = np.arange(1, n + 1, dtype=np.int64)
    idx.add(x, ids)
    # several searches through one graph: each starts from the state the last one reset
    g = check_graph_search(idx, x, ids, None, anisotropic(rng, 3, dim), 10)
    assert g.fallbacks == 0
    assert idx.prefilter_searches == 3 and idx.prefilter_fallbacks == 0
    assert 0 < int(g._status_np[1]) <= n  # the candidates of the last search
    ws = g._ws[1]
    assert int(ws["count"][0]) == 0 and int(ws["emit_ticket"][0]) == 0
    assert bool((ws["state"][0] == codes4.KEY_NONE).all())


def test_the_bounds_hold_for_every_row():
    """The lower and upper bound of every row bracket its exact score (the proof's premise),
    on rows of very different norms and a query of a large norm."""
    rng = np.random.default_rng(21)
    dim, n = 384, 300
    x = anisotropic(rng, n, dim) * rng.uniform(0.01, 50, (n, 1)).astype(np.float32)
    idx = cascade_index("ip", dim)
    idx.add(x, np.arange(1, n + 1))
    q = (anisotropic(rng, 1, dim) * 30).astype(np.float32)
    ws = idx._workspace(1, 10, prefilter=True)
    qt = torch.from_numpy(q)
    scores = torch.empty(1, 10)
    out = torch.empty(1, 10, dtype=torch.int64)
    idx._launch(qt, 10, idx._no_filter, False, scores, out, ws)
    stored = stored_vectors("ip", "fp16", x)
    exact = stored @ q[0].astype(np.float64)
    upper = ws["upper"][:n].double().numpy()
    width = ws["qf"][1].item() * idx._meta[1, :n].double().numpy()
    assert np.all(upper >= exact), "an upper bound below the exact score"
    assert np.all(upper - 2 * width <= exact), "a lower bound above the exact score"


def test_the_bounds_dot_without_ptx_is_the_byte_dot():
    """The bounds pass's four-byte dot in plain integer ops (where there is no PTX: the
    interpreter) against numpy; tests/gpu/test_codes4_gpu.py holds PTX's dp4a to the same."""
    check_dp4a("cpu", ptx=False)


@pytest.mark.parametrize("programs", [1, 3, 64])
def test_emit_lists_every_live_row_whose_bound_reaches_the_floor(programs):
    # the emit's programs stride over the live rows' blocks (fewer programs than blocks:
    # each takes several; more: some take none), below the capacity; the last one resets
    # the state; a closed gate lists nothing and keeps the state
    rng = np.random.default_rng(programs)
    cap, n, k = 5 * 1024 + 300, 4 * 1024 + 77, 10
    upper = torch.from_numpy(rng.standard_normal(cap).astype(np.float32))
    upper[rng.integers(0, n, 40)] = float("-inf")  # rows filtered out: never listed
    floor = 0.8
    key = np.array([floor], np.float32).view(np.int32).astype(np.int64)[0] << 32
    gw = codes4.key_width(k)
    thr = torch.tensor([key], dtype=torch.int64)
    none = codes4.KEY_NONE
    slots = torch.full((1, gw), none, dtype=torch.int64)
    count = torch.zeros(1, dtype=torch.int32)
    rows = torch.zeros(cap, dtype=torch.int32)
    ticket = torch.zeros(1, dtype=torch.int32)
    n_dev = torch.tensor([n], dtype=torch.int32)
    gate = torch.zeros(1, dtype=torch.int32)
    codes4.emit(upper, n_dev, (thr, slots), count, rows, ticket, k=k, replicas=1,
                programs=programs, gate=gate)  # fmt: skip
    assert int(count[0]) == 0 and int(thr[0]) == key
    gate[0] = 1
    codes4.emit(upper, n_dev, (thr, slots), count, rows, ticket, k=k, replicas=1,
                programs=programs, gate=gate)  # fmt: skip
    u = upper.numpy()[:n]
    want = np.flatnonzero((u >= floor) & np.isfinite(u))
    got = np.sort(rows.numpy()[: int(count[0])])
    np.testing.assert_array_equal(got, want)
    assert int(thr[0]) == none and int(ticket[0]) == 0


def test_graphs_share_the_row_scratch_and_stay_exact_interleaved():
    """Every graph of an index reads one copy of the rows' bounds and open rows (O(k) of
    device memory a graph, not O(rows)): searches of different shapes in turn stay exact, a
    scoped one after an unscoped one included (each rewrites every live row's bound, -inf
    where filtered out, before reading it)."""
    rng = np.random.default_rng(31)
    dim, n = 288, 420
    idx = cascade_index("ip", dim)
    x = anisotropic(rng, n, dim)
    ids = np.arange(1, n + 1, dtype=np.int64) * 5
    scopes = np.stack([rng.integers(1, 3, n), rng.integers(1, 5, n), np.zeros(n, int)], 1)
    idx.add(x, ids, scopes)
    qs = anisotropic(rng, 3, dim)
    for q in qs:
        wide = check_graph_search(idx, x, ids, scopes, q, 10)
        narrow = check_graph_search(idx, x, ids, scopes, q, 5, scope=(2, 3, 0))
        check_search(idx, x, ids, scopes, q, 7, scope=(1, 0, 0))
        one = check_graph_search(idx, x, ids, scopes, q, 1)
    graphs_ws = [g._ws[1] for g in (wide, narrow, one)]
    for name in ("upper", "rows"):
        assert len({ws[name].data_ptr() for ws in graphs_ws}) == 1, name
    assert (
        idx._workspace(1, 10, prefilter=True)["upper"].data_ptr() == wide._ws[1]["upper"].data_ptr()
    )
    # storage that moves takes fresh scratch, and the graphs recapture onto it
    idx.reserve(4 * n)
    check_graph_search(idx, x, ids, scopes, qs[0], 10, scope=(1, 2, 0))
    assert idx._workspace(1, 10, prefilter=True)["upper"].shape == (idx._cap,)


@pytest.mark.parametrize("listed", [0, 1, 30, 130, 600])
def test_the_exact_pass_over_few_and_many_listed_rows(listed):
    # the cascade's exact pass scores the listed rows alone: fewer tiles than programs (only
    # those with a tile list and are merged), as many or more (every program), none at all;
    # twice in a row on one workspace, each time resetting the count and the ticket
    rng = np.random.default_rng(listed)
    dim, n, k = 96, 900, 10
    idx = cascade_index("ip", dim)
    x = anisotropic(rng, n, dim)
    idx.add(torch.from_numpy(x), torch.arange(n, dtype=torch.int64) * 7 + 3)
    kern = idx._k
    ex = idx._workspace(1, k, private=True)
    assert ex["programs"] > 1
    rows = torch.zeros(idx._cap, dtype=torch.int32)
    count = torch.zeros(1, dtype=torch.int32)
    status = torch.zeros(2, dtype=torch.int32)
    stored = stored_vectors("ip", "fp16", x)
    for _ in range(2):
        q = rng.standard_normal((1, dim)).astype(np.float32)
        pick = np.sort(rng.choice(n, listed, replace=False)).astype(np.int32)
        rows[:listed] = torch.from_numpy(pick)
        count[0] = listed
        scores = torch.full((1, k), 7.0)
        ids = torch.full((1, k), -2, dtype=torch.int64)
        kern.scan_topk(
            idx._vecs, idx._sq, idx._scopes, idx._no_filter, torch.from_numpy(q), count,
            ex["state"], ex["cand"], k=k, metric=idx._metric_code, scoped=False,
            programs=ex["programs"], cfg=ex["cfg"], final=(ex["ticket"], idx._ids, scores, ids),
            cands=(rows, status),
        )  # fmt: skip
        # the exact pass scores with the fp32 query (on a GPU with FMAs; under the
        # interpreter with the dot, which takes the query's two halves)
        ref = stored[pick] @ q[0].astype(np.float64)
        top = np.argsort(-ref, kind="stable")[:k]
        want = pick[top].astype(np.int64) * 7 + 3
        got = ids.numpy()[0]
        m = min(k, listed)
        np.testing.assert_array_equal(np.sort(got[:m]), np.sort(want[:m]))
        np.testing.assert_allclose(scores.numpy()[0][:m], ref[top][:m], rtol=1e-5, atol=1e-5)
        assert (got[m:] == -1).all() and np.isneginf(scores.numpy()[0][m:]).all()
        assert int(status[0]) == 1 and int(status[1]) == listed
        assert int(count[0]) == 0 and int(ex["ticket"][0]) == 0


def test_the_trace_follows_the_exact_pass():
    # CudaFlatIndex.trace on a cascade: its exact pass's programs (the phases probe's rows):
    # their tiles walked are the listed rows' tiles, only programs with one take part, and
    # the last program's row names one of those; the answer is unchanged
    rng = np.random.default_rng(12)
    dim, n, k = 96, 900, 10
    idx = cascade_index("ip", dim)
    x = anisotropic(rng, n, dim)
    ids = np.arange(n, dtype=np.int64) * 7 + 3
    idx.add(x, ids)
    ws = idx._workspace(1, k, private=True, prefilter=True)
    ex = ws["exact"]
    p = ex["programs"]
    bn = max(ex["cfg"].block_n, ex["cand"].shape[2])
    q = torch.from_numpy(anisotropic(rng, 1, dim))
    scores = torch.empty((1, k), dtype=torch.float32)
    out = torch.empty((1, k), dtype=torch.int64)
    trace = idx.trace = torch.full((p + 1, 8), -1, dtype=torch.int64)
    idx._launch(q, k, idx._no_filter, False, scores, out, ws)
    idx.trace = None
    t = trace.numpy()
    listed = int(ws["status"][1])
    tiles = -(-listed // bn)
    assert 0 < listed <= n and t[:p, 3].sum() == tiles  # every listed row's tile walked once
    assert 0 <= t[p, 3] < max(1, min(p, tiles))  # the last program had a tile
    assert (t[p, :3] == -1).all()  # no select phases: the candidates were scored exactly
    check_result(idx, x, ids, None, q.numpy(), k, scores.numpy(), out.numpy())


@pytest.mark.parametrize("programs", [1, 3])
def test_the_exact_pass_on_fewer_programs_stays_exact(programs):
    # CudaFlatIndex.exact4_programs (the phases probe's launch shapes): the exact pass on a
    # grid of its own, by search and by a search graph
    rng = np.random.default_rng(programs)
    dim, n = 96, 700
    idx = cascade_index("cosine", dim)
    idx.exact4_programs = programs
    x = anisotropic(rng, n, dim)
    ids = np.arange(n, dtype=np.int64) * 5 + 2
    idx.add(x, ids)
    assert idx._workspace(1, 10, private=True, prefilter=True)["exact"]["programs"] == programs
    queries = anisotropic(rng, 3, dim)
    for q in queries[:2]:
        check_search(idx, x, ids, None, q, 10)
    check_graph_search(idx, x, ids, None, queries[2], 10)
