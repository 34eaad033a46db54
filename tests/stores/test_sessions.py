"""SessionStore: context windows against a reference, system prompt, trim, TTL, limits."""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kalos.errors import Conflict, InvalidRequest, NotFound
from kalos.protocol.messages import Scope
from kalos.stores.limits import Limits
from kalos.stores.sessions import REAP_INTERVAL_S, SessionStore, TurnWindow

T0 = 1_800_000_000.0  # a fixed "now", seconds since the epoch

Turn = tuple[str, str, np.ndarray]


def ids(*values: int) -> np.ndarray:
    return np.array(values, np.int32)


def turn_ids(k: int, n: int) -> np.ndarray:
    """n distinct-looking ids for turn k."""
    return np.arange(1000 * k, 1000 * k + n, dtype=np.int32)


def reference(
    turns: Sequence[Turn], system: Turn | None, max_tokens: int, max_turns: int | None
) -> tuple[list[tuple[str, str]], np.ndarray, bool]:
    """The newest turns that fit, oldest first, the system prompt first when it fits."""
    budget = max_tokens
    with_system = system is not None and len(system[2]) <= budget
    if with_system:
        assert system is not None
        budget -= len(system[2])
    chosen: list[Turn] = []
    for turn in reversed(turns):
        if max_turns is not None and len(chosen) >= max_turns:
            break
        if len(turn[2]) > budget:
            break
        budget -= len(turn[2])
        chosen.append(turn)
    chosen.reverse()
    if with_system:
        assert system is not None
        chosen.insert(0, system)
    tokens = np.concatenate([t[2] for t in chosen]) if chosen else np.empty(0, np.int32)
    return [(r, x) for r, x, _ in chosen], tokens, with_system


def window_turns(w: TurnWindow) -> tuple[list[tuple[str, str]], np.ndarray, bool]:
    """A TurnWindow as (role, text) pairs and tokens, the way the wire lays them out."""
    tokens_mv, meta_mv, text_mv, system = w
    meta_b, text_b, tok_b = bytes(meta_mv), bytes(text_mv), bytes(tokens_mv)
    if system is not None:
        assert len(system.tokens) == 4 * system.n_tokens
        meta_b, text_b, tok_b = system.meta + meta_b, system.text + text_b, system.tokens + tok_b
    meta = np.frombuffer(meta_b, np.uint32).reshape(-1, 4)
    out, x = [], 0
    for role_len, text_len, _n, _ in meta.tolist():
        out.append(
            (
                text_b[x : x + role_len].decode(),
                text_b[x + role_len : x + role_len + text_len].decode(),
            )
        )
        x += role_len + text_len
    assert x == len(text_b)
    tokens = np.frombuffer(tok_b, np.int32)
    assert int(meta[:, 2].sum()) == len(tokens)
    return out, tokens, system is not None


def check_context(
    store: SessionStore,
    session: str,
    turns: Sequence[Turn],
    system: Turn | None,
    max_tokens: int,
    max_turns: int | None = None,
) -> None:
    got = window_turns(store.context(session, max_tokens, max_turns, now=T0))
    want = reference(turns, system, max_tokens, max_turns)
    assert got[0] == want[0]
    np.testing.assert_array_equal(got[1], want[1])
    assert got[1].dtype == np.int32
    assert got[2] == want[2]
    # The token-only window (CONTEXT without turns) is the same ids and turn count.
    tokens_mv, n_turns, sp = store.context_tokens(session, max_tokens, max_turns, now=T0)
    head = b"" if sp is None else sp.tokens
    np.testing.assert_array_equal(np.frombuffer(head + bytes(tokens_mv), np.int32), want[1])
    assert (sp is not None) == want[2]
    assert n_turns == len(want[0]) - want[2]


@pytest.fixture
def store() -> SessionStore:
    return SessionStore()


