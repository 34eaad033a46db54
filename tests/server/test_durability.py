"""Durability through a real sidecar: restarts, snapshots, readiness, a full disk, misuse."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import kalos
from conftest import DIM, TIMEOUT
from kalos.errors import ConnectError
from kalos.server import Sidecar, SidecarConfig
from kalos.testing import RunningSidecar, serve_command, wait_for_socket, wait_ready

Start = Callable[..., RunningSidecar]


def vectors(ids: list[int]) -> np.ndarray:
    return np.stack([np.random.default_rng(i).standard_normal(DIM) for i in ids]).astype(np.float32)


def present(client: kalos.Client, ids: list[int]) -> dict[int, str | None]:
    """id -> payload of the items found by searching for their own vectors (l2)."""
    r = client.search(vectors(ids), k=1)
    assert r.payloads is not None
    return {
        item: (r.payloads[j] if int(r.ids[j, 0]) == item and r.scores[j, 0] < 1e-6 else None)  # type: ignore[misc]
        for j, item in enumerate(ids)
    }


def durable(sidecar: Start, data: Path, *extra: str, name: str = "durable") -> RunningSidecar:
    return sidecar(metric="l2", name=name, extra_args=("--data-dir", str(data), *extra))


def refused(tmp_path: Path, data: Path, dim: int, *extra: str, metric: str = "ip") -> str:
    """Starts ``kalos serve`` on ``data``, which must refuse (exit code 2); its stderr."""
    proc = subprocess.run(
        serve_command("other", dim, str(tmp_path / "run"), "--data-dir", str(data), *extra,
                      metric=metric),
        capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    return proc.stderr


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
@pytest.mark.parametrize("transport", ["shm", "uds"])
def test_writes_survive_a_restart(sidecar: Start, tmp_path: Path, sig: int, transport: str) -> None:
    data = tmp_path / "data"
    sc = durable(sidecar, data)
    client = sc.connect(transport=transport, timeout=TIMEOUT)
    ids = list(range(1, 41))
    for i in range(0, 40, 4):
        client.add(vectors(ids[i : i + 4]), ids[i : i + 4], [f"p{j}" for j in ids[i : i + 4]])
    client.remove([5, 6])
    client.add(vectors([7]), [7], ["replaced"])
    client.close()
    sc.stop(sig, timeout=TIMEOUT)

    sc = durable(sidecar, data)
    with sc.connect(timeout=TIMEOUT) as client:
        got = present(client, ids)
        stats = client.stats()
    want = {i: None if i in (5, 6) else "replaced" if i == 7 else f"p{i}" for i in ids}
    assert got == want
    assert stats["items"] == 38
    recovery = stats["durability"]["recovery"]
    if sig == signal.SIGTERM:  # a clean stop snapshots: nothing left to replay
        assert recovery["snapshot_lsn"] == 12 and recovery["records_replayed"] == 0
        assert [p.name for p in data.iterdir() if p.name.startswith("snap-")] == [
            "snap-00000000000000000012"
        ]
    else:
        assert recovery["records_replayed"] == 12


def test_snapshots_bound_the_log(sidecar: Start, tmp_path: Path) -> None:
    data = tmp_path / "data"
    sc = durable(sidecar, data, "--snapshot-mb", "0.01")  # every ~10 KiB of log
    client = sc.connect(timeout=TIMEOUT)
    for i in range(1, 301):
        client.add(vectors([i]), [i], f"p{i}")
    # Snapshots were taken along the way (the last one may still be finishing: wait for it)
    # and deleted the log segments they cover.
    deadline = time.monotonic() + TIMEOUT
    while True:
        stats = client.stats()["durability"]
        if stats["snapshot_lsn"] > 200 and len(os.listdir(data / "wal")) <= 2:
            break
        assert time.monotonic() < deadline, (stats, os.listdir(data / "wal"))
        time.sleep(0.05)
    assert stats["last_snapshot"]["segments_deleted"] >= 1
    client.close()
    sc.stop(signal.SIGKILL)

    sc = durable(sidecar, data)
    with sc.connect(timeout=TIMEOUT) as client:
        assert present(client, list(range(1, 301))) == {i: f"p{i}" for i in range(1, 301)}
        recovery = client.stats()["durability"]["recovery"]
    assert recovery["snapshot_lsn"] + recovery["records_replayed"] == 300


def test_clients_wait_or_are_told_while_it_recovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = SidecarConfig(
        name="starting", dim=DIM, runtime_dir=str(tmp_path / "run"), data_dir=str(tmp_path / "d")
    )
    sc = Sidecar(config)
    assert sc.durability is not None
    release = threading.Event()
    recover = sc.durability.recover

    def slow_recovery() -> dict:
        assert release.wait(TIMEOUT)
        return recover()

    monkeypatch.setattr(sc.durability, "recover", slow_recovery)
    starter = threading.Thread(target=sc.start)
    starter.start()
    try:
        while not os.path.exists(sc.path):
            starter.join(0.01)
        with pytest.raises(ConnectError, match="starting"):
            kalos.connect("starting", runtime_dir=config.runtime_dir, timeout=TIMEOUT)
        release.set()
        starter.join(TIMEOUT)
        with kalos.connect("starting", runtime_dir=config.runtime_dir, timeout=TIMEOUT) as c:
            c.add(np.ones(DIM), 1)
    finally:
        release.set()
        starter.join(TIMEOUT)
        sc.stop()


def test_a_full_disk_refuses_writes_and_serves_reads(tmp_path: Path) -> None:
    data, run = tmp_path / "data", tmp_path / "run"
    run.mkdir(mode=0o700)
    cmd = serve_command(
        "full", DIM, str(run), "--data-dir", str(data), "--snapshot-mb", "1000", metric="l2"
    )

    def small_files() -> None:  # files beyond 64 KiB fail with EFBIG, as on a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))

    log = tmp_path / "sidecar.err"  # its stderr (its first 64 KiB, under the same limit)
    with open(log, "wb") as err:
        proc = subprocess.Popen(cmd, preexec_fn=small_files, stderr=err)
    sock = str(run / "full.sock")
    acked: list[int] = []
    try:
        try:
            wait_for_socket(sock, proc)
            wait_ready(sock, proc)
        except kalos.ConnectError as exc:  # what the sidecar said, to see why
            raise AssertionError(f"{exc}:\n{log.read_text(errors='replace')[-3000:]}") from exc
        # uds: the limit also applies to the memfd of a shm channel
        with kalos.connect(
            "full", runtime_dir=str(run), timeout=TIMEOUT, transport="uds"
        ) as client:
            with pytest.raises(kalos.ServerError, match="disk full"):
                for i in range(1, 10_000):
                    client.add(vectors([i]), [i], "x" * 100)
                    acked.append(i)
            failed = len(acked) + 1
            assert acked, "the limit left no room at all"
            with pytest.raises(kalos.ServerError, match="disk full"):  # still full: refused
                client.add(vectors([failed + 1]), [failed + 1], "y")
            assert present(client, acked[-3:]) == {i: "x" * 100 for i in acked[-3:]}
            stats = client.stats()["durability"]
            assert stats["error"].startswith("disk full") and stats["refused_writes"] >= 1
    finally:
        proc.kill()
        proc.wait()

    proc = subprocess.Popen([*cmd[:-2]], stderr=subprocess.DEVNULL)  # room again
    try:
        wait_for_socket(sock, proc)
        wait_ready(sock, proc)
        with kalos.connect("full", runtime_dir=str(run), timeout=TIMEOUT) as client:
            got = present(client, [*acked, failed, failed + 1])
            assert all(got[i] == "x" * 100 for i in acked)  # every acknowledged write
            assert got[failed + 1] is None  # refused before it was applied
            client.add(vectors([failed + 2]), [failed + 2], "z")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(TIMEOUT)


def test_a_data_dir_keeps_its_dimension(sidecar: Start, tmp_path: Path) -> None:
    data = tmp_path / "data"
    sc = durable(sidecar, data)
    with sc.connect(timeout=TIMEOUT) as client:
        client.add(vectors([1]), [1])
    sc.stop()
    stderr = refused(tmp_path, data, DIM + 1)
    assert f"dim={DIM}" in stderr and f"dim={DIM + 1}" in stderr


def test_a_data_dir_keeps_its_dimension_after_a_crash(sidecar: Start, tmp_path: Path) -> None:
    # No snapshot yet: only identity.json knows the dimension the log was written with.
    data = tmp_path / "data"
    sc = durable(sidecar, data)
    with sc.connect(timeout=TIMEOUT) as client:
        client.add(vectors([1]), [1])
    sc.stop(signal.SIGKILL, timeout=TIMEOUT)
    assert not [p for p in data.iterdir() if p.name.startswith("snap-")]
    identity = json.loads((data / "identity.json").read_text())
    assert identity == {"dim": DIM, "metric": "l2", "tokenizer": None}
    stderr = refused(tmp_path, data, DIM + 1)
    assert f"dim={DIM}" in stderr and f"dim={DIM + 1}" in stderr
    # A directory from before identity.json: recovered as it is, and the file written.
    (data / "identity.json").unlink()
    sc = durable(sidecar, data)
    with sc.connect(timeout=TIMEOUT) as client:
        assert client.stats()["items"] == 1
    assert json.loads((data / "identity.json").read_text()) == identity


def _word_tokenizer(path: Path, words: list[str]) -> str:
    tokenizers = pytest.importorskip("tokenizers")
    model = tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(path))
    return str(path)


def test_a_tokenizer_change_waits_until_the_log_is_in_a_snapshot(
    sidecar: Start, tmp_path: Path
) -> None:
    old = _word_tokenizer(tmp_path / "old.json", ["[UNK]", "hello", "world"])
    new = _word_tokenizer(tmp_path / "new.json", ["[UNK]", "x", "y", "world", "hello"])
    data = tmp_path / "data"
    sc = durable(sidecar, data, "--tokenizer", old)
    with sc.connect(timeout=TIMEOUT) as client:
        client.append_turn("s", "user", "hello world")
    sc.stop(signal.SIGKILL, timeout=TIMEOUT)

    # The log holds a turn the old tokenizer made ids for: another would replay other ids.
    stderr = refused(tmp_path, data, DIM, "--tokenizer", new, metric="l2")
    assert "tokenizer='sha256:" in stderr and "Start it once with the tokenizer" in stderr

    sc = durable(sidecar, data, "--tokenizer", old)  # replays, then a clean stop snapshots
    with sc.connect(timeout=TIMEOUT) as client:
        assert client.context("s", 100).tokens.tolist() == [1, 2]
    assert sc.stop(signal.SIGTERM, timeout=TIMEOUT) == 0

    sc = durable(sidecar, data, "--tokenizer", new)  # nothing left to replay: accepted
    with sc.connect(timeout=TIMEOUT) as client:
        client.append_turn("s", "user", "hello world")
        assert client.context("s", 100).tokens.tolist() == [1, 2, 4, 3]
    sc.stop(signal.SIGKILL, timeout=TIMEOUT)
    sc = durable(sidecar, data, "--tokenizer", new)  # its own log replays under it
    with sc.connect(timeout=TIMEOUT) as client:
        assert client.context("s", 100).tokens.tolist() == [1, 2, 4, 3]


def test_one_sidecar_per_data_dir(sidecar: Start, tmp_path: Path) -> None:
    data = tmp_path / "data"
    durable(sidecar, data)
    proc = subprocess.run(
        serve_command(
            "second", DIM, str(tmp_path / "run"), "--data-dir", str(data), metric="l2"
        ),
        capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "another sidecar is using the data directory" in proc.stderr


_SLOW_SNAPSHOT = """
import os, sys, threading, time
import numpy as np
import kalos.index
from kalos.server.dispatch import Dispatcher
from kalos.server.durability import Durability
from kalos.stores.memories import MemoryStore

