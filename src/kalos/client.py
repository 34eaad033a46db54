"""The client: what an inference service calls.

``kalos.connect(name)`` returns a :class:`Client`. Each thread that uses it gets its own
channel (single producer, single consumer: no locks on the hot path), opened on first use.
Search results are numpy views into that channel's response arena, valid until the same
thread's next call on this client; ``copy=True`` returns owned arrays. Every call has a
deadline (``timeout``, seconds) and reports the sidecar's per-stage timings in µs.

A client outlives its sidecar: a call notices a sidecar that died, stopped or hangs within
the call's deadline and raises SidecarGone (or, with ``on_unavailable="degrade"``, a search
or context returns an empty result marked ``degraded``); the next call opens a new channel,
to the sidecar of the same name once one is back (``Client.reconnects`` counts them).
"""

from __future__ import annotations

import json
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from kalos import filters
from kalos.errors import (
    ClosedError,
    ConfigError,
    ConnectError,
    InvalidRequest,
    PayloadTooLarge,
    ProtocolMismatch,
    RequestTimeout,
    SidecarGone,
)
from kalos.filters import check_metadata, key_id
from kalos.options import MAX_TIMEOUT_S, ClientOptions, ClientOptionsArgs, timeout_error
from kalos.protocol import codes
from kalos.protocol import messages as M
from kalos.protocol.codes import Op, error_for_status
from kalos.protocol.messages import Event, Scope, SessionInfo, StateValue
from kalos.transport import NOTHING, Lent, Transport, open_channel

if TYPE_CHECKING:
    from typing import Unpack

_monotonic_ns = time.monotonic_ns

Payload = str | bytes | None

# What ``on_unavailable="degrade"`` turns into an empty result: the sidecar cannot be reached,
# died or hangs, or did not answer in time. Never bad input (InvalidRequest), nor a refusal
# by a live sidecar's stores, nor ProtocolMismatch (a deployment error).
_UNAVAILABLE = (SidecarGone, ConnectError, RequestTimeout)


class Timings(NamedTuple):
    """Where one call's time went, in µs. ``total_us`` is the client's own round trip."""

    queue_us: float  # client published → sidecar picked the request up
    compute_us: float  # sidecar: validation and store/index work
    write_us: float  # sidecar: encoding the response
    total_us: float  # client: from encoding the request to decoding the response


class SearchResult(NamedTuple):
    """Top-k hits. For a single query ``ids`` and ``scores`` are [k]; for [nq, dim], [nq, k].

    ``ids`` are -1 (and scores ±inf) where fewer than k items matched. Unless the search asked
    for ``copy=True`` they are views into the channel, valid until this thread's next call.
    ``payloads`` has one entry per hit (row-major), or is None when not asked for.
    ``degraded``: the sidecar was unavailable and the client was made with
    ``on_unavailable="degrade"``: no hits (every id -1), owned arrays.
    ``metadata`` and ``keys`` (``search(..., metadata=True)``): per hit (row-major) its
    metadata dict and its string id (None where it has none, or for id -1); else None.
    """

    ids: np.ndarray
    scores: np.ndarray
    payloads: list[Payload] | None
    timings: Timings
    degraded: bool = False
    metadata: list[dict[str, Any] | None] | None = None
    keys: list[str | None] | None = None


class Memory(NamedTuple):
    """One stored memory, as :meth:`Client.lookup` returns it."""

    id: int  # the int64 id (for a string id: its 63-bit key, kalos.key_id)
    key: str | None  # the string id it was added with, or None
    payload: Payload
    metadata: dict[str, Any] | None


class Turns(Sequence[tuple[str, str]]):
    """The (role, text) of each turn of a :class:`Context`, oldest first.

    Owned by the caller (a copy, not a view). Decoded on first use, so a caller that only
    wants the token ids pays nothing per turn.
    """

    __slots__ = ("_list", "_meta", "_text")

    def __init__(self, meta: bytes, text: bytes) -> None:
        self._meta = meta  # u32 [n][4]: role bytes, text bytes, tokens, 0
        self._text = text
        self._list: list[tuple[str, str]] | None = None

    def _decoded(self) -> list[tuple[str, str]]:
        if self._list is None:
            self._list = M.split_turns(self._meta, self._text)
        return self._list

    def __len__(self) -> int:
        return len(self._meta) // 16

    def __getitem__(self, i):
        return self._decoded()[i]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (Turns, list, tuple)):
            return self._decoded() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Turns({self._decoded()!r})"

    def token_counts(self) -> np.ndarray:
        """How many of the context's token ids each turn has, int64 [n] (they sum to
        ``len(context.tokens)``)."""
        return M.turn_token_counts(self._meta)


class Context(NamedTuple):
    """A session's newest turns that fit a token budget, ready for the model.

    ``tokens``: int32 [n], every included turn's token ids concatenated, oldest first, the
    pinned system prompt first when it fits. A view into the channel, valid until this
    thread's next call on the client (or the client's close, or the thread's end: its
    channel closes), unless the call asked for ``copy=True``. Over shm, a window without the
    system prompt is a read-only view of the sidecar's token heap (``flags.writeable``
    False; no copy on either side).
    ``turns``: their (role, text), owned; None when the call asked for ``turns=False``.
    ``system``: whether the system prompt is included (it is then ``turns[0]``).
    ``degraded``: the sidecar was unavailable (``on_unavailable="degrade"``): no turns.
    ``local``: computed in this process from the sidecar's session index, without a request
    (``Client``'s ``local_reads``; ``tokens`` a read-only view of the token heap, as above);
    ``timings`` has only the client's part then.
    """

    tokens: np.ndarray
    turns: Turns | None
    timings: Timings
    system: bool
    degraded: bool = False
    local: bool = False


class RecallContext(NamedTuple):
    """The session part of a :class:`Recall`: what of the session went into the token ids."""

    turns: int  # conversation turns included (the newest ones), not counting the system prompt
    tokens: int  # their token ids (the last ``tokens`` of ``Recall.token_ids``)
    system: bool  # whether the pinned system prompt is included (its ids come first)
    system_tokens: int  # its token ids (0 when not included)


class RecallParts(NamedTuple):
    """Where a recall's time went inside the sidecar, in µs (measured there)."""

    context: float  # reading the session: its system prompt and the turn window
    search: float  # the vector search
    assemble: float  # choosing the memories, gathering and writing the token ids and texts


class Recall(NamedTuple):
    """The memory step of one LLM request: model-ready token ids, and what went into them.

    ``token_ids``: [system prompt if pinned and it fits] + [the included memories' token ids,
    best hit first, each whole] + [the session's newest turns, oldest first]; int32, a view
    into the channel (numpy) or, with ``device="cuda"``, a torch int32 CUDA tensor over the
    channel's GPU buffer; valid until this thread's next call unless ``copy=True``.
    ``ids`` [k] int64 and ``scores`` [k] float32: the top-k memories, -1 (and ±inf) where
    fewer matched; views unless ``copy=True``. ``texts``: the payload of each hit (``ids``
    other than -1, in hit order): str for text, bytes for a bytes payload, None for none.
    ``memory_tokens`` [k] int32: token ids each hit put into ``token_ids`` (0: it has none,
    it did not fit, or no hit). ``context``: the session part. ``timings``: the round trip,
    as for every call; ``parts``: the sidecar's time per part. ``degraded``: the sidecar was
    unavailable (``on_unavailable="degrade"``): no tokens, no hits.
    """

    token_ids: Any
    ids: np.ndarray
    scores: np.ndarray
    texts: list[Payload]
    context: RecallContext
    timings: Timings
    parts: RecallParts
    degraded: bool
    memory_tokens: np.ndarray


