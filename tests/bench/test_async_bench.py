"""``kalos bench async`` end to end at a tiny size: every system measured, the result written."""

from __future__ import annotations

import json

from kalos.cli import build_parser


def test_async_bench(tmp_path) -> None:
    args = build_parser().parse_args(
        ["bench", "async", "--requests", "400", "--block", "100", "--warmup", "50",
         "--concurrency", "4", "--out", str(tmp_path), "--machine", "test", "--quiet"]
    )  # fmt: skip
    assert args.func(args) == 0
    (path,) = tmp_path.glob("async-test*.json")
    result = json.loads(path.read_text())
    rows = {r["system"]: r for r in result["rows"]}
    assert set(rows) == {"sync", "async", "sync-x4", "async-x4"}
    for row in rows.values():
        assert row["n"] == 400 and row["p50_us"] > 0 and row["qps"] > 0
    assert rows["async"]["async_over_sync_p50"] > 0


def test_async_bench_searches_beside_the_pings(tmp_path) -> None:
    common = ["--requests", "200", "--block", "100", "--warmup", "20", "--concurrency", "4",
              "--out", str(tmp_path), "--machine", "test", "--quiet"]  # fmt: skip
    for extra in (["--op", "ping"], ["--op", "search", "--rows", "300", "--append"]):
        args = build_parser().parse_args(["bench", "async", *common, *extra])
        assert args.func(args) == 0
    sets = json.loads((tmp_path / "async-test.json").read_text())
    assert [s["params"]["op"] for s in sets] == ["ping", "search"]
    search = sets[1]
    assert search["params"]["rows"] == 300 and search["params"]["dim"] == 384
    assert {r["system"] for r in search["rows"]} == {"sync", "async", "sync-x4", "async-x4"}
    assert all(r["n"] == 200 and r["qps"] > 0 for r in search["rows"])
