"""kalos.bench.corpora: the harvest, real-384 and real-128 through an injected embedder (no
model), the synthetic corpora's shape and structure."""

from __future__ import annotations

import gzip
import hashlib

import numpy as np
import pytest

from kalos.bench import corpora
from kalos.errors import ConfigError


def _sentence(i: int) -> str:
    return f"line number {i} says something about topic {i % 7} and more"


@pytest.fixture
def text_root(tmp_path):
    """A folder of text files: 300 distinct qualifying lines (some repeated, some in a .gz
    file), plus lines that fail the filters and files the harvest must not read."""
    root = tmp_path / "root"
    (root / "pkg" / "sub").mkdir(parents=True)
    good = [_sentence(i) for i in range(300)]
    (root / "pkg" / "a.py").write_text("\n".join(good[:120] + good[:30]) + "\n")
    (root / "pkg" / "sub" / "b.md").write_text(
        "\n".join(f"   {'   '.join(line.split())}   " for line in good[120:200])
    )
    with gzip.open(root / "pkg" / "changelog.Debian.gz", "wt") as f:
        f.write("\n".join(good[200:300] + good[:10]))
    (root / "pkg" / "short.txt").write_text("too few words here\nx\n" + "word " * 100 + "\n")
    (root / "pkg" / "data.bin").write_text(_sentence(1000))  # not a listed suffix
    (root / "pkg" / "binary.c").write_bytes(b"\0\1" + _sentence(1001).encode())
    return root, good


def fake_embed(texts):
    """A deterministic stand-in for the model: 384-d unit rows from a hash of each text, with
    a shared mean direction (as real text embeddings have)."""
    out = np.empty((len(texts), corpora.REAL_DIM), np.float32)
    for i, t in enumerate(texts):
        seed = int.from_bytes(hashlib.blake2b(t.encode(), digest_size=8).digest(), "little")
        out[i] = np.random.default_rng(seed).standard_normal(corpora.REAL_DIM)
    out[:, :4] += 2.0
    return out / np.linalg.norm(out, axis=1, keepdims=True)


def test_text_lines_filters_and_collapses():
    text = ("  alpha  beta\tgamma delta   epsilon \n" + "one two three four and\n"
            + "four words only here\n" + "x" * 500 + " a b c d\n")  # fmt: skip
    assert list(corpora.text_lines(text)) == [
        "alpha beta gamma delta epsilon",
        "one two three four and",
    ]


def test_harvest_dedups_filters_and_orders_by_the_seed(text_root, monkeypatch):
    root, good = text_root
    h = corpora.harvest(1000, seed=3, roots=[str(root)], progress=False)
    assert sorted(h.lines) == sorted(good) and h.distinct == 300
    assert h.roots[0]["files"] == 4  # a.py, b.md, changelog.Debian.gz, short.txt
    again = corpora.harvest(1000, seed=3, roots=[str(root)], progress=False)
    assert again.lines == h.lines
    other = corpora.harvest(1000, seed=4, roots=[str(root)], progress=False)
    assert other.lines != h.lines and sorted(other.lines) == sorted(h.lines)
    assert h.exact
    # a smaller harvest is the prefix of a larger one, even when it had to prune
    monkeypatch.setattr(corpora, "PRUNE_SLACK", 0)
    small = corpora.harvest(40, seed=3, roots=[str(root)], progress=False)
    assert small.lines == h.lines[:40] and not small.exact and small.distinct >= 40
    missing = corpora.harvest(10, roots=[str(root / "nowhere")], progress=False)
    assert missing.lines == [] and missing.roots[0]["missing"]


