"""cuda:ivf's probed-row kernel (kalos.index.kernels.ivf_keys) on the CPU, under
TRITON_INTERPRET=1: against a float64 reference of its keys, and the index with the kernel
against the same index in torch. The GPU runs of the same searches are in
tests/gpu/test_cuda_ivf_gpu.py."""

from __future__ import annotations

# isort: off
from triton_interp import torch, triton  # noqa: F401  (first: sets TRITON_INTERPRET)

# isort: on

import numpy as np
import pytest

from kalos.index.cuda_ivf import CudaIvfIndex
from kalos.index.kernels.ivf_keys import ivf_keys


def reference(q, x, sq, ends, base, width, l2):
    """Keys [b, width] float64 and rows [b, width] by the definition, one slot at a time."""
    b = q.shape[0]
    keys = np.full((b, width), -np.inf)
    rows = np.zeros((b, width), np.int64)
    for i in range(b):
        e = ends[i]
        for j in range(min(width, int(e[-1]))):
            s = int(np.searchsorted(e, j, side="right"))
            r = int(base[i, s] + j)
            rows[i, j] = r
            keys[i, j] = q[i].astype(np.float64) @ x[r].astype(np.float64)
            if l2:
                keys[i, j] -= 0.5 * sq[r]
    return keys, rows


@pytest.mark.parametrize("l2", [False, True])
@pytest.mark.parametrize(
    ("dim", "probes", "width"),
    [(32, 3, 64), (200, 70, 300), (8, 1, 100), (130, 5, 16)],  # 70 lists: two steps of 64
)
def test_keys_and_rows_match_the_definition(l2, dim, probes, width):
    """Lists of random sizes (some empty) at random offsets; widths below, at and above the
    rows' count; rows past the count are -inf and row 0."""
    rng = np.random.default_rng(dim * 100 + probes + l2)
    n = 600
    x = rng.standard_normal((n, dim)).astype(np.float16)
    sq = (x.astype(np.float32) ** 2).sum(axis=1)
    b = 3
    q = rng.standard_normal((b, dim)).astype(np.float32)
    sizes = rng.integers(0, 12, (b, probes))
    sizes[0, : probes // 2] = 0  # empty lists first
    ends = np.cumsum(sizes, axis=1)
    starts = rng.integers(0, n - 12, (b, probes))
    base = starts - (ends - sizes)
    keys, rows = ivf_keys(
        torch.from_numpy(q), torch.from_numpy(x), torch.from_numpy(sq),
        torch.from_numpy(ends), torch.from_numpy(base), width, l2,
    )  # fmt: skip
    want_keys, want_rows = reference(q, x, sq, ends, base, width, l2)
    np.testing.assert_array_equal(rows.numpy(), want_rows)
    got = keys.numpy()
    assert np.array_equal(np.isinf(got), np.isinf(want_keys))
    finite = np.isfinite(want_keys)
    np.testing.assert_allclose(got[finite], want_keys[finite], rtol=1e-5, atol=1e-4)


def clustered(n: int, dim: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((12, dim)).astype(np.float32) * 3
    return (centres[rng.integers(0, 12, n)] + rng.standard_normal((n, dim))).astype(np.float32)


@pytest.mark.parametrize("metric", ["ip", "cosine", "l2"])
def test_the_index_with_the_kernel_answers_as_in_torch(metric):
    """Single queries (the graph path, its width outgrown and widened), batches, removed rows
    and a scope filter (the eager path's masks), with the kernel and without: the same ids,
    the same scores to fp32 rounding."""
    dim = 24
    x = clustered(2500, dim, 5)
    scopes = np.zeros((2500, 3), np.int64)
    scopes[::3, 0] = 7
    q = clustered(6, dim, 9)
    answers = []
    for kernel in (False, True):
        index = CudaIvfIndex("cuda:ivf,nlist=8,nprobe=2", dim=dim, metric=metric, device="cpu")
        if kernel:
            index.use_kernel()
            index.warm()
        index.graphs = True  # single queries as on a GPU (off one, the steps run eagerly)
        index.add(x, np.arange(2500), scopes)
        index.flush()
        got = [index.search(q[i], 10, nprobe=p) for i in range(len(q)) for p in (1, 2, 8)]
        assert index._graphs is not None and index._graphs.widths[8] == 4096  # widened
        got.append(index.search(q, 10))
        got.append(index.search(q, 5, scope=(7, 0, 0)))
        index.remove(np.arange(0, 2500, 5))
        got.append(index.search(q, 10, nprobe=3))
        answers.append(got)
    for (ws, wi), (gs, gi) in zip(*answers, strict=True):
        np.testing.assert_array_equal(gi, wi)
        np.testing.assert_allclose(gs, ws, rtol=1e-5, atol=1e-5)
