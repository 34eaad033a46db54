"""Server side of the shm channels: the channel record and the poller that serves them.

One poller thread serves every channel. While requests flow it spins over the channels'
request sequence words (one acquire-load each); once no request came for ``spin_us`` it parks
on the control segment's doorbell, so an idle sidecar costs nothing but a heartbeat. With a
``max_spin_us`` (off by default), while requests come as a steady trickle, on average at least
every ``max_spin_us / SPIN_GAPS``, it spins ``SPIN_GAPS`` times their mean gap instead: the
next request then almost always finds it awake and pays no futex wake (tens to hundreds of µs
on a VM). Slower trickles keep ``spin_us``: a long spin that still ends in a park cost the next
requests more on the 2-core VM, whose cores the callers kept busy (likely: the scheduler
wakes a thread that has just spun for ms late).

With durability (a :class:`~kalos.server.durability.Durability` as ``journal``) the response
to a logged write is held back: after each sweep the poller starts one group commit for every
record of the sweep, keeps serving, and publishes each held response once its record is
durable (the log's flusher rings the doorbell when a commit lands). Between sweeps it takes a
snapshot when one is due.

Dynamic batching (``begin_batch``: Dispatcher.begin_batch): the searches and recalls a
sweep finds waiting on different channels are answered together after it, with one pass
over the index; each member is checked on its own (its body's size, its deadline) and its
response written to its own channel. One found alone is served as any other request, so a
lone caller pays one header read for it. With a batch delay the first member waits up to it
for more, sweeping the channels. The callers of a batch that parked while it ran are woken
by another thread (server.waker): the poller only stores their sequence words.

On a GPU a batch's pass is left running while the poller sweeps on: the requests its sweeps
find meanwhile are taken into the next batch and decoded (up to ``batch_max``; a channel's
taken request is passed by until answered). Once the pass is done, its answers are taken, the
next batch's pass started, and the first one's responses written and published while the GPU
runs the second: the host's work on a batch and the GPU's pass overlap, instead of adding up. The
dispatch lock stays held while batches are taken or running: whatever else takes it (a lone
request, a write, the GPU doorbell's books, a snapshot, another thread) first waits until
they are answered.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kalos import _native
from kalos.protocol import layout as L
from kalos.protocol.codes import Op, Status
from kalos.protocol.messages import encode_text
from kalos.server.dispatch import GPU_OPS, batchable
from kalos.server.waker import Waker
from kalos.shm.memory import SharedMemory, create

if TYPE_CHECKING:
    from kalos.server.dispatch import BatchRun
    from kalos.server.doorbell import Doorbell
    from kalos.server.durability import Journal
    from kalos.server.request_stats import RequestStats

log = logging.getLogger("kalos.server")

_monotonic_ns = time.monotonic_ns
_load = _native.load_acquire
_store = _native.store_release
_publish = _native.publish
# A steady trickle of requests keeps the poller spinning this many times their mean gap
SPIN_GAPS = 5
# The poller's steps on a batch, timed apart (Poller.batch_step_ns)
BATCH_STEPS = ("decode", "start", "collect", "write", "reply")
# Bound once: module attribute lookups cost ~0.03 µs each on the request path.
_unpack_request = L.REQ_FIELDS.unpack_from
_pack_response = L.RESP_FIELDS.pack_into
_REQ_OP = L.REQ_OP
_unpack_op_flags = struct.Struct("<II").unpack_from  # REQ_FIELDS' first two: op, flags
_batchable = batchable
_RESP_STATUS = L.RESP_STATUS


class ServerChannel:
    """One client thread's channel, as the sidecar sees it."""

    def __init__(self, channel_id: int, epoch: int, arena_bytes: int) -> None:
        self.id = channel_id
        self.arena_bytes = arena_bytes
        self.fd = create(f"kalos-channel-{channel_id}", L.channel_size(arena_bytes))
        self.mem = SharedMemory(self.fd, L.channel_size(arena_bytes))
        req_off = L.CHANNEL_HEADER_SIZE
        resp_off = req_off + arena_bytes
        L.CHAN_HEADER.pack_into(
            self.mem.buf,
            0,
            L.CHANNEL_MAGIC,
            L.LAYOUT_VERSION,
            channel_id,
            epoch,
            arena_bytes,
            req_off,
            resp_off,
        )
        self.buf = self.mem.buf
        self.req_arena = self.buf[req_off : req_off + arena_bytes]
        self.resp_arena = self.buf[resp_off : resp_off + arena_bytes]
        a = self.mem.addr
        self.req_seq = a + L.REQ_SEQ
        self.resp_seq = a + L.RESP_SEQ
        self.client_parked = a + L.CHAN_CLIENT_PARKED
        self.client_bell = a + L.CHAN_CLIENT_BELL
        self.last_seq = 0
        self.taken = 0  # the request the poller took into a batch not yet answered (its seq)
        self.requests = 0
        self.gpu: Any = None  # its GPU result buffer (server.gpu_search), on a cuda sidecar
        self.pinned: Any = None  # its response arena registered for the GPU (PinnedArena)
        # The token heap (kalos.stores.token_heap): ``reader`` is this channel when its client
        # maps the heap (CONTEXT may answer by reference), else None; the heap's Reader fields.
        self.reader: ServerChannel | None = None
        self.lent_region = -1
        self.lent_request = 0
        self.closed = False
        self._view = a + L.CHAN_CLIENT_VIEW

    def viewing(self) -> int:
        """The token-heap region the client's last window from the session index points into
        (its token offset), or -1: what the client wrote there (acquire)."""
        return int(_native.load_acquire(self._view)) - 1


