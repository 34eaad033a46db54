"""replicas: kalos serve --source, 3 sidecars on one PostgreSQL: write-to-visible, throughput.

Starts its own PostgreSQL server (kalos.testing_postgres: initdb into a temporary directory,
fsync on) and ``--replicas`` sidecars on it, each its own process, as stand-ins for hosts.

- ``write-to-visible``: one add at a time, through the sidecars in turn; the time from the
  call until every sidecar's search finds the item (the writer's own ack included), polled
  from one client thread.
- ``write throughput``: W writer threads adding one item per request for ``--seconds``,
  all through one sidecar, then spread over all of them.
- ``bootstrap``: ``--bootstrap-rows`` rows of ``--bootstrap-dim`` COPYed into the table
  (``kalos_memories``, or with ``--bootstrap-table real[]`` or ``bytea`` an application's
  table that the sidecar mirrors), then a fresh sidecar's load (start to ready) of them, and
  its resident memory. ``--bootstrap-only`` runs this part alone (written with the suffix
  ``bootstrap-<rows>x<dim>``, beside the full scenario's result rather than over it).

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
from kalos.testing import isolated_sidecar, wait_ready
from kalos.testing_postgres import postgres_server

SCENARIO = "replicas"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--visible-writes", type=int, default=300, help="write-to-visible samples")
    p.add_argument("--seconds", type=float, default=4.0, help="per throughput configuration")
    p.add_argument("--writers", type=int, default=3, help="writer threads for the throughput")
    p.add_argument("--bootstrap-rows", type=int, default=100_000)
    p.add_argument("--bootstrap-dim", type=int, default=None, help="default: --dim")
    p.add_argument(
        "--bootstrap-table",
        choices=("kalos_memories", "real[]", "bytea"),
        default="kalos_memories",
        help="load Kalos's own table, or mirror a table with real[] or bytea vectors",
    )
    p.add_argument("--bootstrap-only", action="store_true", help="skip the replicas part")
    p.add_argument("--bootstrap-device", default="cpu",
                   help="the bootstrapped sidecar's --device (cuda: a GPU sidecar)")  # fmt: skip


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


COPY_HEADER = b"PGCOPY\n\xff\r\n\x00" + b"\x00" * 8  # signature, flags, extension length
COPY_TRAILER = b"\xff\xff"
FLOAT4_OID = 700


def copy_block(ids: np.ndarray, vectors: np.ndarray, as_array: bool) -> bytes:
    """Rows (id bigint, vector) in PostgreSQL's binary COPY format, built with numpy:
    the vector as bytea (little-endian float32) or as a one-dimensional real[]."""
    n, dim = vectors.shape
    if as_array:
        cells = np.dtype([("len", ">i4"), ("v", ">f4")])
        vector = [("vlen", ">i4"), ("ndim", ">i4"), ("nulls", ">i4"), ("oid", ">i4"),
                  ("size", ">i4"), ("lbound", ">i4"), ("cells", cells, (dim,))]  # fmt: skip
    else:
        vector = [("vlen", ">i4"), ("v", "<f4", (dim,))]
    rows = np.zeros(n, [("fields", ">i2"), ("idlen", ">i4"), ("id", ">i8"), *vector])
    rows["fields"], rows["idlen"], rows["id"] = 2, 8, ids
    if as_array:
        rows["vlen"] = 20 + 8 * dim
        rows["ndim"], rows["oid"], rows["size"], rows["lbound"] = 1, FLOAT4_OID, dim, 1
        rows["cells"]["len"], rows["cells"]["v"] = 4, vectors
    else:
        rows["vlen"], rows["v"] = 4 * dim, vectors
    return rows.tobytes()


def _resident_peak_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def _bootstrap(pg: Any, dim: int, rows: int, table: str, device: str) -> dict[str, Any]:
    import psycopg

    conninfo = pg.create_database("kalos_bootstrap")
    with tempfile.TemporaryDirectory(prefix="kalos-bench-") as tmp:
        source_file = Path(tmp) / "source"
        source_file.write_text(conninfo)
        extra: tuple[str, ...] = ("--source-file", str(source_file))
        if table == "kalos_memories":
            target = "kalos_memories (id, vector)"
            with isolated_sidecar(dim=dim, name="bench-boot", extra_args=extra) as sc:
                sc.connect(timeout=30).close()  # the schema, made by a first sidecar
        else:
            target = "docs (id, embedding)"
            with psycopg.connect(conninfo, autocommit=True) as conn:
                conn.execute(f"CREATE TABLE docs (id bigint PRIMARY KEY, embedding {table})")
            extra += ("--source-table", "docs", "--source-columns", "id=id,vector=embedding")
        t0 = time.perf_counter()
        with psycopg.connect(conninfo) as conn, conn.cursor() as cur:
            with cur.copy(f"COPY {target} FROM STDIN (FORMAT BINARY)") as copy:
                copy.write(COPY_HEADER)
                for start in range(0, rows, 10_000):
                    block = _vectors(min(10_000, rows - start), dim, start)
                    ids = np.arange(start, start + len(block), dtype=np.int64)
                    copy.write(copy_block(ids, block, table == "real[]"))
                copy.write(COPY_TRAILER)
            conn.commit()
            insert_s = time.perf_counter() - t0
            name = target.split()[0]
            found = conn.execute(f"SELECT pg_total_relation_size('{name}')").fetchone()
            size = int(found[0]) if found else 0
        extra += ("--device", device)
        t0 = time.perf_counter()
        with isolated_sidecar(dim=dim, name="bench-boot", extra_args=extra) as sc:
            wait_ready(sc.socket, sc.process, timeout=3600)  # the load runs before readiness
            c = sc.connect(timeout=30)
            ready_s = time.perf_counter() - t0
            stats = c.stats()
            c.close()
            peak = _resident_peak_mib(sc.process.pid)
    src = stats.get("source", {})
    return {
        "system": "bootstrap",
        "table": table,
        "rows": rows,
        "dim": dim,
        "items_loaded": stats.get("items"),
        "table_mib": round(size / 2**20, 1),
        "copy_in_s": round(insert_s, 2),
        "start_to_ready_s": round(ready_s, 2),
        "bootstrap_s": src.get("bootstrap_s"),
        "rows_per_s": round(rows / src["bootstrap_s"]) if src.get("bootstrap_s") else None,
        "device": device,
        "gpu_warm_s": round(stats["warm_seconds"], 2) if stats.get("warm_seconds") else None,
        "sidecar_peak_rss_mib": peak,
    }


def run(args: argparse.Namespace) -> int:
    import psycopg

    rows: list[dict[str, Any]] = []
    checks: dict[str, Any] = {}
    boot_dim = args.bootstrap_dim or args.dim
    with postgres_server() as pg:
        if args.bootstrap_only:
            boot = _bootstrap(
                pg, boot_dim, args.bootstrap_rows, args.bootstrap_table, args.bootstrap_device
            )
            print(f"bootstrap: {boot}")
            params = {"postgres": "local server, Unix socket, fsync on", "transport": "shm",
                      "bootstrap_only": True, "bootstrap_table": args.bootstrap_table}  # fmt: skip
            suffix = f"bootstrap-{args.bootstrap_rows}x{boot_dim}"
            if args.bootstrap_table != "kalos_memories":
                suffix += "-" + args.bootstrap_table.replace("[]", "-array")
            if args.bootstrap_device != "cpu":
                suffix += "-" + args.bootstrap_device.replace(":", "")
                params["device"] = args.bootstrap_device
            checks = {"all_loaded": boot["items_loaded"] == args.bootstrap_rows}
            path = write_result(SCENARIO, args.machine, params, [boot], args.out, suffix=suffix,
                                checks=checks)  # fmt: skip
            print(f"wrote {path}")
            return 0 if checks["all_loaded"] else 1
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
            rows.append(
                _bootstrap(
                    pg, boot_dim, args.bootstrap_rows, args.bootstrap_table, args.bootstrap_device
                )
            )
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
