"""PostgreSQL as the source of truth: every sidecar on the database a live replica.

With ``kalos serve --source postgresql://...`` memories and agent state live in PostgreSQL
(the tables below, created on first start); the sidecar's index is a replica that any number
of sidecars, on any number of hosts, keep of the same tables. :class:`Source` stands where
:class:`~kalos.server.durability.Durability` stands without a database (the poller's and the
uds and grpc threads' ``journal``), and replaces the local write-ahead log for memories and
state.

A write (ADD, REMOVE, FORGET, STATE_PUT, STATE_CAS, STATE_DELETE) is not applied to the local
stores by the request: :meth:`Source.handle` runs it as one PostgreSQL transaction and
commits it, and sets :attr:`Source.last_lsn` to the change-feed position of the commit. The
response is published once this sidecar's follower has applied the feed through that
position (:meth:`outcome`, :meth:`wait`): an acknowledged write is committed in PostgreSQL
and visible in this sidecar's own searches. Every sidecar (this one too) applies every
change from the feed, in feed order, so all of them hold the same items.

The change feed is a table, ``kalos_changes``: statement-level triggers on ``kalos_memories``
and ``kalos_state`` add a row per changed row in the same transaction as the change, numbered
by ``kalos_feed.head``: one row that every writing statement updates (once per statement,
however many rows it changed), whose row lock lasts until commit, so positions are handed
out in commit order, with no gap (a reader that sees position N has seen every position
below it). ``pg_notify('kalos_changes')`` wakes the followers at commit. A change row names
the row that changed (an id, or a state key), not its contents: the follower reads the row
as it is now (LEFT JOIN) and upserts it, or deletes it locally where it is gone. Applying
the current row is idempotent, so a sidecar that reads a row already changed again by a later
position converges as well. Rows written by any program (psql, an application's own INSERT)
fire the same triggers and reach every sidecar.

Mirroring (``table``, :mod:`kalos.server.source_table`): the memories are the rows of an
application's own table instead of ``kalos_memories``; the same kind of triggers on it add
changes of kind ``t`` (a row) and ``x`` (a TRUNCATE) with the table's oid, the load COPYs
its mapped columns, and writes through the sidecar go into it. State stays in
``kalos_state``.

A rewound feed (a failover to a standby that lacked the last commits, a restore, tables made
again) is noticed at every read of the head: another ``feed_id``, a head behind the applied
position, or another change at that position (its ``at``) than the one applied; the
follower then reloads. A snapshot records the ``at`` of its position's change too, and is
not resumed when the feed holds another change there.

Retention: each follower records its position in ``kalos_followers`` every second; change
rows older than ``retention_s`` that every follower seen within ``retention_s`` has applied
are deleted (by any follower, every few seconds). A follower gone longer than
``retention_s`` no longer holds rows back; when it returns and finds the rows after its
position gone, it reloads the tables.

Resuming (with ``--data-dir``): the sidecar writes a local snapshot of its memories and
state values (:class:`~kalos.server.durability.SnapshotDirectory`: the format and writer of
the local durability), every ``snapshot_s`` while changes arrive and at a clean stop, under
the dispatch lock that the follower applies changes under, so a snapshot holds exactly the
changes through the position it is named by; it also records ``kalos_feed.feed_id`` (a
random id drawn when the tables are created) and :data:`SCHEMA_VERSION`. At start, a
snapshot from this feed whose every later change the feed still holds is restored and
followed from its position: the change rows in (position, head] are counted, under the
advisory lock that pruning takes, and in the same transaction the follower's row is set to
that position, which holds the rows back from every later prune. Otherwise (no snapshot,
another database, rows pruned, a snapshot that cannot be read) the tables are loaded as
without one. While it runs, the follower records the position of its newest snapshot in
``kalos_followers`` (the live one once that snapshot is older than ``retention_s``), so that
a restart soon after a crash still finds the changes after it.

Sessions and event logs stay local to the sidecar (in memory) with ``--source``, and are not
in its snapshots: every start begins them empty.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import socket
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

import numpy as np

from kalos import filters
from kalos.errors import ConfigError, Conflict, InvalidRequest, KalosError, StoreError
from kalos.protocol import codes
from kalos.protocol import messages as M
from kalos.protocol.codes import Op, Status
from kalos.server.dispatch import WRITE_OPS, Dispatcher, status_for
from kalos.server.durability import (
    IDENTITY_FILE,
    SnapshotDirectory,
    Snapshotting,
    list_snapshots,
)
from kalos.server.progress import LoadProgress
from kalos.server.source_table import MirroredTable, resolve
from kalos.stores.state import StateStore
from kalos.stores.wal import fsync_dir
from kalos.types import Scope

log = logging.getLogger("kalos.source")

CHANNEL = "kalos_changes"  # the LISTEN/NOTIFY channel
BATCH_ROWS = 5000  # change rows read per query
COPY_CHUNK = 4096  # rows applied per store call at bootstrap
DEFAULT_RETENTION_S = 3600.0
DEFAULT_MAX_LAG = 0  # feed positions a sidecar may be behind and still become ready
# A committed write not applied here by then (or when the follower lost the database) is
# answered with an error: below the clients' default deadline (5 s), so they hear why.
APPLY_WAIT_S = 2.0
RECONNECT_S = 0.5  # between reconnection attempts
# A write's transaction runs on the thread serving it, under the dispatch lock: these bound
# how long an unreachable database can hold that thread (and the reads behind it).
CONNECT_TIMEOUT_S = 2
STATEMENT_TIMEOUT_MS = 5000
PRUNE_EVERY_S = 5.0
DEFAULT_SNAPSHOT_S = 60.0  # between local snapshots while changes arrive (with a data_dir)
# What a snapshot's contents mean; a snapshot of another version is not resumed.
SCHEMA_VERSION = 1
# Taken by every prune and by a resume's check of the feed: a resume's count of the change
# rows and its follower row are one step as far as pruning is concerned.
PRUNE_LOCK = "SELECT pg_advisory_xact_lock(hashtext('kalos_prune'))"
SOURCE_OPS = frozenset(
    int(o) for o in (Op.ADD, Op.REMOVE, Op.FORGET, Op.STATE_PUT, Op.STATE_CAS, Op.STATE_DELETE)
)

SCHEMA = """
CREATE TABLE IF NOT EXISTS kalos_feed (
    one boolean PRIMARY KEY DEFAULT true CHECK (one),
    head bigint NOT NULL
);
-- not ON CONFLICT: its check of the key would wait for any open transaction that moved the
-- head (an application's, writing a mirrored table), and so would the start
INSERT INTO kalos_feed (one, head) SELECT true, 0 WHERE NOT EXISTS (SELECT 1 FROM kalos_feed);
-- drawn once, when the tables are created: a snapshot of another feed is never resumed
-- (added only where missing: an ALTER TABLE would lock the feed against every writer)
DO $$ BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = 'kalos_feed'::regclass
                   AND attname = 'feed_id' AND NOT attisdropped) THEN
        ALTER TABLE kalos_feed ADD COLUMN feed_id text NOT NULL
            DEFAULT md5(random()::text || clock_timestamp()::text);
    END IF;
END $$;
CREATE TABLE IF NOT EXISTS kalos_changes (
    seq bigint PRIMARY KEY,
    at timestamptz NOT NULL DEFAULT now(),
    kind "char" NOT NULL,
    id bigint,
    tenant text, "user" text, session text, key text
);
-- the mirrored table a change of kind 't' (a row) or 'x' (a TRUNCATE) is of
DO $$ BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = 'kalos_changes'::regclass
                   AND attname = 'rel' AND NOT attisdropped) THEN
        ALTER TABLE kalos_changes ADD COLUMN rel oid;
    END IF;