class Slow:  # a store whose snapshot writer outlives its parent unless something stops it
    def snapshot(self, db, directory):
        with open(sys.argv[2], "w") as f:
            f.write(str(os.getpid()))
        time.sleep(120)
    def restore(self, db, directory):
        pass

store = MemoryStore(kalos.index.create("cpu:flat", dim=4))
durability = Durability(sys.argv[1], Dispatcher(store), threading.Lock(), {"slow": Slow()})
durability.recover()
durability.wal.append(4, 0, np.zeros(8, np.uint8), 0)
durability.snapshot()
time.sleep(120)
"""


def test_a_snapshot_writer_dies_with_its_sidecar(tmp_path: Path) -> None:
    data, pid_file = tmp_path / "data", tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, "-c", _SLOW_SNAPSHOT, str(data), str(pid_file)])
    try:
        deadline = time.monotonic() + TIMEOUT
        while not (pid_file.exists() and pid_file.read_text()):
            assert parent.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        child = int(pid_file.read_text())
        # It holds nothing of its parent's: no data directory lock, no sockets.
        held = [os.readlink(f"/proc/{child}/fd/{fd}") for fd in os.listdir(f"/proc/{child}/fd")]
        assert not [h for h in held if h.endswith("LOCK") or h.startswith("socket:")], held
    finally:
        parent.kill()
        parent.wait()
    while os.path.exists(f"/proc/{child}") and _state(child) != "Z":
        assert time.monotonic() < deadline, "the snapshot writer outlived its sidecar"
        time.sleep(0.02)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "Z"
