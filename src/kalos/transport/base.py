"""The one boundary between the client and the bytes: :class:`Transport`.

A transport moves one request body and its response. The client encodes the body straight
into :attr:`Transport.request_buffer` (in the shm transport, that is the channel's request
arena: no copy), then calls :meth:`Transport.request`. The response body it returns is a view
that stays valid until the next request on the same transport. What a handshake lends
beside the channel (the token heap, the session index, GPU buffers) is not the transport's:
:class:`kalos.transport.lent.Lent`.
"""

from __future__ import annotations

import abc
import contextlib
import os
from typing import Any

import numpy as np

from kalos.errors import ClosedError, SidecarGone


class Response:
    """One response: status, body view and the sidecar's per-stage timings (ns)."""

    __slots__ = ("body", "compute_ns", "queue_ns", "status", "write_ns")

    def __init__(
        self, status: int, body: np.ndarray, queue_ns: int, compute_ns: int, write_ns: int
    ) -> None:
        self.status = status
        self.body = body  # uint8 view of body_len bytes; valid until the next request
        self.queue_ns = queue_ns  # client publish → sidecar picked it up
        self.compute_ns = compute_ns  # sidecar dispatch (validation + store/index work)
        self.write_ns = write_ns  # sidecar encoding the response


class Transport(abc.ABC):
    """One channel to a sidecar, used by one thread at a time."""

    kind: str  # "shm", "uds", "inproc"
    request_buffer: np.ndarray  # writable uint8; the next request's body goes here
    server_info: dict[str, Any]  # what the handshake told: dim, metric, max_k, epoch, ...

    @abc.abstractmethod
    def request(self, op: int, flags: int, body_len: int, *, timeout: float) -> Response:
        """Sends the body in ``request_buffer[:body_len]`` and waits for the response (its
        body, and over shm the Response itself, valid until the next request).

        ``timeout`` is in seconds. Raises ClosedError, RequestTimeout, SidecarGone. After a
        timeout or a lost sidecar the transport is broken (``broken`` is True): the caller
        opens a new one.
        """

    def last_sent_ns(self) -> int:
        """When the last request was published (``time.monotonic_ns()``), read back from its
        header; 0 when this transport does not stamp requests. Benchmarks split round trips
        with it (``Client.record_stages``); nothing on the request path pays for it."""
        return 0

    _closed = False  # closed by its owner (close())
    _broken = False  # lost its sidecar, or a request timed out: never carries another

    @property
    def broken(self) -> bool:
        """True once this transport can no longer carry requests."""
        return self._broken or self._closed

    def _refuse(self) -> None:
        """Raises why a closed or broken transport takes no request (call it only then:
        ``if self._closed or self._broken: self._refuse()`` costs the request path nothing)."""
        if self._closed:
            raise ClosedError("this channel is closed")
        raise SidecarGone("this channel lost its sidecar")

    @abc.abstractmethod
    def close(self) -> None:
        """Releases the channel. Idempotent."""

    # The process that opened it (0: not a process's own, as the in-process transport): in a
    # fork's child the channel is the parent's, and is never closed there (``__del__``).
    _pid = 0

    def __del__(self) -> None:
        # A channel dropped without close (its thread ended) still releases its socket and
        # mappings, so the sidecar frees the channel. Not in a fork's child, which drops the
        # parent's channels (Client._forked; the other threads' go before any at-fork hook
        # runs): a close there would shut the parent's socket down. Its own copies of the
        # descriptors and mappings go with the objects.
        if self._pid and self._pid != os.getpid():
            return
        with contextlib.suppress(Exception):
            self.close()
