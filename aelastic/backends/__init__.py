"""Rendezvous backends: where the shared state and the members' store live.

``memory`` (embedded default), ``redis`` and ``http``; more through the
``aelastic.backends`` entry-point group or :func:`register_backend`. The rows of
:data:`BUILTINS` describe the built-ins.
"""

from ..core.protocol import KeyValueBackend, RendezvousBackend
from ..core.token import NO_STATE, Token
from .registry import (
    BUILTINS,
    BackendInfo,
    backend_info,
    backend_names,
    create_backend,
    register_backend,
)

__all__ = [
    "BUILTINS",
    "NO_STATE",
    "BackendInfo",
    "KeyValueBackend",
    "RendezvousBackend",
    "Token",
    "backend_info",
    "backend_names",
    "create_backend",
    "register_backend",
]
