"""Shared memory made from a memfd: the mapping, its uint8 view and its base address.

The sidecar creates each segment with :func:`create`, hands the descriptor to the client over
the handshake socket (SCM_RIGHTS) and both map it with :class:`SharedMemory`. The base address
feeds :mod:`kalos._native`, which orders the sequence words; everything else is read and
written through the numpy view.
"""

from __future__ import annotations

import mmap
import os

import numpy as np


def create(name: str, size: int) -> int:
    """A new anonymous shared-memory file of ``size`` zero bytes (no /dev/shm name)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
    except OSError:
        os.close(fd)
        raise
    return fd


class SharedMemory:
    """A mapping of the memfd ``fd`` (which it does not close) of ``size`` bytes."""

    def __init__(self, fd: int, size: int) -> None:
        self.size = size
        self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.buf = np.frombuffer(self._mmap, dtype=np.uint8)  # the whole segment
        self.addr: int = self.buf.ctypes.data

    def close(self) -> None:
        """Drops this object's references; the mapping goes when the last view is gone.

        Views handed to callers (search results) keep the memory mapped, so a caller holding
        one after close never reads unmapped memory.
        """
        self.buf = np.empty(0, np.uint8)
        self.addr = 0


class ReadOnlyShared(SharedMemory):
    """A new memfd of ``size`` zero bytes (named ``name``, for /proc only), mapped read-write
    here and handed to clients as :attr:`reader_fd`: the same file reopened read-only, so that
    they cannot map it writable (mmap PROT_WRITE of a MAP_SHARED mapping needs a writable
    descriptor). The sidecar's token heap and session index."""

    def __init__(self, name: str, size: int) -> None:
        self.fd = create(name, size)
        super().__init__(self.fd, size)
        self.reader_fd = os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)

    def close_descriptors(self) -> None:
        """Closes both descriptors; the memory stays mapped here and goes with the last
        mapping (clients keep theirs)."""
        for fd in (self.fd, self.reader_fd):
            if fd >= 0:
                os.close(fd)
        self.fd = self.reader_fd = -1
