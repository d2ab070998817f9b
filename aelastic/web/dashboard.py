"""The stand-alone page server of ``aelastic dashboard``: the pages of any backend's runs.

How it works: :func:`create_dashboard_app` is an aiohttp application with the pages only
(:func:`~.pages.install_pages` over a :class:`~.sources.RunSource`, usually a
:class:`~.sources.BackendSource` reading Redis or a remote HTTP server); any other route is
a 404 JSON answer, a failure a 500 JSON answer. :func:`serve_dashboard` serves it until told
to stop; it never changes a run.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
from collections.abc import Awaitable, Callable, Sequence

from aiohttp import web

from ..backends.http.server import Clients
from . import DEFAULT_PORT
from .pages import install_pages
from .sources import RunSource

__all__ = ["DEFAULT_PORT", "create_dashboard_app", "serve_dashboard"]

log = logging.getLogger("aelastic.web")

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _errors(request: web.Request, handler: _Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return web.json_response({"error": exc.reason}, status=exc.status)
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("internal error answering %s %s", request.method, request.path)
        return web.json_response({"error": "internal server error"}, status=500)


def create_dashboard_app(
    source: RunSource, token: str | None, trusted_proxies: Sequence[str] = ()
) -> web.Application:
    """The dashboard's application: the pages of the runs ``source`` reads.

    Args:
        source: Where the runs are (closed with the application).
        token: The token the pages need (``None``: none).
        trusted_proxies: Addresses or networks of proxies whose ``X-Forwarded-*`` headers
            are believed (the client's address, HTTPS).

    Raises:
        ValueError: A trusted proxy is not an address or network.
    """
    app = web.Application(middlewares=[_errors], client_max_size=64 * 1024)
    install_pages(app, source, token, Clients(trusted_proxies))
    return app


def _url(host: str, port: int) -> str:
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    return f"http://{host}:{port}"


async def serve_dashboard(
    source: RunSource,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    *,
    token: str | None = None,
    trusted_proxies: Sequence[str] = (),
    stop: asyncio.Event | None = None,
    ready: Callable[[str], None] | None = None,
) -> None:
    """Serve the pages of ``source``'s runs until ``stop`` is set (or cancelled).

    Args:
        source: Where the runs are.
        host: Address to bind (loopback by default).
        port: Port to bind; ``0`` picks a free one.
        token: The token the pages need (``None``: none).
        trusted_proxies: As for :func:`create_dashboard_app`.
        stop: Set it to shut the server down.
        ready: Called with the URL once it accepts connections.

    Raises:
        OSError: The address cannot be bound.
    """
    app = create_dashboard_app(source, token, trusted_proxies)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=3.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, reuse_address=True)
        await site.start()
        bound = int(runner.addresses[0][1])  # port 0 picked one
        if ready is not None:
            ready(_url(host, bound))
        await (stop or asyncio.Event()).wait()
    finally:
        await runner.cleanup()
