"""CONTEXT by reference through a real sidecar: shm clients read token ids in the token heap.

Each answer over shm is held against the copying path (the same sidecar over uds), for random
sessions; views are held while other channels relocate, trim and delete what they show; a
full heap falls back to copying; a client reconnects to a restarted sidecar's new heap.
The shm clients here ask the sidecar every time (``local_reads=False``): windows computed
by the client from the session index are tests/test_session_index_client.py's.
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

Start = Callable[..., RunningSidecar]


def same_answers(shm: kalos.Client, uds: kalos.Client, names: list[str], rng) -> int:
    """Asks both clients for random windows of every session; returns how many shm answers
    came by reference (read-only heap views). Fails on any difference."""
    by_ref = 0
    for name in names:
        budget = int(rng.integers(0, 4000))
        max_turns = None if rng.random() < 0.6 else int(rng.integers(0, 30))
        turns = bool(rng.random() < 0.5)
        try:
            want = uds.context(name, budget, max_turns, turns=turns, copy=True)
        except NotFound:
            with pytest.raises(NotFound):
                shm.context(name, budget, max_turns, turns=turns)
            continue
        got = shm.context(name, budget, max_turns, turns=turns)
        assert got.tokens.dtype == np.int32
        assert np.array_equal(got.tokens, want.tokens), name
        assert got.system == want.system
        if turns:
            assert got.turns == list(want.turns or ())
            assert np.array_equal(got.turns.token_counts(), want.turns.token_counts())
        else:
            assert got.turns is None
        if not got.tokens.flags.writeable:
            assert not got.system  # a window with the system prompt is copied
            by_ref += 1
        owned = shm.context(name, budget, max_turns, turns=turns, copy=True)
        assert owned.tokens.flags.writeable and np.array_equal(owned.tokens, want.tokens)
    return by_ref


def test_context_by_reference_matches_the_copying_path(sidecar: Start) -> None:
    sc = sidecar(extra_args=("--max-session-turns", "60"))
    shm = sc.connect(timeout=TIMEOUT, local_reads=False)
    uds = sc.connect(transport="uds", timeout=TIMEOUT)
    assert shm._lent().heap is not None and uds._lent().heap is None
    rng = np.random.default_rng(3)
    names = [f"s{k}" for k in range(12)]
    by_ref = 0
    for round_ in range(6):
        for _ in range(150):
            name = names[int(rng.integers(len(names)))]
            ids = rng.integers(0, 50_000, int(rng.integers(0, 250)), dtype=np.int32)
            who = shm if rng.random() < 0.5 else uds
            op = rng.random()
            if op < 0.03:
                who.append_turn(name, "system", "be brief", ids[:20], pin=True)
            elif op < 0.06:
                who.append_turn(name, "user", "short-lived", ids, ttl_s=0.3)
            else:
                who.append_turn(name, "user", f"turn {round_}", ids, rolling=True)
        for name in names[:4]:
            with contextlib.suppress(NotFound):
                (shm if round_ % 2 else uds).trim(name, int(rng.integers(0, 20)))
        by_ref += same_answers(shm, uds, names, rng)
        if round_ == 2:
            shm.delete_session(names[5])
            uds.forget(Scope(session=names[6]))
        if round_ == 4:
            time.sleep(0.35)  # the short-lived sessions expire
        by_ref += same_answers(shm, uds, names, rng)
    assert by_ref > 20
    stats = shm.stats()
    assert stats["token_heap_used_bytes"] > 0 and stats["token_heap_fallbacks"] == 0


def test_a_view_keeps_its_values_until_its_next_call(sidecar: Start) -> None:
    sc = sidecar()
    names = ("grow", "trim", "gone")
    readers = {name: sc.connect(timeout=TIMEOUT, local_reads=False) for name in names}
    writer = sc.connect(timeout=TIMEOUT, local_reads=False)
    first = np.arange(300, dtype=np.int32)
    for name in names:
        writer.append_turn(name, "user", "x", first)
        writer.append_turn(name, "user", "y", first + 1000)
    views = {name: readers[name].context(name, 10_000, turns=False).tokens for name in names}
    want = {name: v.copy() for name, v in views.items()}
    assert not any(v.flags.writeable for v in views.values())
    quarantined = writer.stats()["token_heap_quarantined"]
    # Another channel relocates one session (growth), compacts one (trim), deletes one, and
    # allocates plenty, which would reuse any region given back.
    for k in range(20):
        writer.append_turn("grow", "user", "z", np.full(500, k, np.int32))
    writer.trim("trim", 1)
    writer.delete_session("gone")
    for k in range(50):
        writer.append_turn(f"new{k}", "user", "n", np.full(600, 0x7FFFFFFF, np.int32))
    for name, v in views.items():
        assert np.array_equal(v, want[name]), f"the view of {name} changed"
    assert writer.stats()["token_heap_quarantined"] == quarantined + 3
    for r in readers.values():
        r.ping()  # each reader's next call: its view may go now
    writer.append_turn("more", "user", "m", np.zeros(10, np.int32))  # an allocation reclaims
    assert writer.stats()["token_heap_quarantined"] == quarantined
    ctx = readers["grow"].context("grow", 100_000, turns=False)
    assert ctx.tokens[:600].tolist() == [*first.tolist(), *(first + 1000).tolist()]
    assert readers["trim"].context("trim", 1000, turns=False).tokens.tolist() == [*(first + 1000)]


def test_a_full_heap_falls_back_to_copying(sidecar: Start) -> None:
    sc = sidecar(extra_args=("--token-heap-mb", "0.0625"))  # 64 KiB: 16,384 ids
    shm = sc.connect(timeout=TIMEOUT, local_reads=False)
    uds = sc.connect(transport="uds", timeout=TIMEOUT)
    rng = np.random.default_rng(5)
    names = [f"s{k}" for k in range(10)]
    for _ in range(200):
        name = names[int(rng.integers(len(names)))]
        shm.append_turn(name, "user", "x", rng.integers(0, 9, 100, dtype=np.int32))
    assert shm.stats()["token_heap_fallbacks"] > 0
    assert same_answers(shm, uds, names, rng) > 0  # the sessions that fit are still lent
    for name in names:
        ctx = shm.context(name, 100_000, turns=False)
        assert np.array_equal(ctx.tokens, uds.context(name, 100_000, turns=False).tokens)


def test_without_a_heap_every_context_is_copied(sidecar: Start) -> None:
    sc = sidecar(extra_args=("--token-heap-mb", "0"))
    shm = sc.connect(timeout=TIMEOUT, local_reads=False)
    assert shm._lent().heap is None and "token_heap_bytes" not in shm.stats()
    shm.append_turn("s", "user", "x", [1, 2, 3])
    ctx = shm.context("s", 10, turns=False)
    assert ctx.tokens.tolist() == [1, 2, 3] and ctx.tokens.flags.writeable


def test_a_client_maps_the_new_heap_of_a_restarted_sidecar(sidecar: Start, tmp_path) -> None:
    runtime_dir = str(tmp_path / "run")
    first = sidecar(name="heap", runtime_dir=runtime_dir)
    client = first.connect(timeout=TIMEOUT, local_reads=False)
    client.append_turn("s", "user", "x", [1, 2, 3])
    old = client.context("s", 10, turns=False).tokens
    assert not old.flags.writeable
    old_heap = client._lent().heap
    first.stop(signal.SIGKILL)
    with pytest.raises(SidecarGone):
        client.ping()
    sidecar(name="heap", runtime_dir=runtime_dir)
    client.append_turn("s", "user", "y", [7, 8])  # a new, empty sidecar: a new session
    new = client.context("s", 10, turns=False).tokens
    assert new.tolist() == [7, 8] and not new.flags.writeable
    assert client._lent().heap is not old_heap and client.reconnects == 1
    assert old.tolist() == [1, 2, 3]  # the old heap stays mapped while a view of it lives


def test_a_client_of_protocol_1_1_gets_no_heap(
    sidecar: Start, monkeypatch: pytest.MonkeyPatch
) -> None:
    sc = sidecar()
    monkeypatch.setattr(kalos.transport.handshake, "PROTOCOL_VERSION", (1, 1))
    # it still says token_heap: the sidecar goes by 1.1
    old = sc.connect(timeout=TIMEOUT, local_reads=False)
    assert old.info["protocol"] == [1, 1] and "token_heap" not in old.info
    assert old._lent().heap is None
    old.append_turn("s", "user", "x", [4, 5])
    assert old.context("s", 10, turns=False).tokens.tolist() == [4, 5]
