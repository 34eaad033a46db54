"""Compiles the search kernels' main variants for an H100/H200 (sm_90) on a machine without a
GPU, through Triton's own JIT (``warmup``: the launch's specialisation, nothing runs): the
full fp16 scan (lists of 16 keys, and of 64 at 384 dims; batches of 16 through the tensor
cores, and the general path of k = 100), the int8 prefilter (proven, and
settled behind it), and the 4-bit cascade (plain, behind a gate that publishes, traced),
each with the PTX paths a GPU takes. A kernel that the interpreter runs but the compiler
rejects fails here, not on the GPU host.

Run as a script in a process of its own (tests/index/test_compile_sm90.py does): the kernels
must be Triton's compiled ones, not the interpreter's. Exits 1 if a variant fails.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

from kalos.index.kernels import precompile
from kalos.index.kernels import scan_topk as kern


class _Sm90Driver:
    """What the JIT asks of the active driver before it compiles: an H100's target, and a
    device and stream it does not use for a warm-up."""

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, *_: object) -> int:
        return 0


def _index(dim: int, scan: str):  # type: ignore[no-untyped-def]
    # the index's CPU guard wants the interpreter; the kernels are already imported compiled
    os.environ["TRITON_INTERPRET"] = "1"
    from kalos.index.cuda_flat import CudaFlatIndex

    idx = CudaFlatIndex(dim=dim, metric="ip", spec=f"cuda:flat,fp16,scan={scan}", device="cpu",
                        scan=scan)  # fmt: skip
    del os.environ["TRITON_INTERPRET"]
    idx._on_gpu = True  # a GPU's launch shapes: 132 multiprocessors
    idx._sms = 132
    rng = np.random.default_rng(0)
    n = 4096
    idx.add(rng.standard_normal((n, dim)).astype(np.float32), np.arange(n))
    idx.prefilter_min_rows = 0
    return idx


def _launches() -> list[tuple]:
    kern._SKIP_MODE = "ptx"  # the PTX paths (CTA-wide votes, the publish's fences)
    k = 10
    q = torch.zeros((1, 1))
    scores, ids = torch.empty((1, k)), torch.empty((1, k), dtype=torch.int64)
    gate = torch.ones(1, dtype=torch.int32)
    seq = torch.zeros(2, dtype=torch.int64)
    publish = (seq[:1], seq[1:])
    with precompile.recording() as noted:
        full = _index(128, "full")
        q = torch.zeros((1, 128))
        full._launch(q, k, full._no_filter, False, scores, ids, full._workspace(1, k))
        # lists of 64 keys (k = 33-64) on tiles of 64 rows (384 dims), whose fused path
        # Triton 3.9's layout inference once failed on (a plain max over a sorted list)
        wide = _index(384, "full")
        out64 = torch.empty((1, 64)), torch.empty((1, 64), dtype=torch.int64)
        wide._launch(torch.zeros((1, 384)), 64, wide._no_filter, False, *out64,
                     wide._workspace(1, 64))  # fmt: skip
        # batches through the tensor cores, the query's low half in lanes of their own
        # (dot_lanes): 4 queries at 384 dims (spare lanes) and 16 (the operand doubled); 16 at
        # 768 and 1536 dims (not split: two_pass_min_batch 0 only); and the general path (k
        # above the fused scan's)
        for dim, nq in ((384, 4), (384, 16), (768, 16), (1536, 16)):
            bat = _index(dim, "full")
            bat.two_pass_min_batch = 0
            outb = torch.empty((nq, k)), torch.empty((nq, k), dtype=torch.int64)
            bat._launch(torch.zeros((nq, dim)), k, bat._no_filter, False, *outb,
                        bat._workspace(nq, k))  # fmt: skip
        out100 = torch.empty((4, 100)), torch.empty((4, 100), dtype=torch.int64)
        bat._launch(torch.zeros((4, 1536)), 100, bat._no_filter, False, *out100,
                    bat._workspace(4, 100))  # fmt: skip
        gen = _index(384, "full")
        gen._launch(torch.zeros((4, 384)), 100, gen._no_filter, False, *out100,
                    gen._workspace(4, 100))  # fmt: skip
        # by default a batch of 16 at 768 dims takes the two passes (its fused scan would
        # round the query), and the general path scores 32 queries at 384 dims 16 at a time
        two = _index(768, "full")
        out16 = torch.empty((16, k)), torch.empty((16, k), dtype=torch.int64)
        two._launch(torch.zeros((16, 768)), k, two._no_filter, False, *out16,
                    two._workspace(16, k))  # fmt: skip
        out32 = torch.empty((32, 100)), torch.empty((32, 100), dtype=torch.int64)
        gen._launch(torch.zeros((32, 384)), 100, gen._no_filter, False, *out32,
                    gen._workspace(32, 100))  # fmt: skip
        pre = _index(128, "int8")
        ws = pre._workspace(1, k, private=True, prefilter=True)
        status = torch.zeros(1, dtype=torch.int32)
        pre._launch(q, k, pre._no_filter, False, scores, ids, ws, status, publish, gate)
        pre._launch_settle(q, k, pre._no_filter, scores, ids, ws, torch.zeros(2, dtype=torch.int32),
                           publish, gate)  # fmt: skip
        casc = _index(384, "4bit")
        q = torch.zeros((1, 384))
        ws = casc._workspace(1, k, private=True, prefilter=True)
        casc._launch(q, k, casc._no_filter, False, scores, ids, ws)
        casc._launch(q, k, casc._no_filter, False, scores, ids, ws, None, publish, gate)
        casc.trace = torch.zeros((ws["exact"]["programs"] + 1, 8), dtype=torch.int64)
        casc._launch(q, k, casc._no_filter, False, scores, ids, ws)
    return noted


def main() -> int:
    noted = _launches()
    driver.set_active(_Sm90Driver())
    failed = 0
    for kernel, args, kwargs in noted:
        name = kernel.fn.__name__
        try:
            kernel.warmup(*args, grid=(1,), **kwargs)
        except Exception as exc:  # every variant is tried; the first failure is not the only
            failed += 1
            print(f"{name}: {type(exc).__name__}: {str(exc)[-2000:]}", file=sys.stderr)
    print(f"{len(noted) - failed} of {len(noted)} launches compiled for sm_90")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
