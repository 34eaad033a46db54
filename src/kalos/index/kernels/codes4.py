"""The 4-bit cascade: exact top-k that reads 4-bit codes of the rows instead of the rows.

Real text embeddings are anisotropic (a strong shared mean direction, a decaying spectrum),
clustered and near-duplicated: a compressed scan that assumes isotropic data leaves too many
rows unsettled on them. The cascade does not assume it. Each stored row ``x`` is centred on the
corpus mean ``mu`` and rotated by a fixed random orthogonal matrix ``R`` (``y = R (x - mu)``,
zero-padded to ``D4``, a multiple of 64): the rotation spreads the energy of the few strong
directions over every coordinate, so one scale a row quantises all of them well. ``y`` is
stored as 4-bit codes ``c`` (``y ~ scale * c``, ``c`` in -7..7) plus two floats: the scale and
the row's *width*, the norm of what the codes miss (with room for every rounding on the way).
For a query ``q``, ``q.x = q.mu + (R q).y``, so

    |q.x - (q.mu + scale * (R q).c)| <= |q| * width

and every row gets a lower and an upper bound of its exact score from 0.5 bytes a dimension
plus 8 bytes (1M x 384: 200 MB against the fp16 rows' 768 MB).

A search of one query is four launches, captured in one CUDA graph:

1. ``prep``: ``R q`` per 64-dimension chunk as two int8 parts (``qs_c * (hi + lo / 256)``),
   packed four to an int32 word (the operands of PTX ``dp4a``, a four-byte integer dot per
   instruction, against four nibbles of a code word at a time), and the query's scalars
   (``q.mu``, ``|q|``, the nibbles' offset).
2. The bounds pass (``scan_topk`` with ``bounds4``): every row's upper bound into ``upper``,
   and the scan's running bound of the k-th best *lower* bound (at least k rows score at or
   above it, so it is at most the exact k-th score).
3. ``emit``: the rows whose upper bound reaches that bound -- every row that can be in the
   top-k, however many -- compacted into a list (a prefix sum per block, one atomic add).
4. The exact pass (``scan_topk`` with ``cands``): those rows re-scored from the stored
   vectors, the fused top-k, the result written (and published, for the doorbell).

Nothing is replayed and nothing is guessed: the answer is the exact scan's. How many rows the
bounds leave open depends on the data; ``count`` in the workspace says how many, per search.

Under ``TRITON_INTERPRET=1`` every kernel runs on CPU tensors (the tests).
"""

from __future__ import annotations

import math
from typing import Any

import triton
import triton.language as tl

from kalos.index.kernels.precompile import launch
from kalos.index.kernels.scan_topk import (
    KEY_NONE,
    ScanConfig,
    block_d,
    key_width,
    next_pow2,
)

CHUNK = 64  # rotated dimensions a chunk: 32 bytes, two nibbles a byte
QF_FIXED = 4  # qf: [QF_FIXED + 2 NCH] fp32 = (q.mu, |q|, 0, 0, offsets[NCH], scales[NCH])
_KEY_NONE: tl.constexpr = tl.constexpr(KEY_NONE)
_QF_FIXED: tl.constexpr = tl.constexpr(QF_FIXED)
_KEY_MAX: tl.constexpr = tl.constexpr(2**63 - 1)
# Slack of the width, relative to |q| (|y^| + |x| + |mu|): fp32 rounding of the exact score
# (at most D * 2^-24 of |q| |x|, doubled for accumulation orders that truncate) and of the
# estimate's few products, with room to spare; the query's int8 rounding is added per D4.
_SLACK = 2e-5
_EMIT_BLOCK = 1024


def padded_dim(dim: int) -> int:
    """D4: the rotated width, a multiple of CHUNK."""
    return CHUNK * max(1, math.ceil(dim / CHUNK))


def rotation(dim: int, seed: int = 0x4B414C4F) -> Any:
    """A fixed random orthogonal matrix restricted to the row space: [D4, dim] float64 (torch,
    CPU), from the QR decomposition of a seeded Gaussian matrix (signs fixed by R's diagonal)."""
    import torch

    d4 = padded_dim(dim)
    gen = torch.Generator().manual_seed(seed + dim)
    a = torch.randn((d4, d4), generator=gen, dtype=torch.float64)
    qm, r = torch.linalg.qr(a)
    qm = qm * torch.sign(torch.diagonal(r))[None, :]
    return qm[:, :dim].contiguous()


def query_slack(d4: int) -> float:
    """Bound of |R q - (its int8 parts)| over |q|: each coordinate is off by at most
    qs_c * (1/512 + 1/256) (the low part's rounding, and its clamp at 127), qs_c <= |q| / 127."""
    return math.sqrt(d4) * 3.0 / (512.0 * 127.0)


