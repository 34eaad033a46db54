"""A LlamaIndex ``VectorStoreIndex`` over :class:`kalos.integrations.llamaindex.KalosVectorStore`
against a real sidecar, answering filtered queries as llama-index-core's own
``SimpleVectorStore`` does on the same nodes (a deterministic embedding: no download)."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

pytest.importorskip("llama_index.core")

from llama_index.core import StorageContext, VectorStoreIndex
from llama_index.core.embeddings import BaseEmbedding
from llama_index.core.schema import TextNode
from llama_index.core.vector_stores import SimpleVectorStore
from llama_index.core.vector_stores.types import (
    FilterCondition,
    FilterOperator,
    MetadataFilter,
    MetadataFilters,
)

import kalos
from conftest import TIMEOUT
from kalos import Scope
from kalos.integrations.llamaindex import KalosVectorStore, to_kalos_filter
from kalos.testing import isolated_sidecar

DIM = 16


class HashEmbedding(BaseEmbedding):
    """A deterministic embedding: a vector seeded by the text's hash, shared by both sides."""

    def _vector(self, text: str) -> list[float]:
        seed = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
        return np.random.default_rng(seed).standard_normal(DIM).tolist()

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._vector(text)

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._vector(query)

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._vector(query)


TOPICS = ["cats", "dogs", "birds"]


def nodes() -> list[TextNode]:
    return [
        TextNode(
            id_=f"node-{i}",
            text=f"note {i} about {TOPICS[i % 3]}",
            metadata={"topic": TOPICS[i % 3], "year": 2000 + i, "tags": ["a", "b"][: i % 3]},
        )
        for i in range(24)
    ]


F = MetadataFilter
FILTERS = [
    None,
    MetadataFilters(filters=[F(key="topic", value="cats")]),
    MetadataFilters(filters=[F(key="year", value=2010, operator=FilterOperator.GTE)]),
    MetadataFilters(
        filters=[
            F(key="topic", value="dogs"),
            F(key="year", value=2005, operator=FilterOperator.LT),
        ],
        condition=FilterCondition.OR,
    ),
    MetadataFilters(filters=[F(key="topic", value=["cats", "birds"], operator=FilterOperator.NIN)]),
    MetadataFilters(filters=[F(key="topic", value="cats", operator=FilterOperator.NE)]),
    MetadataFilters(filters=[F(key="tags", value="b", operator=FilterOperator.CONTAINS)]),
    MetadataFilters(filters=[F(key="year", value=[2001, 2004, 2023], operator=FilterOperator.IN)]),
]


@pytest.fixture(scope="module")
def client() -> Iterator[kalos.Client]:
    with isolated_sidecar(dim=DIM, metric="cosine", name="llamaindex") as running:
        c = running.connect(timeout=TIMEOUT)
        yield c
        c.close()


def test_filtered_queries_answer_as_simple_vector_store_does(client: kalos.Client) -> None:
    scope = Scope(f"t-{uuid.uuid4().hex[:12]}")
    embed = HashEmbedding(model_name="hash")
    kalos_index = VectorStoreIndex(
        nodes(),
        storage_context=StorageContext.from_defaults(
            vector_store=KalosVectorStore(client, scope=scope)
        ),
        embed_model=embed,
    )
    simple_index = VectorStoreIndex(
        nodes(),
        storage_context=StorageContext.from_defaults(vector_store=SimpleVectorStore()),
        embed_model=embed,
    )
    for filters in FILTERS:
        for query in ("cats and years", "note 7 about birds"):
            got = kalos_index.as_retriever(similarity_top_k=5, filters=filters).retrieve(query)
            want = simple_index.as_retriever(similarity_top_k=5, filters=filters).retrieve(query)
            assert [n.node.node_id for n in got] == [n.node.node_id for n in want], filters
            assert [n.score for n in got] == pytest.approx([n.score for n in want], abs=1e-5)
            assert [n.node.get_content() for n in got] == [n.node.get_content() for n in want]
            assert [n.node.metadata for n in got] == [n.node.metadata for n in want]


def test_nodes_are_deleted_by_document_and_by_id(client: kalos.Client) -> None:
    scope = Scope(f"t-{uuid.uuid4().hex[:12]}")
    store = KalosVectorStore(client, scope=scope)
    embed = HashEmbedding(model_name="hash")
    batch = nodes()[:6]
    for i, node in enumerate(batch):
        node.relationships = {}
        node.embedding = embed.get_text_embedding(node.text)
        node.metadata["doc"] = f"d{i % 2}"
    store.add(batch)
    assert [n.node_id for n in store.get_nodes(["node-1", "node-0"])] == ["node-1", "node-0"]
    store.delete_nodes(["node-0"])
    assert store.get_nodes(["node-0"]) == []
    store.delete_nodes(filters=MetadataFilters(filters=[F(key="doc", value="d1")]))
    assert [n.node_id for n in store.get_nodes([f"node-{i}" for i in range(6)])] == [
        "node-2",
        "node-4",
    ]
    store.clear()
    assert store.get_nodes(["node-2"]) == []


def test_unsupported_operators_say_so() -> None:
    with pytest.raises(ValueError, match="is_empty"):
        to_kalos_filter(MetadataFilter(key="a", value=None, operator=FilterOperator.IS_EMPTY))