END $$;
CREATE TABLE IF NOT EXISTS kalos_followers (
    name text PRIMARY KEY,
    applied bigint NOT NULL,
    seen timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS kalos_memories (
    id bigint PRIMARY KEY,
    vector bytea NOT NULL,
    kind smallint NOT NULL DEFAULT 1,
    payload bytea NOT NULL DEFAULT '',
    tenant text NOT NULL DEFAULT '',
    "user" text NOT NULL DEFAULT '',
    session text NOT NULL DEFAULT '',
    tokens bytea,
    meta jsonb,
    key text
);
CREATE SEQUENCE IF NOT EXISTS kalos_state_version;
CREATE TABLE IF NOT EXISTS kalos_state (
    tenant text NOT NULL DEFAULT '',
    "user" text NOT NULL DEFAULT '',
    session text NOT NULL DEFAULT '',
    key text NOT NULL,
    version bigint NOT NULL DEFAULT nextval('kalos_state_version'),
    value bytea NOT NULL,
    PRIMARY KEY (tenant, "user", session, key)
);
CREATE OR REPLACE FUNCTION kalos_memories_changed() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    n bigint;
    h bigint;
BEGIN
    -- one head update per statement (not per row: a COPY of 1M rows updates it once)
    IF TG_OP = 'INSERT' THEN
        SELECT count(*) INTO n FROM new_rows;
    ELSIF TG_OP = 'DELETE' THEN
        SELECT count(*) INTO n FROM old_rows;
    ELSE
        SELECT count(*) INTO n FROM (SELECT id FROM old_rows UNION SELECT id FROM new_rows) k;
    END IF;
    IF n = 0 THEN
        RETURN NULL;
    END IF;
    UPDATE kalos_feed SET head = head + n RETURNING head - n INTO h;
    IF TG_OP = 'INSERT' THEN
        INSERT INTO kalos_changes (seq, kind, id)
            SELECT h + row_number() OVER (), 'm', id FROM new_rows;
    ELSIF TG_OP = 'DELETE' THEN
        INSERT INTO kalos_changes (seq, kind, id)
            SELECT h + row_number() OVER (), 'm', id FROM old_rows;
    ELSE
        INSERT INTO kalos_changes (seq, kind, id)
            SELECT h + row_number() OVER (), 'm', id
            FROM (SELECT id FROM old_rows UNION SELECT id FROM new_rows) k;
    END IF;
    PERFORM pg_notify('kalos_changes', '');
    RETURN NULL;
END $$;
CREATE OR REPLACE FUNCTION kalos_state_changed() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    n bigint;
    h bigint;
BEGIN
    IF TG_OP = 'INSERT' THEN
        SELECT count(*) INTO n FROM new_rows;
    ELSIF TG_OP = 'DELETE' THEN
        SELECT count(*) INTO n FROM old_rows;
    ELSE
        SELECT count(*) INTO n FROM (SELECT tenant, "user", session, key FROM old_rows
                                     UNION SELECT tenant, "user", session, key FROM new_rows) k;
    END IF;
    IF n = 0 THEN
        RETURN NULL;
    END IF;
    UPDATE kalos_feed SET head = head + n RETURNING head - n INTO h;
    IF TG_OP = 'INSERT' THEN
        INSERT INTO kalos_changes (seq, kind, tenant, "user", session, key)
            SELECT h + row_number() OVER (), 's', tenant, "user", session, key FROM new_rows;
    ELSIF TG_OP = 'DELETE' THEN
        INSERT INTO kalos_changes (seq, kind, tenant, "user", session, key)
            SELECT h + row_number() OVER (), 's', tenant, "user", session, key FROM old_rows;
    ELSE
        INSERT INTO kalos_changes (seq, kind, tenant, "user", session, key)
            SELECT h + row_number() OVER (), 's', k.*
            FROM (SELECT tenant, "user", session, key FROM old_rows
                  UNION SELECT tenant, "user", session, key FROM new_rows) k;
    END IF;
    PERFORM pg_notify('kalos_changes', '');
    RETURN NULL;
END $$;
-- Made only where missing: creating a trigger waits for the table's open write transactions
-- (and holds up the writers after it meanwhile), which a start after the first never does.
DO $$ BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = 'kalos_memories'::regclass
                   AND tgname = 'kalos_memories_inserted') THEN
        CREATE TRIGGER kalos_memories_inserted AFTER INSERT ON kalos_memories
            REFERENCING NEW TABLE AS new_rows
            FOR EACH STATEMENT EXECUTE FUNCTION kalos_memories_changed();
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = 'kalos_memories'::regclass
                   AND tgname = 'kalos_memories_updated') THEN
        CREATE TRIGGER kalos_memories_updated AFTER UPDATE ON kalos_memories
            REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
            FOR EACH STATEMENT EXECUTE FUNCTION kalos_memories_changed();
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = 'kalos_memories'::regclass
                   AND tgname = 'kalos_memories_deleted') THEN
        CREATE TRIGGER kalos_memories_deleted AFTER DELETE ON kalos_memories
            REFERENCING OLD TABLE AS old_rows
            FOR EACH STATEMENT EXECUTE FUNCTION kalos_memories_changed();
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = 'kalos_state'::regclass
                   AND tgname = 'kalos_state_inserted') THEN
        CREATE TRIGGER kalos_state_inserted AFTER INSERT ON kalos_state
            REFERENCING NEW TABLE AS new_rows
            FOR EACH STATEMENT EXECUTE FUNCTION kalos_state_changed();
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = 'kalos_state'::regclass
                   AND tgname = 'kalos_state_updated') THEN
        CREATE TRIGGER kalos_state_updated AFTER UPDATE ON kalos_state
            REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
            FOR EACH STATEMENT EXECUTE FUNCTION kalos_state_changed();
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = 'kalos_state'::regclass
                   AND tgname = 'kalos_state_deleted') THEN
        CREATE TRIGGER kalos_state_deleted AFTER DELETE ON kalos_state
            REFERENCING OLD TABLE AS old_rows
            FOR EACH STATEMENT EXECUTE FUNCTION kalos_state_changed();
    END IF;
END $$;
"""

# A memory row, in the order Source._add reads (MirroredTable.select gives the same)
_MEMORY_COLUMNS = (
    'm.id, m.vector, m.kind, m.payload, m.tenant, m."user", m.session, m.tokens, m.meta::text, '
    "m.key"
)
_MEMORY_TYPES = ["int8", "bytea", "int2", "bytea", "text", "text", "text", "bytea", "text", "text"]
# A change row: seq, kind, id, tenant, user, session, key, rel (0-7); whether its memory row
# exists (8), that row (9-18); a state row's version and value (19, 20); when it was made (21).
_CHANGES = """
SELECT c.seq, c.kind, c.id, c.tenant, c."user", c.session, c.key, c.rel,
       m.{id} IS NOT NULL, {memory}, s.version, s.value, c.at
FROM kalos_changes c
LEFT JOIN {table} m ON {join}
LEFT JOIN kalos_state s ON c.kind = 's' AND s.tenant = c.tenant AND s."user" = c."user"
    AND s.session = c.session AND s.key = c.key
WHERE c.seq > %s ORDER BY c.seq LIMIT {rows}
"""
# The feed's head and id, and when the change at a position was made (NULL: pruned, or none)
_HEAD = """
SELECT f.head, f.feed_id, (SELECT c.at FROM kalos_changes c WHERE c.seq = %s) FROM kalos_feed f
"""
_PRUNE = """
DELETE FROM kalos_changes WHERE at < now() - make_interval(secs => %(r)s)
    AND seq <= coalesce((SELECT min(applied) FROM kalos_followers
                         WHERE seen > now() - make_interval(secs => %(r)s)), 0)
