"""Cold start of a cuda sidecar: start to ready from ``--data-dir``, and its first searches.

``search-gpu`` runs this on its first corpus set (``--no-cold-start`` skips it). A sidecar with
Triton's default kernel cache fills a data directory with the set's rows (in 8 users' scopes) and
stops (``load_stop_s``: SIGTERM to exit, its clean-stop snapshot included). Then, twice over
the same data directory, a sidecar starts with a ``--cache-dir`` of its own: first an empty
kernel cache (``empty_cache``), then the cache that start filled (``same_cache``). Each
reports:

- ``start_to_ready_s``: process start to the first handshake it accepts (recovery, the index's
  upload and every kernel's warm-up happen before it);
- ``first``: the first ``searches`` searches after ready, spread over k = 1, 10 and 100, with
  and without a scope filter, back to back through a client with the default deadline: p50,
  p99 and max µs, how many timed out, and how many were wrong (their ids' exact scores against
  the exact top-k in float32 over the same fp16 rows, checked after the part's last search);
- ``steady``: the same mix of searches again, after the first; ``first_max_over_steady_p99``
  is the target's ratio (at most 2); each part's ``slowest`` lists its :data:`SLOWEST`
  slowest searches: their place in the part (from 0), k, whether scoped, and µs, and
  ``by_shape`` the p50 and p99 of each (k, scoped);
- ``stop_s``: SIGTERM to exit.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import tempfile
import time
from typing import Any

import numpy as np

from kalos.bench.common import Progress
from kalos.errors import RequestTimeout
from kalos.testing import RunningSidecar, serve_command, wait_for_socket, wait_ready
from kalos.types import Scope

USERS = 8
KS = (1, 10, 100)
SLOWEST = 8  # the slowest searches of each part, reported with their place and shape
SCOPED_USER = "u3"


def _start(name: str, dim: int, rd: str, n: int, data: str, cache: str, device: str
           ) -> RunningSidecar:  # fmt: skip
    cmd = serve_command(name, dim, rd, "--device", device, "--reserve", str(n), "--data-dir",
                        data, "--cache-dir", cache, "--admin-port", "0")  # fmt: skip
    return RunningSidecar(name, rd, subprocess.Popen(cmd))


def _stop(sidecar: RunningSidecar) -> float:
    t = time.perf_counter()
    sidecar.process.send_signal(signal.SIGTERM)
    try:
        sidecar.process.wait(60)
    except subprocess.TimeoutExpired:
        sidecar.process.kill()
        sidecar.process.wait()
    return round(time.perf_counter() - t, 3)


def _users(n: int) -> np.ndarray:
    """The user of each row: USERS contiguous blocks of rows. [n] int64."""
    return (np.arange(n, dtype=np.int64) * USERS) // n


class _Reference:
    """Exact top-k scores in float32 over the fp16 rows, on ``device``."""

    def __init__(self, torch: Any, db: np.ndarray, device: str) -> None:
        self.torch = torch
        self.device = device
        self.db = torch.from_numpy(db).to(device).float()
        self.scoped = torch.from_numpy(_users(db.shape[0]) == int(SCOPED_USER[1:])).to(device)
        self.tol = 2.0**-10 * float(self.db.norm(dim=1).max()) + 1e-4

    def wrong(self, q: np.ndarray, k: int, scoped: bool, pos: np.ndarray) -> bool:
        """Whether the hits at row positions ``pos`` (-1: not a row) are not an exact top-k:
        their exact scores, sorted, differ from the exact top-k's beyond fp16 rounding."""
        t = self.torch
        if (pos < 0).any():
            return True
        qv = t.from_numpy(q).to(self.device).to(t.float16).float()
        scores = self.db @ qv
        if scoped:
            scores = t.where(self.scoped, scores, t.full_like(scores, -float("inf")))
        want = t.topk(scores, k).values
        got = scores[t.from_numpy(pos).to(self.device)].sort(descending=True).values
        return bool(((got - want).abs() > self.tol * float(qv.norm())).any())


