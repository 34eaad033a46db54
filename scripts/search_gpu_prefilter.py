"""The int8 prefilter's scan against the full fp16 scan, kernel alone, on one GPU.

For each size: the full scan's graph (``scan_topk`` over the fp16 rows) and the prefilter's
graph (``scan_topk`` over the int8 codes, exact re-rank in the last program) under several
launch shapes and numbers of rows kept (the int8 tensor-core dot; the FMA form,
``PREFILTER_FMA``, was slower at every size tried). Each row: CUDA-event p50/p99 of graph replays
with one query, its ratio to its own bandwidth floor (bytes it must read / measured copy
bandwidth), and over ``--check`` distinct queries how often the bound proved the result (no
fallback) and how often the ids differed from the full scan's (must be 0).

Usage (CUDA machine): ``python3 scripts/search_gpu_prefilter.py --out DIR [--sizes 1000000x128]
[--sets real-128:1000000 ...] [--keeps 32 64 128] [--grid] [--only default-dot ...]
[--tag -grid]``; writes ``search-gpu-prefilter-<GPU>[TAG].json`` (H200, H100). ``--sizes``
are random normal rows; ``--sets`` the benchmark corpora (kalos.bench.corpora: real text,
clustered), where some searches are not proven. ``--keeps``: variants that keep that many
rows for the exact re-rank; each variant's ``graph_p50_us`` / ``graph_p99_us`` are the
sidecar's whole path (``replay_and_wait``: the proof's check and an unproven search's
settle), host clocks, one distinct query each. It measured where the prefilter pays (the
prefilter's row threshold; docs/PERFORMANCE.md).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import time
from typing import Any

import numpy as np
import torch

from kalos.bench import corpora
from kalos.bench.search_gpu import _copy_bandwidth, _event_times
from kalos.index.cuda_flat import CudaFlatIndex
from kalos.index.kernels import codes4
from kalos.index.kernels import scan_topk as kern


def _times(fn: Any, reps: int) -> np.ndarray:
    """µs per call of ``fn`` by CUDA events, after 20 untimed calls."""
    _event_times(torch, fn, 20)
    return _event_times(torch, fn, reps) / 1e3


def _row(name: str, t: np.ndarray, floor: float, **extra: Any) -> dict[str, Any]:
    p50, p99 = (float(v) for v in np.percentile(t, [50, 99]))
    return {"variant": name, "p50_us": round(p50, 2), "p99_us": round(p99, 2),
            "floor_us": round(floor, 2), "over_floor": round(p50 / floor, 3), **extra}  # fmt: skip


def run_size(
    n: int, dim: int, k: int, bw: float, checks: int, reps: int, grid: bool = False,
    only: list[str] | None = None, corpus: corpora.Corpus | None = None,
    keeps: list[int] | None = None, scan: str = "int8",
) -> dict[str, Any]:  # fmt: skip
    gen = torch.Generator(device="cuda").manual_seed(n + dim)
    idx = CudaFlatIndex.from_spec(f"cuda:flat,fp16,scan={scan}", dim=dim, metric="ip")
    idx.reserve(n)
    if corpus is None:
        rows_ = torch.randn((n, dim), generator=gen, device="cuda").half()
        qs = torch.randn((checks, dim), generator=gen, device="cuda")
    else:
        rows_ = torch.from_numpy(corpus.db).cuda().half()
        qs = torch.from_numpy(corpus.queries[:checks]).cuda()
    idx.add(rows_, torch.arange(n).cuda())
    del rows_
    stream = torch.cuda.current_stream()
    idx.prefilter_min_rows = 0  # the prefilter at every size here
    full = idx.graph(1, k)
    full.query.copy_(qs[:1])
    rows = [_row("full-fp16", _times(full.replay, reps), n * dim * 2 / bw * 1e6)]
    want = []
    for i in range(checks):
        full.query.copy_(qs[i : i + 1])
        full.replay()
        want.append(full.ids.clone())
    want_ids = torch.cat(want).cpu().numpy()

    # the default (lists of kernels.prefilter_lists, 4 warps) against other lists and 8
    # warps; the launch-shape grid at 1M x 128 was swept with --grid (docs/PERFORMANCE.md)
    base = kern.choose_prefilter_config(dim, True)
    w8 = kern.ScanConfig(block_n=base.block_n, num_warps=8, num_stages=base.num_stages,
                         use_dot=True, programs_per_sm=base.programs_per_sm)  # fmt: skip
    keep = kern.prefilter_candidates(k)
    variants: list[tuple[str, int, Any, int | None, int | None]] = [
        ("default-dot", kern.PREFILTER_DOT, None, None, None),
        ("default-dot-w8", kern.PREFILTER_DOT, w8, None, None),
        ("dot-lists4", kern.PREFILTER_DOT, None, None, 4),
        ("dot-lists16", kern.PREFILTER_DOT, None, None, 16),
        (f"dot-lists{keep}", kern.PREFILTER_DOT, None, None, keep),
        (f"dot-lists{keep}-w8", kern.PREFILTER_DOT, w8, None, keep),
    ]
    for kept in keeps or ():  # rows kept for the exact re-rank, lists as the default's
        variants.append((f"keep{kept}", kern.PREFILTER_DOT, None, kept, None))
    if scan == "4bit":  # the cascade: its bounds pass's launch shapes around its default
        base4 = codes4.choose_config(dim, True)
        variants = [("default-dot", kern.PREFILTER_DOT, None, None, None)]
        for pps, bn, stages in itertools.product((2, 4, 8), (128, 256), (1, 2)) if grid else ():
            cfg = kern.ScanConfig(**{**{a: getattr(base4, a) for a in kern.ScanConfig.__slots__},
                                     "block_n": bn, "num_stages": stages,
                                     "programs_per_sm": pps})  # fmt: skip
            variants.append((f"pps{pps}-st{stages}-bn{bn}", kern.PREFILTER_DOT, cfg, None, None))
    elif grid:  # launch shapes around the default (4 warps, its lists)
        for pps in (1, 2, 3, 4):
            for stages in (2, 3, 4):
                for bn in (128, 256, 512):
                    cfg = kern.ScanConfig(block_n=bn, num_warps=4, num_stages=stages,
                                          use_dot=True, programs_per_sm=pps)  # fmt: skip
                    variants.append((f"pps{pps}-st{stages}-bn{bn}", kern.PREFILTER_DOT, cfg,
                                     None, None))  # fmt: skip
    if only:
        variants = [v for v in variants if v[0] in only]
    for name, mode, cfg, keep, lists in variants:
        idx.prefilter_mode = mode
        idx.prefilter_config = cfg
        idx.prefilter_keep = keep
        idx.prefilter_lists = lists
        try:  # a shape Triton cannot build (it compiles at capture): say so, go on
            g = idx.graph(1, k, prefilter=True)
            g.query.copy_(qs[:1])
            graph = g.prefilter_cuda_graph()
        except Exception as exc:
            rows.append({"variant": name, "error": repr(exc)[:300]})
            continue
        t = _times(graph.replay, reps)
        got = []
        host = np.zeros(checks)
        for i in range(checks):
            g.query.copy_(qs[i : i + 1])
            t0 = time.perf_counter()
            g.replay_and_wait(stream)
            host[i] = time.perf_counter() - t0
            got.append(g.ids.clone())
        got_ids = torch.cat(got).cpu().numpy()
        graph_p50, graph_p99 = (round(float(v) * 1e6, 2) for v in np.percentile(host, [50, 99]))
        differ = int((np.sort(got_ids, 1) != np.sort(want_ids, 1)).any(1).sum())
        meta_bytes = 8 if mode == kern.PREFILTER_FMA else 12
        row_bytes = codes4.padded_dim(dim) // 2 + 8 if scan == "4bit" else dim + meta_bytes
        floor = n * row_bytes / bw * 1e6
        cfg_used = g._ws[1]["cfg"]
        rows.append(_row(name, t, floor, fallbacks=g.fallbacks, checks=checks,
                         graph_p50_us=graph_p50, graph_p99_us=graph_p99,
                         differ_from_full=differ, config=repr(cfg_used), keep=idx._keep(k),
                         programs=g._ws[1]["programs"],
                         surv=g._ws[1]["state"][2].shape[1],
                         lists=g._ws[1]["cand"].shape[2]))  # fmt: skip
        print(rows[-1], flush=True)
    idx.prefilter_config = None
    idx.prefilter_keep = None
    idx.prefilter_lists = None
    idx.prefilter_mode = kern.PREFILTER_DOT
    print(rows[0], flush=True)
    # one row per variant and size, each naming its system (the results shape)
    where = {"corpus": corpus.name if corpus is not None else "normal"}
    return [{"system": r["variant"], "n": n, "dim": dim, "k": k, **where, **r} for r in rows]


def main() -> int:
    ap = argparse.ArgumentParser()
    sizes = ["1000000x128", "10000000x128", "300000x128", "1000000x256", "1000000x64"]
    ap.add_argument(
        "--sizes",
        nargs="*",
        default=None,
        help=f"random normal rows, NxDIM (default, without --sets: {sizes})",
    )
    ap.add_argument(
        "--sets",
        nargs="*",
        default=[],
        type=corpora.parse_set,
        help="benchmark corpora, CORPUS:N[xDIM] (kalos.bench.corpora)",
    )
    ap.add_argument(
        "--keeps",
        nargs="*",
        type=int,
        default=[],
        help="variants keeping this many rows for the exact re-rank",
    )
    ap.add_argument(
        "--scan",
        choices=("int8", "4bit"),
        default="int8",
        help="the codes scanned first: the int8 prefilter, or the 4-bit cascade "
        "(its variants: the default, and with --grid its bounds pass's shapes)",
    )
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--checks", type=int, default=200)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--grid", action="store_true", help="also launch shapes around the default")
    ap.add_argument("--only", nargs="*", default=None, help="run only these variants")
    ap.add_argument("--tag", default="", help="appended to the JSON's name")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    bw = _copy_bandwidth(torch)
    gpu = torch.cuda.get_device_name()
    machine = next((m for m in ("H200", "H100") if m in gpu), "gpu")
    out: dict[str, Any] = {"scenario": "search-gpu-prefilter", "machine": machine,
                           "date": datetime.date.today().isoformat(),
                           "gpu": torch.cuda.get_device_name(),
                           "copy_bandwidth_TBps": round(bw / 1e12, 3), "rows": []}  # fmt: skip
    work: list[tuple[str | None, int, int | None]] = []
    for size in args.sizes if args.sizes is not None else ([] if args.sets else sizes):
        n, dim = (int(v) for v in size.split("x"))
        work.append((None, n, dim))
    for name, n, dim in work + list(args.sets):
        corpus = None
        if name is not None:  # a benchmark corpus: its own dim
            corpus = corpora.load(name, n, dim, queries=args.checks)
            dim = corpus.dim
        assert dim is not None
        out["rows"] += run_size(n, dim, args.k, bw, args.checks, args.reps, args.grid, args.only,
                                corpus, args.keeps, args.scan)  # fmt: skip
        del corpus
        torch.cuda.empty_cache()
        if args.out:
            path = os.path.join(args.out, f"search-gpu-prefilter-{machine}{args.tag}.json")
            with open(path, "w") as f:
                json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
