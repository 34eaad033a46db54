"""The session index's byte layout, and a client's reader of it: what a client needs to find a
CONTEXT window without asking the sidecar. The sidecar's writer is
:class:`kalos.stores.session_index.SessionIndex`.

A CONTEXT over shm costs one round trip through the sidecar, and on a small machine that
round trip needs two CPUs at once: the client's and the sidecar's. A client that maps the
token heap (kalos.shm.token_heap) already holds every heap-resident session's token ids;
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
is the session store's (``SessionStore.context``): the newest turns whose ids fit the budget,
at most ``max_turns``, a contiguous suffix.

Why the view is safe (valid until the client's next call on that channel): ids in a region
are never rewritten while it is allocated (kalos.shm.token_heap). The sidecar marks a
session's slot (odd ``seq``, then a full fence) before any change of that session that may
free its region (``SessionIndex.begin``, ``SessionIndex.remove``), and the heap frees
a region only once no channel's view mark names it (``TokenHeap.free`` reads the marks
after that fence). The client stores its mark, fences, then reads ``seq`` again: either it
sees the slot changed and does not use the window, or the sidecar sees its mark and keeps
the region until the client's next window moves the mark (Dekker's pattern: both sides
store, fence, load). Writes run under the dispatch lock, like the stores.
"""

from __future__ import annotations

import mmap
import os
import struct
import zlib
from bisect import bisect_left
from typing import Any

import numpy as np

from kalos import _native
from kalos.errors import ConnectError

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


def map_session_index(fd: int, size: int, heap: np.ndarray) -> IndexReader:
    """The sidecar's session index from its descriptor ``fd``, mapped read-only, over the
    token heap ``heap`` (:func:`kalos.shm.token_heap.map_token_heap`). Raises ConnectError
    when it is smaller than ``size`` or its header does not match."""
    if os.fstat(fd).st_size < size:
        raise ConnectError("the sidecar's session index is smaller than it says")
    try:
        return IndexReader(mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ), heap)
    except ValueError as exc:
        raise ConnectError(str(exc)) from None
