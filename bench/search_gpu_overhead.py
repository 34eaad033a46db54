"""search-gpu, the sidecar's own time around the kernel: where the ~40 µs between the kernel
(76 µs at 1M x 128) and the sidecar's compute time (120 µs) go, variant by variant.

In one process on the GPU, for 100K and 1M x 128 fp16, top-10, batch 1, host clocks around
each call (what the sidecar's poller sees):

- ``kernel``: the fused scan + merge graph, CUDA events (GPU time only), for reference;
- ``empty+sync``: a graph of one tiny kernel, replay + stream sync: the launch/sync floor;
- ``copy-nodes+sync``: the graph as served before: pinned query → device (memcpy node),
  scan, merge, device → pinned scores and ids (two memcpy nodes), then sync;
- ``served+sync``: the graph as served now: scope and query → device in one memcpy node, the
  merge writing the top-k into pinned host memory (no copy node back);
- ``served+spin``: the same, waiting by polling ``stream.query()`` instead of a sync;
- ``gpusearch``: ``GpuSearch.search`` (staging the numpy query, replay, sync, views): the whole
  index-side path of a served search;
- ``dispatch``: an in-process sidecar's ``Dispatcher.handle`` of an encoded SEARCH request
  (decode, checks, search, response encoding): everything the poller runs for a request.

(A first run also tried kernels reading the query straight from pinned host memory: 37.1 µs
at 100K against 30.4 µs with the memcpy node; every program pulls the query across PCIe.)

Every variant's results are checked against the same search through ``CudaFlatIndex.search``.

Usage (on a CUDA machine)::

    PYTHONPATH=src python3 bench/search_gpu_overhead.py --out bench/results/
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile

import numpy as np
import torch
import triton
import triton.language as tl

from kalos.bench.search_gpu import _host_times
from kalos.client import scope_bytes
from kalos.gpu import driver
from kalos.index.cuda_flat import CudaFlatIndex, SearchGraph
from kalos.protocol import messages as M
from kalos.protocol.codes import Op
from kalos.server import Sidecar, SidecarConfig
from kalos.server.gpu_search import GpuSearch, Staging, _HostResultGraph


@triton.jit
def _tiny(x_ptr):
    tl.store(x_ptr, tl.load(x_ptr) + 1)


class _CopyNodeGraph(SearchGraph):
    """The host-result graph as it was: device buffers, three memcpy nodes."""

    def __init__(self, index: CudaFlatIndex, nq: int, k: int, staging: Staging) -> None:
        self.staging = staging
        lo = staging.QUERY_OFFSET  # a view of the pinned request block
        self.pinned_query = staging.block[lo : lo + nq * index.dim * 4].view(torch.float32)
        super().__init__(index, nq, k, False)

    def _run(self) -> None:
        s, nq, k = self.staging, self.nq, self.k
        self.query.view(-1).copy_(self.pinned_query, non_blocking=True)
        super()._run()
        s.scores[: nq * k].view(nq, k).copy_(self.scores, non_blocking=True)
        s.ids[: nq * k].view(nq, k).copy_(self.ids, non_blocking=True)


def _graph_of(fn) -> torch.cuda.CUDAGraph:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        fn()
    torch.cuda.synchronize()
    return g


def _row(name: str, ns: np.ndarray) -> dict:
    us = ns / 1e3
    return {"system": name, "n": len(us), "p50_us": round(float(np.percentile(us, 50)), 2),
            "p99_us": round(float(np.percentile(us, 99)), 2),
            "p999_us": round(float(np.percentile(us, 99.9)), 2)}  # fmt: skip


def run_size(n: int, dim: int, k: int, reps: int, sidecar: Sidecar) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(n + dim)
    index = sidecar.memories.index
    assert isinstance(index, CudaFlatIndex) and len(index) == 0
    index.reserve(n)
    index.add(torch.randn((n, dim), generator=gen, device="cuda").half(),
              torch.arange(n, device="cuda"))  # fmt: skip
    qs = np.random.default_rng(5).standard_normal((256, dim), dtype=np.float32)
    stream = torch.cuda.current_stream()
    staging = Staging(dim, 64, index.device)
    rows = []
    wrong = 0

    def check(ids: np.ndarray, i: int) -> None:
        nonlocal wrong
        _, want = index.search(qs[i % 256][None], k)
        wrong += int(not np.array_equal(np.sort(ids.reshape(-1)), np.sort(want.reshape(-1))))

    kernel = index.graph(1, k)

    def kernel_fn() -> None:
        kernel.replay()

    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(reps)]  # fmt: skip
    for a, b in ev:
        a.record()
        kernel_fn()
        b.record()
    torch.cuda.synchronize()
    rows.append(_row("kernel", np.array([a.elapsed_time(b) * 1e6 for a, b in ev])))

    x = torch.zeros(1, dtype=torch.int32, device="cuda")
    empty = _graph_of(lambda: _tiny[(1,)](x))

    def empty_fn(i: int) -> None:
        empty.replay()
        stream.synchronize()

    variants = {
        "copy-nodes+sync": _CopyNodeGraph(index, 1, k, staging),
        "served+sync": _HostResultGraph(index, 1, k, False, staging),
    }

    def replay_fn(g):
        def fn(i: int) -> None:
            staging.query_np[0] = qs[i % 256]
            g.replay_and_wait(stream)

        return fn

    zc = variants["served+sync"]

    def spin_fn(i: int) -> None:
        staging.query_np[0] = qs[i % 256]
        zc.cuda_graph.replay()
        while not stream.query():
            pass

    gs = GpuSearch(index)

    def gpusearch_fn(i: int) -> None:
        gs.search(qs[i % 256][None], k, None)

    bodies = np.zeros((256, 4096), np.uint8)
    lengths = [M.encode_search(bodies[i], qs[i][None], k, scope_bytes(None)) for i in range(256)]
    out = np.zeros(1 << 20, np.uint8)
    handle = sidecar.dispatcher.handle

    def dispatch_fn(i: int) -> None:
        status, _, _, _ = handle(Op.SEARCH, 0, bodies[i % 256][: lengths[i % 256]], out)
        assert status == 0, bytes(out[:200])

    # session 3: the same graphs launched and waited for through the driver (ctypes), without
    # torch's CUDAGraph.replay bookkeeping and Stream.synchronize
    empty_raw = driver.graph_launcher(empty.raw_cuda_graph_exec(), stream.cuda_stream)
    served = variants["served+sync"]
    served_raw = driver.graph_launcher(served.cuda_graph.raw_cuda_graph_exec(), stream.cuda_stream)

    def empty_raw_fn(i: int) -> None:
        empty_raw()

    def served_raw_fn(i: int) -> None:
        staging.query_np[0] = qs[i % 256]
        served_raw()

    fns = {"empty+sync": empty_fn, "empty+raw": empty_raw_fn,
           **{name: replay_fn(g) for name, g in variants.items()}, "served+raw": served_raw_fn,
           "served+spin": spin_fn, "gpusearch": gpusearch_fn, "dispatch": dispatch_fn}  # fmt: skip
    for name, fn in fns.items():  # correctness of every variant that returns top-k
        for i in range(20):
            fn(i)
            if name == "gpusearch":
                check(gs.staging.ids_np[:k].copy(), i)
            elif name == "dispatch":
                check(sidecar.gpu.staging.ids_np[:k].copy(), i)
            elif not name.startswith("empty"):
                check(staging.ids_np[:k].copy(), i)
    samples: dict[str, list[np.ndarray]] = {name: [] for name in fns}
    for _ in range(5):  # interleaved blocks
        for name, fn in fns.items():
            for i in range(50):
                fn(i)
            samples[name].append(_host_times(fn, reps // 5)[0])
    rows += [_row(name, np.concatenate(s)) for name, s in samples.items()]
    # what one torch replay of the served graph puts on the GPU besides the graph
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(10):
            replay_fn(served)(i)
    counts: dict[str, int] = {}
    for e in prof.events():
        counts[e.name] = counts.get(e.name, 0) + 1
    print("10 torch replays, GPU events:", {k: v for k, v in counts.items() if v})
    return {"params": {"n": n, "dim": dim, "dtype": "float16", "k": k, "batch": 1},
            "rows": rows, "wrong_results": wrong}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--reps", type=int, default=3000)
    args = ap.parse_args()
    sets = []
    for n in (100_000, 1_000_000):
        with (
            tempfile.TemporaryDirectory() as rd,
            Sidecar(
                SidecarConfig(name="overhead", dim=128, device="cuda", runtime_dir=rd, reserve=n)
            ) as sidecar,
        ):
            r = run_size(n, 128, 10, args.reps, sidecar)
        sets.append(r)
        print(f"\n{n:,} x 128 fp16 top-10 (wrong: {r['wrong_results']})")
        for row in r["rows"]:
            print(f"  {row['system']:<24} p50 {row['p50_us']:8.2f}  p99 {row['p99_us']:8.2f}")
        torch.cuda.empty_cache()
    date = datetime.date.today().isoformat()
    doc = {"scenario": "search-gpu-overhead", "machine": "H200", "date": date,
           "versions": {"torch": torch.__version__, "triton": triton.__version__},
           "gpu": torch.cuda.get_device_name(), "params": sets[0]["params"],
           "rows": sets[0]["rows"], "sets": sets}  # fmt: skip
    path = os.path.join(args.out, f"search-gpu-overhead-H200-{date}.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
