"""What the agent saw of an attempt's workers besides their pages, for hang detection.

How it works: :class:`Seen` reads the workers' progress pages
(:mod:`aelastic.agent.health.progress`) into their watches
(:func:`~aelastic.agent.health.hang_rule.watch_of`) and the verdict
(:func:`~aelastic.agent.health.hang_rule.check_stalls`), adding what the agent itself saw: the
moments a worker was seen alive from outside (:mod:`aelastic.agent.health.activity`: busy at its
second look), and the first of its idle looks since its last sign of life. Of the stalled workers it
leaves the waits inside ``torch.distributed`` under a learned bound to the rank at fault
(:meth:`Seen.leave_to_peers`): logged once, looked at again a bound later, then two, four... bounds
later. :mod:`aelastic.agent.health.stall` drives it, takes the stacks and acts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import anyio

from ..processes.process import WorkerProcess
from .activity import Activity, busy, sample
from .hang_rule import (
    CEILING,
    MIN_GAPS,
    HangRule,
    StallCheck,
    Watch,
    check_stalls,
    learned_bound,
    watch_of,
)
from .progress import PageReading, ProgressPages

__all__ = [
    "Seen",
    "Stall",
]


@dataclass(frozen=True)
class Stall:
    """A worker that made no progress for the stall timeout.

    Attributes:
        local_rank: Its local rank.
        pid: The process that reported progress (the worker, or a Python under a wrapper).
        steps: Progress it reported before it stalled.
        idle: Seconds since its last progress.
        stacks: The Python stacks of its threads (faulthandler's text; may be empty).
        where: The main thread's innermost frame (``file:line in func``), or ``""``.
        user_where: The innermost frame in the user's own code, when not ``where``.
        in_collective: The main thread waits inside ``torch.distributed``.
        stopped: The process is stopped (``SIGSTOP``, a debugger): it could not be asked
            for its stacks.
        phase: What it was watched for: ``"startup"``, ``"learning"``, ``"learned"`` or
            ``"fixed"`` (:class:`~aelastic.agent.health.hang_rule.Watch`).
        bound: The bound it passed (seconds).
    """

    local_rank: int
    pid: int
    steps: int
    idle: float
    stacks: str
    where: str = ""
    user_where: str = ""
    in_collective: bool = False
    stopped: bool = False
    phase: str = "fixed"
    bound: float = 0.0

    @property
    def unresponsive(self) -> bool:
        """Its stacks could not be taken (stopped, or silent past the dump's bound): it is
        the suspect, before any worker that waits for it in a collective."""
        return self.stopped or not self.stacks

    def describe(self) -> str:
        """One line: how long, after how much progress, and where."""
        if not self.steps:
            text = (
                f"hung: no first step {self.idle:.1f} s after its start (start-up bound "
                f"{self.bound:g} s)"
            )
        else:
            text = f"hung: no progress for {self.idle:.1f} s after {self.steps} step(s)"
            if self.phase == "learned":
                text += f" (bound {self.bound:.1f} s, learned from the step times)"
        if self.in_collective:
            text += ", waiting in a torch.distributed call"
        if self.user_where:
            text += f"; stuck at {self.user_where} (innermost: {self.where})"
        elif self.where:
            text += f"; stuck at {self.where}"
        elif self.stopped:
            text += " (no stacks: the process is stopped, by SIGSTOP or a debugger)"
        elif not self.stacks:
            text += " (no stacks: the worker did not answer)"
        return text


log = logging.getLogger("aelastic.agent")


class Seen:
    """What the agent saw of an attempt's workers besides their pages: when each was last
    seen alive from outside (or its wait in a collective left to the peer at fault), and
    the first of its idle samples since."""

    def __init__(self, pages: ProgressPages, rule: HangRule, began: float) -> None:
        self._pages = pages
        self._rule = rule
        #: When the watch began (the workers' start, or their resumption in place).
        self.began = began
        self._renewed: dict[int, float] = {}
        self._quiet: dict[int, tuple[float, Activity, float]] = {}  # rank -> (at, sample, since)
        self._left: dict[int, float | None] = {}  # waits told of -> the progress they had
        self._looks: dict[int, int] = {}  # waits told of -> looks at them since

    def check(
        self, running: Mapping[int, WorkerProcess]
    ) -> tuple[dict[int, Watch | None], StallCheck]:
        """The workers' watches and the verdict now."""
        readings = {rank: self._pages.read(rank) for rank in running}
        learned = self._learned(readings) if self._rule.fixed is None else None
        watches: dict[int, Watch | None] = {}
        for rank, reading in readings.items():
            last = reading.last_progress()
            if rank in self._left and self._left[rank] != last:
                del self._left[rank]  # it moved since its wait was told of: watch it again
                self._renewed.pop(rank, None)
            watch = watch_of(
                self._rule,
                last_progress=last,
                steps=reading.steps,
                torch=reading.torch,
                began=self.began,
                renewed=self._renewed.get(rank),
                learned=learned,
                paused=reading.paused,
            )
            quiet = self._quiet.get(rank)
            if quiet is not None and (watch is None or quiet[2] != watch.since):
                del self._quiet[rank]  # a sign of life since: look again
            elif quiet is not None and watch is not None:
                watch = replace(watch, quiet=quiet[0])  # its idle samples still stand
            watches[rank] = watch
        return watches, check_stalls(watches, time.monotonic(), self._rule.unarmed)

    def _learned(self, readings: Mapping[int, PageReading]) -> float | None:
        gaps = {rank: self._pages.gaps(rank, r.steps) for rank, r in readings.items() if r.steps}
        if not any(len(g) >= MIN_GAPS for g in gaps.values()):
            return None
        return learned_bound(g for found in gaps.values() for g in found)

    async def look(
        self,
        running: Mapping[int, WorkerProcess],
        ranks: Sequence[int],
        watches: Mapping[int, Watch | None],
    ) -> None:
        """The first look from outside at ``ranks``: busy, they are alive; else idle from now."""
        samples = await _sample({r: running[r].pid for r in ranks})
        now = time.monotonic()
        for rank, activity in samples.items():
            watch = watches[rank]
            assert watch is not None
            if activity.disk:
                self._renewed[rank] = now
            else:
                self._quiet[rank] = (now, activity, watch.since)

    async def confirm(
        self,
        running: Mapping[int, WorkerProcess],
        ranks: Sequence[int],
        watches: Mapping[int, Watch | None],
    ) -> list[int]:
        """Of ``ranks`` past their deadline, those still idle (looked at from outside when
        their watch says so); the others are alive from now."""
        outside = [r for r in ranks if (w := watches[r]) is not None and w.outside]
        samples = await _sample({r: running[r].pid for r in outside}) if outside else {}
        now = time.monotonic()
        stalled = []
        for rank in ranks:
            activity = samples.get(rank)
            first = self._quiet.get(rank)
            if (
                activity is not None
                and first is not None
                and busy(first[1], activity, now - first[0])
            ):
                self._renewed[rank] = now
                del self._quiet[rank]
                continue
            stalled.append(rank)
        return stalled

    def leave_to_peers(
        self, stalls: list[Stall], watches: Mapping[int, Watch | None]
    ) -> list[Stall]:
        """The stalls to act on. When every one waits inside ``torch.distributed`` under a
        learned bound, none: the wait is left to the rank at fault (its own agent names it,
        or the collective's timeout ends the wait), logged once, looked at again a bound
        later; a peer writing a checkpoint holds the others in a barrier as long as it
        takes."""
        patient = [
            s
            for s in stalls
            if (w := watches.get(s.local_rank)) is not None
            and w.patient
            and s.in_collective
            and not s.unresponsive
        ]
        if len(patient) < len(stalls):
            return stalls
        now = time.monotonic()
        for stall in patient:
            rank = stall.local_rank
            if rank not in self._left:
                self._looks[rank] = 0
                log.info(
                    "worker local_rank %d: no progress for %.1f s, waiting in torch.distributed "
                    "at %s; left to the rank at fault",
                    rank,
                    stall.idle,
                    stall.user_where or stall.where,
                )
            self._left[rank] = self._pages.read(rank).last_progress()
            # Looked at again (its stacks taken) a bound later, then 2, 4... bounds later,
            # within an hour: a wait of hours costs a few dumps.
            watch = watches[rank]
            assert watch is not None
            self._looks[rank] = self._looks.get(rank, 0) + 1
            extra = min(watch.bound * (2 ** min(self._looks[rank] - 1, 10) - 1), CEILING)
            self._renewed[rank] = now + extra
            self._quiet.pop(rank, None)
        return []


async def _sample(pids: Mapping[int, int]) -> dict[int, Activity]:
    """The activity of each worker (local rank -> its process), read off the event loop."""

    def read() -> dict[int, Activity]:
        return {rank: sample(pid) for rank, pid in pids.items()}

    result: dict[int, Activity] = await anyio.to_thread.run_sync(read)
    return result
