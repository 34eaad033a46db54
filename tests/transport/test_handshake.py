"""The handshake framing (u32 length + JSON), descriptors passing, and its failure modes."""

from __future__ import annotations

import os
import socket
import struct

import pytest

from kalos.transport.handshake import MAX_MESSAGE, recv_message, send_message


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.settimeout(30)
    b.settimeout(30)
    yield a, b
    a.close()
    b.close()


def test_round_trip(pair) -> None:
    a, b = pair
    send_message(a, {"magic": "KALO", "protocol": [1, 0], "ü": "🙂"})
    message, fds = recv_message(b)
    assert message == {"magic": "KALO", "protocol": [1, 0], "ü": "🙂"}
    assert fds == []


def test_descriptors_travel_with_the_message(pair) -> None:
    a, b = pair
    r, w = os.pipe()
    try:
        send_message(a, {"ok": True}, [w])
        message, fds = recv_message(b)
        assert message == {"ok": True} and len(fds) == 1
        os.write(fds[0], b"hi")  # the received descriptor is the same pipe
        assert os.read(r, 2) == b"hi"
        os.close(fds[0])
    finally:
        os.close(r)
        os.close(w)


def test_a_message_split_across_reads(pair) -> None:
    a, b = pair
    data = b'{"x": 1}'
    frame = struct.pack("<I", len(data)) + data
    for i in range(len(frame)):  # one byte at a time
        a.sendall(frame[i : i + 1])
    assert recv_message(b)[0] == {"x": 1}


@pytest.mark.parametrize(
    "frame",
    [
        b"",  # EOF before anything
        struct.pack("<I", 10) + b"abc",  # EOF mid-message
        struct.pack("<I", MAX_MESSAGE + 1),  # too large
        struct.pack("<I", 5) + b"nope!",  # not JSON
        struct.pack("<I", 2) + b"[]",  # JSON, not an object
        struct.pack("<I", 2) + b"\xff\xfe",  # not UTF-8
    ],
    ids=["eof", "truncated", "too-large", "not-json", "not-object", "not-utf8"],
)
def test_malformed_frames_are_connection_errors(pair, frame: bytes) -> None:
    a, b = pair
    a.sendall(frame)
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(ConnectionError):
        recv_message(b)
