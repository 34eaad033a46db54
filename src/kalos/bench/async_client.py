"""async: round trips through AsyncClient vs the sync Client, one and N at a time.

One sidecar, shm. Systems, interleaved in blocks so that drift hits all alike:
``sync`` (the call on one thread), ``async`` (awaited from one task), ``sync-xN`` (N threads
sharing a Client) and ``async-xN`` (N tasks sharing an AsyncClient, each latency measured
around its own await). The call is a ping (``--op ping``, the default) or an exact top-10
search of ``--rows`` random 384-d rows (``--op search``: a call that keeps the sidecar busy
for a while, where how the callers wait for it matters). The number to quote is async over
sync at p50 (the cost of the two thread hops), and the throughputs side by side. With
``--append`` the file keeps its set of the other op beside this run's.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kalos.async_client import AsyncClient
from kalos.bench.common import print_table, summarize, write_sets
from kalos.testing import isolated_sidecar

SCENARIO = "async"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=50_000, help="timed round trips per system")
    p.add_argument("--block", type=int, default=1_000, help="round trips per interleaved block")
    p.add_argument("--warmup", type=int, default=2_000)
    p.add_argument("--concurrency", type=int, default=8, help="N of the -xN systems")
    p.add_argument("--op", choices=("ping", "search"), default="ping", help="the call timed")
    p.add_argument("--rows", type=int, default=1000, help="--op search: the index's rows")
    p.add_argument("--append", action="store_true",
                   help="keep the file's set of the other op beside this run's")  # fmt: skip


DIM = 384  # --op search
K = 10


def _call(client: Any, queries: np.ndarray | None) -> Callable[[int], Any]:
    """The timed call of request ``i``: a ping, or a search of query ``i`` (mod their count)."""
    if queries is None:
        ping = client.ping
        return lambda i: ping()
    search, m = client.search, len(queries)
    return lambda i: search(queries[i % m], K, payloads=False)


def _sync_block(client, q: np.ndarray | None, n: int, out: np.ndarray, at: int) -> None:
    clock = time.perf_counter_ns
    call = _call(client, q)
    for i in range(at, at + n):
        t0 = clock()
        call(i)
        out[i] = clock() - t0


def _sync_threads(client, q: np.ndarray | None, n: int, threads: int, out: np.ndarray,
                  at: int) -> None:  # fmt: skip
    share = n // threads
    workers = [
        threading.Thread(target=_sync_block, args=(client, q, share, out, at + i * share))
        for i in range(threads)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


async def _async_block(client: AsyncClient, q: np.ndarray | None, n: int, out: np.ndarray,
                       at: int) -> None:  # fmt: skip
    clock = time.perf_counter_ns
    call = _call(client, q)
    for i in range(at, at + n):
        t0 = clock()
        await call(i)
        out[i] = clock() - t0


async def _async_tasks(client: AsyncClient, q: np.ndarray | None, n: int, tasks: int,
                       out: np.ndarray, at: int) -> None:  # fmt: skip
    share = n // tasks
    await asyncio.gather(
        *(_async_block(client, q, share, out, at + i * share) for i in range(tasks))
    )


def run(args: argparse.Namespace) -> int:
    c = args.concurrency
    per_block = args.block - args.block % c  # the -xN systems split a block evenly
    requests = args.requests - args.requests % per_block
    systems = ("sync", "async", f"sync-x{c}", f"async-x{c}")
    samples = {s: np.zeros(requests, np.int64) for s in systems}
    wall = dict.fromkeys(systems, 0.0)
    searching = args.op == "search"
    q: np.ndarray | None = None
    with isolated_sidecar(dim=DIM if searching else 8, name="bench-async") as sidecar:
        sync = sidecar.connect(transport="shm")
        if searching:
            rng = np.random.default_rng(0)
            sync.add(rng.standard_normal((args.rows, DIM)).astype(np.float32),
                     np.arange(args.rows, dtype=np.int64))  # fmt: skip
            q = rng.standard_normal((256, DIM)).astype(np.float32)

        async def main() -> None:
            aclient = AsyncClient(sidecar.name, runtime_dir=sidecar.runtime_dir, max_channels=c)
            async with aclient:
                warm = np.zeros(args.warmup, np.int64)
                _sync_block(sync, q, args.warmup, warm, 0)
                await _async_block(aclient, q, args.warmup, warm, 0)
                await _async_tasks(aclient, q, args.warmup - args.warmup % c, c, warm, 0)
                for at in range(0, requests, per_block):
                    for s in systems:
                        t0 = time.perf_counter()
                        if s == "sync":
                            _sync_block(sync, q, per_block, samples[s], at)
                        elif s == "async":
                            await _async_block(aclient, q, per_block, samples[s], at)
                        elif s.startswith("sync-"):
                            _sync_threads(sync, q, per_block, c, samples[s], at)
                        else:
                            await _async_tasks(aclient, q, per_block, c, samples[s], at)
                        wall[s] += time.perf_counter() - t0

        asyncio.run(main())
        sync.close()
    rows = [summarize(s, samples[s], wall[s]) for s in systems]
    hop = rows[1]["p50_us"] - rows[0]["p50_us"]
    rows[1]["async_minus_sync_p50_us"] = round(hop, 2)
    rows[1]["async_over_sync_p50"] = round(rows[1]["p50_us"] / rows[0]["p50_us"], 2)
    rows[3]["async_over_sync_qps"] = round(rows[3]["qps"] / rows[2]["qps"], 2)
    print_table(rows)
    print(
        f"one at a time: async costs {hop:+.1f} us at p50 ({rows[1]['async_over_sync_p50']}x); "
        f"x{c}: async/sync throughput {rows[3]['async_over_sync_qps']}x"
    )
    params: dict[str, Any] = {"op": args.op, "requests": requests, "block": per_block,
                              "concurrency": c, "transport": "shm"}  # fmt: skip
    if searching:
        params.update(rows=args.rows, dim=DIM, k=K, index="cpu:flat")
    path = write_sets(SCENARIO, args.machine, params, rows, args.out, append=args.append,
                      same=("op",))  # fmt: skip
    print(f"wrote {path}")
    return 0
