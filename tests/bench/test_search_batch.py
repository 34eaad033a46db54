"""``kalos bench search-batch`` end to end on the CPU, under TRITON_INTERPRET=1, at a tiny size:
every path and batch size timed and checked."""

from __future__ import annotations

# isort: off
from triton_interp import torch, triton  # noqa: F401  (first: sets TRITON_INTERPRET)

# isort: on

import json

from kalos.cli import build_parser
from kalos.index import cuda_flat


def test_every_path_and_batch_size_is_timed_and_checked(tmp_path) -> None:
    args = build_parser().parse_args(
        ["bench", "search-batch", "--device", "cpu", "--n", "300", "--dim", "64",
         "--batches", "1", "4", "8", "--calls", "2", "--checked", "2", "--k", "5",
         "--out", str(tmp_path), "--machine", "test", "--quiet"]
    )  # fmt: skip
    assert args.func(args) == 0
    path = tmp_path / "search-batch-test.json"
    assert path.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    result = json.loads(path.read_text())
    assert (result["params"]["n"], result["params"]["dim"]) == (300, 64)
    rows = {(r["system"], r["batch"]): r for r in result["rows"]}
    paths = ("two-pass", "fused", "singles", "torch")
    assert set(rows) == {(p, b) for p in paths for b in (1, 4, 8)}
    assert all(r["wrong"] == 0 and r["p99_us"] >= r["p50_us"] > 0 for r in rows.values())
    assert [rows[("two-pass", b)]["two_pass"] for b in (1, 4, 8)] == [False, True, True]
    assert result["params"]["default_two_pass_batch"] == 32  # the default from 32 queries
    assert not any(rows[(p, b)]["two_pass"] for p in ("fused", "singles") for b in (1, 4, 8))
    assert result["checks"]["wrong_results"] == 0
    assert set(result["checks"]["largest_over_one"]) == {"batch", *paths}
    assert "scan" in result["params"] and "listed_p50" not in rows[("fused", 4)]


def test_append_keeps_the_other_sets(tmp_path) -> None:
    base = ["bench", "search-batch", "--device", "cpu", "--dim", "64", "--batches", "1", "4",
            "--calls", "1", "--checked", "1", "--k", "3", "--out", str(tmp_path),
            "--machine", "test", "--quiet"]  # fmt: skip
    for n in ("200", "250", "200"):
        args = build_parser().parse_args([*base, "--n", n, "--append"])
        assert args.func(args) == 0
    sets = json.loads((tmp_path / "search-batch-test.json").read_text())
    assert sorted(s["params"]["n"] for s in sets) == [200, 250]  # the second 200 replaced


def test_a_4bit_index_adds_the_cascade_rows(tmp_path) -> None:
    args = build_parser().parse_args(
        ["bench", "search-batch", "--device", "cpu", "--n", "300", "--dim", "288",
         "--batches", "1", "4", "--calls", "2", "--checked", "2", "--k", "5",
         "--out", str(tmp_path), "--machine", "test", "--quiet"]
    )  # fmt: skip
    assert args.func(args) == 0
    result = json.loads((tmp_path / "search-batch-test.json").read_text())
    assert result["params"]["scan"] == "4bit"
    assert result["params"]["default_batch4_max_batch"] == cuda_flat.BATCH4_MAX_BATCH
    rows = {(r["system"], r["batch"]): r for r in result["rows"]}
    assert {p for p, _ in rows} == {"cascade", "two-pass", "fused", "singles", "torch"}
    for b in (1, 4):
        cascade = rows[("cascade", b)]
        assert cascade["wrong"] == 0 and 5 <= cascade["listed_p50"] <= cascade["listed_max"] <= 300
        assert "listed_p50" not in rows[("fused", b)]
    assert result["checks"]["wrong_results"] == 0
    assert "cascade" in result["checks"]["largest_over_one"]
