"""Searches answered together by one pass over the index: the sidecar's dynamic batching.

A :class:`SearchBatch` (:meth:`MemoryStore.batch`) takes its members one at a time and is
answered in three steps, so that the host's work on a batch whose pass runs on the GPU
happens while it runs rather than between two passes:

- :meth:`SearchBatch.add`, as each member is decoded: its queries and k checked, its scope
  filter taken and, on a GPU index, its queries copied into its filter's batched call (a
  member that fails a check fails alone: its error is its answer);
- :meth:`SearchBatch.start`: the pass started (on a GPU index its last batched call left
  running; on the CPU the answers are there when it returns);
- :meth:`SearchBatch.land` waits for the call left running and copies its answers out of
  the GPU's staging (the next batch's pass may start then); :meth:`SearchBatch.results`
  gives each member's answer, split out of its call's.

Between two passes the sidecar's poller calls only ``land`` and ``start``
(kalos.server.channels). On a GPU index the members of one scope filter share one batched
kernel call of at most ``gpu.max_batch`` queries, padded to a power of two (a graph is
captured once per batch size and k: few sizes, few captures), at the largest of their k
rounded up to a power of ten; each keeps its own first k (the same top-k: the ranking is the
same). A call of one member, or a member of more queries than the limit, is a search of its
own. Should the pass fail, whichever member caused it, each member is searched again
alone, so that it fails only itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from kalos.errors import InvalidRequest
from kalos.protocol.codes import check_k
from kalos.types import Scope

if TYPE_CHECKING:
    from kalos.stores.gpu_searcher import GpuSearcher, Running

Hit = tuple[np.ndarray, np.ndarray]  # (scores [nq, k], ids [nq, k])
Filter = tuple[int, int, int] | None  # a scope filter's codes (ScopeCodes.filter)


class BatchStore(Protocol):
    """What a batch asks of its store (:class:`~kalos.stores.memories.MemoryStore`)."""

    gpu: GpuSearcher | None
    index: Any  # its Index: search_many
    scopes: Any  # its ScopeCodes: filter

    def check_vectors(self, vectors: np.ndarray, what: str) -> None: ...

    def search_alone(self, queries: np.ndarray, k: int, filt: Filter, nprobe: int = 0) -> Hit: ...


class _GpuCall:
    """One batched GPU call being gathered: members of one scope filter (their places in the
    batch's list of checked members), their queries stacked as they come."""

    __slots__ = ("filt", "members", "queries", "rows")

    def __init__(self, filt: Filter) -> None:
        self.filt = filt
        self.members: list[tuple[int, np.ndarray, int]] = []  # (place, queries, k)
        self.queries: np.ndarray | None = None  # [gpu.max_batch, dim], made at the second
        self.rows = 0

    def add(self, j: int, queries: np.ndarray, k: int, most: int) -> None:
        """Takes member ``j``; its queries are stacked once a second member comes (a call of
        one member is searched alone) and while they fit ``most`` rows."""
        members = self.members
        members.append((j, queries, k))
        nq = len(queries)
        if len(members) == 2 and self.rows + nq <= most:
            first = members[0][1]
            self.queries = np.empty((most, first.shape[1]), np.float32)
            self.queries[: len(first)] = first
        if self.queries is not None:
            self.queries[self.rows : self.rows + nq] = queries
        self.rows += nq


class SearchBatch:
    """Searches of one store answered by one pass (see the module doc)."""

    def __init__(self, store: BatchStore) -> None:
        self._store = store
        self._gpu: GpuSearcher | None = store.gpu
        # each member's answer, in the order added: its error as soon as a check fails
        self._results: list[Hit | Exception | None] = []
        self._nprobes: list[int] = []
        # the members checked: (member, queries, k, scope filter)
        self._todo: list[tuple[int, np.ndarray, int, Filter]] = []
        self._open: dict[Filter, _GpuCall] = {}  # a GPU index's calls still taking members
        self._calls: list[_GpuCall] = []  # ... and those full
        self._found: list[Hit | Exception | None] | None = None  # None: each member alone
        self._running: tuple[Running, Callable[[], None]] | None = None  # its split
        self._answered = False

    def __len__(self) -> int:
        return len(self._results)

    def add(self, queries: np.ndarray, k: int, scope: Scope | None, nprobe: int = 0) -> None:
        """A member: ``queries`` [nq, dim], ``k``, its scope and probe count (as
        :meth:`MemoryStore.search`'s), checked now (under the caller's dispatch lock, as the
        pass: the scope codes cannot change in between)."""
        store = self._store
        try:
            store.check_vectors(queries, "the query")
            check_k(k)
        except InvalidRequest as exc:
            self._results.append(exc)
            self._nprobes.append(nprobe)
            return
        filt = store.scopes.filter(scope)
        i = len(self._results)
        self._results.append(None)
        self._nprobes.append(nprobe)
        j = len(self._todo)
        self._todo.append((i, queries, k, filt))
        gpu = self._gpu
        if gpu is not None:
            most = gpu.max_batch
            if len(queries) > most:  # above the limit: searched alone, the open call kept
                alone = _GpuCall(filt)
                self._calls.append(alone)
                alone.add(j, queries, k, most)
                return
            call = self._open.get(filt)
            if call is not None and call.rows + len(queries) > most:
                self._calls.append(call)
                call = None
            if call is None:
                call = self._open[filt] = _GpuCall(filt)
            call.add(j, queries, k, most)

    def start(self) -> Callable[[], bool] | None:
        """Starts the pass. Returns, while a GPU call of it is left running, what says whether
        it is done (None: the answers are there)."""
        found: list[Hit | Exception | None] = [None] * len(self._todo)
        try:
            if self._gpu is not None:
                self._running = self._start_gpu(self._gpu, found)
            elif self._todo:
                found = self._index_many()
            self._found = found
        except Exception:  # whichever member caused it: each alone, so it fails only itself
            self._found = None
        return None if self._running is None else self._running[0].done

    def land(self) -> None:
        """Waits for the call left running and keeps its answers: the GPU's staging is free
        for the next pass. A failed call: each member is searched again alone
        (:meth:`results`)."""
        running = self._running
        if running is not None and self._found is not None:
            try:
                running[0]()
            except Exception:
                self._found = None

    def results(self) -> list[Hit | Exception]:
        """Each member's ``(scores, ids)`` (arrays the caller owns) or the exception its
        search alone would have raised, in the order added."""
        results = self._results
        if self._answered:
            return results  # type: ignore[return-value]
        self._answered = True
        self.land()
        found = self._found
        if found is not None and self._running is not None:
            try:
                self._running[1]()  # the answers of the call left running, split
            except Exception:
                found = None
        if found is None:
            store, nprobes = self._store, self._nprobes
            found = []
            for i, q, k, f in self._todo:
                try:
                    found.append(store.search_alone(q, k, f, nprobes[i]))
                except Exception as exc:
                    found.append(exc)
        for (i, *_), hit in zip(self._todo, found, strict=True):
            results[i] = hit
        return results  # type: ignore[return-value]

    def _index_many(self) -> list[Hit | Exception | None]:
        """The index's pass: one ``Index.search_many`` per distinct probe count, the answers
        in the checked members' order."""
        todo, nprobes = self._todo, self._nprobes
        found: list[Hit | Exception | None] = [None] * len(todo)
        groups: dict[int, list[int]] = {}
        for j, (i, *_) in enumerate(todo):
            groups.setdefault(nprobes[i], []).append(j)
        for nprobe, js in groups.items():
            hits = self._store.index.search_many([todo[j][1:] for j in js], nprobe=nprobe)
            for j, hit in zip(js, hits, strict=True):
                found[j] = hit
        return found

    def _start_gpu(
        self, gpu: GpuSearcher, found: list[Hit | Exception | None]
    ) -> tuple[Running, Callable[[], None]] | None:
        """The GPU's pass: its calls, batched ones last, the last left running where it can
        be. Returns that one and what splits its answers into ``found``, or None."""
        calls = [*self._calls, *self._open.values()]
        calls.sort(key=lambda call: len(call.members) > 1)  # a batched call last: it may run
        last = None
        for c, call in enumerate(calls):
            running = self._gpu_call(gpu, call, found, run_ahead=c == len(calls) - 1)
            if running is not None:
                last = running
        return last

    def _gpu_call(
        self, gpu: GpuSearcher, call: _GpuCall, found: list[Hit | Exception | None],
        run_ahead: bool,
    ) -> tuple[Running, Callable[[], None]] | None:  # fmt: skip
        """One batched GPU search for ``call``'s members; ``run_ahead``: left running where
        the GPU can (GpuSearcher.start): returns it and what splits its answers into
        ``found``; else None (``found`` is filled)."""
        members, rows, filt = call.members, call.rows, call.filt
        k = max(m[2] for m in members)
        if k <= 1000:  # k up to a power of ten, as the batch size to one of two: few graphs
            k = 10 ** math.ceil(math.log10(k))
        if call.queries is None or k > 1024:
            for j, q, kk in members:
                found[j] = self._store.search_alone(q, kk, filt)
            return None
        size = min(1 << (rows - 1).bit_length(), gpu.max_batch)
        batch = call.queries[:size]  # [size, dim]: the queries, padded
        batch[rows:] = batch[0]  # padding rows: a real query (cosine needs a norm); ignored

        def split(result: Hit) -> None:
            scores, ids = result  # views into staging, [size, k]
            scores, ids = scores[:rows].copy(), ids[:rows].copy()  # the staging's next call
            at = 0
            for j, q, kk in members:
                found[j] = (scores[at : at + len(q), :kk], ids[at : at + len(q), :kk])
                at += len(q)

        running = gpu.start(batch, k, filt) if run_ahead else None
        if running is None:
            split(gpu.search(batch, k, filt))
            return None
        return running, lambda: split(running())


__all__ = ["BatchStore", "SearchBatch"]
