"""Responses the GPU publishes (server.gpu_search.PinnedArena), on a real cuda sidecar with
1M rows: the int8 prefilter runs from ``PREFILTER_MIN_ROWS`` on, and each proven search's
kernel stores the response's sequence word itself. Every answer against an exact reference,
for spinning and parked clients, across writes, beside GPU-result searches (which the
sidecar publishes) on the same channel.

The first sidecar runs with ``--no-gpu-doorbell`` (the poller's path); the doorbell tests
(server.doorbell) run on a second one with the default, the doorbell on.

Run on a CUDA machine: ``pytest -m gpu tests/gpu``. Skipped without CUDA.
"""

from __future__ import annotations

# isort: off
from cuda_device import torch

# isort: on

import numpy as np
import pytest

import kalos
from kalos.index.kernels.scan_topk import PREFILTER_MIN_ROWS
from kalos.testing import isolated_sidecar

pytestmark = pytest.mark.gpu

DIM = 64
N = PREFILTER_MIN_ROWS + 50_000  # above it after the removes below
K = 10


def _loaded(name: str, *extra: str, dim: int = DIM):
    rng = np.random.default_rng(17)
    base = rng.standard_normal((N, dim)).astype(np.float32)
    ids = np.arange(N, dtype=np.int64) * 3 + 1
    args = ("--device", "cuda", "--reserve", str(N), *extra)
    with isolated_sidecar(dim=dim, name=name, extra_args=args) as sc:
        loader = sc.connect(arena_bytes=64 << 20, timeout=120)
        step = 200_000 * DIM // dim  # ~51 MB a chunk
        for lo in range(0, N, step):
            loader.add(base[lo : lo + step], ids[lo : lo + step])
        loader.close()
        db = torch.from_numpy(base).cuda().half()
        yield sc, db, ids


@pytest.fixture(scope="module")
def big_sidecar():
    yield from _loaded("gpu-publish", "--no-gpu-doorbell")


@pytest.fixture(scope="module")
def doorbell_sidecar():
    """The same rows served with the GPU doorbell (server.doorbell), the default."""
    yield from _loaded("gpu-doorbell")


@pytest.fixture(scope="module")
def cascade_sidecar():
    """384-d rows, served by the 4-bit cascade (the default from 257 to 1536 dims) with the
    GPU doorbell on."""
    yield from _loaded("gpu-doorbell-4bit", dim=384)


