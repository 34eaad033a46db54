"""Where the fused scan's time goes, read from the GPU's own clock (``scan_topk``'s trace).

For each size, the int8 prefilter's scan (and, with ``--full``, the full fp16 scan) is launched
with a trace (``CudaFlatIndex.trace``): every program stamps its start, the end of its scan and
its end with PTX ``%globaltimer`` and counts the tiles it walked and merged; the fused last
program stamps its selection, re-rank and write. Over ``--runs`` distinct queries this reports
the medians of:

- ``span``: first program's start to last program's end (the kernel, less its launch);
- ``start_spread``: first to last program start (how long the grid takes to start);
- ``scan``: a program's scan (median and slowest program), and ``scan_end``: first start to
  the last scan's end;
- ``select``, ``rerank``, ``write``, ``tail``: the last program's phases after its own scan
  (``tail``: its scan's end to its end, all of them);
- tiles walked and merged per program (merged: sorted into its list; the rest were skipped
  by the bound), and over every program of every run: the merges' percentiles, how closely a
  program's scan time follows its merges, and the programs that merged most with their
  multiprocessors;

beside the CUDA-event time of the same launch (eager) and of the index's graph (no trace), and
every variant's ids against the first's; ``--replicas 1 16`` repeats it all for each number
of copies of the scan's bounds (``ScanConfig.bound_replicas``; the tuned shapes otherwise, and
with it the index's own choices of shape, overridden: below ~270K rows that also lifts the cap
on programs).

``--cascade CORPUS`` traces the 4-bit cascade's exact pass instead (the fused scan over the
rows its bounds left open, ``kernels.codes4``), on a corpus of :mod:`kalos.bench.corpora`
(``clustered``, ``real-384``, ...) at each size: the same phases (its ``tail``: the last
program's merge, write and publish), how many rows each search listed and how many programs
had a tile of them, beside the CUDA-event time of the whole cascade (eager, and its graph);
``--exact-programs 0 132 66`` repeats it for each grid of the exact pass
(``CudaFlatIndex.exact4_programs``; 0: the full scan's), and ``--exact-skip 1 0`` with and
without its skip of tiles below the bound (``ScanConfig.skip``), every variant's ids against
the first's.

Usage (CUDA machine): ``python3 scripts/search_gpu_phases.py --out DIR [--sizes 1000000x128]
[--full] [--replicas 1 16] [--cascade clustered] [--dump PREFIX] [--suffix full]``; writes
``search-gpu-phases-<GPU>[-SUFFIX].json`` (``kalos.bench.common.write_result``).
"""

from __future__ import annotations

import argparse
import functools
import itertools
from typing import Any

import numpy as np
import torch

from kalos.bench.common import write_result
from kalos.bench.search_gpu import _event_times
from kalos.index.cuda_flat import CudaFlatIndex
from kalos.index.kernels import scan_topk as kern


def _median(v: Any) -> float:
    return round(float(np.median(v)), 2)


