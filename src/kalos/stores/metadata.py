"""Per-item metadata and string ids of the memory store, kept as columns for filtering.

Every item of the store holds a **slot**: a row of each column, assigned when the item is
first added and freed when it is removed (a freed slot is reused; slots never move, so no
column is ever rewritten on a removal). A column per metadata key holds, per slot, the
value's kind (none, str, number, bool, list), its number as float64 and its string as an
int64 code (strings are interned per key); a list's elements go into an inverted map from
element to the slots holding it. So a filter (:mod:`kalos.filters`) evaluates to a bool mask
over the slots with numpy operations per condition, never with Python per row: a string
comparison other than equality runs over the key's distinct strings, then one ``np.isin``.

A condition's logic (:meth:`Column.condition`) is written once over an array-ops shim
(:class:`ArrayOps`): numpy here, torch in the device mirror of a store whose index is on a
GPU (:mod:`kalos.stores.device_columns`), which uploads only the slots each write changed
(:class:`SlotChanges`, kept per column and for the slot -> id array once a mirror exists:
:meth:`MetadataTable.track_changes`; before that, writes note nothing).

The item's metadata dict itself is kept as given (returned by search and lookup, written to
snapshots); the columns are rebuilt from it on restore.

String ids: a caller's string id maps onto the 63-bit int64 id :func:`key_id` (the first 8
bytes of its BLAKE2b digest, top bit cleared), computed by the client; the store keeps the
string per id and refuses, with :class:`~kalos.errors.Conflict`, a string whose id already
belongs to another string.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import numpy as np

from kalos.errors import Conflict, InvalidRequest
from kalos.filters import Cond, Node, evaluate, family, key_id
from kalos.index.rows import grown_capacity

_NONE, _STR, _NUM, _BOOL, _LIST = 0, 1, 2, 3, 4
_KIND = {"s": _STR, "n": _NUM, "b": _BOOL}
# single slots a SlotChanges keeps apart before it folds them into its range
_SINGLE_SLOTS = 4096


def _element(value: object) -> tuple[str, object] | None:
    fam = family(value)
    if fam is None:
        return None
    return (fam, float(value) if fam == "n" else value)  # type: ignore[arg-type]


class SlotChanges:
    """The slots of one column (or of the slot -> id array) written since :meth:`take` last
    ran: a range ``[lo, hi)`` (the first slot written, and the appends after it) and a set of
    single slots, folded into the range past 4096 so it stays small. A device mirror
    (kalos.stores.device_columns) takes them to upload what changed, and only that."""

    def __init__(self) -> None:
        self.lo = self.hi = 0
        self.slots: set[int] = set()

    def mark(self, slot: int) -> None:
        lo, hi = self.lo, self.hi
        if lo <= slot < hi:
            return
        if lo == hi:  # nothing yet: a range of one
            self.lo, self.hi = slot, slot + 1
            return
        if slot == hi:  # the next slot: an append
            self.hi = hi + 1
            return
        slots = self.slots
        slots.add(slot)
        if len(slots) > _SINGLE_SLOTS:
            self.mark_range(min(slots), max(slots) + 1)
            slots.clear()

    def mark_range(self, lo: int, hi: int) -> None:
        if self.lo < self.hi:
            lo, hi = min(lo, self.lo), max(hi, self.hi)
        self.lo, self.hi = lo, hi

    def take(self) -> tuple[int, int, np.ndarray]:
        """(lo, hi, single slots [m] int64) written since the last take; forgets them."""
        slots = np.fromiter(self.slots, np.int64, len(self.slots))
        out = self.lo, self.hi, slots
        self.lo = self.hi = 0
        self.slots = set()
        return out


class ArrayOps(Protocol):
    """The elementwise side of a condition, over the arrays that hold the columns: numpy on
    the host (:data:`HOST`), torch on a device (kalos.stores.device_columns). The operands
    come from the host (``values``, ``slots``: numpy); comparisons and ``& | ~`` are the
    arrays' own operators."""

    def zeros(self, n: int) -> Any: ...

    def ones(self, n: int) -> Any: ...

    def isin(self, a: Any, values: np.ndarray) -> Any: ...

    def rows(self, slots: np.ndarray, n: int) -> Any:
        """The [n] bool mask that is true at ``slots`` (each < n)."""
        ...


