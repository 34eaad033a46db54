"""Exact GPU index: vectors resident in device memory, searched by one fused Triton pass.

Spec strings: ``"cuda:flat,fp16"`` (the default storage dtype), ``"cuda:flat,bf16"``,
``"cuda:flat,fp32"``, and ``"cuda:N:flat,..."`` for device N.

Storage (all on the device, grown by doubling so an add copies amortised O(1) rows):

- ``vectors [cap, dim]`` in the storage dtype; cosine rows are unit-normalised at add;
- ``ids [cap]`` int64, ``scopes [3, cap]`` int64 (tenant, user, session rows), ``sqnorms [cap]``
  fp32 (``|x|^2`` of the stored row, for l2);
- ``n`` live rows as a device int32 scalar, read by the kernel, so a captured CUDA graph stays
  valid across adds and removes that do not grow the storage.

Rows ``[0, n)`` are live and dense: a removal moves the last rows into the holes, so a scan never
pays for holes and a removed item can never be returned. The id -> row map lives on the host.

Search (see ``kalos.index.kernels.scan_topk``) is two kernel launches for k <= 256 (nq == 1) or
k <= 64 (batches): the fused scan + per-program top-k, and a merge of the candidates. Larger k
takes a slower general path: every row's key, then ``torch.topk``.

Three ways in, by cost:

- ``search(q, k)``: numpy (or torch) in, numpy out; validates; copies and synchronises.
- ``search_device(q, k, out=...)``: device tensors in and out; no host sync, and no allocation
  once the workspace for that (batch, k) exists and ``out`` is given. Triton's launcher costs
  tens of µs of host time per launch, so latency-critical callers use:
- ``graph(nq, k, scope_active)``: a :class:`SearchGraph` over fixed buffers, replayed as one
  CUDA graph (a few µs of host time).

Mutations (add, remove, reset) are enqueued on torch's current stream; a caller replaying
graphs on another stream orders them itself (an event, or a synchronize after the mutation).
One index serves one search at a time through ``search``/``search_device`` (they share a
workspace); each :class:`SearchGraph` owns its own.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from kalos.errors import ConfigError, InvalidRequest, NotFound

_METRICS = {"ip": 0, "cosine": 1, "l2": 2}
_DTYPES = ("fp16", "bf16", "fp32")
_FP16_MAX = 65504.0
_MAX_K = 1024
_MIN_CAPACITY = 1024
# workspace budget of the general (large-k) path: keys [chunk of queries, capacity] int64
_GENERAL_PATH_BYTES = 512 << 20


def parse_spec(spec: str) -> tuple[str, str]:
    """``"cuda:flat,fp16"`` -> ("cuda", "fp16"); ``"cuda:1:flat,bf16"`` -> ("cuda:1", "bf16")."""
    head, _, dtype = spec.partition(",")
    dtype = dtype.strip() or "fp16"
    parts = head.strip().split(":")
    if len(parts) == 2 and parts[0] == "cuda" and parts[1] == "flat":
        device = "cuda"
    elif len(parts) == 3 and parts[0] == "cuda" and parts[2] == "flat" and parts[1].isdigit():
        device = f"cuda:{parts[1]}"
    else:
        raise ConfigError(f"not a cuda flat index spec: {spec!r} (e.g. 'cuda:flat,fp16')")
    if dtype not in _DTYPES:
        raise ConfigError(f"storage dtype {dtype!r} in {spec!r}: one of {', '.join(_DTYPES)}")
    return device, dtype


class CudaFlatIndex:
    """Exact top-k over vectors held on one CUDA device (faiss's verbs; see the module doc)."""

    def __init__(
        self,
        *,
        dim: int,
        metric: str,
        spec: str,
        device: str = "cuda",
        dtype: str = "fp16",
    ) -> None:
        try:
            import torch
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ConfigError(f"{spec}: needs torch and triton (pip install kalos[gpu])") from exc
        if not isinstance(dim, int) or dim <= 0:
            raise ConfigError(f"dim must be a positive int, got {dim!r}")
        if metric not in _METRICS:
            raise ConfigError(f"metric must be one of {', '.join(_METRICS)}, got {metric!r}")
        if dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
        elem = 4 if dtype == "fp32" else 2
        if dim > 4096 // elem:
            raise ConfigError(f"dim {dim} too large for {dtype} (at most {4096 // elem})")
        dev = torch.device(device)
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ConfigError(f"{spec}: no CUDA device is available")
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
        elif os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError(
                f"device {device!r}: the Triton kernels run on CUDA, or on the CPU only "
                "under TRITON_INTERPRET=1 (tests)"
            )
        from kalos.index.kernels import scan_topk as kernels  # imports triton

        self.spec = spec
        self.dim = dim
        self.metric = metric
        self.dtype = dtype
        self.device = dev
        self.scan_config: Any = None  # a kernels.ScanConfig to override the tuned choice
        self._torch = torch
        self._k = kernels
        self._metric_code = _METRICS[metric]
        self._tdtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
        self._on_gpu = dev.type == "cuda"
        self._elem = 4 if dtype == "fp32" else 2
        self._max_batch = kernels.max_batch(dim, self._elem)
        self._sms = (
            torch.cuda.get_device_properties(dev).multi_processor_count if self._on_gpu else 1
        )
        self._n = 0
        self._cap = 0
        self._generation = 0  # bumped whenever storage moves (graphs recapture)
        self._row_ids = np.empty(0, dtype=np.int64)  # host mirror of ids[:cap]
        self._map: dict[int, int] | None = {}  # id -> row; None = rebuild from _row_ids
        self._workspaces: dict[tuple[int, int], dict[str, Any]] = {}
        # device storage, set by _alloc: vectors [cap, dim], ids [cap], scopes [3, cap], sq [cap]
        self._vecs: Any = None
        self._ids: Any = None
        self._scopes: Any = None
        self._sq: Any = None
        with torch.cuda.device(dev) if self._on_gpu else _nullcontext():
            self._n_dev = torch.zeros(1, dtype=torch.int32, device=dev)
            self._no_filter = torch.zeros(3, dtype=torch.int64, device=dev)
        self._alloc(_MIN_CAPACITY)

    @classmethod
    def from_spec(cls, spec: str, *, dim: int, metric: str) -> CudaFlatIndex:
        device, dtype = parse_spec(spec)
        return cls(dim=dim, metric=metric, spec=spec, device=device, dtype=dtype)

    # ------------------------------------------------------------------------------ storage

    def __len__(self) -> int:
        return self._n

    @property
    def capacity(self) -> int:
        """Rows allocated on the device; graphs stay valid until an add grows past it."""
        return self._cap

    @property
    def generation(self) -> int:
        """Changes whenever the device storage is reallocated."""
        return self._generation

    @property
    def nbytes(self) -> int:
        """Device bytes held by the storage (at capacity): vectors, ids, scopes, norms."""
        return self._cap * (self.dim * self._elem + 8 + 24 + 4)

    def _alloc(self, cap: int) -> None:
        torch = self._torch
        dev = self.device
        vecs = torch.empty((cap, self.dim), dtype=self._tdtype, device=dev)
        ids = torch.full((cap,), -1, dtype=torch.int64, device=dev)
        scopes = torch.zeros((3, cap), dtype=torch.int64, device=dev)
        sq = torch.zeros((cap,), dtype=torch.float32, device=dev)
        n = self._n
        if n:
            vecs[:n] = self._vecs[:n]
            ids[:n] = self._ids[:n]
            scopes[:, :n] = self._scopes[:, :n]
            sq[:n] = self._sq[:n]
        self._vecs, self._ids, self._scopes, self._sq = vecs, ids, scopes, sq
        row_ids = np.full(cap, -1, dtype=np.int64)
        row_ids[:n] = self._row_ids[:n]
        self._row_ids = row_ids
        self._cap = cap
        self._generation += 1
        self._workspaces.clear()

    def reserve(self, capacity: int) -> None:
        """Grow the device storage to at least ``capacity`` rows now, so that adds up to it
        neither copy nor invalidate captured graphs."""
        self._reserve(int(capacity))

    def _reserve(self, total: int) -> None:
        if total > self._cap:
            self._alloc(max(total, 2 * self._cap, _MIN_CAPACITY))

    def _id_map(self) -> dict[int, int]:
        if self._map is None:
            self._map = dict(zip(self._row_ids[: self._n].tolist(), range(self._n), strict=True))
        return self._map

    def _set_n(self, n: int) -> None:
        self._n = n
        self._n_dev.fill_(n)

    # ------------------------------------------------------------------------------ writes

    def add(self, vectors: Any, ids: Any, scopes: Any = None) -> None:
        """Upsert ``vectors [n, dim]`` under ``ids [n]`` int64 with ``scopes [n, 3]`` int64.

        An existing id is replaced in place; within one batch the last occurrence wins.
        Raises InvalidRequest for a wrong shape, NaN/inf, a value outside fp16's range (fp16
        storage), or id -1 (reserved).
        """
        torch = self._torch
        x = self._vectors_in(vectors, "vectors")
        n_in = x.shape[0]
        id_arr = _ids_in(ids, n_in)
        if scopes is None:
            sc = np.zeros((n_in, 3), dtype=np.int64)
        else:
            sc = _to_numpy(scopes)
            if sc.shape != (n_in, 3) or not np.issubdtype(sc.dtype, np.integer):
                raise InvalidRequest(f"scopes must be int64 [{n_in}, 3], got {sc.dtype} {sc.shape}")
            sc = sc.astype(np.int64, copy=False)
        if n_in == 0:
            return
        # last occurrence of each id wins
        if n_in > 1:
            uniq, first_rev = np.unique(id_arr[::-1], return_index=True)
            if len(uniq) != n_in:
                keep = np.sort(n_in - 1 - first_rev)
                id_arr, sc = id_arr[keep], sc[keep]
                x = x[torch.from_numpy(keep).to(x.device)]
        m = len(id_arr)
        if self._n == 0:
            rows = np.full(m, -1, dtype=np.int64)
        else:
            id_map = self._id_map()
            rows = np.fromiter((id_map.get(i, -1) for i in id_arr.tolist()), np.int64, m)
        fresh = rows < 0
        n_new = int(fresh.sum())
        self._reserve(self._n + n_new)
        rows[fresh] = np.arange(self._n, self._n + n_new, dtype=np.int64)

        stored = x.to(self._tdtype)
        sq = stored.float().square().sum(dim=1)
        ids_t = torch.from_numpy(id_arr).to(self.device)
        sc_t = torch.from_numpy(np.ascontiguousarray(sc.T)).to(self.device)
        if n_new == m and m == len(rows) and rows[0] == self._n:  # a plain append
            lo, hi = self._n, self._n + m
            self._vecs[lo:hi] = stored
            self._ids[lo:hi] = ids_t
            self._scopes[:, lo:hi] = sc_t
            self._sq[lo:hi] = sq
        else:
            rows_t = torch.from_numpy(rows).to(self.device)
            self._vecs.index_copy_(0, rows_t, stored)
            self._ids.index_copy_(0, rows_t, ids_t)
            self._scopes.index_copy_(1, rows_t, sc_t)
            self._sq.index_copy_(0, rows_t, sq)
        self._row_ids[rows] = id_arr
        if self._map is not None:
            if self._n == 0 and n_new == m:
                self._map = None  # bulk load: build lazily, on the first upsert/remove
            else:
                self._map.update(zip(id_arr[fresh].tolist(), rows[fresh].tolist(), strict=True))
        self._set_n(self._n + n_new)

    def remove(self, ids: Any) -> int:
        """Remove ``ids``; returns how many were present. The last rows fill the holes."""
        torch = self._torch
        arr = np.unique(_to_numpy(ids).astype(np.int64, copy=False).reshape(-1))
        if self._n == 0 or arr.size == 0:
            return 0
        id_map = self._id_map()
        rows = np.array([id_map.pop(i) for i in arr.tolist() if i in id_map], dtype=np.int64)
        if rows.size == 0:
            return 0
        rows.sort()
        n_old = self._n
        n_new = n_old - rows.size
        holes = rows[rows < n_new]
        if holes.size:
            tail_removed = rows[rows >= n_new]
            sources = np.setdiff1d(np.arange(n_new, n_old, dtype=np.int64), tail_removed)
            h = torch.from_numpy(holes).to(self.device)
            s = torch.from_numpy(sources).to(self.device)
            self._vecs.index_copy_(0, h, self._vecs.index_select(0, s))
            self._ids.index_copy_(0, h, self._ids.index_select(0, s))
            self._scopes.index_copy_(1, h, self._scopes.index_select(1, s))
            self._sq.index_copy_(0, h, self._sq.index_select(0, s))
            moved = self._row_ids[sources]
            self._row_ids[holes] = moved
            id_map.update(zip(moved.tolist(), holes.tolist(), strict=True))
        self._row_ids[n_new:n_old] = -1
        self._set_n(n_new)
        return int(rows.size)

    def reset(self) -> None:
        """Drop every item; the storage (and captured graphs) stay."""
        self._map = {}
        self._row_ids[: self._n] = -1
        self._set_n(0)

    # ------------------------------------------------------------------------------ reads

    def reconstruct(self, ids: Any) -> np.ndarray:
        """Stored vectors of ``ids`` as float32 [n, dim] (unit rows for cosine, storage-rounded).
        Raises NotFound for an unknown id."""
        arr = _to_numpy(ids).astype(np.int64, copy=False).reshape(-1)
        id_map = self._id_map()
        rows = []
        for i in arr.tolist():
            r = id_map.get(i)
            if r is None:
                raise NotFound(f"id {i} is not in the index")
            rows.append(r)
        if not rows:
            return np.empty((0, self.dim), dtype=np.float32)
        r_t = self._torch.tensor(rows, dtype=self._torch.int64, device=self.device)
        return self._vecs.index_select(0, r_t).float().cpu().numpy()

    def dump(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Copies of (ids [n] int64, vectors [n, dim] float32, scopes [n, 3] int64)."""
        n = self._n
        return (
            self._row_ids[:n].copy(),
            self._vecs[:n].float().cpu().numpy(),
            self._scopes[:, :n].T.contiguous().cpu().numpy(),
        )

    def search(
        self, queries: Any, k: int, *, scope: tuple[int, int, int] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Exact top-k: (scores [nq, k] float32, ids [nq, k] int64), numpy copies owned by the
        caller. ip/cosine descending, l2 squared distance ascending; missing results are id -1
        with score -inf (ip/cosine) or +inf (l2)."""
        q = self._vectors_in(queries, "queries", normalise=False)
        k = _k_in(k)
        filt = _scope_in(scope)
        fp16_query = self.metric != "cosine" and self.dtype == "fp16" and q.numel()
        if fp16_query and float(q.abs().max()) > _FP16_MAX:
            raise InvalidRequest("query values exceed fp16's range (65504)")
        scores, ids = self.search_device(q, k, scope=filt)
        return scores.cpu().numpy(), ids.cpu().numpy()

    # ------------------------------------------------------------------------------ device path

    def search_device(self, q: Any, k: int, *, scope: Any = None, out: Any = None) -> Any:
        """Search with device tensors: no host sync; no allocation once this (batch, k) has a
        workspace and ``out`` is given.

        q: [nq, dim] or [dim], fp32/fp16/bf16, on the index's device (not validated: NaN in,
        garbage out). scope: None, a (tenant, user, session) tuple (copied to the device: a
        small sync), or an int64 [3] device tensor. out: (scores [nq, k] fp32, ids [nq, k]
        int64) device tensors, unit stride along k. Returns (scores, ids).
        """
        torch = self._torch
        if q.dim() == 1:
            q = q.unsqueeze(0)
        if q.shape[-1] != self.dim:
            raise InvalidRequest(f"queries must have dim {self.dim}, got {tuple(q.shape)}")
        if q.stride(-1) != 1:
            q = q.contiguous()
        nq = q.shape[0]
        k = _k_in(k)
        if out is None:
            scores = torch.empty((nq, k), dtype=torch.float32, device=self.device)
            ids = torch.empty((nq, k), dtype=torch.int64, device=self.device)
        else:
            scores, ids = out
        filt, scoped = self._filter_tensor(scope)
        batch = self._max_batch
        ws = self._workspace(min(nq, batch), k)
        for lo in range(0, nq, batch):
            hi = min(nq, lo + batch)
            self._launch(q[lo:hi], k, filt, scoped, scores[lo:hi], ids[lo:hi], ws)
        return scores, ids

    def graph(self, nq: int, k: int, scope_active: bool = False) -> SearchGraph:
        """A search of ``nq`` queries for ``k`` results captured as a CUDA graph over fixed
        buffers (see :class:`SearchGraph`). On the CPU (interpreter) it runs the kernels
        directly, with the same buffers."""
        return SearchGraph(self, nq, k, scope_active)

    def _filter_tensor(self, scope: Any) -> tuple[Any, bool]:
        torch = self._torch
        if scope is None:
            return self._no_filter, False
        if isinstance(scope, torch.Tensor):
            return scope, True
        vals = _scope_in(scope)
        if vals is None:
            return self._no_filter, False
        return torch.tensor(vals, dtype=torch.int64, device=self.device), True

    def _config(self, nq: int, k: int) -> Any:
        if self.scan_config is not None:
            return self.scan_config
        return self._k.choose_config(self.dim, self._elem, nq, k, self._on_gpu)

    def _fast(self, nq: int, k: int) -> bool:
        return bool(self._k.fast_path_ok(nq, k, self.dim, self._elem))

    def _programs(self, cfg: Any, k: int) -> int:
        bn = max(cfg.block_n, self._k.key_width(k))
        tiles = max(1, math.ceil(self._cap / bn))
        programs = self._sms * cfg.programs_per_sm  # _sms is 1 on the CPU
        if self._on_gpu and self.scan_config is None:
            # small capacities: >= 8 tiles a program, >= 1 program an SM (100K x 128 on an
            # H200: 132 programs 26 µs, 264 programs 33 µs; bench/NOTES-gpu.md)
            programs = min(programs, max(self._sms, tiles // 8))
        return max(1, min(tiles, programs))

    def _workspace(self, nq: int, k: int, private: bool = False) -> dict[str, Any]:
        """Scratch for one (batch, k): the scan's state (thresholds, group bests, survivors),
        candidates or general-path keys. Shared (cached per index, dropped when storage moves)
        unless ``private`` (graphs). Searches that share one must run one after another on one
        stream: the merge resets the state that the next scan starts from."""
        key = (nq, k)
        if not private and key in self._workspaces:
            return self._workspaces[key]
        torch = self._torch
        kern = self._k
        dev = self.device
        kp = kern.key_width(k)
        none = kern.KEY_NONE
        ws: dict[str, Any] = {
            "state": (
                torch.full((nq,), none, dtype=torch.int64, device=dev),  # thr
                torch.full((nq, kp), none, dtype=torch.int64, device=dev),  # slots
                torch.empty((nq, kern.survivors_width(k)), dtype=torch.int64, device=dev),
            ),
            "ticket": torch.zeros(1, dtype=torch.int32, device=dev),  # the fused scan's
        }
        if self._fast(nq, k):
            cfg = self._config(nq, k)
            p = self._programs(cfg, k)
            ws.update(cfg=cfg, programs=p)
            ws["cand"] = torch.empty((nq, p, kp), dtype=torch.int64, device=dev)
        else:
            qc = max(1, min(nq, _GENERAL_PATH_BYTES // (8 * self._cap)))
            kk = min(k, self._cap)
            ws.update(chunk=qc, kk=kk)
            ws["keys"] = torch.empty((qc, self._cap), dtype=torch.int64, device=dev)
            ws["top"] = torch.empty((qc, kk), dtype=torch.int64, device=dev)
            ws["top_idx"] = torch.empty((qc, kk), dtype=torch.int64, device=dev)
        if not private:
            self._workspaces[key] = ws
        return ws

    def _launch(
        self, q: Any, k: int, filt: Any, scoped: bool, scores: Any, ids: Any, ws: dict[str, Any]
    ) -> None:
        # q: [nq, dim] (nq <= max batch); scores: [nq, k] fp32; ids: [nq, k] int64
        torch = self._torch
        kern = self._k
        nq = q.shape[0]
        if "cand" in ws and self._fast(nq, k):
            p = ws["programs"]
            cand = ws["cand"].view(-1)[: nq * p * kern.key_width(k)].view(nq, p, -1)
            fused = kern.scan_topk(
                self._vecs,
                self._sq,
                self._scopes,
                filt,
                q,
                self._n_dev,
                ws["state"],
                cand,
                k=k,
                metric=self._metric_code,
                scoped=scoped,
                programs=p,
                cfg=ws["cfg"],
                final=(ws["ticket"], self._ids, scores, ids),
            )
            if fused:
                return
            kern.merge_topk(
                cand.view(nq, -1),
                ws["state"],
                self._ids,
                q,
                scores,
                ids,
                k=k,
                metric=self._metric_code,
                select=True,
            )
            return
        if "keys" not in ws:  # a smaller tail batch of a fast-path workspace: its own
            ws = self._workspace(nq, k)
        qc, kk = ws["chunk"], ws["kk"]
        for lo in range(0, nq, qc):
            hi = min(nq, lo + qc)
            keys = ws["keys"][: hi - lo]
            top, top_idx = ws["top"][: hi - lo], ws["top_idx"][: hi - lo]
            kern.score_keys(
                self._vecs,
                self._sq,
                self._scopes,
                filt,
                q[lo:hi],
                self._n_dev,
                keys,
                metric=self._metric_code,
                scoped=scoped,
            )
            torch.topk(keys, kk, dim=1, sorted=True, out=(top, top_idx))
            kern.merge_topk(
                top,
                ws["state"],
                self._ids,
                q[lo:hi],
                scores[lo:hi],
                ids[lo:hi],
                k=k,
                metric=self._metric_code,
                select=False,
            )

    # ------------------------------------------------------------------------------ inputs

    def _vectors_in(self, v: Any, what: str, normalise: bool = True) -> Any:
        """-> float32 [n, dim] torch tensor on the device; validated; unit rows for cosine
        (when ``normalise``)."""
        torch = self._torch
        if isinstance(v, torch.Tensor):
            t = v.detach()
            if not (t.is_floating_point()):
                raise InvalidRequest(f"{what} must be floating point, got {t.dtype}")
            t = t.to(device=self.device, dtype=torch.float32)
        else:
            a = np.asarray(v)
            if a.dtype.kind not in "fiu":
                raise InvalidRequest(f"{what} must be numeric, got {a.dtype}")
            t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(self.device)
        if t.dim() == 1:
            t = t.unsqueeze(0)
        if t.dim() != 2 or t.shape[1] != self.dim:
            raise InvalidRequest(f"{what} must be [n, {self.dim}], got {tuple(t.shape)}")
        if t.numel() and not bool(torch.isfinite(t).all()):
            raise InvalidRequest(f"{what} contain NaN or inf")
        if normalise and self.metric == "cosine" and t.numel():
            nrm = t.norm(dim=1, keepdim=True)
            t = t / torch.where(nrm > 0, nrm, torch.ones_like(nrm))
        if normalise and self.dtype == "fp16" and t.numel() and float(t.abs().max()) > _FP16_MAX:
            raise InvalidRequest(f"{what} exceed fp16's range (65504): use bf16 or fp32 storage")
        return t.contiguous()

    def __repr__(self) -> str:
        return (
            f"CudaFlatIndex(spec={self.spec!r}, dim={self.dim}, metric={self.metric!r}, "
            f"n={self._n}, capacity={self._cap}, device={str(self.device)!r})"
        )


def create_from_spec(
    spec: str, *, dim: int, metric: str, device_index: int | None, options: tuple[str, ...]
) -> CudaFlatIndex:
    """The index factory's entry (kalos.index.create): ``"cuda[:N]:flat[,fp16|bf16|fp32]"``."""
    return CudaFlatIndex.from_spec(spec, dim=dim, metric=metric)


class SearchGraph:
    """One search captured as a CUDA graph over fixed buffers.

    Write queries into ``query`` ([nq, dim] fp32) and, when ``scope_active``, the filter into
    ``scope`` ([3] int64: tenant, user, session; 0 = any); call :meth:`replay`; read ``scores``
    ([nq, k] fp32) and ``ids`` ([nq, k] int64) once the stream reaches that point. The graph
    allocates these in device memory unless the caller passes its own (keyword arguments of
    the same names): pinned host tensors work too, since the kernels read and write them
    through unified addressing. That is how the sidecar's graphs put the top-k straight into
    pinned host memory without a copy node. Buffers must outlive the graph.

    The graph reads the live count from the device, so adds and removes that fit the current
    capacity need nothing; when the index reallocates its storage, the next replay recaptures
    (a one-off cost: a kernel run and a capture, some ms).
    """

    def __init__(
        self,
        index: CudaFlatIndex,
        nq: int,
        k: int,
        scope_active: bool,
        *,
        query: Any = None,
        scope: Any = None,
        scores: Any = None,
        ids: Any = None,
    ) -> None:
        torch = index._torch
        if not isinstance(nq, int) or not 1 <= nq <= index._max_batch:
            raise InvalidRequest(f"graph batch must be 1..{index._max_batch}, got {nq!r}")
        self.index = index
        self.nq = nq
        self.k = _k_in(k)
        self.scope_active = bool(scope_active)
        dev = index.device

        def buffer(given: Any, shape: tuple[int, ...], dtype: Any) -> Any:
            if given is None:
                return torch.zeros(shape, dtype=dtype, device=dev)
            if tuple(given.shape) != shape or given.dtype != dtype or not given.is_contiguous():
                raise InvalidRequest(f"a graph buffer must be contiguous {dtype} {shape}")
            return given

        self.query = buffer(query, (nq, index.dim), torch.float32)
        self.scope = buffer(scope, (3,), torch.int64)
        self.scores = buffer(scores, (nq, self.k), torch.float32)
        self.ids = buffer(ids, (nq, self.k), torch.int64)
        self._graph: Any = None
        self._launch: Any = None  # replay_and_wait's driver launcher of _graph
        self._generation = -1
        self._capture()

    def _run(self) -> None:
        filt = self.scope if self.scope_active else self.index._no_filter
        self.index._launch(
            self.query, self.k, filt, self.scope_active, self.scores, self.ids, self._ws
        )

    def _capture(self) -> None:
        index = self.index
        torch = index._torch
        self._ws = index._workspace(self.nq, self.k, private=True)
        self._generation = index._generation
        self._launch = None
        if not index._on_gpu:
            self._graph = None
            return
        stream = torch.cuda.Stream(device=index.device)
        stream.wait_stream(torch.cuda.current_stream(index.device))
        with torch.cuda.stream(stream):
            self._run()  # compiles the kernels, outside the capture
        torch.cuda.current_stream(index.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            self._run()
        torch.cuda.current_stream(index.device).wait_stream(stream)
        self._graph = graph

    def replay(self) -> None:
        """Run the search on torch's current stream: no host sync, no allocation (except a
        recapture after the index reallocated its storage)."""
        if self.index._generation != self._generation:
            self._capture()
        if self._graph is None:
            self._run()
        else:
            self._graph.replay()

    def replay_and_wait(self, stream: Any) -> None:
        """:meth:`replay` on ``stream`` (torch's current stream, as there), then wait for it:
        launched and waited for through the driver (:func:`kalos.gpu.driver.graph_launcher`),
        which saves torch's per-replay bookkeeping: at 1M x 128 on the H200, replay + sync
        87.3 µs against 92.2 with torch's (bench/NOTES-gpu.md, run 7)."""
        if self.index._generation != self._generation:
            self._capture()
        if self._graph is None:  # the interpreter: ran synchronously
            self._run()
            return
        if self._launch is None:
            from kalos.gpu import driver

            self._launch = driver.graph_launcher(
                self._graph.raw_cuda_graph_exec(), stream.cuda_stream
            )
        self._launch()


# ---------------------------------------------------------------------------------- helpers


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _to_numpy(a: Any) -> np.ndarray:
    if hasattr(a, "detach") and hasattr(a, "cpu"):
        return a.detach().cpu().numpy()
    return np.asarray(a)


def _ids_in(ids: Any, n: int) -> np.ndarray:
    arr = _to_numpy(ids)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.shape != (n,):
        raise InvalidRequest(f"ids must be [{n}], got {arr.shape}")
    if n and not np.issubdtype(arr.dtype, np.integer):
        raise InvalidRequest(f"ids must be integers, got {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if n and bool((arr == -1).any()):
        raise InvalidRequest("id -1 is reserved (it marks a missing result)")
    return arr


def _k_in(k: Any) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise InvalidRequest(f"k must be an int, got {k!r}")
    k = int(k)
    if not 1 <= k <= _MAX_K:
        raise InvalidRequest(f"k must be in 1..{_MAX_K}, got {k}")
    return k


def _scope_in(scope: Any) -> tuple[int, int, int] | None:
    if scope is None:
        return None
    try:
        vals = tuple(int(v) for v in scope)
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"scope must be (tenant, user, session) ints, got {scope!r}") from exc
    if len(vals) != 3:
        raise InvalidRequest(f"scope must have 3 fields (tenant, user, session), got {scope!r}")
    if vals == (0, 0, 0):
        return None
    return vals[0], vals[1], vals[2]


__all__ = ["CudaFlatIndex", "SearchGraph", "parse_spec"]
