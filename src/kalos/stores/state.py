"""Agent state: versioned values per scope and key, and an append-only event log per session.

Values: ``(scope, key) → (version, bytes)``. A scope here is an exact namespace (tenant, user,
session; unset fields are part of it too, as ""). Versions come from one store-wide counter,
so every write gets a version no earlier write had: a value that was deleted and put again
never reuses a version, and a compare-and-set against a stale version always fails.

Event logs: per session id, events ``(seq, time, kind, data)`` with ``seq`` = 1, 2, 3, ...
and ``time`` the request's time (seconds since the epoch). A log belongs to the tenant and
user it was first written with; :meth:`StateStore.forget` removes it with them.

Every mutating method takes ``now`` instead of reading a clock, so replaying the same
requests with the same times rebuilds the same state.
"""

from __future__ import annotations

import sqlite3

from kalos.errors import Conflict, InvalidRequest, NotFound
from kalos.protocol import codes
from kalos.protocol.messages import Event, Scope, StateValue
from kalos.stores.limits import Limits, check_name, check_size

Namespace = tuple[str, str, str]  # (tenant, user, session); "" where unset


def namespace(scope: Scope | None) -> Namespace:
    if scope is None:
        return ("", "", "")
    return (scope.tenant or "", scope.user or "", scope.session or "")


def _matches(ns: Namespace, scope: Scope) -> bool:
    return all(want is None or want == have for want, have in zip(scope, ns, strict=True))


class EventLog:
    """One session's events, in seq order (seq i is at index i - 1)."""

    __slots__ = ("data", "kinds", "owner", "times")

    def __init__(self, owner: Namespace) -> None:
        self.owner = owner
        self.times: list[float] = []
        self.kinds: list[str] = []
        self.data: list[str | bytes] = []


