"""When a worker is hung: the bound on a worker's time without a sign of life; pure, no I/O.

How it works: the agent reads each worker's progress page (:mod:`aelastic.agent.health.progress`)
and hands this module what it says, with the moments the agent itself saw the worker alive;
:func:`watch_of` says what the worker is watched for now (:class:`Watch`: since when, for how long,
and how), and :func:`check_stalls` which workers are hung, which the agent should look at from
outside, and when to look again.

The bound (``stall_timeout``, ``--stall-timeout``):

* **auto** (the default) learns it from the job: ``FACTOR`` (5) times the slowest of the
  recent gaps between two steps of the node's workers (the last 255 of each), never under
  ``FLOOR`` (10 s), never over ``CEILING`` (1 h). A job whose steps take 50 ms is watched
  at 10 s; one whose steps take 5 minutes at 25 minutes.

  - 5x: the step time of a healthy job varies (a logging step, a data loader's slow batch,
    a peer's garbage collection): a multiple of the *slowest* recent gap, not of the mean,
    already holds those; 5 more is NVIDIA's resiliency extension's ``safety_factor`` for
    the same rule (its timeouts are the longest observed heartbeat interval times 5).
    A periodic phase without steps (an evaluation every 10 steps) is a slow gap of its
    own while it is in the window, and raises the bound with it.
  - 10 s: a healthy worker may sit idle for seconds outside a collective (a blocking
    network read, the first batch of a data loader restarted at an epoch's end, a
    machine too loaded to schedule it); a hang found at 10 s instead of 1 s costs seconds
    once, a false one costs the whole job a restart. Well inside NCCL's 10 minutes.
  - 1 h: a bound learned from one huge gap (a step that waited for a long evaluation)
    must not make hang detection useless; a worker idle outside a collective for an hour
    is hung whatever its steps. It is also where NVIDIA's defaults sit (45 minutes after
    the first heartbeat, 60 before it).

  The bound applies once a worker made its first step and some worker of the node has two
  gaps (three steps; the time before the first step is never a gap: imports, compilation,
  the process group). Before that, the start-up bound applies (below).

  A learned bound is only the first half of the verdict: a worker past it is **looked at from
  outside** (:mod:`aelastic.agent.health.activity`, which costs the worker nothing): its processes
  must have been idle, no CPU beyond a trickle, no more than a trickle of bytes read or written, no
  main thread waiting for the disk, for the second half of the bound. A phase without steps that
  works (an evaluation, a checkpoint written, a data pass) is alive, and a step-less phase that
  spins forever is never called hung (name a number for that). A worker found waiting inside
  ``torch.distributed`` is left to the rank at fault: that rank's own agent names it (it is idle
  elsewhere), or the collective's own timeout ends the wait; the wait is reported once, never
  stopped here (a peer writing a checkpoint keeps the others in a barrier for as long as it takes).

* **a number** keeps its meaning: no progress for that many seconds after the first
  progress (or since the watch began, for workers kept in place) is a hang, seen from the
  page alone; a worker waiting in ``torch.distributed`` is given one more timeout for the
  rank at fault (:mod:`aelastic.agent.health.stall`).

* **0** or ``None``: off.

The **start-up bound** (``startup_timeout``, ``--startup-timeout``, 30 minutes; 0: off),
whatever the rule: from the start of the watch (the workers' start) to a worker's first
step. Only a worker whose bootstrap registered torch's optimizer hook is watched then (a
torch worker: it will step; any other command is watched from its first progress only).
It is the same verdict, the outside look included (a long data preparation that works is
alive), except that a wait inside ``torch.distributed`` is a hang too: a process group
that never forms, or a first collective that never completes, is what this bound is for.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = [
    "AUTO",
    "CEILING",
    "DEFAULT_STARTUP",
    "FACTOR",
    "FLOOR",
    "MIN_GAPS",
    "UNARMED_LOOK",
    "HangRule",
    "StallCheck",
    "Watch",
    "check_stalls",
    "learned_bound",
    "rule_of",
    "stall_setting",
    "startup_setting",
    "watch_of",
]

#: ``stall_timeout`` that learns the bound from the job's steps.
AUTO = "auto"
#: The learned bound: this many times the slowest recent gap between steps...
FACTOR = 5.0
#: ... never under this (seconds) ...
FLOOR = 10.0
#: ... never over this (seconds).
CEILING = 3600.0
#: Gaps between steps some local worker must have made before the learned bound applies.
MIN_GAPS = 2
#: The start-up bound (seconds) unless set.
DEFAULT_STARTUP = 1800.0
#: Longest time between two looks at the pages while some worker is not watched yet.
UNARMED_LOOK = 5.0


def _seconds(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number of seconds, not {value!r}")
    seconds = float(value)
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"{name} must be a finite number of seconds >= 0, not {value!r}")
    return seconds


def stall_setting(value: object, name: str = "stall_timeout") -> float | str | None:
    """``value`` checked: ``"auto"``, a positive number of seconds, or ``None`` (off: also
    for ``0``).

    Raises:
        ValueError: Anything else (another string, a negative or infinite number).
    """
    if value is None or value == AUTO:
        return None if value is None else AUTO
    if isinstance(value, str):
        raise ValueError(
            f"{name} must be {AUTO!r}, a number of seconds, or 0 or None (off), not {value!r}"
        )
    seconds = _seconds(value, name)
    return seconds or None


def startup_setting(value: object, name: str = "startup_timeout") -> float | None:
    """``value`` checked: a positive number of seconds, or ``None`` (off: also for ``0``).

    Raises:
        ValueError: Not a finite number >= 0.
    """
    return None if value is None else (_seconds(value, name) or None)


@dataclass(frozen=True)
class HangRule:
    """How a node watches its workers for hangs.

    Attributes:
        fixed: Seconds without progress that make a hang (a number's meaning), or ``None``:
            the bound is learned from the steps (``auto``).
        startup: The start-up bound (seconds), or ``None``: off.
    """

    fixed: float | None
    startup: float | None

    @property
    def unarmed(self) -> float:
        """Seconds between two looks at the pages while some worker is not watched yet."""
        return UNARMED_LOOK if self.fixed is None else min(self.fixed / 2, UNARMED_LOOK)

    def describe(self) -> str:
        """One line for the launcher's start."""
        if self.fixed is None:
            text = (
                f"hangs: the bound is learned from the step times ({FACTOR:g}x the slowest "
                f"recent step, {_duration(FLOOR)} to {_duration(CEILING)})"
            )
        else:
            text = f"hangs: {_duration(self.fixed)} without a step after the first"
        if self.startup is None:
            return text + "; no start-up bound (--startup-timeout 0)"
        return text + f"; start-up bound {_duration(self.startup)} (--startup-timeout)"


def _duration(seconds: float) -> str:
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds / 3600:g} h"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds / 60:g} min"
    return f"{seconds:g} s"


