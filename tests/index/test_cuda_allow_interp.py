"""CudaFlatIndex.search(allow=...) on the CPU, under TRITON_INTERPRET=1: the exact top-k of
the allowed rows (a metadata filter's matches), with and without a scope filter, after
removals, against the float64 reference of tests/cuda_reference.py, on both of its paths (a
gather of the few allowed rows; the scan kernel with a row mask); random filters over random
metadata through it; and a memory store over it, whose filters are evaluated on the index's
device (kalos.stores.device_columns), with and without a scope, with random writes between
the searches."""

from __future__ import annotations

# isort: off
from triton_interp import torch, triton  # noqa: F401  (first: sets TRITON_INTERPRET)

# isort: on

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cuda_reference import check_result, make_index
from kalos import filters
from kalos.protocol.messages import Scope
from kalos.stores.memories import MemoryStore
from kalos.stores.metadata import MetadataTable
from test_filters import FILTERS, METAS, reference


@pytest.mark.parametrize(
    "metric,dtype,nq,k,share",
    [("ip", "fp16", 1, 10, 0.05), ("cosine", "bf16", 2, 7, 0.5), ("l2", "fp32", 3, 5, 1.0)],
)
def test_allowed_rows_only(metric: str, dtype: str, nq: int, k: int, share: float) -> None:
    rng = np.random.default_rng(7)
    n, dim = 300, 32
    idx = make_index(metric, dtype, dim, "cpu")
    x = rng.standard_normal((n, dim)).astype(np.float32)
    ids = rng.permutation(10 * n)[:n].astype(np.int64) + 1
    scopes = np.stack([rng.integers(1, 3, n), np.zeros(n, np.int64), rng.integers(4, 6, n)], 1)
    idx.add(x, ids, scopes)
    gone = ids[:20]
    idx.remove(gone)
    live = np.ones(n, bool)
    live[:20] = False
    allowed = rng.random(n) < share
    allow = np.concatenate([ids[allowed], [999_999]])  # an unknown id is ignored
    q = rng.standard_normal((nq, dim)).astype(np.float32)
    masked = []  # which path each search took: the kernel with a row mask, or the gather
    scan = idx._search_masked
    idx._search_masked = lambda *a: masked.append(1) or scan(*a)  # type: ignore[method-assign]
    for scope in (None, (1, 0, 0), (1, 0, 5)):
        s, got = idx.search(q, k, scope=scope, allow=allow)
        keep = live & allowed & (scopes[:, 2] == 5 if scope == (1, 0, 5) else True)
        check_result(idx, x[keep], ids[keep], scopes[keep], q, k, s, got, scope=scope)
    assert len(masked) == (3 if share >= 1 / 16 else 0)
    # rows move (a removal fills holes from the end; an add appends): the sorted ids follow
    idx.remove(ids[20:40])
    live[20:40] = False
    for keep1 in (live & allowed, live & ~allowed):
        s, got = idx.search(q, k, allow=ids[keep1])
        check_result(idx, x[keep1], ids[keep1], scopes[keep1], q, k, s, got)
    fresh = rng.standard_normal((10, dim)).astype(np.float32)
    fresh_ids = np.arange(10, dtype=np.int64) + 10**6
    idx.add(fresh, fresh_ids, scopes[:10])
    x2, ids2 = np.concatenate([x, fresh]), np.concatenate([ids, fresh_ids])
    scopes2 = np.concatenate([scopes, scopes[:10]])
    for keep2 in (  # the same ids again, and the others (rows that moved among them)
        np.concatenate([live & allowed, np.ones(10, bool)]),
        np.concatenate([live & ~allowed, np.ones(10, bool)]),
    ):
        s, got = idx.search(q, k, allow=ids2[keep2])
        check_result(idx, x2[keep2], ids2[keep2], scopes2[keep2], q, k, s, got)
    s, got = idx.search(q, k, allow=np.empty(0, np.int64))
    assert (got == -1).all()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(metas=st.lists(METAS, min_size=1, max_size=40), where=FILTERS)
