"""Transports: how a request reaches the sidecar. The client only ever sees :class:`Transport`,
and beside it what the handshake lent (:class:`kalos.transport.lent.Lent`).

``open_channel`` is the one place that picks a concrete transport by an explicit name.
"""

from __future__ import annotations

import os

from kalos.errors import ConfigError
from kalos.paths import socket_path
from kalos.transport.base import Response, Transport
from kalos.transport.lent import NOTHING, Lent
from kalos.transport.tls import Tls

TRANSPORTS = ("shm", "uds", "grpc")


def open_channel(
    kind: str,
    name: str,
    *,
    runtime_dir: str | None,
    arena_bytes: int,
    timeout: float,
    spin_us: float | None,
    gpu_results: bool = False,
    hung_after: float | None = None,
    tls: Tls | None = None,
) -> tuple[Transport, Lent]:
    """Handshakes with the sidecar ``name``: a new channel of ``kind``, and what the sidecar
    lent beside it (:data:`kalos.transport.lent.NOTHING` but over shm). Close both.

    For ``kind="grpc"``, ``name`` is the sidecar's grpc target (``host:port``, ``[v6]:port``
    or ``unix:/path``) and ``tls`` secures it; ``runtime_dir`` and ``spin_us`` do not apply.

    ``spin_us`` None: :func:`kalos.transport.shm.default_spin_us` of the sidecar's device as
    a base, and a spin per op learned from its round trips
    (:func:`kalos.transport.shm.learned_spin`).
    ``gpu_results``: ask a cuda sidecar for a GPU result buffer (shm only); the lent ``gpu``
    is then a :class:`kalos.gpu.handoff.GpuChannel`. ``hung_after``: seconds without a
    heartbeat after which a shm channel reports its sidecar hung (SidecarGone). Raises
    ConnectError (no sidecar, refused), ProtocolMismatch, ConfigError (unknown kind, no GPU
    results to be had).
    """
    from kalos.transport.handshake import client_hello

    if kind not in TRANSPORTS:
        raise ConfigError(f"unknown transport {kind!r}; choose one of {', '.join(TRANSPORTS)}")
    if gpu_results and kind != "shm":
        raise ConfigError("GPU results travel over the shm transport only")
    if tls is not None and kind != "grpc":
        raise ConfigError("TLS applies to the grpc transport only")
    if kind == "grpc":
        try:
            from kalos.transport.grpc import open_grpc
        except ImportError as exc:
            raise ConfigError("the grpc transport needs grpcio: pip install 'kalos[grpc]'") from exc

        return open_grpc(name, arena_bytes=arena_bytes, timeout=timeout, tls=tls), NOTHING
    sock, info, fds = client_hello(
        socket_path(name, runtime_dir), kind, arena_bytes, timeout, gpu_results
    )
    if kind == "shm":
        from kalos.transport.shm import HUNG_AFTER_S, default_spin_us, open_shm

        if gpu_results and not info.get("gpu"):
            for fd in fds:
                os.close(fd)
            sock.close()
            raise ConfigError(
                f"the sidecar {name!r} has no GPU result buffer: GPU results need an exact"
                " GPU index (kalos serve --device cuda, cuda:flat)"
            )
        return open_shm(
            sock,
            info,
            fds,
            spin_us=default_spin_us(info) if spin_us is None else spin_us,
            hung_after=HUNG_AFTER_S if hung_after is None else hung_after,
            gpu=gpu_results,
            learn_spin=spin_us is None,
        )
    from kalos.transport.uds import UdsTransport

    for fd in fds:
        os.close(fd)
    return UdsTransport(sock, info), NOTHING


def open_transport(
    kind: str,
    name: str,
    *,
    runtime_dir: str | None,
    arena_bytes: int,
    timeout: float,
    spin_us: float | None,
    hung_after: float | None = None,
    tls: Tls | None = None,
) -> Transport:
    """A new channel of ``kind`` to the sidecar ``name``, alone: what the handshake lent
    beside it is given back at once (see :func:`open_channel`, which keeps it)."""
    t, lent = open_channel(
        kind,
        name,
        runtime_dir=runtime_dir,
        arena_bytes=arena_bytes,
        timeout=timeout,
        spin_us=spin_us,
        hung_after=hung_after,
        tls=tls,
    )
    lent.close()
    return t


__all__ = [
    "NOTHING",
    "TRANSPORTS",
    "Lent",
    "Response",
    "Tls",
    "Transport",
    "open_channel",
    "open_transport",
]
