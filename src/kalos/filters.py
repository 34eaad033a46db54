"""Metadata filters: one Python form (plain dicts, as mem0 writes them), one wire form (the
same dict as UTF-8 JSON), parsed into a small tree and evaluated over columns.

Syntax (docs/FILTERS.md has the whole page)::

    {"user": "ann"}                                 # key equals value
    {"year": {"gte": 2020, "lt": 2025}}             # several operators on one key: all hold
    {"tags": {"contains": "x"}}                     # a list holds x, or a str holds x
    {"lang": {"in": ["en", "fr"]}}
    {"$or": [{"a": 1}, {"b": {"ne": 2}}]}           # also "$and", "$not" (one filter)
    {"AND": [...], "OR": [...], "NOT": {...}}       # mem0's spelling of the same

Operators: ``eq ne gt gte lt lte in nin contains`` (a leading ``$`` is allowed: ``$gte``).
Several keys in one dict are ANDed; an empty dict matches everything.

Semantics, the same wherever a filter is evaluated (the sidecar's column evaluator,
:func:`matches` for one dict, the tests' reference):

* A value is a str, a number (int or float; ``True`` is not a number) or a bool, or a list
  of those. Numbers compare as float64 (ints exactly up to 2**53). Strings compare by code
  point.
* A condition on a missing key, on a stored value that is none of those (None, a dict),
  or on a value of another type than the operand's, is
  **false** — for ``ne`` and ``nin`` too: ``{"a": {"ne": 1}}`` matches an item whose ``a``
  is a number other than 1, not one without ``a`` nor one whose ``a`` is a str.
* ``eq``, ``ne``, ``gt`` .. ``lte``, ``in``, ``nin`` look at a scalar value only (a list
  value fails them); ``contains`` at a list (an element equal to the operand) or a str (the
  operand, a str, is a substring); list elements that are none of those types are ignored.
* ``$not`` is the plain negation of its filter: ``{"$not": {"a": 1}}`` matches an item
  without ``a``.

Limits (:class:`~kalos.errors.InvalidRequest` naming the problem otherwise): a filter's JSON
is at most 16 KiB, nests at most 12 deep and holds at most 512 conditions.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from kalos.errors import InvalidRequest

MAX_FILTER_BYTES = 16 << 10
MAX_DEPTH = 12
MAX_CONDITIONS = 512
OPERATORS = ("eq", "ne", "gt", "gte", "lt", "lte", "in", "nin", "contains")
_LOGIC = {"$and": "and", "and": "and", "AND": "and", "$or": "or", "or": "or", "OR": "or",
          "$not": "not", "not": "not", "NOT": "not"}  # fmt: skip
_ORDERED = ("gt", "gte", "lt", "lte")
_INT_LIMIT = 1 << 1023

Scalar = str | float | bool


@dataclass(frozen=True)
class Cond:
    """One condition: ``key op value``; ``value`` is a scalar, or a tuple for in/nin."""

    key: str
    op: str
    value: Any


@dataclass(frozen=True)
class Logic:
    """``and`` / ``or`` over ``parts``; ``not`` over its one part."""

    op: str
    parts: tuple[Node, ...]


Node = Cond | Logic
MATCH_ALL = Logic("and", ())


def family(value: object) -> str | None:
    """'s' (str), 'n' (int or float, finite), 'b' (bool), or None (not filterable)."""
    if isinstance(value, bool):
        return "b"
    if isinstance(value, str):
        return "s"
    if isinstance(value, int):
        return "n" if -_INT_LIMIT < value < _INT_LIMIT else None  # float64 can hold it
    if isinstance(value, float):
        return "n" if math.isfinite(value) else None
    return None


def _scalar(key: str, op: str, value: object) -> Scalar:
    fam = family(value)
    if fam is None:
        raise InvalidRequest(
            f"filter on {key!r}: {op} takes a str, a number or a bool, got {type(value).__name__}"
        )
    if fam == "n":
        return float(value)  # type: ignore[arg-type]
    return value  # type: ignore[return-value]


def parse(where: object) -> Node:
    """A filter (the Python form, or its JSON as str/bytes) → its tree; InvalidRequest if bad."""
    if isinstance(where, (bytes, bytearray, memoryview, str)):
        raw = bytes(where) if not isinstance(where, str) else where.encode()
        if len(raw) > MAX_FILTER_BYTES:
            raise InvalidRequest(
                f"filter is too large: {len(raw)} bytes of JSON (at most {MAX_FILTER_BYTES})"
            )
        try:
            where = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            raise InvalidRequest(f"filter is not valid JSON: {exc}") from None
    counter = [0]
    return _parse(where, 1, counter)


def _count(counter: list[int]) -> None:
    counter[0] += 1
    if counter[0] > MAX_CONDITIONS:
        raise InvalidRequest(f"filter is too large: more than {MAX_CONDITIONS} conditions")


def _parse(where: object, depth: int, counter: list[int]) -> Node:
    if depth > MAX_DEPTH:
        raise InvalidRequest(f"filter is too deep: more than {MAX_DEPTH} levels of nesting")
    if not isinstance(where, Mapping):
        raise InvalidRequest(f"a filter must be a dict, got {type(where).__name__}")
    parts: list[Node] = []
    for key, spec in where.items():
        if not isinstance(key, str):
            raise InvalidRequest(f"filter keys must be str, got {key!r}")
        logic = _LOGIC.get(key)
        if logic == "not":
            _count(counter)
            inner = spec
            if isinstance(spec, list):  # mem0 writes NOT: [f, ...]: none of them
                inner = {"$or": spec}
            parts.append(Logic("not", (_parse(inner, depth + 1, counter),)))
        elif logic is not None:
            if not isinstance(spec, list) or not spec:
                raise InvalidRequest(f"filter {key!r} takes a non-empty list of filters")
            _count(counter)
            parts.append(Logic(logic, tuple(_parse(s, depth + 1, counter) for s in spec)))
        elif key.startswith("$"):
            raise InvalidRequest(f"unknown filter operator {key!r} (use $and, $or, $not)")
        elif isinstance(spec, Mapping):
            if not spec:
                raise InvalidRequest(f"filter on {key!r} has no operator")
            if depth + 1 > MAX_DEPTH:
                raise InvalidRequest(f"filter is too deep: more than {MAX_DEPTH} levels of nesting")
            for op, value in spec.items():
                parts.append(_cond(key, op, value, counter))
        else:
            parts.append(_cond(key, "eq", spec, counter))
    if len(parts) == 1:
        return parts[0]
    return Logic("and", tuple(parts))


def _cond(key: str, op: object, value: object, counter: list[int]) -> Cond:
    _count(counter)
    name = op[1:] if isinstance(op, str) and op.startswith("$") else op
    if name not in OPERATORS:
        raise InvalidRequest(
            f"unknown filter operator {op!r} on {key!r}; use one of {', '.join(OPERATORS)}"
        )
    if name in ("in", "nin"):
        if not isinstance(value, (list, tuple)) or not value:
            raise InvalidRequest(f"filter on {key!r}: {name} takes a non-empty list")
        return Cond(key, str(name), tuple(_scalar(key, str(name), v) for v in value))
    scalar = _scalar(key, str(name), value)
    if name in _ORDERED and family(value) == "b":
        raise InvalidRequest(f"filter on {key!r}: {name} takes a str or a number, not a bool")
    return Cond(key, str(name), scalar)


def key_id(key: str) -> int:
    """The int64 id of string id ``key``: the first 8 bytes (little-endian) of the BLAKE2b
    digest of its UTF-8, top bit cleared: 63 bits, never negative, so never -1."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def dumps(where: object) -> bytes:
    """The wire form of a filter: checked (:func:`parse`), then its compact UTF-8 JSON."""
    if isinstance(where, (bytes, str)):
        parse(where)
        return where.encode() if isinstance(where, str) else where
    try:
        raw = json.dumps(where, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError, RecursionError) as exc:  # (nested past Python's limit)
        raise InvalidRequest(f"filter cannot be sent as JSON: {exc}") from None
    parse(raw)
    return raw


