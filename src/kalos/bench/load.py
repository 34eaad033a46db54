"""load: many callers at once, open-loop Poisson arrivals, a latency-throughput curve per system.

What an inference server does: many requests at once, each with its own memory lookup. Each
system is first driven closed-loop (every client sends its next search as soon as the last
returns) to find its saturation throughput; then open-loop at a sweep of offered rates
(``--rates``, or fractions of that system's saturation, ``--fractions``): each client thread
draws Poisson arrivals at its share of the rate, and a search's latency counts from its
scheduled arrival (so a client still busy with the last one sees the queueing, and a system
past its capacity shows it instead of slowing the load down), or, where the client waited
idle for it and its timer woke it late, from when it woke (:func:`arrived`).

Systems side by side, one after another in one run (``--systems``):

* ``kalos-shm``: the sidecar (its dynamic batching on, ``--batch-delay-us``), clients in
  ``--processes`` processes × ``--threads`` threads, a channel each;
* ``kalos-shm-unbatched``: the same sidecar with ``--batch-max 1``: one search at a time;
* ``kalos-grpc``: the sidecar through its grpc listener, the same client layout;
* ``kalos-shm-async`` / ``kalos-shm-async-unbatched``: one process, ``--tasks`` asyncio
  tasks sharing one ``AsyncClient`` (a channel and a channel thread per call in flight);
* ``torch-lock``: in-process ``torch.topk(q @ db.T)``, one query at a time under a lock
  (what a service without a sidecar does), from processes × threads callers as threads of
  this process;
* ``torch-batched``: in-process, a server thread taking every waiting query (up to 64)
  into one product (an ideal in-process server);
* ``redis-faiss``: the Redis + FAISS stack of ``bench recall``: FAISS flat in-process under
  a lock, then the hits' payloads from a private redis-server (MGET).

Every system computes with one BLAS thread (the sidecar's ``--compute-threads`` default).
Every answer is checked, tie-aware, against an exact float32 reference computed first.
``checks.batch64_over_one``: one kalos call with 64 queries over one call with one query
(medians). Writes ``load-<machine>.json``: one parameter set per client layout, each row a
system at one offered rate (``offered_qps``; ``null``: closed loop; a kalos shm row's
``sidecar_batches``: the batches of two or more the sidecar formed meanwhile, their mean size
and the share of the searches they answered), and a PNG of p50, p99 and p99.9 against
achieved searches per second. The file is written again after each system, so a run cut
short keeps the systems it measured (``checks.systems_pending``: those it did not reach; the
PNG comes with the whole run).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import multiprocessing as mp
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from kalos.bench import corpora
from kalos.bench.common import load_average, machine_name, print_table, write_result
from kalos.server import channels
from kalos.testing import isolated_sidecar

SCENARIO = "load"
SYSTEMS = (
    "kalos-shm",
    "kalos-shm-unbatched",
    "kalos-grpc",
    "kalos-shm-async",
    "kalos-shm-async-unbatched",
    "torch-lock",
    "torch-batched",
    "redis-faiss",
)
TORCH_BATCH = 64  # the in-process batched server's largest batch
# The sidecar's stats of its batches that each row's sidecar_batches reads (_batch_row)
BATCH_STATS = (
    "batches", "batched", "batch_ns", "batch_dispatch_ns", "batch_search_ns", "batch_woken",
    "batches_run_ahead", "batch_running_ns",
)  # fmt: skip
# the poller's steps on a batch, each timed apart, and settle (of the start, settling the
# GPU's armed graphs): after BATCH_STATS in a sample
BATCH_STEPS = (*channels.BATCH_STEPS, "settle")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--corpus", choices=corpora.NAMES, default="real-384")
    p.add_argument("--n", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=None, help="implied for real-*; else 384")
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--queries", type=int, default=500, help="distinct queries (held out)")
    p.add_argument("--processes", type=int, default=8, help="client processes")
    p.add_argument("--threads", type=int, default=8, help="client threads per process")
    p.add_argument("--tasks", type=int, default=64, help="asyncio tasks (the async systems)")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--rates", type=float, nargs="*", default=None,
                   help="offered searches/s for every system (default: --fractions of each "
                        "system's closed-loop throughput)")  # fmt: skip
    p.add_argument("--fractions", type=float, nargs="*", default=[0.1, 0.25, 0.5, 0.75, 0.9, 1.1])
    p.add_argument("--duration", type=float, default=3.0, help="seconds per rate")
    p.add_argument("--device", default="cpu", help="the sidecar's and torch's device")
    p.add_argument("--index", default=None, help="the sidecar's index spec (default: device's)")
    p.add_argument("--batch-delay-us", type=float, default=0.0)
    p.add_argument(
        "--sidecar-arg", action="append", default=[], metavar="ARG",
        help="an argument for the sidecar's command line, e.g. --sidecar-arg=--spin-us=20000 "
        "(repeat for more; in params.sidecar_args; a set with other sidecar arguments is "
        "another set for --append)",
    )  # fmt: skip
    p.add_argument("--redis-server", default=None, help="redis-server binary (default: PATH)")
    p.add_argument("--append", action="store_true",
                   help="add this run's sets to the result file already there (a set of the "
                        "same corpus, size, device and clients is replaced)")  # fmt: skip
    p.add_argument("--seed", type=int, default=corpora.SEED, help="the corpus's seed")
    p.add_argument("--corpus-dir", default=None,
                   help="the corpora's cache (default $KALOS_CORPUS_DIR or "
                        "~/.cache/kalos/corpora)")  # fmt: skip


# -- the answers ----------------------------------------------------------------------------------


class Reference:
    """Exact top-k of every query (float32 GEMM, float64 not needed at this margin), and for
    each query the ids whose score reaches the k-th best less a tolerance: an answer is right
    when it has k distinct ids, all of them in that set (ties at the k-th place either way)."""

    def __init__(self, db: np.ndarray, queries: np.ndarray, ids: np.ndarray, k: int,
                 fp16: bool = False) -> None:  # fmt: skip
        # fp16: the index stores the rows rounded to fp16 (a cuda index's default); the
        # reference scores those rows, within fp16's rounding of a score (as search-gpu)
        if fp16:
            db = db.astype(np.float16).astype(np.float32)
        max_norm = float(np.sqrt((db.astype(np.float64) ** 2).sum(axis=1).max())) if fp16 else 0.0
        self.allowed: list[np.ndarray] = []
        for start in range(0, len(queries), 64):
            block = queries[start : start + 64]
            scores = block @ db.T  # [b, n]
            for q, row in zip(block, scores, strict=True):
                kth = np.partition(row, len(row) - k)[len(row) - k]
                tol = 1e-4 * max(1.0, abs(float(kth)))
                if fp16:
                    tol = max(tol, 2.0**-10 * float(np.linalg.norm(q)) * max_norm)
                self.allowed.append(np.sort(ids[row >= kth - tol]))
        self.k = k

    def ok(self, i: int, got: np.ndarray) -> bool:
        got = np.asarray(got).reshape(-1)
        if got.shape[0] != self.k or len(np.unique(got)) != self.k:
            return False
        allowed = self.allowed[i]
        pos = np.searchsorted(allowed, got)
        return bool(
            (pos < len(allowed)).all() and (allowed[np.minimum(pos, len(allowed) - 1)] == got).all()
        )


# -- one caller's loop ----------------------------------------------------------------------------


def arrived(at: float, before: float, woke: float) -> float:
    """When a search's latency starts: its scheduled arrival ``at``, as for any open loop
    (a caller still busy with its last search when the next is due counts that wait); but
    where the caller was idle until then (``before``, when it began to wait, is earlier) and
    its timer woke it late (``woke``), the moment it woke. A sleep's lateness (~90 µs p50 on
    the 2-core VM) is the load generator's, not the system's under test."""
    return max(at, woke) if before < at else at


def caller_loop(
    search: Callable[[int], np.ndarray], ref: Reference, nq: int, rate: float,
    start_at: float, duration: float, seed: int,
) -> tuple[list[float], int, float]:  # fmt: skip
    """Searches from ``start_at`` (time.monotonic) for ``duration`` s: Poisson arrivals at
    ``rate`` a second (0: closed loop, the next as soon as the last returns). Returns the
    latencies (s, from each arrival: :func:`arrived`), the wrong answers and the last
    completion."""
    rng = np.random.default_rng(seed)
    clock = time.monotonic
    end = start_at + duration
    lat: list[float] = []
    wrong = 0
    last = start_at
    now = clock()
    if now < start_at:
        time.sleep(start_at - now)
    at = start_at
    while True:
        if rate > 0:
            at += rng.exponential(1.0 / rate)
            if at >= end:
                break
            now = clock()
            if at > now:
                time.sleep(at - now)
        else:
            at = now = clock()
            if at >= end:
                break
        began = arrived(at, now, clock())
        i = int(rng.integers(nq))
        got = search(i)
        last = clock()
        lat.append(last - began)
        if not ref.ok(i, got):
            wrong += 1
    return lat, wrong, last


class CallerPool:
    """``threads`` caller threads, each with its own search function (and so its own
    channel), made and warmed once on its thread before any run: a run's clock never counts
    a handshake or a first search."""

    def __init__(self, make_search: Callable[[], Callable[[int], np.ndarray]], threads: int,
                 ref: Reference, nq: int) -> None:  # fmt: skip
        self.threads = threads
        self._commands: list[queue.SimpleQueue[Any]] = [queue.SimpleQueue() for _ in range(threads)]
        self._results: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._ref, self._nq = ref, nq
        self._workers = [
            threading.Thread(target=self._work, args=(make_search, t), daemon=True)
            for t in range(threads)
        ]
        for w in self._workers:
            w.start()
        for _ in range(threads):
            ready = self._results.get()
            if isinstance(ready, BaseException):
                raise ready

    def _work(self, make_search: Callable[[], Callable[[int], np.ndarray]], t: int) -> None:
        try:
            search = make_search()
            search(0)  # this thread's channel opened, its first search done
        except BaseException as exc:
            self._results.put(exc)
            return
        self._results.put(None)
        while True:
            cmd = self._commands[t].get()
            if cmd is None:
                return
            rate, start_at, duration, seed = cmd
            self._results.put(caller_loop(search, self._ref, self._nq, rate, start_at,
                                          duration, seed * 1000 + t))  # fmt: skip

    def run(self, rate: float, start_at: float, duration: float, seed: int
            ) -> tuple[list[float], int, float]:  # fmt: skip
        """Every thread at ``rate / threads`` from ``start_at``; all latencies, wrong, last."""
        for c in self._commands:
            c.put((rate / self.threads, start_at, duration, seed))
        parts = [self._results.get() for _ in range(self.threads)]
        lat = [x for p in parts for x in p[0]]
        return lat, sum(p[1] for p in parts), max(p[2] for p in parts)

    def close(self) -> None:
        for c in self._commands:
            c.put(None)


# -- client processes -----------------------------------------------------------------------------


def _reported(fn: Callable[..., None]) -> Callable[..., None]:
    """A client process's body that, failing, first sends ``("failed", pid, what)`` on its
    ``out`` queue (its last argument), so that the benchmark says why, then fails."""

    @functools.wraps(fn)
    def run(*args: Any) -> None:
        try:
            fn(*args)
        except BaseException as exc:
            args[-1].put(("failed", os.getpid(), f"{type(exc).__name__}: {exc}"))
            raise

    return run


@_reported
def _client_process(target: dict[str, Any], data: dict[str, Any], commands: Any, out: Any) -> None:
    """A client process: connects, then runs each command (rate, start, duration, seed) with
    its threads and sends back (latencies, wrong, last completion)."""
    import kalos

    queries, k, threads = data["queries"], data["k"], data["threads"]
    ref: Reference = data["ref"]
    if target["transport"] == "grpc":
        client = kalos.connect(target["address"], transport="grpc", timeout=120)
    else:
        client = kalos.connect(target["name"], runtime_dir=target["runtime_dir"], timeout=120)

    def make_search() -> Callable[[int], np.ndarray]:
        def search(i: int) -> np.ndarray:
            return client.search(queries[i], k, payloads=False).ids

        return search

    pool = CallerPool(make_search, threads, ref, len(queries))
    out.put(("ready", os.getpid()))
    while True:
        cmd = commands.get()
        if cmd is None:
            break
        out.put(pool.run(*cmd))
    pool.close()
    client.close()


@_reported
def _async_process(target: dict[str, Any], data: dict[str, Any], commands: Any, out: Any) -> None:
    """One process, ``tasks`` asyncio tasks on one AsyncClient (at ``rate / tasks`` each)."""
    import kalos

    queries, k, tasks = data["queries"], data["k"], data["tasks"]
    ref: Reference = data["ref"]

    async def main() -> None:
        async with kalos.AsyncClient(target["name"], runtime_dir=target["runtime_dir"],
                                     timeout=120, max_channels=tasks) as ac:  # fmt: skip
            await asyncio.gather(*(ac.search(queries[0], k, payloads=False) for _ in range(tasks)))
            out.put(("ready", os.getpid()))
            loop = asyncio.get_running_loop()
            while True:
                cmd = await loop.run_in_executor(None, commands.get)
                if cmd is None:
                    break
                rate, start_at, duration, seed = cmd

                parts = await asyncio.gather(
                    *(
                        _async_caller(
                            ac, queries, k, ref, rate / tasks, start_at, duration, seed * 1000 + t
                        )
                        for t in range(tasks)
                    )
                )
                out.put(([x for p in parts for x in p[0]], sum(p[1] for p in parts),
                         max(p[2] for p in parts)))  # fmt: skip

    asyncio.run(main())


async def _async_caller(
    ac: Any, queries: np.ndarray, k: int, ref: Reference, rate: float, start_at: float,
    duration: float, seed: int,
) -> tuple[list[float], int, float]:  # fmt: skip
    """:func:`caller_loop` as an asyncio task on an AsyncClient."""
    rng = np.random.default_rng(seed)
    clock, end = time.monotonic, start_at + duration
    lat: list[float] = []
    wrong, last, at = 0, start_at, start_at
    await asyncio.sleep(max(0.0, start_at - clock()))
    while True:
        if rate > 0:
            at += rng.exponential(1.0 / rate)
            if at >= end:
                break
            now = clock()
            await asyncio.sleep(max(0.0, at - now))
        else:
            at = now = clock()
            if at >= end:
                break
        began = arrived(at, now, clock())
        i = int(rng.integers(len(queries)))
        r = await ac.search(queries[i], k, payloads=False)
        last = clock()
        lat.append(last - began)
        wrong += not ref.ok(i, r.ids)
    return lat, wrong, last


class ClientFleet:
    """Client processes of one system, started once and reused for every rate."""

    def __init__(self, target: dict[str, Any], data: dict[str, Any], processes: int,
                 asyncio_mode: bool) -> None:  # fmt: skip
        ctx = mp.get_context("spawn")  # a clean interpreter: no inherited threads or torch
        self.out = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(processes)]
        fn = _async_process if asyncio_mode else _client_process
        self.procs = [
            ctx.Process(target=fn, args=(target, data, c, self.out), daemon=True)
            for c in self.commands
        ]
        for p in self.procs:
            p.start()
        for _ in self.procs:
            self._get()

    def _get(self) -> Any:
        while True:
            try:
                got = self.out.get(timeout=5)
            except queue.Empty:
                dead = [p.pid for p in self.procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"client processes {dead} died") from None
            else:
                if isinstance(got, tuple) and got[:1] == ("failed",):
                    raise RuntimeError(f"client process {got[1]} failed: {got[2]}")
                return got

    def run(self, rate: float, seed: int, duration: float) -> tuple[list[float], int, float, float]:
        start_at = time.monotonic() + 0.5
        for i, c in enumerate(self.commands):
            c.put((rate / len(self.commands), start_at, duration, seed * 100 + i))
        parts = [self._get() for _ in self.commands]
        lat = [x for p in parts for x in p[0]]
        return lat, sum(p[1] for p in parts), max(p[2] for p in parts), start_at

    def close(self) -> None:
        for c in self.commands:
            c.put(None)
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()


# -- the in-process systems -----------------------------------------------------------------------


def _current(tensor: Any) -> None:
    """Makes ``tensor``'s GPU current on this thread (a thread of its own would otherwise
    start without a CUDA context, which torch's first matmul warns of)."""
    if tensor.is_cuda:
        import torch

        torch.cuda.set_device(tensor.device)


