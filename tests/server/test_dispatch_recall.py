"""RECALL through the dispatcher: the response, the parts' timings, errors, the GPU-result path
(with a host-memory stand-in for a channel's GPU buffer), and ADD with token ids."""

from __future__ import annotations

import numpy as np

import kalos.index
from kalos.protocol import codes
from kalos.protocol import messages as M
from kalos.protocol.codes import Op, RecallFlag, RecallResponseFlag, Status
from kalos.server.dispatch import Dispatcher
from kalos.stores.memories import MemoryStore
from kalos.stores.sessions import SessionStore

DIM = 4


def make_dispatcher(tokenizer=None) -> Dispatcher:  # type: ignore[no-untyped-def]
    store = MemoryStore(kalos.index.create("cpu:flat", dim=DIM), tokenizer=tokenizer)
    return Dispatcher(store, sessions=SessionStore(tokenizer=tokenizer))


def call(d: Dispatcher, op: int, body: bytes, flags: int = 0, gpu_buffer=None):  # type: ignore[no-untyped-def]
    out = np.zeros(1 << 16, np.uint8)
    buf = np.frombuffer(bytearray(body), np.uint8)
    status, n, compute_ns, write_ns = d.handle(op, flags, buf, out, gpu_buffer=gpu_buffer)
    assert compute_ns >= 0 and write_ns >= 0
    return status, out[:n].copy()


def add_body(ids: list[int], payloads: list[str], tokens=None) -> bytes:  # type: ignore[no-untyped-def]
    buf = np.zeros(1 << 16, np.uint8)
    v = np.zeros((len(ids), DIM), np.float32)
    v[:, 0] = np.arange(len(ids), 0, -1)  # the first id scores best for e0
    kinds = np.full(len(ids), codes.PAYLOAD_TEXT, np.uint8)
    tok = None if tokens is None else [None if t is None else np.array(t, np.int32) for t in tokens]
    n = M.encode_add(buf, np.array(ids, np.int64), v, kinds, [p.encode() for p in payloads],
                     M.EMPTY_SCOPE, tok)  # fmt: skip
    return bytes(buf[:n])


def append_body(tokens: list[int]) -> bytes:
    buf = np.zeros(1 << 12, np.uint8)
    n = M.encode_append_turn(buf, M.ScopeBytes(b"", b"", b"s"), b"user", b"x",
                             np.array(tokens, np.int32), None)  # fmt: skip
    return bytes(buf[:n])


def recall_body(k: int = 3, max_tokens: int = 100, session: bytes = b"s") -> bytes:
    buf = np.zeros(1 << 12, np.uint8)
    q = np.array([1, 0, 0, 0], np.float32)
    n = M.encode_recall(buf, session, q, k, max_tokens, M.NO_LIMIT, M.NO_LIMIT, M.EMPTY_SCOPE)
    return bytes(buf[:n])


def served() -> Dispatcher:
    d = make_dispatcher()
    body = add_body([1, 2, 3], ["one", "two", "three"], [[10, 11], None, [30]])
    assert call(d, Op.ADD, body, codes.ADD_HAS_TOKENS)[0] == Status.OK
    assert call(d, Op.APPEND_TURN, append_body([7, 8]), codes.AppendFlag.HAS_TOKENS)[0] == 0
    return d


def test_recall_response() -> None:
    d = served()
    status, body = call(d, Op.RECALL, recall_body())
    assert status == Status.OK
    r = M.decode_recall_response(body, len(body))
    assert r.ids.tolist() == [1, 2, 3]
    assert r.tokens is not None and r.tokens.tolist() == [10, 11, 30, 7, 8]
    assert r.memory_tokens.tolist() == [2, 0, 1]
    assert r.payloads == ["one", "two", "three"]
    assert (r.n_turns, r.turn_tokens, r.system_tokens, r.flags) == (1, 2, 0, 0)
    assert r.context_ns > 0 and r.search_ns > 0 and r.assemble_ns > 0
    assert d.requests[Op.RECALL] == 1


