"""How a client connects and behaves: :class:`ClientOptions`, the one place its options live.

``kalos.connect``, :class:`kalos.Client`, ``kalos.connect_async`` and :class:`kalos.AsyncClient`
take the same options, either as keywords (``connect(name, timeout=1.0)``) or as one object
(``connect(name, options=ClientOptions(timeout=1.0))``); keywords given beside ``options``
override its fields.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from typing import Any, TypedDict

from kalos.errors import ConfigError, InvalidRequest
from kalos.protocol import layout as L
from kalos.transport.tls import Tls

ON_UNAVAILABLE = ("raise", "degrade")
# The longest deadline a call may have (~31.7 years): its monotonic ns fit the protocol's u64.
MAX_TIMEOUT_S = 1e9


def timeout_error(timeout: object) -> InvalidRequest | None:
    """What is wrong with a call's ``timeout`` (seconds; None: the client's default): an
    InvalidRequest unless it is a number from 0 to :data:`MAX_TIMEOUT_S` (0: the deadline
    has passed already, a RequestTimeout of the call's own), else None."""
    if timeout is None:
        return None
    # type() first: the numbers ABC's isinstance costs µs, and every AsyncClient call asks
    real = type(timeout) is float or type(timeout) is int or isinstance(timeout, numbers.Real)
    if real and 0 <= float(timeout) <= MAX_TIMEOUT_S:  # type: ignore[arg-type]
        return None
    return InvalidRequest(
        f"timeout must be a number of seconds from 0 to {MAX_TIMEOUT_S:g}, or None for the "
        f"client's default; got {timeout!r}"
    )


@dataclasses.dataclass(frozen=True)
class ClientOptions:
    """The options of a client, with their defaults.

    ``transport``: "shm" (default: the request and response travel through shared memory),
    "uds" (a Unix socket) or "grpc"; for "grpc", the client's ``name`` is the sidecar's grpc
    target (``host:port`` or ``unix:/path``, see ``kalos serve --grpc``).

    ``timeout``: the default deadline of a call, in seconds (5 s); each call may pass its own.

    ``runtime_dir``: where the sidecar's socket is (None: ``$KALOS_RUNTIME_DIR``, else the
    user's runtime directory; see :mod:`kalos.paths`).

    ``arena_bytes``: the size of each channel's data arena (1 MiB), the largest request or
    response body one call moves; negotiated down to the sidecar's limit.

    ``spin_us``: how long a caller spins for a response before parking, in µs (spinning pays
    when the sidecar has its own core; parking costs a ~25 µs futex wake). None: learned per
    op by each channel, from a base of 50 µs, or 200 µs against a sidecar whose index is on a
    GPU (a search there takes longer than 50 µs, and a parked caller is woken only after the
    sidecar's stream sync): an op whose round trips average a little more than the base (up
    to 4 times it) is spun for a quarter more than that average, plus 10 µs; a longer one,
    or any under load (queued in the sidecar for a quarter of its round trip), parks after
    the base.

    ``gpu_results``: map each channel's GPU result buffer (a cuda sidecar, shm transport, torch
    installed) so that ``search_gpu`` can hand results over as torch tensors.

    ``on_unavailable``: "raise" (default) or "degrade". A lost sidecar makes a call in flight,
    or the next call, raise SidecarGone within its deadline; a later call opens a new channel
    (ConnectError while no sidecar of that name answers). With "degrade", instead of
    SidecarGone, ConnectError or RequestTimeout, ``search`` returns a SearchResult with every
    id -1 and ``degraded=True``, ``context`` an empty Context and ``recall`` an empty Recall,
    both with ``degraded=True``. Every other call still raises (a write must never look done;
    ping, stats, state, session listings and events have no harmless empty answer), bad input
    always raises, and making the client connects and raises ConnectError either way.

    ``hung_after``: seconds without a sidecar heartbeat after which a shm channel reports its
    sidecar hung, as SidecarGone (None: 1 s). Over uds a hung sidecar is a RequestTimeout.

    ``tls``: a :class:`kalos.Tls` to secure the grpc transport (None: plaintext).

    ``local_reads``: over shm, ``context`` with ``turns=False`` computes the window in this
    process from the sidecar's session index and token heap (shared memory, read-only)
    instead of sending a request, whenever the index can answer for certain; the sidecar
    answers otherwise (kalos.stores.session_index). False: every call asks the sidecar.

    Raises ConfigError for an unknown ``on_unavailable`` or a ``timeout`` that is not a
    positive number of seconds (up to :data:`MAX_TIMEOUT_S`).
    """

    transport: str = "shm"
    timeout: float = 5.0
    runtime_dir: str | None = None
    arena_bytes: int = L.DEFAULT_ARENA_BYTES
    spin_us: float | None = None
    gpu_results: bool = False
    on_unavailable: str = "raise"
    hung_after: float | None = None
    tls: Tls | None = None
    local_reads: bool = True

    def __post_init__(self) -> None:
        if timeout_error(self.timeout) is not None or not self.timeout:
            raise ConfigError(
                f"timeout must be a positive number of seconds up to {MAX_TIMEOUT_S:g}, "
                f"not {self.timeout!r}"
            )
        if self.on_unavailable not in ON_UNAVAILABLE:
            raise ConfigError(
                f"on_unavailable must be 'raise' or 'degrade', not {self.on_unavailable!r}"
            )

    @classmethod
    def of(cls, options: ClientOptions | None, overrides: Mapping[str, Any]) -> ClientOptions:
        """``options`` (None: the defaults) with the fields named in ``overrides`` replaced.
        Raises TypeError for a keyword that is no option, as a function would."""
        unknown = overrides.keys() - _FIELDS
        if unknown:
            raise TypeError(f"unexpected keyword argument {sorted(unknown)[0]!r}")
        if options is None:
            return cls(**overrides)
        if not isinstance(options, ClientOptions):
            raise ConfigError(f"options must be a kalos.ClientOptions, not {options!r}")
        return dataclasses.replace(options, **overrides) if overrides else options


_FIELDS = frozenset(f.name for f in dataclasses.fields(ClientOptions))


class ClientOptionsArgs(TypedDict, total=False):
    """:class:`ClientOptions`' fields as keywords, for type checkers (``**Unpack[...]``)."""

    transport: str
    timeout: float
    runtime_dir: str | None
    arena_bytes: int
    spin_us: float | None
    gpu_results: bool
    on_unavailable: str
    hung_after: float | None
    tls: Tls | None
    local_reads: bool


__all__ = ["MAX_TIMEOUT_S", "ClientOptions", "ClientOptionsArgs", "timeout_error"]
