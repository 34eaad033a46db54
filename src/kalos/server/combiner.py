"""Dynamic batching for the transports that serve each request on a thread of its own (uds
connections, grpc handlers): flat combining around the dispatch lock.

A thread with a batchable request (kalos.server.dispatch.batchable) puts it on a list, then
takes the dispatch lock. Whoever holds the lock serves every request on the list (up to
``batch_max``) as one batch (Dispatcher.handle_batch) and hands each its result; a thread
that finds its own result set once it holds the lock returns it at once. No thread waits on
anything but the lock, so no request is lost: one left off a full batch is served on its own
thread's turn. The shm poller (kalos.server.channels) batches its channels apart, under the
same lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kalos.protocol.codes import Status
from kalos.protocol.messages import encode_text

log = logging.getLogger("kalos.server")

_monotonic_ns = time.monotonic_ns


class Combiner:
    """Batches the searches and recalls of threads that would each take the dispatch lock."""

    def __init__(
        self,
        lock: threading.Lock,
        handle: Callable[..., tuple[int, int, int, int]],
        handle_batch: Callable[..., list[tuple[int, int, int, int]]],
        batch_max: int,
    ) -> None:
        self._lock = lock
        self._handle = handle  # Dispatcher.handle (or Durability.handle)
        self._handle_batch = handle_batch  # Dispatcher.handle_batch
        self._max = max(1, batch_max)
        self._mutex = threading.Lock()  # guards _waiting alone: held for a list operation
        # each waiting request: [op, flags, body, out, result or None, served at (ns)]
        self._waiting: list[list[Any]] = []
        self.batches = 0  # batches of two or more served
        self.batched = 0

    def call(
        self, op: int, flags: int, body: Any, out: Any
    ) -> tuple[tuple[int, int, int, int], int]:
        """Serves one request, in a batch with whatever else waits: ((status, response
        length, compute ns, write ns), the monotonic ns its batch began)."""
        mine: list[Any] = [op, flags, body, out, None, 0]
        with self._mutex:
            self._waiting.append(mine)
        lock = self._lock
        while True:
            lock.acquire()
            try:
                if mine[4] is None:
                    with self._mutex:
                        batch = self._waiting[: self._max]
                        del self._waiting[: self._max]
                    self._serve(batch)
            finally:
                lock.release()
            if mine[4] is not None:
                return mine[4], mine[5]

    def _serve(self, batch: list[list[Any]]) -> None:
        """Answers ``batch`` (under the lock); every member gets a result, whatever fails."""
        started = _monotonic_ns()
        for m in batch:
            m[5] = started
        try:
            if len(batch) == 1:
                m = batch[0]
                m[4] = self._handle(m[0], m[1], m[2], m[3])
                return
            results = self._handle_batch([(m[0], m[1], m[2], m[3]) for m in batch])
            self.batches += 1
            self.batched += len(batch)
        except Exception:  # a bug in the batch path: each alone, so it fails only itself
            log.exception("a batch of %d failed; serving each alone", len(batch))
            results = []
            for m in batch:
                try:
                    results.append(self._handle(m[0], m[1], m[2], m[3]))
                except Exception as exc:
                    n = encode_text(m[3], f"internal error: {type(exc).__name__}: {exc}")
                    results.append((int(Status.SERVER_ERROR), n, 0, 0))
        for m, result in zip(batch, results, strict=True):
            m[4] = result
