"""The :class:`Index` protocol every vector backend speaks, and the validation they share.

An index maps caller-chosen 64-bit ids to float32 vectors with a scope (tenant, user, session)
each, and answers exact or approximate top-k queries with faiss's verbs: ``add`` (an upsert),
``search``, ``remove``, ``reconstruct``. Backends live one per file next to this one and are
named by spec strings (see :mod:`kalos.index.factory`); this module imports numpy only.

Conventions every backend keeps (the conformance tests in ``tests/index`` pin them):

* ``search`` always returns 2-D ``(scores [nq, k] float32, ids [nq, k] int64)``. Where fewer
  than k items match, the tail holds id ``-1`` (:data:`NO_ID`) and score ``-inf`` for
  ``"ip"``/``"cosine"`` or ``+inf`` for ``"l2"`` (see :func:`missing_score`).
* ``"ip"`` and ``"cosine"`` rank by descending score, ``"l2"`` by ascending squared L2 distance.
  ``"cosine"`` stores the unit-normalised vector, so ``reconstruct`` returns that.
* A :data:`ScopeFilter` is ``(tenant, user, session)``; 0 is a wildcard. Items that do not
  match are never returned.
* ``allow``: ids [m] int64 that a search may return (a metadata filter's matches, see
  :mod:`kalos.filters`); None: every id. The result is the exact top-k of the items that
  match both the scope and ``allow``; ids in ``allow`` that are not stored are ignored.
  A backend whose rows live on a device may say so with a ``filter_device`` attribute (a
  torch device): a store then evaluates filters there and passes ``allow`` as an int64
  tensor on it (kalos.stores.device_columns). Host backends have no such attribute.
* ``nprobe``: how many lists an approximate (IVF) backend scores for this request; 0 (the
  default) means the index's own setting. Exact backends take it and ignore it, so a caller
  may pass it whatever index it holds.
* Bad input raises :class:`kalos.errors.InvalidRequest`; an unknown id in ``reconstruct``
  raises :class:`kalos.errors.NotFound`.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from typing import ClassVar, Protocol, runtime_checkable

import numpy as np

from kalos.errors import ConfigError, InvalidRequest

from .rows import RowTable, grown_capacity  # the backends' row storage, importable from here too

ScopeFilter = tuple[int, int, int]
"""``(tenant, user, session)``; 0 matches anything, a non-zero field must equal the item's."""

METRICS: tuple[str, ...] = ("ip", "cosine", "l2")
NO_ID = -1
"""The id that marks "no result" in search output; it can never be stored."""

_FLOAT_KINDS = (np.float16, np.float32, np.float64)
_F32 = np.dtype(np.float32)
_INT64_MAX = np.iinfo(np.int64).max


