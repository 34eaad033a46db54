"""Fuzzing the request path: random and mutated request bytes never crash or hang the sidecar.

Inputs: valid bodies of every op (encoded with kalos.protocol.messages), then mutated (bit
flips, overwritten bytes, counts and lengths set to edge values, truncated, extended with
garbage), plus random bytes under random ops and flags. The bulk runs through
``Dispatcher.handle`` in-process (the same decoders and stores as the sidecar, ~20 µs an
input); tens of thousands more go through a real shm sidecar, with oversized ``body_len``,
out-of-order and duplicate sequence numbers written straight into the channel's header, while
a second client is checked every few hundred inputs. Every input must get a status of the
protocol (an error or OK) or be ignored; a decoder failure (SERVER_ERROR "internal error"),
an exception out of the dispatcher, a missing answer or a dead sidecar fails the test.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

import kalos
import kalos.index
from conftest import DIM
from kalos import Scope, _native
from kalos.protocol import codes
from kalos.protocol import messages as M
from kalos.protocol.codes import Op, Status
from kalos.server.dispatch import Dispatcher
from kalos.stores.memories import MemoryStore
from kalos.stores.sessions import SessionStore
from kalos.stores.state import StateStore
from kalos.testing import RunningSidecar

ARENA = 1 << 16  # the smallest arena: an oversized body or response is easy to reach
IN_PROCESS = 120_000
THROUGH_SIDECAR = 50_000
CHECK_EVERY = 500  # inputs between checks that a second client is served
HANG_S = 10.0  # one input taking longer than this is a hang
STATUSES = {int(s) for s in Status}
EDGE_U32 = [0, 1, 2, 7, 8, 255, 1024, 1025, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1]
OVERSIZED = [ARENA + 1, 2**32, 2**63, 2**64 - 1]  # body_len beyond the arena
OTHER_IDS = 0x5EED_5EED_0000  # the second client's items (see the sidecar test)
SCOPES = [Scope(), Scope("t"), Scope("t", "u"), Scope("t", "u", "s"), Scope(session="s")]


def valid_bodies(rng: np.random.Generator) -> list[tuple[int, int, bytes]]:
    """One valid (op, flags, body) of each op and a few variants."""
    buf = np.zeros(ARENA, np.uint8)
    out: list[tuple[int, int, bytes]] = []

    def put(op: int, flags: int, n: int) -> None:
        out.append((op, flags, buf[:n].tobytes()))

    for scope in SCOPES:
        sb = M.encode_scope_fields(scope)
        ssb = M.ScopeBytes(sb.tenant, sb.user, b"s")
        put(Op.PING, 0, 0)
        put(Op.STATS, 0, 0)
        n = int(rng.integers(1, 4))
        v = rng.standard_normal((n, DIM)).astype(np.float32)
        ids = rng.integers(0, 50, n).astype(np.int64)
        kinds = rng.integers(0, 3, n).astype(np.uint8)
        blobs = [b"" if k == 0 else b"payload" for k in kinds]
        put(Op.ADD, 0, M.encode_add(buf, ids, v, kinds, blobs, sb))
        put(Op.ADD, 0, M.encode_add(buf, ids, v.astype(np.float16), kinds, blobs, sb))
        put(Op.REMOVE, 0, M.encode_remove(buf, ids))
        for dtype in (np.float32, np.float16):
            q = rng.standard_normal((int(rng.integers(1, 3)), DIM)).astype(dtype)
            for flags in (0, codes.SEARCH_WANT_PAYLOADS, codes.SEARCH_GPU_RESULT):
                put(Op.SEARCH, flags, M.encode_search(buf, q, int(rng.integers(1, 20)), sb))
        tokens = rng.integers(0, 1000, int(rng.integers(0, 20))).astype(np.int32)
        for flags in (codes.AppendFlag.HAS_TOKENS, codes.AppendFlag.HAS_TOKENS | 1 | 4 | 8):
            n = M.encode_append_turn(buf, ssb, b"user", b"hello there", tokens, 60.0)
            put(Op.APPEND_TURN, int(flags), n)
        put(Op.CONTEXT, 1, M.encode_context(buf, b"s", 100, M.NO_LIMIT, sb))
        put(Op.SESSIONS, 0, M.encode_scoped(buf, M.NO_LIMIT, 1, sb, b"a"))
        put(Op.TRIM, 0, M.encode_scoped(buf, 2, 0, ssb))
        put(Op.DELETE_SESSION, 0, M.encode_scoped(buf, 0, 0, ssb))
        put(Op.STATE_PUT, 0, M.encode_state_value(buf, sb, b"key", b"value"))
        put(Op.STATE_CAS, 0, M.encode_state_value(buf, sb, b"key", b"v2", 1))
        put(Op.STATE_GET, 0, M.encode_state_key(buf, sb, b"key"))
        put(Op.STATE_DELETE, 0, M.encode_state_key(buf, sb, b"key"))
        put(Op.LOG_EVENT, 0, M.encode_log_event(buf, ssb, b"tool_call", "search(x)"))
        put(Op.LOG_EVENT, 0, M.encode_log_event(buf, ssb, b"blob", b"\x00\xff"))
        put(Op.EVENTS, 0, M.encode_events_request(buf, ssb, 0, M.NO_LIMIT))
        if any(scope):
            put(Op.FORGET, 0, M.encode_scoped(buf, 0, 0, sb))
        toks: list[np.ndarray | None] = [
            rng.integers(0, 1000, int(rng.integers(0, 5))).astype(np.int32) for _ in ids
        ]
        toks[0] = None  # the sidecar would tokenize it
        put(Op.ADD, codes.ADD_HAS_TOKENS, M.encode_add(buf, ids, v, kinds, blobs, sb, toks))
        q = rng.standard_normal(DIM).astype(np.float32)
        for flags in (0, codes.RecallFlag.GPU_RESULT):
            n = M.encode_recall(buf, b"s", q, int(rng.integers(1, 20)), 100, M.NO_LIMIT, 50, sb)
            put(Op.RECALL, int(flags), n)
        # metadata, string ids and filters (1.5)
        metas = [json.dumps(random_meta(rng)).encode() for _ in ids]
        keys = [b"null"] * len(ids)
        keys[0] = json.dumps("k0").encode()
        key_ids = ids.copy()
        key_ids[0] = kalos.key_id("k0")
        meta = M.add_meta_json(metas, keys)
        put(Op.ADD, codes.ADD_HAS_META, M.encode_add(buf, key_ids, v, kinds, blobs, sb, None, meta))
        put(Op.LOOKUP, 0, M.encode_lookup(buf, key_ids, sb))
        for _ in range(3):
            where = json.dumps(random_filter(rng, 3)).encode()
            q1 = rng.standard_normal((1, DIM)).astype(np.float32)
            for flags in (codes.SEARCH_FILTER, codes.SEARCH_FILTER | codes.SEARCH_WANT_META):
                put(Op.SEARCH, flags, M.encode_search(buf, q1, 5, sb, where))
            if sum(map(bool, scope)) >= 2:  # never near the other tenant's, even mutated
                n = M.encode_scoped(buf, 0, 0, sb, M.encode_filter_tail(where))
                put(Op.FORGET, codes.FORGET_FILTER, n)
    assert {op for op, _, _ in out} == {int(op) for op in Op}
    return out


KEYS = ["a", "b", "c", "tags"]
VALUES: list[object] = ["x", "y", "", 0, 1, -2.5, 1e300, True, False, None]


def random_meta(rng: np.random.Generator) -> dict[str, object]:
    out: dict[str, object] = {}
    for key in KEYS:
        if rng.random() < 0.6:
            if rng.random() < 0.3:
                out[key] = [VALUES[int(i)] for i in rng.integers(0, len(VALUES), 3)]
            else:
                out[key] = VALUES[int(rng.integers(len(VALUES)))]
    return out


def random_filter(rng: np.random.Generator, depth: int) -> dict[str, object]:
    """A filter of kalos.filters' syntax, valid or not (unknown operators, wrong operands)."""
    roll = rng.random()
    if depth and roll < 0.3:
        logic = ["$and", "$or", "AND", "OR"][int(rng.integers(4))]
        return {logic: [random_filter(rng, depth - 1) for _ in range(int(rng.integers(1, 3)))]}
    if depth and roll < 0.4:
        return {"$not": random_filter(rng, depth - 1)}
    op = ["eq", "ne", "gt", "gte", "lt", "lte", "in", "nin", "contains", "$eq", "bad"][
        int(rng.integers(11))
    ]
    value: object = VALUES[int(rng.integers(len(VALUES)))]
    if op in ("in", "nin"):
        value = [value, VALUES[int(rng.integers(len(VALUES)))]]
    return {KEYS[int(rng.integers(len(KEYS)))]: {op: value}}


