"""A batch left running while the poller serves on (kalos.server.channels, ``_Flight``).

On a GPU a batch's pass runs while the poller takes and decodes the next batch; the two
overlap. CI has no GPU, so here each batch's pass runs on the CPU at ``start`` and then says
it is still running for a while (2 or 30 ms), as a GPU's batched call does: the poller must
meanwhile take the next sweeps' requests into the next batch, never start a pass while
another runs, hold the dispatch lock while batches are taken or running, answer them before
anything else takes the lock (a write, a lone search), and give every caller its exact
answer once.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import kalos
from conftest import TIMEOUT
from kalos.protocol.codes import Op
from kalos.server import Sidecar, SidecarConfig
from kalos.server.dispatch import BatchRun, Dispatcher
from kalos.testing import check_search

DIM = 16
N = 300


class Log:
    """What the dispatcher did, in order: ("begin" | "start" | "finish", run) and ("handle",
    op); whether a pass was running at each handle, and whether the lock was held at each
    start."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []
        self.running: set[int] = set()
        self.handled_while_running: list[int] = []
        self.unlocked_starts = 0
        self.fail_finish: set[int] = set()  # runs whose finish raises
        self.pass_s = 0.002  # how long a pass runs on after its start
        self.runs: list = []  # every batch's Running
        self.mu = threading.Lock()

    def add(self, what: str, who: int) -> None:
        with self.mu:
            self.events.append((what, who))


@pytest.fixture
def running(monkeypatch, tmp_path):  # type: ignore[no-untyped-def]
    """A sidecar whose batches say their pass still runs after ``start``, and the log."""
    log = Log()
    begin, handle = Dispatcher.begin_batch, Dispatcher.handle
    counter = iter(range(1, 10**9))

    class Running:
        def __init__(self, run: BatchRun, me: int) -> None:
            self.run, self.me = run, me
            self.until = 0.0

        def add(self, members: list) -> None:
            log.add("add", self.me)
            self.run.add(members)

        def start(self) -> bool:
            assert not log.running, "a pass started while another ran"
            if not sidecar.lock.locked():
                log.unlocked_starts += 1
            self.run.start()  # the CPU's pass, done here
            log.add("start", self.me)
            log.running.add(self.me)
            self.until = time.monotonic() + log.pass_s
            return True  # as a GPU's: still running

        def done(self) -> bool:
            return time.monotonic() >= self.until

        def collect(self) -> None:
            log.add("collect", self.me)
            log.running.discard(self.me)
            if self.me in log.fail_finish:
                raise RuntimeError("the GPU failed")
            self.run.collect()

        def finish(self) -> list:
            log.add("finish", self.me)
            assert self.me not in log.running, "answers written before they were collected"
            return self.run.finish()

    def begin_batch(self, members):  # type: ignore[no-untyped-def]
        me = next(counter)
        log.add("begin", me)
        log.runs.append(Running(begin(self, members), me))
        return log.runs[-1]

    def handled(self, op, *args, **kwargs):  # type: ignore[no-untyped-def]
        if log.running:
            log.handled_while_running.append(op)
        log.add("handle", op)
        return handle(self, op, *args, **kwargs)

    monkeypatch.setattr(Dispatcher, "begin_batch", begin_batch)
    monkeypatch.setattr(Dispatcher, "handle", handled)
    config = SidecarConfig(name="flight", dim=DIM, runtime_dir=str(tmp_path), admin_port=None)
    sidecar = Sidecar(config).start()
    try:
        yield sidecar, log, str(tmp_path)
    finally:
        sidecar.stop()


def fill(client: kalos.Client) -> dict:
    rng = np.random.default_rng(5)
    vectors = rng.standard_normal((N, DIM)).astype(np.float32)
    ids = np.arange(1, N + 1, dtype=np.int64)
    client.add(vectors, ids)
    return {int(i): (v, (0, 0, 0)) for i, v in zip(ids, vectors, strict=True)}


