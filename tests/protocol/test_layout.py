"""Golden test of the wire layout: every offset, size, struct format and code, as literals.

The expected numbers are written out here, not recomputed from the module: a change to any of
them must show up as a failing test and a deliberate edit of this file (and a new
``LAYOUT_VERSION`` / major protocol version, and docs/PROTOCOL.md).
"""

from __future__ import annotations

import enum
import itertools
import struct

import pytest

from kalos.protocol import codes
from kalos.protocol import layout as L

GOLDEN_INTS = {
    "LAYOUT_VERSION": 1,
    "LINE": 128,
    "PAGE": 4096,
    # control segment
    "CTRL_MAGIC": 0,
    "CTRL_LAYOUT_VERSION": 4,
    "CTRL_PROTOCOL_MAJOR": 8,
    "CTRL_PROTOCOL_MINOR": 12,
    "CTRL_EPOCH": 16,
    "CTRL_SERVER_PID": 24,
    "CTRL_STATE": 32,
    "CTRL_DIM": 40,
    "CTRL_METRIC": 44,
    "CTRL_MAX_K": 48,
    "CTRL_RESERVED0": 52,
    "CTRL_START_NS": 56,
    "CTRL_HEARTBEAT_NS": 128,
    "CTRL_HEARTBEAT_COUNT": 136,
    "CTRL_SPINNING": 144,
    "CTRL_SERVER_PARKED": 256,
    "CTRL_BELL": 264,
    "CONTROL_SIZE": 4096,
    "STATE_STARTING": 0,
    "STATE_READY": 1,
    "STATE_STOPPING": 2,
    # channel
    "CHAN_MAGIC": 0,
    "CHAN_LAYOUT_VERSION": 4,
    "CHAN_ID": 8,
    "CHAN_EPOCH": 16,
    "CHAN_ARENA_BYTES": 24,
    "CHAN_REQ_ARENA": 32,
    "CHAN_RESP_ARENA": 40,
    "REQ_SEQ": 128,
    "REQ_OP": 136,
    "REQ_FLAGS": 140,
    "REQ_BODY_LEN": 144,
    "REQ_PUBLISH_NS": 152,
    "REQ_DEADLINE_NS": 160,
    "RESP_SEQ": 256,
    "RESP_STATUS": 264,
    "RESP_FLAGS": 268,
    "RESP_BODY_LEN": 272,
    "RESP_QUEUE_NS": 280,
    "RESP_COMPUTE_NS": 288,
    "RESP_WRITE_NS": 296,
    "CHAN_CLIENT_PARKED": 384,
    "CHAN_CLIENT_BELL": 392,
    "CHAN_CLIENT_VIEW": 512,
    "CHANNEL_HEADER_SIZE": 4096,
    "DEFAULT_ARENA_BYTES": 1048576,
    "MIN_ARENA_BYTES": 65536,
    "MAX_ARENA_BYTES": 268435456,
    "GPU_MAX_QUERIES": 64,
    "GPU_MAX_HITS": 16384,
    "GPU_MAX_TOKENS": 131072,
}

GOLDEN_BYTES = {"CONTROL_MAGIC": b"KALO", "CHANNEL_MAGIC": b"KCHN"}

# name: (format, size in bytes)
GOLDEN_STRUCTS = {
    "CTRL_HEADER": ("<4sIIIQQQIIIIQ", 64),
    "CHAN_HEADER": ("<4sIQQQQQ", 48),
    "REQ_FIELDS": ("<IIQQQ", 32),
    "RESP_FIELDS": ("<IIQQQQ", 40),
    "REQ_FRAME": ("<QIIQQQ", 40),
    "RESP_FRAME": ("<QIIQQQQ", 48),
    "GRPC_REQ_FRAME": ("<QIIQQ", 32),
}

