"""search-gpu: exact top-10 on a GPU sidecar, end to end, beside the kernel and torch in-process.

For each corpus set (``--sets``, :mod:`kalos.bench.corpora`: ``real-384`` 1M, ``real-128`` 1M,
``clustered`` 1M x 768, 1M x 1536 and 10M x 128, ``uniform`` 1M x 128; fp16, batch 1, the
corpus's held-out queries) in one run:

- ``kalos-shm``: a client's ``search`` through a ``--device cuda`` sidecar, host results
  (where the int8 prefilter runs, the GPU picks each search up itself: ``server.doorbell``);
- ``kalos-shm-poller``: the same through a second sidecar started with ``--no-gpu-doorbell``
  (the sidecar's poller launches each search), where the doorbell applies (the int8
  prefilter's sizes) and the index has at most ``--compare-rows`` rows;
- ``kalos-shm-gpu``: ``search_gpu`` with a numpy query, results handed over on the GPU;
- ``kalos-shm-gpu-query``: ``search_gpu`` with a torch CUDA query that never leaves the GPU;
- ``kalos-kernel``: the fused scan + top-k alone, a graph replay timed with CUDA events;
  ``kalos-kernel-prefilter``: the int8 prefilter's graph, where the sidecar takes it;
  ``kalos-graph-prefilter``: that graph as the sidecar runs it (its proof checked, an
  unproven search settled from every row's bound), host clocks, with how many searches were
  ``proven`` and the rows the others scored exactly (``settled_rows_p50``, ``_max``);
  ``kalos-kernel-cascade``: the 4-bit cascade's graph, where the sidecar takes it, with the
  rows its bounds left open (``candidates_p50``, ``_p99``, ``_max``); the summary's
  ``cascade.stages`` splits its GPU time per kernel (:func:`cascade_stages`, from a profiler
  trace of 1,000 searches);
- ``kalos-inprocess``: the sidecar's search path without the protocol (``GpuSearch.search``
  in this process: staging, graph launch and sync, the proof's check), host clocks;
- ``torch-inprocess`` / ``torch-inprocess-graph``: ``torch.topk(q @ db.T)`` in this process;
- ``bandwidth-floor``: the index's bytes over the copy bandwidth measured in this run.

End-to-end times are host clocks around the whole client call. Every kalos result is checked
against exact search in the same run. ``--profile`` also records a torch profiler trace of
1,000 GPU-result recalls in an in-process sidecar and counts host↔device copies.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

import numpy as np

from kalos.bench import cold_start, corpora
from kalos.bench.common import (
    add_affinity_argument,
    cpu_split,
    print_table,
    stage_medians,
    summarize,
    write_result,
)
from kalos.testing import isolated_sidecar

SCENARIO = "search-gpu"
SETS = ("real-384:1000000", "real-128:1000000", "clustered:1000000x768",
        "clustered:1000000x1536", "clustered:10000000x128", "uniform:1000000x128")  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sets", nargs="+", type=corpora.parse_set,
                   default=[corpora.parse_set(s) for s in SETS],
                   help="CORPUS:N[xDIM] (the dim is implied for real-384 and real-128), e.g. "
                        "clustered:1000000x768; corpora: " + ", ".join(corpora.NAMES))  # fmt: skip
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--queries", type=int, default=2000,
                   help="timed recalls per system (the corpus's held-out queries)")  # fmt: skip
    p.add_argument("--seed", type=int, default=corpora.SEED, help="the corpora's seed")
    p.add_argument("--corpus-dir", default=None,
                   help="the corpora's cache (default $KALOS_CORPUS_DIR or "
                        "~/.cache/kalos/corpora)")  # fmt: skip
    p.add_argument("--profile", action="store_true", help="count copies in a profiler trace")
    p.add_argument("--spin-us", type=float, default=1000.0,
                   help="the timed client's spin_us (kalos.connect's default against a GPU "
                        "sidecar: 200)")  # fmt: skip
    p.add_argument("--compare-rows", type=int, default=2_000_000,
                   help="largest index also timed through a --no-gpu-doorbell sidecar")  # fmt: skip
    p.add_argument("--scan", choices=("auto", "4bit", "int8", "full"), default="auto",
                   help="the index's first pass for single-query searches (cuda:flat's scan=): "
                        "auto, the default, picks by dim")  # fmt: skip
    p.add_argument("--no-cold-start", dest="cold_start", action="store_false",
                   help="skip the first set's cold start (kalos.bench.cold_start)")  # fmt: skip
    add_affinity_argument(p, cpus="last two CPUs")


def _load(sidecar: Any, db: Any, ids: np.ndarray, n: int, dim: int) -> None:
    loader = sidecar.connect(arena_bytes=64 << 20, timeout=120)
    host_db = db.cpu().numpy()
    step = (60 << 20) // (dim * 2 + 8 + 9)
    for lo in range(0, n, step):
        loader.add(host_db[lo : lo + step], ids[lo : lo + step])
    loader.close()


def _timed_host(
    args: argparse.Namespace, client: Any, fn: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``fn(i)`` timed over ``args.queries`` calls: (its row's samples and wall, its stage
    medians with the counts of responses the GPU published and picked up itself)."""
    timings: list[Any] = []

    def timed(i: int) -> None:
        fn(i)
        timings.append(client.last_timings)

    before = client.stats()
    samples, wall = _host_times(timed, args.queries)
    after = client.stats()
    stages = stage_medians(timings)
    # calls the kernel answered itself: their compute stage ends at the launch, and the
    # kernel's time falls in the client's share (docs/PROTOCOL.md); those the GPU also picked
    # up (the doorbell) have no sidecar stage at all
    for key, name in (
        ("gpu_published", "gpu_published"),
        ("gpu_doorbell_answered", "gpu_doorbell"),
        ("gpu_doorbell_settled", "gpu_doorbell_settled"),
    ):
        stages[name] = after.get(key, 0) - before.get(key, 0)
    return {"samples": samples, "wall": wall}, stages


