"""Does waiting for a search graph cost more when the kernel runs longer? (bench/NOTES-gpu.md,
run 9, item 3: the sidecar's compute sits ~15 µs above the kernel at 1M but ~40 at 10M.)

For each size, in one process, host clocks around each call of the prefiltered search graph
that the sidecar replays (``_HostResultGraph`` through ``GpuSearch``), beside its GPU time:

- ``kernel``: the prefilter's graph, CUDA events over back-to-back replays (GPU time only);
- ``launch+sync``: ``cuGraphLaunch`` + ``cuStreamSynchronize`` through the driver, as the
  sidecar waits (``driver.graph_launcher``);
- ``launch+query``: the same launch, then ``cuStreamQuery`` polled from Python until done;
- ``launch+wait+sync``: the launch, a host busy-wait of 80% of the kernel's p50, then the
  sync (a long wait made short: if the sync's own cost grows with the wait, this row drops);
- ``gpusearch``: ``GpuSearch.search`` (staging, launch, sync, the proof's check);
- ``gpusearch-inplace``: the same with the results written by the graph into a registered
  arena, as the sidecar serves a channel.

Each row's ``over_kernel_us`` is its p50 minus the kernel's. Run it twice: as it is, and with
``--sched spin`` (``CU_CTX_SCHED_SPIN`` set on the primary context before torch creates it;
the default is ``CU_CTX_SCHED_AUTO``). If ``launch+sync`` grows from 1M to 10M while
``launch+query`` does not, the sync is the extra, and the sidecar should wait another way.

Usage (CUDA machine): ``python3 bench/search_gpu_sync.py --out DIR [--sched spin] [--cpus 14 15]``
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import mmap
import os
import time
from typing import Any

import numpy as np

_SCHED = {"auto": 0, "spin": 1, "yield": 2, "blocking": 4}


def _set_sched(name: str) -> str:
    """Sets the primary context's scheduling flag before anything creates the context; returns
    what the driver then reports."""
    lib = ctypes.CDLL("libcuda.so.1")
    dev = ctypes.c_int()
    rc = lib.cuInit(0) or lib.cuDeviceGet(ctypes.byref(dev), 0)
    if rc == 0:
        rc = lib.cuDevicePrimaryCtxSetFlags_v2(dev, _SCHED[name])
    flags, active = ctypes.c_uint(), ctypes.c_int()
    lib.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active))
    return f"rc {rc}, flags {flags.value}, active {active.value}"


def _p(samples_ns: np.ndarray) -> dict[str, float]:
    us = samples_ns / 1e3
    return {"p50_us": round(float(np.percentile(us, 50)), 2),
            "p99_us": round(float(np.percentile(us, 99)), 2)}  # fmt: skip


def run_size(torch: Any, n: int, dim: int, k: int, reps: int) -> dict[str, Any]:
    from kalos.bench.search_gpu import _event_times
    from kalos.gpu import driver
    from kalos.index.cuda_flat import CudaFlatIndex
    from kalos.server.gpu_search import GpuSearch

    gen = torch.Generator(device="cuda").manual_seed(n)
    index = CudaFlatIndex(dim=dim, metric="ip", spec="cuda:flat,fp16")
    index.reserve(n)
    index.add(torch.randn((n, dim), generator=gen, device="cuda").half(),
              torch.arange(n, device="cuda"))  # fmt: skip
    qs = np.random.default_rng(3).standard_normal((256, dim), dtype=np.float32)
    gs = GpuSearch(index)
    for i in range(50):
        gs.search(qs[i % 256][None], k, None)  # compiles and captures
    graph = gs._graphs[(1, k, False)]
    stream = gs.stream
    prefilter = graph.prefilter and n >= index.prefilter_min_rows
    raw = graph._graphs[1 if prefilter else 0]
    kernel = _event_times(torch, raw.replay, reps)
    k50 = float(np.percentile(kernel, 50))
    lib = driver._driver()
    g = ctypes.c_void_p(raw.raw_cuda_graph_exec())
    s = ctypes.c_void_p(stream.cuda_stream)
    lib.cuStreamQuery.argtypes = [ctypes.c_void_p]
    launch, sync, query = lib.cuGraphLaunch, lib.cuStreamSynchronize, lib.cuStreamQuery
    pause = 0.8 * k50 / 1e9
    clock = time.perf_counter_ns

    def timed(fn: Any) -> np.ndarray:
        out = np.zeros(reps, np.int64)
        for i in range(reps):
            gs.staging.query_np[0] = qs[i % 256]
            t = clock()
            fn()
            out[i] = clock() - t
        return out

    def launch_sync() -> None:
        launch(g, s)
        sync(s)

    def launch_query() -> None:
        launch(g, s)
        rc = query(s)
        while rc == 600:  # CUDA_ERROR_NOT_READY
            rc = query(s)
        if rc != 0:
            raise RuntimeError(f"cuStreamQuery: {rc}")

    def launch_wait_sync() -> None:
        launch(g, s)
        end = clock() + int(pause * 1e9)
        while clock() < end:
            pass
        sync(s)

    # The sidecar's own path: results written by the graph into a registered arena (an
    # anonymous shared mapping, as a channel's is a memfd's).
    arena = np.frombuffer(mmap.mmap(-1, 1 << 20), np.uint8)
    pinned = gs.pin(arena)
    out = (arena[:4 * k].view(np.float32).reshape(1, k),
           arena[4096:4096 + 8 * k].view(np.int64).reshape(1, k))  # fmt: skip
    q1 = gs.staging.query_np[:1]
    for _ in range(20):
        gs.search(q1, k, None, out=out, pinned=pinned)

    rows = {"kernel": _p(kernel)}
    fns = {"launch+sync": launch_sync, "launch+query": launch_query,
           "launch+wait+sync": launch_wait_sync,
           "gpusearch": lambda: gs.search(q1, k, None),
           "gpusearch-inplace": lambda: gs.search(q1, k, None, out=out, pinned=pinned)}  # fmt: skip
    samples: dict[str, list[np.ndarray]] = {name: [] for name in fns}
    for _ in range(5):  # interleaved blocks
        for name, fn in fns.items():
            samples[name].append(timed(fn)[: reps // 5])
    for name, parts in samples.items():
        row = _p(np.concatenate(parts))
        row["over_kernel_us"] = round(row["p50_us"] - k50 / 1e3, 2)
        rows[name] = row
    pinned.close()
    return {"n": n, "dim": dim, "k": k, "prefilter": prefilter, "rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", nargs="+", default=["1000000x128", "10000000x128"])
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--reps", type=int, default=1000)
    ap.add_argument("--sched", choices=sorted(_SCHED), default="auto")
    ap.add_argument("--cpus", type=int, nargs="*", default=None, help="pin the process")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.cpus:
        os.sched_setaffinity(0, set(args.cpus))
    sched = _set_sched(args.sched) if args.sched != "auto" else "default"
    import torch

    out: dict[str, Any] = {"scenario": "search-gpu-sync", "machine": "H200",
                           "date": datetime.date.today().isoformat(), "sched": args.sched,
                           "sched_state": sched, "cpus": args.cpus, "sets": []}  # fmt: skip
    for size in args.sizes:
        n, dim = (int(v) for v in size.split("x"))
        out["sets"].append(run_size(torch, n, dim, args.k, args.reps))
        print(json.dumps(out["sets"][-1]), flush=True)
        torch.cuda.empty_cache()
    if args.out:
        path = os.path.join(
            args.out,
            f"search-gpu-sync-H200-{out['date']}-{args.sched}{'-pinned' if args.cpus else ''}.json",
        )
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