def rule_of(stall_timeout: object, startup_timeout: object = DEFAULT_STARTUP) -> HangRule | None:
    """The rule of a worker spec's settings (``None``: no hang detection).

    Raises:
        ValueError: A setting is not valid (see :func:`stall_setting`).
    """
    stall = stall_setting(stall_timeout)
    if stall is None:
        return None
    return HangRule(None if stall == AUTO else float(stall), startup_setting(startup_timeout))


def learned_bound(gaps: Iterable[float]) -> float:
    """The bound learned from ``gaps`` (seconds between steps; at least one)."""
    return min(max(FACTOR * max(gaps), FLOOR), CEILING)


@dataclass(frozen=True)
class Watch:
    """What a worker is watched for now.

    Attributes:
        since: Its last sign of life (monotonic seconds).
        bound: Seconds without one that make it hung.
        phase: ``"startup"`` (no step yet), ``"learning"`` (steps, but the bound is not
            learned yet: the start-up bound from the last step), ``"learned"`` or
            ``"fixed"``.
        outside: Activity seen from outside counts, and the verdict needs its processes
            idle for the second half of the bound.
        quiet: Since when the agent has seen it idle (``None``: not looked at yet).
    """

    since: float
    bound: float
    phase: str
    outside: bool
    quiet: float | None = None

    @property
    def look_at(self) -> float:
        """When the agent first looks at it from outside."""
        return self.since + self.bound / 2

    @property
    def patient(self) -> bool:
        """A wait inside ``torch.distributed`` is left to the rank at fault."""
        return self.phase in ("learning", "learned")

    def deadline(self) -> float:
        """When it is hung, unless a sign of life comes."""
        end = self.since + self.bound
        if not self.outside:
            return end
        quiet = self.look_at if self.quiet is None else self.quiet
        return max(end, quiet + self.bound / 2)


