"""LangChain's own standard suites against a real sidecar: ``VectorStoreIntegrationTests``
(sync and async) over :class:`KalosVectorStore`, ``BaseStoreSyncTests`` and
``BaseStoreAsyncTests`` over :class:`KalosStateStore`; then filters, the chat history and a
retriever.

One sidecar serves the module; each test gets a scope (tenant) of its own, so each store
starts empty, and forgets it afterwards."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("langchain_tests")

from langchain_core.documents import Document
from langchain_core.embeddings import DeterministicFakeEmbedding
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_tests.integration_tests import (
    BaseStoreAsyncTests,
    BaseStoreSyncTests,
    VectorStoreIntegrationTests,
)

import kalos
from conftest import TIMEOUT
from kalos import Scope
from kalos.integrations.langchain import (
    KalosChatMessageHistory,
    KalosStateStore,
    KalosVectorStore,
)
from kalos.testing import RunningSidecar, isolated_sidecar

DIM = 6  # langchain-tests' EMBEDDING_SIZE


@pytest.fixture(scope="module")
def running() -> Iterator[RunningSidecar]:
    with isolated_sidecar(dim=DIM, metric="cosine", name="langchain") as sidecar:
        yield sidecar


@pytest.fixture(scope="module")
def client(running: RunningSidecar) -> Iterator[kalos.Client]:
    c = running.connect(timeout=TIMEOUT)
    yield c
    c.close()


@pytest.fixture
def scope(client: kalos.Client) -> Iterator[Scope]:
    s = Scope(f"t-{uuid.uuid4().hex[:12]}")
    yield s
    client.forget(s)


@pytest.fixture
async def async_client(running: RunningSidecar) -> AsyncIterator[kalos.AsyncClient]:
    async with kalos.AsyncClient(running.name, runtime_dir=running.runtime_dir) as c:
        yield c


class TestKalosVectorStore(VectorStoreIntegrationTests):
    """The whole suite, sync and async (the async methods on an AsyncClient)."""

    @pytest.fixture
    def vectorstore(
        self, client: kalos.Client, scope: Scope, async_client: kalos.AsyncClient
    ) -> KalosVectorStore:
        return KalosVectorStore(
            client, self.get_embeddings(), scope=scope, async_client=async_client
        )


class TestKalosStateStoreSync(BaseStoreSyncTests[bytes]):
    @pytest.fixture
    def kv_store(self, client: kalos.Client, scope: Scope) -> KalosStateStore:
        return KalosStateStore(client, scope=scope)

    @pytest.fixture
    def three_values(self) -> tuple[bytes, bytes, bytes]:
        return b"foo", b"bar", b"\x00buzz"


class TestKalosStateStoreAsync(BaseStoreAsyncTests[bytes]):
    @pytest.fixture
    async def kv_store(
        self, client: kalos.Client, scope: Scope, async_client: kalos.AsyncClient
    ) -> KalosStateStore:
        return KalosStateStore(client, scope=scope, async_client=async_client)

    @pytest.fixture
    def three_values(self) -> tuple[bytes, bytes, bytes]:
        return b"foo", b"bar", b"\x00buzz"


# -- beyond the standard suites ------------------------------------------------------------


def test_filters_and_scores_and_a_retriever(client: kalos.Client, scope: Scope) -> None:
    store = KalosVectorStore(client, DeterministicFakeEmbedding(size=DIM), scope=scope)
    docs = [
        Document(page_content=f"doc {i}", metadata={"year": 2000 + i, "topic": t})
        for i, t in enumerate(["cats", "dogs", "cats", "birds", "cats"])
    ]
    ids = store.add_documents(docs)
    hits = store.similarity_search_with_score("doc 2", k=5, filter={"topic": "cats"})
    assert hits[0][0].page_content == "doc 2"
    assert {d.page_content for d, _ in hits} == {"doc 0", "doc 2", "doc 4"}
    assert hits[0][1] == pytest.approx(1.0, abs=1e-5)  # cosine similarity with itself
    newer = store.similarity_search("doc 0", k=5, filter={"year": {"gte": 2003}})
    assert {d.page_content for d in newer} == {"doc 3", "doc 4"}
    retriever = store.as_retriever(search_kwargs={"k": 2, "filter": {"topic": {"ne": "cats"}}})
    assert {d.page_content for d in retriever.invoke("doc 1")} == {"doc 1", "doc 3"}
    store.delete([ids[0]])
    assert store.get_by_ids([ids[0], ids[1]])[0].page_content == "doc 1"
    store.delete()  # everything of the scope
    assert store.similarity_search("doc 1", k=3) == []


def test_chat_message_history_over_a_session(client: kalos.Client, scope: Scope) -> None:
    history = KalosChatMessageHistory(client, f"chat-{scope.tenant}", scope=scope)
    assert history.messages == []
    history.add_messages([SystemMessage("be brief"), HumanMessage("hi")])
    history.add_message(AIMessage("hello", id="m1"))
    got = history.messages
    assert [type(m) for m in got] == [SystemMessage, HumanMessage, AIMessage]
    assert [m.content for m in got] == ["be brief", "hi", "hello"]
    assert got[2].id == "m1"
    history.clear()
    assert history.messages == []
