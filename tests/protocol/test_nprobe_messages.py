"""The 1.6 SEARCH section, byte for byte (docs/PROTOCOL.md, section 4c): with flag
SEARCH_NPROBE, ``u32 nprobe, u32 0`` follows the scope block, before a filter's section."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from kalos.errors import InvalidRequest
from kalos.protocol import codes
from kalos.protocol import messages as M
from kalos.server.dispatch import batchable


def test_search_with_nprobe_golden_bytes() -> None:
    buf = np.full(256, 0xEE, np.uint8)
    q = np.arange(4, dtype=np.float32).reshape(1, 4)
    n = M.encode_search(buf, q, 3, M.EMPTY_SCOPE, nprobe=7)
    # header 16, empty scope block 16, nprobe section 8, queries 16
    assert n == 16 + 16 + 8 + 16
    assert struct.unpack_from("<IIII", buf, 0) == (1, 3, 4, codes.DTYPE_F32)
    assert struct.unpack_from("<II", buf, 32) == (7, 0)
    assert buf[40:56].view(np.float32).tolist() == [0, 1, 2, 3]
    req = M.decode_search(buf, n, flags=codes.SEARCH_NPROBE)
    assert (req.nprobe, req.k) == (7, 3) and req.queries.tolist() == q.tolist()


def test_nprobe_comes_before_the_filter_section() -> None:
    buf = np.zeros(256, np.uint8)
    q = np.ones((2, 4), np.float32)
    n = M.encode_search(buf, q, 5, M.EMPTY_SCOPE, b'{"x":"y"}', nprobe=64)
    assert n == 16 + 16 + 8 + 32 + 32
    assert struct.unpack_from("<II", buf, 32) == (64, 0)
    assert struct.unpack_from("<QQ", buf, 40) == (9, 0)
    req = M.decode_search(buf, n, flags=codes.SEARCH_NPROBE | codes.SEARCH_FILTER)
    assert req.nprobe == 64 and req.where == b'{"x":"y"}' and req.queries.shape == (2, 4)


def test_without_the_flag_nprobe_is_zero_and_no_section_is_written() -> None:
    buf = np.zeros(128, np.uint8)
    q = np.ones((1, 4), np.float32)
    n = M.encode_search(buf, q, 1, M.EMPTY_SCOPE)
    assert n == 16 + 16 + 16 and M.decode_search(buf, n).nprobe == 0


def test_a_truncated_nprobe_section_is_invalid() -> None:
    buf = np.zeros(128, np.uint8)
    n = M.encode_search(buf, np.ones((1, 4), np.float32), 1, M.EMPTY_SCOPE, nprobe=3)
    with pytest.raises(InvalidRequest, match="truncated"):
        M.decode_search(buf, 36, flags=codes.SEARCH_NPROBE)
    with pytest.raises(InvalidRequest):
        M.decode_search(buf, n - 8, flags=codes.SEARCH_NPROBE)


def test_a_search_with_its_own_nprobe_joins_batches() -> None:
    assert batchable(codes.Op.SEARCH, 0)
    assert batchable(codes.Op.SEARCH, codes.SEARCH_NPROBE)
    assert not batchable(codes.Op.SEARCH, codes.SEARCH_NPROBE | codes.SEARCH_FILTER)


@pytest.mark.parametrize("bad", [-1, 2**32, 1.0, True, "8", None])
def test_check_nprobe_refuses_what_a_u32_cannot_carry(bad) -> None:
    with pytest.raises(InvalidRequest, match="nprobe"):
        codes.check_nprobe(bad)
    assert codes.check_nprobe(np.uint32(9)) == 9 and codes.check_nprobe(0) == 0
