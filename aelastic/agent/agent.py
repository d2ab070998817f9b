"""The elastic agent (work in progress: the public surface is final)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from .api import DEFAULT_ROLE, RunResult, WorkerGroup, WorkerSpec
from .events import AgentEvent, AgentMetrics, EventBus, EventStream

__all__ = ["ElasticAgent"]


class ElasticAgent:
    """Runs the workers of one node under an elastic rendezvous (torch's ``LocalElasticAgent``).

    Args:
        spec: What to run and how.
    """

    def __init__(self, spec: WorkerSpec) -> None:
        self._spec = spec
        self._group = WorkerGroup(spec)
        self._bus = EventBus()

    @property
    def spec(self) -> WorkerSpec:
        """The spec this agent runs."""
        return self._spec

    @property
    def metrics(self) -> AgentMetrics:
        """Counters and durations so far (a snapshot)."""
        return self._bus.metrics

    def get_worker_group(self, role: str = DEFAULT_ROLE) -> WorkerGroup:
        """The current worker group (torch's accessor; ``role`` is accepted and ignored)."""
        return self._group

    def add_listener(self, callback: Callable[[AgentEvent], object]) -> Callable[[], None]:
        """Call ``callback(event)`` on the agent's loop for every event; returns an unsubscriber."""
        return self._bus.add_listener(callback)

    def events(self) -> EventStream:
        """Subscribe now; iterate the events with ``async for`` until the run ends."""
        return self._bus.stream()

    async def run(self, role: str = DEFAULT_ROLE) -> RunResult:
        """Run the workers until they succeed, fail for good, or this call is cancelled."""
        raise NotImplementedError("ElasticAgent.run is being written")

    def run_sync(self, role: str = DEFAULT_ROLE) -> RunResult:
        """Blocking :meth:`run` on a private event loop (for plain scripts)."""
        return asyncio.run(self.run(role))
