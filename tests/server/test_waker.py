"""The waker: a batch's parked callers woken on a thread of their own (kalos.server.waker),
over ``_native.publish_deferred`` and ``_native.wake_loop``."""

from __future__ import annotations

import ctypes
import mmap
import threading
import time

import numpy as np
import pytest

from kalos import _native as native
from kalos.server.waker import Waker

MS = 1_000_000  # ns


class Peer:
    """A caller's seq, parked and bell words in a shared page, and a thread that waits on
    them parked (no spin), as a client past its spin does."""

    def __init__(self, page: mmap.mmap, slot: int) -> None:
        base = ctypes.addressof(ctypes.c_char.from_buffer(page)) + slot * 384
        self.seq, self.parked, self.bell = base, base + 128, base + 256
        self.woke_at = 0.0
        self.reached: bool | None = None

    def park(self, target: int, timeout_ns: int = 5_000 * MS) -> threading.Thread:
        def wait() -> None:
            self.reached = native.wait_seq(self.seq, target, self.parked, self.bell, 0, timeout_ns)
            self.woke_at = time.monotonic()

        t = threading.Thread(target=wait, daemon=True)
        t.start()
        deadline = time.monotonic() + 5
        while not (native.load_acquire(self.parked) and asleep(t)):  # in its futex wait
            assert time.monotonic() < deadline
            time.sleep(0.001)
        return t


def asleep(t: threading.Thread) -> bool:
    """Whether thread ``t`` sleeps in the kernel (its flag alone is set before it does)."""
    with open(f"/proc/self/task/{t.native_id}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "S"


def ring(capacity: int) -> np.ndarray:
    """A ring with no thread consuming it (the layout of server.waker)."""
    r = np.zeros(64 + capacity, np.uint64)
    r[40] = capacity
    return r


@pytest.fixture
def page():
    mm = mmap.mmap(-1, 4096)
    yield mm


def test_a_parked_caller_is_woken_by_the_wakers_thread(page):
    peer = Peer(page, 0)
    waker = Waker()
    try:
        t = peer.park(1)
        t0 = time.monotonic()
        assert waker.publish(peer.seq, 1, peer.parked, peer.bell) is True
        t.join(5)
        assert peer.reached is True and peer.woke_at - t0 < 1.0  # not its 5 s timeout
        assert waker.deferred == 1 and native.load_acquire(peer.bell) == 1
        # a caller that is not parked: the sequence word only, nothing queued
        assert waker.publish(peer.seq, 2, peer.parked, peer.bell) is False
        assert native.load_acquire(peer.seq) == 2 and waker.deferred == 1
    finally:
        waker.close()


def test_the_wake_waits_on_the_ring_until_its_thread_runs(page):
    """The publish stores the word and rings the bell, but the syscall is the ring's consumer's:
    with none, the caller sleeps on (its bell moved, so a caller not yet asleep would not)."""
    peer = Peer(page, 0)
    r = ring(4)
    addr = r.ctypes.data
    t = peer.park(1)
    assert native.publish_deferred(peer.seq, 1, peer.parked, peer.bell, addr) is True
    assert int(r[0]) == 1 and int(r[64]) == peer.bell  # queued: the tail and its slot
    time.sleep(0.05)
    assert t.is_alive()  # still asleep: nobody made the wake
    consumer = threading.Thread(target=native.wake_loop, args=(addr, 0), daemon=True)
    consumer.start()
    t.join(5)
    assert peer.reached is True
    deadline = time.monotonic() + 5
    while int(r[8]) != 1:  # the head, stored once the wake's syscall returned
        assert time.monotonic() < deadline
        time.sleep(0.001)
    native.store_release(addr + 8 * 32, 1)  # stop, then ring the consumer's bell
    native.publish(addr, int(r[0]), addr + 8 * 16, addr + 8 * 24)
    consumer.join(5)
    assert not consumer.is_alive()


def test_a_full_ring_wakes_inline(page):
    first, second = Peer(page, 0), Peer(page, 1)
    r = ring(1)
    addr = r.ctypes.data
    t1, t2 = first.park(1), second.park(1)
    assert native.publish_deferred(first.seq, 1, first.parked, first.bell, addr) is True
    assert native.publish_deferred(second.seq, 1, second.parked, second.bell, addr) is True
    t2.join(5)
    assert second.reached is True and t1.is_alive()  # the second woke here; the first queued
    assert int(r[0]) == 1
    native.futex_wake(first.bell, 1)
    t1.join(5)


def test_close_wakes_what_is_queued_and_ends_the_thread(page):
    peers = [Peer(page, i) for i in range(6)]
    waker = Waker(capacity=8, spin_ns=0)
    threads = [p.park(1) for p in peers]
    for p in peers:
        waker.publish(p.seq, 1, p.parked, p.bell)
    waker.close()
    for p, t in zip(peers, threads, strict=True):
        t.join(5)
        assert p.reached is True
    assert waker.deferred == 6 and not waker._thread.is_alive()
    waker.close()  # twice: nothing more


def test_a_bell_whose_mapping_went_costs_the_waker_nothing():
    mm = mmap.mmap(-1, 4096)
    anchor = ctypes.c_char.from_buffer(mm)
    base = ctypes.addressof(anchor)
    native.store_release(base + 128, 1)  # its caller parked
    r = ring(4)
    addr = r.ctypes.data
    assert native.publish_deferred(base, 1, base + 128, base + 256, addr) is True
    del anchor
    mm.close()  # the channel's memory goes before the wake is made
    consumer = threading.Thread(target=native.wake_loop, args=(addr, 0), daemon=True)
    consumer.start()
    deadline = time.monotonic() + 5
    while int(r[8]) != 1:  # made (EFAULT), and the head moved past it
        assert time.monotonic() < deadline
        time.sleep(0.001)
    native.store_release(addr + 8 * 32, 1)
    native.publish(addr, int(r[0]), addr + 8 * 16, addr + 8 * 24)
    consumer.join(5)
    assert not consumer.is_alive()


def test_a_ring_must_have_a_power_of_two_capacity(page):
    with pytest.raises(ValueError, match="power of two"):
        Waker(capacity=3)
    r = ring(4)
    r[40] = 6
    with pytest.raises(ValueError, match="power of two"):
        native.publish_deferred(8, 1, 16, 24, r.ctypes.data)
    with pytest.raises(ValueError, match="power of two"):
        native.wake_loop(r.ctypes.data, 0)
