"""The GPU's own pickup of a channel's next search (server.doorbell), on the CPU.

The real poller, dispatcher, memory store, GpuSearch and doorbell serve a real channel, with
the kernels under Triton's interpreter. There an armed graph runs when the poller reaches the
next request (``Doorbell.answer``) or cancels it (``Doorbell.settle``), reading each word
once: the order of events the GPU sees. The test drives the poller's ``serve`` itself, one
request at a time, as the client's protocol calls would (publish, then the poller's turn).
Without CUDA, host registration is recorded, page-locking is a no-op and the stream is None.
"""

from __future__ import annotations

# isort: off
from triton_interp import torch

# isort: on

import json
import os
import queue
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass

import numpy as np
import pytest

from cuda_reference import check_result, make_index, unprovable_rows
from kalos import _native
from kalos.gpu import driver
from kalos.protocol import codes
from kalos.protocol import layout as L
from kalos.protocol import messages as M
from kalos.protocol.codes import Op, ResponseFlag, Status
from kalos.protocol.messages import Scope
from kalos.server.channels import Poller, ServerChannel
from kalos.server.config import SidecarConfig
from kalos.server.dispatch import Dispatcher
from kalos.server.gpu_search import WARM_K, GpuSearch
from kalos.stores.memories import MemoryStore
from kalos.transport.memory import SharedMemory, create

DIM, K = 64, 10
ACME, BETA = Scope("acme", None, None), Scope("beta", None, None)
PUBLISHED = int(ResponseFlag.DEVICE_PUBLISHED)
DOORBELL = int(ResponseFlag.DEVICE_PUBLISHED | ResponseFlag.DEVICE_DOORBELL)


class Recorded:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int, int, int]] = []

    def record(self, op, status, queue_ns, compute_ns, write_ns) -> None:
        self.calls.append((op, status, queue_ns, compute_ns, write_ns))


@dataclass
class Served:
    gpu: GpuSearch
    memories: MemoryStore
    dispatcher: Dispatcher
    poller: Poller
    ctrl: SharedMemory
    channels: list[ServerChannel]
    x: np.ndarray
    ids: np.ndarray
    scopes: np.ndarray  # each row's scope codes (acme: tenant 1, beta: tenant 2)
    base: np.ndarray  # the prefilter cannot prove a search along it
    seqs: dict[int, int]

    @property
    def door(self):
        return self.gpu.doorbell

    def search(self, query, k=K, scope=ACME, ch=0, deadline_s=1.0, op=Op.SEARCH):
        """One request through the poller: the client's publish, then the poller's turn.
        Returns (status, flags, header timings, scores, ids)."""
        c = self.channels[ch]
        n = M.encode_search(c.req_arena, query[None], k, M.encode_scope_fields(scope))
        now = time.monotonic_ns()
        deadline = now + int(deadline_s * 1e9) if deadline_s else 0
        L.REQ_FIELDS.pack_into(c.buf, L.REQ_OP, op, 0, n, now, deadline)
        seq = self.seqs[ch] = self.seqs[ch] + 1
        _native.store_release(c.req_seq, seq)
        self.poller.serve(c, seq)
        assert _native.load_acquire(c.resp_seq) == seq
        status, flags, body_len, queue, compute, write = L.RESP_FIELDS.unpack_from(
            c.buf, L.RESP_STATUS
        )
        if status != Status.OK:
            return status, flags, (queue, compute, write), None, None
        r = M.decode_search_response(c.resp_arena, body_len)
        return status, flags, (queue, compute, write), r.scores.copy(), r.ids.copy()

    def check(self, query, scores, got, scope_code, k=K) -> None:
        check_result(
            self.memories.index, self.x, self.ids, self.scopes, query[None], k, scores, got,
            scope=(scope_code, 0, 0),
        )  # fmt: skip


