"""Conformance of every registered CPU index backend to the Index contract.

Each test runs once per spec string of the registry (``cpu:*``) and, where the metric matters,
once per metric. Results are held against a float64 numpy reference computed here, on fresh
random data from a fixed seed; ties are allowed to resolve either way. A backend that needs an
optional package (faiss) is skipped when that package is missing.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kalos.errors import ConfigError, InvalidRequest, NotFound
from kalos.index import Index, create
from kalos.index.base import RowTable
from kalos.index.factory import BACKENDS, Backend, known_specs, parse_spec
from kalos.testing import check_index, check_search

SEED = 20261129
DIM = 16
METRICS = ("ip", "cosine", "l2")
# Approximate backends are held to the exact contract with every list probed (nprobe = nlist)
# and few lists, so that the index trains (39 rows a list) on the suite's data.
EXACT_SETTINGS = {"cpu:ivf": "cpu:ivf,nlist=4,nprobe=4"}
CPU_KEYS = known_specs("cpu")
CPU_SPECS = [EXACT_SETTINGS.get(key, key) for key in CPU_KEYS]


def _spec_param(spec: str) -> object:
    needs = BACKENDS[parse_spec(spec).key].requires
    missing = needs is not None and importlib.util.find_spec(needs) is None
    return pytest.param(
        spec, marks=pytest.mark.skipif(missing, reason=f"{spec} needs {needs}"), id=spec
    )


SPEC_PARAMS = [_spec_param(s) for s in CPU_SPECS]


@pytest.fixture(params=SPEC_PARAMS)
def spec(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=METRICS)
def metric(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(SEED)


# --- items for the float64 reference (kalos.testing.check_search holds results to it) ---


def items_of(ids: np.ndarray, vectors: np.ndarray, scopes: np.ndarray | None = None) -> dict:
    out: dict[int, tuple[np.ndarray, tuple[int, int, int]]] = {}
    for j, i in enumerate(ids.tolist()):
        s = (0, 0, 0) if scopes is None else tuple(int(x) for x in scopes[j])
        out[i] = (np.asarray(vectors[j], dtype=np.float32), s)  # type: ignore[assignment]
    return out


def random_ids(rng: np.random.Generator, n: int) -> np.ndarray:
    """n distinct arbitrary 64-bit ids, negatives included, never -1."""
    ids = np.unique(rng.integers(-(2**62), 2**62, size=n * 2, dtype=np.int64))
    ids = ids[ids != -1]
    return rng.permutation(ids)[:n]


# --- the conformance kit every backend must pass (kalos.testing.check_index) ---


def test_the_index_kit(spec: str) -> None:
    check_index(spec)


# --- search against the reference ---


N = 2000


@pytest.fixture
def filled(spec: str, metric: str, rng: np.random.Generator):
    vectors = rng.standard_normal((N, DIM), dtype=np.float32)
    ids = random_ids(rng, N)
    scopes = np.stack(
        [rng.integers(1, 4, N), rng.integers(0, 5, N), rng.integers(0, 4, N)], axis=1
    ).astype(np.int64)
    index = create(spec, dim=DIM, metric=metric)
    index.add(vectors, ids, scopes)
    return index, items_of(ids, vectors, scopes), rng


@pytest.mark.parametrize("k", [1, 5, 10, 100, N, N + 7])
def test_top_k_matches_reference(filled, metric: str, k: int) -> None:
    index, items, rng = filled
    one = rng.standard_normal(DIM, dtype=np.float32)
    check_search(index.search(one, k), items, one, k, metric)  # nq = 1 as [dim]
    batch = rng.standard_normal((7, DIM), dtype=np.float32)
    check_search(index.search(batch, k), items, batch, k, metric)


def test_many_queries_in_one_call(filled, metric: str, monkeypatch) -> None:
    import kalos.index.cpu_flat as cpu_flat

    monkeypatch.setattr(cpu_flat, "BATCH_SCORE_BYTES", 4 * N * 3)  # cpu:flat: blocks of 3
    index, items, rng = filled
    queries = rng.standard_normal((20, DIM), dtype=np.float32)
    for scope in (None, (1, 0, 0), (2, 3, 0)):
        batch = index.search(queries, 10, scope=scope)
        check_search(batch, items, queries, 10, metric, scope)
        for row in (0, 7, 19):
            single = index.search(queries[row], 10, scope=scope)
            np.testing.assert_array_equal(single[1][0], batch[1][row])


def test_query_equal_to_an_item_finds_it_first(filled, metric: str) -> None:
    if metric == "ip":
        pytest.skip("under inner product a longer vector can beat the item itself")
    index, items, _ = filled
    some = list(items)[:5]
    queries = np.stack([items[i][0] for i in some])
    scores, ids = index.search(queries, 3)
    assert ids[:, 0].tolist() == some
    if metric == "l2":
        np.testing.assert_allclose(scores[:, 0], 0.0, atol=1e-4)
    if metric == "cosine":
        np.testing.assert_allclose(scores[:, 0], 1.0, rtol=1e-5)


@pytest.mark.parametrize(
    "scope",
    [
        (1, 0, 0),
        (0, 3, 0),
        (0, 0, 2),
        (2, 1, 0),
        (3, 0, 1),
        (0, 4, 3),
        (1, 2, 3),
        (0, 0, 0),
    ],
)
@pytest.mark.parametrize("k", [1, 10, N])
def test_scope_filter_matches_reference(filled, metric: str, scope, k: int) -> None:
    index, items, rng = filled
    one = rng.standard_normal(DIM, dtype=np.float32)
    check_search(index.search(one, k, scope=scope), items, one, k, metric, scope)
    batch = rng.standard_normal((3, DIM), dtype=np.float32)
    check_search(index.search(batch, k, scope=scope), items, batch, k, metric, scope)


@pytest.mark.parametrize("scope", [(9, 0, 0), (0, 99, 0), (1, 0, 77), (-5, 1, 1)])
def test_scope_without_match_returns_only_missing(filled, metric: str, scope) -> None:
    index, _, rng = filled
    scores, ids = index.search(rng.standard_normal((2, DIM), dtype=np.float32), 4, scope=scope)
    assert (ids == -1).all()
    assert (scores == (math.inf if metric == "l2" else -math.inf)).all()


def test_scope_filter_accepts_a_list_and_numpy_ints(filled) -> None:
    index, _, rng = filled
    q = rng.standard_normal(DIM, dtype=np.float32)
    want = index.search(q, 10, scope=(2, 1, 0))
    for scope in ([2, 1, 0], np.array([2, 1, 0], dtype=np.int64)):
        got = index.search(q, 10, scope=scope)
        np.testing.assert_array_equal(got[1], want[1])


def test_empty_index_returns_only_missing(spec: str, metric: str) -> None:
    index = create(spec, dim=DIM, metric=metric)
    scores, ids = index.search(np.ones(DIM, dtype=np.float32), 3)
    assert ids.shape == (1, 3) and (ids == -1).all()
    assert (scores == (math.inf if metric == "l2" else -math.inf)).all()
    assert len(index) == 0


def test_order_is_descending_for_similarity_ascending_for_l2(filled, metric: str) -> None:
    index, _, rng = filled
    scores, _ = index.search(rng.standard_normal((4, DIM), dtype=np.float32), 50)
    steps = np.diff(scores, axis=1)
    if metric == "l2":
        assert (steps >= 0).all() and (scores >= 0).all()
    else:
        assert (steps <= 0).all()


# --- writes ---


def test_upsert_replaces_vector_and_scope(spec: str, metric: str, rng) -> None:
    index = create(spec, dim=DIM, metric=metric)
    vectors = rng.standard_normal((50, DIM), dtype=np.float32)
    ids = random_ids(rng, 50)
    scopes = np.tile(np.array([[1, 1, 1]], dtype=np.int64), (50, 1))
    index.add(vectors, ids, scopes)
    items = items_of(ids, vectors, scopes)

    fresh = rng.standard_normal((5, DIM), dtype=np.float32) * 3
    new_scopes = np.tile(np.array([[2, 0, 0]], dtype=np.int64), (5, 1))
    index.add(fresh, ids[:5], new_scopes)  # the same ids again
    items.update(items_of(ids[:5], fresh, new_scopes))

    assert len(index) == 50
    np.testing.assert_allclose(
        index.reconstruct(ids[:5]), _stored(fresh, metric), rtol=1e-6, atol=1e-7
    )
    assert (
        set(index.search(fresh, 50, scope=(1, 0, 0))[1].ravel().tolist()) & set(ids[:5].tolist())
        == set()
    ), "a replaced item still matched its old scope"
    got = index.search(fresh, 5, scope=(2, 0, 0))[1]
    assert set(got.ravel().tolist()) == set(ids[:5].tolist())
    q = rng.standard_normal((3, DIM), dtype=np.float32)
    check_search(index.search(q, 20), items, q, 20, metric)


def test_duplicate_ids_in_one_batch_last_wins(spec: str, metric: str, rng) -> None:
    index = create(spec, dim=DIM, metric=metric)
    vectors = rng.standard_normal((6, DIM), dtype=np.float32)
    ids = np.array([7, -3, 7, 9, -3, 7], dtype=np.int64)
    scopes = np.arange(18, dtype=np.int64).reshape(6, 3) + 1
    index.add(vectors, ids, scopes)
    assert len(index) == 3
    np.testing.assert_allclose(
        index.reconstruct([7, -3, 9]), _stored(vectors[[5, 4, 3]], metric), rtol=1e-6, atol=1e-7
    )
    dumped_ids, _, dumped_scopes = index.dump()
    by_id = dict(zip(dumped_ids.tolist(), dumped_scopes.tolist(), strict=True))
    assert by_id == {7: scopes[5].tolist(), -3: scopes[4].tolist(), 9: scopes[3].tolist()}


def test_remove_then_search_never_returns_removed(spec: str, metric: str, rng) -> None:
    index = create(spec, dim=DIM, metric=metric)
    n = 500
    vectors = rng.standard_normal((n, DIM), dtype=np.float32)
    ids = random_ids(rng, n)
    index.add(vectors, ids)
    items = items_of(ids, vectors)

    gone = rng.choice(ids, 180, replace=False)
    unknown = np.array([123456789, -987654321, -1], dtype=np.int64)
    request = np.concatenate([gone, gone[:10], unknown])  # repeats and unknown ids
    assert index.remove(request) == 180
    assert len(index) == n - 180
    for i in gone.tolist():
        del items[i]

    q = rng.standard_normal((5, DIM), dtype=np.float32)
    result = index.search(q, n)
    assert not set(result[1].ravel().tolist()) & set(gone.tolist())
    check_search(result, items, q, n, metric)
    check_search(index.search(q[0], 10), items, q[0], 10, metric)
    with pytest.raises(NotFound):
        index.reconstruct(gone[:1])
    assert index.remove(gone) == 0
    # remaining items keep their own vectors after rows moved into the holes
    keep = np.array(list(items), dtype=np.int64)
    np.testing.assert_allclose(
        index.reconstruct(keep), _stored(np.stack([items[i][0] for i in keep]), metric), atol=1e-6
    )


def test_remove_everything_then_add_again(spec: str, metric: str, rng) -> None:
    index = create(spec, dim=DIM, metric=metric)
    vectors = rng.standard_normal((40, DIM), dtype=np.float32)
    ids = np.arange(40, dtype=np.int64) - 20
    ids[ids == -1] = 1000
    index.add(vectors, ids)
    assert index.remove(ids[::-1]) == 40
    assert len(index) == 0
    assert (index.search(vectors[0], 5)[1] == -1).all()
    index.add(vectors[:3], ids[:3])
    check_search(
        index.search(vectors[:2], 5), items_of(ids[:3], vectors[:3]), vectors[:2], 5, metric
    )


def test_growth_over_many_batches(spec: str, metric: str, rng) -> None:
    index = create(spec, dim=DIM, metric=metric)
    items: dict = {}
    next_id = -(2**40)
    for batch in range(10):  # 1, 3, 7, ... items: past several capacity doublings
        m = 2 ** (batch + 1) - 1
        vectors = rng.standard_normal((m, DIM), dtype=np.float32)
        ids = np.arange(next_id, next_id + m, dtype=np.int64)
        next_id += m
        index.add(vectors, ids)
        items.update(items_of(ids, vectors))
        assert len(index) == len(items)
        assert index.nbytes >= len(items) * (4 * DIM + 8 + 24)
    q = rng.standard_normal((3, DIM), dtype=np.float32)
    check_search(index.search(q, 25), items, q, 25, metric)
    dumped_ids, dumped_vectors, _ = index.dump()
    assert set(dumped_ids.tolist()) == set(items)
    order = np.argsort(dumped_ids)
    want = np.stack([items[i][0] for i in sorted(items)])
    np.testing.assert_allclose(dumped_vectors[order], _stored(want, metric), atol=1e-6)


def test_add_of_zero_items_is_a_no_op(spec: str) -> None:
    index = create(spec, dim=DIM)
    index.add(np.empty((0, DIM), dtype=np.float32), np.empty(0, dtype=np.int64))
    assert len(index) == 0


def test_reset_empties(filled, metric: str) -> None:
    index, _, rng = filled
    index.reset()
    assert len(index) == 0
    assert (index.search(np.ones(DIM, dtype=np.float32), 3)[1] == -1).all()
    ids, vectors, scopes = index.dump()
    assert ids.shape == (0,) and vectors.shape == (0, DIM) and scopes.shape == (0, 3)
    v = rng.standard_normal((4, DIM), dtype=np.float32)
    index.add(v, np.arange(4))
    check_search(index.search(v, 4), items_of(np.arange(4), v), v, 4, metric)


# --- round trips and conversions ---


def _stored(vectors: np.ndarray, metric: str) -> np.ndarray:
    """What an index stores for these vectors: float32, unit rows for cosine."""
    v = np.asarray(vectors, dtype=np.float32)
    if metric == "cosine":
        v = (v / np.linalg.norm(v.astype(np.float64), axis=1, keepdims=True)).astype(np.float32)
    return v


def test_dump_round_trip_into_a_fresh_index(filled, spec: str, metric: str) -> None:
    index, items, rng = filled
    ids, vectors, scopes = index.dump()
    assert ids.dtype == np.int64 and vectors.dtype == np.float32 and scopes.dtype == np.int64
    assert ids.shape == (N,) and vectors.shape == (N, DIM) and scopes.shape == (N, 3)
    for i, v, s in zip(ids[:50].tolist(), vectors[:50], scopes[:50], strict=True):
        np.testing.assert_allclose(v, _stored(items[i][0][None], metric)[0], atol=1e-6)
        assert tuple(s.tolist()) == items[i][1]
    np.testing.assert_array_equal(index.reconstruct(ids), vectors)

    copy = create(spec, dim=DIM, metric=metric)
    copy.add(vectors, ids, scopes)
    again = copy.dump()
    order_a, order_b = np.argsort(ids), np.argsort(again[0])
    np.testing.assert_array_equal(again[0][order_b], ids[order_a])
    np.testing.assert_allclose(again[1][order_b], vectors[order_a], atol=1e-6)
    np.testing.assert_array_equal(again[2][order_b], scopes[order_a])
    q = rng.standard_normal((2, DIM), dtype=np.float32)
    np.testing.assert_array_equal(copy.search(q, 10)[1], index.search(q, 10)[1])


def test_dump_returns_copies(filled) -> None:
    index, _, _ = filled
    ids, vectors, scopes = index.dump()
    ids[:] = 5
    vectors[:] = 0
    scopes[:] = 0
    again = index.dump()
    assert len(set(again[0].tolist())) == N
    assert np.abs(again[1]).sum() > 0


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_float16_and_float64_are_converted(spec: str, metric: str, dtype, rng) -> None:
    index = create(spec, dim=DIM, metric=metric)
    vectors = rng.standard_normal((30, DIM)).astype(dtype)
    index.add(vectors, np.arange(30))
    np.testing.assert_allclose(
        index.reconstruct(np.arange(30)), _stored(vectors.astype(np.float32), metric), atol=1e-6
    )
    q = vectors[:2]
    check_search(
        index.search(q, 5), items_of(np.arange(30), vectors.astype(np.float32)), q, 5, metric
    )


def test_reconstruct_unknown_id_is_not_found(filled) -> None:
    index, items, _ = filled
    known = next(iter(items))
    with pytest.raises(NotFound):
        index.reconstruct([known, 424242])
    with pytest.raises(KeyError):  # NotFound is a KeyError too
        index.reconstruct([-1])


def test_cosine_normalises_vectors_and_queries(spec: str, rng) -> None:
    index = create(spec, dim=DIM, metric="cosine")
    vectors = rng.standard_normal((100, DIM), dtype=np.float32)
    scale = rng.uniform(0.01, 100, size=(100, 1)).astype(np.float32)
    index.add(vectors * scale, np.arange(100))
    norms = np.linalg.norm(index.reconstruct(np.arange(100)), axis=1)
    np.testing.assert_allclose(norms, 1.0, rtol=1e-5)
    q = rng.standard_normal(DIM, dtype=np.float32)
    s1, i1 = index.search(q, 10)
    s2, i2 = index.search(q * 1000, 10)
    np.testing.assert_array_equal(i1, i2)
    np.testing.assert_allclose(s1, s2, rtol=1e-5)
    assert (np.abs(s1) <= 1.0 + 1e-5).all()
    check_search((s1, i1), items_of(np.arange(100), vectors), q, 10, "cosine")


def test_cosine_refuses_zero_vectors(spec: str) -> None:
    index = create(spec, dim=DIM, metric="cosine")
    with pytest.raises(InvalidRequest):
        index.add(np.zeros((1, DIM), dtype=np.float32), [1])
    index.add(np.ones((1, DIM), dtype=np.float32), [1])
    with pytest.raises(InvalidRequest):
        index.search(np.zeros(DIM, dtype=np.float32), 1)


# --- validation ---


def _bad_adds(rng: np.random.Generator) -> list[tuple[str, tuple, dict]]:
    v = rng.standard_normal((4, DIM), dtype=np.float32)
    ids = np.arange(4, dtype=np.int64)
    nan = v.copy()
    nan[1, 3] = np.nan
    inf = v.copy()
    inf[2, 0] = -np.inf
    huge = v.astype(np.float64)
    huge[0, 0] = 1e300  # finite in float64, inf in float32
    return [
        ("wrong dim", (rng.standard_normal((4, DIM + 1), dtype=np.float32), ids), {}),
        ("1-D vectors", (v[0], ids[:1]), {}),
        ("3-D vectors", (v[None], ids), {}),
        ("NaN", (nan, ids), {}),
        ("inf", (inf, ids), {}),
        ("overflows float32", (huge, ids), {}),
        ("integer vectors", (np.ones((4, DIM), dtype=np.int32), ids), {}),
        ("too few ids", (v, ids[:3]), {}),
        ("too many ids", (v, np.arange(5)), {}),
        ("2-D ids", (v, ids.reshape(2, 2)), {}),
        ("float ids", (v, ids.astype(np.float64)), {}),
        ("id -1", (v, np.array([0, 1, -1, 3])), {}),
        ("uint64 beyond int64", (v, np.array([0, 1, 2, 2**64 - 1], dtype=np.uint64)), {}),
        ("too few scopes", (v, ids), {"scopes": np.zeros((3, 3), dtype=np.int64)}),
        ("scopes of 2 fields", (v, ids), {"scopes": np.zeros((4, 2), dtype=np.int64)}),
        ("1-D scopes", (v, ids), {"scopes": np.zeros(12, dtype=np.int64)}),
        ("float scopes", (v, ids), {"scopes": np.zeros((4, 3))}),
    ]


def test_bad_adds_raise_invalid_request_and_change_nothing(spec: str, metric: str, rng) -> None:
    index = create(spec, dim=DIM, metric=metric)
    base = rng.standard_normal((10, DIM), dtype=np.float32)
    index.add(base, np.arange(100, 110))
    before = index.dump()
    for name, args, kwargs in _bad_adds(rng):
        with pytest.raises(InvalidRequest):
            index.add(*args, **kwargs)
            pytest.fail(f"add accepted {name}")
        after = index.dump()
        assert len(index) == 10, name
        for a, b in zip(before, after, strict=True):
            np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.parametrize(
    ("name", "query", "k", "scope"),
    [
        ("wrong dim", np.ones(DIM + 1, dtype=np.float32), 3, None),
        ("wrong dim 2-D", np.ones((2, DIM - 1), dtype=np.float32), 3, None),
        ("3-D queries", np.ones((1, 1, DIM), dtype=np.float32), 3, None),
        ("scalar query", np.float32(1.0), 3, None),
        ("NaN query", np.full(DIM, np.nan, dtype=np.float32), 3, None),
        ("inf query", np.r_[np.ones(DIM - 1), np.inf].astype(np.float32), 3, None),
        ("integer query", np.ones(DIM, dtype=np.int64), 3, None),
        ("k = 0", np.ones(DIM, dtype=np.float32), 0, None),
        ("k < 0", np.ones(DIM, dtype=np.float32), -2, None),
        ("k float", np.ones(DIM, dtype=np.float32), 2.0, None),
        ("k bool", np.ones(DIM, dtype=np.float32), True, None),
        ("scope of 2", np.ones(DIM, dtype=np.float32), 3, (1, 2)),
        ("scope of 4", np.ones(DIM, dtype=np.float32), 3, (1, 2, 3, 4)),
        ("scope of str", np.ones(DIM, dtype=np.float32), 3, ("a", "b", "c")),
        ("scope int", np.ones(DIM, dtype=np.float32), 3, 5),
    ],
)
def test_bad_searches_raise_invalid_request(spec: str, metric: str, name, query, k, scope) -> None:
    index = create(spec, dim=DIM, metric=metric)
    index.add(np.ones((3, DIM), dtype=np.float32), [1, 2, 3])
    with pytest.raises(InvalidRequest):
        index.search(query, k, scope=scope)
    empty = create(spec, dim=DIM, metric=metric)
    with pytest.raises(InvalidRequest):  # validation does not depend on the content
        empty.search(query, k, scope=scope)


@pytest.mark.parametrize("ids", [np.ones((2, 2), dtype=np.int64), np.array([1.5]), ["a"]])
def test_bad_ids_for_remove_and_reconstruct(spec: str, ids) -> None:
    index = create(spec, dim=DIM)
    index.add(np.ones((2, DIM), dtype=np.float32), [1, 2])
    with pytest.raises(InvalidRequest):
        index.remove(ids)
    with pytest.raises(InvalidRequest):
        index.reconstruct(ids)
    assert len(index) == 2


# --- factory and protocol ---


def test_index_protocol_and_attributes(spec: str, metric: str) -> None:
    index = create(spec, dim=DIM, metric=metric)
    assert isinstance(index, Index)
    assert (index.spec, index.dim, index.metric) == (spec, DIM, metric)
    assert isinstance(index.nbytes, int) and index.nbytes >= 0


def test_default_metric_is_inner_product(spec: str) -> None:
    assert create(spec, dim=4).metric == "ip"


@pytest.mark.parametrize("dim", [0, -1, 2.5, "8", True, None])
def test_create_refuses_a_bad_dim(spec: str, dim) -> None:
    with pytest.raises(ConfigError):
        create(spec, dim=dim)


@pytest.mark.parametrize("metric", ["dot", "L2", "", None])
def test_create_refuses_a_bad_metric(spec: str, metric) -> None:
    with pytest.raises(ConfigError):
        create(spec, dim=4, metric=metric)


def test_cpu_specs_refuse_unknown_options_and_a_device_index(spec: str) -> None:
    with pytest.raises(ConfigError):
        create(spec + ",fp16", dim=4)
    device, kind = spec.split(":")
    with pytest.raises(ConfigError):
        create(f"{device}:0:{kind}", dim=4)


def test_unknown_spec_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError) as err:
        create("cpu:hnsw-nope", dim=4)
    for known in CPU_KEYS:
        assert known in str(err.value)


@pytest.mark.parametrize("bad", ["", "flat", "cpu", "cpu:", ":flat", "a:b:c:d", "cpu:x:flat", 7])
def test_malformed_specs_raise_config_error(bad) -> None:
    with pytest.raises(ConfigError):
        create(bad, dim=4)


def test_spec_parser_handles_device_index_and_options() -> None:
    s = parse_spec("cuda:1:flat,bf16")
    assert (s.device, s.device_index, s.kind, s.options, s.key) == (
        "cuda",
        1,
        "flat",
        ("bf16",),
        "cuda:flat",
    )
    s = parse_spec("cuda:flat,fp16,nprobe=8")
    assert (s.device_index, s.options) == (None, ("fp16", "nprobe=8"))
    assert parse_spec("cpu:flat").options == ()


def test_options_and_device_index_reach_the_backend(monkeypatch) -> None:
    seen: dict[str, object] = {}

    class Probe:
        def __init__(self, spec, *, dim, metric, device_index, options):
            seen.update(spec=spec, dim=dim, metric=metric, index=device_index, options=options)

    import types

    module = types.ModuleType("kalos_probe_backend")
    module.Probe = Probe  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kalos_probe_backend", module)
    monkeypatch.setitem(BACKENDS, "probe:flat", Backend("kalos_probe_backend", "Probe"))
    create("probe:3:flat,fp16,x=1", dim=8, metric="l2")
    assert seen == {
        "spec": "probe:3:flat,fp16,x=1",
        "dim": 8,
        "metric": "l2",
        "index": 3,
        "options": ("fp16", "x=1"),
    }


def test_missing_optional_package_names_it_and_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(
        BACKENDS,
        "cpu:needs-missing",
        Backend(
            "kalos_missing_pkg_xyz.backend",
            "Index",
            requires="kalos_missing_pkg_xyz",
            install="pip install 'kalos[xyz]'",
        ),
    )
    with pytest.raises(ConfigError) as err:
        create("cpu:needs-missing", dim=4)
    assert "kalos_missing_pkg_xyz" in str(err.value)
    assert "kalos[xyz]" in str(err.value)


def test_importing_kalos_index_imports_neither_faiss_nor_torch() -> None:
    code = (
        "import sys, kalos.index; "
        "heavy = [m for m in ('faiss', 'torch', 'triton') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)


# --- the exact selection used by cpu:flat ---


@pytest.mark.parametrize("m", [1, 10, 255, 256, 2000, 50_000])
@pytest.mark.parametrize("k", [1, 3, 10])
@pytest.mark.parametrize("layout", ["random", "ascending", "descending", "ties", "spikes"])
def test_top_k_1d_is_exact(m: int, k: int, layout: str, rng) -> None:
    from kalos.index.cpu_flat import top_k_1d

    if k > m:
        k = m
    scores = {
        "random": rng.standard_normal(m),
        "ascending": np.arange(m, dtype=np.float64),
        "descending": -np.arange(m, dtype=np.float64),
        "ties": rng.integers(0, 3, m).astype(np.float64),
        # the winners sit exactly between the sampled positions
        "spikes": np.where(np.arange(m) % 32 == 16, 1000.0 + np.arange(m), 0.0),
    }[layout].astype(np.float32)
    scores[scores.shape[0] // 2] = -np.inf
    got = top_k_1d(scores, k)
    assert got.shape == (k,) and len(set(got.tolist())) == k
    want = np.sort(scores)[::-1][:k]
    np.testing.assert_array_equal(scores[got], want)


def test_row_table_keeps_ids_and_rows_consistent(rng) -> None:
    table = RowTable()
    ids = random_ids(rng, 300)
    rows = table.upsert(ids, np.zeros((300, 3), dtype=np.int64))
    np.testing.assert_array_equal(rows, np.arange(300))
    removed, holes, movers = table.remove(ids[::3])
    assert removed == 100 and len(table) == 200
    assert holes.shape == movers.shape and (holes < 200).all() and (movers >= 200).all()
    np.testing.assert_array_equal(table.rows_of(table.ids), np.arange(200))
    assert (table.rows_of(ids[::3]) == -1).all()


# --- property test: random operation sequences against a dict model ---

_PROP_DIM = 4
_ids = st.integers(-6, 12).filter(lambda i: i != -1)
_vec = st.lists(st.integers(-3, 3), min_size=_PROP_DIM, max_size=_PROP_DIM)
_scope = st.tuples(st.integers(0, 2), st.integers(0, 2), st.integers(0, 1))
_add = st.tuples(st.just("add"), st.lists(st.tuples(_ids, _vec, _scope), min_size=0, max_size=8))
_remove = st.tuples(st.just("remove"), st.lists(_ids | st.just(-1) | st.just(99), max_size=6))
_search = st.tuples(
    st.just("search"),
    st.tuples(
        st.lists(_vec, min_size=1, max_size=3),
        st.integers(1, 25),
        st.none() | _scope,
    ),
)
_ops = st.lists(st.one_of(_add, _remove, _search), min_size=1, max_size=25)


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("spec", SPEC_PARAMS)
@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(ops=_ops)
def test_random_operations_agree_with_a_dict_model(spec: str, metric: str, ops) -> None:
    index = create(spec, dim=_PROP_DIM, metric=metric)
    model: dict[int, tuple[np.ndarray, tuple[int, int, int]]] = {}
    for op, arg in ops:
        if op == "add":
            ids = np.array([i for i, _, _ in arg], dtype=np.int64)
            vectors = np.array([v for _, v, _ in arg], dtype=np.float32).reshape(-1, _PROP_DIM)
            scopes = np.array([s for _, _, s in arg], dtype=np.int64).reshape(-1, 3)
            if metric == "cosine" and (np.abs(vectors).sum(axis=1) == 0).any():
                with pytest.raises(InvalidRequest):
                    index.add(vectors, ids, scopes)
            else:
                index.add(vectors, ids, scopes)
                for i, v, s in arg:
                    model[i] = (np.array(v, dtype=np.float32), s)
        elif op == "remove":
            present = {i for i in arg if i in model}
            assert index.remove(np.array(arg, dtype=np.int64)) == len(present)
            for i in present:
                del model[i]
        else:
            queries, k, scope = arg
            q = np.array(queries, dtype=np.float32)
            if metric == "cosine" and (np.abs(q).sum(axis=1) == 0).any():
                with pytest.raises(InvalidRequest):
                    index.search(q, k, scope=scope)
                continue
            check_search(index.search(q, k, scope=scope), model, q, k, metric, scope)
        assert len(index) == len(model)
    dumped_ids, dumped_vectors, dumped_scopes = index.dump()
    assert sorted(dumped_ids.tolist()) == sorted(model)
    for i, v, s in zip(dumped_ids.tolist(), dumped_vectors, dumped_scopes, strict=True):
        np.testing.assert_allclose(v, _stored(model[i][0][None], metric)[0], atol=1e-6)
        assert tuple(s.tolist()) == model[i][1]


def test_finiteness_and_cosine_fast_paths_keep_their_answers() -> None:
    """The query checks' shortcuts (a sum of squares for finiteness, scalar norms for one
    row) decide as the exact forms do: large finite values whose squares overflow float32
    pass, NaN and inf anywhere are refused, and one row normalises as it would in a batch."""
    from kalos.index.base import check_queries, normalise_rows

    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, DIM)).astype(np.float32)
    big = q * np.float32(1e30)  # finite, but its sum of squares overflows to inf
    assert np.array_equal(check_queries(big, DIM), big)
    for bad in (np.nan, np.inf, -np.inf):
        x = q.copy()
        x[0, DIM // 2] = bad
        with pytest.raises(InvalidRequest):
            check_queries(x, DIM)
    batch = np.concatenate([q, big, rng.standard_normal((2, DIM)).astype(np.float32)])
    whole = normalise_rows(batch, "queries")
    for i in range(len(batch)):
        np.testing.assert_array_equal(normalise_rows(batch[i : i + 1], "queries"), whole[i : i + 1])
    with pytest.raises(InvalidRequest, match="zero norm"):
        normalise_rows(np.zeros((1, DIM), np.float32), "queries")
