"""The wakes of a batch's parked callers, made on a thread of their own.

A caller that waits longer than its spin parks on its channel's bell, and the response's
publish then makes a FUTEX_WAKE: ~7 µs of the publisher's thread on the 2-core VM, a syscall
and an interrupt to the caller's CPU. The poller answers a batch of up to 64 searches at once,
most of whose callers have parked while the batch ran; made there, their wakes would cost it
longer than the batch's own encoding. :meth:`Waker.publish` stores the response's sequence word
as ``publish`` does (a spinning caller sees it at once) and rings the bell, and leaves the
syscall to the waker's thread (``_native.wake_loop``, which holds no GIL), so the poller goes
on to the next sweep while the callers are woken.

Only the poller's thread publishes through a waker (the ring has one producer). A bell whose
channel has gone before its wake costs the waker's thread an EFAULT, nothing else.
"""

from __future__ import annotations

import threading

import numpy as np

from kalos import _native

CAPACITY = 1024  # bells queued at once; a full ring's publish wakes inline
SPIN_NS = 20_000  # how long the waker's thread spins for the next batch before it sleeps

# The ring's words (src/kalos/_native.c, RING_*): each on its own cache line.
_TAIL, _HEAD, _PARKED, _BELL, _STOP, _CAPACITY, _SLOTS = 0, 8, 16, 24, 32, 40, 64


class Waker:
    """A ring of bells to wake and the thread that wakes them (module doc)."""

    def __init__(self, capacity: int = CAPACITY, spin_ns: int = SPIN_NS) -> None:
        if capacity < 1 or capacity & (capacity - 1):
            raise ValueError(f"capacity must be a power of two, not {capacity}")
        self._ring = np.zeros(_SLOTS + capacity, np.uint64)
        self._ring[_CAPACITY] = capacity
        self.addr = self._ring.ctypes.data
        self._thread = threading.Thread(
            target=_native.wake_loop, args=(self.addr, spin_ns), name="kalos-waker", daemon=True
        )
        self._thread.start()

    def publish(self, seq_addr: int, value: int, parked_addr: int, bell_addr: int) -> bool:
        """``_native.publish``, the wake made by the waker's thread: True if the caller was
        parked."""
        return _native.publish_deferred(seq_addr, value, parked_addr, bell_addr, self.addr)

    @property
    def deferred(self) -> int:
        """The wakes queued so far."""
        return int(self._ring[_TAIL])

    def close(self) -> None:
        """Wakes what is queued, then ends the waker's thread."""
        if not self._thread.is_alive():
            return
        a = self.addr
        _native.store_release(a + 8 * _STOP, 1)
        _native.publish(a + 8 * _TAIL, int(self._ring[_TAIL]), a + 8 * _PARKED, a + 8 * _BELL)
        self._thread.join()
