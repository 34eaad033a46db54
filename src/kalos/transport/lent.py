"""What a sidecar lends a client beside a channel: :class:`Lent`.

A shm handshake may hand the client more shared memory than the channel it moves requests
through: the sidecar's token heap (CONTEXT answers refer to token ids in it), its session
index (the client computes CONTEXT windows itself) and, on a cuda sidecar, the channel's GPU
result buffer. They are one object, returned by the handshake beside the transport and held
by the client beside it; the transport itself only moves requests. Over uds, grpc and the
in-process transport nothing is lent: :data:`NOTHING`.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from kalos import _native
from kalos.shm import channel as L
from kalos.shm.session_index import IndexReader, map_session_index
from kalos.shm.token_heap import map_token_heap

if TYPE_CHECKING:
    from kalos.gpu.handoff import GpuChannel

# A window read from the session index is served only while the sidecar's heartbeat (every
# heartbeat_ms / 2, 50 ms by default) is younger than this: after a crash, at most this long.
LOCAL_READ_BEAT_NS = 250_000_000

_monotonic_ns = time.monotonic_ns
_time_ns = time.time_ns
_load = _native.load_acquire
_READY = L.STATE_READY

__all__ = ["LOCAL_READ_BEAT_NS", "NOTHING", "Lent", "map_session_index", "map_token_heap"]


class Lent:
    """The regions one channel's handshake lent: closed together, by :meth:`close`.

    ``heap``: the sidecar's token heap, mapped read-only (int32), or None. ``sessions``: its
    session index (:class:`kalos.shm.session_index.IndexReader`), or None; only with a
    heap. ``gpu``: the channel's GPU result buffer (:class:`kalos.gpu.handoff.GpuChannel`)
    when GPU results were asked for, else None. ``control`` and ``channel``: views of the
    channel's control segment and channel segment, where a window computed here checks the
    sidecar's heartbeat and state and stores its view mark (needed with ``sessions``).
    ``over``: the transport they were lent with, kept until this is released, so that a
    channel dropped without close gives its GPU buffer back before its socket closes (the
    sidecar takes the regions back when it does).
    """

    __slots__ = (
        "__weakref__", "_beat", "_closed", "_keep", "_over", "_pid", "_state", "_view", "gpu",
        "heap", "sessions",
    )  # fmt: skip

    def __init__(
        self,
        heap: np.ndarray | None = None,
        sessions: IndexReader | None = None,
        gpu: GpuChannel | None = None,
        *,
        control: np.ndarray | None = None,
        channel: np.ndarray | None = None,
        over: Any = None,
    ) -> None:
        self.heap = heap
        self.sessions = sessions if heap is not None else None
        self.gpu = gpu
        self._over = over
        self._closed = False
        self._pid = os.getpid()  # in a fork's child, the regions stay the parent's
        # The views keep both segments mapped while this holds their addresses.
        self._keep = (control, channel)
        if self.sessions is not None and control is not None and channel is not None:
            c = control.ctypes.data
            self._beat = c + L.CTRL_HEARTBEAT_NS
            self._state = c + L.CTRL_STATE
            self._view = channel.ctypes.data + L.CHAN_CLIENT_VIEW  # the view mark
        else:
            self.sessions = None
            self._beat = self._state = self._view = 0

    def context_local(
        self, session: bytes, max_tokens: int, max_turns: int, tenant: Any, user: Any
    ) -> tuple[np.ndarray, int] | None:
        """A CONTEXT window (token ids only) computed in this process from the sidecar's
        session index, without a request: (a read-only view of its ids in the token heap,
        valid until the channel's next call; its turns), or None when the sidecar must
        answer (no index was lent, or the index cannot answer for certain)."""
        index = self.sessions
        heap = self.heap
        if index is None or heap is None or self._closed:
            return None
        beat = _load(self._beat)
        if _monotonic_ns() - beat > LOCAL_READ_BEAT_NS or _load(self._state) != _READY:
            return None  # perhaps gone, or stopping: the request path finds out
        got = index.read(session, max_tokens, max_turns, tenant, user, _time_ns(), self._view)
        if got is None:
            return None
        at, n, turns = got
        return heap[at : at + n], turns

    def close(self) -> None:
        """Gives the regions back: unmaps the GPU buffer; the heap's and the index's mappings
        go with the last view of them (views handed out stay readable). Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.gpu is not None:
                self.gpu.close()
        finally:
            self.gpu = None
            self.heap = None
            self.sessions = None
            self._keep = (None, None)
            self._beat = self._state = self._view = 0
            self._over = None

    def __del__(self) -> None:
        # Dropped without close (its thread ended): the GPU buffer is unmapped before the
        # transport it holds (``over``) closes its socket. Not in a fork's child (as
        # Transport.__del__): the regions are the parent's.
        if self._pid != os.getpid():
            return
        try:  # noqa: SIM105 - at interpreter exit the module's globals (contextlib) may be gone
            self.close()
        except Exception:
            pass


NOTHING = Lent()
"""What a channel that maps nothing beside itself has been lent (uds, grpc, inproc)."""
