"""The session index: what a client needs to find a CONTEXT window without asking the sidecar.

A CONTEXT over shm costs one round trip through the sidecar, and on a small machine that
round trip needs two CPUs at once: the client's and the sidecar's. A client that maps the
token heap (kalos.stores.token_heap) already holds every heap-resident session's token ids;
this index adds, for each such session, where its ids lie and where its newest turns end.
The client then computes the window itself, marks the region it will view in its channel,
checks that nothing changed meanwhile (a seqlock per slot) and returns a read-only view of
the heap: one CPU, no request, no copy (``Client.context``, docs/PROTOCOL.md section 5d).
The sidecar stays the one writer and the authority: whenever the index cannot answer for
certain (a session it does not hold, a slot being written, a window older than the slot's
newest turns, a session with a system prompt or outside the heap, a sidecar whose heartbeat
is stale) the client asks the sidecar, which answers as always, NotFound included.

Layout: one memfd per sidecar (``kalos-session-index``), mapped read-write by the sidecar,
handed to shm clients that ask at the handshake as a read-only descriptor. A 64-byte header
(:data:`HEADER`), then ``slots`` slots of ``SLOT_BYTES`` (an open-addressing hash table on
the CRC-32 of the session id, linear probing, tombstones for deleted sessions):

====== ======== ===============================================================
offset field    meaning
====== ======== ===============================================================
0      u64 seq  even: stable; odd: the sidecar is writing the slot
8      u32      state: 0 empty (ends a probe), 1 live, 2 deleted (probing goes on)
12     u32      CRC-32 of the session id
16     i64      expiry, wall-clock ns since the epoch (INT64_MAX: none)
24     i64      token offset of the session's heap region
32     u32 m    turn ends held (1..RING): the newest m, oldest first
36     u32      flags: 1 the ends reach the oldest live turn; 2 tenant set; 4 user set
40     u16 x 3  bytes of the session id, the tenant, the user
64     bytes    the session id, then the tenant, then the user (KEY_BYTES in all)
256    u32[m]   turn ends: token offsets in the region, the last one the session's end
====== ======== ===============================================================

A session is held when its ids are in the heap, it has no system prompt (its ids live apart)
and its id, tenant and user fit ``KEY_BYTES``; any other session has no slot. The window rule
is :meth:`SessionStore.context`'s: the newest turns whose ids fit the budget, at most
``max_turns``, a contiguous suffix.

Why the view is safe (valid until the client's next call on that channel): ids in a region
are never rewritten while it is allocated (kalos.stores.token_heap). The sidecar marks a
session's slot (odd ``seq``, then a full fence) before any change of that session that may
free its region (:meth:`SessionIndex.begin`, :meth:`SessionIndex.remove`), and the heap frees
a region only once no channel's view mark names it (:meth:`TokenHeap.free` reads the marks
after that fence). The client stores its mark, fences, then reads ``seq`` again: either it
sees the slot changed and does not use the window, or the sidecar sees its mark and keeps
the region until the client's next window moves the mark (Dekker's pattern: both sides
store, fence, load). Writes run under the dispatch lock, like the stores.
"""

from __future__ import annotations

import struct
import zlib
from bisect import bisect_left
from typing import Any, Protocol

import numpy as np

from kalos import _native
from kalos.errors import ConfigError
from kalos.transport.memory import ReadOnlyShared

MAGIC = b"KSIX"
VERSION = 1
HEADER = struct.Struct("<4sIIIII")  # magic, version, slots, ring, slot bytes, key bytes
HEADER_BYTES = 64
RING = 128  # turn ends per slot: windows of up to RING - 1 turns are served locally
KEY_BYTES = 192
SLOT_HEAD = 64
ENDS_AT = SLOT_HEAD + KEY_BYTES
SLOT_BYTES = ENDS_AT + 4 * RING  # 768
FIELDS = struct.Struct("<IIqqIIHHH")  # state .. user length, from offset 8
EMPTY, LIVE, DELETED = 0, 1, 2
COMPLETE, HAS_TENANT, HAS_USER = 1, 2, 4
NO_EXPIRY = (1 << 63) - 1
MAX_PROBE = 64  # slots a lookup reads before it gives up (the sidecar answers then)
MAX_LOAD = 0.75  # live and deleted slots over all: above it the table is rebuilt

