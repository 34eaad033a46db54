"""Clients outlive their sidecar: killed, hung or restarted, with real sidecars and clients.

The SIGKILL test runs 4 client processes (spawned, two raising, two degrading) under load,
kills the sidecar and measures, from the kill, each client's first error (SidecarGone) or
degraded result: every one must come within the call's deadline (plus slack for a loaded
machine). Then a sidecar of the same name starts and every client must be served again
without being restarted; the time to recover is printed. Each wait has its own bound, so a
hanging client fails the test instead of hanging it.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import kalos
from conftest import stop_process
from kalos.errors import ConnectError, InvalidRequest, RequestTimeout, SidecarGone
from kalos.testing import RunningSidecar, isolated_sidecar

DIM = 8
CLIENTS = 4
DEADLINE = 1.0  # s: each call's timeout in the client processes
SLACK = 4.0  # s: a loaded 2-core CI machine may not schedule a client for a while
WAIT = 60.0  # s: the hard bound on every wait of the test


def client_process(
    i: int, name: str, runtime_dir: str, mode: str, events: multiprocessing.Queue, stop
) -> None:
    """Searches and adds in a loop; reports "ready", the first failure ("lost") after being
    served, and the first success after that ("back"), each with CLOCK_MONOTONIC."""
    client = kalos.connect(name, runtime_dir=runtime_dir, timeout=DEADLINE, on_unavailable=mode)
    rng = np.random.default_rng(i)
    q = rng.standard_normal(DIM).astype(np.float32)
    events.put((i, "ready", time.monotonic(), ""))
    phase = "serving"
    n = 0
    while not stop.is_set():
        n += 1
        try:
            if n % 4 == 0:
                client.add(q, 1000 * i + n % 50, "x")  # writes never degrade: they raise
                outcome = "ok"
            else:
                outcome = "degraded" if client.search(q, k=3).degraded else "ok"
        except (SidecarGone, ConnectError, RequestTimeout) as exc:
            outcome = type(exc).__name__
        except Exception as exc:  # reported, never a crash of this process
            outcome = f"unexpected {type(exc).__name__}: {exc}"
        now = time.monotonic()
        if phase == "serving" and outcome != "ok":
            events.put((i, "lost", now, outcome))
            phase = "lost"
        elif phase == "lost" and outcome == "ok":
            events.put((i, "back", now, str(client.reconnects)))
            phase = "back"
        if outcome != "ok":
            time.sleep(0.005)  # no busy loop against a missing sidecar
    client.close()


def collect(events: multiprocessing.Queue, kind: str, deadline: float) -> dict[int, tuple]:
    got: dict[int, tuple] = {}
    while len(got) < CLIENTS:
        left = deadline - time.monotonic()
        assert left > 0, f"only {sorted(got)} of {CLIENTS} clients reported {kind!r}: a hang"
        try:
            i, what, at, detail = events.get(timeout=left)
        except queue.Empty:
            continue
        assert what == kind, f"client {i} reported {what} ({detail}) while waiting for {kind}"
        got[i] = (at, detail)
    return got


@pytest.mark.slow
def test_sigkill_under_load_then_every_client_is_served_again(tmp_path: Path) -> None:
    runtime_dir = str(tmp_path / "run")
    ctx = multiprocessing.get_context("spawn")
    events = ctx.Queue()
    stop = ctx.Event()
    modes = ["raise" if i % 2 == 0 else "degrade" for i in range(CLIENTS)]
    procs: list = []
    try:
        with isolated_sidecar(dim=DIM, name="resilient", runtime_dir=runtime_dir) as first:
            procs = [
                ctx.Process(
                    target=client_process,
                    args=(i, first.name, runtime_dir, modes[i], events, stop),
                    daemon=True,
                )
                for i in range(CLIENTS)
            ]
            for p in procs:
                p.start()
            collect(events, "ready", time.monotonic() + WAIT)
            time.sleep(0.5)  # under load
            killed = time.monotonic()
            first.process.kill()
            lost = collect(events, "lost", killed + DEADLINE + SLACK)
            first.process.wait(WAIT)
        detection = {i: at - killed for i, (at, _) in lost.items()}
        for i, (_, outcome) in lost.items():
            expected = "SidecarGone" if modes[i] == "raise" else ("SidecarGone", "degraded")
            assert outcome in expected, f"client {i} ({modes[i]}): {outcome}"
        launched = time.monotonic()
        with isolated_sidecar(dim=DIM, name="resilient", runtime_dir=runtime_dir):
            accepting = time.monotonic()  # (a client may beat the probe that tells this)
            back = collect(events, "back", accepting + WAIT)
        recovery = {i: max(at - accepting, 0.0) for i, (at, _) in back.items()}
        print(
            "\nkill -> first error or degraded result, per client (ms): "
            + ", ".join(f"{modes[i]} {detection[i] * 1e3:.1f}" for i in sorted(detection))
            + f"\nnew sidecar launched -> accepting: {(accepting - launched) * 1e3:.0f} ms"
            + "; accepting -> client served again (ms): "
            + ", ".join(f"{recovery[i] * 1e3:.1f}" for i in sorted(recovery))
        )
        assert max(detection.values()) < DEADLINE + SLACK
        assert all(int(reconnects) >= 1 for _, reconnects in back.values())
        assert all(p.is_alive() for p in procs)  # none crashed
    finally:
        stop.set()
        for p in procs:
            p.join(WAIT / 4)
            if p.is_alive():
                p.kill()
                p.join()
    assert all(p.exitcode == 0 for p in procs)


def test_a_hung_sidecar_is_gone_within_the_deadline(
    sidecar: Callable[..., RunningSidecar],
) -> None:
    sc = sidecar(dim=DIM, name="hung")
    raising = sc.connect(timeout=5.0, hung_after=0.5)
    degrading = sc.connect(timeout=5.0, hung_after=0.5, on_unavailable="degrade")
    q = np.ones(DIM, np.float32)
    raising.add(q, 1, "one")
    stop_process(sc.process.pid)
    try:
        t0 = time.monotonic()
        with pytest.raises(SidecarGone, match="hangs"):
            raising.ping()
        hung_ms = (time.monotonic() - t0) * 1e3
        t0 = time.monotonic()
        r = degrading.search(q, k=3)
        assert r.degraded and r.ids.tolist() == [-1, -1, -1] and r.payloads == [None] * 3
        assert time.monotonic() - t0 < 5.0
        # a reconnect to a sidecar that still hangs fails within the call's deadline
        t0 = time.monotonic()
        with pytest.raises((ConnectError, RequestTimeout)):
            raising.ping(timeout=0.5)
        assert time.monotonic() - t0 < 0.5 + SLACK
        print(f"\nhung sidecar noticed after {hung_ms:.0f} ms (hung_after 500 ms)")
        assert hung_ms < 5000
    finally:
        os.kill(sc.process.pid, signal.SIGCONT)
    raising.ping()  # the same clients carry on, on new channels
    r = degrading.search(q, k=1)
    assert not r.degraded and r.ids.tolist() == [1]
    assert raising.reconnects == 1 and degrading.reconnects == 1
    # the request abandoned while it hung was expired, not carried out when it resumed
    assert raising.stats()["items"] == 1


def test_a_restarted_sidecar_has_a_new_epoch(
    sidecar: Callable[..., RunningSidecar], tmp_path: Path
) -> None:
    runtime_dir = str(tmp_path / "run")
    first = sidecar(dim=DIM, name="epoch", runtime_dir=runtime_dir)
    client = first.connect(timeout=5.0)
    degrading = first.connect(timeout=5.0, on_unavailable="degrade")
    client.add(np.ones(DIM), 1)
    degrading.ping()
    old = client.epoch
    assert old == client.stats()["epoch"]
    first.stop()  # SIGTERM: the control segment says STOPPING, the sockets close
    with pytest.raises(SidecarGone):
        client.ping()
    with pytest.raises(ConnectError):  # nobody to reconnect to yet
        client.ping()
    # degrading: searches and contexts come back empty, writes and bad input still raise
    assert degrading.search(np.ones(DIM), k=2).degraded
    ctx = degrading.context("s", max_tokens=10)
    assert ctx.degraded and len(ctx.tokens) == 0 and len(ctx.turns or ()) == 0
    with pytest.raises((SidecarGone, ConnectError)):
        degrading.add(np.ones(DIM), 2)
    with pytest.raises(InvalidRequest):
        degrading.search(np.ones(DIM + 1), k=1)
    with pytest.raises(InvalidRequest):
        degrading.search(np.ones(DIM), k=0)
    sidecar(dim=DIM, name="epoch", runtime_dir=runtime_dir)
    client.ping()
    assert client.epoch != old and client.epoch == client.stats()["epoch"]
    assert client.reconnects == 1
    r = degrading.search(np.ones(DIM), k=1)
    assert not r.degraded and r.ids.tolist() == [-1]  # a new, empty sidecar
    assert degrading.reconnects == 1