def fill(store: SessionStore, session: str, lengths: Sequence[int], **kw: object) -> list[Turn]:
    turns = []
    for k, n in enumerate(lengths):
        turn = ("user" if k % 2 == 0 else "assistant", f"turn {k} ✓", turn_ids(k, n))
        store.append_turn(session, *turn, now=T0, **kw)  # type: ignore[arg-type]
        turns.append(turn)
    return turns


def test_newest_turns_that_fit_oldest_first(store: SessionStore) -> None:
    turns = fill(store, "s", [5, 7, 3, 4])
    for budget in range(0, 22):
        check_context(store, "s", turns, None, budget)
    w = store.context("s", 7, now=T0)  # 4 + 3 fit, 7 more does not
    np.testing.assert_array_equal(
        window_turns(w)[1], np.concatenate([turn_ids(2, 3), turn_ids(3, 4)])
    )


def test_a_turn_that_does_not_fit_ends_the_window(store: SessionStore) -> None:
    turns = fill(store, "s", [1, 1, 50, 2])
    check_context(store, "s", turns, None, 10)
    assert len(window_turns(store.context("s", 10, now=T0))[0]) == 1  # 1-token turns not reached


def test_max_turns(store: SessionStore) -> None:
    turns = fill(store, "s", [2, 2, 2, 2])
    for max_turns in range(0, 6):
        check_context(store, "s", turns, None, 100, max_turns)


def test_system_prompt_first_when_it_fits_and_counted(store: SessionStore) -> None:
    system = ("system", "you are terse", ids(7, 7, 7))
    turns = fill(store, "s", [4, 4])
    store.append_turn("s", *system, pin=True, now=T0)
    for budget in range(0, 14):
        check_context(store, "s", turns, system, budget)
    w = store.context("s", 5, now=T0)  # 3 system + not 4: the system prompt alone
    assert w[3] is not None and len(w[0]) == 0
    w = store.context("s", 2, now=T0)  # the system prompt does not fit: turns alone
    assert w[3] is None and len(w[0]) == 0
    # max_turns counts conversation turns only
    check_context(store, "s", turns, system, 100, 1)
    check_context(store, "s", turns, system, 100, 0)


def test_pinning_again_replaces_the_system_prompt(store: SessionStore) -> None:
    store.append_turn("s", "system", "one", ids(1), pin=True, now=T0)
    turns_added, n = store.append_turn("s", "system", "two", ids(2, 2), pin=True, now=T0)
    assert (turns_added, n) == (0, 2)
    assert store.system("s", now=T0) is not None
    role, text, toks = store.system("s", now=T0)  # type: ignore[misc]
    assert (role, text, toks.tolist()) == ("system", "two", [2, 2])
    check_context(store, "s", [], ("system", "two", ids(2, 2)), 10)


def test_empty_session_and_empty_turns(store: SessionStore) -> None:
    turns = fill(store, "s", [0, 3, 0])
    check_context(store, "s", turns, None, 3)
    check_context(store, "s", turns, None, 0)


def test_append_returns_turn_count_and_tokens(store: SessionStore) -> None:
    assert store.append_turn("s", "user", "a", ids(1, 2), now=T0) == (1, 2)
    assert store.append_turn("s", "user", "b", ids(3), now=T0) == (2, 1)


def test_unknown_session_is_not_found(store: SessionStore) -> None:
    with pytest.raises(NotFound, match="'nope'"):
        store.context("nope", 10, now=T0)
    with pytest.raises(NotFound, match="'nope'"):
        store.context_tokens("nope", 10, now=T0)
    with pytest.raises(NotFound):
        store.trim("nope", 1, now=T0)
    with pytest.raises(NotFound):
        store.delete("nope", now=T0)


