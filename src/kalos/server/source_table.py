"""A table that other programs write, mirrored as a sidecar's memories (``--source-table``).

``kalos serve --source ... --source-table public.docs --source-columns
id=doc_id,vector=embedding,payload=body,tenant=org,metadata=attrs`` makes the rows of an
application's own table the sidecar's memories: an application that fills the table with
plain INSERT, UPDATE, DELETE (or COPY, TRUNCATE) needs no change to have its rows searched.

:func:`parse_columns` reads the mapping of roles to columns; :func:`resolve` checks it
against the database's catalog (the table exists, each column exists with a type this
module reads, the id column is unique) and returns a :class:`MirroredTable`; its
:meth:`~MirroredTable.install` puts the same kind of statement-level triggers on the table
as Kalos's own ``kalos_memories`` has: each changed row's id goes into ``kalos_changes``
(kind ``t``, with the table's oid in ``rel``), in the transaction of the change.

Columns (roles): ``id`` (bigint, integer or smallint; or text / varchar: a string id,
mapped onto the 63-bit id as the client maps string ids, :func:`kalos.filters.key_id`),
``vector`` (real[] or double precision[]; or bytea: little-endian float32, 4 × dim bytes),
and optionally ``payload`` (text), ``tenant``, ``user``, ``session`` (text; NULL or '' is
unset) and ``metadata`` (jsonb or json: an object). pgvector's ``vector`` type is not read
(a generated ``real[]`` column, ``embedding::real[]``, is).
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

from kalos.errors import ConfigError, InvalidRequest, KalosError
from kalos.filters import check_metadata, key_id
from kalos.protocol import codes

ROLES = ("id", "vector", "payload", "tenant", "user", "session", "metadata")
REQUIRED = ("id", "vector")
SCOPE_ROLES = ("tenant", "user", "session")
_INT_IDS = ("bigint", "integer", "smallint")
_TEXT = ("text", "character varying")
_ARRAYS = {"real[]": ">f4", "double precision[]": ">f8"}
# Creating the triggers waits for the table's open write transactions, and holds up the
# writers that come after it meanwhile: a start gives up rather than stall the application.
INSTALL_LOCK_TIMEOUT_MS = 5000
_TYPES: dict[str, tuple[str, ...]] = {
    "id": _INT_IDS + _TEXT,
    "vector": (*_ARRAYS, "bytea"),
    "payload": _TEXT,
    "tenant": _TEXT,
    "user": _TEXT,
    "session": _TEXT,
    "metadata": ("jsonb", "json"),
}

# Installed (again) at every start of a mirroring sidecar, in the schema of Kalos's tables.
# SECURITY DEFINER: the programs that write the table need no privilege on Kalos's tables;
# the functions run as the role that created them (the sidecar's), with a fixed search_path.
# TG_ARGV[0] is the id column, TG_ARGV[1] the change row's column that keeps it (id or key).
FUNCTIONS = """
CREATE OR REPLACE FUNCTION kalos_mirror_changed() RETURNS trigger LANGUAGE plpgsql
    SECURITY DEFINER SET search_path = {schema}, pg_temp AS $$
DECLARE
    ids text;
    n bigint;
    h bigint;
BEGIN
    IF TG_OP = 'INSERT' THEN
        ids := format('SELECT %1$I FROM new_rows WHERE %1$I IS NOT NULL', TG_ARGV[0]);
    ELSIF TG_OP = 'DELETE' THEN
        ids := format('SELECT %1$I FROM old_rows WHERE %1$I IS NOT NULL', TG_ARGV[0]);
    ELSE
        ids := format('SELECT %1$I FROM old_rows WHERE %1$I IS NOT NULL '
                      'UNION SELECT %1$I FROM new_rows WHERE %1$I IS NOT NULL', TG_ARGV[0]);
    END IF;
    EXECUTE format('SELECT count(*) FROM (%s) k', ids) INTO n;
    IF n = 0 THEN
        RETURN NULL;
    END IF;
    -- one head update per statement, as for kalos_memories
    UPDATE kalos_feed SET head = head + n RETURNING head - n INTO h;
    EXECUTE format('INSERT INTO kalos_changes (seq, kind, rel, %I) '
                   'SELECT $1 + row_number() OVER (), ''t'', $2, k.v FROM (%s) k(v)',
                   TG_ARGV[1], ids) USING h, TG_RELID;
    PERFORM pg_notify('kalos_changes', '');
    RETURN NULL;