def inputs(seed: int, count: int) -> Iterator[tuple[int, int, bytes, int]]:
    """(op, flags, body, body_len) inputs; body_len may exceed len(body) (oversized)."""
    rng = np.random.default_rng(seed)
    corpus = valid_bodies(rng)
    ops = [int(op) for op in Op]
    for i in range(count):
        op, flags, body = corpus[int(rng.integers(len(corpus)))]
        raw = bytearray(body)
        kind = i % 10
        if kind == 0:  # random bytes, random op and flags
            raw = bytearray(rng.bytes(int(rng.integers(0, 256))))
            op = int(rng.choice(ops)) if rng.random() < 0.8 else int(rng.integers(0, 2**32))
            flags = int(rng.integers(0, 2**32)) if rng.random() < 0.3 else int(rng.integers(16))
        elif kind in (1, 2) and raw:  # bit flips
            for _ in range(int(rng.integers(1, 4))):
                j = int(rng.integers(len(raw)))
                raw[j] ^= 1 << int(rng.integers(8))
        elif kind in (3, 4) and len(raw) >= 4:  # a count or length word set to an edge value
            j = int(rng.integers(0, min(len(raw), 64) - 3)) & ~3
            value = EDGE_U32[int(rng.integers(len(EDGE_U32)))]
            raw[j : j + 4] = value.to_bytes(4, "little")
        elif kind == 5:  # truncated
            raw = raw[: int(rng.integers(0, len(raw) + 1))]
        elif kind == 6:  # extended with garbage
            raw += rng.bytes(int(rng.integers(1, 64)))
        elif kind == 7 and raw:  # overwritten bytes
            j = int(rng.integers(len(raw)))
            chunk = rng.bytes(int(rng.integers(1, 16)))
            raw[j : j + len(chunk)] = chunk
        elif kind == 8:  # another op's body, or other flags
            if rng.random() < 0.5:
                op = int(rng.choice(ops))
            else:
                flags = int(rng.integers(0, 64))
        # kind 9: the valid body as it is
        body_len = len(raw)
        if rng.random() < 0.01:
            body_len = OVERSIZED[int(rng.integers(len(OVERSIZED)))]
        yield op, flags, bytes(raw), body_len