def torch_lock(db: np.ndarray, queries: np.ndarray, k: int, device: str) -> tuple[Any, Any]:
    import torch

    t_db = torch.from_numpy(db).to(device)
    t_q = torch.from_numpy(queries).to(device)
    lock = threading.Lock()
    ids = torch.arange(len(db), device=device)

    def make_search() -> Callable[[int], np.ndarray]:  # (on the caller's thread)
        _current(t_db)

        def search(i: int) -> np.ndarray:
            with lock:
                _, pos = torch.topk(t_db @ t_q[i], k)
                return ids[pos].cpu().numpy()

        return search

    return make_search, None


def torch_batched(db: np.ndarray, queries: np.ndarray, k: int, device: str) -> tuple[Any, Any]:
    import torch

    t_db = torch.from_numpy(db).to(device)
    t_q = torch.from_numpy(queries).to(device)
    waiting: queue.SimpleQueue[tuple[int, list[Any], threading.Event] | None] = queue.SimpleQueue()

    def server() -> None:
        _current(t_db)
        while True:
            first = waiting.get()
            if first is None:
                return
            batch = [first]
            while len(batch) < TORCH_BATCH:
                try:
                    item = waiting.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    waiting.put(None)
                    break
                batch.append(item)
            idx = torch.tensor([b[0] for b in batch], device=device)
            _, pos = torch.topk(t_q[idx] @ t_db.T, k, dim=1)
            found = pos.cpu().numpy()
            for (_, slot, done), row in zip(batch, found, strict=True):
                slot.append(row)
                done.set()

    thread = threading.Thread(target=server, daemon=True)
    thread.start()

    def make_search() -> Callable[[int], np.ndarray]:
        def search(i: int) -> np.ndarray:
            slot: list[Any] = []
            done = threading.Event()
            waiting.put((i, slot, done))
            done.wait()
            return slot[0]

        return search

    return make_search, lambda: waiting.put(None)