END $$;
CREATE OR REPLACE FUNCTION kalos_mirror_truncated() RETURNS trigger LANGUAGE plpgsql
    SECURITY DEFINER SET search_path = {schema}, pg_temp AS $$
DECLARE
    h bigint;
BEGIN
    UPDATE kalos_feed SET head = head + 1 RETURNING head INTO h;
    INSERT INTO kalos_changes (seq, kind, rel) VALUES (h, 'x', TG_RELID);
    PERFORM pg_notify('kalos_changes', '');
    RETURN NULL;
END $$;
"""
TRIGGERS = """
CREATE OR REPLACE TRIGGER kalos_mirror_inserted AFTER INSERT ON {table}
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION {changed}({column}, {slot});
CREATE OR REPLACE TRIGGER kalos_mirror_updated AFTER UPDATE ON {table}
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION {changed}({column}, {slot});
CREATE OR REPLACE TRIGGER kalos_mirror_deleted AFTER DELETE ON {table}
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION {changed}({column}, {slot});
CREATE OR REPLACE TRIGGER kalos_mirror_truncated AFTER TRUNCATE ON {table}
    FOR EACH STATEMENT EXECUTE FUNCTION {truncated}();
"""


def parse_columns(spec: str) -> dict[str, str]:
    """``id=doc_id,vector=embedding,...`` → {role: column}; ConfigError when malformed, a role
    is unknown or repeated, a column serves two roles, or id or vector is missing."""
    columns: dict[str, str] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        role, eq, column = (s.strip() for s in part.partition("="))
        if not eq or not column:
            raise ConfigError(f"--source-columns: {part!r} is not ROLE=COLUMN")
        if role not in ROLES:
            raise ConfigError(
                f"--source-columns: unknown role {role!r} (roles: {', '.join(ROLES)})"
            )
        if role in columns:
            raise ConfigError(f"--source-columns: {role} is given twice")
        if column in columns.values():
            raise ConfigError(f"--source-columns: column {column!r} is given two roles")
        columns[role] = column
    missing = [r for r in REQUIRED if r not in columns]
    if missing:
        raise ConfigError(f"--source-columns needs {' and '.join(missing)}=COLUMN")
    return columns


@dataclasses.dataclass(frozen=True)
class MirroredTable:
    """A mapped table, checked against the catalog (:func:`resolve`)."""

    oid: int
    schema: str
    name: str
    columns: Mapping[str, str]  # role -> column
    types: Mapping[str, str]  # role -> the column's type (format_type)

    @property
    def qualified(self) -> str:
        return f"{self.schema}.{self.name}"

    @property
    def text_ids(self) -> bool:
        return self.types["id"] in _TEXT

    def sql(self) -> Any:
        """The table's name as a psycopg SQL object."""
        from psycopg import sql

        return sql.Identifier(self.schema, self.name)

    def column(self, role: str) -> Any:
        from psycopg import sql

        return sql.Identifier(self.columns[role])

    def select(self, alias: str) -> Any:
        """The memory columns in Kalos's order (id, vector, kind, payload, tenant, user,
        session, tokens, meta, key), as read by :meth:`memory_row`; ``alias``: the table's."""
        from psycopg import sql

        def col(role: str, cast: str) -> Any:
            if role not in self.columns:
                return sql.SQL(f"NULL::{cast}")
            return sql.SQL("{}::" + cast).format(sql.Identifier(alias, self.columns[role]))

        id_cast = "text" if self.text_ids else "bigint"
        return sql.SQL(", ").join([
            col("id", id_cast), sql.Identifier(alias, self.columns["vector"]),
            sql.SQL("NULL::smallint"), col("payload", "text"), col("tenant", "text"),
            col("user", "text"), col("session", "text"), sql.SQL("NULL::bytea"),
            col("metadata", "text"), sql.SQL("NULL::text"),
        ])  # fmt: skip

    def install(self, conn: Any, kalos_schema: str) -> None:
        """Creates (or replaces) the feed's functions, and the table's triggers unless they
        are there as they should be: creating a trigger locks the table against its writers
        (SHARE ROW EXCLUSIVE), and waits for their open transactions, so a start does it
        only when needed, and gives up after :data:`INSTALL_LOCK_TIMEOUT_MS`."""
        import psycopg
        from psycopg import sql

        conn.execute(sql.SQL(FUNCTIONS).format(schema=sql.Identifier(kalos_schema)))
        if self.installed(conn, kalos_schema):
            return
        conn.execute(f"SET LOCAL lock_timeout = {INSTALL_LOCK_TIMEOUT_MS}")
        try:
            conn.execute(
                sql.SQL(TRIGGERS).format(
                    table=self.sql(),
                    changed=sql.Identifier(kalos_schema, "kalos_mirror_changed"),
                    truncated=sql.Identifier(kalos_schema, "kalos_mirror_truncated"),
                    column=sql.Literal(self.columns["id"]),
                    slot=sql.Literal(self.slot),
                )
            )
        except psycopg.errors.LockNotAvailable:
            raise KalosError(
                f"the triggers on {self.qualified} could not be installed within "
                f"{INSTALL_LOCK_TIMEOUT_MS / 1000:g} s: a transaction holds the table; start "
                "again once it is done"
            ) from None

    @property
    def slot(self) -> str:
        """The column of ``kalos_changes`` that keeps a changed row's id."""
        return "key" if self.text_ids else "id"

    def installed(self, conn: Any, kalos_schema: str) -> bool:
        """Whether the table has its four triggers, enabled, calling ``kalos_schema``'s
        functions with this mapping's id column."""
        changed = ("kalos_mirror_changed", (self.columns["id"], self.slot))
        want = {
            "kalos_mirror_inserted": changed,
            "kalos_mirror_updated": changed,
            "kalos_mirror_deleted": changed,
            "kalos_mirror_truncated": ("kalos_mirror_truncated", ()),
        }
        have = {}
        for name, schema, function, args, enabled in conn.execute(
            "SELECT t.tgname, n.nspname, p.proname, t.tgargs, t.tgenabled FROM pg_trigger t "
            "JOIN pg_proc p ON p.oid = t.tgfoid JOIN pg_namespace n ON n.oid = p.pronamespace "
            "WHERE t.tgrelid = %s AND t.tgname LIKE 'kalos_mirror%%'",
            (self.oid,),
        ):
            values = tuple(a.decode() for a in bytes(args).split(b"\0")[:-1])
            have[str(name)] = (str(schema), (str(function), values), str(enabled))
        return all(have.get(n) == (kalos_schema, w, "O") for n, w in want.items())

    # -- writes through a sidecar ----------------------------------------------------------------

    def upsert(self) -> Any:
        """INSERT of one row's mapped columns (the values of :meth:`write_rows`), an upsert
        on the id column, RETURNING whether the row is new."""
        from psycopg import sql

        roles = [r for r in ROLES if r in self.columns]
        return sql.SQL(
            "INSERT INTO {table} AS m ({columns}) VALUES ({values}) ON CONFLICT ({id}) "
            "DO UPDATE SET {sets} RETURNING (xmax = 0)"
        ).format(
            table=self.sql(),
            columns=sql.SQL(", ").join(self.column(r) for r in roles),
            values=sql.SQL(", ").join(sql.Placeholder() * len(roles)),
            id=self.column("id"),
            sets=sql.SQL(", ").join(
                sql.SQL("{c} = EXCLUDED.{c}").format(c=self.column(r)) for r in roles[1:]
            ),
        )

    def write_rows(
        self,
        ids: list[int],
        keys: list[str | None] | None,
        vectors: np.ndarray,
        payloads: list[tuple[int, bytes]],
        scope: tuple[str | None, str | None, str | None],
        meta: list[dict[str, Any] | None] | None,
        tokens: list[Any] | None,
    ) -> list[tuple[Any, ...]]:
        """The values of :meth:`upsert` for an ADD's items (``payloads``: kind and bytes
        each); InvalidRequest when the table cannot hold what the request carries."""
        from psycopg.types.json import Json, Jsonb

        what = f"the memories are the rows of {self.qualified}"
        if tokens is not None and any(t is not None for t in tokens):
            raise InvalidRequest(f"{what}, which hold no token ids: add without token ids")
        if self.text_ids:
            if keys is None or any(k is None for k in keys):
                raise InvalidRequest(
                    f"{what}, whose ids are text ({self.columns['id']}): add with string ids"
                )
            id_values: list[Any] = list(keys)
        else:
            if keys is not None and any(k is not None for k in keys):
                raise InvalidRequest(
                    f"{what}, whose ids are integers ({self.columns['id']}): add with int ids"
                )
            id_values = list(ids)
        for role, value in zip(SCOPE_ROLES, scope, strict=True):
            if value is not None and role not in self.columns:
                raise InvalidRequest(f"{what}, which has no {role} column: add without a {role}")
        if meta is not None and any(m is not None for m in meta) and "metadata" not in self.columns:
            raise InvalidRequest(f"{what}, which has no metadata column: add without metadata")
        wrap = Jsonb if self.types.get("metadata") == "jsonb" else Json
        as_bytes = self.types["vector"] == "bytea"
        rows = []
        for i, item in enumerate(id_values):
            kind, data = payloads[i]
            if kind == codes.PAYLOAD_BYTES:
                raise InvalidRequest(f"{what}, whose payloads are text: add text payloads")
            if kind == codes.PAYLOAD_TEXT and "payload" not in self.columns:
                raise InvalidRequest(f"{what}, which has no payload column: add without payloads")
            try:
                text = data.decode() if kind == codes.PAYLOAD_TEXT else None
            except UnicodeDecodeError:
                raise InvalidRequest(f"payload {i} is not UTF-8 text") from None
            vector = vectors[i]
            row: list[Any] = [item, vector.astype("<f4").tobytes() if as_bytes else vector.tolist()]
            if "payload" in self.columns:
                row.append(text)
            for role, value in zip(SCOPE_ROLES, scope, strict=True):
                if role in self.columns:
                    row.append(value)
            if "metadata" in self.columns:
                one = None if meta is None else meta[i]
                row.append(None if one is None else wrap(one))
            rows.append(tuple(row))
        return rows

    def delete_ids(self, id_values: list[Any]) -> tuple[Any, tuple[Any, ...]]:
        """DELETE of the rows with these id column values, and its parameters."""
        from psycopg import sql

        query = sql.SQL("DELETE FROM {table} WHERE {id} = ANY(%s)").format(
            table=self.sql(), id=self.column("id")
        )
        return query, (id_values,)

    def delete_scope(self, scope: tuple[str | None, ...]) -> tuple[Any, list[str]]:
        """DELETE of the rows in ``scope`` (each given field equal), and its parameters;
        InvalidRequest when a given field has no column."""
        from psycopg import sql

        clauses, params = [], []
        for role, value in zip(SCOPE_ROLES, scope, strict=True):
            if value is None:
                continue
            if role not in self.columns:
                raise InvalidRequest(
                    f"the memories are the rows of {self.qualified}, which has no {role} column"
                )
            clauses.append(sql.SQL("{} = %s").format(self.column(role)))
            params.append(value)
        query = sql.SQL("DELETE FROM {table} WHERE {where}").format(
            table=self.sql(), where=sql.SQL(" AND ").join(clauses)
        )
        return query, params

    # -- rows ----------------------------------------------------------------------------------

    def item_id(self, value: Any) -> int:
        """The 63-bit id of an id column's value (a string id's :func:`key_id`)."""
        return key_id(value) if self.text_ids else int(value)

    def memory_row(self, raw: tuple[Any, ...], *, binary_array: bool) -> tuple[Any, ...]:
        """A row of :meth:`select` as Kalos's memory row (id, vector as little-endian float32
        bytes, kind, payload bytes, tenant, user, session, tokens, meta, key); InvalidRequest
        when it cannot be one. ``binary_array``: an array vector comes in PostgreSQL's binary
        array format (a binary COPY), not as a list."""
        value = raw[0]
        if value is None:
            raise InvalidRequest("the id is NULL")
        key = value if self.text_ids else None
        vector = self.vector_bytes(raw[1], binary_array=binary_array)
        payload = raw[3]
        kind = codes.PAYLOAD_NONE if payload is None else codes.PAYLOAD_TEXT
        try:
            meta = None if raw[8] is None else check_metadata(json.loads(raw[8]), 0)
        except InvalidRequest as exc:
            raise InvalidRequest(f"column {self.columns['metadata']}: {exc}") from None
        return (
            self.item_id(value), vector, kind, b"" if payload is None else payload.encode(),
            raw[4] or "", raw[5] or "", raw[6] or "", None, meta, key,
        )  # fmt: skip

    def vector_bytes(self, value: Any, *, binary_array: bool) -> bytes:
        """The vector column's value as little-endian float32 bytes."""
        column = self.columns["vector"]
        if value is None:
            raise InvalidRequest(f"the vector ({column}) is NULL")
        kind = self.types["vector"]
        if kind == "bytea":
            data = bytes(value)
            if len(data) % 4:
                raise InvalidRequest(
                    f"the vector ({column}) has {len(data)} bytes: not float32 (4 bytes each)"
                )
            return data
        if binary_array:
            return _binary_array(bytes(value), _ARRAYS[kind], column)
        try:
            vector = np.asarray(value, np.float32)
        except (TypeError, ValueError):
            raise InvalidRequest(f"the vector ({column}) has NULL elements") from None
        if vector.ndim != 1:
            raise InvalidRequest(f"the vector ({column}) has {vector.ndim} dimensions, not 1")
        return vector.astype("<f4").tobytes()


