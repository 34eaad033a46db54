"""Approximate search on a GPU: an inverted-file index in torch, spec
``"cuda[:N]:ivf,nlist=N[,nprobe=P]"``.

The algorithm, the training rule and the rebalancing rule are ``cpu:ivf``'s
(:mod:`kalos.index.cpu_ivf`: train at ``39 * nlist`` rows, exact before; retrain after 4x
growth or on :meth:`CudaIvfIndex.train`; filters widen the probe until k rows match); this
module keeps them on a device. The code is device-agnostic torch, so the tests run it on
torch's CPU tensors.

Storage (device tensors):

- the **main** rows, sorted by list: ``vecs [N, dim]`` fp16 (cosine rows unit-normalised),
  ``ids [N]`` int64, ``scopes [3, N]`` int64, ``sq [N]`` fp32 (``|x|^2`` of the stored row, for
  l2), ``live [N]`` bool; list ``l`` is rows ``offsets[l]:offsets[l+1]``;
- the **buffer**: rows added since the last merge, unsorted, each with its list (or -1 before
  training), scanned by every search. It is merged into the main rows (one sort by list on
  the device, dropping removed rows) at every training, by :meth:`CudaIvfIndex.flush`, and
  by the first search that finds it holding more than ``max(MERGE_MIN_ROWS, rows /
  MERGE_SHARE)`` rows: a bulk load of many adds pays for one merge, not one per add.

A removal (or the old version of an upserted id) only clears ``live``; the merge drops it (a
search also merges once the removed rows among the sorted ones pass the same share).
Ids are found by a binary search in each part's ids sorted on the device, so no host map per
row exists (100M rows cost no host memory beyond the adds in flight).

Search of queries q [nq, dim]: centroid scores (one matmul) -> the ``nprobe`` best lists
(``torch.topk``) -> their rows' ranking keys, computed from the stored rows in fp32 by one
Triton launch (:mod:`kalos.index.kernels.ivf_keys`: each probed row found from the lists'
cumulative sizes, read in place, no gather; in torch off a GPU), over a width the widest
query's row count sets (the one host sync), masked (removed, filtered) -> ``torch.topk``
(wide rows in two steps: :func:`topk_rows`); the buffer's top-k (fp16 products on a GPU,
the best re-scored in fp32) merged in. In the steady state (trained, the buffer empty, no
removed sorted row, no filter) a single query replays one CUDA graph instead
(:class:`_ProbeGraphs`): the upload, the lists, the keys over a fixed width and the top-k,
one sync. Scores are exact for the stored fp16 rows (l2: the winners' distances recomputed
from differences).

Training: k-means on the device (:func:`kmeans`: seeded; a random sample of at most
``SAMPLE_ROWS_PER_LIST * nlist`` rows; assignments by fp16 matmuls on a GPU, in chunks), then
every row assigned to its list in chunks and the main rows sorted by list.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from kalos.errors import ConfigError, InvalidRequest, NotFound

from .base import (
    NO_ID,
    check_batch,
    check_config,
    check_ids,
    check_k,
    check_queries,
    check_scope_filter,
    missing_score,
    normalise_rows,
)
from .cpu_ivf import (
    KMEANS_ITERS,
    KMEANS_SEED,
    RETRAIN_GROWTH,
    SAMPLE_ROWS_PER_LIST,
    check_nprobe,
    parse_ivf_options,
    train_size,
)

log = logging.getLogger(__name__)

_FP16_MAX = 65504.0
MERGE_MIN_ROWS = 1 << 16
"""A search merges the buffer into the sorted rows once it holds more than this many rows and
more than 1/MERGE_SHARE of the index (its scan stays a small part of a search); the same for
removed rows still among the sorted ones."""
MERGE_SHARE = 16
RERANK_FACTOR = 4
RERANK_MIN = 64
"""The buffer's best max(RERANK_MIN, RERANK_FACTOR * k) rows by the first pass are re-scored
in fp32 (the first pass's fp16 rounding only reorders rows within ~1e-3 of each other)."""
SCORE_BLOCK_BYTES = 1 << 30
"""Assignment matmuls and batched gathers are chunked to stay under 1 GiB of scratch."""


def parse_spec(spec: str, device_index: int | None) -> str:
    """The torch device of ``"cuda[:N]:ivf,..."``: "cuda" or "cuda:N"."""
    head = spec.strip().split(",")[0].split(":")
    if head[0] != "cuda" or head[-1] != "ivf":
        raise ConfigError(f"not a cuda ivf index spec: {spec!r} (e.g. 'cuda:ivf,nlist=4096')")
    return "cuda" if device_index is None else f"cuda:{device_index}"


def kmeans(sample: Any, nlist: int, spherical: bool, seed: int) -> Any:
    """Centroids [nlist, dim] fp32 of sample [m, dim] fp32 (m >= nlist, on the device):
    seeded k-means, :data:`~kalos.index.cpu_ivf.KMEANS_ITERS` rounds. ``spherical``: unit
    centroids, assignment by inner product (ip, cosine); else by squared distance. A list
    left empty takes a random sample row."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    m = sample.shape[0]
    row_norm = float(sample.norm(dim=1).max())
    first = torch.randperm(m, generator=gen)[:nlist].to(sample.device)
    centroids = sample.index_select(0, first).clone()
    if spherical:
        centroids = _unit(centroids)
    for _ in range(KMEANS_ITERS):
        assign = assign_lists(sample, centroids, spherical, row_norm)
        counts = torch.bincount(assign, minlength=nlist)
        sums = torch.zeros_like(centroids).index_add_(0, assign, sample)
        full = counts > 0
        centroids = torch.where(full[:, None], sums / counts.clamp_min(1)[:, None], centroids)
        empty = (~full).nonzero().reshape(-1)
        if empty.numel():
            pick = torch.randperm(m, generator=gen)[: empty.numel()].to(sample.device)
            centroids[empty] = sample.index_select(0, pick)
        if spherical:
            centroids = _unit(centroids)
    return centroids.contiguous()


def _unit(x: Any) -> Any:
    return x / x.norm(dim=1, keepdim=True).clamp_min(1e-30)


def assign_lists(rows: Any, centroids: Any, spherical: bool, row_norm: float) -> Any:
    """The list [n] int64 of each of rows [n, dim] (any float dtype, norms at most
    ``row_norm``): its best centroid, by matmuls of at most SCORE_BLOCK_BYTES of scores. On
    a GPU in fp16 where the products and |c|^2 stay well inside its range (ties at fp16's
    precision may go either way: a row goes to an equally near list), else fp32."""
    import torch

    nlist = centroids.shape[0]
    c_norm = float(centroids.norm(dim=1).max())
    in_range = max(row_norm * c_norm, c_norm * c_norm) < _FP16_MAX / 4
    dtype = torch.float16 if rows.device.type == "cuda" and in_range else torch.float32
    c = centroids.to(dtype)
    half = None if spherical else (0.5 * centroids.square().sum(dim=1)).to(dtype)
    out = torch.empty(rows.shape[0], dtype=torch.int64, device=rows.device)
    chunk = max(1, SCORE_BLOCK_BYTES // (4 * nlist))
    for lo in range(0, rows.shape[0], chunk):
        block = rows[lo : lo + chunk].to(dtype) @ c.T  # [chunk, nlist]
        if half is not None:
            block -= half
        out[lo : lo + block.shape[0]] = block.argmax(dim=1)
    return out


class CudaIvfIndex:
    """Top-k over the rows of the lists nearest the query, on one device (module doc)."""

    kind = "cuda:ivf"

    def __init__(
        self,
        spec: str = "cuda:ivf",
        *,
        dim: int,
        metric: str = "ip",
        device: str = "cuda",
        options: tuple[str, ...] | None = None,
    ) -> None:
        if options is None:
            options = tuple(o.strip() for o in spec.strip().split(",")[1:])
        self.nlist, self.nprobe = parse_ivf_options(spec, options)
        self.dim, self.metric = check_config(dim, metric)
        try:
            import torch
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ConfigError(f"{spec}: needs torch (pip install kalos[gpu])") from exc
        dev = torch.device(device)
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ConfigError(f"{spec}: no CUDA device is available")
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
        self.spec = spec
        self.device = dev
        self._torch = torch
        # the first pass over the buffer's rows: fp16 products on a GPU (half the traffic of a
        # float32 copy), then the best RERANK_FACTOR * k re-scored in fp32
        self._coarse = torch.float16 if dev.type == "cuda" else torch.float32
        # single queries in the steady state replay CUDA graphs (_ProbeGraphs); elsewhere
        # (torch's CPU tensors, in the tests) the same steps run eagerly
        self.graphs = dev.type == "cuda"
        # the probed rows' keys: one Triton launch on a GPU (kernels.ivf_keys); in torch
        # elsewhere (the tests run the kernel on the CPU under TRITON_INTERPRET=1)
        self._ivf_keys: Any = None
        self._topk_small: Any = None  # kernels.topk_small, with the kernel
        if dev.type == "cuda":
            self.use_kernel()
        self.trainings = 0
        self.reset()

    def use_kernel(self) -> None:
        """Ranks the probed rows with the Triton kernel (the default on a GPU; on the CPU only
        under ``TRITON_INTERPRET=1``)."""
        from kalos.index.kernels import ivf_keys, topk_small  # imports triton

        self._ivf_keys = ivf_keys.ivf_keys
        self._topk_small = topk_small

    def warm(self) -> None:
        """Compiles (or loads from the kernel cache) the kernel variant this index's searches
        launch, on a few rows of scratch: so that no search waits for it."""
        if self._ivf_keys is None:
            return
        torch, dev = self._torch, self.device
        x = torch.zeros((2, self.dim), dtype=self._main.vecs.dtype, device=dev)
        q = torch.zeros((1, self.dim), dtype=torch.float32, device=dev)
        ends = torch.full((1, 1), 2, dtype=torch.int64, device=dev)
        sq = torch.zeros(2, dtype=torch.float32, device=dev)
        self._ivf_keys(q, x, sq, ends, torch.zeros_like(ends), 64, self.metric == "l2")
        self._topk_small.warm(dev)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    # ------------------------------------------------------------------------------ state

    def reset(self) -> None:
        """Remove every item and free the storage (the index is untrained again)."""
        torch, dev, dim = self._torch, self.device, self.dim
        self._centroids: Any = None  # [nlist, dim] fp32
        self._half_c: Any = None  # [nlist] fp32, |c|^2 / 2 (l2)
        self._offsets: Any = torch.zeros(self.nlist + 1, dtype=torch.int64, device=dev)
        self._sizes = np.zeros(self.nlist, dtype=np.int64)  # host copy of the lists' sizes
        self._sizes_t: Any = torch.zeros(self.nlist, dtype=torch.int64, device=dev)
        self._main_dead = 0  # main rows removed since the last merge (live False)
        self._max_norm = 0.0  # the largest stored row's norm (fp16 products' range)
        self._main = _Part.empty(torch, dev, dim)
        self._buf = _Part.empty(torch, dev, dim)
        self._buf_lists: Any = torch.empty(0, dtype=torch.int64, device=dev)  # [cap]
        self._n = 0
        self.trained_rows = 0
        self._graphs: _ProbeGraphs | None = None  # the steady state's single-query graphs

    def __len__(self) -> int:
        return self._n

    @property
    def is_trained(self) -> bool:
        return self._centroids is not None

    @property
    def nbytes(self) -> int:
        """Device bytes held: both parts' rows (at capacity), the lists and the centroids."""
        total = self._main.nbytes + self._buf.nbytes + 8 * self._buf_lists.numel()
        total += 8 * self._offsets.numel()
        if self._centroids is not None:
            total += 4 * self._centroids.numel()
        return int(total)

    def list_sizes(self) -> np.ndarray:
        """Live rows in each list [nlist] int64, the sorted ones and the buffer's (by the
        list each was assigned); all zeros before training."""
        sizes = self._sizes.copy()
        if self._centroids is not None and self._buf.n:
            live = self._buf.live[: self._buf.n]
            lists = self._buf_lists[: self._buf.n][live]
            sizes += self._torch.bincount(lists, minlength=self.nlist).cpu().numpy()
        if self._centroids is not None and self._main.n:
            dead = (~self._main.live[: self._main.n]).nonzero().reshape(-1).cpu().numpy()
            if dead.size:
                sizes -= np.bincount(
                    np.searchsorted(self._offsets.cpu().numpy(), dead, side="right") - 1,
                    minlength=self.nlist,
                )
        return sizes

    def __repr__(self) -> str:
        return (
            f"CudaIvfIndex(spec={self.spec!r}, dim={self.dim}, metric={self.metric!r},"
            f" n={self._n}, nlist={self.nlist}, nprobe={self.nprobe},"
            f" trained={self.is_trained}, device={str(self.device)!r})"
        )

    # ------------------------------------------------------------------------------ writes

    def add(self, vectors: object, ids: object, scopes: object = None) -> None:
        """Upsert rows [n, dim] with ids [n] and scopes [n, 3] into the buffer (module doc);
        the add that reaches a training size trains (or retrains) the index. InvalidRequest
        for bad input and for values beyond fp16's range; nothing changes then."""
        vecs, keys, scope_rows = check_batch(
            _host(vectors), _host(ids), _host(scopes), self.dim, self.metric
        )
        m = keys.shape[0]
        if m == 0:
            return
        if max(float(vecs.max()), -float(vecs.min())) > _FP16_MAX:  # no [n, dim] temporary
            raise InvalidRequest("vectors exceed fp16's range (65504), this index's storage")
        torch = self._torch
        keys_t = torch.from_numpy(keys).to(self.device)
        replaced = self._kill(keys_t)
        x = torch.from_numpy(vecs).to(self.device).to(torch.float16)
        self._max_norm = max(
            self._max_norm, float(np.sqrt(np.einsum("ij,ij->i", vecs, vecs).max()))
        )
        lists = None
        if self._centroids is not None:
            lists = assign_lists(x, self._centroids, self.metric != "l2", self._max_norm)
        sc = torch.from_numpy(np.ascontiguousarray(scope_rows.T)).to(self.device)
        at = self._buf.n
        self._buf.append(x, keys_t, sc)
        if self._buf_lists.numel() < self._buf.capacity:
            grown = torch.full((self._buf.capacity,), -1, dtype=torch.int64, device=self.device)
            grown[:at] = self._buf_lists[:at]
            self._buf_lists = grown
        if lists is not None:
            self._buf_lists[at : at + m] = lists
        self._n += m - replaced
        if self._centroids is None:
            if self._n >= train_size(self.nlist):
                self.train()
        elif self._n >= RETRAIN_GROWTH * self.trained_rows:
            self.train()

    def remove(self, ids: object) -> int:
        """Remove ids [n] (unknown ones ignored); returns how many were present."""
        keys = np.unique(check_ids(_host(ids)))
        if keys.shape[0] == 0 or self._n == 0:
            return 0
        removed = self._kill(self._torch.from_numpy(keys).to(self.device))
        self._n -= removed
        return removed

    def _kill(self, keys: Any) -> int:
        """Clear ``live`` of the rows holding ids keys [m] (unique); returns how many."""
        hits = 0
        for part in (self._main, self._buf):
            pos = part.find(keys)  # live rows only
            if pos.numel():
                hits += int(pos.numel())
                part.live[pos] = False
                if part is self._main:
                    self._main_dead += int(pos.numel())
        return hits

    def train(self) -> None:
        """k-means on a sample of the live rows, every row assigned to its list, and the
        rows sorted by list (the module doc). InvalidRequest with fewer rows than lists."""
        if self._n < self.nlist:
            raise InvalidRequest(
                f"training {self.nlist} lists needs at least as many rows; got {self._n}"
            )
        torch = self._torch
        gen = torch.Generator().manual_seed(KMEANS_SEED + self.trainings)
        m = min(self._n, SAMPLE_ROWS_PER_LIST * self.nlist)
        rows = self._live_rows()  # (part, positions) of every live row
        total = sum(int(p.numel()) for _, p in rows)
        pick = torch.randperm(total, generator=gen)[:m].sort().values.to(self.device)
        sample = []
        start = 0
        for part, pos in rows:
            mine = pick[(pick >= start) & (pick < start + pos.numel())] - start
            sample.append(part.vecs.index_select(0, pos.index_select(0, mine)).float())
            start += pos.numel()
        spherical = self.metric != "l2"
        centroids = kmeans(torch.cat(sample), self.nlist, spherical, KMEANS_SEED + self.trainings)
        self._centroids = centroids
        self._half_c = None if spherical else 0.5 * centroids.square().sum(dim=1)
        self.trainings += 1
        self.trained_rows = self._n
        self._merge(reassign=True)

    def _live_rows(self) -> list[tuple[_Part, Any]]:
        return [(p, p.live[: p.n].nonzero().reshape(-1)) for p in (self._main, self._buf)]

    def _merge(self, reassign: bool = False) -> None:
        """The live rows of both parts sorted by list into new main rows; the buffer empties.
        ``reassign``: every row's list from the (new) centroids, else the main rows keep
        theirs and the buffer's are the ones assigned at add."""
        torch = self._torch
        spherical = self.metric != "l2"
        lists, parts = [], []
        for part, pos in self._live_rows():
            if part is self._main and not reassign:
                lists.append(self._main_lists().index_select(0, pos))
            elif part is self._buf and not reassign:
                lists.append(self._buf_lists.index_select(0, pos))
            else:
                lists.append(self._assign_rows(part, pos, spherical))
            parts.append((part, pos))
        every = torch.cat(lists)
        order = torch.sort(every, stable=True).indices
        del lists
        merged = _Part.gather(torch, self.device, self.dim, parts, order)
        counts = torch.bincount(every, minlength=self.nlist)
        self._offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        self._sizes = counts.cpu().numpy().astype(np.int64)
        self._sizes_t = counts
        self._main_dead = 0
        self._main = merged
        self._graphs = None  # captured over the old storage
        self._buf = _Part.empty(torch, self.device, self.dim)
        self._buf_lists = torch.empty(0, dtype=torch.int64, device=self.device)

    def flush(self) -> None:
        """Merge the buffer (rows added since the last merge) into the rows sorted by list
        now, dropping removed rows, so that searches score no unsorted or removed rows; a bulk
        load calls it at its end."""
        if self._centroids is not None and (self._buf.n or self._main_dead):
            self._merge()

    def _assign_rows(self, part: _Part, pos: Any, spherical: bool) -> Any:
        """The list [m] of a part's rows at positions pos [m], a chunk at a time (no copy of
        every row at once)."""
        torch = self._torch
        out = torch.empty(pos.numel(), dtype=torch.int64, device=self.device)
        chunk = max(1, SCORE_BLOCK_BYTES // (4 * self.nlist))
        for lo in range(0, pos.numel(), chunk):
            rows = part.vecs.index_select(0, pos[lo : lo + chunk])
            out[lo : lo + rows.shape[0]] = assign_lists(
                rows, self._centroids, spherical, self._max_norm
            )
        return out

    def _main_lists(self) -> Any:
        """The list [N] int64 of each main row (from the offsets)."""
        torch = self._torch
        counts = self._offsets[1:] - self._offsets[:-1]
        return torch.repeat_interleave(
            torch.arange(self.nlist, device=self.device), counts, output_size=self._main.n
        )

    # ------------------------------------------------------------------------------ reads

    def reconstruct(self, ids: object) -> np.ndarray:
        """Stored vectors of ids [n] as [n, dim] float32 (fp16-rounded; unit rows for
        cosine). NotFound for an unknown id."""
        keys = check_ids(_host(ids))
        out = np.empty((keys.shape[0], self.dim), np.float32)
        found = np.zeros(keys.shape[0], bool)
        keys_t = self._torch.from_numpy(keys).to(self.device)
        for part in (self._main, self._buf):
            at, pos = part.find(keys_t, with_index=True)
            if pos.numel():
                out[at.cpu().numpy()] = part.vecs.index_select(0, pos).float().cpu().numpy()
                found[at.cpu().numpy()] = True
        if not found.all():
            raise NotFound(f"id {int(keys[~found][0])} is not in the index")
        return out

    def dump(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Copies of every live item: (ids [n] int64, vectors [n, dim] float32, scopes [n, 3])."""
        parts = self._live_rows()
        ids = [p.ids.index_select(0, pos).cpu().numpy() for p, pos in parts]
        vecs = [p.vecs.index_select(0, pos).float().cpu().numpy() for p, pos in parts]
        scopes = [p.scopes.index_select(1, pos).T.cpu().numpy() for p, pos in parts]
        return (
            np.concatenate(ids),
            np.concatenate(vecs).reshape(-1, self.dim),
            np.ascontiguousarray(np.concatenate(scopes).reshape(-1, 3)),
        )

    def search(
        self,
        queries: object,
        k: int,
        *,
        scope: tuple[int, int, int] | None = None,
        allow: Any = None,
        nprobe: int = 0,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Top-k of the probed lists' rows and the buffer (module doc): (scores [nq, k]
        float32, ids [nq, k] int64), numpy arrays owned by the caller. ``nprobe`` 0: the
        spec's; ``allow``: ids [m] int64, the only ones that may be returned."""
        probes = self._probes(nprobe)
        q = check_queries(_host(queries), self.dim)
        k = check_k(k)
        filt = check_scope_filter(scope)
        if self._centroids is not None:  # the buffer's scan or removed rows grew too costly
            most = max(MERGE_MIN_ROWS, self._n // MERGE_SHARE)
            if self._buf.n > most or self._main_dead > most:
                self._merge()
        if self.metric == "cosine":
            q = normalise_rows(q, "queries")
        nq = q.shape[0]
        out_s = np.full((nq, k), missing_score(self.metric), np.float32)
        out_i = np.full((nq, k), NO_ID, np.int64)
        if self._n == 0:
            return out_s, out_i
        ok_main, ok_buf, matched = self._row_masks(filt, allow)
        if matched == 0:
            return out_s, out_i
        kk = min(k, matched)
        if nq == 1 and self._graphs_ok(ok_main):
            if self._graphs is None:
                self._graphs = _ProbeGraphs(self)
            try:
                scores, ids = self._graphs.search(q, kk, probes)
            except (RuntimeError, GraphMismatch) as exc:  # a capture that failed or disagreed
                log.warning("cuda:ivf: eager launches from now on (CUDA graphs: %s)", exc)
                self.graphs, self._graphs = False, None
            else:
                out_s[:, :kk], out_i[:, :kk] = scores, ids
                if probes >= self.nlist or not (ids == NO_ID).any():
                    return out_s, out_i
            # its probed lists held fewer than k rows: the eager path widens the probe
        # the buffer's first pass in fp16 unless its products could leave fp16's range
        qmax = float(np.sqrt(np.einsum("ij,ij->i", q, q).max()))
        coarse = self._coarse if qmax * self._max_norm < _FP16_MAX / 2 else self._torch.float32
        qt = self._torch.from_numpy(q).to(self.device)
        pending = np.arange(nq)
        while pending.size:
            scores, ids = self._search_device(qt[pending], kk, ok_main, ok_buf, probes, coarse)
            out_s[pending, :kk] = scores
            out_i[pending, :kk] = ids
            # a query whose probed rows matched fewer than k widens its probe (module doc)
            short = (ids == NO_ID).any(axis=1)
            if not short.any() or probes >= self.nlist:
                break
            pending, probes = pending[short], min(self.nlist, 2 * probes)
        return out_s, out_i

    def search_many(
        self,
        members: Sequence[tuple[object, int, tuple[int, int, int] | None]],
        *,
        nprobe: int = 0,
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each member ``(queries, k, scope)`` as :meth:`search` would answer it; members of
        one scope are searched as one batch at the largest of their k."""
        results: list[tuple[np.ndarray, np.ndarray] | None] = [None] * len(members)
        groups: dict[Any, list[tuple[int, np.ndarray, int]]] = {}  # scope -> (member, q, k)
        self._probes(nprobe)
        for i, (queries, k, scope) in enumerate(members):
            q = check_queries(_host(queries), self.dim)  # InvalidRequest, as search's
            groups.setdefault(check_scope_filter(scope), []).append((i, q, check_k(k)))
        for key, group in groups.items():
            kmax = max(k for _, _, k in group)
            batch = np.concatenate([q for _, q, _ in group])
            scores, ids = self.search(batch, kmax, scope=key, nprobe=nprobe)
            at = 0
            for i, q, k in group:
                rows = slice(at, at + q.shape[0])
                results[i] = (scores[rows, :k].copy(), ids[rows, :k].copy())
                at += q.shape[0]
        return results  # type: ignore[return-value]

    def _probes(self, nprobe: object) -> int:
        probes = check_nprobe(nprobe)
        return min(self.nprobe if probes == 0 else probes, self.nlist)

    def _row_masks(self, filt: tuple[int, int, int] | None, allow: Any) -> tuple[Any, Any, int]:
        """(main rows a search may return [N] bool, or None for every one; buffer rows [B]
        bool; how many in all)."""
        masks = []
        wanted = None
        if allow is not None:
            keys = np.unique(check_ids(_host(allow)))
            wanted = self._torch.from_numpy(keys).to(self.device)
        for part in (self._main, self._buf):
            ok = part.live[: part.n]
            if filt is not None:
                ok = ok & part.scope_mask(filt)
            if wanted is not None:
                hit = self._torch.zeros_like(ok)
                hit[part.find(wanted)] = True
                ok = ok & hit
            masks.append(ok)
        if filt is None and allow is None:
            # every main row live: the probe needs no mask (a gather and a fill saved)
            return None if self._main_dead == 0 else masks[0], masks[1], self._n
        return masks[0], masks[1], int(masks[0].sum()) + int(masks[1].sum())

    def _search_device(
        self, q: Any, k: int, ok_main: Any, ok_buf: Any, probes: int, coarse: Any
    ) -> tuple[np.ndarray, np.ndarray]:
        """Queries q [nq, dim] fp32 on the device -> host (scores [nq, k], ids [nq, k]), k <=
        the rows allowed; -1 where the probed rows allowed fewer."""
        torch = self._torch
        parts = []
        if self._centroids is not None and self._main.n:
            parts.append(self._probe(q, k, ok_main, probes))
        if self._buf.n:
            parts.append(self._scan(q, k, self._buf, ok_buf, coarse))
        scores, ids = parts[0]
        if len(parts) > 1:
            scores = torch.cat([p[0] for p in parts], dim=1)  # [nq, 2k]
            ids = torch.cat([p[1] for p in parts], dim=1)
            best = torch.topk(scores, k, dim=1).indices
            scores, ids = scores.gather(1, best), ids.gather(1, best)
        return self._finish(q, scores.cpu().numpy(), ids.cpu().numpy())

    def _finish(self, q: Any, out_s: np.ndarray, out_i: np.ndarray) -> tuple[Any, Any]:
        """The host's part of a result: masked or padded slots (-inf keys) as missing, and
        for l2 the winners' distances (the keys rank as distances do)."""
        missing = ~np.isfinite(out_s)  # on the host: no launches
        out_i[missing] = NO_ID
        out_s[missing] = missing_score(self.metric)
        if self.metric == "l2":
            out_s, out_i = self._exact_l2(q, out_s, out_i)
        return out_s, out_i

    def _graphs_ok(self, ok_main: Any) -> bool:
        """Whether a single query can take :class:`_ProbeGraphs`: ``graphs`` on, trained,
        nothing in the buffer, no removed sorted row, no filter (``ok_main`` None)."""
        return (
            self.graphs
            and self._centroids is not None
            and ok_main is None
            and self._buf.n == 0
            and self._main.n > 0
        )

    def _probe(self, q: Any, k: int, ok: Any, probes: int) -> tuple[Any, Any]:
        """The top-k [nq, k] (ranking key, ids; -inf where missing) of the probed lists' rows
        allowed by ok [N] bool (None: every row)."""
        torch = self._torch
        ends, base = self._lists_of(q, probes)
        width = int(ends[:, -1].max())  # the one host sync: the widest query's rows
        if width == 0:
            return _pad(torch, q.new_empty((q.shape[0], 0)), base[:, :0], k)
        # scratch per (query, probed row): keys and rows (16 bytes); in torch also the row copy
        per = 16 if self._ivf_keys is not None else 16 + 4 * self.dim
        chunk = max(1, SCORE_BLOCK_BYTES // (width * per))
        keys_out, ids_out = [], []
        for lo in range(0, q.shape[0], chunk):
            keys, rows = self._probe_keys(
                q[lo : lo + chunk], ends[lo : lo + chunk], base[lo : lo + chunk], width
            )
            if ok is not None:
                keys = keys.masked_fill(~ok[rows], -math.inf)
            best, ids = self._top(keys, rows, k)
            keys_out.append(best)
            ids_out.append(ids)
        return torch.cat(keys_out), torch.cat(ids_out)

    def _lists_of(self, q: Any, probes: int) -> tuple[Any, Any]:
        """The probed lists of queries q [nq, dim] as (ends, base) [nq, P] int64: ``ends``
        the cumulative sizes of each query's probed lists; row j of its probed rows (j <
        ends[-1]) lies in its list s, the first whose end exceeds j, at main row base[s] + j.
        No host sync."""
        cscores = q @ self._centroids.T  # [nq, nlist]
        if self._half_c is not None:
            cscores -= self._half_c
        lists = self._topk(cscores, probes)[1]  # [nq, P]
        lens = self._sizes_t[lists]
        ends = lens.cumsum(dim=1)
        return ends, self._offsets[lists] - (ends - lens)

    def _probe_keys(self, q: Any, ends: Any, base: Any, width: int) -> tuple[Any, Any]:
        """(keys [b, width] fp32, rows [b, width] int64) of queries q [b, dim] against their
        probed rows (``ends``, ``base`` [b, P]: :meth:`_lists_of`): the ranking key from the
        stored row in fp32 (q.x, or q.x - |x|^2/2 for l2: the distance's order), -inf and row
        0 past a query's own rows. On a GPU one launch (kernels.ivf_keys); no shape depends
        on the data, so a CUDA graph can hold it with a fixed ``width``."""
        main = self._main
        if self._ivf_keys is not None:
            return self._ivf_keys(q, main.vecs, main.sq, ends, base, width, self.metric == "l2")
        torch = self._torch
        j = torch.arange(width, device=self.device).expand(q.shape[0], width)
        slot = torch.searchsorted(ends, j.contiguous(), right=True).clamp_(max=ends.shape[1] - 1)
        valid = j < ends[:, -1:]  # beyond a query's own rows: padding
        rows = torch.where(valid, base.gather(1, slot) + j, torch.zeros_like(j))
        keys = (main.vecs[rows].float() @ q[:, :, None]).squeeze(2)
        if self.metric == "l2":
            keys = keys - 0.5 * main.sq[rows]
        return keys.masked_fill(~valid, -math.inf), rows

    def _probe_width(self, q: Any, k: int, ends: Any, base: Any, width: int) -> tuple[Any, Any]:
        """One query's top-k [1, k] (key, id) of its probed rows over a fixed ``width``
        (the rows past it left out; the graphs' step)."""
        return self._top(*self._probe_keys(q, ends, base, width), k)

    def _top(self, keys: Any, rows: Any, k: int) -> tuple[Any, Any]:
        """The top-k [b, k] (key, id; padded with -inf) of keys [b, w] over main rows [b, w]."""
        best, pos = self._topk(keys, min(k, keys.shape[1]))
        return _pad(self._torch, best, self._main.ids[rows.gather(1, pos)], k)

    def _topk(self, x: Any, k: int) -> tuple[Any, Any]:
        """The top-k (values, positions; sorted) of each row of x [b, w]: with the kernels
        (kernels.topk_small) for k up to its MAX_K, else :func:`topk_rows`."""
        small = self._topk_small
        if small is not None and k <= small.MAX_K and k <= x.shape[1]:
            return small.topk_small(x, k)
        return topk_rows(self._torch, x, k)

    def _scan(self, q: Any, k: int, part: _Part, ok: Any, dtype: Any) -> tuple[Any, Any]:
        """The top-k [nq, k] (ranking key, ids) of a part's rows allowed by ok: every row by
        the first pass (one matmul in ``dtype``), the best re-scored in fp32."""
        torch = self._torch
        n = part.n
        coarse = (part.vecs[:n].to(dtype) @ q.to(dtype).T).T.float()  # [nq, n]
        if self.metric == "l2":
            coarse = coarse - 0.5 * part.sq[:n]
        coarse = coarse.masked_fill(~ok[None, :], -math.inf)
        keep = min(n, max(RERANK_MIN, RERANK_FACTOR * k))
        cand_keys, cand = torch.topk(coarse, keep, dim=1)  # [nq, keep]
        keys = (part.vecs[cand].float() @ q[:, :, None]).squeeze(2)  # exact fp32
        if self.metric == "l2":
            keys = keys - 0.5 * part.sq[cand]
        keys = keys.masked_fill(cand_keys == -math.inf, -math.inf)
        best, pos = torch.topk(keys, min(k, keep), dim=1)
        return _pad(torch, best, part.ids[cand.gather(1, pos)], k)

    def _exact_l2(
        self, q: Any, scores: np.ndarray, ids: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Squared distances of the winners recomputed from differences, re-sorted."""
        vecs = np.zeros((ids.shape[0], ids.shape[1], self.dim), np.float32)
        have = ids != NO_ID
        if have.any():
            vecs[have] = self.reconstruct(ids[have])
        qh = q if isinstance(q, np.ndarray) else q.cpu().numpy()
        diff = vecs - qh[:, None, :]
        dist = np.einsum("bkd,bkd->bk", diff, diff).astype(np.float32)
        dist[~have] = np.inf
        order = np.argsort(dist, axis=1, kind="stable")
        return np.take_along_axis(dist, order, 1), np.take_along_axis(ids, order, 1)


class _ProbeGraphs:
    """A single query's search in the steady state (trained, nothing in the buffer, no
    removed sorted row, no filter) as one CUDA graph, replayed instead of ~15 eager launches
    (each ~20 µs of host time on the GPU hosts) and their syncs.

    The graph (one per nprobe, width and k): the query's upload from pinned memory, its
    probed lists (:meth:`CudaIvfIndex._lists_of`), their rows' keys over a fixed width
    (:meth:`CudaIvfIndex._probe_width`: one kernel; the slots past the rows masked), the
    top-k and the probed row count copied to pinned memory; one sync. The width is a power of
    two (at least :data:`MIN_WIDTH`), the smallest that held every count seen at this nprobe:
    a query whose lists hold more rows than the width runs again at the width that holds
    them, which later searches then keep. The answer is the eager path's.

    Graphs are captured at their first use (a few ms) over the index's storage; a merge
    drops them (:meth:`CudaIvfIndex._merge`). Each holds its own memory pool: a width's
    scratch is about ``12 * width`` bytes."""

    MIN_WIDTH = 1024

    def __init__(self, index: CudaIvfIndex) -> None:
        torch = index._torch
        self.index = index
        self._cuda = index.device.type == "cuda"
        self.query_host = self._host(torch.zeros((1, index.dim), dtype=torch.float32))
        self._query_np = self.query_host.numpy()
        self.query = torch.zeros((1, index.dim), dtype=torch.float32, device=index.device)
        self.count = self._host(torch.zeros(1, dtype=torch.int64))
        self.widths: dict[int, int] = {}  # nprobe -> the width its searches start at
        self._graphs: dict[tuple[int, int, int], tuple[Any, Any, Any]] = {}

    def search(self, q: np.ndarray, k: int, probes: int) -> tuple[Any, Any]:
        """(scores [1, k], ids [1, k]) numpy of the query q [1, dim] (checked, cosine rows
        unit), -1 / missing where fewer rows were probed."""
        self._query_np[...] = q
        width = self.widths.get(probes, self.MIN_WIDTH)
        while True:
            key = (probes, width, k)
            new = key not in self._graphs
            graph, scores, ids = self._graphs.get(key) or self._capture(key)
            graph.replay()
            self._sync()
            count = int(self.count[0])
            if count <= width:
                break
            width = self.widths[probes] = max(self.MIN_WIDTH, 1 << (count - 1).bit_length())
        if new:  # a new capture's first answer is checked against the same steps, eager
            index = self.index
            ends, base = index._lists_of(self.query, probes)
            _, found = index._probe_width(self.query, k, ends, base, width)
            if not index._torch.equal(found.cpu(), ids):
                raise GraphMismatch(f"nprobe {probes}, width {width}, k {k}")
        return self.index._finish(q, scores.numpy().copy(), ids.numpy().copy())

    def _host(self, t: Any) -> Any:
        """A host tensor for a graph's copies: pinned on a CUDA device."""
        return t.pin_memory() if self._cuda else t

    def _sync(self) -> None:
        if self._cuda:
            self.index._torch.cuda.current_stream(self.index.device).synchronize()

    def _capture(self, key: tuple[int, int, int]) -> tuple[Any, Any, Any]:
        """The graph of ``key`` (nprobe, width, k), captured after one run on a side stream
        (warm-up: the libraries' handles and workspaces); off a CUDA device the "graph" runs
        the steps again at each replay."""
        torch, index = self.index._torch, self.index
        probes, width, k = key
        scores = self._host(torch.empty((1, k), dtype=torch.float32))
        ids = self._host(torch.empty((1, k), dtype=torch.int64))

        def run() -> None:
            self.query.copy_(self.query_host, non_blocking=True)
            ends, base = index._lists_of(self.query, probes)
            self.count.copy_(ends[0, -1:], non_blocking=True)
            best, found = index._probe_width(self.query, k, ends, base, width)
            scores.copy_(best, non_blocking=True)
            ids.copy_(found, non_blocking=True)

        graph: Any
        if not self._cuda:
            graph = _Eager(run)
        else:
            dev = index.device
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                run()
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                run()
        self._graphs[key] = (graph, scores, ids)
        return graph, scores, ids


TOPK_GROUP = 1024
"""A wide row's top-k is taken in two steps (:func:`topk_rows`): groups of this many."""


def topk_rows(torch: Any, x: Any, k: int) -> tuple[Any, Any]:
    """``torch.topk(x, k, dim=1)`` of x [b, w] (values, indices; sorted), in two steps where
    w is a multiple of :data:`TOPK_GROUP` of at least 4 groups and k <= a group: the top-k of
    each group, then of those. One wide row's topk is one thread block (27 µs a call on an
    H100 at w = 16K-40K); the groups spread over the multiprocessors. Equal values may come
    in another order than one topk's."""
    b, w = x.shape
    if w % TOPK_GROUP or w < 4 * TOPK_GROUP or k > TOPK_GROUP:
        return torch.topk(x, k, dim=1)
    vals, idx = torch.topk(x.view(b, w // TOPK_GROUP, TOPK_GROUP), k, dim=2)  # [b, g, k]
    idx = idx + torch.arange(0, w, TOPK_GROUP, device=x.device)[None, :, None]
    best, pos = torch.topk(vals.reshape(b, -1), k, dim=1)
    return best, idx.reshape(b, -1).gather(1, pos)


class GraphMismatch(Exception):
    """A newly captured graph's first answer differed from the same steps run eagerly: the
    index drops its graphs and stays eager (a warning says so)."""


class _Eager:
    """A stand-in for a CUDA graph off a CUDA device: replay runs the steps again."""

    def __init__(self, run: Any) -> None:
        self.replay = run


def _pad(torch: Any, keys: Any, ids: Any, k: int) -> tuple[Any, Any]:
    """keys, ids [nq, w] -> [nq, k], padded with (-inf, -1) when w < k."""
    if keys.shape[1] >= k:
        return keys, ids
    nq, w = keys.shape
    keys = torch.cat([keys, keys.new_full((nq, k - w), -math.inf)], dim=1)
    ids = torch.cat([ids, ids.new_full((nq, k - w), NO_ID)], dim=1)
    return keys, ids


class _Part:
    """Rows on a device: vecs [cap, dim] fp16, ids [cap] int64, scopes [3, cap] int64, sq
    [cap] fp32, live [cap] bool; the first ``n`` used. Ids are found by a binary search in
    them sorted on the device (sorted again only after an append)."""

    def __init__(self, vecs: Any, ids: Any, scopes: Any, sq: Any, live: Any, n: int) -> None:
        self.vecs, self.ids, self.scopes, self.sq, self.live = vecs, ids, scopes, sq, live
        self.n = n
        self._sorted: Any = None  # (ids[:n] sorted, their positions)

    @classmethod
    def empty(cls, torch: Any, dev: Any, dim: int, cap: int = 0) -> _Part:
        return cls(
            torch.empty((cap, dim), dtype=torch.float16, device=dev),
            torch.full((cap,), NO_ID, dtype=torch.int64, device=dev),
            torch.zeros((3, cap), dtype=torch.int64, device=dev),
            torch.zeros(cap, dtype=torch.float32, device=dev),
            torch.zeros(cap, dtype=torch.bool, device=dev),
            0,
        )

    @classmethod
    def gather(
        cls, torch: Any, dev: Any, dim: int, parts: list[tuple[_Part, Any]], order: Any
    ) -> _Part:
        """A new part of ``parts``' rows (each (part, positions)) taken in ``order``."""
        total = int(order.numel())
        out = cls.empty(torch, dev, dim, total)
        # new row r comes from concatenated row order[r]: part `which`, position `src`
        src = torch.cat([pos for _, pos in parts]).index_select(0, order)
        bounds = [0]
        for _, pos in parts:
            bounds.append(bounds[-1] + int(pos.numel()))
        chunk = max(1, SCORE_BLOCK_BYTES // (2 * dim + 40))
        for i, (part, _) in enumerate(parts):
            dst = ((order >= bounds[i]) & (order < bounds[i + 1])).nonzero().reshape(-1)
            for lo in range(0, dst.numel(), chunk):  # a chunk of rows at a time: no full copy
                d = dst[lo : lo + chunk]
                s = src.index_select(0, d)
                out.vecs[d] = part.vecs.index_select(0, s)
                out.ids[d] = part.ids.index_select(0, s)
                out.sq[d] = part.sq.index_select(0, s)
                out.scopes[:, d] = part.scopes.index_select(1, s)
        out.live.fill_(True)
        out.n = total
        return out

    @property
    def capacity(self) -> int:
        return int(self.ids.numel())

    @property
    def nbytes(self) -> int:
        cap = self.capacity
        return int(cap * (2 * self.vecs.shape[1] + 8 + 24 + 4 + 1))

    def append(self, x: Any, ids: Any, scopes: Any) -> None:
        """Rows x [m, dim] fp16 with ids [m] and scopes [3, m], after the used ones."""
        import torch

        m = ids.numel()
        need = self.n + m
        if need > self.capacity:
            cap = max(need, 2 * self.capacity, 1024)
            grown = _Part.empty(torch, self.ids.device, self.vecs.shape[1], cap)
            n = self.n
            grown.vecs[:n] = self.vecs[:n]
            grown.ids[:n] = self.ids[:n]
            grown.scopes[:, :n] = self.scopes[:, :n]
            grown.sq[:n] = self.sq[:n]
            grown.live[:n] = self.live[:n]
            self.vecs, self.ids, self.scopes = grown.vecs, grown.ids, grown.scopes
            self.sq, self.live = grown.sq, grown.live
        lo, hi = self.n, need
        self.vecs[lo:hi] = x
        self.ids[lo:hi] = ids
        self.scopes[:, lo:hi] = scopes
        self.sq[lo:hi] = x.float().square().sum(dim=1)
        self.live[lo:hi] = True
        self.n = need
        self._sorted = None

    def find(self, keys: Any, with_index: bool = False) -> Any:
        """Positions of the live rows holding ids keys [m]; with ``with_index`` also which
        of keys each one is: (index into keys, positions)."""
        import torch

        empty = torch.empty(0, dtype=torch.int64, device=keys.device)
        if self.n == 0 or keys.numel() == 0:
            return (empty, empty) if with_index else empty
        if self._sorted is None:
            self._sorted = torch.sort(self.ids[: self.n], stable=True)
        sorted_ids, order = self._sorted
        # a removed row's id may appear again later (an upsert): the last live one counts
        lo = torch.searchsorted(sorted_ids, keys, right=False)
        hi = torch.searchsorted(sorted_ids, keys, right=True)
        spans = hi - lo
        at = torch.repeat_interleave(torch.arange(keys.numel(), device=keys.device), spans)
        starts = torch.repeat_interleave(lo, spans)
        first = torch.repeat_interleave(spans.cumsum(0) - spans, spans)
        pos = order[starts + torch.arange(at.numel(), device=keys.device) - first]
        keep = self.live[pos]
        return (at[keep], pos[keep]) if with_index else pos[keep]

    def scope_mask(self, filt: tuple[int, int, int]) -> Any:
        """[n] bool: the rows whose scope matches ``filt`` (0 fields match anything)."""
        mask = self.live[: self.n].clone().fill_(True)
        for field, want in enumerate(filt):
            if want:
                mask &= self.scopes[field, : self.n] == want
        return mask


def _host(x: object) -> Any:
    """A torch tensor as numpy (the checks run on the host); anything else as it is."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):
        return x.detach().cpu().numpy()
    return x


def create_from_spec(
    spec: str, *, dim: int, metric: str, device_index: int | None, options: tuple[str, ...]
) -> CudaIvfIndex:
    """The index factory's entry (kalos.index.create): ``"cuda[:N]:ivf,nlist=N[,nprobe=P]"``.
    The options are checked before the device."""
    return CudaIvfIndex(
        spec, dim=dim, metric=metric, device=parse_spec(spec, device_index), options=options
    )


__all__ = ["CudaIvfIndex", "assign_lists", "create_from_spec", "kmeans"]