"""


def _changes_query(table: MirroredTable | None) -> Any:
    """The follower's query: the changes after a position, joined with the rows as they are
    now (of ``kalos_memories``, or of the mirrored table)."""
    from psycopg import sql

    if table is None:
        return sql.SQL(_CHANGES).format(
            id=sql.Identifier("id"), memory=sql.SQL(_MEMORY_COLUMNS),
            table=sql.Identifier("kalos_memories"), join=sql.SQL("c.kind = 'm' AND m.id = c.id"),
            rows=sql.Literal(BATCH_ROWS),
        )  # fmt: skip
    join = sql.SQL("c.kind = 't' AND c.rel = {oid} AND m.{id} = c.{slot}").format(
        oid=sql.Literal(table.oid),
        id=table.column("id"),
        slot=sql.Identifier(table.slot),
    )
    return sql.SQL(_CHANGES).format(
        id=table.column("id"), memory=table.select("m"), table=table.sql(), join=join,
        rows=sql.Literal(BATCH_ROWS),
    )  # fmt: skip


def _first_line(exc: BaseException) -> str:
    """A database error's message without the statement excerpt that follows it."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def _psycopg() -> Any:
    try:
        import psycopg
    except ImportError as exc:
        raise ConfigError("--source needs psycopg: pip install 'kalos[postgres]'") from exc
    return psycopg


def redact(conninfo: str) -> str:
    """``conninfo`` without its password (for logs and stats)."""
    from psycopg.conninfo import conninfo_to_dict

    try:
        parts = conninfo_to_dict(conninfo)
    except Exception:
        return "postgresql://?"
    parts.pop("password", None)
    return " ".join(f"{k}={v}" for k, v in sorted(parts.items()) if v is not None)


def check_no_password(conninfo: str) -> None:
    """ConfigError when a connection string given on the command line carries a password."""
    from psycopg.conninfo import conninfo_to_dict

    try:
        parts = conninfo_to_dict(conninfo)
    except Exception as exc:
        raise ConfigError(f"--source is not a PostgreSQL connection string: {exc}") from None
    if parts.get("password"):
        raise ConfigError(
            "--source must not carry a password (the command line is visible to every "
            "user of the host): use --source-file, KALOS_SOURCE, PGPASSWORD or PGPASSFILE"
        )


def _scope(tenant: str | None, user: str | None, session: str | None) -> Scope:
    return Scope(tenant or None, user or None, session or None)


def _where(scope: Scope) -> tuple[str, list[str]]:
    """A WHERE clause matching ``scope`` (each given field equal), and its parameters."""
    clauses, params = [], []
    for column, value in zip(("tenant", '"user"', "session"), scope, strict=True):
        if value is not None:
            clauses.append(f"{column} = %s")
            params.append(value)
    return " AND ".join(clauses) or "true", params


class _StateValues:
    """The state store in a source snapshot: its values (a copy of what the database holds);
    event logs stay local and are neither written nor restored."""

    def __init__(self, state: StateStore) -> None:
        self.state = state

    def snapshot(self, db: sqlite3.Connection, directory: str) -> None:
        self.state.snapshot(db, directory, logs=False)

    def restore(self, db: sqlite3.Connection, directory: str) -> None:
        self.state.restore(db, directory, logs=False)


class SourceUnavailable(KalosError):
    """The source database did not answer (or failed) a write: nothing was acknowledged."""


