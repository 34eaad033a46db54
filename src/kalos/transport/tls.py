"""TLS settings of the grpc transport: :class:`Tls`, re-exported as ``kalos.Tls``."""

from __future__ import annotations

import dataclasses
import os

from kalos.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Tls:
    """TLS for the grpc transport, as paths of PEM files.

    A client: ``ca`` is the certificate authority to trust (None: the system's roots);
    ``cert`` and ``key`` its own certificate, for a sidecar that asks for one (mutual TLS);
    ``server_name`` overrides the name checked against the sidecar's certificate (when the
    target is an address the certificate does not name).
    """

    ca: str | os.PathLike[str] | None = None
    cert: str | os.PathLike[str] | None = None
    key: str | os.PathLike[str] | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ConfigError("a TLS client certificate needs its key, and a key its certificate")
