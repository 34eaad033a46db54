"""kalos bench replicas at a small size: 3 sidecars on a PostgreSQL server it starts."""

from __future__ import annotations

import json

import pytest

from kalos.cli import build_parser
from kalos.testing_postgres import unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))


def test_replicas_bench(tmp_path):
    args = build_parser().parse_args(
        ["bench", "replicas", "--visible-writes", "20", "--seconds", "0.5", "--writers", "2",
         "--bootstrap-rows", "500", "--out", str(tmp_path), "--machine", "test", "--quiet"]
    )  # fmt: skip
    assert args.func(args) == 0
    result = json.loads((tmp_path / "replicas-test.json").read_text())
    assert result["checks"]["lost"] == 0 and result["checks"]["replicas_agree"]
    rows = {r["system"]: r for r in result["rows"]}
    assert rows["write-to-visible"]["write_to_visible_p99_ms"] > 0
    assert rows["writes through 1 sidecar"]["adds_per_s"] > 0
    assert rows["bootstrap"]["items_loaded"] == 500


@pytest.mark.parametrize("table", ["kalos_memories", "real[]", "bytea"])
def test_the_bootstrap_alone_from_each_kind_of_table(tmp_path, table):
    args = build_parser().parse_args(
        ["bench", "replicas", "--bootstrap-only", "--bootstrap-rows", "3000", "--bootstrap-dim",
         "24", "--bootstrap-table", table, "--out", str(tmp_path), "--machine", "test"]
    )  # fmt: skip
    assert args.func(args) == 0
    (path,) = tmp_path.glob("replicas-test-bootstrap-3000x24*.json")
    (row,) = json.loads(path.read_text())["rows"]
    assert row["table"] == table and row["dim"] == 24 and row["items_loaded"] == 3000
    assert row["bootstrap_s"] > 0 and row["sidecar_peak_rss_mib"] > 0


def test_copy_blocks_are_what_postgresql_reads():
    """The benchmark's binary COPY rows, read back by PostgreSQL, are the vectors given."""
    import numpy as np
    import psycopg

    from kalos.bench.replicas import COPY_HEADER, COPY_TRAILER, copy_block
    from kalos.testing_postgres import postgres_server

    vectors = np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32)
    with postgres_server() as pg, psycopg.connect(pg.conninfo(), autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id bigint, a real[], b bytea)")
        for column, as_array in (("a", True), ("b", False)):
            with conn.cursor().copy(f"COPY t (id, {column}) FROM STDIN (FORMAT BINARY)") as copy:
                copy.write(COPY_HEADER)
                copy.write(copy_block(np.arange(5) + 10, vectors, as_array))
                copy.write(COPY_TRAILER)
        arrays = conn.execute("SELECT id, a FROM t WHERE a IS NOT NULL ORDER BY id").fetchall()
        blobs = conn.execute("SELECT id, b FROM t WHERE b IS NOT NULL ORDER BY id").fetchall()
    assert [r[0] for r in arrays] == [r[0] for r in blobs] == [10, 11, 12, 13, 14]
    assert np.array_equal(np.array([r[1] for r in arrays], np.float32), vectors)
    assert np.array_equal(np.stack([np.frombuffer(r[1], "<f4") for r in blobs]), vectors)
