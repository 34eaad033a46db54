"""The benchmarks' shared parts: the per-stage split of a kalos call, the progress bar, the
concurrent interleaved runner and the plot writer. No Redis needed."""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from kalos.bench.common import (
    STAGES,
    Progress,
    System,
    add_affinity_argument,
    pin_process,
    run_interleaved,
    split_cpus,
    split_stages,
    stage_summary,
    write_result,
)
from kalos.bench.plots import plot_result, png_path

TIMEOUT = 60.0


@pytest.mark.parametrize("transport", ["shm", "uds"])
def test_stages_sum_to_the_round_trip_and_follow_the_clock(sidecar, transport):
    s = sidecar(dim=4)
    client = s.connect(transport=transport, timeout=TIMEOUT)
    client.append_turn("s", "user", "hello", [1, 2, 3])
    assert client.last_stamps is None  # off by default
    client.record_stages(True)
    for call in (
        client.ping,
        lambda: client.context("s", 100),
        lambda: client.search([1.0] * 4, 1),
    ):
        for _ in range(20):
            t0 = time.monotonic_ns()
            call()
            t1 = time.monotonic_ns()
            start, sent, received = client.last_stamps
            tm = client.last_timings
            # The call began, published, the sidecar picked it up, computed and wrote, then the
            # client saw the response: one clock, in this order.
            assert t0 <= start <= sent < received <= t1
            assert (
                received - sent >= tm.queue_us * 1e3 + tm.compute_us * 1e3 + tm.write_us * 1e3 - 1
            )
            split = split_stages(t0, t1, client.last_stamps, tm)
            assert split is not None and len(split) == len(STAGES)
            assert min(split) >= -1e-3
            assert sum(split) == pytest.approx((t1 - t0) / 1e3, abs=1e-6)
            assert split[1:4] == (tm.queue_us, tm.compute_us, tm.write_us)
    client.record_stages(False)
    assert client.last_stamps is None and client._recording == 0
    client.ping()
    assert client.last_stamps is None
    client.close()


def test_stage_record_is_per_thread(sidecar):
    client = sidecar(dim=4).connect(timeout=TIMEOUT)
    client.record_stages(True)
    seen = []

    def other() -> None:
        client.ping()
        seen.append(client.last_stamps)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen == [None]  # another thread does not record
    client.ping()
    assert client.last_stamps is not None
    client.close()


def test_no_split_without_a_publish_stamp(inproc_client):
    client = inproc_client()
    client.record_stages(True)
    t0 = time.monotonic_ns()
    client.ping()
    stamps = client.last_stamps
    assert stamps is not None and stamps[1] == 0  # the in-process transport has no publish
    assert split_stages(t0, time.monotonic_ns(), stamps, client.last_timings) is None


def test_stage_summary_means_sum_to_the_mean_round_trip():
    rng = np.random.default_rng(0)
    stages = rng.uniform(0, 10, size=(100, 5))
    stages[3] = np.nan  # a call that was not split
    summary = stage_summary(stages)
    ok = np.delete(stages, 3, axis=0)
    assert list(summary["mean_us"]) == list(STAGES)
    assert sum(summary["mean_us"].values()) == pytest.approx(ok.sum(axis=1).mean(), abs=1e-2)
    assert summary["p50_us"]["compute"] == pytest.approx(np.median(ok[:, 2]), abs=1e-3)
    assert stage_summary(np.full((3, 5), np.nan)) == {}


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_draws_on_a_terminal_only():
    quiet = io.StringIO()
    with Progress(10, "x", stream=quiet) as p:  # not a terminal
        p.update(10)
    assert quiet.getvalue() == ""
    muted = _Tty()
    with Progress(10, "x", stream=muted, quiet=True) as p:
        p.update(10)
    assert muted.getvalue() == ""
    tty = _Tty()
    p = Progress(1000, "recall", stream=tty, interval=0.0)
    p.update(250)
    p.update(0, "recall, 8 thread(s)")
    assert "recall [#######" in tty.getvalue() and "250/1,000" in tty.getvalue()
    assert "recall, 8 thread(s)" in tty.getvalue() and " 25% " in p.line()
    p.close()
    assert tty.getvalue().endswith("\r")


