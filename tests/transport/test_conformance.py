"""Every transport passes the Transport conformance kit (kalos.testing.check_transport).

A new transport is one more name in conftest's TRANSPORTS and one more branch here.
"""

from __future__ import annotations

from collections.abc import Callable

from conftest import DIM, TIMEOUT, make_inproc_connector
from kalos.protocol import layout as L
from kalos.testing import RunningSidecar, check_transport
from kalos.transport import Transport, open_transport


def test_the_transport_kit(transport: str, sidecar: Callable[..., RunningSidecar]) -> None:
    if transport == "inproc":
        check_transport(make_inproc_connector(DIM), timeout=TIMEOUT)
        return
    running = sidecar(dim=DIM)
    name = running.grpc_target() if transport == "grpc" else running.name

    def open_one() -> Transport:
        return open_transport(
            transport,
            name,
            runtime_dir=running.runtime_dir,
            arena_bytes=L.DEFAULT_ARENA_BYTES,
            timeout=TIMEOUT,
            spin_us=None,
        )

    check_transport(open_one, timeout=TIMEOUT)