class TurnAdded(NamedTuple):
    """What :meth:`Client.append_turn` did: turns now in the session, token ids of the turn."""

    turns: int
    tokens: int


class Forgotten(NamedTuple):
    """What :meth:`Client.forget` deleted."""

    memories: int
    sessions: int
    state: int  # state values
    logs: int  # event logs


# ``tuple.__new__(Timings, ...)``: a NamedTuple's own __new__ costs twice as much (~0.2 µs),
# and every call builds one. The same for Context, on the CONTEXT path.
_new_tuple = tuple.__new__

# What holds channels of this process (each Client and AsyncClient): in a fork's child its
# ``_forked()`` lets go of them, since the channels open at the fork are the parent's.
_channel_holders: weakref.WeakSet[Any] = weakref.WeakSet()


def forked_in_child(holder: Any) -> None:
    """Has ``holder._forked()`` called in every fork's child of this process."""
    _channel_holders.add(holder)


def _after_fork_in_child() -> None:
    for holder in list(_channel_holders):
        holder._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)


class Client:
    """A connection to one sidecar, safe to share between threads (one channel per thread).

    The options (transport, deadline, spinning, what a lost sidecar does, ...) are
    :class:`kalos.ClientOptions`' fields, given as keywords or as ``options=``; ``options``
    holds them. The constructor connects (ConnectError when no sidecar answers).

    A lost sidecar: a call in flight or the next call raises SidecarGone within its deadline
    when the sidecar died (its socket reads EOF: seen within ~10 ms), is stopping, or hangs
    (see ``hung_after``); the next call opens a new channel within its own deadline;
    ``reconnects`` counts the channels reopened so. ``connector``: a callable that returns
    a new channel, in place of the handshake (an in-process transport, in tests).
    """

    def __init__(
        self,
        name: str,
        *,
        options: ClientOptions | None = None,
        connector: Callable[[], Transport] | None = None,
        **kwargs: Unpack[ClientOptionsArgs],
    ) -> None:
        opts = ClientOptions.of(options, kwargs)
        self.options = opts
        self.name = name
        self.timeout = opts.timeout
        self.on_unavailable = opts.on_unavailable
        self._degrade = opts.on_unavailable == "degrade"
        self.local_reads = opts.local_reads
        self.reconnects = 0  # channels reopened after a lost sidecar or a timed-out call
        self._open: Callable[[float], tuple[Transport, Lent]]
        if connector is None:

            def open_one(budget: float) -> tuple[Transport, Lent]:
                return open_channel(
                    opts.transport,
                    name,
                    runtime_dir=opts.runtime_dir,
                    arena_bytes=opts.arena_bytes,
                    timeout=budget,
                    spin_us=opts.spin_us,
                    gpu_results=opts.gpu_results,
                    hung_after=opts.hung_after,
                    tls=opts.tls,
                )

            self._open = open_one
        else:
            given = connector
            self._open = lambda budget: (given(), NOTHING)
        self._local = threading.local()
        self._recording = 0  # threads that record stage stamps (record_stages)
        # Weak: a thread that ends drops its channel (its thread-local goes), and the
        # channel's socket closes with it, so the sidecar frees the channel. What its
        # handshake lent (a Lent: token heap, session index, GPU buffer) goes with it.
        self._transports: weakref.WeakSet[Transport] = weakref.WeakSet()
        self._lents: weakref.WeakSet[Lent] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._closed = False
        self._info: dict[str, Any] = {}
        forked_in_child(self)
        self._channel()  # connect now: fail fast when no sidecar runs

    # -- channels ----------------------------------------------------------------------------

    def _channel(self, timeout: float | None = None) -> Transport:
        """This thread's channel; a new one (a handshake within ``timeout`` seconds, default
        the client's) when it has none or its last one broke."""
        t: Transport | None = getattr(self._local, "transport", None)
        if t is not None and not t.broken:
            return t
        if self._closed:
            raise ClosedError("this client is closed")
        if t is not None:
            self._forget(t, self._local.lent)
        budget = self.timeout if timeout is None else timeout
        if not 0 < budget <= MAX_TIMEOUT_S:  # e.g. an AsyncClient call that waited out its
            raise _late(timeout)  # deadline for a channel, or a timeout that is none
        new, lent = self._open(budget)
        self._local.transport = new
        self._local.lent = lent
        self._info = new.server_info
        with self._lock:
            self._transports.add(new)
            if lent is not NOTHING:
                self._lents.add(lent)
            if t is not None:
                self.reconnects += 1
        return new

    def _lent(self, timeout: float | None = None) -> Lent:
        """What this thread's channel (:meth:`_channel`) was lent at its handshake."""
        self._channel(timeout)
        lent: Lent = self._local.lent
        return lent

    @staticmethod
    def _needs(t: Transport, minor: int, what: str) -> None:
        """ProtocolMismatch unless the channel's negotiated protocol has ``minor`` (1.x)."""
        proto = t.server_info.get("protocol")  # the in-process transport has none: current
        if proto is not None and (int(proto[0]), int(proto[1])) < (1, minor):
            raise ProtocolMismatch(
                f"{what} needs protocol 1.{minor}; the sidecar speaks {proto[0]}.{proto[1]}: "
                "upgrade the sidecar"
            )

    def _forked(self) -> None:
        """In a fork's child: every channel open at the fork is its parent's (the same shared
        memory and socket: both would answer on it), so each is dropped untouched (its
        ``__del__`` closes nothing in another process than its own), and this process's
        calls open channels of their own."""
        self._transports = weakref.WeakSet()
        self._lents = weakref.WeakSet()
        self._local = threading.local()
        self._lock = threading.Lock()  # another thread of the parent may have held it
        self._recording = 0

    def _forget(self, t: Transport, lent: Lent) -> None:
        try:
            lent.close()  # before the transport: the sidecar takes it back when that closes
        finally:
            t.close()
            with self._lock:
                self._transports.discard(t)
                self._lents.discard(lent)

    @property
    def info(self) -> dict:
        """What the sidecar said at the handshake: dim, metric, max_k, index, version, ..."""
        return self._channel().server_info

    @property
    def dim(self) -> int:
        """The sidecar's vector dimension (as of the last handshake: no round trip)."""
        return int(self._info["dim"])

    @property
    def epoch(self) -> int:
        """The epoch of the sidecar of the last handshake: new on every sidecar start."""
        return int(self._info["epoch"]) if "epoch" in self._info else 0

    @property
    def last_timings(self) -> Timings | None:
        """Timings of this thread's last completed call."""
        return getattr(self._local, "timings", None)

    def record_stages(self, on: bool = True) -> None:
        """Whether this thread's calls keep the stamps of :attr:`last_stamps` (benchmarks'
        per-stage breakdown). While no thread records, a call pays one integer test; turn it
        off before the thread ends, or every call keeps paying a thread-local lookup."""
        was = getattr(self._local, "stamps", None) is not None
        if on != was:
            self._local.stamps = (0, 0, 0) if on else None
            with self._lock:
                self._recording += 1 if on else -1

    @property
    def last_stamps(self) -> tuple[int, int, int] | None:
        """``(start_ns, sent_ns, received_ns)`` of this thread's last call, on the
        ``time.monotonic_ns()`` clock, while it records (:meth:`record_stages`): the call
        began (before validating and encoding), its request was published (0: the transport
        does not say), its response was seen (before decoding). None when not recording."""
        return getattr(self._local, "stamps", None)

    def _call(self, t: Transport, op: int, flags: int, n: int, timeout: float | None, start: int):
        # The deadline counts from the call's start: a reconnect before it used part of it.
        left = (self.timeout if timeout is None else timeout) - (_monotonic_ns() - start) * 1e-9
        if not 0 < left <= MAX_TIMEOUT_S:  # (not: a NaN too)
            raise _late(timeout)
        resp = t.request(op, flags, n, timeout=left)
        end = _monotonic_ns()
        local = self._local
        local.timings = _new_tuple(
            Timings,
            (resp.queue_ns / 1e3, resp.compute_ns / 1e3, resp.write_ns / 1e3, (end - start) / 1e3),
        )
        if self._recording and getattr(local, "stamps", None) is not None:
            local.stamps = (start, t.last_sent_ns(), end)
        if resp.status != _OK:
            raise error_for_status(resp.status, M.decode_text(resp.body, len(resp.body)))
        return resp

    # -- operations --------------------------------------------------------------------------

    def ping(self, *, timeout: float | None = None) -> Timings:
        """An empty round trip; returns its timings."""
        start = _monotonic_ns()
        self._call(self._channel(timeout), Op.PING, 0, 0, timeout, start)
        return self._local.timings

    def stats(self, *, timeout: float | None = None) -> dict:
        """The sidecar's counters: items, bytes, requests per op, errors, channels, uptime."""
        start = _monotonic_ns()
        resp = self._call(self._channel(timeout), Op.STATS, 0, 0, timeout, start)
        return json.loads(M.decode_text(resp.body, len(resp.body)))

    def search(
        self,
        query: np.ndarray,
        k: int = 10,
        *,
        scope: Scope | None = None,
        payloads: bool = True,
        copy: bool = False,
        where: Any = None,
        metadata: bool = False,
        nprobe: int = 0,
        timeout: float | None = None,
    ) -> SearchResult:
        """Top-``k`` memories for ``query`` ([dim] or [nq, dim], float32 or float16): exact,
        unless the sidecar serves an approximate index (``--index cpu:ivf,...``).

        ``scope`` filters: an item matches when each field given equals the item's field.
        ``where``: a metadata filter (docs/FILTERS.md, e.g. ``{"year": {"gte": 2020}}``):
        the top-k of the items that match it. ``metadata``: return each hit's
        metadata and string id too (``SearchResult.metadata``, ``.keys``).
        ``nprobe``: on an approximate (IVF) index, how many lists this search scores (more:
        higher recall, slower; 0: the index's own setting); an exact index ignores it.
        Scores: inner product or cosine similarity (descending), or squared L2 distance
        (ascending), by the sidecar's metric. Raises InvalidRequest for a wrong dimension,
        NaN or inf, k outside 1..max_k, nprobe not in 0..2**32-1, or a bad filter.
        """
        start = _monotonic_ns()
        single = np.ndim(query) == 1
        q = self._host_queries(query)
        codes.check_k(k)
        nprobe = codes.check_nprobe(nprobe)
        sb = scope_bytes(scope)
        flags = codes.SEARCH_WANT_PAYLOADS if payloads else 0
        wire = None if where is None else filters.dumps(where)
        if wire is not None:
            flags |= codes.SEARCH_FILTER
        if metadata:
            flags |= codes.SEARCH_WANT_META
        if nprobe:
            flags |= codes.SEARCH_NPROBE
        try:
            t = self._channel(timeout)
            if wire is not None or metadata:
                self._needs(t, 5, "search(where=..., metadata=True)")
            if nprobe:
                self._needs(t, 6, "search(nprobe=...)")
            n = M.encode_search(t.request_buffer, q, k, sb, wire, nprobe)
            resp = self._call(t, Op.SEARCH, flags, n, timeout, start)
        except _UNAVAILABLE:
            if not self._degrade:
                raise
            return self._no_meta_hits(
                self._no_hits(len(q), int(k), single, payloads, start), metadata
            )
        r = M.decode_search_response(resp.body, len(resp.body))
        ids, scores = (r.ids[0], r.scores[0]) if single else (r.ids, r.scores)
        if copy:
            ids, scores = ids.copy(), scores.copy()
        if r.entries is None:
            return SearchResult(ids, scores, r.payloads, self._local.timings)
        keys = [e[0] for e in r.entries]
        meta = [e[1] for e in r.entries]
        return SearchResult(ids, scores, r.payloads, self._local.timings, False, meta, keys)

    def _no_hits(self, nq: int, k: int, single: bool, payloads: bool, start: int) -> SearchResult:
        """The degraded answer of :meth:`search`: what an empty store returns, owned."""
        worst = np.inf if self._info.get("metric") == "l2" else -np.inf
        ids = np.full((nq, k), -1, np.int64)
        scores = np.full((nq, k), worst, np.float32)
        if single:
            ids, scores = ids[0], scores[0]
        timings = Timings(0.0, 0.0, 0.0, (_monotonic_ns() - start) / 1e3)
        hits: list[Payload] | None = [None] * (nq * k) if payloads else None
        return SearchResult(ids, scores, hits, timings, True)

    def _no_meta_hits(self, result: SearchResult, metadata: bool) -> SearchResult:
        if not metadata:
            return result
        m = int(np.size(result.ids))
        return result._replace(metadata=[None] * m, keys=[None] * m)

    def search_gpu(
        self,
        query: Any,
        k: int = 10,
        *,
        scope: Scope | None = None,
        timeout: float | None = None,
    ) -> SearchResult:
        """Exact top-``k`` with the results handed over on the GPU (needs ``gpu_results``).

        ``query``: numpy [dim] or [nq, dim] (sent through the channel, as in :meth:`search`),
        or a torch CUDA tensor, which never leaves the GPU: it is copied device to device into
        the channel's GPU query slots (this waits for the current stream). ``ids`` and
        ``scores`` come back as torch tensors over this thread's GPU result buffer: no copy,
        complete when this returns, valid until this thread's next call (``.clone()`` to
        keep). ``payloads`` is None: look texts up with :meth:`search` when needed. GPU queries
        are not checked for NaN (they never reach the host).
        """
        start = _monotonic_ns()
        t = self._channel(timeout)
        gpu = self._local.lent.gpu
        if gpu is None:
            raise ConfigError("search_gpu needs kalos.connect(..., gpu_results=True)")
        codes.check_k(k)
        sb = scope_bytes(scope)
        flags = codes.SEARCH_GPU_RESULT
        on_gpu = getattr(query, "is_cuda", False)
        single = query.ndim == 1 if on_gpu else np.ndim(query) == 1
        if on_gpu:
            q = query.reshape(1, -1) if single else query
            nq = q.shape[0]
            if q.ndim != 2 or q.shape[1] != self.dim or not 1 <= nq <= gpu.max_queries:
                raise InvalidRequest(
                    f"GPU queries must be [1..{gpu.max_queries}, {self.dim}], got "
                    f"{tuple(query.shape)}"
                )
            gpu.query[:nq].copy_(q)
            import torch

            torch.cuda.current_stream(gpu.device).synchronize()  # visible to the sidecar
            n = M.encode_search_header(t.request_buffer, nq, self.dim, k, sb)
            flags |= codes.SEARCH_GPU_QUERY
        else:
            q = self._host_queries(query)
            nq = q.shape[0]
            n = M.encode_search(t.request_buffer, q, k, sb)
        if nq * k > gpu.max_hits:
            raise InvalidRequest(f"{nq} x {k} results exceed the {gpu.max_hits} GPU result slots")
        self._call(t, Op.SEARCH, flags, n, timeout, start)
        ids = gpu.ids[: nq * k].view(nq, k)
        scores = gpu.scores[: nq * k].view(nq, k)
        if single:
            ids, scores = ids[0], scores[0]
        return SearchResult(ids, scores, None, self._local.timings)

    def _host_queries(self, query: Any) -> np.ndarray:
        q = np.asarray(query)
        if q.ndim == 1:
            q = q[None, :]
        if q.ndim != 2 or q.shape[1] != self.dim:
            raise InvalidRequest(
                f"the query has shape {np.shape(query)}; this sidecar's vectors have dimension "
                f"{self.dim}"
            )
        if q.dtype != np.float16 and q.dtype != np.float32:
            q = q.astype(np.float32)
        return np.ascontiguousarray(q)

    def add(
        self,
        vectors: np.ndarray,
        ids: np.ndarray | Sequence[int | str] | int | str,
        payloads: Sequence[Payload] | Payload = None,
        *,
        scope: Scope | None = None,
        tokens: Sequence[np.ndarray | Sequence[int] | None] | np.ndarray | None = None,
        metadata: Sequence[Mapping[str, Any] | None] | Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> int:
        """Adds (upserts) items; returns how many were new (the rest replaced existing ids).

        ``vectors``: [n, dim] (or [dim] for one item); ``ids``: n int64 ids of your choosing
        (not -1); ``payloads``: n texts or bytes (or None). Every item gets ``scope``.
        ``tokens``: n token id lists (int32 range; one list for a single item), an entry None
        or ``tokens`` None: a text payload gets its token ids from the sidecar's
        ``--tokenizer`` when it has one, else the item has none. :meth:`recall` puts a hit's
        token ids into the model's input. ``ids`` may be strings (UUIDs, ...): each maps
        onto a 63-bit id (:func:`kalos.key_id`), is stored, and comes back in
        ``SearchResult.keys`` and :meth:`lookup`; two strings with the same 63-bit id are a
        Conflict. ``metadata``: n dicts (or None) of str keys to str, int, float, bool or
        lists of those, for ``where`` filters (docs/FILTERS.md). Batches larger than the
        channel arena are sent in chunks, each acknowledged on its own: if a chunk fails,
        the chunks before it stay added.
        """
        v = np.asarray(vectors)
        if v.ndim == 1:
            v = v[None, :]
        if v.ndim != 2 or v.shape[1] != self.dim:
            raise InvalidRequest(
                f"vectors have shape {np.shape(vectors)}; this sidecar's dimension is {self.dim}"
            )
        if v.dtype != np.float16 and v.dtype != np.float32:
            v = v.astype(np.float32)
        v = np.ascontiguousarray(v)
        id_arr, keys = item_ids(ids)
        n = len(v)
        if id_arr.shape != (n,):
            raise InvalidRequest(f"{len(id_arr)} ids for {n} vectors")
        kinds, blobs = _encode_payloads(payloads, n)
        token_lists = _token_lists(tokens, n)
        meta_json = _meta_json(metadata, keys, n)
        if n == 0:
            return 0
        sb = scope_bytes(scope)
        t = self._channel(timeout)
        capacity = len(t.request_buffer)
        token_lens = (
            None
            if token_lists is None
            else np.array([0 if x is None else len(x) for x in token_lists], np.int64)
        )
        meta_lens = (
            None
            if meta_json is None
            else np.array([len(m) + len(k) + 2 for m, k in zip(*meta_json, strict=True)])
        )
        fixed, per_item = M.add_item_sizes(
            self.dim, v.itemsize, np.fromiter(map(len, blobs), np.int64, n), sb, token_lens,
            meta_lens,
        )  # fmt: skip
        flags = 0
        if token_lists is not None:  # a 1.0 sidecar would read the token ids as payload bytes
            self._needs(t, 1, "add(tokens=...)")
            flags = codes.ADD_HAS_TOKENS
        if meta_json is not None:
            self._needs(t, 5, "add(metadata=...) or string ids")
            flags |= codes.ADD_HAS_META
        if int(per_item.max()) + fixed > capacity:
            raise PayloadTooLarge(
                f"an item of {int(per_item.max())} bytes does not fit the {capacity}-byte arena"
            )
        added = 0
        i = 0
        ends = np.cumsum(per_item)
        while i < n:
            base = ends[i - 1] if i else 0
            j = int(np.searchsorted(ends, base + capacity - fixed, side="right"))
            start = _monotonic_ns()
            t = self._channel(timeout)
            size = M.encode_add(
                t.request_buffer, id_arr[i:j], v[i:j], kinds[i:j], blobs[i:j], sb,
                None if token_lists is None else token_lists[i:j],
                None if meta_json is None
                else M.add_meta_json(meta_json[0][i:j], meta_json[1][i:j]),
            )  # fmt: skip
            resp = self._call(t, Op.ADD, flags, size, timeout, start)
            added += M.decode_counts(resp.body, len(resp.body))[0]
            i = j
        return added

    def remove(
        self,
        ids: np.ndarray | Sequence[int | str] | int | str | None = None,
        *,
        where: Any = None,
        scope: Scope | None = None,
        timeout: float | None = None,
    ) -> int:
        """Removes items by id (ints or string ids); returns how many existed. Unknown ids
        are ignored. Or, with ``where`` (and optionally ``scope``) instead of ids: every
        memory that matches the filter (and the scope)."""
        if where is not None:
            if ids is not None:
                raise InvalidRequest("remove takes ids or where=..., not both")
            return self.forget(scope or Scope(), where=where, timeout=timeout).memories
        if ids is None:
            raise InvalidRequest("remove needs ids or where=...")
        id_arr = item_ids(ids)[0]
        removed = 0
        t = self._channel(timeout)
        step = (len(t.request_buffer) - 8) // 8
        for i in range(0, max(len(id_arr), 1), step):
            start = _monotonic_ns()
            t = self._channel(timeout)
            size = M.encode_remove(t.request_buffer, id_arr[i : i + step])
            resp = self._call(t, Op.REMOVE, 0, size, timeout, start)
            removed += M.decode_counts(resp.body, len(resp.body))[0]
        return removed

    # -- sessions ----------------------------------------------------------------------------

    def append_turn(
        self,
        session: str,
        role: str,
        text: str,
        tokens: np.ndarray | Sequence[int] | None = None,
        *,
        scope: Scope | None = None,
        pin: bool = False,
        ttl_s: float | None = None,
        rolling: bool | None = None,
        timeout: float | None = None,
    ) -> TurnAdded:
        """Appends a turn to ``session`` (created by its first append).

        ``tokens``: the turn's token ids (int32 range); None: the sidecar tokenizes ``text``
        with its ``--tokenizer`` (InvalidRequest when it has none). ``scope``: the session's
        tenant and user, fixed at creation (Conflict when a later append names others).
        ``pin``: the turn becomes the pinned system prompt (replacing any), always first in
        a context when it fits. ``ttl_s``: the session expires this many seconds after its
        last append (0: never; None: keep). ``rolling``: when the session is full
        (``--max-session-turns``) its oldest turns give way, instead of InvalidRequest
        (None: keep the setting; new sessions are not rolling). Over ``--max-turn-tokens``
        or ``--max-turn-bytes``: InvalidRequest.
        """
        start = _monotonic_ns()
        sb = session_scope_bytes(session, scope)
        if not isinstance(role, str) or not isinstance(text, str):
            raise InvalidRequest("role and text must be str")
        ids = None if tokens is None else _token_ids(tokens)
        if ttl_s is not None and not (ttl_s >= 0 and ttl_s < float("inf")):
            raise InvalidRequest(f"ttl_s must be a finite number >= 0, got {ttl_s}")
        flags = 0
        if ids is not None:
            flags |= codes.AppendFlag.HAS_TOKENS
        if pin:
            flags |= codes.AppendFlag.PIN_SYSTEM
        if rolling is not None:
            flags |= codes.AppendFlag.SET_ROLLING | (codes.AppendFlag.ROLLING if rolling else 0)
        t = self._channel(timeout)
        n = M.encode_append_turn(t.request_buffer, sb, role.encode(), text.encode(), ids, ttl_s)
        resp = self._call(t, Op.APPEND_TURN, int(flags), n, timeout, start)
        return TurnAdded(*M.decode_counts(resp.body, len(resp.body)))

    def context(
        self,
        session: str,
        max_tokens: int,
        max_turns: int | None = None,
        *,
        scope: Scope | None = None,
        turns: bool = True,
        copy: bool = False,
        timeout: float | None = None,
    ) -> Context:
        """The newest turns of ``session`` that fit ``max_tokens`` token ids, oldest first.

        The pinned system prompt comes first when it fits (its tokens count against
        ``max_tokens``); ``max_turns`` caps the other turns. The window is a contiguous
        suffix: a turn that does not fit ends it. ``tokens`` is an int32 view into the channel
        or, over shm, a read-only one into the sidecar's token heap (also for a window this
        client computed from the session index: see ``local_reads``), valid until this
        thread's next call, unless ``copy=True``. ``turns=False``: only the
        token ids travel (half the bytes of ~4-byte-per-token text), ``Context.turns`` is
        None. ``scope``: a tenant/user filter; a session outside it is NotFound, as is an
        unknown or expired one.
        """
        start = _monotonic_ns()
        if type(session) is not str or not session:
            raise InvalidRequest("a session id must be a non-empty str")
        if not _is_count(max_tokens, _NO_LIMIT):
            raise InvalidRequest(f"max_tokens must be an integer between 0 and {_NO_LIMIT - 1}")
        if max_turns is None:
            max_turns = _NO_LIMIT
        elif not _is_count(max_turns, _NO_LIMIT):
            raise InvalidRequest(
                f"max_turns must be an integer between 0 and {_NO_LIMIT - 1}, or None"
            )
        sb = _EMPTY_SCOPE if scope is None else scope_bytes(scope)
        name = session.encode()
        try:
            t = self._channel(timeout)
            lent = self._local.lent
            if not turns and self.local_reads:
                # an empty tenant or user is none, on the wire and here
                got = lent.context_local(name, max_tokens, max_turns, sb.tenant or None,
                                      sb.user or None)  # fmt: skip
                if got is not None:  # no request: no sidecar stages, no stamps to split by
                    tokens = got[0].copy() if copy else got[0]
                    end = _monotonic_ns()
                    local = self._local
                    local.timings = _new_tuple(Timings, (0.0, 0.0, 0.0, (end - start) / 1e3))
                    if self._recording and getattr(local, "stamps", None) is not None:
                        local.stamps = (start, 0, end)
                    return _new_tuple(Context, (tokens, None, local.timings, False, False, True))
            n = _encode_context(t.request_buffer, name, max_tokens, max_turns, sb)
            resp = self._call(t, _CONTEXT, _TURNS if turns else 0, n, timeout, start)
        except _UNAVAILABLE:
            if not self._degrade:
                raise
            timings = Timings(0.0, 0.0, 0.0, (_monotonic_ns() - start) / 1e3)
            window = Turns(b"", b"") if turns else None
            return Context(np.empty(0, np.int32), window, timings, False, True, False)
        tokens, meta, text, system = _decode_context_response(resp.body, len(resp.body), lent.heap)
        if copy:
            tokens = tokens.copy()
        window = None if meta is None or text is None else Turns(meta, text)
        return _new_tuple(Context, (tokens, window, self._local.timings, system, False, False))

    def recall(
        self,
        session: str,
        query: Any,
        *,
        k: int = 5,
        max_tokens: int,
        max_turns: int | None = None,
        memory_tokens: int | None = None,
        scope: Scope | None = None,
        device: str | None = None,
        copy: bool = False,
        where: Any = None,
        timeout: float | None = None,
    ) -> Recall:
        """The whole memory step of one LLM request in one round trip: ``session``'s context
        and the top-``k`` memories for ``query``, assembled into model-ready token ids.

        ``query``: a vector of the sidecar's dimension (numpy float32/float16, or a torch
        tensor: a CUDA one is copied to the host, a few hundred bytes). The token ids are
        [system prompt] + [memories, best hit first] + [turns, oldest first], at most
        ``max_tokens`` in all: the pinned system prompt first when it fits; then the
        memories, each whole or not at all (a hit that does not fit is dropped and a later,
        shorter one may still fit), within what is left and within ``memory_tokens`` when
        given; then the newest turns that fit what remains (a contiguous suffix, at most
        ``max_turns``). Memories come before turns: pass ``memory_tokens`` to keep room for
        the conversation. A hit without token ids (see :meth:`add`) is in ``texts`` only.

        ``scope``: the memory filter, as in :meth:`search`, its tenant defaulting to the
        session's tenant (a tenant's session never recalls another tenant's memories); its
        tenant and user must also match the session's (NotFound otherwise, as for an unknown
        or expired session). ``device="cuda"``: the token ids come back as a torch int32
        tensor over this thread's GPU result buffer (needs ``gpu_results=True`` and a cuda
        sidecar; ``max_tokens`` at most the buffer's token slots, 131,072), no copy,
        complete when this returns. The arrays are views valid until this thread's next
        call; ``copy=True`` owns them (a clone on the GPU). With ``on_unavailable="degrade"``
        an unavailable sidecar gives an empty Recall with ``degraded=True``. ``where``: a
        metadata filter on the memories (docs/FILTERS.md), beside ``scope``.
        """
        start = _monotonic_ns()
        if type(session) is not str or not session:
            raise InvalidRequest("a session id must be a non-empty str")
        codes.check_k(k)
        _check_count("max_tokens", max_tokens)
        if max_turns is not None:
            _check_count("max_turns", max_turns)
        if memory_tokens is not None:
            _check_count("memory_tokens", memory_tokens)
        q = self._recall_query(query)
        sb = scope_bytes(scope)
        on_gpu = _on_gpu(device)
        flags = int(codes.RecallFlag.GPU_RESULT) if on_gpu else 0
        wire = None if where is None else filters.dumps(where)
        if wire is not None:
            flags |= int(codes.RecallFlag.FILTER)
        try:
            t = self._channel(timeout)
            self._needs(t, 1 if wire is None else 5, "recall" if wire is None else "recall(where=)")
            gpu = self._local.lent.gpu if on_gpu else None
            if on_gpu:
                if gpu is None:
                    raise ConfigError('recall(device="cuda") needs kalos.connect(..., '
                                      "gpu_results=True) to a cuda sidecar")  # fmt: skip
                if device != "cuda" and device != f"cuda:{gpu.device}":
                    raise ConfigError(
                        f"this channel's GPU buffer is on cuda:{gpu.device}, not {device}"
                    )
                if max_tokens > gpu.max_tokens:
                    raise InvalidRequest(
                        f'recall(device="cuda") takes max_tokens <= {gpu.max_tokens} (the GPU '
                        f"buffer's token slots), got {max_tokens}"
                    )
            n = M.encode_recall(
                t.request_buffer, session.encode(), q, int(k), max_tokens,
                _NO_LIMIT if max_turns is None else max_turns,
                _NO_LIMIT if memory_tokens is None else memory_tokens, sb, wire,
            )  # fmt: skip
            resp = self._call(t, Op.RECALL, flags, n, timeout, start)
        except _UNAVAILABLE:
            if not self._degrade:
                raise
            return self._no_recall(int(k), on_gpu, start)
        r = M.decode_recall_response(resp.body, len(resp.body))
        ids, scores, counts = r.ids, r.scores, r.memory_tokens
        if gpu is not None:
            token_ids: Any = gpu.tokens[: r.n_tokens]
            if copy:
                token_ids = token_ids.clone()
        else:
            token_ids = r.tokens
            if copy:
                token_ids = token_ids.copy()
        if copy:
            ids, scores, counts = ids.copy(), scores.copy(), counts.copy()
        return Recall(
            token_ids,
            ids,
            scores,
            r.payloads[: r.n_hits],
            RecallContext(
                r.n_turns,
                r.turn_tokens,
                bool(r.flags & codes.RecallResponseFlag.SYSTEM),
                r.system_tokens,
            ),
            self._local.timings,
            RecallParts(r.context_ns / 1e3, r.search_ns / 1e3, r.assemble_ns / 1e3),
            False,
            counts,
        )

    def _recall_query(self, query: Any) -> np.ndarray:
        """A recall's query as a host array [1, dim] (a torch tensor is moved to the host)."""
        if hasattr(query, "detach"):  # torch, without importing it
            q = query.detach()
            if str(q.dtype) not in ("torch.float32", "torch.float16"):
                q = q.float()
            query = q.cpu().numpy()
        q = self._host_queries(query)
        if q.shape[0] != 1:
            raise InvalidRequest(f"recall takes one query vector, got shape {np.shape(query)}")
        return q

    def _no_recall(self, k: int, on_gpu: bool, start: int) -> Recall:
        """The degraded answer of :meth:`recall`: no tokens, no hits, owned."""
        worst = np.inf if self._info.get("metric") == "l2" else -np.inf
        if on_gpu:
            import torch

            token_ids: Any = torch.empty(0, dtype=torch.int32, device="cuda")
        else:
            token_ids = np.empty(0, np.int32)
        return Recall(
            token_ids,
            np.full(k, -1, np.int64),
            np.full(k, worst, np.float32),
            [],
            RecallContext(0, 0, False, 0),
            Timings(0.0, 0.0, 0.0, (_monotonic_ns() - start) / 1e3),
            RecallParts(0.0, 0.0, 0.0),
            True,
            np.zeros(k, np.int32),
        )

    def sessions(
        self, scope: Scope | None = None, *, timeout: float | None = None
    ) -> list[SessionInfo]:
        """Live sessions matching ``scope`` (each field given must equal the session's), by
        session id. Fetched in pages as large as the channel arena holds."""
        sb = scope_bytes(scope)
        out: list[SessionInfo] = []
        after = b""
        while True:
            start = _monotonic_ns()
            t = self._channel(timeout)
            n = M.encode_scoped(t.request_buffer, M.NO_LIMIT, len(after), sb, after)
            resp = self._call(t, Op.SESSIONS, 0, n, timeout, start)
            page = json.loads(M.decode_text(resp.body, len(resp.body)))
            out += [SessionInfo(**info) for info in page["sessions"]]
            if not page["more"] or not page["sessions"]:
                return out
            after = out[-1].session.encode()

    def trim(
        self,
        session: str,
        keep_turns: int,
        *,
        scope: Scope | None = None,
        timeout: float | None = None,
    ) -> int:
        """Keeps the newest ``keep_turns`` turns of ``session`` (and its system prompt);
        returns how many were dropped. NotFound for an unknown or expired session."""
        start = _monotonic_ns()
        sb = session_scope_bytes(session, scope)
        if not _is_count(keep_turns, _NO_LIMIT):
            raise InvalidRequest(f"keep_turns must be an integer between 0 and {_NO_LIMIT - 1}")
        t = self._channel(timeout)
        n = M.encode_scoped(t.request_buffer, keep_turns, 0, sb)
        resp = self._call(t, Op.TRIM, 0, n, timeout, start)
        return M.decode_counts(resp.body, len(resp.body))[0]

    def delete_session(
        self, session: str, *, scope: Scope | None = None, timeout: float | None = None
    ) -> None:
        """Deletes ``session``: its turns and system prompt (not its event log: ``forget``
        with ``Scope(session=...)`` removes everything). NotFound when there is none."""
        start = _monotonic_ns()
        sb = session_scope_bytes(session, scope)
        t = self._channel(timeout)
        n = M.encode_scoped(t.request_buffer, 0, 0, sb)
        self._call(t, Op.DELETE_SESSION, 0, n, timeout, start)

    # -- agent state ---------------------------------------------------------------------------

    def put(
        self,
        key: str,
        value: bytes | str,
        *,
        scope: Scope | None = None,
        timeout: float | None = None,
    ) -> int:
        """Sets state ``key`` in ``scope`` (an exact namespace: tenant, user, session) to
        ``value`` (bytes; a str is stored as UTF-8); returns its new version (> 0).
        Over ``--max-state-bytes``: InvalidRequest."""
        return self._state_value(Op.STATE_PUT, key, value, 0, scope, timeout)

    def cas(
        self,
        key: str,
        expected_version: int,
        value: bytes | str,
        *,
        scope: Scope | None = None,
        timeout: float | None = None,
    ) -> int:
        """Sets ``key`` only if its version is ``expected_version`` (0: only if it does not
        exist); returns the new version. Conflict otherwise, naming the current version."""
        if not _is_count(expected_version, 1 << 63):
            raise InvalidRequest(
                f"expected_version must be an integer >= 0, got {expected_version!r}"
            )
        return self._state_value(Op.STATE_CAS, key, value, expected_version, scope, timeout)

    def _state_value(
        self,
        op: int,
        key: str,
        value: bytes | str,
        expected: int,
        scope: Scope | None,
        timeout: float | None,
    ) -> int:
        start = _monotonic_ns()
        raw = _value_bytes(value)
        sb = scope_bytes(scope)
        t = self._channel(timeout)
        n = M.encode_state_value(t.request_buffer, sb, _key_bytes(key), raw, expected)
        resp = self._call(t, op, 0, n, timeout, start)
        return M.decode_counts(resp.body, len(resp.body))[0]

    def get(
        self, key: str, *, scope: Scope | None = None, timeout: float | None = None
    ) -> StateValue:
        """(version, value bytes, owned) of state ``key`` in ``scope``; NotFound if absent."""
        start = _monotonic_ns()
        sb = scope_bytes(scope)
        t = self._channel(timeout)
        n = M.encode_state_key(t.request_buffer, sb, _key_bytes(key))
        resp = self._call(t, Op.STATE_GET, 0, n, timeout, start)
        return StateValue(*M.decode_state_get_response(resp.body, len(resp.body)))

    def delete(self, key: str, *, scope: Scope | None = None, timeout: float | None = None) -> bool:
        """Deletes state ``key`` in ``scope``; returns whether it existed."""
        start = _monotonic_ns()
        sb = scope_bytes(scope)
        t = self._channel(timeout)
        n = M.encode_state_key(t.request_buffer, sb, _key_bytes(key))
        resp = self._call(t, Op.STATE_DELETE, 0, n, timeout, start)
        return bool(M.decode_counts(resp.body, len(resp.body))[0])

    def log(
        self,
        session: str,
        kind: str,
        data: bytes | str,
        *,
        scope: Scope | None = None,
        timeout: float | None = None,
    ) -> int:
        """Appends an event (``kind``, e.g. "tool_call"; ``data`` str or bytes, returned as
        given) to ``session``'s append-only log; returns its seq (1 for the first). The
        sidecar stamps its time. The log's owner is ``scope`` or, if that gives no tenant or
        user, the owner of the session of the same id."""
        start = _monotonic_ns()
        sb = session_scope_bytes(session, scope)
        if not isinstance(kind, str):
            raise InvalidRequest("an event kind must be a str")
        if not isinstance(data, (str, bytes, bytearray, memoryview)):
            raise InvalidRequest(f"event data must be str or bytes, not {type(data).__name__}")
        t = self._channel(timeout)
        n = M.encode_log_event(t.request_buffer, sb, kind.encode(), data)
        resp = self._call(t, Op.LOG_EVENT, 0, n, timeout, start)
        return M.decode_counts(resp.body, len(resp.body))[0]

    def events(
        self,
        session: str,
        since: int = 0,
        *,
        limit: int | None = None,
        scope: Scope | None = None,
        timeout: float | None = None,
    ) -> list[Event]:
        """Events of ``session`` with seq > ``since``, oldest first, at most ``limit``; owned
        objects. A session without a log (or outside ``scope``) has none: []. Fetched in
        pages as large as the channel arena holds."""
        sb = session_scope_bytes(session, scope)
        if not _is_count(since, 1 << 63):
            raise InvalidRequest(f"since must be an integer >= 0, got {since!r}")
        if limit is not None and not _is_count(limit, _NO_LIMIT):
            raise InvalidRequest(f"limit must be an integer between 0 and {_NO_LIMIT - 1}, or None")
        out: list[Event] = []
        while limit is None or len(out) < limit:
            start = _monotonic_ns()
            t = self._channel(timeout)
            want = M.NO_LIMIT if limit is None else limit - len(out)
            n = M.encode_events_request(t.request_buffer, sb, since, want)
            resp = self._call(t, Op.EVENTS, 0, n, timeout, start)
            page, more = M.decode_events_response(resp.body, len(resp.body))
            out += [Event(*e) for e in page]
            if not more or not page:
                break
            since = page[-1][0]
        return out

    # -- scopes ------------------------------------------------------------------------------

    def forget(self, scope: Scope, *, where: Any = None, timeout: float | None = None) -> Forgotten:
        """Deletes everything of ``scope`` (each field given must match; at least one):
        memories (from the index too), sessions, state values and event logs. Returns the
        counts. With ``where`` (a metadata filter): only the memories of ``scope`` (which
        may then be empty: all of them) that match it; sessions and state stay."""
        if not isinstance(scope, Scope) or (where is None and not any(scope)):
            raise InvalidRequest("forget needs a scope with a tenant, a user or a session")
        start = _monotonic_ns()
        sb = scope_bytes(scope)
        t = self._channel(timeout)
        flags = 0
        tail = b""
        if where is not None:
            self._needs(t, 5, "forget(where=...)")
            flags = codes.FORGET_FILTER
            tail = M.encode_filter_tail(filters.dumps(where))
        n = M.encode_scoped(t.request_buffer, 0, 0, sb, tail)
        resp = self._call(t, Op.FORGET, flags, n, timeout, start)
        return Forgotten(*M.decode_forgotten(resp.body, len(resp.body)))

    def lookup(
        self,
        ids: np.ndarray | Sequence[int | str] | int | str,
        *,
        scope: Scope | None = None,
        timeout: float | None = None,
    ) -> list[Memory]:
        """The stored memories among ``ids`` (ints or string ids), in the order asked, each
        once; unknown ids, and with ``scope`` those outside it, are left out. Owned."""
        id_arr = item_ids(ids)[0]
        out: list[Memory] = []
        sb = scope_bytes(scope)
        t = self._channel(timeout)
        self._needs(t, 5, "lookup")
        step = max((len(t.request_buffer) - 8 - sb.nbytes) // 8, 1)
        for i in range(0, len(id_arr), step):
            start = _monotonic_ns()
            t = self._channel(timeout)
            size = M.encode_lookup(t.request_buffer, id_arr[i : i + step], sb)
            resp = self._call(t, Op.LOOKUP, 0, size, timeout, start)
            r = M.decode_search_response(resp.body, len(resp.body))
            entries = r.entries or []
            payloads = r.payloads or [None] * len(entries)
            for item, (key, meta), payload in zip(r.ids[0].tolist(), entries, payloads,
                                                  strict=True):  # fmt: skip
                out.append(Memory(item, key, payload, meta))
        return out

    def close(self) -> None:
        """Closes every thread's channel. Idempotent; later calls raise ClosedError."""
        self._closed = True
        with self._lock:
            transports = list(self._transports)
            lents = list(self._lents)
            self._transports = weakref.WeakSet()
            self._lents = weakref.WeakSet()
        try:
            for lent in lents:  # before the transports, as in _forget
                lent.close()
        finally:
            for t in transports:
                t.close()

    def __reduce__(self) -> Any:
        raise TypeError(
            "a kalos.Client holds this process's channels and cannot be pickled: pass its "
            "name and options (client.name, client.options) and connect in the other process "
            "(a client made before os.fork() works in the child as it is)"
        )

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def scope_bytes(scope: Scope | None) -> M.ScopeBytes:
    if scope is None:
        return M.EMPTY_SCOPE
    if not isinstance(scope, Scope):
        raise InvalidRequest("scope must be a kalos.Scope(tenant, user, session)")
    try:
        return M.encode_scope_fields(scope)
    except AttributeError:  # a field that is no str: it has no encode
        raise _bad_scope_field(scope) from None


def session_scope_bytes(session: str, scope: Scope | None) -> M.ScopeBytes:
    """The scope block of a session op: ``scope``'s tenant and user, the session id."""
    if not isinstance(session, str) or not session:
        raise InvalidRequest("a session id must be a non-empty str")
    if scope is None:
        return M.ScopeBytes(b"", b"", session.encode())
    if not isinstance(scope, Scope):
        raise InvalidRequest("scope must be a kalos.Scope(tenant, user, session)")
    if scope.session is not None and scope.session != session:
        raise InvalidRequest(f"the scope names session {scope.session!r}, not {session!r}")
    try:
        return M.ScopeBytes(
            (scope.tenant or "").encode(), (scope.user or "").encode(), session.encode()
        )
    except AttributeError:
        raise _bad_scope_field(scope) from None


def _bad_scope_field(scope: Scope) -> InvalidRequest:
    return InvalidRequest(
        f"a scope's tenant, user and session must each be a str or None; got {scope!r}"
    )


_INT32 = np.iinfo(np.int32)
_OK = int(codes.Status.OK)  # an IntEnum member costs ~0.08 µs per attribute lookup
_TURNS = int(codes.ContextFlag.TURNS)
_CONTEXT = int(Op.CONTEXT)
_NO_LIMIT = M.NO_LIMIT
_EMPTY_SCOPE = M.EMPTY_SCOPE
# The CONTEXT path's codecs, bound once (a module attribute lookup costs ~0.02 µs).
_encode_context = M.encode_context
_decode_context_response = M.decode_context_response


def _token_ids(tokens: np.ndarray | Sequence[int]) -> np.ndarray:
    ids = np.asarray(tokens)
    if ids.size == 0:
        return np.empty(0, np.int32)
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise InvalidRequest(f"token ids must be integers [n], got {ids.dtype} {ids.shape}")
    if ids.dtype != np.int32:
        if int(ids.min()) < _INT32.min or int(ids.max()) > _INT32.max:
            raise InvalidRequest("token ids must fit in int32")
        ids = ids.astype(np.int32)
    return np.ascontiguousarray(ids)


def _check_count(name: str, value: object) -> None:
    if not _is_count(value, _NO_LIMIT):
        raise InvalidRequest(f"{name} must be an integer between 0 and {_NO_LIMIT - 1}")


def _is_count(value: object, limit: int) -> bool:
    """Whether ``value`` is an integer (numpy's too, not a bool) from 0 to ``limit`` - 1."""
    if type(value) is int or (isinstance(value, (int, np.integer)) and type(value) is not bool):
        return bool(0 <= value < limit)
    return False


def _on_gpu(device: str | None) -> bool:
    """Whether a recall's ``device`` asks for the token ids on the GPU."""
    if device is None or device == "cpu":
        return False
    if isinstance(device, str) and (device == "cuda" or device.startswith("cuda:")):
        return True
    raise InvalidRequest(f'device must be None, "cpu" or "cuda", not {device!r}')


def _token_lists(
    tokens: Sequence[np.ndarray | Sequence[int] | None] | np.ndarray | None, n: int
) -> list[np.ndarray | None] | None:
    """Per item int32 token ids or None, from what :meth:`Client.add` accepts."""
    if tokens is None:
        return None
    if n == 1 and (
        (isinstance(tokens, np.ndarray) and tokens.ndim == 1)
        or (
            isinstance(tokens, (list, tuple))
            and tokens
            and isinstance(tokens[0], (int, np.integer))
        )
    ):
        tokens = [tokens]  # one item's token ids
    if isinstance(tokens, (str, bytes)) or len(tokens) != n:
        raise InvalidRequest(f"tokens must be one list of token ids per item ({n} items)")
    return [None if t is None else _token_ids(t) for t in tokens]


def _key_bytes(key: str) -> bytes:
    if not isinstance(key, str) or not key:
        raise InvalidRequest("a state key must be a non-empty str")
    return key.encode()


def _value_bytes(value: bytes | str) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise InvalidRequest(f"a state value must be bytes or str, not {type(value).__name__}")


def item_ids(
    ids: np.ndarray | Sequence[int | str] | int | str,
) -> tuple[np.ndarray, list[str | None] | None]:
    """ids [n] int64 and, when any is a str, each one's string id (None for an int): a
    string id maps onto :func:`kalos.key_id`. InvalidRequest for an id that is neither a
    str nor an integer in int64's range (a float, a bool, an unsigned id above 2**63 - 1):
    never a silent cast."""
    if isinstance(ids, str):
        ids = [ids]
    if isinstance(ids, (np.ndarray, int, np.integer)):
        return _int64_ids(ids), None
    items = list(ids)
    if not any(isinstance(i, str) for i in items):
        return _int64_ids(items), None
    keys: list[str | None] = [i if isinstance(i, str) else None for i in items]
    arr = _int64_ids([key_id(i) if isinstance(i, str) else i for i in items])
    return arr, keys


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _late(timeout: object) -> InvalidRequest | RequestTimeout:
    """The error of a call with no time left: its ``timeout`` is none (InvalidRequest, see
    kalos.options.timeout_error), or its deadline passed before its request was sent."""
    return timeout_error(timeout) or RequestTimeout(
        "the call's deadline passed before its request was sent"
    )


def _int64_ids(ids: object) -> np.ndarray:
    """Integer ids as int64 [n], checked (see :func:`item_ids`)."""
    try:
        arr = np.atleast_1d(np.asarray(ids))
    except (OverflowError, ValueError):  # e.g. a list of ragged or huge items
        arr = np.atleast_1d(np.asarray(ids, dtype=object))
    if arr.ndim != 1:
        raise InvalidRequest(f"ids must be one-dimensional; got shape {arr.shape}")
    kind = arr.dtype.kind
    if kind == "i" or (kind == "u" and (not arr.size or int(arr.max()) <= _INT64_MAX)):
        return arr.astype(np.int64, copy=False)
    if not arr.size:  # np.asarray([]) is float64
        return np.empty(0, np.int64)
    # the items as given (numpy may have made a list's ints floats), for the message
    items = ids if isinstance(ids, list) else arr.ravel().tolist()
    for i in items:
        if not _is_int64(i):
            raise InvalidRequest(f"an id must be a str or an integer in int64's range; got {i!r}")
    return np.array(items, np.int64)  # (Python ints that numpy held as objects)


def _is_int64(i: object) -> bool:
    return (
        isinstance(i, (int, np.integer))
        and not isinstance(i, (bool, np.bool_))
        and _INT64_MIN <= int(i) <= _INT64_MAX
    )


def _meta_json(
    metadata: Sequence[Mapping[str, Any] | None] | Mapping[str, Any] | None,
    keys: list[str | None] | None,
    n: int,
) -> tuple[list[bytes], list[bytes]] | None:
    """Each item's metadata and string id as JSON, or None when there is neither."""
    if metadata is None and keys is None:
        return None
    if isinstance(metadata, Mapping):
        metadata = [metadata]
    if metadata is not None and len(metadata) != n:
        raise InvalidRequest(f"{len(metadata)} metadata for {n} items")
    meta_out: list[bytes] = []
    for i in range(n):
        m = None if metadata is None else check_metadata(metadata[i], i)
        try:
            meta_out.append(b"null" if m is None else json.dumps(m, allow_nan=False).encode())
        except (TypeError, ValueError, RecursionError) as exc:  # (nested past Python's limit)
            raise InvalidRequest(f"metadata {i} cannot be stored: {exc}") from None
    key_out = [b"null"] * n if keys is None else [json.dumps(k).encode() for k in keys]
    return meta_out, key_out


def _encode_payloads(
    payloads: Sequence[Payload] | Payload, n: int
) -> tuple[np.ndarray, list[bytes]]:
    kinds = np.zeros(n, np.uint8)
    if payloads is None:
        return kinds, [b""] * n
    if isinstance(payloads, (str, bytes)):
        payloads = [payloads]
    if len(payloads) != n:
        raise InvalidRequest(f"{len(payloads)} payloads for {n} items")
    blobs: list[bytes] = []
    for i, p in enumerate(payloads):
        if p is None:
            blobs.append(b"")
        elif isinstance(p, str):
            kinds[i] = codes.PAYLOAD_TEXT
            blobs.append(p.encode())
        elif isinstance(p, (bytes, bytearray, memoryview)):
            kinds[i] = codes.PAYLOAD_BYTES
            blobs.append(bytes(p))
        else:
            raise InvalidRequest(f"payload {i} is {type(p).__name__}; use str, bytes or None")
    return kinds, blobs


def connect(
    name: str, *, options: ClientOptions | None = None, **kwargs: Unpack[ClientOptionsArgs]
) -> Client:
    """Connects to the running sidecar ``name``. Raises ConnectError when none runs.
    The options are :class:`kalos.ClientOptions`' fields, as keywords or as ``options=``.
    Over grpc (another host), ``name`` is the target:
    ``connect("10.0.0.5:7440", transport="grpc", tls=kalos.Tls(...))``."""
    return Client(name, options=ClientOptions.of(options, kwargs))