def _binary_array(data: bytes, element: str, column: str) -> bytes:
    """A one-dimensional real[] or double precision[] in PostgreSQL's binary format (header:
    ndim, has-nulls, element oid, then per dimension its length and lower bound; then each
    element as a 4-byte length and its big-endian value) as little-endian float32 bytes."""
    ndim, has_nulls, _ = struct.unpack_from(">iiI", data)
    if ndim == 0:
        return b""
    if ndim != 1:
        raise InvalidRequest(f"the vector ({column}) has {ndim} dimensions, not 1")
    if has_nulls:
        raise InvalidRequest(f"the vector ({column}) has NULL elements")
    (n,) = struct.unpack_from(">i", data, 12)
    cells = np.frombuffer(data, [("len", ">i4"), ("v", element)], count=n, offset=20)
    return cells["v"].astype("<f4").tobytes()


def resolve(conn: Any, table: str, columns: Mapping[str, str]) -> MirroredTable:
    """Checks ``table`` ([schema.]name, as SQL reads it) and ``columns`` (role -> column)
    against the catalog; ConfigError saying what does not fit."""
    what = f"--source-table {table}"
    row = conn.execute(
        "SELECT c.oid, n.nspname, c.relname, c.relkind FROM pg_class c "
        "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = to_regclass(%s)",
        (table,),
    ).fetchone()
    if row is None:
        raise ConfigError(f"{what}: no such table (as this role sees it, with its search_path)")
    oid, schema, name, relkind = int(row[0]), str(row[1]), str(row[2]), str(row[3])
    if relkind != "r":
        raise ConfigError(f"{what}: not an ordinary table (relkind {relkind!r})")
    found = {
        str(att): (str(typ), int(num))
        for att, typ, num in conn.execute(
            "SELECT attname, format_type(atttypid, NULL), attnum FROM pg_attribute "
            "WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped",
            (oid,),
        )
    }
    types: dict[str, str] = {}
    for role, column in columns.items():
        if column not in found:
            raise ConfigError(
                f"--source-columns {role}={column}: {schema}.{name} has no column {column!r} "
                f"(it has {', '.join(sorted(found))})"
            )
        typ = found[column][0]
        if typ == "vector":
            raise ConfigError(
                f"--source-columns {role}={column}: pgvector's vector type is not supported yet; "
                f"mirror a real[] column instead (a generated one: {column}::real[])"
            )
        if typ not in _TYPES[role]:
            raise ConfigError(
                f"--source-columns {role}={column}: a {typ} column; {role} must be one of "
                f"{', '.join(_TYPES[role])}"
            )
        types[role] = typ
    unique = conn.execute(
        "SELECT 1 FROM pg_index WHERE indrelid = %s AND indisunique AND indnkeyatts = 1 "
        "AND indkey[0] = %s AND indpred IS NULL AND indexprs IS NULL",
        (oid, found[columns["id"]][1]),
    ).fetchone()
    if unique is None:
        raise ConfigError(
            f"--source-columns id={columns['id']}: the id column must be the primary key or "
            "have a unique index of its own"
        )
    return MirroredTable(oid, schema, name, dict(columns), types)
