"""The inverted-file indexes (``cpu:ivf``, and ``cuda:ivf`` on torch CPU tensors): recall
against the exact top-k, every list probed is exact, training and retraining, writes after
training, filters that widen the probe, per-request nprobe, and bad specs and knobs.

The contract every backend keeps (with every list probed) is in test_conformance.py."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kalos.errors import ConfigError, InvalidRequest
from kalos.index import create
from kalos.index.cpu_ivf import RETRAIN_GROWTH, train_size
from kalos.testing import check_search

HAS_TORCH = importlib.util.find_spec("torch") is not None
KINDS = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda", id="cuda-on-torch-cpu", marks=pytest.mark.skipif(not HAS_TORCH, reason="torch")
    ),
]
DIM = 32


@pytest.fixture(autouse=True)
def _lists_always(monkeypatch) -> None:
    """cpu:ivf scans every row once its probed lists hold most of them (FLAT_ABOVE); these
    tests probe every list to hold the lists themselves to the exact answer, so they turn
    that off (test_a_wide_probe_scans_every_row checks it)."""
    import kalos.index.cpu_ivf as cpu_ivf

    monkeypatch.setattr(cpu_ivf, "FLAT_ABOVE", 2.0)


def ivf(kind: str, options: str, metric: str = "ip"):
    """A cpu:ivf index, or a cuda:ivf one whose tensors live on torch's CPU device."""
    if kind == "cpu":
        return create(f"cpu:ivf,{options}", dim=DIM, metric=metric)
    from kalos.index.cuda_ivf import CudaIvfIndex

    return CudaIvfIndex(f"cuda:ivf,{options}", dim=DIM, metric=metric, device="cpu")


