"""Responses the GPU publishes (server.gpu_search.PinnedArena), on a real cuda sidecar with
1M rows: the int8 prefilter runs from ``PREFILTER_MIN_ROWS`` on, and each proven search's
kernel stores the response's sequence word itself. Every answer against an exact reference,
for spinning and parked clients, across writes, beside GPU-result searches (which the
sidecar publishes) on the same channel.

Run on a CUDA machine: ``pytest -m gpu tests/gpu``. Skipped without CUDA.
"""

from __future__ import annotations

# isort: off
from cuda_device import torch

# isort: on

import numpy as np
import pytest

from kalos.index.kernels.scan_topk import PREFILTER_MIN_ROWS
from kalos.testing import isolated_sidecar

pytestmark = pytest.mark.gpu

DIM = 64
N = PREFILTER_MIN_ROWS + 50_000  # above it after the removes below
K = 10


@pytest.fixture(scope="module")
def big_sidecar():
    rng = np.random.default_rng(17)
    base = rng.standard_normal((N, DIM)).astype(np.float32)
    ids = np.arange(N, dtype=np.int64) * 3 + 1
    args = ("--device", "cuda", "--reserve", str(N))
    with isolated_sidecar(dim=DIM, name="gpu-publish", extra_args=args) as sc:
        loader = sc.connect(arena_bytes=64 << 20, timeout=120)
        step = 200_000
        for lo in range(0, N, step):
            loader.add(base[lo : lo + step], ids[lo : lo + step])
        loader.close()
        db = torch.from_numpy(base).cuda().half()
        yield sc, db, ids


def check(db, ids, q: np.ndarray, got_ids: np.ndarray, got_scores: np.ndarray, gone=()) -> None:
    """The exact top-K over the fp16 rows (float32 scores), up to exact ties; ``gone``: ids
    removed since the rows were loaded."""
    s = db.float() @ torch.from_numpy(q).cuda()
    if len(gone):
        s[torch.from_numpy((np.asarray(gone) - 1) // 3).cuda()] = float("-inf")
    want = torch.topk(s, K).values.cpu().numpy()
    assert not set(got_ids.tolist()) & set(gone)
    rows = torch.from_numpy((got_ids - 1) // 3).cuda()
    have = s[rows].cpu().numpy()
    assert np.all(have >= want[-1] - 1e-3), (have, want)
    np.testing.assert_allclose(np.sort(have)[::-1], want, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(got_scores, have, rtol=1e-3, atol=1e-2)


@pytest.mark.parametrize("spin_us", [1000.0, 0.0])
def test_proven_searches_are_published_by_the_kernel(big_sidecar, spin_us):
    sc, db, ids = big_sidecar
    qs = np.random.default_rng(int(spin_us) + 1).standard_normal((300, DIM)).astype(np.float32)
    with sc.connect(spin_us=spin_us, timeout=120) as client:
        client.search(qs[0], K, payloads=False)  # compiles and captures
        before = client.stats()
        for q in qs:
            r = client.search(q, K, payloads=False)
            check(db, ids, q, r.ids, r.scores)
        after = client.stats()
    # random rows: the bound proves (nearly) every search, and each proven one is the GPU's;
    # a parked client (spin 0) is woken by the poller after its sync
    published = after["gpu_published"] - before["gpu_published"]
    assert 290 <= published <= len(qs)
    assert after["errors"] == before["errors"]


def test_writes_and_gpu_results_between_published_searches(big_sidecar):
    sc, db, ids = big_sidecar
    qs = np.random.default_rng(5).standard_normal((20, DIM)).astype(np.float32)
    gone: list[int] = []
    with sc.connect(gpu_results=True, spin_us=1000, timeout=120) as client:
        before = client.stats()["gpu_published"]
        for q in qs:
            r = client.search(q, K, payloads=False, copy=True)
            check(db, ids, q, r.ids, r.scores, gone)
            g = client.search_gpu(q, K)  # GPU results: the sidecar publishes those
            assert set(g.ids.cpu().numpy().tolist()) == set(r.ids.tolist())
            assert client.remove(r.ids[:1]) == 1
            gone.append(int(r.ids[0]))
            r = client.search(q, K, payloads=False)
            check(db, ids, q, r.ids, r.scores, gone)
        assert client.stats()["gpu_published"] - before >= 2 * len(qs) - 2
        rows = torch.tensor([(i - 1) // 3 for i in gone]).cuda()
        client.add(db[rows].float().cpu().numpy(), np.array(gone, dtype=np.int64))