def watch_of(
    rule: HangRule,
    *,
    last_progress: float | None,
    steps: int,
    torch: bool,
    began: float,
    renewed: float | None,
    learned: float | None,
    quiet: float | None = None,
    paused: bool = False,
) -> Watch | None:
    """What a worker is watched for (``None``: not watched now).

    Args:
        rule: The node's rule.
        last_progress: The worker's last progress (``None``: none yet, or in a phase not
            watched: paused, or its interpreter's exit).
        steps: Its progress so far.
        torch: Its bootstrap registered torch's optimizer hook.
        began: When the watch began (the workers' start, or their resumption in place).
        renewed: The last time the agent saw it alive from outside, or left its wait in a
            collective to the peer (``None``: never).
        learned: The node's learned bound (``None``: not learned yet).
        quiet: Since when the agent has seen it idle.
        paused: It is in a phase not watched (``aelastic.worker.paused()``, its exit).
    """
    if paused or (last_progress is None and steps):
        return None  # paused, exiting, or a page read half-written
    since = max(began, renewed or began)
    if not steps:
        if rule.startup is None or not torch:
            return None
        return Watch(since, rule.startup, "startup", True, quiet)
    assert last_progress is not None
    since = max(since, last_progress)
    if rule.fixed is not None:
        return Watch(max(began, last_progress), rule.fixed, "fixed", False)
    if learned is None:  # not learned yet: the start-up bound, from the last step
        return Watch(since, rule.startup or CEILING, "learning", True, quiet)
    return Watch(since, learned, "learned", True, quiet)


@dataclass(frozen=True)
class StallCheck:
    """Which workers are hung, which to look at, and when to check again.

    Attributes:
        stalled: Local ranks past their deadline.
        looks: Local ranks the agent should look at from outside now (past the first half
            of their bound, not looked at yet).
        next_check: Monotonic time of the next check.
    """

    stalled: tuple[int, ...]
    looks: tuple[int, ...]
    next_check: float


def check_stalls(
    watches: Mapping[int, Watch | None], now: float, unarmed: float = UNARMED_LOOK
) -> StallCheck:
    """The verdict on workers watched as ``watches`` say (local rank -> watch, ``None``:
    not watched now), at monotonic time ``now``; a worker not watched, or whose bound a
    step may shorten (all but a number's), is looked at again ``unarmed`` seconds later."""
    stalled, looks, times = [], [], []
    for rank, watch in sorted(watches.items()):
        if watch is None or watch.phase != "fixed":
            times.append(now + unarmed)  # a step may shorten its bound (start-up -> learned)
        if watch is None:
            pass
        elif watch.outside and watch.quiet is None:  # never hung before a first look
            if now >= watch.look_at:
                looks.append(rank)
                times.append(now + watch.bound / 2)  # looked at now: idle until then
            else:
                times.append(watch.look_at)
        elif now >= watch.deadline():
            stalled.append(rank)
        else:
            times.append(watch.deadline())
    return StallCheck(tuple(stalled), tuple(looks), min(times, default=now + unarmed))
