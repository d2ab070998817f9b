"""``aelastic serve``: run the HTTP rendezvous server (``--rdzv-backend http``).

How it works: parses the flags and hands over to
:func:`aelastic.backends.http.server.run_server`, which serves until SIGINT or SIGTERM and
prints ``aelastic rendezvous server listening on <url>`` once it accepts connections. The
bearer token is read from ``AELASTIC_HTTP_TOKEN`` (never from the command line, where other
users of the machine could read it); nodes send the same variable.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from ..backends.http.wire import DEFAULT_PORT
from .options import UsageError

__all__ = ["build_parser", "main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def build_parser(prog: str = "aelastic serve") -> argparse.ArgumentParser:
    """The parser of ``aelastic serve``."""
    p = _Parser(
        prog=prog,
        description="Serve aelastic rendezvous state over HTTP (token from "
        "$AELASTIC_HTTP_TOKEN when set).",
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
    p.add_argument("-v", "--verbose", action="store_true", help="log the server's info lines")
    return p


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
    try:
        from ..backends.http.server import PersistenceError, resolve_token, run_server
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
    kwargs: dict[str, Any] = {} if args.run_ttl is None else {"run_ttl": args.run_ttl}
    if args.max_body is not None:
        kwargs["max_body"] = args.max_body
    try:
        run_server(args.host, args.port, persist_path=args.persist, **kwargs)
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
