"""Exact scan + top-k on the GPU, in Triton: one fused scoring/selection pass and a tiny merge.

Search of ``nq`` queries against ``n`` live rows is two launches:

``scan_topk`` (``_scan_topk_kernel``)
    A fixed grid of ``P`` persistent programs (a few per multiprocessor). Program ``p`` walks
    the row tiles ``p, p + P, p + 2P, ...`` of ``BLOCK_N`` rows. For each tile it scores every row
    (tensor-core ``tl.dot`` or plain FMAs), packs each score and its row into one sortable int64
    key, and takes the tile's largest key. Only when that key beats a lower bound of the query's
    k-th best key does the program sort the tile (bitonic) and merge it into its running
    top-``KP`` list. The bound is read from device memory that every program raises while the
    scan runs (``thr``: the largest k-th key of one program's list; ``slots``: the best key of
    each of k program groups, ``pid % k``). After the first tiles a tile almost never beats it,
    so selection costs one max-reduction and one compare per tile and the pass runs at the speed
    of the loads. Each program writes its sorted top-``KP`` list: ``P * KP`` candidates a query.

``merge_topk`` (``_merge_topk_kernel``)
    One program per query. The scan is over, so the bound is final and stable: it keeps the
    candidates at or above it (compacted into ``surv`` with a prefix sum; usually a few dozen),
    takes the top-``KP`` of those (all candidates if more than ``SURV`` pass), decodes keys to
    (score, row), maps rows to ids, applies the metric's final transform, writes ``k`` results,
    and resets ``thr`` and ``slots`` for the next search (so a captured CUDA graph needs no
    separate reset node).

Why the skip is exact: ``thr`` is the k-th key of some program's list, so at least ``k`` rows
have keys >= ``thr``; the ``k`` group bests come from ``k`` disjoint sets of programs, hence
from ``k`` distinct rows, so at least ``k`` keys are >= their minimum. Either is at most the
true k-th key, whenever it is read. A tile whose largest key is at most the bound holds no row
of the final top-k (keys are unique: the row is in the low bits).

Threads of one program may disagree about the bound. The bound
lives in memory that other programs change while this one runs, and each warp reads it with its
own loads, at its own time; Triton assumes that every thread holding a copy of a tensor element
holds the same value, and layout conversions may take an element from any of them. So nothing
in the scan may depend on the bound being the same in all threads: the skip decision is the OR
over the program's threads of each thread's own decision (``_cta_any``: one barrier reduction),
so the branch is uniform and a tile is skipped only when every thread's bound -- each a valid
one -- allows it; and the survivor selection, which needs one bound for all its steps, is done
in ``merge_topk``, where the bound no longer moves.

Key layout (int64): high 32 bits = the fp32 score's bits mapped to a signed order-preserving int
(``b if b >= 0 else b ^ 0x7FFFFFFF``), low 32 bits = the row. ``KEY_NONE`` (int64 min) marks
"no row" (past ``n``, filtered out by scope, or padding); it can never be a real key, since its
high half would be a NaN's bits.

For k above the fast path's limit, ``score_keys`` writes every row's key (``[nq, cap]``) and the
caller selects with ``torch.topk``; ``merge_topk`` with ``SELECT=False`` decodes the result.

All launchers take torch tensors on one device. With ``TRITON_INTERPRET=1`` they also run on CPU
tensors (slowly), which is how CI tests them.
"""

from __future__ import annotations

import os
from typing import Any

import triton
import triton.language as tl
from triton.runtime.jit import constexpr_function

from kalos.index.kernels.precompile import launch

KEY_NONE = -(2**63)  # int64 min: "no row"
_KEY_NONE: tl.constexpr = tl.constexpr(KEY_NONE)
_KEY_MAX: tl.constexpr = tl.constexpr(2**63 - 1)

METRIC_IP = 0
METRIC_COSINE = 1
METRIC_L2 = 2


@constexpr_function
def _log2(n):
    n = int(n)
    if n <= 0 or n & (n - 1):
        raise ValueError(f"{n} is not a power of two")
    return n.bit_length() - 1


# ------------------------------------------------------------------------------ bitonic top-k
# A [R, N] tensor is viewed as a hypercube [2] * log2(R * N); the innermost log2(N) axes index
# a row. One compare-exchange layer pairs the elements along one size-2 axis. The partner is
# found as (pair sum) - self: two's-complement sums wrap, so this is exact for any int64, and
# it is a plain `sum` reduction -- one shuffle on the GPU, and a numpy-native op under
# TRITON_INTERPRET (tl.sort/tl.topk use an xor-reduction there, which the interpreter runs
# element by element in Python, about 100x slower).


@triton.jit
def _bitonic_stage(h, stage: tl.constexpr, order: tl.constexpr):
    # h: hypercube [2] * n int64. `stage` compare-exchange layers over the innermost `stage` axes,
    # outermost first. order: 0 ascending, 1 descending, 2 alternating by bit `stage` (builds
    # bitonic runs). Written out in one function: under the interpreter every nested jit call
    # costs ~0.3 ms.
    n_dims: tl.constexpr = _log2(h.numel)
    if order == 2:
        flip = tl.reshape(tl.arange(0, 2), [1] * (n_dims - stage - 1) + [2] + [1] * stage)
    else:
        flip = order
    for j in tl.static_range(stage):
        # layer j works on axis n_dims - stage + j (the (stage - 1 - j)-th from the innermost)
        partner = tl.sum(h, axis=n_dims - stage + j, keep_dims=True) - h
        right = tl.reshape(
            tl.arange(0, 2), [1] * (n_dims - stage + j) + [2] + [1] * (stage - 1 - j)
        )
        # the left keeps the smaller one, unless `flip` says the larger
        h = tl.where((h > partner) != (flip ^ right), partner, h)
    return h


@triton.jit
def _topk_desc(x, KP: tl.constexpr):
    # x: [R, N] int64 -> [R, KP] the KP largest of each row, sorted descending (KP, N powers
    # of two, KP <= N). Sort runs of KP, then repeatedly keep the larger half of run pairs.
    log_n: tl.constexpr = _log2(x.shape[1])
    log_k: tl.constexpr = _log2(KP)
    h = tl.reshape(x, [2] * _log2(x.numel))
    for i in tl.static_range(1, log_k + 1):
        h = _bitonic_stage(h, i, 2 if i < log_n else 1)
    for i in tl.static_range(log_k + 1, log_n + 1):
        h = tl.max(h, axis=_log2(h.numel) - 1 - log_k)
        h = _bitonic_stage(h, log_k, 2 if i < log_n else 1)
    return tl.reshape(h, [x.shape[0], KP])


@triton.jit
def _merge_desc(a, b):
    # a, b: [R, KP] int64, rows sorted descending -> top-KP of each row pair, sorted descending.
    # max(a, reversed(b)) is the larger half of the union as a bitonic run; one bitonic merge
    # (log2(KP) layers) sorts it.
    log_k: tl.constexpr = _log2(a.shape[1])
    n_dims: tl.constexpr = _log2(a.numel)
    hb = tl.reshape(b, [2] * n_dims)
    for i in tl.static_range(log_k):  # reverse the row, one index bit at a time
        hb = tl.sum(hb, axis=n_dims - 1 - i, keep_dims=True) - hb
    h = tl.maximum(tl.reshape(a, [2] * n_dims), hb)
    h = _bitonic_stage(h, log_k, 1)
    return tl.reshape(h, a.shape)


# ------------------------------------------------------------------------------------- keys


@triton.jit
def _keys_from_scores(s, rows, valid):
    # s: [BQS, BN] fp32; rows: [1, BN] int32; valid: [BQS, BN] bool -> [BQS, BN] int64 keys
    bits = s.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    key = (ordered.to(tl.int64) << 32) | rows.to(tl.int64)
    return tl.where(valid, key, _KEY_NONE)


@triton.jit
def _scores_from_keys(key):
    # key: [...] int64 -> (scores [...] fp32, rows [...] int32); meaningless where key == KEY_NONE
    hi = (key >> 32).to(tl.int32)
    bits = tl.where(hi >= 0, hi, hi ^ 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True), (key & 0xFFFFFFFF).to(tl.int32)


# ---------------------------------------------------------------------------------- scoring


@triton.jit
def _load_queries(
    q_ptr,
    stride_q,
    nq,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    METRIC: tl.constexpr,
    WRAP: tl.constexpr = 0,
):
    # q: [nq, D] fp32 | fp16 | bf16 -> [BLOCK_Q, BLOCK_D] fp32, zero-padded; unit rows for cosine.
    # WRAP: row r holds query r % WRAP (the split dot's second group of lanes, _dot_operand)
    qi = tl.arange(0, BLOCK_Q)
    if WRAP:
        qi = qi % WRAP
    dc = tl.arange(0, BLOCK_D)
    m = (qi[:, None] < nq) & (dc[None, :] < D)
    q = tl.load(q_ptr + qi[:, None] * stride_q + dc[None, :], mask=m, other=0.0).to(tl.float32)
    if METRIC == 1:
        nrm = tl.sqrt(tl.sum(q * q, axis=1))
        q = q / tl.where(nrm > 0, nrm, 1.0)[:, None]
    return q


@triton.jit
def _dot_operand(q, dt: tl.constexpr, BQS: tl.constexpr, SPLIT: tl.constexpr):
    # q: [BLOCK_Q, BLOCK_D] fp32 -> the dot's query operand [BLOCK_D, BLOCK_Q] in the storage
    # type dt. SPLIT (q loaded with WRAP=BQS): lanes from BQS on take what rounding left of
    # their query (its low half, rounded too), so that the scores of a lane and its twin sum
    # to the fp32 query's within ~2^-22 of |q| |x| (fp16; 2^-16 bf16), where the rounded
    # query alone errs by up to 2^-11 (2^-8): more than a near-tie of real text
    hi = q.to(dt)
    if SPLIT:
        lo = (q - hi.to(tl.float32)).to(dt)
        hi = tl.where((tl.arange(0, q.shape[0]) < BQS)[:, None], hi, lo)
    return tl.trans(hi)


