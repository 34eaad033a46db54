"""The admin endpoint: /healthz, /readyz and /metrics against real sidecar processes.

Metrics are scraped over HTTP and parsed with prometheus_client's own parser; the counts must
equal the requests the test made. Nothing here is timed.
"""

from __future__ import annotations

import fcntl
import inspect
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import numpy as np
import pytest

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import kalos  # noqa: E402
from kalos.errors import ConfigError  # noqa: E402
from kalos.protocol import layout as L  # noqa: E402
from kalos.protocol.codes import Status  # noqa: E402
from kalos.server import Sidecar, SidecarConfig  # noqa: E402
from kalos.server.admin import (  # noqa: E402
    ADMIN_HOST,
    HEALTHZ_PATH,
    METRICS_PATH,
    PATHS,
    READYZ_PATH,
    AdminServer,
    SidecarCollector,
)
from kalos.server.request_stats import RequestStats, request_families  # noqa: E402
from kalos.testing import RunningSidecar, isolated_sidecar  # noqa: E402
from kalos.transport.handshake import client_hello, recv_message, send_message  # noqa: E402
from kalos.transport.uds import recv_exactly  # noqa: E402

DIM = 8
TIMEOUT = 60.0


def get(port: int, path: str) -> tuple[int, str]:
    """GET http://127.0.0.1:port/path: (status, body); HTTP errors are answers too."""
    try:
        with urllib.request.urlopen(f"http://{ADMIN_HOST}:{port}{path}", timeout=TIMEOUT) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics, by (sample name, sorted labels)."""
    status, text = get(port, METRICS_PATH)
    assert status == 200
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def admin_port(sc: RunningSidecar) -> int:
    with sc.connect(transport="uds", timeout=TIMEOUT) as client:
        port = client.stats()["admin_port"]
    assert isinstance(port, int) and port > 0
    return port


def wait_until(check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((ADMIN_HOST, 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("transport", ["shm", "uds"])
def test_metrics_count_the_requests_made(
    sidecar: Callable[..., RunningSidecar], transport: str
) -> None:
    sc = sidecar(dim=DIM)
    port = admin_port(sc)  # one uds connection, one stats request
    rng = np.random.default_rng(0)
    n_add, n_search = 3, 7
    with sc.connect(transport=transport, timeout=TIMEOUT) as client:
        for i in range(n_add):
            client.add(rng.standard_normal((4, DIM), dtype=np.float32), np.arange(4) + 4 * i)
        for _ in range(n_search):
            client.search(rng.standard_normal(DIM, dtype=np.float32), k=3)
        with pytest.raises(kalos.NotFound):
            client.context("no-such-session", max_tokens=10)
        # a uds request is counted once its reply is sent: the last one may still be counting
        wait_until(lambda: sample(scrape(port), "kalos_responses_total", op="context",
                                  transport=transport, status="not_found") == 1)  # fmt: skip
        m = scrape(port)
        assert sample(m, "kalos_open_channels", transport=transport) == 1
    for op, n in (("add", n_add), ("search", n_search)):
        assert sample(m, "kalos_responses_total", op=op, transport=transport, status="ok") == n
        assert sample(m, "kalos_request_duration_seconds_count", op=op, transport=transport) == n
        for stage in ("queue", "compute", "write"):
            labels = {"op": op, "transport": transport, "stage": stage}
            assert sample(m, "kalos_request_stage_duration_seconds_count", **labels) == n
            inf = sample(m, "kalos_request_stage_duration_seconds_bucket", le="+Inf", **labels)
            assert inf == n
    assert (
        sample(m, "kalos_responses_total", op="context", transport=transport, status="not_found")
        == 1
    )
    assert sample(m, "kalos_responses_total", op="stats", transport="uds", status="ok") == 1
    # Cumulative buckets never decrease and end at the count.
    buckets = sorted(
        (float(dict(labels)["le"]), v)
        for (name, labels), v in m.items()
        if name == "kalos_request_duration_seconds_bucket"
        and dict(labels)["op"] == "search"
        and dict(labels)["transport"] == transport
    )
    values = [v for _, v in buckets]
    assert values == sorted(values) and values[-1] == n_search
    assert sample(m, "kalos_request_duration_seconds_sum", op="search", transport=transport) > 0
    assert sample(m, "kalos_index_items") == 4 * n_add
    assert sample(m, "kalos_index_bytes") > 0
    assert sample(m, "kalos_token_heap_bytes") == 256 << 20  # --token-heap-mb's default
    assert sample(m, "kalos_token_heap_used_bytes") == 0  # no session yet
    assert sample(m, "kalos_token_heap_fallbacks_total") == 0
    assert sample(m, "kalos_session_index_slots") == 1 << 16  # --session-index-slots
    assert sample(m, "kalos_session_index_sessions") == 0
    assert sample(m, "kalos_session_index_rebuilds_total") == 0
    assert sample(m, "kalos_client_connects_total") == 2
    assert sample(m, "kalos_ready") == 1
    # Both clients are gone once the sidecar noticed their sockets close.
    wait_until(lambda: sample(scrape(port), "kalos_client_disconnects_total") == 2)
    m = scrape(port)
    assert sample(m, "kalos_open_channels", transport=transport) == 0
    # A finished connection's counts are kept.
    assert sample(m, "kalos_responses_total", op="search", transport=transport, status="ok") == (
        n_search
    )


def test_protocol_errors_are_counted(sidecar: Callable[..., RunningSidecar]) -> None:
    sc = sidecar(dim=DIM)
    port = admin_port(sc)
    # A handshake that is not a Kalos hello.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(TIMEOUT)
        s.connect(sc.socket)
        send_message(s, {"magic": "NOPE"})
        reply, _ = recv_message(s)
        assert reply["error"] == "bad_hello"
    # An op code the sidecar does not know, then a body larger than the arena.
    sock, reply, fds = client_hello(sc.socket, "uds", L.MIN_ARENA_BYTES, timeout=TIMEOUT)
    for fd in fds:
        os.close(fd)
    with sock:
        head = bytearray(L.RESP_FRAME.size)
        sock.sendall(L.REQ_FRAME.pack(1, 99, 0, 0, 0, 0))
        recv_exactly(sock, memoryview(head))
        _, status, _, n, *_ = L.RESP_FRAME.unpack_from(head)
        assert status == Status.UNKNOWN_OP
        recv_exactly(sock, memoryview(bytearray(n)))  # the message
        sock.sendall(L.REQ_FRAME.pack(2, 1, 0, reply["arena_bytes"] + 1, 0, 0))
        recv_exactly(sock, memoryview(head))
        assert L.RESP_FRAME.unpack_from(head)[1] == Status.PAYLOAD_TOO_LARGE
    m = scrape(port)
    assert sample(m, "kalos_protocol_errors_total", kind="bad_hello") == 1
    assert sample(m, "kalos_protocol_errors_total", kind="unknown_op") == 1
    assert sample(m, "kalos_protocol_errors_total", kind="oversized_request") == 1
    assert sample(m, "kalos_protocol_errors_total", kind="protocol_mismatch") == 0
    assert (
        sample(m, "kalos_responses_total", op="unknown", transport="uds", status="unknown_op") == 1
    )


def test_health_and_readiness_of_a_ready_sidecar(sidecar: Callable[..., RunningSidecar]) -> None:
    port = admin_port(sidecar(dim=DIM))
    assert get(port, HEALTHZ_PATH)[0] == 200
    status, body = get(port, READYZ_PATH)
    assert status == 200 and '"ready"' in body
    assert get(port, "/nothing-here")[0] == 404


def test_readyz_is_503_until_recovery_is_done(tmp_path) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    port = free_port()
    # Hold the data directory's lock: the sidecar waits for it inside recovery (up to 10 s).
    lock_fd = os.open(data_dir / "LOCK", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)
    seen: dict[str, tuple[int, str]] = {}

    def watch() -> None:
        try:
            deadline = time.monotonic() + TIMEOUT
            while time.monotonic() < deadline:
                try:
                    seen["readyz"] = get(port, READYZ_PATH)
                    seen["healthz"] = get(port, HEALTHZ_PATH)
                    return
                except OSError:  # not listening yet
                    time.sleep(0.02)
        finally:
            os.close(lock_fd)  # lets recovery go on

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        args = ("--data-dir", str(data_dir), "--admin-port", str(port))
        with isolated_sidecar(dim=DIM, extra_args=args):
            watcher.join()
            assert seen["readyz"][0] == 503 and '"starting"' in seen["readyz"][1]
            assert seen["healthz"][0] == 200
            assert get(port, READYZ_PATH)[0] == 200
            assert "kalos_wal_durable_lsn" in get(port, METRICS_PATH)[1]
    finally:
        watcher.join()


def test_the_endpoint_binds_loopback_only() -> None:
    # No way to ask for another address: no host parameter, no CLI flag.
    assert "host" not in inspect.signature(AdminServer).parameters
    assert not any("host" in f.name for f in SidecarConfig.__dataclass_fields__.values())
    from kalos.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--name", "x", "--dim", "4", "--admin-host", "0.0.0.0"])
    config = SidecarConfig(name="loop", dim=4, admin_port=0)
    sc = Sidecar(config)
    try:
        assert sc.admin is not None
        assert sc.admin.host == "127.0.0.1"
        # Reachable on loopback, not on the host's other addresses.
        assert get(sc.admin.port, HEALTHZ_PATH)[0] == 200
        for addr in _other_addresses():
            with socket.socket() as s, pytest.raises(OSError):
                s.settimeout(5)
                s.connect((addr, sc.admin.port))
    finally:
        sc.admin.close()


def _other_addresses() -> list[str]:
    """This host's non-loopback IPv4 address, if it has one (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            addr = s.getsockname()[0]
        except OSError:
            return []
    return [] if addr.startswith("127.") else [addr]


