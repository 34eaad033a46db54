"""Closed to strangers: peer credentials, no /dev/shm names, per-tenant limits.

The other-uid tests run a client as uid/gid 65534 (nobody; the suite runs as root in CI).
The socket's directory is made traversable and the socket itself world-writable, so that the
file modes let the stranger through and the refusal must come from the sidecar's own check of
the peer's credentials (SO_PEERCRED).
"""

from __future__ import annotations

import json
import os
import signal
import stat
import tempfile
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

import kalos
import kalos.index
from conftest import DIM, TIMEOUT
from kalos import Scope
from kalos.errors import InvalidRequest
from kalos.stores.limits import Limits
from kalos.stores.memories import MemoryStore
from kalos.testing import RunningSidecar

NOBODY = 65534

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching uid needs root")


@pytest.fixture
def open_dir() -> Iterator[str]:
    """A runtime directory that another uid can traverse (0711), removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="kalos-sec-", dir="/tmp") as base:
        os.chmod(base, 0o711)
        run = os.path.join(base, "run")
        os.mkdir(run, 0o711)
        yield run


def connect_as_nobody(sc: RunningSidecar) -> dict:
    """Connects from a forked child that switched to uid and gid 65534 (no other groups)."""
    os.chmod(sc.socket, 0o666)  # let anyone reach the socket: only the peer check is left
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            try:
                with kalos.connect(sc.name, runtime_dir=sc.runtime_dir, timeout=10) as client:
                    client.ping()
                    got = {"ok": True, "uid": os.getuid(), "dim": client.dim}
            except kalos.KalosError as exc:
                got = {"ok": False, "error": type(exc).__name__, "message": str(exc)}
            os.write(write_end, json.dumps(got).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    deadline = time.monotonic() + TIMEOUT
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError("the client of another uid hangs")
        time.sleep(0.01)
    with os.fdopen(read_end, "rb") as f:
        return json.loads(f.read())


@needs_root
def test_a_client_of_another_uid_is_refused(
    sidecar: Callable[..., RunningSidecar], open_dir: str
) -> None:
    sc = sidecar(dim=DIM, runtime_dir=open_dir)
    got = connect_as_nobody(sc)
    assert got["ok"] is False and got["error"] == "ConnectError", got
    assert "refused" in got["message"] and f"uid {NOBODY}" in got["message"], got
    with sc.connect(timeout=TIMEOUT) as owner:  # the sidecar's own uid still gets in
        assert owner.stats()["refused"] == 1


@needs_root
def test_an_allowed_uid_is_accepted(sidecar: Callable[..., RunningSidecar], open_dir: str) -> None:
    sc = sidecar(dim=DIM, runtime_dir=open_dir, extra_args=("--allow-uid", str(NOBODY)))
    assert stat.S_IMODE(os.stat(sc.socket).st_mode) == 0o666  # reachable without a hand chmod
    got = connect_as_nobody(sc)
    assert got == {"ok": True, "uid": NOBODY, "dim": DIM}
    with sc.connect(timeout=TIMEOUT) as owner:
        assert owner.stats()["refused"] == 0


def shm_names() -> set[str]:
    return set(os.listdir("/dev/shm"))


def shm_mappings(pid: int) -> list[str]:
    with open(f"/proc/{pid}/maps") as f:
        return [line.split(None, 5)[-1].strip() for line in f if "/dev/shm" in line]


def test_no_world_visible_shared_memory_names(sidecar: Callable[..., RunningSidecar]) -> None:
    before = shm_names()
    # what this test process already maps (an earlier test's multiprocessing semaphores, say)
    mine_before = set(shm_mappings(os.getpid()))
    sc = sidecar(dim=DIM)
    clients = [sc.connect(timeout=TIMEOUT) for _ in range(3)]
    for i, c in enumerate(clients):
        c.add(np.ones(DIM), i, f"memory {i}", scope=Scope("t"))
        assert c.search(np.ones(DIM), k=3).ids.size == 3
    new = shm_names() - before
    # other processes on the machine may come and go; none of the names may be the sidecar's
    assert not [n for n in new if "kalos" in n.lower()], new
    assert shm_mappings(sc.process.pid) == []
    assert set(shm_mappings(os.getpid())) <= mine_before  # the clients mapped no named shm
    with open(f"/proc/{sc.process.pid}/maps") as f:
        maps = f.read()
    assert "memfd:kalos-channel" in maps and "memfd:kalos-control" in maps  # memfds instead
    for c in clients:
        c.close()


# -- per-tenant limits --------------------------------------------------------------------------


def store(**limits: int) -> MemoryStore:
    return MemoryStore(kalos.index.create("cpu:flat", dim=DIM), Limits(**limits))


def add(s: MemoryStore, ids: list[int], tenant: str | None, payload: bytes = b"") -> None:
    n = len(ids)
    kinds = np.full(n, 2 if payload else 0, np.uint8)
    offsets = np.arange(n + 1, dtype=np.uint64) * len(payload)
    blob = np.frombuffer(payload * n, np.uint8)
    s.add(np.array(ids, np.int64), np.ones((n, DIM), np.float32), kinds, offsets, blob,
          Scope(tenant))  # fmt: skip


def test_tenant_item_limit() -> None:
    s = store(tenant_max_items=3)
    add(s, [1, 2], "acme")
    add(s, [2, 3], "acme")  # one replaced, one new: 3
    with pytest.raises(InvalidRequest, match=r"'acme' would hold 4 items.*--tenant-max-items"):
        add(s, [4], "acme")
    assert len(s) == 3  # refused before anything changed
    add(s, [10, 11, 12], "other")  # another tenant has its own count
    add(s, [20, 21, 22, 23], None)  # items without a tenant are not limited
    s.remove(np.array([1, 2], np.int64))
    add(s, [4], "acme")  # 3, 4
    add(s, [12], "acme")  # moving an item from "other" to "acme" counts against acme
    with pytest.raises(InvalidRequest):
        add(s, [5], "acme")
    add(s, [13], "other")  # other has 3 items again after the move
    with pytest.raises(InvalidRequest):
        add(s, [14], "other")


def test_tenant_byte_limit() -> None:
    item = 4 * DIM  # a vector's bytes, as accounted
    s = store(tenant_max_bytes=2 * item + 10)
    add(s, [1], "acme", b"12345")
    add(s, [2], "acme", b"12345")
    with pytest.raises(InvalidRequest, match=r"'acme' would hold .* bytes.*--tenant-max-bytes"):
        add(s, [1], "acme", b"123456")  # a replacement that grows its payload
    add(s, [1], "acme", b"")  # a smaller one fits
    add(s, [3], "other", b"x" * 10)
    s.forget(Scope("acme"))
    add(s, [5, 6], "acme", b"12345")


def test_tenant_limits_through_a_sidecar(sidecar: Callable[..., RunningSidecar]) -> None:
    sc = sidecar(dim=DIM, extra_args=("--tenant-max-items", "2", "--tenant-max-bytes", "1000"))
    with sc.connect(timeout=TIMEOUT) as c:
        c.add(np.ones((2, DIM)), [1, 2], scope=Scope("acme"))
        with pytest.raises(InvalidRequest, match="--tenant-max-items"):
            c.add(np.ones(DIM), 3, scope=Scope("acme", "u"))
        with pytest.raises(InvalidRequest, match="--tenant-max-bytes"):
            c.add(np.ones(DIM), 4, b"x" * 1000, scope=Scope("beta"))
        c.add(np.ones(DIM), 5, b"x" * 100, scope=Scope("beta"))
        assert c.stats()["items"] == 3
