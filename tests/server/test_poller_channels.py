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
