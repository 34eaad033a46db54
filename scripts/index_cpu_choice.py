"""Scenario ``index-cpu-choice``: which exact CPU backend becomes ``"cpu:flat"``.

100K x 128 float32, exact top-10, one query per search (nq=1), inner product. cpu:flat (numpy)
and cpu:faiss-flat run side by side in one process, interleaved query by query (the order of
the two alternates), 2,000 timed searches each after a warm-up. Every timed result is checked
against a float64 reference (recall@10), so a fast wrong answer cannot win. A third row times
the naive in-process numpy search (``np.argpartition(db @ q)``) for scale.

    .venv/bin/python scripts/index_cpu_choice.py --machine ci-2core   # needs the faiss extra

Writes ``bench/results/index-cpu-choice-<machine>.json`` in the results shape of
docs/PERFORMANCE.md (the date inside).
OPENBLAS_CORETYPE and thread counts are recorded as found; this script never changes them.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as dt
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

SCENARIO = "index-cpu-choice"
SYSTEMS = ("cpu:flat", "cpu:faiss-flat")


def openblas_info() -> list[dict[str, Any]]:
    """Core name, config and threads of every OpenBLAS loaded in this process (numpy, faiss)."""
    found: list[dict[str, Any]] = []
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return found
    paths = sorted({line.split()[-1] for line in maps.splitlines() if "openblas" in line})
    for path in paths:
        lib = ctypes.CDLL(path)
        info: dict[str, Any] = {"lib": os.path.basename(path)}
        for key, names, restype in (
            (
                "corename",
                ("scipy_openblas_get_corename64_", "openblas_get_corename"),
                ctypes.c_char_p,
            ),
            ("config", ("scipy_openblas_get_config64_", "openblas_get_config"), ctypes.c_char_p),
            (
                "threads",
                ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads"),
                ctypes.c_int,
            ),
        ):
            for name in names:
                fn = getattr(lib, name, None)
                if fn is not None:
                    fn.restype = restype
                    value = fn()
                    info[key] = value.decode() if isinstance(value, bytes) else value
                    break
        found.append(info)
    return found


def reference_top_k(db: np.ndarray, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact float64 top-k ids [nq, k] and the k-th best score [nq] of each query."""
    db64 = db.astype(np.float64)
    ids = np.empty((queries.shape[0], k), dtype=np.int64)
    kth = np.empty(queries.shape[0])
    for start in range(0, queries.shape[0], 100):
        scores = queries[start : start + 100].astype(np.float64) @ db64.T
        part = np.argpartition(-scores, k - 1, axis=1)[:, :k]
        ids[start : start + 100] = part
        kth[start : start + 100] = np.take_along_axis(scores, part, axis=1).min(axis=1)
    return ids, kth


def recall_at_k(got: np.ndarray, want: np.ndarray) -> float:
    """Mean |got ∩ want| / k over queries."""
    hits = sum(len(set(g.tolist()) & set(w.tolist())) for g, w in zip(got, want, strict=True))
    return hits / want.size


