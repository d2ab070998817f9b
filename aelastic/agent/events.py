"""Events and metrics of an agent: what happened, when, and how long it took.

How it works: the agent publishes one typed event (a frozen dataclass of the model in
:mod:`aelastic.core.events`) at every step of its life: a rendezvous round completed, workers
started, a worker exited, the group changed state, a restart or rescale was decided, the exit
barrier, the end. They go into its handler's :class:`~aelastic.core.events.EventHub`, with
the handler's own events (transitions, waits, backend retries), so one subscription sees
everything: ``agent.add_listener(fn)`` (called on the agent's loop; an exception in a
callback is logged and ignored) or ``agent.events()`` (a stream that ends with the run's
:class:`Finished`). :class:`AgentMetrics` keeps running counters and the last durations,
readable at any time from ``agent.metrics``. Text in an event (a reason quoting a backend
error, say) is redacted before anyone sees it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import ClassVar

from ..core.events import Event, EventHub, EventKind, EventStream
from .api import WorkerState

__all__ = [
    "AgentEvent",
    "AgentMetrics",
    "EventBus",
    "EventKind",
    "EventStream",
    "ExitBarrier",
    "Finished",
    "JobFailure",
    "MembershipChanged",
    "Quarantined",
    "RendezvousCompleted",
    "Restart",
    "StandbysReady",
    "StateChanged",
    "UnkillableWorkers",
    "WorkerExited",
    "WorkerStalled",
    "WorkersRecovered",
    "WorkersStarted",
]

#: The former name of :class:`~aelastic.core.events.EventHub`.
EventBus = EventHub

_NO_PIDS: Mapping[int, int] = MappingProxyType({})


@dataclass(frozen=True, kw_only=True)
class AgentEvent(Event):
    """What every event of an agent has, besides the common fields.

    Attributes:
        role: The worker role.
        attempt: Number of the attempt (0 for the first start of workers, +1 per start).
        restart_count: Restarts spent so far (``TORCHELASTIC_RESTART_COUNT``).
        state: The worker group's state after the event.
    """

    role: str = ""
    attempt: int = 0
    restart_count: int = 0
    state: WorkerState = WorkerState.INIT


@dataclass(frozen=True, kw_only=True)
class RendezvousCompleted(AgentEvent):
    """A round completed and the ranks were assigned (``duration``: seconds for both)."""

    kind: ClassVar[EventKind] = EventKind.RENDEZVOUS

    group_rank: int = 0
    group_world_size: int = 0
    world_size: int = 0
    duration: float = 0.0


@dataclass(frozen=True, kw_only=True)
class WorkersStarted(AgentEvent):
    """The workers of an attempt run: ``pids`` by local rank, ``duration`` to spawn them,
    ``recovery`` seconds since the earliest sign of what ended the previous attempt (a
    worker failing or saying its collective broke, else this node learning that the group
    changed; ``None`` first)."""

    kind: ClassVar[EventKind] = EventKind.WORKERS_STARTED

    pids: Mapping[int, int] = field(default_factory=lambda: _NO_PIDS)
    duration: float = 0.0
    recovery: float | None = None


@dataclass(frozen=True, kw_only=True)
class WorkersRecovered(AgentEvent):
    """The workers were kept and sent the ranks of a new group (in-place recovery, no
    restart): ``pids`` by local rank (unchanged), ``recovery`` seconds since the earliest
    sign of what interrupted them."""

    kind: ClassVar[EventKind] = EventKind.WORKERS_RECOVERED

    pids: Mapping[int, int] = field(default_factory=lambda: _NO_PIDS)
    recovery: float | None = None


@dataclass(frozen=True, kw_only=True)
class WorkerExited(AgentEvent):
    """A worker exited by itself."""

    kind: ClassVar[EventKind] = EventKind.WORKER_EXITED

    local_rank: int = 0
    global_rank: int = 0
    pid: int = 0
    exitcode: int = 0


@dataclass(frozen=True, kw_only=True)
class StateChanged(AgentEvent):
    """The worker group changed state (``previous``: the old state's value)."""

    kind: ClassVar[EventKind] = EventKind.STATE_CHANGED

    previous: str = ""


@dataclass(frozen=True, kw_only=True)
class MembershipChanged(AgentEvent):
    """The rendezvous group changed.

    Attributes:
        reason: ``member_lost``, ``member_left`` (its workers finished), ``node_waiting``,
            ``removed`` or ``closed``.
        lost: Names of lost members (a sample); ``lost_count`` how many.
        ignored: The agent decided to keep its workers running.
    """

    kind: ClassVar[EventKind] = EventKind.MEMBERSHIP_CHANGED

    reason: str = ""
    lost: tuple[str, ...] = ()
    lost_count: int = 0
    finished: int = 0
    waiting: int = 0
    removed: bool = False
    closed: bool = False
    ignored: bool = False


@dataclass(frozen=True, kw_only=True)
class Restart(AgentEvent):
    """Workers are restarted: ``spent`` a restart (a failure) or not (a rescale)."""

    kind: ClassVar[EventKind] = EventKind.RESTART

    reason: str = ""
    spent: bool = False
    restarts_left: int = 0


@dataclass(frozen=True, kw_only=True)
class ExitBarrier(AgentEvent):
    """The exit barrier ended (``complete``: every member succeeded)."""

    kind: ClassVar[EventKind] = EventKind.EXIT_BARRIER

    duration: float = 0.0
    complete: bool = False


@dataclass(frozen=True, kw_only=True)
class StandbysReady(AgentEvent):
    """Warm standbys for the next attempt are up (``pids`` by local rank)."""

    kind: ClassVar[EventKind] = EventKind.STANDBYS_READY

    pids: Mapping[int, int] = field(default_factory=lambda: _NO_PIDS)


@dataclass(frozen=True, kw_only=True)
class WorkerStalled(AgentEvent):
    """A worker made no progress for the stall timeout; its stacks were taken.

    Attributes:
        host: This node's address.
        steps: Progress it reported; ``idle`` seconds since the last.
        where: The main thread's innermost frame; ``user_where`` the innermost one in the
            user's code (``""`` when the same or unknown).
        in_collective: It waits inside ``torch.distributed``.
        stopped: Its process is stopped (``SIGSTOP``, a debugger): no stacks could be taken.
        waiting_for_peer: The node waits one more timeout (at least 6 s; at start-up up to
            a minute) for the peer at fault (all its stalled workers wait in collectives)
            before stopping them.
        phase: What the worker was watched for: ``startup`` (no step yet: the start-up
            bound), ``learning`` (the start-up bound from its last step: not learned yet),
            ``learned`` (the bound learned from the step times) or ``fixed`` (a number).
        bound: That bound (seconds).
        stacks_file: Where the stacks were written (``""``: no log directory).
        stacks: The stacks (bounded).
    """

    kind: ClassVar[EventKind] = EventKind.WORKER_STALLED

    local_rank: int = 0
    global_rank: int = 0
    pid: int = 0
    host: str = ""
    steps: int = 0
    idle: float = 0.0
    where: str = ""
    user_where: str = ""
    in_collective: bool = False
    stopped: bool = False
    waiting_for_peer: bool = False
    phase: str = "fixed"
    bound: float = 0.0
    stacks_file: str = ""
    stacks: str = ""


@dataclass(frozen=True, kw_only=True)
class JobFailure(AgentEvent):
    """The job's first failure as the rendezvous store says (the same on every node).

    Attributes:
        root: The root cause of the newest incident (a failure record's JSON form).
        failed_nodes: Nodes whose workers failed in that round.
        incidents: Incidents of the job so far; ``job_max_restarts`` its budget (or ``None``).
        quarantined: Hosts set aside.
        budget_spent: The job spent its job-wide budget: it stops.
    """

    kind: ClassVar[EventKind] = EventKind.JOB_FAILURE

    root: Mapping[str, object] = field(default_factory=lambda: MappingProxyType({}))
    failed_nodes: int = 0
    incidents: int = 0
    job_max_restarts: int | None = None
    quarantined: tuple[str, ...] = ()
    budget_spent: bool = False


@dataclass(frozen=True, kw_only=True)
class Quarantined(AgentEvent):
    """This node's host was set aside (``reason``); the agent leaves the job."""

    kind: ClassVar[EventKind] = EventKind.QUARANTINED

    host: str = ""
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class UnkillableWorkers(AgentEvent):
    """Workers outlived SIGKILL by ``bound`` seconds: ``details`` (pid, state, kernel wait)
    of each; the agent leaves the rendezvous and ends."""

    kind: ClassVar[EventKind] = EventKind.UNKILLABLE

    pids: tuple[int, ...] = ()
    details: tuple[str, ...] = ()
    bound: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Finished(AgentEvent):
    """The run ended (the last event of an agent's stream)."""

    kind: ClassVar[EventKind] = EventKind.FINISHED

    reason: str = ""


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

    def updated(self, event: Event) -> AgentMetrics:
        """The metrics after ``event``."""
        if isinstance(event, RendezvousCompleted):
            return replace(
                self,
                rendezvous_count=self.rendezvous_count + 1,
                last_rendezvous_duration=event.duration,
                total_rendezvous_duration=self.total_rendezvous_duration + event.duration,
            )
        if isinstance(event, WorkersStarted):
            recovery = event.recovery
            return replace(
                self,
                worker_starts=self.worker_starts + 1,
                last_recovery_duration=self.last_recovery_duration
                if recovery is None
                else recovery,
            )
        if isinstance(event, Restart):
            if event.spent:
                return replace(self, restarts=self.restarts + 1)
            return replace(self, rescales=self.rescales + 1)
        if isinstance(event, ExitBarrier):
            return replace(self, exit_barrier_duration=event.duration)
        return self