@contextlib.contextmanager
def redis_faiss(db: np.ndarray, queries: np.ndarray, k: int, binary: str | None) -> Iterator[Any]:
    import faiss

    from kalos.bench.baseline import find_redis_server, redis_server

    index = faiss.IndexFlatIP(db.shape[1])
    index.add(db)
    lock = threading.Lock()
    with redis_server(find_redis_server(binary)) as (client, _version):
        pipe = client.pipeline(transaction=False)
        for start in range(0, len(db), 10_000):
            for i in range(start, min(len(db), start + 10_000)):
                pipe.set(f"m:{i}", f"memory {i}")
            pipe.execute()

        def make_search() -> Callable[[int], np.ndarray]:
            def search(i: int) -> np.ndarray:
                with lock:
                    _, found = index.search(queries[i : i + 1], k)
                hits = found[0]
                client.mget([f"m:{h}" for h in hits.tolist()])
                return hits

            return search

        yield make_search


# -- the run ------------------------------------------------------------------------------------


def percentile_row(
    system: str, lat_s: Sequence[float], wrong: int, wall: float, **extra: Any
) -> dict[str, Any]:
    us = np.asarray(lat_s, np.float64) * 1e6
    n = len(us)
    row: dict[str, Any] = {"system": system, **extra, "n": n, "wrong": wrong}
    if n:
        row.update(
            qps=round(n / wall, 1) if wall > 0 else 0.0,
            p50_us=round(float(np.percentile(us, 50)), 1),
            p99_us=round(float(np.percentile(us, 99)), 1),
            p999_us=round(float(np.percentile(us, 99.9)), 1),
        )
    return row


