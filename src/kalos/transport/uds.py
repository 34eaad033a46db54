"""The Unix-socket transport: the fallback where shared memory is not wanted.

Same request and response headers as a channel (layout.REQ_FRAME / RESP_FRAME) followed by the
body, over the handshake connection itself. One blocking send and one or two receives per
request; the body buffers are allocated once.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from typing import Any

import numpy as np

from kalos.errors import ClosedError, RequestTimeout, SidecarGone
from kalos.protocol import layout as L
from kalos.protocol.codes import Status
from kalos.protocol.messages import encode_text
from kalos.transport.base import Response, Transport

_monotonic_ns = time.monotonic_ns


def recv_exactly(sock: socket.socket, view: memoryview) -> None:
    """Fills ``view`` from ``sock``. Raises ConnectionError at EOF."""
    got = 0
    n = len(view)
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k


class UdsTransport(Transport):
    kind = "uds"

    def __init__(self, sock: socket.socket, info: dict[str, Any]) -> None:
        arena = int(info["arena_bytes"])
        self._pid = os.getpid()  # Transport.__del__
        self.server_info = info
        self._sock = sock
        self._out = np.zeros(L.REQ_FRAME.size + arena, np.uint8)
        self._out_view = memoryview(self._out)
        self.request_buffer = self._out[L.REQ_FRAME.size :]
        self._head = np.zeros(L.RESP_FRAME.size, np.uint8)
        self._head_view = memoryview(self._head)
        self._resp = np.zeros(arena, np.uint8)
        self._resp_view = memoryview(self._resp)
        self._seq = 0

    def request(self, op: int, flags: int, body_len: int, *, timeout: float) -> Response:
        if self._closed or self._broken:
            self._refuse()
        if body_len > len(self.request_buffer):
            # The sidecar would answer PAYLOAD_TOO_LARGE and close the stream, which it cannot
            # resynchronise past a body it does not read: answer as it would, keep the stream.
            n = encode_text(self._resp, f"request body of {body_len} bytes exceeds the arena")
            return Response(Status.PAYLOAD_TOO_LARGE, self._resp[:n], 0, 0, 0)
        self._seq += 1
        now = _monotonic_ns()
        L.REQ_FRAME.pack_into(
            self._out, 0, self._seq, op, flags, body_len, now, now + int(timeout * 1e9)
        )
        sock = self._sock
        try:
            sock.settimeout(timeout)
            sock.sendall(self._out_view[: L.REQ_FRAME.size + body_len])
            recv_exactly(sock, self._head_view)
            seq, status, _flags, n, queue_ns, compute_ns, write_ns = L.RESP_FRAME.unpack_from(
                self._head, 0
            )
            if n > len(self._resp) or seq != self._seq:
                raise ConnectionError("malformed response frame")
            if n:
                recv_exactly(sock, self._resp_view[:n])
        except TimeoutError as exc:
            self._broken = True
            raise RequestTimeout("no response from the sidecar within the deadline") from exc
        except OSError as exc:  # ConnectionError included
            self._broken = True
            if self._closed:  # by another thread (Client.close) while this request waited
                raise ClosedError("this channel was closed while a request was in flight") from exc
            raise SidecarGone(f"the sidecar connection failed: {exc}") from exc
        return Response(status, self._resp[:n], queue_ns, compute_ns, write_ns)

    def last_sent_ns(self) -> int:
        return int(L.REQ_FRAME.unpack_from(self._out, 0)[4])

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            with contextlib.suppress(OSError):  # wakes a thread blocked in recv on it
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
