"""Exact search through FAISS: spec ``"cpu:faiss-flat"`` (needs ``faiss-cpu``).

The vectors, ids and scopes live in a :class:`~kalos.index.rows.RowTable`, the same dense rows
``"cpu:flat"`` keeps; FAISS scores them in place with the exhaustive kernels its flat indexes
run (``knn_inner_product`` for ``"ip"`` and ``"cosine"``, ``knn_L2sqr`` for ``"l2"``, the very
calls ``IndexFlatIP.search`` and ``IndexFlatL2.search`` make on their own storage). Keeping the
rows ourselves instead of in an ``IndexIDMap2`` lets removal move the last rows into the holes
in place (faiss's ``remove_ids`` shifts every later row, O(n) per call, and renumbers them),
and turns a scope filter into a row bitmap (``IDSelectorBitmap``) the scan checks.

This module imports faiss at import time; :mod:`kalos.index.factory` imports it lazily.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import faiss
import numpy as np

from kalos.errors import ConfigError, ServerError

from .base import (
    NO_ID,
    ScopeFilter,
    check_batch,
    check_config,
    check_ids,
    check_k,
    check_queries,
    check_scope_filter,
    missing_score,
    normalise_rows,
    scope_mask,
)
from .rows import RowTable


@contextmanager
def _faiss_errors(what: str) -> Iterator[None]:
    """Inputs are validated before FAISS sees them, so its RuntimeError is our failure."""
    try:
        yield
    except RuntimeError as exc:
        raise ServerError(f"faiss {what} failed: {exc}") from exc


class FaissFlatIndex:
    """Exact top-k through FAISS's flat kernels. Spec ``"cpu:faiss-flat"``; no options."""

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
        self._table = RowTable(self.dim)  # vectors [capacity, dim], ids, scopes

    def __len__(self) -> int:
        return len(self._table)

    def __repr__(self) -> str:
        return (
            f"FaissFlatIndex(spec={self.spec!r}, dim={self.dim}, metric={self.metric!r},"
            f" n={len(self)})"
        )

    @property
    def nbytes(self) -> int:
        """Bytes allocated for vectors, ids and scopes (capacity, not live)."""
        return self._table.nbytes

    # --- writes ---------------------------------------------------------------------------

    def add(self, vectors: object, ids: object, scopes: object = None) -> None:
        vecs, keys, scope_rows = check_batch(vectors, ids, scopes, self.dim, self.metric)
        self._table.upsert(keys, scope_rows, vecs)

    def remove(self, ids: object) -> int:
        return self._table.remove(check_ids(ids))[0]

    def reset(self) -> None:
        self._table.reset()

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

        selector = None
        matched = n
        if filt is not None:
            mask = scope_mask(self._table.scope_columns, filt)
            matched = int(np.count_nonzero(mask))
            if matched == 0:
                return out_scores, out_ids
            if matched < n:
                bits = np.packbits(mask, bitorder="little")  # IDSelectorBitmap's bit order
                selector = faiss.IDSelectorBitmap(n, faiss.swig_ptr(bits))
        kk = min(k, matched)
        with _faiss_errors("search"):
            dist, rows = self._scan(q, kk, selector)  # [nq, kk] each
        found = rows >= 0
        out_ids[:, :kk] = np.where(found, self._table.ids[np.where(found, rows, 0)], NO_ID)
        out_scores[:, :kk] = np.where(found, dist, missing)  # faiss pads with ±FLT_MAX
        return out_scores, out_ids

    def _scan(
        self, q: np.ndarray, k: int, selector: faiss.IDSelector | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Queries q [nq, dim] → (scores [nq, k] float32, rows [nq, k] int64, -1 unfilled)."""
        stored = self._table.vectors  # [n, dim] C-contiguous
        nq, n = q.shape[0], stored.shape[0]
        dist = np.empty((nq, k), dtype=np.float32)
        rows = np.empty((nq, k), dtype=np.int64)
        args = (faiss.swig_ptr(q), faiss.swig_ptr(stored), self.dim, nq, n, k)
        out = (faiss.swig_ptr(dist), faiss.swig_ptr(rows))
        if self.metric == "l2":
            faiss.knn_L2sqr(*args, *out, None, selector)  # None: no cached |x|²
        else:
            faiss.knn_inner_product(*args, *out, selector)
        return dist, rows

    def reconstruct(self, ids: object) -> np.ndarray:
        return self._table.reconstruct(check_ids(ids))

    def dump(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self._table.dump()


__all__ = ["FaissFlatIndex"]
