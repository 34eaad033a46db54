"""The in-process transport: a dispatcher called directly, for tests and embedding.

It runs the same request bytes through the same dispatcher as the sidecar does, so a client
test over ``inproc`` exercises every encoder and decoder without processes or sockets.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import numpy as np

from kalos.protocol import layout as L
from kalos.transport.base import Response, Transport


class Handler(Protocol):
    """What the in-process transport calls: the sidecar's dispatcher satisfies it."""

    def info(self) -> dict[str, Any]: ...

    def handle(
        self, op: int, flags: int, body: np.ndarray, out: np.ndarray
    ) -> tuple[int, int, int, int]:
        """Returns (status, response body length, compute ns, write ns)."""
        ...


class InprocTransport(Transport):
    kind = "inproc"

    def __init__(
        self, handler: Handler, lock: threading.Lock, arena_bytes: int = L.DEFAULT_ARENA_BYTES
    ) -> None:
        self._handler = handler
        self._lock = lock  # the handler is used by one thread at a time, as in the sidecar
        self.server_info = dict(handler.info(), arena_bytes=arena_bytes)
        self.request_buffer = np.zeros(arena_bytes, np.uint8)
        self._resp = np.zeros(arena_bytes, np.uint8)

    def request(self, op: int, flags: int, body_len: int, *, timeout: float) -> Response:
        if self._closed:
            self._refuse()
        with self._lock:
            status, n, compute_ns, write_ns = self._handler.handle(
                op, flags, self.request_buffer[:body_len], self._resp
            )
        return Response(status, self._resp[:n], 0, compute_ns, write_ns)

    def close(self) -> None:
        self._closed = True