def test_run_interleaved_times_and_checks_every_call():
    calls: list[tuple[str, int, str]] = []
    lock = threading.Lock()

    def make(name: str, wrong_on_odd: bool) -> System:
        def call(i: int) -> int:
            with lock:
                calls.append((name, i, threading.current_thread().name))
            return i + 1 if wrong_on_odd and i % 2 else i

        return System(name, call, lambda i, got: got == i)

    order = np.arange(90) % 30
    with_progress = Progress(180, quiet=True)
    results = run_interleaved(
        [make("a", False), make("b", True)], order, 3, block=20, warmup=1, progress=with_progress
    )
    assert with_progress.done == 180
    assert results["a"].mismatches == 0
    assert results["b"].mismatches == int((order % 2).sum())
    for res in results.values():
        assert (res.samples_ns > 0).all() and res.wall_s > 0 and res.stages_us is None
    timed = [c for c in calls if c[0] == "a"]
    assert len(timed) == 90 + 3 * 5  # every item once, plus a warm-up call per thread per block
    # a thread's warm-up call precedes its block's timed calls, on an item after the block
    first_a = [c for c in calls if c[0] == "a" and c[2] == "bench-0"][:2]
    assert [i for _, i, _ in first_a] == [int(order[20]), int(order[0])]
    assert {c[2] for c in timed} == {"bench-0", "bench-1", "bench-2"}


def test_run_interleaved_splits_kalos_calls(sidecar):
    client = sidecar(dim=4).connect(timeout=TIMEOUT)
    for s in range(4):
        client.append_turn(f"s{s}", "user", "hi", [s] * (s + 1))
    system = System(
        "kalos",
        lambda i: client.context(f"s{i}", 100).tokens,
        lambda i, got: len(got) == i + 1,
        client,
    )
    results = run_interleaved([system], np.arange(40) % 4, 2, block=10, warmup=1)
    res = results["kalos"]
    assert res.mismatches == 0
    assert res.stages_us is not None and not np.isnan(res.stages_us).any()
    np.testing.assert_allclose(res.stages_us.sum(axis=1), res.samples_ns / 1e3, atol=1e-3)
    assert client._recording == 0  # the worker threads stopped recording
    client.close()


def test_plot_writes_a_png_beside_the_json(tmp_path):
    path = write_result("unit", "box", {"n": 1}, [{"system": "a"}], str(tmp_path), "cpu")
    with open(path) as f:
        assert path.endswith("unit-box-cpu.json") and json.load(f)["date"]
    rng = np.random.default_rng(1)
    png = plot_result(
        path,
        {
            "1 thread": {"a": rng.integers(1_000, 9_000, 500), "b": rng.integers(10, 90, 500)},
            "8 threads": {"a": rng.integers(5_000, 50_000, 500), "b": np.array([], np.int64)},
        },
        {"a, 1": {"client_write": 1.0, "sidecar_wait": 2.0, "compute": 3.0}},
        title="unit",
    )
    assert png == png_path(path) == path[: -len(".json")] + ".png"
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_failed_plot_keeps_the_json_and_says_why(tmp_path, capsys):
    path = write_result("unit", "box", {}, [], str(tmp_path))
    with open(path) as f:
        before = f.read()
    assert plot_result(path, {"empty": {}}) is None
    assert "no plot" in capsys.readouterr().err
    with open(path) as f:
        assert f.read() == before
    assert not any(p.suffix == ".png" for p in tmp_path.iterdir())


def test_search_gpu_stage_split_names_the_tail() -> None:
    """search-gpu's stage split: medians, p99s, and each stage's mean over the calls slower
    than the round trip's p99, so a slow 1% shows which stage it comes from."""
    from kalos.bench.common import stage_medians
    from kalos.client import Timings

    fast = [Timings(1.0, 90.0, 0.0, 100.0)] * 990
    slow = [Timings(1.0, 90.0, 0.0, 140.0)] * 10  # the client's share is 40 µs larger
    got = stage_medians(fast + slow)
    assert got["compute_us"] == 90.0 and got["client_us"] == 9.0
    assert got["tail"] == {"calls": 10, "queue_us": 1.0, "compute_us": 90.0, "write_us": 0.0,
                           "client_us": 49.0}  # fmt: skip