def _phases(traces: list[np.ndarray], p: int) -> dict[str, Any]:
    """Medians over runs of each phase, µs (the trace's clocks are ns)."""
    cols: dict[str, list[float]] = {}

    def put(name: str, value: float) -> None:
        cols.setdefault(name, []).append(value)

    for t in traces:
        prog, last = t[:p], t[p]
        t0 = prog[:, 0].min()
        scan = (prog[:, 1] - prog[:, 0]) / 1e3
        lp = prog[int(last[3])]
        put("span_us", (prog[:, 4].max() - t0) / 1e3)
        put("start_spread_us", (prog[:, 0].max() - t0) / 1e3)
        put("scan_median_us", float(np.median(scan)))
        put("scan_slowest_us", float(scan.max()))
        put("scan_end_us", (prog[:, 1].max() - t0) / 1e3)
        put("last_starts_tail_us", (lp[1] - t0) / 1e3)
        put("tail_us", (lp[4] - lp[1]) / 1e3)
        if last[0] > 0:  # the prefilter's phases
            put("select_us", (last[0] - lp[1]) / 1e3)
            put("select_compact_us", (last[5] - lp[1]) / 1e3)
            put("select_sort_us", (last[6] - last[5]) / 1e3)
            put("survivors", float(last[4]))
            put("rerank_us", (last[1] - last[0]) / 1e3)
            put("write_us", (last[2] - last[1]) / 1e3)
            put("publish_reset_us", (lp[4] - last[2]) / 1e3)
        put("walked_mean", float(prog[:, 3].mean()))
        put("merged_mean", float(prog[:, 2].mean()))
        put("merged_max", float(prog[:, 2].max()))
        put("programs_per_sm_max", float(np.bincount(prog[:, 5]).max()))
    out = {name: _median(v) for name, v in cols.items()}
    prog = np.concatenate([t[:p] for t in traces])
    merged = prog[:, 2]
    out["merged_percentiles"] = [int(v) for v in np.percentile(merged, [10, 50, 90, 99, 100])]
    # how far a program's scan follows its merges (the slowest program is the one that merged
    # most), and which programs merged most: the same ones run after run, and with
    # them their multiprocessors (both programs of a stale one)
    scan = (prog[:, 1] - prog[:, 0]).astype(np.float64)
    corr = float(np.corrcoef(scan, merged)[0, 1]) if merged.std() * scan.std() > 0 else np.nan
    out["scan_merged_corr"] = round(corr, 3) if np.isfinite(corr) else None
    heavy = np.concatenate([np.nonzero(t[:p, 2] >= np.percentile(t[:p, 2], 95))[0] for t in traces])
    top = np.bincount(heavy, minlength=p).argsort()[::-1][:12]
    out["heavy_pids_top"] = top.tolist()
    out["heavy_pids_sm"] = traces[0][top, 5].tolist()
    return out


def _variant(
    idx: Any, qs: Any, k: int, prefilter: bool, dump: str | None
) -> tuple[dict[str, Any], np.ndarray]:
    """One scan (the prefilter's or the full one): its traced runs over the queries ``qs``
    and its CUDA-event times; returns its row and the ids it found."""
    n, dim = len(idx), idx.dim
    ws = idx._workspace(1, k, private=True, prefilter=prefilter)
    p = ws["programs"]
    status = torch.zeros(1, dtype=torch.int32, device="cuda")
    scores = torch.empty((1, k), dtype=torch.float32, device="cuda")
    ids = torch.empty((1, k), dtype=torch.int64, device="cuda")
    q = torch.empty((1, dim), dtype=torch.float32, device="cuda")
    q.copy_(qs[:1])
    st = status if prefilter else None
    launch = functools.partial(idx._launch, q, k, idx._no_filter, False, scores, ids, ws, st)
    _event_times(torch, launch, 20)
    eager = _event_times(torch, launch, 200) / 1e3
    idx.trace = torch.zeros((p + 1, 8), dtype=torch.int64, device="cuda")
    traces, found = [], []
    unproven = 0
    for i in range(len(qs)):
        q.copy_(qs[i : i + 1])
        launch()
        torch.cuda.synchronize()
        traces.append(idx.trace.cpu().numpy().copy())
        found.append(ids.cpu().numpy()[0])
        unproven += prefilter and int(status[0]) != 1
    idx.trace = None
    if dump:
        name = f"trace-{n}x{dim}-{'pre' if prefilter else 'full'}"
        np.save(dump + "-" + name + ".npy", np.stack(traces))
    g = idx.graph(1, k, prefilter=prefilter)
    g.query.copy_(qs[:1])
    graph = g.prefilter_cuda_graph() if prefilter else g.cuda_graph
    _event_times(torch, graph.replay, 20)
    replay = _event_times(torch, graph.replay, 200) / 1e3
    row = {
        "system": "kalos-kernel-prefilter" if prefilter else "kalos-kernel",
        "n": n, "dim": dim, "k": k, "scan": "int8 prefilter" if prefilter else "full fp16",
        "config": repr(ws["cfg"]), "programs": p,
        "block_n": max(ws["cfg"].block_n, ws["cand"].shape[2]), "lists": ws["cand"].shape[2],
        "runs": len(qs), "unproven": unproven,
        "eager_event_p50_us": _median(eager), "graph_event_p50_us": _median(replay),
        **_phases(traces, p),
    }  # fmt: skip
    return row, np.sort(np.stack(found), axis=1)


