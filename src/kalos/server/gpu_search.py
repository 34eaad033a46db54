"""Searching a GPU-resident index from the sidecar: one CUDA graph per request shape.

A search on a ``cuda`` sidecar never moves the index: the query (a few hundred bytes) goes to
the GPU and the top-k comes back. Each (batch, k, filtered, destination) shape is captured
once as a CUDA graph that does, in one launch:

    host-result mode:  pinned query → device, fused scan + top-k, the merge writing the
                       top-k straight into pinned host memory
    GPU-result mode:   pinned query → device (or the client's GPU query, read in place),
                       scan + top-k, the merge writing into the channel's GPU result buffer

then the poller waits for the stream and publishes the response. In GPU-result mode nothing
of the results crosses PCIe: the client reads them as torch tensors over the channel's GPU
buffer, which it mapped once through CUDA IPC (:mod:`kalos.gpu.driver`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kalos.errors import ConfigError, InvalidRequest
from kalos.gpu import driver
from kalos.index.cuda_flat import CudaFlatIndex, SearchGraph

# Per-channel GPU result buffer: room for this many queries and hits (nq * k).
GPU_MAX_QUERIES = 64
GPU_MAX_HITS = 16384
GPU_MAX_TOKENS = 131072  # token ids of one GPU-result recall (int32: 512 KiB)
# Registered bytes at the start of each shm channel's response arena (PinnedArena): a SEARCH
# response of up to 64 x 1024 hits without payloads.
PINNED_BYTES = 1 << 20
_ALIGN = 256


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class GpuResultBuffer:
    """One channel's GPU memory: query slots, result ids and scores, recall token ids,
    exported by CUDA IPC.

    Layout (bytes, each part 256-aligned): ``query f32[GPU_MAX_QUERIES, dim]``,
    ``ids i64[GPU_MAX_HITS]``, ``scores f32[GPU_MAX_HITS]``, ``tokens i32[GPU_MAX_TOKENS]``.
    A result of nq x k fills the first nq*k entries of ids and scores, row-major; a recall of
    n token ids the first n tokens. ``staging``: pinned int32 host memory of at least
    GPU_MAX_TOKENS, shared by the buffers of one sidecar (dispatch is serial).
    """

    max_tokens = GPU_MAX_TOKENS

    def __init__(self, dim: int, device: int, staging: Any = None) -> None:
        import torch

        self.device = device
        self.dim = dim
        self.query_offset = 0
        self.ids_offset = _align(GPU_MAX_QUERIES * dim * 4)
        self.scores_offset = self.ids_offset + _align(GPU_MAX_HITS * 8)
        self.tokens_offset = self.scores_offset + _align(GPU_MAX_HITS * 4)
        self.nbytes = self.tokens_offset + _align(GPU_MAX_TOKENS * 4)
        if staging is None:
            staging = torch.zeros(GPU_MAX_TOKENS, dtype=torch.int32).pin_memory()
        self._token_staging = staging
        self._token_staging_mv = memoryview(staging.numpy()).cast("B")
        self.ptr = driver.mem_alloc(self.nbytes)
        self.handle = driver.ipc_handle(self.ptr)
        self.query = driver.tensor_at(self.ptr, (GPU_MAX_QUERIES, dim), torch.float32, device)
        self.ids = driver.tensor_at(
            self.ptr + self.ids_offset, (GPU_MAX_HITS,), torch.int64, device
        )
        self.scores = driver.tensor_at(
            self.ptr + self.scores_offset, (GPU_MAX_HITS,), torch.float32, device
        )
        self.tokens = driver.tensor_at(
            self.ptr + self.tokens_offset, (GPU_MAX_TOKENS,), torch.int32, device
        )
        self._stream = torch.cuda.current_stream
        self.graphs: dict[tuple[int, int, bool, bool], _DeviceResultGraph] = {}

    def describe(self) -> dict[str, Any]:
        """What the handshake tells the client so it can map this buffer."""
        return {
            "handle": self.handle.hex(),
            "device": self.device,
            "bytes": self.nbytes,
            "dim": self.dim,
            "max_queries": GPU_MAX_QUERIES,
            "max_hits": GPU_MAX_HITS,
            "query_offset": self.query_offset,
            "ids_offset": self.ids_offset,
            "scores_offset": self.scores_offset,
            "max_tokens": GPU_MAX_TOKENS,
            "tokens_offset": self.tokens_offset,
        }

    def write_tokens(self, pieces: Sequence[bytes | memoryview], n: int) -> None:
        """Copies a recall's token ids (int32 bytes, ``n`` ids in all, in order) into
        ``tokens[:n]``: gathered into pinned memory, one host-to-device copy, and the stream
        waited for, so they are complete when the response is published."""
        if n > GPU_MAX_TOKENS:
            raise InvalidRequest(f"{n} token ids exceed the {GPU_MAX_TOKENS} GPU token slots")
        mv = self._token_staging_mv
        pos = 0
        for piece in pieces:
            mv[pos : pos + len(piece)] = piece
            pos += len(piece)
        if n:
            self.tokens[:n].copy_(self._token_staging[:n], non_blocking=True)
            self._stream(self.device).synchronize()

    def free(self) -> None:
        self.graphs.clear()
        if self.ptr:
            driver.mem_free(self.ptr)
            self.ptr = 0


class _Inputs:
    """A graph's device copy of the staged request block (scope, then queries), moved by one
    memcpy node: ``scope`` [3] int64 and ``query`` [nq, dim] fp32 views of it."""

    def __init__(self, staging: Staging, nq: int, with_queries: bool) -> None:
        import torch

        self.src = staging.block[
            : staging.QUERY_OFFSET + (nq * staging.dim * 4 if with_queries else 0)
        ]
        self.block = torch.empty(len(self.src), dtype=torch.uint8, device=staging.device)
        self.scope = self.block[:24].view(torch.int64)
        self.query = (
            self.block[staging.QUERY_OFFSET :].view(torch.float32).view(nq, staging.dim)
            if with_queries
            else None
        )

    def copy(self) -> None:
        self.block.copy_(self.src, non_blocking=True)


class _HostResultGraph(SearchGraph):
    """Pinned request in, results in host memory out, the fused search in between: one graph
    launch.

    The scope and query go to the device in one memcpy node; the merge kernel writes the
    top-k straight into host memory (unified addressing), with no copy node back: into the
    channel's response arena when ``out`` lies in a :class:`PinnedArena`, else into the
    pinned staging buffers. Measured on the H200 (bench/search_gpu_overhead.py, replay + sync
    at 100K x 128): three copy nodes 38.7 µs; results written to pinned memory 30.4 µs.
    Letting the kernels read the query from pinned memory too was slower (37.1 µs): every
    program of the scan pulls it across PCIe before its first tile."""

    def __init__(self, index: CudaFlatIndex, nq: int, k: int, scoped: bool, staging: Staging,
                 out: tuple[np.ndarray, np.ndarray] | None = None) -> None:  # fmt: skip
        import torch

        self.inputs = _Inputs(staging, nq, True)
        m = nq * k
        if out is None:
            scores, ids = staging.scores[:m].view(nq, k), staging.ids[:m].view(nq, k)
        else:
            scores, ids = torch.from_numpy(out[0]), torch.from_numpy(out[1])
        super().__init__(index, nq, k, scoped, query=self.inputs.query, scope=self.inputs.scope,
                         scores=scores, ids=ids, prefilter=True)  # fmt: skip

    def _run(self, prefilter: bool = False) -> None:
        self.inputs.copy()
        super()._run(prefilter)


class PinnedArena:
    """A channel's response arena (its first ``nbytes``), page-locked and mapped for the GPU
    (``cuMemHostRegister``), so that a search's merge kernel writes the top-k straight into
    the response: no staging buffer, no encoding, no copy on the host.

    ``graphs`` holds this channel's search graphs, one per (batch, k, filtered), each writing
    at the fixed addresses of that shape's response (the protocol's layout for nq x k). The
    sidecar makes one per shm channel of a cuda sidecar and closes it, under the dispatch
    lock, before the channel's memory goes.
    """

    def __init__(self, buf: np.ndarray) -> None:
        self._buf = buf  # keeps the mapping alive while registered
        self.lo = int(buf.ctypes.data)
        self.hi = self.lo + len(buf)
        driver.host_register(self.lo, len(buf))
        self._registered = True
        self.graphs: dict[tuple[int, int, bool], _HostResultGraph] = {}

    def holds(self, arrays: tuple[np.ndarray, ...]) -> bool:
        """Whether every array lies inside the registered range."""
        for a in arrays:
            start = int(a.ctypes.data)
            if not (self.lo <= start and start + a.nbytes <= self.hi):
                return False
        return True

    def close(self) -> None:
        self.graphs.clear()
        if self._registered:
            self._registered = False
            driver.host_unregister(self.lo)


class _DeviceResultGraph(SearchGraph):
    """The request from pinned memory (one memcpy node; the scope alone when the query is
    read in place from the channel's GPU query slots); the top-k written straight into the
    channel's GPU buffer. No copy back."""

    def __init__(self, index: CudaFlatIndex, nq: int, k: int, scoped: bool, staging: Staging,
                 buffer: GpuResultBuffer, gpu_query: bool) -> None:  # fmt: skip
        self.inputs = _Inputs(staging, nq, not gpu_query)
        m = nq * k
        super().__init__(
            index, nq, k, scoped,
            query=buffer.query[:nq] if gpu_query else self.inputs.query,
            scope=self.inputs.scope,
            scores=buffer.scores[:m].view(nq, k),
            ids=buffer.ids[:m].view(nq, k),
            prefilter=True,
        )  # fmt: skip

    def _run(self, prefilter: bool = False) -> None:
        self.inputs.copy()
        super()._run(prefilter)


class Staging:
    """Pinned host memory the graphs copy from and write into (allocated once).

    ``block``: the request, scope ([3] int64 at 0) then queries ([max_batch, dim] fp32 at
    ``QUERY_OFFSET``), so that one copy moves both; ``scores`` and ``ids``: the top-k."""

    QUERY_OFFSET = 32

    def __init__(self, dim: int, max_batch: int, device: Any) -> None:
        import torch

        self.dim = dim
        self.device = device
        self.block = torch.zeros(self.QUERY_OFFSET + max_batch * dim * 4, dtype=torch.uint8)
        self.block = self.block.pin_memory()
        self.scores = torch.zeros(max_batch * 1024, dtype=torch.float32).pin_memory()
        self.ids = torch.zeros(max_batch * 1024, dtype=torch.int64).pin_memory()
        block = self.block.numpy()
        self.scope_np = block[:24].view(np.int64)
        self.query_np = block[self.QUERY_OFFSET :].view(np.float32).reshape(max_batch, dim)
        self.scores_np = self.scores.numpy()
        self.ids_np = self.ids.numpy()


class GpuSearch:
    """Serves searches on a :class:`CudaFlatIndex` through cached CUDA graphs."""

    def __init__(self, index: Any) -> None:
        import torch

        if not isinstance(index, CudaFlatIndex):
            raise ConfigError(f"a cuda sidecar needs a cuda index spec, not {index.spec!r}")
        self._torch = torch
        self.index = index
        self.device = index.device.index or 0
        driver.ensure_context(self.device)
        self.max_batch = min(index._max_batch, GPU_MAX_QUERIES)
        self.staging = Staging(index.dim, self.max_batch, index.device)
        # Recall token ids on their way into a channel's GPU buffer (dispatch is serial).
        self.token_staging = torch.zeros(GPU_MAX_TOKENS, dtype=torch.int32).pin_memory()
        # Replays run on torch's current stream, the one index adds and removes are queued
        # on, so a search always sees every write before it.
        self.stream = torch.cuda.current_stream(index.device)
        self._graphs: dict[tuple[int, int, bool], _HostResultGraph] = {}

    def new_result_buffer(self) -> GpuResultBuffer:
        """A GPU result buffer for a new channel (called from the listener's thread)."""
        driver.ensure_context(self.device)
        return GpuResultBuffer(self.index.dim, self.device, self.token_staging)

    def _stage(self, queries: np.ndarray | None, scope: tuple[int, int, int] | None) -> None:
        if queries is not None:
            self.staging.query_np[: len(queries)] = queries
        if scope is not None:  # an unfiltered graph does not read it
            self.staging.scope_np[:] = scope

    def pin(self, arena: np.ndarray) -> PinnedArena:
        """Registers the start of a channel's response arena (enough for the largest graph
        search's response) for in-place results; close it before the channel goes."""
        driver.ensure_context(self.device)
        return PinnedArena(arena[: min(len(arena), PINNED_BYTES)])

    def search(
        self,
        queries: np.ndarray,
        k: int,
        scope: tuple[int, int, int] | None,
        out: tuple[np.ndarray, np.ndarray] | None = None,
        pinned: PinnedArena | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Top-k into host memory: (scores [nq, k], ids [nq, k]).

        With ``out`` (scores f32 and ids i64 arrays, [nq, k]) the results land there, and
        ``out`` is returned: written by the merge kernel itself when ``out`` lies in
        ``pinned`` (a channel's registered response arena; the graph is cached there per
        shape, so ``out`` must be that shape's fixed place in it), else copied from staging.
        Without, views into pinned staging valid until the next search. Batches above the
        graph limit take the plain path."""
        nq = len(queries)
        if nq > self.max_batch or k > 1024:
            scores, ids = self.index.search(queries, k, scope=scope)
        else:
            key = (nq, k, scope is not None)
            graph = None
            if pinned is not None and out is not None:
                graph = pinned.graphs.get(key)
                if graph is None and pinned.holds(out):
                    graph = pinned.graphs[key] = _HostResultGraph(
                        self.index, nq, k, scope is not None, self.staging, out
                    )
            in_place = graph is not None
            if graph is None:
                graph = self._graphs.get(key)
                if graph is None:
                    graph = self._graphs[key] = _HostResultGraph(
                        self.index, nq, k, scope is not None, self.staging
                    )
            self._stage(queries, scope)
            graph.replay_and_wait(self.stream)
            if in_place:
                return out  # type: ignore[return-value]
            m = nq * k
            s = self.staging
            scores, ids = s.scores_np[:m].reshape(nq, k), s.ids_np[:m].reshape(nq, k)
        if out is None:
            return scores, ids
        out[0][...] = scores
        out[1][...] = ids
        return out

    def search_to_device(
        self,
        buffer: GpuResultBuffer,
        queries: np.ndarray | None,
        nq: int,
        k: int,
        scope: tuple[int, int, int] | None,
    ) -> None:
        """Top-k into the channel's GPU buffer; ``queries`` None: they are in its GPU slots.
        Returns once the results are complete in device memory."""
        key = (nq, k, scope is not None, queries is None)
        graph = buffer.graphs.get(key)
        if graph is None:
            graph = buffer.graphs[key] = _DeviceResultGraph(
                self.index, nq, k, scope is not None, self.staging, buffer, queries is None
            )
        self._stage(queries, scope)
        graph.replay_and_wait(self.stream)