# Each struct's fields, in order, by the offset constant of each (None: no constant).
STRUCT_FIELDS = {
    "CTRL_HEADER": (
        "CTRL_MAGIC",
        "CTRL_LAYOUT_VERSION",
        "CTRL_PROTOCOL_MAJOR",
        "CTRL_PROTOCOL_MINOR",
        "CTRL_EPOCH",
        "CTRL_SERVER_PID",
        "CTRL_STATE",
        "CTRL_DIM",
        "CTRL_METRIC",
        "CTRL_MAX_K",
        "CTRL_RESERVED0",
        "CTRL_START_NS",
    ),
    "CHAN_HEADER": (
        "CHAN_MAGIC",
        "CHAN_LAYOUT_VERSION",
        "CHAN_ID",
        "CHAN_EPOCH",
        "CHAN_ARENA_BYTES",
        "CHAN_REQ_ARENA",
        "CHAN_RESP_ARENA",
    ),
    "REQ_FIELDS": ("REQ_OP", "REQ_FLAGS", "REQ_BODY_LEN", "REQ_PUBLISH_NS", "REQ_DEADLINE_NS"),
    "RESP_FIELDS": (
        "RESP_STATUS",
        "RESP_FLAGS",
        "RESP_BODY_LEN",
        "RESP_QUEUE_NS",
        "RESP_COMPUTE_NS",
        "RESP_WRITE_NS",
    ),
}


def _public_constants(module: object) -> dict[str, object]:
    return {n: getattr(module, n) for n in dir(module) if n.isupper() and not n.startswith("_")}


def test_every_layout_constant_is_pinned() -> None:
    # A constant added to layout.py without a golden value here fails this test.
    pinned = set(GOLDEN_INTS) | set(GOLDEN_BYTES) | set(GOLDEN_STRUCTS)
    assert set(_public_constants(L)) == pinned


@pytest.mark.parametrize("name", sorted(GOLDEN_INTS))
def test_offset_and_size_values(name: str) -> None:
    value = getattr(L, name)
    assert type(value) is int
    assert value == GOLDEN_INTS[name]


@pytest.mark.parametrize("name", sorted(GOLDEN_BYTES))
def test_magic_values(name: str) -> None:
    assert getattr(L, name) == GOLDEN_BYTES[name]


@pytest.mark.parametrize("name", sorted(GOLDEN_STRUCTS))
def test_struct_formats_and_sizes(name: str) -> None:
    fmt, size = GOLDEN_STRUCTS[name]
    s = getattr(L, name)
    assert isinstance(s, struct.Struct)
    assert s.format == fmt
    assert s.size == size


def _field_offsets(fmt: str) -> list[int]:
    """Byte offset of each field of a little-endian, padding-free struct format."""
    order, body = fmt[0], fmt[1:]
    assert order == "<"
    offsets, pos, count = [], 0, ""
    for ch in body:
        if ch.isdigit():
            count += ch
            continue
        offsets.append(pos)
        pos += struct.calcsize("<" + count + ch)
        count = ""
    return offsets


@pytest.mark.parametrize("name", sorted(STRUCT_FIELDS))
def test_structs_pack_each_field_at_its_offset(name: str) -> None:
    fields = STRUCT_FIELDS[name]
    fmt, _ = GOLDEN_STRUCTS[name]
    base = GOLDEN_INTS[fields[0]]  # REQ_FIELDS and RESP_FIELDS are packed at their first field
    assert [base + off for off in _field_offsets(fmt)] == [GOLDEN_INTS[f] for f in fields]


def test_frames_are_seq_then_the_channel_header_fields() -> None:
    assert L.REQ_FRAME.format == "<Q" + L.REQ_FIELDS.format[1:]
    assert L.RESP_FRAME.format == "<Q" + L.RESP_FIELDS.format[1:]
    # grpc: seq, op, flags, body_len as over uds, then the response limit (no client clocks)
    assert L.GRPC_REQ_FRAME.format == L.REQ_FRAME.format[:-2] + "Q"


def test_channel_size_is_header_page_then_two_arenas() -> None:
    assert L.channel_size(65536) == 4096 + 2 * 65536
    assert L.channel_size(1 << 20) == 2101248


def test_headers_fit_their_first_line_and_every_word_its_page() -> None:
    assert L.CTRL_HEADER.size <= L.LINE  # the heartbeat line starts after it
    assert L.CHAN_HEADER.size <= L.LINE  # the request header line starts after it
    ctrl_words = [v for n, v in GOLDEN_INTS.items() if n.startswith("CTRL_")]
    chan_words = [v for n, v in GOLDEN_INTS.items() if n.startswith(("CHAN_", "REQ_", "RESP_"))]
    assert max(ctrl_words) + 8 <= L.CONTROL_SIZE
    assert max(chan_words) + 8 <= L.CHANNEL_HEADER_SIZE