def test_random_filters_through_the_cuda_index(metas: list, where: dict) -> None:
    rng = np.random.default_rng(len(metas))
    n, dim = len(metas), 16
    idx = make_index("ip", "fp32", dim, "cpu")
    x = rng.standard_normal((n, dim)).astype(np.float32)
    ids = np.arange(n, dtype=np.int64) + 1
    idx.add(x, ids)
    table = MetadataTable()
    table.upsert(ids.tolist(), metas, None)
    node = filters.parse(where)
    allow = table.matching(node)
    keep = np.array([filters.matches(node, m) for m in metas])
    q = rng.standard_normal((1, dim)).astype(np.float32)
    s, got = idx.search(q, 5, allow=allow)
    check_result(idx, x[keep], ids[keep], None, q, 5, s, got)


STORE_STEPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.lists(st.tuples(st.integers(1, 40), METAS), min_size=1, max_size=8),
            st.sampled_from(["acme", "globex"]),
        ),
        st.tuples(st.just("remove"), st.lists(st.integers(1, 40), max_size=6), st.none()),
        st.tuples(st.just("search"), FILTERS, st.sampled_from([None, "acme"])),
    ),
    min_size=2,
    max_size=10,
)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=STORE_STEPS)
def test_store_filters_on_the_device_with_writes_between(steps: list) -> None:
    rng = np.random.default_rng(len(steps))
    dim, k = 16, 5
    idx = make_index("ip", "fp32", dim, "cpu")
    store = MemoryStore(idx)
    allowed = []  # what the index was given: ids on its device, never a host array
    search_allowed = idx._search_allowed

    def spy(q, k, filt, allow):  # type: ignore[no-untyped-def]
        allowed.append(allow)
        return search_allowed(q, k, filt, allow)

    idx._search_allowed = spy  # type: ignore[method-assign]
    vectors: dict[int, np.ndarray] = {}
    metas: dict[int, dict | None] = {}
    tenants: dict[int, str] = {}
    for step, arg, tenant in steps:
        if step == "add":
            ids = np.array([i for i, _ in arg], np.int64)
            x = rng.standard_normal((len(ids), dim)).astype(np.float32)
            none = np.zeros(len(ids), np.uint8)
            offsets = np.zeros(len(ids) + 1, np.uint64)
            blob = np.empty(0, np.uint8)
            store.add(ids, x, none, offsets, blob, Scope(tenant), meta=[m for _, m in arg])
            for (i, m), v in zip(arg, x, strict=True):
                vectors[i], metas[i], tenants[i] = v, m, tenant
        elif step == "remove":
            store.remove(np.array(arg, np.int64))
            for i in arg:
                vectors.pop(i, None)
                metas.pop(i, None)
        else:
            q = rng.standard_normal((1, dim)).astype(np.float32)
            scope = None if tenant is None else Scope(tenant)
            s, got = store.search(q, k, scope, where=filters.parse(arg))
            keep = [
                i
                for i in sorted(metas)
                if reference(arg, metas[i]) and tenant in (None, tenants[i])
            ]
            if not keep:
                assert (got == -1).all()
                continue
            x = np.stack([vectors[i] for i in keep])
            check_result(idx, x, np.array(keep, np.int64), None, q, k, s, got)
    assert all(isinstance(a, torch.Tensor) for a in allowed)


@pytest.mark.parametrize("step, path", [(50, "gather"), (2, "masked")])
def test_allowed_ids_as_a_device_tensor(step: int, path: str) -> None:
    rng = np.random.default_rng(9)
    n, dim, k = 400, 16, 8
    idx = make_index("ip", "fp32", dim, "cpu")
    x = rng.standard_normal((n, dim)).astype(np.float32)
    ids = np.arange(n, dtype=np.int64) * 3 + 1
    idx.add(x, ids)
    keep = np.zeros(n, bool)
    keep[::step] = True  # 8 rows (16 ids: under 1/16 of the rows still), or half of them
    allow = torch.from_numpy(np.concatenate([ids[keep], ids[keep], [10**6]]))  # twice, unknown
    q = rng.standard_normal((2, dim)).astype(np.float32)
    masked = []
    scan = idx._search_masked
    idx._search_masked = lambda *a: masked.append(1) or scan(*a)  # type: ignore[method-assign]
    s, got = idx.search(q, k, allow=allow)
    check_result(idx, x[keep], ids[keep], None, q, k, s, got)
    assert len(masked) == (path == "masked")
    s, got = idx.search(q, k, allow=allow[:0])
    assert (got == -1).all()