def batch64_over_one(client: Any, queries: np.ndarray, k: int) -> dict[str, float]:
    """Median µs of one call with 1 query and of one with 64, and their ratio."""
    times: dict[int, list[float]] = {1: [], 64: []}
    q64 = np.ascontiguousarray(np.resize(queries, (64, queries.shape[1])))
    for _ in range(12):
        for nq in (1, 64):
            t0 = time.perf_counter()
            client.search(q64[:nq], k, payloads=False)
            times[nq].append(time.perf_counter() - t0)
    one, many = (float(np.median(times[n][2:])) * 1e6 for n in (1, 64))
    return {"one_query_us": round(one, 1), "batch64_us": round(many, 1),
            "batch64_over_one": round(many / one, 2)}  # fmt: skip


def lone_caller(client: Any, queries: np.ndarray, k: int, searches: int = 100) -> dict[str, float]:
    """p50 and p99 µs of one caller alone, ``searches`` in a row."""
    lat = []
    for i in range(searches + 5):
        t0 = time.perf_counter()
        client.search(queries[i % len(queries)], k, payloads=False)
        lat.append(time.perf_counter() - t0)
    us = np.asarray(lat[5:]) * 1e6
    return {"p50_us": round(float(np.percentile(us, 50)), 1),
            "p99_us": round(float(np.percentile(us, 99)), 1)}  # fmt: skip