# The 4-bit cascade's kernels (kernels.codes4), in launch order, as the stage each is: the
# second scan is the exact pass
CASCADE_STAGES = {"_prep_kernel": "prep", "_scan_topk_kernel": "bounds", "_emit_kernel": "emit",
                  "_scan_topk_kernel#2": "exact"}  # fmt: skip


def cascade_stages(kernels: list[tuple[str, float, float]], counts: list[int]) -> dict[str, Any]:
    """Where a cascade search's GPU time goes, from the profiler's kernel records ``(name,
    start_us, end_us)`` of consecutive searches (each begins with the prep kernel; records of
    other kernels, such as the query's copy, are left out): per stage (``CASCADE_STAGES``) the
    p50 and p99 of its time, the GPU's idle time between them (``gaps``) and the whole
    (``span``), in µs. With ``counts``, each search's open rows in the same order, the exact
    pass's time is fitted to them: ``exact_fixed_us`` + ``exact_us_per_1k_rows`` per 1,000
    rows."""
    searches: list[dict[str, float]] = []  # kernel (the second of a name: name#2) -> µs
    bounds: list[tuple[float, float]] = []
    for name, start, end in sorted(kernels, key=lambda r: r[1]):
        if name == "_prep_kernel":
            searches.append({})
            bounds.append((start, end))
        elif not searches or name not in CASCADE_STAGES:
            continue
        times = searches[-1]
        times[name if name not in times else f"{name}#2"] = end - start
        bounds[-1] = (bounds[-1][0], end)
    if not searches:
        return {"searches": 0}
    out: dict[str, Any] = {"searches": len(searches)}
    spans = np.array([b - a for a, b in bounds])
    per = {s: np.array([t.get(k, 0.0) for t in searches]) for k, s in CASCADE_STAGES.items()}
    per["gaps"] = spans - sum(per.values())
    per["span"] = spans
    for s, v in per.items():
        out[s] = {"p50_us": round(float(np.percentile(v, 50)), 2),
                  "p99_us": round(float(np.percentile(v, 99)), 2)}  # fmt: skip
    if len(counts) == len(searches) and len(set(counts)) > 1:
        slope, fixed = np.polyfit(np.asarray(counts, float) / 1e3, per["exact"], 1)
        out["exact_fixed_us"] = round(float(fixed), 2)
        out["exact_us_per_1k_rows"] = round(float(slope), 3)
    return out


