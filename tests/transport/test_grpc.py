"""The grpc transport: the same answers as shm, the same errors, its limits, deadlines, a lost
and restarted sidecar, readiness, TLS and mutual TLS, metrics.

The client's semantics over grpc are also covered by tests/test_client.py and
tests/test_sessions_client.py (parametrized over every transport); these are grpc's own.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

grpc = pytest.importorskip("grpc")

import kalos  # noqa: E402
import kalos.index  # noqa: E402
from conftest import DIM, TIMEOUT, stop_process  # noqa: E402
from kalos import Scope  # noqa: E402
from kalos.errors import (  # noqa: E402
    ClosedError,
    ConfigError,
    Conflict,
    ConnectError,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    RequestTimeout,
    SidecarGone,
)
from kalos.protocol import layout as L  # noqa: E402
from kalos.protocol import messages as M  # noqa: E402
from kalos.protocol.codes import Op, Status  # noqa: E402
from kalos.server import SidecarConfig  # noqa: E402
from kalos.server.dispatch import Dispatcher  # noqa: E402
from kalos.server.grpc_server import GrpcServer  # noqa: E402
from kalos.stores.memories import MemoryStore  # noqa: E402
from kalos.testing import RunningSidecar, isolated_sidecar  # noqa: E402
from kalos.transport.grpc import CALL, HELLO  # noqa: E402

LOOPBACK = ("--grpc", "127.0.0.1:0")
RNG = np.random.default_rng(7)
VECTORS = RNG.standard_normal((40, DIM)).astype(np.float32)
IDS = np.arange(40, dtype=np.int64) * 3 + 1


def grpc_client(sc: RunningSidecar, **kw: object) -> kalos.Client:
    kw.setdefault("timeout", TIMEOUT)
    return sc.connect(transport="grpc", **kw)


def raw(client: kalos.Client, op: int, encode: Callable | None = None, body_len: int | None = None):
    """Sends a request past the client's checks: (status, message)."""
    t = client._channel()
    n = encode(t.request_buffer) if encode is not None else 0
    resp = t.request(op, 0, n if body_len is None else body_len, timeout=TIMEOUT)
    return resp.status, M.decode_text(resp.body, len(resp.body))


def script(c: kalos.Client) -> list[object]:
    """Every op once, with the answers a user sees (timings left out)."""
    out: list[object] = [c.ping() is not None]
    out.append(c.add(VECTORS, IDS, payloads=[f"m{i}" for i in range(40)], scope=Scope("t", "u")))
    out.append(c.add(VECTORS[:5], IDS[:5], payloads=[b"\x00raw"] * 5))  # replaces 5
    r = c.search(VECTORS[7], k=5, scope=Scope("t"))
    out.append((r.ids.tolist(), r.scores.tolist(), r.payloads))
    r = c.search(VECTORS[:3], k=4, payloads=False)
    out.append((r.ids.tolist(), r.scores.tolist(), r.payloads))
    out.append(c.remove(IDS[10:13]))
    out.append(c.append_turn("s1", "system", "be brief", [1, 2], pin=True))
    out.append(c.append_turn("s1", "user", "hello", np.arange(5), scope=None))
    out.append(c.append_turn("s1", "assistant", "hi there", [9, 8, 7]))
    ctx = c.context("s1", max_tokens=8)
    out.append((ctx.tokens.tolist(), list(ctx.turns or ()), ctx.system))
    out.append(c.trim("s1", 1))
    out.append([tuple(s) for s in c.sessions()])
    out.append(c.put("k", b"v1", scope=Scope("t")))
    out.append(c.cas("k", 1, "v2", scope=Scope("t")))
    out.append(tuple(c.get("k", scope=Scope("t"))))
    out.append(c.log("s1", "tool", b"{}"))
    out.append([(e[0], *e[2:]) for e in c.events("s1")])  # without its wall-clock time
    out.append(c.delete("k", scope=Scope("t")))
    out.append(tuple(c.forget(Scope("t", "u"))))
    stats = c.stats()
    out.append((stats["items"], stats["dim"]))
    for call, exc in (
        (lambda: c.get("k", scope=Scope("t")), NotFound),
        (lambda: c.cas("k2", 5, "x"), Conflict),
        (lambda: c.search(VECTORS[0], k=0), InvalidRequest),
        (lambda: c.context("nobody", max_tokens=5), NotFound),
    ):
        with pytest.raises(exc) as info:
            call()
        out.append((type(info.value).__name__, str(info.value)))
    return out


