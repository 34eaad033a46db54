"""Bulk load at start: ``kalos serve --load VECTORS.npy [--load-ids IDS.npy]
[--load-payloads PAYLOADS.jsonl]``.

The sidecar reads the files itself, with its own permissions, before it reports ready: rows
go straight into the memory store in chunks of :data:`CHUNK_ROWS`, never through a client's
channel (whose arena holds 1 MiB by default), so 10M rows load at the speed of the index's
``add``. Approximate indexes train on the way (the ``39 * nlist`` rule; a file loaded in
chunks trains on its first chunks and retrains as it grows).

Files:

- ``VECTORS.npy``: a numpy ``.npy`` array [n, dim], float32 or float16 (memory-mapped: the
  host holds one chunk at a time besides the index);
- ``IDS.npy`` (optional): int64 (or int32/uint32) [n], not -1; without it the ids are
  ``0..n-1``. Inside the file the last occurrence of an id wins, as in any add;
- ``PAYLOADS.jsonl`` (optional): n lines, each a JSON string (the item's text payload) or
  ``null`` (none).

The rows have no scope (tenant, user, session) and no metadata. They are not written to the
write-ahead log: every start that names the files upserts them again, after recovery (with
``--data-dir``, a later snapshot holds them too; a client's removal of a loaded id lasts until
the next start with ``--load``). A replica (``--source``) takes its rows from the database
and refuses ``--load``.

Every problem is a :class:`~kalos.errors.ConfigError` naming the file, found before the
sidecar starts anything: a missing or unreadable file, not an ``.npy`` array, the wrong dtype
or dimension, NaN or inf (found while loading), counts that disagree, a payload line that is
not a JSON string or null.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

import numpy as np

from kalos.errors import ConfigError, InvalidRequest
from kalos.protocol import codes
from kalos.stores.memories import MemoryStore
from kalos.types import Scope

log = logging.getLogger("kalos.server")

CHUNK_ROWS = 1 << 18
"""Rows handed to the store per add (64 MiB of float32 at 64 dims... 384 MiB at 384)."""


@dataclasses.dataclass(frozen=True)
class LoadFiles:
    """The checked files of a load: vectors [n, dim] and ids [n] memory-mapped, payloads
    (a path) or None."""

    vectors: np.ndarray
    ids: np.ndarray | None
    payloads: str | None

    @property
    def rows(self) -> int:
        return int(self.vectors.shape[0])


def _npy(path: str, what: str) -> np.ndarray:
    if not os.path.isfile(path):
        raise ConfigError(f"{what} {path!r}: no such file")
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{what} {path!r} is not a numpy .npy array: {exc}") from None


def check_files(vectors: str, ids: str | None, payloads: str | None, dim: int) -> LoadFiles:
    """The files of ``--load``, ``--load-ids`` and ``--load-payloads`` checked against the
    sidecar's ``dim`` (module doc); ConfigError otherwise."""
    x = _npy(vectors, "--load")
    if x.dtype not in (np.float32, np.float16):
        raise ConfigError(f"--load {vectors!r}: vectors must be float32 or float16, not {x.dtype}")
    if x.ndim != 2 or x.shape[1] != dim:
        raise ConfigError(
            f"--load {vectors!r}: vectors must be [n, {dim}] for this sidecar's dim; got"
            f" shape {list(x.shape)}"
        )
    id_arr = None
    if ids is not None:
        id_arr = _npy(ids, "--load-ids")
        if id_arr.dtype not in (np.int64, np.int32, np.uint32):
            raise ConfigError(f"--load-ids {ids!r}: ids must be int64, not {id_arr.dtype}")
        if id_arr.shape != (x.shape[0],):
            raise ConfigError(
                f"--load-ids {ids!r}: ids must be [{x.shape[0]}], one per vector; got shape"
                f" {list(id_arr.shape)}"
            )
    if payloads is not None:
        if not os.path.isfile(payloads):
            raise ConfigError(f"--load-payloads {payloads!r}: no such file")
        with open(payloads, "rb") as f:
            lines = sum(1 for _ in f)
        if lines != x.shape[0]:
            raise ConfigError(
                f"--load-payloads {payloads!r}: {lines} lines for {x.shape[0]} vectors"
            )
    return LoadFiles(x, id_arr, payloads)


def _payload_chunk(
    lines: list[bytes], path: str, first: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(kinds [m] uint8, offsets [m+1] uint64, blob) of m JSONL payload lines."""
    kinds = np.zeros(len(lines), np.uint8)
    parts: list[bytes] = []
    offsets = np.zeros(len(lines) + 1, np.uint64)
    at = 0
    for i, line in enumerate(lines):
        try:
            value = json.loads(line)
        except ValueError:
            raise ConfigError(f"--load-payloads {path!r} line {first + i + 1}: not JSON") from None
        if value is not None:
            if not isinstance(value, str):
                raise ConfigError(
                    f"--load-payloads {path!r} line {first + i + 1}: a JSON string or null,"
                    f" not {type(value).__name__}"
                )
            data = value.encode()
            kinds[i] = codes.PAYLOAD_TEXT
            parts.append(data)
            at += len(data)
        offsets[i + 1] = at
    return kinds, offsets, np.frombuffer(b"".join(parts), np.uint8)


def load_into(memories: MemoryStore, files: LoadFiles) -> int:
    """Upserts every row of ``files`` into the memory store, CHUNK_ROWS at a time; returns
    the rows read. ConfigError naming the file and row for bad values."""
    t0 = time.perf_counter()
    n = files.rows
    payload_file = open(files.payloads, "rb") if files.payloads is not None else None  # noqa: SIM115
    try:
        for lo in range(0, n, CHUNK_ROWS):
            hi = min(n, lo + CHUNK_ROWS)
            x = np.ascontiguousarray(files.vectors[lo:hi], dtype=np.float32)
            ids = (
                np.arange(lo, hi, dtype=np.int64)
                if files.ids is None
                else np.ascontiguousarray(files.ids[lo:hi], dtype=np.int64)
            )
            if payload_file is not None:
                lines = [payload_file.readline() for _ in range(hi - lo)]
                kinds, offsets, blob = _payload_chunk(lines, str(files.payloads), lo)
            else:
                kinds = np.zeros(hi - lo, np.uint8)
                offsets = np.zeros(hi - lo + 1, np.uint64)
                blob = np.empty(0, np.uint8)
            try:
                memories.add(ids, x, kinds, offsets, blob, Scope())
            except InvalidRequest as exc:
                raise ConfigError(f"--load rows {lo}..{hi - 1}: {exc}") from None
    finally:
        if payload_file is not None:
            payload_file.close()
    log.info("loaded %d rows in %.1f s", n, time.perf_counter() - t0)
    return n


__all__ = ["CHUNK_ROWS", "LoadFiles", "check_files", "load_into"]
