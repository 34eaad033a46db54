"""Triton kernels of the GPU index backends, and their launchers.

Importing this package imports triton; only the GPU backends import it, so that
``import kalos.index`` stays free of torch and triton. The fused scan's launcher is
``kalos.index.kernels.scan_topk.scan_topk`` (the submodule keeps the package attribute
``scan_topk``).
"""

from kalos.index.kernels.scan_topk import (
    KEY_NONE,
    MAX_BATCH,
    METRIC_COSINE,
    METRIC_IP,
    METRIC_L2,
    ScanConfig,
    block_d,
    choose_config,
    fast_path_ok,
    key_width,
    merge_topk,
    score_keys,
    survivors_width,
)

__all__ = [
    "KEY_NONE",
    "MAX_BATCH",
    "METRIC_COSINE",
    "METRIC_IP",
    "METRIC_L2",
    "ScanConfig",
    "block_d",
    "choose_config",
    "fast_path_ok",
    "key_width",
    "merge_topk",
    "score_keys",
    "survivors_width",
]