def clustered(n: int, seed: int = 7, clusters: int = 40) -> np.ndarray:
    """n unit rows around ``clusters`` centres (structure an IVF can exploit)."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((clusters, DIM)).astype(np.float32)
    x = centres[rng.integers(0, clusters, n)] + 0.35 * rng.standard_normal((n, DIM))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def assert_exact(index, q: np.ndarray, result, k: int, scope=None) -> None:
    """``result`` is the exact top-k (up to ties) of the rows the index stores (the cuda
    index's are fp16-rounded: its own dump is the reference)."""
    ids, vectors, scopes = index.dump()
    items = {
        int(i): (v, (int(s[0]), int(s[1]), int(s[2])))
        for i, v, s in zip(ids, vectors, scopes, strict=True)
    }
    check_search(result, items, q, k, index.metric, scope, rtol=1e-3)


def recall(got: np.ndarray, want: np.ndarray) -> float:
    hits = [len(set(g.tolist()) & set(w.tolist())) for g, w in zip(got, want, strict=True)]
    return sum(hits) / want.size


@pytest.fixture(params=["ip", "cosine", "l2"])
def metric(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.mark.parametrize("kind", KINDS)
def test_recall_against_exact_and_every_list_is_exact(kind: str, metric: str) -> None:
    x = clustered(6000)
    ids = np.arange(6000, dtype=np.int64) * 3 + 1
    index = ivf(kind, "nlist=32,nprobe=8", metric)
    exact = create("cpu:flat", dim=DIM, metric=metric)
    index.add(x, ids)
    exact.add(x, ids)
    assert index.is_trained
    q = clustered(64, seed=8)
    want = exact.search(q, 10)[1]
    assert recall(index.search(q, 10)[1], want) >= 0.9
    assert recall(index.search(q, 10, nprobe=1)[1], want) < recall(index.search(q, 10)[1], want)
    assert_exact(index, q, index.search(q, 10, nprobe=32), 10)


@pytest.mark.parametrize("kind", KINDS)
def test_exact_before_training_then_trains_at_the_threshold(kind: str) -> None:
    index = ivf(kind, "nlist=8,nprobe=1")
    x = clustered(train_size(8))
    ids = np.arange(len(x), dtype=np.int64)
    index.add(x[:-1], ids[:-1])
    assert not index.is_trained
    q = clustered(20, seed=9)
    assert_exact(index, q, index.search(q, 10, nprobe=1), 10)
    index.add(x[-1:], ids[-1:])
    assert index.is_trained and index.trained_rows == len(x)
    assert int(index.list_sizes().sum()) == len(x)


@pytest.mark.parametrize("kind", KINDS)
def test_retrains_after_growing_four_times(kind: str) -> None:
    index = ivf(kind, "nlist=4")
    first = train_size(4)
    x = clustered(RETRAIN_GROWTH * first + 10)
    index.add(x[:first], np.arange(first))
    assert index.trained_rows == first and index.trainings == 1
    index.add(x[first:-10], np.arange(first, len(x) - 10))
    assert index.trainings == 2 and index.trained_rows == RETRAIN_GROWTH * first
    index.add(x[-10:], np.arange(len(x) - 10, len(x)))
    assert index.trainings == 2
    index.train()
    assert index.trainings == 3 and int(index.list_sizes().sum()) == len(x)


@pytest.mark.parametrize("kind", KINDS)
def test_writes_after_training_agree_with_an_exact_index(kind: str, metric: str) -> None:
    """Adds, upserts and removes after training, with every list probed: the exact answer,
    and the lists hold exactly the live rows."""
    rng = np.random.default_rng(11)
    index = ivf(kind, "nlist=8,nprobe=8", metric)
    exact = create("cpu:flat", dim=DIM, metric=metric)
    x = clustered(1200)
    ids = rng.permutation(5000)[:1200].astype(np.int64)
    index.add(x[:400], ids[:400])
    exact.add(x[:400], ids[:400])
    assert index.is_trained
    for step in range(12):
        op = step % 3
        if op == 0:  # new rows and upserts of old ones (new vectors), one batch
            pick = np.concatenate([ids[400 + 60 * step : 460 + 60 * step], ids[:400][::37]])
            vec = clustered(len(pick), seed=100 + step)
            index.add(vec, pick)
            exact.add(vec, pick)
        else:
            gone = rng.choice(exact.dump()[0], 25, replace=False)
            gone = np.concatenate([gone, [999_999]])  # and an unknown id
            assert index.remove(gone) == exact.remove(gone) == 25
        assert len(index) == len(exact)
        assert int(index.list_sizes().sum()) == len(index)
        assert sorted(index.dump()[0].tolist()) == sorted(exact.dump()[0].tolist())
        q = clustered(8, seed=200 + step)
        assert_exact(index, q, index.search(q, 10), 10)


@pytest.mark.parametrize("kind", KINDS)
def test_filters_widen_the_probe_until_k_rows_match(kind: str) -> None:
    x = clustered(4000)
    ids = np.arange(4000, dtype=np.int64)
    scopes = np.zeros((4000, 3), np.int64)
    scopes[:, 0] = 1
    rare = np.random.default_rng(3).choice(4000, 15, replace=False)
    scopes[rare, 0] = 2
    index = ivf(kind, "nlist=32,nprobe=1")
    index.add(x, ids, scopes)
    q = clustered(4, seed=12)
    # 15 rows in tenant 2, spread over many lists: the probe widens until 10 of them are
    # in its lists (every list probed: the exact top-10 of the 15)
    scores, got = index.search(q, 10, scope=(2, 0, 0))
    assert (got >= 0).all() and set(got.ravel().tolist()) <= set(rare.tolist())
    assert (np.diff(scores, axis=1) <= 0).all()
    assert_exact(index, q, index.search(q, 10, scope=(2, 0, 0), nprobe=32), 10, scope=(2, 0, 0))
    # allow: 12 ids, k = 20: the 12 (widened to every list), then -1
    allow = rare[:12]
    scores, got = index.search(q, 20, allow=allow)
    assert all(set(row[:12].tolist()) == set(allow.tolist()) for row in got)
    assert (got[:, 12:] == -1).all() and np.isneginf(scores[:, 12:]).all()


@pytest.mark.parametrize("kind", KINDS)
def test_per_request_nprobe_and_bad_values(kind: str) -> None:
    index = ivf(kind, "nlist=16,nprobe=2")
    x = clustered(2000)
    index.add(x, np.arange(2000))
    q = clustered(16, seed=13)
    assert_exact(index, q, index.search(q, 10, nprobe=16), 10)
    assert_exact(index, q, index.search(q, 10, nprobe=10_000), 10)  # above nlist: every list
    np.testing.assert_array_equal(index.search(q, 10, nprobe=0)[1], index.search(q, 10)[1])
    many = index.search_many([(q[:3], 10, None), (q[3:], 5, None)], nprobe=16)
    assert_exact(index, q[:3], many[0], 10)
    assert_exact(index, q[3:], many[1], 5)
    few = index.search_many([(q[:3], 10, None)], nprobe=1)[0]
    np.testing.assert_array_equal(few[1], index.search(q[:3], 10, nprobe=1)[1])
    for bad in (-1, 1.5, True, "4", None):
        with pytest.raises(InvalidRequest, match="nprobe"):
            index.search(q, 10, nprobe=bad)
    with pytest.raises(InvalidRequest, match="at least as many rows"):
        ivf(kind, "nlist=16").train()


@pytest.mark.parametrize("head", ["cpu:ivf", "cuda:ivf"])
@pytest.mark.parametrize(
    "options",
    ["", ",nprobe=4", ",nlist=0", ",nlist=x", ",nlist=-2", ",nlist=4,nlist=8", ",nlist=4,fp16",
     ",nlist=4,nprobe=0", ",nlist=4,seed=1"],
)  # fmt: skip
def test_bad_specs_raise_config_error(head: str, options: str) -> None:
    if head.startswith("cuda") and not HAS_TORCH:
        pytest.skip("torch")
    with pytest.raises(ConfigError, match="nlist"):  # about the options, checked first
        create(head + options, dim=DIM)


def test_the_spec_nprobe_is_capped_at_nlist() -> None:
    index = create("cpu:ivf,nlist=4,nprobe=64", dim=DIM)
    assert (index.nlist, index.nprobe) == (4, 4)
    assert create("cpu:ivf,nlist=256", dim=DIM).nprobe == 16


@pytest.mark.skipif(not HAS_TORCH, reason="torch")
def test_cuda_ivf_keeps_the_index_contract_on_torch_cpu(monkeypatch) -> None:
    """The conformance kit over cuda:ivf with its tensors on torch's CPU device, every list
    probed, few lists (it trains on the kit's 300 rows); fp16 storage: a looser tolerance."""
    import kalos.index.cuda_ivf as cuda_ivf
    from kalos.testing import check_index

    monkeypatch.setattr(cuda_ivf, "parse_spec", lambda spec, device_index: "cpu")
    check_index("cuda:ivf,nlist=4,nprobe=4", rtol=2e-3)


@pytest.mark.skipif(not HAS_TORCH, reason="torch")
def test_cuda_ivf_buffer_is_searched_and_merged(metric: str) -> None:
    """Rows added after training wait in an unsorted buffer that every search scores;
    flush (or growth) merges them into the sorted lists, removed rows dropped on the way."""
    index = ivf("cuda", "nlist=8,nprobe=8", metric)
    x = clustered(600)
    index.add(x[:400], np.arange(400))
    assert index.is_trained and index._buf.n == 0
    index.add(x[400:], np.arange(400, 600))
    index.remove(np.arange(0, 600, 7))
    assert index._buf.n == 200 and len(index) == 600 - len(range(0, 600, 7))
    q = clustered(6, seed=21)
    before = index.search(q, 10)
    assert_exact(index, q, before, 10)
    index.flush()
    assert index._buf.n == 0 and index._main.n == len(index)
    assert int(index.list_sizes().sum()) == len(index)
    assert_exact(index, q, index.search(q, 10), 10)


@pytest.mark.skipif(not HAS_TORCH, reason="torch")
@pytest.mark.parametrize("first_pass", ["float16", "float32"])
def test_cuda_ivf_one_query_and_a_batch_agree(metric: str, first_pass: str) -> None:
    """A single query and a batch (each query's rows padded to the widest) agree, and with
    every list probed both are exact, whichever dtype the buffer's first pass ranks in (fp16
    on a GPU: the best 64 re-scored in fp32)."""
    import torch

    index = ivf("cuda", "nlist=16,nprobe=3", metric)
    index._coarse = getattr(torch, first_pass)
    x = clustered(3000)
    index.add(x, np.arange(3000))
    index.remove(np.arange(0, 3000, 11))  # removed rows in the sorted lists: masked
    q = clustered(7, seed=31)
    batch = index.search(q, 10)
    for i in range(len(q)):
        one = index.search(q[i], 10)
        np.testing.assert_array_equal(one[1][0], batch[1][i])
        np.testing.assert_allclose(one[0][0], batch[0][i], rtol=1e-5)
    for i in range(len(q)):
        assert_exact(index, q[i : i + 1], index.search(q[i], 10, nprobe=16), 10)
    assert_exact(index, q, index.search(q, 10, nprobe=16), 10)
    index.flush()  # merged: no removed rows left, the probe needs no mask
    assert index._main_dead == 0
    assert_exact(index, q[:1], index.search(q[0], 10, nprobe=16), 10)


@pytest.mark.skipif(not HAS_TORCH, reason="torch")
def test_cuda_ivf_merges_on_the_first_search_past_the_share(monkeypatch) -> None:
    """Adds never merge (a bulk load of many adds pays one merge); the first search that
    finds the buffer, or the removed sorted rows, past 1/16 of the index merges them."""
    import kalos.index.cuda_ivf as cuda_ivf

    monkeypatch.setattr(cuda_ivf, "MERGE_MIN_ROWS", 8)
    index = ivf("cuda", "nlist=8,nprobe=8")
    x = clustered(1000)
    index.add(x[:400], np.arange(400))  # trains at 312 rows: everything sorted
    for lo in range(400, 1000, 100):
        index.add(x[lo : lo + 100], np.arange(lo, lo + 100))
    assert index._buf.n == 600 and index._main.n == 400
    q = clustered(3, seed=41)
    result = index.search(q, 10)
    assert index._buf.n == 0 and index._main.n == 1000
    assert_exact(index, q, result, 10)
    index.remove(np.arange(0, 1000, 10))  # 100 removed sorted rows > 900 / 16
    assert index._main_dead == 100
    assert_exact(index, q, index.search(q, 10), 10)
    assert index._main_dead == 0 and index._main.n == 900


# --- property test: random operations across training, against a dict model ---

_ids = st.integers(0, 90) | st.integers(1000, 1079)  # new ids, and the prefilled ones
_vec = st.lists(st.integers(-3, 3), min_size=4, max_size=4).filter(any)
_scope = st.tuples(st.integers(0, 2), st.integers(0, 2), st.integers(0, 1))
_add = st.tuples(st.just("add"), st.lists(st.tuples(_ids, _vec, _scope), min_size=1, max_size=40))
_remove = st.tuples(st.just("remove"), st.lists(_ids, max_size=12))
_search = st.tuples(
    st.just("search"), st.tuples(st.lists(_vec, min_size=1, max_size=2), st.integers(1, 12),
                                 st.none() | _scope)
)  # fmt: skip
_ops = st.lists(st.one_of(_add, _add, _remove, _search), min_size=1, max_size=20)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("metric", ["ip", "l2"])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_ops)
def test_random_operations_across_training_agree_with_a_dict_model(kind, metric, ops) -> None:
    """Two lists, both probed: exact whatever happened. The index starts trained on 80 rows
    (ids 1000-1079); the sequences add to, upsert in and remove from its lists (and retrain
    it when they grow it 4x)."""
    if kind == "cpu":
        index = create("cpu:ivf,nlist=2,nprobe=2", dim=4, metric=metric)
    else:
        from kalos.index.cuda_ivf import CudaIvfIndex

        index = CudaIvfIndex("cuda:ivf,nlist=2,nprobe=2", dim=4, metric=metric, device="cpu")
    rng = np.random.default_rng(9)
    first = rng.integers(-3, 4, (80, 4)).astype(np.float32)
    first[first[:, 0] == 0, 0] = 1  # no zero rows
    index.add(first, np.arange(1000, 1080))
    assert index.is_trained
    model: dict[int, tuple[np.ndarray, tuple[int, int, int]]] = {
        1000 + j: (first[j], (0, 0, 0)) for j in range(80)
    }
    for op, arg in ops:
        if op == "add":
            ids = np.array([i for i, _, _ in arg], dtype=np.int64)
            vectors = np.array([v for _, v, _ in arg], dtype=np.float32)
            index.add(vectors, ids, np.array([s for _, _, s in arg], dtype=np.int64))
            for i, v, s in arg:
                model[i] = (np.array(v, dtype=np.float32), s)
        elif op == "remove":
            present = {i for i in arg if i in model}
            assert index.remove(np.array(arg, dtype=np.int64)) == len(present)
            for i in present:
                del model[i]
        else:
            queries, k, scope = arg
            q = np.array(queries, dtype=np.float32)
            check_search(index.search(q, k, scope=scope), model, q, k, metric, scope)
        assert len(index) == len(model)
    assert sorted(index.dump()[0].tolist()) == sorted(model)


def test_a_wide_probe_scans_every_row(monkeypatch) -> None:
    """Probed lists holding more than FLAT_ABOVE of the rows: the flat scan answers (exact),
    without gathering the lists' rows; a narrow probe gathers them."""
    import kalos.index.cpu_ivf as cpu_ivf

    monkeypatch.setattr(cpu_ivf, "FLAT_ABOVE", 0.15)
    index = create("cpu:ivf,nlist=32,nprobe=2", dim=DIM)
    x = clustered(4000)
    index.add(x, np.arange(4000))
    gathered: list[int] = []
    real = index._rows_of_lists
    monkeypatch.setattr(index, "_rows_of_lists", lambda lists: gathered.append(1) or real(lists))
    q = clustered(5, seed=51)
    assert_exact(index, q, index.search(q, 10, nprobe=32), 10)
    allow = np.arange(0, 4000, 3)
    _, got = index.search(q, 10, nprobe=32, allow=allow)
    exact = create("cpu:flat", dim=DIM)
    exact.add(x, np.arange(4000))
    np.testing.assert_array_equal(got, exact.search(q, 10, allow=allow)[1])
    assert gathered == []
    index.search(q, 10, nprobe=1)
    assert len(gathered) == 5


@pytest.mark.skipif(not HAS_TORCH, reason="torch")
@pytest.mark.parametrize("metric", ["ip", "cosine", "l2"])
def test_cuda_ivf_single_query_steps_of_the_graphs_agree_with_the_eager_path(metric) -> None:
    """A single query in the steady state (flushed, no filter) takes the one-graph path on a
    GPU: the probed lists and their rows over a fixed power-of-two width with the rest
    masked, run again at a wider width when the rows outgrow it. Run eagerly here, it gives
    the eager path's answer for every nprobe and k, a probe wider than the index included;
    a write leaves it until the next merge."""
    index = ivf("cuda", "nlist=16,nprobe=3", metric)
    x = clustered(3000)
    index.add(x, np.arange(3000))
    index.flush()
    q = clustered(12, seed=41)
    for nprobe in (1, 3, 16):
        for k in (1, 10, 100):
            index.graphs = False
            want = [index.search(q[i], k, nprobe=nprobe) for i in range(len(q))]
            index.graphs = True
            got = [index.search(q[i], k, nprobe=nprobe) for i in range(len(q))]
            for (ws, wi), (gs, gi) in zip(want, got, strict=True):
                np.testing.assert_array_equal(gi, wi)
                np.testing.assert_allclose(gs, ws, rtol=1e-6)
    assert index._graphs is not None
    assert {key[0] for key in index._graphs._graphs} == {1, 3, 16}
    assert index._graphs.widths == {16: 4096}  # every list: 3,000 rows outgrew 1,024
    index.add(x[:5] * 0.5, np.arange(5000, 5005))  # in the buffer: the eager path again
    assert not index._graphs_ok(None)
    assert_exact(index, q[:1], index.search(q[0], 10, nprobe=16), 10)
    index.flush()
    assert index._graphs is None  # dropped by the merge


@pytest.mark.skipif(not HAS_TORCH, reason="torch")
@pytest.mark.parametrize(("b", "w", "k"), [(1, 4096, 64), (3, 16384, 10), (2, 8192, 1024),
                                           (1, 5000, 10), (1, 2048, 64)])  # fmt: skip
def test_topk_rows_equals_torch_topk(b: int, w: int, k: int) -> None:
    """The two-step top-k of wide rows: the same values and indices as one torch.topk (rows
    of distinct values), and the plain topk where the width does not split into groups."""
    import torch

    from kalos.index.cuda_ivf import topk_rows

    x = torch.randn(b, w, generator=torch.Generator().manual_seed(w + k))
    want = torch.topk(x, k, dim=1)
    got = topk_rows(torch, x, k)
    torch.testing.assert_close(got[0], want.values)
    torch.testing.assert_close(got[1], want.indices)


@pytest.mark.skipif(not HAS_TORCH, reason="torch")
def test_cuda_ivf_drops_graphs_whose_first_answer_disagrees(monkeypatch, caplog) -> None:
    """A newly captured graph's first answer is checked against the same steps run eagerly;
    one that differs (here a replay that spoils its ids) is dropped with a warning, the
    search answers from the eager path, and the index stays eager."""
    from kalos.index import cuda_ivf

    index = ivf("cuda", "nlist=16,nprobe=3")
    x = clustered(3000)
    index.add(x, np.arange(3000))
    index.flush()
    q = clustered(1, seed=43)
    index.graphs = False
    want = index.search(q[0], 10)
    real = cuda_ivf._ProbeGraphs._capture

    def spoiled(self, key):
        graph, scores, ids = real(self, key)
        run = graph.replay

        def replay() -> None:
            run()
            ids.fill_(7)

        graph.replay = replay
        return graph, scores, ids

    monkeypatch.setattr(cuda_ivf._ProbeGraphs, "_capture", spoiled)
    index.graphs = True
    with caplog.at_level("WARNING", logger="kalos.index.cuda_ivf"):
        got = index.search(q[0], 10)
    np.testing.assert_array_equal(got[1], want[1])
    assert index.graphs is False and index._graphs is None
    assert "eager launches from now on" in caplog.text
