"""SidecarConfig: validation at construction, and who may connect."""

from __future__ import annotations

import os

import pytest

from kalos.errors import ConfigError
from kalos.server import SidecarConfig


@pytest.mark.parametrize(
    "kwargs",
    [
        {"name": "bad name"},
        {"name": ""},
        {"name": "x" * 65},
        {"name": "../up"},
        {"dim": 0},
        {"dim": 65537},
        {"metric": "dot"},
        {"device": "tpu"},
        {"max_arena_bytes": 1024},
        {"max_arena_bytes": 1 << 30},
        {"compute_threads": 0},
        {"token_heap_bytes": -1024},
        {"token_heap_bytes": 1000},  # not a multiple of 1 KiB
        {"spin_us": -1},
        {"max_spin_us": 2e7},
    ],
)
def test_bad_config_is_refused(kwargs: dict) -> None:
    args = {"name": "ok", "dim": 8, **kwargs}
    with pytest.raises(ConfigError):
        SidecarConfig(**args)


def test_defaults() -> None:
    c = SidecarConfig(name="ok", dim=8)
    assert c.metric == "ip" and c.index_spec == "cpu:flat"
    assert SidecarConfig(name="g", dim=8, device="cuda:1").index_spec == "cuda:1:flat,fp16"
    assert SidecarConfig(name="f", dim=8, index="cpu:faiss-flat").index_spec == "cpu:faiss-flat"
    assert c.token_heap_bytes == 256 << 20
    assert SidecarConfig(name="h", dim=8, token_heap_bytes=0).token_heap_bytes == 0  # off


def test_peer_allowed() -> None:
    me = os.getuid()
    c = SidecarConfig(name="ok", dim=8)
    assert c.peer_allowed(me, 12345)
    assert not c.peer_allowed(me + 1, 12345)
    c = SidecarConfig(name="ok", dim=8, allowed_uids=(me + 1,), allowed_gid=4242)
    assert c.peer_allowed(me + 1, 0)
    assert c.peer_allowed(me + 2, 4242)
    assert not c.peer_allowed(me + 2, 4243)


def test_sharded_index_only_on_cpu_sidecar():
    assert SidecarConfig(name="s", dim=8, index="cpu:flat,shards=2").index_spec == (
        "cpu:flat,shards=2"
    )
    with pytest.raises(ConfigError, match="sharded"):
        SidecarConfig(name="s", dim=8, device="cuda", index="cuda:flat,fp16,shards=2")
