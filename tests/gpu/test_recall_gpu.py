"""client.recall(..., device="cuda") against a ``--device cuda`` sidecar: the assembled token
ids arrive as a torch int32 CUDA tensor over the channel's GPU result buffer (no copy), the
same ids as the host path returns, for small and large budgets; bad requests are refused.

Run on a CUDA machine: ``pytest -m gpu tests/gpu/test_recall_gpu.py``. Skipped without CUDA.
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
N = 2_000
GPU_MAX_TOKENS = 131072


@pytest.fixture(scope="module")
def gpu_sidecar():
    rng = np.random.default_rng(11)
    base = rng.standard_normal((N, DIM)).astype(np.float32)
    ids = np.arange(N, dtype=np.int64)
    # memory i: 1 + i % 50 token ids, each 10_000 + i (so a hit's ids name it)
    tokens = [[10_000 + i] * (1 + i % 50) for i in range(N)]
    with isolated_sidecar(dim=DIM, name="gpu-recall", extra_args=("--device", "cuda")) as sc:
        client = sc.connect(gpu_results=True, timeout=120)
        client.add(base, ids, [f"m{i}" for i in ids], tokens=tokens, scope=kalos.Scope("acme"))
        client.append_turn("s", "system", "sys", [1, 2, 3], pin=True, scope=kalos.Scope("acme"))
        for t in range(20):
            client.append_turn("s", "user", f"turn {t}", list(range(100 * t, 100 * t + 40)))
        client.append_turn("big", "user", "long", list(range(30_000)), scope=kalos.Scope("acme"))
        for _ in range(3):
            client.append_turn("big", "user", "long", list(range(30_000)))
        yield sc, client, base
        client.close()


@pytest.mark.parametrize("max_tokens", [0, 3, 200, 1000, 4096])
def test_gpu_token_ids_match_the_host_path(gpu_sidecar, max_tokens):
    _, client, base = gpu_sidecar
    q = base[17] + 0.1
    host = client.recall("s", q, k=8, max_tokens=max_tokens, copy=True)
    g = client.recall("s", q, k=8, max_tokens=max_tokens, device="cuda")
    assert g.token_ids.is_cuda and g.token_ids.dtype == torch.int32
    assert g.token_ids.cpu().numpy().tolist() == host.token_ids.tolist()
    assert isinstance(g.ids, np.ndarray) and g.ids.tolist() == host.ids.tolist()
    assert g.texts == host.texts and g.context == host.context
    assert g.memory_tokens.tolist() == host.memory_tokens.tolist()
    assert len(g.token_ids) <= max_tokens
    for i, n in zip(g.ids.tolist(), g.memory_tokens.tolist(), strict=True):
        assert n in (0, 1 + i % 50)


def test_gpu_token_ids_are_a_view_of_the_channels_buffer(gpu_sidecar):
    _, client, base = gpu_sidecar
    g = client.recall("s", base[3], k=4, max_tokens=500, device="cuda")
    slots = client._lent().gpu.tokens
    assert g.token_ids.data_ptr() == slots.data_ptr()  # no copy
    kept = g.token_ids.clone()
    client.recall("s", base[900], k=4, max_tokens=500, device="cuda")
    assert not torch.equal(kept, g.token_ids) or kept.numel() == 0  # overwritten: a view
    owned = client.recall("s", base[3], k=4, max_tokens=500, device="cuda", copy=True)
    assert owned.token_ids.data_ptr() != slots.data_ptr() and torch.equal(owned.token_ids, kept)


def test_a_large_recall_fills_the_token_slots(gpu_sidecar):
    _, client, base = gpu_sidecar
    host = client.recall("big", base[5], k=10, max_tokens=GPU_MAX_TOKENS, copy=True)
    g = client.recall("big", base[5], k=10, max_tokens=GPU_MAX_TOKENS, device="cuda")
    assert len(host.token_ids) > 120_000  # 4 turns of 30k plus the memories
    assert torch.equal(g.token_ids.cpu(), torch.from_numpy(host.token_ids))


def test_a_cuda_query(gpu_sidecar):
    _, client, base = gpu_sidecar
    q = torch.from_numpy(base[42]).cuda()
    g = client.recall("s", q, k=3, max_tokens=300, device="cuda")
    assert g.ids[0] == 42
    assert g.token_ids.cpu().numpy().tolist()[3 : 3 + 1 + 42 % 50] == [10_042] * (1 + 42 % 50)


def test_bad_gpu_recalls_are_refused_and_serving_goes_on(gpu_sidecar):
    sc, client, base = gpu_sidecar
    with pytest.raises(kalos.InvalidRequest, match="max_tokens"):
        client.recall("s", base[0], max_tokens=GPU_MAX_TOKENS + 1, device="cuda")
    with pytest.raises(kalos.ConfigError, match="cuda:0"):
        client.recall("s", base[0], max_tokens=10, device="cuda:7")
    assert client.recall("s", base[0], max_tokens=10, device="cuda:0").token_ids.is_cuda
    plain = sc.connect()
    with pytest.raises(kalos.ConfigError, match="gpu_results"):
        plain.recall("s", base[0], max_tokens=10, device="cuda")
    assert plain.recall("s", base[0], max_tokens=10).context.system
    plain.close()
    assert client.recall("s", base[0], k=2, max_tokens=10, device="cuda").token_ids.is_cuda
