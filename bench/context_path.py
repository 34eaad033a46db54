"""Where the CPU time of one CONTEXT round trip over shm goes, piece by piece.

``kalos bench context --concurrency 1`` measures the whole call among Redis and dict calls
that evict the caches; this script takes the call apart, on the bench's data (1,000 sessions
x 50 turns of ~100 tokens, ``kalos.bench.context.make_sessions``) and its call
(``client.context(session, 4096, turns=False)``: the ids by reference into the token heap).

1. Pieces, in this process, each a loop of ``--iters`` calls over the sessions in the bench's
   random order, timed with ``time.perf_counter_ns`` around the loop (ns per call; the
   median and the minimum of ``--repeats`` loops):

   * client side: ``client.encode`` (:func:`kalos.protocol.messages.encode_context`),
     ``client.decode`` (``decode_context_response`` of a by-reference response),
     ``client.context`` (the whole :meth:`kalos.Client.context` over a stub transport that
     returns that response at once: everything of the call but the shm handover);
   * sidecar side: ``sidecar.decode`` (``decode_context``), ``sidecar.window``
     (``SessionStore.context_lent``), ``sidecar.encode`` (the 32-byte by-reference
     response), ``sidecar.handle`` (``Dispatcher.handle``: all three and the dispatch) and
     ``sidecar.serve`` (``Poller.serve`` on an in-process channel, with the admin
     endpoint's metrics as a sidecar has them by default: the request as the poller
     answers it, but the client's wake-up).

2. Round trips: a real sidecar (:func:`kalos.testing.isolated_sidecar`, its default
   options), pinned to the last CPU and this process to the others (the bench's
   ``--affinity split``), the sessions appended through the client, then ``--round-trips``
   CONTEXT calls in a plain loop (no Redis, no interleaving) and as many PINGs; p50/p99 of
   each, and the sidecar's own stages (compute + response write, from the response header).

Usage: ``python bench/context_path.py [--label before] [--out bench/results]``; prints a
table and writes ``context-path-<machine>-<date>[-<label>].json`` when ``--out`` is given.
It runs with ``PYTHONHASHSEED=0`` unless given another, so that runs differ only in where
the processes' memory lies, which still moves the sidecar's pieces and its compute by up to
~0.5 µs from one process to the next. The VM is noisy too: compare medians of several
alternated runs, never one run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np

import kalos
import kalos.index
from kalos.bench.common import cpu_split, machine_name, source_revision
from kalos.bench.context import make_sessions
from kalos.protocol import codes
from kalos.protocol import layout as L
from kalos.protocol import messages as M
from kalos.server.admin import RequestStats
from kalos.server.channels import Poller, ServerChannel
from kalos.server.dispatch import Dispatcher
from kalos.stores.memories import MemoryStore
from kalos.stores.sessions import SessionStore
from kalos.stores.token_heap import TokenHeap
from kalos.testing import isolated_sidecar
from kalos.transport.base import Response, Transport
from kalos.transport.memory import SharedMemory, create

BUDGET = 4_096
CONTEXT = int(codes.Op.CONTEXT)


def timed(fn: Callable[[int], Any], order: list[int], repeats: int) -> dict[str, float]:
    """ns per call of ``fn(item)`` over ``order``: the median and minimum of ``repeats``."""
    per_call = []
    clock = time.perf_counter_ns
    for _ in range(repeats):
        t0 = clock()
        for i in order:
            fn(i)
        per_call.append((clock() - t0) / len(order))
    return {"median_ns": round(float(np.median(per_call)), 1), "min_ns": round(min(per_call), 1)}


class StubTransport(Transport):
    """Answers every request with one canned response at once (the client's own cost)."""

    kind = "stub"

    def __init__(self, response: Response, heap: np.ndarray) -> None:
        self.server_info = {"arena_bytes": L.DEFAULT_ARENA_BYTES}
        self.request_buffer = np.zeros(L.DEFAULT_ARENA_BYTES, np.uint8)
        self.heap = heap
        self._response = response

    def request(self, op: int, flags: int, body_len: int, *, timeout: float) -> Response:
        return self._response

    def close(self) -> None:
        self._closed = True


def pieces(sessions: dict, order: list[int], repeats: int) -> dict[str, dict[str, float]]:
    """Each piece of the path, in this process (see the module docstring)."""
    names = list(sessions)
    heap = TokenHeap(64 << 20)
    store = SessionStore(heap=heap)
    for name, turns in sessions.items():
        for role, text, tokens in turns:
            store.append_turn(name, role, text, tokens, now=time.time())
    dispatcher = Dispatcher(MemoryStore(kalos.index.create("cpu:flat", dim=8)), sessions=store)
    ch = ServerChannel(1, 1, L.DEFAULT_ARENA_BYTES)
    heap.attach(ch)
    ch.reader = ch
    heap_view = heap.ids  # the client's mapping stands in (read-write here)
    # The request bodies, side by side (64 bytes each: a session id of up to 24 bytes).
    rows = np.zeros((len(names), 64), np.uint8)
    lengths = [M.encode_context(row, n.encode(), BUDGET, M.NO_LIMIT, M.EMPTY_SCOPE)
               for row, n in zip(rows, names, strict=True)]  # fmt: skip
    bodies = [row[:n] for row, n in zip(rows, lengths, strict=True)]
    out = np.zeros(L.DEFAULT_ARENA_BYTES, np.uint8)
    resp_len = dispatcher.handle(CONTEXT, 0, bodies[0], out, reader=ch)[1]
    assert resp_len == 32, "the bench's sessions must answer by reference"
    now = time.time()
    req = np.zeros(L.DEFAULT_ARENA_BYTES, np.uint8)
    session_bytes = [n.encode() for n in names]
    windows = [store.context_lent(n, BUDGET, None, ch, turns=False, now=now) for n in names]

    control_fd = create("kalos-control", L.CONTROL_SIZE)
    control = SharedMemory(control_fd, L.CONTROL_SIZE)
    poller = Poller(control, dispatcher.handle, threading.Lock(), spin_us=0, heartbeat_ms=100)
    poller.metrics = RequestStats("shm")
    seq = [0]

    def serve(i: int) -> None:
        ch.req_arena[: lengths[i]] = bodies[i]  # what the client wrote
        s = seq[0] = seq[0] + 1
        L.REQ_FIELDS.pack_into(ch.buf, L.REQ_OP, CONTEXT, 0, lengths[i], 0, 0)
        poller.serve(ch, s)

    def copy_only(i: int) -> None:  # serve's own setup, subtracted from it
        ch.req_arena[: lengths[i]] = bodies[i]
        seq[0] += 1
        L.REQ_FIELDS.pack_into(ch.buf, L.REQ_OP, CONTEXT, 0, lengths[i], 0, 0)

    client = kalos.Client(
        "stub",
        connector=lambda: StubTransport(Response(0, out[:32].copy(), 0, 1000, 100), heap_view),
    )
    dispatcher.handle(CONTEXT, 0, bodies[0], out, reader=ch)
    resp = out[:32].copy()

    result = {
        "client.encode": timed(
            lambda i: M.encode_context(req, session_bytes[i], BUDGET, M.NO_LIMIT, M.EMPTY_SCOPE),
            order,
            repeats,
        ),
        "client.decode": timed(
            lambda i: M.decode_context_response(resp, 32, heap_view), order, repeats
        ),
        "client.context": timed(
            lambda i: client.context(names[i], BUDGET, turns=False), order, repeats
        ),
        "sidecar.decode": timed(lambda i: M.decode_context(bodies[i], lengths[i]), order, repeats),
        "sidecar.window": timed(
            lambda i: store.context_lent(names[i], BUDGET, None, ch, turns=False, now=now),
            order,
            repeats,
        ),
        "sidecar.encode": timed(
            lambda i: M.encode_context_tokens_response(
                out, windows[i][0], windows[i][1], None, windows[i][5]
            ),
            order,
            repeats,
        ),
        "sidecar.handle": timed(
            lambda i: dispatcher.handle(CONTEXT, 0, bodies[i], out, reader=ch),
            order,
            repeats,
        ),
    }
    setup = timed(copy_only, order, repeats)
    whole = timed(serve, order, repeats)
    result["sidecar.serve"] = {k: round(whole[k] - setup[k], 1) for k in whole}
    client.close()
    ch.mem.close()
    control.close()
    os.close(control_fd)
    return result


def percentiles(ns: np.ndarray) -> dict[str, float]:
    us = ns / 1e3
    return {
        "p50_us": round(float(np.percentile(us, 50)), 2),
        "p90_us": round(float(np.percentile(us, 90)), 2),
        "p99_us": round(float(np.percentile(us, 99)), 2),
        "p999_us": round(float(np.percentile(us, 99.9)), 2),
        "mean_us": round(float(us.mean()), 2),
    }


def round_trips(sessions: dict, order: list[int], n: int) -> dict[str, Any]:
    """CONTEXT and PING round trips against a real sidecar, pinned apart (split)."""
    names = list(sessions)
    calls = [names[order[j % len(order)]] for j in range(n)]
    with contextlib.ExitStack() as stack:
        sidecar = stack.enter_context(isolated_sidecar(dim=8, name="context-path"))
        affinity = stack.enter_context(cpu_split("split", {"sidecar": sidecar.process.pid}))
        client = stack.enter_context(sidecar.connect())
        for name, turns in sessions.items():
            for role, text, tokens in turns:
                client.append_turn(name, role, text, tokens)
        for name in calls[:2000]:  # warm up
            client.context(name, BUDGET, turns=False)
        clock = time.monotonic_ns
        ctx_ns = np.zeros(n, np.int64)
        sidecar_ns = np.zeros(n, np.int64)
        for j, name in enumerate(calls):
            t0 = clock()
            client.context(name, BUDGET, turns=False)
            ctx_ns[j] = clock() - t0
            timings = client.last_timings
            sidecar_ns[j] = int((timings.compute_us + timings.write_us) * 1e3)
        for _ in range(2000):
            client.ping()
        ping_ns = np.zeros(n, np.int64)
        for j in range(n):
            t0 = clock()
            client.ping()
            ping_ns[j] = clock() - t0
    return {
        "affinity": affinity,
        "context": percentiles(ctx_ns),
        "context_sidecar_compute_write": percentiles(sidecar_ns),
        "ping": percentiles(ping_ns),
    }


def main() -> None:
    if "PYTHONHASHSEED" not in os.environ:
        # One hash seed for every run, and the sidecar it starts: the same dict layouts.
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, *sys.argv])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=1_000)
    ap.add_argument("--turns", type=int, default=50)
    ap.add_argument("--iters", type=int, default=20_000, help="calls per piece loop; 0: none")
    ap.add_argument("--repeats", type=int, default=5, help="loops per piece")
    ap.add_argument("--round-trips", type=int, default=20_000, help="0: pieces only")
    ap.add_argument("--label", default=None, help="appended to the result file name")
    ap.add_argument("--machine", default="ci-2core")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sessions = make_sessions(
        SimpleNamespace(seed=7, sessions=args.sessions, turns=args.turns, tokens=100)
    )
    rng = np.random.default_rng(8)  # the bench's order: seed + 1
    n = max(args.iters, args.round_trips, 1)
    order = [int(i) for i in rng.integers(0, args.sessions, size=n)]
    result: dict[str, Any] = {
        "scenario": "context-path",
        "machine": machine_name(args.machine),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "source": source_revision(),
        "label": args.label,
        "params": {
            "sessions": args.sessions,
            "turns": args.turns,
            "budget": BUDGET,
            "iters": args.iters,
            "repeats": args.repeats,
            "round_trips": args.round_trips,
        },
        "load_average_before": os.getloadavg(),
    }
    # The pieces on the CPU the caller gets in the round trips (split: the first ones).
    affinity = sorted(os.sched_getaffinity(0))
    if len(affinity) > 1:
        os.sched_setaffinity(0, affinity[:-1])
    result["pieces"] = pieces(sessions, order[: args.iters], args.repeats) if args.iters else {}
    os.sched_setaffinity(0, affinity)
    for name, row in result["pieces"].items():
        print(f"{name:16s} {row['median_ns']:8.1f} ns (min {row['min_ns']:.1f})")
    if args.round_trips:
        result["round_trips"] = rt = round_trips(sessions, order, args.round_trips)
        for name in ("context", "context_sidecar_compute_write", "ping"):
            r = rt[name]
            print(f"{name:30s} p50 {r['p50_us']:6.2f}  p99 {r['p99_us']:6.2f} µs")
    result["load_average_after"] = os.getloadavg()
    if args.out:
        day = datetime.date.today().isoformat()
        stem = f"context-path-{result['machine']}-{day}" + (f"-{args.label}" if args.label else "")
        path = os.path.join(args.out, stem + ".json")
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
