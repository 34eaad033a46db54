"""The traditional stack that kalos is measured against: a Python memory module on Redis.

What a Python LLM service typically runs today, in its own process:

* sessions (:class:`RedisMemory`): a Redis list of JSON turns per session,
  ``{"role", "text", "tokens"}``; a context is LRANGE, ``json.loads`` of every turn, the
  newest turns that fit the budget, their token ids concatenated;
* memories (:class:`RedisFaissRecall`): texts and their token ids as one JSON value per memory
  in Redis (``memory:<id>``), vectors in an in-process FAISS ``IndexIDMap(IndexFlatIP)`` over
  float32; the memory step of one request is the FAISS search, then one pipelined round trip
  for the session (LRANGE) and the top-k memories (MGET), ``json.loads``, the token ids
  assembled by :func:`assemble` (kalos's rule), and ``torch.tensor(ids).to(device)``;
* :class:`DictMemory`: the session module over a dict in this process (no server, no JSON).

:func:`redis_server` starts a private ``redis-server`` on a Unix socket (no TCP port, no
persistence); :func:`find_redis_server` finds it (``--redis-server``, ``$PATH``, or Debian's
package installed with apt-get when root).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from kalos.errors import ConfigError

Turn = tuple[str, str, np.ndarray]  # role, text, int32 token ids
Window = tuple[np.ndarray, list[tuple[str, str]]]
Ids = Sequence[int] | np.ndarray  # token ids


# -- the budget rule, shared with the reference answers ------------------------------------


def newest_that_fit(turns: list[dict[str, Any]], max_tokens: int) -> Window:
    """The newest turns (dicts with "role", "text", "tokens") within ``max_tokens``, oldest
    first: a contiguous suffix (a turn that does not fit ends it)."""
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


def assemble(
    system: Ids | None,
    memories: Sequence[Ids],
    turns: Sequence[Ids],
    max_tokens: int,
    max_turns: int | None = None,
    memory_tokens: int | None = None,
) -> list[int]:
    """A recall's token ids: [system prompt] + [memories, best hit first] + [turns, oldest
    first], within ``max_tokens``: kalos's rule (``Client.recall``, docs/PROTOCOL.md).

    (1) The system prompt when it fits. (2) The memories share what is left, at most
    ``memory_tokens``: in rank order, each whole or not at all (one that does not fit is
    dropped; a later, shorter one may still fit). (3) The newest turns that fit what remains,
    a contiguous suffix of at most ``max_turns``, as in a context.
    """
    budget = max_tokens
    out: list[int] = []
    if system is not None and 0 < len(system) <= budget:
        out.extend(system)
        budget -= len(system)
    share = budget if memory_tokens is None else min(budget, memory_tokens)
    for memory in memories:
        if len(memory) <= share:
            out.extend(memory)
            share -= len(memory)
            budget -= len(memory)
    limit = len(turns) if max_turns is None else max_turns
    first = len(turns)
    while first > 0 and len(turns) - first < limit and len(turns[first - 1]) <= budget:
        first -= 1
        budget -= len(turns[first])
    for turn in turns[first:]:
        out.extend(turn)
    return out


# -- the session modules ---------------------------------------------------------------------


class RedisMemory:
    """Turns as JSON in a Redis list per session: what a Python service typically runs."""

    def __init__(self, client: Any) -> None:  # client: redis.Redis
        self.r = client

    def load(self, session: str, turns: Sequence[Turn]) -> None:
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


class DictMemory:
    """The same module over a dict in this process: turns with int32 token arrays."""

    def __init__(self) -> None:
        self.sessions: dict[str, list[Turn]] = {}

    def load(self, session: str, turns: Sequence[Turn]) -> None:
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


# -- the memory step: Redis + in-process FAISS + torch ---------------------------------------


class RedisFaissRecall:
    """One LLM request's memory step on the traditional stack (see the module docstring).

    ``device``: where the token ids go (``torch.tensor(ids).to(device)``): "cuda" on a GPU
    host, "cpu" otherwise. Thread-safe: redis-py pools its connections, FAISS searches
    concurrently, torch allocates per call.
    """

    def __init__(self, client: Any, dim: int, device: str = "cpu") -> None:
        try:
            import faiss
            import torch
        except ImportError as exc:
            raise ConfigError(
                "the Redis + FAISS baseline needs faiss-cpu and torch: "
                "pip install 'kalos[faiss,gpu,bench]'"
            ) from exc
        self.r = client
        self.dim = dim
        self.device = device
        self._torch = torch
        self.index = faiss.IndexIDMap(faiss.IndexFlatIP(dim))
        self.sessions = RedisMemory(client)

    def omp_threads(self) -> int:
        """FAISS's OpenMP threads. A search of one query uses one of them (faiss runs
        ``min(nq, threads)``), so concurrent requests do not oversubscribe the cores."""
        import faiss

        return int(faiss.omp_get_max_threads())

    def add_memories(
        self,
        ids: np.ndarray,
        vectors: np.ndarray,
        texts: Sequence[str],
        tokens: Sequence[np.ndarray],
        batch: int = 5_000,
    ) -> None:
        """Texts and token ids as JSON values in Redis (pipelined), vectors into FAISS."""
        for lo in range(0, len(ids), batch):
            pipe = self.r.pipeline(transaction=False)
            for i in range(lo, min(lo + batch, len(ids))):
                value = json.dumps({"text": texts[i], "tokens": tokens[i].tolist()})
                pipe.set(f"memory:{int(ids[i])}", value)
            pipe.execute()
        self.index.add_with_ids(
            np.ascontiguousarray(vectors, dtype=np.float32), np.asarray(ids, np.int64)
        )

    def recall(
        self, session: str, query: np.ndarray, k: int, max_tokens: int
    ) -> tuple[Any, list[int], list[str]]:
        """(token ids as a torch int32 tensor on ``device``, memory ids, memory texts)."""
        _, found = self.index.search(query.reshape(1, -1), k)  # query: [dim] float32
        ids = [int(i) for i in found[0] if i >= 0]
        pipe = self.r.pipeline(transaction=False)
        pipe.lrange(f"session:{session}", 0, -1)
        pipe.mget([f"memory:{i}" for i in ids])
        raw_turns, raw_memories = pipe.execute()
        turns = [json.loads(raw)["tokens"] for raw in raw_turns]
        memories = [json.loads(raw) for raw in raw_memories]
        token_ids = assemble(None, [m["tokens"] for m in memories], turns, max_tokens)
        tensor = self._torch.tensor(token_ids, dtype=self._torch.int32).to(self.device)
        return tensor, ids, [m["text"] for m in memories]


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
def redis_server(binary: str, max_clients: int = 10_000) -> Iterator[tuple[Any, str]]:
    """A private redis-server on a Unix socket in a temporary directory; (client, version).
    The client's connection pool serves any number of threads (one connection each)."""
    try:
        import redis
    except ImportError as exc:
        raise ConfigError("the Redis baselines need redis-py: pip install 'kalos[bench]'") from exc
    with tempfile.TemporaryDirectory(prefix="kalos-redis-") as tmp:
        sock = os.path.join(tmp, "redis.sock")
        proc = subprocess.Popen(
            [binary, "--port", "0", "--unixsocket", sock, "--unixsocketperm", "700", "--save", "",
             "--appendonly", "no", "--dir", tmp, "--daemonize", "no", "--loglevel", "warning",
             "--maxclients", str(max_clients)],
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