# Who writes each word of the shared memory. The doorbells are the one exception to "different
# writers, different lines": the parker writes PARKED and its wakers bump BELL; both are touched
# only on the park/wake path (a futex syscall already), never per request while spinning.
CLIENT_WRITES = (
    "REQ_SEQ",
    "REQ_OP",
    "REQ_FLAGS",
    "REQ_BODY_LEN",
    "REQ_PUBLISH_NS",
    "REQ_DEADLINE_NS",
    "CHAN_CLIENT_PARKED",
    "CHAN_CLIENT_VIEW",
)
SIDECAR_WRITES = (
    "CHAN_MAGIC",
    "CHAN_LAYOUT_VERSION",
    "CHAN_ID",
    "CHAN_EPOCH",
    "CHAN_ARENA_BYTES",
    "CHAN_REQ_ARENA",
    "CHAN_RESP_ARENA",
    "RESP_SEQ",
    "RESP_STATUS",
    "RESP_FLAGS",
    "RESP_BODY_LEN",
    "RESP_QUEUE_NS",
    "RESP_COMPUTE_NS",
    "RESP_WRITE_NS",
    "CHAN_CLIENT_BELL",
)
DOORBELLS = {frozenset({"CHAN_CLIENT_PARKED", "CHAN_CLIENT_BELL"})}
CTRL_SIDECAR_WRITES = (
    "CTRL_MAGIC",
    "CTRL_STATE",
    "CTRL_START_NS",
    "CTRL_HEARTBEAT_NS",
    "CTRL_HEARTBEAT_COUNT",
    "CTRL_SPINNING",
    "CTRL_SERVER_PARKED",
)
CTRL_CLIENT_WRITES = ("CTRL_BELL",)
CTRL_DOORBELLS = {frozenset({"CTRL_SERVER_PARKED", "CTRL_BELL"})}


