"""How an agent publishes its events and keeps its metrics.

How it works: :class:`AgentPublisher` fills in what every agent event carries (role, attempt,
restarts spent, the group's state and round) and hands the event to the handler, which adds
the run, the node and the time and delivers it through its hub: the agent's events and the
rendezvous' share one subscription. It also listens to that hub to keep
:class:`~aelastic.agent.events.AgentMetrics` current, and names the reason of a membership
change (``member_lost``, ``member_left``, ``node_waiting``, ``removed``, ``closed``) for
the metrics and the logs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ...core.events import Event
from ...core.view import MembershipView
from ...rendezvous.handler import DynamicRendezvousHandler
from ..api import WorkerGroup, WorkerState
from ..events import AgentEvent, AgentMetrics, MembershipChanged, StateChanged, UnkillableWorkers
from ..processes.unkillable import WorkersUnkillable

__all__ = ["AgentPublisher", "membership_reason"]

log = logging.getLogger("aelastic.agent")


def membership_reason(view: MembershipView) -> str:
    """What a change of the group is, in one word (the first that applies)."""
    if view.closed:
        return "closed"
    if view.removed:
        return "removed"
    if view.lost_count:
        return "member_lost"
    if view.finished:
        return "member_left"
    if view.waiting:
        return "node_waiting"
    return "changed"


class AgentPublisher:
    """The agent's side of the event model.

    Args:
        handler: The rendezvous handler (its hub carries the events).
        group: The worker group (its state and round go into every event).
        role: The worker role.
    """

    def __init__(self, handler: DynamicRendezvousHandler, group: WorkerGroup, role: str) -> None:
        self._handler = handler
        self._group = group
        self._role = role
        self.attempt = 0
        self.restart_count = 0
        self.metrics = AgentMetrics()
        self._unsubscribe: Callable[[], None] | None = handler.hub.add_listener(self._count)

    def _count(self, event: Event) -> None:
        self.metrics = self.metrics.updated(event)

    def publish(self, cls: type[AgentEvent], **fields: Any) -> None:
        """Publish an event of class ``cls`` with ``fields`` and the agent's common fields."""
        self._handler.publish(
            cls(
                round=self._group.round,
                role=self._role,
                attempt=self.attempt,
                restart_count=self.restart_count,
                state=self._group.state,
                **fields,
            )
        )

    def set_state(self, state: WorkerState) -> None:
        """Move the group to ``state``; publish the change, if it is one."""
        previous = self._group.state
        self._group.state = state
        if previous is not state:
            self.publish(StateChanged, previous=previous.value)

    def membership(self, view: MembershipView, ignored: bool) -> None:
        """Publish a change of the group (``ignored``: the workers keep running)."""
        self.publish(
            MembershipChanged,
            reason=membership_reason(view),
            lost=tuple(sorted(str(n) for n in view.lost)),
            lost_count=view.lost_count,
            finished=view.finished,
            waiting=view.waiting,
            removed=view.removed,
            closed=view.closed,
            ignored=ignored,
        )

    def unkillable(self, exc: WorkersUnkillable) -> None:
        """Log and publish workers that outlived SIGKILL (the agent then leaves the job)."""
        log.warning("%s: leaving the rendezvous", exc)
        self.publish(
            UnkillableWorkers,
            pids=tuple(s.pid for s in exc.survivors),
            details=tuple(str(s) for s in exc.survivors),
            bound=exc.bound,
        )

    def close(self) -> None:
        """Stop counting (after the run's last event)."""
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
