"""LangChain over Kalos (extra ``kalos[langchain]``): a vector store, a chat message history
and a key-value store, each over a :class:`kalos.Client` to a running sidecar.

* :class:`KalosVectorStore` — a ``langchain_core`` ``VectorStore``. Documents become
  memories: the text is the payload, ``Document.metadata`` the metadata, ``Document.id``
  (or a new UUID) the string id. ``filter=`` takes a Kalos filter (docs/FILTERS.md):
  ``{"source": "wiki", "year": {"gte": 2020}}``. With ``scope`` every document is stored in,
  searched in and deleted from that scope only. The async methods run on an
  :class:`kalos.AsyncClient` when one is given (else LangChain runs the sync ones in a
  thread).
* :class:`KalosChatMessageHistory` — a ``BaseChatMessageHistory`` over one Kalos session:
  each message is a turn (role: the message type; text: its content).
* :class:`KalosStateStore` — a ``BaseStore[str, bytes]`` over the agent state of one scope.

Passes langchain-tests' ``VectorStoreIntegrationTests`` and ``BaseStore{Sync,Async}Tests``
against a real sidecar (tests/integrations).
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
from langchain_core.chat_history import BaseChatMessageHistory
from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.messages import BaseMessage, messages_from_dict, messages_to_dict
from langchain_core.stores import BaseStore
from langchain_core.vectorstores import VectorStore

from kalos.async_client import AsyncClient
from kalos.client import Client, SearchResult
from kalos.errors import Conflict, NotFound
from kalos.types import Scope

_NO_TURN_LIMIT = 0xFFFFFFFE  # the largest max_tokens a context asks for


def _documents(hits: SearchResult) -> list[tuple[Document, float]]:
    """(Document, score) of each real hit of a single-query search with metadata."""
    out: list[tuple[Document, float]] = []
    keys = hits.keys or []
    meta = hits.metadata or []
    payloads = hits.payloads or []
    for i, item in enumerate(np.asarray(hits.ids).reshape(-1).tolist()):
        if item == -1:
            continue
        text = payloads[i] if i < len(payloads) else None
        doc = Document(
            id=keys[i] if keys[i] is not None else str(item),
            page_content=text if isinstance(text, str) else "",
            metadata=meta[i] or {},
        )
        out.append((doc, float(np.asarray(hits.scores).reshape(-1)[i])))
    return out


class KalosVectorStore(VectorStore):
    """A LangChain vector store whose documents are Kalos memories.

    ``client``: a connected :class:`kalos.Client` (its sidecar's dimension must be the
    embedding's); ``embedding``: the LangChain embedding model; ``scope``: the namespace of
    every document (None: the sidecar's whole store); ``async_client``: an
    :class:`kalos.AsyncClient` to the same sidecar for the ``a*`` methods. Scores are the
    sidecar's: cosine similarity, inner product, or squared L2 distance.
    """

    def __init__(
        self,
        client: Client,
        embedding: Embeddings,
        *,
        scope: Scope | None = None,
        async_client: AsyncClient | None = None,
    ) -> None:
        self.client = client
        self.embedding = embedding
        self.scope = scope
        self.async_client = async_client

    @property
    def embeddings(self) -> Embeddings:
        return self.embedding

    # -- writes ------------------------------------------------------------------------------

    @staticmethod
    def _ids(ids: Sequence[str | None] | None, n: int) -> list[str]:
        if ids is None:
            return [str(uuid.uuid4()) for _ in range(n)]
        if len(ids) != n:
            raise ValueError(f"{len(ids)} ids for {n} texts")
        return [str(uuid.uuid4()) if i is None else str(i) for i in ids]

    @staticmethod
    def _metadatas(metadatas: Sequence[dict[str, Any] | None] | None, n: int) -> list[Any]:
        if metadatas is None:
            return [{}] * n
        if len(metadatas) != n:
            raise ValueError(f"{len(metadatas)} metadatas for {n} texts")
        return [dict(m or {}) for m in metadatas]

    def add_embeddings(
        self,
        embeddings: Sequence[Sequence[float]],
        texts: Sequence[str] | None = None,
        metadatas: Sequence[dict[str, Any] | None] | None = None,
        ids: Sequence[str | None] | None = None,
    ) -> list[str]:
        """Adds precomputed vectors (mem0 calls this); ``texts`` default to
        ``metadata["data"]`` (mem0's field) or ""."""
        n = len(embeddings)
        metas = self._metadatas(metadatas, n)
        if texts is None:
            texts = [str(m.get("data", "")) for m in metas]
        keys = self._ids(ids, n)
        if n:
            self.client.add(
                np.asarray(embeddings, np.float32), keys, list(texts), metadata=metas,
                scope=self.scope,
            )  # fmt: skip
        return keys

    def add_texts(
        self,
        texts: Iterable[str],
        metadatas: list[dict[str, Any]] | None = None,
        *,
        ids: list[str] | None = None,
        **kwargs: Any,
    ) -> list[str]:
        texts = list(texts)
        vectors = self.embedding.embed_documents(texts) if texts else []
        return self.add_embeddings(vectors, texts, metadatas, ids)

    async def aadd_texts(
        self,
        texts: Iterable[str],
        metadatas: list[dict[str, Any]] | None = None,
        *,
        ids: list[str] | None = None,
        **kwargs: Any,
    ) -> list[str]:
        if self.async_client is None:
            return await super().aadd_texts(texts, metadatas, ids=ids, **kwargs)
        texts = list(texts)
        n = len(texts)
        metas = self._metadatas(metadatas, n)
        keys = self._ids(ids, n)
        if n:
            vectors = await self.embedding.aembed_documents(texts)
            await self.async_client.add(
                np.asarray(vectors, np.float32), keys, texts, metadata=metas, scope=self.scope
            )
        return keys

    def delete(self, ids: list[str] | None = None, **kwargs: Any) -> bool | None:
        """Deletes documents by id; ``ids`` None: every document of the scope."""
        if ids is None:
            self.client.forget(self.scope or Scope(), where={})
        elif ids:
            self.client.remove(list(ids))
        return True

    async def adelete(self, ids: list[str] | None = None, **kwargs: Any) -> bool | None:
        if self.async_client is None:
            return await super().adelete(ids, **kwargs)
        if ids is None:
            await self.async_client.forget(self.scope or Scope(), where={})
        elif ids:
            await self.async_client.remove(list(ids))
        return True

    # -- reads -------------------------------------------------------------------------------

    def get_by_ids(self, ids: Sequence[str], /) -> list[Document]:
        return [self._document(m) for m in self.client.lookup(list(ids), scope=self.scope)]

    async def aget_by_ids(self, ids: Sequence[str], /) -> list[Document]:
        if self.async_client is None:
            return await super().aget_by_ids(ids)
        found = await self.async_client.lookup(list(ids), scope=self.scope)
        return [self._document(m) for m in found]

    @staticmethod
    def _document(memory: Any) -> Document:
        text = memory.payload
        return Document(
            id=memory.key if memory.key is not None else str(memory.id),
            page_content=text if isinstance(text, str) else "",
            metadata=memory.metadata or {},
        )

    def similarity_search_with_score_by_vector(
        self, embedding: Sequence[float], k: int = 4, filter: Any = None, **kwargs: Any
    ) -> list[tuple[Document, float]]:
        """(Document, score) of the top ``k`` for a vector, with an optional Kalos filter."""
        q = np.asarray(embedding, np.float32)
        hits = self.client.search(q, k, scope=self.scope, where=filter, metadata=True, copy=True)
        return _documents(hits)

    async def asimilarity_search_with_score_by_vector(
        self, embedding: Sequence[float], k: int = 4, filter: Any = None, **kwargs: Any
    ) -> list[tuple[Document, float]]:
        if self.async_client is None:
            return self.similarity_search_with_score_by_vector(embedding, k, filter)
        q = np.asarray(embedding, np.float32)
        hits = await self.async_client.search(q, k, scope=self.scope, where=filter, metadata=True)
        return _documents(hits)

    def similarity_search_with_score(
        self, query: str, k: int = 4, filter: Any = None, **kwargs: Any
    ) -> list[tuple[Document, float]]:
        vector = self.embedding.embed_query(query)
        return self.similarity_search_with_score_by_vector(vector, k, filter)

    async def asimilarity_search_with_score(
        self, query: str, k: int = 4, filter: Any = None, **kwargs: Any
    ) -> list[tuple[Document, float]]:
        vector = await self.embedding.aembed_query(query)
        return await self.asimilarity_search_with_score_by_vector(vector, k, filter)

    def similarity_search(
        self, query: str, k: int = 4, filter: Any = None, **kwargs: Any
    ) -> list[Document]:
        return [d for d, _ in self.similarity_search_with_score(query, k, filter)]

    async def asimilarity_search(
        self, query: str, k: int = 4, filter: Any = None, **kwargs: Any
    ) -> list[Document]:
        return [d for d, _ in await self.asimilarity_search_with_score(query, k, filter)]

    def similarity_search_by_vector(
        self, embedding: list[float], k: int = 4, filter: Any = None, **kwargs: Any
    ) -> list[Document]:
        return [d for d, _ in self.similarity_search_with_score_by_vector(embedding, k, filter)]

    async def asimilarity_search_by_vector(
        self, embedding: list[float], k: int = 4, filter: Any = None, **kwargs: Any
    ) -> list[Document]:
        hits = await self.asimilarity_search_with_score_by_vector(embedding, k, filter)
        return [d for d, _ in hits]

    def _select_relevance_score_fn(self) -> Callable[[float], float]:
        metric = self.client.info.get("metric")
        if metric == "l2":  # squared distance
            return lambda d: 1.0 - float(np.sqrt(max(d, 0.0))) / np.sqrt(2.0)
        if metric == "cosine":
            return lambda s: (s + 1.0) / 2.0
        return self._max_inner_product_relevance_score_fn

    @classmethod
    def from_texts(
        cls,
        texts: list[str],
        embedding: Embeddings,
        metadatas: list[dict[str, Any]] | None = None,
        *,
        ids: list[str] | None = None,
        client: Client | None = None,
        scope: Scope | None = None,
        **kwargs: Any,
    ) -> KalosVectorStore:
        """A store over ``client`` (required) with ``texts`` added."""
        if client is None:
            raise ValueError("KalosVectorStore.from_texts needs client=kalos.connect(...)")
        store = cls(client, embedding, scope=scope, async_client=kwargs.get("async_client"))
        store.add_texts(texts, metadatas, ids=ids)
        return store


class KalosChatMessageHistory(BaseChatMessageHistory):
    """The messages of one Kalos session, oldest first (each message one turn).

    A turn's role is the message's type (``human``, ``ai``, ``system``, ``tool``) and its
    text the message as ``langchain_core.messages.messages_to_dict`` writes it (JSON), so a
    message comes back whole. ``tokens``: a callable giving a message's token ids, for the
    sidecar's context and recall; without it a turn holds none.
    """

    def __init__(
        self,
        client: Client,
        session: str,
        *,
        scope: Scope | None = None,
        tokens: Callable[[BaseMessage], Sequence[int]] | None = None,
    ) -> None:
        self.client = client
        self.session = session
        self.scope = scope
        self.tokens = tokens

    @property
    def messages(self) -> list[BaseMessage]:  # type: ignore[override]
        try:
            ctx = self.client.context(
                self.session, _NO_TURN_LIMIT, scope=self.scope, turns=True, copy=True
            )
        except NotFound:
            return []
        turns: Sequence[tuple[str, str]] = ctx.turns or []
        return messages_from_dict([json.loads(text) for _, text in turns])

    def add_messages(self, messages: Sequence[BaseMessage]) -> None:
        for message, data in zip(messages, messages_to_dict(messages), strict=True):
            ids = list(self.tokens(message)) if self.tokens is not None else []
            self.client.append_turn(
                self.session, message.type, json.dumps(data), ids, scope=self.scope
            )

    def clear(self) -> None:
        with contextlib.suppress(NotFound):  # never had a message
            self.client.delete_session(self.session, scope=self.scope)


class KalosStateStore(BaseStore[str, bytes]):
    """Agent state of one scope as a LangChain ``BaseStore[str, bytes]``.

    Values are Kalos state values (bytes, versioned). ``yield_keys`` reads a key list kept
    in the state itself, under :attr:`INDEX_KEY` (updated with compare-and-set, so writers
    in several processes keep it whole); user keys may not start with ``"\\x00"``.
    """

    INDEX_KEY = "\x00langchain-keys"

    def __init__(
        self, client: Client, *, scope: Scope | None = None, async_client: AsyncClient | None = None
    ) -> None:
        self.client = client
        self.scope = scope
        self.async_client = async_client

    @staticmethod
    def _check(key: str) -> str:
        if not isinstance(key, str) or key.startswith("\x00"):
            raise ValueError(f"a key must be a str not starting with NUL, got {key!r}")
        return key

    def _index(self) -> tuple[int, list[str]]:
        try:
            got = self.client.get(self.INDEX_KEY, scope=self.scope)
        except NotFound:
            return 0, []
        return got.version, json.loads(got.value)

    def _update_index(self, add: Iterable[str] = (), drop: Iterable[str] = ()) -> None:
        add, drop = set(add), set(drop)
        while True:
            version, keys = self._index()
            new = sorted((set(keys) | add) - drop)
            if new == keys:
                return
            try:
                self.client.cas(self.INDEX_KEY, version, json.dumps(new), scope=self.scope)
                return
            except Conflict:
                continue  # another writer changed it: read it again

    def mget(self, keys: Sequence[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for key in keys:
            try:
                out.append(self.client.get(self._check(key), scope=self.scope).value)
            except NotFound:
                out.append(None)
        return out

    def mset(self, key_value_pairs: Sequence[tuple[str, bytes]]) -> None:
        for key, value in key_value_pairs:
            self.client.put(self._check(key), value, scope=self.scope)
        self._update_index(add=(k for k, _ in key_value_pairs))

    def mdelete(self, keys: Sequence[str]) -> None:
        for key in keys:
            self.client.delete(self._check(key), scope=self.scope)
        self._update_index(drop=keys)

    def yield_keys(self, *, prefix: str | None = None) -> Iterator[str]:
        for key in self._index()[1]:
            if prefix is None or key.startswith(prefix):
                yield key

    async def amget(self, keys: Sequence[str]) -> list[bytes | None]:
        if self.async_client is None:
            return await super().amget(keys)
        out: list[bytes | None] = []
        for key in keys:
            try:
                got = await self.async_client.get(self._check(key), scope=self.scope)
                out.append(got.value)
            except NotFound:
                out.append(None)
        return out

    async def amset(self, key_value_pairs: Sequence[tuple[str, bytes]]) -> None:
        if self.async_client is None:
            return await super().amset(key_value_pairs)
        for key, value in key_value_pairs:
            await self.async_client.put(self._check(key), value, scope=self.scope)
        await self._aupdate_index(add=(k for k, _ in key_value_pairs))

    async def amdelete(self, keys: Sequence[str]) -> None:
        if self.async_client is None:
            return await super().amdelete(keys)
        for key in keys:
            await self.async_client.delete(self._check(key), scope=self.scope)
        await self._aupdate_index(drop=keys)

    async def _aupdate_index(self, add: Iterable[str] = (), drop: Iterable[str] = ()) -> None:
        client = self.async_client
        if client is None:
            return self._update_index(add, drop)
        add, drop = set(add), set(drop)
        while True:
            try:
                got = await client.get(self.INDEX_KEY, scope=self.scope)
                version, keys = got.version, json.loads(got.value)
            except NotFound:
                version, keys = 0, []
            new = sorted((set(keys) | add) - drop)
            if new == keys:
                return
            try:
                await client.cas(self.INDEX_KEY, version, json.dumps(new), scope=self.scope)
                return
            except Conflict:
                continue

    async def ayield_keys(self, *, prefix: str | None = None) -> AsyncIterator[str]:
        if self.async_client is None:
            for key in self.yield_keys(prefix=prefix):
                yield key
            return
        try:
            got = await self.async_client.get(self.INDEX_KEY, scope=self.scope)
            keys = json.loads(got.value)
        except NotFound:
            keys = []
        for key in keys:
            if prefix is None or key.startswith(prefix):
                yield key


__all__ = ["KalosChatMessageHistory", "KalosStateStore", "KalosVectorStore"]
