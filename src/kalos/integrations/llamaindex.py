"""LlamaIndex over Kalos (extra ``kalos[llamaindex]``): :class:`KalosVectorStore`, a
``BasePydanticVectorStore`` whose nodes are Kalos memories.

A node is stored under its node id (a Kalos string id) with its text as the payload and, as
metadata, the node's own metadata plus LlamaIndex's bookkeeping fields
(``node_to_metadata_dict``: ``_node_content``, ``_node_type``, ``ref_doc_id``, ...), so a
query returns whole nodes. ``MetadataFilters`` become Kalos filters (docs/FILTERS.md),
evaluated inside the sidecar, with LlamaIndex's own meaning where it differs from Kalos's:
``!=`` and ``nin`` also match nodes without the key (as ``SimpleVectorStore`` does).
``any``/``all`` are ``contains`` ORed/ANDed, ``text_match`` is ``contains`` on a str;
``text_match_insensitive`` and ``is_empty`` have no Kalos form (ValueError).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llama_index.core.bridge.pydantic import PrivateAttr
from llama_index.core.schema import BaseNode, MetadataMode
from llama_index.core.vector_stores.types import (
    BasePydanticVectorStore,
    FilterCondition,
    FilterOperator,
    MetadataFilter,
    MetadataFilters,
    VectorStoreQuery,
    VectorStoreQueryResult,
)
from llama_index.core.vector_stores.utils import metadata_dict_to_node, node_to_metadata_dict

from kalos.client import Client
from kalos.types import Scope

NODE_ID_KEY = "_node_id"  # each node's id again in its metadata: queries by node_ids filter on it

_SAME = {
    FilterOperator.EQ: "eq",
    FilterOperator.GT: "gt",
    FilterOperator.GTE: "gte",
    FilterOperator.LT: "lt",
    FilterOperator.LTE: "lte",
    FilterOperator.IN: "in",
    FilterOperator.CONTAINS: "contains",
    FilterOperator.TEXT_MATCH: "contains",
}


def to_kalos_filter(filters: MetadataFilters | MetadataFilter) -> dict[str, Any]:
    """A LlamaIndex filter (nested ``MetadataFilters`` too) as a Kalos filter dict."""
    if isinstance(filters, MetadataFilters):
        parts = [to_kalos_filter(f) for f in filters.filters]
        if not parts:
            return {}
        condition = filters.condition or FilterCondition.AND
        if condition == FilterCondition.OR:
            return {"$or": parts}
        both = parts[0] if len(parts) == 1 else {"$and": parts}
        return {"$not": both} if condition == FilterCondition.NOT else both
    key, op, value = filters.key, filters.operator, filters.value
    if op in _SAME:
        return {key: {_SAME[op]: value}}
    if op == FilterOperator.NE:
        return {"$not": {key: {"eq": value}}}
    if op == FilterOperator.NIN:
        return {"$not": {key: {"in": value}}}
    if op in (FilterOperator.ANY, FilterOperator.ALL):
        values = value if isinstance(value, list) else [value]
        parts = [{key: {"contains": v}} for v in values]
        return {"$or" if op == FilterOperator.ANY else "$and": parts}
    raise ValueError(f"the Kalos vector store has no filter operator {op.value!r}")


class KalosVectorStore(BasePydanticVectorStore):
    """LlamaIndex nodes as Kalos memories, over a connected :class:`kalos.Client`.

    ``scope``: the namespace of every node (None: the sidecar's whole store). Similarities
    are the sidecar's scores (cosine similarity on a ``--metric cosine`` sidecar).
    """

    stores_text: bool = True
    flat_metadata: bool = False

    _client: Client = PrivateAttr()
    _scope: Scope | None = PrivateAttr(default=None)

    def __init__(self, client: Client, *, scope: Scope | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._client = client
        self._scope = scope

    @classmethod
    def class_name(cls) -> str:
        return "KalosVectorStore"

    @property
    def client(self) -> Client:
        return self._client

    def add(self, nodes: Any, **add_kwargs: Any) -> list[str]:
        nodes = list(nodes)
        if not nodes:
            return []
        ids = [n.node_id for n in nodes]
        metadata = []
        for node in nodes:
            meta = node_to_metadata_dict(node, remove_text=True, flat_metadata=False)
            meta[NODE_ID_KEY] = node.node_id
            metadata.append(meta)
        texts = [n.get_content(metadata_mode=MetadataMode.NONE) for n in nodes]
        vectors = np.asarray([n.get_embedding() for n in nodes], np.float32)
        self._client.add(vectors, ids, texts, metadata=metadata, scope=self._scope)
        return ids

    def delete(self, ref_doc_id: str, **delete_kwargs: Any) -> None:
        self._client.forget(self._scope or Scope(), where={"ref_doc_id": ref_doc_id})

    def delete_nodes(
        self,
        node_ids: list[str] | None = None,
        filters: MetadataFilters | None = None,
        **delete_kwargs: Any,
    ) -> None:
        where = self._where(node_ids, filters)
        if where is not None:  # neither: nothing to delete
            self._client.forget(self._scope or Scope(), where=where)

    def clear(self) -> None:
        self._client.forget(self._scope or Scope(), where={})

    def get_nodes(
        self, node_ids: list[str] | None = None, filters: MetadataFilters | None = None
    ) -> list[BaseNode]:
        if node_ids is None:
            raise ValueError("the Kalos vector store gets nodes by node_ids")
        found = self._client.lookup(list(node_ids), scope=self._scope)
        nodes = [self._node(m.metadata or {}, m.payload) for m in found]
        if filters is None:
            return nodes
        from kalos.filters import matches, parse

        node = parse(to_kalos_filter(filters))
        return [n for n, m in zip(nodes, found, strict=True) if matches(node, m.metadata)]

    @staticmethod
    def _where(
        node_ids: list[str] | None, filters: MetadataFilters | None
    ) -> dict[str, Any] | None:
        parts: list[dict[str, Any]] = []
        if node_ids:  # None or empty: no restriction (VectorIndexRetriever passes [])
            parts.append({NODE_ID_KEY: {"in": list(node_ids)}})
        if filters is not None:
            parts.append(to_kalos_filter(filters))
        parts = [p for p in parts if p]
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else {"$and": parts}

    @staticmethod
    def _node(meta: dict[str, Any], text: Any) -> BaseNode:
        return metadata_dict_to_node(meta, text=text if isinstance(text, str) else "")

    def query(self, query: VectorStoreQuery, **kwargs: Any) -> VectorStoreQueryResult:
        if query.query_embedding is None:
            raise ValueError("the Kalos vector store answers queries with an embedding")
        where = self._where(query.node_ids, query.filters)
        if query.doc_ids:
            doc = {"ref_doc_id": {"in": list(query.doc_ids)}}
            where = doc if where is None else {"$and": [where, doc]}
        hits = self._client.search(
            np.asarray(query.query_embedding, np.float32), query.similarity_top_k,
            scope=self._scope, where=where, metadata=True, copy=True,
        )  # fmt: skip
        nodes, scores, ids = [], [], []
        payloads = hits.payloads or []
        for i, item in enumerate(hits.ids.tolist()):
            if item == -1:
                continue
            meta = (hits.metadata or [])[i] or {}
            nodes.append(self._node(meta, payloads[i]))
            scores.append(float(hits.scores[i]))
            ids.append((hits.keys or [])[i] or str(item))
        return VectorStoreQueryResult(nodes=nodes, similarities=scores, ids=ids)


__all__ = ["NODE_ID_KEY", "KalosVectorStore", "to_kalos_filter"]
