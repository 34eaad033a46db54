"""The token heap: sessions' token ids in one shared-memory file that clients map read-only.
The sidecar's side (the allocator, the readers' pins); the layout and a client's mapping are
:mod:`kalos.shm.token_heap`.

A CONTEXT over a shm channel then answers with where the window's ids lie in the heap
(byte offset and length) instead of copying them into the response arena, and the client
returns ``np.frombuffer(heap, int32, count, offset)``: no copy on either side.

Layout: one memfd per sidecar (``kalos-token-heap``, like the channels' memfds: no name
under /dev/shm, nothing to clean up after a crash), mapped read-write by the sidecar and
handed to each shm client that asks at its handshake as a read-only descriptor, which the
client maps ``PROT_READ`` (it cannot write to it, nor map it writable). Pages cost memory
only once touched. Each session's ids are one contiguous region of it (a block of a buddy
allocator: 2**k units of ``UNIT_TOKENS`` ids); a session that grows moves to a larger region.

The rules that make views safe ("valid until this thread's next call"):

* ids already written in a region are never modified while the region is allocated: appends
  write past the session's end only, and compaction moves the live ids to a new region;
* a region freed (relocation, trim, delete, expiry, forget, a restore) is reused only once no
  reader can still hold a view of it. A reader is a shm channel: each remembers the region
  of its last by-reference response and the request that lent it (:meth:`TokenHeap.lend`);
  its client drops its views when it makes its next call, which the sidecar sees as the
  channel's request count passing the lending request. A freed region that some reader's
  last response points into goes to the quarantine, pinned by those readers, and returns to
  the allocator once each of them has sent a later request or closed. Likewise a region a
  channel's view mark names (:meth:`Reader.viewing`: the region of the last window its client
  computed from the session index, kalos.shm.session_index) stays until the mark moves
  or the channel closes. A region no reader holds is reusable at once. So an idle channel
  pins at most two regions: the one it last read by reference and the one it last viewed.
* while a forked snapshot writer reads the stores (kalos.server.durability), a :meth:`hold`
  pins every region freed meanwhile: the child's image of a shared mapping is not copied on
  write, so a reused region would change under it.

When the heap has no room for a region, the session keeps its ids in private memory and is
served by the copying CONTEXT form, as with ``--token-heap-mb 0``. Used under the dispatch
lock, like the stores; :meth:`attach` and :meth:`detach` come from the listener's threads.
"""

from __future__ import annotations

import threading
from typing import Protocol

import numpy as np

from kalos.errors import ConfigError
from kalos.shm.memory import ReadOnlyShared
from kalos.shm.token_heap import UNIT_BYTES, UNIT_TOKENS

__all__ = [
    "UNIT_BYTES",
    "UNIT_TOKENS",
    "BuddyAllocator",
    "Hold",
    "Reader",
    "TokenHeap",
    "order_for",
]


class Reader(Protocol):
    """What the heap reads of a channel that may hold views of it (a ServerChannel)."""

    requests: int  # requests answered on the channel so far (after each response)
    lent_region: int  # token offset of the region its last by-reference response lent; -1
    lent_request: int  # the number (1-based) of the request that lent it
    closed: bool

    def viewing(self) -> int:
        """The region its client's last window from the session index points into, or -1."""
        ...


class Hold:
    """A pin on every region freed while it is active (a forked snapshot writer)."""

    __slots__ = ("active",)

    def __init__(self) -> None:
        self.active = True

    def release(self) -> None:
        """Safe from any thread: the next allocation sees it."""
        self.active = False


class BuddyAllocator:
    """Blocks of ``2**k`` units out of ``units`` units, by offset in units (buddy system)."""

    def __init__(self, units: int) -> None:
        if units < 1:
            raise ConfigError("a token heap needs at least one unit")
        self.units = units
        self.max_order = units.bit_length() - 1
        self._free: list[set[int]] = [set() for _ in range(self.max_order + 1)]
        self._used: dict[int, int] = {}  # offset -> order
        at = 0
        while at < units:  # the largest aligned blocks that fit, left to right
            k = self.max_order
            while at % (1 << k) or at + (1 << k) > units:
                k -= 1
            self._free[k].add(at)
            at += 1 << k
        self.used_units = 0

    def alloc(self, order: int) -> int:
        """The offset of a free block of ``2**order`` units, or -1 when there is none."""
        if order > self.max_order:
            return -1
        free = self._free
        k = order
        while not free[k]:
            k += 1
            if k > self.max_order:
                return -1
        at = free[k].pop()
        while k > order:  # split: keep the lower half, free the upper
            k -= 1
            free[k].add(at + (1 << k))
        self._used[at] = order
        self.used_units += 1 << order
        return at

    def free(self, at: int) -> None:
        order = self._used.pop(at)
        self.used_units -= 1 << order
        free = self._free
        while order < self.max_order:
            buddy = at ^ (1 << order)
            if buddy not in free[order]:
                break
            free[order].remove(buddy)
            at = min(at, buddy)
            order += 1
        free[order].add(at)

    def order_of(self, at: int) -> int:
        return self._used[at]

    def free_blocks(self) -> list[tuple[int, int]]:
        """(offset, order) of every free block (tests)."""
        return sorted((at, k) for k, blocks in enumerate(self._free) for at in blocks)


