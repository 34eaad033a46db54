"""Moved to :mod:`kalos.shm.memory`; this name stays for existing imports."""

from kalos.shm.memory import ReadOnlyShared, SharedMemory, create

__all__ = ["ReadOnlyShared", "SharedMemory", "create"]
