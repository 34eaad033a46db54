"""The GPU's own pickup of a channel's next search: a graph armed before the request.

After the int8 prefilter's kernel has answered a search on a channel (it publishes the
response itself: :class:`~kalos.server.gpu_search.PinnedArena`), the sidecar launches that
search's graph again, *armed*: headed by a one-program kernel (``_doorbell_kernel``) that
watches the channel's request sequence word in registered host memory. When the client
publishes its next request, the GPU sees it ~1-2 µs later and checks it against the request
the sidecar validated last (its *template*):

- the same op, flags and body length, every body byte before the query equal (so the same k,
  dim, dtype and scope: the scope the device already holds), and no deadline closer than
  2 ms to its publish;
- a finite query.

Then it copies the query and the request's sequence number to the device, writes the response
header, and the graph's scan runs and publishes the response: no CPU between the client's
store and the scan. A search the int8 prefilter's scan cannot prove settles behind it in the
same graph, from the rows' bounds the scan left, gated on the scan's verdict
(``SearchGraph.queue_gated``), and publishes too; the 4-bit cascade settles every search in
its own pass. Anything else it *declines*, and its scan does nothing (its gate stays closed);
the sidecar serves that request as any other. The sidecar's CPU is off the request's
path; it keeps the books afterwards (:meth:`Doorbell.answer`), launching the next armed graph
as soon as the GPU has taken a request, so that it runs right after the scan.

Nothing else may use the GPU's stream while a graph is armed (the kernel would spin ahead of
it): every other GPU request first :meth:`Doorbell.settle`\\ s, which cancels the armed graph
(a word the kernel polls) and waits for it. The kernel also gives up by itself after
``budget_us`` (the poller then arms it again). What the GPU took before a cancel is recorded
and answered for (:meth:`Doorbell.answer`). Only the poller arms.

Under Triton's interpreter (the CPU tests) an armed graph runs when the sidecar settles or
answers, reading the words once: the order of events is the one the GPU sees.
"""

from __future__ import annotations

import logging
import struct
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import triton
import triton.language as tl

from kalos import _native
from kalos.index.kernels.scan_topk import (
    _clock,
    _fence_sys,
    _skip_mode,
    _store_release_sys,
)
from kalos.protocol import codes
from kalos.protocol.codes import ResponseFlag, Status

if TYPE_CHECKING:
    from kalos.server.gpu_search import PinnedArena, _HostResultGraph

# The request's body before its query that a template holds: a SEARCH's 16-byte head and its
# scope's names. A request with a longer prefix is never armed for.
TEMPLATE_BYTES = 512
BUDGET_US = 2000.0  # an armed kernel gives up after this long without a request
VERDICT_WAIT_NS = 1_000_000  # the poller waits this long for the GPU's verdict, then cancels
# The GPU takes a request with a deadline only when it lies at least this long after the
# request's publish (it picks requests up within µs; the poller cancels after VERDICT_WAIT_NS).
DEADLINE_LEAD_NS: tl.constexpr = tl.constexpr(2_000_000)

# The verdict word: seq << 2 | code.
TAKEN = 1  # the request matched: the scan runs (and publishes once proven)
DECLINED = 2  # a request came that did not match: nothing ran
IDLE = 3  # cancelled, or the budget ran out: no request taken

# The arm block: int64 words, then the template's bytes (copied to the device by the graph).
_ARMED_SEQ, _BUDGET, _OP_FLAGS, _BODY_LEN, _QUERY_AT, _STATUS_FLAGS, _RESP_LEN = range(7)
_ARM_WORDS = 8
_SEARCH_HEAD = struct.Struct("<IIII")  # nq, k, dim, dtype
_PUBLISHED_FLAGS = int(ResponseFlag.DEVICE_PUBLISHED | ResponseFlag.DEVICE_DOORBELL)
_load = _native.load_acquire
log = logging.getLogger("kalos.server")


@triton.jit
def _load_sys(ptr, ACQUIRE: tl.constexpr):
    # one int64 from host memory the CPU writes, past every cache: an acquire (the sequence
    # word: what the client wrote before it is visible after) or a relaxed load at system scope
    if ACQUIRE:
        return tl.inline_asm_elementwise(
            "ld.acquire.sys.global.b64 $0, [$1];", "=l,l", [ptr], dtype=tl.int64,
            is_pure=False, pack=1,
        )  # fmt: skip
    else:
        return tl.inline_asm_elementwise(
            "ld.relaxed.sys.global.b64 $0, [$1];", "=l,l", [ptr], dtype=tl.int64,
            is_pure=False, pack=1,
        )  # fmt: skip


