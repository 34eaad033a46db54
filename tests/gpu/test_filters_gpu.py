"""Metadata filters on a ``--device cuda`` sidecar: the exact top-k of the matching rows, on
both of ``cuda:flat``'s paths (a gather of few rows; the scan kernel with a row mask), with a
scope filter and after removals, against a float64 reference; with writes between the
searches (the columns' mirror on the GPU follows them); and a filtered search's latency
beside the unfiltered one at 1M rows (printed; the run of record is ``kalos bench
search-filtered --device cuda``).

Run on a CUDA machine: ``pytest -m gpu tests/gpu``. Skipped without CUDA.
"""

from __future__ import annotations

# isort: off
from cuda_device import torch  # noqa: F401

# isort: on

import time

import numpy as np
import pytest

import kalos
from kalos.testing import isolated_sidecar

pytestmark = pytest.mark.gpu

DIM = 64
N = 20_000


@pytest.fixture(scope="module")
def filtered_sidecar():
    rng = np.random.default_rng(11)
    base = rng.standard_normal((N, DIM)).astype(np.float32)
    keys = [f"doc-{i}" for i in range(N)]
    meta = [{"bucket": i % 100, "tags": ["even"] if i % 2 == 0 else []} for i in range(N)]
    with isolated_sidecar(dim=DIM, name="gpu-filters", extra_args=("--device", "cuda")) as sc:
        client = sc.connect(timeout=120)
        scopes = [kalos.Scope("acme"), kalos.Scope("globex")]
        for s in range(2):
            part = slice(s * N // 2, (s + 1) * N // 2)
            client.add(base[part], keys[part], metadata=meta[part], scope=scopes[s])
        yield client, base.astype(np.float16).astype(np.float64)
        client.close()


@pytest.mark.parametrize(
    "where, keep",
    [
        ({"bucket": 7}, lambda i: i % 100 == 7),  # 1%: the gather
        ({"bucket": {"lt": 50}}, lambda i: i % 100 < 50),  # 50%: the masked scan
        (
            {"tags": {"contains": "even"}, "bucket": {"gte": 90}},
            lambda i: i % 2 == 0 and i % 100 >= 90,
        ),
    ],
)
@pytest.mark.parametrize("scope", [None, kalos.Scope("acme")])
def test_filtered_search_is_exact(filtered_sidecar, where, keep, scope) -> None:
    client, base = filtered_sidecar
    rng = np.random.default_rng(3)
    rows = np.array([i for i in range(N) if keep(i) and (scope is None or i < N // 2)])
    for q in rng.standard_normal((5, DIM)).astype(np.float32):
        hits = client.search(q, 10, where=where, scope=scope, metadata=True, copy=True)
        scores = base[rows] @ q.astype(np.float64)
        want = scores[np.argsort(-scores)[:10]]
        got = np.array([base[int(k.split("-")[1])] @ q for k in hits.keys if k])
        assert all(keep(int(k.split("-")[1])) for k in hits.keys if k)
        np.testing.assert_allclose(np.sort(got)[::-1], want, rtol=2e-3, atol=2e-3)


def test_filtered_latency_beside_unfiltered() -> None:
    n, dim = 1_000_000, 128
    rng = np.random.default_rng(1)
    base = rng.standard_normal((n, dim)).astype(np.float32)
    meta = [{"bucket": i % 1000} for i in range(n)]
    with isolated_sidecar(dim=dim, name="gpu-filters-1m", extra_args=("--device", "cuda")) as sc:
        client = sc.connect(timeout=600, arena_bytes=16 << 20)
        client.add(base, np.arange(n), metadata=meta)
        q = rng.standard_normal((200, dim)).astype(np.float32)
        cases = [
            (None, lambda b: True),
            ({"bucket": {"lt": 500}}, lambda b: b < 500),
            ({"bucket": {"lt": 10}}, lambda b: b < 10),
            ({"bucket": 3}, lambda b: b == 3),
        ]
        for where, allowed in cases:
            for x in q[:20]:  # warm, and every hit within the filter (id % 1000 is its bucket)
                hits = client.search(x, 10, where=where, payloads=False, copy=True)
                found = np.asarray(hits.ids).ravel()
                assert (found >= 0).all() and all(allowed(int(i) % 1000) for i in found)
            t = []
            for x in q:
                t0 = time.perf_counter_ns()
                client.search(x, 10, where=where, payloads=False)
                t.append(time.perf_counter_ns() - t0)
            print(f"{where}: p50 {np.percentile(t, 50) / 1e3:.1f} µs, "
                  f"p99 {np.percentile(t, 99) / 1e3:.1f} µs")  # fmt: skip
        client.close()


def test_filtered_search_follows_writes() -> None:
    """The filter's columns on the GPU follow the writes between filtered searches: metadata
    replaced, removals, new items in the freed slots; on both paths (a selective filter
    gathers, a broad one masks the scan)."""
    rng = np.random.default_rng(5)
    n, fresh = 4000, 1000
    base = rng.standard_normal((n + fresh, DIM)).astype(np.float32)
    stored = base.astype(np.float16).astype(np.float64)
    meta = {i: {"bucket": i % 10, "low": i < 400} for i in range(n)}
    q = rng.standard_normal((3, DIM)).astype(np.float32)

    def check(client: kalos.Client, bucket: int) -> None:
        for where in ({"bucket": bucket}, {"bucket": bucket, "low": True}):
            rows = np.array(
                [i for i, m in meta.items() if all(m[k] == v for k, v in where.items())], np.int64
            )
            for x in q:
                hits = client.search(x, 10, where=where, metadata=True, copy=True)
                got = [int(k.split("-")[1]) for k in hits.keys if k]
                assert all(i in meta and meta[i]["bucket"] == bucket for i in got)
                scores = stored[rows] @ x.astype(np.float64)
                want = scores[np.argsort(-scores)[:10]]
                mine = np.sort(stored[got] @ x.astype(np.float64))[::-1]
                np.testing.assert_allclose(mine, want, rtol=2e-3, atol=2e-3)

    def add(client: kalos.Client, items: list[int]) -> None:
        client.add(base[items], [f"doc-{i}" for i in items], metadata=[meta[i] for i in items])

    with isolated_sidecar(
        dim=DIM, name="gpu-filters-writes", extra_args=("--device", "cuda")
    ) as sc:
        client = sc.connect(timeout=120)
        add(client, list(range(n)))
        check(client, 3)
        moved = list(range(0, n, 10))  # bucket 0 -> 3: metadata replaced in place
        for i in moved:
            meta[i] = {"bucket": 3, "low": meta[i]["low"]}
        add(client, moved)
        check(client, 3)
        check(client, 0)
        gone = list(range(3, n, 20))
        client.remove([f"doc-{i}" for i in gone])
        for i in gone:
            del meta[i]
        check(client, 3)
        new = list(range(n, n + fresh))  # into the freed slots first
        for i in new:
            meta[i] = {"bucket": 3, "low": True}
        add(client, new)
        check(client, 3)
        client.close()
