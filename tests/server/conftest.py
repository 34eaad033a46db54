"""Fixtures shared by the server tests that need a PostgreSQL server (the --source tests)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator

import pytest

from kalos.testing_postgres import PostgresServer, postgres_server


@pytest.fixture(scope="module")
def pg() -> Iterator[PostgresServer]:
    """A PostgreSQL server of the test module's own (kalos.testing_postgres)."""
    with postgres_server() as server:
        yield server


@pytest.fixture
def runtime_dir() -> Iterator[str]:
    """A fresh directory for sidecars' sockets."""
    with tempfile.TemporaryDirectory(prefix="kalos-") as path:
        yield path
