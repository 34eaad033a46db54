"""replicas: kalos serve --source, 3 sidecars on one PostgreSQL: write-to-visible, throughput.

Starts its own PostgreSQL server (kalos.testing_postgres: initdb into a temporary directory,
fsync on) and ``--replicas`` sidecars on it, each its own process, as stand-ins for hosts.

- ``write-to-visible``: one add at a time, through the sidecars in turn; the time from the
  call until every sidecar's search finds the item (the writer's own ack included), polled
  from one client thread.
- ``write throughput``: W writer threads adding one item per request for ``--seconds``,
  all through one sidecar, then spread over all of them.
- ``bootstrap``: ``--bootstrap-rows`` rows COPYed into the table, then a fresh sidecar's load
  (start to ready) of them.

``checks.lost``: acknowledged adds missing from the table or from any sidecar at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from kalos.bench.common import print_table, summarize, write_result
from kalos.testing import isolated_sidecar
from kalos.testing_postgres import postgres_server

SCENARIO = "replicas"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--visible-writes", type=int, default=300, help="write-to-visible samples")
    p.add_argument("--seconds", type=float, default=4.0, help="per throughput configuration")
    p.add_argument("--writers", type=int, default=3, help="writer threads for the throughput")
    p.add_argument("--bootstrap-rows", type=int, default=100_000)


def _vectors(n: int, dim: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, dim), dtype=np.float32)


def _visible(clients: list[Any], q: np.ndarray, item: int) -> bool:
    return all(int(c.search(q, k=1).ids[0, 0]) == item for c in clients)


def _write_to_visible(clients: list[Any], dim: int, n: int, acked: set[int]) -> np.ndarray:
    vecs = _vectors(n, dim, 1)
    out = np.empty(n, np.int64)
    clock = time.perf_counter_ns
    for i in range(n):
        item = 1_000_000_000 + i
        q = vecs[i : i + 1]
        t0 = clock()
        clients[i % len(clients)].add(q, [item])
        acked.add(item)
        deadline = time.monotonic() + 10
        while not _visible(clients, q, item):
            if time.monotonic() > deadline:
                raise RuntimeError(f"item {item} not visible on every sidecar within 10 s")
        out[i] = clock() - t0
    return out


def _throughput(clients: list[Any], writers: int, seconds: float, dim: int, base: int,
                acked: set[int]) -> tuple[np.ndarray, float]:  # fmt: skip
    vecs = _vectors(256, dim, 2)
    lat: list[list[int]] = [[] for _ in range(writers)]
    done: list[list[int]] = [[] for _ in range(writers)]
    barrier = threading.Barrier(writers + 1)
    stop_at = [0.0]

    def work(t: int) -> None:
        c = clients[t % len(clients)]
        clock = time.perf_counter_ns
        barrier.wait()
        i = 0
        while time.perf_counter() < stop_at[0]:
            item = base + t * 10_000_000 + i
            t0 = clock()
            c.add(vecs[i & 255], [item])
            lat[t].append(clock() - t0)
            done[t].append(item)
            i += 1

    threads = [threading.Thread(target=work, args=(t,)) for t in range(writers)]
    for th in threads:
        th.start()
    stop_at[0] = time.perf_counter() + seconds
    t0 = time.perf_counter()
    barrier.wait()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    for d in done:
        acked.update(d)
    return np.array([x for out in lat for x in out], np.int64), wall


def _bootstrap(pg: Any, dim: int, rows: int) -> dict[str, Any]:
    import psycopg

    conninfo = pg.create_database("kalos_bootstrap")
    with tempfile.TemporaryDirectory(prefix="kalos-bench-") as tmp:
        source_file = Path(tmp) / "source"
        source_file.write_text(conninfo)
        extra = ("--source-file", str(source_file))
        with isolated_sidecar(dim=dim, name="bench-boot", extra_args=extra) as sc:
            sc.connect(timeout=30).close()  # the schema, made by a first sidecar
        t0 = time.perf_counter()
        with psycopg.connect(conninfo) as conn, conn.cursor() as cur:
            with cur.copy("COPY kalos_memories (id, vector) FROM STDIN (FORMAT BINARY)") as copy:
                copy.set_types(["int8", "bytea"])
                for start in range(0, rows, 10_000):
                    block = _vectors(min(10_000, rows - start), dim, start)
                    for j in range(len(block)):
                        copy.write_row((start + j, block[j].tobytes()))
            conn.commit()
        insert_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        with isolated_sidecar(dim=dim, name="bench-boot", extra_args=extra) as sc:
            c = sc.connect(timeout=600)
            ready_s = time.perf_counter() - t0
            stats = c.stats()
            c.close()
    src = stats.get("source", {})
    return {
        "system": "bootstrap",
        "rows": rows,
        "dim": dim,
        "items_loaded": stats.get("items"),
        "copy_in_s": round(insert_s, 2),
        "start_to_ready_s": round(ready_s, 2),
        "bootstrap_s": src.get("bootstrap_s"),
        "rows_per_s": round(rows / src["bootstrap_s"]) if src.get("bootstrap_s") else None,
    }


def run(args: argparse.Namespace) -> int:
    import psycopg

    rows: list[dict[str, Any]] = []
    checks: dict[str, Any] = {}
    with postgres_server() as pg:
        conninfo = pg.create_database("kalos_replicas")
        with tempfile.TemporaryDirectory(prefix="kalos-bench-") as tmp:
            source_file = Path(tmp) / "source"
            source_file.write_text(conninfo)
            extra = ("--source-file", str(source_file))
            with contextlib.ExitStack() as stack:
                running = [
                    stack.enter_context(
                        isolated_sidecar(dim=args.dim, name=f"replica{i}", extra_args=extra)
                    )
                    for i in range(args.replicas)
                ]
                clients = [r.connect(timeout=30) for r in running]
                acked: set[int] = set()
                samples = _write_to_visible(clients, args.dim, args.visible_writes, acked)
                ms = samples / 1e6
                row = summarize("write-to-visible", samples, replicas=args.replicas)
                row["write_to_visible_p50_ms"] = round(float(np.percentile(ms, 50)), 3)
                row["write_to_visible_p99_ms"] = round(float(np.percentile(ms, 99)), 3)
                row["write_to_visible_max_ms"] = round(float(ms.max()), 3)
                rows.append(row)
                print(f"write-to-visible: p99 {row['write_to_visible_p99_ms']} ms")
                for label, through in (("1 sidecar", clients[:1]), ("all sidecars", clients)):
                    lat, wall = _throughput(
                        through, args.writers, args.seconds, args.dim,
                        2_000_000_000 + 100_000_000 * len(rows), acked,
                    )  # fmt: skip
                    r = summarize(f"writes through {label}", lat, wall, writers=args.writers,
                                  sidecars=len(through))  # fmt: skip
                    r["adds_per_s"] = round(len(lat) / wall, 1)
                    rows.append(r)
                    print(f"writes through {label}: {r['adds_per_s']} adds/s")
                with psycopg.connect(conninfo) as conn:
                    stored = {int(x[0]) for x in conn.execute("SELECT id FROM kalos_memories")}
                lost = len(acked - stored)
                deadline = time.monotonic() + 30
                while True:  # every sidecar holds exactly the table's rows once caught up
                    items = [int(c.stats()["items"]) for c in clients]
                    if all(n == len(stored) for n in items) or time.monotonic() > deadline:
                        break
                    time.sleep(0.05)
                checks = {
                    "lost": lost,
                    "acknowledged": len(acked),
                    "rows_in_table": len(stored),
                    "items_per_sidecar": items,
                    "replicas_agree": all(n == len(stored) for n in items),
                }
                for c in clients:
                    c.close()
        if args.bootstrap_rows:
            rows.append(_bootstrap(pg, args.dim, args.bootstrap_rows))
            print(f"bootstrap: {rows[-1]}")
    print_table(rows, ("system", "n", "p50_us", "p99_us", "qps"))
    params = {
        "dim": args.dim,
        "replicas": args.replicas,
        "writers": args.writers,
        "seconds": args.seconds,
        "transport": "shm",
        "postgres": "local server, Unix socket, fsync on",
        "feed": "change table + LISTEN/NOTIFY",
    }
    path = write_result(SCENARIO, args.machine, params, rows, args.out, checks=checks)
    print(f"wrote {path}")
    return 0 if checks.get("lost") == 0 else 1