def chunks(dim: int) -> int:
    """NCH: the rotated width's 64-dimension chunks."""
    return padded_dim(dim) // CHUNK


def encode(x: Any, mean: Any, rot: Any) -> tuple[Any, Any]:
    """4-bit codes of stored rows ``x [n, dim]`` (torch, the values exactly as stored):
    ``(codes [NCH, n, 32] uint8, meta [2, n] fp32)``; ``mean [dim]`` and ``rot [D4, dim]``
    float64 on x's device. Byte j of a row's chunk c holds rotated dimension 64c + j in its
    low nibble and 64c + 32 + j in its high one, each as code + 8 (chunk-major: a tile's
    chunk is one contiguous block).

    Per row, four scales ``amax / 7 * a`` (a = 1, 0.85, 0.7, 0.55: clipping the largest
    coordinates often leaves less error in all) are tried, and the one with the smallest
    residual norm kept. ``meta[1]`` (the width) is ``|y - scale c| + (slack + query_slack) *
    (|scale c| + |x| + |mean|)``, computed in float64 and rounded up into fp32."""
    import torch

    n, dim = x.shape
    d4 = rot.shape[0]
    nch = d4 // CHUNK
    codes = torch.empty((nch, n, 32), dtype=torch.uint8, device=x.device)
    meta = torch.empty((2, n), dtype=torch.float32, device=x.device)
    slack = _SLACK + dim * 2.0**-22 + query_slack(d4)
    mean_norm = float(mean.norm())
    up = 1.0 + 2.0**-20
    step = max(1, (1 << 24) // d4)  # rows a step: float64 work space of ~128 MB
    for lo in range(0, n, step):
        xd = x[lo : lo + step].double()
        y = (xd - mean[None, :]) @ rot.T  # [m, D4]
        amax = y.abs().amax(dim=1)
        # the first scale, then each of the others where it leaves less error
        best_s = torch.where(amax > 0, amax / 7.0, torch.ones_like(amax)).float().double()
        best_c = (y / best_s[:, None]).round().clamp(-7, 7)
        best_err = (y - best_c * best_s[:, None]).norm(dim=1)
        for a in (0.85, 0.7, 0.55):
            s = torch.where(amax > 0, amax * (a / 7.0), torch.ones_like(amax)).float().double()
            c = (y / s[:, None]).round().clamp(-7, 7)
            err = (y - c * s[:, None]).norm(dim=1)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_c = torch.where(better[:, None], c, best_c)
            best_s = torch.where(better, s, best_s)
        yhat = (best_c * best_s[:, None]).norm(dim=1)
        width = best_err + slack * (yhat + xd.norm(dim=1) + mean_norm)
        nib = (best_c + 8).to(torch.uint8).view(-1, nch, 2, 32)  # [m, chunk, half, byte]
        hi = lo + len(xd)
        codes[:, lo:hi] = (nib[:, :, 0, :] | (nib[:, :, 1, :] << 4)).permute(1, 0, 2)
        meta[0, lo:hi] = best_s.float()
        meta[1, lo:hi] = (width * up).float()
    return codes, meta


# ------------------------------------------------------------------------------------ kernels


@triton.jit
def _prep_kernel(
    q_ptr,  # q: [nq, D] fp32, row stride stride_q
    rot_ptr,  # rot: [D4, D] fp32
    mean_ptr,  # mean: [D] fp32
    qc_ptr,  # out: [nq, NCH, 4, 8] int32, the int8 parts hi and lo four a word (see below)
    qf_ptr,  # out: [nq, QF_FIXED + 2 NCH] fp32
    gate_ptr,
    stride_q,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DB: tl.constexpr,
    NCH: tl.constexpr,
    METRIC: tl.constexpr,
    GATED: tl.constexpr,
):
    # grid: (NCH, nq): program (c, i) rotates query i onto chunk c's 64 dimensions and writes
    # their int8 parts, with a scale of the chunk's own
    c = tl.program_id(0)
    i = tl.program_id(1)
    q_ptr += i * stride_q
    qc_ptr += i * (NCH * 32)
    qf_ptr += i * (_QF_FIXED + 2 * NCH)
    go = 1
    if GATED:
        go = tl.load(gate_ptr)
    if go != 0:
        jj = tl.arange(0, 64)
        db = tl.arange(0, DB)
        y = tl.zeros([64], dtype=tl.float32)
        qq = 0.0
        qm = 0.0
        for d0 in tl.static_range(0, BLOCK_D, DB):
            dm = d0 + db < D
            qd = tl.load(q_ptr + d0 + db, mask=dm, other=0.0).to(tl.float32)
            r = tl.load(rot_ptr + (c * 64 + jj)[:, None] * D + d0 + db[None, :],
                        mask=dm[None, :], other=0.0)  # fmt: skip
            y += tl.sum(r * qd[None, :], axis=1)
            qq += tl.sum(qd * qd, axis=0)
            qm += tl.sum(qd * tl.load(mean_ptr + d0 + db, mask=dm, other=0.0), axis=0)
        nrm = tl.sqrt(qq)
        if METRIC == 1:  # the kernels search with the unit query
            inv = 1.0 / tl.where(nrm > 0, nrm, 1.0)
            y = y * inv
            qm = qm * inv
            nrm = nrm * inv
        amax = tl.max(tl.abs(y), axis=0)
        qs = tl.where(amax > 0, amax / 127.0, 1.0)
        hi = tl.minimum(tl.maximum(tl.floor(y / qs + 0.5), -127.0), 127.0)
        lo = tl.minimum(tl.maximum(tl.floor((y / qs - hi) * 256.0 + 0.5), -127.0), 127.0)
        # the codes are stored as c + 8: their dot with (hi + lo / 256) is 8 * sum off
        tl.store(qf_ptr + 4 + c, 8.0 * qs * (tl.sum(hi, axis=0) + tl.sum(lo, axis=0) / 256.0))
        tl.store(qf_ptr + 4 + NCH + c, qs)
        # four int8 a word, little-endian: words 0-7 the chunk's first 32 dims (they pair with
        # the low nibbles), 8-15 the next 32 (the high ones); hi's 16 words, then lo's
        sh = tl.arange(0, 4)[None, :] * 8
        hw = tl.sum((tl.reshape(hi.to(tl.int32), [16, 4]) & 0xFF) << sh, axis=1)
        lw = tl.sum((tl.reshape(lo.to(tl.int32), [16, 4]) & 0xFF) << sh, axis=1)
        tl.store(qc_ptr + c * 32 + tl.arange(0, 16), hw)
        tl.store(qc_ptr + c * 32 + 16 + tl.arange(0, 16), lw)
        if c == 0:
            tl.store(qf_ptr, qm)
            tl.store(qf_ptr + 1, nrm * (1.0 + 1e-5))


@triton.jit(do_not_specialize=("kg", "RSTRIDE"))
def _emit_kernel(
    up_ptr,  # upper: [cap] fp32, the bounds pass's
    n_ptr,  # n: [1] int32, live rows
    thr_ptr,  # the bounds pass's state: thr [REPL * RSTRIDE], slots [REPL * RSTRIDE, GW]
    slot_ptr,
    count_ptr,  # count: [1] int32, 0 at entry: candidates listed (reset by the exact pass)
    out_ptr,  # rows: [cap] int32, the candidates
    ticket_ptr,  # [1] int32, 0 at entry: the last program resets the bounds pass's state
    gate_ptr,
    kg,
    RSTRIDE,
    GW: tl.constexpr,
    BLOCK: tl.constexpr,
    REPL: tl.constexpr,
    GATED: tl.constexpr,
):
    # grid: (programs,), each program taking every programs-th block of BLOCK rows up to the
    # live count (a grid that does not grow with the capacity: behind a closed gate, as in
    # the doorbell's armed graph, the launch costs little even at 10M rows)
    pid = tl.program_id(0)
    go = 1
    if GATED:
        go = tl.load(gate_ptr)
    if go != 0:
        n = tl.load(n_ptr)
        gg = tl.arange(0, GW)
        thr = tl.load(thr_ptr)
        best = tl.load(slot_ptr + gg, mask=gg < kg, other=_KEY_MAX)
        bound = tl.maximum(thr, tl.min(best, axis=0))
        # the bound's score (its key's high half); no bound (fewer than k rows): all pass
        hi_bits = (bound >> 32).to(tl.int32)
        bits = tl.where(hi_bits >= 0, hi_bits, hi_bits ^ 0x7FFFFFFF)
        floor = tl.where(bound == _KEY_NONE, float("-inf"), bits.to(tl.float32, bitcast=True))
        for b in range(pid, tl.cdiv(n, BLOCK), tl.num_programs(0)):
            rows = b * BLOCK + tl.arange(0, BLOCK)
            m = rows < n
            up = tl.load(up_ptr + rows, mask=m, other=float("-inf"))
            live = (m & (up >= floor) & (up > float("-inf"))).to(tl.int32)
            total = tl.sum(live, axis=0)
            if total > 0:
                base = tl.atomic_add(count_ptr, total, sem="relaxed")
                pos = base + tl.cumsum(live, axis=0) - 1
                tl.store(out_ptr + pos, rows, mask=live != 0)
        # every program has read the bound before its ticket: the last one resets it
        tl.debug_barrier()
        ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
        if ticket == tl.num_programs(0) - 1:
            rr = tl.arange(0, REPL) * RSTRIDE
            tl.store(thr_ptr + rr, tl.full([REPL], _KEY_NONE, tl.int64))
            tl.store(slot_ptr + rr[:, None] * GW + gg[None, :],
                     tl.full([REPL, GW], _KEY_NONE, tl.int64))  # fmt: skip
            tl.store(ticket_ptr, 0)


# ---------------------------------------------------------------------------------- launchers


def choose_config(dim: int, on_gpu: bool) -> ScanConfig:
    """Launch shape of the bounds pass (NCH chunk loads of 32 bytes a row, a tile's in flight
    at once): 256-row tiles at 384 dims, 4 programs an SM."""
    if not on_gpu:
        return ScanConfig(block_n=64, num_warps=4, num_stages=1, use_dot=True, programs_per_sm=4)
    row = padded_dim(dim) // 2
    bn = max(64, min(256, next_pow2(32768 // row)))
    stages = max(1, min(3, (96 * 1024) // (bn * row)))
    return ScanConfig(
        block_n=bn,
        num_warps=4,
        num_stages=stages,
        use_dot=True,
        programs_per_sm=4,
        fused=False,
        bound_replicas=16,  # as the int8 prefilter's scan: its bounds stay fresh in L1
    )


def prep(q: Any, rot32: Any, mean32: Any, qc: Any, qf: Any, *, metric: int, gate: Any = None
         ) -> None:  # fmt: skip
    """The rotated queries' operands: q [nq, D] (unit stride in D) -> qc [nq, NCH, 4, 8]
    int32 (each query's int8 parts, four a word: scan_topk's _tile_bounds4), qf [nq, QF_FIXED
    + 2 NCH] fp32 (see the module doc); one query's may drop the leading axis."""
    nq, dim = q.shape
    nch = qc.shape[-3]
    launch(_prep_kernel, (nch, nq),
        q, rot32, mean32, qc, qf, q if gate is None else gate, q.stride(0),
        D=dim, BLOCK_D=block_d(dim), DB=min(block_d(dim), 128), NCH=nch, METRIC=metric,
        GATED=gate is not None, num_warps=4,
    )  # fmt: skip


def emit(upper: Any, n_dev: Any, state: Any, count: Any, rows: Any, ticket: Any, *, k: int,
         replicas: int, programs: int, gate: Any = None) -> None:  # fmt: skip
    """The candidates: rows whose upper bound reaches the bounds pass's bound, into ``rows``
    from ``count`` on; resets the bounds pass's ``state`` (thr, slots). At most
    ``programs`` programs (fewer where the capacity has fewer blocks of rows) share the
    live rows' blocks."""
    cap = upper.shape[0]
    thr, slots = state[0], state[1]
    grid = max(1, min(triton.cdiv(cap, _EMIT_BLOCK), programs))
    launch(_emit_kernel, (grid,),
        upper, n_dev, thr, slots, count, rows, ticket, n_dev if gate is None else gate,
        k, thr.shape[0] // replicas,
        GW=key_width(k), BLOCK=_EMIT_BLOCK, REPL=replicas, GATED=gate is not None,
        num_warps=4,
    )  # fmt: skip


@triton.jit
def _settle_gate_kernel(gate_ptr, status_ptr, open_ptr, tally_ptr, TALLY: tl.constexpr):
    # one program: open = gate open and the int8 prefilter's verdict (status[0]) unproven;
    # TALLY: after the settle it opened, count it and its candidates (status[1]) in tally
    if TALLY:
        if tl.load(open_ptr) != 0:
            tl.store(tally_ptr, tl.load(tally_ptr) + 1)
            tl.store(tally_ptr + 1, tl.load(tally_ptr + 1) + tl.load(status_ptr + 1).to(tl.int64))
    else:
        go = tl.load(gate_ptr) != 0
        tl.store(open_ptr, (go & (tl.load(status_ptr) == 0)).to(tl.int32))


def settle_gate(gate: Any, status: Any, open_: Any) -> None:
    """After an int8 prefilter's scan gated on ``gate`` ([1] int32 on the device): ``open_``
    ([1] int32 on the device) becomes 1 where the gate was open and the scan's verdict
    (``status[0]``, [2] int32, pinned host memory on a GPU) says unproven, else 0: the gate of
    the settle that follows it on the stream (the doorbell's armed graph, server.doorbell)."""
    launch(_settle_gate_kernel, (1,), gate, status, open_, open_, TALLY=False, num_warps=1)


def tally_settle(open_: Any, status: Any, tally: Any) -> None:
    """After the settle gated on ``open_`` (:func:`settle_gate`): where it ran, adds 1 and its
    candidates scored exactly (``status[1]``) to ``tally`` ([2] int64)."""
    launch(_settle_gate_kernel, (1,), open_, status, open_, tally, TALLY=True, num_warps=1)


__all__ = [
    "CHUNK", "choose_config", "chunks", "emit", "encode", "padded_dim", "prep", "rotation",
    "settle_gate", "tally_settle",
]  # fmt: skip