def test_recall_errors_keep_the_dispatcher_serving() -> None:
    d = served()
    status, body = call(d, Op.RECALL, recall_body(session=b"nope"))
    assert status == Status.NOT_FOUND and b"nope" in body.tobytes()
    assert call(d, Op.RECALL, recall_body(k=0))[0] == Status.INVALID_REQUEST
    assert call(d, Op.RECALL, recall_body()[:20])[0] == Status.INVALID_REQUEST
    status, body = call(d, Op.RECALL, recall_body(), RecallFlag.GPU_RESULT)
    assert status == Status.INVALID_REQUEST and b"GPU result buffer" in body.tobytes()
    assert call(d, Op.RECALL, recall_body())[0] == Status.OK


class HostTokenSlots:
    """A channel's GPU buffer as the dispatcher sees it, in host memory (CI has no GPU): the
    token slots and the write the real GpuResultBuffer does (gather, then copy)."""

    max_tokens = 128

    def __init__(self) -> None:
        self.tokens = np.full(self.max_tokens, -9, np.int32)
        self.writes = 0

    def write_tokens(self, pieces, n: int) -> None:  # type: ignore[no-untyped-def]
        data = b"".join(bytes(p) for p in pieces)
        assert len(data) == 4 * n
        self.tokens[:n] = np.frombuffer(data, np.int32)
        self.writes += 1


def test_gpu_result_recall_puts_the_tokens_in_the_buffer_only() -> None:
    d = served()
    slots = HostTokenSlots()
    status, body = call(d, Op.RECALL, recall_body(), RecallFlag.GPU_RESULT, gpu_buffer=slots)
    assert status == Status.OK and slots.writes == 1
    r = M.decode_recall_response(body, len(body))
    assert r.flags == RecallResponseFlag.TOKENS_ON_GPU
    assert r.tokens is None and r.n_tokens == 5
    assert slots.tokens[:5].tolist() == [10, 11, 30, 7, 8]
    assert r.payloads == ["one", "two", "three"]  # texts and hits still in the body
    host = call(d, Op.RECALL, recall_body())[1]
    assert len(body) == len(host) - 24  # the host response carries the 5 ids (padded)


def test_gpu_result_recall_refuses_a_budget_over_the_token_slots() -> None:
    d = served()
    slots = HostTokenSlots()
    status, body = call(d, Op.RECALL, recall_body(max_tokens=129), RecallFlag.GPU_RESULT,
                        gpu_buffer=slots)  # fmt: skip
    assert status == Status.INVALID_REQUEST and b"max_tokens <= 128" in body.tobytes()
    assert slots.writes == 0


def test_add_tokenizes_text_payloads_and_replay_is_deterministic() -> None:
    def tok(text: str) -> np.ndarray:
        return np.array([ord(c) for c in text], np.int32)

    bodies = [
        (add_body([1, 2], ["ab", "c"]), 0),
        (add_body([3], ["xyz"], [[5]]), codes.ADD_HAS_TOKENS),
        (append_body([9]), int(codes.AppendFlag.HAS_TOKENS)),
    ]
    recalled = []
    for _ in range(2):  # a second dispatcher replays the same requests: the same state
        d = make_dispatcher(tokenizer=tok)
        for body, flags in bodies:
            op = Op.APPEND_TURN if flags == codes.AppendFlag.HAS_TOKENS else Op.ADD
            assert call(d, op, body, flags)[0] == Status.OK
        status, body = call(d, Op.RECALL, recall_body())
        assert status == Status.OK
        recalled.append(body.tobytes()[56:])  # after the header and its timings
        r = M.decode_recall_response(body, len(body))
        per_id = {1: [97, 98], 2: [99], 3: [5]}  # tokenized "ab", "c"; given [5]
        want = [t for i in r.ids.tolist() for t in per_id[i]] + [9]
        assert r.tokens is not None and r.tokens.tolist() == want
    assert recalled[0] == recalled[1]
