"""kalos serve --source-table: a table that an application writes, mirrored by every sidecar.

Against a real PostgreSQL server that the module starts itself (kalos.testing_postgres); each
test gets a database of its own. The application is a plain psycopg connection running plain
SQL on its own table, which knows nothing of Kalos.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import random
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import kalos
from kalos.testing_postgres import PostgresServer, unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

DIM = 8
COLUMNS = "id=doc_id,vector=embedding,payload=body,tenant=org,metadata=attrs"
_db_names = itertools.count()


def vector(seed: int) -> np.ndarray:
    """A random vector: each seed's is the only one at distance 0 from it."""
    return np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)


@pytest.fixture
def source(pg: PostgresServer) -> str:
    return pg.create_database(f"mirror_{os.getpid()}_{next(_db_names)}")


@pytest.fixture
def app(source: str) -> Iterator[Any]:
    """The application's own connection: autocommit, plain SQL."""
    import psycopg

    with psycopg.connect(source, autocommit=True) as conn:
        yield conn


def create_docs(app: Any, *, ids: str = "bigint", vectors: str = "real[]") -> None:
    """The application's table: more columns than Kalos reads, one NOT NULL with a default."""
    app.execute(
        f"CREATE TABLE docs (doc_id {ids} PRIMARY KEY, embedding {vectors}, body text, "
        "org text, attrs jsonb, updated timestamptz NOT NULL DEFAULT now())"
    )


def encode(v: np.ndarray, vectors: str) -> Any:
    """A vector as the application stores it: real[] (a list) or bytea (float32 bytes)."""
    return v.astype("<f4").tobytes() if vectors == "bytea" else [float(x) for x in v]


@contextlib.contextmanager
def mirrors(
    source: str, runtime_dir: str, n: int = 2, columns: str = COLUMNS, **config: Any
) -> Iterator[list[kalos.Client]]:
    """``n`` sidecars mirroring ``docs``, and a client of each."""
    from kalos.server import Sidecar, SidecarConfig

    with contextlib.ExitStack() as stack:
        clients = []
        for i in range(n):
            cfg = SidecarConfig(name=f"m{i}", dim=DIM, metric="l2", runtime_dir=runtime_dir,
                                source=source, source_table="docs", source_columns=columns,
                                **config)  # fmt: skip
            stack.enter_context(Sidecar(cfg))
            clients.append(stack.enter_context(kalos.Client(f"m{i}", runtime_dir=runtime_dir)))
        yield clients


def hit(client: kalos.Client, v: np.ndarray, scope: kalos.Scope | None = None) -> Any:
    """(id, payload, metadata) of the item at distance 0 from ``v``, or None."""
    r = client.search(v[None], k=1, scope=scope, payloads=True, metadata=True)
    if int(r.ids[0, 0]) >= 0 and float(r.scores[0, 0]) < 1e-6:
        return int(r.ids[0, 0]), r.payloads[0], r.metadata[0]
    return None


