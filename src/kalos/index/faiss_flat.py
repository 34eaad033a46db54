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

from kalos.errors import ServerError

from .base import NO_ID, RowIndex, missing_score


@contextmanager
def _faiss_errors(what: str) -> Iterator[None]:
    """Inputs are validated before FAISS sees them, so its RuntimeError is our failure."""
    try:
        yield
    except RuntimeError as exc:
        raise ServerError(f"faiss {what} failed: {exc}") from exc


class FaissFlatIndex(RowIndex):
    """Exact top-k through FAISS's flat kernels. Spec ``"cpu:faiss-flat"``; no options.

    Writes, ``reconstruct`` and ``dump`` are the row table's (:class:`RowIndex`).
    """

    kind = "cpu:faiss-flat"

    def _search_rows(
        self, q: np.ndarray, k: int, mask: np.ndarray | None, matched: int
    ) -> tuple[np.ndarray, np.ndarray]:
        selector = None
        if mask is not None:
            bits = np.packbits(mask, bitorder="little")  # IDSelectorBitmap's bit order
            selector = faiss.IDSelectorBitmap(mask.shape[0], faiss.swig_ptr(bits))
        kk = min(k, matched)
        with _faiss_errors("search"):
            dist, rows = self._scan(q, kk, selector)  # [nq, kk] each
        out_scores, out_ids = self._no_results(q.shape[0], k)
        found = rows >= 0
        out_ids[:, :kk] = np.where(found, self._table.ids[np.where(found, rows, 0)], NO_ID)
        out_scores[:, :kk] = np.where(found, dist, missing_score(self.metric))  # faiss: ±FLT_MAX
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


__all__ = ["FaissFlatIndex"]
