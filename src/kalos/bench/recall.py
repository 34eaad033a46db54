"""recall: one LLM request's whole memory step, kalos vs Redis + in-process FAISS + torch.

The step: a session's context and the top-5 memories for a query, handed to the model as one
sequence of token ids ([memories, best hit first] + [the newest turns, oldest first], within
4,096 tokens; kalos's rule, :func:`kalos.bench.baseline.assemble`). Data (docs/PERFORMANCE.md):
100K memories of 384 dims (random unit vectors, fixed seed), each with a text of 30-60
tokens and its token ids; 1,000 sessions x 50 turns of ~100 tokens. Side by side, in one
interleaved run at each concurrency level (``--concurrency``, default 1, 8 and 64 threads):

* ``kalos-shm``: ``client.recall(session, query, k=5, max_tokens=4096)`` end to end through a
  sidecar process (shm): the token ids as an int32 view on the host, with the hits' ids,
  scores and texts. With ``--device cuda`` the sidecar searches on the GPU (``--device cuda``)
  and this row reads the ids back on the host;
* ``kalos-shm-gpu`` (``--device cuda`` only): ``client.recall(..., device="cuda")``: the token
  ids as a torch int32 tensor on the GPU, written there by the sidecar (no host copy);
* ``redis+faiss``: the traditional stack (:class:`kalos.bench.baseline.RedisFaissRecall`): a
  FAISS ``IndexIDMap(IndexFlatIP)`` search in this process, one pipelined Redis round trip
  for the session's JSON turns (LRANGE) and the hits' JSON texts and token ids (MGET),
  ``json.loads``, the same assembly, ``torch.tensor(ids).to(device)`` (cuda on a GPU host).

Queries: each session has one, a weighted mix of 5 memories plus noise, so that its top-5
stand clear of the rest and of each other (every gap among the exact top-6 scores is at
least ``--margin``, checked here; fp16 rounding on the GPU is far smaller): both stacks must
return the same memories in the same order, and so the same token ids. Every answer of the run
(ids, texts, token ids) is checked against the exact answer (numpy float32 scores and the
assembly rule) after its timer stopped; mismatches fail the run.

Concurrency is threads of this process, one kalos channel and one Redis connection per
thread, the way a Python inference server's request threads share one memory module; kalos
waits for the sidecar and FAISS searches with the GIL released. The kalos rows carry the
per-stage breakdown (:mod:`kalos.bench.common`) and the sidecar's own split of compute
(context, search, assemble). The JSON lands in ``--out`` with a PNG beside it.

Needs faiss-cpu, torch and redis-py (``pip install 'kalos[faiss,gpu,bench]'``) and
``redis-server``.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from typing import Any

import numpy as np

from kalos.bench.baseline import (
    RedisFaissRecall,
    Turn,
    assemble,
    find_redis_server,
    redis_server,
)
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
from kalos.errors import ConfigError
from kalos.testing import isolated_sidecar

SCENARIO = "recall"
WEIGHTS = np.array([0.6, 0.5, 0.42, 0.36, 0.3], np.float32)  # a query's mix of 5 memories


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--memories", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--sessions", type=int, default=1_000)
    p.add_argument("--turns", type=int, default=50, help="turns per session")
    p.add_argument("--tokens", type=int, default=100, help="mean token ids per turn (±20%%)")
    p.add_argument("--budget", type=int, default=4_096, help="max_tokens of each recall")
    p.add_argument("--k", type=int, default=5, help="memories per recall")
    p.add_argument("--requests", type=int, default=2_000,
                   help="timed recalls per system and concurrency level")  # fmt: skip
    p.add_argument("--block", type=int, default=200, help="recalls per interleaved block")
    p.add_argument("--warmup", type=int, default=200, help="untimed recalls per system first")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64],
                   help="threads calling at once, one level after the other")  # fmt: skip
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="the sidecar's device; cuda adds the kalos-shm-gpu row")  # fmt: skip
    p.add_argument("--margin", type=float, default=2e-3,
                   help="least gap between the exact top-(k+1) scores of a query")  # fmt: skip
    p.add_argument("--spin-us", type=float, default=None,
                   help="the kalos client spins this long, then parks")  # fmt: skip
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--redis-server", default=None, help="path of redis-server")
    add_affinity_argument(p, "the sidecar and redis-server")
    p.add_argument("--suffix", default=None,
                   help="appended to the result file names (default: the device)")  # fmt: skip


# -- data -------------------------------------------------------------------------------------


class Corpus:
    """Memories (unit vectors, texts, token ids), sessions, and one query per session."""

    def __init__(self, args: argparse.Namespace) -> None:
        rng = np.random.default_rng(args.seed)
        n, dim = args.memories, args.dim
        v = rng.standard_normal((n, dim), dtype=np.float32)
        v /= np.linalg.norm(v, axis=1, keepdims=True)
        self.vectors = v  # [n, dim] float32, unit rows
        self.ids = np.arange(n, dtype=np.int64) * 7 + 3
        lengths = rng.integers(30, 61, size=n)
        flat = rng.integers(0, 50_000, size=int(lengths.sum()), dtype=np.int32)
        self.tokens = np.split(flat, np.cumsum(lengths)[:-1])  # n int32 arrays
        letters = rng.integers(97, 123, size=int(lengths.sum()) * 4, dtype=np.uint8).tobytes()
        ends = np.cumsum(lengths * 4)
        self.texts = [letters[e - 4 * m : e].decode() for e, m in zip(ends, lengths, strict=True)]
        self.sessions = make_sessions(args, rng)
        self.names = list(self.sessions)
        self.queries, self.top = make_queries(v, len(self.names), args.k, args.margin, rng)

    def expected(self, args: argparse.Namespace) -> list[tuple[np.ndarray, np.ndarray, list]]:
        """Per session: the exact (memory ids, token ids, texts) of its recall."""
        out = []
        for j, name in enumerate(self.names):
            rows = self.top[j]
            turns = [t[2] for t in self.sessions[name]]
            ids = assemble(None, [self.tokens[r] for r in rows], turns, args.budget)
            out.append((self.ids[rows], np.asarray(ids, np.int32), [self.texts[r] for r in rows]))
        return out


def make_sessions(args: argparse.Namespace, rng: np.random.Generator) -> dict[str, list[Turn]]:
    lo, hi = int(args.tokens * 0.8), int(args.tokens * 1.2)
    sessions = {}
    for s in range(args.sessions):
        lengths = rng.integers(lo, hi + 1, size=args.turns)
        flat = rng.integers(0, 50_000, size=int(lengths.sum()), dtype=np.int32)
        letters = rng.integers(97, 123, size=int(lengths.sum()) * 4, dtype=np.uint8).tobytes()
        turns = []
        at = 0
        for k, m in enumerate(lengths):
            m = int(m)
            text = letters[4 * at : 4 * (at + m)].decode()
            turns.append(("user" if k % 2 == 0 else "assistant", text, flat[at : at + m]))
            at += m
        sessions[f"session-{s:05d}"] = turns
    return sessions


def make_queries(
    v: np.ndarray, count: int, k: int, margin: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """``count`` unit queries, each a weighted mix of ``k`` memories plus noise, whose exact
    top-(k+1) scores are all at least ``margin`` apart; and their exact top-k rows, best first.
    """
    n, dim = v.shape
    weights = np.resize(WEIGHTS, k) if k > len(WEIGHTS) else WEIGHTS[:k]
    queries = np.zeros((count, dim), np.float32)
    top = np.zeros((count, k), np.int64)
    todo = np.arange(count)
    for _ in range(50):
        if not len(todo):
            break
        picks = np.stack([rng.choice(n, size=k, replace=False) for _ in todo])
        q = np.einsum("qk,qkd->qd", np.broadcast_to(weights, picks.shape), v[picks])
        q += rng.standard_normal(q.shape, dtype=np.float32) * (0.2 / np.sqrt(dim))
        q /= np.linalg.norm(q, axis=1, keepdims=True)
        part, s = exact_top(q, v, k + 1)
        order = np.argsort(-s, axis=1, kind="stable")
        part, s = np.take_along_axis(part, order, 1), np.take_along_axis(s, order, 1)
        ok = (-np.diff(s, axis=1)).min(axis=1) >= margin
        queries[todo[ok]], top[todo[ok]] = q[ok], part[ok, :k]
        todo = todo[~ok]
    if len(todo):
        raise ConfigError(f"no queries with top-{k + 1} scores {margin} apart: lower --margin")
    return queries, top


def exact_top(q: np.ndarray, v: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
    """The rows of ``v`` with the ``m`` highest inner products with each query (any order),
    and those scores: float32 numpy, 256 queries at a time."""
    rows, scores = [], []
    for i in range(0, len(q), 256):
        s = q[i : i + 256] @ v.T  # [256, n] float32
        part = np.argpartition(-s, m - 1, axis=1)[:, :m]
        rows.append(part)
        scores.append(np.take_along_axis(s, part, axis=1))
    return np.concatenate(rows), np.concatenate(scores)


# -- the run -----------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    import torch

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("recall --device cuda needs a CUDA GPU")
        return 2
    base_device = "cuda" if torch.cuda.is_available() else "cpu"
    redis_bin = find_redis_server(args.redis_server)
    t0 = time.perf_counter()
    corpus = Corpus(args)
    want = corpus.expected(args)
    names, queries, budget, k = corpus.names, corpus.queries, args.budget, args.k
    print(f"made {args.memories:,} memories x {args.dim} and {len(names)} sessions x "
          f"{args.turns} turns in {time.perf_counter() - t0:.1f} s")  # fmt: skip
    order = np.random.default_rng(args.seed + 1).integers(0, len(names), size=args.requests)
    levels = list(args.concurrency)
    extra_args: tuple[str, ...] = ()
    if cuda:
        extra_args = ("--device", "cuda", "--reserve", str(args.memories))
    with (
        tempfile.TemporaryDirectory(prefix="kalos-bench-") as rd,
        isolated_sidecar(
            dim=args.dim, name="bench-recall", runtime_dir=rd, extra_args=extra_args
        ) as sidecar,
        redis_server(redis_bin) as (r, redis_version),
        cpu_split(
            args.affinity,
            {"sidecar": sidecar.process.pid, "redis": int(r.info("server")["process_id"])},
        ) as affinity,
    ):
        t0 = time.perf_counter()
        load_kalos(sidecar, corpus, args)
        t_kalos = time.perf_counter() - t0
        t0 = time.perf_counter()
        base = RedisFaissRecall(r, args.dim, base_device)
        base_omp_threads = base.omp_threads()
        base.add_memories(corpus.ids, corpus.vectors, corpus.texts, corpus.tokens)
        for name, turns in corpus.sessions.items():
            base.sessions.load(name, turns)
        t_base = time.perf_counter() - t0
        print(f"loaded kalos in {t_kalos:.1f} s, redis+faiss in {t_base:.1f} s")
        spin = {} if args.spin_us is None else {"spin_us": args.spin_us}
        client = sidecar.connect(gpu_results=cuda, timeout=30, **spin)
        # The sidecar's split of compute per (system, threads), logged by the checks.
        parts: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
        running = [0]  # the concurrency level running now

        def kalos_host(i: int) -> Any:
            return client.recall(names[i], queries[i], k=k, max_tokens=budget)

        def kalos_gpu(i: int) -> Any:
            return client.recall(names[i], queries[i], k=k, max_tokens=budget, device="cuda")

        def kalos_check(row: str) -> Any:
            def check(i: int, got: Any) -> bool:
                # list.append is atomic under the GIL; setdefault of a present key too
                parts.setdefault((row, running[0]), []).append(tuple(got.parts))
                tokens = got.token_ids
                if hasattr(tokens, "cpu"):
                    tokens = tokens.cpu().numpy()
                ids, want_tokens, texts = want[i]
                return bool(
                    not got.degraded
                    and np.array_equal(got.ids, ids)
                    and tokens.dtype == np.int32
                    and np.array_equal(tokens, want_tokens)
                    and list(got.texts) == texts
                )

            return check

        def base_call(i: int) -> Any:
            return base.recall(names[i], queries[i], k, budget)

        def base_check(i: int, got: Any) -> bool:
            tensor, ids, texts = got
            want_ids, want_tokens, want_texts = want[i]
            return bool(
                str(tensor.device).startswith(base_device)
                and np.array_equal(tensor.cpu().numpy(), want_tokens)
                and np.array_equal(ids, want_ids)
                and texts == want_texts
            )

        systems = [System("kalos-shm", kalos_host, kalos_check("kalos-shm"), client)]
        if cuda:
            systems.append(System("kalos-shm-gpu", kalos_gpu, kalos_check("kalos-shm-gpu"), client))
        systems.append(System("redis+faiss", base_call, base_check))

        mismatches = 0
        for system in systems:  # warm up every path, and check it
            for j in range(args.warmup):
                i = int(order[j % len(order)])
                mismatches += int(not system.check(i, system.call(i)))
        parts.clear()
        load_before = load_average()
        results = run_levels(
            "recall", systems, order, levels, block=args.block, warmup=10, quiet=args.quiet,
            on_level=lambda threads: running.__setitem__(0, threads),
        )  # fmt: skip
        load_after = load_average()
        client.close()

    rows, bad = level_rows(results, systems, "redis+faiss")
    mismatches += bad
    for row in rows:  # the sidecar's split of compute
        log = parts.get((row["system"], row["concurrency"]))
        if log:
            p = np.asarray(log)
            row["sidecar_parts_p50_us"] = {
                part: round(float(np.median(p[:, j])), 3)
                for j, part in enumerate(("context", "search", "assemble"))
            }
    columns = ("system", "concurrency", "p50_us", "p99_us", "p999_us", "qps",
               "baseline_over_this_p50", "baseline_over_this_p99")  # fmt: skip
    print_table(rows, columns)
    fastest = "kalos-shm-gpu" if cuda else "kalos-shm"
    targets = {
        f"{fastest}_5x_faster_than_redis_faiss_p99_at_{row['concurrency']}": (
            row["baseline_over_this_p99"] >= 5.0
        )
        for row in rows
        if row["system"] == fastest
    }
    print(f"targets: {targets}")
    for row in rows:
        if "stages" in row:
            print(f"{row['system']} at {row['concurrency']}: stages mean µs "
                  f"{row['stages'].get('mean_us')}; sidecar p50 µs "
                  f"{row.get('sidecar_parts_p50_us')}")  # fmt: skip
    print(f"correctness: {mismatches} mismatches (every recall of the run and its warm-up)")
    print(f"load average before/after: {load_before} / {load_after}")
    params = {
        "memories": args.memories,
        "dim": args.dim,
        "sessions": args.sessions,
        "turns": args.turns,
        "tokens_per_turn": [int(args.tokens * 0.8), int(args.tokens * 1.2)],
        "memory_tokens": [30, 60],
        "budget_tokens": budget,
        "k": k,
        "mean_recall_tokens": round(float(np.mean([len(w[1]) for w in want])), 1),
        "requests": args.requests,
        "block": args.block,
        "concurrency": levels,
        "device": args.device,
        "client_spin_us": args.spin_us,
        "affinity": affinity,
        "baseline_device": base_device,
        "margin": args.margin,
        "seed": args.seed,
        "redis": f"redis-server {redis_version}, Unix socket, redis-py; JSON turns per session "
        "(LRANGE) and a JSON text + token ids per memory (MGET), one pipelined round trip",
        "faiss": "IndexIDMap(IndexFlatIP), float32, in process; one query a search runs on "
        f"one thread (of {base_omp_threads} OpenMP threads)",
    }
    extra: dict[str, Any] = {}
    if torch.cuda.is_available():
        extra["gpu"] = torch.cuda.get_device_name()
        extra["cuda"] = torch.version.cuda
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
        **extra,
    )
    print(f"wrote {path}")
    plot_levels(
        path,
        results,
        rows,
        f"recall: {args.memories:,} x {args.dim} memories, {args.sessions:,} sessions, "
        f"top-{k}, {budget} tokens ({args.device} sidecar)",
    )
    return 1 if mismatches else 0


def load_kalos(sidecar: Any, corpus: Corpus, args: argparse.Namespace) -> None:
    """Bulk adds (64 MiB requests) and the sessions' turns, from 4 threads at once."""
    loader = sidecar.connect(arena_bytes=64 << 20, timeout=300)
    step = 20_000
    for lo in range(0, len(corpus.ids), step):
        hi = lo + step
        loader.add(corpus.vectors[lo:hi], corpus.ids[lo:hi], corpus.texts[lo:hi],
                   tokens=corpus.tokens[lo:hi])  # fmt: skip
    names = corpus.names

    def append(part: int) -> None:
        for name in names[part::4]:
            for role, text, tokens in corpus.sessions[name]:
                loader.append_turn(name, role, text, tokens)

    threads = [threading.Thread(target=append, args=(p,)) for p in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    loader.close()
