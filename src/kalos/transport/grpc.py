"""The grpc transport: for clients on other hosts, and the baseline the shm transport is
measured against (``kalos bench transport``).

It carries the same request (op, flags, body) and response (status, flags, body, per-stage
timings) as a shm channel, as raw bytes through grpcio's generic API: no protobuf, no
generated code. Two unary methods of the service ``kalos.v1.Sidecar``:

- ``Hello``: the handshake, the same JSON message and reply as over the Unix socket
  (version negotiation, the sidecar's dim, metric, epoch, the arena size).
- ``Call``: one request, ``GRPC_REQ_FRAME`` (seq, op, flags, body_len, response limit) then
  the body; the reply is ``RESP_FRAME`` then the response body (docs/PROTOCOL.md).

Each transport (one per client thread) has its own grpc channel and connection. A call's
deadline is the grpc call's timeout. Failures raise what the other transports raise, so the
client's degrade and reconnect policies work unchanged: no sidecar at the target, or a
refused handshake, is ConnectError (ProtocolMismatch for another major version); a sidecar
that dies or stops during a call is SidecarGone; a call past its deadline (a hung sidecar
too) is RequestTimeout. Either breaks the transport; the client opens a new one.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from kalos.errors import ClosedError, ConfigError, ConnectError, RequestTimeout, SidecarGone
from kalos.protocol import layout as L
from kalos.protocol.codes import Status
from kalos.protocol.messages import encode_text
from kalos.transport.base import Response, Transport
from kalos.transport.handshake import hello_message, refused
from kalos.transport.tls import Tls

SERVICE = "kalos.v1.Sidecar"
CALL = f"/{SERVICE}/Call"
HELLO = f"/{SERVICE}/Hello"

_monotonic_ns = time.monotonic_ns
_REQ = L.GRPC_REQ_FRAME
_RESP = L.RESP_FRAME


def message_limits(arena_bytes: int) -> tuple[int, int]:
    """The largest request and response messages (bytes) for an arena of ``arena_bytes``."""
    return _REQ.size + arena_bytes, _RESP.size + arena_bytes


def channel_options(arena_bytes: int, tls: Tls | None = None) -> list[tuple[str, Any]]:
    send, receive = message_limits(arena_bytes)
    options: list[tuple[str, Any]] = [
        ("grpc.max_send_message_length", send),
        ("grpc.max_receive_message_length", receive),
        # Its own connection: channels to one target otherwise share a subchannel, and one
        # in reconnect backoff after a sidecar restart would fail the new channel's calls.
        ("grpc.use_local_subchannel_pool", 1),
        # A write is never resent behind the client's back (it may have been applied).
        ("grpc.enable_retries", 0),
    ]
    if tls is not None and tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return options


def _read(path: object, what: str) -> bytes:
    try:
        return Path(str(path)).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read the TLS {what} {path}: {exc.strerror}") from exc


def channel_credentials(tls: Tls) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=_read(tls.ca, "CA certificate") if tls.ca is not None else None,
        private_key=_read(tls.key, "key") if tls.key is not None else None,
        certificate_chain=_read(tls.cert, "certificate") if tls.cert is not None else None,
    )


def open_grpc(target: str, *, arena_bytes: int, timeout: float, tls: Tls | None) -> GrpcTransport:
    """Connects to the sidecar's grpc listener at ``target`` and handshakes (Hello).

    Raises ConnectError (nothing answers, TLS fails, the sidecar refuses or is starting),
    ProtocolMismatch, ConfigError (unreadable TLS files).
    """
    if not isinstance(target, str) or not target:
        raise ConfigError(f"a grpc target is host:port or unix:/path, not {target!r}")
    options = channel_options(arena_bytes, tls)
    if tls is None:
        channel = grpc.insecure_channel(target, options=options)
    else:
        channel = grpc.secure_channel(target, channel_credentials(tls), options=options)
    try:
        hello = channel.unary_unary(HELLO)
        message = json.dumps(hello_message("grpc", arena_bytes), separators=(",", ":")).encode()
        try:
            data = hello(message, timeout=timeout)
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            if code == grpc.StatusCode.UNIMPLEMENTED:
                raise ConnectError(f"{target} is not a Kalos sidecar (no {HELLO})") from exc
            raise ConnectError(
                f"no Kalos sidecar answers at {target}: {getattr(code, 'name', code)}: {details}"
            ) from exc
        try:
            reply = json.loads(data)
        except ValueError as exc:
            raise ConnectError(f"malformed handshake reply from {target}") from exc
        if not isinstance(reply, dict):
            raise ConnectError(f"malformed handshake reply from {target}")
        if not reply.get("ok"):
            refused(reply)
        return GrpcTransport(channel, target, reply)
    except BaseException:
        channel.close()
        raise


class GrpcTransport(Transport):
    kind = "grpc"

    def __init__(self, channel: grpc.Channel, target: str, info: dict[str, Any]) -> None:
        arena = int(info["arena_bytes"])
        self._pid = os.getpid()  # Transport.__del__
        self.server_info = info
        self.target = target
        self._channel = channel
        self._call = channel.unary_unary(CALL)  # bytes in, bytes out: no (de)serializers
        self._arena = arena
        self._out = np.zeros(_REQ.size + arena, np.uint8)
        self.request_buffer = self._out[_REQ.size :]
        self._resp = np.zeros(arena, np.uint8)
        self._seq = 0

    def request(self, op: int, flags: int, body_len: int, *, timeout: float) -> Response:
        if self._closed or self._broken:
            self._refuse()
        if body_len > len(self.request_buffer):
            # What the sidecar would answer, without sending a message over its limit.
            n = encode_text(self._resp, f"request body of {body_len} bytes exceeds the arena")
            return Response(Status.PAYLOAD_TOO_LARGE, self._resp[:n], 0, 0, 0)
        self._seq += 1
        _REQ.pack_into(self._out, 0, self._seq, op, flags, body_len, self._arena)
        try:
            data = self._call(self._out[: _REQ.size + body_len].tobytes(), timeout=timeout)
        except grpc.RpcError as exc:
            return self._failed(exc)
        if len(data) < _RESP.size:
            self._broken = True
            raise SidecarGone("malformed response from the sidecar")
        seq, status, _flags, n, queue_ns, compute_ns, write_ns = _RESP.unpack_from(data, 0)
        if seq != self._seq or n != len(data) - _RESP.size or n > self._arena:
            self._broken = True
            raise SidecarGone("malformed response from the sidecar")
        if n:
            self._resp[:n] = np.frombuffer(data, np.uint8, n, _RESP.size)
        return Response(status, self._resp[:n], queue_ns, compute_ns, write_ns)

    def _failed(self, exc: grpc.RpcError) -> Response:
        """Turns a failed call into the transport's exceptions (or a status response)."""
        code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.UNKNOWN
        details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # a message over a size limit
            n = encode_text(self._resp, f"grpc refused the message: {details}")
            return Response(Status.PAYLOAD_TOO_LARGE, self._resp[:n], 0, 0, 0)
        self._broken = True
        if self._closed:  # by another thread (Client.close) while this request waited
            raise ClosedError("this channel was closed while a request was in flight") from exc
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise RequestTimeout("no response from the sidecar within the deadline") from exc
        raise SidecarGone(f"the sidecar connection failed: {code.name}: {details}") from exc

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._channel.close()  # cancels a call in flight in another thread
