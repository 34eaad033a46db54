"""The session index, the sidecar's side: :class:`SessionIndex` publishes each heap-resident
session's region and turn ends, so that a shm client computes CONTEXT windows itself.

The byte layout, the rules that make a client's window safe, and the client's reader are
:mod:`kalos.shm.session_index` (re-exported here). The index is a memfd
(``kalos-session-index``) mapped read-write here and handed to shm clients that ask at the
handshake as a read-only descriptor. Writes run under the dispatch lock, like the stores.
"""

from __future__ import annotations

import struct
import zlib
from typing import Protocol

import numpy as np

from kalos import _native
from kalos.errors import ConfigError
from kalos.shm.memory import ReadOnlyShared
from kalos.shm.session_index import (
    COMPLETE,
    DELETED,
    EMPTY,
    ENDS_AT,
    FIELDS,
    HAS_TENANT,
    HAS_USER,
    HEADER,
    HEADER_BYTES,
    KEY_BYTES,
    LIVE,
    MAGIC,
    MAX_LOAD,
    MAX_PROBE,
    NO_EXPIRY,
    RING,
    SLOT_BYTES,
    SLOT_HEAD,
    VERSION,
    IndexReader,
    index_bytes,
)

__all__ = [
    "COMPLETE", "DELETED", "EMPTY", "ENDS_AT", "FIELDS", "HAS_TENANT", "HAS_USER", "HEADER",
    "HEADER_BYTES", "KEY_BYTES", "LIVE", "MAGIC", "MAX_LOAD", "MAX_PROBE", "NO_EXPIRY", "RING",
    "SLOT_BYTES", "SLOT_HEAD", "VERSION", "IndexReader", "IndexedSession", "SessionIndex",
    "index_bytes",
]  # fmt: skip

_load = _native.load_acquire
_store = _native.store_release
_fence = _native.fence
_crc32 = zlib.crc32


class IndexedSession(Protocol):
    """What the index reads of a session: :class:`kalos.stores.sessions.Session` is one.

    A protocol rather than an import: the session store writes this index, never the other
    way round.
    """

    @property
    def name(self) -> str: ...
    @property
    def tenant(self) -> str | None: ...
    @property
    def user(self) -> str | None: ...
    @property
    def system(self) -> object | None: ...  # a pinned system prompt: such a session has no slot
    @property
    def tok_at(self) -> int: ...  # token offset of its heap region; -1: not in the heap
    @property
    def tok_cum(self) -> list[int]: ...  # turn ends, token offsets in the region
    @property
    def first(self) -> int: ...  # index in tok_cum of the oldest live turn
    @property
    def expires_at(self) -> float: ...  # wall-clock seconds since the epoch; inf: none


