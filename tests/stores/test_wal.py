"""The write-ahead log on its own: records, torn tails, damage, faults, group commit, segments."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kalos.errors import ConfigError
from kalos.stores import wal as W
from kalos.stores.wal import FsyncPolicy, WalCorrupt, WriteAheadLog, list_segments

POLICIES = ("always", "interval:5", "off")


def body(i: int) -> np.ndarray:
    """A request body of 1..40 bytes that names ``i``."""
    return np.frombuffer(f"request {i} ".encode() * (1 + i % 4), np.uint8)


def fill(log: WriteAheadLog, first: int, count: int) -> list[int]:
    lsns = []
    for i in range(first, first + count):
        lsns.append(log.append(3 + i % 2, i, body(i), 1_000 + i))
        assert log.wait(lsns[-1], timeout=30) is True
    return lsns


def replayed(directory: Path, after: int = 0) -> list[tuple[int, int, int, int, bytes]]:
    log = WriteAheadLog(str(directory))
    return [(r.lsn, r.op, r.flags, r.time_ns, r.body.tobytes()) for r in log.recover(after)]


def expected(first: int, count: int) -> list[tuple[int, int, int, int, bytes]]:
    return [(i, 3 + i % 2, i, 1_000 + i, body(i).tobytes()) for i in range(first, first + count)]


@pytest.fixture
def logdir(tmp_path: Path) -> Path:
    return tmp_path / "wal"


def opened(directory: Path, policy: str = "always", **kwargs: object) -> WriteAheadLog:
    log = WriteAheadLog(str(directory), policy=FsyncPolicy.parse(policy), **kwargs)  # type: ignore[arg-type]
    for _ in log.recover():
        pass
    log.open()
    return log


def test_policy_strings() -> None:
    assert FsyncPolicy.parse("always") == FsyncPolicy("always")
    assert FsyncPolicy.parse("OFF") == FsyncPolicy("off")
    assert FsyncPolicy.parse("interval:20") == FsyncPolicy("interval", 20.0)
    assert str(FsyncPolicy.parse("interval:2.5")) == "interval:2.5"
    for bad in ("sometimes", "interval:", "interval:0", "interval:-3", "interval:x"):
        with pytest.raises(ConfigError):
            FsyncPolicy.parse(bad)


@pytest.mark.parametrize("policy", POLICIES)
def test_records_come_back_in_order(logdir: Path, policy: str) -> None:
    log = opened(logdir, policy)
    fill(log, 1, 50)
    log.close()
    assert replayed(logdir) == expected(1, 50)
    assert replayed(logdir, after=20) == expected(21, 30)


def test_appends_continue_after_a_restart(logdir: Path) -> None:
    log = opened(logdir)
    fill(log, 1, 10)
    log.close()
    log = opened(logdir)
    assert log.last_lsn == 10
    fill(log, 11, 5)
    log.close()
    assert replayed(logdir) == expected(1, 15)


def test_unwritten_records_are_not_durable(logdir: Path) -> None:
    log = opened(logdir, "off")
    lsn = log.append(3, 0, body(1), 5)
    assert log.outcome(lsn) is None  # appended only: nothing may acknowledge it yet
    log.commit()
    assert log.outcome(lsn) is True
    log.close()


@pytest.mark.parametrize("cut", [1, 7, 40, 41])
def test_a_torn_tail_is_cut_off(logdir: Path, cut: int) -> None:
    log = opened(logdir)
    fill(log, 1, 10)
    log.close()
    (_, path), *_ = list_segments(str(logdir))
    size = os.path.getsize(path)
    extra = W.encode_record(11, 1_011, 3, 0, body(11))
    with open(path, "ab") as f:
        f.write(extra[:cut])  # a crash inside write(): part of the next record
    assert replayed(logdir) == expected(1, 10)
    assert os.path.getsize(path) == size  # cut back to the last whole record
    log = opened(logdir)
    fill(log, 11, 3)
    log.close()
    assert replayed(logdir) == expected(1, 13)


def test_a_damaged_last_record_ends_the_log(logdir: Path) -> None:
    log = opened(logdir)
    fill(log, 1, 10)
    log.close()
    (_, path), *_ = list_segments(str(logdir))
    with open(path, "r+b") as f:
        f.seek(-12, os.SEEK_END)  # inside the last record's body (33 bytes + 7 of padding)
        f.write(b"\xff")  # its crc fails
    assert replayed(logdir) == expected(1, 9)


def test_damage_before_the_tail_is_refused(logdir: Path) -> None:
    log = opened(logdir, segment_bytes=4096)
    fill(log, 1, 400)  # several segments
    log.close()
    segments = list_segments(str(logdir))
    assert len(segments) > 2
    with open(segments[0][1], "r+b") as f:
        f.seek(W.SEGMENT_HEADER.size + 50)
        f.write(b"\xff\xff")
    with pytest.raises(WalCorrupt):
        replayed(logdir)


def test_a_missing_segment_is_refused(logdir: Path) -> None:
    log = opened(logdir, segment_bytes=4096)
    fill(log, 1, 400)
    log.close()
    segments = list_segments(str(logdir))
    os.unlink(segments[1][1])
    with pytest.raises(WalCorrupt, match="missing"):
        replayed(logdir)


def test_segments_rotate_and_covered_ones_are_deleted(logdir: Path) -> None:
    log = opened(logdir, segment_bytes=4096)
    fill(log, 1, 300)
    upto = log.rotate()
    assert upto == 300
    fill(log, 301, 10)
    assert len(list_segments(str(logdir))) > 2
    log.delete_through(upto)
    log.close()
    firsts = [first for first, _ in list_segments(str(logdir))]
    assert firsts == [301]
    assert replayed(logdir, after=300) == expected(301, 10)


def test_disk_full_fails_the_write_then_recovers(
    logdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = opened(logdir)
    fill(log, 1, 5)
    real = W._write_all

    def full(fd: int, data: memoryview) -> None:
        os.write(fd, bytes(data[: len(data) // 2]))  # part of it lands, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(W, "_write_all", full)
    lsn = log.append(3, 6, body(6), 1_006)
    result = log.wait(lsn, timeout=30)
    assert isinstance(result, str) and result.startswith("disk full")
    assert log.refusal().startswith("disk full")  # new writes are refused meanwhile
    log.retry()
    assert log.refusal()
    monkeypatch.setattr(W, "_write_all", real)  # space was freed
    log.retry()
    assert log.refusal() == ""
    assert log.outcome(lsn) is True  # the queued record made it after all
    fill(log, 7, 3)
    log.close()
    assert replayed(logdir) == expected(1, 9)  # no half record was left behind


def test_a_failed_sync_refuses_writes_until_restart(
    logdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = opened(logdir)
    fill(log, 1, 3)

    def broken(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(W, "_fdatasync", broken)
    lsn = log.append(3, 4, body(4), 1_004)
    result = log.wait(lsn, timeout=30)
    assert isinstance(result, str) and "fdatasync failed" in result
    monkeypatch.undo()
    log.retry()
    assert "restarts" in log.refusal()  # a failed sync is never retried
    log.close()


def test_concurrent_writers_share_syncs(logdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = W._fdatasync

    def slow(fd: int) -> None:  # a slow disk: writers pile up behind each sync
        time.sleep(0.02)
        real(fd)

    monkeypatch.setattr(W, "_fdatasync", slow)
    log = opened(logdir)
    lock = threading.Lock()  # the dispatch lock: appends in apply order
    results: list[object] = []

    def writer(t: int) -> None:
        for i in range(10):
            with lock:
                lsn = log.append(3, t, body(i), 0)
            results.append(log.wait(lsn, timeout=60))

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * 80
    assert log.synced_records == 80
    assert log.syncs < 80  # group commit: a sync covered several writers' records
    log.close()
    assert [r[0] for r in replayed(logdir)] == list(range(1, 81))
