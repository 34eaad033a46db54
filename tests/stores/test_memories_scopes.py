"""MemoryStore: finding and forgetting items by scope, also after a snapshot and restore."""

from __future__ import annotations

import sqlite3

import numpy as np
import pytest

import kalos.index
from kalos.protocol import codes
from kalos.protocol.messages import Scope
from kalos.stores.memories import MemoryStore

DIM = 4


def make_store() -> MemoryStore:
    return MemoryStore(kalos.index.create("cpu:flat", dim=DIM, metric="ip"))


def add(store: MemoryStore, ids: list[int], scope: Scope, text: str = "") -> None:
    n = len(ids)
    vectors = np.random.default_rng(ids[0]).standard_normal((n, DIM)).astype(np.float32)
    blobs = [f"{text}{i}".encode() for i in ids]
    offsets = np.zeros(n + 1, np.uint64)
    offsets[1:] = np.cumsum([len(b) for b in blobs])
    kinds = np.full(n, codes.PAYLOAD_TEXT, np.uint8)
    blob = np.frombuffer(b"".join(blobs), np.uint8)
    store.add(np.array(ids, np.int64), vectors, kinds, offsets, blob, scope)


def all_ids(store: MemoryStore, scope: Scope | None = None) -> list[int]:
    q = np.ones((1, DIM), np.float32)
    _, ids = store.search(q, 1000, scope)
    return sorted(i for i in ids[0].tolist() if i != -1)


@pytest.fixture
def store() -> MemoryStore:
    s = make_store()
    add(s, [1, 2, 3], Scope("acme", "u1", "s1"))
    add(s, [4, 5], Scope("acme", "u1", "s2"))
    add(s, [6], Scope("acme", "u2"))
    add(s, [7, 8], Scope("other", "u1", "s1"))
    add(s, [9], Scope())
    return s


@pytest.mark.parametrize(
    "scope, expected",
    [
        (Scope("acme"), [1, 2, 3, 4, 5, 6]),
        (Scope("acme", "u1"), [1, 2, 3, 4, 5]),
        (Scope("acme", "u1", "s2"), [4, 5]),
        (Scope(session="s1"), [1, 2, 3, 7, 8]),
        (Scope(user="u1"), [1, 2, 3, 4, 5, 7, 8]),
        (Scope("nobody"), []),
        (Scope("acme", "u3"), []),
        (Scope(), [1, 2, 3, 4, 5, 6, 7, 8, 9]),
    ],
)
def test_ids_in_scope(store: MemoryStore, scope: Scope, expected: list[int]) -> None:
    assert sorted(store.ids_in_scope(scope).tolist()) == expected


def test_forget_removes_from_the_index_and_payloads(store: MemoryStore) -> None:
    assert store.forget(Scope("acme", "u1")) == 5
    assert all_ids(store) == [6, 7, 8, 9]
    assert store.payloads(np.array([1, 6]))[0] == (codes.PAYLOAD_NONE, b"")
    assert store.payloads(np.array([1, 6]))[1] == (codes.PAYLOAD_TEXT, b"6")
    assert store.forget(Scope("acme", "u1")) == 0
    assert store.forget(Scope(session="s1")) == 2
    assert all_ids(store) == [6, 9]


def test_an_upsert_moves_an_item_to_its_new_scope(store: MemoryStore) -> None:
    add(store, [1, 1, 6], Scope("other", "u9"))  # duplicates in a batch too
    assert sorted(store.ids_in_scope(Scope("acme")).tolist()) == [2, 3, 4, 5]
    assert sorted(store.ids_in_scope(Scope("other", "u9")).tolist()) == [1, 6]
    store.remove(np.array([1, 42], np.int64))
    assert sorted(store.ids_in_scope(Scope("other")).tolist()) == [6, 7, 8]


def test_scopes_survive_snapshot_and_restore(store: MemoryStore, tmp_path) -> None:  # type: ignore[no-untyped-def]
    db = sqlite3.connect(str(tmp_path / "snap.db"))
    store.snapshot(db, str(tmp_path))
    db.commit()
    again = make_store()
    add(again, [100], Scope("stale"))
    again.restore(db, str(tmp_path))
    assert all_ids(again) == all_ids(store)
    for scope in (Scope("acme"), Scope(session="s1"), Scope("stale")):
        assert sorted(again.ids_in_scope(scope).tolist()) == sorted(
            store.ids_in_scope(scope).tolist()
        )
        assert all_ids(again, scope) == all_ids(store, scope)
    assert again.forget(Scope("acme", "u1")) == 5
    assert all_ids(again) == [6, 7, 8, 9]
