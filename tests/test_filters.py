"""Metadata filters (kalos.filters, kalos.stores.metadata): the syntax and its limits, and a
property test: random filters (random nesting, every operator, missing keys, type
mismatches) over random metadata give the same rows from the column evaluator, from
``filters.matches`` and from the reference written here, and a filtered search on every CPU
index backend is the exact top-k of those rows."""

from __future__ import annotations

import importlib.util
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kalos import filters
from kalos.errors import InvalidRequest
from kalos.index import create
from kalos.index.factory import BACKENDS, known_specs
from kalos.stores.metadata import MetadataTable

# -- the reference: docs/FILTERS.md's semantics, written again from the page -------------------


def kind(v: object) -> str | None:
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, str):
        return "str"
    if isinstance(v, int):
        return "num"
    if isinstance(v, float):
        return "num" if math.isfinite(v) else None
    return None


def same(a: object, b: object) -> bool:
    return kind(a) is not None and kind(a) == kind(b) and a == b


def reference(where: dict[str, Any], meta: dict[str, Any] | None) -> bool:
    out = True
    for key, spec in where.items():
        if key in ("$and", "AND"):
            out &= all(reference(w, meta) for w in spec)
        elif key in ("$or", "OR"):
            out &= any(reference(w, meta) for w in spec)
        elif key in ("$not", "NOT"):
            out &= not reference(spec, meta)
        elif isinstance(spec, dict):
            out &= all(condition(meta, key, op.lstrip("$"), v) for op, v in spec.items())
        else:
            out &= condition(meta, key, "eq", spec)
    return out


def condition(meta: dict[str, Any] | None, key: str, op: str, want: object) -> bool:
    if meta is None or key not in meta:
        return False
    have = meta[key]
    if op == "contains":
        if isinstance(have, list):
            return any(same(e, want) for e in have)
        return isinstance(have, str) and isinstance(want, str) and want in have
    if isinstance(have, list) or kind(have) is None:
        return False
    if op in ("in", "nin"):
        assert isinstance(want, list)
        if kind(have) not in {kind(w) for w in want}:
            return False
        hit = any(same(have, w) for w in want)
        return hit if op == "in" else not hit
    if kind(have) != kind(want):
        return False
    if op == "eq":
        return have == want
    if op == "ne":
        return have != want
    return {"gt": have > want, "gte": have >= want, "lt": have < want, "lte": have <= want}[op]  # type: ignore[operator]


# -- random metadata and filters --------------------------------------------------------------

KEYS = ["a", "b", "c", "tags"]
SCALARS = st.one_of(
    st.sampled_from(["x", "y", "xy", "", "Z"]),
    st.integers(-3, 3),
    st.sampled_from([0.5, -1.5, 2.0, 1e300]),
    st.booleans(),
)
VALUES = st.one_of(SCALARS, st.lists(SCALARS, max_size=3), st.none(), st.just({"nested": 1}))
METAS = st.one_of(st.none(), st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=4))


def leaf() -> st.SearchStrategy[dict[str, Any]]:
    ordered = st.one_of(st.sampled_from(["x", "xy", ""]), st.integers(-3, 3), st.just(0.5))
    ops = st.one_of(
        st.tuples(st.sampled_from(["eq", "ne", "$eq", "contains"]), SCALARS),
        st.tuples(st.sampled_from(["gt", "gte", "lt", "$lte"]), ordered),
        st.tuples(st.sampled_from(["in", "nin"]), st.lists(SCALARS, min_size=1, max_size=3)),
    )
    plain = st.builds(lambda k, v: {k: v}, st.sampled_from(KEYS), SCALARS)
    with_op = st.builds(lambda k, ov: {k: {ov[0]: ov[1]}}, st.sampled_from(KEYS), ops)
    return st.one_of(plain, with_op)


