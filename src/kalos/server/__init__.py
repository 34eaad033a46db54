"""The sidecar: handshake listener, channel poller, dispatcher."""

from kalos.server.config import SidecarConfig
from kalos.server.sidecar import Sidecar

__all__ = ["Sidecar", "SidecarConfig"]
