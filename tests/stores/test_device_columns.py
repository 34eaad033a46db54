"""The device mirror of the metadata columns (kalos.stores.device_columns), with torch tensors
on the CPU: random filters (random nesting, every operator, missing keys, type mismatches)
evaluated from the mirror agree with the reference of tests/test_filters.py and with the host
table, with random adds, metadata replaced, plain adds, removals, slot reuse, grown capacity
and resets between the searches (on a CUDA device too, where there is one); after each sync
the mirror holds exactly the host's columns; and a write uploads only the slots it changed."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kalos.index.rows
import kalos.stores.metadata
from kalos import filters
from kalos.stores.metadata import MetadataTable
from test_filters import FILTERS, METAS, reference

torch = pytest.importorskip("torch")

from kalos.stores.device_columns import DeviceColumns  # noqa: E402

IDS = st.integers(0, 30)  # a small pool: ids come back, slots are reused
STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.lists(st.tuples(IDS, METAS), min_size=1, max_size=6)),
        st.tuples(st.just("plain"), st.lists(IDS, max_size=5)),
        st.tuples(st.just("remove"), st.lists(IDS, max_size=6)),
        st.tuples(st.just("bulk"), st.integers(1, 40)),  # fresh ids in one plain add
        st.tuples(st.just("search"), FILTERS),
        st.tuples(st.just("search"), FILTERS),
        st.tuples(st.just("reset"), st.none()),
    ),
    min_size=1,
    max_size=24,
)


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]


def assert_mirrors(table: MetadataTable, mirror: DeviceColumns) -> None:
    """After a sync the mirror holds the host's arrays, every slot of the capacity."""
    assert mirror.slot_ids.tolist() == table.slot_ids.tolist()
    for key, column in table.columns.items():
        for dev, host in zip(mirror.arrays(key), column.arrays, strict=True):
            np.testing.assert_array_equal(dev.cpu().numpy(), host)


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@pytest.mark.parametrize("device", DEVICES)
@given(steps=STEPS, singles=st.sampled_from([1, 3, 4096]))
def test_random_filters_from_the_mirror_agree_with_the_reference(
    device: str, steps: list[Any], singles: int
) -> None:
    with pytest.MonkeyPatch.context() as mp:
        # tiny capacities and change sets, so that growth and folding happen at this size
        mp.setattr(kalos.index.rows, "MIN_CAPACITY", 4)
        mp.setattr(kalos.stores.metadata, "_SINGLE_SLOTS", singles)
        table = MetadataTable()
        mirror = None  # made at the first search, as the store does: writes before it too
        live: dict[int, Any] = {}
        fresh = 1000
        for step, arg in steps:
            if step == "add":
                table.upsert([i for i, _ in arg], [m for _, m in arg], None)
                live.update(arg)
            elif step == "plain":
                table.upsert(arg, None, None)
                live.update(dict.fromkeys(arg))
            elif step == "remove":
                table.remove(arg)
                for i in arg:
                    live.pop(i, None)
            elif step == "bulk":
                ids = list(range(fresh, fresh + arg))
                fresh += arg
                table.upsert(ids, None, None)
                live.update(dict.fromkeys(ids))
            elif step == "reset":
                table.reset()
                live.clear()
            else:
                node = filters.parse(arg)
                if mirror is None:
                    mirror = DeviceColumns(table, device)
                got = mirror.matching(node)
                assert got.dtype == torch.int64 and got.device.type == device
                assert got.tolist() == table.matching(node).tolist()  # slot order too
                assert sorted(got.tolist()) == sorted(
                    i for i, m in live.items() if reference(arg, m)
                )
                assert_mirrors(table, mirror)
        if mirror is not None:
            mirror.sync()
            assert_mirrors(table, mirror)


def items(n: int, keys: int = 2) -> list[dict[str, Any]]:
    return [{f"k{j}": (i + j) % 5 for j in range(keys)} for i in range(n)]


