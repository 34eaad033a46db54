"""search-ann: an inverted-file index's recall@10 against exact search, and its latency, per nprobe.

One corpus (``--corpus``, :mod:`kalos.bench.corpora`; default ``clustered`` 100K x 128), three
things built on the same rows:

- the ground truth: the exact top-k of every query in float32 by brute force (numpy, or torch
  on the GPU with ``--device cuda``), a chunk of rows at a time;
- the exact index (``--exact``, default ``cpu:flat`` or ``cuda:flat,fp16``; ``none`` skips it),
  timed as the reference row;
- the IVF index (``<device>:ivf,nlist=N``; ``--nlist`` default about 4 * sqrt(n), a power of
  two), built by adds of ``--chunk`` rows (the training rule of docs/ANN.md applies on the
  way), then flushed; its build seconds and memory are recorded.

Then for each ``--nprobe`` setting: recall@k of every query against the ground truth, and the
latency of ``--queries`` single-query searches (batch 1), in-process (``index.search``) and,
unless ``--no-sidecar``, end to end through a sidecar's client (``kalos serve --index <the
same spec> --load``: the sidecar reads the corpus from a .npy itself, and builds the same
index), ``nprobe`` sent per request. Every row carries ``recall_at_10`` (recall@k for the
run's k), ``p50_us`` and ``p99_us``. A PNG plots recall against p99.

At 100M rows the corpus alone is 51 GB of host memory (float32); the index is built in chunks
on the GPU and the ground truth uploads a chunk of rows at a time. ``--exact none`` and
``--no-sidecar`` keep such a run to one copy of the index.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import tempfile
import time
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from kalos import index as kindex
from kalos.bench import corpora
from kalos.bench.common import (
    load_average,
    print_table,
    stage_medians,
    summarize,
    write_sets,
)
from kalos.bench.plots import plot_recall
from kalos.index.cpu_ivf import suggested_nlist
from kalos.server.bulk_load import CHUNK_ROWS

SCENARIO = "search-ann"
TRUTH_CHUNK = 1 << 20  # rows per ground-truth block


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--corpus", choices=corpora.NAMES, default="clustered")
    p.add_argument("--n", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=None,
                   help="implied for real-384 and real-128; 128 for the others")  # fmt: skip
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--queries", type=int, default=1000,
                   help="held-out queries: every one scored for recall, and timed")  # fmt: skip
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--metric", choices=("ip", "cosine", "l2"), default="ip")
    p.add_argument("--nlist", type=int, default=None,
                   help="lists (default: about 4 * sqrt(n), a power of two)")  # fmt: skip
    p.add_argument("--nprobe", type=int, nargs="+", default=None,
                   help="settings swept (default: powers of 2 up to min(nlist, 512))")  # fmt: skip
    p.add_argument("--exact", default=None,
                   help="the exact index timed beside it (default cpu:flat or cuda:flat,fp16;"
                        " none: skip)")  # fmt: skip
    p.add_argument("--chunk", type=int, default=CHUNK_ROWS,
                   help="rows per add while building (as the sidecar's --load adds)")  # fmt: skip
    p.add_argument("--clients", type=int, default=0,
                   help="after the sweep, this many concurrent callers through the "
                        "sidecar (8 a process), closed loop, at the first nprobe of "
                        "recall >= 0.95")  # fmt: skip
    p.add_argument("--duration", type=float, default=5.0,
                   help="seconds of the concurrent callers' run")  # fmt: skip
    p.add_argument("--append", action="store_true",
                   help="add this run's set to the machine's file (another corpus or size) "
                        "instead of replacing it")  # fmt: skip
    p.add_argument("--no-sidecar", dest="sidecar", action="store_false",
                   help="in-process only (no end-to-end rows)")  # fmt: skip
    p.add_argument("--profile", action="store_true",
                   help="also record where a single-query search's time goes at the "
                        "first nprobe (torch profiler: host calls, device time)")  # fmt: skip
    p.add_argument("--seed", type=int, default=corpora.SEED, help="the corpus's seed")
    p.add_argument("--corpus-dir", default=None,
                   help="the corpora's cache (default $KALOS_CORPUS_DIR or "
                        "~/.cache/kalos/corpora)")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    # in-process searches run with one BLAS thread, as the sidecar's (compute_threads 1)
    with threadpool_limits(limits=1 if args.device == "cpu" else None):
        return _run(args)


def ground_truth(
    db: np.ndarray, queries: np.ndarray, k: int, metric: str, device: str
) -> np.ndarray:
    """The exact top-k ids [nq, k] (row numbers) of queries against db in float32, by brute
    force a block of TRUTH_CHUNK rows at a time (torch on the GPU for device "cuda")."""
    if device == "cuda":
        return _truth_torch(db, queries, k, metric)
    q = _prepared(queries, metric)
    best_s = np.full((len(q), 0), -np.inf, np.float32)
    best_i = np.empty((len(q), 0), np.int64)
    for lo in range(0, len(db), TRUTH_CHUNK):
        x = _prepared(np.asarray(db[lo : lo + TRUTH_CHUNK], np.float32), metric)
        s = q @ x.T  # [nq, chunk]
        if metric == "l2":
            s -= 0.5 * np.einsum("ij,ij->i", x, x)
        kk = min(k, s.shape[1])
        part = np.argpartition(-s, kk - 1, axis=1)[:, :kk]
        best_s = np.concatenate([best_s, np.take_along_axis(s, part, 1)], axis=1)
        best_i = np.concatenate([best_i, part + lo], axis=1)
        keep = np.argsort(-best_s, axis=1, kind="stable")[:, :k]
        best_s, best_i = np.take_along_axis(best_s, keep, 1), np.take_along_axis(best_i, keep, 1)
    return best_i


def _prepared(x: np.ndarray, metric: str) -> np.ndarray:
    if metric != "cosine":
        return x
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-30)


def _truth_torch(db: np.ndarray, queries: np.ndarray, k: int, metric: str) -> np.ndarray:
    import torch

    q = torch.from_numpy(_prepared(queries, metric)).cuda()
    best_s = torch.full((len(q), 0), -float("inf"), device="cuda")
    best_i = torch.empty((len(q), 0), dtype=torch.int64, device="cuda")
    for lo in range(0, len(db), TRUTH_CHUNK):
        x = torch.from_numpy(np.ascontiguousarray(db[lo : lo + TRUTH_CHUNK], np.float32)).cuda()
        if metric == "cosine":
            x = x / x.norm(dim=1, keepdim=True).clamp_min(1e-30)
        s = q @ x.T
        if metric == "l2":
            s -= 0.5 * x.square().sum(dim=1)
        top = torch.topk(s, min(k, s.shape[1]), dim=1)
        best_s = torch.cat([best_s, top.values], dim=1)
        best_i = torch.cat([best_i, top.indices + lo], dim=1)
        top = torch.topk(best_s, min(k, best_s.shape[1]), dim=1)
        best_s, best_i = top.values, best_i.gather(1, top.indices)
    return best_i.cpu().numpy()


def recall_at(got: np.ndarray, want: np.ndarray, at: int = 10) -> float:
    """recall@at: the share of the true top-``at`` ids (want [nq, >= at]) found among the
    first ``at`` of got [nq, >= at]."""
    got, want = got[:, :at], want[:, :at]
    hits = sum(len(set(g.tolist()) & set(w.tolist())) for g, w in zip(got, want, strict=True))
    return hits / want.size


def _time_searches(search: Any, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each query searched alone: (latency ns [nq], ids [nq, k])."""
    clock = time.perf_counter_ns
    lat = np.empty(len(queries), np.int64)
    found = []
    for i in range(len(queries)):
        t0 = clock()
        ids = search(queries[i])
        lat[i] = clock() - t0
        found.append(ids)
    return lat, np.stack(found)