def test_real_384_holds_queries_out_caches_and_serves_prefixes(text_root, tmp_path):
    root, _ = text_root
    cache = tmp_path / "cache"
    kw = {"seed": 1, "cache_dir": cache, "embed": fake_embed, "progress": False,
          "roots": [str(root)]}  # fmt: skip
    c = corpora.load("real-384", 200, queries=50, **kw)
    assert c.db.shape == (200, 384) and c.queries.shape == (50, 384)
    assert c.db.dtype == np.float32 and not c.info["cached"]
    np.testing.assert_allclose(np.linalg.norm(c.db, axis=1), 1, atol=1e-5)
    order = corpora.harvest(1000, seed=1, roots=[str(root)], progress=False).lines
    want = fake_embed(order[:250])
    np.testing.assert_allclose(c.queries, want[:50], atol=2e-3)  # stored as float16
    np.testing.assert_allclose(c.db, want[50:250], atol=2e-3)
    assert c.info["harvest"]["distinct_lines"] == 300 and c.info["filters"]["min_words"] == 5
    # the same parameters again: from the cache
    again = corpora.load("real-384", 200, queries=50, **kw)
    assert again.info["cached"] and np.array_equal(again.db, c.db)
    # a smaller n: the prefix of the build, the same queries
    small = corpora.load("real-384", 100, queries=50, **kw)
    assert small.info["cache"] == c.info["cache"]
    assert np.array_equal(small.db, c.db[:100]) and np.array_equal(small.queries, c.queries)
    # a larger one embeds only the rows beyond the existing build
    calls = []

    def counting(texts):
        calls.append(len(texts))
        return fake_embed(texts)

    counting.__qualname__ = fake_embed.__qualname__  # the same embedder, for the cache's key
    big = corpora.load("real-384", 240, queries=50, **{**kw, "embed": counting})
    assert calls == [40] and np.array_equal(big.db[:200], c.db)
    assert len(list(cache.glob("real-384-*"))) == 2


def test_real_384_with_too_few_lines_says_how_many_and_where(text_root, tmp_path):
    root, _ = text_root
    with pytest.raises(ConfigError, match=r"needs 1,050 distinct.*has 300 \(.*root: 340 lines"):
        corpora.load("real-384", 1000, queries=50, cache_dir=tmp_path, embed=fake_embed,
                     progress=False, roots=[str(root)])  # fmt: skip


def test_real_128_is_the_projection_on_the_top_directions(text_root, tmp_path):
    root, _ = text_root
    kw = {"seed": 1, "cache_dir": tmp_path, "embed": fake_embed, "progress": False,
          "roots": [str(root)]}  # fmt: skip
    base = corpora.load("real-384", 250, queries=50, **kw)
    c = corpora.load("real-128", 250, queries=50, **kw)
    assert c.db.shape == (250, 128) and c.queries.shape == (50, 128)
    np.testing.assert_allclose(np.linalg.norm(c.db, axis=1), 1, atol=1e-5)
    comps, variances = corpora.principal_directions(base.db, 128)
    assert np.all(np.diff(variances) <= 1e-12)
    np.testing.assert_allclose(comps.T @ comps, np.eye(128), atol=1e-8)
    np.testing.assert_allclose(c.db, corpora.project(base.db, comps), atol=2e-3)
    np.testing.assert_allclose(c.queries, corpora.project(base.queries, comps), atol=2e-3)
    # the raw rows were projected: the mean direction survives
    want = base.db.mean(axis=0) @ comps
    got = c.db.mean(axis=0)
    assert got @ want / np.linalg.norm(got) / np.linalg.norm(want) > 0.99
    assert c.info["mean_norm"] > 0.5 * base.info["mean_norm"]
    again = corpora.load("real-128", 250, queries=50, **kw)
    assert np.array_equal(again.db, c.db)