@triton.jit
def _doorbell_kernel(
    req_ptr,  # [5] int64: the channel's request header (REQ_SEQ onwards), registered
    body_ptr,  # uint8: the channel's request arena, registered
    query_ptr,  # the same arena as the query's wire type (fp16 | fp32)
    resp_ptr,  # [6] int64: the channel's response header (RESP_SEQ onwards), registered
    arm_ptr,  # [_ARM_WORDS] int64 on the device: the arm block (see Doorbell)
    tmpl_ptr,  # [TEMPLATE_BYTES] uint8 on the device: the template's body bytes
    ctl_ptr,  # [2] int64, pinned host: cancel (the sidecar writes), verdict (this kernel writes)
    seq_ptr,  # [1] int64 on the device: the staged sequence number the scan publishes
    dest_ptr,  # [D] fp32 on the device: the staged query the scan reads
    gate_ptr,  # [1] int32 on the device: the scan's gate
    trace_ptr,  # with TRACE: [8] int64 on the device, the step times (scripts/doorbell_latency.py)
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ESIZE: tl.constexpr,  # bytes of one query value on the wire
    TMAX: tl.constexpr,  # TEMPLATE_BYTES
    GPU: tl.constexpr,  # False under the interpreter: read each word once, plain stores
    TRACE: tl.constexpr = False,  # GPU only: %globaltimer after each step into trace_ptr
):
    armed = tl.load(arm_ptr + 0)  # the channel's last request: wait for a newer one
    if GPU:
        budget = tl.load(arm_ptr + 1)
        seq = _load_sys(req_ptr, True)
        cancel = _load_sys(ctl_ptr, False)
        start = _clock(cancel.to(tl.int32), 2)
        now = start
        polls = start * 0
        while (seq == armed) & (cancel == 0) & (now - start < budget):
            seq = _load_sys(req_ptr, True)
            cancel = _load_sys(ctl_ptr, False)
            now = _clock(cancel.to(tl.int32), 2)
            if TRACE:
                polls += 1
        op_flags = _load_sys(req_ptr + 1, False)
        body_len = _load_sys(req_ptr + 2, False)
        published = _load_sys(req_ptr + 3, False)
        deadline = _load_sys(req_ptr + 4, False)
        if TRACE:  # [start, seen, header read, body read, fenced, polls]: each after its data
            tl.store(trace_ptr + 0, start)
            tl.store(trace_ptr + 1, _clock(seq.to(tl.int32), 2))
            tl.store(
                trace_ptr + 2, _clock((op_flags + body_len + published + deadline).to(tl.int32), 2)
            )
            tl.store(trace_ptr + 5, polls)
    else:
        seq = tl.load(req_ptr)
        op_flags = tl.load(req_ptr + 1)
        body_len = tl.load(req_ptr + 2)
        published = tl.load(req_ptr + 3)
        deadline = tl.load(req_ptr + 4)
    taken = seq != armed
    ok = taken & (op_flags == tl.load(arm_ptr + 2)) & (body_len == tl.load(arm_ptr + 3))
    # a deadline the GPU's pickup (µs after the publish) cannot miss; the GPU has no clock of
    # the host's, so a shorter one goes to the sidecar, which checks it
    ok = ok & ((deadline == 0) | (deadline - published >= DEADLINE_LEAD_NS))
    # The query's byte offset in the body (a multiple of 8: Doorbell.capture). Only for a
    # request like the template: the body's head in 8-byte words and the query, ordinary
    # loads (after the acquire above they see what the client wrote) issued together, one
    # PCIe round trip (byte-wise volatile loads took ~25 µs on the H200).
    at = tl.load(arm_ptr + 4).to(tl.int32)
    w = tl.arange(0, TMAX // 8)
    d = tl.arange(0, BLOCK_D)
    q = tl.zeros([BLOCK_D], tl.float32)
    if ok:
        wm = w * 8 < at
        got = tl.load(body_ptr.to(tl.pointer_type(tl.int64)) + w, mask=wm, other=0)
        want = tl.load(tmpl_ptr.to(tl.pointer_type(tl.int64)) + w, mask=wm, other=0)
        ok = tl.sum((got != want).to(tl.int32), axis=0) == 0
        q = tl.load(query_ptr + at // ESIZE + d, mask=d < D, other=0.0).to(tl.float32)
    dm = d < tl.where(ok, D, 0)
    bad = tl.sum((dm & ~(tl.abs(q) <= 3.4028234663852886e38)).to(tl.int32), axis=0)  # NaN, inf
    ok = ok & (bad == 0)
    if TRACE:
        tl.store(trace_ptr + 3, _clock(ok.to(tl.int32), 2))
    tl.store(dest_ptr + d, q, mask=d < tl.where(ok, D, 0))
    tl.store(seq_ptr, seq, mask=ok)
    tl.store(gate_ptr, ok.to(tl.int32))
    # the response header the client reads once the scan publishes: written first, and made
    # visible to the host before the verdict (so before the scan, which starts after this)
    zero = seq * 0
    tl.store(resp_ptr + 1, tl.load(arm_ptr + 5), mask=ok)  # status, flags
    tl.store(resp_ptr + 2, tl.load(arm_ptr + 6), mask=ok)  # body length
    tl.store(resp_ptr + 3, zero, mask=ok)  # queue: no sidecar between client and GPU
    tl.store(resp_ptr + 4, zero, mask=ok)  # compute (the GPU's time is the client's share)
    tl.store(resp_ptr + 5, zero, mask=ok)  # write
    code = tl.where(ok, 1, tl.where(taken, 2, 3))  # TAKEN, DECLINED, IDLE
    verdict = seq * 4 + code
    if GPU:
        done = _fence_sys(ok.to(tl.int32) * 0 + 1)
        if TRACE:
            tl.store(trace_ptr + 4, _clock(done, 2))
        tl.debug_barrier()
        _store_release_sys(ctl_ptr + 1, verdict, done)
    else:
        tl.store(ctl_ptr + 1, verdict)


def doorbell_ok() -> bool:
    """Whether the GPU can take requests itself here: an NVIDIA GPU (the kernel's PTX), or the
    interpreter (the CPU tests)."""
    return _skip_mode() != "off"


class ArmedGraph:
    """One channel's search graph with the doorbell kernel ahead of it, for one wire dtype of
    the query: :meth:`work` queues (or, under the interpreter, does) the whole armed search:
    the arm block to the device, the doorbell kernel, the gated scan; on a GPU it is captured
    once as a CUDA graph, which :attr:`launch` launches."""

    def __init__(self, door: Doorbell, pinned: PinnedArena, graph: _HostResultGraph,
                 esize: int) -> None:  # fmt: skip
        import torch

        self.graph = graph
        self.generation = graph.index._generation
        dtype = torch.float16 if esize == 2 else torch.float32
        self._args = (
            pinned.request_words,
            pinned.request,
            pinned.request.view(dtype),
            pinned.response_words,
            door.arm_dev,
            door.template_dev,
            door.ctl,
            graph.inputs.seq,
            graph.inputs.query[0],  # type: ignore[index]
            door.gate,
            door.gate,  # the trace pointer: unused (TRACE off)
        )
        dim = graph.index.dim
        self._meta = {
            "D": dim,
            "BLOCK_D": triton.next_power_of_2(dim),
            "ESIZE": esize,
            "TMAX": TEMPLATE_BYTES,
            "GPU": _skip_mode() == "ptx",
        }
        self._door = door
        self.launch: Any = None  # the captured graph's launcher (a GPU), else None
        if graph.index._on_gpu:
            self._capture()

    def work(self) -> None:
        """The armed graph's work, queued on the current stream."""
        door = self._door
        door.arm_dev.copy_(door.arm_host, non_blocking=True)
        _doorbell_kernel[(1,)](*self._args, **self._meta, num_warps=1)
        self.graph.queue_gated(door.gate, door.settle_gate, door.tally)

    def _capture(self) -> None:
        import torch

        from kalos.gpu import driver

        index = self.graph.index
        door = self._door
        stream = torch.cuda.Stream(device=index.device)
        stream.wait_stream(torch.cuda.current_stream(index.device))
        # The compiling run: cancelled at once, and with a body length no request has, so
        # that it declines even a request the client has published meanwhile.
        body_len = int(door.arm_np[_BODY_LEN])
        door.arm_np[_BODY_LEN] = -1
        door.ctl_np[0] = 1
        with torch.cuda.stream(stream):
            self.work()
        stream.synchronize()
        door.ctl_np[:] = 0
        door.arm_np[_BODY_LEN] = body_len
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph, stream=stream):
            self.work()
        torch.cuda.current_stream(index.device).wait_stream(stream)
        self._cuda_graph = cuda_graph  # keeps the graph alive for its launcher
        self.launch = driver.GraphLaunch(
            cuda_graph.raw_cuda_graph_exec(), torch.cuda.current_stream(index.device).cuda_stream
        )

    def close(self) -> None:
        if self.launch is not None:
            self.launch.close()
            self.launch = None


class Doorbell:
    """At most one armed graph at a time, over the sidecar's one GPU stream (module doc).

    The poller calls :meth:`answer` for every request on a channel while a graph is armed or
    something the GPU took is unaccounted for, and :meth:`arm` after a search the kernel
    published; the dispatcher calls :meth:`settle` before any other work on the GPU.
    """

    def __init__(self, device: Any, budget_us: float = BUDGET_US) -> None:
        import torch

        words = _ARM_WORDS + TEMPLATE_BYTES // 8
        on_gpu = device.type == "cuda"
        self.arm_host = torch.zeros(words, dtype=torch.int64)
        self.ctl = torch.zeros(2, dtype=torch.int64)  # cancel, verdict
        if on_gpu:
            self.arm_host = self.arm_host.pin_memory()
            self.ctl = self.ctl.pin_memory()
        self.arm_np = self.arm_host.numpy()
        self.template_np = self.arm_np[_ARM_WORDS:].view(np.uint8)
        self.ctl_np = self.ctl.numpy()
        self._verdict_addr = int(self.ctl_np.ctypes.data) + 8
        self.arm_dev = torch.zeros(words, dtype=torch.int64, device=device)
        self.template_dev = self.arm_dev[_ARM_WORDS:].view(torch.uint8)
        self.gate = torch.zeros(1, dtype=torch.int32, device=device)
        # the gate of the settle behind an unproven scan, and what those settles did: how
        # many, and their rows scored exactly (pinned: read by stats())
        self.settle_gate = torch.zeros(1, dtype=torch.int32, device=device)
        self.tally = torch.zeros(2, dtype=torch.int64)
        if on_gpu:
            self.tally = self.tally.pin_memory()
        self._tally_np = self.tally.numpy()
        self.arm_np[_BUDGET] = int(budget_us * 1000)
        self.armed: PinnedArena | None = None  # the channel whose next request the GPU may take
        self._graph: ArmedGraph | None = None
        self._pending = False  # the interpreter: the armed graph waits for settle or answer
        self._template_for: PinnedArena | None = None  # whose request the template holds
        self._esize = 0
        # What the GPU took before a settle: channel -> (its sequence number, published).
        self.claims: dict[PinnedArena, tuple[int, bool]] = {}
        # Requests on the channel of the last answer() that the GPU answered before the poller
        # saw them: their sequence numbers, for the poller's books (it empties the list).
        self.unbooked: list[int] = []
        self.answered = 0  # requests the GPU took and answered
        self.declined = 0
        # taken, but not answered on the GPU (a graph that cannot settle behind its scan):
        # the sidecar answered
        self.unproven = 0
        self.expired = 0  # budgets run out (re-armed)
        self.failed: str | None = None  # why no graph could be armed: every request then
        # goes through the poller, as without a doorbell

    # -- the template ------------------------------------------------------------------------

    def capture(self, pinned: PinnedArena, op: int, flags: int, body: np.ndarray) -> None:
        """Before the launch of a search on ``pinned`` that the kernel may publish (the
        client waits; its request does not change): keeps the request as the template."""
        self._template_for = None
        if op != codes.Op.SEARCH or len(body) < 16:
            return
        nq, _k, dim, dtype = _SEARCH_HEAD.unpack_from(body, 0)
        esize = 2 if dtype == codes.DTYPE_F16 else 4
        at = len(body) - (dim * esize + 7) // 8 * 8
        if (
            nq != 1
            or dtype not in (codes.DTYPE_F16, codes.DTYPE_F32)
            or not 16 <= at <= TEMPLATE_BYTES
            or at % 8  # the kernel reads the body in 8-byte words (the protocol pads to 8)
        ):
            return
        arm = self.arm_np
        arm[_OP_FLAGS] = op | flags << 32
        arm[_BODY_LEN] = len(body)
        arm[_QUERY_AT] = at
        self.template_np[:at] = body[:at]
        self._esize = esize
        self._template_for = pinned

    # -- arming --------------------------------------------------------------------------

    def arm(self, pinned: PinnedArena, seq: int) -> None:
        """After the kernel published the response to request ``seq`` on ``pinned`` (its
        template captured; the stream idle): arms that search's graph for the next request."""
        graph = pinned.last_graph
        if self.armed is not None or self._template_for is not pinned or graph is None:
            return
        if self.failed is not None:
            return
        armed = self._armed_graph(pinned, graph, self._esize)
        if armed is None:
            return
        arm = self.arm_np
        arm[_STATUS_FLAGS] = int(Status.OK) | _PUBLISHED_FLAGS << 32
        arm[_RESP_LEN] = graph.body_len
        self.armed = pinned
        self._graph = armed
        self._launch(seq)

    def _armed_graph(
        self, pinned: PinnedArena, graph: _HostResultGraph, esize: int
    ) -> ArmedGraph | None:
        """``pinned``'s armed graph ahead of ``graph`` for queries of ``esize`` bytes a
        value: its own, made (captured) now if it has none for the index's storage as it
        is. None, and the doorbell off (:attr:`failed`), where it cannot be built (e.g. a
        GPU or Triton that cannot build the kernel): every request then the poller's."""
        key = (graph, esize)
        armed = pinned.armed_graphs.get(key)
        if armed is not None and armed.generation == graph.index._generation:
            return armed
        if armed is not None:
            armed.close()
        try:
            armed = pinned.armed_graphs[key] = ArmedGraph(self, pinned, graph, esize)
        except Exception as exc:
            pinned.armed_graphs.pop(key, None)
            self.failed = f"{type(exc).__name__}: {exc}"
            log.warning("the GPU doorbell is off: %s", self.failed)
            return None
        return armed

    def _launch(self, seq: int) -> None:
        self.arm_np[_ARMED_SEQ] = seq
        self.ctl_np[:] = 0
        graph = self._graph
        assert graph is not None
        if graph.launch is not None:
            graph.launch()
        else:
            self._pending = True

    def _run_pending(self) -> None:
        """The interpreter: the armed graph runs now, reading each word once."""
        if self._pending:
            self._pending = False
            assert self._graph is not None
            self._graph.work()

    # -- after the GPU took a request ---------------------------------------------------------

    def answer(self, pinned: PinnedArena | None, seq: int, gpu_op: bool = True) -> bool:
        """The poller (under the dispatch lock), for request ``seq`` on channel ``pinned``
        (``gpu_op``: whether its op may use the GPU, dispatch's ``GPU_OPS``): whether the
        GPU took and answered it (the response is published; the caller keeps the books and
        wakes a parked client). False: the caller serves it; the stream is idle then, or,
        for another channel's request that needs no GPU (a session's append, a PING), the
        armed graph stays armed."""
        if pinned is not None and self.claims:
            claim = self.claims.pop(pinned, None)
            if claim is not None and claim[0] == seq:
                return self._outcome(claim[1])
        if self.armed is None:
            return False
        if self.armed is not pinned:
            if gpu_op:
                self.settle()
            return False
        graph = self._graph
        assert graph is not None
        verdict = self._verdict(graph)
        if verdict != seq << 2 | TAKEN:
            if verdict & 3 == DECLINED:
                self.declined += 1
            elif verdict & 3 == TAKEN:
                # An earlier request, answered before the poller came round to it (its client
                # has sent this one, so the GPU published it): the caller keeps its books.
                self.answered += 1
                self.unbooked.append(verdict >> 2)
            self._stop(graph)
            return False
        resp_seq = pinned.resp_seq_addr
        launch = graph.launch
        if launch is None:  # the interpreter: the search has run
            if _load(resp_seq) != seq:
                self._stop(graph)
                return self._outcome(False)
            self._launch(seq)
            return self._outcome(True)
        # The next armed graph goes on the stream now, behind this one's scan, so that it
        # waits for the client's next request as soon as this answer is published.
        self._launch(seq)
        while _load(resp_seq) != seq:
            if launch.done(previous=True) and _load(resp_seq) != seq:
                self.settle()  # the next armed graph cancelled: the stream is idle
                return self._outcome(False)
        return self._outcome(True)

    def _outcome(self, published: bool) -> bool:
        if published:
            self.answered += 1
        else:
            self.unproven += 1
        return published

    def _verdict(self, graph: ArmedGraph) -> int:
        """The armed graph's verdict word, once written; after VERDICT_WAIT_NS without one,
        cancels and waits for the graph."""
        if graph.launch is None:
            self._run_pending()
            return int(self.ctl_np[1])
        addr = self._verdict_addr
        verdict = _load(addr)
        if verdict:
            return int(verdict)
        deadline = time.monotonic_ns() + VERDICT_WAIT_NS
        while not verdict and time.monotonic_ns() < deadline:
            verdict = _load(addr)
        if not verdict:
            self.ctl_np[0] = 1
            graph.launch.wait()
            verdict = _load(addr)
        return int(verdict)

    def _stop(self, graph: ArmedGraph) -> None:
        if graph.launch is not None:
            graph.launch.wait()
        self.armed = None
        self._graph = None

    # -- disarming -----------------------------------------------------------------------

    def settle(self) -> None:
        """Before any other work on the GPU (under the dispatch lock): cancels the armed graph
        and waits for it. A request it took meanwhile is recorded in :attr:`claims`."""
        pinned, graph = self.armed, self._graph
        if pinned is None or graph is None:
            return
        self.ctl_np[0] = 1
        if graph.launch is None:
            self._run_pending()
        else:
            graph.launch.wait()
        verdict = int(self.ctl_np[1])
        self.armed = None
        self._graph = None
        if verdict & 3 == TAKEN:
            seq = verdict >> 2
            self.claims[pinned] = (seq, _load(pinned.resp_seq_addr) == seq)
        elif verdict & 3 == DECLINED:
            self.declined += 1

    def expired_now(self) -> bool:
        """Whether the armed kernel gave up (its budget ran out) without a request: the poller
        then :meth:`rearm`\\ s. One load."""
        return self.armed is not None and _load(self._verdict_addr) & 3 == IDLE

    def rearm(self) -> None:
        """After :meth:`expired_now` (under the dispatch lock): the same graph, armed again."""
        graph = self._graph
        if graph is None or graph.launch is None or not self.expired_now():
            return  # settled meanwhile (another thread): nothing armed
        graph.launch.wait()
        self.expired += 1
        self._launch(int(self.arm_np[_ARMED_SEQ]))

    def release(self, pinned: PinnedArena) -> None:
        """Before a channel's memory goes (under the dispatch lock)."""
        if self.armed is pinned:
            self.settle()
        self.claims.pop(pinned, None)
        if self._template_for is pinned:
            self._template_for = None

    def prepare(self, pinned: PinnedArena, graphs: list[_HostResultGraph]) -> None:
        """A new channel's armed graphs, at its handshake (GpuSearch.prepare, under the
        dispatch lock): one ahead of each of ``graphs`` (its prepared search graphs that
        publish) for float32 queries, the client's wire dtype unless told float16. Made on
        its first arm instead, each capture (some ms, in the poller) held up the channel's
        next request. Whatever is armed is settled first: a capture runs the doorbell's
        kernel, cancelled, through the shared arm block."""
        if self.failed is not None:
            return
        self.settle()
        for graph in graphs:
            if self._armed_graph(pinned, graph, 4) is None:
                return

    def warm(self, pinned: PinnedArena, graph: _HostResultGraph) -> None:
        """Before readiness (GpuSearch.warm): compiles the doorbell's kernel for both wire
        dtypes of the query, and on a GPU captures its armed graph once, ahead of ``graph``
        (a search graph of ``pinned``'s channel that publishes), cancelled at once and so
        taking no request; nothing stays armed."""
        for esize in (2, 4):
            armed = ArmedGraph(self, pinned, graph, esize)  # a GPU: compiled and captured
            if armed.launch is None:  # the interpreter: its compiling run, declined
                body_len = int(self.arm_np[_BODY_LEN])
                self.arm_np[_BODY_LEN] = -1
                self.ctl_np[0] = 1
                try:
                    armed.work()
                finally:
                    self.ctl_np[:] = 0
                    self.arm_np[_BODY_LEN] = body_len
            armed.close()

    def stats(self) -> dict[str, Any]:
        return {
            "gpu_doorbell_answered": self.answered,
            "gpu_doorbell_declined": self.declined,
            "gpu_doorbell_unproven": self.unproven,
            "gpu_doorbell_settled": int(self._tally_np[0]),
            "gpu_doorbell_settled_rows": int(self._tally_np[1]),
            "gpu_doorbell_expired": self.expired,
            "gpu_doorbell_failed": self.failed,
        }
