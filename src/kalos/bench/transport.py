"""transport: empty request round trip, kalos shm vs uds vs grpc, at 1 or more clients.

Every transport talks to one sidecar process (grpc over loopback TCP, and over a Unix socket),
interleaved in blocks so that drift hits them all alike; the ratios of their p50s to shm's
are the numbers to quote (target: shm >= 20x faster than grpc at p50, docs/PERFORMANCE.md).

``--concurrency 1,8,64``: at each level N, N client processes (spawned; one process does it
itself at N = 1) each make ``--requests / N`` round trips per system, in lockstep: every
process runs its block of one system, waits for the others at a barrier, then the next
system. A sample is one round trip of one client; qps is the sum over the clients.

``--affinity split`` (the default) pins the sidecar to the last CPU and the clients to the
others, so that client and sidecar each have their own cores (docs/PERFORMANCE.md's condition for
the shm target; ``params.affinity`` records it); ``none`` leaves placement to the scheduler.

Each row carries its latency at many quantiles (``quantiles``: p0.1 .. p99.9, µs), enough to
draw a CDF later; ``--samples`` also keeps every sample (``<result>.npz``, one int64 ns
array per row, keyed ``c<N>-<system>``).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import tempfile
import time
from typing import Any

import numpy as np

from kalos.bench.common import (
    add_affinity_argument,
    cpu_split,
    print_table,
    summarize,
    write_result,
)
from kalos.bench.plots import plot_result
from kalos.testing import isolated_sidecar

SCENARIO = "transport"
SHM = "kalos-shm"
# Quantiles (percent) written into each row: a CDF from p0.1 to p99.9 without raw samples.
QUANTILES = (0.1, 0.5, 1, *range(5, 100, 5), 97.5, 99, 99.5, 99.9)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--requests", type=int, default=200_000, help="timed round trips per system and level"
    )
    p.add_argument("--block", type=int, default=2_000, help="round trips per interleaved block")
    p.add_argument("--warmup", type=int, default=5_000)
    p.add_argument(
        "--concurrency",
        default="1",
        help="client counts, comma-separated, e.g. 1,8,64 (one process per client)",
    )
    p.add_argument(
        "--systems",
        default="shm,uds,grpc,grpc-unix",
        help="which of shm, uds, grpc (loopback TCP), grpc-unix to run",
    )
    p.add_argument(
        "--samples", action="store_true", help="also save every sample next to the JSON (.npz)"
    )
    p.add_argument("--suffix", default=None, help="appended to the result file names")
    add_affinity_argument(p)


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise SystemExit(f"--concurrency wants positive integers like 1,8,64, not {text!r}")
    return levels


def _block(client: Any, n: int, out: np.ndarray, at: int) -> None:
    clock = time.perf_counter_ns
    ping = client.ping
    for i in range(at, at + n):
        t0 = clock()
        ping()
        out[i] = clock() - t0


def _connect(how: tuple[str, str, str | None]) -> Any:
    from kalos.client import connect

    transport, name, runtime_dir = how
    return connect(name, transport=transport, runtime_dir=runtime_dir, timeout=30.0)


def client_run(
    systems: dict[str, tuple[str, str, str | None]],
    requests: int,
    block: int,
    warmup: int,
    barrier: Any = None,
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """One client: connects to every system, warms up, then the interleaved timed blocks.

    Returns its samples (ns) and its timed wall seconds, per system.
    """
    clients = {s: _connect(how) for s, how in systems.items()}
    try:
        for c in clients.values():
            _block(c, warmup, np.zeros(warmup, np.int64), 0)
        samples = {s: np.zeros(requests, np.int64) for s in systems}
        wall = dict.fromkeys(systems, 0.0)
        for at in range(0, requests, block):
            n = min(block, requests - at)
            for s, c in clients.items():
                if barrier is not None:
                    barrier.wait()
                t0 = time.perf_counter()
                _block(c, n, samples[s], at)
                wall[s] += time.perf_counter() - t0
        return samples, wall
    finally:
        for c in clients.values():
            c.close()


def _worker(
    work: tuple[dict[str, tuple[str, str, str | None]], int, int, int], barrier: Any, results: Any
) -> None:
    try:
        systems, requests, block, warmup = work
        results.put(client_run(systems, requests, block, warmup, barrier))
    except BaseException as exc:  # reported by the parent
        results.put(exc)
        raise


def _level(
    systems: dict[str, tuple[str, str, str | None]], clients: int, args: argparse.Namespace
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """All clients' samples and summed throughput (requests/s) per system, at ``clients``."""
    per_client = max(1, args.requests // clients)
    work = (systems, per_client, args.block, max(1, args.warmup // clients))
    if clients == 1:
        samples, wall = client_run(*work)
        return samples, {s: per_client / wall[s] for s in systems}
    ctx = multiprocessing.get_context("spawn")  # grpc does not survive a fork
    barrier = ctx.Barrier(clients)
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(work, barrier, results)) for _ in range(clients)]
    for p in procs:
        p.start()
    got: list[tuple[dict[str, np.ndarray], dict[str, float]]] = []
    try:
        for _ in procs:
            out = results.get(timeout=3600)
            if isinstance(out, BaseException):
                barrier.abort()
                raise RuntimeError(f"a client process failed: {out!r}") from out
            got.append(out)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    samples = {s: np.concatenate([g[0][s] for g in got]) for s in systems}
    qps = {s: sum(per_client / g[1][s] for g in got) for s in systems}
    return samples, qps


def run(args: argparse.Namespace) -> int:
    levels = _levels(args.concurrency)
    wanted = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(wanted) - {"shm", "uds", "grpc", "grpc-unix"}
    if unknown or "shm" not in wanted:
        raise SystemExit("--systems: shm (always) and any of uds, grpc, grpc-unix")
    if any(s.startswith("grpc") for s in wanted):
        try:
            import grpc  # noqa: F401
        except ImportError:
            print("grpcio is not installed (pip install 'kalos[grpc]'): grpc rows skipped")
            wanted = [s for s in wanted if not s.startswith("grpc")]
    rows: list[dict[str, Any]] = []
    ratios: list[dict[str, Any]] = []
    affinity: dict[str, list[int]] | str = "none"
    raw: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory(prefix="kalos-bench-") as run_dir:
        extra: tuple[str, ...] = ()
        if "grpc" in wanted:
            extra += ("--grpc", "127.0.0.1:0")
        if "grpc-unix" in wanted:
            extra += ("--grpc", f"unix:{os.path.join(run_dir, 'grpc.sock')}")
        with isolated_sidecar(
            dim=8, name="bench-transport", runtime_dir=run_dir, extra_args=extra
        ) as sidecar:
            systems: dict[str, tuple[str, str, str | None]] = {}
            for s in ("shm", "uds"):
                if s in wanted:
                    systems[f"kalos-{s}"] = (s, sidecar.name, sidecar.runtime_dir)
            listener = 0  # the sidecar's grpc listeners, in the order of --grpc above
            for s in ("grpc", "grpc-unix"):
                if s in wanted:
                    systems[f"kalos-{s}"] = ("grpc", sidecar.grpc_target(listener), None)
                    listener += 1
            with cpu_split(args.affinity, {"sidecar": sidecar.process.pid}) as affinity:
                for clients in levels:
                    samples, qps = _level(systems, clients, args)
                    level_rows = [
                        summarize(
                            s,
                            samples[s],
                            concurrency=clients,
                            quantiles=quantiles(samples[s]),
                        )
                        for s in systems
                    ]
                    for row in level_rows:
                        row["qps"] = round(qps[row["system"]], 1)
                        raw[f"c{clients}-{row['system']}"] = samples[row["system"]]
                    shm_p50 = level_rows[0]["p50_us"]
                    ratio: dict[str, Any] = {"concurrency": clients}
                    for row in level_rows[1:]:
                        key = (
                            f"{row['system'].removeprefix('kalos-').replace('-', '_')}_over_shm_p50"
                        )
                        ratio[key] = round(row["p50_us"] / shm_p50, 2)
                        level_rows[0][key] = ratio[key]
                    rows += level_rows
                    ratios.append(ratio)
    print_table(rows, ("system", "concurrency", "p50_us", "p99_us", "p999_us", "qps"))
    for ratio in ratios:
        for key, value in ratio.items():
            if key != "concurrency":
                name = key.removesuffix("_over_shm_p50").replace("_", "-")
                target = "  (target >= 20x)" if name == "grpc" else ""
                print(f"c={ratio['concurrency']}: {name} / shm at p50: {value:.1f}x{target}")
    params = {
        "requests": args.requests,
        "block": args.block,
        "body_bytes": 0,
        "concurrency": levels,
        "quantiles": list(QUANTILES),
        "affinity": affinity,
    }
    path = write_result(SCENARIO, args.machine, params, rows, args.out, args.suffix, ratios=ratios)
    print(f"wrote {path}")
    groups: dict[str, dict[str, np.ndarray]] = {}
    for key, ns in raw.items():
        level, system = key.split("-", 1)
        groups.setdefault(f"{level.removeprefix('c')} client(s)", {})[system] = ns
    png = plot_result(path, groups)
    if png:
        print(f"wrote {png}")
    if args.samples:
        np.savez_compressed(path.removesuffix(".json") + ".npz", **raw)  # type: ignore[arg-type]
        print(f"wrote {path.removesuffix('.json')}.npz")
    return 0


def quantiles(samples_ns: np.ndarray) -> dict[str, float]:
    """Latency at each of QUANTILES, µs, keyed "p0.1" .. "p99.9": a CDF's points."""
    us = np.percentile(np.asarray(samples_ns, np.float64) / 1e3, QUANTILES)
    return {f"p{q:g}": round(float(v), 3) for q, v in zip(QUANTILES, us, strict=True)}
