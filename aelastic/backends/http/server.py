"""The aelastic HTTP rendezvous server: runs' state cells and key-value stores over HTTP.

How it works: an aiohttp application (:func:`create_app`, mountable inside another aiohttp
application) keeps every run in memory, in its event loop, optionally persisted to a JSON
file (a group commit: each answer waits until the snapshot holding its change is on disk).
:func:`run_server` serves it until SIGINT/SIGTERM; ``python -m aelastic.backends.http.server``
(and ``aelastic serve``) call it. It binds to loopback unless told otherwise.

HTTP API (version 1). Every body, request and answer, is a JSON object; bytes are base64
text. ``{run}`` is the run id, URL-encoded (1..256 characters); keys have up to 1024
characters (no NUL), and a request names 1..4096 of them. With a token configured
(``token=`` or ``AELASTIC_HTTP_TOKEN``) every request needs ``Authorization: Bearer <token>``
(compared in constant time), else ``401``. Mutating requests may carry an
``Idempotency-Key`` header (up to 128 characters): a retry of a request already applied gets
the first answer again.

==========================================  =============================================
``GET /v1/health``                          ``200 {"ok": true, "service": ..., "api": 1}``
``GET /v1/runs/{run}/state``                ``200 {"state": b64 | null, "token": str}``
``GET /v1/runs/{run}/state?token=T&wait=S`` long-poll: answers as soon as the token differs
                                            from ``T``, or after ``S`` seconds (0..300),
                                            with the same body as a plain read
``PUT /v1/runs/{run}/state``                ``{"state": b64, "token": T}``: compare-and-set.
                                            ``200 {"token": new}`` if the stored token was
                                            ``T`` (``""``: no state yet), else
                                            ``409 {"state": b64|null, "token": current,
                                            "error": ...}``
``DELETE /v1/runs/{run}``                   forget the run: ``200 {"deleted": bool}``
``POST /v1/runs/{run}/kv/set``              ``{"key", "value": b64}`` -> ``200 {}``
``POST /v1/runs/{run}/kv/get``              ``{"keys": [..]}`` -> ``200 {"values": [b64|null]}``
``POST /v1/runs/{run}/kv/add``              ``{"key", "amount": int}`` -> ``200 {"value": int}``,
                                            ``409`` if the stored value is not an integer
``POST /v1/runs/{run}/kv/compare_set``      ``{"key", "expected": b64|null, "desired": b64}``
                                            -> ``200 {"value": b64}`` (torch's semantics)
``POST /v1/runs/{run}/kv/delete``           ``{"key"}`` -> ``200 {"deleted": bool}``
``POST /v1/runs/{run}/kv/wait``             ``{"keys": [..], "timeout": S}`` (0..300): answers
                                            once every key exists -> ``200 {"ready": bool}``
==========================================  =============================================

Tokens are ``"<epoch>.<version>"``: the epoch is random, drawn when a run's state is created,
so a token never comes back after the state was lost (restart without persistence, delete).
Errors are ``{"error": "..."}`` with ``400`` (malformed JSON, a body or query that does not
fit the schema, unknown fields), ``401``, ``404`` (no such route), ``405``, ``413`` (body over
``max_body``, 4 MiB by default), ``503`` (shutting down, or the persistence file could not be
written) or ``500``. A rejected request changes nothing. Long-polls answer ``503`` at once when
the server shuts down, so clients retry against the restarted server. Runs nobody changed
for ``run_ttl`` (24 h) and nobody waits on are forgotten.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence

from aiohttp import web

from ._app import DEFAULT_RUN_TTL, create_app, resolve_token
from ._runs import PersistenceError
from .wire import MAX_BODY, TOKEN_ENV

__all__ = ["DEFAULT_PORT", "PersistenceError", "create_app", "main", "run_server", "serve"]

log = logging.getLogger("aelastic.backends.http.server")

#: The default port (torchrun's default rendezvous port).
DEFAULT_PORT = 29400


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


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``python -m aelastic.backends.http.server [--host] [--port] [--persist]``.

    The token is read from ``AELASTIC_HTTP_TOKEN`` (never from the command line).

    Returns:
        The exit status (0 after a clean stop, 1 if it cannot bind, 2 on a bad persist file).
    """
    parser = argparse.ArgumentParser(
        prog="python -m aelastic.backends.http.server",
        description="Serve aelastic rendezvous state over HTTP "
        f"(bearer token from ${TOKEN_ENV} if set).",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (0: pick a free one)")
    parser.add_argument("--persist", metavar="FILE", help="keep the runs in FILE across restarts")
    parser.add_argument("--max-body", type=int, default=MAX_BODY, help="largest body (bytes)")
    parser.add_argument(
        "--run-ttl", type=float, default=DEFAULT_RUN_TTL, help="forget idle runs (s, 0: never)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        run_server(
            args.host,
            args.port,
            persist_path=args.persist,
            max_body=args.max_body,
            run_ttl=args.run_ttl,
        )
    except PersistenceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"error: cannot serve on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
