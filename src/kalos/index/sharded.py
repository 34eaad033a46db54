"""One index over N child indexes (shards): rows spread by a fixed hash of their id.

The shard of an id is ``splitmix64(id) mod N``: a pure function of the id, the same across
restarts and processes, so an upsert, a remove or a reconstruct finds its shard without a
lookup table. A search runs on every shard and merges the per-shard top-k lists into the
global top-k: each shard returns its exact top-k of the rows it holds, so the merged list is
the exact top-k of the whole.

Two ways to run it, picked by what the children are:

- children that search device tensors (:class:`DeviceIndex`: ``cuda:flat``): the queries are
  checked once (as the first child's ``search`` checks them), every child's
  ``search_device`` is launched back to back, each on its own device's current stream (no
  host sync between them), the lists are moved to the first child's device (non-blocking)
  and merged there (:func:`merge_topk_device`), and the result is copied to the host once.
  N shards on one GPU then cost about one scan of all their rows (N scans of 1/N of them)
  plus the launches and two small sorts, not N round trips. Children on several GPUs
  (``ShardedIndex(spec, [CudaFlatIndex(..., device="cuda:0"), CudaFlatIndex(...,
  device="cuda:1")])``) scan at the same time. An ``allow`` (metadata filter) search takes
  the host path below: each child's own filtered ``search`` (its gather or masked scan,
  which synchronise anyway);
- any other children: each child's ``search`` (or ``search_many``) in turn, merged on the
  host (:func:`merge_topk`).

Order of exact ties: both merges break equal scores by ascending id. A single index breaks
them by its own row order (which depends on the history of adds and removes), so a sharded
index and a single index agree on every score and on every id except among exactly tied
scores.

Spec: ``"<device>[:<index>]:<kind>,shards=N[,<option>...]"``: N children of the spec without
the ``shards`` option (``"cpu:flat,shards=3"``, ``"cuda:flat,shards=2"``: two shards on one
device). See :func:`kalos.index.factory.create`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from kalos.errors import ConfigError, InvalidRequest

from .base import (
    NO_ID,
    Index,
    ScopeFilter,
    check_batch,
    check_config,
    check_ids,
    check_k,
    check_queries,
    missing_score,
)

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def splitmix64(ids: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser of ids [n] int64 → [n] uint64 (wrapping arithmetic)."""
    z = ids.astype(np.int64).view(np.uint64) + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def shard_of(ids: np.ndarray, shards: int) -> np.ndarray:
    """The shard [n] int64 in ``0..shards-1`` of each id [n] int64."""
    with np.errstate(over="ignore"):
        return (splitmix64(ids) % np.uint64(shards)).astype(np.int64)


def merge_topk(
    parts: Sequence[tuple[np.ndarray, np.ndarray]], k: int, metric: str
) -> tuple[np.ndarray, np.ndarray]:
    """Per-shard (scores [nq, k_i], ids [nq, k_i]) → the global (scores [nq, k], ids [nq, k]).

    Best first (descending for ip/cosine, ascending squared distance for l2); equal scores
    by ascending id; empty slots (id -1) last.
    """
    scores = np.concatenate([p[0] for p in parts], axis=1)  # [nq, sum k_i] float32
    ids = np.concatenate([p[1] for p in parts], axis=1)  # [nq, sum k_i] int64
    key = scores if metric == "l2" else -scores  # ascending key: best first
    empty = ids == NO_ID
    # lexsort sorts by the last key first: emptiness, then the score key, then the id.
    order = np.lexsort((ids, key, empty), axis=1)[:, :k]
    out_scores = np.take_along_axis(scores, order, axis=1)
    out_ids = np.take_along_axis(ids, order, axis=1)
    if out_ids.shape[1] < k:  # fewer slots than k in all (cannot happen with k_i == k)
        pad = k - out_ids.shape[1]
        nq = out_ids.shape[0]
        out_scores = np.concatenate(
            [out_scores, np.full((nq, pad), missing_score(metric), np.float32)], axis=1
        )
        out_ids = np.concatenate([out_ids, np.full((nq, pad), NO_ID, np.int64)], axis=1)
    return np.ascontiguousarray(out_scores, np.float32), np.ascontiguousarray(out_ids)


def merge_topk_device(scores: Any, ids: Any, k: int, metric: str) -> tuple[Any, Any]:
    """:func:`merge_topk` on a device: the per-shard lists side by side, scores [nq, m] fp32
    and ids [nq, m] int64 torch tensors on one device (m >= k) -> (scores [nq, k], ids
    [nq, k]) on that device, in :func:`merge_topk`'s order (best first, equal scores by
    ascending id, empty slots last). Two stable sorts of [nq, m]; no host sync."""
    import torch

    ids, by_id = torch.sort(ids, dim=1, stable=True)  # ascending id: the order of ties
    scores = scores.gather(1, by_id)
    # An ascending key, best first. ``s + 0.0`` and ``0.0 - s`` make -0.0 into +0.0: the host
    # merge holds them equal, a sort of the bits would not. Empty slots get NaN, which
    # torch.sort puts after every number (also -inf or +inf: a real row can score that).
    key = scores + 0.0 if metric == "l2" else 0.0 - scores
    key = key.masked_fill(ids == NO_ID, math.nan)
    order = torch.sort(key, dim=1, stable=True).indices[:, :k]
    return scores.gather(1, order), ids.gather(1, order)


