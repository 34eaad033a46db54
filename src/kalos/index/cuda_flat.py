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
k <= 64 (batches): the fused scan + per-program top-k, and a merge of the candidates. Batches
from ``two_pass_min_batch``'s size bucket on (32 queries by default) take two passes instead
(``kalos.index.kernels.batch_topk``): each tile's best score per query, then per query the
tiles that can hold its top-k, scored again; so does a smaller batch whose fp32 query the
fused scan's dot has no room for (9-16 queries above 512 dims): every member of a batch ranks
by its fp32 query, as a single search does. On a ``scan=4bit`` index, batches up to the
spec's ``batch4=N`` (off by default) take the batched 4-bit cascade instead
(``kalos.index.kernels.codes4_batch``: one read of the 4-bit codes bounds every query). Larger
k takes a slower general path: every row's key, then ``torch.topk``.

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

import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np

from kalos.errors import ConfigError, InvalidRequest, NotFound

log = logging.getLogger("kalos.index")

_METRICS = {"ip": 0, "cosine": 1, "l2": 2}
_DTYPES = ("fp16", "bf16", "fp32")
_SCANS = ("auto", "4bit", "int8", "full")
# scan=auto: the 4-bit cascade where it measured faster than the full scan (real-384 1M on the
# H200: 161.1 µs against 242.9, graph replays, bench/results/search-gpu-H200.json; clustered
# 1M x 768 and x 1536 on an H100, end to end: 255.2 and 617.6 µs p99 against the full scan's
# 600.7 and its 1,018.7 floor, bench/results/search-gpu-H100.json), the int8 prefilter
# elsewhere (below 257 dims; above 1536, int8 is the full scan)
_CODES4_DIMS = (257, 1536)
_FP16_MAX = 65504.0
_MAX_K = 1024
_MIN_CAPACITY = 1024
# workspace budget of the general (large-k) path: keys [chunk of queries, capacity] int64
_GENERAL_PATH_BYTES = 512 << 20
# The 4-bit cascade (scan=4bit) takes single-query searches from this many live rows on
# (below it the full scan's one launch is as fast as the cascade's four), and centres its
# codes on the rows' mean once there are this many to fit it on.
CODES4_MIN_ROWS = 500_000
CODES4_FIT_ROWS = 1024
# scan=4bit: batches up to this size bucket take the batched cascade (CudaFlatIndex's
# batch4_max_batch, the spec's batch4=N; kernels.codes4_batch). Off (0) by default: on an H100
# it took 2-16 queries in 70-95% of the two passes' time in process (kalos bench search-batch's
# cascade rows) but lost from 32, and through a sidecar with 8 clients it showed no gain
# (docs/PERFORMANCE.md, "The batched cascade")
BATCH4_MAX_BATCH = 0


def parse_spec(spec: str) -> tuple[str, str, str, int]:
    """``"cuda:flat,fp16"`` -> ("cuda", "fp16", "auto", BATCH4_MAX_BATCH);
    ``"cuda:1:flat,bf16,scan=full"`` -> ("cuda:1", "bf16", "full", ...). Options after the
    kind: the storage dtype; the scan of single-query searches: ``scan=4bit`` (the 4-bit
    cascade, exact, see kalos.index.kernels.codes4), ``scan=int8`` (int8 codes first, proven
    or replayed), ``scan=full``, or ``scan=auto`` (the default: 4bit from 257 to 1536 dims,
    else int8); and with the 4-bit cascade, ``batch4=N``: batches of up to N queries (a size
    bucket, N a power of two up to 64; 0: none) take its batched form
    (kalos.index.kernels.codes4_batch)."""
    head, *opts = spec.split(",")
    dtype, scan, batch4 = "fp16", "auto", BATCH4_MAX_BATCH
    for opt in (o.strip() for o in opts):
        if opt in _DTYPES:
            dtype = opt
        elif opt.startswith("scan="):
            scan = opt[5:]
            if scan not in _SCANS:
                raise ConfigError(f"{opt!r} in {spec!r}: scan= is one of {', '.join(_SCANS)}")
        elif opt.startswith("batch4="):
            text = opt[7:]
            batch4 = int(text) if text.isdigit() else -1
            if batch4 not in (0, 1, 2, 4, 8, 16, 32, 64):
                raise ConfigError(f"{opt!r} in {spec!r}: batch4= is 0 or a power of two <= 64")
        elif opt:
            raise ConfigError(
                f"option {opt!r} in {spec!r}: a storage dtype ({', '.join(_DTYPES)}), "
                f"scan=({'|'.join(_SCANS)}) or batch4=N"
            )
    parts = head.strip().split(":")
    if len(parts) == 2 and parts[0] == "cuda" and parts[1] == "flat":
        device = "cuda"
    elif len(parts) == 3 and parts[0] == "cuda" and parts[2] == "flat" and parts[1].isdigit():
        device = f"cuda:{parts[1]}"
    else:
        raise ConfigError(f"not a cuda flat index spec: {spec!r} (e.g. 'cuda:flat,fp16')")
    return device, dtype, scan, batch4


_HOST_CHECKED = 1 << 16
"""Host arrays (queries, small adds) of up to this many values are checked on the host."""


def _fp16_range(what: str, stored: bool) -> str:
    if stored:
        return f"{what} exceed fp16's range (65504): use bf16 or fp32 storage"
    return "query values exceed fp16's range (65504)"


ALLOW_GATHER_BELOW = 1 / 16
"""A search restricted to fewer than this share of the rows (``allow``) gathers them; one
restricted to more scans every row with a row mask (the scope filter's, in the kernel)."""


