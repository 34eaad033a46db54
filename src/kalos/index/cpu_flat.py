"""Exact search in numpy: spec ``"cpu:flat"``.

Vectors sit in the float32 matrix ``[capacity, dim]`` of a :class:`~kalos.index.rows.RowTable`,
whose first ``len(index)`` rows are live (removal moves the last rows into the holes), so a
search is one BLAS matrix-vector product over contiguous memory followed by a top-k selection
of the winners only. This module keeps the scoring; the table keeps the rows.

Top-k selection, measured on the 2-core CI VM (100K float32 scores): ``np.argpartition`` over
all of them took ~0.8 ms, as long as a third of the product itself; taking a threshold from a
1/32 strided sample first (:func:`top_k_1d`) and partitioning only the few scores above it takes
~0.05 ms and stays exact. Rows too few for the sample (fewer than 256 × k) are partitioned whole,
which for several queries (a search's, or a batch's unfiltered members of one k) is one call
over all of them (:func:`top_k_2d`). The backend comparison that made this ``"cpu:flat"`` is in
``bench/results/index-cpu-choice-ci-2core.json``.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import groupby

import numpy as np

from .base import RowIndex, ScopeFilter, check_batch, check_ids

SAMPLE_STRIDE = 32
"""Top-k takes its threshold from every 32nd score (about 32*k candidates survive)."""
GATHER_BELOW = 0.25
"""A scope filter matching fewer than this share of items scans only those rows."""
SMALL_BATCH = 16
"""Batches of up to this many queries score as rows @ queries.T (see CpuFlatIndex)."""
BATCH_SCORE_BYTES = 64 << 20
"""Queries are scored in blocks whose [block, n] float32 score matrix stays under 64 MiB."""


def top_k_1d(scores: np.ndarray, k: int) -> np.ndarray:
    """Positions of the k largest of scores [m] (k <= m), best first. Exact.

    The k-th largest of any subset is a lower bound for the k-th largest of the whole, so
    every score at or above the k-th largest of a strided sample is a candidate and no
    winner is lost; only the candidates are partitioned, and only the k winners sorted.
    """
    m = scores.shape[0]
    if m >= SAMPLE_STRIDE * 8 * k:
        sample = scores[::SAMPLE_STRIDE]
        threshold = np.partition(sample, sample.shape[0] - k)[sample.shape[0] - k]
        candidates = np.flatnonzero(scores >= threshold)
        if candidates.shape[0] > k:
            picked = np.argpartition(scores[candidates], candidates.shape[0] - k)
            candidates = candidates[picked[candidates.shape[0] - k :]]
    elif k < m:
        candidates = np.argpartition(scores, m - k)[m - k :]
    else:
        candidates = np.arange(m)
    return candidates[np.argsort(-scores[candidates], kind="stable")]


def top_k_2d(scores: np.ndarray, k: int) -> np.ndarray:
    """Positions [b, k] of the k largest per row of scores [b, m] (k <= m), best first."""
    m = scores.shape[1]
    if k < m:
        part = np.argpartition(scores, m - k, axis=1)[:, m - k :]
    else:
        part = np.broadcast_to(np.arange(m), scores.shape)
    order = np.argsort(-np.take_along_axis(scores, part, axis=1), axis=1, kind="stable")
    return np.take_along_axis(part, order, axis=1)


class CpuFlatIndex(RowIndex):
    """Exact top-k over float32 vectors in numpy (BLAS). Spec ``"cpu:flat"``; no options."""

    kind = "cpu:flat"
    # l2 ranks by q·x - |x|²/2 (same order as |q - x|², one product instead of a difference)
    _half_sqnorms: np.ndarray  # [capacity] float32, l2 only
    _scores: np.ndarray  # [capacity] float32 scratch for nq == 1
    _batch_scores: np.ndarray  # [B * n] float32 scratch for search_many

    @property
    def nbytes(self) -> int:
        """Bytes allocated for vectors, ids, scopes and per-row scratch (capacity, not live)."""
        scratch = self._scores.nbytes + self._batch_scores.nbytes
        return int(self._table.nbytes + self._half_sqnorms.nbytes + scratch)

    # --- writes ---------------------------------------------------------------------------

    def add(self, vectors: object, ids: object, scopes: object = None) -> None:
        vecs, keys, scope_rows = check_batch(vectors, ids, scopes, self.dim, self.metric)
        rows = self._table.upsert(keys, scope_rows, vecs)
        self._follow_capacity()
        if self.metric == "l2":
            self._half_sqnorms[rows] = 0.5 * np.einsum("ij,ij->i", vecs, vecs)

    def remove(self, ids: object) -> int:
        removed, holes, movers = self._table.remove(check_ids(ids))
        if holes.shape[0] and self.metric == "l2":
            self._half_sqnorms[holes] = self._half_sqnorms[movers]
        return removed

    def reset(self) -> None:
        super().reset()
        self._half_sqnorms = np.empty(0, dtype=np.float32)
        self._scores = np.empty(0, dtype=np.float32)
        self._batch_scores = np.empty(0, dtype=np.float32)  # search_many's [B, n] scratch

    def _follow_capacity(self) -> None:
        """Grow the per-row arrays of this backend to the table's capacity (which doubles)."""
        capacity = self._table.capacity
        if self._scores.shape[0] >= capacity:
            return
        if self.metric == "l2":
            half = np.empty(capacity, dtype=np.float32)
            half[: self._half_sqnorms.shape[0]] = self._half_sqnorms
            self._half_sqnorms = half
        self._scores = np.empty(capacity, dtype=np.float32)

    # --- reads ----------------------------------------------------------------------------

    def _search_rows(
        self, q: np.ndarray, k: int, mask: np.ndarray | None, matched: int
    ) -> tuple[np.ndarray, np.ndarray]:
        nq = q.shape[0]
        n = len(self._table)
        # rows: the candidate rows when a selective scope filter narrows the scan, else None
        rows: np.ndarray | None = None
        reject: np.ndarray | None = None  # [n] bool, rows to exclude from a full scan
        if mask is not None:
            if matched < GATHER_BELOW * n:
                rows = np.flatnonzero(mask)
            else:
                reject = ~mask
        if nq > 1 and rows is None and nq * n * 4 <= BATCH_SCORE_BYTES:
            # One GEMM into the scratch, then each query's sampled top-k: at 100K x 384, 64
            # queries take 91 ms against 340 with top_k_2d's argpartition over [64, n].
            scores = self._shared_scores(q)
            if reject is not None:
                scores[:, reject] = -np.inf
            return self._take_top_k(q, k, scores, matched)
        kk = min(k, matched)
        if kk == k:  # every slot gets a result
            out_scores, out_ids = np.empty((nq, k), np.float32), np.empty((nq, k), np.int64)
        else:
            out_scores, out_ids = self._no_results(nq, k)

        if nq == 1:
            winners, best = self._scan_one(q[0], kk, rows, reject)
            out_ids[0, :kk] = self._table.ids[winners]
            out_scores[0, :kk] = best
        else:
            block = max(1, BATCH_SCORE_BYTES // (4 * (n if rows is None else rows.shape[0])))
            for start in range(0, nq, block):
                stop = min(nq, start + block)
                winners2, best2 = self._scan_block(q[start:stop], kk, rows, reject)
                out_ids[start:stop, :kk] = self._table.ids[winners2]
                out_scores[start:stop, :kk] = best2
        return out_scores, out_ids

    def search_many(
        self,
        members: Sequence[tuple[object, int, ScopeFilter | None]],
        *,
        nprobe: int = 0,
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Several searches in one pass over the rows (the sidecar's dynamic batching).

        Every member that scans all rows (no filter, or one matching at least GATHER_BELOW
        of them) shares one GEMM: their queries stacked [B, dim] against the rows, in blocks
        whose score matrix stays under BATCH_SCORE_BYTES. Each member then takes its own
        top-k from its own rows of the scores, its filter's rejects set to -inf first. A
        selective filter's member scans the rows it matched, as :meth:`search` does. Each
        answer is what :meth:`search` would return for it alone (the same scores up to
        float32 rounding of the product's order)."""
        results: list[tuple[np.ndarray, np.ndarray] | None] = [None] * len(members)
        n = len(self._table)
        block = max(1, BATCH_SCORE_BYTES // (4 * n)) if n else 1
        # (member, queries [nq, dim], k, rows to reject [n] bool or None, rows matched)
        shared: list[tuple[int, np.ndarray, int, np.ndarray | None, int]] = []
        for i, (queries, k, scope) in enumerate(members):
            q, k, mask, matched = self._checked(queries, k, scope)
            if matched == 0:
                results[i] = self._no_results(q.shape[0], k)
            elif (mask is not None and matched < GATHER_BELOW * n) or q.shape[0] > block:
                results[i] = self._search_rows(q, k, mask, matched)
            else:
                shared.append((i, q, k, None if mask is None else ~mask, matched))
        start = 0
        while start < len(shared):
            stop, rows = start, 0
            while stop < len(shared) and rows + shared[stop][1].shape[0] <= block:
                rows += shared[stop][1].shape[0]
                stop += 1
            group = shared[start:stop]
            scores = self._shared_scores(np.concatenate([m[1] for m in group]))  # [B, n]
            at = 0
            # consecutive members without a filter and of one k select their rows together
            # (one call for all of them where the rows are short: _take_top_k)
            for _, members_run in groupby(
                group, key=lambda m: (m[2], None if m[3] is None else m[0])
            ):
                run = list(members_run)
                taken = sum(m[1].shape[0] for m in run)
                mine = scores[at : at + taken]
                at += taken
                reject = run[0][3]
                if reject is not None:
                    mine[:, reject] = -np.inf
                q = run[0][1] if len(run) == 1 else np.concatenate([m[1] for m in run])
                top_scores, top_ids = self._take_top_k(q, run[0][2], mine, run[0][4])
                r = 0
                for i, mq, *_ in run:
                    results[i] = (top_scores[r : r + mq.shape[0]], top_ids[r : r + mq.shape[0]])
                    r += mq.shape[0]
            start = stop
        return results  # type: ignore[return-value]

    def _shared_scores(self, q: np.ndarray) -> np.ndarray:
        """Scores [B, n] float32 of queries q [B, dim] against every row (one GEMM), in a
        scratch matrix reused by the next batch (no page faults on a fresh 25 MB a batch).

        Up to SMALL_BATCH queries the product is rows @ q.T ([n, B], returned transposed:
        each query's scores strided): OpenBLAS then streams the rows once instead of packing
        them, measured on the 2-core VM at 100K x 384: 8 queries 32 ms against 51-59 for
        q @ rows.T (one query alone, a GEMV: 14). Above it the strided top-k costs more than
        the product saves (64 queries: 70 ms of top-k against 8.5 over contiguous scores)."""
        n = len(self._table)
        b = q.shape[0]
        need = b * n
        if self._batch_scores.shape[0] < need:
            self._batch_scores = np.empty(need, dtype=np.float32)
        # a query of huge (finite) values overflows its own scores only, as it would alone
        with np.errstate(over="ignore", invalid="ignore"):
            if b <= SMALL_BATCH:
                by_row = self._batch_scores[:need].reshape(n, b)
                np.matmul(self._table.vectors, q.T, out=by_row)
                scores = by_row.T
            else:
                scores = self._batch_scores[:need].reshape(b, n)
                np.matmul(q, self._table.vectors.T, out=scores)
        if self.metric == "l2":
            scores -= self._half_sqnorms[:n]
        return scores

    def _take_top_k(
        self, q: np.ndarray, k: int, scores: np.ndarray, matched: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """One member's (scores [nq, k], ids [nq, k]) from its rows of the shared scores
        [nq, n] (rejected rows already -inf)."""
        nq = q.shape[0]
        kk = min(k, matched)
        if kk == k:
            out_scores, out_ids = np.empty((nq, k), np.float32), np.empty((nq, k), np.int64)
        else:
            out_scores, out_ids = self._no_results(nq, k)
        if nq > 1 and kk > 0 and scores.shape[1] < SAMPLE_STRIDE * 8 * kk and self.metric != "l2":
            # rows too short for top_k_1d's sample: it would partition every score of each
            # row, which one call does for all of them (64 queries over 1K rows on the 2-core
            # VM: under half the time row by row took)
            winners2 = top_k_2d(scores, kk)
            out_ids[:, :kk] = self._table.ids[winners2]
            out_scores[:, :kk] = np.take_along_axis(scores, winners2, axis=1)
            return out_scores, out_ids
        for row in range(nq):
            winners = top_k_1d(scores[row], kk)
            winners, best = self._finish_one(q[row], winners, scores[row, winners])
            out_ids[row, :kk] = self._table.ids[winners]
            out_scores[row, :kk] = best
        return out_scores, out_ids

    def _scan_one(
        self, q: np.ndarray, k: int, rows: np.ndarray | None, reject: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """One query q [dim] → (rows [k] best first, scores [k] float32)."""
        n = len(self._table)
        if rows is not None:
            scores = self._table.vectors[rows] @ q  # [m] over the m rows a selective filter matched
            if self.metric == "l2":
                scores -= self._half_sqnorms[rows]
            pos = top_k_1d(scores, k)
            return self._finish_one(q, rows[pos], scores[pos])
        scores = np.matmul(self._table.vectors, q, out=self._scores[:n])  # [n] GEMV
        if self.metric == "l2":
            scores -= self._half_sqnorms[:n]
        if reject is not None:
            scores[reject] = -np.inf
        winners = top_k_1d(scores, k)
        return self._finish_one(q, winners, scores[winners])

    def _finish_one(
        self, q: np.ndarray, winners: np.ndarray, best: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        if self.metric != "l2":
            return winners, best
        # exact squared distances of the k winners (no |q|² - 2q·x cancellation), re-sorted
        diff = self._table.vectors[winners] - q
        dist = np.einsum("ij,ij->i", diff, diff)
        order = np.argsort(dist, kind="stable")
        return winners[order], dist[order]

    def _scan_block(
        self, q: np.ndarray, k: int, rows: np.ndarray | None, reject: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Queries q [b, dim] → (rows [b, k] best first, scores [b, k] float32)."""
        n = len(self._table)
        vectors = self._table.vectors  # [n, dim]
        base = vectors if rows is None else vectors[rows]
        scores = q @ base.T  # [b, m] GEMM
        if self.metric == "l2":
            scores -= self._half_sqnorms[:n] if rows is None else self._half_sqnorms[rows]
        if reject is not None:
            scores[:, reject] = -np.inf
        pos = top_k_2d(scores, k)
        winners = pos if rows is None else rows[pos]
        if self.metric != "l2":
            return winners, np.take_along_axis(scores, pos, axis=1)
        diff = vectors[winners] - q[:, None, :]  # [b, k, dim]
        dist = np.einsum("bkd,bkd->bk", diff, diff)
        order = np.argsort(dist, axis=1, kind="stable")
        return np.take_along_axis(winners, order, axis=1), np.take_along_axis(dist, order, axis=1)


__all__ = ["CpuFlatIndex", "top_k_1d", "top_k_2d"]
