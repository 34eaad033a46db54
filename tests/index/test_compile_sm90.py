"""The search kernels compile for an H100/H200 (sm_90) on this machine, no GPU needed: a kernel
the interpreter runs but Triton's compiler rejects fails in CI, not on the GPU host (the
variants and how: tests/compile_sm90.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")


def test_the_search_kernels_compile_for_sm90(tmp_path: Path) -> None:
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("this Triton has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")  # compiled here, whatever is cached
    script = Path(__file__).parents[1] / "compile_sm90.py"
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert "launches compiled for sm_90" in done.stdout
