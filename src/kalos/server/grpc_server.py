"""The sidecar's grpc listener (``kalos serve --grpc ADDR``): the grpc transport's server side.

Two raw-bytes unary methods of ``kalos.v1.Sidecar`` (kalos.transport.grpc; docs/PROTOCOL.md):
``Hello`` answers the handshake with the Unix-socket listener's own negotiation, and ``Call``
serves one request. A request reaches the same dispatcher as shm and uds requests do, under
the same dispatch lock (a uds connection's thread does exactly this), so dispatch is never
concurrent; a logged write is answered once its record is durable, as over uds.

grpcio's thread pool runs the handlers; each pool thread keeps its own request and response
buffers (grown to the largest arena it served) and its own request metrics, so nothing on the
request path is shared between threads but the dispatch lock.

Until the sidecar is ready (recovery done) a ``Hello`` is held for up to ``STARTING_HOLD_S``
and then refused as "starting", and a ``Call`` is answered UNAVAILABLE, as the Unix-socket
listener does. Without TLS the listener must only be reachable from trusted networks: grpc
has no peer-credential check (docs/OPERATIONS.md); ``--grpc-tls-client-ca`` makes it mutual
TLS. A ``unix:`` listener's socket is made private to the sidecar's uid (0600; 0660 and its
group with ``--allow-gid``).
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import TYPE_CHECKING, Any

# Before grpc is imported: its fork handlers off. Snapshots fork a child (kalos.server.
# durability) while grpc's threads run; with the handlers on, that child aborts.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import grpc
import numpy as np

from kalos.errors import ConfigError
from kalos.protocol import layout as L
from kalos.protocol.codes import Status
from kalos.protocol.messages import encode_text
from kalos.server.config import SidecarConfig
from kalos.server.dispatch import batchable
from kalos.server.listener import STARTING_HOLD_S
from kalos.transport.grpc import SERVICE, message_limits

if TYPE_CHECKING:
    from kalos.server.combiner import Combiner
    from kalos.server.durability import Journal
    from kalos.server.request_stats import Metrics, RequestStats

log = logging.getLogger("kalos.server")

# Handler threads. Dispatch is serial (one lock), so more threads only help requests that
# wait outside it: a logged write waiting for its group commit, a message being received.
GRPC_WORKERS = 16
STOP_GRACE_S = 1.0  # calls in flight at stop get this long to finish, then are cancelled

_monotonic_ns = time.monotonic_ns
_REQ = L.GRPC_REQ_FRAME
_RESP = L.RESP_FRAME


class _Buffers(threading.local):
    """One handler thread's request body and response buffers, and its request metrics."""

    body: np.ndarray
    out: np.ndarray
    stats: RequestStats | None

    def __init__(self) -> None:
        self.body = np.zeros(0, np.uint8)
        self.out = np.zeros(_RESP.size, np.uint8)
        self.stats = None


def _server_credentials(config: SidecarConfig) -> grpc.ServerCredentials:
    def read(path: str, what: str) -> bytes:
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read the grpc TLS {what} {path}: {exc.strerror}") from exc

    assert config.grpc_tls_cert is not None and config.grpc_tls_key is not None
    pair = (read(config.grpc_tls_key, "key"), read(config.grpc_tls_cert, "certificate"))
    ca = config.grpc_tls_client_ca
    return grpc.ssl_server_credentials(
        [pair],
        root_certificates=read(ca, "client CA") if ca is not None else None,
        require_client_auth=ca is not None,
    )