# -- one item: the reference semantics --------------------------------------------------------


def matches(node: Node, meta: Mapping[str, Any] | None) -> bool:
    """Whether one item's metadata matches ``node`` (plain Python; the columns agree)."""
    if isinstance(node, Logic):
        if node.op == "and":
            return all(matches(p, meta) for p in node.parts)
        if node.op == "or":
            return any(matches(p, meta) for p in node.parts)
        return not matches(node.parts[0], meta)
    if meta is None or node.key not in meta:
        return False
    stored = meta[node.key]
    op, want = node.op, node.value
    if op == "contains":
        if isinstance(stored, list):
            return any(_scalar_eq(e, want) for e in stored if family(e) is not None)
        return isinstance(stored, str) and isinstance(want, str) and want in stored
    fam = family(stored)
    if fam is None:
        return False
    if op in ("in", "nin"):
        fams = {family(v) for v in want}
        if fam not in fams:
            return False
        hit = any(_scalar_eq(stored, v) for v in want)
        return hit if op == "in" else not hit
    if fam != family(want):
        return False
    if op == "eq":
        return _scalar_eq(stored, want)
    if op == "ne":
        return not _scalar_eq(stored, want)
    a, b = (float(stored), float(want)) if fam == "n" else (stored, want)
    return _ORDER[op](a, b)