class SessionIndex:
    """The sidecar's side: one writer (under the dispatch lock). ``slots``: a power of two."""

    def __init__(self, slots: int, name: str = "kalos-session-index") -> None:
        if slots < 2 or slots & (slots - 1):
            raise ConfigError(f"the session index takes a power of two >= 2 slots, not {slots}")
        self.slots = slots
        self.nbytes = index_bytes(slots)
        self.mem = ReadOnlyShared(name, self.nbytes)
        buf = self.mem.buf
        HEADER.pack_into(buf, 0, MAGIC, VERSION, slots, RING, SLOT_BYTES, KEY_BYTES)
        self._buf = buf
        self._addr = self.mem.addr
        self._at: dict[str, int] = {}  # session id -> its slot
        self._used = 0  # live and deleted slots
        self.rebuilds = 0

    def reader_fd(self) -> int:
        """A read-only descriptor for clients (they cannot map it writable)."""
        return self.mem.reader_fd

    def __len__(self) -> int:
        return len(self._at)

    def stats(self) -> dict[str, int]:
        """Sessions held (windows clients compute themselves), slots, rebuilds."""
        return {
            "session_index_sessions": len(self._at),
            "session_index_slots": self.slots,
            "session_index_rebuilds": self.rebuilds,
        }

    # -- writes ------------------------------------------------------------------------------

    def begin(self, name: str) -> None:
        """Marks the slot of session ``name`` (if it has one) as being written: before any
        change of that session that may free its heap region; :meth:`put` ends it."""
        at = self._at.get(name)
        if at is not None:
            self._begin(at)

    def put(self, s: IndexedSession) -> None:
        """Publishes session ``s`` as it is now (after any change of it), or removes its slot
        when the index cannot hold it (see the module docstring)."""
        key = _key(s)
        if key is None:
            self.remove(s.name)
            return
        at = self._at.get(s.name)
        if at is None:
            if self._used + 1 > MAX_LOAD * self.slots:
                self._rebuild()
                if len(self._at) + 1 > MAX_LOAD * self.slots:
                    return  # full: the session is served by the sidecar
            at = self._free_slot(_crc32(key[0]))
            if at is None:
                return
            if self._state(at) == EMPTY:
                self._used += 1
            self._at[s.name] = at
        self._write(at, s, key)

    def remove(self, name: str) -> None:
        """Removes the slot of session ``name``, if it has one (before its region is freed)."""
        at = self._at.pop(name, None)
        if at is not None:
            self._set_state(at, DELETED)

    def close(self) -> None:
        """Closes the sidecar's descriptors; the memory goes with the last mapping."""
        self.mem.close_descriptors()

    def _slot(self, i: int) -> int:
        return HEADER_BYTES + i * SLOT_BYTES

    def _state(self, at: int) -> int:
        return int(struct.unpack_from("<I", self._buf, at + 8)[0])

    def _set_state(self, at: int, state: int) -> None:
        """Rewrites the state of the slot at ``at`` alone, under its seqlock."""
        seq = self._begin(at)
        struct.pack_into("<I", self._buf, at + 8, state)
        _store(self._addr + at, seq + 1)

    def _free_slot(self, h: int) -> int | None:
        """The first empty or deleted slot on ``h``'s probe, or None within MAX_PROBE."""
        mask = self.slots - 1
        for p in range(MAX_PROBE):
            at = self._slot((h + p) & mask)
            if self._state(at) != LIVE:
                return at
        return None

    def _begin(self, at: int) -> int:
        """Marks the slot at ``at`` as being written (odd seq, kept when it is already);
        returns that odd seq."""
        seq = int(_load(self._addr + at))
        if not seq & 1:
            seq += 1
            _store(self._addr + at, seq)
        # the odd seq is visible before any of the slot's new bytes, and before the heap
        # reads the channels' view marks (TokenHeap.free)
        _fence()
        return seq

    def _write(self, at: int, s: IndexedSession, key: tuple[bytes, bytes, bytes, int]) -> None:
        name, tenant, user, flags = key
        cum = s.tok_cum
        n = len(cum) - 1
        m = min(n - s.first + 1, RING)
        if m == n - s.first + 1:
            flags |= COMPLETE
        # (never raises: the session has changed already; a TTL beyond 2262 is none)
        expires = NO_EXPIRY if s.expires_at * 1e9 >= NO_EXPIRY else int(s.expires_at * 1e9)
        buf = self._buf
        seq = self._begin(at)
        FIELDS.pack_into(
            buf, at + 8, LIVE, _crc32(name), expires, s.tok_at, m, flags,
            len(name), len(tenant), len(user),
        )  # fmt: skip
        k = name + tenant + user
        buf[at + SLOT_HEAD : at + SLOT_HEAD + len(k)] = np.frombuffer(k, np.uint8)
        ends = buf[at + ENDS_AT : at + ENDS_AT + 4 * m].view(np.uint32)
        ends[:] = cum[n - m + 1 : n + 1]
        _store(self._addr + at, seq + 1)

    def _rebuild(self) -> None:
        """Drops the deleted slots: every live session is written again into a fresh probe
        order. Clients reading meanwhile may miss a session (they ask the sidecar then)."""
        self.rebuilds += 1
        # every live slot past its seq word (its state LIVE, its fields), before any moves
        live = [(name, bytes(self._buf[at + 8 : at + SLOT_BYTES])) for name, at in self._at.items()]
        for i in range(self.slots):
            at = self._slot(i)
            if self._state(at) != EMPTY:
                self._set_state(at, EMPTY)
        self._at.clear()
        self._used = 0
        for name, image in live:
            to = self._free_slot(struct.unpack_from("<I", image, 4)[0])  # its CRC
            if to is None:
                continue
            seq = self._begin(to)
            self._buf[to + 8 : to + SLOT_BYTES] = np.frombuffer(image, np.uint8)
            _store(self._addr + to, seq + 1)
            self._at[name] = to
            self._used += 1


def _key(s: IndexedSession) -> tuple[bytes, bytes, bytes, int] | None:
    """(session id, tenant, user, flags) of a session the index can hold, else None."""
    if s.tok_at < 0 or s.system is not None:
        return None
    name = s.name.encode()
    tenant = s.tenant.encode() if s.tenant is not None else b""
    user = s.user.encode() if s.user is not None else b""
    if len(name) + len(tenant) + len(user) > KEY_BYTES:
        return None
    flags = (HAS_TENANT if s.tenant is not None else 0) | (HAS_USER if s.user is not None else 0)
    return name, tenant, user, flags
