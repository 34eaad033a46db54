"""Conformance and isolation kits for tests and benchmarks.

``isolated_sidecar(...)`` starts a real sidecar process (``python -m kalos serve``) with its
own private socket directory, waits until it accepts clients (with ``--data-dir``: until it
finished recovering; with ``--grpc``: until its grpc listeners are up too), and stops it
(SIGTERM, then SIGKILL) on exit.

The conformance kits are the assertions a new backend or transport must pass, whatever it is
built on; each raises AssertionError (or the unexpected exception) on the first breach:

- ``check_index(spec)``: the Index contract of :mod:`kalos.index.base` for the backend named
  by ``spec`` (``"cpu:flat"``, ``"cuda:flat,fp16"``, ...), held against a float64 reference.
- ``check_transport(transport_factory)``: the Transport contract of
  :mod:`kalos.transport.base`, over transports that ``transport_factory()`` opens to one
  sidecar (or in-process dispatcher) whose store is empty and whose metric is ``ip``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kalos.errors import ClosedError, ConnectError, InvalidRequest, NotFound
from kalos.paths import socket_path

if TYPE_CHECKING:
    from kalos.transport.base import Transport


@dataclass
class RunningSidecar:
    name: str
    runtime_dir: str
    process: subprocess.Popen

    @property
    def socket(self) -> str:
        return socket_path(self.name, self.runtime_dir)

    def connect(self, **kwargs):  # -> kalos.Client
        """A client of this sidecar; ``transport="grpc"`` connects to its first grpc listener
        (the sidecar must have been started with ``--grpc ADDR``)."""
        from kalos.client import connect

        if kwargs.get("transport") == "grpc":
            return connect(self.grpc_target(), **kwargs)
        return connect(self.name, runtime_dir=self.runtime_dir, **kwargs)

    def grpc_target(self, index: int = 0) -> str:
        """The address of its ``index``-th grpc listener, as bound (port 0 resolved), read
        from its STATS over uds."""
        from kalos.client import connect

        with connect(self.name, runtime_dir=self.runtime_dir, transport="uds") as c:
            addresses = c.stats().get("grpc") or []
        if len(addresses) <= index:
            raise ConnectError(f"the sidecar {self.name!r} has no grpc listener {index}")
        return str(addresses[index])

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        """Signals the sidecar and waits for it; returns its exit code."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout)


def wait_for_socket(path: str, process: subprocess.Popen, timeout: float = 30.0) -> None:
    """Waits until the sidecar accepts connections at ``path``.

    The file alone is not enough: it exists between bind and listen, and a stale socket left
    by a killed sidecar exists before the new one has claimed it.
    """
    deadline = time.monotonic() + timeout
    while not _accepts(path):
        if process.poll() is not None:
            raise ConnectError(f"the sidecar exited with code {process.returncode} at start")
        if time.monotonic() > deadline:
            raise ConnectError(f"the sidecar did not open {path} within {timeout} s")
        time.sleep(0.01)


def wait_ready(path: str, process: subprocess.Popen, timeout: float = 120.0) -> None:
    """Waits until the sidecar at ``path`` completes a handshake.

    While it recovers its data a sidecar holds handshakes, then refuses them as "starting";
    this retries until one succeeds (it counts as one connect in the sidecar's stats).
    """
    from kalos.protocol import layout as L
    from kalos.transport.handshake import client_hello

    deadline = time.monotonic() + timeout
    while True:
        try:
            sock, _, fds = client_hello(path, "uds", L.MIN_ARENA_BYTES, timeout=10.0)
        except ConnectError as exc:
            if process.poll() is not None:
                raise ConnectError(
                    f"the sidecar exited with code {process.returncode} at start"
                ) from exc
            if "starting" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)
            continue
        sock.close()
        for fd in fds:
            os.close(fd)
        return


