"""The workers of the run's current attempt: started, kept, stopped.

How it works: an :class:`Attempts` holds what starting and stopping workers needs for the
whole run: the attempt's :class:`~aelastic.agent.processes.group.WorkerSet` (``None``
between attempts), the hot spares (:class:`~aelastic.agent.processes.standby.StandbyPool`),
the master port group rank 0 keeps bound until its workers start
(:class:`~.ranks.ReservedPort`), the channel to the workers
(:class:`~aelastic.agent.processes.inplace.InPlaceChannel`) and the agent's beat that they
watch (:class:`~aelastic.agent.processes.beat.AgentBeat`), and the signal a stop sends
first. :meth:`Attempts.start` starts the next attempt's workers (spares first);
:meth:`Attempts.stop` stops and reaps them (workers ending by themselves are not
signalled; those whose Python is over are not waited for); :meth:`Attempts.close` lets go
of everything at the end of the run.
"""

from __future__ import annotations

import signal
import time
from types import MappingProxyType
from typing import Any

from ..api import WorkerGroup, WorkerState
from ..events import StandbysReady, WorkersStarted
from ..output.publish import AgentPublisher
from ..processes.beat import AgentBeat
from ..processes.group import WorkerSet
from ..processes.inplace import InPlaceChannel
from ..processes.standby import StandbyPool
from ..processes.unkillable import WorkersUnkillable
from .aio import uncancellable
from .ranks import ReservedPort
from .run import RunPlace

__all__ = ["Attempts"]


class Attempts:
    """The run's workers, attempt after attempt (see the module docstring).

    Args:
        group: The worker group (its spec, ranks and state).
        events: The agent's publisher.
        channel: The workers' channel to the agent.
        beat: The agent's beat, which the workers watch.
    """

    def __init__(
        self,
        group: WorkerGroup,
        events: AgentPublisher,
        channel: InPlaceChannel,
        beat: AgentBeat,
    ) -> None:
        self._group = group
        self._events = events
        self._channel = channel
        self.beat = beat
        self.port = ReservedPort()
        self.standbys = StandbyPool(
            group.spec, lambda pids: events.publish(StandbysReady, pids=MappingProxyType(pids))
        )
        #: The current attempt's workers (``None``: none running).
        self.workers: WorkerSet | None = None
        #: The number of the current attempt (``-1``: none yet).
        self.number = -1
        #: What a stop sends first (torch: SIGTERM; the launcher forwards the one it got).
        self.stop_signal: int = signal.SIGTERM

    def return_values(self) -> dict[int, Any]:
        """The current workers' return values, by global rank (callables)."""
        assert self.workers is not None
        return self.workers.return_values()

    async def start(
        self, place: RunPlace, restart_count: int, interrupted_at: float | None
    ) -> None:
        """Start the next attempt's workers (spares first); publish ``WorkersStarted`` with
        the time since the interruption's earliest sign (``interrupted_at``, monotonic)."""
        self.number += 1
        self._events.attempt = self.number
        group = self._group
        workers = self.workers = WorkerSet(
            group,
            self.number,
            place.run_dir,
            place.scratch,
            restart_count,
            group.spec.rdzv_handler.get_run_id(),
            place.forks,
            {**self._channel.env(), **self.beat.env()},
        )
        self._channel.forget()
        started = time.monotonic()
        standbys = await self.standbys.take()
        try:
            await workers.start(before_spawn=self.port.release, standbys=standbys)
        finally:
            used = {id(p) for p in workers.processes + workers.discarded}
            await self.standbys.discard(s for s in standbys.values() if id(s.process) not in used)
        self.standbys.schedule()
        self._events.set_state(WorkerState.HEALTHY)
        now = time.monotonic()
        self._events.publish(
            WorkersStarted,
            pids=MappingProxyType({p.local_rank: p.pid for p in workers.processes}),
            duration=now - started,
            recovery=None if interrupted_at is None else now - interrupted_at,
        )

    async def stop(self, state: WorkerState) -> None:
        """Stop and reap the current workers (shielded: a cancellation waits for the stop
        to finish, then goes on).

        Raises:
            WorkersUnkillable: Workers outlived SIGKILL (this node leaves the job).
        """
        workers, self.workers = self.workers, None
        if workers is None:
            return
        running = any(p.returncode is None for p in workers.processes)
        channel = self._channel
        pids = [p.pid for p in workers.processes]
        failing = channel.ending(workers.processes)  # ending by themselves: not signalled
        done = {pid: channel.python_done(pid) for pid in pids}
        grace = self._group.spec.stop_grace_period
        try:
            stop = workers.stop(grace, self.stop_signal, failing=failing.keys(), python_done=done)
            await uncancellable(stop)
        except WorkersUnkillable as exc:  # leave the job to the others, end this node
            self._events.unkillable(exc)
            raise
        if running and state is WorkerState.STOPPED:
            self._events.set_state(WorkerState.STOPPED)

    async def close(self) -> None:
        """At the end of the run: the spares closed, the workers stopped and reaped, the
        master port released (the beat is the caller's to close once the channel is)."""
        await self.standbys.aclose()
        try:
            await self.stop(WorkerState.STOPPED)
        finally:
            self.port.release()
