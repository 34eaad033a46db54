"""The write-ahead log: every acknowledged write, in order, as checksummed records.

The log keeps the *request* of every mutating op verbatim, so recovery replays it through the
same dispatcher that served it (see :mod:`kalos.server.durability`). It knows nothing about
the stores.

On disk (little-endian), ``DIR/wal-<first LSN, 20 digits>.log`` segments::

    segment header, 32 bytes: magic b"KALOWAL\\0", u32 version (1), u32 0, u64 first LSN, u64 0
    records, each 8-byte aligned:
        4s  magic b"KREC"
        u32 crc32 (zlib) of bytes 8 .. 40 + body_len of the record
        u64 LSN            consecutive from 1 across segments
        u64 time_ns        wall-clock time of the request (CLOCK_REALTIME, ns)
        u32 op, u32 flags  as in the request header
        u32 body_len, u32 0
        body_len bytes of request body, zero-padded to 8

A record is valid when its magic, length and crc check out. A segment is preallocated
(``fallocate``: an fdatasync then need not journal a size change, measured 150 µs vs
300-800 µs per append+sync on the CI VM), so it ends at the first all-zero header; the
last segment may end in a torn record (a crash inside ``write()``), which recovery cuts
off: nothing after it is replayed. Segments are trimmed to their used length when the
log rotates to the next one.

Group commit: :meth:`WriteAheadLog.append` only adds a record to an in-memory batch.
With ``fsync=always`` a flusher thread turns each batch into one ``write()`` and one
``fdatasync()`` and everything appended while that ran forms the next batch, so
concurrent writers share a sync; :meth:`outcome` and :meth:`wait` tell a caller when its
record is durable (or that it failed) and ``on_durable`` pokes the poller. With
``interval:MS`` and ``off``, :meth:`commit` writes the batch in the calling thread (an ack
then waits for ``write()`` only: the record survives a crash of the sidecar, not of the
host); ``interval`` syncs from a background thread every MS, ``off`` leaves it to the OS.

Failures: a ``write()`` that fails (ENOSPC: disk full, EFBIG) is cut back off the file; its
records stay queued and are retried (every second, or when :meth:`retry` is called), the
writes waiting on them are told "disk full" and :meth:`refusal` asks callers to refuse new
writes meanwhile. A failed ``fdatasync`` (EIO) cannot be retried safely (the kernel may have
dropped the dirty pages), so the log refuses every later write until the sidecar restarts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import itertools
import logging
import os
import re
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from typing import Literal, NamedTuple

import numpy as np

from kalos.errors import ConfigError, StoreError

log = logging.getLogger("kalos.wal")

SEGMENT_MAGIC = b"KALOWAL\0"
SEGMENT_VERSION = 1
SEGMENT_HEADER = struct.Struct("<8sIIQQ")  # 32 bytes
RECORD_MAGIC = b"KREC"
RECORD_HEADER = struct.Struct("<4sIQQIIII")  # 40 bytes
_RECORD_TAIL = struct.Struct("<QQIIII")  # the header after magic and crc: what the crc covers
MAX_BODY = (1 << 32) - 1
DEFAULT_SEGMENT_BYTES = 64 << 20
RETRY_AFTER_FAILURE_S = 1.0
_SEGMENT_NAME = re.compile(r"^wal-(\d{20})\.log$")
_ZEROS = bytes(8)


def _pad8(n: int) -> int:
    return (n + 7) & ~7


class WalError(StoreError):
    """The log cannot take or keep a record (disk full, a failed sync, or it is closed)."""


class WalCorrupt(WalError):
    """A record before the log's tail is damaged, or records are missing: refuse to guess."""


@dataclasses.dataclass(frozen=True)
class FsyncPolicy:
    """When an acknowledged write is synced: ``always`` (default), ``interval:MS`` or ``off``."""

    kind: str = "always"
    interval_ms: float = 0.0

    @classmethod
    def parse(cls, text: str) -> FsyncPolicy:
        text = text.strip().lower()
        if text in ("always", "off"):
            return cls(text)
        if text.startswith("interval:"):
            try:
                ms = float(text.split(":", 1)[1])
            except ValueError:
                ms = -1.0
            if ms > 0:
                return cls("interval", ms)
        raise ConfigError(f"fsync policy must be always, off or interval:MS (MS > 0); got {text!r}")

    def __str__(self) -> str:
        return f"interval:{self.interval_ms:g}" if self.kind == "interval" else self.kind


