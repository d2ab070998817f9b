"""``aelastic run``'s flags for a job that heals itself: hangs, a job-wide budget, quarantine,
hot spares and in-place recovery.

How it works: :func:`add_heal_flags` declares ``--stall-timeout``, ``--startup-timeout``,
``--job-max-restarts`` and ``--quarantine-after`` (each with its ``PET_*`` variable, like
torchrun's flags) and :func:`heal_options` validates them into :class:`HealOptions`, which
the launcher copies into the :class:`~aelastic.agent.WorkerSpec`. Hang detection is on by
default with no number to choose (``--stall-timeout auto``: the bound is learned from the
job's step times, see :mod:`aelastic.agent.health.hang_rule`; a number keeps its fixed meaning;
``0`` turns it off), and so is the start-up bound (30 minutes to the first step). The
job-wide budget and quarantine are off unless given: torch's per-agent ``--max-restarts``
stays the budget. ``--standby-preload`` and ``--recovery-timeout`` tune warm standbys (a
spare's workers) and in-place recovery.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..agent.health.hang_rule import AUTO, DEFAULT_STARTUP, stall_setting, startup_setting

__all__ = ["HealOptions", "add_heal_flags", "heal_options"]


@dataclass(frozen=True)
class HealOptions:
    """What the self-healing flags ask of the agent (``None``: off)."""

    stall_timeout: float | str | None = AUTO
    startup_timeout: float | None = DEFAULT_STARTUP
    job_max_restarts: int | None = None
    quarantine_after: int | None = None
    standby_preload: tuple[str, ...] = ()
    recovery_timeout: float = 60.0


def add_heal_flags(parser: argparse.ArgumentParser, add: Callable[..., None]) -> None:
    """Declare the flags on ``parser`` with ``add`` (the launcher's ``PET_*``-aware adder)."""
    add(
        parser,
        ["--stall-timeout"],
        default=AUTO,
        help="Hang detection: auto (default) learns the bound from the step times (5x the "
        "slowest recent step, 10 s to 1 h; a worker busy without steps is not hung); SECONDS: "
        "a worker with no progress (optimizer step) for that long after its first is hung; "
        "its stacks are taken and the group restarted; 0: off (aelastic).",
        metavar="auto|SECONDS",
    )
    add(
        parser,
        ["--startup-timeout"],
        default=DEFAULT_STARTUP,
        kind=float,
        help="Seconds from a torch worker's start to its first step (process group set-up, "
        "the first collective) after which an idle worker is hung, named with its stacks "
        "(aelastic; 1800; 0: off).",
    )
    add(
        parser,
        ["--job-max-restarts"],
        kind=int,
        help="Restarts the whole job may spend, however nodes rejoin (aelastic; off).",
    )
    add(
        parser,
        ["--quarantine-after"],
        kind=int,
        help="A host that was the job's root cause N times in a row, or was lost N times, "
        "leaves the job with exit code 3 (aelastic; off).",
    )
    add(
        parser,
        ["--standby-preload"],
        default="",
        help="Modules (comma-separated, e.g. torch) each warm standby imports ahead of time, "
        "so that a spare's or a restart's workers skip that import (aelastic; none).",
    )
    add(
        parser,
        ["--recovery-timeout"],
        default=60.0,
        kind=float,
        help="Seconds workers kept for in-place recovery (aelastic.worker.InPlace) have to "
        "join their new group; then they are restarted the old way (aelastic; 60).",
    )


def heal_options(args: Any) -> HealOptions:
    """The validated options of ``args``.

    Raises:
        UsageError: A stall timeout neither ``auto`` nor a number >= 0, a negative
            timeout or budget, ``--quarantine-after`` below 1, a
            preload that is no module name, a recovery timeout that is not positive.
    """
    from .rules import UsageError

    text = str(args.stall_timeout).strip()
    try:
        stall = stall_setting(AUTO if text.lower() == AUTO else float(text))
    except ValueError:
        raise UsageError(
            f"--stall-timeout must be auto or a number of seconds >= 0 (0: off), not {text!r}"
        ) from None
    try:
        startup = startup_setting(float(args.startup_timeout))
    except ValueError:
        raise UsageError(
            f"--startup-timeout must be a number of seconds >= 0 (0: off), "
            f"not {args.startup_timeout}"
        ) from None
    budget = None if args.job_max_restarts is None else int(args.job_max_restarts)
    if budget is not None and budget < 0:
        raise UsageError(f"--job-max-restarts must be >= 0, not {budget}")
    after = None if args.quarantine_after is None else int(args.quarantine_after)
    if after is not None and after < 1:
        raise UsageError(f"--quarantine-after must be >= 1, not {after}")
    preload = tuple(filter(None, (m.strip() for m in str(args.standby_preload).split(","))))
    for name in preload:
        if not all(part.isidentifier() for part in name.split(".")):
            raise UsageError(f"--standby-preload names modules, not {name!r}")
    recovery = float(args.recovery_timeout)
    if not recovery > 0:
        raise UsageError(f"--recovery-timeout must be > 0, not {args.recovery_timeout}")
    return HealOptions(stall, startup, budget, after, preload, recovery)