def fresh_dispatcher() -> Dispatcher:
    store = MemoryStore(kalos.index.create("cpu:flat", dim=DIM, metric="ip"))
    return Dispatcher(store, sessions=SessionStore(), state=StateStore())


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # finite vectors whose products overflow
def test_fuzz_the_dispatcher(record_property: Callable[[str, object], None]) -> None:
    body = np.zeros(ARENA, np.uint8)
    out = np.zeros(ARENA, np.uint8)
    dispatcher = fresh_dispatcher()
    statuses: dict[int, int] = {}
    failures: list[str] = []
    done = 0
    started = time.monotonic()
    for i, (op, flags, raw, body_len) in enumerate(inputs(1, IN_PROCESS)):
        if i % 20_000 == 0:
            dispatcher = fresh_dispatcher()  # bounded stores: the inputs stay fast
        if body_len > ARENA:  # the poller answers these before dispatch (tested below)
            body_len = len(raw)
        body[: len(raw)] = np.frombuffer(raw, np.uint8)
        t0 = time.monotonic()
        try:
            status, n, _, _ = dispatcher.handle(op, flags, body[:body_len], out)
        except Exception as exc:
            failures.append(f"input {i} (op {op}, flags {flags}): raised {exc!r}")
            continue
        if time.monotonic() - t0 > HANG_S:
            failures.append(f"input {i} (op {op}): took {time.monotonic() - t0:.1f} s")
        statuses[status] = statuses.get(status, 0) + 1
        message = M.decode_text(out, n) if status != Status.OK else ""
        if status not in STATUSES or not 0 <= n <= ARENA:
            failures.append(f"input {i} (op {op}): status {status}, length {n}")
        elif status == Status.SERVER_ERROR:  # a decoder or store bug, not a bad request
            failures.append(f"input {i} (op {op}, flags {flags}, {raw[:48]!r}): {message}")
        done += 1
    elapsed = time.monotonic() - started
    # still serving, right
    dispatcher = fresh_dispatcher()
    n = M.encode_add(body, np.array([7], np.int64), np.ones((1, DIM), np.float32),
                     np.zeros(1, np.uint8), [b""], M.EMPTY_SCOPE)  # fmt: skip
    assert dispatcher.handle(Op.ADD, 0, body[:n], out)[0] == Status.OK
    named = {Status(s).name: c for s, c in sorted(statuses.items())}
    print(f"\n{done} inputs in process in {elapsed:.1f} s: {len(failures)} failures; {named}")
    record_property("fuzz_inputs_in_process", done)
    assert not failures, "\n".join(failures[:20])
    assert done == IN_PROCESS


