"""The 4-bit cascade (``scan=4bit``, kalos.index.kernels.codes4) on a CUDA GPU, at full size:
its bounds pass's PTX ``dp4a`` against the byte dot, and 1M anisotropic rows searched through
the cascade against the float64 reference, with every row's bounds checked; batches through
the batched cascade (kernels.codes4_batch) too, at each size bucket it takes.

Run on a CUDA machine: ``pytest -m gpu tests/gpu``. Skipped without CUDA.
"""

from __future__ import annotations

# isort: off
from cuda_device import torch

# isort: on

import numpy as np
import pytest

from cuda_reference import (
    check_dp4a,
    check_graph_search,
    check_result,
    check_search,
    stored_vectors,
)
from kalos.index.cuda_flat import CudaFlatIndex

pytestmark = pytest.mark.gpu


def anisotropic(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    """A shared mean direction, a decaying spectrum, uneven clusters, near-duplicates."""
    mean = rng.standard_normal(dim) * 3.0 / np.sqrt(dim)
    spectrum = np.arange(1, dim + 1) ** -0.8
    centres = rng.standard_normal((64, dim)) * spectrum
    which = np.minimum(rng.zipf(1.5, n) - 1, 63)
    x = mean + centres[which] + 0.3 * rng.standard_normal((n, dim)) * spectrum
    x[1::50] = x[::50][: len(x[1::50])] + 1e-4 * rng.standard_normal((len(x[1::50]), dim))
    return x.astype(np.float32)


@pytest.mark.parametrize("ptx", [True, False], ids=["ptx", "bytes"])
def test_dp4a_is_the_byte_dot(ptx):
    check_dp4a("cuda", ptx=ptx, n=1 << 16)


@pytest.fixture(scope="module")
def rows_1m():
    rng = np.random.default_rng(418)
    return anisotropic(rng, 1_000_000, 384), anisotropic(rng, 6, 384)


def check_cascade(x: np.ndarray, queries: np.ndarray, metric: str) -> None:
    """x searched through the cascade, against the float64 reference: all but the last two
    queries through ``search``, those two through a search graph (k 10, then 1)."""
    idx = CudaFlatIndex(dim=x.shape[1], metric=metric, spec="cuda:flat,fp16,scan=4bit",
                        scan="4bit")  # fmt: skip
    ids = np.arange(1, len(x) + 1, dtype=np.int64) * 7
    idx.add(x, ids)
    assert len(idx) >= idx.prefilter_min_rows  # single queries take the cascade
    for q in queries[:-2]:
        check_search(idx, x, ids, None, q, 10)
    check_graph_search(idx, x, ids, None, queries[-2], 10)
    check_graph_search(idx, x, ids, None, queries[-1], 1)


@pytest.mark.parametrize("metric", ["ip", "cosine", "l2"])
def test_cascade_matches_float64_reference_at_1m(rows_1m, metric):
    x, queries = rows_1m
    check_cascade(x, queries[:5], metric)


def test_every_rows_bounds_hold_at_1m(rows_1m):
    x, queries = rows_1m
    idx = CudaFlatIndex(dim=384, metric="ip", spec="cuda:flat,fp16,scan=4bit", scan="4bit")
    idx.add(x, np.arange(1, len(x) + 1))
    ws = idx._workspace(1, 10, prefilter=True)
    qt = torch.from_numpy(queries[5:6] * 30).cuda()
    scores = torch.empty(1, 10, device="cuda")
    out = torch.empty(1, 10, dtype=torch.int64, device="cuda")
    idx._launch(qt, 10, idx._no_filter, False, scores, out, ws)
    torch.cuda.synchronize()
    exact = stored_vectors("ip", "fp16", x) @ (queries[5] * 30).astype(np.float64)
    upper = ws["upper"][: len(x)].double().cpu().numpy()
    width = ws["qf"][1].item() * idx._meta[1, : len(x)].double().cpu().numpy()
    assert np.all(upper >= exact), "an upper bound below the exact score"
    assert np.all(upper - 2 * width <= exact), "a lower bound above the exact score"
    assert 0 < int(ws["status"][1]) <= len(x)  # the rows the bounds leave open, exact-scored


@pytest.mark.parametrize("dim", [768, 1536])
def test_cascade_above_512_dims_matches_float64_reference(dim):
    """scan=4bit at the dims where scan=auto takes the full scan (the bounds pass's launch
    shape changes with the row's bytes: codes4.choose_config)."""
    rng = np.random.default_rng(dim)
    check_cascade(anisotropic(rng, 600_000, dim), anisotropic(rng, 4, dim), "ip")


@pytest.mark.parametrize("metric", ["ip", "cosine", "l2"])
def test_batched_cascade_matches_float64_reference_at_1m(rows_1m, metric):
    """Batches of 2 to 64 through the batched cascade (every size bucket the index can be set
    to take it for), by search and by a graph replayed twice, with and without a scope."""
    x, _ = rows_1m
    rng = np.random.default_rng(7)
    more = anisotropic(rng, 64, 384)
    idx = CudaFlatIndex(dim=384, metric=metric, spec="cuda:flat,fp16,scan=4bit", scan="4bit")
    ids = np.arange(1, len(x) + 1, dtype=np.int64)
    scopes = np.zeros((len(x), 3), dtype=np.int64)
    scopes[:, 0] = 1 + (ids % 3)
    idx.add(x, ids, scopes)
    idx.batch4_max_batch = 64
    for nq in (2, 3, 16, 64):
        check_search(idx, x, ids, scopes, more[:nq], 10)
        assert idx._workspaces[(nq, 10, False)].get("codes4_batch")
    check_search(idx, x, ids, scopes, more[:5], 10, scope=(2, 0, 0))
    g = idx.graph(8, 10, scope_active=False)
    assert g._ws[0].get("codes4_batch")
    for lo in (0, 8):
        g.query.copy_(torch.from_numpy(more[lo : lo + 8]))
        g.replay()
        torch.cuda.synchronize()
        check_result(idx, x, ids, scopes, more[lo : lo + 8], 10, g.scores.cpu().numpy(),
                     g.ids.cpu().numpy())  # fmt: skip
    listed = g._ws[0]["listed"].cpu().numpy()
    assert np.all((listed >= 10) & (listed <= len(x)))
