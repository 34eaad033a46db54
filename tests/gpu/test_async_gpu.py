"""AsyncClient.search_gpu on a ``--device cuda`` sidecar: host and CUDA queries from many tasks,
results owned CUDA tensors (cloned off each channel's GPU buffer) that later calls on the same
channel do not overwrite.

Run on a CUDA machine: ``pytest -m gpu tests/gpu/test_async_gpu.py``. Skipped without CUDA.
"""

from __future__ import annotations

# isort: off
from cuda_device import torch

# isort: on

import asyncio

import numpy as np
import pytest

import kalos
from kalos.testing import isolated_sidecar

pytestmark = pytest.mark.gpu

DIM = 64
N = 4_096


def test_search_gpu_from_many_tasks_returns_owned_tensors() -> None:
    rng = np.random.default_rng(3)
    base = rng.standard_normal((N, DIM)).astype(np.float32)
    base /= np.linalg.norm(base, axis=1, keepdims=True)  # each vector its own best hit

    async def main(runtime_dir: str) -> None:
        c = await kalos.connect_async(
            "gpu-async", runtime_dir=runtime_dir, gpu_results=True, timeout=120, max_channels=4
        )
        await c.add(base, np.arange(N))
        stream = torch.cuda.Stream()

        async def task(i: int) -> list[tuple[int, object]]:
            held = []
            for j in range(8):
                row = (i * 8 + j) % N
                if j % 2:  # a CUDA query, made on the caller's own stream
                    with torch.cuda.stream(stream):
                        q = torch.from_numpy(base[row]).cuda() * 1.0
                    with torch.cuda.stream(stream):
                        hits = await c.search_gpu(q, 3)
                else:
                    hits = await c.search_gpu(base[row], 3)
                assert hits.ids.is_cuda and hits.payloads is None
                held.append((row, hits))
            return held

        results = await asyncio.gather(*(task(i) for i in range(16)))
        torch.cuda.synchronize()
        for held in results:
            for row, hits in held:  # unchanged by the 127 calls after each on 4 channels
                assert int(hits.ids[0]) == row
        await c.close()

    with isolated_sidecar(dim=DIM, name="gpu-async", extra_args=("--device", "cuda")) as sc:
        asyncio.run(main(sc.runtime_dir))