def run_cascade(corpus_name: str, n: int, dim: int, k: int, runs: int, dump: str | None,
                exact_programs: list[int], exact_skip: list[int]
                ) -> list[dict[str, Any]]:  # fmt: skip
    """The 4-bit cascade's exact pass, traced over ``runs`` held-out queries of the corpus,
    on each grid of ``exact_programs`` (0: the full scan's), with and without the skip of
    tiles below the bound (``exact_skip``: 1, 0) in turn."""
    from kalos.bench import corpora

    # 2,000 held-out queries, as search-gpu loads them (a real corpus's cache is built for
    # its rows and queries together), of which the first ``runs``
    corpus = corpora.load(corpus_name, n, dim, queries=max(runs, 2000), progress=False)
    n, dim = corpus.n, corpus.dim
    idx = CudaFlatIndex.from_spec("cuda:flat,fp16,scan=4bit", dim=dim, metric="ip")
    idx.reserve(n)
    db = torch.empty((n, dim), dtype=torch.float16, device="cuda")
    step = 1 << 20
    for lo in range(0, n, step):
        db[lo : lo + step] = torch.from_numpy(corpus.db[lo : lo + step]).cuda()
    idx.add(db, torch.arange(n, device="cuda"))
    del db
    qs = torch.from_numpy(corpus.queries[:runs]).cuda()
    idx.prefilter_min_rows = 0
    rows = []
    want = None
    tuned = kern.choose_config(dim, 2, 1, k, True)  # the exact pass's (a single query's)
    # the first variant once unrecorded: measured first, it read 10-19 us slower than the
    # same grid did in search-gpu (search-gpu-phases-H100.json's note)
    idx.exact4_programs = exact_programs[0]
    idx.scan_config = None if exact_skip[0] else tuned.replace(skip=False)
    _cascade_variant(idx, qs, k, corpus_name, None)
    for programs, skip in itertools.product(exact_programs, exact_skip):
        idx.exact4_programs = programs
        # the exact pass's launch shape (the bounds pass keeps its own: codes4.choose_config)
        idx.scan_config = None if skip else tuned.replace(skip=False)
        row, found = _cascade_variant(idx, qs, k, corpus_name, dump)
        row["exact_skip"] = bool(skip)
        want = found if want is None else want
        row["ids_differ_from_first"] = int((found != want).any(axis=1).sum())
        print(row, flush=True)
        rows.append(row)
    return rows


def _cascade_variant(idx: Any, qs: Any, k: int, corpus_name: str, dump: str | None
                     ) -> tuple[dict[str, Any], np.ndarray]:  # fmt: skip
    """One grid of the cascade's exact pass: its traced runs and the ids it found."""
    n, dim = len(idx), idx.dim
    ws = idx._workspace(1, k, private=True, prefilter=True)
    ex = ws["exact"]
    p = ex["programs"]
    scores = torch.empty((1, k), dtype=torch.float32, device="cuda")
    ids = torch.empty((1, k), dtype=torch.int64, device="cuda")
    q = torch.empty((1, dim), dtype=torch.float32, device="cuda")
    q.copy_(qs[:1])
    launch = functools.partial(idx._launch, q, k, idx._no_filter, False, scores, ids, ws)
    _event_times(torch, launch, 20)
    eager = _event_times(torch, launch, 200) / 1e3
    idx.trace = torch.zeros((p + 1, 8), dtype=torch.int64, device="cuda")
    traces, listed, found = [], [], []
    for i in range(len(qs)):
        q.copy_(qs[i : i + 1])
        launch()
        torch.cuda.synchronize()
        traces.append(idx.trace.cpu().numpy().copy())
        listed.append(int(ws["status"][1]))
        found.append(ids.cpu().numpy()[0])
    idx.trace = None
    if dump:
        name = f"{corpus_name}-{n}x{dim}-cascade-exact-p{p}"
        np.save(f"{dump}-trace-{name}.npy", np.stack(traces))
    with_tiles = [int((t[:p, 3] > 0).sum()) for t in traces]
    # the graph the sidecar replays, with this grid, timed whole (CUDA events)
    g = idx.graph(1, k, prefilter=True)
    g.query.copy_(qs[:1])
    graph = g.prefilter_cuda_graph()
    _event_times(torch, graph.replay, 20)
    replay = _event_times(torch, graph.replay, 200) / 1e3
    row = {
        "system": "kalos-kernel-cascade-exact", "corpus": corpus_name, "n": n, "dim": dim,
        "k": k, "scan": "4bit cascade, its exact pass", "config": repr(ex["cfg"]),
        "programs": p, "block_n": max(ex["cfg"].block_n, ex["cand"].shape[2]), "runs": len(qs),
        "listed_p50": int(np.median(listed)), "listed_max": int(max(listed)),
        "programs_with_tiles_p50": int(np.median(with_tiles)),
        "cascade_eager_event_p50_us": _median(eager),
        "cascade_graph_event_p50_us": _median(replay), **_phases(traces, p),
    }  # fmt: skip
    return row, np.sort(np.stack(found), axis=1)


