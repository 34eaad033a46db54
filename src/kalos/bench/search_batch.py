"""search-batch: exact batched search in process, per batch size: two passes against one scan.

One corpus (``--corpus``, :mod:`kalos.bench.corpora`; default ``clustered`` 1M x 384) in a
``cuda:flat,fp16`` index. For each batch size of ``--batches``, ``--calls`` searches of that
many of the corpus's held-out queries, each a replay of the index's CUDA graph for that
shape (``CudaFlatIndex.graph``) and a wait for it, timed on the host:

- ``two-pass``: every batch of 2 or more takes each tile's best score, then the tiles that can
  hold a result (``kernels.batch_topk``; a single query takes the fused scan, its row says
  ``two_pass: false``). The index takes them from ``batch_topk.MIN_BATCH``'s size bucket on
  (``params.default_two_pass_batch``, 32; 0: never);
- ``fused``: every batch through the fused scan and its per-program top-k lists
  (``kernels.scan_topk``; the index's ``two_pass_min_batch`` 0), which scores each query's
  fp32 value up to 16 queries at 384 dims and 8 above 512, the query rounded to the rows'
  type beyond;
- ``cascade`` (a ``scan=4bit`` index: 257 to 1536 dims): every batch of 2 or more through the
  batched 4-bit cascade (``kernels.codes4_batch``: one read of the 4-bit codes bounds every
  query, then each query's open rows are scored exactly), a single query through its own
  cascade (``kernels.codes4``). By default the index takes the batched cascade up to
  ``params.default_batch4_max_batch``'s size bucket (0: never; the spec's ``batch4=N``). Its
  rows give ``listed_p50`` and ``listed_max``: the rows a query left open, over the checked
  calls;
- ``singles``: each query of the batch alone, one after another, through the index's
  one-query graph with its compressed first pass (the int8 prefilter, or at 257 to 1536 dims
  the 4-bit cascade, as a lone search takes it): what answering a batch's members one at a
  time costs, against which the batched paths pay off;
- ``torch``: ``torch.topk(q @ db.T)`` on the same fp16 rows, the batch in one product.

The ``two-pass`` and ``fused`` rows keep the batched cascade off.

Every answer of the first ``--checked`` calls of each row is held against the exact top-k of
the stored rows in float32: a result is wrong when its exact score is below the k-th best
by more than the fp16 query's rounding allows (``checks.wrong_results``: the kalos paths;
each row has its own ``wrong``). ``checks`` also
gives each path's call of the largest batch over its one-query call. Rows: ``p50_us`` and ``p99_us``
per call and ``us_per_query``. On the CPU (``--device cpu``) it needs ``TRITON_INTERPRET=1``
and tiny sizes (the tests).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from kalos.bench import corpora
from kalos.bench.common import (
    load_average,
    print_table,
    summarize,
    write_sets,
)
from kalos.bench.plots import plot_result

SCENARIO = "search-batch"
PATHS = ("cascade", "two-pass", "fused", "singles", "torch")
TWO_PASS_FROM = 2  # the two-pass rows: every batch from this size


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--corpus", choices=corpora.NAMES, default="clustered")
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=None,
                   help="implied for real-384 and real-128; 384 for the others")  # fmt: skip
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--calls", type=int, default=200, help="timed calls per batch size and path")
    p.add_argument("--checked", type=int, default=20,
                   help="calls per row whose answers are checked")  # fmt: skip
    p.add_argument("--device", default="cuda")
    p.add_argument("--append", action="store_true",
                   help="add this run's set to the result file already there (a set of the "
                        "same corpus, size and dim is replaced)")  # fmt: skip
    p.add_argument("--seed", type=int, default=corpora.SEED)
    p.add_argument("--corpus-dir", default=None)


def run(args: argparse.Namespace) -> int:
    import torch

    from kalos.index import cuda_flat
    from kalos.index.cuda_flat import CudaFlatIndex
    from kalos.index.kernels import batch_topk

    dim = args.dim if args.corpus.startswith("real-") or args.dim else 384
    corpus = corpora.load(
        args.corpus, args.n, None if args.corpus.startswith("real-") else dim,
        queries=max(1000, 4 * max(args.batches)), seed=args.seed, cache_dir=args.corpus_dir,
        progress=not args.quiet,
    )  # fmt: skip
    dev = torch.device(args.device)
    on_gpu = dev.type == "cuda"
    index = CudaFlatIndex(dim=corpus.dim, metric="ip", spec="cuda:flat,fp16", device=str(dev))
    chunk = 1 << 18
    for lo in range(0, corpus.n, chunk):
        hi = min(corpus.n, lo + chunk)
        index.add(corpus.db[lo:hi], np.arange(lo, hi, dtype=np.int64))
    queries = torch.from_numpy(np.ascontiguousarray(corpus.queries, np.float32)).to(dev)
    stored = index._vecs[: corpus.n]  # the fp16 rows, as the kernels read them
    stored32 = stored.float()  # the reference's rows (float32 of what is stored)
    xmax = float(stored32.norm(dim=1).max())
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    k = args.k

    def picks(b: int, i: int) -> Any:
        lo = (i * b) % (len(queries) - b + 1)
        return queries[lo : lo + b]

    rows: list[dict[str, Any]] = []
    samples: dict[str, dict[str, np.ndarray]] = {}
    wrong_total = 0
    paths = [p for p in PATHS if p != "cascade" or index.scan == "4bit"]
    min_rows = index.prefilter_min_rows  # (the cascade's one-query row takes it at any size)
    for b in args.batches:
        group = samples.setdefault(f"batch {b}", {})
        for path in paths:
            checked: list[tuple[Any, Any]] = []
            listed: list[int] = []
            index.prefilter_min_rows = min_rows
            call, two_pass, open_rows = _caller(path, index, stored, b, k)
            for i in range(5):  # the kernels compiled, the caches warm
                call(picks(b, i))
            sync()
            lat = np.empty(args.calls, np.int64)
            for i in range(args.calls):
                q = picks(b, i)
                sync()
                t0 = time.perf_counter_ns()
                got = call(q)
                sync()
                lat[i] = time.perf_counter_ns() - t0
                if i < args.checked:
                    checked.append((q, got.clone()))
                    if open_rows is not None:
                        listed += open_rows()
            wrong = _wrong(stored32, xmax, checked, k)
            if path != "torch":  # torch's fp16 product is the baseline, not under test
                wrong_total += wrong
            row = summarize(path, lat, batch=b, two_pass=two_pass, wrong=wrong)
            row["us_per_query"] = round(row["p50_us"] / b, 3)
            if listed:
                row["listed_p50"] = int(np.percentile(listed, 50))
                row["listed_max"] = int(max(listed))
            rows.append(row)
            group[path] = lat
    index.two_pass_min_batch = batch_topk.MIN_BATCH
    index.batch4_max_batch = cuda_flat.BATCH4_MAX_BATCH
    checks: dict[str, Any] = {"wrong_results": wrong_total, "checked_calls": args.checked}
    p50 = {(r["system"], r["batch"]): r["p50_us"] for r in rows}
    largest = max(args.batches)
    if 1 in args.batches and largest > 1:  # the largest batch's call over one query's
        checks["largest_over_one"] = {
            "batch": largest,
            **{p: round(p50[(p, largest)] / p50[(p, 1)], 2) for p in paths},
        }
    params = {
        "corpus": corpus.name, "n": corpus.n, "dim": corpus.dim, "k": k, "metric": "ip",
        "index": "cuda:flat,fp16", "device": str(dev), "batches": list(args.batches),
        "calls": args.calls, "two_pass_from": TWO_PASS_FROM,
        "default_two_pass_batch": batch_topk.MIN_BATCH,
        "default_batch4_max_batch": cuda_flat.BATCH4_MAX_BATCH, "scan": index.scan,
        "corpus_info": corpus.info,
    }  # fmt: skip
    path = write_sets(SCENARIO, args.machine, params, rows, args.out, append=args.append,
                      same=("corpus", "n", "dim"), checks=checks,
                      load_average=load_average())  # fmt: skip
    print_table(rows, ("system", "batch", "two_pass", "p50_us", "p99_us", "us_per_query", "wrong"))
    print(checks)
    print(f"wrote {path}")
    png = plot_result(path, samples, title=f"search-batch: {corpus.name} {corpus.n:,} x "
                      f"{corpus.dim}, top-{k}, time per call")  # fmt: skip
    if png:
        print(f"wrote {png}")
    return 1 if wrong_total else 0


def _caller(path: str, index: Any, stored: Any, b: int, k: int) -> tuple[Any, bool, Any]:
    """(a function: queries [b, dim] on the device -> their top-k ids, whether it takes the
    two passes, and for the cascade a function that gives the rows its last call left open
    per query, else None) for one row: a graph of the index on its path, or torch's
    product."""
    import torch

    if path == "torch":
        db16 = stored.T
        return (lambda q: torch.topk(q.to(torch.float16) @ db16, k, dim=1).indices), False, None
    index.two_pass_min_batch = TWO_PASS_FROM if path == "two-pass" else 0
    index.batch4_max_batch = 2**30 if path == "cascade" else 0
    stream = torch.cuda.current_stream() if index.device.type == "cuda" else None
    if path == "singles" or (path == "cascade" and b == 1):
        # one query at a time through the prefilter's graph (a cascade index: its cascade)
        if path == "cascade":
            index.prefilter_min_rows = 0
        graph = index.graph(1, k, prefilter=True)

        def singles(q: Any) -> Any:
            out = []
            for i in range(len(q)):
                graph.query.copy_(q[i : i + 1])
                graph.replay_and_wait(stream)
                out.append(graph.ids.clone() if len(q) > 1 else graph.ids)
            return out[0] if len(out) == 1 else torch.cat(out)

        opened = (lambda: [int(graph._status_np[1])]) if path == "cascade" else None
        return singles, False, opened
    graph = index.graph(b, k)
    ws = graph._ws[0]

    def call(q: Any) -> Any:
        graph.query.copy_(q)
        graph.replay()
        return graph.ids

    opened = (lambda: ws["listed"][:b].tolist()) if ws.get("codes4_batch") else None
    return call, bool(ws.get("two_pass")), opened


def _wrong(stored32: Any, xmax: float, checked: list[tuple[Any, Any]], k: int) -> int:
    """Results whose exact float32 score (over the stored rows, ``stored32``; ``xmax`` their
    largest norm) is below the query's k-th best by more than the fp16 rounding of a batch's
    query allows."""
    import torch

    wrong = 0
    for q, ids in checked:
        s = q.float() @ stored32.T  # [b, n]
        kth = torch.topk(s, k, dim=1).values[:, -1:]
        tol = 2e-3 * q.float().norm(dim=1, keepdim=True) * xmax
        got = s.gather(1, ids.clamp(min=0))
        wrong += int(((got < kth - tol) | (ids < 0)).sum())
    return wrong


__all__ = ["PATHS", "SCENARIO", "add_arguments", "run"]