@pytest.fixture
def served(monkeypatch, request):
    """The int8 prefilter's rows (DIM); ``param`` 272: the 4-bit cascade's (fp16 rows)."""
    dim = getattr(request, "param", DIM)
    registered: list[int] = []
    monkeypatch.setattr(driver, "host_register", lambda ptr, n: registered.append(ptr))
    monkeypatch.setattr(driver, "host_unregister", lambda ptr: registered.remove(ptr))
    monkeypatch.setattr(driver, "ensure_context", lambda device: None)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **kw: self)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **kw: None)
    x, ids, base = unprovable_rows(np.random.default_rng(5), dim)
    index = make_index("ip", "fp32" if dim == DIM else "fp16", dim, "cpu")
    index.prefilter_min_rows = 0
    memories = MemoryStore(index)
    none = np.zeros(0, np.uint8)
    scopes = np.zeros((len(ids), 3), np.int64)
    for lo, hi, scope, code in ((0, 300, ACME, 1), (300, 400, BETA, 2)):
        m = hi - lo
        memories.add(ids[lo:hi], x[lo:hi], np.zeros(m, np.uint8), np.zeros(m + 1, np.uint64),
                     none, scope)  # fmt: skip
        scopes[lo:hi, 0] = code
    gpu = GpuSearch(index, doorbell=True)
    assert gpu.doorbell is not None
    memories.gpu = gpu
    dispatcher = Dispatcher(memories)
    ctrl = SharedMemory(create("kalos-test-control", L.CONTROL_SIZE), L.CONTROL_SIZE)
    channels = []
    for cid in (1, 2):
        ch = ServerChannel(cid, 7, L.MIN_ARENA_BYTES)
        ch.pinned = gpu.pin(ch.resp_arena, ch.buf[: L.CHANNEL_HEADER_SIZE], ch.req_arena)
        gpu.prepare(ch.pinned, ch.resp_arena)  # as the listener does at the handshake
        channels.append(ch)
    assert len(registered) == 6  # each channel: response arena, header page, request arena
    poller = Poller(ctrl, dispatcher.handle, threading.Lock(), spin_us=100, heartbeat_ms=100)
    poller.doorbell = gpu.doorbell
    poller.metrics = Recorded()  # type: ignore[assignment]
    for ch in channels:
        poller.add(ch)
    s = Served(gpu, memories, dispatcher, poller, ctrl, channels, x, ids, scopes, base,
               {0: 0, 1: 0})  # fmt: skip
    try:
        yield s
    finally:
        for ch in channels:
            gpu.unpin(ch.pinned)
        assert registered == []
        assert gpu.doorbell.armed is None


def query(seed: int, dtype=np.float32, dim: int = DIM) -> np.ndarray:
    """A random query the prefilter proves: pointing away from ``base``, so that the 150
    near-copies of it (acme's first rows) are not among its best."""
    q = np.random.default_rng(seed).standard_normal(dim).astype(np.float32)
    base = unprovable_rows(np.random.default_rng(5), dim)[2]
    return (-q if q @ base > 0 else q).astype(dtype)


def test_a_channel_holds_its_common_graphs_before_its_first_search(served):
    """The handshake prepares a channel's search graphs of the common shapes (one query, each
    k of WARM_K, scoped or not): its first searches of them take those graphs, capture none,
    and are exact. What a capture's run publishes is the channel's own response word."""
    ch = served.channels[1]
    graphs = dict(ch.pinned.graphs)
    assert set(graphs) == {(1, k, scoped) for k in WARM_K for scoped in (False, True)}
    # with the doorbell's armed graph ahead of each that publishes, for float32 queries
    armed = dict(ch.pinned.armed_graphs)
    publishing = [g for g in graphs.values() if g.publish is not None]
    assert publishing and set(armed) == {(g, 4) for g in publishing}
    assert int(served.gpu.staging.seq_np[0]) == _native.load_acquire(ch.pinned.resp_seq_addr)
    for i, k in enumerate(WARM_K):
        for scope, code in ((ACME, 1), (None, None)):
            q = query(40 + i)
            status, _, _, scores, got = served.search(q, k=k, scope=scope, ch=1)
            assert status == Status.OK
            check_result(served.memories.index, served.x, served.ids, served.scopes, q[None],
                         k, scores, got, scope=None if code is None else (code, 0, 0))  # fmt: skip
    assert ch.pinned.graphs == graphs  # the same graphs, no other
    assert ch.pinned.armed_graphs == armed  # and the same armed graphs: each arm built none
    assert served.door.failed is None