def _batch_failed(members: int) -> None:
    """Logs a bug in the batch path (with its traceback): its members are served each alone,
    so that it fails only itself."""
    log.exception("a batch of %d failed; serving each alone", members)


def _run_step(flight: _Flight, step: Callable[[], Any]) -> Any:
    """``step()`` of ``flight``'s BatchRun (its start or finish). Should it fail, the failure
    is logged and the run dropped (its members are then answered each alone): None."""
    try:
        return step()
    except Exception:
        _batch_failed(len(flight.members))
        flight.run = None
        return None


class _Flight:
    """A batch between its decode and its replies (Poller._serve_together): its BatchRun
    (None: each member alone), members, (channel, seq, op, queue ns) of each, when its first
    was picked up and when its pass was left running (0: it was not), and its results."""

    __slots__ = ("members", "picked", "results", "run", "served", "started")

    def __init__(
        self, run: BatchRun | None, members: list[tuple[int, int, Any, Any]],
        served: list[tuple[ServerChannel, int, int, int]], picked: int,
    ) -> None:  # fmt: skip
        self.run, self.members, self.served, self.picked = run, members, served, picked
        self.started = 0
        self.results: list[tuple[int, int, int, int]] = []

    def done(self) -> bool:
        """Whether its pass, left running, has finished (it does not wait)."""
        return self.run is None or self.run.done()


