"""``aelastic serve``: run the HTTP rendezvous server (``--rdzv-backend http``).

How it works: parses the flags and hands over to
:func:`aelastic.backends.http.server.run_server`, which serves until SIGINT or SIGTERM and
prints ``aelastic rendezvous server listening on <url>`` once it accepts connections. It
serves the live pages of its runs too (``/``, ``/runs/<run id>``: :mod:`aelastic.web`). The
bearer token is read from ``AELASTIC_HTTP_TOKEN`` or the first line of ``--token-file``
(never from the command line, where other users of the machine could read it); nodes send
the same variable. Tokens scoped to a run-id prefix are listed in ``--scoped-tokens FILE``
or minted (``--mint-token PREFIX`` prints one and exits). The server has no TLS of its own:
off a private network, put it behind a TLS-terminating proxy.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from ..backends.http.wire import DEFAULT_PORT
from ._serve_quotas import add_quota_flags, quota_kwargs
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
        "--token-file",
        metavar="FILE",
        help="read the server's token from FILE's first line instead of $AELASTIC_HTTP_TOKEN",
    )
    p.add_argument(
        "--scoped-tokens",
        metavar="FILE",
        help="tokens scoped to a run-id prefix, one 'TOKEN PREFIX' a line: each reaches only "
        "the runs whose id starts with its prefix (needs the server's token)",
    )
    p.add_argument(
        "--mint-token",
        metavar="PREFIX",
        help="print the token for the runs whose id starts with PREFIX (derived from the "
        "server's token) and exit",
    )
    add_quota_flags(p)
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


def _token(args: argparse.Namespace) -> str | None:
    """The server's token: ``--token-file``'s, or ``$AELASTIC_HTTP_TOKEN`` (``None``: none).

    Raises:
        UsageError: Both are given, the file cannot be read, or the token could never
            match (whitespace around it).
    """
    from ..backends.http.server import read_token_file, resolve_token

    try:
        from_env = resolve_token(None)
        if args.token_file is None:
            return from_env
        if from_env is not None:
            raise UsageError(
                "the server's token is given twice: $AELASTIC_HTTP_TOKEN and --token-file "
                "(keep one)"
            )
        return resolve_token(read_token_file(args.token_file))
    except ValueError as exc:
        raise UsageError(str(exc)) from None


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
    quota_limits = quota_kwargs(args)
    try:
        from ..backends.http import server
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
    token = _token(args)
    if args.mint_token is not None:
        if token is None:
            raise UsageError(
                "--mint-token needs the server's token ($AELASTIC_HTTP_TOKEN or --token-file)"
            )
        try:
            print(server.mint(token, args.mint_token))
        except ValueError as exc:
            raise UsageError(f"--mint-token: {exc}") from None
        return 0
    scoped = None
    if args.scoped_tokens is not None:
        if token is None:
            raise UsageError(
                "--scoped-tokens needs the server's own token ($AELASTIC_HTTP_TOKEN or "
                "--token-file): it is the operator's, for every run"
            )
        try:
            scoped = server.load_scoped_tokens(args.scoped_tokens)
        except ValueError as exc:
            raise UsageError(f"--scoped-tokens: {exc}") from None
        if token in scoped:
            raise UsageError("--scoped-tokens lists the server's own token")
    try:
        server.resolve_loop(args.loop)
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
        server.run_server(
            args.host,
            args.port,
            token=token or "",
            persist_path=args.persist,
            pages=serve_pages,
            loop=args.loop,
            scoped_tokens=scoped,
            quotas=server.Quotas(**quota_limits),
            **kwargs,
        )
    except server.PersistenceError as exc:
        print(f"aelastic serve: error: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(
            f"aelastic serve: error: cannot serve on {args.host}:{args.port}: {exc}",
            file=sys.stderr,
        )
        return 1
    return 0
