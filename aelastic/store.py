"""The key-value store the members of a rendezvous round share (see :mod:`aelastic.core.store`)."""

from .core.store import DEFAULT_STORE_TIMEOUT, Store

__all__ = ["DEFAULT_STORE_TIMEOUT", "Store"]
