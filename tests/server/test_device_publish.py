"""A search whose kernel publishes the response (server.gpu_search.PinnedArena), on the CPU.

The GPU parts run as on a cuda sidecar, but under Triton's interpreter: the prefilter graph
writes the results into a real channel's response arena and, once proven, the request's
sequence number into its response sequence word (through ``PinnedArena.resp_seq``). The
poller (server.channels.Poller) serves the channel from its own thread. Only the dispatcher
is a stand-in: it decodes the SEARCH, runs the graph through ``PinnedArena.replay`` as
``GpuSearch.search`` does, then holds a "stream sync" (an event the test sets), so that a
test can see what the client sees while the sidecar has not returned yet. The client's side
is the protocol's own calls (``_native.publish`` / ``wait_seq`` on the channel's words).
"""

from __future__ import annotations

# isort: off
from triton_interp import torch

# isort: on

import threading
import time
from dataclasses import dataclass

import numpy as np
import pytest

from cuda_reference import check_result, make_index, unprovable_rows
from kalos import _native
from kalos.gpu import driver
from kalos.index.cuda_flat import SearchGraph
from kalos.protocol import layout as L
from kalos.protocol import messages as M
from kalos.protocol.codes import Op, ResponseFlag, Status
from kalos.server.channels import Poller, ServerChannel
from kalos.server.gpu_search import PINNED_BYTES, PinnedArena
from kalos.transport.memory import SharedMemory, create

DIM, K = 64, 10
WAIT = 30.0  # seconds: generous, the interpreter is slow on a loaded machine


class StandInDispatcher:
    """``Dispatcher.handle`` for SEARCH on a cuda sidecar, reduced to what the publish needs:
    the graph of ``GpuSearch.search``'s in-place path (the kernel writes into the response)
    and a stream sync that returns when the test says so."""

    def __init__(self, index) -> None:
        self.index = index
        self.seq = torch.zeros(1, dtype=torch.int64)  # the staged sequence (the device copy)
        self.graph: SearchGraph | None = None
        self.sync = threading.Event()  # set: the "stream" may end
        self.returned = threading.Event()
        self.compute_ns = 0

    def handle(self, op, flags, body, out, gpu_buffer=None, pinned=None, reader=None):
        t0 = time.monotonic_ns()
        req = M.decode_search(body, len(body))
        n, scores, ids = M.search_response_views(out, 1, req.k)
        if self.graph is None:
            self.graph = SearchGraph(
                self.index, 1, req.k, False, scores=torch.from_numpy(scores),
                ids=torch.from_numpy(ids), prefilter=True, publish=(self.seq, pinned.resp_seq),
            )  # fmt: skip
        self.graph.query.copy_(torch.from_numpy(req.queries))
        pinned.replay(self.graph, n, self.seq.numpy(), None)
        assert self.sync.wait(WAIT)
        self.compute_ns = time.monotonic_ns() - t0
        self.returned.set()
        return Status.OK, n, self.compute_ns, 0


@dataclass
class Served:
    ch: ServerChannel
    dispatcher: StandInDispatcher
    poller: Poller
    ctrl: SharedMemory
    x: np.ndarray  # the index's rows: a random query is proven over them
    ids: np.ndarray
    base: np.ndarray  # a query along which the prefilter cannot prove its result


