"""The float64 reference and the checker shared by the CudaFlatIndex tests: on the CPU under
TRITON_INTERPRET=1 (tests/index/test_cuda_flat_interp.py) and on a GPU at full size
(tests/gpu/test_cuda_flat_gpu.py). Importing it imports torch, never triton.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

from kalos.index.cuda_flat import CudaFlatIndex

_UNIT_ROUNDOFF = {"fp16": 2.0**-11, "bf16": 2.0**-8, "fp32": 2.0**-20}
_TORCH_DTYPE = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


def make_index(metric: str, dtype: str, dim: int, device: str) -> CudaFlatIndex:
    return CudaFlatIndex(
        dim=dim, metric=metric, spec=f"cuda:flat,{dtype}", device=device, dtype=dtype
    )


def anisotropic(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    """Real embeddings' shape: a shared mean direction, a decaying spectrum, clusters."""
    mean = rng.standard_normal(dim) * 3.0 / np.sqrt(dim)
    spectrum = np.arange(1, dim + 1) ** -0.8
    centres = rng.standard_normal((8, dim)) * spectrum
    x = mean + centres[rng.integers(0, 8, n)] + 0.3 * rng.standard_normal((n, dim)) * spectrum
    return x.astype(np.float32)


def unprovable_rows(
    rng: np.random.Generator, dim: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """400 rows over which the int8 prefilter cannot prove a search along ``base``: 150
    near-copies of ``base``, closer to each other than the int8 bound, then 250 random rows
    (a random query is proven there). Returns (rows f32 [400, dim], ids i64 from 1, base)."""
    base = rng.standard_normal(dim).astype(np.float32)
    near = base + 1e-3 * rng.standard_normal((150, dim)).astype(np.float32)
    x = np.concatenate([near, rng.standard_normal((250, dim)).astype(np.float32)])
    ids = rng.permutation(400).astype(np.int64) + 1
    return x, ids, base


def stored_vectors(metric: str, dtype: str, x: np.ndarray) -> np.ndarray:
    """float64 of what the index stores: cosine rows normalised in float32, then rounded."""
    x = x.astype(np.float32)
    if metric == "cosine":
        nrm = np.linalg.norm(x, axis=1, keepdims=True)
        x = x / np.where(nrm > 0, nrm, 1)
    t = torch.from_numpy(np.ascontiguousarray(x)).to(getattr(torch, _TORCH_DTYPE[dtype]))
    return t.double().numpy()


# The last few stored rows, by their contents (a 1M x 384 reference takes seconds to round;
# a checksum of the rows, a fraction of that): the 1M tests check many queries of one x
_STORED: dict[tuple, tuple[np.ndarray, float]] = {}


def _stored(metric: str, dtype: str, x: np.ndarray) -> tuple[np.ndarray, float]:
    """(stored_vectors, the largest stored row's norm), kept for the same x's contents."""
    x32 = np.ascontiguousarray(x, dtype=np.float32)
    key = (metric, dtype, x32.shape, zlib.crc32(x32.data))
    if key not in _STORED:
        xs = stored_vectors(metric, dtype, x32)
        xn = float(np.sqrt(np.einsum("ij,ij->i", xs, xs).max())) if len(xs) else 0.0
        while len(_STORED) >= 2:
            _STORED.pop(next(iter(_STORED)))
        _STORED[key] = (xs, xn)
    return _STORED[key]


def ref_scores(metric: str, dtype: str, x: np.ndarray, q: np.ndarray) -> np.ndarray:
    """[nq, n] float64: inner products (ip, cosine) or squared distances (l2)."""
    xs = _stored(metric, dtype, x)[0]
    qd = q.astype(np.float64)
    if metric == "cosine":
        qd = qd / np.linalg.norm(qd, axis=1, keepdims=True)
    if metric == "l2":
        return (qd**2).sum(1)[:, None] - 2 * qd @ xs.T + (xs**2).sum(1)[None, :]
    return qd @ xs.T


def tolerance(metric: str, dtype: str, x: np.ndarray, q: np.ndarray) -> np.ndarray:
    """[nq] bound on |kernel score - reference|: the query is rounded to the storage dtype for
    the dot (|dq.x| <= u |q| |x|), plus fp32 accumulation; l2 adds fp32 cancellation."""
    xn = _stored(metric, dtype, x)[1]
    qn = np.linalg.norm(q.astype(np.float64), axis=1)
    if metric == "cosine":
        qn = np.ones_like(qn)
    u = _UNIT_ROUNDOFF[dtype]
    tol = (2 * u + 2e-4) * qn * xn + 1e-6
    if metric == "l2":
        tol = 2 * tol + 1e-5 * (qn**2 + xn**2)
    return tol


def check_search(idx, x, ids, scopes, q, k, scope=None):
    """Search through the device path with poisoned outputs and hold the answer against the
    float64 reference over the live items that match ``scope``."""
    q = np.atleast_2d(np.asarray(q, dtype=np.float32))
    nq = len(q)
    qt = torch.from_numpy(q).to(idx.device)
    s_out = torch.full((nq, k), float("nan"), dtype=torch.float32, device=idx.device)
    i_out = torch.full((nq, k), -7, dtype=torch.int64, device=idx.device)
    idx.search_device(qt, k, scope=scope, out=(s_out, i_out))
    s, got = s_out.cpu().numpy(), i_out.cpu().numpy()
    assert not np.isnan(s).any(), "an output score was not written"
    assert not (got == -7).any(), "an output id was not written"
    # the host path must agree exactly
    _, got_host = idx.search(q, k, scope=scope)
    np.testing.assert_array_equal(got_host, got)
    check_result(idx, x, ids, scopes, q, k, s, got, scope)


def check_graph_search(idx, x, ids, scopes, q, k, scope=None, prefilter=True):
    """The same check through a single-query search graph (``prefilter``: the int8 scan
    first, as the sidecar's graphs), run with replay_and_wait; returns the graph."""
    q = np.atleast_2d(np.asarray(q, dtype=np.float32))
    idx.prefilter_min_rows = 0  # at any size (it pays from ~1M rows on)
    g = idx.graph(1, k, scope_active=scope is not None, prefilter=prefilter)
    for i in range(len(q)):
        g.query.copy_(torch.from_numpy(q[i : i + 1]))
        if scope is not None:
            g.scope.copy_(torch.tensor(scope, dtype=torch.int64))
        g.scores.fill_(float("nan"))
        g.ids.fill_(-7)
        g.replay_and_wait(torch.cuda.current_stream() if idx.device.type == "cuda" else None)
        s, got = g.scores.cpu().numpy(), g.ids.cpu().numpy()
        assert not np.isnan(s).any(), "an output score was not written"
        assert not (got == -7).any(), "an output id was not written"
        check_result(idx, x, ids, scopes, q[i : i + 1], k, s, got, scope)
    return g


def check_result(idx, x, ids, scopes, q, k, s, got, scope=None):
    """Holds scores ``s`` and ids ``got`` [nq, k] against the float64 reference over the live
    items that match ``scope``: every true top-k item is there (beyond ties), sorted."""
    nq = len(q)
    ascending = idx.metric == "l2"
    ref = ref_scores(idx.metric, idx.dtype, x, q)
    tol = tolerance(idx.metric, idx.dtype, x, q)
    match = np.ones(len(ids), dtype=bool)
    if scope is not None and scopes is not None:
        for f in range(3):
            if scope[f] != 0:
                match &= scopes[:, f] == scope[f]
    for i in range(nq):
        cand, cid = ref[i][match], np.asarray(ids)[match]
        kk = min(k, len(cand))
        valid = got[i, :kk]
        assert (got[i, kk:] == -1).all(), "missing results must be id -1"
        assert (s[i, kk:] == (np.inf if ascending else -np.inf)).all()
        assert -1 not in valid.tolist() and len(set(valid.tolist())) == kk, "duplicate or -1 id"
        # each returned id's reference score (the ids are distinct)
        order = np.argsort(cid, kind="stable")
        at = np.minimum(np.searchsorted(cid, valid, sorter=order), len(cid) - 1)
        loc = order[at] if len(cid) else at
        assert (cid[loc] == valid).all(), "returned a removed or filtered item"
        r = cand[loc]
        assert np.all(np.abs(s[i, :kk] - r) <= tol[i]), (s[i, :kk], r, tol[i])
        step = np.diff(s[i, :kk])
        assert np.all(step >= 0) if ascending else np.all(step <= 0), "not sorted"
        if kk:
            srt = np.sort(cand) if ascending else -np.sort(-cand)
            kth = srt[kk - 1]
            if ascending:
                must, ok = cid[cand < kth - tol[i]], r <= kth + tol[i]
            else:
                must, ok = cid[cand > kth + tol[i]], r >= kth - tol[i]
            assert set(must.tolist()) <= set(valid.tolist()), "missed a true top-k item"
            assert ok.all(), "returned an item outside the top-k (beyond ties)"


def round_to(x, dtype):
    """x (any float array) rounded to the storage type, as float64."""
    if dtype == "bf16":
        return torch.from_numpy(np.asarray(x, np.float32)).to(torch.bfloat16).double().numpy()
    return np.asarray(x).astype(np.float16).astype(np.float64)


def rounding_flips_the_order(rng, dim, dtype="fp16"):
    """(q, a, b): rows a and b exact in the storage type (fp16 or bf16), b the better one for
    the fp32 query q by 1e-3 or more, and the worse one by as much for q rounded to that type
    (a batch's tensor-core dot takes its operands so)."""
    q = rng.standard_normal(dim).astype(np.float32)
    q64, qr = q.astype(np.float64), round_to(q, dtype)
    d = q64 - qr
    perp = d - (d @ qr) / (qr @ qr) * qr
    perp /= np.linalg.norm(perp)
    a = round_to(q64 + rng.standard_normal(dim), dtype)  # q . a > 0
    for _ in range(100_000):
        shift = rng.uniform(0.5, 4) * perp + rng.uniform(-0.01, 0.01) * qr / np.linalg.norm(qr)
        b = round_to(a + shift, dtype)
        if (b - a) @ q64 > 1e-3 and (b - a) @ qr < -1e-3:
            return q, a.astype(np.float32), b.astype(np.float32)
    raise AssertionError("no such pair")


def check_dp4a(device: str, ptx: bool, n: int = 4096) -> None:
    """scan_topk's ``_dp4a`` (PTX ``dp4a.u32.s32``, or its byte-by-byte form) against numpy:
    c + the dot of a's four unsigned bytes with b's four signed ones, for random words."""
    from dp4a_kernel import dp4a_kernel

    rng = np.random.default_rng(4)
    a, b = (rng.integers(-(2**31), 2**31, n, dtype=np.int64).astype(np.int32) for _ in range(2))
    c = rng.integers(-(2**20), 2**20, n).astype(np.int32)
    t = [torch.from_numpy(v).to(device) for v in (a, b, c)]
    out = torch.empty(n, dtype=torch.int32, device=device)
    dp4a_kernel[(n // 256,)](*t, out, PTX=ptx, BLOCK=256)
    ua = a.view(np.uint8).reshape(n, 4).astype(np.int64)
    sb = b.view(np.int8).reshape(n, 4).astype(np.int64)
    want = c.astype(np.int64) + (ua * sb).sum(axis=1)
    assert np.array_equal(out.cpu().numpy().astype(np.int64), want)
