"""The client: what an inference service calls.

``kalos.connect(name)`` returns a :class:`Client`. Each thread that uses it gets its own
channel (single producer, single consumer: no locks on the hot path), opened on first use.
Search results are numpy views into that channel's response arena, valid until the same
thread's next call on this client; ``copy=True`` returns owned arrays. Every call has a
deadline (``timeout``, seconds) and reports the sidecar's per-stage timings in µs.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from kalos.errors import ClosedError, InvalidRequest, PayloadTooLarge
from kalos.protocol import codes
from kalos.protocol import layout as L
from kalos.protocol import messages as M
from kalos.protocol.codes import Op, error_for_status
from kalos.protocol.messages import Scope
from kalos.transport import Transport, open_transport
from kalos.transport.base import Response

_monotonic_ns = time.monotonic_ns

Payload = str | bytes | None


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
    """

    ids: np.ndarray
    scores: np.ndarray
    payloads: list[Payload] | None
    timings: Timings


def _timings(resp: Response, start_ns: int) -> Timings:
    return Timings(
        resp.queue_ns / 1e3,
        resp.compute_ns / 1e3,
        resp.write_ns / 1e3,
        (_monotonic_ns() - start_ns) / 1e3,
    )


class Client:
    """A connection to one sidecar, safe to share between threads (one channel per thread).

    ``transport``: "shm" (default) or "uds". ``timeout``: the default deadline of a call, in
    seconds. ``spin_us``: how long a caller spins for a response before parking (spinning
    pays when the sidecar has its own core; parking costs a ~25 µs futex wake).
    """

    def __init__(
        self,
        name: str,
        *,
        transport: str = "shm",
        timeout: float = 5.0,
        runtime_dir: str | None = None,
        arena_bytes: int = L.DEFAULT_ARENA_BYTES,
        spin_us: float = 50.0,
        connector: Callable[[], Transport] | None = None,
    ) -> None:
        self.name = name
        self.timeout = timeout
        if connector is None:

            def connector() -> Transport:
                return open_transport(
                    transport,
                    name,
                    runtime_dir=runtime_dir,
                    arena_bytes=arena_bytes,
                    timeout=timeout,
                    spin_us=spin_us,
                )

        self._connector = connector
        self._local = threading.local()
        self._transports: list[Transport] = []
        self._lock = threading.Lock()
        self._closed = False
        self._channel()  # connect now: fail fast when no sidecar runs

    # -- channels ----------------------------------------------------------------------------

    def _channel(self) -> Transport:
        t: Transport | None = getattr(self._local, "transport", None)
        if t is not None and not t.broken:
            return t
        if self._closed:
            raise ClosedError("this client is closed")
        if t is not None:
            self._forget(t)
        t = self._connector()
        self._local.transport = t
        with self._lock:
            self._transports.append(t)
        return t

    def _forget(self, t: Transport) -> None:
        t.close()
        with self._lock:
            if t in self._transports:
                self._transports.remove(t)

    @property
    def info(self) -> dict:
        """What the sidecar said at the handshake: dim, metric, max_k, index, version, ..."""
        return self._channel().server_info

    @property
    def dim(self) -> int:
        return int(self.info["dim"])

    @property
    def last_timings(self) -> Timings | None:
        """Timings of this thread's last completed call."""
        return getattr(self._local, "timings", None)

    def _call(self, t: Transport, op: int, flags: int, n: int, timeout: float | None, start: int):
        resp = t.request(op, flags, n, timeout=self.timeout if timeout is None else timeout)
        self._local.timings = _timings(resp, start)
        if resp.status != codes.Status.OK:
            raise error_for_status(resp.status, M.decode_text(resp.body, len(resp.body)))
        return resp

    # -- operations --------------------------------------------------------------------------

    def ping(self, *, timeout: float | None = None) -> Timings:
        """An empty round trip; returns its timings."""
        start = _monotonic_ns()
        self._call(self._channel(), Op.PING, 0, 0, timeout, start)
        return self._local.timings

    def stats(self, *, timeout: float | None = None) -> dict:
        """The sidecar's counters: items, bytes, requests per op, errors, channels, uptime."""
        start = _monotonic_ns()
        resp = self._call(self._channel(), Op.STATS, 0, 0, timeout, start)
        return json.loads(M.decode_text(resp.body, len(resp.body)))

    def search(
        self,
        query: np.ndarray,
        k: int = 10,
        *,
        scope: Scope | None = None,
        payloads: bool = True,
        copy: bool = False,
        timeout: float | None = None,
    ) -> SearchResult:
        """Exact top-``k`` memories for ``query`` ([dim] or [nq, dim], float32 or float16).

        ``scope`` filters: an item matches when each field given equals the item's field.
        Scores: inner product or cosine similarity (descending), or squared L2 distance
        (ascending), by the sidecar's metric. Raises InvalidRequest for a wrong dimension,
        NaN or inf, or k outside 1..max_k.
        """
        start = _monotonic_ns()
        t = self._channel()
        q = np.asarray(query)
        single = q.ndim == 1
        if single:
            q = q[None, :]
        if q.ndim != 2 or q.shape[1] != self.dim:
            raise InvalidRequest(
                f"the query has shape {np.shape(query)}; this sidecar's vectors have dimension "
                f"{self.dim}"
            )
        if q.dtype != np.float16 and q.dtype != np.float32:
            q = q.astype(np.float32)
        if not 1 <= k <= codes.MAX_K:
            raise InvalidRequest(f"k must be between 1 and {codes.MAX_K}, got {k}")
        sb = scope_bytes(scope)
        n = M.encode_search(t.request_buffer, np.ascontiguousarray(q), k, sb)
        flags = codes.SEARCH_WANT_PAYLOADS if payloads else 0
        resp = self._call(t, Op.SEARCH, flags, n, timeout, start)
        r = M.decode_search_response(resp.body, len(resp.body))
        ids, scores = (r.ids[0], r.scores[0]) if single else (r.ids, r.scores)
        if copy:
            ids, scores = ids.copy(), scores.copy()
        return SearchResult(ids, scores, r.payloads, self._local.timings)

    def add(
        self,
        vectors: np.ndarray,
        ids: np.ndarray | Sequence[int] | int,
        payloads: Sequence[Payload] | Payload = None,
        *,
        scope: Scope | None = None,
        timeout: float | None = None,
    ) -> int:
        """Adds (upserts) items; returns how many were new (the rest replaced existing ids).

        ``vectors``: [n, dim] (or [dim] for one item); ``ids``: n int64 ids of your choosing
        (not -1); ``payloads``: n texts or bytes (or None). Every item gets ``scope``. Batches
        larger than the channel arena are sent in chunks, each acknowledged on its own: if a
        chunk fails, the chunks before it stay added.
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
        id_arr = np.atleast_1d(np.asarray(ids, dtype=np.int64))
        n = len(v)
        if id_arr.shape != (n,):
            raise InvalidRequest(f"{len(id_arr)} ids for {n} vectors")
        kinds, blobs = _encode_payloads(payloads, n)
        if n == 0:
            return 0
        sb = scope_bytes(scope)
        t = self._channel()
        capacity = len(t.request_buffer)
        fixed, per_item = M.add_item_sizes(
            self.dim, v.itemsize, np.fromiter(map(len, blobs), np.int64, n), sb
        )
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
            t = self._channel()
            size = M.encode_add(t.request_buffer, id_arr[i:j], v[i:j], kinds[i:j], blobs[i:j], sb)
            resp = self._call(t, Op.ADD, 0, size, timeout, start)
            added += M.decode_counts(resp.body, len(resp.body))[0]
            i = j
        return added

    def remove(self, ids: np.ndarray | Sequence[int] | int, *, timeout: float | None = None) -> int:
        """Removes items by id; returns how many existed. Unknown ids are ignored."""
        id_arr = np.atleast_1d(np.asarray(ids, dtype=np.int64))
        removed = 0
        t = self._channel()
        step = (len(t.request_buffer) - 8) // 8
        for i in range(0, max(len(id_arr), 1), step):
            start = _monotonic_ns()
            t = self._channel()
            size = M.encode_remove(t.request_buffer, id_arr[i : i + step])
            resp = self._call(t, Op.REMOVE, 0, size, timeout, start)
            removed += M.decode_counts(resp.body, len(resp.body))[0]
        return removed

    def close(self) -> None:
        """Closes every thread's channel. Idempotent; later calls raise ClosedError."""
        self._closed = True
        with self._lock:
            transports, self._transports = self._transports, []
        for t in transports:
            t.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def scope_bytes(scope: Scope | None) -> M.ScopeBytes:
    if scope is None:
        return M.EMPTY_SCOPE
    if not isinstance(scope, Scope):
        raise InvalidRequest("scope must be a kalos.Scope(tenant, user, session)")
    return M.encode_scope_fields(scope)


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
    name: str,
    *,
    transport: str = "shm",
    timeout: float = 5.0,
    runtime_dir: str | None = None,
    arena_bytes: int = L.DEFAULT_ARENA_BYTES,
    spin_us: float = 50.0,
) -> Client:
    """Connects to the running sidecar ``name``. Raises ConnectError when none runs."""
    return Client(
        name,
        transport=transport,
        timeout=timeout,
        runtime_dir=runtime_dir,
        arena_bytes=arena_bytes,
        spin_us=spin_us,
    )