class Record(NamedTuple):
    lsn: int
    time_ns: int
    op: int
    flags: int
    body: np.ndarray  # uint8 view into the segment as read, 8-byte aligned; valid while iterated


def segment_name(first_lsn: int) -> str:
    return f"wal-{first_lsn:020d}.log"


def list_segments(directory: str) -> list[tuple[int, str]]:
    """(first LSN, path) of every segment in ``directory``, oldest first."""
    out = []
    for name in os.listdir(directory):
        m = _SEGMENT_NAME.match(name)
        if m:
            out.append((int(m.group(1)), os.path.join(directory, name)))
    return sorted(out)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def encode_record(lsn: int, time_ns: int, op: int, flags: int, body: object) -> bytes:
    """One record's bytes (header, body, padding); ``body`` is any contiguous buffer."""
    view = memoryview(body).cast("B")  # type: ignore[arg-type]
    n = view.nbytes
    tail = _RECORD_TAIL.pack(lsn, time_ns, op, flags, n, 0)
    crc = zlib.crc32(view, zlib.crc32(tail))
    return b"".join((RECORD_MAGIC, struct.pack("<I", crc), tail, view, _ZEROS[: _pad8(n) - n]))


def _scan(data: np.ndarray, start: int) -> Iterator[tuple[int, Record]]:
    """Valid records of a segment's bytes from ``start``; yields (offset after it, record)."""
    end = len(data)
    off = start
    while off + RECORD_HEADER.size <= end:
        magic, crc, lsn, time_ns, op, flags, n, _ = RECORD_HEADER.unpack_from(data, off)
        if magic != RECORD_MAGIC:
            return
        body_at = off + RECORD_HEADER.size
        if body_at + n > end:
            return
        body = data[body_at : body_at + n]
        if zlib.crc32(body, zlib.crc32(data[off + 8 : body_at])) != crc:
            return
        off = body_at + _pad8(n)
        yield min(off, end), Record(lsn, time_ns, op, flags, body)


# The two system calls the log's durability rests on (module functions: tests inject faults).
def _write_all(fd: int, data: memoryview) -> None:
    while data:
        n = os.write(fd, data)
        data = data[n:]


def _fdatasync(fd: int) -> None:
    os.fdatasync(fd)


