"""The sidecar's configuration: one immutable object, built by the CLI or by tests."""

from __future__ import annotations

import dataclasses
import os

from kalos.errors import ConfigError
from kalos.paths import check_name
from kalos.protocol import codes
from kalos.protocol import layout as L
from kalos.stores.limits import Limits
from kalos.stores.wal import FsyncPolicy


@dataclasses.dataclass(frozen=True)
class SidecarConfig:
    name: str
    dim: int
    metric: str = "ip"
    device: str = "cpu"
    index: str | None = None  # spec string; None: the device's exact default
    runtime_dir: str | None = None
    max_arena_bytes: int = 64 << 20  # the largest arena a client may negotiate
    max_channels: int = 1024  # shm channels and uds connections open at once
    # Spin this long after the last request before parking: while requests flow the poller
    # answers in ~1 µs; a futex wake costs ~25 µs on a 2-vCPU VM (DESIGN.md).
    spin_us: float = 200.0
    # ... or, while requests come as a steady trickle (on average at least every
    # max_spin_us / 5), five times their mean gap: a request that finds the poller parked
    # waits for a futex wake (kalos.server.channels). 0 (the default): spin_us only. On the
    # 2-core VM it cut the p50 at 500-1,000 searches/s but raised the p99 in the band of
    # rates where the long spin still ends in a park (docs/OPERATIONS.md, Resources).
    max_spin_us: float = 0.0
    # BLAS/OpenMP threads for CPU search. One: dispatch is serial, a matrix-vector product is
    # memory-bound, and a pool of spinning BLAS threads fights the poller and the clients for
    # cores (measured on the 2-core machine: 100K x 128 search p50 12.4 ms with OpenBLAS's 2
    # threads under load vs 3.3 ms with 1).
    compute_threads: int = 1
    # Dynamic batching (kalos.server.channels): searches and recalls waiting on different
    # shm channels are answered with one pass over the index, at most batch_max of them;
    # the first waits up to batch_delay_us for more (0: batch only what is already waiting,
    # so a lone caller never waits). uds and grpc requests batch among themselves
    # (kalos.server.combiner, no delay). batch_max 1 turns batching off.
    batch_delay_us: float = 0.0
    batch_max: int = 64
    heartbeat_ms: float = 100.0  # parked sidecars still beat this often (≈0.1% of a core)
    allowed_uids: tuple[int, ...] = ()  # besides the sidecar's own uid
    allowed_gid: int | None = None
    # Durability (docs/OPERATIONS.md): None keeps everything in memory only.
    data_dir: str | None = None
    fsync: str = "always"  # always | interval:MS | off
    snapshot_bytes: int = 256 << 20  # snapshot once the log grew this much since the last
    wal_segment_bytes: int = 64 << 20
    # PostgreSQL as the source of truth (kalos.server.source): a libpq connection string or
    # URL; memories and state then live there and this sidecar is a replica. With data_dir
    # too, no write-ahead log: local snapshots of the replica, which a restart resumes from.
    # Never logged (it may carry a password): stats show it redacted.
    source: str | None = dataclasses.field(default=None, repr=False)
    source_max_lag: int = 0  # feed positions behind the head at which it becomes ready
    source_retention_s: float = 3600.0  # change rows kept for followers (docs/OPERATIONS.md)
    source_snapshot_s: float = 60.0  # with data_dir: between snapshots while changes arrive
    # A table that other programs write, mirrored as the memories (kalos.server.source_table):
    # [schema.]table, and its columns as ROLE=COLUMN,... (id and vector required).
    source_table: str | None = None
    source_columns: str | None = None
    # Sessions and state: a tokenizer.json for turns sent without token ids, and size limits.
    tokenizer: str | None = None
    # The token heap (kalos.stores.token_heap): sessions' token ids in shared memory that shm
    # clients map read-only, so that CONTEXT answers by reference. 0: no heap, ids are copied.
    token_heap_bytes: int = 256 << 20
    # The session index (kalos.stores.session_index): where each heap-resident session's ids
    # and newest turns lie, so that shm clients compute CONTEXT windows without a request.
    # Slots, a power of two (768 bytes each, touched pages only); 0: every CONTEXT asks.
    session_index_slots: int = 1 << 16
    # Rows to allocate up front (GPU index: adds up to this size never move storage, so
    # captured search graphs stay valid). 0: grow on demand.
    reserve: int = 0
    # A cuda sidecar's GPU picks a channel's next search up itself, with no sidecar CPU
    # between the client and the kernel (kalos.server.doorbell; off: kalos serve
    # --no-gpu-doorbell). On the H200, 1M x 128: p99 103.1 µs against 124.2 through the
    # poller, side by side (bench/results/search-gpu-H200.json).
    gpu_doorbell: bool = True
    # A cuda sidecar's compiled-kernel cache (Triton's TRITON_CACHE_DIR), so that a restart
    # loads its kernels instead of compiling them (server.sidecar.kernel_cache_dir). None:
    # TRITON_CACHE_DIR if set, else <data_dir>/kernel-cache, else Triton's default.
    cache_dir: str | None = None
    limits: Limits = dataclasses.field(default_factory=Limits)
    # The admin HTTP endpoint on 127.0.0.1 (kalos.server.admin): None turns it off; 0 picks a
    # free port. With admin_port_strict False a taken port only logs a warning (the CLI's
    # default port); an explicit port that is taken stops the start.
    admin_port: int | None = None
    admin_port_strict: bool = True
    # grpc listeners (kalos.server.grpc_server) for clients on other hosts: host:port,
    # [::]:port or unix:/path each; none by default. Port 0 picks a free port (STATS "grpc").
    # Without TLS a grpc listener must only be reachable from trusted networks.
    grpc: tuple[str, ...] = ()
    grpc_tls_cert: str | None = None  # PEM certificate chain and key: TLS on every listener
    grpc_tls_key: str | None = None
    grpc_tls_client_ca: str | None = None  # mutual TLS: clients need a certificate it signed
    # Bulk load at start (kalos.server.bulk_load): a .npy of vectors [n, dim] the sidecar
    # reads itself before it reports ready, with optional ids (.npy) and payloads (.jsonl).
    load: str | None = None
    load_ids: str | None = None
    load_payloads: str | None = None

    def __post_init__(self) -> None:
        check_name(self.name)
        if not 1 <= self.dim <= 65536:
            raise ConfigError(f"dim must be between 1 and 65536, got {self.dim}")
        if self.metric not in codes.METRICS:
            raise ConfigError(f"metric must be one of {', '.join(codes.METRICS)}")
        if not self.device.startswith(("cpu", "cuda")):
            raise ConfigError(f"device must be cpu or cuda[:N], got {self.device!r}")
        if self.device.startswith("cuda") and any(
            o.strip().startswith("shards") for o in self.index_spec.split(",")[1:]
        ):
            raise ConfigError(
                f"index {self.index_spec!r}: the sidecar's GPU search serves one cuda index;"
                " a sharded index (shards=N) is served on --device cpu"
            )
        if self.compute_threads < 1:
            raise ConfigError("compute_threads must be at least 1")
        if not (0 <= self.spin_us <= 1e7 and 0 <= self.max_spin_us <= 1e7):
            raise ConfigError("spin_us and max_spin_us must be 0..1e7 (10 s)")
        if self.batch_max < 1 or not 0 <= self.batch_delay_us <= 1e6:
            raise ConfigError("batch_max must be at least 1 and batch_delay_us 0..1e6")
        if self.max_channels < 1:
            raise ConfigError("max_channels must be at least 1")
        if not L.MIN_ARENA_BYTES <= self.max_arena_bytes <= L.MAX_ARENA_BYTES:
            raise ConfigError("max_arena_bytes out of range")
        FsyncPolicy.parse(self.fsync)  # ConfigError when malformed
        slots = self.session_index_slots
        if slots < 0 or slots == 1 or slots & (slots - 1):
            raise ConfigError("session_index_slots must be 0 or a power of two >= 2")
        if self.token_heap_bytes < 0 or self.token_heap_bytes % 1024:
            raise ConfigError("token_heap_bytes must be 0 or a positive multiple of 1024")
        if self.snapshot_bytes < 1 or self.wal_segment_bytes < 4096:
            raise ConfigError("snapshot_bytes must be positive and wal_segment_bytes >= 4096")
        if self.source_max_lag < 0 or self.source_retention_s <= 0 or self.source_snapshot_s <= 0:
            raise ConfigError(
                "source_max_lag must be >= 0, source_retention_s and source_snapshot_s positive"
            )
        if (self.source_table is None) != (self.source_columns is None):
            raise ConfigError("--source-table and --source-columns go together")
        if self.source_table is not None:
            if self.source is None:
                raise ConfigError("--source-table needs --source (or --source-file)")
            from kalos.server.source_table import parse_columns

            parse_columns(str(self.source_columns))  # ConfigError when malformed
        if self.admin_port is not None and not 0 <= self.admin_port <= 65535:
            raise ConfigError(f"admin_port must be between 0 and 65535, got {self.admin_port}")
        for address in self.grpc:
            if not isinstance(address, str) or address in ("", "unix:") or ":" not in address:
                raise ConfigError(f"bad grpc address {address!r}: use host:port or unix:/path")
        if (self.grpc_tls_cert is None) != (self.grpc_tls_key is None):
            raise ConfigError("--grpc-tls-cert and --grpc-tls-key go together")
        if self.grpc_tls_client_ca is not None and self.grpc_tls_cert is None:
            raise ConfigError("--grpc-tls-client-ca needs --grpc-tls-cert and --grpc-tls-key")
        if self.grpc_tls_cert is not None and not self.grpc:
            raise ConfigError("the grpc TLS options need a grpc listener (--grpc ADDR)")
        if self.load is None and (self.load_ids is not None or self.load_payloads is not None):
            raise ConfigError("--load-ids and --load-payloads go with --load VECTORS.npy")
        if self.load is not None:
            if self.source is not None:
                raise ConfigError(
                    "--load: a replica (--source) takes its rows from the database; load them there"
                )
            from kalos.server.bulk_load import check_files

            check_files(self.load, self.load_ids, self.load_payloads, self.dim)

    @property
    def index_spec(self) -> str:
        if self.index:
            return self.index
        if self.device.startswith("cuda"):
            return f"{self.device}:flat,fp16"
        return "cpu:flat"

    def peer_allowed(self, uid: int, gid: int) -> bool:
        """Whether a peer with these credentials (SO_PEERCRED) may connect."""
        return (
            uid == os.getuid()
            or uid in self.allowed_uids
            or (self.allowed_gid is not None and gid == self.allowed_gid)
        )
