"""Sessions, agent state, event logs and forget through the client, over every transport.

Each test gets a fresh store (a new sidecar process for shm, uds and grpc) from the ``backend``
fixture of conftest.py. Limits, the tokenizer and TTL have tests of their own below: limits
and the tokenizer need sidecar flags, TTL an injected clock (in-process only).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

import kalos
from conftest import DIM, TIMEOUT, Backend, make_inproc_connector
from kalos import Scope
from kalos.client import Context, Forgotten, TurnAdded
from kalos.errors import Conflict, InvalidRequest, NotFound, PayloadTooLarge
from kalos.protocol import layout as L
from kalos.protocol.messages import Event, StateValue
from kalos.server.dispatch import Dispatcher
from kalos.stores.memories import MemoryStore
from kalos.testing import RunningSidecar
from kalos.transport.inproc import InprocTransport

Turn = tuple[str, str, list[int]]


def reference(
    turns: Sequence[Turn], system: Turn | None, max_tokens: int, max_turns: int | None = None
) -> tuple[list[tuple[str, str]], list[int]]:
    """The newest turns that fit, oldest first; the system prompt first when it fits."""
    budget = max_tokens
    chosen: list[Turn] = []
    if system is not None and len(system[2]) <= budget:
        budget -= len(system[2])
    else:
        system = None
    for turn in reversed(turns):
        if (max_turns is not None and len(chosen) >= max_turns) or len(turn[2]) > budget:
            break
        budget -= len(turn[2])
        chosen.append(turn)
    chosen = ([system] if system else []) + chosen[::-1]
    return [(r, x) for r, x, _ in chosen], [t for _, _, toks in chosen for t in toks]


def make_turns(n: int, seed: int = 0) -> list[Turn]:
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        length = int(rng.integers(0, 40))
        role = ("user", "assistant", "tool")[k % 3]
        out.append(
            (
                role,
                f"turn {k}: " + "ü" * int(rng.integers(0, 20)),
                list(range(k * 100, k * 100 + length)),
            )
        )
    return out


def check(client: kalos.Client, session: str, turns, system, max_tokens, max_turns=None) -> None:  # type: ignore[no-untyped-def]
    ctx = client.context(session, max_tokens, max_turns)
    want_turns, want_tokens = reference(turns, system, max_tokens, max_turns)
    assert ctx.tokens.dtype == np.int32
    assert ctx.tokens.tolist() == want_tokens
    assert ctx.turns == want_turns
    assert list(ctx.turns) == want_turns
    assert ctx.system == (bool(want_turns) and system is not None and want_turns[0] == system[:2])
    assert int(ctx.turns.token_counts().sum()) == len(want_tokens)


# -- sessions ---------------------------------------------------------------------------------


def test_context_is_the_newest_turns_that_fit(backend: Callable[..., Backend]) -> None:
    client = backend().connect()
    turns = make_turns(30)
    system: Turn = ("system", "You are brief. ✓", [7, 7, 7, 7, 7])
    assert client.append_turn("s", *system, pin=True) == TurnAdded(0, 5)
    for k, turn in enumerate(turns):
        added = client.append_turn("s", turn[0], turn[1], np.array(turn[2], np.int64))
        assert added == TurnAdded(k + 1, len(turn[2]))
    for budget in (0, 4, 5, 6, 40, 100, 333, 10_000):
        check(client, "s", turns, system, budget)
    for max_turns in (0, 1, 7, 30, 100):
        check(client, "s", turns, system, 10_000, max_turns)
    ctx = client.context("s", 200)
    assert isinstance(ctx, Context) and isinstance(ctx.timings, kalos.Timings)
    assert ctx.turns[0] == system[:2] and ctx.system
    assert ctx.turns[-1] == turns[-1][:2]


def test_context_is_a_view_unless_copied(backend: Callable[..., Backend]) -> None:
    client = backend().connect()
    client.append_turn("a", "user", "x", [1, 2, 3])
    client.append_turn("b", "user", "y", [4, 5, 6])
    view = client.context("a", 10)
    owned = client.context("a", 10, copy=True)
    assert not view.tokens.flags.owndata and owned.tokens.base is None
    turns = view.turns
    client.context("b", 10)
    if client._lent().heap is None:  # the next call reused the arena: the view shows b
        assert view.tokens.tolist() == [4, 5, 6]
    else:  # a view of the token heap (shm): session a's ids, read-only, still there
        assert view.tokens.tolist() == [1, 2, 3] and not view.tokens.flags.writeable
    assert owned.tokens.tolist() == [1, 2, 3] and owned.tokens.flags.writeable
    assert turns == [("user", "x")]  # turns are always owned


def test_context_without_turns(backend: Callable[..., Backend]) -> None:
    client = backend().connect()
    client.append_turn("s", "system", "sys", [9], pin=True)
    client.append_turn("s", "user", "x" * 1000, [1, 2, 3])
    ctx = client.context("s", 10, turns=False)
    assert ctx.tokens.tolist() == [9, 1, 2, 3] and ctx.turns is None and ctx.system
    assert client.context("s", 3, turns=False, copy=True).tokens.tolist() == [9]  # 3 does not fit


def test_context_larger_than_the_arena(backend: Callable[..., Backend]) -> None:
    client = backend().connect(arena_bytes=L.MIN_ARENA_BYTES)
    for k in range(3):
        client.append_turn("s", "user", "x", np.arange(8000, dtype=np.int32) + k)
    assert len(client.context("s", 16_000).tokens) == 16_000
    if client._lent().heap is not None:  # shm: the ids stay in the token heap
        assert len(client.context("s", 24_000).tokens) == 24_000
        # A window with a system prompt is copied (its ids live apart from the turns').
        client.append_turn("s", "system", "sys", np.arange(8000, dtype=np.int32), pin=True)
    with pytest.raises(PayloadTooLarge):
        client.context("s", 24_000)
    client.ping()  # the channel still works


def test_sessions_trim_delete(backend: Callable[..., Backend]) -> None:
    client = backend().connect()
    client.append_turn("b", "user", "x", [1, 2], scope=Scope("acme", "u1"), ttl_s=3600)
    client.append_turn("a", "user", "x", [1], scope=Scope("acme", "u2"))
    client.append_turn("c", "system", "sys", [9], pin=True, scope=Scope("other", "u1"))
    assert [s.session for s in client.sessions()] == ["a", "b", "c"]
    assert [s.session for s in client.sessions(Scope("acme"))] == ["a", "b"]
    assert [s.session for s in client.sessions(Scope(user="u1"))] == ["b", "c"]
    b = client.sessions(Scope("acme", "u1"))[0]
    assert (b.tenant, b.user, b.turns, b.tokens, b.system, b.ttl_s) == (
        "acme",
        "u1",
        1,
        2,
        False,
        3600,
    )
    assert b.expires_at is not None
    c = client.sessions(Scope(session="c"))[0]
    assert (c.turns, c.tokens, c.system, c.expires_at) == (0, 0, True, None)

    turns = make_turns(6)
    for turn in turns:
        client.append_turn("a", *turn)
    assert client.trim("a", 2) == 5  # 7 turns: 1 + 6
    check(client, "a", turns[-2:], None, 1000)
    assert client.trim("a", 10) == 0
    with pytest.raises(NotFound):
        client.trim("a", 1, scope=Scope("other"))
    client.delete_session("a")
    with pytest.raises(NotFound, match="'a'"):
        client.context("a", 10)
    with pytest.raises(NotFound):
        client.delete_session("a")
    with pytest.raises(NotFound):
        client.trim("nope", 1)
    assert [s.session for s in client.sessions()] == ["b", "c"]


def test_sessions_listing_comes_in_pages(backend: Callable[..., Backend]) -> None:
    client = backend().connect(arena_bytes=L.MIN_ARENA_BYTES)
    names = [f"session-{k:04d}-" + "x" * 40 for k in range(700)]  # > 64 KiB of JSON
    for name in names:
        client.append_turn(name, "user", "x", [1], scope=Scope("t" + "y" * 30, "u" * 30))
    assert [s.session for s in client.sessions()] == names
    assert [s.session for s in client.sessions(Scope("t" + "y" * 30))] == names


def test_session_owner_and_scope_filter(backend: Callable[..., Backend]) -> None:
    client = backend().connect()
    client.append_turn("s", "user", "x", [1], scope=Scope("acme", "u1"))
    assert client.context("s", 10, scope=Scope("acme")).tokens.tolist() == [1]
    assert client.context("s", 10, scope=Scope("acme", "u1")).tokens.tolist() == [1]
    with pytest.raises(NotFound):
        client.context("s", 10, scope=Scope("other"))
    with pytest.raises(Conflict):
        client.append_turn("s", "user", "x", [2], scope=Scope("other"))
    with pytest.raises(InvalidRequest, match="names session"):
        client.append_turn("s", "user", "x", [2], scope=Scope("acme", "u1", "t"))
    client.append_turn("s", "user", "y", [2], scope=Scope("acme", "u1", "s"))
    assert client.context("s", 10).tokens.tolist() == [1, 2]


def test_rolling_session(sidecar: Callable[..., RunningSidecar], transport: str) -> None:
    if transport == "inproc":
        pytest.skip("needs --max-session-turns: a real sidecar")
    client = sidecar(extra_args=("--max-session-turns", "3")).connect(
        transport=transport, timeout=TIMEOUT
    )
    for k in range(3):
        client.append_turn("s", "user", str(k), [k])
    with pytest.raises(InvalidRequest, match="--max-session-turns"):
        client.append_turn("s", "user", "3", [3])
    client.append_turn("s", "user", "3", [3], rolling=True)
    client.append_turn("s", "user", "4", [4])
    assert client.context("s", 100).tokens.tolist() == [2, 3, 4]


def test_limits(sidecar: Callable[..., RunningSidecar], transport: str) -> None:
    if transport == "inproc":
        pytest.skip("needs the limit flags: a real sidecar")
    args = ("--max-turn-tokens", "4", "--max-turn-bytes", "16", "--max-state-bytes", "8")
    client = sidecar(extra_args=args).connect(transport=transport, timeout=TIMEOUT)
    client.append_turn("s", "user", "0123456789ab", [1, 2, 3, 4])
    with pytest.raises(InvalidRequest, match=r"5 tokens.*--max-turn-tokens"):
        client.append_turn("s", "user", "x", [1, 2, 3, 4, 5])
    with pytest.raises(InvalidRequest, match=r"17 bytes.*--max-turn-bytes"):
        client.append_turn("s", "user", "0123456789abc", [1])
    client.put("k", b"12345678")
    with pytest.raises(InvalidRequest, match=r"9 bytes.*--max-state-bytes"):
        client.put("k", b"123456789")
    with pytest.raises(InvalidRequest, match="--max-state-bytes"):
        client.cas("k", 0, b"123456789")
    with pytest.raises(InvalidRequest, match="--max-state-bytes"):
        client.log("s", "kind", "123456789")
    assert client.get("k").value == b"12345678"
    assert client.context("s", 100).tokens.tolist() == [1, 2, 3, 4]


def test_client_side_checks(client: kalos.Client) -> None:
    with pytest.raises(InvalidRequest, match="session id"):
        client.append_turn("", "user", "x", [1])
    with pytest.raises(InvalidRequest, match="session id"):
        client.context(42, 10)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="integers"):
        client.append_turn("s", "user", "x", [1.5])
    with pytest.raises(InvalidRequest, match="int32"):
        client.append_turn("s", "user", "x", [2**31])
    with pytest.raises(InvalidRequest, match=">= 0"):
        client.append_turn("s", "user", "x", [-1])
    with pytest.raises(InvalidRequest, match="max_tokens"):
        client.context("s", -1)
    with pytest.raises(InvalidRequest, match="max_turns"):
        client.context("s", 10, -1)
    with pytest.raises(InvalidRequest, match="ttl_s"):
        client.append_turn("s", "user", "x", [1], ttl_s=float("nan"))
    with pytest.raises(InvalidRequest, match="a scope"):
        client.forget(Scope())
    with pytest.raises(InvalidRequest, match="key"):
        client.put("", b"x")
    with pytest.raises(InvalidRequest, match="no tokenizer"):
        client.append_turn("s", "user", "no ids and no tokenizer")
    with pytest.raises(NotFound):
        client.context("s", 10)  # nothing above was stored


# -- agent state ------------------------------------------------------------------------------


def test_state_put_get_delete_cas(backend: Callable[..., Backend]) -> None:
    client = backend().connect()
    scope = Scope("acme", "u1", "s1")
    v1 = client.put("plan", "step 1 ✓", scope=scope)
    assert client.get("plan", scope=scope) == StateValue(v1, "step 1 ✓".encode())
    with pytest.raises(NotFound, match="'plan'"):
        client.get("plan")  # another namespace
    with pytest.raises(Conflict, match=f"version {v1}"):
        client.cas("plan", 0, b"x", scope=scope)
    v2 = client.cas("plan", v1, b"\x00step 2", scope=scope)
    assert v2 > v1
    with pytest.raises(Conflict):
        client.cas("plan", v1, b"stale", scope=scope)
    assert client.get("plan", scope=scope) == StateValue(v2, b"\x00step 2")
    assert client.delete("plan", scope=scope) is True
    assert client.delete("plan", scope=scope) is False
    with pytest.raises(NotFound):
        client.get("plan", scope=scope)
    v3 = client.cas("plan", 0, b"new", scope=scope)
    assert v3 > v2
    big = bytes(range(256)) * 1000  # 256 KB fits the default limit and arena
    client.put("big", big[: 256 << 10])
    assert client.get("big").value == big[: 256 << 10]


def test_cas_lets_one_of_many_writers_win(backend: Callable[..., Backend]) -> None:
    b = backend()
    clients = [b.connect() for _ in range(4)]
    version = clients[0].put("counter", b"0")
    wins: list[int] = []
    lock = threading.Lock()

    def bump(c: kalos.Client) -> None:
        for _ in range(25):
            while True:
                got = c.get("counter")
                try:
                    c.cas("counter", got.version, str(int(got.value) + 1).encode())
                except Conflict:
                    continue
                with lock:
                    wins.append(1)
                break

    threads = [threading.Thread(target=bump, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 100
    got = clients[0].get("counter")
    assert got.value == b"100" and got.version > version


# -- event logs -------------------------------------------------------------------------------


def test_log_and_events(backend: Callable[..., Backend]) -> None:
    client = backend().connect()
    assert client.events("s") == []
    assert client.log("s", "tool_call", "search('x') ✓") == 1
    assert client.log("s", "result", b"\x00\x01\x02") == 2
    assert client.log("s", "empty", "") == 3
    events = client.events("s")
    assert [(e.seq, e.kind, e.data) for e in events] == [
        (1, "tool_call", "search('x') ✓"),
        (2, "result", b"\x00\x01\x02"),
        (3, "empty", ""),
    ]
    assert all(isinstance(e, Event) for e in events)
    assert events[0].time <= events[1].time <= events[2].time
    assert client.events("s", since=2) == events[2:]
    assert client.events("s", since=3) == []
    assert client.events("s", limit=2) == events[:2]
    assert client.events("s", since=1, limit=1) == events[1:2]


def test_events_come_in_pages(backend: Callable[..., Backend]) -> None:
    client = backend().connect(arena_bytes=L.MIN_ARENA_BYTES)
    for k in range(200):
        assert client.log("s", "step", f"{k:04d}" + "x" * 1000) == k + 1  # 200 KB > the arena
    events = client.events("s")
    assert [e.seq for e in events] == list(range(1, 201))
    assert [e.data[:4] for e in events] == [f"{k:04d}" for k in range(200)]
    assert [e.seq for e in client.events("s", since=150, limit=100)] == list(range(151, 201))


def test_log_owner_comes_from_the_session(backend: Callable[..., Backend]) -> None:
    client = backend().connect()
    client.append_turn("s", "user", "x", [1], scope=Scope("acme", "u1"))
    client.log("s", "step", "one")  # the log takes the session's owner
    assert len(client.events("s", scope=Scope("acme"))) == 1
    assert client.events("s", scope=Scope("other")) == []
    with pytest.raises(Conflict):
        client.log("s", "step", "x", scope=Scope("other"))
    client.delete_session("s")
    assert len(client.events("s")) == 1  # delete_session keeps the log; forget removes it
    assert client.forget(Scope(session="s")).logs == 1
    assert client.events("s") == []


# -- forget -----------------------------------------------------------------------------------


def test_forget_removes_everything_of_a_user(backend: Callable[..., Backend]) -> None:
    client = backend().connect()
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((6, DIM)).astype(np.float32)
    u1, u2 = Scope("acme", "u1"), Scope("acme", "u2")
    client.add(vectors[:3], [1, 2, 3], ["a", "b", "c"], scope=Scope("acme", "u1", "s1"))
    client.add(vectors[3:5], [4, 5], ["d", "e"], scope=u2)
    client.add(vectors[5:], [6], ["f"], scope=Scope("other", "u1"))
    client.append_turn("s1", "user", "hi", [1], scope=u1)
    client.append_turn("s2", "user", "hi", [1], scope=u2)
    client.put("k", b"v", scope=Scope("acme", "u1", "s1"))
    client.put("k", b"v", scope=u1)
    client.put("k", b"v", scope=u2)
    client.log("s1", "step", "x")

    assert client.forget(u1) == Forgotten(memories=3, sessions=1, state=2, logs=1)
    for q in vectors:
        assert set(client.search(q, 10).ids.tolist()) == {4, 5, 6, -1}
    assert client.search(vectors[0], 10, scope=Scope("acme", "u1")).ids.tolist() == [-1] * 10
    with pytest.raises(NotFound):
        client.context("s1", 10)
    with pytest.raises(NotFound):
        client.get("k", scope=u1)
    assert client.get("k", scope=u2).value == b"v"
    assert client.events("s1") == []
    assert [s.session for s in client.sessions()] == ["s2"]
    assert client.forget(u1) == Forgotten(0, 0, 0, 0)
    assert client.forget(Scope("acme")) == Forgotten(2, 1, 1, 0)
    assert set(client.search(vectors[0], 10).ids.tolist()) == {6, -1}


def test_stats_count_sessions_and_state(backend: Callable[..., Backend]) -> None:
    client = backend().connect()
    client.append_turn("s", "user", "x", [1, 2, 3])
    client.put("k", b"abc")
    client.log("s", "k", "d")
    stats = client.stats()
    assert (stats["sessions"], stats["session_turns"], stats["session_tokens"]) == (1, 1, 3)
    assert (stats["state_keys"], stats["state_bytes"], stats["events"]) == (1, 3, 1)
    assert stats["requests"]["append_turn"] == 1 and stats["requests"]["state_put"] == 1


# -- TTL with an injected clock (in-process) --------------------------------------------------


class Clocked:
    """The dispatcher, with each request's time taken from ``now_s`` instead of the clock."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher
        self.now_s = 1_800_000_000.0

    def info(self) -> dict[str, Any]:
        return self.dispatcher.info()

    def handle(
        self, op: int, flags: int, body: np.ndarray, out: np.ndarray
    ) -> tuple[int, int, int, int]:
        return self.dispatcher.handle(op, flags, body, out, now_ns=int(self.now_s * 1e9))


