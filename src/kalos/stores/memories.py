"""Memories: vectors with payloads and scopes, searched through an :class:`~kalos.index.Index`.

The index holds vectors, ids and the scope of every item as three int64 codes (tenant, user,
session); this store interns scope strings into those codes (0 = unset) and keeps payloads by
id. It is used by one thread at a time: the sidecar serialises dispatch.
"""

from __future__ import annotations

import numpy as np

from kalos.errors import InvalidRequest
from kalos.index import Index
from kalos.protocol import codes
from kalos.protocol.messages import Scope

NO_MATCH = -1  # a filter code that no item carries: a scope name never seen


class ScopeCodes:
    """Interns tenant, user and session names into positive int64 codes, one table each."""

    def __init__(self) -> None:
        self._tables: tuple[dict[str, int], dict[str, int], dict[str, int]] = ({}, {}, {})

    def intern(self, scope: Scope) -> np.ndarray:
        """Codes of an item's scope, assigning new codes to new names. [3] int64."""
        out = np.zeros(3, np.int64)
        for i, name in enumerate(scope):
            if name:
                table = self._tables[i]
                out[i] = table.setdefault(name, len(table) + 1)
        return out

    def filter(self, scope: Scope | None) -> tuple[int, int, int] | None:
        """The index filter for a search scope (None: no filter; NO_MATCH: unknown name)."""
        if scope is None or not any(scope):
            return None
        codes = [0, 0, 0]
        for i, name in enumerate(scope):
            if name:
                codes[i] = self._tables[i].get(name, NO_MATCH)
        return codes[0], codes[1], codes[2]


class MemoryStore:
    """Memory items (id, vector, payload, scope) over one vector index."""

    def __init__(self, index: Index) -> None:
        self.index = index
        self.scopes = ScopeCodes()
        self._payloads: dict[int, tuple[int, bytes]] = {}
        self._payload_bytes = 0

    def __len__(self) -> int:
        return len(self.index)

    @property
    def dim(self) -> int:
        return self.index.dim

    def check_vectors(self, vectors: np.ndarray, what: str) -> None:
        """InvalidRequest unless ``vectors`` is [n, dim] and finite."""
        if vectors.ndim != 2 or vectors.shape[1] != self.index.dim:
            got = vectors.shape[-1] if vectors.ndim else 0
            raise InvalidRequest(f"{what} has dimension {got}; this sidecar's index has {self.dim}")
        if not np.isfinite(vectors).all():
            raise InvalidRequest(f"{what} contains NaN or inf")

    def add(
        self,
        ids: np.ndarray,
        vectors: np.ndarray,
        kinds: np.ndarray,
        offsets: np.ndarray,
        blob: np.ndarray,
        scope: Scope,
    ) -> tuple[int, int]:
        """Upserts items; returns (new items, replaced items). Payloads are copied out."""
        self.check_vectors(vectors, "a vector")
        if bool((ids == -1).any()):
            raise InvalidRequest("id -1 is reserved for 'no result'")
        n = len(ids)
        scopes = np.broadcast_to(self.scopes.intern(scope), (n, 3))
        before = len(self.index)
        self.index.add(vectors, ids, scopes)
        added = len(self.index) - before
        payloads = self._payloads
        bounds = offsets.tolist()
        data = blob.tobytes() if bounds[-1] else b""
        for i, (item, kind) in enumerate(zip(ids.tolist(), kinds.tolist(), strict=False)):
            old = payloads.pop(item, None)
            if old is not None:
                self._payload_bytes -= len(old[1])
            if kind != codes.PAYLOAD_NONE:
                value = data[bounds[i] : bounds[i + 1]]
                payloads[item] = (kind, value)
                self._payload_bytes += len(value)
        return added, n - added

    def remove(self, ids: np.ndarray) -> int:
        removed = self.index.remove(ids)
        for item in ids.tolist():
            old = self._payloads.pop(item, None)
            if old is not None:
                self._payload_bytes -= len(old[1])
        return removed

    def search(
        self, queries: np.ndarray, k: int, scope: Scope | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Exact top-k: (scores [nq, k] f32, ids [nq, k] i64; -1 where fewer matched)."""
        self.check_vectors(queries, "the query")
        if not 1 <= k <= codes.MAX_K:
            raise InvalidRequest(f"k must be between 1 and {codes.MAX_K}, got {k}")
        return self.index.search(queries, k, scope=self.scopes.filter(scope))

    def payloads(self, ids: np.ndarray) -> list[tuple[int, bytes]]:
        """(kind, bytes) of each id, in order; (PAYLOAD_NONE, b"") for none or -1."""
        none = (codes.PAYLOAD_NONE, b"")
        get = self._payloads.get
        return [get(item, none) for item in ids.reshape(-1).tolist()]

    def stats(self) -> dict[str, int | str]:
        return {
            "items": len(self.index),
            "index": self.index.spec,
            "index_bytes": int(self.index.nbytes),
            "payload_bytes": self._payload_bytes,
        }
