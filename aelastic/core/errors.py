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
    "RendezvousLostError",
    "RendezvousStateError",
    "RendezvousTimeoutError",
    "StoreTimeoutError",
    "reason",
    "typed",
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


class RendezvousLostError(RendezvousConnectionError):
    """Raised when the rendezvous is gone for good: the node that hosted a ``static`` or
    ``c10d`` rendezvous stopped answering (nothing can answer for that run again)."""


class RendezvousStateError(RendezvousError):
    """Raised when the state of a rendezvous is corrupt, foreign or of an unknown format."""


class RendezvousGracefulExitError(RendezvousError):
    """Raised when a node was not admitted to the rendezvous and exits gracefully.

    Like torch's, this is a way to unwind the stack, not a failure.
    """


class StoreTimeoutError(RendezvousTimeoutError, TimeoutError):
    """Raised when a key-value store wait (``get``, ``wait``) runs out of time."""


def reason(exc: BaseException) -> str:
    """What an error line says of ``exc``: its text, or its type's name when the text is
    empty (``TimeoutError()``, ``CancelledError()``, a bare ``OSError()`` say nothing)."""
    return str(exc) or type(exc).__name__


def typed(exc: BaseException) -> str:
    """``"TypeName: text"``, or the type's name alone when the text is empty."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
