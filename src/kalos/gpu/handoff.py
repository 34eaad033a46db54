"""The client's side of the GPU handoff: a channel's GPU result buffer, mapped once.

At the handshake a cuda sidecar exports each channel's GPU buffer (CUDA IPC handle and
layout); :class:`GpuChannel` maps it into this process and exposes torch tensors over it:
``query`` (where a client may put GPU queries), ``ids`` and ``scores``, and ``tokens`` (a
recall's token ids). The sidecar writes a search's results (or a recall's token ids) there
and waits for its stream before publishing the response, so when the response arrives the
tensors hold the results: no copy and no extra synchronisation.
"""

from __future__ import annotations

import contextlib
from typing import Any

from kalos.gpu import driver


class GpuChannel:
    def __init__(self, desc: dict[str, Any]) -> None:
        import torch

        self.device = int(desc["device"])
        driver.ensure_context(self.device)
        self.ptr = driver.ipc_open(bytes.fromhex(desc["handle"]))
        dim = int(desc["dim"])
        self.max_queries = int(desc["max_queries"])
        self.max_hits = int(desc["max_hits"])
        self.query = driver.tensor_at(
            self.ptr + int(desc["query_offset"]), (self.max_queries, dim), torch.float32,
            self.device,
        )  # fmt: skip
        self.ids = driver.tensor_at(
            self.ptr + int(desc["ids_offset"]), (self.max_hits,), torch.int64, self.device
        )
        self.scores = driver.tensor_at(
            self.ptr + int(desc["scores_offset"]), (self.max_hits,), torch.float32, self.device
        )
        # A sidecar older than protocol 1.1 has no token slots: max_tokens 0.
        self.max_tokens = int(desc.get("max_tokens", 0))
        self.tokens = driver.tensor_at(
            self.ptr + int(desc.get("tokens_offset", 0)), (self.max_tokens,), torch.int32,
            self.device,
        )  # fmt: skip

    def close(self) -> None:
        if self.ptr:
            del self.query, self.ids, self.scores, self.tokens
            with contextlib.suppress(RuntimeError):  # the context may be gone at exit
                driver.ipc_close(self.ptr)
            self.ptr = 0
