"""Byte layout of the transports: the control segment and a channel (shared memory, defined in
:mod:`kalos.shm.channel` and re-exported here), and the frames of the uds and grpc transports,
which carry the same header fields. The golden test (tests/protocol/test_layout.py) pins every
offset and size; docs/PROTOCOL.md draws them.
"""

from __future__ import annotations

import struct

from kalos.shm.channel import (
    CHAN_ARENA_BYTES,
    CHAN_CLIENT_BELL,
    CHAN_CLIENT_PARKED,
    CHAN_CLIENT_VIEW,
    CHAN_EPOCH,
    CHAN_HEADER,
    CHAN_ID,
    CHAN_LAYOUT_VERSION,
    CHAN_MAGIC,
    CHAN_REQ_ARENA,
    CHAN_RESP_ARENA,
    CHANNEL_HEADER_SIZE,
    CHANNEL_MAGIC,
    CONTROL_MAGIC,
    CONTROL_SIZE,
    CTRL_BELL,
    CTRL_DIM,
    CTRL_EPOCH,
    CTRL_HEADER,
    CTRL_HEARTBEAT_COUNT,
    CTRL_HEARTBEAT_NS,
    CTRL_LAYOUT_VERSION,
    CTRL_MAGIC,
    CTRL_MAX_K,
    CTRL_METRIC,
    CTRL_PROTOCOL_MAJOR,
    CTRL_PROTOCOL_MINOR,
    CTRL_RESERVED0,
    CTRL_SERVER_PARKED,
    CTRL_SERVER_PID,
    CTRL_SPINNING,
    CTRL_START_NS,
    CTRL_STATE,
    DEFAULT_ARENA_BYTES,
    LAYOUT_VERSION,
    LINE,
    MAX_ARENA_BYTES,
    MIN_ARENA_BYTES,
    PAGE,
    REQ_BODY_LEN,
    REQ_DEADLINE_NS,
    REQ_FIELDS,
    REQ_FLAGS,
    REQ_OP,
    REQ_PUBLISH_NS,
    REQ_SEQ,
    RESP_BODY_LEN,
    RESP_COMPUTE_NS,
    RESP_FIELDS,
    RESP_FLAGS,
    RESP_QUEUE_NS,
    RESP_SEQ,
    RESP_STATUS,
    RESP_WRITE_NS,
    STATE_READY,
    STATE_STARTING,
    STATE_STOPPING,
    channel_size,
)

# -- frames of the uds transport: the same header fields, then the body ----------------------
# A request frame is REQ_FRAME (seq + REQ_FIELDS) then body_len bytes; a response frame is
# RESP_FRAME (seq + RESP_FIELDS) then body_len bytes.
REQ_FRAME = struct.Struct("<QIIQQQ")  # 40 bytes
RESP_FRAME = struct.Struct("<QIIQQQQ")  # 48 bytes

# -- messages of the grpc transport (method /kalos.v1.Sidecar/Call, raw bytes, no protobuf) ----
# A request is GRPC_REQ_FRAME then body_len bytes: seq, op, flags, body_len, then the largest
# response body the client accepts (its negotiated arena; the sidecar clamps it to its
# max_arena_bytes). The client's clock means nothing off-host, so there is no publish or
# deadline field: the deadline travels as the grpc call's own. A response is RESP_FRAME then
# body_len bytes, as over uds.
GRPC_REQ_FRAME = struct.Struct("<QIIQQ")  # 32 bytes

# A channel's GPU result buffer (a cuda sidecar's, handed to the client over CUDA IPC): room
# for this many queries and hits (nq * k), and token ids of one GPU-result recall (int32).
GPU_MAX_QUERIES = 64
GPU_MAX_HITS = 16384
GPU_MAX_TOKENS = 131072

__all__ = [
    "CHANNEL_HEADER_SIZE",
    "CHANNEL_MAGIC",
    "CHAN_ARENA_BYTES",
    "CHAN_CLIENT_BELL",
    "CHAN_CLIENT_PARKED",
    "CHAN_CLIENT_VIEW",
    "CHAN_EPOCH",
    "CHAN_HEADER",
    "CHAN_ID",
    "CHAN_LAYOUT_VERSION",
    "CHAN_MAGIC",
    "CHAN_REQ_ARENA",
    "CHAN_RESP_ARENA",
    "CONTROL_MAGIC",
    "CONTROL_SIZE",
    "CTRL_BELL",
    "CTRL_DIM",
    "CTRL_EPOCH",
    "CTRL_HEADER",
    "CTRL_HEARTBEAT_COUNT",
    "CTRL_HEARTBEAT_NS",
    "CTRL_LAYOUT_VERSION",
    "CTRL_MAGIC",
    "CTRL_MAX_K",
    "CTRL_METRIC",
    "CTRL_PROTOCOL_MAJOR",
    "CTRL_PROTOCOL_MINOR",
    "CTRL_RESERVED0",
    "CTRL_SERVER_PARKED",
    "CTRL_SERVER_PID",
    "CTRL_SPINNING",
    "CTRL_START_NS",
    "CTRL_STATE",
    "DEFAULT_ARENA_BYTES",
    "GPU_MAX_HITS",
    "GPU_MAX_QUERIES",
    "GPU_MAX_TOKENS",
    "GRPC_REQ_FRAME",
    "LAYOUT_VERSION",
    "LINE",
    "MAX_ARENA_BYTES",
    "MIN_ARENA_BYTES",
    "PAGE",
    "REQ_BODY_LEN",
    "REQ_DEADLINE_NS",
    "REQ_FIELDS",
    "REQ_FLAGS",
    "REQ_FRAME",
    "REQ_OP",
    "REQ_PUBLISH_NS",
    "REQ_SEQ",
    "RESP_BODY_LEN",
    "RESP_COMPUTE_NS",
    "RESP_FIELDS",
    "RESP_FLAGS",
    "RESP_FRAME",
    "RESP_QUEUE_NS",
    "RESP_SEQ",
    "RESP_STATUS",
    "RESP_WRITE_NS",
    "STATE_READY",
    "STATE_STARTING",
    "STATE_STOPPING",
    "channel_size",
]
