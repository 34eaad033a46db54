"""search-shards: what sharding costs: ``index.search`` of one index beside the same rows in N
shards on one device, interleaved, every answer checked against the exact top-k.

It builds the corpus (``--corpus``, default ``clustered``; :mod:`kalos.bench.corpora`), one
index of ``--index`` (default ``cuda:flat,fp16`` with ``--device cuda``, ``cpu:flat`` with
``--device cpu``) and one of ``--index,shards=N``, both over the same rows (ids
``row * 3 + 1``), and nothing else: no sidecar, no kernel warm-up beyond the searches' own
(the kernels compile on first use, in 20 untimed searches of each). Then ``--queries``
held-out queries, batch 1, top ``--k``, each through both indexes in turn (which goes first
alternates), timed with host clocks around ``index.search``: the checks, the launches, the
merge and the copy to the host.

Rows ``index-search`` and ``index-search-shards-N``; ``summary``: ``p50_ratio`` and
``p99_ratio`` (sharded over one index), ``wrong_results`` (answers of either index that are not
an exact top-k of all rows; exact ties at the stored precision, fp16 on a GPU, may come in any
order), ``identical_answers`` (queries where both returned the same ids in the same order),
``target_ratio`` (1.10: the merge may cost at most 10% over one index) and ``met``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from kalos.bench import corpora
from kalos.bench.common import print_table, summarize, write_result

SCENARIO = "search-shards"
TARGET_RATIO = 1.10
WARM_SEARCHES = 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--corpus", choices=corpora.NAMES, default="clustered")
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--shards", type=int, default=2, help="shards of the sharded index")
    p.add_argument("--queries", type=int, default=2000,
                   help="timed searches per index (the corpus's held-out queries)")  # fmt: skip
    p.add_argument("--device", default="cuda",
                   help="cuda[:N] (a GPU) or cpu: the default --index's device")  # fmt: skip
    p.add_argument("--index", default=None,
                   help="the one index's spec (default cuda:flat,fp16 on --device cuda, "
                        "cpu:flat on cpu); the sharded one is SPEC,shards=N")  # fmt: skip
    p.add_argument("--seed", type=int, default=corpora.SEED, help="the corpus's seed")
    p.add_argument("--corpus-dir", default=None,
                   help="the corpora's cache (default $KALOS_CORPUS_DIR or "
                        "~/.cache/kalos/corpora)")  # fmt: skip


def default_spec(device: str) -> str:
    """``cpu:flat`` for ``cpu``; ``cuda:flat,fp16`` for ``cuda``, ``cuda:N:flat,fp16`` for
    ``cuda:N``."""
    if device == "cpu":
        return "cpu:flat"
    head, _, index = device.partition(":")
    if head != "cuda" or (index and not index.isdigit()):
        raise SystemExit(f"--device is cpu, cuda or cuda:N, not {device!r}")
    return f"cuda:{index}:flat,fp16" if index else "cuda:flat,fp16"


def build(spec: str, shards: int, db: np.ndarray, ids: np.ndarray) -> tuple[Any, Any]:
    """One index of ``spec`` and one of ``spec,shards=N``, each holding every row of ``db``
    [n, dim] under ``ids`` [n]."""
    from kalos.index import create

    dim = db.shape[1]
    single = create(spec, dim=dim, metric="ip")
    sharded = create(f"{spec},shards={shards}", dim=dim, metric="ip")
    step = 1 << 18  # rows a batch: a bounded host copy each
    for lo in range(0, db.shape[0], step):
        single.add(db[lo : lo + step], ids[lo : lo + step])
        sharded.add(db[lo : lo + step], ids[lo : lo + step])
    return single, sharded


def devices_of(index: Any) -> int:
    """How many distinct CUDA devices hold the shards of ``index`` (0: none, the CPU)."""
    devices = {getattr(c, "device", None) for c in index.children}
    return len({str(d) for d in devices if d is not None and d.type == "cuda"})


def stored(db: np.ndarray, index: Any) -> tuple[np.ndarray, float]:
    """The rows as ``index`` holds them (rounded to its storage dtype: a cuda index's
    ``dtype``) and the relative precision of a score over them: (rows [n, dim] float32,
    2^-10 for fp16, 2^-7 for bf16 (the rounding, doubled), 1e-5 for float32 sums)."""
    dtype = getattr(index, "dtype", "fp32")
    if dtype == "fp16":
        return db.astype(np.float16).astype(np.float32), 2.0**-10
    if dtype == "bf16":
        import torch

        return torch.from_numpy(db).to(torch.bfloat16).float().numpy(), 2.0**-7
    return db, 1e-5


def exact_topk(db: np.ndarray, queries: np.ndarray, k: int, on_gpu: bool) -> np.ndarray:
    """The exact top-k rows [nq, k] (descending inner product, float32 sums) of ``queries``
    [nq, dim] over ``db`` [n, dim]: on the GPU with torch when ``on_gpu``, else numpy."""
    kk = min(k, db.shape[0])
    chunk = max(1, (256 << 20) // (4 * db.shape[0]))  # a [chunk, n] fp32 score block
    if on_gpu:
        import torch

        db_t = torch.from_numpy(db).cuda()
        out = [
            torch.topk(torch.from_numpy(queries[lo : lo + chunk]).cuda() @ db_t.T, kk).indices
            for lo in range(0, len(queries), chunk)
        ]
        rows = torch.cat(out).cpu().numpy()
        del db_t
        torch.cuda.empty_cache()
        return rows
    parts = []
    for lo in range(0, len(queries), chunk):
        scores = queries[lo : lo + chunk] @ db.T  # [chunk, n]
        top = np.argpartition(-scores, kk - 1, axis=1)[:, :kk]
        order = np.argsort(-np.take_along_axis(scores, top, axis=1), axis=1, kind="stable")
        parts.append(np.take_along_axis(top, order, axis=1))
    return np.concatenate(parts)


def is_exact(
    db: np.ndarray, q: np.ndarray, got: np.ndarray, want_rows: np.ndarray, tol: float
) -> bool:
    """Whether ``got`` (ids ``row * 3 + 1``, -1 padded) is an exact top-k: the reference's
    rows ``want_rows``, or as many distinct rows that all score at least its k-th less
    ``tol`` (exact ties at the stored precision come back in any order)."""
    got = got[got >= 0]
    mine = (got - 1) // 3
    if set(mine.tolist()) == set(want_rows.tolist()):
        return True
    if len(set(mine.tolist())) != len(want_rows) or not np.array_equal(mine * 3 + 1, got):
        return False
    if mine.min() < 0 or mine.max() >= db.shape[0]:
        return False
    q64 = q.astype(np.float64)
    kth = float((db[want_rows].astype(np.float64) @ q64).min())
    return bool((db[mine].astype(np.float64) @ q64 >= kth - tol).all())


def measure(
    single: Any,
    sharded: Any,
    db: np.ndarray,
    queries: np.ndarray,
    k: int,
    want: np.ndarray,
    tol: np.ndarray,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Each of ``queries`` [nq, dim] through both indexes in turn (the first alternating),
    host clocks around ``index.search``; every answer checked (:func:`is_exact` against
    ``want`` [nq, k] with ``tol`` [nq]). Returns the two rows and the summary."""
    for index in (single, sharded):  # compiles the kernels (lazy JIT), untimed
        for i in range(min(WARM_SEARCHES, len(queries))):
            index.search(queries[i], k)
    nq = len(queries)
    t_one = np.empty(nq, np.int64)
    t_many = np.empty(nq, np.int64)
    answers_one = np.empty((nq, k), np.int64)
    answers_many = np.empty((nq, k), np.int64)
    clock = time.perf_counter_ns
    systems = ((single, answers_one, t_one), (sharded, answers_many, t_many))
    for i in range(nq):
        # alternate which goes first, so neither always finds the other's caches warm
        for index, answers, times in systems if i % 2 == 0 else systems[::-1]:
            t0 = clock()
            _, answers[i] = index.search(queries[i], k)
            times[i] = clock() - t0
    wrong = 0
    for i in range(nq):
        for got in (answers_one[i], answers_many[i]):
            wrong += int(not is_exact(db, queries[i], got, want[i], float(tol[i])))
    shards = sharded.shards
    one = summarize("index-search", t_one)
    many = summarize(f"index-search-shards-{shards}", t_many)
    p50_ratio = round(many["p50_us"] / one["p50_us"], 3)
    summary = {
        "p50_ratio": p50_ratio,
        "p99_ratio": round(many["p99_us"] / one["p99_us"], 3),
        "wrong_results": wrong,
        "identical_answers": int((answers_one == answers_many).all(axis=1).sum()),
        "target_ratio": TARGET_RATIO,
        "met": bool(p50_ratio <= TARGET_RATIO and wrong == 0),
    }
    return [one, many], summary