def test_trim_keeps_the_newest(store: SessionStore) -> None:
    turns = fill(store, "s", [3, 4, 5, 6])
    assert store.trim("s", 2, now=T0) == (2, 2)
    check_context(store, "s", turns[2:], None, 100)
    assert store.trim("s", 5, now=T0) == (0, 2)
    assert [t[:2] for t in store.turns("s", now=T0)] == [t[:2] for t in turns[2:]]
    more = ("user", "after trim", turn_ids(9, 2))
    store.append_turn("s", *more, now=T0)
    check_context(store, "s", [*turns[2:], more], None, 100)
    assert store.trim("s", 0, now=T0) == (3, 0)
    check_context(store, "s", [], None, 100)


def test_delete(store: SessionStore) -> None:
    fill(store, "s", [1])
    store.delete("s", now=T0)
    with pytest.raises(NotFound):
        store.context("s", 10, now=T0)
    assert store.sessions(None, now=T0) == []


def test_owner_is_fixed_at_creation(store: SessionStore) -> None:
    acme = Scope("acme", "u1")
    store.append_turn("s", "user", "a", ids(1), owner=acme, now=T0)
    store.append_turn("s", "user", "b", ids(2), now=T0)  # no owner given: fine
    store.append_turn("s", "user", "c", ids(3), owner=Scope("acme"), now=T0)  # same tenant
    with pytest.raises(Conflict):
        store.append_turn("s", "user", "x", ids(4), owner=Scope("other"), now=T0)
    with pytest.raises(Conflict):
        store.append_turn("s", "user", "x", ids(4), owner=Scope("acme", "u2"), now=T0)
    assert store.turns("s", now=T0)[-1][1] == "c"  # the refused appends left no trace
    # reads filter by owner: another tenant does not see the session
    store.context("s", 10, now=T0, scope=Scope("acme"))
    assert store.context_tokens("s", 10, now=T0, scope=Scope("acme"))[1] == 3
    with pytest.raises(NotFound):
        store.context("s", 10, now=T0, scope=Scope("other"))
    with pytest.raises(NotFound):
        store.context_tokens("s", 10, now=T0, scope=Scope("other"))
    with pytest.raises(NotFound):
        store.trim("s", 0, now=T0, scope=Scope("acme", "u2"))
    with pytest.raises(InvalidRequest, match="names session"):
        store.append_turn("s", "user", "x", ids(1), owner=Scope("acme", "u1", "t"), now=T0)


def test_sessions_lists_by_scope(store: SessionStore) -> None:
    store.append_turn("b", "user", "x", ids(1, 2), owner=Scope("acme", "u1"), now=T0)
    store.append_turn("a", "user", "x", ids(1), owner=Scope("acme", "u2"), now=T0)
    store.append_turn("c", "user", "x", ids(1), owner=Scope("other", "u1"), now=T0)
    assert [i.session for i in store.sessions(None, now=T0)] == ["a", "b", "c"]
    assert [i.session for i in store.sessions(Scope("acme"), now=T0)] == ["a", "b"]
    assert [i.session for i in store.sessions(Scope(user="u1"), now=T0)] == ["b", "c"]
    assert [i.session for i in store.sessions(Scope(session="c"), now=T0)] == ["c"]
    assert [i.session for i in store.sessions(None, now=T0, after="a", limit=1)] == ["b"]
    info = store.sessions(Scope("acme", "u1"), now=T0)[0]
    assert (info.tenant, info.user, info.turns, info.tokens, info.system) == (
        "acme", "u1", 1, 2, False,
    )  # fmt: skip


def test_forget_by_scope(store: SessionStore) -> None:
    store.append_turn("a", "user", "x", ids(1), owner=Scope("acme", "u1"), now=T0)
    store.append_turn("b", "user", "x", ids(1), owner=Scope("acme", "u2"), now=T0)
    store.append_turn("c", "user", "x", ids(1), owner=Scope("other", "u1"), now=T0)
    assert store.forget(Scope("acme", "u1")) == 1
    assert [i.session for i in store.sessions(None, now=T0)] == ["b", "c"]
    assert store.forget(Scope(session="c")) == 1
    assert store.forget(Scope("acme")) == 1
    assert len(store) == 0


# -- TTL ------------------------------------------------------------------------------------


