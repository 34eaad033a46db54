"""kalos bench transport at a tiny size: every system's row at every concurrency, the ratios
to shm, quantiles for a CDF, the raw samples. A benchmark is not a test: nothing is timed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("grpc")


def test_transport_bench_rows_ratios_and_quantiles(tmp_path: Path) -> None:
    argv = ["bench", "transport", "--requests", "120", "--block", "40", "--warmup", "10"]
    argv += ["--concurrency", "1,2", "--out", str(tmp_path), "--machine", "t", "--samples"]
    # In a process of its own: its client processes' barrier maps shared memory (/dev/shm),
    # which tests/server/test_security.py must not find in the test process.
    subprocess.run([sys.executable, "-m", "kalos", *argv], check=True, timeout=600)
    (path,) = tmp_path.glob("transport-t*.json")
    result = json.loads(path.read_text())
    systems = ["kalos-shm", "kalos-uds", "kalos-grpc", "kalos-grpc-unix"]
    assert [(r["system"], r["concurrency"]) for r in result["rows"]] == [
        (s, c) for c in (1, 2) for s in systems
    ]
    for row in result["rows"]:
        assert row["n"] == 120
        names, q = list(row["quantiles"]), list(row["quantiles"].values())
        assert (names[0], names[-1]) == ("p0.1", "p99.9")
        assert q == sorted(q) and q[0] > 0
    assert [r["concurrency"] for r in result["ratios"]] == [1, 2]
    for ratio in result["ratios"]:
        assert set(ratio) == {
            "concurrency",
            "uds_over_shm_p50",
            "grpc_over_shm_p50",
            "grpc_unix_over_shm_p50",
        }
        assert all(v > 0 for v in ratio.values())
    cpus = sorted(os.sched_getaffinity(0))  # --affinity split, the default
    if len(cpus) >= 2:
        assert result["params"]["affinity"] == {"client": cpus[:-1], "sidecar": cpus[-1:]}
    else:
        assert result["params"]["affinity"] == "none"
    samples = np.load(path.with_suffix(".npz"))
    assert samples["c2-kalos-grpc"].shape == (120,) and samples["c2-kalos-grpc"].min() > 0
