"""The conformance kits of kalos.testing fail on a backend or transport that breaks the
contract (and pass on a sound one: tests/index and tests/transport run them on every one)."""

from __future__ import annotations

import pytest

import kalos.index
from conftest import DIM, make_inproc_connector
from kalos.index import Index
from kalos.testing import check_index, check_transport
from kalos.transport.inproc import InprocTransport


class ScopeBlind:
    """A cpu:flat index that ignores the scope filter."""

    def __init__(self, inner: Index) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)

    def __len__(self) -> int:
        return len(self._inner)

    def search(self, queries: object, k: int, *, scope: object = None) -> object:
        return self._inner.search(queries, k)


def test_check_index_fails_on_a_backend_that_ignores_scopes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    create = kalos.index.create
    monkeypatch.setattr(
        kalos.index, "create", lambda spec, **kw: ScopeBlind(create("cpu:flat", **kw))
    )
    with pytest.raises(AssertionError, match="out of scope"):
        check_index("cpu:flat", metrics=("ip",))


class NeverCloses(InprocTransport):
    def close(self) -> None:
        pass


def test_check_transport_fails_on_a_transport_that_serves_after_close() -> None:
    connector = make_inproc_connector(DIM)

    def open_one() -> InprocTransport:
        t = connector()
        t.__class__ = NeverCloses
        return t

    with pytest.raises(AssertionError, match="closed"):
        check_transport(open_one)


def test_check_transport_passes_the_in_process_transport() -> None:
    check_transport(make_inproc_connector(DIM))