def test_every_op_answers_as_over_shm(sidecar: Callable[..., RunningSidecar]) -> None:
    over_shm = script(sidecar(dim=DIM, name="a").connect(timeout=TIMEOUT))
    over_grpc = script(grpc_client(sidecar(dim=DIM, name="b", extra_args=LOOPBACK)))
    assert over_grpc == over_shm


def test_bad_requests_get_the_same_status_and_message(
    sidecar: Callable[..., RunningSidecar],
) -> None:
    sc = sidecar(dim=DIM, extra_args=LOOPBACK)
    shm, over_grpc = sc.connect(timeout=TIMEOUT), grpc_client(sc)
    q, short = np.ones((1, DIM), np.float32), np.ones((1, 3), np.float32)
    cases = [
        (99, None, None),  # unknown op
        (Op.SEARCH, lambda b: M.encode_search(b, q, 0, M.EMPTY_SCOPE), None),  # k = 0
        (Op.SEARCH, lambda b: M.encode_search(b, short, 1, M.EMPTY_SCOPE), None),  # wrong dim
        (Op.ADD, lambda b: 7, None),  # a body too short to be an ADD
        (Op.PING, None, 1 << 30),  # body_len beyond the arena
    ]
    for op, encode, body_len in cases:
        a = raw(shm, op, encode, body_len)
        b = raw(over_grpc, op, encode, body_len)
        assert a[0] != Status.OK and a == b, (op, a, b)
    over_grpc.ping()
    assert over_grpc.stats()["items"] == 0


def test_size_limits_are_the_arena(sidecar: Callable[..., RunningSidecar]) -> None:
    sc = sidecar(dim=DIM, extra_args=LOOPBACK)
    small = grpc_client(sc, arena_bytes=65536)
    assert small.info["arena_bytes"] == 65536
    with pytest.raises(PayloadTooLarge, match="65536-byte arena"):
        small.add(np.ones((2, DIM)), [1, 2], payloads=["ok", "y" * 70_000])
    small.add(np.ones((4, DIM)), [1, 2, 3, 4])
    # 8 x 1024 hits = 96 KiB of ids and scores: only the sidecar can tell, as over shm
    with pytest.raises(PayloadTooLarge) as over_grpc:
        small.search(np.ones((8, DIM)), k=1024, payloads=False)
    with pytest.raises(PayloadTooLarge) as over_shm:
        sc.connect(arena_bytes=65536, timeout=TIMEOUT).search(
            np.ones((8, DIM)), k=1024, payloads=False
        )
    assert str(over_grpc.value) == str(over_shm.value)
    assert set(small.search(np.ones(DIM), k=2).ids.tolist()) <= {1, 2, 3, 4}  # still serving
    # A raw message declaring a 64 KiB arena and carrying more: refused by the sidecar.
    target = sc.grpc_target()
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary(CALL)
        reply = call(L.GRPC_REQ_FRAME.pack(1, Op.PING, 0, 70_000, 65536) + bytes(70_000))
        seq, status, *_ = L.RESP_FRAME.unpack_from(reply)
        assert (seq, status) == (1, Status.PAYLOAD_TOO_LARGE)
        assert b"exceeds the arena" in reply[L.RESP_FRAME.size :]
        # body_len must match what the message carries
        reply = call(L.GRPC_REQ_FRAME.pack(2, Op.PING, 0, 5, 65536) + bytes(3))
        assert L.RESP_FRAME.unpack_from(reply)[1] == Status.INVALID_REQUEST
        reply = call(b"short")
        assert L.RESP_FRAME.unpack_from(reply)[1] == Status.INVALID_REQUEST
        # a Hello that is not a Kalos handshake, and one asking for another transport
        assert json.loads(channel.unary_unary(HELLO)(b"nonsense"))["error"] == "bad_hello"
        hello = {"magic": "KALO", "protocol": [1, 0], "transport": "shm"}
        reply = channel.unary_unary(HELLO)(json.dumps(hello).encode())
        assert json.loads(reply)["error"] == "bad_transport"
    small.ping()


