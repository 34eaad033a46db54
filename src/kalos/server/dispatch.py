"""The dispatcher: one request body in, one response body out, whatever the transport.

Every transport (shm channels, uds connections, the in-process transport) ends here, so a
request means the same thing on all of them. A bad request becomes an error status and a short
message; an unexpected failure becomes SERVER_ERROR with the exception's type and message,
never a traceback on the wire, and the sidecar keeps serving.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kalos import __version__, filters
from kalos.errors import (
    Conflict,
    InvalidRequest,
    KalosError,
    NotFound,
    PayloadTooLarge,
    RequestTimeout,
)
from kalos.protocol import codes
from kalos.protocol import messages as M
from kalos.protocol.codes import Op, Status
from kalos.stores.memories import MemoryStore
from kalos.stores.recall import RecallPlan, recall, recall_finish, recall_start
from kalos.stores.sessions import SessionStore
from kalos.stores.state import StateStore

log = logging.getLogger("kalos.server")

_monotonic_ns = time.monotonic_ns
_time_ns = time.time_ns

_ERROR_STATUS: tuple[tuple[type[KalosError], Status], ...] = (
    (PayloadTooLarge, Status.PAYLOAD_TOO_LARGE),
    (InvalidRequest, Status.INVALID_REQUEST),
    (NotFound, Status.NOT_FOUND),
    (Conflict, Status.CONFLICT),
    (RequestTimeout, Status.TIMEOUT),
)


# Ops that change a store. With durability on, each successful one is logged before its
# response is published and replayed at recovery (kalos.server.durability): such an op must
# be deterministic given its request body and the request time (``Dispatcher.now_ns``).
WRITE_OPS: frozenset[int] = frozenset(
    {
        Op.ADD,
        Op.REMOVE,
        Op.APPEND_TURN,
        Op.TRIM,
        Op.DELETE_SESSION,
        Op.STATE_PUT,
        Op.STATE_DELETE,
        Op.STATE_CAS,
        Op.LOG_EVENT,
        Op.FORGET,
    }
)

# Ops that may put work on a cuda sidecar's GPU stream (server.doorbell: settle first).
GPU_OPS = frozenset(int(o) for o in (Op.STATS, Op.ADD, Op.REMOVE, Op.SEARCH, Op.FORGET, Op.RECALL))
_OK = int(Status.OK)  # an IntEnum member costs ~0.08 µs per attribute lookup
_PIN_SYSTEM = int(codes.AppendFlag.PIN_SYSTEM)
_SET_ROLLING = int(codes.AppendFlag.SET_ROLLING)
_ROLLING = int(codes.AppendFlag.ROLLING)
_TURNS = int(codes.ContextFlag.TURNS)
_RECALL_GPU = int(codes.RecallFlag.GPU_RESULT)
_RECALL_FILTER = int(codes.RecallFlag.FILTER)
_SEARCH = int(Op.SEARCH)
_RECALL = int(Op.RECALL)
_SEARCH_ON_GPU = int(codes.SEARCH_GPU_RESULT | codes.SEARCH_GPU_QUERY)
_RECALL_SYSTEM = int(codes.RecallResponseFlag.SYSTEM)
_RECALL_ON_GPU = int(codes.RecallResponseFlag.TOKENS_ON_GPU)
# A SEARCH with a metadata filter, or returning metadata, takes _search_filtered (1.5).
_SEARCH_FILTERED = codes.SEARCH_FILTER | codes.SEARCH_WANT_META
# The CONTEXT path's codecs, bound once (a module attribute lookup costs ~0.02 µs).
_decode_context = M.decode_context
_encode_context_tokens_response = M.encode_context_tokens_response


def batchable(op: int, flags: int) -> bool:
    """Whether a request may join a batch (Dispatcher.handle_batch): a search or a recall
    whose results come back in the response (not into a GPU buffer), without a metadata
    filter (a filtered search runs alone: its rows are its own). Searches with their own
    nprobe join too: the batch runs as one pass per probe count."""
    if op == _SEARCH:
        return not flags & (_SEARCH_ON_GPU | _SEARCH_FILTERED)
    if op == _RECALL:
        return not flags & (_RECALL_GPU | _RECALL_FILTER)
    return False


def status_for(exc: KalosError) -> Status:
    for cls, status in _ERROR_STATUS:
        if isinstance(exc, cls):
            return status
    return Status.SERVER_ERROR


class Dispatcher:
    """Decodes a request, runs it against the stores, encodes the response."""

    def __init__(
        self,
        memories: MemoryStore,
        *,
        name: str = "inproc",
        device: str = "cpu",
        extra_stats: Callable[[], dict[str, Any]] | None = None,
        sessions: SessionStore | None = None,
        state: StateStore | None = None,
    ) -> None:
        self.memories = memories
        self.sessions = sessions if sessions is not None else SessionStore()
        self.state = state if state is not None else StateStore()
        self.name = name
        self.device = device
        self.metric = memories.index.metric
        self.started = time.time()
        self.requests = [0] * (max(Op) + 1)  # by op code
        self.gpu_buffer: Any = None  # the requesting channel's GPU result buffer (see handle)
        self.pinned: Any = None  # the requesting channel's registered response arena (see handle)
        self.reader: Any = None  # the requesting channel, when it maps the token heap (handle)
        self.now_ns = 0  # wall-clock time of the request being handled (see handle)
        self.errors = 0
        self.batch_search_ns = 0  # handle_batch's passes over the index, in all
        self.batch_settle_ns = 0  # of their starts, in settling the GPU's armed graphs
        self._extra_stats = extra_stats
        self._ops: dict[int, Callable[[int, np.ndarray, np.ndarray], tuple[int, int]]] = {
            Op.PING: self._ping,
            Op.STATS: self._stats,
            Op.ADD: self._add,
            Op.REMOVE: self._remove,
            Op.SEARCH: self._search,
            Op.APPEND_TURN: self._append_turn,
            Op.CONTEXT: self._context,
            Op.SESSIONS: self._sessions,
            Op.TRIM: self._trim,
            Op.DELETE_SESSION: self._delete_session,
            Op.STATE_PUT: self._state_put,
            Op.STATE_GET: self._state_get,
            Op.STATE_DELETE: self._state_delete,
            Op.STATE_CAS: self._state_cas,
            Op.LOG_EVENT: self._log_event,
            Op.EVENTS: self._events,
            Op.FORGET: self._forget,
            Op.RECALL: self._recall,
            Op.LOOKUP: self._lookup,
        }

    def info(self) -> dict[str, Any]:
        """What the handshake tells a client about this sidecar."""
        return {
            "name": self.name,
            "dim": self.memories.dim,
            "metric": self.metric,
            "max_k": codes.MAX_K,
            "index": self.memories.index.spec,
            "device": self.device,
            "version": __version__,
        }

    def handle(
        self,
        op: int,
        flags: int,
        body: np.ndarray,
        out: np.ndarray,
        now_ns: int | None = None,
        gpu_buffer: Any = None,
        pinned: Any = None,
        reader: Any = None,
    ) -> tuple[int, int, int, int]:
        """Runs one request. Returns (status, response length, compute ns, write ns).

        ``now_ns``: the request's wall-clock time (ns since the epoch), default the clock now;
        recovery passes the logged time. Ops read it from :attr:`now_ns`, never the clock.
        ``gpu_buffer``: the requesting channel's GPU result buffer, if it has one.
        ``pinned``: its response arena registered for the GPU (a cuda sidecar's shm channel):
        a search's kernel then writes the results into ``out`` itself.
        ``reader``: the requesting shm channel when its client maps the token heap
        (kalos.stores.token_heap): a CONTEXT may then answer with the ids by reference.
        """
        t0 = _monotonic_ns()
        gpu = self.memories.gpu
        if gpu is not None and op in GPU_OPS:  # no graph may stay armed ahead of this work
            gpu.settle()
        self.now_ns = _time_ns() if now_ns is None else now_ns
        self.gpu_buffer = gpu_buffer
        self.pinned = pinned
        self.reader = reader
        fn = self._ops.get(op)
        try:
            if fn is None:
                self.errors += 1
                n = M.encode_text(out, f"unknown op {op}")
                return Status.UNKNOWN_OP, n, _monotonic_ns() - t0, 0
            self.requests[op] += 1
            n, write_at = fn(flags, body, out)
            end = _monotonic_ns()
            if write_at:
                return _OK, n, write_at - t0, end - write_at
            return _OK, n, end - t0, 0
        except KalosError as exc:
            self.errors += 1
            n = M.encode_text(out, str(exc))
            return status_for(exc), n, _monotonic_ns() - t0, 0
        except Exception as exc:  # a bug: report it, keep serving
            self.errors += 1
            log.exception("op %s failed", op)
            n = M.encode_text(out, f"internal error: {type(exc).__name__}: {exc}")
            return Status.SERVER_ERROR, n, _monotonic_ns() - t0, 0

    def handle_batch(
        self, members: Sequence[tuple[int, int, np.ndarray, np.ndarray]]
    ) -> list[tuple[int, int, int, int]]:
        """Runs several searches or recalls (each ``(op, flags, body, out)``, every one
        :func:`batchable`) with one pass over the index (MemoryStore.search_many): the
        sidecar's dynamic batching. Returns each one's (status, response length, compute ns,
        write ns), as :meth:`handle` would have for it alone: a member that fails (a bad
        body, a wrong dimension, a session not found, a response too large) gets its own
        error status and message, and every other member its exact answer. Compute time is
        the batch's up to the member's response."""
        run = self.begin_batch(members)
        run.start()
        return run.finish()

    def begin_batch(self, members: Sequence[tuple[int, int, np.ndarray, np.ndarray]]) -> BatchRun:
        """:meth:`handle_batch` in its three steps (:class:`BatchRun`): the members decoded
        here; the pass over the index started, then the answers written, by the caller, which
        holds the dispatch lock from this call to the answers."""
        return BatchRun(self, members)

    def _batch_job(
        self, op: int, flags: int, body: np.ndarray, out: np.ndarray
    ) -> tuple[Callable[[Any, int], tuple[int, int]], np.ndarray, int, Any, int]:
        """A batch member decoded: (what writes its response from its hits, queries, k,
        scope, nprobe)."""
        if op == Op.RECALL:
            req_r = M.decode_recall(body, len(body))
            start = recall_start(self.sessions, req_r, now=self.now_ns * 1e-9)

            def finish_recall(hit: Any, search_ns: int) -> tuple[int, int]:
                plan = recall_finish(
                    self.memories, start, hit[0][0].copy(), hit[1][0].copy(), search_ns
                )
                return self._recall_response(out, plan, None)

            return finish_recall, start.query, start.k, start.scope, 0
        req = M.decode_search(body, len(body), flags=flags & codes.SEARCH_NPROBE)
        if flags & codes.SEARCH_WANT_PAYLOADS:

            def finish_payloads(hit: Any, search_ns: int) -> tuple[int, int]:
                t = _monotonic_ns()
                payloads = self.memories.payloads(hit[1])
                return M.encode_search_response(out, hit[0], hit[1], payloads), t

            return finish_payloads, req.queries, req.k, req.scope, req.nprobe
        codes.check_k(req.k)  # a bad k is INVALID_REQUEST, before its response's size is judged
        n, scores, ids = M.search_response_views(out, len(req.queries), req.k)

        def finish_search(hit: Any, search_ns: int) -> tuple[int, int]:
            scores[...] = hit[0]
            ids[...] = hit[1]
            return n, 0

        return finish_search, req.queries, req.k, req.scope, req.nprobe

    def _failure(
        self, op: int, exc: Exception, out: np.ndarray, t0: int
    ) -> tuple[int, int, int, int]:
        """A failed batch member's (status, length, compute ns, write ns), as handle has it."""
        self.errors += 1
        if isinstance(exc, KalosError):
            return status_for(exc), M.encode_text(out, str(exc)), _monotonic_ns() - t0, 0
        log.error("op %s failed in a batch", op, exc_info=exc)
        n = M.encode_text(out, f"internal error: {type(exc).__name__}: {exc}")
        return Status.SERVER_ERROR, n, _monotonic_ns() - t0, 0

    # Each op returns (response length, the monotonic ns at which it began to encode the
    # response, or 0 when it does not time that): handle reads the clock once at the end.

    def _ping(self, flags: int, body: np.ndarray, out: np.ndarray) -> tuple[int, int]:
        return 0, 0

    def _stats(self, flags: int, body: np.ndarray, out: np.ndarray) -> tuple[int, int]:
        stats: dict[str, Any] = dict(self.info())
        stats.update(self.memories.stats())
        stats.update(self.sessions.stats())
        stats.update(self.state.stats())
        stats.update(
            pid=os.getpid(),
            uptime_s=round(time.time() - self.started, 3),
            requests={op.name.lower(): self.requests[op] for op in Op},
            errors=self.errors,
        )
        if self._extra_stats is not None:
            stats.update(self._extra_stats())
        t = _monotonic_ns()
        n = M.encode_text(out, json.dumps(stats))
        return n, t

    def _add(self, flags: int, body: np.ndarray, out: np.ndarray) -> tuple[int, int]:
        req = M.decode_add(body, len(body), flags)
        added, replaced = self.memories.add(
            req.ids, req.vectors, req.kinds, req.offsets, req.blob, req.scope, req.tokens,
            req.meta, req.keys,
        )  # fmt: skip
        return M.encode_counts(out, added, replaced), 0

    def _remove(self, flags: int, body: np.ndarray, out: np.ndarray) -> tuple[int, int]:
        ids = M.decode_remove(body, len(body))
        removed = self.memories.remove(ids)
        return M.encode_counts(out, removed), 0

    def _search(self, flags: int, body: np.ndarray, out: np.ndarray) -> tuple[int, int]:
        if flags & (codes.SEARCH_GPU_RESULT | codes.SEARCH_GPU_QUERY):
            return self._search_to_device(flags, body, out)
        req = M.decode_search(body, len(body), flags=flags)
        if flags & _SEARCH_FILTERED:
            return self._search_filtered(flags, req, out)
        if not flags & codes.SEARCH_WANT_PAYLOADS:  # the results go straight into the response
            codes.check_k(req.k)  # a bad k is INVALID_REQUEST, before its response's size is judged
            n, scores, ids = M.search_response_views(out, len(req.queries), req.k)
            self.memories.search(
                req.queries, req.k, req.scope, out=(scores, ids), pinned=self.pinned,
                nprobe=req.nprobe,
            )  # fmt: skip
            return n, 0
        scores, ids = self.memories.search(req.queries, req.k, req.scope, nprobe=req.nprobe)
        t = _monotonic_ns()
        n = M.encode_search_response(out, scores, ids, self.memories.payloads(ids))
        return n, t

    def _search_filtered(
        self, flags: int, req: M.SearchRequest, out: np.ndarray
    ) -> tuple[int, int]:
        """A search with a metadata filter, or one that returns metadata (1.5)."""
        where = None if req.where is None else filters.parse(req.where)
        scores, ids = self.memories.search(
            req.queries, req.k, req.scope, where=where, nprobe=req.nprobe
        )
        t = _monotonic_ns()
        payloads = self.memories.payloads(ids) if flags & codes.SEARCH_WANT_PAYLOADS else None
        entries = self.memories.entries(ids) if flags & codes.SEARCH_WANT_META else None
        return M.encode_search_response(out, scores, ids, payloads, entries), t

    def _lookup(self, flags: int, body: np.ndarray, out: np.ndarray) -> tuple[int, int]:
        """Memories by id: a one-row SEARCH response of the ids found (scores 0)."""
        ids = self.memories.present(*M.decode_lookup(body, len(body)))[None, :]
        t = _monotonic_ns()
        scores = np.zeros(ids.shape, np.float32)
        n = M.encode_search_response(
            out, scores, ids, self.memories.payloads(ids), self.memories.entries(ids)
        )
        return n, t

    def _search_to_device(self, flags: int, body: np.ndarray, out: np.ndarray) -> tuple[int, int]:
        """GPU-result mode: the results go to the channel's GPU buffer; the response body is
        the SEARCH response header alone (nq, k, no payloads)."""
        if flags & _SEARCH_FILTERED:
            raise InvalidRequest("a GPU-result search takes no metadata filter")
        if self.gpu_buffer is None:
            raise InvalidRequest(
                "this channel has no GPU result buffer: connect with gpu_results=True to a "
                "sidecar whose index is on a GPU"
            )
        gpu_query = bool(flags & codes.SEARCH_GPU_QUERY)
        # an exact GPU index: a probe count (flag SEARCH_NPROBE) is read and does not apply
        req = M.decode_search(
            body, len(body), with_queries=not gpu_query, flags=flags & codes.SEARCH_NPROBE
        )
        nq = len(req.queries)
        self.memories.search_to_device(
            self.gpu_buffer, None if gpu_query else req.queries, nq, req.k, req.scope
        )
        return M.encode_search_device_response(out, nq, req.k), 0

    # -- sessions, state, event logs, forget -------------------------------------------------
    # Time-dependent ops read the request's time from self.now_ns (seconds: now_ns * 1e-9).

    def _append_turn(self, flags: int, body: np.ndarray, out: np.ndarray) -> tuple[int, int]:
        req = M.decode_append_turn(body, len(body), flags)
        turns, tokens = self.sessions.append_turn(
            M.session_of(req.scope),
            req.role,
            req.text,
            req.tokens,
            now=self.now_ns * 1e-9,
            owner=req.scope,
            pin=bool(flags & _PIN_SYSTEM),
            ttl_s=req.ttl_s,
            rolling=bool(flags & _ROLLING) if flags & _SET_ROLLING else None,
        )
        return M.encode_counts(out, turns, tokens), 0

    def _context(self, flags: int, body: np.ndarray, out: np.ndarray) -> tuple[int, int]:
        session, max_tokens, max_turns, scope = _decode_context(body, len(body))
        reader = self.reader
        if reader is not None:  # a shm channel that maps the token heap
            tokens, n_turns, meta, text, system, heap_at = self.sessions.context_lent(
                session,
                max_tokens,
                max_turns,
                reader,
                turns=bool(flags & _TURNS),
                now=self.now_ns * 1e-9,
                scope=scope,
            )
            t = _monotonic_ns()
            if meta is None or text is None:
                n = _encode_context_tokens_response(out, tokens, n_turns, system, heap_at)
            else:
                n = M.encode_context_response(out, tokens, meta, text, system, heap_at=heap_at)
            return n, t
        if flags & _TURNS:
            tokens, meta, text, system = self.sessions.context(
                session, max_tokens, max_turns, now=self.now_ns * 1e-9, scope=scope
            )
            t = _monotonic_ns()
            n = M.encode_context_response(out, tokens, meta, text, system)
            return n, t
        # Only the token ids travel: the store does not slice the turns' meta and text.
        tokens, n_turns, system = self.sessions.context_tokens(
            session, max_tokens, max_turns, now=self.now_ns * 1e-9, scope=scope
        )
        t = _monotonic_ns()
        n = M.encode_context_tokens_response(out, tokens, n_turns, system)
        return n, t

    def _recall(self, flags: int, body: np.ndarray, out: np.ndarray) -> tuple[int, int]:
        """The session's context and the top-k memories as one token sequence
        (kalos.stores.recall); with RecallFlag.GPU_RESULT the token ids go into the channel's
        GPU result buffer and the response carries the rest."""
        req = M.decode_recall(body, len(body), flags)
        to_gpu = bool(flags & _RECALL_GPU)
        buffer = self.gpu_buffer
        if to_gpu:
            if buffer is None:
                raise InvalidRequest(
                    "this channel has no GPU result buffer: connect with gpu_results=True to a "
                    "sidecar whose index is on a GPU"
                )
            if req.max_tokens > buffer.max_tokens:
                raise InvalidRequest(
                    f"a GPU-result recall takes max_tokens <= {buffer.max_tokens} (the GPU "
                    f"buffer's token slots), got {req.max_tokens}"
                )
        plan = recall(self.memories, self.sessions, req, now=self.now_ns * 1e-9)
        return self._recall_response(out, plan, buffer if to_gpu else None)

    def _recall_response(self, out: np.ndarray, plan: RecallPlan, buffer: Any) -> tuple[int, int]:
        """Encodes a recall's response; ``buffer``: the channel's GPU buffer for the token
        ids (RecallFlag.GPU_RESULT), else None."""
        t = _monotonic_ns()
        to_gpu = buffer is not None
        if to_gpu:
            buffer.write_tokens(plan.pieces, plan.n_tokens)
        n = M.encode_recall_response(
            out,
            plan.scores,
            plan.ids,
            plan.memory_tokens,
            plan.payloads,
            None if to_gpu else plan.pieces,
            n_tokens=plan.n_tokens,
            system_tokens=plan.system_tokens,
            n_turns=plan.n_turns,
            turn_tokens=plan.turn_tokens,
            flags=(_RECALL_SYSTEM if plan.system else 0) | (_RECALL_ON_GPU if to_gpu else 0),
        )
        write_ns = _monotonic_ns() - t
        M.set_recall_parts(out, plan.context_ns, plan.search_ns, plan.assemble_ns + write_ns)
        return n, t

    def _sessions(self, flags: int, body: np.ndarray, out: np.ndarray) -> tuple[int, int]:
        scope, limit, after = M.decode_sessions(body, len(body))
        infos = self.sessions.sessions(
            scope,
            now=self.now_ns * 1e-9,
            after=after,
            limit=None if limit is None else limit + 1,
        )
        more = limit is not None and len(infos) > limit
        if limit is not None:
            infos = infos[:limit]
        t = _monotonic_ns()
        while True:  # as many as fit the arena; the client asks again after the last one
            text = json.dumps({"sessions": [i._asdict() for i in infos], "more": more})
            if len(text.encode()) <= len(out) or not infos:
                break
            infos, more = infos[: len(infos) // 2], True
        n = M.encode_text(out, text)
        return n, t

    def _trim(self, flags: int, body: np.ndarray, out: np.ndarray) -> tuple[int, int]:
        keep, _, scope, _ = M.decode_scoped(body, len(body))
        dropped, left = self.sessions.trim(
            M.session_of(scope), keep, now=self.now_ns * 1e-9, scope=M.owner_of(scope)
        )
        return M.encode_counts(out, dropped, left), 0

    def _delete_session(self, flags: int, body: np.ndarray, out: np.ndarray) -> tuple[int, int]:
        _, _, scope, _ = M.decode_scoped(body, len(body))
        self.sessions.delete(M.session_of(scope), now=self.now_ns * 1e-9, scope=M.owner_of(scope))
        return M.encode_counts(out, 1), 0

    def _state_put(self, flags: int, body: np.ndarray, out: np.ndarray) -> tuple[int, int]:
        req = M.decode_state_value(body, len(body))
        return M.encode_counts(out, self.state.put(req.scope, req.key, req.value)), 0

    def _state_cas(self, flags: int, body: np.ndarray, out: np.ndarray) -> tuple[int, int]:
        req = M.decode_state_value(body, len(body))
        version = self.state.cas(req.scope, req.key, req.expected_version, req.value)
        return M.encode_counts(out, version), 0

    def _state_get(self, flags: int, body: np.ndarray, out: np.ndarray) -> tuple[int, int]:
        scope, key = M.decode_state_key(body, len(body))
        got = self.state.get(scope, key)
        return M.encode_state_get_response(out, got.version, got.value), 0

    def _state_delete(self, flags: int, body: np.ndarray, out: np.ndarray) -> tuple[int, int]:
        scope, key = M.decode_state_key(body, len(body))
        return M.encode_counts(out, int(self.state.delete(scope, key))), 0

    def _log_event(self, flags: int, body: np.ndarray, out: np.ndarray) -> tuple[int, int]:
        req = M.decode_log_event(body, len(body))
        session = M.session_of(req.scope)
        now = self.now_ns * 1e-9
        # A log without an owner of its own takes the owner of the session of the same id.
        owner = M.owner_of(req.scope) or self.sessions.owner(session, now)
        seq = self.state.log(session, req.kind, req.data, now=now, owner=owner)
        return M.encode_counts(out, seq), 0

    def _events(self, flags: int, body: np.ndarray, out: np.ndarray) -> tuple[int, int]:
        scope, since, limit = M.decode_events_request(body, len(body))
        session = M.session_of(scope)
        cap = max(len(out) // 64, 1)  # an event takes >= 40 bytes: fetch no more than fit
        events = self.state.events(
            session, since, cap if limit is None else min(limit, cap), scope=M.owner_of(scope)
        )
        more = bool(events) and events[-1].seq < self.state.log_length(session)
        t = _monotonic_ns()
        n = M.encode_events_response(out, events, more)
        return n, t

    def _forget(self, flags: int, body: np.ndarray, out: np.ndarray) -> tuple[int, int]:
        _, _, scope, off = M.decode_scoped(body, len(body))
        if flags & codes.FORGET_FILTER:  # memories only: sessions and state have no metadata
            where = filters.parse(M.decode_filter_at(body, off, len(body)))
            return M.encode_forgotten(out, (self.memories.forget(scope, where), 0, 0, 0)), 0
        if not any(scope):
            raise InvalidRequest("forget needs a scope: a tenant, a user or a session")
        memories = self.memories.forget(scope)
        sessions = self.sessions.forget(scope)
        values, logs = self.state.forget(scope)
        return M.encode_forgotten(out, (memories, sessions, values, logs)), 0


class BatchRun:
    """One batch of searches and recalls between its decode and its answers
    (:meth:`Dispatcher.begin_batch`): members are decoded, and their searches checked, as
    they come (:meth:`add`; kalos.stores.batch);
    :meth:`start` starts the pass over the index and says whether it is still running (a GPU
    index's batched call, left running so that the sidecar can decode the next batch
    meanwhile; :meth:`done` asks whether it has finished); :meth:`collect` waits for it and
    keeps its answers (the GPU is then free for the next pass); :meth:`finish` splits them
    and writes each member's response, returning what :meth:`Dispatcher.handle_batch`
    does."""

    def __init__(
        self, dispatcher: Dispatcher, members: Sequence[tuple[int, int, np.ndarray, np.ndarray]]
    ) -> None:
        d = self._dispatcher = dispatcher
        self._t0 = _monotonic_ns()
        d.now_ns = _time_ns()
        d.gpu_buffer = d.pinned = d.reader = None
        self._members: list[tuple[int, int, np.ndarray, np.ndarray]] = []
        self._results: list[tuple[int, int, int, int] | None] = []
        # (member, its finish: hits and search ns -> (response length, write at)), each one
        # decoded; their searches, checked as they come (stores.batch)
        self._jobs: list[tuple[int, Callable[[Any, int], tuple[int, int]]]] = []
        self._batch = d.memories.batch()
        self._done: Callable[[], bool] | None = None
        self._started = False
        self._landed = False
        self._t1 = 0
        self._search_ns = 0
        self.add(members)

    def add(self, members: Sequence[tuple[int, int, np.ndarray, np.ndarray]]) -> None:
        """Decodes more members into the batch, before :meth:`start`."""
        d, t0 = self._dispatcher, self._t0
        for op, flags, body, out in members:
            i = len(self._members)
            self._members.append((op, flags, body, out))
            self._results.append(None)
            d.requests[op] += 1
            try:
                finish, queries, k, scope, nprobe = d._batch_job(op, flags, body, out)
                self._batch.add(queries, k, scope, nprobe)
            except Exception as exc:
                self._results[i] = d._failure(op, exc, out, t0)
                continue
            self._jobs.append((i, finish))

    def start(self) -> bool:
        """Starts the pass over the index; returns whether it is still running."""
        d = self._dispatcher
        gpu = d.memories.gpu
        if gpu is not None:  # no graph may stay armed ahead of this work
            t = _monotonic_ns()
            gpu.settle()
            d.batch_settle_ns += _monotonic_ns() - t
        self._t1 = _monotonic_ns()
        self._started = True
        self._done = self._batch.start()
        return self._done is not None

    def done(self) -> bool:
        """Whether the pass :meth:`start` left running has finished (it does not wait). A
        failing query says True: :meth:`finish` then meets the failure, and answers each
        member alone."""
        try:
            return self._done is None or self._done()
        except Exception:
            return True

    def collect(self) -> None:
        """Waits for the pass and keeps its answers, copied out of the GPU's staging: the
        next batch's pass may start before :meth:`finish` splits them per member and writes
        the responses."""
        assert self._started, "collect before start"
        if not self._landed:
            self._landed = True
            self._batch.land()
            self._search_ns = _monotonic_ns() - self._t1
            self._dispatcher.batch_search_ns += self._search_ns

    def finish(self) -> list[tuple[int, int, int, int]]:
        """Writes each member's response (after :meth:`collect`, which it calls if need be):
        (status, response length, compute ns, write ns) in the members' order."""
        self.collect()
        d, t0, results = self._dispatcher, self._t0, self._results
        hits, search_ns = self._batch.results(), self._search_ns
        members = self._members
        for (i, finish), hit in zip(self._jobs, hits, strict=True):
            out = members[i][3]
            try:
                if isinstance(hit, Exception):
                    raise hit
                n, write_at = finish(hit, search_ns)
                end = _monotonic_ns()
                if write_at:
                    results[i] = (_OK, n, write_at - t0, end - write_at)
                else:
                    results[i] = (_OK, n, end - t0, 0)
            except Exception as exc:
                results[i] = d._failure(members[i][0], exc, out, t0)
        return results  # type: ignore[return-value]