class Source:
    """A sidecar's link to its PostgreSQL source (see the module docstring).

    Implements the journal interface of :class:`~kalos.server.durability.Durability`:
    ``handle`` under the dispatch ``lock``, then :attr:`last_lsn` (a feed position, or 0) and
    :meth:`outcome` / :meth:`wait` before a write's response is published.
    """

    def __init__(
        self,
        conninfo: str,
        dispatcher: Dispatcher,
        lock: threading.Lock,
        *,
        name: str = "default",
        max_lag: int = DEFAULT_MAX_LAG,
        retention_s: float = DEFAULT_RETENTION_S,
        apply_wait_s: float = APPLY_WAIT_S,
        data_dir: str | None = None,
        identity: Mapping[str, Any] | None = None,
        fork: bool = True,
        snapshot_s: float = DEFAULT_SNAPSHOT_S,
        table: tuple[str, Mapping[str, str]] | None = None,
    ) -> None:
        """``data_dir``: where local snapshots are written and resumed from (None: every
        start loads the tables); ``identity``: what a snapshot's data depend on (dim, metric,
        tokenizer), all of which must match for a resume; ``fork``: write background
        snapshots from a forked child (not with CUDA); ``table``: a table that other
        programs write and its columns (role -> column, :mod:`kalos.server.source_table`),
        whose rows are then the memories instead of ``kalos_memories``'."""
        self._psycopg = _psycopg()
        self._conninfo = conninfo
        self.where = redact(conninfo)
        self.dispatcher = dispatcher
        self.lock = lock
        self.follower = f"{socket.gethostname()}/{name}"
        self.max_lag = max_lag
        self.retention_s = retention_s
        self.apply_wait_s = apply_wait_s
        self.last_lsn = 0
        self.applied = 0  # the feed position applied to the local stores
        self.head = 0  # the newest feed position seen in the database
        self.on_durable: Callable[[], None] | None = None
        self._writer: Any = None  # the connection writes go through (under the lock)
        self._applied_cv = threading.Condition()
        self._pending: dict[int, float] = {}  # poller's held positions -> their deadline
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.connected = False  # the follower's connection is up
        self.writer_error: str | None = None  # the last write's connection failure
        self.loaded_rows = 0
        self.bootstrap_s = 0.0
        self.reloads = 0
        self.applied_changes = 0
        self.apply_errors = 0
        self.refused_writes = 0
        self.pruned = 0
        self.reconnects = 0
        self.feed_id: str | None = None  # kalos_feed.feed_id of the database
        self._applied_at: Any = None  # when the change at `applied` was made (if known)
        # a load replaced the stores since the last snapshot (at whatever position: a table
        # mirrored from before its triggers loads rows at position 0)
        self._load_unsaved = False
        self.snapshot_s = snapshot_s
        self._table_spec = table
        self.table: MirroredTable | None = None  # checked against the catalog at start
        self._changes = _changes_query(None)
        self.snapshots: SnapshotDirectory | None = None
        if table is not None:  # a snapshot of another table or mapping is not resumed
            roles = ",".join(f"{r}={c}" for r, c in sorted(table[1].items()))
            identity = {**(identity or {}), "source_table": f"{table[0]}:{roles}"}
        if data_dir is not None:
            stores: dict[str, Snapshotting] = {
                "memories": dispatcher.memories,
                "state": _StateValues(dispatcher.state),
            }
            identity = {**(identity or {}), "journal": "source"}
            self.snapshots = SnapshotDirectory(data_dir, lock, stores, identity=identity, fork=fork)
        self._loading = False  # a load is replacing the stores (no snapshot meanwhile)
        self._snapshot_tried = time.monotonic()  # the last snapshot_due that went ahead
        self.resumed = False
        self.applied_from = 0  # the position of the snapshot it resumed from
        self.resume_reason = "no --data-dir: every start loads the tables"
        self.recovery: dict[str, Any] = {}

    # -- connections ---------------------------------------------------------------------------

    def _connect(self, autocommit: bool = False, *, writer: bool = False) -> Any:
        conn = self._psycopg.connect(
            self._conninfo,
            autocommit=autocommit,
            connect_timeout=CONNECT_TIMEOUT_S,
            tcp_user_timeout=STATEMENT_TIMEOUT_MS,  # unacknowledged TCP data: give up
            keepalives=1,
            keepalives_idle=5,
            keepalives_interval=2,
            keepalives_count=2,
        )
        if writer:  # not the follower's: a bootstrap's COPY may take minutes
            conn.execute(f"SET statement_timeout = {STATEMENT_TIMEOUT_MS}")
            conn.commit()
        return conn

    @property
    def degraded(self) -> bool:
        """Reads are served, but the database is not reachable (writes fail meanwhile)."""
        return not self.connected or self.writer_error is not None

    # -- journal interface ---------------------------------------------------------------------

    def handle(
        self, op: int, flags: int, body: np.ndarray, out: np.ndarray, **options: Any
    ) -> tuple[int, int, int, int]:
        """Dispatcher.handle, except that a memory or state write is committed in PostgreSQL
        (and applied by the follower) instead of applied here. Called under the lock."""
        self.last_lsn = 0
        if op not in WRITE_OPS:
            return self.dispatcher.handle(op, flags, body, out, **options)
        if op not in SOURCE_OPS:  # sessions and event logs stay local
            return self.dispatcher.handle(op, flags, body, out, **options)
        t0 = time.monotonic_ns()
        try:
            n, lsn = self._write(op, flags, body, out)
        except KalosError as exc:
            return status_for(exc), M.encode_text(out, str(exc)), time.monotonic_ns() - t0, 0
        except Exception as exc:  # a bug, never a traceback on the wire
            log.exception("a write through the source failed")
            msg = f"{type(exc).__name__}: {exc}"
            return Status.SERVER_ERROR, M.encode_text(out, msg), time.monotonic_ns() - t0, 0
        self.last_lsn = lsn
        if lsn > self.applied:
            self._pending[lsn] = time.monotonic() + self.apply_wait_s
        return Status.OK, n, time.monotonic_ns() - t0, 0

    def commit(self) -> None:
        """Nothing to do: :meth:`handle` commits each write."""

    def sync(self) -> None:
        """Nothing to do: every acknowledged write is committed in PostgreSQL."""

    def snapshot_due(self) -> bool:
        """With a data directory: whether ``snapshot_s`` passed since the last snapshot and
        the follower applied changes since."""
        files = self.snapshots
        return (
            files is not None
            and (self.applied != files.snapshot_lsn or self._load_unsaved)
            and time.monotonic() - self._snapshot_tried >= self.snapshot_s
            and not files.busy
        )

    def snapshot(self, *, background: bool = True) -> dict[str, Any] | None:
        """Writes the memories and state values through the applied position into the data
        directory; the caller must not hold the lock. Returns what it did, or None when
        there is no data directory, nothing changed since the last one, or a load is under
        way. ``background``: as :meth:`Durability.snapshot`."""
        files = self.snapshots
        if files is None:
            return None
        files.wait_finished()
        t0 = time.perf_counter()
        with self.lock:  # the follower applies under it: the stores are those of `applied`
            self._snapshot_tried = time.monotonic()
            unchanged = self.applied == files.snapshot_lsn and not self._load_unsaved
            if self._loading or self.feed_id is None or unchanged:
                return None
            position = self.applied
            # when the change at its position was made: a resume checks it is still that one
            at = self._applied_at
            files.meta["source_at"] = "" if at is None else at.isoformat()
            begun = files.begin(position, background)
            if begun is None:
                return None
            self._load_unsaved = False
        return files.launch(begun, position, t0, background)

    def outcome(self, lsn: int) -> Literal[True] | str | None:
        """True once the follower applied position ``lsn``; a message when it has not within
        ``apply_wait_s`` (the write is committed, but not acknowledged); None meanwhile."""
        if self.applied >= lsn:
            self._pending.pop(lsn, None)
            return True
        deadline = self._pending.get(lsn)
        if deadline is not None and (not self.connected or time.monotonic() > deadline):
            del self._pending[lsn]
            return self._late(lsn)
        return None

    def wait(self, lsn: int) -> Literal[True] | str:
        """Blocks until the follower applied position ``lsn`` (True) or ``apply_wait_s``
        passed (a message)."""
        self._pending.pop(lsn, None)
        deadline = time.monotonic() + self.apply_wait_s
        with self._applied_cv:
            while self.applied < lsn:
                left = deadline - time.monotonic()
                if left <= 0 or not self.connected:
                    return self._late(lsn)
                self._applied_cv.wait(left)
        return True

    def _late(self, lsn: int) -> str:
        return (
            f"the write was committed in the source database (position {lsn}) but this "
            f"sidecar has not applied it yet (applied through {self.applied}: it lags, or "
            "lost the database); it will appear once the sidecar catches up"
        )

    # -- writes --------------------------------------------------------------------------------

    def _write(self, op: int, flags: int, body: np.ndarray, out: np.ndarray) -> tuple[int, int]:
        """Runs one write as a transaction; returns (response length, feed position)."""
        request = self._prepare(op, flags, body)  # validation first: no connection needed
        if not self.connected:  # the follower lost the database: fail fast, hold no one up
            self.refused_writes += 1
            raise SourceUnavailable(
                "the write was not acknowledged: the source database is unreachable (reconnecting)"
            )
        conn = self._writer
        try:
            if conn is None or conn.closed:
                conn = self._writer = self._connect(writer=True)
            with conn.transaction(), conn.cursor() as cur:
                n = request(cur, out)
                cur.execute("SELECT head FROM kalos_feed")
                lsn = int(cur.fetchone()[0])
        except KalosError:
            raise
        except (self._psycopg.DataError, self._psycopg.IntegrityError) as exc:
            # the rows do not fit the table (a constraint, a type, a range): the request's fault
            self._drop_writer(conn)
            raise InvalidRequest(
                f"the source database refused the write: {_first_line(exc)}"
            ) from exc
        except self._psycopg.Error as exc:
            self.refused_writes += 1
            # A failed connection may be left mid-pipeline (executemany): never reuse one.
            if conn is not None:
                if conn.closed or conn.broken:
                    self.writer_error = _first_line(exc) or type(exc).__name__
                with contextlib.suppress(Exception):
                    conn.close()
                self._writer = None
            raise SourceUnavailable(
                "the write was not acknowledged: the source database failed it "
                f"({type(exc).__name__}: {_first_line(exc)})"
            ) from exc
        self.writer_error = None
        return n, lsn

    def _drop_writer(self, conn: Any) -> None:
        with contextlib.suppress(Exception):
            conn.close()
        self._writer = None

    def _prepare(self, op: int, flags: int, body: np.ndarray) -> Callable[[Any, np.ndarray], int]:
        """Decodes and checks a write; returns what runs it in a transaction."""
        end = len(body)
        memories, state = self.dispatcher.memories, self.dispatcher.state
        if op == Op.ADD:
            req = M.decode_add(body, end, flags)
            vectors = np.ascontiguousarray(req.vectors, np.float32)
            memories.check_vectors(vectors, "a vector")
            if bool((req.ids == -1).any()):
                raise InvalidRequest("id -1 is reserved for 'no result'")
            if self.table is not None:
                return self._prepare_mirror_add(req, vectors)
            tenant, user, session = (f or "" for f in req.scope)
            bounds = req.offsets.tolist()
            blob = req.blob.tobytes()
            rows = []
            for i, item in enumerate(req.ids.tolist()):
                tokens = None if req.tokens is None else req.tokens[i]
                meta = None if req.meta is None else req.meta[i]
                rows.append((
                    item, vectors[i].tobytes(), int(req.kinds[i]), blob[bounds[i] : bounds[i + 1]],
                    tenant, user, session,
                    None if tokens is None else np.ascontiguousarray(tokens, "<i4").tobytes(),
                    None if meta is None else json.dumps(meta),
                    None if req.keys is None else req.keys[i],
                ))  # fmt: skip

            def add(cur: Any, out: np.ndarray) -> int:
                cur.executemany(
                    "INSERT INTO kalos_memories AS m (id, vector, kind, payload, tenant, "
                    '"user", session, tokens, meta, key) VALUES (%s, %s, %s, %s, %s, %s, %s, '
                    "%s, %s, %s) ON CONFLICT (id) DO UPDATE SET vector = EXCLUDED.vector, "
                    "kind = EXCLUDED.kind, payload = EXCLUDED.payload, tenant = EXCLUDED.tenant,"
                    ' "user" = EXCLUDED."user", session = EXCLUDED.session, '
                    "tokens = EXCLUDED.tokens, meta = EXCLUDED.meta, key = EXCLUDED.key "
                    "RETURNING (xmax = 0)",
                    rows,
                    returning=True,
                )
                added = 0
                while True:
                    added += int(bool(cur.fetchone()[0]))
                    if not cur.nextset():
                        break
                return M.encode_counts(out, added, len(rows) - added)

            return add
        if op == Op.REMOVE:
            ids = M.decode_remove(body, end).tolist()
            deletion = self._delete_ids(ids)

            def remove(cur: Any, out: np.ndarray) -> int:
                cur.execute(*deletion)
                return M.encode_counts(out, cur.rowcount)

            return remove
        if op == Op.FORGET:
            return self._prepare_forget(flags, body)
        if op in (Op.STATE_PUT, Op.STATE_CAS):
            sv = M.decode_state_value(body, end)
            ns, key, value = state.check(sv.scope, sv.key, sv.value)
            if op == Op.STATE_CAS and sv.expected_version < 0:
                raise InvalidRequest(f"expected_version must be >= 0, got {sv.expected_version}")
            expected = sv.expected_version if op == Op.STATE_CAS else None

            def put(cur: Any, out: np.ndarray) -> int:
                pk = (*ns, key)
                if expected is None:
                    cur.execute(
                        'INSERT INTO kalos_state (tenant, "user", session, key, value) VALUES '
                        '(%s, %s, %s, %s, %s) ON CONFLICT (tenant, "user", session, key) DO '
                        "UPDATE SET value = EXCLUDED.value, "
                        "version = nextval('kalos_state_version') RETURNING version",
                        (*pk, value),
                    )
                elif expected == 0:
                    cur.execute(
                        'INSERT INTO kalos_state (tenant, "user", session, key, value) VALUES '
                        "(%s, %s, %s, %s, %s) ON CONFLICT DO NOTHING RETURNING version",
                        (*pk, value),
                    )
                else:
                    cur.execute(
                        "UPDATE kalos_state SET value = %s, version = "
                        "nextval('kalos_state_version') WHERE tenant = %s AND \"user\" = %s AND "
                        "session = %s AND key = %s AND version = %s RETURNING version",
                        (value, *pk, expected),
                    )
                row = cur.fetchone()
                if row is None:
                    cur.execute(
                        'SELECT version FROM kalos_state WHERE tenant = %s AND "user" = %s AND '
                        "session = %s AND key = %s",
                        pk,
                    )
                    have = cur.fetchone()
                    now = "does not exist" if have is None else f"is at version {have[0]}"
                    raise Conflict(f"state key {key!r} {now}, not {expected}")
                return M.encode_counts(out, int(row[0]))

            return put
        if op == Op.STATE_DELETE:
            scope, key = M.decode_state_key(body, end)
            ns, key, _ = state.check(scope, key, b"")

            def delete(cur: Any, out: np.ndarray) -> int:
                cur.execute(
                    'DELETE FROM kalos_state WHERE tenant = %s AND "user" = %s AND session = %s '
                    "AND key = %s",
                    (*ns, key),
                )
                return M.encode_counts(out, int(cur.rowcount > 0))

            return delete
        raise InvalidRequest(f"op {op} is not a source write")

    def _delete_ids(self, ids: list[int]) -> tuple[Any, tuple[Any, ...]]:
        """The DELETE of the memories ``ids`` and its parameters. A mirrored table with text
        ids is matched on the string ids this replica holds for them (an id it does not
        hold is not in the table either, as far as it has applied the feed)."""
        table = self.table
        if table is None:
            return "DELETE FROM kalos_memories WHERE id = ANY(%s)", (ids,)
        if not table.text_ids:
            return table.delete_ids(ids)
        keys = self.dispatcher.memories.metadata.keys
        return table.delete_ids([keys[i] for i in ids if i in keys])

    def _prepare_mirror_add(
        self, req: Any, vectors: np.ndarray
    ) -> Callable[[Any, np.ndarray], int]:
        """An ADD into the mirrored table's mapped columns (an upsert on its id column)."""
        table = self.table
        assert table is not None
        bounds, blob = req.offsets.tolist(), req.blob.tobytes()
        payloads = [
            (int(kind), blob[bounds[i] : bounds[i + 1]])
            for i, kind in enumerate(req.kinds.tolist())
        ]
        rows = table.write_rows(
            req.ids.tolist(), req.keys, vectors, payloads, tuple(req.scope), req.meta, req.tokens
        )
        upsert = table.upsert()

        def add(cur: Any, out: np.ndarray) -> int:
            cur.executemany(upsert, rows, returning=True)
            added = 0
            while True:
                added += int(bool(cur.fetchone()[0]))
                if not cur.nextset():
                    break
            return M.encode_counts(out, added, len(rows) - added)

        return add

    def _prepare_forget(self, flags: int, body: np.ndarray) -> Callable[[Any, np.ndarray], int]:
        dispatcher = self.dispatcher
        _, _, scope, off = M.decode_scoped(body, len(body))
        if flags & codes.FORGET_FILTER:  # the matching ids, from this replica's metadata
            where = filters.parse(M.decode_filter_at(body, off, len(body)))
            memories = dispatcher.memories
            ids = np.intersect1d(
                memories.ids_in_scope(scope), memories.metadata.matching(where), assume_unique=True
            ).tolist()
            matching = self._delete_ids(ids)

            def forget_ids(cur: Any, out: np.ndarray) -> int:
                cur.execute(*matching)
                return M.encode_forgotten(out, (cur.rowcount, 0, 0, 0))

            return forget_ids
        if not any(scope):
            raise InvalidRequest("forget needs a scope: a tenant, a user or a session")
        clause, params = _where(scope)
        deletion: tuple[Any, Any] = (
            (f"DELETE FROM kalos_memories WHERE {clause}", params)
            if self.table is None
            else self.table.delete_scope(tuple(scope))
        )

        def forget(cur: Any, out: np.ndarray) -> int:
            cur.execute(*deletion)
            items = cur.rowcount
            cur.execute(f"DELETE FROM kalos_state WHERE {clause}", params)
            values = cur.rowcount
            # sessions and event logs are local: forgotten here (the lock is held)
            sessions = dispatcher.sessions.forget(scope)
            _, logs = dispatcher.state.forget(scope)
            return M.encode_forgotten(out, (items, sessions, values, logs))

        return forget

    # -- bootstrap and follow ------------------------------------------------------------------

    def recover(self, stop: Callable[[], bool] = lambda: False) -> dict[str, Any]:
        """Before readiness: creates the schema, resumes from the local snapshot or loads the
        tables, starts following, and waits until the follower is within ``max_lag``
        positions of the feed's head."""
        t0 = time.perf_counter()
        try:
            self._start(self._open_data_dir())
        except BaseException:
            if self.snapshots is not None:
                self.snapshots.release_lock()
            raise
        while self.head - self.applied > self.max_lag or not self.connected:
            if stop() or self._stopping.is_set():
                break
            time.sleep(0.01)
        self.recovery = {
            "resumed": self.resumed,
            "resume_reason": self.resume_reason,
            "snapshot_position": self.applied_from if self.resumed else None,
            "loaded_rows": self.loaded_rows,
            "applied": self.applied,
            "bootstrap_s": round(self.bootstrap_s, 3),
            "total_s": round(time.perf_counter() - t0, 3),
        }
        log.info("recovered from %s: %s", self.where, json.dumps(self.recovery))
        return self.recovery

    def _start(self, newest: tuple[int, str] | None) -> None:
        """Creates the schema, resumes from ``newest`` (a snapshot's position and path) or
        loads the tables, and starts the follower."""
        with self._connect(autocommit=True) as conn:
            with conn.transaction():
                # one sidecar at a time runs the DDL (CREATE ... IF NOT EXISTS races otherwise)
                conn.execute("SELECT pg_advisory_xact_lock(hashtext('kalos_schema'))")
                conn.execute(SCHEMA)
                if self._table_spec is not None:
                    self.table = resolve(conn, *self._table_spec)
                    schema = str(conn.execute("SELECT current_schema()").fetchone()[0])
                    self.table.install(conn, schema)
                    self._changes = _changes_query(self.table)
            self.feed_id = str(conn.execute("SELECT feed_id FROM kalos_feed").fetchone()[0])
            if self.snapshots is not None:  # recorded in every snapshot, checked on resume
                self.snapshots.meta = {
                    "source_feed": self.feed_id,
                    "source_schema": str(SCHEMA_VERSION),
                }
                self.resumed, self.resume_reason = self._resume(conn, newest)
            if not self.resumed:
                if self.snapshots is not None:
                    log.info("not resuming (%s): loading the tables", self.resume_reason)
                self._load(conn)
        self.connected = True
        self._thread = threading.Thread(target=self._follow, name="kalos-follower", daemon=True)
        self._thread.start()

    def _open_data_dir(self) -> tuple[int, str] | None:
        """Takes the data directory (its lock), checks that it holds no write-ahead log,
        drops unfinished snapshots; returns the newest snapshot's (position, path)."""
        files = self.snapshots
        if files is None:
            return None
        os.makedirs(files.data_dir, mode=0o700, exist_ok=True)
        files.take_lock()
        path = os.path.join(files.data_dir, IDENTITY_FILE)
        try:
            with open(path) as f:
                journal = json.load(f).get("journal")
        except FileNotFoundError:
            journal = "wal" if os.path.isdir(os.path.join(files.data_dir, "wal")) else "source"
        except (OSError, ValueError) as exc:
            raise StoreError(f"{path} is unreadable: {exc}") from exc
        if journal != "source":  # its writes are in no database: never drop them
            raise ConfigError(
                f"the data directory {files.data_dir} holds a write-ahead log of a sidecar "
                "without --source: give this one another --data-dir"
            )
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(files.identity, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(files.data_dir)
        files.remove_unfinished()
        snapshots = list_snapshots(files.data_dir)
        return snapshots[-1] if snapshots else None

    def _resume(self, conn: Any, newest: tuple[int, str] | None) -> tuple[bool, str]:
        """Restores the newest snapshot when it may be followed from its position; returns
        (resumed, why)."""
        files = self.snapshots
        assert files is not None
        if newest is None:
            return False, f"no snapshot in {files.data_dir}"
        position, path = newest
        try:
            meta = files.read_meta(path, position)
            theirs = json.loads(meta.get("identity", "{}"))
        except (StoreError, ValueError) as exc:
            return False, f"the snapshot cannot be read: {exc}"
        if meta.get("source_feed") != self.feed_id:
            return False, "the snapshot comes from another database (or one created again)"
        if meta.get("source_schema") != str(SCHEMA_VERSION):
            return False, f"the snapshot is of schema {meta.get('source_schema')}"
        for key, ours in files.identity.items():
            if theirs.get(key) != ours:
                return False, f"the snapshot was written with {key}={theirs.get(key)!r}"
        head, gone = self._hold_feed(conn, position)
        if gone is not None:
            return False, gone
        row = conn.execute("SELECT at FROM kalos_changes WHERE seq = %s", (position,)).fetchone()
        made = None if row is None else row[0]
        try:
            ours = (
                datetime.datetime.fromisoformat(meta["source_at"])
                if meta.get("source_at")
                else None
            )
        except ValueError:
            return False, f"the snapshot's source_at {meta['source_at']!r} is not a time"
        if ours is not None and made is not None and made != ours:
            return False, (
                f"the change at the snapshot's position {position} is another one (a failover "
                "to a standby without the last commits, or a restore)"
            )
        t0 = time.perf_counter()
        try:
            with self.lock:
                files.restore_stores(path)
        except Exception as exc:
            log.warning("the snapshot at position %d cannot be restored", position, exc_info=True)
            return False, f"the snapshot cannot be restored: {type(exc).__name__}: {exc}"
        self.bootstrap_s = time.perf_counter() - t0
        self.applied = self.applied_from = position
        self._applied_at = made
        self.head = head  # readiness waits for the follower to apply up to it
        files.snapshot_lsn = position
        age_s = max(0.0, (time.time_ns() - int(meta.get("created_ns", 0))) / 1e9)
        files.snapshot_taken = time.perf_counter() - age_s
        return True, f"resumed from the snapshot at position {position}"

    def _hold_feed(self, conn: Any, position: int) -> tuple[int, str | None]:
        """The feed's head, and whether the feed holds every change after ``position``: None
        when it does (and this follower's row now keeps them from being pruned), else why
        not."""
        with conn.transaction():
            conn.execute(PRUNE_LOCK)  # no prune between the count and the follower's row
            head = int(conn.execute("SELECT head FROM kalos_feed").fetchone()[0])
            if head < position:
                return (
                    head,
                    f"the snapshot (position {position}) is ahead of the feed (head {head})",
                )
            held = int(
                conn.execute(
                    "SELECT count(*) FROM kalos_changes WHERE seq > %s AND seq <= %s",
                    (position, head),
                ).fetchone()[0]
            )
            if held != head - position:
                return head, (
                    f"the feed no longer holds every change after position {position} "
                    f"({held} of {head - position} rows left: pruned)"
                )
            conn.execute(
                "INSERT INTO kalos_followers (name, applied) VALUES (%s, %s) ON CONFLICT (name) "
                "DO UPDATE SET applied = EXCLUDED.applied, seen = now()",
                (self.follower, position),
            )
        return head, None

    def _load(self, conn: Any) -> None:
        """Replaces the local memories and state with the tables' rows (one snapshot: COPY in
        binary, streamed into the stores) and sets :attr:`applied` to its feed position."""
        t0 = time.perf_counter()
        with conn.transaction():
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
            head = int(conn.execute("SELECT head FROM kalos_feed").fetchone()[0])
            _, feed_id, head_at = conn.execute(_HEAD, (head,)).fetchone()
            rows = 0
            with self.lock:
                self._loading = True  # the stores are not those of a position until the end
                self._clear()
            with conn.cursor() as cur:
                copy_sql, types, table_oid = self._copy_memories()
                total, estimated = self._row_count(conn, table_oid)
                what = "kalos_memories" if self.table is None else self.table.qualified
                progress = LoadProgress(what, total, estimated=estimated)
                with cur.copy(copy_sql) as copy:
                    copy.set_types(types)
                    chunk: list[tuple[Any, ...]] = []
                    read = 0
                    for row in copy.rows():
                        read += 1
                        memory = self._memory_row(row, binary_array=True)
                        if memory is not None:
                            chunk.append(memory)
                        if len(chunk) >= COPY_CHUNK:
                            rows += self._apply_memories(chunk)
                            chunk = []
                            progress.update(read)
                    rows += self._apply_memories(chunk)
                    progress.finish(read)
                with cur.copy(
                    'COPY (SELECT tenant, "user", session, key, version, value FROM '
                    "kalos_state) TO STDOUT (FORMAT BINARY)"
                ) as copy:
                    copy.set_types(["text", "text", "text", "text", "int8", "bytea"])
                    with self.lock:
                        for tenant, user, session, key, version, value in copy.rows():
                            self.dispatcher.state.apply((tenant, user, session), key, version,
                                                        bytes(value))  # fmt: skip
                            rows += 1
        with self.lock:
            self.loaded_rows = rows
            self.applied = self.head = head
            self._applied_at = head_at
            self._loading = False
            self._load_unsaved = True
        if feed_id != self.feed_id:  # a feed created again: its snapshots are of that one
            self.feed_id = str(feed_id)
            if self.snapshots is not None:
                self.snapshots.meta["source_feed"] = self.feed_id
        self.bootstrap_s = time.perf_counter() - t0

    def _copy_memories(self) -> tuple[Any, list[str], Any]:
        """The load's COPY of the memory rows, its column types, and the table's oid (or the
        SQL naming it)."""
        from psycopg import sql

        table = self.table
        if table is None:
            own = sql.SQL(
                f"COPY (SELECT {_MEMORY_COLUMNS} FROM kalos_memories m) TO STDOUT (FORMAT BINARY)"
            )
            return own, _MEMORY_TYPES, sql.SQL("'kalos_memories'::regclass")
        copy = sql.SQL(
            "COPY (SELECT {memory} FROM {table} m WHERE m.{id} IS NOT NULL) TO STDOUT "
            "(FORMAT BINARY)"
        ).format(memory=table.select("m"), table=table.sql(), id=table.column("id"))
        # the vector as its binary form (bytea, or an array that MirroredTable decodes)
        types = ["text" if table.text_ids else "int8", *_MEMORY_TYPES[1:3], "text",
                 *_MEMORY_TYPES[4:8], "text", "text"]  # fmt: skip
        return copy, types, sql.Literal(table.oid)

    def _row_count(self, conn: Any, oid: Any) -> tuple[int, bool]:
        """The rows the load is about to read, for its progress: the planner's estimate
        (free), or a count when the table was never analysed; and whether estimated."""
        from psycopg import sql

        query = sql.SQL("SELECT reltuples::bigint FROM pg_class WHERE oid = {}").format(oid)
        estimate = int(conn.execute(query).fetchone()[0])
        if estimate >= 0:
            return estimate, True
        table = sql.Identifier("kalos_memories") if self.table is None else self.table.sql()
        count = sql.SQL("SELECT count(*) FROM {}").format(table)
        return int(conn.execute(count).fetchone()[0]), False

    def _memory_row(self, raw: tuple[Any, ...], *, binary_array: bool) -> tuple[Any, ...] | None:
        """A memory row as read (kalos_memories', or the mirrored table's) in Kalos's form;
        None, counted and logged, when a mirrored row cannot be a memory."""
        table = self.table
        if table is None:
            return raw
        try:
            return table.memory_row(raw, binary_array=binary_array)
        except InvalidRequest as exc:
            self._left_out(f"row {raw[0]!r} of {table.qualified}", exc)
            return None

    def _left_out(self, what: str, why: Exception) -> None:
        """Counts a row that cannot be applied, and logs why (the first 20, then every
        1,000th: a table of bad rows does not flood the log)."""
        self.apply_errors += 1
        n = self.apply_errors
        if n <= 20 or n % 1000 == 0:
            log.warning("%s left out (%d so far): %s", what, n, why)

    def _clear(self) -> None:
        """Removes every memory and state value from the local stores (under the lock)."""
        memories, state = self.dispatcher.memories, self.dispatcher.state
        memories.remove(memories.ids_in_scope(Scope()))
        for ns, key in state.keys_in():
            state.apply(ns, key, 0, None)

    def _apply_memories(self, rows: list[tuple[Any, ...]]) -> int:
        """Upserts memory rows (id, vector, kind, payload, tenant, user, session, tokens,
        meta, key) into the store, one store call per scope; returns how many applied."""
        by_scope: dict[tuple[str, str, str], list[tuple[Any, ...]]] = {}
        for row in rows:
            by_scope.setdefault((row[4], row[5], row[6]), []).append(row)
        applied = 0
        with self.lock:
            for (tenant, user, session), group in by_scope.items():
                try:
                    self._add(group, _scope(tenant, user, session))
                    applied += len(group)
                except (KalosError, ValueError) as exc:
                    for row in group:  # one at a time: only the bad rows are left out
                        try:
                            self._add([row], _scope(tenant, user, session))
                            applied += 1
                        except (KalosError, ValueError) as one:
                            self._left_out(f"memory {row[0]}", one)
                    del exc
        return applied

    def _add(self, rows: list[tuple[Any, ...]], scope: Scope) -> None:
        memories = self.dispatcher.memories
        dim = memories.dim
        n = len(rows)
        ids = np.fromiter((r[0] for r in rows), np.int64, n)
        vectors = np.empty((n, dim), np.float32)
        payloads = []
        for i, r in enumerate(rows):
            vec = np.frombuffer(r[1], "<f4")
            if len(vec) != dim:
                raise InvalidRequest(f"a vector of {len(vec)} values; the index has {dim}")
            vectors[i] = vec
            payloads.append(bytes(r[3]) if r[2] != codes.PAYLOAD_NONE else b"")
        kinds = np.fromiter((r[2] for r in rows), np.uint8, n)
        offsets = np.zeros(n + 1, np.uint64)
        offsets[1:] = np.cumsum([len(p) for p in payloads])
        blob = np.frombuffer(b"".join(payloads), np.uint8)
        tokens = [None if r[7] is None else np.frombuffer(r[7], "<i4") for r in rows]
        # meta: JSON text (kalos_memories), or already a dict (a mirrored table's row)
        meta = [r[8] if r[8] is None or isinstance(r[8], dict) else json.loads(r[8]) for r in rows]
        keys = [r[9] for r in rows]
        memories.add(ids, vectors, kinds, offsets, blob, scope, tokens, meta, keys)

    def _follow(self) -> None:
        """The follower thread: applies the feed, wakes on NOTIFY, reconnects by itself."""
        last_seen = last_prune = 0.0
        while not self._stopping.is_set():
            conn = None
            try:
                conn = self._connect(autocommit=True)
                conn.execute(f"LISTEN {CHANNEL}")
                if not self.connected:
                    self.reconnects += 1
                    log.info("reconnected to %s", self.where)
                self.connected = True
                while not self._stopping.is_set():
                    while self._catch_up(conn):
                        pass
                    now = time.monotonic()
                    if now - last_seen >= min(1.0, self.retention_s / 4):
                        conn.execute(
                            "INSERT INTO kalos_followers (name, applied) VALUES (%s, %s) ON "
                            "CONFLICT (name) DO UPDATE SET applied = EXCLUDED.applied, "
                            "seen = now()",
                            (self.follower, self._kept_from()),
                        )
                        last_seen = now
                    if now - last_prune >= min(PRUNE_EVERY_S, self.retention_s):
                        self._prune(conn)
                        last_prune = now
                    # wake on the next commit's NOTIFY, or after 0.5 s at most
                    for _ in conn.notifies(timeout=0.5, stop_after=1):
                        pass
            except self._psycopg.Error as exc:
                if self.connected:
                    log.warning("lost the source database %s: %s", self.where, exc)
                self.connected = False
                self._wake()  # writes waiting to be applied here are answered now
            except Exception:
                log.exception("the follower failed; retrying")
                self.connected = False
                self._wake()
            finally:
                if conn is not None:
                    with contextlib.suppress(Exception):
                        conn.close()
            self._stopping.wait(RECONNECT_S)

    def _catch_up(self, conn: Any) -> bool:
        """Applies the next batch of changes; True when there may be more."""
        head, feed_id, applied_at = conn.execute(_HEAD, (self.applied,)).fetchone()
        why = self._rewound(int(head), str(feed_id), applied_at)
        if why is not None:
            log.warning("%s: reloading", why)
            self.reloads += 1
            self._load(conn)
            self._wake()
            return True
        self.head = head = int(head)
        if head <= self.applied:
            return False
        rows = conn.execute(self._changes, (self.applied,)).fetchall()
        # positions are unique and sorted: the batch is whole when both ends are where due
        if not rows or rows[0][0] != self.applied + 1 or rows[-1][0] != self.applied + len(rows):
            # the rows after our position were pruned: only a reload brings us level
            log.warning("the change feed no longer holds position %d: reloading", self.applied)
            self.reloads += 1
            self._load(conn)
            self._wake()
            return True
        with self.lock:
            for row in rows:
                self._apply_change(row)
            self.applied = int(rows[-1][0])
            self._applied_at = rows[-1][21]
            self.applied_changes += len(rows)
        self._wake()
        return len(rows) >= BATCH_ROWS

    def _rewound(self, head: int, feed_id: str, applied_at: Any) -> str | None:
        """Why the database's feed is no longer the one applied here, or None: its tables
        were created again or restored from a backup (another feed id), or a failover went
        to a standby that lacked the last commits (the head is behind the applied position,
        or the change at that position is another one, made since)."""
        rewound = "a failover to a standby without the last commits, or a restore"
        if feed_id != self.feed_id:
            return "the database's change feed is another one (its tables made again, or restored)"
        if head < self.applied:
            return (
                f"the feed's head {head} is behind position {self.applied} applied here: {rewound}"
            )
        if (
            applied_at is not None
            and self._applied_at is not None
            and applied_at != self._applied_at
        ):
            return f"the change at position {self.applied} is not the one applied here: {rewound}"
        return None

    def _apply_change(self, row: tuple[Any, ...]) -> None:
        """One change row with the current contents of its row (under the lock; the layout
        of :data:`_CHANGES`). The memories follow ``kalos_memories`` (kind ``m``) or the
        mirrored table (``t``: a row, ``x``: a TRUNCATE), never both."""
        kind, table = row[1], self.table
        memories = self.dispatcher.memories
        try:
            if kind == "s":
                version, value = row[19], row[20]
                self.dispatcher.state.apply(
                    (row[3], row[4], row[5]), row[6], version or 0,
                    None if value is None else bytes(value),
                )  # fmt: skip
            elif kind == "m" and table is None:
                if row[8]:  # the row exists: upsert it as it is now
                    self._add([(row[2], *row[10:19])], _scope(row[13], row[14], row[15]))
                else:
                    memories.remove(np.array([row[2]], np.int64))
            elif table is not None and row[7] == table.oid and kind in ("t", "x"):
                if kind == "x":
                    memories.remove(memories.ids_in_scope(Scope()))
                    return
                item = np.array([table.item_id(row[6] if table.text_ids else row[2])], np.int64)
                # a row that is gone, or cannot be a memory: its earlier version goes too
                memory = self._memory_row(row[9:19], binary_array=False) if row[8] else None
                if memory is None:
                    memories.remove(item)
                    return
                try:
                    self._add([memory], _scope(memory[4], memory[5], memory[6]))
                except (KalosError, ValueError):
                    memories.remove(item)
                    raise
            # else: a change of a table this sidecar does not follow
        except (KalosError, ValueError) as exc:
            self._left_out(f"change {row[0]}", exc)

    def _kept_from(self) -> int:
        """The position recorded in ``kalos_followers``, after which the feed keeps every
        change for this follower: that of its newest local snapshot, from which a restart
        resumes, unless that snapshot is older than ``retention_s``; else the applied one."""
        files = self.snapshots
        if files is None or time.perf_counter() - files.snapshot_taken > self.retention_s:
            return self.applied
        return min(self.applied, files.snapshot_lsn)

    def _wake(self) -> None:
        with self._applied_cv:
            self._applied_cv.notify_all()
        if self.on_durable is not None:
            self.on_durable()

    def _prune(self, conn: Any) -> None:
        """Drop the feed rows every live follower passed and the followers gone ``retention_s``.

        One transaction: a reader never sees the rows gone while a stale follower remains.
        """
        r = self.retention_s
        with conn.transaction():
            conn.execute(PRUNE_LOCK)
            cur = conn.execute(_PRUNE, {"r": r})
            conn.execute(
                "DELETE FROM kalos_followers WHERE seen < now() - make_interval(secs => %s)", (r,)
            )
        self.pruned += max(0, cur.rowcount)

    # -- stop and stats ------------------------------------------------------------------------

    def close(self, timeout: float | None = None) -> bool:
        """Stops following; with a data directory, then writes a last snapshot (when the
        position moved since the last one). ``timeout`` (seconds) bounds it all: a snapshot
        not finished by then is left to the process's exit (the next start removes it and
        resumes from the one before, or loads). Returns whether no snapshot was left running."""
        deadline = time.monotonic() + (timeout if timeout is not None else 5.0)
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._writer is not None:
            with contextlib.suppress(Exception):
                self._writer.close()
            self._writer = None
        files = self.snapshots
        if files is None:
            return True
        left_running = not files.wait_finished(max(0.0, deadline - time.monotonic()))
        writer: threading.Thread | None = None
        if not left_running and self.feed_id is not None:
            writer = threading.Thread(
                target=self._last_snapshot, name="kalos-last-snapshot", daemon=True
            )
            writer.start()
            writer.join(max(0.0, deadline - time.monotonic()))
            if writer.is_alive():
                log.warning(
                    "the last snapshot did not finish in time: the next start resumes "
                    "from the one before, or loads the tables"
                )
            else:
                writer = None
        if left_running:
            log.warning("a snapshot is still being finished: no last snapshot")
            return False
        if writer is None:
            files.release_lock()
        return writer is None

    def _last_snapshot(self) -> None:
        try:
            self.snapshot(background=False)
        except Exception:
            log.exception("the snapshot at stop failed")

    def stats(self) -> dict[str, Any]:
        return {
            "source": self.where,
            "follower": self.follower,
            "table": None if self.table is None else self.table.qualified,
            "connected": self.connected,
            "degraded": self.degraded,
            "writer_error": self.writer_error,
            "applied": self.applied,
            "head": self.head,
            "lag": max(0, self.head - self.applied),
            "loaded_rows": self.loaded_rows,
            "bootstrap_s": round(self.bootstrap_s, 3),
            "applied_changes": self.applied_changes,
            "apply_errors": self.apply_errors,
            "refused_writes": self.refused_writes,
            "reloads": self.reloads,
            "reconnects": self.reconnects,
            "pruned": self.pruned,
            "resumed": self.resumed,
            "resume_reason": self.resume_reason,
            **(self._snapshot_stats() if self.snapshots is not None else {}),
        }

    def _snapshot_stats(self) -> dict[str, Any]:
        files = self.snapshots
        assert files is not None
        out: dict[str, Any] = {"data_dir": files.data_dir, "snapshot_position": files.snapshot_lsn}
        if files.last_snapshot:
            out["last_snapshot"] = files.last_snapshot
        return out
