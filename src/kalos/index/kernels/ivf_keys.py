"""The ranking keys of an IVF search's probed rows, in one launch (``cuda:ivf``).

The index keeps each list's rows contiguous (its main rows sorted by list), so the rows a
query probes are P runs of rows: with ``ends`` the cumulative sizes of its probed lists and
``base[s] = offsets[list s] - (ends[s] - size[s])``, its probed row j (j < ends[P-1]) lies in
run s, the first whose end exceeds j, at main row ``base[s] + j``.

:func:`ivf_keys` writes, for each query b and each j below a fixed width W, the ranking key of
that row (``q.x``, or ``q.x - |x|^2 / 2`` for l2, from the stored row in fp32) and the row;
slots past the query's own row count get -inf and row 0. A block of slots past the count
writes only that, so W may be a generous bound of the count: nothing in the launch depends on
the data, and a CUDA graph can hold it. In torch the same work is a searchsorted, a gather
that copies every probed row, a batched product and a mask: five launches and the copy.

Under ``TRITON_INTERPRET=1`` the kernel runs on CPU tensors (the tests).
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from kalos.index.kernels.precompile import launch

BLOCK_J = 64  # slots a program
BLOCK_P = 64  # probed lists compared at once when finding a slot's list


@triton.jit(do_not_specialize=("P", "W"))  # nprobe and the width vary: one variant for all
def _ivf_keys_kernel(
    q_ptr,  # [B, dim] fp32
    x_ptr,  # [N, dim] the stored rows (fp16, bf16 or fp32), row stride stride_x
    sq_ptr,  # [N] fp32 |x|^2 (read for l2 only)
    ends_ptr,  # [B, P] int64
    base_ptr,  # [B, P] int64
    keys_ptr,  # [B, W] fp32 out
    rows_ptr,  # [B, W] int64 out
    P,
    W,
    dim,
    stride_x,
    L2: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    j = pid * BLOCK_J + tl.arange(0, BLOCK_J)
    inside = j < W
    count = tl.load(ends_ptr + b * P + P - 1)
    if pid * BLOCK_J >= count:  # past the query's rows: only the padding
        tl.store(keys_ptr + b * W + j, float("-inf"), mask=inside)
        tl.store(rows_ptr + b * W + j, tl.zeros([BLOCK_J], tl.int64), mask=inside)
    else:
        valid = j < count
        slot = tl.zeros([BLOCK_J], tl.int32)
        for p0 in range(0, P, BLOCK_P):
            p = p0 + tl.arange(0, BLOCK_P)
            e = tl.load(ends_ptr + b * P + p, mask=p < P, other=2**62)
            slot += tl.sum((e[None, :] <= j[:, None]).to(tl.int32), axis=1)
        slot = tl.minimum(slot, P - 1)
        start = tl.load(base_ptr + b * P + slot, mask=valid, other=0)
        row = tl.where(valid, start + j, 0)
        acc = tl.zeros([BLOCK_J], tl.float32)
        for d0 in range(0, dim, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            dm = d < dim
            x = tl.load(
                x_ptr + row[:, None] * stride_x + d[None, :],
                mask=valid[:, None] & dm[None, :],
                other=0.0,
            ).to(tl.float32)
            qv = tl.load(q_ptr + b * dim + d, mask=dm, other=0.0)
            acc += tl.sum(x * qv[None, :], axis=1)
        if L2:
            acc -= 0.5 * tl.load(sq_ptr + row, mask=valid, other=0.0)
        tl.store(keys_ptr + b * W + j, tl.where(valid, acc, float("-inf")), mask=inside)
        tl.store(rows_ptr + b * W + j, row, mask=inside)


def block_d(dim: int) -> int:
    """The dimensions a program reads per step: 128, or the next power of two below it."""
    return min(128, triton.next_power_of_2(dim))


def ivf_keys(
    q: Any, x: Any, sq: Any, ends: Any, base: Any, width: int, l2: bool
) -> tuple[Any, Any]:
    """(keys [B, width] fp32, rows [B, width] int64) of queries q [B, dim] fp32 against the
    probed rows of ``ends``, ``base`` [B, P] int64 (module doc) among the stored rows x
    [N, dim] (``sq`` [N] fp32 ``|x|^2``, read for ``l2``); one launch, no host sync."""
    import torch

    nq, dim = q.shape
    keys = torch.empty((nq, width), dtype=torch.float32, device=q.device)
    rows = torch.empty((nq, width), dtype=torch.int64, device=q.device)
    grid = (triton.cdiv(width, BLOCK_J), nq)
    launch(
        _ivf_keys_kernel, grid, q, x, sq, ends, base, keys, rows, ends.shape[1], width, dim,
        x.stride(0), L2=l2, BLOCK_J=BLOCK_J, BLOCK_D=block_d(dim), BLOCK_P=BLOCK_P,
    )  # fmt: skip
    return keys, rows


__all__ = ["BLOCK_J", "block_d", "ivf_keys"]