class CudaFlatIndex:
    """Exact top-k over vectors held on one CUDA device (faiss's verbs; see the module doc)."""

    max_k = _MAX_K  # the largest k a search takes

    def __init__(
        self,
        *,
        dim: int,
        metric: str,
        spec: str,
        device: str = "cuda",
        dtype: str = "fp16",
        scan: str = "auto",
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
        if scan not in _SCANS:
            raise ConfigError(f"scan must be one of {', '.join(_SCANS)}, got {scan!r}")
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
        from kalos.index.kernels import batch_topk, codes4_batch
        from kalos.index.kernels import scan_topk as kernels  # imports triton

        if scan == "auto":
            scan = "4bit" if _CODES4_DIMS[0] <= dim <= _CODES4_DIMS[1] else "int8"

        self.spec = spec
        self.dim = dim
        self.metric = metric
        self.dtype = dtype
        self.device = dev
        self.scan = scan
        self.scan_config: Any = None  # a kernels.ScanConfig to override the tuned choice
        self.prefilter_config: Any = None  # the same for the int8 prefilter's scan
        self.prefilter_mode = kernels.PREFILTER_DOT  # or PREFILTER_FMA (experiments)
        self.prefilter_keep: int | None = None  # rows kept for the re-rank (experiments)
        # its programs' list length (None: kernels.prefilter_lists)
        self.prefilter_lists: int | None = None
        # prefiltered graphs take the int8 scan from this many live rows on (below it the
        # full scan is as fast: kernels.PREFILTER_MIN_ROWS)
        self.prefilter_min_rows = CODES4_MIN_ROWS if scan == "4bit" else kernels.PREFILTER_MIN_ROWS
        # batches from this size bucket on take the two-pass search (kernels.batch_topk)
        self.two_pass_min_batch = batch_topk.MIN_BATCH
        # scan=4bit: batches up to this size bucket take the batched 4-bit cascade
        # (kernels.codes4_batch; 0: never), before the two passes (the spec's batch4=N)
        self.batch4_max_batch = BATCH4_MAX_BATCH
        # a [programs + 1, 8] int64 tensor that fused scans launched from now on fill with
        # where their time goes (kernels.scan_topk's trace; scripts/search_gpu_phases.py):
        # the full scan's, the int8 prefilter's, or the 4-bit cascade's exact pass's
        self.trace: Any = None
        # the 4-bit cascade's exact pass: its programs (0: the full scan's grid), for
        # workspaces made from now on (scripts/search_gpu_phases.py --exact-programs)
        self.exact4_programs = 0
        # searches that took the prefilter, and those of them it did not prove (settled from
        # the bounds, or by a full scan where a graph has no bounds)
        self.prefilter_searches = 0
        self.prefilter_fallbacks = 0
        # of those, the rows they scored exactly, in all
        self.prefilter_settled_rows = 0
        # what the last warm-up's parallel compile did (kernels.precompile.compile_all)
        self.precompiled: dict[str, Any] | None = None
        self._torch = torch
        self._k = kernels
        self._bt = batch_topk
        self._b4 = codes4_batch
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
        self._sorted: Any = None  # (live ids sorted, their rows) on the device; None: stale
        self._workspaces: dict[tuple[int, int, bool], dict[str, Any]] = {}
        # the workspaces' row-sized scratch, one of each shape (_shared)
        self._scratch: dict[tuple[str, tuple[int, ...]], Any] = {}
        # device storage, set by _alloc: vectors [cap, dim], ids [cap], scopes [3, cap], sq [cap]
        self._vecs: Any = None
        self._ids: Any = None
        self._scopes: Any = None
        self._sq: Any = None
        # the int8 prefilter's codes [cap, dim] int8 and meta [3, cap] fp32 (scan == "int8"),
        # or the 4-bit cascade's codes [NCH, cap, 32] uint8 and meta [2, cap] fp32 ("4bit")
        self._codes: Any = None
        self._meta: Any = None
        # the cascade's centring and rotation (kernels.codes4): float64 for encoding, fp32
        # copies the query's prep kernel reads; the mean is refitted as the index grows
        self._rot64: Any = None
        self._rot32: Any = None
        self._mean64: Any = None
        self._mean32: Any = None
        self._fit_n = 0  # live rows when the mean was last fitted
        with torch.cuda.device(dev) if self._on_gpu else _nullcontext():
            self._n_dev = torch.zeros(1, dtype=torch.int32, device=dev)
            self._no_filter = torch.zeros(3, dtype=torch.int64, device=dev)
            # the largest |x|^2 added since the last reset (the two-pass search's slack);
            # allocated once, so captured graphs keep it
            self._sq_max = torch.zeros(1, dtype=torch.float32, device=dev)
            from kalos.index.kernels import codes4

            self._c4 = codes4  # the cascade's kernels; its emit also settles the int8 prefilter
            if scan == "4bit":
                self._rot64 = codes4.rotation(dim).to(dev)
                self._rot32 = self._rot64.float().contiguous()
                self._mean64 = torch.zeros(dim, dtype=torch.float64, device=dev)
                self._mean32 = torch.zeros(dim, dtype=torch.float32, device=dev)
        self._alloc(_MIN_CAPACITY)

    @classmethod
    def from_spec(cls, spec: str, *, dim: int, metric: str) -> CudaFlatIndex:
        device, dtype, scan, batch4 = parse_spec(spec)
        index = cls(dim=dim, metric=metric, spec=spec, device=device, dtype=dtype, scan=scan)
        index.batch4_max_batch = batch4
        return index

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
    def filter_device(self) -> Any:
        """Where a metadata filter over this index is evaluated: its device. A store passes
        ``allow`` to :meth:`search` as ids on it (kalos.stores.device_columns)."""
        return self.device

    @property
    def nbytes(self) -> int:
        """Device bytes held by the storage (at capacity): vectors, ids, scopes, norms, and
        the prefilter's codes and meta."""
        codes = {"int8": self.dim + 12, "4bit": self._d4() // 2 + 8 + 8}.get(self.scan, 0)
        return self._cap * (self.dim * self._elem + 8 + 24 + 4 + codes)

    def _alloc(self, cap: int) -> None:
        torch = self._torch
        dev = self.device
        vecs = torch.empty((cap, self.dim), dtype=self._tdtype, device=dev)
        ids = torch.full((cap,), -1, dtype=torch.int64, device=dev)
        scopes = torch.zeros((3, cap), dtype=torch.int64, device=dev)
        sq = torch.zeros((cap,), dtype=torch.float32, device=dev)
        codes: Any = None
        meta: Any = None
        if self.scan == "int8":
            codes = torch.zeros((cap, self.dim), dtype=torch.int8, device=dev)
            meta = torch.zeros((3, cap), dtype=torch.float32, device=dev)
        elif self.scan == "4bit":
            codes = torch.zeros((self._d4() // 64, cap, 32), dtype=torch.uint8, device=dev)
            meta = torch.zeros((2, cap), dtype=torch.float32, device=dev)
        n = self._n
        if n:
            vecs[:n] = self._vecs[:n]
            ids[:n] = self._ids[:n]
            scopes[:, :n] = self._scopes[:, :n]
            sq[:n] = self._sq[:n]
            if self.scan == "int8":
                codes[:n] = self._codes[:n]
                meta[:, :n] = self._meta[:, :n]
            elif self.scan == "4bit":
                codes[:, :n] = self._codes[:, :n]
                meta[:, :n] = self._meta[:, :n]
        self._vecs, self._ids, self._scopes, self._sq = vecs, ids, scopes, sq
        self._codes, self._meta = codes, meta
        row_ids = np.full(cap, -1, dtype=np.int64)
        row_ids[:n] = self._row_ids[:n]
        self._row_ids = row_ids
        self._cap = cap
        self._generation += 1
        self._workspaces.clear()
        self._scratch.clear()

    def reserve(self, capacity: int) -> None:
        """Grow the device storage to at least ``capacity`` rows now, so that adds up to it
        neither copy nor invalidate captured graphs."""
        self._reserve(int(capacity))

    def _reserve(self, total: int) -> None:
        if total > self._cap:
            # a multiple of 16: the kernels' capacity argument keeps one specialisation
            self._alloc(-(-max(total, 2 * self._cap, _MIN_CAPACITY) // 16) * 16)

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
        torch.maximum(self._sq_max, sq.max().reshape(1), out=self._sq_max)
        ids_t = torch.from_numpy(id_arr).to(self.device)
        sc_t = torch.from_numpy(np.array(sc.T, order="C")).to(self.device)  # owned, writable
        codes = meta = None
        if self.scan == "int8":
            codes, meta = self._k.prefilter_meta(stored)
        elif self.scan == "4bit":
            codes, meta = self._c4.encode(stored, self._mean64, self._rot64)
        cdim = 1 if self.scan == "4bit" else 0  # the codes' row axis
        if n_new == m and m == len(rows) and rows[0] == self._n:  # a plain append
            lo, hi = self._n, self._n + m
            self._vecs[lo:hi] = stored
            self._ids[lo:hi] = ids_t
            self._scopes[:, lo:hi] = sc_t
            self._sq[lo:hi] = sq
            if codes is not None:
                self._codes.narrow(cdim, lo, m).copy_(codes)
                self._meta[:, lo:hi] = meta
        else:
            rows_t = torch.from_numpy(rows).to(self.device)
            self._vecs.index_copy_(0, rows_t, stored)
            self._ids.index_copy_(0, rows_t, ids_t)
            self._scopes.index_copy_(1, rows_t, sc_t)
            self._sq.index_copy_(0, rows_t, sq)
            if codes is not None:
                self._codes.index_copy_(cdim, rows_t, codes)
                self._meta.index_copy_(1, rows_t, meta)
        self._row_ids[rows] = id_arr
        if n_new:
            self._sorted = None
        if self._map is not None:
            if self._n == 0 and n_new == m:
                self._map = None  # bulk load: build lazily, on the first upsert/remove
            else:
                self._map.update(zip(id_arr[fresh].tolist(), rows[fresh].tolist(), strict=True))
        self._set_n(self._n + n_new)
        if self.scan == "4bit" and self._n >= max(CODES4_FIT_ROWS, 2 * self._fit_n):
            self._refit()

    def _refit(self) -> None:
        """Centres the 4-bit codes on the mean of the live rows and encodes every row again,
        in place (captured graphs stay valid). Called as the index doubles: O(1) a row."""
        n = self._n
        total = self._torch.zeros(self.dim, dtype=self._torch.float64, device=self.device)
        for lo in range(0, n, 1 << 20):
            total += self._vecs[lo : min(n, lo + (1 << 20))].double().sum(dim=0)
        self._mean64.copy_(total / n)
        self._mean32.copy_(self._mean64.float())
        for lo in range(0, n, 1 << 20):
            hi = min(n, lo + (1 << 20))
            codes, meta = self._c4.encode(self._vecs[lo:hi], self._mean64, self._rot64)
            self._codes[:, lo:hi] = codes
            self._meta[:, lo:hi] = meta
        self._fit_n = n

    def _d4(self) -> int:
        from kalos.index.kernels import codes4

        return codes4.padded_dim(self.dim)

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
        self._sorted = None
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
            if self._codes is not None:
                cdim = 1 if self.scan == "4bit" else 0
                self._codes.index_copy_(cdim, h, self._codes.index_select(cdim, s))
                self._meta.index_copy_(1, h, self._meta.index_select(1, s))
            moved = self._row_ids[sources]
            self._row_ids[holes] = moved
            id_map.update(zip(moved.tolist(), holes.tolist(), strict=True))
        self._row_ids[n_new:n_old] = -1
        self._set_n(n_new)
        return int(rows.size)

    def reset(self) -> None:
        """Drop every item; the storage (and captured graphs) stay."""
        self._map = {}
        self._sorted = None
        self._row_ids[: self._n] = -1
        self._set_n(0)
        self._sq_max.zero_()

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
        self,
        queries: Any,
        k: int,
        *,
        scope: tuple[int, int, int] | None = None,
        allow: Any = None,
        nprobe: int = 0,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Exact top-k (``nprobe``, for approximate indexes, is ignored): (scores [nq, k]
        float32, ids [nq, k] int64), numpy copies owned by the caller. ip/cosine descending,
        l2 squared distance ascending; missing results are id -1 with score -inf (ip/cosine)
        or +inf (l2). ``allow``: ids [m] int64 (numpy, or a torch tensor on
        :attr:`filter_device`), the only ones that may be returned (a metadata filter's
        matches): see :meth:`_search_allowed`."""
        q = self.device_queries(queries)
        k = _k_in(k)
        filt = _scope_in(scope)
        if allow is not None:
            return self._search_allowed(q, k, filt, allow)
        scores, ids = self.search_device(q, k, scope=filt)
        return scores.cpu().numpy(), ids.cpu().numpy()

    def device_queries(self, queries: Any) -> Any:
        """Queries as :meth:`search` takes them (numpy or torch, [nq, dim] or [dim]), checked
        as it checks them (numeric, finite, within fp16's range for fp16 storage, except
        cosine, whose kernels search with the unit query) -> float32 [nq, dim] on this
        device, what :meth:`search_device` takes. Synchronises (the checks)."""
        fp16_query = self.metric != "cosine" and self.dtype == "fp16"
        return self._vectors_in(queries, "queries", normalise=False, fp16_check=fp16_query)

    def device_scope(self, scope: Any) -> Any:
        """A scope filter as :meth:`search` takes it -> an int64 [3] tensor on this device,
        which :meth:`search_device` reads without a copy, or None (no filter: None or all
        zeros). Copies to the device (a small sync)."""
        vals = _scope_in(scope)
        if vals is None:
            return None
        return self._torch.tensor(vals, dtype=self._torch.int64, device=self.device)

    def _search_allowed(
        self, q: Any, k: int, filt: tuple[int, int, int] | None, allow: Any
    ) -> tuple[np.ndarray, np.ndarray]:
        """The exact top-k of the rows whose id is in ``allow`` (and that match ``filt``).

        The allowed rows are found on the host for a few ids given on the host (the id map),
        on the device for many, and for ids given as a device tensor, which never come to the
        host (:meth:`_rows_on_device`). Fewer than :data:`ALLOW_GATHER_BELOW` of the rows: the
        gather path, those rows gathered on the device, scored there in fp32, then
        ``torch.topk`` (the cost follows the rows that match, not the index). More: the scan
        kernel itself, with the allowed rows as a row mask (:meth:`_search_masked`).
        q: [nq, dim]."""
        torch = self._torch
        nq = q.shape[0]
        worst = np.inf if self.metric == "l2" else -np.inf
        out_s = np.full((nq, k), worst, np.float32)
        out_i = np.full((nq, k), -1, np.int64)
        if isinstance(allow, torch.Tensor):  # on the device: matched there
            wanted_t = allow.reshape(-1).to(device=self.device, dtype=torch.int64)
            if self._n == 0 or wanted_t.numel() == 0:
                return out_s, out_i
            rows_t = self._rows_on_device(wanted_t)
        else:
            wanted = _to_numpy(allow).astype(np.int64, copy=False).reshape(-1)
            if self._n == 0 or wanted.size == 0:
                return out_s, out_i
            if wanted.size < self._n // 16:  # a few: look each up (a dict lookup each)
                get = self._id_map().get
                rows = np.fromiter((get(i, -1) for i in wanted.tolist()), np.int64, wanted.size)
                rows_t = torch.from_numpy(np.unique(rows[rows >= 0])).to(self.device)
            else:  # many: a binary search on the device, in the ids sorted there
                rows_t = self._rows_on_device(wanted)
        if rows_t.numel() == 0:
            return out_s, out_i
        if rows_t.numel() >= ALLOW_GATHER_BELOW * self._n:
            return self._search_masked(q, k, filt, rows_t)
        rows_t = torch.unique(rows_t)  # a row given twice is still one candidate
        if filt is not None:
            keep = torch.ones(rows_t.numel(), dtype=torch.bool, device=self.device)
            scopes = self._scopes.index_select(1, rows_t)  # [3, m]
            for field, want in enumerate(filt):
                if want:
                    keep &= scopes[field] == want
            rows_t = rows_t[keep]
            if rows_t.numel() == 0:
                return out_s, out_i
        vecs = self._vecs.index_select(0, rows_t).float()  # [m, dim]
        qf = q.to(self.device).float()  # [nq, dim]
        if self.metric == "cosine":
            qf = qf / qf.norm(dim=1, keepdim=True).clamp_min(1e-30)
        if self.metric == "l2":
            # [nq, m] squared distances, from differences (no |q|² - 2q·x cancellation)
            scores = torch.cdist(qf, vecs, compute_mode="donot_use_mm_for_euclid_dist").square()
        else:
            scores = qf @ vecs.T  # [nq, m]
        kk = min(k, scores.shape[1])
        best, pos = torch.topk(scores, kk, dim=1, largest=self.metric != "l2", sorted=True)
        out_s[:, :kk] = best.cpu().numpy()
        out_i[:, :kk] = self._ids.index_select(0, rows_t)[pos.reshape(-1)].reshape(nq, kk).cpu()
        return out_s, out_i

    def _rows_on_device(self, wanted: Any) -> Any:
        """The rows (device int64; unique where ``wanted`` is) of the ones of ``wanted`` ids
        (numpy, or int64 on the device) that are present:
        ``torch.searchsorted`` in the live ids sorted on the device (sorted again only after a
        write that added or moved rows), so matching many ids costs no host time per id."""
        torch = self._torch
        if self._sorted is None:
            keys, order = torch.sort(self._ids[: self._n])
            self._sorted = keys, order
        keys, order = self._sorted
        want = (
            wanted
            if isinstance(wanted, torch.Tensor)
            else torch.from_numpy(np.ascontiguousarray(wanted)).to(self.device)
        )
        pos = torch.searchsorted(keys, want).clamp_(max=keys.numel() - 1)
        return order[pos[keys[pos] == want]]

    def _search_masked(
        self, q: Any, k: int, filt: tuple[int, int, int] | None, rows_t: Any
    ) -> tuple[np.ndarray, np.ndarray]:
        """The scan kernel over every row with ``rows_t`` (device int64) as its row mask.

        The kernels' scope filter is the mask: a copy of the scope table whose third (session)
        row is 1 for an allowed row (that also matches ``filt``'s session) and 2 otherwise,
        searched with the filter (tenant, user, 1). So the mask costs the scan what a scope
        filter does, and no kernel knows of it. The copy is 24 bytes a row of device memory
        traffic (about 6 µs per million rows on an H200), made for this search and dropped
        after it (the results are synchronised to the host before)."""
        torch = self._torch
        session = torch.full((self._cap,), 2, dtype=torch.int64, device=self.device)
        session[rows_t] = 1
        if filt is not None and filt[2]:
            session = torch.where(self._scopes[2] == filt[2], session, 2)
        masked = torch.empty_like(self._scopes)  # [3, cap]
        masked[:2] = self._scopes[:2]
        masked[2] = session
        tenant, user = (0, 0) if filt is None else (filt[0], filt[1])
        table, self._scopes = self._scopes, masked
        try:
            scores, ids = self.search_device(q, k, scope=(tenant, user, 1))
            return scores.cpu().numpy(), ids.cpu().numpy()
        finally:
            self._scopes = table

    def search_many(
        self,
        members: Sequence[tuple[Any, int, tuple[int, int, int] | None]],
        *,
        nprobe: int = 0,
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Several searches, each ``(queries, k, scope)``: one :meth:`search` each (a cuda
        sidecar batches through its GPU search hook, kalos.server.gpu_search, instead)."""
        return [self.search(q, k, scope=scope) for q, k, scope in members]

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
        cascade = nq == 1 and self.scan == "4bit" and self._n >= self.prefilter_min_rows
        if cascade and self.prefilter_ok(1, k):
            self._launch(q, k, filt, scoped, scores, ids, self._workspace(1, k, prefilter=True))
            return scores, ids
        batch = self._max_batch
        ws = self._workspace(min(nq, batch), k)
        for lo in range(0, nq, batch):
            hi = min(nq, lo + batch)
            self._launch(q[lo:hi], k, filt, scoped, scores[lo:hi], ids[lo:hi], ws)
        return scores, ids

    def graph(
        self, nq: int, k: int, scope_active: bool = False, prefilter: bool = False
    ) -> SearchGraph:
        """A search of ``nq`` queries for ``k`` results captured as a CUDA graph over fixed
        buffers (see :class:`SearchGraph`; ``prefilter``: the int8 scan first, where this
        shape allows it). On the CPU (interpreter) it runs the kernels directly, with the
        same buffers."""
        return SearchGraph(self, nq, k, scope_active, prefilter=prefilter)

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

    def _two_pass(self, nq: int, k: int) -> bool:
        """Whether a batch of ``nq`` takes kernels.batch_topk's two passes: from a size bucket
        (the next power of two, as the kernels' variants go) of ``two_pass_min_batch`` on
        (the default: ``batch_topk.MIN_BATCH``, 32; 0: never), and below it a batch whose
        query the fused scan would round to the rows' type (kernels.scan_topk.dot_lanes: 9 to
        16 queries above 512 dims), since the second pass scores the fp32 query."""
        if nq < 2 or self.two_pass_min_batch <= 0 or not self._fast(nq, k):
            return False
        if self.two_pass_min_batch <= self._k.next_pow2(nq):
            return True
        return not self._k.ranks_by_fp32(nq, self._config(nq, k), self.dim, self._elem)

    def _batch4(self, nq: int, k: int) -> bool:
        """Whether a batch of ``nq`` takes the batched 4-bit cascade (kernels.codes4_batch):
        ``scan=4bit``, a size bucket (the next power of two) of at most ``batch4_max_batch``,
        k <= 64."""
        return (
            self.scan == "4bit"
            and nq > 1
            and self._k.next_pow2(nq) <= min(self.batch4_max_batch, self._b4.MAX_BATCH)
            and self._k.key_width(k) <= 64
        )

    def _programs(self, cfg: Any, k: int) -> int:
        bn = max(cfg.block_n, self._k.key_width(k))
        tiles = max(1, math.ceil(self._cap / bn))
        programs = self._sms * cfg.programs_per_sm  # _sms is 1 on the CPU
        if self._on_gpu and self.scan_config is None:
            # small capacities: >= 8 tiles a program, >= 1 program an SM (100K x 128 on an
            # H200: 132 programs 26 µs, 264 programs 33 µs)
            programs = min(programs, max(self._sms, tiles // 8))
        return max(1, min(tiles, programs))

    def _emit_programs(self) -> int:
        """The emit's programs (kernels.codes4.emit): 8 an SM (1M rows: about one block of
        rows each, on an H100 or H200); under the interpreter 8, each looping over blocks."""
        return 8 * self._sms

    def _keep(self, k: int) -> int:
        return self.prefilter_keep or self._k.prefilter_candidates(k)

    def prefilter_ok(self, nq: int, k: int) -> bool:
        """Whether a search of this shape can scan codes first: ``scan=4bit``, one query and
        a k of the fast path; ``scan=int8``, one query, k <= 32 (see :class:`SearchGraph`)."""
        if self.scan == "4bit":
            return nq == 1 and self._fast(1, k)
        return self._codes is not None and bool(self._k.prefilter_ok(nq, k, self.dim))

    def _workspace(
        self, nq: int, k: int, private: bool = False, prefilter: bool = False
    ) -> dict[str, Any]:
        """Scratch for one (batch, k): the scan's state (thresholds, group bests, survivors),
        candidates or general-path keys. Shared (cached per index, dropped when storage moves)
        unless ``private`` (graphs). Searches that share one must run one after another on one
        stream: the merge resets the state that the next scan starts from. ``prefilter``: for
        the int8 prefilter's scan, sized for its candidates."""
        key = (nq, k, prefilter)
        if not private and key in self._workspaces:
            return self._workspaces[key]
        torch = self._torch
        kern = self._k
        dev = self.device
        kk = self._keep(k) if prefilter else k  # rows kept by the scan
        kp = kern.key_width(kk)
        none = kern.KEY_NONE
        ws: dict[str, Any] = {}
        if prefilter and self.scan == "4bit":
            ws = self._workspace4(k)
            if not private:
                self._workspaces[key] = ws
            return ws
        if not prefilter and self._batch4(nq, k):
            # the row-sized scratch of the largest batch the cascade takes, shared
            most = self._k.next_pow2(min(self.batch4_max_batch, self._b4.MAX_BATCH))
            upper = self._shared("upper4", (most, self._cap), torch.float32)
            rows = self._shared("rows4", (most, self._cap), torch.int32)
            ws = self._b4.workspace(nq, k, self.dim, upper[:nq], rows[:nq], self._on_gpu)
            if not private:
                self._workspaces[key] = ws
            return ws
        if prefilter:
            cfg = self.prefilter_config or kern.choose_prefilter_config(
                self.dim, self._on_gpu, self.prefilter_mode
            )
            p = self._programs(cfg, kk)
            ws.update(cfg=cfg, programs=p, prefilter=True)
            lists = kern.key_width(min(self.prefilter_lists or kern.prefilter_lists(kk, p), kk))
            ws["cand"] = torch.empty((nq, p, lists), dtype=torch.int64, device=dev)
            # an unproven search settles from every row's bound (_launch_settle): the bounds,
            # the floor (the emit's state: thr, slots), the rows left open and their count
            ws["upper"] = self._shared("upper", (self._cap,), torch.float32)
            ws["floor"] = (
                torch.full((1,), none, dtype=torch.int64, device=dev),
                torch.full((1, kern.key_width(k)), none, dtype=torch.int64, device=dev),
            )
            ws["count"] = torch.zeros(1, dtype=torch.int32, device=dev)
            ws["rows"] = self._shared("rows", (self._cap,), torch.int32)
            ws["emit_ticket"] = torch.zeros(1, dtype=torch.int32, device=dev)
        elif self._two_pass(nq, k):
            cfg = self._config(nq, k)
            tiles = self._bt.tiles(self._cap, cfg, k)
            ws.update(cfg=cfg, programs=self._programs(cfg, k), two_pass=True)
            ws["tmax"] = torch.empty((nq, tiles), dtype=torch.float32, device=dev)
            ws["lists"] = torch.empty((nq, tiles), dtype=torch.int32, device=dev)
            # the second pass's slices a query: fewer under the interpreter (each program
            # runs in Python there)
            split = self._bt.SPLIT if self._on_gpu else 2
            ws["parts"] = torch.empty((2, nq, split, kern.key_width(k)), dtype=torch.int64,
                                      device=dev)  # fmt: skip
        elif self._fast(nq, k):
            cfg = self._config(nq, k)
            p = self._programs(cfg, k)
            ws.update(cfg=cfg, programs=p)
            ws["cand"] = torch.empty((nq, p, kp), dtype=torch.int64, device=dev)
        reps = ws["cfg"].bound_replicas if "cfg" in ws else 1  # copies of thr and slots
        ws["state"] = (
            torch.full((reps * nq,), none, dtype=torch.int64, device=dev),  # thr
            torch.full((reps * nq, kp), none, dtype=torch.int64, device=dev),  # slots
            torch.empty((nq, kern.survivors_width(kk)), dtype=torch.int64, device=dev),
        )
        ws["replicas"] = reps
        ws["ticket"] = torch.zeros(1, dtype=torch.int32, device=dev)  # the fused scan's
        if "cfg" not in ws:
            # queries a launch: within the keys' memory, and as many as score_keys scores by
            # their fp32 query at once
            most = min(
                _GENERAL_PATH_BYTES // (8 * self._cap), kern.split_batch(self.dim, self._elem)
            )
            qc = max(1, min(nq, most))
            kk = min(k, self._cap)
            ws.update(chunk=qc, kk=kk)
            ws["keys"] = self._shared("keys", (qc, self._cap), torch.int64)
            ws["top"] = torch.empty((qc, kk), dtype=torch.int64, device=dev)
            ws["top_idx"] = torch.empty((qc, kk), dtype=torch.int64, device=dev)
        if not private:
            self._workspaces[key] = ws
        return ws

    def _shared(self, name: str, shape: tuple[int, ...], dtype: Any) -> Any:
        """Scratch of ``shape`` that every workspace of this index shares, graphs' private ones
        too: a row's bound (``upper``), the rows a search left open (``rows``), the general
        path's keys. Searches run one after another on one stream, and each writes what it
        reads of these first (every live row's bound, -inf where filtered out; the open rows
        from 0 up to its own count), so one copy serves them all: a channel's graphs cost
        O(k) of device memory, not O(rows) each. Dropped when storage moves."""
        key = (name, shape)
        t = self._scratch.get(key)
        if t is None:
            t = self._scratch[key] = self._torch.empty(shape, dtype=dtype, device=self.device)
        return t

    def _workspace4(self, k: int) -> dict[str, Any]:
        """The 4-bit cascade's scratch for one query (kernels.codes4): the bounds pass's state
        and lists, every row's upper bound, the query's operands, the candidates and their
        count, and the exact pass's own full-scan workspace."""
        torch = self._torch
        kern = self._k
        dev = self.device
        c4 = self._c4
        none = kern.KEY_NONE
        kp = kern.key_width(k)
        cfg = self.prefilter_config or c4.choose_config(self.dim, self._on_gpu)
        p = self._programs(cfg, k)
        reps = cfg.bound_replicas
        return {
            "codes4": True,
            "cfg": cfg,
            "programs": p,
            "cand": torch.empty((1, p, kp), dtype=torch.int64, device=dev),
            "state": (
                torch.full((reps,), none, dtype=torch.int64, device=dev),
                torch.full((reps, kp), none, dtype=torch.int64, device=dev),
                torch.empty((1, kern.survivors_width(k)), dtype=torch.int64, device=dev),
            ),
            "upper": self._shared("upper", (self._cap,), torch.float32),
            "qc": torch.zeros((c4.chunks(self.dim), 4, 8), dtype=torch.int32, device=dev),
            "qf": torch.zeros(
                c4.QF_FIXED + 2 * c4.chunks(self.dim), dtype=torch.float32, device=dev
            ),
            "count": torch.zeros(1, dtype=torch.int32, device=dev),
            "rows": self._shared("rows", (self._cap,), torch.int32),
            "emit_ticket": torch.zeros(1, dtype=torch.int32, device=dev),
            "status": torch.zeros(2, dtype=torch.int32, device=dev),
            "exact": self._exact4_workspace(k),
        }

    def _exact4_workspace(self, k: int) -> dict[str, Any]:
        """The cascade's exact pass's workspace: a single query's scan, on ``exact4_programs``
        programs where set."""
        ex = self._workspace(1, k, private=True)
        if self.exact4_programs:
            p = ex["programs"] = self.exact4_programs
            kp = self._k.key_width(k)
            ex["cand"] = self._torch.empty((1, p, kp), dtype=self._torch.int64, device=self.device)
        return ex

    def _launch4(self, q: Any, k: int, filt: Any, scoped: bool, scores: Any, ids: Any,
                 ws: dict[str, Any], status: Any, publish: Any, gate: Any) -> None:  # fmt: skip
        # one query through the 4-bit cascade's four launches (kernels.codes4's module doc)
        kern = self._k
        c4 = self._c4
        cfg = ws["cfg"]
        c4.prep(q, self._rot32, self._mean32, ws["qc"], ws["qf"], metric=self._metric_code,
                gate=gate)  # fmt: skip
        kern.scan_topk(
            self._vecs, self._sq, self._scopes, filt, q, self._n_dev, ws["state"], ws["cand"],
            k=k, metric=self._metric_code, scoped=scoped, programs=ws["programs"], cfg=cfg,
            gate=gate, bounds4=(self._codes, self._meta, ws["upper"], ws["qc"], ws["qf"]),
        )  # fmt: skip
        c4.emit(ws["upper"], self._n_dev, ws["state"], ws["count"], ws["rows"],
                ws["emit_ticket"], k=k, replicas=cfg.bound_replicas,
                programs=self._emit_programs(), gate=gate)  # fmt: skip
        ex = ws["exact"]
        kern.scan_topk(
            self._vecs, self._sq, self._scopes, filt, q, ws["count"], ex["state"], ex["cand"],
            k=k, metric=self._metric_code, scoped=False, programs=ex["programs"], cfg=ex["cfg"],
            final=(ex["ticket"], self._ids, scores, ids), publish=publish, gate=gate,
            cands=(ws["rows"], ws["status"] if status is None else status), trace=self.trace,
        )  # fmt: skip

    def _launch_settle(self, q: Any, k: int, filt: Any, scores: Any, ids: Any,
                       ws: dict[str, Any], status: Any, publish: Any = None,
                       gate: Any = None) -> None:  # fmt: skip
        # an unproven int8 prefilter search (its workspace ws, just run): every row whose
        # bound reaches the floor, however many, scored exactly (the cascade's last two
        # launches, kernels.codes4's module doc); the scope filter is in the bounds already.
        # publish: as _launch's; gate: as _launch's, for both launches
        kern = self._k
        self._c4.emit(ws["upper"], self._n_dev, ws["floor"], ws["count"], ws["rows"],
                      ws["emit_ticket"], k=k, replicas=1, programs=self._emit_programs(),
                      gate=gate)  # fmt: skip
        ex = ws.get("exact")
        if ex is None:  # its own program count, as a single query's scan
            ex = ws["exact"] = self._workspace(1, k, private=True)
        kern.scan_topk(
            self._vecs, self._sq, self._scopes, filt, q, ws["count"], ex["state"], ex["cand"],
            k=k, metric=self._metric_code, scoped=False, programs=ex["programs"], cfg=ex["cfg"],
            final=(ex["ticket"], self._ids, scores, ids), cands=(ws["rows"], status),
            publish=publish, gate=gate,
        )  # fmt: skip

    def _launch(
        self,
        q: Any,
        k: int,
        filt: Any,
        scoped: bool,
        scores: Any,
        ids: Any,
        ws: dict[str, Any],
        status: Any = None,
        publish: Any = None,
        gate: Any = None,
    ) -> None:
        # q: [nq, dim] (nq <= max batch); scores: [nq, k] fp32; ids: [nq, k] int64;
        # status: [1] int32, set by the prefilter's scan (a prefilter workspace); publish:
        # (seq, dest), the prefilter's scan stores seq at dest once proven (kernels.scan_topk);
        # gate: [1] int32 on the device, 0 there makes the prefilter's scan do nothing
        torch = self._torch
        kern = self._k
        nq = q.shape[0]
        if ws.get("codes4"):
            self._launch4(q, k, filt, scoped, scores, ids, ws, status, publish, gate)
            return
        if ws.get("codes4_batch"):
            self._b4.search(
                self._vecs, self._sq, self._scopes, filt, q, self._n_dev, self._ids, self._codes,
                self._meta, self._rot32, self._mean32, ws, scores, ids, k=k,
                metric=self._metric_code, scoped=scoped, programs=self._programs(ws["cfg"], k),
                emit_programs=self._emit_programs(),
            )  # fmt: skip
            return
        if ws.get("two_pass"):
            if not self._two_pass(nq, k):  # a tail batch below the two passes' size
                self._launch(q, k, filt, scoped, scores, ids, self._workspace(nq, k))
                return
            self._bt.search(
                self._vecs, self._sq, self._sq_max, self._scopes, filt, q, self._n_dev, self._ids,
                ws["tmax"], ws["lists"], ws["parts"], scores, ids, k=k, metric=self._metric_code,
                scoped=scoped, programs=ws["programs"], cfg=ws["cfg"], split=ws["parts"].shape[2],
            )  # fmt: skip
            return
        if "cand" in ws and (ws.get("prefilter") or self._fast(nq, k)):
            p = ws["programs"]
            prefilter = settle = None
            if ws.get("prefilter"):  # one query: its workspace's candidates as they are
                cand = ws["cand"]
                keep, lists = self._keep(k), cand.shape[2]
                prefilter = (self._codes, self._meta, status, self.prefilter_mode, keep, lists)
                settle = (ws["upper"], ws["floor"][0])
            else:
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
                prefilter=prefilter,
                publish=publish,
                gate=gate,
                trace=self.trace,
                settle=settle,
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
                replicas=ws["replicas"],
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

    def _vectors_in(
        self, v: Any, what: str, normalise: bool = True, fp16_check: bool | None = None
    ) -> Any:
        """-> float32 [n, dim] torch tensor on the device; validated; unit rows for cosine
        (when ``normalise``); values within fp16's range where ``fp16_check`` (default: when
        ``normalise`` and the storage is fp16). Host arrays of up to :data:`_HOST_CHECKED`
        values (queries) are checked on the host, before their one upload: no device
        reductions, no syncs."""
        torch = self._torch
        if fp16_check is None:
            fp16_check = normalise and self.dtype == "fp16"
        if isinstance(v, torch.Tensor):
            t = v.detach()
            if not (t.is_floating_point()):
                raise InvalidRequest(f"{what} must be floating point, got {t.dtype}")
            t = t.to(device=self.device, dtype=torch.float32)
        else:
            a = np.asarray(v)
            if a.dtype.kind not in "fiu":
                raise InvalidRequest(f"{what} must be numeric, got {a.dtype}")
            a = np.ascontiguousarray(a, dtype=np.float32)
            if a.size <= _HOST_CHECKED:
                a = self._checked_on_host(a.reshape(1, -1) if a.ndim == 1 else a, what,
                                          normalise, fp16_check)  # fmt: skip
                return torch.from_numpy(a).to(self.device)
            t = torch.from_numpy(a).to(self.device)
        if t.dim() == 1:
            t = t.unsqueeze(0)
        self._check_shape(tuple(t.shape), what)
        if t.numel() and not bool(torch.isfinite(t).all()):
            raise InvalidRequest(f"{what} contain NaN or inf")
        if normalise and self.metric == "cosine" and t.numel():
            nrm = t.norm(dim=1, keepdim=True)
            t = t / torch.where(nrm > 0, nrm, torch.ones_like(nrm))
        if fp16_check and t.numel() and float(t.abs().max()) > _FP16_MAX:
            raise InvalidRequest(_fp16_range(what, normalise))
        return t.contiguous()

    def _check_shape(self, shape: tuple[int, ...], what: str) -> None:
        if len(shape) != 2 or shape[1] != self.dim:
            raise InvalidRequest(f"{what} must be [n, {self.dim}], got {shape}")

    def _checked_on_host(
        self, a: np.ndarray, what: str, normalise: bool, fp16_check: bool
    ) -> np.ndarray:
        """:meth:`_vectors_in`'s checks of a small float32 host array, on the host."""
        self._check_shape(a.shape, what)
        if a.size and not np.isfinite(a).all():
            raise InvalidRequest(f"{what} contain NaN or inf")
        if normalise and self.metric == "cosine" and a.size:
            nrm = np.linalg.norm(a, axis=1, keepdims=True)
            a = a / np.where(nrm > 0, nrm, np.float32(1))
        if fp16_check and a.size and float(np.abs(a).max()) > _FP16_MAX:
            raise InvalidRequest(_fp16_range(what, normalise))
        return np.ascontiguousarray(a, dtype=np.float32)

    def __repr__(self) -> str:
        return (
            f"CudaFlatIndex(spec={self.spec!r}, dim={self.dim}, metric={self.metric!r}, "
            f"n={self._n}, capacity={self._cap}, device={str(self.device)!r})"
        )

    # ------------------------------------------------------------------------------ warm-up

    def warm(
        self,
        *,
        publish: bool = True,
        gated: bool = True,
        stop: Callable[[], bool] | None = None,
        precompile: bool | None = None,
    ) -> int:
        """Compiles (or loads from Triton's disk cache) every kernel variant that a search on
        this index can launch from now on, whatever it grows to, so that none waits for a
        compile: each k bucket (``key_width``: the fast path up to its limit, ``score_keys``
        + ``torch.topk`` above), each batch bucket up to ``max_batch`` (and the tail batch of
        a larger search), the scope filter on and off, the int8 prefilter (whatever ``n`` is
        now), with the sequence publish (``publish``) and behind the doorbell's gate
        (``gated``), and each class of program count the capacity can still reach (the
        candidates' chunk and list widths follow it). The launches run on a scratch index of
        the same dim, dtype, metric and launch settings: the live rows are not touched.
        ``stop``: polled between launches; when it turns true, raises InterruptedError.
        ``precompile`` (default: on a GPU): first a dry run of the same launches, whose
        variants worker processes compile in parallel into the disk cache
        (:mod:`kalos.index.kernels.precompile`); what they did is ``self.precompiled``, with
        ``unforeseen``: the variants the real launches took that the workers did not compile,
        and the seconds of the dry run (``dry_s``) and of the real launches (``launches_s``:
        each variant loaded from the cache, or compiled if unforeseen, and run).
        Returns the number of launches (seconds on the H200 from a warm disk cache; a cold
        one compiles each variant once)."""
        if self._on_gpu if precompile is None else precompile:
            from kalos.index.kernels import precompile as pre

            t0 = time.perf_counter()
            with pre.recording() as noted:
                self._warm_launches(publish, gated, stop, dry=True)
            found = pre.variants(noted)
            dry_s = time.perf_counter() - t0
            device = self.device.index if self.device.index is not None else 0
            done = pre.compile_all(
                found, device=device, workers=pre.workers_for(len(found)), stop=stop
            )
            ahead = set(done.pop("keys"))
            t0 = time.perf_counter()
            with pre.compiles() as taken:
                launches = self._warm_launches(publish, gated, stop, dry=False)
            unforeseen = sorted({name for key, name in taken if key not in ahead})
            done["unforeseen"] = len(unforeseen)
            done["dry_s"] = round(dry_s, 2)
            done["launches_s"] = round(time.perf_counter() - t0, 2)
            if unforeseen:
                log.warning(
                    "kernel warm-up: %d variants the precompile did not foresee compiled one "
                    "at a time, e.g. %s", len(unforeseen), unforeseen[0],
                )  # fmt: skip
            self.precompiled = done
            return launches
        return self._warm_launches(publish, gated, stop, dry=False)

    def _warm_launches(
        self, publish: bool, gated: bool, stop: Callable[[], bool] | None, dry: bool
    ) -> int:
        """:meth:`warm`'s launches; ``dry``: while a recording notes them, without the graph
        that ends a real warm-up (its launches are those of the searches before it)."""
        torch = self._torch
        kern = self._k
        dev = self.device
        on_gpu = self._on_gpu
        scratch = CudaFlatIndex(
            dim=self.dim, metric=self.metric, spec=self.spec, device=str(dev), dtype=self.dtype,
            scan=self.scan,
        )  # fmt: skip
        for name in ("scan_config", "prefilter_config", "prefilter_mode", "prefilter_keep",
                     "prefilter_lists", "two_pass_min_batch", "batch4_max_batch"):  # fmt: skip
            setattr(scratch, name, getattr(self, name))
        scratch.prefilter_min_rows = 0  # its graph below takes the prefilter too
        rng = np.random.default_rng(0)
        rows = 64
        scratch.add(
            rng.standard_normal((rows, self.dim)).astype(np.float32),
            np.arange(1, rows + 1, dtype=np.int64),
            np.tile(np.array([1, 2, 3], dtype=np.int64), (rows, 1)),
        )
        batch = self._max_batch
        queries = torch.from_numpy(rng.standard_normal((batch, self.dim)).astype(np.float32))
        queries = queries.to(dev)
        scope = torch.tensor([1, 0, 0], dtype=torch.int64, device=dev)
        status = torch.zeros(2, dtype=torch.int32)  # a graph's verdict and candidates
        dest = torch.zeros(1, dtype=torch.int64)  # a response's sequence word, in host memory
        if on_gpu:
            status, dest = status.pin_memory(), dest.pin_memory()
        seq = torch.ones(1, dtype=torch.int64, device=dev)
        gate = torch.zeros(1, dtype=torch.int32, device=dev)  # closed: compiled, scans nothing
        settle_gate = torch.zeros(1, dtype=torch.int32, device=dev)  # closed too
        tally = torch.zeros(2, dtype=torch.int64)  # the doorbell's settles, in host memory
        if on_gpu:
            tally = tally.pin_memory()
        launches = 0

        def programs_at(cfg: Any, kept: int, cap: int) -> int:
            # this index's program count at capacity ``cap`` (_programs reads only these)
            shape = SimpleNamespace(
                _cap=cap, _sms=self._sms, _on_gpu=on_gpu, scan_config=self.scan_config, _k=kern
            )
            return int(CudaFlatIndex._programs(shape, cfg, kept))  # type: ignore[arg-type]

        def program_classes(cfg: Any, kept: int, cap: int, prefilter: bool) -> list[int | None]:
            # One program count per class of what depends on it: the lists' width (the
            # prefilter's, as _workspace sets it) and next_pow2(programs * width), which fixes
            # the chunk of merge_topk's selection (the fused scan's is one for every grid).
            # The count grows with the capacity (never shrinks), up to its value at any size.
            if cfg is None:  # the general path: no programs
                return [None]
            classes: dict[tuple[int, int], int] = {}
            for p in range(programs_at(cfg, kept, cap), programs_at(cfg, kept, 1 << 40) + 1):
                if prefilter:
                    lists = self.prefilter_lists or kern.prefilter_lists(kept, p)
                    width = kern.key_width(min(lists, kept))
                else:
                    width = kern.key_width(kept)
                classes.setdefault((width, kern.next_pow2(p * width)), p)
            return list(classes.values())

        def run(nq: int, k: int, scoped: bool, prefilter: bool = False, publishing: bool = False,
                gating: bool = False, ws_nq: int | None = None) -> None:  # fmt: skip
            # every class of one variant; ws_nq: the workspace's batch, when larger (a tail)
            nonlocal launches
            wnq = ws_nq or nq
            if prefilter and self.scan == "4bit":
                run4(k, scoped, publishing, gating)
                return
            if prefilter:
                kept = self._keep(k)
                cfg = self.prefilter_config or kern.choose_prefilter_config(
                    self.dim, on_gpu, self.prefilter_mode
                )
                cap = max(self._cap, self.prefilter_min_rows)  # it runs only from there on
            else:
                kept = k
                cfg = self._config(wnq, k) if self._fast(wnq, k) else None
                cap = self._cap
            for p in program_classes(cfg, kept, cap, prefilter):
                if stop is not None and stop():
                    raise InterruptedError("stopped during the kernel warm-up")
                if p is not None:
                    scratch._programs = lambda cfg, k, p=p: p  # type: ignore[method-assign,misc]
                try:
                    ws = scratch._workspace(wnq, k, private=True, prefilter=prefilter)
                finally:
                    scratch.__dict__.pop("_programs", None)
                scores = torch.empty((nq, k), dtype=torch.float32, device=dev)
                ids = torch.empty((nq, k), dtype=torch.int64, device=dev)
                scratch._launch(
                    queries[:nq], k, scope if scoped else scratch._no_filter, scoped, scores,
                    ids, ws, status, (seq, dest) if publishing else None,
                    gate if gating else None,
                )  # fmt: skip
                launches += 1
            if prefilter and "floor" in ws:
                # an unproven search's settle: its emit, and its exact pass in each class of
                # a single query's program count (publishing as its graph does; gated behind
                # the doorbell's scan, SearchGraph.queue_gated, with the gate's own kernel)
                if gating:
                    self._c4.settle_gate(gate, status, settle_gate)
                    self._c4.tally_settle(settle_gate, status, tally)
                for p1 in program_classes(self._config(1, k), k, cap, False):
                    scratch._programs = lambda cfg, k, p1=p1: p1  # type: ignore[method-assign,misc]
                    try:
                        ws.pop("exact", None)
                        scratch._launch_settle(
                            queries[:1], k, scratch._no_filter, scores, ids, ws, status,
                            (seq, dest) if publishing else None, settle_gate if gating else None,
                        )  # fmt: skip
                    finally:
                        scratch.__dict__.pop("_programs", None)
                    launches += 1

        def run4(k: int, scoped: bool, publishing: bool, gating: bool) -> None:
            # the 4-bit cascade: its bounds pass and its exact pass each take a program count
            # of their own (_workspace4), so every class of each, paired up
            nonlocal launches
            cfg4 = self.prefilter_config or self._c4.choose_config(self.dim, on_gpu)
            cap = max(self._cap, self.prefilter_min_rows)  # it runs only from there on
            bounds = program_classes(cfg4, k, cap, False)
            exact = program_classes(self._config(1, k), k, cap, False)
            for i in range(max(len(bounds), len(exact))):
                if stop is not None and stop():
                    raise InterruptedError("stopped during the kernel warm-up")
                p4, p1 = bounds[min(i, len(bounds) - 1)], exact[min(i, len(exact) - 1)]

                def programs(cfg: Any, k: int, p4: int | None = p4, p1: int | None = p1) -> Any:
                    return p1 if cfg.fused else p4

                scratch._programs = programs  # type: ignore[method-assign]
                try:
                    ws = scratch._workspace(1, k, private=True, prefilter=True)
                finally:
                    scratch.__dict__.pop("_programs", None)
                scores = torch.empty((1, k), dtype=torch.float32, device=dev)
                ids = torch.empty((1, k), dtype=torch.int64, device=dev)
                scratch._launch(
                    queries[:1], k, scope if scoped else scratch._no_filter, scoped, scores, ids,
                    ws, status, (seq, dest) if publishing else None, gate if gating else None,
                )  # fmt: skip
                launches += 1

        ks = [kern.key_width(1) << i for i in range(int(math.log2(_MAX_K)))]  # 2 .. 1024
        nqs = [1 << i for i in range(int(math.log2(batch)) + 1)]  # 1 .. max_batch
        publishing = publish and bool(kern.publish_ok())
        with torch.cuda.device(dev) if on_gpu else _nullcontext():
            for scoped in (False, True):
                for nq in nqs:
                    for k in ks:
                        run(nq, k, scoped)
                for k in ks:
                    if self.prefilter_ok(1, k):
                        run(1, k, scoped, prefilter=True)
                        if publishing:
                            run(1, k, scoped, prefilter=True, publishing=True)
                            if gated:
                                run(1, k, scoped, True, True, gating=True)
                for nq in nqs[:-1]:  # the last batch of a search of more than max_batch
                    for k in ks:
                        if self._fast(batch, k):
                            run(nq, k, scoped, ws_nq=batch)
            # the host path's own work (validation, copies) and one captured graph
            scratch.search(queries[:1].cpu().numpy(), 10)
            if on_gpu and not dry:
                graph = scratch.graph(1, 10, prefilter=True)
                graph.replay_and_wait(torch.cuda.current_stream(dev))
                torch.cuda.current_stream(dev).synchronize()
        return launches


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

    ``prefilter`` (where the index allows it: ``scan=int8``, one query, k <= 32, dim 32..256)
    captures a second graph that scans the int8 codes instead of the stored rows: about half
    the bytes (dim + 12 a row against 2 dim at fp16), then an exact re-rank of the rows of
    highest score bound (``prefilter_candidates(k)``), and a flag that says whether the bound
    proves the result exact. Such a graph is run with :meth:`replay_and_wait`, which takes the
    prefilter once the index holds ``index.prefilter_min_rows`` live rows (where it pays) and
    checks the flag. An unproven search (``fallbacks`` counts those; the bound is loose where
    many rows score within ~1% of the k-th best) settles in a third graph: every row whose
    int8 bound reaches the k-th best exact score of the re-ranked rows, however many, is
    scored exactly (``settled_rows``: how many, the last time), instead of a full scan. The
    result is the full scan's, up to the order of exact ties. (The 4-bit cascade's graph
    settles every search in one graph.) :meth:`queue_gated` queues the prefilter and its
    settle with no host in between: the settle's gate is the scan's own verdict.

    ``publish`` (with ``prefilter``): (seq [1] int64 on the device, dest [1] int64 in host
    memory registered for the GPU). A proven prefilter search, or its settle, then stores seq
    into dest once its results are visible to the host (:func:`kernels.scan_topk`): a
    response's sequence word, so that the client reads the response before this process has
    seen the stream end. :meth:`replay_and_wait` says whether that happened.

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
        prefilter: bool = False,
        publish: tuple[Any, Any] | None = None,
    ) -> None:
        torch = index._torch
        if not isinstance(nq, int) or not 1 <= nq <= index._max_batch:
            raise InvalidRequest(f"graph batch must be 1..{index._max_batch}, got {nq!r}")
        self.index = index
        self.nq = nq
        self.k = _k_in(k)
        self.scope_active = bool(scope_active)
        self.prefilter = bool(prefilter) and index.prefilter_ok(nq, self.k)
        self.fallbacks = 0  # prefiltered searches not proven (settled in a second graph)
        self.settled_rows = 0  # the rows the last of them scored exactly
        # the prefilter (or the 4-bit cascade's exact pass) stores a sequence number once
        # proven (see the class doc)
        self.publish = publish if self.prefilter and index._k.publish_ok() else None
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
        # the prefilter's verdict, in host memory the kernel writes (pinned on a GPU)
        status = torch.zeros(2, dtype=torch.int32)  # verdict; the 4-bit cascade's candidates
        self._status = status.pin_memory() if index._on_gpu else status
        self._status_np = self._status.numpy()
        self._graphs: list[Any] = []  # [full scan, prefilter, settle] CUDA graphs (GPU only)
        self._launchers: list[Any] = []  # replay_and_wait's driver launchers of them
        self._started: tuple[Any, Any] | None = None  # start's: (its graph, GraphLaunch)
        self._generation = -1
        self._capture()

    @property
    def cuda_graph(self) -> Any:
        """The captured graph of the full scan; None on the CPU."""
        return self._graphs[0] if self._graphs else None

    def prefilter_cuda_graph(self) -> Any:
        """The prefilter's captured graph (captured now if it was not yet); None on the CPU.
        Replaying it alone skips the check of its proof (benchmarks)."""
        if not self.prefilter:
            raise InvalidRequest("this search graph has no prefilter")
        self._ensure(True)
        return self._graphs[1] if len(self._graphs) > 1 else None

    def _run(self, prefilter: bool = False, gate: Any = None) -> None:
        filt = self.scope if self.scope_active else self.index._no_filter
        ws = self._ws[1] if prefilter else self._ws[0]
        self.index._launch(
            self.query, self.k, filt, self.scope_active, self.scores, self.ids, ws, self._status,
            self.publish if prefilter else None, gate,
        )  # fmt: skip

    def _run_settle(self, gate: Any = None) -> None:
        filt = self.scope if self.scope_active else self.index._no_filter
        self.index._launch_settle(self.query, self.k, filt, self.scores, self.ids, self._ws[1],
                                  self._status, self.publish, gate)  # fmt: skip

    def queue_gated(self, gate: Any, settle_gate: Any, tally: Any) -> None:
        """Queues the prefilter's pass on the current stream behind a gate, as the doorbell's
        armed graph does (server.doorbell): ``gate`` ([1] int32 on the device) 0 makes it do
        nothing. Where an unproven search settles from its bounds (the int8 prefilter), that
        settle follows, gated on the scan's verdict (``settle_gate``, [1] int32 on the device,
        set by kernels.codes4.settle_gate), and publishes: no host between the scan and the
        settle. Each such settle adds 1 and its rows scored exactly to ``tally`` ([2]
        int64). The 4-bit cascade settles every search in its own pass. The prefilter's
        workspace must exist (the graph has run :meth:`replay_and_wait` with it)."""
        self._run(True, gate=gate)
        if self._settles():
            c4 = self.index._c4
            c4.settle_gate(gate, self._status, settle_gate)
            self._run_settle(settle_gate)
            c4.tally_settle(settle_gate, self._status, tally)

    def _settles(self) -> bool:
        """Whether an unproven prefilter search settles from its bounds (the int8 prefilter's
        workspace has them) rather than in a full scan."""
        return len(self._ws) > 1 and "floor" in self._ws[1]

    def _capture(self) -> None:
        """The full scan's workspace and graph; the prefilter's come on first use (_ensure),
        since below prefilter_min_rows it never runs."""
        self._ws = [self.index._workspace(self.nq, self.k, private=True)]
        self._generation = self.index._generation
        self._graphs = []
        self._launchers = []
        self._capture_one(False)

    def _ensure(self, prefilter: bool) -> None:
        """Recaptures after the index reallocated; adds the prefilter's part when needed."""
        if self.index._generation != self._generation:
            self._capture()
        if prefilter and len(self._ws) == 1:
            self._ws.append(self.index._workspace(self.nq, self.k, private=True, prefilter=True))
            self._launchers = []
            self._capture_one(True)
            if self._settles():
                self._capture_one(False, settle=True)

    def _capture_one(self, prefilter: bool, settle: bool = False) -> None:
        index = self.index
        if not index._on_gpu:
            return
        torch = index._torch
        stream = torch.cuda.Stream(device=index.device)
        stream.wait_stream(torch.cuda.current_stream(index.device))
        run = self._run_settle if settle else lambda: self._run(prefilter)
        with torch.cuda.stream(stream):
            run()  # compiles the kernels, outside the capture
        torch.cuda.current_stream(index.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            run()
        torch.cuda.current_stream(index.device).wait_stream(stream)
        self._graphs.append(graph)

    def replay(self) -> None:
        """Run the search on torch's current stream: no host sync, no allocation (except a
        recapture after the index reallocated its storage). Not for a prefiltered graph,
        whose check needs the host: use :meth:`replay_and_wait`."""
        if self.prefilter:
            raise InvalidRequest("a prefiltered search graph runs with replay_and_wait")
        self._ensure(False)
        if not self._graphs:
            self._run()
        else:
            self._graphs[0].replay()

    def start(self, stream: Any) -> Any:
        """The full scan launched on ``stream`` (torch's current stream) and not waited for:
        returns its ``driver.GraphLaunch`` (``wait()``, then the results are in ``scores``
        and ``ids``; ``done()`` asks without waiting). None,
        with nothing launched, where the search needs the host between its passes (a
        prefiltered graph, once the index is large enough to take it) or has no captured
        graph (the interpreter): run it with :meth:`replay_and_wait`."""
        index = self.index
        if self.prefilter and index._n >= index.prefilter_min_rows:
            return None
        self._ensure(False)
        if not self._graphs:
            return None
        if self._started is None or self._started[0] is not self._graphs[0]:
            from kalos.gpu import driver

            if self._started is not None:  # a recaptured graph: the old one's events go
                self._started[1].close()
            graph = self._graphs[0]
            launch = driver.GraphLaunch(graph.raw_cuda_graph_exec(), stream.cuda_stream)
            self._started = (graph, launch)
        launch = self._started[1]
        launch()
        return launch

    def replay_and_wait(self, stream: Any) -> bool:
        """:meth:`replay` on ``stream`` (torch's current stream, as there), then wait for it:
        launched and waited for through the driver (:func:`kalos.gpu.driver.graph_launcher`),
        which saves torch's per-replay bookkeeping: at 1M x 128 on the H200, replay + sync
        87.3 µs against 92.2 with torch's. A prefiltered graph
        runs the prefilter first, then settles its result when it is not proven.

        Returns whether the answer is the prefilter's, proven or settled from its bounds:
        with ``publish``, the kernel has then stored the sequence number (the full scan never
        does)."""
        index = self.index
        prefilter = self.prefilter and index._n >= index.prefilter_min_rows
        self._ensure(prefilter)

        def run(which: int) -> None:  # 0 the full scan, 1 the prefilter, 2 the settle
            if self._graphs:
                self._launcher(stream, which)()
            elif which == 2:  # the interpreter: runs synchronously
                self._run_settle()
            else:
                self._run(which == 1)

        if prefilter:
            index.prefilter_searches += 1
            run(1)
            if self._status_np[0] == 1:
                return True
            self.fallbacks += 1
            index.prefilter_fallbacks += 1
            if self._settles():
                run(2)
                self._settled()
                return True
        run(0)
        return False

    def _launcher(self, stream: Any, which: int) -> Any:
        """The driver's launcher of graph ``which`` (full scan, prefilter, settle)."""
        if not self._launchers:
            from kalos.gpu import driver

            index = self.index
            self._launchers = [
                driver.graph_launcher(
                    g.raw_cuda_graph_exec(), stream.cuda_stream, index.device.index
                )
                for g in self._graphs
            ]
        return self._launchers[which]

    def _settled(self) -> None:
        rows = int(self._status_np[1])  # the settle pass's candidates
        self.settled_rows = rows
        self.index.prefilter_settled_rows += rows


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