class Recorded:
    """The poller's metrics (admin.RequestStats.record), kept."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int, int, int]] = []

    def record(self, op, status, queue_ns, compute_ns, write_ns) -> None:
        self.calls.append((op, status, queue_ns, compute_ns, write_ns))


@pytest.fixture
def served(monkeypatch):
    """A channel with its PinnedArena, served by a running poller through the stand-in
    dispatcher (see :class:`Served`). Host registration is recorded instead of done (no CUDA
    here)."""
    registered: list[int] = []
    monkeypatch.setattr(driver, "host_register", lambda ptr, n: registered.append(ptr))
    monkeypatch.setattr(driver, "host_unregister", lambda ptr: registered.remove(ptr))
    x, ids, base = unprovable_rows(np.random.default_rng(3), DIM)
    index = make_index("ip", "fp32", DIM, "cpu")
    index.add(x, ids)
    index.prefilter_min_rows = 0
    ctrl = SharedMemory(create("kalos-test-control", L.CONTROL_SIZE), L.CONTROL_SIZE)
    ch = ServerChannel(1, 7, L.MIN_ARENA_BYTES)
    ch.pinned = PinnedArena(ch.resp_arena[:PINNED_BYTES], ch.buf[: L.CHANNEL_HEADER_SIZE])
    assert sorted(registered) == [ch.mem.addr, ch.mem.addr + L.CHANNEL_HEADER_SIZE + ch.arena_bytes]
    dispatcher = StandInDispatcher(index)
    poller = Poller(ctrl, dispatcher.handle, threading.Lock(), spin_us=100, heartbeat_ms=100)
    poller.metrics = Recorded()  # type: ignore[assignment]
    poller.add(ch)
    thread = threading.Thread(target=poller.run, daemon=True)
    thread.start()
    try:
        yield Served(ch, dispatcher, poller, ctrl, x, ids, base)
    finally:
        dispatcher.sync.set()
        poller.stop()
        thread.join(WAIT)
        ch.pinned.close()
        assert registered == []


def send(ch: ServerChannel, ctrl: SharedMemory, seq: int, query: np.ndarray) -> None:
    """The client's publish of a SEARCH (no payloads) for one query."""
    n = M.encode_search(ch.req_arena, query[None], K, M.encode_scope_fields(None))
    L.REQ_FIELDS.pack_into(ch.buf, L.REQ_OP, Op.SEARCH, 0, n, time.monotonic_ns(), 0)
    _native.publish(ch.req_seq, seq, ctrl.addr + L.CTRL_SERVER_PARKED, ctrl.addr + L.CTRL_BELL)


def wait(ch: ServerChannel, seq: int, spin_ns: int) -> bool:
    return _native.wait_seq(
        ch.resp_seq, seq, ch.client_parked, ch.client_bell, spin_ns, int(WAIT * 1e9)
    )


def header(ch: ServerChannel) -> tuple[int, int, int, int, int, int]:
    return L.RESP_FIELDS.unpack_from(ch.buf, L.RESP_STATUS)


def results(ch: ServerChannel, n: int):
    r = M.decode_search_response(ch.resp_arena, n)
    return r.scores.copy(), r.ids.copy()


def served_count(ch: ServerChannel, seq: int) -> None:
    deadline = time.monotonic() + WAIT
    while ch.requests < seq:
        assert time.monotonic() < deadline, "the poller never finished the request"
        time.sleep(0.001)


def test_the_kernel_publishes_before_the_sidecar_returns(served):
    ch, dispatcher, poller, ctrl = served.ch, served.dispatcher, served.poller, served.ctrl
    q = np.random.default_rng(1).standard_normal(DIM).astype(np.float32)  # random: proven
    send(ch, ctrl, 1, q)
    assert wait(ch, 1, spin_ns=int(WAIT * 1e9))  # a spinning client
    # the answer is complete while the sidecar still waits for its stream
    assert not dispatcher.returned.is_set()
    status, flags, n, queue_ns, compute_ns, write_ns = header(ch)
    assert (status, flags, write_ns) == (Status.OK, ResponseFlag.DEVICE_PUBLISHED, 0)
    assert n == M.search_response_views(np.zeros(4096, np.uint8), 1, K)[0]
    assert queue_ns > 0 and compute_ns > 0
    scores, got = results(ch, n)
    check_result(dispatcher.index, served.x, served.ids, None, q[None], K, scores, got)
    dispatcher.sync.set()
    served_count(ch, 1)
    # the header the client read stays; the metrics take the whole compute time
    assert header(ch) == (status, flags, n, queue_ns, compute_ns, write_ns)
    assert poller.metrics.calls == [(Op.SEARCH, Status.OK, queue_ns, dispatcher.compute_ns, 0)]
    assert dispatcher.compute_ns > compute_ns
    assert ch.last_seq == 1 and _native.load_acquire(ch.resp_seq) == 1
    assert poller.device_published == 1


