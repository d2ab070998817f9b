"""Flags of the commands that read a job's backend (``status``, ``dashboard``).

How it works: :func:`add_backend_flags` adds ``--rdzv-backend``, ``--rdzv-endpoint``
(and ``--rdzv-id`` when asked), ``--rdzv-conf`` and ``--timeout``, each read from the job's
``PET_<NAME>`` variable when not given, like ``aelastic run``. :func:`backend_of` checks
them: a backend that lives inside one launcher (memory) cannot be read from outside; a
backend that one of the job's nodes serves (c10d, static) is read as its row's ``read_as``
says (the HTTP server its host runs; never hosted from here);
``--timeout`` becomes the backend's ``read_timeout`` unless ``--rdzv-conf`` sets one. A
password or token given on the command line (where every user of the machine can read it)
is warned about, naming the variable to use instead.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from ..backends.registry import BUILTINS, backend_info, external_names, secret_variables
from ..core.redact import exposed_secrets
from .conf_keys import unknown_key_warnings
from .options import BACKEND_ALIASES, UsageError, parse_rdzv_conf

__all__ = ["add_backend_flags", "backend_of"]


def _readable() -> str:
    names = [info.name for info in BUILTINS if info.multi_node]
    return ", ".join(names[:-1]) + " or " + names[-1]


def add_backend_flags(parser: argparse.ArgumentParser, *, run_id: bool) -> None:
    """Add the flags naming the backend (and the run, when ``run_id``) to ``parser``."""
    names: list[tuple[tuple[str, str], str]] = [
        (("--rdzv-backend", "--rdzv_backend"), _readable()),
        (("--rdzv-endpoint", "--rdzv_endpoint"), "where it is"),
    ]
    if run_id:
        names.append((("--rdzv-id", "--rdzv_id"), "the job's run id"))
    for flags, what in names:
        env = os.environ.get("PET_" + flags[1].lstrip("-").upper())
        parser.add_argument(*flags, default=env, help=f"{what} (default: ${flags[1][2:].upper()})")
    parser.add_argument(
        "--rdzv-conf",
        "--rdzv_conf",
        default=os.environ.get("PET_RDZV_CONF", ""),
        help="keep_alive_interval=...,password=...,... (as run)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=5.0,
        help="seconds to keep trying an unreachable backend before failing (default 5)",
    )


def backend_of(
    args: argparse.Namespace, command: str, warn: Callable[[str], None]
) -> tuple[str, dict[str, str]]:
    """The backend to open and its config keys, from ``args`` (see the module docstring).

    Args:
        args: Parsed flags of :func:`add_backend_flags`.
        command: The command's name, for messages.
        warn: Called with each warning line (a secret the command line shows, unknown
            ``--rdzv-conf`` keys).

    Raises:
        UsageError: A flag is missing or wrong.
    """
    if not args.rdzv_backend or not args.rdzv_endpoint:
        raise UsageError(
            "--rdzv-backend and --rdzv-endpoint are required (or PET_RDZV_BACKEND and "
            "PET_RDZV_ENDPOINT)"
        )
    name = BACKEND_ALIASES.get(args.rdzv_backend, args.rdzv_backend)
    info = backend_info(name)
    if info is not None and not info.multi_node:
        raise UsageError(
            f"the {name} backend lives inside one launcher process: {command} needs a "
            f"backend other processes can reach ({external_names()})"
        )
    if info is not None and info.read_as is not None:
        # One of the job's nodes serves it (aelastic's HTTP server): read it as that.
        name = info.read_as
    if not args.timeout > 0:
        raise UsageError(f"--timeout must be positive, not {args.timeout}")
    config = parse_rdzv_conf(args.rdzv_conf)
    exposed = exposed_secrets(args.rdzv_endpoint, config, sys.orig_argv, secret_variables(name))
    config.setdefault("read_timeout", str(args.timeout))
    for warning in [*exposed, *unknown_key_warnings(config, name)]:
        warn(f"aelastic {command}: warning: {warning}")
    return name, config