def test_ttl_expires_after_the_last_append(store: SessionStore) -> None:
    store.append_turn("s", "user", "a", ids(1), ttl_s=10, now=T0)
    store.append_turn("s", "user", "b", ids(2), now=T0 + 5)  # refreshes: expires at T0 + 15
    assert len(window_turns(store.context("s", 10, now=T0 + 14.9))[1]) == 2
    with pytest.raises(NotFound):
        store.context("s", 10, now=T0 + 15)
    with pytest.raises(NotFound):
        store.context_tokens("s", 10, now=T0 + 15)
    assert store.sessions(None, now=T0 + 15) == []
    assert store.owner("s", T0 + 15) is None


def test_expired_sessions_are_reclaimed(store: SessionStore) -> None:
    for k in range(5):
        store.append_turn(f"s{k}", "user", "a", ids(1), ttl_s=1 + k, now=T0)
    store.append_turn("keep", "user", "a", ids(1), now=T0)
    assert len(store) == 6
    assert store.reap(T0 + 2.5) == 2  # s0 (T0+1) and s1 (T0+2)
    assert len(store) == 4
    # a write reaps at most once per REAP_INTERVAL_S, then everything that expired
    store.append_turn("keep", "user", "b", ids(1), now=T0 + 100)
    assert len(store) == 1
    store.append_turn("x", "user", "b", ids(1), ttl_s=1, now=T0 + 100)
    store.append_turn("keep", "user", "c", ids(1), now=T0 + 100 + REAP_INTERVAL_S / 2)
    assert len(store) == 2  # x expired at T0+101 but the reap interval has not passed


def test_an_expired_id_starts_a_new_session(store: SessionStore) -> None:
    store.append_turn("s", "user", "old", ids(1), ttl_s=1, owner=Scope("acme"), now=T0)
    store.append_turn("s", "user", "new", ids(2), owner=Scope("other"), now=T0 + 2)
    assert [t[1] for t in store.turns("s", now=T0 + 2)] == ["new"]
    assert store.owner("s", T0 + 2) == Scope("other", None, "s")
    assert store.reap(T0 + 3) == 0  # the stale heap entry of the old session is skipped


def test_ttl_zero_removes_it_and_none_keeps_it(store: SessionStore) -> None:
    store.append_turn("s", "user", "a", ids(1), ttl_s=1, now=T0)
    store.append_turn("s", "user", "b", ids(1), now=T0 + 0.5)  # keeps ttl 1
    assert store.sessions(None, now=T0)[0].ttl_s == 1
    store.append_turn("s", "user", "c", ids(1), ttl_s=0, now=T0 + 1)
    assert store.sessions(None, now=T0 + 1000)[0].expires_at is None
    store.append_turn("s", "user", "d", ids(1), ttl_s=2, now=T0 + 1000)  # shorter again
    assert store.reap(T0 + 1002) == 1


# -- limits ---------------------------------------------------------------------------------


def test_turn_limits() -> None:
    store = SessionStore(Limits(max_turn_tokens=4, max_turn_bytes=12, max_role_bytes=4))
    store.append_turn("s", "user", "12345678", ids(1, 2, 3, 4), now=T0)
    with pytest.raises(InvalidRequest, match=r"5 tokens; the limit is 4.*--max-turn-tokens"):
        store.append_turn("s", "user", "x", ids(1, 2, 3, 4, 5), now=T0)
    with pytest.raises(InvalidRequest, match=r"13 bytes; the limit is 12.*--max-turn-bytes"):
        store.append_turn("s", "user", "123456789", ids(1), now=T0)
    with pytest.raises(InvalidRequest, match="role"):
        store.append_turn("s", "assistant", "x", ids(1), now=T0)
    with pytest.raises(InvalidRequest, match="role"):
        store.append_turn("s", "", "x", ids(1), now=T0)
    with pytest.raises(InvalidRequest, match="int32"):
        store.append_turn("s", "user", "x", np.array([1], np.int64), now=T0)
    with pytest.raises(InvalidRequest, match=">= 0"):
        store.append_turn("s", "user", "x", ids(-1), now=T0)
    with pytest.raises(InvalidRequest, match="ttl_s"):
        store.append_turn("s", "user", "x", ids(1), ttl_s=-1, now=T0)
    with pytest.raises(InvalidRequest, match="session id"):
        store.append_turn("", "user", "x", ids(1), now=T0)
    assert len(store.turns("s", now=T0)) == 1


