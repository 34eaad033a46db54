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

In host-result mode through a channel's registered arena (:class:`PinnedArena`), a search
that takes the int8 prefilter is answered by the GPU itself: the sidecar writes the
response header before the launch and stages the response's sequence number beside the
query; once the kernel has proven its result it makes the results visible to the host and
stores that number into the channel's response sequence word. The client reads the answer
then, while the sidecar is still waiting for the stream; afterwards the poller only wakes a
parked client (see :meth:`PinnedArena.announce`). An unproven search settles in a second
graph (every row its bound leaves open, scored exactly: SearchGraph), which publishes the
same way.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kalos import _native
from kalos.errors import ConfigError, InvalidRequest
from kalos.gpu import driver
from kalos.index.cuda_flat import CudaFlatIndex, SearchGraph
from kalos.protocol import layout as L
from kalos.protocol.codes import ResponseFlag, Status

if TYPE_CHECKING:
    from kalos.server.doorbell import ArmedGraph, Doorbell

# Per-channel GPU result buffer: room for this many queries and hits (nq * k), token ids of
# one GPU-result recall (int32: 512 KiB); the protocol's layout owns them
GPU_MAX_QUERIES = L.GPU_MAX_QUERIES
GPU_MAX_HITS = L.GPU_MAX_HITS
GPU_MAX_TOKENS = L.GPU_MAX_TOKENS
# Registered bytes at the start of each shm channel's response arena (PinnedArena): a SEARCH
# response of up to 64 x 1024 hits without payloads.
PINNED_BYTES = 1 << 20
_ALIGN = 256
# Search graphs captured on the live index before readiness (GpuSearch.warm): one query, each
# of these k, with and without a scope filter.
WARM_K = (1, 10, 100)
_monotonic_ns = time.monotonic_ns
_OK = int(Status.OK)
_DEVICE_PUBLISHED = int(ResponseFlag.DEVICE_PUBLISHED)


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
    """A graph's device copy of the staged request block (scope, the response's sequence
    number, then queries), moved by one memcpy node: ``scope`` [3] int64, ``seq`` [1] int64
    and ``query`` [nq, dim] fp32 views of it."""

    def __init__(self, staging: Staging, nq: int, with_queries: bool) -> None:
        import torch

        self.src = staging.block[
            : staging.QUERY_OFFSET + (nq * staging.dim * 4 if with_queries else 0)
        ]
        self.block = torch.empty(len(self.src), dtype=torch.uint8, device=staging.device)
        self.scope = self.block[:24].view(torch.int64)
        self.seq = self.block[staging.SEQ_OFFSET : staging.SEQ_OFFSET + 8].view(torch.int64)
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
    pinned staging buffers. Measured on the H200 (host clocks around replay + sync
    at 100K x 128): three copy nodes 38.7 µs; results written to pinned memory 30.4 µs.
    Letting the kernels read the query from pinned memory too was slower (37.1 µs): every
    program of the scan pulls it across PCIe before its first tile."""

    def __init__(self, index: CudaFlatIndex, nq: int, k: int, scoped: bool, staging: Staging,
                 out: tuple[np.ndarray, np.ndarray] | None = None,
                 pinned: PinnedArena | None = None) -> None:  # fmt: skip
        import torch

        self.inputs = _Inputs(staging, nq, True)
        m = nq * k
        publish = None
        self.body_len = 0  # of the response, when the graph publishes it
        if out is None:
            scores, ids = staging.scores[:m].view(nq, k), staging.ids[:m].view(nq, k)
        else:
            scores, ids = torch.from_numpy(out[0]), torch.from_numpy(out[1])
            if pinned is not None and pinned.resp_seq is not None:
                publish = (self.inputs.seq, pinned.resp_seq)
                # the response body ends with the ids (protocol.messages.search_response_views)
                self.body_len = int(out[1].ctypes.data) + out[1].nbytes - pinned.lo
        super().__init__(index, nq, k, scoped, query=self.inputs.query, scope=self.inputs.scope,
                         scores=scores, ids=ids, prefilter=True, publish=publish)  # fmt: skip

    def _run(self, prefilter: bool = False, gate: Any = None) -> None:
        if gate is None:  # gated: the doorbell's kernel writes the query and sequence itself
            self.inputs.copy()
        super()._run(prefilter, gate)


class PinnedArena:
    """A channel's response arena (its first ``nbytes``), page-locked and mapped for the GPU
    (``cuMemHostRegister``), so that a search's merge kernel writes the top-k straight into
    the response: no staging buffer, no encoding, no copy on the host.

    With the channel's ``header`` page registered too, the prefilter's kernel publishes the
    response itself (the module doc): the poller calls :meth:`arm` before each request, the
    search :meth:`announce` before its launch, and the poller reads :attr:`published` after.

    ``graphs`` holds this channel's search graphs, one per (batch, k, filtered), each writing
    at the fixed addresses of that shape's response (the protocol's layout for nq x k). The
    sidecar makes one per shm channel of a cuda sidecar and closes it, under the dispatch
    lock, before the channel's memory goes.
    """

    def __init__(
        self,
        buf: np.ndarray,
        header: np.ndarray | None = None,
        request: np.ndarray | None = None,
        doorbell: Doorbell | None = None,
    ) -> None:
        self._buf = buf  # keeps the mappings alive while registered
        self._header = header
        self.lo = int(buf.ctypes.data)
        self.hi = self.lo + len(buf)
        self._registered: list[int] = []
        self.graphs: dict[tuple[int, int, bool], _HostResultGraph] = {}
        self.resp_seq: Any = None  # the response sequence word, for the kernel ([1] int64)
        self.resp_seq_addr = 0
        # The doorbell's (server.doorbell), with the header and the request arena registered
        # too: the request header words [5] int64 from REQ_SEQ, the request
        # arena's registered start (uint8), the response header words [6] int64 from RESP_SEQ.
        self.doorbell = doorbell if header is not None and request is not None else None
        self.request_words: Any = None
        self.request: Any = None
        self.response_words: Any = None
        self.last_graph: _HostResultGraph | None = None  # the last graph whose kernel published
        # the doorbell's, by (search graph, bytes of one query value on the wire)
        self.armed_graphs: dict[tuple[_HostResultGraph, int], ArmedGraph] = {}
        self._op_flags = (0, 0)
        self._body: np.ndarray | None = None
        try:
            driver.host_register(self.lo, len(buf))
            self._registered.append(self.lo)
            if header is not None:
                import torch

                driver.host_register(int(header.ctypes.data), len(header))
                self._registered.append(int(header.ctypes.data))
                word = header[L.RESP_SEQ : L.RESP_SEQ + 8].view(np.int64)
                self.resp_seq = torch.from_numpy(word)
                self.resp_seq_addr = int(word.ctypes.data)
                if self.doorbell is not None:
                    assert request is not None
                    # The whole arena: a range registered in part makes the driver refuse
                    # any copy from an array that straddles its end (e.g. an ADD's ids).
                    driver.host_register(int(request.ctypes.data), len(request))
                    self._registered.append(int(request.ctypes.data))
                    self.request = torch.from_numpy(request)
                    self.request_words = torch.from_numpy(
                        header[L.REQ_SEQ : L.REQ_SEQ + 40].view(np.int64)
                    )
                    self.response_words = torch.from_numpy(
                        header[L.RESP_SEQ : L.RESP_SEQ + 48].view(np.int64)
                    )
        except BaseException:
            self.close()
            raise
        # the request being served (arm): its sequence number, queue time and pickup time
        self._seq = 0
        self._queue_ns = 0
        self._picked = 0
        self.published = False  # the GPU published the last request's response

    def arm(self, seq: int, queue_ns: int, picked: int, op: int = 0, flags: int = 0,
            body: np.ndarray | None = None) -> None:  # fmt: skip
        """The poller, before dispatching request ``seq`` (picked up at monotonic ``picked``,
        ``queue_ns`` after its publish; ``op``, ``flags`` and ``body`` its own): what
        :meth:`announce` writes, and the doorbell's template."""
        self._seq = seq
        self._queue_ns = queue_ns
        self._picked = picked
        self._op_flags = (op, flags)
        self._body = body
        self.published = False

    def replay(self, graph: SearchGraph, body_len: int, seq_slot: np.ndarray, stream: Any) -> None:
        """Runs one of this channel's search graphs (``graph.replay_and_wait(stream)``),
        whose response body is ``body_len`` bytes. When the graph publishes (its
        ``publish`` is set), first :meth:`announce`; afterwards :attr:`published` says
        whether the kernel stored the armed request's sequence number."""
        armed = graph.publish is not None and self.announce(body_len, seq_slot)
        self.published = graph.replay_and_wait(stream) and armed
        if self.published:
            self.last_graph = graph  # type: ignore[assignment]

    def announce(self, body_len: int, seq_slot: np.ndarray) -> bool:
        """Before launching a graph that publishes (``SearchGraph.publish``): writes the
        response header the client will read (OK, DEVICE_PUBLISHED, ``body_len``, the queue
        time, the compute time so far, no write time) and stages the sequence number the
        kernel stores (``seq_slot``, [1] int64 in the staged request block). Returns whether
        the request was armed; if not (a search from outside the poller), stages the word's
        current value, so the kernel's store changes nothing."""
        seq = self._seq
        self._seq = 0  # one announce per arm
        if not seq:
            seq_slot[0] = _native.load_acquire(self.resp_seq_addr)
            return False
        door, body = self.doorbell, self._body
        if door is not None and body is not None:  # the client waits: its request stays put
            door.capture(self, self._op_flags[0], self._op_flags[1], body)
        assert self._header is not None  # a graph publishes only with the header registered
        L.RESP_FIELDS.pack_into(
            self._header, L.RESP_STATUS, _OK, _DEVICE_PUBLISHED, body_len, self._queue_ns,
            _monotonic_ns() - self._picked, 0,
        )  # fmt: skip
        seq_slot[0] = seq
        return True

    def holds(self, arrays: tuple[np.ndarray, ...]) -> bool:
        """Whether every array lies inside the registered range."""
        for a in arrays:
            start = int(a.ctypes.data)
            if not (self.lo <= start and start + a.nbytes <= self.hi):
                return False
        return True

    def close(self) -> None:
        for armed in self.armed_graphs.values():
            armed.close()
        self.armed_graphs.clear()
        self.last_graph = None
        self.graphs.clear()
        self.resp_seq = self.request = self.request_words = self.response_words = None
        while self._registered:
            driver.host_unregister(self._registered.pop())


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

    def _run(self, prefilter: bool = False, gate: Any = None) -> None:
        self.inputs.copy()
        super()._run(prefilter, gate)


