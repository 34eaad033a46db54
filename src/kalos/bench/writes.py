"""writes: acknowledged adds per second with the write-ahead log, 1 vs 8 writers, by fsync policy.

Each configuration is its own sidecar (``--data-dir`` in a temporary directory, ``--fsync``
POLICY) and W writer threads, each with its own shm channel, adding one 128-d float32 item
with a ~100-byte payload per request for ``--seconds``; rounds alternate the configurations so
that drift hits all alike. Also reported: the mean number of records per fsync (what group
commit buys: with fsync=always, W writers share each sync), and the same load without
``--data-dir`` (in memory only) as the ceiling.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import threading
import time

import numpy as np

from kalos.bench.common import print_table, summarize, write_result
from kalos.testing import isolated_sidecar

SCENARIO = "writes"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--seconds", type=float, default=4.0, help="per configuration and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--writers", type=int, nargs="+", default=[1, 8])
    p.add_argument("--policies", nargs="+", default=["always", "interval:10", "off", "memory"])
    p.add_argument("--data-root", default=None, help="parent of the temporary data dirs")


def _run_config(args, policy: str, writers: int, seed: int) -> dict:
    data = tempfile.mkdtemp(prefix="kalos-writes-", dir=args.data_root)
    extra = () if policy == "memory" else ("--data-dir", data, "--fsync", policy)
    try:
        with isolated_sidecar(dim=args.dim, name="bench-writes", extra_args=extra) as sc:
            clients = [sc.connect(timeout=30.0) for _ in range(writers)]
            rng = np.random.default_rng(seed)
            vecs = rng.standard_normal((writers, 256, args.dim), dtype=np.float32)
            payload = "x" * 100
            for t, c in enumerate(clients):  # warm-up: channels open, first segment made
                c.add(vecs[t, 0], t * 10_000_000 + 9_999_999, payload)
            before = clients[0].stats().get("durability", {})
            lat: list[list[int]] = [[] for _ in range(writers)]
            barrier = threading.Barrier(writers + 1)
            stop_at = [0.0]

            def work(t: int) -> None:
                c, out, v = clients[t], lat[t], vecs[t]
                clock = time.perf_counter_ns
                base = t * 10_000_000
                barrier.wait()
                i = 0
                while time.perf_counter() < stop_at[0]:
                    t0 = clock()
                    c.add(v[i & 255], base + i, payload)
                    out.append(clock() - t0)
                    i += 1

            threads = [threading.Thread(target=work, args=(t,)) for t in range(writers)]
            for th in threads:
                th.start()
            stop_at[0] = time.perf_counter() + args.seconds
            t0 = time.perf_counter()
            barrier.wait()
            for th in threads:
                th.join()
            wall = time.perf_counter() - t0
            after = clients[0].stats().get("durability", {})
            for c in clients:
                c.close()
    finally:
        shutil.rmtree(data, ignore_errors=True)
    syncs = after.get("syncs", 0) - before.get("syncs", 0)
    records = after.get("last_lsn", 0) - before.get("last_lsn", 0)
    return {
        "samples": np.array([x for out in lat for x in out], np.int64),
        "wall": wall,
        "syncs": syncs,
        "records": records,
    }


def run(args: argparse.Namespace) -> int:
    configs = [(p, w) for p in args.policies for w in args.writers]
    parts: dict[tuple[str, int], list[dict]] = {c: [] for c in configs}
    for r in range(args.rounds):
        order = configs if r % 2 == 0 else configs[::-1]
        for policy, writers in order:
            res = _run_config(args, policy, writers, seed=r)
            parts[(policy, writers)].append(res)
            print(
                f"round {r + 1}: fsync={policy} writers={writers}: "
                f"{len(res['samples']) / res['wall']:.0f} adds/s"
            )
    rows = []
    for policy, writers in configs:
        ps = parts[(policy, writers)]
        samples = np.concatenate([p["samples"] for p in ps])
        wall = sum(p["wall"] for p in ps)
        syncs = sum(p["syncs"] for p in ps)
        records = sum(p["records"] for p in ps)
        row = summarize(
            f"kalos-shm fsync={policy}",
            samples,
            wall,
            fsync=policy,
            writers=writers,
            adds_per_s=round(len(samples) / wall, 1),
            syncs_per_s=round(syncs / wall, 1) if policy != "memory" else None,
            records_per_sync=round(records / syncs, 2) if syncs else None,
        )
        rows.append(row)
    by = {(r["fsync"], r["writers"]): r for r in rows}
    ratios = {}
    lo, hi = min(args.writers), max(args.writers)
    for policy in args.policies:
        if (policy, lo) in by and (policy, hi) in by and lo != hi:
            ratios[f"{policy}: {hi} writers / {lo}"] = round(
                by[(policy, hi)]["adds_per_s"] / by[(policy, lo)]["adds_per_s"], 2
            )
    for w in args.writers:
        if ("always", w) in by and ("off", w) in by:
            ratios[f"{w} writers: always / off"] = round(
                by[("always", w)]["adds_per_s"] / by[("off", w)]["adds_per_s"], 3
            )
    print_table(
        rows,
        ("system", "writers", "adds_per_s", "p50_us", "p99_us", "records_per_sync", "syncs_per_s"),
    )
    for k, v in ratios.items():
        print(f"{k}: {v}x")
    params = {
        "dim": args.dim,
        "dtype": "float32",
        "items_per_add": 1,
        "payload_bytes": 100,
        "seconds_per_round": args.seconds,
        "rounds": args.rounds,
        "transport": "shm",
        "writers_are": "threads of one process, one channel each",
    }
    path = write_result(SCENARIO, args.machine, params, rows, args.out, ratios=ratios)
    print(f"wrote {path}")
    return 0
