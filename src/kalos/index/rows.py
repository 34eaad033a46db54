"""Dense row storage shared by the CPU backends: vectors, ids, scopes and the id → row map.

Live items sit in rows ``0..n-1`` of preallocated arrays whose capacity grows by doubling, so
adding n items costs amortised O(n) copying and a scan is one pass over contiguous memory that
never meets a hole: removal moves the last live rows into the holes. A backend keeps only how it
scores these rows (numpy BLAS, FAISS) and any per-row data of its own, which it moves with the
``holes``/``movers`` that :meth:`RowTable.remove` returns and sizes to :attr:`RowTable.capacity`.

This module imports numpy only.
"""

from __future__ import annotations

import numpy as np

from kalos.errors import NotFound

MIN_CAPACITY = 64
"""The first allocation holds this many rows."""


def grown_capacity(current: int, need: int) -> int:
    """Capacity after growing to hold ``need`` rows: at least double, at least MIN_CAPACITY."""
    return max(need, 2 * current, MIN_CAPACITY)


class RowTable:
    """Live items in dense rows ``0..n-1``: vectors, ids and scopes, plus the id → row map.

    ``dim`` is the vector width; ``dim=0`` keeps ids and scopes only (a table of who owns what,
    as the memory store keeps). Vectors are stored as given: validation and cosine
    normalisation happen before :meth:`upsert` (see :func:`kalos.index.base.check_batch`).
    """

    def __init__(self, dim: int = 0) -> None:
        self.dim = dim
        self._row_of: dict[int, int] = {}
        self._n = 0
        self._ids = np.empty(0, dtype=np.int64)  # [capacity]
        self._scopes = np.empty((3, 0), dtype=np.int64)  # [3, capacity]: one row per field
        self._vectors = np.empty((0, dim), dtype=np.float32)  # [capacity, dim]
        # (live ids sorted, the row of each): built by rows_of_many, dropped when rows move
        self._sorted: tuple[np.ndarray, np.ndarray] | None = None

    def __len__(self) -> int:
        return self._n

    @property
    def capacity(self) -> int:
        """Rows allocated (live or not); per-row arrays of a backend grow to this."""
        return int(self._ids.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes allocated for vectors, ids and scopes (capacity, not live)."""
        return int(self._ids.nbytes + self._scopes.nbytes + self._vectors.nbytes)

    @property
    def ids(self) -> np.ndarray:
        """ids [n] int64 of the live rows (a view)."""
        return self._ids[: self._n]

    @property
    def scope_columns(self) -> np.ndarray:
        """[3, n] int64 view: tenant, user and session of every live row."""
        return self._scopes[:, : self._n]

    @property
    def vectors(self) -> np.ndarray:
        """[n, dim] float32 C-contiguous view of the live rows; invalid after the next write."""
        return self._vectors[: self._n]

    # --- lookups --------------------------------------------------------------------------

    def rows_of(self, ids: np.ndarray) -> np.ndarray:
        """rows [n] int64 of ids [n]; -1 where the id is not present."""
        get = self._row_of.get
        return np.fromiter((get(i, -1) for i in ids.tolist()), dtype=np.int64, count=len(ids))

    def rows_of_many(self, ids: np.ndarray) -> np.ndarray:
        """rows [m] int64 of the ones of ids [m] that are present (the others left out), with
        no Python per id: a binary search in the live ids sorted once (n log n, redone only
        after a write that added or moved rows)."""
        if self._sorted is None:
            order = np.argsort(self.ids, kind="stable")
            self._sorted = self.ids[order], order.astype(np.int64)
        keys, rows = self._sorted
        if keys.shape[0] == 0:
            return np.empty(0, np.int64)
        pos = np.minimum(np.searchsorted(keys, ids), keys.shape[0] - 1)
        return rows[pos[keys[pos] == ids]]

    def reconstruct(self, ids: np.ndarray) -> np.ndarray:
        """Stored vectors of ids [m] as [m, dim] float32, a copy; NotFound for unknown ids."""
        rows = self.rows_of(ids)
        if (rows < 0).any():
            missing = ids[rows < 0]
            raise NotFound(f"{missing.shape[0]} id(s) not in the index, e.g. {int(missing[0])}")
        return self._vectors[rows]  # fancy indexing: a copy

    def dump(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Copies of all live items: (ids [n] int64, vectors [n, dim] float32, scopes [n, 3])."""
        return self.ids.copy(), self.vectors.copy(), np.ascontiguousarray(self.scope_columns.T)

    # --- writes ---------------------------------------------------------------------------

    def upsert(
        self, ids: np.ndarray, scopes: np.ndarray, vectors: np.ndarray | None = None
    ) -> np.ndarray:
        """Place unique ids [m] with scopes [m, 3] and vectors [m, dim]; returns the row of each.

        Ids already present keep their row (their scope and vector are replaced); new ids take
        rows ``n, n+1, ...`` in batch order. ``vectors=None`` leaves the vector rows as they
        are (for ``dim=0``).
        """
        rows = self.rows_of(ids)
        new = rows < 0
        n_new = int(new.sum())
        if n_new:
            self._sorted = None
            first = self._n
            self._reserve(first + n_new)
            rows[new] = np.arange(first, first + n_new, dtype=np.int64)
            new_ids = ids[new]
            self._ids[first : first + n_new] = new_ids
            self._row_of.update(zip(new_ids.tolist(), range(first, first + n_new), strict=True))
            self._n = first + n_new
        self._scopes[:, rows] = scopes.T
        if vectors is not None:
            self._vectors[rows] = vectors
        return rows

    def remove(self, ids: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
        """Drop ids [m] (unknown ones ignored) → (how many were present, holes, movers).

        Vectors, ids and scopes of row ``movers[i]`` are moved into row ``holes[i]`` here; a
        backend with per-row data of its own moves it the same way. After that, rows
        ``0..len(self)-1`` are the live ones.
        """
        pop = self._row_of.pop
        unique = np.unique(ids)
        gone = np.fromiter((pop(i, -1) for i in unique.tolist()), np.int64, unique.shape[0])
        gone = gone[gone >= 0]
        if gone.shape[0] == 0:
            empty = np.empty(0, dtype=np.int64)
            return 0, empty, empty
        self._sorted = None
        old_n = self._n
        new_n = old_n - gone.shape[0]
        holes = gone[gone < new_n]
        tail_free = np.ones(old_n - new_n, dtype=bool)
        tail_free[gone[gone >= new_n] - new_n] = False
        movers = np.flatnonzero(tail_free) + new_n  # live rows beyond the new end, ascending
        holes.sort()
        self._ids[holes] = self._ids[movers]
        self._scopes[:, holes] = self._scopes[:, movers]
        self._vectors[holes] = self._vectors[movers]
        self._row_of.update(zip(self._ids[holes].tolist(), holes.tolist(), strict=True))
        self._n = new_n
        return int(gone.shape[0]), holes, movers

    def reset(self) -> None:
        """Remove every item and free the storage."""
        self._row_of = {}
        self._sorted = None
        self._n = 0
        self._ids = np.empty(0, dtype=np.int64)
        self._scopes = np.empty((3, 0), dtype=np.int64)
        self._vectors = np.empty((0, self.dim), dtype=np.float32)

    def _reserve(self, need: int) -> None:
        if need <= self.capacity:
            return
        capacity = grown_capacity(self.capacity, need)
        n = self._n
        ids = np.empty(capacity, dtype=np.int64)
        ids[:n] = self._ids[:n]
        scopes = np.empty((3, capacity), dtype=np.int64)
        scopes[:, :n] = self._scopes[:, :n]
        vectors = np.empty((capacity, self.dim), dtype=np.float32)
        vectors[:n] = self._vectors[:n]
        self._ids, self._scopes, self._vectors = ids, scopes, vectors


__all__ = ["MIN_CAPACITY", "RowTable", "grown_capacity"]
