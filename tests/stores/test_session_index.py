"""The session index: windows a client computes from shared memory are the store's, or none.

The rule every test holds: whenever :meth:`IndexReader.read` answers, the ids it points to
and its turn count equal what :meth:`SessionStore.context_tokens` answers at that moment;
when the store would raise NotFound, the index does not answer. Not answering is always
allowed (the client asks the sidecar then), but the tests also hold that the index answers
the ordinary cases: a heap-resident session without a system prompt whose window lies within
its newest turns.
A thread that mutates sessions while another reads shows that a window never changes under
its reader until the reader's next read (each turn's ids name the turn, so a mixed or
overwritten window is visible): the reader's view mark pins the region.
"""

from __future__ import annotations

import mmap
import struct
import sys
import threading
import time

import numpy as np
import pytest

from kalos import _native
from kalos.errors import ConfigError, NotFound
from kalos.protocol.messages import Scope
from kalos.stores.limits import Limits
from kalos.stores.session_index import RING, IndexReader, SessionIndex, index_bytes
from kalos.stores.sessions import SessionStore
from kalos.stores.token_heap import TokenHeap

T0 = 1_800_000_000.0
NS = 1_000_000_000


class Client:
    """A client's side: the index and the heap mapped read-only, and its channel's view mark
    (attached to the heap as a reader, as the sidecar's ServerChannel is)."""

    def __init__(self, index: SessionIndex, heap: TokenHeap) -> None:
        mem = mmap.mmap(index.reader_fd(), index.nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
        self.ids = np.frombuffer(
            mmap.mmap(heap.reader_fd(), heap.nbytes, mmap.MAP_SHARED, mmap.PROT_READ), np.int32
        )
        self.index = IndexReader(mem, self.ids)
        self.marks = np.zeros(8, np.uint64)  # its own line
        self.mark = self.marks.ctypes.data
        self.requests, self.lent_region, self.lent_request, self.closed = 0, -1, 0, False
        heap.attach(self)

    def viewing(self) -> int:
        return int(_native.load_acquire(self.mark)) - 1


def make(slots: int = 64, heap_kb: int = 4096, **limits):
    heap = TokenHeap(heap_kb * 1024)
    index = SessionIndex(slots)
    store = SessionStore(Limits(**limits), heap=heap, index=index)
    return store, index, Client(index, heap)


def read(client: Client, name: str, budget: int, max_turns=None, scope=None, now=T0, copy=True):
    got = client.index.read(
        name.encode(),
        budget,
        (1 << 32) - 1 if max_turns is None else max_turns,
        scope.tenant.encode() if scope is not None and scope.tenant else None,
        scope.user.encode() if scope is not None and scope.user else None,
        int(now * NS),
        client.mark,
    )
    if got is None:
        return None
    view = client.ids[got[0] : got[0] + got[1]]
    return (view.copy() if copy else view), got[2]


def want(store: SessionStore, name: str, budget: int, max_turns=None, scope=None, now=T0):
    try:
        mv, turns, system = store.context_tokens(name, budget, max_turns, now=now, scope=scope)
    except NotFound:
        return None
    return np.frombuffer(mv, np.int32).copy(), turns, system


def agree(store, reader, name, budget, max_turns=None, scope=None, now=T0) -> bool:
    """Fails unless the index's answer (if any) is the store's; True when it answered."""
    got = read(reader, name, budget, max_turns, scope, now)
    w = want(store, name, budget, max_turns, scope, now)
    if got is None:
        return False
    assert w is not None, f"{name}: the index answered for a session the store does not serve"
    assert w[2] is None, "the index answered for a session with a system prompt"
    assert np.array_equal(got[0], w[0]) and got[1] == w[1], (name, budget, max_turns)
    return True


def test_windows_match_the_store_over_random_operations() -> None:
    store, index, reader = make(slots=64, max_session_turns=300)
    heap = store.heap
    assert heap is not None
    free = heap.free

    def checked_free(region: int) -> None:
        # the order the view marks rely on: a region is freed only while no stable slot
        # points at it (its session's slot is being written, or gone)
        for at in index._at.values():
            seq, state, _, _, tok_at = struct.unpack_from("<QIIqq", index._buf, at)
            assert seq & 1 or state != 1 or tok_at != region, "freed under a stable slot"
        free(region)

    heap.free = checked_free  # type: ignore[method-assign]
    rng = np.random.default_rng(5)
    names = [f"s{k}" for k in range(10)]
    owners = [Scope("t1", "u1"), Scope("t2", None), None]
    answered = asked = 0
    now = T0
    for step in range(1500):
        name = names[int(rng.integers(len(names)))]
        op = rng.random()
        owner = owners[int(name[1:]) % 3]
        try:
            if op < 0.03:
                store.append_turn(name, "system", "x", _ids(rng, 5), now=now, pin=True,
                                  owner=owner)  # fmt: skip
            elif op < 0.06:
                store.trim(name, int(rng.integers(0, 40)), now=now)
            elif op < 0.08:
                store.delete(name, now=now)
            elif op < 0.09:
                store.forget(Scope("t2"))
            elif op < 0.11:
                store.append_turn(name, "user", "t", _ids(rng, 30), now=now, ttl_s=2.0,
                                  owner=owner)  # fmt: skip
            else:
                store.append_turn(name, "user", "t", _ids(rng, int(rng.integers(0, 60))),
                                  now=now, rolling=True, owner=owner)  # fmt: skip
        except NotFound:
            pass
        now += float(rng.random() * 0.05)
        for name in rng.choice(names, 3):
            budget = int(rng.integers(0, 6000))
            max_turns = None if rng.random() < 0.6 else int(rng.integers(0, 200))
            scope = [None, Scope("t1"), Scope("t1", "u1"), Scope(None, "u2")][step % 4]
            w = want(store, str(name), budget, max_turns, scope, now)
            asked += w is not None and w[2] is None  # served by the store, no system prompt
            answered += agree(store, reader, str(name), budget, max_turns, scope, now)
    assert answered > 0.7 * asked, (answered, asked)  # the ordinary cases are answered


def _ids(rng, n: int) -> np.ndarray:
    return rng.integers(0, 50_000, n, dtype=np.int32)


def test_only_the_newest_turns_are_held() -> None:
    store, _, reader = make()
    for k in range(RING + 40):
        store.append_turn("long", "user", "t", np.full(10, k, np.int32), now=T0)
    # within the newest RING - 1 turns: answered
    assert agree(store, reader, "long", 10 * (RING - 2))
    assert agree(store, reader, "long", 10 * (RING - 1) - 1)
    assert agree(store, reader, "long", 10**9, max_turns=RING - 1)
    assert agree(store, reader, "long", 10**9, max_turns=3)
    # a window that may reach older turns than the slot holds: the sidecar's
    assert read(reader, "long", 10 * RING) is None
    assert read(reader, "long", 10**9) is None
    store.trim("long", RING - 1, now=T0)  # now every live turn is held: answered in full
    assert agree(store, reader, "long", 10**9)


def test_sessions_the_index_does_not_hold() -> None:
    store, index, reader = make(slots=8, heap_kb=4)
    store.append_turn("a", "user", "t", np.arange(5, dtype=np.int32), now=T0)
    assert agree(store, reader, "a", 100)
    store.append_turn("a", "system", "s", np.arange(3, dtype=np.int32), now=T0, pin=True)
    assert read(reader, "a", 100) is None  # a system prompt: its ids live apart
    assert want(store, "a", 100)[2] is not None
    long = "n" * 200  # id, tenant and user over KEY_BYTES
    store.append_turn(long, "user", "t", np.arange(5, dtype=np.int32), now=T0)
    assert read(reader, long, 100) is None and want(store, long, 100) is not None
    # a heap with no room: the session's ids are private, and so is its window
    store.append_turn("big", "user", "t", np.arange(4000, dtype=np.int32), now=T0)
    assert read(reader, "big", 10**6) is None and want(store, "big", 10**6) is not None
    # more sessions than the table takes (3/4 of 8 slots): the rest are the sidecar's
    for k in range(10):
        store.append_turn(f"k{k}", "user", "t", np.arange(2, dtype=np.int32), now=T0)
    held = sum(read(reader, f"k{k}", 100) is not None for k in range(10))
    assert 0 < held <= 6 and len(index) <= 6
    assert read(reader, "never", 100) is None


def test_expiry_scope_and_removal() -> None:
    store, _, reader = make()
    store.append_turn("e", "user", "t", np.arange(4, dtype=np.int32), now=T0, ttl_s=10.0,
                      owner=Scope("acme", "ann"))  # fmt: skip
    assert agree(store, reader, "e", 100, now=T0 + 9.9)
    assert read(reader, "e", 100, now=T0 + 10.0) is None  # expired: NotFound from the store
    assert want(store, "e", 100, now=T0 + 10.0) is None
    assert agree(store, reader, "e", 100, scope=Scope("acme"))
    assert agree(store, reader, "e", 100, scope=Scope("acme", "ann"))
    for other in (Scope("other"), Scope("acme", "bob"), Scope(None, "bob")):
        assert (
            read(reader, "e", 100, scope=other) is None
            and want(store, "e", 100, scope=other) is None
        )
    store.append_turn("u", "user", "t", np.arange(4, dtype=np.int32), now=T0)  # no owner
    assert read(reader, "u", 100, scope=Scope("acme")) is None
    store.delete("e", now=T0)
    assert read(reader, "e", 100) is None
    store.append_turn("e", "user", "t", np.arange(7, dtype=np.int32), now=T0)  # a new one
    assert agree(store, reader, "e", 100)
    store.append_turn("far", "user", "t", np.arange(3, dtype=np.int32), now=T0, ttl_s=1e300)
    assert agree(store, reader, "far", 100)  # an expiry past int64 ns: none, in the index
    store.reap(T0 + 100)
    store.clear()
    assert read(reader, "e", 100) is None and read(reader, "u", 100) is None


def test_deleted_slots_are_rebuilt_away() -> None:
    store, index, reader = make(slots=16)
    for round_ in range(8):  # 8 x 4 sessions made, 8 x 3 deleted: tombstones fill the table
        for k in range(4):
            store.append_turn(f"r{round_}-{k}", "user", "t", np.arange(3, dtype=np.int32),
                              now=T0)  # fmt: skip
        for k in range(3):
            store.delete(f"r{round_}-{k}", now=T0)
    assert index.rebuilds > 0
    held = [f"r{r}-3" for r in range(8)]
    assert len(index) == 8
    assert all(agree(store, reader, name, 100) for name in held)
    assert index.stats()["session_index_rebuilds"] == index.rebuilds
    assert store.stats()["session_index_sessions"] == 8


def test_restore_publishes_every_session(tmp_path) -> None:
    import sqlite3

    store, _, _ = make()
    for k in range(5):
        store.append_turn(f"s{k}", "user", "t", np.arange(k + 1, dtype=np.int32), now=T0)
    db = sqlite3.connect(str(tmp_path / "snap.db"))
    store.snapshot(db, str(tmp_path))
    restored, _, reader = make()
    restored.restore(db, str(tmp_path))
    assert all(agree(restored, reader, f"s{k}", 100) for k in range(5))


def test_slots_must_be_a_power_of_two() -> None:
    with pytest.raises(ConfigError, match="power of two"):
        SessionIndex(12)
    assert index_bytes(4) == 64 + 4 * 768


def test_a_window_holds_until_the_next_read() -> None:
    """A writer thread appends, trims, deletes and re-creates sessions (regions move, are
    freed and reused); a reader thread reads without any lock and holds each view while the
    writer goes on (a sleep), then checks it. Every token id of turn t of session s is
    s * 100_000 + t and turn t has 1 + t % 7 ids, so a view must still be whole consecutive
    turns of that session: no torn read, and no region reused under a view."""
    store, _, reader = make(slots=32, heap_kb=64, max_session_turns=40)
    lock = threading.Lock()
    stop = threading.Event()
    counts: dict[int, int] = {}  # session -> turns appended since it was made

    def writer() -> None:
        rng = np.random.default_rng(11)
        while not stop.is_set():
            s = int(rng.integers(6))
            with lock:
                op = rng.random()
                if op < 0.05 and s in counts:
                    store.delete(f"s{s}", now=T0)
                    del counts[s]
                elif op < 0.1 and s in counts:
                    store.trim(f"s{s}", int(rng.integers(0, 10)), now=T0)
                else:
                    t = counts.get(s, 0)
                    ids = np.full(1 + t % 7, s * 100_000 + t, np.int32)
                    store.append_turn(f"s{s}", "user", "t", ids, now=T0, rolling=True)
                    counts[s] = t + 1

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    th = threading.Thread(target=writer)
    th.start()
    answered = 0
    try:
        rng = np.random.default_rng(12)
        for i in range(20_000):
            s = int(rng.integers(6))
            got = read(reader, f"s{s}", int(rng.integers(0, 120)), copy=False)
            if got is None:
                continue
            view, turns = got
            before = view.copy()
            if i % 4 == 0:
                time.sleep(0)  # the writer runs meanwhile
            answered += 1
            assert _whole_turns(before, s) == turns, before
            assert np.array_equal(view, before), "the region changed under its view"
    finally:
        stop.set()
        th.join()
        sys.setswitchinterval(old)
    assert answered > 1000


def _whole_turns(ids: np.ndarray, s: int) -> int:
    """How many whole consecutive turns of session ``s`` the ids are (fails otherwise)."""
    turns, at, last = 0, 0, None
    while at < len(ids):
        t = int(ids[at]) - s * 100_000
        assert 0 <= t < 100_000, ids
        assert last is None or t == last + 1, ids
        n = 1 + t % 7
        assert np.all(ids[at : at + n] == ids[at]) and at + n <= len(ids), ids
        at, last, turns = at + n, t, turns + 1
    return turns
