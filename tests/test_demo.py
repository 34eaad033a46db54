"""kalos demo's building blocks, without the embedding model.

The corpus loads and is what the demo says it is; its parsers refuse malformed files; and the
conversations run through a real sidecar (with ``--tokenizer``) and, where redis-server,
redis-py and faiss are installed, through the Redis pipeline, with a deterministic stand-in
for the model: :func:`bag_of_words_for_tests`, a hashed bag of words (a real function of the
text, so recalls differ by turn). Every recall is checked against an exact search and a token
layout computed here from the corpus and the tokenizer.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import zlib
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import pytest

from conftest import TIMEOUT
from kalos import ConfigError, Scope
from kalos.demo import (
    Budget,
    Conversation,
    KalosMemory,
    Memory,
    RedisPipeline,
    load_corpus,
    parse_conversations,
    parse_memories,
    print_summary,
    run_conversations,
)
from kalos.testing import RunningSidecar

DIM = 256
BUDGET = Budget(k=5, max_tokens=200, memory_tokens=60)  # small: memories and turns get cut


def bag_of_words_for_tests(texts: Sequence[str]) -> np.ndarray:
    """The tests' stand-in for the embedding model: lower-cased words hashed (crc32) into
    DIM buckets, counted, normalized to unit length."""
    out = np.zeros((len(texts), DIM), np.float32)
    for row, text in enumerate(texts):
        for word in re.findall(r"\w+", text.lower()):
            out[row, zlib.crc32(word.encode()) % DIM] += 1.0
    norms = np.linalg.norm(out, axis=1, keepdims=True)
    return out / np.where(norms == 0, 1.0, norms)


# -- the corpus ---------------------------------------------------------------------------------


def test_the_corpus_is_real_text_of_several_people() -> None:
    memories, conversations = load_corpus()
    assert len(memories) >= 300
    assert [m.id for m in memories] == list(range(1, len(memories) + 1))
    people = {m.scope for m in memories}
    assert len(people) >= 6 and len({s.tenant for s in people}) >= 3
    for scope in people:
        texts = [m.text for m in memories if m.scope == scope]
        assert len(texts) >= 25 and len(set(texts)) == len(texts)  # no duplicates per person
    assert all(len(m.text.split()) >= 3 for m in memories)
    assert len(conversations) >= 2 and len({c.scope for c in conversations}) >= 2
    assert 6 <= max(len(c.turns) for c in conversations) <= 10
    for conv in conversations:
        assert conv.scope in people and conv.system
        assert all(user and reply for user, reply in conv.turns)


def test_the_parsers_name_the_bad_line() -> None:
    with pytest.raises(ConfigError, match=r"m:2: a memory before"):
        parse_memories("# comment\nan orphan memory\n", "m")
    with pytest.raises(ConfigError, match=r"m:1: a memory section is \[tenant/user\]"):
        parse_memories("[a/b session]\nx\n", "m")
    assert parse_memories("[acme/ann]\n\n  one  \n# no\ntwo\n[acme/bo]\nthree") == [
        Memory(1, Scope("acme", "ann"), "one"),
        Memory(2, Scope("acme", "ann"), "two"),
        Memory(3, Scope("acme", "bo"), "three"),
    ]
    good = "[acme/ann s1]\nsystem: be brief\nuser: hi\nassistant: hello\n"
    assert parse_conversations(good) == [
        Conversation(Scope("acme", "ann"), "s1", "be brief", (("hi", "hello"),))
    ]
    with pytest.raises(ConfigError, match=r"c:3: 'assistant' out of order"):
        parse_conversations("[acme/ann s1]\nsystem: x\nassistant: early\n", "c")
    with pytest.raises(ConfigError, match=r"c:1: a conversation needs"):
        parse_conversations("[acme/ann s1]\nsystem: x\nuser: no reply\n", "c")
    with pytest.raises(ConfigError, match=r"c:1: expected 'system:'"):
        parse_conversations("user: outside\n", "c")


# -- the conversations through a real sidecar -----------------------------------------------------


@pytest.fixture(scope="module")
def corpus() -> tuple[list[Memory], list[Conversation]]:
    return load_corpus()


@pytest.fixture(scope="module")
def tokenizer_file(
    tmp_path_factory: pytest.TempPathFactory, corpus: tuple[list[Memory], list[Conversation]]
) -> str:
    """A word-level tokenizer.json over the corpus's vocabulary (the model's is not here)."""
    tokenizers = pytest.importorskip("tokenizers")
    memories, conversations = corpus
    texts = [m.text for m in memories]
    texts += [c.system for c in conversations] + [
        t for c in conversations for p in c.turns for t in p
    ]
    pre = tokenizers.pre_tokenizers.Whitespace()
    words = sorted({w for text in texts for w, _ in pre.pre_tokenize_str(text)})
    vocab = {w: i for i, w in enumerate(["[UNK]", *words])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre
    path = str(tmp_path_factory.mktemp("demo-tok") / "tokenizer.json")
    tok.save(path)
    return path


@contextlib.contextmanager
def redis_pipeline(tokenizer_file: str) -> Iterator[RedisPipeline]:
    pytest.importorskip("redis")
    pytest.importorskip("faiss")
    pytest.importorskip("torch")
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    from kalos.bench.context import redis_server
    from kalos.stores.sessions import load_tokenizer

    with redis_server(binary) as (r, _version):
        yield RedisPipeline(r, load_tokenizer(tokenizer_file), DIM, BUDGET)


def expected_token_ids(
    tokenize: Callable[[str], np.ndarray],
    conv: Conversation,
    turn: int,
    memory_texts: Sequence[str],
) -> tuple[list[int], list[int]]:
    """(the model input, each memory's tokens in it) as the demo's recall must lay them out
    after user turn ``turn`` (1-based): the system prompt, the memories whole in rank order
    within BUDGET.memory_tokens, then the newest turns that fit."""
    budget = BUDGET.max_tokens
    system = tokenize(conv.system).tolist()
    out = list(system)
    budget -= len(system)
    share = min(budget, BUDGET.memory_tokens or budget)
    counts = []
    for text in memory_texts:
        ids = tokenize(text).tolist()
        counts.append(len(ids) if len(ids) <= share else 0)
        if len(ids) <= share:
            share -= len(ids)
            budget -= len(ids)
            out += ids
    said = [t for user, reply in conv.turns[: turn - 1] for t in (user, reply)]
    said.append(conv.turns[turn - 1][0])
    window: list[int] = []
    for text in reversed(said):
        ids = tokenize(text).tolist()
        if len(ids) > budget:
            break
        budget -= len(ids)
        window = ids + window
    return out + window, counts


@pytest.mark.parametrize("with_redis", [False, True], ids=["kalos", "kalos+redis"])
def test_the_conversations_recall_their_own_memories(
    sidecar: Callable[..., RunningSidecar],
    tokenizer_file: str,
    corpus: tuple[list[Memory], list[Conversation]],
    with_redis: bool,
) -> None:
    from kalos.stores.sessions import load_tokenizer

    memories, conversations = corpus
    vectors = bag_of_words_for_tests([m.text for m in memories])
    running = sidecar(dim=DIM, metric="cosine", extra_args=("--tokenizer", tokenizer_file))
    client = running.connect(timeout=TIMEOUT)
    KalosMemory(client, BUDGET).load(memories, vectors)
    lines: list[str] = []
    with contextlib.ExitStack() as stack:
        pipeline = stack.enter_context(redis_pipeline(tokenizer_file)) if with_redis else None
        if pipeline is not None:
            pipeline.load(memories, vectors)
        run = run_conversations(
            client, bag_of_words_for_tests, memories, conversations, BUDGET,
            pipeline=pipeline, repeat=3, block=2, out=lines.append,
        )  # fmt: skip
        print_summary(lines.append, run, None)

    assert run.out_of_scope == 0 and run.disagreements == 0
    assert len(run.turns) == sum(len(c.turns) for c in conversations)
    tokenize = load_tokenizer(tokenizer_file)
    text_of = {m.id: m.text for m in memories}
    for r in run.turns:
        conv = r.conversation
        mine = [i for i, m in enumerate(memories) if m.scope == conv.scope]
        # Exact top-k over this person's memories only, computed here.
        scores = vectors[mine] @ bag_of_words_for_tests([r.user])[0]
        best = np.sort(scores)[::-1][: BUDGET.k]
        np.testing.assert_allclose(r.scores, best, atol=1e-5)
        for i, s in zip(r.ids, r.scores, strict=True):
            assert memories[int(i) - 1].scope == conv.scope
            assert float(vectors[int(i) - 1] @ bag_of_words_for_tests([r.user])[0]) == (
                pytest.approx(float(s), abs=1e-5)
            )
        assert r.texts == [text_of[int(i)] for i in r.ids]
        want, counts = expected_token_ids(tokenize, conv, r.turn, r.texts)
        assert r.token_ids.tolist() == want
        assert r.memory_tokens.tolist() == counts
        assert len(want) <= BUDGET.max_tokens and sum(counts) <= (BUDGET.memory_tokens or 0)
        assert len(r.kalos_ns) == 4 and (r.kalos_ns > 0).all() and r.embed_ns > 0
        assert (r.redis_ns is not None) == with_redis
        assert r.redis_answer in (("same", "tie") if with_redis else (None,))
        assert all(s != conv.scope and s.tenant == conv.scope.tenant for s in r.others)
    # The filter had something to keep out: tenant-wide, other people's memories ranked high.
    assert sum(len(r.others) for r in run.turns) > 0
    # Later turns no longer fit whole: the window drops the oldest turns.
    longest = max(conversations, key=lambda c: len(c.turns))
    last = [r for r in run.turns if r.conversation is longest][-1]
    assert last.context.turns < 2 * len(longest.turns) - 1
    printed = "\n".join(lines)
    for conv in conversations:
        for user, reply in conv.turns:
            assert f"user: {user}" in printed and f"assistant (canned): {reply}" in printed
    assert "checks: 0 recalled memories outside their person's scope" in printed
    assert ("Redis pipeline / kalos" in printed) == with_redis
    client.close()


def test_without_redis_server_the_comparison_is_skipped_with_the_reason(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    import argparse

    from kalos.demo import _pipeline_unavailable, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert _pipeline_unavailable(parser.parse_args(["--no-redis"])) == (None, "--no-redis")
    monkeypatch.setenv("PATH", str(tmp_path))  # no redis-server on it
    found, why = _pipeline_unavailable(parser.parse_args([]))
    assert found is None and why is not None and "redis-server is not installed" in why
    not_a_program = tmp_path / "redis-server"
    not_a_program.write_text("")
    not_a_program.chmod(0o644)
    found, why = _pipeline_unavailable(parser.parse_args(["--redis-server", str(not_a_program)]))
    assert found is None and why is not None and "not an executable file" in why