def _copy_bandwidth(torch: Any) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus written."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * 20 * src.numel() / (start.elapsed_time(end) / 1e3)


def _event_times(torch: Any, fn: Any, n: int) -> np.ndarray:
    """ns per call of ``fn`` measured with CUDA events, one pair per call."""
    out = np.zeros(n, np.int64)
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
             for _ in range(n)]  # fmt: skip
    for a, b in pairs:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(pairs):
        out[i] = int(a.elapsed_time(b) * 1e6)
    return out


def _host_times(fn: Any, n: int) -> tuple[np.ndarray, float]:
    out = np.zeros(n, np.int64)
    clock = time.perf_counter_ns
    t0 = time.perf_counter()
    for i in range(n):
        t = clock()
        fn(i)
        out[i] = clock() - t
    return out, time.perf_counter() - t0


def _run_size(args: argparse.Namespace, torch: Any, corpus: corpora.Corpus, bw: float) -> dict:
    from kalos.index.cuda_flat import CudaFlatIndex
    from kalos.server.gpu_search import GpuSearch

    k = args.k
    n, dim = corpus.n, corpus.dim
    db = torch.empty((n, dim), device="cuda", dtype=torch.float16)  # [n, dim] fp16
    step = 1 << 20
    for lo in range(0, n, step):
        db[lo : lo + step] = torch.from_numpy(corpus.db[lo : lo + step]).cuda()
    ids = np.arange(n, dtype=np.int64) * 3 + 1
    ids_t = torch.from_numpy(ids).cuda()
    queries = corpus.queries  # [args.queries, dim] float32 unit rows, held out of the corpus
    q_gpu = torch.from_numpy(queries).cuda()
    rows: list[dict[str, Any]] = []
    t_set = time.monotonic()

    def mark(what: str) -> None:  # where a set's minutes go (a GPU host's time is scarce)
        print(f"[{time.monotonic() - t_set:7.1f} s] {what}", flush=True)

    # Kernel alone: the same index class in this process, one graph replay per search.
    spec = f"cuda:flat,fp16,scan={args.scan}"
    index = CudaFlatIndex.from_spec(spec, dim=dim, metric="ip")
    index.reserve(n)
    index.add(db, ids_t)
    graph = index.graph(1, k)
    qi = iter(range(10**9))

    def kernel() -> None:
        graph.query.copy_(q_gpu[next(qi) % len(q_gpu)][None])
        graph.replay()

    mark("in-process index built")
    _event_times(torch, kernel, 50)
    t_kernel = _event_times(torch, graph.replay, args.queries)
    rows.append(summarize("kalos-kernel", t_kernel))
    # The int8 prefilter's graph, where the sidecar takes it (index.prefilter_min_rows, 1M
    # rows): its replay alone (the proof's check and any fallback happen on the host, after it)
    pre_floor_us = n * (dim + 12) / bw * 1e6
    if index.scan == "int8" and index.prefilter_ok(1, k) and n >= index.prefilter_min_rows:
        pre = index.graph(1, k, prefilter=True)
        pre.query.copy_(q_gpu[:1])
        replay = pre.prefilter_cuda_graph().replay
        _event_times(torch, replay, 50)
        row = summarize("kalos-kernel-prefilter", _event_times(torch, replay, args.queries))
        row["floor_us"] = round(pre_floor_us, 3)
        rows.append(row)
        # The same graph as the sidecar runs it (replay_and_wait: the prefilter, its proof's
        # check on the host, and an unproven search settled from every row's bound), a new
        # query each search, host clocks: how many settled in the first pool, and how many
        # rows the others scored exactly
        stream = torch.cuda.current_stream()
        settled: list[int] = []

        def run_graph(i: int) -> None:
            pre.query.copy_(q_gpu[i % len(q_gpu)][None])
            pre.replay_and_wait(stream)
            if pre.fallbacks > len(settled):
                settled.append(pre.settled_rows)

        for i in range(50):
            run_graph(i)
        settled.clear()
        pre.fallbacks = 0
        row = summarize("kalos-graph-prefilter", _host_times(run_graph, args.queries)[0])
        s_arr = np.array(settled or [0])
        row.update(searches=args.queries, proven=args.queries - len(settled),
                   settled_rows_p50=int(np.percentile(s_arr, 50)) if settled else 0,
                   settled_rows_max=int(s_arr.max()) if settled else 0)  # fmt: skip
        rows.append(row)
        del pre
    # The 4-bit cascade's graph (index.scan == "4bit"), a new query each replay: its time, and
    # how many rows its bounds left to the exact pass (every search settles in one cascade:
    # nothing is replayed)
    cascade_stats: dict[str, Any] = {}
    if index.scan == "4bit" and index.prefilter_ok(1, k) and n >= index.prefilter_min_rows:
        from kalos.index.kernels import codes4

        casc = index.graph(1, k, prefilter=True)
        cuda_graph = casc.prefilter_cuda_graph()
        ci = iter(range(10**9))

        def cascade() -> None:
            casc.query.copy_(q_gpu[next(ci) % len(q_gpu)][None])
            cuda_graph.replay()

        _event_times(torch, cascade, 50)
        row = summarize("kalos-kernel-cascade", _event_times(torch, cascade, args.queries))
        codes_bytes = n * (codes4.padded_dim(dim) // 2 + 8)
        row["floor_us"] = round(codes_bytes / bw * 1e6, 3)
        # the same replays under the profiler: each kernel's time per search, beside the rows
        # the search left open
        counts = []
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            for i in range(min(1000, len(q_gpu))):
                casc.query.copy_(q_gpu[i][None])
                cuda_graph.replay()
                torch.cuda.synchronize()
                counts.append(int(casc._status_np[1]))
        c = np.array(counts)
        cascade_stats = {
            "searches": len(c),
            "replayed": 0,
            "candidates_p50": int(np.percentile(c, 50)),
            "candidates_p99": int(np.percentile(c, 99)),
            "candidates_max": int(c.max()),
        }
        row.update(cascade_stats)
        cuda = torch.autograd.DeviceType.CUDA
        kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == cuda]  # fmt: skip
        cascade_stats["stages"] = cascade_stages(kernels, counts)
        print("cascade stages:", cascade_stats["stages"])
        rows.append(row)
        del casc
    mark("kernel rows timed")
    # The sidecar's search path without the protocol: GpuSearch.search in this process (the
    # query staged in pinned memory, the graph launched and waited for through the driver,
    # the proof's check), host clocks. Its gap to the kernel rows is the launch, the sync and
    # the Python around them; its gap to kalos-shm's compute stage is the sidecar process's.
    searcher = GpuSearch(index)
    for i in range(50):
        searcher.search(queries[i % len(queries)][None], k, None)
    row = summarize(
        "kalos-inprocess",
        _host_times(lambda i: searcher.search(queries[i][None], k, None), args.queries)[0],
    )
    rows.append(row)

    # torch.topk(q @ db.T) in this process, eager and as a CUDA graph.
    qs = q_gpu.half()
    j = iter(range(10**9))

    def eager() -> None:
        torch.topk(qs[next(j) % len(qs)][None] @ db.T, k)

    _event_times(torch, eager, 50)
    rows.append(summarize("torch-inprocess", _event_times(torch, eager, args.queries)))
    static_q = qs[:1].clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            torch.topk(static_q @ db.T, k)
    torch.cuda.current_stream().wait_stream(s)
    tg = torch.cuda.CUDAGraph()
    with torch.cuda.graph(tg):
        torch.topk(static_q @ db.T, k)
    rows.append(summarize("torch-inprocess-graph", _event_times(torch, tg.replay, args.queries)))
    # The reference scores in float32 over the fp16 vectors (fp16 scores near the top are
    # 0.125 apart at dim 768: too coarse to judge ties).
    exact = [torch.topk(q_gpu[i : i + 25] @ db.T.float(), k) for i in range(0, 200, 25)]
    exact_ids = ids_t[torch.cat([r for _, r in exact])].cpu().numpy()
    exact_kth = torch.cat([s for s, _ in exact])[:, -1].cpu().numpy()
    max_norm = float(db.float().norm(dim=1).max())

    mark("in-process and torch rows timed")
    # End to end through a sidecar on the same GPU.
    floor_us = n * dim * 2 / bw * 1e6
    with tempfile.TemporaryDirectory(prefix="kalos-bench-") as rd, isolated_sidecar(
        dim=dim, name="bench-gpu", runtime_dir=rd,
        extra_args=("--device", "cuda", "--index", spec, "--reserve", str(n)),
    ) as sidecar:  # fmt: skip
        mark("sidecar ready")
        _load(sidecar, db, ids, n, dim)
        mark("sidecar loaded")
        # the sidecar on two CPUs of its own (its poller spins in the stream sync; its other
        # threads wake beside it), this process's threads on the others
        with cpu_split(args.affinity, {"sidecar": sidecar.process.pid}, 2) as affinity:
            # a long deadline: the first calls compile the kernels and capture the graphs
            client = sidecar.connect(gpu_results=True, spin_us=args.spin_us, timeout=120)
            wrong = 0
            for i in range(200):  # correctness in the same run (tie-aware: k-th score bound)
                got = client.search(queries[i], k, payloads=False).ids
                got_gpu = client.search_gpu(queries[i], k).ids.cpu().numpy()
                same = set(got.tolist()) == set(exact_ids[i].tolist())
                tol = 2.0**-10 * float(np.linalg.norm(queries[i])) * max_norm
                wrong += int(not same and not _tie_ok(db, ids, queries[i], got, exact_kth[i], tol))
                wrong += int(not np.array_equal(np.sort(got), np.sort(got_gpu)))
            for _ in range(200):
                client.search(queries[0], k, payloads=False)
                client.search_gpu(queries[0], k)
                client.search_gpu(q_gpu[0], k)
            stages: dict[str, dict[str, float]] = {}

            def host(i: int) -> None:
                client.search(queries[i], k, payloads=False)

            def gpu(i: int) -> None:
                client.search_gpu(queries[i], k)

            def gpu_query(i: int) -> None:
                client.search_gpu(q_gpu[i], k)

            for name, fn in (("kalos-shm", host), ("kalos-shm-gpu", gpu),
                             ("kalos-shm-gpu-query", gpu_query)):  # fmt: skip
                timed, stages[name] = _timed_host(args, client, fn)
                rows.append(summarize(name, timed["samples"], timed["wall"]))
            client.close()
    mark("end-to-end rows timed")
    # The same host searches with the sidecar's poller launching each, side by side.
    doorbell_applies = n >= index.prefilter_min_rows and index.prefilter_ok(1, k)
    if doorbell_applies and n <= args.compare_rows:
        with tempfile.TemporaryDirectory(prefix="kalos-bench-") as rd, isolated_sidecar(
            dim=dim, name="bench-gpu-poller", runtime_dir=rd,
            extra_args=("--device", "cuda", "--reserve", str(n), "--no-gpu-doorbell"),
        ) as sidecar:  # fmt: skip
            _load(sidecar, db, ids, n, dim)
            with cpu_split(args.affinity, {"sidecar": sidecar.process.pid}, 2):
                client = sidecar.connect(spin_us=args.spin_us, timeout=120)
                for i in range(200):
                    got = client.search(queries[i], k, payloads=False).ids
                    same = set(got.tolist()) == set(exact_ids[i].tolist())
                    tol = 2.0**-10 * float(np.linalg.norm(queries[i])) * max_norm
                    wrong += int(
                        not same and not _tie_ok(db, ids, queries[i], got, exact_kth[i], tol)
                    )

                def plain(i: int) -> None:
                    client.search(queries[i], k, payloads=False)

                name = "kalos-shm-poller"
                timed, stages[name] = _timed_host(args, client, plain)
                rows.append(summarize(name, timed["samples"], timed["wall"]))
                client.close()
        mark("poller rows timed")
    rows.append({"system": "bandwidth-floor", "p50_us": round(floor_us, 3),
                 "bytes": n * dim * 2, "copy_bandwidth_TBps": round(bw / 1e12, 3)})  # fmt: skip
    by = {r["system"]: r for r in rows}
    summary = {
        "e2e_p99_us": by["kalos-shm"]["p99_us"],
        "e2e_gpu_p99_us": by["kalos-shm-gpu"]["p99_us"],
        "e2e_poller_p99_us": by.get("kalos-shm-poller", {}).get("p99_us"),
        "kernel_p50_us": by["kalos-kernel"]["p50_us"],
        "kernel_over_floor": round(by["kalos-kernel"]["p50_us"] / floor_us, 3),
        "prefilter_kernel_p50_us": by.get("kalos-kernel-prefilter", {}).get("p50_us"),
        "prefilter_kernel_over_its_floor": (
            round(by["kalos-kernel-prefilter"]["p50_us"] / pre_floor_us, 3)
            if "kalos-kernel-prefilter" in by
            else None
        ),
        "torch_over_kalos_e2e_p50": round(
            by["torch-inprocess"]["p50_us"] / by["kalos-shm"]["p50_us"], 3
        ),
        "wrong_results": wrong,
        "scan": index.scan,
        **({"cascade": cascade_stats} if cascade_stats else {}),
    }
    return {"params": {"corpus": corpus.name, "n": n, "dim": dim, "dtype": "float16", "k": k,
                       "batch": 1, "index": spec, "client_spin_us": args.spin_us,
                       "corpus_info": corpus.info},
            "rows": rows, "summary": summary, "checks": {"wrong_results": wrong},
            "stage_median_us": stages, "affinity": affinity}  # fmt: skip


