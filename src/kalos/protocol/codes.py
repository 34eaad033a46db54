"""Op codes, status codes, metric and payload codes, and the protocol version.

Status codes travel in every response header; the client turns a non-OK status into one
exception of :mod:`kalos.errors` through :func:`error_for_status`, in this one place.
"""

from __future__ import annotations

import enum
import numbers

from kalos import errors

# (major, minor). A client and a sidecar talk when their majors are equal; the minor is
# negotiated down to the smaller of the two. docs/PROTOCOL.md says what a minor may change.
# 1.1: RECALL, ADD with token ids; 1.2: the token heap; 1.3: response flag DEVICE_PUBLISHED;
# 1.4: the session index (clients compute CONTEXT windows from shared memory); 1.5: metadata,
# string ids and filters (ADD_HAS_META, SEARCH_FILTER, SEARCH_WANT_META, FORGET_FILTER,
# RECALL_FILTER, LOOKUP); 1.6: SEARCH_NPROBE (an approximate index's probe count per search)
PROTOCOL_VERSION = (1, 6)

MAX_K = 1024  # largest k a search may ask for


def check_k(k: object) -> int:
    """``k`` as the number of hits a search or recall asks for: an integer (numpy's too) in
    1..:data:`MAX_K`, not a bool. The client checks it before a request, the sidecar again
    on receipt. Raises InvalidRequest otherwise."""
    # type() first: isinstance against the numbers ABC alone measured 2.4 µs a call, this
    # 0.4 µs (a loaded 2-core VM), and every search pays it
    integer = type(k) is int or (isinstance(k, numbers.Integral) and not isinstance(k, bool))
    if integer and 1 <= (n := int(k)) <= MAX_K:  # type: ignore[call-overload]
        return n
    raise errors.InvalidRequest(f"k must be an integer between 1 and {MAX_K}, got {k!r}")


class Op(enum.IntEnum):
    PING = 1
    STATS = 2
    ADD = 3  # upsert: an existing id is replaced
    REMOVE = 4
    SEARCH = 5
    # Sessions (context buffers), agent state and scopes: bodies in messages/.
    APPEND_TURN = 6
    CONTEXT = 7
    SESSIONS = 8  # list, one page
    TRIM = 9
    DELETE_SESSION = 10
    STATE_PUT = 11
    STATE_GET = 12
    STATE_DELETE = 13
    STATE_CAS = 14
    LOG_EVENT = 15
    EVENTS = 16
    FORGET = 17
    RECALL = 18  # one LLM request's memory step: context + top-k memories as token ids
    LOOKUP = 19  # memories by id: payload, string id and metadata (1.5)


class Status(enum.IntEnum):
    OK = 0
    INVALID_REQUEST = 1  # bad input: wrong dim, NaN, k out of range, malformed body
    UNKNOWN_OP = 2
    PAYLOAD_TOO_LARGE = 3  # request or response does not fit the arena
    NOT_FOUND = 4
    CONFLICT = 5
    TIMEOUT = 6  # the request's deadline had passed when the sidecar reached it
    SERVER_ERROR = 7  # the sidecar failed; the message says what, never a traceback
    UNAVAILABLE = 8  # the sidecar is starting or stopping


METRICS = ("ip", "cosine", "l2")  # index = the code in the control segment

# Payload kinds of a memory item.
PAYLOAD_NONE = 0
PAYLOAD_TEXT = 1
PAYLOAD_BYTES = 2

# Vector dtypes on the wire.
DTYPE_F32 = 0
DTYPE_F16 = 1

# SEARCH flags.
SEARCH_WANT_PAYLOADS = 1
SEARCH_GPU_RESULT = 2  # results into the channel's GPU buffer (CUDA IPC), not the arena
SEARCH_GPU_QUERY = 4  # the queries are in the channel's GPU buffer; the body carries none
SEARCH_FILTER = 8  # (1.5) a metadata filter's JSON section follows the scope block
SEARCH_WANT_META = 16  # (1.5) the response carries each hit's string id and metadata
SEARCH_NPROBE = 32  # (1.6) `u32 nprobe, u32 0` follows the scope block (0: the index's own)
MAX_NPROBE = (1 << 32) - 1  # nprobe travels as a u32


