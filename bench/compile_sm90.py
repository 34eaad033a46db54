"""Compiles the GPU kernels for an H200 (sm_90) on a machine without a GPU, to catch what
only the CUDA backend rejects (inline PTX, Triton's lowering) before spending device time.

    env -u TRITON_INTERPRET PYTHONPATH=<triton 3.6> .venv/bin/python bench/compile_sm90.py

Compiles the doorbell's kernel (``kalos.server.doorbell``) and the int8 prefilter's fused
scan (``kalos.index.kernels.scan_topk``) with and without its gate, at the launch shape the
H200 takes (``choose_prefilter_config(128, on_gpu=True)``), and prints each one's cubin size
and shared memory. It needs a Triton whose CUDA backend carries ptxas; match the device's
version (3.6 there: ``pip install --target DIR triton==3.6.0``): the scan's helpers do not
build under Triton 3.9's constexpr rules. The scan's arguments are taken from a real launch
on the CPU (a stand-in catches the call); their values do not matter, only their types.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import kalos.index.kernels.scan_topk as st
from kalos.server import doorbell

TARGET = GPUTarget("cuda", 90, 32)
_TYPES = {torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64",
          torch.int32: "i32", torch.int8: "i8", torch.uint8: "u8"}  # fmt: skip


def compile_doorbell() -> None:
    sig = {name: "*i64" for name in ("req_ptr", "resp_ptr", "arm_ptr", "ctl_ptr", "seq_ptr")}
    sig.update(body_ptr="*u8", tmpl_ptr="*u8", query_ptr="*fp16", dest_ptr="*fp32",
               gate_ptr="*i32", trace_ptr="*i64")  # fmt: skip
    for trace in (False, True):
        consts = {"D": 128, "BLOCK_D": 128, "ESIZE": 2, "TMAX": doorbell.TEMPLATE_BYTES,
                  "GPU": True, "TRACE": trace}  # fmt: skip
        sig.update({name: "constexpr" for name in consts})
        k = triton.compile(ASTSource(fn=doorbell._doorbell_kernel, signature=sig,
                                     constexprs=consts),
                           target=TARGET, options={"num_warps": 1})  # fmt: skip
        print(
            f"doorbell (trace {trace}): cubin {len(k.asm['cubin'])} bytes, "
            f"shared {k.metadata.shared}"
        )


def compile_scan() -> None:
    kernel = st._scan_topk_kernel
    calls: list[tuple[tuple, dict]] = []

    class Catch:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((args, kwargs))

    st._scan_topk_kernel = Catch()
    os.environ["TRITON_INTERPRET"] = "1"  # a CudaFlatIndex on the CPU, for its launch
    try:
        from kalos.index.cuda_flat import CudaFlatIndex, SearchGraph

        index = CudaFlatIndex(dim=128, metric="ip", spec="cuda:flat,fp16", device="cpu",
                              dtype="fp16")  # fmt: skip
        rows = np.random.default_rng(0).standard_normal((2000, 128)).astype(np.float32)
        index.add(rows, np.arange(1, 2001))
        index.prefilter_min_rows = 0
        word = torch.zeros(1, dtype=torch.int64)
        graph = SearchGraph(index, 1, 10, False, prefilter=True, publish=(word, word.clone()))
        graph._ensure(True)
        graph._run(True, gate=torch.zeros(1, dtype=torch.int32))
    finally:
        st._scan_topk_kernel = kernel
        os.environ.pop("TRITON_INTERPRET", None)
    args, kwargs = calls[-1]
    sig: dict[str, str] = {}
    consts: dict = {}
    for name, value in zip(kernel.arg_names, args, strict=False):
        sig[name] = "*" + _TYPES[value.dtype] if isinstance(value, torch.Tensor) else "i32"
    for name, value in kwargs.items():
        if name not in ("num_warps", "num_stages"):
            consts[name] = value
            sig[name] = "constexpr"
    cfg = st.choose_prefilter_config(128, True)  # the H200's launch shape
    consts.update(CTA_OR=True, NUM_STAGES=cfg.num_stages, REPL=cfg.bound_replicas,
                  BLOCK_N=max(cfg.block_n, consts["KP"]))  # fmt: skip
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    for gated in (False, True):
        consts["GATED"] = gated
        src = ASTSource(fn=kernel, signature=sig, constexprs=dict(consts))
        k = triton.compile(src, target=TARGET, options=options)
        print(f"scan (prefilter, gated={gated}): cubin {len(k.asm['cubin'])} bytes, "
              f"shared {k.metadata.shared}")  # fmt: skip


if __name__ == "__main__":
    print(f"triton {triton.__version__}, target sm_{TARGET.arch}")
    compile_doorbell()
    compile_scan()
