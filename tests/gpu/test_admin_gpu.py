"""/metrics of a ``--device cuda`` sidecar reports its GPU memory and its search latency.

Run on a CUDA machine: ``pytest -m gpu tests/gpu``. Skipped without CUDA.
"""

from __future__ import annotations

# isort: off
from cuda_device import torch  # noqa: F401  (first: skips this module without CUDA)

# isort: on

import urllib.request

import numpy as np
import pytest

pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families

from kalos.testing import isolated_sidecar

pytestmark = pytest.mark.gpu

DIM = 64


def test_metrics_report_gpu_memory_and_searches() -> None:
    rng = np.random.default_rng(1)
    with isolated_sidecar(dim=DIM, name="gpu-admin", extra_args=("--device", "cuda")) as sc:
        with sc.connect(timeout=120) as client:
            client.add(rng.standard_normal((5000, DIM), dtype=np.float32), np.arange(5000))
            for _ in range(20):
                client.search(rng.standard_normal(DIM, dtype=np.float32), k=10)
            port = client.stats()["admin_port"]
        url = f"http://127.0.0.1:{port}/metrics"
        with urllib.request.urlopen(url, timeout=60) as r:
            text = r.read().decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    allocated = [v for (n, _), v in samples.items() if n == "kalos_gpu_memory_allocated_bytes"]
    assert allocated and allocated[0] >= 5000 * DIM * 2  # fp16 vectors at least
    key = ("kalos_request_duration_seconds_count", (("op", "search"), ("transport", "shm")))
    assert samples[key] == 20
    assert samples[("kalos_index_items", ())] == 5000
