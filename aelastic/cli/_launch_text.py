"""What ``aelastic run`` says: its banner, why a run could not start, a closed job id's way out.

Plain functions from a :class:`~aelastic.cli.options.LaunchConfig` (and an error) to lines;
:mod:`.launch` prints them on its console.
"""

from __future__ import annotations

import math
import os
import shlex
from collections.abc import Sequence

from ..agent import ElasticAgent
from ..backends.registry import backend_info
from ..core.errors import reason, typed
from ..core.redact import redact_endpoint
from ..rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousTimeoutError,
)
from .console import Console
from .options import LaunchConfig

__all__ = ["EXIT_FAILED", "banner", "entrypoint_name", "failed_to_run"]

#: Workers failed, the rendezvous failed, or a signal stopped the job (torchrun's code).
EXIT_FAILED = 1


def entrypoint_name(entrypoint: str, args: Sequence[str]) -> str:
    """The script (or module, or command) a human recognizes (torch's rule)."""
    if os.path.basename(entrypoint).startswith("python"):
        rest = iter(args)
        for arg in rest:
            if arg == "-c":
                return "<code>"
            if arg == "-m":
                return next(rest, "<module>")
            if not arg.startswith("-"):
                return arg
    return entrypoint


def banner(config: LaunchConfig, name: str) -> str:
    nodes = (
        f"{config.min_nodes} node"
        if config.min_nodes == config.max_nodes == 1
        else f"{config.min_nodes} nodes"
        if config.min_nodes == config.max_nodes
        else f"{config.min_nodes} to {config.max_nodes} nodes"
    )
    workers = config.nproc_per_node
    per_node = f"{workers} worker{'s' if workers != 1 else ''} per node"
    if config.nproc_device:
        per_node += f" (one per {config.nproc_device})"
    asked = config.rdzv_asked or config.rdzv_backend
    if asked == "standalone":
        where = "standalone (the rendezvous runs in this process)"
    elif config.standalone:
        where = f"one node, {asked} rendezvous in this process (nothing else to start)"
    else:
        where = f"{asked} rendezvous at {_where(config)}"
    restarts = config.max_restarts
    command = shlex.join([os.path.basename(config.entrypoint), *config.args])
    return (
        f"launching {name}: {per_node}, {nodes}, {where}; job id {config.run_id}; "
        f"{restarts or 'no'} restart{'s' if restarts != 1 else ''} allowed; command: {command}"
    )


def _where(config: LaunchConfig) -> str:
    return redact_endpoint(config.rdzv_endpoint) if config.rdzv_endpoint else "this process"


def _closed_on_arrival(config: LaunchConfig, exc: RendezvousClosedError) -> list[str]:
    """What to say when the job id names a run that was closed before this node came."""
    lines = [
        f"error: the job id '{config.run_id}' was used by a job that has finished: its "
        f"rendezvous at {_where(config)} is closed, so no node can join it for now"
    ]
    if exc.reopens_in is not None:
        lines.append(
            f"the id is free again in {math.ceil(exc.reopens_in)} s (two heartbeat windows "
            "after that job's last node left, so that a late node of it still learns that it "
            "closed)"
        )
    else:
        lines.append("the id is free again two heartbeat windows after that job's nodes leave")
    info = backend_info(config.rdzv_backend)
    if info is not None and info.external:
        reset = shlex.join(
            [
                "aelastic",
                "status",
                "--rdzv-backend",
                config.rdzv_backend,
                "--rdzv-endpoint",
                redact_endpoint(config.rdzv_endpoint),
                "--rdzv-id",
                config.run_id,
                "--reset",
            ]
        )
        lines.append(f"start fresh with a new --rdzv-id, or delete the old run first: {reset}")
    else:
        lines.append("start fresh with a new --rdzv-id")
    return lines


def failed_to_run(
    exc: BaseException, console: Console, agent: ElasticAgent, config: LaunchConfig
) -> int:
    """Say why the agent could not run (the rendezvous, a worker's start); exit code 1."""
    # The end of the run: the job's root cause, if any, is said after (news=False).
    if isinstance(exc, RendezvousClosedError) and agent.metrics.rendezvous_count == 0:
        for line in _closed_on_arrival(config, exc):
            console.line(line, always=True, news=False)
    elif isinstance(exc, RendezvousError):
        said = f"error: rendezvous failed: {typed(exc)}"
        if config.endpoint_note and isinstance(
            exc, RendezvousConnectionError | RendezvousTimeoutError
        ):
            said += f" ({config.endpoint_note})"
        console.line(said, always=True, news=False)
    elif isinstance(exc, OSError):
        console.line(f"error: cannot start the workers: {reason(exc)}", always=True, news=False)
    else:
        console.line(f"error: {exc}", always=True, news=False)
    return EXIT_FAILED