def test_cascade_stages_split_each_search_by_kernel() -> None:
    """search-gpu's cascade split: each search's kernels in launch order (the query's copy
    between them left out), the idle time between them, and the exact pass fitted to the rows
    each search left open."""
    from kalos.bench.search_gpu import cascade_stages

    kernels = []
    counts = []
    t = 0.0
    for i in range(100):
        rows = 1000 * (i % 10 + 1)
        exact = 5.0 + 2.0 * rows / 1000  # 5 µs + 2 µs per 1,000 rows
        kernels.append(("copy_kernel", t, t + 1))  # the query's copy: not the cascade's
        t += 2
        for name, dur in (("_prep_kernel", 3.0), ("_scan_topk_kernel", 60.0),
                          ("_emit_kernel", 4.0), ("_scan_topk_kernel", exact)):  # fmt: skip
            kernels.append((name, t, t + dur))
            t += dur + 1.5  # each stage starts 1.5 µs after the one before ends
        counts.append(rows)
        t += 50
    kernels.reverse()  # the profiler's order is not the launch order
    got = cascade_stages(kernels, counts)
    assert got["searches"] == 100
    assert got["prep"]["p50_us"] == 3.0 and got["bounds"]["p99_us"] == 60.0
    assert got["emit"]["p50_us"] == 4.0
    assert got["exact"]["p99_us"] == pytest.approx(25.0)
    assert got["gaps"]["p50_us"] == pytest.approx(4.5)  # three gaps between four kernels
    assert got["exact_fixed_us"] == pytest.approx(5.0)
    assert got["exact_us_per_1k_rows"] == pytest.approx(2.0)
    assert cascade_stages([("copy_kernel", 0.0, 1.0)], []) == {"searches": 0}


def test_split_cpus_gives_the_servers_the_last_cpu(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 0, 5})
    assert split_cpus("split") == ([0, 3], [5])
    assert split_cpus("split", 2) == ([0], [3, 5])  # search-gpu's sidecar: two CPUs
    assert split_cpus("split", 3) is None  # no CPU left for the client
    assert split_cpus("none") is None
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2})
    assert split_cpus("split") is None  # one CPU: nothing to split
    with pytest.raises(ValueError, match="split"):
        split_cpus("spread")


def test_split_cpus_on_listed_cpus(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 0, 5})
    assert split_cpus("cpus:3,0") == ([5], [0, 3])  # whatever server_cpus says
    for bad, why in (("cpus:3,0,5", "one left over"), ("cpus:4", "one left over"),
                     ("cpus:", "no CPU"), ("cpus:a", "integers")):  # fmt: skip
        with pytest.raises(ValueError, match=why):
            split_cpus(bad)
    parser = argparse.ArgumentParser()
    add_affinity_argument(parser)
    assert parser.parse_args(["--affinity", "cpus:1,2"]).affinity == "cpus:1,2"
    with pytest.raises(SystemExit):  # argparse reports a bad value and exits
        parser.parse_args(["--affinity", "cpus:x"])


def test_pin_process_pins_every_thread_of_a_child():
    cpu = max(os.sched_getaffinity(0))  # on 2+ CPUs, not what the child started with
    code = (
        "import threading, time, sys\n"
        "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
        "print('up', flush=True); sys.stdin.readline()\n"
        "import os\n"
        "tasks = os.listdir('/proc/self/task')\n"
        "print(len(tasks), sorted({c for t in tasks for c in os.sched_getaffinity(int(t))}))\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "up"
        pin_process(child.pid, [cpu])
        child.stdin.write("\n")
        child.stdin.flush()
        out, _ = child.communicate(timeout=TIMEOUT)
    finally:
        child.kill()
        child.wait()
    assert out.split(None, 1) == ["2", f"[{cpu}]\n"]


def test_write_sets_appends_and_replaces_the_same_set(tmp_path) -> None:
    from kalos.bench.common import write_sets

    def write(n: int, dim: int, rows: list, append: bool = True) -> list:
        path = write_sets("demo", "test", {"n": n, "dim": dim}, rows, str(tmp_path),
                          append=append, same=("n", "dim"), checks={})  # fmt: skip
        with open(path) as f:
            doc = json.load(f)
        return doc if isinstance(doc, list) else [doc]

    assert len(write(10, 4, [{"a": 1}])) == 1
    sets = write(20, 4, [{"a": 2}])
    assert [s["params"]["n"] for s in sets] == [10, 20]
    sets = write(10, 4, [{"a": 3}])  # the same parameters: replaced, now last
    assert [(s["params"]["n"], s["rows"][0]["a"]) for s in sets] == [(20, 2), (10, 3)]
    assert len(write(30, 8, [{"a": 4}], append=False)) == 1  # without append: this run only
