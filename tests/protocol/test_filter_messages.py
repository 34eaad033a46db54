"""The 1.5 bodies, byte for byte (docs/PROTOCOL.md, section 4b): JSON sections, SEARCH with a
filter and with entries, ADD with metadata and string ids, LOOKUP, FORGET with a filter; and
truncated bodies never crash their decoders."""

from __future__ import annotations

import contextlib
import struct

import numpy as np
import pytest

from kalos.errors import InvalidRequest
from kalos.protocol import codes
from kalos.protocol import messages as M


def test_a_json_section_is_length_zero_bytes_padded() -> None:
    buf = np.full(64, 0xEE, np.uint8)
    end = M.write_json_section(buf, 8, b'{"a":1}')
    assert end == 8 + 16 + 8
    assert struct.unpack_from("<QQ", buf, 8) == (7, 0)
    assert bytes(buf[24:32]) == b'{"a":1}\x00'
    assert M.read_json_section(buf, 8, end) == (b'{"a":1}', end)
    with pytest.raises(InvalidRequest, match="outside the request"):
        M.read_json_section(buf, 8, end - 8)


def test_search_with_a_filter() -> None:
    buf = np.zeros(256, np.uint8)
    q = np.arange(4, dtype=np.float32).reshape(1, 4)
    n = M.encode_search(buf, q, 3, M.EMPTY_SCOPE, b'{"x":"y"}')
    # header 16, empty scope block 16, section 16 + 16 (9 bytes padded), queries 16
    assert n == 16 + 16 + 32 + 16
    assert struct.unpack_from("<IIII", buf, 0) == (1, 3, 4, codes.DTYPE_F32)
    assert struct.unpack_from("<QQ", buf, 32) == (9, 0)
    assert bytes(buf[48:57]) == b'{"x":"y"}'
    assert buf[64:80].view(np.float32).tolist() == [0, 1, 2, 3]
    req = M.decode_search(buf, n, flags=codes.SEARCH_FILTER)
    assert req.where == b'{"x":"y"}' and req.k == 3
    assert req.queries.tolist() == q.tolist()


def test_a_search_response_with_entries() -> None:
    buf = np.zeros(512, np.uint8)
    ids = np.array([[5, -1]], np.int64)
    scores = np.array([[0.5, -np.inf]], np.float32)
    entries = b'[["k",{"a":1}],[null,null]]'
    n = M.encode_search_response(buf, scores, ids, [(1, b"hi"), (0, b"")], entries)
    assert struct.unpack_from("<IIII", buf, 0) == (1, 2, 1, 1)
    assert struct.unpack_from("<QQ", buf, 16 + 8 + 16) == (len(entries), 0)  # after the ids
    r = M.decode_search_response(buf, n)
    assert r.entries == [["k", {"a": 1}], [None, None]]
    assert r.payloads == ["hi", None] and r.ids.tolist() == [[5, -1]]


def test_add_with_metadata_and_string_ids() -> None:
    buf = np.zeros(1024, np.uint8)
    meta = M.add_meta_json([b'{"a":1}', b"null"], [b'"doc"', b"null"])
    assert meta == b'{"meta":[{"a":1},null],"keys":["doc",null]}'
    ids = np.array([7, 8], np.int64)
    v = np.ones((2, 3), np.float32)
    n = M.encode_add(buf, ids, v, np.array([1, 0], np.uint8), [b"t", b""], M.EMPTY_SCOPE,
                     None, meta)  # fmt: skip
    req = M.decode_add(buf, n, codes.ADD_HAS_META)
    assert req.meta == [{"a": 1}, None] and req.keys == ["doc", None]
    assert bytes(req.blob[: int(req.offsets[-1])]) == b"t"
    bad = M.add_meta_json([b"[1]", b"null"], [b"null", b"null"])
    n = M.encode_add(buf, ids, v, np.zeros(2, np.uint8), [b"", b""], M.EMPTY_SCOPE, None, bad)
    with pytest.raises(InvalidRequest, match="metadata 0 must be a JSON object"):
        M.decode_add(buf, n, codes.ADD_HAS_META)


def test_lookup_and_forget_with_a_filter() -> None:
    buf = np.zeros(256, np.uint8)
    sb = M.ScopeBytes(b"t", b"", b"")
    n = M.encode_lookup(buf, np.array([3, 4], np.int64), sb)
    assert struct.unpack_from("<II", buf, 0) == (2, 0)
    ids, scope = M.decode_lookup(buf, n)
    assert ids.tolist() == [3, 4] and scope.tenant == "t"
    n = M.encode_scoped(buf, 0, 0, sb, M.encode_filter_tail(b"{}"))
    _, _, scope, off = M.decode_scoped(buf, n)
    assert M.decode_filter_at(buf, off, n) == b"{}"


def _bodies() -> list[tuple[str, bytes, int]]:
    buf = np.zeros(1024, np.uint8)
    out = []
    q = np.ones((1, 4), np.float32)
    n = M.encode_search(buf, q, 2, M.EMPTY_SCOPE, b'{"a":{"in":[1,2]}}')
    out.append(("search", buf[:n].tobytes(), codes.SEARCH_FILTER))
    meta = M.add_meta_json([b'{"a":[1,"x"]}'], [b'"k"'])
    n = M.encode_add(buf, np.array([1], np.int64), q, np.array([1], np.uint8), [b"p"],
                     M.EMPTY_SCOPE, None, meta)  # fmt: skip
    out.append(("add", buf[:n].tobytes(), codes.ADD_HAS_META))
    return out


_DECODERS = {
    "search": lambda b, n, f: M.decode_search(b, n, flags=f),
    "add": lambda b, n, f: M.decode_add(b, n, f),
}


@pytest.mark.parametrize("name, body, flags", _bodies(), ids=["search", "add"])
def test_truncated_bodies_never_crash_the_decoder(name: str, body: bytes, flags: int) -> None:
    _DECODERS[name](np.frombuffer(body, np.uint8).copy(), len(body), flags)
    for cut in range(len(body)):
        buf = np.frombuffer(body[:cut], np.uint8).copy()
        with contextlib.suppress(InvalidRequest):  # a cut in the padding may still decode
            _DECODERS[name](buf, cut, flags)