class _NumpyOps:
    def zeros(self, n: int) -> np.ndarray:
        return np.zeros(n, bool)

    def ones(self, n: int) -> np.ndarray:
        return np.ones(n, bool)

    def isin(self, a: np.ndarray, values: np.ndarray) -> np.ndarray:
        return np.isin(a, values)

    def rows(self, slots: np.ndarray, n: int) -> np.ndarray:
        out = np.zeros(n, bool)
        out[slots] = True
        return out


HOST: ArrayOps = _NumpyOps()


class Column:
    """One metadata key over the slots: kind [cap] i8, num [cap] f64, code [cap] i64 (on the
    host), the key's strings and its lists' inverted map, and the slots written since a
    device mirror last looked (:attr:`changes`, once the table tracks them)."""

    def __init__(self, capacity: int, tracked: bool = False) -> None:
        self.kind = np.zeros(capacity, np.int8)
        self.num = np.zeros(capacity, np.float64)
        self.code = np.full(capacity, -1, np.int64)
        self.strings: dict[str, int] = {}
        self.names: list[str] = []
        self.elements: dict[tuple[str, object], set[int]] = {}
        self.slot_elements: dict[int, list[tuple[str, object]]] = {}
        self.changes = SlotChanges() if tracked else None

    @property
    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(kind, num, code), each [capacity]."""
        return self.kind, self.num, self.code

    def grow(self, capacity: int) -> None:
        old = self.kind.shape[0]
        for name, fill in (("kind", 0), ("num", 0.0), ("code", -1)):
            arr = getattr(self, name)
            new = np.full(capacity, fill, arr.dtype)
            new[:old] = arr
            setattr(self, name, new)

    def set(self, slot: int, value: object) -> None:
        self.clear(slot)
        if isinstance(value, list):
            self.kind[slot] = _LIST
            elems = [e for e in map(_element, value) if e is not None]
            self.slot_elements[slot] = elems
            for e in elems:
                self.elements.setdefault(e, set()).add(slot)
            return
        fam = family(value)
        if fam is None:
            return
        self.kind[slot] = _KIND[fam]
        if isinstance(value, str):
            code = self.strings.get(value)
            if code is None:
                code = self.strings[value] = len(self.names)
                self.names.append(value)
            self.code[slot] = code
        else:
            self.num[slot] = float(value)  # type: ignore[arg-type]

    def clear(self, slot: int) -> None:
        if self.changes is not None:  # set() clears first: this marks every write
            self.changes.mark(slot)
        if self.kind[slot] == _LIST:
            for e in self.slot_elements.pop(slot, ()):
                holders = self.elements.get(e)
                if holders is not None:
                    holders.discard(slot)
                    if not holders:
                        del self.elements[e]
        self.kind[slot] = _NONE
        self.code[slot] = -1

    def _codes_where(self, keep: Any) -> np.ndarray:
        """Codes of the distinct strings for which ``keep(name)`` holds."""
        return np.array([c for c, s in enumerate(self.names) if keep(s)], np.int64)

    def condition(
        self, cond: Cond, n: int, arrays: tuple[Any, Any, Any] | None = None, ops: ArrayOps = HOST
    ) -> Any:
        """The [n] bool mask of the slots ``cond`` holds for. The operands (string codes, the
        slots of a list element) come from the host state here; the elementwise work runs
        on ``arrays`` (kind, num, code; the host's own when None) through ``ops``."""
        kind, num, code = self.arrays if arrays is None else arrays
        kind, num, code = kind[:n], num[:n], code[:n]
        op, want = cond.op, cond.value
        if op == "contains":
            elem = _element(want)
            holders = self.elements.get(elem) if elem is not None else None
            if holders:
                out = ops.rows(np.fromiter(holders, np.int64, len(holders)), n)
            else:
                out = ops.zeros(n)
            if isinstance(want, str):
                codes = self._codes_where(lambda s: want in s)
                out |= (kind == _STR) & ops.isin(code, codes)
            return out
        if op in ("in", "nin"):
            kinds = {_KIND[str(family(v))] for v in want}
            right_kind = ops.isin(kind, np.array(sorted(kinds), np.int8))
            strs = [v for v in want if isinstance(v, str)]
            hit = ops.zeros(n)
            if strs:
                codes = np.array([self.strings.get(s, -2) for s in strs], np.int64)
                hit |= (kind == _STR) & ops.isin(code, codes)
            for kind_code, fam in ((_NUM, "n"), (_BOOL, "b")):
                vals = [float(v) for v in want if family(v) == fam]
                if vals:
                    hit |= (kind == kind_code) & ops.isin(num, np.array(vals, np.float64))
            return hit if op == "in" else right_kind & ~hit
        same = kind == _KIND[str(family(want))]
        if isinstance(want, str):
            if op in ("eq", "ne"):
                equal = code == self.strings.get(want, -2)
                return same & (equal if op == "eq" else ~equal)
            cmp = _ORDER[op]
            return same & ops.isin(code, self._codes_where(lambda s: cmp(s, want)))
        value = float(want)
        if op == "eq":
            return same & (num == value)
        if op == "ne":
            return same & (num != value)
        return same & _ORDER[op](num, value)


# the same comparison for a str pair, a number pair and an array against a number
_ORDER = {"gt": operator.gt, "gte": operator.ge, "lt": operator.lt, "lte": operator.le}


class MetadataTable:
    """Metadata dicts and string ids by item id, and their filter columns over slots."""

    def __init__(self) -> None:
        self.generation = -1
        self.tracking = False  # whether writes note what they change: track_changes
        self.reset()

    def reset(self) -> None:
        # bumped on every reset: a device mirror of an older generation uploads everything
        self.generation += 1
        # slots whose id (slot_ids) changed, and the keys whose columns did, when tracking
        self.id_changes: SlotChanges | None = SlotChanges() if self.tracking else None
        self.changed_keys: set[str] = set()
        self._slot_of: dict[int, int] = {}
        self._ids = np.full(0, -1, np.int64)  # [capacity]: the item in each slot, -1 free
        self._free: list[int] = []
        self._used = 0  # slots 0.._used-1 were ever handed out
        self._columns: dict[str, Column] = {}
        self.meta: dict[int, dict[str, Any]] = {}
        self.keys: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self._slot_of)

    @property
    def n_keys(self) -> int:
        """Metadata keys ever seen (each has its columns)."""
        return len(self._columns)

    @property
    def capacity(self) -> int:
        """Slots allocated in every column."""
        return int(self._ids.shape[0])

    @property
    def used(self) -> int:
        """Slots ever handed out: a filter's mask covers slots ``[0, used)``."""
        return self._used

    @property
    def slot_ids(self) -> np.ndarray:
        """[capacity] int64: the item in each slot, -1 where free (a view; do not write)."""
        return self._ids

    @property
    def columns(self) -> Mapping[str, Column]:
        """Each metadata key's columns (a view; do not write)."""
        return self._columns

    # -- writes ------------------------------------------------------------------------------

    def check_keys(self, ids: Iterable[int], keys: list[str | None] | None) -> None:
        """InvalidRequest for a key whose id is not :func:`key_id` of it; Conflict for a key
        whose id belongs to another key (stored, or earlier in the batch). Changes nothing."""
        if keys is None:
            return
        seen: dict[int, str] = {}
        for item, key in zip(ids, keys, strict=True):
            if key is None:
                continue
            if not isinstance(key, str):
                raise InvalidRequest(f"a string id must be a str, got {type(key).__name__}")
            if key_id(key) != item:
                raise InvalidRequest(f"string id {key!r} does not map to id {item}")
            other = seen.get(item, self.keys.get(item))
            if other is not None and other != key:
                raise Conflict(
                    f"string ids {other!r} and {key!r} map to the same 63-bit id {item}; "
                    "use another string"
                )
            seen[item] = key

    def upsert(
        self,
        ids: list[int],
        meta: list[dict[str, Any] | None] | None,
        keys: list[str | None] | None,
    ) -> None:
        """Places (or replaces) each item's metadata and string id; the last of an id wins."""
        if meta is None and keys is None:
            self._upsert_plain(ids)
            return
        tracking = self.tracking
        for i, item in enumerate(ids):
            slot = self._slot_of.get(item)
            if slot is None:
                slot = self._new_slot(item)
            m = None if meta is None else meta[i]
            old = self.meta.pop(item, None)
            if old:
                if tracking:
                    self.changed_keys.update(old)
                for name in old:
                    self._columns[name].clear(slot)
            if m:
                self.meta[item] = m
                if tracking:
                    self.changed_keys.update(m)
                for name, value in m.items():
                    column = self._columns.get(name)
                    if column is None:
                        column = self._columns[name] = Column(self._ids.shape[0], tracking)
                    column.set(slot, value)
            key = None if keys is None else keys[i]
            if key is None:
                self.keys.pop(item, None)
            else:
                self.keys[item] = key

    def _upsert_plain(self, ids: list[int]) -> None:
        """Items without metadata or string id (a plain add): slots for the new ones in bulk,
        and whatever the others had cleared."""
        slot_of = self._slot_of
        fresh = list(dict.fromkeys(i for i in ids if i not in slot_of))
        for item in ids:
            if item in self.meta or item in self.keys:
                self.remove([item])
                if item not in fresh:
                    fresh.append(item)
        reuse = min(len(self._free), len(fresh))
        for item in fresh[:reuse]:
            self._new_slot(item)
        rest = fresh[reuse:]
        if not rest:
            return
        first = self._used
        self._reserve(first + len(rest))
        self._ids[first : first + len(rest)] = rest
        if self.id_changes is not None:
            self.id_changes.mark_range(first, first + len(rest))
        slot_of.update(zip(rest, range(first, first + len(rest)), strict=True))
        self._used = first + len(rest)

    def _reserve(self, need: int) -> None:
        if need <= self._ids.shape[0]:
            return
        capacity = grown_capacity(self._ids.shape[0], need)
        ids = np.full(capacity, -1, np.int64)
        ids[: self._ids.shape[0]] = self._ids
        self._ids = ids
        for column in self._columns.values():
            column.grow(capacity)

    def _new_slot(self, item: int) -> int:
        if self._free:
            slot = self._free.pop()
        else:
            slot = self._used
            self._used += 1
            self._reserve(slot + 1)
        self._ids[slot] = item
        if self.id_changes is not None:
            self.id_changes.mark(slot)
        self._slot_of[item] = slot
        return slot

    def remove(self, ids: Iterable[int]) -> None:
        for item in ids:
            slot = self._slot_of.pop(item, None)
            if slot is None:
                continue
            old = self.meta.pop(item, None)
            if old:
                if self.tracking:
                    self.changed_keys.update(old)
                for name in old:
                    self._columns[name].clear(slot)
            self.keys.pop(item, None)
            self._ids[slot] = -1
            if self.id_changes is not None:
                self.id_changes.mark(slot)
            self._free.append(slot)

    def track_changes(self) -> None:
        """From now on every write notes the slots and keys it changes (:class:`SlotChanges`,
        :meth:`take_changed`), for the one device mirror of this table, which uploads them.
        Until then writes note nothing (the mirror's first upload is of everything)."""
        if self.tracking:
            return
        self.tracking = True
        self.id_changes = SlotChanges()
        for column in self._columns.values():
            column.changes = SlotChanges()
        self.changed_keys = set()

    def take_changed(self) -> list[str]:
        """The keys whose columns changed since the last call (a device mirror visits those
        only); forgets them."""
        keys = list(self.changed_keys)
        self.changed_keys.clear()
        return keys

    # -- reads -------------------------------------------------------------------------------

    def condition(self, cond: Cond, n: int) -> np.ndarray:
        column = self._columns.get(cond.key)
        if column is None:
            return np.zeros(n, bool)
        return column.condition(cond, n)

    def everything(self, n: int) -> np.ndarray:
        return np.ones(n, bool)

    def matching(self, node: Node) -> np.ndarray:
        """ids [m] int64 of the items whose metadata matches ``node``, in slot order."""
        n = self._used
        mask = evaluate(node, self, n)
        ids = self._ids[:n]
        mask &= ids >= 0
        return ids[mask]

    def entries(self, ids: Iterable[int]) -> list[tuple[str | None, dict[str, Any] | None]]:
        """(string id, metadata) of each id; (None, None) for none or -1."""
        keys, meta = self.keys.get, self.meta.get
        return [(keys(i), meta(i)) for i in ids]


__all__ = ["HOST", "ArrayOps", "Column", "MetadataTable", "SlotChanges", "key_id"]
