"""Ready means warm, and a stop is bounded: a sidecar reports ready (the listener, the control
segment, /readyz) only once its GPU warm-up is done, a stop during the warm-up ends it, and a
sidecar stopped with SIGTERM exits within 5 s, clients connected and searching, with a last
snapshot that would take longer left to the write-ahead log.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

import kalos
from conftest import DIM, TIMEOUT
from kalos import _native
from kalos.protocol import layout as L
from kalos.server import Sidecar, SidecarConfig
from kalos.server.durability import Durability
from kalos.server.sidecar import KERNEL_CACHE, STOP_BUDGET_S, kernel_cache_dir

STOP_LIMIT_S = 5.0  # what a supervisor may rely on after SIGTERM


class StandInGpu:
    """A cuda sidecar's GpuSearch, reduced to its warm-up: it lasts until released (or until
    the sidecar's stop, as GpuSearch.warm polls it)."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.precompiled = None  # what a GPU's parallel compile did: nothing here
        self.prepare_fails = False

    def warm(self, stop=None) -> float:
        self.started.set()
        while not self.release.wait(0.01):
            if stop is not None and stop():
                raise InterruptedError("stopped during the kernel warm-up")
        return 1.25

    def pin(self, *arenas):  # a channel's connect: no GPU here, its searches stay on the CPU
        return None

    def prepare(self, pinned, arena) -> None:  # nor graphs to capture for it
        if self.prepare_fails:
            raise RuntimeError("out of memory")


def state(sidecar: Sidecar) -> int:
    return int(_native.load_acquire(sidecar.control.addr + L.CTRL_STATE))


def readyz(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=TIMEOUT) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def warming_sidecar(tmp_path) -> tuple[Sidecar, StandInGpu, threading.Thread]:
    config = SidecarConfig(name="warm", dim=DIM, runtime_dir=str(tmp_path), admin_port=0)
    sidecar = Sidecar(config)
    gpu = sidecar.gpu = StandInGpu()  # type: ignore[assignment]
    starter = threading.Thread(target=sidecar.start)
    starter.start()
    assert gpu.started.wait(TIMEOUT)
    return sidecar, gpu, starter


def test_readiness_waits_for_the_warm_up(tmp_path):
    sidecar, gpu, starter = warming_sidecar(tmp_path)
    try:
        assert sidecar.admin is not None
        time.sleep(0.2)
        # warming: the socket exists, but nothing says ready
        assert state(sidecar) == L.STATE_STARTING
        assert sidecar.listener is not None and not sidecar.listener.ready.is_set()
        assert readyz(sidecar.admin.port) == 503
        assert starter.is_alive()
        gpu.release.set()
        starter.join(TIMEOUT)
        assert not starter.is_alive()
        assert state(sidecar) == L.STATE_READY and sidecar.listener.ready.is_set()
        assert readyz(sidecar.admin.port) == 200
        assert sidecar.warm_seconds == 1.25
        with kalos.connect("warm", runtime_dir=str(tmp_path), timeout=TIMEOUT) as client:
            assert client.stats()["warm_seconds"] == 1.25
        # a channel whose graphs cannot be captured at its handshake still connects and serves
        gpu.prepare_fails = True
        with kalos.connect("warm", runtime_dir=str(tmp_path), timeout=TIMEOUT) as client:
            assert client.stats()["warm_seconds"] == 1.25
        metrics = urllib.request.urlopen(
            f"http://127.0.0.1:{sidecar.admin.port}/metrics", timeout=TIMEOUT
        ).read()
        assert b"kalos_gpu_warm_seconds 1.25" in metrics
    finally:
        gpu.release.set()
        sidecar.stop()


def test_a_stop_during_the_warm_up_ends_it(tmp_path):
    sidecar, _, starter = warming_sidecar(tmp_path)
    t0 = time.monotonic()
    sidecar.stop()
    starter.join(TIMEOUT)
    assert not starter.is_alive()
    assert sidecar._stopped.wait(STOP_LIMIT_S)
    assert time.monotonic() - t0 < STOP_LIMIT_S
    assert state(sidecar) == L.STATE_STOPPING
    assert sidecar.warm_seconds is None
    assert not os.path.exists(sidecar.path)


