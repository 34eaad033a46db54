"""search-cpu: exact top-10 through the sidecar vs the same search in-process (real-384 100K).

The vectors and queries come from a corpus (``--corpus``, :mod:`kalos.bench.corpora`; default
``real-384``, 100K rows, float32). Both sides run the same index backend on them; kalos is timed
end to end through the client (shm), the baseline as a direct call in this process. 1 and 8
concurrent clients (threads); the kalos results are checked against the in-process ones.
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np
from threadpoolctl import threadpool_limits

from kalos import index as kindex
from kalos.bench import corpora
from kalos.bench.common import print_table, summarize, write_result
from kalos.bench.plots import plot_result
from kalos.testing import isolated_sidecar

SCENARIO = "search-cpu"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--corpus", choices=corpora.NAMES, default="real-384")
    p.add_argument("--n", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=None,
                   help="implied for real-384 and real-128; 128 for the others")  # fmt: skip
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--queries", type=int, default=2_000, help="timed searches per client")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--index", default="cpu:flat")
    p.add_argument("--seed", type=int, default=corpora.SEED, help="the corpus's seed")
    p.add_argument("--corpus-dir", default=None,
                   help="the corpora's cache (default $KALOS_CORPUS_DIR or "
                        "~/.cache/kalos/corpora)")  # fmt: skip


def _run_threads(fn, threads: int, per_thread: int) -> tuple[np.ndarray, float]:
    out = np.zeros((threads, per_thread), np.int64)
    barrier = threading.Barrier(threads + 1)

    def work(t: int) -> None:
        barrier.wait()
        fn(t, out[t])

    ts = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for t in ts:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in ts:
        t.join()
    return out.reshape(-1), time.perf_counter() - t0


def run(args: argparse.Namespace) -> int:
    # The sidecar searches with one BLAS thread (SidecarConfig.compute_threads); so does the
    # in-process baseline, so both run the same code on the same resources.
    with threadpool_limits(limits=1):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    dim = args.dim
    if dim is None and args.corpus in ("clustered", "uniform"):
        dim = 128
    corpus = corpora.load(args.corpus, args.n, dim, queries=args.queries, seed=args.seed,
                          cache_dir=args.corpus_dir, progress=not args.quiet)  # fmt: skip
    base, queries, dim = corpus.db, corpus.queries, corpus.dim
    ids = np.arange(args.n, dtype=np.int64) * 7 + 3
    local = kindex.create(args.index, dim=dim, metric="ip")
    local.add(base, ids)
    index_lock = threading.Lock()
    rows = []
    samples: dict[str, dict[str, np.ndarray]] = {}  # for the plot: level → system → ns
    mismatches = 0
    with isolated_sidecar(
        dim=dim, name="bench-search-cpu", extra_args=("--index", args.index)
    ) as sidecar:
        loader = sidecar.connect(arena_bytes=16 << 20)
        loader.add(base, ids)
        for _ in range(50):  # warm-up both paths
            loader.search(queries[0], args.k)
            local.search(queries[0], args.k)
        for q in queries[:200]:  # correctness in the same run
            got = loader.search(q, args.k, payloads=False).ids
            want = local.search(q, args.k)[1][0]
            mismatches += int(not np.array_equal(np.sort(got), np.sort(want)))
        loader.close()
        for conc in args.concurrency:
            clients = [sidecar.connect() for _ in range(conc)]

            def via_kalos(t: int, out: np.ndarray, clients=clients) -> None:
                c, clock = clients[t], time.perf_counter_ns
                for i in range(len(out)):
                    t0 = clock()
                    c.search(queries[i], args.k, payloads=False)
                    out[i] = clock() - t0

            def in_process(t: int, out: np.ndarray) -> None:
                # An index serves one thread at a time (the Index contract): in-process callers
                # share it under a lock, as the sidecar serialises its dispatch.
                clock = time.perf_counter_ns
                for i in range(len(out)):
                    t0 = clock()
                    with index_lock:
                        local.search(queries[i], args.k)
                    out[i] = clock() - t0

            per = max(args.queries // conc, 50)
            # Interleave: in-process, kalos, in-process, kalos (two halves each).
            parts: dict[str, list] = {"kalos": [], "inprocess": []}
            walls = {"kalos": 0.0, "inprocess": 0.0}
            for _ in range(2):
                for system, fn in (("inprocess", in_process), ("kalos", via_kalos)):
                    s, w = _run_threads(fn, conc, per // 2)
                    parts[system].append(s)
                    walls[system] += w
            k_row = summarize(
                "kalos-shm", np.concatenate(parts["kalos"]), walls["kalos"], concurrency=conc
            )
            i_row = summarize(
                f"inprocess-{args.index}",
                np.concatenate(parts["inprocess"]),
                walls["inprocess"],
                concurrency=conc,
            )
            k_row["over_inprocess_p50"] = round(k_row["p50_us"] / i_row["p50_us"], 3)
            samples[f"{conc} client(s)"] = {
                "kalos-shm": np.concatenate(parts["kalos"]),
                f"inprocess-{args.index}": np.concatenate(parts["inprocess"]),
            }
            rows += [k_row, i_row]
            for c in clients:
                c.close()
    print_table(
        rows, ("system", "concurrency", "p50_us", "p99_us", "p999_us", "qps", "over_inprocess_p50")
    )
    print(f"result mismatches against in-process: {mismatches} of 200")
    params = {
        "corpus": corpus.name,
        "n": args.n,
        "dim": dim,
        "dtype": "float32",
        "k": args.k,
        "index": args.index,
        "queries": args.queries,
        "compute_threads": 1,
        "corpus_info": corpus.info,
    }
    checks = {"wrong_results": mismatches}
    path = write_result(
        SCENARIO, args.machine, params, rows, args.out, mismatches=mismatches, checks=checks
    )
    print(f"wrote {path}")
    png = plot_result(
        path, samples, title=f"search-cpu: {corpus.name} {args.n:,} x {dim}, top-{args.k}"
    )
    if png:
        print(f"wrote {png}")
    return 1 if mismatches else 0
