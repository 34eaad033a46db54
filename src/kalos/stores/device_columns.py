"""A device mirror of the metadata columns, for a store whose index lives on a GPU: a filter
is evaluated there, into a slot mask and then the allowed ids, without leaving the device.

Per metadata key the mirror holds the host table's (:mod:`kalos.stores.metadata`) kind [cap]
int8, num [cap] float64 and code [cap] int64 as torch tensors on the index's device, and the
slot -> id array [cap] int64 (-1: a free slot). It is synchronised lazily: once a mirror
exists, each write notes the slots it changed, per column
(:class:`~kalos.stores.metadata.SlotChanges`), and the next filtered search uploads those
slots only: 17 bytes per key the write touched (kind 1, num 8, code 8) and 8 for a slot whose
item changed (a new or removed memory: its id), plus an 8-byte slot index per slot for the
writes to scattered slots (the first slot written and the appends after it go as one range,
without indices). Past 4096 scattered slots of one column the upload is their whole span.
Grown capacity copies on the device (the new slots hold the defaults on both sides); a new
key starts from the defaults and uploads its noted slots; the first sync, and the first
after a reset of the table, uploads everything once. A sync visits only the keys that
changed (:meth:`MetadataTable.take_changed
<kalos.stores.metadata.MetadataTable.take_changed>`), so its host time does not grow with
the number of keys.

A condition runs the host table's own logic (:meth:`Column.condition
<kalos.stores.metadata.Column.condition>`) with torch arrays: its host operands (the codes of
the strings a comparison keeps, the slots of a list element) go to the device per search,
the rest is elementwise there; the filter tree is :func:`kalos.filters.evaluate`'s.

torch is imported when a mirror is made (an index on a GPU), never by importing this module.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kalos.filters import Cond, Node, evaluate
from kalos.stores.metadata import MetadataTable, SlotChanges

# an isin over at most this many values is a chain of comparisons with scalars (two launches a
# value, no upload); over more, the values are uploaded (a copy the host waits for) for one
# isin. Not measured yet: a launch and a small upload cost about the same order of time.
_SCALAR_ISIN = 2
_NO_SLOTS = np.empty(0, np.int64)


class _TorchOps:
    """:class:`~kalos.stores.metadata.ArrayOps` over torch tensors on one device."""

    def __init__(self, torch: Any, device: Any) -> None:
        self._torch = torch
        self._device = device

    def zeros(self, n: int) -> Any:
        return self._torch.zeros(n, dtype=self._torch.bool, device=self._device)

    def ones(self, n: int) -> Any:
        return self._torch.ones(n, dtype=self._torch.bool, device=self._device)

    def isin(self, a: Any, values: np.ndarray) -> Any:
        if values.size <= _SCALAR_ISIN:
            out = self.zeros(a.shape[0])
            for v in values.tolist():
                out |= a == v
            return out
        return self._torch.isin(a, self._upload(values).to(a.dtype))

    def rows(self, slots: np.ndarray, n: int) -> Any:
        out = self.zeros(n)
        out[self._upload(slots)] = True
        return out

    def _upload(self, host: np.ndarray) -> Any:
        return self._torch.from_numpy(np.ascontiguousarray(host)).to(self._device)


class DeviceColumns:
    """The device mirror of one :class:`~kalos.stores.metadata.MetadataTable` (see the module
    doc); a :class:`~kalos.filters.ColumnSource` of torch bool masks. Used by one thread at a
    time, as the store is."""

    def __init__(self, table: MetadataTable, device: Any) -> None:
        import torch

        self._torch = torch
        self.table = table
        table.track_changes()
        self.device = torch.device(device)
        self._ops = _TorchOps(torch, self.device)
        self._generation = -1  # the table's generation last uploaded (-1: none yet)
        self._cap = 0
        self._ids: Any = None  # [cap] int64: the item in each slot, -1 free
        self._columns: dict[str, tuple[Any, Any, Any]] = {}  # key -> kind, num, code [cap]
        self.uploaded_bytes = 0  # host -> device bytes of column data and slot indices, so far

    # -- synchronisation ---------------------------------------------------------------------

    def sync(self) -> None:
        """Uploads what changed in the table since the last sync (everything, the first
        time and after a reset)."""
        table = self.table
        full = table.generation != self._generation
        if full:
            self._generation = table.generation
            self._cap, self._ids, self._columns = 0, None, {}
        if full or table.capacity != self._cap:
            self._grow(table.capacity)
        n = table.used
        self._apply(table.id_changes, (table.slot_ids,), (self._ids,), full, n)
        changed = table.take_changed()
        for name in table.columns if full else changed:
            column = table.columns[name]
            arrays = self._columns.get(name)
            if arrays is None:
                arrays = self._columns[name] = self._defaults(self._cap)
            self._apply(column.changes, column.arrays, arrays, full, n)

    def _defaults(self, cap: int) -> tuple[Any, Any, Any]:
        torch, dev = self._torch, self.device
        return (
            torch.zeros(cap, dtype=torch.int8, device=dev),
            torch.zeros(cap, dtype=torch.float64, device=dev),
            torch.full((cap,), -1, dtype=torch.int64, device=dev),
        )

    def _grow(self, cap: int) -> None:
        """Reallocates every array at ``cap`` slots: the old ones copied on the device, the
        new slots at their defaults (the host's are too)."""
        torch, old = self._torch, self._cap
        ids = torch.full((cap,), -1, dtype=torch.int64, device=self.device)
        if self._ids is not None:
            ids[:old] = self._ids[:old]
        self._ids = ids
        for name, arrays in self._columns.items():
            grown = self._defaults(cap)
            for new, now in zip(grown, arrays, strict=True):
                new[:old] = now[:old]
            self._columns[name] = grown
        self._cap = cap

    def _apply(
        self,
        changes: SlotChanges | None,
        host: tuple[np.ndarray, ...],
        dev: tuple[Any, ...],
        full: bool,
        n: int,
    ) -> None:
        """Copies the changed slots of ``host`` arrays into the ``dev`` ones."""
        lo, hi, slots = (0, 0, _NO_SLOTS) if changes is None else changes.take()
        if full or changes is None:  # everything (None: the table noted nothing)
            lo, hi, slots = 0, n, _NO_SLOTS
        torch = self._torch
        if lo < hi:
            for h, d in zip(host, dev, strict=True):
                d[lo:hi].copy_(torch.from_numpy(h[lo:hi]))
                self.uploaded_bytes += (hi - lo) * h.itemsize
        if slots.size:
            index = torch.from_numpy(slots).to(self.device)
            self.uploaded_bytes += slots.nbytes
            for h, d in zip(host, dev, strict=True):
                d.index_copy_(0, index, torch.from_numpy(h[slots]).to(self.device))
                self.uploaded_bytes += slots.size * h.itemsize

    # -- reads -------------------------------------------------------------------------------

    @property
    def slot_ids(self) -> Any:
        """[capacity] int64 on the device: the item in each slot, as of the last sync."""
        return self._ids

    def arrays(self, key: str) -> tuple[Any, Any, Any]:
        """(kind, num, code), each [capacity] on the device, of ``key``, as of the last sync."""
        return self._columns[key]

    def condition(self, cond: Cond, n: int) -> Any:
        column = self.table.columns.get(cond.key)
        if column is None:
            return self._ops.zeros(n)
        return column.condition(cond, n, self._columns[cond.key], self._ops)

    def everything(self, n: int) -> Any:
        return self._ops.ones(n)

    def mask(self, node: Node) -> Any:
        """The [used] bool tensor of the slots whose item matches ``node`` (free slots
        included: see :meth:`matching`), after a :meth:`sync`."""
        self.sync()
        return evaluate(node, self, self.table.used)

    def matching(self, node: Node) -> Any:
        """ids [m] int64 on the device of the items whose metadata matches ``node``, in slot
        order: the device twin of :meth:`MetadataTable.matching
        <kalos.stores.metadata.MetadataTable.matching>`."""
        mask = self.mask(node)
        ids = self._ids[: self.table.used]
        return ids[mask & (ids >= 0)]


__all__ = ["DeviceColumns"]