class GrpcServer:
    """The grpc listener of one sidecar; :meth:`start`, then :meth:`close` at its stop."""

    def __init__(
        self,
        config: SidecarConfig,
        *,
        handle: Callable[..., tuple[int, int, int, int]],
        lock: threading.Lock,
        negotiate: Callable[..., dict[str, Any]],
        ready: threading.Event,
        journal: Journal | None = None,
        metrics: Metrics | None = None,
        rejected: collections.Counter[str] | None = None,
    ) -> None:
        self.config = config
        self._handle = handle
        self._lock = lock
        self._negotiate = negotiate
        self.ready = ready
        self._journal = journal
        self._metrics = metrics
        self.rejected = rejected if rejected is not None else collections.Counter()
        self.combiner: Combiner | None = None  # batching across handlers, set by the sidecar
        self.connects = 0  # handshakes accepted
        self._local = _Buffers()
        self._all_stats: list[RequestStats] = []
        self._stats_lock = threading.Lock()
        receive, send = message_limits(config.max_arena_bytes)
        self._server = grpc.server(
            futures.ThreadPoolExecutor(GRPC_WORKERS, thread_name_prefix="kalos-grpc"),
            handlers=[
                grpc.method_handlers_generic_handler(
                    SERVICE,
                    {
                        # No (de)serializers: the handlers take and return bytes.
                        "Hello": grpc.unary_unary_rpc_method_handler(self._hello),
                        "Call": grpc.unary_unary_rpc_method_handler(self._call),
                    },
                )
            ],
            options=[
                ("grpc.max_receive_message_length", receive),
                ("grpc.max_send_message_length", send),
                ("grpc.so_reuseport", 0),  # a taken port is an error, not a shared one
            ],
        )
        credentials = _server_credentials(config) if config.grpc_tls_cert is not None else None
        self.addresses: list[str] = []  # as bound: a port 0 replaced by the port taken
        for address in config.grpc:
            self.addresses.append(self._bind(address, credentials))

    def _bind(self, address: str, credentials: grpc.ServerCredentials | None) -> str:
        try:
            if credentials is None:
                port = self._server.add_insecure_port(address)
            else:
                port = self._server.add_secure_port(address, credentials)
        except RuntimeError as exc:
            raise ConfigError(f"cannot listen for grpc on {address}: {exc}") from exc
        if address.startswith("unix:"):
            return address
        if not port:
            raise ConfigError(f"cannot listen for grpc on {address}")
        return f"{address.rsplit(':', 1)[0]}:{port}"

    def start(self) -> GrpcServer:
        self._server.start()
        for address in self.addresses:
            if address.startswith("unix:"):
                path = address[len("unix:") :].removeprefix("//")
                gid = self.config.allowed_gid
                os.chmod(path, 0o660 if gid is not None else 0o600)
                if gid is not None:
                    os.chown(path, -1, gid)
        log.info("grpc listening on %s%s", ", ".join(self.addresses), self._tls_note())
        return self

    def _tls_note(self) -> str:
        if self.config.grpc_tls_client_ca is not None:
            return " (mutual TLS)"
        return " (TLS)" if self.config.grpc_tls_cert is not None else " (no TLS)"

    def close(self) -> None:
        """Stops serving: calls in flight get ``STOP_GRACE_S`` to finish, then fail (the
        clients see SidecarGone)."""
        self._server.stop(STOP_GRACE_S).wait(STOP_GRACE_S + 1)
        for address in self.addresses:
            if address.startswith("unix:"):
                with contextlib.suppress(OSError):
                    os.unlink(address[len("unix:") :].removeprefix("//"))
        if self._metrics is not None:
            with self._stats_lock:
                for rs in self._all_stats:
                    self._metrics.retire(rs)
                self._all_stats.clear()

    # -- handlers ----------------------------------------------------------------------------

    def _hello(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        reply = self._hello_reply(request)
        if reply.get("ok"):
            self.connects += 1
        else:
            self.rejected[reply["error"]] += 1
        return json.dumps(reply, separators=(",", ":")).encode()

    def _hello_reply(self, request: bytes) -> dict[str, Any]:
        try:
            hello = json.loads(request)
        except ValueError:
            hello = None
        if not isinstance(hello, dict):
            return {"ok": False, "error": "bad_hello", "message": "not a Kalos handshake"}
        if not self.ready.wait(STARTING_HOLD_S):
            message = "the sidecar is starting (recovering its data); retry shortly"
            return {"ok": False, "error": "starting", "message": message}
        return self._negotiate(hello, transports=("grpc",))

    def _call(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        picked = _monotonic_ns()
        local = self._local
        seq = op = 0
        try:
            if len(request) < _REQ.size:
                return self._answer(local, 0, 0, Status.INVALID_REQUEST, "malformed request")
            seq, op, flags, body_len, arena = _REQ.unpack_from(request, 0)
            arena = max(L.MIN_ARENA_BYTES, min(arena, self.config.max_arena_bytes))
            if not self.ready.is_set():
                return self._answer(
                    local, seq, op, Status.UNAVAILABLE, "the sidecar is starting; retry shortly"
                )
            if body_len != len(request) - _REQ.size:
                message = f"body_len {body_len} but {len(request) - _REQ.size} body bytes"
                return self._answer(local, seq, op, Status.INVALID_REQUEST, message)
            if body_len > arena:
                if local.stats is not None:
                    local.stats.oversized += 1
                message = f"request body of {body_len} bytes exceeds the arena"
                return self._answer(local, seq, op, Status.PAYLOAD_TOO_LARGE, message)
            return self._dispatch(local, request, seq, op, flags, body_len, arena, picked, context)
        except Exception:  # never a traceback to the client, never a dead handler thread
            log.exception("grpc request failed")
            return self._answer(local, seq, op, Status.SERVER_ERROR, "internal error")

    def _buffers(self, local: _Buffers, body_len: int, arena: int) -> None:
        if len(local.body) < arena:
            local.body = np.zeros(arena, np.uint8)
        if len(local.out) < _RESP.size + arena:
            local.out = np.zeros(_RESP.size + arena, np.uint8)
        if local.stats is None and self._metrics is not None:
            local.stats = self._metrics.stats("grpc")
            with self._stats_lock:
                self._all_stats.append(local.stats)

    def _dispatch(
        self,
        local: _Buffers,
        request: bytes,
        seq: int,
        op: int,
        flags: int,
        body_len: int,
        arena: int,
        picked: int,
        context: grpc.ServicerContext,
    ) -> bytes:
        self._buffers(local, body_len, arena)
        body = local.body[:body_len]
        if body_len:
            body[:] = np.frombuffer(request, np.uint8, body_len, _REQ.size)
        out = local.out
        resp = out[_RESP.size : _RESP.size + arena]  # the client's arena: the same limit as shm
        combiner = self.combiner
        if combiner is not None and batchable(op, flags):  # with other handlers' searches
            left = context.time_remaining()  # None: no deadline
            if left is not None and left <= 0:  # as the shm poller does
                status_b: int = Status.TIMEOUT
                n = encode_text(resp, "the request's deadline passed before it was served")
                compute_ns = write_ns = 0
                queue_ns = _monotonic_ns() - picked
            else:
                (status_b, n, compute_ns, write_ns), started = combiner.call(op, flags, body, resp)
                queue_ns = started - picked if started > picked else 0  # waiting for its batch
            _RESP.pack_into(out, 0, seq, status_b, 0, n, queue_ns, compute_ns, write_ns)
            if local.stats is not None:
                local.stats.record(op, status_b, queue_ns, compute_ns, write_ns)
            return out[: _RESP.size + n].tobytes()
        with self._lock:
            queue_ns = _monotonic_ns() - picked  # waiting for the dispatcher
            left = context.time_remaining()  # None: no deadline
            if left is not None and left <= 0:  # as the shm poller does
                status: int = Status.TIMEOUT
                n = encode_text(resp, "the request's deadline passed before it was served")
                compute_ns = write_ns = 0
                lsn = 0
            else:
                status, n, compute_ns, write_ns = self._handle(op, flags, body, resp)
                lsn = self._journal.last_lsn if self._journal is not None else 0
        if lsn:  # a logged write: answer once its record is durable (group commit)
            assert self._journal is not None
            outcome = self._journal.wait(lsn)
            if outcome is not True:
                status, n = Status.SERVER_ERROR, encode_text(resp, outcome)
        _RESP.pack_into(out, 0, seq, status, 0, n, queue_ns, compute_ns, write_ns)
        data = out[: _RESP.size + n].tobytes()
        if local.stats is not None:
            local.stats.record(op, status, queue_ns, compute_ns, write_ns)
        return data

    def _answer(self, local: _Buffers, seq: int, op: int, status: int, message: str) -> bytes:
        """A response carrying only ``status`` and ``message`` (no dispatch)."""
        out = np.zeros(_RESP.size + 1024, np.uint8)
        n = encode_text(out[_RESP.size :], message)
        _RESP.pack_into(out, 0, seq, status, 0, n, 0, 0, 0)
        if local.stats is not None:
            local.stats.record(op, status, 0, 0, 0)
        return out[: _RESP.size + n].tobytes()
