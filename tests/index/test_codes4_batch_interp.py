"""The batched 4-bit cascade (kalos.index.kernels.codes4_batch: batches of 2 to
``batch4_max_batch`` queries on a ``scan=4bit`` index) on the CPU, under TRITON_INTERPRET=1:
every answer against the float64 reference of tests/cuda_reference.py, on data made to be hard
for a compressed scan (anisotropic clusters, rows tied with the k-th, one tight cluster, rows
that differ only below fp16's precision), through the device path and a search graph, with
scope filters, upserts, removes and a refit of the mean. Small sizes: the interpreter runs each
program in Python.
"""

from __future__ import annotations

# isort: off
from triton_interp import torch, triton  # noqa: F401  (first: sets TRITON_INTERPRET)

# isort: on

import numpy as np
import pytest

from cuda_reference import anisotropic, check_result, check_search, stored_vectors
from kalos.index import cuda_flat
from kalos.index.cuda_flat import CudaFlatIndex
from kalos.index.kernels import codes4_batch


def cascade_index(metric: str, dim: int) -> CudaFlatIndex:
    idx = CudaFlatIndex(dim=dim, metric=metric, spec="cuda:flat,fp16,scan=4bit", device="cpu",
                        scan="4bit")  # fmt: skip
    idx.batch4_max_batch = 16  # batches of 2 to 16 through the batched cascade
    return idx


def listed(idx: CudaFlatIndex, nq: int, k: int) -> list[int]:
    ws = idx._workspaces[(nq, k, False)]
    assert ws.get("codes4_batch"), "the batch did not take the batched cascade"
    return ws["listed"][:nq].tolist()


def test_which_batches_take_the_batched_cascade():
    default = CudaFlatIndex(dim=384, metric="ip", spec="cuda:flat", device="cpu")
    assert default.batch4_max_batch == cuda_flat.BATCH4_MAX_BATCH
    idx = cascade_index("ip", 384)
    assert [nq for nq in range(1, 40) if idx._batch4(nq, 10)] == list(range(2, 17))
    assert not idx._batch4(4, 65)  # k above the batch lists' 64
    idx.batch4_max_batch = 64
    assert idx._batch4(64, 10) and not idx._batch4(65, 10)
    idx.batch4_max_batch = 0  # never
    assert not idx._batch4(2, 10)
    int8 = CudaFlatIndex(dim=128, metric="ip", spec="cuda:flat", device="cpu")
    assert int8.scan == "int8" and not int8._batch4(4, 10)


def test_the_spec_sets_the_largest_batch(monkeypatch):
    monkeypatch.setattr(cuda_flat, "parse_spec", lambda spec: ("cpu", "fp16", "4bit", 4))
    idx = CudaFlatIndex.from_spec("cuda:flat,scan=4bit,batch4=4", dim=300, metric="ip")
    assert idx.batch4_max_batch == 4 and idx._batch4(4, 10) and not idx._batch4(5, 10)


@pytest.mark.parametrize(
    "metric,dim,n,nq,k",
    [
        ("ip", 384, 500, 3, 10),
        ("cosine", 96, 420, 2, 7),
        ("l2", 200, 360, 5, 16),
        ("ip", 64, 300, 8, 1),
        ("ip", 768, 300, 4, 10),
        ("cosine", 300, 260, 16, 64),
    ],
)
def test_batched_cascade_matches_float64_reference(metric, dim, n, nq, k):
    rng = np.random.default_rng(dim + n + nq + k)
    idx = cascade_index(metric, dim)
    x = anisotropic(rng, n, dim)
    ids = rng.permutation(10 * n)[:n].astype(np.int64) + 1
    idx.add(x, ids)
    q = anisotropic(rng, nq, dim)
    check_search(idx, x, ids, None, q, k)
    assert all(min(k, n) <= c <= n for c in listed(idx, nq, k))
    # the same workspace again (its counts and group bests reset by the last launch)
    check_search(idx, x, ids, None, q[::-1].copy(), k)


def test_ties_with_the_kth_one_cluster_and_sub_fp16_differences():
    rng = np.random.default_rng(12)
    dim = 320
    base = rng.standard_normal(dim).astype(np.float32)
    ties = np.repeat(base[None], 60, axis=0)  # 60 exact copies: tied with the k-th
    sub = base + 1e-6 * rng.standard_normal((100, dim)).astype(np.float32)  # below fp16
    cluster = base + 1e-2 * rng.standard_normal((200, dim)).astype(np.float32)
    x = np.concatenate([ties, sub, cluster])
    ids = rng.permutation(len(x)).astype(np.int64) + 1
    idx = cascade_index("ip", dim)
    idx.add(x, ids)
    near = base + 0.05 * rng.standard_normal(dim).astype(np.float32)
    check_search(idx, x, ids, None, np.stack([base, near, -base, base]), 10)
    check_search(idx, x, ids, None, np.stack([near, base]), 64)


