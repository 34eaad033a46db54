"""Byte layout of the control segment and of a channel: the one source of truth
(:mod:`kalos.protocol.layout` re-exports it beside the uds and grpc frames).

Every field is fixed-width little-endian at a fixed offset; there are no pointers. The golden
test (tests/protocol/test_layout.py) pins every offset and size below, and docs/PROTOCOL.md
draws them. Changing any of them is a new ``LAYOUT_VERSION`` and a new major protocol version.

Words written by one side and read by the other (the sequence words, the parked flags and the
doorbells) are 64-bit, 8-byte aligned, and only ever touched through :mod:`kalos._native`
(acquire/release), because pure Python cannot order memory on weakly ordered CPUs. Fields the
two sides write sit 128 bytes apart: Hopper/Grace and some x86 parts prefetch cache-line pairs,
so 64-byte spacing would still share a line between writers.
"""

from __future__ import annotations

import struct

LAYOUT_VERSION = 1
CONTROL_MAGIC = b"KALO"
CHANNEL_MAGIC = b"KCHN"
LINE = 128  # spacing between fields of different writers (a cache-line pair)
PAGE = 4096

# -- control segment (one per sidecar, mapped read-mostly by every client) -------------------
# Written by the sidecar at start, read by clients after the handshake.
CTRL_MAGIC = 0  # 4s   b"KALO"
CTRL_LAYOUT_VERSION = 4  # u32
CTRL_PROTOCOL_MAJOR = 8  # u32
CTRL_PROTOCOL_MINOR = 12  # u32
CTRL_EPOCH = 16  # u64  random, new on every sidecar start
CTRL_SERVER_PID = 24  # u64
CTRL_STATE = 32  # u64  STATE_* below
CTRL_DIM = 40  # u32  vector dimension of the memory index
CTRL_METRIC = 44  # u32  METRIC_CODES
CTRL_MAX_K = 48  # u32
CTRL_RESERVED0 = 52  # u32  zero
CTRL_START_NS = 56  # u64  CLOCK_MONOTONIC at start
CTRL_HEADER = struct.Struct("<4sIIIQQQIIIIQ")  # the fields above, offsets 0..63
# Line 1: written by the sidecar's poller only.
CTRL_HEARTBEAT_NS = 1 * LINE  # u64  CLOCK_MONOTONIC of the last heartbeat
CTRL_HEARTBEAT_COUNT = 1 * LINE + 8  # u64
# Callers waiting for a response without being parked (spinning) at the poller's last sweep,
# over every client process: a caller beyond a quarter of the CPUs parks at once (client).
CTRL_SPINNING = 1 * LINE + 16  # u64
# Line 2: the sidecar's doorbell. The sidecar sets PARKED before it sleeps on BELL; a client
# that publishes a request and sees PARKED != 0 bumps BELL and futex-wakes it.
CTRL_SERVER_PARKED = 2 * LINE  # u64
CTRL_BELL = 2 * LINE + 8  # u64  futex word (its low 32 bits)
CONTROL_SIZE = PAGE

STATE_STARTING = 0
STATE_READY = 1
STATE_STOPPING = 2

# -- channel (one per client thread; single producer, single consumer per direction) ---------
# Line 0: written once by the sidecar when it creates the channel.
CHAN_MAGIC = 0  # 4s   b"KCHN"
CHAN_LAYOUT_VERSION = 4  # u32
CHAN_ID = 8  # u64
CHAN_EPOCH = 16  # u64  the epoch of the sidecar that made it
CHAN_ARENA_BYTES = 24  # u64  size of each of the two arenas
CHAN_REQ_ARENA = 32  # u64  offset of the request arena
CHAN_RESP_ARENA = 40  # u64  offset of the response arena
CHAN_HEADER = struct.Struct("<4sIQQQQQ")  # offsets 0..47

# Line 1: the request header, written by the client. SEQ is published last (release).
REQ_SEQ = 1 * LINE  # u64
REQ_OP = 1 * LINE + 8  # u32  op code (protocol.codes.Op)
REQ_FLAGS = 1 * LINE + 12  # u32  op-specific flags
REQ_BODY_LEN = 1 * LINE + 16  # u64  bytes of body at the start of the request arena
REQ_PUBLISH_NS = 1 * LINE + 24  # u64  client CLOCK_MONOTONIC when published
REQ_DEADLINE_NS = 1 * LINE + 32  # u64  client CLOCK_MONOTONIC deadline; 0 = none
# op, flags, body_len, publish_ns, deadline_ns: the part of the request header after SEQ.
REQ_FIELDS = struct.Struct("<IIQQQ")

# Line 2: the response header, written by the sidecar. SEQ is published last (release).
RESP_SEQ = 2 * LINE  # u64  equals the request's SEQ it answers
RESP_STATUS = 2 * LINE + 8  # u32  protocol.codes.Status
RESP_FLAGS = 2 * LINE + 12  # u32
RESP_BODY_LEN = 2 * LINE + 16  # u64  bytes of body at the start of the response arena
RESP_QUEUE_NS = 2 * LINE + 24  # u64  publish → the sidecar picked it up
RESP_COMPUTE_NS = 2 * LINE + 32  # u64  dispatch: validation and the store/index work
RESP_WRITE_NS = 2 * LINE + 40  # u64  encoding the response body into the arena
# status, flags, body_len, queue_ns, compute_ns, write_ns: the part after SEQ.
RESP_FIELDS = struct.Struct("<IIQQQQ")

# Line 3: the client's doorbell, mirror of the sidecar's: the client sets PARKED before it
# sleeps on BELL; the sidecar bumps BELL and wakes it after publishing a response.
CHAN_CLIENT_PARKED = 3 * LINE  # u64
CHAN_CLIENT_BELL = 3 * LINE + 8  # u64  futex word (its low 32 bits)
# Line 4 (1.4): written by the client. The token offset + 1 of the token-heap region its last
# CONTEXT window computed from the session index points into (0: none); the sidecar reuses
# no region a client may still view (kalos.stores.session_index).
CHAN_CLIENT_VIEW = 4 * LINE  # u64

CHANNEL_HEADER_SIZE = PAGE  # the arenas start page-aligned
DEFAULT_ARENA_BYTES = 1 << 20  # 1 MiB each way
MIN_ARENA_BYTES = 64 << 10
MAX_ARENA_BYTES = 256 << 20


def channel_size(arena_bytes: int) -> int:
    """Bytes of a channel: the header page, then the request arena, then the response arena."""
    return CHANNEL_HEADER_SIZE + 2 * arena_bytes
