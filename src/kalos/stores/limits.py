"""Size limits of the stores, set when the sidecar starts (``kalos serve --max-...``).

Every limit is checked before a store changes anything, so a refused write leaves no trace.
A write over a limit raises :class:`~kalos.errors.InvalidRequest` whose message names the
limit, the size asked for and the flag that raises it.
"""

from __future__ import annotations

import dataclasses

from kalos.errors import ConfigError, InvalidRequest


@dataclasses.dataclass(frozen=True)
class Limits:
    max_turn_tokens: int = 32_768  # token ids of one turn
    max_turn_bytes: int = 256 << 10  # UTF-8 bytes of one turn's role + text
    # Turns a session may hold. A full session refuses the next append (InvalidRequest) unless
    # it was made rolling (append_turn(..., rolling=True)): then its oldest turns give way.
    max_session_turns: int = 10_000
    max_state_bytes: int = 256 << 10  # one state value, or one event's data
    max_key_bytes: int = 1024  # a state key, a session id
    max_role_bytes: int = 64  # a turn's role ("user", "assistant", "tool", ...)
    max_kind_bytes: int = 256  # an event's kind
    # Per tenant (memories whose scope names a tenant; None: no limit): items, and bytes
    # (vectors at 4 bytes a dimension plus payloads and token ids at 4 bytes each).
    tenant_max_items: int | None = None
    tenant_max_bytes: int | None = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None and value < 1:
                raise ConfigError(f"{field.name} must be at least 1")


def check_size(what: str, size: int, limit: int, unit: str, flag: str | None = None) -> None:
    """InvalidRequest naming the limit when ``size`` exceeds ``limit``."""
    if size > limit:
        raise InvalidRequest(
            f"{what} has {size} {unit}; the limit is {limit}"
            + (f" (kalos serve {flag})" if flag else "")
        )


def check_name(what: str, name: str, limit: int) -> bytes:
    """A session id or key: a non-empty string of at most ``limit`` UTF-8 bytes."""
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"{what} must be a non-empty string")
    raw = name.encode()
    check_size(what, len(raw), limit, "bytes")
    return raw
