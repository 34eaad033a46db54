"""Exact search through FAISS: spec ``"cpu:faiss-flat"`` (needs ``faiss-cpu``).

The vectors live in a ``faiss.IndexFlatIP`` (``"ip"``, ``"cosine"``) or ``faiss.IndexFlatL2``
(``"l2"``) whose row i is our dense row i; ids and scopes live in a :class:`RowTable`. We keep
our own id mapping instead of ``IndexIDMap2`` so that removal can move the last rows into the
holes in place (faiss's ``remove_ids`` shifts every later row, O(n) per call, and renumbers
them) and so that a scope filter becomes a row bitmap (``IDSelectorBitmap``) the scan checks.
The flat storage is a ``std::vector`` that FAISS grows geometrically on ``add``.

This module imports faiss at import time; :mod:`kalos.index.factory` imports it lazily.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import faiss
import numpy as np

from kalos.errors import ConfigError, NotFound, ServerError

from .base import (
    NO_ID,
    RowTable,
    ScopeFilter,
    check_config,
    check_ids,
    check_k,
    check_queries,
    check_scope_filter,
    check_scopes,
    check_vectors,
    last_occurrences,
    missing_score,
    normalise_rows,
    scope_mask,
)


@contextmanager
def _faiss_errors(what: str) -> Iterator[None]:
    """Inputs are validated before FAISS sees them, so its RuntimeError is our failure."""
    try:
        yield
    except RuntimeError as exc:
        raise ServerError(f"faiss {what} failed: {exc}") from exc


class FaissFlatIndex:
    """Exact top-k through FAISS flat indexes. Spec ``"cpu:faiss-flat"``; no options."""

    def __init__(
        self,
        spec: str = "cpu:faiss-flat",
        *,
        dim: int,
        metric: str = "ip",
        device_index: int | None = None,
        options: tuple[str, ...] = (),
    ) -> None:
        if device_index is not None:
            raise ConfigError(f"{spec!r}: the cpu device takes no index")
        if options:
            raise ConfigError(f"{spec!r}: cpu:faiss-flat takes no options; got {options}")
        self.spec = spec
        self.dim, self.metric = check_config(dim, metric)
        self._table = RowTable()
        self._flat = self._new_flat()

    def _new_flat(self) -> faiss.IndexFlat:
        if self.metric == "l2":
            return faiss.IndexFlatL2(self.dim)
        return faiss.IndexFlatIP(self.dim)

    def __len__(self) -> int:
        return len(self._table)

    def __repr__(self) -> str:
        return (
            f"FaissFlatIndex(spec={self.spec!r}, dim={self.dim}, metric={self.metric!r},"
            f" n={len(self)})"
        )

    @property
    def nbytes(self) -> int:
        """Bytes of the FAISS vector storage (its size; capacity is not exposed) + ids + scopes."""
        return int(self._flat.codes.size()) + self._table.nbytes

    def _stored(self) -> np.ndarray:
        """[ntotal, dim] float32 view of FAISS's own storage; invalid after the next add."""
        n = int(self._flat.ntotal)
        if n == 0:
            return np.empty((0, self.dim), dtype=np.float32)
        return faiss.rev_swig_ptr(self._flat.get_xb(), n * self.dim).reshape(n, self.dim)

    # --- writes ---------------------------------------------------------------------------

    def add(self, vectors: object, ids: object, scopes: object = None) -> None:
        vecs = check_vectors(vectors, self.dim)
        n = vecs.shape[0]
        keys = check_ids(ids, n, storing=True)
        scope_rows = check_scopes(scopes, n)
        if n == 0:
            return
        if self.metric == "cosine":
            vecs = normalise_rows(vecs, "vectors")
        keep = last_occurrences(keys)
        if keep is not None:  # duplicate ids in the batch: the last one wins
            vecs, keys, scope_rows = vecs[keep], keys[keep], scope_rows[keep]
        old_n = len(self._table)
        rows = self._table.upsert(keys, scope_rows)
        present = rows < old_n
        with _faiss_errors("add"):
            if present.any():
                self._stored()[rows[present]] = vecs[present]
            if not present.all():
                # new ids got rows old_n, old_n+1, ... in batch order: one append
                self._flat.add(np.ascontiguousarray(vecs[~present]))

    def remove(self, ids: object) -> int:
        keys = check_ids(ids)
        removed, holes, movers = self._table.remove(keys)
        if removed:
            stored = self._stored()
            stored[holes] = stored[movers]
            new_n = len(self._table)
            with _faiss_errors("remove"):
                # shrink in place: std::vector keeps its capacity, later adds reuse it
                self._flat.codes.resize(new_n * self.dim * 4)
                self._flat.ntotal = new_n
        return removed

    def reset(self) -> None:
        self._table.reset()
        self._flat = self._new_flat()

    # --- reads ----------------------------------------------------------------------------

    def search(
        self, queries: object, k: int, *, scope: ScopeFilter | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        q = check_queries(queries, self.dim)  # [nq, dim] float32
        k = check_k(k)
        filt = check_scope_filter(scope)
        if self.metric == "cosine":
            q = normalise_rows(q, "queries")
        nq = q.shape[0]
        missing = missing_score(self.metric)
        out_scores = np.full((nq, k), missing, dtype=np.float32)
        out_ids = np.full((nq, k), NO_ID, dtype=np.int64)
        n = len(self._table)
        if n == 0:
            return out_scores, out_ids

        params = None
        matched = n
        if filt is not None:
            mask = scope_mask(self._table.scope_columns, filt)
            matched = int(np.count_nonzero(mask))
            if matched == 0:
                return out_scores, out_ids
            if matched < n:
                bits = np.packbits(mask, bitorder="little")  # IDSelectorBitmap's bit order
                selector = faiss.IDSelectorBitmap(n, faiss.swig_ptr(bits))
                params = faiss.SearchParameters()
                params.sel = selector
        kk = min(k, matched)
        with _faiss_errors("search"):
            dist, rows = self._flat.search(q, kk, params=params)  # [nq, kk] each
        found = rows >= 0
        out_ids[:, :kk] = np.where(found, self._table.ids[np.where(found, rows, 0)], NO_ID)
        out_scores[:, :kk] = np.where(found, dist, missing)  # faiss pads with ±FLT_MAX
        return out_scores, out_ids

    def reconstruct(self, ids: object) -> np.ndarray:
        keys = check_ids(ids)
        rows = self._table.rows_of(keys)
        if (rows < 0).any():
            missing = keys[rows < 0]
            raise NotFound(f"{missing.shape[0]} id(s) not in the index, e.g. {int(missing[0])}")
        return self._stored()[rows]  # fancy indexing: a copy

    def dump(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return (
            self._table.ids.copy(),
            self._stored().copy(),
            np.ascontiguousarray(self._table.scope_columns.T),
        )


__all__ = ["FaissFlatIndex"]