def test_deadline_and_a_hung_sidecar(sidecar: Callable[..., RunningSidecar]) -> None:
    sc = sidecar(dim=DIM, extra_args=LOOPBACK)
    c = grpc_client(sc)
    c.ping()
    stop_process(sc.process.pid)
    try:
        with pytest.raises(RequestTimeout):
            c.ping(timeout=0.3)
    finally:
        os.kill(sc.process.pid, signal.SIGCONT)
    c.ping()  # a new channel, within the call's own deadline
    assert c.reconnects == 1


def test_close_while_another_thread_waits(sidecar: Callable[..., RunningSidecar]) -> None:
    sc = sidecar(dim=DIM, extra_args=LOOPBACK)
    c = grpc_client(sc)
    outcome: list[BaseException | str] = []
    ready, go = threading.Event(), threading.Event()

    def call() -> None:
        c.ping()  # this thread's channel exists before the sidecar stops
        ready.set()
        go.wait()
        try:
            c.ping(timeout=TIMEOUT)
            outcome.append("returned")
        except BaseException as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=call)
    waiter.start()
    assert ready.wait(TIMEOUT)
    stop_process(sc.process.pid)  # so that the ping waits
    try:
        go.set()
        time.sleep(0.2)  # the call is in flight
        c.close()
        waiter.join(TIMEOUT)
    finally:
        os.kill(sc.process.pid, signal.SIGCONT)
    assert len(outcome) == 1 and isinstance(outcome[0], ClosedError), outcome


def test_a_killed_sidecar_then_its_restart(tmp_path: Path) -> None:
    run = str(tmp_path)
    with isolated_sidecar(dim=DIM, name="k", runtime_dir=run, extra_args=LOOPBACK) as sc:
        target = sc.grpc_target()
        c = kalos.connect(target, transport="grpc", timeout=TIMEOUT)
        soft = kalos.connect(target, transport="grpc", timeout=TIMEOUT, on_unavailable="degrade")
        c.add(VECTORS, IDS)
        epoch = c.epoch
        sc.process.kill()
        sc.process.wait()
        with pytest.raises(SidecarGone):
            c.ping()
        with pytest.raises(ConnectError):
            c.ping()  # nothing listens at the target
        hits = soft.search(VECTORS[0], k=3)
        assert hits.degraded and hits.ids.tolist() == [-1, -1, -1]
        assert soft.context("s", max_tokens=5).degraded
    port = target.rsplit(":", 1)[1]
    again = ("--grpc", f"127.0.0.1:{port}")
    with isolated_sidecar(dim=DIM, name="k", runtime_dir=run, extra_args=again):
        assert c.ping() and c.epoch != epoch
        assert c.stats()["items"] == 0  # a new sidecar (no --data-dir)
        assert not soft.search(VECTORS[0], k=3).degraded
        assert c.reconnects >= 1 and soft.reconnects >= 1
        c.close()
        soft.close()


def test_no_sidecar_and_not_a_sidecar() -> None:
    with pytest.raises(ConnectError, match="no Kalos sidecar"):
        kalos.connect("127.0.0.1:1", transport="grpc", timeout=5)
    with pytest.raises(ConfigError):
        kalos.connect("", transport="grpc")
    with pytest.raises(ConfigError):  # TLS is for grpc only
        kalos.connect("x", transport="uds", tls=kalos.Tls())
    with pytest.raises(ConfigError):
        kalos.Tls(cert="c.pem")  # without its key


# -- in process: readiness, message limits, configuration -------------------------------------


@pytest.fixture
def server() -> Iterator[Callable[..., tuple[GrpcServer, threading.Event]]]:
    """Factory: a GrpcServer over a fresh dispatcher on a free loopback port, not yet ready."""
    servers: list[GrpcServer] = []

    def make(**config: object) -> tuple[GrpcServer, threading.Event]:
        cfg = SidecarConfig(name="inproc", dim=DIM, grpc=("127.0.0.1:0",), **config)  # type: ignore[arg-type]
        dispatcher = Dispatcher(MemoryStore(kalos.index.create("cpu:flat", dim=DIM)), name="x")

        def negotiate(hello: dict, transports: tuple[str, ...]) -> dict:
            assert transports == ("grpc",)
            return dict(dispatcher.info(), ok=True, protocol=[1, 0], epoch=5, arena_bytes=65536)

        ready = threading.Event()
        s = GrpcServer(
            cfg, handle=dispatcher.handle, lock=threading.Lock(), negotiate=negotiate, ready=ready
        ).start()
        servers.append(s)
        return s, ready

    yield make
    for s in servers:
        s.close()