def _tie_ok(
    db: Any, ids: np.ndarray, q: np.ndarray, got: np.ndarray, kth: float, tol: float
) -> bool:
    """Whether every returned id scores at least the exact k-th score, within ``tol`` (the
    fp16 rounding of a dot product: exact ties may come back in any order)."""
    import torch

    rows = torch.from_numpy(np.searchsorted(ids, got)).cuda()
    scores = (db[rows].float() @ torch.from_numpy(q).cuda()).cpu().numpy()
    return bool((scores >= kth - tol).all())


def _profile_client(runtime_dir: str, dim: int, recalls: int) -> None:
    """The client half of :func:`_profile`, in its own process (CUDA IPC handles cannot be
    opened by the process that exported them)."""
    from kalos.client import connect

    client = connect("prof", runtime_dir=runtime_dir, gpu_results=True)
    q = np.random.default_rng(0).standard_normal((recalls, dim), dtype=np.float32)
    for i in range(recalls):
        client.search_gpu(q[i], 10)
    client.close()


def _profile(torch: Any, dim: int = 128, n: int = 1_000_000) -> dict[str, Any]:
    """1,000 GPU-result recalls against an in-process sidecar recorded by the torch profiler:
    counts the sidecar's host↔device copies (each query goes up; nothing of the index or of
    the results comes down). The client runs in another process, as in production."""
    import multiprocessing

    from kalos.server import Sidecar, SidecarConfig

    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="kalos-prof-") as rd:
        cfg = SidecarConfig(name="prof", dim=dim, device="cuda", runtime_dir=rd, reserve=n)
        with Sidecar(cfg) as sidecar:
            db = torch.randn((n, dim), device="cuda").half()
            sidecar.memories.index.add(db, torch.arange(n, device="cuda"))
            warm = ctx.Process(target=_profile_client, args=(rd, dim, 50))
            warm.start()
            warm.join()
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=acts) as prof:
                proc = ctx.Process(target=_profile_client, args=(rd, dim, 1000))
                proc.start()
                proc.join()
    counts: dict[str, int] = {}
    for e in prof.events():
        if "memcpy" in e.name.lower():
            counts[e.name] = counts.get(e.name, 0) + 1
    path = os.path.join(tempfile.gettempdir(), "kalos-gpu-results-trace.json")
    prof.export_chrome_trace(path)
    dtoh = sum(v for name, v in counts.items() if "DtoH" in name)
    # the sidecar launches its graphs through the driver (cuGraphLaunch; the runtime's
    # cudaGraphLaunch before): count either, and the scan kernels that ran on the GPU
    graphs = sum(1 for e in prof.events() if e.name in ("cudaGraphLaunch", "cuGraphLaunch"))
    scans = sum(1 for e in prof.events() if e.name == "_scan_topk_kernel")
    return {"recalls": 1000, "copy_events": counts, "device_to_host_copies": dtoh,
            "graph_launches": graphs, "scan_kernels": scans, "trace": path}  # fmt: skip


