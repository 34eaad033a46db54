"""Where sockets live, and which names are allowed."""

from __future__ import annotations

import os

import pytest

from kalos.errors import ConfigError
from kalos.paths import check_name, runtime_dir, socket_path


def test_runtime_dir_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KALOS_RUNTIME_DIR", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    assert runtime_dir() == f"/tmp/kalos-{os.getuid()}"
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/7")
    assert runtime_dir() == "/run/user/7/kalos"
    monkeypatch.setenv("KALOS_RUNTIME_DIR", "/srv/kalos")
    assert runtime_dir() == "/srv/kalos"
    assert runtime_dir("/explicit") == "/explicit"


@pytest.mark.parametrize("name", ["a", "memories", "svc-1.prod_2", "A" * 64, "0start"])
def test_good_names(name: str) -> None:
    assert check_name(name) == name
    assert socket_path(name, "/d") == f"/d/{name}.sock"


@pytest.mark.parametrize("name", ["", "-x", ".hidden", "a/b", "../x", "a b", "A" * 65, "é"])
def test_bad_names(name: str) -> None:
    with pytest.raises(ConfigError):
        check_name(name)
    with pytest.raises(ConfigError):
        socket_path(name, "/d")
