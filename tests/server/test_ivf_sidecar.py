"""A sidecar serving an approximate index: per-request nprobe through a real client, and
the bulk load at start (``kalos serve --load``) with its errors."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator

import numpy as np
import pytest

from kalos.errors import ConfigError, InvalidRequest, ProtocolMismatch
from kalos.index import create
from kalos.paths import socket_path
from kalos.server.config import SidecarConfig
from kalos.testing import RunningSidecar, isolated_sidecar, serve_command

DIM = 32
N = 3000
TIMEOUT = 30.0


def corpus(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((30, DIM)).astype(np.float32)
    x = centres[rng.integers(0, 30, n)] + 0.4 * rng.standard_normal((n, DIM)).astype(np.float32)
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("load")
    x = corpus(N, 1)
    ids = np.arange(N, dtype=np.int64) * 5 + 7
    paths = {"vectors": str(d / "v.npy"), "ids": str(d / "ids.npy"), "payloads": str(d / "p.jsonl")}
    np.save(paths["vectors"], x)
    np.save(paths["ids"], ids)
    with open(paths["payloads"], "w") as f:
        for i in range(N):
            f.write(json.dumps(f"memory {i}" if i % 2 == 0 else None) + "\n")
    return paths


@pytest.fixture(scope="module")
def running(files: dict[str, str]) -> Iterator[RunningSidecar]:
    args = ("--index", "cpu:ivf,nlist=32,nprobe=1", "--load", files["vectors"],
            "--load-ids", files["ids"], "--load-payloads", files["payloads"])  # fmt: skip
    with isolated_sidecar(dim=DIM, name="ivf", extra_args=args) as sidecar:
        yield sidecar


def test_loaded_rows_are_served_and_nprobe_applies_per_request(running, files) -> None:
    x = np.load(files["vectors"])
    ids = np.load(files["ids"])
    exact = create("cpu:flat", dim=DIM)
    exact.add(x, ids)
    q = corpus(32, 2)
    want = exact.search(q, 10)[1]
    with running.connect(timeout=TIMEOUT) as client:
        assert client.stats()["items"] == N
        full = client.search(q, 10, nprobe=32, payloads=False)
        np.testing.assert_array_equal(np.sort(full.ids, axis=1), np.sort(want, axis=1))
        one = client.search(q, 10, payloads=False, copy=True)  # the spec's nprobe=1
        pairs = zip(one.ids.tolist(), want.tolist(), strict=True)
        hits_one = sum(len(set(a) & set(b)) for a, b in pairs)
        assert hits_one < want.size  # one list of 32 misses some of the true top-10
        np.testing.assert_array_equal(client.search(q, 10, nprobe=1, payloads=False).ids, one.ids)
        hit = client.search(x[4], 1, nprobe=32)  # row 4: an even row, with a payload
        assert hit.ids[0] == ids[4] and hit.payloads[0] == "memory 4"
        filtered = client.search(q[0], 5, where={"missing": 1}, nprobe=32)
        assert (filtered.ids == -1).all()
        for bad in (-1, 1.5, 2**32):
            with pytest.raises(InvalidRequest, match="nprobe"):
                client.search(q[0], 10, nprobe=bad)
        assert client.search(q[0], 10, nprobe=32, payloads=False).ids[0] == want[0, 0]


def test_nprobe_needs_a_channel_of_protocol_1_6(running, monkeypatch) -> None:
    import kalos.transport.handshake

    monkeypatch.setattr(kalos.transport.handshake, "PROTOCOL_VERSION", (1, 5))
    with running.connect(timeout=TIMEOUT) as client:
        assert client.info["protocol"] == [1, 5]
        with pytest.raises(ProtocolMismatch, match=r"nprobe=\.\.\.\) needs protocol 1\.6"):
            client.search(corpus(1, 5)[0], 10, nprobe=4)
        assert client.search(corpus(1, 5)[0], 10).ids.shape == (10,)  # the index's own


def _config(**kwargs) -> SidecarConfig:
    return SidecarConfig(name="load-errors", dim=DIM, **kwargs)


def test_bad_load_files_are_config_errors(tmp_path, files) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        _config(load=str(tmp_path / "absent.npy"))
    np.save(tmp_path / "wrong_dim.npy", np.zeros((4, DIM + 1), np.float32))
    with pytest.raises(ConfigError, match=r"must be \[n, 32\]"):
        _config(load=str(tmp_path / "wrong_dim.npy"))
    np.save(tmp_path / "ints.npy", np.zeros((4, DIM), np.int32))
    with pytest.raises(ConfigError, match="float32 or float16"):
        _config(load=str(tmp_path / "ints.npy"))
    (tmp_path / "text.npy").write_text("not numpy")
    with pytest.raises(ConfigError, match=r"not a numpy \.npy array"):
        _config(load=str(tmp_path / "text.npy"))
    np.save(tmp_path / "few_ids.npy", np.arange(5, dtype=np.int64))
    with pytest.raises(ConfigError, match=r"one per vector; got shape \[5\]"):
        _config(load=files["vectors"], load_ids=str(tmp_path / "few_ids.npy"))
    np.save(tmp_path / "float_ids.npy", np.zeros(N, np.float64))
    with pytest.raises(ConfigError, match="must be int64"):
        _config(load=files["vectors"], load_ids=str(tmp_path / "float_ids.npy"))
    (tmp_path / "short.jsonl").write_text('"a"\n')
    with pytest.raises(ConfigError, match="1 lines for 3000 vectors"):
        _config(load=files["vectors"], load_payloads=str(tmp_path / "short.jsonl"))
    with pytest.raises(ConfigError, match="go with --load"):
        _config(load_ids=files["ids"])


def test_a_bad_load_stops_the_start_with_the_reason(tmp_path) -> None:
    """Values the header cannot show (NaN, a payload of the wrong type) are found while
    loading: ``kalos serve`` exits with the file and rows named, no socket left behind."""
    x = corpus(10, 3)
    x[7, 3] = np.nan
    np.save(tmp_path / "nan.npy", x)
    cmd = serve_command("load-nan", DIM, str(tmp_path), "--load", str(tmp_path / "nan.npy"),
                        "--no-admin")  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--load rows 0..9" in done.stderr and "NaN" in done.stderr
    assert not os.path.exists(socket_path("load-nan", str(tmp_path)))
    np.save(tmp_path / "ok.npy", corpus(2, 4))
    (tmp_path / "p.jsonl").write_text('"fine"\n{"a": 1}\n')
    cmd = serve_command("load-payload", DIM, str(tmp_path), "--load", str(tmp_path / "ok.npy"),
                        "--load-payloads", str(tmp_path / "p.jsonl"), "--no-admin")  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "line 2: a JSON string or null, not dict" in done.stderr