class Poller:
    """Serves every shm channel from one thread (see the module docstring)."""

    def __init__(
        self,
        control: SharedMemory,
        handle,
        lock: threading.Lock,
        *,
        spin_us: float,
        heartbeat_ms: float,
        max_spin_us: float = 0.0,
        journal: Journal | None = None,
        begin_batch=None,
        batch_delay_us: float = 0.0,
        batch_max: int = 64,
    ) -> None:
        self._ctrl = control
        self._handle = handle  # Dispatcher.handle, or Durability.handle
        # Dynamic batching (the module docstring): Dispatcher.begin_batch, or None for none;
        # how long the first search of a batch may wait for more (0: only those waiting);
        # the most requests in one batch.
        self._begin_batch = begin_batch
        self._batch_delay_ns = int(batch_delay_us * 1000)
        self._batch_max = max(1, batch_max)
        self._batch: list[tuple[ServerChannel, int]] = []  # reused by every sweep
        self.batches = 0  # batches of two or more served
        self.batched = 0  # requests served in them
        self.largest_batch = 0
        # where those batches' time went: from their sweep's pickup to the last reply, and of
        # that, inside the dispatcher's batch call (decode, search, encode; under the lock)
        self.batch_ns = 0
        # ... and the poller's steps on them, each summed over the batches: decoding the
        # members, starting the pass, taking its answers, writing the responses (these four
        # in the dispatcher: batch_dispatch_ns), publishing them
        self.batch_step_ns = dict.fromkeys(BATCH_STEPS, 0)
        # A batch whose pass runs on the GPU while the poller sweeps for the next (the dispatch
        # lock held for it); how many batches ran so, and for how long in all
        self._flight: _Flight | None = None
        self._next: _Flight | None = None  # the batch taken meanwhile, started after it
        self.batches_run_ahead = 0
        self.batch_running_ns = 0
        # While run serves with batching on: the thread that wakes a batch's parked callers
        # (server.waker); None: each reply wakes its own. How many it woke in earlier runs.
        self._waker: Waker | None = None
        self._woken_before = 0
        self._lock = lock
        self._journal = journal
        # Responses to logged writes awaiting their commit, in LSN order:
        # (lsn, channel, seq, status, body length, queue ns, compute ns, write ns)
        self._held: list[tuple[int, ServerChannel, int, int, int, int, int, int]] = []
        self._spin_ns = int(spin_us * 1000)
        # the spin through a trickle's gaps (the module doc): at most this long, 0: never
        self._max_spin_ns = int(max_spin_us * 1000)
        # the mean gap between the sweeps that found a request (each gap counted up to
        # max_spin_us, so that an idle spell does not outweigh the trickle after it)
        self.gap_ns = self._max_spin_ns
        # how long it spins now after the last request before it parks (set per arrival)
        self.spin_ns = self._spin_ns
        self._heartbeat_ns = int(heartbeat_ms * 1e6)
        self.channels: tuple[ServerChannel, ...] = ()
        self._channels_lock = threading.Lock()
        self.stopping = False
        self.device_published = 0  # responses whose sequence word the GPU stored
        # A cuda sidecar's doorbell (server.doorbell): the GPU may pick up a channel's next
        # search itself; set by the sidecar.
        self.doorbell: Doorbell | None = None
        a = control.addr
        self._parked = a + L.CTRL_SERVER_PARKED
        self._bell = a + L.CTRL_BELL
        self._hb_ns = a + L.CTRL_HEARTBEAT_NS
        self._hb_count = a + L.CTRL_HEARTBEAT_COUNT
        self._spinning_word = a + L.CTRL_SPINNING
        self._spinning = 0  # what the word says: callers waiting and not parked, last sweep
        self.metrics: RequestStats | None = None  # set by the admin endpoint (kalos.server.admin)

    def add(self, ch: ServerChannel) -> None:
        # Each connection's listener thread adds and removes its own channel: the tuple is
        # replaced under a lock, or a connect racing a disconnect could drop a channel (whose
        # requests then go unserved). The poll loop reads it without one.
        with self._channels_lock:
            self.channels = (*self.channels, ch)

    def remove(self, ch: ServerChannel) -> None:
        # The poller may still hold the old tuple and answer one last request on this channel;
        # its memory stays mapped until the last reference goes, so that is harmless.
        with self._channels_lock:
            self.channels = tuple(c for c in self.channels if c is not ch)

    def wake(self) -> None:
        _native.fetch_add(self._bell, 1)
        _native.futex_wake(self._bell, 1 << 30)

    def stop(self) -> None:
        self.stopping = True
        self.wake()

    def run(self) -> None:
        """The poll loop; returns once :meth:`stop` was called."""
        batch = self._batch if self._begin_batch is not None else None
        if batch is not None:
            self._waker = Waker()
        try:
            self._run(batch)
        finally:
            if self._waker is not None:
                self._waker.close()
                self._woken_before += self._waker.deferred
                self._waker = None

    @property
    def batch_dispatch_ns(self) -> int:
        """Of the batches' time, the steps inside the dispatcher (decode, search, encode)."""
        steps = self.batch_step_ns
        return steps["decode"] + steps["start"] + steps["collect"] + steps["write"]

    @property
    def batch_woken(self) -> int:
        """Batch members whose callers had parked, woken by the waker's thread."""
        waker = self._waker
        return self._woken_before + (waker.deferred if waker is not None else 0)

    def _arrived(self, now: int, last: int) -> None:
        """A sweep found a request ``now``, the one before ``last``: the mean gap, and the
        spin that follows from it (``spin_us``, or through a steady trickle's gaps)."""
        self.gap_ns += (min(now - last, self._max_spin_ns) - self.gap_ns) // 8
        spin = SPIN_GAPS * self.gap_ns
        fits = spin <= self._max_spin_ns
        self.spin_ns = max(self._spin_ns, spin) if fits else self._spin_ns

    def _run(self, batch: list[tuple[ServerChannel, int]] | None) -> None:
        last_work = last_arrival = _monotonic_ns()
        next_beat = 0
        beats = 0
        while not self.stopping:
            worked = arrived = False
            spinning = 0
            for ch in self.channels:
                seq = _load(ch.req_seq)
                if seq != ch.last_seq:
                    if not _load(ch.client_parked):
                        spinning += 1
                    if seq == ch.taken:  # in a batch not yet answered
                        continue
                    if batch is not None and _batchable(*_unpack_op_flags(ch.buf, _REQ_OP)):
                        batch.append((ch, seq))  # served after the sweep, with the others
                    else:
                        self.serve(ch, seq)
                    worked = arrived = True
            if spinning != self._spinning:  # every client process's callers read it
                self._spinning = spinning
                _store(self._spinning_word, spinning)
            if batch:
                self._serve_batch(batch)
            if self._flight is not None:  # answered once its pass is done; spin meanwhile
                self._advance()
                worked = True
            if self._held:
                self._release()
            door = self.doorbell
            if door is not None and door.expired_now():
                self._locked(door.rearm)
            now = _monotonic_ns()
            if now >= next_beat:
                beats += 1
                _store(self._hb_ns, now)
                _store(self._hb_count, beats)
                next_beat = now + self._heartbeat_ns
            if self._journal is not None and self._journal.snapshot_due():
                self._drain()
                if door is not None:
                    self._locked(door.settle)
                self._journal.snapshot()
            if arrived and self._max_spin_ns:
                self._arrived(now, last_arrival)
                last_arrival = now
            if worked:
                last_work = now
                continue
            if now - last_work < self.spin_ns:
                continue
            if door is not None and door.armed is not None:  # idle: no kernel spins on
                self._locked(door.settle)
                continue  # it may have taken a request meanwhile
            if self._park():
                last_work = _monotonic_ns()
        self._drain()
        door = self.doorbell
        if door is not None:
            self._locked(door.settle)
        if self._held:  # stopping: answer every write whose record can still be made durable
            assert self._journal is not None
            self._journal.sync()
            self._release()

    def _locked(self, fn) -> None:
        self._drain()
        self._lock.acquire()
        try:
            fn()
        finally:
            self._lock.release()

    def _release(self) -> None:
        """Commits the held writes' records and publishes those that are durable (or failed)."""
        journal = self._journal
        assert journal is not None
        journal.commit()
        held = self._held
        done = 0
        metrics = self.metrics
        for lsn, ch, seq, status, n, queue_ns, compute_ns, write_ns in held:
            outcome = journal.outcome(lsn)
            if outcome is None:
                break
            if outcome is not True:  # the log failed: the write is not acknowledged
                status = Status.SERVER_ERROR
                n = encode_text(ch.resp_arena, outcome)
            L.RESP_FIELDS.pack_into(
                ch.buf, L.RESP_STATUS, status, 0, n, queue_ns, compute_ns, write_ns
            )
            # The request's op, read before the publish lets the client write the next one.
            op = L.REQ_FIELDS.unpack_from(ch.buf, L.REQ_OP)[0] if metrics is not None else 0
            _publish(ch.resp_seq, seq, ch.client_parked, ch.client_bell)
            if metrics is not None:
                metrics.record(op, status, queue_ns, compute_ns, write_ns)
            done += 1
        if done:
            del held[:done]

    def _park(self) -> bool:
        """Sleeps on the doorbell until a client rings it or a heartbeat is due.

        Dekker handshake with the client's ``publish``: we set PARKED, fence, then re-check
        every channel; the client stores its sequence, fences, then checks PARKED. One of
        the two always sees the other, so a request is never left waiting.
        """
        bell = _load(self._bell)
        _store(self._parked, 1)
        _native.fence()
        try:
            for ch in self.channels:
                if _load(ch.req_seq) != ch.last_seq:
                    return True
            # The log's flusher rings the doorbell after each commit (after the outcome is set)
            held, journal = self._held, self._journal
            if held and journal is not None and journal.outcome(held[0][0]) is not None:
                return True
            if self.stopping:
                return False
            return bool(_native.futex_wait(self._bell, bell & 0xFFFFFFFF, self._heartbeat_ns))
        finally:
            _store(self._parked, 0)

    def serve(self, ch: ServerChannel, seq: int) -> None:
        """Answers the request published with ``seq`` on ``ch``."""
        if self._flight is not None or self._next is not None:
            self._drain()
        picked = _monotonic_ns()
        buf = ch.buf
        op, flags, body_len, publish_ns, deadline_ns = _unpack_request(buf, _REQ_OP)
        queue_ns = picked - publish_ns if 0 < publish_ns <= picked else 0
        published = False
        if body_len > ch.arena_bytes:
            if self.metrics is not None:
                self.metrics.oversized += 1
            status = Status.PAYLOAD_TOO_LARGE
            n = encode_text(ch.resp_arena, f"request body of {body_len} bytes exceeds the arena")
            compute_ns = write_ns = 0
        elif deadline_ns and picked > deadline_ns:
            status = Status.TIMEOUT
            n = encode_text(ch.resp_arena, "the request's deadline passed before it was served")
            compute_ns = write_ns = 0
        else:
            pinned = ch.pinned
            door = self.doorbell
            lock = self._lock  # acquire/release: ~0.08 µs less than a with block
            if (
                door is not None
                and (door.armed is not None or door.claims)
                and self._door_took(door, ch, seq, op, publish_ns)
            ):
                return
            if pinned is not None:  # a cuda sidecar: its GPU may publish a search's response
                # (with a doorbell: the request, its template should the GPU take the next)
                body = ch.req_arena[:body_len] if door is not None else None
                pinned.arm(seq, queue_ns, picked, op, flags, body)
            lock.acquire()
            try:
                status, n, compute_ns, write_ns = self._handle(
                    op,
                    flags,
                    ch.req_arena[:body_len],
                    ch.resp_arena,
                    gpu_buffer=ch.gpu,
                    pinned=pinned,
                    reader=ch.reader,
                )
                lsn = self._journal.last_lsn if self._journal is not None else 0
            finally:
                lock.release()
            if lsn:  # a logged write: answered once its record is durable (_release)
                ch.last_seq = seq
                ch.requests += 1
                self._held.append((lsn, ch, seq, status, n, queue_ns, compute_ns, write_ns))
                return
            # The GPU may have published the response: it stored the sequence word after the
            # header written before its launch (gpu_search.PinnedArena), and the client may
            # have read them already, so the header stays as it is; the publish below stores
            # the same value again, which wakes a parked client.
            published = pinned is not None and pinned.published
            if published:
                self.device_published += 1
                if door is not None:  # the GPU may take this channel's next search itself
                    lock.acquire()
                    try:
                        door.arm(pinned, seq)
                    finally:
                        lock.release()
        if not published:
            _pack_response(buf, _RESP_STATUS, status, 0, n, queue_ns, compute_ns, write_ns)
        ch.last_seq = seq
        _publish(ch.resp_seq, seq, ch.client_parked, ch.client_bell)
        ch.requests += 1  # after the publish, as the metrics: the client does not wait for it
        metrics = self.metrics
        if metrics is not None:  # after the publish: the client is not kept waiting for it
            metrics.record(op, status, queue_ns, compute_ns, write_ns)

    def _door_took(
        self, door: Doorbell, ch: ServerChannel, seq: int, op: int, publish_ns: int
    ) -> bool:
        """Whether the GPU took request ``seq`` on ``ch`` itself (server.doorbell) and
        published its response; keeps the books of it, and of those the GPU answered before
        this poller saw them. False: the poller serves it."""
        lock = self._lock
        lock.acquire()
        try:
            answered = door.answer(ch.pinned, seq, op in GPU_OPS)
            missed, door.unbooked = door.unbooked, []
        finally:
            lock.release()
        for _ in missed:  # answered by the GPU before this poller saw them
            self._answered(ch, 0, Op.SEARCH, 0)  # the GPU takes only searches
        if answered:  # the GPU took the request and published the response
            self._answered(ch, seq, op, publish_ns)
        return answered

    def _serve_batch(self, batch: list[tuple[ServerChannel, int]]) -> None:
        """Answers the searches and recalls of one sweep (``batch``: channel and sequence,
        emptied here) with one pass over the index (Dispatcher.begin_batch); with a batch
        delay, first waits up to it for more. A lone request goes the way of any other
        (:meth:`serve`): batching never adds work to one caller's search. Each member is
        checked on its own (its body's size, its deadline), and answered on its own channel.
        While a batch's pass runs on the GPU, the sweep's requests join the next batch, up to
        ``batch_max`` (the others wait for a later sweep)."""
        try:
            if self._batch_delay_ns:
                self._gather(batch)
            if self._flight is not None:
                room = self._batch_max - (len(self._next.members) if self._next else 0)
                if room > 0:
                    self._serve_together(batch[:room])
                return
            for start in range(0, len(batch), self._batch_max):
                part = batch[start : start + self._batch_max]
                if len(part) == 1:
                    self.serve(*part[0])
                else:
                    self._serve_together(part)
        finally:
            batch.clear()

    def _gather(self, batch: list[tuple[ServerChannel, int]]) -> None:
        """Waits up to the batch delay from now for more batchable requests (or until the
        batch is full), sweeping the channels; the others wait for the next sweep."""
        deadline = _monotonic_ns() + self._batch_delay_ns
        taken = {id(ch) for ch, _ in batch}
        while len(batch) < self._batch_max and not self.stopping:
            for ch in self.channels:
                if id(ch) in taken:
                    continue
                seq = _load(ch.req_seq)
                if (
                    seq != ch.last_seq
                    and seq != ch.taken
                    and _batchable(*_unpack_op_flags(ch.buf, _REQ_OP))
                ):
                    batch.append((ch, seq))
                    taken.add(id(ch))
            if _monotonic_ns() >= deadline:
                break

    def _serve_together(self, part: list[tuple[ServerChannel, int]]) -> None:
        """Takes ``part`` into the next batch (Dispatcher.begin_batch decodes it), started at
        once unless a batch's pass runs on the GPU: then it starts when that one is done
        (:meth:`_advance`). The dispatch lock is held while batches are taken or running."""
        picked = _monotonic_ns()
        door = self.doorbell
        if door is not None and (door.armed is not None or door.claims):
            self._drain()  # the GPU's books (_door_took) take the dispatch lock
        members: list[tuple[int, int, Any, Any]] = []
        served: list[tuple[ServerChannel, int, int, int]] = []  # channel, seq, op, queue ns
        for ch, seq in part:
            op, flags, body_len, publish_ns, deadline_ns = _unpack_request(ch.buf, _REQ_OP)
            queue_ns = picked - publish_ns if 0 < publish_ns <= picked else 0
            if body_len > ch.arena_bytes:
                if self.metrics is not None:
                    self.metrics.oversized += 1
                text = f"request body of {body_len} bytes exceeds the arena"
                n = encode_text(ch.resp_arena, text)
                self._reply(ch, seq, op, Status.PAYLOAD_TOO_LARGE, n, queue_ns, 0, 0)
                continue
            if deadline_ns and picked > deadline_ns:
                text = "the request's deadline passed before it was served"
                n = encode_text(ch.resp_arena, text)
                self._reply(ch, seq, op, Status.TIMEOUT, n, queue_ns, 0, 0)
                continue
            if (
                door is not None
                and (door.armed is not None or door.claims)
                and self._door_took(door, ch, seq, op, publish_ns)
            ):
                continue
            body = ch.req_arena[:body_len]
            if ch.pinned is not None:  # the GPU does not publish a batch member's response
                ch.pinned.arm(seq, queue_ns, picked, op, flags, body if door else None)
            ch.taken = seq  # in a batch: later sweeps pass it by until it is answered
            members.append((op, flags, body, ch.resp_arena))
            served.append((ch, seq, op, queue_ns))
        if not members:
            return
        if self._flight is None and self._next is None:
            self._lock.acquire()  # held until the batches taken are answered (_advance)
        taken = _monotonic_ns()
        nxt = self._next
        try:
            if nxt is None:
                nxt = self._next = _Flight(None, [], [], picked)
                nxt.run = self._begin_batch(members)  # decoded
            else:
                assert nxt.run is not None
                nxt.run.add(members)
        except Exception:  # a bug in the batch path: each alone, so it fails only itself
            _batch_failed(len(members))
            assert nxt is not None
            nxt.run = None
        nxt.members += members
        nxt.served += served
        self.batch_step_ns["decode"] += _monotonic_ns() - taken
        if self._flight is None:
            self._advance()

    def _advance(self, wait: bool = False) -> None:
        """Moves the batches on: once the pass that runs on the GPU is done (``wait``: waits
        for it), takes its answers, starts the next batch's pass, then writes the first
        one's responses and publishes them while the GPU runs the second (the GPU does not
        wait for the host's writes). Releases the dispatch lock once no batch is taken or
        running."""
        flight = self._flight
        landed = done = None
        try:
            if flight is not None:
                if not wait and not flight.done():
                    return
                self._flight = None
                t = _monotonic_ns()
                self.batch_running_ns += t - flight.started
                if flight.run is not None:  # its answers, out of the GPU's staging
                    _run_step(flight, flight.run.collect)
                self.batch_step_ns["collect"] += _monotonic_ns() - t
                if flight.run is None:  # its pass failed: each member alone, before the next
                    landed = self._finish(flight)
            nxt = self._next
            if nxt is not None:
                self._next = None
                self.batches += 1
                self.batched += len(nxt.members)
                if len(nxt.members) > self.largest_batch:
                    self.largest_batch = len(nxt.members)
                t = _monotonic_ns()
                running = nxt.run is not None and bool(_run_step(nxt, nxt.run.start))
                self.batch_step_ns["start"] += _monotonic_ns() - t
                if running:
                    nxt.started = _monotonic_ns()
                    self._flight = nxt
                    self.batches_run_ahead += 1
                else:
                    done = self._finish(nxt)
            if flight is not None and landed is None:
                landed = self._finish(flight)
        finally:
            if self._flight is None and self._next is None:
                self._lock.release()
        if landed is not None:  # the one before, while the GPU runs this one
            self._replies(landed)
        if done is not None:
            self._replies(done)

    def _drain(self) -> None:
        """Answers every batch taken or running and releases the dispatch lock: before
        anything else takes the lock or the GPU."""
        while self._flight is not None or self._next is not None:
            self._advance(wait=True)

    def _finish(self, flight: _Flight) -> _Flight:
        """``flight``'s answers written (under the dispatch lock): BatchRun.finish, or each
        member alone should the batch path fail."""
        t = _monotonic_ns()
        results = None if flight.run is None else _run_step(flight, flight.run.finish)
        if results is None:
            results = [self._handle(*m) for m in flight.members]
        flight.results = results
        self.batch_step_ns["write"] += _monotonic_ns() - t
        return flight

    def _replies(self, flight: _Flight) -> None:
        """Publishes a batch's responses (written by :meth:`_finish`): the wakes of parked
        callers are the waker's."""
        publish = self._waker.publish if self._waker is not None else _publish
        t = _monotonic_ns()
        for (ch, seq, op, queue_ns), (status, n, compute_ns, write_ns) in zip(
            flight.served, flight.results, strict=True
        ):
            self._reply(ch, seq, op, status, n, queue_ns, compute_ns, write_ns, publish)
        now = _monotonic_ns()
        self.batch_step_ns["reply"] += now - t
        self.batch_ns += now - flight.picked

    def _reply(
        self, ch: ServerChannel, seq: int, op: int, status: int, n: int, queue_ns: int,
        compute_ns: int, write_ns: int, publish=_publish,
    ) -> None:  # fmt: skip
        """Writes a response header and publishes request ``seq``'s response on ``ch``
        (``publish``: a batch's leaves the wake to the waker's thread)."""
        _pack_response(ch.buf, _RESP_STATUS, status, 0, n, queue_ns, compute_ns, write_ns)
        ch.last_seq = seq
        ch.taken = 0  # (a client that rewinds its sequence numbers may send this one again)
        publish(ch.resp_seq, seq, ch.client_parked, ch.client_bell)
        ch.requests += 1
        metrics = self.metrics
        if metrics is not None:  # after the publish: the client is not kept waiting for it
            metrics.record(op, status, queue_ns, compute_ns, write_ns)

    def _answered(self, ch: ServerChannel, seq: int, op: int, publish_ns: int) -> None:
        """The books of a request the GPU took and answered itself (server.doorbell): its
        response header and sequence word are written; storing the word again wakes a parked
        client. The metrics take its whole time from the client's publish as compute (0 when
        unknown). ``seq`` 0: one the poller never saw (its client has sent the next)."""
        if seq:
            ch.last_seq = seq
            _publish(ch.resp_seq, seq, ch.client_parked, ch.client_bell)
        ch.requests += 1
        self.device_published += 1
        metrics = self.metrics
        if metrics is not None:
            now = _monotonic_ns()
            compute_ns = now - publish_ns if 0 < publish_ns <= now else 0
            metrics.record(op, Status.OK, 0, compute_ns, 0)
