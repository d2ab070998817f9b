"""Events and metrics of an agent: what happened, when, and how long it took.

How it works: the agent emits an :class:`AgentEvent` at every step of its life (a
rendezvous round completed, workers started, a worker exited, the group changed state, a
restart or rescale was decided, the exit barrier, the end). Subscribers are either plain
callbacks (``agent.add_listener(fn)``, called synchronously on the agent's event loop; an
exception in a callback is logged and ignored) or async iterators (``agent.events()``, a
stream that ends when the run ends). :class:`AgentMetrics` keeps running counters and the
last durations, readable at any time from ``agent.metrics``. Text in an event's data (a
reason quoting a backend error, say) is redacted before anyone sees it: no password of an
endpoint and no ``password=``/``token=`` value reaches a subscriber or a log.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from ..core.redact import redact
from .api import WorkerState

__all__ = ["AgentEvent", "AgentMetrics", "EventBus", "EventKind", "EventStream"]

log = logging.getLogger("aelastic.agent")

_EMPTY: Mapping[str, Any] = MappingProxyType({})


class EventKind(str, enum.Enum):
    """What an :class:`AgentEvent` reports; the keys of ``AgentEvent.data`` follow."""

    #: A rendezvous round completed: ``round``, ``group_rank``, ``group_world_size``,
    #: ``world_size``, ``duration`` (seconds spent in the rendezvous and rank assignment).
    RENDEZVOUS = "rendezvous"
    #: The workers of an attempt are running: ``pids`` (by local rank), ``duration``
    #: (seconds to spawn them), ``recovery`` (seconds since the event that stopped the
    #: previous attempt, absent for the first attempt).
    WORKERS_STARTED = "workers_started"
    #: A worker exited by itself: ``local_rank``, ``global_rank``, ``pid``, ``exitcode``.
    WORKER_EXITED = "worker_exited"
    #: The worker group changed state: ``previous`` (the old state's value).
    STATE_CHANGED = "state_changed"
    #: The rendezvous group changed: ``lost`` (node ids), ``waiting``, ``removed``,
    #: ``closed``, ``ignored`` (true when the agent decided to keep running).
    MEMBERSHIP_CHANGED = "membership_changed"
    #: Workers are being restarted: ``reason``, ``spent`` (whether a restart was spent),
    #: ``restarts_left``.
    RESTART = "restart"
    #: The exit barrier ended: ``duration``, ``complete`` (every member succeeded).
    EXIT_BARRIER = "exit_barrier"
    #: Warm standbys for the next attempt are up: ``pids`` (by local rank).
    STANDBYS_READY = "standbys_ready"
    #: The run ended (the last event of a stream): ``reason``.
    FINISHED = "finished"


@dataclass(frozen=True)
class AgentEvent:
    """One thing that happened in an agent.

    Attributes:
        kind: What happened.
        at: Wall-clock time (``time.time()``).
        role: The worker role.
        run_id: The rendezvous run id.
        attempt: Number of the attempt (0 for the first start of workers, +1 per start).
        restart_count: Restarts spent so far (``TORCHELASTIC_RESTART_COUNT``).
        state: The worker group's state after the event.
        data: Details; see :class:`EventKind` for the keys of each kind.
    """

    kind: EventKind
    at: float
    role: str
    run_id: str
    attempt: int
    restart_count: int
    state: WorkerState
    data: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)


@dataclass(frozen=True)
class AgentMetrics:
    """Counters and last durations of an agent (a snapshot; seconds)."""

    rendezvous_count: int = 0
    last_rendezvous_duration: float | None = None
    total_rendezvous_duration: float = 0.0
    worker_starts: int = 0
    restarts: int = 0
    rescales: int = 0
    last_recovery_duration: float | None = None
    exit_barrier_duration: float | None = None

    def updated(self, event: AgentEvent) -> AgentMetrics:
        """The metrics after ``event``."""
        data = event.data
        if event.kind is EventKind.RENDEZVOUS:
            duration = float(data.get("duration", 0.0))
            return replace(
                self,
                rendezvous_count=self.rendezvous_count + 1,
                last_rendezvous_duration=duration,
                total_rendezvous_duration=self.total_rendezvous_duration + duration,
            )
        if event.kind is EventKind.WORKERS_STARTED:
            recovery = data.get("recovery")
            return replace(
                self,
                worker_starts=self.worker_starts + 1,
                last_recovery_duration=(
                    self.last_recovery_duration if recovery is None else float(recovery)
                ),
            )
        if event.kind is EventKind.RESTART:
            if data.get("spent"):
                return replace(self, restarts=self.restarts + 1)
            return replace(self, rescales=self.rescales + 1)
        if event.kind is EventKind.EXIT_BARRIER:
            return replace(self, exit_barrier_duration=float(data.get("duration", 0.0)))
        return self


def _scrub(value: Any) -> Any:
    """``value`` with its text redacted (inside mappings, lists and tuples too)."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, Mapping):
        return {k: _scrub(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_scrub(v) for v in value)
    return value


def _redacted(event: AgentEvent) -> AgentEvent:
    """``event`` with no secret in its data (the same object when there was none)."""
    data = {k: _scrub(v) for k, v in event.data.items()}
    if data == dict(event.data):
        return event
    return replace(event, data=MappingProxyType(data))


_END = object()


class EventStream(AsyncIterator[AgentEvent]):
    """Events of one agent as an async iterator; ends after the ``FINISHED`` event.

    Iterate it on the event loop that runs the agent. ``aclose()`` unsubscribes early.
    """

    def __init__(self, bus: EventBus) -> None:
        self._bus = bus
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._done = False

    def _put(self, item: object) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> AgentEvent:
        if self._done:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is _END:
            await self.aclose()
            raise StopAsyncIteration
        assert isinstance(item, AgentEvent)
        return item

    async def aclose(self) -> None:
        """Stop receiving events."""
        self._done = True
        self._bus.discard(self)


class EventBus:
    """Fan-out of agent events to callbacks and streams, with running metrics."""

    def __init__(self) -> None:
        self._callbacks: list[Callable[[AgentEvent], object]] = []
        self._streams: list[EventStream] = []
        self.metrics = AgentMetrics()

    def add_listener(self, callback: Callable[[AgentEvent], object]) -> Callable[[], None]:
        """Call ``callback(event)`` for every event; returns a function that unsubscribes."""
        self._callbacks.append(callback)

        def remove() -> None:
            if callback in self._callbacks:
                self._callbacks.remove(callback)

        return remove

    def stream(self) -> EventStream:
        """A new subscription as an async iterator (subscribed from now on)."""
        stream = EventStream(self)
        self._streams.append(stream)
        return stream

    def discard(self, stream: EventStream) -> None:
        """Forget ``stream``."""
        if stream in self._streams:
            self._streams.remove(stream)

    def emit(self, event: AgentEvent) -> None:
        """Deliver ``event``, redacted, to every subscriber."""
        event = _redacted(event)
        self.metrics = self.metrics.updated(event)
        for callback in list(self._callbacks):
            try:
                callback(event)
            except Exception:
                log.exception("an agent event listener failed on %s", event.kind.value)
        for stream in list(self._streams):
            stream._put(event)

    def close(self) -> None:
        """End every stream (after the last event)."""
        for stream in list(self._streams):
            stream._put(_END)


def wall_time() -> float:
    """Wall-clock seconds, for event timestamps."""
    return time.time()