def test_sigterm_stops_within_the_limit_while_clients_search(sidecar, tmp_path):
    sc = sidecar(extra_args=("--data-dir", str(tmp_path / "data")))
    setup = sc.connect(timeout=TIMEOUT)
    rng = np.random.default_rng(0)
    setup.add(rng.standard_normal((2000, DIM)).astype(np.float32), np.arange(2000) + 1)
    done = threading.Event()
    searched = []

    def search() -> None:
        client = sc.connect(transport="shm" if len(searched) % 2 else "uds", timeout=TIMEOUT)
        searched.append(0)
        q = rng.standard_normal(DIM).astype(np.float32)
        try:
            while not done.is_set():
                client.search(q, k=10)
                client.add(q, 100_000 + len(searched))  # writes in flight too
                searched.append(1)
        except Exception:
            pass  # the stop: SidecarGone, ConnectError
        finally:
            client.close()

    threads = [threading.Thread(target=search) for _ in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + TIMEOUT
    while sum(searched) < 20:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    t0 = time.monotonic()
    sc.process.send_signal(signal.SIGTERM)
    code = sc.process.wait(TIMEOUT)
    elapsed = time.monotonic() - t0
    done.set()
    for t in threads:
        t.join(TIMEOUT)
    setup.close()
    assert code == 0
    assert elapsed < STOP_LIMIT_S, f"{elapsed:.2f} s to stop"


def test_a_last_snapshot_longer_than_the_budget_is_left_to_the_log(tmp_path, monkeypatch):
    data = str(tmp_path / "data")
    config = SidecarConfig(name="slow", dim=DIM, runtime_dir=str(tmp_path), data_dir=data)
    sidecar = Sidecar(config).start()
    with kalos.connect("slow", runtime_dir=str(tmp_path), timeout=TIMEOUT) as client:
        client.add(np.ones((3, DIM), np.float32), np.arange(3) + 1)
    release = threading.Event()
    write = Durability._write_stores

    def slow_write(self, directory, lsn):  # a snapshot of a large store
        release.wait(30)
        raise OSError("no snapshot this time")

    monkeypatch.setattr(Durability, "_write_stores", slow_write)
    t0 = time.monotonic()
    sidecar.stop()
    assert sidecar._stopped.is_set()
    assert time.monotonic() - t0 < STOP_BUDGET_S + 0.5
    writer = next(t for t in threading.enumerate() if t.name == "kalos-last-snapshot")
    release.set()
    writer.join(TIMEOUT)
    assert sidecar.durability is not None
    os.close(sidecar.durability._lock_fd)  # the process's exit would release it
    monkeypatch.setattr(Durability, "_write_stores", write)
    # the write-ahead log covers what no snapshot holds
    again = Sidecar(config).start()
    try:
        with kalos.connect("slow", runtime_dir=str(tmp_path), timeout=TIMEOUT) as client:
            assert sorted(client.search(np.ones(DIM), k=5, copy=True).ids.reshape(-1)[:3]) == [
                1,
                2,
                3,
            ]
    finally:
        again.stop()


def test_the_kernel_cache_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    base = {"name": "c", "dim": 8}
    assert kernel_cache_dir(SidecarConfig(**base)) is None  # a cpu sidecar compiles nothing
    assert kernel_cache_dir(SidecarConfig(**base, device="cuda")) is None  # Triton's default
    data = str(tmp_path / "data")
    assert kernel_cache_dir(SidecarConfig(**base, device="cuda", data_dir=data)) == os.path.join(
        data, KERNEL_CACHE
    )
    monkeypatch.setenv("TRITON_CACHE_DIR", "/elsewhere")
    assert kernel_cache_dir(SidecarConfig(**base, device="cuda", data_dir=data)) == "/elsewhere"
    given = str(tmp_path / "kernels")
    config = SidecarConfig(**base, device="cuda:1", data_dir=data, cache_dir=given)
    assert kernel_cache_dir(config) == given


def test_the_cli_takes_a_cache_dir():
    from kalos.cli import build_parser

    args = build_parser().parse_args(
        ["serve", "--name", "x", "--dim", "8", "--device", "cuda", "--cache-dir", "/k"]
    )
    assert args.cache_dir == "/k"


@pytest.fixture(autouse=True)
def _restore_triton_cache_dir(monkeypatch):
    # a cuda configuration may set it for the process (Sidecar): leave it as it was
    monkeypatch.setenv("TRITON_CACHE_DIR", os.environ.get("TRITON_CACHE_DIR", ""))
    if not os.environ["TRITON_CACHE_DIR"]:
        monkeypatch.delenv("TRITON_CACHE_DIR")
    yield