_load = _native.load_acquire
_store = _native.store_release
_fence = _native.fence
_unpack_fields = FIELDS.unpack_from
_crc32 = zlib.crc32


def index_bytes(slots: int) -> int:
    """The memfd's size for ``slots`` slots."""
    return HEADER_BYTES + slots * SLOT_BYTES


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


class IndexReader:
    """A client's read-only view of a sidecar's session index and token heap."""

    def __init__(self, mem: Any, heap: np.ndarray) -> None:  # heap: the token heap, int32
        buf = np.frombuffer(mem, np.uint8)
        magic, version, slots, ring, slot_bytes, key_bytes = HEADER.unpack_from(buf, 0)
        if (magic, version, ring, slot_bytes, key_bytes) != (
            MAGIC, VERSION, RING, SLOT_BYTES, KEY_BYTES,
        ):  # fmt: skip
            raise ValueError("the session index's header does not match this client")
        if len(buf) < index_bytes(slots) or slots & (slots - 1):
            raise ValueError("the session index is smaller than its header says")
        self.slots = slots
        self._buf = buf
        self._mv = memoryview(mem)
        self._addr = buf.ctypes.data
        self._heap_len = len(heap)

    def read(
        self,
        name: bytes,
        max_tokens: int,
        max_turns: int,
        tenant: bytes | None,
        user: bytes | None,
        now_ns: int,
        mark: int,
    ) -> tuple[int, int, int] | None:
        """The window of session ``name``: (the token offset of its ids in the heap, their
        count, its turns), or None when the index cannot answer for certain (the sidecar
        must). ``tenant``/``user``: the scope's (bytes), None for any. ``now_ns``: the wall
        clock (expiry). ``mark``: the address of the channel's view mark (u64), where the
        region of the answer is stored before the slot is checked again; the ids stay as
        they are until the mark moves (see the module docstring)."""
        h = _crc32(name)
        mask = self.slots - 1
        mv = self._mv
        addr = self._addr
        nl = len(name)
        for p in range(MAX_PROBE):
            at = HEADER_BYTES + ((h + p) & mask) * SLOT_BYTES
            seq = _load(addr + at)
            if seq & 1:
                return None  # being written: ask the sidecar
            state, crc, expires, tok_at, m, flags, ln, lt, lu = _unpack_fields(mv, at + 8)
            if state == EMPTY:
                return None  # not held (unknown, or a session the index cannot hold)
            k = at + SLOT_HEAD
            if state != LIVE or crc != h or ln != nl or mv[k : k + nl] != name:
                continue
            if expires <= now_ns or not 0 < m <= RING:
                return None
            if tenant is not None and (
                not flags & HAS_TENANT or mv[k + ln : k + ln + lt] != tenant
            ):
                return None
            if user is not None and (
                not flags & HAS_USER or mv[k + ln + lt : k + ln + lt + lu] != user
            ):
                return None
            ends = mv[at + ENDS_AT : at + ENDS_AT + 4 * m].cast("I")
            end = ends[m - 1]
            first = bisect_left(ends, end - max_tokens, 0, m - 1)
            if m - 1 - first >= max_turns:  # exact: the window has at least max_turns turns
                first = m - 1 - max_turns
            elif first == 0 and not flags & COMPLETE:
                # the window may reach turns older than the slot holds (or zero-id turns
                # before its first end, when that end is the budget's bound exactly)
                return None
            lo = ends[first]
            if lo > end or tok_at < 0 or tok_at + end > self._heap_len:
                return None  # torn: the seq check would say so too
            _store(mark, tok_at + 1)
            _fence()  # the mark is visible before seq is read again (and every read above done)
            if _load(addr + at) != seq:
                return None  # changed meanwhile: the region may be freed and reused
            return tok_at + lo, end - lo, m - 1 - first
        return None
