"""Windows computed by the client from the session index, through a real sidecar.

Every answer a shm client computes itself (``Context.local``) is held against the sidecar's
own (the same sidecar over uds) for random sessions and operations from several clients; a
write is seen by the next read of any client (the sidecar publishes before it acknowledges);
a killed sidecar's index is not served once its heartbeat is stale; the index is off with
``--session-index-slots 0``, for ``turns=True``, for ``local_reads=False`` and for a client
of protocol 1.3.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable

import numpy as np
import pytest

import kalos
import kalos.transport.handshake
from conftest import TIMEOUT
from kalos import Scope
from kalos.errors import NotFound, SidecarGone
from kalos.testing import RunningSidecar
from kalos.transport.shm import LOCAL_READ_BEAT_NS

Start = Callable[..., RunningSidecar]


def test_local_windows_match_the_sidecars(sidecar: Start) -> None:
    sc = sidecar(extra_args=("--max-session-turns", "200"))
    shm = sc.connect(timeout=TIMEOUT)
    other = sc.connect(timeout=TIMEOUT)  # another process's view is the same memory
    uds = sc.connect(transport="uds", timeout=TIMEOUT)
    assert shm._lent().sessions is not None and uds._lent().sessions is None
    rng = np.random.default_rng(8)
    names = [f"s{k}" for k in range(8)]
    owner = {name: Scope("acme", f"u{k % 2}") if k % 3 else None for k, name in enumerate(names)}
    local = asked = 0
    for step in range(600):
        name = names[int(rng.integers(len(names)))]
        who = (shm, other, uds)[step % 3]
        op = rng.random()
        with contextlib.suppress(NotFound):
            if op < 0.02:
                who.append_turn(name, "system", "be brief", [1, 2], pin=True, scope=owner[name])
            elif op < 0.05:
                who.trim(name, int(rng.integers(0, 20)))
            elif op < 0.07:
                who.delete_session(name)
            else:
                ids = rng.integers(0, 50_000, int(rng.integers(0, 80)), dtype=np.int32)
                who.append_turn(name, "user", "t", ids, rolling=True, scope=owner[name])
        # the next read, from any client, sees the write
        for reader in (shm, other):
            name = names[int(rng.integers(len(names)))]
            budget = int(rng.integers(0, 5000))
            max_turns = None if rng.random() < 0.7 else int(rng.integers(0, 50))
            scope = [None, Scope("acme"), Scope("acme", "u1"), Scope("zeta")][step % 4]
            try:
                want = uds.context(name, budget, max_turns, turns=False, scope=scope, copy=True)
            except NotFound:
                with pytest.raises(NotFound):
                    reader.context(name, budget, max_turns, turns=False, scope=scope)
                continue
            got = reader.context(name, budget, max_turns, turns=False, scope=scope)
            assert np.array_equal(got.tokens, want.tokens) and got.tokens.dtype == np.int32
            assert got.system == want.system and got.turns is None
            asked += not want.system
            if got.local:
                local += 1
                assert not got.system and got.timings.compute_us == 0
                assert not got.tokens.flags.writeable  # a view of the token heap
                owned = reader.context(name, budget, max_turns, turns=False, scope=scope,
                                       copy=True)  # fmt: skip
                assert owned.local and np.array_equal(owned.tokens, want.tokens)
                assert owned.tokens.base is None or owned.tokens.base is not got.tokens.base
    assert local > 0.7 * asked, (local, asked)
    assert shm.stats()["session_index_sessions"] > 0


def test_turns_and_local_reads_false_ask_the_sidecar(sidecar: Start) -> None:
    sc = sidecar()
    shm = sc.connect(timeout=TIMEOUT)
    asking = sc.connect(timeout=TIMEOUT, local_reads=False)
    shm.append_turn("s", "user", "x", [1, 2, 3])
    assert shm.context("s", 10, turns=False).local
    assert not shm.context("s", 10).local  # turns are not in the index
    ctx = asking.context("s", 10, turns=False)
    assert not ctx.local and ctx.tokens.tolist() == [1, 2, 3]
    # a CONTEXT's scope filters by tenant and user: its session field is not looked at
    got = shm.context("s", 10, turns=False, scope=Scope(None, None, "t"))
    want = asking.context("s", 10, turns=False, scope=Scope(None, None, "t"))
    assert got.local and got.tokens.tolist() == want.tokens.tolist() == [1, 2, 3]


def test_a_killed_sidecars_index_is_not_served(sidecar: Start, tmp_path) -> None:
    runtime_dir = str(tmp_path / "run")
    first = sidecar(name="ix", runtime_dir=runtime_dir)
    client = first.connect(timeout=TIMEOUT)
    client.append_turn("s", "user", "x", [1, 2, 3])
    assert client.context("s", 10, turns=False).local
    first.stop(signal.SIGKILL)
    time.sleep(2 * LOCAL_READ_BEAT_NS / 1e9)  # its last heartbeat is stale by now
    with pytest.raises(SidecarGone):
        client.context("s", 10, turns=False)
    sidecar(name="ix", runtime_dir=runtime_dir)
    client.append_turn("s", "user", "y", [7, 8])  # a new, empty sidecar: a new session
    ctx = client.context("s", 10, turns=False)
    assert ctx.local and ctx.tokens.tolist() == [7, 8] and client.reconnects == 1


def test_no_index_with_zero_slots_or_an_older_client(
    sidecar: Start, monkeypatch: pytest.MonkeyPatch
) -> None:
    off = sidecar(name="off", extra_args=("--session-index-slots", "0"))
    client = off.connect(timeout=TIMEOUT)
    assert client._lent().sessions is None and "session_index" not in client.info
    client.append_turn("s", "user", "x", [4, 5])
    ctx = client.context("s", 10, turns=False)
    assert not ctx.local and ctx.tokens.tolist() == [4, 5]
    assert "session_index_sessions" not in client.stats()
    on = sidecar(name="on")
    monkeypatch.setattr(kalos.transport.handshake, "PROTOCOL_VERSION", (1, 3))
    old = on.connect(timeout=TIMEOUT)  # it asks for the index: the sidecar goes by 1.3
    assert old.info["protocol"] == [1, 3] and "session_index" not in old.info
    assert old._lent().heap is not None and old._lent().sessions is None
    old.append_turn("s", "user", "x", [4, 5])
    assert not old.context("s", 10, turns=False).local
