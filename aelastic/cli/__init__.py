"""The ``aelastic`` command: ``run`` (torchrun's launcher), ``serve``, ``status``, ``dashboard``.

How it works: :func:`main` picks the subcommand from the first argument and hands the rest to
it; each subcommand imports only what it needs (the launcher never imports torch, so it starts
in a fraction of torchrun's time). A bad flag or value raises
:class:`~aelastic.cli.options.UsageError`, printed here as one line, exit code 2.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from ..core._signals import sigint_interrupts
from ..core.redact import redact
from .options import UsageError

__all__ = ["main"]

_USAGE = """\
usage: aelastic <command> [options]

commands:
  run        launch an elastic job on this node (torchrun's flags), e.g.
             aelastic run --standalone --nproc-per-node 2 train.py
  serve      run the HTTP rendezvous server (for --rdzv-backend http), with live
             pages of its runs at http://host:port/
  status     show a job's rendezvous: round, nodes, ranks, heartbeats (--list: the runs)
  dashboard  serve live pages of the runs on a backend (Redis, an HTTP server)

`aelastic <command> --help` describes a command's options."""


_COMMANDS = ("run", "serve", "status", "dashboard")


def _run(argv: Sequence[str]) -> int:
    # Until launch() handles the signals itself (and after), SIGINT interrupts (see main()):
    # nothing runs then, so the launcher just exits with 1.
    try:
        return _launch(argv)
    except KeyboardInterrupt:
        print("aelastic run: interrupted", file=sys.stderr)
        return 1


def _launch(argv: Sequence[str]) -> int:
    import asyncio
    import logging
    import os

    from ..core.redact import known_secrets
    from .console import Console
    from .launch import launch
    from .options import parse_config

    config = parse_config(argv)
    secrets = known_secrets(config.rdzv_endpoint, config.rdzv_configs, os.environ)
    console = Console(enabled=not config.quiet, secrets=secrets)
    level: int | None = logging.INFO if config.verbose else None
    env_level = os.environ.get("LOGLEVEL", "").upper()
    if env_level in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        level = getattr(logging, env_level)
    console.capture_logs(level)
    try:
        return asyncio.run(launch(config, console))
    finally:
        from ..agent.output import writer

        writer.flush()  # a console that stopped reading holds the exit 2 s at most


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``aelastic`` command line; the process exit code.

    Args:
        argv: The arguments after the program name (default ``sys.argv[1:]``).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_USAGE, file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    if args[0] in ("-V", "--version"):
        from .. import __version__

        print(f"aelastic {__version__}")
        return 0
    command, rest = args[0], args[1:]
    # First thing, before the command's modules load: SIGINT interrupts, even if inherited
    # ignored (a background job of a script). The kernel discards a signal that is ignored
    # when it arrives, so every moment it stays ignored is a Ctrl-C lost for good.
    with sigint_interrupts():
        try:
            return _command(command, rest)
        except KeyboardInterrupt:
            return 1 if command == "run" else 130


def _command(command: str, rest: list[str]) -> int:
    try:
        if command == "run":
            return _run(rest)
        if command == "serve":
            from .serve import main as serve_main

            return serve_main(rest)
        if command == "status":
            from .status import main as status_main

            return status_main(rest)
        if command == "dashboard":
            from .dashboard import main as dashboard_main

            return dashboard_main(rest)
        raise UsageError(f"unknown command {command!r} (commands: {', '.join(_COMMANDS)})")
    except UsageError as exc:
        prefix = f"aelastic {command}" if command in _COMMANDS else "aelastic"
        print(f"{prefix}: error: {redact(str(exc))}", file=sys.stderr)
        return 2
