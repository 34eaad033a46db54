"""The sidecar process: lifecycle, signals, its socket, its control segment, its stats.

Every sidecar here is a real ``python -m kalos serve`` process in a private runtime directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import kalos
from conftest import DIM, TIMEOUT, stop_process
from kalos import _native
from kalos.errors import ConnectError, SidecarGone
from kalos.protocol import layout as L
from kalos.protocol.codes import PROTOCOL_VERSION, Op, Status
from kalos.server import Sidecar, SidecarConfig
from kalos.testing import RunningSidecar
from kalos.transport.handshake import recv_message, send_message

Start = Callable[..., RunningSidecar]


def kalos_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kalos", *args], capture_output=True, text=True, timeout=TIMEOUT
    )


def wait_until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# -- stopping ---------------------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_stops_it_cleanly(sidecar: Start, sig: int) -> None:
    sc = sidecar()
    shm = sc.connect(timeout=TIMEOUT)
    uds = sc.connect(transport="uds", timeout=TIMEOUT)
    shm.add(np.ones(DIM), 1)
    uds.ping()
    time.sleep(0.3)  # let the poller park: a parked sidecar must wake up for the signal too
    assert os.path.exists(sc.socket)
    assert sc.stop(sig, timeout=TIMEOUT) == 0
    assert not os.path.exists(sc.socket)
    # its clients learn that it is gone, and that nobody answers any more
    for client in (shm, uds):
        with pytest.raises((SidecarGone, ConnectError)):
            client.ping()
        with pytest.raises(ConnectError):
            client.ping()
    shm.close()
    uds.close()


@pytest.mark.parametrize("transport", ["shm", "uds"])
def test_a_call_in_flight_at_stop_completes_or_raises_sidecar_gone(
    sidecar: Start, transport: str
) -> None:
    sc = sidecar()
    client = sc.connect(transport=transport, timeout=TIMEOUT)
    client.add(np.ones(DIM), 1)
    outcome: list[object] = []
    ready, go = threading.Event(), threading.Event()

    def call() -> None:
        client.ping()  # this thread's channel exists before the sidecar stops
        ready.set()
        go.wait()
        try:
            outcome.append(client.search(np.ones(DIM), k=1, copy=True).ids.tolist())
        except Exception as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=call)
    waiter.start()
    ready.wait(TIMEOUT)
    stop_process(sc.process.pid)
    go.set()
    time.sleep(0.3)  # the request is published (or sent) and waits
    os.kill(sc.process.pid, signal.SIGTERM)
    os.kill(sc.process.pid, signal.SIGCONT)
    waiter.join(TIMEOUT / 2)
    assert not waiter.is_alive(), "the call hung on a stopping sidecar"
    assert outcome == [[1]] or isinstance(outcome[0], SidecarGone), outcome
    assert sc.process.wait(TIMEOUT) == 0
    client.close()


def test_stopping_marks_the_control_segment(sidecar: Start) -> None:
    sc = sidecar()
    client = sc.connect(timeout=TIMEOUT)
    ctrl = client._channel()._ctrl  # type: ignore[attr-defined]
    assert _native.load_acquire(ctrl.addr + L.CTRL_STATE) == L.STATE_READY
    assert sc.stop(timeout=TIMEOUT) == 0
    # the client still maps the segment: it reads why its sidecar went away
    assert _native.load_acquire(ctrl.addr + L.CTRL_STATE) == L.STATE_STOPPING
    client.close()


def test_stale_socket_of_a_killed_sidecar(sidecar: Start) -> None:
    first = sidecar(name="mem")
    first.connect(timeout=TIMEOUT).close()
    first.process.kill()
    first.process.wait(TIMEOUT)
    assert os.path.exists(first.socket)  # SIGKILL leaves the socket behind
    with pytest.raises(ConnectError):
        kalos.connect("mem", runtime_dir=first.runtime_dir, timeout=TIMEOUT)
    second = sidecar(name="mem", runtime_dir=first.runtime_dir)
    assert second.process.poll() is None
    with second.connect(timeout=TIMEOUT) as client:
        assert client.stats()["pid"] == second.process.pid


def test_a_second_sidecar_of_the_same_name_is_refused(sidecar: Start) -> None:
    first = sidecar(name="mem")
    with first.connect(timeout=TIMEOUT) as client:
        client.add(np.ones(DIM), 7)
        done = kalos_cli("serve", "--name", "mem", "--dim", str(DIM),
                         "--runtime-dir", first.runtime_dir)  # fmt: skip
        assert done.returncode == 2
        assert "already serving" in done.stderr
        assert "admin" not in done.stderr  # said first, before any port or index is set up
        # the first one is untouched: its socket, its clients, its data
        assert os.path.exists(first.socket)
        assert client.search(np.ones(DIM), k=1).ids.tolist() == [7]
        assert client.stats()["pid"] == first.process.pid
    with first.connect(timeout=TIMEOUT) as again:  # and it still accepts new clients
        again.ping()


@pytest.mark.parametrize("flag", ["--data-dir", "--runtime-dir"])
def test_a_directory_it_cannot_use_is_refused_at_once(tmp_path: Path, flag: str) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for path, why in [
        (a_file, "it is not a directory"),
        (a_file / "below", "Not a directory"),
        ("/proc/no-such-dir", "No such file or directory"),
    ]:
        args = ["serve", "--name", "dirs", "--dim", str(DIM), flag, str(path)]
        if flag != "--runtime-dir":
            args += ["--runtime-dir", str(tmp_path / "rt")]
        done = kalos_cli(*args)
        assert done.returncode == 2, done.stderr
        what = "data directory" if flag == "--data-dir" else "runtime directory"
        assert f"kalos: cannot use {path} as the {what}: {why}" in done.stderr
        assert "Traceback" not in done.stderr


def test_a_closed_channel_gives_its_segment_back_at_once(sidecar: Start) -> None:
    """Each channel's segment (2 arenas: 2 MiB by default) is mapped, and a descriptor of it
    open, until the sidecar drops the channel: at its disconnect, not at some later full
    garbage collection (a reference cycle held them: 40-120 of them after 2,000 connects)."""
    running = sidecar(name="churn")

    def channel_segments() -> int:
        fd_dir = f"/proc/{running.process.pid}/fd"
        links = []
        for fd in os.listdir(fd_dir):
            with contextlib.suppress(OSError):
                links.append(os.readlink(f"{fd_dir}/{fd}"))
        return sum(link.startswith("/memfd:kalos-channel") for link in links)

    for _ in range(100):
        with running.connect(timeout=TIMEOUT) as client:
            client.ping()
    # each disconnect ends on its listener thread; the poller's loop may still hold the
    # last channel it swept
    deadline = time.monotonic() + TIMEOUT
    while channel_segments() > 1:
        assert time.monotonic() < deadline, f"{channel_segments()} segments still open"
        time.sleep(0.01)


def test_out_of_descriptors_it_refuses_clearly_and_serves_again(tmp_path: Path) -> None:
    """With its open-file limit spent (here a hard limit of 48), a client the sidecar cannot
    give a channel gets a ConnectError saying so, or waits in the listen queue until its
    deadline; once channels close, the next client is served: the listener never stops (a
    failed accept used to end it for good, and every later client timed out)."""
    import resource

    from kalos.testing import serve_command, wait_for_socket

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (48, 48))

    cmd = serve_command("fds", DIM, str(tmp_path), "--admin-port", "0")
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, preexec_fn=limit)
    path = str(tmp_path / "fds.sock")
    try:
        wait_for_socket(path, proc)
        client = kalos.connect("fds", runtime_dir=str(tmp_path), timeout=2.0)
        results: list[str] = []
        hold = threading.Event()

        def a_channel_held() -> None:
            try:
                client.ping()
                results.append("ok")
            except ConnectError as exc:
                results.append(str(exc))
            hold.wait()

        threads = [threading.Thread(target=a_channel_held) for _ in range(60)]
        for t in threads:
            t.start()
        while len(results) < len(threads):
            time.sleep(0.01)
        assert 0 < results.count("ok") < len(threads)
        refusals = [r for r in results if r != "ok"]
        assert any("could not open a channel: Too many open files" in r for r in refusals)
        hold.set()
        for t in threads:
            t.join()
        deadline = time.monotonic() + TIMEOUT  # the channels close on the listener's threads
        while True:
            try:
                with kalos.connect("fds", runtime_dir=str(tmp_path), timeout=2.0) as again:
                    again.ping()
                break
            except ConnectError:
                assert time.monotonic() < deadline
        assert proc.poll() is None
        client.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=TIMEOUT)
    assert b"Traceback" not in err


def test_a_connection_whose_thread_cannot_start_ends_and_the_listener_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kalos.server.listener as listener_module
    from kalos.server import Sidecar, SidecarConfig

    sidecar = Sidecar(SidecarConfig(name="threads", dim=DIM, runtime_dir=str(tmp_path),
                                    admin_port=None)).start()  # fmt: skip
    refused = [1]  # the next connection's thread does not start

    class Thread(threading.Thread):
        def start(self) -> None:
            if self.name == "kalos-conn" and refused:
                refused.pop()
                raise RuntimeError("can't start new thread")
            super().start()

    monkeypatch.setattr(listener_module.threading, "Thread", Thread)
    try:
        with pytest.raises(ConnectError):
            kalos.connect("threads", runtime_dir=str(tmp_path), timeout=5.0)
        with kalos.connect("threads", runtime_dir=str(tmp_path), timeout=5.0) as client:
            client.ping()
        assert sidecar.listener is not None and sidecar.listener.accept_errors == 1
    finally:
        monkeypatch.undo()
        sidecar.stop()


def test_it_raises_its_soft_open_file_limit_to_what_its_channels_need(tmp_path: Path) -> None:
    import resource

    from kalos.server.sidecar import OPEN_FILES_BESIDE_CHANNELS
    from kalos.testing import serve_command, wait_for_socket

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    want = 300 + OPEN_FILES_BESIDE_CHANNELS
    if hard != resource.RLIM_INFINITY and hard < want:
        pytest.skip(f"this process's hard open-file limit is {hard}")

    def low_soft_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))

    cmd = serve_command("nofile", DIM, str(tmp_path), "--admin-port", "0", "--max-channels", "300")
    proc = subprocess.Popen(cmd, preexec_fn=low_soft_limit)
    try:
        wait_for_socket(str(tmp_path / "nofile.sock"), proc)
        with open(f"/proc/{proc.pid}/limits") as f:
            line = next(x for x in f if x.startswith("Max open files"))
        assert int(line.split()[3]) == want
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(TIMEOUT)


def test_sidecars_of_different_names_share_a_directory(sidecar: Start) -> None:
    a = sidecar(name="a")
    b = sidecar(name="b", runtime_dir=a.runtime_dir, dim=3)
    with a.connect(timeout=TIMEOUT) as ca, b.connect(timeout=TIMEOUT) as cb:
        assert ca.dim == DIM and cb.dim == 3
        assert ca.stats()["pid"] != cb.stats()["pid"]


def test_a_world_writable_runtime_dir_is_refused(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "open")
    os.mkdir(path)
    os.chmod(path, 0o777)
    done = kalos_cli("serve", "--name", "x", "--dim", "4", "--runtime-dir", path)
    assert done.returncode == 2
    assert "world-writable" in done.stderr
    assert not os.path.exists(os.path.join(path, "x.sock"))


def test_bad_configuration_exits_2(tmp_path: object) -> None:
    for args in (
        ["--dim", "0"],
        ["--dim", "4", "--device", "tpu"],
        ["--dim", "4", "--index", "cpu:nope"],
    ):
        done = kalos_cli("serve", "--name", "x", "--runtime-dir", str(tmp_path), *args)
        assert done.returncode == 2, (args, done.stderr)
        assert "kalos:" in done.stderr


# -- the status command and the counters ------------------------------------------------------


def test_status_prints_json(sidecar: Start) -> None:
    sc = sidecar(name="stats-me", metric="l2")
    with sc.connect(timeout=TIMEOUT) as client:
        client.add(np.eye(DIM), np.arange(DIM), payloads=["abc"] * DIM)
    done = kalos_cli("status", "--name", "stats-me", "--runtime-dir", sc.runtime_dir,
                     "--timeout", str(TIMEOUT))  # fmt: skip
    assert done.returncode == 0, done.stderr
    stats = json.loads(done.stdout)
    assert stats["items"] == DIM
    assert stats["payload_bytes"] == 3 * DIM
    assert stats["name"] == "stats-me" and stats["metric"] == "l2" and stats["dim"] == DIM
    assert stats["pid"] == sc.process.pid
    assert stats["requests"]["add"] == 1


def test_status_of_no_sidecar_exits_2(tmp_path: object) -> None:
    done = kalos_cli("status", "--name", "nobody", "--runtime-dir", str(tmp_path))
    assert done.returncode == 2
    assert "no sidecar" in done.stderr


def test_stats_counters_move(sidecar: Start) -> None:
    sc = sidecar()
    watcher = sc.connect(transport="uds", timeout=TIMEOUT)
    s0 = watcher.stats()
    assert s0["connects"] == 1 and s0["uds_connections"] == 1 and s0["channels"] == 0
    shm = sc.connect(timeout=TIMEOUT)
    shm.add(np.ones((3, DIM)), [1, 2, 3], payloads=["a", "b", "c"])
    shm.search(np.ones(DIM), k=2)
    shm.search(np.ones(DIM), k=2)
    shm.remove([3])
    shm.ping()
    with pytest.raises(kalos.InvalidRequest):
        shm.search(np.full(DIM, np.nan), k=1)
    s1 = watcher.stats()
    assert s1["connects"] == 2 and s1["channels"] == 1
    assert s1["items"] == 2 and s1["payload_bytes"] == 2
    moved = {op: s1["requests"][op] - s0["requests"][op] for op in s1["requests"]}
    assert {op: n for op, n in moved.items() if n} == {
        "ping": 1, "stats": 1, "add": 1, "remove": 1, "search": 3,
    }  # fmt: skip
    assert s1["errors"] == s0["errors"] + 1
    assert s1["epoch"] == s0["epoch"] and s1["pid"] == s0["pid"]
    assert s1["uptime_s"] >= s0["uptime_s"]
    shm.close()
    wait_until(lambda: watcher.stats()["channels"] == 0, "the closed channel to be freed")
    watcher.close()


# -- what a client maps -----------------------------------------------------------------------


def test_control_segment_and_channel_header(sidecar: Start) -> None:
    sc = sidecar(metric="cosine")
    with sc.connect(timeout=TIMEOUT) as client:
        t = client._channel()
        ctrl = t._ctrl  # type: ignore[attr-defined]
        (magic, layout, major, minor, epoch, pid, state, dim, metric, max_k, zero,
         start_ns) = L.CTRL_HEADER.unpack_from(ctrl.buf, 0)  # fmt: skip
        assert (magic, layout, major, minor) == (b"KALO", 1, *PROTOCOL_VERSION)
        assert epoch == client.info["epoch"] != 0
        assert pid == sc.process.pid
        assert state == L.STATE_READY
        assert (dim, metric, max_k, zero) == (DIM, 1, 1024, 0)
        assert 0 < start_ns <= time.monotonic_ns()
        chan = t._chan  # type: ignore[attr-defined]
        cmagic, clayout, cid, cepoch, arena, req_off, resp_off = L.CHAN_HEADER.unpack_from(
            chan.buf, 0
        )
        assert (cmagic, clayout, cepoch) == (b"KCHN", 1, epoch)
        assert cid == client.info["channel_id"]
        assert (arena, req_off, resp_off) == (1 << 20, 4096, 4096 + (1 << 20))
        # the heartbeat goes on while the sidecar is idle (parked)
        beats = _native.load_acquire(ctrl.addr + L.CTRL_HEARTBEAT_COUNT)
        wait_until(
            lambda: _native.load_acquire(ctrl.addr + L.CTRL_HEARTBEAT_COUNT) > beats + 2,
            "heartbeats",
        )
        assert 0 < _native.load_acquire(ctrl.addr + L.CTRL_HEARTBEAT_NS) <= time.monotonic_ns()


@pytest.mark.parametrize(
    "asked, given",
    [(1000, 65536), (65536, 65536), (70000, 73728), (1 << 20, 1 << 20), (1 << 40, 64 << 20)],
)
def test_arena_size_is_clamped_and_page_rounded(sidecar: Start, asked: int, given: int) -> None:
    sc = sidecar()
    for transport in ("shm", "uds"):
        with sc.connect(transport=transport, arena_bytes=asked, timeout=TIMEOUT) as client:
            assert client.info["arena_bytes"] == given
            assert len(client._channel().request_buffer) == given
            client.ping()


def test_every_start_has_a_new_epoch(sidecar: Start) -> None:
    first = sidecar(name="e")
    with first.connect(timeout=TIMEOUT) as c:
        epoch = c.info["epoch"]
    first.stop()
    second = sidecar(name="e", runtime_dir=first.runtime_dir)
    with second.connect(timeout=TIMEOUT) as c:
        assert c.info["epoch"] != epoch


# -- the handshake socket faces anything ------------------------------------------------------


def _raw(sc: RunningSidecar) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(TIMEOUT)
    s.connect(sc.socket)
    return s


def _hello(**fields: object) -> dict:
    hello = {"magic": "KALO", "protocol": [1, 0], "transport": "shm", "arena_bytes": 65536}
    hello.update(fields)
    return hello


def _reply_or_eof(s: socket.socket) -> dict | None:
    try:
        reply, fds = recv_message(s)
    except ConnectionError:
        return None
    for fd in fds:
        os.close(fd)
    return reply


BAD_HELLOS = [
    ("bad magic", _hello(magic="NOPE"), "bad_hello"),
    ("no protocol", {"magic": "KALO", "transport": "shm"}, "bad_hello"),
    ("protocol not a pair", _hello(protocol=[1]), "bad_hello"),
    ("protocol not numbers", _hello(protocol=[1, "x"]), "bad_hello"),
    ("bad transport", _hello(transport="carrier-pigeon"), "bad_transport"),
    ("old major", _hello(protocol=[0, 9]), "protocol_mismatch"),
]


@pytest.mark.parametrize("hello, error", [(h, e) for _, h, e in BAD_HELLOS],
                         ids=[n for n, _, _ in BAD_HELLOS])  # fmt: skip
def test_bad_hellos_are_refused_with_a_reason(sidecar: Start, hello: dict, error: str) -> None:
    sc = sidecar()
    with _raw(sc) as s:
        send_message(s, hello)
        reply = _reply_or_eof(s)
    assert reply is not None and reply["ok"] is False
    assert reply["error"] == error
    assert reply.get("message")
    with sc.connect(timeout=TIMEOUT) as client:
        client.ping()


def test_garbage_on_the_socket_never_takes_it_down(sidecar: Start) -> None:
    sc = sidecar()
    with sc.connect(timeout=TIMEOUT) as client:
        client.add(np.ones(DIM), 5)
        frames = [
            b"",  # connect and hang up
            struct.pack("<I", 0xFFFFFFFF),  # a length past the limit
            struct.pack("<I", 9) + b"not json!",
            struct.pack("<I", 6) + b"[1, 2]",  # JSON, not an object
            struct.pack("<I", 100) + b"short",  # then hang up mid-message
            os.urandom(300),
        ]
        for frame in frames:
            with _raw(sc) as s:
                if frame:
                    s.sendall(frame)
                s.shutdown(socket.SHUT_WR)
                reply = _reply_or_eof(s)
                assert reply is None or reply["ok"] is False
            assert client.search(np.ones(DIM), k=1).ids.tolist() == [5]


def test_a_silent_connection_does_not_block_others(sidecar: Start) -> None:
    sc = sidecar()
    with _raw(sc):  # connects and says nothing
        with sc.connect(timeout=TIMEOUT) as client:
            client.ping()
        with sc.connect(transport="uds", timeout=TIMEOUT) as client:
            client.ping()


def test_uds_frame_longer_than_the_arena(sidecar: Start) -> None:
    sc = sidecar()
    with _raw(sc) as s:
        send_message(s, _hello(transport="uds"))
        reply = _reply_or_eof(s)
        assert reply is not None and reply["ok"] and reply["arena_bytes"] == 65536
        s.sendall(L.REQ_FRAME.pack(1, Op.PING, 0, 65537, 0, 0))
        head = b""
        while len(head) < L.RESP_FRAME.size:
            chunk = s.recv(L.RESP_FRAME.size - len(head))
            assert chunk, "no response frame"
            head += chunk
        seq, status, _, n, *_ = L.RESP_FRAME.unpack(head)
        assert (seq, status) == (1, Status.PAYLOAD_TOO_LARGE)
        body = s.recv(n, socket.MSG_WAITALL)
        assert b"exceeds the arena" in body
        assert s.recv(1) == b""  # and the stream is closed: it cannot be resynchronised
    with sc.connect(transport="uds", timeout=TIMEOUT) as client:
        client.ping()


# -- who may connect --------------------------------------------------------------------------

NOBODY = 65534


def _hello_as(uid: int, path: str) -> dict:
    """Handshakes from a forked child running as ``uid``; returns the sidecar's reply."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(r)
            os.setgid(uid)
            os.setuid(uid)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(TIMEOUT)
            s.connect(path)
            # a refused peer is answered (and hung up on) before its hello is read
            with contextlib.suppress(BrokenPipeError):
                send_message(s, _hello())
            reply, _ = recv_message(s)
            fields = {k: reply.get(k) for k in ("ok", "error", "message")}
            os.write(w, json.dumps(fields).encode())
        except BaseException as exc:
            os.write(w, json.dumps({"exception": repr(exc)}).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        out = json.loads(f.read())
    os.waitpid(pid, 0)
    return out


def _open_to_everyone(sc: RunningSidecar) -> None:
    # the sidecar makes its socket 0600 in a 0700 directory; open them so that the peer
    # credential check (SO_PEERCRED) is what refuses, not the file mode
    os.chmod(sc.runtime_dir, 0o711)
    os.chmod(sc.socket, 0o666)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to connect as another uid")
def test_max_channels_counts_shm_channels_and_uds_connections(sidecar: Start) -> None:
    """--max-channels bounds what the sidecar holds per client thread: shm channels and uds
    connections (each a thread of its own) together. One more handshake is refused as busy
    (a ConnectError for the client), and a closed one frees its place."""
    sc = sidecar(extra_args=("--max-channels", "2"))
    shm = sc.connect(timeout=TIMEOUT)
    uds = sc.connect(transport="uds", timeout=TIMEOUT)
    assert shm.ping() and uds.ping()
    for transport in ("shm", "uds"):
        with pytest.raises(ConnectError, match="too many channels"):
            sc.connect(transport=transport, timeout=TIMEOUT).ping()
    uds.close()
    wait_until(lambda: shm.stats()["uds_connections"] == 0, "the uds connection to close")
    with sc.connect(transport="uds", timeout=TIMEOUT) as again:
        assert again.ping()
    assert shm.stats()["rejected"]["busy"] == 2
    shm.close()


def test_another_uid_is_refused(sidecar: Start) -> None:
    sc = sidecar()
    _open_to_everyone(sc)
    reply = _hello_as(NOBODY, sc.socket)
    assert reply.get("ok") is False, reply
    assert reply["error"] == "refused"
    assert str(NOBODY) in reply["message"]
    with sc.connect(timeout=TIMEOUT) as client:
        assert client.stats()["refused"] == 1


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to connect as another uid")
def test_an_allowed_uid_connects(sidecar: Start) -> None:
    sc = sidecar(extra_args=("--allow-uid", str(NOBODY)))
    _open_to_everyone(sc)
    reply = _hello_as(NOBODY, sc.socket)
    assert reply.get("ok") is True, reply


def test_socket_mode(sidecar: Start) -> None:
    sc = sidecar()
    assert os.stat(sc.socket).st_mode & 0o777 == 0o600  # only the owner (and root) connect


# -- embedded: Sidecar(config).start() --------------------------------------------------------


def test_embedded_sidecar(tmp_path: object) -> None:
    config = SidecarConfig(name="embedded", dim=4, runtime_dir=str(tmp_path))
    sidecar = Sidecar(config).start()
    try:
        with kalos.connect("embedded", runtime_dir=str(tmp_path), timeout=TIMEOUT) as client:
            client.add(np.eye(4), [1, 2, 3, 4])
            assert client.search(np.eye(4)[2], k=1).ids.tolist() == [3]
            sidecar.stop()
            assert not os.path.exists(sidecar.path)
            with pytest.raises((SidecarGone, ConnectError)):
                client.ping()
    finally:
        sidecar.stop()
