"""cuda:ivf on a CUDA GPU: the tests of tests/index/test_ivf.py's kind at larger sizes, with
the fp16 first pass the GPU takes, and a ``--device cuda`` sidecar serving it with a bulk
load and per-request nprobe.

Run on a CUDA machine: ``pytest -m gpu tests/gpu/test_cuda_ivf_gpu.py``. Skipped without CUDA.
"""

from __future__ import annotations

# isort: off
from cuda_device import torch

# isort: on

import numpy as np
import pytest

from kalos.index import create
from kalos.testing import check_index, check_search, isolated_sidecar

pytestmark = pytest.mark.gpu

DIM = 128


def clustered(n: int, seed: int, clusters: int = 200) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((clusters, DIM)).astype(np.float32)
    x = centres[rng.integers(0, clusters, n)] + 0.3 * rng.standard_normal((n, DIM))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def items_of(index) -> dict:
    ids, vectors, scopes = index.dump()
    return {
        int(i): (v, (int(s[0]), int(s[1]), int(s[2])))
        for i, v, s in zip(ids, vectors, scopes, strict=True)
    }


def recall(got: np.ndarray, want: np.ndarray) -> float:
    return sum(len(set(g) & set(w)) for g, w in zip(got.tolist(), want.tolist(), strict=True)) / (
        want.size
    )


def test_the_index_contract_on_the_gpu() -> None:
    check_index("cuda:ivf,nlist=4,nprobe=4", rtol=2e-3)


@pytest.mark.parametrize("metric", ["ip", "cosine", "l2"])
def test_recall_and_every_list_exact_at_200k(metric: str) -> None:
    x = clustered(200_000, 1)
    index = create("cuda:ivf,nlist=512,nprobe=16", dim=DIM, metric=metric)
    assert index.device.type == "cuda"
    for lo in range(0, len(x), 50_000):  # trains at 19,968 rows, retrains at 4x
        index.add(x[lo : lo + 50_000], np.arange(lo, lo + 50_000))
    index.flush()
    assert index.trainings == 2 and int(index.list_sizes().sum()) == len(x)
    exact = create("cpu:flat", dim=DIM, metric=metric)
    exact.add(x, np.arange(len(x)))
    q = clustered(200, 2)
    want = exact.search(q, 10)[1]
    assert recall(index.search(q, 10)[1], want) >= 0.9
    for i in range(0, 200, 40):  # one query at a time: the path without a padding mask
        assert recall(index.search(q[i], 10)[1], want[i : i + 1]) >= 0.5
    few = q[:20]  # the reference checks score every row in float64: 20 queries suffice
    check_search(index.search(few, 10, nprobe=512), items_of(index), few, 10, metric, rtol=2e-3)
    index.remove(np.arange(0, len(x), 3))
    got = index.search(q, 10, nprobe=512)
    assert not (np.isin(got[1], np.arange(0, len(x), 3))).any()
    check_search((got[0][:20], got[1][:20]), items_of(index), few, 10, metric, rtol=2e-3)


def test_large_vectors_rank_in_fp32_first() -> None:
    """Inner products beyond fp16's range: the first pass runs in fp32, the answer is exact."""
    x = clustered(20_000, 3) * 400.0
    index = create("cuda:ivf,nlist=64,nprobe=64", dim=DIM)
    index.add(x, np.arange(len(x)))
    q = clustered(20, 4) * 400.0
    check_search(index.search(q, 10), items_of(index), q, 10, "ip", rtol=2e-3)


def test_a_cuda_sidecar_serves_cuda_ivf_with_a_bulk_load(tmp_path) -> None:
    x = clustered(100_000, 5)
    np.save(tmp_path / "v.npy", x)
    exact = create("cpu:flat", dim=DIM)
    exact.add(x, np.arange(len(x)))
    q = clustered(50, 6)
    want = exact.search(q, 10)[1]
    args = ("--device", "cuda", "--index", "cuda:ivf,nlist=256,nprobe=1",
            "--load", str(tmp_path / "v.npy"))  # fmt: skip
    with (
        isolated_sidecar(dim=DIM, name="gpu-ivf", extra_args=args) as sidecar,
        sidecar.connect(timeout=120) as client,
    ):
        assert client.stats()["items"] == len(x)
        one = client.search(q, 10, payloads=False, copy=True).ids
        full = client.search(q, 10, nprobe=256, payloads=False, copy=True).ids
        assert recall(one, want) < recall(full, want)
        assert recall(full, want) >= 0.99  # fp16 rows: near-ties may swap
    torch.cuda.synchronize()


def test_single_queries_replay_graphs_that_answer_as_the_eager_steps() -> None:
    x = clustered(200_000, 7)
    index = create("cuda:ivf,nlist=512,nprobe=16", dim=DIM)
    index.add(x, np.arange(len(x)))
    index.flush()
    q = clustered(64, 8)
    graphed = [index.search(q[i], 10, nprobe=p) for p in (1, 16, 64) for i in range(len(q))]
    assert index.graphs and index._graphs is not None  # captured, checked, still in use
    assert {key[0] for key in index._graphs._graphs} == {1, 16, 64}
    index.graphs = False
    eager = [index.search(q[i], 10, nprobe=p) for p in (1, 16, 64) for i in range(len(q))]
    for (gs, gi), (es, ei) in zip(graphed, eager, strict=True):
        np.testing.assert_array_equal(gi, ei)
        np.testing.assert_allclose(gs, es, rtol=1e-6)
    kernels = index._ivf_keys, index._topk_small
    index._ivf_keys = index._topk_small = None  # the same steps in torch: gather, product, topk
    in_torch = [index.search(q[i], 10, nprobe=p) for p in (1, 16, 64) for i in range(len(q))]
    index._ivf_keys, index._topk_small = kernels
    for (gs, gi), (ts, ti) in zip(graphed, in_torch, strict=True):
        np.testing.assert_array_equal(gi, ti)
        np.testing.assert_allclose(gs, ts, rtol=1e-5)
    # a write drops out of the graphs' steady state; the next merge recaptures
    index.graphs = True
    index.add(clustered(10, 9), np.arange(len(x), len(x) + 10))
    got = index.search(q[0], 10, nprobe=512)
    assert got[1].shape == (1, 10) and index.graphs
