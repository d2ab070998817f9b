"""The group of one rendezvous round, as one agent sees it: changes, finished members, barrier.

How it works: ``handler.watch()`` returns when the round's group changes (the backend wakes
it; nothing polls). A step of the agent that must not outlive a change calling for action
(the exit barrier) races it with :func:`~aelastic.core.race.first_of`: one anyio task group,
the loser cancelled. :meth:`RoundGroup.observe` turns a change into a policy
:class:`~aelastic.agent.loop.policy.Observation`, telling apart members that are gone after their
workers succeeded (they left finished, or said they were done before they died: the
rendezvous counts both as finished) from members that are lost. The exit barrier is kept by
the rendezvous itself: a node that succeeded says so (``handler.mark_done()``, a request
only it can make for itself) and waits until the status says every member did
(:attr:`~aelastic.core.state.Status.all_done`); it gives up early when a member is lost
unfinished (the barrier can then never complete), or after the configured timeout. Nothing
here reads the members' store, which any store client can write.
"""

from __future__ import annotations

import logging
from typing import TypeVar

import anyio

from ...core.errors import RendezvousError, RendezvousLostError, reason
from ...core.store import Store
from ...core.view import MembershipView
from ...rendezvous.handler import DynamicRendezvousHandler
from .policy import Observation, Trigger

__all__ = ["RoundGroup"]

log = logging.getLogger("aelastic.agent")

_T = TypeVar("_T")
#: Seconds the exit barrier's last look at the rendezvous may take once its time is up.
_LAST_LOOK = 1.0


class RoundGroup:
    """The members of one completed round and what this node knows of them.

    Args:
        handler: The rendezvous handler (its last ``next_rendezvous`` made the round).
        store: The round's store.
    """

    def __init__(self, handler: DynamicRendezvousHandler, store: Store) -> None:
        self._handler = handler
        self.store = store
        #: The round's number.
        self.round = handler.round

    async def failed_elsewhere(self) -> bool:
        """Whether the job's health names another node's worker the root cause of this
        round (a failure of its own, not one broken in a collective): that node's agent
        acted, and the group change that follows is on its way. False when the health
        cannot be read within :data:`_LAST_LOOK` seconds."""
        with anyio.move_on_after(_LAST_LOOK):
            try:
                health = await self._handler.health()
            except RendezvousError:
                return False
            latest = None if health is None else health.latest
            return (
                latest is not None
                and latest.round == self.round
                and not latest.root.secondary
                and latest.root.node != self._handler.node.key
            )
        return False

    async def next_change(self, since: MembershipView | None) -> MembershipView:
        """The next change of the group that differs from ``since`` (an unreachable backend
        is looked at again later: the workers keep running meanwhile).

        Raises:
            RendezvousLostError: The rendezvous is gone for good (its hosting node died).
        """
        while True:
            try:
                return await self._handler.watch(0.0, since)
            except RendezvousLostError:
                raise
            except RendezvousError as exc:
                log.warning("watching the rendezvous failed (retrying): %s", reason(exc))
                await anyio.sleep(self._handler.settings.keep_alive_interval)

    async def observe(self, view: MembershipView) -> Observation:
        """What ``view`` means for the policy (members that left after succeeding, or died
        after saying they were done, count as finished: the rendezvous counts them so)."""
        return Observation(
            Trigger.MEMBERSHIP_CHANGED,
            closed=view.closed,
            removed=view.removed,
            lost=view.lost_count,
            lost_finished=view.finished,
            waiting=view.waiting,
            peers_finished=bool(view.finished or view.done),
        )

    async def loss_within(self, grace: float) -> Observation | None:
        """The first change of the group within ``grace`` seconds that explains a broken
        collective (a member lost, this node removed, the run closed), or ``None``.

        A worker whose collective broke when a peer was lost fails before the rendezvous
        has declared the peer lost (its heartbeat window): waiting for that tells a peer's
        loss from this node's own failure.
        """

        async def explained() -> Observation:
            since: MembershipView | None = None
            while True:
                since = await self.next_change(since)
                observation = await self.observe(since)
                if observation.lost or observation.removed or observation.closed:
                    return observation

        with anyio.move_on_after(grace):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(self.report_departures)
                found = await explained()
                tasks.cancel_scope.cancel()
            return found
        return None

    async def report_departures(self) -> None:
        """Have the backend report the members whose connections ended, where it can tell
        (a worker's collective broke: a peer may be gone)."""
        if lost := await self._handler.report_departures():
            log.info("%d member(s) lost: their connections to the rendezvous ended", lost)

    async def exit_barrier(self, limit: float) -> bool:
        """Say this node is done, then wait for every member; whether all of them were done.

        Returns early (``False``) when a member is lost without being done, this node was
        removed, or the run closed before everybody was done, and after ``limit`` seconds
        (plus a second for a last look, whatever the rendezvous is doing).

        Raises:
            RendezvousError: The rendezvous failed.
        """
        with anyio.move_on_after(limit):
            if await self._wait_for_all():
                return True
        with anyio.move_on_after(_LAST_LOOK):
            await self._handler.is_closed()  # a status request: the status as it is now
            status = self._handler.status
            return status is not None and status.all_done and status.round == self.round
        return False

    async def _wait_for_all(self) -> bool:
        await self._handler.mark_done()

        async def settled() -> bool:
            since: MembershipView | None = None
            while True:
                since = await self.next_change(since)
                if since.all_done:
                    return True
                if since.closed or since.removed or since.lost_count:
                    return False

        return await settled()