def run_size(
    n: int, dim: int, k: int, runs: int, full: bool, dump: str | None, replicas: list[int] | None
) -> list[dict[str, Any]]:
    gen = torch.Generator(device="cuda").manual_seed(n + dim)
    idx = CudaFlatIndex(dim=dim, metric="ip", spec="cuda:flat,fp16")
    idx.reserve(n)
    idx.add(torch.randn((n, dim), generator=gen, device="cuda").half(), torch.arange(n).cuda())
    qs = torch.randn((runs, dim), generator=gen, device="cuda")
    idx.prefilter_min_rows = 0
    rows = []
    want = None
    for reps in replicas or [None]:
        if reps is not None:  # the tuned shapes with this many copies of the bounds
            pre = kern.choose_prefilter_config(dim, True, idx.prefilter_mode)
            idx.prefilter_config = pre.replace(bound_replicas=reps)
            fp16 = kern.choose_config(dim, 2, 1, k, True)
            idx.scan_config = fp16.replace(bound_replicas=reps)
        for prefilter in (True, False) if full else (True,):
            row, found = _variant(idx, qs, k, prefilter, dump and f"{dump}-r{reps}")
            row["bound_replicas"] = idx._workspace(1, k, private=True, prefilter=prefilter)[
                "replicas"
            ]
            # exact either way: every variant's ids are the first's
            want = found if want is None else want
            row["ids_differ_from_first"] = int((found != want).any(axis=1).sum())
            print(row, flush=True)
            rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", nargs="+", default=["1000000x128", "500000x128", "10000000x128"])
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--full", action="store_true", help="the full fp16 scan too")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--suffix", default=None)
    ap.add_argument("--dump", default=None, help="a path prefix for every run's raw trace")
    ap.add_argument("--cascade", default=None, metavar="CORPUS",
                    help="trace the 4-bit cascade's exact pass on this corpus instead")  # fmt: skip
    ap.add_argument("--exact-programs", nargs="+", type=int, default=[0],
                    help="--cascade: its exact pass's grids (0: the full scan's)")  # fmt: skip
    ap.add_argument("--exact-skip", nargs="+", type=int, choices=(0, 1), default=[1],
                    help="--cascade: its exact pass with (1) or without (0) the skip")  # fmt: skip
    ap.add_argument(
        "--replicas",
        nargs="+",
        type=int,
        default=None,
        help="copies of the scan's bounds (ScanConfig.bound_replicas), each in turn",
    )
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    for size in args.sizes:
        n, dim = (int(v) for v in size.split("x"))
        if args.cascade:
            rows += run_cascade(args.cascade, n, dim, args.k, args.runs, args.dump,
                                args.exact_programs, args.exact_skip)  # fmt: skip
        else:
            rows += run_size(n, dim, args.k, args.runs, args.full, args.dump, args.replicas)
        torch.cuda.empty_cache()
        gpu = torch.cuda.get_device_name()
        machine = "H200" if "H200" in gpu else "H100" if "H100" in gpu else "gpu"
        write_result("search-gpu-phases", machine, vars(args), rows, args.out, args.suffix)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
