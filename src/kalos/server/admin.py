"""The admin HTTP endpoint: ``/healthz``, ``/readyz`` and ``/metrics`` on 127.0.0.1.

``kalos serve`` starts it on ``--admin-port`` (default :data:`DEFAULT_ADMIN_PORT`; ``0`` picks
a free port, logged and reported in STATS as ``admin_port``; ``--no-admin`` turns it off). It
binds the loopback address and nothing else: there is no host parameter, so it cannot be
exposed by configuration (in Kubernetes the probes run inside the pod, see deploy/k8s/).

- ``/healthz``: 200 while the process answers (alive), whatever its state.
- ``/readyz``: 200 once the control segment's state is READY (index loaded, recovery done);
  503 while starting or recovering, and while stopping.
- ``/metrics``: Prometheus text (prometheus_client), from a registry private to this sidecar.

Request metrics are counted by :mod:`kalos.server.request_stats`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, Protocol

from kalos import _native
from kalos.errors import ConfigError
from kalos.protocol import codes
from kalos.protocol import layout as L
from kalos.protocol.codes import Status
from kalos.server.request_stats import N_OPS, N_STATUS, Metrics, request_families
from kalos.server.request_stats import RequestStats as RequestStats  # re-exported, as before

if TYPE_CHECKING:
    from kalos.server.channels import Poller
    from kalos.server.config import SidecarConfig
    from kalos.server.dispatch import Dispatcher
    from kalos.server.durability import Durability
    from kalos.server.listener import Listener
    from kalos.shm.memory import SharedMemory
    from kalos.stores.memories import MemoryStore

log = logging.getLogger("kalos.server")

ADMIN_HOST = "127.0.0.1"  # by construction: nothing else is ever bound
DEFAULT_ADMIN_PORT = 9464
HEALTHZ_PATH = "/healthz"
READYZ_PATH = "/readyz"
METRICS_PATH = "/metrics"
PATHS = (HEALTHZ_PATH, READYZ_PATH, METRICS_PATH)
ADMIN_POLL_S = 0.05  # how often the admin thread checks for a stop: a stop waits at most this

STATE_NAMES = {L.STATE_STARTING: "starting", L.STATE_READY: "ready", L.STATE_STOPPING: "stopping"}


class Sidecar(Protocol):
    """What the endpoint reads of a sidecar: :class:`kalos.server.sidecar.Sidecar` is one.

    A protocol rather than an import, so the sidecar, which starts the endpoint, stays the
    one module above it.
    """

    config: SidecarConfig
    control: SharedMemory
    dispatcher: Dispatcher
    durability: Durability | None
    listener: Listener | None
    lock: threading.Lock
    memories: MemoryStore
    poller: Poller


class SidecarCollector:
    """Reads a sidecar's state at scrape time (prometheus_client custom collector)."""

    def __init__(self, sidecar: Sidecar, metrics: Metrics) -> None:
        self._sidecar = sidecar
        self._metrics = metrics

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            InfoMetricFamily,
        )

        sc = self._sidecar
        cfg = sc.config
        state = control_state(sc)
        info = InfoMetricFamily("kalos_sidecar", "The sidecar's identity")
        info.add_metric(
            (),
            {
                "name": cfg.name,
                "version": str(sc.dispatcher.info().get("version", "")),
                "index": sc.memories.index.spec,
                "device": cfg.device,
                "metric": cfg.metric,
                "protocol": "{}.{}".format(*codes.PROTOCOL_VERSION),
            },
        )
        yield info
        yield GaugeMetricFamily(
            "kalos_ready",
            "1 once the index is loaded and recovery done",
            value=int(state == "ready"),
        )
        yield GaugeMetricFamily(
            "kalos_start_time_seconds",
            "When the sidecar started (Unix time)",
            value=sc.dispatcher.started,
        )
        yield from request_families(self._metrics.totals())

        listener = sc.listener
        rejected: dict[str, int] = dict(getattr(listener, "rejected", {}) or {})
        oversized = sum(rs.oversized for rs in self._metrics.totals().values())
        protocol = CounterMetricFamily(
            "kalos_protocol_errors",
            "Protocol errors: malformed or mismatched handshakes, oversized request bodies, "
            "unknown op codes",
            labels=("kind",),
        )
        unknown_ops = sum(
            rs.responses[op * N_STATUS + Status.UNKNOWN_OP]
            for rs in self._metrics.totals().values()
            for op in range(N_OPS)
        )
        for kind in ("bad_hello", "protocol_mismatch", "bad_transport"):
            protocol.add_metric((kind,), rejected.get(kind, 0))
        protocol.add_metric(("oversized_request",), oversized)
        protocol.add_metric(("unknown_op",), unknown_ops)
        yield protocol
        refusals = CounterMetricFamily(
            "kalos_client_rejections",
            "Handshakes turned away: peer (uid/gid not allowed), starting (recovering), busy "
            "(too many channels), resources (out of open files or memory)",
            labels=("reason",),
        )
        refusals.add_metric(("peer",), listener.refused if listener else 0)
        for reason in ("starting", "busy", "resources"):
            refusals.add_metric((reason,), rejected.get(reason, 0))
        yield refusals
        grpc = getattr(sc, "grpc", None)
        yield CounterMetricFamily(
            "kalos_client_connects",
            "Handshakes accepted (each client thread connects once; a reconnect counts again; "
            "grpc Hello calls included)",
            value=(listener.connects if listener else 0) + (grpc.connects if grpc else 0),
        )
        yield CounterMetricFamily(
            "kalos_client_disconnects",
            "Client connections that ended (a client closed, died, or was disconnected)",
            value=getattr(listener, "disconnects", 0) if listener else 0,
        )
        channels = GaugeMetricFamily(
            "kalos_open_channels", "Connected client threads", labels=("transport",)
        )
        channels.add_metric(("shm",), len(sc.poller.channels))
        channels.add_metric(("uds",), listener.uds_connections if listener else 0)
        yield channels
        yield from self._store_families()
        yield from self._durability_families()
        yield from self._source_families()
        yield from self._gpu_families()
        yield from self._batch_families()

    def _store_families(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        d = self._sidecar.dispatcher
        # The stores change under the dispatch lock; a scrape waits for it briefly.
        if not self._sidecar.lock.acquire(timeout=2.0):
            log.debug("metrics: the dispatch lock is busy; store gauges skipped")
            return
        try:
            stats: dict[str, Any] = {}
            for store in (d.memories, d.sessions, d.state):
                stats.update(store.stats())
        finally:
            self._sidecar.lock.release()
        for key, help_text in (
            ("items", "Memory items in the index"),
            ("index_bytes", "Bytes held by the vector index"),
            ("payload_bytes", "Bytes of memory payloads"),
            ("memory_token_bytes", "Bytes of memories' token ids (int32)"),
            ("metadata_items", "Memory items with metadata"),
            ("metadata_keys", "Metadata keys with filter columns"),
            ("string_ids", "Memory items with a string id"),
            ("sessions", "Sessions (context buffers)"),
            ("session_turns", "Turns held in all sessions"),
            ("session_tokens", "Token ids held in all sessions"),
            ("session_bytes", "Bytes held by sessions"),
            ("token_heap_bytes", "Size of the token heap (shared memory for session ids)"),
            ("token_heap_used_bytes", "Bytes of the token heap given to sessions"),
            ("token_heap_quarantined", "Freed token heap regions a channel may still read"),
            ("session_index_sessions", "Sessions whose context windows clients compute"),
            ("session_index_slots", "Slots of the session index"),
            ("state_keys", "Agent state keys"),
            ("state_bytes", "Bytes of agent state values"),
            ("events", "Events in all event logs"),
        ):
            if key in stats:
                name = "kalos_index_items" if key == "items" else f"kalos_{key}"
                yield GaugeMetricFamily(name, help_text, value=stats[key])
        if "token_heap_fallbacks" in stats:
            yield CounterMetricFamily(
                "kalos_token_heap_fallbacks",
                "Session id buffers put in private memory: the token heap had no room",
                value=stats["token_heap_fallbacks"],
            )
        if "session_index_rebuilds" in stats:
            yield CounterMetricFamily(
                "kalos_session_index_rebuilds",
                "Session index tables rebuilt to drop deleted slots",
                value=stats["session_index_rebuilds"],
            )

    def _source_families(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        source = getattr(self._sidecar, "source", None)
        if source is None:
            return
        st = source.stats()
        yield GaugeMetricFamily(
            "kalos_source_connected", "1 while the follower reaches the source database",
            value=int(st["connected"]),
        )  # fmt: skip
        yield GaugeMetricFamily(
            "kalos_source_degraded", "1 while writes fail (the source database is unreachable)",
            value=int(st["degraded"]),
        )  # fmt: skip
        yield GaugeMetricFamily(
            "kalos_source_applied", "Change-feed position applied here", value=st["applied"]
        )
        yield GaugeMetricFamily(
            "kalos_source_lag", "Changes committed in the database, not yet applied here",
            value=st["lag"],
        )  # fmt: skip
        yield GaugeMetricFamily(
            "kalos_source_resumed",
            "1 when this start resumed from the local snapshot, 0 when it loaded the tables",
            value=int(st["resumed"]),
        )
        if "snapshot_position" in st:
            yield GaugeMetricFamily(
                "kalos_source_snapshot_position", "Feed position of the newest local snapshot",
                value=st["snapshot_position"],
            )  # fmt: skip
        for name, what in (
            ("applied_changes", "Changes applied from the feed"),
            ("apply_errors", "Changed rows left out (e.g. a vector of another dimension)"),
            ("refused_writes", "Writes the source database did not commit"),
            ("reconnects", "Reconnections to the source database"),
            ("reloads", "Full reloads (the feed lost this sidecar's position, or was rewound)"),
        ):
            yield CounterMetricFamily(f"kalos_source_{name}", what, value=st[name])

    def _durability_families(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        dur = self._sidecar.durability
        if dur is None:
            return
        wal = dur.wal
        stats = dur.stats()
        yield GaugeMetricFamily(
            "kalos_wal_last_lsn", "LSN of the last logged write", value=stats["last_lsn"]
        )
        yield GaugeMetricFamily(
            "kalos_wal_durable_lsn",
            "LSN through which the log is durable",
            value=stats["durable_lsn"],
        )
        yield CounterMetricFamily(
            "kalos_wal_written_bytes", "Bytes written to the log", value=wal.bytes_written
        )
        yield CounterMetricFamily("kalos_wal_syncs", "fsyncs of the log", value=wal.syncs)
        yield CounterMetricFamily(
            "kalos_wal_synced_records", "Records covered by those fsyncs", value=wal.synced_records
        )
        yield CounterMetricFamily(
            "kalos_wal_refused_writes",
            "Writes refused because the log could not be written",
            value=stats["refused_writes"],
        )
        yield GaugeMetricFamily(
            "kalos_wal_error",
            "1 while the log is failing (disk full, EIO)",
            value=int(bool(stats["error"])),
        )
        yield GaugeMetricFamily(
            "kalos_snapshot_lsn", "LSN of the newest complete snapshot", value=stats["snapshot_lsn"]
        )
        last = stats.get("last_snapshot") or {}
        for key, name, help_text in (
            ("pause_s", "kalos_snapshot_last_pause_seconds", "Serving paused by the last snapshot"),
            ("total_s", "kalos_snapshot_last_duration_seconds", "Duration of the last snapshot"),
            ("bytes", "kalos_snapshot_last_bytes", "Size of the last snapshot"),
        ):
            if key in last:
                yield GaugeMetricFamily(name, help_text, value=last[key])
        recovery = stats.get("recovery") or {}
        if "total_s" in recovery:
            yield GaugeMetricFamily(
                "kalos_recovery_duration_seconds",
                "Time the last start spent recovering (restore + log replay)",
                value=recovery["total_s"],
            )
            yield GaugeMetricFamily(
                "kalos_recovery_replayed_records",
                "Log records replayed at the last start",
                value=recovery.get("records_replayed", 0),
            )

    def _batch_families(self) -> Iterator[Any]:
        """Dynamic batching (kalos.server.channels): batches of two or more, what they held."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        poller = self._sidecar.poller
        yield CounterMetricFamily(
            "kalos_batches", "Batches of two or more searches or recalls answered together",
            value=poller.batches,
        )  # fmt: skip
        yield CounterMetricFamily(
            "kalos_batched_requests", "Searches and recalls answered in those batches",
            value=poller.batched,
        )  # fmt: skip
        yield GaugeMetricFamily(
            "kalos_batch_largest", "The most requests answered in one batch since the start",
            value=poller.largest_batch,
        )  # fmt: skip

    def _gpu_families(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        device = self._sidecar.config.device
        warm = getattr(self._sidecar, "warm_seconds", None)
        if warm is not None:
            yield GaugeMetricFamily(
                "kalos_gpu_warm_seconds",
                "Time the start spent compiling or loading the GPU kernels before ready",
                value=warm,
            )
        if not device.startswith("cuda"):
            return
        index = self._sidecar.memories.index
        for attr, name, help_text in (
            ("prefilter_searches", "kalos_gpu_prefilter_searches",
             "Single-query searches that scanned the int8 codes first"),
            ("prefilter_fallbacks", "kalos_gpu_prefilter_fallbacks",
             "Of those, searches whose bound did not prove the answer (settled from the bounds)"),
            ("prefilter_settled_rows", "kalos_gpu_prefilter_settled_rows",
             "Rows those unproven searches scored exactly (every row their bounds left open)"),
        ):  # fmt: skip
            c = CounterMetricFamily(name, help_text, labels=("device",))
            c.add_metric((device,), getattr(index, attr, 0))
            yield c
        c = CounterMetricFamily(
            "kalos_gpu_published_responses",
            "Responses whose sequence word the search kernel stored itself (shm channels)",
            labels=("device",),
        )
        c.add_metric((device,), self._sidecar.poller.device_published)
        yield c
        try:
            import torch

            allocated = torch.cuda.memory_allocated(device)
            reserved = torch.cuda.memory_reserved(device)
        except Exception as exc:  # a metrics scrape never fails on the GPU's account
            log.debug("metrics: no GPU memory figures: %s", exc)
            return
        for name, help_text, value in (
            (
                "kalos_gpu_memory_allocated_bytes",
                "GPU memory allocated by the sidecar (torch)",
                allocated,
            ),
            (
                "kalos_gpu_memory_reserved_bytes",
                "GPU memory reserved by torch's caching allocator",
                reserved,
            ),
        ):
            g = GaugeMetricFamily(name, help_text, labels=("device",))
            g.add_metric((device,), value)
            yield g


def control_state(sidecar: Sidecar) -> str:
    """The control segment's state: starting, ready or stopping (acquire-load)."""
    state = _native.load_acquire(sidecar.control.addr + L.CTRL_STATE)
    return STATE_NAMES.get(state, str(state))


class _Handler(BaseHTTPRequestHandler):
    server: _AdminHTTPServer
    timeout = 5.0  # a stuck peer holds only its own thread, never the probes
    protocol_version = "HTTP/1.0"

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        routes: dict[str, Callable[[], tuple[int, str, bytes]]] = self.server.routes
        route = routes.get(path)
        if route is None:
            self._reply(404, "text/plain; charset=utf-8", b"not found\n")
            return
        try:
            code, ctype, body = route()
        except Exception:
            log.exception("admin %s failed", path)
            code, ctype, body = 500, "text/plain; charset=utf-8", b"internal error\n"
        self._reply(code, ctype, body)

    def _reply(self, code: int, ctype: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("admin: " + format, *args)


class _AdminHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    routes: dict[str, Callable[[], tuple[int, str, bytes]]]


class AdminServer:
    """The admin endpoint of one sidecar, served from a daemon thread on 127.0.0.1:``port``.

    ``port`` 0 picks a free port (:attr:`port` says which). Raises ConfigError when the port
    is taken. There is deliberately no host argument: the endpoint is local to the host (or
    the pod) by construction.
    """

    def __init__(self, sidecar: Sidecar, port: int) -> None:
        try:
            from prometheus_client import (
                CONTENT_TYPE_LATEST,
                CollectorRegistry,
                ProcessCollector,
                generate_latest,
            )
        except ImportError as exc:  # a dependency; missing only in a broken install
            raise ConfigError(
                "the admin endpoint needs prometheus-client (pip install prometheus-client), "
                "or run with --no-admin"
            ) from exc
        if not 0 <= port <= 65535:
            raise ConfigError(f"admin port must be between 0 and 65535, got {port}")
        self.sidecar = sidecar
        self.metrics = Metrics()
        self.registry = CollectorRegistry()  # private: never the process-global registry
        self.registry.register(SidecarCollector(sidecar, self.metrics))
        ProcessCollector(registry=self.registry)
        registry = self.registry

        def healthz() -> tuple[int, str, bytes]:
            body = json.dumps({"alive": True, "state": control_state(sidecar)}) + "\n"
            return 200, "application/json", body.encode()

        def readyz() -> tuple[int, str, bytes]:
            state = control_state(sidecar)
            doc: dict[str, Any] = {"ready": state == "ready", "state": state}
            source = getattr(sidecar, "source", None)
            if source is not None:  # reads still served; writes fail until it reconnects
                doc["degraded"] = source.degraded
            body = (json.dumps(doc) + "\n").encode()
            return (200 if state == "ready" else 503), "application/json", body

        def metrics() -> tuple[int, str, bytes]:
            return 200, CONTENT_TYPE_LATEST, generate_latest(registry)

        try:
            self._http = _AdminHTTPServer((ADMIN_HOST, port), _Handler)
        except OSError as exc:
            raise ConfigError(
                f"cannot serve the admin endpoint on {ADMIN_HOST}:{port}: {exc.strerror} "
                "(another sidecar? pass --admin-port N, 0 for any free port, or --no-admin)"
            ) from exc
        self._http.routes = {HEALTHZ_PATH: healthz, READYZ_PATH: readyz, METRICS_PATH: metrics}
        self.host, self.port = self._http.server_address[:2]
        # serve_forever checks for shutdown() once per poll interval: at its default (0.5 s)
        # every stop of a sidecar waited for it
        self._thread = threading.Thread(
            target=self._http.serve_forever,
            args=(ADMIN_POLL_S,),
            name="kalos-admin",
            daemon=True,
        )
        self._thread.start()
        log.info(
            "kalos admin endpoint at http://%s:%d (%s)", ADMIN_HOST, self.port, ", ".join(PATHS)
        )

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._http.shutdown()
        self._http.server_close()


def start_admin(sidecar: Sidecar) -> AdminServer | None:
    """Starts the admin endpoint of ``sidecar`` on ``config.admin_port`` and has its poller
    record request metrics. A taken port is a ConfigError, or with ``admin_port_strict``
    False a warning (and no endpoint)."""
    port = sidecar.config.admin_port
    if port is None:
        return None
    try:
        admin = AdminServer(sidecar, port)
    except ConfigError as exc:
        if sidecar.config.admin_port_strict:
            raise
        log.warning("%s; the admin endpoint is off", exc)
        return None
    sidecar.poller.metrics = admin.metrics.stats("shm")
    return admin
