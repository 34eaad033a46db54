"""Records the spin of each shm request's first wait (not the slow path's slices after it)."""

from __future__ import annotations

import threading

import pytest

from kalos.transport import shm


def record_first_waits(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now on, each request's first wait appends its spin (ns) to the list returned."""
    spins: list[int] = []
    wait, slow = shm._wait_seq, shm.ShmTransport._wait_slow
    slicing = threading.local()

    def recording(seq: int, target: int, parked: int, bell: int, spin: int, timeout: int) -> bool:
        if not getattr(slicing, "on", False):
            spins.append(spin)
        return wait(seq, target, parked, bell, spin, timeout)

    def wait_slow(self: shm.ShmTransport, seq: int, deadline: int) -> None:
        slicing.on = True
        try:
            slow(self, seq, deadline)
        finally:
            slicing.on = False

    monkeypatch.setattr(shm, "_wait_seq", recording)
    monkeypatch.setattr(shm.ShmTransport, "_wait_slow", wait_slow)
    return spins
