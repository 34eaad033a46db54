"""kalos serve --source: PostgreSQL as the source of truth, every sidecar a live replica.

Against a real PostgreSQL server that the module starts itself (kalos.testing_postgres:
initdb into a temporary directory, a private socket directory, fsync on); each test gets a
database of its own. Three sidecars on this machine stand in for three hosts.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import kalos
from kalos.testing_postgres import PostgresServer, unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))

DIM = 8
_db_names = itertools.count()


def vector(item: int) -> np.ndarray:
    """The item's vector: random, so each item is the only one at distance 0 from it."""
    return np.random.default_rng(item).standard_normal(DIM).astype(np.float32)


@pytest.fixture
def source(pg: PostgresServer) -> str:
    return pg.create_database(f"kalos_{os.getpid()}_{next(_db_names)}")


@contextlib.contextmanager
def replicas(source: str, runtime_dir: str, n: int = 3, **config) -> Iterator[list[kalos.Client]]:
    """``n`` sidecars (in this process) on ``source``, and a client of each."""
    from kalos.server import Sidecar, SidecarConfig

    with contextlib.ExitStack() as stack:
        clients = []
        for i in range(n):
            cfg = SidecarConfig(
                name=f"r{i}", dim=DIM, metric="l2", runtime_dir=runtime_dir, source=source, **config
            )
            stack.enter_context(Sidecar(cfg))
            clients.append(stack.enter_context(kalos.Client(f"r{i}", runtime_dir=runtime_dir)))
        yield clients


def find(client: kalos.Client, item: int) -> str | None:
    """The item's payload in the sidecar, or None when it does not hold it."""
    r = client.search(vector(item)[None], k=1, payloads=True)
    if int(r.ids[0, 0]) == item and float(r.scores[0, 0]) < 1e-6:
        return r.payloads[0]
    return None


