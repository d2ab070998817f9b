"""``torch.distributed.run`` (torchrun's Python entry points) on aelastic's launcher.

Programs that run torchrun in-process switch with one import: Lightning Fabric's
``fabric run`` calls ``torch.distributed.run.main(args)``, accelerate's ``accelerate
launch`` builds a namespace with ``get_args_parser()`` and calls ``run(args)``::

    import aelastic.run as distrib_run     # was: import torch.distributed.run as distrib_run
    distrib_run.main(["--nproc-per-node", "2", "train.py"])

The flags are ``aelastic run``'s (torchrun's, with their ``PET_*`` variables). The job runs
as ``aelastic run`` runs it (its progress lines on stderr); on a worker failure :func:`run`
raises torch's ``ChildFailedError`` (aelastic's own class of that name without torch) with
torch's ``failures`` and message, a failed rendezvous raises its ``RendezvousError``, a
handled signal ``KeyboardInterrupt`` (SIGINT) or ``SignalException``. :func:`main` also
writes the root cause, or its own error, to ``TORCHELASTIC_ERROR_FILE`` when that is set,
as torch's ``@record`` on ``main`` does. Nothing here imports torch until a failure.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from .agent.loop.signals import raise_for
from .cli import options
from .cli.launch import EXIT_OK, Outcome, entrypoint_name, launch, launch_config
from .launcher import LaunchConfig
from .launcher._failures import child_failed_error, child_failed_error_class, record_exception

__all__ = ["config_from_args", "get_args_parser", "main", "parse_args", "run"]


class _Parser(argparse.ArgumentParser):
    """argparse's own behaviour on a bad flag (usage, message, ``SystemExit(2)``), as
    torch's parser; ``aelastic run``'s raises its one-line usage error instead."""

    def error(self, message: str) -> NoReturn:
        argparse.ArgumentParser.error(self, message)


def get_args_parser() -> argparse.ArgumentParser:
    """The parser of torchrun's flags (``aelastic run``'s; ``PET_*`` defaults)."""
    return options.build_parser(prog="aelastic.run", parser_class=_Parser)


def parse_args(args: Sequence[str] | None) -> argparse.Namespace:
    """Parse torchrun's command line (``sys.argv[1:]`` when ``args`` is ``None``)."""
    return get_args_parser().parse_args(None if args is None else list(args))


def _complete(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with every flag's default filled in and string values converted by the
    flag's type, as argparse would (callers build namespaces of their own)."""
    parser = get_args_parser()
    done = argparse.Namespace(**vars(args))
    for action in parser._actions:
        dest = action.dest
        if dest == "help":
            continue
        if not hasattr(done, dest):
            setattr(done, dest, action.default)
        value = getattr(done, dest)
        kind: Callable[[str], Any] | None = action.type  # type: ignore[assignment]
        if isinstance(value, str) and kind is not None and kind is not str:
            setattr(done, dest, kind(value))
        elif value is not None and kind is str and not isinstance(value, str):
            setattr(done, dest, str(value))
    done.training_script_args = list(getattr(done, "training_script_args", []) or [])
    return done


def _plan(args: argparse.Namespace) -> options.LaunchConfig:
    try:
        return options.config_from_args(_complete(args))
    except options.UsageError as exc:
        raise ValueError(str(exc)) from None


def config_from_args(args: argparse.Namespace) -> tuple[LaunchConfig, str, list[str]]:
    """(torch's) ``(LaunchConfig, entrypoint, entrypoint arguments)`` of parsed flags, for
    :func:`aelastic.launcher.elastic_launch`.

    Raises:
        ValueError: An invalid flag value or combination.
    """
    config, entrypoint, entry_args = launch_config(_plan(args))
    return config, entrypoint, list(entry_args)


def run(args: argparse.Namespace) -> None:
    """Run this node of the job (torchrun's ``run``): returns when it succeeded.

    Raises:
        ChildFailedError: Workers failed for good (torch's class when torch is installed).
        RendezvousError: The rendezvous failed.
        ValueError: Invalid flags.
        KeyboardInterrupt, SignalException: A handled signal stopped the job.
        OSError: The workers could not be started.
    """
    from .cli.console import Console
    from .core.redact import known_secrets

    plan = _plan(args)
    secrets = known_secrets(plan.rdzv_endpoint, plan.rdzv_configs, os.environ)
    outcome = Outcome()
    console = Console(enabled=not plan.quiet, secrets=secrets, report=False)  # raised below
    code = asyncio.run(launch(plan, console, outcome))
    if outcome.signal is not None:
        raise_for([outcome.signal])
    if outcome.error is not None:
        raise outcome.error
    result = outcome.result
    if result is not None and result.is_failed():
        name = entrypoint_name(plan.entrypoint, plan.args)
        raise child_failed_error(name, result.failures)
    if code != EXIT_OK:
        raise RuntimeError(f"the launch failed (exit code {code}; see the lines above)")


def main(args: Sequence[str] | None = None) -> None:
    """torchrun's ``main``: parse ``args`` and :func:`run`. An error of the launch itself is
    written to ``TORCHELASTIC_ERROR_FILE`` when set (a worker's root cause already is).

    Raises:
        Whatever :func:`run` raises; ``SystemExit(2)`` for bad flags.
    """
    try:
        run(parse_args(args))
    except SystemExit as exc:
        if exc.code == 0:
            return
        raise
    except Exception as exc:
        if not isinstance(exc, child_failed_error_class()):
            record_exception(exc)
        raise
