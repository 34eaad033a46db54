"""A client made before os.fork and used on both sides of it (gunicorn's --preload, a
multiprocessing pool forked by default, Celery's prefork workers): every process gets its own
exact answers.

The channels open at the fork (the forking thread's, and those of the client's other threads,
an AsyncClient's channel threads among them) are the parent's: the same shared memory and
socket. The child lets go of them untouched and opens its own; before, parent and children
answered on one channel, and most answers were another process's (over shm), or the child's
garbage collection shut the parent's uds sockets down.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable

import numpy as np
import pytest

import kalos
from conftest import REAL_TRANSPORTS, TIMEOUT
from kalos.testing import RunningSidecar

DIM = 16
N = 64
CHILDREN = 3
SEARCHES = 300  # per process and client


def _corpus() -> tuple[np.ndarray, np.ndarray]:
    """N vectors and each one's exact top-1 by inner product (not always itself)."""
    v = np.random.default_rng(7).standard_normal((N, DIM)).astype(np.float32)
    return v, np.argmax(v.astype(np.float64) @ v.T.astype(np.float64), axis=1)


def _wrong(search: Callable[[np.ndarray], int], v: np.ndarray, best: np.ndarray, off: int) -> int:
    """Searches SEARCHES vectors; how many answers were not their exact top-1."""
    return sum(search(v[j]) != best[j] for j in ((off + 7 * i) % N for i in range(SEARCHES)))


def _in_children(work: Callable[[int], int]) -> list[int]:
    """Runs ``work(child)`` in CHILDREN forked children (``work(CHILDREN)`` in this process
    meanwhile); each child's exit status is its count of wrong answers (99: it raised)."""
    pids = []
    for w in range(CHILDREN):
        pid = os.fork()
        if pid == 0:  # the child: no return into pytest
            code = 99
            try:
                code = min(work(w), 98)
            finally:
                os._exit(code)
        pids.append(pid)
    wrong = [work(CHILDREN)]
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status), status
        wrong.append(os.WEXITSTATUS(status))
    return wrong


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork")
@pytest.mark.parametrize("transport", REAL_TRANSPORTS)
def test_a_client_used_across_fork_answers_every_process_exactly(
    sidecar: Callable[..., RunningSidecar], transport: str
) -> None:
    running = sidecar(dim=DIM, name="forked")
    v, best = _corpus()
    client = running.connect(transport=transport, timeout=TIMEOUT)
    client.add(v, np.arange(N))

    # channels on more threads than the forking one: the child never has those threads
    def on_a_thread() -> None:
        assert _wrong(lambda q: int(client.search(q, k=1).ids[0]), v, best, 1) == 0

    threads = [threading.Thread(target=on_a_thread) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert client.search(v[0], k=1).ids[0] == best[0]  # this thread's channel is open

    wrong = _in_children(lambda w: _wrong(lambda q: int(client.search(q, k=1).ids[0]), v, best, w))
    assert wrong == [0] * (CHILDREN + 1)
    on_a_thread()  # the parent's other threads' channels still serve it
    assert client.stats()["items"] == N
    client.close()


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork")
@pytest.mark.parametrize("transport", REAL_TRANSPORTS)
def test_an_async_client_used_across_fork_answers_every_process_exactly(
    sidecar: Callable[..., RunningSidecar], transport: str
) -> None:
    running = sidecar(dim=DIM, name="forked-async")
    v, best = _corpus()
    ac = kalos.AsyncClient(running.name, runtime_dir=running.runtime_dir, transport=transport,
                           timeout=TIMEOUT)  # fmt: skip

    async def searches(off: int) -> int:
        async def top1(q: np.ndarray) -> int:
            return int((await ac.search(q, k=1)).ids[0])

        wrong = 0
        for i in range(SEARCHES // 10):  # 10 at a time: as many channel threads
            js = [(off + 7 * (10 * i + t)) % N for t in range(10)]
            got = await asyncio.gather(*(top1(v[j]) for j in js))
            wrong += sum(g != best[j] for g, j in zip(got, js, strict=True))
        return wrong

    async def load() -> None:
        await ac.add(v, np.arange(N))

    asyncio.run(load())
    assert asyncio.run(searches(0)) == 0  # the channel threads hold channels at the fork
    wrong = _in_children(lambda w: asyncio.run(searches(w)))
    assert wrong == [0] * (CHILDREN + 1)
    assert asyncio.run(searches(5)) == 0
    asyncio.run(ac.close())


def test_a_client_says_how_to_reach_another_process_instead_of_pickling(
    sidecar: Callable[..., RunningSidecar],
) -> None:
    import pickle

    running = sidecar(dim=DIM, name="pickled")
    client = running.connect(timeout=TIMEOUT)
    ac = kalos.AsyncClient(running.name, runtime_dir=running.runtime_dir)
    for c in (client, ac):
        with pytest.raises(TypeError, match="cannot be pickled: pass its name and options"):
            pickle.dumps(c)
    again = kalos.connect(client.name, options=client.options)  # what it says to do
    assert again.stats()["name"] == "pickled"
    again.close()
    client.close()
    asyncio.run(ac.close())
