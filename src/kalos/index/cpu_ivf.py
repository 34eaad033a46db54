"""Approximate search in numpy: an inverted-file index, spec ``"cpu:ivf,nlist=N[,nprobe=P]"``.

The rows live in the same dense :class:`~kalos.index.rows.RowTable` as ``"cpu:flat"``. On top,
``nlist`` centroids partition them: every row belongs to the list of its nearest centroid, and
a search scores exactly (float32) only the rows of the ``nprobe`` lists whose centroids score
best against the query, then takes their top-k. Cost and recall both follow ``nprobe / nlist``;
``nprobe = nlist`` scores every row and is exact.

Training (the rule, :data:`TRAIN_ROWS_PER_LIST`): until the index first holds ``39 * nlist``
rows it has no centroids and every search is exact (the flat scan). The add that reaches that
size trains it: k-means (seeded, :data:`KMEANS_ITERS` rounds) on a random sample of at most
:data:`SAMPLE_ROWS_PER_LIST` ``* nlist`` rows, then every row is assigned to its list.

Rebalancing: rows added later go to the list of their nearest centroid, and removed rows leave
their list; the centroids stay. Once the index holds :data:`RETRAIN_GROWTH` (4) times the rows
it was trained with, the add that crosses that size trains it again on a sample of all rows and
reassigns every row (the cost is amortised: each retrain follows a 4x growth).
:meth:`CpuIvfIndex.train` retrains explicitly (after a large shift in the data, say).

Metrics: for ``"ip"`` and ``"cosine"`` the centroids are unit vectors (spherical k-means) and
the lists probed are those of the largest inner product with the query; for ``"l2"`` the
nearest centroids. Filters (a scope, ``allow``) restrict the rows scored to the probed lists'
rows they match; when those are fewer than k (and more match elsewhere), the search probes the
next lists in centroid order, doubling the count, until it has k rows to rank or has probed
every list. So a search returns ``min(k, rows matched)`` results whatever the filter.

``nprobe`` per request: ``search(..., nprobe=P)`` (and ``search_many``) override the spec's
setting for that call; 0 means the spec's; a value above ``nlist`` probes every list.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np

from kalos.errors import ConfigError, InvalidRequest

from .base import ScopeFilter, check_batch, check_ids
from .cpu_flat import CpuFlatIndex, top_k_1d

TRAIN_ROWS_PER_LIST = 39
"""The index trains at the first add that brings it to ``39 * nlist`` rows (faiss's minimum
sample per centroid); searches are exact before that."""
SAMPLE_ROWS_PER_LIST = 64
"""k-means runs on a random sample of at most this many rows per list."""
KMEANS_ITERS = 12
"""Rounds of k-means (assign, then move each centroid to its rows' mean)."""
RETRAIN_GROWTH = 4
"""The index trains again once it holds this many times the rows it was trained with."""
FLAT_ABOVE = 0.15
"""A search whose probed lists hold more than this share of the rows scans every row instead
(gathering scattered rows costs more than one matrix-vector product over all of them:
measured on the 2-core VM, clustered 100K x 128 in 1,024 lists, before this rule, probing
128 lists took 2.0 ms p50, 256 lists 4.3 ms, the scan of every row 2.7 ms)."""
DEFAULT_NPROBE = 16
"""Lists probed when the spec gives no ``nprobe`` (at most ``nlist``)."""
KMEANS_SEED = 20261205
ASSIGN_CHUNK = 1 << 15
"""Rows assigned to lists per matrix product (a [chunk, nlist] float32 score block)."""


def parse_ivf_options(spec: str, options: tuple[str, ...]) -> tuple[int, int]:
    """``("nlist=N", "nprobe=P")`` of an ivf spec -> (nlist, nprobe). ``nlist`` is required;
    ``nprobe`` defaults to min(nlist, DEFAULT_NPROBE). ConfigError for anything else."""
    values: dict[str, int] = {}
    for opt in options:
        name, eq, value = opt.partition("=")
        if name not in ("nlist", "nprobe") or not eq:
            raise ConfigError(
                f"option {opt!r} in {spec!r}: an ivf index takes nlist=N and nprobe=P"
            )
        if name in values:
            raise ConfigError(f"bad index spec {spec!r}: {name!r} given twice")
        if not value.isdigit() or int(value) < 1:
            raise ConfigError(f"bad index spec {spec!r}: {name}= takes a whole number >= 1")
        values[name] = int(value)
    if "nlist" not in values:
        raise ConfigError(
            f"index spec {spec!r} needs nlist=N, the number of lists (about 4 * sqrt(rows):"
            " e.g. 'cpu:ivf,nlist=1024' for 100K rows)"
        )
    nlist = values["nlist"]
    if nlist > 1 << 22:
        raise ConfigError(f"bad index spec {spec!r}: nlist is at most {1 << 22}")
    nprobe = min(values.get("nprobe", DEFAULT_NPROBE), nlist)
    return nlist, nprobe


def check_nprobe(nprobe: object) -> int:
    """A request's ``nprobe``: an integer >= 0 (0: the index's own setting). InvalidRequest
    otherwise."""
    if isinstance(nprobe, bool) or not isinstance(nprobe, (int, np.integer)):
        raise InvalidRequest(f"nprobe must be an integer; got {nprobe!r}")
    if nprobe < 0:
        raise InvalidRequest(f"nprobe must be 0 (the index's setting) or more; got {nprobe}")
    return int(nprobe)


def train_size(nlist: int) -> int:
    """Rows at which an index of ``nlist`` lists first trains."""
    return TRAIN_ROWS_PER_LIST * nlist


def sample_rows(n: int, nlist: int, rng: np.random.Generator) -> np.ndarray:
    """Sorted positions [m] of the k-means sample among n rows."""
    m = min(n, SAMPLE_ROWS_PER_LIST * nlist)
    if m == n:
        return np.arange(n)
    return np.sort(rng.choice(n, size=m, replace=False))


def kmeans(sample: np.ndarray, nlist: int, spherical: bool, seed: int) -> np.ndarray:
    """Centroids [nlist, dim] float32 of sample [m, dim] float32 (m >= nlist): seeded k-means.

    ``spherical``: centroids renormalised to unit length each round, rows assigned by the
    largest inner product (ip, cosine); else by the smallest squared distance. A list left
    empty takes a random sample row (so every centroid stays in use)."""
    rng = np.random.default_rng(seed)
    m = sample.shape[0]
    centroids = sample[rng.choice(m, size=nlist, replace=False)].copy()
    if spherical:
        centroids = _unit(centroids)
    for _ in range(KMEANS_ITERS):
        assign = assign_lists(sample, centroids, spherical)
        counts = np.bincount(assign, minlength=nlist)
        starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
        full = counts > 0
        # each list's sum: its rows contiguous (sorted by list), one reduceat over them
        by_list = sample[np.argsort(assign, kind="stable")]
        sums = np.add.reduceat(by_list, starts[full], axis=0, dtype=np.float64)
        centroids[full] = (sums / counts[full][:, None]).astype(np.float32)
        empty = ~full
        if empty.any():
            centroids[empty] = sample[rng.choice(m, size=int(empty.sum()), replace=False)]
        if spherical:
            centroids = _unit(centroids)
    return np.ascontiguousarray(centroids, dtype=np.float32)


def _unit(x: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return (x / np.where(norms > 0, norms, 1)).astype(np.float32)


def assign_lists(vectors: np.ndarray, centroids: np.ndarray, spherical: bool) -> np.ndarray:
    """The list [n] int64 of each of vectors [n, dim]: its best centroid, in chunks."""
    out = np.empty(vectors.shape[0], dtype=np.int64)
    half = None if spherical else 0.5 * np.einsum("ij,ij->i", centroids, centroids)
    for lo in range(0, vectors.shape[0], ASSIGN_CHUNK):
        block = vectors[lo : lo + ASSIGN_CHUNK] @ centroids.T  # [chunk, nlist]
        if half is not None:
            block -= half
        out[lo : lo + block.shape[0]] = np.argmax(block, axis=1)
    return out


class CpuIvfIndex(CpuFlatIndex):
    """Top-k over the rows of the lists nearest the query (see the module doc).

    Spec ``"cpu:ivf,nlist=N[,nprobe=P]"``. Writes, ``reconstruct`` and ``dump`` are the row
    table's; the lists hold row positions and follow the rows as they move."""

    kind = "cpu:ivf"
    _centroids: np.ndarray | None  # [nlist, dim] float32; None until trained
    _half_c: np.ndarray | None  # [nlist] float32 |c|²/2 (l2)
    _members: list[np.ndarray]  # per list: row positions (the first _sizes[list] live)
    _sizes: np.ndarray  # [nlist] int64
    _assign: np.ndarray  # [capacity] int64, the list of each row (-1: none)
    _slot: np.ndarray  # [capacity] int64, its position in that list

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
        self.nlist, self.nprobe = parse_ivf_options(spec, options)
        self.trained_rows = 0  # rows the index held when it last trained (0: untrained)
        self.trainings = 0
        super().__init__(spec, dim=dim, metric=metric, device_index=device_index)

    @property
    def is_trained(self) -> bool:
        return self._centroids is not None

    @property
    def nbytes(self) -> int:
        lists = sum(m.nbytes for m in self._members) + self._sizes.nbytes
        per_row = self._assign.nbytes + self._slot.nbytes
        centroids = 0 if self._centroids is None else self._centroids.nbytes
        return int(super().nbytes + lists + per_row + centroids)

    def list_sizes(self) -> np.ndarray:
        """Rows in each list [nlist] int64 (all zeros before training)."""
        return self._sizes.copy()

    # --- writes ---------------------------------------------------------------------------

    def reset(self) -> None:
        super().reset()
        self._centroids = None
        self._half_c = None
        self._members = [np.empty(0, np.int64) for _ in range(self.nlist)]
        self._sizes = np.zeros(self.nlist, dtype=np.int64)
        self._assign = np.empty(0, dtype=np.int64)
        self._slot = np.empty(0, dtype=np.int64)
        self.trained_rows = 0

    def add(self, vectors: object, ids: object, scopes: object = None) -> None:
        vecs, keys, scope_rows = check_batch(vectors, ids, scopes, self.dim, self.metric)
        before = len(self._table)
        rows = self._table.upsert(keys, scope_rows, vecs)
        self._follow_capacity()
        if self.metric == "l2":
            self._half_sqnorms[rows] = 0.5 * np.einsum("ij,ij->i", vecs, vecs)
        n = len(self._table)
        if self._centroids is None:
            if n >= train_size(self.nlist):
                self.train()
            return
        if n >= RETRAIN_GROWTH * self.trained_rows:
            self.train()
            return
        replaced = rows[rows < before]  # upserts: their vector changed, so may their list
        if replaced.shape[0]:
            self._lists_drop(replaced)
        self._lists_add(rows, assign_lists(vecs, self._centroids, self.metric != "l2"))

    def remove(self, ids: object) -> int:
        keys = check_ids(ids)
        if self._centroids is not None and len(self._table):
            rows = self._table.rows_of(np.unique(keys))
            rows = rows[rows >= 0]
            if rows.shape[0]:
                self._lists_drop(rows)
        removed, holes, movers = self._table.remove(keys)
        if holes.shape[0]:
            if self.metric == "l2":
                self._half_sqnorms[holes] = self._half_sqnorms[movers]
            if self._centroids is not None:
                self._lists_move(holes, movers)
        return removed

    def train(self) -> None:
        """k-means on a sample of the rows (module doc), then every row assigned to its
        list. InvalidRequest with fewer rows than lists."""
        n = len(self._table)
        if n < self.nlist:
            raise InvalidRequest(
                f"training {self.nlist} lists needs at least as many rows; got {n}"
            )
        spherical = self.metric != "l2"
        rng = np.random.default_rng(KMEANS_SEED + self.trainings)
        vectors = self._table.vectors
        sample = vectors[sample_rows(n, self.nlist, rng)]
        centroids = kmeans(sample, self.nlist, spherical, KMEANS_SEED + self.trainings)
        self._centroids = centroids
        self._half_c = None if spherical else 0.5 * np.einsum("ij,ij->i", centroids, centroids)
        self._members = [np.empty(0, np.int64) for _ in range(self.nlist)]
        self._sizes[:] = 0
        self._lists_add(np.arange(n, dtype=np.int64), assign_lists(vectors, centroids, spherical))
        self.trained_rows = n
        self.trainings += 1

    def _follow_capacity(self) -> None:
        super()._follow_capacity()
        capacity = self._table.capacity
        if self._assign.shape[0] < capacity:
            for name in ("_assign", "_slot"):
                old = getattr(self, name)
                grown = np.full(capacity, -1, dtype=np.int64)
                grown[: old.shape[0]] = old
                setattr(self, name, grown)

    def _by_list(self, rows: np.ndarray, lists: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
        """(list, its rows) for rows [m] grouped by lists [m]."""
        order = np.argsort(lists, kind="stable")
        rows, lists = rows[order], lists[order]
        cut = np.flatnonzero(np.diff(lists)) + 1
        for part_rows, first in zip(
            np.split(rows, cut), lists[np.concatenate(([0], cut))].tolist(), strict=True
        ):
            yield int(first), part_rows

    def _lists_add(self, rows: np.ndarray, lists: np.ndarray) -> None:
        """Append rows [m] to lists [m] (rows not in any list now)."""
        if rows.shape[0] == 0:
            return
        self._assign[rows] = lists
        for lst, part in self._by_list(rows, lists):
            size = int(self._sizes[lst])
            need = size + part.shape[0]
            members = self._members[lst]
            if need > members.shape[0]:
                grown = np.empty(max(need, 2 * members.shape[0], 8), dtype=np.int64)
                grown[:size] = members[:size]
                self._members[lst] = members = grown
            members[size:need] = part
            self._slot[part] = np.arange(size, need)
            self._sizes[lst] = need

    def _lists_drop(self, rows: np.ndarray) -> None:
        """Take rows [m] (each in a list) out of their lists, keeping the others' order."""
        for lst, part in self._by_list(rows, self._assign[rows]):
            size = int(self._sizes[lst])
            members = self._members[lst]
            keep = np.ones(size, dtype=bool)
            keep[self._slot[part]] = False
            kept = members[:size][keep]
            members[: kept.shape[0]] = kept
            self._slot[kept] = np.arange(kept.shape[0])
            self._sizes[lst] = kept.shape[0]
        self._assign[rows] = -1

    def _lists_move(self, holes: np.ndarray, movers: np.ndarray) -> None:
        """The table moved row movers[i] into holes[i]: the lists follow."""
        lists = self._assign[movers]
        slots = self._slot[movers]
        for lst, idx in self._by_list(np.arange(holes.shape[0]), lists):
            self._members[lst][slots[idx]] = holes[idx]
        self._assign[holes] = lists
        self._slot[holes] = slots

    # --- reads ----------------------------------------------------------------------------

    def search(
        self,
        queries: object,
        k: int,
        *,
        scope: ScopeFilter | None = None,
        allow: np.ndarray | None = None,
        nprobe: int = 0,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Top-k of the probed lists' rows (module doc); ``nprobe`` 0: the spec's."""
        probes = self._probes(nprobe)
        q, k, mask, matched = self._checked(queries, k, scope, allow)
        if matched == 0:
            return self._no_results(q.shape[0], k)
        if self._centroids is None:
            return self._search_rows(q, k, mask, matched)  # untrained: the exact flat scan
        kk = min(k, matched)
        nq = q.shape[0]
        if kk == k:
            out_scores, out_ids = np.empty((nq, k), np.float32), np.empty((nq, k), np.int64)
        else:
            out_scores, out_ids = self._no_results(nq, k)
        for i in range(nq):
            rows, best = self._probe_one(self._centroids, q[i], kk, mask, probes)
            out_ids[i, :kk] = self._table.ids[rows]
            out_scores[i, :kk] = best
        return out_scores, out_ids

    def search_many(
        self,
        members: Sequence[tuple[object, int, ScopeFilter | None]],
        *,
        nprobe: int = 0,
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each member ``(queries, k, scope)`` searched as :meth:`search` would, one after
        another (each probes its own lists)."""
        return [self.search(q, k, scope=scope, nprobe=nprobe) for q, k, scope in members]

    def _probes(self, nprobe: object) -> int:
        probes = check_nprobe(nprobe)
        return min(self.nprobe if probes == 0 else probes, self.nlist)

    def _probe_one(
        self, centroids: np.ndarray, q: np.ndarray, k: int, mask: np.ndarray | None, probes: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """One query q [dim] over the rows of its best lists -> (rows [k], scores [k]), best
        first. k <= the rows matched, so the widening probe always finds k rows. When the
        lists probed hold more than FLAT_ABOVE of the rows, the flat scan of every row
        answers instead: faster there, and exact."""
        cscores = centroids @ q  # [nlist]
        if self._half_c is not None:
            cscores -= self._half_c
        n = len(self._table)
        while True:
            if probes < self.nlist:
                best = np.argpartition(-cscores, probes - 1)[:probes]
            else:
                best = np.arange(self.nlist)
            if int(self._sizes[best].sum()) > FLAT_ABOVE * n:
                return self._scan_one(q, k, None, None if mask is None else ~mask)
            rows = self._rows_of_lists(best)
            if mask is not None:
                rows = rows[mask[rows]]
            if rows.shape[0] >= k or probes >= self.nlist:
                break
            probes = min(self.nlist, 2 * probes)
        scores = self._table.vectors[rows] @ q  # [m] exact float32
        if self.metric == "l2":
            scores -= self._half_sqnorms[rows]
        pos = top_k_1d(scores, k)
        return self._finish_one(q, rows[pos], scores[pos])

    def _rows_of_lists(self, lists: np.ndarray) -> np.ndarray:
        """Row positions [m] of every row in lists [p]."""
        parts = [self._members[lst][: self._sizes[lst]] for lst in lists.tolist()]
        return np.concatenate(parts) if parts else np.empty(0, np.int64)

    def __repr__(self) -> str:
        return (
            f"CpuIvfIndex(spec={self.spec!r}, dim={self.dim}, metric={self.metric!r},"
            f" n={len(self)}, nlist={self.nlist}, nprobe={self.nprobe},"
            f" trained={self.is_trained})"
        )


def suggested_nlist(n: int) -> int:
    """About 4 * sqrt(n) lists for n rows, a power of two (the common starting point)."""
    return 1 << max(0, round(math.log2(max(1.0, 4 * math.sqrt(n)))))


__all__ = [
    "DEFAULT_NPROBE",
    "RETRAIN_GROWTH",
    "TRAIN_ROWS_PER_LIST",
    "CpuIvfIndex",
    "assign_lists",
    "check_nprobe",
    "kmeans",
    "parse_ivf_options",
    "suggested_nlist",
    "train_size",
]
