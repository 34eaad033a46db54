"""kalos.stores.recall: the budget rule, its edge cases, scopes, and a property test against a
plain reference model of the whole assembly."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kalos.index
from kalos.errors import InvalidRequest, NotFound
from kalos.protocol import codes
from kalos.protocol.messages import NO_SCOPE, RecallRequest, Scope
from kalos.stores.limits import Limits
from kalos.stores.memories import MemoryStore
from kalos.stores.recall import RecallPlan, memory_scope, pick_memories, recall
from kalos.stores.sessions import SessionStore

DIM = 4
T0 = 1_000.0


def memory_store(tokenizer=None, limits=None) -> MemoryStore:  # type: ignore[no-untyped-def]
    return MemoryStore(kalos.index.create("cpu:flat", dim=DIM), limits, tokenizer)


def add(store: MemoryStore, items: list[tuple[int, float, str | bytes | None, list[int] | None]],
        scope: Scope = NO_SCOPE) -> None:  # fmt: skip
    """Adds (id, score for the query e0, payload, token ids) items."""
    ids = np.array([i for i, *_ in items], np.int64)
    vectors = np.zeros((len(items), DIM), np.float32)
    vectors[:, 0] = [s for _, s, *_ in items]
    vectors[:, 1] = 1.0  # never all zero
    kinds = np.array(
        [codes.PAYLOAD_TEXT if isinstance(p, str) else codes.PAYLOAD_BYTES if p else 0
         for _, _, p, _ in items], np.uint8,
    )  # fmt: skip
    blobs = [p.encode() if isinstance(p, str) else (p or b"") for _, _, p, _ in items]
    offsets = np.zeros(len(items) + 1, np.uint64)
    np.cumsum([len(b) for b in blobs], out=offsets[1:])
    blob = np.frombuffer(b"".join(blobs) or b"\0", np.uint8)
    tokens = [None if t is None else np.array(t, np.int32) for *_, t in items]
    store.add(ids, vectors, kinds, offsets, blob, scope, tokens)


def request(
    session: str = "s",
    k: int = 5,
    max_tokens: int = 100,
    max_turns: int | None = None,
    memory_tokens: int | None = None,
    scope: Scope = NO_SCOPE,
) -> RecallRequest:
    q = np.zeros((1, DIM), np.float32)
    q[0, 0] = 1.0
    return RecallRequest(session, q, k, max_tokens, max_turns, memory_tokens, scope)


def tokens(plan: RecallPlan) -> list[int]:
    return np.frombuffer(b"".join(bytes(p) for p in plan.pieces), "<i4").tolist()


@pytest.fixture
def stores() -> tuple[MemoryStore, SessionStore]:
    memories = memory_store()
    add(memories, [
        (1, 4.0, "best", [10, 11, 12]),
        (2, 3.0, "second", [20, 21, 22, 23, 24]),
        (3, 2.0, "third", [30]),
        (4, 1.0, b"bytes", None),  # no token ids: text only
    ])  # fmt: skip
    sessions = SessionStore()
    sessions.append_turn("s", "system", "be brief", np.array([1, 2], np.int32), now=T0, pin=True)
    for t in ([100, 101], [200], [300, 301, 302]):
        sessions.append_turn("s", "user", "x", np.array(t, np.int32), now=T0)
    return memories, sessions


def test_pick_memories_is_whole_or_nothing_best_first() -> None:
    assert pick_memories([3, 5, 1], 100) == [3, 5, 1]
    assert pick_memories([3, 5, 1], 4) == [3, 0, 1]  # 5 does not fit; the next one does
    assert pick_memories([3, 5, 1], 0) == [0, 0, 0]
    assert pick_memories([0, 2], 1) == [0, 0]
    assert pick_memories([], 10) == []


def test_the_whole_assembly_in_order(stores: tuple[MemoryStore, SessionStore]) -> None:
    plan = recall(*stores, request(), now=T0)
    assert tokens(plan) == [1, 2, 10, 11, 12, 20, 21, 22, 23, 24, 30, 100, 101, 200, 300, 301, 302]
    assert plan.ids.tolist() == [1, 2, 3, 4, -1]
    assert plan.memory_tokens == [3, 5, 1, 0, 0]
    assert [p[1] for p in plan.payloads] == [b"best", b"second", b"third", b"bytes", b""]
    assert (plan.system, plan.system_tokens, plan.n_turns, plan.turn_tokens) == (True, 2, 3, 6)
    assert plan.n_tokens == 17
    assert min(plan.context_ns, plan.search_ns, plan.assemble_ns) >= 0


def test_memories_take_their_share_before_the_turns(
    stores: tuple[MemoryStore, SessionStore],
) -> None:
    # 10: the system prompt takes 2; of the 8 left, 3 fits (5 left), 5 fits (0 left), 1 does
    # not: the turns get nothing.
    plan = recall(*stores, request(max_tokens=10), now=T0)
    assert plan.memory_tokens == [3, 5, 0, 0, 0]
    assert tokens(plan) == [1, 2, 10, 11, 12, 20, 21, 22, 23, 24]
    assert plan.n_turns == 0 and plan.turn_tokens == 0
    # 9: 3 fits (4 left), 5 does not, 1 fits (3 left): the newest turn (3 ids) fits after.
    plan = recall(*stores, request(max_tokens=9), now=T0)
    assert plan.memory_tokens == [3, 0, 1, 0, 0]
    assert tokens(plan) == [1, 2, 10, 11, 12, 30, 300, 301, 302]


def test_memory_tokens_caps_the_memories_share(stores: tuple[MemoryStore, SessionStore]) -> None:
    plan = recall(*stores, request(max_tokens=12, memory_tokens=4), now=T0)
    assert plan.memory_tokens == [3, 0, 1, 0, 0]  # within 4
    # 12 - 2 - 4 = 6 for the turns: all three (2 + 1 + 3)
    assert tokens(plan) == [1, 2, 10, 11, 12, 30, 100, 101, 200, 300, 301, 302]
    plan = recall(*stores, request(memory_tokens=0), now=T0)
    assert plan.memory_tokens == [0] * 5
    assert tokens(plan) == [1, 2, 100, 101, 200, 300, 301, 302]
    assert plan.ids.tolist() == [1, 2, 3, 4, -1]  # the hits and texts are still there


def test_max_turns(stores: tuple[MemoryStore, SessionStore]) -> None:
    plan = recall(*stores, request(max_turns=1), now=T0)
    assert tokens(plan)[-3:] == [300, 301, 302] and plan.n_turns == 1
    plan = recall(*stores, request(max_turns=0), now=T0)
    assert plan.n_turns == 0 and tokens(plan)[-1] == 30


def test_a_turn_that_does_not_fit_ends_the_window(
    stores: tuple[MemoryStore, SessionStore],
) -> None:
    # 2 + 9 memories = 11; 15 leaves 4: the newest turn (3) fits, the one before (1) too,
    # then [100, 101] does not: the window stops there.
    plan = recall(*stores, request(max_tokens=15), now=T0)
    assert tokens(plan)[11:] == [200, 300, 301, 302]


def test_a_system_prompt_over_budget_is_left_out(
    stores: tuple[MemoryStore, SessionStore],
) -> None:
    plan = recall(*stores, request(max_tokens=1), now=T0)
    assert not plan.system and plan.system_tokens == 0
    assert tokens(plan) == [30]  # the one memory of <= 1 ids
    plan = recall(*stores, request(max_tokens=0), now=T0)
    assert tokens(plan) == [] and plan.n_tokens == 0
    assert plan.ids.tolist()[:4] == [1, 2, 3, 4]  # still searched


def test_no_hits_and_k_larger_than_the_store() -> None:
    sessions = SessionStore()
    sessions.append_turn("s", "user", "x", np.array([7, 8], np.int32), now=T0)
    empty = memory_store()
    plan = recall(empty, sessions, request(k=1024), now=T0)
    assert (plan.ids == -1).all() and len(plan.ids) == 1024
    assert plan.memory_tokens == [0] * 1024
    assert tokens(plan) == [7, 8]
    with pytest.raises(InvalidRequest, match="k must be"):
        recall(empty, sessions, request(k=0), now=T0)
    with pytest.raises(InvalidRequest, match="k must be"):
        recall(empty, sessions, request(k=1025), now=T0)


def test_an_empty_session() -> None:
    memories = memory_store()
    add(memories, [(1, 1.0, "m", [5, 6])])
    sessions = SessionStore()
    sessions.append_turn("s", "user", "x", np.array([9], np.int32), now=T0)
    sessions.trim("s", 0, now=T0)  # a session with no turns left
    plan = recall(memories, sessions, request(), now=T0)
    assert tokens(plan) == [5, 6]
    assert (plan.system, plan.n_turns, plan.turn_tokens) == (False, 0, 0)
    sessions.append_turn("s", "system", "sys", np.array([1], np.int32), now=T0, pin=True)
    assert tokens(recall(memories, sessions, request(), now=T0)) == [1, 5, 6]


def test_unknown_expired_and_foreign_sessions_are_not_found(
    stores: tuple[MemoryStore, SessionStore],
) -> None:
    memories, sessions = stores
    with pytest.raises(NotFound):
        recall(memories, sessions, request(session="nope"), now=T0)
    sessions.append_turn("t", "user", "x", np.array([1], np.int32), now=T0, ttl_s=5,
                         owner=Scope("acme", "u1"))  # fmt: skip
    assert tokens(recall(memories, sessions, request(session="t"), now=T0 + 1))[-1] == 1
    with pytest.raises(NotFound):
        recall(memories, sessions, request(session="t"), now=T0 + 6)
    sessions.append_turn("t", "user", "x", np.array([1], np.int32), now=T0 + 6,
                         owner=Scope("acme", "u1"))  # fmt: skip
    for scope in (Scope("globex"), Scope("acme", "u2"), Scope(None, "u2")):
        with pytest.raises(NotFound):
            recall(memories, sessions, request(session="t", scope=scope), now=T0 + 6)
    recall(memories, sessions, request(session="t", scope=Scope("acme", "u1")), now=T0 + 6)


def test_memories_default_to_the_sessions_tenant() -> None:
    memories = memory_store()
    add(memories, [(1, 3.0, "acme's", [1])], Scope("acme"))
    add(memories, [(2, 9.0, "globex's", [2])], Scope("globex"))
    add(memories, [(3, 2.0, "acme u1's", [3])], Scope("acme", "u1", "t"))
    add(memories, [(4, 8.0, "nobody's", [4])])
    sessions = SessionStore()
    sessions.append_turn("t", "user", "x", np.array([0], np.int32), now=T0,
                         owner=Scope("acme", "u1"))  # fmt: skip
    sessions.append_turn("anon", "user", "x", np.array([0], np.int32), now=T0)
    hits = recall(memories, sessions, request(session="t"), now=T0).ids
    assert hits.tolist() == [1, 3, -1, -1, -1]  # acme's only
    hits = recall(memories, sessions, request(session="t", scope=Scope(user="u1")), now=T0).ids
    assert hits.tolist()[:2] == [3, -1]
    hits = recall(memories, sessions, request(session="t", scope=Scope(session="zz")), now=T0)
    assert (hits.ids == -1).all()
    hits = recall(memories, sessions, request(session="anon"), now=T0).ids
    assert hits.tolist()[:4] == [2, 4, 1, 3]  # a session without a tenant: no default
    assert memory_scope(Scope(None, "u"), "acme") == Scope("acme", "u")
    assert memory_scope(Scope("x"), "acme") == Scope("x")
    assert memory_scope(Scope(), None) == Scope()


def test_negative_max_tokens_is_refused(stores: tuple[MemoryStore, SessionStore]) -> None:
    with pytest.raises(InvalidRequest, match="max_tokens"):
        recall(*stores, request(max_tokens=-1), now=T0)


# -- memory token ids in the store ------------------------------------------------------------


def test_the_tokenizer_makes_ids_for_text_payloads_only() -> None:
    memories = memory_store(tokenizer=lambda text: np.array([len(w) for w in text.split()],
                                                            np.int32))  # fmt: skip
    add(memories, [(1, 1.0, "a bb ccc", None), (2, 1.0, b"raw bytes", None), (3, 1.0, None, None),
                   (4, 1.0, "given wins", [42])])  # fmt: skip
    got = memories.token_ids(np.array([1, 2, 3, 4, -1]))
    assert [np.frombuffer(b, "<i4").tolist() for b in got] == [[1, 2, 3], [], [], [42], []]
    assert memories.stats()["memory_token_bytes"] == 16


def test_upsert_and_remove_drop_token_ids() -> None:
    memories = memory_store()
    add(memories, [(1, 1.0, "a", [1, 2]), (2, 1.0, "b", [3])])
    add(memories, [(1, 1.0, "a2", None)])  # replaced without ids: has none now
    assert memories.token_ids(np.array([1, 2])) == [b"", np.array([3], "<i4").tobytes()]
    memories.remove(np.array([2]))
    assert memories.token_ids(np.array([2])) == [b""]
    assert memories.stats()["memory_token_bytes"] == 0


def test_bad_token_ids_change_nothing() -> None:
    memories = memory_store(limits=Limits(max_turn_tokens=3))
    add(memories, [(1, 1.0, "a", [1])])
    with pytest.raises(InvalidRequest, match=">= 0"):
        add(memories, [(1, 1.0, "b", [-5]), (2, 1.0, "c", [1])])
    with pytest.raises(InvalidRequest, match="--max-turn-tokens"):
        add(memories, [(2, 1.0, "c", [1, 2, 3, 4])])
    assert len(memories) == 1
    assert memories.token_ids(np.array([1])) == [np.array([1], "<i4").tobytes()]


def test_snapshot_keeps_token_ids(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import sqlite3

    memories = memory_store()
    add(memories, [(1, 1.0, "a", [1, 2]), (2, 1.0, "b", None), (3, 2.0, b"c", [7])])
    db = sqlite3.connect(str(tmp_path / "s.db"))
    memories.snapshot(db, str(tmp_path))
    restored = memory_store()
    restored.restore(db, str(tmp_path))
    ids = np.array([1, 2, 3])
    assert restored.token_ids(ids) == memories.token_ids(ids)
    assert restored.stats() == memories.stats()
    db.execute("DROP TABLE memory_tokens")  # a snapshot made before token ids existed
    older = memory_store()
    older.restore(db, str(tmp_path))
    assert older.token_ids(ids) == [b"", b"", b""] and len(older) == 3


# -- property: the whole assembly against a reference -----------------------------------------

Item = tuple[float, list[int] | None]


def reference(
    system: list[int] | None, turns: list[list[int]], hits: list[list[int] | None],
    max_tokens: int, max_turns: int | None, memory_tokens: int | None,
) -> list[int]:  # fmt: skip
    """The documented rule, written plainly."""
    out: list[int] = []
    left = max_tokens
    if system is not None and len(system) <= left:
        out += system
        left -= len(system)
    share = left if memory_tokens is None else min(left, memory_tokens)
    for t in hits:
        if t is not None and len(t) <= share:
            out += t
            share -= len(t)
            left -= len(t)
    chosen: list[list[int]] = []
    for turn in reversed(turns):
        if (max_turns is not None and len(chosen) >= max_turns) or len(turn) > left:
            break
        chosen.append(turn)
        left -= len(turn)
    for turn in reversed(chosen):
        out += turn
    return out


token_lists = st.lists(st.integers(0, 999), max_size=6)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    system=st.one_of(st.none(), token_lists),
    turns=st.lists(token_lists, max_size=8),
    items=st.lists(st.one_of(st.none(), token_lists), max_size=8),
    k=st.integers(1, 10),
    max_tokens=st.integers(0, 40),
    max_turns=st.one_of(st.none(), st.integers(0, 5)),
    memory_tokens=st.one_of(st.none(), st.integers(0, 20)),
)
def test_recall_matches_the_reference(
    system: list[int] | None, turns: list[list[int]], items: list[list[int] | None], k: int,
    max_tokens: int, max_turns: int | None, memory_tokens: int | None,
) -> None:  # fmt: skip
    memories = memory_store()
    if items:  # distinct scores: item i ranks i-th
        add(memories, [(i, float(len(items) - i), f"m{i}", t) for i, t in enumerate(items)])
    sessions = SessionStore()
    sessions.append_turn("s", "user", "first", np.zeros(0, np.int32), now=T0)
    if system is not None:
        sessions.append_turn("s", "system", "sys", np.array(system, np.int32), now=T0, pin=True)
    for t in turns:
        sessions.append_turn("s", "user", "x", np.array(t, np.int32), now=T0)
    plan = recall(memories, sessions,
                  request(k=k, max_tokens=max_tokens, max_turns=max_turns,
                          memory_tokens=memory_tokens), now=T0)  # fmt: skip
    hits = items[:k]
    want = reference(system, [[], *turns], hits, max_tokens, max_turns, memory_tokens)
    assert tokens(plan) == want
    assert plan.n_tokens == len(want) <= max_tokens
    assert plan.ids.tolist() == list(range(len(hits))) + [-1] * (k - len(hits))
    assert sum(plan.memory_tokens) + plan.system_tokens + plan.turn_tokens == len(want)


def test_token_ids_count_against_the_tenant_byte_limit() -> None:
    item = 4 * DIM  # a vector's bytes, as accounted
    memories = memory_store(limits=Limits(tenant_max_bytes=2 * item + 20))
    add(memories, [(1, 1.0, "ab", [1, 2, 3])], Scope("acme"))  # item + 2 + 12
    with pytest.raises(InvalidRequest, match="--tenant-max-bytes"):
        add(memories, [(2, 1.0, "ab", [1, 2])], Scope("acme"))  # + item + 2 + 8: 2 over
    add(memories, [(2, 1.0, "ab", [1])], Scope("acme"))  # exactly the limit
    with pytest.raises(InvalidRequest, match="--tenant-max-bytes"):
        add(memories, [(1, 1.0, "ab", [1, 2, 3, 4])], Scope("acme"))  # an upsert that grows
    add(memories, [(1, 1.0, "ab", None)])  # moved out of the tenant, ids gone
    add(memories, [(3, 1.0, "", [1, 2, 3])], Scope("acme"))  # 22 + item + 12 = 50
