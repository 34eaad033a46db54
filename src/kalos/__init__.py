"""Kalos: a zero-copy memory-recall sidecar for LLM services.

Start a sidecar with ``kalos serve --name NAME --dim D``, then from the inference service::

    import kalos
    client = kalos.connect("NAME")
    client.add(vectors, ids, payloads=texts, scope=kalos.Scope("acme", "user-1"))
    hits = client.search(query, k=10, scope=kalos.Scope("acme"))
    hits.ids, hits.scores, hits.payloads   # numpy views into the channel, then payloads
    r = client.recall("chat-42", query, k=5, max_tokens=4096)   # context + memories
    r.token_ids                            # int32 [system] + [memories] + [turns]

Results are views valid until the same thread's next call; ``copy=True`` gives owned arrays.
"""

__version__ = "0.1.0"

from kalos.async_client import AsyncClient, connect_async
from kalos.client import (
    Client,
    Memory,
    Recall,
    RecallContext,
    RecallParts,
    SearchResult,
    Timings,
    connect,
)
from kalos.errors import (
    ClosedError,
    ConfigError,
    Conflict,
    ConnectError,
    InvalidRequest,
    KalosError,
    NotFound,
    PayloadTooLarge,
    ProtocolMismatch,
    RequestTimeout,
    ServerError,
    SidecarGone,
    StoreError,
    TransportError,
)
from kalos.filters import key_id
from kalos.options import ClientOptions
from kalos.protocol import PROTOCOL_VERSION
from kalos.transport import Tls
from kalos.types import Scope

__all__ = [
    "PROTOCOL_VERSION",
    "AsyncClient",
    "Client",
    "ClientOptions",
    "ClosedError",
    "ConfigError",
    "Conflict",
    "ConnectError",
    "InvalidRequest",
    "KalosError",
    "Memory",
    "NotFound",
    "PayloadTooLarge",
    "ProtocolMismatch",
    "Recall",
    "RecallContext",
    "RecallParts",
    "RequestTimeout",
    "Scope",
    "SearchResult",
    "ServerError",
    "SidecarGone",
    "StoreError",
    "Timings",
    "Tls",
    "TransportError",
    "__version__",
    "connect",
    "connect_async",
    "key_id",
]
