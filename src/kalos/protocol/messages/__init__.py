"""Request and response bodies: how each op's arguments lie in a channel arena.

Both sides use these functions: the client encodes requests and decodes responses, the sidecar
decodes requests and encodes responses. Every function works on a ``uint8`` numpy array over
an arena (or a socket buffer) so that vectors and results are written and read in place:
decoders return numpy *views* into that memory, valid until the buffer is reused.

Every section of a body starts 8-byte aligned. Layouts (little-endian):

- scope block: ``u32 tenant_len, u32 user_len, u32 session_len, u32 0``, then the UTF-8
  bytes, padded to 8.
- ADD: ``u32 n, u32 dim, u32 dtype, u32 0``, scope block, ``ids i64[n]``,
  ``vectors dtype[n*dim]``, ``kinds u8[n]``, ``offsets u64[n+1]``, then with flag
  ``ADD_HAS_TOKENS`` ``has_tokens u8[n]``, ``token_offsets u64[n+1]``,
  ``tokens i32[token_offsets[n]]`` (each padded to 8), then ``blob``.
- REMOVE: ``u32 n, u32 0``, ``ids i64[n]``.  Response: ``u64 removed``.
- SEARCH: ``u32 nq, u32 k, u32 dim, u32 dtype``, scope block, ``queries dtype[nq*dim]``.
  Response: ``u32 nq, u32 k, u32 has_payloads, u32 0``, ``scores f32[nq*k]``,
  ``ids i64[nq*k]``, and with payloads ``kinds u8[nq*k]``, ``offsets u64[nq*k+1]``, ``blob``.
- ADD response: ``u64 added, u64 replaced``.
- STATS response, and the message of an error response: UTF-8 text (JSON for STATS).
- Sessions, agent state, event logs and FORGET (ops 6-17): the last section of this module;
  RECALL (op 18) after them.

The bodies live in one module per domain: :mod:`~kalos.protocol.messages.common` (the scope
block, counts, text), :mod:`~kalos.protocol.messages.memories` (SEARCH, ADD, REMOVE),
:mod:`~kalos.protocol.messages.sessions`, :mod:`~kalos.protocol.messages.state` (agent state and
event logs) and :mod:`~kalos.protocol.messages.recall`. This package re-exports every public
name, so ``from kalos.protocol.messages import ...`` and ``messages.encode_search`` keep working.
"""

from __future__ import annotations

from kalos.protocol.messages.common import (
    EMPTY_SCOPE,
    NO_LIMIT,
    NO_SCOPE,
    ScopeBytes,
    decode_counts,
    decode_text,
    encode_counts,
    encode_scope_fields,
    encode_text,
    json_section_size,
    owner_of,
    read_json_section,
    read_scope,
    session_of,
    vector_dtype,
    wire_dtype,
    write_json_section,
    write_scope,
)
from kalos.protocol.messages.memories import (
    AddRequest,
    SearchRequest,
    SearchResponse,
    add_item_sizes,
    add_meta_json,
    decode_add,
    decode_filter_at,
    decode_lookup,
    decode_remove,
    decode_search,
    decode_search_response,
    encode_add,
    encode_filter_tail,
    encode_lookup,
    encode_remove,
    encode_search,
    encode_search_device_response,
    encode_search_header,
    encode_search_response,
    search_request_size,
    search_response_size,
    search_response_views,
)
from kalos.protocol.messages.recall import (
    RECALL_PARTS_AT,
    RecallRequest,
    RecallResponse,
    decode_recall,
    decode_recall_response,
    encode_recall,
    encode_recall_response,
    recall_request_size,
    recall_response_size,
    set_recall_parts,
)
from kalos.protocol.messages.sessions import (
    AppendTurnRequest,
    ContextRequest,
    ContextResponse,
    SessionInfo,
    decode_append_turn,
    decode_context,
    decode_context_response,
    decode_forgotten,
    decode_scoped,
    decode_sessions,
    encode_append_turn,
    encode_context,
    encode_context_response,
    encode_context_tokens_response,
    encode_forgotten,
    encode_scoped,
    split_turns,
    turn_token_counts,
)
from kalos.protocol.messages.state import (
    Event,
    LogEventRequest,
    StateValue,
    StateValueRequest,
    decode_events_request,
    decode_events_response,
    decode_log_event,
    decode_state_get_response,
    decode_state_key,
    decode_state_value,
    encode_events_request,
    encode_events_response,
    encode_log_event,
    encode_state_get_response,
    encode_state_key,
    encode_state_value,
)
from kalos.types import Scope

__all__ = [
    "EMPTY_SCOPE",
    "NO_LIMIT",
    "NO_SCOPE",
    "RECALL_PARTS_AT",
    "AddRequest",
    "AppendTurnRequest",
    "ContextRequest",
    "ContextResponse",
    "Event",
    "LogEventRequest",
    "RecallRequest",
    "RecallResponse",
    "Scope",
    "ScopeBytes",
    "SearchRequest",
    "SearchResponse",
    "SessionInfo",
    "StateValue",
    "StateValueRequest",
    "add_item_sizes",
    "add_meta_json",
    "decode_add",
    "decode_append_turn",
    "decode_context",
    "decode_context_response",
    "decode_counts",
    "decode_events_request",
    "decode_events_response",
    "decode_filter_at",
    "decode_forgotten",
    "decode_log_event",
    "decode_lookup",
    "decode_recall",
    "decode_recall_response",
    "decode_remove",
    "decode_scoped",
    "decode_search",
    "decode_search_response",
    "decode_sessions",
    "decode_state_get_response",
    "decode_state_key",
    "decode_state_value",
    "decode_text",
    "encode_add",
    "encode_append_turn",
    "encode_context",
    "encode_context_response",
    "encode_context_tokens_response",
    "encode_counts",
    "encode_events_request",
    "encode_events_response",
    "encode_filter_tail",
    "encode_forgotten",
    "encode_log_event",
    "encode_lookup",
    "encode_recall",
    "encode_recall_response",
    "encode_remove",
    "encode_scope_fields",
    "encode_scoped",
    "encode_search",
    "encode_search_device_response",
    "encode_search_header",
    "encode_search_response",
    "encode_state_get_response",
    "encode_state_key",
    "encode_state_value",
    "encode_text",
    "json_section_size",
    "owner_of",
    "read_json_section",
    "read_scope",
    "recall_request_size",
    "recall_response_size",
    "search_request_size",
    "search_response_size",
    "search_response_views",
    "session_of",
    "set_recall_parts",
    "split_turns",
    "turn_token_counts",
    "vector_dtype",
    "wire_dtype",
    "write_json_section",
    "write_scope",
]