def test_a_taken_port_stops_the_start_only_when_explicit() -> None:
    with socket.socket() as taken:
        taken.bind((ADMIN_HOST, 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match="admin"):
            Sidecar(SidecarConfig(name="taken", dim=4, admin_port=port))
        lenient = Sidecar(
            SidecarConfig(name="taken", dim=4, admin_port=port, admin_port_strict=False)
        )
        assert lenient.admin is None
    with pytest.raises(ConfigError):
        SidecarConfig(name="bad", dim=4, admin_port=70000)


def test_no_admin_turns_it_off(sidecar: Callable[..., RunningSidecar]) -> None:
    sc = sidecar(dim=DIM, extra_args=("--no-admin",))
    with sc.connect(timeout=TIMEOUT) as client:
        assert client.stats()["admin_port"] is None


def test_buckets_are_powers_of_two_of_nanoseconds() -> None:
    rs = RequestStats("shm")
    rs.record(5, Status.OK, 1500, 3_000_000, 0)  # queue 1.5 µs, compute 3 ms
    rs.record(500, Status.UNKNOWN_OP, 0, 10, 0)  # an op code out of range counts as unknown
    families = {f.name: f for f in request_families({"shm": rs})}
    by_stage = {
        (s.labels["stage"], s.labels["le"]): s.value
        for s in families["kalos_request_stage_duration_seconds"].samples
        if s.name.endswith("_bucket") and s.labels["op"] == "search"
    }
    assert by_stage[("queue", repr(1024 / 1e9))] == 0
    assert by_stage[("queue", repr(2048 / 1e9))] == 1  # 1500 ns < 2**11 ns
    assert by_stage[("compute", repr(2**21 / 1e9))] == 0
    assert by_stage[("compute", repr(2**22 / 1e9))] == 1  # 3 ms < 2**22 ns
    unknown = [s for s in families["kalos_responses"].samples if s.labels["op"] == "unknown"]
    assert [s.labels["status"] for s in unknown] == ["unknown_op"]


def test_paths_are_the_ones_served() -> None:
    assert PATHS == (HEALTHZ_PATH, READYZ_PATH, METRICS_PATH)


def test_gpu_families_count_prefilter_searches_even_without_memory_figures() -> None:
    # a cuda sidecar's GPU families, on the CPU: a stand-in sidecar whose index counted
    # prefiltered searches; torch's memory query fails here (no CUDA), the counters still come
    from types import SimpleNamespace

    index = SimpleNamespace(prefilter_searches=7, prefilter_fallbacks=2)
    stand_in = SimpleNamespace(config=SimpleNamespace(device="cuda:0"),
                               memories=SimpleNamespace(index=index),
                               poller=SimpleNamespace(device_published=5))  # fmt: skip
    collector = SidecarCollector(stand_in, None)  # type: ignore[arg-type]
    got = {f.name: f.samples[0].value for f in collector._gpu_families()}
    assert got["kalos_gpu_prefilter_searches"] == 7
    assert got["kalos_gpu_prefilter_fallbacks"] == 2
    assert got["kalos_gpu_published_responses"] == 5
    cpu = SimpleNamespace(config=SimpleNamespace(device="cpu"))
    assert list(SidecarCollector(cpu, None)._gpu_families()) == []  # type: ignore[arg-type]
