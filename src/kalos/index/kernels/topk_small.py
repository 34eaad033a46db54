"""A small top-k of wide rows in few launches (``cuda:ivf``'s lists and its rows' top-k).

``torch.topk`` of one wide row with a small k runs as a radix select, then a sort: several
passes and launches, about 20-30 µs on the GPU hosts for the two top-ks of an IVF search. Here
each program takes a group of :data:`GROUP` values of one row and extracts its best k by k
rounds of max and arg-max in registers (sorted, ties to the lower index); the groups' k bests
are the next stage's row, until one group is left: two launches up to ``GROUP * GROUP / k``
values, and the result sorted, with its positions in the original row.

Slots past a row's width read as -inf. A row with fewer than k finite values gets -inf values
at the end (their positions are valid indices of the row, but not meaningful). Under
``TRITON_INTERPRET=1`` the kernel runs on CPU tensors (the tests).
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from kalos.index.kernels.precompile import launch

GROUP = 1024  # values a program ranks
MAX_K = 64  # the largest k taken here (beyond: torch.topk)


@triton.jit(do_not_specialize=("W", "K"))
def _group_topk_kernel(
    x_ptr,  # [B, W] fp32
    pos_ptr,  # [B, W] int64: each value's position in the original row (HAS_POS)
    vals_ptr,  # [B, G * K] fp32 out
    out_ptr,  # [B, G * K] int64 out: positions in the original row
    W,
    K,
    HAS_POS: tl.constexpr,
    GROUP: tl.constexpr,
    KP: tl.constexpr,
):
    g = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    width_out = tl.num_programs(0) * K
    offs = g * GROUP + tl.arange(0, GROUP)
    inside = offs < W
    v = tl.load(x_ptr + b * W + offs, mask=inside, other=float("-inf"))
    r = tl.arange(0, KP)
    best = tl.full([KP], float("-inf"), tl.float32)
    at = tl.zeros([KP], tl.int32)
    for j in range(K):
        m = tl.max(v, axis=0)
        i = tl.min(tl.where((v == m) & inside, offs, W), axis=0)
        i = tl.minimum(i, W - 1)  # a group of fewer than K values: a valid index, -inf
        best = tl.where(r == j, m, best)
        at = tl.where(r == j, i, at)
        v = tl.where(offs == i, float("-inf"), v)
    keep = r < K
    pos = at.to(tl.int64)
    if HAS_POS:
        pos = tl.load(pos_ptr + b * W + pos, mask=keep, other=0)
    tl.store(vals_ptr + b * width_out + g * K + r, best, mask=keep)
    tl.store(out_ptr + b * width_out + g * K + r, pos, mask=keep)


def topk_small(x: Any, k: int) -> tuple[Any, Any]:
    """``torch.topk(x, k, dim=1)`` of x [b, w] fp32 (values, positions int64; sorted, ties
    to the lower position), 1 <= k <= :data:`MAX_K`, k <= w: one launch per stage (module
    doc), no host sync."""
    import torch

    if not 1 <= k <= MAX_K or k > x.shape[1]:
        raise ValueError(f"topk_small takes 1 <= k <= min({MAX_K}, width), got k={k}")
    vals, pos = x.contiguous(), None
    kp = triton.next_power_of_2(k)
    while True:
        b, w = vals.shape
        groups = triton.cdiv(w, GROUP)
        out_v = torch.empty((b, groups * k), dtype=torch.float32, device=x.device)
        out_p = torch.empty((b, groups * k), dtype=torch.int64, device=x.device)
        launch(
            _group_topk_kernel, (groups, b), vals, vals if pos is None else pos, out_v, out_p,
            w, k, HAS_POS=pos is not None, GROUP=GROUP, KP=kp,
        )  # fmt: skip
        vals, pos = out_v, out_p
        if groups == 1:
            return vals, pos


def warm(device: Any) -> None:
    """Launches every variant :func:`topk_small` can take (each k's power of two, with and
    without positions) on scratch rows, so that none compiles during a search."""
    import torch

    x = torch.zeros((1, 2 * GROUP), dtype=torch.float32, device=device)
    kp = 1
    while kp <= MAX_K:
        topk_small(x, kp)  # two stages: without positions, then with
        kp *= 2


__all__ = ["GROUP", "MAX_K", "topk_small", "warm"]
