"""A memory's token ids survive a restart: replayed from the write-ahead log after SIGKILL
(given ids travel in the logged request, text payloads are tokenized again on replay), and
restored from the snapshot a clean stop writes."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from conftest import DIM, TIMEOUT
from kalos.testing import RunningSidecar

Start = Callable[..., RunningSidecar]


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


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_memory_token_ids_survive_a_restart(
    sidecar: Start, tmp_path: Path, tokenizer_file: str, sig: int
) -> None:
    args = ("--data-dir", str(tmp_path / "data"), "--tokenizer", tokenizer_file)
    q = np.eye(DIM, dtype=np.float32)[0]
    v = np.zeros((4, DIM), np.float32)
    v[:, 0] = [4, 3, 2, 1]

    sc = sidecar(name="recall-durable", extra_args=args)
    client = sc.connect(timeout=TIMEOUT)
    client.add(v[:2], [1, 2], ["paris is in france", "hello"], tokens=[None, [42, 43]])
    client.add(v[2:], [3, 4], ["world", b"raw"])
    client.add(v[1], 2, "hello world")  # an upsert: tokenized now, the given ids are gone
    client.remove(3)
    client.append_turn("s", "user", "hello", [7])
    before = client.recall("s", q, k=4, max_tokens=100, copy=True)
    assert before.token_ids.tolist() == [3, 4, 5, 6, 1, 2, 7]
    assert before.ids.tolist() == [1, 2, 4, -1]
    client.close()
    sc.stop(sig, timeout=TIMEOUT)

    sc = sidecar(name="recall-durable", extra_args=args)
    with sc.connect(timeout=TIMEOUT) as client:
        after = client.recall("s", q, k=4, max_tokens=100)
        assert after.token_ids.tolist() == before.token_ids.tolist()
        assert after.ids.tolist() == before.ids.tolist()
        assert after.texts == before.texts == ["paris is in france", "hello world", b"raw"]
        assert after.memory_tokens.tolist() == [4, 2, 0, 0]
        recovery = client.stats()["durability"]["recovery"]  # the views above end here
    if sig == signal.SIGTERM:
        assert recovery["records_replayed"] == 0  # all from the snapshot
    else:
        assert recovery["records_replayed"] == 5 and recovery["replay_errors"] == 0