@runtime_checkable
class Index(Protocol):
    """A vector index for one dimension and one metric, used by one thread at a time."""

    spec: str  # the spec string it was created from, e.g. "cpu:flat"
    dim: int
    metric: str  # "ip" | "cosine" | "l2"

    def __len__(self) -> int:
        """Number of live items."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes held for vectors, ids and scopes (allocated capacity, not only live rows)."""
        ...

    def add(self, vectors: object, ids: object, scopes: object = None) -> None:
        """Upsert: vectors [n, dim] float, ids [n] int64, scopes [n, 3] int64 or None (zeros).

        An id already present is replaced (vector and scope); inside one batch the last
        occurrence of an id wins. Id -1 is reserved.
        """
        ...

    def search(
        self,
        queries: object,
        k: int,
        *,
        scope: ScopeFilter | None = None,
        allow: np.ndarray | None = None,
        nprobe: int = 0,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Top-k of queries [nq, dim] or [dim] → (scores [nq, k] float32, ids [nq, k] int64).

        ``allow``: ids [m] int64, the only ones that may be returned (None: any).
        ``nprobe``: lists an approximate backend probes (0: its own setting; exact: ignored).
        The returned arrays are new and owned by the caller.
        """
        ...

    def search_many(
        self,
        members: Sequence[tuple[object, int, ScopeFilter | None]],
        *,
        nprobe: int = 0,
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Several searches at once, each ``(queries, k, scope)`` as ``search`` takes them:
        each one's ``(scores, ids)``, exactly what ``search`` would return for it alone. A
        backend may share one pass over its rows among them (the sidecar's batching).
        ``nprobe``: as :meth:`search`'s, for every member."""
        ...

    def remove(self, ids: object) -> int:
        """Remove ids [n]; unknown ids are ignored. Returns how many were present."""
        ...

    def reconstruct(self, ids: object) -> np.ndarray:
        """Stored vectors of ids [n] as [n, dim] float32 (a copy); NotFound for unknown ids."""
        ...

    def dump(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Copies of all live items: (ids [n] int64, vectors [n, dim] float32, scopes [n, 3])."""
        ...

    def reset(self) -> None:
        """Remove every item."""
        ...


# --- configuration ---------------------------------------------------------------------------


def check_config(dim: object, metric: object) -> tuple[int, str]:
    """Validate ``dim`` and ``metric`` given to a backend constructor (ConfigError)."""
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or int(dim) <= 0:
        raise ConfigError(f"dim must be a positive integer, got {dim!r}")
    if metric not in METRICS:
        raise ConfigError(f"metric must be one of {', '.join(METRICS)}; got {metric!r}")
    return int(dim), str(metric)


def missing_score(metric: str) -> float:
    """Score reported next to id -1: the worst possible value for the metric's order."""
    return math.inf if metric == "l2" else -math.inf


# --- request validation ----------------------------------------------------------------------


def _as_float_array(x: object, what: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype.type not in _FLOAT_KINDS:
        raise InvalidRequest(f"{what} must be float32 (float16/float64 accepted); got {arr.dtype}")
    return arr


def _check_finite(arr: np.ndarray, what: str) -> None:
    # A finite sum of squares means every value is finite (NaN and inf propagate); the exact
    # check runs only when it is not (or it overflowed): half the cost on a query.
    if not math.isfinite(np.vdot(arr, arr)) and not np.isfinite(arr).all():
        raise InvalidRequest(f"{what} contain NaN or inf")


def _float32_rows(arr: np.ndarray) -> np.ndarray:
    """C-contiguous float32; float64 beyond float32's range becomes inf (refused later)."""
    if arr.dtype == _F32 and arr.flags.c_contiguous:  # a query as sent: no copy, no errstate
        return arr
    with np.errstate(over="ignore"):
        return np.ascontiguousarray(arr, dtype=np.float32)


def check_vectors(vectors: object, dim: int) -> np.ndarray:
    """vectors [n, dim] float16/32/64 → C-contiguous float32 [n, dim], finite."""
    arr = _as_float_array(vectors, "vectors")
    if arr.ndim != 2:
        raise InvalidRequest(f"vectors must be 2-D [n, {dim}]; got shape {arr.shape}")
    if arr.shape[1] != dim:
        raise InvalidRequest(f"vectors have dimension {arr.shape[1]}; the index has {dim}")
    arr = _float32_rows(arr)
    _check_finite(arr, "vectors")
    return arr


def check_queries(queries: object, dim: int) -> np.ndarray:
    """queries [nq, dim] or [dim] → C-contiguous float32 [nq, dim], finite."""
    arr = _as_float_array(queries, "queries")
    if arr.ndim == 1:
        arr = arr.reshape(1, -1)
    elif arr.ndim != 2:
        raise InvalidRequest(f"queries must be [nq, {dim}] or [{dim}]; got shape {arr.shape}")
    if arr.shape[1] != dim:
        raise InvalidRequest(f"queries have dimension {arr.shape[1]}; the index has {dim}")
    arr = _float32_rows(arr)
    _check_finite(arr, "queries")
    return arr


def check_k(k: object) -> int:
    """k must be a positive integer; k larger than the index is fine (the tail is -1)."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise InvalidRequest(f"k must be an integer; got {k!r}")
    if k <= 0:
        raise InvalidRequest(f"k must be positive; got {k}")
    return int(k)


def _as_int64(x: object, what: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype.kind == "u":
        if arr.size and int(arr.max()) > _INT64_MAX:
            raise InvalidRequest(f"{what} must fit in int64")
    elif arr.dtype.kind != "i":
        if arr.size == 0 and arr.dtype.kind == "f":  # np.asarray([]) is float64
            return arr.astype(np.int64)
        raise InvalidRequest(f"{what} must be int64; got {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.int64)


def check_ids(ids: object, n: int | None = None, *, storing: bool = False) -> np.ndarray:
    """ids [n] integers → C-contiguous int64 [n]. When ``storing``, id -1 is refused."""
    arr = _as_int64(ids, "ids")
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.ndim != 1:
        raise InvalidRequest(f"ids must be 1-D; got shape {arr.shape}")
    if n is not None and arr.shape[0] != n:
        raise InvalidRequest(f"got {arr.shape[0]} ids for {n} vectors")
    if storing and (arr == NO_ID).any():
        raise InvalidRequest("id -1 is reserved for 'no result' and cannot be stored")
    return arr


def check_scopes(scopes: object, n: int) -> np.ndarray:
    """scopes [n, 3] integers or None → C-contiguous int64 [n, 3] (None: all zeros)."""
    if scopes is None:
        return np.zeros((n, 3), dtype=np.int64)
    arr = _as_int64(scopes, "scopes")
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise InvalidRequest(f"scopes must be [n, 3] (tenant, user, session); got {arr.shape}")
    if arr.shape[0] != n:
        raise InvalidRequest(f"got {arr.shape[0]} scopes for {n} vectors")
    return arr


def check_scope_filter(scope: object) -> ScopeFilter | None:
    """A filter of three ints, or None. An all-zero filter matches everything (→ None)."""
    if scope is None:
        return None
    try:
        fields: tuple[object, ...] = tuple(scope)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidRequest(f"scope must be (tenant, user, session); got {scope!r}") from None
    if len(fields) != 3 or not all(
        isinstance(f, (int, np.integer)) and not isinstance(f, bool) for f in fields
    ):
        raise InvalidRequest(f"scope must be three ints (tenant, user, session); got {scope!r}")
    tenant, user, session = (int(f) for f in fields)  # type: ignore[call-overload]
    if not all(-_INT64_MAX - 1 <= f <= _INT64_MAX for f in (tenant, user, session)):
        raise InvalidRequest(f"scope fields must fit in int64; got {scope!r}")
    if tenant == user == session == 0:
        return None
    return (tenant, user, session)


# --- shared numerics -------------------------------------------------------------------------


def normalise_rows(vectors: np.ndarray, what: str) -> np.ndarray:
    """Unit-normalise float32 rows for cosine; a zero row has no direction (InvalidRequest).

    Norms are taken in float64 so that large float32 values cannot overflow.
    """
    if vectors.shape[0] == 1:  # a query: float64 scalars, no einsum (6.6 -> ~2 µs)
        v = vectors[0].astype(np.float64)
        norm = math.sqrt(float(np.dot(v, v)))
        if norm == 0:
            raise InvalidRequest(f"{what} with zero norm have no cosine similarity")
        return (v / norm).astype(np.float32)[None, :]
    norms = np.sqrt(np.einsum("ij,ij->i", vectors, vectors, dtype=np.float64))
    if (norms == 0).any():
        raise InvalidRequest(f"{what} with zero norm have no cosine similarity")
    return (vectors / norms[:, None]).astype(np.float32)


def last_occurrences(ids: np.ndarray) -> np.ndarray | None:
    """Positions that keep the last occurrence of each id, in batch order; None if no dupes."""
    uniq, first_in_reversed = np.unique(ids[::-1], return_index=True)
    if uniq.shape[0] == ids.shape[0]:
        return None
    return np.sort(ids.shape[0] - 1 - first_in_reversed)


def check_batch(
    vectors: object, ids: object, scopes: object, dim: int, metric: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An add's batch → (vectors [m, dim] float32, ids [m] int64, scopes [m, 3] int64) to store.

    Validated (InvalidRequest), unit-normalised for ``"cosine"``, and one row per id: inside
    the batch the last occurrence of an id wins, so ``m`` may be less than the batch's n.
    """
    vecs = check_vectors(vectors, dim)
    n = vecs.shape[0]
    keys = check_ids(ids, n, storing=True)
    scope_rows = check_scopes(scopes, n)
    if n == 0:
        return vecs, keys, scope_rows
    if metric == "cosine":
        vecs = normalise_rows(vecs, "vectors")
    keep = last_occurrences(keys)
    if keep is not None:
        vecs, keys, scope_rows = vecs[keep], keys[keep], scope_rows[keep]
    return vecs, keys, scope_rows


def scope_mask(columns: np.ndarray, scope: ScopeFilter) -> np.ndarray:
    """Which items match ``scope``: columns is [3, n] int64 (tenant, user, session rows)."""
    mask: np.ndarray | None = None
    for field, want in enumerate(scope):
        if want:
            hit = columns[field] == want
            mask = hit if mask is None else np.logical_and(mask, hit, out=mask)
    if mask is None:  # an all-zero filter; check_scope_filter turns that into None already
        return np.ones(columns.shape[1], dtype=bool)
    return mask


ALLOW_LOOKUP_BELOW = 1 / 16
"""``allow`` lists smaller than this share of the rows are looked up id by id (a dict);
larger ones by a binary search in the table's sorted ids (:meth:`RowTable.rows_of_many`)."""


def allow_mask(table: RowTable, allow: np.ndarray) -> np.ndarray:
    """[n] bool: the table's rows whose id is in ``allow`` [m] int64."""
    n = len(table)
    mask = np.zeros(n, bool)
    if allow.shape[0] < ALLOW_LOOKUP_BELOW * n:
        rows = table.rows_of(allow)
        mask[rows[rows >= 0]] = True
    else:
        mask[table.rows_of_many(allow)] = True
    return mask


# --- the half of a row-table backend that is not scoring ---------------------------------------


class RowIndex(abc.ABC):
    """Spec checks, a :class:`RowTable` of the items, and the verbs that only touch the table.

    ``search`` checks its arguments and the scope filter here, then hands the backend's
    :meth:`_search_rows` the matched rows. A backend subclass names its ``kind``
    (``"cpu:flat"``), scores in ``_search_rows`` and keeps any per-row data of its own in
    ``add``/``remove``/``reset``; ``__init__`` ends with ``reset()`` so that an override sets
    that data up too.
    """

    kind: ClassVar[str]  # the spec it answers to, without options: "cpu:flat"

    def __init__(
        self,
        spec: str | None = None,
        *,
        dim: int,
        metric: str = "ip",
        device_index: int | None = None,
        options: tuple[str, ...] = (),
    ) -> None:
        spec = self.kind if spec is None else spec
        if device_index is not None:
            raise ConfigError(f"{spec!r}: the cpu device takes no index")
        if options:
            raise ConfigError(f"{spec!r}: {self.kind} takes no options; got {options}")
        self.spec = spec
        self.dim, self.metric = check_config(dim, metric)
        self._table = RowTable(self.dim)  # vectors [capacity, dim] float32, ids, scopes
        self.reset()

    def __len__(self) -> int:
        return len(self._table)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(spec={self.spec!r}, dim={self.dim},"
            f" metric={self.metric!r}, n={len(self)})"
        )

    @property
    def nbytes(self) -> int:
        """Bytes allocated for vectors, ids and scopes (capacity, not live)."""
        return self._table.nbytes

    def add(self, vectors: object, ids: object, scopes: object = None) -> None:
        vecs, keys, scope_rows = check_batch(vectors, ids, scopes, self.dim, self.metric)
        self._table.upsert(keys, scope_rows, vecs)

    def remove(self, ids: object) -> int:
        return self._table.remove(check_ids(ids))[0]

    def reset(self) -> None:
        self._table.reset()

    def reconstruct(self, ids: object) -> np.ndarray:
        return self._table.reconstruct(check_ids(ids))

    def dump(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self._table.dump()

    def search(
        self,
        queries: object,
        k: int,
        *,
        scope: ScopeFilter | None = None,
        allow: np.ndarray | None = None,
        nprobe: int = 0,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Exact top-k (``nprobe`` is for approximate backends: ignored)."""
        q, k, mask, matched = self._checked(queries, k, scope, allow)
        if matched == 0:
            return self._no_results(q.shape[0], k)
        return self._search_rows(q, k, mask, matched)

    def _checked(
        self,
        queries: object,
        k: int,
        scope: ScopeFilter | None,
        allow: np.ndarray | None = None,
    ) -> tuple[np.ndarray, int, np.ndarray | None, int]:
        """A search's arguments checked: (queries [nq, dim] float32, normalised for cosine;
        k; the mask [n] bool of the rows the scope filter and ``allow`` matched, None for
        every row; how many rows it matched)."""
        q = check_queries(queries, self.dim)  # [nq, dim] float32
        k = check_k(k)
        filt = check_scope_filter(scope)
        if self.metric == "cosine":
            q = normalise_rows(q, "queries")
        n = len(self._table)
        mask: np.ndarray | None = None  # [n] bool, the rows the filters matched
        matched = n
        if n and filt is not None:
            mask = scope_mask(self._table.scope_columns, filt)
            matched = int(np.count_nonzero(mask))
        if n and allow is not None:
            allowed = allow_mask(self._table, check_ids(allow))
            mask = allowed if mask is None else np.logical_and(mask, allowed, out=mask)
            matched = int(np.count_nonzero(mask))
        return q, k, mask if matched < n else None, matched

    def search_many(
        self,
        members: Sequence[tuple[object, int, ScopeFilter | None]],
        *,
        nprobe: int = 0,
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Several searches at once, each ``(queries, k, scope)`` as :meth:`search` takes
        them; returns each one's ``(scores, ids)``, exactly what :meth:`search` would. A
        backend that can share one pass over its rows among them overrides this (the
        sidecar's dynamic batching); this one runs them one after another."""
        return [self.search(q, k, scope=scope) for q, k, scope in members]

    @abc.abstractmethod
    def _search_rows(
        self, q: np.ndarray, k: int, mask: np.ndarray | None, matched: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """The backend's scan: checked queries q [nq, dim] float32 over the table's rows.

        ``mask`` [n] bool marks the rows a scope filter matched (None: every row), and
        ``matched`` (at least 1) counts them. Returns ``search``'s (scores, ids) [nq, k].
        """

    def _no_results(self, nq: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores, ids) [nq, k] with no result in any slot."""
        return (
            np.full((nq, k), missing_score(self.metric), dtype=np.float32),
            np.full((nq, k), NO_ID, dtype=np.int64),
        )


__all__ = [
    "METRICS",
    "NO_ID",
    "Index",
    "RowIndex",
    "RowTable",
    "ScopeFilter",
    "allow_mask",
    "check_batch",
    "check_config",
    "check_ids",
    "check_k",
    "check_queries",
    "check_scope_filter",
    "check_scopes",
    "check_vectors",
    "grown_capacity",
    "last_occurrences",
    "missing_score",
    "normalise_rows",
    "scope_mask",
]