def test_a_full_session_refuses_unless_rolling() -> None:
    store = SessionStore(Limits(max_session_turns=3))
    turns = fill(store, "s", [1, 2, 3])
    with pytest.raises(InvalidRequest, match=r"3 turns.*--max-session-turns.*rolling=True"):
        store.append_turn("s", "user", "x", ids(9), now=T0)
    store.append_turn("s", "system", "pinned", ids(5), pin=True, now=T0)  # not a turn: fine
    check_context(store, "s", turns, ("system", "pinned", ids(5)), 100)
    extra = ("user", "rolled", turn_ids(7, 2))
    store.append_turn("s", *extra, rolling=True, now=T0)
    check_context(store, "s", [*turns[1:], extra], ("system", "pinned", ids(5)), 100)
    store.append_turn("s", "user", "again", ids(1), now=T0)  # stays rolling
    assert len(store.turns("s", now=T0)) == 3
    with pytest.raises(InvalidRequest):  # rolling=False on a full session: refused
        store.append_turn("s", "user", "off", ids(1), rolling=False, now=T0)
    store.trim("s", 2, now=T0)
    store.append_turn("s", "user", "off", ids(1), rolling=False, now=T0)  # switched off...
    with pytest.raises(InvalidRequest):  # ...the next append to the full session is refused
        store.append_turn("s", "user", "x", ids(1), now=T0)


def test_rolling_window_over_many_turns_matches_the_reference() -> None:
    # Enough turns that the dropped head is compacted many times.
    store = SessionStore(Limits(max_session_turns=40))
    rng = np.random.default_rng(3)
    turns: list[Turn] = []
    for k in range(500):
        turn = ("user", "t" * int(rng.integers(0, 30)), turn_ids(k, int(rng.integers(0, 50))))
        store.append_turn("s", *turn, rolling=True, now=T0)
        turns = [*turns, turn][-40:]
        if k % 37 == 0:
            check_context(store, "s", turns, None, int(rng.integers(0, 800)))
    check_context(store, "s", turns, None, 10**6)


def test_tokens_are_copied_in(store: SessionStore) -> None:
    mine = ids(1, 2, 3)
    store.append_turn("s", "user", "a", mine, now=T0)
    mine[:] = 0
    assert window_turns(store.context("s", 10, now=T0))[1].tolist() == [1, 2, 3]


# -- tokenizer ------------------------------------------------------------------------------


def test_no_tokenizer_and_no_tokens_is_a_clear_error(store: SessionStore) -> None:
    with pytest.raises(InvalidRequest, match=r"no tokenizer.*--tokenizer"):
        store.append_turn("s", "user", "hello", None, now=T0)


def test_the_configured_tokenizer_makes_the_ids() -> None:
    store = SessionStore(tokenizer=lambda text: np.array([len(w) for w in text.split()], np.int32))
    assert store.append_turn("s", "user", "a bb ccc", None, now=T0) == (1, 3)
    assert window_turns(store.context("s", 10, now=T0))[1].tolist() == [1, 2, 3]


# -- property: any sequence of appends, pins, trims, against the reference -------------------

ops = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(0, 12), st.booleans()),
        st.tuples(st.just("pin"), st.integers(0, 12), st.booleans()),
        st.tuples(st.just("trim"), st.integers(0, 6), st.booleans()),
        st.tuples(st.just("context"), st.integers(0, 60), st.one_of(st.none(), st.integers(0, 8))),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(ops)