@runtime_checkable
class DeviceIndex(Protocol):
    """A child that searches device tensors without a host sync (``cuda:flat``:
    :class:`kalos.index.cuda_flat.CudaFlatIndex`)."""

    device: Any  # a torch.device
    max_k: int  # the largest k a search takes

    def device_queries(self, queries: Any) -> Any:
        """Checked queries as float32 [nq, dim] on ``device``."""
        ...

    def device_scope(self, scope: Any) -> Any:
        """A scope filter as an int64 [3] tensor on ``device``, or None."""
        ...

    def search_device(self, q: Any, k: int, *, scope: Any = None, out: Any = None) -> Any:
        """(scores [nq, k] fp32, ids [nq, k] int64) on ``device``, launched, not synced."""
        ...


@contextlib.contextmanager
def _on(device: Any) -> Iterator[None]:
    """Make ``device`` current (Triton launches on the current device's stream)."""
    if device.type != "cuda":  # a CPU tensor (Triton's interpreter, in tests)
        yield
        return
    import torch

    with torch.cuda.device(device):
        yield


class ShardedIndex:
    """The :class:`~kalos.index.base.Index` protocol over ``children`` (same dim and metric).

    ``children`` are empty indexes; row ``id`` lives in ``children[shard_of(id, N)]``. Used by
    one thread at a time, like every index.
    """

    def __init__(self, spec: str, children: Sequence[Index]) -> None:
        if len(children) < 2:
            raise ConfigError(f"{spec!r}: a sharded index needs at least 2 shards")
        first = children[0]
        for child in children:
            if child.dim != first.dim or child.metric != first.metric:
                raise ConfigError(f"{spec!r}: shards differ in dim or metric")
            if len(child):
                raise ConfigError(f"{spec!r}: shards must start empty")
        self.spec = spec
        self.dim, self.metric = check_config(first.dim, first.metric)
        self.children: tuple[Index, ...] = tuple(children)
        # the children when every one searches device tensors (the device path), else ()
        device_children = tuple(c for c in children if isinstance(c, DeviceIndex))
        self._device_children = device_children if len(device_children) == len(children) else ()

    @property
    def shards(self) -> int:
        """How many child indexes."""
        return len(self.children)

    def __len__(self) -> int:
        return sum(len(c) for c in self.children)

    def __repr__(self) -> str:
        return (
            f"ShardedIndex(spec={self.spec!r}, dim={self.dim}, metric={self.metric!r},"
            f" shards={self.shards}, n={len(self)})"
        )

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.children)

    def _route(self, ids: np.ndarray) -> list[np.ndarray]:
        """Positions [m_s] into ids of each shard's ids."""
        where = shard_of(ids, self.shards)
        return [np.flatnonzero(where == s) for s in range(self.shards)]

    def _current(self, child: Index) -> contextlib.AbstractContextManager[None]:
        """The child's device made current while it runs (children on several GPUs)."""
        device = getattr(child, "device", None) if self._device_children else None
        return _on(device) if device is not None else contextlib.nullcontext()

    def add(self, vectors: object, ids: object, scopes: object = None) -> None:
        # Checked (and de-duplicated: last occurrence wins) once here; each child checks again.
        vecs, keys, scope_rows = check_batch(vectors, ids, scopes, self.dim, "ip")
        for child, pos in zip(self.children, self._route(keys), strict=True):
            if pos.shape[0]:
                with self._current(child):
                    child.add(vecs[pos], keys[pos], scope_rows[pos])

    def remove(self, ids: object) -> int:
        keys = check_ids(ids)
        removed = 0
        for child, pos in zip(self.children, self._route(keys), strict=True):
            if pos.shape[0]:
                with self._current(child):
                    removed += child.remove(keys[pos])
        return removed

    def reconstruct(self, ids: object) -> np.ndarray:
        keys = check_ids(ids)
        out = np.empty((keys.shape[0], self.dim), np.float32)
        for child, pos in zip(self.children, self._route(keys), strict=True):
            if pos.shape[0]:
                out[pos] = child.reconstruct(keys[pos])  # NotFound for an unknown id
        return out

    def dump(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        parts = [c.dump() for c in self.children]
        return (
            np.concatenate([p[0] for p in parts]),
            np.concatenate([p[1] for p in parts]).reshape(-1, self.dim),
            np.concatenate([p[2] for p in parts]).reshape(-1, 3),
        )

    def reset(self) -> None:
        for c in self.children:
            c.reset()

    def search(
        self,
        queries: object,
        k: int,
        *,
        scope: ScopeFilter | None = None,
        allow: np.ndarray | None = None,
        nprobe: int = 0,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The top-k of all shards (the module doc: on the device for cuda children, except
        with ``allow``), exact when the children are; ``nprobe`` goes to each child. Returns
        numpy arrays owned by the caller."""
        if self._device_children and allow is None:
            scores, ids = self._launch(self._device_inputs(queries, k, scope))
            return scores.cpu().numpy(), ids.cpu().numpy()
        q = check_queries(queries, self.dim)
        k = check_k(k)
        parts = []
        for child in self.children:
            with self._current(child):
                parts.append(child.search(q, k, scope=scope, allow=allow, nprobe=nprobe))
        return merge_topk(parts, k, self.metric)

    def search_many(
        self,
        members: Sequence[tuple[object, int, ScopeFilter | None]],
        *,
        nprobe: int = 0,
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        if self._device_children:
            # every member checked first (the checks synchronise), then every launch, then
            # the copies (the first waits for all)
            inputs = [self._device_inputs(q, k, scope) for q, k, scope in members]
            merged = [self._launch(one) for one in inputs]
            return [(scores.cpu().numpy(), ids.cpu().numpy()) for scores, ids in merged]
        per_shard = [c.search_many(members, nprobe=nprobe) for c in self.children]
        return [
            merge_topk([answers[i] for answers in per_shard], check_k(k), self.metric)
            for i, (_, k, _) in enumerate(members)
        ]

    def _device_inputs(
        self, queries: object, k: object, scope: object
    ) -> tuple[dict[Any, tuple[Any, Any]], int]:
        """One search's inputs on every device a child is on, checked once (by the first
        child, as its own ``search`` checks them): ({device: (queries [nq, dim] fp32, scope
        [3] int64 or None)}, k). The copies synchronise, so they all happen before any
        launch."""
        children = self._device_children
        first = children[0]
        q = first.device_queries(queries)
        k = check_k(k)
        if k > first.max_k:
            raise InvalidRequest(f"k must be in 1..{first.max_k}, got {k}")
        filt = first.device_scope(scope)
        inputs = {first.device: (q, filt)}
        for child in children[1:]:
            if child.device not in inputs:
                inputs[child.device] = (
                    q.to(child.device),
                    None if filt is None else filt.to(child.device),
                )
        return inputs, k

    def _launch(self, prepared: tuple[dict[Any, tuple[Any, Any]], int]) -> tuple[Any, Any]:
        """Every child's ``search_device`` back to back, then the merge on the first child's
        device: (scores [nq, k] fp32, ids [nq, k] int64) there, not synchronised."""
        import torch

        inputs, k = prepared
        children = self._device_children
        home = children[0].device
        nq, width = inputs[home][0].shape[0], k * len(children)
        # the lists side by side: children on the first device write their slice in place,
        # the others' are copied in (non-blocking, ordered after their search)
        scores = torch.empty((nq, width), dtype=torch.float32, device=home)
        ids = torch.empty((nq, width), dtype=torch.int64, device=home)
        for s, child in enumerate(children):  # no host sync in here
            q, filt = inputs[child.device]
            lists = scores[:, s * k : (s + 1) * k], ids[:, s * k : (s + 1) * k]
            if child.device == home:
                with _on(home):
                    child.search_device(q, k, scope=filt, out=lists)
                continue
            with _on(child.device):
                part = child.search_device(q, k, scope=filt)
            with _on(home):
                lists[0].copy_(part[0], non_blocking=True)
                lists[1].copy_(part[1], non_blocking=True)
        with _on(home):
            return merge_topk_device(scores, ids, k, self.metric)

    def warm(self, *args: object, **kwargs: object) -> None:
        """Warm every child that can be warmed (GPU kernels, graphs)."""
        for c in self.children:
            warm: Callable[..., object] | None = getattr(c, "warm", None)
            if warm is not None:
                warm(*args, **kwargs)


def split_shards_option(spec: str, options: tuple[str, ...]) -> tuple[int | None, tuple[str, ...]]:
    """``shards=N`` out of a spec's options: (N or None, the other options). ConfigError
    for a malformed count."""
    shards: int | None = None
    rest: list[str] = []
    for opt in options:
        if opt.split("=", 1)[0] != "shards":
            rest.append(opt)
            continue
        value = opt.partition("=")[2]
        if shards is not None:
            raise ConfigError(f"bad index spec {spec!r}: 'shards' given twice")
        if not value.isdigit() or int(value) < 2:
            raise ConfigError(
                f"bad index spec {spec!r}: shards=N takes a whole number N >= 2; got {opt!r}"
            )
        shards = int(value)
    return shards, tuple(rest)


__all__ = [
    "DeviceIndex",
    "ShardedIndex",
    "merge_topk",
    "merge_topk_device",
    "shard_of",
    "split_shards_option",
    "splitmix64",
]
