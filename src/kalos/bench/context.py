"""context: a session's newest turns within 4,096 tokens, kalos vs Redis vs an in-process dict.

1,000 sessions x 50 turns of ~100 tokens (docs/PERFORMANCE.md). Side by side, in one run:

* ``kalos-shm``: ``client.context(session, 4096, turns=False)`` end to end against a sidecar
  process (shm): the window's token ids, as an int32 view, which is what the model takes.
  By default the client computes the window itself from the sidecar's session index (shared
  memory, read-only; ``Client``'s ``local_reads``): no request, a read-only view of the token
  heap. ``params.kalos_shm_local`` counts the sessions it answered so.
* ``kalos-shm-request``: the same call from a client with ``local_reads=False``: a request
  through the sidecar, answered with a read-only view of its token heap (no copy).
* ``kalos-shm+turns``: ``client.context(session, 4096)`` and every (role, text) of the window
  decoded (a request: turns are not in the index): the same output as the Redis module's.
* ``redis-json``: a Python memory module on a real ``redis-server`` (started here, on a
  private Unix socket): a list of JSON turns per session; LRANGE, ``json.loads``, the newest
  turns that fit, their token ids concatenated into one int32 array.
* ``dict-inprocess``: the same module over a dict in this process (no server, no JSON).

Every system answers the same random sequence of sessions at each concurrency level
(``--concurrency``, default 1, 8 and 64 threads of this process: one kalos channel and one
Redis connection per thread), in interleaved blocks whose order rotates; each thread starts a
block with a few untimed calls. Every session is checked up front, and every answer of the
run against the dict module's (token ids, and turns where the system returns them) after its
timer stopped; mismatches are counted and fail the run. The kalos rows carry the per-stage
breakdown of :mod:`kalos.bench.common` (mean and p50 µs of client write, sidecar wait,
compute, response write, client read). Threads share this process's GIL, as the request
threads of a Python inference service do; at 64 threads on a small machine that is part of
what is measured, for kalos and the Redis module alike.

With ``--affinity split`` (the default) the sidecar and redis-server run on the last CPU and
the calling threads on the others, so that no client shares a core with its server
(:func:`kalos.bench.common.cpu_split`; ``params.affinity`` records it).

The JSON lands in ``--out`` with a PNG beside it: latency CDFs per concurrency level, and the
kalos stages as stacked bars. The Redis and dict modules live in :mod:`kalos.bench.baseline`.

Needs redis-py (``pip install 'kalos[bench]'``) and ``redis-server`` (installed with
``apt-get install -y redis-server`` when missing and this runs as root).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from typing import Any

import numpy as np

from kalos.bench.baseline import DictMemory, RedisMemory, Turn, find_redis_server, redis_server
from kalos.bench.common import (
    System,
    add_affinity_argument,
    cpu_split,
    level_rows,
    load_average,
    plot_levels,
    print_table,
    run_levels,
    source_revision,
    write_result,
)
from kalos.testing import isolated_sidecar

SCENARIO = "context"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sessions", type=int, default=1_000)
    p.add_argument("--turns", type=int, default=50, help="turns per session")
    p.add_argument("--tokens", type=int, default=100, help="mean token ids per turn (±20%%)")
    p.add_argument("--budget", type=int, default=4_096, help="max_tokens of each context")
    p.add_argument("--requests", type=int, default=20_000,
                   help="timed calls per system and concurrency level")  # fmt: skip
    p.add_argument("--block", type=int, default=500, help="calls per interleaved block")
    p.add_argument("--warmup", type=int, default=2_000, help="untimed calls per system first")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64],
                   help="threads calling at once, one level after the other")  # fmt: skip
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--redis-server", default=None, help="path of redis-server")
    p.add_argument("--suffix", default=None, help="appended to the result file names")
    p.add_argument("--token-heap-mb", type=float, default=None,
                   help="the sidecar's --token-heap-mb (default: its own, 256; 0: copy the "
                   "token ids into each response, the path before the token heap)")  # fmt: skip
    add_affinity_argument(p, "the sidecar and redis-server")


# -- the run -----------------------------------------------------------------------------------


def make_sessions(args: argparse.Namespace) -> dict[str, list[Turn]]:
    rng = np.random.default_rng(args.seed)
    lo, hi = int(args.tokens * 0.8), int(args.tokens * 1.2)
    sessions = {}
    for s in range(args.sessions):
        turns = []
        for k in range(args.turns):
            n = int(rng.integers(lo, hi + 1))
            tokens = rng.integers(0, 50_000, size=n, dtype=np.int32)
            text = rng.integers(97, 123, size=4 * n, dtype=np.uint8).tobytes().decode()
            turns.append(("user" if k % 2 == 0 else "assistant", text, tokens))
        sessions[f"session-{s:05d}"] = turns
    return sessions


def run(args: argparse.Namespace) -> int:
    sessions = make_sessions(args)
    names = list(sessions)
    order = np.random.default_rng(args.seed + 1).integers(0, len(names), size=args.requests)
    redis_bin = find_redis_server(args.redis_server)
    budget = args.budget
    levels = list(args.concurrency)
    with contextlib.ExitStack() as stack:
        heap = () if args.token_heap_mb is None else ("--token-heap-mb", str(args.token_heap_mb))
        sidecar = stack.enter_context(
            isolated_sidecar(dim=8, name="bench-context", extra_args=heap)
        )
        r, redis_version = stack.enter_context(redis_server(redis_bin))
        servers = {"sidecar": sidecar.process.pid, "redis": int(r.info("server")["process_id"])}
        affinity = stack.enter_context(cpu_split(args.affinity, servers))
        client = sidecar.connect()
        asking = sidecar.connect(local_reads=False)  # every context a request
        redis_mem, dict_mem = RedisMemory(r), DictMemory()
        t0 = time.perf_counter()
        for name, turns in sessions.items():
            for role, text, tokens in turns:
                client.append_turn(name, role, text, tokens)
            redis_mem.load(name, turns)
            dict_mem.load(name, turns)
        print(
            f"loaded {len(names)} sessions x {args.turns} turns in {time.perf_counter() - t0:.1f} s"
        )

        # Correctness first, every session: the same ids and turns from all three. The dict
        # module's answers are also what every timed call is checked against.
        mismatches = 0
        local = 0  # sessions whose window the client computed itself
        window_tokens = []
        want: list[tuple[np.ndarray, list[tuple[str, str]]]] = []
        for name in names:
            ctx = client.context(name, budget, copy=True)
            want_tokens, want_turns = dict_mem.context(name, budget)
            got_redis = redis_mem.context(name, budget)
            ids = client.context(name, budget, turns=False)
            local += ids.local
            ok = (
                np.array_equal(ctx.tokens, want_tokens)
                and np.array_equal(ids.tokens, want_tokens)
                and np.array_equal(asking.context(name, budget, turns=False).tokens, want_tokens)
                and np.array_equal(got_redis[0], want_tokens)
                and list(ctx.turns) == want_turns == got_redis[1]
                and ctx.tokens.dtype == got_redis[0].dtype == np.int32
            )
            mismatches += int(not ok)
            window_tokens.append(len(want_tokens))
            want.append((want_tokens, want_turns))

        def kalos_tokens(i: int) -> Any:
            return client.context(names[i], budget, turns=False).tokens

        def kalos_request(i: int) -> Any:
            return asking.context(names[i], budget, turns=False).tokens

        def kalos_turns(i: int) -> Any:
            ctx = client.context(names[i], budget)
            return ctx.tokens, list(ctx.turns)

        def same_tokens(i: int, got: Any) -> bool:
            return bool(got.dtype == np.int32 and np.array_equal(got, want[i][0]))

        def same_window(i: int, got: Any) -> bool:
            return same_tokens(i, got[0]) and got[1] == want[i][1]

        systems = [
            System("kalos-shm", kalos_tokens, same_tokens, client),
            System("kalos-shm-request", kalos_request, same_tokens, asking),
            System("kalos-shm+turns", kalos_turns, same_window, client),
            System("redis-json", lambda i: redis_mem.context(names[i], budget), same_window),
            System("dict-inprocess", lambda i: dict_mem.context(names[i], budget), same_window),
        ]
        for system in systems:  # warm up every path
            for j in range(args.warmup):
                system.call(int(order[j % len(order)]))

        load_before = load_average()
        results = run_levels(
            "context", systems, order, levels, block=args.block, warmup=20, quiet=args.quiet
        )
        load_after = load_average()
        client.close()
        asking.close()

    rows, bad = level_rows(results, systems, "redis-json", ratio="redis")
    mismatches += bad
    columns = ("system", "concurrency", "p50_us", "p99_us", "p999_us", "qps",
               "redis_over_this_p50", "redis_over_this_p99")  # fmt: skip
    print_table(rows, columns)
    one = {row["system"]: row for row in rows if row["concurrency"] == levels[0]}
    k, kt = one["kalos-shm"], one["kalos-shm+turns"]
    targets = {
        "kalos_p99_le_15us": k["p99_us"] <= 15.0,
        "kalos_10x_faster_than_redis_p99": k["redis_over_this_p99"] >= 10.0,
        "kalos_10x_faster_than_redis_p50": k["redis_over_this_p50"] >= 10.0,
        "kalos_with_turns_p99_le_15us": kt["p99_us"] <= 15.0,
        "kalos_with_turns_10x_faster_than_redis_p99": kt["redis_over_this_p99"] >= 10.0,
    }
    print(f"targets (at {levels[0]} thread(s)): {targets}")
    print(f"kalos-shm stages, mean µs: {k.get('stages', {}).get('mean_us')}")
    print(f"correctness: {mismatches} mismatches ({len(names)} sessions up front, every call)")
    print(f"load average before/after: {load_before} / {load_after}")
    params = {
        "sessions": args.sessions,
        "turns": args.turns,
        "tokens_per_turn": [int(args.tokens * 0.8), int(args.tokens * 1.2)],
        "budget_tokens": budget,
        "mean_window_tokens": round(float(np.mean(window_tokens)), 1),
        "requests": args.requests,
        "block": args.block,
        "concurrency": levels,
        "seed": args.seed,
        "redis": f"redis-server {redis_version}, Unix socket, redis-py, JSON list per session",
        "affinity": affinity,
        "token_heap_mb": args.token_heap_mb,  # None: the sidecar's default (256)
        "kalos_shm_local": local,  # of the sessions, answered from the session index
    }
    path = write_result(
        SCENARIO,
        args.machine,
        params,
        rows,
        args.out,
        args.suffix,
        mismatches=mismatches,
        targets=targets,
        load_average_before=load_before,
        load_average_after=load_after,
        source=source_revision(),
    )
    print(f"wrote {path}")
    plot_levels(
        path,
        results,
        rows,
        f"context: {args.sessions:,} sessions x {args.turns} turns, {budget} tokens",
    )
    return 1 if mismatches else 0