def _accepts(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        return False
    finally:
        probe.close()
    return True


def serve_command(
    name: str, dim: int, runtime_dir: str, *extra_args: str, metric: str = "ip"
) -> list[str]:
    """The command line of ``kalos serve`` in this interpreter, for tests and benchmarks."""
    return [
        sys.executable, "-m", "kalos", "serve", "--name", name, "--dim", str(dim),
        "--metric", metric, "--runtime-dir", str(runtime_dir), *extra_args,
    ]  # fmt: skip


@contextlib.contextmanager
def isolated_sidecar(
    *,
    dim: int,
    metric: str = "ip",
    name: str = "test",
    extra_args: tuple[str, ...] = (),
    runtime_dir: str | None = None,
    stderr=None,
) -> Iterator[RunningSidecar]:
    """A sidecar in its own process and socket directory, stopped on exit."""
    with contextlib.ExitStack() as stack:
        if runtime_dir is None:
            runtime_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="kalos-"))
        cmd = serve_command(name, dim, runtime_dir, *extra_args, metric=metric)
        if not any(a.startswith(("--admin-port", "--no-admin")) for a in extra_args):
            cmd += ["--admin-port", "0"]  # a free port each: sidecars in parallel never collide
        proc = subprocess.Popen(cmd, stderr=stderr)
        sidecar = RunningSidecar(name, runtime_dir, proc)
        try:
            wait_for_socket(sidecar.socket, proc)
            cuda = any(a.startswith("cuda") for a in extra_args)
            loading = "--load" in extra_args
            if "--data-dir" in extra_args or "--grpc" in extra_args or cuda or loading:
                # recovered; grpc listening; a cuda sidecar's kernels warm (from a cold
                # kernel cache, minutes); a bulk load read (10M rows: minutes)
                wait_ready(
                    sidecar.socket, proc, timeout=3600.0 if loading else 900.0 if cuda else 120.0
                )
            yield sidecar
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


# -- the Index kit ---------------------------------------------------------------------------


def reference_scores(vectors: np.ndarray, query: np.ndarray, metric: str) -> np.ndarray:
    """Exact scores [n] of one query [dim] against vectors [n, dim], in float64."""
    v = np.asarray(vectors, dtype=np.float64)
    q = np.asarray(query, dtype=np.float64)
    if metric == "cosine":
        v = v / np.linalg.norm(v, axis=1, keepdims=True)
        q = q / np.linalg.norm(q)
    if metric == "l2":
        return np.asarray(((v - q) ** 2).sum(axis=1))
    return v @ q


def scope_matches(scopes: np.ndarray, scope: tuple[int, int, int] | None) -> np.ndarray:
    """The reference scope filter over scopes [n, 3]: every non-zero field must be equal."""
    ok = np.ones(scopes.shape[0], dtype=bool)
    if scope is not None:
        for field, want in enumerate(scope):
            if want != 0:
                ok &= scopes[:, field] == want
    return ok


def _score_scale(vecs: np.ndarray, q: np.ndarray, metric: str) -> float:
    if metric == "cosine":
        return 1.0
    vmax = float(np.linalg.norm(vecs, axis=1).max())
    qn = float(np.linalg.norm(q))
    return max(1.0, (vmax + qn) ** 2 if metric == "l2" else vmax * qn)


