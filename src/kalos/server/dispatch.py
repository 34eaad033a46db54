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
from collections.abc import Callable
from typing import Any

import numpy as np

from kalos import __version__
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

log = logging.getLogger("kalos.server")

_monotonic_ns = time.monotonic_ns

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
WRITE_OPS: frozenset[int] = frozenset({Op.ADD, Op.REMOVE})


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
    ) -> None:
        self.memories = memories
        self.name = name
        self.device = device
        self.metric = memories.index.metric
        self.started = time.time()
        self.requests = [0] * (max(Op) + 1)  # by op code
        self.now_ns = 0  # wall-clock time of the request being handled (see handle)
        self.errors = 0
        self._extra_stats = extra_stats
        self._ops: dict[int, Callable[[int, np.ndarray, np.ndarray], tuple[int, int]]] = {
            Op.PING: self._ping,
            Op.STATS: self._stats,
            Op.ADD: self._add,
            Op.REMOVE: self._remove,
            Op.SEARCH: self._search,
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
        self, op: int, flags: int, body: np.ndarray, out: np.ndarray, now_ns: int | None = None
    ) -> tuple[int, int, int, int]:
        """Runs one request. Returns (status, response length, compute ns, write ns).

        ``now_ns``: the request's wall-clock time (ns since the epoch), default the clock now;
        recovery passes the logged time. Ops read it from :attr:`now_ns`, never the clock.
        """
        t0 = _monotonic_ns()
        self.now_ns = time.time_ns() if now_ns is None else now_ns
        fn = self._ops.get(op)
        try:
            if fn is None:
                self.errors += 1
                n = M.encode_text(out, f"unknown op {op}")
                return Status.UNKNOWN_OP, n, _monotonic_ns() - t0, 0
            self.requests[op] += 1
            n, write_ns = fn(flags, body, out)
            return Status.OK, n, _monotonic_ns() - t0 - write_ns, write_ns
        except KalosError as exc:
            self.errors += 1
            n = M.encode_text(out, str(exc))
            return status_for(exc), n, _monotonic_ns() - t0, 0
        except Exception as exc:  # a bug: report it, keep serving
            self.errors += 1
            log.exception("op %s failed", op)
            n = M.encode_text(out, f"internal error: {type(exc).__name__}: {exc}")
            return Status.SERVER_ERROR, n, _monotonic_ns() - t0, 0

    # Each op returns (response length, ns spent encoding the response).

    def _ping(self, flags: int, body: np.ndarray, out: np.ndarray) -> tuple[int, int]:
        return 0, 0

    def _stats(self, flags: int, body: np.ndarray, out: np.ndarray) -> tuple[int, int]:
        stats: dict[str, Any] = dict(self.info())
        stats.update(self.memories.stats())
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
        return n, _monotonic_ns() - t

    def _add(self, flags: int, body: np.ndarray, out: np.ndarray) -> tuple[int, int]:
        req = M.decode_add(body, len(body))
        added, replaced = self.memories.add(
            req.ids, req.vectors, req.kinds, req.offsets, req.blob, req.scope
        )
        return M.encode_counts(out, added, replaced), 0

    def _remove(self, flags: int, body: np.ndarray, out: np.ndarray) -> tuple[int, int]:
        ids = M.decode_remove(body, len(body))
        removed = self.memories.remove(ids)
        return M.encode_counts(out, removed), 0

    def _search(self, flags: int, body: np.ndarray, out: np.ndarray) -> tuple[int, int]:
        req = M.decode_search(body, len(body))
        scores, ids = self.memories.search(req.queries, req.k, req.scope)
        t = _monotonic_ns()
        payloads = self.memories.payloads(ids) if flags & codes.SEARCH_WANT_PAYLOADS else None
        n = M.encode_search_response(out, scores, ids, payloads)
        return n, _monotonic_ns() - t