@triton.jit
def _load_rows(ptr, rows, rmask, D: tl.constexpr, BLOCK_D: tl.constexpr):
    # -> [BLOCK_N, BLOCK_D] the rows' elements of a row-major [cap, D] matrix, 0 past the
    # mask; int64 offsets (10M x 768 elements overflow int32)
    dc = tl.arange(0, BLOCK_D)
    ptrs = ptr + rows.to(tl.int64)[:, None] * D + dc[None, :]
    if BLOCK_D == D:
        x = tl.load(ptrs, mask=rmask[:, None], other=0)
    else:
        x = tl.load(ptrs, mask=rmask[:, None] & (dc[None, :] < D), other=0)
    return x


@triton.jit
def _tile_scores(
    db_ptr,
    sq_ptr,
    rows,
    rmask,
    qT,
    qv,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BQS: tl.constexpr,
    USE_DOT: tl.constexpr,
    METRIC: tl.constexpr,
    PREC: tl.constexpr,
    DOT_F32: tl.constexpr,
    SPLIT: tl.constexpr = False,
):
    # -> [BQS, BLOCK_N] fp32 scores to maximise, for the first BQS queries; SPLIT (the dot's
    # operand from _dot_operand): each lane's score and its twin's, BQS lanes on, summed
    x = _load_rows(db_ptr, rows, rmask, D, BLOCK_D)
    if USE_DOT:
        if DOT_F32:  # bf16 under TRITON_INTERPRET: its dot multiplies the raw uint16 bits
            acc = tl.dot(x.to(tl.float32), qT.to(tl.float32), input_precision="ieee")
        else:
            acc = tl.dot(x, qT, input_precision=PREC)  # [BLOCK_N, BLOCK_Q] fp32
        if BQS == BLOCK_Q:
            s = tl.trans(acc)
        else:
            # keep the first BQS columns: [BN, BLOCK_Q] -> [BN, BLOCK_Q // BQS, BQS], group 0
            # (and group 1, the low halves, when SPLIT)
            g = tl.arange(0, BLOCK_Q // BQS)[None, :, None]
            acc3 = tl.reshape(acc, [acc.shape[0], BLOCK_Q // BQS, BQS])
            s = tl.trans(tl.sum(tl.where(g < 1 + SPLIT, acc3, 0.0), axis=1))
    else:
        s = tl.sum(x.to(tl.float32) * qv[None, :], axis=1)[None, :]  # BQS == 1
    if METRIC == 2:
        # maximise 2 q.x - |x|^2  (distance = |q|^2 - that, applied in merge_topk)
        sq = tl.load(sq_ptr + rows, mask=rmask, other=0.0)
        s = 2.0 * s - sq[None, :]
    return s


@triton.jit
def _tile_upper(
    codes_ptr,
    meta_ptr,
    sq_ptr,
    rows,
    rmask,
    cap,
    qv,
    qT8,
    q_scale,
    qn,
    rq,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    CODES: tl.constexpr,
    METRIC: tl.constexpr,
):
    # -> [1, BLOCK_N] fp32: an upper bound of each row's exact score (the prefilter's key).
    # codes: [cap, D] int8, row i ~ scale_i * codes_i; meta: [3, cap] fp32 = (scale, e1, e2)
    # with |q.x - approx| <= |q| e1 + e2 |q - q8| (see prefilter_meta). CODES 1: the codes
    # upcast against the fp32 query (FMAs); 2: an int8 tensor-core dot against the query
    # in two int8 parts (q ~ q_scale * (hi + lo / 256)), exact in int32.
    c = _load_rows(codes_ptr, rows, rmask, D, BLOCK_D)
    scale = tl.load(meta_ptr + rows, mask=rmask, other=0.0)
    e1 = tl.load(meta_ptr + cap + rows, mask=rmask, other=0.0)
    if CODES == 2:
        acc = tl.dot(c, qT8, out_dtype=tl.int32)  # [BLOCK_N, BLOCK_Q]: columns hi, lo
        col = tl.arange(0, BLOCK_Q)[None, :]
        hi = tl.sum(tl.where(col == 0, acc, 0), axis=1).to(tl.float32)
        lo = tl.sum(tl.where(col == 1, acc, 0), axis=1).to(tl.float32)
        d = hi + lo * (1.0 / 256.0)
        e2 = tl.load(meta_ptr + 2 * cap + rows, mask=rmask, other=0.0)
        s = d * (scale * q_scale) + (qn * e1 + rq * e2)
    else:
        d = tl.sum(c.to(tl.float32) * qv[None, :], axis=1)
        s = d * scale + qn * e1
    if METRIC == 2:
        # maximise 2 q.x - |x|^2; |x|^2 a hair low, for the rounding of the subtraction
        sq = tl.load(sq_ptr + rows, mask=rmask, other=0.0)
        s = 2.0 * s - sq * (1.0 - 2e-6)
    return s[None, :]


@triton.jit
def _dp4a(a, b, c, PTX: tl.constexpr):
    # c + the dot of a's four bytes (unsigned) with b's four (signed), per int32 element: PTX
    # dp4a.u32.s32 on an NVIDIA GPU, the same integer sum byte by byte otherwise
    if PTX:
        return tl.inline_asm_elementwise(
            "dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
            is_pure=True, pack=1,
        )  # fmt: skip
    else:
        acc = c
        for i in tl.static_range(4):
            acc += ((a >> (8 * i)) & 0xFF) * ((b << (24 - 8 * i)) >> 24)
        return acc


@triton.jit
def _tile_bounds4(
    codes_ptr,
    meta_ptr,
    sq_ptr,
    qw_ptr,
    qf_ptr,
    rows,
    rmask,
    cap,
    qmu,
    qn,
    corr,
    NCH: tl.constexpr,
    METRIC: tl.constexpr,
    PTX: tl.constexpr,
):
    # -> (lower [1, BLOCK_N], upper [1, BLOCK_N]) fp32 bounds of each row's exact score, from
    # its 4-bit codes (kernels.codes4), read as int32 words: codes [NCH, cap, 8], byte j of
    # chunk c holds rotated dimension 64c + j in its low nibble and 64c + 32 + j in its high
    # one, as code + 8; meta [2, cap] fp32 = (scale, width per unit |q|). The query's int8
    # parts qw [NCH, 4, 8] int32, four bytes a word: (hi part, dims 64c..64c+31), (hi part,
    # the next 32), (lo part, ...), (lo part, ...); qf[4 + NCH + c] is chunk c's scale.
    # score ~ q.mean + scale * (sum_c qs_c (hi_c + lo_c / 256) . nibbles - corr), within
    # |q| * width of the exact score. A word's eight nibbles are two dp4a operands: its low
    # nibbles (0x0F0F0F0F) pair with four dims of the first half, its high ones with the same
    # four of the second half.
    ww = tl.arange(0, 8)
    r64 = rows.to(tl.int64)
    acc = tl.zeros([rows.shape[0]], dtype=tl.float32)
    for c in tl.static_range(NCH):
        w = tl.load(codes_ptr + (c * cap + r64)[:, None] * 8 + ww[None, :], mask=rmask[:, None],
                    other=0)  # fmt: skip
        lo = w & 0x0F0F0F0F
        hi = (w >> 4) & 0x0F0F0F0F
        qo = qw_ptr + c * 32 + ww
        zero = tl.zeros([rows.shape[0], 8], dtype=tl.int32)
        dh = _dp4a(hi, tl.load(qo + 8)[None, :], _dp4a(lo, tl.load(qo)[None, :], zero, PTX), PTX)
        dl = _dp4a(hi, tl.load(qo + 24)[None, :], _dp4a(lo, tl.load(qo + 16)[None, :], zero, PTX),
                   PTX)  # fmt: skip
        qs = tl.load(qf_ptr + 4 + NCH + c)
        d = tl.sum(dh, axis=1).to(tl.float32) + tl.sum(dl, axis=1).to(tl.float32) * (1.0 / 256.0)
        acc += d * qs
    scale = tl.load(meta_ptr + rows, mask=rmask, other=0.0)
    width = qn * tl.load(meta_ptr + cap + rows, mask=rmask, other=0.0)
    est = qmu + scale * (acc - corr)
    lower = est - width
    upper = est + width
    if METRIC == 2:
        # maximise 2 q.x - |x|^2; |x|^2 a hair off, for the rounding of the subtraction
        sq = tl.load(sq_ptr + rows, mask=rmask, other=0.0)
        lower = 2.0 * lower - sq * (1.0 + 2e-6)
        upper = 2.0 * upper - sq * (1.0 - 2e-6)
    return lower[None, :], upper[None, :]


@triton.jit
def _scope_mask(scope_ptr, filt_ptr, rows, rmask, cap):
    # scopes: [3, cap] int64 (tenant, user, session rows); filter: [3] int64, 0 = any.
    # A field whose filter is 0 is not read at all (its load is masked off).
    # filter fields broadcast to the tile first (the interpreter mis-types bool & scalar-bool)
    zero = rows.to(tl.int64) * 0
    ft = zero + tl.load(filt_ptr)
    fu = zero + tl.load(filt_ptr + 1)
    fs = zero + tl.load(filt_ptr + 2)
    tv = tl.load(scope_ptr + rows, mask=rmask & (ft != 0), other=0)
    uv = tl.load(scope_ptr + cap + rows, mask=rmask & (fu != 0), other=0)
    sv = tl.load(scope_ptr + 2 * cap + rows, mask=rmask & (fs != 0), other=0)
    ok = ((ft == 0) | (tv == ft)) & ((fu == 0) | (uv == fu)) & ((fs == 0) | (sv == fs))
    return rmask & ok


# ------------------------------------------------------------------------- one program's OR


@triton.jit
def _cta_any(x):
    # x: int32 scalar, this thread's own view -> 1 in every thread of the program if x != 0
    # in any of them, else 0 (PTX bar.red.or: a barrier that reduces a predicate, as CUDA's
    # __syncthreads_or). Every thread must reach it, once per call.
    return tl.inline_asm_elementwise(
        "{ .reg .pred %pin, %pout; setp.ne.s32 %pin, $1, 0; "
        "bar.red.or.pred %pout, 0, %pin; selp.s32 $0, 1, 0, %pout; }",
        "=r,r",
        [x],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _fence_sys(x):
    # PTX fence.sc.sys in every thread: this thread's earlier stores (the results, in pinned
    # host memory) are visible to the host before any of its later ones. Returns x.
    return tl.inline_asm_elementwise(
        "fence.sc.sys; mov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _store_release_sys(ptr, value, when):
    # One thread of the program (thread 0) stores the int64 value at ptr, a release at system
    # scope, when ``when`` != 0. Returns 0.
    return tl.inline_asm_elementwise(
        "{ .reg .pred %p; .reg .u32 %t; mov.u32 %t, %tid.x; setp.eq.u32 %p, %t, 0; "
        "setp.ne.and.s32 %p, $3, 0, %p; @%p st.global.release.sys.b64 [$1], $2; "
        "mov.u32 $0, 0; }",
        "=r,l,l,r",
        [ptr, value, when],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _clock(x, TRACE: tl.constexpr):
    # the GPU's global clock in ns (PTX %globaltimer) when TRACE == 2; 0 under the interpreter
    if TRACE == 2:
        return tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l,r", [x], dtype=tl.int64, is_pure=False, pack=1
        )
    else:
        return x.to(tl.int64) * 0


@triton.jit
def _smid(x, TRACE: tl.constexpr):
    # the multiprocessor this program runs on (PTX %smid) when TRACE == 2; 0 otherwise
    if TRACE == 2:
        return tl.inline_asm_elementwise(
            "mov.u32 $0, %smid;", "=r,r", [x], dtype=tl.int32, is_pure=True, pack=1
        )
    else:
        return x * 0


@triton.jit
def _publish_seq(seq_ptr, pub_ptr, exact, MODE: tl.constexpr):
    # The response's sequence number (seq_ptr, staged with the query) stored at pub_ptr (the
    # channel's response sequence word) once every thread's results are visible to the host,
    # and only when the result is proven (exact != 0): the client then reads the response
    # without waiting for the sidecar. MODE 2 (GPU): every thread fences at system scope, a
    # barrier, then one release store. MODE 1 (the interpreter: one thread, memory in order):
    # a plain store.
    seq = tl.load(seq_ptr)
    if MODE == 2:
        done = _fence_sys(exact)
        tl.debug_barrier()
        _store_release_sys(pub_ptr, seq, done)
    else:
        if exact != 0:
            tl.store(pub_ptr, seq)


# ---------------------------------------------------------------------------------- kernels


# Arguments that take other values as the index grows or by (batch, k) within one bucket, or
# whose alignment depends on where the caller's buffers lie (a response arena's results): not
# specialised (Triton's ==1 and divisible-by-16 keys), so that no search after the warm-up
# (CudaFlatIndex.warm) needs a new compile. None of them is on a row loop's address path; the
# capacity is (a multiple of 16: CudaFlatIndex._reserve), and so keeps its key.
_SCAN_DYNAMIC = (
    "q_ptr", "filt_ptr", "ticket_ptr", "scores_ptr", "out_ids_ptr", "status_ptr", "seq_ptr",
    "pub_ptr", "gate_ptr", "trace_ptr", "RSTRIDE", "nq", "k", "kf", "kg", "stride_os",
    "stride_oi",
)  # fmt: skip
_MERGE_DYNAMIC = ("q_ptr", "scores_ptr", "out_ids_ptr", "NCAND", "k", "stride_os", "stride_oi",
                  "RSTRIDE")  # fmt: skip
_KEYS_DYNAMIC = ("filt_ptr", "q_ptr", "nq")


@triton.jit(do_not_specialize=_SCAN_DYNAMIC)
def _scan_topk_kernel(
    db_ptr,  # db: [cap, D] fp16 | bf16 | fp32, row-major
    sq_ptr,  # sqnorms: [cap] fp32, |x|^2 of the stored rows (read when METRIC == 2)
    scope_ptr,  # scopes: [3, cap] int64 (read when SCOPED)
    filt_ptr,  # filter: [3] int64 on the device (read when SCOPED)
    q_ptr,  # q: [nq, D] fp32 | fp16 | bf16, row-major with stride_q
    n_ptr,  # n: [1] int32, live rows; rows [0, n) are scanned
    thr_ptr,  # thr: [REPL * RSTRIDE] int64, largest published k-th key of one program; KEY_NONE
    slot_ptr,  # slots: [REPL * RSTRIDE, GW] int64, best key of program group j = pid % kg; NONE
    cand_ptr,  # cand: [nq, P, KP] int64, each program's top-KP keys, sorted descending
    ticket_ptr,  # ticket: [1] int32, programs finished (FUSED); 0 at entry, reset here
    surv_ptr,  # merge_topk's arguments, for the fused final top-k (FUSED)
    ids_ptr,
    scores_ptr,
    out_ids_ptr,
    codes_ptr,  # the prefilter (CODES): codes [cap, D] int8, meta [3, cap] fp32,
    meta_ptr,  # status [1] int32: 1 when the re-ranked top-kf is provably the exact one
    status_ptr,
    seq_ptr,  # PUBLISH: [1] int64 on the device, the response's sequence number
    pub_ptr,  # PUBLISH: [1] int64 in registered host memory, the channel's response sequence
    gate_ptr,  # GATED: [1] int32 on the device; 0: this launch does nothing (server.doorbell)
    trace_ptr,  # TRACE: [P + 1, 8] int64, where the time goes (see scan_topk's trace)
    up_ptr,  # CODES 4 or SETTLE: upper [cap] fp32, each row's score upper bound (written)
    qc_ptr,  # CODES 4: the rotated query's int8 parts as words [NCH, 4, 8] (kernels.codes4)
    qf_ptr,  # CODES 4: the rotated query's fp32 terms (kernels.codes4.QF_*)
    rows_ptr,  # CANDS: the candidate rows [cap] int32; n_ptr then holds their count
    floor_ptr,  # SETTLE: [1] int64, the re-ranked rows' kf-th best exact key (written)
    RSTRIDE,  # rows between two replicas of thr and slots (replica r of query q: r * RSTRIDE + q)
    nq,
    k,  # the rows kept per query: the final k, or the prefilter's candidates (CODES)
    kf,  # the final k (CODES)
    kg,  # groups of the group-best bound (its rank): k, unless the lists are shorter
    cap,
    stride_q,
    stride_os,
    stride_oi,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # >= 16 (a dot operand), >= BQS
    BQS: tl.constexpr,  # queries selected for: next_pow2(nq)
    KP: tl.constexpr,
    METRIC: tl.constexpr,
    SCOPED: tl.constexpr,
    USE_DOT: tl.constexpr,
    SKIP: tl.constexpr,
    PREC: tl.constexpr,
    DOT_F32: tl.constexpr,
    SPLIT: tl.constexpr,  # the dot scores the query's low half too (dot_lanes)
    NUM_STAGES: tl.constexpr,
    CTA_OR: tl.constexpr,  # PTX (GPU; not the interpreter): the skip through _cta_any, dp4a
    FUSED: tl.constexpr,  # nq == 1: the last program to finish does merge_topk's work
    SURV: tl.constexpr,
    CHUNK: tl.constexpr,
    CODES: tl.constexpr,  # 0: score the stored rows; 1, 2: the int8 prefilter (_tile_upper)
    KPF: tl.constexpr,  # key_width(kf) (CODES)
    KPC: tl.constexpr,  # rows the last program selects: key_width(k) (KP unless CODES)
    GW: tl.constexpr,  # the slots' width: key_width(kg)
    USE_THR: tl.constexpr,  # the lists' k-th key as a bound too (lists of >= k rows)
    PUBLISH: tl.constexpr,  # CODES: store seq at pub once proven; 0 off, 1 plain, 2 fenced (GPU)
    GATED: tl.constexpr,  # read gate first: 0 there scans no row and writes no result
    TRACE: tl.constexpr,  # 0 off; 1 counts only (the interpreter); 2 counts and GPU clocks
    REPL: tl.constexpr,  # replicas of the bounds (ScanConfig.bound_replicas)
    NCH: tl.constexpr = 1,  # CODES 4: 64-dimension chunks of the rotated rows
    CANDS: tl.constexpr = 0,  # 1: score the rows listed at rows_ptr (the 4-bit cascade's last pass)
    SETTLE: tl.constexpr = 0,  # CODES 1, 2: every row's upper bound and the floor, for settle
):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    if TRACE != 0:
        tl.store(trace_ptr + pid * 8, _clock(pid, TRACE))
        tl.store(trace_ptr + pid * 8 + 5, _smid(pid, TRACE))
    merged = 0
    walked = 0
    n = tl.load(n_ptr)
    if GATED:  # a closed gate: no tile, and the last program selects and writes nothing
        go = tl.load(gate_ptr)
        n = tl.where(go != 0, n, 0)
    else:
        go = n * 0 + 1
    n_tiles = tl.cdiv(n, BLOCK_N)
    # The programs whose lists the last one merges: every one; in the fused pass over a
    # candidate list (the 4-bit cascade's exact pass, a settle), only those with a tile of it
    # (at least the first): a median cascade search lists a few thousand rows, a tile each for
    # far fewer programs than the grid's, and the rest neither list nor take a ticket
    used = P
    if CANDS:  # noqa: SIM102 - constexpr branches
        if FUSED:
            used = tl.maximum(tl.minimum(P, n_tiles), 1)

    q = _load_queries(q_ptr, stride_q, nq, D, BLOCK_D, BLOCK_Q, METRIC, BQS if SPLIT else 0)
    qT = _dot_operand(q, db_ptr.dtype.element_ty, BQS, SPLIT)  # [BLOCK_D, BLOCK_Q]
    qv = tl.sum(tl.where(tl.arange(0, BLOCK_Q)[:, None] == 0, q, 0.0), axis=0)  # [BLOCK_D]
    if CODES == 4:  # nq == 1: the rotated query's terms, staged by codes4's prep kernel
        q_scale = tl.load(qf_ptr)  # q . mean
        qn = tl.load(qf_ptr + 1)
        rq = qn * 0.0  # the nibbles' offset, summed over the chunks
        for c in tl.static_range(NCH):
            rq += tl.load(qf_ptr + 4 + c)
        qT8 = qT
    elif CODES != 0:  # nq == 1: the query's norm, and its int8 form for the int8 dot
        qn = tl.sqrt(tl.sum(qv * qv, axis=0)) * (1.0 + 1e-5)
        amax = tl.max(tl.abs(qv), axis=0)
        q_scale = tl.where(amax > 0, amax / 127.0, 1.0)
        q8f = tl.minimum(tl.maximum(tl.floor(qv / q_scale + 0.5), -127.0), 127.0)
        # q ~ q_scale * (hi + lo / 256): two int8 columns of one dot, so the query's own
        # rounding adds |x| |q - that| <= ~0.2% of the int8 rounding of the rows
        lo8f = tl.minimum(tl.maximum(tl.floor((qv / q_scale - q8f) * 256.0 + 0.5), -127.0), 127.0)
        rv = qv - (q8f + lo8f / 256.0) * q_scale
        rq = tl.sqrt(tl.sum(rv * rv, axis=0)) * (1.0 + 1e-5) + 1e-6 * qn
        col = tl.arange(0, BLOCK_Q)[None, :]
        qT8 = tl.where(col == 0, q8f[:, None], tl.where(col == 1, lo8f[:, None], 0.0))
        qT8 = qT8.to(tl.int8)  # [BLOCK_D, BLOCK_Q]: hi in column 0, lo in column 1
    else:
        qn = 0.0
        q_scale = 1.0
        rq = 0.0
        qT8 = qT
    qs = tl.arange(0, BQS)
    qs_ok = qs < nq
    kk = tl.arange(0, KP)
    gg = tl.arange(0, GW)
    slots_ok = qs_ok[:, None] & (gg[None, :] < kg)
    rr = tl.arange(0, REPL)[None, :]  # every replica, raised together
    thr_all = thr_ptr + rr * RSTRIDE + qs[:, None]  # [BQS, REPL]
    my_slot = slot_ptr + (rr * RSTRIDE + qs[:, None]) * GW + pid % kg  # [BQS, REPL]

    run = tl.full([BQS, KP], _KEY_NONE, tl.int64)
    for t in tl.range(pid, n_tiles, P, num_stages=NUM_STAGES):
        rows = t * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < n
        if CANDS:  # the tile's rows are the next entries of the candidate list
            rows = tl.load(rows_ptr + rows, mask=rmask, other=0)
        if CODES == 4:
            s, up = _tile_bounds4(
                codes_ptr, meta_ptr, sq_ptr, qc_ptr, qf_ptr, rows, rmask, cap, q_scale, qn, rq,
                NCH, METRIC, CTA_OR,
            )  # fmt: skip
        elif CODES != 0:
            s = _tile_upper(
                codes_ptr, meta_ptr, sq_ptr, rows, rmask, cap, qv, qT8, q_scale, qn, rq,
                D, BLOCK_D, BLOCK_Q, CODES, METRIC,
            )  # fmt: skip
        else:
            s = _tile_scores(
                db_ptr,
                sq_ptr,
                rows,
                rmask,
                qT,
                qv,
                D,
                BLOCK_D,
                BLOCK_Q,
                BQS,
                USE_DOT,
                METRIC,
                PREC,
                DOT_F32,
                SPLIT,
            )
        if SCOPED:  # noqa: SIM108 - a constexpr branch: the filter costs nothing when off
            valid = _scope_mask(scope_ptr, filt_ptr, rows, rmask, cap)
        else:
            valid = rmask
        if CODES == 4:  # every row's upper bound, for the emit pass (-inf: filtered out)
            tl.store(up_ptr + rows, tl.where(valid, tl.reshape(up, [BLOCK_N]), float("-inf")),
                     mask=rmask)  # fmt: skip
        elif SETTLE:  # the int8 bounds too: an unproven search settles from them
            tl.store(up_ptr + rows, tl.where(valid, tl.reshape(s, [BLOCK_N]), float("-inf")),
                     mask=rmask)  # fmt: skip
        keys = _keys_from_scores(s, rows[None, :], valid[None, :] & qs_ok[:, None])
        if SKIP:
            tmax = tl.max(keys, axis=1)  # [BQS]
            # volatile: other programs raise these while this one runs; a stale value only
            # skips less. Two lower bounds of the k-th key: the best published k-th key of one
            # program, and the least of the k group bests (k distinct rows). Threads may read
            # different values (module doc): each decides with its own, and the program merges
            # the tile if any of them says so, which keeps the branch uniform.
            # replica r of the bounds in the program's r-th round: a different line each round,
            # so a line an earlier round left in this multiprocessor's L1 is not read again
            row = ((t // P) % REPL) * RSTRIDE + qs
            if USE_THR:
                thr = tl.load(thr_ptr + row, mask=qs_ok, other=_KEY_NONE, volatile=True)
            else:  # lists shorter than the bound's rank: the group bests alone
                thr = tl.full([BQS], _KEY_NONE, tl.int64)
            slots = slot_ptr + row[:, None] * GW + gg[None, :]  # [BQS, GW]
            best = tl.load(slots, mask=slots_ok, other=_KEY_MAX, volatile=True)
            bound = tl.maximum(thr, tl.min(best, axis=1))
            hit = tl.max((tmax > bound).to(tl.int32), axis=0)
            if CTA_OR:
                hit = _cta_any(hit)
        else:
            hit = 1
        if TRACE != 0:
            walked += 1
            merged += (hit > 0).to(tl.int32)
        if hit > 0 and CODES == 4:
            # the bounds pass raises the group bests alone (its tile's best lower bound): the
            # least of k group bests bounds the k-th best lower bound with no list to sort
            top1 = tl.broadcast_to(tl.max(keys, axis=1)[:, None], [BQS, REPL])
            tl.atomic_max(my_slot, top1, mask=qs_ok[:, None], sem="relaxed")
        elif hit > 0:
            run = _merge_desc(run, _topk_desc(keys, KP))
            if SKIP:
                if USE_THR:
                    kth = tl.max(tl.where(kk[None, :] == k - 1, run, _KEY_NONE), axis=1)
                    kth = tl.broadcast_to(kth[:, None], [BQS, REPL])
                    tl.atomic_max(thr_all, kth, mask=qs_ok[:, None], sem="relaxed")
                # the list's first key (its best), picked as kth is: a plain max over the
                # sorted list fails Triton 3.9's layout inference at KP >= 32
                top1 = tl.max(tl.where(kk[None, :] == 0, run, _KEY_NONE), axis=1)
                top1 = tl.broadcast_to(top1[:, None], [BQS, REPL])
                tl.atomic_max(my_slot, top1, mask=qs_ok[:, None], sem="relaxed")

    if CODES != 4:  # (the bounds pass keeps no lists)
        out = cand_ptr + qs[:, None] * (P * KP) + pid * KP + kk[None, :]
        tl.store(out, run, mask=(qs_ok & (qs * 0 + pid < used))[:, None])
    if TRACE != 0:
        tl.store(trace_ptr + pid * 8 + 1, _clock(pid, TRACE))
        tl.store(trace_ptr + pid * 8 + 2, merged)
        tl.store(trace_ptr + pid * 8 + 3, walked)
    if FUSED:  # noqa: SIM102 - a constexpr branch around a runtime one
        if pid < used:
            # The last program to finish selects the final top-k, saving the merge launch. The
            # barrier orders every thread's candidate stores (and bound raises) before this
            # program's ticket; the ticket is acq_rel at GPU scope: the last taker sees what every
            # program did before its own ticket, and reads it past its L1 (_final_topk's FRESH).
            # (A program past ``used`` may read the count after the last one reset it: 0, which
            # leaves it past ``used`` too.)
            tl.debug_barrier()
            ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
            if ticket == used - 1:
                if go != 0:
                    if CODES != 0:
                        key, bound, total, lists_last = _select_top(
                            pid * 0, cand_ptr, thr_ptr, slot_ptr, surv_ptr, used * KP, kg, GW,
                            KPC, SURV, CHUNK, True, True, KP, trace_ptr + P * 8, TRACE, RSTRIDE,
                            REPL,
                        )  # fmt: skip
                        if TRACE != 0:
                            tl.store(trace_ptr + P * 8, _clock(pid, TRACE))
                            tl.store(trace_ptr + P * 8 + 4, total)
                        if KPC > KP:  # noqa: SIM108 - a constexpr branch
                            # lists shorter than the rows kept: a row left out may also have been
                            # pushed off its program's list (below that list's last key) or skipped
                            # (below the bound): the proof must clear those too
                            floor = tl.maximum(bound, lists_last)
                        else:
                            floor = bound * 0 + _KEY_NONE
                        top, exact, kth = _rerank(
                            db_ptr, sq_ptr, status_ptr, key, floor, qv, kf, D, BLOCK_D, KPF, METRIC
                        )
                        if SETTLE:  # at most the exact kf-th score: settle's bound (codes4.emit)
                            tl.store(floor_ptr, kth)
                        if TRACE != 0:
                            tl.store(trace_ptr + P * 8 + 1, _clock(pid, TRACE))
                        _write_top(
                            pid * 0, top, ids_ptr, q_ptr, scores_ptr, out_ids_ptr, kf, stride_q,
                            stride_os, stride_oi, D, BLOCK_D, KPF, METRIC,
                        )  # fmt: skip
                        if TRACE != 0:
                            tl.store(trace_ptr + P * 8 + 2, _clock(pid, TRACE))
                        if PUBLISH != 0:
                            _publish_seq(seq_ptr, pub_ptr, exact.to(tl.int32), PUBLISH)
                    else:
                        _final_topk(
                            pid * 0, cand_ptr, thr_ptr, slot_ptr, surv_ptr, ids_ptr, q_ptr,
                            scores_ptr, out_ids_ptr, used * KP, k, stride_q, stride_os, stride_oi,
                            D, BLOCK_D, KP, SURV, CHUNK, METRIC, True, True, RSTRIDE, REPL,
                        )  # fmt: skip
                        if CANDS:  # every candidate scored exactly: the result is exact
                            tl.store(status_ptr, 1)
                            tl.store(status_ptr + 1, n)  # the candidates, for the books
                            if PUBLISH != 0:
                                _publish_seq(seq_ptr, pub_ptr, go, PUBLISH)
                if CANDS:  # every program read the count at its start: reset it for the next search
                    tl.store(n_ptr, 0)
                tl.store(ticket_ptr, 0)
                if TRACE != 0:
                    tl.store(trace_ptr + P * 8 + 3, pid)  # the last program
    if TRACE != 0:
        tl.store(trace_ptr + pid * 8 + 4, _clock(pid, TRACE))


@triton.jit
def _rerank(
    db_ptr,
    sq_ptr,
    status_ptr,
    key,
    floor,
    qv,
    kf,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KPF: tl.constexpr,
    METRIC: tl.constexpr,
):
    # key: [KPC] the prefilter's candidates, sorted descending by their score's upper bound
    # -> ([KPF] the top-kf of their exact scores (as _tile_scores computes them), sorted;
    # whether proven; the kf-th of them, a key no greater than the exact kf-th best row's).
    # Writes status 1 when that is provably the exact top-kf of every row: each row left out
    # has an upper bound <= max(the least kept one's, floor), and that is below the kf-th
    # exact score (or fewer than KPC rows passed the filter at all, so none was left out).
    ok = key != _KEY_NONE
    _, row = _scores_from_keys(key)
    row = tl.where(ok, row, 0)
    dc = tl.arange(0, BLOCK_D)
    x = tl.load(
        db_ptr + row.to(tl.int64)[:, None] * D + dc[None, :],
        mask=ok[:, None] & (dc[None, :] < D),
        other=0.0,
    )
    e = tl.sum(x.to(tl.float32) * qv[None, :], axis=1)
    if METRIC == 2:
        e = 2.0 * e - tl.load(sq_ptr + row, mask=ok, other=0.0)
    ekeys = _keys_from_scores(e[None, :], row[None, :], ok[None, :])
    top = tl.reshape(_topk_desc(ekeys, KPF), [KPF])
    least = tl.maximum(tl.min(key, axis=0), floor)  # min: KEY_NONE when fewer than KPC
    kth = tl.max(tl.where(tl.arange(0, KPF) == kf - 1, top, _KEY_NONE), axis=0)
    least_s, _ = _scores_from_keys(least)
    kth_s, _ = _scores_from_keys(kth)
    exact = (least == _KEY_NONE) | ((kth != _KEY_NONE) & (least_s < kth_s))
    tl.store(status_ptr, exact.to(tl.int32))
    return top, exact, kth


@triton.jit
def _final_topk(
    qid,
    cand_ptr,
    thr_ptr,
    slot_ptr,
    surv_ptr,
    ids_ptr,
    q_ptr,
    scores_ptr,
    out_ids_ptr,
    NCAND,
    k,
    stride_q,
    stride_os,
    stride_oi,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KP: tl.constexpr,
    SURV: tl.constexpr,
    CHUNK: tl.constexpr,
    METRIC: tl.constexpr,
    SELECT: tl.constexpr,
    FRESH: tl.constexpr,
    RSTRIDE,
    REPL: tl.constexpr,
):
    # The final top-k of query qid from its candidates (see merge_topk), decoded and written.
    key, _, _, _ = _select_top(
        qid, cand_ptr, thr_ptr, slot_ptr, surv_ptr, NCAND, k, KP, KP, SURV, CHUNK, SELECT,
        FRESH, KP, cand_ptr, 0, RSTRIDE, REPL,
    )  # fmt: skip
    _write_top(
        qid, key, ids_ptr, q_ptr, scores_ptr, out_ids_ptr, k, stride_q, stride_os, stride_oi,
        D, BLOCK_D, KP, METRIC,
    )  # fmt: skip


@triton.jit
def _select_top(
    qid,
    cand_ptr,
    thr_ptr,
    slot_ptr,
    surv_ptr,
    NCAND,
    kg,
    GW: tl.constexpr,
    KP: tl.constexpr,
    SURV: tl.constexpr,
    CHUNK: tl.constexpr,
    SELECT: tl.constexpr,
    FRESH: tl.constexpr,
    LIST: tl.constexpr,
    trace_ptr,  # TRACE: the last program's row of scan_topk's trace
    TRACE: tl.constexpr,
    RSTRIDE,  # the replicas of thr and slots (ScanConfig.bound_replicas): read the first, reset all
    REPL: tl.constexpr,
):
    # -> ([KP] the top-KP keys of query qid's candidates, sorted descending, KEY_NONE padded;
    # the final bound, every key skipped or not a survivor at most it; the survivors counted;
    # the largest last key over the programs' sorted lists of LIST keys, in the same pass).
    # kg: the group bests in the state's slots (width GW).
    # FRESH: the state and candidates were written by other programs of this same launch
    # (the fused scan's last program): read them past this multiprocessor's L1 (volatile).
    kk = tl.arange(0, KP)
    base = cand_ptr + qid.to(tl.int64) * NCAND
    if SELECT:
        # The scan has finished: nothing writes thr or the group bests while this runs, so
        # every thread reads the same bound, and it is at most the true k-th key.
        thr = tl.load(thr_ptr + qid, volatile=FRESH)
        gg = tl.arange(0, GW)
        best = tl.load(slot_ptr + qid * GW + gg, mask=gg < kg, other=_KEY_MAX, volatile=FRESH)
        bound = tl.maximum(thr, tl.min(best, axis=0))
        # Survivors: the candidates >= bound (every true top-k key is one), compacted into
        # surv by a prefix sum over the candidates (no atomics, no order assumed).
        offs = tl.arange(0, CHUNK)
        sbase = surv_ptr + qid.to(tl.int64) * SURV
        total = 0
        lists_last = bound * 0 + _KEY_NONE
        for c0 in range(0, NCAND, CHUNK):
            c = tl.load(base + c0 + offs, mask=c0 + offs < NCAND, other=_KEY_NONE, volatile=FRESH)
            live = ((c >= bound) & (c != _KEY_NONE)).to(tl.int32)
            pos = total + tl.cumsum(live, axis=0) - 1
            tl.store(sbase + pos, c, mask=(live != 0) & (pos < SURV))
            total += tl.sum(live, axis=0)
            ends = tl.where((c0 + offs) % LIST == LIST - 1, c, _KEY_NONE)
            lists_last = tl.maximum(lists_last, tl.max(ends, axis=0))
        # the survivors stored above are read below by other threads of this program; and
        # every thread has read thr and the group bests before they are reset further down
        tl.debug_barrier()
        if TRACE != 0:
            tl.store(trace_ptr + 5, _clock(total, TRACE))
        if total <= SURV:  # the usual case: sort the few survivors
            so = tl.arange(0, SURV)
            sv = tl.load(sbase + so, mask=so < total, other=_KEY_NONE)
            top = _topk_desc(sv[None, :], KP)
        else:  # too many (weak bound): every program's list
            c = tl.load(base + offs, mask=offs < NCAND, other=_KEY_NONE, volatile=FRESH)
            top = _topk_desc(c[None, :], KP)
            for c0 in range(CHUNK, NCAND, CHUNK):
                c = tl.load(
                    base + c0 + offs, mask=c0 + offs < NCAND, other=_KEY_NONE, volatile=FRESH
                )
                top = _merge_desc(top, _topk_desc(c[None, :], KP))
        key = tl.reshape(top, [KP])
        if TRACE != 0:
            tl.store(trace_ptr + 6, _clock(total, TRACE))
        # reset the search state for the next search (a captured graph needs no reset node)
        row = tl.arange(0, REPL) * RSTRIDE + qid  # every replica
        tl.store(thr_ptr + row, tl.full([REPL], _KEY_NONE, tl.int64))
        tl.store(
            slot_ptr + row[:, None] * GW + gg[None, :], tl.full([REPL, GW], _KEY_NONE, tl.int64)
        )
    else:
        key = tl.load(base + kk, mask=kk < NCAND, other=_KEY_NONE)
        bound = qid.to(tl.int64) * 0 + _KEY_NONE
        total = qid * 0
        lists_last = bound
    return key, bound, total, lists_last


@triton.jit
def _write_top(
    qid,
    key,
    ids_ptr,
    q_ptr,
    scores_ptr,
    out_ids_ptr,
    k,
    stride_q,
    stride_os,
    stride_oi,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KP: tl.constexpr,
    METRIC: tl.constexpr,
):
    # key: [KP] sorted descending -> the first k as (score, id) in the metric's terms
    kk = tl.arange(0, KP)
    s, row = _scores_from_keys(key)
    ok = key != _KEY_NONE
    ids = tl.load(ids_ptr + row, mask=ok, other=-1)
    if METRIC == 2:
        dc = tl.arange(0, BLOCK_D)
        qrow = tl.load(q_ptr + qid * stride_q + dc, mask=dc < D, other=0.0).to(tl.float32)
        d = tl.maximum(tl.sum(qrow * qrow, axis=0) - s, 0.0)
        s = tl.where(ok, d, float("inf"))
    else:
        s = tl.where(ok, s, float("-inf"))
    wm = kk < k
    tl.store(scores_ptr + qid * stride_os + kk, s, mask=wm)
    tl.store(out_ids_ptr + qid * stride_oi + kk, ids, mask=wm)


@triton.jit(do_not_specialize=_MERGE_DYNAMIC)
def _merge_topk_kernel(
    cand_ptr,  # cand: [nq, NCAND] int64 keys (SELECT) or [nq, NCAND] sorted keys (not SELECT)
    thr_ptr,  # thr: [REPL * RSTRIDE] int64, read then reset to KEY_NONE here (when SELECT)
    slot_ptr,  # slots: [REPL * RSTRIDE, KP] int64, read then reset to KEY_NONE (when SELECT)
    surv_ptr,  # surv: [nq, SURV] int64 scratch: the candidates at or above the bound (SELECT)
    ids_ptr,  # ids: [cap] int64, row -> id
    q_ptr,  # q: [nq, D] (read for METRIC == 2: |q|^2)
    scores_ptr,  # out scores: [nq, k] fp32, row stride stride_os
    out_ids_ptr,  # out ids: [nq, k] int64, row stride stride_oi
    NCAND,
    k,
    stride_q,
    stride_os,
    stride_oi,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KP: tl.constexpr,
    SURV: tl.constexpr,
    CHUNK: tl.constexpr,
    METRIC: tl.constexpr,
    SELECT: tl.constexpr,
    RSTRIDE,
    REPL: tl.constexpr,
):
    _final_topk(
        tl.program_id(0), cand_ptr, thr_ptr, slot_ptr, surv_ptr, ids_ptr, q_ptr, scores_ptr,
        out_ids_ptr, NCAND, k, stride_q, stride_os, stride_oi, D, BLOCK_D, KP, SURV, CHUNK,
        METRIC, SELECT, False, RSTRIDE, REPL,
    )  # fmt: skip


@triton.jit(do_not_specialize=_KEYS_DYNAMIC)
def _score_keys_kernel(
    db_ptr,  # db: [cap, D]
    sq_ptr,  # sqnorms: [cap] fp32
    scope_ptr,  # scopes: [3, cap] int64
    filt_ptr,  # filter: [3] int64
    q_ptr,  # q: [nq, D]
    n_ptr,  # n: [1] int32
    keys_ptr,  # keys: [nq, cap] int64 out; KEY_NONE for rows >= n or filtered out
    nq,
    cap,
    stride_q,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    METRIC: tl.constexpr,
    SCOPED: tl.constexpr,
    PREC: tl.constexpr,
    DOT_F32: tl.constexpr,
    BQS: tl.constexpr,  # the queries a program scores (BLOCK_Q, or half of it when SPLIT)
    SPLIT: tl.constexpr,
):
    # grid: (cdiv(cap, BLOCK_N),) -- covers the capacity, so a captured graph stays valid
    t = tl.program_id(0)
    n = tl.load(n_ptr)
    q = _load_queries(q_ptr, stride_q, nq, D, BLOCK_D, BLOCK_Q, METRIC, BQS if SPLIT else 0)
    qT = _dot_operand(q, db_ptr.dtype.element_ty, BQS, SPLIT)
    qs = tl.arange(0, BQS)
    rows = t * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < n
    s = _tile_scores(
        db_ptr,
        sq_ptr,
        rows,
        rmask,
        qT,
        qT,
        D,
        BLOCK_D,
        BLOCK_Q,
        BQS,
        True,
        METRIC,
        PREC,
        DOT_F32,
        SPLIT,
    )
    if SCOPED:  # noqa: SIM108 - a constexpr branch
        valid = _scope_mask(scope_ptr, filt_ptr, rows, rmask, cap)
    else:
        valid = rmask
    keys = _keys_from_scores(s, rows[None, :], valid[None, :] & (qs[:, None] < nq))
    out = keys_ptr + qs[:, None].to(tl.int64) * cap + rows[None, :]
    tl.store(out, keys, mask=(qs[:, None] < nq) & (rows[None, :] < cap))


# ----------------------------------------------------------------------------------- launchers


class ScanConfig:
    """Launch shape of ``scan_topk``; ``choose_config`` picks one per (dim, dtype, batch, k).

    block_n: rows per tile; num_warps / num_stages: Triton's; use_dot: score with tensor cores
    (``tl.dot``) rather than FMAs; skip: the published-threshold skip (off only for experiments);
    programs_per_sm: persistent programs per multiprocessor (the grid is fixed by capacity);
    fused: a single query's final top-k is selected by the scan's last program rather than by a
    second launch (``merge_topk``); bound_replicas: copies of the scan's bounds (a power of
    two; ``scan_topk``'s state), replica r read in a program's r-th round of tiles; lanes: the
    queries a batch's selection works on at least (a power of two; the lanes past the batch
    are masked out): the next power of two of the batch when larger.
    """

    __slots__ = (
        "block_n", "bound_replicas", "fused", "lanes", "num_stages", "num_warps",
        "programs_per_sm", "skip", "use_dot",
    )  # fmt: skip

    def __init__(
        self,
        block_n: int = 128,
        num_warps: int = 4,
        num_stages: int = 3,
        use_dot: bool = True,
        skip: bool = True,
        programs_per_sm: int = 2,
        fused: bool = True,
        bound_replicas: int = 1,
        lanes: int = 1,
    ) -> None:
        if lanes < 1 or lanes & (lanes - 1) or lanes > MAX_BATCH:
            raise ValueError(f"lanes must be a power of two up to {MAX_BATCH}, not {lanes}")
        self.block_n = block_n
        self.lanes = lanes
        self.bound_replicas = bound_replicas
        self.fused = fused
        self.num_warps = num_warps
        self.num_stages = num_stages
        self.use_dot = use_dot
        self.skip = skip
        self.programs_per_sm = programs_per_sm

    def __repr__(self) -> str:
        return (
            f"ScanConfig(block_n={self.block_n}, num_warps={self.num_warps}, "
            f"num_stages={self.num_stages}, use_dot={self.use_dot}, skip={self.skip}, "
            f"programs_per_sm={self.programs_per_sm}, fused={self.fused}, "
            f"bound_replicas={self.bound_replicas}, lanes={self.lanes})"
        )

    def replace(self, **changes: Any) -> ScanConfig:
        """A copy with ``changes`` (a probe's or a test's variant of a tuned shape)."""
        fields = {name: getattr(self, name) for name in self.__slots__}
        return ScanConfig(**{**fields, **changes})


# The fast path keeps a top-KP list per program and sorts tiles of >= KP rows; above these KP
# (or when such a tile would pass 64 KB) the caller uses score_keys plus torch.topk instead.
FAST_MAX_KP_SINGLE = 256
FAST_MAX_KP_BATCH = 64
MAX_BATCH = 64  # queries per launch at most (fewer for wide rows: see max_batch)
BATCH_LANES = 8  # a batch's selection lanes at least, on a GPU (choose_config)
_TILE_BYTES_MAX = 64 * 1024


def _dot_f32(db) -> bool:
    """The interpreter's dot multiplies bf16 as raw uint16: upcast there (tests only)."""
    return os.environ.get("TRITON_INTERPRET") == "1" and str(db.dtype) == "torch.bfloat16"


def next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def block_d(dim: int) -> int:
    return max(16, next_pow2(dim))


def block_q(nq: int) -> int:
    return max(16, next_pow2(nq))


def select_lanes(nq: int, cfg: ScanConfig) -> int:
    """BQS: the query lanes a scan of ``nq`` queries selects for (masked past ``nq``), up to
    the dot's width."""
    return min(max(next_pow2(nq), cfg.lanes), block_q(nq)) if nq > 1 else 1


# The largest dot operand [BLOCK_D, BLOCK_Q] (elements) that dot_lanes doubles for the split:
# a batch of 16 at 384 dims (512 x 32); beyond, the operand crowds the tile's registers
SPLIT_MAX_OPERAND = 16384


def dot_lanes(nq: int, bqs: int, dim: int, elem_bytes: int, use_dot: bool) -> tuple[int, bool]:
    """(BLOCK_Q, SPLIT) of a scan whose dot scores ``bqs`` query lanes. Rows of 16 bits take
    the query in their type as the dot's operand, which moves a score by up to 2^-11 of
    |q| |x| (fp16; 2^-8 bf16): enough to order near-ties of real text otherwise than the
    fp32 query does, as a single query's FMAs score it. SPLIT: the lanes from ``bqs`` on
    score each query's low half (_dot_operand), so that a batch ranks as its members alone
    do. Free where the dot's 16 lanes leave room (a batch of up to 8); where the operand
    must double, only up to SPLIT_MAX_OPERAND (16 queries at 384 dims, 64 at 128). Wider
    batches would score the rounded query, so none reaches this scan (ranks_by_fp32): they
    take batch_topk's two passes, whose second pass scores the fp32 query, and score_keys
    scores them in groups of split_batch."""
    bq = block_q(nq)
    if not use_dot or elem_bytes != 2:
        return bq, False
    if 2 * bqs <= bq:
        return bq, True
    if 2 * bqs * block_d(dim) <= SPLIT_MAX_OPERAND:
        return 2 * bqs, True
    return bq, False


def ranks_by_fp32(nq: int, cfg: ScanConfig, dim: int, elem_bytes: int) -> bool:
    """Whether the fused scan of a batch of ``nq`` under ``cfg`` scores each member by its
    fp32 query: rows of 32 bits, a single query (FMAs), or a batch whose dot takes the
    query's low half (dot_lanes)."""
    if elem_bytes != 2 or nq == 1:
        return True
    return dot_lanes(nq, select_lanes(nq, cfg), dim, elem_bytes, True)[1]


def split_batch(dim: int, elem_bytes: int) -> int:
    """The most queries one launch of score_keys (the general path) scores by their fp32
    queries: a power of two, all of them on rows of 32 bits."""
    if elem_bytes != 2:
        return MAX_BATCH
    nq = 1
    while nq < MAX_BATCH and dot_lanes(2 * nq, 2 * nq, dim, elem_bytes, True)[1]:
        nq *= 2
    return nq


def key_width(k: int) -> int:
    """KP: the per-program list length, a power of two >= k (and >= 2)."""
    return max(2, next_pow2(k))


def max_batch(dim: int, elem_bytes: int) -> int:
    """Queries per launch, so that the query tile [BLOCK_Q, BLOCK_D] stays within 64 KB."""
    row = block_d(dim) * elem_bytes
    return max(1, min(MAX_BATCH, _TILE_BYTES_MAX // row))


def fast_path_ok(nq: int, k: int, dim: int, elem_bytes: int) -> bool:
    kp = key_width(k)
    if kp > (FAST_MAX_KP_SINGLE if nq == 1 else FAST_MAX_KP_BATCH):
        return False
    return kp * block_d(dim) * elem_bytes <= _TILE_BYTES_MAX


def choose_config(dim: int, elem_bytes: int, nq: int, k: int, on_gpu: bool) -> ScanConfig:
    """Launch shape, from launch-shape sweeps on the H200: a single query scores with
    FMAs on 32 KB tiles (128 rows at dim 128, 16 at 768), 3 stages deep, 2 programs per SM
    (3 for narrow tiles); batches use tensor cores on ~32 KB tiles, 2 programs per SM, and
    select in at least 8 lanes (a batch of 2 to 4 selected in as many lanes took 1.6-3.6x as
    long as in 8, at 1M x 384 and 10M x 128 on an H200; 16 lanes were slower at 128 dims)."""
    row = block_d(dim) * elem_bytes
    kp = key_width(k)
    if not on_gpu:  # the interpreter: few, small programs
        return ScanConfig(
            block_n=max(kp, 64),
            num_warps=4,
            num_stages=1,
            use_dot=True,
            skip=True,
            programs_per_sm=4,
        )
    if nq == 1:
        use_dot = row > 2048  # a [16, 2048] fp16 tile would not fit the FMA path's registers
        bn = max(16, min(128, next_pow2(32768 // row)))
        pps = 2 if bn >= 128 else 3
    else:
        use_dot = True
        bn = max(16, min(64, next_pow2(32768 // row)))
        pps = 2
    bn = max(bn, kp)
    stages = max(1, min(3, (96 * 1024) // (bn * row)))
    lanes = 1 if nq == 1 else BATCH_LANES
    bqs = max(next_pow2(nq), lanes)
    warps = 4 if block_q(nq) <= 16 and bqs * bn <= 512 and kp < 64 and bn <= 128 else 8
    return ScanConfig(
        block_n=bn,
        num_warps=warps,
        num_stages=stages,
        use_dot=use_dot,
        skip=True,
        programs_per_sm=pps,
        lanes=lanes,
    )


# ---------------------------------------------------------------------- the int8 prefilter
# A single query's scan reads int8 codes (1 byte a dimension, plus 12 bytes of meta a row)
# instead of the stored rows, keeps the rows of highest score *bound*, and re-scores those
# exactly; the bound makes the result provably exact or says it is not (see scan_topk).

PREFILTER_MAX_K = 32  # above this the candidate lists grow past what pays
PREFILTER_MIN_DIM = 32  # an int8 dot operand needs K >= 32
# Where it pays (scripts/search_gpu_prefilter.py on the H200, search-gpu-prefilter-H200.json in
# bench/results): at 10M x 128 330.5 µs against the full scan's 570.6, at 1M x 128 58.5 against
# 74.3, at 300K 36.9 against 35.5 (no gain); above 256 dims the bound, which grows with the
# dimension, leaves too many searches unproven.
PREFILTER_MIN_ROWS = 1_000_000
PREFILTER_MAX_DIM = 256
# Relative slack of the bound: the fp32 rounding of the prefilter's dot product and of the
# exact score's (each at most ~D * 2^-24 of |q| |x| for D <= 2048), with room to spare.
PREFILTER_SLACK = 3e-4
PREFILTER_DOT = 2  # the scan's CODES: int8 tensor-core dot against an int8 query
PREFILTER_FMA = 1  # the codes upcast against the fp32 query


def prefilter_candidates(k: int) -> int:
    """Rows kept for the exact re-rank: a power of two >= 2k and >= 32."""
    return max(32, next_pow2(2 * k))


def prefilter_lists(keep: int, programs: int) -> int:
    """Each program's list of the prefilter's scan: a quarter of the rows kept (8 for k <= 16)
    once there are at least as many programs as rows kept, else all of them. Shorter lists cut
    the per-tile work, and the proof covers a row pushed off a list; with a program per kept
    row, a list of keep/4 overflows only when the best rows crowd into one program. At 1M x 128
    on the H200 (264 programs), keep 32: lists of 32 75.1 µs, of 16 63.0, of 8 58.5, every
    search proven (bench/results/search-gpu-prefilter-H200.json)."""
    return max(8, keep // 4) if programs >= keep else keep


def prefilter_ok(nq: int, k: int, dim: int) -> bool:
    """Whether a search of this shape can take the prefilter (one query, small k, a dim where
    it pays)."""
    return nq == 1 and 1 <= k <= PREFILTER_MAX_K and PREFILTER_MIN_DIM <= dim <= PREFILTER_MAX_DIM


def prefilter_meta(x: Any) -> tuple[Any, Any]:
    """The prefilter's form of stored rows ``x [n, D]`` (torch, any float dtype, the values
    exactly as stored): ``(codes [n, D] int8, meta [3, n] fp32)``.

    Row i is approximated by ``scale_i * codes_i`` (symmetric, ``scale_i = max|x_i| / 127``).
    For a query q, ``|q.x_i - q.(scale_i codes_i)| <= |q| * r_i`` with ``r_i`` the residual's
    norm, and against an int8 query ``q ~ s_q q8``, ``|q.x_i - s_q scale_i (q8.codes_i)| <=
    |q| r_i + |scale_i codes_i| |q - s_q q8|``. meta holds ``(scale, e1, e2)``: e1 = r_i and e2 =
    ``|scale_i codes_i|``, computed in float64, each raised by PREFILTER_SLACK of the row's norm
    (fp32 rounding of both scores) and rounded up into fp32."""
    import torch

    codes = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    meta = torch.empty((3, x.shape[0]), dtype=torch.float32, device=x.device)
    up = 1.0 + 2.0**-20
    for lo in range(0, x.shape[0], 1 << 18):  # float64 work space: 2 MB a dimension
        xd = x[lo : lo + (1 << 18)].double()
        amax = xd.abs().amax(dim=1)
        scale = (amax / 127.0).where(amax > 0, amax.new_ones(())).float()
        s = scale.double()[:, None]
        c = (xd / s).round().clamp(-127, 127)
        resid = (xd - c * s).norm(dim=1)
        cn = c.norm(dim=1) * s[:, 0]
        hi = lo + len(xd)
        codes[lo:hi] = c.to(torch.int8)
        meta[0, lo:hi] = scale
        meta[1, lo:hi] = ((resid + PREFILTER_SLACK * (cn + resid)) * up).float()
        meta[2, lo:hi] = (cn * (1.0 + PREFILTER_SLACK) * up).float()
    return codes, meta


def choose_prefilter_config(dim: int, on_gpu: bool, mode: int = PREFILTER_DOT) -> ScanConfig:
    """Launch shape of the prefilter's scan (int8 rows of ``dim`` bytes; measured in
    bench/results/search-gpu-prefilter-H200.json)."""
    if not on_gpu:
        return ScanConfig(block_n=64, num_warps=4, num_stages=1, use_dot=True, programs_per_sm=4)
    bn = max(64, min(256, next_pow2(32768 // block_d(dim))))
    stages = max(1, min(3, (96 * 1024) // (bn * block_d(dim))))
    return ScanConfig(
        block_n=bn,
        num_warps=4,  # 1M x 128: 58.5 µs against 72.6 with 8
        num_stages=stages,
        use_dot=mode == PREFILTER_DOT,
        programs_per_sm=2,
        # 16 copies of the bounds: one in L1 goes stale under the pipelined int8 loads, and
        # the programs on those multiprocessors merge every tile (traced: 1M 58.0 -> 51.0
        # µs, 10M 346.9 -> 329.3; the full fp16 scan does not gain, and loses at 10M)
        bound_replicas=16,
    )


def survivors_width(k: int) -> int:
    """SURV: room for the keys that pass the final bound (~50 for k = 10 at 1M-10M rows)."""
    return 16 * key_width(k)


# Candidates per step of the fused final top-k: the scan's program (4 warps) holds a step in
# registers, so smaller steps than merge_topk's own (8 warps, up to 8192). One step width for
# every grid: a constexpr that followed the candidates' count would make a variant of each
# class of program count, to compile at warm-up (the unfused scan never reads it); fewer
# candidates than a step only leave the step's tail masked.
FUSED_CHUNK = 2048


def merge_chunk(ncand: int, k: int) -> int:
    """Candidates per step of merge_topk (one step for up to 8192: ~500 programs at k <= 16)."""
    return max(key_width(k), min(8192, next_pow2(max(ncand, key_width(k)))))


_SKIP_MODE: str | None = None


def _skip_mode() -> str:
    """How the scan makes its skip decision uniform: "interp" (TRITON_INTERPRET: one thread a
    program, nothing to do), "ptx" (NVIDIA: bar.red.or), or "off" (another backend: no skip)."""
    global _SKIP_MODE
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "interp"
    if _SKIP_MODE is None:
        try:
            backend = triton.runtime.driver.active.get_current_target().backend
        except Exception:  # pragma: no cover - no driver
            backend = "unknown"
        _SKIP_MODE = "ptx" if backend == "cuda" else "off"
    return _SKIP_MODE


def scan_topk(
    db,
    sqnorms,
    scopes,
    filt,
    q,
    n_dev,
    state,
    cand,
    *,
    k: int,
    metric: int,
    scoped: bool,
    programs: int,
    cfg: ScanConfig,
    final: tuple | None = None,
    prefilter: tuple | None = None,
    publish: tuple | None = None,
    gate: Any = None,
    trace: Any = None,
    bounds4: tuple | None = None,
    cands: tuple | None = None,
    settle: tuple | None = None,
) -> bool:
    """Launch the fused scan.

    db: [cap, D] fp16 | bf16 | fp32; sqnorms: [cap] fp32; scopes: [3, cap] int64; filt: [3] int64;
    q: [nq, D] (unit stride in D); n_dev: [1] int32; state: (thr [>= nq] int64 KEY_NONE,
    slots [nq, KP] int64 KEY_NONE, surv [nq, SURV] int64 scratch), thr and slots reset by
    merge_topk; cand: [nq, programs, KP] int64, written. No host sync, no allocation.

    final: (ticket [1] int32 zero, ids, scores_out, ids_out) as for :func:`merge_topk`: for a
    single query with ``cfg.fused`` the scan's last program selects the final top-k into
    them (and resets the state and the ticket). Returns whether it did; if not, the caller
    runs merge_topk.

    prefilter: (codes [cap, D] int8, meta [3, cap] fp32, status [1] int32, mode 1 | 2, keep,
    lists: None, or the programs' list length when shorter than keep) to
    scan the int8 codes instead (see :func:`prefilter_meta`; mode 2 scores them with an int8
    dot, 1 with FMAs): the scan keeps the ``keep`` (> k) rows of highest score bound,
    the last program re-scores them from ``db`` and writes their exact top-k, and ``status``
    says whether that is provably the exact top-k of all rows (1) or not (0: see ``settle``).
    Needs ``final`` and one query; state and cand sized for ``keep``.

    publish (with ``prefilter``): (seq [1] int64 on the device, dest [1] int64 in host memory
    registered for the GPU): once the re-ranked top-k is proven, the last program makes its
    result stores visible to the host and then stores seq into dest (a release at system
    scope), so that a host waiting on dest may read the results without waiting for the
    stream. Unproven: dest is left alone. Needs :func:`publish_ok`.

    gate: None, or [1] int32 on the device, read first by every program: 0 there makes this
    launch scan no row and select, write and publish nothing (``server.doorbell``'s graph,
    whose first kernel decides whether the search runs at all).

    cfg.bound_replicas: copies of the bounds (a power of two): thr [replicas * m] and slots
    [replicas * m, KP] hold replica r of query q at row r * m + q (m >= nq); every merge raises
    every replica, a program reads replica r in its r-th round of tiles, and the selection
    resets them all.

    trace: None, or a [programs + 1, 8] int64 tensor that the kernel fills with where its time
    goes (a probe's: ``scripts/search_gpu_phases.py``). Row p < programs, program p: 0 its
    start, 1 the end of its scan, 2 tiles merged into its list, 3 tiles walked, 4 its end,
    5 its multiprocessor. Row programs, the fused last program: 0 the selection done, 1 the
    re-rank done (prefilter), 2 the results written (prefilter), 3 its program id, 4 the
    candidates that passed the final bound (prefilter), 5 the survivors compacted, 6 their
    top-k sorted (5 and 6: the selection's own steps, prefilter).
    Times are the GPU's global clock in ns (0 under the interpreter, which fills the counts).

    bounds4: (codes [NCH, cap, 32] uint8, meta [2, cap] fp32, upper [cap] fp32, qc, qf), the
    4-bit cascade's first pass (:mod:`kalos.index.kernels.codes4`): the scan reads the codes,
    writes every row's score upper bound into ``upper`` and raises the group bests in
    ``state`` with the rows' lower bounds (no lists: ``cand`` is left empty); no ``final``,
    one query. qc: the query's int8 parts as int32 words [NCH, 4, 8] (codes4.prep).

    cands: (rows [cap] int32, status [1] int32), the cascade's last pass: ``n_dev`` holds the
    count of candidate rows listed in ``rows``; the scan scores those exactly, its last
    program writes the top-k (``final``), sets status to 1, publishes (``publish``) and resets
    the count to 0.

    settle (with ``prefilter``): (upper [cap] fp32, floor [1] int64): the prefilter also writes
    every row's score upper bound into ``upper`` (-inf: filtered out) and the kf-th best
    exact key of its re-ranked rows into ``floor``: at least kf rows score that, so every row
    of the exact top-k has an upper bound at or above it. An unproven search settles from
    them (``codes4.emit`` over ``upper``, then the ``cands`` pass) instead of a full scan.
    """
    nq, dim = q.shape
    kf = k
    up = qc = qf = rows = floor = db
    nch = 1
    if bounds4 is not None:
        if final is not None or nq != 1 or prefilter is not None:
            raise ValueError("the 4-bit bounds pass runs unfused, for one query")
        codes, meta, up, qc, qf = bounds4
        codes = codes.view(qc.dtype)  # int32 words: [NCH, cap, 8]
        nch = codes.shape[0]
        status = db
        codes_mode = 4
        kp = key_width(k)
    elif prefilter is not None:
        if final is None or nq != 1 or not cfg.fused:
            raise ValueError("the int8 prefilter runs fused, for one query")
        codes, meta, status, codes_mode, k, lists = prefilter
        kp = key_width(lists or k)  # the programs' lists (shorter than k: see _rerank)
        if settle is not None:
            up, floor = settle
    elif settle is not None:
        raise ValueError("settle comes with the prefilter")
    else:
        codes = meta = status = db
        codes_mode = 0
        kp = key_width(k)
    if cands is not None:
        if final is None or nq != 1 or not cfg.fused or prefilter is not None:
            raise ValueError("the candidates' pass runs fused, for one query")
        rows, status = cands
    mode = _skip_mode()
    if publish is None:
        seq = dest = db
        publish_mode = 0
    elif (prefilter is None and cands is None) or mode == "off":
        raise ValueError("publish needs the prefilter, on an NVIDIA GPU or the interpreter")
    else:
        seq, dest = publish
        publish_mode = 2 if mode == "ptx" else 1
    replicas = cfg.bound_replicas
    if replicas < 1 or replicas & (replicas - 1) or state[0].shape[0] % replicas:
        raise ValueError(f"replicas must be a power of two dividing thr's rows, not {replicas}")
    if trace is not None and trace.shape != (programs + 1, 8):
        raise ValueError(f"trace must be [{programs + 1}, 8], not {list(trace.shape)}")
    kpc = key_width(k)
    bn = max(cfg.block_n, kp)
    use_dot = cfg.use_dot or nq > 1
    prec = "ieee" if db.dtype.itemsize == 4 else "tf32"
    bqs = select_lanes(nq, cfg)
    # the rows' scores through the dot (the codes' bounds take their own operand)
    bq, split = dot_lanes(nq, bqs, dim, db.dtype.itemsize, use_dot and codes_mode == 0)
    thr, slots, surv = state
    fused = final is not None and nq == 1 and cfg.fused
    if fused:
        assert final is not None
        ticket, ids, scores_out, ids_out = final
        stride_os, stride_oi = scores_out.stride(0), ids_out.stride(0)
    else:  # unused pointers
        ticket = ids = scores_out = ids_out = cand
        stride_os = stride_oi = 0
    launch(
        _scan_topk_kernel,
        (programs,),
        db,
        sqnorms,
        scopes,
        filt,
        q,
        n_dev,
        thr,
        slots,
        cand,
        ticket,
        surv,
        ids,
        scores_out,
        ids_out,
        codes,
        meta,
        status,
        seq,
        dest,
        db if gate is None else gate,
        db if trace is None else trace,
        up,
        qc,
        qf,
        rows,
        floor,
        thr.shape[0] // replicas,
        nq,
        k,
        kf,
        k,
        db.shape[0],
        q.stride(0),
        stride_os,
        stride_oi,
        D=dim,
        BLOCK_D=block_d(dim),
        BLOCK_N=bn,
        BLOCK_Q=bq,
        BQS=bqs,
        KP=kp,
        METRIC=metric,
        SCOPED=scoped,
        USE_DOT=use_dot,
        SKIP=cfg.skip and mode != "off",
        PREC=prec,
        DOT_F32=_dot_f32(db),
        SPLIT=split,
        NUM_STAGES=cfg.num_stages,
        CTA_OR=mode == "ptx",
        FUSED=fused,
        SURV=surv.shape[1],
        CHUNK=max(FUSED_CHUNK, kp, kpc),
        CODES=codes_mode,
        KPF=key_width(kf),
        KPC=kpc,
        GW=kpc,
        USE_THR=kp >= kpc,
        PUBLISH=publish_mode,
        GATED=gate is not None,
        TRACE=0 if trace is None else 2 if mode == "ptx" else 1,
        REPL=replicas,
        NCH=nch,
        CANDS=int(cands is not None),
        SETTLE=int(settle is not None),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return fused


def publish_ok() -> bool:
    """Whether :func:`scan_topk` can publish a sequence number (an NVIDIA GPU, whose fences
    it uses, or the interpreter)."""
    return _skip_mode() != "off"


def merge_topk(
    cand,
    state,
    ids,
    q,
    scores_out,
    ids_out,
    *,
    k: int,
    metric: int,
    select: bool,
    num_warps: int = 8,
    chunk: int | None = None,
    replicas: int = 1,
) -> None:
    """Final top-k per query, decoded to (score, id).

    cand: [nq, NCAND] int64 keys (any order when select, sorted descending otherwise);
    state: scan_topk's (thr, slots, surv); thr and slots are read and reset here when select;
    ids: [cap] int64; q: [nq, D]; scores_out: [nq, k] fp32 and ids_out: [nq, k] int64, unit
    stride in k. chunk: candidates per step (a power of two >= KP; tests). replicas: as for
    :func:`scan_topk` (every replica is reset). No host sync.
    """
    nq, ncand = cand.shape
    dim = q.shape[1]
    kp = key_width(k)
    if chunk is None:
        chunk = merge_chunk(ncand, k)
    thr, slots, surv = state
    launch(
        _merge_topk_kernel,
        (nq,),
        cand,
        thr,
        slots,
        surv,
        ids,
        q,
        scores_out,
        ids_out,
        ncand,
        k,
        q.stride(0),
        scores_out.stride(0),
        ids_out.stride(0),
        D=dim,
        BLOCK_D=block_d(dim),
        KP=kp,
        SURV=surv.shape[1],
        CHUNK=max(next_pow2(chunk), kp),
        METRIC=metric,
        SELECT=select,
        RSTRIDE=thr.shape[0] // replicas,
        REPL=replicas,
        num_warps=num_warps,
    )


def score_keys(
    db,
    sqnorms,
    scopes,
    filt,
    q,
    n_dev,
    keys,
    *,
    metric: int,
    scoped: bool,
    block_n: int = 64,
    num_warps: int = 4,
) -> None:
    """Every row's key for every query: keys [nq, cap] int64 (KEY_NONE past n or filtered)."""
    nq, dim = q.shape
    cap = db.shape[0]
    prec = "ieee" if db.dtype.itemsize == 4 else "tf32"
    bd = block_d(dim)
    bn = max(16, min(block_n, next_pow2(32768 // (bd * db.dtype.itemsize))))
    bqs = max(1, next_pow2(nq))
    bq, split = dot_lanes(nq, bqs, dim, db.dtype.itemsize, True)
    bqs = bqs if split else bq
    launch(
        _score_keys_kernel,
        (triton.cdiv(cap, bn),),
        db,
        sqnorms,
        scopes,
        filt,
        q,
        n_dev,
        keys,
        nq,
        cap,
        q.stride(0),
        D=dim,
        BLOCK_D=bd,
        BLOCK_N=bn,
        BLOCK_Q=bq,
        METRIC=metric,
        SCOPED=scoped,
        PREC=prec,
        DOT_F32=_dot_f32(db),
        BQS=bqs,
        SPLIT=split,
        num_warps=num_warps,
    )