class WriteAheadLog:
    """An append-only log of write requests in ``directory`` (see the module docstring).

    Use: :meth:`recover` (iterate the records after a snapshot's LSN; it also cuts a torn
    tail), then :meth:`open` (start a new segment for appends), then :meth:`append` and
    :meth:`commit` from the serving threads, :meth:`close` at the end. ``append`` and the
    state queries are safe from any thread.
    """

    def __init__(
        self,
        directory: str,
        *,
        policy: FsyncPolicy | None = None,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        on_durable: Callable[[], None] | None = None,
    ) -> None:
        self.directory = directory
        self.policy = policy or FsyncPolicy()
        self.segment_bytes = segment_bytes
        self.on_durable = on_durable  # called after a batch became durable (or failed)
        os.makedirs(directory, exist_ok=True)
        self._cond = threading.Condition()
        self._io = threading.Lock()  # file writes, syncs, rotation: one at a time, in order
        self._buf = bytearray()  # records appended, not yet written
        self._appended = 0  # LSN of the last record appended
        self._written = 0  # ... written to the file
        self._synced = 0  # ... synced to disk
        self._durable = 0  # ... durable per the policy: its write may be acknowledged
        self._failed = 0  # records up to this LSN failed (unless durable since)
        self._failure = ""  # why they failed
        self._error = ""  # disk full: records queued, new writes refused until a retry works
        self._fatal = ""  # a sync failed: writes refused until restart
        self._retry_at = 0.0
        self._closing = False
        self._fd = -1
        self._opened = False  # between open() and close()
        self._pos = 0  # bytes used in the current segment
        self._segment_first = 0
        self._threads: list[threading.Thread] = []
        # counters for stats and the writes benchmark
        self.syncs = 0
        self.synced_records = 0
        self.bytes_written = 0
        self.recovered_bytes = 0  # bytes of the records recover() yielded

    # -- recovery ------------------------------------------------------------------------------

    def recover(self, after_lsn: int = 0) -> Iterator[Record]:
        """Yields the records with LSN > ``after_lsn`` in order; cuts a torn tail off the log.

        Raises WalCorrupt for damage anywhere but the tail of the last segment, or a gap in
        the LSNs. After the iteration :attr:`last_lsn` is the LSN of the last valid record
        (or ``after_lsn``). The bodies are views of the mapped segment: valid during the
        iteration step that yields them.
        """
        segments = list_segments(self.directory)
        expect = after_lsn + 1  # the next LSN we must see, once past after_lsn
        last = after_lsn
        self.recovered_bytes = 0
        for i, (first, path) in enumerate(segments):
            is_last = i == len(segments) - 1
            if not is_last and segments[i + 1][0] - 1 <= after_lsn:
                continue  # wholly covered by the snapshot (not deleted yet)
            size = os.path.getsize(path)
            # Mapped, not read: only the used part of a preallocated segment is touched.
            data = np.memmap(path, np.uint8, mode="r") if size else np.zeros(0, np.uint8)
            if size < SEGMENT_HEADER.size or bytes(data[:8]) != SEGMENT_MAGIC:
                if is_last and not data.any():
                    # created but its header never reached the disk: an empty segment
                    log.warning("removing an empty, headerless last WAL segment %s", path)
                    os.unlink(path)
                    continue
                raise WalCorrupt(f"{path} is not a WAL segment")
            _, version, _, header_first, _ = SEGMENT_HEADER.unpack_from(data, 0)
            if version != SEGMENT_VERSION or header_first != first:
                raise WalCorrupt(f"{path}: unknown version {version} or wrong first LSN")
            end = SEGMENT_HEADER.size
            lsn = first - 1
            for end, record in _scan(data, SEGMENT_HEADER.size):  # noqa: B007 (used below)
                if record.lsn != lsn + 1:
                    raise WalCorrupt(f"{path}: LSN {record.lsn} follows {lsn}")
                lsn = record.lsn
                if lsn <= after_lsn:
                    continue
                if lsn != expect:
                    raise WalCorrupt(
                        f"the log has LSN {lsn} next after {expect - 1}: records are missing"
                    )
                expect = lsn + 1
                last = lsn
                self.recovered_bytes += RECORD_HEADER.size + _pad8(len(record.body))
                yield record
            rest = data[end:]
            if not is_last and rest.any():
                raise WalCorrupt(f"{path}: damaged record at byte {end} before the log's end")
            if len(rest):
                # The last segment ends in its unused preallocation (zeros), or in a record
                # torn by a crash inside write(): it was never acknowledged. Cut either off.
                if rest[: 1 << 20].any():
                    log.warning("cutting a torn record off the WAL: %s at byte %d", path, end)
                del data, rest
                with open(path, "r+b") as f:
                    f.truncate(end)
                    os.fsync(f.fileno())
        self._appended = self._written = self._synced = self._durable = last

    # -- appending -----------------------------------------------------------------------------

    def open(self, next_lsn: int | None = None) -> None:
        """Starts a new segment at ``next_lsn`` (default: after the recovered records)."""
        if next_lsn is not None:
            self._appended = self._written = self._synced = self._durable = next_lsn - 1
        with self._io:
            self._new_segment(self._appended + 1)
            self._opened = True
        if self.policy.kind == "always":
            self._start(self._flush_loop, "kalos-wal-flush")
        elif self.policy.kind == "interval":
            self._start(self._interval_loop, "kalos-wal-sync")

    def _start(self, target: Callable[[], None], name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        self._threads.append(t)
        t.start()

    @property
    def last_lsn(self) -> int:
        """LSN of the last record appended."""
        return self._appended

    @property
    def durable_lsn(self) -> int:
        return self._durable

    def append(self, op: int, flags: int, body: np.ndarray, time_ns: int) -> int:
        """Queues a record of this request; returns its LSN. Nothing is written yet.

        The caller serialises appends with the order it applies them (the dispatch lock), so
        LSN order is apply order. It is never refused here: a caller that already applied
        the op must log it. Ask :meth:`refusal` first.
        """
        if body.nbytes > MAX_BODY:
            raise WalError(f"a request body of {body.nbytes} bytes is too large to log")
        with self._cond:
            if self._closing:
                raise WalError("the write-ahead log is closed")
            lsn = self._appended + 1
            self._buf += encode_record(lsn, time_ns, op, flags, body)
            self._appended = lsn
        return lsn

    def refusal(self) -> str:
        """Why new writes must be refused now (disk full, a failed sync, closed), or ""."""
        if self._fatal:
            return self._fatal
        if self._closing:
            return "the sidecar is stopping: writes are refused"
        return self._error

    def outcome(self, lsn: int) -> Literal[True] | str | None:
        """True once record ``lsn`` is durable; a message if it failed; None while pending."""
        if lsn <= self._durable:
            return True
        if lsn <= self._failed:
            return self._failure
        return None

    def commit(self) -> None:
        """Starts making every appended record durable; does not wait (see :meth:`wait`).

        ``always``: wakes the flusher. ``interval``/``off``: writes them now, in this thread.
        """
        if self._appended <= self._written:
            return
        if self.policy.kind == "always":
            with self._cond:
                self._cond.notify_all()
        else:
            self._flush(sync=False)

    def wait(self, lsn: int, timeout: float | None = None) -> Literal[True] | str | None:
        """Commits and blocks until record ``lsn`` is durable or failed; returns :meth:`outcome`."""
        self.commit()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while (result := self.outcome(lsn)) is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(left)
        return result

    def retry(self) -> None:
        """After a disk-full failure: tries to write the queued records again, now."""
        if self._error and not self._fatal:
            self._flush(sync=self.policy.kind == "always")

    def sync(self) -> None:
        """Writes and syncs every appended record now, whatever the policy. Raises WalError."""
        self._flush(sync=True)
        if self._durable < self._appended:
            raise WalError(self.refusal() or "the write-ahead log could not be synced")

    def _flush(self, *, sync: bool) -> None:
        """Writes the queued batch as one write(), then one fdatasync if ``sync``."""
        with self._io:
            if not self._opened:
                return
            if self._fd < 0:  # the last rotation could not create the next segment: again
                try:
                    self._new_segment(self._written + 1)
                except OSError as exc:
                    self._write_failed(bytearray(), self._appended, exc)
                    return
            with self._cond:
                data, self._buf = self._buf, bytearray()
                last = self._appended
                first_unwritten = self._written + 1
            if data:
                try:
                    _write_all(self._fd, memoryview(data))
                except OSError as exc:
                    self._write_failed(data, last, exc)
                    return
                self._pos += len(data)
                self.bytes_written += len(data)
            records = last - self._synced
            if sync and last > self._synced:
                try:
                    _fdatasync(self._fd)
                except OSError as exc:
                    self._sync_failed(last, exc)
                    return
                self.syncs += 1
                self.synced_records += records
            with self._cond:
                self._written = last
                if sync:
                    self._synced = last
                if sync or self.policy.kind != "always":
                    self._durable = max(self._durable, last)
                self._error = ""
                self._retry_at = 0.0
                self._cond.notify_all()
            if self._pos >= self.segment_bytes and last >= first_unwritten:
                self._rotate_locked()
        if self.on_durable is not None:
            self.on_durable()

    def _write_failed(self, data: bytearray, last: int, exc: OSError) -> None:
        # Cut whatever part of the batch reached the file, so the log stays a sequence of
        # whole records, and queue the batch again in front of anything appended since.
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, self._pos)
        with contextlib.suppress(OSError):
            os.lseek(self._fd, self._pos, os.SEEK_SET)
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
        reason = "disk full" if full else "write failed"
        message = (
            f"{reason}: the write-ahead log could not be written ({exc.strerror or exc}); "
            "the write is not acknowledged and its outcome is unknown (applied in memory, it "
            "is logged if space is freed before the sidecar stops): retry it once writes are "
            "accepted; writes are refused until space is freed, reads are served"
        )
        log.error("%s", message)
        with self._cond:
            self._buf = data + self._buf
            self._failed = last
            self._failure = message
            self._error = message
            self._retry_at = time.monotonic() + RETRY_AFTER_FAILURE_S
            self._cond.notify_all()
        if self.on_durable is not None:
            self.on_durable()

    def _sync_failed(self, last: int, exc: OSError) -> None:
        message = (
            f"the write-ahead log's fdatasync failed ({exc.strerror or exc}); the write is not "
            "acknowledged and writes are refused until the sidecar restarts; reads are served"
        )
        log.critical("%s", message)
        with self._cond:
            self._failed = max(last, self._appended)
            self._failure = message
            self._fatal = message
            self._cond.notify_all()
        if self.on_durable is not None:
            self.on_durable()

    def _flush_loop(self) -> None:
        """fsync=always: one write() + fdatasync per batch, batches formed while it runs."""
        while True:
            with self._cond:
                while not self._closing and (
                    not self._buf or self._fatal or time.monotonic() < self._retry_at
                ):
                    wait = None
                    if self._buf and not self._fatal:  # waiting out a failure's back-off
                        wait = max(0.0, self._retry_at - time.monotonic())
                    self._cond.wait(wait)
                if self._closing:
                    return
            try:
                self._flush(sync=True)
            except Exception as exc:  # a bug: fail the waiting writes rather than hang them
                log.exception("the write-ahead log's flusher failed")
                self._sync_failed(self._appended, OSError(0, f"{type(exc).__name__}: {exc}"))
                return

    def _interval_loop(self) -> None:
        period = self.policy.interval_ms / 1e3
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closing, timeout=period)
                if self._closing:
                    return
            if self._error and not self._fatal and time.monotonic() >= self._retry_at:
                self._flush(sync=True)
                continue
            # Sync a duplicate of the descriptor without holding the I/O lock: the poller's
            # write()s (the acknowledgements) must not wait for this fdatasync.
            with self._io:
                if self._fd < 0 or self._written <= self._synced or self._fatal:
                    continue
                last = self._written
                fd = os.dup(self._fd)
            try:
                _fdatasync(fd)
            except OSError as exc:
                self._sync_failed(last, exc)
                continue
            finally:
                os.close(fd)
            with self._io:
                if last > self._synced:
                    self.syncs += 1
                    self.synced_records += last - self._synced
                    self._synced = last

    # -- segments ------------------------------------------------------------------------------

    def _new_segment(self, first_lsn: int) -> None:
        path = os.path.join(self.directory, segment_name(first_lsn))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            with contextlib.suppress(OSError):  # not every filesystem preallocates
                os.posix_fallocate(fd, 0, self.segment_bytes)
            _write_all(fd, memoryview(SEGMENT_HEADER.pack(SEGMENT_MAGIC, 1, 0, first_lsn, 0)))
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        fsync_dir(self.directory)
        self._fd = fd
        self._pos = SEGMENT_HEADER.size
        self._segment_first = first_lsn

    def _close_segment(self) -> None:
        """Syncs the current segment, trims its preallocated tail and closes it."""
        if self._fd < 0:
            return
        fd, self._fd = self._fd, -1
        try:
            os.ftruncate(fd, self._pos)
            os.fsync(fd)
        finally:
            os.close(fd)

    def _rotate_locked(self) -> None:
        self._close_segment()
        self._synced = self._written
        # On failure (disk full) the next flush tries again, its records failing meanwhile.
        with contextlib.suppress(OSError):
            self._new_segment(self._written + 1)

    def rotate(self) -> int:
        """Syncs everything appended, starts a new segment; returns the last LSN before it.

        A snapshot calls it with the dispatch lock held, so no record is appended meanwhile:
        every segment but the new one then holds only records at or before that LSN.
        """
        self.sync()
        with self._io:
            if self._fd >= 0 and self._pos > SEGMENT_HEADER.size:
                self._rotate_locked()
        return self._written

    def delete_through(self, lsn: int) -> int:
        """Deletes the segments whose every record is at or before ``lsn``; returns how many."""
        segments = list_segments(self.directory)
        deleted = 0
        for (_, path), (next_first, _) in itertools.pairwise(segments):
            if next_first - 1 <= lsn and next_first <= self._segment_first:
                os.unlink(path)
                deleted += 1
        if deleted:
            fsync_dir(self.directory)
        return deleted

    def close(self) -> None:
        """Writes and syncs what is queued (if it can), stops the threads, closes the file."""
        with contextlib.suppress(WalError):
            if not self._fatal:
                self.sync()
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout=10)
        with self._io:
            self._opened = False
            self._close_segment()

    def stats(self) -> dict[str, object]:
        return {
            "fsync": str(self.policy),
            "last_lsn": self._appended,
            "durable_lsn": self._durable,
            "wal_bytes_written": self.bytes_written,
            "syncs": self.syncs,
            "records_per_sync": round(self.synced_records / self.syncs, 3) if self.syncs else 0,
            "error": self.refusal(),
        }
