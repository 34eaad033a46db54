"""The token heap: its buddy allocator, and reuse only once no reader can still see a region.

The randomized tests hold the rule the CONTEXT-by-reference path relies on: a region (or any
part of one) is never handed out again while a live channel's last by-reference response
points into it (the client may hold that view until its next call), nor while a hold (a
forked snapshot writer) that saw it is active. And at the store level: a view lent by
``SessionStore.context_lent`` keeps its values, whatever other requests do to the sessions,
until its channel makes another request.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from kalos.errors import ConfigError
from kalos.stores.sessions import SessionStore
from kalos.stores.token_heap import (
    UNIT_BYTES,
    UNIT_TOKENS,
    BuddyAllocator,
    Hold,
    TokenHeap,
    order_for,
)

T0 = 1_000_000.0


class FakeReader:
    """A channel as the heap sees it (kalos.server.channels.ServerChannel's fields)."""

    def __init__(self) -> None:
        self.requests = 0
        self.lent_region = -1
        self.lent_request = 0
        self.closed = False

    def viewing(self) -> int:
        return -1  # no window of its own (kalos.stores.session_index)


# -- the allocator ------------------------------------------------------------------------------


def test_buddy_splits_and_coalesces() -> None:
    a = BuddyAllocator(8)
    assert a.free_blocks() == [(0, 3)]
    x, y, z = a.alloc(0), a.alloc(0), a.alloc(1)
    assert {x, y} == {0, 1} and z == 2
    assert a.used_units == 4
    assert a.alloc(3) == -1  # no 8-unit block left
    assert a.alloc(2) == 4
    assert a.alloc(0) == -1  # full
    for at in (x, z, 4, y):
        a.free(at)
    assert a.free_blocks() == [(0, 3)] and a.used_units == 0


def test_buddy_with_a_size_that_is_no_power_of_two() -> None:
    a = BuddyAllocator(13)  # 8 + 4 + 1
    assert a.free_blocks() == [(0, 3), (8, 2), (12, 0)]
    got = sorted(a.alloc(0) for _ in range(13))
    assert got == list(range(13)) and a.alloc(0) == -1
    for at in got:
        a.free(at)
    assert a.free_blocks() == [(0, 3), (8, 2), (12, 0)]
    assert a.alloc(4) == -1  # larger than the heap


def test_order_for() -> None:
    assert [order_for(n) for n in (0, 1, 256, 257, 512, 513, 4096)] == [0, 0, 0, 1, 1, 2, 4]


def test_buddy_randomized_never_overlaps() -> None:
    rng = np.random.default_rng(1)
    a = BuddyAllocator(100)
    live: dict[int, int] = {}
    owner = np.full(100, -1)
    for _ in range(3000):
        if live and rng.random() < 0.45:
            at = list(live)[int(rng.integers(len(live)))]
            owner[at : at + (1 << live.pop(at))] = -1
            a.free(at)
            continue
        order = int(rng.integers(0, 5))
        at = a.alloc(order)
        if at < 0:
            continue
        assert at % (1 << order) == 0 and at + (1 << order) <= 100
        assert (owner[at : at + (1 << order)] == -1).all()
        owner[at : at + (1 << order)] = at
        live[at] = order
    for at in list(live):
        a.free(at)
    assert a.used_units == 0 and a.free_blocks() == BuddyAllocator(100).free_blocks()


# -- the heap: quarantine -------------------------------------------------------------------------


def test_heap_size_is_checked() -> None:
    for bad in (0, 1000, UNIT_BYTES + 4):
        with pytest.raises(ConfigError):
            TokenHeap(bad)


def test_the_clients_descriptor_is_read_only() -> None:
    heap = TokenHeap(4 * UNIT_BYTES)
    try:
        assert os.fstat(heap.reader_fd()).st_size == 4 * UNIT_BYTES
        with open(f"/proc/self/fdinfo/{heap.reader_fd()}") as f:
            flags = int(f.read().split()[3], 8)
        assert flags & os.O_ACCMODE == os.O_RDONLY
    finally:
        heap.close()


def test_a_free_region_is_reused_at_once_when_nobody_holds_it() -> None:
    heap = TokenHeap(2 * UNIT_BYTES)
    reader = FakeReader()
    heap.attach(reader)
    got = heap.alloc(10)
    assert got is not None and len(got[1]) == UNIT_TOKENS
    heap.lend(reader, got[0])
    reader.requests += 1  # the lending request answered
    reader.requests += 1  # and the next one: the client dropped its view
    heap.free(got[0])
    assert heap.stats()["token_heap_quarantined"] == 0
    assert heap.alloc(UNIT_TOKENS * 2) is not None  # the whole heap again


def test_a_lent_region_waits_for_the_readers_next_request() -> None:
    heap = TokenHeap(2 * UNIT_BYTES)
    a, b = FakeReader(), FakeReader()
    heap.attach(a)
    heap.attach(b)
    r1 = heap.alloc(1)
    r2 = heap.alloc(1)
    assert r1 is not None and r2 is not None
    heap.lend(a, r1[0])
    a.requests += 1
    heap.free(r1[0])  # a still holds a view of it
    assert heap.stats()["token_heap_quarantined"] == 1
    assert heap.alloc(1) is None  # r2 is live, r1 pinned
    b.requests += 5  # other channels' requests change nothing
    assert heap.alloc(1) is None
    a.requests += 1  # a's next request: its view is gone
    again = heap.alloc(1)
    assert again is not None and again[0] == r1[0]
    assert heap.stats()["token_heap_quarantined"] == 0
    assert heap.stats()["token_heap_fallbacks"] == 2


def test_a_closed_reader_pins_nothing() -> None:
    heap = TokenHeap(UNIT_BYTES)
    a = FakeReader()
    heap.attach(a)
    r = heap.alloc(1)
    assert r is not None
    heap.lend(a, r[0])
    a.requests += 1
    heap.free(r[0])
    assert heap.alloc(1) is None
    heap.detach(a)
    assert heap.alloc(1) is not None


def test_a_region_lent_earlier_is_not_pinned_by_a_later_lend() -> None:
    heap = TokenHeap(2 * UNIT_BYTES)
    a = FakeReader()
    heap.attach(a)
    r1, r2 = heap.alloc(1), heap.alloc(1)
    assert r1 is not None and r2 is not None
    heap.lend(a, r1[0])
    a.requests += 1
    heap.lend(a, r2[0])  # the next request lent another region: the view of r1 is gone
    a.requests += 1
    heap.free(r1[0])
    assert heap.stats()["token_heap_quarantined"] == 0


def test_a_hold_pins_what_is_freed_while_it_is_active() -> None:
    heap = TokenHeap(UNIT_BYTES)
    r = heap.alloc(1)
    assert r is not None
    hold = heap.hold()
    heap.free(r[0])
    assert heap.alloc(1) is None
    hold.release()
    assert heap.alloc(1) is not None
    late = heap.hold()
    late.release()  # released before anything was freed: pins nothing
    assert isinstance(late, Hold) and heap.reclaim() == 0


@pytest.mark.parametrize("seed", range(6))
def test_randomized_no_region_is_handed_out_while_it_may_be_seen(seed: int) -> None:
    """Random allocations, frees, lends, requests, closes and holds: every allocation must
    avoid live regions, every view a live reader may still hold, and every region freed
    while a hold was active (until it is released)."""
    rng = np.random.default_rng(seed)
    units = 64
    heap = TokenHeap(units * UNIT_BYTES)
    size = units * UNIT_TOKENS
    live: dict[int, int] = {}  # region -> length (tokens)
    readers: list[FakeReader] = []
    views: dict[int, tuple[int, int]] = {}  # id(reader) -> (region, length) it may still read
    holds: list[tuple[Hold, list[tuple[int, int]]]] = []  # each hold and what it froze
    lengths: dict[int, int] = {}
    for _ in range(4000):
        op = rng.random()
        if op < 0.3:
            got = heap.alloc(int(rng.integers(1, 8 * UNIT_TOKENS)))
            if got is None:
                continue
            at, view = got
            lo, hi = at, at + len(view)
            assert lo >= 0 and hi <= size and at % UNIT_TOKENS == 0
            busy = list(live.items()) + list(views.values())
            busy += [span for h, frozen in holds if h.active for span in frozen]
            for start, n in busy:
                assert hi <= start or start + n <= lo, "a region that may be seen was reused"
            live[at] = lengths[at] = len(view)
        elif op < 0.5 and live:
            at = list(live)[int(rng.integers(len(live)))]
            n = live.pop(at)
            heap.free(at)
            for h, frozen in holds:
                if h.active:
                    frozen.append((at, n))
        elif op < 0.7 and live and readers:  # a CONTEXT by reference on some channel
            r = readers[int(rng.integers(len(readers)))]
            if r.closed:
                continue
            at = list(live)[int(rng.integers(len(live)))]
            heap.lend(r, at)
            r.requests += 1
            views[id(r)] = (at, live[at])
        elif op < 0.85 and readers:  # another request on some channel: its view is gone
            r = readers[int(rng.integers(len(readers)))]
            r.requests += 1
            views.pop(id(r), None)
        elif op < 0.9:
            r = FakeReader()
            heap.attach(r)
            readers.append(r)
        elif op < 0.94 and readers:
            r = readers.pop(int(rng.integers(len(readers))))
            heap.detach(r)
            views.pop(id(r), None)
        elif op < 0.97:
            holds.append((heap.hold(), []))
        elif holds:
            holds.pop(int(rng.integers(len(holds))))[0].release()
    # Once every view and hold is gone, every freed region comes back.
    for r in readers:
        r.requests += 1
    for h, _ in holds:
        h.release()
    for at in list(live):
        heap.free(at)
    heap.reclaim()
    assert heap.stats()["token_heap_used_bytes"] == 0
    assert heap.stats()["token_heap_quarantined"] == 0
    got = heap.alloc(size)
    assert got is not None and got[0] == 0


# -- sessions in the heap -------------------------------------------------------------------------


def copying_tokens(
    store: SessionStore, name: str, budget: int, max_turns: int | None
) -> np.ndarray:
    return np.frombuffer(store.context_tokens(name, budget, max_turns, now=T0)[0], np.int32)


@pytest.mark.parametrize("heap_units", [4096, 24])  # roomy; so small that sessions fall back
def test_lent_views_keep_their_values_until_the_next_request(heap_units: int) -> None:
    """Random appends (some pinned system prompts), trims, rolling drops, deletes, forgets
    and contexts; each context by reference is checked against the copying path, and every
    view still held is checked after every operation: its values never change."""
    rng = np.random.default_rng(heap_units)
    from kalos.stores.limits import Limits

    heap = TokenHeap(heap_units * UNIT_BYTES)
    store = SessionStore(Limits(max_session_turns=40), heap=heap)
    readers = [FakeReader() for _ in range(3)]
    for r in readers:
        heap.attach(r)
    held: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # reader -> (view, values)
    names = [f"s{k}" for k in range(6)]
    lent = copied = 0
    for step in range(2500):
        name = names[int(rng.integers(len(names)))]
        op = rng.random()
        exists = store.owner(name, T0) is not None
        if op < 0.45:
            n = int(rng.integers(0, 300))
            ids = rng.integers(0, 1 << 30, n, dtype=np.int32)
            pin = rng.random() < 0.03
            store.append_turn(name, "user", "t", ids, now=T0, pin=pin, rolling=True)
        elif op < 0.5 and exists:
            store.trim(name, int(rng.integers(0, 10)), now=T0)
        elif op < 0.53 and exists:
            store.delete(name, now=T0)
        elif op < 0.54:
            from kalos.protocol.messages import Scope

            store.forget(Scope(session=name))
        elif exists:  # a CONTEXT on one channel, by reference when it can be
            k = int(rng.integers(len(readers)))
            r = readers[k]
            held.pop(k, None)  # this request is the client's next call
            budget = int(rng.integers(0, 3000))
            max_turns = None if rng.random() < 0.7 else int(rng.integers(0, 20))
            tokens, _, _, _, system, at = store.context_lent(
                name, budget, max_turns, r, turns=False, now=T0
            )
            want = copying_tokens(store, name, budget, max_turns)
            if at >= 0:
                view = np.frombuffer(heap.mem.buf, np.int32, len(tokens) // 4, at)
                assert system is None
                held[k] = (view, view.copy())
                lent += 1
            else:
                view = np.frombuffer(tokens, np.int32)
                copied += 1
            assert np.array_equal(view, want)
            r.requests += 1
        for view, values in held.values():
            assert np.array_equal(view, values), f"a lent view changed at step {step}"
    assert lent > 50 and copied > 10
    if heap_units == 24:
        assert heap.fallbacks > 0


def test_every_way_a_session_goes_gives_its_region_back() -> None:
    heap = TokenHeap(64 * UNIT_BYTES)
    store = SessionStore(heap=heap)
    ids = np.arange(1000, dtype=np.int32)
    used = lambda: heap.stats()["token_heap_used_bytes"]  # noqa: E731
    from kalos.protocol.messages import Scope

    for name in ("del", "forget", "reap", "replaced", "trim"):
        store.append_turn(name, "user", "x", ids, now=T0, owner=Scope("t", "u"))
    assert used() == 5 * 2048 * 4  # 1,000 ids: a 2,048-id region each (twice the need)
    store.delete("del", now=T0)
    assert store.forget(Scope(session="forget")) == 1
    store.append_turn("reap", "user", "x", ids, now=T0, ttl_s=1)
    store.append_turn("replaced", "user", "x", ids, now=T0, ttl_s=1)
    store.append_turn("replaced", "user", "x", ids[:10], now=T0 + 5)  # expired: a new session
    store.reap(T0 + 5)  # "reap" (the append above may have reaped it already)
    assert sorted(i.session for i in store.sessions(None, now=T0 + 5)) == ["replaced", "trim"]
    store.trim("trim", 0, now=T0 + 5)  # compaction moves its (no) ids to a small region
    assert used() == 2 * UNIT_BYTES
    again = SessionStore(heap=heap)
    store.clear()
    assert used() == 0 and len(again) == 0


class _SlowStore:
    """Written first by a snapshot: the forked writer reads the sessions only after this."""

    def snapshot(self, db: object, directory: str) -> None:
        import time

        time.sleep(0.5)

    def restore(self, db: object, directory: str) -> None:
        pass


def test_a_forked_snapshot_writer_sees_the_heap_as_it_was(tmp_path) -> None:
    """The child's image of the shared heap is not copied on write: what the sidecar frees
    while it writes must not be reused before it is done (SessionStore.hold)."""
    import sqlite3
    import threading

    import kalos.index
    from kalos.server.dispatch import Dispatcher
    from kalos.server.durability import Durability, list_snapshots
    from kalos.stores.memories import MemoryStore

    heap = TokenHeap(16 * UNIT_BYTES)
    sessions = SessionStore(heap=heap)
    dispatcher = Dispatcher(MemoryStore(kalos.index.create("cpu:flat", dim=4)), sessions=sessions)
    durability = Durability(
        str(tmp_path), dispatcher, threading.Lock(), {"slow": _SlowStore(), "sessions": sessions}
    )
    durability.recover()
    ids = np.arange(1000, dtype=np.int32)
    sessions.append_turn("a", "user", "x", ids, now=T0)  # a 2,048-id region: half the heap
    region = sessions.live("a", now=T0).tok_at
    durability.wal.append(4, 0, np.zeros(8, np.uint8), 0)  # something to snapshot
    assert durability.snapshot() is not None  # the child sleeps, then reads the sessions
    sessions.delete("a", now=T0)
    sessions.append_turn("b", "user", "y", ids + 5000, now=T0)  # a's region is held: private
    b_at = sessions.live("b", now=T0).tok_at
    assert durability._finisher is not None
    durability._finisher.join()
    sessions.delete("b", now=T0)
    sessions.append_turn("c", "user", "z", ids, now=T0)  # the hold is gone: a's region again
    assert sessions.live("c", now=T0).tok_at == region
    _lsn, path = list_snapshots(str(tmp_path))[-1]
    again = SessionStore()
    db = sqlite3.connect(f"{path}/snapshot.db")
    try:
        again.restore(db, path)
    finally:
        db.close()
    assert np.array_equal(again.turns("a", now=T0)[0][2], ids)  # not b's ids
    assert b_at == -1  # b could not have a's region while the child ran
    durability.close()
