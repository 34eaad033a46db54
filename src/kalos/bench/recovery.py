"""recovery: time from start to READY with 1M x 128 vectors and 10,000 sessions on disk.

Builds the state through a real sidecar (``--data-dir`` in a temporary directory; the build
itself runs with ``--fsync off``: how the log was written does not change what recovery
reads), then measures restarts, each from ``Popen`` to the first successful handshake (the
sidecar holds or refuses handshakes until it has recovered):

* ``snapshot``: after a clean stop (SIGTERM: a final snapshot), restore the snapshot alone;
* ``snapshot+wal``: a further 10% of vectors and sessions' turns written after it, then
  SIGKILL: the snapshot plus a log tail;
* ``wal-only``: a second data dir built with snapshots off, then SIGKILL: every record replayed.

Each is measured with the data dir's files in the page cache (a restart after a crash of
the process) and evicted from it first (``posix_fadvise(DONTNEED)`` on every file: as after a
reboot, as far as this process can arrange). The recovered state is checked: item count,
a few searches, a few sessions' contexts.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import tempfile
import time

import numpy as np

from kalos.bench.common import print_table, write_result
from kalos.paths import socket_path
from kalos.testing import serve_command, wait_for_socket, wait_ready

SCENARIO = "recovery"
NAME = "bench-recovery"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n", type=int, default=1_000_000, help="vectors")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--sessions", type=int, default=10_000)
    p.add_argument("--turns", type=int, default=4, help="turns per session")
    p.add_argument("--tokens", type=int, default=64, help="token ids per turn")
    p.add_argument("--repeat", type=int, default=2, help="restarts per measurement")
    p.add_argument("--skip-wal-only", action="store_true")
    p.add_argument("--data-root", default=None, help="parent of the temporary data dirs")
    p.add_argument("--sidecar-log", default=None, help="append the sidecars' stderr here")


class Server:
    """A sidecar process on one data dir, restarted at will."""

    def __init__(self, args: argparse.Namespace, data: str, run_dir: str) -> None:
        self.args, self.data, self.run_dir = args, data, run_dir
        self.sock = socket_path(NAME, run_dir)
        self.proc: subprocess.Popen | None = None

    def start(self, *extra: str) -> float:
        """Starts it; returns seconds from Popen to the first successful handshake."""
        cmd = serve_command(NAME, self.args.dim, self.run_dir, "--data-dir", self.data, *extra)
        t0 = time.perf_counter()
        log = subprocess.DEVNULL
        if self.args.sidecar_log:
            with open(self.args.sidecar_log, "ab") as f:
                f.write(f"--- {' '.join(cmd)}\n".encode())
            log = os.open(self.args.sidecar_log, os.O_WRONLY | os.O_APPEND)
        try:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=log)
        finally:
            if log != subprocess.DEVNULL:
                os.close(log)
        wait_for_socket(self.sock, self.proc, timeout=300)
        wait_ready(self.sock, self.proc, timeout=300)
        return time.perf_counter() - t0

    def connect(self, **kw):  # -> kalos.Client
        import kalos

        return kalos.connect(NAME, runtime_dir=self.run_dir, timeout=300.0, **kw)

    def stop(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)
        self.proc.wait(600)
        self.proc = None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _vectors(start: int, count: int, dim: int) -> np.ndarray:
    return np.random.default_rng(start).standard_normal((count, dim), dtype=np.float32)


CHUNK = 16_384  # vectors per add request (8 MiB arena)


def _vector_of(item: int, n: int, dim: int) -> np.ndarray:
    """The vector _fill gave ``item`` (ids 1..n, then the tail n+1..)."""
    first = 1 if item <= n else n + 1
    start = first + (item - first) // CHUNK * CHUNK
    return _vectors(start, CHUNK, dim)[item - start]


def _fill(server: Server, args, first: int, n: int, sess_from: int, sess_to: int, turns: int):
    """Adds vectors first..first+n-1 (ids, payloads) and ``turns`` turns to each session."""
    client = server.connect(arena_bytes=8 << 20)
    for start in range(first, first + n, CHUNK):
        count = min(CHUNK, first + n - start)
        ids = np.arange(start, start + count, dtype=np.int64)
        client.add(_vectors(start, count, args.dim), ids, [f"memory {i}" for i in ids.tolist()])
    has_sessions = hasattr(client, "append_turn")
    if has_sessions:
        tokens = np.arange(args.tokens, dtype=np.int32)
        for s in range(sess_from, sess_to):
            for t in range(turns):
                client.append_turn(f"s{s}", "user", f"turn {t} of session {s}", tokens=tokens + t)
    client.close()
    return has_sessions


def _evict(path: str) -> None:
    """Drops a directory tree's clean pages from the page cache (no root needed)."""
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _check(server: Server, args, items: int, has_sessions: bool, sessions: int) -> dict:
    """Verifies the recovered state; returns the sidecar's recovery stats."""
    with server.connect() as client:
        stats = client.stats()
        assert stats["items"] == items, (stats["items"], items)
        for probe in (1, items // 2, items):
            r = client.search(_vector_of(probe, args.n, args.dim), k=1)
            assert int(r.ids[0]) == probe and r.payloads == [f"memory {probe}"], (probe, r.ids)
        if has_sessions:
            for s in (0, sessions // 2, sessions - 1):
                ctx = client.context(f"s{s}", max_tokens=1 << 20)
                assert len(ctx.turns) >= args.turns, (s, len(ctx.turns))
        return stats["durability"]["recovery"]


def _measure(server: Server, args, label: str, items, has_sessions, rows, stop_sig) -> None:
    for cache in ("warm", "cold"):
        for _ in range(args.repeat):
            if cache == "cold":
                _evict(server.data)
            seconds = server.start("--snapshot-mb", "100000")  # no snapshot after recovery
            rec = _check(server, args, items, has_sessions, args.sessions)
            server.stop(signal.SIGKILL)  # no snapshot at stop: the next start sees the same
            rows.append(
                {
                    "system": f"kalos {label}",
                    "page_cache": cache,
                    "start_to_ready_s": round(seconds, 3),
                    "recovery_s": rec["total_s"],
                    "restore_s": rec["restore_s"],
                    "replay_s": rec["replay_s"],
                    "records_replayed": rec["records_replayed"],
                    "snapshot_lsn": rec["snapshot_lsn"],
                }
            )
            print(rows[-1])


def _du(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files
    )


def run(args: argparse.Namespace) -> int:
    root = tempfile.mkdtemp(prefix="kalos-recovery-", dir=args.data_root)
    run_dir = os.path.join(root, "run")
    os.makedirs(run_dir, mode=0o700)
    rows: list[dict] = []
    extra: dict = {}
    server: Server | None = None
    try:
        # snapshot, then snapshot + log tail
        server = Server(args, os.path.join(root, "snap"), run_dir)
        server.start("--fsync", "off")
        t0 = time.perf_counter()
        has_sessions = _fill(server, args, 1, args.n, 0, args.sessions, args.turns)
        extra["build_s"] = round(time.perf_counter() - t0, 1)
        with server.connect() as c:
            extra["snapshots_during_build"] = c.stats()["durability"].get("last_snapshot")
        t0 = time.perf_counter()
        server.stop(signal.SIGTERM)
        extra["final_snapshot_s"] = round(time.perf_counter() - t0, 2)
        extra["data_dir_bytes_snapshot"] = _du(server.data)
        _measure(server, args, "snapshot", args.n, has_sessions, rows, signal.SIGKILL)
        tail = args.n // 10
        server.start("--fsync", "off", "--snapshot-mb", "100000")
        _fill(server, args, args.n + 1, tail, 0, args.sessions // 10, 1)
        server.stop(signal.SIGKILL)
        _measure(server, args, "snapshot+wal", args.n + tail, has_sessions, rows, signal.SIGKILL)
        shutil.rmtree(server.data, ignore_errors=True)

        if not args.skip_wal_only:
            server = Server(args, os.path.join(root, "wal"), run_dir)
            server.start("--fsync", "off", "--snapshot-mb", "100000")
            _fill(server, args, 1, args.n, 0, args.sessions, args.turns)
            server.stop(signal.SIGKILL)
            extra["data_dir_bytes_wal_only"] = _du(server.data)
            _measure(server, args, "wal-only", args.n, has_sessions, rows, signal.SIGKILL)
            shutil.rmtree(server.data, ignore_errors=True)
    finally:
        if server is not None:
            server.kill()
        shutil.rmtree(root, ignore_errors=True)
    print_table(
        rows,
        ("system", "page_cache", "start_to_ready_s", "recovery_s", "restore_s", "replay_s",
         "records_replayed"),
    )  # fmt: skip
    worst = max(r["start_to_ready_s"] for r in rows)
    print(f"worst start -> ready: {worst:.2f} s (target <= 15 s)")
    if not has_sessions:
        print("this client has no append_turn: measured vectors only, no sessions")
    params = {
        "n": args.n,
        "dim": args.dim,
        "dtype": "float32",
        "payload": "'memory <id>' text per vector",
        "sessions": args.sessions if has_sessions else 0,
        "turns_per_session": args.turns,
        "tokens_per_turn": args.tokens,
        "tail": f"{args.n // 10} vectors + 1 turn in {args.sessions // 10} sessions",
        "build_fsync": "off",
        "index": "cpu:flat",
    }
    path = write_result(
        SCENARIO, args.machine, params, rows, args.out, target_s=15.0, worst_s=worst, **extra
    )
    print(f"wrote {path}")
    return 0 if worst <= 15.0 else 1
