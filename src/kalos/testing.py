"""Conformance and isolation kits for tests and benchmarks.

``isolated_sidecar(...)`` starts a real sidecar process (``python -m kalos serve``) with its
own private socket directory, waits until it accepts clients (with ``--data-dir``: until it
finished recovering; with ``--grpc``: until its grpc listeners are up too), and stops it
(SIGTERM, then SIGKILL) on exit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

from kalos.errors import ConnectError
from kalos.paths import socket_path


@dataclass
class RunningSidecar:
    name: str
    runtime_dir: str
    process: subprocess.Popen

    @property
    def socket(self) -> str:
        return socket_path(self.name, self.runtime_dir)

    def connect(self, **kwargs):  # -> kalos.Client
        """A client of this sidecar; ``transport="grpc"`` connects to its first grpc listener
        (the sidecar must have been started with ``--grpc ADDR``)."""
        from kalos.client import connect

        if kwargs.get("transport") == "grpc":
            return connect(self.grpc_target(), **kwargs)
        return connect(self.name, runtime_dir=self.runtime_dir, **kwargs)

    def grpc_target(self, index: int = 0) -> str:
        """The address of its ``index``-th grpc listener, as bound (port 0 resolved), read
        from its STATS over uds."""
        from kalos.client import connect

        with connect(self.name, runtime_dir=self.runtime_dir, transport="uds") as c:
            addresses = c.stats().get("grpc") or []
        if len(addresses) <= index:
            raise ConnectError(f"the sidecar {self.name!r} has no grpc listener {index}")
        return str(addresses[index])

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        """Signals the sidecar and waits for it; returns its exit code."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout)


def wait_for_socket(path: str, process: subprocess.Popen, timeout: float = 30.0) -> None:
    """Waits until the sidecar accepts connections at ``path``.

    The file alone is not enough: it exists between bind and listen, and a stale socket left
    by a killed sidecar exists before the new one has claimed it.
    """
    deadline = time.monotonic() + timeout
    while not _accepts(path):
        if process.poll() is not None:
            raise ConnectError(f"the sidecar exited with code {process.returncode} at start")
        if time.monotonic() > deadline:
            raise ConnectError(f"the sidecar did not open {path} within {timeout} s")
        time.sleep(0.01)


def wait_ready(path: str, process: subprocess.Popen, timeout: float = 120.0) -> None:
    """Waits until the sidecar at ``path`` completes a handshake.

    While it recovers its data a sidecar holds handshakes, then refuses them as "starting";
    this retries until one succeeds (it counts as one connect in the sidecar's stats).
    """
    from kalos.protocol import layout as L
    from kalos.transport.handshake import client_hello

    deadline = time.monotonic() + timeout
    while True:
        try:
            sock, _, fds = client_hello(path, "uds", L.MIN_ARENA_BYTES, timeout=10.0)
        except ConnectError as exc:
            if process.poll() is not None:
                raise ConnectError(
                    f"the sidecar exited with code {process.returncode} at start"
                ) from exc
            if "starting" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)
            continue
        sock.close()
        for fd in fds:
            os.close(fd)
        return


def _accepts(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        return False
    finally:
        probe.close()
    return True


def serve_command(
    name: str, dim: int, runtime_dir: str, *extra_args: str, metric: str = "ip"
) -> list[str]:
    """The command line of ``kalos serve`` in this interpreter, for tests and benchmarks."""
    return [
        sys.executable, "-m", "kalos", "serve", "--name", name, "--dim", str(dim),
        "--metric", metric, "--runtime-dir", str(runtime_dir), *extra_args,
    ]  # fmt: skip


@contextlib.contextmanager
def isolated_sidecar(
    *,
    dim: int,
    metric: str = "ip",
    name: str = "test",
    extra_args: tuple[str, ...] = (),
    runtime_dir: str | None = None,
    stderr=None,
) -> Iterator[RunningSidecar]:
    """A sidecar in its own process and socket directory, stopped on exit."""
    with contextlib.ExitStack() as stack:
        if runtime_dir is None:
            runtime_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="kalos-"))
        cmd = serve_command(name, dim, runtime_dir, *extra_args, metric=metric)
        if not any(a.startswith(("--admin-port", "--no-admin")) for a in extra_args):
            cmd += ["--admin-port", "0"]  # a free port each: sidecars in parallel never collide
        proc = subprocess.Popen(cmd, stderr=stderr)
        sidecar = RunningSidecar(name, runtime_dir, proc)
        try:
            wait_for_socket(sidecar.socket, proc)
            cuda = any(a.startswith("cuda") for a in extra_args)
            if "--data-dir" in extra_args or "--grpc" in extra_args or cuda:
                # recovered; grpc listening; a cuda sidecar's kernels warm (from a cold
                # kernel cache, minutes)
                wait_ready(sidecar.socket, proc, timeout=900.0 if cuda else 120.0)
            yield sidecar
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
