"""The group of one rendezvous round, as one agent sees it: changes, finished members, barrier.

How it works: ``handler.watch()`` returns when the round's group changes (the backend wakes
it; nothing polls). A step of the agent that must not outlive a change calling for action
(the rank exchange, the exit barrier) races it with :func:`~aelastic.core.race.first_of`:
one anyio task group, the loser cancelled. :meth:`RoundGroup.observe` turns a change into a policy
:class:`~aelastic.agent.policy.Observation`, telling apart members that are gone after their
workers succeeded (the rendezvous counts members that left finished; one that died after
marking ``agent/done/<node>`` in the round's store counts too) from members that are lost,
and among those, members that said they leave to restart or rescale
(``agent/leaving/<node>``, :meth:`RoundGroup.mark_leaving`) from hosts really lost (gone
silent, killed): only these count towards ``--quarantine-after``.
The exit barrier is a counter: a node that succeeded marks itself done and adds one to
``agent/finished``; the one that brings it to the world size sets ``agent/all-done``, which
every finished node waits for (one key, whatever the size of the job). It gives up early
when a member is lost unfinished (the barrier can then never complete), or after the
configured timeout.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from typing import TypeVar

import anyio

from ..core.errors import RendezvousError, RendezvousLostError, reason
from ..core.race import first_of
from ..core.state import NodeDesc
from ..core.store import Store
from ..core.view import MembershipView
from ..rendezvous.handler import DynamicRendezvousHandler
from .policy import Action, Decision, Observation, Trigger, decide

__all__ = ["GroupChanged", "RoundGroup"]

log = logging.getLogger("aelastic.agent")

_T = TypeVar("_T")
_FINISHED_KEY = "agent/finished"
_ALL_DONE_KEY = "agent/all-done"
#: Seconds the exit barrier's last look at the store may take once its time is up.
_LAST_LOOK = 1.0


def _done_key(node: NodeDesc) -> str:
    return f"agent/done/{node.key}"


def _leaving_key(node: NodeDesc) -> str:
    return f"agent/leaving/{node.key}"


class GroupChanged(Exception):
    """The group changed in a way that needs action while the agent was busy with a step."""

    def __init__(self, decision: Decision) -> None:
        super().__init__(decision.reason)
        self.decision = decision


class RoundGroup:
    """The members of one completed round and what this node knows of them.

    Args:
        handler: The rendezvous handler (its last ``next_rendezvous`` made the round).
        store: The round's store.
    """

    def __init__(self, handler: DynamicRendezvousHandler, store: Store) -> None:
        self._handler = handler
        self.store = store

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
        after marking themselves done, count as finished)."""
        finished = view.finished
        lost = view.lost_count
        peers_finished = False
        gone: list[str] = []
        if not view.closed:
            for node in view.lost:
                if await self.store.try_get(_done_key(node)) is not None:
                    finished, lost = finished + 1, lost - 1
                elif await self.store.try_get(_leaving_key(node)) is None:
                    gone.append(node.addr)
            peers_finished = bool(finished) or await self.store.try_get(_FINISHED_KEY) is not None
        return Observation(
            Trigger.MEMBERSHIP_CHANGED,
            closed=view.closed,
            removed=view.removed,
            lost=max(lost, 0),
            lost_finished=finished,
            waiting=view.waiting,
            peers_finished=peers_finished,
            lost_hosts=tuple(sorted(set(gone))),
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

    async def mark_leaving(self, node: NodeDesc) -> None:
        """Say that ``node`` leaves the round to restart or rescale (it is not lost)."""
        await self.store.set(_leaving_key(node), b"1")

    async def unless_changed(self, work: Awaitable[_T], restarts_left: int) -> _T:
        """Await ``work``, unless the group changes in a way that calls for action first.

        Raises:
            GroupChanged: The group changed first (``work`` is cancelled).
        """

        async def calling_for_action() -> Decision:
            since: MembershipView | None = None
            while True:
                since = await self.next_change(since)
                decision = decide(await self.observe(since), restarts_left)
                if decision.action is not Action.CONTINUE:
                    return decision

        index, value = await first_of(lambda: work, calling_for_action)
        if index == 1:
            raise GroupChanged(value)
        result: _T = value
        return result

    async def exit_barrier(self, node: NodeDesc, world_size: int, limit: float) -> bool:
        """Mark this node done, then wait for every member; whether all of them were done.

        Returns early (``False``) when a member is lost without being done, this node was
        removed, or the run closed before everybody was done, and after ``limit`` seconds
        (plus a second for a last look, whatever the store is doing).

        Raises:
            RendezvousError: The store failed.
        """
        keys = [_ALL_DONE_KEY]
        with anyio.move_on_after(limit):
            if await self._wait_for_all(node, world_size, limit):
                return True
        with anyio.move_on_after(_LAST_LOOK):
            return await self.store.check(keys)  # unless it already is complete
        return False

    async def _wait_for_all(self, node: NodeDesc, world_size: int, limit: float) -> bool:
        await self.store.set(_done_key(node), b"1")
        if await self.store.add(_FINISHED_KEY, 1) >= world_size:
            await self.store.set(_ALL_DONE_KEY, b"1")
        keys = [_ALL_DONE_KEY]

        async def all_done() -> bool:
            try:
                await self.store.wait(keys, limit + 1.0)  # the deadline below comes first
            except Exception:  # the store failed: not everybody is known to be done
                return False
            return True

        async def cannot_complete() -> None:
            since: MembershipView | None = None
            while True:
                since = await self.next_change(since)
                observation = await self.observe(since)
                if observation.closed or observation.removed or observation.lost:
                    return

        index, done = await first_of(all_done, cannot_complete)
        return index == 0 and bool(done)
