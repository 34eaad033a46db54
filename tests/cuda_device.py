"""The CUDA device for the ``gpu`` tests (tests/gpu): import this module first in such a test
module. It skips the importing module where torch, a CUDA device or triton is missing, and
exports ``torch``. CUDA is checked before triton is imported: without a device, the CPU
tests need triton's interpreter (tests/triton_interp.py), which must be chosen before the
first import.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")