class Staging:
    """Pinned host memory the graphs copy from and write into (allocated once).

    ``block``: the request, scope ([3] int64 at 0), the response's sequence number for a
    graph that publishes (int64 at ``SEQ_OFFSET``), then queries ([max_batch, dim] fp32 at
    ``QUERY_OFFSET``), so that one copy moves all three; ``scores`` and ``ids``: the top-k."""

    SEQ_OFFSET = 24
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
        self.seq_np = block[self.SEQ_OFFSET : self.QUERY_OFFSET].view(np.int64)
        self.query_np = block[self.QUERY_OFFSET :].view(np.float32).reshape(max_batch, dim)
        self.scores_np = self.scores.numpy()
        self.ids_np = self.ids.numpy()


class _Running:
    """A batch's search left running on the GPU (:meth:`GpuSearch.start`): call it for its
    (scores, ids); :meth:`land` waits for it and keeps a copy of them, before the staging's
    next use."""

    def __init__(self, owner: GpuSearch, launch: Any, nq: int, k: int) -> None:
        self._owner, self._launch, self._nq, self._k = owner, launch, nq, k
        self._result: tuple[np.ndarray, np.ndarray] | None = None

    def done(self) -> bool:
        """Whether the pass has finished (it does not wait)."""
        return self._result is not None or bool(self._launch.done())

    def land(self) -> None:
        try:
            if self._result is None:
                self._launch.wait()
                m, s = self._nq * self._k, self._owner.staging
                shape = (self._nq, self._k)
                self._result = (s.scores_np[:m].reshape(shape).copy(),
                                s.ids_np[:m].reshape(shape).copy())  # fmt: skip
        finally:  # a failed wait too: the staging's next user does not wait on it again
            if self._owner._running is self:
                self._owner._running = None

    def __call__(self) -> tuple[np.ndarray, np.ndarray]:
        self.land()
        assert self._result is not None
        return self._result


