"""Rendezvous backends: where the shared state and the members' store live.

``memory`` (embedded default), ``redis`` and ``http``; more through the
``aelastic.backends`` entry-point group or :func:`register_backend`.
"""

from .base import NO_STATE, KeyValueBackend, RendezvousBackend, Token
from .registry import backend_names, create_backend, register_backend

__all__ = [
    "NO_STATE",
    "KeyValueBackend",
    "RendezvousBackend",
    "Token",
    "backend_names",
    "create_backend",
    "register_backend",
]
