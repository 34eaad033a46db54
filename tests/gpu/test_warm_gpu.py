"""Ready means warm, on a GPU: a ``--device cuda`` sidecar started with an empty kernel cache
answers its first searches after ready without waiting for a compile, and a second start
with the same cache gets ready faster (it loads the kernels instead of compiling them).

Run on a CUDA machine: ``pytest -m gpu tests/gpu/test_warm_gpu.py`` (the first start compiles
every kernel variant: minutes). Skipped without CUDA.
"""

from __future__ import annotations

# isort: off
from cuda_device import torch

# isort: on

import os
import time

import numpy as np
import pytest

import kalos
from kalos.testing import isolated_sidecar

pytestmark = pytest.mark.gpu

DIM = 128
N = 50_000
FIRST_SEARCH_S = 1.0  # a search that waited for a compile takes seconds
SHAPES = [(k, scope) for k in (1, 10, 100) for scope in (None, kalos.Scope("acme"))]


def start_and_search(cache: str, name: str) -> tuple[float, dict, list[tuple[str, float]]]:
    """Starts a cuda sidecar on ``cache``; returns (seconds to ready, its stats, the time of
    each first search after ready, by shape)."""
    rng = np.random.default_rng(1)
    base = rng.standard_normal((N, DIM)).astype(np.float32)
    t0 = time.monotonic()
    args = ("--device", "cuda", "--cache-dir", cache)
    with isolated_sidecar(dim=DIM, name=name, extra_args=args) as sc:
        ready_s = time.monotonic() - t0  # isolated_sidecar waits for ready on cuda
        client = sc.connect(gpu_results=True, timeout=30)
        client.add(base[: N // 2], np.arange(N // 2) + 1, scope=kalos.Scope("acme"))
        client.add(base[N // 2 :], np.arange(N // 2, N) + 1, scope=kalos.Scope("globex"))
        firsts = []
        for k, scope in SHAPES:
            q = rng.standard_normal(DIM).astype(np.float32)
            t = time.perf_counter()
            client.search(q, k=k, scope=scope, timeout=30)
            firsts.append((f"host k={k} scope={scope}", time.perf_counter() - t))
            t = time.perf_counter()
            client.search_gpu(torch.from_numpy(q).cuda(), k, scope=scope, timeout=30)
            firsts.append((f"gpu k={k} scope={scope}", time.perf_counter() - t))
        for nq in (2, 7, 64):  # batches
            t = time.perf_counter()
            client.search(rng.standard_normal((nq, DIM)).astype(np.float32), k=10, timeout=30)
            firsts.append((f"host nq={nq}", time.perf_counter() - t))
        stats = client.stats()
        client.close()
    return ready_s, stats, firsts


def test_first_searches_are_warm_and_a_restart_is_faster(tmp_path):
    cache = str(tmp_path / "kernel-cache")
    cold_s, stats, firsts = start_and_search(cache, "warm-cold")
    print(f"cold start to ready {cold_s:.1f} s (warm-up {stats['warm_seconds']:.1f} s)")
    slow = [(shape, round(s, 3)) for shape, s in firsts if s >= FIRST_SEARCH_S]
    assert not slow, f"first searches that waited: {slow}"
    assert stats["warm_seconds"] > 0
    assert os.listdir(cache), "nothing was cached"
    warm_s, stats2, firsts2 = start_and_search(cache, "warm-again")
    print(f"second start to ready {warm_s:.1f} s (warm-up {stats2['warm_seconds']:.1f} s)")
    assert stats2["warm_seconds"] < stats["warm_seconds"]
    assert warm_s < cold_s
    slow = [(shape, round(s, 3)) for shape, s in firsts2 if s >= FIRST_SEARCH_S]
    assert not slow, f"first searches that waited: {slow}"


@pytest.mark.parametrize("dim", [384, 128], ids=["4bit-cascade", "int8-prefilter"])
def test_the_warm_up_compiles_every_variant_in_parallel_first(tmp_path, monkeypatch, dim):
    """On an empty kernel cache the warm-up's variants compile in worker processes; the
    warm-up that follows then compiles nothing more (no new cache entry)."""
    from kalos.index.cuda_flat import CudaFlatIndex
    from kalos.index.kernels import precompile

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    entries: list[int] = []
    compile_all = precompile.compile_all

    def counted(*args, **kwargs):
        done = compile_all(*args, **kwargs)
        entries.append(len(os.listdir(tmp_path)))
        return done

    monkeypatch.setattr(precompile, "compile_all", counted)
    index = CudaFlatIndex.from_spec("cuda:flat", dim=dim, metric="cosine")
    rng = np.random.default_rng(2)
    index.add(rng.standard_normal((5000, dim)).astype(np.float32), np.arange(5000) + 1)
    t0 = time.perf_counter()
    launches = index.warm()
    seconds = time.perf_counter() - t0
    done = index.precompiled
    print(f"dim {dim}: warm-up {seconds:.1f} s, {launches} launches, precompile {done}")
    assert done is not None and done["failures"] == []
    assert done["compiled"] == done["variants"] > 50
    assert done["unforeseen"] == 0, "variants the dry run did not foresee"
    assert entries and len(os.listdir(tmp_path)) == entries[0], "the warm-up compiled more"
