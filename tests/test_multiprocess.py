"""Many client processes and threads against one real sidecar; every response is checked.

4 processes x 4 threads x 10,000 mixed requests (ping, add/upsert, search, remove, stats),
each thread working on ids and a scope private to it, so that it knows exactly what every
response must be: a search for a vector it added must return exactly that id and payload
first, and its scope must hold exactly its live ids; an upsert must count as new or not; a
remove must count what existed. A response meant for another thread or process, a stale
arena or a lost request shows up as a mismatch (or a hang, which the deadline turns into an
error). Processes even and odd use shm and uds.
"""

from __future__ import annotations

import multiprocessing
import threading
import traceback

import numpy as np
import pytest

import kalos
from conftest import TIMEOUT
from kalos import Scope

PROCESSES = 4
THREADS = 4
REQUESTS = 10_000  # per thread
DIM = 16
SLOTS = 6  # ids per thread
K = SLOTS + 2  # searches ask for more than the thread's scope holds: the tail must be -1


def run_thread(client: kalos.Client, p: int, t: int, out: list) -> None:
    """Runs REQUESTS checked requests; appends (requests done, mismatches, examples) to out."""
    rng = np.random.default_rng(1000 * p + t)
    base = (p * THREADS + t) * 1_000_000
    scope = Scope(f"proc-{p}", f"thread-{t}")
    live: dict[int, tuple[np.ndarray, str]] = {}  # id -> (vector, payload)
    done = 0
    mismatches = 0
    examples: list[str] = []

    def mismatch(what: str) -> None:
        nonlocal mismatches
        mismatches += 1
        if len(examples) < 5:
            examples.append(f"p{p} t{t} request {done}: {what}")

    try:
        while done < REQUESTS:
            roll = rng.random()
            if roll < 0.10:
                timings = client.ping()
                if not isinstance(timings, kalos.Timings) or timings.total_us <= 0:
                    mismatch(f"ping returned {timings!r}")
            elif roll < 0.40:
                slot = int(rng.integers(SLOTS))
                item = base + slot
                v = rng.standard_normal(DIM).astype(np.float32)
                payload = f"p{p}-t{t}-i{done}"
                new = client.add(v, item, payload, scope=scope)
                if new != (0 if item in live else 1):
                    mismatch(f"add of {item} counted {new} new")
                live[item] = (v, payload)
            elif roll < 0.50:
                slot = int(rng.integers(SLOTS))
                item = base + slot
                removed = client.remove([item, base + SLOTS + 99])  # and an id never added
                if removed != (1 if item in live else 0):
                    mismatch(f"remove of {item} counted {removed}")
                live.pop(item, None)
            elif roll < 0.55:
                stats = client.stats()
                if not isinstance(stats.get("items"), int) or stats["items"] < len(live):
                    mismatch(
                        f"stats say {stats.get('items')} items; this thread alone has {len(live)}"
                    )
            else:
                if live and roll < 0.95:
                    item = list(live)[int(rng.integers(len(live)))]
                    v, payload = live[item]
                else:
                    item, v, payload = -1, rng.standard_normal(DIM).astype(np.float32), ""
                r = client.search(v, k=K, scope=scope)
                ids = r.ids.tolist()
                found = set(ids[: len(live)])
                if found != set(live) or ids[len(live) :] != [-1] * (K - len(live)):
                    mismatch(f"scope holds {sorted(found)}, expected {sorted(live)}; got {ids}")
                elif item != -1 and (ids[0] != item or r.payloads[0] != payload):  # type: ignore[index]
                    mismatch(f"search for {item} returned {ids[0]} {r.payloads[0]!r}")  # type: ignore[index]
                elif item != -1 and r.scores[0] != 0.0:  # l2: the vector itself, distance 0
                    mismatch(f"search for {item} scored {r.scores[0]}")
            done += 1
    except Exception:
        mismatch(traceback.format_exc())
    out.append((done, mismatches, examples))


def run_process(p: int, name: str, runtime_dir: str, transport: str) -> tuple[int, int, list]:
    client = kalos.connect(name, runtime_dir=runtime_dir, transport=transport, timeout=TIMEOUT)
    out: list = []
    threads = [
        threading.Thread(target=run_thread, args=(client, p, t, out)) for t in range(THREADS)
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    client.close()
    return (
        sum(r[0] for r in out),
        sum(r[1] for r in out) + (THREADS - len(out)),
        [e for r in out for e in r[2]],
    )


@pytest.mark.slow
def test_many_processes_and_threads_get_their_own_answers(sidecar) -> None:  # type: ignore[no-untyped-def]
    sc = sidecar(dim=DIM, metric="l2", name="multi")
    ctx = multiprocessing.get_context("spawn")
    transports = ["shm" if p % 2 == 0 else "uds" for p in range(PROCESSES)]
    with ctx.Pool(PROCESSES) as pool:
        results = pool.starmap(
            run_process, [(p, sc.name, sc.runtime_dir, transports[p]) for p in range(PROCESSES)]
        )
    requests = sum(r[0] for r in results)
    mismatches = sum(r[1] for r in results)
    examples = [e for r in results for e in r[2]]
    print(
        f"\n{requests} requests, {PROCESSES} processes x {THREADS} threads: {mismatches} mismatches"
    )
    assert mismatches == 0, "\n".join(examples)
    assert requests == PROCESSES * THREADS * REQUESTS
    with sc.connect(timeout=TIMEOUT) as client:
        stats = client.stats()
    served = sum(stats["requests"].values())
    assert served >= PROCESSES * THREADS * REQUESTS  # removes of many ids may be one request
    assert stats["errors"] == 0
    assert sc.process.poll() is None