def test_any_history_matches_the_reference(history: list[tuple]) -> None:
    store = SessionStore(Limits(max_session_turns=6))
    turns: list[Turn] = []
    system: Turn | None = None
    rolling = False
    store.append_turn("s", "system", "", ids(), pin=True, now=T0)
    system = ("system", "", ids())
    for k, (op, n, flag) in enumerate(history):
        if op == "append":
            turn = ("user", "x" * n, turn_ids(k, n))
            rolling = rolling or flag
            if len(turns) >= 6 and not rolling:
                with pytest.raises(InvalidRequest):
                    store.append_turn("s", *turn, rolling=rolling or None, now=T0)
                continue
            store.append_turn("s", *turn, rolling=rolling or None, now=T0)
            turns = [*turns, turn][-6:]
        elif op == "pin":
            system = ("system", "p" * n, turn_ids(k, n))
            store.append_turn("s", *system, pin=True, now=T0)
        elif op == "trim":
            store.trim("s", n, now=T0)
            turns = turns[len(turns) - n :] if n < len(turns) else turns
        else:
            check_context(store, "s", turns, system, n, flag)
    check_context(store, "s", turns, system, 10**6)


# -- snapshot / restore ---------------------------------------------------------------------


def test_snapshot_restore_round_trip(tmp_path) -> None:  # type: ignore[no-untyped-def]
    store = SessionStore(Limits(max_session_turns=5))
    fill(store, "plain", [3, 0, 4])
    fill(store, "rolled", [1, 2, 3, 4, 5, 6, 7], rolling=True)  # head dropped, not compacted
    store.append_turn(
        "pinned", "system", "sys ünï", ids(9, 9), pin=True, owner=Scope("acme", "u1"), now=T0
    )
    fill(store, "pinned", [2], owner=Scope("acme", "u1"))
    store.append_turn("ttl", "user", "x", ids(1), ttl_s=30, owner=Scope("t"), now=T0)
    store.append_turn("empty", "system", "only a system prompt", ids(), pin=True, now=T0)
    db = sqlite3.connect(str(tmp_path / "snap.db"))
    store.snapshot(db, str(tmp_path))
    db.commit()

    again = SessionStore(Limits(max_session_turns=5))
    again.append_turn("stale", "user", "gone after restore", ids(1), now=T0)
    again.restore(sqlite3.connect(str(tmp_path / "snap.db")), str(tmp_path))
    assert again.sessions(None, now=T0) == store.sessions(None, now=T0)
    for info in store.sessions(None, now=T0):
        name = info.session
        assert _dump(again, name) == _dump(store, name)
        for budget in (0, 3, 7, 100):
            a = window_turns(again.context(name, budget, now=T0))
            b = window_turns(store.context(name, budget, now=T0))
            assert a[0] == b[0] and a[2] == b[2]
            np.testing.assert_array_equal(a[1], b[1])
    # settings survive: rolling keeps rolling, the TTL still expires, appends still work
    fill(again, "rolled", [8])
    assert len(again.turns("rolled", now=T0)) == 5
    assert again.reap(T0 + 31) == 1
    fill(again, "plain", [2, 2])
    assert [len(t[2]) for t in again.turns("plain", now=T0)] == [3, 0, 4, 2, 2]
    with pytest.raises(Conflict):
        again.append_turn("pinned", "user", "x", ids(1), owner=Scope("other"), now=T0)


def test_snapshot_of_an_empty_store(tmp_path) -> None:  # type: ignore[no-untyped-def]
    db = sqlite3.connect(":memory:")
    SessionStore().snapshot(db, str(tmp_path))
    again = SessionStore()
    again.restore(db, str(tmp_path))
    assert len(again) == 0


def _dump(store: SessionStore, name: str) -> tuple:
    turns = [(r, x, t.tolist()) for r, x, t in store.turns(name, now=T0)]
    system = store.system(name, now=T0)
    return turns, None if system is None else (system[0], system[1], system[2].tolist())
