"""The 4-bit cascade for a batch of queries: one pass over the codes bounds every query.

A single query's cascade (:mod:`kalos.index.kernels.codes4`) reads 0.5 bytes a dimension of
each row instead of the stored row, then scores exactly only the rows its bounds leave open.
A batch of queries through the full-precision scan reads the stored rows once for all of them
(:mod:`kalos.index.kernels.batch_topk`), but those rows are four times the codes' bytes. Here a
batch shares one read of the codes, in five launches:

1. ``prep`` (codes4's, one program a chunk and query): each query rotated, as int8 parts.
2. ``_bounds_kernel``: persistent programs walk the row tiles; a tile's codes are unpacked
   into nibbles once and multiplied with every query's int8 parts in four int8 tensor-core
   dots a 64-dimension chunk (low and high nibbles, against the query's high and low parts):
   each row's lower and upper bound for each query, as the single query's dp4a gives them.
   Every upper bound is stored (``upper`` [nq, cap] fp32, -inf where the scope filter leaves
   the row out). Each query's largest lower bound in the tile is raised into one of ``k``
   groups (tile t into group t mod k): the least of the k group bests is the largest lower
   bound of k distinct rows, so at most the query's exact k-th score. (Fewer than k groups
   with a row: no bound, every row passes.)
3. ``_emit_kernel`` (programs a query): the rows whose upper bound reaches that bound, each
   query's listed apart (``rows`` [nq, cap] int32, ``count`` [nq]).
4. ``_rescore_kernel`` (up to SPLIT programs a query: most of them find no rows of a short
   list and stop): each its share of the query's listed rows scored exactly from the stored
   rows with the fp32 query, keeping its KP best.
5. ``_finish_kernel`` (one program a query): the top-k of its programs' bests, written out;
   it resets the query's count and group bests for the next batch.

Every row of a query's exact top-k has an upper bound at or above its exact score, which is
at least the k-th exact score, which is at least the bound: so it is listed, and scored
exactly. The answer is the exact scan's, up to the order of exact ties. The bounds' slack for
fp32 rounding is the single query's (codes4.encode): the rescore's FMAs are a single query's
scan's.

The batch costs one read of the codes (1M x 384: 200 MB, against the fp16 rows' 768 MB), the
upper bounds' write and read (4 bytes a row and query), and each query's open rows (on real
text embeddings a few thousand p50, tens of thousands at the tail: ``count``).

Under ``TRITON_INTERPRET=1`` every kernel runs on CPU tensors (the tests).
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from kalos.index.kernels import codes4
from kalos.index.kernels.batch_topk import write_merged
from kalos.index.kernels.precompile import launch
from kalos.index.kernels.scan_topk import (
    ScanConfig,
    _keys_from_scores,
    _merge_desc,
    _scope_mask,
    _tile_scores,
    _topk_desc,
    block_d,
    key_width,
    next_pow2,
)

MAX_BATCH = 64  # queries a batch (the bounds pass keeps [BLOCK_N, batch] accumulators)
# Rescore programs a query, at most: a query's open rows on real text run from a few thousand
# to tens of thousands, and the batch waits for its longest list; the finish merges SPLIT x
# KP keys a query, within FINISH_KEYS
SPLIT = 128
FINISH_KEYS = 2048
_QF_FIXED: tl.constexpr = tl.constexpr(codes4.QF_FIXED)
_NONE32: tl.constexpr = tl.constexpr(-(2**31))  # no group best yet (below every float's key)
_KEY_NONE: tl.constexpr = tl.constexpr(-(2**63))
_EMIT_BLOCK = 1024
# (do_not_specialize below: the arguments whose value changes within a batch bucket or whose
# alignment depends on the caller's buffers, such as a response arena's results, so that the
# warm-up's variants are the ones a search takes; the capacity, a multiple of 16, keeps its
# key: as kernels.scan_topk's)


@triton.jit
def _order32(x):
    # fp32 -> int32 with the same order (the group bests are raised with integer atomics)
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _float32(key):
    bits = tl.where(key >= 0, key, key ^ 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=("nq", "kg"))
def _bounds_kernel(
    codes_ptr,  # codes: [NCH, cap, 32] uint8 (codes4.encode)
    meta_ptr,  # meta: [2, cap] fp32, (scale, width per unit |q|)
    sq_ptr,  # sqnorms: [cap] fp32 (METRIC == 2)
    scope_ptr,  # scopes: [3, cap] int64 (SCOPED)
    filt_ptr,  # filter: [3] int64 (SCOPED)
    n_ptr,  # n: [1] int32, the live rows
    qc_ptr,  # the queries' int8 parts: [nq, NCH, 128] int8 (codes4.prep's words, as bytes)
    qf_ptr,  # the queries' fp32 terms: [nq, QF_FIXED + 2 NCH]
    up_ptr,  # out: [>= nq, cap] fp32, each row's upper bound for each query
    best_ptr,  # [>= nq, GW] int32: each query's group bests (_order32), _NONE32 at entry
    nq,
    cap,
    kg,
    NCH: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NQP: tl.constexpr,  # next_pow2(nq), >= 16 (a dot operand)
    GW: tl.constexpr,
    METRIC: tl.constexpr,
    SCOPED: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    n = tl.load(n_ptr)
    n_tiles = tl.cdiv(n, BLOCK_N)
    qq = tl.arange(0, NQP)
    qok = qq < nq
    qfw = _QF_FIXED + 2 * NCH
    qmu = tl.load(qf_ptr + qq * qfw, mask=qok, other=0.0)
    qn = tl.load(qf_ptr + qq * qfw + 1, mask=qok, other=0.0)
    corr = tl.zeros([NQP], dtype=tl.float32)  # the nibbles' offset, summed over the chunks
    for c in tl.static_range(NCH):
        corr += tl.load(qf_ptr + qq * qfw + 4 + c, mask=qok, other=0.0)
    jj = tl.arange(0, 32)
    qcol = qc_ptr + qq[None, :] * (NCH * 128) + jj[:, None]  # [32, NQP]
    up_col = up_ptr + qq[None, :].to(tl.int64) * cap  # [1, NQP]
    for t in tl.range(pid, n_tiles, P, num_stages=NUM_STAGES):
        rows = t * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < n
        r64 = rows.to(tl.int64)
        acc = tl.zeros([BLOCK_N, NQP], dtype=tl.float32)
        for c in tl.static_range(NCH):
            b = tl.load(codes_ptr + (c * cap + r64)[:, None] * 32 + jj[None, :],
                        mask=rmask[:, None], other=0)  # fmt: skip
            lo = (b & 0x0F).to(tl.int8)  # [BLOCK_N, 32]: dims 64c + j, as code + 8
            hi = (b >> 4).to(tl.int8)  # dims 64c + 32 + j
            qo = qcol + c * 128
            # the queries' high parts (bytes 0-63 of the chunk), then their low ones (64-127)
            dh = tl.dot(lo, tl.load(qo, mask=qok[None, :], other=0), out_dtype=tl.int32)
            dh = tl.dot(hi, tl.load(qo + 32, mask=qok[None, :], other=0), acc=dh,
                        out_dtype=tl.int32)  # fmt: skip
            dl = tl.dot(lo, tl.load(qo + 64, mask=qok[None, :], other=0), out_dtype=tl.int32)
            dl = tl.dot(hi, tl.load(qo + 96, mask=qok[None, :], other=0), acc=dl,
                        out_dtype=tl.int32)  # fmt: skip
            qs = tl.load(qf_ptr + qq * qfw + 4 + NCH + c, mask=qok, other=0.0)
            acc += (dh.to(tl.float32) + dl.to(tl.float32) * (1.0 / 256.0)) * qs[None, :]
        scale = tl.load(meta_ptr + rows, mask=rmask, other=0.0)
        width = tl.load(meta_ptr + cap + rows, mask=rmask, other=0.0)
        est = qmu[None, :] + scale[:, None] * (acc - corr[None, :])
        w = qn[None, :] * width[:, None]
        lower = est - w
        upper = est + w
        if METRIC == 2:
            # maximise 2 q.x - |x|^2; |x|^2 a hair off, for the rounding of the subtraction
            sq = tl.load(sq_ptr + rows, mask=rmask, other=0.0)[:, None]
            lower = 2.0 * lower - sq * (1.0 + 2e-6)
            upper = 2.0 * upper - sq * (1.0 - 2e-6)
        if SCOPED:  # noqa: SIM108 - a constexpr branch: the filter costs nothing when off
            valid = _scope_mask(scope_ptr, filt_ptr, rows, rmask, cap)
        else:
            valid = rmask
        ok = valid[:, None] & qok[None, :]
        tl.store(up_col + rows[:, None], tl.where(ok, upper, float("-inf")),
                 mask=rmask[:, None] & qok[None, :])  # fmt: skip
        low = tl.max(tl.where(ok, lower, float("-inf")), axis=0)  # [NQP]
        tl.atomic_max(best_ptr + qq * GW + t % kg, _order32(low), mask=qok & (low > float("-inf")),
                      sem="relaxed")  # fmt: skip


@triton.jit(do_not_specialize=("kg",))
def _emit_kernel(
    up_ptr,  # upper: [>= nq, cap] fp32, the bounds pass's
    n_ptr,  # n: [1] int32, the live rows
    best_ptr,  # [>= nq, GW] int32, the group bests
    count_ptr,  # count: [>= nq] int32, 0 at entry: each query's rows listed
    rows_ptr,  # out: [>= nq, cap] int32, each query's listed rows
    cap,
    kg,
    GW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # grid: (programs, nq): program (p, i) lists query i's rows in every programs-th block
    pid = tl.program_id(0)
    i = tl.program_id(1)
    n = tl.load(n_ptr)
    gg = tl.arange(0, GW)
    least = tl.min(tl.load(best_ptr + i * GW + gg, mask=gg < kg, other=2**31 - 1), axis=0)
    floor = tl.where(least == _NONE32, float("-inf"), _float32(least))
    up_row = up_ptr + i.to(tl.int64) * cap
    out_row = rows_ptr + i.to(tl.int64) * cap
    for b in range(pid, tl.cdiv(n, BLOCK), tl.num_programs(0)):
        rows = b * BLOCK + tl.arange(0, BLOCK)
        m = rows < n
        up = tl.load(up_row + rows, mask=m, other=float("-inf"))
        live = (m & (up >= floor) & (up > float("-inf"))).to(tl.int32)
        total = tl.sum(live, axis=0)
        if total > 0:
            base = tl.atomic_add(count_ptr + i, total, sem="relaxed")
            pos = base + tl.cumsum(live, axis=0) - 1
            tl.store(out_row + pos, rows, mask=live != 0)


@triton.jit(do_not_specialize=("q_ptr", "stride_q"))
def _rescore_kernel(
    db_ptr,  # db: [cap, D], the stored rows
    sq_ptr,  # sqnorms: [cap] fp32
    q_ptr,  # q: [nq, D], row stride stride_q
    count_ptr,  # count: [>= nq] int32, each query's rows listed
    rows_ptr,  # rows: [>= nq, cap] int32
    part_ptr,  # out: [nq, SPLIT, KP] int64, each program's best (score, row) keys
    cap,
    stride_q,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KP: tl.constexpr,
    SPLIT: tl.constexpr,
    METRIC: tl.constexpr,
):
    # program (query, s): the listed rows' blocks s, s + SPLIT, ..., scored with fp32 FMAs
    i = tl.program_id(0)
    s = tl.program_id(1)
    count = tl.load(count_ptr + i)
    dc = tl.arange(0, BLOCK_D)
    qv = tl.load(q_ptr + i.to(tl.int64) * stride_q + dc, mask=dc < D, other=0.0).to(tl.float32)
    if METRIC == 1:  # unit queries, as the scans make them
        qn = tl.sqrt(tl.sum(qv * qv, axis=0))
        qv = qv / tl.where(qn > 0, qn, 1.0)
    listed = rows_ptr + i.to(tl.int64) * cap
    run = tl.full([1, KP], _KEY_NONE, tl.int64)
    least = tl.min(run, axis=1)  # [1]: the KP-th best so far
    for j0 in range(s * BLOCK_N, count, SPLIT * BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        m = j < count
        rows = tl.load(listed + j, mask=m, other=0)
        sc = _tile_scores(
            db_ptr, sq_ptr, rows, m, qv, qv, D, BLOCK_D, 16, 1, False, METRIC, "ieee", False
        )  # [1, BLOCK_N]
        keys = _keys_from_scores(sc, rows[None, :], m[None, :])
        if tl.max(tl.max(keys, axis=1) > least, axis=0):
            run = _merge_desc(run, _topk_desc(keys, KP))
            least = tl.min(run, axis=1)
    kk = tl.arange(0, KP)
    tl.store(part_ptr + (i * SPLIT + s).to(tl.int64) * KP + kk, tl.reshape(run, [KP]))


@triton.jit(
    do_not_specialize=(
        "q_ptr",
        "scores_ptr",
        "out_ids_ptr",
        "k",
        "stride_q",
        "stride_os",
        "stride_oi",
    )
)
def _finish_kernel(
    part_ptr,  # [nq, SPLIT, KP] int64, the rescore programs' bests
    ids_ptr,  # ids: [cap] int64, row -> id
    q_ptr,  # q: [nq, D] (|q|^2 for l2)
    scores_ptr,  # out scores: [nq, k] fp32, row stride stride_os
    out_ids_ptr,  # out ids: [nq, k] int64, row stride stride_oi
    count_ptr,  # count: [>= nq] int32, reset to 0 here
    listed_ptr,  # out: [>= nq] int32, each query's count (for the books)
    best_ptr,  # [>= nq, GW] int32, reset to _NONE32 here
    k,
    stride_q,
    stride_os,
    stride_oi,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KP: tl.constexpr,
    SPLIT: tl.constexpr,
    GW: tl.constexpr,
    METRIC: tl.constexpr,
):
    i = tl.program_id(0)
    write_merged(
        i, part_ptr, ids_ptr, q_ptr, scores_ptr, out_ids_ptr, k, stride_q, stride_os, stride_oi,
        D, BLOCK_D, KP, SPLIT, METRIC,
    )  # fmt: skip
    tl.store(listed_ptr + i, tl.load(count_ptr + i))
    tl.store(count_ptr + i, 0)
    tl.store(best_ptr + i * GW + tl.arange(0, GW), tl.full([GW], _NONE32, tl.int32))


# ---------------------------------------------------------------------------------- launchers


def choose_config(nq: int, on_gpu: bool) -> ScanConfig:
    """Launch shape of the bounds pass: a tile's accumulators [BLOCK_N, next_pow2(nq)] fp32
    within 64 a thread at 4 warps (64 queries); 4 programs an SM."""
    if not on_gpu:
        return ScanConfig(block_n=32, num_warps=4, num_stages=1, use_dot=True, programs_per_sm=4)
    # 128-row tiles: a stage of codes is 32 bytes a row and chunk (384 dims: 24 KB)
    return ScanConfig(block_n=128, num_warps=4, num_stages=2, use_dot=True, programs_per_sm=4)


def workspace(nq: int, k: int, dim: int, upper: Any, rows: Any, on_gpu: bool) -> dict[str, Any]:
    """The scratch of :func:`search` for batches of up to ``nq`` queries and k results, on
    the device of ``upper`` ([nq, cap] fp32) and ``rows`` ([nq, cap] int32): the row-sized
    scratch, given, since searches that run one after another on one stream may share it
    (each writes what it reads of it first)."""
    import torch

    if not 1 <= nq <= MAX_BATCH:
        raise ValueError(f"a batch of 1..{MAX_BATCH} queries, not {nq}")
    if upper.shape[0] < nq or tuple(rows.shape) != tuple(upper.shape):
        raise ValueError(f"upper and rows must be [>= {nq}, cap]")
    device = upper.device
    nch = codes4.chunks(dim)
    kp = key_width(k)
    gw = max(2, next_pow2(k))
    split = min(SPLIT, FINISH_KEYS // kp) if on_gpu else 2
    qc = torch.zeros((nq, nch, 4, 8), dtype=torch.int32, device=device)
    return {
        "codes4_batch": True,
        "cfg": choose_config(nq, on_gpu),
        "qc": qc,
        "qc8": qc.view(torch.int8),  # the same words as bytes: the bounds pass's dot operands
        "qf": torch.zeros((nq, codes4.QF_FIXED + 2 * nch), dtype=torch.float32, device=device),
        "best": torch.full((nq, gw), -(2**31), dtype=torch.int32, device=device),
        "count": torch.zeros(nq, dtype=torch.int32, device=device),
        "listed": torch.zeros(nq, dtype=torch.int32, device=device),
        "upper": upper,
        "rows": rows,
        "parts": torch.empty((nq, split, kp), dtype=torch.int64, device=device),
        # rows a rescore step: [BLOCK_N, BLOCK_D] fp32 within ~64 values a thread at 8
        # warps, >= KP
        "rescore_block": max(kp, min(64, 16384 // block_d(dim))),
    }


def search(
    db: Any,
    sqnorms: Any,
    scopes: Any,
    filt: Any,
    q: Any,
    n_dev: Any,
    ids: Any,
    codes: Any,
    meta: Any,
    rot32: Any,
    mean32: Any,
    ws: dict[str, Any],
    scores_out: Any,
    ids_out: Any,
    *,
    k: int,
    metric: int,
    scoped: bool,
    programs: int,
    emit_programs: int,
) -> None:
    """The exact top-k of each of the queries ``q`` [nq, D] (unit stride in D) through the
    codes (the module doc). db, sqnorms, scopes, filt, n_dev, ids as for
    :func:`kalos.index.kernels.scan_topk.scan_topk`; codes, meta, rot32, mean32: the index's
    4-bit codes and their rotation and centre (:mod:`codes4`); ``ws``: :func:`workspace`'s
    for at least nq queries and this k; scores_out [nq, k] fp32 and ids_out [nq, k] int64,
    unit stride in k. ``ws["listed"][:nq]`` then holds each query's rows scored exactly. No
    host sync, no allocation."""
    nq, dim = q.shape
    cap = db.shape[0]
    nch = codes.shape[0]
    kp = key_width(k)
    gw = ws["best"].shape[1]
    cfg = ws["cfg"]
    if nq > ws["best"].shape[0] or k > gw or tuple(ws["upper"].shape[1:]) != (cap,):
        raise ValueError(
            f"a workspace of {ws['best'].shape[0]} queries, k <= {gw} and {cap} rows needed"
        )
    codes4.prep(q, rot32, mean32, ws["qc"], ws["qf"], metric=metric)
    launch(
        _bounds_kernel, (programs,), codes, meta, sqnorms, scopes, filt, n_dev, ws["qc8"],
        ws["qf"], ws["upper"], ws["best"], nq, cap, k,
        NCH=nch, BLOCK_N=cfg.block_n, NQP=max(16, next_pow2(nq)), GW=gw, METRIC=metric,
        SCOPED=scoped, NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
    grid = max(1, min(triton.cdiv(cap, _EMIT_BLOCK), emit_programs // nq))
    launch(
        _emit_kernel, (grid, nq), ws["upper"], n_dev, ws["best"], ws["count"], ws["rows"], cap,
        k, GW=gw, BLOCK=_EMIT_BLOCK, num_warps=4,
    )  # fmt: skip
    split = ws["parts"].shape[1]
    bd = block_d(dim)
    launch(
        _rescore_kernel, (nq, split), db, sqnorms, q, ws["count"], ws["rows"], ws["parts"], cap,
        q.stride(0), D=dim, BLOCK_D=bd, BLOCK_N=ws["rescore_block"], KP=kp, SPLIT=split,
        METRIC=metric, num_warps=8,
    )  # fmt: skip
    launch(
        _finish_kernel, (nq,), ws["parts"], ids, q, scores_out, ids_out, ws["count"],
        ws["listed"], ws["best"], k, q.stride(0), scores_out.stride(0), ids_out.stride(0),
        D=dim, BLOCK_D=bd, KP=kp, SPLIT=split, GW=gw, METRIC=metric, num_warps=4,
    )  # fmt: skip


__all__ = ["MAX_BATCH", "SPLIT", "choose_config", "search", "workspace"]