def wait_for(predicate: Any, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


@pytest.mark.parametrize(
    ("ids", "vectors"), [("bigint", "real[]"), ("text", "bytea")], ids=["bigint-real", "text-bytea"]
)
def test_rows_the_application_writes_with_plain_sql_are_searched(
    source: str, runtime_dir: str, app: Any, ids: str, vectors: str
) -> None:
    create_docs(app, ids=ids, vectors=vectors)

    def doc(i: int) -> Any:
        return f"doc-{i}" if ids == "text" else i

    def item(i: int) -> int:
        return kalos.key_id(f"doc-{i}") if ids == "text" else i

    insert = "INSERT INTO docs (doc_id, embedding, body, org, attrs) VALUES (%s, %s, %s, %s, %s)"
    for i in range(3):  # before any sidecar: the bootstrap loads them
        app.execute(insert, (doc(i), encode(vector(i), vectors), f"body {i}", "acme", None))
    with mirrors(source, runtime_dir) as clients:
        for c in clients:
            assert c.stats()["items"] == 3 and hit(c, vector(1)) == (item(1), "body 1", None)
        app.execute(insert, (doc(10), encode(vector(10), vectors), "ten", "acme",
                             '{"lang": "en", "year": 2024}'))  # fmt: skip
        with app.transaction():  # several rows, one transaction
            for i in (11, 12):
                app.execute(insert, (doc(i), encode(vector(i), vectors), None, None, None))
        for c in clients:
            wait_for(lambda c=c: hit(c, vector(12)) == (item(12), None, None), "the inserts")
            assert hit(c, vector(10)) == (item(10), "ten", {"lang": "en", "year": 2024})
            assert hit(c, vector(10), kalos.Scope("acme")) is not None
            assert hit(c, vector(10), kalos.Scope("other")) is None
            r = c.search(vector(10)[None], k=5, where={"year": {"gte": 2020}}, metadata=True)
            assert [int(x) for x in r.ids[0] if x >= 0] == [item(10)]
            if ids == "text":
                assert r.keys is not None and r.keys[0] == "doc-10"
        # the row moves (new vector), its body and tenant change; one row goes
        app.execute(
            "UPDATE docs SET embedding = %s, body = 'moved', org = 'other' WHERE doc_id = %s",
            (encode(vector(100), vectors), doc(10)),
        )
        app.execute("DELETE FROM docs WHERE doc_id = %s", (doc(11),))
        for c in clients:
            wait_for(lambda c=c: hit(c, vector(100)) is not None, "the update")
            assert hit(c, vector(100), kalos.Scope("other"))[:2] == (item(10), "moved")
            assert hit(c, vector(10)) is None  # the old vector is gone
            wait_for(lambda c=c: hit(c, vector(11)) is None, "the delete")
            assert c.stats()["items"] == 5
        app.execute("TRUNCATE docs")
        app.execute(insert, (doc(7), encode(vector(7), vectors), "after", None, None))
        for c in clients:
            wait_for(lambda c=c: c.stats()["items"] == 1, "the truncate")
            assert hit(c, vector(7)) == (item(7), "after", None)
            assert c.stats()["source"]["table"] == "public.docs"


def test_kalos_own_memories_table_is_not_mirrored_beside_a_table(
    source: str, runtime_dir: str, app: Any
) -> None:
    """A mirroring sidecar's memories are the table's rows; sidecars without --source-table
    on the same database keep following kalos_memories, untouched by the table's changes."""
    from kalos.server import Sidecar, SidecarConfig

    create_docs(app)
    plain = SidecarConfig(name="plain", dim=DIM, metric="l2", runtime_dir=runtime_dir,
                          source=source)  # fmt: skip
    with (
        mirrors(source, runtime_dir, n=1) as (mirror,),
        Sidecar(plain),
        kalos.Client("plain", runtime_dir=runtime_dir) as own,
    ):
        own.add(vector(1)[None], [1], ["in kalos_memories"])
        app.execute("INSERT INTO docs (doc_id, embedding) VALUES (2, %s)", (encode(vector(2), ""),))
        wait_for(lambda: hit(mirror, vector(2)) is not None, "the table's row")
        time.sleep(0.2)
        assert hit(mirror, vector(1)) is None and mirror.stats()["items"] == 1
        assert hit(own, vector(2)) is None and own.stats()["items"] == 1
        assert own.stats()["source"]["apply_errors"] == 0


def test_writes_through_a_sidecar_go_into_the_table(
    source: str, runtime_dir: str, app: Any
) -> None:
    create_docs(app)
    with mirrors(source, runtime_dir) as (a, b):
        assert a.add(np.stack([vector(1), vector(2)]), [1, 2], ["one", "two"],
                     scope=kalos.Scope("acme"), metadata=[{"n": 1}, None]) == 2  # fmt: skip
        rows = app.execute("SELECT doc_id, body, org, attrs, embedding FROM docs ORDER BY 1")
        got = rows.fetchall()
        assert [r[:4] for r in got] == [(1, "one", "acme", {"n": 1}), (2, "two", "acme", None)]
        assert np.array_equal(np.array(got[0][4], np.float32), vector(1))
        wait_for(lambda: hit(b, vector(2)) == (2, "two", None), "the add on the other sidecar")
        assert a.add(vector(3)[None], [1], ["one again"]) == 0  # an upsert, without a scope
        assert app.execute("SELECT body, org FROM docs WHERE doc_id = 1").fetchone() == (
            "one again",
            None,
        )
        assert b.remove([2, 99]) == 1
        assert app.execute("SELECT count(*) FROM docs").fetchone()[0] == 1
        a.add(vector(4)[None], [4], ["four"], scope=kalos.Scope("other"))
        assert b.forget(kalos.Scope("other")).memories == 1
        assert [r[0] for r in app.execute("SELECT doc_id FROM docs")] == [1]
        for c in (a, b):
            wait_for(lambda c=c: c.stats()["items"] == 1, "the removes")
            assert hit(c, vector(3)) == (1, "one again", None)

        # what the table cannot hold is refused, with the reason; nothing is written
        refused = [
            (lambda: a.add(vector(5)[None], [5], [b"\x00bytes"]), "text"),
            (lambda: a.add(vector(5)[None], [5], scope=kalos.Scope(user="u")), "no user column"),
            (lambda: a.add(vector(5)[None], ["doc-5"]), "integers"),
            (lambda: a.add(vector(5)[None], [5], tokens=[[1, 2]]), "token ids"),
            (lambda: a.add(vector(5)[None], [1 << 40], ["too big"]), None),
            (lambda: a.forget(kalos.Scope(session="s")), "no session column"),
        ]
        app.execute("ALTER TABLE docs ADD CHECK (doc_id < 1000000)")
        for call, why in refused:
            with pytest.raises(kalos.InvalidRequest, match=why or "refused"):
                call()
        assert a.add(vector(5)[None], [5], ["five"]) == 1  # and the next write goes through
        assert app.execute("SELECT count(*) FROM docs").fetchone()[0] == 2
        assert not a.stats()["source"]["degraded"]


def test_string_ids_through_a_sidecar(source: str, runtime_dir: str, app: Any) -> None:
    create_docs(app, ids="text", vectors="bytea")
    with mirrors(source, runtime_dir) as (a, b):
        a.add(np.stack([vector(1), vector(2)]), ["doc-1", "doc-2"], ["one", "two"])
        stored = dict(app.execute("SELECT doc_id, embedding FROM docs"))
        assert sorted(stored) == ["doc-1", "doc-2"]
        assert np.frombuffer(stored["doc-1"], "<f4").tolist() == vector(1).tolist()
        with pytest.raises(kalos.InvalidRequest, match="string ids"):
            a.add(vector(3)[None], [3])
        wait_for(lambda: hit(b, vector(2)) is not None, "the add on the other sidecar")
        assert b.remove(["doc-1", "doc-9"]) == 1
        assert [r[0] for r in app.execute("SELECT doc_id FROM docs")] == ["doc-2"]
        wait_for(lambda: a.stats()["items"] == 1, "the remove")
        assert [m.key for m in a.lookup(["doc-2"])] == ["doc-2"]


@pytest.mark.parametrize(
    ("table", "columns", "why"),
    [
        ("nowhere", COLUMNS, "no such table"),
        ("docs", "id=doc_id,vector=emb", "has no column 'emb'"),
        ("docs", "id=doc_id,vector=body", "a text column; vector must be one of"),
        ("docs", "id=body,vector=embedding", "primary key or have a unique index"),
        ("docs", "id=doc_id,vector=pgv", "pgvector's vector type is not supported yet"),
        ("docs_view", COLUMNS, "not an ordinary table"),
    ],
)
def test_a_bad_column_mapping_is_refused_at_start(
    source: str, runtime_dir: str, app: Any, table: str, columns: str, why: str
) -> None:
    from kalos.server import Sidecar, SidecarConfig

    create_docs(app)
    app.execute("CREATE DOMAIN vector AS real[]")  # named as pgvector's type is
    app.execute("ALTER TABLE docs ADD COLUMN pgv vector")
    app.execute("CREATE VIEW docs_view AS SELECT * FROM docs")
    cfg = SidecarConfig(name="bad", dim=DIM, runtime_dir=runtime_dir, source=source,
                        source_table=table, source_columns=columns)  # fmt: skip
    with pytest.raises(kalos.ConfigError, match=why):
        Sidecar(cfg).start()
    # nothing was installed on the table
    triggers = app.execute("SELECT count(*) FROM pg_trigger WHERE tgname LIKE 'kalos_mirror%'")
    assert triggers.fetchone()[0] == 0


@pytest.mark.parametrize(
    ("columns", "why"),
    [
        ("id=doc_id", "needs vector=COLUMN"),
        ("id=doc_id,vector=embedding,colour=c", "unknown role 'colour'"),
        ("id=doc_id,vector=embedding,payload", "not ROLE=COLUMN"),
        ("id=doc_id,vector=embedding,tenant=doc_id", "two roles"),
    ],
)
def test_a_malformed_column_mapping_is_a_config_error(columns: str, why: str) -> None:
    from kalos.server import SidecarConfig

    with pytest.raises(kalos.ConfigError, match=why):
        SidecarConfig(name="x", dim=DIM, source="dbname=x", source_table="docs",
                      source_columns=columns)  # fmt: skip
    with pytest.raises(kalos.ConfigError, match="go together"):
        SidecarConfig(name="x", dim=DIM, source="dbname=x", source_table="docs")
    with pytest.raises(kalos.ConfigError, match="needs --source"):
        SidecarConfig(name="x", dim=DIM, source_table="docs", source_columns=COLUMNS)


def test_a_row_that_cannot_be_a_memory_is_left_out_with_its_reason(
    source: str, runtime_dir: str, app: Any, caplog: pytest.LogCaptureFixture
) -> None:
    create_docs(app)
    insert = "INSERT INTO docs (doc_id, embedding, body, attrs) VALUES (%s, %s, %s, %s)"
    bad = [  # (id, vector, attrs, the reason logged)
        (1, [1.0, 2.0], None, "2 values; the index has 8"),
        (2, None, None, "is NULL"),
        (3, [*vector(3).tolist()[:7], None], None, "NULL elements"),
        (4, vector(4).tolist(), "[1, 2]", "must be a dict"),
        (5, [float("nan")] * DIM, None, "NaN"),
    ]
    app.execute(insert, (0, vector(0).tolist(), "good", None))
    for row_id, v, attrs, _ in bad[:3]:  # in the load
        app.execute(insert, (row_id, v, "bad", attrs))
    caplog.set_level(logging.WARNING, logger="kalos.source")
    with mirrors(source, runtime_dir, n=1) as (c,):
        assert c.stats()["items"] == 1 and c.stats()["source"]["apply_errors"] == 3
        for row_id, v, attrs, _ in bad[3:]:  # in the feed
            app.execute(insert, (row_id, v, "bad", attrs))
        app.execute(insert, (6, vector(6).tolist(), "good too", None))
        wait_for(lambda: hit(c, vector(6)) is not None, "the row after the bad ones")
        assert c.stats()["source"]["apply_errors"] == 5 and c.stats()["items"] == 2
        logged = "\n".join(r.getMessage() for r in caplog.records)
        for row_id, _, _, why in bad:
            assert why in logged, (row_id, logged)
        # a fixed row appears; a row broken by an update leaves the index
        app.execute("UPDATE docs SET embedding = %s WHERE doc_id = 2", (vector(2).tolist(),))
        app.execute("UPDATE docs SET embedding = '{1,2,3}' WHERE doc_id = 0")
        wait_for(lambda: hit(c, vector(2)) is not None, "the fixed row")
        wait_for(lambda: hit(c, vector(0)) is None, "the broken row to leave")
        assert hit(c, vector(6)) == (6, "good too", None)
        assert not c.stats()["source"]["degraded"]


@pytest.mark.parametrize("seed", [1, 2])
def test_random_writes_anywhere_every_sidecar_equals_the_table(
    source: str, runtime_dir: str, app: Any, seed: int
) -> None:
    """Random upserts, moves, removes and forgets through random sidecars and straight into
    the table; then every sidecar's answers equal a reference built from the table."""
    rng = random.Random(seed)
    create_docs(app)
    tenants = ["acme", "other", None]
    with mirrors(source, runtime_dir, n=3) as clients:
        for step in range(120):
            row_id, c, what = rng.randrange(30), rng.choice(clients), rng.random()
            tenant = rng.choice(tenants)
            v, body = vector(1000 * step + row_id), f"s{step}"
            if what < 0.3:
                c.add(v[None], [row_id], [body], scope=kalos.Scope(tenant),
                      metadata={"step": step})  # fmt: skip
            elif what < 0.6:
                app.execute(
                    "INSERT INTO docs (doc_id, embedding, body, org) VALUES (%s, %s, %s, %s) "
                    "ON CONFLICT (doc_id) DO UPDATE SET embedding = EXCLUDED.embedding, "
                    "body = EXCLUDED.body, org = EXCLUDED.org, attrs = NULL",
                    (row_id, v.tolist(), body, tenant),
                )
            elif what < 0.68:
                app.execute("UPDATE docs SET body = %s WHERE doc_id %% 7 = %s", (body, row_id % 7))
            elif what < 0.76:
                c.remove([row_id])
            elif what < 0.84:
                app.execute("DELETE FROM docs WHERE doc_id = %s", (row_id,))
            elif what < 0.855:
                c.forget(kalos.Scope(rng.choice(tenants[:2])))
            else:
                c.forget(kalos.Scope(), where={"step": {"lt": step - 20}})
        reference = {
            int(r[0]): (np.array(r[1], np.float32), r[2], r[3], r[4])
            for r in app.execute("SELECT doc_id, embedding, body, org, attrs FROM docs")
        }
        assert len(reference) >= 8  # the sequence left rows to compare

        def agrees(c: kalos.Client) -> bool:
            if c.stats()["items"] != len(reference):
                return False
            for row_id, (v, body, tenant, attrs) in reference.items():
                if hit(c, v) != (row_id, body, attrs):
                    return False
                if tenant is not None and hit(c, v, kalos.Scope(tenant)) is None:
                    return False
            return True

        for c in clients:
            wait_for(lambda c=c: agrees(c), "a sidecar equal to the table")


def test_the_documented_privileges_are_enough(
    pg: PostgresServer, source: str, runtime_dir: str, app: Any
) -> None:
    """The sidecar's role: CREATE on the schema, SELECT, INSERT, UPDATE, DELETE and TRIGGER
    on the table; the application's role: its own privileges on its table, nothing new."""
    import psycopg

    create_docs(app)
    for role in ("mirror_sidecar", "docs_app"):
        app.execute(f"CREATE ROLE {role} LOGIN")
        app.execute(f"GRANT CONNECT ON DATABASE {app.info.dbname} TO {role}")
    app.execute("GRANT CREATE, USAGE ON SCHEMA public TO mirror_sidecar")
    app.execute("GRANT SELECT, INSERT, UPDATE, DELETE, TRIGGER ON docs TO mirror_sidecar")
    app.execute("GRANT SELECT, INSERT, UPDATE, DELETE, TRUNCATE ON docs TO docs_app")
    as_sidecar = source.replace("user=kalos", "user=mirror_sidecar")
    with (
        mirrors(as_sidecar, runtime_dir, n=1) as (c,),
        psycopg.connect(source.replace("user=kalos", "user=docs_app"), autocommit=True) as own,
    ):
        own.execute("INSERT INTO docs (doc_id, embedding, body) VALUES (1, %s, 'by the app')",
                    (vector(1).tolist(),))  # fmt: skip
        wait_for(lambda: hit(c, vector(1)) == (1, "by the app", None), "the application's row")
        c.add(vector(2)[None], [2], ["through the sidecar"])
        own.execute("DELETE FROM docs WHERE doc_id = 1")
        wait_for(lambda: c.stats()["items"] == 1, "the application's delete")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            own.execute("SELECT * FROM kalos_changes")


def test_a_restart_resumes_its_snapshot_of_the_table_and_another_mapping_loads(
    source: str, runtime_dir: str, app: Any, tmp_path: Any
) -> None:
    from kalos.server import Sidecar, SidecarConfig

    create_docs(app, ids="text")

    def started(columns: str) -> Sidecar:
        return Sidecar(SidecarConfig(
            name="snap", dim=DIM, metric="l2", runtime_dir=runtime_dir, source=source,
            source_table="docs", source_columns=columns, data_dir=str(tmp_path / "data"),
        ))  # fmt: skip

    insert = "INSERT INTO docs (doc_id, embedding, body) VALUES (%s, %s, %s)"
    for i in range(10):
        app.execute(insert, (f"doc-{i}", vector(i).tolist(), f"body {i}"))
    with started(COLUMNS), kalos.Client("snap", runtime_dir=runtime_dir) as c:
        assert c.stats()["items"] == 10
    for i in range(10, 15):  # while it is down
        app.execute(insert, (f"doc-{i}", vector(i).tolist(), f"body {i}"))
    app.execute("DELETE FROM docs WHERE doc_id = 'doc-0'")
    with started(COLUMNS), kalos.Client("snap", runtime_dir=runtime_dir) as c:
        st = c.stats()["source"]
        assert st["resumed"] is True and st["loaded_rows"] == 0, st["resume_reason"]
        assert c.stats()["items"] == 14 and hit(c, vector(0)) is None
        assert hit(c, vector(12)) == (kalos.key_id("doc-12"), "body 12", None)
        assert [m.key for m in c.lookup(["doc-3"])] == ["doc-3"]  # string ids restored
    with started("id=doc_id,vector=embedding"), kalos.Client("snap", runtime_dir=runtime_dir) as c:
        st = c.stats()["source"]
        assert st["resumed"] is False and "source_table" in st["resume_reason"]
        assert c.stats()["items"] == 14 and hit(c, vector(12)) == (
            kalos.key_id("doc-12"),
            None,
            None,
        )


def test_a_dropped_table_leaves_the_sidecar_serving_reads(
    source: str, runtime_dir: str, app: Any
) -> None:
    create_docs(app)
    app.execute("INSERT INTO docs (doc_id, embedding, body) VALUES (1, %s, 'kept')",
                (vector(1).tolist(),))  # fmt: skip
    with mirrors(source, runtime_dir, n=1) as (c,):
        assert hit(c, vector(1)) == (1, "kept", None)
        app.execute("DROP TABLE docs")
        gone = r'not acknowledged.*"public.docs" does not exist\)$'  # one line: no SQL excerpt
        with pytest.raises(kalos.KalosError, match=gone):
            c.add(vector(2)[None], [2], ["refused"])
        # the next change in the feed cannot be read with the table gone: the follower says
        # so and retries, and the sidecar goes on serving reads
        app.execute("INSERT INTO kalos_state (key, value) VALUES ('k', 'v')")
        wait_for(lambda: c.stats()["source"]["degraded"], "degraded")
        assert hit(c, vector(1)) == (1, "kept", None)


def test_kalos_serve_mirrors_a_table_or_says_why_it_cannot(
    source: str, runtime_dir: str, app: Any, tmp_path: Any
) -> None:
    import subprocess

    from kalos.testing import serve_command, wait_for_socket, wait_ready

    create_docs(app)
    app.execute("INSERT INTO docs (doc_id, embedding) VALUES (1, %s)", (vector(1).tolist(),))
    source_file = tmp_path / "source"
    source_file.write_text(source)

    def serve(columns: str) -> subprocess.Popen:
        cmd = serve_command("cli", DIM, runtime_dir, "--source-file", str(source_file),
                            "--source-table", "public.docs", "--source-columns", columns,
                            "--no-admin", metric="l2")  # fmt: skip
        return subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)

    bad = serve("id=doc_id,vector=body")
    _, err = bad.communicate(timeout=60)
    assert bad.returncode != 0 and "Traceback" not in err
    assert "--source-columns vector=body: a text column; vector must be one of" in err
    good = serve("id=doc_id,vector=embedding")
    try:
        from kalos.paths import socket_path

        wait_for_socket(socket_path("cli", runtime_dir), good)
        wait_ready(socket_path("cli", runtime_dir), good, timeout=30)
        with kalos.Client("cli", runtime_dir=runtime_dir) as c:
            assert c.stats()["source"]["table"] == "public.docs"
            assert hit(c, vector(1)) == (1, None, None)
    finally:
        good.terminate()
        good.communicate(timeout=10)