def check(
    db, ids, q: np.ndarray, got_ids: np.ndarray, got_scores: np.ndarray, gone=(), k: int = K
) -> None:
    """The exact top-K over the fp16 rows (float32 scores), up to exact ties, of the query as
    given or as rounded to fp16 (requests of two channels served as one batch are scored in
    the storage dtype: at scores ~34 that moves the k-th place by more than a tie's
    tolerance); ``gone``: ids removed since the rows were loaded."""
    assert not set(got_ids.tolist()) & set(gone)
    rows = torch.from_numpy((got_ids - 1) // 3).cuda()
    failures = []
    for qr in (q, q.astype(np.float16).astype(np.float32)):
        s = db.float() @ torch.from_numpy(np.ascontiguousarray(qr)).cuda()
        if len(gone):
            s[torch.from_numpy((np.asarray(gone) - 1) // 3).cuda()] = float("-inf")
        want = torch.topk(s, k).values.cpu().numpy()
        have = s[rows].cpu().numpy()
        try:
            assert np.all(have >= want[-1] - 1e-3), (have, want)
            np.testing.assert_allclose(np.sort(have)[::-1], want, rtol=1e-3, atol=1e-3)
            np.testing.assert_allclose(got_scores, have, rtol=1e-3, atol=1e-2)
            return
        except AssertionError as exc:
            failures.append(exc)
    raise AssertionError(f"not the top-{k} of the query, as given nor rounded: {failures}")


@pytest.mark.parametrize("spin_us", [1000.0, 0.0])
def test_proven_searches_are_published_by_the_kernel(big_sidecar, spin_us):
    sc, db, ids = big_sidecar
    qs = np.random.default_rng(int(spin_us) + 1).standard_normal((300, DIM)).astype(np.float32)
    with sc.connect(spin_us=spin_us, timeout=120) as client:
        client.search(qs[0], K, payloads=False)  # compiles and captures
        before = client.stats()
        for q in qs:
            r = client.search(q, K, payloads=False)
            check(db, ids, q, r.ids, r.scores)
        after = client.stats()
    # random rows: the bound proves (nearly) every search, and each proven one is the GPU's;
    # a parked client (spin 0) is woken by the poller after its sync
    published = after["gpu_published"] - before["gpu_published"]
    assert 290 <= published <= len(qs)
    assert after["errors"] == before["errors"]


def test_writes_and_gpu_results_between_published_searches(big_sidecar):
    sc, db, ids = big_sidecar
    qs = np.random.default_rng(5).standard_normal((20, DIM)).astype(np.float32)
    gone: list[int] = []
    with sc.connect(gpu_results=True, spin_us=1000, timeout=120) as client:
        before = client.stats()["gpu_published"]
        try:
            for q in qs:
                r = client.search(q, K, payloads=False, copy=True)
                check(db, ids, q, r.ids, r.scores, gone)
                g = client.search_gpu(q, K)  # GPU results: the sidecar publishes those
                assert set(g.ids.cpu().numpy().tolist()) == set(r.ids.tolist())
                assert client.remove(r.ids[:1]) == 1
                gone.append(int(r.ids[0]))
                r = client.search(q, K, payloads=False)
                check(db, ids, q, r.ids, r.scores, gone)
            assert client.stats()["gpu_published"] - before >= 2 * len(qs) - 2
        finally:  # the rows back, for the module's later tests, whatever failed
            _add_back(client, db, gone)


def _add_back(client, db, gone: list[int]) -> None:
    """Adds the removed ids ``gone`` back with their rows, as the fixture loaded them."""
    if gone:
        rows = torch.tensor([(i - 1) // 3 for i in gone]).cuda()
        client.add(db[rows].float().cpu().numpy(), np.array(gone, dtype=np.int64))


def doorbell(client) -> dict[str, int]:
    stats = client.stats()
    return {k: stats[k] for k in stats if k.startswith("gpu_doorbell_")}


@pytest.mark.parametrize("spin_us", [1000.0, 0.0])
def test_the_gpu_picks_up_the_next_search_itself(doorbell_sidecar, spin_us):
    """server.doorbell: after a published search the graph is armed; the next search of the
    same shape is taken by the GPU with no sidecar CPU in between (a parked client is woken
    by the poller afterwards)."""
    sc, db, ids = doorbell_sidecar
    qs = np.random.default_rng(int(spin_us) + 7).standard_normal((300, DIM)).astype(np.float32)
    with sc.connect(spin_us=spin_us, timeout=120) as client:
        client.search(qs[0], K, payloads=False)
        before = doorbell(client)
        # back to back, as a serving loop calls: the answers are checked afterwards (a check
        # takes ms, longer than the poller spins before it settles the armed graph and parks)
        got = [client.search(q, K, payloads=False, copy=True) for q in qs]
        after = doorbell(client)
    for q, r in zip(qs, got, strict=True):
        check(db, ids, q, r.ids, r.scores)
    answered = after["gpu_doorbell_answered"] - before["gpu_doorbell_answered"]
    # the GPU takes a request only if the poller re-armed in time: a stalled thread on a busy
    # host leaves one to the sidecar (answered exact all the same)
    assert answered >= 3 * len(qs) // 4, (answered, before, after)
    assert after["gpu_doorbell_failed"] is None


def test_requests_unlike_the_armed_one_and_writes_between(doorbell_sidecar):
    """Another k, an fp16 query, a NaN, another channel's search and a remove between armed
    searches: each is served by the sidecar (or the GPU, for a repeat), every answer exact."""
    sc, db, ids = doorbell_sidecar
    rng = np.random.default_rng(11)
    qs = rng.standard_normal((40, DIM)).astype(np.float32)
    gone: list[int] = []
    # (query, result, the ids removed by then, k): checked after the loop, which runs back to
    # back so that the graph stays armed between requests
    done: list[tuple[np.ndarray, object, tuple[int, ...], int]] = []
    with sc.connect(spin_us=1000, timeout=120) as a, sc.connect(spin_us=1000, timeout=120) as b:
        try:
            before = doorbell(a)
            for i, q in enumerate(qs):
                r = a.search(q, K, payloads=False, copy=True)
                done.append((q, r, tuple(gone), K))
                step = i % 5
                if step == 0:  # another k
                    done.append((q, a.search(q, 5, payloads=False, copy=True), tuple(gone), 5))
                elif step == 1:  # an fp16 query: another template
                    h = q.astype(np.float16)
                    r16 = a.search(h, K, payloads=False, copy=True)
                    done.append((h.astype(np.float32), r16, tuple(gone), K))
                elif step == 2:  # a NaN: refused, the sidecar keeps serving
                    bad = q.copy()
                    bad[0] = np.nan
                    with pytest.raises(kalos.InvalidRequest):
                        a.search(bad, K, payloads=False)
                elif step == 3:  # another channel's search cancels the armed one
                    done.append((q, b.search(q, K, payloads=False, copy=True), tuple(gone), K))
                else:  # a write settles it; the next search sees the write
                    assert a.remove(r.ids[:1]) == 1
                    gone.append(int(r.ids[0]))
                done.append((q, a.search(q, K, payloads=False, copy=True), tuple(gone), K))
            after = doorbell(a)
            for q, r, removed, k in done:
                check(db, ids, q, r.ids, r.scores, removed, k=k)  # type: ignore[attr-defined]
        finally:  # the rows back, for the module's later tests, whatever failed
            _add_back(a, db, gone)
    assert after["gpu_doorbell_answered"] > before["gpu_doorbell_answered"]
    assert after["gpu_doorbell_declined"] > before["gpu_doorbell_declined"]


def test_clients_racing_on_two_channels(doorbell_sidecar):
    """Two threads search at once, each on its own channel: every request is either the GPU's
    (its channel armed) or the sidecar's after it cancelled the other's armed graph (what the
    GPU took meanwhile is answered from the claim). Every answer exact."""
    import threading

    sc, db, ids = doorbell_sidecar
    errors: list[BaseException] = []

    def run(seed: int) -> None:
        try:
            qs = np.random.default_rng(seed).standard_normal((150, DIM)).astype(np.float32)
            with sc.connect(spin_us=1000, timeout=120) as client:
                got = [client.search(q, K, payloads=False, copy=True) for q in qs]
            for q, r in zip(qs, got, strict=True):  # afterwards: the searches race back to back
                check(db, ids, q, r.ids, r.scores)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(s,)) for s in (21, 22)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors[0]


def test_searches_the_scan_cannot_prove_settle_on_the_gpu(doorbell_sidecar):
    """Near-copies of one direction, closer together than the int8 bound: the armed scan
    cannot prove a search along it, and the settle behind it in the same graph (gated on the
    scan's verdict) answers and publishes it; random queries between are proven. Every
    answer exact; the rows are removed afterwards."""
    sc, db, ids = doorbell_sidecar
    rng = np.random.default_rng(43)
    base = rng.standard_normal(DIM).astype(np.float32)
    near = base + 1e-3 * rng.standard_normal((150, DIM)).astype(np.float32)
    near_ids = np.arange(N, N + 150, dtype=np.int64) * 3 + 1  # rows N.. of the reference
    rows = torch.cat([db, torch.from_numpy(near).cuda().half()])
    qs = base + 0.01 * rng.standard_normal((100, DIM)).astype(np.float32)
    qs[::2] = rng.standard_normal((50, DIM)).astype(np.float32)
    with sc.connect(spin_us=1000, timeout=120) as client:
        client.add(near, near_ids)
        try:
            client.search(qs[1], K, payloads=False)  # the sidecar's, then armed
            before = doorbell(client)
            got = [client.search(q, K, payloads=False, copy=True) for q in qs]
            after = doorbell(client)
        finally:
            assert client.remove(near_ids) == len(near_ids)
    for q, r in zip(qs, got, strict=True):
        check(rows, ids, q, r.ids, r.scores)
    d = {k: v - before[k] for k, v in after.items() if isinstance(v, int)}
    # 3/4 of the 50 searches near the close rows, which the int8 bound cannot prove
    assert d["gpu_doorbell_settled"] >= 37, (d, before, after)
    assert d["gpu_doorbell_settled_rows"] >= K * d["gpu_doorbell_settled"]
    assert d["gpu_doorbell_unproven"] == 0 and d["gpu_doorbell_answered"] >= 75, (d, before, after)
    assert after["gpu_doorbell_failed"] is None


def test_the_gpu_picks_up_the_cascades_searches(cascade_sidecar):
    """The cascade's exact pass publishes every search, so the doorbell takes each next one:
    random queries and stored rows (whose near neighbours leave rows open), then a remove
    between, every answer exact."""
    sc, db, ids = cascade_sidecar
    rng = np.random.default_rng(31)
    qs = rng.standard_normal((200, 384)).astype(np.float32)
    qs[::4] = db[torch.from_numpy(rng.integers(0, N, 50)).cuda()].float().cpu().numpy()
    with sc.connect(spin_us=1000, timeout=120) as client:
        client.search(qs[0], K, payloads=False)
        before = doorbell(client)
        got = [client.search(q, K, payloads=False, copy=True) for q in qs]
        gone = [int(got[0].ids[0])]
        assert client.remove(np.array(gone)) == 1
        later = [client.search(q, K, payloads=False, copy=True) for q in qs[:20]]
        after = doorbell(client)
        _add_back(client, db, gone)
    for q, r in zip(qs, got, strict=True):
        check(db, ids, q, r.ids, r.scores)
    for q, r in zip(qs[:20], later, strict=True):
        check(db, ids, q, r.ids, r.scores, gone)
    answered = after["gpu_doorbell_answered"] - before["gpu_doorbell_answered"]
    assert answered >= 3 * len(qs) // 4, (answered, before, after)  # as above
    assert after["gpu_doorbell_failed"] is None