def check_nprobe(nprobe: object) -> int:
    """``nprobe`` as a search asks for it: lists an approximate (IVF) index probes, an
    integer in 0..:data:`MAX_NPROBE`; 0 means the index's own setting, and an exact index
    ignores it. Raises InvalidRequest otherwise."""
    if isinstance(nprobe, bool) or not isinstance(nprobe, numbers.Integral):
        raise errors.InvalidRequest(f"nprobe must be an integer; got {nprobe!r}")
    if not 0 <= int(nprobe) <= MAX_NPROBE:
        raise errors.InvalidRequest(f"nprobe must be in 0..{MAX_NPROBE}; got {nprobe}")
    return int(nprobe)


ADD_HAS_TOKENS = 1  # ADD flag: the body carries token ids for some of its payloads
ADD_HAS_META = 2  # (1.5) ADD flag: a JSON section of metadata and string ids precedes the blob
FORGET_FILTER = 1  # (1.5) FORGET flag: a filter's JSON section follows the scope block


class AppendFlag(enum.IntFlag):
    """APPEND_TURN request flags."""

    PIN_SYSTEM = 1  # the turn becomes the session's pinned system prompt (replacing one)
    HAS_TOKENS = 2  # the body carries the token ids; without it the sidecar tokenizes
    SET_ROLLING = 4  # set the session's rolling option to ROLLING (otherwise keep it)
    ROLLING = 8


class ContextFlag(enum.IntFlag):
    """CONTEXT request flags."""

    TURNS = 1  # each turn's role and text too; without it only the token ids come back


class ContextForm(enum.IntFlag):
    """The fourth word of a CONTEXT response header (before 1.2: has_turns, 0 or 1)."""

    TURNS = 1  # the turns' meta and text follow the token ids
    TOKENS_IN_HEAP = 2  # the ids are in the token heap: u64 byte offset, u64 0 replace them


class ResponseFlag(enum.IntFlag):
    """Flags in a response's header (the channel's response line; the frames' flags)."""

    # The GPU wrote this response's sequence word (a cuda sidecar's search whose kernel
    # published it): its compute_ns is the sidecar's time up to the kernel's launch, and the
    # kernel's own time falls in the client's share of the round trip.
    DEVICE_PUBLISHED = 1
    # With DEVICE_PUBLISHED: the GPU also picked the request up itself, with no sidecar CPU
    # between the client and the kernel (server.doorbell): queue_ns, compute_ns and write_ns
    # are 0, and the whole round trip is the client's share.
    DEVICE_DOORBELL = 2


class RecallFlag(enum.IntFlag):
    """RECALL request flags."""

    GPU_RESULT = 1  # the token ids go into the channel's GPU buffer, not the response arena
    FILTER = 2  # (1.5) a filter's JSON section follows the session id, before the query


class RecallResponseFlag(enum.IntFlag):
    """Flags in the header of a RECALL response body."""

    SYSTEM = 1  # the pinned system prompt is included (its tokens come first)
    TOKENS_ON_GPU = 2  # the token ids are in the channel's GPU buffer, not in this body


_STATUS_ERRORS: dict[int, type[errors.KalosError]] = {
    Status.INVALID_REQUEST: errors.InvalidRequest,
    Status.UNKNOWN_OP: errors.InvalidRequest,
    Status.PAYLOAD_TOO_LARGE: errors.PayloadTooLarge,
    Status.NOT_FOUND: errors.NotFound,
    Status.CONFLICT: errors.Conflict,
    Status.TIMEOUT: errors.RequestTimeout,
}


def error_for_status(status: int, message: str) -> errors.KalosError:
    """The exception a client raises for a non-OK ``status`` with the sidecar's ``message``."""
    cls = _STATUS_ERRORS.get(status)
    if cls is not None:
        return cls(message)
    return errors.ServerError(message or f"sidecar error (status {status})", code=status)