def _lines(offset: int, size: int = 8) -> set[int]:
    """The 128-byte lines (cache-line pairs) a word at ``offset`` touches."""
    return set(range(offset // 128, (offset + size - 1) // 128 + 1))


@pytest.mark.parametrize(
    "client_fields, sidecar_fields, doorbells",
    [
        (CLIENT_WRITES, SIDECAR_WRITES, DOORBELLS),
        (CTRL_CLIENT_WRITES, CTRL_SIDECAR_WRITES, CTRL_DOORBELLS),
    ],
    ids=["channel", "control"],
)
def test_words_of_different_writers_are_128_bytes_apart(
    client_fields: tuple[str, ...], sidecar_fields: tuple[str, ...], doorbells: set[frozenset]
) -> None:
    for a, b in itertools.product(client_fields, sidecar_fields):
        if frozenset({a, b}) in doorbells:
            continue
        oa, ob = GOLDEN_INTS[a], GOLDEN_INTS[b]
        assert getattr(L, a) == oa and getattr(L, b) == ob
        # different 128-byte lines: no cache-line pair holds words of both writers
        assert not _lines(oa) & _lines(ob), (a, b)


def test_hot_sequence_words_have_lines_of_their_own() -> None:
    # REQ_SEQ (client) and RESP_SEQ (sidecar) are polled on every request.
    assert L.REQ_SEQ // 128 != L.RESP_SEQ // 128
    assert L.RESP_SEQ - L.REQ_SEQ >= 128


def test_shared_words_are_8_byte_aligned() -> None:
    for name in (
        "REQ_SEQ",
        "RESP_SEQ",
        "CHAN_CLIENT_PARKED",
        "CHAN_CLIENT_BELL",
        "CHAN_CLIENT_VIEW",
        "CTRL_SERVER_PARKED",
        "CTRL_BELL",
        "CTRL_HEARTBEAT_NS",
        "CTRL_HEARTBEAT_COUNT",
        "CTRL_SPINNING",
        "CTRL_STATE",
    ):
        assert getattr(L, name) % 8 == 0, name


# -- codes ------------------------------------------------------------------------------------


def test_protocol_version_and_limits() -> None:
    assert codes.PROTOCOL_VERSION == (1, 6)
    assert codes.MAX_K == 1024
    assert {f.name: int(f) for f in codes.ResponseFlag} == {
        "DEVICE_PUBLISHED": 1,
        "DEVICE_DOORBELL": 2,
    }


def test_op_codes() -> None:
    assert {op.name: int(op) for op in codes.Op} == {
        "PING": 1, "STATS": 2, "ADD": 3, "REMOVE": 4, "SEARCH": 5,
        "APPEND_TURN": 6, "CONTEXT": 7, "SESSIONS": 8, "TRIM": 9, "DELETE_SESSION": 10,
        "STATE_PUT": 11, "STATE_GET": 12, "STATE_DELETE": 13, "STATE_CAS": 14,
        "LOG_EVENT": 15, "EVENTS": 16, "FORGET": 17, "RECALL": 18, "LOOKUP": 19,
    }  # fmt: skip


def test_append_flags() -> None:
    assert {f.name: int(f) for f in codes.AppendFlag} == {
        "PIN_SYSTEM": 1, "HAS_TOKENS": 2, "SET_ROLLING": 4, "ROLLING": 8,
    }  # fmt: skip


def test_context_flags() -> None:
    assert {f.name: int(f) for f in codes.ContextFlag} == {"TURNS": 1}


def test_context_forms() -> None:
    assert {f.name: int(f) for f in codes.ContextForm} == {"TURNS": 1, "TOKENS_IN_HEAP": 2}


def test_recall_flags() -> None:
    assert {f.name: int(f) for f in codes.RecallFlag} == {"GPU_RESULT": 1, "FILTER": 2}
    assert {f.name: int(f) for f in codes.RecallResponseFlag} == {
        "SYSTEM": 1, "TOKENS_ON_GPU": 2,
    }  # fmt: skip


def test_every_code_enum_is_pinned() -> None:
    enums = {n for n, v in vars(codes).items() if isinstance(v, type) and issubclass(v, enum.Enum)}
    assert enums == {
        "Op", "Status", "AppendFlag", "ContextFlag", "ContextForm", "RecallFlag",
        "RecallResponseFlag", "ResponseFlag",
    }  # fmt: skip


def test_status_codes() -> None:
    assert {s.name: int(s) for s in codes.Status} == {
        "OK": 0,
        "INVALID_REQUEST": 1,
        "UNKNOWN_OP": 2,
        "PAYLOAD_TOO_LARGE": 3,
        "NOT_FOUND": 4,
        "CONFLICT": 5,
        "TIMEOUT": 6,
        "SERVER_ERROR": 7,
        "UNAVAILABLE": 8,
    }


def test_metric_payload_dtype_and_flag_codes() -> None:
    assert codes.METRICS == ("ip", "cosine", "l2")
    assert (codes.PAYLOAD_NONE, codes.PAYLOAD_TEXT, codes.PAYLOAD_BYTES) == (0, 1, 2)
    assert (codes.DTYPE_F32, codes.DTYPE_F16) == (0, 1)
    assert codes.SEARCH_WANT_PAYLOADS == 1
    assert codes.SEARCH_GPU_RESULT == 2
    assert codes.SEARCH_GPU_QUERY == 4
    assert codes.ADD_HAS_TOKENS == 1
    assert codes.SEARCH_FILTER == 8
    assert codes.SEARCH_WANT_META == 16
    assert codes.SEARCH_NPROBE == 32
    assert codes.MAX_NPROBE == 2**32 - 1
    assert codes.ADD_HAS_META == 2
    assert codes.FORGET_FILTER == 1
    assert int(codes.RecallFlag.FILTER) == 2


def test_every_code_constant_is_pinned() -> None:
    assert set(_public_constants(codes)) == {
        "PROTOCOL_VERSION",
        "MAX_K",
        "METRICS",
        "PAYLOAD_NONE",
        "PAYLOAD_TEXT",
        "PAYLOAD_BYTES",
        "DTYPE_F32",
        "DTYPE_F16",
        "SEARCH_WANT_PAYLOADS",
        "SEARCH_GPU_RESULT",
        "SEARCH_GPU_QUERY",
        "ADD_HAS_TOKENS",
        "SEARCH_FILTER",
        "SEARCH_WANT_META",
        "SEARCH_NPROBE",
        "MAX_NPROBE",
        "ADD_HAS_META",
        "FORGET_FILTER",
    }