def test_ttl_expiry_with_an_injected_clock() -> None:
    dispatcher = Dispatcher(MemoryStore(kalos.index.create("cpu:flat", dim=DIM, metric="ip")))
    clock = Clocked(dispatcher)
    lock = threading.Lock()
    client = kalos.Client("inproc", connector=lambda: InprocTransport(clock, lock), timeout=TIMEOUT)
    client.append_turn("short", "user", "x", [1], ttl_s=10)
    client.append_turn("long", "user", "x", [2], ttl_s=100)
    client.append_turn("forever", "user", "x", [3])
    clock.now_s += 9
    client.append_turn("short", "user", "y", [4])  # refreshes: expires at +19
    clock.now_s += 9  # +18
    assert client.context("short", 10).tokens.tolist() == [1, 4]
    clock.now_s += 1  # +19
    with pytest.raises(NotFound):
        client.context("short", 10)
    assert [s.session for s in client.sessions()] == ["forever", "long"]
    assert client.stats()["sessions"] == 2  # listing reaped the expired one
    clock.now_s += 100
    assert [s.session for s in client.sessions()] == ["forever"]
    client.append_turn("short", "user", "again", [5], scope=Scope("new"))  # a new session
    assert client.context("short", 10).tokens.tolist() == [5]
    events_at = clock.now_s
    client.log("short", "step", "x")
    assert client.events("short")[0].time == pytest.approx(events_at)
    client.close()