def test_the_gpu_takes_the_next_search_of_the_same_shape(served):
    q = query(1)
    status, flags, _, scores, got = served.search(q)  # through the poller: then armed
    assert (status, flags) == (Status.OK, PUBLISHED)
    served.check(q, scores, got, 1)
    assert served.door.armed is served.channels[0].pinned
    for seed in range(2, 6):
        q = query(seed)
        status, flags, timings, scores, got = served.search(q)
        assert (status, flags, timings) == (Status.OK, DOORBELL, (0, 0, 0))
        served.check(q, scores, got, 1)
    assert served.door.answered == 4
    assert served.poller.device_published == 5
    assert served.channels[0].requests == 5
    calls = served.poller.metrics.calls
    assert [c[:3] for c in calls] == [(Op.SEARCH, Status.OK, c[2]) for c in calls]
    assert all(c[2] == 0 for c in calls[1:])  # no queue: the GPU took them
    assert served.dispatcher.requests[Op.SEARCH] == 1  # the dispatcher saw the first only


@pytest.mark.parametrize("served", [272], indirect=True, ids=["4bit-cascade"])
def test_the_gpu_takes_the_cascades_searches_too(served):
    # the 4-bit cascade settles every search in its graph, so its exact pass publishes each
    # one: behind the doorbell, even the near-copies' query (which leaves rows open)
    dim = served.x.shape[1]
    assert served.memories.index.scan == "4bit"
    q = query(1, dim=dim)
    status, flags, _, scores, got = served.search(q)
    assert (status, flags) == (Status.OK, PUBLISHED)
    served.check(q, scores, got, 1)
    for q in (query(2, dim=dim), served.base, query(3, np.float16, dim)):
        status, flags, _, scores, got = served.search(q)
        # a query of another wire type is declined once, then armed for (PUBLISHED)
        assert status == Status.OK and flags in (DOORBELL, PUBLISHED)
        served.check(q.astype(np.float32), scores, got, 1)
    assert served.door.answered == 2 and served.door.declined == 1
    # a write between: settled first, then served by the sidecar and armed again
    body = np.zeros(1 << 16, np.uint8)
    row = query(4, dim=dim) * 50  # scores far above every other row
    n = M.encode_add(body, np.array([10_000]), row[None], np.zeros(1, np.uint8), [b""],
                     M.encode_scope_fields(ACME))  # fmt: skip
    status, *_ = served.dispatcher.handle(Op.ADD, 0, body[:n], np.zeros(4096, np.uint8))
    assert status == Status.OK and served.door.armed is None
    served.x = np.concatenate([served.x, row[None]])
    served.ids = np.concatenate([served.ids, [10_000]])
    served.scopes = np.concatenate([served.scopes, [[1, 0, 0]]])
    for seed in (4, 5):
        q = query(seed, dim=dim)
        status, flags, _, scores, got = served.search(q)
        assert status == Status.OK
        served.check(q, scores, got, 1)
    assert flags == DOORBELL and 10_000 in got.ravel().tolist()


@pytest.mark.parametrize(
    "change",
    ["scope", "k", "dtype", "deadline", "nan", "inf"],
)
def test_a_request_unlike_the_template_is_served_by_the_sidecar(served, change):
    q = query(7)
    served.search(q)
    assert served.door.armed is not None
    q2, k, scope, deadline, code = query(8), K, ACME, 1.0, 1
    if change == "scope":  # another tenant's rows: the device holds acme's filter
        scope, code = BETA, 2
    elif change == "k":
        k = 5
    elif change == "dtype":
        q2 = q2.astype(np.float16)
    elif change == "deadline":  # closer than the GPU can vouch for: the sidecar checks it
        deadline = 0.001
    elif change in ("nan", "inf"):
        q2[3] = np.nan if change == "nan" else np.inf
    status, flags, _timings, scores, got = served.search(q2, k=k, scope=scope, deadline_s=deadline)
    assert served.door.declined == 1 and served.door.answered == 0
    if change in ("nan", "inf"):
        assert status == Status.INVALID_REQUEST
        return
    assert (status, flags) == (Status.OK, PUBLISHED)
    served.check(q2.astype(np.float32), scores, got, code, k=k)
    # armed again for the new shape: the next one like it is the GPU's
    q3 = query(9, q2.dtype)
    status, flags, _, scores, got = served.search(q3, k=k, scope=scope, deadline_s=deadline)
    if change == "deadline":
        assert flags == PUBLISHED  # still too close
        return
    assert flags == DOORBELL
    served.check(q3.astype(np.float32), scores, got, code, k=k)