def test_clustered_has_the_structure_of_real_embeddings():
    c = corpora.load("clustered", 20_000, 64, queries=200, seed=5, progress=False)
    assert c.db.shape == (20_000, 64) and c.queries.shape == (200, 64)
    assert c.db.dtype == np.float32 == c.queries.dtype
    np.testing.assert_allclose(np.linalg.norm(c.db, axis=1), 1, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(c.queries, axis=1), 1, atol=1e-5)
    again = corpora.load("clustered", 20_000, 64, queries=200, seed=5, progress=False)
    assert np.array_equal(again.db, c.db) and np.array_equal(again.queries, c.queries)
    other = corpora.load("clustered", 20_000, 64, queries=200, seed=6, progress=False)
    assert not np.allclose(other.db[:10], c.db[:10])
    # anisotropic: a shared mean direction, far above uniform's ~1/sqrt(n)
    uniform = corpora.load("uniform", 20_000, 64, queries=200, progress=False)
    assert c.info["mean_norm"] > 0.25 > 10 * uniform.info["mean_norm"]
    # a decaying spectrum: the top few directions carry far more than their share
    _, variances = corpora.principal_directions(c.db, 64)
    assert variances[:8].sum() / variances.sum() > 3 * 8 / 64
    # near-duplicates: about 5% of rows have a neighbour at cosine > 0.99
    sample = c.db[:4000]
    scores = sample @ c.db.T
    scores[np.arange(4000), np.arange(4000)] = -1
    close = (scores.max(axis=1) > 0.99).mean()
    assert 0.03 < close < 0.2
    # queries near rows, never equal to one
    best = (c.queries @ c.db.T).max(axis=1)
    assert best.max() < 0.9999 and np.median(best) > 0.7
    assert c.info["clusters"] == 20 and c.info["largest_cluster_rows"] > 20_000 / 20


def test_uniform_and_the_argument_checks():
    c = corpora.load("uniform", 3000, 32, queries=10, seed=2, progress=False)
    assert c.db.shape == (3000, 32) and c.queries.shape == (10, 32)
    np.testing.assert_allclose(np.linalg.norm(c.db, axis=1), 1, atol=1e-5)
    assert np.array_equal(corpora.load("uniform", 3000, 32, queries=10, seed=2,
                                       progress=False).db, c.db)  # fmt: skip
    assert c.info["corpus"] == "uniform" and c.info["n"] == 3000 and c.info["dim"] == 32
    with pytest.raises(ConfigError, match="unknown corpus"):
        corpora.load("random", 10, 8)
    with pytest.raises(ConfigError, match="needs a dim"):
        corpora.load("clustered", 10)
    with pytest.raises(ConfigError, match=r"64\.\.1536"):
        corpora.load("clustered", 10, 32)
    with pytest.raises(ConfigError, match="384-d"):
        corpora.load("real-384", 10, 128)


def test_benchmark_sets_parse():
    from kalos.cli import build_parser
    from kalos.index.cuda_flat import parse_spec

    assert corpora.parse_set("clustered:10000000x128") == ("clustered", 10_000_000, 128)
    assert corpora.parse_set("real-384:1000000") == ("real-384", 1_000_000, None)
    with pytest.raises(ConfigError, match="not CORPUS"):
        corpora.parse_set("clustered:many")
    with pytest.raises(ConfigError, match="unknown corpus"):
        corpora.parse_set("random:1000x8")
    args = build_parser().parse_args(["bench", "search-gpu"])
    assert [(name, dim) for name, _, dim in args.sets] == [
        ("real-384", None), ("real-128", None), ("clustered", 768), ("clustered", 1536),
        ("clustered", 128), ("uniform", 128)]  # fmt: skip
    assert args.scan == "auto"
    args = build_parser().parse_args(["bench", "search-gpu", "--sets", "uniform:1000x64"])
    assert args.sets == [("uniform", 1000, 64)]
    args = build_parser().parse_args(["bench", "search-gpu", "--scan", "4bit"])
    assert parse_spec(f"cuda:flat,fp16,scan={args.scan}")[:3] == ("cuda", "fp16", "4bit")
    assert build_parser().parse_args(["bench", "search-cpu"]).corpus == "real-384"