# -- the tokenizer -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    tokenizers = pytest.importorskip("tokenizers")
    words = ["[UNK]", "hello", "world", "how", "are", "you", "?", "fine"]
    model = tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = str(tmp_path_factory.mktemp("tok") / "tokenizer.json")
    tok.save(path)
    return path


def test_the_sidecar_tokenizes_turns_without_ids(
    sidecar: Callable[..., RunningSidecar], tokenizer_file: str
) -> None:
    client = sidecar(extra_args=("--tokenizer", tokenizer_file)).connect(timeout=TIMEOUT)
    assert client.append_turn("s", "user", "hello world how are you ?") == TurnAdded(1, 6)
    assert client.append_turn("s", "assistant", "fine , fine") == TurnAdded(2, 3)
    client.append_turn("s", "tool", "ids given", [42, 43])  # given ids win
    ctx = client.context("s", 100)
    assert ctx.tokens.tolist() == [1, 2, 3, 4, 5, 6, 7, 0, 7, 42, 43]
    assert ctx.turns[1] == ("assistant", "fine , fine")


def test_a_tokenizer_files_padding_and_truncation_are_ignored(
    sidecar: Callable[..., RunningSidecar], tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """Embedding models ship tokenizer.json files that pad (and truncate) every text to a
    fixed length: a turn's ids must still be its text's ids, all of them, no padding."""
    tokenizers = pytest.importorskip("tokenizers")
    words = ["[PAD]", "[UNK]", "hello", "world"]
    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]")
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.enable_padding(length=8, pad_id=0, pad_token="[PAD]")
    tok.enable_truncation(max_length=8)
    path = str(tmp_path / "tokenizer.json")
    tok.save(path)
    assert len(tokenizers.Tokenizer.from_file(path).encode("hello").ids) == 8  # the file pads
    client = sidecar(extra_args=("--tokenizer", path)).connect(timeout=TIMEOUT)
    assert client.append_turn("s", "user", "hello world") == TurnAdded(1, 2)
    client.append_turn("s", "user", " ".join(["hello"] * 12))  # longer than the truncation
    assert client.context("s", 100).tokens.tolist() == [2, 3] + [2] * 12


def test_a_missing_tokenizer_file_stops_the_start(
    sidecar: Callable[..., RunningSidecar], tmp_path
) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("tokenizers")
    with pytest.raises(kalos.ConnectError, match="exited"):
        sidecar(extra_args=("--tokenizer", str(tmp_path / "missing.json")))


def test_inproc_dispatcher_has_stores() -> None:
    connector = make_inproc_connector()
    assert connector().server_info["name"] == "inproc"
