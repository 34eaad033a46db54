"""A throwaway PostgreSQL server for tests and benchmarks of ``kalos serve --source``.

:func:`postgres_server` runs ``initdb`` into a fresh directory and starts ``postgres`` on a
private Unix-socket directory and a free port (no TCP listener), with ``fsync`` on, as a
user other than root (PostgreSQL refuses to run as root: under root it runs as ``nobody``
through ``runuser``), and stops it on exit. :func:`unavailable` says why no server can be
started here (the tests skip with that reason).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

RUN_AS = "nobody"  # the user the server runs as when this process is root
START_TIMEOUT_S = 30.0


def _bin_dir() -> str | None:
    """Where initdb and postgres are: PATH, else Debian's /usr/lib/postgresql/N/bin."""
    found = shutil.which("initdb")
    if found and shutil.which("postgres"):
        return os.path.dirname(found)
    for path in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if os.path.exists(os.path.join(path, "initdb")):
            return path
    return None


def unavailable() -> str | None:
    """Why :func:`postgres_server` cannot run here, or None."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is not installed (pip install 'kalos[postgres]')"
    if _bin_dir() is None:
        return "PostgreSQL's server programs (initdb, postgres) are not installed"
    if os.getuid() == 0 and shutil.which("runuser") is None:
        return "running as root without runuser: PostgreSQL refuses to run as root"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclasses.dataclass
class PostgresServer:
    """A running server: connect with :attr:`conninfo` (user ``kalos``, trust auth)."""

    directory: str
    socket_dir: str
    port: int
    bin_dir: str
    process: subprocess.Popen | None = None

    @property
    def data_dir(self) -> str:
        return os.path.join(self.directory, "data")

    def conninfo(self, dbname: str = "postgres") -> str:
        return f"host={self.socket_dir} port={self.port} user=kalos dbname={dbname}"

    def _as_owner(self, *cmd: str) -> list[str]:
        if os.getuid() == 0:
            return ["runuser", "-u", RUN_AS, "--", *cmd]
        return list(cmd)

    def start(self) -> None:
        """Starts the server (again, after :meth:`stop` or :meth:`kill`); waits until it
        accepts connections."""
        import psycopg

        log = open(os.path.join(self.directory, "postgres.log"), "ab")  # noqa: SIM115
        self.process = subprocess.Popen(
            self._as_owner(
                os.path.join(self.bin_dir, "postgres"),
                "-D",
                self.data_dir,
                "-k",
                self.socket_dir,
                "-p",
                str(self.port),
                "-c",
                "listen_addresses=",
                "-c",
                "fsync=on",
                "-c",
                "synchronous_commit=on",
                "-c",
                "max_connections=200",
            ),
            stdout=log,
            stderr=log,
            cwd=self.directory,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                psycopg.connect(self.conninfo(), connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"PostgreSQL did not start: see {self.directory}/postgres.log"
                    ) from None
                time.sleep(0.05)

    def _postmaster_pid(self) -> int | None:
        try:
            with open(os.path.join(self.data_dir, "postmaster.pid")) as f:
                return int(f.readline())
        except (OSError, ValueError):
            return None

    def _signal(self, sig: int) -> None:
        pid = self._postmaster_pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        if self.process is not None:
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
            self.process = None

    def stop(self) -> None:
        """A fast shutdown (SIGINT): open transactions roll back, committed ones stay."""
        self._signal(signal.SIGINT)

    def kill(self) -> None:
        """SIGKILL of the postmaster and its backends (a crash: the next start recovers)."""
        pid = self._postmaster_pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(os.getpgid(pid), signal.SIGKILL)
        self._signal(signal.SIGKILL)
        # what a dead postmaster leaves behind (its pid may linger as an unreaped zombie)
        sock = os.path.join(self.socket_dir, f".s.PGSQL.{self.port}")
        for path in (os.path.join(self.data_dir, "postmaster.pid"), sock, sock + ".lock"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def create_database(self, name: str) -> str:
        """Creates database ``name``; returns its connection string."""
        import psycopg

        with psycopg.connect(self.conninfo(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.conninfo(name)


@contextlib.contextmanager
def postgres_server() -> Iterator[PostgresServer]:
    """A fresh PostgreSQL server for the duration of the block (see the module docstring)."""
    why = unavailable()
    if why is not None:
        raise RuntimeError(why)
    bin_dir = _bin_dir()
    assert bin_dir is not None
    directory = tempfile.mkdtemp(prefix="kalos-pg-")  # under /tmp: traversable by RUN_AS
    try:
        socket_dir = os.path.join(directory, "sock")
        os.makedirs(socket_dir)
        if os.getuid() == 0:
            shutil.chown(directory, RUN_AS)
            shutil.chown(socket_dir, RUN_AS)
        server = PostgresServer(directory, socket_dir, _free_port(), bin_dir)
        subprocess.run(
            server._as_owner(
                os.path.join(bin_dir, "initdb"),
                "-D",
                server.data_dir,
                "-U",
                "kalos",
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-sync",
                "--no-instructions",
            ),
            check=True,
            capture_output=True,
            cwd=directory,
        )
        server.start()
        try:
            yield server
        finally:
            server.stop()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