def test_a_start_waits_for_no_open_transaction_of_the_application(
    source: str, runtime_dir: str, app: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Creating triggers waits for the table's open write transactions: a start does it only
    when they are missing, and then gives up after a bound instead of stalling the writers."""
    import psycopg

    from kalos.server import Sidecar, SidecarConfig, source_table

    monkeypatch.setattr(source_table, "INSTALL_LOCK_TIMEOUT_MS", 500)
    create_docs(app)
    with mirrors(source, runtime_dir, n=1):  # installs the triggers
        pass
    insert = "INSERT INTO docs (doc_id, embedding) VALUES (%s, %s)"
    with psycopg.connect(source) as busy:  # an open write transaction on the table
        busy.execute(insert, (1, vector(1).tolist()))
        with mirrors(source, runtime_dir, n=1) as (c,):  # nothing to install: no wait
            busy.commit()
            wait_for(lambda: hit(c, vector(1)) is not None, "the committed row")
        app.execute("DROP TRIGGER kalos_mirror_deleted ON docs")
        busy.execute(insert, (2, vector(2).tolist()))
        cfg = SidecarConfig(name="late", dim=DIM, metric="l2", runtime_dir=runtime_dir,
                            source=source, source_table="docs", source_columns=COLUMNS)  # fmt: skip
        with pytest.raises(kalos.KalosError, match=r"could not be installed within 0\.5 s"):
            Sidecar(cfg).start()
        busy.rollback()
    with mirrors(source, runtime_dir, n=1) as (c,):  # once it is done, the start puts it back
        app.execute("DELETE FROM docs WHERE doc_id = 1")
        wait_for(lambda: c.stats()["items"] == 0, "the delete, through the trigger put back")
