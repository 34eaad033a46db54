"""Triton's interpreter for the CPU tests of the GPU kernels (CI has no GPU): import this
module before anything imports triton. It sets TRITON_INTERPRET=1, skips the importing test
module where torch, triton or the interpreter is missing, and makes the kernels interpreted
even when another test module imported them first, built for a GPU.
"""

from __future__ import annotations

import inspect
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import numpy as np
import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")
if not hasattr(triton.runtime, "interpreter"):  # not imported when triton was imported first
    import triton.runtime.interpreter

if not getattr(triton.runtime.interpreter, "_patch_lang_tensor", None):  # pragma: no cover
    pytest.skip("this triton has no interpreter", allow_module_level=True)


def _interpreter_numpy_compat() -> None:
    """Triton < 3.7's interpreter turns a loaded scalar (a 1-element array) into a range bound
    with int(array), which numpy >= 2.4 refuses; newer Triton squeezes first. Do the same."""
    interp = triton.runtime.interpreter
    if "squeeze" in inspect.getsource(interp._patch_lang_tensor):
        return
    original = interp._patch_lang_tensor

    def patched(tensor, scope):  # type: ignore[no-untyped-def]
        original(tensor, scope)
        scope.set_attr(
            tensor, "__index__", lambda self: int(np.asarray(self.handle.data).squeeze())
        )

    interp._patch_lang_tensor = patched


_interpreter_numpy_compat()


def _ensure_interpreted_kernels() -> None:
    """If another test imported the kernels before TRITON_INTERPRET was set, they were built
    for a GPU: import them again, now as interpreted functions."""
    import importlib
    import sys

    mod = sys.modules.get("kalos.index.kernels.scan_topk")
    if mod is None or isinstance(
        mod._scan_topk_kernel, triton.runtime.interpreter.InterpretedFunction
    ):
        return
    importlib.reload(mod)
    importlib.reload(sys.modules["kalos.index.kernels"])


_ensure_interpreted_kernels()
