"""``aelastic serve``: run the HTTP rendezvous server (``--rdzv-backend http``).

How it works: parses the flags and hands over to
:func:`aelastic.backends.http.server.run_server`, which serves until SIGINT or SIGTERM and
prints ``aelastic rendezvous server listening on <url>`` once it accepts connections. It
serves the live pages of its runs too (``/``, ``/runs/<run id>``: :mod:`aelastic.web`). The
bearer token is read from ``AELASTIC_HTTP_TOKEN`` (never from the command line, where other
users of the machine could read it); nodes send the same variable. The server has no TLS
of its own: off a private network, put it behind a TLS-terminating proxy.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from ..backends.http.wire import DEFAULT_PORT
from .options import UsageError
from .rules import UsageParser

__all__ = ["build_parser", "main"]


def build_parser(prog: str = "aelastic serve") -> argparse.ArgumentParser:
    """The parser of ``aelastic serve``."""
    p = UsageParser(
        prog=prog,
        description="Serve aelastic rendezvous state over HTTP, and live pages of its runs at "
        "http://HOST:PORT/ (token from $AELASTIC_HTTP_TOKEN when set).",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (default 29400; 0: any)")
    p.add_argument("--persist", metavar="FILE", help="keep the runs in FILE across restarts")
    p.add_argument(
        "--run-ttl", type=float, default=None, help="forget runs idle this long (s; 0: never)"
    )
    p.add_argument(
        "--max-body", type=int, default=None, help="largest request body in bytes (default 4 MiB)"
    )
    p.add_argument(
        "--max-runs",
        type=int,
        default=None,
        help="runs kept at most; a new one past it gets 503 (default 10000; 0: no limit)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="open connections held at most (default 10000, lowered to fit ulimit -n)",
    )
    p.add_argument(
        "--read-timeout",
        type=float,
        default=None,
        help="seconds a client has to send a request's head, then its body (default 10)",
    )
    p.add_argument(
        "--keepalive-timeout",
        type=float,
        default=None,
        help="seconds an idle connection stays open between requests (default 30)",
    )
    p.add_argument(
        "--trusted-proxy",
        metavar="ADDRESS",
        action="append",
        default=[],
        help="a proxy (address or network; repeat or comma-separate) whose X-Forwarded-For, "
        "-Proto and -Host are believed: the client's address, HTTPS (Secure cookie)",
    )
    p.add_argument(
        "--max-nodes-per-client",
        type=int,
        default=None,
        help="nodes one client address may have in the runs; a join past it gets 429 "
        "(default 1024; loopback clients exempt; 0: no limit)",
    )
    p.add_argument(
        "--loop",
        choices=("auto", "asyncio", "uvloop"),
        default="auto",
        help="event loop (default auto: uvloop when installed, else asyncio's)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log the server's info lines")
    return p


def trusted_proxies(values: Sequence[str]) -> list[str]:
    """The ``--trusted-proxy`` values, split at commas and checked.

    Raises:
        UsageError: A value is not an address or network.
    """
    from ..backends.http.server import parse_networks

    proxies = [part.strip() for value in values for part in value.split(",") if part.strip()]
    try:
        parse_networks(proxies)
    except ValueError as exc:
        raise UsageError(f"--trusted-proxy: {exc}") from None
    return proxies


def main(argv: Sequence[str]) -> int:
    """Run ``aelastic serve`` until SIGINT/SIGTERM; the exit code.

    Raises:
        UsageError: Bad flags (exit code 2).
    """
    args = build_parser().parse_args(list(argv))
    if not 0 <= args.port < 65536:
        raise UsageError(f"--port {args.port} is not a port number")
    if args.run_ttl is not None and not args.run_ttl >= 0:
        raise UsageError("--run-ttl must be >= 0")
    if args.max_body is not None and args.max_body < 1024:
        raise UsageError("--max-body must be at least 1024 bytes")
    if args.max_runs is not None and args.max_runs < 0:
        raise UsageError("--max-runs must be >= 0 (0: no limit)")
    if args.max_connections is not None and args.max_connections < 1:
        raise UsageError("--max-connections must be at least 1")
    if args.max_nodes_per_client is not None and args.max_nodes_per_client < 0:
        raise UsageError("--max-nodes-per-client must be >= 0 (0: no limit)")
    for flag in ("read_timeout", "keepalive_timeout"):
        value = getattr(args, flag)
        if value is not None and not 0 < value < float("inf"):
            raise UsageError(f"--{flag.replace('_', '-')} must be a positive number of seconds")
    try:
        from ..backends.http.server import (
            PersistenceError,
            resolve_loop,
            resolve_token,
            run_server,
        )
        from ..web.pages import serve_pages
    except ImportError as exc:
        print(
            f"aelastic serve: error: {exc.name} is missing; pip install 'aelastic[http]'",
            file=sys.stderr,
        )
        return 1
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s: %(message)s",
    )
    try:
        resolve_token(None)  # a token that could never match is refused at once
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    try:
        resolve_loop(args.loop)
    except ValueError as exc:
        raise UsageError(f"--loop: {exc}") from None
    names = ("run_ttl", "max_body", "max_runs", "max_connections", "read_timeout")
    kwargs: dict[str, Any] = {
        name: getattr(args, name)
        for name in (*names, "keepalive_timeout", "max_nodes_per_client")
        if getattr(args, name) is not None
    }
    kwargs["trusted_proxies"] = trusted_proxies(args.trusted_proxy)
    try:
        run_server(
            args.host,
            args.port,
            persist_path=args.persist,
            pages=serve_pages,
            loop=args.loop,
            **kwargs,
        )
    except PersistenceError as exc:
        print(f"aelastic serve: error: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(
            f"aelastic serve: error: cannot serve on {args.host}:{args.port}: {exc}",
            file=sys.stderr,
        )
        return 1
    return 0
