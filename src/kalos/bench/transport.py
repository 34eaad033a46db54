"""transport: empty request round trip, one client, kalos shm vs kalos uds (BENCHMARKS.md).

Both transports talk to one sidecar process, interleaved in blocks so that drift hits both
alike; the ratio of their p50s is the number to quote.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from kalos.bench.common import print_table, summarize, write_result
from kalos.testing import isolated_sidecar

SCENARIO = "transport"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=200_000, help="timed round trips per system")
    p.add_argument("--block", type=int, default=2_000, help="round trips per interleaved block")
    p.add_argument("--warmup", type=int, default=5_000)


def _block(client, n: int, out: np.ndarray, at: int) -> None:
    clock = time.perf_counter_ns
    ping = client.ping
    for i in range(at, at + n):
        t0 = clock()
        ping()
        out[i] = clock() - t0


def run(args: argparse.Namespace) -> int:
    systems = ("kalos-shm", "kalos-uds")
    samples = {s: np.zeros(args.requests, np.int64) for s in systems}
    queue = np.zeros(args.requests, np.int64)
    with isolated_sidecar(dim=8, name="bench-transport") as sidecar:
        clients = {
            "kalos-shm": sidecar.connect(transport="shm"),
            "kalos-uds": sidecar.connect(transport="uds"),
        }
        for s in systems:
            _block(clients[s], args.warmup, np.zeros(args.warmup, np.int64), 0)
        wall = dict.fromkeys(systems, 0.0)
        for at in range(0, args.requests, args.block):
            n = min(args.block, args.requests - at)
            for s in systems:
                t0 = time.perf_counter()
                _block(clients[s], n, samples[s], at)
                wall[s] += time.perf_counter() - t0
                if s == "kalos-shm":
                    queue[at : at + n] = int(clients[s].last_timings.queue_us * 1e3)
        for c in clients.values():
            c.close()
    rows = [summarize(s, samples[s], wall[s]) for s in systems]
    ratio = rows[1]["p50_us"] / rows[0]["p50_us"]
    rows[0]["uds_over_shm_p50"] = round(ratio, 2)
    print_table(rows)
    print(f"uds / shm at p50: {ratio:.1f}x")
    path = write_result(
        SCENARIO,
        args.machine,
        {"requests": args.requests, "block": args.block, "body_bytes": 0},
        rows,
        args.out,
    )
    print(f"wrote {path}")
    return 0
