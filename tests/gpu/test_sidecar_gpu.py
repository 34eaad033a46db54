"""A ``--device cuda`` sidecar end to end: host results, GPU-result handoff over CUDA IPC,
GPU queries, scope filters, removes; every result against an exact float64 reference.

Run on a CUDA machine: ``pytest -m gpu tests/gpu``. Skipped without CUDA.
"""

from __future__ import annotations

# isort: off
from cuda_device import torch

# isort: on

import numpy as np
import pytest

import kalos
from kalos.testing import isolated_sidecar

pytestmark = pytest.mark.gpu

DIM = 64
N = 20_000


def exact_topk(base16: np.ndarray, q: np.ndarray, k: int, mask: np.ndarray | None = None):
    """Scores and positions of the exact top-k in float64 over the fp16-rounded vectors."""
    s = base16.astype(np.float64) @ q.astype(np.float64)
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    order = np.argsort(-s, kind="stable")[:k]
    return s[order], order


def assert_same_topk(got_ids, got_scores, ids, base16, q, k, mask=None) -> None:
    """The exact top-k up to ties, against the float64 reference of the query as given or as
    rounded to fp16: a single query is scored with the fp32 query, but requests of several
    channels served as one batch are scored in the storage dtype (at 64 dims that moves a
    score by up to ~0.01, more than the tolerance of a tie). Every returned id scores at
    least the k-th best, and the scores are the returned rows'."""
    pos = {int(i): p for p, i in enumerate(ids)}
    rows = np.array([pos[int(i)] for i in got_ids])
    failures = []
    for qr in (q, q.astype(np.float16).astype(np.float32)):
        want, _ = exact_topk(base16, qr, k, mask)
        got = base16[rows].astype(np.float64) @ qr.astype(np.float64)
        try:
            assert np.all(got >= want[-1] - 1e-3), (got, want[-1])
            np.testing.assert_allclose(np.sort(got)[::-1], want, rtol=2e-3, atol=2e-3)
            np.testing.assert_allclose(np.asarray(got_scores, np.float64), got, rtol=2e-3,
                                       atol=2e-2)  # fmt: skip
            return
        except AssertionError as exc:
            failures.append(exc)
    raise AssertionError(f"not the top-{k} of the query, as given nor rounded: {failures}")


@pytest.fixture(scope="module")
def gpu_sidecar():
    rng = np.random.default_rng(5)
    base = rng.standard_normal((N, DIM)).astype(np.float32)
    ids = rng.choice(10**9, N, replace=False).astype(np.int64)
    with isolated_sidecar(dim=DIM, name="gpu-test", extra_args=("--device", "cuda")) as sc:
        client = sc.connect(gpu_results=True, timeout=120)
        half = N // 2
        client.add(base[:half], ids[:half], [f"t{i}" for i in ids[:half]],
                   scope=kalos.Scope("acme"))  # fmt: skip
        client.add(base[half:], ids[half:], scope=kalos.Scope("globex", "u1"))
        yield sc, client, base.astype(np.float16), ids
        client.close()


@pytest.mark.parametrize("k", [1, 10, 100])
def test_host_results_match_exact(gpu_sidecar, k):
    _, client, base16, ids = gpu_sidecar
    rng = np.random.default_rng(k)
    for _ in range(5):
        q = rng.standard_normal(DIM).astype(np.float32)
        r = client.search(q, k)
        assert_same_topk(r.ids, r.scores, ids, base16, q, k)
        assert len(r.payloads) == k


def test_gpu_results_are_cuda_tensors_matching_host(gpu_sidecar):
    _, client, base16, ids = gpu_sidecar
    rng = np.random.default_rng(1)
    for _ in range(5):
        q = rng.standard_normal(DIM).astype(np.float32)
        g = client.search_gpu(q, 10)
        assert g.ids.is_cuda and g.scores.is_cuda and g.payloads is None
        got_ids, got_scores = g.ids.cpu().numpy(), g.scores.cpu().numpy()
        assert_same_topk(got_ids, got_scores, ids, base16, q, 10)
        h = client.search(q, 10, payloads=False)
        assert set(h.ids.tolist()) == set(got_ids.tolist())


def test_gpu_query_never_leaves_the_gpu(gpu_sidecar):
    _, client, base16, ids = gpu_sidecar
    rng = np.random.default_rng(2)
    q = rng.standard_normal((3, DIM)).astype(np.float32)
    g = client.search_gpu(torch.from_numpy(q).cuda(), 10)
    assert tuple(g.ids.shape) == (3, 10)
    for row in range(3):
        assert_same_topk(g.ids[row].cpu().numpy(), g.scores[row].cpu().numpy(), ids, base16,
                         q[row], 10)  # fmt: skip