def test_an_unproven_search_the_gpu_took_settles_on_the_gpu(served, monkeypatch):
    served.search(query(10))
    index = served.memories.index
    scans: list[bool] = []  # each scan's gate: None when the sidecar launched it
    launch = index._launch
    monkeypatch.setattr(
        index, "_launch", lambda *a, **kw: (scans.append(a[-1] is None), launch(*a, **kw))
    )
    status, flags, timings, scores, got = served.search(served.base)
    # the armed graph's scan, then its settle behind it, gated on the scan's verdict: the
    # GPU answered, with no sidecar stage
    assert (status, flags, timings) == (Status.OK, DOORBELL, (0, 0, 0))
    served.check(served.base, scores, got, 1)
    assert scans == [False] and served.door.unproven == 0 and served.door.answered == 1
    stats = served.door.stats()
    assert stats["gpu_doorbell_settled"] == 1 and stats["gpu_doorbell_settled_rows"] >= K
    assert served.door.armed is served.channels[0].pinned  # armed again at once
    for seed in (11, 12):  # proven ones after it: the GPU's, and not settled
        q = query(seed)
        status, flags, _, scores, got = served.search(q)
        assert flags == DOORBELL
        served.check(q, scores, got, 1)
    assert served.door.stats()["gpu_doorbell_settled"] == 1
    assert served.dispatcher.requests[Op.SEARCH] == 1  # the dispatcher saw the first only


def test_a_write_cancels_the_armed_search_and_is_seen_by_the_next(served):
    served.search(query(13))
    assert served.door.armed is not None
    c = served.channels[0]
    seen = c.resp_arena[:4096].copy()  # the client may still read these views
    # another client's ADD (a uds thread, say) runs through the dispatcher under the lock
    new_id, row = 10_000, query(14) * 50  # scores far above every other row
    body = np.zeros(1 << 16, np.uint8)
    n = M.encode_add(body, np.array([new_id]), row[None], np.zeros(1, np.uint8), [b""],
                     M.encode_scope_fields(ACME))  # fmt: skip
    status, *_ = served.dispatcher.handle(Op.ADD, 0, body[:n], np.zeros(4096, np.uint8))
    assert status == Status.OK
    assert served.door.armed is None  # settled before the add touched the index
    # the cancelled graph's scan ran with its gate closed: the last answer is untouched
    assert np.array_equal(c.resp_arena[:4096], seen)
    assert _native.load_acquire(c.resp_seq) == served.seqs[0]
    status, flags, _, _scores, got = served.search(query(14))
    assert flags == PUBLISHED and got[0, 0] == new_id


def test_a_search_on_another_channel_cancels_the_armed_one(served):
    served.search(query(15))
    assert served.door.armed is served.channels[0].pinned
    _status, flags, _, scores, got = served.search(query(16), ch=1)
    assert flags == PUBLISHED
    served.check(query(16), scores, got, 1)
    assert served.door.armed is served.channels[1].pinned
    _status, flags, _, _, _ = served.search(query(17), ch=0)
    assert flags == PUBLISHED  # channel 1 was armed: the sidecar served it, then armed it


def test_another_channels_request_that_needs_no_gpu_leaves_it_armed(served):
    """A PING (or a session's append, a state read: no GPU) on another channel is served
    beside the armed graph, which takes channel 0's next search; a STATS (it reads the GPU's
    memory) settles it."""
    served.search(query(29))
    armed = served.channels[0].pinned
    c = served.channels[1]
    for op in (Op.PING, Op.STATS):
        L.REQ_FIELDS.pack_into(c.buf, L.REQ_OP, op, 0, 0, time.monotonic_ns(), 0)
        seq = served.seqs[1] = served.seqs[1] + 1
        _native.store_release(c.req_seq, seq)
        served.poller.serve(c, seq)
        assert _native.load_acquire(c.resp_seq) == seq
        assert L.RESP_FIELDS.unpack_from(c.buf, L.RESP_STATUS)[0] == Status.OK
        if op == Op.PING:
            assert served.door.armed is armed
            q = query(30)
            _status, flags, _, scores, got = served.search(q)
            assert flags == DOORBELL  # the GPU's, armed across the PING
            served.check(q, scores, got, 1)
    assert served.door.armed is None
    assert served.door.declined == 0