def test_not_ready_until_recovered(
    server: Callable[..., tuple[GrpcServer, threading.Event]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("kalos.server.grpc_server.STARTING_HOLD_S", 0.05)
    s, ready = server()
    with pytest.raises(ConnectError, match="starting"):
        kalos.connect(s.addresses[0], transport="grpc", timeout=TIMEOUT)
    assert s.rejected["starting"] == 1
    with grpc.insecure_channel(s.addresses[0]) as channel:
        reply = channel.unary_unary(CALL)(L.GRPC_REQ_FRAME.pack(1, Op.PING, 0, 0, 65536))
    assert L.RESP_FRAME.unpack_from(reply)[1] == Status.UNAVAILABLE
    ready.set()
    with kalos.connect(s.addresses[0], transport="grpc", timeout=TIMEOUT) as c:
        c.ping()
        assert c.epoch == 5


def test_a_message_over_the_sidecars_limit(
    server: Callable[..., tuple[GrpcServer, threading.Event]],
) -> None:
    s, ready = server(max_arena_bytes=L.MIN_ARENA_BYTES)
    ready.set()
    too_big = L.GRPC_REQ_FRAME.pack(1, Op.PING, 0, 200_000, 1 << 20) + bytes(200_000)
    options = [("grpc.max_send_message_length", 1 << 22)]
    with grpc.insecure_channel(s.addresses[0], options=options) as channel:
        with pytest.raises(grpc.RpcError) as info:
            channel.unary_unary(CALL)(too_big, timeout=TIMEOUT)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max" in info.value.details()
        # the largest body it takes (an arena asked beyond its max is clamped to it)
        body = L.GRPC_REQ_FRAME.pack(2, Op.PING, 0, 65536, 1 << 20) + bytes(65536)
        reply = channel.unary_unary(CALL)(body, timeout=TIMEOUT)
        assert L.RESP_FRAME.unpack_from(reply)[:2] == (2, Status.OK)


def test_configuration_errors(server: Callable[..., tuple[GrpcServer, threading.Event]]) -> None:
    for bad in ({"grpc": ("nohostport",)}, {"grpc": ("unix:",)}):
        with pytest.raises(ConfigError, match="grpc address"):
            SidecarConfig(name="c", dim=DIM, **bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="go together"):
        SidecarConfig(name="c", dim=DIM, grpc=("127.0.0.1:0",), grpc_tls_cert="c.pem")
    with pytest.raises(ConfigError, match="needs"):
        SidecarConfig(name="c", dim=DIM, grpc=("127.0.0.1:0",), grpc_tls_client_ca="ca.pem")
    with pytest.raises(ConfigError, match="grpc listener"):
        SidecarConfig(name="c", dim=DIM, grpc_tls_cert="c.pem", grpc_tls_key="k.pem")
    s, _ = server()
    taken = SidecarConfig(name="c", dim=DIM, grpc=(s.addresses[0],))
    with pytest.raises(ConfigError, match="cannot listen"):
        GrpcServer(
            taken,
            handle=lambda *a: (0, 0, 0, 0),
            lock=threading.Lock(),
            negotiate=lambda *a, **k: {},
            ready=threading.Event(),
        )


# -- a real sidecar: unix socket, metrics, TLS --------------------------------------------------


def test_unix_socket_listener_is_private(sidecar: Callable[..., RunningSidecar]) -> None:
    with tempfile.TemporaryDirectory(prefix="kg-") as d:
        path = os.path.join(d, "g.sock")
        sc = sidecar(dim=DIM, extra_args=("--grpc", f"unix:{path}"))
        assert sc.grpc_target() == f"unix:{path}"
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        with kalos.connect(f"unix:{path}", transport="grpc", timeout=TIMEOUT) as c:
            c.add(VECTORS[:3], IDS[:3])
            assert c.search(VECTORS[1], k=1).ids[0] == IDS[1]
        assert sc.stop() == 0
        assert not os.path.exists(path)  # removed at a clean stop


def test_metrics_count_grpc_requests(sidecar: Callable[..., RunningSidecar]) -> None:
    sc = sidecar(dim=DIM, extra_args=LOOPBACK)
    with grpc_client(sc) as c:
        for _ in range(5):
            c.search(VECTORS[0], k=2)
        admin = c.stats()["admin_port"]
    url = f"http://127.0.0.1:{admin}/metrics"
    with urllib.request.urlopen(url, timeout=TIMEOUT) as r:
        text = r.read().decode()
    line = 'kalos_responses_total{op="search",status="ok",transport="grpc"} 5.0'
    assert line in text


def make_certificate(directory: Path, name: str) -> tuple[Path, Path]:
    """A self-signed certificate for localhost and 127.0.0.1 (its own CA): (cert, key)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-days", "2", "-subj", f"/CN={name}", "-keyout", str(key), "-out", str(cert),
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
         "-addext", "basicConstraints=critical,CA:TRUE"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def test_tls_and_mutual_tls(sidecar: Callable[..., RunningSidecar], tmp_path: Path) -> None:
    cert, key = make_certificate(tmp_path, "sidecar")
    tls = ("--grpc-tls-cert", str(cert), "--grpc-tls-key", str(key))
    sc = sidecar(dim=DIM, name="tls", extra_args=(*LOOPBACK, *tls))
    target = sc.grpc_target()
    with kalos.connect(target, transport="grpc", tls=kalos.Tls(ca=cert), timeout=TIMEOUT) as c:
        c.add(VECTORS[:4], IDS[:4], payloads=["a", "b", "c", "d"])
        assert c.search(VECTORS[2], k=1).payloads == ["c"]
    with pytest.raises(ConnectError):  # plaintext to a TLS listener
        kalos.connect(target, transport="grpc", timeout=5)
    other, _ = make_certificate(tmp_path, "other")
    with pytest.raises(ConnectError):  # a CA that did not sign the sidecar's certificate
        kalos.connect(target, transport="grpc", tls=kalos.Tls(ca=other), timeout=5)

    client_cert, client_key = make_certificate(tmp_path, "client")
    mutual = (*tls, "--grpc-tls-client-ca", str(client_cert))
    sc = sidecar(dim=DIM, name="mtls", extra_args=(*LOOPBACK, *mutual))
    target = "localhost:" + sc.grpc_target().rsplit(":", 1)[1]
    with pytest.raises(ConnectError):  # no client certificate
        kalos.connect(target, transport="grpc", tls=kalos.Tls(ca=cert), timeout=5)
    good = kalos.Tls(ca=cert, cert=client_cert, key=client_key)
    with kalos.connect(target, transport="grpc", tls=good, timeout=TIMEOUT) as c:
        assert c.stats()["grpc"] == [sc.grpc_target()]
    with pytest.raises(ConfigError, match="cannot read"):
        kalos.connect(target, transport="grpc", tls=kalos.Tls(ca=tmp_path / "missing.pem"))


def test_durable_writes_over_grpc_survive_a_kill(tmp_path: Path) -> None:
    """Logged writes over grpc are acknowledged once durable; snapshots fork beside grpc's
    threads; a sidecar killed and restarted on the same data serves them all."""
    run, data = str(tmp_path / "run"), str(tmp_path / "data")
    durable = ("--data-dir", data, "--snapshot-mb", "0.004", *LOOPBACK)
    log = tmp_path / "sidecar.log"
    with (
        open(log, "w") as stderr,
        isolated_sidecar(
            dim=DIM, name="d", runtime_dir=run, extra_args=durable, stderr=stderr
        ) as sc,
    ):
        c = grpc_client(sc)
        for i in range(40):  # ~1 KiB of log each: a snapshot due after every few
            c.add(VECTORS[i], IDS[i], payloads="p" * 1000)
        c.put("plan", "step 3")
        deadline = time.monotonic() + TIMEOUT
        while c.stats()["durability"]["snapshot_lsn"] == 0:  # a forked child writes it
            assert time.monotonic() < deadline, "no snapshot was taken"
            time.sleep(0.05)
        assert c.stats()["durability"]["last_snapshot"]["forked"]
        sc.process.kill()
        sc.process.wait()
    assert "snapshot writer" not in log.read_text()  # no forked writer failed (grpc's threads)
    with isolated_sidecar(dim=DIM, name="d", runtime_dir=run, extra_args=durable) as sc:
        c = grpc_client(sc)
        assert c.stats()["items"] == 40
        assert c.get("plan").value == b"step 3"
        assert c.search(VECTORS[9], k=1).ids[0] == IDS[9]
        c.close()
