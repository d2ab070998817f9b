"""The ``http`` rendezvous backend: an aiohttp server and its client.

:mod:`.server` serves runs' rendezvous state and stores over HTTP (``create_app`` to mount
it in an aiohttp application, ``run_server`` to run it; ``aelastic serve`` is its command
line); :mod:`.client` is the backend that talks to it (``backend="http"``); :mod:`.wire` is
what both sides agree on. Each half is imported only when asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .wire import DEFAULT_PORT

if TYPE_CHECKING:
    from .client import HttpBackend, create_backend, parse_endpoint
    from .server import create_app, run_server, serve

__all__ = [
    "DEFAULT_PORT",
    "HttpBackend",
    "create_app",
    "create_backend",
    "parse_endpoint",
    "run_server",
    "serve",
]

_LAZY = {
    "create_app": "server",
    "run_server": "server",
    "serve": "server",
    "HttpBackend": "client",
    "create_backend": "client",
    "parse_endpoint": "client",
}


def __getattr__(name: str) -> Any:
    # Imported on use: the wire constants must not need aiohttp.
    half = _LAZY.get(name)
    if half is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{half}"), name)
