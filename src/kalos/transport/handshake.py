"""The handshake over the sidecar's Unix socket (both sides).

One message each way, each a ``u32`` length then UTF-8 JSON: the handshake is not on the hot
path, and JSON keeps it readable and extensible. The sidecar's reply carries the control
segment and channel memory as memfd descriptors (SCM_RIGHTS), so no /dev/shm name exists.
docs/PROTOCOL.md lists the fields.
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
from typing import Any, NoReturn

from kalos.errors import ConnectError, ProtocolMismatch
from kalos.protocol.codes import PROTOCOL_VERSION

_LEN = struct.Struct("<I")
MAX_MESSAGE = 64 << 10
MAX_FDS = 4


def send_message(
    sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None
) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    frame = _LEN.pack(len(data)) + data
    if fds:
        socket.send_fds(sock, [frame], fds)
    else:
        sock.sendall(frame)


def recv_message(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """Reads one message and any descriptors sent with it. Raises ConnectionError on EOF."""
    buf = b""
    fds: list[int] = []
    while len(buf) < _LEN.size or len(buf) < _LEN.size + _LEN.unpack_from(buf)[0]:
        if len(buf) >= _LEN.size and _LEN.unpack_from(buf)[0] > MAX_MESSAGE:
            raise ConnectionError("handshake message too large")
        data, got, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, MAX_FDS)
        if not data:
            for fd in got:
                _close_fd(fd)
            raise ConnectionError("peer closed during the handshake")
        buf += data
        fds.extend(got)
    (n,) = _LEN.unpack_from(buf)
    try:
        message = json.loads(buf[_LEN.size : _LEN.size + n])
    except ValueError as exc:
        raise ConnectionError("malformed handshake message") from exc
    if not isinstance(message, dict):
        raise ConnectionError("malformed handshake message")
    return message, fds


def _close_fd(fd: int) -> None:
    import os

    with contextlib.suppress(OSError):
        os.close(fd)


def client_hello(
    path: str, transport: str, arena_bytes: int, timeout: float, gpu_results: bool = False
) -> tuple[socket.socket, dict[str, Any], list[int]]:
    """Connects to the sidecar at ``path`` and asks for a channel of ``transport`` kind.

    Returns the connected socket (it stays open for the channel's lifetime: the sidecar frees
    the channel when it closes, and the client sees the sidecar die when it reaches EOF), the
    sidecar's reply and the descriptors it sent.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
    except FileNotFoundError as exc:
        sock.close()
        raise ConnectError(f"no sidecar is listening at {path}") from exc
    except (ConnectionRefusedError, OSError) as exc:
        sock.close()
        raise ConnectError(f"cannot connect to the sidecar at {path}: {exc}") from exc
    shm = transport == "shm"
    hello = hello_message(transport, arena_bytes, gpu_results, token_heap=shm, session_index=shm)
    try:
        # A sidecar refusing this peer (SO_PEERCRED) answers at once and closes, maybe before
        # the hello arrives (EPIPE); its answer is still there to read.
        with contextlib.suppress(BrokenPipeError):
            send_message(sock, hello)
        reply, fds = recv_message(sock)
    except (OSError, ConnectionError) as exc:
        sock.close()
        raise ConnectError(f"handshake with the sidecar at {path} failed: {exc}") from exc
    if not reply.get("ok"):
        for fd in fds:
            _close_fd(fd)
        sock.close()
        refused(reply)
    sock.settimeout(None)
    return sock, reply, fds


def hello_message(
    transport: str,
    arena_bytes: int,
    gpu_results: bool = False,
    *,
    token_heap: bool = False,
    session_index: bool = False,
) -> dict[str, Any]:
    """The client's handshake message (over the Unix socket, or grpc's Hello method).

    ``token_heap``: the client maps the sidecar's token heap (shm channels: CONTEXT token
    ids by reference, kalos.shm.token_heap); ``session_index``: and its session index
    (CONTEXT windows computed by the client, kalos.shm.session_index)."""
    hello = {
        "magic": "KALO",
        "protocol": list(PROTOCOL_VERSION),
        "transport": transport,
        "arena_bytes": arena_bytes,
        "gpu_results": gpu_results,
    }
    if token_heap:
        hello["token_heap"] = True
    if session_index:
        hello["session_index"] = True
    return hello


def refused(reply: dict[str, Any]) -> NoReturn:
    """Raises what a refusing handshake ``reply`` means: ProtocolMismatch or ConnectError."""
    if reply.get("error") == "protocol_mismatch":
        server = reply.get("protocol", ["?", "?"])
        raise ProtocolMismatch(
            f"client speaks protocol {PROTOCOL_VERSION[0]}.{PROTOCOL_VERSION[1]}, "
            f"the sidecar speaks {server[0]}.{server[1]}"
        )
    raise ConnectError(f"the sidecar refused the connection: {reply.get('message', '?')}")
