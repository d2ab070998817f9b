"""Rendezvous: barrier, peer discovery, consistent ranks and a shared store for a run.

``create_handler(params)`` gives the async :class:`DynamicRendezvousHandler` over the
backend that ``params.backend`` names. The semantics live in the pure state machine
(:mod:`aelastic.core.machine`); backends apply it, the handler only sends this node's
requests and waits for round transitions.
"""

from __future__ import annotations

from ..backends.registry import create_backend
from ..core.clock import Clock, ManualClock
from ..core.errors import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousLostError,
    RendezvousStateError,
    RendezvousTimeoutError,
    StoreTimeoutError,
)
from ..core.events import BackendError, BackendRetry, RendezvousWaiting
from ..core.params import (
    RendezvousInfo,
    RendezvousParameters,
    RendezvousSettings,
    RendezvousStoreInfo,
    RendezvousTimeout,
)
from ..core.state import NodeDesc
from ..core.view import MembershipView
from .handler import DynamicRendezvousHandler, HandlerStats, RendezvousEvent

__all__ = [
    "BackendError",
    "BackendRetry",
    "Clock",
    "DynamicRendezvousHandler",
    "HandlerStats",
    "ManualClock",
    "MembershipView",
    "NodeDesc",
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousEvent",
    "RendezvousGracefulExitError",
    "RendezvousInfo",
    "RendezvousLostError",
    "RendezvousParameters",
    "RendezvousSettings",
    "RendezvousStateError",
    "RendezvousStoreInfo",
    "RendezvousTimeout",
    "RendezvousTimeoutError",
    "RendezvousWaiting",
    "StoreTimeoutError",
    "create_handler",
]


def create_handler(
    params: RendezvousParameters, *, clock: Clock | None = None
) -> DynamicRendezvousHandler:
    """Create the async rendezvous handler that ``params`` describe.

    Args:
        params: Backend, endpoint, run id, node bounds and configuration keys
            (``join_timeout``, ``last_call_timeout``, ``close_timeout``, ``heartbeat_timeout``,
            ``keep_alive_interval``, ``keep_alive_max_attempt``, ``read_timeout``; seconds).
        clock: Time source (tests); the system clocks by default.

    Raises:
        ValueError: Unknown backend or invalid parameters.
        ImportError: The backend's optional dependencies are missing.
    """
    settings = RendezvousSettings.from_parameters(params)
    backend = create_backend(params)
    kwargs = {} if clock is None else {"clock": clock}
    return DynamicRendezvousHandler(
        backend, settings, local_addr=params.local_addr, backend_name=params.backend, **kwargs
    )