def run(args: argparse.Namespace) -> int:
    if args.shards < 2:
        raise SystemExit("--shards takes N >= 2")
    spec = args.index or default_spec(args.device)
    corpus = corpora.load(args.corpus, args.n, args.dim, queries=args.queries, seed=args.seed,
                          cache_dir=args.corpus_dir, progress=not args.quiet)  # fmt: skip
    db, queries = corpus.db, corpus.queries
    n, dim = corpus.n, corpus.dim
    ids = np.arange(n, dtype=np.int64) * 3 + 1
    t0 = time.perf_counter()
    single, sharded = build(spec, args.shards, db, ids)
    build_s = time.perf_counter() - t0
    gpus = devices_of(sharded)
    held, precision = stored(db, single)  # a tie: scores within the stored precision
    want = exact_topk(held, queries, args.k, on_gpu=gpus > 0)
    max_norm = float(np.linalg.norm(held, axis=1).max())
    tol = precision * np.linalg.norm(queries, axis=1) * max_norm
    rows, summary = measure(single, sharded, held, queries, args.k, want, tol)
    print_table(rows)
    print(summary)
    params = {
        "corpus": corpus.name,
        "n": n,
        "dim": dim,
        "k": args.k,
        "shards": args.shards,
        "gpus": gpus,
        "queries": len(queries),
        "index": spec,
        "batch": 1,
        "build_s": round(build_s, 2),
        "corpus_info": corpus.info,
    }
    extra: dict[str, Any] = {
        "summary": summary,
        "checks": {"wrong_results": summary["wrong_results"]},
    }
    if gpus:
        import torch

        extra["gpu"] = torch.cuda.get_device_name()
    path = write_result(SCENARIO, args.machine, params, rows, args.out, **extra)
    print(f"wrote {path}")
    return 1 if summary["wrong_results"] else 0