def searchers(runtime_dir: str, items: dict, threads: int, rounds: int,
              writer: bool = False) -> list[str]:  # fmt: skip
    """``threads`` callers searching at once (and one adding rows beside them, never a
    top-k); the errors."""
    errors: list[str] = []
    barrier = threading.Barrier(threads + writer)

    def caller(t: int) -> None:
        try:
            client = kalos.connect("flight", runtime_dir=runtime_dir, timeout=TIMEOUT)
            rng = np.random.default_rng(100 + t)
            barrier.wait(TIMEOUT)
            for r in range(rounds):
                q = rng.standard_normal((1, DIM)).astype(np.float32)
                k = 1 + (t + r) % 12
                res = client.search(q, k, payloads=False, copy=True)
                check_search((res.scores, res.ids), items, q, k, "ip", None)
            client.close()
        except Exception as exc:  # reported by the test
            errors.append(f"caller {t}: {type(exc).__name__}: {exc}")

    def adder() -> None:
        try:
            client = kalos.connect("flight", runtime_dir=runtime_dir, timeout=TIMEOUT)
            barrier.wait(TIMEOUT)
            for r in range(rounds):
                client.add(np.full((1, DIM), 1e-4, np.float32), 10_000 + r)
            client.close()
        except Exception as exc:  # reported by the test
            errors.append(f"adder: {type(exc).__name__}: {exc}")

    workers = [threading.Thread(target=caller, args=(t,)) for t in range(threads)]
    if writer:
        workers.append(threading.Thread(target=adder))
    for w in workers:
        w.start()
    for w in workers:
        w.join(TIMEOUT)
    return errors


@pytest.mark.parametrize("pass_ms", [2, 30])
def test_batches_overlap_and_every_answer_is_exact(running, pass_ms: int) -> None:  # type: ignore[no-untyped-def]
    sidecar, log, runtime_dir = running
    log.pass_s = pass_ms / 1000
    loader = kalos.connect("flight", runtime_dir=runtime_dir, timeout=TIMEOUT)
    items = fill(loader)
    assert searchers(runtime_dir, items, threads=8, rounds=25, writer=True) == []
    stats = loader.stats()
    poller = sidecar.poller
    assert stats["batches_run_ahead"] == stats["batches"] >= 2, stats
    assert stats["batch_running_ns"] > 0
    assert poller._flight is None and not sidecar.lock.locked()  # idle: answered, released
    # every pass started under the dispatch lock, never while another ran (Running.start),
    # and nothing else reached the dispatcher while one ran: the adds and the lone
    # searches waited for it
    assert log.unlocked_starts == 0
    assert log.handled_while_running == []
    assert sum(1 for what, op in log.events if what == "handle" and op == Op.ADD) >= 25
    # each run: begun, started, collected, finished, in that order; and at least once the
    # next batch was decoded while one ran (begin of B between the start and the collect of A)
    order = {(what, who): i for i, (what, who) in enumerate(log.events) if what != "handle"}
    if pass_ms == 30:  # the callers a batch's replies freed come back over several sweeps
        assert any(what == "add" for what, _ in log.events), log.events
    runs = {who for what, who in log.events if what == "begin"}
    assert all(
        order[("begin", r)] < order[("start", r)] < order[("collect", r)] < order[("finish", r)]
        for r in runs
    )
    overlapped = [
        a for a in runs for b in runs
        if order[("start", a)] < order[("begin", b)] < order[("collect", a)]
    ]  # fmt: skip
    if pass_ms == 30:  # (in 2 ms the callers, threads of this process, may not get the GIL)
        assert overlapped, log.events
    # ... and the batch it decoded meanwhile started once that one's pass was over and its
    # answers taken, before its responses were written (the GPU does not wait for them)
    assert all(
        order[("collect", a)] < order[("start", a + 1)] < order[("finish", a)] for a in overlapped
    )
    # each caller's search taken and answered once
    assert stats["requests"]["search"] == 8 * 25
    assert (
        sum(1 for what, op in log.events if what == "handle" and op == Op.SEARCH)
        + sum(len(r.run._members) for r in log.runs)
        == 8 * 25
    )
    loader.close()


def test_a_failing_running_batch_answers_each_member_alone(running) -> None:  # type: ignore[no-untyped-def]
    sidecar, log, runtime_dir = running
    loader = kalos.connect("flight", runtime_dir=runtime_dir, timeout=TIMEOUT)
    items = fill(loader)
    log.fail_finish.update(range(1, 10**4, 2))  # every other batch's pass fails at its end
    assert searchers(runtime_dir, items, threads=6, rounds=15) == []
    assert loader.stats()["batches_run_ahead"] >= 2
    assert sidecar.poller._flight is None and not sidecar.lock.locked()
    loader.close()