def run(args: argparse.Namespace) -> int:
    with threadpool_limits(limits=1):  # one BLAS thread everywhere, as the sidecar's
        import_torch_threads()
        return _run(args)


def import_torch_threads() -> None:
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)


def _run(args: argparse.Namespace) -> int:
    dim = args.dim
    if dim is None and args.corpus in ("clustered", "uniform"):
        dim = 384
    corpus = corpora.load(args.corpus, args.n, dim, queries=args.queries, seed=args.seed,
                          cache_dir=args.corpus_dir, progress=not args.quiet)  # fmt: skip
    db = np.ascontiguousarray(corpus.db, np.float32)
    queries = np.ascontiguousarray(corpus.queries, np.float32)
    dim = corpus.dim
    ids = np.arange(len(db), dtype=np.int64)
    previous = None  # the file this run adds its sets to (--append)
    target_path = os.path.join(args.out, f"{SCENARIO}-{machine_name(args.machine)}.json")
    if args.append and os.path.exists(target_path):
        with open(target_path) as f:
            loaded = json.load(f)
        previous = loaded if isinstance(loaded, list) else [loaded]
    fp16 = args.device != "cpu" and (args.index is None or "fp16" in args.index)
    ref = Reference(db, queries, ids, args.k, fp16=fp16)
    clients = args.processes * args.threads
    layouts = {  # a parameter set per client layout
        "threads": f"{args.processes} processes x {args.threads} threads",
        "asyncio": f"1 process, {args.tasks} asyncio tasks (AsyncClient)",
    }
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in layouts}
    checks: dict[str, Any] = {"wrong_results": 0}
    loads: list[list[float]] = [load_average()]

    def sweep(
        system: str,
        layout: str,
        drive: Callable[[float, int], tuple[list[float], int, float, float]],
        batches: Callable[[], tuple[int, ...]] | None = None,
    ) -> None:
        """The closed loop, then each offered rate; ``batches``: the sidecar's (batches of two
        or more, searches in them) so far, for each row's ``sidecar_batches``."""
        before = batches() if batches else None
        lat, wrong, last, start = drive(0.0, 1)  # closed loop: the saturation throughput
        row = percentile_row(system, lat, wrong, last - start, offered_qps=None)
        if batches:
            before = _batch_row(row, before, batches(), len(lat))
        rows[layout].append(row)
        checks["wrong_results"] += wrong
        print(
            f"  {system}: closed loop {row.get('qps', 0):,.0f}/s p50 {row.get('p50_us', 0):,.0f} µs"
        )
        rates = args.rates if args.rates else [f * row.get("qps", 0) for f in args.fractions]
        for j, rate in enumerate(r for r in rates if r > 0):
            lat, wrong, last, start = drive(rate, j + 2)
            wall = max(last - start, args.duration)
            r = percentile_row(system, lat, wrong, wall, offered_qps=round(rate, 1))
            if batches:
                before = _batch_row(r, before, batches(), len(lat))
            rows[layout].append(r)
            checks["wrong_results"] += wrong
            print(f"  {system}: offered {rate:,.0f}/s achieved {r.get('qps', 0):,.0f}/s "
                  f"p99 {r.get('p99_us', 0):,.0f} µs")  # fmt: skip

    params = {
        "corpus": corpus.name, "n": args.n, "dim": dim, "dtype": "float32", "k": args.k,
        "device": args.device, "duration_s": args.duration, "compute_threads": 1,
        "batch_delay_us": args.batch_delay_us, "corpus_info": corpus.info,
        "load_average": loads,
    }  # fmt: skip
    if args.sidecar_arg:
        params["sidecar_args"] = list(args.sidecar_arg)

    def save(pending: list[str]) -> tuple[str, list[dict[str, Any]]]:
        """Writes the file with every row so far (after each system, so that a run cut short
        keeps what it measured; ``checks.systems_pending`` names the systems it did not
        reach); returns its path and the document."""
        done = {**checks, **saturation_summary(rows), "systems_pending": pending}
        path = write_result(SCENARIO, args.machine, {**params, "clients": layouts["threads"]},
                            rows["threads"], args.out, checks=done)  # fmt: skip
        # one file, one parameter set per client layout (with --append, beside the file's
        # others)
        with open(path) as f:
            first = json.load(f)
        doc = [first] if rows["threads"] else []
        if rows["asyncio"]:
            second = dict(first, params={**params, "clients": layouts["asyncio"]},
                          rows=rows["asyncio"])  # fmt: skip
            doc.append(second)
        if args.append and previous is not None:

            def key(s: dict[str, Any]) -> tuple[Any, ...]:
                p = s.get("params", {})
                return (p.get("corpus"), p.get("n"), p.get("dim"), p.get("device"),
                        p.get("clients"), tuple(p.get("sidecar_args", ())))  # fmt: skip

            replaced = {key(s) for s in doc}
            doc = [s for s in previous if key(s) not in replaced] + doc
        with open(path, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
        return path, doc

    order = [s for b in (True, False) for s in args.systems
             if s.startswith("kalos") and s.endswith("-unbatched") != b]  # fmt: skip
    order += [s for s in args.systems if not s.startswith("kalos")]

    def ran(system: str) -> None:
        save(order[order.index(system) + 1 :])

    data = {
        "queries": queries,
        "k": args.k,
        "threads": args.threads,
        "tasks": args.tasks,
        "ref": ref,
    }
    kalos_sets = [s for s in args.systems if s.startswith("kalos")]
    for batched in (True, False):
        mine = [s for s in kalos_sets if s.endswith("-unbatched") != batched]
        if not mine:
            continue
        extra = [
            "--batch-max",
            "64" if batched else "1",
            "--batch-delay-us",
            str(args.batch_delay_us),
        ]
        extra += ["--device", args.device] if args.device != "cpu" else []
        if args.index:
            extra += ["--index", args.index]
        if any("grpc" in s for s in mine):
            extra += ["--grpc", "127.0.0.1:0"]
        extra += args.sidecar_arg
        with isolated_sidecar(dim=dim, name="bench-load", extra_args=tuple(extra)) as sc:
            loader = sc.connect(arena_bytes=16 << 20, timeout=600)
            loader.add(db, ids)
            if batched:
                checks.update(batch64_over_one(loader, queries, args.k))
            # a lone caller must not get slower with batching on: its p50 on either sidecar
            lone = checks.setdefault("lone_caller", {})
            lone["batched" if batched else "unbatched"] = lone_caller(loader, queries, args.k)
            target = {"transport": "shm", "name": sc.name, "runtime_dir": sc.runtime_dir}
            for system in mine:
                layout = "asyncio" if "async" in system else "threads"
                tgt = dict(target)
                if "grpc" in system:
                    tgt = {"transport": "grpc", "address": sc.grpc_target()}
                fleet = ClientFleet(tgt, data, 1 if layout == "asyncio" else args.processes,
                                    asyncio_mode=layout == "asyncio")  # fmt: skip

                def batches(loader: Any = loader) -> tuple[int, ...]:
                    stats = loader.stats()
                    keys = (*BATCH_STATS, *(f"batch_{step}_ns" for step in BATCH_STEPS))
                    return (*(int(stats.get(key, 0)) for key in keys), time.monotonic_ns())

                try:
                    # the poller's batches: shm channels only (grpc batches among its threads)
                    sweep(system, layout, functools.partial(fleet.run, duration=args.duration),
                          None if "grpc" in system else batches)  # fmt: skip
                finally:
                    fleet.close()
                loads.append(load_average())
                ran(system)
            checks.setdefault("sidecar_stats", {})["batched" if batched else "unbatched"] = {
                key: loader.stats().get(key) for key in ("batches", "batched", "largest_batch")
            }
            loader.close()

    for system in (s for s in args.systems if not s.startswith("kalos")):
        stop: Callable[[], None] | None = None
        with contextlib.ExitStack() as stack:
            if system == "torch-lock":
                make, stop = torch_lock(db, queries, args.k, args.device)
            elif system == "torch-batched":
                make, stop = torch_batched(db, queries, args.k, args.device)
            else:
                try:
                    make = stack.enter_context(redis_faiss(db, queries, args.k, args.redis_server))
                except Exception as exc:  # no redis-server here: the row says so
                    print(f"  {system}: skipped ({exc})")
                    rows["threads"].append({"system": system, "skipped": str(exc)})
                    ran(system)
                    continue

            pool = CallerPool(make, clients, ref, len(queries))

            def drive(rate: float, seed: int, pool=pool) -> tuple[list[float], int, float, float]:
                start_at = time.monotonic() + 0.2
                lat, wrong, last = pool.run(rate, start_at, args.duration, seed)
                return lat, wrong, last, start_at

            sweep(system, "threads", drive)
            pool.close()
            if stop is not None:
                stop()
        loads.append(load_average())
        ran(system)

    for layout, what in layouts.items():
        if not rows[layout]:
            continue
        print(f"\n{what}")
        print_table(
            rows[layout], ("system", "offered_qps", "qps", "p50_us", "p99_us", "p999_us", "wrong")
        )
    print({k: v for k, v in {**checks, **saturation_summary(rows)}.items()
           if k != "sidecar_stats"})  # fmt: skip
    path, doc = save([])
    print(f"wrote {path}")
    png = plot_curves(path, doc)
    if png:
        print(f"wrote {png}")
    return 1 if checks["wrong_results"] else 0


def _batch_row(
    row: dict[str, Any], before: Any, after: tuple[int, ...], searches: int
) -> tuple[int, ...]:
    """Adds to ``row`` the sidecar's batches over its run (``before`` and ``after``: its
    BATCH_STATS so far, then the clock): how many, their mean size and the share of the run's
    ``searches`` they answered; the mean time of a batch from its pickup to its last reply
    (``mean_us``), of which in the pass over the index (``search_us``) and in the dispatcher
    around it (``dispatch_us``, the decoding and encoding of its members), the rest the
    poller's; the share of the wall time the poller spent in its steps on batches
    (``busy_share``, the sum of ``steps_us``: near 1, the poller's one thread is the bound;
    the sweeps between them are not counted); the share of the wall time a batch's pass was
    left running on the GPU, from its start until the poller found it done
    (``running_share``: well below 1 under a closed loop, the GPU waits for the host); the
    share of the members whose callers had
    parked (``woken_share``: woken by the sidecar's waker thread); and the share of the
    batches whose pass ran while the poller decoded the next (``run_ahead_share``); and the
    mean time of the poller's steps on a batch (``steps_us``: decoding its members, starting
    its pass, of which settling the GPU's armed graphs, taking its answers, writing and
    publishing its responses). Returns ``after``."""
    n, members, total, dispatch, search, woken, ahead, running, *steps, now = (
        a - b for a, b in zip(after, before, strict=True)
    )
    per = 1e-3 / n if n else 0.0
    busy = sum(steps) - steps[BATCH_STEPS.index("settle")]  # (settling is part of the start)
    row["sidecar_batches"] = {
        "batches": n,
        "mean_batch": round(members / n, 2) if n else 0.0,
        "batched_share": round(members / searches, 3) if searches else 0.0,
        "mean_us": round(total * per, 1),
        "search_us": round(search * per, 1),
        # the pass's time in the dispatcher: all of it, less what ran while the poller served on
        "dispatch_us": round((dispatch - (search - running)) * per, 1),
        "busy_share": round(busy / now, 3) if now else 0.0,
        "running_share": round(running / now, 3) if now else 0.0,
        "woken_share": round(woken / members, 3) if members else 0.0,
        "run_ahead_share": round(ahead / n, 3) if n else 0.0,
        "steps_us": {step: round(ns * per, 1) for step, ns in zip(BATCH_STEPS, steps, strict=True)},
    }
    return after


def saturation_summary(rows: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The closed-loop throughput of each system, and kalos batched over unbatched."""
    closed = {
        r["system"]: r.get("qps", 0.0)
        for layout in rows.values()
        for r in layout
        if r.get("offered_qps", 0) is None
    }
    out: dict[str, Any] = {"closed_loop_qps": closed}
    for a, b, name in (
        ("kalos-shm", "kalos-shm-unbatched", "threads_batched_over_unbatched"),
        ("kalos-shm-async", "kalos-shm-async-unbatched", "asyncio_batched_over_unbatched"),
    ):
        if closed.get(a) and closed.get(b):
            out[name] = round(closed[a] / closed[b], 2)
    return out


def plot_curves(path: str, sets: list[dict[str, Any]]) -> str | None:
    """p50, p99 and p99.9 against achieved searches/s, a panel per parameter set."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        from kalos.bench.plots import png_path

        fig, axes = plt.subplots(1, len(sets), figsize=(7 * len(sets), 5), squeeze=False)
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"] * 3
        for ax, one in zip(axes[0], sets, strict=True):
            rows = one["rows"]
            systems = sorted({r["system"] for r in rows if "qps" in r})
            for color, system in zip(colors, systems, strict=False):
                swept = [r for r in rows if r["system"] == system and "qps" in r]
                mine = sorted(
                    (r for r in swept if r.get("offered_qps") is not None), key=lambda r: r["qps"]
                )
                if not mine:
                    continue
                x = [r["qps"] for r in mine]
                for key, style in (("p50_us", "-"), ("p99_us", "--"), ("p999_us", ":")):
                    ax.plot(x, [r[key] for r in mine], style, color=color, marker=".",
                            label=f"{system} {key[:-3]}")  # fmt: skip
            p = one["params"]
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("achieved searches/s")
            ax.set_ylabel("latency, µs (from each arrival)")
            ax.set_title(f"{p['corpus']} {p['n']:,} x {p['dim']}, {p['device']}: {p['clients']}",
                         fontsize=9)  # fmt: skip
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=6, ncol=2)
        title = f"load: exact top-{sets[0]['params']['k']}" if sets else "load"
        fig.suptitle(title)
        fig.tight_layout()
        out = png_path(path)
        fig.savefig(out, dpi=110)
        plt.close(fig)
        return out
    except Exception as exc:  # a plot is an extra: the JSON is written already
        import sys

        print(f"no plot: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None