def test_scope_filters_upserts_removes_and_few_matches():
    rng = np.random.default_rng(6)
    dim, n = 272, 400
    idx = cascade_index("cosine", dim)
    x = anisotropic(rng, n, dim)
    ids = np.arange(1, n + 1, dtype=np.int64)
    scopes = np.stack([rng.integers(1, 3, n), rng.integers(1, 4, n), np.zeros(n)], 1)
    scopes = scopes.astype(np.int64)
    scopes[:3] = (7, 1, 0)  # three rows alone in tenant 7: fewer than k match
    idx.add(x, ids, scopes)
    up = rng.choice(np.arange(3, n), n // 3, replace=False)
    x[up] = anisotropic(rng, len(up), dim)
    idx.add(x[up], ids[up], scopes[up])
    gone = rng.choice(np.setdiff1d(np.arange(3, n), up), n // 3, replace=False)
    assert idx.remove(ids[gone]) == len(gone)
    live = np.setdiff1d(np.arange(n), gone)
    q = anisotropic(rng, 4, dim)
    xs, ls, ss = x[live], ids[live], scopes[live]
    check_search(idx, xs, ls, ss, q, 10)
    check_search(idx, xs, ls, ss, q, 10, scope=(2, 0, 0))
    check_search(idx, xs, ls, ss, q, 5, scope=(1, 3, 0))
    check_search(idx, xs, ls, ss, q, 10, scope=(7, 0, 0))  # 3 rows: the rest -1
    check_search(idx, xs, ls, ss, q, 5, scope=(9, 0, 0))  # none


def test_refit_of_the_mean_between_batches(monkeypatch):
    monkeypatch.setattr(cuda_flat, "CODES4_FIT_ROWS", 200)
    rng = np.random.default_rng(9)
    dim = 256 + 64
    idx = cascade_index("l2", dim)
    x = anisotropic(rng, 520, dim)
    ids = np.arange(1, 521, dtype=np.int64)
    q = anisotropic(rng, 3, dim)
    idx.add(x[:150], ids[:150])
    check_search(idx, x[:150], ids[:150], None, q, 10)
    idx.add(x[150:], ids[150:])  # fitted, every row encoded anew
    assert idx._fit_n == 520
    check_search(idx, x, ids, None, q, 10)


def test_a_graph_runs_the_batched_cascade_again_and_again():
    rng = np.random.default_rng(4)
    dim, n, nq, k = 384, 360, 4, 10
    idx = cascade_index("ip", dim)
    x = anisotropic(rng, n, dim)
    ids = np.arange(1, n + 1, dtype=np.int64)
    idx.add(x, ids)
    g = idx.graph(nq, k, scope_active=False)
    assert g._ws[0].get("codes4_batch")
    for _ in range(3):
        q = anisotropic(rng, nq, dim)
        g.query.copy_(torch.from_numpy(q))
        g.scores.fill_(float("nan"))
        g.ids.fill_(-7)
        g.replay()
        check_result(idx, x, ids, None, q, k, g.scores.numpy(), g.ids.numpy())
    ws = g._ws[0]
    assert ws["count"].tolist() == [0] * nq  # reset for the next batch
    assert (ws["best"] == -(2**31)).all()
    assert all(0 < c <= n for c in ws["listed"].tolist())


def test_every_listed_set_holds_each_row_whose_bound_reaches_the_kth_score():
    """The bounds pass's upper bounds bracket every row's exact score from above, and the
    emit lists each row whose bound reaches the query's exact k-th score (the proof's
    premise), for rows of very different norms."""
    rng = np.random.default_rng(22)
    dim, n, nq, k = 384, 300, 3, 10
    x = anisotropic(rng, n, dim) * rng.uniform(0.01, 50, (n, 1)).astype(np.float32)
    idx = cascade_index("ip", dim)
    idx.add(x, np.arange(1, n + 1))
    q = (anisotropic(rng, nq, dim) * 30).astype(np.float32)
    ws = idx._workspace(nq, k)
    scores = torch.empty(nq, k)
    out = torch.empty(nq, k, dtype=torch.int64)
    idx._launch(torch.from_numpy(q), k, idx._no_filter, False, scores, out, ws)
    exact = q.astype(np.float64) @ stored_vectors("ip", "fp16", x).T  # [nq, n]
    upper = ws["upper"][:nq, :n].double().numpy()
    assert np.all(upper >= exact), "an upper bound below the exact score"
    kth = -np.sort(-exact, axis=1)[:, k - 1]
    rows = ws["rows"][:nq].numpy()
    for i in range(nq):
        must = set(np.flatnonzero(upper[i] >= kth[i]).tolist())
        assert must <= set(rows[i, : ws["listed"][i]].tolist())


def test_workspace_checks():
    upper = torch.empty(4, 100)
    with pytest.raises(ValueError, match=r"1\.\.64"):
        codes4_batch.workspace(65, 10, 128, upper, upper, False)
    with pytest.raises(ValueError, match=r"\[>= 8, cap\]"):
        codes4_batch.workspace(8, 10, 128, upper, upper.int(), False)
