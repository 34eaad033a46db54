"""client.recall over every transport (inproc, shm, uds), add(tokens=...), the sidecar's
tokenizer for memories, client-side checks and the degraded answer.

The budget rule itself is tested against a reference in tests/stores/test_recall.py; here the
same assembly must come through the wire intact on every transport.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

import kalos
from conftest import DIM, TIMEOUT, Backend
from kalos import Recall, RecallContext, Scope
from kalos.errors import ConfigError, InvalidRequest, NotFound
from kalos.testing import RunningSidecar

E0 = np.eye(DIM, dtype=np.float32)[0]


def memories(client: kalos.Client, scope: Scope | None = None) -> None:
    """Four memories ranked 1 > 2 > 3 > 4 for the query E0."""
    v = np.zeros((4, DIM), np.float32)
    v[:, 0] = [4, 3, 2, 1]
    v[:, 1] = 1
    client.add(v, [1, 2, 3, 4], ["best", "second ü", b"third", None],
               tokens=[[10, 11, 12], [20, 21, 22, 23, 24], [30], None], scope=scope)  # fmt: skip


def conversation(client: kalos.Client, session: str = "s", scope: Scope | None = None) -> None:
    client.append_turn(session, "system", "be brief", [1, 2], pin=True, scope=scope)
    for t in ([100, 101], [200], [300, 301, 302]):
        client.append_turn(session, "user", "x", t, scope=scope)


def test_recall_assembles_context_and_memories(client: kalos.Client) -> None:
    memories(client)
    conversation(client)
    r = client.recall("s", E0, k=5, max_tokens=100)
    assert isinstance(r, Recall)
    assert r.token_ids.dtype == np.int32
    assert r.token_ids.tolist() == [1, 2, 10, 11, 12, 20, 21, 22, 23, 24, 30,
                                    100, 101, 200, 300, 301, 302]  # fmt: skip
    assert r.ids.tolist() == [1, 2, 3, 4, -1]
    assert r.ids.dtype == np.int64 and r.scores.dtype == np.float32
    assert r.scores[:4].tolist() == [4.0, 3.0, 2.0, 1.0]  # ip of E0 with (x, 1, 0, ...)
    assert r.texts == ["best", "second ü", b"third", None]
    assert r.memory_tokens.tolist() == [3, 5, 1, 0, 0]
    assert r.context == RecallContext(turns=3, tokens=6, system=True, system_tokens=2)
    assert r.degraded is False
    assert r.timings.total_us > 0
    assert r.parts.context > 0 and r.parts.search > 0 and r.parts.assemble > 0
    assert r.parts.context + r.parts.search + r.parts.assemble <= r.timings.total_us
    # views into the channel, until the next call; copy=True owns them
    assert not r.token_ids.flags.owndata and not r.ids.flags.owndata
    owned = client.recall("s", E0, k=5, max_tokens=100, copy=True)
    assert owned.token_ids.flags.owndata and owned.ids.flags.owndata
    assert owned.token_ids.tolist() == r.token_ids.tolist()


def test_budget_edges_through_the_client(client: kalos.Client) -> None:
    memories(client)
    conversation(client)
    r = client.recall("s", E0, k=5, max_tokens=9)  # 2 + 3 + (5 dropped) + 1 + newest turn
    assert r.token_ids.tolist() == [1, 2, 10, 11, 12, 30, 300, 301, 302]
    assert r.memory_tokens.tolist() == [3, 0, 1, 0, 0]
    r = client.recall("s", E0, k=5, max_tokens=12, memory_tokens=4)
    assert r.token_ids.tolist() == [1, 2, 10, 11, 12, 30, 100, 101, 200, 300, 301, 302]
    r = client.recall("s", E0, k=5, max_tokens=100, max_turns=1)
    assert r.context.turns == 1 and r.token_ids.tolist()[-3:] == [300, 301, 302]
    r = client.recall("s", E0, k=2, max_tokens=1)  # the system prompt alone is over budget
    assert r.context == RecallContext(0, 0, False, 0)
    assert r.token_ids.tolist() == [] and r.texts == ["best", "second ü"]
    r = client.recall("s", E0, k=1024, max_tokens=100)  # k larger than the index
    assert len(r.ids) == 1024 and r.ids.tolist()[4:] == [-1] * 1020 and len(r.texts) == 4
    client.trim("s", 0)  # an empty session: the system prompt and the memories
    r = client.recall("s", E0, k=3, max_tokens=100)
    assert r.token_ids.tolist() == [1, 2, 10, 11, 12, 20, 21, 22, 23, 24, 30]
    assert r.context == RecallContext(0, 0, True, 2)


def test_no_hits(client: kalos.Client) -> None:
    conversation(client)
    r = client.recall("s", E0, max_tokens=100)
    assert r.ids.tolist() == [-1] * 5 and r.texts == []
    assert r.token_ids.tolist() == [1, 2, 100, 101, 200, 300, 301, 302]
    with pytest.raises(NotFound):
        client.recall("nope", E0, max_tokens=100)


def test_scope_and_tenants(client: kalos.Client) -> None:
    memories(client, Scope("acme"))
    v = np.zeros((1, DIM), np.float32)
    v[0, 0] = 99
    client.add(v, [9], ["globex secret"], tokens=[[666]], scope=Scope("globex"))
    conversation(client, "s", Scope("acme", "u1"))
    r = client.recall("s", E0, k=3, max_tokens=100)  # the session's tenant by default
    assert r.ids.tolist() == [1, 2, 3] and 666 not in r.token_ids.tolist()
    r = client.recall("s", E0, k=3, max_tokens=100, scope=Scope("acme", "u1"))
    assert r.ids.tolist() == [-1, -1, -1]  # acme's memories have no user
    with pytest.raises(NotFound):
        client.recall("s", E0, k=3, max_tokens=100, scope=Scope("globex"))


def test_query_forms(client: kalos.Client) -> None:
    memories(client)
    conversation(client)
    want = client.recall("s", E0, max_tokens=100, copy=True).token_ids.tolist()
    assert client.recall("s", E0.astype(np.float16), max_tokens=100).token_ids.tolist() == want
    assert client.recall("s", E0[None, :], max_tokens=100).token_ids.tolist() == want
    assert client.recall("s", E0.tolist(), max_tokens=100).token_ids.tolist() == want
    torch = pytest.importorskip("torch")
    for q in (torch.from_numpy(E0), torch.from_numpy(E0).double(), torch.from_numpy(E0).half()):
        assert client.recall("s", q, max_tokens=100).token_ids.tolist() == want


def test_client_side_checks(client: kalos.Client) -> None:
    conversation(client)
    for kwargs, match in [
        ({"k": 0}, "k must be"),
        ({"k": 1025}, "k must be"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 2**32}, "max_tokens"),
        ({"max_turns": -1}, "max_turns"),
        ({"memory_tokens": -1}, "memory_tokens"),
        ({"device": "tpu"}, "device"),
    ]:
        args = {"max_tokens": 10, **kwargs}
        with pytest.raises(InvalidRequest, match=match):
            client.recall("s", E0, **args)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="session id"):
        client.recall("", E0, max_tokens=10)
    with pytest.raises(InvalidRequest, match="dimension"):
        client.recall("s", np.ones(DIM + 1), max_tokens=10)
    with pytest.raises(InvalidRequest, match="one query"):
        client.recall("s", np.ones((2, DIM)), max_tokens=10)
    with pytest.raises(InvalidRequest, match="NaN"):
        client.recall("s", np.full(DIM, np.nan), max_tokens=10)
    with pytest.raises(ConfigError, match="gpu_results"):
        client.recall("s", E0, max_tokens=10, device="cuda")
    assert client.recall("s", E0, max_tokens=10, device="cpu").context.system


# -- add(tokens=...) --------------------------------------------------------------------------


def test_add_token_forms(client: kalos.Client) -> None:
    conversation(client)
    client.add(E0, 1, "one item", tokens=[5, 6, 7])  # one item: a flat list
    client.add(E0 * 2, 2, "one item", tokens=np.array([8], np.int64))
    r = client.recall("s", E0, k=2, max_tokens=100, memory_tokens=100)
    assert r.token_ids.tolist()[2:6] == [8, 5, 6, 7]
    with pytest.raises(InvalidRequest, match="one list of token ids per item"):
        client.add(np.ones((2, DIM)), [3, 4], tokens=[[1]])
    with pytest.raises(InvalidRequest, match="int32"):
        client.add(E0, 3, tokens=[2**31])
    with pytest.raises(InvalidRequest, match=">= 0"):
        client.add(E0, 3, tokens=[-1])
    assert client.stats()["items"] == 2  # nothing of the refused adds


def test_add_with_tokens_in_chunks(backend: Callable[..., Backend]) -> None:
    """A batch over the smallest arena goes in chunks; every item keeps its own token ids."""
    client = backend(metric="l2").connect(arena_bytes=64 << 10)
    n = 600
    rng = np.random.default_rng(0)
    v = rng.standard_normal((n, DIM)).astype(np.float32)
    toks = [list(range(i, i + 30)) if i % 3 else None for i in range(n)]
    client.add(v, np.arange(n), [f"m{i}" for i in range(n)], tokens=toks)
    assert 600 * 30 * 4 > 64 << 10  # the token ids alone need several chunks
    client.append_turn("s", "user", "x", [])
    for i in (0, 1, 299, 599):
        r = client.recall("s", v[i], k=1, max_tokens=1000)
        assert r.ids.tolist() == [i] and r.texts == [f"m{i}"]
        assert r.token_ids.tolist() == (toks[i] or [])


# -- a sidecar with a tokenizer, and the degraded answer --------------------------------------


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    tokenizers = pytest.importorskip("tokenizers")
    words = ["[UNK]", "hello", "world", "paris", "is", "in", "france"]
    model = tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = str(tmp_path_factory.mktemp("tok") / "tokenizer.json")
    tok.save(path)
    return path


@pytest.mark.parametrize("transport", ["shm", "uds"])
def test_the_sidecar_tokenizes_memories_at_add_time(
    sidecar: Callable[..., RunningSidecar], tokenizer_file: str, transport: str
) -> None:
    sc = sidecar(extra_args=("--tokenizer", tokenizer_file))
    client = sc.connect(transport=transport, timeout=TIMEOUT)
    v = np.zeros((3, DIM), np.float32)
    v[:, 0] = [3, 2, 1]
    client.add(v, [1, 2, 3], ["paris is in france", b"bytes: no ids", "hello"],
               tokens=[None, None, [42]])  # fmt: skip
    client.append_turn("s", "user", "hello world")
    r = client.recall("s", E0, k=3, max_tokens=100)
    assert r.token_ids.tolist() == [3, 4, 5, 6, 42, 1, 2]
    assert r.memory_tokens.tolist() == [4, 0, 1]
    assert r.texts == ["paris is in france", b"bytes: no ids", "hello"]
    assert client.stats()["memory_token_bytes"] == 20
    client.close()


def test_recall_degrades_when_the_sidecar_is_gone(
    sidecar: Callable[..., RunningSidecar],
) -> None:
    sc = sidecar(metric="l2")
    degrading = sc.connect(timeout=5.0, on_unavailable="degrade")
    conversation(degrading)
    assert not degrading.recall("s", E0, k=3, max_tokens=100).degraded
    sc.stop()
    r = degrading.recall("s", E0, k=3, max_tokens=100)
    assert r.degraded
    assert r.token_ids.tolist() == [] and r.texts == []
    assert r.ids.tolist() == [-1, -1, -1] and r.scores.tolist() == [np.inf] * 3  # l2
    assert r.memory_tokens.tolist() == [0, 0, 0]
    assert r.context == RecallContext(0, 0, False, 0)
    with pytest.raises(InvalidRequest):  # bad input still raises
        degrading.recall("s", E0, k=0, max_tokens=100)
    degrading.close()


def test_an_older_sidecar_is_told_apart(
    sidecar: Callable[..., RunningSidecar], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Against a 1.0 sidecar, recall and add(tokens=...) raise ProtocolMismatch instead of
    sending what it would misread (token ids as payload bytes)."""
    import kalos.transport.handshake

    monkeypatch.setattr(kalos.transport.handshake, "PROTOCOL_VERSION", (1, 0))
    client = sidecar().connect(timeout=TIMEOUT)
    assert client.info["protocol"] == [1, 0]
    with pytest.raises(kalos.ProtocolMismatch, match=r"recall needs protocol 1\.1"):
        client.recall("s", E0, max_tokens=10)
    with pytest.raises(kalos.ProtocolMismatch, match=r"add\(tokens=...\)"):
        client.add(E0, 1, "text", tokens=[1])
    client.add(E0, 1, "text")  # without token ids: as before
    assert client.search(E0, k=1).payloads == ["text"]
    client.close()
