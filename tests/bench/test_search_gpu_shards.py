"""``kalos bench search-gpu --shards N``'s measurement, on the CPU at a tiny size.

The search-gpu scenario needs a GPU; its sharding rows come from
:func:`kalos.bench.search_gpu.shard_overhead`, which takes any spec, so CI runs it over
``cpu:flat``: both indexes built, every search timed and checked.
"""

from __future__ import annotations

import numpy as np

from kalos.bench.search_gpu import shard_overhead
from kalos.cli import build_parser


def test_shard_overhead_on_cpu() -> None:
    rng = np.random.default_rng(7)
    db = rng.standard_normal((2000, 16)).astype(np.float32)
    ids = np.arange(2000, dtype=np.int64) * 3 + 1
    queries = rng.standard_normal((20, 16)).astype(np.float32)
    rows, summary = shard_overhead("cpu:flat", db, ids, queries, 10, 3, 40)
    assert [r["system"] for r in rows] == ["index-search", "index-search-shards-3"]
    assert all(r["n"] == 40 and r["p50_us"] > 0 for r in rows)
    assert summary["shards"] == 3 and summary["sharded_wrong_results"] == 0
    assert summary["sharded_over_single_p50"] > 0


def test_search_gpu_takes_shards() -> None:
    args = build_parser().parse_args(["bench", "search-gpu", "--shards", "2"])
    assert args.shards == 2
