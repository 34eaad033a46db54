"""A kernel around scan_topk's ``_dp4a`` alone, for tests/cuda_reference.py's check_dp4a
(imported by it lazily: importing this module imports triton)."""

from __future__ import annotations

import triton
import triton.language as tl

from kalos.index.kernels.scan_topk import _dp4a


@triton.jit
def dp4a_kernel(a_ptr, b_ptr, c_ptr, out_ptr, PTX: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    out = _dp4a(tl.load(a_ptr + i), tl.load(b_ptr + i), tl.load(c_ptr + i), PTX)
    tl.store(out_ptr + i, out)
