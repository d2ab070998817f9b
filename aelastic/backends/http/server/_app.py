"""The aiohttp application of the rendezvous server: middlewares, limits, lifetime.

How it works: two middlewares wrap every route (:mod:`._routes`). The outer one turns every
failure into a JSON ``{"error": ...}`` answer with the right status (a bug gives 500, never a
dropped connection; a limit's refusal its own status and ``Retry-After``); the inner one
checks the bearer token (constant-time compare) and keeps its scope, every run or the runs
of one id prefix (:mod:`._tenancy.scopes`: a scoped token's request for another run is
refused ``403``), after asking the client's failed checks whether it must wait first
(``429``: :mod:`._throttle`). Store writes may carry an ``Idempotency-Key``: a retry of one
that was applied gets the first answer again instead of applying twice (:class:`Replays`).
Joins that add a node are counted per client (:mod:`._quota`), requests that make a run per
client and per scoped token (:mod:`._tenancy.creations`), store writes against the stores'
limits (:mod:`._tenancy.sizes`). A background task forgets runs idle for ``run_ttl``, and
abandoned ones (no live node, nobody changed or read them) after ``quotas.empty_run_ttl``
(and the nodes and runs per client that went).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

from aiohttp import web

from ..._engine import Engine
from ..wire import MAX_BODY, TOKEN_ENV, SchemaError
from ._answer import failure
from ._channel import add_channel
from ._clients import CLIENTS, Clients
from ._guard import DEFAULT_KEEPALIVE_TIMEOUT, DEFAULT_READ_TIMEOUT, RateLimitedLog
from ._metrics import install as install_metrics
from ._operator import HAS_TOKEN
from ._quota import DEFAULT_MAX_NODES_PER_CLIENT, QUOTA, NodeQuota, NodeQuotaError
from ._routes import BODY_TIMEOUT, REPLAYS, STORE, Replays, add_routes
from ._runs import PersistenceError, RunLimitError, RunStore
from ._tenancy import (
    RUN_QUOTA,
    SCOPE,
    STORE_QUOTA,
    Quotas,
    Refused,
    RunQuota,
    Scope,
    Scopes,
    StoreQuota,
    check_route,
    load_scoped_tokens,
)
from ._throttle import THROTTLE, AuthThrottle

__all__ = [
    "DEFAULT_MAX_RUNS",
    "DEFAULT_RUN_TTL",
    "OWN_AUTH",
    "Pages",
    "create_app",
    "resolve_token",
    "too_many_failures",
]

log = logging.getLogger("aelastic.backends.http.server")

#: Runs nobody changed (or read the store of) for this long (seconds) are forgotten.
DEFAULT_RUN_TTL = 24 * 3600.0
#: Runs a server keeps at most; a request that would add one more gets ``503``.
DEFAULT_MAX_RUNS = 10_000
#: Seconds between two sweeps for forgotten runs, at most.
_SWEEP_EVERY = 60.0

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
#: Adds pages to the application: called with it, the runs and the token (``aelastic serve``
#: passes :func:`aelastic.web.pages.serve_pages`; this layer knows nothing of them).
Pages = Callable[[web.Application, Engine, "str | None"], object]
#: A route whose handler has this attribute set checks the token itself (the pages: a
#: session cookie or the bearer header); the bearer check lets it through.
OWN_AUTH = "aelastic_checks_token"


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def _errors_middleware() -> Any:
    at_limit = RateLimitedLog("refused %d request(s) for new runs: %s")

    @web.middleware
    async def errors(request: web.Request, handler: _Handler) -> web.StreamResponse:
        try:
            return await _answer(request, handler)
        except RunLimitError as exc:
            at_limit.note(exc)
            return _error(503, str(exc))

    return errors


async def _answer(request: web.Request, handler: _Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except (SchemaError, PersistenceError) as exc:
        known = failure(exc)
        assert known is not None
        return _error(*known)
    except NodeQuotaError as exc:
        return _error(429, str(exc))
    except Refused as exc:
        return web.json_response({"error": str(exc)}, status=exc.status, headers=exc.headers())
    except web.HTTPRequestTimeout as exc:
        response = _error(408, exc.text or "the request body came too slowly")
        response.force_close()  # what is left of the body is not worth reading
        return response
    except web.HTTPRequestEntityTooLarge as exc:
        return _error(413, f"the request body is too large ({exc.text})")
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error(exc.status, exc.reason)
    except (asyncio.CancelledError, RunLimitError):
        raise  # a full server is answered (and logged, rate-limited) one level up
    except ConnectionError as exc:  # the client went away, e.g. in a WebSocket's handshake
        log.debug("the client of %s %s went away: %s", request.method, request.path, exc)
        return _error(400, "the connection was lost")  # nobody reads it: aiohttp drops it
    except Exception:
        log.exception("internal error answering %s %s", request.method, request.path)
        return _error(500, "internal server error")


def too_many_failures(wait: float) -> web.Response:
    """The ``429`` of a client that must wait ``wait`` seconds before its token is checked."""
    seconds = max(math.ceil(wait), 1)
    return web.json_response(
        {"error": f"too many failed token checks from this client: retry in {seconds} s"},
        status=429,
        headers={"Retry-After": str(seconds)},
    )


def _auth_middleware(scopes: Scopes, clients: Clients, throttle: AuthThrottle) -> Any:
    @web.middleware
    async def auth(request: web.Request, handler: _Handler) -> web.StreamResponse:
        if getattr(request.match_info.handler, OWN_AUTH, False):
            return await handler(request)
        connection = request.transport
        if throttle.tracking and not throttle.vouched(connection):
            wait = throttle.wait(clients.key(request), "bearer")
            if wait:
                return too_many_failures(wait)
        header = request.headers.get("Authorization")
        scope = scopes.resolve(header)
        if scope is None:
            if header is not None:  # a guess (none guesses nothing: a 401, not counted)
                throttle.failed(clients.key(request), "bearer", connection)
            return web.json_response(
                {"error": "unauthorized: a valid 'Authorization: Bearer <token>' is required"},
                status=401,
                headers={"WWW-Authenticate": 'Bearer realm="aelastic"'},
            )
        if not clients.proxied(request):  # a proxy's connection carries other clients too
            throttle.vouch(connection)
        request[SCOPE] = scope
        check_route(request, scope)  # a scoped token: its runs' routes only
        return await handler(request)

    return auth


def resolve_token(token: str | None) -> str | None:
    """``token`` itself, or the ``AELASTIC_HTTP_TOKEN`` environment variable when ``None``.

    An empty string means no authentication.

    Raises:
        ValueError: The token has leading or trailing whitespace (HTTP strips it from the
            header, so it could never match).
    """
    if token is None:
        token = os.environ.get(TOKEN_ENV) or None
    if token and token != token.strip():
        raise ValueError(
            f"the token ({TOKEN_ENV} or --token) has leading or trailing whitespace; "
            "remove it (HTTP headers cannot carry it, so no client could authenticate)"
        )
    return token or None


def create_app(
    *,
    token: str | None = None,
    persist_path: str | os.PathLike[str] | None = None,
    max_body: int = MAX_BODY,
    run_ttl: float = DEFAULT_RUN_TTL,
    max_runs: int = DEFAULT_MAX_RUNS,
    read_timeout: float = DEFAULT_READ_TIMEOUT,
    keepalive_timeout: float = DEFAULT_KEEPALIVE_TIMEOUT,
    trusted_proxies: Sequence[str] = (),
    max_nodes_per_client: int = DEFAULT_MAX_NODES_PER_CLIENT,
    pages: Pages | None = None,
    scoped_tokens: str | os.PathLike[str] | Mapping[str, Scope] | None = None,
    quotas: Quotas | None = None,
) -> web.Application:
    """Create the rendezvous server's aiohttp application (mountable with ``add_subapp``).

    Args:
        token: Bearer token every request must carry; ``None`` reads ``AELASTIC_HTTP_TOKEN``
            from the environment, ``""`` disables authentication.
        persist_path: JSON file keeping the runs across restarts (``None``: memory only).
        max_body: Largest request body accepted, in bytes (larger: ``413``).
        run_ttl: Seconds after which a run nobody changed, read the store of, or waits on is
            forgotten (``0``: never).
        max_runs: Runs kept at most (``0``: no limit); a request that would add one more
            gets ``503``, the runs already there keep working.
        read_timeout: Seconds a request's body may take to arrive (else ``408``).
        keepalive_timeout: Seconds a rendezvous channel (WebSocket) that carries nothing
            stays open, as an idle connection between requests.
        trusted_proxies: Addresses or networks of proxies whose ``X-Forwarded-For``,
            ``-Proto`` and ``-Host`` name the client (:mod:`._clients`).
        max_nodes_per_client: Nodes one client (not on loopback) may have in the runs at
            once; a join past it gets ``429`` (``0``: no limit).
        pages: Adds the pages (``/``, ``/runs/<run id>``) showing the runs.
        scoped_tokens: Tokens scoped to a run-id prefix, or a file of them, one ``TOKEN
            PREFIX`` a line (:func:`._tenancy.load_scoped_tokens`); needs ``token``.
        quotas: The limits of runs per client and per scoped token, of the stores, and the
            time after which an abandoned run is forgotten (``None``: the defaults).

    Returns:
        The application; its API lives under ``/v1``.

    Raises:
        PersistenceError: ``persist_path`` exists but is not a valid runs file.
        ValueError: ``max_body``, ``run_ttl``, ``max_runs``, ``read_timeout``,
            ``keepalive_timeout`` or ``max_nodes_per_client`` is out of range, a trusted
            proxy is not an address or network, or the scoped tokens file cannot be read,
            has a bad line, or is given to a server without a token.
    """
    if max_body < 1024:
        raise ValueError(f"max_body ({max_body}) must be at least 1024 bytes")
    if not run_ttl >= 0:
        raise ValueError(f"run_ttl ({run_ttl}) must be a non-negative number of seconds")
    if max_runs < 0:
        raise ValueError(f"max_runs ({max_runs}) must be a non-negative number (0: no limit)")
    for name, value in (("read_timeout", read_timeout), ("keepalive_timeout", keepalive_timeout)):
        if not 0 < value < math.inf:
            raise ValueError(f"{name} ({value}) must be a positive number of seconds")
    secret = resolve_token(token)
    quotas = quotas or Quotas()
    listed = scoped_tokens
    if listed is not None and not isinstance(listed, Mapping):
        listed = load_scoped_tokens(listed)
    scopes = Scopes(secret, listed)
    clients = Clients(trusted_proxies)
    throttle = AuthThrottle()
    middlewares: list[Any] = [_errors_middleware()]
    if secret is not None:
        middlewares.append(_auth_middleware(scopes, clients, throttle))
    app = web.Application(client_max_size=max_body, middlewares=middlewares)
    store = RunStore(persist_path, max_runs=max_runs)
    quota = NodeQuota(store.engine, max_nodes_per_client, clients)
    runs_quota = RunQuota(store, quotas, clients)
    app[STORE] = store
    app[RUN_QUOTA] = runs_quota
    app[STORE_QUOTA] = StoreQuota(store.engine, quotas, runs_quota)
    app[CLIENTS] = clients
    app[THROTTLE] = throttle
    app[QUOTA] = quota
    app[HAS_TOKEN] = secret is not None
    app[REPLAYS] = Replays()
    app[BODY_TIMEOUT] = read_timeout

    async def on_shutdown(app: web.Application) -> None:
        store.close()  # first: held requests answer, then the channels close

    app.on_shutdown.append(on_shutdown)
    add_routes(app)
    add_channel(app, store, max_body, keepalive_timeout)
    install_metrics(app, store)
    if pages is not None:
        pages(app, store.engine, secret)

    async def lifetime(app: web.Application) -> AsyncIterator[None]:
        sweep = _sweep(store, quota, runs_quota, run_ttl, quotas.empty_run_ttl)
        sweeper = asyncio.get_running_loop().create_task(sweep)
        yield
        sweeper.cancel()
        throttle.close()
        with contextlib.suppress(asyncio.CancelledError):
            await sweeper
        with contextlib.suppress(PersistenceError):
            await store.durable()

    app.cleanup_ctx.append(lifetime)
    return app


def loop_time() -> float:
    return time.monotonic()


async def _sweep(
    store: RunStore, quota: NodeQuota, runs_quota: RunQuota, ttl: float, empty_ttl: float
) -> None:
    every = min([t / 4 for t in (ttl, empty_ttl) if t] + [_SWEEP_EVERY])
    while True:
        await asyncio.sleep(every)
        expired = store.expire(ttl or math.inf, loop_time(), empty_ttl or math.inf)
        quota.sweep()
        runs_quota.sweep()
        if expired:
            with contextlib.suppress(PersistenceError):
                await store.durable()
