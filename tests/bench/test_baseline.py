"""The traditional-stack baseline: its assembly rule is kalos's, token for token."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kalos.bench.baseline import assemble, newest_that_fit


def test_assemble_budget_rule():
    system, m1, m2, m3 = [9, 9], [1] * 5, [2] * 8, [3] * 2
    turns = [[7] * 4, [8] * 3, [6] * 2]
    every_turn = [t for turn in turns for t in turn]
    # Everything fits: system, memories best first, turns oldest first.
    assert assemble(system, [m1, m2, m3], turns, 100) == system + m1 + m2 + m3 + every_turn
    # A memory that does not fit is dropped; a later, shorter one still goes in.
    assert assemble(system, [m1, m2, m3], [], 10) == system + m1 + m3
    # The turns get what is left: the newest that fit, a contiguous suffix.
    assert assemble(None, [m1], turns, 10) == m1 + turns[1] + turns[2]  # 5 + 3 + 2
    assert assemble(None, [m1], turns, 9) == m1 + turns[2]  # 3 more do not fit in 2
    assert assemble(None, [], turns, 4) == turns[2]
    assert assemble(None, [], turns, 8) == turns[1] + turns[2]  # the 4-token turn ends it
    assert assemble(None, [], turns, 100, max_turns=1) == turns[2]
    # A system prompt that does not fit is left out; memory_tokens caps the memories.
    assert assemble([5] * 20, [m3], [], 10) == m3
    assert assemble(None, [m1, m2, m3], turns, 100, memory_tokens=7) == m1 + m3 + every_turn
    assert assemble(system, [m1], turns, 0) == []


def test_newest_that_fit_is_a_contiguous_suffix():
    turns = [{"role": "u", "text": str(i), "tokens": [i] * n} for i, n in enumerate([3, 1, 5, 2])]
    tokens, window = newest_that_fit(turns, 7)
    assert tokens.dtype == np.int32 and tokens.tolist() == [2] * 5 + [3] * 2
    assert window == [("u", "2"), ("u", "3")]
    assert newest_that_fit(turns, 1)[1] == []  # the newest does not fit: nothing


def test_assemble_matches_kalos_recall(inproc_client):
    """The baseline's rule against the sidecar's on the same hits: token for token."""
    rng = np.random.default_rng(3)
    client = inproc_client(dim=8)
    n = 60
    vectors = rng.standard_normal((n, 8)).astype(np.float32)
    tokens = [rng.integers(0, 1000, rng.integers(1, 40)).astype(np.int32) for _ in range(n)]
    ids = np.arange(n) * 5 + 1
    client.add(vectors, ids, [f"m{i}" for i in ids], tokens=tokens)
    by_id = dict(zip(ids.tolist(), tokens, strict=True))
    system = rng.integers(0, 1000, 12).astype(np.int32)
    client.append_turn("s", "system", "be brief", system, pin=True)
    turns = [rng.integers(0, 1000, rng.integers(1, 60)).astype(np.int32) for _ in range(25)]
    for k, t in enumerate(turns):
        client.append_turn("s", "user" if k % 2 else "assistant", f"turn {k}", t)
    checked = 0
    for budget, max_turns, cap in itertools.product(
        (0, 5, 11, 12, 40, 90, 200, 600, 5000), (None, 0, 3), (None, 0, 25)
    ):
        q = rng.standard_normal(8).astype(np.float32)
        r = client.recall("s", q, k=5, max_tokens=budget, max_turns=max_turns, memory_tokens=cap)
        hits = [by_id[int(i)] for i in r.ids if i >= 0]
        want = assemble(system, hits, turns, budget, max_turns, cap)
        assert r.token_ids.tolist() == want, (budget, max_turns, cap)
        assert r.texts == [f"m{int(i)}" for i in r.ids if i >= 0]
        checked += len(want)
    assert checked > 5000


@pytest.mark.parametrize("budget", [0, 50, 4096])
def test_assemble_without_a_system_prompt_is_memories_then_context(budget):
    turns = [[i] * (10 + i % 7) for i in range(40)]
    memories = [[100 + j] * (30 + j) for j in range(5)]
    out = assemble(None, memories, turns, budget)
    assert len(out) <= budget
    used = sum(len(m) for m in memories if len(m) <= budget)  # all fit or none at these sizes
    dicts = [{"role": "u", "text": "", "tokens": t} for t in turns]
    assert out[used:] == newest_that_fit(dicts, budget - used)[0].tolist()