def test_a_request_taken_before_a_cancel_is_answered(served):
    """The GPU took the client's request just as the sidecar cancelled (for other work): the
    response is the GPU's, and the poller only keeps the books when it reaches it."""
    served.search(query(18))
    c = served.channels[0]
    q = query(19)
    n = M.encode_search(c.req_arena, q[None], K, M.encode_scope_fields(ACME))
    now = time.monotonic_ns()
    L.REQ_FIELDS.pack_into(c.buf, L.REQ_OP, Op.SEARCH, 0, n, now, now + 60 * 10**9)
    seq = served.seqs[0] = served.seqs[0] + 1
    _native.store_release(c.req_seq, seq)
    served.gpu.settle()  # e.g. an add from another thread, before the poller's sweep
    assert served.door.claims == {c.pinned: (seq, True)}
    assert _native.load_acquire(c.resp_seq) == seq  # the client has its answer already
    before = served.dispatcher.requests[Op.SEARCH]
    served.poller.serve(c, seq)
    assert served.dispatcher.requests[Op.SEARCH] == before  # books only
    assert served.door.claims == {} and served.door.answered == 1
    r = M.decode_search_response(c.resp_arena, L.RESP_FIELDS.unpack_from(c.buf, L.RESP_STATUS)[2])
    served.check(q, r.scores, r.ids, 1)


def test_a_request_the_poller_never_saw_is_counted(served):
    """The GPU answered a search before the poller came round to it, and the client has sent
    its next request (a PING): the poller serves that one and keeps the books of both, the
    earlier one as a SEARCH."""
    served.search(query(26))
    c = served.channels[0]
    scope = M.encode_scope_fields(ACME)
    n = M.encode_search(c.req_arena, query(27)[None], K, scope)
    now = time.monotonic_ns()
    L.REQ_FIELDS.pack_into(c.buf, L.REQ_OP, Op.SEARCH, 0, n, now, now + 60 * 10**9)
    taken = served.seqs[0] = served.seqs[0] + 1
    _native.store_release(c.req_seq, taken)
    served.door._run_pending()  # the GPU, on its own: takes and answers it
    assert _native.load_acquire(c.resp_seq) == taken
    before = served.channels[0].requests
    # the client's next request, a PING: the poller's first sight of the channel since
    L.REQ_FIELDS.pack_into(c.buf, L.REQ_OP, Op.PING, 0, 0, time.monotonic_ns(), 0)
    seq = served.seqs[0] = served.seqs[0] + 1
    _native.store_release(c.req_seq, seq)
    served.poller.serve(c, seq)
    assert _native.load_acquire(c.resp_seq) == seq
    assert served.door.answered == 1
    assert served.channels[0].requests == before + 2  # the books of both
    ops = [call[:2] for call in served.poller.metrics.calls[-2:]]
    assert ops == [(Op.SEARCH, Status.OK), (Op.PING, Status.OK)]
    q = query(28)
    status, flags, _, scores, got = served.search(q)  # nothing armed: through the poller
    assert (status, flags) == (Status.OK, PUBLISHED)
    served.check(q, scores, got, 1)


def test_the_template_is_the_validated_request_not_the_arena_now(served):
    """The template is taken before the launch, while the client waits; a client that writes
    its next request into the arena afterwards cannot make it match by construction."""
    served.search(query(20))
    arm = served.door.arm_np
    at = int(arm[4])
    template = served.door.template_np[:at].tobytes()
    c = served.channels[0]
    assert template == c.req_arena[:at].tobytes()
    scope = M.encode_scope_fields(ACME)
    head = M.encode_search(np.zeros(4096, np.uint8), query(1)[None], K, scope)
    assert head == int(arm[3])  # the body length it checks
    assert int(arm[2]) == Op.SEARCH  # op, flags 0
    assert np.frombuffer(template[12:16], np.uint32)[0] == codes.DTYPE_F32


def test_stopping_cancels_the_armed_search(served):
    served.search(query(21))
    assert served.door.armed is not None
    served.poller.stop()
    served.poller.run()  # returns at once: stopping, after settling
    assert served.door.armed is None