def wait_for(predicate, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def test_every_write_through_any_sidecar_is_visible_on_all(source: str, runtime_dir: str) -> None:
    with replicas(source, runtime_dir) as clients:
        latencies = []
        for item in range(60):
            writer = clients[item % 3]
            t0 = time.perf_counter()
            writer.add(vector(item)[None], [item], [f"p{item}"])
            # acknowledged: committed, and visible on the sidecar that took it
            assert find(writer, item) == f"p{item}"
            for c in clients:
                wait_for(lambda c=c, i=item: find(c, i) == f"p{i}", f"item {item}")
            latencies.append(time.perf_counter() - t0)
        p99 = float(np.percentile(np.array(latencies) * 1e3, 99))
        print(f"\nwrite-to-visible on all 3 sidecars: p50 {np.median(latencies) * 1e3:.2f} ms, "
              f"p99 {p99:.2f} ms (target <= 100 ms)")  # fmt: skip
        assert p99 <= 1000  # a gross regression; the target is reported above

        # removes, upserts and state, through other sidecars than the ones that wrote
        assert clients[1].remove([0, 1]) == 2
        clients[2].add(vector(2)[None], [2], ["p2 again"])
        v1 = clients[0].put("task", b"step 1")
        v2 = clients[1].cas("task", v1, b"step 2")
        with pytest.raises(kalos.Conflict):
            clients[2].cas("task", v1, b"stale")
        for c in clients:
            wait_for(lambda c=c: find(c, 0) is None and find(c, 1) is None, "removes")
            wait_for(lambda c=c: find(c, 2) == "p2 again", "the upsert")
            wait_for(lambda c=c: c.get("task").version == v2, "the cas")
            assert c.get("task").value == b"step 2"
        assert clients[0].delete("task") is True
        for c in clients:
            wait_for(lambda c=c: _absent(c, "task"), "the state delete")


def _absent(client: kalos.Client, key: str) -> bool:
    try:
        client.get(key)
    except kalos.NotFound:
        return True
    return False


def test_forget_a_scope_reaches_every_sidecar(source: str, runtime_dir: str) -> None:
    with replicas(source, runtime_dir, n=2) as (a, b):
        acme, other = kalos.Scope("acme"), kalos.Scope("other")
        a.add(np.stack([vector(i) for i in range(4)]), [0, 1, 2, 3], scope=acme)
        b.add(vector(10)[None], [10], ["kept"], scope=other)
        a.put("k", b"v", scope=acme)
        forgotten = b.forget(acme)
        assert forgotten.memories == 4 and forgotten.state == 1
        for c in (a, b):
            # the forget's memory and state changes are applied one after the other
            wait_for(
                lambda c=c: all(find(c, i) is None for i in range(4)) and _absent_in(c, "k", acme),
                "the forget",
            )
            assert find(c, 10) == "kept"


def _absent_in(client: kalos.Client, key: str, scope: kalos.Scope) -> bool:
    try:
        client.get(key, scope=scope)
    except kalos.NotFound:
        return True
    return False


def test_rows_written_with_plain_sql_show_up_in_search(source: str, runtime_dir: str) -> None:
    import psycopg

    with (
        replicas(source, runtime_dir, n=2) as clients,
        psycopg.connect(source, autocommit=True) as conn,
    ):
        conn.execute(
            "INSERT INTO kalos_memories (id, vector, payload, tenant) VALUES (%s, %s, %s, %s)",
            (100, vector(100).tobytes(), b"from sql", "acme"),
        )
        with conn.transaction():  # several rows in one transaction
            for item in (101, 102):
                conn.execute(
                    "INSERT INTO kalos_memories (id, vector, payload) VALUES (%s, %s, %s)",
                    (item, vector(item).tobytes(), f"row {item}".encode()),
                )
        for c in clients:
            wait_for(lambda c=c: find(c, 100) == "from sql", "the INSERT")
            wait_for(lambda c=c: find(c, 102) == "row 102", "the transaction")
            hit = c.search(vector(100)[None], k=1, scope=kalos.Scope("acme"))
            assert int(hit.ids[0, 0]) == 100
        conn.execute("UPDATE kalos_memories SET payload = 'updated' WHERE id = 100")
        conn.execute("DELETE FROM kalos_memories WHERE id = 101")
        conn.execute("INSERT INTO kalos_state (key, value) VALUES ('from-sql', 'hello'::bytea)")
        for c in clients:
            wait_for(lambda c=c: find(c, 100) == "updated", "the UPDATE")
            wait_for(lambda c=c: find(c, 101) is None, "the DELETE")
            wait_for(lambda c=c: not _absent(c, "from-sql"), "the state row")
            assert c.get("from-sql").value == b"hello"


def test_a_new_sidecar_loads_the_tables_then_follows(source: str, runtime_dir: str) -> None:
    from kalos.server import Sidecar, SidecarConfig

    with replicas(source, runtime_dir, n=1) as (first,):
        first.add(np.stack([vector(i) for i in range(500)]), list(range(500)), ["x"] * 500)
        first.put("k", b"v")
        cfg = SidecarConfig(name="late", dim=DIM, metric="l2", runtime_dir=runtime_dir,
                            source=source)  # fmt: skip
        with Sidecar(cfg) as late, kalos.Client("late", runtime_dir=runtime_dir) as c:
            stats = late.source.stats()
            assert stats["loaded_rows"] == 501 and stats["lag"] == 0
            assert len(late.memories) == 500 and c.get("k").value == b"v"
            first.add(vector(999)[None], [999], ["after"])
            wait_for(lambda: find(c, 999) == "after", "a write after the load")


def test_a_start_waits_for_no_open_transaction_on_the_tables(source: str, runtime_dir: str) -> None:
    import psycopg

    from kalos.server import Sidecar, SidecarConfig

    with replicas(source, runtime_dir, n=1) as (first,), psycopg.connect(source) as busy:
        first.add(vector(1)[None], [1], ["committed"])
        busy.execute("INSERT INTO kalos_memories (id, vector) VALUES (2, %s)",
                     (vector(2).tobytes(),))  # fmt: skip
        busy.execute("INSERT INTO kalos_state (key, value) VALUES ('open', 'x')")
        cfg = SidecarConfig(name="late", dim=DIM, metric="l2", runtime_dir=runtime_dir,
                            source=source)  # fmt: skip
        late = Sidecar(cfg)
        starting = threading.Thread(target=late.start)
        starting.start()
        starting.join(20)
        started = not starting.is_alive()
        busy.rollback()  # lets a start that waited go on, so that it can be stopped
        starting.join()
        try:
            assert started, "the start waited for the open transaction"
            with kalos.Client("late", runtime_dir=runtime_dir) as c:
                assert find(c, 1) == "committed" and find(c, 2) is None
        finally:
            late.stop()


def test_unreachable_database_reads_served_writes_refused(
    pg: PostgresServer, source: str, runtime_dir: str
) -> None:
    with replicas(source, runtime_dir, n=1) as (c,):
        c.add(vector(1)[None], [1], ["before"])
        pg.stop()
        try:
            with pytest.raises(kalos.KalosError, match="not acknowledged"):
                c.add(vector(2)[None], [2], ["during"])
            assert find(c, 1) == "before"  # reads keep being served from the index
            wait_for(lambda: c.stats()["source"]["degraded"], "degraded")
        finally:
            pg.start()
        # it reconnects by itself; the next write goes through
        wait_for(lambda: c.stats()["source"]["connected"], "reconnect")
        deadline = time.monotonic() + 10
        while True:
            try:
                c.add(vector(3)[None], [3], ["after"])
                break
            except kalos.KalosError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert find(c, 3) == "after" and find(c, 2) is None
        wait_for(lambda: not c.stats()["source"]["degraded"], "recovered")


def test_the_change_feed_is_pruned_once_every_follower_passed_it(
    source: str, runtime_dir: str
) -> None:
    import psycopg

    with replicas(source, runtime_dir, n=2, source_retention_s=2.0) as (a, b):
        a.add(np.stack([vector(i) for i in range(20)]), list(range(20)), ["x"] * 20)
        wait_for(lambda: find(b, 19) == "x", "the add on the other sidecar")
        with psycopg.connect(source, autocommit=True) as conn:
            # a follower that went away long ago holds nothing back
            conn.execute(
                "INSERT INTO kalos_followers VALUES ('gone/long-ago', 0, now() - interval '1 day')"
            )

            def rows() -> int:
                return int(conn.execute("SELECT count(*) FROM kalos_changes").fetchone()[0])

            wait_for(lambda: rows() == 0, "the feed's rows to be pruned")
            names = {r[0] for r in conn.execute("SELECT name FROM kalos_followers")}
            assert "gone/long-ago" not in names and len(names) == 2
        b.add(vector(50)[None], [50], ["y"])  # the feed goes on after pruning
        wait_for(lambda: find(a, 50) == "y", "a write after the pruning")


@pytest.mark.parametrize(
    ("lost", "new_rows", "new_feed"),
    [(5, 0, False), (5, 10, False), (0, 0, True)],
    ids=["head-behind", "positions-reused", "feed-replaced"],
)
def test_a_rewound_feed_is_reloaded_not_diverged_from(
    source: str, runtime_dir: str, lost: int, new_rows: int, new_feed: bool
) -> None:
    """As after a failover to a standby that lacked the last commits (or a restore): the
    feed's last positions vanish, and later commits may take them again. Every sidecar
    notices, reloads, and holds what the tables hold."""
    import psycopg

    with replicas(source, runtime_dir, n=2) as (a, b):
        a.add(np.stack([vector(i) for i in range(20)]), list(range(20)), ["x"] * 20)
        wait_for(lambda: find(b, 19) == "x", "the add on the other sidecar")
        with psycopg.connect(source) as sql, sql.transaction():
            head = int(sql.execute("SELECT head FROM kalos_feed").fetchone()[0])
            # the lost commits: never made, as far as this timeline knows (no triggers)
            sql.execute("SET LOCAL session_replication_role = replica")
            sql.execute("DELETE FROM kalos_memories WHERE id >= %s", (20 - lost,))
            sql.execute("DELETE FROM kalos_changes WHERE seq > %s", (head - lost,))
            sql.execute("UPDATE kalos_feed SET head = head - %s", (lost,))
            if new_feed:
                sql.execute("UPDATE kalos_feed SET feed_id = 'restored'")
            sql.execute("SET LOCAL session_replication_role = origin")
            for item in range(100, 100 + new_rows):  # one position each, from head - lost on
                sql.execute(
                    "INSERT INTO kalos_memories (id, vector, payload) VALUES (%s, %s, 'new')",
                    (item, vector(item).tobytes()),
                )
        kept = list(range(20 - lost))
        fresh = list(range(100, 100 + new_rows))
        for c in (a, b):
            wait_for(lambda c=c: c.stats()["source"]["reloads"] >= 1, "a reload")
            wait_for(
                lambda c=c: (
                    c.stats()["items"] == len(kept) + len(fresh)
                    and all(find(c, i) == "x" for i in kept)
                    and all(find(c, i) == "new" for i in fresh)
                ),
                "the tables' rows",
            )
            assert all(find(c, i) is None for i in range(20 - lost, 20))
        a.add(vector(500)[None], [500], ["after"])  # and they follow on
        wait_for(lambda: find(b, 500) == "after", "a write after the reload")


def test_a_snapshot_from_before_a_rewind_is_not_resumed(
    source: str, runtime_dir: str, tmp_path: Path
) -> None:
    """The feed lost its last positions while the sidecar was down and later commits took
    them again: the snapshot's position is in the feed, but not its change."""
    import psycopg

    from kalos.server import Sidecar

    cfg = _replica_config("snap", source, runtime_dir, tmp_path / "data")
    with Sidecar(cfg), kalos.Client("snap", runtime_dir=runtime_dir) as c:
        for item in range(20):  # one position each
            c.add(vector(item)[None], [item], ["x"])
    with psycopg.connect(source) as sql, sql.transaction():
        sql.execute("SET LOCAL session_replication_role = replica")
        sql.execute("DELETE FROM kalos_memories WHERE id >= 15")
        sql.execute("DELETE FROM kalos_changes WHERE seq > 15")
        sql.execute("UPDATE kalos_feed SET head = 15")
        sql.execute("SET LOCAL session_replication_role = origin")
        for item in range(100, 110):  # positions 16 to 25: the snapshot's 20 among them
            sql.execute("INSERT INTO kalos_memories (id, vector, payload) VALUES (%s, %s, 'new')",
                        (item, vector(item).tobytes()))  # fmt: skip
    with Sidecar(cfg) as sc, kalos.Client("snap", runtime_dir=runtime_dir) as c:
        assert sc.source is not None and sc.source.recovery["resumed"] is False
        assert "is another one" in sc.source.recovery["resume_reason"]
        assert c.stats()["items"] == 25
        assert all(find(c, i) is None for i in range(15, 20))
        assert all(find(c, i) == "new" for i in range(100, 110))


@pytest.mark.parametrize("crash", [False, True], ids=["restart", "kill-9"])
def test_database_restart_under_load_loses_nothing_acknowledged(
    pg: PostgresServer, source: str, runtime_dir: str, crash: bool
) -> None:
    import psycopg

    with psycopg.connect(source) as conn:  # what "nothing acknowledged is lost" rests on
        assert conn.execute("SHOW fsync").fetchone()[0] == "on"
    with replicas(source, runtime_dir, n=2) as (a, b):
        b.add(vector(0)[None], [0], ["v0"])
        acked: set[int] = {0}
        refused: list[str] = []
        read_errors: list[BaseException] = []
        stop = threading.Event()

        def write() -> None:
            with kalos.Client("r0", runtime_dir=runtime_dir) as c:
                for item in itertools.count(1):
                    if stop.is_set():
                        return
                    try:
                        c.add(vector(item)[None], [item], [f"v{item}"])
                        acked.add(item)
                    except kalos.KalosError as exc:
                        refused.append(str(exc))
                        time.sleep(0.01)

        def read() -> None:
            with kalos.Client("r1", runtime_dir=runtime_dir) as c:
                while not stop.is_set():
                    try:
                        assert find(c, 0) == "v0"
                    except BaseException as exc:
                        read_errors.append(exc)
                        return

        threads = [threading.Thread(target=write), threading.Thread(target=read)]
        for t in threads:
            t.start()
        try:
            wait_for(lambda: len(acked) >= 30, "writes before the restart")
            pg.kill() if crash else pg.stop()
            wait_for(lambda: len(refused) >= 3, "writes refused while it is down")
            down = len(acked)
            time.sleep(0.3)
            pg.start()
            wait_for(lambda: len(acked) >= down + 30, "writes after the restart", timeout=20)
        finally:
            stop.set()
            for t in threads:
                t.join()
        assert not read_errors, read_errors
        assert all("not acknowledged" in m or "not applied" in m for m in refused), refused[:3]
        with psycopg.connect(source) as conn:
            stored = {r[0] for r in conn.execute("SELECT id FROM kalos_memories")}
        assert acked <= stored, sorted(acked - stored)[:10]
        for c in (a, b):
            wait_for(lambda c=c: all(find(c, i) == f"v{i}" for i in sorted(acked)), "all acked")
        print(f"\n{len(acked)} acknowledged, {len(refused)} refused while down, 0 lost")


def test_readyz_and_metrics_report_the_source(
    pg: PostgresServer, source: str, runtime_dir: str
) -> None:
    import json
    import urllib.request

    from kalos.server import Sidecar, SidecarConfig

    cfg = SidecarConfig(name="m", dim=DIM, runtime_dir=runtime_dir, source=source, admin_port=0)
    with Sidecar(cfg) as sc:
        assert sc.admin is not None
        base = f"http://127.0.0.1:{sc.admin.port}"
        ready = json.loads(urllib.request.urlopen(base + "/readyz").read())
        assert ready == {"ready": True, "state": "ready", "degraded": False}
        metrics = urllib.request.urlopen(base + "/metrics").read().decode()
        assert "kalos_source_lag 0.0" in metrics and "kalos_source_connected 1.0" in metrics
        pg.stop()
        try:
            wait_for(lambda: sc.source is not None and sc.source.degraded, "degraded")
            ready = json.loads(urllib.request.urlopen(base + "/readyz").read())
            assert ready["degraded"] is True and ready["ready"] is True  # reads still served
        finally:
            pg.start()


@pytest.mark.parametrize("seed", [1, 2])
def test_random_writes_anywhere_every_sidecar_equals_the_table(
    source: str, runtime_dir: str, seed: int
) -> None:
    """Random adds, upserts, removes, state puts and deletes through random sidecars and
    straight into the tables; then every sidecar's answers equal the tables' rows."""
    import random

    import psycopg

    rng = random.Random(seed)
    with (
        replicas(source, runtime_dir) as clients,
        psycopg.connect(source, autocommit=True) as sql,
    ):
        for step in range(150):
            item, key = rng.randrange(40), f"k{rng.randrange(8)}"
            c, what = rng.choice(clients), rng.random()
            text = f"s{step}"
            if what < 0.35:
                c.add(vector(item)[None], [item], [text])
            elif what < 0.5:
                sql.execute(
                    "INSERT INTO kalos_memories (id, vector, payload) VALUES (%s, %s, %s) "
                    "ON CONFLICT (id) DO UPDATE SET payload = EXCLUDED.payload",
                    (item, vector(item).tobytes(), text.encode()),
                )
            elif what < 0.6:
                c.remove([item])
            elif what < 0.65:
                sql.execute("DELETE FROM kalos_memories WHERE id = %s", (item,))
            elif what < 0.85:
                c.put(key, text)
            elif what < 0.9:
                sql.execute(
                    "UPDATE kalos_state SET value = %s, version = nextval('kalos_state_version') "
                    "WHERE key = %s",
                    (text.encode(), key),
                )
            else:
                c.delete(key)
        memories = dict(sql.execute("SELECT id, convert_from(payload, 'UTF8') FROM kalos_memories"))
        state = {
            k: (v, bytes(b))
            for k, v, b in sql.execute("SELECT key, version, value FROM kalos_state")
        }

        def agrees(c: kalos.Client) -> bool:
            if c.stats()["items"] != len(memories):
                return False
            if any(find(c, i) != memories.get(i) for i in range(40)):
                return False
            for k in (f"k{i}" for i in range(8)):
                try:
                    got = c.get(k)
                except kalos.NotFound:
                    if k in state:
                        return False
                    continue
                if state.get(k) != (got.version, got.value):
                    return False
            return True

        for c in clients:
            wait_for(lambda c=c: agrees(c), "a sidecar equal to the tables")


def test_source_on_the_command_line_refuses_a_password() -> None:
    from kalos.server.source import check_no_password

    with pytest.raises(kalos.ConfigError, match="password"):
        check_no_password("postgresql://kalos:secret@db.example/kalos")
    check_no_password("postgresql://kalos@db.example/kalos?sslmode=verify-full")


def test_the_connection_string_comes_from_a_file_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kalos.cli import _source, build_parser

    def source(*argv: str) -> str | None:
        return _source(build_parser().parse_args(["serve", "--name", "x", "--dim", "4", *argv]))

    monkeypatch.delenv("KALOS_SOURCE", raising=False)
    assert source() is None
    secret = tmp_path / "source"
    secret.write_text("postgresql://kalos:secret@db.example/kalos?sslmode=require\n")
    assert source("--source-file", str(secret)).endswith("sslmode=require")
    monkeypatch.setenv("KALOS_SOURCE", "host=/run/pg dbname=kalos password=x")
    assert source() == "host=/run/pg dbname=kalos password=x"
    with pytest.raises(kalos.ConfigError, match="password"):
        source("--source", "postgresql://kalos:secret@db.example/kalos")


def test_the_connection_string_is_not_in_the_config_repr() -> None:
    from kalos.server import SidecarConfig

    assert "secret" not in repr(SidecarConfig(name="x", dim=4, source="password=secret"))


# -- restarts with --data-dir: resume from the local snapshot, or reload ----------------------

KEYS = [f"k{i}" for i in range(4)]


def _replica_config(name: str, source: str, runtime_dir: str, data_dir: Path | None, **config):
    from kalos.server import SidecarConfig

    data = None if data_dir is None else str(data_dir)
    return SidecarConfig(name=name, dim=DIM, metric="l2", runtime_dir=runtime_dir, source=source,
                         data_dir=data, **config)  # fmt: skip


def _answers(client: kalos.Client, items: range) -> tuple:
    """What a sidecar answers: its item count, each item's payload, each key's state."""
    state = []
    for k in KEYS:
        try:
            got = client.get(k)
            state.append((got.version, got.value))
        except kalos.NotFound:
            state.append(None)
    return client.stats()["items"], [find(client, i) for i in items], state


def _write_a_history(c: kalos.Client, base: int) -> None:
    """Adds, an upsert, removes, state puts and deletes through ``c``."""
    c.add(np.stack([vector(base + i) for i in range(30)]), list(range(base, base + 30)),
          [f"v{base + i}" for i in range(30)])  # fmt: skip
    c.add(vector(base)[None], [base], ["upserted"])
    assert c.remove([base + 1, base + 2]) == 2
    for i, k in enumerate(KEYS):
        c.put(k, f"{base}:{i}".encode())
    c.delete(KEYS[base // 100 % len(KEYS)])


def _equal_to_a_full_load(c: kalos.Client, source: str, runtime_dir: str, items: range) -> None:
    """``c`` answers as a sidecar that loaded the tables just now."""
    from kalos.server import Sidecar

    cfg = _replica_config("fresh", source, runtime_dir, None)
    with Sidecar(cfg) as fresh, kalos.Client("fresh", runtime_dir=runtime_dir) as f:
        assert fresh.source is not None and fresh.source.loaded_rows > 0
        want = _answers(f, items)
        wait_for(lambda: _answers(c, items) == want, "the answers of a full load")


def test_a_restart_resumes_from_its_snapshot_and_follows_what_it_missed(
    source: str, runtime_dir: str, tmp_path: Path
) -> None:
    from kalos.server import Sidecar
    from kalos.server.durability import list_snapshots

    data = tmp_path / "data"
    cfg = _replica_config("snap", source, runtime_dir, data)
    items = range(0, 240)
    with replicas(source, runtime_dir, n=1) as (other,):
        with Sidecar(cfg) as sc, kalos.Client("snap", runtime_dir=runtime_dir) as c:
            assert sc.source is not None and sc.source.recovery["resumed"] is False
            assert "no snapshot" in sc.source.recovery["resume_reason"]
            _write_a_history(c, 0)
            _write_a_history(other, 100)
            wait_for(lambda: find(c, 129) == "v129", "the other sidecar's writes")
        # a clean stop wrote a snapshot at the position it had applied
        ((position, _),) = list_snapshots(str(data))
        assert position > 0
        _write_a_history(other, 200)  # while it is down: adds, removes, state changes
        assert other.remove([5, 105]) == 2
        other.put(KEYS[0], b"while down")
        head = other.stats()["source"]["applied"]
        with Sidecar(cfg) as sc, kalos.Client("snap", runtime_dir=runtime_dir) as c:
            assert sc.source is not None
            st = c.stats()["source"]
            assert st["resumed"] is True, st["resume_reason"]
            assert st["loaded_rows"] == 0 and st["reloads"] == 0
            assert sc.source.recovery["snapshot_position"] == position
            assert sc.source.recovery["applied"] >= head  # ready once caught up
            assert f"position {position}" in st["resume_reason"]
            _equal_to_a_full_load(c, source, runtime_dir, items)
            other.add(vector(300)[None], [300], ["after"])  # and it follows on
            wait_for(lambda: find(c, 300) == "after", "a write after the restart")


def test_a_restart_after_the_feed_was_pruned_past_it_reloads(
    source: str, runtime_dir: str, tmp_path: Path
) -> None:
    import psycopg

    from kalos.server import Sidecar
    from kalos.server.durability import list_snapshots

    data = tmp_path / "data"
    cfg = _replica_config("snap", source, runtime_dir, data, source_retention_s=1.0)
    items = range(0, 240)
    with replicas(source, runtime_dir, n=1, source_retention_s=1.0) as (other,):
        with Sidecar(cfg), kalos.Client("snap", runtime_dir=runtime_dir) as c:
            _write_a_history(c, 0)
        ((position, _),) = list_snapshots(str(data))
        _write_a_history(other, 100)
        with psycopg.connect(source, autocommit=True) as sql:

            def held() -> int:
                q = "SELECT count(*) FROM kalos_changes WHERE seq > %s"
                return int(sql.execute(q, (position,)).fetchone()[0])

            head = int(sql.execute("SELECT head FROM kalos_feed").fetchone()[0])
            wait_for(lambda: held() < head - position, "the rows after its position pruned")
        with Sidecar(cfg) as sc, kalos.Client("snap", runtime_dir=runtime_dir) as c:
            assert sc.source is not None
            st = c.stats()["source"]
            assert st["resumed"] is False and "pruned" in st["resume_reason"]
            assert st["loaded_rows"] > 0
            _equal_to_a_full_load(c, source, runtime_dir, items)


def test_a_damaged_snapshot_or_one_of_another_database_is_not_resumed(
    pg: PostgresServer, source: str, runtime_dir: str, tmp_path: Path
) -> None:
    from kalos.server import Sidecar
    from kalos.server.durability import list_snapshots

    data = tmp_path / "data"
    with (
        Sidecar(_replica_config("snap", source, runtime_dir, data)),
        kalos.Client("snap", runtime_dir=runtime_dir) as c,
    ):
        _write_a_history(c, 0)
    ((_, path),) = list_snapshots(str(data))
    good = Path(path, "snapshot.db").read_bytes()
    Path(path, "snapshot.db").write_bytes(b"\0" * len(good))
    with (
        Sidecar(_replica_config("snap", source, runtime_dir, data)) as sc,
        kalos.Client("snap", runtime_dir=runtime_dir) as c,
    ):
        assert sc.source is not None and sc.source.recovery["resumed"] is False
        assert "cannot be read" in sc.source.recovery["resume_reason"]
        _equal_to_a_full_load(c, source, runtime_dir, range(0, 40))
    other_db = pg.create_database(f"kalos_{os.getpid()}_{next(_db_names)}")
    with (
        Sidecar(_replica_config("snap", other_db, runtime_dir, data)) as sc,
        kalos.Client("snap", runtime_dir=runtime_dir) as c,
    ):
        assert sc.source is not None
        assert sc.source.recovery["resumed"] is False
        assert "another database" in sc.source.recovery["resume_reason"]
        assert c.stats()["items"] == 0 and find(c, 0) is None  # nothing of the first one
        _write_a_history(c, 100)
    # the same database dropped and created again: a new feed, not resumed either
    import psycopg

    with psycopg.connect(other_db, autocommit=True) as sql:
        sql.execute("DROP TABLE kalos_feed, kalos_changes, kalos_followers, kalos_memories, "
                    "kalos_state CASCADE")  # fmt: skip
    with (
        Sidecar(_replica_config("snap", other_db, runtime_dir, data)) as sc,
        kalos.Client("snap", runtime_dir=runtime_dir) as c,
    ):
        assert sc.source is not None and sc.source.recovery["resumed"] is False
        assert "another database" in sc.source.recovery["resume_reason"]
        assert c.stats()["items"] == 0


def test_a_data_dir_of_the_other_kind_is_refused(
    source: str, runtime_dir: str, tmp_path: Path
) -> None:
    from kalos.server import Sidecar, SidecarConfig

    wal_dir, replica_dir = tmp_path / "wal", tmp_path / "replica"
    local = SidecarConfig(name="local", dim=DIM, runtime_dir=runtime_dir, data_dir=str(wal_dir))
    with Sidecar(local), kalos.Client("local", runtime_dir=runtime_dir) as c:
        c.add(vector(1)[None], [1], ["only here"])
    with pytest.raises(kalos.ConfigError, match="write-ahead log"):
        Sidecar(_replica_config("snap", source, runtime_dir, wal_dir)).start()
    with Sidecar(_replica_config("snap", source, runtime_dir, replica_dir)):
        pass
    replica = SidecarConfig(name="local", dim=DIM, runtime_dir=runtime_dir,
                            data_dir=str(replica_dir))  # fmt: skip
    with pytest.raises(kalos.ConfigError, match="source"):
        Sidecar(replica).start()


# -- kill -9 of a sidecar under a stream of writes ---------------------------------------------


def _serve(name: str, runtime_dir: str, source_file: Path, log, *args: str) -> subprocess.Popen:
    from kalos.testing import serve_command

    cmd = serve_command(name, DIM, runtime_dir, "--source-file", str(source_file), "--no-admin",
                        *args, metric="l2")  # fmt: skip
    return subprocess.Popen(cmd, stdout=log, stderr=log)


def test_sigkill_of_a_sidecar_loses_no_acknowledged_write(
    source: str, runtime_dir: str, tmp_path: Path
) -> None:
    from kalos.paths import socket_path
    from kalos.testing import wait_for_socket, wait_ready

    source_file = tmp_path / "source"
    source_file.write_text(source)
    log = open(tmp_path / "sidecars.log", "ab")  # noqa: SIM115
    names = ["k0", "k1", "k2"]
    procs = {n: _serve(n, runtime_dir, source_file, log) for n in names}
    try:
        for n, p in procs.items():
            wait_for_socket(socket_path(n, runtime_dir), p)
            wait_ready(socket_path(n, runtime_dir), p, timeout=30)
        acked: set[int] = set()
        stop = threading.Event()
        errors: list[BaseException] = []

        def write(name: str, start: int) -> None:
            try:
                with kalos.Client(name, runtime_dir=runtime_dir) as c:
                    for item in itertools.count(start):
                        if stop.is_set():
                            return
                        c.add(vector(item)[None], [item], [f"v{item}"])
                        acked.add(item)
            except BaseException as exc:
                errors.append(exc)

        writers = [
            threading.Thread(target=write, args=(n, base))
            for n, base in (("k0", 0), ("k1", 1_000_000))
        ]
        for t in writers:
            t.start()
        wait_for(lambda: len(acked) >= 50, "writes before the kill")
        procs["k2"].kill()  # SIGKILL
        procs["k2"].wait()
        wait_for(lambda: len(acked) >= 150, "writes while k2 is down")
        procs["k2"] = _serve("k2", runtime_dir, source_file, log)
        wait_for_socket(socket_path("k2", runtime_dir), procs["k2"])
        wait_ready(socket_path("k2", runtime_dir), procs["k2"], timeout=30)
        wait_for(lambda: len(acked) >= 250, "writes after the restart")
        stop.set()
        for t in writers:
            t.join()
        assert not errors, errors
        expected = sorted(acked)
        for n in names:
            with kalos.Client(n, runtime_dir=runtime_dir) as c:

                def holds_all(c=c) -> bool:
                    return all(find(c, item) == f"v{item}" for item in expected)

                wait_for(holds_all, f"every acknowledged write on {n}", timeout=20)
                assert c.stats()["items"] >= len(expected)
        print(f"\n{len(expected)} acknowledged writes, 0 missing on any of the 3 sidecars")
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        log.close()


def test_sigkill_then_restart_resumes_from_the_periodic_snapshot_losing_nothing(
    source: str, runtime_dir: str, tmp_path: Path
) -> None:
    from kalos.paths import socket_path
    from kalos.testing import wait_for_socket, wait_ready

    source_file = tmp_path / "source"
    source_file.write_text(source)
    log = open(tmp_path / "sidecar.log", "ab")  # noqa: SIM115
    args = ("--data-dir", str(tmp_path / "data"), "--source-snapshot-s", "0.2")

    def start() -> subprocess.Popen:
        proc = _serve("k", runtime_dir, source_file, log, *args)
        wait_for_socket(socket_path("k", runtime_dir), proc)
        wait_ready(socket_path("k", runtime_dir), proc, timeout=30)
        return proc

    proc = start()
    acked: set[int] = set()
    try:
        with replicas(source, runtime_dir, n=1) as (other,):
            with kalos.Client("k", runtime_dir=runtime_dir) as c:
                for item in range(40):
                    c.add(vector(item)[None], [item], [f"v{item}"])
                    acked.add(item)
                c.put("task", b"before")
                wait_for(lambda: "last_snapshot" in c.stats()["source"], "a periodic snapshot")
                for item in range(40, 60):  # after the snapshot: only in the feed
                    c.add(vector(item)[None], [item], [f"v{item}"])
                    acked.add(item)
            proc.kill()  # SIGKILL: no snapshot at stop
            proc.wait()
            for item in range(60, 90):  # while it is down
                other.add(vector(item)[None], [item], [f"v{item}"])
                acked.add(item)
            assert other.remove([0]) == 1
            acked.discard(0)
            other.put("task", b"while down")
            proc = start()
            with kalos.Client("k", runtime_dir=runtime_dir) as c:
                st = c.stats()["source"]
                assert st["resumed"] is True, st["resume_reason"]
                assert st["loaded_rows"] == 0
                wait_for(lambda: all(find(c, i) == f"v{i}" for i in sorted(acked)), "all acked")
                assert find(c, 0) is None and c.get("task").value == b"while down"
                assert c.stats()["items"] == len(acked)
        print(f"\nresumed from position {st['snapshot_position']}: {len(acked)} acknowledged, "
              "0 missing")  # fmt: skip
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q", "-s"]))
