"""Metadata, filters and string ids through the client: in-process, then a real sidecar (shm),
and across a restart of a sidecar with a data directory."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

import numpy as np
import pytest

import kalos
from conftest import DIM, TIMEOUT
from kalos import Scope
from kalos.errors import Conflict, InvalidRequest
from kalos.filters import matches, parse
from kalos.testing import RunningSidecar

ROWS = 60


def unit_rows(n: int, seed: int = 0) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def meta_of(i: int) -> dict[str, object]:
    m: dict[str, object] = {"n": i, "parity": "even" if i % 2 == 0 else "odd", "tags": []}
    if i % 3 == 0:
        m["tags"] = ["three", i % 5]
    if i % 7:
        m["score"] = i / 7
    m["flag"] = i % 4 == 0
    return m


def filled(client: kalos.Client) -> tuple[np.ndarray, list[str], list[dict[str, object]]]:
    base = unit_rows(ROWS)
    keys = [f"doc-{i}" for i in range(ROWS)]
    metas = [meta_of(i) for i in range(ROWS)]
    payloads = [f"text {i}" for i in range(ROWS)]
    assert client.add(base, keys, payloads, metadata=metas) == ROWS
    return base, keys, metas


def expected(base: np.ndarray, metas: list, where: dict, q: np.ndarray, k: int) -> list[int]:
    node = parse(where)
    rows = [i for i, m in enumerate(metas) if matches(node, m)]
    scores = base[rows].astype(np.float64) @ q.astype(np.float64)
    return [rows[j] for j in np.argsort(-scores, kind="stable")[:k]]


FILTERS = [
    {"parity": "even"},
    {"n": {"gte": 10, "lt": 30}},
    {"tags": {"contains": "three"}},
    {"$or": [{"parity": "odd"}, {"flag": True}]},
    {"$not": {"score": {"gt": 3}}},
    {"n": {"in": [1, 2, 3, 50]}, "parity": {"ne": "odd"}},
    {"parity": {"nin": ["odd"]}, "tags": {"contains": 0}},
    {"AND": [{"n": {"lte": 40}}, {"OR": [{"parity": {"contains": "dd"}}, {"n": 0}]}]},
]


@pytest.mark.parametrize("transport", ["inproc", "shm"], indirect=True)
def test_filtered_search_is_the_exact_top_k_of_the_matches(client: kalos.Client) -> None:
    base, keys, metas = filled(client)
    q = unit_rows(1, seed=9)[0]
    for where in FILTERS:
        want = expected(base, metas, where, q, 7)
        hits = client.search(q, 7, where=where, metadata=True, copy=True)
        got = [int(x) for x in hits.ids if x != -1]
        assert got == [kalos.key_id(keys[i]) for i in want], where
        assert hits.keys is not None and hits.metadata is not None and hits.payloads
        for slot, i in enumerate(want):
            assert hits.keys[slot] == keys[i]
            assert hits.metadata[slot] == metas[i]
            assert hits.payloads[slot] == f"text {i}"
        assert all(k is None for k in hits.keys[len(want) :])


@pytest.mark.parametrize("transport", ["inproc"], indirect=True)
def test_string_ids_round_trip_and_delete(client: kalos.Client) -> None:
    filled(client)
    found = client.lookup(["doc-3", "nope", "doc-4", "doc-3"])
    assert [(m.key, m.payload) for m in found] == [("doc-3", "text 3"), ("doc-4", "text 4")]
    assert found[0].metadata == meta_of(3) and found[0].id == kalos.key_id("doc-3")
    assert client.remove(["doc-3", "doc-5"]) == 2
    assert client.lookup(["doc-3"]) == []
    # where=: a delete by filter, within a scope (none given: every memory)
    assert client.remove(where={"parity": "odd", "n": {"lt": 10}}) == 3  # 1, 7, 9
    left = {m.key for m in client.lookup([f"doc-{i}" for i in range(ROWS)])}
    assert "doc-7" not in left and "doc-8" in left


@pytest.mark.parametrize("transport", ["inproc"], indirect=True)
def test_a_string_id_that_collides_is_a_conflict(
    client: kalos.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kalos.client as client_side
    import kalos.stores.metadata as store_side

    vec = unit_rows(2)
    monkeypatch.setattr(client_side, "key_id", lambda key: 42)
    with pytest.raises(InvalidRequest, match="does not map"):
        client.add(vec[:1], ["a"])  # the sidecar checks the mapping itself
    monkeypatch.setattr(store_side, "key_id", lambda key: 42)  # every string collides
    client.add(vec[:1], ["a"])
    client.add(vec[:1], ["a"])  # the same string again: an upsert
    with pytest.raises(Conflict, match="'a' and 'b' map to the same 63-bit id 42"):
        client.add(vec[1:], ["b"])
    with pytest.raises(Conflict, match="same 63-bit id"):
        client.add(vec, ["c", "d"])  # inside one batch
    assert [m.key for m in client.lookup([42])] == ["a"]


BAD = [
    ({"a": {"regex": "x"}}, "unknown filter operator 'regex'"),
    ({"a": {"gt": [1]}}, "takes a str, a number or a bool"),
    ({"a": {"in": 3}}, "non-empty list"),
    ({"$xor": []}, "unknown filter operator"),
    ({"a": {"gt": True}}, "not a bool"),
]


@pytest.mark.parametrize("transport", ["inproc"], indirect=True)
def test_bad_filters_are_invalid_requests_and_the_sidecar_keeps_serving(
    client: kalos.Client,
) -> None:
    filled(client)
    q = unit_rows(1)[0]
    for where, message in BAD:
        with pytest.raises(InvalidRequest, match=message):
            client.search(q, 3, where=where)
    deep: dict = {"a": 1}
    for _ in range(20):
        deep = {"$not": deep}
    with pytest.raises(InvalidRequest, match="too deep"):
        client.search(q, 3, where=deep)
    with pytest.raises(InvalidRequest, match="too large"):
        client.search(q, 3, where={"$or": [{"a": i} for i in range(600)]})
    with pytest.raises(InvalidRequest, match="too large"):
        client.search(q, 3, where={"a": {"in": ["x" * 100] * 200}})
    assert client.search(q, 3, where={"parity": "odd"}).ids[0] != -1


def test_metadata_survives_a_restart(sidecar: Callable[..., RunningSidecar], tmp_path) -> None:
    data = str(tmp_path / "data")
    args = ("--data-dir", data)
    running = sidecar(dim=DIM, extra_args=args)
    client = running.connect(timeout=TIMEOUT)
    base, keys, metas = filled(client)
    client.remove(["doc-0"])
    live = set(range(1, ROWS))
    client.close()
    # first kill -9 (recovery replays the log), then a clean stop (it writes a snapshot)
    running.stop(signal.SIGKILL)
    for turn in range(2):
        running = sidecar(dim=DIM, extra_args=args)
        client = running.connect(timeout=TIMEOUT)
        q = unit_rows(1, seed=3)[0]
        where = {"parity": "even", "n": {"gt": 0}}
        hits = client.search(q, 5, where=where, metadata=True, copy=True)
        rows = sorted(live)
        want = expected(base[rows], [metas[i] for i in rows], where, q, 5)
        assert hits.keys == [keys[rows[i]] for i in want]
        assert client.lookup("doc-0") == []
        assert client.lookup("doc-2")[0].metadata == metas[2]
        gone = {10 + turn, 20 + turn}
        assert client.forget(Scope(), where={"n": {"in": sorted(gone)}}).memories == 2
        live -= gone
        client.close()
        running.stop(signal.SIGKILL if turn else signal.SIGTERM)


@pytest.mark.parametrize("transport", ["inproc"], indirect=True)
def test_recall_takes_a_filter(client: kalos.Client) -> None:
    base = unit_rows(6)
    client.add(base, [f"m{i}" for i in range(6)], [f"memory {i}" for i in range(6)],
               tokens=[[i + 1] for i in range(6)],
               metadata=[{"kind": "fact" if i % 2 else "chat"} for i in range(6)])  # fmt: skip
    client.append_turn("s1", "user", "hi", tokens=[100, 101])
    r = client.recall("s1", base[0], k=6, max_tokens=100, where={"kind": "fact"})
    hits = [int(x) for x in r.ids if x != -1]
    assert sorted(hits) == sorted(kalos.key_id(f"m{i}") for i in (1, 3, 5))
    with pytest.raises(InvalidRequest, match="unknown filter operator"):
        client.recall("s1", base[0], k=2, max_tokens=100, where={"kind": {"like": "f"}})


def test_the_async_client_filters_too() -> None:
    from conftest import make_inproc_connector

    async def main() -> None:
        connector = make_inproc_connector()
        async with kalos.AsyncClient("inproc", connector=connector) as client:
            base = unit_rows(4)
            await client.add(base, ["a", "b", "c", "d"], metadata=[{"n": i} for i in range(4)])
            hits = await client.search(base[0], 4, where={"n": {"gte": 2}}, metadata=True)
            assert hits.keys is not None
            assert sorted(k for k in hits.keys if k) == ["c", "d"]
            assert [m.key for m in await client.lookup(["d", "a"])] == ["d", "a"]
            assert await client.remove(where={"n": 3}) == 1

    asyncio.run(main())


@pytest.mark.parametrize("transport", ["inproc"], indirect=True)
def test_lookup_keeps_to_its_scope(client: kalos.Client) -> None:
    vec = unit_rows(2)
    client.add(vec[:1], ["a"], scope=Scope("t1"))
    client.add(vec[1:], ["b"], scope=Scope("t2", "u"))
    assert [m.key for m in client.lookup(["a", "b"], scope=Scope("t1"))] == ["a"]
    assert [m.key for m in client.lookup(["a", "b"], scope=Scope("t2", "u"))] == ["b"]
    assert client.lookup(["a", "b"], scope=Scope("t3")) == []
    assert len(client.lookup(["a", "b"])) == 2


def test_metadata_counts_against_the_tenant_byte_limit() -> None:
    import threading

    from kalos.server.dispatch import Dispatcher
    from kalos.stores.limits import Limits
    from kalos.stores.memories import MemoryStore
    from kalos.transport.inproc import InprocTransport

    store = MemoryStore(kalos.index.create("cpu:flat", dim=DIM), Limits(tenant_max_bytes=400))
    dispatcher, lock = Dispatcher(store), threading.Lock()
    client = kalos.Client("inproc", connector=lambda: InprocTransport(dispatcher, lock, 1 << 20))
    acme = Scope("acme")
    vec = unit_rows(3)
    client.add(vec[:2], ["a", "b"], scope=acme)  # 2 x 32 bytes of vector + 1 of id
    with pytest.raises(InvalidRequest, match="--tenant-max-bytes"):
        client.add(vec[2:], ["c"], scope=acme, metadata=[{"blob": "x" * 400}])
    client.add(vec[2:], ["c"], scope=acme, metadata=[{"blob": "x" * 100}])
    with pytest.raises(InvalidRequest, match="--tenant-max-bytes"):  # an upsert grows it
        client.add(vec[2:], ["c"], scope=acme, metadata=[{"blob": "x" * 300}])
    client.remove(["c"])
    client.add(vec[2:], ["c"], scope=acme, metadata=[{"blob": "x" * 250}])
    client.close()


@pytest.mark.parametrize("transport", ["inproc"], indirect=True)
def test_lookup_on_an_empty_store(client: kalos.Client) -> None:
    assert client.lookup(["a", 7], scope=Scope("t")) == []
    assert client.lookup([]) == []
