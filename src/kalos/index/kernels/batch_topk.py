"""Exact top-k of a batch of queries in two passes: each tile's best score, then a second
look at the few tiles that can hold a result (``cuda:flat`` searches of several queries).

The fused scan (:mod:`kalos.index.kernels.scan_topk`) keeps a top-k list per program and
sorts a tile into it whenever the tile beats a query's bound. With one query that is rare;
with a batch, a tile beats *some* query's bound almost always, and the program then sorts
the whole [queries x rows] tile: simulated at 1M x 384 (``clustered``), 20% of the tiles are
sorted for one query, 66% for a batch of 8 and 99.6% for a batch of 64. Here instead:

``_tile_max_kernel``
    Persistent programs walk the row tiles as the scan does, score each tile for every query
    with one tensor-core dot, and store each query's largest score in it: ``tmax`` [nq,
    tiles] fp32 (-inf where no row passes the scope filter). No selection, no atomics: the
    pass runs at the speed of its loads.

The second pass: SPLIT programs a query, each on a slice of its tiles (a query whose best
scores tie across hundreds of tiles, as near-duplicate text lines do, would otherwise hold up
the batch while one program walks them).

``_slice_top_kernel``
    Each slice's KP largest tile maxima, as (score, tile) keys. The k-th largest tile maximum
    T_k is at most the query's k-th best score (the k largest maxima are scores of k distinct
    rows), so every row of the top-k lies in a tile whose maximum is at least T_k; T_k is the
    k-th largest of the union of the slices' lists.

``_rescore_kernel``
    Each slice's program finds T_k from those lists, lists its tiles at or above T_k minus
    the slack below, scores their rows again with the fp32 query and FMAs (as a single-query
    search does), and keeps its KP best.

``_merge_kernel``
    One program a query: the top-k of its slices' bests, written out.

The slack. The first pass's dot takes the query in the storage type (fp16: a relative error
of 2^-11 an element) and the passes accumulate in fp32 in different orders, so one row's
two scores differ by at most ``e |q| |x|``, with ``e`` = 2^-11 + 2 D 2^-24 at fp16. With X
the largest row norm the index has held (``sq_max``: |x|^2, raised by every add), a tile
holds a row of the exact top-k only if its maximum is at least T_k - 2 e |q| X (for l2,
whose score is 2 q.x - |x|^2, twice that plus the subtraction's rounding, ~2^-22 X^2).
:func:`slack` gives those factors with a further factor of 2 to spare. Rows whose scores
tie are all kept, so ties resolve as in the fused scan (the larger key: the later row).

All launchers take torch tensors on one device; under ``TRITON_INTERPRET=1`` they run on
CPU tensors (the tests).
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from kalos.index.kernels.precompile import launch
from kalos.index.kernels.scan_topk import (
    _KEY_NONE,
    METRIC_L2,
    ScanConfig,
    _dot_f32,
    _keys_from_scores,
    _load_queries,
    _merge_desc,
    _scope_mask,
    _scores_from_keys,
    _tile_scores,
    _topk_desc,
    _write_top,
    block_d,
    block_q,
    key_width,
    next_pow2,
)

CHUNK = 1024  # tile maxima a program reads at once in the second pass
SPLIT = 16  # programs a query in the second pass, each a slice of the query's tiles
# The smallest size bucket (next power of two of the batch) that takes the two passes by
# default (CudaFlatIndex.two_pass_min_batch; 0 there: never). On an H100 with real text
# embeddings (kalos bench search-batch, real-384 1M, search-batch-H100.json) 32 queries take
# 344 µs p50 / 459 p99 against 881 / 909 through the fused scan, 64 take 486 / 602 against
# 1,101 / 1,196; at 16 the fused scan's tail is shorter (p99 374 against 434).
MIN_BATCH = 32

_MAX_DYNAMIC = ("q_ptr", "nq", "cap", "TW", "stride_q")
_SLICE_DYNAMIC = ("TW",)
_RESCORE_DYNAMIC = ("q_ptr", "k", "cap", "TW", "stride_q", "gap_q", "gap_x")
_MERGE_DYNAMIC = ("q_ptr", "scores_ptr", "out_ids_ptr", "k", "stride_q", "stride_os",
                  "stride_oi")  # fmt: skip


@triton.jit(do_not_specialize=_MAX_DYNAMIC)
def _tile_max_kernel(
    db_ptr,  # db: [cap, D]
    sq_ptr,  # sqnorms: [cap] fp32
    scope_ptr,  # scopes: [3, cap] int64
    filt_ptr,  # filter: [3] int64
    q_ptr,  # q: [nq, D]
    n_ptr,  # n: [1] int32, the live rows
    tmax_ptr,  # tmax: [>= nq, TW] fp32 out: each query's best score in each tile < cdiv(n, BN)
    nq,
    cap,
    TW,
    stride_q,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BQS: tl.constexpr,
    METRIC: tl.constexpr,
    SCOPED: tl.constexpr,
    PREC: tl.constexpr,
    DOT_F32: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    n = tl.load(n_ptr)
    n_tiles = tl.cdiv(n, BLOCK_N)
    q = _load_queries(q_ptr, stride_q, nq, D, BLOCK_D, BLOCK_Q, METRIC)  # [BLOCK_Q, BLOCK_D]
    qT = tl.trans(q.to(db_ptr.dtype.element_ty))  # [BLOCK_D, BLOCK_Q] (dot operand)
    qs = tl.arange(0, BQS)
    out = tmax_ptr + qs.to(tl.int64) * TW
    for t in tl.range(pid, n_tiles, P, num_stages=NUM_STAGES):
        rows = t * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < n
        s = _tile_scores(
            db_ptr, sq_ptr, rows, rmask, qT, qT, D, BLOCK_D, BLOCK_Q, BQS, True, METRIC, PREC,
            DOT_F32,
        )  # fmt: skip
        if SCOPED:  # noqa: SIM108 - a constexpr branch
            valid = _scope_mask(scope_ptr, filt_ptr, rows, rmask, cap)
        else:
            valid = rmask
        s = tl.where(valid[None, :], s, float("-inf"))
        tl.store(out + t, tl.max(s, axis=1), mask=qs < nq)


@triton.jit
def _slice(n, sid, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
    # slice sid of SPLIT of the tiles of n rows: tiles [lo, hi)
    n_tiles = tl.cdiv(n, BLOCK_N)
    width = tl.cdiv(n_tiles, SPLIT)
    lo = sid * width
    return lo, tl.minimum(lo + width, n_tiles)


@triton.jit(do_not_specialize=_SLICE_DYNAMIC)
def _slice_top_kernel(
    n_ptr,  # n: [1] int32, the live rows
    tmax_ptr,  # tmax: [>= nq, TW] fp32, from _tile_max_kernel
    part_ptr,  # out: [nq, SPLIT, KP] int64, each slice's KP largest (maximum, tile) keys
    TW,
    BLOCK_N: tl.constexpr,
    KP: tl.constexpr,
    CHUNK: tl.constexpr,
    SPLIT: tl.constexpr,
):
    # program (query, slice): the largest tile maxima of its slice of the query's tiles; a
    # chunk none of which beats the slice's KP-th so far is not sorted (most of them)
    qid = tl.program_id(0)
    sid = tl.program_id(1)
    lo, hi = _slice(tl.load(n_ptr), sid, BLOCK_N, SPLIT)
    trow = tmax_ptr + qid.to(tl.int64) * TW
    tiles = tl.arange(0, CHUNK)
    top = tl.full([1, KP], _KEY_NONE, tl.int64)
    least = tl.min(top, axis=1)  # [1]: the KP-th largest so far
    for c0 in range(lo, hi, CHUNK):
        t = c0 + tiles
        m = tl.load(trow + t, mask=t < hi, other=float("-inf"))
        live = (t < hi) & (m != float("-inf"))
        keys = _keys_from_scores(m[None, :], t[None, :], live[None, :])
        if tl.max(tl.max(keys, axis=1) > least, axis=0):
            top = _merge_desc(top, _topk_desc(keys, KP))
            least = tl.min(top, axis=1)
    kk = tl.arange(0, KP)
    tl.store(part_ptr + (qid * SPLIT + sid).to(tl.int64) * KP + kk, tl.reshape(top, [KP]))


@triton.jit(do_not_specialize=_RESCORE_DYNAMIC)
def _rescore_kernel(
    db_ptr,  # db: [cap, D]
    sq_ptr,  # sqnorms: [cap] fp32
    sqmax_ptr,  # [1] fp32: the largest |x|^2 the index has held
    scope_ptr,  # scopes: [3, cap] int64
    filt_ptr,  # filter: [3] int64
    q_ptr,  # q: [nq, D]
    n_ptr,  # n: [1] int32
    tmax_ptr,  # tmax: [>= nq, TW] fp32, from _tile_max_kernel
    list_ptr,  # [>= nq, TW] int32 scratch: the query's candidate tiles, each slice its own
    part_ptr,  # [nq, SPLIT, KP] int64: the slices' largest tile maxima (_slice_top_kernel)
    best_ptr,  # out: [nq, SPLIT, KP] int64, each slice's best (score, row) keys
    k,
    cap,
    TW,
    stride_q,
    gap_q,  # the slack is gap_q |q| X + gap_x X^2 (slack())
    gap_x,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KP: tl.constexpr,
    CHUNK: tl.constexpr,
    SPLIT: tl.constexpr,
    METRIC: tl.constexpr,
    SCOPED: tl.constexpr,
):
    # program (query, slice): T_k from every slice's list, then the slice's candidate tiles
    # scored again with the fp32 query
    qid = tl.program_id(0)
    sid = tl.program_id(1)
    n = tl.load(n_ptr)
    lo, hi = _slice(n, sid, BLOCK_N, SPLIT)
    dc = tl.arange(0, BLOCK_D)
    qv = tl.load(q_ptr + qid.to(tl.int64) * stride_q + dc, mask=dc < D, other=0.0).to(tl.float32)
    qn = tl.sqrt(tl.sum(qv * qv, axis=0))
    if METRIC == 1:  # unit queries, as _load_queries makes them
        qv = qv / tl.where(qn > 0, qn, 1.0)
        qn = tl.where(qn > 0, 1.0, 0.0)
    # T_k: the k-th largest tile maximum, among the union of the slices' KP largest
    kk = tl.arange(0, KP)[None, :]
    parts = tl.load(part_ptr + qid.to(tl.int64) * (SPLIT * KP) + tl.arange(0, SPLIT * KP))
    top = _topk_desc(tl.reshape(parts, [1, SPLIT * KP]), KP)
    kth = tl.max(tl.max(tl.where(kk == k - 1, top, _KEY_NONE), axis=1), axis=0)
    kth_s, _ = _scores_from_keys(kth)
    sx = tl.load(sqmax_ptr)
    gap = gap_q * qn * tl.sqrt(sx) + gap_x * sx
    # fewer than k tiles with a row: every such tile is a candidate
    floor = tl.where(kth != _KEY_NONE, kth_s - gap, float("-inf"))
    # the slice's candidate tiles, compacted into its part of the list by a prefix sum
    tiles = tl.arange(0, CHUNK)
    trow = tmax_ptr + qid.to(tl.int64) * TW
    lrow = list_ptr + qid.to(tl.int64) * TW + lo
    count = 0
    for c0 in range(lo, hi, CHUNK):
        t = c0 + tiles
        m = tl.load(trow + t, mask=t < hi, other=float("-inf"))
        live = ((t < hi) & (m != float("-inf")) & (m >= floor)).to(tl.int32)
        pos = count + tl.cumsum(live, axis=0) - 1
        tl.store(lrow + pos, t, mask=live != 0)
        count += tl.sum(live, axis=0)
    tl.debug_barrier()  # the list's stores, read below by other threads of this program
    run = tl.full([1, KP], _KEY_NONE, tl.int64)
    for j in range(0, count):
        t = tl.load(lrow + j)
        rows = t * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < n
        s = _tile_scores(
            db_ptr, sq_ptr, rows, rmask, qv, qv, D, BLOCK_D, 16, 1, False, METRIC, "ieee", False
        )  # [1, BLOCK_N]
        if SCOPED:  # noqa: SIM108 - a constexpr branch
            valid = _scope_mask(scope_ptr, filt_ptr, rows, rmask, cap)
        else:
            valid = rmask
        run = _merge_desc(run, _topk_desc(_keys_from_scores(s, rows[None, :], valid[None, :]), KP))
    tl.store(best_ptr + (qid * SPLIT + sid).to(tl.int64) * KP + tl.arange(0, KP),
             tl.reshape(run, [KP]))  # fmt: skip


@triton.jit(do_not_specialize=_MERGE_DYNAMIC)
def _merge_kernel(
    best_ptr,  # [nq, SPLIT, KP] int64: each slice's best keys (_rescore_kernel)
    ids_ptr,  # ids: [cap] int64, row -> id
    q_ptr,  # q: [nq, D] (|q|^2 for l2)
    scores_ptr,  # out scores: [nq, k] fp32, row stride stride_os
    out_ids_ptr,  # out ids: [nq, k] int64, row stride stride_oi
    k,
    stride_q,
    stride_os,
    stride_oi,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KP: tl.constexpr,
    SPLIT: tl.constexpr,
    METRIC: tl.constexpr,
):
    write_merged(
        tl.program_id(0), best_ptr, ids_ptr, q_ptr, scores_ptr, out_ids_ptr, k, stride_q,
        stride_os, stride_oi, D, BLOCK_D, KP, SPLIT, METRIC,
    )  # fmt: skip


@triton.jit
def write_merged(
    qid, best_ptr, ids_ptr, q_ptr, scores_ptr, out_ids_ptr, k, stride_q, stride_os, stride_oi,
    D: tl.constexpr, BLOCK_D: tl.constexpr, KP: tl.constexpr, SPLIT: tl.constexpr,
    METRIC: tl.constexpr,
):  # fmt: skip
    # query qid's top-k of its SPLIT programs' best keys (best: [nq, SPLIT, KP] int64),
    # written out as _write_top does (also kernels.codes4_batch's finish)
    keys = tl.load(best_ptr + qid.to(tl.int64) * (SPLIT * KP) + tl.arange(0, SPLIT * KP))
    top = _topk_desc(tl.reshape(keys, [1, SPLIT * KP]), KP)
    _write_top(
        qid, tl.reshape(top, [KP]), ids_ptr, q_ptr, scores_ptr, out_ids_ptr, k, stride_q,
        stride_os, stride_oi, D, BLOCK_D, KP, METRIC,
    )  # fmt: skip


def slack(dim: int, dtype: Any, metric: int) -> tuple[float, float]:
    """(gap_q, gap_x): the second pass lists every tile whose maximum is at least T_k -
    (gap_q |q| X + gap_x X^2) (module doc), for rows stored as ``dtype`` (a torch dtype)."""
    rounding = {"torch.float16": 2.0**-11, "torch.bfloat16": 2.0**-8}.get(str(dtype), 0.0)
    e = 2 * (rounding + 2 * dim * 2.0**-24)  # twice the bound, to spare
    if metric == METRIC_L2:
        return 2 * e, 4 * 2.0**-22
    return e, 0.0


def tiles(cap: int, cfg: ScanConfig, k: int) -> int:
    """The tiles of a capacity of ``cap`` rows: the width of ``tmax`` and of the lists."""
    return triton.cdiv(max(cap, 1), max(cfg.block_n, key_width(k)))


def search(
    db: Any,
    sqnorms: Any,
    sq_max: Any,
    scopes: Any,
    filt: Any,
    q: Any,
    n_dev: Any,
    ids: Any,
    tmax: Any,
    lists: Any,
    parts: Any,
    scores_out: Any,
    ids_out: Any,
    *,
    k: int,
    metric: int,
    scoped: bool,
    programs: int,
    cfg: ScanConfig,
    chunk: int = CHUNK,
    split: int = SPLIT,
) -> None:
    """The exact top-k of each of the queries ``q`` [nq, D] (unit stride in D): the two
    passes of the module doc. db, sqnorms, scopes, filt, n_dev, ids as for
    :func:`kalos.index.kernels.scan_topk.scan_topk`; sq_max: [1] fp32, at least every live
    row's |x|^2; tmax [>= nq, tiles] fp32 and lists [>= nq, tiles] int32: scratch
    (:func:`tiles`); parts [2, >= nq, split, key_width(k)] int64: scratch; scores_out [nq, k]
    fp32 and ids_out [nq, k] int64, unit stride in k. k <= 64
    (``scan_topk.FAST_MAX_KP_BATCH``). chunk: tile maxima a second-pass program reads at once;
    split: programs a query in the second pass (powers of two; tests). No host sync, no
    allocation."""
    nq, dim = q.shape
    kp = key_width(k)
    bn = max(cfg.block_n, kp)
    tw = tmax.shape[1]
    if (
        tmax.shape[0] < nq
        or tuple(lists.shape) != tuple(tmax.shape)
        or tw < triton.cdiv(db.shape[0], bn)
    ):
        raise ValueError(f"tmax and lists must be [>= {nq}, >= tiles], not {list(tmax.shape)}")
    if split < 1 or split & (split - 1):
        raise ValueError(f"split must be a power of two, not {split}")
    if parts.shape[0] != 2 or parts.shape[1] < nq or tuple(parts.shape[2:]) != (split, kp):
        raise ValueError(f"parts must be [2, >= {nq}, {split}, {kp}], not {list(parts.shape)}")
    bd = block_d(dim)
    launch(
        _tile_max_kernel, (programs,), db, sqnorms, scopes, filt, q, n_dev, tmax, nq,
        db.shape[0], tw, q.stride(0), D=dim, BLOCK_D=bd, BLOCK_N=bn, BLOCK_Q=block_q(nq),
        BQS=next_pow2(nq), METRIC=metric, SCOPED=scoped,
        PREC="ieee" if db.dtype.itemsize == 4 else "tf32", DOT_F32=_dot_f32(db),
        NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    ch = max(next_pow2(chunk), kp)
    launch(
        _slice_top_kernel, (nq, split), n_dev, tmax, parts[0], tw, BLOCK_N=bn, KP=kp, CHUNK=ch,
        SPLIT=split, num_warps=4,
    )  # fmt: skip
    gap_q, gap_x = slack(dim, db.dtype, metric)
    launch(
        _rescore_kernel, (nq, split), db, sqnorms, sq_max, scopes, filt, q, n_dev, tmax, lists,
        parts[0], parts[1], k, db.shape[0], tw, q.stride(0), gap_q, gap_x, D=dim, BLOCK_D=bd,
        BLOCK_N=bn, KP=kp, CHUNK=ch, SPLIT=split, METRIC=metric, SCOPED=scoped, num_warps=4,
    )  # fmt: skip
    launch(
        _merge_kernel, (nq,), parts[1], ids, q, scores_out, ids_out, k, q.stride(0),
        scores_out.stride(0), ids_out.stride(0), D=dim, BLOCK_D=bd, KP=kp, SPLIT=split,
        METRIC=metric, num_warps=4,
    )  # fmt: skip


__all__ = ["CHUNK", "MIN_BATCH", "SPLIT", "search", "slack", "tiles"]
