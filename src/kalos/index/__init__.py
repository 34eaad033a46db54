"""Vector indexes named by spec strings: ``create("cpu:flat", dim=128)``.

Importing this package imports numpy only; a backend's module (and FAISS or torch) loads when
a spec first asks for it. See :mod:`kalos.index.base` for the contract every backend keeps.
"""

from __future__ import annotations

from .base import Index, ScopeFilter
from .factory import create

__all__ = ["Index", "ScopeFilter", "create"]
