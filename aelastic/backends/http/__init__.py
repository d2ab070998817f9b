"""The ``http`` rendezvous backend: an aiohttp server and its client.

:mod:`.server` serves runs' state cells and key-value stores over HTTP (``create_app`` to
mount it in an aiohttp application, ``run_server`` or ``python -m
aelastic.backends.http.server`` to run it); :mod:`.client` is the backend that talks to it
(``backend="http"``). The server is imported only when asked for, so that running it as a
module does not import it twice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .client import HttpBackend, create_backend, parse_endpoint

if TYPE_CHECKING:
    from .server import create_app, run_server, serve

__all__ = ["HttpBackend", "create_app", "create_backend", "parse_endpoint", "run_server", "serve"]

_SERVER_NAMES = {"create_app", "run_server", "serve"}


def __getattr__(name: str) -> Any:
    if name in _SERVER_NAMES:
        from . import server

        return getattr(server, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
