"""The handshake listener: accepts clients on the Unix socket and gives each a channel.

Each accepted connection gets its own thread: it checks the peer's credentials
(SO_PEERCRED), negotiates the protocol version and then either hands over a shm channel (and
waits for the connection to close, which frees the channel) or serves uds frames itself.

The socket listens from the start, but until the sidecar is ready (recovery done) a
handshake is held for up to ``STARTING_HOLD_S`` and then refused with the error "starting":
a short recovery is invisible to clients, a long one is reported, never served half-done.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import itertools
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from kalos.protocol import layout as L
from kalos.protocol.codes import PROTOCOL_VERSION, Status
from kalos.protocol.messages import encode_text
from kalos.server.channels import Poller, ServerChannel
from kalos.server.dispatch import batchable

if TYPE_CHECKING:
    from kalos.server.combiner import Combiner
    from kalos.server.gpu_search import GpuSearch
from kalos.server.config import SidecarConfig
from kalos.transport.handshake import recv_message, send_message
from kalos.transport.uds import recv_exactly

if TYPE_CHECKING:
    from kalos.server.durability import Journal
    from kalos.server.request_stats import Metrics, RequestStats
    from kalos.stores.session_index import SessionIndex
    from kalos.stores.token_heap import TokenHeap

log = logging.getLogger("kalos.server")

HANDSHAKE_TIMEOUT_S = 5.0
STARTING_HOLD_S = 2.0  # below the client's default 5 s deadline
# After a failed accept (out of descriptors or memory): the pause before the next; and the
# least time between two warnings of a failure for want of room (accepting, or a channel)
ACCEPT_RETRY_S = 0.05
ACCEPT_WARN_EVERY_S = 10.0
_PEERCRED = struct.Struct("3i")


def socket_mode(config: SidecarConfig) -> int:
    """The socket file's mode: the sidecar's uid only (0600), its allowed group too (0660),
    or anyone when other uids are allowed (0666): then the file mode cannot tell uids apart,
    and the SO_PEERCRED check at accept is the gate."""
    if config.allowed_uids:
        return 0o666
    return 0o660 if config.allowed_gid is not None else 0o600


class Listener:
    def __init__(
        self,
        config: SidecarConfig,
        path: str,
        control_fd: int,
        epoch: int,
        poller: Poller,
        handle: Callable[..., tuple[int, int, int, int]],
        lock: threading.Lock,
        info: Callable[[], dict[str, Any]],
        journal: Journal | None = None,
    ) -> None:
        self.config = config
        self.path = path
        self._control_fd = control_fd
        self._epoch = epoch
        self._poller = poller
        self._handle = handle
        self._lock = lock
        self._info = info
        self.gpu: GpuSearch | None = None  # set by the sidecar on a cuda index
        self.combiner: Combiner | None = None  # batching across connections, set by the sidecar
        self.heap: TokenHeap | None = None  # the token heap, set by the sidecar when it has one
        self.session_index: SessionIndex | None = None  # likewise (it needs the heap)
        self._journal = journal
        self.ready = threading.Event()  # set once recovery is done
        self._ids = itertools.count(1)
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self.connects = 0
        self.refused = 0
        self.uds_connections = 0
        self.disconnects = 0  # accepted connections that ended
        self.rejected: collections.Counter[str] = collections.Counter()  # handshakes, by error
        self.accept_errors = 0  # accepts that failed (the listener went on)
        self._closing = False
        self._warned = -ACCEPT_WARN_EVERY_S  # when _warn_out_of_room last logged
        self.metrics: Metrics | None = None  # request metrics (kalos.server.admin), if served
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        os.chmod(path, socket_mode(config))
        if config.allowed_gid is not None:
            os.chown(path, -1, config.allowed_gid)
        self._sock.listen(128)
        self._thread = threading.Thread(
            target=self._accept_loop, name="kalos-listener", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stops accepting and disconnects every client (they see EOF: SidecarGone)."""
        self._closing = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with self._conns_lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=2)

    def _warn_out_of_room(self, message: str, *args: object) -> None:
        """Logs a failure for want of descriptors or memory, at most once a while: a client
        retrying in a loop would otherwise flood the log."""
        now = time.monotonic()
        if now - self._warned >= ACCEPT_WARN_EVERY_S:
            self._warned = now
            log.warning(message, *args)

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError as exc:
                if self._closing:
                    return
                # Out of descriptors (EMFILE) or memory, or a connection that went away
                # before it was accepted: the listener goes on, or no client could ever
                # connect again; the connections waiting are accepted once there is room.
                self.accept_errors += 1
                files = exc.errno in (errno.EMFILE, errno.ENFILE)
                hint = "; raise the open-file limit (ulimit -n, LimitNOFILE)" if files else ""
                self._warn_out_of_room("accepting a connection failed (%s): retrying%s", exc, hint)
                time.sleep(ACCEPT_RETRY_S)
                continue
            try:
                threading.Thread(
                    target=self._serve_connection, args=(conn,), name="kalos-conn", daemon=True
                ).start()
            except RuntimeError as exc:  # no thread to be had (a pids limit): this client
                conn.close()  # sees the connection end, and the listener goes on
                self.accept_errors += 1
                self._warn_out_of_room("could not start a connection's thread: %s", exc)

    def _serve_connection(self, conn: socket.socket) -> None:
        with self._conns_lock:
            self._conns.add(conn)
        try:
            self._handshake_and_serve(conn)
        except (OSError, ConnectionError) as exc:
            log.debug("connection ended: %s", exc)
        except Exception:
            log.exception("connection failed")
        finally:
            with self._conns_lock:
                self._conns.discard(conn)
            conn.close()

    def _handshake_and_serve(self, conn: socket.socket) -> None:
        pid, uid, gid = _PEERCRED.unpack(
            conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        )
        if not self.config.peer_allowed(uid, gid):
            self.refused += 1
            log.warning("refused a client: pid %d uid %d gid %d", pid, uid, gid)
            send_message(
                conn,
                {"ok": False, "error": "refused", "message": f"uid {uid} may not use this sidecar"},
            )
            return
        conn.settimeout(HANDSHAKE_TIMEOUT_S)
        hello, fds = recv_message(conn)
        for fd in fds:
            os.close(fd)
        if not self.ready.wait(STARTING_HOLD_S):
            message = "the sidecar is starting (recovering its data); retry shortly"
            self.rejected["starting"] += 1
            send_message(conn, {"ok": False, "error": "starting", "message": message})
            return
        reply = self.negotiate(hello)
        if not reply["ok"]:
            self.rejected[reply["error"]] += 1
            send_message(conn, reply)
            return
        self.connects += 1
        conn.settimeout(None)
        if hello.get("transport") == "uds":
            send_message(conn, reply)
            with self._conns_lock:  # counts against max_channels: no update may be lost
                self.uds_connections += 1
            stats = self.metrics.stats("uds") if self.metrics is not None else None
            try:
                self._serve_uds(conn, reply["arena_bytes"], stats)
            finally:
                with self._conns_lock:
                    self.uds_connections -= 1
                self.disconnects += 1
                if stats is not None and self.metrics is not None:
                    self.metrics.retire(stats)
            return
        try:
            ch = ServerChannel(next(self._ids), self._epoch, reply["arena_bytes"])
        except OSError as exc:  # out of descriptors (memfd_create) or of memory
            self.rejected["resources"] += 1
            self._warn_out_of_room("could not open a channel: %s (refused the client)", exc)
            message = (
                f"the sidecar could not open a channel: {exc.strerror}; raise its open-file "
                "limit (ulimit -n) or lower --max-channels"
            )
            send_message(conn, {"ok": False, "error": "resources", "message": message})
            return
        reply["channel_id"] = ch.id
        reply["gpu"] = None
        served = False
        try:
            if self.gpu is not None:
                with self._lock:  # CUDA work stays serialised with dispatch
                    ch.pinned = self.gpu.pin(
                        ch.resp_arena, ch.buf[: L.CHANNEL_HEADER_SIZE], ch.req_arena
                    )
                    try:
                        self.gpu.prepare(ch.pinned, ch.resp_arena)
                    except Exception as exc:  # the channel still serves: graphs on first use
                        log.warning(
                            "channel %d: its search graphs are captured on first use "
                            "instead: %s: %s", ch.id, type(exc).__name__, exc,
                        )  # fmt: skip
                    if hello.get("gpu_results"):
                        ch.gpu = self.gpu.new_result_buffer()
                if ch.gpu is not None:
                    reply["gpu"] = ch.gpu.describe()
            fds = [self._control_fd, ch.fd]
            heap = self.heap
            # The token heap goes to clients that ask (1.2): older ones expect two descriptors.
            minor = reply["protocol"][1]
            if heap is not None and hello.get("token_heap") is True and minor >= 2:
                reply["token_heap"] = {"bytes": heap.nbytes}
                fds.append(heap.reader_fd())
                heap.attach(ch)  # before the poller can serve the channel
                ch.reader = ch
                index = self.session_index
                # The session index (1.4), to clients that ask, after the heap's descriptor.
                if index is not None and hello.get("session_index") is True and minor >= 4:
                    reply["session_index"] = {"bytes": index.nbytes}
                    fds.append(index.reader_fd())
            send_message(conn, reply, fds)
            os.close(ch.fd)
            ch.fd = -1
            self._poller.add(ch)
            served = True
            while conn.recv(4096):  # the client never writes after the handshake
                pass
        finally:
            if ch.fd >= 0:
                os.close(ch.fd)
            if served:
                self._poller.remove(ch)
                self.disconnects += 1
            if ch.reader is not None and self.heap is not None:
                self.heap.detach(ch)  # its views are gone with it: it pins nothing now
            # ``reader`` is the channel itself: a cycle, which would keep its segment
            # mapped (and a descriptor of it open) until the next full garbage collection
            ch.reader = None
            self._release_gpu(ch)

    def _release_gpu(self, ch: ServerChannel) -> None:
        """Frees a closed channel's GPU result buffer and unregisters its response arena,
        under the dispatch lock: a request the poller was still serving on it has finished,
        and a later one sees neither."""
        if ch.gpu is None and ch.pinned is None:
            return
        with self._lock:
            gpu, pinned = ch.gpu, ch.pinned
            ch.gpu = ch.pinned = None
            if gpu is not None:
                gpu.free()
            if pinned is not None:
                assert self.gpu is not None
                self.gpu.unpin(pinned)

    def negotiate(
        self, hello: dict[str, Any], transports: tuple[str, ...] = ("shm", "uds")
    ) -> dict[str, Any]:
        """The reply to a client's handshake ``hello`` asking for one of ``transports``."""
        major, minor = PROTOCOL_VERSION
        theirs = hello.get("protocol")
        if (
            hello.get("magic") != "KALO"
            or not isinstance(theirs, list)
            or len(theirs) != 2
            or not all(isinstance(v, int) for v in theirs)
        ):
            return {"ok": False, "error": "bad_hello", "message": "not a Kalos handshake"}
        if theirs[0] != major:
            message = f"sidecar speaks {major}.{minor}, client {theirs[0]}.{theirs[1]}"
            return {
                "ok": False,
                "error": "protocol_mismatch",
                "protocol": [major, minor],
                "message": message,
            }
        if hello.get("transport") not in transports:
            return {
                "ok": False,
                "error": "bad_transport",
                "message": f"transport must be {' or '.join(transports)}",
            }
        if len(self._poller.channels) + self.uds_connections >= self.config.max_channels:
            return {
                "ok": False,
                "error": "busy",
                "message": f"too many channels (max_channels {self.config.max_channels})",
            }
        try:
            arena = int(hello.get("arena_bytes", L.DEFAULT_ARENA_BYTES))
        except (TypeError, ValueError):
            arena = L.DEFAULT_ARENA_BYTES
        arena = max(L.MIN_ARENA_BYTES, min(arena, self.config.max_arena_bytes))
        arena = (arena + L.PAGE - 1) // L.PAGE * L.PAGE
        return dict(
            self._info(),
            ok=True,
            protocol=[major, min(minor, int(theirs[1]))],
            epoch=self._epoch,
            arena_bytes=arena,
            server_pid=os.getpid(),
        )

    def _serve_uds(
        self, conn: socket.socket, arena: int, stats: RequestStats | None = None
    ) -> None:
        """Serves request frames on ``conn`` until it closes (counting them into ``stats``)."""
        head = np.zeros(L.REQ_FRAME.size, np.uint8)
        head_view = memoryview(head)
        body = np.zeros(arena, np.uint8)
        body_view = memoryview(body)
        out = np.zeros(L.RESP_FRAME.size + arena, np.uint8)
        out_view = memoryview(out)
        resp = out[L.RESP_FRAME.size :]
        while True:
            try:
                recv_exactly(conn, head_view)
            except ConnectionError:
                return
            seq, op, flags, body_len, publish_ns, deadline_ns = L.REQ_FRAME.unpack_from(head, 0)
            picked = time.monotonic_ns()
            if body_len > arena:
                # The stream cannot be resynchronised past a frame we will not read.
                if stats is not None:
                    stats.oversized += 1
                n = encode_text(resp, f"request body of {body_len} bytes exceeds the arena")
                L.RESP_FRAME.pack_into(out, 0, seq, Status.PAYLOAD_TOO_LARGE, 0, n, 0, 0, 0)
                conn.sendall(out_view[: L.RESP_FRAME.size + n])
                return
            recv_exactly(conn, body_view[:body_len])
            queue_ns = picked - publish_ns if 0 < publish_ns <= picked else 0
            if deadline_ns and picked > deadline_ns:  # as the shm poller does
                status: int = Status.TIMEOUT
                n = encode_text(resp, "the request's deadline passed before it was served")
                compute_ns = write_ns = 0
            elif self.combiner is not None and batchable(op, flags):  # with other threads' searches
                result, _ = self.combiner.call(op, flags, body[:body_len], resp)
                status, n, compute_ns, write_ns = result
            else:
                with self._lock:
                    status, n, compute_ns, write_ns = self._handle(op, flags, body[:body_len], resp)
                    lsn = self._journal.last_lsn if self._journal is not None else 0
                if lsn:  # a logged write: answer once its record is durable (group commit)
                    assert self._journal is not None
                    outcome = self._journal.wait(lsn)
                    if outcome is not True:
                        status, n = Status.SERVER_ERROR, encode_text(resp, outcome)
            L.RESP_FRAME.pack_into(out, 0, seq, status, 0, n, queue_ns, compute_ns, write_ns)
            conn.sendall(out_view[: L.RESP_FRAME.size + n])
            if stats is not None:
                stats.record(op, status, queue_ns, compute_ns, write_ns)