class GpuSearch:
    """Serves searches on a :class:`CudaFlatIndex` through cached CUDA graphs."""

    def __init__(self, index: Any, doorbell: bool = False) -> None:
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
        self._running: _Running | None = None  # a batch's search started and not waited for
        self._current_on: set[int] = set()  # threads that made the device's context current
        # The GPU's own pickup of a channel's next search (server.doorbell), where the kernel
        # can publish; None: every request goes through the sidecar.
        self.doorbell: Doorbell | None = None
        if doorbell and index._k.publish_ok():
            from kalos.server.doorbell import Doorbell, doorbell_ok

            if doorbell_ok():
                self.doorbell = Doorbell(index.device)

    @property
    def precompiled(self) -> dict[str, Any] | None:
        """What the last warm-up's parallel compile did (CudaFlatIndex.precompiled)."""
        return self.index.precompiled

    def warm(self, stop: Callable[[], bool] | None = None) -> float:
        """Before readiness: compiles (or loads from Triton's disk cache) every kernel a
        search can need (:meth:`CudaFlatIndex.warm`), captures the search graphs of the
        common shapes (:data:`WARM_K`) and those of the batches (each size bucket of up to
        :attr:`max_batch` queries, k up to 10, scoped or not) on the live index, and builds
        once, on a scratch channel, a graph that writes its response in place and publishes
        it, the doorbell's armed graph behind it and, on a GPU, the graphs of a GPU result
        buffer. A channel's own graphs of the common shapes are captured at its handshake
        (:meth:`prepare`); other shapes on first use (a capture, some ms: no compile).
        ``stop``: polled between steps; raises InterruptedError once true. Returns the
        seconds it took."""
        t0 = time.perf_counter()
        index = self.index
        index.warm(publish=True, gated=self.doorbell is not None, stop=stop)
        for scoped in (False, True):
            for k in WARM_K:
                if stop is not None and stop():
                    raise InterruptedError("stopped during the kernel warm-up")
                key = (1, k, scoped)
                graph = self._graphs.get(key)
                if graph is None:
                    graph = self._graphs[key] = _HostResultGraph(index, 1, k, scoped, self.staging)
                graph._ensure(graph.prefilter)  # the prefilter's part too, whatever n is
        # the batches' graphs (MemoryStore.batch's calls: each size bucket, k up to 10), so
        # that a loaded sidecar's first batches wait for no capture either
        for size in sorted({min(1 << i, self.max_batch) for i in range(1, 7)}):
            for scoped in (False, True):
                if stop is not None and stop():
                    raise InterruptedError("stopped during the kernel warm-up")
                key = (size, 10, scoped)
                if key not in self._graphs:
                    self._graphs[key] = _HostResultGraph(index, size, 10, scoped, self.staging)
        self._warm_channel()
        if index._on_gpu:
            buffer = self.new_result_buffer()
            try:
                for gpu_query in (False, True):
                    g = _DeviceResultGraph(index, 1, 10, False, self.staging, buffer, gpu_query)
                    g._ensure(g.prefilter)
            finally:
                self.stream.synchronize()  # the capture's runs wrote into the buffer
                buffer.free()
        return time.perf_counter() - t0

    def _warm_channel(self) -> None:
        from kalos.protocol import messages as M
        from kalos.server.channels import ServerChannel

        ch = ServerChannel(0, 0, L.MIN_ARENA_BYTES)
        try:
            pinned = self.pin(ch.resp_arena, ch.buf[: L.CHANNEL_HEADER_SIZE], ch.req_arena)
            try:
                _, scores, ids = M.search_response_views(ch.resp_arena, 1, 10)
                graph = _HostResultGraph(
                    self.index, 1, 10, False, self.staging, (scores, ids), pinned
                )
                graph._ensure(graph.prefilter)
                if self.doorbell is not None and graph.publish is not None:
                    self.doorbell.warm(pinned, graph)
            finally:
                if self.index._on_gpu:  # the capture's runs wrote into the registered arena
                    self.stream.synchronize()
                self.unpin(pinned)
        finally:
            ch.mem.close()
            os.close(ch.fd)

    def new_result_buffer(self) -> GpuResultBuffer:
        """A GPU result buffer for a new channel (called from the listener's thread)."""
        driver.ensure_context(self.device)
        return GpuResultBuffer(self.index.dim, self.device, self.token_staging)

    def _stage(self, queries: np.ndarray | None, scope: tuple[int, int, int] | None) -> None:
        if queries is not None:
            self.staging.query_np[: len(queries)] = queries
        if scope is not None:  # an unfiltered graph does not read it
            self.staging.scope_np[:] = scope

    def pin(
        self,
        arena: np.ndarray,
        header: np.ndarray | None = None,
        request: np.ndarray | None = None,
    ) -> PinnedArena:
        """Registers the start of a channel's response arena (enough for the largest graph
        search's response) for in-place results, and its ``header`` page (the channel's
        first ``layout.CHANNEL_HEADER_SIZE`` bytes) when given, for responses the GPU
        publishes; with its ``request`` arena too, the GPU may pick up the channel's searches
        (server.doorbell). Release it (:meth:`unpin`) before the channel goes."""
        driver.ensure_context(self.device)
        return PinnedArena(arena[: min(len(arena), PINNED_BYTES)], header, request, self.doorbell)

    def prepare(self, pinned: PinnedArena, arena: np.ndarray) -> None:
        """A new channel's own search graphs of the common shapes (one query, each k of
        :data:`WARM_K`, with and without a scope filter), captured now, at its handshake and
        under the dispatch lock, so that none of the channel's first searches waits for a
        capture (some ms each, every other channel's requests waiting behind it too); with
        the doorbell, the armed graph ahead of each that publishes too
        (:meth:`Doorbell.prepare`). Its other shapes are still captured on first use.
        ``arena``: the channel's response arena, whose start ``pinned`` registers. Cheap in
        GPU memory: the graphs' row-sized scratch is the index's one copy
        (``CudaFlatIndex._shared``)."""
        from kalos.protocol import messages as M

        # a capture runs its graph once: what a publishing kernel stores into the channel's
        # response word is that word's own value (no request of the channel is armed)
        if pinned.resp_seq_addr:
            self.staging.seq_np[0] = _native.load_acquire(pinned.resp_seq_addr)
        for scoped in (False, True):
            for k in WARM_K:
                key = (1, k, scoped)
                if key in pinned.graphs:
                    continue
                _, scores, ids = M.search_response_views(arena, 1, k)
                graph = _HostResultGraph(
                    self.index, 1, k, scoped, self.staging, (scores, ids), pinned
                )
                graph._ensure(graph.prefilter)
                pinned.graphs[key] = graph
        if self.index._on_gpu:  # the captures' runs wrote into the registered arena
            self.stream.synchronize()
        door = self.doorbell
        if door is not None and pinned.doorbell is not None:
            door.prepare(pinned, [g for g in pinned.graphs.values() if g.publish is not None])

    def unpin(self, pinned: PinnedArena) -> None:
        """Undoes :meth:`pin` (under the dispatch lock): nothing armed on it any more."""
        if self.doorbell is not None:
            self.doorbell.release(pinned)
        pinned.close()

    def settle(self) -> None:
        """Before other work on the GPU's stream (under the dispatch lock): no graph armed,
        no batch running."""
        if self._running is not None:
            self._running.land()
        if self.doorbell is not None:
            self.doorbell.settle()

    def _make_current(self) -> None:
        """The driver's graph launches need the device's context current on the calling
        thread (the poller, a gRPC worker, the listener): made so once a thread."""
        thread = threading.get_ident()
        if thread not in self._current_on:
            driver.ensure_context(self.device)
            self._current_on.add(thread)

    def start(
        self, queries: np.ndarray, k: int, scope: tuple[int, int, int] | None
    ) -> _Running | None:
        """:meth:`search` of a batch into host memory, launched and not waited for: returns
        what waits for it and gives (scores [nq, k], ids [nq, k]). None, with nothing
        launched, for a shape that cannot run ahead (a batch above the graph limit, one
        query's prefilter, the interpreter): call :meth:`search`. Until it is called,
        nothing else may change the index (the dispatch lock stays held); another search
        first waits for it, keeping its answer."""
        self.settle()
        nq = len(queries)
        if nq > self.max_batch or k > 1024:
            return None
        key = (nq, k, scope is not None)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = _HostResultGraph(
                self.index, nq, k, scope is not None, self.staging
            )
        self._make_current()
        self._stage(queries, scope)
        launch = graph.start(self.stream)
        if launch is None:
            return None
        self._running = _Running(self, launch, nq, k)
        return self._running

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
        if self._running is not None:
            self._running.land()
        nq = len(queries)
        if nq > self.max_batch or k > 1024:
            scores, ids = self.index.search(queries, k, scope=scope)
        else:
            self._make_current()
            key = (nq, k, scope is not None)
            graph = None
            if pinned is not None and out is not None:
                graph = pinned.graphs.get(key)
                if graph is None and pinned.holds(out):
                    graph = pinned.graphs[key] = _HostResultGraph(
                        self.index, nq, k, scope is not None, self.staging, out, pinned
                    )
            in_place = graph is not None
            if graph is None:
                graph = self._graphs.get(key)
                if graph is None:
                    graph = self._graphs[key] = _HostResultGraph(
                        self.index, nq, k, scope is not None, self.staging
                    )
            self._stage(queries, scope)
            if in_place:
                assert pinned is not None
                pinned.replay(graph, graph.body_len, self.staging.seq_np, self.stream)
                return out  # type: ignore[return-value]
            graph.replay_and_wait(self.stream)
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
        if self._running is not None:
            self._running.land()
        self._make_current()
        key = (nq, k, scope is not None, queries is None)
        graph = buffer.graphs.get(key)
        if graph is None:
            graph = buffer.graphs[key] = _DeviceResultGraph(
                self.index, nq, k, scope is not None, self.staging, buffer, queries is None
            )
        self._stage(queries, scope)
        graph.replay_and_wait(self.stream)
