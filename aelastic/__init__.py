"""aelastic: an asyncio-native elastic launcher for distributed PyTorch.

The rendezvous types and exceptions carry torch's names and semantics. The core never
imports torch.
"""

from .core.errors import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousLostError,
    RendezvousStateError,
    RendezvousTimeoutError,
    StoreTimeoutError,
)
from .core.params import (
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeout,
)

__version__ = "0.1.0"

__all__ = [
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousGracefulExitError",
    "RendezvousInfo",
    "RendezvousLostError",
    "RendezvousParameters",
    "RendezvousStateError",
    "RendezvousStoreInfo",
    "RendezvousTimeout",
    "RendezvousTimeoutError",
    "StoreTimeoutError",
    "__version__",
]
