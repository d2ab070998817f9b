"""One typed event model: what a handler, its backend and an agent report, and who hears it.

How it works: every event is a frozen dataclass, one class per kind (:class:`EventKind`),
with the fields every event has (``at``, wall-clock seconds; ``run_id``; ``node``; ``round``,
the rendezvous round or ``None`` before the first) and its own typed fields. A handler owns
one :class:`EventHub`; an agent publishes into its handler's hub, so one subscription sees
the rendezvous, the backend and the agent together. Subscribers are callbacks
(``hub.add_listener(fn)``: called synchronously where the event happens; an exception is
logged and ignored) or streams (``hub.stream()``: an async iterator, also usable as
``async with hub.stream() as events: await events.get()``). Event logs, metrics and the
console are listeners.

Backends report without knowing who listens: a retry loop calls :func:`report` with a
:class:`BackendRetry`; the handler, around each call into its backend, installs itself as
the reporter of the current context (:func:`reporting`) and fills in the run, the node and
the round. Text in an event (a reason quoting a backend error, say) is redacted before any
subscriber sees it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import enum
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType, TracebackType
from typing import Any, ClassVar

from .redact import redact

__all__ = [
    "BackendError",
    "BackendRetry",
    "Event",
    "EventHub",
    "EventKind",
    "EventStream",
    "RendezvousEvent",
    "RendezvousWaiting",
    "event_fields",
    "report",
    "reporting",
]

log = logging.getLogger("aelastic.events")

#: Fields every event has (``kind`` is a class attribute, not a field).
COMMON_FIELDS = ("at", "run_id", "node", "round")


class EventKind(str, enum.Enum):
    """What an event reports (the ``kind`` of every event class)."""

    #: The handler's request changed the run's state (:class:`RendezvousEvent`).
    TRANSITION = "transition"
    #: The handler waits for its round to complete (:class:`RendezvousWaiting`).
    WAITING = "waiting"
    #: A backend call failed and is retried (:class:`BackendRetry`).
    BACKEND_RETRY = "backend_retry"
    #: A backend call failed for good (:class:`BackendError`).
    BACKEND_ERROR = "backend_error"
    #: An agent's round completed and its ranks were assigned.
    RENDEZVOUS = "rendezvous"
    #: An agent's workers of an attempt are running.
    WORKERS_STARTED = "workers_started"
    #: An agent's workers were kept and joined a new group in place (no restart).
    WORKERS_RECOVERED = "workers_recovered"
    #: A worker exited by itself.
    WORKER_EXITED = "worker_exited"
    #: An agent's worker group changed state.
    STATE_CHANGED = "state_changed"
    #: The rendezvous group of an agent's round changed.
    MEMBERSHIP_CHANGED = "membership_changed"
    #: An agent restarts its workers (a restart spent, or a rescale).
    RESTART = "restart"
    #: An agent's exit barrier ended.
    EXIT_BARRIER = "exit_barrier"
    #: An agent's warm standbys for the next attempt are up.
    STANDBYS_READY = "standbys_ready"
    #: An agent's worker made no progress for the stall timeout (its stacks were taken).
    WORKER_STALLED = "worker_stalled"
    #: An agent read the job's first failure (its root cause, from every node's reports).
    JOB_FAILURE = "job_failure"
    #: An agent's host was set aside: it leaves the job.
    QUARANTINED = "quarantined"
    #: An agent's workers outlived SIGKILL past the bound: it gives up on them.
    UNKILLABLE = "unkillable"
    #: An agent's run ended (the last event of an agent's stream).
    FINISHED = "finished"


@dataclass(frozen=True, kw_only=True)
class Event:
    """What every event has.

    Attributes:
        at: Wall-clock time (seconds since the epoch).
        run_id: The rendezvous run id.
        node: The node that reports (``addr_pid_n``).
        round: The rendezvous round, ``None`` before this node completed one.
    """

    kind: ClassVar[EventKind]

    at: float = 0.0
    run_id: str = ""
    node: str = ""
    round: int | None = None

    @property
    def data(self) -> Mapping[str, Any]:
        """The event's own fields (and its round) as a read-only mapping."""
        return MappingProxyType({k: v for k, v in event_fields(self).items() if k not in _NOT_DATA})


_NOT_DATA = frozenset({"at", "run_id", "node", "role", "attempt", "restart_count", "state"})


def event_fields(event: Event) -> dict[str, Any]:
    """Every field of ``event`` by name (values as they are)."""
    return {f.name: getattr(event, f.name) for f in dataclasses.fields(event)}


@dataclass(frozen=True, kw_only=True)
class RendezvousEvent(Event):
    """A state transition this handler's request made.

    Attributes:
        op: The request (``join``, ``leave``, ``close``, ...).
        transition: What it changed (``add_to_participants``, ...).
    """

    kind: ClassVar[EventKind] = EventKind.TRANSITION

    op: str = ""
    transition: str = ""


@dataclass(frozen=True, kw_only=True)
class RendezvousWaiting(Event):
    """The handler asked to join and must wait (sent each time it asks).

    Attributes:
        participants: Nodes in the forming round.
        min_nodes, max_nodes: The round's bounds.
        waiting: Whether this node waits for the next round (the current one is complete).
        join_timeout_in: Seconds until this node's join times out.
        last_call_in: Seconds until the last call completes the round (``None``: no last
            call yet).
        id_wait: Set when the node waits for the run's id to be free (a job that used it
            has ended): why (``closed``, ``made with other rules``).
        id_free_in: Seconds until the id is free.
    """

    kind: ClassVar[EventKind] = EventKind.WAITING

    participants: int = 0
    min_nodes: int = 0
    max_nodes: int = 0
    waiting: bool = False
    join_timeout_in: float = 0.0
    last_call_in: float | None = None
    id_wait: str | None = None
    id_free_in: float | None = None


