"""The shared-memory transport: the default, and the fast path.

The request body is already in the channel's request arena (the client encoded it there). A
request is: write the header fields, then publish the sequence word (release) and wake the
sidecar only if it is parked. The response is awaited by spinning for ``spin_us`` (the sidecar
usually answers within a few µs when it has its own core) and then parking on the channel's
futex doorbell, in slices, so that a dead sidecar is noticed within ``LIVENESS_SLICE_NS``.

A sidecar is gone when its handshake socket reads EOF (it died: the kernel closes it), when
its control segment says STOPPING, or when its heartbeat is older than ``hung_after`` seconds
(it hangs: SIGSTOPped, or stuck). Each raises SidecarGone and breaks the channel.
"""

from __future__ import annotations

import ctypes
import os
import select
import socket
import struct
import time
from typing import Any

from kalos import _native
from kalos.errors import ClosedError, ConnectError, RequestTimeout, SidecarGone
from kalos.shm import channel as L
from kalos.shm.memory import SharedMemory
from kalos.transport.base import Response, Transport
from kalos.transport.lent import LOCAL_READ_BEAT_NS, Lent, map_session_index, map_token_heap

# How long a parked client sleeps before it checks that the sidecar still lives.
LIVENESS_SLICE_NS = 10_000_000  # 10 ms: a dead sidecar is seen well inside a 100 ms deadline
# A heartbeat older than this means a hung sidecar. It beats every <= 100 ms from a thread of
# its own (a long request does not delay it); 1 s leaves room for a loaded 2-core machine.
HUNG_AFTER_S = 1.0

