"""The group of one rendezvous round, as one agent sees it: changes, finished members, barrier.

How it works: ``handler.watch()`` returns when the round's group changes (the backend wakes
it; nothing polls). :meth:`RoundGroup.observe` turns a change into a policy
:class:`~aelastic.agent.policy.Observation`, telling apart members that are gone after their
workers succeeded (the rendezvous counts members that left finished; one that died after
marking ``agent/done/<node>`` in the round's store counts too) from members that are lost.
The exit barrier is a counter: a node that succeeded marks itself done and adds one to
``agent/finished``; the one that brings it to the world size sets ``agent/all-done``, which
every finished node waits for (one key, whatever the size of the job). It gives up early
when a member is lost unfinished (the barrier can then never complete), or after the
configured timeout.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

from ..core.errors import RendezvousError
from ..core.state import NodeDesc
from ..core.store import Store
from ..core.view import MembershipView
from ..rendezvous.handler import DynamicRendezvousHandler
from ._aio import cancel_and_wait
from .policy import Action, Decision, Observation, Trigger, decide

__all__ = ["GroupChanged", "RoundGroup"]

log = logging.getLogger("aelastic.agent")

_T = TypeVar("_T")
_FINISHED_KEY = "agent/finished"
_ALL_DONE_KEY = "agent/all-done"


def _done_key(node: NodeDesc) -> str:
    return f"agent/done/{node.key}"


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

    def watch(self, since: MembershipView | None) -> asyncio.Task[MembershipView]:
        """A task returning the next change of the group that differs from ``since``."""
        return asyncio.ensure_future(self._watch(since))

    async def _watch(self, since: MembershipView | None) -> MembershipView:
        while True:
            try:
                return await self._handler.watch(0.0, since)
            except RendezvousError as exc:
                # The backend is unreachable for now: workers keep running, look again later.
                log.warning("watching the rendezvous failed (retrying): %s", exc)
                await asyncio.sleep(self._handler.settings.keep_alive_interval)

    async def observe(self, view: MembershipView) -> Observation:
        """What ``view`` means for the policy (members that left after succeeding, or died
        after marking themselves done, count as finished)."""
        finished = view.finished
        lost = view.lost_count
        peers_finished = False
        if not view.closed:
            for node in view.lost:
                if await self.store.try_get(_done_key(node)) is not None:
                    finished, lost = finished + 1, lost - 1
            peers_finished = bool(finished) or await self.store.try_get(_FINISHED_KEY) is not None
        return Observation(
            Trigger.MEMBERSHIP_CHANGED,
            closed=view.closed,
            removed=view.removed,
            lost=max(lost, 0),
            lost_finished=finished,
            waiting=view.waiting,
            peers_finished=peers_finished,
        )

    async def unless_changed(self, work: Coroutine[Any, Any, _T], restarts_left: int) -> _T:
        """Await ``work``, unless the group changes in a way that calls for action first.

        Raises:
            GroupChanged: The group changed first (``work`` is cancelled).
        """
        task = asyncio.ensure_future(work)
        since: MembershipView | None = None
        try:
            while True:
                watch = self.watch(since)
                try:
                    await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    await cancel_and_wait(watch)
                if task.done():
                    return task.result()
                since = watch.result()
                decision = decide(await self.observe(since), restarts_left)
                if decision.action is not Action.CONTINUE:
                    raise GroupChanged(decision)
        finally:
            await cancel_and_wait(task)

    async def exit_barrier(self, node: NodeDesc, world_size: int, timeout: float) -> bool:
        """Mark this node done, then wait for every member; whether all of them were done.

        Returns early (``False``) when a member is lost without being done, this node was
        removed, or the run closed before everybody was done.

        Raises:
            RendezvousError: The store failed.
        """
        await self.store.set(_done_key(node), b"1")
        if await self.store.add(_FINISHED_KEY, 1) >= world_size:
            await self.store.set(_ALL_DONE_KEY, b"1")
        keys = [_ALL_DONE_KEY]
        waiting = asyncio.ensure_future(self.store.wait(keys, timeout))
        since: MembershipView | None = None
        try:
            while True:
                watch = self.watch(since)
                try:
                    await asyncio.wait({waiting, watch}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    await cancel_and_wait(watch)
                if waiting.done():
                    return waiting.exception() is None
                since = watch.result()
                observation = await self.observe(since)
                if observation.closed or observation.removed or observation.lost:
                    return await self.store.check(keys)  # unless it already is complete
        finally:
            await cancel_and_wait(waiting)
