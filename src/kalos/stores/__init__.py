"""Stores: what the sidecar remembers (memories now; sessions and agent state to come)."""

from kalos.stores.memories import MemoryStore

__all__ = ["MemoryStore"]
