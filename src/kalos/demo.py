"""``kalos demo``: the main job on the embedded default (CPU, no external services).

Starts a sidecar process, loads a seeded synthetic corpus of memories (vectors with texts,
spread over tenants and users), recalls through the client over shm and uds, checks every
recall against exact search done in this process, prints a latency table and stops the
sidecar cleanly.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from threadpoolctl import threadpool_limits

from kalos import Scope
from kalos import index as kindex
from kalos.bench.common import print_table, summarize
from kalos.testing import isolated_sidecar

TENANTS = ("acme", "globex", "initech")
TOPICS = ("billing", "shipping", "returns", "account", "warranty", "pricing", "support")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--memories", type=int, default=50_000, help="synthetic memories to load")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--recalls", type=int, default=2_000, help="timed recalls per transport")
    p.add_argument("--seed", type=int, default=42)


def corpus(n: int, dim: int, seed: int) -> tuple[np.ndarray, np.ndarray, list[str], list[Scope]]:
    rng = np.random.default_rng(seed)
    vectors = rng.standard_normal((n, dim), dtype=np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    ids = np.arange(1, n + 1, dtype=np.int64)
    tenant = rng.integers(0, len(TENANTS), n)
    user = rng.integers(0, 20, n)
    topic = rng.integers(0, len(TOPICS), n)
    texts = [
        f"memory {i}: user-{u} asked about {TOPICS[t]}"
        for i, u, t in zip(ids, user, topic, strict=True)
    ]
    scopes = [Scope(TENANTS[t], f"user-{u}") for t, u in zip(tenant, user, strict=True)]
    return vectors, ids, texts, scopes


def run(args: argparse.Namespace) -> int:
    print(f"kalos demo: {args.memories:,} memories x {args.dim} dims, cosine, on the CPU")
    vectors, ids, texts, scopes = corpus(args.memories, args.dim, args.seed)
    reference = kindex.create("cpu:flat", dim=args.dim, metric="cosine")
    with isolated_sidecar(dim=args.dim, metric="cosine", name="demo") as sidecar:
        print(f"sidecar pid {sidecar.process.pid} listening at {sidecar.socket}")
        client = sidecar.connect(arena_bytes=8 << 20)
        t0 = time.perf_counter()
        for tenant in TENANTS:  # one add per scope: a scope applies to a whole add
            for u in range(20):
                scope = Scope(tenant, f"user-{u}")
                sel = np.array([s == scope for s in scopes])
                if sel.any():
                    client.add(
                        vectors[sel], ids[sel], [texts[i] for i in np.flatnonzero(sel)], scope=scope
                    )
        load_s = time.perf_counter() - t0
        reference.add(vectors, ids)
        print(f"loaded in {load_s:.2f} s; sidecar reports {client.stats()['items']:,} items")

        rng = np.random.default_rng(args.seed + 1)
        queries = rng.standard_normal((args.recalls, args.dim), dtype=np.float32)
        hit = client.search(queries[0], k=5, scope=Scope("acme", "user-3"))
        print("\nrecall for tenant acme, user-3, top 5:")
        for i, score, text in zip(hit.ids, hit.scores, hit.payloads or [], strict=False):
            print(f"  id {int(i):>6}  score {float(score):+.3f}  {text}")
        print(f"  timings (µs): {hit.timings}")

        rows = []
        wrong = 0
        uds = sidecar.connect(transport="uds")
        for system, c in (("kalos shm", client), ("kalos uds", uds)):
            samples = np.zeros(args.recalls, np.int64)
            for i, q in enumerate(queries):
                t = time.perf_counter_ns()
                r = c.search(q, k=10, payloads=True)
                samples[i] = time.perf_counter_ns() - t
                if i % 50 == 0:
                    want = reference.search(q, 10)[1][0]
                    wrong += int(not np.array_equal(np.sort(r.ids), np.sort(want)))
            rows.append(summarize(system, samples))
        samples = np.zeros(args.recalls, np.int64)
        with threadpool_limits(limits=1):  # the sidecar's own setting (--compute-threads 1)
            for i, q in enumerate(queries):
                t = time.perf_counter_ns()
                reference.search(q, 10)
                samples[i] = time.perf_counter_ns() - t
        rows.append(summarize("in-process numpy, 1 thread (no payloads)", samples))
        uds.close()
        client.close()
    print(f"\ntop-10 recall over {args.memories:,} memories, {args.recalls:,} queries each:")
    print_table(rows)
    print(f"\nrecalls checked against exact search: {wrong} wrong")
    print(
        "sidecar stopped cleanly"
        if sidecar.process.returncode == 0
        else f"sidecar exit: {sidecar.process.returncode}"
    )
    return 1 if wrong or sidecar.process.returncode != 0 else 0