FILTERS = st.recursive(
    leaf(),
    lambda inner: st.one_of(
        st.builds(lambda fs: {"$and": fs}, st.lists(inner, min_size=1, max_size=3)),
        st.builds(lambda fs: {"OR": fs}, st.lists(inner, min_size=1, max_size=3)),
        st.builds(lambda f: {"$not": f}, inner),
        st.builds(lambda f, g: {**f, **g}, inner, inner),  # several keys: ANDed
    ),
    max_leaves=8,
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(metas=st.lists(METAS, min_size=1, max_size=30), where=FILTERS, data=st.data())
def test_random_filters_agree_with_the_reference(metas, where, data) -> None:
    table = MetadataTable()
    ids = list(range(100, 100 + len(metas)))
    table.upsert(ids, metas, None)
    # churn: remove some, re-add some with other metadata (slots are reused)
    gone = data.draw(st.sets(st.sampled_from(ids)), label="removed")
    table.remove(sorted(gone))
    back = data.draw(st.sets(st.sampled_from(ids)), label="re-added")
    live = {i: metas[i - 100] for i in ids if i not in gone}
    for i in sorted(back):
        m = data.draw(METAS)
        table.upsert([i], [m], None)
        live[i] = m
    plain = data.draw(st.lists(st.sampled_from([*ids, 500, 501]), max_size=6), label="plain")
    table.upsert(plain, None, None)  # a plain add (no metadata), duplicates and new ids too
    live.update(dict.fromkeys(plain))
    node = filters.parse(where)
    want = sorted(i for i, m in live.items() if reference(where, m))
    assert sorted(table.matching(node).tolist()) == want
    assert sorted(i for i, m in live.items() if filters.matches(node, m)) == want
    assert filters.parse(filters.dumps(where)) == node  # the wire form says the same


# approximate backends with every list probed (exact), few lists so that they train
EXACT_SETTINGS = {"cpu:ivf": "cpu:ivf,nlist=1,nprobe=1"}
CPU_SPECS = [
    pytest.param(
        EXACT_SETTINGS.get(s, s),
        marks=pytest.mark.skipif(
            BACKENDS[s].requires is not None
            and importlib.util.find_spec(BACKENDS[s].requires) is None,
            reason=f"{s} needs {BACKENDS[s].requires}",
        ),
    )
    for s in known_specs("cpu")
]


@pytest.mark.parametrize("spec", CPU_SPECS)
@pytest.mark.parametrize("metric", ["ip", "cosine", "l2"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(metas=st.lists(METAS, min_size=1, max_size=60), where=FILTERS, k=st.integers(1, 12))
def test_filtered_search_is_the_exact_top_k_of_the_matches(spec, metric, metas, where, k):
    rng = np.random.default_rng(len(metas) * 31 + k)
    n, dim = len(metas), 8
    x = rng.standard_normal((n, dim)).astype(np.float32)
    ids = np.arange(n, dtype=np.int64) * 7 + 3
    index = create(spec, dim=dim, metric=metric)
    index.add(x, ids)
    table = MetadataTable()
    table.upsert(ids.tolist(), metas, None)
    allow = table.matching(filters.parse(where))
    q = rng.standard_normal((2, dim)).astype(np.float32)
    scores, got = index.search(q, k, allow=allow)
    rows = np.flatnonzero(np.isin(ids, allow))
    xs = x[rows].astype(np.float64)
    if metric == "cosine":
        xs /= np.linalg.norm(xs, axis=1, keepdims=True)
    for i in range(len(q)):
        qd = q[i].astype(np.float64)
        if metric == "cosine":
            qd /= np.linalg.norm(qd)
        ref = ((xs - qd) ** 2).sum(1) if metric == "l2" else xs @ qd
        order = np.argsort(ref if metric == "l2" else -ref, kind="stable")[:k]
        kk = len(order)
        assert (got[i, kk:] == -1).all()
        assert set(got[i, :kk].tolist()) <= set(allow.tolist())
        # the k-th best score agrees (ids may swap on ties)
        if kk:
            assert scores[i, kk - 1] == pytest.approx(ref[order[-1]], rel=1e-4, abs=1e-4)


# -- syntax and limits ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "where, message",
    [
        ({"a": {"regex": "x"}}, "unknown filter operator 'regex' on 'a'"),
        ({"a": {"gt": [1]}}, "gt takes a str, a number or a bool, got list"),
        ({"a": {"in": []}}, "in takes a non-empty list"),
        ({"a": {"nin": "x"}}, "nin takes a non-empty list"),
        ({"a": {"lt": False}}, "not a bool"),
        ({"a": {"eq": None}}, "got NoneType"),
        ({"a": {"eq": float("nan")}}, "got float"),
        ({"a": {}}, "has no operator"),
        ({"$xor": [{"a": 1}]}, "unknown filter operator '$xor'"),
        ({"$or": []}, "non-empty list"),
        ({"$and": {"a": 1}}, "non-empty list"),
        ([{"a": 1}], "a filter must be a dict, got list"),
        ({1: 2}, "filter keys must be str"),
        (b"{not json", "not valid JSON"),
        (b"[" * 20000, "too large"),
    ],
)
def test_bad_filters_name_the_problem(where: Any, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message.replace("$", r"\$").replace("(", r"\(")):
        filters.parse(where)


def test_the_limits() -> None:
    deep: dict[str, Any] = {"a": 1}
    for _ in range(filters.MAX_DEPTH - 1):
        deep = {"$not": deep}
    filters.parse(deep)  # 12 levels: fine
    with pytest.raises(InvalidRequest, match="too deep: more than 12 levels"):
        filters.parse({"$not": deep})
    filters.parse({"$or": [{"a": i} for i in range(filters.MAX_CONDITIONS - 1)]})
    with pytest.raises(InvalidRequest, match="more than 512 conditions"):
        filters.parse({"$or": [{"a": i} for i in range(filters.MAX_CONDITIONS)]})
    with pytest.raises(InvalidRequest, match="16384"):
        filters.parse(b" " * 16385)


def test_mem0_spellings() -> None:
    node = filters.parse({"AND": [{"a": 1}], "OR": [{"b": "x"}, {"b": "y"}], "NOT": [{"c": 1}]})
    assert filters.matches(node, {"a": 1, "b": "y"})
    assert not filters.matches(node, {"a": 1, "b": "y", "c": 1})
    assert not filters.matches(node, {"a": 1.5, "b": "y"})


def test_key_id_is_63_bits_and_stable() -> None:
    assert filters.key_id("doc-1") == filters.key_id("doc-1") != filters.key_id("doc-2")
    assert 0 <= filters.key_id("") < 1 << 63
    # pinned: clients in other languages must compute the same id (docs/FILTERS.md)
    assert filters.key_id("doc-1") == 4752762565065110614
