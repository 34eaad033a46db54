"""Spec strings → index backends.

A spec is ``"<device>[:<index>]:<kind>[,<option>...]"``::

    "cpu:flat"            exact search in numpy (the default CPU backend, see below)
    "cpu:faiss-flat"      exact search through FAISS (needs faiss-cpu: pip install 'kalos[faiss]')
    "cuda:flat,fp16"      a GPU backend on the current device, with one option
    "cuda:1:flat,bf16"    the same on device 1
    "cpu:flat,shards=3"   three cpu:flat shards, rows spread by id hash (kalos.index.sharded)
    "cuda:flat,shards=2"  two cuda:flat shards on one device
    "cpu:ivf,nlist=1024"  approximate: an inverted-file index, 1024 lists (kalos.index.cpu_ivf)
    "cuda:ivf,nlist=16384,nprobe=32"  the same on the GPU (kalos.index.cuda_ivf)

The registry key is ``"<device>:<kind>"``; the device index and the options are passed to the
backend's constructor, which refuses what it does not understand (ConfigError). A backend is
one module plus one line in :data:`BACKENDS`; its module is imported only when a spec asks for
it, so optional packages (faiss, torch) are never imported by ``import kalos.index``.

``"cpu:flat"`` is numpy because it won the side-by-side measurement on the 2-core CI machine
(100K x 128 float32, top-10, nq=1, interleaved: FAISS flat was 3.5-3.8x slower at p50,
2.7x at p99; ``bench/results/index-cpu-choice-ci-2core.json``).
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass

from kalos.errors import ConfigError

from .base import Index, check_config
from .sharded import ShardedIndex, split_shards_option


@dataclass(frozen=True)
class Backend:
    """Where a backend lives, and what it needs that ``pip install kalos`` does not bring."""

    module: str  # e.g. "kalos.index.cpu_flat"
    cls: str  # called as cls(spec, dim=, metric=, device_index=, options=)
    requires: str | None = None  # top-level import the backend needs, e.g. "faiss"
    install: str | None = None  # how to get it, e.g. "pip install 'kalos[faiss]' (faiss-cpu)"


BACKENDS: dict[str, Backend] = {
    "cpu:flat": Backend("kalos.index.cpu_flat", "CpuFlatIndex"),
    "cuda:flat": Backend(
        "kalos.index.cuda_flat",
        "create_from_spec",
        requires="torch",
        install="pip install 'kalos[gpu]' (torch and triton)",
    ),
    "cpu:ivf": Backend("kalos.index.cpu_ivf", "CpuIvfIndex"),
    "cuda:ivf": Backend(
        "kalos.index.cuda_ivf",
        "create_from_spec",
        requires="torch",
        install="pip install 'kalos[gpu]' (torch)",
    ),
    "cpu:faiss-flat": Backend(
        "kalos.index.faiss_flat",
        "FaissFlatIndex",
        requires="faiss",
        install="pip install 'kalos[faiss]' (or: pip install faiss-cpu)",
    ),
}


@dataclass(frozen=True)
class Spec:
    """A parsed spec string."""

    device: str  # "cpu", "cuda", ...
    device_index: int | None  # the N of "cuda:N:flat"; None when not given
    kind: str  # "flat", "faiss-flat", ...
    options: tuple[str, ...]  # ("fp16",) for "cuda:flat,fp16"

    @property
    def key(self) -> str:
        """The registry key: ``"<device>:<kind>"``."""
        return f"{self.device}:{self.kind}"


_NAME = re.compile(r"[a-z][a-z0-9_.\-]*\Z")
_OPTION = re.compile(r"[A-Za-z0-9_.\-]+(=[A-Za-z0-9_.\-]+)?\Z")


def parse_spec(spec: str) -> Spec:
    """Split ``"<device>[:<index>]:<kind>[,<option>...]"``; ConfigError when malformed."""
    if not isinstance(spec, str):
        raise ConfigError(f"an index spec is a string such as 'cpu:flat'; got {spec!r}")
    head, *options = spec.strip().split(",")
    parts = head.split(":")
    device_index: int | None = None
    if len(parts) == 3 and parts[1].isdigit():
        device, index, kind = parts
        device_index = int(index)
    elif len(parts) == 2:
        device, kind = parts
    else:
        raise ConfigError(
            f"bad index spec {spec!r}: expected '<device>[:<index>]:<kind>[,<option>...]',"
            " e.g. 'cpu:flat' or 'cuda:1:flat,fp16'"
        )
    opts = tuple(o.strip() for o in options)
    if not _NAME.match(device) or not _NAME.match(kind):
        raise ConfigError(f"bad index spec {spec!r}: device and kind are lowercase names")
    bad = [o for o in opts if not _OPTION.match(o)]
    if bad:
        raise ConfigError(f"bad index spec {spec!r}: malformed option(s) {bad}")
    return Spec(device=device, device_index=device_index, kind=kind, options=opts)


def known_specs(device: str | None = None) -> list[str]:
    """Registered ``"<device>:<kind>"`` keys, sorted; only one device's when given."""
    return sorted(k for k in BACKENDS if device is None or k.split(":", 1)[0] == device)


def register(key: str, backend: Backend) -> None:
    """Add or replace a backend under ``"<device>:<kind>"`` (plugins, tests)."""
    parsed = parse_spec(key)
    if parsed.key != key:
        raise ConfigError(f"register a backend under '<device>:<kind>', not {key!r}")
    BACKENDS[key] = backend


def backend_class(spec: str) -> type:
    """The class a spec names, importing its module (and optional packages) now."""
    parsed = parse_spec(spec)
    backend = BACKENDS.get(parsed.key)
    if backend is None:
        raise ConfigError(
            f"unknown index spec {spec!r}; known: {', '.join(known_specs())}"
            " (optionally with a device index and ',options', e.g. 'cuda:1:flat,fp16')"
        )
    try:
        module = importlib.import_module(backend.module)
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").split(".")[0]
        if backend.requires and missing == backend.requires:
            how = f": {backend.install}" if backend.install else ""
            raise ConfigError(
                f"index spec {spec!r} needs the package {backend.requires!r}, which is not"
                f" installed{how}"
            ) from exc
        raise
    cls: type = getattr(module, backend.cls)
    return cls


def create(spec: str, *, dim: int, metric: str = "ip") -> Index:
    """Build an empty index from a spec string.

    ``dim``: vector dimension (> 0). ``metric``: ``"ip"`` (inner product), ``"cosine"``
    (vectors and queries normalised) or ``"l2"`` (squared distance, ascending).
    Raises ConfigError for an unknown or malformed spec, a missing optional package, an
    option the backend does not take, or a bad dim or metric.
    """
    dim, metric = check_config(dim, metric)
    parsed = parse_spec(spec)
    shards, rest = split_shards_option(spec, parsed.options)
    if shards is not None:
        head = spec.strip().split(",")[0]
        child_spec = ",".join((head, *rest))
        children = [create(child_spec, dim=dim, metric=metric) for _ in range(shards)]
        return ShardedIndex(spec, children)
    cls = backend_class(spec)
    index: Index = cls(
        spec, dim=dim, metric=metric, device_index=parsed.device_index, options=parsed.options
    )
    return index


__all__ = [
    "BACKENDS",
    "Backend",
    "Spec",
    "backend_class",
    "create",
    "known_specs",
    "parse_spec",
    "register",
]
