"""Small value types shared by every layer: :class:`Scope`.

Re-exported as ``kalos.Scope``, ``kalos.protocol.Scope`` and ``kalos.protocol.messages.Scope``.
"""

from __future__ import annotations

from typing import NamedTuple


class Scope(NamedTuple):
    """Who a memory belongs to: tenant, user and session, each optional.

    On add, the item's scope. On search, a filter: an item matches when every field given here
    equals the item's field (``Scope("acme")`` matches all of tenant acme's items).
    """

    tenant: str | None = None
    user: str | None = None
    session: str | None = None


__all__ = ["Scope"]
