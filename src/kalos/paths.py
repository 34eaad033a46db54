"""Where a sidecar's socket lives: one private directory per user, one socket per name."""

from __future__ import annotations

import os
import re

from kalos.errors import ConfigError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def runtime_dir(override: str | None = None) -> str:
    """The directory that holds sidecar sockets: ``override``, ``$KALOS_RUNTIME_DIR``,
    ``$XDG_RUNTIME_DIR/kalos`` or ``/tmp/kalos-<uid>``, in that order."""
    if override:
        return override
    env = os.environ.get("KALOS_RUNTIME_DIR")
    if env:
        return env
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return os.path.join(xdg, "kalos")
    return f"/tmp/kalos-{os.getuid()}"


def check_name(name: str) -> str:
    if not _NAME.match(name):
        raise ConfigError(f"bad sidecar name {name!r}: use 1-64 letters, digits, '_', '.', '-'")
    return name


def socket_path(name: str, directory: str | None = None) -> str:
    """The handshake socket of the sidecar called ``name``."""
    return os.path.join(runtime_dir(directory), check_name(name) + ".sock")
