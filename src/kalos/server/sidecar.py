"""The sidecar process: control segment, listener, poller and their lifecycle.

``Sidecar(config).serve()`` runs in the calling thread until :meth:`Sidecar.stop` (the CLI
calls it from SIGTERM/SIGINT); ``start()`` runs the poller in a background thread instead,
for embedding and tests. On stop it marks the control segment STOPPING, disconnects every
client and removes its socket.

With ``data_dir`` (kalos.server.durability) it recovers its stores before it reports READY,
logs every write before acknowledging it, and takes a last snapshot when it stops cleanly
(if that fits the stop's budget, STOP_BUDGET_S). A cuda sidecar then compiles or loads every
GPU kernel its searches can need (GpuSearch.warm) before it reports READY, with compiled
kernels cached on disk (kernel_cache_dir), so that no search after ready waits for a compile.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from threadpoolctl import threadpool_limits

from kalos import _native, index
from kalos.errors import ConfigError
from kalos.index.factory import parse_spec
from kalos.paths import runtime_dir, socket_path
from kalos.protocol import codes
from kalos.protocol import layout as L
from kalos.server.channels import Poller
from kalos.server.combiner import Combiner
from kalos.server.config import SidecarConfig

if TYPE_CHECKING:
    from kalos.server.admin import AdminServer
    from kalos.server.gpu_search import GpuSearch
    from kalos.server.grpc_server import GrpcServer
    from kalos.server.source import Source
from kalos.server.dispatch import Dispatcher
from kalos.server.durability import Durability, Journal
from kalos.server.listener import Listener
from kalos.shm.memory import SharedMemory, create
from kalos.stores.memories import MemoryStore
from kalos.stores.session_index import SessionIndex
from kalos.stores.sessions import SessionStore, load_tokenizer, tokenizer_fingerprint
from kalos.stores.state import StateStore
from kalos.stores.token_heap import TokenHeap
from kalos.stores.wal import FsyncPolicy

log = logging.getLogger("kalos.server")

# Seconds from stop() (SIGTERM) to a closed sidecar, at most: what a supervisor's grace
# period can rely on (Kubernetes' default is 30 s, an operator's often 5-10).
STOP_BUDGET_S = 4.0
KERNEL_CACHE = "kernel-cache"  # Triton's cache directory under --data-dir
OPEN_FILES_BESIDE_CHANNELS = 256  # descriptors a sidecar may hold besides its channels


def kernel_cache_dir(config: SidecarConfig) -> str | None:
    """Where a cuda sidecar's compiled kernels are cached: ``config.cache_dir``; else
    TRITON_CACHE_DIR when the environment sets it; else ``<data_dir>/kernel-cache``; else
    None (Triton's default, ~/.triton/cache)."""
    if not config.device.startswith("cuda"):
        return None
    if config.cache_dir:
        return os.path.abspath(config.cache_dir)
    if os.environ.get("TRITON_CACHE_DIR"):
        return os.environ["TRITON_CACHE_DIR"]
    if config.data_dir is not None:
        return os.path.join(os.path.abspath(config.data_dir), KERNEL_CACHE)
    return None


def use_kernel_cache(config: SidecarConfig) -> str | None:
    """Creates the kernel cache directory and points Triton at it (TRITON_CACHE_DIR, read
    when a kernel compiles); returns it, or None for Triton's default."""
    path = kernel_cache_dir(config)
    if path is not None:
        prepare_dir(path, "kernel cache directory")
        os.environ["TRITON_CACHE_DIR"] = path
    return path


def raise_open_file_limit(max_channels: int) -> int:
    """Raises this process's soft limit of open files (up to its hard limit) to what
    ``max_channels`` channels need: a socket each, and descriptors besides (the log, the
    admin endpoint, a channel's segment while it is handed over). The usual soft limit, 1024,
    is below what the default 1,024 channels need. Returns the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_channels + OPEN_FILES_BESIDE_CHANNELS
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        if new > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        if soft < want:
            log.warning(
                "the open-file limit (%d, hard %d) is below what %d channels need (%d): "
                "raise it (ulimit -n, LimitNOFILE) or lower --max-channels",
                soft, hard, max_channels, want,
            )  # fmt: skip
    return soft


def prepare_dir(path: str, what: str) -> None:
    """Creates directory ``path`` (0700) where it is missing. ConfigError, naming the OS's
    reason, when it cannot be made or this process cannot write in it."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except FileExistsError:
        raise ConfigError(f"cannot use {path} as the {what}: it is not a directory") from None
    except OSError as exc:
        raise ConfigError(f"cannot use {path} as the {what}: {exc.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot use {path} as the {what}: this user cannot write in it")


def prepare_runtime_dir(path: str, traversable: bool = False) -> None:
    """Creates the socket directory private to this user, or checks an existing one.

    ``traversable`` (other uids are allowed in): others may pass through it (0711) to reach
    the socket, but never list or write it."""
    prepare_dir(path, "runtime directory")
    st = os.stat(path)
    if st.st_uid != os.getuid():
        raise ConfigError(f"{path} belongs to uid {st.st_uid}, not to this user")
    if st.st_mode & 0o002:
        raise ConfigError(f"{path} is world-writable; use a private directory")
    if traversable and st.st_mode & 0o011 != 0o011:
        os.chmod(path, (st.st_mode & 0o777) | 0o011)


def _socket_live(path: str) -> bool:
    """Whether a process accepts connections on the Unix socket at ``path``."""
    if not os.path.exists(path):
        return False
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except OSError:
        return False
    finally:
        probe.close()
    return True


def check_socket_free(path: str) -> None:
    """ConfigError if a live sidecar already answers at ``path`` (changes nothing)."""
    if _socket_live(path):
        raise ConfigError(f"a sidecar is already serving at {path}")


def claim_socket(path: str) -> None:
    """Removes a stale socket; ConfigError if a live sidecar already answers there."""
    check_socket_free(path)
    if os.path.lexists(path):
        os.unlink(path)  # nobody listens: left by a sidecar that was killed


class Sidecar:
    def __init__(self, config: SidecarConfig) -> None:
        self.config = config
        self.epoch = secrets.randbits(63) or 1
        self._threadpools = threadpool_limits(limits=config.compute_threads)
        self.path = socket_path(config.name, config.runtime_dir)
        # A second sidecar of the same name: say so first, before anything else it would
        # start (the admin port's warning, an index, shared memory) hides the cause.
        check_socket_free(self.path)
        raise_open_file_limit(config.max_channels)  # or the listener runs out (EMFILE)
        # Directories it cannot use: said now, not after a recovery or a load.
        prepare_runtime_dir(runtime_dir(config.runtime_dir), bool(config.allowed_uids))
        if config.data_dir is not None:
            prepare_dir(config.data_dir, "data directory")
        # Where compiled GPU kernels are cached (before any compiles): a restart loads them.
        self.kernel_cache_dir = use_kernel_cache(config)
        self.warm_seconds: float | None = None  # a cuda sidecar's warm-up (GpuSearch.warm)
        self._stop_at: float | None = None  # when stop() was first called (monotonic)
        # One tokenizer for turns and memories sent without token ids.
        tokenizer = load_tokenizer(config.tokenizer) if config.tokenizer is not None else None
        vectors = index.create(config.index_spec, dim=config.dim, metric=config.metric)
        if config.reserve and hasattr(vectors, "reserve"):
            vectors.reserve(config.reserve)
        # An exact cuda index's searches go through the GPU search (graphs, pinned staging,
        # the doorbell): the one hook of the GPU path, handed to the store it serves. An
        # approximate one (cuda:ivf) is searched through the Index protocol like a CPU index.
        self.gpu: GpuSearch | None = None
        if config.device.startswith("cuda") and parse_spec(config.index_spec).kind == "flat":
            from kalos.server.gpu_search import GpuSearch

            self.gpu = GpuSearch(vectors, doorbell=config.gpu_doorbell)
        self.memories = MemoryStore(
            vectors, limits=config.limits, tokenizer=tokenizer, gpu=self.gpu
        )
        self.lock = threading.Lock()  # serialises dispatch between the poller and uds threads
        # Sessions' token ids, shared read-only with shm clients (CONTEXT by reference).
        self.token_heap: TokenHeap | None = None
        if config.token_heap_bytes:
            try:
                self.token_heap = TokenHeap(config.token_heap_bytes)
            except OSError as exc:  # e.g. a file size limit (RLIMIT_FSIZE) below its size
                log.warning("no token heap (%s): CONTEXT copies the token ids", exc)
        # Where clients find windows themselves (it points into the heap: none without one).
        self.session_index: SessionIndex | None = None
        if self.token_heap is not None and config.session_index_slots:
            try:
                self.session_index = SessionIndex(config.session_index_slots)
            except OSError as exc:
                log.warning("no session index (%s): every CONTEXT asks the sidecar", exc)
        self.dispatcher = Dispatcher(
            self.memories,
            name=config.name,
            device=config.device,
            extra_stats=self._stats,
            sessions=SessionStore(config.limits, tokenizer, self.token_heap, self.session_index),
            state=StateStore(config.limits),
        )
        self.durability: Durability | None = None
        handle: Callable[..., tuple[int, int, int, int]] = self.dispatcher.handle
        # What the data directory's snapshots depend on.
        identity = {
            "dim": config.dim,
            "metric": config.metric,
            "tokenizer": tokenizer_fingerprint(config.tokenizer),
        }
        if config.data_dir is not None and config.source is None:
            # Snapshots hold every store the dispatcher serves.
            stores = {
                name: getattr(self.dispatcher, name)
                for name in ("memories", "sessions", "state")
                if hasattr(self.dispatcher, name)
            }
            self.durability = Durability(
                config.data_dir,
                self.dispatcher,
                self.lock,
                stores,
                policy=FsyncPolicy.parse(config.fsync),
                snapshot_bytes=config.snapshot_bytes,
                segment_bytes=config.wal_segment_bytes,
                identity=identity,
                fork=not config.device.startswith("cuda"),  # CUDA does not survive a fork
            )
            handle = self.durability.handle
        # With a source database, writes commit there and a follower applies the feed.
        self.source: Source | None = None
        if config.source is not None:
            from kalos.server.source import Source
            from kalos.server.source_table import parse_columns

            table = None
            if config.source_table is not None and config.source_columns is not None:
                table = (config.source_table, parse_columns(config.source_columns))

            self.source = Source(
                config.source,
                self.dispatcher,
                self.lock,
                name=config.name,
                max_lag=config.source_max_lag,
                retention_s=config.source_retention_s,
                # snapshots of the replica, resumed from at start (no write-ahead log)
                data_dir=config.data_dir,
                identity=identity,
                fork=not config.device.startswith("cuda"),
                snapshot_s=config.source_snapshot_s,
                table=table,
            )
            handle = self.source.handle
        journal: Journal | None = self.source if self.source is not None else self.durability
        self._journal = journal
        self._control_fd = create("kalos-control", L.CONTROL_SIZE)
        self.control = SharedMemory(self._control_fd, L.CONTROL_SIZE)
        L.CTRL_HEADER.pack_into(
            self.control.buf,
            0,
            L.CONTROL_MAGIC,
            L.LAYOUT_VERSION,
            *codes.PROTOCOL_VERSION,
            self.epoch,
            os.getpid(),
            L.STATE_STARTING,
            config.dim,
            codes.METRICS.index(config.metric),
            codes.MAX_K,
            0,
            time.monotonic_ns(),
        )
        self.poller = Poller(
            self.control,
            handle,
            self.lock,
            spin_us=config.spin_us,
            max_spin_us=config.max_spin_us,
            heartbeat_ms=config.heartbeat_ms,
            journal=journal,
            begin_batch=self.dispatcher.begin_batch if config.batch_max > 1 else None,
            batch_delay_us=config.batch_delay_us,
            batch_max=config.batch_max,
        )
        if self.gpu is not None:
            self.poller.doorbell = self.gpu.doorbell
        if self.durability is not None:
            self.durability.on_durable = self.poller.wake  # a commit landed: release writes
        if self.source is not None:
            self.source.on_durable = self.poller.wake  # the follower applied: release writes
        self._handle = handle
        # uds connections' and grpc handlers' searches batch among themselves (server.combiner)
        self.combiner: Combiner | None = None
        if config.batch_max > 1:
            self.combiner = Combiner(
                self.lock, handle, self.dispatcher.handle_batch, config.batch_max
            )
        self.listener: Listener | None = None
        self.grpc: GrpcServer | None = None  # with config.grpc (kalos serve --grpc ADDR)
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self.admin: AdminServer | None = None  # /healthz, /readyz, /metrics on 127.0.0.1
        if config.admin_port is not None:
            from kalos.server.admin import start_admin

            self.admin = start_admin(self)  # up before recovery: /readyz says 503 meanwhile

    def _stats(self) -> dict[str, Any]:
        listener = self.listener
        return {
            "epoch": self.epoch,
            "channels": len(self.poller.channels),
            # how long the poller spins now after the last request before it parks
            "poller_spin_us": self.poller.spin_ns / 1000,
            "gpu_published": self.poller.device_published,  # see server.gpu_search
            "batches": self.poller.batches,  # of two or more searches (server.channels)
            "batched": self.poller.batched,
            "largest_batch": self.poller.largest_batch,
            # those batches' time: pickup to last reply; in the dispatcher; in the search pass
            "batch_ns": self.poller.batch_ns,
            "batch_dispatch_ns": self.poller.batch_dispatch_ns,
            "batch_search_ns": self.dispatcher.batch_search_ns,
            "batch_woken": self.poller.batch_woken,  # members whose callers parked (server.waker)
            # batches whose pass ran on the GPU while the poller served on, and for how long
            "batches_run_ahead": self.poller.batches_run_ahead,
            "batch_running_ns": self.poller.batch_running_ns,
            # the poller's steps on them (server.channels.BATCH_STEPS), and of the starts,
            # the time spent settling the GPU's armed graphs (server.doorbell)
            **{f"batch_{step}_ns": ns for step, ns in self.poller.batch_step_ns.items()},
            "batch_settle_ns": self.dispatcher.batch_settle_ns,
            # uds and grpc requests' batches (server.combiner)
            "thread_batches": self.combiner.batches if self.combiner is not None else 0,
            "thread_batched": self.combiner.batched if self.combiner is not None else 0,
            "uds_connections": listener.uds_connections if listener else 0,
            "connects": listener.connects if listener else 0,
            "refused": listener.refused if listener else 0,
            "rejected": dict(listener.rejected) if listener else {},  # handshakes, by error
            "admin_port": self.admin.port if self.admin is not None else None,
            "warm_seconds": self.warm_seconds,
            "grpc": list(self.grpc.addresses) if self.grpc is not None else [],
            **({"durability": self.durability.stats()} if self.durability is not None else {}),
            **({"source": self.source.stats()} if self.source is not None else {}),
            **(door.stats() if (door := self.poller.doorbell) is not None else {}),
        }

    def _beat(self) -> None:
        """Beats the heartbeat from a thread of its own, besides the poller's beats, so that a
        long request (the poller busy in one dispatch) never looks like a hung sidecar to the
        clients (kalos.transport.shm): only a stopped or stuck process stops beating."""
        addr = self.control.addr + L.CTRL_HEARTBEAT_NS
        period = self.config.heartbeat_ms / 2e3
        _native.store_release(addr, time.monotonic_ns())
        while not self._stopped.wait(period):
            _native.store_release(addr, time.monotonic_ns())

    def _open(self) -> None:
        threading.Thread(target=self._beat, name="kalos-heartbeat", daemon=True).start()
        claim_socket(self.path)
        self.listener = Listener(
            self.config,
            self.path,
            self._control_fd,
            self.epoch,
            self.poller,
            self._handle,
            self.lock,
            self.dispatcher.info,
            journal=self._journal,
        )
        self.listener.gpu = self.gpu
        self.listener.combiner = self.combiner
        self.listener.heap = self.token_heap
        self.listener.session_index = self.session_index
        self.listener.metrics = self.admin.metrics if self.admin is not None else None
        self.listener.start()
        if self.config.grpc:
            try:
                self._open_grpc(self.listener)
            except BaseException:
                self.listener.close()
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
                raise
        if self.durability is not None or self.source is not None:
            try:  # clients are held, then refused "starting", meanwhile
                if self.durability is not None:
                    self.durability.recover()
                if self.source is not None:  # load the tables, follow, wait to catch up
                    self.source.recover(stop=lambda: self.poller.stopping)
            except BaseException:
                if self.grpc is not None:
                    self.grpc.close()
                self.listener.close()
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
                raise
        if self.config.load is not None:
            self._load()
        if self.gpu is not None and not self._warm():
            return  # stopped meanwhile: serve() and start() close at once
        warm_index = getattr(self.memories.index, "warm", None)
        if self.gpu is None and warm_index is not None:  # e.g. cuda:ivf's kernel
            warm_index()
        self.listener.ready.set()
        _native.store_release(self.control.addr + L.CTRL_STATE, L.STATE_READY)
        log.info(
            "kalos sidecar %r ready at %s (%s, dim %d, %s)",
            self.config.name,
            self.path,
            self.memories.index.spec,
            self.config.dim,
            self.config.metric,
        )

    def _load(self) -> None:
        """Before readiness, after recovery: the rows of ``--load`` (kalos.server.bulk_load),
        read by the sidecar itself. A bad file stops the start, as a bad flag does."""
        from kalos.server.bulk_load import check_files, load_into

        config = self.config
        assert config.load is not None
        files = check_files(config.load, config.load_ids, config.load_payloads, config.dim)
        log.info("loading %d rows from %s", files.rows, config.load)
        try:
            with self.lock:
                load_into(self.memories, files)
                # an index with unsorted rows pending (cuda:ivf's buffer) sorts them now
                flush = getattr(self.memories.index, "flush", None)
                if flush is not None:
                    flush()
        except BaseException:
            if self.grpc is not None:
                self.grpc.close()
            if self.listener is not None:
                self.listener.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            raise

    def _warm(self) -> bool:
        """Before readiness: every kernel and the common graphs of a cuda sidecar's searches
        (GpuSearch.warm), so that no search after ready waits for a compile. False when the
        sidecar was stopped meanwhile."""
        assert self.gpu is not None
        cache = self.kernel_cache_dir or "Triton's default"
        log.info("warming the GPU kernels (kernel cache: %s)", cache)
        try:  # no request is served yet: the dispatch lock is not needed
            self.warm_seconds = self.gpu.warm(stop=lambda: self.poller.stopping)
        except InterruptedError:
            log.info("stopped during the kernel warm-up")
            return False
        pre = self.gpu.precompiled
        if pre is not None:
            log.info(
                "GPU kernels warm in %.1f s (a dry run %.1f s, %d variants compiled by %d "
                "processes in %.1f s, every variant loaded and run %.1f s, the graphs %.1f s)",
                self.warm_seconds, pre["dry_s"], pre["compiled"], pre["workers"], pre["seconds"],
                pre["launches_s"],
                self.warm_seconds - pre["dry_s"] - pre["seconds"] - pre["launches_s"],
            )  # fmt: skip
        else:
            log.info("GPU kernels warm in %.1f s", self.warm_seconds)
        return True

    def _open_grpc(self, listener: Listener) -> None:
        """Starts the grpc listener (before recovery: it holds handshakes until ready)."""
        try:
            from kalos.server.grpc_server import GrpcServer
        except ImportError as exc:
            raise ConfigError("--grpc needs grpcio: pip install 'kalos[grpc]'") from exc
        grpc = GrpcServer(
            self.config,
            handle=self._handle,
            lock=self.lock,
            negotiate=listener.negotiate,
            ready=listener.ready,
            journal=self._journal,
            metrics=self.admin.metrics if self.admin is not None else None,
            rejected=listener.rejected,
        )
        grpc.combiner = self.combiner
        self.grpc = grpc.start()

    def serve(self) -> None:
        """Serves in this thread until :meth:`stop`; then cleans up."""
        self._open()
        try:
            self.poller.run()
        finally:
            self._close()

    def start(self) -> Sidecar:
        """Serves from a background thread; returns once the socket accepts clients."""
        self._open()

        def run() -> None:
            try:
                self.poller.run()
            finally:
                self._close()

        self._thread = threading.Thread(target=run, name="kalos-poller", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Asks the poller to finish; safe from a signal handler or another thread. The
        sidecar has closed within STOP_BUDGET_S of the first call (a warm-up or a last
        snapshot that would take longer is cut short)."""
        if self._stop_at is None:
            self._stop_at = time.monotonic()
        self.poller.stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._stopped.wait(timeout=STOP_BUDGET_S + 1)

    def _close(self) -> None:
        _native.store_release(self.control.addr + L.CTRL_STATE, L.STATE_STOPPING)
        deadline = (self._stop_at or time.monotonic()) + STOP_BUDGET_S
        if self.grpc is not None:
            self.grpc.close()
        if self.listener is not None:
            self.listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        finished = True
        if self.durability is not None:
            # a last snapshot if it fits the budget, then the log closes
            finished = self.durability.close(timeout=max(0.5, deadline - time.monotonic()))
        if self.source is not None:  # with a data directory, a last snapshot if it fits
            finished = self.source.close(timeout=max(0.5, deadline - time.monotonic()))
        if self.admin is not None:
            self.admin.close()
        if finished:  # else a snapshot writer may still read them: they go with the process
            if self.token_heap is not None:
                self.token_heap.close()  # its memory goes with the last client's mapping
            if self.session_index is not None:
                self.session_index.close()
        self._stopped.set()
        log.info("kalos sidecar %r stopped", self.config.name)

    def __enter__(self) -> Sidecar:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
