"""The poller's channel set under concurrent connects and disconnects (one listener thread
per connection adds and removes its own channel)."""

from __future__ import annotations

import sys
import threading

from kalos.protocol import layout as L
from kalos.server.channels import Poller
from kalos.transport.memory import SharedMemory, create


def test_concurrent_adds_and_removes_lose_no_channel() -> None:
    ctrl = SharedMemory(create("kalos-test-control", L.CONTROL_SIZE), L.CONTROL_SIZE)
    poller = Poller(ctrl, None, threading.Lock(), spin_us=0, heartbeat_ms=100)
    kept = [object() for _ in range(8)]  # stand-ins: the set only holds references
    start = threading.Barrier(8)

    def churn(mine: object) -> None:
        start.wait()
        for _ in range(3000):  # a channel that comes and goes, as a short-lived thread's
            brief = object()
            poller.add(brief)  # type: ignore[arg-type]
            poller.remove(brief)  # type: ignore[arg-type]
        poller.add(mine)  # type: ignore[arg-type]

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often: the race shows within a few rounds
    try:
        threads = [threading.Thread(target=churn, args=(c,)) for c in kept]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert sorted(map(id, poller.channels)) == sorted(map(id, kept))


def test_the_poller_publishes_how_many_callers_spin() -> None:
    """Each sweep counts the requests waiting for their response whose caller is not parked,
    over every channel, into the control segment (clients park at once beyond a quarter of
    the CPUs: transport.shm.SPINNERS). Requests taken into a batch count too (they are not
    served again)."""
    import os
    import time

    from kalos import _native
    from kalos.server.channels import ServerChannel

    ctrl = SharedMemory(create("kalos-test-control", L.CONTROL_SIZE), L.CONTROL_SIZE)
    poller = Poller(ctrl, None, threading.Lock(), spin_us=10**6, heartbeat_ms=100)
    channels = [ServerChannel(i, 7, L.MIN_ARENA_BYTES) for i in range(3)]
    for ch in channels:
        poller.add(ch)
    word = ctrl.addr + L.CTRL_SPINNING

    def wait_for(n: int) -> None:
        deadline = time.monotonic() + 10
        while _native.load_acquire(word) != n:
            assert time.monotonic() < deadline, (_native.load_acquire(word), n)
            time.sleep(0.001)

    spinner, sleeper, _idle = channels  # the third: no request
    for ch in (spinner, sleeper):  # a request each, taken (nothing here serves it)
        _native.store_release(ch.req_seq, 1)
        ch.taken = 1
    _native.store_release(sleeper.client_parked, 1)
    thread = threading.Thread(target=poller.run, daemon=True)
    thread.start()
    try:
        wait_for(1)  # the spinner; not the parked caller, nor the idle channel
        _native.store_release(sleeper.client_parked, 0)
        wait_for(2)
        _native.store_release(spinner.client_parked, 1)
        _native.store_release(sleeper.resp_seq, 1)
        sleeper.last_seq = 1  # answered
        wait_for(0)
    finally:
        poller.stop()
        thread.join(10)
        for ch in channels:
            ch.mem.close()
            os.close(ch.fd)