def _memory_mark(device: str) -> int:
    """GPU memory allocated now (after freeing cached blocks), its peak counter reset."""
    if device != "cuda":
        return 0
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return int(torch.cuda.memory_allocated())


def _build(
    spec: str, db: np.ndarray, ids: np.ndarray, metric: str, chunk: int, device: str
) -> tuple[Any, float, dict[str, int]]:
    """The index of ``spec`` with every row added ``chunk`` at a time, flushed:
    (index, build seconds, {bytes it holds; on the GPU also the peak while building})."""
    before = _memory_mark(device)
    t0 = time.perf_counter()
    index = kindex.create(spec, dim=db.shape[1], metric=metric)
    for lo in range(0, len(db), chunk):
        index.add(np.asarray(db[lo : lo + chunk], np.float32), ids[lo : lo + chunk])
    flush = getattr(index, "flush", None)
    if flush is not None:
        flush()
    if device == "cuda":
        import torch

        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    memory = {"index_bytes": int(index.nbytes)}
    if device == "cuda":
        import torch

        memory["gpu_peak_bytes"] = int(torch.cuda.max_memory_allocated()) - before
        memory["gpu_held_bytes"] = _memory_mark(device) - before
    return index, seconds, memory


PROFILED = 200  # single-query searches under the profiler
PROFILE_NAME_CHARS = 60  # of a kernel's name in the profile (template arguments cut)


