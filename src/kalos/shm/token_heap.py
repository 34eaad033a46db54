"""The token heap's layout, and a client's read-only mapping of it.

The token heap holds sessions' token ids in one shared-memory file that clients map
read-only. A CONTEXT over a shm channel then answers with where the window's ids lie in the
heap (byte offset and length) instead of copying them into the response arena, and the client
returns ``np.frombuffer(heap, int32, count, offset)``: no copy on either side.

Layout: one memfd per sidecar (``kalos-token-heap``, like the channels' memfds: no name
under /dev/shm, nothing to clean up after a crash), mapped read-write by the sidecar and
handed to each shm client that asks at its handshake as a read-only descriptor, which the
client maps ``PROT_READ`` (it cannot write to it, nor map it writable). It is int32 token
ids, nothing else; each session's ids are one contiguous region of it, a block of
``2**k`` units of :data:`UNIT_TOKENS` ids. The sidecar's allocator, and the rules that keep a
client's views valid, are :mod:`kalos.stores.token_heap`.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref

import numpy as np

from kalos.errors import ConnectError

UNIT_TOKENS = 256
"""Token ids per allocation unit (1 KiB): the smallest region, a new session's first."""
UNIT_BYTES = 4 * UNIT_TOKENS

_heaps: dict[tuple[int, int], weakref.ref[np.ndarray]] = {}
_heaps_lock = threading.Lock()


def map_token_heap(fd: int, size: int, key: tuple[int, int]) -> np.ndarray:
    """The token heap of the sidecar ``key`` (pid, epoch), mapped read-only, as int32.

    One mapping per sidecar start in this process, shared by its channels (a page a client
    thread touched is mapped for the others too). It lives while a channel or a view of it
    does: views handed out before a reconnect stay readable (the old heap is an unlinked
    memfd: its memory goes with the last mapping)."""
    with _heaps_lock:
        ref = _heaps.get(key)
        heap = ref() if ref is not None else None
        if heap is None or 4 * len(heap) != size:
            if os.fstat(fd).st_size < size:
                raise ConnectError("the sidecar's token heap is smaller than it says")
            heap = np.frombuffer(mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ), np.int32)
            for k in [k for k, r in _heaps.items() if r() is None]:
                del _heaps[k]
            _heaps[key] = weakref.ref(heap)
        return heap
