"""StateStore: versioned values with compare-and-set, event logs, forget, snapshots."""

from __future__ import annotations

import sqlite3

import pytest

from kalos.errors import Conflict, InvalidRequest, NotFound
from kalos.protocol.messages import Event, Scope, StateValue
from kalos.stores.limits import Limits
from kalos.stores.state import StateStore

T0 = 1_800_000_000.0
ACME = Scope("acme", "u1", "s1")


@pytest.fixture
def store() -> StateStore:
    return StateStore()


def test_put_get_delete(store: StateStore) -> None:
    v1 = store.put(ACME, "plan", b"step 1")
    assert v1 > 0
    assert store.get(ACME, "plan") == StateValue(v1, b"step 1")
    v2 = store.put(ACME, "plan", b"step 2")
    assert v2 > v1
    assert store.get(ACME, "plan") == StateValue(v2, b"step 2")
    assert store.delete(ACME, "plan") is True
    assert store.delete(ACME, "plan") is False
    with pytest.raises(NotFound, match="'plan'"):
        store.get(ACME, "plan")


def test_scopes_are_exact_namespaces(store: StateStore) -> None:
    store.put(ACME, "k", b"session")
    store.put(Scope("acme", "u1"), "k", b"user")
    store.put(None, "k", b"global")
    assert store.get(ACME, "k").value == b"session"
    assert store.get(Scope("acme", "u1"), "k").value == b"user"
    assert store.get(None, "k").value == b"global"
    assert store.get(Scope(), "k").value == b"global"
    with pytest.raises(NotFound):
        store.get(Scope("acme"), "k")
    with pytest.raises(NotFound):
        store.get(Scope("other", "u1", "s1"), "k")


def test_cas(store: StateStore) -> None:
    v1 = store.cas(ACME, "k", 0, b"first")  # 0: must not exist
    with pytest.raises(Conflict, match=f"version {v1}, not 0"):
        store.cas(ACME, "k", 0, b"again")
    with pytest.raises(Conflict, match=f"version {v1}, not {v1 + 5}"):
        store.cas(ACME, "k", v1 + 5, b"stale")
    v2 = store.cas(ACME, "k", v1, b"second")
    assert store.get(ACME, "k") == StateValue(v2, b"second")
    store.delete(ACME, "k")
    with pytest.raises(Conflict, match="does not exist"):
        store.cas(ACME, "k", v2, b"gone")
    v3 = store.cas(ACME, "k", 0, b"reborn")
    assert v3 > v2  # a re-created key never reuses a version: old CAS holders fail
    with pytest.raises(Conflict):
        store.cas(ACME, "k", v1, b"aba")
    assert store.get(ACME, "k").value == b"reborn"
    with pytest.raises(InvalidRequest):
        store.cas(ACME, "k", -1, b"x")


def test_limits() -> None:
    store = StateStore(Limits(max_state_bytes=8, max_key_bytes=4, max_kind_bytes=3))
    store.put(None, "abcd", b"12345678")
    with pytest.raises(InvalidRequest, match=r"9 bytes; the limit is 8.*--max-state-bytes"):
        store.put(None, "k", b"123456789")
    with pytest.raises(InvalidRequest, match="key"):
        store.put(None, "abcde", b"x")
    with pytest.raises(InvalidRequest, match="key"):
        store.put(None, "", b"x")
    with pytest.raises(InvalidRequest, match="bytes"):
        store.put(None, "k", "text")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="--max-state-bytes"):
        store.cas(None, "k", 0, b"123456789")
    with pytest.raises(InvalidRequest, match="event data"):
        store.log("s", "ok", b"123456789", now=T0)
    with pytest.raises(InvalidRequest, match="kind"):
        store.log("s", "long", b"x", now=T0)
    assert store.events("s") == []
    assert store.keys_in() == [(("", "", ""), "abcd")]


def test_event_log(store: StateStore) -> None:
    assert store.log("s1", "tool_call", "search(x)", now=T0) == 1
    assert store.log("s1", "result", b"\x00\xff", now=T0 + 1) == 2
    assert store.log("s2", "step", "other", now=T0 + 2) == 1
    assert store.events("s1") == [
        Event(1, T0, "tool_call", "search(x)"),
        Event(2, T0 + 1, "result", b"\x00\xff"),
    ]
    assert store.events("s1", since=1) == [Event(2, T0 + 1, "result", b"\x00\xff")]
    assert store.events("s1", since=2) == []
    assert store.events("s1", since=0, limit=1) == [Event(1, T0, "tool_call", "search(x)")]
    assert store.events("none") == []


def test_event_log_owner(store: StateStore) -> None:
    store.log("s1", "a", "x", owner=Scope("acme", "u1"), now=T0)
    store.log("s1", "b", "x", now=T0)  # no owner named: fine
    with pytest.raises(Conflict):
        store.log("s1", "c", "x", owner=Scope("other"), now=T0)
    assert len(store.events("s1", scope=Scope("acme"))) == 2
    assert store.events("s1", scope=Scope("other")) == []  # outside the filter: no events


def test_forget(store: StateStore) -> None:
    store.put(Scope("acme", "u1", "s1"), "a", b"1")
    store.put(Scope("acme", "u1"), "b", b"2")
    store.put(Scope("acme", "u2", "s2"), "c", b"3")
    store.put(Scope("other", "u1", "s1"), "d", b"4")
    store.log("s1", "k", "x", owner=Scope("acme", "u1"), now=T0)
    store.log("s2", "k", "x", owner=Scope("acme", "u2"), now=T0)
    store.log("s3", "k", "x", now=T0)
    assert store.forget(Scope(session="s1")) == (2, 1)  # acme's and other's s1 values
    assert store.forget(Scope("acme", "u1")) == (1, 0)
    assert store.forget(Scope("acme")) == (1, 1)
    assert store.keys_in() == []
    assert store.events("s3") != []
    assert store.forget(Scope(session="s3")) == (0, 1)


def test_snapshot_restore_round_trip(store: StateStore, tmp_path) -> None:  # type: ignore[no-untyped-def]
    store.put(Scope("acme", "u1", "s1"), "a", b"1" * 100)
    store.put(None, "b", b"")
    store.put(Scope("ünï", None, "s"), "ключ", b"\x00")
    store.delete(None, "b")
    store.log("s1", "tool", "call ✓", owner=Scope("acme", "u1"), now=T0)
    store.log("s1", "bytes", b"\x00\x01", now=T0 + 0.25)
    store.log("s2", "x", "", now=T0 + 1)
    db = sqlite3.connect(str(tmp_path / "snap.db"))
    store.snapshot(db, str(tmp_path))
    store.snapshot(db, str(tmp_path))  # a second snapshot replaces the first
    db.commit()

    again = StateStore()
    again.put(None, "stale", b"x")
    again.restore(sqlite3.connect(str(tmp_path / "snap.db")), str(tmp_path))
    assert again.keys_in() == store.keys_in()
    for ns, key in store.keys_in():
        scope = Scope(*(f or None for f in ns))
        assert again.get(scope, key) == store.get(scope, key)
    for session in ("s1", "s2"):
        assert again.events(session) == store.events(session)
    assert again.stats() == store.stats()
    # versions keep growing after a restore, and owners still hold
    assert again.put(None, "new", b"x") == store.put(None, "new", b"x")
    with pytest.raises(Conflict):
        again.log("s1", "x", "y", owner=Scope("other"), now=T0)
    assert again.log("s1", "x", "y", now=T0) == 3
