"""Recall: the whole memory step of one LLM request, across the session and memory stores.

One :func:`recall` reads a session's pinned system prompt and newest turns, searches the
memories with a query vector, and lays out the model-ready token ids, in this order::

    [system prompt, if pinned and it fits] + [memories, best hit first, each whole]
        + [the session's newest turns, oldest first]

Budget (``max_tokens`` token ids in all), decided in this order:

1. The system prompt is included when its token ids fit ``max_tokens`` (as in a context).
2. The memories share what is left, capped by ``memory_tokens`` when given. The hits are
   taken in rank order; a hit whose token ids fit what is left of that share is included
   whole, one that does not is dropped whole (never truncated) and the next, shorter hit may
   still fit. A hit without token ids (a bytes payload, or a text added without token ids
   to a sidecar without ``--tokenizer``) contributes its payload to the texts, no tokens.
3. The turns get what the system prompt and the included memories left: the newest turns
   that fit, a contiguous suffix of at most ``max_turns`` turns (as in a context).

So memories come before turns: pass ``memory_tokens`` to keep room for the conversation.

Scopes: the session must match the filter's tenant and user (else NotFound, as a context);
the memories are searched with the filter, whose tenant defaults to the session's tenant, so
a recall for a tenant's session never sees another tenant's memories.

Everything here is deterministic given the stores, and returns byte views into them (valid
until the stores next change): the encoder copies each piece once into the response, or into
the GPU buffer.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from kalos import filters
from kalos.errors import InvalidRequest
from kalos.protocol.messages import RecallRequest, Scope
from kalos.stores.memories import MemoryStore
from kalos.stores.sessions import SessionStore

_monotonic_ns = time.monotonic_ns


class RecallPlan(NamedTuple):
    """What :func:`recall` chose; ``pieces`` are the token ids (int32 bytes) in order."""

    scores: np.ndarray  # [k] f32
    ids: np.ndarray  # [k] i64, -1 where fewer than k matched
    memory_tokens: list[int]  # [k] token ids of each hit in the assembly (0: none)
    payloads: list[tuple[int, bytes]]  # [k] (kind, bytes)
    pieces: list[bytes | memoryview]
    n_tokens: int
    system: bool
    system_tokens: int
    n_turns: int
    turn_tokens: int
    context_ns: int  # reading the session: system prompt and the turn window
    search_ns: int  # the vector search
    assemble_ns: int  # choosing the memories and gathering their token ids


def pick_memories(lengths: Sequence[int], budget: int) -> list[int]:
    """Token ids each hit contributes, in hit order: whole or nothing, best first, within
    ``budget`` (a hit that does not fit is dropped; a later, shorter one may still fit)."""
    out = []
    for n in lengths:
        if n <= budget:
            budget -= n
            out.append(n)
        else:
            out.append(0)
    return out


def memory_scope(scope: Scope, session_tenant: str | None) -> Scope:
    """The memory filter of a recall: ``scope``, its tenant defaulting to the session's."""
    if scope.tenant is None and session_tenant is not None:
        return Scope(session_tenant, scope.user, scope.session)
    return scope


class RecallStart(NamedTuple):
    """A recall up to its search (:func:`recall_start`): the session read, the budget left,
    and the search to run (``query``, ``k``, ``scope``), which a batch may share with
    others before :func:`recall_finish`."""

    session: Any  # the live session (SessionStore.live)
    system: Any  # its pinned system prompt when it fits the budget, else None
    budget: int  # token ids left after the system prompt
    query: np.ndarray  # [1, dim]
    k: int
    scope: Scope  # the memory filter (memory_scope)
    where: Any  # the metadata filter (kalos.filters, parsed), or None
    memory_tokens: int | None
    max_turns: int | None
    started_ns: int  # monotonic: the recall began
    context_ns: int  # reading the session so far


def recall_start(sessions: SessionStore, req: RecallRequest, *, now: float) -> RecallStart:
    """The first half of :func:`recall`: checks the request and reads the session."""
    t0 = _monotonic_ns()
    if req.max_tokens < 0:
        raise InvalidRequest(f"max_tokens must be >= 0, got {req.max_tokens}")
    scope = req.scope
    s = sessions.live(req.session, now=now, scope=Scope(scope.tenant, scope.user))
    budget = req.max_tokens
    system = s.system
    if system is not None and system.n_tokens > budget:
        system = None
    if system is not None:
        budget -= system.n_tokens
    where = None if req.where is None else filters.parse(req.where)
    return RecallStart(
        s, system, budget, req.query, req.k, memory_scope(scope, s.tenant), where,
        req.memory_tokens, req.max_turns, t0, _monotonic_ns() - t0,
    )  # fmt: skip


def recall_finish(
    memories: MemoryStore, start: RecallStart, scores: np.ndarray, ids: np.ndarray,
    search_ns: int,
) -> RecallPlan:  # fmt: skip
    """The second half of :func:`recall`, given its search's hits (scores [k], ids [k],
    owned) and how long the search took."""
    t2 = _monotonic_ns()
    s, system, budget = start.session, start.system, start.budget
    token_bytes = memories.token_ids(ids)
    share = budget if start.memory_tokens is None else min(budget, start.memory_tokens)
    counts = pick_memories([len(b) >> 2 for b in token_bytes], share)
    pieces: list[bytes | memoryview] = [] if system is None else [system.tokens]
    pieces += [b for b, n in zip(token_bytes, counts, strict=True) if n]
    used = sum(counts)
    payloads = memories.payloads(ids)
    t3 = _monotonic_ns()
    first = s.newest(budget - used, start.max_turns)
    cum = s.tok_cum
    n = len(cum) - 1
    pieces.append(s.tokens_mv[4 * cum[first] : 4 * cum[n]])
    turn_tokens = cum[n] - cum[first]
    t4 = _monotonic_ns()
    system_tokens = 0 if system is None else system.n_tokens
    return RecallPlan(
        scores,
        ids,
        counts,
        payloads,
        pieces,
        system_tokens + used + turn_tokens,
        system is not None,
        system_tokens,
        n - first,
        turn_tokens,
        start.context_ns + (t4 - t3),
        search_ns,
        t3 - t2,
    )


def recall(
    memories: MemoryStore, sessions: SessionStore, req: RecallRequest, *, now: float
) -> RecallPlan:
    """Runs one recall (see the module docstring). NotFound for an unknown or expired
    session, or one outside the filter's tenant and user; InvalidRequest for bad input."""
    start = recall_start(sessions, req, now=now)
    t1 = _monotonic_ns()
    scores, ids = memories.search(start.query, start.k, start.scope, where=start.where)
    scores, ids = scores[0].copy(), ids[0].copy()  # GPU staging is reused: own them
    return recall_finish(memories, start, scores, ids, _monotonic_ns() - t1)