def summarise(system: str, ns: np.ndarray, recall: float) -> dict[str, Any]:
    us = ns / 1e3
    return {
        "system": system,
        "p50_us": round(float(np.percentile(us, 50)), 1),
        "p99_us": round(float(np.percentile(us, 99)), 1),
        "p999_us": round(float(np.percentile(us, 99.9)), 1),
        "mean_us": round(float(us.mean()), 1),
        "qps": round(1e6 / float(us.mean()), 1),
        "recall_at_k": round(recall, 5),
        "searches": int(ns.shape[0]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--machine", default="ci-2core", help="short machine name for the file")
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--searches", type=int, default=2_000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--seed", type=int, default=20261129)
    parser.add_argument("--date", default=dt.date.today().isoformat())
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent.parent / "bench" / "results"
    )
    parser.add_argument(
        "--append", action="store_true", help="add this run to the file (a list of runs)"
    )
    args = parser.parse_args(argv)

    import faiss

    from kalos.index import create

    rng = np.random.default_rng(args.seed)
    db = rng.standard_normal((args.n, args.dim), dtype=np.float32)
    ids = np.arange(args.n, dtype=np.int64)
    queries = rng.standard_normal((args.warmup + args.searches, args.dim), dtype=np.float32)
    k = args.k

    indexes = {spec: create(spec, dim=args.dim, metric="ip") for spec in SYSTEMS}
    for index in indexes.values():
        index.add(db, ids)

    def naive(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        scores = db @ q
        top = np.argpartition(scores, scores.shape[0] - k)[scores.shape[0] - k :]
        top = top[np.argsort(-scores[top])]
        return scores[top], top

    def searcher(index: Any) -> Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]:
        return lambda q: index.search(q, k)

    runners = {spec: searcher(index) for spec, index in indexes.items()}
    runners["numpy-naive-inprocess"] = naive
    names = list(runners)

    clock = time.perf_counter_ns

    def timed(name: str, q: np.ndarray) -> tuple[int, np.ndarray]:
        start = clock()
        out = runners[name](q)
        elapsed = clock() - start
        return elapsed, out[1].reshape(-1)  # ids: [1, k] from an index, [k] from naive

    load_before = [round(x, 2) for x in os.getloadavg()]
    # phase 1, the one that decides: interleaved query by query, alternating who goes first
    timings = {name: np.empty(args.searches, dtype=np.int64) for name in names}
    results = {name: np.empty((args.searches, k), dtype=np.int64) for name in names}
    for i, q in enumerate(queries):
        t = i - args.warmup
        for name in names if i % 2 == 0 else names[::-1]:
            elapsed, got = timed(name, q)
            if t >= 0:
                timings[name][t], results[name][t] = elapsed, got
    # phase 2, for context: each system alone for blocks of 250 queries, blocks alternating.
    # In one process FAISS's OpenMP workers (spin-waiting after each call) and OpenBLAS's
    # threads compete for 2 cores when interleaved; blocks show each without the other.
    blocked = {name: np.empty(args.searches, dtype=np.int64) for name in names}
    timed_queries = queries[args.warmup :]
    for start in range(0, args.searches, 250):
        for name in names if (start // 250) % 2 == 0 else names[::-1]:
            for q in queries[: args.warmup // 4]:  # re-warm after the other system ran
                timed(name, q)
            for t in range(start, min(start + 250, args.searches)):
                blocked[name][t], _ = timed(name, timed_queries[t])
    load_after = [round(x, 2) for x in os.getloadavg()]

    ref_ids, _ = reference_top_k(db, timed_queries, k)
    rows = [summarise(n, timings[n], recall_at_k(results[n], ref_ids)) for n in names]
    for row in rows:
        row["mode"] = "interleaved"
    by_name = {r["system"]: r for r in rows}
    for name in names:
        row = summarise(name, blocked[name], by_name[name]["recall_at_k"])
        row["mode"] = "blocks-of-250"
        rows.append(row)
    flat, faissf = by_name["cpu:flat"], by_name["cpu:faiss-flat"]
    winner = min(SYSTEMS, key=lambda s: float(by_name[s]["p50_us"]))

    record: dict[str, Any] = {
        "scenario": SCENARIO,
        "machine": args.machine,
        "date": args.date,
        "versions": {
            "kalos": _kalos_version(),
            "python": platform.python_version(),
            "numpy": np.__version__,
            "faiss": faiss.__version__,
        },
        "params": {
            "n": args.n,
            "dim": args.dim,
            "dtype": "float32",
            "k": k,
            "nq": 1,
            "metric": "ip",
            "searches": args.searches,
            "warmup": args.warmup,
            "seed": args.seed,
            "interleaved": True,
            "blocks": 250,
        },
        "env": {
            "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE"),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS"),
            "cpu_count": os.cpu_count(),
            "cpu": _cpu_model(),
            "faiss_omp_threads": faiss.omp_get_max_threads(),
            "openblas": openblas_info(),
            # the CI-class VM is shared: other jobs' load inflates both rows alike (interleaved)
            "loadavg_1_5_15_before": load_before,
            "loadavg_1_5_15_after": load_after,
        },
        "rows": rows,
        "ratios": {
            "faiss_over_numpy_p50": round(faissf["p50_us"] / flat["p50_us"], 2),
            "faiss_over_numpy_p99": round(faissf["p99_us"] / flat["p99_us"], 2),
        },
        "choice": {
            "cpu:flat": "numpy" if winner == "cpu:flat" else "faiss",
            "by": "p50_us, interleaved rows",
        },
    }

    print(f"{SCENARIO}: {args.n} x {args.dim} float32, top-{k}, nq=1, {args.searches} searches")
    print(f"{'system':32} {'p50 µs':>10} {'p99 µs':>10} {'p99.9 µs':>10} {'qps':>8} {'recall':>8}")
    for r in rows:
        print(
            f"{r['system'] + ' (' + r['mode'][:6] + ')':32} {r['p50_us']:>10} {r['p99_us']:>10}"
            f" {r['p999_us']:>10}"
            f" {r['qps']:>8} {r['recall_at_k']:>8}"
        )
    print(
        f"faiss / numpy: p50 {record['ratios']['faiss_over_numpy_p50']}x,"
        f" p99 {record['ratios']['faiss_over_numpy_p99']}x; faster at p50: {winner}"
    )
    print(
        f"OPENBLAS_CORETYPE={record['env']['OPENBLAS_CORETYPE']};"
        f" load average before/after {load_before} / {load_after}"
    )

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{SCENARIO}-{args.machine}.json"
    runs: list[dict[str, Any]] = []
    if args.append and path.exists():
        previous = json.loads(path.read_text())
        runs = previous if isinstance(previous, list) else [previous]
    runs.append(record)
    path.write_text(json.dumps(runs if len(runs) > 1 else record, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


def _kalos_version() -> str:
    try:
        from importlib.metadata import version

        return version("kalos")
    except Exception:
        return "0.1.0+src"


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


if __name__ == "__main__":
    sys.exit(main())
