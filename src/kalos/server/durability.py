"""Durability: the write-ahead log in front of the dispatcher, snapshots, and recovery.

With ``--data-dir DIR`` every request of an op in :data:`~kalos.server.dispatch.WRITE_OPS`
that succeeded in memory is appended to the write-ahead log (:mod:`kalos.stores.wal`)
before its response is published: the poller keeps it pending until a group commit made it
durable, a uds thread waits for that. The in-memory state runs ahead of the log only for
responses not yet published (a concurrent search may already see such a write; a crash
loses exactly those, none of them acknowledged). A request that fails validation is never
logged. The log holds request bodies verbatim, with the request's wall-clock time, so
recovery replays them through the same :meth:`Dispatcher.handle` (``now_ns`` = the logged
time) and needs nothing from the stores but determinism.

Layout of ``DIR``::

    LOCK                      flock()ed by the sidecar that owns the directory
    identity.json             what the stores' data depend on (dim, metric, tokenizer)
    wal/wal-<LSN>.log         log segments (kalos.stores.wal)
    snap-<LSN>/               the newest complete snapshot: every store's state through LSN
        snapshot.db           SQLite: table snapshot_meta, and each store's tables
        *.npy                 each store's flat arrays (vectors, token ids, ...)

A snapshot is taken on the poller thread between sweeps, once the log grew by
``snapshot_bytes`` since the last one, and at a clean stop. With the dispatch lock held (no
request runs) the log is synced and rotated, then the stores are written into
``snap-<LSN>.tmp/``: by default (``fork=True``) from a forked child process, a copy-on-write
image of the stores as of that LSN, so serving pauses only for the ``fork()`` (tens of ms for
a 1M x 128 store) while the child writes; with ``fork=False`` (GPU indexes: CUDA does not
survive a fork) the poller writes them itself and serving pauses for all of it (seconds for
1M x 128 vectors with payloads: bench/results/recovery-ci-2core.json). A background thread then
fsyncs the files, renames the directory into place, and deletes the older snapshot and the
log segments it covers. A crash at any point leaves either the old snapshot plus the whole
log, or the new one plus the log after it; a snapshot that fails (a full disk, a child that
dies) is logged and leaves the log covering everything. While a forked child writes, pages
the parent changes are copied: memory can grow by up to the stores' size meanwhile. The
same machinery (:class:`SnapshotDirectory`) writes and restores the snapshots of a
``--source`` replica (kalos.server.source), named by feed position, with no log.

Recovery (before the sidecar reports ready): check ``identity.json`` against this sidecar's
configuration, restore the newest ``snap-*``, replay the log records after its LSN, cut a
torn tail, open a fresh segment, write ``identity.json``. A different dim or metric is
refused at once (ConfigError); a different tokenizer only while the log holds records after
the newest snapshot (replaying a turn or memory sent without token ids tokenizes it again,
which with another tokenizer would give other ids than the ones acknowledged).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import logging
import os
import re
import shutil
import signal
import sqlite3
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any, Literal, Protocol

import numpy as np

from kalos.errors import ConfigError, StoreError
from kalos.protocol.codes import Status
from kalos.protocol.messages import encode_text
from kalos.server.dispatch import WRITE_OPS, Dispatcher
from kalos.stores.wal import DEFAULT_SEGMENT_BYTES, FsyncPolicy, WalError, WriteAheadLog, fsync_dir

log = logging.getLogger("kalos.durability")

SNAPSHOT_FORMAT = 1
DEFAULT_SNAPSHOT_BYTES = 256 << 20
_SNAPSHOT_NAME = re.compile(r"^snap-(\d{20})$")
_REPLAY_OUT_BYTES = 1 << 20
CHILD_TIMEOUT_S = 1800.0  # a forked snapshot writer still running after this is killed
_PR_SET_PDEATHSIG = 1
LOCK_WAIT_S = 10.0  # a stopping sidecar may still hold the data directory this long
IDENTITY_FILE = "identity.json"
# Identity keys that only the log's replay depends on (a snapshot holds their results): a
# change is refused only while records after the newest snapshot remain to be replayed.
REPLAY_KEYS = frozenset({"tokenizer"})


class Journal(Protocol):
    """What the poller and the uds and grpc threads call around a write's dispatch:
    :class:`Durability` (the local log), or :class:`~kalos.server.source.Source` (PostgreSQL)."""

    last_lsn: int

    def commit(self) -> None: ...

    def outcome(self, lsn: int) -> Literal[True] | str | None: ...

    def wait(self, lsn: int) -> Literal[True] | str: ...

    def sync(self) -> None: ...

    def snapshot_due(self) -> bool: ...

    def snapshot(self, *, background: bool = True) -> Any: ...


class Snapshotting(Protocol):
    """A store whose whole state a snapshot can write and a recovery read back."""

    def snapshot(self, db: sqlite3.Connection, directory: str) -> None: ...

    def restore(self, db: sqlite3.Connection, directory: str) -> None: ...


def snapshot_name(lsn: int) -> str:
    return f"snap-{lsn:020d}"


def list_snapshots(data_dir: str) -> list[tuple[int, str]]:
    """(LSN, path) of every complete snapshot in ``data_dir``, oldest first."""
    out = []
    for name in os.listdir(data_dir):
        m = _SNAPSHOT_NAME.match(name)
        if m and os.path.isdir(os.path.join(data_dir, name)):
            out.append((int(m.group(1)), os.path.join(data_dir, name)))
    return sorted(out)


def _fsync_tree(path: str) -> None:
    for name in os.listdir(path):
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fsync_dir(path)


class SnapshotDirectory:
    """A data directory's snapshots: the directory lock, writing a snapshot (from a forked
    child or in place), finishing it (fsync, rename, older ones deleted) and restoring one.

    :class:`Durability` numbers its snapshots by log LSN;
    :class:`~kalos.server.source.Source` by change-feed position. ``stores`` are written in
    their order; ``identity`` is recorded in every snapshot.
    """

    def __init__(
        self,
        data_dir: str,
        lock: threading.Lock,
        stores: Mapping[str, Snapshotting],
        *,
        identity: Mapping[str, Any] | None = None,
        fork: bool = True,
    ) -> None:
        self.data_dir = os.path.abspath(data_dir)
        self.fork = fork  # write background snapshots from a forked child (copy-on-write)
        self.lock = lock
        self.stores = dict(stores)
        # What must match between the sidecar that wrote a snapshot and the one reading it.
        self.identity = dict(identity or {})
        self.snapshot_lsn = 0  # of the newest complete snapshot
        self.snapshot_taken = -float("inf")  # when it was taken (time.perf_counter)
        self.meta: dict[str, str] = {}  # more snapshot_meta rows, recorded in every snapshot
        self._finisher: threading.Thread | None = None
        self._lock_fd = -1
        self.last_snapshot: dict[str, Any] = {}

    @property
    def busy(self) -> bool:
        """A snapshot is still being finished (in the background)."""
        return self._finisher is not None and self._finisher.is_alive()

    def wait_finished(self, timeout: float | None = None) -> bool:
        """Waits for a snapshot being finished; True when none is left running."""
        if self._finisher is not None:
            self._finisher.join(timeout)
            if self._finisher.is_alive():
                return False
            self._finisher = None
        return True

    def take_lock(self) -> None:
        fd = os.open(os.path.join(self.data_dir, "LOCK"), os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise ConfigError(
                        f"another sidecar is using the data directory {self.data_dir}"
                    ) from None
                time.sleep(0.05)
        self._lock_fd = fd

    def release_lock(self) -> None:
        if self._lock_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)
            self._lock_fd = -1

    def remove_unfinished(self) -> None:
        """Deletes the temporary directories of snapshots that never finished."""
        for name in os.listdir(self.data_dir):
            if name.startswith("snap-") and name.endswith(".tmp"):
                shutil.rmtree(os.path.join(self.data_dir, name), ignore_errors=True)

    def read_meta(self, path: str, lsn: int) -> dict[str, str]:
        """The snapshot's ``snapshot_meta``; StoreError when this version cannot read it."""
        try:
            db = sqlite3.connect(f"file:{os.path.join(path, 'snapshot.db')}?mode=ro", uri=True)
            try:
                meta = dict(db.execute("SELECT key, value FROM snapshot_meta").fetchall())
            finally:
                db.close()
        except sqlite3.Error as exc:
            raise StoreError(f"{path}: unreadable ({exc})") from exc
        if int(meta.get("format", -1)) != SNAPSHOT_FORMAT or int(meta.get("lsn", -1)) != lsn:
            raise StoreError(f"{path}: not a snapshot this version can read")
        return meta

    def restore_stores(self, path: str) -> None:
        """Reads every store of the snapshot at ``path`` back (replacing what they hold)."""
        db = sqlite3.connect(os.path.join(path, "snapshot.db"))
        try:
            meta = dict(db.execute("SELECT key, value FROM snapshot_meta").fetchall())
            for name in json.loads(meta["stores"]):
                store = self.stores.get(name)
                if store is None:
                    raise ConfigError(f"{path} holds a {name!r} store this sidecar lacks")
                store.restore(db, path)
        finally:
            db.close()

    def begin(self, lsn: int, background: bool) -> tuple[str, int, list[Any]] | None:
        """Starts the snapshot through ``lsn`` (called with the dispatch lock held): writes
        the stores into a temporary directory, from a forked child when ``background`` and
        :attr:`fork`. Returns (directory, child pid or 0, holds), or None when it failed."""
        # Named by pid too: a writer orphaned by a crash never shares a directory.
        tmp = os.path.join(self.data_dir, f"{snapshot_name(lsn)}.{os.getpid()}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        child = 0
        holds: list[Any] = []
        try:
            os.makedirs(tmp, mode=0o700)
            if background and self.fork:
                # A store in shared memory (the token heap) is not copied on write for the
                # child: it keeps what it frees from reuse until the child is done.
                holds = [
                    h
                    for store in self.stores.values()
                    if (h := getattr(store, "hold", lambda: None)()) is not None
                ]
                child = self._fork_writer(tmp, lsn)
            else:
                self._write_stores(tmp, lsn)
        except Exception:  # e.g. the disk filled up
            log.exception("the snapshot through %d failed", lsn)
            shutil.rmtree(tmp, ignore_errors=True)
            for h in holds:
                h.release()
            return None
        return tmp, child, holds

    def launch(
        self, begun: tuple[str, int, list[Any]], lsn: int, t0: float, background: bool
    ) -> dict[str, Any]:
        """After :meth:`begin` (the lock released): finishes the snapshot, in a thread when
        ``background``."""
        tmp, child, holds = begun
        paused = time.perf_counter() - t0
        info: dict[str, Any] = {"lsn": lsn, "pause_s": round(paused, 3), "forked": bool(child)}
        if background:
            self._finisher = threading.Thread(
                target=self._finish,
                args=(tmp, lsn, info, t0, child, holds),
                name="kalos-snapshot",
                daemon=True,
            )
            self._finisher.start()
        else:
            self._finish(tmp, lsn, info, t0, child, holds)
        return info

    def _fork_writer(self, directory: str, lsn: int) -> int:
        """Forks a child that writes the stores as they are now; returns its pid.

        Called with the dispatch lock held, so the child's copy is the state through ``lsn``.
        The child touches nothing but the stores, numpy and a new SQLite file, then exits
        without running any of the parent's cleanup.
        """
        parent = os.getpid()
        pid = os.fork()
        if pid:
            return pid
        code = 1
        try:  # the child
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            # Die with the sidecar (a crash must not leave a writer behind), and let go of
            # every descriptor it inherited: the listening socket and the data directory's
            # lock must not outlive the sidecar, or a restart would find them taken.
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != parent:
                os._exit(1)
            os.closerange(3, os.sysconf("SC_OPEN_MAX"))
            self._write_stores(directory, lsn)
            code = 0
        except BaseException:
            with contextlib.suppress(BaseException):
                traceback.print_exc(file=sys.stderr)
                sys.stderr.flush()
        finally:
            os._exit(code)

    def _reap(self, child: int) -> bool:
        """Waits for a forked snapshot writer; True when it wrote the snapshot."""
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        while True:
            pid, status = os.waitpid(child, os.WNOHANG)
            if pid:
                code = os.waitstatus_to_exitcode(status)
                if code:
                    log.error("the snapshot writer (pid %d) failed with exit code %d", child, code)
                return code == 0
            if time.monotonic() > deadline:
                log.error("the snapshot writer (pid %d) hung: killing it", child)
                with contextlib.suppress(OSError):
                    os.kill(child, signal.SIGKILL)
                os.waitpid(child, 0)
                return False
            time.sleep(0.02)

    def _write_stores(self, directory: str, lsn: int) -> None:
        db = sqlite3.connect(os.path.join(directory, "snapshot.db"), isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode=OFF")  # a new file, fsynced before it is used
            db.execute("PRAGMA synchronous=OFF")
            db.execute("BEGIN")
            for store in self.stores.values():
                store.snapshot(db, directory)
            rows = {
                "format": str(SNAPSHOT_FORMAT),
                "lsn": str(lsn),
                "created_ns": str(time.time_ns()),
                "stores": json.dumps(list(self.stores)),
                "identity": json.dumps(self.identity),
                **self.meta,
            }
            db.execute("CREATE TABLE snapshot_meta (key TEXT PRIMARY KEY, value TEXT)")
            db.executemany("INSERT INTO snapshot_meta VALUES (?, ?)", rows.items())
            db.execute("COMMIT")
        finally:
            db.close()

    def _finish(
        self,
        tmp: str,
        lsn: int,
        info: dict[str, Any],
        t0: float,
        child: int = 0,
        holds: list[Any] | None = None,
    ) -> None:
        try:
            reaped = not child or self._reap(child)
        finally:
            for h in holds or ():
                h.release()  # the child is gone: what it could read may be reused
        if not reaped:
            shutil.rmtree(tmp, ignore_errors=True)
            return
        try:
            _fsync_tree(tmp)
            final = os.path.join(self.data_dir, snapshot_name(lsn))
            shutil.rmtree(final, ignore_errors=True)  # one through the same position
            os.rename(tmp, final)
            fsync_dir(self.data_dir)
            # The new snapshot is durable: older ones (and what it covers) can go.
            for old_lsn, path in list_snapshots(self.data_dir):
                if old_lsn != lsn:
                    shutil.rmtree(path, ignore_errors=True)
            self._covered(lsn, info)
            self.snapshot_lsn = lsn
            self.snapshot_taken = t0
            info["total_s"] = round(time.perf_counter() - t0, 3)
            info["bytes"] = sum(os.path.getsize(os.path.join(final, f)) for f in os.listdir(final))
            self.last_snapshot = info
            log.info("snapshot %s", json.dumps(info))
        except OSError:
            log.exception("the snapshot through %d failed", lsn)
            shutil.rmtree(tmp, ignore_errors=True)

    def _covered(self, lsn: int, info: dict[str, Any]) -> None:
        """Called once the snapshot through ``lsn`` is durable (Durability: deletes the log
        segments it covers)."""


class Durability(SnapshotDirectory):
    """Logs a sidecar's writes and recovers its stores (see the module docstring).

    ``handle`` stands in for :meth:`Dispatcher.handle` in the poller and the uds threads
    (called under the dispatch ``lock``); after it, :attr:`last_lsn` is the LSN of the record
    the call logged, or 0 when it logged none (a read, or a failed write): the caller then
    publishes at once. For a record, it asks :meth:`outcome` (poller) or :meth:`wait` (uds)
    before publishing.
    """

    def __init__(
        self,
        data_dir: str,
        dispatcher: Dispatcher,
        lock: threading.Lock,
        stores: Mapping[str, Snapshotting],
        *,
        policy: FsyncPolicy | None = None,
        snapshot_bytes: int = DEFAULT_SNAPSHOT_BYTES,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        identity: Mapping[str, Any] | None = None,
        fork: bool = True,
    ) -> None:
        super().__init__(data_dir, lock, stores, identity=identity, fork=fork)
        self.dispatcher = dispatcher
        self.snapshot_bytes = snapshot_bytes
        self.wal = WriteAheadLog(
            os.path.join(self.data_dir, "wal"),
            policy=policy,
            segment_bytes=segment_bytes,
        )
        self.last_lsn = 0
        self._snapshot_wal_bytes = 0  # wal.bytes_written when the last snapshot was taken
        self.recovery: dict[str, Any] = {}
        self.refused_writes = 0

    @property
    def on_durable(self) -> Callable[[], None] | None:
        return self.wal.on_durable

    @on_durable.setter
    def on_durable(self, fn: Callable[[], None] | None) -> None:
        self.wal.on_durable = fn

    # -- serving -------------------------------------------------------------------------------

    def handle(
        self, op: int, flags: int, body: np.ndarray, out: np.ndarray, **options: Any
    ) -> tuple[int, int, int, int]:
        """Dispatcher.handle, logging a successful write (see the class docstring).

        ``options`` go to the dispatcher as they are (e.g. a channel's GPU buffer).
        """
        self.last_lsn = 0
        if op not in WRITE_OPS:
            return self.dispatcher.handle(op, flags, body, out, **options)
        wal = self.wal
        if wal.refusal():
            wal.retry()
            refusal = wal.refusal()
            if refusal:
                self.refused_writes += 1
                return Status.SERVER_ERROR, encode_text(out, refusal), 0, 0
        now = time.time_ns()
        status, n, compute_ns, write_ns = self.dispatcher.handle(
            op, flags, body, out, now_ns=now, **options
        )
        if status == Status.OK:
            try:
                self.last_lsn = wal.append(op, flags, body, now)
            except WalError as exc:  # closed under us, or a body too large to log
                return Status.SERVER_ERROR, encode_text(out, str(exc)), compute_ns, write_ns
        return status, n, compute_ns, write_ns

    def commit(self) -> None:
        """Starts the group commit of every record appended so far (poller: end of a sweep)."""
        self.wal.commit()

    def outcome(self, lsn: int) -> Literal[True] | str | None:
        """True when record ``lsn`` is durable, the failure's message, or None (pending)."""
        return self.wal.outcome(lsn)

    def sync(self) -> None:
        """Makes every appended record durable now, whatever the policy (at stop)."""
        with contextlib.suppress(WalError):
            self.wal.sync()

    def wait(self, lsn: int) -> Literal[True] | str:
        """Blocks until record ``lsn`` is durable (True) or failed (its message)."""
        result = self.wal.wait(lsn)
        return "the write-ahead log did not answer" if result is None else result

    # -- recovery ------------------------------------------------------------------------------

    def recover(self) -> dict[str, Any]:
        """Restores the newest snapshot, replays the log after it, opens the log for writes.

        Runs before the sidecar reports ready. Returns (and keeps in :attr:`recovery`) what it
        did: snapshot LSN, records replayed, seconds per stage.
        """
        t0 = time.perf_counter()
        os.makedirs(self.data_dir, mode=0o700, exist_ok=True)
        self.take_lock()
        changed = self._check_identity()
        self.remove_unfinished()
        snapshots = list_snapshots(self.data_dir)
        lsn = 0
        if snapshots:
            lsn, path = snapshots[-1]
            self._restore(path, lsn)
        t1 = time.perf_counter()
        replayed = failed = 0
        out = np.zeros(_REPLAY_OUT_BYTES, np.uint8)
        handle = self.dispatcher.handle
        for record in self.wal.recover(lsn):
            if changed:
                key, theirs, ours = changed[0]
                raise ConfigError(
                    f"the data directory {self.data_dir} holds writes logged with "
                    f"{key}={theirs!r} and not yet in a snapshot; this sidecar has "
                    f"{key}={ours!r}, and replaying them would give other results than the "
                    f"ones acknowledged. Start it once with the {key} it had (a clean stop "
                    "then snapshots the log), then switch."
                )
            status, n, _, _ = handle(record.op, record.flags, record.body, out, record.time_ns)
            replayed += 1
            if status != Status.OK:
                failed += 1
                log.warning(
                    "replaying LSN %d (op %d) gave status %d: %s",
                    record.lsn,
                    record.op,
                    status,
                    bytes(out[:n]).decode(errors="replace"),
                )
        t2 = time.perf_counter()
        self.wal.open()
        self._write_identity()
        self.snapshot_lsn = lsn
        # The log already holds this much beyond the snapshot: it counts toward the next one.
        self._snapshot_wal_bytes = -self.wal.recovered_bytes
        self.recovery = {
            "snapshot_lsn": lsn,
            "records_replayed": replayed,
            "replay_errors": failed,
            "last_lsn": self.wal.last_lsn,
            "restore_s": round(t1 - t0, 3),
            "replay_s": round(t2 - t1, 3),
            "total_s": round(time.perf_counter() - t0, 3),
        }
        log.info("recovered %s: %s", self.data_dir, json.dumps(self.recovery))
        return self.recovery

    def _check_identity(self) -> list[tuple[str, Any, Any]]:
        """Compares ``identity.json`` (when there is one) with :attr:`identity`: raises
        ConfigError for a key that must never change; returns the changed REPLAY_KEYS as
        (key, theirs, ours)."""
        path = os.path.join(self.data_dir, IDENTITY_FILE)
        try:
            with open(path) as f:
                theirs = json.load(f)
        except FileNotFoundError:
            return []  # a new directory, or one written before the file existed
        except (OSError, ValueError) as exc:
            raise StoreError(f"{path} is unreadable: {exc}") from exc
        if theirs.get("journal", "wal") != "wal":  # a --source replica's snapshots
            raise ConfigError(
                f"the data directory {self.data_dir} holds snapshots of a replica of a source "
                "database (--source), not a write-ahead log: give this sidecar another --data-dir"
            )
        changed = []
        for key, ours in self.identity.items():
            if key not in theirs or theirs[key] == ours:
                continue
            if key not in REPLAY_KEYS:
                raise ConfigError(
                    f"the data directory {self.data_dir} holds {key}={theirs[key]!r}; "
                    f"this sidecar is configured with {key}={ours!r}"
                )
            changed.append((key, theirs[key], ours))
        return changed

    def _write_identity(self) -> None:
        """Records this sidecar's identity in the directory (atomically, durably)."""
        path = os.path.join(self.data_dir, IDENTITY_FILE)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.identity, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(self.data_dir)

    def _restore(self, path: str, lsn: int) -> None:
        meta = self.read_meta(path, lsn)
        theirs = json.loads(meta.get("identity", "{}"))
        for key, value in self.identity.items():
            if key in theirs and theirs[key] != value and key not in REPLAY_KEYS:
                raise ConfigError(
                    f"the data directory {self.data_dir} holds {key}={theirs[key]!r}; "
                    f"this sidecar is configured with {key}={value!r}"
                )
        self.restore_stores(path)

    # -- snapshots -----------------------------------------------------------------------------

    def snapshot_due(self) -> bool:
        """Whether the log grew past ``snapshot_bytes`` since the last snapshot."""
        return (
            self.wal.bytes_written - self._snapshot_wal_bytes >= self.snapshot_bytes
            and (self._finisher is None or not self._finisher.is_alive())
            and not self.wal.refusal()
        )

    def snapshot(self, *, background: bool = True) -> dict[str, Any] | None:
        """Writes every store through the last LSN; the caller must not hold the lock.

        Returns what it did, or None when nothing was logged since the last snapshot or a
        snapshot is still being finished. ``background``: fsync, rename and delete the
        covered log segments in a thread (the poller keeps serving meanwhile).
        """
        if self._finisher is not None:
            self._finisher.join()
            self._finisher = None
        t0 = time.perf_counter()
        with self.lock:
            if self.wal.last_lsn == self.snapshot_lsn:
                self._snapshot_wal_bytes = self.wal.bytes_written
                return None
            try:
                lsn = self.wal.rotate()
            except WalError as exc:
                log.error("no snapshot: %s", exc)
                return None
            # Whatever happens, the next try waits for another snapshot_bytes of log.
            self._snapshot_wal_bytes = self.wal.bytes_written
            begun = self.begin(lsn, background)
            if begun is None:  # the log still covers everything
                return None
        return self.launch(begun, lsn, t0, background)

    def _covered(self, lsn: int, info: dict[str, Any]) -> None:
        info["segments_deleted"] = self.wal.delete_through(lsn)

    def close(self, timeout: float | None = None) -> bool:
        """At a clean stop: a final snapshot (when anything was logged), then the log closes.

        ``timeout`` (seconds, None: no limit) bounds the stop: a snapshot still being
        finished, or the final one, that has not ended by then is left to the process's exit
        (it writes into a temporary directory, which the next start removes); the log covers
        every write, and the next start replays it. Returns whether no snapshot was left
        running (if one was, it may still read the stores: the caller must not free them)."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        writer: threading.Thread | None = None
        try:
            if self._finisher is not None:
                self._finisher.join(left())
                if self._finisher.is_alive():
                    log.warning("a snapshot is still being finished: no last snapshot")
                    writer = self._finisher
            if writer is None and not self.wal.refusal():
                writer = threading.Thread(
                    target=self._last_snapshot, name="kalos-last-snapshot", daemon=True
                )
                writer.start()
                writer.join(left())
                if writer.is_alive():
                    log.warning(
                        "the last snapshot did not finish within %.1f s: left unfinished; the "
                        "write-ahead log covers every write (the next start replays it)",
                        timeout,
                    )
                else:
                    writer = None
        finally:
            if writer is None and self._finisher is not None:
                self._finisher.join(left())
            self.wal.close()
            # a writer left running keeps the data directory's lock until the process exits
            if writer is None:
                self.release_lock()
        return writer is None

    def _last_snapshot(self) -> None:
        try:
            self.snapshot(background=False)
        except Exception:
            log.exception("the snapshot at stop failed; the log still covers every write")

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"data_dir": self.data_dir, **self.wal.stats()}
        out["snapshot_lsn"] = self.snapshot_lsn
        out["refused_writes"] = self.refused_writes
        if self.last_snapshot:
            out["last_snapshot"] = self.last_snapshot
        if self.recovery:
            out["recovery"] = self.recovery
        return out
