"""context: a session's newest turns within 4,096 tokens, kalos vs Redis vs an in-process dict.

1,000 sessions x 50 turns of ~100 tokens (BENCHMARKS.md). Side by side, in one run:

* ``kalos-shm``: ``client.context(session, 4096, turns=False)`` end to end through a sidecar
  process (shm): the window's token ids, as an int32 view, which is what the model takes.
* ``kalos-shm+turns``: ``client.context(session, 4096)`` and every (role, text) of the window
  decoded: the same output as the Redis module's.
* ``redis-json``: a Python memory module on a real ``redis-server`` (started here, on a
  private Unix socket): a list of JSON turns per session; LRANGE, ``json.loads``, the newest
  turns that fit, their token ids concatenated into one int32 array.
* ``dict-inprocess``: the same module over a dict in this process (no server, no JSON).

Every system answers the same random sequence of sessions, in interleaved blocks whose order
rotates; each block starts with a few untimed calls. All three must return the same token
ids (and turns) for every session; mismatches are counted and fail the run.

Needs redis-py (``pip install 'kalos[bench]'``) and ``redis-server`` (installed with
``apt-get install -y redis-server`` when missing and this runs as root).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from kalos.bench.common import print_table, summarize, write_result
from kalos.errors import ConfigError
from kalos.testing import isolated_sidecar

SCENARIO = "context"
Window = tuple[np.ndarray, list[tuple[str, str]]]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sessions", type=int, default=1_000)
    p.add_argument("--turns", type=int, default=50, help="turns per session")
    p.add_argument("--tokens", type=int, default=100, help="mean token ids per turn (±20%%)")
    p.add_argument("--budget", type=int, default=4_096, help="max_tokens of each context")
    p.add_argument("--requests", type=int, default=20_000, help="timed calls per system")
    p.add_argument("--block", type=int, default=500, help="calls per interleaved block")
    p.add_argument("--warmup", type=int, default=2_000, help="untimed calls per system first")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--redis-server", default=None, help="path of redis-server")


# -- the baselines: a Python memory module over Redis, and over a dict ----------------------


class RedisMemory:
    """Turns as JSON in a Redis list per session: what a Python service typically runs."""

    def __init__(self, client: Any) -> None:  # client: redis.Redis
        self.r = client

    def load(self, session: str, turns: list[tuple[str, str, np.ndarray]]) -> None:
        pipe = self.r.pipeline(transaction=False)
        for role, text, tokens in turns:
            pipe.rpush(
                f"session:{session}",
                json.dumps({"role": role, "text": text, "tokens": tokens.tolist()}),
            )
        pipe.execute()

    def context(self, session: str, max_tokens: int) -> Window:
        turns = [json.loads(raw) for raw in self.r.lrange(f"session:{session}", 0, -1)]
        return newest_that_fit(turns, max_tokens)


def newest_that_fit(turns: list[dict[str, Any]], max_tokens: int) -> Window:
    budget = max_tokens
    chosen = []
    for turn in reversed(turns):
        n = len(turn["tokens"])
        if n > budget:
            break
        budget -= n
        chosen.append(turn)
    chosen.reverse()
    tokens = np.fromiter(itertools.chain.from_iterable(t["tokens"] for t in chosen), np.int32)
    return tokens, [(t["role"], t["text"]) for t in chosen]


class DictMemory:
    """The same module over a dict in this process: turns with int32 token arrays."""

    def __init__(self) -> None:
        self.sessions: dict[str, list[tuple[str, str, np.ndarray]]] = {}

    def load(self, session: str, turns: list[tuple[str, str, np.ndarray]]) -> None:
        self.sessions[session] = list(turns)

    def context(self, session: str, max_tokens: int) -> Window:
        budget = max_tokens
        chosen = []
        for turn in reversed(self.sessions[session]):
            if len(turn[2]) > budget:
                break
            budget -= len(turn[2])
            chosen.append(turn)
        chosen.reverse()
        tokens = np.concatenate([t[2] for t in chosen]) if chosen else np.empty(0, np.int32)
        return tokens, [(t[0], t[1]) for t in chosen]


# -- redis-server ------------------------------------------------------------------------------


def find_redis_server(path: str | None) -> str:
    """redis-server's path; installs Debian's package when it is missing and we are root."""
    found = path or shutil.which("redis-server")
    if found:
        return found
    if os.geteuid() == 0 and shutil.which("apt-get"):
        print("redis-server is missing: apt-get install -y redis-server")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        if subprocess.run(["apt-get", "install", "-y", "redis-server"], env=env).returncode:
            subprocess.run(["apt-get", "update"], env=env, check=False)
            subprocess.run(["apt-get", "install", "-y", "redis-server"], env=env, check=True)
        found = shutil.which("redis-server")
        if found:
            return found
    raise ConfigError("redis-server not found: apt-get install redis-server, or --redis-server")


@contextlib.contextmanager
def redis_server(binary: str) -> Iterator[tuple[Any, str]]:
    """A private redis-server on a Unix socket in a temporary directory; (client, version)."""
    try:
        import redis
    except ImportError as exc:
        raise ConfigError(
            "the context benchmark needs redis-py: pip install 'kalos[bench]'"
        ) from exc
    with tempfile.TemporaryDirectory(prefix="kalos-redis-") as tmp:
        sock = os.path.join(tmp, "redis.sock")
        proc = subprocess.Popen(
            [binary, "--port", "0", "--unixsocket", sock, "--unixsocketperm", "700", "--save", "",
             "--appendonly", "no", "--dir", tmp, "--daemonize", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 30
            client = redis.Redis(unix_socket_path=sock)
            while True:
                try:
                    client.ping()
                    break
                except (redis.ConnectionError, FileNotFoundError):
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise ConfigError("redis-server did not start") from None
                    time.sleep(0.05)
            version = str(client.info("server").get("redis_version", "?"))
            yield client, version
            client.close()
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# -- the run -----------------------------------------------------------------------------------


def make_sessions(args: argparse.Namespace) -> dict[str, list[tuple[str, str, np.ndarray]]]:
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


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def source_revision() -> str:
    """The git commit the benchmark ran from (``+dirty`` with uncommitted changes), or "?"."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        rev = subprocess.run(
            ["git", "-C", here, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return rev + ("+dirty" if dirty else "")


def run(args: argparse.Namespace) -> int:
    sessions = make_sessions(args)
    names = list(sessions)
    order = np.random.default_rng(args.seed + 1).integers(0, len(names), size=args.requests)
    redis_bin = find_redis_server(args.redis_server)
    budget = args.budget
    with (
        isolated_sidecar(dim=8, name="bench-context") as sidecar,
        redis_server(redis_bin) as (
            r,
            redis_version,
        ),
    ):
        client = sidecar.connect()
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

        def kalos_tokens(name: str) -> Any:
            return client.context(name, budget, turns=False).tokens

        def kalos_turns(name: str) -> Any:
            ctx = client.context(name, budget)
            return ctx.tokens, list(ctx.turns)

        systems = {
            "kalos-shm": kalos_tokens,
            "kalos-shm+turns": kalos_turns,
            "redis-json": lambda name: redis_mem.context(name, budget),
            "dict-inprocess": lambda name: dict_mem.context(name, budget),
        }

        # Correctness first, every session: the same ids and turns from all three.
        mismatches = 0
        window_tokens = []
        for name in names:
            ctx = client.context(name, budget, copy=True)
            want_tokens, want_turns = dict_mem.context(name, budget)
            got_redis = redis_mem.context(name, budget)
            ok = (
                np.array_equal(ctx.tokens, want_tokens)
                and np.array_equal(client.context(name, budget, turns=False).tokens, want_tokens)
                and np.array_equal(got_redis[0], want_tokens)
                and list(ctx.turns) == want_turns == got_redis[1]
                and ctx.tokens.dtype == got_redis[0].dtype == np.int32
            )
            mismatches += int(not ok)
            window_tokens.append(len(want_tokens))

        for fn in systems.values():  # warm up every path
            for i in range(args.warmup):
                fn(names[int(order[i % len(order)])])

        samples = {s: np.zeros(args.requests, np.int64) for s in systems}
        walls = dict.fromkeys(systems, 0.0)
        stages = np.zeros((args.requests, 3), np.float64)  # kalos: queue, compute, write µs
        load_before = load_average()
        clock = time.perf_counter_ns
        keys = list(systems)
        for b, at in enumerate(range(0, args.requests, args.block)):
            idx = [names[int(i)] for i in order[at : at + args.block]]
            rotation = keys[b % len(keys) :] + keys[: b % len(keys)]
            for system in rotation:
                fn, out = systems[system], samples[system]
                for name in idx[:20]:  # untimed: wake the sidecar, warm the caches
                    fn(name)
                w0 = time.perf_counter()
                for i, name in enumerate(idx, start=at):
                    t = clock()
                    fn(name)
                    out[i] = clock() - t
                    if system == "kalos-shm":
                        tm = client.last_timings
                        stages[i] = (tm.queue_us, tm.compute_us, tm.write_us)
                walls[system] += time.perf_counter() - w0
        load_after = load_average()
        client.close()

    rows = [summarize(s, samples[s], walls[s]) for s in systems]
    by = {row["system"]: row for row in rows}
    for row in rows:
        row["redis_over_this_p50"] = round(by["redis-json"]["p50_us"] / row["p50_us"], 2)
        row["redis_over_this_p99"] = round(by["redis-json"]["p99_us"] / row["p99_us"], 2)
    k = by["kalos-shm"]
    k["sidecar_p50_us"] = {
        "queue": round(float(np.percentile(stages[:, 0], 50)), 3),
        "compute": round(float(np.percentile(stages[:, 1], 50)), 3),
        "write": round(float(np.percentile(stages[:, 2], 50)), 3),
    }
    print_table(
        rows,
        (
            "system",
            "p50_us",
            "p99_us",
            "p999_us",
            "qps",
            "redis_over_this_p50",
            "redis_over_this_p99",
        ),
    )
    kt = by["kalos-shm+turns"]
    targets = {
        "kalos_p99_le_15us": k["p99_us"] <= 15.0,
        "kalos_10x_faster_than_redis_p99": k["redis_over_this_p99"] >= 10.0,
        "kalos_10x_faster_than_redis_p50": k["redis_over_this_p50"] >= 10.0,
        "kalos_with_turns_p99_le_15us": kt["p99_us"] <= 15.0,
        "kalos_with_turns_10x_faster_than_redis_p99": kt["redis_over_this_p99"] >= 10.0,
    }
    print(f"targets: {targets}")
    print(f"sidecar stages at p50 (µs): {k['sidecar_p50_us']}")
    print(f"correctness: {mismatches} mismatches over {len(names)} sessions")
    print(f"load average before/after: {load_before} / {load_after}")
    params = {
        "sessions": args.sessions,
        "turns": args.turns,
        "tokens_per_turn": [int(args.tokens * 0.8), int(args.tokens * 1.2)],
        "budget_tokens": budget,
        "mean_window_tokens": round(float(np.mean(window_tokens)), 1),
        "requests": args.requests,
        "block": args.block,
        "seed": args.seed,
        "redis": f"redis-server {redis_version}, Unix socket, redis-py, JSON list per session",
    }
    path = write_result(
        SCENARIO,
        args.machine,
        params,
        rows,
        args.out,
        mismatches=mismatches,
        targets=targets,
        load_average_before=load_before,
        load_average_after=load_after,
        source=source_revision(),
    )
    print(f"wrote {path}")
    return 1 if mismatches else 0