def test_a_write_uploads_the_slots_it_changed() -> None:
    table = MetadataTable()
    n = 1000
    table.upsert(list(range(n)), items(n), None)
    mirror = DeviceColumns(table, "cpu")
    node = filters.parse({"k0": 3})
    mirror.matching(node)
    assert mirror.uploaded_bytes == n * (8 + 2 * 17)  # the first sync: every used slot
    assert table.tracking  # from the mirror on, writes note what they change

    def cost(write: Any) -> int:
        before = mirror.uploaded_bytes
        write()
        got = sorted(mirror.matching(node).tolist())
        assert got == sorted(table.matching(node).tolist())
        return mirror.uploaded_bytes - before

    assert cost(lambda: None) == 0
    # metadata replaced (k0 and k1 change, the slot keeps its item): 17 bytes a key
    assert cost(lambda: table.upsert([7], [{"k0": 3, "k1": 0}], None)) == 2 * 17
    assert cost(lambda: table.upsert([8], [{"k0": 3}], None)) == 2 * 17  # k1 cleared
    # a new item in a new slot: its id (8 bytes) and its one key
    assert cost(lambda: table.upsert([n], [{"k0": 3}], None)) == 8 + 17
    assert cost(lambda: table.remove([9])) == 8 + 2 * 17
    assert cost(lambda: table.upsert([n + 1], [{"k0": 3}], None)) == 8 + 17  # slot 9 reused
    # a new key: its columns start at the defaults on the device, then its one slot
    assert cost(lambda: table.upsert([10], [{"k0": 1, "k1": 1, "new": "x"}], None)) == 3 * 17
    # two scattered slots: the first as a range, the other with its slot index (8 bytes)
    assert cost(lambda: table.upsert([20, 500], items(2), None)) == 2 * (17 + 8 + 17)
    # appends: one range of ids and of the key's columns, no slot indices
    assert cost(lambda: table.upsert(list(range(2000, 2100)), None, None)) == 100 * 8
    fresh = list(range(3000, 3100))
    assert cost(lambda: table.upsert(fresh, [{"k0": 3}] * 100, None)) == 100 * (8 + 17)


def test_grown_capacity_and_reset() -> None:
    table = MetadataTable()
    mirror = DeviceColumns(table, "cpu")
    node = filters.parse({"$or": [{"a": {"gte": 0}}, {"s": {"gt": "m"}}]})
    assert mirror.matching(node).numel() == 0  # empty table, nothing allocated yet
    table.upsert([1, 2], [{"a": 1}, {"s": "z"}], None)
    assert mirror.matching(node).tolist() == [1, 2]
    cap = table.capacity
    ids = list(range(10, 10 + cap))  # past the capacity: the table and the mirror grow
    table.upsert(ids, [{"a": -1} if i % 2 else {"s": "n"} for i in ids], None)
    assert table.capacity > cap
    assert mirror.matching(node).tolist() == [1, 2, *[i for i in ids if i % 2 == 0]]
    assert_mirrors(table, mirror)
    table.reset()
    assert mirror.matching(node).numel() == 0
    table.upsert([5], [{"s": "q"}], None)
    assert mirror.matching(node).tolist() == [5]
    assert_mirrors(table, mirror)


def test_many_values_and_list_elements() -> None:
    # in/nin and string ranges over more values than the scalar chain: one isin on the device
    table = MetadataTable()
    n = 200
    metas = [{"s": f"v{i % 40:02d}", "x": i % 30, "tags": [f"t{i % 7}", i % 3]} for i in range(n)]
    table.upsert(list(range(n)), metas, None)
    mirror = DeviceColumns(table, "cpu")
    for where in (
        {"s": {"in": [f"v{j:02d}" for j in range(0, 40, 3)]}},
        {"x": {"nin": list(range(0, 30, 2))}},
        {"s": {"gte": "v10", "lt": "v35"}},
        {"tags": {"contains": "t3"}},
        {"$not": {"tags": {"contains": 2}}},
        {"s": {"contains": "1"}},
    ):
        node = filters.parse(where)
        want = [i for i in range(n) if reference(where, metas[i])]
        assert mirror.matching(node).tolist() == want
