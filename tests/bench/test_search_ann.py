"""``kalos bench search-ann`` end to end at a tiny size, and its recall arithmetic."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kalos.bench.search_ann import ground_truth, recall_at
from kalos.cli import build_parser
from kalos.index import create


def test_ground_truth_is_the_exact_top_k_across_chunks(monkeypatch) -> None:
    import kalos.bench.search_ann as ann

    monkeypatch.setattr(ann, "TRUTH_CHUNK", 37)  # many blocks, the last one short
    rng = np.random.default_rng(5)
    db = rng.standard_normal((500, 16)).astype(np.float32)
    q = rng.standard_normal((9, 16)).astype(np.float32)
    for metric in ("ip", "cosine", "l2"):
        exact = create("cpu:flat", dim=16, metric=metric)
        exact.add(db, np.arange(500))
        want = exact.search(q, 10)[1]
        got = ground_truth(db, q, 10, metric, "cpu")
        np.testing.assert_array_equal(got, want)


def test_recall_at_counts_the_true_top_10_found() -> None:
    want = np.arange(20).reshape(2, 10)
    got = want.copy()
    got[0, :3] = [100, 101, 102]
    assert recall_at(got, want) == 17 / 20
    assert recall_at(got[:, ::-1], want) == 17 / 20  # order does not matter


def test_the_bench_sweeps_nprobe_in_process_and_through_a_sidecar(tmp_path) -> None:
    args = build_parser().parse_args(
        ["bench", "search-ann", "--n", "4000", "--queries", "50", "--nlist", "32",
         "--nprobe", "1", "32", "--out", str(tmp_path), "--machine", "test", "--quiet"]
    )  # fmt: skip
    assert args.func(args) == 0
    path = tmp_path / "search-ann-test.json"
    assert path.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    result = json.loads(path.read_text())
    assert result["params"]["index"] == "cpu:ivf,nlist=32"
    assert (result["params"]["n"], result["params"]["corpus"]) == (4000, "clustered")
    rows = {(r["system"], r.get("nprobe")): r for r in result["rows"]}
    assert rows[("inprocess-cpu:flat", None)]["recall_at_10"] == 1.0
    one = rows[("inprocess-cpu:ivf,nlist=32", 1)]["recall_at_10"]
    assert one < rows[("inprocess-cpu:ivf,nlist=32", 32)]["recall_at_10"] == 1.0
    # the sidecar loads the same rows, builds the same index, answers the same
    assert rows[("kalos-shm", 1)]["recall_at_10"] == one
    assert rows[("kalos-shm", 32)]["recall_at_10"] == 1.0
    # where the sidecar's round trips went: every stage, its median within its p99
    stages = rows[("kalos-shm", 1)]["stages_us"]
    for stage in ("queue", "compute", "write", "client"):
        assert 0 <= stages[f"{stage}_us"] <= stages[f"{stage}_p99_us"]
    assert stages["compute_us"] > 0 and stages["client_us"] > 0
    assert all(r["p50_us"] > 0 and r["p99_us"] >= r["p50_us"] for r in rows.values())
    assert result["params"]["build"]["trainings"] >= 1


def test_the_profile_records_where_a_search_spends_its_time(tmp_path) -> None:
    pytest.importorskip("torch")
    args = build_parser().parse_args(
        ["bench", "search-ann", "--n", "3000", "--queries", "20", "--nlist", "16",
         "--nprobe", "4", "--exact", "none", "--no-sidecar", "--profile", "--out",
         str(tmp_path), "--machine", "test", "--quiet"]
    )  # fmt: skip
    assert args.func(args) == 0
    profile = json.loads((tmp_path / "search-ann-test.json").read_text())["params"]["profile"]
    assert profile["nprobe"] == 4 and profile["searches"] == 200
    assert profile["wall_us"] > 0 and isinstance(profile["host_us"], dict)


def test_a_set_becomes_a_panel_of_curves_by_system():
    """Each system's points in order of nprobe, the exact index a lone point, the eager and
    concurrent single settings left out."""
    from kalos.bench.search_ann import panel

    rows = [
        {"system": "inprocess-cpu:flat", "index": "cpu:flat", "p99_us": 900.0, "recall_at_10": 1.0},
        {"system": "inprocess-cpu:ivf,nlist=8", "index": "cpu:ivf,nlist=8", "nprobe": 2,
         "p99_us": 50.0, "recall_at_10": 0.9},
        {"system": "inprocess-cpu:ivf,nlist=8", "index": "cpu:ivf,nlist=8", "nprobe": 1,
         "p99_us": 30.0, "recall_at_10": 0.8},
        {"system": "inprocess-cpu:ivf,nlist=8-eager", "index": "cpu:ivf,nlist=8", "nprobe": 1,
         "p99_us": 90.0, "recall_at_10": 0.8},
        {"system": "kalos-shm", "index": "cpu:ivf,nlist=8", "nprobe": 1, "p99_us": 60.0,
         "recall_at_10": 0.8},
        {"system": "kalos-shm-concurrent", "index": "cpu:ivf,nlist=8", "nprobe": 1,
         "p99_us": 6000.0, "recall_at_10": 0.8, "clients": 64},
    ]  # fmt: skip
    params = {"corpus": "clustered", "n": 1000, "dim": 8, "index": "cpu:ivf,nlist=8", "k": 10}
    title, curves = panel({"params": params, "rows": rows})
    assert title == "search-ann: clustered 1,000 x 8, cpu:ivf,nlist=8, top-10"
    assert curves == {
        "exact cpu:flat": [(900.0, 1.0, 0)],
        "in-process cpu:ivf,nlist=8": [(50.0, 0.9, 2), (30.0, 0.8, 1)],
        "kalos-shm cpu:ivf,nlist=8": [(60.0, 0.8, 1)],
    }