def check_search(
    result: tuple[np.ndarray, np.ndarray],
    items: dict[int, tuple[np.ndarray, tuple[int, int, int]]],
    queries: np.ndarray,
    k: int,
    metric: str,
    scope: tuple[int, int, int] | None = None,
    rtol: float = 1e-4,
) -> None:
    """Holds one search result (scores [nq, k], ids [nq, k]) against the reference over
    ``items`` (id -> (vector, scope)): the same top-k up to ties at the k-th place, best
    first, scores within ``rtol``, the tail (fewer matches than k) -1 with the missing score."""
    scores, ids = result
    queries = np.atleast_2d(queries)
    nq = queries.shape[0]
    assert scores.shape == (nq, k) and ids.shape == (nq, k), (scores.shape, ids.shape)
    assert scores.dtype == np.float32 and ids.dtype == np.int64, (scores.dtype, ids.dtype)
    missing = np.inf if metric == "l2" else -np.inf
    all_ids = np.array(list(items), dtype=np.int64)
    vecs = np.zeros((0, queries.shape[1]))
    if all_ids.size:
        vecs = np.stack([items[int(i)][0] for i in all_ids])
        scopes = np.array([items[int(i)][1] for i in all_ids], dtype=np.int64).reshape(-1, 3)
        keep = scope_matches(scopes, scope)
        all_ids, vecs = all_ids[keep], vecs[keep]
    pos = {int(i): p for p, i in enumerate(all_ids)}
    for row in range(nq):
        kk = min(k, all_ids.shape[0])
        assert (ids[row, kk:] == -1).all(), "fewer than k matches: the tail must be -1"
        assert (scores[row, kk:] == missing).all(), f"the tail scores must be {missing}"
        if kk == 0:
            continue
        want = reference_scores(vecs, queries[row], metric)
        sign = 1.0 if metric == "l2" else -1.0  # sort key: ascending is best first
        order = np.argsort(sign * want, kind="stable")
        scale = _score_scale(vecs, queries[row], metric)
        atol = 1e-5 * scale * (rtol / 1e-4)
        got_ids = ids[row, :kk]
        assert (got_ids != -1).all(), "returned -1 although enough items match"
        assert len(set(got_ids.tolist())) == kk, "an id came back twice"
        assert all(int(i) in pos for i in got_ids), "returned an id that is gone or out of scope"
        got_ref = want[[pos[int(i)] for i in got_ids]]
        np.testing.assert_allclose(scores[row, :kk], got_ref, rtol=rtol, atol=atol)
        # best first (allowing rounding)
        assert (
            np.diff(sign * scores[row, :kk].astype(np.float64)) >= -2 * atol - rtol * scale
        ).all(), "the hits are not best first"
        # the same set as the reference top-k, except where scores tie at the k-th place
        kth = want[order[kk - 1]]
        tie = rtol * max(abs(kth), 1.0) + 2 * atol
        surely_in = all_ids[sign * want < sign * kth - tie]
        assert set(surely_in.tolist()) <= set(got_ids.tolist()), "missed a true top-k item"
        assert (sign * got_ref <= sign * kth + tie).all(), "returned an item outside the top-k"


