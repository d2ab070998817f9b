"""The rendezvous exceptions, with torch's names (``torch.distributed.elastic.rendezvous``).

Every error a rendezvous raises derives from :class:`RendezvousError`; the store's timeout
is also a ``TimeoutError``.
"""

from __future__ import annotations

__all__ = [
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousGracefulExitError",
    "RendezvousStateError",
    "RendezvousTimeoutError",
    "StoreTimeoutError",
]


class RendezvousError(Exception):
    """Base type for rendezvous errors."""


class RendezvousClosedError(RendezvousError):
    """Raised when a rendezvous is closed.

    Attributes:
        reopens_in: Seconds until a new job can use the closed run's id (``None``: not
            known, or some of its nodes are still in it).
    """

    reopens_in: float | None = None


class RendezvousTimeoutError(RendezvousError):
    """Raised when a rendezvous did not complete on time."""


class RendezvousConnectionError(RendezvousError):
    """Raised when the connection to a rendezvous backend has failed."""


class RendezvousStateError(RendezvousError):
    """Raised when the state of a rendezvous is corrupt, foreign or of an unknown format."""


class RendezvousGracefulExitError(RendezvousError):
    """Raised when a node was not admitted to the rendezvous and exits gracefully.

    Like torch's, this is a way to unwind the stack, not a failure.
    """


class StoreTimeoutError(RendezvousTimeoutError, TimeoutError):
    """Raised when a key-value store wait (``get``, ``wait``) runs out of time."""