def test_fuzz_a_sidecar_through_its_channel(
    sidecar: Callable[..., RunningSidecar], record_property: Callable[[str, object], None]
) -> None:
    sc = sidecar(dim=DIM)
    fuzzed = sc.connect(arena_bytes=ARENA, timeout=HANG_S)
    other = sc.connect(timeout=HANG_S)
    # ids no single mutated byte of the corpus' small ids (0..49) can turn into
    other.add(np.eye(DIM, dtype=np.float32), np.arange(DIM) + OTHER_IDS, scope=Scope("other"))
    t = fuzzed._channel()
    seq_words = t._req_seq, t._server_parked, t._server_bell  # type: ignore[attr-defined]
    statuses: dict[int, int] = {}
    failures: list[str] = []
    checks = 0
    done = 0
    started = time.monotonic()
    for i, (op, flags, raw, body_len) in enumerate(inputs(2, THROUGH_SIDECAR)):
        t.request_buffer[: len(raw)] = np.frombuffer(raw, np.uint8)
        if i % 1000 == 999:  # out of order: a sequence number behind, then a duplicate
            seq = t._seq  # type: ignore[attr-defined]
            _native.publish(seq_words[0], max(seq - 5, 1), seq_words[1], seq_words[2])
            _native.publish(seq_words[0], max(seq - 5, 1), seq_words[1], seq_words[2])
            t._seq = max(seq - 5, 1)  # type: ignore[attr-defined]  # carry on from there
        try:
            resp = t.request(op, flags, body_len, timeout=HANG_S)
        except kalos.KalosError as exc:  # a hang (RequestTimeout) or a dead sidecar
            failures.append(f"input {i} (op {op}, flags {flags}): {exc!r}")
            break
        statuses[resp.status] = statuses.get(resp.status, 0) + 1
        if resp.status == Status.SERVER_ERROR:
            message = M.decode_text(resp.body, len(resp.body))
            failures.append(f"input {i} (op {op}, flags {flags}, {raw[:48]!r}): {message}")
        elif resp.status not in STATUSES:
            failures.append(f"input {i} (op {op}): status {resp.status}")
        done += 1
        if i % CHECK_EVERY == 0:
            r = other.search(np.eye(DIM, dtype=np.float32)[3], k=1, scope=Scope("other"))
            assert r.ids.tolist() == [OTHER_IDS + 3], f"after input {i}: {r.ids}"
            checks += 1
    elapsed = time.monotonic() - started
    assert sc.process.poll() is None, "the sidecar died"
    other.ping()
    # the last input rewound the sequence: the calls after it may have read a response of the
    # numbers before (the word was still ahead); once the sidecar has answered the last one,
    # the channel is in step again
    deadline = time.monotonic() + HANG_S
    while _native.load_acquire(t._resp_seq) != t._seq:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "the fuzzed channel's last request unanswered"
        time.sleep(0.001)
    fuzzed.ping()
    named = {Status(s).name: c for s, c in sorted(statuses.items())}
    print(
        f"\n{done} inputs through a sidecar in {elapsed:.1f} s ({checks} checks of a second "
        f"client): {len(failures)} failures; {named}"
    )
    record_property("fuzz_inputs_through_sidecar", done)
    assert not failures, "\n".join(failures[:20])
    assert done == THROUGH_SIDECAR


@pytest.mark.parametrize("seed", range(3))
def test_every_op_has_a_valid_body_that_succeeds_or_is_refused_cleanly(seed: int) -> None:
    body = np.zeros(ARENA, np.uint8)
    out = np.zeros(ARENA, np.uint8)
    dispatcher = fresh_dispatcher()
    for op, flags, raw in valid_bodies(np.random.default_rng(seed)):
        body[: len(raw)] = np.frombuffer(raw, np.uint8)
        status, n, _, _ = dispatcher.handle(op, flags, body[: len(raw)], out)
        assert status != Status.SERVER_ERROR, (Op(op).name, M.decode_text(out, n))
