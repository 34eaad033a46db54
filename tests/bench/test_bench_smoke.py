"""``kalos bench context`` and ``kalos bench recall`` end to end at a tiny size.

The full runs need ``redis-server`` (Debian's package) and redis-py; CI has no redis-server,
so those two skip there, with the reason. The kalos side of recall (the corpus, its exact
answers, the bulk load, every answer checked) runs without Redis.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import time

import numpy as np
import pytest

from kalos.bench import recall
from kalos.bench.common import System, run_interleaved
from kalos.cli import build_parser

TIMEOUT = 60.0
NO_REDIS = shutil.which("redis-server") is None or importlib.util.find_spec("redis") is None
needs_redis = pytest.mark.skipif(
    NO_REDIS, reason="needs redis-server (apt-get install redis-server) and redis-py"
)


def _bench(tmp_path, *argv: str) -> tuple[int, dict]:
    args = build_parser().parse_args(
        ["bench", *argv, "--out", str(tmp_path), "--machine", "test", "--quiet"]
    )
    rc = args.func(args)
    (path,) = tmp_path.glob(f"{argv[0]}-test*.json")
    assert path.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    return rc, json.loads(path.read_text())


@needs_redis
def test_context_bench(tmp_path):
    before = os.sched_getaffinity(0)
    rc, result = _bench(
        tmp_path, "context", "--sessions", "6", "--turns", "8", "--requests", "60",
        "--block", "20", "--warmup", "5", "--concurrency", "1", "3",
    )  # fmt: skip
    assert rc == 0 and result["mismatches"] == 0
    rows = {(r["system"], r["concurrency"]): r for r in result["rows"]}
    systems = ("kalos-shm", "kalos-shm-request", "kalos-shm+turns", "redis-json",
               "dict-inprocess")  # fmt: skip
    assert set(rows) == {(s, c) for s in systems for c in (1, 3)}
    assert all(r["n"] == 60 and r["p50_us"] > 0 for r in rows.values())
    # every session's window from the session index (no request: no sidecar stages) ...
    assert result["params"]["kalos_shm_local"] == 6
    assert not rows[("kalos-shm", 3)].get("stages")
    # ... and through the sidecar, stage by stage
    stages = rows[("kalos-shm-request", 3)]["stages"]["mean_us"]
    assert list(stages) == ["client_write", "sidecar_wait", "compute", "response_write",
                            "client_read"]  # fmt: skip
    mean = rows[("kalos-shm-request", 3)]["mean_us"]
    assert sum(stages.values()) == pytest.approx(mean, rel=0.01)
    assert os.sched_getaffinity(0) == before  # --affinity split (the default), undone after
    cpus = sorted(before)
    if len(cpus) > 1:
        assert result["params"]["affinity"] == {
            "client": cpus[:-1], "sidecar": cpus[-1:], "redis": cpus[-1:]
        }  # fmt: skip
    else:
        assert result["params"]["affinity"] == "none"


@needs_redis
def test_context_bench_without_affinity(tmp_path):
    rc, result = _bench(
        tmp_path, "context", "--sessions", "3", "--turns", "4", "--requests", "20",
        "--block", "10", "--warmup", "2", "--concurrency", "1", "--affinity", "none",
    )  # fmt: skip
    assert rc == 0 and result["mismatches"] == 0
    assert result["params"]["affinity"] == "none"


@needs_redis
def test_recall_bench(tmp_path):
    pytest.importorskip("faiss")
    pytest.importorskip("torch")
    rc, result = _bench(
        tmp_path, "recall", "--memories", "500", "--dim", "32", "--sessions", "8", "--turns",
        "10", "--budget", "700", "--requests", "40", "--block", "20", "--warmup", "4",
        "--concurrency", "1", "2",
    )  # fmt: skip
    assert rc == 0 and result["mismatches"] == 0
    assert result["params"]["device"] == "cpu" and result["params"]["baseline_device"] == "cpu"
    rows = {(r["system"], r["concurrency"]): r for r in result["rows"]}
    assert set(rows) == {(s, c) for s in ("kalos-shm", "redis+faiss") for c in (1, 2)}
    k = rows[("kalos-shm", 2)]
    assert set(k["sidecar_parts_p50_us"]) == {"context", "search", "assemble"}
    # the ratio is rounded to 2 decimals (on a loaded smoke run it can be below 1)
    assert k["baseline_over_this_p99"] == pytest.approx(
        rows[("redis+faiss", 2)]["p99_us"] / k["p99_us"], rel=0.01, abs=0.005
    )


def test_search_cpu_bench_on_a_corpus(tmp_path):
    rc, result = _bench(
        tmp_path, "search-cpu", "--corpus", "clustered", "--n", "2000", "--dim", "64",
        "--queries", "200", "--concurrency", "1", "2",
    )  # fmt: skip
    assert rc == 0 and result["checks"]["wrong_results"] == 0
    params = result["params"]
    assert (params["corpus"], params["n"], params["dim"]) == ("clustered", 2000, 64)
    assert params["corpus_info"]["clusters"] == 8
    assert {r["system"] for r in result["rows"]} == {"kalos-shm", "inprocess-cpu:flat"}


def _recall_args(**kw: object) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    recall.add_arguments(p)
    args = p.parse_args([])
    vars(args).update({"memories": 400, "dim": 16, "sessions": 6, "turns": 12, "budget": 900, **kw})
    return args


def test_recall_queries_have_a_clear_top_k():
    args = _recall_args()
    corpus = recall.Corpus(args)
    scores = corpus.queries @ corpus.vectors.T
    top = np.argsort(-scores, axis=1)[:, : args.k + 1]
    np.testing.assert_array_equal(top[:, : args.k], corpus.top)
    gaps = -np.diff(np.take_along_axis(scores, top, axis=1), axis=1)
    assert gaps.min() >= args.margin
    expected = corpus.expected(args)
    assert all(len(tokens) <= args.budget for _, tokens, _ in expected)
    assert [len(ids) for ids, _, _ in expected] == [args.k] * args.sessions


def test_recall_kalos_side_without_redis(sidecar):
    args = _recall_args()
    corpus = recall.Corpus(args)
    want = corpus.expected(args)
    s = sidecar(dim=args.dim, name="bench-recall")
    recall.load_kalos(s, corpus, args)
    client = s.connect(timeout=TIMEOUT)

    def call(i: int):
        return client.recall(corpus.names[i], corpus.queries[i], k=args.k, max_tokens=args.budget)

    def check(i: int, got) -> bool:
        ids, tokens, texts = want[i]
        return bool(np.array_equal(got.ids, ids) and np.array_equal(got.token_ids, tokens)
                    and got.texts == texts)  # fmt: skip

    order = np.arange(30) % args.sessions
    res = run_interleaved([System("kalos-shm", call, check, client)], order, 3, block=10,
                          warmup=1)["kalos-shm"]  # fmt: skip
    assert res.mismatches == 0 and not np.isnan(res.stages_us).any()
    # The check can fail: a smaller budget gives other token ids.
    small = _recall_args(budget=300)
    want = corpus.expected(small)
    res = run_interleaved([System("kalos-shm", call, check, client)], order, 2, block=10,
                          warmup=0)["kalos-shm"]  # fmt: skip
    assert res.mismatches == len(order)
    client.close()


def test_search_filtered_bench(tmp_path):
    rc, result = _bench(
        tmp_path, "search-filtered", "--n", "3000", "--dim", "64", "--queries", "60",
        "--shares", "1", "0.1", "0.01",
    )  # fmt: skip
    assert rc == 0 and result["checks"]["wrong_results"] == 0
    rows = {r["share"]: r for r in result["rows"]}
    assert rows[1.0]["matched"] == 3000 and rows[0.01]["matched"] == 30
    assert rows[1.0]["over_unfiltered_p50"] == 1.0


def test_load_bench(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("grpc")
    rc, result = _bench(
        tmp_path, "load", "--corpus", "clustered", "--n", "2000", "--dim", "64",
        "--queries", "40", "--processes", "1", "--threads", "2", "--tasks", "3",
        "--duration", "0.3", "--fractions", "0.5", "--systems", "kalos-shm",
        "kalos-shm-unbatched", "kalos-shm-async", "kalos-grpc", "torch-lock", "torch-batched",
    )  # fmt: skip
    assert rc == 0
    threads, tasks = result  # one parameter set per client layout
    for s in result:
        assert s["params"]["corpus"] == "clustered" and s["params"]["clients"]
        assert s["checks"]["wrong_results"] == 0 and s["checks"]["batch64_over_one"] > 0
        assert all({"qps", "p50_us", "p99_us", "p999_us"} <= set(r) for r in s["rows"])
    systems = [(r["system"], r["offered_qps"] is None) for r in threads["rows"]]
    for system in ("kalos-shm", "kalos-shm-unbatched", "kalos-grpc", "torch-lock", "torch-batched"):
        assert (system, True) in systems and (system, False) in systems  # closed, then swept
    assert {r["system"] for r in tasks["rows"]} == {"kalos-shm-async"}
    assert threads["checks"]["sidecar_stats"]["unbatched"]["batches"] == 0
    assert threads["checks"]["systems_pending"] == []
    for r in threads["rows"]:  # each kalos row: the sidecar's batches during that run
        if r["system"].startswith("kalos-shm"):
            b = r["sidecar_batches"]
            assert {"batches", "mean_batch", "batched_share", "mean_us", "search_us",
                    "dispatch_us", "busy_share", "running_share", "woken_share",
                    "run_ahead_share", "steps_us"} == set(b)  # fmt: skip
            steps = b["steps_us"]
            assert set(steps) == {"decode", "start", "settle", "collect", "write", "reply"}
            if r["system"] == "kalos-shm-unbatched":
                assert b["batches"] == 0 and b["mean_us"] == 0.0
                assert set(steps.values()) == {0.0}
            elif b["batches"]:  # a batch's time holds its search's; the poller's share of the wall
                assert b["mean_us"] >= b["search_us"] > 0 and b["dispatch_us"] >= 0
                # the poller's steps: each batch decoded, started (a CPU pass runs in its
                # start; its answers are taken as its responses are written), written and
                # replied
                assert min(steps[s] for s in ("decode", "write", "reply")) > 0, steps
                assert steps["start"] + steps["write"] >= 0.95 * b["search_us"], (steps, b)
                assert steps["settle"] == 0  # no GPU
                assert sum(steps.values()) <= b["mean_us"] * 1.01, (steps, b)
                assert 0 < b["busy_share"] <= 1 and 0 <= b["woken_share"] <= 1
                # a CPU sidecar's passes end before replies: none left running
                assert b["run_ahead_share"] == 0 and b["running_share"] == 0
        else:
            assert "sidecar_batches" not in r
    # --append: another corpus size's set joins the file (the same one would be replaced)
    args = ["load", "--corpus", "clustered", "--n", "1000", "--dim", "64", "--queries", "20",
            "--threads", "2", "--processes", "2", "--duration", "0.2", "--fractions", "0.5",
            "--systems", "torch-lock", "--append"]  # fmt: skip
    rc, appended = _bench(tmp_path, *args)
    assert rc == 0 and [s["params"]["n"] for s in appended] == [2000, 2000, 1000]
    assert appended[2]["rows"][0]["system"] == "torch-lock"
    # --sidecar-arg: onto the sidecar's command line (the last --batch-max wins: batches of at
    # most 2), recorded, and a set of its own beside the same clients' set without it
    args = ["load", "--corpus", "clustered", "--n", "1000", "--dim", "64", "--queries", "20",
            "--threads", "2", "--processes", "2", "--duration", "0.3", "--fractions", "0.5",
            "--systems", "kalos-shm", "--sidecar-arg=--batch-max=2", "--append"]  # fmt: skip
    rc, appended = _bench(tmp_path, *args)
    assert rc == 0 and [s["params"]["n"] for s in appended] == [2000, 2000, 1000, 1000]
    mine = appended[3]
    assert mine["params"]["sidecar_args"] == ["--batch-max=2"]
    assert mine["params"]["clients"] == appended[2]["params"]["clients"]
    batched = mine["checks"]["sidecar_stats"]["batched"]
    assert batched["batches"] > 0 and batched["largest_batch"] == 2, batched


def test_load_bench_keeps_each_system_it_measured(tmp_path, monkeypatch):
    """The file is written after each system: a run cut short (here a system that raises)
    keeps the rows of those before it and names the systems it did not reach."""
    pytest.importorskip("torch")
    from kalos.bench import load

    def broken(*args, **kwargs):
        raise KeyboardInterrupt("cut short")

    monkeypatch.setattr(load, "torch_batched", broken)
    args = build_parser().parse_args(
        ["bench", "load", "--corpus", "clustered", "--n", "500", "--dim", "64", "--queries",
         "20", "--processes", "1", "--threads", "1", "--duration", "0.2", "--fractions", "0.5",
         "--systems", "torch-lock", "torch-batched", "--out", str(tmp_path), "--machine",
         "test", "--quiet"]
    )  # fmt: skip
    with pytest.raises(KeyboardInterrupt):
        args.func(args)
    (kept,) = json.loads((tmp_path / "load-test.json").read_text())
    assert {r["system"] for r in kept["rows"]} == {"torch-lock"}
    assert kept["checks"]["systems_pending"] == ["torch-batched"]
    assert not (tmp_path / "load-test.png").exists()  # the plot comes with the whole run


def test_a_failing_client_process_says_why(tmp_path):
    """A client process of the load benchmark that fails (here: no such sidecar) sends its
    error before it exits, and the benchmark raises with it instead of a bare "died"."""
    from kalos.bench.load import ClientFleet

    target = {"transport": "shm", "name": "nobody-here", "runtime_dir": str(tmp_path)}
    data = {"queries": np.zeros((1, 4), np.float32), "k": 1, "threads": 1, "tasks": 1,
            "ref": None}  # fmt: skip
    with pytest.raises(RuntimeError, match=r"client process \d+ failed: ConnectError"):
        ClientFleet(target, data, 1, asyncio_mode=False)


def test_an_open_loops_latency_starts_at_the_arrival_or_when_an_idle_caller_woke():
    """An idle caller's late timer is the load generator's, not the system's; a caller still
    busy with its last search when the next is due counts that wait (coordinated omission)."""
    from kalos.bench.load import arrived, caller_loop

    assert arrived(at=1.0, before=0.9, woke=1.0002) == 1.0002  # slept, woke late
    assert arrived(at=1.0, before=0.9, woke=1.0) == 1.0
    assert arrived(at=1.0, before=1.3, woke=1.3) == 1.0  # busy until after the arrival

    class Ok:
        def ok(self, i, got):
            return True

    def slow(i):  # every search 20 ms, at 200 arrivals a second: the caller falls behind
        time.sleep(0.02)
        return np.zeros(1, np.int64)

    lat, wrong, _ = caller_loop(slow, Ok(), 4, 200.0, time.monotonic(), 0.3, seed=1)
    assert wrong == 0 and len(lat) > 5
    assert max(lat) > 0.06  # the queue behind the slow searches is in the latencies