def test_a_parked_client_is_woken_after_the_sync(served):
    ch, dispatcher, ctrl = served.ch, served.dispatcher, served.ctrl
    q = np.random.default_rng(2).standard_normal(DIM).astype(np.float32)
    woke: list[float] = []

    def client() -> None:
        send(ch, ctrl, 1, q)
        assert wait(ch, 1, spin_ns=0)  # parks at once
        woke.append(time.monotonic())

    t = threading.Thread(target=client)
    t.start()
    deadline = time.monotonic() + WAIT
    while _native.load_acquire(ch.resp_seq) != 1:  # the kernel's store wakes no one
        assert time.monotonic() < deadline
        time.sleep(0.001)
    time.sleep(0.05)
    assert not woke and _native.load_acquire(ch.client_parked) == 1
    released = time.monotonic()
    dispatcher.sync.set()
    t.join(WAIT)
    assert woke and woke[0] - released < WAIT / 2  # the poller's publish rang the bell
    assert header(ch)[1] == ResponseFlag.DEVICE_PUBLISHED
    scores, got = results(ch, header(ch)[2])
    check_result(dispatcher.index, served.x, served.ids, None, q[None], K, scores, got)


def test_an_unproven_search_is_published_by_its_settle(served):
    ch, dispatcher, poller, ctrl = served.ch, served.dispatcher, served.poller, served.ctrl
    q = np.random.default_rng(1).standard_normal(DIM).astype(np.float32)
    send(ch, ctrl, 1, q)  # proven: the kernel publishes
    assert wait(ch, 1, spin_ns=int(WAIT * 1e9))
    dispatcher.sync.set()
    served_count(ch, 1)
    dispatcher.sync.clear()
    dispatcher.returned.clear()
    # the near-copies' direction: the prefilter cannot prove it; the settle scores every row
    # its bound leaves open and publishes, before the sidecar's stream sync returns
    base = served.base
    send(ch, ctrl, 2, base)
    assert wait(ch, 2, spin_ns=int(WAIT * 1e9))
    assert not dispatcher.returned.is_set()
    status, flags, n, _, _, _ = header(ch)
    assert (status, flags) == (Status.OK, ResponseFlag.DEVICE_PUBLISHED)
    scores, got = results(ch, n)
    check_result(dispatcher.index, served.x, served.ids, None, base[None], K, scores, got)
    dispatcher.sync.set()
    served_count(ch, 2)
    assert dispatcher.graph is not None and dispatcher.graph.fallbacks == 1
    assert dispatcher.graph.settled_rows >= K
    assert poller.device_published == 2


def test_a_search_outside_the_poller_publishes_nothing(served):
    # PinnedArena.replay without arm (a search not served through the poller): the kernel
    # stores the word's current value, so the channel's sequence does not move
    ch, dispatcher, ctrl = served.ch, served.dispatcher, served.ctrl
    q = np.random.default_rng(1).standard_normal(DIM).astype(np.float32)
    send(ch, ctrl, 1, q)
    assert wait(ch, 1, spin_ns=int(WAIT * 1e9))
    dispatcher.sync.set()
    served_count(ch, 1)
    graph, pinned = dispatcher.graph, ch.pinned
    assert graph is not None
    pinned.replay(graph, 0, dispatcher.seq.numpy(), None)
    assert not pinned.published and _native.load_acquire(ch.resp_seq) == 1
    assert int(dispatcher.seq[0]) == 1


def test_a_failed_registration_leaves_nothing_registered(monkeypatch):
    registered: list[int] = []

    def register(ptr: int, n: int) -> None:
        if registered:  # the header page, after the arena
            raise OSError("cuMemHostRegister failed: out of memory")
        registered.append(ptr)

    monkeypatch.setattr(driver, "host_register", register)
    monkeypatch.setattr(driver, "host_unregister", lambda ptr: registered.remove(ptr))
    ch = ServerChannel(1, 7, L.MIN_ARENA_BYTES)
    with pytest.raises(OSError, match="out of memory"):
        PinnedArena(ch.resp_arena[:PINNED_BYTES], ch.buf[: L.CHANNEL_HEADER_SIZE])
    assert registered == []
