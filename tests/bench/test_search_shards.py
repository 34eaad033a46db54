"""``kalos bench search-shards`` end to end on the CPU at a tiny size.

On a GPU the scenario times ``cuda:flat,fp16`` against ``cuda:flat,fp16,shards=2``; CI runs
the same code over ``cpu:flat``: the corpus, both indexes, interleaved timed searches, every
answer checked against the exact top-k, and the result file's shape.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from kalos.bench import search_shards
from kalos.cli import build_parser


def test_search_shards_on_cpu(tmp_path) -> None:
    args = build_parser().parse_args(
        ["bench", "search-shards", "--device", "cpu", "--corpus", "uniform", "--n", "3000",
         "--dim", "64",
         "--shards", "3", "--queries", "40", "--out", str(tmp_path), "--machine", "test",
         "--quiet"]
    )  # fmt: skip
    assert args.func(args) == 0
    result = json.loads((tmp_path / "search-shards-test.json").read_text())
    params = result["params"]
    assert (params["corpus"], params["n"], params["dim"], params["k"]) == ("uniform", 3000, 64, 10)
    assert (params["shards"], params["gpus"], params["queries"]) == (3, 0, 40)
    assert params["index"] == "cpu:flat"
    rows = {r["system"]: r for r in result["rows"]}
    assert set(rows) == {"index-search", "index-search-shards-3"}
    assert all(r["n"] == 40 and r["p50_us"] > 0 and r["p99_us"] > 0 for r in rows.values())
    summary = result["summary"]
    assert summary["wrong_results"] == 0 and summary["target_ratio"] == 1.10
    assert summary["p50_ratio"] == round(
        rows["index-search-shards-3"]["p50_us"] / rows["index-search"]["p50_us"], 3
    )
    assert summary["p99_ratio"] > 0 and isinstance(summary["met"], bool)
    assert summary["identical_answers"] <= 40


def test_a_wrong_answer_is_counted() -> None:
    rng = np.random.default_rng(3)
    db = rng.standard_normal((50, 8)).astype(np.float32)
    q = rng.standard_normal(8).astype(np.float32)
    (want,) = search_shards.exact_topk(db, q[None], 5, on_gpu=False)
    ids = want * 3 + 1
    assert search_shards.is_exact(db, q, ids, want, 1e-5)
    assert search_shards.is_exact(db, q, ids[::-1].copy(), want, 1e-5)  # any order
    worst = int(np.argmin(db @ q))
    assert not search_shards.is_exact(db, q, np.r_[ids[:4], worst * 3 + 1], want, 1e-5)
    assert not search_shards.is_exact(db, q, np.r_[ids[:4], ids[0]], want, 1e-5)
    assert not search_shards.is_exact(db, q, np.r_[ids[:4], -1], want, 1e-5)


def test_search_gpu_has_no_shards_option() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "search-gpu", "--shards", "2"])
    args = build_parser().parse_args(["bench", "search-shards"])
    assert (args.n, args.dim, args.shards, args.corpus, args.device) == (
        1_000_000,
        384,
        2,
        "clustered",
        "cuda",
    )
