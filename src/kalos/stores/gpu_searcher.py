"""What the stores ask of a cuda sidecar's GPU search: the :class:`GpuSearcher` protocol
(kalos.server.gpu_search.GpuSearch implements it; the stores import nothing of the
server's)."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np


class GpuSearcher(Protocol):
    """What the store and its dispatcher ask of a cuda sidecar's GPU search
    (kalos.server.gpu_search.GpuSearch, set by the sidecar): host results, GPU results into a
    channel's buffer and their batch limit, and settling the GPU before other work on it."""

    max_batch: int

    def settle(self) -> None: ...

    def search(self, queries: np.ndarray, k: int, scope: Any, out: Any = None,
               pinned: Any = None) -> tuple[np.ndarray, np.ndarray]: ...  # fmt: skip

    def search_to_device(self, buffer: Any, queries: np.ndarray | None, nq: int, k: int,
                         scope: Any) -> None: ...  # fmt: skip

    def start(self, queries: np.ndarray, k: int, scope: Any) -> Running | None: ...


class Running(Protocol):
    """A GPU search left running (GpuSearcher.start): call it for its (scores, ids)."""

    def __call__(self) -> tuple[np.ndarray, np.ndarray]: ...

    def done(self) -> bool: ...


__all__ = ["GpuSearcher", "Running"]
