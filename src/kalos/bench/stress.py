"""stress: 8 processes x 8 threads of mixed reads and writes, every response checked.

Each thread works on ids, a scope and state keys private to it, so it knows exactly what every
response must be (as tests/test_multiprocess.py does): a search for a vector it added must
return that id and payload first and its scope must hold exactly its live ids; an upsert must
count as new or not; a remove must count what existed; a state read must return the value it
last wrote. A response meant for another thread, a stale arena or a lost request shows up as
a mismatch; a request that raised (a deadline missed, a lost sidecar) counts as lost.
Reported: throughput, latency percentiles of every request, mismatched and lost (both must
be 0).
"""

from __future__ import annotations

import argparse
import array
import multiprocessing
import threading
import time
import traceback

import numpy as np

from kalos.bench.common import print_table, summarize, write_result
from kalos.testing import isolated_sidecar

SCENARIO = "stress"
DIM = 16
SLOTS = 6  # ids per thread
K = SLOTS + 2  # searches ask for more than the thread's scope holds: the tail must be -1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seconds", type=float, default=60.0, help="how long the load runs")
    p.add_argument("--processes", type=int, default=8)
    p.add_argument("--threads", type=int, default=8, help="client threads per process")
    p.add_argument("--transport", choices=("shm", "uds"), default="shm")
    p.add_argument("--timeout", type=float, default=30.0, help="each call's deadline, s")


class Tally:
    """One thread's counts, samples (ns) and the first few mismatches."""

    def __init__(self) -> None:
        self.requests = 0
        self.mismatched = 0
        self.lost = 0
        self.samples = array.array("q")
        self.examples: list[str] = []

    def mismatch(self, what: str) -> None:
        self.mismatched += 1
        if len(self.examples) < 5:
            self.examples.append(what)


def run_thread(client, p: int, t: int, threads: int, end: float, tally: Tally) -> None:
    from kalos import NotFound, Scope

    rng = np.random.default_rng(1000 * p + t)
    base = (p * threads + t) * 1_000_000
    scope = Scope(f"proc-{p}", f"thread-{t}")
    live: dict[int, tuple[np.ndarray, str]] = {}  # id -> (vector, payload)
    state: dict[str, bytes] = {}
    clock = time.perf_counter_ns
    samples = tally.samples
    while time.monotonic() < end:
        roll = rng.random()
        where = f"p{p} t{t} request {tally.requests}"
        t0 = clock()
        try:
            if roll < 0.05:
                client.ping()
            elif roll < 0.25:
                item = base + int(rng.integers(SLOTS))
                v = rng.standard_normal(DIM).astype(np.float32)
                payload = f"p{p}-t{t}-i{tally.requests}"
                new = client.add(v, item, payload, scope=scope)
                if new != (0 if item in live else 1):
                    tally.mismatch(f"{where}: add of {item} counted {new} new")
                live[item] = (v, payload)
            elif roll < 0.32:
                item = base + int(rng.integers(SLOTS))
                removed = client.remove([item, base + SLOTS + 99])  # and an id never added
                if removed != (1 if item in live else 0):
                    tally.mismatch(f"{where}: remove of {item} counted {removed}")
                live.pop(item, None)
            elif roll < 0.40:
                key = f"k{int(rng.integers(4))}"
                value = rng.bytes(int(rng.integers(1, 64)))
                client.put(key, value, scope=scope)
                state[key] = value
            elif roll < 0.50:
                key = f"k{int(rng.integers(4))}"
                try:
                    got = client.get(key, scope=scope).value
                except NotFound:
                    got = None
                if got != state.get(key):
                    tally.mismatch(f"{where}: state {key} read {got!r}, wrote {state.get(key)!r}")
            else:
                if live and roll < 0.95:
                    item = list(live)[int(rng.integers(len(live)))]
                    v, payload = live[item]
                else:
                    item, v, payload = -1, rng.standard_normal(DIM).astype(np.float32), ""
                r = client.search(v, k=K, scope=scope)
                ids = r.ids.tolist()
                if set(ids[: len(live)]) != set(live) or ids[len(live) :] != [-1] * (K - len(live)):
                    tally.mismatch(f"{where}: scope holds {ids}, expected {sorted(live)}")
                elif item != -1 and (ids[0] != item or r.payloads[0] != payload):
                    tally.mismatch(f"{where}: search for {item} returned {ids[0]}")
        except Exception:
            tally.lost += 1
            if len(tally.examples) < 5:
                tally.examples.append(f"{where}: {traceback.format_exc(limit=2)}")
        samples.append(clock() - t0)
        tally.requests += 1


def run_process(
    p: int, name: str, runtime_dir: str, transport: str, threads: int, end: float, timeout: float
) -> tuple[int, int, int, bytes, list[str]]:
    import kalos

    client = kalos.connect(name, runtime_dir=runtime_dir, transport=transport, timeout=timeout)
    tallies = [Tally() for _ in range(threads)]
    workers = [
        threading.Thread(target=run_thread, args=(client, p, t, threads, end, tallies[t]))
        for t in range(threads)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    client.close()
    samples = array.array("q")
    for tally in tallies:
        samples.extend(tally.samples)
    return (
        sum(x.requests for x in tallies),
        sum(x.mismatched for x in tallies),
        sum(x.lost for x in tallies),
        samples.tobytes(),
        [e for x in tallies for e in x.examples],
    )


def run(args: argparse.Namespace) -> int:
    ctx = multiprocessing.get_context("spawn")
    with isolated_sidecar(dim=DIM, metric="l2", name="bench-stress") as sidecar:
        with ctx.Pool(args.processes) as pool:
            # Start after the processes are up (spawn imports take a while on 2 cores).
            pool.map(int, range(args.processes))
            start = time.monotonic()
            end = start + args.seconds
            results = pool.starmap(
                run_process,
                [
                    (p, sidecar.name, sidecar.runtime_dir, args.transport, args.threads, end,
                     args.timeout)
                    for p in range(args.processes)
                ],
            )  # fmt: skip
            wall = time.monotonic() - start
        with sidecar.connect() as client:
            stats = client.stats()
        alive = sidecar.process.poll() is None
    requests = sum(r[0] for r in results)
    mismatched = sum(r[1] for r in results)
    lost = sum(r[2] for r in results)
    samples = np.concatenate([np.frombuffer(r[3], np.int64) for r in results])
    examples = [e for r in results for e in r[4]]
    served = sum(stats["requests"].values())
    row = summarize(
        f"kalos-{args.transport}",
        samples,
        wall,
        requests=requests,
        mismatched=mismatched,
        lost=lost,
        sidecar_requests=served,
        sidecar_errors=stats["errors"],
        sidecar_alive=alive,
    )
    print_table([row], ("system", "p50_us", "p99_us", "p999_us", "qps", "mismatched", "lost"))
    print(f"{requests} requests in {wall:.1f} s: {mismatched} mismatched, {lost} lost")
    for e in examples[:10]:
        print(e)
    path = write_result(
        SCENARIO,
        args.machine,
        {
            "processes": args.processes,
            "threads": args.threads,
            "seconds": args.seconds,
            "transport": args.transport,
            "dim": DIM,
            "mix": "search 50%, add 20%, get 10%, put 8%, remove 7%, ping 5%",
        },
        [row],
        args.out,
    )
    print(f"wrote {path}")
    return 0 if mismatched == 0 and lost == 0 and alive else 1
