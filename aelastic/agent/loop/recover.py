"""The agent's side of a peer's loss: no restart spent for it, workers kept in place.

How it works: a worker whose collective broke fails before the rendezvous declares the peer lost
(its heartbeat window, or sooner where the backend reports the peer's connection ended: a departure,
``core.machine``). :meth:`PeerLoss.explain` waits up to that window (and a beat and a second more)
for a change of the group that explains the failure: then the failure was the peer's, and the
attempt ends as a rescale, no restart spent. On a rescale, workers that all opted in to in-place
recovery (:mod:`aelastic.agent.processes.inplace`) are held (told the group is changing) instead of
stopped; after the next rendezvous :meth:`PeerLoss.resume` sends each its new ranks and master. A
held worker that exited meanwhile makes the agent start the workers again the old way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType

from ...rendezvous.handler import DynamicRendezvousHandler
from ..api import ProcessFailure, WorkerGroup, WorkerState
from ..events import WorkersRecovered
from ..output.publish import AgentPublisher
from ..processes.env import worker_env
from ..processes.group import WorkerSet
from ..processes.inplace import InPlaceChannel
from .aio import cancel_and_wait, quietly
from .membership import RoundGroup
from .policy import Action, Decision, Observation

__all__ = ["PeerLoss"]

log = logging.getLogger("aelastic.agent")


class PeerLoss:
    """Tells a peer's loss from the node's own failure; keeps workers through it."""

    def __init__(self, handler: DynamicRendezvousHandler) -> None:
        self._handler = handler
        #: The agent's end of the workers' in-place channel.
        self.channel = InPlaceChannel()
        #: The workers are kept through the coming re-rendezvous.
        self.held = False
        self._checking: asyncio.Task[None] | None = None

    def check_departures(self, round_group: RoundGroup) -> None:
        """Start asking the backend which members' connections ended (unless a check
        runs): a worker says it is failing in a collective. A task of its own, so that the
        attempt ending first (the worker's exit) does not cut the check short."""
        if self._checking is not None and not self._checking.done():
            return
        check = quietly(round_group.report_departures(), "check the members' connections")
        self._checking = asyncio.ensure_future(check)

    async def aclose(self) -> None:
        """Stop a check still running (the agent ends)."""
        task, self._checking = self._checking, None
        if task is not None:
            await cancel_and_wait(task)

    @property
    def grace(self) -> float:
        """How long a broken collective may wait for the rendezvous to say a peer was lost:
        the heartbeat window, a beat, a second."""
        settings = self._handler.settings
        return settings.heartbeat_window + settings.keep_alive_interval + 1.0

    async def explain(
        self, failures: Mapping[int, ProcessFailure], round_group: RoundGroup
    ) -> Observation | None:
        """The loss of a member that explains ``failures`` (each broke in a collective, and
        no worker was told already that no peer was lost), or ``None``."""
        if not failures or self.channel.told_fail:
            return None
        if not all(f.secondary for f in failures.values()):
            return None
        explained = await round_group.loss_within(self.grace)
        if explained is not None:
            log.info("workers broke in a collective as a peer was lost: no restart")
        return explained

    def interrupted_at(self, workers: WorkerSet) -> float:
        """When the attempt of ``workers`` was interrupted, by its earliest sign (monotonic):
        a worker saying it is failing or that its collective broke, a worker's failed exit,
        else now (a change of the group: this node learns of it now)."""
        signs = [time.monotonic()]
        if (said := self.channel.interrupted_at(workers.processes)) is not None:
            signs.append(said)
        failed = [p for p in workers.processes if p.returncode not in (None, 0)]
        signs += [p.exited_monotonic for p in failed if p.exited_monotonic is not None]
        return min(signs)

    def hold(self, decision: Decision, workers: WorkerSet | None) -> bool:
        """Whether the workers are kept through this rescale (all alive, opted in, and in
        the group of the current round); if so, they are told to leave their group now."""
        self.held = (
            decision.action is Action.RESCALE
            and workers is not None
            and self.channel.opted_in(workers.processes)
        )
        if self.held and workers is not None and not self.channel.settled(workers.processes):
            log.info("a worker is still making its group: starting the workers again")
            self.held = False
        if self.held:
            assert workers is not None
            self.channel.hold(workers.processes)
        return self.held

    def resume(
        self,
        group: WorkerGroup,
        workers: WorkerSet,
        events: AgentPublisher,
        restart_count: int,
        interrupted_at: float | None,
        before_send: Callable[[], object],
    ) -> bool:
        """Send the held workers the ranks of the new round (``before_send()`` first: the
        master port's release); whether they all could be."""
        self.held = False
        procs = sorted(workers.processes, key=lambda p: p.local_rank)
        if not self.channel.opted_in(procs):
            log.info("a worker kept for in-place recovery exited: starting the workers again")
            return False
        before_send()
        envs = {}
        run_id = self._handler.get_run_id()
        for worker, proc in zip(group.workers, procs, strict=True):
            worker.id = proc.pid
            envs[proc.pid] = worker_env(
                group, worker, restart_count=restart_count, run_id=run_id, error_file=""
            )
        self.channel.resume(envs)
        events.set_state(WorkerState.HEALTHY)
        events.publish(
            WorkersRecovered,
            pids=MappingProxyType({p.local_rank: p.pid for p in procs}),
            recovery=None if interrupted_at is None else time.monotonic() - interrupted_at,
        )
        return True