def _mix(i: int) -> tuple[int, bool]:
    return KS[i % len(KS)], (i // len(KS)) % 2 == 1


def _searches(client: Any, queries: np.ndarray, count: int, offset: int, ref: _Reference,
              pos_of: dict[int, int]) -> dict[str, Any]:  # fmt: skip
    """``count`` searches back to back, then each answer checked: the checks run on the
    reference's device, which may be the sidecar's GPU, so none runs between two timed
    searches. Where the sidecar has a GPU doorbell, how many of them it answered on the GPU
    and how many it declined (another shape than the channel's last search's, for one)."""
    before = client.stats()
    lat = np.zeros(count, np.int64)
    timeouts = wrong = 0
    clock = time.perf_counter_ns
    scope = Scope(tenant="t", user=SCOPED_USER)
    answers: list[tuple[int, np.ndarray]] = []
    for j in range(count):
        i = offset + j
        k, scoped = _mix(i)
        q = queries[i % len(queries)]
        t = clock()
        try:
            r = client.search(q, k, scope=scope if scoped else None, payloads=False, copy=True)
        except RequestTimeout:
            lat[j] = clock() - t
            timeouts += 1
            continue
        lat[j] = clock() - t
        answers.append((i, r.ids))
    after = client.stats()
    doorbell = {
        name: after[f"gpu_doorbell_{name}"] - before.get(f"gpu_doorbell_{name}", 0)
        for name in ("answered", "declined")
        if f"gpu_doorbell_{name}" in after
    }
    for i, found in answers:
        k, scoped = _mix(i)
        pos = np.array([pos_of.get(int(x), -1) for x in found], np.int64)
        wrong += int(ref.wrong(queries[i % len(queries)], k, scoped, pos))
    us = lat / 1e3
    shapes = [_mix(offset + j) for j in range(count)]
    by_shape = {}
    for k, scoped in sorted(set(shapes)):
        mine = us[[j for j in range(count) if shapes[j] == (k, scoped)]]
        by_shape[f"k={k}{',scoped' if scoped else ''}"] = {
            "searches": len(mine), "p50_us": round(float(np.percentile(mine, 50)), 1),
            "p99_us": round(float(np.percentile(mine, 99)), 1)}  # fmt: skip
    slowest = [{"search": int(j), "k": _mix(offset + int(j))[0],
                "scoped": _mix(offset + int(j))[1], "us": round(float(us[j]), 1)}
               for j in np.argsort(-us, kind="stable")[:SLOWEST]]  # fmt: skip
    return {"searches": count, "p50_us": round(float(np.percentile(us, 50)), 1),
            "p99_us": round(float(np.percentile(us, 99)), 1), "max_us": round(float(us.max()), 1),
            "timeouts": timeouts, "wrong": wrong, "by_shape": by_shape,
            "slowest": slowest, **({"doorbell": doorbell} if doorbell else {})}  # fmt: skip


def measure(torch: Any, db: np.ndarray, ids: np.ndarray, queries: np.ndarray,
            searches: int = 1000, quiet: bool = False, device: str = "cuda"
            ) -> dict[str, Any]:  # fmt: skip
    """The cold-start figures for ``db`` [n, dim] fp16 with ``ids``, searched with ``queries``,
    on a ``device`` sidecar (cuda; cpu in the tests, where the kernel cache is unused)."""
    from kalos.client import connect

    n, dim = db.shape
    out: dict[str, Any] = {"n": n, "dim": dim, "searches": searches, "ks": list(KS),
                           "scope_filter": f"every other triple of searches: user {SCOPED_USER} "
                                           f"of {USERS} (1/{USERS} of the rows)"}  # fmt: skip
    ref = _Reference(torch, db, "cuda" if device.startswith("cuda") else "cpu")
    pos_of = {int(x): i for i, x in enumerate(ids)}
    with tempfile.TemporaryDirectory(prefix="kalos-cold-") as work:
        data = os.path.join(work, "data")
        rd = os.path.join(work, "run")
        os.makedirs(rd)
        # fill the data directory with Triton's own kernel cache, as the sidecars without a
        # data directory use it (warm where this machine ran one of this dim before); the
        # measured starts' cache is their own
        shared = os.environ.get("TRITON_CACHE_DIR") or os.path.expanduser("~/.triton/cache")
        s = _start("cold-load", dim, rd, n, data, shared, device)
        try:
            wait_for_socket(s.socket, s.process)
            wait_ready(s.socket, s.process, timeout=900.0)
            loader = connect("cold-load", runtime_dir=rd, arena_bytes=64 << 20, timeout=300)
            step = (48 << 20) // (dim * 2 + 8 + 9)
            users = _users(n)
            # chunks of at most `step` rows, each within one user's block
            cuts = sorted(
                {*range(0, n, step), *np.searchsorted(users, np.arange(USERS)).tolist(), n}
            )
            with Progress(n, "cold start: load", quiet=quiet) as bar:
                for a, b in itertools.pairwise(cuts):
                    loader.add(db[a:b], ids[a:b], scope=Scope(tenant="t", user=f"u{users[a]}"))
                    bar.update(b - a)
            loader.close()
        finally:
            out["load_stop_s"] = _stop(s)
        cache = os.path.join(work, "cache")
        for label, offset in (("empty_cache", 0), ("same_cache", 3 * searches)):
            t0 = time.perf_counter()
            s = _start("cold", dim, rd, n, data, cache, device)
            try:
                wait_for_socket(s.socket, s.process, timeout=900.0)
                wait_ready(s.socket, s.process, timeout=900.0)
                ready = time.perf_counter() - t0
                client = connect("cold", runtime_dir=rd)  # the default deadline
                first = _searches(client, queries, searches, offset, ref, pos_of)
                steady = _searches(client, queries, 2 * searches, offset + searches, ref, pos_of)
                client.close()
            finally:
                stop = _stop(s)
            out[label] = {"start_to_ready_s": round(ready, 2), "first": first, "steady": steady,
                          "first_max_over_steady_p99": round(first["max_us"] / steady["p99_us"], 2),
                          "stop_s": stop}  # fmt: skip
            if not quiet:
                print(f"cold start ({label}): {out[label]}")
    return out