def _scalar_eq(a: object, b: object) -> bool:
    fa = family(a)
    if fa != family(b):
        return False
    return float(a) == float(b) if fa == "n" else a == b  # type: ignore[arg-type]


_ORDER: dict[str, Callable[[Any, Any], bool]] = {
    "gt": lambda a, b: a > b,
    "gte": lambda a, b: a >= b,
    "lt": lambda a, b: a < b,
    "lte": lambda a, b: a <= b,
}


def check_metadata(meta: object, i: int) -> dict[str, Any] | None:
    """One item's metadata: a dict with str keys whose values JSON can carry, or None."""
    if meta is None:
        return None
    if not isinstance(meta, Mapping):
        raise InvalidRequest(f"metadata {i} must be a dict, got {type(meta).__name__}")
    for key in meta:
        if not isinstance(key, str):
            raise InvalidRequest(f"metadata {i} has a key that is not a str: {key!r}")
    return dict(meta)


Mask = TypeVar("Mask", covariant=True)


class ColumnSource(Protocol[Mask]):
    """What :func:`evaluate` needs of a metadata table's columns (kalos.stores.metadata on the
    host, kalos.stores.device_columns on a device): the [n] bool mask of the rows one
    condition holds for, and of every row. Each call returns a new mask (evaluate combines
    them in place)."""

    def condition(self, cond: Cond, n: int) -> Mask: ...

    def everything(self, n: int) -> Mask: ...


def evaluate(node: Node, columns: ColumnSource[Mask], n: int) -> Mask:
    """The rows [n] of ``columns`` that match ``node``, as the columns' bool mask type: a
    numpy array over the host's columns, a torch tensor over a device's (vectorised, per
    column; the logic combines masks with ``~``, ``&=`` and ``|=`` only)."""
    if isinstance(node, Logic):
        if node.op == "not":
            inner: Any = evaluate(node.parts[0], columns, n)
            return ~inner
        if not node.parts:
            return columns.everything(n)
        out: Any = evaluate(node.parts[0], columns, n)
        for part in node.parts[1:]:
            if node.op == "and":
                out &= evaluate(part, columns, n)
            else:
                out |= evaluate(part, columns, n)
        return out
    return columns.condition(node, n)


__all__ = [
    "MATCH_ALL",
    "MAX_CONDITIONS",
    "MAX_DEPTH",
    "MAX_FILTER_BYTES",
    "OPERATORS",
    "ColumnSource",
    "Cond",
    "Logic",
    "Node",
    "check_metadata",
    "dumps",
    "evaluate",
    "family",
    "key_id",
    "matches",
    "parse",
]