def _profile(index: Any, queries: np.ndarray, k: int, nprobe: int, device: str) -> dict[str, Any]:
    """Where :data:`PROFILED` single-query searches at ``nprobe`` spend their time, per
    search, from a torch profiler trace (after the sweep: graphs captured, kernels loaded):
    the wall time; the host time of each torch or CUDA runtime call that took the most
    (``host_us``: call -> µs, launches, graph replays, syncs and copies among them); on a GPU
    the device's busy time (``device_us``: kernels and copies), its launches (``kernels``)
    and the kernels and copies that took the most of it (``device_top_us``: name, its first
    :data:`PROFILE_NAME_CHARS` characters -> µs)."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError as exc:
        raise SystemExit("--profile needs torch: pip install 'kalos[gpu]'") from exc

    qs = [queries[i % len(queries)] for i in range(PROFILED)]
    acts = [ProfilerActivity.CPU]
    if device == "cuda":
        acts.append(ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for q in qs:
            index.search(q, k, nprobe=nprobe)
        wall = time.perf_counter() - t0
    per = 1e6 / PROFILED
    host: dict[str, float] = {}
    on_device: dict[str, float] = {}
    device_us = 0.0
    kernels = 0
    for ev in prof.key_averages():
        if ev.self_cpu_time_total > 0:
            host[ev.key] = ev.self_cpu_time_total / 1e6 * per
        dev = getattr(ev, "self_device_time_total", 0.0) or 0.0
        if dev > 0 and not ev.key.startswith(("aten::", "cuda")):
            device_us += dev / 1e6 * per
            kernels += ev.count
            name = ev.key[:PROFILE_NAME_CHARS]
            on_device[name] = on_device.get(name, 0.0) + dev / 1e6 * per
    top = sorted(host.items(), key=lambda kv: -kv[1])[:12]
    out: dict[str, Any] = {
        "nprobe": nprobe,
        "searches": PROFILED,
        "wall_us": round(wall * per, 1),
        "host_us": {name: round(us, 1) for name, us in top},
    }
    if device == "cuda":
        busiest = sorted(on_device.items(), key=lambda kv: -kv[1])[:10]
        out.update(device_us=round(device_us, 1), kernels=round(kernels / PROFILED, 1),
                   device_top_us={name: round(us, 1) for name, us in busiest})  # fmt: skip
    return out


def _run(args: argparse.Namespace) -> int:
    dim = args.dim
    if dim is None and args.corpus in ("clustered", "uniform"):
        dim = 128
    corpus = corpora.load(args.corpus, args.n, dim, queries=args.queries, seed=args.seed,
                          cache_dir=args.corpus_dir, progress=not args.quiet)  # fmt: skip
    db, queries, dim, n, k = corpus.db, corpus.queries, corpus.dim, corpus.n, args.k
    nlist = args.nlist or suggested_nlist(n)
    sweep = args.nprobe or [p for p in (1 << i for i in range(20)) if p <= min(nlist, 512)]
    spec = f"{args.device}:ivf,nlist={nlist}"
    exact_spec = args.exact or ("cpu:flat" if args.device == "cpu" else "cuda:flat,fp16")
    ids = np.arange(n, dtype=np.int64)  # ids are row numbers: the ground truth's ids

    t0 = time.perf_counter()
    truth = ground_truth(db, queries, k, args.metric, args.device)
    truth_s = time.perf_counter() - t0
    print(f"ground truth: {len(queries)} queries x {n:,} rows in {truth_s:.1f} s")

    rows: list[dict[str, Any]] = []
    if exact_spec != "none":
        exact, build_s, held = _build(exact_spec, db, ids, args.metric, args.chunk, args.device)
        for q in queries[:20]:
            exact.search(q, k)
        lat, got = _time_searches(lambda q: exact.search(q, k)[1][0], queries)
        row = summarize(f"inprocess-{exact_spec}", lat, index=exact_spec)
        row.update(recall_at_10=round(recall_at(got, truth), 5), build_s=round(build_s, 2),
                   **held)  # fmt: skip
        rows.append(row)
        del exact
        _memory_mark(args.device)

    index, build_s, held = _build(spec, db, ids, args.metric, args.chunk, args.device)
    print(f"built {spec}: {build_s:.1f} s, {held}, {index!r}")
    for nprobe in sweep:
        for q in queries[:20]:
            index.search(q, k, nprobe=nprobe)
        lat, got = _time_searches(
            lambda q, ix=index, p=nprobe: ix.search(q, k, nprobe=p)[1][0], queries
        )
        row = summarize(f"inprocess-{spec}", lat, index=spec, nprobe=nprobe)
        row.update(recall_at_10=round(recall_at(got, truth), 5))
        rows.append(row)
    if getattr(index, "graphs", False):
        # beside the first setting: the same searches with the graphs off (eager launches)
        index.graphs = False
        lat, got = _time_searches(lambda q, ix=index, p=sweep[0]: ix.search(q, k, nprobe=p)[1][0],
                                  queries)  # fmt: skip
        index.graphs = True
        row = summarize(f"inprocess-{spec}-eager", lat, index=spec, nprobe=sweep[0])
        row.update(recall_at_10=round(recall_at(got, truth), 5))
        rows.append(row)
    profile = _profile(index, queries, k, sweep[0], args.device) if args.profile else None
    if profile is not None:
        print(f"profile at nprobe {sweep[0]}: {profile}")
    build = {"build_s": round(build_s, 2), **held, "chunk_rows": args.chunk,
             "trainings": getattr(index, "trainings", None), "nlist": nlist}  # fmt: skip
    del index
    _memory_mark(args.device)

    if args.sidecar:
        rows += _through_sidecar(args, spec, db, queries, truth, sweep)

    print_table(rows, ("system", "nprobe", "recall_at_10", "p50_us", "p99_us", "qps"))
    params = {
        "corpus": corpus.name, "n": n, "dim": dim, "dtype": "float32", "k": k,
        "metric": args.metric, "index": spec, "exact_index": exact_spec, "device": args.device,
        "nprobe": sweep, "queries": len(queries), "build": build,
        "ground_truth": {"method": "brute force, float32", "seconds": round(truth_s, 2)},
        "corpus_info": corpus.info,
    }  # fmt: skip
    if profile is not None:
        params["profile"] = profile
    checks = {"recall_queries": len(queries), "recall_against": "float32 brute force"}
    path = write_sets(SCENARIO, args.machine, params, rows, args.out, append=args.append,
                      same=("corpus", "n", "dim", "index"), checks=checks,
                      load_average=load_average())  # fmt: skip
    print(f"wrote {path}")
    with open(path) as f:
        written = json.load(f)
    png = plot_recall(
        path, [panel(s) for s in (written if isinstance(written, list) else [written])]
    )
    if png:
        print(f"wrote {png}")
    return 0


def _through_sidecar(
    args: argparse.Namespace,
    spec: str,
    db: np.ndarray,
    queries: np.ndarray,
    truth: np.ndarray,
    sweep: list[int],
) -> list[dict[str, Any]]:
    """The same index served by a sidecar that loads the corpus itself (``--load``): each
    nprobe's recall and end-to-end latency through the client (shm)."""
    from kalos.testing import isolated_sidecar

    rows = []
    with tempfile.TemporaryDirectory(prefix="kalos-ann-") as tmp:
        path = os.path.join(tmp, "corpus.npy")
        np.save(path, db)  # ids: 0..n-1, the row numbers
        extra = ("--index", spec, "--device", args.device, "--load", path)
        with isolated_sidecar(dim=db.shape[1], metric=args.metric, name="bench-search-ann",
                              extra_args=extra) as sidecar:  # fmt: skip
            os.unlink(path)
            client = sidecar.connect(timeout=600.0)
            for nprobe in sweep:
                for q in queries[:20]:
                    client.search(q, args.k, nprobe=nprobe, payloads=False)
                stages: list[Any] = []

                def one(q: np.ndarray, p: int = nprobe, stages: list[Any] = stages) -> Any:
                    r = client.search(q, args.k, nprobe=p, payloads=False, copy=True)
                    stages.append(r.timings)
                    return r.ids

                lat, got = _time_searches(one, queries)
                row = summarize("kalos-shm", lat, index=spec, nprobe=nprobe)
                row.update(recall_at_10=round(recall_at(got, truth), 5),
                           stages_us=stage_medians(stages))  # fmt: skip
                rows.append(row)
            client.close()
            if args.clients > 0:
                rows.append(_concurrent(args, sidecar, spec, queries, truth, rows))
    return rows


