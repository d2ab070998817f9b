"""The ground floor: parameters, errors, time, the state and its pure machine, the backend
protocol and the members' store. Nothing here imports from above (backends, the handler,
the agent, the command line) or does I/O of its own.
"""

from .clock import SYSTEM_CLOCK, Clock, ManualClock, SystemClock
from .errors import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousStateError,
    RendezvousTimeoutError,
    StoreTimeoutError,
)
from .events import Event, EventHub, EventKind, EventStream
from .params import (
    RendezvousInfo,
    RendezvousParameters,
    RendezvousSettings,
    RendezvousStoreInfo,
    RendezvousTimeout,
    Rules,
)
from .protocol import KeyValueBackend, RendezvousBackend
from .state import NodeDesc, Op, Outcome, Reply, Request, Snapshot, Status
from .store import Store

__all__ = [
    "SYSTEM_CLOCK",
    "Clock",
    "Event",
    "EventHub",
    "EventKind",
    "EventStream",
    "KeyValueBackend",
    "ManualClock",
    "NodeDesc",
    "Op",
    "Outcome",
    "RendezvousBackend",
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousGracefulExitError",
    "RendezvousInfo",
    "RendezvousParameters",
    "RendezvousSettings",
    "RendezvousStateError",
    "RendezvousStoreInfo",
    "RendezvousTimeout",
    "RendezvousTimeoutError",
    "Reply",
    "Request",
    "Rules",
    "Snapshot",
    "Status",
    "Store",
    "StoreTimeoutError",
    "SystemClock",
]
