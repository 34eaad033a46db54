"""mem0 over Kalos: a real ``mem0.Memory`` whose vector store is mem0's ``"langchain"``
provider over :class:`kalos.integrations.langchain.KalosVectorStore`, with a deterministic
embedder (LangChain's, through mem0's ``"langchain"`` embedder) and ``infer=False``: no LLM,
no download. It adds, searches with filters, and deletes."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

# mem0 reads these when imported: no telemetry (nothing outside can be reached), its files
# under a temporary directory (set again per test below)
os.environ.setdefault("MEM0_TELEMETRY", "False")
pytest.importorskip("mem0")
pytest.importorskip("langchain_community")

from langchain_core.embeddings import DeterministicFakeEmbedding
from langchain_core.language_models.fake_chat_models import FakeListChatModel

import kalos
from conftest import TIMEOUT
from kalos import Scope
from kalos.integrations.langchain import KalosVectorStore
from kalos.testing import isolated_sidecar

DIM = 32


@pytest.fixture
def memory(tmp_path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[object, kalos.Client]]:
    monkeypatch.setenv("MEM0_TELEMETRY", "False")
    monkeypatch.setenv("MEM0_DIR", str(tmp_path / "mem0"))
    import mem0.memory.main as mem0_main
    from mem0 import Memory

    monkeypatch.setattr(mem0_main, "MEM0_TELEMETRY", False)
    embedding = DeterministicFakeEmbedding(size=DIM)
    with isolated_sidecar(dim=DIM, metric="cosine", name="mem0") as running:
        client = running.connect(timeout=TIMEOUT)
        store = KalosVectorStore(client, embedding, scope=Scope(f"t-{uuid.uuid4().hex[:8]}"))
        config = {
            "vector_store": {"provider": "langchain", "config": {"client": store}},
            "embedder": {"provider": "langchain", "config": {"model": embedding}},
            # never called with infer=False; mem0 builds one at start
            "llm": {
                "provider": "langchain",
                "config": {"model": FakeListChatModel(responses=["{}"])},
            },
            "history_db_path": os.path.join(str(tmp_path), "history.db"),
        }
        yield Memory.from_config(config), client
        client.close()


def test_mem0_adds_searches_with_filters_and_deletes(memory: tuple[object, kalos.Client]) -> None:
    m, client = memory
    facts = [
        ("ann", "Ann likes green tea", {"kind": "preference", "year": 2021}),
        ("ann", "Ann lives in Lyon", {"kind": "fact", "year": 2019}),
        ("bob", "Bob likes black coffee", {"kind": "preference", "year": 2023}),
    ]
    ids = {}
    for user, text, meta in facts:
        added = m.add(text, user_id=user, metadata=meta, infer=False)  # type: ignore[attr-defined]
        (result,) = added["results"]
        ids[text] = result["id"]
    # each memory is a Kalos memory with mem0's payload as metadata
    stored = client.lookup(list(ids.values()))
    assert {s.key for s in stored} == set(ids.values())
    assert all(s.metadata and s.metadata["data"] in ids for s in stored)

    def search(query: str, filters: dict) -> list[str]:  # threshold 0: no score is too low
        found = m.search(query, filters=filters, top_k=5, threshold=0.0)  # type: ignore[attr-defined]
        return [r["memory"] for r in found["results"]]

    assert set(search("tea", {"user_id": "ann"})) == {"Ann likes green tea", "Ann lives in Lyon"}
    assert search("Ann likes green tea", {"user_id": "ann", "kind": "preference"}) == [
        "Ann likes green tea"
    ]
    assert search("drinks", {"user_id": "bob", "year": {"gte": 2022}}) == ["Bob likes black coffee"]
    assert search("x", {"user_id": "ann", "year": {"gt": 2030}}) == []

    m.delete(ids["Ann lives in Lyon"])  # type: ignore[attr-defined]
    assert search("tea", {"user_id": "ann"}) == ["Ann likes green tea"]
    assert client.lookup([ids["Ann lives in Lyon"]]) == []