def test_a_graph_that_cannot_be_built_turns_the_doorbell_off(served, monkeypatch):
    """A GPU or Triton that cannot build the doorbell's kernel: the sidecar says why (STATS)
    and serves every search through the poller, as without a doorbell."""
    from kalos.server import doorbell

    def refuse(*args, **kwargs):
        raise RuntimeError("no such PTX instruction")

    monkeypatch.setattr(doorbell, "ArmedGraph", refuse)
    # the channel's armed graphs, made at its handshake: gone, as for a shape it had none of
    served.channels[0].pinned.armed_graphs.clear()
    for seed in (22, 23, 24):
        q = query(seed)
        status, flags, _, scores, got = served.search(q)
        assert (status, flags) == (Status.OK, PUBLISHED)
        served.check(q, scores, got, 1)
    assert served.door.armed is None
    assert served.door.stats()["gpu_doorbell_failed"] == "RuntimeError: no such PTX instruction"
    # ... and at a handshake (GpuSearch.prepare): the same
    served.door.failed = None
    pinned = served.channels[1].pinned
    pinned.armed_graphs.clear()
    served.door.prepare(pinned, [g for g in pinned.graphs.values() if g.publish is not None])
    assert served.door.stats()["gpu_doorbell_failed"] == "RuntimeError: no such PTX instruction"
    assert pinned.armed_graphs == {}


def test_the_doorbell_is_on_in_a_sidecar_by_default_and_off_when_asked(served):
    """A sidecar's default (SidecarConfig, the CLI's --gpu-doorbell / --no-gpu-doorbell); a
    GpuSearch made in process (e.g. by a benchmark) has none unless asked for."""
    from kalos.cli import build_parser

    assert SidecarConfig(name="s", dim=8).gpu_doorbell is True
    serve = ["serve", "--name", "s", "--dim", "8"]
    assert build_parser().parse_args(serve).gpu_doorbell is True
    assert build_parser().parse_args([*serve, "--no-gpu-doorbell"]).gpu_doorbell is False
    assert GpuSearch(served.memories.index).doorbell is None


