"""CUDA-only tests: marked ``gpu`` and skipped on machines without a CUDA device."""