def _concurrent(
    args: argparse.Namespace,
    sidecar: Any,
    spec: str,
    queries: np.ndarray,
    truth: np.ndarray,
    swept: list[dict[str, Any]],
) -> dict[str, Any]:
    """``args.clients`` callers (processes of up to 8 threads, a channel each) searching as
    fast as they can for ``args.duration`` s at the first swept nprobe whose recall through
    the sidecar reached 0.95 (else the largest): searches a second, latency, and the recall
    of every answer they got."""
    reached = [r for r in swept if r["recall_at_10"] >= 0.95] or swept[-1:]
    nprobe = int(reached[0]["nprobe"])
    threads = min(8, args.clients)
    procs = -(-args.clients // threads)
    ctx = mp.get_context("spawn")  # a clean interpreter: no inherited threads or torch
    out = ctx.Queue()
    target = {"name": sidecar.name, "runtime_dir": sidecar.runtime_dir}
    start_at = time.monotonic() + 3.0  # every process connected by then
    work = [ctx.Process(target=_caller_process, daemon=True,
                        args=(target, queries, truth, args.k, nprobe, threads, start_at,
                              args.duration, out))
            for _ in range(procs)]  # fmt: skip
    for w in work:
        w.start()
    parts = [out.get(timeout=120 + args.duration) for _ in work]
    for w in work:
        w.join(10)
    lat = np.concatenate([p[0] for p in parts])
    hits, answers = sum(p[1] for p in parts), sum(p[2] for p in parts)
    row = summarize("kalos-shm-concurrent", lat, index=spec, nprobe=nprobe)
    row.update(clients=procs * threads, qps=round(len(lat) / args.duration, 1),
               recall_at_10=round(hits / max(1, answers * args.k), 5))  # fmt: skip
    return row


def _caller_process(
    target: dict[str, Any], queries: np.ndarray, truth: np.ndarray, k: int, nprobe: int,
    threads: int, start_at: float, duration: float, out: Any,
) -> None:  # fmt: skip
    """One process of :func:`_concurrent`: ``threads`` callers from ``start_at`` for
    ``duration`` s; puts (latencies ns, true neighbours found, answers)."""
    import threading

    import kalos

    client = kalos.connect(target["name"], runtime_dir=target["runtime_dir"], timeout=120)
    results: list[tuple[list[int], int, int]] = []

    def caller(t: int) -> None:
        rng = np.random.default_rng(t)
        client.search(queries[0], k, nprobe=nprobe, payloads=False)  # its channel opened
        lat, hits, answers = [], 0, 0
        now = time.monotonic()
        if now < start_at:
            time.sleep(start_at - now)
        end = start_at + duration
        clock = time.perf_counter_ns
        while time.monotonic() < end:
            i = int(rng.integers(len(queries)))
            t0 = clock()
            got = client.search(queries[i], k, nprobe=nprobe, payloads=False).ids
            lat.append(clock() - t0)
            hits += len(np.intersect1d(got, truth[i, :k]))
            answers += 1
        results.append((lat, hits, answers))

    seed = os.getpid() * 64
    pool = [threading.Thread(target=caller, args=(seed + t,)) for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    client.close()
    out.put((np.array([x for r in results for x in r[0]], np.int64),
             sum(r[1] for r in results), sum(r[2] for r in results)))  # fmt: skip


def panel(result: dict[str, Any]) -> tuple[str, dict[str, list[tuple[float, float, int]]]]:
    """One parameter set of a search-ann file as a plot panel: its title, and each system's
    (p99, recall, nprobe) points; an exact index a lone point at setting 0. The eager and
    concurrent rows are single settings beside the curves, not drawn."""
    p = result["params"]
    curves: dict[str, list[tuple[float, float, int]]] = {}
    for row in result["rows"]:
        system = row["system"]
        if "recall_at_10" not in row or system.endswith(("-eager", "-concurrent")):
            continue
        if "nprobe" not in row:  # the exact index
            curves[f"exact {row.get('index', '')}".strip()] = [
                (row["p99_us"], row["recall_at_10"], 0)
            ]
            continue
        name = (
            f"in-process {row['index']}"
            if system.startswith("inprocess-")
            else (f"{system} {row['index']}")
        )
        curves.setdefault(name, []).append((row["p99_us"], row["recall_at_10"], row["nprobe"]))
    title = f"search-ann: {p['corpus']} {p['n']:,} x {p['dim']}, {p['index']}, top-{p['k']}"
    return title, curves


__all__ = ["SCENARIO", "add_arguments", "ground_truth", "panel", "recall_at", "run"]