def test_the_doorbell_kernel_builds_for_an_h200():
    """Compiles the kernel the GPU runs (its inline PTX: acquire and relaxed loads at system
    scope in a loop, the global timer, the fence and the release store) for sm_90 with
    Triton's own ptxas, without a GPU, in a process without the interpreter; skipped where
    this Triton has no CUDA toolchain."""
    script = textwrap.dedent(
        """
        import json, sys
        try:
            from triton.backends.compiler import GPUTarget
            from triton.compiler import ASTSource
            import triton
        except ImportError as exc:
            print(json.dumps({"skip": str(exc)})); sys.exit(0)
        from kalos.server import doorbell
        sig = {name: "*i64" for name in ("req_ptr", "resp_ptr", "arm_ptr", "ctl_ptr", "seq_ptr")}
        sig.update(body_ptr="*u8", tmpl_ptr="*u8", query_ptr="*fp16", dest_ptr="*fp32",
                   gate_ptr="*i32", trace_ptr="*i64")
        out = {}
        for trace in (False, True):  # the kernel the sidecar runs, and the probe's
            consts = {"D": 128, "BLOCK_D": 128, "ESIZE": 2, "TMAX": doorbell.TEMPLATE_BYTES,
                      "GPU": True, "TRACE": trace}
            sig.update({name: "constexpr" for name in consts})
            try:
                k = triton.compile(ASTSource(fn=doorbell._doorbell_kernel, signature=sig,
                                             constexprs=consts),
                                   target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
            except Exception as exc:
                if "ptxas" in str(exc).lower() or "backend" in str(exc).lower():
                    print(json.dumps({"skip": str(exc)})); sys.exit(0)
                raise
            out["trace" if trace else "plain"] = {"ptx": k.asm["ptx"], "cubin": len(k.asm["cubin"])}
        print(json.dumps(out))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(f"no CUDA toolchain in this triton: {out['skip']}")
    ptx = out["plain"]["ptx"]
    assert "ld.acquire.sys.global.b64" in ptx and "%globaltimer" in ptx
    assert "st.global.release.sys.b64" in ptx and "fence.sc.sys" in ptx
    # the trace's four clock reads are compiled out of the sidecar's kernel
    assert ptx.count("%globaltimer") + 4 == out["trace"]["ptx"].count("%globaltimer")
    assert out["plain"]["cubin"] > 0


# -- the GPU's side as a stream of its own ----------------------------------------------------
#
# Above, an armed graph runs when the poller reaches it. Below, it runs on a thread of its own
# that stands in for the GPU's stream, so the doorbell's GPU-mode paths run for real, beside a
# running poller and client threads: launches queue in order; each one's doorbell polls the
# request and cancel words (in Python) until a request, a cancel or its budget, then does the
# armed graph's work (interpreted); an event per launch says when it has finished.


class EmulatedStream:
    def __init__(self) -> None:
        self.jobs: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            job()

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join(30)


class EmulatedLaunch:
    """``driver.GraphLaunch``'s interface over :class:`EmulatedStream`."""

    def __init__(self, armed, stream: EmulatedStream) -> None:
        self.armed, self.stream = armed, stream
        self.events = [threading.Event(), threading.Event()]
        for e in self.events:
            e.set()
        self.last = 0

    def __call__(self) -> None:
        self.last ^= 1
        done = self.events[self.last] = threading.Event()
        door = self.armed._door
        req_addr = self.armed._args[0].data_ptr()  # the channel's REQ_SEQ word
        cancel_addr = int(door.ctl_np.ctypes.data)

        def job() -> None:
            armed_seq = int(door.arm_np[0])  # the arm block as the graph's copy takes it
            end = time.monotonic_ns() + int(door.arm_np[1])
            while (
                _native.load_acquire(req_addr) == armed_seq
                and _native.load_acquire(cancel_addr) == 0
                and time.monotonic_ns() < end
            ):
                time.sleep(50e-6)
            self.armed.work()
            done.set()

        self.stream.jobs.put(job)

    def done(self, previous: bool = False) -> bool:
        return self.events[self.last ^ previous].is_set()

    def wait(self) -> None:
        assert self.events[self.last].wait(60), "the emulated stream is stuck"

    def close(self) -> None:
        pass


@pytest.fixture
def streamed(served, monkeypatch):
    """``served`` with armed graphs launched on an emulated stream and the poller running."""
    from kalos.server import doorbell

    stream = EmulatedStream()
    init = doorbell.ArmedGraph.__init__

    def with_launch(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.launch = EmulatedLaunch(self, stream)

    monkeypatch.setattr(doorbell.ArmedGraph, "__init__", with_launch)
    for ch in served.channels:  # the handshake's armed graphs, again with the emulated launch
        ch.pinned.armed_graphs.clear()
        served.door.prepare(ch.pinned, [g for g in ch.pinned.graphs.values() if g.publish])
    # 2 s: it settles and parks between bursts, but not while the interpreted kernels behind
    # an answer run (they hold the GIL for hundreds of milliseconds on a busy machine)
    served.poller.spin_ns = 2_000_000_000
    monkeypatch.setattr(doorbell, "VERDICT_WAIT_NS", 10**10)  # an interpreted kernel is slow
    thread = threading.Thread(target=served.poller.run, daemon=True)
    thread.start()
    try:
        yield served
    finally:
        served.poller.stop()
        thread.join(60)
        stream.close()


def call(served: Served, ch: int, q: np.ndarray, k: int = K, scope=ACME):
    """A client's SEARCH on channel ``ch`` through the running poller: (flags, scores, ids)."""
    c = served.channels[ch]
    n = M.encode_search(c.req_arena, q[None], k, M.encode_scope_fields(scope))
    now = time.monotonic_ns()
    L.REQ_FIELDS.pack_into(c.buf, L.REQ_OP, Op.SEARCH, 0, n, now, now + 60 * 10**9)
    seq = served.seqs[ch] = served.seqs[ch] + 1
    ctrl = served.ctrl.addr
    _native.publish(c.req_seq, seq, ctrl + L.CTRL_SERVER_PARKED, ctrl + L.CTRL_BELL)
    assert _native.wait_seq(c.resp_seq, seq, c.client_parked, c.client_bell, 10**6, 60 * 10**9)
    status, flags, body_len, *_ = L.RESP_FIELDS.unpack_from(c.buf, L.RESP_STATUS)
    assert status == Status.OK
    r = M.decode_search_response(c.resp_arena, body_len)
    return flags, r.scores.copy(), r.ids.copy()


def test_repeats_idle_gaps_clients_and_writes_with_the_gpu_on_its_own(streamed):
    """One client's repeats (the GPU takes them), an idle gap (the kernel's budget runs out
    and it is re-armed, then the poller settles and parks), then two channels' clients at
    once with another thread's ADDs and shape changes: every answer exact, and every request
    reaches the books once."""
    s = streamed
    s.door.arm_np[1] = 10**9  # the kernel's budget: 1 s while the client works
    flags_seen: list[int] = []
    for seed in range(100, 112):  # one client alone: the first through the poller, then the GPU
        q = query(seed)
        flags, scores, got = call(s, 0, q)
        s.check(q, scores, got, 1)
        flags_seen.append(flags)
    # the first through the poller; the rest the GPU's, but where this emulated GPU answers
    # before the poller has seen a request (its threads share one interpreter), the next
    # goes through the poller
    assert flags_seen[0] == PUBLISHED and flags_seen[1] == DOORBELL
    assert flags_seen.count(DOORBELL) >= 6, flags_seen
    # a request the GPU takes but cannot prove: it settles behind the scan, and publishes
    flags, scores, got = call(s, 0, s.base)
    s.check(s.base, scores, got, 1)
    assert flags == DOORBELL
    # the tally follows the publish on the stream: the client can read its answer first
    deadline = time.monotonic() + 30
    while s.door.stats()["gpu_doorbell_settled"] != 1 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert s.door.stats()["gpu_doorbell_settled"] == 1
    flags_seen.append(flags)
    flags, scores, got = call(s, 0, query(98))
    flags_seen.append(flags)
    s.door.arm_np[1] = 5_000_000  # 5 ms, taken by the armed graph the next answer launches
    q = query(99)
    flags, scores, got = call(s, 0, q)
    s.check(q, scores, got, 1)
    flags_seen.append(flags)
    # idle: budgets run out (re-armed), then the poller settles and parks
    deadline = time.monotonic() + 60
    while not (s.door.expired >= 1 and s.door.armed is None) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert s.door.expired >= 1 and s.door.armed is None
    q = query(112)
    flags, scores, got = call(s, 0, q)
    s.check(q, scores, got, 1)
    assert flags == PUBLISHED  # after a park: through the poller, then armed again
    flags_seen.append(flags)

    errors: list[BaseException] = []

    def client(ch: int, seeds: range) -> None:
        try:
            for i, seed in enumerate(seeds):
                q = query(seed)
                k = 5 if i % 7 == 6 else K
                flags, scores, got = call(s, ch, q, k)
                s.check(q, scores, got, 1, k=k)
                flags_seen.append(flags)
        except BaseException as exc:
            errors.append(exc)

    def writer() -> None:
        try:
            rng = np.random.default_rng(9)
            body = np.zeros(1 << 16, np.uint8)
            for i in range(3):
                row = 1e-3 * rng.standard_normal((1, DIM)).astype(np.float32)  # never a top-k
                n = M.encode_add(body, np.array([20_000 + i]), row, np.zeros(1, np.uint8),
                                 [b""], M.encode_scope_fields(ACME))  # fmt: skip
                with s.poller._lock:
                    status, *_ = s.dispatcher.handle(Op.ADD, 0, body[:n], np.zeros(4096, np.uint8))
                assert status == Status.OK
                time.sleep(0.05)
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=client, args=(0, range(200, 220))),
        threading.Thread(target=client, args=(1, range(300, 312))),
        threading.Thread(target=writer),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors[0]
    assert len(flags_seen) == 12 + 2 + 1 + 1 + 20 + 12
    total = len(flags_seen)
    assert set(flags_seen) <= {PUBLISHED, DOORBELL}
    assert s.door.answered == flags_seen.count(DOORBELL)
    assert s.channels[0].requests + s.channels[1].requests == total
    searches = [c for c in s.poller.metrics.calls if c[0] == Op.SEARCH]
    assert len(searches) == total and all(c[1] == Status.OK for c in searches)