# How long a caller spins for a response before it parks, unless told (Client's spin_us): a
# CPU sidecar answers within a few µs; a GPU search takes ~60-90 µs at 1M rows, and its
# response is published by the kernel itself (server.gpu_search), which wakes no one: a
# parked caller waits for the sidecar's stream sync and a futex wake (8-28 µs on the H200).
SPIN_US = 50.0
GPU_SPIN_US = 200.0
# Unless told a spin, a channel learns one per op (learned_spin): ops that take a little longer
# than that base (an IVF search, a GPU search of 250 µs) are spun for instead of parked for
# (a futex wake costs the caller tens of µs), up to SPIN_CAP times the
# base; an op that takes longer than that cap parks after the base, as does every op under load
# (a request that waited in the sidecar's queue for a quarter of its round trip or more).
SPIN_CAP = 4
LOADED_NS = 10_000_000  # a round trip that queued in the sidecar counts as this long
# Callers of this process that spin at once for a response slower than the base spin (the
# ops a channel learned, or every op with a fixed spin): beyond SPINNERS, such a call parks at
# once, as it does while SPINNERS callers or more spin across every client process of the
# sidecar (the poller's count of the callers it found waiting and not parked, in the control
# segment). Spinning callers beyond the CPUs only take them from the sidecar and from the
# callers whose answers have come (64 threads or asyncio tasks searching on the 2-core VM:
# async-ci-2core.json). The process's count is a native word, updated atomically without the
# GIL.
_CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
SPINNERS = max(1, (_CPUS or 1) // 4)
_waiting = ctypes.c_uint64(0)
_WAITING = ctypes.addressof(_waiting)
_LESS_ONE = 2**64 - 1  # fetch_add's delta for -1 (it wraps)
os.register_at_fork(after_in_child=lambda: setattr(_waiting, "value", 0))  # no waiter there
_monotonic_ns = time.monotonic_ns
_publish = _native.publish
_wait_seq = _native.wait_seq
_load = _native.load_acquire
_fetch_add = _native.fetch_add
_DEADLINE = struct.Struct("<Q")
# Bound once: module attribute lookups cost ~0.03 µs each on the request path.
_pack_request = L.REQ_FIELDS.pack_into
_unpack_response = L.RESP_FIELDS.unpack_from
_REQ_OP = L.REQ_OP
_RESP_STATUS = L.RESP_STATUS

__all__ = [
    "GPU_SPIN_US", "HUNG_AFTER_S", "LIVENESS_SLICE_NS", "LOADED_NS", "LOCAL_READ_BEAT_NS",
    "SPIN_CAP", "SPIN_US", "ShmTransport", "default_spin_us", "learned_spin",
    "map_session_index", "map_token_heap", "open_shm",
]  # fmt: skip


def default_spin_us(info: dict[str, Any]) -> float:
    """The spin of a channel to the sidecar whose handshake reply is ``info``."""
    return GPU_SPIN_US if str(info.get("device", "cpu")).startswith("cuda") else SPIN_US


def learned_spin(estimate_ns: int, base_ns: int) -> int:
    """The spin (ns) for an op whose recent round trips average ``estimate_ns``: a quarter
    more than that, plus 10 µs, when that is above the base spin and within SPIN_CAP times
    it; else the base (a quick op is answered within it; a long one is parked for)."""
    spin = estimate_ns + (estimate_ns >> 2) + 10_000
    if estimate_ns <= base_ns or spin > SPIN_CAP * base_ns:
        return base_ns
    return spin


def open_shm(
    sock: socket.socket,
    info: dict[str, Any],
    fds: list[int],
    *,
    spin_us: float,
    hung_after: float = HUNG_AFTER_S,
    gpu: bool = False,
    learn_spin: bool = False,
) -> tuple[ShmTransport, Lent]:
    """The channel a shm handshake opened (its reply ``info`` and descriptors ``fds``: the
    control segment, the channel, then the token heap and the session index when lent), and
    what it lent beside it. ``gpu``: map the channel's GPU result buffer (``info["gpu"]``).
    ``learn_spin``: ``spin_us`` is a base, and each op's spin is learned (:func:`learned_spin`).
    Closes the descriptors; raises ConnectError when they do not match the reply."""
    heap_info = info.get("token_heap")
    index_info = info.get("session_index") if heap_info else None
    want = 2 + bool(heap_info) + bool(index_info)
    if len(fds) != want:
        for fd in fds:
            os.close(fd)
        raise ConnectError(f"the sidecar sent {len(fds)} descriptors, expected {want}")
    heap = sessions = None
    try:
        ctrl = SharedMemory(fds[0], L.CONTROL_SIZE)
        chan = SharedMemory(fds[1], L.channel_size(int(info["arena_bytes"])))
        if heap_info:
            key = (int(info.get("server_pid", 0)), int(info.get("epoch", 0)))
            heap = map_token_heap(fds[2], int(heap_info["bytes"]), key)
        if index_info and heap is not None:
            sessions = map_session_index(fds[3], int(index_info["bytes"]), heap)
    finally:
        for fd in fds:
            os.close(fd)
    t = ShmTransport(
        sock, info, ctrl, chan, spin_us=spin_us, hung_after=hung_after, learn_spin=learn_spin
    )
    try:
        channel = None
        if gpu:
            from kalos.gpu.handoff import GpuChannel

            channel = GpuChannel(info["gpu"])
        lent = Lent(heap, sessions, channel, control=ctrl.buf, channel=chan.buf, over=t)
    except BaseException:
        t.close()
        raise
    return t, lent


class ShmTransport(Transport):
    kind = "shm"

    def __init__(
        self,
        sock: socket.socket,
        info: dict[str, Any],
        ctrl: SharedMemory,
        chan: SharedMemory,
        *,
        spin_us: float,
        hung_after: float = HUNG_AFTER_S,
        learn_spin: bool = False,
    ) -> None:
        """The channel ``chan`` with its control segment ``ctrl`` (see :func:`open_shm`)."""
        self._ctrl = ctrl
        self._pid = os.getpid()  # Transport.__del__
        self._chan = chan
        self._sock = sock
        self.server_info = info
        arena = int(info["arena_bytes"])
        buf = self._chan.buf
        magic, version, _cid, _epoch, arena_bytes, req_off, resp_off = L.CHAN_HEADER.unpack_from(
            buf, 0
        )
        if magic != L.CHANNEL_MAGIC or version != L.LAYOUT_VERSION or arena_bytes != arena:
            raise ConnectError("the channel's header does not match the handshake")
        self.request_buffer = buf[req_off : req_off + arena]
        self._resp_arena = buf[resp_off : resp_off + arena]
        a, c = self._chan.addr, self._ctrl.addr
        self._req_seq = a + L.REQ_SEQ
        self._resp_seq = a + L.RESP_SEQ
        self._client_parked = a + L.CHAN_CLIENT_PARKED
        self._client_bell = a + L.CHAN_CLIENT_BELL
        self._server_parked = c + L.CTRL_SERVER_PARKED
        self._server_bell = c + L.CTRL_BELL
        self._ctrl_state = c + L.CTRL_STATE
        self._heartbeat = c + L.CTRL_HEARTBEAT_NS
        self._spinning = c + L.CTRL_SPINNING
        self._hung_ns = int(hung_after * 1e9)
        self._buf = buf
        self._seq = _load(self._req_seq)
        self._spin_ns = int(spin_us * 1000)
        # learn_spin: each op's spin (ns) and its round trips' running average (ns), kept for
        # the ops that took longer than the base spin
        self._spins: dict[int, int] | None = {} if learn_spin else None
        self._rtt: dict[int, int] = {}
        self._sent_ns = 0  # when the last request was published (last_sent_ns)
        # The Response of every request, refilled: like its body, valid until the next request
        # (~0.1 µs less than building one per call).
        self._response = Response(0, self._resp_arena[:0], 0, 0, 0)

    def request(self, op: int, flags: int, body_len: int, *, timeout: float) -> Response:
        if self._closed or self._broken:
            self._refuse()
        seq = self._seq + 1
        self._seq = seq
        now = _monotonic_ns()
        timeout_ns = int(timeout * 1e9)
        deadline = now + timeout_ns
        buf = self._buf
        _pack_request(buf, _REQ_OP, op, flags, body_len, now, deadline)
        _publish(self._req_seq, seq, self._server_parked, self._server_bell)
        self._sent_ns = now
        first = timeout_ns if timeout_ns < LIVENESS_SLICE_NS else LIVENESS_SLICE_NS
        spins = self._spins
        if spins is not None and op not in self._rtt:  # quick: spins, whoever else waits
            if not _wait_seq(self._resp_seq, seq, self._client_parked, self._client_bell,
                             self._spin_ns, first):  # fmt: skip
                self._wait_slow(seq, deadline)
        else:  # slower than the base spin: spins only within the process's SPINNERS
            spin = self._spin_ns if spins is None else spins.get(op, self._spin_ns)
            if _fetch_add(_WAITING, 1) >= SPINNERS or _load(self._spinning) >= SPINNERS:
                spin = 0  # as many spin already, in this process or in all (the sidecar's count)
            try:
                if not _wait_seq(self._resp_seq, seq, self._client_parked, self._client_bell,
                                 spin, first):  # fmt: skip
                    self._wait_slow(seq, deadline)
            finally:
                _fetch_add(_WAITING, _LESS_ONE)
        status, _flags, n, queue_ns, compute_ns, write_ns = _unpack_response(buf, _RESP_STATUS)
        if spins is not None:
            rtt = _monotonic_ns() - now
            if rtt > self._spin_ns or op in self._rtt:  # a quick op costs only this test
                # waited in the sidecar's queue for a quarter of it: under load, where spinning
                # callers take the CPUs the sidecar needs; counted as a long round trip
                self._learn(op, rtt if queue_ns <= rtt >> 2 else LOADED_NS)
        r = self._response
        r.status = status
        r.body = self._resp_arena[:n]
        r.queue_ns = queue_ns
        r.compute_ns = compute_ns
        r.write_ns = write_ns
        return r

    def _learn(self, op: int, rtt: int) -> None:
        """Folds a round trip of ``op`` into its average (a quarter of the way) and sets its
        spin (:func:`learned_spin`); an op back under the base spin is forgotten."""
        assert self._spins is not None
        estimate = self._rtt.get(op, rtt)
        estimate += (rtt - estimate) >> 2
        if estimate <= self._spin_ns:
            self._rtt.pop(op, None)
            self._spins.pop(op, None)
            return
        self._rtt[op] = estimate
        self._spins[op] = learned_spin(estimate, self._spin_ns)

    def last_sent_ns(self) -> int:
        return self._sent_ns  # the publish stamp of the last request's header, kept

    def _wait_slow(self, seq: int, deadline: int) -> None:
        """Parks in slices until the response comes, the deadline passes or the sidecar dies."""
        while True:
            gone = self._sidecar_gone()
            if gone:
                self._broken = True
                # Expire the abandoned request: a hung sidecar that resumes refuses it (TIMEOUT)
                # unless it had picked it up already, as it refuses one past its deadline.
                _DEADLINE.pack_into(self._buf, L.REQ_DEADLINE_NS, 1)
                raise SidecarGone(f"{gone} while a request was in flight")
            left = deadline - _monotonic_ns()
            if left <= 0:
                # The sidecar may still answer later and overwrite the arena: never reuse it.
                self._broken = True
                raise RequestTimeout("no response from the sidecar within the deadline")
            if _wait_seq(
                self._resp_seq,
                seq,
                self._client_parked,
                self._client_bell,
                0,
                min(left, LIVENESS_SLICE_NS),
            ):
                return

    def _sidecar_gone(self) -> str | None:
        """Why the sidecar is gone (died, stopping, hung), or None while it lives."""
        if _load(self._ctrl_state) == L.STATE_STOPPING:
            return "the sidecar is stopping"
        # The sidecar never writes to this socket after the handshake: readable means EOF.
        try:
            readable, _, _ = select.select([self._sock], [], [], 0)
        except ValueError:  # its fd is -1: another thread closed this channel (Client.close)
            raise ClosedError("this channel was closed while a request was in flight") from None
        if readable:
            return "the sidecar died"
        beat = _load(self._heartbeat)  # 0: no beat yet (a sidecar from before the beat thread)
        if beat and _monotonic_ns() - beat > self._hung_ns:
            return f"the sidecar hangs (no heartbeat for {(_monotonic_ns() - beat) / 1e9:.1f} s)"
        return None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._sock.close()
        finally:
            self._chan.close()
            self._ctrl.close()