class StateStore:
    """Versioned values and event logs of one sidecar. Used by one thread at a time."""

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self._values: dict[tuple[str, str, str, str], StateValue] = {}
        self._logs: dict[str, EventLog] = {}
        self.revision = 0  # the last version handed out
        self._value_bytes = 0

    def __len__(self) -> int:
        return len(self._values)

    # -- values ------------------------------------------------------------------------------

    def _key(self, scope: Scope | None, key: str) -> tuple[str, str, str, str]:
        check_name("a state key", key, self.limits.max_key_bytes)
        return (*namespace(scope), key)

    def _check_value(self, value: bytes) -> bytes:
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise InvalidRequest(f"a state value must be bytes, not {type(value).__name__}")
        value = bytes(value)
        check_size("the value", len(value), self.limits.max_state_bytes, "bytes",
                   "--max-state-bytes")  # fmt: skip
        return value

    def get(self, scope: Scope | None, key: str) -> StateValue:
        """(version, value) of ``key``; NotFound when absent."""
        got = self._values.get(self._key(scope, key))
        if got is None:
            raise NotFound(f"state key {key!r} does not exist in this scope")
        return got

    def put(self, scope: Scope | None, key: str, value: bytes) -> int:
        """Sets ``key`` to ``value`` whatever its version; returns the new version."""
        k = self._key(scope, key)
        return self._set(k, self._check_value(value))

    def cas(self, scope: Scope | None, key: str, expected_version: int, value: bytes) -> int:
        """Sets ``key`` only if its version is ``expected_version`` (0: only if it does not
        exist); returns the new version. Conflict, naming the current version, otherwise."""
        k = self._key(scope, key)
        value = self._check_value(value)
        if expected_version < 0:
            raise InvalidRequest(f"expected_version must be >= 0, got {expected_version}")
        current = self._values.get(k)
        have = 0 if current is None else current.version
        if have != expected_version:
            state = "does not exist" if current is None else f"is at version {have}"
            raise Conflict(f"state key {key!r} {state}, not {expected_version}")
        return self._set(k, value)

    def _set(self, k: tuple[str, str, str, str], value: bytes) -> int:
        self.revision += 1
        old = self._values.get(k)
        if old is not None:
            self._value_bytes -= len(old.value)
        self._values[k] = StateValue(self.revision, value)
        self._value_bytes += len(value)
        return self.revision

    def check(self, scope: Scope | None, key: str, value: bytes) -> tuple[Namespace, str, bytes]:
        """(namespace, key, value) of a put, checked against the limits; changes nothing."""
        k = self._key(scope, key)
        return k[:3], key, self._check_value(value)

    def apply(self, ns: Namespace, key: str, version: int, value: bytes | None) -> None:
        """Sets ``key`` in ``ns`` to ``value`` at ``version`` as another store decided it (a
        replica following its source), or deletes it (``value`` None). Later versions this
        store hands out stay above ``version``."""
        k = (*ns, key)
        old = self._values.pop(k, None)
        if old is not None:
            self._value_bytes -= len(old.value)
        if value is not None:
            self._values[k] = StateValue(version, value)
            self._value_bytes += len(value)
            self.revision = max(self.revision, version)

    def delete(self, scope: Scope | None, key: str) -> bool:
        """Deletes ``key``; returns whether it existed."""
        old = self._values.pop(self._key(scope, key), None)
        if old is None:
            return False
        self._value_bytes -= len(old.value)
        return True

    # -- event logs --------------------------------------------------------------------------

    def log(
        self, session: str, kind: str, data: str | bytes, *, now: float, owner: Scope | None = None
    ) -> int:
        """Appends an event to ``session``'s log; returns its seq (1 for the first).

        ``owner``: the tenant and user of the log, fixed by its first event; an event that
        names another raises Conflict. ``now`` becomes the event's time.
        """
        lim = self.limits
        check_name("a session id", session, lim.max_key_bytes)
        if not isinstance(kind, str):
            raise InvalidRequest(f"an event kind must be a str, not {type(kind).__name__}")
        check_size("the event kind", len(kind.encode()), lim.max_kind_bytes, "bytes")
        if isinstance(data, str):
            size = len(data.encode())
        elif isinstance(data, (bytes, bytearray, memoryview)):
            data = bytes(data)
            size = len(data)
        else:
            raise InvalidRequest(f"event data must be str or bytes, not {type(data).__name__}")
        check_size("the event data", size, lim.max_state_bytes, "bytes", "--max-state-bytes")
        want = namespace(owner)[:2]
        log = self._logs.get(session)
        if log is not None and any(w and w != h for w, h in zip(want, log.owner, strict=False)):
            raise Conflict(f"the event log of session {session!r} belongs to another owner")
        if log is None:
            log = self._logs[session] = EventLog((want[0], want[1], session))
        log.times.append(now)
        log.kinds.append(kind)
        log.data.append(data)
        return len(log.times)

    def events(
        self,
        session: str,
        since: int = 0,
        limit: int | None = None,
        *,
        scope: Scope | None = None,
    ) -> list[Event]:
        """Events of ``session`` with seq > ``since``, oldest first (at most ``limit``).

        A session without a log (or outside ``scope``) has no events: the list is empty.
        """
        log = self._logs.get(session)
        if log is None or (scope is not None and not _matches(log.owner, scope)):
            return []
        start = max(since, 0)
        stop = len(log.times) if limit is None else min(len(log.times), start + limit)
        return [Event(i + 1, log.times[i], log.kinds[i], log.data[i]) for i in range(start, stop)]

    def log_length(self, session: str) -> int:
        log = self._logs.get(session)
        return 0 if log is None else len(log.times)

    # -- scopes ------------------------------------------------------------------------------

    def forget(self, scope: Scope) -> tuple[int, int]:
        """Deletes every value and event log whose scope matches ``scope`` (each field given
        must be equal); returns (values, logs) deleted."""
        keys = [k for k in self._values if _matches(k[:3], scope)]
        for k in keys:
            self._value_bytes -= len(self._values.pop(k).value)
        logs = [name for name, log in self._logs.items() if _matches(log.owner, scope)]
        for name in logs:
            del self._logs[name]
        return len(keys), len(logs)

    def keys_in(self, scope: Scope | None = None) -> list[tuple[Namespace, str]]:
        """Every (namespace, key) whose namespace matches ``scope``, sorted."""
        return sorted(
            (k[:3], k[3]) for k in self._values if scope is None or _matches(k[:3], scope)
        )

    def stats(self) -> dict[str, int]:
        return {
            "state_keys": len(self._values),
            "state_bytes": self._value_bytes,
            "event_logs": len(self._logs),
            "events": sum(len(log.times) for log in self._logs.values()),
        }

    def clear(self) -> None:
        self._values.clear()
        self._logs.clear()
        self.revision = 0
        self._value_bytes = 0

    # -- snapshots ---------------------------------------------------------------------------

    def snapshot(self, db: sqlite3.Connection, directory: str, *, logs: bool = True) -> None:
        """Writes every value and event into ``db`` (tables ``state_values``, ``state_logs``,
        ``state_events``, ``state_meta``). Nothing goes to ``directory``: values are small
        (``max_state_bytes``). Replaces an earlier snapshot in ``db``; does not commit.
        ``logs`` False: the values only (the event-log tables are left empty)."""
        for table in ("state_values", "state_logs", "state_events", "state_meta"):
            db.execute(f"DROP TABLE IF EXISTS {table}")
        db.execute(
            "CREATE TABLE state_values (tenant TEXT NOT NULL, user TEXT NOT NULL, "
            "session TEXT NOT NULL, key TEXT NOT NULL, version INTEGER NOT NULL, "
            "value BLOB NOT NULL, PRIMARY KEY (tenant, user, session, key))"
        )
        db.execute(
            "CREATE TABLE state_logs (session TEXT PRIMARY KEY, tenant TEXT NOT NULL, "
            "user TEXT NOT NULL)"
        )
        db.execute(
            "CREATE TABLE state_events (session TEXT NOT NULL, seq INTEGER NOT NULL, "
            "time REAL NOT NULL, kind TEXT NOT NULL, data_kind INTEGER NOT NULL, "
            "data BLOB NOT NULL, PRIMARY KEY (session, seq))"
        )
        db.execute("CREATE TABLE state_meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL)")
        db.execute("INSERT INTO state_meta VALUES ('revision', ?)", (self.revision,))
        db.executemany(
            "INSERT INTO state_values VALUES (?,?,?,?,?,?)",
            ((*k, v.version, v.value) for k, v in self._values.items()),
        )
        if not logs:
            return
        db.executemany(
            "INSERT INTO state_logs VALUES (?,?,?)",
            ((name, log.owner[0], log.owner[1]) for name, log in self._logs.items()),
        )
        db.executemany(
            "INSERT INTO state_events VALUES (?,?,?,?,?,?)",
            (
                (name, i + 1, log.times[i], log.kinds[i], *_data_row(log.data[i]))
                for name, log in self._logs.items()
                for i in range(len(log.times))
            ),
        )

    def restore(self, db: sqlite3.Connection, directory: str, *, logs: bool = True) -> None:
        """Replaces everything with a :meth:`snapshot` from ``db``; ``logs`` False: the
        values only (the store's event logs are kept as they are)."""
        if logs:
            self.clear()
        else:
            self._values.clear()
            self._value_bytes = 0
        (self.revision,) = db.execute(
            "SELECT value FROM state_meta WHERE name = 'revision'"
        ).fetchone()
        for tenant, user, session, key, version, value in db.execute(
            "SELECT tenant, user, session, key, version, value FROM state_values"
        ):
            self._values[(tenant, user, session, key)] = StateValue(version, bytes(value))
            self._value_bytes += len(value)
        if not logs:
            return
        for name, tenant, user in db.execute("SELECT session, tenant, user FROM state_logs"):
            self._logs[name] = EventLog((tenant, user, name))
        for name, _seq, t, kind, data_kind, data in db.execute(
            "SELECT session, seq, time, kind, data_kind, data FROM state_events "
            "ORDER BY session, seq"
        ):
            log = self._logs[name]
            log.times.append(t)
            log.kinds.append(kind)
            log.data.append(
                bytes(data).decode() if data_kind == codes.PAYLOAD_TEXT else bytes(data)
            )


def _data_row(data: str | bytes) -> tuple[int, bytes]:
    if isinstance(data, str):
        return codes.PAYLOAD_TEXT, data.encode()
    return codes.PAYLOAD_BYTES, data
