"""The aelastic HTTP rendezvous server: runs' rendezvous state and stores over HTTP.

How it works: an aiohttp application (:func:`create_app`, mountable inside another aiohttp
application) keeps every run in memory, in its event loop, and applies the rendezvous state
machine to it (:mod:`aelastic.core.machine`), optionally keeping the runs in a journal
(:mod:`._runs`). :func:`run_server` serves it until SIGINT/SIGTERM; ``aelastic serve`` calls
it. It binds to loopback unless told otherwise. It has no TLS of its own: off a private
network, put it behind a TLS-terminating proxy (the token travels in a header). Given a
``pages`` hook (``aelastic serve`` passes :func:`aelastic.web.pages.serve_pages`), it also
serves the live pages of its runs at ``/`` and ``/runs/{run}`` (their own token check:
a session cookie or the bearer header).

HTTP API (routes under ``/v1``; rendezvous state format 2). Every body is a JSON object;
store values are base64 text; requests, replies, statuses and snapshots have the JSON forms
of :mod:`aelastic.core.wire`. ``{run}`` is the run id, URL-encoded (1..256 characters); keys
have up to 1024 characters, and a request names 1..4096 of them. With a token configured
(``AELASTIC_HTTP_TOKEN``) every request needs ``Authorization: Bearer <token>`` (compared
in constant time), else ``401``. A rendezvous request acts only for its node: it carries the
node's secret, and one for a node listed under another secret changes nothing (the reply's
outcome is ``error_forbidden``). Closing and deleting a run are the operator's: on a server
without a token only from its own machine (loopback, not forwarded by a proxy), else ``403``.

==========================================  =============================================
``GET /v1/health``                          ``200 {"ok": true, "service": ..., "api": 2}``
``GET /v1/runs?limit=N``                    ``200 {"runs": [{"run_id", "status"}, ..]}``: the
                                            runs with a rendezvous state, sorted by id, at
                                            most ``N`` (1..10000, default 1000)
``POST /v1/runs/{run}/rendezvous``          a request (join, leave, close, keep_alive,
                                            status) -> ``200`` its reply
``GET /v1/runs/{run}/status``               ``200`` the run's status
``GET /v1/runs/{run}/status?token=T&wait=S`` long-poll: answers as soon as the status's token
                                            differs from ``T``, or after ``S`` s (0..300)
``GET /v1/runs/{run}``                      ``200`` the whole membership, ``404`` if none
``DELETE /v1/runs/{run}``                   forget the run: ``200 {"deleted": bool}``
                                            (operator: see below)
``POST /v1/runs/{run}/close``               ``{}`` -> ``200 {"closed": bool, "status"}``:
                                            close the run for its operator
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
``403`` (a scoped token's request for another run or a server-wide route; the operator's
routes without a token, from elsewhere), ``404``, ``405``, ``408`` (the body came too
slowly), ``413`` (body over ``max_body``; a store value, a run's store or all of them past
their limits), ``429`` (the client sent too many wrong tokens and must wait,
``Retry-After``; a join past the client's ``max_nodes_per_client``; a new run past its
client's or scoped token's quota of runs), ``503`` (shutting down, the journal could not be
written, the limit of runs) or ``500``.
A rejected request changes nothing. Long-polls answer ``503`` at once when the server shuts
down. Runs nobody changed (or read the store of) for ``run_ttl`` (24 h) and nobody waits on
are forgotten; so are abandoned runs (no live node in them, nobody changed them or read
their store) after ``quotas.empty_run_ttl`` (5 min).

Scoped tokens (:mod:`._tenancy`): besides the server's own token (every run: the
operator's), a token minted for a run-id prefix (:func:`mint`; ``aelastic serve
--mint-token PREFIX``) or listed with one (``scoped_tokens``, a file of ``TOKEN PREFIX``
lines) reaches only the runs whose id starts with that prefix.

Limits (:func:`serve`): a request that would make a run past ``max_runs`` gets ``503``
(the runs already there keep working); a client must send a request's head within
``read_timeout`` of connecting and its body within ``read_timeout`` after that (``408``),
else it is dropped; an idle connection (or rendezvous channel) is closed after
``keepalive_timeout``; past ``max_connections`` a new connection is answered ``503`` and
closed (:mod:`._guard`). Per client (its address, or the one a trusted proxy names:
:mod:`._clients`): wrong tokens (:mod:`._throttle`) and nodes in the runs (:mod:`._quota`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
from collections.abc import Callable, Mapping, Sequence

from aiohttp import web

from ....core._signals import stop_on_signals
from ..wire import DEFAULT_PORT, MAX_BODY, TOKEN_ENV
from ._app import (
    DEFAULT_MAX_RUNS,
    DEFAULT_RUN_TTL,
    OWN_AUTH,
    Pages,
    create_app,
    resolve_token,
    too_many_failures,
)
from ._clients import CLIENTS, Clients, parse_networks
from ._guard import (
    BACKLOG,
    DEFAULT_KEEPALIVE_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_READ_TIMEOUT,
    ConnectionGuard,
    connection_limit,
    quiet_accept_errors,
    raise_open_file_limit,
)
from ._loop import resolve as resolve_loop
from ._loop import run as run_loop
from ._operator import is_loopback
from ._quota import DEFAULT_MAX_NODES_PER_CLIENT
from ._runs import PersistenceError
from ._tenancy import Quotas, Refused, Scope, load_scoped_tokens, mint, read_token_file
from ._throttle import THROTTLE, AuthThrottle

__all__ = [
    "CLIENTS",
    "DEFAULT_KEEPALIVE_TIMEOUT",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_NODES_PER_CLIENT",
    "DEFAULT_MAX_RUNS",
    "DEFAULT_PORT",
    "DEFAULT_READ_TIMEOUT",
    "DEFAULT_RUN_TTL",
    "OWN_AUTH",
    "THROTTLE",
    "AuthThrottle",
    "Clients",
    "Pages",
    "PersistenceError",
    "Quotas",
    "Refused",
    "Scope",
    "create_app",
    "is_loopback",
    "load_scoped_tokens",
    "mint",
    "parse_networks",
    "read_token_file",
    "resolve_loop",
    "resolve_token",
    "run_server",
    "serve",
    "too_many_failures",
]

log = logging.getLogger("aelastic.backends.http.server")


def _url(host: str, port: int) -> str:
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    return f"http://{host}:{port}"


async def serve(
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    *,
    token: str | None = None,
    persist_path: str | os.PathLike[str] | None = None,
    max_body: int = MAX_BODY,
    run_ttl: float = DEFAULT_RUN_TTL,
    max_runs: int = DEFAULT_MAX_RUNS,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    read_timeout: float = DEFAULT_READ_TIMEOUT,
    keepalive_timeout: float = DEFAULT_KEEPALIVE_TIMEOUT,
    trusted_proxies: Sequence[str] = (),
    max_nodes_per_client: int = DEFAULT_MAX_NODES_PER_CLIENT,
    stop: asyncio.Event | None = None,
    ready: Callable[[str], None] | None = None,
    pages: Pages | None = None,
    scoped_tokens: str | os.PathLike[str] | Mapping[str, Scope] | None = None,
    quotas: Quotas | None = None,
) -> None:
    """Serve the rendezvous API until ``stop`` is set (or the task is cancelled).

    Args:
        host: Address to bind (loopback by default).
        port: Port to bind; ``0`` picks a free one.
        token, persist_path, max_body, run_ttl, max_runs, trusted_proxies,
            max_nodes_per_client, pages, scoped_tokens, quotas: As for :func:`create_app`.
        max_connections: Open connections held at most (lowered to fit the open-file
            limit); past it a new connection is answered ``503`` and closed.
        read_timeout: Seconds a client has to send a request's head (from its connect, or
            from the first byte of a later request), and then its body.
        keepalive_timeout: Seconds an idle connection stays open between requests (and an
            idle rendezvous channel).
        stop: Set it to shut the server down cleanly.
        ready: Called with the server's URL once it accepts connections.

    Raises:
        PersistenceError: The persistence file cannot be loaded.
        OSError: The address cannot be bound.
        ValueError: A limit or timeout is out of range, or the scoped tokens file is bad.
    """
    secret = resolve_token(token)
    app = create_app(
        token=secret or "",
        persist_path=persist_path,
        max_body=max_body,
        run_ttl=run_ttl,
        max_runs=max_runs,
        read_timeout=read_timeout,
        keepalive_timeout=keepalive_timeout,
        trusted_proxies=trusted_proxies,
        max_nodes_per_client=max_nodes_per_client,
        pages=pages,
        scoped_tokens=scoped_tokens,
        quotas=quotas,
    )
    if secret is None and not is_loopback(host):
        log.warning(
            "serving on %s without a token: anyone who can reach it can change the runs (set %s)",
            host,
            TOKEN_ENV,
        )
    guard = ConnectionGuard(
        max_connections=connection_limit(max_connections),
        read_timeout=read_timeout,
        keepalive_timeout=keepalive_timeout,
    )
    app.middlewares.insert(0, guard.middleware)  # before runner.setup() freezes them
    # aiohttp's own keep-alive timer only backs up the guard's (which decides first).
    backstop = keepalive_timeout + read_timeout + 1.0
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=5.0, keepalive_timeout=backstop)
    loop = asyncio.get_running_loop()
    restore = quiet_accept_errors(loop)
    listener: asyncio.AbstractServer | None = None
    try:
        await runner.setup()
        assert runner.server is not None
        factory = guard.factory(runner.server)
        listener = await loop.create_server(
            factory, host, port, backlog=BACKLOG, reuse_address=True
        )
        bound = listener.sockets[0].getsockname()
        url = _url(host, int(bound[1]))
        log.info("aelastic rendezvous server listening on %s", url)
        if ready is not None:
            ready(url)
        await (stop or asyncio.Event()).wait()
    finally:
        if listener is not None:
            listener.close()  # accept no more; the open connections end below
        await runner.cleanup()
        guard.close()
        restore()


def run_server(
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    *,
    token: str | None = None,
    persist_path: str | os.PathLike[str] | None = None,
    max_body: int = MAX_BODY,
    run_ttl: float = DEFAULT_RUN_TTL,
    max_runs: int = DEFAULT_MAX_RUNS,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    read_timeout: float = DEFAULT_READ_TIMEOUT,
    keepalive_timeout: float = DEFAULT_KEEPALIVE_TIMEOUT,
    trusted_proxies: Sequence[str] = (),
    max_nodes_per_client: int = DEFAULT_MAX_NODES_PER_CLIENT,
    pages: Pages | None = None,
    loop: str = "auto",
    scoped_tokens: str | os.PathLike[str] | Mapping[str, Scope] | None = None,
    quotas: Quotas | None = None,
) -> None:
    """Run the rendezvous server until SIGINT or SIGTERM (blocking).

    Lifts the process's soft open-file limit to its hard limit first. Prints ``aelastic
    rendezvous server listening on <url>`` on one line of stdout once it accepts
    connections (the URL is the line's last word).

    Args:
        host: Address to bind (loopback by default).
        port: Port to bind; ``0`` picks a free one.
        token: Bearer token; ``None`` reads ``AELASTIC_HTTP_TOKEN``, ``""`` disables auth.
        persist_path: JSON file keeping the runs across restarts.
        max_body: Largest request body accepted, in bytes.
        run_ttl: Seconds after which an unchanged, unwatched run is forgotten (0: never).
        max_runs, max_connections, read_timeout, keepalive_timeout, trusted_proxies,
            max_nodes_per_client, pages, scoped_tokens, quotas: As for :func:`serve`.
        loop: The event loop: ``auto`` (uvloop when it is installed), ``asyncio`` or
            ``uvloop``.

    Raises:
        PersistenceError: The persistence file cannot be loaded.
        OSError: The address cannot be bound.
        ValueError: A limit or timeout is out of range, the loop is unknown or missing, or
            the scoped tokens file is bad.
    """
    resolve_loop(loop)
    raise_open_file_limit()

    async def main() -> None:
        stop = stop_on_signals()

        def announce(url: str) -> None:
            print(f"aelastic rendezvous server listening on {url}", flush=True)

        await serve(
            host,
            port,
            token=token,
            persist_path=persist_path,
            max_body=max_body,
            run_ttl=run_ttl,
            max_runs=max_runs,
            max_connections=max_connections,
            read_timeout=read_timeout,
            keepalive_timeout=keepalive_timeout,
            trusted_proxies=trusted_proxies,
            max_nodes_per_client=max_nodes_per_client,
            stop=stop,
            ready=announce,
            pages=pages,
            scoped_tokens=scoped_tokens,
            quotas=quotas,
        )

    run_loop(main(), loop)
