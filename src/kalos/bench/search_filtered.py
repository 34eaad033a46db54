"""search-filtered: top-k through the sidecar with metadata filters of falling selectivity, beside
the unfiltered search, in one run.

Every row gets the metadata ``{"bucket": i % 1000, "even": i % 2 == 0}``; a filter
``{"bucket": {"lt": B}}`` keeps B/1000 of the rows (``--shares``: 1 is no filter at all).
Each level is timed through the client (shm) and every answer of a sample checked against
the exact top-k of the matching rows computed here (float64). On a cuda sidecar
(``--device cuda --index cuda:flat``) the filtered searches take the gather path or the
masked scan (docs/FILTERS.md), the unfiltered one the fused kernels.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from kalos.bench import corpora
from kalos.bench.common import print_table, summarize, write_result
from kalos.bench.plots import plot_result
from kalos.testing import isolated_sidecar

SCENARIO = "search-filtered"
BUCKETS = 1000


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--corpus", choices=corpora.NAMES, default="clustered")
    p.add_argument("--n", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--queries", type=int, default=500, help="timed searches per level")
    p.add_argument("--shares", type=float, nargs="+", default=[1.0, 0.5, 0.1, 0.01, 0.001],
                   help="the share of rows each filter keeps (1: no filter)")  # fmt: skip
    p.add_argument("--index", default="cpu:flat")
    p.add_argument("--device", default="cpu", help="the sidecar's --device (cuda: a GPU)")
    p.add_argument("--seed", type=int, default=corpora.SEED, help="the corpus's seed")
    p.add_argument("--corpus-dir", default=None,
                   help="the corpora's cache (default $KALOS_CORPUS_DIR or "
                        "~/.cache/kalos/corpora)")  # fmt: skip


def _where(share: float) -> dict | None:
    if share >= 1:
        return None
    return {"bucket": {"lt": max(1, round(share * BUCKETS))}}


def _correct(base: np.ndarray, keep: np.ndarray, q: np.ndarray, k: int, got: np.ndarray,
             tol: float) -> bool:  # fmt: skip
    """Whether ``got`` (ids, -1 padded) is an exact top-k of the rows in ``keep``: the
    reference's set, or rows that all score within ``tol`` of its k-th (ties at the stored
    precision: fp16 on a GPU). Ids are ``row * 7 + 3``."""
    rows = np.flatnonzero(keep)
    scores = base[rows].astype(np.float64) @ q.astype(np.float64)
    want = min(k, len(rows))
    order = np.argsort(-scores, kind="stable")[:want]
    got = got[got >= 0]
    if set(got.tolist()) == set((rows[order] * 7 + 3).tolist()):
        return True
    mine = (got - 3) // 7
    if len(set(mine.tolist())) != want or not keep[mine].all():
        return False
    kth = scores[order[-1]]
    return bool((base[mine].astype(np.float64) @ q.astype(np.float64) >= kth - tol).all())


def run(args: argparse.Namespace) -> int:
    corpus = corpora.load(args.corpus, args.n, args.dim, queries=args.queries, seed=args.seed,
                          cache_dir=args.corpus_dir, progress=not args.quiet)  # fmt: skip
    base, queries, dim = corpus.db, corpus.queries, corpus.dim
    n = len(base)
    ids = np.arange(n, dtype=np.int64) * 7 + 3
    buckets = np.arange(n) % BUCKETS
    metadata = [{"bucket": int(b), "even": i % 2 == 0} for i, b in enumerate(buckets.tolist())]
    extra = ("--index", args.index, "--device", args.device)
    # a tie at the stored precision: a GPU index stores fp16 (2^-11 relative, doubled), the
    # CPU one float32 (its sums' rounding)
    precision = 2.0**-10 if args.device.startswith("cuda") else 1e-5
    max_norm = float(np.linalg.norm(base, axis=1).max())
    rows = []
    samples: dict[str, dict[str, np.ndarray]] = {}
    mismatches = 0
    checked = 0
    with isolated_sidecar(dim=dim, name="bench-search-filtered", extra_args=extra) as sidecar:
        client = sidecar.connect(arena_bytes=16 << 20, timeout=600.0)
        t0 = time.perf_counter()
        client.add(base, ids, metadata=metadata)
        load_s = time.perf_counter() - t0
        for share in args.shares:
            where = _where(share)
            keep = np.ones(n, bool) if where is None else buckets < where["bucket"]["lt"]
            for q in queries[:20]:  # warm-up
                client.search(q, args.k, where=where, payloads=False)
            for q in queries[:50]:  # correctness in the same run
                got = client.search(q, args.k, where=where, payloads=False).ids
                tol = precision * float(np.linalg.norm(q)) * max_norm
                mismatches += int(not _correct(base, keep, q, args.k, np.asarray(got), tol))
                checked += 1
            out = np.zeros(len(queries), np.int64)
            clock = time.perf_counter_ns
            wall = time.perf_counter()
            for i, q in enumerate(queries):
                start = clock()
                client.search(q, args.k, where=where, payloads=False)
                out[i] = clock() - start
            wall = time.perf_counter() - wall
            label = "no filter" if where is None else f"{share:g} of rows"
            row = summarize("kalos-shm", out, wall, share=share, matched=int(keep.sum()))
            rows.append(row)
            samples[label] = {"kalos-shm": out}
        client.close()
    unfiltered = next((r for r in rows if r["share"] >= 1), None)
    if unfiltered is not None:
        for r in rows:
            r["over_unfiltered_p50"] = round(r["p50_us"] / unfiltered["p50_us"], 3)
    print_table(rows, ("system", "share", "matched", "p50_us", "p99_us", "qps",
                       "over_unfiltered_p50"))  # fmt: skip
    print(f"bulk load with metadata: {load_s:.1f} s; wrong results: {mismatches} of {checked}")
    params = {
        "corpus": corpus.name,
        "n": n,
        "dim": dim,
        "k": args.k,
        "index": args.index,
        "device": args.device,
        "queries": len(queries),
        "filter": '{"bucket": {"lt": share * 1000}}',
        "load_s": round(load_s, 2),
        "corpus_info": corpus.info,
    }
    checks = {"wrong_results": mismatches, "checked": checked}
    path = write_result(SCENARIO, args.machine, params, rows, args.out, checks=checks)
    print(f"wrote {path}")
    png = plot_result(path, samples, title=f"search-filtered: {corpus.name} {n:,} x {dim}")
    if png:
        print(f"wrote {png}")
    return 1 if mismatches else 0
