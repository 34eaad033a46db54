"""error_for_status: the one place a status code becomes an exception of the tree."""

from __future__ import annotations

import pytest

from kalos import errors
from kalos.protocol.codes import Status, error_for_status
from kalos.server.dispatch import status_for

EXPECTED = {
    Status.INVALID_REQUEST: errors.InvalidRequest,
    Status.UNKNOWN_OP: errors.InvalidRequest,
    Status.PAYLOAD_TOO_LARGE: errors.PayloadTooLarge,
    Status.NOT_FOUND: errors.NotFound,
    Status.CONFLICT: errors.Conflict,
    Status.TIMEOUT: errors.RequestTimeout,
    Status.SERVER_ERROR: errors.ServerError,
    Status.UNAVAILABLE: errors.ServerError,
}


@pytest.mark.parametrize("status", sorted(EXPECTED), ids=lambda s: Status(s).name)
def test_status_becomes_its_exception(status: Status) -> None:
    exc = error_for_status(status, "the message")
    assert type(exc) is EXPECTED[status]
    assert str(exc) == "the message"


def test_every_error_status_is_mapped() -> None:
    assert set(EXPECTED) == set(Status) - {Status.OK}


@pytest.mark.parametrize("status", [Status.SERVER_ERROR, Status.UNAVAILABLE, 99])
def test_server_errors_carry_the_code(status: int) -> None:
    exc = error_for_status(status, "")
    assert isinstance(exc, errors.ServerError)
    assert exc.code == status
    assert str(status) in str(exc)  # an empty message still says which status


@pytest.mark.parametrize("status", sorted(set(EXPECTED) - {Status.UNKNOWN_OP, Status.UNAVAILABLE}))
def test_sidecar_and_client_agree_on_the_mapping(status: Status) -> None:
    # the sidecar's exception -> status, then the client's status -> exception, round trips
    exc = error_for_status(status, "m")
    assert status_for(exc) == status
