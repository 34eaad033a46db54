"""MemoryStore: scope interning, payload bookkeeping, validation, over a cpu:flat index."""

from __future__ import annotations

import numpy as np
import pytest

import kalos.index
from kalos.errors import InvalidRequest
from kalos.protocol import codes
from kalos.protocol.messages import Scope
from kalos.stores.memories import NO_MATCH, MemoryStore, ScopeCodes

DIM = 3


def store() -> MemoryStore:
    return MemoryStore(kalos.index.create("cpu:flat", dim=DIM))


def add(
    s: MemoryStore, ids: list[int], payloads: list[bytes | None], scope: Scope | None = None
) -> tuple[int, int]:
    kinds = np.array([0 if p is None else codes.PAYLOAD_BYTES for p in payloads], np.uint8)
    blobs = [p or b"" for p in payloads]
    offsets = np.zeros(len(ids) + 1, np.uint64)
    offsets[1:] = np.cumsum([len(b) for b in blobs])
    blob = np.frombuffer(b"".join(blobs) or b"", np.uint8)
    vectors = np.ones((len(ids), DIM), np.float32)
    return s.add(np.array(ids, np.int64), vectors, kinds, offsets, blob, scope or Scope())


def test_scope_codes() -> None:
    sc = ScopeCodes()
    assert sc.intern(Scope("a", "u")).tolist() == [1, 1, 0]
    assert sc.intern(Scope("b", None, "s")).tolist() == [2, 0, 1]
    assert sc.intern(Scope("a", "v")).tolist() == [1, 2, 0]  # one table per field
    assert sc.filter(None) is None
    assert sc.filter(Scope()) is None
    assert sc.filter(Scope("b")) == (2, 0, 0)
    assert sc.filter(Scope("zzz", "u")) == (NO_MATCH, 1, 0)
    assert sc.filter(Scope(None, None, "s")) == (0, 0, 1)


def test_add_counts_and_payloads() -> None:
    s = store()
    assert add(s, [1, 2, 3], [b"aa", None, b"c"]) == (3, 0)
    assert add(s, [3, 4], [None, b"dddd"]) == (1, 1)
    assert len(s) == 4
    assert s.payloads(np.array([[1, 2], [3, 4], [-1, 99]])) == [
        (2, b"aa"), (0, b""), (0, b""), (2, b"dddd"), (0, b""), (0, b""),
    ]  # fmt: skip
    assert s.stats()["payload_bytes"] == 6
    assert s.remove(np.array([1, 1, 50], np.int64)) == 1
    assert s.stats()["payload_bytes"] == 4
    assert s.stats()["items"] == 3


def test_validation() -> None:
    s = store()
    with pytest.raises(InvalidRequest, match="-1"):
        add(s, [4, -1], [None, None])
    assert len(s) == 0
    with pytest.raises(InvalidRequest, match="dimension"):
        s.search(np.ones((1, DIM + 1), np.float32), 1, None)
    with pytest.raises(InvalidRequest, match="NaN"):
        s.search(np.full((1, DIM), np.nan, np.float32), 1, None)
    for k in (0, 1025):
        with pytest.raises(InvalidRequest, match="k must be"):
            s.search(np.ones((1, DIM), np.float32), k, None)


def test_search_with_an_unknown_scope_matches_nothing() -> None:
    s = store()
    add(s, [1], [None], Scope("a"))
    _, ids = s.search(np.ones((1, DIM), np.float32), 2, Scope("b"))
    assert ids.tolist() == [[-1, -1]]
    _, ids = s.search(np.ones((1, DIM), np.float32), 2, Scope("a"))
    assert ids.tolist() == [[1, -1]]
