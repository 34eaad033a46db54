"""Memories: vectors with payloads and scopes, searched through an :class:`~kalos.index.Index`.

The index holds vectors, ids and the scope of every item as three int64 codes (tenant, user,
session); this store interns scope strings into those codes (0 = unset) and keeps payloads by
id. It is used by one thread at a time: the sidecar serialises dispatch.

A memory may also have token ids (int32, kept as little-endian bytes), so that a recall
hands its text to the model without tokenizing on the request path: given with the add, or
made from a text payload at add time by the sidecar's tokenizer (``--tokenizer``). A
memory without them (bytes or no payload, no tokenizer) still has its payload.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kalos.errors import InvalidRequest
from kalos.filters import Node
from kalos.index import Index
from kalos.index.base import scope_mask
from kalos.index.rows import RowTable
from kalos.protocol import codes
from kalos.protocol import layout as L
from kalos.protocol.codes import check_k, check_nprobe
from kalos.stores.batch import SearchBatch
from kalos.stores.device_columns import DeviceColumns
from kalos.stores.gpu_searcher import GpuSearcher
from kalos.stores.limits import Limits, check_size
from kalos.stores.metadata import MetadataTable
from kalos.types import Scope

if TYPE_CHECKING:
    from kalos.stores.sessions import Tokenizer


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

    def rows(self) -> list[tuple[int, str, int]]:
        """Every interned name as (field 0..2, name, code), for a snapshot."""
        return [(i, name, code) for i, t in enumerate(self._tables) for name, code in t.items()]

    def load(self, rows: list[tuple[int, str, int]]) -> None:
        """Replaces every table with ``rows`` as :meth:`rows` returned them."""
        self._tables = ({}, {}, {})
        for field, name, code in rows:
            self._tables[field][name] = code

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

    def __init__(
        self,
        index: Index,
        limits: Limits | None = None,
        tokenizer: Tokenizer | None = None,
        gpu: GpuSearcher | None = None,
    ) -> None:
        self.index = index
        self.limits = limits or Limits()
        self.tokenizer = tokenizer  # text payloads added without token ids get them from it
        # Per-tenant limits (items, bytes), accounted only when one is set.
        self._max_items = limits.tenant_max_items if limits is not None else None
        self._max_bytes = limits.tenant_max_bytes if limits is not None else None
        self._quota = self._max_items is not None or self._max_bytes is not None
        self._tenant_items: dict[int, int] = {}  # tenant code -> items
        self._tenant_bytes: dict[int, int] = {}  # tenant code -> vector + payload bytes
        # a cuda index's searches (the sidecar's hook: kalos.server.gpu_search.GpuSearch)
        self.gpu: GpuSearcher | None = gpu
        self.scopes = ScopeCodes()
        self._payloads: dict[int, tuple[int, bytes]] = {}
        self._payload_bytes = 0
        self._tokens: dict[int, bytes] = {}  # id -> its token ids, int32 little-endian bytes
        self._token_bytes = 0
        # The scope codes of every item again, apart from the index (whose backends differ):
        # forget(scope) finds the ids of a user or session here, with one vectorised mask.
        self._scoped = RowTable()
        # Metadata and string ids, and their filter columns (kalos.stores.metadata).
        self.metadata = MetadataTable()
        # their mirror on the index's device, for an index with a filter_device (made at the
        # first filtered search there)
        self._device_columns: DeviceColumns | None = None

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
        # A finite sum of squares means every value is finite (NaN and inf propagate); only
        # when it is not (or it overflowed) does the exact check run. Half the cost of
        # isfinite().all() on a query.
        if not math.isfinite(np.vdot(vectors, vectors)) and not np.isfinite(vectors).all():
            raise InvalidRequest(f"{what} contains NaN or inf")

    def add(
        self,
        ids: np.ndarray,
        vectors: np.ndarray,
        kinds: np.ndarray,
        offsets: np.ndarray,
        blob: np.ndarray,
        scope: Scope,
        tokens: list[np.ndarray | None] | None = None,
        meta: list[dict[str, Any] | None] | None = None,
        keys: list[str | None] | None = None,
    ) -> tuple[int, int]:
        """Upserts items; returns (new items, replaced items). Payloads are copied out.

        ``tokens``: per item its token ids (int32 [m]), or None: a text payload is tokenized
        by the store's tokenizer when it has one, else the item has no token ids. An item
        replaced by an upsert loses its old token ids. ``meta``: per item its metadata dict
        (or None); ``keys``: per item its string id (or None); an upsert replaces both.
        Conflict when a string id's 63-bit id belongs to another string id.
        """
        self.check_vectors(vectors, "a vector")
        if bool((ids == -1).any()):
            raise InvalidRequest("id -1 is reserved for 'no result'")
        n = len(ids)
        id_list = ids.tolist()
        self.metadata.check_keys(id_list, keys)
        token_bytes = self._token_bytes_of(kinds, offsets, blob, tokens, n)
        scopes = np.broadcast_to(self.scopes.intern(scope), (n, 3))
        unique = np.unique(ids)
        if self._quota:
            token_lens = np.array([0 if b is None else len(b) for b in token_bytes], np.int64)
            if meta is not None or keys is not None:  # metadata counts as its JSON
                token_lens += np.array(
                    [
                        meta_size(
                            None if meta is None else meta[i], None if keys is None else keys[i]
                        )
                        for i in range(n)
                    ],
                    np.int64,
                )
            self._check_tenant(
                scope, int(scopes[0, 0]) if n else 0, ids, unique, offsets, token_lens
            )
            self._tally(unique, -1)
        before = len(self.index)
        self.index.add(vectors, ids, scopes)
        added = len(self.index) - before
        # one scope for the whole batch: duplicates agree
        self._scoped.upsert(unique, np.broadcast_to(scopes[0], (len(unique), 3)))
        payloads = self._payloads
        bounds = offsets.tolist()
        data = blob.tobytes() if bounds[-1] else b""
        token_map = self._tokens
        for i, (item, kind) in enumerate(zip(ids.tolist(), kinds.tolist(), strict=False)):
            old = payloads.pop(item, None)
            if old is not None:
                self._payload_bytes -= len(old[1])
            if kind != codes.PAYLOAD_NONE:
                value = data[bounds[i] : bounds[i + 1]]
                payloads[item] = (kind, value)
                self._payload_bytes += len(value)
            old_tokens = token_map.pop(item, None)
            if old_tokens is not None:
                self._token_bytes -= len(old_tokens)
            ids_i = token_bytes[i]
            if ids_i is not None:
                token_map[item] = ids_i
                self._token_bytes += len(ids_i)
        self.metadata.upsert(id_list, meta, keys)
        if self._quota:
            self._tally(unique, 1)
        return added, n - added

    def _token_bytes_of(
        self,
        kinds: np.ndarray,
        offsets: np.ndarray,
        blob: np.ndarray,
        tokens: list[np.ndarray | None] | None,
        n: int,
    ) -> list[bytes | None]:
        """Each item's token ids as int32 little-endian bytes, or None; checked (ids >= 0, at
        most ``--max-turn-tokens``) before anything changes."""
        out: list[bytes | None] = [None] * n
        tokenize = self.tokenizer
        text = codes.PAYLOAD_TEXT
        kind_list = kinds.tolist()
        bounds = offsets.tolist() if tokenize is not None else []
        for i in range(n):
            given = None if tokens is None else tokens[i]
            if given is not None:
                if len(given) and int(given.min()) < 0:
                    raise InvalidRequest(f"token ids must be >= 0 (item {i})")
                ids_i = given
            elif tokenize is not None and kind_list[i] == text:
                ids_i = tokenize(blob[bounds[i] : bounds[i + 1]].tobytes().decode())
            else:
                continue
            check_size(f"item {i}'s token ids", len(ids_i), self.limits.max_turn_tokens,
                       "tokens", "--max-turn-tokens")  # fmt: skip
            out[i] = np.ascontiguousarray(ids_i, "<i4").tobytes()
        return out

    def token_ids(self, ids: np.ndarray) -> list[bytes]:
        """The token ids of each of ``ids`` (int32 little-endian bytes; b"" for none or -1)."""
        get = self._tokens.get
        return [get(item, b"") for item in ids.reshape(-1).tolist()]

    def _usage(self, ids: np.ndarray) -> tuple[list[int], list[int]]:
        """Tenant code and bytes (vector + payload + token ids + metadata and string id as
        JSON) of each of ``ids`` that is present."""
        rows = self._scoped.rows_of(ids)
        present = rows >= 0
        tenants = self._scoped.scope_columns[0, rows[present]].tolist()
        vector = 4 * self.index.dim
        get = self._payloads.get
        none = (codes.PAYLOAD_NONE, b"")
        tokens = self._tokens.get
        metas, names = self.metadata.meta.get, self.metadata.keys.get
        sizes = [
            vector + len(get(item, none)[1]) + len(tokens(item, b""))
            + meta_size(metas(item), names(item))
            for item in ids[present].tolist()
        ]  # fmt: skip
        return tenants, sizes

    def _tally(self, ids: np.ndarray, sign: int) -> None:
        """Adds (sign 1) or takes away (-1) the present ``ids`` from their tenants' usage."""
        items, nbytes = self._tenant_items, self._tenant_bytes
        for tenant, size in zip(*self._usage(ids), strict=True):
            if tenant:
                items[tenant] = items.get(tenant, 0) + sign
                nbytes[tenant] = nbytes.get(tenant, 0) + sign * size

    def _check_tenant(
        self, scope: Scope, tenant: int, ids: np.ndarray, unique: np.ndarray,
        offsets: np.ndarray, token_lens: np.ndarray,
    ) -> None:  # fmt: skip
        """InvalidRequest naming the flag when an add would take ``tenant`` over a limit."""
        if not tenant:
            return  # items without a tenant are not limited
        tenants, sizes = self._usage(unique)
        mine = [size for t, size in zip(tenants, sizes, strict=True) if t == tenant]
        items = self._tenant_items.get(tenant, 0) + len(unique) - len(mine)
        if self._max_items is not None and items > self._max_items:
            raise InvalidRequest(
                f"tenant {scope.tenant!r} would hold {items} items; the limit is "
                f"{self._max_items} (kalos serve --tenant-max-items)"
            )
        if self._max_bytes is not None:
            # the last occurrence of an id in the batch is the one that stays
            last = len(ids) - 1 - np.unique(ids[::-1], return_index=True)[1]
            sizes_in = (
                np.diff(offsets).astype(np.int64)[last] + token_lens[last] + 4 * self.index.dim
            )
            total = self._tenant_bytes.get(tenant, 0) - sum(mine) + int(sizes_in.sum())
            if total > self._max_bytes:
                raise InvalidRequest(
                    f"tenant {scope.tenant!r} would hold {total} bytes; the limit is "
                    f"{self._max_bytes} (kalos serve --tenant-max-bytes)"
                )

    def remove(self, ids: np.ndarray) -> int:
        if self._quota:
            self._tally(np.unique(ids), -1)
        removed = self.index.remove(ids)
        self._scoped.remove(ids)
        id_list = ids.tolist()
        self.metadata.remove(id_list)
        for item in id_list:
            old = self._payloads.pop(item, None)
            if old is not None:
                self._payload_bytes -= len(old[1])
            old_tokens = self._tokens.pop(item, None)
            if old_tokens is not None:
                self._token_bytes -= len(old_tokens)
        return removed

    def search(
        self,
        queries: np.ndarray,
        k: int,
        scope: Scope | None,
        out: tuple[np.ndarray, np.ndarray] | None = None,
        pinned: Any = None,
        where: Node | None = None,
        nprobe: int = 0,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Top-k, exact unless the index is approximate: (scores [nq, k] f32, ids [nq, k] i64;
        -1 where fewer matched). ``nprobe``: lists an approximate (IVF) index probes for this
        search (0: its own setting; exact indexes ignore it).

        With ``out`` (two such arrays, e.g. views into a response) the results are written
        there and ``out`` is returned; on a GPU index whose ``pinned`` arena holds ``out``, by
        the search kernel itself (:class:`~kalos.server.gpu_search.PinnedArena`). Without,
        on a GPU index the arrays are views into pinned staging memory, valid until the next
        search. ``where``: a metadata filter (kalos.filters); the top-k of its matches only.
        """
        self.check_vectors(queries, "the query")
        check_k(k)
        nprobe = check_nprobe(nprobe)
        allow = None
        if where is not None:
            allow = self._allowed(where)
        elif self.gpu is not None:  # an exact GPU index: nprobe does not apply
            return self.gpu.search(queries, k, self.scopes.filter(scope), out, pinned)
        filt = self.scopes.filter(scope)
        if nprobe:
            scores, ids = self.index.search(queries, k, scope=filt, allow=allow, nprobe=nprobe)
        else:
            scores, ids = self.index.search(queries, k, scope=filt, allow=allow)
        if out is None:
            return scores, ids
        out[0][...] = scores
        out[1][...] = ids
        return out

    def _allowed(self, where: Node) -> Any:
        """The ids a search filtered by ``where`` may return, evaluated where the index lives:
        on the host (ids [m] int64) for an index there; for an index on a device (its
        ``filter_device``), there, from a mirror of the metadata columns that uploads what
        changed since the last filtered search (a device tensor of ids)."""
        device = getattr(self.index, "filter_device", None)
        if device is None:
            return self.metadata.matching(where)
        mirror = self._device_columns
        if mirror is None or mirror.device != device:
            mirror = self._device_columns = DeviceColumns(self.metadata, device)
        return mirror.matching(where)

    def search_many(
        self,
        members: Sequence[tuple[np.ndarray, int, Scope | None]],
        nprobes: Sequence[int] | None = None,
    ) -> list[tuple[np.ndarray, np.ndarray] | Exception]:
        """Several searches in one pass over the index (the sidecar's dynamic batching),
        each ``(queries [nq, dim], k, scope)``; returns, in order, each one's ``(scores, ids)``
        as :meth:`search` would (arrays owned by the caller), or the exception that search
        alone would have raised: a bad member fails only itself. On a CPU index one BLAS
        product serves the batch (:meth:`Index.search_many`); on a GPU index the members of
        one scope filter share one batched kernel call, at the largest of their k, and each
        keeps its own first k (the same top-k: the ranking is the same). ``nprobes``: each
        member's probe count, as :meth:`search`'s ``nprobe`` (None: the index's own); an
        approximate index takes one pass per distinct count."""
        return self.start_search_many(members, nprobes)[0]()

    def start_search_many(
        self,
        members: Sequence[tuple[np.ndarray, int, Scope | None]],
        nprobes: Sequence[int] | None = None,
    ) -> tuple[Callable[[], list[tuple[np.ndarray, np.ndarray] | Exception]],
               Callable[[], bool] | None]:  # fmt: skip
        """:meth:`search_many`, with a GPU index's last batched call left running: returns
        what gives the answers (waiting for that call) and, while that call runs, what says
        whether it is done (None: nothing runs). While it runs, nothing else may use the GPU
        or change the store: the caller holds the dispatch lock until it has the answers.
        Elsewhere (a CPU index, a call that cannot run ahead) the answers are there when
        this returns. (:meth:`batch` takes the members one at a time.)"""
        batch = self.batch()
        for i, (queries, k, scope) in enumerate(members):
            batch.add(queries, k, scope, nprobes[i] if nprobes else 0)
        done = batch.start()
        return batch.results, done

    def batch(self) -> SearchBatch:
        """An empty :class:`~kalos.stores.batch.SearchBatch` of this store: searches taken one
        at a time, then answered by one pass (the sidecar's dynamic batching)."""
        return SearchBatch(self)

    def search_alone(
        self, queries: np.ndarray, k: int, filt: tuple[int, int, int] | None, nprobe: int = 0
    ) -> tuple[np.ndarray, np.ndarray]:
        """A checked search by its scope filter's codes (:meth:`ScopeCodes.filter`), with
        answers the caller owns: a batch's member searched on its own."""
        if self.gpu is not None:
            scores, ids = self.gpu.search(queries, k, filt)
            return scores.copy(), ids.copy()  # GPU staging is reused: own them
        return self.index.search(queries, k, scope=filt, nprobe=nprobe)

    def search_to_device(
        self, buffer: Any, queries: np.ndarray | None, nq: int, k: int,
        scope: Scope | None,
    ) -> None:  # fmt: skip
        """Exact top-k into a channel's GPU result buffer (GPU index only). ``queries`` None:
        the client put them in the buffer's query slots (not checked for NaN: they never
        reach the host)."""
        if self.gpu is None:
            raise InvalidRequest(
                "GPU results need a sidecar whose exact index is on a GPU (cuda:flat)"
            )
        if queries is not None:
            self.check_vectors(queries, "the query")
        check_k(k)
        if not 1 <= nq <= self.gpu.max_batch or nq * k > L.GPU_MAX_HITS:
            raise InvalidRequest(
                f"a GPU-result search takes 1..{self.gpu.max_batch} queries and at most "
                f"{L.GPU_MAX_HITS} results, got {nq} x {k}"
            )
        self.gpu.search_to_device(buffer, queries, nq, k, self.scopes.filter(scope))

    def payloads(self, ids: np.ndarray) -> list[tuple[int, bytes]]:
        """(kind, bytes) of each id, in order; (PAYLOAD_NONE, b"") for none or -1."""
        none = (codes.PAYLOAD_NONE, b"")
        get = self._payloads.get
        return [get(item, none) for item in ids.reshape(-1).tolist()]

    def ids_in_scope(self, scope: Scope) -> np.ndarray:
        """ids [m] int64 of every item whose scope matches ``scope`` (each field given equals
        the item's), in no particular order; every id when ``scope`` gives no field."""
        codes = self.scopes.filter(scope)
        table = self._scoped
        if codes is None:
            return table.ids.copy()
        if NO_MATCH in codes:
            return np.empty(0, np.int64)
        return table.ids[scope_mask(table.scope_columns, codes)]

    def forget(self, scope: Scope, where: Node | None = None) -> int:
        """Removes every item matching ``scope`` (vectors, payloads) and, when given, the
        metadata filter ``where``; returns how many."""
        ids = self.ids_in_scope(scope)
        if where is not None:
            ids = np.intersect1d(ids, self.metadata.matching(where), assume_unique=True)
        return self.remove(ids)

    def entries(self, ids: np.ndarray) -> bytes:
        """JSON ``[[string id or null, metadata or null], ...]`` of each of ``ids`` (row-major;
        nulls for -1 and for none)."""
        return json.dumps(self.metadata.entries(ids.reshape(-1).tolist())).encode()

    def present(self, ids: np.ndarray, scope: Scope | None = None) -> np.ndarray:
        """The ones of ``ids`` [n] that are stored and match ``scope``, in order (first
        occurrences)."""
        _, first = np.unique(ids, return_index=True)
        ids = ids[np.sort(first)]
        rows = self._scoped.rows_of(ids)
        keep = rows >= 0
        ids, rows = ids[keep], rows[keep]
        codes = self.scopes.filter(scope)
        if codes is not None and len(ids):
            if NO_MATCH in codes:
                return ids[:0]
            ids = ids[scope_mask(self._scoped.scope_columns[:, rows], codes)]
        return ids

    # -- snapshots ---------------------------------------------------------------------------

    def snapshot(self, db: sqlite3.Connection, directory: str) -> None:
        """Writes every item: vectors, ids and scope codes as flat ``memories_*.npy`` files in
        ``directory`` (index order), payloads, token ids and the scope-name tables into ``db``
        (tables ``memory_payloads``, ``memory_tokens`` and ``memory_scopes``). Does not
        commit.

        Payloads go to SQLite rather than flat files: measured for 1M short payloads on the
        CI VM, reading them back into the store takes 0.7 s from SQLite, 0.9 s from flat files.
        """
        ids, vectors, scopes = self.index.dump()  # [n] i64, [n, dim] f32, [n, 3] i64
        np.save(os.path.join(directory, "memories_ids.npy"), ids)
        np.save(os.path.join(directory, "memories_vectors.npy"), vectors)
        np.save(os.path.join(directory, "memories_scopes.npy"), scopes)
        db.execute("DROP TABLE IF EXISTS memory_payloads")
        db.execute("DROP TABLE IF EXISTS memory_scopes")
        db.execute("DROP TABLE IF EXISTS memory_tokens")
        db.execute("DROP TABLE IF EXISTS memory_meta")
        db.execute("CREATE TABLE memory_tokens (id INTEGER PRIMARY KEY, tokens BLOB NOT NULL)")
        db.execute("CREATE TABLE memory_meta (id INTEGER PRIMARY KEY, key TEXT, meta TEXT)")
        db.execute(
            "CREATE TABLE memory_payloads (id INTEGER PRIMARY KEY, kind INTEGER NOT NULL, "
            "value BLOB NOT NULL)"
        )
        db.execute(
            "CREATE TABLE memory_scopes (field INTEGER NOT NULL, name TEXT NOT NULL, "
            "code INTEGER NOT NULL, PRIMARY KEY (field, name))"
        )
        db.executemany(
            "INSERT INTO memory_payloads VALUES (?, ?, ?)",
            ((item, kind, value) for item, (kind, value) in self._payloads.items()),
        )
        db.executemany("INSERT INTO memory_scopes VALUES (?, ?, ?)", self.scopes.rows())
        db.executemany("INSERT INTO memory_tokens VALUES (?, ?)", self._tokens.items())
        table = self.metadata
        with_meta = set(table.meta) | set(table.keys)
        db.executemany(
            "INSERT INTO memory_meta VALUES (?, ?, ?)",
            ((item, table.keys.get(item), _dump_meta(table.meta.get(item))) for item in with_meta),
        )

    def restore(self, db: sqlite3.Connection, directory: str) -> None:
        """Replaces every item with those of a :meth:`snapshot` in ``db`` and ``directory``."""
        ids = np.load(os.path.join(directory, "memories_ids.npy"))
        vectors = np.load(os.path.join(directory, "memories_vectors.npy"))
        scopes = np.load(os.path.join(directory, "memories_scopes.npy"))
        self.index.reset()
        if len(ids):
            self.index.add(vectors, ids, scopes)
        del vectors
        self._scoped = RowTable()
        self._scoped.upsert(ids, scopes)
        self.scopes.load(db.execute("SELECT field, name, code FROM memory_scopes").fetchall())
        self._payloads = {
            item: (kind, value)
            for item, kind, value in db.execute("SELECT id, kind, value FROM memory_payloads")
        }
        self._payload_bytes = sum(len(v) for _, v in self._payloads.values())
        has_tokens = db.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'memory_tokens'"
        ).fetchone()  # snapshots of older versions have no token ids
        self._tokens = (
            {item: bytes(t) for item, t in db.execute("SELECT id, tokens FROM memory_tokens")}
            if has_tokens
            else {}
        )
        self._token_bytes = sum(len(t) for t in self._tokens.values())
        self.metadata.reset()
        has_meta = db.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'memory_meta'"
        ).fetchone()  # snapshots of older versions have no metadata
        stored: dict[int, tuple[str | None, str | None]] = (
            {item: (key, meta) for item, key, meta in db.execute("SELECT * FROM memory_meta")}
            if has_meta
            else {}
        )
        all_ids = ids.tolist()
        none: tuple[str | None, str | None] = (None, None)
        rows = [stored.get(item, none) for item in all_ids]
        self.metadata.upsert(
            all_ids, [None if m is None else json.loads(m) for _, m in rows], [k for k, _ in rows]
        )
        self._tenant_items, self._tenant_bytes = {}, {}
        if self._quota:
            self._tally(self._scoped.ids.copy(), 1)

    def stats(self) -> dict[str, int | str]:
        return {
            "items": len(self.index),
            "index": self.index.spec,
            "index_bytes": int(self.index.nbytes),
            "payload_bytes": self._payload_bytes,
            "memory_token_bytes": self._token_bytes,
            "metadata_items": len(self.metadata.meta),
            "metadata_keys": self.metadata.n_keys,
            "string_ids": len(self.metadata.keys),
        }


def meta_size(meta: dict[str, Any] | None, key: str | None) -> int:
    """Bytes an item's metadata and string id count for the tenant limits: their JSON."""
    size = 0 if meta is None else len(json.dumps(meta).encode())
    return size if key is None else size + len(key.encode())


def _dump_meta(meta: dict[str, Any] | None) -> str | None:
    return None if meta is None else json.dumps(meta)
