"""The public surface: ``kalos.__all__`` and the shape of the exception tree."""

from __future__ import annotations

import pytest

import kalos
from kalos import errors


def isort_key(name: str) -> tuple[int, str]:
    """The order ruff (RUF022) keeps ``__all__`` in: CONSTANTS, then Classes, then the rest."""
    if name.isupper():
        return 0, name
    if name[0].isupper():
        return 1, name
    return 2, name


def test_all_is_sorted_and_unique() -> None:
    assert kalos.__all__ == sorted(kalos.__all__, key=isort_key)
    assert len(set(kalos.__all__)) == len(kalos.__all__)


def test_every_name_in_all_exists() -> None:
    for name in kalos.__all__:
        assert hasattr(kalos, name), name


def test_all_lists_the_public_api() -> None:
    expected = {
        "PROTOCOL_VERSION", "AsyncClient", "Client", "ClientOptions", "ClosedError", "ConfigError",
        "Conflict", "ConnectError", "InvalidRequest", "KalosError", "Memory", "NotFound",
        "PayloadTooLarge",
        "ProtocolMismatch", "Recall", "RecallContext", "RecallParts", "RequestTimeout", "Scope",
        "SearchResult", "ServerError", "SidecarGone", "StoreError", "Timings", "Tls",
        "TransportError", "__version__", "connect", "connect_async", "key_id",
    }  # fmt: skip
    assert set(kalos.__all__) == expected


def test_errors_all_is_sorted_and_complete() -> None:
    assert errors.__all__ == sorted(errors.__all__, key=isort_key)
    defined = {
        name
        for name, obj in vars(errors).items()
        if isinstance(obj, type) and issubclass(obj, BaseException)
    }
    assert set(errors.__all__) == defined
    for name in errors.__all__:
        assert getattr(kalos, name) is getattr(errors, name)  # re-exported, same class


def test_version_is_a_string() -> None:
    assert isinstance(kalos.__version__, str)
    assert kalos.__version__.count(".") == 2


# (exception, its direct KalosError parent, the builtin it also is, if any)
TREE = [
    (errors.ConfigError, errors.KalosError, ValueError),
    (errors.InvalidRequest, errors.KalosError, ValueError),
    (errors.PayloadTooLarge, errors.InvalidRequest, ValueError),
    (errors.TransportError, errors.KalosError, None),
    (errors.ConnectError, errors.TransportError, None),
    (errors.RequestTimeout, errors.TransportError, None),
    (errors.SidecarGone, errors.TransportError, None),
    (errors.ProtocolMismatch, errors.TransportError, None),
    (errors.ClosedError, errors.KalosError, None),
    (errors.ServerError, errors.KalosError, None),
    (errors.StoreError, errors.KalosError, None),
    (errors.NotFound, errors.StoreError, KeyError),
    (errors.Conflict, errors.StoreError, None),
]


def test_kalos_error_is_the_root() -> None:
    assert issubclass(errors.KalosError, Exception)
    assert not issubclass(errors.KalosError, (ValueError, KeyError, OSError))


@pytest.mark.parametrize("cls, parent, builtin", TREE, ids=lambda x: getattr(x, "__name__", ""))
def test_exception_tree_shape(cls: type, parent: type, builtin: type | None) -> None:
    assert issubclass(cls, parent)
    assert issubclass(cls, errors.KalosError)
    if builtin is not None:
        assert issubclass(cls, builtin)
    # the builtin bases are exactly the drawn ones: no accidental OSError, TimeoutError, ...
    for other in (ValueError, KeyError, OSError, TimeoutError, ConnectionError, RuntimeError):
        if other is not builtin:
            assert not issubclass(cls, other), (cls, other)


def test_the_tree_is_exactly_the_drawn_one() -> None:
    drawn = {cls for cls, _, _ in TREE} | {errors.KalosError}
    assert {getattr(errors, n) for n in errors.__all__} == drawn


def test_transport_errors_are_not_caller_errors() -> None:
    for cls in (errors.ConnectError, errors.RequestTimeout, errors.SidecarGone,
                errors.ProtocolMismatch, errors.ClosedError, errors.ServerError):  # fmt: skip
        assert not issubclass(cls, errors.InvalidRequest)
        assert not issubclass(cls, ValueError)


def test_server_error_keeps_its_code() -> None:
    exc = errors.ServerError("boom", code=7)
    assert exc.code == 7
    assert str(exc) == "boom"
    assert errors.ServerError("x").code == 0


def test_not_found_prints_its_plain_message() -> None:
    # KeyError would print repr('...'), quotes included
    assert str(errors.NotFound("session 42 does not exist")) == "session 42 does not exist"
    assert str(errors.NotFound()) == ""
    with pytest.raises(KeyError):
        raise errors.NotFound("x")
