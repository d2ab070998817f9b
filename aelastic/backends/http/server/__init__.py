"""The aelastic HTTP rendezvous server: runs' rendezvous state and stores over HTTP.

How it works: an aiohttp application (:func:`create_app`, mountable inside another aiohttp
application) keeps every run in memory, in its event loop, and applies the rendezvous state
machine to it (:mod:`aelastic.core.machine`), optionally keeping the runs in a journal
(:mod:`._runs`). :func:`run_server` serves it until SIGINT/SIGTERM; ``aelastic serve`` calls
it. It binds to loopback unless told otherwise. It has no TLS of its own: off a private
network, put it behind a TLS-terminating proxy (the token travels in a header).

HTTP API (routes under ``/v1``; rendezvous state format 2). Every body is a JSON object;
store values are base64 text; requests, replies, statuses and snapshots have the JSON forms
of :mod:`aelastic.core.wire`. ``{run}`` is the run id, URL-encoded (1..256 characters); keys
have up to 1024 characters, and a request names 1..4096 of them. With a token configured
(``AELASTIC_HTTP_TOKEN``) every request needs ``Authorization: Bearer <token>`` (compared
in constant time), else ``401``.

==========================================  =============================================
``GET /v1/health``                          ``200 {"ok": true, "service": ..., "api": 2}``
``POST /v1/runs/{run}/rendezvous``          a request (join, leave, close, keep_alive,
                                            status) -> ``200`` its reply
``GET /v1/runs/{run}/status``               ``200`` the run's status
``GET /v1/runs/{run}/status?token=T&wait=S`` long-poll: answers as soon as the status's token
                                            differs from ``T``, or after ``S`` s (0..300)
``GET /v1/runs/{run}``                      ``200`` the whole membership, ``404`` if none
``DELETE /v1/runs/{run}``                   forget the run: ``200 {"deleted": bool}``
``POST /v1/runs/{run}/kv/set``              ``{"key", "value": b64}`` -> ``200 {}``
``POST /v1/runs/{run}/kv/get``              ``{"keys": [..]}`` -> ``200 {"values": [b64|null]}``
``POST /v1/runs/{run}/kv/add``              ``{"key", "amount": int}`` -> ``200 {"value": int}``,
                                            ``409`` if not an integer or past 64 bits
``POST /v1/runs/{run}/kv/compare_set``      ``{"key", "expected": b64|null, "desired": b64}``
                                            -> ``200 {"value": b64}`` (torch's semantics)
``POST /v1/runs/{run}/kv/delete``           ``{"key"}`` -> ``200 {"deleted": bool}``
``POST /v1/runs/{run}/kv/wait``             ``{"keys": [..], "timeout": S}`` (0..300): answers
                                            once every key exists -> ``200 {"ready": bool}``
==========================================  =============================================

A node of the first state format asking at ``/v1/runs/{run}/state`` gets a state of format
2 and fails with an error naming both versions. Errors are ``{"error": "..."}`` with ``400``
(malformed JSON, a body or query that does not fit the schema, unknown fields), ``401``,
``404``, ``405``, ``413`` (body over ``max_body``), ``503`` (shutting down, or the journal
could not be written) or ``500``. A rejected request changes nothing. Long-polls answer
``503`` at once when the server shuts down. Runs nobody changed for ``run_ttl`` (24 h) and
nobody waits on are forgotten.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import signal
from collections.abc import Callable

from aiohttp import web

from ..wire import DEFAULT_PORT, MAX_BODY, TOKEN_ENV
from ._app import DEFAULT_RUN_TTL, create_app, resolve_token
from ._runs import PersistenceError

__all__ = [
    "DEFAULT_PORT",
    "DEFAULT_RUN_TTL",
    "PersistenceError",
    "create_app",
    "resolve_token",
    "run_server",
    "serve",
]

log = logging.getLogger("aelastic.backends.http.server")


def _url(host: str, port: int) -> str:
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    return f"http://{host}:{port}"


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


async def serve(
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    *,
    token: str | None = None,
    persist_path: str | os.PathLike[str] | None = None,
    max_body: int = MAX_BODY,
    run_ttl: float = DEFAULT_RUN_TTL,
    stop: asyncio.Event | None = None,
    ready: Callable[[str], None] | None = None,
) -> None:
    """Serve the rendezvous API until ``stop`` is set (or the task is cancelled).

    Args:
        host: Address to bind (loopback by default).
        port: Port to bind; ``0`` picks a free one.
        token, persist_path, max_body, run_ttl: As for :func:`create_app`.
        stop: Set it to shut the server down cleanly.
        ready: Called with the server's URL once it accepts connections.

    Raises:
        PersistenceError: The persistence file cannot be loaded.
        OSError: The address cannot be bound.
    """
    secret = resolve_token(token)
    app = create_app(
        token=secret or "", persist_path=persist_path, max_body=max_body, run_ttl=run_ttl
    )
    if secret is None and not _is_loopback(host):
        log.warning(
            "serving on %s without a token: anyone who can reach it can change the runs (set %s)",
            host,
            TOKEN_ENV,
        )
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0]
        url = _url(host, int(bound[1]))
        log.info("aelastic rendezvous server listening on %s", url)
        if ready is not None:
            ready(url)
        await (stop or asyncio.Event()).wait()
    finally:
        await runner.cleanup()


def run_server(
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    *,
    token: str | None = None,
    persist_path: str | os.PathLike[str] | None = None,
    max_body: int = MAX_BODY,
    run_ttl: float = DEFAULT_RUN_TTL,
) -> None:
    """Run the rendezvous server until SIGINT or SIGTERM (blocking).

    Prints ``aelastic rendezvous server listening on <url>`` on one line of stdout once it
    accepts connections (the URL is the line's last word).

    Args:
        host: Address to bind (loopback by default).
        port: Port to bind; ``0`` picks a free one.
        token: Bearer token; ``None`` reads ``AELASTIC_HTTP_TOKEN``, ``""`` disables auth.
        persist_path: JSON file keeping the runs across restarts.
        max_body: Largest request body accepted, in bytes.
        run_ttl: Seconds after which an unchanged, unwatched run is forgotten (0: never).

    Raises:
        PersistenceError: The persistence file cannot be loaded.
        OSError: The address cannot be bound.
    """

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(signum, stop.set)

        def announce(url: str) -> None:
            print(f"aelastic rendezvous server listening on {url}", flush=True)

        await serve(
            host,
            port,
            token=token,
            persist_path=persist_path,
            max_body=max_body,
            run_ttl=run_ttl,
            stop=stop,
            ready=announce,
        )

    asyncio.run(main())
