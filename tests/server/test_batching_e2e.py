"""Dynamic batching through a real sidecar: many callers at once, each with its exact answer.

The sidecar runs with a long batch delay (``--batch-delay-us``), so that the searches the
threads, tasks and processes here send at once wait in one batch. Every answer is held
against an exact numpy reference; a bad member, a cancelled member, a stopped (slow) caller
and a caller killed with SIGKILL while its request is in the batch answer only that caller.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import kalos
from conftest import TIMEOUT
from kalos.errors import NotFound
from kalos.server import Sidecar, SidecarConfig
from kalos.testing import RunningSidecar, check_search
from server.test_admin import admin_port, sample, scrape

DIM = 16
N = 400
DELAY_US = 100_000  # a batch's first search waits 100 ms for the others
# scope names -> the reference's codes
TENANT = {"a": 1, "b": 2, "nobody": 3}
USER = {"u1": 1}


def corpus() -> tuple[np.ndarray, np.ndarray, list[tuple[str, str | None]]]:
    rng = np.random.default_rng(7)
    vectors = rng.standard_normal((N, DIM)).astype(np.float32)
    ids = np.arange(1, N + 1, dtype=np.int64)
    scopes = [("a" if i % 4 else "b", "u1" if i % 20 == 0 else None) for i in range(N)]
    return vectors, ids, scopes


def reference_items() -> dict[int, tuple[np.ndarray, tuple[int, int, int]]]:
    vectors, ids, scopes = corpus()
    return {
        int(i): (v, (TENANT[t], USER[u] if u else 0, 0))
        for i, v, (t, u) in zip(ids, vectors, scopes, strict=True)
    }


def codes_of(scope: kalos.Scope | None) -> tuple[int, int, int] | None:
    if scope is None:
        return None
    return (TENANT[scope.tenant] if scope.tenant else 0, USER[scope.user] if scope.user else 0, 0)


def fill(client: kalos.Client) -> None:
    vectors, ids, scopes = corpus()
    for key in sorted(set(scopes), key=str):
        rows = [i for i, s in enumerate(scopes) if s == key]
        client.add(vectors[rows], ids[rows], scope=kalos.Scope(*key))


# one caller's searches: (k, scope, queries at once)
CASES = [
    (10, None, 1),
    (3, kalos.Scope("a"), 1),
    (5, kalos.Scope("a", "u1"), 1),  # a selective filter: it scans its own rows
    (30, kalos.Scope("b", "u1"), 1),  # fewer match than k: the tail is -1
    (4, kalos.Scope("nobody"), 1),  # nothing matches
    (7, None, 3),
    (1, kalos.Scope("b"), 2),
    (50, None, 1),
]


def start(sidecar, delay_us: int = DELAY_US) -> tuple[RunningSidecar, kalos.Client]:  # type: ignore[no-untyped-def]
    sc = sidecar(dim=DIM, extra_args=("--batch-delay-us", str(delay_us)))
    client = sc.connect(timeout=TIMEOUT)
    fill(client)
    return sc, client


def search_and_check(client: kalos.Client, items: dict, case: int, seed: int) -> None:
    k, scope, nq = CASES[case % len(CASES)]
    q = np.random.default_rng(seed).standard_normal((nq, DIM)).astype(np.float32)
    r = client.search(q, k, scope=scope, payloads=False, copy=True)
    check_search((r.scores, r.ids), items, q, k, "ip", codes_of(scope))


def run_threads(client: kalos.Client, items: dict, threads: int, rounds: int) -> list[str]:
    """``threads`` threads (a channel each) searching at once, ``rounds`` times; the errors."""
    errors: list[str] = []
    barrier = threading.Barrier(threads)

    def caller(t: int) -> None:
        try:
            barrier.wait(TIMEOUT)
            for r in range(rounds):
                search_and_check(client, items, t, seed=1000 * t + r)
        except Exception as exc:  # reported by the test
            errors.append(f"thread {t}: {type(exc).__name__}: {exc}")

    workers = [threading.Thread(target=caller, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(TIMEOUT)
    return errors


def test_mixed_k_and_scopes_in_one_batch_each_exact(sidecar) -> None:  # type: ignore[no-untyped-def]
    sc, client = start(sidecar)
    items = reference_items()
    bad: list[BaseException] = []

    def bad_member() -> None:  # a recall of a session that does not exist: NotFound, alone
        try:
            client.recall("nosuch", np.ones(DIM, np.float32), k=3, max_tokens=10)
        except NotFound as exc:
            bad.append(exc)

    # a recall of a session of tenant "a": its search joins the batch, filtered by the tenant
    client.append_turn("s1", "user", "hello", [1, 2, 3], scope=kalos.Scope("a"))
    recalled: list[str] = []

    def good_recall() -> None:
        try:
            q = np.random.default_rng(99).standard_normal(DIM).astype(np.float32)
            r = client.recall("s1", q, k=6, max_tokens=50, scope=kalos.Scope("a"), copy=True)
            check_search((r.scores[None], r.ids[None]), items, q[None], 6, "ip", (1, 0, 0))
            assert r.token_ids.tolist() == [1, 2, 3]  # the memories have no token ids
            recalled.append("ok")
        except Exception as exc:  # reported by the test
            recalled.append(f"{type(exc).__name__}: {exc}")

    spoiler = threading.Thread(target=bad_member)
    recaller = threading.Thread(target=good_recall)
    spoiler.start()
    recaller.start()
    assert run_threads(client, items, threads=len(CASES), rounds=3) == []
    spoiler.join(TIMEOUT)
    recaller.join(TIMEOUT)
    assert len(bad) == 1
    assert recalled == ["ok"]
    stats = client.stats()
    assert stats["batches"] >= 1 and stats["largest_batch"] >= 2, stats
    # the batches' time, pickup to last reply, holds the dispatcher's, which holds the search's
    assert stats["batch_ns"] >= stats["batch_dispatch_ns"] >= stats["batch_search_ns"] > 0
    # callers that waited out their spin in the batch's 100 ms: woken by the waker's thread
    assert 1 <= stats["batch_woken"] <= stats["batched"], stats
    assert stats["errors"] == 1
    m = scrape(admin_port(sc))  # the admin endpoint counts each member's response
    assert sample(m, "kalos_batches_total") == stats["batches"]
    assert sample(m, "kalos_batch_largest") == stats["largest_batch"]
    searches = sample(m, "kalos_responses_total", op="search", transport="shm", status="ok")
    assert searches == 3 * len(CASES)


def test_a_lone_caller_is_not_batched(sidecar) -> None:  # type: ignore[no-untyped-def]
    _, client = start(sidecar, delay_us=0)
    items = reference_items()
    for i in range(20):
        search_and_check(client, items, i, seed=i)
    assert client.stats()["batches"] == 0


CALLER = textwrap.dedent(
    """
    import sys, numpy as np, kalos
    name, runtime_dir, dim = sys.argv[1], sys.argv[2], int(sys.argv[3])
    client = kalos.connect(name, runtime_dir=runtime_dir, timeout=60)
    rng = np.random.default_rng(3)
    print("connected", flush=True)
    for i in range(int(sys.argv[4])):
        client.search(rng.standard_normal(dim).astype(np.float32), 10, payloads=False)
    print("done", flush=True)
    """
)


def spawn_caller(sc: RunningSidecar, searches: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", CALLER, sc.name, sc.runtime_dir, str(DIM), str(searches)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "connected"
    return proc


def test_a_caller_killed_in_a_batch_answers_only_itself(sidecar) -> None:  # type: ignore[no-untyped-def]
    sc, client = start(sidecar)
    items = reference_items()
    victim = spawn_caller(sc, searches=10_000)  # always waiting in a batch: 100 ms each
    try:
        time.sleep(0.35)  # a few batches in: its next search is in flight
        killer = threading.Timer(0.15, victim.send_signal, (signal.SIGKILL,))
        killer.start()
        assert run_threads(client, items, threads=4, rounds=4) == []
        killer.join()
        assert victim.wait(TIMEOUT) == -signal.SIGKILL
    finally:
        if victim.poll() is None:
            victim.kill()
    assert run_threads(client, items, threads=4, rounds=2) == []  # and it keeps batching


def test_a_stopped_caller_holds_up_nobody(sidecar) -> None:  # type: ignore[no-untyped-def]
    sc, client = start(sidecar)
    items = reference_items()
    slow = spawn_caller(sc, searches=8)
    try:
        time.sleep(0.15)
        slow.send_signal(signal.SIGSTOP)  # a caller that does not read its answer
        assert run_threads(client, items, threads=4, rounds=3) == []
        slow.send_signal(signal.SIGCONT)
        out, _ = slow.communicate(timeout=TIMEOUT)
        assert out.strip() == "done" and slow.returncode == 0
    finally:
        if slow.poll() is None:
            slow.kill()


def test_a_cancelled_task_in_a_batch_answers_only_itself(sidecar) -> None:  # type: ignore[no-untyped-def]
    sc, _ = start(sidecar)
    items = reference_items()

    async def main() -> None:
        async with kalos.AsyncClient(sc.name, runtime_dir=sc.runtime_dir, timeout=TIMEOUT) as ac:

            async def caller(t: int) -> None:
                k, scope, nq = CASES[t % len(CASES)]
                for r in range(3):
                    q = np.random.default_rng(100 * t + r).standard_normal((nq, DIM))
                    q = q.astype(np.float32)
                    res = await ac.search(q, k, scope=scope, payloads=False)
                    check_search((res.scores, res.ids), items, q, k, "ip", codes_of(scope))

            async def cancelled() -> None:
                with pytest.raises(TimeoutError):  # cancelled while it waits in the batch
                    await asyncio.wait_for(ac.search(np.ones(DIM, np.float32), 5), 0.02)

            await asyncio.gather(cancelled(), *(caller(t) for t in range(len(CASES))))
            # the cancelled task's channel serves the next caller with its own answer
            await asyncio.gather(*(caller(t) for t in range(len(CASES))))

    asyncio.run(main())


def test_batches_beside_logged_writes(sidecar, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """With a data directory: writes held for their group commit, searches batched beside
    them, every search exact and every write acknowledged."""
    sc = sidecar(dim=DIM, extra_args=("--batch-delay-us", str(DELAY_US), "--data-dir",
                                      str(tmp_path / "data")))  # fmt: skip
    client = sc.connect(timeout=TIMEOUT)
    fill(client)
    items = reference_items()
    writer_errors: list[str] = []

    def writer() -> None:  # adds far from every query's top-k: the reference stays right
        try:
            for i in range(20):
                v = np.zeros((1, DIM), np.float32)
                v[0, 0] = 1e-6
                client.add(v, [10_000 + i], scope=kalos.Scope("a"))
        except Exception as exc:  # reported by the test
            writer_errors.append(repr(exc))

    w = threading.Thread(target=writer)
    w.start()
    # the writer's items score ~0: below the k-th best of every search here, so the
    # reference without them stays right
    errors = run_threads(client, items, threads=4, rounds=3)
    w.join(TIMEOUT)
    assert writer_errors == [] and errors == [], (writer_errors, errors)
    assert client.stats()["items"] == N + 20


@pytest.mark.parametrize("transport", ["uds", "grpc"])
def test_uds_and_grpc_requests_batch_among_themselves(tmp_path, transport: str) -> None:  # type: ignore[no-untyped-def]
    """A thread per connection (uds) or grpc handler: requests that wait for the dispatch
    lock while it is held are answered as one batch by whichever thread takes it next."""
    if transport == "grpc":
        pytest.importorskip("grpc")
    config = SidecarConfig(
        name="batching", dim=DIM, runtime_dir=str(tmp_path), admin_port=None,
        grpc=("127.0.0.1:0",) if transport == "grpc" else (),
    )  # fmt: skip
    sidecar = Sidecar(config).start()
    try:
        target = sidecar.grpc.addresses[0] if sidecar.grpc is not None else "batching"
        options = {"runtime_dir": str(tmp_path)} if transport == "uds" else {}
        loader = kalos.connect("batching", runtime_dir=str(tmp_path), timeout=TIMEOUT)
        fill(loader)
        items = reference_items()
        callers = [kalos.connect(target, transport=transport, timeout=TIMEOUT, **options)
                   for _ in CASES]  # fmt: skip
        for c in callers:
            c.ping()
        combiner = sidecar.combiner
        assert combiner is not None
        errors: list[str] = []
        sidecar.lock.acquire()  # the dispatcher busy: every caller's search waits for it
        try:
            workers = [
                threading.Thread(target=lambda c=c, t=t: errors.extend(run_checked(c, items, t)))
                for t, c in enumerate(callers)
            ]
            for w in workers:
                w.start()
            deadline = time.monotonic() + TIMEOUT
            while len(combiner._waiting) < len(CASES) and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            sidecar.lock.release()
        for w in workers:
            w.join(TIMEOUT)
        assert errors == []
        assert combiner.batches >= 1 and combiner.batched >= len(CASES), vars(combiner)
        for c in [*callers, loader]:
            c.close()
    finally:
        sidecar.stop()


def run_checked(client: kalos.Client, items: dict, case: int) -> list[str]:
    try:
        search_and_check(client, items, case, seed=case)
    except Exception as exc:  # reported by the test
        return [f"case {case}: {type(exc).__name__}: {exc}"]
    return []
