"""AsyncClient against real sidecars: every method, 64 concurrent tasks, a loop that is never
blocked, cancellation, deadlines (queued ones too), a killed sidecar and the reconnect.

Each test runs its own event loop with ``asyncio.run`` (no pytest plugin). A "slow request" is
one sent to a SIGSTOPped sidecar: it waits until SIGCONT, as long as the test wants.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import kalos
from conftest import TIMEOUT, stop_process
from first_waits import record_first_waits
from kalos.async_client import _Completions, _cuda_stream, _owned
from kalos.errors import (
    ClosedError,
    ConfigError,
    ConnectError,
    InvalidRequest,
    NotFound,
    RequestTimeout,
    SidecarGone,
)
from kalos.protocol import layout as L
from kalos.protocol.messages import Scope
from kalos.testing import RunningSidecar, isolated_sidecar

DIM = 8
SMALL = L.MIN_ARENA_BYTES  # 64 KiB arenas: 64 channels stay small


def connect(sidecar: RunningSidecar, **kw: object) -> kalos.AsyncClient:
    kw.setdefault("timeout", TIMEOUT)
    kw.setdefault("arena_bytes", SMALL)
    return kalos.AsyncClient(sidecar.name, runtime_dir=sidecar.runtime_dir, **kw)  # type: ignore[arg-type]


def public_methods(cls: type) -> set[str]:
    return {n for n, v in vars(cls).items() if not n.startswith("_") and inspect.isfunction(v)}


def test_every_client_method_is_a_coroutine_with_the_same_signature() -> None:
    # record_stages: a benchmark hook of the sync client's threads (per-thread stamps).
    names = public_methods(kalos.Client) - {"close", "record_stages"}
    assert names <= public_methods(kalos.AsyncClient) | {
        n for n, v in vars(kalos.AsyncClient).items() if inspect.iscoroutinefunction(v)
    }
    for name in names:
        method = getattr(kalos.AsyncClient, name)
        assert inspect.iscoroutinefunction(method), name
        assert inspect.signature(method) == inspect.signature(getattr(kalos.Client, name)), name
    for name in ("close", "aclose", "connect", "__aenter__", "__aexit__"):
        assert inspect.iscoroutinefunction(getattr(kalos.AsyncClient, name)), name
    # connect_async takes connect's parameters (the options, as keywords or options=), plus
    # max_channels
    sync = inspect.signature(kalos.connect).parameters
    async_ = inspect.signature(kalos.connect_async).parameters
    assert set(async_) - set(sync) == {"max_channels"}
    for name, p in sync.items():
        assert async_[name].kind == p.kind, name
        assert async_[name].default == p.default, name


@pytest.mark.parametrize("transport", ["shm", "uds", "grpc"])
def test_every_method(transport: str, sidecar: Callable[..., RunningSidecar]) -> None:
    if transport == "grpc":
        pytest.importorskip("grpc")
    running = sidecar(dim=DIM)  # with a grpc listener when transport is grpc (conftest)
    rng = np.random.default_rng(1)
    vectors = rng.standard_normal((20, DIM)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)  # each its own best hit
    acme = Scope("acme", "u1")

    def make() -> kalos.AsyncClient:
        if transport == "grpc":
            return kalos.AsyncClient(running.grpc_target(), transport="grpc", timeout=TIMEOUT)
        return connect(running, transport=transport)

    async def main() -> None:
        async with make() as c:
            assert c.dim == DIM and c.info["dim"] == DIM and c.epoch != 0
            timings = await c.ping()
            assert timings.total_us > 0 and c.last_timings == timings
            assert await c.add(vectors, np.arange(20), [f"t{i}" for i in range(20)]) == 20
            hits = await c.search(vectors[3], k=3)
            assert hits.ids[0] == 3 and hits.payloads is not None and hits.payloads[0] == "t3"
            assert hits.ids.flags.owndata and hits.scores.flags.owndata
            batch = await c.search(vectors[:2], k=1, payloads=False)
            assert batch.ids.tolist() == [[0], [1]] and batch.payloads is None
            assert (await c.stats())["items"] == 20
            assert await c.remove([0, 1, 99]) == 2
            tokens = np.arange(5, dtype=np.int32)
            added = await c.append_turn("s1", "user", "hello", tokens, scope=acme)
            assert added == (1, 5)
            await c.append_turn("s1", "system", "be brief", [7], pin=True, scope=acme)
            ctx = await c.context("s1", max_tokens=100, scope=acme)
            assert ctx.tokens.tolist() == [7, 0, 1, 2, 3, 4] and ctx.system
            assert list(ctx.turns or []) == [("system", "be brief"), ("user", "hello")]
            assert ctx.tokens.flags.owndata
            assert [s.session for s in await c.sessions(acme)] == ["s1"]
            await c.append_turn("s1", "user", "again", [8, 9], scope=acme)
            assert await c.trim("s1", keep_turns=1, scope=acme) == 1
            v1 = await c.put("plan", "step 1", scope=acme)
            v2 = await c.cas("plan", v1, b"step 2", scope=acme)
            assert v2 > v1
            got = await c.get("plan", scope=acme)
            assert got.version == v2 and got.value == b"step 2"
            assert await c.delete("plan", scope=acme) is True
            with pytest.raises(NotFound):
                await c.get("plan", scope=acme)
            assert await c.log("s1", "tool_call", "search()", scope=acme) == 1
            assert [e.kind for e in await c.events("s1", scope=acme)] == ["tool_call"]
            await c.delete_session("s1", scope=acme)
            with pytest.raises(NotFound):
                await c.context("s1", max_tokens=10, scope=acme)
            await c.add(vectors[0], 500, "mine", scope=acme)
            gone = await c.forget(acme)
            assert gone.memories == 1 and gone.logs == 1
            with pytest.raises(InvalidRequest):  # bad input raises from the await, as in Client
                await c.search(vectors[0, :3], k=1)
            with pytest.raises(ConfigError):  # as in Client: needs gpu_results on a cuda sidecar
                await c.search_gpu(vectors[0], k=1)
            await c.add(vectors[5:7], [105, 106], ["five", "six"], tokens=[[50, 51], [60]])
            await c.append_turn("s2", "user", "hi", [1, 2])
            recalled = await c.recall("s2", vectors[5], k=1, max_tokens=100)
            assert recalled.ids.tolist() == [105] and recalled.texts == ["five"]
            assert recalled.token_ids.tolist() == [50, 51, 1, 2]
            assert recalled.token_ids.flags.owndata and recalled.ids.flags.owndata
            assert (await c.ping()).total_us > 0  # and the channel still serves
        with pytest.raises(ClosedError):
            await c.ping()

    asyncio.run(main())


def test_64_concurrent_tasks_each_get_their_own_answers(
    sidecar: Callable[..., RunningSidecar],
) -> None:
    running = sidecar(dim=DIM)
    tasks = 64
    rng = np.random.default_rng(2)
    vectors = rng.standard_normal((tasks, DIM)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)

    async def worker(c: kalos.AsyncClient, i: int) -> list[tuple[object, object]]:
        held = []  # results kept across other tasks' calls: must stay this task's
        for round_ in range(5):
            await c.put(f"k{i}", f"v{i}-{round_}")
            await c.append_turn(f"s{i}", "user", f"turn {round_}", [i, round_])
            hits = await c.search(vectors[i], k=1)
            ctx = await c.context(f"s{i}", max_tokens=1000)
            held.append((hits, ctx))
            assert (await c.get(f"k{i}")).value == f"v{i}-{round_}".encode()
        return held

    async def main() -> None:
        async with connect(running, max_channels=64) as c:
            await c.add(vectors, np.arange(tasks), [f"p{i}" for i in range(tasks)])
            results = await asyncio.gather(*(worker(c, i) for i in range(tasks)))
            assert 1 < c.channels <= 64
        for i, held in enumerate(results):
            for round_, (hits, ctx) in enumerate(held):
                assert hits.ids.tolist() == [i] and hits.payloads == [f"p{i}"]
                expected = [t for r in range(round_ + 1) for t in (i, r)]
                assert ctx.tokens.tolist() == expected

    asyncio.run(main())


def test_the_loop_keeps_ticking_while_64_requests_wait(
    sidecar: Callable[..., RunningSidecar],
) -> None:
    running = sidecar(dim=DIM)
    stall = 0.6  # s: every request waits this long (the sidecar is stopped)

    async def main() -> None:
        async with connect(running, max_channels=64, hung_after=60.0) as c:
            await asyncio.gather(*(c.put(f"k{i}", str(i)) for i in range(64)))  # 64 channels
            gaps: list[float] = []
            stop = asyncio.Event()

            async def ticker() -> None:
                last = time.monotonic()
                while not stop.is_set():
                    await asyncio.sleep(0.001)
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now

            tick = asyncio.create_task(ticker())
            await asyncio.sleep(0.05)
            stop_process(running.process.pid)
            t0 = time.monotonic()
            # Resumed from another thread: a blocked loop could not do it, and would fail on
            # the gap below instead of hanging.
            resume = threading.Timer(stall, os.kill, (running.process.pid, signal.SIGCONT))
            resume.start()
            calls = [asyncio.create_task(c.get(f"k{i}")) for i in range(64)]
            values = await asyncio.gather(*calls)
            resume.join()
            waited = time.monotonic() - t0
            stop.set()
            await tick
        assert [v.value for v in values] == [str(i).encode() for i in range(64)]
        assert waited >= stall
        # A loop blocked by any one request would show one gap of ~`stall`.
        assert max(gaps) < stall / 2, max(gaps)
        assert len(gaps) > 50

    asyncio.run(main())


def test_results_are_owned_by_the_caller(sidecar: Callable[..., RunningSidecar]) -> None:
    running = sidecar(dim=DIM)
    vectors = np.eye(DIM, dtype=np.float32)

    async def main() -> None:
        async with connect(running, max_channels=1) as c:  # one channel: every call reuses it
            await c.add(vectors, np.arange(DIM))
            await c.append_turn("a", "user", "x", [1, 2, 3])
            first = await c.search(vectors[1], k=2)
            ctx = await c.context("a", max_tokens=10)
            ids, scores = first.ids.copy(), first.scores.copy()
            for _ in range(3):
                await c.search(vectors[5], k=2)
                await c.context("a", max_tokens=1)
            assert np.array_equal(first.ids, ids) and np.array_equal(first.scores, scores)
            assert ctx.tokens.tolist() == [1, 2, 3]

    asyncio.run(main())


def test_owned_copies_views_and_keeps_owned_values() -> None:
    arena = np.arange(10, dtype=np.int64)
    view = arena[2:5]
    copy = _owned(view)
    assert copy.flags.owndata and copy.tolist() == [2, 3, 4]
    arena[2] = 99
    assert copy[0] == 2
    owned = np.zeros(3)
    assert _owned(owned) is owned
    timings = kalos.Timings(1.0, 2.0, 3.0, 4.0)
    assert _owned(timings) is timings
    hits = kalos.SearchResult(arena[:2], np.ones(2, np.float32)[:2], ["a", "b"], timings)
    out = _owned(hits)
    assert out.ids.flags.owndata and out.payloads is hits.payloads and out.timings is timings
    torch = pytest.importorskip("torch")
    t = torch.arange(4)
    c = _owned(t[1:3])
    t[1] = 7
    assert c.tolist() == [1, 2]
    assert _cuda_stream((t, np.zeros(2)), {"scope": None}) is None  # host tensors: no stream


def test_cancelling_a_call_leaves_its_channel_usable(
    sidecar: Callable[..., RunningSidecar],
) -> None:
    running = sidecar(dim=DIM)

    async def main() -> None:
        async with connect(running, max_channels=1, hung_after=60.0) as c:
            await c.put("a", "A")
            await c.put("b", "B")
            stop_process(running.process.pid)
            sent = asyncio.create_task(c.get("a"))  # on the channel, waiting for the sidecar
            queued = asyncio.create_task(c.put("a", "never"))  # behind it, for the channel
            await asyncio.sleep(0.1)
            sent.cancel()
            queued.cancel()
            with pytest.raises(asyncio.CancelledError):
                await sent
            with pytest.raises(asyncio.CancelledError):
                await queued
            os.kill(running.process.pid, signal.SIGCONT)
            # The cancelled get's answer is drained before the channel serves anyone else:
            assert (await c.get("b")).value == b"B"
            assert (await c.get("a")).value == b"A"  # and the queued put never ran
            assert c.reconnects == 0 and c.channels == 1

    asyncio.run(main())


def test_deadlines_of_sent_and_queued_calls(sidecar: Callable[..., RunningSidecar]) -> None:
    running = sidecar(dim=DIM)

    async def main() -> None:
        async with connect(running, max_channels=1, hung_after=60.0) as c:
            await c.ping()
            stop_process(running.process.pid)
            t0 = time.monotonic()
            sent = asyncio.create_task(c.ping(timeout=1.0))
            await asyncio.sleep(0.01)
            with pytest.raises(RequestTimeout):  # queued behind `sent` all along
                await c.ping(timeout=0.2)
            queued_s = time.monotonic() - t0
            with pytest.raises(RequestTimeout):
                await sent
            sent_s = time.monotonic() - t0
            assert 0.2 <= queued_s < 0.9, queued_s  # its own deadline, not the channel's
            assert 1.0 <= sent_s < 1.0 + 5.0, sent_s
            os.kill(running.process.pid, signal.SIGCONT)
            await c.ping()  # a new channel: the timed-out one is never reused
            assert c.reconnects == 1

    asyncio.run(main())


def test_a_timeout_that_is_none_is_refused_at_the_await(
    sidecar: Callable[..., RunningSidecar],
) -> None:
    running = sidecar(dim=DIM)

    async def main() -> None:
        async with connect(running) as c:
            for bad in (-1, float("nan"), float("inf")):
                with pytest.raises(InvalidRequest, match="timeout must be"):
                    await c.ping(timeout=bad)
            with pytest.raises(RequestTimeout):  # no time at all
                await c.ping(timeout=0)
            await c.ping(timeout=1.0)

    asyncio.run(main())


def test_killed_sidecar_degrades_raises_then_reconnects(tmp_path: Path) -> None:
    runtime_dir = str(tmp_path / "run")
    q = np.ones(DIM, np.float32)

    async def main() -> None:
        with isolated_sidecar(dim=DIM, name="phoenix", runtime_dir=runtime_dir) as first:
            # One channel thread: a call whose thread is not back in the pool yet would start
            # a new one, with no broken channel to reopen (reconnects would stay 0).
            c = await kalos.connect_async(
                "phoenix", runtime_dir=runtime_dir, timeout=2.0, on_unavailable="degrade",
                max_channels=1,
            )  # fmt: skip
            await c.add(q, 1, "one")
            assert (await c.search(q, k=1)).ids.tolist() == [1]
            epoch = c.epoch
            first.stop(signal.SIGKILL)
            hits = await c.search(q, k=2)
            assert hits.degraded and hits.ids.tolist() == [-1, -1]
            ctx = await c.context("s", max_tokens=10)
            assert ctx.degraded and len(ctx.tokens) == 0
            with pytest.raises((SidecarGone, ConnectError)):  # writes never degrade
                await c.put("k", "v")
        with isolated_sidecar(dim=DIM, name="phoenix", runtime_dir=runtime_dir):
            await c.add(q, 2, "two")  # the same client, served again
            hits = await c.search(q, k=1)
            assert not hits.degraded and hits.ids.tolist() == [2]
            assert c.epoch != epoch and c.reconnects >= 1
            await c.close()

    asyncio.run(main())


def test_killed_sidecar_raises_sidecar_gone_in_flight(
    sidecar: Callable[..., RunningSidecar],
) -> None:
    running = sidecar(dim=DIM)

    async def main() -> None:
        async with connect(running, hung_after=60.0) as c:
            await c.ping()
            stop_process(running.process.pid)
            calls = [asyncio.create_task(c.ping()) for _ in range(4)]
            await asyncio.sleep(0.05)
            running.process.kill()  # SIGKILL ends a stopped process too
            outcomes = await asyncio.gather(*calls, return_exceptions=True)
        # The call on the open channel sees the sidecar die; calls that had to open a new
        # channel (a handshake the stopped sidecar never answered) fail to connect.
        assert any(isinstance(o, SidecarGone) for o in outcomes), outcomes
        assert all(isinstance(o, (SidecarGone, ConnectError)) for o in outcomes), outcomes

    asyncio.run(main())


def test_connect_errors_and_close(tmp_path: Path, sidecar: Callable[..., RunningSidecar]) -> None:
    async def main() -> None:
        with pytest.raises(ConnectError):
            await kalos.connect_async("nobody", runtime_dir=str(tmp_path), timeout=1.0)
        c = kalos.AsyncClient("nobody", runtime_dir=str(tmp_path))
        with pytest.raises(ConnectError):  # not connected: properties need a handshake
            _ = c.dim
        await c.close()
        running = sidecar(dim=DIM)
        c = await kalos.connect_async(running.name, runtime_dir=running.runtime_dir)
        await c.ping()
        await c.close()
        await c.aclose()  # idempotent
        with pytest.raises(ClosedError):
            await c.put("k", "v")

    asyncio.run(main())


def test_a_queued_search_past_its_deadline_degrades(sidecar: Callable[..., RunningSidecar]) -> None:
    running = sidecar(dim=DIM)
    q = np.ones(DIM, np.float32)

    async def main() -> None:
        async with connect(running, max_channels=1, hung_after=60.0, on_unavailable="degrade") as c:
            await c.add(q, 1)
            stop_process(running.process.pid)
            sent = asyncio.create_task(c.search(q, k=1, timeout=1.0))
            await asyncio.sleep(0.01)
            t0 = time.monotonic()
            queued = await c.search(q, k=2, timeout=0.1)  # never had a channel
            assert time.monotonic() - t0 < 0.8
            assert queued.degraded and queued.ids.tolist() == [-1, -1]
            ctx = await c.context("s", max_tokens=5, timeout=0.1)
            assert ctx.degraded
            with pytest.raises(RequestTimeout):  # a write never degrades
                await c.put("k", "v", timeout=0.1)
            assert (await sent).degraded  # its own deadline passed on the stopped sidecar
            os.kill(running.process.pid, signal.SIGCONT)
            assert (await c.search(q, k=1)).ids.tolist() == [1]

    asyncio.run(main())


def test_a_dropped_client_ends_its_threads(sidecar: Callable[..., RunningSidecar]) -> None:
    running = sidecar(dim=DIM)

    async def use() -> list[threading.Thread]:
        c = connect(running, max_channels=4)
        await asyncio.gather(*(c.ping() for _ in range(8)))
        return list(c._threads._threads)  # never closed: dropped here

    threads = asyncio.run(use())
    assert threads
    gc.collect()
    for t in threads:
        t.join(TIMEOUT)
        assert not t.is_alive()


def test_many_cancelled_awaits_never_mix_up_answers(
    sidecar: Callable[..., RunningSidecar],
) -> None:
    running = sidecar(dim=DIM)
    rng = np.random.default_rng(4)

    async def main() -> None:
        async with connect(running, max_channels=8) as c:
            await asyncio.gather(*(c.put(f"k{i}", f"v{i}") for i in range(32)))
            answered = cancelled = 0
            for round_ in range(6):
                keys = rng.integers(0, 32, 48)
                calls = [asyncio.create_task(c.get(f"k{k}")) for k in keys]
                # round 0 cancels before any call ran (so some surely are cancelled, however
                # fast the calls); the others at a random moment, mostly mid-flight
                await asyncio.sleep(0.0 if round_ == 0 else float(rng.uniform(0, 0.002)))
                for call in calls:
                    if rng.random() < 0.5:
                        call.cancel()
                outcomes = await asyncio.gather(*calls, return_exceptions=True)
                for k, out in zip(keys, outcomes, strict=True):
                    if isinstance(out, asyncio.CancelledError):
                        cancelled += 1
                    else:
                        assert out.value == f"v{k}".encode(), (k, out)
                        answered += 1
            assert answered and cancelled
            assert c.reconnects == 0  # every channel was drained, none discarded

    asyncio.run(main())


def test_results_from_many_threads_reach_the_loop_in_few_wake_ups() -> None:
    """Channel threads hand results back through _Completions: every future is resolved
    once, on the loop, with its own value or exception, and results that arrive together
    share a wake-up; a closed loop drops them without raising on the thread."""
    resolved: list[tuple[asyncio.Future, bool, object]] = []

    class Resolver:  # as AsyncClient._done, held weakly
        def done(self, future: asyncio.Future, ok: bool, value: object) -> None:
            assert threading.current_thread() is threading.main_thread()
            resolved.append((future, ok, value))
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)  # type: ignore[arg-type]

    resolver = Resolver()
    completions = _Completions(weakref.WeakMethod(resolver.done))
    drains = 0
    drain = completions._drain

    def counted(entry: list) -> None:
        nonlocal drains
        drains += 1
        drain(entry)

    completions._drain = counted  # type: ignore[method-assign]

    async def main() -> None:
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in range(2000)]

        def hand(part: range) -> None:
            for i in part:
                value = ValueError(i) if i % 7 == 0 else i
                completions.hand_back(loop, futures[i], i % 7 != 0, value)

        for wave in (range(0, 1000), range(1000, 2000)):  # the second after a drain
            threads = [threading.Thread(target=hand, args=(wave[t::8],)) for t in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                await asyncio.to_thread(t.join)
            gathered = asyncio.gather(*futures[wave.start : wave.stop], return_exceptions=True)
            results = await asyncio.wait_for(gathered, TIMEOUT)  # a lost result: a failure
            for i, r in zip(wave, results, strict=True):
                if i % 7 == 0:
                    assert isinstance(r, ValueError) and r.args == (i,)
                else:
                    assert r == i

    asyncio.run(main())
    assert len(resolved) == 2000 and len({id(f) for f, _, _ in resolved}) == 2000
    assert 2 <= drains < 2000
    loop = asyncio.new_event_loop()
    loop.close()
    completions.hand_back(loop, None, True, 1)  # type: ignore[arg-type]  # nobody waits


def test_channel_threads_park_at_once_while_more_calls_than_spinners_wait(
    sidecar: Callable[..., RunningSidecar], monkeypatch: pytest.MonkeyPatch
) -> None:
    # spinning threads beyond the CPUs take them from the loop and the sidecar: with more of
    # the process's calls waiting than its spinners, a channel thread waits parked from the start
    from kalos.transport import shm

    running = sidecar(dim=DIM)
    monkeypatch.setattr(shm, "SPINNERS", 2)
    spins = record_first_waits(monkeypatch)
    q = np.ones(DIM, np.float32)

    async def main() -> tuple[list[int], list[int]]:
        async with connect(running, max_channels=16, spin_us=50.0) as c:
            await c.add(q[None], np.arange(1))
            await asyncio.gather(*(c.ping() for _ in range(16)))  # every channel opened
            spins.clear()
            for _ in range(3):
                await c.search(q, k=1)  # alone: spins first
            alone = list(spins)
            spins.clear()
            for _ in range(3):  # 16 calls waiting at once: the sidecar is stopped meanwhile
                running.process.send_signal(signal.SIGSTOP)
                try:
                    calls = [asyncio.ensure_future(c.search(q, k=1)) for _ in range(16)]
                    await asyncio.sleep(0.1)
                finally:
                    running.process.send_signal(signal.SIGCONT)
                await asyncio.gather(*calls)
            return alone, list(spins)

    alone, crowd = asyncio.run(main())
    assert alone == [50_000] * 3, alone
    assert len(crowd) == 48 and crowd.count(0) >= 24, crowd  # 2 of each 16 may spin
