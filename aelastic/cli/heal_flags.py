"""``aelastic run``'s flags for a job that heals itself: hangs, a job-wide budget, quarantine.

How it works: :func:`add_heal_flags` declares ``--stall-timeout``, ``--job-max-restarts`` and
``--quarantine-after`` (each with its ``PET_*`` variable, like torchrun's flags) and
:func:`heal_options` validates them into :class:`HealOptions`, which the launcher copies into
the :class:`~aelastic.agent.WorkerSpec`. All three are off unless given: a stall timeout
would call a long evaluation or checkpoint without an optimizer step a hang (see
``aelastic.worker.progress()``), and torch's per-agent ``--max-restarts`` stays the budget.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["HealOptions", "add_heal_flags", "heal_options"]


@dataclass(frozen=True)
class HealOptions:
    """What the self-healing flags ask of the agent (``None``: off)."""

    stall_timeout: float | None = None
    job_max_restarts: int | None = None
    quarantine_after: int | None = None


def add_heal_flags(parser: argparse.ArgumentParser, add: Callable[..., None]) -> None:
    """Declare the flags on ``parser`` with ``add`` (the launcher's ``PET_*``-aware adder)."""
    add(
        parser,
        ["--stall-timeout"],
        default=0.0,
        kind=float,
        help="A worker with no progress (optimizer step) for SECONDS after its first is hung: "
        "its stacks are taken and the group restarted; 0: off (aelastic).",
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


def heal_options(args: Any) -> HealOptions:
    """The validated options of ``args``.

    Raises:
        UsageError: A negative timeout or budget, or ``--quarantine-after`` below 1.
    """
    from .rules import UsageError

    stall = float(args.stall_timeout)
    if not stall >= 0:
        raise UsageError(f"--stall-timeout must be >= 0 (0: off), not {args.stall_timeout}")
    budget = None if args.job_max_restarts is None else int(args.job_max_restarts)
    if budget is not None and budget < 0:
        raise UsageError(f"--job-max-restarts must be >= 0, not {budget}")
    after = None if args.quarantine_after is None else int(args.quarantine_after)
    if after is not None and after < 1:
        raise UsageError(f"--quarantine-after must be >= 1, not {after}")
    return HealOptions(stall or None, budget, after)
