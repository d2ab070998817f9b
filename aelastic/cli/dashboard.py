"""``aelastic dashboard``: the live pages of the runs on a backend (Redis, an HTTP server).

How it works: the flags name the backend like ``aelastic status`` does (``PET_*`` variables
when not given); the dashboard checks within ``--timeout`` that it can list the runs (an
unreachable backend is a one-line error, exit 1), then serves the pages of
:mod:`aelastic.web` (``/``: the runs, ``/runs/<run id>``: one run, live) until SIGINT or
SIGTERM, printing ``aelastic dashboard listening on <url>`` once it accepts connections. It
never changes a run. With ``AELASTIC_HTTP_TOKEN`` set, the pages need that token (a login
form keeps it in a cookie); it is never read from the command line, where other users of
the machine could see it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence

from ..backends.http.wire import TOKEN_ENV
from ..core._signals import stop_on_signals
from ..core.errors import RendezvousError
from ..core.redact import known_secrets, redact, redact_endpoint
from ..web import DEFAULT_PORT
from .options import UsageError, parse_rdzv_conf
from .reading import add_backend_flags, backend_of
from .rules import UsageParser
from .serve import trusted_proxies

__all__ = ["build_parser", "main"]

log = logging.getLogger("aelastic.web")


def build_parser(prog: str = "aelastic dashboard") -> argparse.ArgumentParser:
    """The parser of ``aelastic dashboard``."""
    p = UsageParser(
        prog=prog,
        description="Serve live pages of the runs on a backend (read-only; token from "
        f"${TOKEN_ENV} when set).",
    )
    add_backend_flags(p, run_id=False)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    p.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0: any)"
    )
    p.add_argument(
        "--trusted-proxy",
        metavar="ADDRESS",
        action="append",
        default=[],
        help="a proxy (address or network) whose X-Forwarded-For, -Proto and -Host are "
        "believed (as for aelastic serve)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log the server's info lines")
    return p


async def _serve(args: argparse.Namespace, backend: str, config: dict[str, str]) -> int:
    try:
        from ..backends.http.server import is_loopback, resolve_token
        from ..web.dashboard import serve_dashboard
        from ..web.sources import BackendSource
    except ImportError as exc:
        raise ImportError(f"the pages need {exc.name}: pip install 'aelastic[http]'") from None

    try:
        token = resolve_token(None)
        where = f"{backend} at {redact_endpoint(args.rdzv_endpoint)}"
        source = BackendSource(backend, args.rdzv_endpoint, config, where)
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from None
    if source.lists:  # reachable? (a backend that cannot list still serves run pages)
        try:
            await source.list_runs(1)
        except BaseException:
            await source.aclose()
            raise
    if token is None and not is_loopback(args.host):
        log.warning(
            "serving on %s without a token: anyone who can reach it can see the runs (set %s)",
            args.host,
            TOKEN_ENV,
        )
    stop = stop_on_signals()

    def announce(url: str) -> None:
        print(f"aelastic dashboard listening on {url}", flush=True)

    try:
        await serve_dashboard(
            source,
            args.host,
            args.port,
            token=token,
            trusted_proxies=trusted_proxies(args.trusted_proxy),
            stop=stop,
            ready=announce,
        )
    except OSError as exc:
        raise UsageError(f"cannot serve on {args.host}:{args.port}: {exc}") from None
    return 0


def main(argv: Sequence[str]) -> int:
    """Run ``aelastic dashboard`` until SIGINT/SIGTERM; the exit code (1 when the backend
    cannot be read).

    Raises:
        UsageError: Bad flags, or the address cannot be bound (exit code 2).
    """
    args = build_parser().parse_args(list(argv))
    if not 0 <= args.port < 65536:
        raise UsageError(f"--port {args.port} is not a port number")
    config = parse_rdzv_conf(args.rdzv_conf)
    secrets = known_secrets(args.rdzv_endpoint or "", config, os.environ)

    def warn(line: str) -> None:
        print(redact(line, secrets), file=sys.stderr, flush=True)

    backend, config = backend_of(args, "dashboard", warn)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s: %(message)s",
    )
    try:
        return asyncio.run(_serve(args, backend, config))
    except (RendezvousError, ImportError) as exc:
        warn(f"aelastic dashboard: error: {exc}")
        return 1
