"""Where the sidecar's compute stage spends its time beyond the GPU search (CUDA machine).

bench/NOTES-gpu.md, run 10: at 1M x 128 the sidecar's compute median sits ~18 µs above the
prefilter kernel, but ``GpuSearch.search`` with in-place results, in one process, only ~6-8
above it. The rest is the dispatcher's Python around the search (decode, checks, the
response's views, the timings). This times, in one process, host clocks, interleaved blocks:

- ``gpusearch-inplace``: ``GpuSearch.search`` writing into a registered arena (the baseline);
- ``handle``: ``Dispatcher.handle`` for that SEARCH request, as the sidecar's poller calls it;
- ``handle-nogpu``: the same with the GPU search replaced by a no-op (the Python alone, warm);
- ``python-after-wait``: the Python of ``handle-nogpu`` run right after a launch + sync of the
  graph (the Python alone, as it runs in the sidecar: after the driver's wait).

If ``handle - gpusearch-inplace`` is near ``handle-nogpu``, the Python costs what it costs
warm; if it is near ``python-after-wait`` and well above, the wait leaves it running cold.

Usage: ``python3 bench/search_gpu_dispatch.py [--size 1000000x128] [--out DIR]``
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import time
from typing import Any

import numpy as np

from kalos.bench.common import write_result


def _p(ns: np.ndarray) -> dict[str, float]:
    us = ns / 1e3
    return {"p50_us": round(float(np.percentile(us, 50)), 2),
            "p99_us": round(float(np.percentile(us, 99)), 2)}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="1000000x128")
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--cpus", type=int, nargs="*", default=None, help="pin the process")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.cpus:
        os.sched_setaffinity(0, set(args.cpus))
    import torch

    import kalos.index as kindex
    from kalos.protocol import codes
    from kalos.protocol import messages as M
    from kalos.server.dispatch import Dispatcher
    from kalos.server.gpu_search import GpuSearch
    from kalos.stores.memories import MemoryStore

    n, dim = (int(v) for v in args.size.split("x"))
    k = args.k
    store = MemoryStore(kindex.create("cuda:flat,fp16", dim=dim, metric="ip"))
    index = store.index
    index.reserve(n)
    gen = torch.Generator(device="cuda").manual_seed(n)
    index.add(torch.randn((n, dim), generator=gen, device="cuda").half(),
              torch.arange(n, device="cuda"))  # fmt: skip
    gs = store.gpu = GpuSearch(index)
    dispatcher = Dispatcher(store, name="probe", device="cuda")
    qs = np.random.default_rng(3).standard_normal((256, dim), dtype=np.float32)
    req = np.zeros(1 << 16, np.uint8)
    body_len = M.encode_search(req, qs[:1], k, M.encode_scope_fields(None))
    arena = np.frombuffer(mmap.mmap(-1, 1 << 20), np.uint8)
    pinned = gs.pin(arena)
    body = req[:body_len]
    op = int(codes.Op.SEARCH)

    qview = M.decode_search(req, body_len).queries  # where a client writes the query

    def handle() -> None:
        status, n_out = dispatcher.handle(op, 0, body, arena, pinned=pinned)[:2]
        if status != 0:
            raise RuntimeError(f"SEARCH failed: {status}: {M.decode_text(arena, n_out)}")

    nq_k = M.search_response_views(arena, 1, k)
    out = (nq_k[1], nq_k[2])

    def inplace() -> None:
        gs.search(qs[:1], k, None, out=out, pinned=pinned)

    for _ in range(100):
        handle()
        inplace()
    real_search = gs.search
    graph = pinned.graphs[(1, k, False)]

    def nogpu_search(*a: Any, **kw: Any) -> Any:
        return kw.get("out") if "out" in kw else a[3]

    clock = time.perf_counter_ns

    def timed(fn: Any, reps: int, before: Any = None) -> np.ndarray:
        t = np.zeros(reps, np.int64)
        for i in range(reps):
            qview[0] = qs[i % 256]
            if before is not None:
                before()
            t0 = clock()
            fn()
            t[i] = clock() - t0
        return t

    def wait_graph() -> None:
        graph.replay_and_wait(gs.stream)

    blocks: dict[str, list[np.ndarray]] = {
        "gpusearch-inplace": [], "handle": [], "handle-nogpu": [], "python-after-wait": []
    }  # fmt: skip
    per = args.reps // 5
    for _ in range(5):
        blocks["gpusearch-inplace"].append(timed(inplace, per))
        blocks["handle"].append(timed(handle, per))
        gs.search = nogpu_search  # type: ignore[method-assign]
        blocks["handle-nogpu"].append(timed(handle, per))
        blocks["python-after-wait"].append(timed(handle, per, before=wait_graph))
        gs.search = real_search  # type: ignore[method-assign]
    rows = {name: _p(np.concatenate(parts)) for name, parts in blocks.items()}
    base = rows["gpusearch-inplace"]["p50_us"]
    rows["handle"]["over_gpusearch_us"] = round(rows["handle"]["p50_us"] - base, 2)
    pinned.close()
    print(json.dumps(rows), flush=True)
    if args.out:
        path = write_result(
            "search-gpu-dispatch", "H200", {"n": n, "dim": dim, "k": k, "cpus": args.cpus},
            [{"system": name, **row} for name, row in rows.items()], args.out,
            "pinned" if args.cpus else None,
        )  # fmt: skip
        print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