@dataclass(frozen=True, kw_only=True)
class BackendRetry(Event):
    """A call to the backend failed in a way that may pass; it is tried again.

    Attributes:
        backend: The backend's name (``redis``, ``http``).
        endpoint: Where it is (never with credentials).
        what: The operation that failed.
        error: Why (``connection refused``, ...).
        retry_for: Seconds the call keeps retrying before giving up.
    """

    kind: ClassVar[EventKind] = EventKind.BACKEND_RETRY

    backend: str = ""
    endpoint: str = ""
    what: str = ""
    error: str = ""
    retry_for: float = 0.0


@dataclass(frozen=True, kw_only=True)
class BackendError(Event):
    """A call to the backend failed for good (the caller gets the error).

    Attributes:
        backend: The backend's name.
        error: The error's class name and message.
    """

    kind: ClassVar[EventKind] = EventKind.BACKEND_ERROR

    backend: str = ""
    error: str = ""


# -- reporting from below (backends) ------------------------------------------------------

_reporter: contextvars.ContextVar[Callable[[Event], None] | None] = contextvars.ContextVar(
    "aelastic_event_reporter", default=None
)


def report(event: Event) -> None:
    """Hand ``event`` to the reporter of the current context, if any (never raises)."""
    reporter = _reporter.get()
    if reporter is not None:
        try:
            reporter(event)
        except Exception:
            log.exception("an event reporter failed on %s", event.kind.value)


class reporting:
    """Make ``reporter`` receive what :func:`report` is given in this context (a context
    manager; a class rather than a generator: it wraps every backend call)."""

    __slots__ = ("_reporter", "_token")

    def __init__(self, reporter: Callable[[Event], None] | None) -> None:
        self._reporter = reporter
        self._token: contextvars.Token[Callable[[Event], None] | None] | None = None

    def __enter__(self) -> None:
        self._token = _reporter.set(self._reporter)

    def __exit__(self, *exc_info: object) -> None:
        if self._token is not None:
            _reporter.reset(self._token)
            self._token = None


# -- subscribers ---------------------------------------------------------------------------


def _scrub(value: Any) -> Any:
    """``value`` with its text redacted (inside mappings, lists and tuples too)."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, Mapping):
        return {k: _scrub(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_scrub(v) for v in value)
    return value


def redacted(event: Event) -> Event:
    """``event`` with no secret in its text (the same object when there was none)."""
    changes: dict[str, Any] = {}
    for name, value in event_fields(event).items():
        if isinstance(value, str | Mapping | list | tuple):
            clean = _scrub(value)
            if clean != value:
                changes[name] = MappingProxyType(clean) if isinstance(clean, dict) else clean
    return dataclasses.replace(event, **changes) if changes else event


_END = object()


class EventStream(AsyncIterator[Event]):
    """Events of a hub as an async iterator (subscribed when made).

    Iterate it on the event loop where the events happen. It ends after an event of kind
    ``until`` (if given) or when the hub closes; ``aclose()`` (or leaving ``async with``)
    unsubscribes early.
    """

    def __init__(self, hub: EventHub, until: EventKind | None = None) -> None:
        self._hub = hub
        self._until = until
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._done = False

    def _put(self, item: object) -> None:
        self._queue.put_nowait(item)
        if isinstance(item, Event) and item.kind is self._until:
            self._queue.put_nowait(_END)

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> Event:
        if self._done:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is _END:
            await self.aclose()
            raise StopAsyncIteration
        assert isinstance(item, Event)
        return item

    async def get(self) -> Event:
        """The next event (waits for it).

        Raises:
            StopAsyncIteration: The stream ended.
        """
        return await self.__anext__()

    async def aclose(self) -> None:
        """Stop receiving events."""
        self._done = True
        self._hub.discard(self)

    async def __aenter__(self) -> EventStream:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


class EventHub:
    """Fan-out of events to callbacks and streams."""

    def __init__(self) -> None:
        self._callbacks: list[Callable[[Event], object]] = []
        self._streams: list[EventStream] = []

    def add_listener(self, callback: Callable[[Any], object]) -> Callable[[], None]:
        """Call ``callback(event)`` for every event.

        Returns:
            A function that unsubscribes ``callback``.
        """
        self._callbacks.append(callback)

        def remove() -> None:
            if callback in self._callbacks:
                self._callbacks.remove(callback)

        return remove

    def stream(self, until: EventKind | None = None) -> EventStream:
        """A new subscription as an async iterator, ending after an event of kind ``until``."""
        stream = EventStream(self, until)
        self._streams.append(stream)
        return stream

    def discard(self, stream: EventStream) -> None:
        """Forget ``stream``."""
        if stream in self._streams:
            self._streams.remove(stream)

    @property
    def listened(self) -> bool:
        """Whether anybody subscribed (events need not be made otherwise)."""
        return bool(self._callbacks or self._streams)

    def emit(self, event: Event) -> None:
        """Deliver ``event``, redacted, to every subscriber."""
        event = redacted(event)
        for callback in list(self._callbacks):
            try:
                callback(event)
            except Exception:
                log.exception("an event listener failed on %s", event.kind.value)
        for stream in list(self._streams):
            stream._put(event)

    def close(self) -> None:
        """End every stream (after the last event)."""
        for stream in list(self._streams):
            stream._put(_END)

    @contextlib.asynccontextmanager
    async def subscribed(self) -> AsyncIterator[EventStream]:
        """A stream for the duration of the block."""
        stream = self.stream()
        try:
            yield stream
        finally:
            await stream.aclose()
