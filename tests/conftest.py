"""Fixtures shared by the tests: real sidecars in private runtime directories, and clients.

``sidecar`` starts real ``python -m kalos serve`` processes (kalos.testing.isolated_sidecar),
each with its own socket directory, stopped when the test ends. ``inproc_client`` builds a
client over the in-process transport: the same encoders, dispatcher and store, no processes.
``backend`` is parametrized over every transport ("inproc", then each real one), so a client
test written once runs on all of them. A sidecar started by a test of the grpc transport also
listens for grpc on a free loopback port (``RunningSidecar.connect(transport="grpc")`` finds
it); the grpc cases skip where grpcio is not installed.

Deadlines are generous (``TIMEOUT``): the suite runs on a loaded 2-core machine, and a test
is not timed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

import kalos
import kalos.index
from kalos.protocol import layout as L
from kalos.server.dispatch import Dispatcher
from kalos.stores.memories import MemoryStore
from kalos.testing import RunningSidecar, isolated_sidecar
from kalos.transport.inproc import InprocTransport

TIMEOUT = 60.0  # seconds: the default deadline of a call in the tests
DIM = 8
TRANSPORTS = ("inproc", "shm", "uds", "grpc")
REAL_TRANSPORTS = ("shm", "uds")


def make_inproc_connector(
    dim: int = DIM, metric: str = "ip", *, arena_bytes: int = L.DEFAULT_ARENA_BYTES
) -> Callable[..., InprocTransport]:
    """A connector over one fresh store: every transport it makes shares the dispatcher."""
    store = MemoryStore(kalos.index.create("cpu:flat", dim=dim, metric=metric))
    dispatcher = Dispatcher(store, name="inproc")
    lock = threading.Lock()

    def connector(arena: int = arena_bytes) -> InprocTransport:
        return InprocTransport(dispatcher, lock, arena)

    return connector


def make_inproc_client(
    dim: int = DIM,
    metric: str = "ip",
    *,
    arena_bytes: int = L.DEFAULT_ARENA_BYTES,
    timeout: float = TIMEOUT,
) -> kalos.Client:
    """A client over the in-process transport and a fresh ``cpu:flat`` store."""
    connector = make_inproc_connector(dim, metric, arena_bytes=arena_bytes)
    return kalos.Client("inproc", connector=connector, timeout=timeout)


def stop_process(pid: int, timeout: float = TIMEOUT) -> None:
    """SIGSTOPs ``pid`` and waits until every one of its threads has stopped.

    kill() returns before the stop takes effect: a thread already running (or woken by a
    request in flight) can still answer for a moment, which would make a timeout test racy.
    """
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while not all(_task_state(pid, tid) in ("T", "t") for tid in os.listdir(f"/proc/{pid}/task")):
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} did not stop")
        time.sleep(0.005)


def _task_state(pid: int, tid: str) -> str:
    try:
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:  # the thread has exited
        return "T"


GRPC_LOOPBACK = ("--grpc", "127.0.0.1:0")


@pytest.fixture
def sidecar(request: pytest.FixtureRequest) -> Iterator[Callable[..., RunningSidecar]]:
    """Factory: ``sidecar(dim=8, metric="ip", name="test")`` starts a real sidecar process
    (with a grpc listener in a test of the grpc transport)."""
    grpc = "transport" in request.fixturenames and request.getfixturevalue("transport") == "grpc"
    with contextlib.ExitStack() as stack:

        def start(
            dim: int = DIM,
            metric: str = "ip",
            name: str = "test",
            extra_args: tuple[str, ...] = (),
            **kwargs: object,
        ) -> RunningSidecar:
            if grpc and "--grpc" not in extra_args:
                extra_args = (*extra_args, *GRPC_LOOPBACK)
            return stack.enter_context(
                isolated_sidecar(dim=dim, metric=metric, name=name, extra_args=extra_args, **kwargs)  # type: ignore[arg-type]
            )

        yield start


@pytest.fixture
def inproc_client() -> Iterator[Callable[..., kalos.Client]]:
    """Factory: ``inproc_client(dim=8, metric="ip")`` is a client over a fresh in-process store."""
    clients: list[kalos.Client] = []

    def make(dim: int = DIM, metric: str = "ip", **kwargs: object) -> kalos.Client:
        client = make_inproc_client(dim, metric, **kwargs)  # type: ignore[arg-type]
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


@dataclass
class Backend:
    """One store behind one transport; ``connect()`` makes another client of the same store."""

    transport: str
    dim: int
    metric: str
    connect: Callable[..., kalos.Client]
    sidecar: RunningSidecar | None  # None for inproc


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    if request.param == "grpc":
        pytest.importorskip("grpc")
    return request.param


@pytest.fixture
def backend(
    transport: str, sidecar: Callable[..., RunningSidecar]
) -> Iterator[Callable[..., Backend]]:
    """Factory: ``backend(dim=8, metric="ip")`` is a fresh store over this test's transport."""
    clients: list[kalos.Client] = []

    def make(dim: int = DIM, metric: str = "ip") -> Backend:
        running: RunningSidecar | None = None
        if transport == "inproc":
            connector = make_inproc_connector(dim, metric)

            def connect(arena_bytes: int = L.DEFAULT_ARENA_BYTES, **kw: object) -> kalos.Client:
                kw.setdefault("timeout", TIMEOUT)
                return kalos.Client(
                    "inproc",
                    connector=lambda: connector(arena_bytes),
                    **kw,  # type: ignore[arg-type]
                )

        else:
            running = sidecar(dim=dim, metric=metric)
            # grpc: the listener's address, looked up once
            target = running.grpc_target() if transport == "grpc" else None

            def connect(**kw: object) -> kalos.Client:
                kw.setdefault("timeout", TIMEOUT)
                if target is not None:
                    return kalos.connect(target, transport="grpc", **kw)  # type: ignore[arg-type]
                return running.connect(transport=transport, **kw)  # type: ignore[union-attr]

        def tracked(**kw: object) -> kalos.Client:
            client = connect(**kw)
            clients.append(client)
            return client

        return Backend(transport, dim, metric, tracked, running)

    yield make
    for client in clients:
        client.close()


@pytest.fixture
def client(backend: Callable[..., Backend]) -> kalos.Client:
    """A client over this test's transport to a fresh store of dimension DIM, metric ip."""
    return backend().connect()
