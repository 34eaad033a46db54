"""The cold-start measurement of search-gpu, on a CPU sidecar at a small size."""

import numpy as np
import pytest

from kalos.bench import cold_start

torch = pytest.importorskip("torch")


def test_cold_start_reports_both_starts_and_checks_every_answer():
    rng = np.random.default_rng(3)
    db = rng.standard_normal((3000, 32)).astype(np.float16)
    ids = np.arange(3000, dtype=np.int64) * 7 + 5
    queries = rng.standard_normal((40, 32)).astype(np.float32)
    out = cold_start.measure(torch, db, ids, queries, searches=24, quiet=True, device="cpu")
    for label in ("empty_cache", "same_cache"):
        r = out[label]
        assert r["start_to_ready_s"] > 0 and r["stop_s"] < 5
        for part, count in (("first", 24), ("steady", 48)):
            assert r[part]["searches"] == count
            assert r[part]["timeouts"] == 0 and r[part]["wrong"] == 0
            assert 0 < r[part]["p50_us"] <= r[part]["p99_us"] <= r[part]["max_us"]
            slowest = r[part]["slowest"]
            assert len(slowest) == cold_start.SLOWEST
            assert slowest[0]["us"] == r[part]["max_us"]
            assert [x["us"] for x in slowest] == sorted((x["us"] for x in slowest), reverse=True)
            for x in slowest:
                assert 0 <= x["search"] < count and x["k"] in cold_start.KS
            shapes = r[part]["by_shape"]
            assert sorted(shapes) == sorted(f"k={k}{s}" for k in cold_start.KS
                                            for s in ("", ",scoped"))  # fmt: skip
            assert sum(x["searches"] for x in shapes.values()) == count
        assert r["first_max_over_steady_p99"] > 0
        assert "doorbell" not in r["first"]  # a CPU sidecar has none


def test_the_reference_finds_a_wrong_answer():
    rng = np.random.default_rng(4)
    db = rng.standard_normal((500, 16)).astype(np.float16)
    ref = cold_start._Reference(torch, db, "cpu")
    q = rng.standard_normal(16).astype(np.float32)
    scores = db.astype(np.float32) @ q.astype(np.float16).astype(np.float32)
    best = np.argsort(-scores)[:10]
    assert not ref.wrong(q, 10, False, best)
    assert ref.wrong(q, 10, False, np.argsort(scores)[:10])  # the bottom 10
    assert ref.wrong(q, 10, False, np.r_[best[:9], -1])  # a hit that is no row
    users = cold_start._users(500)
    mine = np.flatnonzero(users == int(cold_start.SCOPED_USER[1:]))
    top_mine = mine[np.argsort(-scores[mine])[:10]]
    assert not ref.wrong(q, 10, True, top_mine)
    assert not set(best) <= set(mine)
    assert ref.wrong(q, 10, True, best)  # the unscoped top 10 under the scope filter


def test_every_answer_is_checked_after_the_last_timed_search():
    rng = np.random.default_rng(5)
    db = rng.standard_normal((1600, 16)).astype(np.float16)  # 200 rows a user: k = 100 fits
    ids = np.arange(1600, dtype=np.int64) + 1000
    pos_of = {int(x): i for i, x in enumerate(ids)}
    queries = rng.standard_normal((12, 16)).astype(np.float32)
    events: list[str] = []

    class Ref(cold_start._Reference):
        def wrong(self, q, k, scoped, pos):  # type: ignore[no-untyped-def]
            events.append("check")
            return super().wrong(q, k, scoped, pos)

    class Answer:
        def __init__(self, found: np.ndarray) -> None:
            self.ids = found

    class Client:
        """Every other search answered with the bottom rows instead of the top ones; a GPU
        doorbell's counts in its stats, that took every third search and declined the rest."""

        calls = 0

        def stats(self):  # type: ignore[no-untyped-def]
            took = Client.calls // 3 + 5
            return {"gpu_doorbell_answered": took, "gpu_doorbell_declined": Client.calls - took}

        def search(self, q, k, scope=None, payloads=False, copy=True):  # type: ignore[no-untyped-def]
            events.append("search")
            scores = db.astype(np.float32) @ q.astype(np.float16).astype(np.float32)
            if scope is not None:
                users = cold_start._users(len(db))
                scores[users != int(cold_start.SCOPED_USER[1:])] = -np.inf
            order = np.argsort(-scores)
            Client.calls += 1
            pick = order[:k] if Client.calls % 2 else order[np.isfinite(scores[order])][-k:]
            return Answer(ids[pick])

    ref = Ref(torch, db, "cpu")
    out = cold_start._searches(Client(), queries, 12, 0, ref, pos_of)
    assert out["searches"] == 12 and out["wrong"] == 6
    assert out["doorbell"] == {"answered": 4, "declined": 8}
    assert events == ["search"] * 12 + ["check"] * 12
