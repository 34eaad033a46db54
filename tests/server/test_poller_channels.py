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


def test_a_steady_trickle_keeps_the_poller_spinning_through_its_gaps() -> None:
    """With max_spin_us, the poller spins SPIN_GAPS times the mean gap between requests
    while that fits within max_spin_us, else spin_us; an idle spell counts as max_spin_us
    only, so that a trickle after a long pause is spun through again within a few requests;
    0 turns it off."""
    from kalos.server.channels import SPIN_GAPS

    ctrl = SharedMemory(create("kalos-test-control", L.CONTROL_SIZE), L.CONTROL_SIZE)
    poller = Poller(ctrl, None, threading.Lock(), spin_us=200, heartbeat_ms=100,
                    max_spin_us=10_000)  # fmt: skip
    assert poller.spin_ns == 200_000  # no trickle yet
    now = 0
    for _ in range(100):  # a request every 1 ms
        poller._arrived(now + 1_000_000, now)
        now += 1_000_000
    assert abs(poller.gap_ns - 1_000_000) < 10_000
    assert poller.spin_ns == SPIN_GAPS * poller.gap_ns  # 5 ms: within 10
    poller._arrived(now + 60 * 10**9, now)  # a minute's pause weighs as 10 ms
    assert poller.gap_ns < 2_200_000
    for _ in range(3):  # so a few more requests of the trickle bring the spin back
        poller._arrived(now + 1_000_000, now)
        now += 1_000_000
    assert 200_000 < poller.spin_ns <= 10_000_000
    for _ in range(100):  # every 4 ms: 20 ms of spin would not fit, so spin_us
        poller._arrived(now + 4_000_000, now)
        now += 4_000_000
    assert poller.spin_ns == 200_000
    for _ in range(100):  # every 20 µs: never below spin_us
        poller._arrived(now + 20_000, now)
        now += 20_000
    assert poller.spin_ns == 200_000

    off = Poller(ctrl, None, threading.Lock(), spin_us=200, heartbeat_ms=100)
    off._arrived(1_000_000, 0)  # (the loop does not even call it when off)
    assert off.gap_ns == 0 and off.spin_ns == 200_000


def test_a_sidecar_reports_its_poller_spin() -> None:
    """kalos serve --max-spin-us: pings every ~1 ms raise the poller's spin (stats
    poller_spin_us) above --spin-us; without the option it stays --spin-us."""
    import time

    from kalos.testing import isolated_sidecar

    for extra, spun in ((("--max-spin-us", "100000"), True), ((), False)):
        with isolated_sidecar(dim=4, extra_args=("--spin-us", "200", *extra)) as sidecar:
            client = sidecar.connect()
            try:
                for _ in range(200):
                    client.ping()
                    time.sleep(0.001)
                spin = client.stats()["poller_spin_us"]
            finally:
                client.close()
        assert (spin > 1000) if spun else (spin == 200), (extra, spin)