def order_for(n_tokens: int) -> int:
    """The smallest order whose block holds ``n_tokens`` ids."""
    units = max(1, -(-n_tokens // UNIT_TOKENS))
    return (units - 1).bit_length()


class TokenHeap:
    """The heap (see the module docstring). ``nbytes``: its size, a multiple of 1 KiB."""

    def __init__(self, nbytes: int, name: str = "kalos-token-heap") -> None:
        if nbytes < UNIT_BYTES or nbytes % UNIT_BYTES:
            raise ConfigError(f"the token heap takes a multiple of {UNIT_BYTES} bytes")
        self.nbytes = nbytes
        self.mem = ReadOnlyShared(name, nbytes)
        self.ids = self.mem.buf.view(np.int32)  # int32 [nbytes / 4], read-write
        self._alloc = BuddyAllocator(nbytes // UNIT_BYTES)
        # Freed regions some reader (or hold) may still see: (token offset, pins, holds).
        self._quarantine: list[tuple[int, list[tuple[Reader, int]], list[Hold]]] = []
        self._holds: list[Hold] = []
        self._readers: tuple[Reader, ...] = ()
        self._readers_lock = threading.Lock()
        self.fallbacks = 0  # regions asked for that the heap had no room for

    # -- readers (shm channels) -------------------------------------------------------------

    def attach(self, reader: Reader) -> None:
        """Registers a channel whose client maps the heap (before it can be lent anything)."""
        reader.lent_region = -1
        reader.lent_request = 0
        reader.closed = False
        with self._readers_lock:
            self._readers = (*self._readers, reader)

    def detach(self, reader: Reader) -> None:
        """The channel closed: it pins nothing any more."""
        reader.closed = True
        with self._readers_lock:
            self._readers = tuple(r for r in self._readers if r is not reader)

    @staticmethod
    def lend(reader: Reader, region: int) -> None:
        """``reader``'s current request answers with ids in ``region`` (by reference)."""
        reader.lent_region = region
        reader.lent_request = reader.requests + 1

    def hold(self) -> Hold:
        """Pins every region freed until the hold is released (see the module docstring)."""
        h = Hold()
        self._holds.append(h)
        return h

    def reader_fd(self) -> int:
        """A read-only descriptor of the heap for clients (they cannot map it writable)."""
        return self.mem.reader_fd

    # -- regions ------------------------------------------------------------------------------

    def alloc(self, n_tokens: int) -> tuple[int, np.ndarray] | None:
        """A region for at least ``n_tokens`` ids: (its token offset, int32 view of all of
        it, a power-of-two multiple of UNIT_TOKENS), or None when the heap has no room."""
        if self._quarantine or self._holds:
            self.reclaim()
        order = order_for(n_tokens)
        at = self._alloc.alloc(order)
        if at < 0:
            self.fallbacks += 1
            return None
        start = at * UNIT_TOKENS
        return start, self.ids[start : start + (UNIT_TOKENS << order)]

    def free(self, region: int) -> None:
        """Gives back the region at token offset ``region``: at once when no reader may hold
        a view of it, else once none may (the quarantine)."""
        pins = [
            (r, r.lent_request)
            for r in self._readers
            if r.lent_region == region and r.requests <= r.lent_request and not r.closed
        ]
        # clients that may view it through a window of their own (kalos.shm.session_index;
        # the session's index slot was marked before this, so either such a client's check of
        # the slot failed or its mark is seen here)
        pins += [(r, -1) for r in self._readers if not r.closed and r.viewing() == region]
        holds = [h for h in self._holds if h.active]
        if pins or holds:
            self._quarantine.append((region, pins, holds))
        else:
            self._alloc.free(region // UNIT_TOKENS)

    def reclaim(self) -> int:
        """Returns every quarantined region no reader or hold pins any more; how many."""
        self._holds = [h for h in self._holds if h.active]
        keep = []
        done = 0
        for entry in self._quarantine:
            _, pins, holds = entry
            if any(h.active for h in holds) or any(
                not r.closed and (r.requests <= req if req >= 0 else r.viewing() == entry[0])
                for r, req in pins
            ):
                keep.append(entry)
            else:
                self._alloc.free(entry[0] // UNIT_TOKENS)
                done += 1
        self._quarantine = keep
        return done

    def stats(self) -> dict[str, int]:
        return {
            "token_heap_bytes": self.nbytes,
            "token_heap_used_bytes": self._alloc.used_units * UNIT_BYTES,
            "token_heap_quarantined": len(self._quarantine),
            "token_heap_fallbacks": self.fallbacks,
        }

    def close(self) -> None:
        """Closes the sidecar's descriptors; the memory goes with the last mapping."""
        self.mem.close_descriptors()