def run(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        print("search-gpu needs a CUDA GPU")
        return 2
    bw = _copy_bandwidth(torch)
    extra: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(),
        "cuda": torch.version.cuda,
        "copy_bandwidth_TBps": round(bw / 1e12, 3),
        "sets": [],
    }
    path = ""
    for name, n, dim in args.sets:
        corpus = corpora.load(name, n, dim, queries=args.queries, seed=args.seed,
                              cache_dir=args.corpus_dir, progress=not args.quiet)  # fmt: skip
        print(f"\n{name} {corpus.n:,} x {corpus.dim}: loaded in {corpus.info['load_s']} s")
        torch.cuda.empty_cache()  # what the corpus's build held (the embedding model)
        if args.cold_start and not extra["sets"]:  # the first set only, before it is timed
            extra["cold_start"] = cold_start.measure(
                torch, corpus.db.astype(np.float16), np.arange(corpus.n, dtype=np.int64) * 3 + 1,
                corpus.queries, quiet=args.quiet)  # fmt: skip
            extra["cold_start"]["corpus"] = corpus.name
        r = _run_size(args, torch, corpus, bw)
        del corpus
        torch.cuda.empty_cache()
        extra["sets"].append(r)
        wrong = sum(s["checks"]["wrong_results"] for s in extra["sets"])
        extra["checks"] = {"wrong_results": wrong}
        print(f"{name} {n:,} x {r['params']['dim']} fp16, top-{args.k}, batch 1")
        print_table(r["rows"])
        print(r["summary"])
        print("stage medians:", r["stage_median_us"])
        first = extra["sets"][0]  # rewritten after every size: a cut-off run keeps its sets
        path = write_result(SCENARIO, args.machine or "H200", first["params"], first["rows"],
                            args.out, **extra)  # fmt: skip
    if args.profile:
        extra["profile_gpu_results"] = _profile(torch)
        print("profile:", extra["profile_gpu_results"])
        first = extra["sets"][0]
        path = write_result(SCENARIO, args.machine or "H200", first["params"], first["rows"],
                            args.out, **extra)  # fmt: skip
    print(f"wrote {path}")
    return 1 if any(r["summary"]["wrong_results"] for r in extra["sets"]) else 0