def check_index(
    spec: str,
    *,
    dim: int = 16,
    metrics: tuple[str, ...] = ("ip", "cosine", "l2"),
    n: int = 300,
    seed: int = 20261201,
    rtol: float = 1e-4,
) -> None:
    """Holds the backend named by ``spec`` to the Index contract, once per metric.

        What it checks, on ``n`` random items of ``dim`` dimensions with random 64-bit ids and
        scopes: the protocol's attributes; an empty index answers only -1; top-k against a float64
        reference (within ``rtol``: a backend that scores in fp16 passes a looser one), for one
        query and a batch, k beyond the item count padded with -1; scope filters; ``allow`` (the
    ids a search may return), alone and with a scope; upsert (an id
        added again is replaced, the last of a batch wins); remove (the count, and a removed id is
        never returned nor reconstructed); reconstruct and dump; reset; and that bad input (a
        wrong dimension, NaN, k < 1) raises InvalidRequest and changes nothing.
    """
    from kalos.index import Index, create

    rng = np.random.default_rng(seed)
    for metric in metrics:
        index = create(spec, dim=dim, metric=metric)
        assert isinstance(index, Index), f"{spec}: not an Index"
        assert index.dim == dim and index.metric == metric, (index.dim, index.metric)
        assert len(index) == 0
        q = rng.standard_normal((3, dim), dtype=np.float32)
        check_search(index.search(q, 5), {}, q, 5, metric, rtol=rtol)

        vectors = rng.standard_normal((n, dim), dtype=np.float32)
        ids = np.unique(rng.integers(-(2**62), 2**62, size=2 * n, dtype=np.int64))
        ids = rng.permutation(ids[ids != -1])[:n]
        scopes = np.stack(
            [rng.integers(1, 3, n), rng.integers(0, 3, n), rng.integers(0, 2, n)], axis=1
        ).astype(np.int64)
        index.add(vectors, ids, scopes)
        assert len(index) == n, f"{spec}: {len(index)} items after adding {n}"
        items = {int(i): (vectors[j], _scope_of(scopes[j])) for j, i in enumerate(ids)}

        for k in (1, 10, n + 5):
            check_search(index.search(q, k), items, q, k, metric, rtol=rtol)
        one_scores, one_ids = index.search(q[0], 10)
        assert one_ids.shape[-1] == 10 and one_scores.shape[-1] == 10
        for scope in ((1, 0, 0), (2, 1, 0), (1, 2, 1), (7, 0, 0)):
            result = index.search(q, 10, scope=scope)
            check_search(result, items, q, 10, metric, scope=scope, rtol=rtol)
        # allow: only these ids (a metadata filter's matches), a few or most, and an unknown id
        for share in (0.02, 0.6):
            allowed = ids[rng.random(n) < share]
            allow = np.concatenate([allowed, [1 << 62]])
            only = {i: items[i] for i in allowed.tolist()}
            for within in (None, (1, 0, 0)):
                result = index.search(q, 10, scope=within, allow=allow)
                check_search(result, only, q, 10, metric, scope=within, rtol=rtol)
        check_search(index.search(q, 10, allow=np.empty(0, np.int64)), {}, q, 10, metric)

        # upsert: the id of item 0 gets item 1's vector; in one batch, the last one wins
        index.add(np.stack([vectors[2], vectors[1]]), np.array([ids[0], ids[0]]), scopes[:2])
        assert len(index) == n, "an upsert changed the item count"
        items[int(ids[0])] = (vectors[1], _scope_of(scopes[1]))
        np.testing.assert_allclose(
            index.reconstruct(ids[:1])[0], _stored(vectors[1], metric), rtol=rtol, atol=rtol
        )
        check_search(index.search(q, 10), items, q, 10, metric, rtol=rtol)

        # remove: counts only the ids present; a removed id is gone everywhere
        gone = ids[: n // 3]
        assert index.remove(np.concatenate([gone, gone[:2]])) == len(gone)
        assert index.remove(gone) == 0
        for i in gone.tolist():
            del items[i]
        assert len(index) == n - len(gone)
        check_search(index.search(q, n), items, q, n, metric, rtol=rtol)
        # allow after rows moved: half the live ids, and the removed ones (never returned)
        half = np.array(sorted(items), dtype=np.int64)[::2]
        result = index.search(q, 10, allow=np.concatenate([half, gone]))
        check_search(result, {i: items[i] for i in half.tolist()}, q, 10, metric, rtol=rtol)
        try:
            index.reconstruct(gone[:1])
        except NotFound:
            pass
        else:
            raise AssertionError(f"{spec}: reconstruct of a removed id did not raise NotFound")
        dumped_ids, dumped_vectors, dumped_scopes = index.dump()
        assert sorted(dumped_ids.tolist()) == sorted(items), "dump lists other ids"
        assert dumped_vectors.shape == (len(items), dim) and dumped_scopes.shape == (len(items), 3)

        # bad input: InvalidRequest, and nothing changes
        nan = vectors[:1].copy()
        nan[0, 0] = np.nan
        _expect_invalid(
            spec, "an add of the wrong dimension", index.add, vectors[:1, :-1], ids[-1:]
        )
        _expect_invalid(spec, "an add with NaN", index.add, nan, ids[-1:])
        _expect_invalid(spec, "a search of the wrong dimension", index.search, q[:, :-1], 5)
        _expect_invalid(spec, "a search with NaN", index.search, nan, 5)
        _expect_invalid(spec, "a search with k = 0", index.search, q, 0)
        assert len(index) == n - len(gone), "bad input changed the index"

        index.reset()
        assert len(index) == 0
        check_search(index.search(q, 5), {}, q, 5, metric, rtol=rtol)


def _scope_of(row: np.ndarray) -> tuple[int, int, int]:
    return int(row[0]), int(row[1]), int(row[2])


def _expect_invalid(spec: str, what: str, call: Callable[..., object], *args: object) -> None:
    try:
        call(*args)
    except InvalidRequest:
        return
    raise AssertionError(f"{spec}: {what} did not raise InvalidRequest")


def _stored(vector: np.ndarray, metric: str) -> np.ndarray:
    """What an index stores for ``vector``: cosine stores it normalised."""
    if metric == "cosine":
        return vector / np.linalg.norm(vector)
    return vector


# -- the Transport kit -----------------------------------------------------------------------


def check_transport(transport_factory: Callable[[], Transport], *, timeout: float = 10.0) -> None:
    """Holds what ``transport_factory()`` opens to the Transport contract.

    The factory opens a new channel to one sidecar (or in-process dispatcher) whose memory
    store is empty at the start and whose metric is ``ip``; the kit adds a few items to it.
    It checks: the attributes a client reads (kind, server_info with dim, a writable uint8
    request_buffer); PING and STATS round trips with their timings; an ADD then a SEARCH
    that finds each item first; that a bad request comes back as a status, not an exception,
    and leaves the channel usable; that two channels of one factory work side by side; and
    that close is idempotent, marks the transport broken and makes a request raise
    ClosedError.
    """
    from kalos.protocol import codes
    from kalos.protocol import messages as M
    from kalos.protocol.codes import Op, Status

    t = transport_factory()
    other = None
    try:
        assert isinstance(t.kind, str) and t.kind, "a transport names its kind"
        dim = int(t.server_info["dim"])
        assert dim > 0, t.server_info
        buf = t.request_buffer
        assert buf.dtype == np.uint8 and buf.ndim == 1 and buf.flags.writeable
        assert not t.broken

        r = t.request(Op.PING, 0, 0, timeout=timeout)
        assert r.status == Status.OK, r.status
        for ns in (r.queue_ns, r.compute_ns, r.write_ns):
            assert isinstance(ns, int) and ns >= 0, (r.queue_ns, r.compute_ns, r.write_ns)
        r = t.request(Op.STATS, 0, 0, timeout=timeout)
        assert r.status == Status.OK, r.status
        assert M.decode_text(r.body, len(r.body)).startswith("{"), "STATS is JSON"

        rng = np.random.default_rng(7)
        vectors = rng.standard_normal((8, dim)).astype(np.float32)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)  # each its own best hit
        ids = np.arange(100, 108, dtype=np.int64)
        kinds = np.full(len(ids), codes.PAYLOAD_NONE, np.uint8)
        blobs = [b""] * len(ids)
        n = M.encode_add(t.request_buffer, ids, vectors, kinds, blobs, M.EMPTY_SCOPE)
        r = t.request(Op.ADD, 0, n, timeout=timeout)
        assert r.status == Status.OK, M.decode_text(r.body, len(r.body))
        assert M.decode_counts(r.body, len(r.body))[0] == len(ids), "ADD counts the new ids"

        n = M.encode_search(t.request_buffer, vectors, 3, M.EMPTY_SCOPE)
        r = t.request(Op.SEARCH, 0, n, timeout=timeout)
        assert r.status == Status.OK, M.decode_text(r.body, len(r.body))
        hits = M.decode_search_response(r.body, len(r.body))
        assert hits.ids.shape == (len(ids), 3)
        assert (hits.ids[:, 0] == ids).all(), "each item is its own best hit"

        r = t.request(200, 0, 0, timeout=timeout)  # an op no sidecar knows
        assert r.status == Status.UNKNOWN_OP, r.status
        assert M.decode_text(r.body, len(r.body)), "an error response carries a message"
        assert not t.broken, "a refused request broke the channel"
        assert t.request(Op.PING, 0, 0, timeout=timeout).status == Status.OK

        other = transport_factory()
        assert other.request(Op.PING, 0, 0, timeout=timeout).status == Status.OK
        assert t.request(Op.PING, 0, 0, timeout=timeout).status == Status.OK
    finally:
        t.close()
        if other is not None:
            other.close()
    t.close()  # idempotent
    assert t.broken, "a closed transport is broken"
    try:
        t.request(Op.PING, 0, 0, timeout=timeout)
    except ClosedError:
        pass
    else:
        raise AssertionError("a request on a closed transport did not raise ClosedError")