def test_scope_filter_on_gpu(gpu_sidecar):
    _, client, base16, ids = gpu_sidecar
    q = np.random.default_rng(3).standard_normal(DIM).astype(np.float32)
    mask = np.zeros(N, bool)
    mask[N // 2 :] = True
    for r in (client.search(q, 10, scope=kalos.Scope("globex", "u1")),):
        assert_same_topk(r.ids, r.scores, ids, base16, q, 10, mask)
    g = client.search_gpu(q, 10, scope=kalos.Scope("globex"))
    assert set(g.ids.cpu().numpy().tolist()) <= set(ids[N // 2 :].tolist())
    none = client.search(q, 10, scope=kalos.Scope("nobody"))
    assert (none.ids == -1).all()


def test_remove_then_search_on_gpu(gpu_sidecar):
    """Removed rows are never returned; then they are added back as they were, since the
    module's later tests hold every answer against all N rows."""
    _, client, base16, ids = gpu_sidecar
    q = base16[7].astype(np.float32) * 4
    top = client.search(q, 5, payloads=False).ids.copy()
    assert client.remove(top[:2]) == 2
    after = client.search_gpu(q, 5).ids.cpu().numpy()
    assert not set(top[:2].tolist()) & set(after.tolist())
    rows = np.flatnonzero(np.isin(ids, top[:2]))
    for row in rows:  # each with its own scope (and payload), as the fixture added it
        vector = base16[row : row + 1].astype(np.float32)
        if row < N // 2:
            client.add(vector, ids[row : row + 1], [f"t{ids[row]}"], scope=kalos.Scope("acme"))
        else:
            client.add(vector, ids[row : row + 1], scope=kalos.Scope("globex", "u1"))
    assert set(top[:2].tolist()) <= set(client.search(q, 5, payloads=False).ids.tolist())


def test_bad_gpu_requests_are_refused_and_serving_goes_on(gpu_sidecar):
    sc, client, _, _ = gpu_sidecar
    with pytest.raises(kalos.InvalidRequest):
        client.search_gpu(torch.zeros(DIM + 1, device="cuda"), 10)
    with pytest.raises(kalos.InvalidRequest):
        client.search_gpu(np.full(DIM, np.nan, np.float32), 10)
    plain = sc.connect()
    with pytest.raises(kalos.ConfigError):
        plain.search_gpu(np.zeros(DIM, np.float32), 10)
    assert plain.ping().total_us > 0
    plain.close()
    assert client.search_gpu(np.ones(DIM, np.float32), 3).ids.shape[0] == 3


def test_in_place_results_through_the_registered_arena(gpu_sidecar):
    """payloads=False: the merge kernel writes the top-k straight into each channel's
    registered response arena. Exact for batches and k of several shapes, on several
    channels at once, across reconnects (each channel unregisters its arena when it closes),
    and the same answers over uds (no registration: copied from staging)."""
    import threading

    sc, client, base16, ids = gpu_sidecar
    errors_before = client.stats()["errors"]
    rng = np.random.default_rng(11)
    qs = rng.standard_normal((8, DIM)).astype(np.float32)
    for nq, k in ((1, 1), (1, 10), (3, 10), (8, 64), (2, 1024)):
        r = client.search(qs[:nq], k, payloads=False)
        assert r.ids.shape == (nq, k) and r.payloads is None
        for i in range(nq):
            assert_same_topk(r.ids[i], r.scores[i], ids, base16, qs[i], k)
        # a scoped search of the same shape takes its own graph and sees only its scope
        s = client.search(qs[:nq], k, payloads=False, scope=kalos.Scope("globex", "u1"))
        assert set(s.ids.ravel().tolist()) <= set(ids[N // 2 :].tolist()) | {-1}
    want = client.search(qs, 10, payloads=False, copy=True)
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            for _ in range(n):  # a fresh channel (and registration) each round
                with sc.connect(timeout=60) as c:
                    for _ in range(20):
                        r = c.search(qs, 10, payloads=False)
                        np.testing.assert_array_equal(r.ids, want.ids)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(5,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    with sc.connect(transport="uds", timeout=60) as u:
        np.testing.assert_array_equal(u.search(qs, 10, payloads=False).ids, want.ids)
    assert client.stats()["errors"] == errors_before


def test_batches_run_ahead_on_the_gpu_and_stay_exact(gpu_sidecar):
    """Callers on 16 channels at once: their searches batch, and each batch's pass runs on the
    GPU while the poller decodes the next (``batches_run_ahead``). Every answer exact."""
    import threading

    sc, client, base16, ids = gpu_sidecar
    before = client.stats()
    errors: list[BaseException] = []

    def caller(t: int) -> None:
        try:
            rng = np.random.default_rng(100 + t)
            with sc.connect(timeout=60) as c:
                for r in range(40):
                    q = rng.standard_normal(DIM).astype(np.float32)
                    k = (1, 10, 10, 100)[(t + r) % 4]
                    got = c.search(q, k, payloads=False, copy=True)
                    assert_same_topk(got.ids, got.scores, ids, base16, q, k)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=caller, args=(t,)) for t in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    after = client.stats()
    assert after["batches_run_ahead"] > before["batches_run_ahead"], after
    assert after["errors"] == before["errors"]
